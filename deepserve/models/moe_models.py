"""Mixtral and Qwen3-MoE: the Llama decoder with the MLP swapped for a mixture of experts.

Attention is Llama's (Qwen3-MoE adds per-head q/k RMSNorm). Routing: softmax over experts, top-k, and
renormalised weights (always for Mixtral; `norm_topk_prob` for Qwen3-MoE). Qwen3-MoE may keep dense MLPs
in some layers (`mlp_only_layers`, `decoder_sparse_step`).

Checkpoint names: Mixtral's `block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up, down), Qwen3-MoE's
`mlp.experts.{e}.gate_proj|up_proj|down_proj`; both become the stacked `mlp.w13` / `mlp.w2`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from deepserve.layers.moe import FusedMoE, GatedMLP, RoutingConfig, copy_checked
from deepserve.layers.rotary import RotaryEmbedding
from deepserve.models.llama import LlamaAttention
from deepserve.models.base import CausalLM, DecoderLayer, layer_windows


class _MoECausalLM(CausalLM):
    """Shared body; subclasses say how their config names experts and which layers are sparse."""

    qk_norm = False

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        self.config = cfg
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {cfg['hidden_act']!r} is not supported (silu only)")
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
        rotary = RotaryEmbedding.from_config(head_dim, max_position, cfg)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.build_trunk(cfg, (DecoderLayer(hidden, eps, LlamaAttention(cfg, rotary, self.qk_norm, window),
                                            self.make_mlp(cfg, i))
                               for i, window in enumerate(layer_windows(cfg))))

    def make_mlp(self, cfg: dict[str, Any], layer: int) -> nn.Module:
        raise NotImplementedError

    # --- loading ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            m = re.match(r"layers\.(\d+)\.(self_attn|mlp)\.(.+)", name)
            if m and m.group(2) == "mlp":
                prefix = f"layers.{m.group(1)}.mlp."
                filled = self.layers[int(m.group(1))].mlp.load_weight(m.group(3), tensor)
                if filled is not None:
                    loaded.add(prefix + filled)
                continue
            if m and m.group(3).split(".")[0] in ("q_proj", "k_proj", "v_proj"):
                loaded.add(self._load_qkv(int(m.group(1)), m.group(3), tensor))
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            copy_checked(params[name], tensor, name)
            loaded.add(name)
        return loaded

    def _load_qkv(self, layer: int, name: str, tensor: torch.Tensor) -> str:
        attn = self.layers[layer].self_attn
        proj, kind = name.split(".")
        offset, size = {"q_proj": (0, attn.q_size), "k_proj": (attn.q_size, attn.kv_size),
                        "v_proj": (attn.q_size + attn.kv_size, attn.kv_size)}[proj]
        param = getattr(attn.qkv_proj, kind)
        copy_checked(param.narrow(0, offset, size), tensor, f"layers.{layer}.self_attn.{name}")
        return f"layers.{layer}.self_attn.qkv_proj.{kind}"


class MixtralForCausalLM(_MoECausalLM):
    def make_mlp(self, cfg, layer):
        routing = RoutingConfig(top_k=cfg["num_experts_per_tok"], renormalize=True)
        return FusedMoE(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"], routing)


class Qwen3MoeForCausalLM(_MoECausalLM):
    qk_norm = True

    def make_mlp(self, cfg, layer):
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        sparse = (layer not in (cfg.get("mlp_only_layers") or []) and num_experts > 0
                  and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        if not sparse:
            return GatedMLP(cfg["hidden_size"], cfg["intermediate_size"])
        routing = RoutingConfig(top_k=cfg["num_experts_per_tok"], renormalize=bool(cfg.get("norm_topk_prob")))
        return FusedMoE(cfg["hidden_size"], cfg["moe_intermediate_size"], num_experts, routing)
