/* cpu — which SIMD instruction set the kernels run: detected once, or forced by a test or
 * `kvshard bench --isa`. quant's dispatcher and vecops both ask here, so the two always agree. */
#ifndef KVS_CPU_H
#define KVS_CPU_H

#include <stdbool.h>

/* In order: each ISA includes the one before it. */
enum kvs_isa { KVS_ISA_SCALAR = 0, KVS_ISA_AVX2 = 1, KVS_ISA_AVX512 = 2 };
/* Best ISA this CPU supports (AVX2 means AVX2+FMA+F16C; AVX-512 means F/BW/VL/DQ/VNNI). */
enum kvs_isa kvs_isa_detect(void);
/* The ISA in use (detected at first use unless forced). */
enum kvs_isa kvs_isa_current(void);
/* Forces an ISA (for tests); returns false and changes nothing if the CPU lacks it. */
bool kvs_isa_force(enum kvs_isa isa);
/* "scalar", "avx2" or "avx512". */
const char *kvs_isa_name(enum kvs_isa isa);
/* Forces the ISA that kvs_isa_name calls NAME; returns false and changes nothing for an
 * unknown name or one this CPU lacks. */
bool kvs_isa_force_name(const char *name);

#endif /* KVS_CPU_H */
