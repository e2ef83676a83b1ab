/* Paged decode attention on the CPU: one query token per sequence over its cached keys/values.
 *
 * Queries, outputs and all arithmetic are fp32. The cache is fp32, or bf16 when compiled with -DKV_BF16
 * (build.py builds each variant on demand): a bf16 key or value widens exactly to fp32 on load (its bits
 * shifted up), so the two builds differ only in what the cache holds, and the bf16 one reads half the bytes.
 *
 * Cache of one layer: keys and values each [num_blocks, block_size, Hkv, D], contiguous. Sequence b's
 * token i lives in block block_tables[b][i / block_size] at slot i % block_size.
 *
 * Each kv head's G = H / Hkv query heads walk the sequence's blocks once, reading the cache in place (no
 * gather), so each key and value is read from memory exactly once; an online softmax (running max,
 * running sum, rescaled accumulator) needs no second pass. Everything accumulates in fp32 in a fixed
 * order that depends only on the sequence's own data: a row's result does not depend on the rest of the
 * batch, on the thread count, nor on which thread ran it.
 *
 * Built with -O3 -march=native -fno-math-errno and no -ffast-math, so the compiler may not reorder sums:
 * the loops are written to vectorize as they are (dot products keep LANES independent partial sums,
 * exp is a polynomial instead of a call to expf).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef KV_BF16
typedef uint16_t kv_t;
static inline float KV(kv_t x)
{
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#else
typedef float kv_t;
#define KV(x) (x)
#endif

#define LANES 16   /* partial sums per dot product: one 512-bit or two 256-bit vectors */
#define TILE 16    /* keys whose dot products are reduced together */

/* Sums of LANES partial sums, all in one fixed tree (halving the width each step), so that a dot product
 * gives the same bits whichever of the two functions below computes it. */
#define REDUCE_LANES(part, out)                      \
    do {                                             \
        float h8[8], h4[4], h2[2];                   \
        for (int j = 0; j < 8; ++j)                  \
            h8[j] = (part)[j] + (part)[j + 8];       \
        for (int j = 0; j < 4; ++j)                  \
            h4[j] = h8[j] + h8[j + 4];               \
        for (int j = 0; j < 2; ++j)                  \
            h2[j] = h4[j] + h4[j + 2];               \
        (out) = h2[0] + h2[1];                       \
    } while (0)

/* a . b over D floats (D a multiple of LANES). */
static inline float dot(const float *restrict a, const kv_t *restrict b, int64_t D)
{
    float part[LANES] = {0.f}, sum;
    for (int64_t d = 0; d < D; d += LANES)
        for (int j = 0; j < LANES; ++j)
            part[j] += a[d + j] * KV(b[d + j]);
    REDUCE_LANES(part, sum);
    return sum;
}

/* out[t] = q . k[t * stride] for TILE keys at once: reducing TILE dot products together lets gcc do it
 * with a transpose across vectors, instead of one horizontal sum per key. */
static inline void dot_tile(const float *restrict q, const kv_t *restrict k, int64_t stride, int64_t D,
                            float *restrict out)
{
    float part[TILE][LANES];
    for (int t = 0; t < TILE; ++t) {
        for (int j = 0; j < LANES; ++j)
            part[t][j] = 0.f;
        for (int64_t d = 0; d < D; d += LANES)
            for (int j = 0; j < LANES; ++j)
                part[t][j] += q[d + j] * KV(k[t * stride + d + j]);
    }
    for (int t = 0; t < TILE; ++t)
        REDUCE_LANES(part[t], out[t]);
}

/* exp(x) for x <= 0 (scores minus their running max), within 1.02 ulp of the exact value (expf: 0.5).
 * Unlike a call to expf, gcc vectorizes it. Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2,
 * Cephes' degree-6 polynomial for exp(r), then 2^n built in the exponent bits. Below -87, where 2^n
 * leaves the normal range, it returns 0 (the true value is < 1.7e-38, nothing next to the max's exp(0)
 * = 1 in the softmax sum); -inf gives 0 and NaN stays NaN. tests/kernels measures the error. */
static inline float exp_nonpos(float x)
{
    const float lo = -87.f;
    const float xc = x < lo ? lo : x;
    const float n = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;   /* round(x / ln2) */
    const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;            /* ln2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x < lo ? 0.f : p * two_n;
}

/* Running state of one group: per head the max score m, the sum of exp(score - m) l, and the
 * accumulator acc = sum of exp(score - m) * value. */
typedef struct {
    float *m, *l, *acc;
} Running;

/* Fold n (<= block_size) keys/values of one block into the running state of G heads.
 * k, v point at the block's first token for this kv head; consecutive tokens are `token_stride` apart.
 * p is scratch for G * block_size probabilities. */
static inline __attribute__((always_inline)) void
attend_block(const float *restrict q, const kv_t *restrict k, const kv_t *restrict v, int64_t n,
             int64_t token_stride, int64_t G, int64_t D, int64_t block_size, float scale,
             float *restrict p, Running st)
{
    int64_t t0 = 0;
    for (; t0 + TILE <= n; t0 += TILE)
        for (int64_t g = 0; g < G; ++g)
            dot_tile(q + g * D, k + t0 * token_stride, token_stride, D, p + g * block_size + t0);
    for (int64_t t = t0; t < n; ++t)           /* a block shorter than a tile, or its tail */
        for (int64_t g = 0; g < G; ++g)
            p[g * block_size + t] = dot(q + g * D, k + t * token_stride, D);
    for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < n; ++t)
            p[g * block_size + t] *= scale;

    for (int64_t g = 0; g < G; ++g) {
        float *pg = p + g * block_size;
        float mx = st.m[g];
        for (int64_t t = 0; t < n; ++t)
            mx = pg[t] > mx ? pg[t] : mx;
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
            pg[t] = exp_nonpos(pg[t] - mx);
            sum += pg[t];
        }
        float alpha = exp_nonpos(st.m[g] - mx);      /* 0 on the first block (m = -inf) */
        st.l[g] = st.l[g] * alpha + sum;
        st.m[g] = mx;
        if (alpha != 1.f)
            for (int64_t d = 0; d < D; ++d)
                st.acc[g * D + d] *= alpha;
    }

    for (int64_t g = 0; g < G; ++g) {          /* head-major: the head's accumulator stays in registers */
        float *restrict a = st.acc + g * D;
        for (int64_t t = 0; t < n; ++t) {
            const kv_t *vt = v + t * token_stride;
            const float w = p[g * block_size + t];
            for (int64_t d = 0; d < D; ++d)
                a[d] += w * KV(vt[d]);
        }
    }
}

/* Ask for the given heads' slices of n token rows before they are needed: a block is only a few pages,
 * too short for the hardware prefetcher to get ahead of the loads. */
static inline void prefetch_rows(const kv_t *k, const kv_t *v, int64_t n, int64_t token_stride, int64_t width)
{
    for (int64_t t = 0; t < n; ++t)
        for (int64_t off = 0; off < width; off += 64 / sizeof(kv_t)) {   /* one 64-byte cache line */
            __builtin_prefetch(k + t * token_stride + off);
            __builtin_prefetch(v + t * token_stride + off);
        }
}

typedef struct {
    const float *q;
    int64_t q_row_stride, q_head_stride;
    const kv_t *k_cache, *v_cache;
    const int64_t *rows, *block_tables, *seq_lens;
    float *out;
    int64_t out_row_stride, out_head_stride;
    int64_t H, Hkv, block_size, max_blocks;
    float scale;
} Args;

/* One work item: sequence b, kv heads [h0, h0 + nh). Each kv head's arithmetic is the same whatever nh
 * is, so how the work is split never changes a result. Inlined per head_dim so the common sizes get
 * constant trip counts. */
static inline __attribute__((always_inline)) void
attend_item(const Args *a, int64_t b, int64_t h0, int64_t nh, int64_t D)
{
    const int64_t G = a->H / a->Hkv, bs = a->block_size;
    const int64_t token_stride = a->Hkv * D, block_stride = bs * token_stride;
    const int64_t len = a->seq_lens[b];
    const int64_t *table = a->block_tables + b * a->max_blocks;
    const int64_t nq = nh * G;                 /* query heads of the item, from query head h0 * G on */

    float q[nq * D], m[nq], l[nq], acc[nq * D], p[G * bs];
    const float *qb = a->q + a->rows[b] * a->q_row_stride + h0 * G * a->q_head_stride;
    for (int64_t i = 0; i < nq; ++i) {
        for (int64_t d = 0; d < D; ++d) {
            q[i * D + d] = qb[i * a->q_head_stride + d];
            acc[i * D + d] = 0.f;
        }
        m[i] = -INFINITY;
        l[i] = 0.f;
    }

    for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
        const int64_t n = len - start < bs ? len - start : bs;
        if (start + bs < len) {
            const int64_t next = table[j + 1] * block_stride + h0 * D;
            const int64_t n_next = len - start - bs < bs ? len - start - bs : bs;
            prefetch_rows(a->k_cache + next, a->v_cache + next, n_next, token_stride, nh * D);
        }
        for (int64_t h = 0; h < nh; ++h) {
            const int64_t offset = table[j] * block_stride + (h0 + h) * D;
            Running st = {m + h * G, l + h * G, acc + h * G * D};
            attend_block(q + h * G * D, a->k_cache + offset, a->v_cache + offset, n, token_stride, G, D, bs,
                         a->scale, p, st);
        }
    }

    float *ob = a->out + a->rows[b] * a->out_row_stride + h0 * G * a->out_head_stride;
    for (int64_t i = 0; i < nq; ++i) {
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;   /* len == 0 gives zeros, not NaN */
        for (int64_t d = 0; d < D; ++d)
            ob[i * a->out_head_stride + d] = acc[i * D + d] * inv;
    }
}

static void run_item(const Args *a, int64_t b, int64_t h0, int64_t nh, int64_t D)
{
    switch (D) {
    case 64: attend_item(a, b, h0, nh, 64); break;
    case 128: attend_item(a, b, h0, nh, 128); break;
    default: attend_item(a, b, h0, nh, D); break;
    }
}

/* q, out: [T, H, D] with the given row/head strides (dim stride 1); decode sequence b reads q row rows[b]
 * and writes out row rows[b]. block_tables: [B, max_blocks]; seq_lens: [B] (each <= max_blocks * block_size).
 * num_threads: OpenMP threads to use (the caller passes torch's setting). */
void paged_decode_attention(const float *q, int64_t q_row_stride, int64_t q_head_stride,
                            const kv_t *k_cache, const kv_t *v_cache,
                            const int64_t *rows, const int64_t *block_tables, const int64_t *seq_lens,
                            float *out, int64_t out_row_stride, int64_t out_head_stride,
                            int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks,
                            float scale, int num_threads)
{
    const Args a = {q, q_row_stride, q_head_stride, k_cache, v_cache, rows, block_tables, seq_lens,
                    out, out_row_stride, out_head_stride, H, Hkv, block_size, max_blocks, scale};
    /* A whole sequence per item reads each block front to back; with few sequences per thread, split
     * them by kv head instead so that every thread gets work. */
    const int64_t nh = B >= 4 * (int64_t)num_threads ? Hkv : 1;
    const int64_t per_seq = Hkv / nh;
    /* Dynamic scheduling evens out mixed sequence lengths; it cannot change results, since each item
     * is computed whole by one thread. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i < B * per_seq; ++i)
        run_item(&a, i / per_seq, i % per_seq * nh, nh, D);
}
