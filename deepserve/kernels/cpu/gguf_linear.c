/* y[M, N] = x[M, K] @ W^T for W kept as GGUF's packed blocks (CPU): Q4_1 and Q8_0, fp32 activations.
 *
 * Block layouts (ggml's, read in the gguf package's dequantize code), 32 weights each, blocks run along K:
 *   Q4_1 (ggml type 3), 20 bytes: fp16 d, fp16 m, 16 bytes qs;  w[j] = d * (qs[j] & 15) + m,
 *                                                                w[j + 16] = d * (qs[j] >> 4) + m   (j < 16)
 *   Q8_0 (ggml type 8), 34 bytes: fp16 d, int8 qs[32];          w[j] = d * qs[j]
 * A row of W is K / 32 consecutive blocks, rows one after the other.
 *
 * The product (numeric option (a) of issue 21): the activations stay fp32, each block's integers are widened to
 * float and multiplied into x, so the weights are exactly GGUF's and results equal x @ dequantize(W)^T up to
 * the order of the sums:   y[r, n] = sum_b d_b * (sum_j x[r, 32b + j] * q_b[j]) + m_b * xsum[r, b],
 * xsum[r, b] = sum_j x[r, 32b + j] computed once per call for all N rows (Q4_1's offset term).
 *
 * One runtime choice of code (`isa`, decided by gguf_linear.py from the CPU's flags, each function compiled for
 * its own target with a target attribute, so one library holds all of them): 2 = AVX-512 (F, BW, VL), 1 = AVX2 +
 * FMA + F16C, 0 = plain C. A path the CPU lacks (checked again here with __builtin_cpu_supports) falls back to the
 * next one down, never to an illegal instruction. Output rows are spread over OpenMP threads; activation rows
 * are taken up to 4 at a time per weight row, so a block is unpacked once for all of them.
 *
 * gguf_dequantize_rows: rows of W as fp32, bit for bit the gguf package's dequantization (d * q + m, two
 * roundings: fp-contract is off there), for embedding lookups and for GEMMs of many rows (run as dequantize +
 * sgemm by the caller).
 */

#if defined(__x86_64__) || defined(__i386__)
#define GGUF_X86 1
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { GGML_Q4_1 = 3, GGML_Q8_0 = 8 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
/* The vector paths of option (a) prefetch the weight row this many rows ahead: with the hardware prefetcher alone a
 * decode step's GEMMs were ~25% slower (batch-1 decode of the default model 59-65 -> 81-85 tok/s, 2-core AVX-512
 * Xeon). Option (b) below has no prefetch yet. A prefetch past the end of W is a hint that cannot fault. */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 4
#endif
#define MT 4                     /* activation rows per pass over a weight row */

static inline int block_bytes(int qtype) { return qtype == GGML_Q4_1 ? 20 : 34; }

/* IEEE half -> float, exact (normals, subnormals, inf, NaN), no F16C needed. */
static inline float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {                       /* subnormal: normalise */
        int e = -1;
        do { mant <<= 1; ++e; } while (!(mant & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ---------------------------------------------------------------- plain C ---------------------------------- */

static void rows_scalar(int qtype, const uint8_t *wrow, const float *x, int64_t ldx, const float *xs, int64_t nb,
                        int mt, float *out, int64_t ldy)
{
    for (int r = 0; r < mt; ++r) {
        const float *xr = x + r * ldx;
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = xr + 32 * b;
            float s = 0.f;
            if (qtype == GGML_Q4_1) {
                const uint8_t *blk = wrow + 20 * b, *qs = blk + 4;
                for (int j = 0; j < 16; ++j)
                    s += xb[j] * (float)(qs[j] & 15) + xb[j + 16] * (float)(qs[j] >> 4);
                acc += half_to_float(load_u16(blk)) * s + half_to_float(load_u16(blk + 2)) * xs[r * nb + b];
            } else {
                const uint8_t *blk = wrow + 34 * b;
                const int8_t *qs = (const int8_t *)(blk + 2);
                for (int j = 0; j < 32; ++j)
                    s += xb[j] * (float)qs[j];
                acc += half_to_float(load_u16(blk)) * s;
            }
        }
        out[r * ldy] = acc;
    }
}

#ifdef GGUF_X86
/* ---------------------------------------------------------------- AVX2 ------------------------------------- */

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2_TARGET static void rows_avx2(int qtype, const uint8_t *wrow, const float *x, int64_t ldx, const float *xs,
                                  int64_t nb, int mt, float *out, int64_t ldy)
{
    __m256 acc[MT];
    float macc[MT];
    for (int r = 0; r < MT; ++r) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.f; }
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const int64_t bb = qtype == GGML_Q4_1 ? 20 : 34, ahead = PREFETCH_ROWS * nb * bb;
    for (int64_t b = 0; b < nb; ++b) {
        if (!(b & 1))       /* a cache line every two blocks: the row PREFETCH_ROWS ahead */
            _mm_prefetch((const char *)(wrow + ahead + b * bb), _MM_HINT_T0);
        __m256 q0, q1, q2, q3;
        float d, m = 0.f;
        if (qtype == GGML_Q4_1) {
            const uint8_t *blk = wrow + 20 * b;
            uint32_t dm;
            memcpy(&dm, blk, 4);
            const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
            d = _mm_cvtss_f32(dmf);
            m = _mm_cvtss_f32(_mm_shuffle_ps(dmf, dmf, 1));
            const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4));
            const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
            q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        } else {
            const uint8_t *blk = wrow + 34 * b;
            d = _cvtsh_ss(load_u16(blk));
            const __m128i v0 = _mm_loadu_si128((const __m128i *)(blk + 2));
            const __m128i v1 = _mm_loadu_si128((const __m128i *)(blk + 18));
            q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
            q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
            q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
            q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
        }
        const __m256 vd = _mm256_set1_ps(d);
        for (int r = 0; r < mt; ++r) {
            const float *xb = x + r * ldx + 32 * b;
            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb), q0);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q1, t);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q2, t);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q3, t);
            acc[r] = _mm256_fmadd_ps(t, vd, acc[r]);
            if (qtype == GGML_Q4_1)
                macc[r] += m * xs[r * nb + b];
        }
    }
    for (int r = 0; r < mt; ++r)
        out[r * ldy] = hsum256(acc[r]) + macc[r];
}

/* ---------------------------------------------------------------- AVX-512 ---------------------------------- */

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* One block's 32 weights as two float vectors (elements 0-15, 16-31), its d and (Q4_1) m. */
AVX512_TARGET static inline __attribute__((always_inline))
void unpack512(const int qtype, const uint8_t *wrow, int64_t b, __m512 *q0, __m512 *q1, float *d, float *m)
{
    if (qtype == GGML_Q4_1) {
        const uint8_t *blk = wrow + 20 * b;
        uint32_t dm;
        memcpy(&dm, blk, 4);
        const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        *d = _mm_cvtss_f32(dmf);
        *m = _mm_cvtss_f32(_mm_shuffle_ps(dmf, dmf, 1));
        const __m128i low4 = _mm_set1_epi8(0x0f);
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4));
        *q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low4)));
        *q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low4)));
    } else {
        const uint8_t *blk = wrow + 34 * b;
        *d = _cvtsh_ss(load_u16(blk));
        *m = 0.f;
        *q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
        *q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
    }
}

/* `mt` rows of x against one weight row; qtype and mt are constants where this is inlined (rows_avx512), so the
 * accumulators stay in registers. Even and odd blocks sum into separate accumulators: two FMA chains. */
AVX512_TARGET static inline __attribute__((always_inline))
void rows_avx512_impl(const int qtype, const uint8_t *wrow, const float *x, int64_t ldx, const float *xs, int64_t nb,
                      const int mt, float *out, int64_t ldy)
{
    __m512 acc[MT][2];
    float macc[MT];
    for (int r = 0; r < mt; ++r) { acc[r][0] = acc[r][1] = _mm512_setzero_ps(); macc[r] = 0.f; }
    int64_t b = 0;
    const int64_t row_bytes = nb * (qtype == GGML_Q4_1 ? 20 : 34), stride = qtype == GGML_Q4_1 ? 40 : 68;
    for (; b + 2 <= nb; b += 2) {
        _mm_prefetch((const char *)(wrow + PREFETCH_ROWS * row_bytes + b / 2 * stride), _MM_HINT_T0);
        for (int h = 0; h < 2; ++h) {
            __m512 q0, q1;
            float d, m;
            unpack512(qtype, wrow, b + h, &q0, &q1, &d, &m);
            const __m512 vd = _mm512_set1_ps(d);
            for (int r = 0; r < mt; ++r) {
                const float *xb = x + r * ldx + 32 * (b + h);
                __m512 t = _mm512_mul_ps(_mm512_loadu_ps(xb), q0);
                t = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), q1, t);
                acc[r][h] = _mm512_fmadd_ps(t, vd, acc[r][h]);
                if (qtype == GGML_Q4_1)
                    macc[r] += m * xs[r * nb + b + h];
            }
        }
    }
    if (b < nb) {
        __m512 q0, q1;
        float d, m;
        unpack512(qtype, wrow, b, &q0, &q1, &d, &m);
        const __m512 vd = _mm512_set1_ps(d);
        for (int r = 0; r < mt; ++r) {
            const float *xb = x + r * ldx + 32 * b;
            __m512 t = _mm512_mul_ps(_mm512_loadu_ps(xb), q0);
            t = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), q1, t);
            acc[r][0] = _mm512_fmadd_ps(t, vd, acc[r][0]);
            if (qtype == GGML_Q4_1)
                macc[r] += m * xs[r * nb + b];
        }
    }
    for (int r = 0; r < mt; ++r)
        out[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + macc[r];
}

AVX512_TARGET static void rows_avx512(int qtype, const uint8_t *wrow, const float *x, int64_t ldx, const float *xs,
                                      int64_t nb, int mt, float *out, int64_t ldy)
{
#define CASE(MTV)                                                                                   \
    case MTV:                                                                                       \
        if (qtype == GGML_Q4_1) rows_avx512_impl(GGML_Q4_1, wrow, x, ldx, xs, nb, MTV, out, ldy);   \
        else rows_avx512_impl(GGML_Q8_0, wrow, x, ldx, xs, nb, MTV, out, ldy);                      \
        break;
    switch (mt) { CASE(1) CASE(2) CASE(3) CASE(4) default: break; }
#undef CASE
}

#endif /* GGUF_X86 */

/* ---------------------------------------------------------------- entry points ----------------------------- */

typedef void (*rows_fn)(int, const uint8_t *, const float *, int64_t, const float *, int64_t, int, float *, int64_t);

static int usable_isa(int isa)
{
#ifndef GGUF_X86
    (void)isa;
    return ISA_SCALAR;
#else
    __builtin_cpu_init();
    if (isa >= ISA_AVX512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2"))
        return ISA_AVX512;
    if (isa >= ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return ISA_AVX2;       /* F16C: every AVX2 CPU has it (Haswell / Zen on) */
    return ISA_SCALAR;
#endif
}

/* The code `isa` asks for, or the best this CPU runs below it: what gguf_linear will run (for tests). */
void gguf_resolved_isa(int isa, int *out) { *out = usable_isa(isa); }

void gguf_linear(int qtype, int isa, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx,
                 float *y, int64_t ldy, int num_threads)
{
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(qtype);
    rows_fn fn = rows_scalar;
#ifdef GGUF_X86
    switch (usable_isa(isa)) {
    case ISA_AVX512: fn = rows_avx512; break;
    case ISA_AVX2: fn = rows_avx2; break;
    default: break;
    }
#else
    (void)isa;
#endif
    float *xs = NULL;
    if (qtype == GGML_Q4_1) {          /* block sums of x, for the m * sum(x) term */
        xs = malloc(sizeof(float) * (size_t)(M * nb > 0 ? M * nb : 1));
        for (int64_t r = 0; r < M; ++r)
            for (int64_t b = 0; b < nb; ++b) {
                const float *xb = x + r * ldx + 32 * b;
                float s = 0.f;
                for (int j = 0; j < 32; ++j)
                    s += xb[j];
                xs[r * nb + b] = s;
            }
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * K * (M < 4 ? M : 4) > 65536)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *wrow = w + n * row_bytes;
        for (int64_t r = 0; r < M; r += MT) {
            const int mt = (int)(M - r < MT ? M - r : MT);
            fn(qtype, wrow, x + r * ldx, ldx, xs ? xs + r * nb : NULL, nb, mt, y + r * ldy + n, ldy);
        }
    }
    free(xs);
}

/* out[i, :] = dequantized row rows[i] of W (rows NULL: rows 0 .. n - 1), as the gguf package computes it. */
__attribute__((optimize("fp-contract=off")))
void gguf_dequantize_rows(int qtype, const uint8_t *w, int64_t K, const int64_t *rows, int64_t n, float *out,
                          int num_threads)
{
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(qtype);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * K > 262144)
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t *wrow = w + (rows ? rows[i] : i) * row_bytes;
        float *o = out + i * K;
        for (int64_t b = 0; b < nb; ++b) {
            float *ob = o + 32 * b;
            if (qtype == GGML_Q4_1) {
                const uint8_t *blk = wrow + 20 * b, *qs = blk + 4;
                const float d = half_to_float(load_u16(blk)), m = half_to_float(load_u16(blk + 2));
                for (int j = 0; j < 16; ++j) {
                    ob[j] = d * (float)(qs[j] & 15) + m;
                    ob[j + 16] = d * (float)(qs[j] >> 4) + m;
                }
            } else {
                const uint8_t *blk = wrow + 34 * b;
                const int8_t *qs = (const int8_t *)(blk + 2);
                const float d = half_to_float(load_u16(blk));
                for (int j = 0; j < 32; ++j)
                    ob[j] = (float)qs[j] * d;
            }
        }
    }
}
