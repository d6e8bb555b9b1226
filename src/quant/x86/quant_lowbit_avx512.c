/*
 * quant_lowbit_avx512 — the kernels of quant_lowbit_avx2.c compiled a second
 * time for AVX-512 (F/BW/VL/DQ/VNNI): vpdpbusd / vpdpwssd for the integer dot
 * steps; exported as quant_avx512_dot_*.
 */
#define QUANT_VNNI 1
#include "quant_lowbit_avx2.c"
