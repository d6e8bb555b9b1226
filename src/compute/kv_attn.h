/*
 * kv_attn — attention over a KV pool of any element type: f32 and f16 go to
 * vecops; GGUF's q8_0 and q4_0 blocks (32 elements along head_dim) are read as
 * they are stored, with no f16 copy of the pool, the way llama.cpp reads a
 * quantized cache: each query head is quantized to q8_0 once, a score is the
 * sum over blocks of d_key x d_query x (the exact int8 dot of the block), and
 * value rows are dequantized while they are accumulated.
 *
 * Bits: a score depends only on its query head and key row, an output element
 * only on the probabilities and value rows in order (per head, whatever the
 * group, batch or ISA): the SIMD kernels compute the integer dot of a block
 * exactly and then run the scalar reference's float steps in its order, so
 * the scalar `_ref` twins give the same bits and attention stays batch
 * invariant.
 */
#ifndef KVS_KV_ATTN_H
#define KVS_KV_ATTN_H

#include <stddef.h>
#include <stdint.h>

/* The largest head_dim the quantized kernels take (their per-call query blocks live on the stack). */
#define KV_ATTN_MAX_HEAD_DIM 512

/* Writes one K or V row: hd floats of x as type (QUANT_F32, QUANT_F16, QUANT_Q8_0, QUANT_Q4_0;
 * hd a multiple of 32 for the block types) at dst, kv_row_bytes(type, hd) bytes. */
void kv_attn_store_row(uint32_t type, const float *x, void *dst, int hd);
/* scores[h * stride + j] = scale * (q + h * hd) . keys[j] for h < group, j < n_keys, keys of type
 * (as vec_scores for f32 / f16; for q8_0 / q4_0 the query is quantized to q8_0 first). */
void kv_attn_scores(uint32_t type, const float *q, int group, int hd, const void *const *keys, int n_keys, float scale,
                    float *scores, size_t stride);
/* out[h * hd + i] = sum over j < n in order of p[h * p_stride + j] * rows[j][i], h < group, i < hd
 * (out is overwritten), value rows of type. */
void kv_attn_wsum(uint32_t type, const float *p, size_t p_stride, int group, int n, const void *const *rows, int hd,
                  float *out);

/* Quantized caches hold their rows rotated, as llama.cpp's do: a quantized K or V row is stored
 * multiplied by an orthonormal Walsh-Hadamard matrix, which spreads an outlier over its block and
 * cuts the quantization error. Q is rotated by the K matrix (scores do not change: H'H = I) and
 * the attention output by the V matrix (H is its own inverse). The K matrix is the largest power
 * of two >= 64 dividing head_dim, the V matrix 64; none for f16 / f32 or a head_dim that 64 does
 * not divide. 0: no rotation. */
int kv_attn_rot_k(uint32_t type, int hd);
int kv_attn_rot_v(uint32_t type, int hd);
/* x = H x on each run of n floats of x[0, len) (n a power of two dividing len); kv_attn_rotate_ref
 * is its scalar reference (the same bits). */
void kv_attn_rotate(float *x, int len, int n);
void kv_attn_rotate_ref(float *x, int len, int n);

/* The scalar references of the two block-type kernels (tests compare them with the dispatched ones:
 * the same bits). type is QUANT_Q8_0 or QUANT_Q4_0. */
void kv_attn_scores_ref(uint32_t type, const float *q, int group, int hd, const void *const *keys, int n_keys,
                        float scale, float *scores, size_t stride);
void kv_attn_wsum_ref(uint32_t type, const float *p, size_t p_stride, int group, int n, const void *const *rows, int hd,
                      float *out);

#endif /* KVS_KV_ATTN_H */
