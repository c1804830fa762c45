/* evalset.c — multiple-choice evaluation sets in llm.c's eval file format (evalset.h).
 *
 * One struct both ways: dt_evalset_add appends an example to the stream the file holds and
 * checks what the format can hold; loading parses each example's fields and hands them to
 * dt_evalset_add, so a file is held to the same rules as what distrain-prep writes, and then
 * has to agree with the stream rebuilt from them (its byte count and index fields). */
#include "evalset.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"

#define DT_EVAL_HEADER 256   /* int32 words */
#define EXAMPLE_START  65535 /* uint16 */

int dt_evalset_add(dt_evalset_t *e, int label, const int *ctx, int nctx, const int *const *comp,
                   const int *ncomp, int ncompletions, char *why, size_t n)
{
  if (e->n >= 65535) {
    snprintf(why, n, "more than 65535 examples (the format's index is 16 bits)");
    return DT_ERANGE;
  }
  if (ncompletions < 2 || ncompletions > DT_EVAL_MAX_COMPLETIONS) {
    snprintf(why, n, "%d completions (expected 2..%d)", ncompletions, DT_EVAL_MAX_COMPLETIONS);
    return DT_EFORMAT;
  }
  if (label < 0 || label >= ncompletions) {
    snprintf(why, n, "label %d is not one of its %d completions", label, ncompletions);
    return DT_EFORMAT;
  }
  if (nctx < 1) {
    snprintf(why, n, "an empty context (nothing to predict the completions' first token from)");
    return DT_EFORMAT;
  }
  size_t values = 6 + (size_t)nctx; /* start, bytes, index, label, completions, context */
  int longest_row = 0;
  for (int j = 0; j < ncompletions; j++) {
    if (ncomp[j] < 1) {
      snprintf(why, n, "completion %d is empty", j);
      return DT_EFORMAT;
    }
    values += 1 + (size_t)ncomp[j];
    longest_row = DT_MAX(longest_row, nctx + ncomp[j]);
  }
  if (values * 2 >= 65536) {
    snprintf(why, n, "%zu bytes: an example must be under 65536 bytes (16-bit size field)",
             values * 2);
    return DT_ERANGE;
  }
  for (int j = -1; j < ncompletions; j++) {
    const int *t = j < 0 ? ctx : comp[j], len = j < 0 ? nctx : ncomp[j];
    for (int k = 0; k < len; k++)
      if (t[k] < 0 || t[k] >= EXAMPLE_START) {
        snprintf(why, n, "token %d in its %s (ids must be 0..65534)", t[k],
                 j < 0 ? "context" : "completions");
        return DT_ERANGE;
      }
  }
  if (dt_grow((void **)&e->ex, &e->ncap, (size_t)e->n + 1, sizeof *e->ex) ||
      dt_grow((void **)&e->row, &e->rcap, (size_t)(e->rows + ncompletions), sizeof *e->row) ||
      dt_grow((void **)&e->stream, &e->cap, e->len + values, sizeof *e->stream)) {
    snprintf(why, n, "out of memory");
    return DT_ENOMEM;
  }
  uint16_t *s = e->stream + e->len;
  size_t at = 0;
  s[at++] = EXAMPLE_START;
  s[at++] = (uint16_t)(values * 2);
  s[at++] = (uint16_t)e->n;
  s[at++] = (uint16_t)label;
  s[at++] = (uint16_t)ncompletions;
  e->ex[e->n] = (dt_eval_example_t){
      .label = label, .row0 = e->rows, .nrows = ncompletions, .ctx = e->len + at};
  s[at++] = (uint16_t)nctx;
  for (int k = 0; k < nctx; k++)
    s[at++] = (uint16_t)ctx[k];
  for (int j = 0; j < ncompletions; j++) {
    e->row[e->rows++] = e->len + at;
    s[at++] = (uint16_t)ncomp[j];
    for (int k = 0; k < ncomp[j]; k++)
      s[at++] = (uint16_t)comp[j][k];
  }
  e->n++;
  e->len += at;
  e->longest = DT_MAX(e->longest, (int)(values * 2));
  e->max_tokens = DT_MAX(e->max_tokens, longest_row);
  return 0;
}

/* The file's example i at stream[*pos] (len values in all), added to e. */
static int load_example(dt_evalset_t *e, const char *path, const uint16_t *f, size_t len,
                        size_t *pos, int vocab, int *buf)
{
  const int i = e->n;
  const size_t p = *pos;
  if (len - p < 6) {
    DT_ERROR(DATA, "%s: truncated: example %d of the header's count is missing", path, i);
    return DT_EFORMAT;
  }
  if (f[p] != EXAMPLE_START || f[p + 2] != (uint16_t)i) {
    DT_ERROR(DATA, "%s: example %d: expected its start (65535) and index %d, found %u and %u", path,
             i, i, f[p], f[p + 2]);
    return DT_EFORMAT;
  }
  const size_t values = f[p + 1] / 2;
  if (f[p + 1] % 2 || values < 6 || values > len - p) {
    DT_ERROR(DATA, "%s: example %d: its size field (%u bytes) %s", path, i, f[p + 1],
             values > len - p ? "runs past the end of the file" : "is not a whole example");
    return DT_EFORMAT;
  }
  const int label = f[p + 3], ncompletions = f[p + 4];
  if (ncompletions > DT_EVAL_MAX_COMPLETIONS) {
    DT_ERROR(DATA, "%s: example %d: %d completions (at most %d)", path, i, ncompletions,
             DT_EVAL_MAX_COMPLETIONS);
    return DT_EFORMAT;
  }
  /* the context and completions: lengths and tokens, all inside the example's values */
  const int *parts[1 + DT_EVAL_MAX_COMPLETIONS];
  int lens[1 + DT_EVAL_MAX_COMPLETIONS];
  size_t at = p + 5, used = 0;
  for (int j = 0; j <= ncompletions; j++) {
    if (at >= p + values || f[at] > p + values - at - 1) {
      DT_ERROR(DATA, "%s: example %d: its %s runs past the example's size field (%u bytes)", path,
               i, j ? "completions" : "context", f[p + 1]);
      return DT_EFORMAT;
    }
    lens[j] = f[at++];
    parts[j] = buf + used;
    for (int k = 0; k < lens[j]; k++) {
      if (f[at + (size_t)k] >= vocab) {
        DT_ERROR(DATA, "%s: example %d: token %u is not below the vocabulary size %d", path, i,
                 f[at + (size_t)k], vocab);
        return DT_ERANGE;
      }
      buf[used++] = f[at + (size_t)k];
    }
    at += (size_t)lens[j];
  }
  if (at != p + values) {
    DT_ERROR(DATA, "%s: example %d: its size field says %u bytes, its fields take %zu", path, i,
             f[p + 1], (at - p) * 2);
    return DT_EFORMAT;
  }
  char why[160];
  int rc = dt_evalset_add(e, label, parts[0], lens[0], parts + 1, lens + 1, ncompletions, why,
                          sizeof why);
  if (rc != 0) {
    DT_ERROR(DATA, "%s: example %d: %s", path, i, why);
    return rc;
  }
  *pos = at;
  return 0;
}

int dt_evalset_load(dt_evalset_t *e, const char *path, int vocab)
{
  memset(e, 0, sizeof *e);
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    DT_ERROR(DATA, "%s: %s", path, strerror(errno));
    return errno == ENOENT ? DT_ENOENT : DT_EIO;
  }
  int32_t hdr[DT_EVAL_HEADER];
  uint16_t *f = NULL;
  int *buf = NULL;
  long bytes = -1;
  int rc = 0;
  if (fread(hdr, sizeof hdr, 1, fp) != 1 || hdr[0] != DT_EVAL_MAGIC || hdr[1] != DT_EVAL_VERSION) {
    DT_ERROR(DATA,
             "%s: not an eval file (expected the header %d, %d: llm.c's eval format, as "
             "distrain-prep --hellaswag writes)",
             path, DT_EVAL_MAGIC, DT_EVAL_VERSION);
    rc = DT_EFORMAT;
  } else if (hdr[2] < 1 || hdr[2] > 65535) {
    DT_ERROR(DATA, "%s: the header's example count %d is not in 1..65535", path, hdr[2]);
    rc = DT_EFORMAT;
  } else if (fseek(fp, 0, SEEK_END) != 0 || (bytes = ftell(fp)) < 0 ||
             fseek(fp, (long)sizeof hdr, SEEK_SET) != 0) {
    DT_ERROR(DATA, "%s: %s", path, strerror(errno));
    rc = DT_EIO;
  } else if ((bytes - (long)sizeof hdr) % 2) {
    DT_ERROR(DATA, "%s: %ld bytes after the header, not a whole number of uint16", path,
             bytes - (long)sizeof hdr);
    rc = DT_EFORMAT;
  }
  const size_t len = rc == 0 ? (size_t)(bytes - (long)sizeof hdr) / 2 : 0;
  if (rc == 0 && (!(f = malloc(len ? len * 2 : 1)) || !(buf = malloc(32768 * sizeof *buf))))
    rc = DT_ENOMEM;
  if (rc == 0 && fread(f, 2, len, fp) != len) {
    DT_ERROR(DATA, "%s: read failed", path);
    rc = DT_EIO;
  }
  size_t pos = 0;
  while (rc == 0 && e->n < hdr[2])
    rc = load_example(e, path, f, len, &pos, vocab, buf);
  if (rc == 0 && pos != len) {
    DT_ERROR(DATA, "%s: %zu bytes after the header's %d examples", path, (len - pos) * 2, hdr[2]);
    rc = DT_EFORMAT;
  }
  fclose(fp);
  free(f);
  free(buf);
  if (rc != 0)
    dt_evalset_free(e);
  return rc;
}

int dt_evalset_save(const dt_evalset_t *e, const char *path)
{
  int32_t hdr[DT_EVAL_HEADER] = {DT_EVAL_MAGIC, DT_EVAL_VERSION, e->n, e->longest};
  dt_afile_t af;
  int ret = 0;
  DT_CHECK(dt_afile_open(&af, path));
  DT_CHECK_GOTO(dt_afile_write(&af, hdr, sizeof hdr), ret, fail);
  DT_CHECK_GOTO(dt_afile_write(&af, e->stream, e->len * sizeof *e->stream), ret, fail);
  return dt_afile_commit(&af);
fail:
  dt_afile_abort(&af);
  return ret;
}

void dt_evalset_free(dt_evalset_t *e)
{
  free(e->ex);
  free(e->row);
  free(e->stream);
  memset(e, 0, sizeof *e);
}

/* The example row r belongs to: the last one whose first row is <= r. */
static int example_of(const dt_evalset_t *e, int r)
{
  int ex = 0;
  for (int lo = 0, hi = e->n - 1; lo <= hi;) {
    const int mid = (lo + hi) / 2;
    if (e->ex[mid].row0 <= r) {
      ex = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return ex;
}

int dt_evalset_row_positions(const dt_evalset_t *e, int r)
{
  return e->stream[e->ex[example_of(e, r)].ctx] + e->stream[e->row[r]] - 1;
}

void dt_evalset_row(const dt_evalset_t *e, int r, int T, int *inputs, int *targets, int *first,
                    int *count)
{
  const uint16_t *c = e->stream + e->ex[example_of(e, r)].ctx, *w = e->stream + e->row[r];
  const int nctx = c[0], nw = w[0], n = nctx + nw; /* the row: n tokens, n - 1 positions */
  memset(inputs, 0, (size_t)T * sizeof *inputs);
  memset(targets, 0, (size_t)T * sizeof *targets);
  for (int k = 0; k < n; k++) {
    const int tok = k < nctx ? c[1 + k] : w[1 + k - nctx];
    if (k < n - 1)
      inputs[k] = tok;
    if (k > 0)
      targets[k - 1] = tok;
  }
  *first = nctx - 1;
  *count = nw;
}
