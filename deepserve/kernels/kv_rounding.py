"""How the Triton kernels put keys and values into a KV cache of any dtype (`store_rounded`) and read fp8 ones back
(`widen_keys`, `widen_values`, `for_products`).

A cache of the activations' dtype takes the values as they are. An 8-bit float cache (kv_cache_dtype "fp8" = E4M3,
"fp8_e5m2") takes them clamped to the format's largest finite value, then rounded to nearest (ties to even): the
reference's `to_cache_dtype` (kernels/reference/attention.py) and the C kernels' fp8_narrow (kernels/cpu/kv_fp8.h)
round the same way, so an outlier key becomes the largest value on every path, never NaN. Readers widen the codes
back to the activations' dtype before their products (`widen_keys`, `widen_values`: kernels/paged_attention.py,
kernels/paged_prefill.py, kernels/mla_decode.py).
"""

from deepserve import envs
from deepserve.kernels import HAS_TRITON, INTERPRET, tl, triton


@triton.jit
def store_rounded(ptr, x, mask):
    """tl.store(ptr, x) into a cache element (of ptr's type), saturating 8-bit floats; the branch is taken at compile
    time, so other caches compile to the plain store. The limits are torch.finfo(float8_e4m3fn / float8_e5m2).max."""
    ty = ptr.dtype.element_ty
    if ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    elif ty == tl.float8e5:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -57344.0), 57344.0)
    tl.store(ptr, x.to(ty), mask=mask)


# Where an 8-bit float tile widens (DEEPSERVE_FP8_WIDEN, read at import; the interpreter has no inline PTX, so it
# always widens the plain way): 0 "late", wherever Triton puts the conversion; 1 "values", the value tiles in the
# registers they were loaded into; 2 "all", key tiles too.
FP8_WIDEN = tl.constexpr(0 if INTERPRET else {"late": 0, "values": 1, "all": 2}[envs.DEEPSERVE_FP8_WIDEN]) \
    if HAS_TRITON else 0


# DEEPSERVE_FP8_PRODUCTS=f16 (the default; read at import): decode attention over an fp8 cache runs its products in
# float16 for bf16 activations. E4M3 codes widen to fp16 in one conversion per pair and E5M2 codes are fp16's high
# byte, where bf16 takes three more instructions per pair; with bf16 products the fp8 kernels spent the bf16 kernels'
# time on half the bytes. On an H200 (fp8_attention_kernels_s30_h200.json, one layer's call, E4M3): Llama-3-8B batch
# 64 at 4k 267 -> 193 us (bf16 cache: 261), Llama-3.2-1B batch 64 at 4k 155 -> 122 (143), V2-Lite batch 256 at 1k
# 129 -> 103 (109); "activations" keeps bf16 products.
FP8_F16_PRODUCTS = tl.constexpr(envs.DEEPSERVE_FP8_PRODUCTS == "f16") if HAS_TRITON else False


@triton.jit
def for_products(x, cache_ptr):
    """A bf16 query tile x in the dtype a decode kernel's products over `cache_ptr`'s cache run in: with
    FP8_F16_PRODUCTS and an fp8 cache, float16 (clamped to its largest finite value, which no query of a working
    model reaches; bf16's 8 mantissa bits fit fp16's 11 exactly above 2^-14), else x unchanged."""
    FP8_CACHE: tl.constexpr = cache_ptr.dtype.element_ty == tl.float8e4nv or cache_ptr.dtype.element_ty == tl.float8e5
    if FP8_F16_PRODUCTS and FP8_CACHE and x.dtype == tl.bfloat16:
        return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        return x


@triton.jit
def widen_in_registers(x, dtype: tl.constexpr, WANTED: tl.constexpr):
    """x.to(dtype); with WANTED, an 8-bit float x widens in the layout it was loaded in, before a register move
    that Triton cannot see through (so it cannot move the conversion past it)."""
    if WANTED and (x.dtype == tl.float8e4nv or x.dtype == tl.float8e5):
        y = x.to(dtype)
        # One 32-bit register a move: two 16-bit elements packed in it, or one 32-bit element (a float32 model).
        PACK: tl.constexpr = 32 // y.dtype.primitive_bitwidth
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [y], dtype=y.dtype, is_pure=False, pack=PACK)
    return x.to(dtype)


@triton.jit
def widen_values(x, dtype: tl.constexpr):
    """A cache tile used as the values of p @ v (reduced over its tokens), in `dtype`. Left to itself, Triton
    converts an 8-bit tile after the shared-memory load that lays it out for the product; read transposed there,
    8-bit elements go one byte a load (ldmatrix transposes only 16-bit ones). Widened in registers first, the
    tile reaches shared memory as 16-bit elements that ldmatrix transposes. On an H200 (one layer's decode call,
    E4M3 cache, fp8_attention_kernels_h200.json): Llama-3-8B batch 64 at 4k 437 -> 256 us (bf16 cache: 254),
    DeepSeek-V2-Lite batch 256 at 1k 186 -> 118 us (bf16: 104). Values stored transposed in each block instead
    ([KV heads, head_dim, slots], read like keys, no round trip) lost on an H200 in session 37: Qwen3-MoE batch 256
    88.8 -> 103.3 us, Llama-3-8B batch 256 170.1 -> 195.2 (gqa_values_transposed_h200_s37.json; the kernel keeps that
    read as DecodeTiles.values_t for a test with 64-slot blocks, gpu_pending.sh values-t64)."""
    return widen_in_registers(x, dtype, FP8_WIDEN >= 1)


@triton.jit
def widen_keys(x, dtype: tl.constexpr):
    """A cache tile used as the keys of q @ k^T, in `dtype`: read along its rows, an 8-bit tile loads from shared
    memory four bytes at a time, so it widens wherever Triton puts it unless DEEPSERVE_FP8_WIDEN=all."""
    return widen_in_registers(x, dtype, FP8_WIDEN >= 2)


__all__ = ["FP8_F16_PRODUCTS", "FP8_WIDEN", "for_products", "store_rounded", "widen_keys", "widen_values"]
