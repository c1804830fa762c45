/* test_resume.c — a run stopped and resumed from its checkpoint is bit-identical to the same
 * run done in one go: same per-step losses and gradient norms to the last bit, and the same
 * final weights byte for byte.
 *
 * The configuration is chosen to exercise everything the checkpoint must carry: shuffled data
 * that wraps into a second epoch (which reshuffles), gradient accumulation, clipping, weight
 * decay, and warmup + cosine (the schedule depends on the global step). Both halves use the
 * same thread count: OpenBLAS's GEMMs round differently with a different number of threads
 * (measured: 2471 of 12800 elements of a 128x100x64 sgemm differ between 1 and 2 threads). */
#include <check.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer.h"

#define GOLDEN "/tests/numerics/golden/"
#define STEPS  12

typedef struct {
  dt_step_metrics_t steps[STEPS];
  int n;
} capture_t;

static void on_step(void *ud, const dt_step_metrics_t *m)
{
  capture_t *c = ud;
  ck_assert_int_lt(c->n, STEPS);
  c->steps[c->n++] = *m;
}

static void opts(dt_train_opts_t *o, capture_t *cap, const char *export_path)
{
  dt_train_opts_default(o);
  o->init_llmc = NULL;
  o->model = (dt_gpt2_config_t){
      .max_seq = 32, .vocab = 100, .padded_vocab = 128, .layers = 2, .heads = 2, .channels = 32};
  o->seed = 7;
  /* 4096 tokens / (4 x 32) = 31 windows; 12 steps x 3 micro-batches = 36: wraps an epoch. */
  o->train_pattern = DT_SOURCE_DIR GOLDEN "tiny_val.bin";
  o->shuffle = 1;
  o->batch = 4;
  o->seq = 32;
  o->grad_accum = 3;
  o->steps = STEPS;
  o->sched.lr = 2e-3;
  o->sched.warmup = 2;
  o->sched.schedule = DT_SCHEDULE_COSINE;
  o->sched.min_lr_frac = 0.1;
  o->weight_decay = 0.1f;
  o->grad_clip = 0.5f;
  o->quiet = 1;
  o->export_llmc = export_path;
  o->on_step = on_step;
  o->on_step_ud = cap;
}

static long file_bytes(const char *path, unsigned char **buf)
{
  FILE *fp = fopen(path, "rb");
  ck_assert_msg(fp != NULL, "cannot open %s", path);
  fseek(fp, 0, SEEK_END);
  long n = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  *buf = malloc((size_t)n);
  ck_assert_uint_eq(fread(*buf, 1, (size_t)n, fp), (size_t)n);
  fclose(fp);
  return n;
}

START_TEST(test_resume_bit_identical)
{
  char dir[] = "/tmp/dt_resume_XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  char full_export[256], resumed_export[256], ckpt[256], cmd[600];
  snprintf(full_export, sizeof full_export, "%s/full.bin", dir);
  snprintf(resumed_export, sizeof resumed_export, "%s/resumed.bin", dir);
  snprintf(ckpt, sizeof ckpt, "%s/ckpt", dir);

  /* Uninterrupted. */
  dt_train_opts_t o;
  capture_t full = {0}, first = {0}, second = {0};
  opts(&o, &full, full_export);
  o.threads = 2;
  ck_assert_int_eq(dt_train_run(&o), 0);
  ck_assert_int_eq(full.n, STEPS);

  /* Stopped after step 5 (checkpoints at 3 and 5)... */
  opts(&o, &first, NULL);
  o.threads = 2;
  o.ckpt_dir = ckpt;
  o.save_every = 3;
  o.stop_at = 5;
  ck_assert_int_eq(dt_train_run(&o), 0);
  ck_assert_int_eq(first.n, 5);

  /* ...and resumed from the newest checkpoint. */
  opts(&o, &second, resumed_export);
  o.threads = 2;
  o.ckpt_dir = ckpt;
  o.resume = 1;
  ck_assert_int_eq(dt_train_run(&o), 0);
  ck_assert_int_eq(second.n, STEPS - 5);

  for (int i = 0; i < STEPS; i++) {
    const dt_step_metrics_t *a = &full.steps[i];
    const dt_step_metrics_t *b = i < 5 ? &first.steps[i] : &second.steps[i - 5];
    ck_assert_int_eq(a->step, b->step);
    ck_assert_msg(memcmp(&a->loss, &b->loss, sizeof a->loss) == 0,
                  "step %d: loss %.9g (one run) vs %.9g (resumed)", i + 1, a->loss, b->loss);
    ck_assert_msg(memcmp(&a->grad_norm, &b->grad_norm, sizeof a->grad_norm) == 0,
                  "step %d: grad norm %.9g vs %.9g", i + 1, a->grad_norm, b->grad_norm);
    ck_assert(a->lr == b->lr);
  }
  unsigned char *x, *y;
  long nx = file_bytes(full_export, &x), ny = file_bytes(resumed_export, &y);
  ck_assert_int_eq(nx, ny);
  ck_assert_msg(memcmp(x, y, (size_t)nx) == 0, "final weights differ after resume");
  free(x);
  free(y);
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  ck_assert_int_eq(system(cmd), 0);
}
END_TEST

int main(void)
{
  Suite *s = suite_create("resume");
  TCase *tc = tcase_create("bit-identical");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_resume_bit_identical);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
