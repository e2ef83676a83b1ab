/* Elementwise steps of a decoder layer on the CPU, float32, one call each instead of 5-10 PyTorch ops.
 *
 * At batch 1 a layer's norms, rotary and SiLU-and-mul are ~25 tiny PyTorch ops whose dispatch costs more than
 * their arithmetic (~1.5 ms of a ~25 ms decode step of SmolLM2-135M on 2 cores); each function here is one
 * pass over its rows.
 *
 * rms_norm_rows:   h = x (+ residual); out = weight * (h / sqrt(mean(h^2) + eps)); residual_out = h
 *                  (the mean of squares is summed in double, then rounded: at least as exact as PyTorch's
 *                  float32 sum, within an ulp or two of it)
 * rotate_half_rows: NeoX rotary: for j < D/2, with (c, s) = cos/sin[pos][j] and (c2, s2) at j + D/2,
 *                  out[j] = x[j] c - x[j + D/2] s,  out[j + D/2] = x[j + D/2] c2 + x[j] s2
 * silu_mul_rows:   out[i] = g[i] / (1 + exp(-g[i])) * u[i], gate g then up u in each input row
 *
 * Rows are independent (a row's result does not depend on the batch); OpenMP splits rows only when there
 * are enough of them to pay for waking the second thread.
 */

#include <math.h>
#include <stdint.h>

#define PARALLEL_ROWS 16

void rms_norm_rows(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                   const float *weight, float *out, int64_t out_stride, float *res_out, int64_t res_out_stride,
                   int64_t rows, int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        float *orow = out + r * out_stride;
        double sum = 0.0;
        if (residual) {
            const float *rr = residual + r * res_stride;
            float *hr = res_out + r * res_out_stride;
            for (int64_t c = 0; c < cols; ++c) {
                float h = xr[c] + rr[c];
                hr[c] = h;
                sum += (double)h * h;
            }
            xr = hr;
        } else {
            for (int64_t c = 0; c < cols; ++c)
                sum += (double)xr[c] * xr[c];
        }
        float inv = 1.0f / sqrtf((float)(sum / (double)cols) + eps);
        for (int64_t c = 0; c < cols; ++c)
            orow[c] = weight[c] * (xr[c] * inv);
    }
}

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

void silu_mul_rows(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = x + r * x_stride;
        const float *u = g + inter;
        float *orow = out + r * inter;
        for (int64_t i = 0; i < inter; ++i)
            orow[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
