/* digest — SHA-256 of a model file or of all parts of a split model (libsodium), the identity of its exact weights. */
#ifndef KVS_DIGEST_H
#define KVS_DIGEST_H

#include <stdbool.h>
#include <stdint.h>

/* Hashes the whole file at path into out. KVS_OK, KVS_ERR_IO when it cannot be read,
 * KVS_ERR_INTERNAL when libsodium cannot start. out is untouched on failure. */
int digest_file_sha256(const char *path, uint8_t out[32]);
/* The model's digest: digest_file_sha256 of a single file; for the first part of a split model
 * (PREFIX-00001-of-NNNNN.gguf, N > 1) with a kvshard manifest, the manifest's model digest (the
 * SHA-256 of the unsplit file, so whole-file and split shards agree; read from part 1 alone,
 * the other parts' tensors are checked against the manifest when a model maps them); without
 * one, the SHA-256 of all N parts in order, so every shard of the same split agrees and a change
 * in any part shows. Same codes as digest_file_sha256 (KVS_ERR_IO also when a part is missing,
 * KVS_ERR_FORMAT for a malformed manifest). */
int digest_model_sha256(const char *path, uint8_t out[32]);
/* digest_model_sha256 through a cache in cache_dir (created, mode 0700, when missing): an entry
 * is keyed by every part's real path, device, inode, size, mtime and ctime, so a file changed or
 * replaced in any way (even with its old mtime put back) is hashed again. *hit says whether the
 * cache answered. The cache is a convenience: when it cannot be read or written the file is
 * hashed as without it. Whoever can write cache_dir can make a shard claim another digest, so it
 * belongs to the user running the shard. Same codes as digest_model_sha256. */
int digest_model_cached(const char *path, const char *cache_dir, uint8_t out[32], bool *hit);
/* The cache's answer alone: true with out filled when cache_dir holds the entry of path. */
bool digest_cache_get(const char *path, const char *cache_dir, uint8_t out[32]);
/* Lower-case hex of a 32-byte digest, NUL-terminated. */
void digest_hex(const uint8_t d[32], char hex[65]);

#endif /* KVS_DIGEST_H */
