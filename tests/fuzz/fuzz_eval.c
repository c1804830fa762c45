/* fuzz_eval.c — a multiple-choice eval file as found on disk (llm.c's eval format, evalset.h):
 * distrain-train --eval loads it or refuses it with a reason. Properties of an accepted file:
 * its tokens are below the vocabulary; every row, laid out in the window the trainer would
 * use, has its completion's targets where dt_evalset_row says and each target is the next
 * input; and written back, the examples are the file's bytes, and so are the header's magic,
 * version and count (its longest-example field is recomputed, its reserved words zeroed). */
#include <string.h>

#include "evalset.h"
#include "fuzz.h"

#define VOCAB 50257

static char g_path[600], g_back[600];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
  (void)argc, (void)argv;
  const char *dir = fuzz_setup();
  snprintf(g_path, sizeof g_path, "%s/eval.bin", dir);
  snprintf(g_back, sizeof g_back, "%s/back.bin", dir);
  return 0;
}

static void check_rows(const dt_evalset_t *e)
{
  const int T = e->max_tokens - 1;
  int *in = malloc((size_t)T * sizeof *in), *tg = malloc((size_t)T * sizeof *tg);
  FUZZ_ASSERT(in && tg, "out of memory");
  int rows = 0;
  for (int i = 0; i < e->n; i++) {
    const dt_eval_example_t *x = &e->ex[i];
    FUZZ_ASSERT(x->row0 == rows && x->nrows >= 2 && x->label >= 0 && x->label < x->nrows,
                "example %d: rows %d+%d, label %d", i, x->row0, x->nrows, x->label);
    rows += x->nrows;
    const int nctx = e->stream[x->ctx];
    for (int r = x->row0; r < x->row0 + x->nrows; r++) {
      int first, count;
      dt_evalset_row(e, r, T, in, tg, &first, &count);
      FUZZ_ASSERT(first == nctx - 1 && count == e->stream[e->row[r]] && first + count <= T,
                  "row %d: first %d count %d in a window of %d", r, first, count, T);
      for (int k = 0; k < first + count; k++) {
        FUZZ_ASSERT(in[k] >= 0 && in[k] < VOCAB && tg[k] >= 0 && tg[k] < VOCAB,
                    "row %d position %d: token outside the vocabulary", r, k);
        if (k + 1 < first + count)
          FUZZ_ASSERT(tg[k] == in[k + 1], "row %d: target %d is not the next input", r, k);
      }
      for (int k = first; k < first + count; k++)
        FUZZ_ASSERT(tg[k] == e->stream[e->row[r] + 1 + (size_t)(k - first)],
                    "row %d: target %d is not its completion's token", r, k);
    }
  }
  FUZZ_ASSERT(rows == e->rows, "%d rows, counted %d", e->rows, rows);
  free(in);
  free(tg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  fuzz_write(g_path, data, size);
  dt_evalset_t e;
  if (dt_evalset_load(&e, g_path, VOCAB) != 0)
    return 0;
  check_rows(&e);
  FUZZ_ASSERT(dt_evalset_save(&e, g_back) == 0, "writing it back failed");
  FILE *fp = fopen(g_back, "rb");
  FUZZ_ASSERT(fp, "cannot read it back");
  uint8_t *back = malloc(size + 1);
  FUZZ_ASSERT(back, "out of memory");
  const size_t got = fread(back, 1, size + 1, fp);
  fclose(fp);
  FUZZ_ASSERT(got == size && memcmp(back, data, 12) == 0 &&
                  memcmp(back + 1024, data + 1024, size - 1024) == 0,
              "written back as %zu bytes, not the file's %zu", got, size);
  free(back);
  dt_evalset_free(&e);
  return 0;
}
