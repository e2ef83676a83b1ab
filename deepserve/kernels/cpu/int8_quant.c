/* The int32 -> float epilogue of w8a8 linear layers (CPU).
 *
 * dequantize_rows: out[r, c] = (float)acc[r, c] * row_scale[r] * col_scale[c]
 *
 * (Per-token quantization was here too; measured against PyTorch 2.13 at 64 x 576-1536 it was slower, 38-90 us
 * vs 30-55 us: scalar rounding does not vectorize without -fno-trapping-math. PyTorch's version runs now.)
 *
 * PyTorch makes three passes over the int32 accumulator (convert, two scale products); this makes one,
 * with the same two products in the same order, so the results are bit-identical to it (18 vs 33 us at
 * 64 x 3072 on 2 cores).
 */

#include <math.h>
#include <stdint.h>

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
