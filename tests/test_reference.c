/*
 * Agreement with llama.cpp on ../shared/reference (the checks are in
 * reference_check.h); the downloads/ files are test_reference_downloads.
 */
#include "reference_check.h"

static const ref_case CASES[] = {
    {"stories260K", 0.1, 1e-5, 0.1, 0.1},       {"stories260K-F16", 0.1, 1e-5, 0.1, 0.1},
    {"stories260K-Q8_0", 1.0, 3e-3, 0.25, 0.5}, {"stories260K-Q4_0", 1.0, 3e-3, 0.25, 0.5},
    {"synth-F32", 0.1, 1e-5, 0.1, 0.1},         {"synth-F16", 0.1, 1e-5, 0.1, 0.1},
    {"synth-BF16", 0.2, 2e-4, 0.25, 0.5},       {"synth-Q8_0", 1.0, 3e-3, 0.25, 0.5},
    {"synth-Q4_0", 1.0, 3e-3, 0.25, 0.5},       {"synth-Q4_1", 1.0, 3e-3, 0.25, 0.5},
    {"synth-Q5_0", 1.0, 3e-3, 0.25, 0.5},       {"synth-Q4_K_M", 1.0, 3e-3, 0.25, 0.5},
    {"synth-Q5_K_M", 1.0, 3e-3, 0.25, 0.5},     {"synth-Q6_K", 1.0, 3e-3, 0.25, 0.5},
};

int main(void) { return run_ref_cases("test_reference", "", CASES, sizeof CASES / sizeof CASES[0]); }
