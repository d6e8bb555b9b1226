/*
 * tok_utf8 — strict UTF-8 decoding and repair (RFC 3629): what the tokenizer and the
 * tools use to make text valid before it is written as JSON or streamed.
 */
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"
#include "util.h"

/* Bytes a character with this lead byte takes, 0 for a byte that cannot lead. */
static int lead_len(uint8_t b) {
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0;
}

/* Whether b may follow the lead byte at position k (1..3) of a sequence led by lead. */
static bool cont_ok(uint8_t lead, int k, uint8_t b) {
    if (k == 1) {
        if (lead == 0xE0) return b >= 0xA0 && b <= 0xBF; /* no overlongs */
        if (lead == 0xED) return b >= 0x80 && b <= 0x9F; /* no surrogates */
        if (lead == 0xF0) return b >= 0x90 && b <= 0xBF;
        if (lead == 0xF4) return b >= 0x80 && b <= 0x8F; /* <= U+10FFFF */
    }
    return b >= 0x80 && b <= 0xBF;
}

/* Valid bytes at the start of s[0..n) that a character could begin with: the full length
 * when complete, less when cut off by n, 0 when s[0] is invalid. *complete tells which. */
static int prefix_len(const uint8_t *s, size_t n, bool *complete) {
    *complete = false;
    if (n == 0) return 0;
    int need = lead_len(s[0]);
    if (need == 0) return 0;
    int k = 1;
    while (k < need && (size_t)k < n && cont_ok(s[0], k, s[k])) k++;
    *complete = k == need;
    return k == need || (size_t)k == n ? k : -k; /* -k: broken by an invalid byte */
}

int tok_utf8_char(const char *s, size_t n, uint32_t *cp) {
    if (!s) return 0;
    const uint8_t *u = (const uint8_t *)s;
    bool complete;
    int k = prefix_len(u, n, &complete);
    if (!complete) return 0;
    uint32_t c = k == 1 ? u[0] : k == 2 ? u[0] & 0x1Fu : k == 3 ? u[0] & 0x0Fu : u[0] & 0x07u;
    for (int i = 1; i < k; i++) c = (c << 6) | (u[i] & 0x3Fu);
    if (cp) *cp = c;
    return k;
}

size_t tok_utf8_complete_len(const char *s, size_t n) {
    if (!s) return 0;
    const uint8_t *u = (const uint8_t *)s;
    /* Only the last 3 bytes can start a character that is still incomplete. */
    size_t from = n > 3 ? n - 3 : 0;
    for (size_t i = from; i < n; i++) {
        if (u[i] >= 0x80 && u[i] <= 0xBF) continue; /* continuation: look for its lead */
        bool complete;
        int k = prefix_len(u + i, n - i, &complete);
        if (!complete && k > 0 && (size_t)k == n - i) return i; /* a valid start cut off by the end */
    }
    return n;
}

int tok_utf8_repair(const char *s, size_t n, char **out, size_t *out_len) {
    if (out) *out = NULL;
    if (out_len) *out_len = 0;
    if (!out || !out_len || (!s && n > 0)) return KVS_ERR_INVALID_ARG;
    if (n > (SIZE_MAX - 1) / 3) return KVS_ERR_NOMEM;
    char *r = malloc(3 * n + 1); /* each invalid byte becomes at most 3 */
    if (!r) return KVS_ERR_NOMEM;
    const uint8_t *u = (const uint8_t *)s;
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        bool complete;
        int k = prefix_len(u + i, n - i, &complete);
        if (complete) {
            memcpy(r + w, u + i, (size_t)k);
            w += (size_t)k;
            i += (size_t)k;
            continue;
        }
        memcpy(r + w, "\xEF\xBF\xBD", 3); /* U+FFFD for the maximal subpart */
        w += 3;
        i += k == 0 ? 1 : (size_t)(k < 0 ? -k : k);
    }
    r[w] = 0;
    *out = r;
    *out_len = w;
    return KVS_OK;
}
