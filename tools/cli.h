/* Subcommands of the kvshard CLI; each returns the process exit status. */
#ifndef KVS_CLI_H
#define KVS_CLI_H

int cmd_run(int argc, char **argv);
int cmd_logits(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_mkmodel(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_stats(int argc, char **argv);
int cmd_drain(int argc, char **argv);
int cmd_split(int argc, char **argv);
int cmd_delay_proxy(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_detokenize(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_cert(int argc, char **argv);
int cmd_api(int argc, char **argv);
int cmd_cluster(int argc, char **argv);

#endif /* KVS_CLI_H */
