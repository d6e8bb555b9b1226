/*
 * mkmodel — synthetic Llama GGUF writer. See mkmodel.h.
 *
 * Weight statistics (why the scales are what they are):
 *  - token_embd ~ N(0, 1): the residual stream starts with rms ~1, which is
 *    what rmsnorm expects;
 *  - every projection W[n_out, n_in] ~ N(0, 1/n_in): a unit-rms input gives a
 *    unit-rms output, so each layer adds O(1) to the residual and hidden
 *    states grow like sqrt(layers), never exponentially;
 *  - output ~ N(0, (3^2)/n_embd): after output_norm (rms 1) logits have std ~3;
 *  - norm weights 1 + N(0, 0.05^2), f32.
 * Normal deviates come from a sum of four 16-bit uniforms (Irwin-Hall, bounded
 * at +-3.46 sigma): one 64-bit hash per element, no transcendental functions.
 */
#include "mkmodel.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "quant.h"
#include "util.h"

static const mkmodel_shape shapes[] = {
    /* name, n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx */
    {"tiny", 64, 2, 4, 2, 128, 512, 256},
    {"tiny-long", 64, 2, 4, 2, 128, 512, 8192}, /* the tiny model with a context past 2048 */
    {"small", 256, 2, 4, 2, 512, 512, 512},
    {"smollm2-360m", 960, 32, 15, 5, 2560, 49152, 8192},
    {"tinyllama-1.1b", 2048, 22, 32, 4, 5632, 32000, 2048},
    {"llama-7b", 4096, 32, 32, 32, 11008, 32000, 4096},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

const mkmodel_shape *mkmodel_find_shape(const char *name) {
    for (int i = 0; name && i < N_SHAPES; i++)
        if (strcmp(shapes[i].name, name) == 0) return &shapes[i];
    return NULL;
}

const mkmodel_shape *mkmodel_shape_at(int i) { return i >= 0 && i < N_SHAPES ? &shapes[i] : NULL; }

mkmodel_params mkmodel_default_params(void) {
    mkmodel_params p = {.shape = "tiny", .type = QUANT_F32, .k_m = false, .seed = 1};
    return p;
}

enum mk_arch { MK_LLAMA, MK_QWEN3, MK_GEMMA3, MK_PHI3 };
static const char *const ARCH_NAMES[] = {"llama", "qwen3", "gemma3", "phi3"};

/* The architecture called name (NULL: llama), or -1. */
static int arch_of(const char *name) {
    if (!name) return MK_LLAMA;
    for (int i = 0; i < (int)(sizeof ARCH_NAMES / sizeof ARCH_NAMES[0]); i++)
        if (!strcmp(name, ARCH_NAMES[i])) return i;
    return -1;
}

bool mkmodel_arch_supported(const char *arch) { return arch_of(arch) >= 0; }

bool mkmodel_type_supported(uint32_t type) {
    switch (type) {
    case QUANT_F32: case QUANT_F16: case QUANT_BF16: case QUANT_Q8_0: case QUANT_Q4_0:
    case QUANT_Q4_1: case QUANT_Q5_0: case QUANT_Q5_1: case QUANT_Q4_K: case QUANT_Q5_K:
    case QUANT_Q6_K: case QUANT_Q2_K: case QUANT_Q3_K: case QUANT_IQ4_NL: case QUANT_IQ4_XS:
        return true;
    default: return false;
    }
}

/* llama.cpp's llama_ftype for a file whose matrices are all of type t. */
static uint32_t file_type_of(uint32_t t) {
    switch (t) {
    case QUANT_F32: return 0;
    case QUANT_F16: return 1;
    case QUANT_Q4_0: return 2;
    case QUANT_Q4_1: return 3;
    case QUANT_Q8_0: return 7;
    case QUANT_Q5_0: return 8;
    case QUANT_Q5_1: return 9;
    case QUANT_Q2_K: return 10;
    case QUANT_Q3_K: return 11; /* Q3_K_S */
    case QUANT_Q4_K: return 14; /* Q4_K_S */
    case QUANT_Q5_K: return 16; /* Q5_K_S */
    case QUANT_Q6_K: return 18;
    case QUANT_IQ4_NL: return 25;
    case QUANT_IQ4_XS: return 30;
    case QUANT_BF16: return 32;
    default: return 0;
    }
}

/* ------------------------------------------------------------ random rows */

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* x[j] = mean + std * N(0,1) for the row (seed, tensor, row); depends on nothing else. */
static void gen_row(float *x, uint64_t n, uint64_t seed, uint32_t tensor, uint64_t row, float mean,
                    float std) {
    uint64_t s = mix64(seed ^ mix64(((uint64_t)tensor + 1) * 0x9e3779b97f4a7c15ull) ^
                       mix64((row + 1) * 0xd1b54a32d192ed03ull));
    /* sum of four U{0..65535}: mean 131070, std 65536/sqrt(3) (to 1e-9) */
    const float scale = std / 37837.2273f;
    for (uint64_t j = 0; j < n; j++) {
        uint64_t r = mix64(s + (j + 1) * 0x9e3779b97f4a7c15ull);
        uint32_t u = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) + (uint32_t)((r >> 32) & 0xffff) +
                     (uint32_t)(r >> 48);
        x[j] = mean + ((float)u - 131070.0f) * scale;
    }
}

/* ------------------------------------------------------------ tensor plan */

typedef struct {
    char name[48];
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne[2];   /* ne[0] = input dim (row length), ne[1] = rows */
    float mean, std;  /* value distribution */
    uint64_t row_bytes;
    const char *note; /* non-NULL when the matrix fell back from the requested type */
} plan_tensor;

typedef struct {
    plan_tensor *t;
    int n;
} plan;

static uint32_t matrix_type(uint32_t want, uint64_t n_in, const char **note) {
    const quant_traits *tr = quant_get_traits(want);
    *note = NULL;
    if (tr && n_in % tr->block_elems == 0) return want;
    *note = "fallback";
    return n_in % 32 == 0 ? QUANT_Q8_0 : QUANT_F16;
}

static void add(plan *p, const char *name, uint32_t type, uint64_t n_in, uint64_t n_out, float mean, float std) {
    plan_tensor *t = &p->t[p->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->type = type == QUANT_F32 ? QUANT_F32 : matrix_type(type, n_in, &t->note);
    t->n_dims = n_out > 0 ? 2 : 1;
    t->ne[0] = n_in;
    t->ne[1] = n_out > 0 ? n_out : 1;
    t->mean = mean;
    t->std = std;
    KVS_ASSERT(quant_row_bytes(t->type, n_in, &t->row_bytes));
}

/* llama.cpp's use_more_bits: the layers whose attn_v / ffn_down a _M mix widens. */
static bool more_bits(uint32_t l, uint32_t n) { return l < n / 8 || l >= 7 * n / 8 || (l - n / 8) % 3 == 2; }

/* The attention and FFN matrices of layer l: separate, or phi3's fused attn_qkv and gate+up. */
static void add_layer_matrices(plan *p, const mkmodel_shape *s, int arch, uint32_t type, uint32_t wide, uint32_t l) {
    char name[48];
    const uint64_t hd = s->n_embd / s->n_head, q_out = s->n_head * hd, kv_out = s->n_head_kv * hd;
    const float sd_embd = 1.0f / sqrtf((float)s->n_embd), sd_q = 1.0f / sqrtf((float)q_out);
    const float sd_ff = 1.0f / sqrtf((float)s->n_ff);
#define L(suffix) (snprintf(name, sizeof name, "blk.%u." suffix, l), name)
    if (arch == MK_PHI3) {
        add(p, L("attn_qkv.weight"), type, s->n_embd, q_out + 2 * kv_out, 0.0f, sd_embd);
    } else {
        add(p, L("attn_q.weight"), type, s->n_embd, q_out, 0.0f, sd_embd);
        add(p, L("attn_k.weight"), type, s->n_embd, kv_out, 0.0f, sd_embd);
        add(p, L("attn_v.weight"), wide, s->n_embd, kv_out, 0.0f, sd_embd);
    }
    if (arch == MK_QWEN3 || arch == MK_GEMMA3) {
        add(p, L("attn_q_norm.weight"), QUANT_F32, hd, 0, 1.0f, 0.05f);
        add(p, L("attn_k_norm.weight"), QUANT_F32, hd, 0, 1.0f, 0.05f);
    }
    add(p, L("attn_output.weight"), type, q_out, s->n_embd, 0.0f, sd_q);
    if (arch == MK_GEMMA3) add(p, L("post_attention_norm.weight"), QUANT_F32, s->n_embd, 0, 1.0f, 0.05f);
    add(p, L("ffn_norm.weight"), QUANT_F32, s->n_embd, 0, 1.0f, 0.05f);
    if (arch == MK_PHI3) {
        add(p, L("ffn_up.weight"), type, s->n_embd, 2 * (uint64_t)s->n_ff, 0.0f, sd_embd);
    } else {
        add(p, L("ffn_gate.weight"), type, s->n_embd, s->n_ff, 0.0f, sd_embd);
        add(p, L("ffn_up.weight"), type, s->n_embd, s->n_ff, 0.0f, sd_embd);
    }
    add(p, L("ffn_down.weight"), wide, s->n_ff, s->n_embd, 0.0f, sd_ff);
    if (arch == MK_GEMMA3) add(p, L("post_ffw_norm.weight"), QUANT_F32, s->n_embd, 0, 1.0f, 0.05f);
#undef L
}

static int make_plan(const mkmodel_shape *s, int arch, uint32_t type, bool k_m, plan *p) {
    p->n = 0;
    p->t = calloc((size_t)s->n_layer * 13 + 5, sizeof *p->t);
    if (!p->t) return KVS_ERR_NOMEM;
    const uint64_t hd = s->n_embd / s->n_head;
    const float sd_embd = 1.0f / sqrtf((float)s->n_embd);
    char name[48];
    add(p, "token_embd.weight", type, s->n_embd, s->n_vocab, 0.0f, 1.0f);
    if (arch == MK_PHI3) { /* LongRoPE: one factor per rotated pair, near 1 */
        add(p, "rope_factors_long.weight", QUANT_F32, hd / 2, 0, 1.0f, 0.05f);
        add(p, "rope_factors_short.weight", QUANT_F32, hd / 2, 0, 1.0f, 0.05f);
    }
    for (uint32_t l = 0; l < s->n_layer; l++) {
        snprintf(name, sizeof name, "blk.%u.attn_norm.weight", l);
        add(p, name, QUANT_F32, s->n_embd, 0, 1.0f, 0.05f);
        add_layer_matrices(p, s, arch, type, k_m && more_bits(l, s->n_layer) ? QUANT_Q6_K : type, l);
    }
    add(p, "output_norm.weight", QUANT_F32, s->n_embd, 0, 1.0f, 0.05f);
    if (arch != MK_GEMMA3) /* gemma3 ties its output to token_embd */
        add(p, "output.weight", k_m ? QUANT_Q6_K : type, s->n_embd, s->n_vocab, 0.0f, 3.0f * sd_embd);
    return KVS_OK;
}

/* ------------------------------------------------------------------ vocab */

#define N_BYTE_TOKENS 256
#define N_FIXED_TOKENS (3 + N_BYTE_TOKENS)

/* Bijective base-26 word of k ("a".."z", "aa", ...); out needs 16 bytes. */
static void filler_word(uint64_t k, char *out) {
    char tmp[16];
    int n = 0;
    k += 1;
    while (k > 0 && n < 15) {
        k -= 1;
        tmp[n++] = (char)('a' + k % 26);
        k /= 26;
    }
    for (int i = 0; i < n; i++) out[i] = tmp[n - 1 - i];
    out[n] = '\0';
}

/* A phi3 file's last token is Phi-3's "<|endoftext|>": llama.cpp looks it up by name in any file
 * whose name says phi3, and refuses the file without it. */
static int set_vocab(gguf_writer *w, uint32_t n_vocab, int arch) {
    int rc = KVS_ERR_NOMEM;
    char **toks = calloc(n_vocab, sizeof *toks);
    float *scores = calloc(n_vocab, sizeof *scores);
    int32_t *types = calloc(n_vocab, sizeof *types);
    char *pool = malloc((size_t)n_vocab * 24);
    if (!toks || !scores || !types || !pool) goto out;
    char *p = pool;
    for (uint32_t i = 0; i < n_vocab; i++) {
        toks[i] = p;
        if (i == 0) strcpy(p, "<unk>"), types[i] = 2;
        else if (i == 1) strcpy(p, "<s>"), types[i] = 3;
        else if (i == 2) strcpy(p, "</s>"), types[i] = 3;
        else if (i < N_FIXED_TOKENS) snprintf(p, 24, "<0x%02X>", i - 3), types[i] = 6;
        else if (arch == MK_PHI3 && i == n_vocab - 1) strcpy(p, "<|endoftext|>"), types[i] = 3;
        else {
            /* even: "\u2581word" (word-initial piece), odd: "word" */
            uint64_t f = i - N_FIXED_TOKENS;
            char word[16];
            filler_word(f / 2, word);
            snprintf(p, 24, "%s%s", (f % 2 == 0) ? "\xe2\x96\x81" : "", word);
            types[i] = 1;
            scores[i] = -(float)f;
        }
        p += strlen(p) + 1;
    }
    if ((rc = gguf_writer_set_str(w, "tokenizer.ggml.model", "llama")) ||
        (rc = gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)toks, n_vocab)) ||
        (rc = gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", scores, n_vocab)) ||
        (rc = gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, n_vocab)) ||
        (rc = gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1)) ||
        (rc = gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2)) ||
        (rc = gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0)) ||
        (rc = gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", true)) ||
        (rc = gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", false)))
        goto out;
out:
    free(toks);
    free(scores);
    free(types);
    free(pool);
    return rc;
}

/* arch.KEY, e.g. "gemma3.block_count"; static buffer, one at a time. */
static const char *akey(int arch, const char *key) {
    static char buf[96];
    snprintf(buf, sizeof buf, "%s.%s", ARCH_NAMES[arch], key);
    return buf;
}

/* The keys of the families beyond llama: head dims, gemma3's windows and rope bases, phi3's LongRoPE. */
static int set_family_keys(gguf_writer *w, const mkmodel_shape *s, int arch) {
    const uint32_t hd = s->n_embd / s->n_head;
    int rc = KVS_OK;
    if (arch == MK_QWEN3 || arch == MK_GEMMA3) {
        if ((rc = gguf_writer_set_u32(w, akey(arch, "attention.key_length"), hd)) ||
            (rc = gguf_writer_set_u32(w, akey(arch, "attention.value_length"), hd)))
            return rc;
    }
    if (arch == MK_GEMMA3) {
        if ((rc = gguf_writer_set_u32(w, akey(arch, "attention.sliding_window"), 512)) ||
            (rc = gguf_writer_set_f32(w, akey(arch, "rope.freq_base_swa"), 10000.0f)))
            return rc;
    }
    if (arch == MK_PHI3) {
        if ((rc = gguf_writer_set_u32(w, akey(arch, "rope.scaling.original_context_length"), s->n_ctx / 2)) ||
            (rc = gguf_writer_set_f32(w, akey(arch, "rope.scaling.attn_factor"), 1.19f)))
            return rc;
    }
    return rc;
}

static int set_metadata(gguf_writer *w, const mkmodel_shape *s, int arch, uint32_t type, bool k_m, uint64_t seed) {
    char name[96];
    const quant_traits *tr = quant_get_traits(type);
    snprintf(name, sizeof name, "kvshard-mkmodel-%s%s%s-%s%s", arch ? ARCH_NAMES[arch] : "", arch ? "-" : "", s->name,
             tr ? tr->name : "?", k_m ? "_m" : "");
    int rc;
    if ((rc = gguf_writer_set_str(w, "general.architecture", ARCH_NAMES[arch])) ||
        (rc = gguf_writer_set_str(w, "general.name", name)) ||
        (rc = gguf_writer_set_u32(w, "general.file_type", k_m ? 15 : file_type_of(type))) ||
        (rc = gguf_writer_set_u32(w, "general.quantization_version", 2)) ||
        (rc = gguf_writer_set_u64(w, "kvshard.mkmodel.seed", seed)) ||
        (rc = gguf_writer_set_u32(w, akey(arch, "vocab_size"), s->n_vocab)) ||
        (rc = gguf_writer_set_u32(w, akey(arch, "context_length"), s->n_ctx)) ||
        (rc = gguf_writer_set_u32(w, akey(arch, "embedding_length"), s->n_embd)) ||
        (rc = gguf_writer_set_u32(w, akey(arch, "block_count"), s->n_layer)) ||
        (rc = gguf_writer_set_u32(w, akey(arch, "feed_forward_length"), s->n_ff)) ||
        (rc = gguf_writer_set_u32(w, akey(arch, "attention.head_count"), s->n_head)) ||
        (rc = gguf_writer_set_u32(w, akey(arch, "attention.head_count_kv"), s->n_head_kv)) ||
        (rc = gguf_writer_set_u32(w, akey(arch, "rope.dimension_count"), s->n_embd / s->n_head)) ||
        (rc = gguf_writer_set_f32(w, akey(arch, "rope.freq_base"), arch == MK_GEMMA3 ? 1e6f : 10000.0f)) ||
        (rc = gguf_writer_set_f32(w, akey(arch, "attention.layer_norm_rms_epsilon"), 1e-5f)) ||
        (rc = set_family_keys(w, s, arch)))
        return rc;
    return set_vocab(w, s->n_vocab, arch);
}

/* ---------------------------------------------------------- row generation */

typedef struct {
    const plan_tensor *t;
    uint32_t t_idx;
    uint64_t seed;
    uint64_t r0, r1; /* rows [r0, r1) of the tensor */
    uint8_t *out;    /* bytes of row r0 */
    bool ok;
} gen_job;

static void *gen_rows(void *arg) {
    gen_job *j = arg;
    const plan_tensor *t = j->t;
    float *x = malloc(t->ne[0] * sizeof *x);
    j->ok = x != NULL;
    for (uint64_t r = j->r0; r < j->r1 && j->ok; r++) {
        gen_row(x, t->ne[0], j->seed, j->t_idx, r, t->mean, t->std);
        j->ok = quant_quantize_row(t->type, x, j->out + (r - j->r0) * t->row_bytes, (int64_t)t->ne[0]);
    }
    free(x);
    return NULL;
}

/* Fills buf with rows [r0, r1) using n_threads (the caller's thread included). */
static bool gen_chunk(const plan_tensor *t, uint32_t t_idx, uint64_t seed, uint64_t r0, uint64_t r1,
                      uint8_t *buf, int n_threads) {
    enum { MAX_THREADS = 8 };
    gen_job jobs[MAX_THREADS];
    pthread_t th[MAX_THREADS];
    bool started[MAX_THREADS] = {false};
    uint64_t rows = r1 - r0;
    int nt = n_threads;
    if ((uint64_t)nt > rows) nt = (int)rows;
    if (nt > MAX_THREADS) nt = MAX_THREADS;
    if (nt < 1) nt = 1;
    for (int k = 0; k < nt; k++) {
        uint64_t a = r0 + rows * (uint64_t)k / (uint64_t)nt, b = r0 + rows * (uint64_t)(k + 1) / (uint64_t)nt;
        jobs[k] = (gen_job){t, t_idx, seed, a, b, buf + (a - r0) * t->row_bytes, false};
    }
    for (int k = 1; k < nt; k++) started[k] = pthread_create(&th[k], NULL, gen_rows, &jobs[k]) == 0;
    gen_rows(&jobs[0]);
    for (int k = 1; k < nt; k++) {
        if (started[k]) pthread_join(th[k], NULL);
        else gen_rows(&jobs[k]); /* no thread: do it here */
    }
    bool ok = true;
    for (int k = 0; k < nt; k++) ok = ok && jobs[k].ok;
    return ok;
}

static void progress(const mkmodel_params *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void progress(const mkmodel_params *p, const char *fmt, ...) {
    if (!p->progress) return;
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    p->progress(p->progress_user, line);
}

#define CHUNK_BYTES (8u << 20) /* output bytes generated per pass */

int mkmodel_write(const char *path, mkmodel_params params, char *msg, size_t msg_cap) {
    if (!path) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "no output path");
    const mkmodel_shape *s = mkmodel_find_shape(params.shape);
    if (!s) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "unknown shape '%s'", params.shape ? params.shape : "(null)");
    if (!mkmodel_type_supported(params.type))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "type id %u is not supported by mkmodel", params.type);
    int n_threads = params.n_threads;
    if (n_threads <= 0) {
        long nc = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = nc < 1 ? 1 : nc > 8 ? 8 : (int)nc;
    }
    plan pl = {0};
    gguf_writer *w = NULL;
    uint8_t *buf = NULL;
    if (params.k_m && params.type != QUANT_Q4_K)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "the _M mix is made from q4_k only");
    const int arch = arch_of(params.arch);
    if (arch < 0)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "unknown architecture '%s' (llama, qwen3, gemma3, phi3)",
                        params.arch);
    int rc = make_plan(s, arch, params.type, params.k_m, &pl);
    if (rc) {
        rc = kvs_fail(msg, msg_cap, rc, "out of memory");
        goto out;
    }
    if (!(w = gguf_writer_create())) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto out;
    }
    if ((rc = set_metadata(w, s, arch, params.type, params.k_m, params.seed))) {
        rc = kvs_fail(msg, msg_cap, rc, "setting metadata: %s", kvs_strerror(rc));
        goto out;
    }
    uint64_t max_chunk = 0, total = 0;
    for (int i = 0; i < pl.n; i++) {
        const plan_tensor *t = &pl.t[i];
        uint64_t size;
        if ((rc = gguf_writer_declare_tensor(w, t->name, t->type, t->n_dims, t->ne, &size))) {
            rc = kvs_fail(msg, msg_cap, rc, "declaring %s: %s", t->name, kvs_strerror(rc));
            goto out;
        }
        uint64_t rows = CHUNK_BYTES / t->row_bytes;
        if (rows < 1) rows = 1;
        if (rows > t->ne[1]) rows = t->ne[1];
        if (rows * t->row_bytes > max_chunk) max_chunk = rows * t->row_bytes;
        total += size;
    }
    if (!(buf = malloc((size_t)max_chunk))) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto out;
    }
    progress(&params, "%s: shape %s, %s, seed %" PRIu64 ", %d tensors, %.1f MiB of tensor data, %d threads", path,
             s->name, quant_get_traits(params.type)->name, params.seed, pl.n, (double)total / (1 << 20), n_threads);
    if ((rc = gguf_writer_begin(w, path, msg, msg_cap))) goto out;
    for (int i = 0; i < pl.n; i++) {
        const plan_tensor *t = &pl.t[i];
        if (t->n_dims == 1)
            progress(&params, "tensor %d/%d %s %s [%" PRIu64 "]", i + 1, pl.n, t->name,
                     quant_get_traits(t->type)->name, t->ne[0]);
        else
        {
            char fb[128] = "";
            if (t->note)
                snprintf(fb, sizeof fb, " (fallback: row length %" PRIu64 " is not a multiple of the %s block size %u)",
                         t->ne[0], quant_get_traits(params.type)->name, quant_get_traits(params.type)->block_elems);
            progress(&params, "tensor %d/%d %s %s [%" PRIu64 ", %" PRIu64 "]%s", i + 1, pl.n, t->name,
                     quant_get_traits(t->type)->name, t->ne[0], t->ne[1], fb);
        }
        uint64_t rows_per = max_chunk / t->row_bytes;
        for (uint64_t r0 = 0; r0 < t->ne[1]; r0 += rows_per) {
            uint64_t r1 = r0 + rows_per < t->ne[1] ? r0 + rows_per : t->ne[1];
            if (!gen_chunk(t, (uint32_t)i, params.seed, r0, r1, buf, n_threads)) {
                rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "generating %s failed (out of memory)", t->name);
                goto out;
            }
            if ((rc = gguf_writer_write_data(w, buf, (size_t)((r1 - r0) * t->row_bytes), msg, msg_cap))) goto out;
        }
    }
    rc = gguf_writer_finish(w, msg, msg_cap);
out:
    gguf_writer_free(w); /* removes path.tmp if unfinished */
    free(buf);
    free(pl.t);
    return rc;
}
