#include "digest.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
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
    int err = gguf_manifest_digest(path, out);
    if (err != KVS_ERR_NOT_FOUND) return err; /* the manifest's digest, or why part 1 cannot be read */
    if (sodium_init() < 0) return KVS_ERR_INTERNAL;
    crypto_hash_sha256_state st;
    crypto_hash_sha256_init(&st);
    for (uint32_t i = 0; i < n; i++) {
        if (!gguf_split_path(part, sizeof(part), prefix, i, n)) return KVS_ERR_INVALID_ARG;
        err = hash_into(&st, part);
        if (err) return err;
    }
    crypto_hash_sha256_final(&st, out);
    return KVS_OK;
}

/* The cache key of the model at path: one line per part with what identifies its bytes. false
 * when a part cannot be found or the key does not fit. */
static bool cache_key(const char *path, char *key, size_t cap) {
    char prefix[4096], part[4096 + 32], real[PATH_MAX];
    uint32_t n = gguf_split_first_part(path, prefix, sizeof(prefix));
    size_t at = (size_t)snprintf(key, cap, "kvshard model digest v1\n");
    for (uint32_t i = 0; i < (n < 2 ? 1 : n); i++) {
        if (n >= 2 && !gguf_split_path(part, sizeof(part), prefix, i, n)) return false;
        struct stat st;
        if (!realpath(n >= 2 ? part : path, real) || stat(real, &st) != 0 || !S_ISREG(st.st_mode)) return false;
        int w = snprintf(key + at, cap - at, "%s dev %llu ino %llu size %lld mtime %lld.%09ld ctime %lld.%09ld\n", real,
                         (unsigned long long)st.st_dev, (unsigned long long)st.st_ino, (long long)st.st_size,
                         (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec, (long long)st.st_ctim.tv_sec, st.st_ctim.tv_nsec);
        if (w < 0 || (size_t)w >= cap - at) return false;
        at += (size_t)w;
    }
    return true;
}

/* The entry's file: cache_dir/digest-<first 32 hex of the key's SHA-256>. */
static bool cache_file(const char *cache_dir, const char *key, char *out, size_t cap) {
    uint8_t h[32];
    char hex[65];
    crypto_hash_sha256(h, (const unsigned char *)key, strlen(key));
    digest_hex(h, hex);
    hex[32] = 0;
    int w = snprintf(out, cap, "%s/digest-%s", cache_dir, hex);
    return w > 0 && (size_t)w < cap;
}

/* Reads the entry: the key again, then "sha256 HEX". */
static bool cache_read(const char *file, const char *key, uint8_t out[32]) {
    int fd = open(file, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return false;
    char buf[20000];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    size_t kl = strlen(key);
    if (n < 0 || (size_t)n != kl + 72 || memcmp(buf, key, kl) || memcmp(buf + kl, "sha256 ", 7) || buf[n - 1] != '\n')
        return false;
    for (int i = 0; i < 32; i++) {
        unsigned v;
        if (sscanf(buf + kl + 7 + 2 * i, "%2x", &v) != 1) return false;
        out[i] = (uint8_t)v;
    }
    return true;
}

/* Writes the entry through a temporary file renamed into place; failures are ignored. */
static void cache_write(const char *cache_dir, const char *file, const char *key, const uint8_t d[32]) {
    if (mkdir(cache_dir, 0700) != 0 && errno != EEXIST) return;
    char tmp[4300], hex[65];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", file, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return;
    digest_hex(d, hex);
    size_t kl = strlen(key);
    char line[80];
    int ll = snprintf(line, sizeof line, "sha256 %s\n", hex);
    bool ok = write(fd, key, kl) == (ssize_t)kl && write(fd, line, (size_t)ll) == ll;
    if (close(fd) != 0) ok = false;
    if (!ok || rename(tmp, file) != 0) unlink(tmp);
}

bool digest_cache_get(const char *path, const char *cache_dir, uint8_t out[32]) {
    if (!cache_dir || !cache_dir[0] || sodium_init() < 0) return false;
    char *key = malloc(16384), file[4200];
    bool ok = key && cache_key(path, key, 16384) && cache_file(cache_dir, key, file, sizeof file) &&
              cache_read(file, key, out);
    free(key);
    return ok;
}

int digest_model_cached(const char *path, const char *cache_dir, uint8_t out[32], bool *hit) {
    *hit = false;
    if (!cache_dir || !cache_dir[0]) return digest_model_sha256(path, out);
    if (sodium_init() < 0) return KVS_ERR_INTERNAL;
    char *key = malloc(16384), *again = malloc(16384), file[4200];
    bool keyed = key && again && cache_key(path, key, 16384) && cache_file(cache_dir, key, file, sizeof file);
    if (keyed && cache_read(file, key, out)) {
        *hit = true;
    } else {
        int err = digest_model_sha256(path, out);
        /* Kept only when no part changed while it was read. */
        if (!err && keyed && cache_key(path, again, 16384) && !strcmp(key, again)) cache_write(cache_dir, file, key, out);
        if (err) {
            free(key);
            free(again);
            return err;
        }
    }
    free(key);
    free(again);
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
