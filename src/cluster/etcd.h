/*
 * etcd — a small etcd v3 client over its JSON gateway (POST /v3/...), libcurl + cJSON.
 *
 * Keys and values travel base64 in the gateway's JSON; 64-bit ids come back as JSON strings.
 * One handle is one libcurl easy handle: not thread-safe, one thread per handle (the shard's
 * registration thread and a client each open their own). Every request has a deadline
 * (timeout_ms), so a dead etcd costs a bounded wait and an error, never a hang.
 */
#ifndef KVS_ETCD_H
#define KVS_ETCD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct etcd etcd;

typedef struct {
    const char *url;        /* "http://HOST:PORT" or "https://HOST:PORT" (one endpoint) */
    const char *ca, *cert, *key; /* TLS to etcd: CA file, client certificate and key (NULL: none) */
    const char *user, *password; /* etcd auth (NULL: none): a token from /v3/auth/authenticate,
                                    asked at the first request (deadline >= 10 s: bcrypt is slow) */
    int timeout_ms;         /* per request; <= 0: 2000 */
} etcd_params;

typedef struct {
    char *key, *value;      /* decoded, NUL-terminated, malloc'd */
    size_t value_len;
    int64_t lease;
} etcd_kv;

int etcd_open(const etcd_params *p, etcd **out, char *msg, size_t cap);
void etcd_close(etcd *e);
/* Puts key=value, attached to lease (0: none). */
int etcd_put(etcd *e, const char *key, const char *value, int64_t lease, char *msg, size_t cap);
/* Every key that starts with prefix: *kvs (malloc'd, etcd_kvs_free) of *n entries. */
int etcd_range_prefix(etcd *e, const char *prefix, etcd_kv **kvs, size_t *n, char *msg, size_t cap);
void etcd_kvs_free(etcd_kv *kvs, size_t n);
int etcd_delete(etcd *e, const char *key, char *msg, size_t cap);
int etcd_lease_grant(etcd *e, int64_t ttl_s, int64_t *id, char *msg, size_t cap);
/* Renews lease id once; *ttl_left is what etcd says is left, 0 when the lease is gone
 * (expired or revoked: grant a new one). */
int etcd_lease_keepalive(etcd *e, int64_t id, int64_t *ttl_left, char *msg, size_t cap);
int etcd_lease_revoke(etcd *e, int64_t id, char *msg, size_t cap);

/* What a watch reports: the watch is in place (changes from now on are reported), a key was
 * created, an existing key was rewritten, a key was deleted (or its lease expired). */
enum etcd_watch_event { ETCD_WATCHING = 0, ETCD_CREATED = 1, ETCD_MODIFIED = 2, ETCD_DELETED = 3 };

typedef struct {
    void (*on_event)(void *ctx, int event, const char *key); /* key NULL for ETCD_WATCHING */
    bool (*stop)(void *ctx); /* polled about every 100 ms and on each message: true ends the watch */
    void *ctx;
} etcd_watch_cb;

/* Watches every key under prefix over one streaming POST /v3/watch, calling cb->on_event as etcd
 * reports, until cb->stop says so (KVS_OK) or the stream breaks (etcd down or restarted: the error;
 * changes may then have been missed, so re-read the range before watching again). Blocks the
 * calling thread; the handle is busy meanwhile. */
int etcd_watch_prefix(etcd *e, const char *prefix, const etcd_watch_cb *cb, char *msg, size_t cap);

#endif /* KVS_ETCD_H */
