/*
 * x86/r8_avx512 — the r8 kernels of r8_avx2.c compiled again for
 * AVX-512 VNNI (vpdpbusd / vpdpwssd for the integer sums; same float steps, so
 * the same bits), where neighbouring groups go two at a time through the
 * 512-bit pair kernels (16 rows a register; q8_0 with its weights offset to
 * unsigned instead of a sign step); exported as quant_avx512_r8_*.
 */
#define QUANT_VNNI 1
#include "r8_avx2.c"
