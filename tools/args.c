#include "args.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

bool args_str(int argc, char **argv, int *i, const char **out) {
    if (*i + 1 >= argc) {
        fprintf(stderr, "kvshard %s: option %s needs a value\n", argv[0], argv[*i]);
        return false;
    }
    *out = argv[++*i];
    return true;
}

bool args_int(int argc, char **argv, int *i, long lo, long hi, long *out) {
    const char *s;
    if (!args_str(argc, argv, i, &s)) return false;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < lo || v > hi) {
        fprintf(stderr, "kvshard %s: %s wants an integer in [%ld, %ld], got '%s'\n", argv[0], argv[*i - 1], lo, hi, s);
        return false;
    }
    *out = v;
    return true;
}

bool args_float(int argc, char **argv, int *i, double lo, double hi, double *out) {
    const char *s;
    if (!args_str(argc, argv, i, &s)) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || end == s || !(v >= lo && v <= hi)) {
        fprintf(stderr, "kvshard %s: %s wants a number in [%.15g, %.15g], got '%s'\n", argv[0], argv[*i - 1], lo, hi, s);
        return false;
    }
    *out = v;
    return true;
}

bool args_u64(int argc, char **argv, int *i, uint64_t *out) {
    const char *s;
    if (!args_str(argc, argv, i, &s)) return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || end == s || s[0] == '-') {
        fprintf(stderr, "kvshard %s: %s wants an unsigned integer, got '%s'\n", argv[0], argv[*i - 1], s);
        return false;
    }
    *out = v;
    return true;
}

bool args_kv_type(int argc, char **argv, int *i, uint32_t *out) {
    const char *s;
    if (!args_str(argc, argv, i, &s)) return false;
    if (!strcmp(s, "f16")) *out = QUANT_F16;
    else if (!strcmp(s, "f32")) *out = QUANT_F32;
    else if (!strcmp(s, "q8_0")) *out = QUANT_Q8_0;
    else if (!strcmp(s, "q4_0")) *out = QUANT_Q4_0;
    else {
        fprintf(stderr, "kvshard %s: %s must be f16, q8_0, q4_0 or f32, got '%s'\n", argv[0], argv[*i - 1], s);
        return false;
    }
    return true;
}

bool args_size(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    if (s[0] == '-') return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return false;
    unsigned shift = 0;
    if (*end == 'K' || *end == 'k') shift = 10, end++;
    else if (*end == 'M' || *end == 'm') shift = 20, end++;
    else if (*end == 'G' || *end == 'g') shift = 30, end++;
    if (*end == 'B' || *end == 'b') end++;
    if (*end) return false;
    if (shift && v > (UINT64_MAX >> shift)) return false;
    *out = (uint64_t)v << shift;
    return true;
}

int args_ids(const char *s, int32_t **ids, size_t *n) {
    *ids = NULL;
    *n = 0;
    size_t cap = strlen(s) / 2 + 1, k = 0;
    int32_t *out = malloc(cap * sizeof *out);
    if (!out) return -1;
    while (*s) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (errno || end == s || v < 0 || v > INT32_MAX || (*end && *end != ',') || k == cap) {
            free(out);
            return -1;
        }
        out[k++] = (int32_t)v;
        s = *end ? end + 1 : end;
    }
    *ids = out;
    *n = k;
    return 0;
}

int args_security_opt(int argc, char **argv, int *i, args_security *o) {
    const char *a = argv[*i];
    const char **slot = !strcmp(a, "--tls-cert")          ? &o->tls_cert
                        : !strcmp(a, "--tls-key")         ? &o->tls_key
                        : !strcmp(a, "--tls-ca")          ? &o->tls_ca
                        : !strcmp(a, "--auth-token-file") ? &o->auth_token_file
                                                          : NULL;
    if (slot) return args_str(argc, argv, i, slot) ? 1 : -1;
    if (!strcmp(a, "--insecure")) {
        o->insecure = true;
        return 1;
    }
    return 0;
}

bool args_security_check(const char *cmd, const args_security *o) {
    int n = (o->tls_cert != NULL) + (o->tls_key != NULL) + (o->tls_ca != NULL);
    if (n == 0 || n == 3) return true;
    fprintf(stderr, "kvshard %s: --tls-cert, --tls-key and --tls-ca go together (all three or none)\n", cmd);
    return false;
}

char *args_read_token(const char *cmd, const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "kvshard %s: --auth-token-file %s: %s\n", cmd, path, strerror(errno));
        return NULL;
    }
    char line[300];
    bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    size_t l = got ? strcspn(line, "\r\n") : 0;
    line[l] = 0;
    if (l == 0 || l > 256) {
        fprintf(stderr, "kvshard %s: --auth-token-file %s: the first line must hold a token of 1..256 bytes\n", cmd, path);
        return NULL;
    }
    return strdup(line);
}

bool args_security_route(const char *cmd, const args_security *o, route_params *rp, char **token) {
    rp->tls_cert = o->tls_cert;
    rp->tls_key = o->tls_key;
    rp->tls_ca = o->tls_ca;
    *token = NULL;
    if (o->auth_token_file && !(*token = args_read_token(cmd, o->auth_token_file))) return false;
    rp->auth = *token;
    return true;
}
