#include "prom.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

void prom_observe(prom_hist *h, const double *bounds, int n_bounds, double v) {
    int b = n_bounds;
    for (int i = 0; i < n_bounds; i++)
        if (v <= bounds[i]) {
            b = i;
            break;
        }
    h->bucket[b]++;
    h->count++;
    h->sum += v;
}

void prom_printf(prom_buf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        if (b->cap - b->len < 64) {
            size_t nc = b->cap ? b->cap * 2 : 4096;
            char *ns = realloc(b->s, nc);
            if (!ns) {
                b->oom = true;
                return;
            }
            b->s = ns;
            b->cap = nc;
        }
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t nc = b->cap * 2 + (size_t)n;
        char *ns = realloc(b->s, nc);
        if (!ns) {
            b->oom = true;
            return;
        }
        b->s = ns;
        b->cap = nc;
    }
}

void prom_family(prom_buf *b, const char *name, const char *type, const char *help) {
    prom_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

void prom_counter(prom_buf *b, const char *name, const char *help, uint64_t v) {
    prom_family(b, name, "counter", help);
    prom_printf(b, "%s %llu\n", name, (unsigned long long)v);
}

void prom_gauge(prom_buf *b, const char *name, const char *help, double v) {
    prom_family(b, name, "gauge", help);
    prom_printf(b, "%s %.17g\n", name, v);
}

void prom_histogram(prom_buf *b, const char *name, const char *help, const prom_hist *h, const double *bounds,
                    int n_bounds) {
    prom_family(b, name, "histogram", help);
    uint64_t cum = 0;
    for (int i = 0; i < n_bounds; i++) {
        cum += h->bucket[i];
        prom_printf(b, "%s_bucket{le=\"%g\"} %llu\n", name, bounds[i], (unsigned long long)cum);
    }
    prom_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)h->count);
    prom_printf(b, "%s_sum %.9g\n%s_count %llu\n", name, h->sum, name, (unsigned long long)h->count);
}

char *prom_take(prom_buf *b) {
    if (b->oom || !b->s) {
        free(b->s);
        b->s = NULL;
        return NULL;
    }
    char *s = b->s;
    b->s = NULL;
    return s;
}
