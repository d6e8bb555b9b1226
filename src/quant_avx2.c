/* quant_avx2 — SIMD kernels (work in progress). */
#include "quant_impl.h"

const quant_isa_table quant_table_avx2 = {.f16_to_f32 = 0};
