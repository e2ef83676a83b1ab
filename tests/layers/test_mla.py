"""MultiHeadLatentAttention's input projections: the stacked weight (one GEMM for q and kv_a) against the two
Linears it replaces."""

import pytest
import torch

from deepserve.layers.mla import MLARotaryEmbedding, MultiHeadLatentAttention


def _attention(q_lora_rank, bias=False) -> MultiHeadLatentAttention:
    cfg = dict(hidden_size=64, num_attention_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               kv_lora_rank=32, q_lora_rank=q_lora_rank, attention_bias=bias)
    rotary = MLARotaryEmbedding(8, 64, {"rope_type": "default", "rope_theta": 10000.0}, 64, interleaved=True)
    layer = MultiHeadLatentAttention(cfg, rotary, scale=0.2)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    return layer.eval()


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q_proj", "q_a_proj"])
def test_stacked_input_projections_match_the_two_linears(q_lora_rank):
    layer = _attention(q_lora_rank)
    q_first = layer.q_a_proj if q_lora_rank else layer.q_proj
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want_q, want_kv = q_first(x), layer.kv_a_proj_with_mqa(x)
        before = (q_first.weight.clone(), layer.kv_a_proj_with_mqa.weight.clone())
        assert layer.stack_input_projections()
        stacked = layer.input_projections
        rows = q_first.weight.shape[0]
        assert stacked.shape == (rows + layer.kv_lora_rank + layer.rope_dim, 64)
        # The Linears' weights are views of the stacked tensor, with the values they had.
        assert q_first.weight.data_ptr() == stacked.data_ptr()
        assert layer.kv_a_proj_with_mqa.weight.data_ptr() == stacked[rows:].data_ptr()
        assert torch.equal(q_first.weight, before[0]) and torch.equal(layer.kv_a_proj_with_mqa.weight, before[1])
        q, kv = layer.project_inputs(x)
    assert q.shape == want_q.shape and kv.shape == want_kv.shape
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, want_kv, rtol=1e-5, atol=1e-5)


def test_projections_with_bias_stay_apart():
    layer = _attention(None, bias=True)
    assert not layer.stack_input_projections()
    assert layer.input_projections is None
