#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
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

void *kvs_map_big(size_t bytes, bool noreserve, size_t *mapped) {
    const size_t huge = (size_t)2 << 20;
    if (bytes == 0 || bytes > SIZE_MAX - huge) return NULL;
    const size_t len = (bytes + huge - 1) / huge * huge;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (noreserve ? MAP_NORESERVE : 0), -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, len, MADV_HUGEPAGE); /* advice only: without it the pages are 4 KiB */
#endif
    *mapped = len;
    return p;
}

void kvs_prefault(void *p, size_t len) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; an older kernel refuses it and the loop below runs */
#endif
    if (madvise(p, len, MADV_POPULATE_WRITE) == 0) return;
    volatile uint8_t *b = p;
    for (size_t off = 0; off < len; off += 4096) b[off] = 0;
}

void kvs_unmap_big(void *p, size_t mapped) {
    if (p) munmap(p, mapped);
}

void kvs_advise_huge(void *p, size_t len) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20, lo = ((uintptr_t)p + huge - 1) & ~(huge - 1),
                    hi = ((uintptr_t)p + len) & ~(huge - 1);
    if (p && hi > lo) (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)len;
#endif
}
