"""DEEPSERVE_QKV_ROTARY_TILES' parsing (kernels/qkv_rotary.py parse_tiles), without a GPU: rotation pairs and warps
a program of the batch-1 fused qkv GEMV + rotary + KV write."""

import pytest

from deepserve.kernels.qkv_rotary import QKV_ROTARY_TILES, parse_tiles


def test_parses_pairs_and_warps():
    assert parse_tiles("1x2") == (1, 2) and parse_tiles("4X4") == (4, 4) and parse_tiles("16x8") == (16, 8)
    assert QKV_ROTARY_TILES == parse_tiles("1x2")          # the default: two rows a program, two warps


@pytest.mark.parametrize("text", ["", "2", "2x", "3x4", "2x3", "32x4", "ax4"])
def test_rejects_what_it_cannot_launch(text):
    with pytest.raises(ValueError, match="DEEPSERVE_QKV_ROTARY_TILES"):
        parse_tiles(text)
