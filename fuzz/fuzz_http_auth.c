/* fuzz_http_auth — libFuzzer target for the `Authorization` check of `kvshard api --api-key`
 * (http_guard_check): arbitrary header values against two keys. Only "Bearer KEY" with one of
 * the keys may pass, and a pass must name that key's identity; nothing may read past the value.
 * Run: ./fuzz_http_auth -max_total_time=60 corpus_dir (seeds in fuzz/seeds/fuzz_http_auth). */
#include <sodium.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "http_impl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const keys[2] = {"alpha-key-01", "beta-key-02"};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static http_guard g;
    static uint8_t hashes[2][HTTP_KEY_HASH];
    static uint64_t owners[2];
    if (!g.n_keys) {
        if (sodium_init() < 0) abort();
        for (int i = 0; i < 2; i++)
            crypto_generichash(hashes[i], HTTP_KEY_HASH, (const uint8_t *)keys[i], strlen(keys[i]), NULL, 0);
        g.keys = hashes;
        g.n_keys = 2;
        for (int i = 0; i < 2; i++) {
            char h[64];
            strcpy(h, "Bearer ");
            strcat(h, keys[i]);
            if (!http_guard_check(&g, h, &owners[i])) abort();
        }
        if (owners[0] == owners[1]) abort();
    }
    char *value = malloc(size + 1); /* a header value: NUL-terminated, as libmicrohttpd gives it */
    if (!value) return 0;
    memcpy(value, data, size);
    value[size] = 0;
    uint64_t owner = 0;
    if (http_guard_check(&g, value, &owner) && owner != owners[0] && owner != owners[1]) abort();
    free(value);
    return 0;
}
