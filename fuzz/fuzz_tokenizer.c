/* fuzz_tokenizer — libFuzzer target for the tokenizer (tok_encode_ex, tok_detokenize, the
 * UTF-8 helpers) over random bytes with random special-token text spliced in.
 *
 * Vocabs: a small SPM and a small byte-level BPE vocab built from arrays (always), and the
 * Llama 3 and Qwen2 vocabularies of ../shared/downloads when present (KVS_SHARED_DIR or
 * ../shared, loaded once).
 * Input: byte 0 picks the vocab and the flags; in the rest, byte 0x01 followed by k inserts
 * special-token text number k (complete or cut short), so the partitioner sees real and
 * broken special tokens at random places.
 * Checked: encoding never fails on any input and gives ids inside the vocab; detokenizing
 * them works; a repaired string is valid UTF-8; for the Qwen2 vocab (lossless: byte-level,
 * no space clean-up) valid UTF-8 text comes back byte for byte. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "kvshard.h"
#include "tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static tok_vocab *vocabs[4]; /* spm, bpe, llama3, qwen2 */

static const char *const SPECIALS[] = {
    "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|endoftext|>", "<think>", "</think>", "<s>", "</s>", "<|end|>", "<x>", "<|", "|>", "<|eot_id", "\xE2\x96\x81",
    "\xC4\xA0", "'s", " 're", "\r\n", "   ", "123456", "\xF0\x9F\x98",
};
#define N_SPECIALS (sizeof SPECIALS / sizeof SPECIALS[0])

static tok_vocab *synthetic(tok_kind kind) {
    static const char *const bpe_texts[] = {"a", "b", "c", "\xC4\xA0", "ab", "bc", "abc", "\xC4\240a", "<|eot_id|>",
                                            "<x>", "!", "1", "12"};
    static const char *const spm_texts[] = {"<unk>", "<s>", "</s>", "<0x41>", "<0xE2>", "\xE2\x96\x81", "a", "b",
                                            "ab", "\xE2\x96\201a", "<x>", "c"};
    static const char *const merges[] = {"b c", "a bc", "a b", "\xC4\xA0 a", "1 2", "bad"};
    const char *const *texts = kind == TOK_KIND_BPE ? bpe_texts : spm_texts;
    int n = kind == TOK_KIND_BPE ? 13 : 12;
    uint32_t lens[13], mlens[6];
    int32_t types[13];
    float scores[13];
    for (int i = 0; i < n; i++) {
        lens[i] = (uint32_t)strlen(texts[i]);
        types[i] = 1;
        scores[i] = (float)-i;
    }
    for (int i = 0; i < 6; i++) mlens[i] = (uint32_t)strlen(merges[i]);
    tok_arrays a = {.n_vocab = n, .texts = texts, .text_lens = lens, .types = types, .scores = scores, .kind = kind};
    if (kind == TOK_KIND_BPE) {
        types[8] = 3;
        types[9] = 4;
        a.bos = a.eos = a.unk = -1;
        a.pre = "llama-bpe";
        a.n_merges = 6;
        a.merges = merges;
        a.merge_lens = mlens;
    } else {
        types[0] = 2;
        types[1] = types[2] = 3;
        types[3] = types[4] = 6;
        types[10] = 4;
        a.bos = 1;
        a.eos = 2;
        a.unk = 0;
        a.add_space_prefix = true;
    }
    tok_vocab *v = NULL;
    char msg[KVS_MSG_MAX];
    if (tok_from_arrays(&a, &v, msg, sizeof msg) != KVS_OK) abort();
    return v;
}

static tok_vocab *from_file(const char *name) {
    const char *dir = getenv("KVS_SHARED_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/downloads/models/%s", dir ? dir : "../shared", name);
    gguf_ctx *g = NULL;
    tok_vocab *v = NULL;
    char msg[KVS_MSG_MAX];
    if (gguf_open(path, &g, msg, sizeof msg) == KVS_OK) tok_from_gguf(g, &v, msg, sizeof msg);
    gguf_close(g);
    return v;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    vocabs[0] = synthetic(TOK_KIND_SPM);
    vocabs[1] = synthetic(TOK_KIND_BPE);
    vocabs[2] = from_file("llama3-synth-Q4_K_M.gguf");
    vocabs[3] = from_file("qwen2-synth-Q8_0.gguf");
    return 0;
}

static bool valid_utf8(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        int k = tok_utf8_char(s + i, n - i, NULL);
        if (k <= 0) return false;
        i += (size_t)k;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    int which = data[0] & 3;
    bool parse_special = data[0] & 4, add_bos = data[0] & 8;
    tok_vocab *v = vocabs[which] ? vocabs[which] : vocabs[which & 1];

    /* Build the text: 0x01 k splices special text k (cut short when k's high bit is set). */
    char *text = malloc(size * 24 + 1);
    if (!text) return 0;
    size_t n = 0;
    bool spliced = false;
    for (size_t i = 1; i < size; i++) {
        if (data[i] == 0x01 && i + 1 < size) {
            uint8_t k = data[++i];
            const char *s = SPECIALS[(k & 0x7F) % N_SPECIALS];
            size_t l = strlen(s);
            if (k & 0x80) l /= 2;
            memcpy(text + n, s, l);
            n += l;
            spliced = true;
        } else {
            text[n++] = (char)data[i];
        }
    }
    (void)spliced;

    int need = 0;
    int rc = tok_encode_ex(v, text, n, add_bos && tok_bos(v) >= 0, parse_special, NULL, 0, &need);
    if (rc != KVS_OK && rc != KVS_ERR_TOO_LARGE) abort();
    if (need < 0 || (n > 0 && (size_t)need > 3 * n + 2)) abort();
    int32_t *ids = malloc(((size_t)need + 1) * sizeof *ids);
    int got = 0;
    if (!ids) {
        free(text);
        return 0;
    }
    if (tok_encode_ex(v, text, n, add_bos && tok_bos(v) >= 0, parse_special, ids, need + 1, &got) != KVS_OK ||
        got != need)
        abort();
    for (int i = 0; i < got; i++)
        if (ids[i] < 0 || ids[i] >= tok_n_vocab(v)) abort();

    char *back = NULL, *fixed = NULL;
    size_t bl = 0, fl = 0;
    if (tok_detokenize(v, ids, (size_t)got, true, &back, &bl) != KVS_OK) abort();
    if (tok_utf8_repair(back, bl, &fixed, &fl) != KVS_OK || !valid_utf8(fixed, fl)) abort();
    size_t cl = tok_utf8_complete_len(back, bl);
    if (cl > bl || (cl < bl && bl - cl > 3)) abort();
    /* Qwen2: lossless for valid UTF-8 when specials are parsed (they render as their text) */
    if (which == 3 && vocabs[3] && parse_special && !add_bos && valid_utf8(text, n) &&
        (bl != n || memcmp(back, text, n) != 0))
        abort();
    free(fixed);
    free(back);
    free(ids);
    free(text);
    return 0;
}
