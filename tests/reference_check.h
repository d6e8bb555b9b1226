/*
 * reference_check — the checks of test_reference and test_reference_downloads
 * against llama.cpp's full-logit references (format: ../shared/reference/README.md):
 * token ids, teacher-forced logits (max abs difference, mean KL, top-1
 * mismatches only at near-ties), greedy continuations up to the first near-tie;
 * plus the KV path (prompt, then one token at a time) against the one-batch
 * path, and a model split in two ranges passing hidden states against the
 * whole model. Included by exactly one test file each (static functions).
 */
#ifndef KVS_REFERENCE_CHECK_H
#define KVS_REFERENCE_CHECK_H

#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>

#include "engine_check.h"
#include "isa_check.h"
#include "jsonl.h"
#include "quant.h"
#include "sampler.h"
#include "test.h"
#include "util.h"

typedef struct {
    const char *name;
    double max_diff, max_kl, top1_margin, greedy_margin;
} ref_case;

static double kl_div(const float *ref, const float *ours, int n) {
    double mr = -INFINITY, mo = -INFINITY;
    for (int i = 0; i < n; i++) {
        if (ref[i] > mr) mr = ref[i];
        if (ours[i] > mo) mo = ours[i];
    }
    double zr = 0, zo = 0;
    for (int i = 0; i < n; i++) {
        zr += exp(ref[i] - mr);
        zo += exp(ours[i] - mo);
    }
    double lzr = log(zr) + mr, lzo = log(zo) + mo, kl = 0;
    for (int i = 0; i < n; i++) {
        double lpr = ref[i] - lzr, lpo = ours[i] - lzo;
        kl += exp(lpr) * (lpr - lpo);
    }
    return kl;
}

static double top_margin(const float *x, int n, int *top) {
    int a = sampler_argmax(x, n);
    double second = -INFINITY;
    for (int i = 0; i < n; i++)
        if (i != a && x[i] > second) second = x[i];
    *top = a;
    return x[a] - second;
}

typedef struct {
    double max_diff, kl_sum;
    long positions, top1_mismatch, greedy_checked, kv_mismatch, split_mismatch;
} file_stats;

static void check_line(const ref_case *rc, engine *whole, engine *head, engine *tail, cJSON *line, int line_no,
                       file_stats *fs) {
    const char *prompt = cJSON_GetStringValue(cJSON_GetObjectItem(line, "prompt"));
    int n_prompt = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(line, "n_prompt"));
    cJSON *jt = cJSON_GetObjectItem(line, "tokens"), *jl = cJSON_GetObjectItem(line, "logits");
    cJSON *jm = cJSON_GetObjectItem(line, "greedy_margins");
    CHECK(prompt && jt && jl && jm);
    if (!prompt || !jt || !jl || !jm) return;
    int n = cJSON_GetArraySize(jt), nv = (int)whole->m->hp.n_vocab;
    CHECK_EQ_INT(cJSON_GetArraySize(jl), n);
    int32_t *ref_tok = malloc((size_t)n * sizeof(int32_t));
    float *ref_log = malloc((size_t)n * (size_t)nv * sizeof(float));
    float *ours = malloc((size_t)n * (size_t)nv * sizeof(float));
    float *step = malloc((size_t)nv * sizeof(float));
    float *hid = malloc((size_t)n * whole->m->hp.n_embd * sizeof(float));
    float *split = malloc((size_t)n * (size_t)nv * sizeof(float));
    for (int i = 0; i < n; i++) {
        ref_tok[i] = (int32_t)cJSON_GetNumberValue(cJSON_GetArrayItem(jt, i));
        cJSON *row = cJSON_GetArrayItem(jl, i);
        CHECK_EQ_INT(cJSON_GetArraySize(row), nv);
        for (int j = 0; j < nv; j++) ref_log[(size_t)i * nv + j] = (float)cJSON_GetNumberValue(cJSON_GetArrayItem(row, j));
    }

    /* 1. Token ids. */
    int32_t ids[512];
    int n_ids = 0;
    CHECK_EQ_INT(tok_encode(whole->vocab, prompt, strlen(prompt), true, ids, 512, &n_ids), KVS_OK);
    CHECK_EQ_INT(n_ids, n_prompt);
    for (int i = 0; i < n_prompt && i < n_ids; i++) CHECK_EQ_INT(ids[i], ref_tok[i]);

    /* 2. Teacher-forced logits, one batch. */
    engine_req req = {.epoch = 1, .n = (uint32_t)n, .tokens = ref_tok, .out_mode = FWD_OUT_LOGITS_ALL, .out = ours};
    set_sid(&req.sid, line_no * 10 + 1);
    CHECK_EQ_INT(engine_step(whole, &req, 1), KVS_OK);
    CHECK_EQ_INT(req.status, KVS_OK);
    for (int i = 0; i < n; i++) {
        const float *r = ref_log + (size_t)i * nv, *o = ours + (size_t)i * nv;
        for (int j = 0; j < nv; j++) {
            double d = fabs((double)r[j] - (double)o[j]);
            if (d > fs->max_diff) fs->max_diff = d;
        }
        fs->kl_sum += kl_div(r, o, nv);
        fs->positions++;
        int rt, ot = sampler_argmax(o, nv);
        double margin = top_margin(r, nv, &rt);
        if (rt != ot) {
            fs->top1_mismatch++;
            if (margin >= rc->top1_margin) {
                fprintf(stderr, "%s line %d pos %d: top-1 %d vs ref %d with ref margin %.4f >= %.2f\n", rc->name, line_no, i,
                        ot, rt, margin, rc->top1_margin);
                test_failures_++;
            }
        }
    }

    /* 3. KV path: prompt, then the reference tokens one at a time. */
    kv_sid sid;
    set_sid(&sid, line_no * 10 + 2);
    if (!kv_path_matches(whole, sid, ref_tok, n_prompt, n, split, ours)) fs->kv_mismatch++;

    /* 4. Greedy continuation with our own argmax through the KV cache. */
    const int n_greedy = n - n_prompt;
    set_sid(&sid, line_no * 10 + 3);
    engine_req g = {.sid = sid, .epoch = 1, .n = (uint32_t)n_prompt, .tokens = ref_tok, .out_mode = FWD_OUT_LOGITS_LAST,
                    .out = step};
    int32_t cur;
    for (int i = 0; i < n_greedy; i++) {
        CHECK_EQ_INT(engine_step(whole, &g, 1), KVS_OK);
        cur = sampler_argmax(step, nv);
        double m = cJSON_GetNumberValue(cJSON_GetArrayItem(jm, i));
        if (cur != ref_tok[n_prompt + i]) {
            if (m >= rc->greedy_margin) {
                fprintf(stderr, "%s line %d greedy step %d: %d vs ref %d (ref margin %.4f)\n", rc->name, line_no, i, cur,
                        ref_tok[n_prompt + i], m);
                test_failures_++;
            }
            break;
        }
        fs->greedy_checked++;
        if (m < rc->greedy_margin) break; /* past a near-tie either continuation is valid */
        g.start_pos += g.n;
        g.n = 1;
        g.tokens = &ref_tok[n_prompt + i];
    }

    /* 5. Two ranges passing hidden states. */
    if (head && tail && !split_matches(head, tail, line_no * 10 + 4, ref_tok, n, hid, split, ours)) fs->split_mismatch++;
    free(ref_tok); free(ref_log); free(ours); free(step); free(hid); free(split);
}

typedef struct {
    const ref_case *rc;
    engine_halves *eh;
    file_stats *fs;
} line_ctx;

static void check_line_cb(cJSON *line, int line_no, void *ctx) {
    line_ctx *c = ctx;
    check_line(c->rc, c->eh->whole, c->eh->head, c->eh->tail, line, line_no, c->fs);
}

/* Runs every case on dir/models/NAME.gguf against dir/reference/NAME.jsonl, dir
 * being a folder under ../shared with its "/" ("" for the top level); a case
 * whose files are missing is skipped with a note. Returns test_finish's code. */
static int run_ref_cases(const char *test_name, const char *dir, const ref_case *cases, size_t n_cases) {
    check_expected_isa(test_name);
    int n_run = 0, n_skipped = 0;
    for (size_t c = 0; c < n_cases; c++) {
        const ref_case *rc = &cases[c];
        char rel[128], mpath[1024], rpath[1024];
        snprintf(rel, sizeof(rel), "%smodels/%s.gguf", dir, rc->name);
        const char *mp = test_shared_path(rel, mpath, sizeof(mpath));
        snprintf(rel, sizeof(rel), "%sreference/%s.jsonl", dir, strcmp(rc->name, "stories260K") ? rc->name : "stories260K-F32");
        const char *rp = test_shared_path(rel, rpath, sizeof(rpath));
        if (!mp || !rp) { n_skipped++; continue; }
        /* A model whose matrices the loader repacks (r8, quant.h) runs twice: as
         * loaded, then with repacking off, so the row-layout kernels stay covered. */
        for (int pass = 0; pass < 2; pass++) {
            engine_halves eh;
            if (!open_halves(mp, 64ull << 20, &eh)) break;
            const model *wm = eh.whole->m;
            const int repacked = wm->n_repacked;
            if (pass == 0 && quant_r8_preferred(wm->layers[0].w_up.type)) CHECK(repacked > 0);
            file_stats fs = {0};
            line_ctx lc = {rc, &eh, &fs};
            int line_no = jsonl_each(rp, INT_MAX, check_line_cb, &lc);
            double mean_kl = fs.positions ? fs.kl_sum / (double)fs.positions : 0;
            printf("%-18s %s lines %d positions %ld max|diff| %.4f (<= %.2f) mean KL %.2e (<= %.0e) top-1 mismatches "
                   "%ld greedy ids checked %ld kv-path mismatches %ld split mismatches %ld\n",
                   rc->name, repacked ? "r8  " : "rows", line_no, fs.positions, fs.max_diff, rc->max_diff, mean_kl,
                   rc->max_kl, fs.top1_mismatch, fs.greedy_checked, fs.kv_mismatch, fs.split_mismatch);
            CHECK(line_no > 0);
            CHECK(fs.max_diff <= rc->max_diff);
            CHECK(mean_kl <= rc->max_kl);
            CHECK_EQ_INT(fs.kv_mismatch, 0);
            CHECK_EQ_INT(fs.split_mismatch, 0);
            close_halves(&eh);
            n_run++;
            if (pass == 1 || !repacked) break;
            quant_r8_set_enabled(false);
        }
        quant_r8_set_enabled(true);
    }
    return test_finish(test_name, n_run, n_skipped);
}

#endif /* KVS_REFERENCE_CHECK_H */
