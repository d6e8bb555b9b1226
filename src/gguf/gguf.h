/*
 * gguf — GGUF v2/v3 reader (mmap, every count/length/offset checked) and writer.
 *
 * Reader: gguf_open() maps a file and validates the whole header, metadata and
 * tensor table before returning; anything inconsistent is refused with
 * KVS_ERR_FORMAT (or KVS_ERR_UNSUPPORTED for an unknown tensor type / version)
 * and a message naming the problem. After success every pointer the context
 * hands out (strings, array data, tensor data) stays valid until gguf_close().
 * Strings are NOT NUL-terminated: use gguf_str's len.
 * A context never changes after open (except gguf_map_data on a header-only
 * context, which callers do before sharing it): any number of threads may
 * read it at once. The file is mapped MAP_SHARED read-only; truncating it on disk while
 * it is open is outside the contract (the OS delivers SIGBUS on access).
 * Knows nothing about models: no architecture checks here.
 *
 * What the reader checks (everything else is refused):
 *  1. magic "GGUF", little-endian version 2 or 3 (v1 and big-endian files: UNSUPPORTED);
 *  2. n_kv <= GGUF_MAX_KV and n_tensors <= GGUF_MAX_TENSORS, and neither larger
 *     than the bytes left could hold at the minimal entry size;
 *  3. every string length and array byte size fits in the bytes left; keys are
 *     1..GGUF_MAX_KEY_LEN bytes, tensor names 1..GGUF_MAX_NAME_LEN, unique;
 *     value types known; bools 0/1; arrays of arrays refused (UNSUPPORTED);
 *  4. general.alignment, when present, is a u32 nonzero power of two;
 *  5. per tensor: n_dims 1..4, each ne >= 1, product and byte size without
 *     overflow, type known to quant (else UNSUPPORTED), ne[0] a multiple of the
 *     block size, offset aligned, [data_offset + offset, + size) inside the file,
 *     and no two tensors' byte ranges overlap.
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
#define GGUF_MAX_KV (1u << 20)      /* metadata entries */
#define GGUF_MAX_TENSORS (1u << 20) /* tensor infos */
#define GGUF_MAX_KEY_LEN 65535u     /* bytes */
#define GGUF_MAX_NAME_LEN 256u      /* bytes; ggml itself caps names at 63 */

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
    const void *arr_data;       /* numeric arrays: raw little-endian elements, maybe unaligned;
                                   string arrays: the first encoded string (u64 len + bytes) */
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

/* Like gguf_open (same checks), but keeps only a heap copy of the header
 * (metadata and tensor table): no byte of the data section stays mapped, and
 * every tensor's data is NULL until gguf_map_data(). The file stays open. */
int gguf_open_header(const char *path, gguf_ctx **out, char *msg, size_t msg_cap);
/* Maps the data section of a context from gguf_open_header and sets every
 * tensor's data; a no-op (KVS_OK) when the data is already reachable.
 * KVS_ERR_IO when the file changed size since the header was read or mmap
 * fails (the context is unchanged). Changes the context: call it before the
 * context is shared between threads. */
int gguf_map_data(gguf_ctx *ctx, char *msg, size_t msg_cap);
/* Bytes of the data section (tensor data) currently mapped: the whole data
 * section for gguf_open / gguf_open_buffer, 0 for gguf_open_header until
 * gguf_map_data. */
uint64_t gguf_mapped_data_bytes(const gguf_ctx *ctx);

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
/* Out-of-range index or a non-numeric array gives 0 (never reads out of bounds). */
float gguf_arr_f32(const gguf_kv *kv, uint64_t i);   /* f32/f64/integer/bool arrays */
int64_t gguf_arr_i64(const gguf_kv *kv, uint64_t i); /* integer/bool arrays (u64 above INT64_MAX wraps) */
bool gguf_str_eq(gguf_str s, const char *cstr);

uint64_t gguf_n_tensors(const gguf_ctx *ctx);
const gguf_tensor *gguf_tensor_at(const gguf_ctx *ctx, uint64_t i);
const gguf_tensor *gguf_find_tensor(const gguf_ctx *ctx, const char *name); /* NULL if absent */

/* "u8", "i32", "string", ...; "?" for an unknown id. */
const char *gguf_vtype_name(enum gguf_vtype t);
/* Bytes of one element of a numeric/bool type; 0 for STRING/ARRAY/unknown. */
size_t gguf_vtype_size(enum gguf_vtype t);

/* --- split files ---------------------------------------------------------- */
/*
 * A model stored in parts NAME-00001-of-0000N.gguf ... NAME-0000N-of-0000N.gguf
 * (llama.cpp's gguf-split layout): every part is a valid GGUF with the keys
 * split.no (0-based part index), split.count (N) and split.tensors.count
 * (tensors over all parts); the first part holds the model's metadata, each
 * tensor lives in exactly one part.
 *
 * gguf_set_open() takes any file. A file without split.count (or with
 * split.count 1) is one part opened with gguf_open — exactly as before. For a
 * split model it reads the headers of every part but maps no tensor data:
 * gguf_set_map_tensor() maps the data section of the part holding a tensor on
 * first use, so a shard maps only the parts that hold what it owns.
 *
 * kvshard manifest: `kvshard split` also writes into the first part, for every
 * tensor, its part and the BLAKE2b-256 of its bytes, plus the SHA-256 of the
 * unsplit file (the model digest a whole-file shard reports). With it, parts
 * that are not on disk are fine until one of their tensors is mapped (find
 * still answers, with a name-only tensor), and every tensor is checked against
 * its digest when first mapped. A split without it (llama.cpp's gguf-split)
 * needs every part, as before.
 */
#define GGUF_SPLIT_MAX_PARTS 9999u
#define GGUF_MANIFEST_VERSION "kvshard.manifest.version"           /* u32: 1 */
#define GGUF_MANIFEST_MODEL_SHA256 "kvshard.manifest.model_sha256" /* 64 hex: SHA-256 of the unsplit file */
#define GGUF_MANIFEST_NAMES "kvshard.manifest.tensor_names"        /* [split.tensors.count] strings */
#define GGUF_MANIFEST_PARTS "kvshard.manifest.tensor_parts"        /* [split.tensors.count] u32, 0-based */
#define GGUF_MANIFEST_DIGESTS "kvshard.manifest.tensor_blake2b"    /* u8 [32 x split.tensors.count] */
#define GGUF_MANIFEST_DIGEST_SIZE 32u

typedef struct gguf_set gguf_set;

/* Opens path (a single file, or the first part of a split model, whose other
 * parts are found by name beside it). Refused (KVS_ERR_FORMAT, message says
 * which part and why): path is not part 1, a part is missing (without a
 * manifest), a part's split.no / split.count / split.tensors.count disagree, a
 * tensor is in two parts, the tensor counts do not add up, a present part does
 * not hold what the manifest says. *out owned by the caller. */
int gguf_set_open(const char *path, gguf_set **out, char *msg, size_t msg_cap);
void gguf_set_close(gguf_set *set); /* NULL is fine */
/* The first part: the model's metadata. Valid until gguf_set_close. */
const gguf_ctx *gguf_set_meta(const gguf_set *set);
uint32_t gguf_set_n_parts(const gguf_set *set);
/* NULL past the end, and for a part absent from disk (only with a manifest). */
const gguf_ctx *gguf_set_part(const gguf_set *set, uint32_t i);
/* True, with the manifest's model digest (SHA-256 of the unsplit file) in out,
 * when the set has a kvshard manifest. */
bool gguf_set_manifest_digest(const gguf_set *set, uint8_t out[32]);
/* Every tensor of the model, over all parts (absent ones: name-only). */
uint64_t gguf_set_n_tensors(const gguf_set *set);
const gguf_tensor *gguf_set_tensor_at(const gguf_set *set, uint64_t i); /* NULL past the end */
/* The tensor called name in whichever part holds it (its data is NULL while
 * that part is unmapped or absent; only its name is set when absent), or NULL;
 * *part (may be NULL) gets the part index. */
const gguf_tensor *gguf_set_find_tensor(const gguf_set *set, const char *name, uint32_t *part);
/* Like find, then maps the part's data (gguf_map_data) so that (*out)->data
 * is valid. KVS_ERR_NOT_FOUND (*out NULL) when absent; KVS_ERR_IO from mapping
 * or when the part is not on disk; with a manifest, KVS_ERR_FORMAT (message
 * names the tensor and the part) when the tensor's bytes do not match it. */
int gguf_set_map_tensor(gguf_set *set, const char *name, const gguf_tensor **out, char *msg, size_t msg_cap);
/* With a manifest: maps and checks, on n_threads threads, every tensor of a
 * present part for which want(name, user) is true, so that later map calls
 * find them checked (a tensor it leaves out is checked, on the calling thread,
 * when mapped). KVS_ERR_FORMAT naming the tensor and part for a mismatch;
 * KVS_OK at once without a manifest. */
int gguf_set_verify(gguf_set *set, bool (*want)(const char *name, void *user), void *user, uint32_t n_threads,
                    char *msg, size_t msg_cap);
/* Sum of gguf_mapped_data_bytes over the parts. */
uint64_t gguf_set_mapped_data_bytes(const gguf_set *set);

/* Writes src as n_parts parts PREFIX-00001-of-0000N.gguf ...: tensor i goes
 * to part part_of[i] (< n_parts; tensors keep their order inside a part),
 * the first part gets all of src's metadata, every part the split.* keys
 * (and general.alignment when src sets it). src's tensor data must be
 * mapped. KVS_ERR_INVALID_ARG for n_parts out of [1, GGUF_SPLIT_MAX_PARTS], a
 * part index out of range or a part left without tensors; KVS_ERR_IO /
 * KVS_ERR_NOMEM otherwise, and then no part is left on disk. */
int gguf_split_write(const gguf_ctx *src, const uint32_t *part_of, uint32_t n_parts, const char *prefix, char *msg,
                     size_t msg_cap);
/* gguf_split_write plus the kvshard manifest in the first part when
 * model_sha256 (the SHA-256 of src's file, 32 bytes) is not NULL. */
int gguf_split_write_manifest(const gguf_ctx *src, const uint32_t *part_of, uint32_t n_parts, const char *prefix,
                              const uint8_t *model_sha256, char *msg, size_t msg_cap);
/* The manifest's model digest of the split model whose first part is path,
 * read from that part's header alone. KVS_ERR_NOT_FOUND when path is not a
 * split first part or has no manifest; KVS_ERR_IO / KVS_ERR_FORMAT when it
 * cannot be read. */
int gguf_manifest_digest(const char *path, uint8_t out[32]);
/* N when path is named PREFIX-00001-of-NNNNN.gguf (N >= 1), with PREFIX copied into prefix;
 * 0 when it is not so named or PREFIX does not fit in cap. */
uint32_t gguf_split_first_part(const char *path, char *prefix, size_t cap);
/* "PREFIX-%05u-of-%05u.gguf" for part i (0-based) of n into buf; false when it does not fit. */
bool gguf_split_path(char *buf, size_t cap, const char *prefix, uint32_t i, uint32_t n);

typedef struct gguf_writer gguf_writer;
/* Copies one metadata entry (any type) into a writer under its own key. */
int gguf_writer_copy_kv(gguf_writer *w, const gguf_kv *kv);

/* --- writer -------------------------------------------------------------- */
/*
 * Two ways to write:
 *  - copying: gguf_writer_add_tensor() copies each tensor's bytes, then
 *    gguf_writer_write() writes the whole file;
 *  - streaming (files larger than memory): gguf_writer_declare_tensor() for every
 *    tensor (name, type, shape; no data), then gguf_writer_begin() writes the
 *    header, metadata and tensor table, gguf_writer_write_data() appends the
 *    tensors' bytes in declaration order (any chunking), gguf_writer_finish()
 *    closes and renames. Only the bytes of one chunk are held at a time.
 * Both write GGUF v3, every field little-endian, to path.tmp and rename it to
 * path on success; on failure the .tmp file is removed and path is untouched.
 * Alignment: the value of a "general.alignment" u32 key if set, else 32; the
 * data section and every tensor offset are aligned to it, padding is zeros.
 */
typedef struct gguf_writer gguf_writer;

/* New empty writer (GGUF v3, alignment 32); NULL on allocation failure. */
gguf_writer *gguf_writer_create(void);
/* Frees the writer; NULL is fine. An unfinished streaming write is abandoned
 * (its .tmp file removed). */
void gguf_writer_free(gguf_writer *w);
/* Metadata setters copy key and value; setting an existing key replaces its
 * value (the key keeps its position). Return KVS_OK, KVS_ERR_NOMEM, or
 * KVS_ERR_INVALID_ARG (NULL key/value, or after gguf_writer_begin()). */
int gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v);
int gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v);
int gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v);
int gguf_writer_set_f32(gguf_writer *w, const char *key, float v);
int gguf_writer_set_bool(gguf_writer *w, const char *key, bool v);
int gguf_writer_set_str(gguf_writer *w, const char *key, const char *v);
int gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *v, uint64_t n);
int gguf_writer_set_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n);
int gguf_writer_set_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
/* Any numeric/bool scalar: value points at one host-order element of type t
 * (uint8_t, int8_t, ..., float, bool, double). KVS_ERR_INVALID_ARG for STRING/ARRAY. */
int gguf_writer_set_scalar(gguf_writer *w, const char *key, enum gguf_vtype t, const void *value);
/* String with explicit length (may contain NUL bytes). */
int gguf_writer_set_strn(gguf_writer *w, const char *key, const char *v, uint64_t len);
/* Array of numeric/bool elements of type elem (host-order C array of n
 * elements), or of strings when elem == GGUF_VT_STRING (data is const char *const *).
 * KVS_ERR_INVALID_ARG for elem == ARRAY. */
int gguf_writer_set_arr(gguf_writer *w, const char *key, enum gguf_vtype elem, const void *data,
                        uint64_t n);
/* Adds a tensor; data (size bytes, must equal the type's row bytes x rows) is copied.
 * KVS_ERR_INVALID_ARG for a bad shape/size, unknown type, duplicate name. */
int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                           const uint64_t *ne, const void *data, uint64_t size);
/* Writes the file (to path.tmp then renamed). KVS_ERR_INVALID_ARG when a tensor
 * was declared without data (use the streaming calls), KVS_ERR_IO on I/O errors. */
int gguf_writer_write(const gguf_writer *w, const char *path, char *msg, size_t msg_cap);

/* Streaming. declare: like add_tensor without data; *out_size (may be NULL)
 * gets the tensor's byte size. */
int gguf_writer_declare_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                               const uint64_t *ne, uint64_t *out_size);
/* Creates path.tmp and writes header, metadata, tensor table and padding.
 * Metadata and tensors can no longer change. On failure nothing is left on disk. */
int gguf_writer_begin(gguf_writer *w, const char *path, char *msg, size_t msg_cap);
/* Appends n bytes of tensor data, continuing the current tensor (declaration
 * order) and moving to the next one when it is full. KVS_ERR_INVALID_ARG when
 * n exceeds the bytes still expected, or not streaming. */
int gguf_writer_write_data(gguf_writer *w, const void *data, size_t n, char *msg, size_t msg_cap);
/* Checks every declared byte was written, closes and renames path.tmp to path.
 * After any streaming failure the write is abandoned (tmp removed) and later
 * streaming calls fail. */
int gguf_writer_finish(gguf_writer *w, char *msg, size_t msg_cap);

#endif /* KVS_GGUF_H */
