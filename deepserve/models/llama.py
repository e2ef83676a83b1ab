"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), readable in one sitting.

Differences handled by the config: Qwen2 adds biases to q/k/v; Qwen3 RMS-normalises q and k per head
before RoPE; `tie_word_embeddings` reuses the embedding as the LM head.
q/k/v are fused into one `qkv_proj` GEMM and gate/up into `gate_up_proj`: `load_weights` maps HF names.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from deepserve.layers.attention import Attention
from deepserve.layers.linear import Linear, linear_residual
from deepserve.layers.mlp import GatedMLP
from deepserve.layers.norm import RMSNorm
from deepserve.layers.rank_group import SINGLE, RankGroup
from deepserve.layers.tensor_parallel import shard_column, shard_row, split_evenly, split_kv_heads
from deepserve.models.base import CausalLM, DecoderLayer, layer_windows
from deepserve.layers.rotary import RotaryEmbedding
from deepserve.layers.forward_batch import ForwardBatch


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], rotary: RotaryEmbedding, qk_norm: bool, window: int = 0) -> None:
        """`window` > 0: this layer's sliding window (models/base.py's `layer_windows`)."""
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2"
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden, bias=False)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, window)
        # Tensor parallelism (shard_tensor_parallel): this rank's heads' o_proj output is summed over `tp`.
        self.tp: RankGroup = SINGLE

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.tp.all_reduce(self.o_proj(self.attend(x, batch)))

    def forward_residual(self, h: torch.Tensor, norm: RMSNorm, batch: ForwardBatch) -> torch.Tensor:
        """h + self(norm(h)) for the residual stream h (DecoderLayer's fused GPU path): the norm runs in the qkv
        projection's prologue, the add in o_proj's epilogue, where the kernels allow."""
        out = self.attend(h, batch, norm)
        if self.tp.size > 1:            # the add comes after the all-reduce, not in o_proj's epilogue
            return h + self.tp.all_reduce(self.o_proj(out))
        return linear_residual(out, self.o_proj, h)

    def shard_tensor_parallel(self, tp: RankGroup) -> None:
        """After loading: keep this rank's query heads and their kv heads. qkv_proj column-parallel by segments
        [q | k | v] (weight and bias), o_proj row-parallel; the inner Attention then holds (and its KV cache is sized
        for) the local heads. KV heads split when tp divides them, else (tp a multiple of them) each rank keeps the
        one its query heads share. q_norm / k_norm act per head_dim and stay whole."""
        heads = split_evenly(self.num_heads, tp, "num_attention_heads")
        kv_heads, first_kv = split_kv_heads(self.num_kv_heads, tp)
        d = self.head_dim
        q_piece = (tp.rank * heads * d, heads * d)
        shard_column(self.qkv_proj, [q_piece, (self.q_size + first_kv * d, kv_heads * d),
                                     (self.q_size + self.kv_size + first_kv * d, kv_heads * d)])
        shard_row(self.o_proj, q_piece, tp)
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.q_size, self.kv_size = heads * d, kv_heads * d
        self.attn.num_heads, self.attn.num_kv_heads = heads, kv_heads
        self.tp = tp

    def attend(self, x: torch.Tensor, batch: ForwardBatch, norm: RMSNorm | None = None) -> torch.Tensor:
        """The attention's output before o_proj, [T, H * D], of x (of norm(x) given an RMSNorm)."""
        t = x.shape[0]
        # o_proj's weight, which a GPU attention backend may ask into L2 while it attends (kernels/l2_prefetch.py).
        prefetch = getattr(self.o_proj, "weight", None)
        if self.q_norm is None:
            # Batch-1 decode on the GPU: norm, projection, rotary and cache write in one launch (None elsewhere).
            out = self.attn.forward_from_hidden(x, self.qkv_proj, batch, self.rotary, norm, prefetch=prefetch)
            if out is not None:
                return out.reshape(t, self.q_size)
        qkv = self.qkv_proj(x if norm is None else norm(x))
        q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        # The attention applies the q/k norms (Qwen3) and the rotary embedding: the GPU backend fuses them with the
        # KV-cache write (one launch); the reference rotates q and k as views side by side in qkv, in one pass (one
        # C call on the CPU).
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None else None
        return self.attn(q, k, v, batch, rotary=self.rotary, qk_norm=qk_norm,
                         prefetch=prefetch).reshape(t, self.q_size)


class LlamaForCausalLM(CausalLM):
    # HF checkpoint name -> (fused parameter, shard index)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        self.config = cfg
        qk_norm = cfg.get("model_type") == "qwen3"
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rotary = RotaryEmbedding.from_config(head_dim, max_position, cfg)
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.build_trunk(cfg, (DecoderLayer(hidden, eps, LlamaAttention(cfg, rotary, qk_norm, window),
                                            GatedMLP(hidden, cfg["intermediate_size"]))
                               for window in layer_windows(cfg)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            target, shard = self._map_name(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            self._copy_shard(params[target], tensor, shard, target)
            loaded.add(target)
        return loaded

    def _map_name(self, name: str) -> tuple[str, int | None]:
        for hf, (fused, shard) in self.stacked_params.items():
            if f".{hf}." in name:
                return name.replace(hf, fused), shard
        return name, None

    def _copy_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None, name: str) -> None:
        with torch.no_grad():
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.copy_(tensor)
                return
            sizes = self._shard_sizes(name)
            offset = sum(sizes[:shard])
            param.narrow(0, offset, sizes[shard]).copy_(tensor)

    def _shard_sizes(self, name: str) -> list[int]:
        attn = self.layers[0].self_attn
        if "qkv_proj" in name:
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = self.config["intermediate_size"]
        return [inter, inter]
