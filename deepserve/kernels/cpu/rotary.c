/* NeoX rotary embedding on the CPU, float32: one call instead of ~9 PyTorch ops (two cos/sin gathers, the
 * rotate-half concatenation, multiplies and adds). Measured on 2 cores, q and k of SmolLM2 (12 heads x 64):
 * 17 us vs 21 us at 1 token, 30 vs 69 us at 64 tokens, 0.67 vs 6.8 ms at a 2048-token prefill.
 *
 * For j < D/2, with (c, s) = cos/sin[pos][j] and (c2, s2) at j + D/2:
 *   out[j] = x[j] c - x[j + D/2] s,   out[j + D/2] = x[j + D/2] c2 + x[j] s2
 * Rows (tokens) are independent; OpenMP splits them only when there are enough to pay for waking a thread.
 */

#include <stdint.h>

#define PARALLEL_ROWS 16

void rotate_half_rows(const float *x, int64_t x_row_stride, int64_t x_head_stride, const int64_t *positions,
                      const float *cos_cache, const float *sin_cache, int64_t cache_stride, float *out,
                      int64_t rows, int64_t heads, int64_t dim, int num_threads) {
    int64_t half = dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; ++t) {
        const float *cs = cos_cache + positions[t] * cache_stride;
        const float *sn = sin_cache + positions[t] * cache_stride;
        for (int64_t h = 0; h < heads; ++h) {
            const float *xh = x + t * x_row_stride + h * x_head_stride;
            float *oh = out + (t * heads + h) * dim;
            for (int64_t j = 0; j < half; ++j) {
                float x1 = xh[j], x2 = xh[j + half];
                oh[j] = x1 * cs[j] - x2 * sn[j];
                oh[j + half] = x2 * cs[j + half] + x1 * sn[j + half];
            }
        }
    }
}
