/* The registry entry codec (registry.h). */
#include "registry.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

const char *cl_state_name(int state) { return state == CL_DRAINING ? "draining" : "serving"; }

char *cl_entry_encode(const cl_entry *e) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "addr", e->addr);
    cJSON_AddStringToObject(o, "name", e->name);
    cJSON_AddStringToObject(o, "digest", e->digest);
    cJSON_AddStringToObject(o, "tls_id", e->tls_id);
    cJSON_AddNumberToObject(o, "n_layer", e->n_layer);
    cJSON *l = cJSON_AddArrayToObject(o, "layers");
    if (l) {
        cJSON_AddItemToArray(l, cJSON_CreateNumber(e->first));
        cJSON_AddItemToArray(l, cJSON_CreateNumber(e->last));
    }
    cJSON_AddNumberToObject(o, "proto", e->proto);
    cJSON_AddNumberToObject(o, "kv_budget", (double)e->kv_budget);
    cJSON_AddNumberToObject(o, "kv_used", (double)e->kv_used);
    cJSON_AddNumberToObject(o, "sessions", e->sessions);
    cJSON_AddNumberToObject(o, "load", e->load);
    cJSON_AddStringToObject(o, "state", cl_state_name(e->state));
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

static int get_str(const cJSON *o, const char *name, char *out, size_t cap, bool nonempty, char *msg, size_t mcap) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!cJSON_IsString(v) || strlen(v->valuestring) >= cap || (nonempty && !v->valuestring[0]))
        return kvs_fail(msg, mcap, KVS_ERR_FORMAT, "registry entry: \"%s\" missing, not a string or too long", name);
    snprintf(out, cap, "%s", v->valuestring);
    return KVS_OK;
}

static int get_num(const cJSON *v, const char *name, double max, double *out, char *msg, size_t mcap) {
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble < 0 || v->valuedouble > max)
        return kvs_fail(msg, mcap, KVS_ERR_FORMAT, "registry entry: \"%s\" missing or out of range", name);
    *out = v->valuedouble;
    return KVS_OK;
}

static int check_entry(const cl_entry *e, char *msg, size_t cap) {
    if (strlen(e->digest) != CL_DIGEST_HEX || strspn(e->digest, "0123456789abcdef") != CL_DIGEST_HEX)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "registry entry: \"digest\" is not 64 lowercase hex digits");
    const char *colon = strrchr(e->addr, ':');
    if (!colon || colon == e->addr || !colon[1] || strspn(colon + 1, "0123456789") != strlen(colon + 1) ||
        atol(colon + 1) < 1 || atol(colon + 1) > 65535)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "registry entry: \"addr\" '%s' is not HOST:PORT", e->addr);
    if (e->n_layer == 0 || e->first >= e->last || e->last > e->n_layer)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "registry entry: layers [%u, %u) do not fit n_layer %u", e->first,
                        e->last, e->n_layer);
    return KVS_OK;
}

static int decode_fields(const cJSON *o, cl_entry *e, char *msg, size_t cap) {
    int err;
    if ((err = get_str(o, "addr", e->addr, sizeof e->addr, true, msg, cap)) ||
        (err = get_str(o, "name", e->name, sizeof e->name, false, msg, cap)) ||
        (err = get_str(o, "digest", e->digest, sizeof e->digest, true, msg, cap)) ||
        (err = get_str(o, "tls_id", e->tls_id, sizeof e->tls_id, false, msg, cap)))
        return err;
    const cJSON *l = cJSON_GetObjectItemCaseSensitive(o, "layers");
    if (!cJSON_IsArray(l) || cJSON_GetArraySize(l) != 2)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "registry entry: \"layers\" is not [first, last]");
    double v[8];
    if ((err = get_num(cJSON_GetObjectItemCaseSensitive(o, "n_layer"), "n_layer", CL_MAX_LAYERS, &v[0], msg, cap)) ||
        (err = get_num(cJSON_GetArrayItem(l, 0), "layers", CL_MAX_LAYERS, &v[1], msg, cap)) ||
        (err = get_num(cJSON_GetArrayItem(l, 1), "layers", CL_MAX_LAYERS, &v[2], msg, cap)) ||
        (err = get_num(cJSON_GetObjectItemCaseSensitive(o, "proto"), "proto", 65535, &v[3], msg, cap)) ||
        (err = get_num(cJSON_GetObjectItemCaseSensitive(o, "kv_budget"), "kv_budget", 9.0e18, &v[4], msg, cap)) ||
        (err = get_num(cJSON_GetObjectItemCaseSensitive(o, "kv_used"), "kv_used", 9.0e18, &v[5], msg, cap)) ||
        (err = get_num(cJSON_GetObjectItemCaseSensitive(o, "sessions"), "sessions", 4.0e9, &v[6], msg, cap)) ||
        (err = get_num(cJSON_GetObjectItemCaseSensitive(o, "load"), "load", 1.0e9, &v[7], msg, cap)))
        return err;
    e->n_layer = (uint32_t)v[0];
    e->first = (uint32_t)v[1];
    e->last = (uint32_t)v[2];
    e->proto = (uint32_t)v[3];
    e->kv_budget = (uint64_t)v[4];
    e->kv_used = (uint64_t)v[5];
    e->sessions = (uint32_t)v[6];
    e->load = v[7];
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "state");
    if (!cJSON_IsString(st) || (strcmp(st->valuestring, "serving") && strcmp(st->valuestring, "draining")))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "registry entry: \"state\" is not serving or draining");
    e->state = strcmp(st->valuestring, "serving") ? CL_DRAINING : CL_SERVING;
    return check_entry(e, msg, cap);
}

int cl_entry_decode(const char *json, size_t len, cl_entry *out, char *msg, size_t cap) {
    memset(out, 0, sizeof *out);
    cJSON *o = cJSON_ParseWithLength(json, len);
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "registry entry: not a JSON object");
    }
    int err = decode_fields(o, out, msg, cap);
    cJSON_Delete(o);
    if (err) memset(out, 0, sizeof *out);
    return err;
}

void cl_entry_key(const cl_entry *e, const char *prefix, char *out, size_t cap) {
    snprintf(out, cap, "%sshards/%s/%s", prefix, e->digest, e->addr);
}
