/* blend.h — lists of data sources in one flag or job-spec string:
 *
 * - a weighted blend of training-data sources, as Megatron-LM's `--data-path 0.7 web 0.3 code`
 *   gives one: "W:GLOB[,W:GLOB...]" (`--train`, `--val` and the job spec's data.train and
 *   data.val), each source a file or glob of token shards with a positive weight. The weights
 *   are relative (they are normalised by their sum). A source may be named, "W:NAME=GLOB"
 *   (NAME as a validation set's, below; a glob whose text before its first '=' would be a name
 *   is written "./x=y..."); unnamed ones are src1, src2, ... by their place. Training reports
 *   each source's loss under its name.
 * - named validation sets, as Megatron-LM's `--multiple-validation-sets` evaluates its
 *   validation paths: "NAME=GLOB[,NAME=GLOB...]" (`--val-sets`, data.val_sets), each set a file
 *   or glob of token shards whose validation loss is reported alone, under its name.
 *
 * A path inside either may not contain a comma. How they are read is the data loader's
 * (dataloader.h) and the trainer's; this is their syntax, shared by the trainer, the job-spec
 * validation and distrainctl (which makes relative paths absolute). */
#ifndef DT_BLEND_H
#define DT_BLEND_H

#include <stddef.h>

#define DT_BLEND_MAX 64 /* sources in a blend */
#define DT_NAME_MAX  32 /* a validation set's or a blend source's name, with its NUL */

typedef struct {
  int n;
  double weight[DT_BLEND_MAX];          /* as written: finite, > 0 */
  char *pattern[DT_BLEND_MAX];          /* owned */
  char name[DT_BLEND_MAX][DT_NAME_MAX]; /* as written, else "src<i>"; each used once */
  int named[DT_BLEND_MAX];              /* whether the name was written */
} dt_blend_t;

/* Whether spec is written as a blend: it starts with a number and a colon ("0.7:..."). A path
 * never parses as a number, so anything else is one source. */
int dt_blend_is(const char *spec);
/* Parses a blend. A bad one (an empty source, a weight that is not a positive finite number,
 * an empty pattern, a name used twice, more than DT_BLEND_MAX sources) is DT_EINVAL with a
 * one-line reason in why naming the source. */
int dt_blend_parse(const char *spec, dt_blend_t *b, char *why, size_t whylen);
/* Writes b back as "W:GLOB,..." or "W:NAME=GLOB,..." for a source named so (each weight in the
 * shortest text that reads back exactly) into a new string; NULL when out of memory. */
char *dt_blend_format(const dt_blend_t *b);
void dt_blend_free(dt_blend_t *b);
/* The names of spec's sources, in its order, into name (room for DT_BLEND_MAX); their count, 0
 * for a spec that is one source or no valid blend. */
int dt_blend_names(const char *spec, char (*name)[DT_NAME_MAX]);

#define DT_VALSETS_MAX 16 /* named validation sets */

typedef struct {
  int n;
  char name[DT_VALSETS_MAX][DT_NAME_MAX]; /* 1-31 of [A-Za-z0-9_.-], each used once */
  char *pattern[DT_VALSETS_MAX];          /* owned */
} dt_valsets_t;

/* Parses "NAME=GLOB,...". A bad one (a set without NAME=, a name that is empty, too long, of
 * other characters or used twice, an empty pattern, more than DT_VALSETS_MAX sets) is DT_EINVAL
 * with a one-line reason in why naming the set. */
int dt_valsets_parse(const char *spec, dt_valsets_t *v, char *why, size_t whylen);
/* Writes v back as "NAME=GLOB,..." into a new string; NULL when out of memory. */
char *dt_valsets_format(const dt_valsets_t *v);
void dt_valsets_free(dt_valsets_t *v);
/* A step line's validation, as the trainer and distrainctl print it: " | val 3.0123" (val not
 * NULL), " | val web 3.1000, code 2.5000" (n named sets' losses), or both as " | val 3.0123 (web
 * 3.1000, code 2.5000)"; "" for neither. */
void dt_valsets_line(char *buf, size_t len, const float *val, int n, const char *const *name,
                     const float *loss);
/* A step line's losses of a blend's sources, after its loss: " (web 2.1000, code 2.5000)"; ""
 * for n = 0. */
void dt_sources_line(char *buf, size_t len, int n, const char *const *name, const float *loss);

#endif
