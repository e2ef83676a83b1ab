"""DEEPSERVE_MLA_DECODE_TILES: the MLA decode launch's tiles forced for an A/B (kernels/mla_decode.py), parsed at
import; a value that does not parse is an error naming the variable."""

import os
import subprocess
import sys

import pytest

from deepserve.kernels import mla_decode


def test_parse_tiles():
    assert mla_decode.parse_tiles("") is None
    assert mla_decode.parse_tiles("16x4x3") == (16, 4, 3, None)
    assert mla_decode.parse_tiles("64X8X2") == (64, 8, 2, None)
    assert mla_decode.parse_tiles("32x4x2r168") == (32, 4, 2, 168)


@pytest.mark.parametrize("text", ["32x4", "16x4x3x1", "axbxc", "24x4x3", "8x4x3", "32x3x3", "32x4x0", "32x4x9",
                                  "32x4x2r", "32x4x2r16", "32x4x2r300", "32x4x2rr"])
def test_parse_tiles_refuses_what_cannot_launch(text):
    with pytest.raises(ValueError, match="DEEPSERVE_MLA_DECODE_TILES"):
        mla_decode.parse_tiles(text)


def test_launch_tiles_caller_then_variable_then_default(monkeypatch):
    monkeypatch.setattr(mla_decode, "FORCED_TILES", None)
    assert mla_decode.launch_tiles(None, None, None) == mla_decode.DEFAULT_TILES == (mla_decode.MLA_BLOCK_N, 4, 3,
                                                                                     None)
    monkeypatch.setattr(mla_decode, "FORCED_TILES", (16, 8, 2, 128))
    assert mla_decode.launch_tiles(None, None, None) == (16, 8, 2, 128)
    assert mla_decode.launch_tiles(64, None, 3) == (64, 8, 3, 128)
    assert mla_decode.launch_tiles(None, 4, None, 168) == (16, 4, 2, 168)     # the caller's cap (a tile sweep's)
    monkeypatch.setattr(mla_decode, "FORCED_TILES", None)
    assert mla_decode.launch_tiles(None, None, 2, 96) == (mla_decode.MLA_BLOCK_N, 4, 2, 96)


def _import_under(variable: str, value: str, attribute: str) -> subprocess.CompletedProcess:
    """`mla_decode.<attribute>` printed by a fresh interpreter with `variable=value` in its environment."""
    code = f"from deepserve.kernels import mla_decode as m; print(m.{attribute})"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, variable: value}, capture_output=True,
                          text=True)


def test_variable_is_read_at_import():
    out = _import_under("DEEPSERVE_MLA_DECODE_TILES", "16x4x2", "FORCED_TILES")
    assert out.returncode == 0 and out.stdout.strip() == "(16, 4, 2, None)"
    bad = _import_under("DEEPSERVE_MLA_DECODE_TILES", "16x4", "FORCED_TILES")
    assert bad.returncode != 0 and "'16x4' (DEEPSERVE_MLA_DECODE_TILES)" in bad.stderr


def test_programs_per_sm_sets_the_split_count(monkeypatch):
    """mla_num_splits splits the context until sequences x head tiles x splits reaches PROGRAMS_PER_SM programs an
    SM (DEEPSERVE_MLA_PROGRAMS_PER_SM): 132 SMs, 16 heads (one head tile), 1k context."""
    monkeypatch.setattr(mla_decode, "num_sms", lambda device: 132)
    cpu = mla_decode.torch.device("cpu")
    monkeypatch.setattr(mla_decode, "PROGRAMS_PER_SM", 2)
    assert [mla_decode.mla_num_splits(b, 16, 1024, cpu) for b in (8, 64, 128, 256)] == [22, 4, 2, 1]
    monkeypatch.setattr(mla_decode, "PROGRAMS_PER_SM", 4)
    assert [mla_decode.mla_num_splits(b, 16, 1024, cpu) for b in (8, 64, 128, 256)] == [22, 8, 4, 2]
    assert mla_decode.mla_num_splits(256, 16, 96, cpu) == 1      # too short to split


def test_programs_per_sm_is_read_at_import():
    out = _import_under("DEEPSERVE_MLA_PROGRAMS_PER_SM", "3", "PROGRAMS_PER_SM")
    assert out.returncode == 0 and out.stdout.strip() == "3"
    bad = _import_under("DEEPSERVE_MLA_PROGRAMS_PER_SM", "0", "PROGRAMS_PER_SM")
    assert bad.returncode != 0 and "(DEEPSERVE_MLA_PROGRAMS_PER_SM): 0, expected >= 1" in bad.stderr
