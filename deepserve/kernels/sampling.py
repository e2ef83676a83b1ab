"""Sampling kernel: temperature, top-k, top-p, min-p and the float64 inverse CDF of deepserve/layers/sampler.py in
one launch (one program per row), with the counter-based uniform of deepserve/kernels/reference/counter_rng.py computed
in the kernel (or taken as given).

No sort. The reference keeps a prefix of the stable descending order of the scaled logits; the kernel finds the
same prefix by a radix select over an order-preserving 32-bit key of each scaled logit (8 passes of 4 bits):
  top-k:  t_k = the key of the k-th token in that order; kept: key > t_k, and of the tokens with key == t_k
          (ties), the lowest-index ones up to k in all (the stable sort's tie order);
  top-p:  over the top-k survivors' probabilities, t_p = the key at which the mass above first reaches
          top_p * (their total) (float64 sums); ties at t_p kept in index order while the mass before them
          stays below that limit: the reference's `mass_before < top_p * total` rule, token by token;
  min-p:  p >= min_p * max(p) (float32, as the reference);
then the first index (vocabulary order) whose float64 running sum of kept probabilities exceeds u * total.

Arithmetic as the reference: scaled = logits / T (IEEE division), probabilities exp(x - max) / sum with CUDA's
accurate expf (libdevice) and IEEE division, float32 sum. What cannot match bit for bit is the order of the
float32 sum and of the float64 sums, so a token can differ only where a decision sits within rounding (about
1e-7 relative) of a boundary; tests/gpu compares on rows where the reference token is stable under such
perturbations and requires every other row to match exactly.

Speed (H200, B=64, V=151936, benchmarks/h200_kernels.json): temperature / min-p rows 0.25 ms (torch 0.45-0.54 ms);
top-k and/or top-p rows 3.9-4.4 ms (torch 2.0 ms): the float64 mass radix (8 passes over the whole row, one
program per row) dominates. Next steps: after top-k, compact the k survivors so top-p and the CDF run over k
tokens, not V; split long rows over several programs when the batch is small.
"""

from typing import Optional

import torch

from deepserve.kernels import USE_LIBDEVICE, libdevice, require_triton, tl, triton
from deepserve.kernels.reference.counter_rng import torch_sample_uniforms
from deepserve.kernels.reference.sampling import sample_tokens as reference_sample_tokens

@triton.jit
def _counter_uniform(seed, pos, CASE: tl.constexpr):
    """The SplitMix64 counter uniform of counter_rng.sample_uniforms (uint64 arithmetic wraps)."""
    s = seed.to(tl.uint64, bitcast=True)
    p = pos.to(tl.uint64, bitcast=True)
    c = (p * 3 + CASE) * 0x9E3779B97F4A7C15
    z = s + (c ^ (c << 13))
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return (z >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)


@triton.jit
def _uniforms_kernel(seed_ptr, pos_ptr, out_ptr, n, CASE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    seed = tl.load(seed_ptr + i, mask=mask, other=0)
    pos = tl.load(pos_ptr + i, mask=mask, other=0)
    tl.store(out_ptr + i, _counter_uniform(seed, pos, CASE), mask=mask)


@triton.jit
def _order_key(x):
    """float32 -> int64 in [0, 2**32) with the same order; -0.0 and +0.0 map to one key (the sort ties them)."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return b.to(tl.int64) + 2147483648


@triton.jit
def _scaled(row_ptr, cols, valid, temp):
    x = tl.load(row_ptr + cols, mask=valid, other=float("-inf"))
    return tl.math.div_rn(x, temp)


@triton.jit
def _prob(x, m, d, ACCURATE_EXP: tl.constexpr):
    if ACCURATE_EXP:
        e = libdevice.exp(x - m)
    else:
        e = tl.exp(x - m)
    return tl.math.div_rn(e, d)


@triton.jit
def _keep_top_k(key, valid, t0k, rem_k, carry, partial):
    """Top-k survivors of one chunk (vocabulary order). Only when some ties at t0k are dropped (`partial`) does
    the tie rank matter: `carry` counts ties at t0k in earlier chunks."""
    if partial:
        tie = valid & (key == t0k)
        tie_i = tie.to(tl.int32)
        rank = carry + tl.cumsum(tie_i, 0) - tie_i
        kept = valid & ((key > t0k) | (tie & (rank < rem_k)))
        carry = carry + tl.sum(tie_i, 0)
    else:
        kept = valid & (key >= t0k)
    return kept, carry


@triton.jit
def _keep_top_p(key, wk, t0p, above_p, limit, carry, partial):
    """Top-p survivors of one chunk given the top-k-kept masses `wk`. With several tokens tied at t0p (`partial`),
    each is kept while the mass before it stays below the limit; `carry` is the mass of earlier ties."""
    if partial:
        tie = key == t0p
        wt = tl.where(tie, wk, 0.0)
        before = carry + (tl.cumsum(wt, 0) - wt)
        kept = (key > t0p) | (tie & (above_p + before < limit))
        carry = carry + tl.sum(wt, 0)
    else:
        kept = key >= t0p
    return kept, carry


@triton.jit
def _digit_counts(digit, inb, HIST: tl.constexpr):
    """Per-digit (16 bins) count of the chunk's in-bucket tokens."""
    bins = tl.arange(0, 16)
    if HIST:
        # Out-of-bucket tokens are counted in bin 0 and taken out again (no histogram mask in older Tritons).
        c = tl.histogram(tl.where(inb, digit, 0), 16)
        return c - tl.where(bins == 0, tl.sum((~inb).to(tl.int32), 0), 0)
    else:
        return tl.sum(((digit[:, None] == bins[None, :]) & inb[:, None]).to(tl.int32), 0)


@triton.jit
def _radix_select(row_ptr, V, temp, m, d, target, t0k, rem_k, k_partial,
                  MASS: tl.constexpr, BLOCK: tl.constexpr, HIST: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    """The key t0 at which the weight strictly above first reaches `target`, scanning keys downwards; the weight
    above t0 (< target); and how many tokens have key t0. Weight: 1 per token (MASS False) or the top-k-kept
    probability in float64 (MASS True)."""
    bins = tl.arange(0, 16)
    prefix = tl.full([], 0, tl.int64)
    if MASS:
        above = tl.full([], 0.0, tl.float64)
    else:
        above = tl.full([], 0, tl.int32)
    count_at = tl.full([], 0, tl.int32)
    for level in range(8):
        shift_hi = 32 - 4 * level
        shift_lo = 28 - 4 * level
        if MASS:
            W = tl.zeros([16], tl.float64)
        C = tl.zeros([16], tl.int32)
        carry = tl.full([], 0, tl.int32)
        for c0 in range(0, V, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            valid = cols < V
            x = _scaled(row_ptr, cols, valid, temp)
            key = _order_key(x)
            inb = valid & ((key >> shift_hi) == prefix)
            digit = ((key >> shift_lo) & 15).to(tl.int32)
            C += _digit_counts(digit, inb, HIST)
            if MASS:
                p = _prob(x, m, d, ACCURATE_EXP).to(tl.float64)
                kept, carry = _keep_top_k(key, valid, t0k, rem_k, carry, k_partial)
                w = tl.where(inb & kept, p, 0.0)
                W += tl.sum(tl.where(digit[:, None] == bins[None, :], w[:, None], 0.0), 0)
        if not MASS:
            W = C
        suffix = tl.cumsum(W, 0, reverse=True)           # weight of digits >= d within the bucket
        cond = (above + suffix) >= target
        dstar = tl.max(tl.where(cond, bins, 0), 0)       # no crossing (rounding): take digit 0, keep the bucket
        above = above + tl.sum(tl.where(bins > dstar, W, 0), 0)
        count_at = tl.sum(tl.where(bins == dstar, C, 0), 0)
        prefix = prefix * 16 + dstar
    return prefix, above, count_at


@triton.jit
def _sample_kernel(logits_ptr, stride_row, V, temp_ptr, greedy_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                   uniform_ptr, seed_ptr, pos_ptr, out_ptr,
                   HAS_UNIFORMS: tl.constexpr, CASE: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
                   HIST: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    r = tl.program_id(0)
    row_ptr = logits_ptr + r.to(tl.int64) * stride_row
    temp = tl.load(temp_ptr + r)
    greedy = tl.load(greedy_ptr + r)
    offs = tl.arange(0, BLOCK)

    # Pass 1: argmax of the raw logits (first index on ties) and max of the scaled ones.
    m = tl.full([], float("-inf"), tl.float32)
    raw_best = tl.full([], float("-inf"), tl.float32)
    best = tl.full([], 0, tl.int32)
    for c0 in range(0, V, BLOCK):
        cols = c0 + offs
        valid = cols < V
        raw = tl.load(row_ptr + cols, mask=valid, other=float("-inf"))
        cm = tl.max(raw, 0)
        ci = tl.argmax(raw, 0)
        better = cm > raw_best
        best = tl.where(better, c0 + ci, best)
        raw_best = tl.maximum(raw_best, cm)
        m = tl.maximum(m, tl.max(tl.math.div_rn(raw, temp), 0))

    if greedy != 0:
        token = best
    else:
        # Pass 2: softmax denominator.
        d = tl.full([], 0.0, tl.float32)
        for c0 in range(0, V, BLOCK):
            cols = c0 + offs
            valid = cols < V
            x = _scaled(row_ptr, cols, valid, temp)
            if ACCURATE_EXP:
                e = libdevice.exp(x - m)
            else:
                e = tl.exp(x - m)
            d += tl.sum(tl.where(valid, e, 0.0), 0)

        # Top-k threshold (radix select on counts).
        k = tl.maximum(tl.load(top_k_ptr + r), 1)
        if k < V:
            t0k, above_k, ties_k = _radix_select(row_ptr, V, temp, m, d, k.to(tl.int32), -1, 0, False,
                                                 False, BLOCK, HIST, ACCURATE_EXP)
            rem_k = k.to(tl.int32) - above_k
            k_partial = ties_k > rem_k
        else:
            t0k = tl.full([], -1, tl.int64)
            rem_k = tl.full([], 0, tl.int32)
            k_partial = rem_k > 0                         # False

        # Top-p threshold (radix select on the top-k survivors' float64 masses).
        top_p = tl.load(top_p_ptr + r)
        if top_p < 1.0:
            total_k = tl.full([], 0.0, tl.float64)
            carry = tl.full([], 0, tl.int32)
            for c0 in range(0, V, BLOCK):
                cols = c0 + offs
                valid = cols < V
                x = _scaled(row_ptr, cols, valid, temp)
                p = _prob(x, m, d, ACCURATE_EXP).to(tl.float64)
                kept, carry = _keep_top_k(_order_key(x), valid, t0k, rem_k, carry, k_partial)
                total_k += tl.sum(tl.where(kept, p, 0.0), 0)
            limit = top_p.to(tl.float64) * total_k
            t0p, above_p, ties_p = _radix_select(row_ptr, V, temp, m, d, limit, t0k, rem_k, k_partial,
                                                 True, RBLOCK, HIST, ACCURATE_EXP)
            p_partial = ties_p > 1
        else:
            t0p = tl.full([], -1, tl.int64)
            above_p = tl.full([], 0.0, tl.float64)
            limit = tl.full([], float("inf"), tl.float64)
            p_partial = above_p < 0.0                     # False

        # min-p: the most likely token's probability is exp(0) / d.
        thr = tl.load(min_p_ptr + r) * tl.math.div_rn(1.0, d)

        # Total kept mass.
        total = tl.full([], 0.0, tl.float64)
        ck = tl.full([], 0, tl.int32)
        cp = tl.full([], 0.0, tl.float64)
        for c0 in range(0, V, BLOCK):
            cols = c0 + offs
            valid = cols < V
            x = _scaled(row_ptr, cols, valid, temp)
            key = _order_key(x)
            p = _prob(x, m, d, ACCURATE_EXP)
            p64 = p.to(tl.float64)
            kk, ck = _keep_top_k(key, valid, t0k, rem_k, ck, k_partial)
            kp, cp = _keep_top_p(key, tl.where(kk, p64, 0.0), t0p, above_p, limit, cp, p_partial)
            total += tl.sum(tl.where(kk & kp & (p >= thr), p64, 0.0), 0)

        if HAS_UNIFORMS:
            u = tl.load(uniform_ptr + r)
        else:
            u = _counter_uniform(tl.load(seed_ptr + r), tl.load(pos_ptr + r), CASE)
        target = u * total

        # Inverse CDF: first index whose running kept mass exceeds the target (a chunk's prefix sums are only
        # formed in the chunk where the running sum crosses it).
        found = tl.full([], -1, tl.int32)
        last = tl.full([], -1, tl.int32)
        run = tl.full([], 0.0, tl.float64)
        ck = tl.full([], 0, tl.int32)
        cp = tl.full([], 0.0, tl.float64)
        c0 = 0
        while (c0 < V) & (found < 0):
            cols = c0 + offs
            valid = cols < V
            x = _scaled(row_ptr, cols, valid, temp)
            key = _order_key(x)
            p = _prob(x, m, d, ACCURATE_EXP)
            p64 = p.to(tl.float64)
            kk, ck = _keep_top_k(key, valid, t0k, rem_k, ck, k_partial)
            kp, cp = _keep_top_p(key, tl.where(kk, p64, 0.0), t0p, above_p, limit, cp, p_partial)
            w = tl.where(kk & kp & (p >= thr), p64, 0.0)
            chunk = tl.sum(w, 0)
            if run + chunk > target:
                cdf = run + tl.cumsum(w, 0)
                hit = (cdf > target) & (w > 0.0)
                first = tl.min(tl.where(hit, cols, 2147483647), 0)
                found = tl.where(first < 2147483647, first, -1)
            last = tl.maximum(last, tl.max(tl.where(w > 0.0, cols, -1), 0))
            run += chunk
            c0 += BLOCK
        # Past the end only through rounding (u * total >= the running sum): the last kept token.
        token = tl.where(found >= 0, found, last)
    tl.store(out_ptr + r, token.to(tl.int64))


# (BLOCK for single passes, RBLOCK for the float64 radix passes, histogram counts, warps)
SAMPLE_CONFIG = {"block": 4096, "rblock": 1024, "hist": True, "num_warps": 16}


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, is_greedy: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, uniforms: Optional[torch.Tensor] = None,
                  seeds: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                  case: int = 0, config: Optional[dict] = None) -> torch.Tensor:
    """Next token of each row of float32 `logits` [B, V] (after bans and penalties): argmax for greedy rows,
    else a draw from softmax(logits / T) shaped by top-k, top-p and min-p. The draw's uniform is `uniforms`
    [B] float64, or the counter uniform of (seeds, positions, case) (int64 tensors with uint64 bit patterns)."""
    require_triton(logits)
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    if logits.dtype != torch.float32:
        logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    temperature = temperature.to(device=dev, dtype=torch.float32)
    greedy = is_greedy.to(device=dev, dtype=torch.int32)
    top_k = top_k.to(device=dev, dtype=torch.int64)
    top_p = top_p.to(device=dev, dtype=torch.float32)
    min_p = min_p.to(device=dev, dtype=torch.float32)
    has_u = uniforms is not None
    if has_u:
        uniforms = uniforms.to(device=dev, dtype=torch.float64)
        seeds = positions = uniforms   # unused
    else:
        assert seeds is not None and positions is not None and case in (0, 1)
        seeds = seeds.to(device=dev, dtype=torch.int64)
        positions = positions.to(device=dev, dtype=torch.int64)
        uniforms = seeds               # unused
    cfg = {**SAMPLE_CONFIG, **(config or {})}
    _sample_kernel[(b,)](
        logits, logits.stride(0), v, temperature, greedy, top_k, top_p, min_p, uniforms, seeds, positions, out,
        HAS_UNIFORMS=has_u, CASE=case, BLOCK=cfg["block"], RBLOCK=cfg["rblock"], HIST=cfg["hist"],
        ACCURATE_EXP=USE_LIBDEVICE, num_warps=cfg["num_warps"])
    return out


def sample_tokens_ref(logits, temperature, is_greedy, top_k, top_p, min_p, uniforms=None, seeds=None,
                      positions=None, case: int = 0) -> torch.Tensor:
    """The PyTorch twin: the reference sampler's shaping and inverse CDF (kernels/reference/sampling.py)."""
    if uniforms is None:
        uniforms = torch_sample_uniforms(seeds, positions, case)
    return reference_sample_tokens(logits, temperature, is_greedy, top_k, top_p, min_p, uniforms)


def choose_tokens(logits: torch.Tensor, meta, config: Optional[dict] = None) -> torch.Tensor:
    """Drop-in for `Sampler.choose_tokens(logits, meta)` with a SamplingMetadata."""
    if meta.all_greedy:
        return logits.argmax(dim=-1)
    return sample_tokens(logits, meta.temperature, meta.is_greedy, meta.top_k, meta.top_p, meta.min_p,
                         uniforms=meta.uniforms, config=config)


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor, case: int = 0) -> torch.Tensor:
    """The kernel's counter uniforms (for testing against counter_rng.torch_sample_uniforms bit for bit)."""
    require_triton(seeds)
    seeds = seeds.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    n = seeds.numel()
    out = torch.empty(n, dtype=torch.float64, device=seeds.device)
    if n:
        _uniforms_kernel[(triton.cdiv(n, 1024),)](seeds, positions, out, n, CASE=case, BLOCK=1024)
    return out.view(seeds.shape)


__all__ = ["SAMPLE_CONFIG", "sample_tokens", "sample_tokens_ref", "choose_tokens", "counter_uniforms"]
