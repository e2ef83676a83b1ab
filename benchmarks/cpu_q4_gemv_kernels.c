/* Q4_1 GEMV at one activation row on one core, two ways (a prototype for issue 21's CPU target, not the engine's
 * code; benchmarks/cpu_q4_gemv_kernels.py builds and runs it):
 *   option_a  the engine's inner loop (kernels/cpu/gguf_linear.c, rows_avx512_impl at one row): fp32 activations
 *             times the file's blocks, each block's nibbles widened to floats;
 *   option_r  int8 activations (per-32-block scale, llama.cpp's Q8_1 way) times blocks repacked at load (the 16
 *             nibble bytes of two blocks contiguous, d and m as float arrays): two blocks per 512-bit VNNI
 *             product, no per-block fp16 conversions or unpacking beyond one and / shift; x is stored in the
 *             nibbles' order at quantization, so no shuffles.
 * Prints one JSON line: microseconds a call (best of 5 x 200), weights/s, option_r's error against an exact
 * (double) product of the dequantized weights with the same quantized x, and option_a's distance to that.
 * Needs AVX-512 F/BW/VL + VNNI. Build: cc -O2 -o gemv cpu_q4_gemv_kernels.c -lm; run: ./gemv N K. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define T __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

T static float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* The engine's loop: y[n] = sum_b d_b * (x_b . q_b) + m_b * sum(x_b), fp32 activations. */
T static void option_a(const uint8_t *w, int N, int NB, const float *x, const float *xs, float *y)
{
    const __m128i lo = _mm_set1_epi8(15);
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (size_t)n * NB * 20;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        float macc = 0;
        for (int b = 0; b < NB; b++) {
            const uint8_t *blk = wr + 20 * b;
            uint32_t dm;
            memcpy(&dm, blk, 4);
            const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
            const float d = _mm_cvtss_f32(dmf), m = _mm_cvtss_f32(_mm_shuffle_ps(dmf, dmf, 1));
            const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4));
            const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, lo)));
            const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), lo)));
            __m512 t = _mm512_mul_ps(_mm512_loadu_ps(x + 32 * b), q0);
            t = _mm512_fmadd_ps(_mm512_loadu_ps(x + 32 * b + 16), q1, t);
            if (b & 1)
                a1 = _mm512_fmadd_ps(t, _mm512_set1_ps(d), a1);
            else
                a0 = _mm512_fmadd_ps(t, _mm512_set1_ps(d), a0);
            macc += m * xs[b];
        }
        y[n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + macc;
    }
}

/* Repacked at load: each block's 16 nibble bytes back to back (so blocks 2p, 2p+1 are 32 contiguous bytes), its d
 * and m as floats. */
typedef struct {
    uint8_t *qs;
    float *d, *m;
} Repacked;

T static Repacked repack(const uint8_t *w, int N, int NB)
{
    const size_t blocks = (size_t)N * NB;
    Repacked r = {aligned_alloc(64, blocks * 16), aligned_alloc(64, blocks * 4), aligned_alloc(64, blocks * 4)};
    for (size_t i = 0; i < blocks; i++) {
        uint16_t d, m;
        memcpy(&d, w + 20 * i, 2);
        memcpy(&m, w + 20 * i + 2, 2);
        r.d[i] = h2f(d);
        r.m[i] = h2f(m);
        memcpy(r.qs + 16 * i, w + 20 * i + 4, 16);
    }
    return r;
}

/* x per 32-block: dx = max|x| / 127, q = round(x / dx), xsum = dx * sum(q); each block pair stored in the order
 * its weights' nibbles come out of one 32-byte load: [x_b 0-15 | x_b+1 0-15 | x_b 16-31 | x_b+1 16-31]. */
T static void quantize_x(const float *x, int NB, int8_t *xq, float *xd, float *xsum)
{
    for (int b = 0; b < NB; b++) {
        float amax = 0;
        for (int j = 0; j < 32; j++)
            amax = fmaxf(amax, fabsf(x[32 * b + j]));
        const float dx = amax / 127.f, inv = dx ? 1.f / dx : 0.f;
        int8_t *pair = xq + 64 * (b / 2);
        int s = 0;
        for (int j = 0; j < 32; j++) {
            const int q = (int)lrintf(x[32 * b + j] * inv);
            s += q;
            pair[(j < 16 ? 0 : 32) + 16 * (b % 2) + (j & 15)] = (int8_t)q;
        }
        xd[b] = dx;
        xsum[b] = dx * s;
    }
}

/* The block pair's integer dot: lanes 0-3 and 8-11 hold block 2p's sums, 4-7 and 12-15 block 2p+1's; each is
 * scaled by its d * dx, and the m * xsum terms are one float dot over the row's blocks at the end. */
T static void option_r(const Repacked *r, int N, int NB, const int8_t *xq, const float *xd, const float *xsum,
                       float *y)
{
    const __m256i lo = _mm256_set1_epi8(15);
    const __m512i pair_lane = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int n = 0; n < N; n++) {
        const uint8_t *qs = r->qs + (size_t)n * NB * 16;
        const float *dr = r->d + (size_t)n * NB, *mr = r->m + (size_t)n * NB;
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        int b = 0;
        for (; b + 2 <= NB; b += 2) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 16 * b));
            const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, lo)),
                                                  _mm256_and_si256(_mm256_srli_epi16(v, 4), lo), 1);
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, _mm512_loadu_si512(xq + 32 * b));
            const __m128 dd = _mm_mul_ps(_mm_castpd_ps(_mm_load_sd((const double *)(dr + b))),
                                         _mm_castpd_ps(_mm_load_sd((const double *)(xd + b))));
            const __m512 scale = _mm512_permutexvar_ps(pair_lane, _mm512_castps128_ps512(dd));
            acc[(b >> 1) & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[(b >> 1) & 1]);
        }
        float tail = 0;
        for (; b < NB; b++) {          /* an odd last block: scalar */
            const uint8_t *q = qs + 16 * b;
            const int8_t *pair = xq + 64 * (b / 2);
            int s = 0;
            for (int j = 0; j < 16; j++)
                s += (q[j] & 15) * pair[16 * (b % 2) + j] + (q[j] >> 4) * pair[32 + 16 * (b % 2) + j];
            tail += dr[b] * xd[b] * s;
        }
        __m512 macc = _mm512_setzero_ps();
        int c = 0;
        for (; c + 16 <= NB; c += 16)
            macc = _mm512_fmadd_ps(_mm512_loadu_ps(mr + c), _mm512_loadu_ps(xsum + c), macc);
        float mtail = 0;
        for (; c < NB; c++)
            mtail += mr[c] * xsum[c];
        y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + _mm512_reduce_add_ps(macc) + mtail + tail;
    }
}

/* Exact (double) y of the dequantized weights times the quantized x: what option_r computes, rounding aside. */
T static void exact_quantized(const uint8_t *w, int N, int NB, const int8_t *xq, const float *xd, float *y)
{
    for (int n = 0; n < N; n++) {
        double acc = 0;
        for (int b = 0; b < NB; b++) {
            const uint8_t *blk = w + ((size_t)n * NB + b) * 20;
            uint16_t d, m;
            memcpy(&d, blk, 2);
            memcpy(&m, blk + 2, 2);
            const int8_t *pair = xq + 64 * (b / 2);
            for (int j = 0; j < 16; j++) {
                acc += ((double)h2f(d) * (blk[4 + j] & 15) + h2f(m)) * xd[b] * pair[16 * (b % 2) + j];
                acc += ((double)h2f(d) * (blk[4 + j] >> 4) + h2f(m)) * xd[b] * pair[32 + 16 * (b % 2) + j];
            }
        }
        y[n] = (float)acc;
    }
}

static double rel_diff(const float *a, const float *ref, int n)
{
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) {
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / den);
}

T int main(int argc, char **argv)
{
    const int N = argc > 1 ? atoi(argv[1]) : 3072, K = argc > 2 ? atoi(argv[2]) : 576, NB = K / 32;
    uint8_t *w = malloc((size_t)N * NB * 20);
    srand(1);
    for (size_t i = 0; i < (size_t)N * NB * 20; i++)
        w[i] = rand();
    for (size_t i = 0; i < (size_t)N * NB; i++) {       /* d ~ 2^-6..2^-5, m ~ -(2^-6..2^-5): model-like scales */
        const uint16_t d = 0x2400 + (rand() & 0x3ff), m = 0xa400 + (rand() & 0x3ff);
        memcpy(w + 20 * i, &d, 2);
        memcpy(w + 20 * i + 2, &m, 2);
    }
    float *x = malloc(K * 4), *xs = malloc(NB * 4), *xd = malloc(NB * 4), *xsum = malloc(NB * 4);
    int8_t *xq = aligned_alloc(64, ((NB + 1) / 2) * 64 + 64);
    for (int k = 0; k < K; k++)
        x[k] = (float)(rand() / (double)RAND_MAX - 0.5);
    for (int b = 0; b < NB; b++) {
        xs[b] = 0;
        for (int j = 0; j < 32; j++)
            xs[b] += x[32 * b + j];
    }
    const Repacked r = repack(w, N, NB);
    float *ya = malloc(N * 4), *yr = malloc(N * 4), *yref = malloc(N * 4);
    quantize_x(x, NB, xq, xd, xsum);
    option_a(w, N, NB, x, xs, ya);
    option_r(&r, N, NB, xq, xd, xsum, yr);
    exact_quantized(w, N, NB, xq, xd, yref);
    const int reps = 200;
    double best_a = 1e9, best_r = 1e9, best_q = 1e9;
    for (int t = 0; t < 5; t++) {
        double s = now();
        for (int i = 0; i < reps; i++)
            option_a(w, N, NB, x, xs, ya);
        best_a = fmin(best_a, (now() - s) / reps);
        s = now();
        for (int i = 0; i < reps; i++)
            quantize_x(x, NB, xq, xd, xsum);
        best_q = fmin(best_q, (now() - s) / reps);
        s = now();
        for (int i = 0; i < reps; i++)
            option_r(&r, N, NB, xq, xd, xsum, yr);
        best_r = fmin(best_r, (now() - s) / reps);
    }
    printf("{\"N\": %d, \"K\": %d, \"option_a_us\": %.2f, \"repacked_int8_us\": %.2f, \"quantize_x_us\": %.2f, "
           "\"speedup\": %.2f, \"Gweights_per_s_a\": %.2f, \"Gweights_per_s_r\": %.2f, "
           "\"rel_err_r_vs_exact_of_quantized_x\": %.2e, \"rel_diff_a_vs_quantized_x\": %.2e}\n",
           N, K, best_a * 1e6, best_r * 1e6, best_q * 1e6, best_a / (best_r + best_q), N * (double)K / best_a / 1e9,
           N * (double)K / best_r / 1e9, rel_diff(yr, yref, N), rel_diff(ya, yref, N));
    return 0;
}
