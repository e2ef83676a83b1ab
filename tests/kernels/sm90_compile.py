"""Compile a Triton kernel for an H100/H200 (sm_90) on a machine without a GPU: Triton's compiler and the ptxas it
ships take the kernel down to a cubin, so a GPU-only path (inline PTX, Hopper instructions, dynamic loop bounds)
is at least known to compile before any GPU runs it."""

from __future__ import annotations


def compile_for_sm90(kernel, pointer_types: dict, constexprs: dict, scalar_types: dict | None = None,
                     divisible_by_16: tuple = ()) -> str:
    """The kernel's PTX, compiled (through ptxas, into a cubin) for sm_90 on this GPU-less machine: pointers typed
    by `pointer_types` (default bf16), other arguments by `scalar_types`, else int32 (float32 where named `*_eps` or
    `scale*`). Arguments named in `divisible_by_16` carry the hint Triton's launcher gives a pointer or integer that
    is a multiple of 16 (the vectorized loads of a real launch follow from it)."""
    return compile_sm90_kernel(kernel, pointer_types, constexprs, scalar_types, divisible_by_16).asm["ptx"]


def compile_sm90_kernel(kernel, pointer_types: dict, constexprs: dict, scalar_types: dict | None = None,
                        divisible_by_16: tuple = (), num_warps: int = 4, num_stages: int = 3,
                        maxnreg: int | None = None):
    """`compile_for_sm90`'s compiled kernel itself (its `asm` holds "ptx" and "cubin", its `metadata` the shared
    memory a launch asks for), at a launch's `num_warps`, `num_stages` and register cap (`maxnreg`, None: ptxas's
    choice)."""
    scalar_types = scalar_types or {}
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile
    signature = {}
    for p in kernel.params:
        name = p.name
        if p.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*bf16")
        elif name in scalar_types:
            signature[name] = scalar_types[name]
        elif name.endswith("_eps") or name.startswith("scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    # A constexpr the caller leaves out takes its default (a switch added later, off unless named).
    defaults = {p.name: p.default for p in kernel.params
                if p.is_constexpr and p.name not in constexprs and p.has_default}
    constexprs = {**defaults, **constexprs}
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, missing
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params) if p.name in divisible_by_16}
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():     # a Gluon kernel (kernels/mla_decode_wgmma.py)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    compiled = triton_compile(source(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       **({"maxnreg": maxnreg} if maxnreg else {})})
    assert compiled.asm["cubin"], "ptxas made no cubin"
    return compiled


# Arguments that change from step to step: a real launch does not hint them (the kernels say do_not_specialize).
PER_STEP_ARGS = {"stride_bt", "stride_po_r", "stride_po_h", "stride_pl_r", "stride_pl_h", "stride_po_b", "stride_pl_b"}


def aligned(kernel) -> tuple:
    """What a real launch hints as multiples of 16: the tensors, and their strides but the per-step ones."""
    return tuple(p.name for p in kernel.params
                 if p.name.endswith("_ptr") or (p.name.startswith("stride") and p.name not in PER_STEP_ARGS))
