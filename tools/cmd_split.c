/* kvshard split: write a model as NAME-00001-of-0000N.gguf ... parts, by layers. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "digest.h"
#include "gguf.h"
#include "kvshard.h"
#include "model.h"

static void split_usage(FILE *f) {
    fprintf(f, "usage: kvshard split -m MODEL --parts N -o PREFIX\n"
               "  writes MODEL as N GGUF files PREFIX-00001-of-0000N.gguf ... (llama.cpp's split layout:\n"
               "  split.no / split.count / split.tensors.count in every part, the metadata in the first).\n"
               "  Layers are spread evenly: blk.L goes to part L*N/n_layer + 1, token_embd and\n"
               "  rope_freqs to the first part, output_norm and output to the last, so a shard maps\n"
               "  only the parts holding its layers. N is at most n_layer + 1. Pass the first part\n"
               "  to -m of any command.\n"
               "  The first part also carries a manifest (kvshard.manifest.*): every tensor's part and\n"
               "  BLAKE2b-256, and the SHA-256 of MODEL. So a machine needs only part 1 and the parts of\n"
               "  its layers; a shard checks each tensor it maps against the manifest (a mismatch is\n"
               "  refused, naming the tensor and the part) and reports MODEL's digest, the same as a\n"
               "  shard serving MODEL whole. Parts split by other tools (llama.cpp's gguf-split) have\n"
               "  no manifest: every part is then needed, and read for the digest.\n");
}

int cmd_split(int argc, char **argv) {
    const char *in = NULL, *prefix = NULL;
    long parts = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            split_usage(stdout);
            return 0;
        } else if (!strcmp(a, "-m")) {
            if (!args_str(argc, argv, &i, &in)) return 2;
        } else if (!strcmp(a, "-o")) {
            if (!args_str(argc, argv, &i, &prefix)) return 2;
        } else if (!strcmp(a, "--parts")) {
            if (!args_int(argc, argv, &i, 1, GGUF_SPLIT_MAX_PARTS, &parts)) return 2;
        } else {
            fprintf(stderr, "kvshard split: unexpected argument '%s'\n", a);
            split_usage(stderr);
            return 2;
        }
    }
    if (!in || !prefix || parts == 0) {
        split_usage(stderr);
        return 2;
    }
    char msg[KVS_MSG_MAX] = "";
    gguf_ctx *g = NULL;
    uint32_t *part_of = NULL;
    int rc = gguf_open(in, &g, msg, sizeof msg);
    if (rc == KVS_OK && gguf_find_kv(g, "split.count")) {
        snprintf(msg, sizeof msg, "%s is already a split part", in);
        rc = KVS_ERR_INVALID_ARG;
    }
    if (rc == KVS_OK && !(part_of = calloc(gguf_n_tensors(g) ? gguf_n_tensors(g) : 1, sizeof(uint32_t)))) rc = KVS_ERR_NOMEM;
    if (rc == KVS_OK) rc = model_split_plan(g, (uint32_t)parts, part_of, msg, sizeof msg);
    uint8_t sha[32];
    if (rc == KVS_OK && (rc = digest_file_sha256(in, sha)) != KVS_OK) snprintf(msg, sizeof msg, "cannot read %s to hash it", in);
    if (rc == KVS_OK) rc = gguf_split_write_manifest(g, part_of, (uint32_t)parts, prefix, sha, msg, sizeof msg);
    if (rc == KVS_OK) {
        char path[4096];
        for (uint32_t p = 0; p < (uint32_t)parts; p++) {
            uint64_t n = 0;
            for (uint64_t t = 0; t < gguf_n_tensors(g); t++) n += part_of[t] == p;
            if (gguf_split_path(path, sizeof path, prefix, p, (uint32_t)parts))
                printf("%s: %" PRIu64 " tensors\n", path, n);
        }
        char hex[65];
        digest_hex(sha, hex);
        printf("manifest in the first part: %" PRIu64 " tensors, model digest %s (the same as %s's)\n", gguf_n_tensors(g),
               hex, in);
    }
    free(part_of);
    gguf_close(g);
    if (rc) {
        fprintf(stderr, "kvshard split: %s\n", msg[0] ? msg : kvs_strerror(rc));
        return 1;
    }
    return 0;
}
