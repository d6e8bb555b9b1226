/*
 * cpu — ISA detection and the process-wide choice (cpu.h). The emu512 build compiles this file
 * again with KVS_EMU_AVX512, where an AVX2 CPU reports AVX-512: that build's AVX-512 kernels
 * run on SIMDe (quant/x86/emu_avx512.h).
 */
#include "cpu.h"

#include <stdatomic.h>
#include <string.h>

/* -1 until first use; then the ISA in use. Relaxed atomics: every thread that
 * races on the first use computes the same value. */
static _Atomic int current_isa = -1;

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* CPUID plus the OS check (XCR0) that the wide registers are saved on context
 * switch; __builtin_cpu_supports is not used because clang lacks some names. */
enum kvs_isa kvs_isa_detect(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return KVS_ISA_SCALAR;
    const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28),
               f16c = c & (1u << 29);
    if (!(fma && osxsave && avx && f16c)) return KVS_ISA_SCALAR;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    if ((xlo & 0x6u) != 0x6u) return KVS_ISA_SCALAR; /* XMM and YMM state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return KVS_ISA_SCALAR;
    if (!(b & (1u << 5))) return KVS_ISA_SCALAR; /* AVX2 */
    const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31),
               vnni = c & (1u << 11);
    if (f && dq && bw && vl && vnni && (xlo & 0xE6u) == 0xE6u) return KVS_ISA_AVX512;
#ifdef KVS_EMU_AVX512
    return KVS_ISA_AVX512; /* its kernels were built for AVX2 on SIMDe */
#else
    return KVS_ISA_AVX2;
#endif
}
#else
enum kvs_isa kvs_isa_detect(void) { return KVS_ISA_SCALAR; }
#endif

enum kvs_isa kvs_isa_current(void) {
    int isa = atomic_load_explicit(&current_isa, memory_order_relaxed);
    if (isa < 0) {
        isa = (int)kvs_isa_detect();
        atomic_store_explicit(&current_isa, isa, memory_order_relaxed);
    }
    return (enum kvs_isa)isa;
}

bool kvs_isa_force(enum kvs_isa isa) {
    if ((int)isa < 0 || (int)isa > (int)kvs_isa_detect()) return false;
    atomic_store_explicit(&current_isa, (int)isa, memory_order_relaxed);
    return true;
}

const char *kvs_isa_name(enum kvs_isa isa) {
    switch (isa) {
    case KVS_ISA_SCALAR: return "scalar";
    case KVS_ISA_AVX2: return "avx2";
    case KVS_ISA_AVX512: return "avx512";
    }
    return "unknown";
}

bool kvs_isa_force_name(const char *name) {
    for (int i = KVS_ISA_SCALAR; i <= KVS_ISA_AVX512; i++)
        if (!strcmp(kvs_isa_name((enum kvs_isa)i), name)) return kvs_isa_force((enum kvs_isa)i);
    return false;
}
