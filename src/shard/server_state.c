/*
 * server_state.c — serve --state-dir: the shard's hot KV state survives a restart.
 *
 * DIR holds two files of this shard:
 *   sid.key   the key session ids and tenant tags are derived with (server_conn.c). It is
 *             random per shard and must outlive the process: the snapshot's sessions are
 *             keyed by it, and a client reconnecting must land on the same session. Written
 *             once (0600, temp + fsync + rename), read at every start.
 *   kv.snap   the sessions and tombstones (kv_snapshot.c's format), written when the shard
 *             stops (SIGTERM) after its in-flight work finished: kv.snap.tmp, fsync, rename,
 *             fsync of DIR — a kill at any point leaves the previous file or none, never a
 *             partial one under the name. Loaded at start when the model digest, the layer
 *             range and the KV type match, then removed: a snapshot is consumed once, so a
 *             later crash cannot bring back state that clients have since moved past. A
 *             refused snapshot (checksum, identity, room) is renamed kv.snap.refused, logged
 *             and counted; the shard serves with an empty pool and clients replay.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "server_impl.h"
#include "util.h"

static void state_path(const srv *s, const char *name, char *out, size_t cap) {
    snprintf(out, cap, "%s/%s", s->p.state_dir, name);
}

/* fsync of a directory, so a rename in it is durable. */
static void sync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;
    (void)fsync(fd);
    close(fd);
}

/* Writes len bytes to DIR/name crash-safely (temp, fsync, rename, fsync DIR). */
static int write_small_file(const srv *s, const char *name, const void *data, size_t len) {
    char tmp[4200], path[4096];
    state_path(s, name, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return KVS_ERR_IO;
    bool ok = write(fd, data, len) == (ssize_t)len && fsync(fd) == 0;
    ok = close(fd) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return KVS_ERR_IO;
    }
    sync_dir(s->p.state_dir);
    return KVS_OK;
}

int srv_state_open(srv *s, char *msg, size_t cap) {
    const char *dir = s->p.state_dir;
    if (strlen(dir) > 3000) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--state-dir: the path is too long");
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return kvs_fail(msg, cap, KVS_ERR_IO, "--state-dir %s: %s", dir, strerror(errno));
    char path[4096];
    state_path(s, "sid.key", path, sizeof path);
    FILE *f = fopen(path, "rb");
    if (f) {
        size_t n = fread(s->sid_key, 1, sizeof s->sid_key, f);
        int extra = fgetc(f);
        fclose(f);
        if (n != sizeof s->sid_key || extra != EOF)
            return kvs_fail(msg, cap, KVS_ERR_FORMAT, "--state-dir: %s is not a %zu-byte key (remove it to start afresh)",
                            path, sizeof s->sid_key);
        return KVS_OK;
    }
    if (errno != ENOENT) return kvs_fail(msg, cap, KVS_ERR_IO, "--state-dir: %s: %s", path, strerror(errno));
    if (write_small_file(s, "sid.key", s->sid_key, sizeof s->sid_key) != KVS_OK)
        return kvs_fail(msg, cap, KVS_ERR_IO, "--state-dir: cannot write %s: %s", path, strerror(errno));
    return KVS_OK;
}

static void state_ident(const srv *s, kv_snap_ident *id) {
    memcpy(id->digest, s->digest, sizeof id->digest);
    id->first = s->e->m->first;
    id->last = s->e->m->last;
}

static int file_read(void *ctx, void *buf, size_t len) {
    return fread(buf, 1, len, (FILE *)ctx) == len ? KVS_OK : KVS_ERR_IO;
}

static int file_write(void *ctx, const void *buf, size_t len) {
    return fwrite(buf, 1, len, (FILE *)ctx) == len ? KVS_OK : KVS_ERR_IO;
}

/* Test hook (tests/test_mobility.c): with KVS_TEST_STATE_STALL set, the writer stops for good
 * at its third write (the header, a session record and a block are out), as if killed there,
 * and says so on stderr. */
static int stall_write(void *ctx, const void *buf, size_t len) {
    static int calls;
    if (++calls == 3) {
        (void)file_write(ctx, buf, len);
        fflush(ctx);
        fprintf(stderr, "state: test stall in the snapshot write\n");
        fflush(stderr);
        for (;;) pause();
    }
    return file_write(ctx, buf, len);
}

void srv_state_load(srv *s) {
    char path[4096], tmp[4096], msg[KVS_MSG_MAX] = "";
    state_path(s, "kv.snap", path, sizeof path);
    state_path(s, "kv.snap.tmp", tmp, sizeof tmp);
    unlink(tmp); /* a write that was cut short: never read */
    FILE *f = fopen(path, "rb");
    if (!f) {
        kvs_logf(s->p.log, s->p.log_ctx, "state: no snapshot in %s: starting with an empty pool", s->p.state_dir);
        return;
    }
    setvbuf(f, NULL, _IOFBF, 1u << 20);
    kv_snap_ident id;
    state_ident(s, &id);
    kv_snap_counts c = {0};
    uint64_t t0 = kvs_now_ns();
    int err = kv_import(s->e->kv, &id, file_read, f, &c, msg, sizeof msg);
    double secs = (double)(kvs_now_ns() - t0) / 1e9;
    fclose(f);
    if (err != KVS_OK) {
        char bad[4096];
        state_path(s, "kv.snap.refused", bad, sizeof bad);
        (void)rename(path, bad);
        s->c_snap_refused++;
        kvs_logf(s->p.log, s->p.log_ctx, "state: snapshot %s refused (%s): serving with an empty pool; kept as %s",
                 path, msg, bad);
    } else {
        unlink(path);
        s->c_snap_loaded_sessions += c.sessions;
        s->c_snap_loaded_bytes += c.bytes;
        kvs_logf(s->p.log, s->p.log_ctx, "state: loaded %llu session(s), %llu tombstone(s), %.1f MiB in %.3f s",
                 (unsigned long long)c.sessions, (unsigned long long)c.tombstones, (double)c.bytes / (1 << 20), secs);
    }
    sync_dir(s->p.state_dir);
}

int srv_state_save(srv *s) {
    char path[4096], tmp[4096], msg[KVS_MSG_MAX] = "";
    state_path(s, "kv.snap", path, sizeof path);
    state_path(s, "kv.snap.tmp", tmp, sizeof tmp);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        kvs_logf(s->p.log, s->p.log_ctx, "state: cannot write %s: %s", tmp, strerror(errno));
        return KVS_ERR_IO;
    }
    setvbuf(f, NULL, _IOFBF, 1u << 20);
    kv_snap_ident id;
    state_ident(s, &id);
    kv_snap_counts c = {0};
    uint64_t t0 = kvs_now_ns();
    kv_snap_write_fn w = getenv("KVS_TEST_STATE_STALL") ? stall_write : file_write;
    int err = kv_export(s->e->kv, &id, NULL, w, f, &c, msg, sizeof msg);
    if (err == KVS_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0)) err = KVS_ERR_IO;
    if (fclose(f) != 0 && err == KVS_OK) err = KVS_ERR_IO;
    if (err == KVS_OK && rename(tmp, path) != 0) err = KVS_ERR_IO;
    if (err != KVS_OK) {
        unlink(tmp);
        kvs_logf(s->p.log, s->p.log_ctx, "state: snapshot not written (%s)", msg[0] ? msg : strerror(errno));
        return err;
    }
    sync_dir(s->p.state_dir);
    double secs = (double)(kvs_now_ns() - t0) / 1e9;
    s->c_snap_written_sessions += c.sessions;
    s->c_snap_written_bytes += c.bytes;
    kvs_logf(s->p.log, s->p.log_ctx, "state: wrote %llu session(s), %llu tombstone(s), %.1f MiB to %s in %.3f s",
             (unsigned long long)c.sessions, (unsigned long long)c.tombstones, (double)c.bytes / (1 << 20), path, secs);
    return KVS_OK;
}

void srv_state_quiesce(srv *s) {
    /* New connections are refused from now on, and a request on an open one closes it: its
     * client reconnects once the shard is back (route_params.reconnect_grace_ms). */
    close(s->listen_fd);
    s->listen_fd = -1;
    atomic_store(&s->draining, true);
    int limit_ms = s->p.drain_timeout_ms > 0 ? s->p.drain_timeout_ms : 30000;
    uint64_t t0 = kvs_now_ns();
    bool idle = false;
    while (!idle && kvs_now_ns() - t0 < (uint64_t)limit_ms * 1000000ull) {
        pthread_mutex_lock(&s->mu);
        idle = s->jobs == NULL;
        pthread_mutex_unlock(&s->mu);
        if (!idle) {
            struct timespec ts = {0, 2 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    kvs_logf(s->p.log, s->p.log_ctx, "state: %s in-flight work after %.3f s", idle ? "finished" : "gave up on",
             (double)(kvs_now_ns() - t0) / 1e9);
}
