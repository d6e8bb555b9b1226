#include "digest.h"

#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "kvshard.h"

/* Adds the whole regular file at path to st. KVS_ERR_IO when it cannot be read. */
static int hash_into(crypto_hash_sha256_state *st, const char *path) {
    /* O_NONBLOCK so a FIFO cannot block the open; only regular files are hashed. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return KVS_ERR_IO;
    struct stat fs;
    if (fstat(fd, &fs) != 0 || !S_ISREG(fs.st_mode)) {
        close(fd);
        return KVS_ERR_IO;
    }
    unsigned char *buf = malloc(1 << 20);
    ssize_t r = -1;
    while (buf && (r = read(fd, buf, 1 << 20)) > 0) crypto_hash_sha256_update(st, buf, (unsigned long long)r);
    close(fd);
    free(buf);
    return (r < 0 || !buf) ? KVS_ERR_IO : KVS_OK;
}

int digest_file_sha256(const char *path, uint8_t out[32]) {
    if (sodium_init() < 0) return KVS_ERR_INTERNAL;
    crypto_hash_sha256_state st;
    crypto_hash_sha256_init(&st);
    int err = hash_into(&st, path);
    if (err) return err;
    crypto_hash_sha256_final(&st, out);
    return KVS_OK;
}

int digest_model_sha256(const char *path, uint8_t out[32]) {
    char prefix[4096], part[4096 + 32];
    uint32_t n = gguf_split_first_part(path, prefix, sizeof(prefix));
    if (n < 2) return digest_file_sha256(path, out);
    if (sodium_init() < 0) return KVS_ERR_INTERNAL;
    crypto_hash_sha256_state st;
    crypto_hash_sha256_init(&st);
    for (uint32_t i = 0; i < n; i++) {
        if (!gguf_split_path(part, sizeof(part), prefix, i, n)) return KVS_ERR_INVALID_ARG;
        int err = hash_into(&st, part);
        if (err) return err;
    }
    crypto_hash_sha256_final(&st, out);
    return KVS_OK;
}

void digest_hex(const uint8_t d[32], char hex[65]) {
    static const char x[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        hex[2 * i] = x[d[i] >> 4];
        hex[2 * i + 1] = x[d[i] & 15];
    }
    hex[64] = 0;
}
