/*
 * registry — what a shard publishes in etcd and how clients read it back (docs/cluster.md).
 *
 * One entry per shard, a JSON object under PREFIX/shards/<model digest hex>/<addr>, attached to the
 * shard's lease so that it disappears within the TTL of a shard that died. The registry is advice,
 * never trust: clients still authenticate each shard (TLS) and check its INFO against the entry.
 */
#ifndef KVS_REGISTRY_H
#define KVS_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CL_DEFAULT_PREFIX "/kvshard/v1/"
#define CL_ADDR_MAX 280u  /* "host:port" */
#define CL_NAME_MAX 128u
#define CL_DIGEST_HEX 64u
#define CL_MAX_LAYERS 65536u

enum cl_state { CL_SERVING = 0, CL_DRAINING = 1 };

typedef struct {
    char addr[CL_ADDR_MAX];           /* advertised "host:port" */
    char name[CL_NAME_MAX];           /* model name */
    char digest[CL_DIGEST_HEX + 1];   /* model digest, lowercase hex */
    char tls_id[CL_NAME_MAX];         /* TLS identity (certificate subject), "" for none */
    uint32_t n_layer, first, last;    /* serves [first, last) of n_layer */
    uint32_t proto;                   /* protocol version */
    uint64_t kv_budget, kv_used;      /* bytes */
    uint32_t sessions;                /* live sessions */
    double load;                      /* >= 0; requests in flight per compute thread, smoothed */
    int state;                        /* enum cl_state */
} cl_entry;

/* The entry as one JSON object (malloc'd, free()); NULL when out of memory. */
char *cl_entry_encode(const cl_entry *e);
/* Parses and checks an entry: every field present with the right type, 0 <= first < last <=
 * n_layer <= CL_MAX_LAYERS, a 64-hex digest, a non-empty "host:port", state "serving" or
 * "draining", numbers in range. KVS_ERR_FORMAT with a message naming the field otherwise. */
int cl_entry_decode(const char *json, size_t len, cl_entry *out, char *msg, size_t cap);
/* The key of e under prefix (e.g. CL_DEFAULT_PREFIX): PREFIX "shards/" DIGEST "/" ADDR. */
void cl_entry_key(const cl_entry *e, const char *prefix, char *out, size_t cap);
const char *cl_state_name(int state);

#endif /* KVS_REGISTRY_H */
