"""Tensor parallelism as a post-load pass: narrow a loaded layer's weights in place to one rank's shard.

A model's `shard_tensor_parallel(tp)` runs after its full weights are loaded (and before quantization). Each layer
keeps this rank's slice of its heads / intermediate dims and all-reduces its output over `tp` after the row-parallel
projection that ends it; embedding, LM head, norms and routers stay whole on every rank.

    column-parallel (output rows split; a fused weight by segments: qkv = [q | k | v], gate_up = [gate | up])
        -> row-parallel (input columns split) -> all_reduce

Every narrowing replaces `param.data` with a contiguous copy of the kept rows, so the full tensor is freed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from deepserve.layers.rank_group import RankGroup

# (start, length) along one dimension of the full tensor.
Piece = tuple[int, int]


def split_evenly(total: int, tp: RankGroup, field: str) -> int:
    """`total` (of config field `field`) per rank; ValueError unless tp.size divides it."""
    if total % tp.size:
        raise ValueError(f"{field} = {total} is not divisible by the tensor-parallel size {tp.size}")
    return total // tp.size


def split_kv_heads(num_kv_heads: int, tp: RankGroup, field: str = "num_key_value_heads") -> tuple[int, int]:
    """(local kv heads, this rank's first kv head). Split when tp divides the kv heads; replicated when the kv heads
    divide tp (rank r keeps head r * kv // tp: the one its query heads share); else ValueError."""
    if num_kv_heads % tp.size == 0:
        local = num_kv_heads // tp.size
        return local, tp.rank * local
    if tp.size % num_kv_heads == 0:
        return 1, tp.rank * num_kv_heads // tp.size
    raise ValueError(f"{field} = {num_kv_heads} neither divides nor is divisible by the tensor-parallel size "
                     f"{tp.size}")


def even_pieces(sizes: Sequence[int], tp: RankGroup, field: str) -> list[Piece]:
    """This rank's piece of each segment of a fused dimension made of `sizes` (each split evenly)."""
    pieces, offset = [], 0
    for size in sizes:
        local = split_evenly(size, tp, field)
        pieces.append((offset + tp.rank * local, local))
        offset += size
    return pieces


def narrow_parameter(param: nn.Parameter | torch.Tensor, dim: int, pieces: Sequence[Piece]) -> None:
    """Keep `pieces` of `param` along `dim`, concatenated in order, in a fresh contiguous tensor (in place)."""
    with torch.no_grad():
        kept = [param.data.narrow(dim, start, length) for start, length in pieces]
        param.data = (torch.cat(kept, dim=dim) if len(kept) > 1 else kept[0]).clone(
            memory_format=torch.contiguous_format)


def shard_column(linear: nn.Linear, pieces: Sequence[Piece]) -> None:
    """A column-parallel Linear: keep output rows `pieces` (weight and bias)."""
    narrow_parameter(linear.weight, 0, pieces)
    if linear.bias is not None:
        narrow_parameter(linear.bias, 0, pieces)
    linear.out_features = linear.weight.shape[0]


def shard_row(linear: nn.Linear, piece: Piece, tp: RankGroup) -> None:
    """A row-parallel Linear: keep input columns `piece`. Its bias is added once, after the all-reduce would sum
    it tp times: rank 0 keeps it, the others zero theirs."""
    narrow_parameter(linear.weight, 1, [piece])
    linear.in_features = linear.weight.shape[1]
    if linear.bias is not None and tp.rank != 0:
        with torch.no_grad():
            linear.bias.zero_()


__all__ = ["Piece", "even_pieces", "narrow_parameter", "shard_column", "shard_row", "split_evenly",
           "split_kv_heads"]
