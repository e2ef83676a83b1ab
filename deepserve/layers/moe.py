"""Mixture of experts: router, expert backend protocol and its PyTorch reference, the MoE layer.

One MoE layer = router (gate GEMM -> scores -> top-k experts and their weights per token) + routed experts
(SwiGLU MLPs, weights stacked [E, ...] so a kernel sees one tensor) + optional shared experts (a dense
SwiGLU every token goes through) + per-expert load counters (tokens routed, read and reset by the engine,
the input of expert-parallel load balancing).

The routing rules (`RoutingConfig`, `route`: softmax / sigmoid / sqrt-softplus scores, greedy / group-limited /
noaux_tc choice, ties to the lower expert id) and the reference expert sum are the PyTorch twins of the routing
and fused-MoE kernels, in kernels/reference/moe.py; this module holds the layer and its backend protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.kernels.reference.moe import (PairRows, RoutingConfig, count_expert_load, moe_experts,  # noqa: F401
                                             route)
from deepserve.layers import side_stream
from deepserve.layers.kernel_dispatch import use_triton
from deepserve.layers.linear import invariant_linear
from deepserve.layers.mlp import GatedMLP, copy_checked  # noqa: F401 (used by models)
from deepserve.layers.rank_group import SINGLE, RankGroup
from deepserve.layers.tensor_parallel import even_pieces, narrow_parameter

# --- experts -------------------------------------------------------------------------------------

class MoEBackend(Protocol):
    """Routed-expert computation; a fused GPU kernel implements the same signature."""

    defers_combine: bool = False    # takes combine=False (FusedMoE.forward passes it only then)

    def forward(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, swiglu_limit: float | None = None,
                shared_out: torch.Tensor | None = None, shared_experts: GatedMLP | None = None,
                combine: bool = True) -> torch.Tensor | PairRows:
        """x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I];
        topk_weights: [T, k] float32; topk_ids: [T, k] int64; shared_out: None or [T, H] in x's dtype (the
        shared experts' output) -> [T, H] in x's dtype: the weighted sum of each token's experts, plus shared_out,
        in float32 and rounded once (the GPU backend adds it in its combine kernel, not in another launch).
        shared_experts (instead of shared_out): the shared experts' module, for the backend to run on x; its output
        is added as shared_out would be (the GPU backend folds plain weights into its grouped GEMMs).
        combine False (only passed to a backend with `defers_combine` True, the GPU one): no combine; the pairs'
        weighted rows come back as a PairRows, for the next RMSNorm to add as it loads them.
        A backend with `shared_beside(x)` (the GPU one) may ask the layer to launch the shared experts on a side
        stream before its router; their output then comes as shared_out with shared_on_side=True, for the backend
        to join (layers/side_stream.py) before anything reads it."""
        ...


class TorchMoE:
    """Reference backend: (token, expert) pairs sorted by expert, one GEMM pair per expert that got tokens.

    `batch_invariant`: the expert GEMMs through `invariant_linear`, so that a pair's output does not depend on how
    many other tokens chose the same expert; the combine already sums each token's k outputs in slot order."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def forward(self, x, w13, w2, topk_weights, topk_ids, swiglu_limit=None, shared_out=None, shared_experts=None):
        if shared_experts is not None:
            shared_out = shared_experts(x)
        linear = invariant_linear if self.batch_invariant else F.linear
        return moe_experts(x, w13, w2, topk_weights, topk_ids, swiglu_limit, shared_out, linear=linear)


class Router(nn.Module):
    """The gate GEMM and the routing rule. DeepSeek keeps the gate in fp32 (`dtype`), as HF does. On CUDA the rule
    (and the load count) is one Triton kernel, deepserve/kernels/moe_routing.py, with `route()` as its reference."""

    batch_invariant = False     # the gate GEMM through invariant_linear (layers/batch_invariant.py)

    def __init__(self, hidden_size: int, num_experts: int, cfg: RoutingConfig,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32)) if cfg.uses_bias else None
        self.register_parameter("e_score_correction_bias", bias)

    def gate_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> the gate GEMM in the gate's dtype: [T, E] float32 logits, or, on the Triton path from 17
        tokens (up to ROUTER_MMA_MAX_TOKENS on tensor cores, ROUTER_TILED_MAX_TOKENS on CUDA cores), [S, T, E]
        split-K partial sums (exact float32 products, not yet rounded to a half-precision gate's dtype), which
        `fused_route` adds as it loads a row and `sum_partials` adds in the same order, both rounding the sum to
        the gate's dtype."""
        if self.batch_invariant:
            return invariant_linear(x.to(self.weight.dtype), self.weight).float()
        if use_triton(x) and not torch.is_grad_enabled():
            from deepserve.kernels.moe_routing import (router_logit_partials, router_logit_partials_supported,
                                                       router_logits, router_logits_supported)
            if router_logits_supported(x):
                # One GEMV launch at decode sizes instead of a cast and cuBLAS's two GEMV kernels.
                return router_logits(x, self.weight)
            if router_logit_partials_supported(x, self.weight):
                # One launch for cuBLAS's cast, GEMM and split-K reduce; the routing kernel does the reduce.
                return router_logit_partials(x, self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight).float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, E] float32, the gate GEMM in the gate's dtype."""
        return _summed(self.gate_gemm(x), self.weight.dtype)

    def forward(self, x: torch.Tensor, expert_load: torch.Tensor | None = None):
        """x: [T, H] -> (weights [T, k] float32, ids [T, k] int64); with `expert_load` ([E] int64), each expert's
        count among the ids is added to it."""
        gate = self.gate_gemm(x)
        if use_triton(gate) and not gate.requires_grad:
            from deepserve.kernels.moe_routing import fused_route, fused_route_supported
            if fused_route_supported(self.cfg, self.weight.shape[0]):
                # One launch (load count included) instead of ~10 small, launch-bound torch ops at decode sizes.
                return fused_route(gate, self.cfg, self.e_score_correction_bias, expert_load,
                                   round_to=self.weight.dtype)
        logits = _summed(gate, self.weight.dtype)
        weights, ids = route(logits, self.cfg, self.e_score_correction_bias)
        if expert_load is not None:
            count_expert_load(expert_load, ids)
        return weights, ids


def _summed(gate: torch.Tensor, gate_dtype: torch.dtype) -> torch.Tensor:
    """[T, E] logits from a gate GEMM's result (split-K partials [S, T, E] added in order, rounded to a
    half-precision gate's dtype)."""
    if gate.dim() == 2:
        return gate
    from deepserve.kernels.moe_routing import sum_partials
    return sum_partials(gate, gate_dtype)


# Checkpoint names of one expert's projections -> (stacked parameter, shard: 0 gate, 1 up, None down).
_EXPERT_PROJ = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
                "down_proj": ("w2", None), "w2": ("w2", None)}


class FusedMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, routing: RoutingConfig, *,
                 shared_intermediate_size: int = 0, gate_dtype: torch.dtype | None = None,
                 swiglu_limit: float | None = None) -> None:
        super().__init__()
        if routing.top_k > num_experts:
            raise ValueError(f"top_k {routing.top_k} > {num_experts} experts")
        if routing.topk_method != "greedy" and num_experts % routing.num_groups:
            raise ValueError(f"{num_experts} experts do not split into {routing.num_groups} groups")
        if routing.topk_method != "greedy" and routing.top_k > routing.topk_groups * num_experts // routing.num_groups:
            raise ValueError(f"top_k {routing.top_k} > the experts of {routing.topk_groups} allowed groups")
        self.num_experts, self.intermediate_size, self.swiglu_limit = num_experts, intermediate_size, swiglu_limit
        self.gate = Router(hidden_size, num_experts, routing, gate_dtype)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.shared_experts = (GatedMLP(hidden_size, shared_intermediate_size, swiglu_limit)
                               if shared_intermediate_size else None)
        # Tokens routed to each expert since the last reset (int64, on the model's device).
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.backend: MoEBackend = TorchMoE()
        # Tensor parallelism (models' shard_tensor_parallel): the layer's output is this rank's partial sum, reduced
        # over `tp` at the end. Expert parallelism (layers/expert_parallel.py): `expert_parallel` holds this rank's
        # experts and dispatches the routed tokens over the EP group; None in one process.
        self.tp: RankGroup = SINGLE
        self.expert_parallel = None
        self._expert_pieces: dict[str, set[tuple[int, int | None]]] = {"w13": set(), "w2": set()}

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None,
                combine: bool = True) -> torch.Tensor | PairRows:
        """`token_ids`: each row's token, for a gate that routes by it (DeepSeek-V4's hash layers, HashRouter).
        `combine` False: the output may come back uncombined (PairRows), for an RMSNorm to sum as it reads it
        (models/base.py DecoderLayer); only in one process (no tensor or expert parallelism: their reduce and
        dispatch need the sum)."""
        # The shared experts need only x: the GPU backend has them launched on a side stream first, beside the
        # router's short launches and the routed experts' GEMMs (layers/side_stream.py; the backend joins before
        # their output is read).
        beside = (self.shared_experts is not None and self.expert_parallel is None
                  and hasattr(self.backend, "shared_beside") and self.backend.shared_beside(x))
        if beside:
            with side_stream.fork(x.device):
                shared_out = self.shared_experts(x)
        # The gate also counts the tokens routed to each expert.
        if token_ids is None:
            weights, ids = self.gate(x, self.expert_load)
        else:
            weights, ids = self.gate(x, token_ids, self.expert_load)
        # The backend runs the shared experts and adds their output to the routed sum (on the GPU inside its
        # grouped GEMMs and combine kernel: no launches of their own).
        if self.expert_parallel is not None:
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            out = self.expert_parallel.forward(self, x, weights, ids, shared)
        else:
            defer = not combine and self.tp.size == 1 and getattr(self.backend, "defers_combine", False)
            shared = ({"shared_out": shared_out, "shared_on_side": True} if beside
                      else {"shared_experts": self.shared_experts})
            out = self.backend.forward(x, self.w13, self.w2, weights, ids, self.swiglu_limit, **shared,
                                       **({"combine": False} if defer else {}))
            if defer:
                return out
        return self.tp.all_reduce(out)

    def reset_expert_load(self) -> None:
        self.expert_load.zero_()

    def shard_tensor_parallel(self, tp: RankGroup, shard_experts: bool = True) -> None:
        """After loading: the output becomes this rank's partial sum, all-reduced over `tp` in forward (routed and
        shared experts in one reduce). `shard_experts`: every expert keeps 1 / tp.size of its intermediate dim (w13
        [E, 2I, H] by segments [gate | up] on dim 1, w2 [E, H, I] on dim 2); False leaves the expert stacks whole
        (expert parallelism spreads whole experts instead). The shared experts are always sharded, without a reduce
        of their own; the router stays whole on every rank."""
        if shard_experts:
            inter = self.intermediate_size
            field = "the experts' intermediate size (moe_intermediate_size; Mixtral's intermediate_size)"
            pieces = even_pieces([inter, inter], tp, field)
            local = pieces[0][1]
            narrow_parameter(self.w13, 1, pieces)
            narrow_parameter(self.w2, 2, [(tp.rank * local, local)])
            self.intermediate_size = local
        if self.shared_experts is not None:
            self.shared_experts.shard_tensor_parallel(tp, reduce=False, field="shared experts' intermediate size")
        self.tp = tp

    # --- loading ---------------------------------------------------------------------------------
    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """HF name relative to this layer -> the parameter it filled (for the expert stacks: only once
        every expert's piece has arrived, so a checkpoint missing an expert fails the completeness check).

        Accepts per-expert names (`experts.3.gate_proj.weight`, Mixtral's `experts.3.w1.weight`) and the
        stacked layout transformers 5 keeps in memory (`experts.gate_up_proj`, `experts.down_proj`).
        """
        parts = name.split(".")
        if parts[0] == "gate" and getattr(self.gate, parts[1], None) is not None:
            copy_checked(getattr(self.gate, parts[1]), tensor, name)
            return name
        if parts[0] == "shared_experts" and self.shared_experts is not None:
            return "shared_experts." + self.shared_experts.load_weight(".".join(parts[1:]), tensor)
        if parts[0] == "experts" and parts[1] in ("gate_up_proj", "down_proj"):
            target = "w13" if parts[1] == "gate_up_proj" else "w2"
            copy_checked(getattr(self, target), tensor, name)
            return target
        if parts[0] == "experts" and parts[1].isdigit() and parts[2] in _EXPERT_PROJ:
            return self._load_expert(int(parts[1]), *_EXPERT_PROJ[parts[2]], tensor, name)
        raise KeyError(f"MoE weight {name!r} has no place in {type(self).__name__}")

    def _load_expert(self, expert: int, target: str, shard: int | None, tensor: torch.Tensor,
                     name: str) -> str | None:
        if not 0 <= expert < self.num_experts:
            raise KeyError(f"{name}: expert {expert} out of range ({self.num_experts} experts)")
        param = getattr(self, target)[expert]
        if shard is not None:
            param = param.narrow(0, shard * self.intermediate_size, self.intermediate_size)
        copy_checked(param, tensor, name)
        pieces = self._expert_pieces[target]
        pieces.add((expert, shard))
        return target if len(pieces) == self.num_experts * (2 if target == "w13" else 1) else None


def expert_load(moe_layers: list[FusedMoE]) -> torch.Tensor:
    """[num_moe_layers, num_experts] tokens routed per expert since the last reset."""
    return torch.stack([layer.expert_load for layer in moe_layers])


def reset_expert_load(moe_layers: list[FusedMoE]) -> None:
    for layer in moe_layers:
        layer.reset_expert_load()
