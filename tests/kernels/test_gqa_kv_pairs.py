"""DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM: when the paged decode kernel reads two adjacent KV heads a program
(kernels/paged_attention.py kv_heads_a_program). "auto" pairs only where session 40's H100 steps gained (no split,
16-bit cache, heads of at most 128 bytes a token); the GPU tests check the paired kernel's attention itself."""

import pytest

from deepserve.kernels.paged_attention import kv_heads_a_program


@pytest.mark.parametrize("head_dim,elem,kv_heads,adjacent,split,want", [
    (64, 2, 8, True, False, 2),      # Llama-3.2-1B at batch 64-256: unsplit launches over bf16
    (64, 2, 8, True, True, 1),       # batch 8's split launch: half the programs where there are too few
    (128, 1, 4, True, False, 1),     # Qwen3-MoE over E4M3: slower at kernel level
    (128, 2, 4, True, False, 1),     # 256 bytes a token: no pairing
    (64, 2, 3, True, False, 1),      # odd KV heads (SmolLM2)
    (64, 2, 8, False, False, 1),     # heads not side by side in the cache's rows
])
def test_auto_pairs_only_unsplit_launches_over_16_bit_heads(head_dim, elem, kv_heads, adjacent, split, want):
    assert kv_heads_a_program(head_dim, elem, kv_heads, adjacent, split, mode="auto") == want


def test_forced_modes():
    assert kv_heads_a_program(64, 2, 8, True, True, mode="2") == 2
    assert kv_heads_a_program(128, 1, 4, True, False, mode="2") == 2       # 128 fp8 bytes pair when forced
    assert kv_heads_a_program(128, 2, 4, True, False, mode="2") == 1       # ... 256 never
    assert kv_heads_a_program(64, 2, 3, True, False, mode="2") == 1
    assert kv_heads_a_program(64, 2, 8, True, False, mode="1") == 1


def test_the_variable_refuses_other_values(monkeypatch):
    from deepserve import envs
    monkeypatch.setenv("DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM", "4")
    with pytest.raises(ValueError, match="DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM"):
        envs.DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM
