/* kvshard tokenize / detokenize: a file's tokenizer alone (no weights are read), printed as
 * JSON — the tools for checking a file's text side against another implementation. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "gen_loop.h"
#include "gguf.h"
#include "tokenizer.h"
#include "util.h"

/* Opens path's tokenizer (reported on failure as "kvshard CMD: path: why"). */
static int open_vocab(const char *cmd, const char *path, tok_vocab **out) {
    char msg[KVS_MSG_MAX] = "";
    gguf_ctx *g = NULL;
    int err = gguf_open(path, &g, msg, sizeof msg);
    if (err == KVS_OK) err = tok_from_gguf(g, out, msg, sizeof msg);
    gguf_close(g);
    if (err) fprintf(stderr, "kvshard %s: %s: %s\n", cmd, path, msg[0] ? msg : kvs_strerror(err));
    return err;
}

static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        size_t k = fread(buf + len, 1, cap - len, f);
        len += k;
        if (len < cap) break;
        char *nb = cap > (1u << 30) ? NULL : realloc(buf, 2 * cap + 1);
        if (!nb) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = nb;
        cap *= 2;
    }
    if (buf && ferror(f)) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[len] = 0;
        *n = len;
    }
    return buf;
}

static void tokenize_usage(FILE *f) {
    fprintf(f, "usage: kvshard tokenize -m MODEL (-p TEXT | -f FILE) [--plain] [--no-bos] [--stats]\n"
               "  prints {\"ids\":[...]}: BOS as the file says (tokenizer.ggml.add_bos_token), special-token\n"
               "  text such as <|eot_id|> read as that token\n"
               "  --plain     read special-token text as plain text\n"
               "  --no-bos    never add BOS\n"
               "  --stats     one JSON line on stderr: bytes, tokens, load and tokenize times, MB/s\n");
}

int cmd_tokenize(int argc, char **argv) {
    const char *path = NULL, *text = NULL, *file = NULL;
    bool plain = false, no_bos = false, stats = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { tokenize_usage(stdout); return 0; }
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &path);
        else if (!strcmp(a, "-p")) ok = args_str(argc, argv, &i, &text);
        else if (!strcmp(a, "-f")) ok = args_str(argc, argv, &i, &file);
        else if (!strcmp(a, "--plain")) plain = true;
        else if (!strcmp(a, "--no-bos")) no_bos = true;
        else if (!strcmp(a, "--stats")) stats = true;
        else { fprintf(stderr, "kvshard tokenize: unknown option '%s'\n", a); tokenize_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    if (!path || !text == !file) {
        fprintf(stderr, "kvshard tokenize: -m MODEL and exactly one of -p TEXT / -f FILE are required\n");
        tokenize_usage(stderr);
        return 2;
    }
    char *owned = NULL;
    size_t len = 0;
    if (file) {
        if (!(owned = read_all(file, &len))) {
            fprintf(stderr, "kvshard tokenize: cannot read %s\n", file);
            return 1;
        }
        text = owned;
    } else {
        len = strlen(text);
    }
    uint64_t t0 = kvs_now_ns();
    tok_vocab *v = NULL;
    if (open_vocab("tokenize", path, &v)) {
        free(owned);
        return 1;
    }
    uint64_t t1 = kvs_now_ns();
    int rc = 1, n = 0;
    bool bos = !no_bos && tok_add_bos(v);
    /* One pass: a token covers at least one byte, except that an invalid byte (read as
     * U+FFFD) may give up to 3; so 3 * len + 2 ids always fit. */
    int32_t *ids = len < (1u << 28) ? malloc((3 * len + 2) * sizeof *ids) : NULL;
    int err = ids ? tok_encode_ex(v, text, len, bos, !plain, ids, (int)(3 * len + 2), &n) : KVS_ERR_TOO_LARGE;
    uint64_t t2 = kvs_now_ns();
    if (err) {
        fprintf(stderr, "kvshard tokenize: %s\n", kvs_strerror(err));
        goto out;
    }
    fputs("{\"ids\":[", stdout);
    for (int i = 0; i < n; i++) printf(i ? ",%d" : "%d", (int)ids[i]);
    fputs("]}\n", stdout);
    if (stats) {
        /* tokenize_ms is the one pass over the text (the vocab is loaded in load_ms) */
        double ms = (double)(t2 - t1) / 1e6;
        fprintf(stderr, "{\"bytes\":%zu,\"tokens\":%d,\"load_ms\":%.3f,\"tokenize_ms\":%.3f,\"mb_s\":%.3f}\n", len, n,
                (double)(t1 - t0) / 1e6, ms, ms > 0 ? (double)len / 1e6 / (ms / 1e3) : 0.0);
    }
    rc = 0;
out:
    free(ids);
    free(owned);
    tok_free(v);
    return rc;
}

static void detokenize_usage(FILE *f) {
    fprintf(f, "usage: kvshard detokenize -m MODEL --tokens ID,ID,... [--no-special]\n"
               "  prints {\"text\":\"...\"}: the pieces joined as llama.cpp's detokenizer does, special\n"
               "  tokens rendered as their text (--no-special: left out); bad UTF-8 shown as U+FFFD\n");
}

int cmd_detokenize(int argc, char **argv) {
    const char *path = NULL, *toks = NULL;
    bool special = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { detokenize_usage(stdout); return 0; }
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &path);
        else if (!strcmp(a, "--tokens")) ok = args_str(argc, argv, &i, &toks);
        else if (!strcmp(a, "--no-special")) special = false;
        else { fprintf(stderr, "kvshard detokenize: unknown option '%s'\n", a); detokenize_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    if (!path || !toks) {
        fprintf(stderr, "kvshard detokenize: -m MODEL and --tokens are required\n");
        detokenize_usage(stderr);
        return 2;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    if (args_ids(toks, &ids, &n) != 0) {
        fprintf(stderr, "kvshard detokenize: --tokens wants comma-separated ids, got '%s'\n", toks);
        return 2;
    }
    tok_vocab *v = NULL;
    if (open_vocab("detokenize", path, &v)) {
        free(ids);
        return 1;
    }
    int rc = 1;
    char *text = NULL, *valid = NULL;
    size_t len = 0, vl = 0;
    int err = tok_detokenize(v, ids, n, special, &text, &len);
    if (err == KVS_ERR_INVALID_ARG) {
        fprintf(stderr, "kvshard detokenize: a token id is outside the vocabulary (%d)\n", (int)tok_n_vocab(v));
        goto out;
    }
    if (err || tok_utf8_repair(text, len, &valid, &vl) != KVS_OK) {
        fprintf(stderr, "kvshard detokenize: %s\n", kvs_strerror(err ? err : KVS_ERR_NOMEM));
        goto out;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "text", valid);
    char *s = cJSON_PrintUnformatted(o);
    if (s) puts(s);
    free(s);
    cJSON_Delete(o);
    rc = 0;
out:
    free(valid);
    free(text);
    free(ids);
    tok_free(v);
    return rc;
}
