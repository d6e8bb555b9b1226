/*
 * gguf — reader and writer. See gguf.h for the checks the reader makes.
 *
 * Reader design: one pass over the bytes with a bounds-checked cursor
 * (rd_*); every read states what it is reading so that a refusal can say
 * where the file went wrong. Metadata entries and tensor infos go into
 * arrays owned by the context, plus an open-addressing hash index for
 * duplicate detection and find_* lookups. Nothing is copied out of the
 * mapping: gguf_str and data pointers point into it.
 *
 * Writer design: metadata values are encoded to their little-endian bytes
 * when set (so writing is a byte copy); the header + metadata + tensor table
 * is assembled in one buffer at write time, when the alignment and thus the
 * tensor offsets are final.
 */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "quant.h"
#include "util.h"

#define GGUF_MAGIC "GGUF"

/* ------------------------------------------------------------------------ */
/* hash index over (ptr, len) names                                          */

typedef struct {
    uint32_t *slots; /* 0 = empty, else entry index + 1 */
    uint64_t mask;   /* capacity - 1 (capacity a power of two) */
} name_index;

static uint64_t hash_bytes(const char *p, uint64_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (uint64_t i = 0; i < n; i++) {
        h ^= (uint8_t)p[i];
        h *= 1099511628211ull;
    }
    return h;
}

static bool index_init(name_index *ix, uint64_t n) {
    uint64_t cap = 8;
    while (cap < 2 * n) cap *= 2;
    ix->slots = calloc(cap, sizeof(uint32_t));
    ix->mask = cap - 1;
    return ix->slots != NULL;
}

static bool str_eq_n(gguf_str a, const char *p, uint64_t n) {
    return a.len == n && (n == 0 || memcmp(a.ptr, p, n) == 0);
}

/* Looks up name among names[] (via stride-accessed gguf_str at name_of(i));
 * returns the entry index or -1. */
typedef gguf_str (*name_of_fn)(const void *entries, uint32_t i);

static int64_t index_find(const name_index *ix, const void *entries, name_of_fn name_of,
                          const char *p, uint64_t n) {
    if (!ix->slots) return -1;
    for (uint64_t s = hash_bytes(p, n) & ix->mask;; s = (s + 1) & ix->mask) {
        uint32_t v = ix->slots[s];
        if (v == 0) return -1;
        if (str_eq_n(name_of(entries, v - 1), p, n)) return (int64_t)(v - 1);
    }
}

/* Inserts entry i; false if an entry with the same name is already there. */
static bool index_insert(name_index *ix, const void *entries, name_of_fn name_of, uint32_t i) {
    gguf_str nm = name_of(entries, i);
    for (uint64_t s = hash_bytes(nm.ptr, nm.len) & ix->mask;; s = (s + 1) & ix->mask) {
        uint32_t v = ix->slots[s];
        if (v == 0) {
            ix->slots[s] = i + 1;
            return true;
        }
        if (str_eq_n(name_of(entries, v - 1), nm.ptr, nm.len)) return false;
    }
}

static gguf_str kv_name_of(const void *entries, uint32_t i) { return ((const gguf_kv *)entries)[i].key; }
static gguf_str tensor_name_of(const void *entries, uint32_t i) {
    return ((const gguf_tensor *)entries)[i].name;
}

/* ------------------------------------------------------------------------ */
/* reader                                                                    */

struct gguf_ctx {
    const uint8_t *base; /* mapping or caller buffer; header-only: a malloc'd copy of [0, data_offset) */
    uint64_t size;       /* bytes of the file (header-only: base holds fewer) */
    bool mapped;         /* base came from mmap (unmap on close) */
    bool header_only;    /* opened by gguf_open_header: base is owned heap memory */
    int fd;              /* header-only until gguf_map_data: the open file, else -1 */
    void *data_map;      /* header-only after gguf_map_data: mapping of the data section */
    size_t data_map_len; /* bytes of data_map */
    uint32_t version;
    uint64_t alignment;   /* bytes, power of two */
    uint64_t data_offset; /* file offset of the data section */
    uint64_t n_kv;
    gguf_kv *kvs;       /* [n_kv] */
    uint64_t n_tensors;
    gguf_tensor *tensors; /* [n_tensors] */
    name_index kv_ix, tensor_ix;
};

typedef struct {
    const uint8_t *p;
    uint64_t size;
    uint64_t pos;
    char *msg;
    size_t cap;
} cursor;

static uint64_t left(const cursor *c) { return c->size - c->pos; }

/* Reads n raw bytes (returns a pointer to them) or fails naming what. */
static int rd_bytes(cursor *c, uint64_t n, const void **out, const char *what) {
    if (n > left(c))
        return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                        "%s at offset %" PRIu64 ": needs %" PRIu64 " bytes, only %" PRIu64
                        " left (file size %" PRIu64 ")",
                        what, c->pos, n, left(c), c->size);
    *out = c->p + c->pos;
    c->pos += n;
    return KVS_OK;
}

static int rd_u32(cursor *c, uint32_t *v, const char *what) {
    const void *b = NULL;
    int rc = rd_bytes(c, 4, &b, what);
    if (rc == KVS_OK) *v = kvs_rd_u32(b);
    return rc;
}

static int rd_u64(cursor *c, uint64_t *v, const char *what) {
    const void *b = NULL;
    int rc = rd_bytes(c, 8, &b, what);
    if (rc == KVS_OK) *v = kvs_rd_u64(b);
    return rc;
}

/* u64 length + bytes, length capped at max_len. */
static int rd_str(cursor *c, gguf_str *s, uint64_t max_len, const char *what) {
    uint64_t len;
    const void *b = NULL;
    uint64_t at = c->pos;
    int rc = rd_u64(c, &len, what);
    if (rc) return rc;
    if (len > max_len)
        return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                        "%s at offset %" PRIu64 ": length %" PRIu64 " exceeds the limit %" PRIu64,
                        what, at, len, max_len);
    rc = rd_bytes(c, len, &b, what);
    if (rc) return rc;
    s->ptr = (const char *)b;
    s->len = len;
    return KVS_OK;
}

size_t gguf_vtype_size(enum gguf_vtype t) {
    switch (t) {
    case GGUF_VT_U8: case GGUF_VT_I8: case GGUF_VT_BOOL: return 1;
    case GGUF_VT_U16: case GGUF_VT_I16: return 2;
    case GGUF_VT_U32: case GGUF_VT_I32: case GGUF_VT_F32: return 4;
    case GGUF_VT_U64: case GGUF_VT_I64: case GGUF_VT_F64: return 8;
    case GGUF_VT_STRING: case GGUF_VT_ARRAY: return 0;
    }
    return 0;
}

const char *gguf_vtype_name(enum gguf_vtype t) {
    switch (t) {
    case GGUF_VT_U8: return "u8";
    case GGUF_VT_I8: return "i8";
    case GGUF_VT_U16: return "u16";
    case GGUF_VT_I16: return "i16";
    case GGUF_VT_U32: return "u32";
    case GGUF_VT_I32: return "i32";
    case GGUF_VT_F32: return "f32";
    case GGUF_VT_BOOL: return "bool";
    case GGUF_VT_STRING: return "string";
    case GGUF_VT_ARRAY: return "array";
    case GGUF_VT_U64: return "u64";
    case GGUF_VT_I64: return "i64";
    case GGUF_VT_F64: return "f64";
    }
    return "?";
}

static bool vtype_known(uint32_t t) { return t <= GGUF_VT_F64; }

/* Decodes one numeric/bool element at b into kv->val. */
static int decode_scalar(cursor *c, gguf_kv *kv, const uint8_t *b) {
    switch (kv->type) {
    case GGUF_VT_U8: kv->val.u = b[0]; break;
    case GGUF_VT_I8: kv->val.i = (int8_t)b[0]; break;
    case GGUF_VT_U16: kv->val.u = kvs_rd_u16(b); break;
    case GGUF_VT_I16: kv->val.i = (int16_t)kvs_rd_u16(b); break;
    case GGUF_VT_U32: kv->val.u = kvs_rd_u32(b); break;
    case GGUF_VT_I32: kv->val.i = (int32_t)kvs_rd_u32(b); break;
    case GGUF_VT_F32: kv->val.f = kvs_rd_f32(b); break;
    case GGUF_VT_U64: kv->val.u = kvs_rd_u64(b); break;
    case GGUF_VT_I64: kv->val.i = (int64_t)kvs_rd_u64(b); break;
    case GGUF_VT_F64: kv->val.f = kvs_rd_f64(b); break;
    case GGUF_VT_BOOL:
        if (b[0] > 1)
            return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT, "key '%.*s': bool value %u is not 0 or 1",
                            (int)kv->key.len, kv->key.ptr, b[0]);
        kv->val.b = b[0] != 0;
        break;
    case GGUF_VT_STRING: case GGUF_VT_ARRAY: KVS_ASSERT(0);
    }
    return KVS_OK;
}

static int parse_array(cursor *c, gguf_kv *kv) {
    uint32_t et;
    uint64_t n;
    int rc;
    char what[96];
    snprintf(what, sizeof what, "key '%.*s': array header", (int)(kv->key.len > 64 ? 64 : kv->key.len),
             kv->key.ptr);
    if ((rc = rd_u32(c, &et, what)) || (rc = rd_u64(c, &n, what))) return rc;
    if (et == GGUF_VT_ARRAY)
        return kvs_fail(c->msg, c->cap, KVS_ERR_UNSUPPORTED,
                        "key '%.*s': arrays of arrays are not supported", (int)kv->key.len,
                        kv->key.ptr);
    if (!vtype_known(et))
        return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT, "key '%.*s': unknown array element type %u",
                        (int)kv->key.len, kv->key.ptr, et);
    kv->arr_type = (enum gguf_vtype)et;
    kv->arr_n = n;
    kv->arr_data = c->p + c->pos;
    if (et == GGUF_VT_STRING) {
        /* each element is at least its 8-byte length */
        if (n > left(c) / 8)
            return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                            "key '%.*s': string array count %" PRIu64
                            " cannot fit in the %" PRIu64 " bytes left",
                            (int)kv->key.len, kv->key.ptr, n, left(c));
        gguf_str *strs = NULL;
        if (n > 0) {
            strs = calloc(n, sizeof *strs);
            if (!strs) return kvs_fail(c->msg, c->cap, KVS_ERR_NOMEM, "out of memory");
        }
        kv->arr_strs = strs;
        snprintf(what, sizeof what, "key '%.*s': string array element",
                 (int)(kv->key.len > 64 ? 64 : kv->key.len), kv->key.ptr);
        for (uint64_t i = 0; i < n; i++)
            if ((rc = rd_str(c, &strs[i], UINT64_MAX, what))) return rc;
        return KVS_OK;
    }
    uint64_t es = gguf_vtype_size(kv->arr_type), bytes;
    if (!kvs_mul_u64(es, n, &bytes) || bytes > left(c))
        return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                        "key '%.*s': array of %" PRIu64 " x %s (%" PRIu64
                        " bytes each) does not fit in the %" PRIu64 " bytes left",
                        (int)kv->key.len, kv->key.ptr, n, gguf_vtype_name(kv->arr_type), es, left(c));
    const uint8_t *b = c->p + c->pos;
    if (kv->arr_type == GGUF_VT_BOOL)
        for (uint64_t i = 0; i < n; i++)
            if (b[i] > 1)
                return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                                "key '%.*s': bool array element %" PRIu64 " is %u, not 0 or 1",
                                (int)kv->key.len, kv->key.ptr, i, b[i]);
    c->pos += bytes;
    return KVS_OK;
}

static int parse_kv(cursor *c, gguf_kv *kv, uint64_t idx) {
    char what[64];
    int rc;
    uint32_t t;
    snprintf(what, sizeof what, "metadata entry %" PRIu64 " key", idx);
    if ((rc = rd_str(c, &kv->key, GGUF_MAX_KEY_LEN, what))) return rc;
    if (kv->key.len == 0)
        return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT, "metadata entry %" PRIu64 ": empty key", idx);
    snprintf(what, sizeof what, "metadata entry %" PRIu64 " type", idx);
    if ((rc = rd_u32(c, &t, what))) return rc;
    if (!vtype_known(t))
        return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT, "key '%.*s': unknown value type %u",
                        (int)kv->key.len, kv->key.ptr, t);
    kv->type = (enum gguf_vtype)t;
    if (t == GGUF_VT_ARRAY) return parse_array(c, kv);
    if (t == GGUF_VT_STRING) {
        char w2[96];
        snprintf(w2, sizeof w2, "key '%.*s': string value", (int)(kv->key.len > 64 ? 64 : kv->key.len),
                 kv->key.ptr);
        return rd_str(c, &kv->str, UINT64_MAX, w2);
    }
    const void *b = NULL;
    snprintf(what, sizeof what, "metadata entry %" PRIu64 " value", idx);
    if ((rc = rd_bytes(c, gguf_vtype_size(kv->type), &b, what))) return rc;
    return decode_scalar(c, kv, b);
}

static int parse_tensor_info(cursor *c, gguf_tensor *t, uint64_t idx) {
    char what[64];
    int rc;
    snprintf(what, sizeof what, "tensor info %" PRIu64 " name", idx);
    if ((rc = rd_str(c, &t->name, GGUF_MAX_NAME_LEN, what))) return rc;
    if (t->name.len == 0)
        return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT, "tensor info %" PRIu64 ": empty name", idx);
    int nl = (int)t->name.len;
    const char *np = t->name.ptr;
    snprintf(what, sizeof what, "tensor info %" PRIu64 " fields", idx);
    if ((rc = rd_u32(c, &t->n_dims, what))) return rc;
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT, "tensor '%.*s': n_dims %u is not in 1..%d", nl,
                        np, t->n_dims, GGUF_MAX_DIMS);
    uint64_t n_elems = 1;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        if ((rc = rd_u64(c, &t->ne[d], what))) return rc;
        if (t->ne[d] == 0 || t->ne[d] > (uint64_t)INT64_MAX)
            return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT, "tensor '%.*s': ne[%u] = %" PRIu64 " is invalid",
                            nl, np, d, t->ne[d]);
        if (!kvs_mul_u64(n_elems, t->ne[d], &n_elems) || n_elems > (uint64_t)INT64_MAX)
            return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                            "tensor '%.*s': element count overflows at ne[%u] = %" PRIu64, nl, np, d,
                            t->ne[d]);
    }
    if ((rc = rd_u32(c, &t->type, what)) || (rc = rd_u64(c, &t->offset, what))) return rc;
    const quant_traits *tr = quant_get_traits(t->type);
    if (!tr)
        return kvs_fail(c->msg, c->cap, KVS_ERR_UNSUPPORTED, "tensor '%.*s': unknown tensor type id %u",
                        nl, np, t->type);
    if (t->ne[0] % tr->block_elems != 0)
        return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                        "tensor '%.*s': row length %" PRIu64 " is not a multiple of the %s block size %u",
                        nl, np, t->ne[0], tr->name, tr->block_elems);
    uint64_t row_bytes;
    if (!quant_row_bytes(t->type, t->ne[0], &row_bytes) ||
        !kvs_mul_u64(row_bytes, n_elems / t->ne[0], &t->size))
        return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT, "tensor '%.*s': byte size overflows", nl, np);
    return KVS_OK;
}

static int cmp_tensor_offset(const void *a, const void *b) {
    const gguf_tensor *x = *(const gguf_tensor *const *)a, *y = *(const gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Checks alignment, ranges and overlaps of all tensors; sets data pointers. */
static int check_tensor_data(gguf_ctx *g, cursor *c) {
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        gguf_tensor *t = &g->tensors[i];
        int nl = (int)t->name.len;
        if (t->offset % g->alignment != 0)
            return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                            "tensor '%.*s': offset %" PRIu64 " is not a multiple of the alignment %" PRIu64,
                            nl, t->name.ptr, t->offset, g->alignment);
        uint64_t start = 0, end = 0;
        if (!kvs_add_u64(g->data_offset, t->offset, &start) || !kvs_add_u64(start, t->size, &end))
            return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                            "tensor '%.*s': offset %" PRIu64 " + size %" PRIu64 " overflows", nl,
                            t->name.ptr, t->offset, t->size);
        if (end > g->size)
            return kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                            "tensor '%.*s': data [%" PRIu64 ", %" PRIu64 ") past end of file (size %" PRIu64 ")",
                            nl, t->name.ptr, start, end, g->size);
        t->data = g->base + start;
    }
    if (g->n_tensors < 2) return KVS_OK;
    const gguf_tensor **order = malloc(g->n_tensors * sizeof *order);
    if (!order) return kvs_fail(c->msg, c->cap, KVS_ERR_NOMEM, "out of memory");
    for (uint64_t i = 0; i < g->n_tensors; i++) order[i] = &g->tensors[i];
    qsort(order, g->n_tensors, sizeof *order, cmp_tensor_offset);
    int rc = KVS_OK;
    for (uint64_t i = 1; i < g->n_tensors; i++) {
        const gguf_tensor *a = order[i - 1], *b = order[i];
        if (a->offset + a->size > b->offset) { /* no overflow: both ranges are inside the file */
            rc = kvs_fail(c->msg, c->cap, KVS_ERR_FORMAT,
                          "tensors '%.*s' and '%.*s': data ranges overlap", (int)a->name.len,
                          a->name.ptr, (int)b->name.len, b->name.ptr);
            break;
        }
    }
    free(order);
    return rc;
}

static int parse(gguf_ctx *g, char *msg, size_t cap) {
    cursor c = {g->base, g->size, 0, msg, cap};
    int rc;
    if (g->size < 4 || memcmp(g->base, GGUF_MAGIC, 4) != 0)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "not a GGUF file (bad magic)");
    c.pos = 4;
    if ((rc = rd_u32(&c, &g->version, "header version"))) return rc;
    if (g->version == 1)
        return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED,
                        "GGUF version 1 is not supported (re-convert the model with a newer llama.cpp)");
    if (g->version != 2 && g->version != 3) {
        uint32_t sw = __builtin_bswap32(g->version);
        if (sw >= 1 && sw <= 3)
            return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED,
                            "big-endian GGUF (version %u byte-swapped) is not supported", sw);
        return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED, "GGUF version %u is not supported (need 2 or 3)",
                        g->version);
    }
    uint64_t n_tensors, n_kv;
    if ((rc = rd_u64(&c, &n_tensors, "header tensor count")) || (rc = rd_u64(&c, &n_kv, "header kv count")))
        return rc;
    /* minimal encodings: kv = key len 8 + 1 key byte + type 4 + 1 value byte;
     * tensor = name len 8 + 1 name byte + n_dims 4 + ne 8 + type 4 + offset 8 */
    if (n_kv > GGUF_MAX_KV || n_kv > left(&c) / 14)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT,
                        "metadata count %" PRIu64 " is absurd (limit %u, %" PRIu64 " bytes left)", n_kv,
                        GGUF_MAX_KV, left(&c));
    if (n_tensors > GGUF_MAX_TENSORS || n_tensors > left(&c) / 33)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT,
                        "tensor count %" PRIu64 " is absurd (limit %u, %" PRIu64 " bytes left)", n_tensors,
                        GGUF_MAX_TENSORS, left(&c));
    if (n_kv > 0 && !(g->kvs = calloc(n_kv, sizeof *g->kvs)))
        return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    if (!index_init(&g->kv_ix, n_kv)) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    for (uint64_t i = 0; i < n_kv; i++) {
        g->n_kv = i + 1; /* so that close frees this entry's string table */
        if ((rc = parse_kv(&c, &g->kvs[i], i))) return rc;
        if (!index_insert(&g->kv_ix, g->kvs, kv_name_of, (uint32_t)i))
            return kvs_fail(msg, cap, KVS_ERR_FORMAT, "duplicate metadata key '%.*s'",
                            (int)g->kvs[i].key.len, g->kvs[i].key.ptr);
    }
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t ai = index_find(&g->kv_ix, g->kvs, kv_name_of, "general.alignment", 17);
    if (ai >= 0) {
        const gguf_kv *kv = &g->kvs[ai];
        if (kv->type != GGUF_VT_U32)
            return kvs_fail(msg, cap, KVS_ERR_FORMAT, "general.alignment has type %s, expected u32",
                            gguf_vtype_name(kv->type));
        if (kv->val.u == 0 || (kv->val.u & (kv->val.u - 1)) != 0)
            return kvs_fail(msg, cap, KVS_ERR_FORMAT,
                            "general.alignment %" PRIu64 " is not a nonzero power of two", kv->val.u);
        g->alignment = kv->val.u;
    }
    if (n_tensors > 0 && !(g->tensors = calloc(n_tensors, sizeof *g->tensors)))
        return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    if (!index_init(&g->tensor_ix, n_tensors)) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    g->n_tensors = n_tensors;
    for (uint64_t i = 0; i < n_tensors; i++) {
        if ((rc = parse_tensor_info(&c, &g->tensors[i], i))) return rc;
        if (!index_insert(&g->tensor_ix, g->tensors, tensor_name_of, (uint32_t)i))
            return kvs_fail(msg, cap, KVS_ERR_FORMAT, "duplicate tensor name '%.*s'",
                            (int)g->tensors[i].name.len, g->tensors[i].name.ptr);
    }
    /* the data section starts at the next multiple of the alignment (no overflow:
     * pos <= size <= SIZE_MAX and alignment <= 2^31) */
    g->data_offset = (c.pos + g->alignment - 1) / g->alignment * g->alignment;
    return check_tensor_data(g, &c);
}

static void ctx_free(gguf_ctx *g) {
    if (!g) return;
    for (uint64_t i = 0; i < g->n_kv; i++) free((void *)g->kvs[i].arr_strs);
    free(g->kvs);
    free(g->tensors);
    free(g->kv_ix.slots);
    free(g->tensor_ix.slots);
    if (g->mapped && g->size > 0) munmap((void *)g->base, (size_t)g->size);
    if (g->header_only) free((void *)g->base);
    if (g->data_map) munmap(g->data_map, g->data_map_len);
    if (g->fd >= 0) close(g->fd);
    free(g);
}

int gguf_open_buffer(const void *data, size_t size, gguf_ctx **out, char *msg, size_t msg_cap) {
    if (!out) return KVS_ERR_INVALID_ARG;
    *out = NULL;
    if (!data && size > 0) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "NULL buffer");
    gguf_ctx *g = calloc(1, sizeof *g);
    if (!g) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    g->fd = -1;
    g->base = data;
    g->size = size;
    int rc = parse(g, msg, msg_cap);
    if (rc) {
        ctx_free(g);
        return rc;
    }
    *out = g;
    return KVS_OK;
}

/* Opens path and maps the whole file read-only (the descriptor is closed: the
 * mapping keeps the file). */
static int map_file(const char *path, void **map_out, size_t *size_out, char *msg, size_t msg_cap) {
    /* O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; it is refused below. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return kvs_fail(msg, msg_cap, KVS_ERR_IO, "%s: %s", path, strerror(errno));
    struct stat st;
    int rc = KVS_OK;
    if (fstat(fd, &st) != 0) rc = kvs_fail(msg, msg_cap, KVS_ERR_IO, "%s: %s", path, strerror(errno));
    else if (!S_ISREG(st.st_mode)) rc = kvs_fail(msg, msg_cap, KVS_ERR_IO, "%s: not a regular file", path);
    else if (st.st_size < 24)
        rc = kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "%s: too small for a GGUF header (%lld bytes)", path,
                      (long long)st.st_size);
    else if ((uint64_t)st.st_size > SIZE_MAX) rc = kvs_fail(msg, msg_cap, KVS_ERR_TOO_LARGE, "%s: too large to map", path);
    if (rc) {
        close(fd);
        return rc;
    }
    size_t size = (size_t)st.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    int e = errno;
    if (map == MAP_FAILED) {
        close(fd);
        return kvs_fail(msg, msg_cap, KVS_ERR_IO, "%s: mmap: %s", path, strerror(e));
    }
    close(fd);
    *map_out = map;
    *size_out = size;
    return KVS_OK;
}

int gguf_open(const char *path, gguf_ctx **out, char *msg, size_t msg_cap) {
    if (!out || !path) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "NULL argument");
    *out = NULL;
    void *map = NULL;
    size_t size = 0;
    int rc = map_file(path, &map, &size, msg, msg_cap);
    if (rc) return rc;
    gguf_ctx *g = calloc(1, sizeof *g);
    if (!g) {
        munmap(map, size);
        return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    }
    g->fd = -1;
    g->base = map;
    g->size = size;
    g->mapped = true;
    char inner[KVS_MSG_MAX];
    inner[0] = '\0';
    rc = parse(g, inner, sizeof inner);
    if (rc) {
        ctx_free(g);
        return kvs_fail(msg, msg_cap, rc, "%s: %s", path, inner);
    }
    *out = g;
    return KVS_OK;
}

/* Moves a pointer into [old, old + n) to the same offset in neu. */
static const void *rebase(const void *p, const uint8_t *old, const uint8_t *neu) {
    return p ? neu + ((const uint8_t *)p - old) : NULL;
}

int gguf_open_header(const char *path, gguf_ctx **out, char *msg, size_t msg_cap) {
    if (!out || !path) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "NULL argument");
    *out = NULL;
    gguf_ctx *g = NULL;
    int fd = -1;
    int rc = gguf_open(path, &g, msg, msg_cap);
    if (rc) return rc;
    /* Reopen for gguf_map_data: the descriptor pins this very file. */
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    uint64_t keep = g->data_offset < g->size ? g->data_offset : g->size;
    uint8_t *copy = fd >= 0 ? malloc(keep ? (size_t)keep : 1) : NULL;
    if (!copy) {
        rc = fd < 0 ? kvs_fail(msg, msg_cap, KVS_ERR_IO, "%s: %s", path, strerror(errno))
                    : kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        if (fd >= 0) close(fd);
        gguf_close(g);
        return rc;
    }
    /* Everything the context hands out lies in the header: copy it and
     * point strings and names at the copy, then drop the mapping. */
    const uint8_t *old = g->base;
    memcpy(copy, old, (size_t)keep);
    for (uint64_t i = 0; i < g->n_kv; i++) {
        gguf_kv *kv = &g->kvs[i];
        kv->key.ptr = rebase(kv->key.ptr, old, copy);
        kv->str.ptr = rebase(kv->str.ptr, old, copy);
        kv->arr_data = rebase(kv->arr_data, old, copy);
        if (kv->arr_strs)
            for (uint64_t k = 0; k < kv->arr_n; k++) {
                gguf_str *sk = (gguf_str *)&kv->arr_strs[k];
                sk->ptr = rebase(sk->ptr, old, copy);
            }
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        g->tensors[i].name.ptr = rebase(g->tensors[i].name.ptr, old, copy);
        g->tensors[i].data = NULL;
    }
    munmap((void *)g->base, (size_t)g->size);
    g->base = copy;
    g->mapped = false;
    g->header_only = true;
    g->fd = fd;
    *out = g;
    return KVS_OK;
}

int gguf_map_data(gguf_ctx *g, char *msg, size_t msg_cap) {
    if (!g->header_only || g->data_map || g->fd < 0) return KVS_OK; /* data already reachable */
    if (g->data_offset >= g->size) { /* no data section: no tensors (the reader checked) */
        close(g->fd);
        g->fd = -1;
        return KVS_OK;
    }
    struct stat st;
    if (fstat(g->fd, &st) != 0 || (uint64_t)st.st_size != g->size)
        return kvs_fail(msg, msg_cap, KVS_ERR_IO, "the file changed size since its header was read");
    long page = sysconf(_SC_PAGESIZE);
    uint64_t pg = page > 0 ? (uint64_t)page : 4096;
    uint64_t start = g->data_offset / pg * pg;
    size_t len = (size_t)(g->size - start);
    void *map = mmap(NULL, len, PROT_READ, MAP_SHARED, g->fd, (off_t)start);
    if (map == MAP_FAILED) return kvs_fail(msg, msg_cap, KVS_ERR_IO, "mmap of the tensor data: %s", strerror(errno));
    const uint8_t *data = (const uint8_t *)map + (g->data_offset - start);
    for (uint64_t i = 0; i < g->n_tensors; i++) g->tensors[i].data = data + g->tensors[i].offset;
    g->data_map = map;
    g->data_map_len = len;
    close(g->fd);
    g->fd = -1;
    return KVS_OK;
}

uint64_t gguf_mapped_data_bytes(const gguf_ctx *g) {
    if (g->data_offset >= g->size) return 0;
    if (g->header_only && !g->data_map) return 0;
    return g->size - g->data_offset;
}

void gguf_close(gguf_ctx *ctx) { ctx_free(ctx); }

uint32_t gguf_version(const gguf_ctx *ctx) { return ctx->version; }
uint64_t gguf_alignment(const gguf_ctx *ctx) { return ctx->alignment; }
uint64_t gguf_file_size(const gguf_ctx *ctx) { return ctx->size; }
uint64_t gguf_data_offset(const gguf_ctx *ctx) { return ctx->data_offset; }
const void *gguf_base(const gguf_ctx *ctx) { return ctx->base; }
uint64_t gguf_n_kv(const gguf_ctx *ctx) { return ctx->n_kv; }
uint64_t gguf_n_tensors(const gguf_ctx *ctx) { return ctx->n_tensors; }

const gguf_kv *gguf_kv_at(const gguf_ctx *ctx, uint64_t i) { return i < ctx->n_kv ? &ctx->kvs[i] : NULL; }

const gguf_tensor *gguf_tensor_at(const gguf_ctx *ctx, uint64_t i) {
    return i < ctx->n_tensors ? &ctx->tensors[i] : NULL;
}

const gguf_kv *gguf_find_kv(const gguf_ctx *ctx, const char *key) {
    int64_t i = index_find(&ctx->kv_ix, ctx->kvs, kv_name_of, key, strlen(key));
    return i < 0 ? NULL : &ctx->kvs[i];
}

const gguf_tensor *gguf_find_tensor(const gguf_ctx *ctx, const char *name) {
    int64_t i = index_find(&ctx->tensor_ix, ctx->tensors, tensor_name_of, name, strlen(name));
    return i < 0 ? NULL : &ctx->tensors[i];
}

bool gguf_str_eq(gguf_str s, const char *cstr) { return str_eq_n(s, cstr, strlen(cstr)); }

static bool vtype_signed(enum gguf_vtype t) {
    return t == GGUF_VT_I8 || t == GGUF_VT_I16 || t == GGUF_VT_I32 || t == GGUF_VT_I64;
}
static bool vtype_unsigned(enum gguf_vtype t) {
    return t == GGUF_VT_U8 || t == GGUF_VT_U16 || t == GGUF_VT_U32 || t == GGUF_VT_U64;
}

/* Integer kv as u64 (fails for negative or non-integer). */
static int kv_uint(const gguf_ctx *ctx, const char *key, uint64_t *out) {
    const gguf_kv *kv = gguf_find_kv(ctx, key);
    if (!kv) return KVS_ERR_NOT_FOUND;
    if (vtype_unsigned(kv->type)) *out = kv->val.u;
    else if (vtype_signed(kv->type) && kv->val.i >= 0) *out = (uint64_t)kv->val.i;
    else return KVS_ERR_FORMAT;
    return KVS_OK;
}

int gguf_get_u64(const gguf_ctx *ctx, const char *key, uint64_t *out) { return kv_uint(ctx, key, out); }

int gguf_get_u32(const gguf_ctx *ctx, const char *key, uint32_t *out) {
    uint64_t v;
    int rc = kv_uint(ctx, key, &v);
    if (rc) return rc;
    if (v > UINT32_MAX) return KVS_ERR_FORMAT;
    *out = (uint32_t)v;
    return KVS_OK;
}

int gguf_get_f32(const gguf_ctx *ctx, const char *key, float *out) {
    const gguf_kv *kv = gguf_find_kv(ctx, key);
    if (!kv) return KVS_ERR_NOT_FOUND;
    if (kv->type != GGUF_VT_F32 && kv->type != GGUF_VT_F64) return KVS_ERR_FORMAT;
    *out = (float)kv->val.f;
    return KVS_OK;
}

int gguf_get_bool(const gguf_ctx *ctx, const char *key, bool *out) {
    const gguf_kv *kv = gguf_find_kv(ctx, key);
    if (!kv) return KVS_ERR_NOT_FOUND;
    if (kv->type != GGUF_VT_BOOL) return KVS_ERR_FORMAT;
    *out = kv->val.b;
    return KVS_OK;
}

int gguf_get_str(const gguf_ctx *ctx, const char *key, gguf_str *out) {
    const gguf_kv *kv = gguf_find_kv(ctx, key);
    if (!kv) return KVS_ERR_NOT_FOUND;
    if (kv->type != GGUF_VT_STRING) return KVS_ERR_FORMAT;
    *out = kv->str;
    return KVS_OK;
}

int64_t gguf_arr_i64(const gguf_kv *kv, uint64_t i) {
    if (!kv || kv->type != GGUF_VT_ARRAY || i >= kv->arr_n) return 0;
    const uint8_t *b = (const uint8_t *)kv->arr_data;
    switch (kv->arr_type) {
    case GGUF_VT_U8: case GGUF_VT_BOOL: return b[i];
    case GGUF_VT_I8: return (int8_t)b[i];
    case GGUF_VT_U16: return kvs_rd_u16(b + 2 * i);
    case GGUF_VT_I16: return (int16_t)kvs_rd_u16(b + 2 * i);
    case GGUF_VT_U32: return kvs_rd_u32(b + 4 * i);
    case GGUF_VT_I32: return (int32_t)kvs_rd_u32(b + 4 * i);
    case GGUF_VT_U64: case GGUF_VT_I64: return (int64_t)kvs_rd_u64(b + 8 * i);
    default: return 0;
    }
}

float gguf_arr_f32(const gguf_kv *kv, uint64_t i) {
    if (!kv || kv->type != GGUF_VT_ARRAY || i >= kv->arr_n) return 0.0f;
    const uint8_t *b = (const uint8_t *)kv->arr_data;
    switch (kv->arr_type) {
    case GGUF_VT_F32: return kvs_rd_f32(b + 4 * i);
    case GGUF_VT_F64: return (float)kvs_rd_f64(b + 8 * i);
    case GGUF_VT_U64: return (float)kvs_rd_u64(b + 8 * i);
    case GGUF_VT_STRING: case GGUF_VT_ARRAY: return 0.0f;
    default: return (float)gguf_arr_i64(kv, i);
    }
}

/* ------------------------------------------------------------------------ */
/* writer                                                                    */

typedef struct {
    uint8_t *p;
    size_t len, cap;
    bool oom;
} bytebuf;

static void bb_put(bytebuf *b, const void *src, size_t n) {
    if (b->oom) return;
    if (n > SIZE_MAX - b->len) {
        b->oom = true;
        return;
    }
    if (b->len + n > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->len + n) {
            if (nc > SIZE_MAX / 2) {
                nc = b->len + n;
                break;
            }
            nc *= 2;
        }
        uint8_t *np = realloc(b->p, nc);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = nc;
    }
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
}
static void bb_u32(bytebuf *b, uint32_t v) { uint8_t t[4]; kvs_wr_u32(t, v); bb_put(b, t, 4); }
static void bb_u64(bytebuf *b, uint64_t v) { uint8_t t[8]; kvs_wr_u64(t, v); bb_put(b, t, 8); }
static void bb_str(bytebuf *b, const char *s, uint64_t len) {
    bb_u64(b, len);
    bb_put(b, s, (size_t)len);
}

typedef struct {
    char *key;
    enum gguf_vtype type;
    uint8_t *val; /* encoded value bytes (everything after the type field) */
    size_t val_len;
} wkv;

typedef struct {
    char *name;
    uint32_t type, n_dims;
    uint64_t ne[GGUF_MAX_DIMS];
    uint64_t size; /* bytes */
    uint8_t *data; /* owned copy; NULL when declared for streaming */
} wtensor;

struct gguf_writer {
    wkv *kvs;
    size_t n_kv, cap_kv;
    wtensor *tensors;
    size_t n_tensors, cap_tensors;
    /* streaming state */
    FILE *f;
    char *path, *tmp_path;
    bool started, failed, finished;
    size_t cur;           /* tensor being written */
    uint64_t cur_written; /* bytes of it written so far */
    uint64_t alignment;
};

gguf_writer *gguf_writer_create(void) { return calloc(1, sizeof(gguf_writer)); }

static void abandon_stream(gguf_writer *w) {
    if (w->f) {
        fclose(w->f);
        w->f = NULL;
        if (w->tmp_path) unlink(w->tmp_path);
    }
    w->failed = true;
}

void gguf_writer_free(gguf_writer *w) {
    if (!w) return;
    if (w->f) abandon_stream(w);
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].val);
    }
    free(w->kvs);
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->tensors);
    free(w->path);
    free(w->tmp_path);
    free(w);
}

/* Stores key -> (type, encoded bytes of b); takes the buffer in all cases. */
static int set_encoded(gguf_writer *w, const char *key, enum gguf_vtype type, bytebuf *b) {
    if (b->oom) {
        free(b->p);
        return KVS_ERR_NOMEM;
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, key) == 0) {
            free(w->kvs[i].val);
            w->kvs[i].type = type;
            w->kvs[i].val = b->p;
            w->kvs[i].val_len = b->len;
            return KVS_OK;
        }
    }
    if (w->n_kv == w->cap_kv) {
        size_t nc = w->cap_kv ? 2 * w->cap_kv : 32;
        wkv *nk = realloc(w->kvs, nc * sizeof *nk);
        if (!nk) {
            free(b->p);
            return KVS_ERR_NOMEM;
        }
        w->kvs = nk;
        w->cap_kv = nc;
    }
    char *k = strdup(key);
    if (!k) {
        free(b->p);
        return KVS_ERR_NOMEM;
    }
    w->kvs[w->n_kv++] = (wkv){k, type, b->p, b->len};
    return KVS_OK;
}

static bool key_ok(const gguf_writer *w, const char *key) {
    return w && key && !w->started && key[0] != '\0' && strlen(key) <= GGUF_MAX_KEY_LEN;
}

/* Encodes one host-order element of numeric/bool type t. */
static void put_elem(bytebuf *b, enum gguf_vtype t, const void *v) {
    uint8_t tmp[8];
    switch (t) {
    case GGUF_VT_U8: case GGUF_VT_I8: memcpy(tmp, v, 1); break;
    case GGUF_VT_BOOL: tmp[0] = *(const bool *)v ? 1 : 0; break;
    case GGUF_VT_U16: case GGUF_VT_I16: { uint16_t x; memcpy(&x, v, 2); kvs_wr_u16(tmp, x); break; }
    case GGUF_VT_U32: case GGUF_VT_I32: case GGUF_VT_F32: { uint32_t x; memcpy(&x, v, 4); kvs_wr_u32(tmp, x); break; }
    case GGUF_VT_U64: case GGUF_VT_I64: case GGUF_VT_F64: { uint64_t x; memcpy(&x, v, 8); kvs_wr_u64(tmp, x); break; }
    case GGUF_VT_STRING: case GGUF_VT_ARRAY: KVS_ASSERT(0);
    }
    bb_put(b, tmp, gguf_vtype_size(t));
}

/* Host size of one element of numeric/bool type t (bool is a C bool). */
static size_t host_size(enum gguf_vtype t) { return t == GGUF_VT_BOOL ? sizeof(bool) : gguf_vtype_size(t); }

int gguf_writer_set_scalar(gguf_writer *w, const char *key, enum gguf_vtype t, const void *value) {
    if (!key_ok(w, key) || !value || !vtype_known(t) || t == GGUF_VT_STRING || t == GGUF_VT_ARRAY)
        return KVS_ERR_INVALID_ARG;
    bytebuf b = {0};
    put_elem(&b, t, value);
    return set_encoded(w, key, t, &b);
}

int gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v) { return gguf_writer_set_scalar(w, key, GGUF_VT_U32, &v); }
int gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v) { return gguf_writer_set_scalar(w, key, GGUF_VT_I32, &v); }
int gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v) { return gguf_writer_set_scalar(w, key, GGUF_VT_U64, &v); }
int gguf_writer_set_f32(gguf_writer *w, const char *key, float v) { return gguf_writer_set_scalar(w, key, GGUF_VT_F32, &v); }
int gguf_writer_set_bool(gguf_writer *w, const char *key, bool v) { return gguf_writer_set_scalar(w, key, GGUF_VT_BOOL, &v); }

int gguf_writer_set_strn(gguf_writer *w, const char *key, const char *v, uint64_t len) {
    if (!key_ok(w, key) || (!v && len > 0) || len > SIZE_MAX) return KVS_ERR_INVALID_ARG;
    bytebuf b = {0};
    bb_str(&b, v, len);
    return set_encoded(w, key, GGUF_VT_STRING, &b);
}

int gguf_writer_set_str(gguf_writer *w, const char *key, const char *v) {
    if (!v) return KVS_ERR_INVALID_ARG;
    return gguf_writer_set_strn(w, key, v, strlen(v));
}

int gguf_writer_set_arr(gguf_writer *w, const char *key, enum gguf_vtype elem, const void *data, uint64_t n) {
    if (!key_ok(w, key) || (!data && n > 0) || !vtype_known(elem) || elem == GGUF_VT_ARRAY)
        return KVS_ERR_INVALID_ARG;
    bytebuf b = {0};
    bb_u32(&b, (uint32_t)elem);
    bb_u64(&b, n);
    if (elem == GGUF_VT_STRING) {
        const char *const *strs = data;
        for (uint64_t i = 0; i < n; i++) {
            if (!strs[i]) {
                free(b.p);
                return KVS_ERR_INVALID_ARG;
            }
            bb_str(&b, strs[i], strlen(strs[i]));
        }
    } else {
        size_t hs = host_size(elem);
        for (uint64_t i = 0; i < n && !b.oom; i++) put_elem(&b, elem, (const uint8_t *)data + i * hs);
    }
    return set_encoded(w, key, GGUF_VT_ARRAY, &b);
}

int gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *v, uint64_t n) {
    return gguf_writer_set_arr(w, key, GGUF_VT_STRING, v, n);
}
int gguf_writer_set_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n) {
    return gguf_writer_set_arr(w, key, GGUF_VT_F32, v, n);
}
int gguf_writer_set_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n) {
    return gguf_writer_set_arr(w, key, GGUF_VT_I32, v, n);
}

int gguf_writer_copy_kv(gguf_writer *w, const gguf_kv *kv) {
    if (!w || !kv || kv->key.len == 0 || kv->key.len > GGUF_MAX_KEY_LEN || memchr(kv->key.ptr, 0, kv->key.len))
        return KVS_ERR_INVALID_ARG;
    char *key = malloc(kv->key.len + 1);
    if (!key) return KVS_ERR_NOMEM;
    memcpy(key, kv->key.ptr, kv->key.len);
    key[kv->key.len] = '\0';
    bytebuf b = {0};
    if (kv->type == GGUF_VT_STRING) {
        bb_str(&b, kv->str.ptr, kv->str.len);
    } else if (kv->type == GGUF_VT_ARRAY) {
        /* The source bytes are already the little-endian encoding. */
        bb_u32(&b, (uint32_t)kv->arr_type);
        bb_u64(&b, kv->arr_n);
        if (kv->arr_type == GGUF_VT_STRING)
            for (uint64_t i = 0; i < kv->arr_n && !b.oom; i++) bb_str(&b, kv->arr_strs[i].ptr, kv->arr_strs[i].len);
        else
            bb_put(&b, kv->arr_data, (size_t)(gguf_vtype_size(kv->arr_type) * kv->arr_n));
    } else {
        uint8_t raw[8];
        switch (kv->type) {
        case GGUF_VT_F32: kvs_wr_f32(raw, (float)kv->val.f); break;
        case GGUF_VT_F64: { uint64_t u; memcpy(&u, &kv->val.f, 8); kvs_wr_u64(raw, u); break; }
        case GGUF_VT_BOOL: raw[0] = kv->val.b ? 1 : 0; break;
        default: kvs_wr_u64(raw, kv->val.u); break; /* integers: the low bytes, little-endian */
        }
        bb_put(&b, raw, gguf_vtype_size(kv->type));
    }
    int rc = key_ok(w, key) ? set_encoded(w, key, kv->type, &b) : (free(b.p), KVS_ERR_INVALID_ARG);
    free(key);
    return rc;
}

/* Validates and appends a tensor entry (data not yet attached). */
static int push_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims, const uint64_t *ne,
                       uint64_t *out_size) {
    if (!w || w->started || !name || !ne || name[0] == '\0' || strlen(name) > GGUF_MAX_NAME_LEN ||
        n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return KVS_ERR_INVALID_ARG;
    const quant_traits *tr = quant_get_traits(type);
    if (!tr) return KVS_ERR_INVALID_ARG;
    uint64_t rows = 1, row_bytes, size;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] == 0 || ne[d] > (uint64_t)INT64_MAX) return KVS_ERR_INVALID_ARG;
        if (d > 0 && !kvs_mul_u64(rows, ne[d], &rows)) return KVS_ERR_INVALID_ARG;
    }
    if (!quant_row_bytes(type, ne[0], &row_bytes) || !kvs_mul_u64(row_bytes, rows, &size) || size > SIZE_MAX)
        return KVS_ERR_INVALID_ARG;
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0) return KVS_ERR_INVALID_ARG;
    if (w->n_tensors == w->cap_tensors) {
        size_t nc = w->cap_tensors ? 2 * w->cap_tensors : 64;
        wtensor *nt = realloc(w->tensors, nc * sizeof *nt);
        if (!nt) return KVS_ERR_NOMEM;
        w->tensors = nt;
        w->cap_tensors = nc;
    }
    wtensor t = {0};
    if (!(t.name = strdup(name))) return KVS_ERR_NOMEM;
    t.type = type;
    t.n_dims = n_dims;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) t.ne[d] = d < n_dims ? ne[d] : 1;
    t.size = size;
    w->tensors[w->n_tensors++] = t;
    if (out_size) *out_size = size;
    return KVS_OK;
}

int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                           const uint64_t *ne, const void *data, uint64_t size) {
    uint64_t want;
    if (!data) return KVS_ERR_INVALID_ARG;
    int rc = push_tensor(w, name, type, n_dims, ne, &want);
    if (rc) return rc;
    wtensor *t = &w->tensors[w->n_tensors - 1];
    if (want != size || !(t->data = malloc((size_t)size))) {
        free(t->name);
        w->n_tensors--;
        return want != size ? KVS_ERR_INVALID_ARG : KVS_ERR_NOMEM;
    }
    memcpy(t->data, data, (size_t)size);
    return KVS_OK;
}

int gguf_writer_declare_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                               const uint64_t *ne, uint64_t *out_size) {
    return push_tensor(w, name, type, n_dims, ne, out_size);
}

/* Alignment from general.alignment (u32 power of two) or the default. */
static int writer_alignment(const gguf_writer *w, uint64_t *out, char *msg, size_t cap) {
    *out = GGUF_DEFAULT_ALIGNMENT;
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, "general.alignment") != 0) continue;
        uint32_t a = w->kvs[i].type == GGUF_VT_U32 ? kvs_rd_u32(w->kvs[i].val) : 0;
        if (a == 0 || (a & (a - 1)) != 0)
            return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "general.alignment must be a u32 power of two");
        *out = a;
    }
    return KVS_OK;
}

/* Encodes header + metadata + tensor table + padding into b. Tensor offsets
 * are derived here: each tensor starts at the previous end rounded up to align. */
static int encode_head(const gguf_writer *w, uint64_t align, bytebuf *b, char *msg, size_t cap) {
    bb_put(b, GGUF_MAGIC, 4);
    bb_u32(b, 3);
    bb_u64(b, w->n_tensors);
    bb_u64(b, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        bb_str(b, w->kvs[i].key, strlen(w->kvs[i].key));
        bb_u32(b, (uint32_t)w->kvs[i].type);
        bb_put(b, w->kvs[i].val, w->kvs[i].val_len);
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        bb_str(b, t->name, strlen(t->name));
        bb_u32(b, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) bb_u64(b, t->ne[d]);
        bb_u32(b, t->type);
        bb_u64(b, off);
        uint64_t padded = (t->size + align - 1) / align * align;
        if (!kvs_add_u64(off, padded, &off))
            return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "total tensor size overflows");
    }
    static const uint8_t zeros[256];
    size_t pad = (size_t)((align - b->len % align) % align);
    while (pad > 0) {
        size_t n = pad < sizeof zeros ? pad : sizeof zeros;
        bb_put(b, zeros, n);
        pad -= n;
    }
    if (b->oom) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory encoding the header");
    return KVS_OK;
}

static int write_bytes(FILE *f, const void *p, size_t n, const char *path, char *msg, size_t cap) {
    if (n > 0 && fwrite(p, 1, n, f) != n)
        return kvs_fail(msg, cap, KVS_ERR_IO, "%s: write failed: %s", path, strerror(errno));
    return KVS_OK;
}

static int write_zeros(FILE *f, uint64_t n, const char *path, char *msg, size_t cap) {
    static const uint8_t zeros[256];
    while (n > 0) {
        size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        int rc = write_bytes(f, zeros, k, path, msg, cap);
        if (rc) return rc;
        n -= k;
    }
    return KVS_OK;
}

static char *tmp_name(const char *path) {
    size_t n = strlen(path);
    char *t = malloc(n + 5);
    if (t) {
        memcpy(t, path, n);
        memcpy(t + n, ".tmp", 5);
    }
    return t;
}

/* Closes f and renames tmp to path; removes tmp on any failure. */
static int close_and_rename(FILE *f, const char *tmp, const char *path, char *msg, size_t cap) {
    int rc = KVS_OK;
    if (fflush(f) != 0) rc = kvs_fail(msg, cap, KVS_ERR_IO, "%s: write failed: %s", tmp, strerror(errno));
    if (fclose(f) != 0 && rc == KVS_OK)
        rc = kvs_fail(msg, cap, KVS_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
    if (rc == KVS_OK && rename(tmp, path) != 0)
        rc = kvs_fail(msg, cap, KVS_ERR_IO, "rename %s -> %s: %s", tmp, path, strerror(errno));
    if (rc) unlink(tmp);
    return rc;
}

static FILE *open_tmp(const char *tmp, char *msg, size_t cap, int *rc) {
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        *rc = kvs_fail(msg, cap, KVS_ERR_IO, "%s: %s", tmp, strerror(errno));
        return NULL;
    }
    setvbuf(f, NULL, _IOFBF, 1 << 20);
    *rc = KVS_OK;
    return f;
}

int gguf_writer_write(const gguf_writer *w, const char *path, char *msg, size_t msg_cap) {
    if (!w || !path || w->started) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "bad arguments");
    for (size_t i = 0; i < w->n_tensors; i++)
        if (!w->tensors[i].data)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                            "tensor '%s' was declared without data: use the streaming calls",
                            w->tensors[i].name);
    uint64_t align;
    int rc = writer_alignment(w, &align, msg, msg_cap);
    if (rc) return rc;
    bytebuf b = {0};
    char *tmp = NULL;
    FILE *f = NULL;
    if ((rc = encode_head(w, align, &b, msg, msg_cap))) goto out;
    if (!(tmp = tmp_name(path))) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (!(f = open_tmp(tmp, msg, msg_cap, &rc))) goto out;
    rc = write_bytes(f, b.p, b.len, tmp, msg, msg_cap);
    for (size_t i = 0; i < w->n_tensors && rc == KVS_OK; i++) {
        const wtensor *t = &w->tensors[i];
        rc = write_bytes(f, t->data, (size_t)t->size, tmp, msg, msg_cap);
        if (rc == KVS_OK) rc = write_zeros(f, (align - t->size % align) % align, tmp, msg, msg_cap);
    }
    if (rc) {
        fclose(f);
        unlink(tmp);
        goto out;
    }
    rc = close_and_rename(f, tmp, path, msg, msg_cap);
out:
    free(b.p);
    free(tmp);
    return rc;
}

int gguf_writer_begin(gguf_writer *w, const char *path, char *msg, size_t msg_cap) {
    if (!w || !path || w->started) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "bad arguments");
    for (size_t i = 0; i < w->n_tensors; i++)
        if (w->tensors[i].data)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                            "tensor '%s' was added with data: use gguf_writer_write", w->tensors[i].name);
    int rc = writer_alignment(w, &w->alignment, msg, msg_cap);
    if (rc) return rc;
    bytebuf b = {0};
    if ((rc = encode_head(w, w->alignment, &b, msg, msg_cap))) goto out;
    free(w->path); /* from an earlier failed begin */
    free(w->tmp_path);
    w->tmp_path = NULL;
    if (!(w->path = strdup(path)) || !(w->tmp_path = tmp_name(path))) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (!(w->f = open_tmp(w->tmp_path, msg, msg_cap, &rc))) goto out;
    w->started = true;
    w->cur = 0;
    w->cur_written = 0;
    if ((rc = write_bytes(w->f, b.p, b.len, w->tmp_path, msg, msg_cap))) abandon_stream(w);
out:
    free(b.p);
    return rc;
}

int gguf_writer_write_data(gguf_writer *w, const void *data, size_t n, char *msg, size_t msg_cap) {
    if (!w || !w->started || w->failed || w->finished || (!data && n > 0))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "not streaming (begin not called, or failed/finished)");
    const uint8_t *p = data;
    while (n > 0) {
        if (w->cur >= w->n_tensors) {
            abandon_stream(w);
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "more data than the declared tensors hold");
        }
        wtensor *t = &w->tensors[w->cur];
        uint64_t room = t->size - w->cur_written;
        size_t k = n < room ? n : (size_t)room;
        int rc = write_bytes(w->f, p, k, w->tmp_path, msg, msg_cap);
        if (rc) {
            abandon_stream(w);
            return rc;
        }
        p += k;
        n -= k;
        w->cur_written += k;
        if (w->cur_written == t->size) {
            rc = write_zeros(w->f, (w->alignment - t->size % w->alignment) % w->alignment, w->tmp_path, msg,
                             msg_cap);
            if (rc) {
                abandon_stream(w);
                return rc;
            }
            w->cur++;
            w->cur_written = 0;
        }
    }
    return KVS_OK;
}

int gguf_writer_finish(gguf_writer *w, char *msg, size_t msg_cap) {
    if (!w || !w->started || w->failed || w->finished)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "not streaming (begin not called, or failed/finished)");
    if (w->cur < w->n_tensors) {
        int rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                          "tensor '%s' incomplete: %" PRIu64 " of %" PRIu64 " bytes written",
                          w->tensors[w->cur].name, w->cur_written, w->tensors[w->cur].size);
        abandon_stream(w);
        return rc;
    }
    FILE *f = w->f;
    w->f = NULL;
    w->finished = true;
    return close_and_rename(f, w->tmp_path, w->path, msg, msg_cap);
}
