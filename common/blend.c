/* blend.c — see blend.h. */
#include "blend.h"

#include <ctype.h>
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

/* The item of a comma-separated list at *p, into part; *p moves past its comma, or to NULL
 * after the last item. -1 when the item is longer than part holds. */
static int next_item(const char **p, char *part, size_t n)
{
  const char *comma = strchr(*p, ',');
  const size_t len = comma ? (size_t)(comma - *p) : strlen(*p);
  if (len >= n)
    return -1;
  memcpy(part, *p, len);
  part[len] = '\0';
  *p = comma ? comma + 1 : NULL;
  return 0;
}

/* Whether name is 1-31 of [A-Za-z0-9_.-]: a JSON key, a Prometheus label value and a word in a
 * log line as it is. */
static int name_ok(const char *name, size_t len)
{
  if (len == 0 || len >= DT_NAME_MAX)
    return 0;
  for (size_t i = 0; i < len; i++)
    if (!isalnum((unsigned char)name[i]) && !strchr("_.-", name[i]))
      return 0;
  return 1;
}

/* Whether two of the first n names are the same: the later one's index, else -1. */
static int name_twice(const char (*name)[DT_NAME_MAX], int n)
{
  for (int i = 1; i < n; i++)
    for (int j = 0; j < i; j++)
      if (strcmp(name[i], name[j]) == 0)
        return i;
  return -1;
}

int dt_blend_parse(const char *spec, dt_blend_t *b, char *why, size_t whylen)
{
  memset(b, 0, sizeof *b);
  for (const char *p = spec; p;) {
    char part[4096];
    double w;
    const char *colon;
    if (next_item(&p, part, sizeof part) != 0) {
      snprintf(why, whylen, "blend source %d is longer than %zu characters", b->n + 1,
               sizeof part - 1);
      goto bad;
    }
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
    const char *glob = colon + 1, *eq = strchr(glob, '=');
    if (eq && name_ok(glob, (size_t)(eq - glob))) {
      memcpy(b->name[b->n], glob, (size_t)(eq - glob));
      b->named[b->n] = 1;
      glob = eq + 1;
    } else {
      snprintf(b->name[b->n], DT_NAME_MAX, "src%d", b->n + 1);
    }
    if (*glob == '\0') {
      snprintf(why, whylen, "blend source %d ('%s') names no shards", b->n + 1, part);
      goto bad;
    }
    b->weight[b->n] = w;
    b->pattern[b->n] = strdup(glob);
    if (!b->pattern[b->n++]) {
      dt_blend_free(b);
      return DT_ENOMEM;
    }
  }
  const int twice = name_twice(b->name, b->n);
  if (twice >= 0) {
    snprintf(why, whylen, "blend source %d: the name '%s' is used twice", twice + 1,
             b->name[twice]);
    goto bad;
  }
  return 0;
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
    cap += 32 + DT_NAME_MAX + strlen(b->pattern[i]);
  char *s = malloc(cap), *p = s;
  if (!s)
    return NULL;
  *s = '\0';
  for (int i = 0; i < b->n; i++) {
    char w[32];
    format_weight(w, sizeof w, b->weight[i]);
    p += snprintf(p, cap - (size_t)(p - s), "%s%s:%s%s%s", i ? "," : "", w,
                  b->named[i] ? b->name[i] : "", b->named[i] ? "=" : "", b->pattern[i]);
  }
  return s;
}

void dt_blend_free(dt_blend_t *b)
{
  for (int i = 0; i < b->n; i++)
    free(b->pattern[i]);
  memset(b, 0, sizeof *b);
}

int dt_blend_names(const char *spec, char (*name)[DT_NAME_MAX])
{
  dt_blend_t b;
  char why[256];
  if (!spec || !dt_blend_is(spec) || dt_blend_parse(spec, &b, why, sizeof why) != 0)
    return 0;
  const int n = b.n;
  memcpy(name, b.name, (size_t)n * sizeof *name);
  dt_blend_free(&b);
  return n;
}

int dt_valsets_parse(const char *spec, dt_valsets_t *v, char *why, size_t whylen)
{
  memset(v, 0, sizeof *v);
  for (const char *p = spec; p;) {
    char part[4096];
    if (next_item(&p, part, sizeof part) != 0) {
      snprintf(why, whylen, "validation set %d is longer than %zu characters", v->n + 1,
               sizeof part - 1);
      goto bad;
    }
    if (v->n == DT_VALSETS_MAX) {
      snprintf(why, whylen, "at most %d validation sets", DT_VALSETS_MAX);
      goto bad;
    }
    const char *eq = strchr(part, '=');
    if (!eq) {
      snprintf(why, whylen, "validation set %d ('%s') is not NAME=GLOB", v->n + 1, part);
      goto bad;
    }
    const size_t len = (size_t)(eq - part);
    if (!name_ok(part, len)) {
      snprintf(why, whylen,
               "validation set %d ('%s'): a name is 1 to %d letters, digits, '_', '.' or '-'",
               v->n + 1, part, DT_NAME_MAX - 1);
      goto bad;
    }
    memcpy(v->name[v->n], part, len);
    v->name[v->n][len] = '\0';
    if (name_twice(v->name, v->n + 1) >= 0) {
      snprintf(why, whylen, "validation set %d: the name '%s' is used twice", v->n + 1,
               v->name[v->n]);
      goto bad;
    }
    if (eq[1] == '\0') {
      snprintf(why, whylen, "validation set %d ('%s') names no shards", v->n + 1, part);
      goto bad;
    }
    v->pattern[v->n] = strdup(eq + 1);
    if (!v->pattern[v->n++]) {
      dt_valsets_free(v);
      return DT_ENOMEM;
    }
  }
  return 0;
bad:
  dt_valsets_free(v);
  return DT_EINVAL;
}

char *dt_valsets_format(const dt_valsets_t *v)
{
  size_t cap = 1;
  for (int i = 0; i < v->n; i++)
    cap += DT_NAME_MAX + 2 + strlen(v->pattern[i]);
  char *s = malloc(cap), *p = s;
  if (!s)
    return NULL;
  *s = '\0';
  for (int i = 0; i < v->n; i++)
    p += snprintf(p, cap - (size_t)(p - s), "%s%s=%s", i ? "," : "", v->name[i], v->pattern[i]);
  return s;
}

void dt_valsets_free(dt_valsets_t *v)
{
  for (int i = 0; i < v->n; i++)
    free(v->pattern[i]);
  memset(v, 0, sizeof *v);
}

/* "NAME 1.2345, NAME 2.3456" of n losses at buf (as much as len holds). */
static void losses_list(char *buf, size_t len, int n, const char *const *name, const float *loss)
{
  size_t at = 0;
  buf[0] = '\0';
  for (int i = 0; i < n && at < len; i++)
    at += (size_t)snprintf(buf + at, len - at, "%s%.*s %.4f", i ? ", " : "", DT_NAME_MAX - 1,
                           name[i], loss[i]);
}

void dt_valsets_line(char *buf, size_t len, const float *val, int n, const char *const *name,
                     const float *loss)
{
  char list[DT_VALSETS_MAX * (DT_NAME_MAX + 16)];
  losses_list(list, sizeof list, n, name, loss);
  if (val && n)
    snprintf(buf, len, " | val %.4f (%s)", *val, list);
  else if (val)
    snprintf(buf, len, " | val %.4f", *val);
  else if (n)
    snprintf(buf, len, " | val %s", list);
  else
    buf[0] = '\0';
}

void dt_sources_line(char *buf, size_t len, int n, const char *const *name, const float *loss)
{
  char list[DT_BLEND_MAX * (DT_NAME_MAX + 16)];
  losses_list(list, sizeof list, n, name, loss);
  if (n)
    snprintf(buf, len, " (%s)", list);
  else
    buf[0] = '\0';
}
