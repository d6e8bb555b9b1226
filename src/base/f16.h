/* f16 — IEEE half and bfloat16 to and from f32, one value at a time, in plain C (the row
 * conversions with SIMD are quant's: quant_f16_to_f32_row). Every layer may use it. */
#ifndef KVS_F16_H
#define KVS_F16_H

#include <stdint.h>

float kvs_f16_to_f32(uint16_t h);    /* exact */
uint16_t kvs_f32_to_f16(float f);    /* round to nearest even, as F16C does */
float kvs_bf16_to_f32(uint16_t h);   /* exact */
uint16_t kvs_f32_to_bf16(float f);   /* round to nearest even */

#endif /* KVS_F16_H */
