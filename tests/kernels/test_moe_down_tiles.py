"""DEEPSERVE_MOE_DOWN_TILES: the aligned MoE's down-GEMM tiles at decode sizes forced (a tuning switch), parsed
strictly; the gate/up tiles, the prefill tiles and the rows a block stay the pick's. Host-side, no GPU."""

import pytest
import torch

from deepserve.kernels import fused_moe
from deepserve.kernels.fused_moe import parse_down_tiles, pick_config

CPU = torch.device("cpu")


def test_parse_down_tiles():
    assert parse_down_tiles("") is None and parse_down_tiles("default") is None
    assert parse_down_tiles("256x64x4x3") == (256, 64, 4, 3)


@pytest.mark.parametrize("spec", ["256x64x4", "100x64x4x3", "256x8x4x3", "256x64x16x3", "256x64x4x0", "axbxcxd"])
def test_parse_down_tiles_rejects_bad_settings(spec):
    with pytest.raises(ValueError, match="DEEPSERVE_MOE_DOWN_TILES"):
        parse_down_tiles(spec)


def test_forced_down_tiles_move_only_the_down_gemm_at_decode_sizes(monkeypatch):
    monkeypatch.setattr(fused_moe, "num_sms", lambda device: 132)
    decode = pick_config(1536, 64, 1408, 2048, CPU)          # V2-Lite at 256 tokens: 24 rows an expert
    prefill = pick_config(8192 * 6, 64, 1408, 2048, CPU)
    monkeypatch.setattr(fused_moe, "FORCED_DOWN_TILES", (256, 64, 8, 4))
    forced = pick_config(1536, 64, 1408, 2048, CPU)
    assert forced.down_tiles() == (64, 8, 4) and forced.block_n_down == 256
    assert (forced.block_m, forced.block_n_up, forced.block_k, forced.num_warps, forced.num_stages) == \
        (decode.block_m, decode.block_n_up, decode.block_k, decode.num_warps, decode.num_stages)
    assert pick_config(8192 * 6, 64, 1408, 2048, CPU) == prefill
