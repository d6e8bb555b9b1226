/*
 * bench_state — writes a `kvshard serve --state-dir DIR` snapshot of MIB MiB of hot KV for a
 * model file and layer range, so a shard starts with a full pool without hours of prefill
 * (scripts/bench-drain.sh times drain, snapshot write and load with it). The pool has the
 * shard's geometry (the model's kv heads and head size, f16, 16 positions per block, the
 * model's context as the session cap); it is filled with sessions of POS positions (the last
 * one shorter) of random f16 rows in [-1, -0.5] and [0.5, 1], and written with kv_export to
 * DIR/kv.snap (temp, fsync, rename) as the shard writes it on SIGTERM. Each session belongs to
 * the plaintext identity "anonymous": its owner, id and tenant are derived under DIR/sid.key
 * (read, or created like the shard creates it) exactly as server_conn.c derives them, so the
 * shard can drain the sessions (SESSION_PUSH rekeys by owner) and clients could reach them.
 *
 * Built with -DKVS_BENCH=ON (CMakeLists.txt):
 *   build/bench_state MODEL FIRST:LAST DIR [MIB [POS]]   (default 1024 MiB, 2048 positions)
 */
#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "digest.h"
#include "gguf.h"
#include "kvstate.h"
#include "model.h"
#include "util.h"

#define IDENTITY "anonymous" /* a plaintext client without a token (server_conn.c) */

static int file_write(void *ctx, const void *buf, size_t len) {
    return fwrite(buf, 1, len, (FILE *)ctx) == len ? KVS_OK : KVS_ERR_IO;
}

/* DIR/sid.key into key: read when present (it must be the shard's exact size), else created. */
static int sid_key(const char *dir, uint8_t key[crypto_generichash_KEYBYTES]) {
    char path[4096];
    snprintf(path, sizeof path, "%s/sid.key", dir);
    FILE *f = fopen(path, "rb");
    if (f) {
        size_t n = fread(key, 1, crypto_generichash_KEYBYTES, f);
        int extra = fgetc(f);
        fclose(f);
        if (n == crypto_generichash_KEYBYTES && extra == EOF) return 0;
        fprintf(stderr, "bench_state: %s is not a %d-byte key\n", path, crypto_generichash_KEYBYTES);
        return 1;
    }
    randombytes_buf(key, crypto_generichash_KEYBYTES);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    bool ok = fd >= 0 && write(fd, key, crypto_generichash_KEYBYTES) == crypto_generichash_KEYBYTES && fsync(fd) == 0;
    if (fd >= 0) ok = close(fd) == 0 && ok;
    if (!ok) fprintf(stderr, "bench_state: cannot write %s: %s\n", path, strerror(errno));
    return ok ? 0 : 1;
}

/* Pool parameters of a shard serving layers [first, last) of the model with default flags. */
static int model_params(const char *path, uint32_t first, uint32_t last, uint64_t mib, kv_params *p) {
    char msg[KVS_MSG_MAX] = "";
    gguf_set *g = NULL;
    model_hparams hp;
    int err = gguf_set_open(path, &g, msg, sizeof msg);
    if (!err) err = model_read_hparams(g, &hp, msg, sizeof msg);
    gguf_set_close(g);
    if (err) {
        fprintf(stderr, "bench_state: %s: %s\n", path, msg);
        return 1;
    }
    if (first >= last || last > hp.n_layer) {
        fprintf(stderr, "bench_state: layers %u:%u are not a range of the model's %u\n", first, last, hp.n_layer);
        return 1;
    }
    *p = kv_default_params();
    p->n_layers = (int)(last - first);
    p->n_kv_heads = (int)hp.n_head_kv;
    p->head_dim = (int)hp.head_dim;
    p->max_positions = hp.n_ctx;
    p->budget_bytes = mib << 20;
    return 0;
}

/* Random f16 bits with exponent 14 (magnitude in [0.5, 1)): never a NaN or an infinity. */
static void fill_row(uint8_t *row, size_t len, uint64_t *x) {
    for (size_t i = 0; i + 8 <= len; i += 8) {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        uint64_t v = (*x & 0x83FF83FF83FF83FFull) | 0x3800380038003800ull;
        memcpy(row + i, &v, 8);
    }
}

/* One session of pos positions owned by IDENTITY (raw id: the session number). */
static int add_session(kv_state *kv, const uint8_t *key, uint32_t n, uint32_t pos, uint64_t *x) {
    const kv_params *p = kv_get_params(kv);
    uint8_t owner[sizeof IDENTITY + 16] = IDENTITY, tag[8];
    memcpy(owner + sizeof IDENTITY, &n, sizeof n); /* the NUL after IDENTITY separates the raw id */
    kv_sid sid;
    crypto_generichash(sid.bytes, sizeof sid.bytes, owner, sizeof owner, key, crypto_generichash_KEYBYTES);
    crypto_generichash(tag, sizeof tag, (const uint8_t *)IDENTITY, strlen(IDENTITY), key, crypto_generichash_KEYBYTES);
    uint64_t tenant;
    memcpy(&tenant, tag, sizeof tenant);
    kv_txn *t = NULL;
    kv_reply r;
    int err = kv_begin_tenant(kv, tenant, &sid, 1, 0, pos, NULL, &t, &r);
    if (err) return err;
    size_t row = kv_row_bytes(p->kv_type, p->head_dim);
    for (uint32_t i = 0; i < pos; i++)
        for (int l = 0; l < p->n_layers; l++)
            for (int h = 0; h < p->n_kv_heads; h++) {
                fill_row(kv_txn_k(t, l, i, h), row, x);
                fill_row(kv_txn_v(t, l, i, h), row, x);
            }
    kv_commit(kv, t, &r);
    return kv_set_owner(kv, &sid, owner, sizeof owner);
}

/* Exports the pool to DIR/kv.snap as srv_state_save does (temp, fsync, rename). */
static int write_snapshot(kv_state *kv, const kv_snap_ident *id, const char *dir, kv_snap_counts *c) {
    char path[4096], tmp[4200], msg[KVS_MSG_MAX] = "";
    snprintf(path, sizeof path, "%s/kv.snap", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        fprintf(stderr, "bench_state: %s: %s\n", tmp, strerror(errno));
        return 1;
    }
    setvbuf(f, NULL, _IOFBF, 1u << 20);
    int err = kv_export(kv, id, NULL, file_write, f, c, msg, sizeof msg);
    if (!err && (fflush(f) != 0 || fsync(fileno(f)) != 0)) err = KVS_ERR_IO;
    if (fclose(f) != 0 && !err) err = KVS_ERR_IO;
    if (!err && rename(tmp, path) != 0) err = KVS_ERR_IO;
    if (err) {
        fprintf(stderr, "bench_state: %s not written: %s\n", path, msg[0] ? msg : strerror(errno));
        unlink(tmp);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: bench_state MODEL FIRST:LAST DIR [MIB [POS]]\n");
        return 2;
    }
    unsigned first = 0, last = 0;
    uint64_t mib = argc > 4 ? strtoull(argv[4], NULL, 10) : 1024;
    uint32_t want = argc > 5 ? (uint32_t)strtoul(argv[5], NULL, 10) : 2048;
    if (sscanf(argv[2], "%u:%u", &first, &last) != 2 || mib == 0 || want == 0) {
        fprintf(stderr, "bench_state: want FIRST:LAST, MIB > 0 and POS > 0\n");
        return 2;
    }
    kv_params p;
    uint8_t key[crypto_generichash_KEYBYTES];
    kv_snap_ident id = {.first = first, .last = last};
    if (sodium_init() < 0 || model_params(argv[1], first, last, mib, &p)) return 1;
    if (mkdir(argv[3], 0700) != 0 && errno != EEXIST) {
        fprintf(stderr, "bench_state: %s: %s\n", argv[3], strerror(errno));
        return 1;
    }
    if (sid_key(argv[3], key)) return 1;
    if (digest_model_sha256(argv[1], id.digest) != KVS_OK) {
        fprintf(stderr, "bench_state: cannot hash %s\n", argv[1]);
        return 1;
    }
    if (want > p.max_positions) want = p.max_positions;
    kv_state *kv = NULL;
    char msg[KVS_MSG_MAX] = "";
    if (kv_create(&p, &kv, msg, sizeof msg)) {
        fprintf(stderr, "bench_state: %s\n", msg);
        return 1;
    }
    uint64_t x = 0x9E3779B97F4A7C15ull ^ (uint64_t)kvs_now_ns(), t0 = kvs_now_ns();
    kv_stats st;
    uint32_t n = 0;
    for (;; n++) {
        kv_get_stats(kv, &st);
        uint64_t room = st.blocks_free * (uint64_t)p.block_tokens;
        if (room == 0 || add_session(kv, key, n, room < want ? (uint32_t)room : want, &x) != KVS_OK) break;
    }
    double fill_s = (double)(kvs_now_ns() - t0) / 1e9;
    kv_snap_counts c = {0};
    t0 = kvs_now_ns();
    int rc = n == 0 ? 1 : write_snapshot(kv, &id, argv[3], &c);
    if (rc == 0)
        printf("bench_state: %s/kv.snap: %u sessions of up to %u positions, layers %u:%u, %.1f MiB "
               "(filled in %.2f s, written in %.2f s)\n",
               argv[3], n, want, first, last, (double)c.bytes / (1 << 20), fill_s,
               (double)(kvs_now_ns() - t0) / 1e9);
    kv_free(kv);
    return rc;
}
