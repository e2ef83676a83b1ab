"""`quantization="gguf"`: a GGUF model's quantized matrices stay in GGUF's packed blocks (Q4_1, Q8_0) on the CPU.

`GGUFLinear` multiplies by the blocks in C (kernels/cpu/gguf_linear.c) with fp32 activations: the weights are
exactly the file's and results equal the dequantized fp32 model's up to the order of the sums, while a decode step
reads 4.5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of 32. `GGUFEmbedding` dequantizes only the rows it looks up.
`pack_model` swaps them in after the usual (dequantizing) load: a fused projection (qkv_proj, gate_up_proj)
concatenates the rows of its parts' blocks, a tied LM head multiplies by the embedding's blocks. A matrix stored in
another type (F32, K-quants) keeps its fp32 Linear.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from deepserve.kernels.cpu import gguf_linear as kernel
from deepserve.loader.gguf_loader import PackedTensor

logger = logging.getLogger(__name__)

# The ggml types GGUFLinear takes.
PACKED_TYPES = tuple(kernel.BLOCK_BYTES)


class GGUFLinear(nn.Module):
    # Numeric option (b) instead: activations quantized per 32-block to int8 (llama.cpp's way). Off: it changes the
    # model's numbers; benchmarks/cpu_vs_llamacpp.py switches it on per layer to measure it against option (a).
    int8_activations = False

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        kernel.check_blocks(blocks, qtype, in_features)
        self.register_buffer("blocks", blocks.contiguous())
        self.qtype, self.in_features, self.out_features = qtype, in_features, blocks.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.gemm = kernel.PackedGemm(qtype, in_features)      # library and vector code looked up once, here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.float()
        if self.int8_activations:
            out = kernel.gguf_linear_q8act(flat, self.blocks, self.qtype, self.in_features)
        else:
            out = self.gemm(flat, self.blocks)
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        return kernel.dequantize(self.blocks, self.qtype, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={kernel.TYPE_NAMES[self.qtype]}, bias={self.bias is not None}")


class GGUFEmbedding(nn.Module):
    """An embedding table kept packed: a lookup dequantizes the rows it reads (bit for bit the fp32 load's)."""

    def __init__(self, blocks: torch.Tensor, qtype: int, embedding_dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        kernel.check_blocks(blocks, qtype, embedding_dim)
        self.register_buffer("blocks", blocks.contiguous())
        self.qtype, self.embedding_dim, self.num_embeddings = qtype, embedding_dim, blocks.shape[0]
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = kernel.dequantize(self.blocks, self.qtype, self.embedding_dim, rows=ids)
        rows = rows.view(*ids.shape, self.embedding_dim)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={kernel.TYPE_NAMES[self.qtype]}"


def _sources(model: nn.Module) -> dict[str, list[str]]:
    """Fused module name -> its checkpoint parts in row order (the model's `stacked_params`)."""
    parts: dict[str, dict[int, str]] = {}
    for hf, (fused, shard) in getattr(model, "stacked_params", {}).items():
        parts.setdefault(fused, {})[shard] = hf
    return {fused: [by_shard[i] for i in sorted(by_shard)] for fused, by_shard in parts.items()}


def _find(packed: dict[str, PackedTensor], module_path: str) -> PackedTensor | None:
    return packed.get(f"model.{module_path}.weight") or packed.get(f"{module_path}.weight")


def _packed_linear(child: nn.Linear, parts: list[PackedTensor | None]) -> GGUFLinear | None:
    if not parts or any(p is None for p in parts) or len({p.qtype for p in parts}) != 1:
        return None
    if any(p.in_features != child.in_features for p in parts) or \
            sum(p.out_features for p in parts) != child.out_features:
        return None
    blocks = parts[0].blocks if len(parts) == 1 else torch.cat([p.blocks for p in parts])
    return GGUFLinear(blocks, parts[0].qtype, child.in_features, child.bias)


def pack_model(model: nn.Module, packed: dict[str, PackedTensor]) -> nn.Module:
    """Replace every nn.Linear whose weight (all parts of it, for a fused one) `packed` holds in one GGUF type by a
    GGUFLinear, the embedding by a GGUFEmbedding, and give a tied LM head the embedding's blocks. `packed`: HF
    name -> PackedTensor (`GGUFCheckpoint.packed_tensors`), rows already in the model's order."""
    fused = _sources(model)
    swapped, kept = 0, []
    for parent_path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            hf_names = [f"{parent_path}.{hf}" if parent_path else hf for hf in fused.get(name, [name])]
            layer = _packed_linear(child, [_find(packed, p) for p in hf_names])
            if layer is None:
                kept.append(path)
                continue
            setattr(parent, name, layer)
            swapped += 1
    embed = getattr(model, "embed_tokens", None)
    table = packed.get("model.embed_tokens.weight")
    if isinstance(embed, nn.Embedding) and table is not None and table.in_features == embed.embedding_dim \
            and table.out_features == embed.num_embeddings:
        model.embed_tokens = GGUFEmbedding(table.blocks, table.qtype, table.in_features, embed.weight.dtype)
        if getattr(model, "lm_head", "absent") is None:       # tied: the LM head multiplies by the same blocks
            model.lm_head = GGUFLinear(model.embed_tokens.blocks, table.qtype, table.in_features)
            swapped += 1
    logger.info("gguf: %d linear layers run on packed GGUF blocks; %d kept in fp32%s", swapped, len(kept),
                f" ({', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''})" if kept else "")
    return model


__all__ = ["GGUFEmbedding", "GGUFLinear", "PACKED_TYPES", "pack_model"]
