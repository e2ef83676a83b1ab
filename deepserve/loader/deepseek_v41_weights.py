"""DeepSeek-V4.1-Flash checkpoints in their released format (spec §3, §2.14, §16.3): read, validate, dequantize.

A checkpoint directory holds `model.safetensors.index.json` (`weight_map`: tensor name -> shard file) and the
shards. Names appear with or without a `model.` prefix and are otherwise the model's own parameter names
(`layers.3.attn.wq_a.weight`, `layers.0.hc_attn_fn`, `mtp.0.main_proj.weight`, ...). A tensor is quantized
exactly when a sibling `<module>.scale` (F8_E8M0, value 2^(e-127)) exists (§16.1, §16.3):

    format     stored weight                      scale                         used for (§2.14)
    fp8        F8_E4M3 [out, in]                  [ceil(out/32), ceil(in/32)]   attention and shared-expert
                                                                                projections, indexer.wq_b,
                                                                                engram.wkv, main_proj
    fp4        I8 (U8 accepted) [out, in/2]       [out, ceil(in/32)]            routed experts w1 / w2 / w3
    fp8_rows   F8_E4M3 [rows, head_dim]           [rows, ceil(head_dim/32)]     the Engram tables
    f32        F32, no scale                                                    hc_*, attn_sink, gate.bias(_vl)
    plain      BF16 (F32 accepted), no scale                                    everything else

`load_weights(model_dir, targets)` validates the whole checkpoint from the shard headers first (every index entry
in its shard, no separate HC norm tensors, F32 where §3 demands it, each quantized weight with a well-formed
scale, every target covered with the right shape, nothing left over), then yields (name, float tensor) pairs in
the model's names, dequantized. Every problem is a CheckpointFormatError naming the tensor. Optionally the
gate/up projections of each expert are merged, `w13 = concat(w1, w3)` along the output dim (§3 "Merges"):
deepserve's reference model keeps w1 / w3 separate, so the merge is off by default.

Not done here (single process, §3): expert-parallel placement (each rank loading only its physical expert slots),
Engram row sharding across ranks, the 30-minute load watchdog. Vision weights (`vision.*`, `aligner.*`) and the
draft blocks' tied `mtp.{i}.embed` / `mtp.{i}.head` copies are skipped.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from deepserve.loader.fp4 import PACKED_DTYPES, dequantize_fp4, fp4_scale_shape
from deepserve.loader.fp8 import E8M0_BLOCK, E8M0_NAN, dequantize_block_fp8_e8m0, e8m0_bytes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PREFIX = "model."
SCALE_SUFFIX = ".scale"
WEIGHT_SUFFIX = ".weight"

F32, PLAIN, FP8, FP4, FP8_ROWS, INT_TABLE = "f32", "plain", "fp8", "fp4", "fp8_rows", "int_table"
ENGRAM_ROW_BLOCK = (1, E8M0_BLOCK[1])        # one scale per row and 32 columns (§3 "per-row scales")

# Roles by name (§2.14, §2.12 "HC, sinks, gate bias fp32", §16.3).
F32_ROLE = re.compile(r"(^|\.)(hc_(attn|ffn|head)_(base|fn|scale)|attn\.attn_sink|ffn\.gate\.bias(_vl)?)$")
ROUTED_EXPERT = re.compile(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$")
ENGRAM_TABLE = re.compile(r"(^|\.)engram\.embed\.weight$")
FP8_ROLE = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                      r"|engram\.wkv|main_proj)\.weight$")
# DeepSeek-V4's hash-routed layers: token id -> expert ids, an integer table kept as stored.
INDEX_TABLE = re.compile(r"(^|\.)ffn\.gate\.tid2eid$")
INT_TABLE_DTYPES = ("I64", "I32", "I16", "I8", "U8")
# §3: the HC pre-norm weight must already be folded into fn; a separate tensor for it is an error.
HC_NORM = re.compile(r"(^|\.)hc_[a-z_]*norm(\.|$)")
# Not the text model's: draft copies of the tied embedding / head (§3), the vision tower (text-only reader).
IGNORED = re.compile(r"^(mtp\.\d+\.(embed|head)\.|vision\.|aligner\.)")
GATE_UP = re.compile(r"^(.*(?:^|\.)(?:shared_experts|experts\.\d+))\.w([13])\.weight$")

TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
                "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                "BOOL": torch.bool}
PACKED_FP4_DTYPES = {name for name, dt in TORCH_DTYPES.items() if dt in PACKED_DTYPES}
PLAIN_DTYPES = ("BF16", "F32")


class CheckpointFormatError(ValueError):
    """The checkpoint does not follow the released format; the message names every offending tensor."""


def released_format(name: str) -> str:
    """The storage format §2.14 gives the tensor `name` (model name, no prefix) in the released checkpoint."""
    if F32_ROLE.search(name):
        return F32
    if INDEX_TABLE.search(name):
        return INT_TABLE
    if ROUTED_EXPERT.search(name):
        return FP4
    if ENGRAM_TABLE.search(name):
        return FP8_ROWS
    if FP8_ROLE.search(name):
        return FP8
    return PLAIN


def scale_name(weight_name: str) -> str:
    """`<module>.weight` -> `<module>.scale` (§16.3)."""
    return weight_name[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ================================================================================================ headers


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a shard header describes it (nothing loaded)."""
    stored_name: str            # as in the checkpoint (maybe with the `model.` prefix)
    shard: str                  # path of its shard file
    dtype: str                  # safetensors dtype string: "F8_E4M3", "BF16", ...
    shape: tuple[int, ...]


def read_safetensors_header(path: str) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON): names, dtypes, shapes."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def read_weight_map(model_dir: str) -> dict[str, str]:
    """Stored tensor name -> shard file name, from the index (or a lone model.safetensors without one)."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if not os.path.isfile(index_path):
        single = os.path.join(model_dir, SINGLE_FILE)
        if os.path.isfile(single):
            return dict.fromkeys(read_safetensors_header(single), SINGLE_FILE)
        raise CheckpointFormatError(f"{model_dir}: no {INDEX_FILE} (and no {SINGLE_FILE})")
    with open(index_path) as f:
        index = json.load(f)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointFormatError(f"{index_path}: no weight_map")
    return weight_map


def read_checkpoint(model_dir: str) -> dict[str, StoredTensor]:
    """Canonical name (no `model.` prefix) -> its header entry, for every index entry. Fails when an index entry
    is missing from its shard (or the shard is missing) and when a name appears both with and without prefix."""
    weight_map = read_weight_map(model_dir)
    headers: dict[str, dict[str, Any]] = {}
    problems = []
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(model_dir, shard)
        if os.path.isfile(path):
            headers[shard] = read_safetensors_header(path)
    tensors: dict[str, StoredTensor] = {}
    for stored, shard in weight_map.items():
        if shard not in headers:
            problems.append(f"{stored}: its shard {shard} (from the index) does not exist")
            continue
        entry = headers[shard].get(stored)
        if entry is None:
            problems.append(f"{stored}: listed in the index under {shard}, but that shard has no such tensor")
            continue
        name = stored[len(PREFIX):] if stored.startswith(PREFIX) else stored
        if name in tensors:
            problems.append(f"{name}: stored twice ({tensors[name].stored_name!r} and {stored!r})")
            continue
        tensors[name] = StoredTensor(stored, os.path.join(model_dir, shard), entry["dtype"], tuple(entry["shape"]))
    raise_if(problems, f"{model_dir}: index and shards disagree")
    return tensors


def raise_if(problems: Sequence[str], heading: str, limit: int = 20) -> None:
    if problems:
        more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
        raise CheckpointFormatError(f"{heading}:\n  " + "\n  ".join(problems[:limit]) + more)


# ================================================================================================ roles, dtypes


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor in the model's terms: its format, its logical [out, in] shape, its scale if any."""
    name: str
    fmt: str
    weight: StoredTensor
    scale: StoredTensor | None
    shape: tuple[int, ...]      # logical (dequantized) shape


def classify(name: str, weight: StoredTensor, scale: StoredTensor | None) -> tuple[Source | None, list[str]]:
    """The stored format of `name` from its dtype and scale, checked against its role; (None, problems) if bad."""
    if scale is None:
        return classify_unquantized(name, weight)
    return classify_quantized(name, weight, scale)


def classify_unquantized(name: str, weight: StoredTensor) -> tuple[Source | None, list[str]]:
    if released_format(name) == F32:
        fmt, ok, want = F32, weight.dtype == "F32", "F32 (§3: HC fn/base/scale, sinks and gate biases are F32)"
    elif released_format(name) == INT_TABLE:
        fmt, ok, want = INT_TABLE, weight.dtype in INT_TABLE_DTYPES, "an integer type (a token -> expert table)"
    else:
        fmt, ok, want = PLAIN, weight.dtype in PLAIN_DTYPES, "BF16 or F32 (a quantized weight needs a sibling .scale)"
    if not ok:
        return None, [f"{name}: dtype {weight.dtype}, must be {want}"]
    return Source(name, fmt, weight, None, weight.shape), []


def scale_shape(fmt: str, shape: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a [out, in] weight: per row and 32 inputs (FP4, Engram rows) or 32 x 32 blocks (FP8)."""
    out, k = shape
    if fmt == FP4:
        return fp4_scale_shape(out, k)
    if fmt == FP8_ROWS:
        return out, ceil_div(k, ENGRAM_ROW_BLOCK[1])
    return ceil_div(out, E8M0_BLOCK[0]), ceil_div(k, E8M0_BLOCK[1])


def classify_quantized(name: str, weight: StoredTensor, scale: StoredTensor) -> tuple[Source | None, list[str]]:
    # Any weight with a scale is dequantized (§16.1); routed experts are FP4, Engram tables FP8 rows, others FP8.
    role = released_format(name)
    fmt = role if role in (FP4, FP8_ROWS) else FP8
    problems = []
    if scale.dtype != "F8_E8M0":
        problems.append(f"{scale_name(name)}: dtype {scale.dtype}, must be F8_E8M0")
    if weight.dtype not in (PACKED_FP4_DTYPES if fmt == FP4 else {"F8_E4M3"}):
        kind = "a routed expert: packed FP4 (I8 or U8)" if fmt == FP4 else "FP8 (F8_E4M3)"
        problems.append(f"{name}: quantized (has {scale_name(name)}) with dtype {weight.dtype}; must be {kind}")
    if len(weight.shape) != 2:
        problems.append(f"{name}: a quantized weight must be 2-D, got shape {list(weight.shape)}")
    if problems:
        return None, problems
    out, k = weight.shape
    shape = (out, 2 * k) if fmt == FP4 else (out, k)          # FP4 packs two inputs per byte
    if scale.shape != scale_shape(fmt, shape):
        return None, [f"{scale_name(name)}: shape {list(scale.shape)}, a {fmt} scale of the {list(shape)} weight "
                      f"{name} must be {list(scale_shape(fmt, shape))}"]
    return Source(name, fmt, weight, scale, shape), []


def sources_of(tensors: Mapping[str, StoredTensor]) -> dict[str, Source]:
    """Pair every weight with its scale and classify it; reject HC norm tensors and orphan scales."""
    problems = []
    for name in tensors:
        if HC_NORM.search(name):
            problems.append(f"{name}: a separate HC norm tensor; the HC pre-norm weight must be folded into the "
                            f"hc_*_fn matrix (§3)")
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] + WEIGHT_SUFFIX not in tensors:
            problems.append(f"{name}: a scale without its weight {name[:-len(SCALE_SUFFIX)] + WEIGHT_SUFFIX}")
    sources: dict[str, Source] = {}
    for name, weight in tensors.items():
        if name.endswith(SCALE_SUFFIX) or IGNORED.search(name):
            continue
        scale = tensors.get(scale_name(name)) if name.endswith(WEIGHT_SUFFIX) else None
        source, bad = classify(name, weight, scale)
        problems += bad
        if source is not None:
            sources[name] = source
    raise_if(problems, "checkpoint tensors not in the released format")
    return sources


# ================================================================================================ targets, coverage


@dataclass(frozen=True)
class Target:
    """A model parameter to fill: its shape and, optionally, the exact dtype the stored tensor must have."""
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


def targets_of(state_dict: Mapping[str, Any], exact_dtypes: bool = False) -> dict[str, Target]:
    """Targets from a model's state dict (or any name -> tensor / shape mapping). With `exact_dtypes`, each
    unquantized stored tensor must have exactly the parameter's dtype (§3 "each target's dtype must match
    exactly"), and dequantized ones are produced in it."""
    targets = {}
    for name, value in state_dict.items():
        if isinstance(value, Target):
            targets[name] = value
        elif isinstance(value, torch.Tensor):
            targets[name] = Target(tuple(value.shape), value.dtype if exact_dtypes else None)
        else:
            targets[name] = Target(tuple(value))
    return targets


def merge_gate_up_targets(targets: Mapping[str, Target]) -> dict[str, Target]:
    """The targets of a model that merges each expert's w1 and w3 into `w13` [2I, H] (§3 "Merges")."""
    merged: dict[str, Target] = {}
    for name, target in targets.items():
        match = GATE_UP.match(name)
        if match is None:
            merged[name] = target
        elif match.group(2) == "1":
            w3 = targets.get(f"{match.group(1)}.w3.weight")
            if w3 is None or w3.shape[1:] != target.shape[1:]:
                raise ValueError(f"{name}: no matching {match.group(1)}.w3.weight to merge with")
            merged[f"{match.group(1)}.w13.weight"] = Target((target.shape[0] + w3.shape[0], *target.shape[1:]),
                                                            target.dtype)
    return merged


@dataclass(frozen=True)
class Planned:
    """How one target is produced: its sources (two for a merged w13), concatenated along dim 0."""
    name: str
    parts: tuple[Source, ...]
    target: Target


def group_sources(sources: Mapping[str, Source], merge_gate_up: bool) -> dict[str, tuple[Source, ...]]:
    """Model name -> its sources: itself, or (w1, w3) of an expert when merging (a missing half stays missing)."""
    groups: dict[str, tuple[Source, ...]] = {}
    for name, source in sources.items():
        match = GATE_UP.match(name) if merge_gate_up else None
        if match is None:
            groups[name] = (source,)
        elif match.group(2) == "1":
            w3 = sources.get(f"{match.group(1)}.w3.weight")
            groups[f"{match.group(1)}.w13.weight"] = (source,) if w3 is None else (source, w3)
    return groups


def check_part_shapes(name: str, parts: Sequence[Source], target: Target) -> list[str]:
    if ENGRAM_TABLE.search(name):
        # The table may be stored with pad rows beyond the model's Σ primes (§2.14 "(padded)"); they are dropped.
        shape = parts[0].shape
        if len(shape) != len(target.shape) or shape[1:] != target.shape[1:] or shape[0] < target.shape[0]:
            return [f"{name}: shape {list(shape)}, the model expects {list(target.shape)} (pad rows allowed)"]
        return []
    if len(parts) == 2:
        if parts[0].shape != parts[1].shape:
            return [f"{name}: cannot merge {parts[0].name} {list(parts[0].shape)} with {parts[1].name} "
                    f"{list(parts[1].shape)}"]
        shape = (parts[0].shape[0] + parts[1].shape[0], *parts[0].shape[1:])
    else:
        shape = parts[0].shape
    if shape != target.shape:
        stored = "" if parts[0].shape == parts[0].weight.shape else f" (stored {list(parts[0].weight.shape)})"
        return [f"{name}: shape {list(shape)}{stored}, the model expects {list(target.shape)}"]
    return []


def check_target_dtype(parts: Sequence[Source], target: Target) -> list[str]:
    if target.dtype is None:
        return []
    problems = []
    for part in parts:
        if part.scale is None and TORCH_DTYPES.get(part.weight.dtype) != target.dtype:
            problems.append(f"{part.name}: stored {part.weight.dtype}, the model's parameter is {target.dtype} "
                            f"(dtypes must match exactly)")
        elif part.scale is not None and not target.dtype.is_floating_point:
            problems.append(f"{part.name}: quantized, but the model's parameter is {target.dtype}")
    return problems


def plan_weights(model_dir: str, targets: Mapping[str, Target], merge_gate_up: bool = False,
                 allow_unexpected: bool = False) -> list[Planned]:
    """Validate the checkpoint against the targets from the shard headers alone (§3 "coverage is validated
    before loading ... shapes checked from headers"); the load plan in target order."""
    groups = group_sources(sources_of(read_checkpoint(model_dir)), merge_gate_up)
    problems = []
    missing = [name for name in targets if name not in groups]
    if missing:
        problems.append(f"{len(missing)} model parameter(s) not in the checkpoint: {', '.join(missing)}")
    unexpected = [name for name in groups if name not in targets]
    if unexpected and not allow_unexpected:
        problems.append(f"{len(unexpected)} checkpoint tensor(s) the model has no parameter for: "
                        f"{', '.join(unexpected)}")
    plan = []
    for name, target in targets.items():
        parts = groups.get(name)
        if parts is None:
            continue
        if merge_gate_up and name.endswith(".w13.weight") and len(parts) != 2:
            problems.append(f"{name}: merging needs both {parts[0].name} and its w3 partner")
            continue
        problems += check_part_shapes(name, parts, target) + check_target_dtype(parts, target)
        plan.append(Planned(name, parts, target))
    raise_if(problems, f"{model_dir}: checkpoint does not fit the model")
    return plan


# ================================================================================================ loading


def dequantize(source: Source, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The real float32 value of one stored tensor."""
    if scale is not None and bool((e8m0_bytes(scale) == E8M0_NAN).any()):
        raise CheckpointFormatError(f"{scale_name(source.name)}: E8M0 byte 255 (NaN) in a scale")
    if source.fmt == FP4:
        return dequantize_fp4(weight, scale)
    if source.fmt == FP8:
        return dequantize_block_fp8_e8m0(weight, scale, E8M0_BLOCK)
    if source.fmt == FP8_ROWS:
        return dequantize_block_fp8_e8m0(weight, scale, ENGRAM_ROW_BLOCK)
    if source.fmt == INT_TABLE:
        return weight.long()
    return weight.float()


def load_weights(model_dir: str, targets: Mapping[str, Any], merge_gate_up: bool = False,
                 dtype: torch.dtype = torch.float32, allow_unexpected: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Validate (all of it, before reading any data), then yield (model name, tensor) for every target, in target
    order: dequantized, merged when asked, in the target's dtype when it has one, else in `dtype`. `targets` is a
    name -> Target mapping, or a state dict (see targets_of)."""
    targets = targets_of(targets)
    plan = plan_weights(model_dir, targets, merge_gate_up, allow_unexpected)
    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def get(stored: StoredTensor) -> torch.Tensor:
            if stored.shard not in handles:
                handles[stored.shard] = stack.enter_context(safe_open(stored.shard, framework="pt"))
            return handles[stored.shard].get_tensor(stored.stored_name)

        for item in plan:
            values = [dequantize(p, get(p.weight), None if p.scale is None else get(p.scale)) for p in item.parts]
            value = values[0] if len(values) == 1 else torch.cat(values, dim=0)
            if value.shape[0] > item.target.shape[0]:
                value = value[: item.target.shape[0]]              # Engram pad rows
            yield item.name, value.to(item.target.dtype or (dtype if value.is_floating_point() else value.dtype))


def load_state_dict(model_dir: str, targets: Mapping[str, Any], **kwargs: Any) -> dict[str, torch.Tensor]:
    """`dict(load_weights(...))`: a state dict for `module.load_state_dict(..., strict=True)`."""
    return dict(load_weights(model_dir, targets, **kwargs))
