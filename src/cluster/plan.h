/*
 * plan — route planning over registry entries: pure functions, no I/O (docs/cluster.md).
 *
 * Among the `serving` entries of one model (digest), a route is a chain of entries whose layer
 * ranges meet end to start from 0 to n_layer. The planner picks the route with the fewest hops;
 * among those the lowest total load, then the most total free KV (budget - used), then the
 * earliest address in byte order, so one registry always gives one answer. Every other serving
 * entry of the model is a spare, lowest load first. Gaps are the layers no serving entry covers.
 */
#ifndef KVS_PLAN_H
#define KVS_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "registry.h"

#define CL_MAX_GAPS 64u

typedef struct {
    char digest[CL_DIGEST_HEX + 1];
    uint32_t n_layer;
    bool covered;                 /* a route exists */
    size_t n_hops, n_spares;
    size_t *hops, *spares;        /* indices into the entries given, malloc'd (cl_plan_free) */
    uint32_t n_gaps;              /* gaps[0..n_gaps): [a, b) covered by no serving entry */
    uint32_t gaps[CL_MAX_GAPS][2];
} cl_plan;

/* Chooses the model: want is a 64-hex digest or a name; NULL or "" means "the only model there
 * is". KVS_ERR_NOT_FOUND when nothing matches; KVS_ERR_INVALID_ARG (message listing the choices)
 * when want is NULL and the registry holds several models, or a name matches several digests. */
int cl_pick_model(const cl_entry *e, size_t n, const char *want, char digest[CL_DIGEST_HEX + 1], char *msg,
                  size_t cap);
/* Plans the route of model digest over e[0..n). KVS_OK with out->covered false (and the gaps)
 * when no route exists; KVS_ERR_NOT_FOUND when no entry has that digest; KVS_ERR_NOMEM. */
int cl_plan_route(const cl_entry *e, size_t n, const char *digest, cl_plan *out, char *msg, size_t cap);
void cl_plan_free(cl_plan *p);
/* --layers auto: the layer range a new shard of model digest (n_layer layers) should take, at most
 * max_layers long. Candidates start and end on a boundary the registry already has (0, n_layer,
 * and every serving entry's first and last) so that the new shard fits into routes; the one whose
 * least-covered layer has the fewest replicas wins, ties: the longer one, then the lowest first
 * layer. Without any candidate of that length, [s, s + max_layers) at the least-covered start s. */
void cl_plan_auto(const cl_entry *e, size_t n, const char *digest, uint32_t n_layer, uint32_t max_layers,
                  uint32_t *first, uint32_t *last);

#endif /* KVS_PLAN_H */
