/* prom.c — see prom.h. */
#include "prom.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dt_util.h"

void dt_prom_escape_label(FILE *out, const char *s)
{
  for (; s && *s; s++) {
    if (*s == '\\')
      fputs("\\\\", out);
    else if (*s == '"')
      fputs("\\\"", out);
    else if (*s == '\n')
      fputs("\\n", out);
    else
      fputc(*s, out);
  }
}

void dt_prom_family(FILE *out, const char *name, const char *type, const char *help)
{
  fprintf(out, "# HELP %s ", name);
  for (const char *s = help; *s; s++) {
    if (*s == '\\')
      fputs("\\\\", out);
    else if (*s == '\n')
      fputs("\\n", out);
    else
      fputc(*s, out);
  }
  fprintf(out, "\n# TYPE %s %s\n", name, type);
}

void dt_prom_value(FILE *out, double v)
{
  if (isnan(v)) {
    fputs("NaN", out);
    return;
  }
  if (isinf(v)) {
    fputs(v > 0 ? "+Inf" : "-Inf", out);
    return;
  }
  /* The shortest of %.15g / %.17g that reads back exactly: 0.1 stays "0.1". */
  char buf[32];
  snprintf(buf, sizeof buf, "%.15g", v);
  if (strtod(buf, NULL) != v)
    snprintf(buf, sizeof buf, "%.17g", v);
  fputs(buf, out);
}

static void write_labels(FILE *out, const dt_prom_label_t *labels, size_t n, const char *le)
{
  if (n == 0 && !le)
    return;
  fputc('{', out);
  for (size_t i = 0; i < n; i++) {
    fprintf(out, "%s%s=\"", i ? "," : "", labels[i].name);
    dt_prom_escape_label(out, labels[i].value);
    fputc('"', out);
  }
  if (le)
    fprintf(out, "%sle=\"%s\"", n ? "," : "", le);
  fputc('}', out);
}

void dt_prom_sample(FILE *out, const char *name, const dt_prom_label_t *labels, size_t n_labels,
                    double value)
{
  fputs(name, out);
  write_labels(out, labels, n_labels, NULL);
  fputc(' ', out);
  dt_prom_value(out, value);
  fputc('\n', out);
}

void dt_prom_hist_init(dt_prom_hist_t *h, const double *bounds, size_t n_bounds)
{
  memset(h, 0, sizeof *h);
  h->bounds = bounds;
  h->n_bounds = DT_MIN(n_bounds, (size_t)DT_PROM_MAX_BUCKETS);
}

void dt_prom_hist_observe(dt_prom_hist_t *h, double v)
{
  if (isnan(v))
    return;
  size_t i = 0;
  while (i < h->n_bounds && v > h->bounds[i])
    i++;
  h->counts[i]++;
  h->sum += v;
  h->count++;
}

void dt_prom_hist_write(FILE *out, const char *name, const dt_prom_label_t *labels, size_t n_labels,
                        const dt_prom_hist_t *h)
{
  uint64_t cum = 0;
  for (size_t i = 0; i <= h->n_bounds; i++) {
    char le[32];
    cum += h->counts[i];
    if (i < h->n_bounds) {
      snprintf(le, sizeof le, "%.15g", h->bounds[i]);
    } else {
      snprintf(le, sizeof le, "+Inf");
    }
    fprintf(out, "%s_bucket", name);
    write_labels(out, labels, n_labels, le);
    fprintf(out, " %llu\n", (unsigned long long)cum);
  }
  fprintf(out, "%s_sum", name);
  write_labels(out, labels, n_labels, NULL);
  fputc(' ', out);
  dt_prom_value(out, h->sum);
  fprintf(out, "\n%s_count", name);
  write_labels(out, labels, n_labels, NULL);
  fprintf(out, " %llu\n", (unsigned long long)h->count);
}
