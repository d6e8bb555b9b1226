/*
 * emu_avx512 — force-included (-include) into the AVX-512 kernel files by a
 * KVS_EMU_AVX512 build only. Those files are then compiled for AVX2, and SIMDe
 * (Debian's libsimde-dev) supplies every 512-bit and VNNI intrinsic they use
 * under its Intel name, as portable code; the AVX2 intrinsics stay native.
 *
 * Why: the AVX-512 kernels are what the dispatcher picks on an AVX-512 machine,
 * and a development machine without AVX-512 would otherwise never execute them.
 * SIMDe follows Intel's definitions of each instruction (saturation included),
 * so the emulated kernels give the bits the real ones give; the emulation says
 * nothing about their speed, and the ordinary build still tests the real code
 * wherever the CPU has AVX-512.
 */
#ifndef KVS_EMU_AVX512_H
#define KVS_EMU_AVX512_H
#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

/* Debian 12's SIMDe has no alias for this one: each half converted as the
 * instruction converts it (MXCSR rounding, exact below 2^24). */
static inline simde__m512 kvs_emu_mm512_cvtepi32_ps(simde__m512i a) {
    return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(simde_mm256_cvtepi32_ps(simde_mm512_extracti64x4_epi64(a, 0))),
                                   simde_mm256_cvtepi32_ps(simde_mm512_extracti64x4_epi64(a, 1)), 1);
}
#define _mm512_cvtepi32_ps(a) kvs_emu_mm512_cvtepi32_ps(a)

/* Nor for this one: bytes 0-7 zero-extended into the low half, 8-15 into the
 * high half, as vpmovzxbd does. */
static inline simde__m512i kvs_emu_mm512_cvtepu8_epi32(simde__m128i a) {
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(simde_mm256_cvtepu8_epi32(a)),
                                   simde_mm256_cvtepu8_epi32(simde_mm_srli_si128(a, 8)), 1);
}
#define _mm512_cvtepu8_epi32(a) kvs_emu_mm512_cvtepu8_epi32(a)

/* Nor for this one: bytes 0-7 sign-extended into the low half, 8-15 into the
 * high half, as vpmovsxbd does. */
static inline simde__m512i kvs_emu_mm512_cvtepi8_epi32(simde__m128i a) {
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(simde_mm256_cvtepi8_epi32(a)),
                                   simde_mm256_cvtepi8_epi32(simde_mm_srli_si128(a, 8)), 1);
}
#define _mm512_cvtepi8_epi32(a) kvs_emu_mm512_cvtepi8_epi32(a)

/* Nor for this one: bytes 0-15 zero-extended into the low half, 16-31 into
 * the high half, as vpmovzxbw does. */
static inline simde__m512i kvs_emu_mm512_cvtepu8_epi16(simde__m256i a) {
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(simde_mm256_cvtepu8_epi16(simde_mm256_castsi256_si128(a))),
                                   simde_mm256_cvtepu8_epi16(simde_mm256_extracti128_si256(a, 1)), 1);
}
#define _mm512_cvtepu8_epi16(a) kvs_emu_mm512_cvtepu8_epi16(a)
#endif
