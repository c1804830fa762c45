/* evalset.h — multiple-choice evaluation sets (HellaSwag) in llm.c's eval file format.
 *
 * An example is a context and several completions, one of them right (its label). A model
 * picks the completion it finds most likely after the context: the lowest mean loss over the
 * completion's tokens (acc_norm, as llm.c and its hellaswag.py report) or the lowest total
 * loss (acc). Each completion is one row: the context's tokens then the completion's, the
 * model predicting every completion token from the tokens before it.
 *
 * File format (llm.c's dev/data/data_common.py write_evalfile; little-endian): 256 int32
 * {20240522, 1, examples, longest example in bytes, 0...}, then per example a stream of
 * uint16: 65535, the example's bytes (these fields included), its index (0, 1, ...), its
 * label, its number of completions, the context's length and tokens, and per completion its
 * length and tokens. Token 65535 cannot occur (it marks an example's start).
 *
 * Loading checks all of it, and the tokens against the vocabulary; errors name the file and
 * the example. */
#ifndef DT_TRAINER_EVALSET_H
#define DT_TRAINER_EVALSET_H

#include <stddef.h>
#include <stdint.h>

#define DT_EVAL_MAGIC           20240522
#define DT_EVAL_VERSION         1
#define DT_EVAL_MAX_COMPLETIONS 64

typedef struct {
  int label; /* the right completion */
  int row0;  /* its completions are rows row0 .. row0 + nrows - 1 */
  int nrows;
  size_t ctx; /* offset of its context in the stream: the length, then the tokens */
} dt_eval_example_t;

typedef struct {
  int n;                 /* examples */
  int rows;              /* completions over all examples */
  dt_eval_example_t *ex; /* (n) */
  size_t *row;           /* (rows) offset of a completion in stream: its length, then tokens */
  uint16_t *stream;      /* the examples as the file holds them */
  size_t len, cap;       /* uint16 values in stream */
  size_t ncap, rcap;     /* capacity of ex and row */
  int longest;           /* the longest example in bytes (the header's field) */
  int max_tokens;        /* the longest row: context + completion tokens */
} dt_evalset_t;

/* Reads and checks an eval file; tokens must be < vocab. */
int dt_evalset_load(dt_evalset_t *e, const char *path, int vocab);
/* Appends an example (e starts zeroed). Refuses what the format cannot hold: a label outside
 * the completions, fewer than 2 or more than DT_EVAL_MAX_COMPLETIONS completions, an empty
 * context or completion, token 65535, an example of 65536 bytes or more, 65536 examples.
 * *why (n bytes) then says which. */
int dt_evalset_add(dt_evalset_t *e, int label, const int *ctx, int nctx, const int *const *comp,
                   const int *ncomp, int ncompletions, char *why, size_t n);
/* Writes e as an eval file (temporary name, fsync, rename). */
int dt_evalset_save(const dt_evalset_t *e, const char *path);
void dt_evalset_free(dt_evalset_t *e);

/* Row r as a model reads it in a window of T positions (T >= its tokens - 1): inputs and
 * targets (T each; 0 past the row's end); the completion's targets are positions first ..
 * first + count - 1. */
void dt_evalset_row(const dt_evalset_t *e, int r, int T, int *inputs, int *targets, int *first,
                    int *count);
/* The positions row r takes: its tokens but the last. */
int dt_evalset_row_positions(const dt_evalset_t *e, int r);
#endif
