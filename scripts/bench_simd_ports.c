/*
 * bench_simd_ports — the throughput of the AVX2 instructions of the int8 dot
 * kernels on this core: eight independent vpmaddubsw, vpsignb, vpaddd or
 * vfmadd231ps per iteration, four vpmaddubsw + four vpmaddwd, the q8_0
 * step's mix (vpsignb, vpmaddubsw, vpmaddwd, vpaddd) four times, the same
 * without its vpsignb (what the step would cost if the weights needed no sign
 * fix-up), and an i16 form of 128 products (eight vpmaddwd + vpaddd, as with
 * activations and weights widened to i16); ns per
 * iteration and cycles at the GHz given (default 3.2). Registers only, no
 * memory, no dependencies between the eight.
 *
 * Not part of the build; x86-64 with AVX2 only. From the repository root:
 *   cc -O2 scripts/bench_simd_ports.c -o build/bench_simd_ports && taskset -c 1 build/bench_simd_ports [GHZ]
 */
#include <stdio.h>
#include <stdlib.h>

#include "bench_util.h"

#define ITERS 100000000L
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9"
#define X8(op) op " %%ymm8,%%ymm9,%%ymm0\n" op " %%ymm8,%%ymm9,%%ymm1\n" op " %%ymm8,%%ymm9,%%ymm2\n" \
    op " %%ymm8,%%ymm9,%%ymm3\n" op " %%ymm8,%%ymm9,%%ymm4\n" op " %%ymm8,%%ymm9,%%ymm5\n"             \
    op " %%ymm8,%%ymm9,%%ymm6\n" op " %%ymm8,%%ymm9,%%ymm7\n"
#define MIX(a, b, c, d) "vpsignb %%ymm8,%%ymm9,%%ymm" a "\nvpmaddubsw %%ymm8,%%ymm9,%%ymm" b \
    "\nvpmaddwd %%ymm8,%%ymm9,%%ymm" c "\nvpaddd %%ymm8,%%ymm9,%%ymm" d "\n"
#define MIX_NOSIGN(b, c, d) "vpmaddubsw %%ymm8,%%ymm9,%%ymm" b "\nvpmaddwd %%ymm8,%%ymm9,%%ymm" c \
    "\nvpaddd %%ymm8,%%ymm9,%%ymm" d "\n"
#define I16(a, b) "vpmaddwd %%ymm8,%%ymm9,%%ymm" a "\nvpaddd %%ymm8,%%ymm9,%%ymm" b "\n"
#define RUN(label, body, n_ops)                                                                          \
    do {                                                                                                 \
        const double t0 = bench_now_s();                                                                       \
        for (long i = 0; i < ITERS; i++) __asm__ volatile(body ::: CLOBBER);                             \
        const double ns = (bench_now_s() - t0) / (double)ITERS * 1e9;                                          \
        printf("%-34s %6.3f ns/iteration, %5.2f cycles, %4.2f instructions/cycle\n", label, ns, ns * ghz, \
               (double)(n_ops) / (ns * ghz));                                                            \
    } while (0)

int main(int argc, char **argv) {
    const double ghz = argc > 1 ? atof(argv[1]) : 3.2;
    if (!(ghz > 0)) { fprintf(stderr, "usage: bench_simd_ports [GHZ > 0]\n"); return 2; }
    RUN("8 x vpmaddubsw", X8("vpmaddubsw"), 8);
    RUN("8 x vpsignb", X8("vpsignb"), 8);
    RUN("8 x vpaddd", X8("vpaddd"), 8);
    RUN("8 x vfmadd231ps", X8("vfmadd231ps"), 8);
    RUN("4 x (vpmaddubsw, vpmaddwd)", "vpmaddubsw %%ymm8,%%ymm9,%%ymm0\nvpmaddwd %%ymm8,%%ymm9,%%ymm1\n"
        "vpmaddubsw %%ymm8,%%ymm9,%%ymm2\nvpmaddwd %%ymm8,%%ymm9,%%ymm3\nvpmaddubsw %%ymm8,%%ymm9,%%ymm4\n"
        "vpmaddwd %%ymm8,%%ymm9,%%ymm5\nvpmaddubsw %%ymm8,%%ymm9,%%ymm6\nvpmaddwd %%ymm8,%%ymm9,%%ymm7\n", 8);
    RUN("4 x (sign, maddubs, maddwd, add)", MIX("0", "1", "2", "3") MIX("4", "5", "6", "7") MIX("0", "1", "2", "3")
        MIX("4", "5", "6", "7"), 16);
    RUN("the same without vpsignb", MIX_NOSIGN("1", "2", "3") MIX_NOSIGN("5", "6", "7") MIX_NOSIGN("1", "2", "3")
        MIX_NOSIGN("5", "6", "7"), 12);
    RUN("i16: 8 x (vpmaddwd, vpaddd)", I16("0", "1") I16("2", "3") I16("4", "5") I16("6", "7") I16("0", "1")
        I16("2", "3") I16("4", "5") I16("6", "7"), 16);
    return 0;
}
