"""Fused MoE routing: everything after the gate GEMM in one launch. The GPU twin of `route()` (+ the expert-load
`index_add_`) in deepserve/layers/moe.py, which stays the reference and the CPU path. The gate GEMM before it
(exact float32 products, never TF32) is one launch too, by batch size:
  1..16 tokens    `router_logits`: a GEMV, [T, E] logits (a half-precision gate's rounded to its dtype, as cuBLAS's
                  GEMM rounds them above 16 tokens and in HF).
  17..512         `router_logit_partials`: a split-K GEMM, [S, T, E] partial sums (S splits of the hidden dim, each
                  its own slice: no atomics, deterministic), which `fused_route` sums itself (and rounds to a
                  half-precision gate's dtype, as the GEMM would). On tensor cores for bf16 x on a float32 gate
                  (the weight split in three bf16 parts whose products with x are exact) and for a bf16 / fp16 gate
                  in x's dtype; float32 x on a float32 gate runs on CUDA cores, up to 64 tokens only.
  above           cuBLAS (the caller's F.linear).
Both replace a cast + cuBLAS's split-K GEMM and reduce kernels (DeepSeek's gate is float32) for a 0.5 MB weight.

logits [T, E] float32, or partials [S, T, E] summed in order s = 0..S-1 (`sum_partials`)
(+ e_score_correction_bias [E]) -> weights [T, k] float32, ids [T, k] int64, and
expert_load[e] += (count of e among the ids). One program per token row, the row's E scores in registers, laid
out [groups, experts per group] (greedy: one group of E):
  scores   softmax exp(x - max) / sum, sigmoid 1 / (1 + exp(-x)), sqrtsoftplus sqrt(x > 20 ? x : log1p(exp(x))):
           the formulas of PyTorch's CUDA kernels with CUDA's accurate expf/log1pf (libdevice, denormals kept), IEEE
           division and square root, so each score should be torch's bit for bit, except softmax's sum (another
           summation order: softmax scores and weights may differ from torch's by about an ulp).
  choice   scores + bias: the bias steers the choice, the weights use the unbiased scores.
  groups   group_limited_greedy / noaux_tc with num_groups > 1: group score = its best choice (DeepSeek-V2) or the
           sum of its two best (V3); the topk_groups best groups stay, the other experts get -inf.
  top-k    k rounds of "largest available, lowest index among equals" (a NaN counts as the largest, as in
           torch.sort): exactly the order of `stable_topk_ids`, so ids come out by descending choice, ties by id.
  weights  scores at the ids, / (their sum + 1e-20) when renormalizing, * scaling_factor.
  load     one int64 atomic add per id.
Selection works on the rounded scores (not the logits), so logits that round to one score tie as they do in torch
(sigmoid saturating at 1, sqrt merging neighbours). Ids equal route()'s; the one known gap is softmax: two
different but adjacent-ulp exp values may round to one quotient under one sum and not under the other.

Every RoutingConfig is supported; `fused_route_supported` is false (the caller keeps the torch path) only for
E > 1024 (registers), top_k > E, or a group split route() itself rejects (E not divisible by num_groups, noaux_tc
groups of one expert). Fixed output shapes and no host sync: CUDA-graph capturable.
Without libdevice (Triton's interpreter) exp and log1p come from tl.exp and a log-based log1p: scores within a
few ulps of torch's, still equal for equal logits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from deepserve import envs
from deepserve.kernels import USE_LIBDEVICE, cdiv, libdevice, next_pow2, num_sms, require_triton, tl, triton
from deepserve.kernels.gemv import gemv_rows
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from deepserve.kernels.reference.moe import count_expert_load, route

MAX_EXPERTS = 1024
_SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
_GROUP_NONE, _GROUP_MAX, _GROUP_TOP2 = 0, 1, 2


@triton.jit
def _exp(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log1p(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.log1p(x)
    else:
        # log(u) * x / (u - 1) cancels the rounding of u = 1 + x (Goldberg); where u rounds to 1, log1p(x) = x.
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * tl.math.div_rn(x, tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _scores(x, valid, SCORING: tl.constexpr, ACCURATE: tl.constexpr):
    """Router scores of one row of logits x (float32, any shape; invalid entries are padding)."""
    if SCORING == 0:
        x = tl.where(valid, x, float("-inf"))
        e = _exp(x - tl.max(x), ACCURATE)
        return tl.math.div_rn(e, tl.sum(e))
    elif SCORING == 1:
        return tl.math.div_rn(1.0, 1.0 + _exp(-x, ACCURATE))
    else:
        # torch's softplus: x itself above the threshold 20; exp's input clamped so the unused side stays finite.
        soft = tl.where(x > 20.0, x, _log1p(_exp(tl.minimum(x, 20.0), ACCURATE), ACCURATE))
        # tl.minimum(NaN, 20) may give 20: keep a NaN logit NaN, as torch's softplus does.
        return tl.sqrt_rn(tl.where(x != x, x, soft))


@triton.jit
def _first_max(x, avail, idx, NONE: tl.constexpr):
    """The index (from `idx`) of the largest available entry of x, the lowest index among equals: the head of a
    stable descending sort. A NaN counts as the largest, as in torch.sort. NONE when nothing is available."""
    nan = avail & (x != x)                     # x != x: NaN
    best = tl.max(tl.where(avail & (x == x), x, float("-inf")))
    first = tl.min(tl.where(avail & (x == best), idx, NONE))
    first_nan = tl.min(tl.where(nan, idx, NONE))
    return tl.where(first_nan < NONE, first_nan, first)


@triton.jit
def _mask_groups(choice, valid, j, num_groups,
                 GROUP_MODE: tl.constexpr, TOPK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """choice [BLOCK_G, BLOCK_S] (a row per group) with the experts outside the TOPK_GROUPS best groups at -inf."""
    c = tl.where(valid, choice, float("-inf"))
    best = tl.max(c, 1)
    if GROUP_MODE == 2:     # V3: a group's two best (the best's first position excluded, so a tie counts twice)
        first = tl.min(tl.where(valid & (c == best[:, None]), j, BLOCK_S), 1)
        group_score = best + tl.max(tl.where(j == first[:, None], float("-inf"), c), 1)
    else:                   # V2: the group's best expert
        group_score = best
    g = tl.arange(0, BLOCK_G)
    avail = g < num_groups
    for _ in tl.static_range(TOPK_GROUPS):
        avail = avail & (g != _first_max(group_score, avail, g, BLOCK_G))
    kept = (g < num_groups) & ~avail
    return tl.where(kept[:, None], choice, float("-inf"))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, load_ptr,
                  num_groups, group_size, stride_p, stride_l, scaling, NUM_PARTIALS: tl.constexpr,
                  ROUND_SUM: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_MODE: tl.constexpr,
                  TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  COUNT_LOAD: tl.constexpr, ACCURATE: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """One token row: (the sum of its partial logits), scores, choice, group filter, top-k, weights, load count."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_S)[None, :]
    expert = g * group_size + j                                     # [BLOCK_G, BLOCK_S]
    valid = (g < num_groups) & (j < group_size)
    row_ptrs = logits_ptr + row * stride_l + expert
    x = tl.load(row_ptrs, mask=valid, other=0.0).to(tl.float32)
    # Unrolled (a constexpr count): the S loads go out together. In order s = 1, 2, ...: sum_partials' sum.
    for s in tl.static_range(1, NUM_PARTIALS):
        x = x + tl.load(row_ptrs + s * stride_p, mask=valid, other=0.0).to(tl.float32)
    if ROUND_SUM == 1:                  # a half-precision gate's logits, as its GEMM rounds them
        x = x.to(tl.bfloat16).to(tl.float32)
    elif ROUND_SUM == 2:
        x = x.to(tl.float16).to(tl.float32)
    scores = _scores(x, valid, SCORING, ACCURATE)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    if GROUP_MODE != 0:
        choice = _mask_groups(choice, valid, j, num_groups, GROUP_MODE, TOPK_GROUPS, BLOCK_G, BLOCK_S)
    NONE: tl.constexpr = BLOCK_G * BLOCK_S
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    weights = tl.zeros([BLOCK_K], tl.float32)
    avail = valid
    for i in tl.static_range(TOP_K):
        pick = _first_max(choice, avail, expert, NONE)
        hit = (expert == pick) & valid      # padding cells alias real expert numbers
        ids = tl.where(kk == i, pick, ids)
        weights = tl.where(kk == i, tl.sum(tl.where(hit, scores, 0.0)), weights)
        avail = avail & ~hit
    out = kk < TOP_K
    if RENORMALIZE:
        weights = tl.math.div_rn(weights, tl.sum(tl.where(out, weights, 0.0)) + 1e-20)
    weights = weights * scaling
    tl.store(weights_ptr + row * TOP_K + kk, weights, mask=out)
    tl.store(ids_ptr + row * TOP_K + kk, ids.to(tl.int64), mask=out)
    if COUNT_LOAD:
        tl.atomic_add(load_ptr + ids, tl.full([BLOCK_K], 1, tl.int64), mask=out, sem="relaxed")


def _grouped(cfg) -> bool:
    """route() filters groups only for the group methods with more than one group."""
    return cfg.topk_method != "greedy" and cfg.num_groups > 1


def fused_route_supported(cfg, num_experts: int) -> bool:
    """Whether `fused_route` takes this config and expert count (else the caller runs route())."""
    if num_experts > MAX_EXPERTS or cfg.top_k > num_experts:
        return False
    if not _grouped(cfg):
        return True
    if num_experts % cfg.num_groups:
        return False
    return cfg.topk_method != "noaux_tc" or num_experts // cfg.num_groups >= 2


@functools.cache
def _no_ftz() -> dict:
    """Triton builds libdevice with flush-to-zero by default, PyTorch's kernels keep denormals: turn it off where
    this Triton has the option (CUDA), so that tiny scores (exp of a logit far below the max) stay torch's."""
    if torch.version.hip is not None:
        return {}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return {}
    return {"enable_reflect_ftz": False} if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__ else {}


def _kernel_meta(cfg, num_experts: int):
    """(groups, experts per group, the kernel's other compile-time parameters) for a routing config."""
    grouped = _grouped(cfg)
    num_groups = cfg.num_groups if grouped else 1
    group_size = num_experts // num_groups
    group_mode = (_GROUP_TOP2 if cfg.topk_method == "noaux_tc" else _GROUP_MAX) if grouped else _GROUP_NONE
    block_g, block_s = next_pow2(num_groups), max(16, next_pow2(group_size))
    # Not tuned on a GPU: one warp keeps the k rounds of reductions in warp shuffles for the usual E <= 256.
    num_warps = 1 if block_g * block_s <= 256 else 4
    return num_groups, group_size, dict(
        SCORING=_SCORING[cfg.scoring], GROUP_MODE=group_mode, TOPK_GROUPS=min(cfg.topk_groups, num_groups),
        TOP_K=cfg.top_k, RENORMALIZE=cfg.renormalize, ACCURATE=USE_LIBDEVICE,
        BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=max(2, next_pow2(cfg.top_k)), num_warps=num_warps, **_no_ftz())


_ROUND_CODES = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}     # the route kernel's ROUND_SUM


def fused_route(logits: torch.Tensor, cfg, bias: torch.Tensor | None = None,
                expert_load: torch.Tensor | None = None, round_to: torch.dtype | None = None):
    """logits: [T, E] float32, or [S, T, E] float32 partial logits (`router_logit_partials`); cfg: RoutingConfig;
    bias: [E] (any float dtype) or None; expert_load: [E] int64 or None -> (weights [T, k] float32, ids [T, k]
    int64), the results of `route(logits, cfg, bias)` (of `route(sum_partials(logits, round_to), cfg, bias)`);
    with expert_load, each expert's count among the ids is added to it in the same launch. `round_to` (a
    half-precision gate's dtype): the partials' sum rounded to it, as that gate's GEMM rounds its logits. Each S
    compiles its own kernel (the partials' loads unrolled): `router_logit_partials` keeps S to a few powers of
    two."""
    require_triton(logits)
    assert logits.dim() in (2, 3), f"logits [T, E] or partials [S, T, E], got {tuple(logits.shape)}"
    num_partials = logits.shape[0] if logits.dim() == 3 else 1
    t, num_experts = logits.shape[-2:]
    assert logits.dtype == torch.float32, "route() takes float32 logits"
    assert fused_route_supported(cfg, num_experts), f"{cfg} with {num_experts} experts: use route()"
    k = cfg.top_k
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if bias is not None:
        assert bias.shape == (num_experts,)
        bias = bias.contiguous()
    if expert_load is not None:
        assert expert_load.dtype == torch.int64 and expert_load.shape == (num_experts,) and expert_load.is_contiguous()
    num_groups, group_size, meta = _kernel_meta(cfg, num_experts)
    _route_kernel[(t,)](
        logits, bias if bias is not None else logits, weights, ids,
        expert_load if expert_load is not None else ids,
        num_groups, group_size, logits.stride(0) if num_partials > 1 else 0, logits.stride(-2),
        float(cfg.scaling_factor), NUM_PARTIALS=num_partials,
        ROUND_SUM=_ROUND_CODES[round_to], HAS_BIAS=bias is not None,
        COUNT_LOAD=expert_load is not None, **meta, **pdl_launch_args(logits))
    return weights, ids


# ------------------------------------------------------------------------------------------------
# The gate GEMM: a GEMV at decode sizes, split-K partial sums up to 64 tokens
# ------------------------------------------------------------------------------------------------
ROUTER_GEMV_MAX_TOKENS = 16     # above this, the split-K kernel (the gate is a real GEMM by then)
# Above this, cuBLAS. Measured on an H200 (benchmarks/router_gate_ab.py, router_gate_ab_h200.json: gate GEMM + routing
# in a CUDA graph, hidden 2048): V2-Lite's float32 gate 5.8 / 8.4 / 13.9 / 24.6 us at 17 / 64 / 128 / 256 tokens,
# against cuBLAS's 11.7 / 12.8 / 13.1 / 13.8 (cast, SIMT sgemm, split-K reduce, routing).
ROUTER_TILED_MAX_TOKENS = 64
# The tensor-core variants of the split-K kernel (bf16 x on a float32 gate, a half-precision gate in x's dtype) take
# up to this many tokens. Measured on an H200 (router_gate_ab.py, router_gate_ab_h200.json: gate GEMM + routing in a
# CUDA graph, hidden 2048): V2-Lite's float32 gate 4.9 / 5.0 / 5.4 / 6.2 / 8.3 us at 17 / 64 / 128 / 256 / 512
# tokens, against 5.8 / 8.4 / 13.9 / 24.5 / 45.8 on CUDA cores and 11.6 / 12.8 / 13.1 / 13.8 / 20.8 on cuBLAS.
ROUTER_MMA_MAX_TOKENS = 512


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, num_experts, hidden, stride_xt, stride_we, stride_ot,
                          ROUND_TO_GATE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """out[t, e] = sum_k float32(x[t, k]) * float32(w[e, k]) for BLOCK_E experts of token t (exact float32 products),
    with ROUND_TO_GATE rounded once to the gate's dtype (stored as float32)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    logits = gemv_rows(x_ptr + t * stride_xt, w_ptr, e, e_ok, hidden, stride_we, BLOCK_K, USE_PDL)
    if ROUND_TO_GATE:
        logits = logits.to(w_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + e, logits, mask=e_ok)


def router_logits_supported(x: torch.Tensor) -> bool:
    return x.dim() == 2 and 0 < x.shape[0] <= ROUTER_GEMV_MAX_TOKENS


def _gate_inputs(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (T > 0) and weight [E, H], checked and made row-contiguous for the gate kernels."""
    require_triton(x)
    assert x.dim() == 2 and x.shape[0] > 0, f"x {tuple(x.shape)}: [T, H] with T > 0"
    assert weight.dim() == 2 and weight.shape[1] == x.shape[1], f"weight {tuple(weight.shape)} for x {tuple(x.shape)}"
    return (x if x.stride(-1) == 1 else x.contiguous()), weight.contiguous()


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] (any float dtype), weight [E, H] (DeepSeek keeps it float32) -> [T, E] float32 logits: the gate GEMM
    in the gate's dtype, F.linear(x.to(weight.dtype), weight).float() up to summation order. A float32 gate's logits
    stay float32; a half-precision gate's (Qwen3-MoE, Mixtral) are rounded to its dtype once, as cuBLAS's GEMM (the
    path above ROUTER_GEMV_MAX_TOKENS tokens, the CPU path and HF) rounds them: otherwise a request's routing would
    depend on how many tokens share its step. Within one bf16 ulp of cuBLAS's GEMM with full-precision reduction
    (tests/gpu/test_moe_routing.py); with torch's default, allow_bf16_reduced_precision_reduction, cuBLAS may sum
    split-K partials in bf16 and land further off the exact product (on an H200, 31 of 180 logits of a 60-expert
    gate at 3 tokens beyond one ulp), so above 16 tokens the routing can still move by such a margin. One launch at
    decode sizes, where the torch path is three (x cast to float32, cuBLAS's dot and reduce kernels) for a 0.5 MB
    weight."""
    if x.dtype != weight.dtype and weight.dtype != torch.float32:
        x = x.to(weight.dtype)           # as F.linear(x.to(weight.dtype), weight): the input rounded first
    x, weight = _gate_inputs(x, weight)
    (t, hidden), num_experts = x.shape, weight.shape[0]
    out = torch.empty(t, num_experts, dtype=torch.float32, device=x.device)
    # One expert's row a program, in one or two K steps: E programs per token pull the weight (measured on an H200:
    # 4 rows x 512 columns per program, E / 4 programs, took 5 us for V2-Lite's 64 x 2048 fp32 gate).
    block_e, block_k = 1, min(4096, next_pow2(hidden))
    _router_logits_kernel[(t, triton.cdiv(num_experts, block_e))](
        x, weight, out, num_experts, hidden, x.stride(0), weight.stride(0), out.stride(0),
        ROUND_TO_GATE=weight.dtype != torch.float32, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
        **pdl_launch_args(x))
    return out


class RouterTiles(NamedTuple):
    """The split-K kernel's tile: block_t tokens x block_e experts, block_k of the hidden dim per step; `mma`: on
    tensor cores; `split`: bf16 x on a float32 weight, split in three bf16 parts."""
    block_t: int
    block_e: int
    block_k: int
    warps: int
    mma: bool
    split: bool = False


# CUDA cores (float32 x): not tuned (it loses to cuBLAS from 128 tokens, where ROUTER_TILED_MAX_TOKENS hands over).
FMA_TILES = RouterTiles(16, 16, 32, 4, mma=False)
# Tensor cores: a tile takes 64 experts (DeepSeek-V2-Lite's whole gate) per 16 tokens.
MMA_TILES = RouterTiles(16, 64, 64, 4, mma=True)
MMA_SPLIT_TILES = MMA_TILES._replace(split=True)
_MAX_SPLITS = 16


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])   # the batch size: no new variant per step
def _router_partials_kernel(x_ptr, w_ptr, out_ptr, num_tokens, num_experts, hidden, num_splits,
                            stride_xt, stride_we, stride_os, stride_ot,
                            BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                            MMA: tl.constexpr, SPLIT_BF16: tl.constexpr, USE_PDL: tl.constexpr):
    """out[s, t, e] = sum over split s's range of k of float32(x[t, k]) * float32(w[e, k]), for a BLOCK_T x BLOCK_E
    tile of (t, e).

    Without MMA, tl.dot with input_precision="ieee" on float32 operands is Triton's CUDA-core path (no tensor cores,
    no TF32): each thread runs FMA chains over k for its outputs, operands from shared memory, loads pipelined with
    cp.async. (A broadcast product + tl.sum over k compiled for sm_90 to 5 warp shuffles a product: K lay across the
    lanes.)

    MMA: tensor-core dots with a float32 accumulator; x and w in one half-precision dtype go in as they are (a
    product of two 8- or 11-bit significands is exact in float32). SPLIT_BF16 (x bf16, w float32): each weight tile
    is split into bf16 parts hi + mid + lo = w exactly (each part takes the next 8 of float32's 24 significand bits;
    the differences are exact in float32), and three dots add x . lo, x . mid, x . hi. Every product is exact, as in
    the CUDA-core path; only the summation order differs."""
    pdl_wait(USE_PDL)                   # x is the previous kernel's output; the weight is not worth an early load
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    t_ok, e_ok = t < num_tokens, e < num_experts
    # Split s takes the K steps [s * steps // S, (s + 1) * steps // S): whole steps, none empty when S <= steps.
    steps = tl.cdiv(hidden, BLOCK_K)
    k_begin = (split * steps // num_splits) * BLOCK_K
    k_end = ((split + 1) * steps // num_splits) * BLOCK_K
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + t[:, None].to(tl.int64) * stride_xt + k[None, :]
    w_ptrs = w_ptr + e[:, None].to(tl.int64) * stride_we + k[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = k[None, :] < hidden - k0                     # only the last step of the last split is partial
        xs = tl.load(x_ptrs + k0, mask=t_ok[:, None] & k_ok, other=0.0)
        ws = tl.load(w_ptrs + k0, mask=e_ok[:, None] & k_ok, other=0.0)
        if SPLIT_BF16:
            hi = ws.to(tl.bfloat16)
            rest = ws - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(xs, tl.trans(lo), acc)             # smallest parts first
            acc = tl.dot(xs, tl.trans(mid), acc)
            acc = tl.dot(xs, tl.trans(hi), acc)
        elif MMA:
            acc = tl.dot(xs, tl.trans(ws), acc)
        else:
            acc = tl.dot(xs.to(tl.float32), tl.trans(ws.to(tl.float32)), acc, input_precision="ieee")
    out_ptrs = out_ptr + split * stride_os + t[:, None].to(tl.int64) * stride_ot + e[None, :]
    tl.store(out_ptrs, acc, mask=t_ok[:, None] & e_ok[None, :])


_HALF = (torch.bfloat16, torch.float16)


def router_tiles(x: torch.Tensor, weight: torch.Tensor) -> RouterTiles | None:
    """The split-K kernel's tile for x on weight: tensor cores for bf16 x on a float32 gate (split weights) and for
    a half-precision gate in x's dtype, CUDA cores for float32 x on a float32 gate; None for other pairs."""
    if weight.dtype == torch.float32:
        return MMA_SPLIT_TILES if x.dtype == torch.bfloat16 else FMA_TILES if x.dtype == torch.float32 else None
    return MMA_TILES if weight.dtype in _HALF and x.dtype == weight.dtype else None


def router_logit_partials_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the gate GEMM of x takes `router_logit_partials`: from 17 tokens up to ROUTER_MMA_MAX_TOKENS on the
    tensor cores (bf16 x on DeepSeek's float32 gate, a bf16 gate as Qwen3-MoE's in x's dtype), up to
    ROUTER_TILED_MAX_TOKENS on CUDA cores (float32 x and gate)."""
    tiles = router_tiles(x, weight) if x.dim() == 2 else None
    if tiles is None:
        return False
    most = ROUTER_MMA_MAX_TOKENS if tiles.mma else ROUTER_TILED_MAX_TOKENS
    return ROUTER_GEMV_MAX_TOKENS < x.shape[0] <= most


# DEEPSERVE_ROUTER_SPLITS (read at import; 0: the rule in router_splits): an A/B switch for the split count.
FORCED_SPLITS = envs.DEEPSERVE_ROUTER_SPLITS


def router_splits(num_tokens: int, num_experts: int, hidden: int, device: torch.device,
                  tiles: RouterTiles = FMA_TILES, forced: int | None = None) -> int:
    """S for `router_logit_partials`: the smallest power of two that gives the grid 2 programs an SM (1 once the
    tiles alone do), at most _MAX_SPLITS and at most the K steps. Powers of two: `fused_route` compiles a kernel
    per S, so a model sees at most five (1, 2, 4, 8, 16) over all batch sizes. `forced` (default:
    DEEPSERVE_ROUTER_SPLITS) > 0 replaces the rule, rounded up to a power of two and held to the same limits."""
    forced = FORCED_SPLITS if forced is None else forced
    steps = cdiv(hidden, tiles.block_k)
    most = min(_MAX_SPLITS, 1 << (steps.bit_length() - 1))
    if forced > 0:
        return min(next_pow2(forced), most)
    num_tiles = cdiv(num_tokens, tiles.block_t) * cdiv(num_experts, tiles.block_e)
    return min(next_pow2(cdiv(2 * num_sms(device), num_tiles)), most)


def router_logit_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H], weight [E, H] (a pair `router_tiles` takes) -> [S, T, E] float32 partial logits: slice s holds the
    dot products over split s of the hidden dim, exact float32 products, so that `sum_partials` of them =
    F.linear(x.float(), weight.float()) up to summation order (a half-precision gate's GEMM rounds that sum to its
    dtype: `fused_route` and `sum_partials` take `round_to`). Deterministic: every
    output written once by one program, the same S and summation order for the same T on the same GPU.
    `fused_route` takes them as they are (the sum is in its row loads: no [T, E] round trip, no reduce launch)."""
    x, weight = _gate_inputs(x, weight)
    (t, hidden), num_experts = x.shape, weight.shape[0]
    tiles = router_tiles(x, weight)
    assert tiles is not None, f"x {x.dtype} on a {weight.dtype} gate: no split-K kernel"
    splits = router_splits(t, num_experts, hidden, x.device, tiles)
    # Slices 16 floats apart at any T: fused_route's stride over them stays a multiple of 16, which Triton
    # specializes on (no second route kernel for odd T x E).
    size = t * num_experts
    out = torch.empty(splits, cdiv(size, 16) * 16, dtype=torch.float32, device=x.device)[:, :size]
    out = out.view(splits, t, num_experts)
    grid = (cdiv(t, tiles.block_t), cdiv(num_experts, tiles.block_e), splits)
    _router_partials_kernel[grid](
        x, weight, out, t, num_experts, hidden, splits, x.stride(0), weight.stride(0), out.stride(0), out.stride(1),
        BLOCK_T=tiles.block_t, BLOCK_E=tiles.block_e, BLOCK_K=tiles.block_k, MMA=tiles.mma, SPLIT_BF16=tiles.split,
        num_warps=tiles.warps, **pdl_launch_args(x))
    return out


def sum_partials(partials: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
    """[S, T, E] -> [T, E]: p[0] + p[1] + ... in that order, in float32, as `fused_route` sums them (bit for bit);
    with a half-precision `round_to`, the sum rounded to it once (stored as float32)."""
    out = partials[0].clone()
    for p in partials[1:]:
        out += p
    return out if round_to in (None, torch.float32) else out.to(round_to).float()


def fused_route_ref(logits, cfg, bias=None, expert_load=None):
    """The PyTorch twin: route() and the index_add_ of FusedMoE."""
    weights, ids = route(logits, cfg, bias)
    if expert_load is not None:
        count_expert_load(expert_load, ids)
    return weights, ids


__all__ = ["FMA_TILES", "MAX_EXPERTS", "MMA_SPLIT_TILES", "MMA_TILES", "ROUTER_GEMV_MAX_TOKENS",
           "ROUTER_MMA_MAX_TOKENS", "ROUTER_TILED_MAX_TOKENS", "RouterTiles", "fused_route", "fused_route_ref",
           "fused_route_supported", "router_logit_partials", "router_logit_partials_supported", "router_logits",
           "router_logits_supported", "router_splits", "router_tiles", "sum_partials"]
