/* route_check — route specs and the check that hops form a route. */
#include "route.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "route_impl.h"
#include "util.h"

/* ---- specs -------------------------------------------------------------- */

int route_parse_spec(const char *spec, route_addr **out, size_t *n, char *msg, size_t msg_cap) {
    if (!out || !n) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    *n = 0;
    if (!spec) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "no route given");
    size_t count = 1;
    for (const char *c = spec; *c; c++) count += *c == ',';
    if (count > ROUTE_MAX_HOPS)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "%zu entries in '%s' (at most %u)", count, spec,
                        ROUTE_MAX_HOPS);
    route_addr *a = calloc(count, sizeof *a);
    if (!a) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    size_t k = 0;
    for (const char *p = spec;; k++) {
        const char *end = strchr(p, ',');
        if (!end) end = p + strlen(p);
        while (p < end && (*p == ' ' || *p == '\t')) p++;
        const char *e = end;
        while (e > p && (e[-1] == ' ' || e[-1] == '\t')) e--;
        size_t len = (size_t)(e - p);
        if (len == 0 || len >= ROUTE_ADDR_MAX) {
            free(a);
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "entry %zu of '%s' is %s (want HOST:PORT)", k, spec,
                            len ? "too long" : "empty");
        }
        memcpy(a[k].text, p, len);
        a[k].text[len] = '\0';
        if (netio_parse_hostport(a[k].text, a[k].host, sizeof a[k].host, &a[k].port) != KVS_OK) {
            int rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "'%s' is not HOST:PORT", a[k].text);
            free(a);
            return rc;
        }
        if (!*end) break;
        p = end + 1;
    }
    *out = a;
    *n = k + 1;
    return KVS_OK;
}

/* ---- validation --------------------------------------------------------- */

static void digest_hex(const uint8_t *d, char out[17]) {
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 8; i++) {
        out[2 * i] = hex[d[i] >> 4];
        out[2 * i + 1] = hex[d[i] & 15];
    }
    out[16] = '\0';
}

/* Same model and shape as ref? Else a message naming hop `what`. */
int route_check_same_model(const struct wire_info *ref, const char *ref_name, const struct wire_info *x,
                            const char *what, char *msg, size_t msg_cap) {
    if (memcmp(ref->model_digest, x->model_digest, WIRE_DIGEST_SIZE) != 0) {
        char a[17], b[17];
        digest_hex(x->model_digest, a);
        digest_hex(ref->model_digest, b);
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                        "%s serves another model (digest %s... but %s has %s...)", what, a, ref_name, b);
    }
    if (x->n_layer != ref->n_layer || x->n_embd != ref->n_embd || x->n_vocab != ref->n_vocab)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                        "%s reports n_layer %u, n_embd %u, n_vocab %u but %s reports %u, %u, %u", what, x->n_layer,
                        x->n_embd, x->n_vocab, ref_name, ref->n_layer, ref->n_embd, ref->n_vocab);
    if (!(x->hidden_dtypes & WIRE_DTYPE_F32))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "%s does not take f32 hidden states", what);
    return KVS_OK;
}

int route_check_hops(const struct wire_info *infos, const char *const *addrs, size_t n, char *msg,
                     size_t msg_cap) {
    if (!infos || !addrs || n == 0) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "empty route");
    char ref_name[ROUTE_ADDR_MAX + 16], what[ROUTE_ADDR_MAX + 16];
    snprintf(ref_name, sizeof ref_name, "hop 0 (%s)", addrs[0]);
    for (size_t k = 0; k < n; k++) {
        const struct wire_info *x = &infos[k];
        snprintf(what, sizeof what, "hop %zu (%s)", k, addrs[k]);
        int rc = route_check_same_model(&infos[0], ref_name, x, what, msg, msg_cap);
        if (rc != KVS_OK) return rc;
        if (x->first >= x->last || x->last > x->n_layer)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "%s reports an invalid layer range [%u, %u) of %u",
                            what, x->first, x->last, x->n_layer);
        if (k == 0 && x->first != 0)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                            "%s serves layers [%u, %u) but a route must start at layer 0", what, x->first, x->last);
        if (k > 0 && x->first != infos[k - 1].last)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                            "%s serves layers [%u, %u) but the previous hop ends at %u", what, x->first, x->last,
                            infos[k - 1].last);
        if (k + 1 == n && x->last != x->n_layer)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                            "%s is the last hop and serves layers [%u, %u) but the model has %u layers", what,
                            x->first, x->last, x->n_layer);
    }
    return KVS_OK;
}
