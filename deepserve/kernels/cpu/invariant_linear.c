/* Batch-invariant linear layer on the CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32.
 *
 * The invariant: every output element is computed by one fixed sequence of operations that depends only on K,
 * never on M (the number of rows), on the row's place among them, on N, on the thread count or on which thread
 * ran it. That sequence: 16 lane accumulators, lane j summing x[k] * w[k] for k = j, j + 16, j + 32, ... in
 * increasing k (one vector FMA per 16 k), then one fixed tree over the 16 lanes, then the bias. BLAS libraries
 * do not promise this: MKL picks a GEMV for one row and other kernels (and K splits) by M and thread count, so a
 * row's result moves by an ulp when its batch changes (tests/engine/test_batch_invariant_mode.py shows it).
 *
 * The work is blocked 4 rows x 4 weight rows (16 vector accumulators held in registers, 8 loads per 16 FMAs);
 * edge blocks use the same inline micro-kernel with smaller constant sizes, so their arithmetic per element is
 * the same. K must be a multiple of 16 (the Python side checks it and otherwise pads nothing: it falls back).
 * Rows are taken 64 at a time (their x stays in L2) and weight rows are split over threads in blocks of 4.
 *
 * Written with GCC/Clang vector extensions (16-float vectors: one AVX-512 register, two AVX ones, whatever
 * -march=native has), not intrinsics; no -ffast-math, so the compiler keeps the written order.
 */

#include <stdint.h>

#if !(defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#error "needs __builtin_shufflevector (GCC >= 12 or Clang); the fixed-tile F.linear path is used instead"
#endif

#define W 16
#define MR 4
#define NR 4
#define M_CHUNK 64

typedef float vf __attribute__((vector_size(4 * W)));
typedef float vf_u __attribute__((vector_size(4 * W), aligned(4)));

static inline vf load_f(const float *p) { return *(const vf_u *)p; }

/* Sum of the lanes in one fixed tree (the same as paged_attention.c's). */
static inline float sum_lanes(vf x)
{
    x = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x = x + __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x = x + __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
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
                acc[i][j] += xv[i] * wv[j];
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
    switch (nr) {
    case 4: rows_by_cols(x, x_stride, w, w_stride, bias, y, y_stride, m, K, 4); break;
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
