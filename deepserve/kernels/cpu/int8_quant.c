/* Per-token int8 quantization of w8a8 activations, and the int32 -> float epilogue of w8a8 GEMMs (CPU).
 *
 * quantize_rows:   s[r] = max(max_c |x[r, c]|, 1e-8) / 127;  q[r, c] = round_half_even(x[r, c] / s[r])
 * dequantize_rows: out[r, c] = (float)acc[r, c] * row_scale[r] * col_scale[c]
 *
 * Both bit-identical to the PyTorch versions they replace (int8_quant.py has them), in one pass over a row
 * where PyTorch makes five (abs, max, divide, round, convert) or three (convert, two products): same
 * operations on the same values in the same order. The quantizer is written with vector extensions because
 * plain C rounding does not vectorize without -fno-trapping-math: rounding half to even here is adding and
 * subtracting 1.5 * 2^23, exact for |v| <= 127 under the default rounding mode, as is converting the
 * rounded value to an integer.
 */

#include <math.h>
#include <stdint.h>

#define W 16
typedef float vf __attribute__((vector_size(4 * W)));
typedef float vf_u __attribute__((vector_size(4 * W), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef int8_t vb_u __attribute__((vector_size(W), aligned(1)));

static float row_absmax(const float *x, int64_t cols)
{
    vf m = {0};
    int64_t c = 0;
    for (; c + W <= cols; c += W) {
        const vf v = *(const vf_u *)(x + c);
        const vf a = (vf)((vi)v & 0x7fffffff);              /* |v| */
        const vi gt = a > m;
        m = (vf)((gt & (vi)a) | (~gt & (vi)m));
    }
    float best = 0.f;
    for (int j = 0; j < W; ++j)
        best = m[j] > best ? m[j] : best;
    for (; c < cols; ++c)
        best = fabsf(x[c]) > best ? fabsf(x[c]) : best;
    return best;            /* NaN inputs (a broken model) give garbage here and in torch alike, not the same garbage */
}

void quantize_rows(const float *x, int64_t rows, int64_t cols, int8_t *q, float *scales, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * cols;
        int8_t *qr = q + r * cols;
        float amax = row_absmax(xr, cols);
        const float s = (amax < 1e-8f ? 1e-8f : amax) / 127.0f;
        scales[r] = s;
        const float magic = 12582912.0f;                  /* 1.5 * 2^23 */
        int64_t c = 0;
        for (; c + W <= cols; c += W) {
            const vf v = *(const vf_u *)(xr + c) / s;
            const vf rounded = (v + magic) - magic;
            *(vb_u *)(qr + c) = __builtin_convertvector(__builtin_convertvector(rounded, vi), vb_u);
        }
        for (; c < cols; ++c)
            qr[c] = (int8_t)(int32_t)((xr[c] / s + magic) - magic);
    }
}

void dequantize_rows(const int32_t *acc, int64_t rows, int64_t cols, const float *row_scales,
                     const float *col_scales, float *out, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const int32_t *ar = acc + r * cols;
        float *orow = out + r * cols;
        float rs = row_scales[r];
        for (int64_t c = 0; c < cols; ++c)
            orow[c] = ((float)ar[c] * rs) * col_scales[c];
    }
}
