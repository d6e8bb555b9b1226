/* quant_avx512 — SIMD kernels (work in progress). */
#include "quant_impl.h"

const quant_isa_table quant_table_avx512 = {.f16_to_f32 = 0};
