/* prom.h — writing the Prometheus text exposition format, version 0.0.4.
 *
 *   # HELP distrain_job_step Rank 0's last reported step.
 *   # TYPE distrain_job_step gauge
 *   distrain_job_step{job_id="job-1"} 120
 *
 * Invariants:
 *  - Label values escape backslash, double quote and newline (\\, \", \n); HELP text escapes
 *    backslash and newline. Names are the caller's and are not checked.
 *  - Values are written exactly (the shortest form that reads back as the same double);
 *    non-finite ones as NaN, +Inf, -Inf.
 *  - A histogram's buckets are cumulative, in ascending order of le, and end with le="+Inf"
 *    equal to _count; _sum and _count follow.
 *  - Every sample of a family must be written right after its HELP/TYPE lines (the format
 *    requires a family's samples to be contiguous): that is the caller's ordering to keep. */
#ifndef DT_PROM_H
#define DT_PROM_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define DT_PROM_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"
#define DT_PROM_MAX_BUCKETS  16

typedef struct {
  const char *name, *value;
} dt_prom_label_t;

/* A histogram with fixed upper bounds (ascending; +Inf is implicit). */
typedef struct {
  const double *bounds; /* (n_bounds) borrowed: usually a static table */
  size_t n_bounds;
  uint64_t counts[DT_PROM_MAX_BUCKETS + 1]; /* per bucket, not cumulative; [n_bounds]: above all */
  double sum;
  uint64_t count;
} dt_prom_hist_t;

/* # HELP and # TYPE lines; type is "gauge", "counter" or "histogram". */
void dt_prom_family(FILE *out, const char *name, const char *type, const char *help);
/* name{labels} value */
void dt_prom_sample(FILE *out, const char *name, const dt_prom_label_t *labels, size_t n_labels,
                    double value);
void dt_prom_value(FILE *out, double v);
void dt_prom_escape_label(FILE *out, const char *s);

/* n_bounds <= DT_PROM_MAX_BUCKETS. */
void dt_prom_hist_init(dt_prom_hist_t *h, const double *bounds, size_t n_bounds);
/* Counts v in the first bucket whose bound is >= v (NaN is ignored). */
void dt_prom_hist_observe(dt_prom_hist_t *h, double v);
/* name_bucket{labels,le=".."} for every bound and +Inf, then name_sum and name_count. */
void dt_prom_hist_write(FILE *out, const char *name, const dt_prom_label_t *labels, size_t n_labels,
                        const dt_prom_hist_t *h);

#endif
