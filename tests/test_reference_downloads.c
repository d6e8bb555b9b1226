/*
 * Agreement with llama.cpp on ../shared/downloads/reference: the synthetic
 * model in the quant types common in downloads of large models (q5_1, q2_k,
 * q3_k_m, iq4_nl, iq4_xs). Same full-logit format and quantized-type bounds as
 * ../shared/reference (downloads/README.md); checks in reference_check.h.
 */
#include "reference_check.h"

static const ref_case CASES[] = {
    {"synth-Q5_1", 1.0, 3e-3, 0.25, 0.5},   {"synth-Q2_K", 1.0, 3e-3, 0.25, 0.5},
    {"synth-Q3_K_M", 1.0, 3e-3, 0.25, 0.5}, {"synth-IQ4_NL", 1.0, 3e-3, 0.25, 0.5},
    {"synth-IQ4_XS", 1.0, 3e-3, 0.25, 0.5},
};

int main(void) { return run_ref_cases("test_reference_downloads", "downloads/", CASES, sizeof CASES / sizeof CASES[0]); }
