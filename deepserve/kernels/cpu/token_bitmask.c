/* Structured outputs: logits[row, t] = -inf for every token t whose bit is clear in that row's bitmask.
 *
 * The bitmask is int32 words, 32 tokens a word (token t is bit t % 32 of word t / 32), bit set = allowed.
 * Unpacking it with torch ops builds [rows, vocab] int32 and bool intermediates (~12 ms at 32 x 49152 on a
 * shared core); xgrammar's CPU kernel visits disallowed tokens one by one (as slow when nearly all are, as in
 * JSON). Here a word of all ones is skipped and the others are a branch-free select over their 32 tokens.
 * Rows are independent: one thread each.
 */

#include <math.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, int64_t stride, const int32_t *bitmask, int64_t words,
                         const int64_t *rows, int64_t num_rows, int64_t vocab, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= 4)
    for (int64_t i = 0; i < num_rows; ++i) {
        float *x = logits + rows[i] * stride;
        const uint32_t *m = (const uint32_t *)(bitmask + rows[i] * words);
        for (int64_t w = 0; w < words; ++w) {
            const uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu)
                continue;
            const int64_t base = w * 32;
            const int64_t n = vocab - base < 32 ? vocab - base : 32;
            /* A select, not a branch on each bit: gcc vectorizes it, and mixed words are common (a regex over
             * letters allows ~2/3 of SmolLM2's vocabulary, scattered). */
            for (int64_t j = 0; j < n; ++j)
                x[base + j] = ((bits >> j) & 1u) ? x[base + j] : -INFINITY;
        }
    }
}
