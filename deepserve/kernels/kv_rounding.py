"""How the Triton kernels put keys and values into a KV cache of any dtype: `store_rounded`.

A cache of the activations' dtype takes the values as they are. An 8-bit float cache (kv_cache_dtype "fp8" = E4M3,
"fp8_e5m2") takes them clamped to the format's largest finite value, then rounded to nearest (ties to even): the
reference's `to_cache_dtype` (kernels/reference/attention.py) and the C kernels' fp8_narrow (kernels/cpu/kv_fp8.h)
round the same way, so an outlier key becomes the largest value on every path, never NaN. Readers widen the codes
back to the activations' dtype before their products (kernels/paged_attention.py, kernels/paged_prefill.py).
"""

from deepserve.kernels import tl, triton


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


__all__ = ["store_rounded"]
