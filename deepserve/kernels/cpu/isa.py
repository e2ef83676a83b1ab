"""What this CPU can do: its model name and vector-ISA flags, read once, for choosing kernels.

The same instruction set does not mean the same fast kernels: torch's int8 GEMM (`torch._int_mm`, oneDNN) is
1.8-3.6x faster than fp32 where the CPU has an int8 dot-product instruction (AVX-512 VNNI, AVX-VNNI, AMX) and
was measured 2.7-20x slower on an AVX2-only AMD Zen 3. Callers key their choice on `CpuFeatures`, a plain value:
tests pass made-up feature sets (`preset`) instead of reading the host.

DEEPSERVE_CPU_ISA=<preset> makes `current()` report that preset (less whatever this CPU lacks), e.g. to run
what an AVX2-only host would run on this one.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

from deepserve import envs

logger = logging.getLogger(__name__)

# Flag names as Linux's /proc/cpuinfo spells them; the ones kernel choices key on.
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
_VECTOR_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c")

_AVX2 = frozenset({"sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
_VNNI = _AVX512 | {"avx512_vnni"}
PRESETS: dict[str, frozenset[str]] = {
    "avx2": _AVX2,                                               # Haswell .. Zen 3
    "avx_vnni": _AVX2 | {"avx_vnni"},                            # Alder Lake-class cores without AVX-512
    "avx512": _AVX512,                                           # Skylake-SP: AVX-512 without VNNI
    "avx512_vnni": _VNNI,                                        # Cascade Lake .. Ice Lake, Zen 4
    "amx": _VNNI | {"avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},   # Sapphire Rapids and later
}


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    flags: frozenset[str]
    source: str          # where the flags came from: /proc/cpuinfo, torch's capability, a preset, ...

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def int8_dot(self) -> bool:
        """An instruction that multiplies int8 pairs and sums them into int32 lanes (VNNI, AMX)."""
        return bool(self.flags & INT8_DOT_FLAGS)

    def vector_flags(self) -> list[str]:
        return sorted(f for f in self.flags if f.startswith(_VECTOR_PREFIXES))

    def to_json(self) -> dict:
        """What benchmarks record: the model name and the vector-ISA flags (not the whole flags line)."""
        return {"model": self.model, "isa_flags": self.vector_flags(), "int8_dot_product": self.int8_dot,
                "source": self.source}


def preset(name: str, model: str = "preset") -> CpuFeatures:
    if name not in PRESETS:
        raise ValueError(f"unknown CPU feature preset {name!r}; known: {', '.join(PRESETS)}")
    return CpuFeatures(model, PRESETS[name], f"preset:{name}")


def parse_cpuinfo(text: str) -> CpuFeatures | None:
    """Model name and flags of the first processor in a /proc/cpuinfo text (x86: "flags", Arm: "Features");
    None when it has no flags line."""
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Hardware") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = frozenset(value.split())
        if not line.strip() and flags is not None:      # end of the first processor's block
            break
    return None if flags is None else CpuFeatures(model or platform.processor() or "unknown", flags, "/proc/cpuinfo")


def _from_torch() -> CpuFeatures:
    """Off Linux: torch's own dispatch level (AVX512 / AVX2 / DEFAULT ...). It cannot tell VNNI or AMX, so a
    host read this way gets no int8 dot product: the safe side (fp32 paths), never a slow int8 one."""
    try:
        import torch

        level = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError, RuntimeError):
        level = "unknown"
    flags = {"AVX512": PRESETS["avx512"], "AVX2": PRESETS["avx2"]}.get(level, frozenset())
    return CpuFeatures(platform.processor() or platform.machine() or "unknown", flags, f"torch capability {level}")


def read(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
    """The features `cpuinfo` lists; torch's capability level where it is missing or has no flags."""
    try:
        found = parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        found = None
    return found if found is not None else _from_torch()


@functools.lru_cache(maxsize=None)
def host() -> CpuFeatures:
    """This CPU's features, read once per process."""
    return read()


def restrict(features: CpuFeatures, name: str) -> CpuFeatures:
    """`features` cut down to preset `name`: the flags of both. A preset never adds a flag the CPU lacks,
    so forcing one can only pick kernels this CPU runs."""
    wanted = preset(name).flags
    missing = sorted(wanted - features.flags)
    if missing:
        logger.warning("CPU feature preset %s: this CPU lacks %s; using what it has", name, ", ".join(missing))
    keep = frozenset(f for f in features.flags if f in wanted or not f.startswith(_VECTOR_PREFIXES))
    return CpuFeatures(features.model, keep, f"{features.source}, restricted to {name}")


def current() -> CpuFeatures:
    """The features kernel choices use: the host's, or DEEPSERVE_CPU_ISA's preset within them."""
    name = envs.DEEPSERVE_CPU_ISA
    return host() if name in ("", "auto") else restrict(host(), name)


def vector_width_defines() -> tuple[str, ...]:
    """Defines for the C kernels built with -march=native whose generic vectors take the CPU's width
    (paged_attention.c, invariant_linear.c: 16 floats with AVX-512, else 8): 8 where DEEPSERVE_CPU_ISA takes AVX-512
    away from a CPU that has it, so that a run held to AVX2 runs the AVX2 build; () otherwise (the build's choice)."""
    if host().has("avx512f") and not current().has("avx512f"):
        return ("ATTN_LANES=8", "LINEAR_LANES=8")
    return ()


__all__ = ["CpuFeatures", "INT8_DOT_FLAGS", "PRESETS", "current", "host", "parse_cpuinfo", "preset", "read", "restrict",
           "vector_width_defines"]
