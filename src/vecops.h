/*
 * vecops — short float vector kernels for attention (dot of a query head with
 * a key row, accumulation of value rows), keys/values in f32 or f16. Chosen at
 * run time: AVX2+FMA+F16C when quant's dispatcher uses a SIMD ISA, else
 * scalar. Each result is reduced in one fixed order for a given ISA, so
 * attention stays batch invariant.
 */
#ifndef KVS_VECOPS_H
#define KVS_VECOPS_H

#include <stdint.h>

float vec_dot_f32(const float *a, const float *b, int n);
float vec_dot_f32_f16(const float *a, const uint16_t *b, int n); /* b: IEEE half */
/* y[i] += a * x[i] */
void vec_axpy_f32(float a, const float *x, float *y, int n);
void vec_axpy_f16(float a, const uint16_t *x, float *y, int n);

#endif /* KVS_VECOPS_H */
