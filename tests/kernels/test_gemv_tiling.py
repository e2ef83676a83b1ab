"""DEEPSERVE_GEMV_TILING: the batch-1 GEMV's tiling overridden per class of shape (a tuning switch for a GPU the
table was not tuned on), parsed strictly; the table stands for the classes it does not name."""

import pytest

from deepserve.kernels import gemv as gemv_module
from deepserve.kernels.gemv import gemv_config, gemv_shape_class, parse_gemv_tiling


def test_parse_gemv_tiling_reads_each_class():
    assert parse_gemv_tiling("") == {} and parse_gemv_tiling("default") == {}
    assert parse_gemv_tiling("long_rows=1x1024x4; many_rows=2x512x2") == {"long_rows": (1, 1024, 4),
                                                                          "many_rows": (2, 512, 2)}


@pytest.mark.parametrize("spec", ["long_rows=1x1000x4", "long_rows=3x512x4", "long_rows=1x512x16", "wide=1x512x4",
                                  "long_rows=1x512", "long_rows", "long_rows=axbxc", "long_rows=1x8x4"])
def test_parse_gemv_tiling_rejects_bad_entries(spec):
    with pytest.raises(ValueError, match="DEEPSERVE_GEMV_TILING"):
        parse_gemv_tiling(spec)


def test_override_moves_only_its_class(monkeypatch):
    table = {shape: gemv_config(*shape) for shape in [(16384, 2048), (2048, 8192), (3072, 2048), (7, 40)]}
    assert [gemv_shape_class(*shape) for shape in table] == ["many_rows", "long_rows", "short_rows", "short_rows"]
    monkeypatch.setattr(gemv_module, "TILING_OVERRIDES", parse_gemv_tiling("long_rows=2x1024x8"))
    assert gemv_config(2048, 8192) == (2, 1024, 8)
    assert gemv_config(2048, 2816) == (2, 1024, 8)
    for shape in [(16384, 2048), (3072, 2048), (7, 40)]:
        assert gemv_config(*shape) == table[shape]
    # a K step longer than the row takes the row in one step (the power of two that holds it)
    monkeypatch.setattr(gemv_module, "TILING_OVERRIDES", parse_gemv_tiling("short_rows=2x4096x4"))
    assert gemv_config(3072, 2048) == (2, 2048, 4) and gemv_config(7, 40) == (2, 64, 4)
