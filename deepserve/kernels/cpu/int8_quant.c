/* Per-token int8 activation quantization and the int32 -> float epilogue of w8a8 linear layers (CPU).
 *
 * quantize_rows:   scale[r] = max(max_c |x[r, c]|, 1e-8) / 127;  q[r, c] = round_half_even(x[r, c] / scale[r])
 * dequantize_rows: out[r, c] = (float)acc[r, c] * row_scale[r] * col_scale[c]
 *
 * The PyTorch version makes six passes over the activations (abs, amax, divide, round, convert, and
 * three for the epilogue); these make one read for the maximum and one read + write for the rest. The
 * arithmetic is the same as PyTorch's (a true division, nearbyintf = round half to even in the default
 * rounding mode, the two scale products in the same order), so the results are bit-identical to it.
 */

#include <math.h>
#include <stdint.h>

void quantize_rows(const float *x, int64_t rows, int64_t cols, int64_t x_stride, int8_t *q, float *scales,
                   int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        float amax = 0.0f;
        for (int64_t c = 0; c < cols; ++c) {
            float a = fabsf(xr[c]);
            amax = a > amax ? a : amax;
        }
        float scale = (amax > 1e-8f ? amax : 1e-8f) / 127.0f;
        scales[r] = scale;
        int8_t *qr = q + r * cols;
        for (int64_t c = 0; c < cols; ++c)
            qr[c] = (int8_t)nearbyintf(xr[c] / scale);
    }
}

void dequantize_rows(const int32_t *acc, int64_t rows, int64_t cols, const float *row_scales,
                     const float *col_scales, float *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const int32_t *ar = acc + r * cols;
        float *orow = out + r * cols;
        float rs = row_scales[r];
        for (int64_t c = 0; c < cols; ++c)
            orow[c] = ((float)ar[c] * rs) * col_scales[c];
    }
}
