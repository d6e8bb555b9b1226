/* jsonl — reading a reference file of one JSON object per line (the ../shared/reference and
 * ../shared/downloads/reference formats), for reference_check.h and test_downloads. */
#ifndef KVS_JSONL_H
#define KVS_JSONL_H

#include <cjson/cJSON.h>

#include "test.h"

typedef void (*jsonl_fn)(cJSON *line, int line_no, void *ctx);

/* Calls fn(line, line_no, ctx) on each line of path that parses, line_no counting those from 1,
 * until max_lines of them; CHECKs that the file opens and that every line read parses. The line
 * is freed after fn returns. Returns the number of lines passed to fn. */
static inline int jsonl_each(const char *path, int max_lines, jsonl_fn fn, void *ctx) {
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    char *buf = NULL;
    size_t cap = 0;
    int line_no = 0;
    while (f && line_no < max_lines && getline(&buf, &cap, f) > 0) {
        cJSON *line = cJSON_Parse(buf);
        CHECK(line != NULL);
        if (line) fn(line, ++line_no, ctx);
        cJSON_Delete(line);
    }
    free(buf);
    if (f) fclose(f);
    return line_no;
}

#endif /* KVS_JSONL_H */
