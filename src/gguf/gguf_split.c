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
 *     and stays mapped until gguf_set_close.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "util.h"

struct gguf_set {
    uint32_t n_parts;
    gguf_ctx **parts; /* [n_parts] */
};

bool gguf_split_path(char *buf, size_t cap, const char *prefix, uint32_t i, uint32_t n) {
    int len = snprintf(buf, cap, "%s-%05" PRIu32 "-of-%05" PRIu32 ".gguf", prefix, i + 1, n);
    return len > 0 && (size_t)len < cap;
}

void gguf_set_close(gguf_set *set) {
    if (!set) return;
    for (uint32_t i = 0; i < set->n_parts; i++) gguf_close(set->parts[i]);
    free(set->parts);
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

static int open_parts(gguf_set *set, const char *path, uint32_t n, char *msg, size_t cap) {
    char prefix[4096], part_path[4096 + 32];
    if (!first_part_prefix(path, n, prefix, sizeof(prefix)))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT,
                        "%s: split.count is %" PRIu32 " but the name does not end in -00001-of-%05" PRIu32
                        ".gguf (pass the first part; the others are found by name)",
                        path, n, n);
    set->parts = calloc(n, sizeof(gguf_ctx *));
    if (!set->parts) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    set->n_parts = n;
    uint32_t total = 0;
    uint64_t sum = 0;
    int err;
    for (uint32_t i = 0; i < n; i++) {
        if (!gguf_split_path(part_path, sizeof(part_path), prefix, i, n))
            return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "%s: path too long", path);
        if ((err = gguf_open_header(part_path, &set->parts[i], msg, cap))) return err;
        const gguf_ctx *g = set->parts[i];
        uint32_t no, count, tensors;
        if ((err = split_key(g, part_path, "split.no", &no, msg, cap)) ||
            (err = split_key(g, part_path, "split.count", &count, msg, cap)) ||
            (err = split_key(g, part_path, "split.tensors.count", &tensors, msg, cap)))
            return err;
        if (no != i || count != n)
            return kvs_fail(msg, cap, KVS_ERR_FORMAT,
                            "%s: split.no %" PRIu32 " / split.count %" PRIu32 ", expected %" PRIu32 " / %" PRIu32,
                            part_path, no, count, i, n);
        if (i == 0) total = tensors;
        else if (tensors != total)
            return kvs_fail(msg, cap, KVS_ERR_FORMAT,
                            "%s: split.tensors.count %" PRIu32 " but the first part says %" PRIu32, part_path, tensors,
                            total);
        for (uint64_t t = 0; t < gguf_n_tensors(g); t++) {
            const gguf_tensor *ti = gguf_tensor_at(g, t);
            char name[GGUF_MAX_NAME_LEN + 1];
            snprintf(name, sizeof(name), "%.*s", (int)ti->name.len, ti->name.ptr);
            for (uint32_t k = 0; k < i; k++)
                if (gguf_find_tensor(set->parts[k], name))
                    return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor '%s' is in parts %" PRIu32 " and %" PRIu32, name,
                                    k + 1, i + 1);
        }
        sum += gguf_n_tensors(g);
    }
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

const gguf_tensor *gguf_set_find_tensor(const gguf_set *set, const char *name, uint32_t *part) {
    for (uint32_t i = 0; i < set->n_parts; i++) {
        const gguf_tensor *t = gguf_find_tensor(set->parts[i], name);
        if (t) {
            if (part) *part = i;
            return t;
        }
    }
    return NULL;
}

int gguf_set_map_tensor(gguf_set *set, const char *name, const gguf_tensor **out, char *msg, size_t cap) {
    uint32_t part = 0;
    *out = NULL;
    const gguf_tensor *t = gguf_set_find_tensor(set, name, &part);
    if (!t) return KVS_ERR_NOT_FOUND;
    int err = gguf_map_data(set->parts[part], msg, cap);
    if (err) return err;
    *out = t;
    return KVS_OK;
}

uint64_t gguf_set_mapped_data_bytes(const gguf_set *set) {
    uint64_t sum = 0;
    for (uint32_t i = 0; i < set->n_parts; i++) sum += gguf_mapped_data_bytes(set->parts[i]);
    return sum;
}

/* ------------------------------------------------------------------ writer */

static bool is_split_key(gguf_str key) {
    return gguf_str_eq(key, "split.no") || gguf_str_eq(key, "split.count") || gguf_str_eq(key, "split.tensors.count");
}

/* Writes part p: its metadata, then the tensors with part_of[i] == p. */
static int write_part(const gguf_ctx *src, const uint32_t *part_of, uint32_t p, uint32_t n_parts, const char *path,
                      char *msg, size_t cap) {
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
    char path[4096];
    uint32_t written = 0;
    for (uint32_t p = 0; p < n_parts && !err; p++) {
        if (!gguf_split_path(path, sizeof(path), prefix, p, n_parts)) {
            err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "prefix too long");
            break;
        }
        if ((err = write_part(src, part_of, p, n_parts, path, msg, cap)) == KVS_OK) written++;
    }
    if (err) /* leave no partial set behind */
        for (uint32_t p = 0; p < written; p++)
            if (gguf_split_path(path, sizeof(path), prefix, p, n_parts)) unlink(path);
    return err;
}
