"""One decode step of a whole Llama-style decoder stack in one C call (llama_decode.c), and its PyTorch twin.

Weights stay GGUF's packed blocks (Q4_1 / Q8_0, gguf_linear.c's GEMVs) or plain float32 / int8 rows (F32: the
dequantized model's, I8: quantization="int8" / "w8a8"'s), activations fp32, the KV cache paged (fp32, bf16 or fp8).
At batch 1 the module path spends as long in Python and small PyTorch ops as in the GEMVs; here the ~25 ops per layer
are loops between the GEMVs of one C call per step. `DecodeStack` holds the tensors (their pointers sit in C structs
built once); `decode_step_ref` computes the same step with PyTorch ops and dequantized weights.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from deepserve.kernels.cpu import build as _build
from deepserve.kernels.cpu import enabled
from deepserve.kernels.cpu import gguf_a8
from deepserve.kernels.cpu import gguf_linear as gk
from deepserve.kernels.cpu import isa
from deepserve.kernels.reference.attention import gather_blocks, masked_decode_attention, write_kv
from deepserve.kernels.reference.norm import rms_norm
from deepserve.kernels.reference.rotary import apply_rotate_half

_SOURCE = Path(__file__).with_name("llama_decode.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

# Cache dtype -> the build of llama_decode.c that reads it (the defines of paged_attention.c, which it includes).
_VARIANTS = {torch.float32: (), torch.bfloat16: ("KV_BF16",), torch.float8_e4m3fn: ("KV_FP8_E4M3",),
             torch.float8_e5m2: ("KV_FP8_E5M2",)}
_ERRORS = {1: "a position outside the rotary cache", 2: "a KV slot outside the cache",
           3: "a block table entry outside the cache", 4: "a sequence length outside its block table (or 0)",
           5: "out of memory"}
# paged_attention.c keeps a head in registers: head_dim a multiple of 32, at most 256.
_HEAD_DIMS = range(32, 257, 32)


class _Mat(ctypes.Structure):
    _fields_ = [("blocks", _P), ("bias", _P), ("rows", _I64), ("qtype", _I64), ("int8_activations", _I64),
                ("scales", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Mat), ("o", _Mat), ("gate_up", _Mat),
                ("down", _Mat), ("k_cache", _P), ("v_cache", _P), ("window", _I64)]


class _Stack(ctypes.Structure):
    _fields_ = [("layers", _P), ("n_layers", _I64), ("hidden", _I64), ("intermediate", _I64), ("heads", _I64),
                ("kv_heads", _I64), ("head_dim", _I64), ("num_blocks", _I64), ("block_size", _I64),
                ("cos", _P), ("sin", _P), ("rotary_len", _I64), ("rotary_stride", _I64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("isa", _I64), ("isa_a8", _I64)]


# The phases llama_decode.c times when built with PHASE_TIMES (its PH_* order).
PHASES = ("norms", "qkv_gemv", "rotary_kv_write", "attention", "o_gemv_add", "gate_up_gemv", "swiglu", "down_gemv_add")


@functools.lru_cache(maxsize=None)
def _load(cache_dtype: torch.dtype, phase_times: bool) -> ctypes.CDLL | None:
    defines = isa.vector_width_defines() + _VARIANTS[cache_dtype] + (("PHASE_TIMES",) if phase_times else ())
    lib = _build.load(_SOURCE, {"llama_decode_phase_times": [_P]}, defines=defines)
    if lib is not None:
        lib.llama_decode_step.argtypes = [_P, _P, _I64, _P, _P, _P, _I64, _P, _INT]
        lib.llama_decode_step.restype = ctypes.c_int
        if hasattr(lib, "kv_fp8_narrow"):
            lib.kv_fp8_narrow.argtypes, lib.kv_fp8_narrow.restype = [_P, _P, _I64], None
    return lib


def fp8_narrow(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The fp8 build's cache-write rounding (kv_fp8.h's fp8_narrow) of every value of fp32 x, as uint8 codes: tests
    hold it against torch (kernels/reference/attention.to_cache_dtype)."""
    lib = library(cache_dtype)
    assert lib is not None and hasattr(lib, "kv_fp8_narrow"), f"no fp8 build for {cache_dtype}"
    x = x.contiguous().float()
    out = torch.empty(x.shape, dtype=torch.uint8)
    lib.kv_fp8_narrow(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def library(cache_dtype: torch.dtype = torch.float32, phase_times: bool = False) -> ctypes.CDLL | None:
    """The kernel for a KV cache of `cache_dtype`; `phase_times`: the build that times its phases (for profiles)."""
    return _load(cache_dtype, phase_times) if enabled() and cache_dtype in _VARIANTS else None


# ggml's type numbers of plain matrices: a PackedWeight of qtype F32 holds the float32 weight [rows, K] itself (the
# dequantized model's Linear, llama_decode.c's f32_gemv); of qtype I8 the int8 weight [rows, K] and its float32 scale
# a row (quantization="int8" / "w8a8"'s Int8Linear, i8_gemv: fp32 activations).
F32, I8 = 0, 24


@dataclass
class PackedWeight:
    """One projection: GGUF blocks uint8 [rows, row_bytes] of ggml type `qtype` (F32: the float32 weight [rows, K];
    I8: the int8 weight [rows, K], with `scales`), an optional fp32 bias [rows]; `int8_activations`: the blocks are in
    gguf_a8's layout (`gguf_a8.repack`) and its input is quantized to int8."""
    blocks: torch.Tensor
    qtype: int
    bias: torch.Tensor | None = None
    int8_activations: bool = False
    scales: torch.Tensor | None = None      # I8: float32 [rows]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor          # [hidden] fp32
    qkv: PackedWeight                 # rows: q heads, then k heads, then v heads
    o: PackedWeight
    post_norm: torch.Tensor
    gate_up: PackedWeight             # rows: gate, then up
    down: PackedWeight
    kv_cache: torch.Tensor            # [2, num_blocks, block_size, kv_heads, head_dim] fp32, bf16 or fp8, contiguous
    window: int = 0                   # > 0: the layer's sliding window (keys a query sees); 0: all keys


@dataclass
class StackShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float


def _fp32_vector(t: torch.Tensor, n: int, what: str) -> None:
    if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.shape != (n,):
        raise ValueError(f"{what}: needs a contiguous fp32 CPU tensor [{n}], got {t.dtype} {tuple(t.shape)}")


def _check_weight(w: PackedWeight, rows: int, k: int, what: str) -> None:
    if w.qtype in (F32, I8):
        dtype = torch.float32 if w.qtype == F32 else torch.int8
        if w.blocks.dtype != dtype or w.blocks.shape != (rows, k) or w.int8_activations:
            raise ValueError(f"{what}: needs a {dtype} [{rows}, {k}] weight, got {w.blocks.dtype} "
                             f"{tuple(w.blocks.shape)}")
        if (w.qtype == I8) != (w.scales is not None):
            raise ValueError(f"{what}: an int8 weight takes its row scales, another none")
        if w.scales is not None:
            _fp32_vector(w.scales, rows, f"{what} scales")
    else:
        gk.check_blocks(w.blocks, w.qtype, k)
    if w.blocks.shape[0] != rows or not w.blocks.is_contiguous() or not w.blocks.is_cpu:
        raise ValueError(f"{what}: needs contiguous CPU blocks with {rows} rows, got {tuple(w.blocks.shape)}")
    if w.bias is not None:
        _fp32_vector(w.bias, rows, f"{what} bias")


def _check_layer(w: LayerWeights, shape: StackShape, cache_shape: tuple, cache_dtype: torch.dtype) -> None:
    e, i, d = shape.hidden, shape.intermediate, shape.head_dim
    _fp32_vector(w.input_norm, e, "input_norm")
    _fp32_vector(w.post_norm, e, "post_norm")
    _check_weight(w.qkv, (shape.heads + 2 * shape.kv_heads) * d, e, "qkv")
    _check_weight(w.o, e, shape.heads * d, "o")
    _check_weight(w.gate_up, 2 * i, e, "gate_up")
    _check_weight(w.down, e, i, "down")
    c = w.kv_cache
    if c.shape != cache_shape or c.dtype != cache_dtype or not c.is_contiguous() or not c.is_cpu:
        raise ValueError(f"kv_cache: every layer needs a contiguous {cache_dtype} CPU cache of the first's shape "
                         f"{cache_shape}; got {c.dtype} {tuple(c.shape)}")


def _mat(w: PackedWeight) -> _Mat:
    return _Mat(w.blocks.data_ptr(), None if w.bias is None else w.bias.data_ptr(), w.blocks.shape[0], w.qtype,
                int(w.int8_activations), None if w.scales is None else w.scales.data_ptr())


class DecodeStack:
    """The C step over fixed layers, caches and rotary tables: built once (the weights' pointers go into C structs
    here, and the tensors are kept alive with them), then `run` per decode step. Raises ValueError for tensors the
    kernel cannot take; check `library(cache dtype)` before building one."""

    def __init__(self, layers: list[LayerWeights], shape: StackShape, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor, isa_name: str | None = None, phase_times: bool = False,
                 a8_isa_name: str | None = None) -> None:
        if not layers:
            raise ValueError("a decode stack needs at least one layer")
        cache = layers[0].kv_cache
        self.lib = library(cache.dtype, phase_times)
        if self.lib is None:
            raise RuntimeError(f"the llama_decode kernel is not available here for a {cache.dtype} KV cache")
        if shape.head_dim not in _HEAD_DIMS or shape.heads % shape.kv_heads or shape.hidden % gk.QK \
                or shape.intermediate % gk.QK or (shape.heads * shape.head_dim) % gk.QK:
            raise ValueError(f"unsupported shape {shape}: head_dim a multiple of 32 up to 256, heads a multiple of "
                             "kv_heads, hidden and intermediate multiples of 32")
        if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[3:] != (shape.kv_heads, shape.head_dim):
            raise ValueError(f"kv_cache: needs [2, blocks, block_size, {shape.kv_heads}, {shape.head_dim}], got "
                             f"{tuple(cache.shape)}")
        for w in layers:
            _check_layer(w, shape, tuple(cache.shape), cache.dtype)
        for t in (cos_cache, sin_cache):
            if t.dtype != torch.float32 or not t.is_cpu or t.dim() != 2 or t.shape[1] != shape.head_dim \
                    or t.stride(1) != 1 or t.stride() != cos_cache.stride() or t.shape != cos_cache.shape:
                raise ValueError("cos/sin caches: fp32 CPU [positions, head_dim] with unit stride along head_dim")
        self.layers, self.shape, self.cos, self.sin = layers, shape, cos_cache, sin_cache
        self.cache_shape = tuple(cache.shape)
        self._layer_structs = (_Layer * len(layers))(*[
            _Layer(w.input_norm.data_ptr(), w.post_norm.data_ptr(), _mat(w.qkv), _mat(w.o), _mat(w.gate_up),
                   _mat(w.down), w.kv_cache[0].data_ptr(), w.kv_cache[1].data_ptr(), w.window) for w in layers])
        self._stack = _Stack(ctypes.addressof(self._layer_structs), len(layers), shape.hidden, shape.intermediate,
                             shape.heads, shape.kv_heads, shape.head_dim, cache.shape[1], cache.shape[2],
                             cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.shape[0], cos_cache.stride(0),
                             shape.eps, shape.scale, gk.ISAS[isa_name or gk.choose_isa()],
                             gguf_a8.ISAS[a8_isa_name or gguf_a8.choose_isa()])
        self._stack_ptr = ctypes.addressof(self._stack)
        self._fn = self.lib.llama_decode_step

    def run(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor) -> torch.Tensor:
        """h [B, hidden] fp32 (the tokens' embeddings; overwritten) -> h, the residual stream after the last layer
        (before the final norm). positions, slots, seq_lens: int64 [B]; block_tables int64 [B, max_blocks]. Each
        layer's key and value are written to its cache at `slots`. IndexError for an index outside the tensors
        (checked in C before anything is written)."""
        b = h.shape[0]
        if h.dtype != torch.float32 or h.dim() != 2 or h.shape[1] != self.shape.hidden or not h.is_contiguous():
            raise ValueError(f"h: needs contiguous fp32 [B, {self.shape.hidden}], got {h.dtype} {tuple(h.shape)}")
        for t in (positions, slots, seq_lens, block_tables):
            if t.dtype != torch.int64 or not t.is_contiguous() or t.shape[0] != b:
                raise ValueError("positions, slots, seq_lens, block_tables: contiguous int64 with one row per token")
        err = self._fn(self._stack_ptr, h.data_ptr(), b, positions.data_ptr(), slots.data_ptr(),
                       block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), torch.get_num_threads())
        if err:
            raise IndexError(f"llama_decode_step: {_ERRORS.get(err, f'error {err}')}")
        return h


    def phase_times(self) -> dict[str, float]:
        """Seconds per phase of the layers (PHASES) summed since the last read, then reset; all zero unless built
        with phase_times=True."""
        out = (ctypes.c_double * len(PHASES))()
        self.lib.llama_decode_phase_times(out)
        return dict(zip(PHASES, out))


def _linear_ref(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    if w.qtype == F32:
        return F.linear(x, w.blocks, w.bias)
    if w.qtype == I8:
        return F.linear(x, w.blocks.float() * w.scales[:, None], w.bias)
    k = w.blocks.shape[1] // gk.BLOCK_BYTES[w.qtype] * gk.QK
    if w.int8_activations:
        y = gguf_a8.linear_ref(x, gguf_a8.unpack_ref(w.blocks, w.qtype, k), w.qtype, k)
        return y if w.bias is None else y + w.bias
    return F.linear(x, gk.dequantize_ref(w.blocks, w.qtype, k), w.bias)


def decode_step_ref(h: torch.Tensor, layers: list[LayerWeights], shape: StackShape, cos_cache: torch.Tensor,
                    sin_cache: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor) -> torch.Tensor:
    """The PyTorch twin of DecodeStack.run (same arguments, a new tensor out; the caches are written the same way)."""
    b, hd, kvh, d = h.shape[0], shape.heads, shape.kv_heads, shape.head_dim
    h = h.clone()
    cos, sin = cos_cache[positions].unsqueeze(1), sin_cache[positions].unsqueeze(1)
    block_size = layers[0].kv_cache.shape[2]
    key_pos = torch.arange(block_tables.shape[1] * block_size)[None, :]
    for w in layers:
        mask = key_pos < seq_lens[:, None]
        if w.window > 0:
            mask &= key_pos >= seq_lens[:, None] - w.window
        qkv = _linear_ref(rms_norm(h, w.input_norm, shape.eps), w.qkv)
        q, k, v = qkv.split([hd * d, kvh * d, kvh * d], dim=1)
        q = apply_rotate_half(q.reshape(b, hd, d), cos, sin)
        k = apply_rotate_half(k.reshape(b, kvh, d), cos, sin)
        write_kv(w.kv_cache, k, v.reshape(b, kvh, d), slots)
        keys = gather_blocks(w.kv_cache[0], block_tables).flatten(1, 2)
        values = gather_blocks(w.kv_cache[1], block_tables).flatten(1, 2)
        attn = masked_decode_attention(q, keys, values, mask, shape.scale).reshape(b, hd * d)
        h = _linear_ref(attn, w.o) + h
        gate, up = _linear_ref(rms_norm(h, w.post_norm, shape.eps), w.gate_up).chunk(2, dim=-1)
        h = _linear_ref(F.silu(gate) * up, w.down) + h
    return h


__all__ = ["F32", "I8", "DecodeStack", "LayerWeights", "PHASES", "PackedWeight", "StackShape", "decode_step_ref",
           "library"]
