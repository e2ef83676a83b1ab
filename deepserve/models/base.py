"""What every decoder-only model shares: the pre-norm residual layer and the embed -> layers -> norm -> LM head
trunk. A model file only says how its attention and MLP are built and how its checkpoint names map."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from deepserve import envs
from deepserve.layers.cpu_decode import CpuDecodeStack
from deepserve.layers.embedding import Embedding
from deepserve.layers.linear import Linear, apply_linear, linear, one_row_on_gpu
from deepserve.layers.norm import RMSNorm
from deepserve.layers.rank_group import SINGLE, RankGroup
from deepserve.layers.forward_batch import ForwardBatch


# A/B switch (DEEPSERVE_FUSED_NORMS=0): batch-1 GPU layers run their norms and residual adds as separate launches.
_FUSED_NORMS = envs.DEEPSERVE_FUSED_NORMS


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)).

    Layers pass (x, residual) on: the sublayer output and the residual stream before it is added, so that each add
    is fused into the norm that follows it (one kernel). A residual of None means x *is* the stream (the embedding,
    before the first layer; or the output of a layer that took the one-row path below).

    One row on the GPU (batch-1 decode), when the attention and the MLP offer `forward_residual`: each add runs in
    the epilogue of the projection before it, and each norm in the prologue of the projection that reads it where
    that GEMV can take it (one K step: the qkv projection of a Llama-3.2-1B layer), else as a norm-only kernel
    (`prologue_norm` in kernels/gemv.py). The layer passes the stream itself on (residual None): at 1B shapes one
    launch fewer per layer, no add + norm kernel before the attention. (The same path for a few rows through the
    skinny GEMMs, session 38's, lost in decode steps and was removed: docs/gpu.md.)"""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.fuses_norms = _FUSED_NORMS and hasattr(self_attn, "forward_residual") and \
            hasattr(mlp, "forward_residual")
        # A MoE layer may hand its output on uncombined (PairRows, when its backend can: the GPU one): the next
        # layer's add + RMSNorm (or the model's final norm) sums the pair rows as it loads them, one launch fewer.
        self.defers_moe_combine = envs.DEEPSERVE_MOE_COMBINE_IN_NORM and hasattr(mlp, "expert_load")

    def shard_tensor_parallel(self, tp: RankGroup, shard_experts: bool = True) -> None:
        """Shard the attention and the MLP over `tp` (each all-reduces its own output). The one-row path is switched
        off: it adds the residual inside o_proj's / down_proj's epilogue, before the all-reduce could."""
        self.self_attn.shard_tensor_parallel(tp)
        if hasattr(self.mlp, "expert_load"):        # a FusedMoE
            self.mlp.shard_tensor_parallel(tp, shard_experts=shard_experts)
        else:
            self.mlp.shard_tensor_parallel(tp)
        self.fuses_norms = False
        self.defers_moe_combine = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch):
        if residual is None and self.fuses_norms and one_row_on_gpu(x):
            h = self.self_attn.forward_residual(x, self.input_layernorm, batch)
            return self.mlp.forward_residual(h, self.post_attention_layernorm), None
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        if self.defers_moe_combine:
            return self.mlp(x, combine=False), residual
        return self.mlp(x), residual


def layer_windows(cfg: dict[str, Any]) -> list[int]:
    """Each layer's sliding window in an HF config (0: the layer attends to every key), read as transformers 5 reads
    it: the per-layer `layer_types` where the config lists them; else Mistral's (and Mixtral's, Qwen3-MoE's)
    `sliding_window` on every layer (null from Mistral v0.2 on), Qwen2 / Qwen3's from layer `max_window_layers`
    on; nothing unless Qwen's `use_sliding_window` is on."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") or 0
    if window <= 0 or not cfg.get("use_sliding_window", True):
        return [0] * n
    if cfg.get("layer_types") is not None:
        return [window if kind == "sliding_attention" else 0 for kind in cfg["layer_types"]]
    first = cfg.get("max_window_layers", 28) if cfg.get("model_type") in ("qwen2", "qwen3") else 0
    return [window if i >= first else 0 for i in range(n)]


class CausalLM(nn.Module):
    """Embedding, a stack of DecoderLayers, final norm, LM head (tied to the embedding or not)."""

    batch_invariant = False     # the tied LM head's GEMM in batch-invariant mode (layers/batch_invariant.py)
    tp: RankGroup = SINGLE      # the tensor-parallel group the layers are sharded over (shard_tensor_parallel)
    cpu_decode: CpuDecodeStack | None = None     # set by build_trunk

    def build_trunk(self, cfg: dict[str, Any], layers: Iterable[nn.Module]) -> None:
        hidden = cfg["hidden_size"]
        self.embed_tokens = Embedding(cfg["vocab_size"], hidden)
        self.layers = nn.ModuleList(layers)
        # CPU decode steps through GGUF-packed or float32 Llama layers: all layers in one C call (where it applies).
        self.cpu_decode = CpuDecodeStack(self.layers)
        self.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        # Tied: the embedding doubles as the LM head (quantization may later install a separate one).
        self.lm_head = None if self.tie_word_embeddings else Linear(hidden, cfg["vocab_size"], bias=False)

    def shard_tensor_parallel(self, tp: RankGroup, shard_experts: bool = True) -> None:
        """After the full weights are loaded (before quantization): narrow every decoder layer to this rank's shard
        of `tp` (attention heads, MLP / expert intermediate dims; `shard_experts` False leaves the routed experts
        whole, for expert parallelism). Embedding, LM head and final norm stay whole: every rank computes the full
        logits. A ValueError names the config field tp does not divide (the model is then unusable)."""
        if self.tp.size > 1:
            raise RuntimeError(f"{type(self).__name__} is already sharded over {self.tp.size} ranks")
        if tp.size == 1:
            return
        for layer in self.layers:
            layer.shard_tensor_parallel(tp, shard_experts)
        self.tp = tp

    def attention_layers(self) -> list[nn.Module]:
        """The per-layer KV cache holders, in layer order (the model runner sizes and binds their caches)."""
        return [layer.self_attn.attn for layer in self.layers]

    def moe_layers(self) -> list[nn.Module]:
        """Layers whose MLP routes tokens to experts (they keep per-expert load counters)."""
        return [layer.mlp for layer in self.layers if hasattr(layer.mlp, "expert_load")]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of the rows in `batch.logits_indices` (after the final norm)."""
        x = self.embed_tokens(batch.input_ids)
        stream = None if self.cpu_decode is None else self.cpu_decode(x, batch)
        if stream is not None:          # every layer ran in one C call: the residual stream after the last one
            return self.norm(batch.logits_rows(stream))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        # Only rows that are sampled (or asked for prompt logprobs) go through the last norm and the LM head.
        if residual is None:            # the last layer passed the stream itself on (DecoderLayer)
            return self.norm(batch.logits_rows(x))
        return self.norm(batch.logits_rows(x), batch.logits_rows(residual))[0]

    def head_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's output in its own dtype (bf16 for a bf16 model): what a CUDA graph keeps (an argmax reads
        it as is; float32 is twice the bytes to write and read back). `out`: written there (the graph's static
        logits; layers/linear.py `linear` says when straight from the GEMM)."""
        if self.lm_head is None:
            return linear(hidden, self.embed_tokens.weight, batch_invariant=self.batch_invariant, out=out)
        return apply_linear(self.lm_head, hidden, out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_logits(hidden).float()
