"""`quantization="gguf"`: a GGUF model's quantized matrices stay in GGUF's packed blocks (Q4_1, Q8_0) on the CPU.

`GGUFLinear` multiplies by the blocks in C (kernels/cpu/gguf_linear.c) with fp32 activations: the weights are
exactly the file's and results equal the dequantized fp32 model's up to the order of the sums, while a decode step
reads 4.5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of 32. `quantization="gguf_a8"`: the same weights, repacked
at load, times activations quantized to int8 per 32-block (kernels/cpu/gguf_a8.c: llama.cpp's numerics, integer dot
products; a default-model decode step 3.27 against 5.49 ms on an AMX Xeon, docs/cpu.md); prefill chunks of MANY_ROWS
rows and more still run dequantize + sgemm with fp32 activations. `GGUFEmbedding` dequantizes only the rows it looks up.
`pack_model` swaps them in after the usual (dequantizing) load: a fused projection (qkv_proj, gate_up_proj)
concatenates the rows of its parts' blocks, a tied LM head multiplies by the embedding's blocks. A matrix stored in
another type (F32, K-quants) keeps its fp32 Linear.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from deepserve.kernels.cpu import gguf_a8
from deepserve.kernels.cpu import gguf_linear as kernel
from deepserve.loader.gguf_loader import PackedTensor

logger = logging.getLogger(__name__)

# The ggml types GGUFLinear takes.
PACKED_TYPES = tuple(kernel.BLOCK_BYTES)


class GGUFLinear(nn.Module):
    """`blocks`: the file's rows of blocks. With `int8_activations` they are kept repacked (`gguf_a8.repack`, the
    same bytes per row in another order) and the input is quantized to int8 per 32-block."""

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None = None,
                 int8_activations: bool = False) -> None:
        super().__init__()
        kernel.check_blocks(blocks, qtype, in_features)
        self.int8_activations = int8_activations
        blocks = gguf_a8.repack(blocks, qtype, in_features) if int8_activations else blocks.contiguous()
        self.register_buffer("blocks", blocks)
        self.qtype, self.in_features, self.out_features = qtype, in_features, blocks.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # library and vector code looked up once, here
        gemm = gguf_a8.PackedGemmA8 if int8_activations else kernel.PackedGemm
        self.gemm = gemm(qtype, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.float()
        out = self.gemm(flat, self.blocks)
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        if self.int8_activations:
            return gguf_a8.dequantize(self.blocks, self.qtype, self.in_features)
        return kernel.dequantize(self.blocks, self.qtype, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={kernel.TYPE_NAMES[self.qtype]}, bias={self.bias is not None}"
                + (", int8 activations" if self.int8_activations else ""))


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


def _packed_linear(child: nn.Linear, parts: list[PackedTensor | None], int8_activations: bool) -> GGUFLinear | None:
    if not parts or any(p is None for p in parts) or len({p.qtype for p in parts}) != 1:
        return None
    if any(p.in_features != child.in_features for p in parts) or \
            sum(p.out_features for p in parts) != child.out_features:
        return None
    blocks = parts[0].blocks if len(parts) == 1 else torch.cat([p.blocks for p in parts])
    return GGUFLinear(blocks, parts[0].qtype, child.in_features, child.bias, int8_activations)


def pack_model(model: nn.Module, packed: dict[str, PackedTensor], int8_activations: bool = False) -> nn.Module:
    """Replace every nn.Linear whose weight (all parts of it, for a fused one) `packed` holds in one GGUF type by a
    GGUFLinear, the embedding by a GGUFEmbedding, and give a tied LM head the embedding's blocks (`int8_activations`:
    a repacked copy of them, while the embedding keeps the file's layout for its row lookups). `packed`: HF name ->
    PackedTensor (`GGUFCheckpoint.packed_tensors`), rows already in the model's order."""
    fused = _sources(model)
    swapped, kept = 0, []
    for parent_path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            hf_names = [f"{parent_path}.{hf}" if parent_path else hf for hf in fused.get(name, [name])]
            layer = _packed_linear(child, [_find(packed, p) for p in hf_names], int8_activations)
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
            model.lm_head = GGUFLinear(model.embed_tokens.blocks, table.qtype, table.in_features,
                                       int8_activations=int8_activations)
            swapped += 1
    logger.info("gguf: %d linear layers run on packed GGUF blocks (%s activations); %d kept in fp32%s", swapped,
                "int8" if int8_activations else "fp32", len(kept),
                f" ({', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''})" if kept else "")
    return model


__all__ = ["GGUFEmbedding", "GGUFLinear", "PACKED_TYPES", "pack_model"]
