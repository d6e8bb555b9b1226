/* Test helper: flips one byte in the middle of a tensor's data in a GGUF file, in place. */
#ifndef KVS_TEST_GGUF_FLIP_H
#define KVS_TEST_GGUF_FLIP_H

#include <stdio.h>

#include "gguf.h"
#include "test.h"
#include "util.h"

/* Flips one byte in the middle of tensor name's data in the GGUF at path (twice: the original). */
static inline void flip_tensor_byte(const char *path, const char *name) {
    char msg[KVS_MSG_MAX];
    gguf_ctx *g = NULL;
    CHECK_EQ_INT(gguf_open_header(path, &g, msg, sizeof(msg)), KVS_OK);
    const gguf_tensor *t = g ? gguf_find_tensor(g, name) : NULL;
    CHECK(t != NULL);
    long at = t ? (long)(gguf_data_offset(g) + t->offset + t->size / 2) : 0;
    gguf_close(g);
    FILE *f = t ? fopen(path, "r+b") : NULL;
    CHECK(f != NULL);
    if (!f) return;
    CHECK(fseek(f, at, SEEK_SET) == 0);
    int c = fgetc(f);
    CHECK(fseek(f, at, SEEK_SET) == 0);
    CHECK(fputc(c ^ 0x5a, f) != EOF);
    CHECK(fclose(f) == 0);
}

#endif /* KVS_TEST_GGUF_FLIP_H */
