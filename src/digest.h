/* digest — SHA-256 of a model file (libsodium), the identity of its exact weights. */
#ifndef KVS_DIGEST_H
#define KVS_DIGEST_H

#include <stdint.h>

/* Hashes the whole file at path into out. KVS_OK, KVS_ERR_IO when it cannot be read,
 * KVS_ERR_INTERNAL when libsodium cannot start. out is untouched on failure. */
int digest_file_sha256(const char *path, uint8_t out[32]);
/* Lower-case hex of a 32-byte digest, NUL-terminated. */
void digest_hex(const uint8_t d[32], char hex[65]);

#endif /* KVS_DIGEST_H */
