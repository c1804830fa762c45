/* blend.h — a weighted blend of training-data sources, as Megatron-LM's `--data-path 0.7 web
 * 0.3 code` gives one: "W:GLOB[,W:GLOB...]" (`--train` and the job spec's data.train), each
 * source a file or glob of token shards with a positive weight. The weights are relative (they
 * are normalised by their sum). A path inside a blend may not contain a comma.
 *
 * How a blend is read is the data loader's (dataloader.h); this is its syntax, shared by the
 * trainer, the job-spec validation and distrainctl (which makes relative paths absolute). */
#ifndef DT_BLEND_H
#define DT_BLEND_H

#include <stddef.h>

#define DT_BLEND_MAX 64 /* sources in a blend */

typedef struct {
  int n;
  double weight[DT_BLEND_MAX]; /* as written: finite, > 0 */
  char *pattern[DT_BLEND_MAX]; /* owned */
} dt_blend_t;

/* Whether spec is written as a blend: it starts with a number and a colon ("0.7:..."). A path
 * never parses as a number, so anything else is one source. */
int dt_blend_is(const char *spec);
/* Parses a blend. A bad one (an empty source, a weight that is not a positive finite number,
 * an empty pattern, more than DT_BLEND_MAX sources) is DT_EINVAL with a one-line reason in why
 * naming the source. */
int dt_blend_parse(const char *spec, dt_blend_t *b, char *why, size_t whylen);
/* Writes b back as "W:GLOB,..." (each weight in the shortest text that reads back exactly) into a
 * new string; NULL when out of memory. */
char *dt_blend_format(const dt_blend_t *b);
void dt_blend_free(dt_blend_t *b);

#endif
