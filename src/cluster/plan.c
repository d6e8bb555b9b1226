/* Route planning (plan.h). */
#include "plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

static bool usable(const cl_entry *x, const char *digest, uint32_t n_layer) {
    return x->state == CL_SERVING && !strcmp(x->digest, digest) && x->n_layer == n_layer && x->first < x->last &&
           x->last <= n_layer;
}

int cl_pick_model(const cl_entry *e, size_t n, const char *want, char digest[CL_DIGEST_HEX + 1], char *msg,
                  size_t cap) {
    digest[0] = 0;
    bool by_digest = want && strlen(want) == CL_DIGEST_HEX;
    for (size_t i = 0; i < n; i++) {
        bool match = !want || !want[0] || (by_digest ? !strcmp(e[i].digest, want) : !strcmp(e[i].name, want));
        if (!match) continue;
        if (!digest[0]) {
            snprintf(digest, CL_DIGEST_HEX + 1, "%s", e[i].digest);
        } else if (strcmp(digest, e[i].digest)) {
            kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "several models match '%s' (e.g. %s and %s): pass --model DIGEST",
                     want && want[0] ? want : "*", digest, e[i].digest);
            digest[0] = 0;
            return KVS_ERR_INVALID_ARG;
        }
    }
    if (!digest[0])
        return kvs_fail(msg, cap, KVS_ERR_NOT_FOUND, "no shard of model '%s' is registered", want && want[0] ? want : "*");
    return KVS_OK;
}


static double free_kv(const cl_entry *x) { return x->kv_used < x->kv_budget ? (double)(x->kv_budget - x->kv_used) : 0; }

/* Order: first layer, then load, then free KV (more first), then address. */
static int cmp_idx(const void *a, const void *b, void *ctx) {
    const cl_entry *e = ctx, *x = &e[*(const size_t *)a], *y = &e[*(const size_t *)b];
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    if (x->load != y->load) return x->load < y->load ? -1 : 1;
    if (free_kv(x) != free_kv(y)) return free_kv(x) > free_kv(y) ? -1 : 1;
    return strcmp(x->addr, y->addr);
}

static int cmp_spare(const void *a, const void *b, void *ctx) {
    const cl_entry *e = ctx, *x = &e[*(const size_t *)a], *y = &e[*(const size_t *)b];
    if (x->load != y->load) return x->load < y->load ? -1 : 1;
    return strcmp(x->addr, y->addr);
}

static void find_gaps(const cl_entry *e, const size_t *idx, size_t m, uint32_t n_layer, cl_plan *out) {
    /* idx is sorted by first: sweep the covered frontier. */
    uint32_t reach = 0;
    out->n_gaps = 0;
    for (size_t k = 0; k <= m; k++) {
        uint32_t first = k < m ? e[idx[k]].first : n_layer;
        if (first > reach && out->n_gaps < CL_MAX_GAPS) {
            out->gaps[out->n_gaps][0] = reach;
            out->gaps[out->n_gaps][1] = first;
            out->n_gaps++;
        }
        if (k < m && e[idx[k]].last > reach) reach = e[idx[k]].last;
    }
}

typedef struct {
    uint32_t hops;
    double load, free;
    size_t pred; /* entry index of the last hop; SIZE_MAX at layer 0 */
} dp_cell;

static bool better(uint32_t hops, double load, double fr, const dp_cell *c) {
    if (hops != c->hops) return hops < c->hops;
    if (load != c->load) return load < c->load;
    return fr > c->free;
}

/* Fewest hops, then lowest load sum, then most free KV: each is a sum along the route, so the
 * lexicographic order is kept by extension and one sweep by first layer is optimal. */
static int best_route(const cl_entry *e, const size_t *idx, size_t m, uint32_t n_layer, cl_plan *out) {
    dp_cell *dp = malloc(((size_t)n_layer + 1) * sizeof *dp);
    if (!dp) return KVS_ERR_NOMEM;
    for (uint32_t l = 0; l <= n_layer; l++) dp[l] = (dp_cell){UINT32_MAX, 0, 0, SIZE_MAX};
    dp[0].hops = 0;
    for (size_t k = 0; k < m; k++) {
        const cl_entry *x = &e[idx[k]];
        const dp_cell *from = &dp[x->first];
        if (from->hops == UINT32_MAX) continue;
        if (better(from->hops + 1, from->load + x->load, from->free + free_kv(x), &dp[x->last]))
            dp[x->last] = (dp_cell){from->hops + 1, from->load + x->load, from->free + free_kv(x), idx[k]};
    }
    out->covered = dp[n_layer].hops != UINT32_MAX;
    if (out->covered) {
        out->n_hops = dp[n_layer].hops;
        out->hops = malloc(out->n_hops * sizeof *out->hops);
        if (!out->hops) {
            free(dp);
            return KVS_ERR_NOMEM;
        }
        uint32_t at = n_layer;
        for (size_t h = out->n_hops; h-- > 0;) {
            out->hops[h] = dp[at].pred;
            at = e[dp[at].pred].first;
        }
    }
    free(dp);
    return KVS_OK;
}

int cl_plan_route(const cl_entry *e, size_t n, const char *digest, cl_plan *out, char *msg, size_t cap) {
    memset(out, 0, sizeof *out);
    snprintf(out->digest, sizeof out->digest, "%s", digest);
    for (size_t i = 0; i < n && !out->n_layer; i++)
        if (!strcmp(e[i].digest, digest)) out->n_layer = e[i].n_layer;
    if (!out->n_layer) return kvs_fail(msg, cap, KVS_ERR_NOT_FOUND, "no shard of model %s is registered", digest);
    size_t *idx = malloc((n ? n : 1) * sizeof *idx);
    if (!idx) return KVS_ERR_NOMEM;
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (usable(&e[i], digest, out->n_layer)) idx[m++] = i;
    qsort_r(idx, m, sizeof *idx, cmp_idx, (void *)e); /* GNU qsort_r: the entries as context */
    find_gaps(e, idx, m, out->n_layer, out);
    int err = best_route(e, idx, m, out->n_layer, out);
    if (!err) {
        out->spares = malloc((m ? m : 1) * sizeof *out->spares);
        if (!out->spares) err = KVS_ERR_NOMEM;
    }
    if (!err) {
        for (size_t k = 0; k < m; k++) {
            bool in_route = false;
            for (size_t h = 0; h < out->n_hops; h++) in_route |= out->hops[h] == idx[k];
            if (!in_route) out->spares[out->n_spares++] = idx[k];
        }
        qsort_r(out->spares, out->n_spares, sizeof *out->spares, cmp_spare, (void *)e);
    }
    free(idx);
    if (err) cl_plan_free(out);
    return err;
}

void cl_plan_free(cl_plan *p) {
    if (!p) return;
    free(p->hops);
    free(p->spares);
    p->hops = p->spares = NULL;
    p->n_hops = p->n_spares = 0;
}

/* Replicas of each layer among serving entries; cover has n_layer cells. */
static void count_cover(const cl_entry *e, size_t n, const char *digest, uint32_t n_layer, uint32_t *cover,
                        bool *boundary) {
    memset(cover, 0, n_layer * sizeof *cover);
    memset(boundary, 0, ((size_t)n_layer + 1) * sizeof *boundary);
    boundary[0] = boundary[n_layer] = true;
    for (size_t i = 0; i < n; i++) {
        if (!usable(&e[i], digest, n_layer)) continue;
        for (uint32_t l = e[i].first; l < e[i].last; l++) cover[l]++;
        boundary[e[i].first] = boundary[e[i].last] = true;
    }
}

static uint32_t min_cover(const uint32_t *cover, uint32_t a, uint32_t b) {
    uint32_t m = UINT32_MAX;
    for (uint32_t l = a; l < b; l++) m = cover[l] < m ? cover[l] : m;
    return m;
}

void cl_plan_auto(const cl_entry *e, size_t n, const char *digest, uint32_t n_layer, uint32_t max_layers,
                  uint32_t *first, uint32_t *last) {
    *first = 0;
    *last = n_layer;
    if (n_layer == 0) return;
    if (max_layers == 0 || max_layers > n_layer) max_layers = n_layer;
    uint32_t *cover = malloc(n_layer * sizeof *cover);
    bool *boundary = malloc(((size_t)n_layer + 1) * sizeof *boundary);
    if (!cover || !boundary) {
        free(cover);
        free(boundary);
        *last = max_layers;
        return;
    }
    count_cover(e, n, digest, n_layer, cover, boundary);
    uint32_t best_min = UINT32_MAX, best_a = 0, best_b = 0;
    for (uint32_t a = 0; a < n_layer; a++) {
        if (!boundary[a]) continue;
        for (uint32_t b = a + 1; b <= n_layer && b - a <= max_layers; b++) {
            if (!boundary[b]) continue;
            uint32_t mc = min_cover(cover, a, b);
            if (mc < best_min || (mc == best_min && b - a > best_b - best_a)) {
                best_min = mc;
                best_a = a;
                best_b = b;
            }
        }
    }
    if (best_b == 0) { /* no boundary pair fits max_layers: a window at the least-covered layer */
        uint32_t at = 0;
        for (uint32_t l = 1; l < n_layer; l++)
            if (cover[l] < cover[at]) at = l;
        best_a = at + max_layers <= n_layer ? at : n_layer - max_layers;
        best_b = best_a + max_layers;
    }
    *first = best_a;
    *last = best_b;
    free(cover);
    free(boundary);
}
