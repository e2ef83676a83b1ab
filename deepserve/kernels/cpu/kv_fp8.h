/* 8-bit float KV caches on the CPU: -DKV_FP8_E4M3 (torch.float8_e4m3fn) or -DKV_FP8_E5M2 (torch.float8_e5m2).
 *
 * A code is sign | exponent | mantissa with FP8_MANT mantissa bits and exponent bias FP8_BIAS; E4M3 has no
 * infinities (0x7f / 0xff are NaN, 448 the largest value), E5M2 is IEEE-like (exponent 31: inf / NaN).
 *
 * fp8_widen: 16 codes (one per int32 lane) -> 16 floats, exactly, in vector operations only (no table): a normal
 * code's exponent and mantissa move into the float's fields and the bias difference is added to the exponent; a
 * subnormal one (exponent 0) is its mantissa times 2^(1 - bias - mantissa bits), an exact int -> float product.
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
