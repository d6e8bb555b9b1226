/*
 * kvshard — public API.
 *
 * Every fallible function returns an int: KVS_OK (0) or one negative code of
 * enum kvs_err. Results come back through out-parameters. Library code never
 * exits and never prints; kvs_strerror() turns a code into text.
 */
#ifndef KVSHARD_H
#define KVSHARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, value, message) */
#define KVS_ERR_MAP(X)                                                        \
    X(OK, 0, "ok")                                                            \
    X(ERR_NOMEM, -1, "out of memory")                                         \
    X(ERR_INVALID_ARG, -2, "invalid argument")                                \
    X(ERR_IO, -3, "i/o error")                                                \
    X(ERR_FORMAT, -4, "malformed file or data")                               \
    X(ERR_UNSUPPORTED, -5, "unsupported")                                     \
    X(ERR_NOT_FOUND, -6, "not found")                                         \
    X(ERR_CACHE_MISS, -7, "cache miss: session state missing, replay needed") \
    X(ERR_STALE_EPOCH, -8, "stale route epoch")                               \
    X(ERR_CONTEXT_FULL, -9, "session context full")                           \
    X(ERR_BUDGET_EXHAUSTED, -10, "kv budget exhausted")                       \
    X(ERR_CANCELLED, -11, "cancelled")                                        \
    X(ERR_PROTOCOL, -12, "protocol error")                                    \
    X(ERR_TIMEOUT, -13, "timed out")                                          \
    X(ERR_BUSY, -14, "busy")                                                  \
    X(ERR_CLOSED, -15, "connection closed")                                   \
    X(ERR_TOO_LARGE, -16, "too large")                                        \
    X(ERR_INTERNAL, -17, "internal error")

enum kvs_err {
#define KVS_ERR_ENUM_(name, value, msg) KVS_##name = value,
    KVS_ERR_MAP(KVS_ERR_ENUM_)
#undef KVS_ERR_ENUM_
};

/* Returns a static, NUL-terminated description of an error code; never NULL. */
const char *kvs_strerror(int err);

/* Size of the optional message buffers that many calls accept (char *msg, size_t msg_cap). */
#define KVS_MSG_MAX 256

#ifdef __cplusplus
}
#endif

#endif /* KVSHARD_H */
