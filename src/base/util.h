/* util — small helpers shared by every module: messages, checked size math, LE reads. */
#ifndef KVS_UTIL_H
#define KVS_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvshard.h"

/* Formats a message into msg (capacity cap) when msg is non-NULL; returns err unchanged,
 * so callers can write `return kvs_fail(msg, cap, KVS_ERR_FORMAT, "bad %s", what);`. */
int kvs_fail(char *msg, size_t cap, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Checked arithmetic: return false on overflow, *out untouched then. */
static inline bool kvs_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    uint64_t r;
    if (__builtin_mul_overflow(a, b, &r)) return false;
    *out = r;
    return true;
}
static inline bool kvs_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
    uint64_t r;
    if (__builtin_add_overflow(a, b, &r)) return false;
    *out = r;
    return true;
}

/* Little-endian loads/stores from unaligned memory. */
static inline uint16_t kvs_rd_u16(const void *p) { uint8_t b[2]; memcpy(b, p, 2); return (uint16_t)(b[0] | (b[1] << 8)); }
static inline uint32_t kvs_rd_u32(const void *p) {
    uint8_t b[4]; memcpy(b, p, 4);
    return (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
}
static inline uint64_t kvs_rd_u64(const void *p) {
    const uint8_t *b = (const uint8_t *)p;
    return (uint64_t)kvs_rd_u32(b) | ((uint64_t)kvs_rd_u32(b + 4) << 32);
}
static inline float kvs_rd_f32(const void *p) { uint32_t u = kvs_rd_u32(p); float f; memcpy(&f, &u, 4); return f; }
static inline double kvs_rd_f64(const void *p) { uint64_t u = kvs_rd_u64(p); double d; memcpy(&d, &u, 8); return d; }
static inline void kvs_wr_u16(void *p, uint16_t v) { uint8_t b[2] = {(uint8_t)v, (uint8_t)(v >> 8)}; memcpy(p, b, 2); }
static inline void kvs_wr_u32(void *p, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    memcpy(p, b, 4);
}
static inline void kvs_wr_u64(void *p, uint64_t v) { kvs_wr_u32(p, (uint32_t)v); kvs_wr_u32((uint8_t *)p + 4, (uint32_t)(v >> 32)); }
static inline void kvs_wr_f32(void *p, float f) { uint32_t u; memcpy(&u, &f, 4); kvs_wr_u32(p, u); }

/* Aborts with file:line on a broken invariant (a bug), never on bad input. */
#define KVS_ASSERT(cond)                                                       \
    do {                                                                       \
        if (!(cond)) kvs_assert_fail(__FILE__, __LINE__, #cond);               \
    } while (0)
_Noreturn void kvs_assert_fail(const char *file, int line, const char *what);

/* Anonymous read-write memory for a large long-lived buffer (repacked weights,
 * the KV arena): mmap of bytes rounded up to 2 MiB, advised MADV_HUGEPAGE so
 * that, where the kernel's transparent huge pages are in "madvise" mode, it
 * is backed by 2 MiB pages and a walk through it costs few TLB misses.
 * noreserve: MAP_NORESERVE (pages touched on first use count, not the size).
 * NULL when the mapping fails; *mapped gets the length to pass to kvs_unmap_big. */
void *kvs_map_big(size_t bytes, bool noreserve, size_t *mapped);
void kvs_unmap_big(void *p, size_t mapped);
/* Writes every page of [p, p + len) (zeros on fresh anonymous memory) so later first writes take
 * no page fault: MADV_POPULATE_WRITE, else one store per 4 KiB page. */
void kvs_prefault(void *p, size_t len);
/* Advises MADV_HUGEPAGE for the 2 MiB-aligned part of [p, p + len), a large malloc'd buffer
 * that is filled at once (a KV transfer): its first touch then faults 2 MiB at a time, which
 * where page faults are dear (virtual machines) is several times faster. Advice only. */
void kvs_advise_huge(void *p, size_t len);

/* Monotonic time in nanoseconds. */
uint64_t kvs_now_ns(void);

#endif /* KVS_UTIL_H */
