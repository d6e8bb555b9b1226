/*
 * x86/rows_avx512 — AVX-512 (F/BW/VL/DQ/VNNI) kernels of the plain row formats.
 *
 * The 256-bit kernels of rows_avx2.c are compiled here a second time with
 * QUANT_VNNI, so their int8/int16 dot steps use vpdpbusd/vpdpwssd,
 * and the K-quant kernels take activation rows four at a time (32 registers).
 * A 512-bit q4_0 kernel (two blocks per zmm, top-bit-flipped activations)
 * was tried and measured slower than this on Zen 4, where 512-bit ops are
 * double-pumped, so it is not kept.
 */
#define QUANT_VNNI 1
#include "rows_avx2.c"

