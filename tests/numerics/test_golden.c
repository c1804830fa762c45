/* test_golden.c — the C trainer against the PyTorch reference (tests/numerics/gpt2_ref.py).
 *
 * The golden files were produced by gen_golden.py with PyTorch 1.13 in fp32 from the same
 * llm.c checkpoint and token shard; see tests/numerics/README.md. Tolerances: the issue's
 * 1e-5 absolute on the loss; gradients 1e-6 and weights 2e-5 absolute (about 10x the fp32-vs-
 * fp64 spread the generator measured: 7.7e-8 on grads, 1.9e-6 on final weights).
 *
 *   test_golden [cpu|cpu-remote|cuda]   (default cpu)
 * runs the same checks on that device. The CUDA kernels sum in other orders than the CPU's
 * (cuBLAS's GEMM blocking, tree reductions), so on cuda every tolerance is 10x: the issue's
 * 1e-4 on the loss over 20 steps. Without a GPU the cuda run exits 77 (skipped). The golden
 * files are found under $DT_SOURCE_DIR when it is set (a GPU test bundle, tests/gpu/run.sh),
 * else in this source tree. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint.h"
#include "dataloader.h"
#include "devices.h"
#include "gpt2.h"
#include "trainer.h"

#define GOLDEN_STEPS 20

static const char *g_device = "cpu";
static double g_tol = 1.0; /* tolerance multiplier: 10 on cuda */
static char g_golden[4096];

/* A golden file's path. */
static const char *golden(const char *name)
{
  static char path[8][4200];
  static int next;
  char *p = path[next++ % 8];
  snprintf(p, sizeof path[0], "%s/%s", g_golden, name);
  return p;
}

typedef struct {
  double loss, lr, grad_norm;
} golden_step_t;

static void read_losses(const char *name, golden_step_t *out)
{
  FILE *fp = fopen(name, "r");
  ck_assert_msg(fp != NULL, "cannot open %s", name);
  for (int i = 0; i < GOLDEN_STEPS; i++) {
    int step;
    ck_assert_int_eq(
        fscanf(fp, "%d %lf %lf %lf", &step, &out[i].loss, &out[i].lr, &out[i].grad_norm), 4);
    ck_assert_int_eq(step, i);
  }
  fclose(fp);
}

static float *read_floats(const char *path, long skip_bytes, size_t n)
{
  FILE *fp = fopen(path, "rb");
  ck_assert_msg(fp != NULL, "cannot open %s", path);
  float *buf = malloc(n * sizeof(float));
  ck_assert_ptr_nonnull(buf);
  fseek(fp, skip_bytes, SEEK_SET);
  ck_assert_uint_eq(fread(buf, sizeof(float), n, fp), n);
  fclose(fp);
  return buf;
}

/* Collects the per-step metrics of a dt_train_run. */
typedef struct {
  dt_step_metrics_t steps[GOLDEN_STEPS];
  int n;
} capture_t;

static void on_step(void *ud, const dt_step_metrics_t *m)
{
  capture_t *c = ud;
  ck_assert_int_lt(c->n, GOLDEN_STEPS);
  c->steps[c->n++] = *m;
}

static void base_opts(dt_train_opts_t *o, capture_t *cap)
{
  dt_train_opts_default(o);
  o->init_llmc = golden("tiny_model.bin");
  o->train_pattern = golden("tiny_train.bin");
  o->batch = 4;
  o->seq = 32;
  o->steps = GOLDEN_STEPS;
  o->quiet = 1;
  o->device = g_device;
  o->on_step = on_step;
  o->on_step_ud = cap;
}

/* Step 0's full gradient, element by element, in llm.c's parameter layout, with either
 * attention (test_adamw_20_steps runs the trainer's default, flash; test_full_20_steps the
 * materialised probabilities). */
START_TEST(test_grads_step0)
{
  const int flash = _i;
  dt_gpt2_config_t cfg;
  dt_gpt2_t m;
  dt_dataloader_t dl;
  dt_device_t *dev;
  ck_assert_int_eq(dt_train_device_open(g_device, &dev), 0);
  ck_assert_int_eq(dt_llmc_read_config(golden("tiny_model.bin"), &cfg), 0);
  ck_assert_int_eq(dt_gpt2_create(&m, &cfg, dev, NULL, NULL), 0);
  ck_assert_int_eq(dt_gpt2_set_attention(&m, flash), 0);
  ck_assert_int_eq(dt_llmc_load(&m, golden("tiny_model.bin")), 0);
  ck_assert_int_eq(dt_gpt2_alloc_activations(&m, 4, 32, (int[]){1}, 0), 0);
  ck_assert_int_eq(
      dt_dataloader_init(&dl, golden("tiny_train.bin"), 4, 32, 0, 1, 1, cfg.vocab, 0, 0), 0);
  ck_assert_int_eq(dt_dataloader_next(&dl), 0);
  ck_assert_int_eq(dt_gpt2_zero_grad(&m), 0);
  float loss;
  ck_assert_int_eq(dt_gpt2_forward_backward(&m, dl.inputs, dl.targets, 4, 32, 1.0f, &loss), 0);
  golden_step_t g[GOLDEN_STEPS];
  read_losses(golden("tiny_adamw_losses.txt"), g);
  ck_assert_msg(fabs(loss - g[0].loss) < 1e-5 * g_tol, "%s attention: loss %.9g vs torch %.9g",
                flash ? "flash" : "materialized", loss, g[0].loss);

  float *ref = read_floats(golden("tiny_adamw_grads0.bin"), 0, m.num_params);
  float *grads = malloc(m.num_params * sizeof(float));
  ck_assert_ptr_nonnull(grads);
  ck_assert_int_eq(dev->copy(dev, grads, m.grads_flat, m.num_params * sizeof(float), DT_COPY_D2H),
                   0);
  double max_err = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < m.num_params; i++) {
    double e = fabs((double)grads[i] - (double)ref[i]);
    if (e > max_err)
      max_err = e, worst = i;
  }
  ck_assert_msg(max_err < 1e-6 * g_tol,
                "%s attention: max |grad - torch| = %.3g at flat index %zu (%.9g vs %.9g)",
                flash ? "flash" : "materialized", max_err, worst, grads[worst], ref[worst]);
  free(grads);
  free(ref);
  dt_dataloader_free(&dl);
  dt_gpt2_destroy(&m);
  dt_train_device_close(dev);
}
END_TEST

/* Run (a): the exactness protocol, plus final weights and validation loss. */
START_TEST(test_adamw_20_steps)
{
  dt_train_opts_t o;
  capture_t cap = {0};
  char dir[] = "/tmp/dt_golden_XXXXXX", export_path[256];
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(export_path, sizeof export_path, "%s/final.bin", dir);
  base_opts(&o, &cap);
  o.sched.lr = 3e-4;
  o.val_pattern = golden("tiny_val.bin");
  o.val_every = GOLDEN_STEPS;
  o.val_batches = 4;
  o.export_llmc = export_path;
  ck_assert_int_eq(dt_train_run(&o), 0);
  ck_assert_int_eq(cap.n, GOLDEN_STEPS);

  golden_step_t g[GOLDEN_STEPS];
  read_losses(golden("tiny_adamw_losses.txt"), g);
  for (int i = 0; i < GOLDEN_STEPS; i++) {
    ck_assert_msg(fabs(cap.steps[i].loss - g[i].loss) < 1e-5 * g_tol,
                  "step %d: loss %.9g vs torch %.9g", i, cap.steps[i].loss, g[i].loss);
    ck_assert_msg(fabs(cap.steps[i].grad_norm - g[i].grad_norm) < 1e-5 * g_tol * g[i].grad_norm,
                  "step %d: grad norm %.9g vs torch %.9g", i, cap.steps[i].grad_norm,
                  g[i].grad_norm);
  }
  FILE *fp = fopen(golden("tiny_adamw_val.txt"), "r");
  double val;
  ck_assert_int_eq(fscanf(fp, "%lf", &val), 1);
  fclose(fp);
  ck_assert(cap.steps[GOLDEN_STEPS - 1].has_val);
  ck_assert_msg(fabs(cap.steps[GOLDEN_STEPS - 1].val_loss - val) < 1e-5 * g_tol,
                "val %.9g vs torch %.9g", cap.steps[GOLDEN_STEPS - 1].val_loss, val);

  /* Final weights, exported in llm.c format, against torch's. */
  size_t n = 112384;
  float *ours = read_floats(export_path, 1024, n);
  float *ref = read_floats(golden("tiny_adamw_final.bin"), 1024, n);
  double max_err = 0.0;
  for (size_t i = 0; i < n; i++)
    max_err = fmax(max_err, fabs((double)ours[i] - (double)ref[i]));
  ck_assert_msg(max_err < 2e-5 * g_tol, "final weights: max |w - torch| = %.3g", max_err);
  free(ours);
  free(ref);
  unlink(export_path);
  rmdir(dir);
}
END_TEST

/* Run (b): weight decay on matrices only, warmup + cosine, clipping, 2 micro-batches. */
START_TEST(test_full_20_steps)
{
  dt_train_opts_t o;
  capture_t cap = {0};
  base_opts(&o, &cap);
  o.sched.lr = 1e-3;
  o.sched.schedule = DT_SCHEDULE_COSINE;
  o.sched.warmup = 5;
  o.sched.min_lr_frac = 0.1;
  o.weight_decay = 0.1f;
  o.grad_clip = 1.0f;
  o.grad_accum = 2;
  o.attention = "materialized";
  ck_assert_int_eq(dt_train_run(&o), 0);
  ck_assert_int_eq(cap.n, GOLDEN_STEPS);
  golden_step_t g[GOLDEN_STEPS];
  read_losses(golden("tiny_full_losses.txt"), g);
  for (int i = 0; i < GOLDEN_STEPS; i++) {
    ck_assert_msg(fabs(cap.steps[i].lr - g[i].lr) < 1e-12, "step %d: lr %.12g vs %.12g", i,
                  cap.steps[i].lr, g[i].lr);
    ck_assert_msg(fabs(cap.steps[i].loss - g[i].loss) < 1e-5 * g_tol,
                  "step %d: loss %.9g vs torch %.9g", i, cap.steps[i].loss, g[i].loss);
    ck_assert_msg(fabs(cap.steps[i].grad_norm - g[i].grad_norm) < 1e-5 * g_tol * g[i].grad_norm,
                  "step %d: grad norm %.9g vs torch %.9g", i, cap.steps[i].grad_norm,
                  g[i].grad_norm);
  }
}
END_TEST

int main(int argc, char **argv)
{
  if (argc > 1)
    g_device = argv[1];
  if (strcmp(g_device, "cuda") == 0) {
    g_tol = 10.0;
    dt_device_t *probe;
    if (dt_train_device_open("auto", &probe) != 0 || probe->host)
      return 77; /* no GPU here: skipped */
    dt_train_device_close(probe);
  }
  const char *src = getenv("DT_SOURCE_DIR");
  snprintf(g_golden, sizeof g_golden, "%s/tests/numerics/golden", src ? src : DT_SOURCE_DIR);
  Suite *s = suite_create("golden");
  TCase *tc = tcase_create("pytorch");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, test_grads_step0, 0, 2);
  tcase_add_test(tc, test_adamw_20_steps);
  tcase_add_test(tc, test_full_20_steps);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  if (strcmp(g_device, "cuda") ==
      0) /* CUDA is initialised above: a forked child could not use it */
    srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
