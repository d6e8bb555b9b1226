/* test_tokenizer — SPM tokenizer against llama.cpp's tokenization of the reference
 * prompts, plus edge cases (spaces, non-ASCII, invalid UTF-8, long input, round trip). */
#include <dirent.h>
#include <stdbool.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "gguf.h"
#include "kvshard.h"
#include "tokenizer.h"
#include "test.h"

#define MAX_IDS 4096

static int encode(const tok_vocab *v, const char *s, bool bos, int32_t *ids, int *n) {
    return tok_encode(v, s, strlen(s), bos, ids, MAX_IDS, n);
}

/* Concatenated pieces of ids[0..n) into out (NUL-terminated); returns its length. */
static size_t detok(const tok_vocab *v, const int32_t *ids, int n, char *out, size_t cap) {
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        size_t pl = 0;
        int rc = tok_piece(v, ids[i], out + len, cap - 1 - len, &pl);
        CHECK_EQ_INT(rc, KVS_OK);
        if (len + pl >= cap) break;
        len += pl;
    }
    out[len] = '\0';
    return len;
}

/* First token after the stories byte tokens (3..258) whose piece is text. */
static int32_t find_token(const tok_vocab *v, const char *text) {
    char buf[64];
    for (int32_t i = 259; i < tok_n_vocab(v); i++) {
        size_t pl = 0;
        if (tok_piece(v, i, buf, sizeof buf, &pl) == KVS_OK && pl == strlen(text) && memcmp(buf, text, pl) == 0)
            return i;
    }
    return -1;
}

/* Every line of every reference file: tok_encode(prompt, BOS) == tokens[0..n_prompt). */
static int check_reference(const tok_vocab *v, const char *ref_dir, int *n_files) {
    DIR *d = opendir(ref_dir);
    if (!d) return 0;
    int n_prompts = 0;
    struct dirent *e;
    char path[1024];
    char *line = NULL;
    size_t line_cap = 0;
    while ((e = readdir(d)) != NULL) {
        size_t nl = strlen(e->d_name);
        if (nl < 6 || strcmp(e->d_name + nl - 6, ".jsonl") != 0) continue;
        /* every reference model (stories260K-*, synth-*) uses the stories tokenizer; the
         * large-vocabulary files beside them are test_tokenizer_bpe's */
        if (strncmp(e->d_name, "stories260K", 11) != 0 && strncmp(e->d_name, "synth-", 6) != 0) continue;
        int pn = snprintf(path, sizeof path, "%s/%s", ref_dir, e->d_name);
        if (pn < 0 || (size_t)pn >= sizeof path) continue;
        FILE *f = fopen(path, "r");
        CHECK(f != NULL);
        if (!f) continue;
        (*n_files)++;
        ssize_t got;
        int lineno = 0;
        while ((got = getline(&line, &line_cap, f)) > 0) {
            lineno++;
            if (got <= 1) continue;
            cJSON *j = cJSON_ParseWithLength(line, (size_t)got);
            CHECK(j != NULL);
            if (!j) continue;
            const cJSON *jp = cJSON_GetObjectItemCaseSensitive(j, "prompt");
            const cJSON *jn = cJSON_GetObjectItemCaseSensitive(j, "n_prompt");
            const cJSON *jt = cJSON_GetObjectItemCaseSensitive(j, "tokens");
            CHECK(cJSON_IsString(jp) && cJSON_IsNumber(jn) && cJSON_IsArray(jt));
            if (cJSON_IsString(jp) && cJSON_IsNumber(jn) && cJSON_IsArray(jt)) {
                int n_prompt = jn->valueint;
                CHECK(n_prompt > 0 && n_prompt <= cJSON_GetArraySize(jt));
                int32_t ids[MAX_IDS];
                int n = 0;
                CHECK_EQ_INT(encode(v, jp->valuestring, true, ids, &n), KVS_OK);
                bool same = n == n_prompt;
                for (int i = 0; same && i < n; i++) same = ids[i] == cJSON_GetArrayItem(jt, i)->valueint;
                if (!same) {
                    fprintf(stderr, "%s:%d: prompt \"%s\": got %d ids, want %d\n  got: ", e->d_name, lineno,
                            jp->valuestring, n, n_prompt);
                    for (int i = 0; i < n && i < MAX_IDS; i++) fprintf(stderr, "%d ", ids[i]);
                    fprintf(stderr, "\n want:");
                    for (int i = 0; i < n_prompt; i++) fprintf(stderr, " %d", cJSON_GetArrayItem(jt, i)->valueint);
                    fprintf(stderr, "\n");
                }
                CHECK(same);
                n_prompts++;
            }
            cJSON_Delete(j);
        }
        fclose(f);
    }
    free(line);
    closedir(d);
    return n_prompts;
}

static void check_basics(const tok_vocab *v) {
    CHECK_EQ_INT(tok_n_vocab(v), 512);
    CHECK_EQ_INT(tok_bos(v), 1);
    CHECK_EQ_INT(tok_eos(v), 2);

    int32_t ids[MAX_IDS];
    int n = -1;
    /* empty text: only BOS (and nothing at all without it) */
    CHECK_EQ_INT(tok_encode(v, "", 0, true, ids, MAX_IDS, &n), KVS_OK);
    CHECK_EQ_INT(n, 1);
    CHECK_EQ_INT(ids[0], 1);
    CHECK_EQ_INT(tok_encode(v, NULL, 0, false, ids, MAX_IDS, &n), KVS_OK);
    CHECK_EQ_INT(n, 0);

    /* control tokens have no text; the byte tokens are their byte */
    char buf[16];
    size_t pl = 99;
    CHECK_EQ_INT(tok_piece(v, 1, buf, sizeof buf, &pl), KVS_OK);
    CHECK_EQ_INT(pl, 0);
    CHECK_EQ_INT(tok_piece(v, 2, buf, sizeof buf, &pl), KVS_OK);
    CHECK_EQ_INT(pl, 0);
    CHECK_EQ_INT(tok_piece(v, 0, buf, sizeof buf, &pl), KVS_OK); /* <unk> */
    CHECK_EQ_INT(pl, 0);
    CHECK_EQ_INT(tok_piece(v, 3 + 0x41, buf, sizeof buf, &pl), KVS_OK); /* <0x41> */
    CHECK_EQ_INT(pl, 1);
    CHECK_EQ_INT(buf[0], 'A');
    CHECK_EQ_INT(tok_piece(v, -1, buf, sizeof buf, &pl), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(tok_piece(v, 512, buf, sizeof buf, &pl), KVS_ERR_INVALID_ARG);
    /* truncated piece: reports the full length, writes only cap bytes */
    int32_t once = -1;
    CHECK_EQ_INT(encode(v, "Once", false, ids, &n), KVS_OK);
    if (n == 1) once = ids[0];
    CHECK(once >= 0);
    if (once >= 0) {
        memset(buf, 'x', sizeof buf);
        CHECK_EQ_INT(tok_piece(v, once, buf, 2, &pl), KVS_OK);
        CHECK_EQ_INT(pl, 5); /* " Once" */
        CHECK(buf[0] == ' ' && buf[1] == 'O' && buf[2] == 'x');
    }
}

static void check_spaces(const tok_vocab *v) {
    int32_t sp = find_token(v, " ");
    CHECK(sp >= 0);
    int32_t ids[MAX_IDS];
    int n = 0;
    char out[256];

    /* one space: prefix + the space = two U+2581; stories has "▁" but no "▁▁" */
    CHECK_EQ_INT(encode(v, " ", true, ids, &n), KVS_OK);
    CHECK_EQ_INT(n, 3);
    CHECK_EQ_INT(ids[1], sp);
    CHECK_EQ_INT(ids[2], sp);

    const char *cases[] = {"   ", "  hello", "hello  ", "a  b   c", " leading", "trailing ", "x"};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        CHECK_EQ_INT(encode(v, cases[c], true, ids, &n), KVS_OK);
        CHECK(n >= 2 && ids[0] == 1);
        detok(v, ids, n, out, sizeof out);
        char want[64];
        snprintf(want, sizeof want, " %s", cases[c]);
        if (strcmp(out, want) != 0) fprintf(stderr, "round trip: '%s' vs '%s'\n", out, want);
        CHECK(strcmp(out, want) == 0);
    }

    /* newlines are not in the stories vocab except as the byte <0x0A> */
    CHECK_EQ_INT(encode(v, "a\nb", false, ids, &n), KVS_OK);
    bool has_nl = false;
    for (int i = 0; i < n; i++) has_nl |= ids[i] == 3 + 0x0A;
    CHECK(has_nl);
    detok(v, ids, n, out, sizeof out);
    CHECK(strcmp(out, " a\nb") == 0);
    CHECK_EQ_INT(encode(v, "\n\n", false, ids, &n), KVS_OK);
    detok(v, ids, n, out, sizeof out);
    CHECK(strcmp(out, " \n\n") == 0);
}

static void check_non_ascii(const tok_vocab *v) {
    const char *cases[] = {"caf\xC3\xA9", "\xE6\x97\xA5\xE6\x9C\xAC", "hi \xF0\x9F\x98\x80 there",
                           "\xC3\xA9\xC3\xA9\xC3\xA9"};
    int32_t ids[MAX_IDS];
    int n = 0;
    char out[256];
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        CHECK_EQ_INT(encode(v, cases[c], false, ids, &n), KVS_OK);
        detok(v, ids, n, out, sizeof out);
        char want[64];
        snprintf(want, sizeof want, " %s", cases[c]);
        CHECK(strcmp(out, want) == 0);
    }
    /* 日本 is not in the 512-token vocab: 6 byte tokens after the prefix "▁" */
    CHECK_EQ_INT(encode(v, "\xE6\x97\xA5\xE6\x9C\xAC", false, ids, &n), KVS_OK);
    CHECK_EQ_INT(n, 7);
    const uint8_t bytes[6] = {0xE6, 0x97, 0xA5, 0xE6, 0x9C, 0xAC};
    for (int i = 0; i < 6 && i + 1 < n; i++) CHECK_EQ_INT(ids[i + 1], 3 + bytes[i]);
    /* the emoji becomes its 4 bytes */
    CHECK_EQ_INT(encode(v, "\xF0\x9F\x98\x80", false, ids, &n), KVS_OK);
    CHECK_EQ_INT(n, 5);
    if (n == 5) CHECK(ids[1] == 3 + 0xF0 && ids[2] == 3 + 0x9F && ids[3] == 3 + 0x98 && ids[4] == 3 + 0x80);
}

static void check_invalid_utf8(const tok_vocab *v) {
    /* stray continuation bytes, truncated sequences, 0xFF, NUL in the middle */
    const char bad[][8] = {"\x80", "\xBF\xBF", "a\xC3", "\xE6\x97", "\xF0\x9F\x98", "\xFF\xFE", "\xC0\xAF"};
    int32_t ids[MAX_IDS];
    int n = 0;
    char out[64];
    for (size_t c = 0; c < sizeof bad / sizeof *bad; c++) {
        size_t len = strlen(bad[c]);
        CHECK_EQ_INT(tok_encode(v, bad[c], len, true, ids, MAX_IDS, &n), KVS_OK);
        size_t ol = detok(v, ids, n, out, sizeof out);
        CHECK(ol == len + 1 && memcmp(out + 1, bad[c], len) == 0);
    }
    /* a lead byte that swallows part of an escaped space (U+2581 is 3 bytes): more
     * characters than input bytes; the space's bytes come back as byte tokens */
    const char *swallow[] = {"\xC3 ", "\xF0 a", "a\xE6  b", "\xF0\xF0\xF0 \xF0  \xE0 "};
    for (size_t c = 0; c < sizeof swallow / sizeof *swallow; c++) {
        CHECK_EQ_INT(encode(v, swallow[c], true, ids, &n), KVS_OK);
        for (int i = 0; i < n; i++) CHECK(ids[i] >= 0 && ids[i] < tok_n_vocab(v));
    }
    const char with_nul[] = {'a', '\0', 'b'};
    CHECK_EQ_INT(tok_encode(v, with_nul, 3, false, ids, MAX_IDS, &n), KVS_OK);
    size_t ol = detok(v, ids, n, out, sizeof out);
    CHECK(ol == 4 && memcmp(out + 1, with_nul, 3) == 0);
}

static void check_too_large(const tok_vocab *v) {
    const char *s = "Once upon a time there was a little girl";
    int32_t ids[MAX_IDS];
    int n_full = 0, n = 0;
    CHECK_EQ_INT(encode(v, s, true, ids, &n_full), KVS_OK);
    CHECK(n_full > 3);
    int32_t small[3] = {-7, -7, -7};
    CHECK_EQ_INT(tok_encode(v, s, strlen(s), true, small, 2, &n), KVS_ERR_TOO_LARGE);
    CHECK_EQ_INT(n, n_full);
    CHECK_EQ_INT(small[0], ids[0]);
    CHECK_EQ_INT(small[1], ids[1]);
    CHECK_EQ_INT(small[2], -7);
    /* sizing call */
    CHECK_EQ_INT(tok_encode(v, s, strlen(s), true, NULL, 0, &n), KVS_ERR_TOO_LARGE);
    CHECK_EQ_INT(n, n_full);
    CHECK_EQ_INT(tok_encode(v, s, strlen(s), true, ids, n_full, &n), KVS_OK);
    CHECK_EQ_INT(tok_encode(NULL, s, strlen(s), true, ids, n_full, &n), KVS_ERR_INVALID_ARG);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* 100 KB of text (and 100 KB of one repeated letter, the worst case for merges). */
static void check_long_input(const tok_vocab *v) {
    enum { LEN = 100 * 1024 };
    char *text = malloc(LEN + 1);
    int32_t *ids = malloc((LEN + 2) * sizeof *ids);
    char *out = malloc(LEN + 16);
    CHECK(text && ids && out);
    if (!text || !ids || !out) goto done;
    const char *base = "Lily and Ben were friends. One day, they found a big red ball in the garden. ";
    size_t bl = strlen(base);
    for (size_t i = 0; i < LEN; i++) text[i] = base[i % bl];
    text[LEN] = '\0';
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) memset(text, 'a', LEN);
        int n = 0;
        double t0 = now_s();
        CHECK_EQ_INT(tok_encode(v, text, LEN, true, ids, LEN + 2, &n), KVS_OK);
        double dt = now_s() - t0;
        CHECK(dt < 2.0); /* O(n log n): milliseconds in practice, even under ASan */
        CHECK(n > 1 && n <= (pass == 0 ? LEN / 2 : LEN + 1));
        if (dt > 0.05) fprintf(stderr, "note: 100 KB took %.3f s (pass %d)\n", dt, pass);
        size_t ol = detok(v, ids, n, out, LEN + 16);
        CHECK(ol == LEN + 1 && out[0] == ' ' && memcmp(out + 1, text, LEN) == 0);
    }
done:
    free(text);
    free(ids);
    free(out);
}

/* A vocab written through the GGUF writer: user-defined tokens, no space prefix,
 * a missing model key. Needs gguf.c's writer; exercises paths stories does not. */
/* An SPM vocab without byte tokens or an unknown token: text it can spell encodes, a
 * character it cannot is refused (KVS_ERR_UNSUPPORTED), never encoded as id -1. */
static void check_no_byte_fallback(void) {
    const char *toks[] = {"<s>", "</s>", "a", "b", "ab"};
    const uint32_t lens[] = {3, 4, 1, 1, 2};
    const float scores[] = {0, 0, -1, -1, -0.5f};
    const int32_t types[] = {3, 3, 1, 1, 1};
    tok_arrays a = {.n_vocab = 5, .texts = toks, .text_lens = lens, .scores = scores, .types = types,
                    .bos = 0, .eos = 1, .unk = -1, .add_space_prefix = false};
    tok_vocab *v = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(tok_from_arrays(&a, &v, msg, sizeof msg), KVS_OK);
    if (!v) return;
    int32_t ids[16] = {0};
    int n = 0;
    CHECK_EQ_INT(tok_encode(v, "abab", 4, false, ids, 16, &n), KVS_OK);
    CHECK_EQ_INT(n, 2);
    if (n == 2) CHECK(ids[0] == 4 && ids[1] == 4);
    n = 0;
    int rc = tok_encode(v, "az", 2, false, ids, 16, &n);
    CHECK_EQ_INT(rc, KVS_ERR_UNSUPPORTED);
    for (int i = 0; rc == KVS_OK && i < n && i < 16; i++) CHECK(ids[i] >= 0);
    printf("  a vocab without byte or unknown tokens refuses 'z' (%s), never id -1\n", kvs_strerror(rc));
    tok_free(v);
}

static void check_synthetic_vocab(void) {
    const char *toks[] = {"<unk>", "<s>", "</s>", "<0x61>", "<0x62>", "a", "b", "ab", "\xE2\x96\x81", "<sep>", "ba"};
    const float scores[] = {0, 0, 0, 0, 0, -1, -1, -2, -1, 0, -0.5f};
    const int32_t types[] = {2, 3, 3, 6, 6, 1, 1, 1, 1, 4, 1};
    const int nt = (int)(sizeof toks / sizeof *toks);
    gguf_writer *w = gguf_writer_create();
    CHECK(w != NULL);
    if (!w) return;
    CHECK_EQ_INT(gguf_writer_set_str(w, "tokenizer.ggml.model", "llama"), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)nt), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", scores, (uint64_t)nt), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, (uint64_t)nt), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", false), KVS_OK);
    char path[] = "/tmp/kvs_test_tok_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0) {
        gguf_writer_free(w);
        return;
    }
    close(fd);
    char msg[KVS_MSG_MAX] = "";
    int rc = gguf_writer_write(w, path, msg, sizeof msg);
    CHECK_EQ_INT(rc, KVS_OK);
    gguf_writer_free(w);
    gguf_ctx *g = NULL;
    if (rc == KVS_OK) rc = gguf_open(path, &g, msg, sizeof msg);
    CHECK_EQ_INT(rc, KVS_OK);
    tok_vocab *v = NULL;
    if (rc == KVS_OK) rc = tok_from_gguf(g, &v, msg, sizeof msg);
    CHECK_EQ_INT(rc, KVS_OK);
    if (rc == KVS_OK) {
        int32_t ids[64];
        int n = 0;
        /* "ba" (-0.5) beats "ab" (-2): b a b -> ba b ; no space prefix */
        CHECK_EQ_INT(tok_encode(v, "bab", 3, false, ids, 64, &n), KVS_OK);
        CHECK_EQ_INT(n, 2);
        if (n == 2) CHECK(ids[0] == 10 && ids[1] == 6);
        /* user-defined token split out verbatim; a raw fragment after it gets no prefix */
        CHECK_EQ_INT(tok_encode(v, "a<sep>b c", 9, true, ids, 64, &n), KVS_OK);
        const int32_t want[] = {1, 5, 9, 6, 8, 0};
        CHECK_EQ_INT(n, 6);
        for (int i = 0; i < n && i < 6; i++) CHECK_EQ_INT(ids[i], want[i]);
        /* unknown byte without a <0xNN> token -> unk */
        CHECK_EQ_INT(tok_encode(v, "c", 1, false, ids, 64, &n), KVS_OK);
        CHECK_EQ_INT(n, 1);
        CHECK_EQ_INT(ids[0], 0);
        char buf[16];
        size_t pl = 0;
        CHECK_EQ_INT(tok_piece(v, 9, buf, sizeof buf, &pl), KVS_OK);
        CHECK(pl == 5 && memcmp(buf, "<sep>", 5) == 0);
    }
    tok_free(v);
    gguf_close(g);

    /* "none" ids (UINT32_MAX) clear a special token; an id past the vocab is refused;
     * arrays of different lengths are refused */
    for (int pass = 0; pass < 3; pass++) {
        w = gguf_writer_create();
        CHECK(w != NULL);
        if (!w) break;
        gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
        gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)nt);
        if (pass == 0) gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", UINT32_MAX);
        if (pass == 1) gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)nt);
        if (pass == 2) gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", scores, (uint64_t)nt - 1);
        g = NULL;
        v = NULL;
        rc = gguf_writer_write(w, path, msg, sizeof msg);
        CHECK_EQ_INT(rc, KVS_OK);
        if (rc == KVS_OK && gguf_open(path, &g, msg, sizeof msg) == KVS_OK) {
            rc = tok_from_gguf(g, &v, msg, sizeof msg);
            CHECK_EQ_INT(rc, pass == 0 ? KVS_OK : KVS_ERR_FORMAT);
            if (pass == 0 && v) {
                CHECK_EQ_INT(tok_eos(v), -1);
                CHECK_EQ_INT(tok_bos(v), 1);
            }
            if (pass != 0) CHECK(v == NULL);
        }
        tok_free(v);
        gguf_close(g);
        gguf_writer_free(w);
    }

    /* a tokenizer model other than llama / gpt2 is refused */
    w = gguf_writer_create();
    CHECK(w != NULL);
    if (w) {
        gguf_writer_set_str(w, "tokenizer.ggml.model", "bert");
        gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)nt);
        g = NULL;
        v = NULL;
        rc = gguf_writer_write(w, path, msg, sizeof msg);
        CHECK_EQ_INT(rc, KVS_OK);
        if (rc == KVS_OK && gguf_open(path, &g, msg, sizeof msg) == KVS_OK) {
            CHECK_EQ_INT(tok_from_gguf(g, &v, msg, sizeof msg), KVS_ERR_UNSUPPORTED);
            CHECK(v == NULL);
        }
        gguf_close(g);
        gguf_writer_free(w);
    }
    unlink(path);
}

int main(void) {
    int n_run = 0, n_skipped = 0;
    char path[1024], ref[1024];
    check_synthetic_vocab();
    check_no_byte_fallback();
    n_run++;

    /* stories260K's vocab; the downloads' synth files carry the same one */
    const char *ref_rel = "reference";
    if (!test_shared_path("models/stories260K.gguf", path, sizeof path)) {
        if (!test_shared_path("downloads/models/synth-Q5_1.gguf", path, sizeof path)) {
            n_skipped++;
            return test_finish("test_tokenizer", n_run, n_skipped);
        }
        ref_rel = "downloads/reference";
    }
    gguf_ctx *g = NULL;
    char msg[KVS_MSG_MAX] = "";
    int rc = gguf_open(path, &g, msg, sizeof msg);
    if (rc != KVS_OK) fprintf(stderr, "gguf_open(%s): %s: %s\n", path, kvs_strerror(rc), msg);
    CHECK_EQ_INT(rc, KVS_OK);
    tok_vocab *v = NULL;
    if (rc == KVS_OK) {
        rc = tok_from_gguf(g, &v, msg, sizeof msg);
        if (rc != KVS_OK) fprintf(stderr, "tok_from_gguf: %s: %s\n", kvs_strerror(rc), msg);
        CHECK_EQ_INT(rc, KVS_OK);
    }
    gguf_close(g); /* the vocab holds copies */
    if (v) {
        check_basics(v);
        check_spaces(v);
        check_non_ascii(v);
        check_invalid_utf8(v);
        check_too_large(v);
        check_long_input(v);
        n_run++;
        if (test_shared_path(ref_rel, ref, sizeof ref)) {
            int n_files = 0;
            int n_prompts = check_reference(v, ref, &n_files);
            printf("test_tokenizer: %d reference prompts in %d files checked\n", n_prompts, n_files);
            CHECK(n_prompts > 0);
            n_run++;
        } else {
            n_skipped++;
        }
    }
    tok_free(v);
    return test_finish("test_tokenizer", n_run, n_skipped);
}
