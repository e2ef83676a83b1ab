"""TritonMoE (the MoEBackend of the GPU path, deepserve/layers/moe.py has the protocol and the reference) and
the switch that puts the GPU backends of MoE and MLA layers into a model.

The model runner calls `select_moe_and_mla_backends(model, device)` once after loading: on a CUDA device with
Triton importable, every MoE layer still on the reference `TorchMoE` gets `TritonMoE` and every MLA layer still
on `TorchMLA` gets `TritonMLA`; anywhere else nothing changes (the CPU path never imports Triton).
"""

from __future__ import annotations

from typing import Optional

import torch

from deepserve.kernels.fused_moe import MoEConfig, MoEPairConfig, fused_moe


class TritonMoE:
    def __init__(self, config: Optional[MoEConfig | MoEPairConfig] = None) -> None:
        # Force a mode and its tiles (tests, tuning): MoEConfig the aligned grouped GEMMs, MoEPairConfig the
        # pair mode; None: both picked per call by batch size.
        self.config = config

    def forward(self, x, w13, w2, topk_weights, topk_ids, swiglu_limit=None, shared_out=None):
        return fused_moe(x, w13, w2, topk_weights, topk_ids, swiglu_limit, config=self.config, shared_out=shared_out)


def select_moe_and_mla_backends(model, device) -> None:
    """Swap the reference expert/latent-attention backends of `model` for the Triton ones on CUDA + Triton."""
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


__all__ = ["TritonMoE", "select_moe_and_mla_backends"]
