/*
 * isa_check — which kernels a test binary runs. The emu512_* tests (CMake
 * KVS_EMU_AVX512) are built with KVS_EXPECT_ISA=KVS_ISA_AVX512: they exist to
 * run the AVX-512 kernels on a CPU without AVX-512, so a dispatcher that picked
 * another ISA would let them pass while testing the wrong code. Elsewhere this
 * only prints.
 */
#ifndef KVS_TEST_ISA_CHECK_H
#define KVS_TEST_ISA_CHECK_H
#include <stdio.h>

#include "cpu.h"
#include "test.h"

static inline void check_expected_isa(const char *test_name) {
    printf("%s: kernels of ISA %s\n", test_name, kvs_isa_name(kvs_isa_current()));
#ifdef KVS_EXPECT_ISA
    CHECK_EQ_INT((int)kvs_isa_current(), (int)KVS_EXPECT_ISA);
#endif
}
#endif
