/* test_dataloader.c — Check suite for worker/trainer/dataloader: exact sequential windows,
 * rank slicing, shard and epoch order, seeded shuffling, seek (what resume relies on) and the
 * validation of bad shards.
 *
 * Shard k holds tokens k*SHARD_BASE + i, so every token names its shard and position and a
 * batch can be checked against the exact slice it must come from. */
#include <stdlib.h>
#include <string.h>

#include <check.h>
#include <math.h>

#include "blend.h"
#include "dataloader.h"
#include "dt_error.h"
#include "ut_fs.h"

#define VOCAB      65536
#define SHARD_BASE 10000

/* Writes shard k of ntok tokens (token i = k*SHARD_BASE + i) to dir/name. */
static void write_shard(const char *dir, const char *name, int k, int64_t ntok)
{
  char path[512];
  uint16_t *tok = malloc((size_t)(ntok ? ntok : 1) * sizeof *tok);
  ck_assert_ptr_nonnull(tok);
  for (int64_t i = 0; i < ntok; i++)
    tok[i] = (uint16_t)(k * SHARD_BASE + i);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  ck_assert_int_eq(dt_shard_write(path, tok, ntok), 0);
  free(tok);
}

/* Writes a raw shard: a header as given, then n tokens of value tokval. */
static void write_raw(const char *path, int32_t magic, int32_t version, int32_t hdr_ntok, int64_t n,
                      uint16_t tokval)
{
  FILE *fp = fopen(path, "wb");
  ck_assert_ptr_nonnull(fp);
  int32_t hdr[DT_SHARD_HEADER] = {magic, version, hdr_ntok};
  ck_assert_int_eq(fwrite(hdr, sizeof hdr, 1, fp), 1);
  for (int64_t i = 0; i < n; i++)
    ck_assert_int_eq(fwrite(&tokval, 2, 1, fp), 1);
  ck_assert_int_eq(fclose(fp), 0);
}

/* The batch must be inputs = base + [start, start+BT) and targets shifted by one. */
static void expect_batch(const dt_dataloader_t *dl, int k, int64_t start)
{
  const int n = dl->B * dl->T;
  for (int i = 0; i < n; i++) {
    ck_assert_msg(dl->inputs[i] == (int)(k * SHARD_BASE + start + i),
                  "input %d = %d, expected shard %d token %lld", i, dl->inputs[i], k,
                  (long long)(start + i));
    ck_assert_int_eq(dl->targets[i], k * SHARD_BASE + start + i + 1);
  }
}

/* Which (shard, global window) the current rank-0 batch came from. */
static int64_t batch_id(const dt_dataloader_t *dl)
{
  const int64_t wt = (int64_t)dl->world * dl->B * dl->T;
  const int k = dl->inputs[0] / SHARD_BASE;
  const int64_t off = dl->inputs[0] % SHARD_BASE;
  ck_assert_int_eq(off % wt, (int64_t)dl->rank * dl->B * dl->T);
  return (int64_t)k * 1000 + off / wt;
}

/* ------------------------------------------------------------------------------------------ */
/* Sequential order                                                                            */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_sequential_windows)
{
  char dir[256], pat[512];
  ut_mkdtemp(dir, sizeof dir);
  const int B = 2, T = 4;                  /* BT = 8 */
  write_shard(dir, "s.bin", 0, 8 * 5 + 1); /* exactly 5 windows */
  snprintf(pat, sizeof pat, "%s/s.bin", dir);
  dt_dataloader_t dl;
  ck_assert_int_eq(dt_dataloader_init(&dl, pat, B, T, 0, 1, 1, VOCAB, 0, 0), 0);
  ck_assert_int_eq(dl.nshards, 1);
  ck_assert_int_eq(dt_dataloader_epoch_windows(&dl), 5);
  for (int epoch = 0; epoch < 3; epoch++) {
    for (int w = 0; w < 5; w++) {
      ck_assert_int_eq(dt_dataloader_next(&dl), 0);
      expect_batch(&dl, 0, (int64_t)w * B * T);
    }
  }
  ck_assert_int_eq(dl.pos.epoch, 2);
  ck_assert_int_eq(dl.pos.window, 5);
  /* reset goes back to the very first window */
  ck_assert_int_eq(dt_dataloader_reset(&dl), 0);
  ck_assert_int_eq(dt_dataloader_next(&dl), 0);
  expect_batch(&dl, 0, 0);
  dt_dataloader_free(&dl);
  ut_rm_rf(dir);
}
END_TEST

/* The "+1" for the last target: a shard of exactly k*BT tokens has only k-1 windows. */
START_TEST(test_window_needs_one_extra_token)
{
  char dir[256], pat[512];
  ut_mkdtemp(dir, sizeof dir);
  write_shard(dir, "s.bin", 0, 8 * 3);
  snprintf(pat, sizeof pat, "%s/s.bin", dir);
  dt_dataloader_t dl;
  ck_assert_int_eq(dt_dataloader_init(&dl, pat, 2, 4, 0, 1, 1, VOCAB, 0, 0), 0);
  ck_assert_int_eq(dt_dataloader_epoch_windows(&dl), 2);
  dt_dataloader_free(&dl);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_rank_slicing)
{
  char dir[256], pat[512];
  ut_mkdtemp(dir, sizeof dir);
  const int B = 2, T = 3, world = 3, BT = B * T;                 /* global window 18 tokens */
  write_shard(dir, "s.bin", 0, (int64_t)world * BT * 4 + 1 + 5); /* 4 windows + a tail */
  snprintf(pat, sizeof pat, "%s/s.bin", dir);
  dt_dataloader_t dl[3];
  for (int r = 0; r < world; r++) {
    ck_assert_int_eq(dt_dataloader_init(&dl[r], pat, B, T, r, world, 1, VOCAB, 0, 0), 0);
    ck_assert_int_eq(dt_dataloader_epoch_windows(&dl[r]), 4);
  }
  for (int step = 0; step < 9; step++) {
    const int w = step % 4; /* wraps to the next epoch after 4 */
    for (int r = 0; r < world; r++) {
      ck_assert_int_eq(dt_dataloader_next(&dl[r]), 0);
      expect_batch(&dl[r], 0, (int64_t)w * world * BT + (int64_t)r * BT);
    }
    /* the ranks' slices tile the global window: rank r's last target is rank r+1's first input */
    for (int r = 0; r + 1 < world; r++)
      ck_assert_int_eq(dl[r].targets[BT - 1], dl[r + 1].inputs[0]);
  }
  for (int r = 0; r < world; r++)
    dt_dataloader_free(&dl[r]);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_multi_shard_sorted_and_epochs)
{
  char dir[256], pat[512];
  ut_mkdtemp(dir, sizeof dir);
  const int B = 1, T = 8;
  /* Written out of order, with different lengths; glob order is by name. */
  write_shard(dir, "train_002.bin", 2, 8 * 1 + 1);
  write_shard(dir, "train_000.bin", 0, 8 * 3 + 1);
  write_shard(dir, "train_001.bin", 1, 8 * 2 + 4);
  write_shard(dir, "other_000.bin", 7, 100); /* not matched */
  snprintf(pat, sizeof pat, "%s/train_*.bin", dir);
  dt_dataloader_t dl;
  ck_assert_int_eq(dt_dataloader_init(&dl, pat, B, T, 0, 1, 1, VOCAB, 0, 0), 0);
  ck_assert_int_eq(dl.nshards, 3);
  ck_assert_int_eq(dt_dataloader_epoch_windows(&dl), 6);
  const int expect_shard[6] = {0, 0, 0, 1, 1, 2};
  const int expect_window[6] = {0, 1, 2, 0, 1, 0};
  for (int epoch = 0; epoch < 3; epoch++) {
    for (int i = 0; i < 6; i++) {
      ck_assert_int_eq(dt_dataloader_next(&dl), 0);
      expect_batch(&dl, expect_shard[i], (int64_t)expect_window[i] * T);
      ck_assert_int_eq(dl.pos.epoch, epoch);
      ck_assert_int_eq(dl.pos.shard, expect_shard[i]);
      ck_assert_int_eq(dl.pos.window, expect_window[i] + 1);
    }
  }
  dt_dataloader_free(&dl);
  ut_rm_rf(dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Shuffling                                                                                   */
/* ------------------------------------------------------------------------------------------ */

#define SH_SHARDS  3
#define SH_WINDOWS 20

static void make_shuffle_data(char *dir, size_t n, char *pat, size_t patn)
{
  ut_mkdtemp(dir, n);
  for (int k = 0; k < SH_SHARDS; k++) {
    char name[64];
    snprintf(name, sizeof name, "shard_%d.bin", k);
    write_shard(dir, name, k, 4 * SH_WINDOWS + 1 + k); /* B*T = 4 */
  }
  snprintf(pat, patn, "%s/shard_*.bin", dir);
}

/* Draws n batches and records their ids. */
static void draw(dt_dataloader_t *dl, int64_t *ids, int n)
{
  for (int i = 0; i < n; i++) {
    ck_assert_int_eq(dt_dataloader_next(dl), 0);
    /* Whatever the order, a batch is still a contiguous, shifted slice. */
    expect_batch(dl, dl->inputs[0] / SHARD_BASE, dl->inputs[0] % SHARD_BASE);
    ids[i] = batch_id(dl);
  }
}

START_TEST(test_shuffle_is_permutation_per_epoch)
{
  char dir[256], pat[512];
  make_shuffle_data(dir, sizeof dir, pat, sizeof pat);
  dt_dataloader_t dl;
  ck_assert_int_eq(dt_dataloader_init(&dl, pat, 2, 2, 0, 1, 1, VOCAB, 1, 42), 0);
  const int E = SH_SHARDS * SH_WINDOWS;
  ck_assert_int_eq(dt_dataloader_epoch_windows(&dl), E);
  ck_assert_int_eq(dt_dataloader_windows_within(&dl, 1000), E);
  ck_assert_int_eq(dt_dataloader_windows_within(&dl, 3), 3);
  int64_t ids[2][SH_SHARDS * SH_WINDOWS];
  for (int epoch = 0; epoch < 2; epoch++) {
    draw(&dl, ids[epoch], E);
    uint8_t seen[SH_SHARDS][SH_WINDOWS];
    memset(seen, 0, sizeof seen);
    int in_order = 0;
    for (int i = 0; i < E; i++) {
      int64_t k = ids[epoch][i] / 1000, w = ids[epoch][i] % 1000;
      ck_assert(k >= 0 && k < SH_SHARDS && w >= 0 && w < SH_WINDOWS);
      ck_assert_msg(!seen[k][w], "epoch %d: window (%lld, %lld) drawn twice", epoch, (long long)k,
                    (long long)w);
      seen[k][w] = 1;
      in_order += i > 0 && ids[epoch][i] == ids[epoch][i - 1] + 1;
      /* shards are visited one at a time: windows of a shard are contiguous in the order */
      if (i % SH_WINDOWS != 0)
        ck_assert_int_eq(k, ids[epoch][i - 1] / 1000);
    }
    ck_assert_int_lt(in_order, E / 4); /* really shuffled, not sequential */
  }
  /* Re-drawn every epoch: the shard order, and the window order inside every shard. */
  ck_assert_int_ne(memcmp(ids[0], ids[1], sizeof ids[0]), 0);
  int64_t order[2][SH_SHARDS][SH_WINDOWS];
  for (int epoch = 0; epoch < 2; epoch++)
    for (int i = 0; i < E; i++)
      order[epoch][ids[epoch][i] / 1000][i % SH_WINDOWS] = ids[epoch][i] % 1000;
  for (int k = 0; k < SH_SHARDS; k++)
    ck_assert_msg(memcmp(order[0][k], order[1][k], sizeof order[0][k]) != 0,
                  "shard %d: same window order in epochs 0 and 1", k);
  dt_dataloader_free(&dl);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_shuffle_deterministic_per_seed)
{
  char dir[256], pat[512];
  make_shuffle_data(dir, sizeof dir, pat, sizeof pat);
  const int N = 2 * SH_SHARDS * SH_WINDOWS + 7;
  int64_t a[2 * SH_SHARDS * SH_WINDOWS + 7], b[2 * SH_SHARDS * SH_WINDOWS + 7],
      c[2 * SH_SHARDS * SH_WINDOWS + 7];
  dt_dataloader_t dl;
  ck_assert_int_eq(dt_dataloader_init(&dl, pat, 2, 2, 0, 1, 1, VOCAB, 1, 42), 0);
  draw(&dl, a, N);
  dt_dataloader_free(&dl);
  ck_assert_int_eq(dt_dataloader_init(&dl, pat, 2, 2, 0, 1, 1, VOCAB, 1, 42), 0);
  draw(&dl, b, N);
  dt_dataloader_free(&dl);
  ck_assert_int_eq(dt_dataloader_init(&dl, pat, 2, 2, 0, 1, 1, VOCAB, 1, 43), 0);
  draw(&dl, c, N);
  dt_dataloader_free(&dl);
  ck_assert_int_eq(memcmp(a, b, sizeof a), 0);
  ck_assert_int_ne(memcmp(a, c, sizeof a), 0);
  ut_rm_rf(dir);
}
END_TEST

/* The shard order is drawn from the seed and the epoch: over a handful of seeds (and of
 * epochs) three shards must not always come in the same order. */
START_TEST(test_shuffle_shard_order_varies)
{
  char dir[256], pat[512];
  make_shuffle_data(dir, sizeof dir, pat, sizeof pat);
  const int E = SH_SHARDS * SH_WINDOWS;
  int64_t ids[SH_SHARDS * SH_WINDOWS];
  int by_seed[6] = {0}, by_epoch[6] = {0}, distinct_seed = 0, distinct_epoch = 0;
  dt_dataloader_t dl;
  for (uint64_t seed = 1; seed <= 12; seed++) {
    ck_assert_int_eq(dt_dataloader_init(&dl, pat, 2, 2, 0, 1, 1, VOCAB, 1, seed), 0);
    for (int epoch = 0; epoch < (seed == 1 ? 12 : 1); epoch++) {
      draw(&dl, ids, E);
      /* encode the order of the three shards as a number in [0, 6) */
      const int a = (int)(ids[0] / 1000), b = (int)(ids[SH_WINDOWS] / 1000);
      const int code = a * 2 + (b > a ? b - 1 : b);
      if (epoch == 0)
        distinct_seed += by_seed[code]++ == 0;
      if (seed == 1)
        distinct_epoch += by_epoch[code]++ == 0;
    }
    dt_dataloader_free(&dl);
  }
  ck_assert_int_ge(distinct_seed, 2);
  ck_assert_int_ge(distinct_epoch, 2);
  ut_rm_rf(dir);
}
END_TEST

/* With shuffling and world > 1 every rank must see the same window order. */
START_TEST(test_shuffle_ranks_agree)
{
  char dir[256], pat[512];
  make_shuffle_data(dir, sizeof dir, pat, sizeof pat);
  dt_dataloader_t r0, r1;
  ck_assert_int_eq(dt_dataloader_init(&r0, pat, 1, 2, 0, 2, 1, VOCAB, 1, 9), 0);
  ck_assert_int_eq(dt_dataloader_init(&r1, pat, 1, 2, 1, 2, 1, VOCAB, 1, 9), 0);
  for (int i = 0; i < 2 * SH_SHARDS * SH_WINDOWS; i++) {
    ck_assert_int_eq(dt_dataloader_next(&r0), 0);
    ck_assert_int_eq(dt_dataloader_next(&r1), 0);
    ck_assert_int_eq(r0.targets[1], r1.inputs[0]);
    ck_assert_int_eq(batch_id(&r0), batch_id(&r1));
  }
  dt_dataloader_free(&r0);
  dt_dataloader_free(&r1);
  ut_rm_rf(dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Seek (resume)                                                                               */
/* ------------------------------------------------------------------------------------------ */

static void check_seek_reproduces(int shuffle)
{
  char dir[256], pat[512];
  make_shuffle_data(dir, sizeof dir, pat, sizeof pat);
  const int E = SH_SHARDS * SH_WINDOWS;
  /* Save points: start, mid-shard, end of a shard, an epoch boundary, into the second epoch. */
  const int saves[] = {0, 7, SH_WINDOWS, E, E + SH_WINDOWS + 3};
  for (size_t k = 0; k < sizeof saves / sizeof saves[0]; k++) {
    dt_dataloader_t a, b;
    ck_assert_int_eq(dt_dataloader_init(&a, pat, 2, 2, 0, 1, 1, VOCAB, shuffle, 77), 0);
    int64_t skip[2 * SH_SHARDS * SH_WINDOWS];
    draw(&a, skip, saves[k]);
    dt_data_pos_t pos = a.pos;
    int64_t ref[SH_SHARDS * SH_WINDOWS + 5], got[SH_SHARDS * SH_WINDOWS + 5];
    draw(&a, ref, E + 5);

    /* A fresh loader (a resumed process) seeks to the saved position. */
    ck_assert_int_eq(dt_dataloader_init(&b, pat, 2, 2, 0, 1, 1, VOCAB, shuffle, 77), 0);
    ck_assert_int_eq(dt_dataloader_seek(&b, pos), 0);
    draw(&b, got, E + 5);
    ck_assert_msg(memcmp(ref, got, sizeof ref) == 0, "seek after %d batches diverged", saves[k]);

    /* And the same loader seeking backwards replays too. */
    ck_assert_int_eq(dt_dataloader_seek(&a, pos), 0);
    draw(&a, got, E + 5);
    ck_assert_int_eq(memcmp(ref, got, sizeof ref), 0);
    dt_dataloader_free(&a);
    dt_dataloader_free(&b);
  }
  ut_rm_rf(dir);
}

START_TEST(test_seek_reproduces_sequential)
{
  check_seek_reproduces(0);
}
END_TEST

START_TEST(test_seek_reproduces_shuffled)
{
  check_seek_reproduces(1);
}
END_TEST

START_TEST(test_seek_invalid)
{
  char dir[256], pat[512];
  make_shuffle_data(dir, sizeof dir, pat, sizeof pat);
  dt_dataloader_t dl;
  ck_assert_int_eq(dt_dataloader_init(&dl, pat, 2, 2, 0, 1, 1, VOCAB, 0, 0), 0);
  const dt_data_pos_t bad[] = {
      {.epoch = -1, .unit = 2},
      {.shard = -1, .unit = 2},
      {.shard = SH_SHARDS, .unit = 2},
      {.window = -1, .unit = 2},
      {.window = SH_WINDOWS + 1, .unit = 2},
      /* saved with another window size (found by tests/fuzz): a negative one turned the window
       * negative, and a huge window overflowed its sequence count */
      {.window = 3, .unit = -4},
      {.window = INT64_MAX / 3, .unit = 4}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    ck_assert_int_eq(dt_dataloader_seek(&dl, bad[i]), DT_ERANGE);
  /* The end of a shard is a valid position: the next batch is the next shard's first. */
  dt_data_pos_t end = {.window = SH_WINDOWS, .unit = 2};
  ck_assert_int_eq(dt_dataloader_seek(&dl, end), 0);
  ck_assert_int_eq(dt_dataloader_next(&dl), 0);
  expect_batch(&dl, 1, 0);
  dt_dataloader_free(&dl);
  ut_rm_rf(dir);
}
END_TEST

/* The first token of every micro-batch one optimizer step reads, over all ranks, sorted: the
 * step's data as a set (the sequences are contiguous slices, checked by expect_batch). */
static int cmp_int(const void *a, const void *b)
{
  return (*(const int *)a > *(const int *)b) - (*(const int *)a < *(const int *)b);
}

static void step_data(dt_dataloader_t *dl, int world, int accum, int *firsts)
{
  int n = 0;
  for (int k = 0; k < accum; k++)
    for (int r = 0; r < world; r++) {
      ck_assert_int_eq(dt_dataloader_next(&dl[r]), 0);
      expect_batch(&dl[r], dl[r].inputs[0] / SHARD_BASE, dl[r].inputs[0] % SHARD_BASE);
      for (int b = 0; b < dl[r].B; b++)
        firsts[n++] = dl[r].inputs[b * dl[r].T];
    }
  qsort(firsts, (size_t)n, sizeof *firsts, cmp_int);
}

/* dp 4 x accum 1, dp 2 x accum 2 and one process x accum 4 read the same sequences in every
 * step, through shard ends and epochs, sequential and shuffled: a job resized by the
 * coordinator (which keeps the global batch) goes on with the same data. */
START_TEST(test_split_of_the_global_batch_does_not_matter)
{
  char dir[256], pat[512];
  make_shuffle_data(dir, sizeof dir, pat, sizeof pat);
  for (int shuffle = 0; shuffle < 2; shuffle++) {
    enum { STEPS = 3 * SH_SHARDS * SH_WINDOWS / 4 + 7 }; /* past two epochs */
    const int layouts[3][2] = {{4, 1}, {2, 2}, {1, 4}};  /* (world, accum), B = 1 */
    int ref[STEPS][4];
    for (int l = 0; l < 3; l++) {
      const int world = layouts[l][0], accum = layouts[l][1];
      dt_dataloader_t dl[4];
      for (int r = 0; r < world; r++)
        ck_assert_int_eq(dt_dataloader_init(&dl[r], pat, 1, 4, r, world, accum, VOCAB, shuffle, 7),
                         0);
      for (int s = 0; s < STEPS; s++) {
        int firsts[4];
        step_data(dl, world, accum, firsts);
        if (l == 0)
          memcpy(ref[s], firsts, sizeof firsts);
        else
          for (int i = 0; i < 4; i++)
            ck_assert_msg(firsts[i] == ref[s][i],
                          "shuffle %d, dp %d x accum %d, step %d: sequence %d starts at %d, "
                          "dp 4 at %d",
                          shuffle, world, accum, s, i, firsts[i], ref[s][i]);
      }
      for (int r = 0; r < world; r++)
        dt_dataloader_free(&dl[r]);
    }
  }
  ut_rm_rf(dir);
}
END_TEST

/* A position saved by dp 4 x accum 1 resumes under dp 2 x accum 2 where dp 4 would have gone
 * on; positions of another window size are converted through their sequence count, and those
 * of older checkpoints (unit 0: windows of world x B sequences, one per micro-step) too. */
START_TEST(test_seek_across_layouts)
{
  char dir[256], pat[512];
  make_shuffle_data(dir, sizeof dir, pat, sizeof pat);
  dt_dataloader_t a[4], b[2];
  for (int r = 0; r < 4; r++)
    ck_assert_int_eq(dt_dataloader_init(&a[r], pat, 1, 4, r, 4, 1, VOCAB, 1, 3), 0);
  for (int r = 0; r < 2; r++)
    ck_assert_int_eq(dt_dataloader_init(&b[r], pat, 1, 4, r, 2, 2, VOCAB, 1, 3), 0);
  int fa[4], fb[4];
  for (int s = 0; s < 23; s++)
    step_data(a, 4, 1, fa);
  const dt_data_pos_t saved = a[0].pos;
  ck_assert_int_eq(saved.unit, 4);
  for (int r = 0; r < 2; r++)
    ck_assert_int_eq(dt_dataloader_seek(&b[r], saved), 0);
  for (int s = 0; s < 9; s++) {
    step_data(a, 4, 1, fa);
    step_data(b, 2, 2, fb);
    ck_assert_mem_eq(fa, fb, sizeof fa);
  }
  /* Conversions: 6 windows of 2 sequences are 3 of 4; an older position counted micro-step
   * windows of world x B = 2 sequences; 5 of 2 is not a step boundary of 4: down to 2. */
  const int64_t cases[][3] = {{2, 6, 3}, {0, 6, 3}, {2, 5, 2}, {8, 2, 4}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    dt_data_pos_t p = {.shard = 1, .window = cases[i][1], .unit = cases[i][0]};
    ck_assert_int_eq(dt_dataloader_seek(&b[0], p), 0);
    ck_assert_int_eq(b[0].pos.window, cases[i][2]);
    ck_assert_int_eq(b[0].pos.unit, 4);
  }
  for (int r = 0; r < 4; r++)
    dt_dataloader_free(&a[r]);
  for (int r = 0; r < 2; r++)
    dt_dataloader_free(&b[r]);
  ut_rm_rf(dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Bad input                                                                                   */
/* ------------------------------------------------------------------------------------------ */

static int init_one(const char *path, int vocab)
{
  dt_dataloader_t dl;
  int rc = dt_dataloader_init(&dl, path, 2, 4, 0, 1, 1, vocab, 0, 0);
  if (rc == 0)
    dt_dataloader_free(&dl);
  else
    ck_assert_ptr_null(dl.paths); /* a failed init cleans up after itself */
  return rc;
}

START_TEST(test_bad_magic)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/s.bin", dir);
  write_raw(path, DT_SHARD_MAGIC + 1, DT_SHARD_VERSION, 100, 100, 1);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  write_raw(path, 20240326 /* an llm.c model checkpoint */, 3, 100, 100, 1);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_bad_version)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/s.bin", dir);
  write_raw(path, DT_SHARD_MAGIC, 2, 100, 100, 1);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  write_raw(path, DT_SHARD_MAGIC, 0, 100, 100, 1);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  /* and the good version of the same file loads */
  write_raw(path, DT_SHARD_MAGIC, DT_SHARD_VERSION, 100, 100, 1);
  ck_assert_int_eq(init_one(path, VOCAB), 0);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_truncated)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/s.bin", dir);
  /* shorter than the header */
  ut_write_all(path, "\x28\x0e\x35\x01", 4);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  ut_write_all(path, "", 0);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  /* a good shard cut short by one byte */
  write_shard(dir, "s.bin", 0, 100);
  ck_assert_int_eq(init_one(path, VOCAB), 0);
  ck_assert_int_eq(truncate(path, ut_file_size(path) - 1), 0);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  /* trailing bytes the header does not account for */
  write_raw(path, DT_SHARD_MAGIC, DT_SHARD_VERSION, 100, 101, 1);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_header_claims_more_tokens)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/s.bin", dir);
  write_raw(path, DT_SHARD_MAGIC, DT_SHARD_VERSION, 1000, 500, 1);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  write_raw(path, DT_SHARD_MAGIC, DT_SHARD_VERSION, -5, 0, 1);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_token_out_of_vocab)
{
  char dir[256], path[512], pat[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/a.bin", dir);
  write_raw(path, DT_SHARD_MAGIC, DT_SHARD_VERSION, 100, 100, 49);
  ck_assert_int_eq(init_one(path, 50), 0);
  ck_assert_int_eq(init_one(path, 49), DT_ERANGE); /* token == vocab is out of range */
  ck_assert_int_eq(init_one(path, 10), DT_ERANGE);

  /* In a later shard it is caught when that shard is first loaded. */
  snprintf(path, sizeof path, "%s/b.bin", dir);
  write_raw(path, DT_SHARD_MAGIC, DT_SHARD_VERSION, 100, 100, 1);
  snprintf(path, sizeof path, "%s/c.bin", dir);
  write_raw(path, DT_SHARD_MAGIC, DT_SHARD_VERSION, 100, 100, 60);
  snprintf(path, sizeof path, "%s/a.bin", dir);
  write_raw(path, DT_SHARD_MAGIC, DT_SHARD_VERSION, 100, 100, 1);
  snprintf(pat, sizeof pat, "%s/*.bin", dir);
  dt_dataloader_t dl;
  ck_assert_int_eq(dt_dataloader_init(&dl, pat, 2, 4, 0, 1, 1, 50, 0, 0), 0);
  int rc = 0, steps = 0;
  while (rc == 0 && steps < 100) {
    rc = dt_dataloader_next(&dl);
    steps++;
  }
  ck_assert_int_eq(rc, DT_ERANGE);
  ck_assert_int_eq(steps, 2 * 12 + 1); /* a.bin and b.bin have 12 windows each */
  dt_dataloader_free(&dl);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_too_few_tokens)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/s.bin", dir);
  write_shard(dir, "s.bin", 0, 8); /* B*T = 8 needs 9 */
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  write_shard(dir, "s.bin", 0, 0);
  ck_assert_int_eq(init_one(path, VOCAB), DT_EFORMAT);
  write_shard(dir, "s.bin", 0, 9);
  ck_assert_int_eq(init_one(path, VOCAB), 0);
  /* world multiplies the window: 9 tokens are too few for two ranks */
  dt_dataloader_t dl;
  ck_assert_int_eq(dt_dataloader_init(&dl, path, 2, 4, 1, 2, 1, VOCAB, 0, 0), DT_EFORMAT);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_no_match)
{
  char dir[256], pat[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(pat, sizeof pat, "%s/train_*.bin", dir);
  ck_assert_int_eq(init_one(pat, VOCAB), DT_ENOENT);
  snprintf(pat, sizeof pat, "%s/missing.bin", dir);
  ck_assert_int_eq(init_one(pat, VOCAB), DT_ENOENT);
  snprintf(pat, sizeof pat, "%s/no/such/dir/*.bin", dir);
  ck_assert_int_eq(init_one(pat, VOCAB), DT_ENOENT);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_invalid_args)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  write_shard(dir, "s.bin", 0, 100);
  snprintf(path, sizeof path, "%s/s.bin", dir);
  dt_dataloader_t dl;
  ck_assert_int_eq(dt_dataloader_init(&dl, path, 0, 4, 0, 1, 1, VOCAB, 0, 0), DT_EINVAL);
  ck_assert_int_eq(dt_dataloader_init(&dl, path, 2, 0, 0, 1, 1, VOCAB, 0, 0), DT_EINVAL);
  ck_assert_int_eq(dt_dataloader_init(&dl, path, 2, 4, 2, 2, 1, VOCAB, 0, 0), DT_EINVAL);
  ck_assert_int_eq(dt_dataloader_init(&dl, path, 2, 4, -1, 2, 1, VOCAB, 0, 0), DT_EINVAL);
  ck_assert_int_eq(dt_dataloader_init(&dl, path, 2, 4, 0, 0, 1, VOCAB, 0, 0), DT_EINVAL);
  ck_assert_int_eq(dt_dataloader_init(&dl, path, 2, 4, 0, 1, 1, 0, 0, 0), DT_EINVAL);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_shard_write_format)
{
  char dir[256], path[512];
  size_t n;
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/s.bin", dir);
  const uint16_t tok[5] = {1, 2, 65535, 0, 7};
  ck_assert_int_eq(dt_shard_write(path, tok, 5), 0);
  uint8_t *buf = ut_read_all(path, &n);
  ck_assert_int_eq(n, DT_SHARD_HEADER * 4 + 10);
  int32_t hdr[DT_SHARD_HEADER];
  memcpy(hdr, buf, sizeof hdr);
  ck_assert_int_eq(hdr[0], DT_SHARD_MAGIC);
  ck_assert_int_eq(hdr[1], DT_SHARD_VERSION);
  ck_assert_int_eq(hdr[2], 5);
  for (int i = 3; i < DT_SHARD_HEADER; i++)
    ck_assert_int_eq(hdr[i], 0);
  ck_assert_int_eq(memcmp(buf + sizeof hdr, tok, sizeof tok), 0);
  free(buf);
  ck_assert_int_eq(ut_count_entries(dir, NULL), 1); /* no temporary left behind */
  ck_assert_int_eq(dt_shard_write(path, tok, -1), DT_ERANGE);
  snprintf(path, sizeof path, "%s/missing/s.bin", dir);
  ck_assert_int_eq(dt_shard_write(path, tok, 5), DT_ENOENT);
  ut_rm_rf(dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Blends                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* Source A: shards 1 (6 sequences of BL_T) and 2 (5); source B: shard 5 (3 sequences). A
 * sequence's first token names its shard and offset. */
#define BL_T 4
enum { BL_A = 11, BL_B = 3 };

static void make_blend_data(char *dir, size_t n, char *spec, size_t specn, const char *weights)
{
  char sub[300];
  ut_mkdtemp(dir, n);
  snprintf(sub, sizeof sub, "%s/a", dir);
  ck_assert_int_eq(mkdir(sub, 0755), 0);
  write_shard(sub, "a_1.bin", 1, 6 * BL_T + 1);
  write_shard(sub, "a_2.bin", 2, 5 * BL_T + 1 + 2); /* a tail too short for a sequence */
  snprintf(sub, sizeof sub, "%s/b", dir);
  ck_assert_int_eq(mkdir(sub, 0755), 0);
  write_shard(sub, "b_5.bin", 5, 3 * BL_T + 1);
  double wa, wb;
  ck_assert_int_eq(sscanf(weights, "%lf/%lf", &wa, &wb), 2);
  snprintf(spec, specn, "%g:%s/a/a_*.bin,%g:%s/b/b_*.bin", wa, dir, wb, dir);
}

/* The j-th sequence of source A or B in the unshuffled order: its first token. */
static int unshuffled_first(int source, int64_t j)
{
  if (source == 1)
    return 5 * SHARD_BASE + (int)(j % BL_B) * BL_T;
  j %= BL_A;
  return j < 6 ? SHARD_BASE + (int)j * BL_T : 2 * SHARD_BASE + (int)(j - 6) * BL_T;
}

/* Reads steps windows from loaders dl[0..world) and writes each global sequence's first token
 * in global order ((micro-step x world + rank) x B + row), checking every row is a contiguous,
 * shifted slice. */
static void read_global(dt_dataloader_t *dl, int world, int accum, int steps, int *out)
{
  const int B = dl[0].B;
  for (int s = 0; s < steps; s++)
    for (int m = 0; m < accum; m++)
      for (int r = 0; r < world; r++) {
        ck_assert_int_eq(dt_dataloader_next(&dl[r]), 0);
        for (int b = 0; b < B; b++) {
          const int *in = dl[r].inputs + b * BL_T, *tg = dl[r].targets + b * BL_T;
          for (int t = 0; t < BL_T; t++) {
            ck_assert_int_eq(in[t], in[0] + t);
            ck_assert_int_eq(tg[t], in[0] + t + 1);
          }
          out[((s * accum + m) * world + r) * B + b] = in[0];
        }
      }
}

static int source_of(int first)
{
  return first / SHARD_BASE == 5;
}

static void open_blend(dt_dataloader_t *dl, const char *spec, int B, int world, int accum,
                       int shuffle)
{
  for (int r = 0; r < world; r++)
    ck_assert_int_eq(dt_dataloader_init(&dl[r], spec, B, BL_T, r, world, accum, VOCAB, shuffle, 11),
                     0);
}

/* The blend's first n global sequences, read one at a time (the stream every layout reads). */
static void read_stream(const char *spec, int shuffle, int n, int *out)
{
  dt_dataloader_t one;
  open_blend(&one, spec, 1, 1, 1, shuffle);
  read_global(&one, 1, 1, n, out);
  dt_dataloader_free(&one);
}

static void close_all(dt_dataloader_t *dl, int n)
{
  for (int r = 0; r < n; r++)
    dt_dataloader_free(&dl[r]);
}

/* Megatron-LM's rule, worked by hand for weights 3:1 (error = w x max(i, 1) - taken, the first
 * source on a tie): i=0 A (.75 vs .25), i=1 B (-.25 vs .25), i=2 A (.5), i=3 A (.25 vs -.25),
 * i=4 A (0 vs 0: a tie), i=5 B (-.25 vs .25), i=6 A, i=7 A. Each source's sequences come in
 * its own order, over its shard ends and passes, and every prefix holds each share to within
 * one sequence. */
START_TEST(test_blend_deals_by_weight)
{
  char dir[256], spec[1400];
  make_blend_data(dir, sizeof dir, spec, sizeof spec, "3/1");
  dt_dataloader_t dl;
  open_blend(&dl, spec, 1, 1, 1, 0);
  ck_assert_int_eq(dl.nsrc, 2);
  ck_assert_int_eq(dt_dataloader_epoch_windows(&dl), -1);
  enum { N = 60 }; /* about 4 passes over A, 5 over B */
  int first[N];
  read_global(&dl, 1, 1, N, first);
  const char *hand = "ABAAABAA";
  int64_t taken[2] = {0, 0}, fresh = -1; /* sequences before a source's second pass */
  for (int i = 0; i < N; i++) {
    const int src = source_of(first[i]);
    if (fresh < 0 && taken[src] == (src ? BL_B : BL_A))
      fresh = i;
    if (i < 8)
      ck_assert_msg(src == hand[i] - 'A', "sequence %d from source %c, expected %c", i, 'A' + src,
                    hand[i]);
    ck_assert_int_eq(first[i], unshuffled_first(src, taken[src]));
    taken[src]++;
    for (int d = 0; d < 2; d++)
      ck_assert_msg(fabs((double)taken[d] - (d ? 0.25 : 0.75) * (i + 1)) <= 1.0,
                    "after %d sequences source %d has %lld", i + 1, d, (long long)taken[d]);
  }
  ck_assert_int_eq(dl.pos.seqs, N);
  ck_assert_uint_ne(dl.pos.blend, 0);
  ck_assert_int_gt(fresh, 0);
  ck_assert_int_eq(dt_dataloader_windows_within(&dl, N), fresh);
  ck_assert_int_eq(dt_dataloader_windows_within(&dl, 2), 2);
  dt_dataloader_free(&dl);
  ut_rm_rf(dir);
}
END_TEST

/* The global sequence order does not depend on the layout (dp x accum x B), shuffled or not,
 * and equals the one-sequence stream of the test above. */
START_TEST(test_blend_layouts_read_the_same_stream)
{
  char dir[256], spec[1400];
  make_blend_data(dir, sizeof dir, spec, sizeof spec, "0.6/0.4");
  for (int shuffle = 0; shuffle < 2; shuffle++) {
    enum { STEPS = 9, UNIT = 4 };
    int ref[STEPS * UNIT], got[STEPS * UNIT];
    read_stream(spec, shuffle, STEPS * UNIT, ref);
    const int layouts[][3] = {{1, 4, 1}, {1, 2, 2}, {2, 1, 2}, {1, 1, 4}, {4, 1, 1}}; /* B dp K */
    for (size_t l = 0; l < sizeof layouts / sizeof *layouts; l++) {
      const int B = layouts[l][0], world = layouts[l][1], accum = layouts[l][2];
      dt_dataloader_t dl[4];
      open_blend(dl, spec, B, world, accum, shuffle);
      read_global(dl, world, accum, STEPS, got);
      ck_assert_msg(memcmp(ref, got, sizeof ref) == 0, "shuffle %d, B %d dp %d accum %d differs",
                    shuffle, B, world, accum);
      ck_assert_int_eq(dl[world - 1].pos.seqs, STEPS * UNIT);
      ck_assert_int_eq(dl[0].pos.window, STEPS);
      close_all(dl, world);
    }
  }
  ut_rm_rf(dir);
}
END_TEST

/* Shuffled, each source's sequences of a pass are a permutation of its sequences, in another
 * order than the unshuffled one. */
START_TEST(test_blend_shuffles_each_source)
{
  char dir[256], spec[1400];
  make_blend_data(dir, sizeof dir, spec, sizeof spec, "1/1");
  dt_dataloader_t dl;
  open_blend(&dl, spec, 1, 1, 1, 1);
  enum { N = 2 * BL_A };
  int first[N], a[BL_A], na = 0, moved = 0;
  read_global(&dl, 1, 1, N, first);
  for (int i = 0; i < N && na < BL_A; i++)
    if (source_of(first[i]) == 0) {
      moved += first[i] != unshuffled_first(0, na);
      a[na++] = first[i];
    }
  ck_assert_int_eq(na, BL_A);
  qsort(a, BL_A, sizeof *a, cmp_int);
  for (int j = 0; j < BL_A; j++)
    ck_assert_int_eq(a[j], unshuffled_first(0, j));
  ck_assert_int_gt(moved, 0);
  dt_dataloader_free(&dl);
  ut_rm_rf(dir);
}
END_TEST

/* A resumed run (a fresh loader seeking to a saved position) reads what the uninterrupted one
 * reads, in another layout of the same global batch too, and a run of another global batch
 * goes on from the same global sequence. */
START_TEST(test_blend_seek)
{
  char dir[256], spec[1400];
  make_blend_data(dir, sizeof dir, spec, sizeof spec, "0.7/0.3");
  for (int shuffle = 0; shuffle < 2; shuffle++) {
    enum { UNIT = 4, MORE = 12 };
    int ref[40 * UNIT], got[MORE * UNIT], skip[40 * UNIT];
    read_stream(spec, shuffle, 40 * UNIT, ref);
    const int saves[] = {0, 3, 7, 20};
    for (size_t k = 0; k < sizeof saves / sizeof *saves; k++) {
      dt_dataloader_t a[2], b[4];
      open_blend(a, spec, 1, 2, 2, shuffle);
      read_global(a, 2, 2, saves[k], skip);
      const dt_data_pos_t pos = a[0].pos;
      ck_assert_int_eq(pos.seqs, saves[k] * UNIT);
      open_blend(b, spec, 1, 4, 1, shuffle);
      for (int r = 0; r < 4; r++)
        ck_assert_int_eq(dt_dataloader_seek(&b[r], pos), 0);
      read_global(b, 4, 1, MORE, got);
      ck_assert_msg(memcmp(got, ref + saves[k] * UNIT, sizeof got) == 0,
                    "shuffle %d: resumed after %d steps, diverged", shuffle, saves[k]);
      close_all(b, 4);
      /* Without the sources' counts (one source's checkpoint, another blend), the sequences are
       * dealt again to find them; counts that do not add up are refused. */
      dt_data_pos_t p = pos;
      p.nsrc = 0;
      open_blend(b, spec, 1, 1, 1, shuffle);
      ck_assert_int_eq(dt_dataloader_seek(&b[0], p), 0);
      ck_assert_int_eq(memcmp(b[0].pos.taken, pos.taken, sizeof pos.taken), 0);
      read_global(b, 1, 1, MORE, got);
      ck_assert_int_eq(memcmp(got, ref + saves[k] * UNIT, MORE * sizeof *got), 0);
      p = pos;
      p.taken[1]++;
      ck_assert_int_eq(dt_dataloader_seek(&b[0], p), DT_ERANGE);
      close_all(b, 1);
      /* Steps of 2 sequences go on from the same global sequence. */
      open_blend(b, spec, 2, 1, 1, shuffle);
      ck_assert_int_eq(dt_dataloader_seek(&b[0], pos), 0);
      read_global(b, 1, 1, MORE, got);
      ck_assert_int_eq(memcmp(got, ref + saves[k] * UNIT, MORE * 2 * sizeof *got), 0);
      close_all(b, 1);
      close_all(a, 2);
    }
  }
  ut_rm_rf(dir);
}
END_TEST

/* One source's checkpoint resumed with a blend goes on from its sequence count, and a blend's
 * resumed with one source from that many windows into the source's stream. */
START_TEST(test_blend_and_one_source_positions)
{
  char dir[256], spec[1400], pat[600];
  make_blend_data(dir, sizeof dir, spec, sizeof spec, "1/2");
  snprintf(pat, sizeof pat, "%s/a/a_*.bin", dir);
  enum { UNIT = 2 };
  int ref[30 * UNIT], got[6 * UNIT], skip[14 * UNIT];
  dt_dataloader_t dl;
  read_stream(spec, 1, 30 * UNIT, ref);

  ck_assert_int_eq(dt_dataloader_init(&dl, pat, UNIT, BL_T, 0, 1, 1, VOCAB, 1, 5), 0);
  read_global(&dl, 1, 1, 8, skip);
  dt_data_pos_t pos = dl.pos; /* 16 sequences in, epoch 1 */
  ck_assert_int_eq(pos.seqs, 8 * UNIT);
  ck_assert_int_eq(pos.blend, 0);
  dt_dataloader_free(&dl);
  open_blend(&dl, spec, UNIT, 1, 1, 1);
  ck_assert_int_eq(dt_dataloader_seek(&dl, pos), 0);
  read_global(&dl, 1, 1, 6, got);
  ck_assert_int_eq(memcmp(got, ref + 8 * UNIT, sizeof got), 0);
  pos = dl.pos; /* 28 sequences of the blend */
  dt_dataloader_free(&dl);

  /* One source from the blend's position: window 14 of its stream, where a loader that read 14
   * windows from the start is. */
  int want[6 * UNIT];
  ck_assert_int_eq(dt_dataloader_init(&dl, pat, UNIT, BL_T, 0, 1, 1, VOCAB, 1, 5), 0);
  read_global(&dl, 1, 1, 14, skip);
  read_global(&dl, 1, 1, 6, want);
  ck_assert_int_eq(dt_dataloader_seek(&dl, pos), 0);
  ck_assert_int_eq(dl.pos.epoch, 14 / (BL_A / UNIT));
  read_global(&dl, 1, 1, 6, got);
  ck_assert_int_eq(memcmp(got, want, sizeof got), 0);
  dt_dataloader_free(&dl);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_blend_bad_input)
{
  char dir[256], spec[1400], bad[2000];
  make_blend_data(dir, sizeof dir, spec, sizeof spec, "1/1");
  dt_dataloader_t dl;
  snprintf(bad, sizeof bad, "%s,1:%s/c/*.bin", spec, dir); /* a source matching nothing */
  ck_assert_int_eq(dt_dataloader_init(&dl, bad, 1, BL_T, 0, 1, 1, VOCAB, 0, 0), DT_ENOENT);
  snprintf(bad, sizeof bad, "%s,0:%s/a/a_1.bin", spec, dir);
  ck_assert_int_eq(dt_dataloader_init(&dl, bad, 1, BL_T, 0, 1, 1, VOCAB, 0, 0), DT_EINVAL);
  snprintf(bad, sizeof bad, "%s,", spec);
  ck_assert_int_eq(dt_dataloader_init(&dl, bad, 1, BL_T, 0, 1, 1, VOCAB, 0, 0), DT_EINVAL);
  /* B's tokens (5 x SHARD_BASE + i) are past this vocabulary. */
  ck_assert_int_eq(dt_dataloader_init(&dl, spec, 1, BL_T, 0, 1, 1, 3 * SHARD_BASE, 0, 0),
                   DT_ERANGE);
  /* A sequence too long for a source's shard. */
  ck_assert_int_eq(dt_dataloader_init(&dl, spec, 1, 6 * BL_T, 0, 1, 1, VOCAB, 0, 0), DT_EFORMAT);
  ut_rm_rf(dir);
}
END_TEST

/* The syntax (blend.h): what is a blend, what is refused, and written back. */
START_TEST(test_blend_syntax)
{
  ck_assert(dt_blend_is("0.7:web/*.bin"));
  ck_assert(dt_blend_is("3:x"));
  ck_assert(!dt_blend_is("data/train_*.bin"));
  ck_assert(!dt_blend_is("/abs/0.7:x"));
  ck_assert(!dt_blend_is("web:0.7"));
  ck_assert(!dt_blend_is(NULL));
  dt_blend_t b;
  char why[256];
  ck_assert_int_eq(dt_blend_parse("0.7:web/a_*.bin,0.3:/d/code.bin", &b, why, sizeof why), 0);
  ck_assert_int_eq(b.n, 2);
  ck_assert(b.weight[0] == 0.7 && b.weight[1] == 0.3);
  ck_assert_str_eq(b.pattern[0], "web/a_*.bin");
  ck_assert_str_eq(b.pattern[1], "/d/code.bin");
  char *s = dt_blend_format(&b);
  ck_assert_str_eq(s, "0.7:web/a_*.bin,0.3:/d/code.bin");
  free(s);
  b.weight[0] = 1.0 / 3.0;
  s = dt_blend_format(&b);
  dt_blend_t back;
  ck_assert_int_eq(dt_blend_parse(s, &back, why, sizeof why), 0);
  ck_assert(back.weight[0] == 1.0 / 3.0);
  free(s);
  dt_blend_free(&back);
  dt_blend_free(&b);
  /* Names: NAME= before a glob (the text before its first '=' a name), else src<place>. */
  ck_assert_int_eq(
      dt_blend_parse("2:web=w/*.bin,1:/d/a=b.bin,1:./c=1.bin,1:code.v2=x=y", &b, why, sizeof why),
      0);
  ck_assert_int_eq(b.n, 4);
  const char *names[] = {"web", "src2", "src3", "code.v2"};
  const char *globs[] = {"w/*.bin", "/d/a=b.bin", "./c=1.bin", "x=y"};
  for (int i = 0; i < 4; i++) {
    ck_assert_str_eq(b.name[i], names[i]);
    ck_assert_str_eq(b.pattern[i], globs[i]);
    ck_assert_int_eq(b.named[i], i == 0 || i == 3);
  }
  s = dt_blend_format(&b);
  ck_assert_str_eq(s, "2:web=w/*.bin,1:/d/a=b.bin,1:./c=1.bin,1:code.v2=x=y");
  free(s);
  dt_blend_free(&b);
  char got[DT_BLEND_MAX][DT_NAME_MAX];
  ck_assert_int_eq(dt_blend_names("2:web=w/*.bin,1:x.bin", got), 2);
  ck_assert_str_eq(got[0], "web");
  ck_assert_str_eq(got[1], "src2");
  ck_assert_int_eq(dt_blend_names("w/*.bin", got), 0); /* one source */
  ck_assert_int_eq(dt_blend_names(NULL, got), 0);
  ck_assert_int_eq(dt_blend_names("1:a,1:src1=b", got), 0); /* no valid blend */
  const char *bad[][2] = {{"0.7:a,", "source 2"},
                          {"0.7:a,b", "source 2 ('b')"},
                          {"0:a", "positive"},
                          {"-1:a", "positive"},
                          {"nan:a", "positive"},
                          {"inf:a", "positive"},
                          {"1:a,2:", "names no shards"},
                          {"1:a,,1:b", "source 2"},
                          {"1:web=", "source 1 ('1:web=') names no shards"},
                          {"1:web=a,1:web=b", "source 2: the name 'web' is used twice"},
                          {"1:a,1:src1=b", "source 2: the name 'src1' is used twice"}};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    ck_assert_int_eq(dt_blend_parse(bad[i][0], &b, why, sizeof why), DT_EINVAL);
    ck_assert_msg(strstr(why, bad[i][1]), "'%s': %s", bad[i][0], why);
    ck_assert_int_eq(b.n, 0);
  }
  char many[DT_BLEND_MAX * 8 + 16] = "", *p = many;
  for (int i = 0; i <= DT_BLEND_MAX; i++)
    p += sprintf(p, "%s1:s%d", i ? "," : "", i);
  ck_assert_int_eq(dt_blend_parse(many, &b, why, sizeof why), DT_EINVAL);
  ck_assert_ptr_nonnull(strstr(why, "at most"));
}
END_TEST

/* Named validation sets (blend.h): names, patterns, what is refused, and written back. */
START_TEST(test_valsets_syntax)
{
  dt_valsets_t v;
  char why[256];
  ck_assert_int_eq(dt_valsets_parse("web=web/val_*.bin,code.v2=/d/a=b.bin", &v, why, sizeof why),
                   0);
  ck_assert_int_eq(v.n, 2);
  ck_assert_str_eq(v.name[0], "web");
  ck_assert_str_eq(v.pattern[0], "web/val_*.bin");
  ck_assert_str_eq(v.name[1], "code.v2");
  ck_assert_str_eq(v.pattern[1], "/d/a=b.bin"); /* the first '=' splits */
  char *s = dt_valsets_format(&v);
  ck_assert_str_eq(s, "web=web/val_*.bin,code.v2=/d/a=b.bin");
  free(s);
  dt_valsets_free(&v);
  char longest[64];
  snprintf(longest, sizeof longest, "%.*s=x", DT_NAME_MAX - 1,
           "abcdefghijklmnopqrstuvwxyz_-.0123456789");
  ck_assert_int_eq(dt_valsets_parse(longest, &v, why, sizeof why), 0);
  ck_assert_int_eq((int)strlen(v.name[0]), DT_NAME_MAX - 1);
  dt_valsets_free(&v);
  const char *bad[][2] = {{"a=x,", "set 2 ('') is not NAME=GLOB"},
                          {"a=x,y", "set 2 ('y') is not NAME=GLOB"},
                          {"=x", "set 1 ('=x'): a name is"},
                          {"a/b=x", "a name is 1 to 31"},
                          {"abcdefghijklmnopqrstuvwxyz_-.0123=x", "a name is 1 to 31"},
                          {"a=x,b=y,a=z", "set 3: the name 'a' is used twice"},
                          {"a=", "set 1 ('a=') names no shards"}};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    ck_assert_int_eq(dt_valsets_parse(bad[i][0], &v, why, sizeof why), DT_EINVAL);
    ck_assert_msg(strstr(why, bad[i][1]), "'%s': %s", bad[i][0], why);
    ck_assert_int_eq(v.n, 0);
  }
  char many[DT_VALSETS_MAX * 12 + 16] = "", *p = many;
  for (int i = 0; i <= DT_VALSETS_MAX; i++)
    p += sprintf(p, "%ss%d=x%d", i ? "," : "", i, i);
  ck_assert_int_eq(dt_valsets_parse(many, &v, why, sizeof why), DT_EINVAL);
  ck_assert_ptr_nonnull(strstr(why, "at most 16 validation sets"));
  /* The step line's text of a validation. */
  const char *names[] = {"web", "code"};
  const float losses[] = {3.18424f, 2.441f}, val = 3.0123f;
  char line[128];
  dt_valsets_line(line, sizeof line, &val, 0, names, losses);
  ck_assert_str_eq(line, " | val 3.0123");
  dt_valsets_line(line, sizeof line, NULL, 2, names, losses);
  ck_assert_str_eq(line, " | val web 3.1842, code 2.4410");
  dt_valsets_line(line, sizeof line, &val, 2, names, losses);
  ck_assert_str_eq(line, " | val 3.0123 (web 3.1842, code 2.4410)");
  dt_valsets_line(line, sizeof line, NULL, 0, names, losses);
  ck_assert_str_eq(line, "");
  dt_valsets_line(line, 20, &val, 2, names, losses); /* cut, terminated */
  ck_assert_str_eq(line, " | val 3.0123 (web ");
  /* And of a blend's sources' losses, after the step's loss. */
  dt_sources_line(line, sizeof line, 2, names, losses);
  ck_assert_str_eq(line, " (web 3.1842, code 2.4410)");
  dt_sources_line(line, sizeof line, 0, names, losses);
  ck_assert_str_eq(line, "");
}
END_TEST

/* ------------------------------------------------------------------------------------------ */

static Suite *dataloader_suite(void)
{
  Suite *s = suite_create("dataloader");
  TCase *t = tcase_create("order");
  tcase_add_test(t, test_sequential_windows);
  tcase_add_test(t, test_window_needs_one_extra_token);
  tcase_add_test(t, test_rank_slicing);
  tcase_add_test(t, test_multi_shard_sorted_and_epochs);
  suite_add_tcase(s, t);

  t = tcase_create("shuffle");
  tcase_add_test(t, test_shuffle_is_permutation_per_epoch);
  tcase_add_test(t, test_shuffle_deterministic_per_seed);
  tcase_add_test(t, test_shuffle_shard_order_varies);
  tcase_add_test(t, test_shuffle_ranks_agree);
  suite_add_tcase(s, t);

  t = tcase_create("seek");
  tcase_add_test(t, test_seek_reproduces_sequential);
  tcase_add_test(t, test_seek_reproduces_shuffled);
  tcase_add_test(t, test_seek_invalid);
  tcase_add_test(t, test_split_of_the_global_batch_does_not_matter);
  tcase_add_test(t, test_seek_across_layouts);
  suite_add_tcase(s, t);

  t = tcase_create("blend");
  tcase_add_test(t, test_blend_syntax);
  tcase_add_test(t, test_valsets_syntax);
  tcase_add_test(t, test_blend_deals_by_weight);
  tcase_add_test(t, test_blend_layouts_read_the_same_stream);
  tcase_add_test(t, test_blend_shuffles_each_source);
  tcase_add_test(t, test_blend_seek);
  tcase_add_test(t, test_blend_and_one_source_positions);
  tcase_add_test(t, test_blend_bad_input);
  suite_add_tcase(s, t);

  t = tcase_create("bad_input");
  tcase_add_test(t, test_bad_magic);
  tcase_add_test(t, test_bad_version);
  tcase_add_test(t, test_truncated);
  tcase_add_test(t, test_header_claims_more_tokens);
  tcase_add_test(t, test_token_out_of_vocab);
  tcase_add_test(t, test_too_few_tokens);
  tcase_add_test(t, test_no_match);
  tcase_add_test(t, test_invalid_args);
  tcase_add_test(t, test_shard_write_format);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(dataloader_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
