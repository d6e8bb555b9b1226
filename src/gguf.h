/*
 * gguf — GGUF v2/v3 reader (mmap, every count/length/offset checked) and writer.
 *
 * Reader: gguf_open() maps a file and validates the whole header, metadata and
 * tensor table before returning; anything inconsistent is refused with
 * KVS_ERR_FORMAT (or KVS_ERR_UNSUPPORTED for an unknown tensor type / version)
 * and a message naming the problem. After success every pointer the context
 * hands out (strings, array data, tensor data) stays valid until gguf_close().
 * Strings are NOT NUL-terminated: use gguf_str's len.
 * Knows nothing about models: no architecture checks here.
 */
#ifndef KVS_GGUF_H
#define KVS_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum gguf_vtype {
    GGUF_VT_U8 = 0, GGUF_VT_I8 = 1, GGUF_VT_U16 = 2, GGUF_VT_I16 = 3,
    GGUF_VT_U32 = 4, GGUF_VT_I32 = 5, GGUF_VT_F32 = 6, GGUF_VT_BOOL = 7,
    GGUF_VT_STRING = 8, GGUF_VT_ARRAY = 9, GGUF_VT_U64 = 10, GGUF_VT_I64 = 11,
    GGUF_VT_F64 = 12
};

#define GGUF_MAX_DIMS 4
#define GGUF_DEFAULT_ALIGNMENT 32

typedef struct {
    const char *ptr; /* into the mapping; not NUL-terminated */
    uint64_t len;
} gguf_str;

typedef struct gguf_ctx gguf_ctx;

typedef struct {
    gguf_str key;
    enum gguf_vtype type;
    /* scalars (type != STRING/ARRAY): value widened */
    union { uint64_t u; int64_t i; double f; bool b; } val;
    gguf_str str;               /* type == STRING */
    enum gguf_vtype arr_type;   /* type == ARRAY: element type (never ARRAY) */
    uint64_t arr_n;             /* type == ARRAY: element count */
    const void *arr_data;       /* numeric arrays: raw little-endian elements, maybe unaligned */
    const gguf_str *arr_strs;   /* string arrays: arr_n entries */
} gguf_kv;

typedef struct {
    gguf_str name;
    uint32_t n_dims;
    uint64_t ne[GGUF_MAX_DIMS]; /* ne[0] = row length (elements); unused dims = 1 */
    uint32_t type;              /* enum quant_type id */
    uint64_t offset;            /* relative to the data section */
    uint64_t size;              /* bytes */
    const void *data;           /* into the mapping */
} gguf_tensor;

/* Opens and validates a GGUF file (read-only mmap). On success *out owns the
 * mapping; on failure *out is NULL, msg (if non-NULL) says why. */
int gguf_open(const char *path, gguf_ctx **out, char *msg, size_t msg_cap);
/* Same over caller memory (not copied; must outlive the context). */
int gguf_open_buffer(const void *data, size_t size, gguf_ctx **out, char *msg, size_t msg_cap);
/* Unmaps and frees; NULL is fine. */
void gguf_close(gguf_ctx *ctx);

uint32_t gguf_version(const gguf_ctx *ctx);
uint64_t gguf_alignment(const gguf_ctx *ctx);
uint64_t gguf_file_size(const gguf_ctx *ctx);
uint64_t gguf_data_offset(const gguf_ctx *ctx); /* file offset of the data section */
const void *gguf_base(const gguf_ctx *ctx);     /* start of the mapping */

uint64_t gguf_n_kv(const gguf_ctx *ctx);
const gguf_kv *gguf_kv_at(const gguf_ctx *ctx, uint64_t i);
const gguf_kv *gguf_find_kv(const gguf_ctx *ctx, const char *key); /* NULL if absent */

/* Typed getters: KVS_ERR_NOT_FOUND when absent, KVS_ERR_FORMAT when of the wrong
 * type or out of range. Integer getters accept any integer type whose value fits. */
int gguf_get_u32(const gguf_ctx *ctx, const char *key, uint32_t *out);
int gguf_get_u64(const gguf_ctx *ctx, const char *key, uint64_t *out);
int gguf_get_f32(const gguf_ctx *ctx, const char *key, float *out); /* f32 or f64 */
int gguf_get_bool(const gguf_ctx *ctx, const char *key, bool *out);
int gguf_get_str(const gguf_ctx *ctx, const char *key, gguf_str *out);
/* Array element readers (index must be < arr_n; element type converted). */
float gguf_arr_f32(const gguf_kv *kv, uint64_t i);   /* f32/f64/integer arrays */
int64_t gguf_arr_i64(const gguf_kv *kv, uint64_t i); /* integer arrays */
bool gguf_str_eq(gguf_str s, const char *cstr);

uint64_t gguf_n_tensors(const gguf_ctx *ctx);
const gguf_tensor *gguf_tensor_at(const gguf_ctx *ctx, uint64_t i);
const gguf_tensor *gguf_find_tensor(const gguf_ctx *ctx, const char *name); /* NULL if absent */

const char *gguf_vtype_name(enum gguf_vtype t);

/* --- writer -------------------------------------------------------------- */
typedef struct gguf_writer gguf_writer;

/* New empty writer (GGUF v3, alignment 32); NULL on allocation failure. */
gguf_writer *gguf_writer_create(void);
void gguf_writer_free(gguf_writer *w);
/* Metadata setters copy key and value. Return KVS_OK or KVS_ERR_NOMEM. */
int gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v);
int gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v);
int gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v);
int gguf_writer_set_f32(gguf_writer *w, const char *key, float v);
int gguf_writer_set_bool(gguf_writer *w, const char *key, bool v);
int gguf_writer_set_str(gguf_writer *w, const char *key, const char *v);
int gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *v, uint64_t n);
int gguf_writer_set_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n);
int gguf_writer_set_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
/* Adds a tensor; data (size bytes, must equal the type's row bytes x rows) is copied. */
int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                           const uint64_t *ne, const void *data, uint64_t size);
/* Writes the file (to path.tmp then renamed). */
int gguf_writer_write(const gguf_writer *w, const char *path, char *msg, size_t msg_cap);

#endif /* KVS_GGUF_H */
