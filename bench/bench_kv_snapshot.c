/*
 * bench_kv_snapshot — time serve --state-dir's snapshot of a full pool: kv_export of every
 * session to a file (buffered writes, fsync, as server_state.c does) and kv_import of it into a
 * fresh pool (every block's checksum verified), plus kv_snap_sum alone. The pool is TinyLlama-
 * shaped (22 layers, 4 kv heads, head_dim 64, f16, 16 positions per block: 352 KiB a block),
 * filled with sessions of 2048 positions.
 *
 * Built with -DKVS_BENCH=ON (CMakeLists.txt):
 *   build/bench_kv_snapshot [MIB [FILE]]   (default 1024 MiB, /tmp/kvs-bench.snap)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvstate.h"
#include "util.h"

static int file_write(void *ctx, const void *buf, size_t len) {
    return fwrite(buf, 1, len, (FILE *)ctx) == len ? KVS_OK : KVS_ERR_IO;
}

static int file_read(void *ctx, void *buf, size_t len) {
    return fread(buf, 1, len, (FILE *)ctx) == len ? KVS_OK : KVS_ERR_IO;
}

static kv_params bench_params(uint64_t mib) {
    kv_params p = kv_default_params();
    p.n_layers = 22;
    p.n_kv_heads = 4;
    p.head_dim = 64;
    p.budget_bytes = mib << 20;
    return p;
}

/* Fills the pool with sessions of 2048 positions (the last one shorter) of non-zero bytes. */
static uint32_t fill(kv_state *kv) {
    kv_stats st;
    uint32_t n = 0;
    for (;; n++) {
        kv_get_stats(kv, &st);
        uint32_t pos = (uint32_t)(st.blocks_free * 16 < 2048 ? st.blocks_free * 16 : 2048);
        if (pos == 0) break;
        kv_sid sid = {{0}};
        memcpy(sid.bytes, &n, sizeof n);
        kv_txn *t = NULL;
        kv_reply r;
        if (kv_begin(kv, &sid, 1, 0, pos, NULL, &t, &r) != KVS_OK) break;
        for (uint32_t p = 0; p < pos; p++)
            for (int l = 0; l < 22; l++)
                for (int h = 0; h < 4; h++) {
                    memset(kv_txn_k(t, l, p, h), (int)(p + (uint32_t)l), 128);
                    memset(kv_txn_v(t, l, p, h), (int)(p ^ (uint32_t)h), 128);
                }
        kv_commit(kv, t, &r);
    }
    return n;
}

int main(int argc, char **argv) {
    uint64_t mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 1024;
    const char *path = argc > 2 ? argv[2] : "/tmp/kvs-bench.snap";
    kv_params p = bench_params(mib);
    kv_state *src = NULL, *dst = NULL;
    char msg[KVS_MSG_MAX] = "";
    if (kv_create(&p, &src, msg, sizeof msg) || kv_create(&p, &dst, msg, sizeof msg)) {
        fprintf(stderr, "kv_create: %s\n", msg);
        return 1;
    }
    uint32_t sessions = fill(src);
    kv_snap_ident id = {.first = 0, .last = 22};
    kv_snap_counts c;
    FILE *f = fopen(path, "wb");
    setvbuf(f, NULL, _IOFBF, 1u << 20);
    uint64_t t0 = kvs_now_ns();
    int err = kv_export(src, &id, NULL, file_write, f, &c, msg, sizeof msg);
    fflush(f);
    fsync(fileno(f));
    fclose(f);
    double w = (double)(kvs_now_ns() - t0) / 1e9;
    if (err) fprintf(stderr, "export: %s\n", msg);
    f = fopen(path, "rb");
    setvbuf(f, NULL, _IOFBF, 1u << 20);
    t0 = kvs_now_ns();
    err = kv_import(dst, &id, file_read, f, &c, msg, sizeof msg);
    double rd = (double)(kvs_now_ns() - t0) / 1e9;
    fclose(f);
    if (err) fprintf(stderr, "import: %s\n", msg);
    size_t nb = 64u << 20;
    uint8_t *buf = malloc(nb);
    memset(buf, 7, nb);
    t0 = kvs_now_ns();
    uint64_t sum = 0;
    for (int i = 0; i < 8; i++) sum ^= kv_snap_sum(buf, nb, (uint64_t)i);
    double sum_s = (double)(kvs_now_ns() - t0) / 1e9;
    double gib = (double)c.bytes / (1u << 30);
    printf("pool %llu MiB, %u sessions, snapshot %.3f GiB: write+fsync %.2f s (%.2f GiB/s), "
           "load+verify %.2f s (%.2f GiB/s); checksum alone %.2f GiB/s (%llx)\n",
           (unsigned long long)mib, sessions, gib, w, gib / w, rd, gib / rd, 0.5 / sum_s, (unsigned long long)(sum & 0xf));
    unlink(path);
    free(buf);
    kv_free(src);
    kv_free(dst);
    return err ? 1 : 0;
}
