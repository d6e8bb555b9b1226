/* Small helpers for parsing subcommand options. */
#ifndef KVS_ARGS_H
#define KVS_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "route.h"

/* Each returns false (after printing "kvshard CMD: ...") when the value is
 * missing or malformed. *i is advanced past the consumed value. */
bool args_str(int argc, char **argv, int *i, const char **out);
bool args_int(int argc, char **argv, int *i, long lo, long hi, long *out);
bool args_float(int argc, char **argv, int *i, double lo, double hi, double *out);
bool args_u64(int argc, char **argv, int *i, uint64_t *out);
/* --kv-type value: "f16", "q8_0", "q4_0" or "f32" -> QUANT_F16 / QUANT_Q8_0 / QUANT_Q4_0 / QUANT_F32. */
bool args_kv_type(int argc, char **argv, int *i, uint32_t *out);
/* Parses "ID,ID,..." (each 0..INT32_MAX; "" is no ids) into a malloc'd array (*ids, *n;
 * the caller frees). Returns 0, or -1 on a malformed list (nothing allocated then). */
int args_ids(const char *s, int32_t **ids, size_t *n);
/* Parses "123", "64K", "512M", "2G" (powers of 1024). */
bool args_size(const char *s, uint64_t *out);

/* Security options shared by serve, generate, stats (and chat/api): docs/security.md. */
typedef struct {
    const char *tls_cert, *tls_key, *tls_ca; /* --tls-cert / --tls-key / --tls-ca FILE */
    const char *auth_token_file;             /* --auth-token-file FILE */
    bool insecure;                           /* --insecure (serve: plaintext off loopback) */
} args_security;

#define ARGS_SECURITY_USAGE                                                                     \
    "  --tls-cert FILE      this node's certificate (PEM); with --tls-key and --tls-ca: mutual TLS 1.3\n" \
    "  --tls-key FILE       its private key (PEM)\n"                                            \
    "  --tls-ca FILE        the cluster CA that every peer's certificate must chain to\n"        \
    "  --auth-token-file F  serve: HELLO tokens accepted, one per line; clients: the token to send\n"

/* If argv[*i] is one of the options above, consumes it and its value and returns 1; returns 0
 * when it is not one; -1 (after printing) when its value is missing. */
int args_security_opt(int argc, char **argv, int *i, args_security *o);
/* False (after printing "kvshard CMD: ...") unless the TLS files are given all three or none. */
bool args_security_check(const char *cmd, const args_security *o);
/* The client token in path: its first line without the line end, malloc'd (free()). NULL after
 * printing when the file cannot be read or the line is empty or longer than 256 bytes. */
char *args_read_token(const char *cmd, const char *path);
/* Copies the TLS files into rp and, with --auth-token-file, reads the token into *token (malloc'd,
 * also set as rp->auth; the caller frees it once route_open has returned, which keeps a copy).
 * False (after printing) when the token file cannot be read; *token is then NULL. */
bool args_security_route(const char *cmd, const args_security *o, route_params *rp, char **token);

#endif /* KVS_ARGS_H */
