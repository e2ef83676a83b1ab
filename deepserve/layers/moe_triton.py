"""TritonMoE (the MoEBackend of the GPU path, deepserve/layers/moe.py has the protocol and the reference) and
the switch that puts the GPU backends of MoE and MLA layers into a model.

The model runner calls `select_moe_and_mla_backends(model, device)` once after loading: on a CUDA device with
Triton importable, every MoE layer still on the reference `TorchMoE` gets `TritonMoE` and every MLA layer still
on `TorchMLA` gets `TritonMLA`; anywhere else nothing changes (the CPU path never imports Triton).
"""

from __future__ import annotations

from typing import Optional

import torch

from deepserve import envs
from deepserve.kernels import fused_moe as moe_kernels
from deepserve.kernels.fused_moe import MoEConfig, MoEPairConfig, fused_moe, pick_moe_config
from deepserve.layers import side_stream
from deepserve.layers.linear import Linear
from deepserve.layers.mlp import GatedMLP


# A/B switch (DEEPSERVE_MLA_STACKED_INPUTS=0): MLA's q and kv_a projections keep two weights (two GEMMs past 32 rows).
_STACK_MLA_INPUTS = envs.DEEPSERVE_MLA_STACKED_INPUTS

# Above this many tokens the shared experts keep their own GEMMs: every BLOCK_M tokens re-read the shared weights in
# the grouped GEMM (from L2 while they fit), where cuBLAS reads them about once. Measured on an H200
# (benchmarks/moe_shared_fusion_ab.py, moe_shared_fusion_ab_h200.json, us per MoE layer fused / apart): V2-Lite
# (23 MB of shared gate/up weights) 151.7 / 155.9 at 8 tokens, 284.8 / 293.2 at 64, 295.7 / 299.1 at 128, 316.9 /
# 316.5 at 256; DeepSeek-V3 (58.7 MB, more than the L2) 4333 / 4344 at 64, 5148 / 5117 at 128. So shared weights
# that fit the L2 fuse up to 128 tokens (session 22: V2-Lite batch-128 decode steps 10.846 -> 10.794 ms,
# session22_steps_ab_h200.json, A/B mode shared_fusion_s21), larger ones up to 64.
FUSED_SHARED_MAX_TOKENS = 128
FUSED_SHARED_MAX_TOKENS_LARGE = 64
SHARED_FITS_L2_BYTES = 32 << 20


def fused_shared_max_tokens(gate_up: torch.Tensor) -> int:
    """The most tokens whose MoE step runs the shared experts with weight `gate_up` inside the grouped GEMMs."""
    small = gate_up.numel() * gate_up.element_size() <= SHARED_FITS_L2_BYTES
    return FUSED_SHARED_MAX_TOKENS if small else FUSED_SHARED_MAX_TOKENS_LARGE


class TritonMoE:
    defers_combine = True       # combine=False: the pair rows come back for the next RMSNorm to add (PairRows)

    def __init__(self, config: Optional[MoEConfig | MoEPairConfig] = None) -> None:
        # Force a mode and its tiles (tests, tuning): MoEConfig the aligned grouped GEMMs, MoEPairConfig the
        # pair mode; None: both picked per call by batch size.
        self.config = config

    def forward(self, x, w13, w2, topk_weights, topk_ids, swiglu_limit=None, shared_out=None, shared_experts=None,
                combine=True, shared_on_side=False):
        """MoEBackend.forward. `shared_on_side`: `shared_out` is still being computed on the side stream
        (FusedMoE.forward launched it there, `shared_beside`); joined before the combine, or before returning the
        pair rows whose shared output the next layer's norm reads."""
        config = self._config(x, w13, topk_ids.shape[1])
        shared_weights = None
        if shared_experts is not None:
            shared_weights = self._fused_shared_weights(x, config, shared_experts, swiglu_limit)
            if shared_weights is None:
                shared_out = shared_experts(x)
        if shared_on_side:
            pairs = fused_moe(x, w13, w2, topk_weights, topk_ids, swiglu_limit, config=config, shared_out=shared_out,
                              combine=False)
            side_stream.join(x.device)
            # Through the module: tests spy on the combine there.
            return moe_kernels.moe_combine(pairs.pair_out, pairs.top_k, pairs.shared_out) if combine else pairs
        return fused_moe(x, w13, w2, topk_weights, topk_ids, swiglu_limit, config=config, shared_out=shared_out,
                         shared_weights=shared_weights, combine=combine)

    def shared_beside(self, x) -> bool:
        """Whether the layer should launch its shared experts on the side stream before its router: on a CUDA
        device, unless DEEPSERVE_MOE_SHARED_STREAM=0. Then they never run as blocks of the grouped GEMMs: on the
        side stream they overlap the router's short launches and the routed experts' GEMMs, which took V2-Lite's
        steps from 7.19 / 12.57 / 13.76 / 15.56 ms (fused up to 128 tokens) to 7.03 / 12.46 / 13.49 / 15.33 at
        batch 8 / 64 / 128 / 256 on an H100, and from 2.62 / 3.82 / 5.06 to 2.43 / 3.57 / 4.82 at batch 1 / 2 / 4
        (the pair mode; side_streams2_v2lite_ab_h100_s49.json, side_stream_pair_mode_v2lite_ab_h100_s49.json)."""
        return x.shape[0] > 0 and envs.DEEPSERVE_MOE_SHARED_STREAM and side_stream.available(x.device)

    def _config(self, x, w13, top_k: int):
        num_experts, two_i, hidden = w13.shape
        return self.config or pick_moe_config(x.shape[0], top_k, num_experts, two_i // 2, hidden, x.dtype, x.device)

    @staticmethod
    def _fused_shared_weights(x, config, shared_experts, swiglu_limit):
        """The shared experts' (gate_up, down) weights where the grouped GEMMs run them as extra blocks (two
        launches fewer, their weight reads beside the routed experts'), up to fused_shared_max_tokens, else None:
        the pair mode (batches of a few tokens) has no such blocks, and the shared experts run as their own module
        (GEMV kernels)."""
        if not (isinstance(config, MoEConfig) and x.shape[0] <= FUSED_SHARED_MAX_TOKENS
                and envs.DEEPSERVE_MOE_FUSED_SHARED):
            return None
        weights = plain_shared_weights(shared_experts, x, swiglu_limit)
        if weights is not None and x.shape[0] > fused_shared_max_tokens(weights[0]):
            return None
        return weights


def plain_shared_weights(shared: GatedMLP, x, swiglu_limit):
    """(gate_up, down) weights of shared experts the fused kernels can run in place of the module, else None:
    a plain GatedMLP (no subclass, no quantized projection, no bias, no all-reduce of its own, not batch-invariant)
    in x's dtype with the routed experts' clamp."""
    if type(shared) is not GatedMLP or shared.tp.size > 1 or shared.swiglu_limit != swiglu_limit:
        return None
    projections = (shared.gate_up_proj, shared.down_proj)
    if any(type(p) is not Linear or p.bias is not None or p.batch_invariant for p in projections):
        return None
    gate_up, down = shared.gate_up_proj.weight, shared.down_proj.weight
    if gate_up.dtype != x.dtype or down.dtype != x.dtype or gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        return None
    return gate_up, down


def select_moe_and_mla_backends(model, device) -> None:
    """Swap the reference expert/latent-attention backends of `model` for the Triton ones on CUDA + Triton, and stack
    each latent attention's two input projections into one weight (MultiHeadLatentAttention.stack_input_projections:
    one GEMM past the fused launches' rows)."""
    if torch.device(device).type != "cuda":
        return
    from deepserve.kernels import HAS_TRITON
    if not HAS_TRITON:
        return
    from deepserve.layers.mla import TorchMLA
    from deepserve.layers.moe import TorchMoE
    moe = TritonMoE()
    for layer in model.moe_layers():
        # Batch-invariant mode keeps the reference backend: its expert GEMMs run the fixed-tiling Triton matmul,
        # where the fused MoE kernel picks tiles by the tokens per expert.
        if isinstance(layer.backend, TorchMoE) and not layer.backend.batch_invariant:
            layer.backend = moe
    mla_layers = [layer for layer in model.attention_layers() if isinstance(getattr(layer, "backend", None), TorchMLA)]
    if mla_layers:
        from deepserve.layers.mla_triton import TritonMLA
        mla = TritonMLA()
        for layer in mla_layers:
            layer.backend = mla
    if _STACK_MLA_INPUTS:
        from deepserve.layers.mla import MultiHeadLatentAttention
        for module in model.modules():
            if isinstance(module, MultiHeadLatentAttention):
                module.stack_input_projections()


__all__ = ["FUSED_SHARED_MAX_TOKENS", "FUSED_SHARED_MAX_TOKENS_LARGE", "SHARED_FITS_L2_BYTES", "TritonMoE",
           "fused_shared_max_tokens", "plain_shared_weights", "select_moe_and_mla_backends"]
