"""The in-graph in-flight token patch (kernels/token_patch.py) against its PyTorch twin."""

import pytest
import torch

from deepserve.kernels.token_patch import patch_tokens, patch_tokens_ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 8, 37, 256])
def test_patch_matches_reference(device, rows):
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, 1000, (rows,), generator=g).to(device)
    tokens = torch.randint(1000, 2000, (300,), generator=g).to(device)
    src = torch.randint(-1, 300, (rows,), generator=g).to(device)
    src[0] = -1
    want = ids.clone()
    patch_tokens_ref(want, src, tokens)
    patch_tokens(ids, src, tokens)
    assert torch.equal(ids, want) and ids[0] < 1000
    assert ((ids >= 1000) == (src >= 0)).all()
