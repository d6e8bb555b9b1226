/*
 * quant_r8_avx512 — the r8 kernels of quant_r8_avx2.c compiled again for
 * AVX-512 VNNI (vpdpbusd for the integer sums; same float steps, so the same
 * bits); exported as quant_avx512_r8_*.
 */
#define QUANT_R8_VNNI 1
#include "quant_r8_avx2.c"
