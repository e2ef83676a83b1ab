"""layers/side_stream.py and its user, host-side: a MoE layer launches its shared experts on the side stream before
its router where the backend asks (on CUDA, unless DEEPSERVE_MOE_SHARED_STREAM=0), and the backend joins before the
combine. The streams themselves, and the same bits with and without them, are tests/gpu's (test_engine_gpu.py,
test_fused_moe.py)."""

from __future__ import annotations

import contextlib

import torch

from deepserve.layers import side_stream
from deepserve.layers.moe import FusedMoE, RoutingConfig, TorchMoE
from deepserve.layers.moe_triton import TritonMoE

HIDDEN, INTER, SHARED, EXPERTS = 24, 12, 20, 8
ROUTING = RoutingConfig(top_k=2, scoring="softmax", renormalize=True)


def _moe() -> FusedMoE:
    torch.manual_seed(0)
    moe = FusedMoE(HIDDEN, INTER, EXPERTS, ROUTING, shared_intermediate_size=SHARED)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


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

    def shared_beside(self, x) -> bool:
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


def test_triton_backend_asks_for_the_side_stream_on_cuda_unless_switched_off(monkeypatch):
    monkeypatch.delenv("DEEPSERVE_MOE_SHARED_STREAM", raising=False)     # the default: on
    x = torch.randn(4, HIDDEN)
    assert not TritonMoE().shared_beside(x)                                # no side stream off CUDA
    monkeypatch.setattr(side_stream, "available", lambda device: True)    # as on a CUDA device
    assert TritonMoE().shared_beside(x)
    assert not TritonMoE().shared_beside(x[:0])                            # nothing to overlap
    monkeypatch.setenv("DEEPSERVE_MOE_SHARED_STREAM", "0")
    assert not TritonMoE().shared_beside(x)
