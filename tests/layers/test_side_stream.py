"""layers/side_stream.py and its users, host-side: a MoE layer launches its shared experts on the side stream before
its router where the backend asks (DEEPSERVE_MOE_SHARED_STREAM), and the backend joins before the combine. The
streams themselves, and the same bits with and without them, are tests/gpu/test_engine_gpu.py's."""

from __future__ import annotations

import contextlib

import pytest
import torch

from deepserve.kernels.fused_moe import MoEConfig, MoEPairConfig
from deepserve.layers import side_stream
from deepserve.layers.moe import FusedMoE, RoutingConfig, TorchMoE
from deepserve.layers.moe_triton import FUSED_SHARED_MAX_TOKENS, TritonMoE

HIDDEN, INTER, SHARED, EXPERTS = 24, 12, 20, 8
ROUTING = RoutingConfig(top_k=2, scoring="softmax", renormalize=True)


def _moe() -> FusedMoE:
    torch.manual_seed(0)
    moe = FusedMoE(HIDDEN, INTER, EXPERTS, ROUTING, shared_intermediate_size=SHARED)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


def test_no_side_stream_off_cuda(monkeypatch):
    assert not side_stream.available(torch.device("cpu"))
    monkeypatch.setenv("DEEPSERVE_MOE_SHARED_STREAM", "1")
    moe, x = _moe(), torch.randn(5, HIDDEN)
    assert not TritonMoE(MoEPairConfig(8, 16, 32)).shared_beside(x, moe.w13, 2, moe.shared_experts, None)


class _Events:
    """Records the order of forks, joins, shared-expert and router calls."""

    def __init__(self, monkeypatch, moe: FusedMoE) -> None:
        self.log: list[str] = []

        @contextlib.contextmanager
        def fork(device):
            self.log.append("fork")
            yield None
            self.log.append("forked")

        monkeypatch.setattr(side_stream, "fork", fork)
        monkeypatch.setattr(side_stream, "join", lambda device: self.log.append("join"))
        for name, module in (("shared", moe.shared_experts), ("router", moe.gate)):
            monkeypatch.setattr(module, "forward", self._logged(name, module.forward))

    def _logged(self, name, forward):
        def call(*args, **kwargs):
            self.log.append(name)
            return forward(*args, **kwargs)
        return call


class _SideBackend:
    """A backend that asks for the side stream, checks what the layer hands it, and joins as TritonMoE does."""

    def __init__(self, events: _Events) -> None:
        self.events = events

    def shared_beside(self, x, w13, top_k, shared_experts, swiglu_limit) -> bool:
        return True

    def forward(self, x, w13, w2, weights, ids, swiglu_limit=None, shared_out=None, shared_experts=None,
                shared_on_side=False):
        assert shared_on_side and shared_experts is None and shared_out is not None
        self.events.log.append("routed")
        side_stream.join(x.device)
        return TorchMoE().forward(x, w13, w2, weights, ids, swiglu_limit, shared_out=shared_out)


def test_layer_forks_the_shared_experts_before_its_router(monkeypatch):
    moe = _moe()
    x = torch.randn(6, HIDDEN)
    want = moe(x)                        # the reference backend: the shared experts inside it, in order
    events = _Events(monkeypatch, moe)
    moe.backend = _SideBackend(events)
    got = moe(x)
    assert events.log == ["fork", "shared", "forked", "router", "routed", "join"]
    assert torch.equal(got, want)


def test_layer_keeps_the_backends_order_where_it_declines(monkeypatch):
    moe = _moe()
    x = torch.randn(6, HIDDEN)
    events = _Events(monkeypatch, moe)
    moe(x)                               # TorchMoE has no shared_beside: no fork, the shared experts after routing
    assert events.log == ["router", "shared"]


@pytest.mark.parametrize("tokens, fused_shared, config, beside", [
    (FUSED_SHARED_MAX_TOKENS + 1, "1", MoEConfig(16, 32, 32), True),     # past the fused blocks' tokens
    (FUSED_SHARED_MAX_TOKENS, "1", MoEConfig(16, 32, 32), False),        # shared experts inside the grouped GEMMs
    (64, "0", MoEConfig(16, 32, 32), True),                              # fusion switched off
    (4, "1", MoEPairConfig(8, 16, 32), True),                            # the pair mode has no shared blocks
])
def test_triton_backend_asks_where_shared_experts_run_apart(monkeypatch, tokens, fused_shared, config, beside):
    monkeypatch.setattr(side_stream, "available", lambda device: True)    # as on a CUDA device
    monkeypatch.setenv("DEEPSERVE_MOE_FUSED_SHARED", fused_shared)
    moe, x = _moe(), torch.randn(tokens, HIDDEN)
    backend = TritonMoE(config)
    monkeypatch.setenv("DEEPSERVE_MOE_SHARED_STREAM", "1")
    assert backend.shared_beside(x, moe.w13, 2, moe.shared_experts, None) == beside
    monkeypatch.setenv("DEEPSERVE_MOE_SHARED_STREAM", "0")
    assert not backend.shared_beside(x, moe.w13, 2, moe.shared_experts, None)
