"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention + DeepSeekMoE, readable in one sitting.

Layer i: RMSNorm -> MLA -> residual -> RMSNorm -> FFN -> residual, where the FFN is a dense SwiGLU for the
first `first_k_dense_replace` layers and an MoE (routed experts + shared experts) after.

  V2 router: softmax scores, `greedy` or `group_limited_greedy` top-k, times routed_scaling_factor.
  V3 router: sigmoid scores, e_score_correction_bias for the choice, grouped top-k (`noaux_tc`),
             renormalised (norm_topk_prob), times routed_scaling_factor. The gate stays fp32, as in HF.
  The router reads `scoring_func` / `topk_method` from the config, so V4.1's sqrt(softplus) scoring works too.

The V3 multi-token-prediction module (checkpoint layers numbered >= num_hidden_layers) is skipped at load unless
speculative decoding asks for it (`keep_mtp`, models/deepseek_mtp.py): then it is the MTP drafter.
FP8 checkpoints (`*.weight_scale_inv`) are dequantized on load (deepserve/loader/fp8.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from deepserve.layers.mla import MLARotaryEmbedding, MultiHeadLatentAttention, mla_softmax_scale
from deepserve.layers.rotary import rope_parameters
from deepserve.layers.moe import FusedMoE, GatedMLP, RoutingConfig, copy_checked
from deepserve.loader.fp8 import dequantize_weights, weight_block_size
from deepserve.layers.forward_batch import ForwardBatch
from deepserve.models.base import CausalLM, DecoderLayer
from deepserve.models.deepseek_mtp import MultiTokenPredictor


def routing_config(cfg: dict[str, Any], version: int) -> RoutingConfig:
    defaults = ("softmax", "greedy") if version == 2 else ("sigmoid", "noaux_tc")
    return RoutingConfig(
        top_k=cfg["num_experts_per_tok"],
        scoring=cfg.get("scoring_func") or defaults[0],
        topk_method=cfg.get("topk_method") or defaults[1],
        num_groups=cfg.get("n_group") or 1,
        topk_groups=cfg.get("topk_group") or 1,
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
    )


def deepseek_layer(cfg: dict[str, Any], layer: int, rotary: MLARotaryEmbedding, scale: float,
                   version: int) -> DecoderLayer:
    """MLA attention; a dense MLP for the first `first_k_dense_replace` layers, experts after."""
    hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
    sparse = (cfg.get("n_routed_experts") and layer >= cfg.get("first_k_dense_replace", 0)
              and layer % cfg.get("moe_layer_freq", 1) == 0)
    if sparse:
        inter = cfg["moe_intermediate_size"]
        mlp = FusedMoE(hidden, inter, cfg["n_routed_experts"], routing_config(cfg, version),
                       shared_intermediate_size=inter * (cfg.get("n_shared_experts") or 0), gate_dtype=torch.float32)
    else:
        mlp = GatedMLP(hidden, cfg["intermediate_size"])
    return DecoderLayer(hidden, eps, MultiHeadLatentAttention(cfg, rotary, scale), mlp)


class DeepseekV2ForCausalLM(CausalLM):
    version = 2

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        self.config = cfg
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {cfg['hidden_act']!r} is not supported (silu only)")
        rope = rope_parameters(cfg)
        # V2 always rotates interleaved pairs (HF's complex-number form); V3 has a switch, on by default.
        interleaved = self.version == 2 or cfg.get("rope_interleave", True)
        rotary = MLARotaryEmbedding(cfg["qk_rope_head_dim"], max_position, rope,
                                    cfg.get("max_position_embeddings", max_position), interleaved)
        scale = mla_softmax_scale(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], rope)
        self.build_trunk(cfg, (deepseek_layer(cfg, i, rotary, scale, self.version)
                               for i in range(cfg["num_hidden_layers"])))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        num_layers = len(self.layers)
        for name, tensor in dequantize_weights(weights, weight_block_size(self.config)):
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            m = re.match(r"layers\.(\d+)\.(.+)", name)
            if m and int(m.group(1)) >= num_layers:
                continue        # the MTP module(s) of V3 checkpoints: not used yet
            if m and m.group(2).startswith("mlp."):
                filled = self.layers[int(m.group(1))].mlp.load_weight(m.group(2).removeprefix("mlp."), tensor)
                if filled is not None:
                    loaded.add(f"layers.{m.group(1)}.mlp.{filled}")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            copy_checked(params[name], tensor, name)
            loaded.add(name)
        return loaded


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    version = 3

    def __init__(self, cfg: dict[str, Any], max_position: int, keep_mtp: bool = False) -> None:
        super().__init__(cfg, max_position)
        self.mtp: MultiTokenPredictor | None = None
        if keep_mtp:
            if int(cfg.get("num_nextn_predict_layers") or 0) < 1:
                raise ValueError("speculative_config method 'mtp' needs a checkpoint with MTP layers "
                                 "(num_nextn_predict_layers >= 1 in config.json)")
            n = cfg["num_hidden_layers"]
            rotary = self.layers[0].self_attn.rotary
            scale = self.layers[0].self_attn.attn.scale
            self.mtp = MultiTokenPredictor(cfg, deepseek_layer(cfg, n, rotary, scale, self.version))

    def shard_tensor_parallel(self, tp, shard_experts: bool = True) -> None:
        """CausalLM's, and the MTP layer's decoder block the same way (its eh_proj and head stay whole)."""
        super().shard_tensor_parallel(tp, shard_experts)
        if self.mtp is not None and tp.size > 1:
            self.mtp.block.shard_tensor_parallel(tp, shard_experts)

    def attention_layers(self) -> list:
        """The decoder layers' caches, then the MTP layer's (it is paged like them)."""
        layers = super().attention_layers()
        return layers + [self.mtp.block.self_attn.attn] if self.mtp is not None else layers

    def moe_layers(self) -> list:
        layers = super().moe_layers()
        return layers + [self.mtp.block.mlp] if self.mtp is not None and hasattr(self.mtp.block.mlp,
                                                                                  "expert_load") else layers

    def mtp_step(self, token_ids: torch.Tensor, target_hidden: torch.Tensor,
                 batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over rows (next token, the target's final hidden state at the row's position): the logits of
        the rows in batch.logits_indices and the MTP's own hidden states for them (MultiTokenPredictor.forward)."""
        return self.mtp(self.embed_tokens(token_ids), target_hidden, batch)

    def mtp_attention(self):
        """The MTP layer's cache holder (the last of attention_layers())."""
        return self.mtp.block.self_attn.attn

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.mtp is None:
            return super().load_weights(weights)
        n = len(self.layers)
        mtp_weights: list[tuple[str, torch.Tensor]] = []

        def main_weights():
            for name, tensor in weights:
                short = name.removeprefix("model.")
                if short.startswith(f"layers.{n}."):
                    mtp_weights.append((short.removeprefix(f"layers.{n}."), tensor))
                else:
                    yield name, tensor
        loaded = super().load_weights(main_weights())
        return loaded | self._load_mtp(mtp_weights)

    def _load_mtp(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        """`model.layers.{N}.*`: enorm / hnorm / eh_proj / shared_head.* and the decoder layer's own names."""
        params = dict(self.mtp.named_parameters())
        loaded: set[str] = set()
        for name, tensor in dequantize_weights(iter(weights), weight_block_size(self.config)):
            if name == "embed_tokens.weight" or "rotary_emb.inv_freq" in name:
                continue            # the MTP layer shares the model's embedding (V3 stores a copy)
            if name.startswith("mlp."):
                filled = self.mtp.block.mlp.load_weight(name.removeprefix("mlp."), tensor)
                if filled is not None:
                    loaded.add(f"mtp.block.mlp.{filled}")
                continue
            target = name if name.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head") else f"block.{name}"
            if target not in params:
                raise KeyError(f"checkpoint tensor model.layers.{len(self.layers)}.{name!r} has no place in the MTP layer")
            copy_checked(params[target], tensor, target)
            loaded.add(f"mtp.{target}")
        return loaded
