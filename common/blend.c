/* blend.c — see blend.h. */
#include "blend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_error.h"

/* The weight's text and its end: the number before the first colon, or NULL. */
static int weight_prefix(const char *s, double *w, const char **colon)
{
  char *end;
  *w = strtod(s, &end);
  if (end == s || *end != ':')
    return 0;
  *colon = end;
  return 1;
}

int dt_blend_is(const char *spec)
{
  double w;
  const char *colon;
  return spec && weight_prefix(spec, &w, &colon);
}

int dt_blend_parse(const char *spec, dt_blend_t *b, char *why, size_t whylen)
{
  memset(b, 0, sizeof *b);
  const char *p = spec;
  for (;;) {
    const char *comma = strchr(p, ',');
    const size_t len = comma ? (size_t)(comma - p) : strlen(p);
    char part[4096];
    if (len >= sizeof part) {
      snprintf(why, whylen, "blend source %d is longer than %zu characters", b->n + 1,
               sizeof part - 1);
      goto bad;
    }
    memcpy(part, p, len);
    part[len] = '\0';
    double w;
    const char *colon;
    if (b->n == DT_BLEND_MAX) {
      snprintf(why, whylen, "a blend has at most %d sources", DT_BLEND_MAX);
      goto bad;
    }
    if (!weight_prefix(part, &w, &colon)) {
      snprintf(why, whylen, "blend source %d ('%s') is not WEIGHT:GLOB", b->n + 1, part);
      goto bad;
    }
    if (!(w > 0.0) || !isfinite(w)) {
      snprintf(why, whylen, "blend source %d ('%s'): the weight must be a positive number",
               b->n + 1, part);
      goto bad;
    }
    if (colon[1] == '\0') {
      snprintf(why, whylen, "blend source %d ('%s') names no shards", b->n + 1, part);
      goto bad;
    }
    b->weight[b->n] = w;
    b->pattern[b->n] = strdup(colon + 1);
    if (!b->pattern[b->n++]) {
      dt_blend_free(b);
      return DT_ENOMEM;
    }
    if (!comma)
      return 0;
    p = comma + 1;
  }
bad:
  dt_blend_free(b);
  return DT_EINVAL;
}

/* The shortest %g text that reads back as w. */
static void format_weight(char *buf, size_t n, double w)
{
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(buf, n, "%.*g", prec, w);
    if (strtod(buf, NULL) == w)
      return;
  }
}

char *dt_blend_format(const dt_blend_t *b)
{
  size_t cap = 1;
  for (int i = 0; i < b->n; i++)
    cap += 32 + strlen(b->pattern[i]);
  char *s = malloc(cap), *p = s;
  if (!s)
    return NULL;
  *s = '\0';
  for (int i = 0; i < b->n; i++) {
    char w[32];
    format_weight(w, sizeof w, b->weight[i]);
    p += snprintf(p, cap - (size_t)(p - s), "%s%s:%s", i ? "," : "", w, b->pattern[i]);
  }
  return s;
}

void dt_blend_free(dt_blend_t *b)
{
  for (int i = 0; i < b->n; i++)
    free(b->pattern[i]);
  memset(b, 0, sizeof *b);
}
