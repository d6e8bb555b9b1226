/* f16 — the scalar half and bfloat16 conversions (f16.h). */
#include "f16.h"

#include <string.h>

static float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

float kvs_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24 is exact in f32 */
        float f = (float)mant * 0x1p-24f;
        return sign ? -f : f;
    }
    if (exp == 31) return f32_from_bits(sign | 0x7F800000u | (mant << 13));
    return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t kvs_f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) /* NaN: quiet it, keep the top payload bits (as F16C does) */
        return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to inf */
    if (a < 0x38800000u) {
        /* result is subnormal or zero: mantissa in units of 2^-24 */
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7FFFFFu) | (e ? 0x800000u : 0);
        uint32_t s = 126u - e; /* >= 14 */
        if (s > 24) return sign;
        uint32_t r = m >> s, rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t base = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3FFu);
    uint32_t rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (base & 1u))) base++;
    return (uint16_t)(sign | base);
}

float kvs_bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

uint16_t kvs_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
