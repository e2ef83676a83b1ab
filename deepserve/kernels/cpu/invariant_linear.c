/* Batch-invariant linear layer on the CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32.
 *
 * The invariant: every output element is computed by one fixed sequence of operations that depends only on K
 * (and the CPU's vector width W), never on M (the number of rows), on the row's place among them, on N, on the
 * thread count or on which thread ran it. That sequence: W lane accumulators, lane j summing x[k] * w[k] for
 * k = j, j + W, j + 2 W, ... in increasing k (one vector FMA per W k), then one fixed tree over the W lanes, then
 * the bias. BLAS libraries do not promise this: MKL picks a GEMV for one row and other kernels (and K splits) by M
 * and thread count, so a row's result moves by an ulp when its batch changes (tests/engine/test_batch_invariant_mode.py
 * shows it).
 *
 * The work is blocked MR rows x NR weight rows (4 x 4 at W = 16, 4 x 3 at W = 8: the vector accumulators held in
 * registers); edge blocks use the same inline micro-kernel with smaller constant sizes, so their arithmetic per
 * element is the same. K must be a multiple of 16 (the Python side checks it and otherwise pads nothing: it falls
 * back). Rows are taken 64 at a time (their x stays in L2) and weight rows are split over threads in blocks of NR.
 *
 * Written with GCC/Clang vector extensions, not intrinsics (but the FMAs, see fma_v); no -ffast-math, so the
 * compiler keeps the written order. Vectors are one register of what -march=native has: W = 16 floats (AVX-512),
 * else 8 (AVX2). 16-float vectors on 256-bit registers compile to code that goes through the stack: on an
 * AVX2-only Zen 3 the 16-float build ran 2.8-9.2x slower than the 8-float one, and 1.5-10.6x slower than F.linear
 * (1 to 256 rows, 576 <-> 1536; benchmarks/cpu_invariant_linear_avx2_lanes_s52.json). -DLINEAR_LANES=8 / 16
 * forces a width (the tests build both); the width is part of the fixed order, so results are invariant on a
 * CPU, not between widths.
 */

#include <stdint.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

/* No contraction of a * b + c into an FMA behind our back: GCC decides that per inlined copy of `block`, and on an
 * AVX2 CPU it fused in some row x column edge cases and not in others, so a row's result changed with the row
 * count (session 52). FMAs are written out (fma_v) where the CPU has them, and nowhere else. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#else
#pragma GCC optimize("fp-contract=off")
#endif

#if !(defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#error "needs __builtin_shufflevector (GCC >= 12 or Clang); the fixed-tile F.linear path is used instead"
#endif

#if defined(LINEAR_LANES)
#define W LINEAR_LANES
#elif defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif
#if W == 16
#define MR 4
#define NR 4
#elif W == 8      /* 16 registers: 4 x 3 ran best of 2-4 x 2-4 on a Zen 3 (session 52) */
#define MR 4
#define NR 3
#else
#error "LINEAR_LANES must be 8 or 16"
#endif
#define M_CHUNK 64

typedef float vf __attribute__((vector_size(4 * W)));
typedef float vf_u __attribute__((vector_size(4 * W), aligned(4)));

static inline vf load_f(const float *p) { return *(const vf_u *)p; }

/* a * b + c: one rounding where the CPU has a vector FMA of this width, else two; the same in every call. */
static inline vf fma_v(vf a, vf b, vf c)
{
#if W == 16 && defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif W == 8 && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* Sum of the lanes in one fixed tree (the same as paged_attention.c's). */
static inline float sum_lanes(vf x)
{
#if W == 16
    x = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x = x + __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x = x + __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
    x = x + __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
    x = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
    x = x + __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
    return x[0];
}

/* y[i][j] for i < mr rows of x and j < nr rows of w (mr, nr: compile-time constants at every call). */
static inline __attribute__((always_inline)) void
block(const float *restrict x, int64_t x_stride, const float *restrict w, int64_t w_stride,
      const float *restrict bias, float *restrict y, int64_t y_stride, int64_t K, const int mr, const int nr)
{
    vf acc[MR][NR];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j)
            acc[i][j] = (vf){0};
    for (int64_t k = 0; k < K; k += W) {
        vf xv[MR], wv[NR];
        for (int i = 0; i < mr; ++i)
            xv[i] = load_f(x + i * x_stride + k);
        for (int j = 0; j < nr; ++j)
            wv[j] = load_f(w + j * w_stride + k);
        for (int i = 0; i < mr; ++i)
            for (int j = 0; j < nr; ++j)
                acc[i][j] = fma_v(xv[i], wv[j], acc[i][j]);
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) {
            const float s = sum_lanes(acc[i][j]);
            y[i * y_stride + j] = bias ? s + bias[j] : s;
        }
}

/* Rows [0, m) of x (m <= M_CHUNK) times weight rows [n0, n0 + nr). */
static inline __attribute__((always_inline)) void
rows_by_cols(const float *x, int64_t x_stride, const float *w, int64_t w_stride, const float *bias, float *y,
             int64_t y_stride, int64_t m, int64_t K, const int nr)
{
    int64_t i = 0;
    for (; i + MR <= m; i += MR)
        block(x + i * x_stride, x_stride, w, w_stride, bias, y + i * y_stride, y_stride, K, MR, nr);
    switch (m - i) {
    case 3: block(x + i * x_stride, x_stride, w, w_stride, bias, y + i * y_stride, y_stride, K, 3, nr); break;
    case 2: block(x + i * x_stride, x_stride, w, w_stride, bias, y + i * y_stride, y_stride, K, 2, nr); break;
    case 1: block(x + i * x_stride, x_stride, w, w_stride, bias, y + i * y_stride, y_stride, K, 1, nr); break;
    }
}

static void col_block(const float *x, int64_t x_stride, const float *w, int64_t w_stride, const float *bias,
                      float *y, int64_t y_stride, int64_t m, int64_t K, int64_t nr)
{
    switch (nr) {   /* nr <= NR */
#if NR == 4
    case 4: rows_by_cols(x, x_stride, w, w_stride, bias, y, y_stride, m, K, 4); break;
#endif
    case 3: rows_by_cols(x, x_stride, w, w_stride, bias, y, y_stride, m, K, 3); break;
    case 2: rows_by_cols(x, x_stride, w, w_stride, bias, y, y_stride, m, K, 2); break;
    case 1: rows_by_cols(x, x_stride, w, w_stride, bias, y, y_stride, m, K, 1); break;
    }
}

/* x: [M, K] (row stride x_stride), w: [N, K] (row stride w_stride), bias: [N] or NULL, y: [M, N] (row stride
 * y_stride); K a multiple of 16. num_threads: OpenMP threads (the caller passes torch's setting). */
void invariant_linear(const float *x, int64_t x_stride, const float *w, int64_t w_stride, const float *bias,
                      float *y, int64_t y_stride, int64_t M, int64_t N, int64_t K, int num_threads)
{
    const int64_t col_blocks = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int64_t m = M - m0 < M_CHUNK ? M - m0 : M_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
        for (int64_t b = 0; b < col_blocks; ++b) {
            const int64_t n0 = b * NR, nr = N - n0 < NR ? N - n0 : NR;
            col_block(x + m0 * x_stride, x_stride, w + n0 * w_stride, w_stride, bias ? bias + n0 : 0,
                      y + m0 * y_stride + n0, y_stride, m, K, nr);
        }
    }
}
