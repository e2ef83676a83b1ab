"""The decode steps' embedding gather against torch's (bit for bit: a copy), ids outside the table as zero rows,
and the layer's dispatch (decode-sized steps without autograd on the GPU; prompt-sized steps keep torch's)."""

import pytest
import torch

from deepserve.kernels.embedding import embedding, embedding_ref
from deepserve.layers import embedding as embedding_module
from deepserve.layers.embedding import Embedding


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (5, 40), (64, 1100), (0, 64)])
def test_embedding_gathers_the_rows(device, dtype, rows, hidden):
    weight = torch.randn(300, hidden, device=device).to(dtype)
    ids = torch.randint(0, 300, (rows,), device=device)
    out = embedding(ids, weight)
    assert out.shape == (rows, hidden) and out.dtype == dtype
    assert torch.equal(out, torch.nn.functional.embedding(ids, weight))


def test_ids_outside_the_table_give_zero_rows(device):
    weight = torch.randn(10, 48, device=device)
    ids = torch.tensor([3, -1, 10, 9, 1 << 40], device=device)
    out = embedding(ids, weight)
    assert torch.equal(out, embedding_ref(ids, weight))
    assert not out[[1, 2, 4]].any() and torch.equal(out[[0, 3]], weight[[3, 9]])


def test_layer_dispatch(device, monkeypatch):
    calls = []
    monkeypatch.setattr(embedding_module, "use_triton", lambda x: True)
    import deepserve.kernels.embedding as kernel
    real = kernel.embedding
    monkeypatch.setattr(kernel, "embedding", lambda *a: calls.append(1) or real(*a))
    layer = Embedding(50, 32).to(device)
    ids = torch.randint(0, 50, (4,), device=device)
    with torch.inference_mode():
        assert torch.equal(layer(ids), layer.weight[ids]) and len(calls) == 1
        layer(torch.randint(0, 50, (embedding_module.TRITON_MAX_ROWS + 1,), device=device))     # a prompt step
        layer(ids[None])                                                                      # not one flat row
    assert len(calls) == 1
    layer(ids)                                                                                # autograd on
    assert len(calls) == 1
