"""CPU feature detection: /proc/cpuinfo parsing, the fallback without it, presets and DEEPSERVE_CPU_ISA."""

import logging

import pytest

from deepserve.kernels.cpu import isa

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 fma avx f16c avx2 bmi2 sha_ni

processor\t: 1
model name\t: some other core
flags\t\t: fpu avx512f avx512_vnni
"""
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: fpu sse avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx_vnni amx_tile amx_int8 amx_bf16
"""
GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp
"""


def test_parse_zen3_reads_the_first_processor_only():
    cpu = isa.parse_cpuinfo(ZEN3)
    assert cpu.model == "AMD EPYC 7B13 64-Core Processor" and cpu.source == "/proc/cpuinfo"
    assert cpu.has("avx2") and not cpu.has("avx512f") and not cpu.int8_dot
    assert "bmi2" not in cpu.vector_flags() and "avx2" in cpu.vector_flags()


def test_parse_sapphire_rapids_and_arm():
    spr = isa.parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert spr.int8_dot and spr.has("amx_int8")
    arm = isa.parse_cpuinfo(GRAVITON)
    assert arm.has("asimd") and not arm.int8_dot and arm.vector_flags() == []
    assert isa.parse_cpuinfo("processor : 0\nmodel name : x\n") is None


def test_missing_cpuinfo_falls_back_to_torch_without_int8_dot(tmp_path):
    cpu = isa.read(tmp_path / "no_cpuinfo")
    assert cpu.source.startswith("torch capability") and not cpu.int8_dot   # VNNI unknown: the safe side
    assert isa.read(tmp_path / "no_cpuinfo") == cpu


@pytest.mark.parametrize("name,int8_dot,avx512", [("avx2", False, False), ("avx_vnni", True, False),
                                                  ("avx512", False, True), ("avx512_vnni", True, True),
                                                  ("amx", True, True)])
def test_presets(name, int8_dot, avx512):
    cpu = isa.preset(name)
    assert cpu.int8_dot == int8_dot and cpu.has("avx512f") == avx512 and cpu.has("avx2")


def test_restrict_removes_flags_and_never_adds_any(caplog):
    spr = isa.parse_cpuinfo(SAPPHIRE_RAPIDS)
    as_avx2 = isa.restrict(spr, "avx2")
    assert as_avx2.has("avx2") and not as_avx2.has("avx512f") and not as_avx2.int8_dot
    assert as_avx2.has("fpu") and as_avx2.model == spr.model     # non-vector flags and the name are kept
    zen3 = isa.parse_cpuinfo(ZEN3)
    with caplog.at_level(logging.WARNING, logger="deepserve.kernels.cpu.isa"):
        as_amx = isa.restrict(zen3, "amx")
    assert as_amx.flags == zen3.flags and not as_amx.int8_dot
    assert "amx_int8" in caplog.text
    with pytest.raises(ValueError, match="preset"):
        isa.restrict(spr, "sse9")


def test_current_follows_the_environment(monkeypatch):
    monkeypatch.delenv("DEEPSERVE_CPU_ISA", raising=False)
    assert isa.current() == isa.host()
    monkeypatch.setenv("DEEPSERVE_CPU_ISA", "avx2")
    forced = isa.current()
    assert not forced.int8_dot and not forced.has("avx512f") and forced.flags <= isa.host().flags
    monkeypatch.setenv("DEEPSERVE_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="DEEPSERVE_CPU_ISA"):
        isa.current()


def test_host_json_names_the_model_and_flags():
    record = isa.host().to_json()
    assert record["model"] and isinstance(record["isa_flags"], list)
    assert record["int8_dot_product"] == bool(set(record["isa_flags"]) & isa.INT8_DOT_FLAGS)


@pytest.mark.parametrize("cpuinfo,setting,expected", [
    (SAPPHIRE_RAPIDS, "", ()),                                           # the build's own width (16)
    (SAPPHIRE_RAPIDS, "avx2", ("ATTN_LANES=8", "LINEAR_LANES=8")),      # held to AVX2: the AVX2 build
    (SAPPHIRE_RAPIDS, "avx512_vnni", ()),
    (ZEN3, "", ()),                                                      # builds 8 wide by itself
    (ZEN3, "avx2", ()),
])
def test_vector_width_defines_follow_the_preset(monkeypatch, cpuinfo, setting, expected):
    """A run held to AVX2 on an AVX-512 CPU builds the generic-vector C kernels at AVX2's width."""
    monkeypatch.setattr(isa, "host", lambda: isa.parse_cpuinfo(cpuinfo))
    monkeypatch.setenv("DEEPSERVE_CPU_ISA", setting)
    assert isa.vector_width_defines() == expected
