/*
 * vecops — short float vector kernels for attention (dot of a query head with
 * a key row, accumulation of value rows), keys/values in f32 or f16, and the
 * SwiGLU of the feed-forward. Chosen at run time: AVX2+FMA+F16C when the ISA
 * in use (base/cpu.h, the one quant's kernels run too) is a SIMD one, else
 * scalar; under AVX-512 the scores, softmax and weighted sums run 512 bits
 * wide (vecops_avx512.c) with the AVX2 code's bits. Each result is reduced in one fixed order for a given ISA (per head
 * and position, whatever the group or batch), so attention stays batch invariant.
 */
#ifndef KVS_VECOPS_H
#define KVS_VECOPS_H

#include <stddef.h>
#include <stdint.h>

/* y[i] += a * x[i]: the per-row step vec_wsum_group's sums are bit-identical to. */
void vec_axpy_f32(float a, const float *x, float *y, int n);
void vec_axpy_f16(float a, const uint16_t *x, float *y, int n);

/* Attention over a group of query heads sharing one key/value head (GQA).
 * scores[h * stride + j] = scale * dot(q + h * hd, keys[j], hd) for h < group,
 * j < n_keys, keys f32 or f16 per k_f16, each key converted once per tile of
 * up to four heads; a score's bits depend only on its query head and key (not
 * on group, n_keys or j). Rows are prefetched 32 ahead of the walk. */
void vec_scores(const float *q, int group, int hd, const void *const *keys, int n_keys, int k_f16, float scale,
                float *scores, size_t stride);
/* The value rows (f32 or f16) weighted by each head's probabilities, for every
 * head of a GQA group at once: out[h * hd + i] = sum over j in order of
 * p[h * p_stride + j] * rows[j][i], h < group, i < hd — each row converted once
 * per tile of up to four heads, prefetched 32 rows ahead; per head
 * bit-identical to n vec_axpy calls on a zeroed out, whatever the group size. */
void vec_wsum_group(const float *p, size_t p_stride, int group, int n, const void *const *rows, int v_f16, int hd,
                    float *out);
/* x = softmax(x) over n elements, in place: exp by a degree-6 polynomial after
 * range reduction (relative error ~2e-7, i.e. as good as expf for attention
 * weights), sums in a fixed order. */
void vec_softmax(float *x, int n);

/* gate[i] = silu(gate[i]) * up[i] = gate[i] * sigmoid(gate[i]) * up[i], with
 * the softmax's exp of -|gate[i]| (never overflows; relative error ~3e-7). */
void vec_swiglu(float *gate, const float *up, int64_t n);

/* The sum of the n / 8 u64 words at p (64-byte aligned, n a multiple of
 * 256 x streams), read with the ISA's widest loads and a software prefetch
 * 4 KiB ahead, as `streams` (1-8) equal contiguous parts walked side by side,
 * 256 bytes of each in turn: the memory read-bandwidth probe of `kvshard
 * bench`. A scalar loop reads DRAM well below what the weight kernels reach on
 * some cores, and one stream per core below what several do (BENCHMARKS.md),
 * so the probe reads the way the fastest kernels can and keeps the best. */
uint64_t vec_read_sum(const void *p, size_t n, int streams);

#endif /* KVS_VECOPS_H */
