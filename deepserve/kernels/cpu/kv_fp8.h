/* 8-bit float KV caches on the CPU: -DKV_FP8_E4M3 (torch.float8_e4m3fn) or -DKV_FP8_E5M2 (torch.float8_e5m2).
 *
 * A code is sign | exponent | mantissa with FP8_MANT mantissa bits and exponent bias FP8_BIAS; E4M3 has no
 * infinities (0x7f / 0xff are NaN, 448 the largest value), E5M2 is IEEE-like (exponent 31: inf / NaN).
 *
 * FP8_WIDEN(p): W codes at p -> W floats, exactly, in vector operations only (no table). Where the CPU converts fp16
 * to fp32 (F16C, AVX-512) through fp8_widen_f16c (E4M3 scaled by 2^-8, see FP8_WIDEN_SCALE); elsewhere (or built
 * with -DKV_FP8_PORTABLE, as a test does) through fp8_widen: a normal code's exponent and mantissa move into the
 * float's fields and the bias difference is added to the exponent; a subnormal one (exponent 0) is its mantissa
 * times 2^(1 - bias - mantissa bits), an exact int -> float product. Measured on a 2-core AVX-512 EPYC (one decode
 * call over 4096 keys of 3 x 64-wide heads, benchmarks/cpu_kv_attention.json): fp32 cache 164 us, bf16 142, E4M3 189,
 * E5M2 151; through fp8_widen (-DKV_FP8_PORTABLE) E4M3 574, E5M2 607. On an AVX2-only Zen 3, with the 8-float
 * vectors such CPUs build (benchmarks/cpu_kv_attention_avx2_lanes_s52.json): fp32 319, bf16 301, E4M3 559, E5M2 344;
 * portable 1337 / 1434. Session 54 (the attention's groups of 3 heads at W = 8, then this file's E4M3 widening in 7
 * lane operations instead of 11): E4M3 295 -> 263 us, against fp32 219, bf16 229, E5M2 212
 * (benchmarks/cpu_kv_attention_e4m3_widen_avx2_s54.json).
 * fp8_narrow: one float -> its code, rounded to nearest (ties to even) and saturated at the largest finite value,
 * as kernels/reference/attention.py's to_cache_dtype (a clamp, then torch's cast).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(KV_FP8_E4M3)
#define FP8_MANT 3
#define FP8_BIAS 7
#define FP8_MAX 448.0f
#define FP8_MAX_CODE 0x7e        /* 0 1111 110: 2^8 x 1.75 */
#elif defined(KV_FP8_E5M2)
#define FP8_MANT 2
#define FP8_BIAS 15
#define FP8_MAX 57344.0f
#define FP8_MAX_CODE 0x7b        /* 0 11110 11: 2^15 x 1.75 */
#else
#error "kv_fp8.h needs KV_FP8_E4M3 or KV_FP8_E5M2"
#endif

#define FP8_NAN_CODE 0x7f
#define FP8_SUBNORMAL_SCALE (1.0f / (float)(1 << (FP8_BIAS - 1 + FP8_MANT)))    /* 2^(1 - bias - mantissa bits) */

typedef uint8_t fp8_vb __attribute__((vector_size(W), aligned(1)));        /* W codes, unaligned */

/* W codes at p, one per int32 lane. */
static inline vi fp8_codes(const uint8_t *p) { return __builtin_convertvector(*(const fp8_vb *)p, vi); }

static inline vf fp8_widen(vi code)
{
    const vi sign = (code & 0x80) << 24;
    const vi em = code & 0x7f;                                  /* exponent and mantissa */
    const vi normal = (em << (23 - FP8_MANT)) + ((127 - FP8_BIAS) << 23);
    const vf subnormal = __builtin_convertvector(em, vf) * FP8_SUBNORMAL_SCALE;
    const vi is_sub = em < (1 << FP8_MANT);
    vi bits = (is_sub & (vi)subnormal) | (~is_sub & normal);
#if defined(KV_FP8_E4M3)
    const vi is_nan = em == 0x7f;
    bits = (is_nan & 0x7fc00000) | (~is_nan & bits);
#else
    const vi is_top = em >= 0x7c;                               /* exponent 31: inf (mantissa 0) or NaN */
    bits = (is_top & (0x7f800000 | ((em & 3) << 21))) | (~is_top & bits);
#endif
    return (vf)(bits | sign);
}

#if !defined(KV_FP8_PORTABLE) && (defined(__AVX512F__) || (defined(__F16C__) && defined(__AVX2__)))
#include <immintrin.h>
typedef uint16_t fp8_vh __attribute__((vector_size(2 * W)));
#if W == 16
#define FP8_TO_HALVES 0, 16, 1, 16, 2, 16, 3, 16, 4, 16, 5, 16, 6, 16, 7, 16, 8, 16, 9, 16, 10, 16, 11, 16, 12, 16, \
    13, 16, 14, 16, 15, 16           /* code i, then a zero byte: W little-endian 16-bit lanes */
#else
#define FP8_TO_HALVES 0, 8, 1, 8, 2, 8, 3, 8, 4, 8, 5, 8, 6, 8, 7, 8
#endif

/* W codes at p -> W floats through fp16: each code moves into an fp16's bits (E5M2 is fp16's high byte; E4M3's
 * exponent and mantissa sit one bit lower, with a bias 8 below fp16's) and the CPU's fp16 -> fp32 conversion (F16C /
 * AVX-512 vcvtph2ps, which takes subnormals as they are) widens them: 16-bit lane work and one conversion where
 * fp8_widen needs a dozen 32-bit lane operations. E4M3's NaN code is set to fp16's NaN first. An E4M3 value comes out
 * 2^-8 times its true value (FP8_WIDEN_SCALE): the attention scales q up and its output back by that power of two
 * once per row instead of every key and value (exact: products and sums scale by a power of two unrounded). */
#if defined(KV_FP8_E4M3)
#define FP8_WIDEN_SCALE 256.0f
#else
#define FP8_WIDEN_SCALE 1.0f
#endif
static inline vf fp8_widen_f16c(const uint8_t *p)
{
    const fp8_vb b = *(const fp8_vb *)p, z = {0};
    const fp8_vh c = (fp8_vh)__builtin_shufflevector(b, z, FP8_TO_HALVES);
#if defined(KV_FP8_E4M3)
    /* c + its sign bit carries the sign to bit 8, so one shift puts it at fp16's bit 15 and the exponent and
     * mantissa at bits 7-13; a NaN code (exponent and mantissa all ones) then gets fp16's all-ones exponent. */
    const fp8_vh em = (c + (c & 0x80)) << 7;
    const fp8_vh nan = (fp8_vh)((em & 0x3f80) == 0x3f80);         /* all ones where the code is NaN */
    const fp8_vh h = em | (nan & 0x7e00);
#else
    const fp8_vh h = c << 8;
#endif
    vf out;
#if W == 8
    __m128i bits;
    memcpy(&bits, &h, sizeof bits);
    const __m256 f = _mm256_cvtph_ps(bits);
    memcpy(&out, &f, sizeof out);
#else
    __m256i bits;
    memcpy(&bits, &h, sizeof bits);
#if defined(__AVX512F__) && !defined(KV_FP8_F16C_ONLY)      /* KV_FP8_F16C_ONLY: a test's build of the path below */
    const __m512 f = _mm512_cvtph_ps(bits);
    memcpy(&out, &f, sizeof out);
#else
    const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(bits));
    const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1));
    memcpy(&out, &lo, sizeof lo);
    memcpy((char *)&out + sizeof lo, &hi, sizeof hi);
#endif
#endif
    return out;
}
#define FP8_WIDEN(p) fp8_widen_f16c(p)
#else
#define FP8_WIDEN(p) fp8_widen(fp8_codes(p))
#define FP8_WIDEN_SCALE 1.0f
#endif

static inline uint8_t fp8_narrow(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    const uint32_t mag = bits & 0x7fffffffu;
    if (mag > 0x7f800000u)
        return sign | FP8_NAN_CODE;
    float a;
    memcpy(&a, &mag, 4);
    if (a >= FP8_MAX)                                           /* saturate (infinities too) */
        return sign | FP8_MAX_CODE;
    if (mag < ((uint32_t)(127 - FP8_BIAS + 1) << 23))           /* below the smallest normal: a subnormal code */
        return sign | (uint8_t)rintf(a / FP8_SUBNORMAL_SCALE);  /* exact scaling; rintf rounds ties to even */
    const int shift = 23 - FP8_MANT;                            /* round the float's mantissa at bit `shift` */
    const uint32_t rounded = mag + ((1u << (shift - 1)) - 1u) + ((mag >> shift) & 1u);
    return sign | (uint8_t)((rounded >> shift) - ((uint32_t)(127 - FP8_BIAS) << FP8_MANT));
}
