/*
 * Quantized KV against llama.cpp with the same cache types, on the two
 * large-vocabulary files of ../shared/downloads (reference/MODEL-kv{f16,q8_0,
 * q4_0}.jsonl: llama.cpp's top-32 logits with its K and V cache in that type,
 * flash attention on). For each type T every reference's `tokens` are
 * teacher-forced in one batch through kvshard with --kv-type T, and the mean
 * KL divergence over the reference's top-32 probabilities plus one bucket for
 * the rest is measured three ways:
 *   own(T):  llama.cpp T against llama.cpp f16 (positions whose tokens agree
 *            in both files; an id missing from T's top-32 counts at its 32nd
 *            logit) — how far the cache type itself moves llama.cpp;
 *   same(T): kvshard T against llama.cpp T;
 *   f16(T):  kvshard T against llama.cpp f16 (the f16 file's tokens).
 * The goals, same(T) <= own(T) / 2 and f16(T) <= 1.25 x own(T), are
 * printed and asserted. Both engines rotate a quantized cache's rows
 * (kv_attn.h), so their blocks round alike, and both round the scale of a
 * q8_0 activation block to f16 (quant_impl.h design note 3), without which
 * same(q8_0) on the q8_0 qwen2 file sat at 0.62 of own. All figures
 * are over the positions where both llama.cpp files saw the same tokens. Also, per type, on the first
 * prompt: the KV path (prompt, then one token at a time) and the same
 * session batched with another in one step give the one-batch logits bit
 * for bit.
 */
#include <cjson/cJSON.h>
#include <math.h>

#include "engine_check.h"
#include "isa_check.h"
#include "quant.h"
#include "jsonl.h"
#include "test.h"
#include "util.h"

#define TOP_N 32
#define MAX_LINES 16

/* Under a sanitizer (several times slower) each file runs one line: the same code paths for the
 * memory checks; the accuracy figures and their bounds come from the release build. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVD_LINES 1
#else
#define KVD_LINES 1000000
#endif

static const char *const MODELS[] = {"llama3-synth-Q4_K_M", "qwen2-synth-Q8_0"};
static const char *const TYPES[] = {"f16", "q8_0", "q4_0"};
static const uint32_t TYPE_IDS[] = {QUANT_F16, QUANT_Q8_0, QUANT_Q4_0};

typedef struct {
    int n, n_prompt;
    int32_t *tok;        /* [n] */
    int *top_id;         /* [n][TOP_N] */
    double *top_logit;   /* [n][TOP_N] descending */
    double *lse;         /* [n] */
} ref_line;

typedef struct {
    ref_line lines[MAX_LINES];
    int n_lines;
} ref_file;

static void read_line_cb(cJSON *line, int line_no, void *ctx) {
    ref_file *rf = ctx;
    (void)line_no;
    cJSON *jt = cJSON_GetObjectItem(line, "tokens"), *jl = cJSON_GetObjectItem(line, "logits_top");
    CHECK(jt && jl && cJSON_GetArraySize(jt) == cJSON_GetArraySize(jl));
    if (!jt || !jl || cJSON_GetArraySize(jt) != cJSON_GetArraySize(jl) || rf->n_lines == MAX_LINES) return;
    ref_line *r = &rf->lines[rf->n_lines++];
    r->n = cJSON_GetArraySize(jt);
    r->n_prompt = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(line, "n_prompt"));
    r->tok = calloc((size_t)r->n, sizeof(int32_t));
    r->top_id = calloc((size_t)r->n * TOP_N, sizeof(int));
    r->top_logit = calloc((size_t)r->n * TOP_N, sizeof(double));
    r->lse = calloc((size_t)r->n, sizeof(double));
    for (int i = 0; i < r->n; i++) {
        r->tok[i] = (int32_t)cJSON_GetNumberValue(cJSON_GetArrayItem(jt, i));
        cJSON *pos = cJSON_GetArrayItem(jl, i), *top = cJSON_GetObjectItem(pos, "top");
        r->lse[i] = cJSON_GetNumberValue(cJSON_GetObjectItem(pos, "lse"));
        CHECK_EQ_INT(cJSON_GetArraySize(top), TOP_N);
        for (int k = 0; k < TOP_N && k < cJSON_GetArraySize(top); k++) {
            cJSON *e = cJSON_GetArrayItem(top, k);
            r->top_id[i * TOP_N + k] = (int)cJSON_GetNumberValue(cJSON_GetArrayItem(e, 0));
            r->top_logit[i * TOP_N + k] = cJSON_GetNumberValue(cJSON_GetArrayItem(e, 1));
        }
    }
}

static bool read_ref(const char *name, const char *type, ref_file *rf) {
    char rel[160], path[1024];
    snprintf(rel, sizeof rel, "downloads/reference/%s-kv%s.jsonl", name, type);
    if (!test_shared_path(rel, path, sizeof path)) return false;
    rf->n_lines = 0;
    jsonl_each(path, MAX_LINES, read_line_cb, rf);
    return rf->n_lines > 0;
}

static void free_ref(ref_file *rf) {
    for (int l = 0; l < rf->n_lines; l++) {
        free(rf->lines[l].tok); free(rf->lines[l].top_id); free(rf->lines[l].top_logit); free(rf->lines[l].lse);
    }
    rf->n_lines = 0;
}

/* KL(ref || other) over ref's top-32 plus one bucket for the rest, other's log-probabilities
 * given for ref's ids (lpo[k]). */
static double kl_top(const ref_line *r, int i, const double *lpo) {
    double kl = 0, p_ref_rest = 1, p_oth_rest = 1;
    for (int k = 0; k < TOP_N; k++) {
        double lpr = r->top_logit[i * TOP_N + k] - r->lse[i];
        kl += exp(lpr) * (lpr - lpo[k]);
        p_ref_rest -= exp(lpr);
        p_oth_rest -= exp(lpo[k]);
    }
    if (p_ref_rest > 1e-12) kl += p_ref_rest * (log(p_ref_rest) - log(p_oth_rest > 1e-12 ? p_oth_rest : 1e-12));
    return kl;
}

static double log_sum_exp(const float *x, int n) {
    double mx = -INFINITY, s = 0;
    for (int i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < n; i++) s += exp((double)x[i] - mx);
    return mx + log(s);
}

/* Mean-KL accumulator. */
typedef struct {
    double sum;
    long n;
} kl_acc;
static double kl_mean(const kl_acc *a) { return a->n ? a->sum / (double)a->n : 0; }

/* Positions of line l whose tokens so far are the same in a and b. */
static int same_prefix(const ref_file *a, const ref_file *b, int l) {
    if (l >= b->n_lines) return 0;
    const ref_line *r = &a->lines[l], *o = &b->lines[l];
    int same = 0;
    while (same < r->n && same < o->n && r->tok[same] == o->tok[same]) same++;
    return same;
}

/* kvshard's teacher-forced logits of every line of ref against it: all positions into acc, and
 * those before the line's tokens part from limit's into acc_common. */
static void kl_ours(engine *e, const ref_file *ref, const ref_file *limit, int sid_base, kl_acc *acc,
                    kl_acc *acc_common) {
    const int nv = (int)e->m->hp.n_vocab;
    for (int l = 0; l < ref->n_lines && l < KVD_LINES; l++) {
        const ref_line *r = &ref->lines[l];
        float *ours = malloc((size_t)r->n * (size_t)nv * sizeof(float));
        engine_req req = {.epoch = 1, .n = (uint32_t)r->n, .tokens = r->tok, .out_mode = FWD_OUT_LOGITS_ALL, .out = ours};
        set_sid(&req.sid, sid_base + l);
        CHECK_EQ_INT(engine_step(e, &req, 1), KVS_OK);
        CHECK_EQ_INT(req.status, KVS_OK);
        kv_release(e->kv, &req.sid, 1, NULL);
        for (int i = 0; i < r->n; i++) {
            const float *row = ours + (size_t)i * (size_t)nv;
            double lse = log_sum_exp(row, nv), lpo[TOP_N];
            for (int k = 0; k < TOP_N; k++) {
                int id = r->top_id[i * TOP_N + k];
                lpo[k] = (id >= 0 && id < nv ? (double)row[id] : -INFINITY) - lse;
            }
            const double kl = kl_top(r, i, lpo);
            acc->sum += kl;
            acc->n++;
            if (i < same_prefix(ref, limit, l)) {
                acc_common->sum += kl;
                acc_common->n++;
            }
        }
        free(ours);
    }
}

/* llama.cpp T (oth) against llama.cpp f16 (ref) where both saw the same tokens. */
static void kl_theirs(const ref_file *ref, const ref_file *oth, kl_acc *acc) {
    for (int l = 0; l < ref->n_lines && l < oth->n_lines; l++) {
        const ref_line *r = &ref->lines[l], *o = &oth->lines[l];
        for (int i = 0; i < same_prefix(ref, oth, l); i++) {
            double lpo[TOP_N];
            for (int k = 0; k < TOP_N; k++) {
                double logit = o->top_logit[i * TOP_N + TOP_N - 1];
                for (int j = 0; j < TOP_N; j++)
                    if (o->top_id[i * TOP_N + j] == r->top_id[i * TOP_N + k]) logit = o->top_logit[i * TOP_N + j];
                lpo[k] = logit - o->lse[i];
            }
            acc->sum += kl_top(r, i, lpo);
            acc->n++;
        }
    }
}

/* The first line: KV path and batched with another session, against one batch alone. */
static void check_bits(engine *e, const ref_line *r, const char *what) {
    const size_t nv = e->m->hp.n_vocab, n = (size_t)r->n;
    float *alone = malloc(n * nv * sizeof(float)), *other = malloc(n * nv * sizeof(float));
    float *mate = malloc(n * nv * sizeof(float));
    engine_req req = {.epoch = 1, .n = (uint32_t)n, .tokens = r->tok, .out_mode = FWD_OUT_LOGITS_ALL, .out = alone};
    set_sid(&req.sid, 900);
    CHECK_EQ_INT(engine_step(e, &req, 1), KVS_OK);
    kv_sid sid;
    set_sid(&sid, 901);
    bool kv_ok = kv_path_matches(e, sid, r->tok, r->n_prompt, r->n, other, alone);
    engine_req two[2] = {
        {.epoch = 1, .n = (uint32_t)(n - 3), .tokens = r->tok + 3, .out_mode = FWD_OUT_LOGITS_ALL, .out = mate},
        {.epoch = 1, .n = (uint32_t)n, .tokens = r->tok, .out_mode = FWD_OUT_LOGITS_ALL, .out = other}};
    set_sid(&two[0].sid, 902);
    set_sid(&two[1].sid, 903);
    CHECK_EQ_INT(engine_step(e, two, 2), KVS_OK);
    bool batch_ok = memcmp(other, alone, n * nv * sizeof(float)) == 0;
    printf("  %s: kv path bit-identical %s, batched with another session bit-identical %s\n", what,
           kv_ok ? "yes" : "NO", batch_ok ? "yes" : "NO");
    CHECK(kv_ok);
    CHECK(batch_ok);
    for (int k = 900; k < 904; k++) {
        set_sid(&sid, k);
        kv_release(e->kv, &sid, 1, NULL);
    }
    free(alone); free(other); free(mate);
}

static engine *open_typed(const char *path, uint32_t kv_type) {
    engine_params ep = engine_default_params();
    ep.model_path = path;
    ep.n_threads = 2;
    ep.kv.kv_type = kv_type;
    ep.kv.budget_bytes = 16ull << 20;
    engine *e = NULL;
    char msg[KVS_MSG_MAX] = "";
    if (engine_open(&ep, &e, msg, sizeof msg)) fprintf(stderr, "engine_open(%s): %s\n", path, msg);
    return e;
}

static void run_model(const char *name, const char *mpath) {
    static ref_file f16_ref, t_ref;
    if (!read_ref(name, "f16", &f16_ref)) return;
    for (int t = 0; t < 3; t++) {
        if (!read_ref(name, TYPES[t], &t_ref)) continue;
        engine *e = open_typed(mpath, TYPE_IDS[t]);
        CHECK(e != NULL);
        if (!e) { free_ref(&t_ref); continue; }
        kl_acc own = {0}, same = {0}, same_common = {0}, vs_f16 = {0}, vs_f16_common = {0};
        kl_theirs(&f16_ref, &t_ref, &own);
        kl_ours(e, &t_ref, &f16_ref, 100, &same, &same_common);
        kl_ours(e, &f16_ref, &t_ref, 200, &vs_f16, &vs_f16_common);
        printf("%-20s kv %-4s mean KL over the %ld positions both llama.cpp files share: llama.cpp %s vs f16 %.3e; "
               "kvshard %s vs llama.cpp %s %.3e (goal <= %.3e); kvshard %s vs llama.cpp f16 %.3e (goal <= %.3e); "
               "over all positions: kvshard vs llama.cpp %s %.3e (%ld), vs llama.cpp f16 %.3e (%ld)\n",
               name, TYPES[t], own.n, TYPES[t], kl_mean(&own), TYPES[t], TYPES[t], kl_mean(&same_common),
               kl_mean(&own) / 2, TYPES[t], kl_mean(&vs_f16_common), 1.25 * kl_mean(&own), TYPES[t], kl_mean(&same),
               same.n, kl_mean(&vs_f16), vs_f16.n);
        if (TYPE_IDS[t] != QUANT_F16 && KVD_LINES == 1)
            printf("  (sanitizer build: one line per file; the accuracy bounds are checked in release)\n");
        else if (TYPE_IDS[t] != QUANT_F16) {
            const double o = kl_mean(&own), sc = kl_mean(&same_common), fc = kl_mean(&vs_f16_common);
            printf("  %s issue goals: vs llama.cpp %s <= own/2 %s (ratio to own %.2f); vs llama.cpp f16 <= 1.25 x own "
                   "%s (ratio %.2f)\n", TYPES[t], TYPES[t], sc <= o / 2 ? "met" : "NOT MET", sc / o,
                   fc <= 1.25 * o ? "met" : "NOT MET", fc / o);
            CHECK(own.n > 0);
            /* The goals; without the rotation of kv_attn.h q4_0 sat at 2.4-3.1x and 1.5x. */
            CHECK(sc <= 0.5 * o);
            CHECK(fc <= 1.25 * o);
        }
        check_bits(e, &t_ref.lines[0], TYPES[t]);
        engine_close(e);
        free_ref(&t_ref);
    }
    free_ref(&f16_ref);
}

int main(void) {
    check_expected_isa("test_kv_downloads");
    int n_run = 0, n_skipped = 0;
    for (size_t c = 0; c < sizeof MODELS / sizeof MODELS[0]; c++) {
        char rel[160], mpath[1024], rpath[1024];
        snprintf(rel, sizeof rel, "downloads/models/%s.gguf", MODELS[c]);
        const char *mp = test_shared_path(rel, mpath, sizeof mpath);
        snprintf(rel, sizeof rel, "downloads/reference/%s-kvf16.jsonl", MODELS[c]);
        if (!mp || !test_shared_path(rel, rpath, sizeof rpath)) {
            printf("test_kv_downloads: %s or its kv references absent, skipped\n", MODELS[c]);
            n_skipped++;
            continue;
        }
        run_model(MODELS[c], mp);
        n_run++;
    }
    return test_finish("test_kv_downloads", n_run, n_skipped);
}
