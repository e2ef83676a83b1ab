"""DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM: when the paged decode kernel reads two adjacent KV heads a program
(kernels/paged_attention.py kv_heads_a_program). "auto" pairs only where session 40's steps gained on an H100 and an
H200 (a one-wave launch without a split, 16-bit cache, heads of at most 128 bytes a token); the GPU tests check
the paired kernel's attention itself."""

import pytest
import torch

from deepserve.kernels.decode_launch import fits_one_wave, kv_heads_a_program


@pytest.mark.parametrize("head_dim,elem,kv_heads,adjacent,one_wave,want", [
    (64, 2, 8, True, True, 2),       # Llama-3.2-1B at batch 64: one unsplit wave over bf16
    (64, 2, 8, True, False, 1),      # batch 8's split launch (half the programs where there are too few), 256's
    (128, 1, 4, True, True, 1),      # Qwen3-MoE over E4M3: slower at kernel level
    (128, 2, 4, True, True, 1),      # 256 bytes a token: no pairing
    (64, 2, 3, True, True, 1),       # odd KV heads (SmolLM2)
    (64, 2, 8, False, True, 1),      # heads not side by side in the cache's rows
])
def test_auto_pairs_only_one_wave_unsplit_launches_over_16_bit_heads(head_dim, elem, kv_heads, adjacent, one_wave,
                                                                     want):
    assert kv_heads_a_program(head_dim, elem, kv_heads, adjacent, one_wave, mode="auto") == want


def test_one_wave_is_two_128_wide_programs_an_sm_without_a_split():
    cpu = torch.device("cpu")               # num_sms: 8 off the GPU
    assert fits_one_wave(32, 64, False, cpu) and fits_one_wave(16, 128, False, cpu)
    assert not fits_one_wave(33, 64, False, cpu) and not fits_one_wave(17, 128, False, cpu)
    assert not fits_one_wave(4, 64, True, cpu)


def test_forced_modes():
    assert kv_heads_a_program(64, 2, 8, True, False, mode="2") == 2
    assert kv_heads_a_program(128, 1, 4, True, True, mode="2") == 2        # 128 fp8 bytes pair when forced
    assert kv_heads_a_program(128, 2, 4, True, True, mode="2") == 1        # ... 256 never
    assert kv_heads_a_program(64, 2, 3, True, True, mode="2") == 1
    assert kv_heads_a_program(64, 2, 8, True, True, mode="1") == 1


def test_the_variable_refuses_other_values(monkeypatch):
    from deepserve import envs
    monkeypatch.setenv("DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM", "4")
    with pytest.raises(ValueError, match="DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM"):
        envs.DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM
