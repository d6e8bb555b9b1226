/* Small helpers for parsing subcommand options. */
#ifndef KVS_ARGS_H
#define KVS_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Each returns false (after printing "kvshard CMD: ...") when the value is
 * missing or malformed. *i is advanced past the consumed value. */
bool args_str(int argc, char **argv, int *i, const char **out);
bool args_int(int argc, char **argv, int *i, long lo, long hi, long *out);
bool args_float(int argc, char **argv, int *i, double lo, double hi, double *out);
bool args_u64(int argc, char **argv, int *i, uint64_t *out);
/* --kv-type value: "f16" or "f32" -> QUANT_F16 / QUANT_F32. */
bool args_kv_type(int argc, char **argv, int *i, uint32_t *out);
/* Parses "ID,ID,..." (each 0..INT32_MAX; "" is no ids) into a malloc'd array (*ids, *n;
 * the caller frees). Returns 0, or -1 on a malformed list (nothing allocated then). */
int args_ids(const char *s, int32_t **ids, size_t *n);
/* Parses "123", "64K", "512M", "2G" (powers of 1024). */
bool args_size(const char *s, uint64_t *out);

#endif /* KVS_ARGS_H */
