#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

const char *kvs_strerror(int err) {
    switch (err) {
#define KVS_ERR_STR_(name, value, text) case value: return text;
        KVS_ERR_MAP(KVS_ERR_STR_)
#undef KVS_ERR_STR_
    default: return "unknown error";
    }
}

int kvs_fail(char *msg, size_t cap, int err, const char *fmt, ...) {
    if (msg && cap > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, cap, fmt, ap);
        va_end(ap);
    }
    return err;
}

void kvs_assert_fail(const char *file, int line, const char *what) {
    fprintf(stderr, "kvshard: internal invariant broken at %s:%d: %s\n", file, line, what);
    abort();
}

uint64_t kvs_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
