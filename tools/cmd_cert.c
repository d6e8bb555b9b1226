/* kvshard cert: a cluster CA and node certificates for mutual TLS, in one step. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "args.h"
#include "cli.h"
#include "tls.h"
#include "util.h"

static void cert_usage(FILE *f) {
    fprintf(f,
            "usage: kvshard cert --out DIR [--days N] NAME [NAME...]\n"
            "  writes DIR/ca.pem, DIR/ca.key and DIR/NAME.pem, DIR/NAME.key for each NAME: an EC P-256\n"
            "  cluster CA and node certificates (CN=NAME, TLS server and client) signed by it.\n"
            "  A shard:  serve  --tls-cert DIR/NAME.pem --tls-key DIR/NAME.key --tls-ca DIR/ca.pem\n"
            "  A client: generate ... with its own NAME's files; sessions belong to the client's CN.\n"
            "  --out DIR   created if missing (mode 0700)\n"
            "  --days N    validity (default 365)\n"
            "Keep DIR/ca.key off the shards: whoever holds it can mint members of the cluster.\n");
}

int cmd_cert(int argc, char **argv) {
    const char *dir = NULL;
    long days = 365;
    const char **names = calloc((size_t)argc, sizeof *names);
    size_t n = 0;
    int rc = 2;
    if (!names) return 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { cert_usage(stdout); rc = 0; goto out; }
        else if (!strcmp(a, "--out")) ok = args_str(argc, argv, &i, &dir);
        else if (!strcmp(a, "--days")) ok = args_int(argc, argv, &i, 1, 36500, &days);
        else if (a[0] == '-') { fprintf(stderr, "kvshard cert: unknown option '%s'\n", a); cert_usage(stderr); goto out; }
        else names[n++] = a;
        if (!ok) goto out;
    }
    if (!dir || n == 0) {
        fprintf(stderr, "kvshard cert: --out DIR and at least one NAME are required\n");
        cert_usage(stderr);
        goto out;
    }
    (void)mkdir(dir, 0700);
    char msg[KVS_MSG_MAX] = "";
    int err = tls_make_cluster(dir, names, n, (int)days, msg, sizeof msg);
    if (err) {
        fprintf(stderr, "kvshard cert: %s\n", msg[0] ? msg : kvs_strerror(err));
        rc = 1;
        goto out;
    }
    fprintf(stderr, "kvshard cert: wrote %s/ca.pem and %zu node certificate(s)\n", dir, n);
    rc = 0;
out:
    free(names);
    return rc;
}
