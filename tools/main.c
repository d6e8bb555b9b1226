/* kvshard — command line entry point: dispatches to the subcommands. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_env.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvshard COMMAND [options]\n"
            "\n"
            "commands:\n"
            "  run      generate text from a GGUF model in one process\n"
            "  chat     converse with an instruct model (its chat template), locally or over a route\n"
            "  tokenize   print a file's token ids for a text (JSON)\n"
            "  detokenize print the text of token ids (JSON)\n"
            "  logits   print the logits of every position of a prompt (JSON)\n"
            "  serve    serve a layer range of a model as a shard over TCP\n"
            "  generate generate text by driving a route of shards (no weights needed)\n"
            "  stats    print a running shard's identity and counters (JSON)\n"
            "  drain    move a shard's sessions to peers, then retire it (no replay for clients)\n"
            "  api      an OpenAI-compatible HTTP server over a route or one model\n"
            "  bench    measure prefill/decode speed and memory bandwidth (JSON)\n"
            "  inspect  print a GGUF file's metadata and tensor table\n"
            "  mkmodel  write a llama GGUF with seeded random weights\n"
            "  split    write a model as NAME-00001-of-0000N.gguf parts, by layers\n"
            "  delay-proxy  benchmark aid: a TCP relay that holds each chunk D ms\n"
            "  cert     make a cluster CA and node certificates for mutual TLS\n"
            "  cluster  show the shards an etcd registry holds (cluster status)\n"
            "\n"
            "run 'kvshard COMMAND --help' for a command's options; every command also takes --version,\n"
            "--log-level error|warn|info|debug, and KVSHARD_* environment variables for common flags\n"
            "(KVSHARD_MODEL, KVSHARD_ROUTE, KVSHARD_LISTEN, KVSHARD_KV_BUDGET, KVSHARD_CTX_SIZE,\n"
            "KVSHARD_THREADS, KVSHARD_TLS_CERT/_KEY/_CA, KVSHARD_AUTH_TOKEN_FILE, KVSHARD_LOG_LEVEL)\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    static const struct { const char *name; int (*fn)(int, char **); } cmds[] = {
        {"run", cmd_run},         {"logits", cmd_logits},   {"bench", cmd_bench},
        {"inspect", cmd_inspect}, {"mkmodel", cmd_mkmodel}, {"serve", cmd_serve},
        {"generate", cmd_generate}, {"stats", cmd_stats},     {"split", cmd_split},
        {"delay-proxy", cmd_delay_proxy},
        {"tokenize", cmd_tokenize}, {"detokenize", cmd_detokenize}, {"chat", cmd_chat},
        {"cert", cmd_cert},
        {"api", cmd_api},
        {"cluster", cmd_cluster},
        {"drain", cmd_drain},
    };
    if (!strcmp(argv[1], "--version")) return cli_prepare(&argc, &argv);
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        if (strcmp(argv[1], cmds[i].name)) continue;
        int n = argc - 1, done;
        char **a = argv + 1;
        if ((done = cli_prepare(&n, &a)) >= 0) return done; /* --version, --log-level, KVSHARD_* */
        int rc = cmds[i].fn(n, a);
        if (a != argv + 1) free(a); /* cli_prepare's copy of the argument vector */
        return rc;
    }
    fprintf(stderr, "kvshard: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
