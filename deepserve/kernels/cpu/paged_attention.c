/* Paged decode attention on the CPU: one query token per sequence over its cached keys/values.
 *
 * Queries, outputs and all arithmetic are fp32. The cache is fp32, or bf16 when compiled with -DKV_BF16, or an
 * 8-bit float with -DKV_FP8_E4M3 / -DKV_FP8_E5M2 (build.py builds each variant on demand): a bf16 or fp8 key or
 * value widens exactly to fp32 on load (kv_fp8.h for the 8-bit ones), so the builds differ only in what the cache
 * holds, and the bf16 one reads half the bytes, the fp8 ones a quarter.
 *
 * Cache of one layer: keys and values each [num_blocks, block_size, Hkv, D], contiguous. Sequence b's
 * token i lives in block block_tables[b][i / block_size] at slot i % block_size. D: a multiple of 32, <= 256.
 *
 * Decode attention reads every cached key and value once per step and does little arithmetic on it, so
 * what bounds it is getting the cache from memory; what this kernel is built around:
 *  - each block is read front to back once, for all the query heads of the kv heads in a work item, and the
 *    next block is prefetched row by row while this one is computed (a block is a few pages: too short for
 *    the hardware prefetcher);
 *  - a key or value row, once loaded, serves all query heads of its group (GQA): queries and accumulators of up
 *    to MAX_VEC vectors, in registers where they fit, for a chunk of W keys;
 *  - a chunk's 16 scores per head come out of one transposed reduction of the keys' lane partial sums, not
 *    16 horizontal sums;
 *  - an online softmax (running max, running sum, rescaled accumulator) needs no second pass;
 *  - a long sequence folds in partitions of PART_KEYS keys, separate work items merged afterwards, so that a
 *    batch of one sequence still keeps every thread busy.
 *
 * Everything accumulates in fp32 in a fixed order that depends only on the sequence's own data: a row's
 * result does not depend on the rest of the batch, on the thread count, nor on which thread ran it.
 *
 * Written with GCC/Clang vector extensions, not intrinsics: vectors of W floats, one register of what
 * -march=native has: W = 16 (AVX-512), else W = 8 (AVX2, or two SSE registers). A 16-float vector on a CPU
 * without AVX-512 does compile, but GCC moves much of its shuffling through the stack: on an AVX2-only Zen 3 that
 * build ran 2.4-4.9x slower than the 8-float one (benchmarks/cpu_kv_attention_avx2_lanes_s52.json). -DATTN_LANES=8
 * or 16 forces a width (the tests build both on any CPU); the width fixes the order of the sums, so results are
 * the same for every batch, thread count and thread on a CPU, but not between widths. Built with -O3
 * -march=native -fno-math-errno and no -ffast-math: the compiler may not reorder sums, so the order written here
 * is the order computed.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !(defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#error "needs __builtin_shufflevector (GCC >= 12 or Clang); the PyTorch path is used instead"
#endif

#if defined(ATTN_LANES)
#define W ATTN_LANES  /* floats per vector, and keys per chunk: 8 or 16 */
#elif defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif
#if W != 8 && W != 16
#error "ATTN_LANES must be 8 or 16"
#endif
/* Query heads x (D / W) folded together (a group): each key or value row loaded (and widened) once serves them
 * all. At W = 16 (AVX-512: 32 registers) 16 keeps them in registers. At W = 8 (16 AVX registers) they do not fit either
 * way, and 32 (the default model's 3 heads of 64 in one group, not 2 + 1) took one call over 4096 keys on an AVX2 Zen 3
 * from 500 to 346 us over E4M3, 310 to 255 over E5M2, 265 to 262 over fp32 (128-wide heads in groups of 4: 915 to
 * 642, 508 to 391, 386 to 359), but bf16 from 277 to 287 (369 to 407): the bf16 build keeps 16
 * (benchmarks/cpu_kv_attention_max_vec{,_d128}_avx2_s54.json). -DATTN_MAX_VEC forces it. */
#ifndef ATTN_MAX_VEC
#if W == 8 && !defined(KV_BF16)
#define ATTN_MAX_VEC 32
#else
#define ATTN_MAX_VEC 16
#endif
#endif
#define MAX_VEC ATTN_MAX_VEC
#define MAX_GROUP 4   /* query heads per group */
#define MAX_DV (256 / W)  /* vectors per head: head_dim <= 256 */

typedef float vf __attribute__((vector_size(4 * W)));
typedef float vf_u __attribute__((vector_size(4 * W), aligned(4)));          /* unaligned access */
typedef int32_t vi __attribute__((vector_size(4 * W)));

/* Lane patterns of two W-lane vectors a, b (index i < W: a's lane i, W + i: b's lane i). */
#if W == 16
#define EVENS 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define ODDS 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#define ZIP_LO 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23          /* a0 b0 a1 b1 ... of the low halves */
#define ZIP_HI 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31
#else
#define EVENS 0, 2, 4, 6, 8, 10, 12, 14
#define ODDS 1, 3, 5, 7, 9, 11, 13, 15
#define ZIP_LO 0, 8, 1, 9, 2, 10, 3, 11
#define ZIP_HI 4, 12, 5, 13, 6, 14, 7, 15
#endif

static inline vf load_f(const float *p) { return *(const vf_u *)p; }
static inline void store_f(float *p, vf x) { *(vf_u *)p = x; }

/* Dimensions are handled in pairs of vectors: 2 W consecutive entries of a query, key, value or output row.
 * The bf16 build loads 2 W cache entries in one 4 W-byte load and widens them with a shift and a mask:
 * the even entries come out in the first vector, the odd ones in the second. Queries are loaded in that
 * same order and outputs put back in place, so every product still pairs the same dimension of q and k,
 * and of p and v. */
#ifdef KV_BF16
typedef uint16_t kv_t;
typedef uint32_t vu_u __attribute__((vector_size(4 * W), aligned(2)));
static inline void load_kv_pair(const kv_t *p, vf *lo, vf *hi)
{
    const vu_u x = *(const vu_u *)p;        /* lane i: entry 2i in its low 16 bits, 2i + 1 in its high ones */
    *lo = (vf)(x << 16);
    *hi = (vf)(x & 0xffff0000u);
}
static inline void load_q_pair(const float *p, vf *lo, vf *hi)
{
    const vf a = load_f(p), b = load_f(p + W);
    *lo = __builtin_shufflevector(a, b, EVENS);
    *hi = __builtin_shufflevector(a, b, ODDS);
}
static inline void store_pair(float *p, vf lo, vf hi)
{
    store_f(p, __builtin_shufflevector(lo, hi, ZIP_LO));
    store_f(p + W, __builtin_shufflevector(lo, hi, ZIP_HI));
}
#elif defined(KV_FP8_E4M3) || defined(KV_FP8_E5M2)
#include "kv_fp8.h"
typedef uint8_t kv_t;
static inline void load_kv_pair(const kv_t *p, vf *lo, vf *hi)      /* 2 W codes, widened in their order */
{
    *lo = FP8_WIDEN(p);
    *hi = FP8_WIDEN(p + W);
}
static inline void load_q_pair(const float *p, vf *lo, vf *hi)    /* keys come 1 / FP8_WIDEN_SCALE of their value */
{
    *lo = load_f(p) * FP8_WIDEN_SCALE;
    *hi = load_f(p + W) * FP8_WIDEN_SCALE;
}
static inline void store_pair(float *p, vf lo, vf hi)                /* and values too */
{
    store_f(p, lo * FP8_WIDEN_SCALE);
    store_f(p + W, hi * FP8_WIDEN_SCALE);
}
#else
typedef float kv_t;
static inline void load_kv_pair(const kv_t *p, vf *lo, vf *hi)
{
    *lo = load_f(p);
    *hi = load_f(p + W);
}
static inline void load_q_pair(const float *p, vf *lo, vf *hi) { load_kv_pair(p, lo, hi); }
static inline void store_pair(float *p, vf lo, vf hi)
{
    store_f(p, lo);
    store_f(p + W, hi);
}
#endif

static inline vf splat(float x) { return (vf){0} + x; }

/* out[i] = sum of the W lanes of p[i], for W vectors at once: each step adds the two halves of every vector's
 * remaining lanes while packing two vectors into one (2 (W - 1) shuffles and W - 1 adds in all). */
static inline vf sum_lanes_transposed(const vf p[W])
{
#if W == 16
    vf c[8], d[4], e[2];
    for (int i = 0; i < 8; ++i)
        c[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(e[0], e[1], EVENS) + __builtin_shufflevector(e[0], e[1], ODDS);
#else
    vf c[4], d[2];
    for (int i = 0; i < 4; ++i)     /* lanes 0-3: p[2i]'s halves summed, 4-7: p[2i + 1]'s */
        c[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; ++i)     /* lane pairs: p[4i], p[4i + 1], p[4i + 2], p[4i + 3] */
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(d[0], d[1], EVENS) + __builtin_shufflevector(d[0], d[1], ODDS);
#endif
}

static inline vf vmax(vf a, vf b)
{
    const vi gt = a > b;
    return (vf)((gt & (vi)a) | (~gt & (vi)b));
}

/* Each lane swapped with the one 8, 4, 2 or 1 lanes away (SWAP8 only where W = 16). */
#if W == 16
#define SWAP8 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7
#define SWAP4 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11
#define SWAP2 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13
#define SWAP1 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14
#else
#define SWAP4 4, 5, 6, 7, 0, 1, 2, 3
#define SWAP2 2, 3, 0, 1, 6, 7, 4, 5
#define SWAP1 1, 0, 3, 2, 5, 4, 7, 6
#endif

/* Largest lane (exact whatever the order). */
static inline float max_lanes(vf x)
{
#if W == 16
    x = vmax(x, __builtin_shufflevector(x, x, SWAP8));
#endif
    x = vmax(x, __builtin_shufflevector(x, x, SWAP4));
    x = vmax(x, __builtin_shufflevector(x, x, SWAP2));
    x = vmax(x, __builtin_shufflevector(x, x, SWAP1));
    return x[0];
}

/* Sum of the lanes in one fixed tree. */
static inline float sum_lanes(vf x)
{
#if W == 16
    x = x + __builtin_shufflevector(x, x, SWAP8);
#endif
    x = x + __builtin_shufflevector(x, x, SWAP4);
    x = x + __builtin_shufflevector(x, x, SWAP2);
    x = x + __builtin_shufflevector(x, x, SWAP1);
    return x[0];
}

/* exp(x) per lane for x <= 0 (scores minus their running max), within 1.02 ulp of the exact value (expf:
 * 0.5). Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, Cephes' degree-6 polynomial for exp(r),
 * then 2^n built in the exponent bits. Below -87, where 2^n leaves the normal range, it returns 0 (the true
 * value is < 1.7e-38, nothing next to the max's exp(0) = 1 in the softmax sum); -inf gives 0 and NaN stays
 * NaN. tests/kernels measures the error. */
static inline vf exp_nonpos(vf x)
{
    const vf lo = splat(-87.f);
    const vi below = x < lo;
    const vf xc = (vf)((below & (vi)lo) | (~below & (vi)x));
    const vf n = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;   /* round(x / ln2) */
    const vf r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;            /* ln2 in two parts */
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)(~below & (vi)(p * (vf)two_n));
}

/* Ask for a row of the next block before it is needed (a block is only a few pages, too short for the
 * hardware prefetcher to get ahead of the loads); one row per key of this block spreads the requests out
 * instead of stalling on a burst of them. */
static inline void prefetch_row(const kv_t *p, int64_t width)
{
    for (int64_t off = 0; off < width; off += 64 / sizeof(kv_t))   /* one 64-byte cache line */
        __builtin_prefetch(p + off);
}

/* Running softmax state of one query head: max score m, sum of exp(score - m) l, accumulator of
 * exp(score - m) * value. */
typedef struct {
    vf acc[MAX_DV];
    float m, l;
} Running;

/* Fold one chunk of cnt <= W keys/values (k, v: the first key's slice of this kv head; consecutive tokens
 * token_stride apart) into the running state of GS query heads (q: their rows, q_stride apart). GS and DV
 * are compile-time constants at every call (see fold_group), so the queries, the accumulators and each
 * key's vectors live in registers; the state goes back to memory once per chunk. */
static inline __attribute__((always_inline)) void
fold_chunk(const float *restrict q, int64_t q_stride, const kv_t *restrict k, const kv_t *restrict v,
           const kv_t *pk, const kv_t *pv, int64_t cnt,
           int64_t token_stride, float scale, Running *restrict st, const int GS, const int DV)
{
    /* Fixed-size arrays (not sized by GS and DV: those would be variable-length arrays, kept in memory even
     * when inlining makes GS and DV constants); only [GS][DV] is used. */
    vf qv[MAX_GROUP][MAX_DV], part[MAX_GROUP][W], p[MAX_GROUP];
    for (int g = 0; g < GS; ++g)
        for (int c = 0; c < DV; c += 2)
            load_q_pair(q + g * q_stride + c * W, &qv[g][c], &qv[g][c + 1]);

    /* Scores: lane partial sums per key, then one transposed reduction per head. Missing keys (a short
     * chunk) are zero partials, masked to -inf below. */
    for (int t = 0; t < W; ++t) {
        if (t < cnt) {
            vf kt[MAX_DV];
            if (pk)
                prefetch_row(pk + t * token_stride, DV * W);
            for (int c = 0; c < DV; c += 2)
                load_kv_pair(k + t * token_stride + c * W, &kt[c], &kt[c + 1]);
            for (int g = 0; g < GS; ++g) {
                vf s = qv[g][0] * kt[0];
                for (int c = 1; c < DV; ++c)
                    s += qv[g][c] * kt[c];
                part[g][t] = s;
            }
        } else {
            for (int g = 0; g < GS; ++g)
                part[g][t] = splat(0.f);
        }
    }

    vf acc[MAX_GROUP][MAX_DV];
    for (int g = 0; g < GS; ++g) {
        vf s = sum_lanes_transposed(part[g]) * scale;
        for (int t = (int)cnt; t < W; ++t)
            s[t] = -INFINITY;
        const float mx = fmaxf(st[g].m, max_lanes(s));
        p[g] = exp_nonpos(s - mx);
        const float alpha = exp_nonpos(splat(st[g].m - mx))[0];   /* 0 on the first chunk (m = -inf) */
        st[g].l = st[g].l * alpha + sum_lanes(p[g]);
        st[g].m = mx;
        for (int c = 0; c < DV; ++c)
            acc[g][c] = alpha == 1.f ? st[g].acc[c] : st[g].acc[c] * alpha;
    }

    for (int t = 0; t < cnt; ++t) {
        vf vt[MAX_DV];
        if (pv)
            prefetch_row(pv + t * token_stride, DV * W);
        for (int c = 0; c < DV; c += 2)
            load_kv_pair(v + t * token_stride + c * W, &vt[c], &vt[c + 1]);
        for (int g = 0; g < GS; ++g) {
            const vf w = splat(p[g][t]);
            for (int c = 0; c < DV; ++c)
                acc[g][c] += w * vt[c];
        }
    }
    for (int g = 0; g < GS; ++g)
        for (int c = 0; c < DV; ++c)
            st[g].acc[c] = acc[g][c];
}

typedef struct {
    const float *q;
    int64_t q_row_stride, q_head_stride;
    const kv_t *k_cache, *v_cache;
    const int64_t *rows, *block_tables, *seq_lens;
    float *out;
    int64_t out_row_stride, out_head_stride;
    int64_t H, Hkv, D, block_size, max_blocks;
    int64_t window;                /* > 0: a sequence of len keys attends to its last `window` only */
    float scale;
} Args;

/* Fold n <= block_size tokens of one block into GS query heads' states, a chunk of W tokens at a time. */
static inline __attribute__((always_inline)) void
fold_block(const float *q, int64_t q_stride, const kv_t *k, const kv_t *v, const kv_t *pk, const kv_t *pv,
           int64_t n, int64_t token_stride, float scale, Running *st, const int GS, const int DV)
{
    for (int64_t t0 = 0; t0 < n; t0 += W)
        fold_chunk(q, q_stride, k + t0 * token_stride, v + t0 * token_stride, pk ? pk + t0 * token_stride : NULL,
                   pv ? pv + t0 * token_stride : NULL, n - t0 < W ? n - t0 : W, token_stride, scale, st, GS, DV);
}

/* Query heads [0, gs) of q (rows q_stride apart), all of one kv head (k, v: its slice of the block). Each
 * head's arithmetic is the same whatever group it is computed in, so the grouping never changes a result. */
static void fold_group(const float *q, int64_t q_stride, const kv_t *k, const kv_t *v, const kv_t *pk,
                       const kv_t *pv, int64_t n,
                       int64_t token_stride, float scale, Running *st, int64_t gs, int64_t D)
{
#define FOLD(GS, DV) fold_block(q, q_stride, k, v, pk, pv, n, token_stride, scale, st, GS, DV)
    switch (D / W * 8 + gs) {     /* (D / W, gs) for the common head sizes 64 and 128 (and 256 at W = 16) */
    case 4 * 8 + 1: FOLD(1, 4); return;
    case 4 * 8 + 2: FOLD(2, 4); return;
    case 4 * 8 + 3: FOLD(3, 4); return;
    case 4 * 8 + 4: FOLD(4, 4); return;
    case 8 * 8 + 1: FOLD(1, 8); return;
    case 8 * 8 + 2: FOLD(2, 8); return;
    case 8 * 8 + 3: FOLD(3, 8); return;
    case 8 * 8 + 4: FOLD(4, 8); return;
    case 16 * 8 + 1: FOLD(1, 16); return;
    case 16 * 8 + 2: FOLD(2, 16); return;
    }
#undef FOLD
    for (int64_t i = 0; i < gs; ++i)   /* other head sizes: a head at a time, its vectors counted at run time */
        fold_block(q + i * q_stride, q_stride, k, v, i ? NULL : pk, i ? NULL : pv, n, token_stride, scale, st + i, 1,
                   (int)(D / W));
}

/* Query heads handled together: as many as keep their queries and accumulators within MAX_VEC vectors. */
static int64_t group_size(int64_t D)
{
    const int64_t per_head = D / W;
    const int64_t gs = per_head == 4 || per_head == 8 || per_head == 16 ? MAX_VEC / per_head : 1;
    return gs < MAX_GROUP ? gs : MAX_GROUP;
}

/* A sequence longer than PART_KEYS keys (rounded down to whole blocks) is folded in partitions of that many keys,
 * each its own work item, whose running states are merged afterwards in partition order. At batch 1 the items are
 * otherwise only the KV heads (3 for the default model, on 2 threads: one thread does two, the other waits); split
 * by partitions a 4k-key sequence gives 12. The partitioning depends on the sequence's length and the block size
 * alone, so a row's result still does not depend on its batch or the thread count; sequences of up to PART_KEYS
 * keys are one partition, computed exactly as without it. */
#define PART_KEYS 1024

/* The first key a sequence of len keys attends to: len - window through a sliding window (window > 0), else 0. */
static inline int64_t window_first_key(int64_t len, int64_t window)
{
    return window > 0 && len > window ? len - window : 0;
}

/* Partial state of one query head over one partition: its accumulator (D floats, in the kernel's own layout),
 * then its max score and its sum. */
static inline int64_t partial_floats(int64_t D) { return D + 2; }

/* One work item: sequence b, kv heads [h0, h0 + nh), blocks [j0, j1) of its table. Block by block (each block is
 * read front to back once), every query head of those kv heads folds the block into its running state. The states
 * go out normalized into the output rows, or (partial != NULL: one partition of several) as they are into
 * partial, D + 2 floats per query head. */
static void run_item(const Args *a, int64_t b, int64_t h0, int64_t nh, int64_t j0, int64_t j1, float *partial)
{
    const int64_t G = a->H / a->Hkv, D = a->D, bs = a->block_size, nq = nh * G, gmax = group_size(D);
    const int64_t token_stride = a->Hkv * D, block_stride = bs * token_stride, len = a->seq_lens[b];
    const int64_t *table = a->block_tables + b * a->max_blocks;
    const float *qb = a->q + a->rows[b] * a->q_row_stride + h0 * G * a->q_head_stride;
    Running st[nq];
    for (int64_t i = 0; i < nq; ++i) {
        memset(st[i].acc, 0, sizeof st[i].acc);
        st[i].m = -INFINITY;
        st[i].l = 0.f;
    }
    const int64_t lo = window_first_key(len, a->window);
    for (int64_t j = j0, start = j0 * bs; j < j1 && start < len; start += bs, ++j) {
        if (start + bs <= lo)
            continue;                   /* the whole block lies before the window */
        const int64_t n = len - start < bs ? len - start : bs;
        const int64_t skip = lo > start ? lo - start : 0;   /* the window's first key inside this block */
        const int64_t base = table[j] * block_stride + skip * token_stride;
        /* The next block's slices (of this partition), prefetched row by row while this one is computed. */
        const int64_t next = start + bs < len && j + 1 < j1 ? table[j + 1] * block_stride : -1;
        for (int64_t h = 0; h < nh; ++h) {
            const int64_t offset = base + (h0 + h) * D;
            const kv_t *pk = next < 0 ? NULL : a->k_cache + next + (h0 + h) * D;
            const kv_t *pv = next < 0 ? NULL : a->v_cache + next + (h0 + h) * D;
            for (int64_t i = 0; i < G; i += gmax, pk = pv = NULL)   /* the first group prefetches */
                fold_group(qb + (h * G + i) * a->q_head_stride, a->q_head_stride, a->k_cache + offset,
                           a->v_cache + offset, pk, pv, n - skip, token_stride, a->scale, st + h * G + i,
                           G - i < gmax ? G - i : gmax, D);
        }
    }
    if (partial) {
        for (int64_t i = 0; i < nq; ++i) {
            float *rec = partial + i * partial_floats(D);
            for (int64_t c = 0; c < D / W; ++c)
                store_f(rec + c * W, st[i].acc[c]);
            rec[D] = st[i].m;
            rec[D + 1] = st[i].l;
        }
        return;
    }
    float *ob = a->out + a->rows[b] * a->out_row_stride + h0 * G * a->out_head_stride;
    for (int64_t i = 0; i < nq; ++i) {
        const float inv = st[i].l > 0.f ? 1.f / st[i].l : 0.f;   /* len == 0 gives zeros, not NaN */
        for (int64_t c = 0; c < D / W; c += 2)
            store_pair(ob + i * a->out_head_stride + c * W, st[i].acc[c] * inv, st[i].acc[c + 1] * inv);
    }
}

/* Query head qh of sequence b from its parts partial states (records parts_stride floats apart), merged in
 * partition order: each rescaled to the largest max, then summed, then normalized, as fold_chunk does per chunk. */
static void merge_partitions(const Args *a, int64_t b, int64_t qh, const float *rec, int64_t parts,
                             int64_t parts_stride)
{
    const int64_t D = a->D;
    float mx = -INFINITY;
    for (int64_t p = 0; p < parts; ++p)
        mx = fmaxf(mx, rec[p * parts_stride + D]);
    vf acc[MAX_DV];
    for (int64_t c = 0; c < D / W; ++c)
        acc[c] = splat(0.f);
    float l = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
        const float *r = rec + p * parts_stride;
        const float w = exp_nonpos(splat(r[D] - mx))[0];
        l += r[D + 1] * w;
        for (int64_t c = 0; c < D / W; ++c)
            acc[c] += load_f(r + c * W) * w;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float *ob = a->out + a->rows[b] * a->out_row_stride + qh * a->out_head_stride;
    for (int64_t c = 0; c < D / W; c += 2)
        store_pair(ob + c * W, acc[c] * inv, acc[c + 1] * inv);
}

/* Whole blocks of sequence b before its window's first key (0 without a window). */
static inline int64_t skipped_blocks(const Args *a, int64_t b)
{
    return window_first_key(a->seq_lens[b], a->window) / a->block_size;
}

/* Scratch of the calling thread for partial states, grown as needed and kept for its next calls (a step calls
 * once per layer); NULL when it cannot be had. */
static float *partial_scratch(size_t floats)
{
    static __thread float *buf;
    static __thread size_t cap;
    if (floats > cap) {
        float *grown = realloc(buf, floats * sizeof *buf);
        if (!grown)
            return NULL;
        buf = grown;
        cap = floats;
    }
    return buf;
}

/* q, out: [T, H, D] with the given row/head strides (dim stride 1); decode sequence b reads q row rows[b]
 * and writes out row rows[b]. block_tables: [B, max_blocks]; seq_lens: [B] (each <= max_blocks * block_size).
 * window > 0: each sequence attends to its last `window` keys only (a sliding window); 0: to all.
 * num_threads: OpenMP threads to use (the caller passes torch's setting). */
void paged_decode_attention(const float *q, int64_t q_row_stride, int64_t q_head_stride,
                            const kv_t *k_cache, const kv_t *v_cache,
                            const int64_t *rows, const int64_t *block_tables, const int64_t *seq_lens,
                            float *out, int64_t out_row_stride, int64_t out_head_stride,
                            int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks,
                            int64_t window, float scale, int num_threads)
{
    const Args a = {q, q_row_stride, q_head_stride, k_cache, v_cache, rows, block_tables, seq_lens,
                    out, out_row_stride, out_head_stride, H, Hkv, D, block_size, max_blocks, window, scale};
    /* A whole sequence per item reads each block front to back; with few sequences per thread, split
     * them by kv head instead so that every thread gets work. */
    const int64_t nh = B >= 4 * (int64_t)num_threads ? Hkv : 1;
    const int64_t per_seq = Hkv / nh;
    const int64_t part_blocks = PART_KEYS >= block_size ? PART_KEYS / block_size : 1;
    /* Items: sequence by sequence, partition by partition, kv-head range by range. first[b]: sequence b's first
     * item; base[b]: its first partition among the partial states of the sequences that have several. */
    int64_t stack_first[65], stack_base[64];
    int64_t *first = B < 64 ? stack_first : malloc((size_t)(2 * B + 1) * sizeof *first);
    int64_t *base = B < 64 ? stack_base : first + B + 1;
    float *scratch = NULL;
    int64_t items = 0, partials = 0;
    if (first) {
        for (int64_t b = 0; b < B; ++b) {
            /* Blocks from the window's first (block 0 without a window). */
            const int64_t blocks = (seq_lens[b] + block_size - 1) / block_size - skipped_blocks(&a, b);
            const int64_t parts = blocks > part_blocks ? (blocks + part_blocks - 1) / part_blocks : 1;
            first[b] = items;
            base[b] = parts > 1 ? partials : -1;
            items += parts * per_seq;
            partials += parts > 1 ? parts : 0;
        }
        first[B] = items;
    }
    const int64_t rec = partial_floats(D), stride = H * rec;      /* floats per query head, per partition */
    if (first && partials)
        scratch = partial_scratch((size_t)(partials * stride));
    if (!first || (partials && !scratch)) {
        /* Out of memory for the bookkeeping: every sequence in one partition (the same result for those of up
         * to PART_KEYS keys; longer ones fold in one pass, which rounds differently). */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
        for (int64_t i = 0; i < B * per_seq; ++i)
            run_item(&a, i / per_seq, i % per_seq * nh, nh, 0, max_blocks, NULL);
        if (first != stack_first)
            free(first);
        return;
    }
    /* Dynamic scheduling evens out mixed sequence lengths; it cannot change results, since each item
     * is computed whole by one thread. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i < items; ++i) {
        int64_t lo = 0, hi = B - 1;             /* the sequence of item i: first[b] <= i < first[b + 1] */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (first[mid] <= i)
                lo = mid;
            else
                hi = mid - 1;
        }
        const int64_t b = lo, k = i - first[b], part = k / per_seq, h0 = k % per_seq * nh;
        float *partial = base[b] < 0 ? NULL : scratch + (base[b] + part) * stride + h0 * (H / Hkv) * rec;
        const int64_t j0 = skipped_blocks(&a, b) + part * part_blocks;
        run_item(&a, b, h0, nh, j0, j0 + part_blocks, partial);
    }
    if (partials) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
        for (int64_t i = 0; i < B * H; ++i) {
            const int64_t b = i / H, qh = i % H;
            if (base[b] >= 0)
                merge_partitions(&a, b, qh, scratch + base[b] * stride + qh * rec,
                                 (first[b + 1] - first[b]) / per_seq, stride);
        }
    }
    if (first != stack_first)
        free(first);
}
