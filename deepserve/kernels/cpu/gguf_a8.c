/* y[M, N] = x[M, K] @ W^T for W a GGUF Q4_1 / Q8_0 matrix with int8 activations (quantization="gguf_a8"; the
 * numerics of llama.cpp's CPU matmuls): x quantized per 32-block, integer dot products of the blocks.
 *
 *   x per block b: dx_b = max|x_b| / 127, qx_b = round_half_even(x_b / dx_b) (int8), sx_b = dx_b * sum(qx_b)
 *   y[r, n] = sum_b dw_b * dx_b * (qw_b . qx_b) + mw_b * sx_b            (mw = 0 for Q8_0)
 *
 * Why a layout of its own: gguf_linear.c's fp32 path widens every weight to a float (14-16 G weights/s a core on an
 * AVX-512 Xeon). Here two blocks go through one 512-bit VNNI dpbusd, and nothing is unpacked but one and / shift:
 *
 * The weights, repacked once at load (gguf_a8_repack), row by row, the same bytes per row as the file's blocks:
 *   Q4_1 row: qs[NB][16] (each block's nibble bytes, as stored: low nibbles elements 0-15, high 16-31), d[NB] fp16,
 *             m[NB] fp16.  A 32-byte load at block 2p gives pair p's nibbles: & 15 -> [w_2p 0-15 | w_2p+1 0-15],
 *             >> 4 -> [w_2p 16-31 | w_2p+1 16-31].
 *   Q8_0 row: qs, pair p at 64p as [w_2p 0-15 | w_2p+1 0-15 | w_2p 16-31 | w_2p+1 16-31] (an odd last block: its 32
 *             bytes in element order), then d[NB] fp16.
 * The activations (gguf_a8_quantize), per row: xq[NBP][32] int8 in the same pair order (NBP = NB rounded up to even;
 * an odd last block's partner is zeros), xd[NBS] and xs[NBS] fp32 (NBS = NB rounded up to 16, zero padded).
 * So a pair's 64 weight bytes and 64 activation bytes line up with no shuffle; dpbusd's 32-bit lanes 0-3 and 8-11
 * hold block 2p's partial sums, 4-7 and 12-15 block 2p+1's, each scaled by its dw * dx.
 *
 * Code paths (one library; `isa`: 4 AVX-512 VNNI, 3 AVX-VNNI 256-bit, 1 AVX2 maddubs, 0 plain C; a path the CPU lacks
 * drops to the next one it has, checked with __builtin_cpu_supports). The integer sums are exact in every path; the
 * float sums run in a path's own order. Output rows are spread over OpenMP threads, activation rows taken up to 4 at
 * a time per weight row (the unpacked pair is shared).
 */

#include "gguf_linear.c"

enum { A8_SCALAR = 0, A8_AVX2 = 1, A8_AVX_VNNI = 3, A8_AVX512_VNNI = 4 };

static inline int64_t pairs_up(int64_t nb) { return (nb + 1) / 2; }            /* NBP / 2 */
static inline int64_t scales_up(int64_t nb) { return (nb + 15) / 16 * 16; }    /* NBS */

/* Bytes of one quantized activation row: xq, then xd and xs. */
int64_t gguf_a8_row_bytes(int64_t K)
{
    const int64_t nb = K / 32;
    return 64 * pairs_up(nb) + 8 * scales_up(nb);
}

/* ---------------------------------------------------------------- repacking -------------------------------- */

/* Where element j (< 32) of block b sits in a pair-ordered 32-byte run: pair b/2's 64 bytes, then the half. */
static inline int64_t pair_offset(int64_t b, int j, int64_t nb)
{
    if ((nb & 1) && b == nb - 1)                   /* an odd last block: element order */
        return 32 * b + j;
    return 64 * (b / 2) + (j < 16 ? 0 : 32) + 16 * (b & 1) + (j & 15);
}

/* out[N, row_bytes] = the rows of the file's blocks w in the layout above (N rows, K = 32 * NB). */
void gguf_a8_repack(int qtype, const uint8_t *w, int64_t N, int64_t K, uint8_t *out)
{
    const int64_t nb = K / 32, bb = block_bytes(qtype), row_bytes = nb * bb;
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *src = w + n * row_bytes;
        uint8_t *dst = out + n * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = src + b * bb;
            if (qtype == GGML_Q4_1) {
                memcpy(dst + 16 * b, blk + 4, 16);
                memcpy(dst + 16 * nb + 2 * b, blk, 2);
                memcpy(dst + 18 * nb + 2 * b, blk + 2, 2);
            } else {
                for (int j = 0; j < 32; ++j)
                    dst[pair_offset(b, j, nb)] = blk[2 + j];
                memcpy(dst + 32 * nb + 2 * b, blk, 2);
            }
        }
    }
}

/* out[i, :] = row i of a repacked W as fp32 (d * q + m, two roundings, as gguf_dequantize_rows). */
__attribute__((optimize("fp-contract=off")))
void gguf_a8_dequantize(int qtype, const uint8_t *w, int64_t N, int64_t K, float *out, int num_threads)
{
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(qtype);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * K > 262144)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *row = w + n * row_bytes;
        float *o = out + n * K;
        for (int64_t b = 0; b < nb; ++b) {
            if (qtype == GGML_Q4_1) {
                const float d = half_to_float(load_u16(row + 16 * nb + 2 * b));
                const float m = half_to_float(load_u16(row + 18 * nb + 2 * b));
                for (int j = 0; j < 16; ++j) {
                    o[32 * b + j] = d * (float)(row[16 * b + j] & 15) + m;
                    o[32 * b + j + 16] = d * (float)(row[16 * b + j] >> 4) + m;
                }
            } else {
                const float d = half_to_float(load_u16(row + 32 * nb + 2 * b));
                for (int j = 0; j < 32; ++j)
                    o[32 * b + j] = (float)(int8_t)row[pair_offset(b, j, nb)] * d;
            }
        }
    }
}

/* ---------------------------------------------------------------- activations ------------------------------ */

/* One row of x (K floats) -> xq, xd, xs at `q` (gguf_a8_row_bytes(K) bytes). Every path gives the same bits. */
static void quantize_row_scalar(const float *x, int64_t K, uint8_t *q)
{
    const int64_t nb = K / 32, nbs = scales_up(nb);
    int8_t *xq = (int8_t *)q;
    float *xd = (float *)(q + 64 * pairs_up(nb)), *xs = xd + nbs;
    memset(q, 0, (size_t)gguf_a8_row_bytes(K));
    for (int64_t b = 0; b < nb; ++b) {
        const float *xb = x + 32 * b;
        float amax = 0.f;
        for (int j = 0; j < 32; ++j)
            amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j) {
            const int32_t v = (int32_t)lrintf(xb[j] * inv);        /* round half to even (the default mode) */
            xq[64 * (b / 2) + (j < 16 ? 0 : 32) + 16 * (b & 1) + (j & 15)] = (int8_t)v;
            sum += v;
        }
        xd[b] = d;
        xs[b] = d * (float)sum;
    }
}

#ifdef GGUF_X86
AVX512_TARGET static void quantize_row_avx512(const float *x, int64_t K, uint8_t *q)
{
    const int64_t nb = K / 32, nbs = scales_up(nb);
    int8_t *xq = (int8_t *)q;
    float *xd = (float *)(q + 64 * pairs_up(nb)), *xs = xd + nbs;
    memset(q, 0, (size_t)gguf_a8_row_bytes(K));
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        const __m512 a = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1));
        const float amax = _mm512_reduce_max_ps(a);
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));   /* nearest even */
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
        int8_t *pair = xq + 64 * (b / 2) + 16 * (b & 1);
        _mm_storeu_si128((__m128i *)pair, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(pair + 32), _mm512_cvtepi32_epi8(q1));
        xd[b] = d;
        xs[b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

AVX2_TARGET static void quantize_row_avx2(const float *x, int64_t K, uint8_t *q)
{
    const int64_t nb = K / 32, nbs = scales_up(nb);
    int8_t *xq = (int8_t *)q;
    float *xd = (float *)(q + 64 * pairs_up(nb)), *xs = xd + nbs;
    memset(q, 0, (size_t)gguf_a8_row_bytes(K));
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   /* undo the packs' 128-bit interleave */
    for (int64_t b = 0; b < nb; ++b) {
        __m256 v[4], a = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
            a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float d = _mm_cvtss_f32(m) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        __m256i qi[4];
        for (int i = 0; i < 4; ++i)            /* nearest even, as lrintf */
            qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order);
        int8_t *pair = xq + 64 * (b / 2) + 16 * (b & 1);
        _mm_storeu_si128((__m128i *)pair, _mm256_castsi256_si128(bytes));
        _mm_storeu_si128((__m128i *)(pair + 32), _mm256_extracti128_si256(bytes, 1));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        xd[b] = d;
        xs[b] = d * (float)_mm_cvtsi128_si32(s);
    }
}
#endif

/* x [M, K] (rows ldx apart) -> M quantized rows, gguf_a8_row_bytes(K) bytes apart. */
void gguf_a8_quantize(int isa, const float *x, int64_t M, int64_t ldx, int64_t K, uint8_t *out)
{
    const int64_t rb = gguf_a8_row_bytes(K);
#ifdef GGUF_X86
    if (isa >= A8_AVX512_VNNI && usable_isa(ISA_AVX512) == ISA_AVX512) {
        for (int64_t r = 0; r < M; ++r)
            quantize_row_avx512(x + r * ldx, K, out + r * rb);
        return;
    }
    if (isa >= A8_AVX2 && usable_isa(ISA_AVX2) == ISA_AVX2) {
        for (int64_t r = 0; r < M; ++r)
            quantize_row_avx2(x + r * ldx, K, out + r * rb);
        return;
    }
#else
    (void)isa;
#endif
    for (int64_t r = 0; r < M; ++r)
        quantize_row_scalar(x + r * ldx, K, out + r * rb);
}

/* ---------------------------------------------------------------- plain C ---------------------------------- */

/* The integer dot of weight block b with activation block b (pair order on both sides, element order for an odd
 * last block of Q8_0 weights). */
static int32_t block_dot_scalar(int qtype, const uint8_t *row, const int8_t *xq, int64_t b, int64_t nb)
{
    const int8_t *x_lo = xq + 64 * (b / 2) + 16 * (b & 1), *x_hi = x_lo + 32;    /* elements 0-15, 16-31 */
    int32_t s = 0;
    if (qtype == GGML_Q4_1) {
        const uint8_t *qs = row + 16 * b;
        for (int j = 0; j < 16; ++j)
            s += (qs[j] & 15) * x_lo[j] + (qs[j] >> 4) * x_hi[j];
    } else {
        const int odd_last = (nb & 1) && b == nb - 1;
        const int8_t *w_lo = (const int8_t *)row + (odd_last ? 32 * b : 64 * (b / 2) + 16 * (b & 1));
        const int8_t *w_hi = w_lo + (odd_last ? 16 : 32);
        for (int j = 0; j < 16; ++j)
            s += w_lo[j] * x_lo[j] + w_hi[j] * x_hi[j];
    }
    return s;
}

static void rows_a8_scalar(int qtype, const uint8_t *row, const uint8_t *xrows, int64_t rb, int64_t nb, int mt,
                           float *out, int64_t ldy)
{
    const uint8_t *dptr = row + (qtype == GGML_Q4_1 ? 16 : 32) * nb, *mptr = row + 18 * nb;
    for (int r = 0; r < mt; ++r) {
        const int8_t *xq = (const int8_t *)(xrows + r * rb);
        const float *xd = (const float *)(xrows + r * rb + 64 * pairs_up(nb)), *xs = xd + scales_up(nb);
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
            acc += half_to_float(load_u16(dptr + 2 * b)) * xd[b] * (float)block_dot_scalar(qtype, row, xq, b, nb);
            if (qtype == GGML_Q4_1)
                acc += half_to_float(load_u16(mptr + 2 * b)) * xs[b];
        }
        out[r * ldy] = acc;
    }
}

#ifdef GGUF_X86
/* ---------------------------------------------------------------- AVX2 / AVX-VNNI (256-bit) ---------------- */

#define VNNI512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define VNNI256_TARGET __attribute__((target("avxvnni,avx2,fma,f16c")))

/* A pair's integer sums in 8 lanes (0-3 block 2p, 4-7 block 2p+1) for unsigned u times signed s. */
#define DOT2_VNNI256(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#define DOT2_AVX2(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), \
                                                                      _mm256_set1_epi16(1)))

/* `mt` activation rows against one weight row; a pair's weights are unpacked once for all of them (its two 32-byte
 * halves, |w| and sign for Q8_0). IMPL is inlined with constant qtype and mt, so the accumulators stay in registers. */
#define DEFINE_ROWS_A8_256(NAME, TARGET, DOT)                                                                     \
TARGET static inline __attribute__((always_inline))                                                              \
void NAME##_impl(const int qtype, const uint8_t *row, const uint8_t *xrows, int64_t rb, int64_t nb, const int mt, \
                 float *out, int64_t ldy)                                                                         \
{                                                                                                                 \
    const uint8_t *dptr = row + (qtype == GGML_Q4_1 ? 16 : 32) * nb, *mptr = row + 18 * nb;                       \
    const int64_t xd_offset = 64 * pairs_up(nb), nbs = scales_up(nb);                                             \
    const __m256i low4 = _mm256_set1_epi8(0x0f);                                                                  \
    const __m256i lanes = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);                                               \
    __m256 acc[MT];                                                                                               \
    float tail[MT];                                                                                               \
    for (int r = 0; r < mt; ++r) {                                                                                \
        acc[r] = _mm256_setzero_ps();                                                                             \
        tail[r] = 0.f;                                                                                            \
    }                                                                                                             \
    int64_t b = 0;                                                                                                \
    for (; b + 2 <= nb; b += 2) {                                                                                 \
        __m256i u0, u1, w0 = _mm256_setzero_si256(), w1 = _mm256_setzero_si256();                                \
        if (qtype == GGML_Q4_1) {                                                                                 \
            const __m256i v = _mm256_loadu_si256((const __m256i *)(row + 16 * b));                                \
            u0 = _mm256_and_si256(v, low4);                                                                       \
            u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);                                                 \
        } else {                                                                                                  \
            w0 = _mm256_loadu_si256((const __m256i *)(row + 32 * b));                                             \
            w1 = _mm256_loadu_si256((const __m256i *)(row + 32 * b + 32));                                        \
            u0 = _mm256_sign_epi8(w0, w0);                                                                        \
            u1 = _mm256_sign_epi8(w1, w1);                                                                        \
        }                                                                                                         \
        uint32_t dd;                                                                                              \
        memcpy(&dd, dptr + 2 * b, 4);                                                                             \
        const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd));                                               \
        for (int r = 0; r < mt; ++r) {                                                                            \
            const int8_t *xq = (const int8_t *)(xrows + r * rb);                                                  \
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));                                      \
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 32 * b + 32));                                 \
            if (qtype == GGML_Q8_0) {                  /* |w| . (x * sign(w)) */                                  \
                x0 = _mm256_sign_epi8(x0, w0);                                                                    \
                x1 = _mm256_sign_epi8(x1, w1);                                                                    \
            }                                                                                                     \
            const __m256i p = DOT(DOT(_mm256_setzero_si256(), u0, x0), u1, x1);                                   \
            const float *xd = (const float *)(xrows + r * rb + xd_offset);                                        \
            const __m128 s = _mm_mul_ps(dw, _mm_castpd_ps(_mm_load_sd((const double *)(xd + b))));                \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),                                                       \
                                     _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), lanes), acc[r]);         \
        }                                                                                                         \
    }                                                                                                             \
    for (int r = 0; r < mt; ++r) {                                                                                \
        const int8_t *xq = (const int8_t *)(xrows + r * rb);                                                      \
        const float *xd = (const float *)(xrows + r * rb + xd_offset), *xs = xd + nbs;                            \
        if (b < nb)                            /* an odd last block */                                           \
            tail[r] = half_to_float(load_u16(dptr + 2 * b)) * xd[b] * (float)block_dot_scalar(qtype, row, xq, b, nb); \
        if (qtype == GGML_Q4_1) {              /* sum_b m_b * xs_b */                                             \
            __m256 macc = _mm256_setzero_ps();                                                                    \
            int64_t c = 0;                                                                                        \
            for (; c + 8 <= nb; c += 8)                                                                           \
                macc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mptr + 2 * c))),         \
                                       _mm256_loadu_ps(xs + c), macc);                                            \
            for (; c < nb; ++c)                                                                                   \
                tail[r] += half_to_float(load_u16(mptr + 2 * c)) * xs[c];                                         \
            acc[r] = _mm256_add_ps(acc[r], macc);                                                                 \
        }                                                                                                         \
        out[r * ldy] = hsum256(acc[r]) + tail[r];                                                                 \
    }                                                                                                             \
}                                                                                                                 \
                                                                                                                  \
TARGET static void NAME(int qtype, const uint8_t *row, const uint8_t *xrows, int64_t rb, int64_t nb, int mt,      \
                        float *out, int64_t ldy)                                                                  \
{                                                                                                                 \
    switch (mt * 16 + qtype) {                                                                                    \
    case 16 + GGML_Q4_1: NAME##_impl(GGML_Q4_1, row, xrows, rb, nb, 1, out, ldy); break;                          \
    case 32 + GGML_Q4_1: NAME##_impl(GGML_Q4_1, row, xrows, rb, nb, 2, out, ldy); break;                          \
    case 48 + GGML_Q4_1: NAME##_impl(GGML_Q4_1, row, xrows, rb, nb, 3, out, ldy); break;                          \
    case 64 + GGML_Q4_1: NAME##_impl(GGML_Q4_1, row, xrows, rb, nb, 4, out, ldy); break;                          \
    case 16 + GGML_Q8_0: NAME##_impl(GGML_Q8_0, row, xrows, rb, nb, 1, out, ldy); break;                          \
    case 32 + GGML_Q8_0: NAME##_impl(GGML_Q8_0, row, xrows, rb, nb, 2, out, ldy); break;                          \
    case 48 + GGML_Q8_0: NAME##_impl(GGML_Q8_0, row, xrows, rb, nb, 3, out, ldy); break;                          \
    case 64 + GGML_Q8_0: NAME##_impl(GGML_Q8_0, row, xrows, rb, nb, 4, out, ldy); break;                          \
    default: break;                                                                                               \
    }                                                                                                             \
}

DEFINE_ROWS_A8_256(rows_a8_avxvnni, VNNI256_TARGET, DOT2_VNNI256)
DEFINE_ROWS_A8_256(rows_a8_avx2, AVX2_TARGET, DOT2_AVX2)

/* ---------------------------------------------------------------- AVX-512 VNNI ----------------------------- */

/* `mt` activation rows against one weight row, in chunks of 16 blocks: the chunk's dw (16 fp16 -> fp32) times each
 * row's dx once, then per pair one dpbusd per row and a permute that spreads the two scales over the pair's lanes.
 * qtype and mt are constants where this is inlined. */
VNNI512_TARGET static inline __attribute__((always_inline))
void rows_a8_avx512_impl(const int qtype, const uint8_t *row, const uint8_t *xrows, int64_t rb, int64_t nb,
                         const int mt, float *out, int64_t ldy)
{
    const uint8_t *dptr = row + (qtype == GGML_Q4_1 ? 16 : 32) * nb, *mptr = row + 18 * nb;
    const int64_t xd_offset = 64 * pairs_up(nb), nbs = scales_up(nb);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m512i pair_lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[MT][2], macc[MT];
    float tail[MT];
    for (int r = 0; r < mt; ++r) {
        acc[r][0] = acc[r][1] = macc[r] = _mm512_setzero_ps();
        tail[r] = 0.f;
    }
    for (int64_t c = 0; c < nb; c += 16) {
        const int64_t nbc = nb - c < 16 ? nb - c : 16;
        const __mmask16 live = (__mmask16)((1u << nbc) - 1);
        const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, dptr + 2 * c));
        const __m512 mw = qtype == GGML_Q4_1 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mptr + 2 * c))
                                             : _mm512_setzero_ps();
        __m512 scale[MT];
        for (int r = 0; r < mt; ++r) {
            const float *xd = (const float *)(xrows + r * rb + xd_offset);
            scale[r] = _mm512_mul_ps(dw, _mm512_loadu_ps(xd + c));
            if (qtype == GGML_Q4_1)
                macc[r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(xd + nbs + c), macc[r]);
        }
        const int64_t pairs = nbc / 2;
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t b = c + 2 * p;
            __m512i w;
            __mmask64 negative = 0;
            if (qtype == GGML_Q4_1) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(row + 16 * b));
                w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                                       _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
            } else {
                const __m512i v = _mm512_loadu_si512((const void *)(row + 32 * b));
                negative = _mm512_movepi8_mask(v);
                w = _mm512_abs_epi8(v);
            }
            const __m512i lanes = _mm512_add_epi32(pair_lanes, _mm512_set1_epi32((int)(2 * p)));
            for (int r = 0; r < mt; ++r) {
                __m512i x = _mm512_loadu_si512((const void *)(xrows + r * rb + 32 * b));
                if (qtype == GGML_Q8_0)     /* |w| . (x * sign(w)) */
                    x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
                const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
                acc[r][p & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(lanes, scale[r]),
                                                acc[r][p & 1]);
            }
        }
        if (nbc & 1) {                     /* an odd last block */
            const int64_t b = c + nbc - 1;
            const float d = half_to_float(load_u16(dptr + 2 * b));
            for (int r = 0; r < mt; ++r) {
                const float *xd = (const float *)(xrows + r * rb + xd_offset);
                tail[r] += d * xd[b] * (float)block_dot_scalar(qtype, row, (const int8_t *)(xrows + r * rb), b, nb);
            }
        }
    }
    for (int r = 0; r < mt; ++r)
        out[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), macc[r])) + tail[r];
}

VNNI512_TARGET static void rows_a8_avx512(int qtype, const uint8_t *row, const uint8_t *xrows, int64_t rb,
                                          int64_t nb, int mt, float *out, int64_t ldy)
{
#define CASE(MTV)                                                                                       \
    case MTV:                                                                                           \
        if (qtype == GGML_Q4_1) rows_a8_avx512_impl(GGML_Q4_1, row, xrows, rb, nb, MTV, out, ldy);      \
        else rows_a8_avx512_impl(GGML_Q8_0, row, xrows, rb, nb, MTV, out, ldy);                         \
        break;
    switch (mt) { CASE(1) CASE(2) CASE(3) CASE(4) default: break; }
#undef CASE
}
#endif /* GGUF_X86 */

/* ---------------------------------------------------------------- entry points ----------------------------- */

typedef void (*rows_a8_fn)(int, const uint8_t *, const uint8_t *, int64_t, int64_t, int, float *, int64_t);

static int usable_a8_isa(int isa)
{
#ifdef GGUF_X86
    __builtin_cpu_init();
    if (isa >= A8_AVX512_VNNI && usable_isa(ISA_AVX512) == ISA_AVX512 && __builtin_cpu_supports("avx512vnni"))
        return A8_AVX512_VNNI;
    if (isa >= A8_AVX_VNNI && usable_isa(ISA_AVX2) == ISA_AVX2 && __builtin_cpu_supports("avxvnni"))
        return A8_AVX_VNNI;
    if (isa >= A8_AVX2 && usable_isa(ISA_AVX2) == ISA_AVX2)
        return A8_AVX2;
#else
    (void)isa;
#endif
    return A8_SCALAR;
}

/* The code `isa` asks for, or the best this CPU runs below it (for tests). */
void gguf_a8_resolved_isa(int isa, int *out) { *out = usable_a8_isa(isa); }

/* y [M, N] (rows ldy apart) = the quantized rows xrows (gguf_a8_quantize's) @ W^T, W repacked. */
void gguf_a8_gemm(int qtype, int isa, const uint8_t *w, int64_t N, int64_t K, const uint8_t *xrows, int64_t M,
                  float *y, int64_t ldy, int num_threads)
{
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(qtype), rb = gguf_a8_row_bytes(K);
    rows_a8_fn fn = rows_a8_scalar;
#ifdef GGUF_X86
    switch (usable_a8_isa(isa)) {
    case A8_AVX512_VNNI: fn = rows_a8_avx512; break;
    case A8_AVX_VNNI: fn = rows_a8_avxvnni; break;
    case A8_AVX2: fn = rows_a8_avx2; break;
    default: break;
    }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * K * (M < 4 ? M : 4) > 65536)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *row = w + n * row_bytes;
#ifdef GGUF_X86
        for (int64_t o = 0; o < row_bytes; o += 64)    /* the row PREFETCH_ROWS ahead (a hint: cannot fault) */
            _mm_prefetch((const char *)(row + PREFETCH_ROWS * row_bytes + o), _MM_HINT_T0);
#endif
        for (int64_t r = 0; r < M; r += MT) {
            const int mt = (int)(M - r < MT ? M - r : MT);
            fn(qtype, row, xrows + r * rb, rb, nb, mt, y + r * ldy + n, ldy);
        }
    }
}

/* gguf_a8_quantize then gguf_a8_gemm. `scratch`: M * gguf_a8_row_bytes(K) bytes, or NULL (allocated here).
 * Returns 0, or 1 when the scratch could not be allocated (nothing written). */
int gguf_a8_linear(int qtype, int isa, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M,
                   int64_t ldx, float *y, int64_t ldy, int num_threads, uint8_t *scratch)
{
    uint8_t *xrows = scratch ? scratch : malloc((size_t)(M > 0 ? M : 1) * (size_t)gguf_a8_row_bytes(K));
    if (!xrows)
        return 1;
    gguf_a8_quantize(isa, x, M, ldx, K, xrows);
    gguf_a8_gemm(qtype, isa, w, N, K, xrows, M, y, ldy, num_threads);
    if (!scratch)
        free(xrows);
    return 0;
}
