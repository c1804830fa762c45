/* test_checkpoint.c — Check suite for worker/trainer/checkpoint: llm.c files in and out, and
 * distrain's sharded checkpoints (bit-exact round trips, resharded loads, the commit protocol,
 * corruption and truncation detection, pruning). Uses a tiny model on the CPU ops. */
#include <stdlib.h>
#include <string.h>

#include <check.h>

#include "checkpoint.h"
#include "dt_error.h"
#include "dt_util.h"
#include "rng.h"
#include "ut_fs.h"

static const dt_gpt2_config_t TINY = {
    .max_seq = 16, .vocab = 50, .padded_vocab = 128, .layers = 1, .heads = 2, .channels = 8};

/* A model whose every parameter and moment is a distinct random value. */
static void make_model(dt_gpt2_t *m, const dt_gpt2_config_t *cfg, uint64_t seed, int optim)
{
  ck_assert_int_eq(dt_gpt2_create(m, cfg, dt_device_cpu(), NULL, NULL), 0);
  dt_rng_t r;
  dt_rng_seed(&r, seed);
  dt_rng_normal(&r, m->params_flat, m->num_params, 0.0f, 1.0f);
  /* wte's padded rows zero, as every model holds them (dt_llmc_load sets them so) */
  memset(m->params_flat + (size_t)cfg->vocab * cfg->channels, 0,
         (size_t)(cfg->padded_vocab - cfg->vocab) * cfg->channels * sizeof(float));
  if (optim) {
    ck_assert_int_eq(dt_gpt2_alloc_optimizer(m), 0);
    dt_rng_normal(&r, m->m_flat, m->num_params, 0.0f, 0.1f);
    for (size_t i = 0; i < m->num_params; i++)
      m->v_flat[i] = dt_rng_uniform(&r) * 1e-3f;
  }
}

static void make_state(dt_train_state_t *s, int64_t step)
{
  memset(s, 0, sizeof *s);
  s->step = step;
  s->data = (dt_data_pos_t){.epoch = 3,
                            .shard = 2,
                            .window = 12345,
                            .unit = 8,
                            .seqs = 98765,
                            .blend = 0xB1E2D3C4A5F60718ull};
  dt_rng_seed(&s->rng, 0xC0FFEE + (uint64_t)step);
  for (int i = 0; i < 17; i++)
    dt_rng_u64(&s->rng);
  s->loss_avg = 3.0 + 1.0 / 3.0; /* a double's every bit */
  s->loss_steps = step + 7;
  s->updates = step - 2; /* two steps taken without an update */
  s->norm_avg = 0.1 + 1.0 / 7.0;
  s->norm_steps = step + 5;
  s->skip_until = step + 3;
}

static void expect_same_model(const dt_gpt2_t *a, const dt_gpt2_t *b)
{
  ck_assert_uint_eq(a->num_params, b->num_params);
  ck_assert_int_eq(memcmp(a->params_flat, b->params_flat, a->bytes_params), 0);
  ck_assert_ptr_nonnull(b->m_flat);
  ck_assert_ptr_nonnull(b->v_flat);
  ck_assert_int_eq(memcmp(a->m_flat, b->m_flat, a->bytes_params), 0);
  ck_assert_int_eq(memcmp(a->v_flat, b->v_flat, a->bytes_params), 0);
}

static void expect_same_state(const dt_train_state_t *a, const dt_train_state_t *b)
{
  ck_assert_int_eq(a->step, b->step);
  ck_assert_int_eq(a->data.epoch, b->data.epoch);
  ck_assert_int_eq(a->data.shard, b->data.shard);
  ck_assert_int_eq(a->data.window, b->data.window);
  ck_assert_int_eq(a->data.unit, b->data.unit);
  ck_assert_int_eq(a->data.seqs, b->data.seqs);
  ck_assert_uint_eq(a->data.blend, b->data.blend);
  ck_assert_int_eq(a->data.nsrc, b->data.nsrc);
  ck_assert_int_eq(memcmp(a->data.taken, b->data.taken, sizeof a->data.taken), 0);
  ck_assert_int_eq(memcmp(a->rng.s, b->rng.s, sizeof a->rng.s), 0);
  ck_assert_int_eq(memcmp(&a->loss_avg, &b->loss_avg, sizeof a->loss_avg), 0);
  ck_assert_int_eq(a->loss_steps, b->loss_steps);
  ck_assert_int_eq(a->updates, b->updates);
  ck_assert_int_eq(memcmp(&a->norm_avg, &b->norm_avg, sizeof a->norm_avg), 0);
  ck_assert_int_eq(a->norm_steps, b->norm_steps);
  ck_assert_int_eq(a->skip_until, b->skip_until);
}

/* Writes and commits step state->step as world equal-ish flat shards. */
static void save_sharded(const dt_gpt2_t *m, const dt_train_state_t *st, const char *dir, int world)
{
  dt_ckpt_shard_info_t info[8];
  const int64_t P = (int64_t)m->num_params;
  for (int r = 0; r < world; r++) {
    int64_t lo = P * r / world, hi = P * (r + 1) / world;
    ck_assert_int_eq(dt_ckpt_write_shard(m, st, dir, r, world, lo, hi, &info[r]), 0);
    ck_assert_int_eq(info[r].lo, lo);
    ck_assert_int_eq(info[r].hi, hi);
  }
  ck_assert_int_eq(dt_ckpt_commit(dir, st->step, P, world, info), 0);
}

static void shard_path(char *buf, size_t n, const char *dir, int64_t step, int rank, int world)
{
  snprintf(buf, n, "%s/step-%08lld/shard-%05d-of-%05d.bin", dir, (long long)step, rank, world);
}

/* ------------------------------------------------------------------------------------------ */
/* llm.c format                                                                                */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_llmc_round_trip)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/model.bin", dir);
  dt_gpt2_t a, b;
  make_model(&a, &TINY, 1, 0);
  ck_assert_int_eq(dt_llmc_save(&a, path), 0);
  ck_assert_int_eq(ut_file_size(path), 256 * 4 + (long long)a.num_params * 4);

  /* The header is llm.c's: magic, version 3, maxT, V, L, NH, C, Vp. */
  size_t n;
  uint8_t *buf = ut_read_all(path, &n);
  int32_t h[8];
  memcpy(h, buf, sizeof h);
  free(buf);
  const int32_t want[8] = {20240326, 3, 16, 50, 1, 2, 8, 128};
  ck_assert_int_eq(memcmp(h, want, sizeof want), 0);

  dt_gpt2_config_t cfg;
  memset(&cfg, 0, sizeof cfg);
  ck_assert_int_eq(dt_llmc_read_config(path, &cfg), 0);
  ck_assert_int_eq(memcmp(&cfg, &TINY, sizeof cfg), 0);

  make_model(&b, &TINY, 2, 0);
  ck_assert_int_ne(memcmp(a.params_flat, b.params_flat, a.bytes_params), 0);
  ck_assert_int_eq(dt_llmc_load(&b, path), 0);
  ck_assert_int_eq(memcmp(a.params_flat, b.params_flat, a.bytes_params), 0);
  ck_assert_int_eq(ut_count_entries(dir, ".tmp"), 0);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

/* wte's rows past the vocabulary come back zero whatever the file holds there (a NaN would reach
 * every input gradient through a GPU's LM head, which runs over them); the rest as written. */
START_TEST(test_llmc_padded_rows_zeroed)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/model.bin", dir);
  dt_gpt2_t a, b;
  make_model(&a, &TINY, 1, 0);
  ck_assert_int_eq(dt_llmc_save(&a, path), 0);
  const size_t C = (size_t)TINY.channels, lo = (size_t)TINY.vocab * C,
               hi = (size_t)TINY.padded_vocab * C;
  for (size_t i = lo; i < hi; i++) /* the saved padding is zero */
    ck_assert(a.params_flat[i] == 0.0f);
  FILE *fp = fopen(path, "r+b");
  ck_assert_ptr_nonnull(fp);
  const float junk[2] = {NAN, 3.0f};
  ck_assert_int_eq(fseek(fp, (long)(256 * 4 + lo * 4), SEEK_SET), 0);
  ck_assert_int_eq(fwrite(junk, sizeof junk[0], 2, fp), 2);
  ck_assert_int_eq(fseek(fp, (long)(256 * 4 + (hi - 1) * 4), SEEK_SET), 0);
  ck_assert_int_eq(fwrite(junk, sizeof junk[0], 1, fp), 1);
  fclose(fp);
  make_model(&b, &TINY, 2, 0);
  ck_assert_int_eq(dt_llmc_load(&b, path), 0);
  ck_assert_int_eq(memcmp(a.params_flat, b.params_flat, a.bytes_params), 0);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_llmc_bad_files)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/model.bin", dir);
  dt_gpt2_t m;
  dt_gpt2_config_t cfg;
  make_model(&m, &TINY, 1, 0);
  const float before = m.params_flat[0];

  /* missing */
  ck_assert_int_eq(dt_llmc_read_config(path, &cfg), DT_ENOENT);
  ck_assert_int_eq(dt_llmc_load(&m, path), DT_ENOENT);

  /* bad magic */
  ck_assert_int_eq(dt_llmc_save(&m, path), 0);
  const int32_t bad_magic = 20240520; /* a token shard's magic */
  ut_patch(path, 0, &bad_magic, 4);
  ck_assert_int_eq(dt_llmc_read_config(path, &cfg), DT_EFORMAT);
  ck_assert_int_eq(dt_llmc_load(&m, path), DT_EFORMAT);

  /* version 5 (bf16) and other versions */
  ck_assert_int_eq(dt_llmc_save(&m, path), 0);
  const int32_t v5 = 5, v1 = 1;
  ut_patch(path, 4, &v5, 4);
  ck_assert_int_eq(dt_llmc_read_config(path, &cfg), DT_EFORMAT);
  ck_assert_int_eq(dt_llmc_load(&m, path), DT_EFORMAT);
  ut_patch(path, 4, &v1, 4);
  ck_assert_int_eq(dt_llmc_load(&m, path), DT_EFORMAT);

  /* truncated: by one float, and inside the header */
  ck_assert_int_eq(dt_llmc_save(&m, path), 0);
  ck_assert_int_eq(truncate(path, ut_file_size(path) - 4), 0);
  ck_assert_int_eq(dt_llmc_read_config(path, &cfg), DT_EFORMAT);
  ck_assert_int_eq(dt_llmc_load(&m, path), DT_EFORMAT);
  ck_assert_int_eq(truncate(path, 100), 0);
  ck_assert_int_eq(dt_llmc_load(&m, path), DT_EFORMAT);
  /* one byte too many */
  ck_assert_int_eq(dt_llmc_save(&m, path), 0);
  FILE *fp = fopen(path, "ab");
  fputc(0, fp);
  fclose(fp);
  ck_assert_int_eq(dt_llmc_load(&m, path), DT_EFORMAT);

  /* a header with an impossible config (heads do not divide channels) */
  ck_assert_int_eq(dt_llmc_save(&m, path), 0);
  const int32_t heads3 = 3;
  ut_patch(path, 5 * 4, &heads3, 4);
  ck_assert_int_eq(dt_llmc_read_config(path, &cfg), DT_EFORMAT);
  /* sizes whose parameter count overflows 64 bits (found by tests/fuzz: the count was summed
   * before the sizes were bounded, a signed overflow), and sizes just past each bound */
  ck_assert_int_eq(dt_llmc_save(&m, path), 0);
  const int32_t huge[5] = {1 << 24, 2, 2, 1 << 30, 1 << 30}; /* maxT V L NH C */
  ut_patch(path, 2 * 4, huge, sizeof huge);
  ck_assert_int_eq(dt_llmc_read_config(path, &cfg), DT_EFORMAT);
  char why[256];
  dt_gpt2_config_t big = TINY;
  ck_assert_int_eq(dt_gpt2_config_validate(&big, why, sizeof why), 0);
  big.layers = DT_GPT2_MAX_LAYERS + 1;
  ck_assert_int_eq(dt_gpt2_config_validate(&big, why, sizeof why), DT_EINVAL);
  ck_assert_msg(strstr(why, "layers must be in [1, 4096]"), "%s", why);
  big = TINY, big.heads = 1, big.channels = DT_GPT2_MAX_CHANNELS + 1;
  ck_assert_int_eq(dt_gpt2_config_validate(&big, why, sizeof why), DT_EINVAL);
  ck_assert_msg(strstr(why, "channels must be a multiple of heads in [1, 131072]"), "%s", why);
  big = TINY, big.max_seq = DT_GPT2_MAX_ROWS + 1;
  ck_assert_int_eq(dt_gpt2_config_validate(&big, why, sizeof why), DT_EINVAL);
  big = TINY, big.padded_vocab = DT_GPT2_MAX_ROWS + 1;
  ck_assert_int_eq(dt_gpt2_config_validate(&big, why, sizeof why), DT_EINVAL);
  big = TINY, big.layers = DT_GPT2_MAX_LAYERS, big.heads = 1, big.channels = DT_GPT2_MAX_CHANNELS;
  big.max_seq = big.padded_vocab = DT_GPT2_MAX_ROWS;
  ck_assert_int_eq(dt_gpt2_config_validate(&big, why, sizeof why), 0);

  /* None of the failures touched the model. */
  ck_assert(m.params_flat[0] == before);
  dt_gpt2_destroy(&m);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_llmc_config_mismatch)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/model.bin", dir);
  dt_gpt2_t a, b;
  make_model(&a, &TINY, 1, 0);
  ck_assert_int_eq(dt_llmc_save(&a, path), 0);
  /* More layers: a different size altogether. */
  dt_gpt2_config_t c2 = TINY;
  c2.layers = 2;
  make_model(&b, &c2, 3, 0);
  ck_assert_int_eq(dt_llmc_load(&b, path), DT_ESHAPE);
  dt_gpt2_destroy(&b);
  /* Same parameter count (V 50 and 60 both pad to 128) but a different vocabulary. */
  c2 = TINY;
  c2.vocab = 60;
  make_model(&b, &c2, 3, 0);
  ck_assert_uint_eq(a.num_params, b.num_params);
  const float before = b.params_flat[0];
  ck_assert_int_eq(dt_llmc_load(&b, path), DT_ESHAPE);
  ck_assert(b.params_flat[0] == before);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* distrain checkpoints                                                                        */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_ckpt_round_trip)
{
  char dir[256], sdir[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a, b, c;
  dt_train_state_t sa, sb, sc;
  make_model(&a, &TINY, 10, 1);
  make_state(&sa, 42);
  save_sharded(&a, &sa, dir, 1);
  snprintf(sdir, sizeof sdir, "%s/step-00000042", dir);
  ck_assert(ut_exists(sdir));
  ck_assert_int_eq(ut_count_entries(sdir, NULL), 2); /* one shard + MANIFEST, no temporaries */

  /* Into a fresh model without moments: load allocates and fills them. */
  make_model(&b, &TINY, 11, 0);
  memset(&sb, 0, sizeof sb);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), 0);
  expect_same_model(&a, &b);
  expect_same_state(&sa, &sb);

  /* By step directory as well; and the config reads back. */
  make_model(&c, &TINY, 12, 1);
  memset(&sc, 0, sizeof sc);
  ck_assert_int_eq(dt_ckpt_load(&c, &sc, sdir), 0);
  expect_same_model(&a, &c);
  expect_same_state(&sa, &sc);
  dt_gpt2_config_t cfg;
  memset(&cfg, 0, sizeof cfg);
  ck_assert_int_eq(dt_ckpt_read_config(dir, &cfg), 0);
  ck_assert_int_eq(memcmp(&cfg, &TINY, sizeof cfg), 0);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  dt_gpt2_destroy(&c);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_ckpt_multi_shard)
{
  char dir[256];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a, b;
  dt_train_state_t sa, sb;
  make_model(&a, &TINY, 20, 1);
  make_state(&sa, 7);
  /* two ranges [0, k), [k, P) with an uneven k */
  const int64_t P = (int64_t)a.num_params, k = P / 3 + 1;
  dt_ckpt_shard_info_t info[2];
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &sa, dir, 0, 2, 0, k, &info[0]), 0);
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &sa, dir, 1, 2, k, P, &info[1]), 0);
  /* header, one run (global offset, length), params + two moments */
  ck_assert_int_eq(info[0].bytes, 256 + 16 + (uint64_t)k * 12);
  ck_assert_int_eq(info[1].bytes, 256 + 16 + (uint64_t)(P - k) * 12);
  ck_assert_str_eq(info[1].name, "shard-00001-of-00002.bin");
  /* not loadable before the commit */
  make_model(&b, &TINY, 21, 0);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_ENOENT);
  ck_assert_int_eq(dt_ckpt_commit(dir, 7, P, 2, info), 0);
  memset(&sb, 0, sizeof sb);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), 0);
  expect_same_model(&a, &b);
  expect_same_state(&sa, &sb);
  dt_gpt2_destroy(&b);

  /* Three shards, one of them empty, load the same. */
  sa.step = 8;
  dt_ckpt_shard_info_t i3[3];
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &sa, dir, 0, 3, 0, 5, &i3[0]), 0);
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &sa, dir, 1, 3, 5, 5, &i3[1]), 0);
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &sa, dir, 2, 3, 5, P, &i3[2]), 0);
  ck_assert_int_eq(dt_ckpt_commit(dir, 8, P, 3, i3), 0);
  make_model(&b, &TINY, 22, 0);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), 0);
  expect_same_model(&a, &b);
  expect_same_state(&sa, &sb);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_ckpt_latest)
{
  char dir[256], path[512];
  int64_t step = -1;
  ut_mkdtemp(dir, sizeof dir);
  ck_assert_int_eq(dt_ckpt_latest(dir, &step), DT_ENOENT);
  snprintf(path, sizeof path, "%s/does-not-exist", dir);
  ck_assert_int_eq(dt_ckpt_latest(path, &step), DT_ENOENT);

  dt_gpt2_t a;
  dt_train_state_t st;
  make_model(&a, &TINY, 30, 1);
  const int64_t steps[] = {3, 120, 10};
  for (size_t i = 0; i < 3; i++) {
    make_state(&st, steps[i]);
    save_sharded(&a, &st, dir, 1);
  }
  /* A newer step whose shard is written but never committed. */
  make_state(&st, 500);
  dt_ckpt_shard_info_t info;
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 1, 0, (int64_t)a.num_params, &info), 0);
  /* Directories that only look like steps. */
  snprintf(path, sizeof path, "%s/step-9999x", dir);
  ck_assert_int_eq(dt_mkdir_p(path), 0);
  snprintf(path, sizeof path, "%s/notes", dir);
  ck_assert_int_eq(dt_mkdir_p(path), 0);

  ck_assert_int_eq(dt_ckpt_latest(dir, &step), 0);
  ck_assert_int_eq(step, 120);
  /* Loading the directory picks that step. */
  dt_gpt2_t b;
  dt_train_state_t sb;
  make_model(&b, &TINY, 31, 0);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), 0);
  ck_assert_int_eq(sb.step, 120);
  /* The uncommitted step directory itself is not a checkpoint. */
  snprintf(path, sizeof path, "%s/step-00000500", dir);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, path), DT_ENOENT);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_ckpt_corrupt_payload)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a, b;
  dt_train_state_t st, sb;
  make_model(&a, &TINY, 40, 1);
  make_state(&st, 5);
  save_sharded(&a, &st, dir, 2);
  make_model(&b, &TINY, 41, 0);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), 0);

  /* One byte in the weights of shard 0, then one in the second moment of shard 1. */
  shard_path(path, sizeof path, dir, 5, 0, 2);
  ut_flip_byte(path, 256 + 13);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_EFORMAT);
  ut_flip_byte(path, 256 + 13);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), 0);
  shard_path(path, sizeof path, dir, 5, 1, 2);
  ut_flip_byte(path, (long)ut_file_size(path) - 1);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_EFORMAT);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_ckpt_bad_shard_files)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a, b;
  dt_train_state_t st, sb;
  make_model(&a, &TINY, 50, 1);
  make_model(&b, &TINY, 51, 0);
  make_state(&st, 1);
  save_sharded(&a, &st, dir, 1);
  shard_path(path, sizeof path, dir, 1, 0, 1);
  size_t n;
  uint8_t *good = ut_read_all(path, &n);

  /* truncated by one float, to inside the header, to nothing */
  const long long cuts[] = {(long long)n - 4, 100, 0};
  for (size_t i = 0; i < 3; i++) {
    ut_write_all(path, good, n);
    ck_assert_int_eq(truncate(path, cuts[i]), 0);
    ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_EFORMAT);
  }
  /* bad magic, bad version */
  const uint32_t bad = 0xDEADBEEF, v2 = 7;
  ut_write_all(path, good, n);
  ut_patch(path, 0, &bad, 4);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_EFORMAT);
  ut_write_all(path, good, n);
  ut_patch(path, 4, &v2, 4);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_EFORMAT);
  /* shard missing altogether */
  unlink(path);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_ENOENT);
  /* restored: loads again */
  ut_write_all(path, good, n);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), 0);
  free(good);

  /* a malformed manifest */
  char mpath[512];
  snprintf(mpath, sizeof mpath, "%s/step-00000001/MANIFEST", dir);
  ut_write_all(mpath, "distrain-checkpoint 1\nstep 1\n", 29);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_EFORMAT);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

/* A manifest must describe a tiling of [0, P): shard entries that leave a hole (or reach past
 * the model) would otherwise load "successfully" with part of the weights never read. */
START_TEST(test_ckpt_manifest_must_tile)
{
  char dir[256], mpath[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a, b;
  dt_train_state_t st, sb;
  make_model(&a, &TINY, 55, 1);
  make_model(&b, &TINY, 56, 0);
  make_state(&st, 4);
  const int64_t P = (int64_t)a.num_params, k = P / 2;
  dt_ckpt_shard_info_t info[2];
  /* Two writers that (wrongly) both wrote [0, k). */
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 2, 0, k, &info[0]), 0);
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 1, 2, 0, k, &info[1]), 0);
  ck_assert_int_eq(dt_ckpt_commit(dir, 4, P, 2, info), DT_EINVAL);
  /* A hand-written manifest naming both, each consistent with its file. */
  char text[1024];
  int len = snprintf(text, sizeof text,
                     "distrain-checkpoint 1\nstep 4\nnum_params %lld\nworld 2\n"
                     "shard 0 0 %lld %llu %08x %s\nshard 1 0 %lld %llu %08x %s\n",
                     (long long)P, (long long)k, (unsigned long long)info[0].bytes, info[0].crc32c,
                     info[0].name, (long long)k, (unsigned long long)info[1].bytes, info[1].crc32c,
                     info[1].name);
  snprintf(mpath, sizeof mpath, "%s/step-00000004/MANIFEST", dir);
  ut_write_all(mpath, text, (size_t)len);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_EFORMAT);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

/* The same inside the tiling: shards whose runs list an element twice. Their lengths add up to
 * P, so the count of elements delivered matched the count asked for, and a load "succeeded"
 * with the elements no run held left as they were. */
START_TEST(test_ckpt_runs_must_not_overlap)
{
  char dir[256];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a, b;
  dt_train_state_t st, sb;
  make_model(&a, &TINY, 57, 1);
  make_model(&b, &TINY, 58, 1);
  make_state(&st, 5);
  const int64_t P = (int64_t)a.num_params, k = P / 2;
  /* Writer 0 holds [0, k), writer 1 (its place in the concatenation [k, P)) [0, P - k). */
  const dt_gpt2_run_t r0 = {.global = 0, .local = 0, .len = k};
  const dt_gpt2_run_t r1 = {.global = 0, .local = 0, .len = P - k};
  dt_ckpt_shard_info_t info[2];
  ck_assert_int_eq(dt_ckpt_write_runs(&TINY, P, &st, dir, 0, 2, 0, &r0, 1, a.params_flat, a.m_flat,
                                      a.v_flat, &info[0]),
                   0);
  ck_assert_int_eq(dt_ckpt_write_runs(&TINY, P, &st, dir, 1, 2, k, &r1, 1, a.params_flat, a.m_flat,
                                      a.v_flat, &info[1]),
                   0);
  ck_assert_int_eq(dt_ckpt_commit(dir, 5, P, 2, info), 0);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_EFORMAT);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_ckpt_config_mismatch)
{
  char dir[256];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a, b;
  dt_train_state_t st, sb;
  make_model(&a, &TINY, 60, 1);
  make_state(&st, 2);
  save_sharded(&a, &st, dir, 2);
  dt_gpt2_config_t c2 = TINY;
  c2.layers = 2; /* different parameter count */
  make_model(&b, &c2, 61, 0);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_ESHAPE);
  dt_gpt2_destroy(&b);
  c2 = TINY;
  c2.vocab = 60; /* same parameter count, different model */
  make_model(&b, &c2, 61, 0);
  ck_assert_uint_eq(a.num_params, b.num_params);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_ESHAPE);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

/* A shard written without moments (an exported model) is not a training checkpoint. */
START_TEST(test_ckpt_without_optimizer_state)
{
  char dir[256];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a, b;
  dt_train_state_t st, sb;
  make_model(&a, &TINY, 65, 0);
  make_state(&st, 2);
  save_sharded(&a, &st, dir, 1);
  make_model(&b, &TINY, 66, 0);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_EFORMAT);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_ckpt_refuses_committed_step)
{
  char dir[256], sdir[512], mpath[512], spath[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a;
  dt_train_state_t st;
  make_model(&a, &TINY, 70, 1);
  make_state(&st, 9);
  save_sharded(&a, &st, dir, 1);
  snprintf(sdir, sizeof sdir, "%s/step-00000009", dir);
  snprintf(mpath, sizeof mpath, "%s/step-00000009/MANIFEST", dir);
  shard_path(spath, sizeof spath, dir, 9, 0, 1);
  size_t nm, ns;
  uint8_t *man = ut_read_all(mpath, &nm), *shard = ut_read_all(spath, &ns);

  /* Different weights, same step: refused, for the same and for another rank/world. */
  for (size_t i = 0; i < a.num_params; i++)
    a.params_flat[i] += 1.0f;
  dt_ckpt_shard_info_t info;
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 1, 0, (int64_t)a.num_params, &info),
                   DT_EEXIST);
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 1, 2, 0, 10, &info), DT_EEXIST);

  size_t nm2, ns2;
  uint8_t *man2 = ut_read_all(mpath, &nm2), *shard2 = ut_read_all(spath, &ns2);
  ck_assert_int_eq(nm, nm2);
  ck_assert_int_eq(ns, ns2);
  ck_assert_int_eq(memcmp(man, man2, nm), 0);
  ck_assert_int_eq(memcmp(shard, shard2, ns), 0);
  ck_assert_int_eq(ut_count_entries(sdir, NULL), 2);
  free(man);
  free(man2);
  free(shard);
  free(shard2);
  dt_gpt2_destroy(&a);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_ckpt_commit_must_tile)
{
  char dir[256], mpath[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a;
  dt_train_state_t st;
  make_model(&a, &TINY, 80, 1);
  make_state(&st, 6);
  const int64_t P = (int64_t)a.num_params, k = P / 2;
  dt_ckpt_shard_info_t info[2];
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 2, 0, k, &info[0]), 0);
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 1, 2, k, P, &info[1]), 0);
  dt_ckpt_shard_info_t bad[2];

  memcpy(bad, info, sizeof bad); /* gap */
  bad[1].lo = k + 1;
  ck_assert_int_eq(dt_ckpt_commit(dir, 6, P, 2, bad), DT_EINVAL);
  memcpy(bad, info, sizeof bad); /* overlap */
  bad[1].lo = k - 1;
  ck_assert_int_eq(dt_ckpt_commit(dir, 6, P, 2, bad), DT_EINVAL);
  memcpy(bad, info, sizeof bad); /* short of P */
  bad[1].hi = P - 1;
  ck_assert_int_eq(dt_ckpt_commit(dir, 6, P, 2, bad), DT_EINVAL);
  memcpy(bad, info, sizeof bad); /* past P */
  bad[1].hi = P + 1;
  ck_assert_int_eq(dt_ckpt_commit(dir, 6, P, 2, bad), DT_EINVAL);
  memcpy(bad, info, sizeof bad); /* not starting at 0 */
  bad[0].lo = 1;
  ck_assert_int_eq(dt_ckpt_commit(dir, 6, P, 2, bad), DT_EINVAL);
  ck_assert_int_eq(dt_ckpt_commit(dir, 6, P, 1, info), DT_EINVAL); /* only half */

  snprintf(mpath, sizeof mpath, "%s/step-00000006/MANIFEST", dir);
  ck_assert(!ut_exists(mpath));
  int64_t step;
  ck_assert_int_eq(dt_ckpt_latest(dir, &step), DT_ENOENT);
  ck_assert_int_eq(dt_ckpt_commit(dir, 6, P, 2, info), 0);
  ck_assert(ut_exists(mpath));
  dt_gpt2_destroy(&a);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_ckpt_bad_range)
{
  char dir[256];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a;
  dt_train_state_t st;
  make_model(&a, &TINY, 85, 1);
  make_state(&st, 1);
  dt_ckpt_shard_info_t info;
  const int64_t P = (int64_t)a.num_params;
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 1, -1, P, &info), DT_ERANGE);
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 1, 0, P + 1, &info), DT_ERANGE);
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 1, 10, 5, &info), DT_ERANGE);
  dt_gpt2_destroy(&a);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_ckpt_prune)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a;
  dt_train_state_t st;
  make_model(&a, &TINY, 90, 1);
  for (int64_t s = 1; s <= 5; s++) {
    make_state(&st, s * 10);
    save_sharded(&a, &st, dir, s % 2 ? 1 : 2);
  }
  /* an uncommitted, older step directory is not the pruner's business */
  make_state(&st, 5);
  dt_ckpt_shard_info_t info;
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 1, 0, (int64_t)a.num_params, &info), 0);

  ck_assert_int_eq(dt_ckpt_prune(dir, 0, 0), 0); /* keep <= 0: nothing */
  ck_assert_int_eq(ut_count_entries(dir, "step-"), 6);
  ck_assert_int_eq(dt_ckpt_prune(dir, 2, 0), 0);
  for (int64_t s = 1; s <= 5; s++) {
    snprintf(path, sizeof path, "%s/step-%08lld", dir, (long long)(s * 10));
    ck_assert_msg(ut_exists(path) == (s >= 4), "step %lld", (long long)(s * 10));
  }
  snprintf(path, sizeof path, "%s/step-00000005", dir);
  ck_assert(ut_exists(path));
  int64_t step;
  ck_assert_int_eq(dt_ckpt_latest(dir, &step), 0);
  ck_assert_int_eq(step, 50);
  /* keep more than there are: nothing */
  ck_assert_int_eq(dt_ckpt_prune(dir, 10, 0), 0);
  ck_assert_int_eq(ut_count_entries(dir, "step-"), 3);
  ck_assert_int_eq(dt_ckpt_prune(dir, 1, 0), 0);
  ck_assert_int_eq(ut_count_entries(dir, "step-"), 2);
  snprintf(path, sizeof path, "%s/step-00000050/MANIFEST", dir);
  ck_assert(ut_exists(path));
  /* the survivor still loads */
  dt_gpt2_t b;
  dt_train_state_t sb;
  make_model(&b, &TINY, 91, 0);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), 0);
  ck_assert_int_eq(sb.step, 50);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

/* Saves cut short (no MANIFEST) are deleted, ascending; committed steps and those marked bad
 * stay, and dt_ckpt_discard refuses a committed step. */
START_TEST(test_ckpt_discard_incomplete)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a;
  dt_train_state_t st;
  make_model(&a, &TINY, 93, 1);
  int64_t *steps;
  int n;
  ck_assert_int_eq(dt_ckpt_discard_incomplete(dir, &steps, &n), 0); /* none */
  ck_assert_int_eq(n, 0);
  free(steps);
  for (int64_t s = 10; s <= 20; s += 10) {
    make_state(&st, s);
    save_sharded(&a, &st, dir, 1);
  }
  snprintf(path, sizeof path, "%s/step-00000020", dir);
  ck_assert_int_eq(dt_ckpt_mark_bad(path), 0);
  dt_ckpt_shard_info_t info;
  for (int64_t s = 30; s >= 5; s -= 25) { /* 30 and 5: written, never committed */
    make_state(&st, s);
    ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 1, 0, (int64_t)a.num_params, &info), 0);
  }
  ck_assert_int_eq(ut_count_entries(dir, "step-"), 4);
  ck_assert_int_eq(dt_ckpt_discard_incomplete(dir, &steps, &n), 0);
  ck_assert_int_eq(n, 2);
  ck_assert(steps[0] == 5 && steps[1] == 30);
  free(steps);
  ck_assert_int_eq(ut_count_entries(dir, "step-"), 2);
  snprintf(path, sizeof path, "%s/step-00000020/" DT_CKPT_MANIFEST_NAME ".bad", dir);
  ck_assert(ut_exists(path));
  ck_assert_int_eq(dt_ckpt_discard(dir, 10), DT_EEXIST);
  int64_t step;
  ck_assert_int_eq(dt_ckpt_latest(dir, &step), 0);
  ck_assert_int_eq(step, 10);
  dt_gpt2_destroy(&a);
  ut_rm_rf(dir);
}
END_TEST

/* keep_every: the steps it divides stay whatever keep says; the rest rotate as before. */
START_TEST(test_ckpt_prune_keeps_milestones)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a;
  dt_train_state_t st;
  make_model(&a, &TINY, 92, 1);
  for (int64_t s = 1; s <= 9; s++) {
    make_state(&st, s * 10);
    save_sharded(&a, &st, dir, 1);
    ck_assert_int_eq(dt_ckpt_prune(dir, 2, 40), 0); /* as the trainer does after each commit */
  }
  for (int64_t s = 1; s <= 9; s++) {
    snprintf(path, sizeof path, "%s/step-%08lld/MANIFEST", dir, (long long)(s * 10));
    ck_assert_msg(ut_exists(path) == (s == 4 || s >= 8), "step %lld", (long long)(s * 10));
  }
  ck_assert_int_eq(ut_count_entries(dir, "step-"), 3); /* 40, 80 (also newest but one) and 90 */
  /* the newest two are counted among all steps, milestones too: 80 and 90 */
  make_state(&st, 100);
  save_sharded(&a, &st, dir, 1);
  ck_assert_int_eq(dt_ckpt_prune(dir, 2, 40), 0);
  ck_assert_int_eq(ut_count_entries(dir, "step-"), 4); /* 40, 80, 90, 100 */
  ck_assert_int_eq(dt_ckpt_prune(dir, 1, 40), 0);
  ck_assert_int_eq(ut_count_entries(dir, "step-"), 3); /* 40, 80, 100 */
  snprintf(path, sizeof path, "%s/step-00000090", dir);
  ck_assert(!ut_exists(path));
  ck_assert_int_eq(dt_ckpt_prune(dir, 1, 0), 0); /* without milestones: the newest only */
  ck_assert_int_eq(ut_count_entries(dir, "step-"), 1);
  dt_gpt2_destroy(&a);
  ut_rm_rf(dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */

/* Copies rank tr's part of a whole-model buffer into a local one, by the placement's runs. */
static void scatter_runs(const dt_gpt2_t *m, int tr, const float *global, float *local)
{
  dt_gpt2_run_t *runs;
  size_t n;
  ck_assert_int_eq(dt_gpt2_runs(m, tr, 0, (int64_t)m->num_params, 0, &runs, &n), 0);
  for (size_t i = 0; i < n; i++)
    memcpy(local + runs[i].local, global + runs[i].global, (size_t)runs[i].len * sizeof(float));
  free(runs);
}

/* Tensor-parallel placement and checkpoints across layouts: the runs of all tp ranks (the
 * replicated tensors from rank 0 only) tile the whole model exactly once; qkv rows of one rank
 * are the same heads in q, k and v; shards written by tp ranks load into one process bit for
 * bit, and a one-process checkpoint loads into every tp rank's local layout. */
START_TEST(test_ckpt_tensor_parallel_layouts)
{
  char dir[256];
  const dt_gpt2_config_t cfg = {
      .max_seq = 8, .vocab = 200, .padded_vocab = 256, .layers = 2, .heads = 4, .channels = 16};
  dt_gpt2_t whole;
  dt_train_state_t st, got;
  make_model(&whole, &cfg, 60, 1);
  make_state(&st, 9);
  const size_t P = whole.num_params;
  for (int tp = 2; tp <= 4; tp *= 2) {
    ut_mkdtemp(dir, sizeof dir);
    dt_gpt2_t part[4];
    int *cover = calloc(P, sizeof *cover);
    dt_ckpt_shard_info_t info[4];
    int64_t vlo = 0;
    for (int r = 0; r < tp; r++) {
      const dt_gpt2_tp_t t = {.tp = tp, .rank = r, .comm = NULL};
      ck_assert_int_eq(dt_gpt2_create(&part[r], &cfg, dt_device_cpu(), &t, NULL), 0);
      ck_assert_int_eq(dt_gpt2_alloc_optimizer(&part[r]), 0);
      const size_t R = part[r].replicated;
      ck_assert_uint_eq(part[r].num_params, (P - R) / (size_t)tp + R);
      ck_assert_uint_eq(part[r].global_params, P);
      scatter_runs(&part[r], r, whole.params_flat, part[r].params_flat);
      scatter_runs(&part[r], r, whole.m_flat, part[r].m_flat);
      scatter_runs(&part[r], r, whole.v_flat, part[r].v_flat);
      /* qkvw rows of head h of q, k and v sit C rows apart in the whole model */
      const size_t C = (size_t)cfg.channels, hs = C / (size_t)cfg.heads;
      const size_t rows = 3 * C / (size_t)tp, q0 = (size_t)r * (C / (size_t)tp);
      for (size_t j = 0; j < 3; j++)
        ck_assert(part[r].params.qkvw[j * rows / 3 * C] == whole.params.qkvw[(j * C + q0) * C]);
      ck_assert_uint_eq(rows % hs, 0);

      dt_gpt2_run_t *runs;
      size_t n;
      ck_assert_int_eq(dt_gpt2_runs(&part[r], r, 0, (int64_t)part[r].num_params, 1, &runs, &n), 0);
      int64_t count = 0;
      for (size_t i = 0; i < n; i++) {
        for (int64_t k = 0; k < runs[i].len; k++)
          cover[runs[i].global + k]++;
        count += runs[i].len;
      }
      ck_assert_int_eq(dt_ckpt_write_runs(&cfg, (int64_t)P, &st, dir, r, tp, vlo, runs, n,
                                          part[r].params_flat, part[r].m_flat, part[r].v_flat,
                                          &info[r]),
                       0);
      vlo += count;
      free(runs);
    }
    for (size_t i = 0; i < P; i++)
      ck_assert_msg(cover[i] == 1, "tp %d: global element %zu held %d times", tp, i, cover[i]);
    ck_assert_int_eq(dt_ckpt_commit(dir, st.step, (int64_t)P, tp, info), 0);

    /* tp shards -> one process */
    dt_gpt2_t one;
    make_model(&one, &cfg, 61, 1);
    ck_assert_int_eq(dt_ckpt_load(&one, &got, dir), 0);
    expect_same_model(&whole, &one);
    expect_same_state(&st, &got);
    dt_gpt2_destroy(&one);

    /* one process (the tp checkpoint, now read back) -> every tp rank's local buffers */
    for (int r = 0; r < tp; r++) {
      dt_gpt2_t *pm = &part[r];
      float *p = calloc(pm->num_params, sizeof *p), *m1 = calloc(pm->num_params, sizeof *m1);
      dt_gpt2_run_t *runs;
      size_t n;
      ck_assert_int_eq(dt_gpt2_runs(pm, r, 0, (int64_t)pm->num_params, 0, &runs, &n), 0);
      ck_assert_int_eq(dt_ckpt_load_runs(dir, &cfg, (int64_t)P, runs, n, p, m1, NULL, &got), 0);
      ck_assert_int_eq(memcmp(p, pm->params_flat, pm->bytes_params), 0);
      ck_assert_int_eq(memcmp(m1, pm->m_flat, pm->bytes_params), 0);
      free(runs);
      free(p);
      free(m1);
      dt_gpt2_destroy(pm);
    }
    free(cover);
    ut_rm_rf(dir);
  }
  dt_gpt2_destroy(&whole);
}
END_TEST

/* A run on a blend of data sources saves how many sequences each source was dealt: version 3,
 * the counts after the run table, under the payload's checksum. Other runs write version 2,
 * which builds before blends read. */
START_TEST(test_ckpt_blend_counts)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a, b;
  dt_train_state_t st, sb;
  make_model(&a, &TINY, 80, 1);
  make_model(&b, &TINY, 81, 0);
  make_state(&st, 6);
  dt_ckpt_shard_info_t info;
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 1, 0, (int64_t)a.num_params, &info), 0);
  shard_path(path, sizeof path, dir, 6, 0, 1);
  size_t n;
  uint8_t *buf = ut_read_all(path, &n);
  uint32_t version;
  memcpy(&version, buf + 4, 4);
  ck_assert_uint_eq(version, 2);
  free(buf);

  st.step = 7;
  st.data.nsrc = 3;
  st.data.taken[0] = 50000, st.data.taken[1] = 48000, st.data.taken[2] = 765;
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 1, 0, (int64_t)a.num_params, &info), 0);
  ck_assert_int_eq(dt_ckpt_commit(dir, 7, (int64_t)a.num_params, 1, &info), 0);
  shard_path(path, sizeof path, dir, 7, 0, 1);
  buf = ut_read_all(path, &n);
  memcpy(&version, buf + 4, 4);
  ck_assert_uint_eq(version, 3);
  ck_assert_uint_eq(n, 256 + 16 + 3 * 8 + a.num_params * 12);
  ck_assert_int_eq(memcmp(buf + 256 + 16, st.data.taken, 3 * 8), 0);
  free(buf);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), 0);
  expect_same_model(&a, &b);
  expect_same_state(&st, &sb);
  /* A count changed on disk fails the checksum. */
  const int64_t other = 50001;
  ut_patch(path, 256 + 16, &other, 8);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), DT_EFORMAT);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

/* Checkpoints written before shards carried run tables (version 1: the header, then the
 * parameters and moments of the global range [lo, hi)) still load. Made here from a version 2
 * shard of one run: the run table dropped, the header fields of version 1 restored (offsets
 * of the 256-byte header: version 4, flags 12 (no updates count), payload_bytes 136,
 * payload_crc32c 144, header_crc32c 152, nruns 160, updates 208) and both checksums
 * recomputed, then committed. Its updates read -1: unknown, --skip-steps tells. */
START_TEST(test_ckpt_reads_version_1_shards)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  dt_gpt2_t a, b;
  dt_train_state_t st, sb;
  make_model(&a, &TINY, 70, 1);
  make_model(&b, &TINY, 71, 0);
  make_state(&st, 3);
  dt_ckpt_shard_info_t info;
  ck_assert_int_eq(dt_ckpt_write_shard(&a, &st, dir, 0, 1, 0, (int64_t)a.num_params, &info), 0);
  shard_path(path, sizeof path, dir, 3, 0, 1);
  size_t n;
  uint8_t *v2 = ut_read_all(path, &n);
  ck_assert_uint_eq(n, 256 + 16 + a.num_params * 12);
  uint8_t *v1 = malloc(n - 16);
  memcpy(v1, v2, 256);
  memcpy(v1 + 256, v2 + 256 + 16, n - 256 - 16);
  const uint32_t version = 1, zero32 = 0;
  const uint64_t payload = (uint64_t)a.num_params * 12;
  const int64_t zero64 = 0;
  const uint32_t crc = dt_crc32c(0, v1 + 256, n - 256 - 16);
  memcpy(v1 + 4, &version, 4);
  memcpy(v1 + 136, &payload, 8);
  memcpy(v1 + 144, &crc, 4);
  memcpy(v1 + 152, &zero32, 4);
  memcpy(v1 + 160, &zero64, 8);
  memcpy(v1 + 208, &zero64, 8);
  const uint32_t optim_only = 1;
  memcpy(v1 + 12, &optim_only, 4);
  const uint32_t hcrc = dt_crc32c(0, v1, 256);
  memcpy(v1 + 152, &hcrc, 4);
  ut_write_all(path, v1, n - 16);
  info.bytes = n - 16;
  info.crc32c = crc;
  ck_assert_int_eq(dt_ckpt_commit(dir, 3, (int64_t)a.num_params, 1, &info), 0);
  ck_assert_int_eq(dt_ckpt_load(&b, &sb, dir), 0);
  expect_same_model(&a, &b);
  ck_assert_int_eq(sb.updates, -1);
  sb.updates = st.updates;
  expect_same_state(&st, &sb);
  free(v1);
  free(v2);
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  ut_rm_rf(dir);
}
END_TEST

static Suite *checkpoint_suite(void)
{
  Suite *s = suite_create("checkpoint");
  TCase *t = tcase_create("llmc");
  tcase_add_test(t, test_llmc_round_trip);
  tcase_add_test(t, test_llmc_padded_rows_zeroed);
  tcase_add_test(t, test_llmc_bad_files);
  tcase_add_test(t, test_llmc_config_mismatch);
  suite_add_tcase(s, t);

  t = tcase_create("distrain");
  tcase_add_test(t, test_ckpt_round_trip);
  tcase_add_test(t, test_ckpt_blend_counts);
  tcase_add_test(t, test_ckpt_multi_shard);
  tcase_add_test(t, test_ckpt_latest);
  tcase_add_test(t, test_ckpt_corrupt_payload);
  tcase_add_test(t, test_ckpt_bad_shard_files);
  tcase_add_test(t, test_ckpt_manifest_must_tile);
  tcase_add_test(t, test_ckpt_runs_must_not_overlap);
  tcase_add_test(t, test_ckpt_config_mismatch);
  tcase_add_test(t, test_ckpt_without_optimizer_state);
  tcase_add_test(t, test_ckpt_refuses_committed_step);
  tcase_add_test(t, test_ckpt_commit_must_tile);
  tcase_add_test(t, test_ckpt_bad_range);
  tcase_add_test(t, test_ckpt_prune);
  tcase_add_test(t, test_ckpt_prune_keeps_milestones);
  tcase_add_test(t, test_ckpt_discard_incomplete);
  tcase_add_test(t, test_ckpt_tensor_parallel_layouts);
  tcase_add_test(t, test_ckpt_reads_version_1_shards);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(checkpoint_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
