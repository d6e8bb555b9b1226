/* Minimal test helpers: assertions that print both sides, skip code 77, shared-data lookup. */
#ifndef KVS_TEST_H
#define KVS_TEST_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvshard.h"

static int test_failures_;

#define CHECK(cond)                                                                 \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            test_failures_++;                                                       \
        }                                                                           \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                                   \
    do {                                                                                     \
        long long va_ = (long long)(a), vb_ = (long long)(b);                                \
        if (va_ != vb_) {                                                                    \
            fprintf(stderr, "%s:%d: CHECK_EQ_INT failed: %s == %s (%lld vs %lld)\n", __FILE__, \
                    __LINE__, #a, #b, va_, vb_);                                             \
            test_failures_++;                                                                \
        }                                                                                    \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                                 \
    do {                                                                                      \
        double va_ = (double)(a), vb_ = (double)(b);                                          \
        if (!(va_ - vb_ <= (tol) && vb_ - va_ <= (tol))) {                                    \
            fprintf(stderr, "%s:%d: CHECK_NEAR failed: %s ~ %s (%.9g vs %.9g, tol %g)\n",      \
                    __FILE__, __LINE__, #a, #b, va_, vb_, (double)(tol));                     \
            test_failures_++;                                                                 \
        }                                                                                     \
    } while (0)

#define TEST_SKIP_CODE 77

/* Path of a file in the shared data dir (KVS_SHARED_DIR, default ../shared from
 * the source tree); returns NULL and prints a skip note when the file is absent. */
static inline const char *test_shared_path(const char *rel, char *buf, size_t cap) {
    const char *dir = getenv("KVS_SHARED_DIR");
    if (!dir) dir = "../shared";
    snprintf(buf, cap, "%s/%s", dir, rel);
    if (access(buf, R_OK) != 0) {
        fprintf(stderr, "note: %s is missing; checks on it are skipped\n", buf);
        return NULL;
    }
    return buf;
}

/* Reads a whole file into a malloc'd buffer (*n bytes); NULL when it cannot. */
static inline uint8_t *test_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(sz > 0 ? (size_t)sz : 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *n = (size_t)(sz > 0 ? sz : 0);
    return b;
}

/* Prints the closing line and returns the process exit code. */
static inline int test_finish(const char *name, int n_run, int n_skipped) {
    if (n_run == 0 && n_skipped > 0) {
        printf("%s: SKIPPED (all checks need missing data)\n", name);
        return TEST_SKIP_CODE;
    }
    printf("%s: %s (%d failures, %d skipped parts)\n", name, test_failures_ ? "FAIL" : "ok",
           test_failures_, n_skipped);
    return test_failures_ ? 1 : 0;
}

#endif /* KVS_TEST_H */
