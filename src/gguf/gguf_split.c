/*
 * gguf split files: a model in parts NAME-0000K-of-0000N.gguf. See gguf.h.
 *
 * Invariants of an open gguf_set:
 *  1. parts[0] holds the model's metadata; parts[i] has split.no == i and
 *     split.count == n_parts, and every part agrees on split.tensors.count,
 *     which equals the sum of the parts' tensor counts;
 *  2. a tensor name is in exactly one part, so find_tensor's answer does not
 *     depend on the search order;
 *  3. a split model's parts are opened header-only; a part's data section is
 *     mapped by gguf_set_map_tensor when a tensor in it is first asked for,
 *     and stays mapped until gguf_set_close;
 *  4. with a kvshard manifest in part 1 (man != NULL): man lists every tensor
 *     once with its part; a present part holds exactly the entries naming it;
 *     parts[i] may be NULL (absent from disk), and then its entries answer
 *     find with a name-only ghost and map with an error; an entry is marked
 *     verified only after its mapped bytes matched its BLAKE2b digest.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "util.h"

typedef struct {
    gguf_tensor ghost;     /* name only (data NULL, n_dims 0): find's answer while the part is absent */
    const gguf_tensor *t;  /* the tensor in its part's header; NULL while the part is absent */
    uint32_t part;
    uint8_t digest[GGUF_MANIFEST_DIGEST_SIZE];
    bool verified;
} man_entry;

struct gguf_set {
    uint32_t n_parts;
    gguf_ctx **parts; /* [n_parts]; an entry is NULL only for a part absent with a manifest */
    char *prefix;     /* NAME of NAME-00001-of-0000N.gguf, for messages; NULL for one file */
    man_entry *man;   /* [n_man]: the kvshard manifest; NULL when part 1 has none */
    uint64_t n_man;
    uint8_t model_digest[32]; /* the manifest's whole-model SHA-256 */
};

bool gguf_split_path(char *buf, size_t cap, const char *prefix, uint32_t i, uint32_t n) {
    int len = snprintf(buf, cap, "%s-%05" PRIu32 "-of-%05" PRIu32 ".gguf", prefix, i + 1, n);
    return len > 0 && (size_t)len < cap;
}

void gguf_set_close(gguf_set *set) {
    if (!set) return;
    for (uint32_t i = 0; i < set->n_parts; i++) gguf_close(set->parts[i]);
    free(set->parts);
    free(set->prefix);
    free(set->man);
    free(set);
}

/* A u32 split key of one part; reports the part by its path. */
static int split_key(const gguf_ctx *g, const char *path, const char *key, uint32_t *out, char *msg, size_t cap) {
    int err = gguf_get_u32(g, key, out);
    if (err == KVS_ERR_NOT_FOUND) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "%s: split part without '%s'", path, key);
    if (err) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "%s: '%s' is not a 32-bit unsigned integer", path, key);
    return KVS_OK;
}

uint32_t gguf_split_first_part(const char *path, char *prefix, size_t cap) {
    static const char head[] = "-00001-of-";
    size_t lp = strlen(path), tail = sizeof(head) - 1 + 5 + 5; /* "-00001-of-" NNNNN ".gguf" */
    if (lp <= tail || lp - tail >= cap) return 0;
    const char *t = path + lp - tail;
    if (memcmp(t, head, sizeof(head) - 1) != 0 || strcmp(t + tail - 5, ".gguf") != 0) return 0;
    uint32_t n = 0;
    for (int i = 0; i < 5; i++) {
        char c = t[sizeof(head) - 1 + i];
        if (c < '0' || c > '9') return 0;
        n = n * 10 + (uint32_t)(c - '0');
    }
    if (n < 1) return 0;
    memcpy(prefix, path, lp - tail);
    prefix[lp - tail] = '\0';
    return n;
}

/* The NAME of NAME-00001-of-NNNNN.gguf (n parts) into prefix; false when path is not so named. */
static bool first_part_prefix(const char *path, uint32_t n, char *prefix, size_t cap) {
    return gguf_split_first_part(path, prefix, cap) == n;
}

static bool is_int_vtype(enum gguf_vtype t) {
    return t == GGUF_VT_U8 || t == GGUF_VT_I8 || t == GGUF_VT_U16 || t == GGUF_VT_I16 || t == GGUF_VT_U32 ||
           t == GGUF_VT_I32 || t == GGUF_VT_U64 || t == GGUF_VT_I64;
}

/* The manifest array key of part 1 with n elements of type want (any integer type when want is
 * GGUF_VT_U32); NULL with msg set otherwise. */
static const gguf_kv *manifest_array(const gguf_ctx *g, const char *key, enum gguf_vtype want, uint64_t n, char *msg,
                                     size_t cap) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    bool ok = kv && kv->type == GGUF_VT_ARRAY && kv->arr_n == n &&
              (want == GGUF_VT_U32 ? is_int_vtype(kv->arr_type) : kv->arr_type == want);
    if (!ok)
        kvs_fail(msg, cap, KVS_ERR_FORMAT, "kvshard manifest: '%s' is missing or not an array of %" PRIu64 " %s", key, n,
                 want == GGUF_VT_U32 ? "integers" : gguf_vtype_name(want));
    return ok ? kv : NULL;
}

/* Parses 64 hex digits into 32 bytes; false on anything else. */
static bool parse_sha256_hex(gguf_str s, uint8_t out[32]) {
    if (s.len != 64) return false;
    for (int i = 0; i < 64; i++) {
        char c = s.ptr[i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) return false;
        out[i / 2] = (uint8_t)(i % 2 ? (out[i / 2] | v) : v << 4);
    }
    return true;
}

/* Reads part 1's kvshard manifest into set->man (left NULL when part 1 has none): total tensors,
 * each with a unique name, a part below n_parts and a digest. */
static int read_manifest(gguf_set *set, const gguf_ctx *g, const char *path, uint32_t total, char *msg, size_t cap) {
    uint32_t version;
    int err = gguf_get_u32(g, GGUF_MANIFEST_VERSION, &version);
    if (err == KVS_ERR_NOT_FOUND) return KVS_OK;
    if (err || version != 1)
        return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED, "%s: kvshard manifest version is not 1 (written by a newer kvshard?)",
                        path);
    gguf_str hex;
    if (gguf_get_str(g, GGUF_MANIFEST_MODEL_SHA256, &hex) != KVS_OK || !parse_sha256_hex(hex, set->model_digest))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "%s: kvshard manifest: '%s' is not 64 lower-case hex digits", path,
                        GGUF_MANIFEST_MODEL_SHA256);
    const gguf_kv *names = manifest_array(g, GGUF_MANIFEST_NAMES, GGUF_VT_STRING, total, msg, cap);
    const gguf_kv *parts = names ? manifest_array(g, GGUF_MANIFEST_PARTS, GGUF_VT_U32, total, msg, cap) : NULL;
    const gguf_kv *dig = parts ? manifest_array(g, GGUF_MANIFEST_DIGESTS, GGUF_VT_U8,
                                                (uint64_t)total * GGUF_MANIFEST_DIGEST_SIZE, msg, cap) : NULL;
    if (!dig) return KVS_ERR_FORMAT;
    if (!(set->man = calloc(total ? total : 1, sizeof(man_entry)))) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    set->n_man = total;
    for (uint32_t i = 0; i < total; i++) {
        man_entry *e = &set->man[i];
        int64_t part = gguf_arr_i64(parts, i);
        e->ghost.name = names->arr_strs[i];
        if (part < 0 || part >= (int64_t)set->n_parts || e->ghost.name.len == 0 || e->ghost.name.len > GGUF_MAX_NAME_LEN)
            return kvs_fail(msg, cap, KVS_ERR_FORMAT, "%s: kvshard manifest entry %" PRIu32 " is malformed", path, i);
        e->part = (uint32_t)part;
        memcpy(e->digest, (const uint8_t *)dig->arr_data + (size_t)i * GGUF_MANIFEST_DIGEST_SIZE, GGUF_MANIFEST_DIGEST_SIZE);
        for (uint32_t k = 0; k < i; k++)
            if (set->man[k].ghost.name.len == e->ghost.name.len &&
                !memcmp(set->man[k].ghost.name.ptr, e->ghost.name.ptr, e->ghost.name.len))
                return kvs_fail(msg, cap, KVS_ERR_FORMAT, "%s: kvshard manifest names tensor '%.*s' twice", path,
                                (int)e->ghost.name.len, e->ghost.name.ptr);
    }
    return KVS_OK;
}

/* Opens part i header-only and checks its split keys; *total takes part 1's tensor count. */
static int open_part(gguf_set *set, uint32_t i, const char *part_path, uint32_t *total, char *msg, size_t cap) {
    int err = gguf_open_header(part_path, &set->parts[i], msg, cap);
    if (err) return err;
    const gguf_ctx *g = set->parts[i];
    uint32_t no, count, tensors;
    if ((err = split_key(g, part_path, "split.no", &no, msg, cap)) ||
        (err = split_key(g, part_path, "split.count", &count, msg, cap)) ||
        (err = split_key(g, part_path, "split.tensors.count", &tensors, msg, cap)))
        return err;
    if (no != i || count != set->n_parts)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT,
                        "%s: split.no %" PRIu32 " / split.count %" PRIu32 ", expected %" PRIu32 " / %" PRIu32, part_path,
                        no, count, i, set->n_parts);
    if (i == 0) *total = tensors;
    else if (tensors != *total)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT,
                        "%s: split.tensors.count %" PRIu32 " but the first part says %" PRIu32, part_path, tensors, *total);
    return KVS_OK;
}

/* Without a manifest: no tensor of part i is in an earlier part. */
static int check_no_duplicates(const gguf_set *set, uint32_t i, char *msg, size_t cap) {
    const gguf_ctx *g = set->parts[i];
    for (uint64_t t = 0; t < gguf_n_tensors(g); t++) {
        const gguf_tensor *ti = gguf_tensor_at(g, t);
        char name[GGUF_MAX_NAME_LEN + 1];
        snprintf(name, sizeof(name), "%.*s", (int)ti->name.len, ti->name.ptr);
        for (uint32_t k = 0; k < i; k++)
            if (gguf_find_tensor(set->parts[k], name))
                return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor '%s' is in parts %" PRIu32 " and %" PRIu32, name, k + 1,
                                i + 1);
    }
    return KVS_OK;
}

/* With a manifest: every present part holds exactly the tensors the manifest gives it. */
static int link_manifest(gguf_set *set, const char *path, char *msg, size_t cap) {
    uint64_t *listed = calloc(set->n_parts, sizeof(uint64_t));
    if (!listed) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    int err = KVS_OK;
    for (uint64_t i = 0; i < set->n_man && !err; i++) {
        man_entry *e = &set->man[i];
        const gguf_ctx *g = set->parts[e->part];
        listed[e->part]++;
        if (!g) continue;
        char name[GGUF_MAX_NAME_LEN + 1];
        snprintf(name, sizeof(name), "%.*s", (int)e->ghost.name.len, e->ghost.name.ptr);
        if (!(e->t = gguf_find_tensor(g, name)))
            err = kvs_fail(msg, cap, KVS_ERR_FORMAT, "%s: the kvshard manifest puts tensor '%s' in part %" PRIu32
                           " but that part does not hold it", path, name, e->part + 1);
    }
    for (uint32_t p = 0; p < set->n_parts && !err; p++)
        if (set->parts[p] && gguf_n_tensors(set->parts[p]) != listed[p])
            err = kvs_fail(msg, cap, KVS_ERR_FORMAT, "%s: part %" PRIu32 " holds %" PRIu64 " tensors but the kvshard "
                           "manifest lists %" PRIu64, path, p + 1, gguf_n_tensors(set->parts[p]), listed[p]);
    free(listed);
    return err;
}

static int open_parts(gguf_set *set, const char *path, uint32_t n, char *msg, size_t cap) {
    char prefix[4096], part_path[4096 + 32];
    if (!first_part_prefix(path, n, prefix, sizeof(prefix)))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT,
                        "%s: split.count is %" PRIu32 " but the name does not end in -00001-of-%05" PRIu32
                        ".gguf (pass the first part; the others are found by name)",
                        path, n, n);
    set->parts = calloc(n, sizeof(gguf_ctx *));
    if (!set->parts || !(set->prefix = strdup(prefix))) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    set->n_parts = n;
    uint32_t total = 0;
    uint64_t sum = 0;
    int err;
    for (uint32_t i = 0; i < n; i++) {
        if (!gguf_split_path(part_path, sizeof(part_path), prefix, i, n))
            return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "%s: path too long", path);
        /* With a manifest a part not on disk is fine until one of its tensors is mapped. */
        if (i > 0 && set->man && access(part_path, F_OK) != 0 && errno == ENOENT) continue;
        if ((err = open_part(set, i, part_path, &total, msg, cap))) {
            if (err != KVS_ERR_IO || set->man || !msg || !cap) return err;
            char why[KVS_MSG_MAX];
            snprintf(why, sizeof why, "%s", msg);
            return kvs_fail(msg, cap, err, "%s (a split without a kvshard manifest needs every part)", why);
        }
        if (i == 0 && (err = read_manifest(set, set->parts[0], path, total, msg, cap))) return err;
        if (!set->man && (err = check_no_duplicates(set, i, msg, cap))) return err;
        sum += gguf_n_tensors(set->parts[i]);
    }
    if (set->man) return link_manifest(set, path, msg, cap);
    if (sum != total)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT,
                        "%s: split.tensors.count is %" PRIu32 " but the %" PRIu32 " parts hold %" PRIu64 " tensors", path,
                        total, n, sum);
    return KVS_OK;
}

int gguf_set_open(const char *path, gguf_set **out, char *msg, size_t cap) {
    if (!out || !path) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "NULL argument");
    *out = NULL;
    gguf_set *set = calloc(1, sizeof(*set));
    if (!set) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    gguf_ctx *g = NULL;
    int err = gguf_open(path, &g, msg, cap);
    if (err) goto fail;
    uint32_t n = 1, no = 0;
    err = gguf_get_u32(g, "split.count", &n);
    if (err == KVS_ERR_NOT_FOUND) n = 1;
    else if (err || n == 0 || n > GGUF_SPLIT_MAX_PARTS) {
        err = kvs_fail(msg, cap, KVS_ERR_FORMAT, "%s: split.count must be an integer in [1, %u]", path,
                       GGUF_SPLIT_MAX_PARTS);
        goto fail;
    }
    if (n > 1 && gguf_get_u32(g, "split.no", &no) == KVS_OK && no != 0) {
        err = kvs_fail(msg, cap, KVS_ERR_FORMAT, "%s is part %" PRIu32 " of %" PRIu32 " of a split model; pass the first part",
                       path, no + 1, n);
        goto fail;
    }
    if (n == 1) { /* one file: mapped whole, as always */
        set->parts = malloc(sizeof(gguf_ctx *));
        if (!set->parts) {
            err = kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
            goto fail;
        }
        set->parts[0] = g;
        set->n_parts = 1;
        *out = set;
        return KVS_OK;
    }
    gguf_close(g); /* parts are reopened header-only */
    g = NULL;
    if ((err = open_parts(set, path, n, msg, cap))) goto fail;
    *out = set;
    return KVS_OK;
fail:
    gguf_close(g);
    gguf_set_close(set);
    return err;
}

const gguf_ctx *gguf_set_meta(const gguf_set *set) { return set->parts[0]; }
uint32_t gguf_set_n_parts(const gguf_set *set) { return set->n_parts; }
const gguf_ctx *gguf_set_part(const gguf_set *set, uint32_t i) { return i < set->n_parts ? set->parts[i] : NULL; }

bool gguf_set_manifest_digest(const gguf_set *set, uint8_t out[32]) {
    if (!set->man) return false;
    memcpy(out, set->model_digest, 32);
    return true;
}

uint64_t gguf_set_n_tensors(const gguf_set *set) {
    if (set->man) return set->n_man;
    uint64_t n = 0;
    for (uint32_t i = 0; i < set->n_parts; i++) n += gguf_n_tensors(set->parts[i]);
    return n;
}

const gguf_tensor *gguf_set_tensor_at(const gguf_set *set, uint64_t i) {
    if (set->man) return i < set->n_man ? (set->man[i].t ? set->man[i].t : &set->man[i].ghost) : NULL;
    for (uint32_t p = 0; p < set->n_parts; i -= gguf_n_tensors(set->parts[p]), p++)
        if (i < gguf_n_tensors(set->parts[p])) return gguf_tensor_at(set->parts[p], i);
    return NULL;
}

static man_entry *manifest_find(const gguf_set *set, const char *name) {
    size_t len = strlen(name);
    for (uint64_t i = 0; i < set->n_man; i++)
        if (set->man[i].ghost.name.len == len && !memcmp(set->man[i].ghost.name.ptr, name, len)) return &set->man[i];
    return NULL;
}

const gguf_tensor *gguf_set_find_tensor(const gguf_set *set, const char *name, uint32_t *part) {
    if (set->man) {
        const man_entry *e = manifest_find(set, name);
        if (e && part) *part = e->part;
        return e ? (e->t ? e->t : &e->ghost) : NULL;
    }
    for (uint32_t i = 0; i < set->n_parts; i++) {
        const gguf_tensor *t = gguf_find_tensor(set->parts[i], name);
        if (t) {
            if (part) *part = i;
            return t;
        }
    }
    return NULL;
}

/* The path of part p into buf ("?" when it does not fit). */
static void part_path_of(const gguf_set *set, uint32_t p, char *buf, size_t cap) {
    if (!gguf_split_path(buf, cap, set->prefix, p, set->n_parts)) snprintf(buf, cap, "?");
}

static bool entry_matches(const man_entry *e) {
    uint8_t d[GGUF_MANIFEST_DIGEST_SIZE];
    crypto_generichash(d, sizeof d, e->t->data, e->t->size, NULL, 0);
    return memcmp(d, e->digest, sizeof d) == 0;
}

static int mismatch(const gguf_set *set, const man_entry *e, char *msg, size_t cap) {
    char path[4096 + 32];
    part_path_of(set, e->part, path, sizeof(path));
    return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor '%.*s' in part %" PRIu32 " (%s) does not match the kvshard "
                    "manifest of part 1: the part is damaged or belongs to another model", (int)e->ghost.name.len,
                    e->ghost.name.ptr, e->part + 1, path);
}

/* Maps the part of manifest entry e and checks its bytes against the manifest, once. */
static int map_verified(gguf_set *set, man_entry *e, const char *name, char *msg, size_t cap) {
    char path[4096 + 32];
    part_path_of(set, e->part, path, sizeof(path));
    if (!set->parts[e->part])
        return kvs_fail(msg, cap, KVS_ERR_IO, "tensor '%s' is in part %" PRIu32 " (%s), which is not on this machine: "
                        "this layer range needs that part", name, e->part + 1, path);
    int err = gguf_map_data(set->parts[e->part], msg, cap);
    if (err || e->verified) return err;
    if (sodium_init() < 0) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "libsodium failed to start");
    if (!entry_matches(e)) return mismatch(set, e, msg, cap);
    e->verified = true;
    return KVS_OK;
}

typedef struct {
    man_entry **todo;
    uint64_t n;
    atomic_uint_fast64_t next;
} verify_job;

/* Checks entries off the shared list until it is empty; a match marks its entry verified. */
static void *verify_worker(void *arg) {
    verify_job *j = arg;
    for (uint64_t i; (i = atomic_fetch_add(&j->next, 1)) < j->n;) j->todo[i]->verified = entry_matches(j->todo[i]);
    return NULL;
}

static int by_size_desc(const void *a, const void *b) {
    uint64_t x = (*(man_entry *const *)a)->t->size, y = (*(man_entry *const *)b)->t->size;
    return x < y ? 1 : x > y ? -1 : 0;
}

int gguf_set_verify(gguf_set *set, bool (*want)(const char *name, void *user), void *user, uint32_t n_threads,
                    char *msg, size_t cap) {
    if (!set->man) return KVS_OK;
    if (sodium_init() < 0) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "libsodium failed to start");
    verify_job j = {.todo = calloc(set->n_man ? set->n_man : 1, sizeof(man_entry *))};
    if (!j.todo) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    int err = KVS_OK;
    char name[GGUF_MAX_NAME_LEN + 1];
    for (uint64_t i = 0; i < set->n_man && !err; i++) {
        man_entry *e = &set->man[i];
        snprintf(name, sizeof(name), "%.*s", (int)e->ghost.name.len, e->ghost.name.ptr);
        if (e->verified || !set->parts[e->part] || !want(name, user)) continue; /* an absent part: map says so */
        if (!(err = gguf_map_data(set->parts[e->part], msg, cap))) j.todo[j.n++] = e;
    }
    qsort(j.todo, j.n, sizeof(man_entry *), by_size_desc); /* the largest first: threads end together */
    atomic_init(&j.next, 0);
    pthread_t th[64];
    uint32_t started = 0;
    for (; !err && started + 1 < n_threads && started < 64 && started + 1 < j.n; started++)
        if (pthread_create(&th[started], NULL, verify_worker, &j) != 0) break;
    if (!err) verify_worker(&j);
    for (uint32_t t = 0; t < started; t++) pthread_join(th[t], NULL);
    for (uint64_t i = 0; i < j.n && !err; i++)
        if (!j.todo[i]->verified) err = mismatch(set, j.todo[i], msg, cap);
    free(j.todo);
    return err;
}

int gguf_set_map_tensor(gguf_set *set, const char *name, const gguf_tensor **out, char *msg, size_t cap) {
    *out = NULL;
    if (set->man) {
        man_entry *e = manifest_find(set, name);
        if (!e) return KVS_ERR_NOT_FOUND;
        int err = map_verified(set, e, name, msg, cap);
        if (err) return err;
        *out = e->t;
        return KVS_OK;
    }
    uint32_t part = 0;
    const gguf_tensor *t = gguf_set_find_tensor(set, name, &part);
    if (!t) return KVS_ERR_NOT_FOUND;
    int err = gguf_map_data(set->parts[part], msg, cap);
    if (err) return err;
    *out = t;
    return KVS_OK;
}

uint64_t gguf_set_mapped_data_bytes(const gguf_set *set) {
    uint64_t sum = 0;
    for (uint32_t i = 0; i < set->n_parts; i++)
        if (set->parts[i]) sum += gguf_mapped_data_bytes(set->parts[i]);
    return sum;
}

/* ------------------------------------------------------------------ writer */

/* Keys a split writes itself: the source's own copies (from an earlier split) are dropped. */
static bool is_split_key(gguf_str key) {
    static const char man[] = "kvshard.manifest.";
    return gguf_str_eq(key, "split.no") || gguf_str_eq(key, "split.count") || gguf_str_eq(key, "split.tensors.count") ||
           (key.len >= sizeof(man) - 1 && !memcmp(key.ptr, man, sizeof(man) - 1));
}

/* The manifest part 1 gets: one entry per tensor of the source, in its order. */
typedef struct {
    const char **names;
    uint32_t *parts;
    uint8_t *digests; /* GGUF_MANIFEST_DIGEST_SIZE bytes each */
    char sha256_hex[65];
} split_manifest;

static void manifest_free(split_manifest *m) {
    if (m->names)
        for (uint32_t i = 0; m->names[i]; i++) free((char *)m->names[i]);
    free(m->names);
    free(m->parts);
    free(m->digests);
}

/* Fills m from src (data mapped): names, parts and the BLAKE2b of every tensor's bytes. */
static int manifest_build(split_manifest *m, const gguf_ctx *src, const uint32_t *part_of, const uint8_t sha256[32]) {
    uint64_t n = gguf_n_tensors(src);
    static const char x[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        m->sha256_hex[2 * i] = x[sha256[i] >> 4];
        m->sha256_hex[2 * i + 1] = x[sha256[i] & 15];
    }
    m->sha256_hex[64] = 0;
    m->names = calloc(n + 1, sizeof(char *));
    m->parts = malloc((n ? n : 1) * sizeof(uint32_t));
    m->digests = malloc((n ? n : 1) * GGUF_MANIFEST_DIGEST_SIZE);
    if (!m->names || !m->parts || !m->digests || sodium_init() < 0) return KVS_ERR_NOMEM;
    for (uint64_t i = 0; i < n; i++) {
        const gguf_tensor *t = gguf_tensor_at(src, i);
        char *name = malloc(t->name.len + 1);
        if (!name) return KVS_ERR_NOMEM;
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = 0;
        m->names[i] = name;
        m->parts[i] = part_of[i];
        crypto_generichash(m->digests + i * GGUF_MANIFEST_DIGEST_SIZE, GGUF_MANIFEST_DIGEST_SIZE, t->data, t->size, NULL, 0);
    }
    return KVS_OK;
}

static int write_manifest_keys(gguf_writer *w, const split_manifest *m, uint64_t n) {
    int err = gguf_writer_set_u32(w, GGUF_MANIFEST_VERSION, 1);
    if (!err) err = gguf_writer_set_str(w, GGUF_MANIFEST_MODEL_SHA256, m->sha256_hex);
    if (!err) err = gguf_writer_set_arr(w, GGUF_MANIFEST_NAMES, GGUF_VT_STRING, m->names, n);
    if (!err) err = gguf_writer_set_arr(w, GGUF_MANIFEST_PARTS, GGUF_VT_U32, m->parts, n);
    if (!err) err = gguf_writer_set_arr(w, GGUF_MANIFEST_DIGESTS, GGUF_VT_U8, m->digests, n * GGUF_MANIFEST_DIGEST_SIZE);
    return err;
}

/* Writes part p: its metadata (and the manifest, when given, in part 1), then the tensors with
 * part_of[i] == p. */
static int write_part(const gguf_ctx *src, const uint32_t *part_of, uint32_t p, uint32_t n_parts,
                      const split_manifest *man, const char *path, char *msg, size_t cap) {
    gguf_writer *w = gguf_writer_create();
    if (!w) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    int err = KVS_OK;
    for (uint64_t i = 0; i < gguf_n_kv(src) && !err; i++) {
        const gguf_kv *kv = gguf_kv_at(src, i);
        if (is_split_key(kv->key)) continue;
        if (p == 0 || gguf_str_eq(kv->key, "general.alignment")) err = gguf_writer_copy_kv(w, kv);
    }
    if (!err) err = gguf_writer_set_u32(w, "split.no", p);
    if (!err) err = gguf_writer_set_u32(w, "split.count", n_parts);
    if (!err) err = gguf_writer_set_u32(w, "split.tensors.count", (uint32_t)gguf_n_tensors(src));
    if (!err && p == 0 && man) err = write_manifest_keys(w, man, gguf_n_tensors(src));
    char name[GGUF_MAX_NAME_LEN + 1];
    for (uint64_t i = 0; i < gguf_n_tensors(src) && !err; i++) {
        if (part_of[i] != p) continue;
        const gguf_tensor *t = gguf_tensor_at(src, i);
        snprintf(name, sizeof(name), "%.*s", (int)t->name.len, t->name.ptr);
        err = gguf_writer_declare_tensor(w, name, t->type, t->n_dims, t->ne, NULL);
    }
    if (err) {
        gguf_writer_free(w);
        return kvs_fail(msg, cap, err, "%s: cannot set up the part's header", path);
    }
    err = gguf_writer_begin(w, path, msg, cap);
    for (uint64_t i = 0; i < gguf_n_tensors(src) && !err; i++) {
        const gguf_tensor *t = gguf_tensor_at(src, i);
        if (part_of[i] == p) err = gguf_writer_write_data(w, t->data, (size_t)t->size, msg, cap);
    }
    if (!err) err = gguf_writer_finish(w, msg, cap);
    gguf_writer_free(w);
    return err;
}

int gguf_split_write(const gguf_ctx *src, const uint32_t *part_of, uint32_t n_parts, const char *prefix, char *msg,
                     size_t cap) {
    return gguf_split_write_manifest(src, part_of, n_parts, prefix, NULL, msg, cap);
}

int gguf_split_write_manifest(const gguf_ctx *src, const uint32_t *part_of, uint32_t n_parts, const char *prefix,
                              const uint8_t *model_sha256, char *msg, size_t cap) {
    if (!src || !part_of || !prefix) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "NULL argument");
    if (n_parts < 1 || n_parts > GGUF_SPLIT_MAX_PARTS)
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "part count %" PRIu32 " is not in [1, %u]", n_parts,
                        GGUF_SPLIT_MAX_PARTS);
    if (gguf_n_tensors(src) > UINT32_MAX) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "too many tensors");
    uint32_t *count = calloc(n_parts, sizeof(uint32_t));
    if (!count) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    int err = KVS_OK;
    for (uint64_t i = 0; i < gguf_n_tensors(src) && !err; i++) {
        if (part_of[i] >= n_parts)
            err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "tensor %" PRIu64 " assigned to part %" PRIu32 " of %" PRIu32, i,
                           part_of[i] + 1, n_parts);
        else if (!gguf_tensor_at(src, i)->data)
            err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "the source's tensor data is not mapped");
        else count[part_of[i]]++;
    }
    for (uint32_t p = 0; p < n_parts && !err; p++)
        if (count[p] == 0) err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "part %" PRIu32 " would hold no tensor", p + 1);
    free(count);
    if (err) return err;
    split_manifest man = {0};
    if (model_sha256 && manifest_build(&man, src, part_of, model_sha256) != KVS_OK) {
        manifest_free(&man);
        return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory building the manifest");
    }
    char path[4096];
    uint32_t written = 0;
    for (uint32_t p = 0; p < n_parts && !err; p++) {
        if (!gguf_split_path(path, sizeof(path), prefix, p, n_parts)) {
            err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "prefix too long");
            break;
        }
        if ((err = write_part(src, part_of, p, n_parts, model_sha256 ? &man : NULL, path, msg, cap)) == KVS_OK) written++;
    }
    manifest_free(&man);
    if (err) /* leave no partial set behind */
        for (uint32_t p = 0; p < written; p++)
            if (gguf_split_path(path, sizeof(path), prefix, p, n_parts)) unlink(path);
    return err;
}

int gguf_manifest_digest(const char *path, uint8_t out[32]) {
    char prefix[4096];
    if (gguf_split_first_part(path, prefix, sizeof(prefix)) < 2) return KVS_ERR_NOT_FOUND;
    gguf_ctx *g = NULL;
    int err = gguf_open_header(path, &g, NULL, 0);
    if (err) return err;
    uint32_t version = 0;
    gguf_str hex;
    int vr = gguf_get_u32(g, GGUF_MANIFEST_VERSION, &version);
    if (vr == KVS_ERR_NOT_FOUND) err = KVS_ERR_NOT_FOUND;
    else if (vr || version != 1 || gguf_get_str(g, GGUF_MANIFEST_MODEL_SHA256, &hex) || !parse_sha256_hex(hex, out))
        err = KVS_ERR_FORMAT;
    gguf_close(g);
    return err;
}
