/* test_jobspec.c — Check suite for common/jobspec: defaults, the example spec, layering of YAML
 * and --set overrides, every reader error (with its line and key), each validation rule, the
 * YAML round trip and the distrain-train command line. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include <check.h>

#include "dt_error.h"
#include "jobspec.h"
#include "ut_fs.h"

typedef Distrain__V1__JobSpec spec_t;

/* The example of the design issue, verbatim (also deploy/jobs/example.yaml, below a header). */
static const char *const k_example =
    "model:      {layers: 4, heads: 4, channels: 256, vocab: 256, max_seq: 256, init: "
    "\"seed:1337\"}  # or llmc:PATH / a distrain checkpoint\n"
    "data:       {train: \"kjv_train.bin\", val: \"kjv_val.bin\", shuffle: false}\n"
    "training:   {batch: 8, seq: 256, steps: 200, micro_batch: 8, val_every: 50}\n"
    "optimizer:  {lr: 3.0e-4, warmup: 0, schedule: cosine, weight_decay: 0.0, beta1: 0.9, beta2: "
    "0.95, eps: 1.0e-8, grad_clip: 1.0}\n"
    "parallel:   {dp: 1, tp: 1, pp: 1, cp: 1, zero_stage: 0, schedule: 1f1b}\n"
    "checkpoint: {dir: ckpt, every: 100, keep: 3}\n"
    "elastic:    {min_nodes: 1, max_nodes: 1, max_restarts: 3, heartbeat_ms: 500, bad_step: "
    "rollback}\n";

static spec_t *fresh(void)
{
  spec_t *s = NULL;
  ck_assert_int_eq(dt_jobspec_new_default(&s), 0);
  ck_assert_ptr_nonnull(s);
  return s;
}

static void parse_ok(spec_t *s, const char *text)
{
  char err[1024];
  int rc = dt_jobspec_parse_yaml(text, strlen(text), "job.yaml", s, err, sizeof err);
  ck_assert_msg(rc == 0, "parse failed (%d): %s\n--- text:\n%s", rc, err, text);
  ck_assert_str_eq(err, "");
}

static void set_ok(spec_t *s, const char *assignment)
{
  char err[1024];
  int rc = dt_jobspec_set(s, assignment, err, sizeof err);
  ck_assert_msg(rc == 0, "--set %s failed: %s", assignment, err);
}

/* Parses text onto a default spec and checks the error: DT_EINVAL, starting with
 * "job.yaml:LINE: " (LINE 0: "job.yaml: ") and containing each NULL-terminated fragment. */
static void parse_fails(const char *text, int line, ...)
{
  spec_t *s = fresh();
  char err[1024], prefix[64];
  int rc = dt_jobspec_parse_yaml(text, strlen(text), "job.yaml", s, err, sizeof err);
  ck_assert_msg(rc == DT_EINVAL, "expected DT_EINVAL, got %d (%s) for:\n%s", rc, err, text);
  if (line > 0)
    snprintf(prefix, sizeof prefix, "job.yaml:%d: ", line);
  else
    snprintf(prefix, sizeof prefix, "job.yaml: ");
  ck_assert_msg(strncmp(err, prefix, strlen(prefix)) == 0, "error '%s' should start with '%s'", err,
                prefix);
  va_list ap;
  va_start(ap, line);
  for (const char *frag; (frag = va_arg(ap, const char *));)
    ck_assert_msg(strstr(err, frag), "error '%s' should contain '%s'", err, frag);
  va_end(ap);
  dt_jobspec_free(s);
}

/* --set on a default spec must fail with DT_EINVAL and an error containing every fragment. */
static void set_fails(const char *assignment, ...)
{
  spec_t *s = fresh();
  char err[1024];
  int rc = dt_jobspec_set(s, assignment, err, sizeof err);
  ck_assert_msg(rc == DT_EINVAL, "--set %s: expected DT_EINVAL, got %d (%s)", assignment, rc, err);
  va_list ap;
  va_start(ap, assignment);
  for (const char *frag; (frag = va_arg(ap, const char *));)
    ck_assert_msg(strstr(err, frag), "error '%s' should contain '%s'", err, frag);
  va_end(ap);
  dt_jobspec_free(s);
}

/* A spec that passes validation: the defaults plus training data. */
static spec_t *valid_spec(void)
{
  spec_t *s = fresh();
  set_ok(s, "data.train=train_*.bin");
  char err[1024];
  ck_assert_msg(dt_jobspec_validate(s, err, sizeof err) == 0, "base spec invalid: %s", err);
  return s;
}

/* ------------------------------------------------------------------------------------------ */
/* Defaults and the example                                                                    */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_defaults)
{
  spec_t *s = fresh();
  ck_assert_str_eq(s->name, "");
  ck_assert_int_eq(s->model->layers, 4);
  ck_assert_int_eq(s->model->heads, 4);
  ck_assert_int_eq(s->model->channels, 256);
  ck_assert_int_eq(s->model->vocab, 256);
  ck_assert_int_eq(s->model->max_seq, 256);
  ck_assert_str_eq(s->model->init, "seed:1337");
  ck_assert_str_eq(s->data->train, "");
  ck_assert_str_eq(s->data->val, "");
  ck_assert_int_eq(s->data->shuffle, 0);
  ck_assert_int_eq(s->training->batch, 8);
  ck_assert_int_eq(s->training->seq, 256);
  ck_assert_int_eq(s->training->steps, 200);
  ck_assert_int_eq(s->training->micro_batch, 8);
  ck_assert_int_eq(s->training->val_every, 0);
  ck_assert_int_eq(s->training->val_batches, 20);
  ck_assert_int_eq(s->training->threads, 0);
  ck_assert(s->optimizer->lr == 3e-4);
  ck_assert_int_eq(s->optimizer->warmup, 0);
  ck_assert_str_eq(s->optimizer->schedule, "cosine");
  ck_assert(s->optimizer->min_lr_frac == 0.0);
  ck_assert(s->optimizer->weight_decay == 0.0);
  ck_assert(s->optimizer->beta1 == 0.9);
  ck_assert(s->optimizer->beta2 == 0.95);
  ck_assert(s->optimizer->eps == 1e-8);
  ck_assert(s->optimizer->grad_clip == 1.0);
  ck_assert_int_eq(s->parallel->dp, 1);
  ck_assert_int_eq(s->parallel->tp, 1);
  ck_assert_int_eq(s->parallel->pp, 1);
  ck_assert_int_eq(s->parallel->cp, 1);
  ck_assert_int_eq(s->parallel->zero_stage, 0);
  ck_assert_str_eq(s->parallel->schedule, "1f1b");
  ck_assert_str_eq(s->checkpoint->dir, "ckpt");
  ck_assert_int_eq(s->checkpoint->every, 100);
  ck_assert_int_eq(s->checkpoint->keep, 3);
  ck_assert_int_eq(s->elastic->min_nodes, 1);
  ck_assert_int_eq(s->elastic->max_nodes, 1);
  ck_assert_int_eq(s->elastic->max_restarts, 3);
  ck_assert_int_eq(s->elastic->heartbeat_ms, 500);
  ck_assert_int_eq(s->elastic->hang_timeout_s, 30);
  /* The defaults alone are invalid only for want of data. */
  char err[1024];
  ck_assert_int_eq(dt_jobspec_validate(s, err, sizeof err), DT_EINVAL);
  ck_assert_str_eq(err, "data.train must name the training shards (a file or a glob)");
  dt_jobspec_free(s);
  dt_jobspec_free(NULL);
}
END_TEST

static void check_example_values(const spec_t *s)
{
  ck_assert_int_eq(s->model->layers, 4);
  ck_assert_int_eq(s->model->heads, 4);
  ck_assert_int_eq(s->model->channels, 256);
  ck_assert_int_eq(s->model->vocab, 256);
  ck_assert_int_eq(s->model->max_seq, 256);
  ck_assert_str_eq(s->model->init, "seed:1337");
  ck_assert_str_eq(s->data->train, "kjv_train.bin");
  ck_assert_str_eq(s->data->val, "kjv_val.bin");
  ck_assert_int_eq(s->data->shuffle, 0);
  ck_assert_int_eq(s->training->batch, 8);
  ck_assert_int_eq(s->training->seq, 256);
  ck_assert_int_eq(s->training->steps, 200);
  ck_assert_int_eq(s->training->micro_batch, 8);
  ck_assert_int_eq(s->training->val_every, 50);
  ck_assert_int_eq(s->training->val_batches, 20); /* default */
  ck_assert(s->optimizer->lr == 3.0e-4);
  ck_assert_int_eq(s->optimizer->warmup, 0);
  ck_assert_str_eq(s->optimizer->schedule, "cosine");
  ck_assert(s->optimizer->weight_decay == 0.0);
  ck_assert(s->optimizer->beta1 == 0.9);
  ck_assert(s->optimizer->beta2 == 0.95);
  ck_assert(s->optimizer->eps == 1.0e-8);
  ck_assert(s->optimizer->grad_clip == 1.0);
  ck_assert_int_eq(s->parallel->dp, 1);
  ck_assert_int_eq(s->parallel->tp, 1);
  ck_assert_int_eq(s->parallel->pp, 1);
  ck_assert_int_eq(s->parallel->cp, 1);
  ck_assert_int_eq(s->parallel->zero_stage, 0);
  ck_assert_str_eq(s->parallel->schedule, "1f1b");
  ck_assert_str_eq(s->checkpoint->dir, "ckpt");
  ck_assert_int_eq(s->checkpoint->every, 100);
  ck_assert_int_eq(s->checkpoint->keep, 3);
  ck_assert_int_eq(s->elastic->min_nodes, 1);
  ck_assert_int_eq(s->elastic->max_nodes, 1);
  ck_assert_int_eq(s->elastic->max_restarts, 3);
  ck_assert_int_eq(s->elastic->heartbeat_ms, 500);
}

START_TEST(test_example_parses)
{
  spec_t *s = fresh();
  parse_ok(s, k_example);
  check_example_values(s);
  char err[1024];
  ck_assert_msg(dt_jobspec_validate(s, err, sizeof err) == 0, "%s", err);
  dt_jobspec_free(s);
}
END_TEST

/* The files in deploy/jobs parse and validate; example.yaml is the example above. */
START_TEST(test_deploy_jobs)
{
  char err[1024];
  spec_t *ex = fresh(), *ref = fresh();
  ck_assert_msg(
      dt_jobspec_parse_file(DT_SOURCE_DIR "/deploy/jobs/example.yaml", ex, err, sizeof err) == 0,
      "%s", err);
  check_example_values(ex);
  parse_ok(ref, k_example);
  ck_assert(dt_jobspec_equal(ex, ref));
  ck_assert_msg(dt_jobspec_validate(ex, err, sizeof err) == 0, "%s", err);

  spec_t *demo = fresh();
  ck_assert_msg(
      dt_jobspec_parse_file(DT_SOURCE_DIR "/deploy/jobs/kjv-demo.yaml", demo, err, sizeof err) == 0,
      "%s", err);
  ck_assert_msg(dt_jobspec_validate(demo, err, sizeof err) == 0, "%s", err);
  ck_assert_str_eq(demo->name, "kjv-demo");
  ck_assert_int_eq(demo->model->layers, 4);
  ck_assert_int_eq(demo->model->heads, 4);
  ck_assert_int_eq(demo->model->channels, 128);
  ck_assert_int_eq(demo->model->vocab, 256);
  ck_assert_int_eq(demo->model->max_seq, 128);
  ck_assert_str_eq(demo->model->init, "seed:1337");
  ck_assert_str_eq(demo->data->train, "data/train_*.bin");
  ck_assert_str_eq(demo->data->val, "data/val.bin");
  ck_assert_int_eq(demo->data->shuffle, 1);
  ck_assert_int_eq(demo->training->batch, 16);
  ck_assert_int_eq(demo->training->seq, 128);
  ck_assert_int_eq(demo->training->steps, 600);
  ck_assert_int_eq(demo->training->micro_batch, 16);
  ck_assert_int_eq(demo->training->sample_every, 200);
  ck_assert_int_eq(demo->training->val_every, 100);
  ck_assert_int_eq(demo->training->val_batches, 10);
  ck_assert(demo->optimizer->lr == 2e-3);
  ck_assert_int_eq(demo->optimizer->warmup, 30);
  ck_assert_str_eq(demo->optimizer->schedule, "cosine");
  ck_assert(demo->optimizer->min_lr_frac == 0.1);
  ck_assert(demo->optimizer->weight_decay == 0.1);
  ck_assert(demo->optimizer->grad_clip == 1.0);
  ck_assert(demo->optimizer->beta2 == 0.95); /* untouched default */
  ck_assert_str_eq(demo->checkpoint->dir, "ckpt");
  ck_assert_int_eq(demo->checkpoint->every, 200);
  ck_assert_int_eq(demo->checkpoint->keep, 2);
  dt_jobspec_free(demo);
  dt_jobspec_free(ex);
  dt_jobspec_free(ref);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Layering and scalar typing                                                                  */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_layering)
{
  spec_t *s = fresh();
  /* Block style; only the named keys change. */
  parse_ok(s, "name: run1\n"
              "model:\n"
              "  layers: 6\n"
              "optimizer:\n"
              "  lr: 1e-3\n");
  ck_assert_str_eq(s->name, "run1");
  ck_assert_int_eq(s->model->layers, 6);
  ck_assert_int_eq(s->model->heads, 4);
  ck_assert_str_eq(s->model->init, "seed:1337");
  ck_assert(s->optimizer->lr == 1e-3);
  ck_assert(s->optimizer->beta2 == 0.95);
  /* A second file on top; then --set on top of both. */
  parse_ok(s, "model: {heads: 8}\nname: run2\n");
  ck_assert_int_eq(s->model->layers, 6);
  ck_assert_int_eq(s->model->heads, 8);
  ck_assert_str_eq(s->name, "run2");
  set_ok(s, "model.layers=12");
  set_ok(s, "name=run3");
  ck_assert_int_eq(s->model->layers, 12);
  ck_assert_str_eq(s->name, "run3");
  /* Empty documents change nothing. */
  spec_t *before = fresh();
  parse_ok(before, "model: {heads: 8, layers: 12}\nname: run3\noptimizer: {lr: 1e-3}\n");
  const char *empties[] = {"", "# only a comment\n", "---\n", "~\n", "--- null\n...\n"};
  for (size_t i = 0; i < sizeof empties / sizeof empties[0]; i++) {
    parse_ok(s, empties[i]);
    ck_assert(dt_jobspec_equal(s, before));
  }
  ck_assert_int_eq(dt_jobspec_parse_yaml(NULL, 0, "job.yaml", s, NULL, 0), 0);
  dt_jobspec_free(before);
  dt_jobspec_free(s);
}
END_TEST

START_TEST(test_scalar_types)
{
  spec_t *s = fresh();
  /* Integers: signs, and the int32 extremes. */
  parse_ok(s, "model: {layers: +7, heads: -2147483648, channels: 2147483647}");
  ck_assert_int_eq(s->model->layers, 7);
  ck_assert_int_eq(s->model->heads, INT32_MIN);
  ck_assert_int_eq(s->model->channels, INT32_MAX);
  /* Numbers: exponents, bare integers, leading/trailing dots. */
  parse_ok(s, "optimizer: {lr: 3e-4, eps: 1.0e-8, beta1: .5, beta2: 5., grad_clip: 2, "
              "weight_decay: -1.5E+2, min_lr_frac: 0.1}");
  ck_assert(s->optimizer->lr == 3e-4);
  ck_assert(s->optimizer->eps == 1e-8);
  ck_assert(s->optimizer->beta1 == 0.5);
  ck_assert(s->optimizer->beta2 == 5.0);
  ck_assert(s->optimizer->grad_clip == 2.0);
  ck_assert(s->optimizer->weight_decay == -150.0);
  ck_assert(s->optimizer->min_lr_frac == 0.1);
  /* Booleans. */
  parse_ok(s, "data: {shuffle: true}");
  ck_assert_int_eq(s->data->shuffle, 1);
  parse_ok(s, "data: {shuffle: FALSE}");
  ck_assert_int_eq(s->data->shuffle, 0);
  parse_ok(s, "data: {shuffle: True}");
  ck_assert_int_eq(s->data->shuffle, 1);
  /* Strings: any scalar; plain null forms are the empty string, quoted ones are text. */
  parse_ok(s, "name: 123\ndata: {train: 'a b.bin', val: ~}\ncheckpoint: {dir: true}\n");
  ck_assert_str_eq(s->name, "123");
  ck_assert_str_eq(s->data->train, "a b.bin");
  ck_assert_str_eq(s->data->val, "");
  ck_assert_str_eq(s->checkpoint->dir, "true");
  parse_ok(s, "data: {val: \"null\", train: \"\"}\nname:\n");
  ck_assert_str_eq(s->data->val, "null");
  ck_assert_str_eq(s->data->train, "");
  ck_assert_str_eq(s->name, "");
  parse_ok(s, "name: |\n  two\n  lines\nmodel: {init: \"llmc:/w/gpt2 124M.bin\"}\n");
  ck_assert_str_eq(s->name, "two\nlines\n");
  ck_assert_str_eq(s->model->init, "llmc:/w/gpt2 124M.bin");
  parse_ok(s, "name: \"caf\\u00e9 \\\"q\\\"\"\n");
  ck_assert_str_eq(s->name, "caf\xc3\xa9 \"q\"");
  /* Anchors and aliases are plain YAML and resolve to their value. */
  parse_ok(s, "training: {batch: &b 32, micro_batch: *b}\n");
  ck_assert_int_eq(s->training->batch, 32);
  ck_assert_int_eq(s->training->micro_batch, 32);
  dt_jobspec_free(s);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Reader errors                                                                               */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_error_unknown_keys)
{
  parse_fails("model: {layers: 4}\noptimiser: {lr: 1}\n", 2, "unknown key 'optimiser'",
              "did you mean 'optimizer'?",
              "expected one of: name, model, data, training, optimizer, parallel, checkpoint, "
              "elastic",
              NULL);
  parse_fails("model:\n  layers: 4\n  layer: 5\n", 3, "unknown key 'model.layer'",
              "did you mean 'model.layers'?",
              "expected one of: layers, heads, channels, vocab, max_seq, init", NULL);
  /* No hint when nothing is close. */
  parse_fails("\n\ntraining:\n  batch: 4\n  flux_capacitor: 1\n", 5,
              "unknown key 'training.flux_capacitor' (expected one of: batch, seq, steps", NULL);
  /* Keys are case-sensitive. */
  parse_fails("Model: {layers: 4}\n", 1, "unknown key 'Model'", NULL);
  /* The key must be a scalar. */
  parse_fails("? [a, b]\n: 1\n", 1, "top level: keys must be plain words, got a sequence", NULL);
  parse_fails("model:\n  ? {a: 1}\n  : 2\n", 2, "model: keys must be plain words, got a mapping",
              NULL);
}
END_TEST

START_TEST(test_error_types)
{
  parse_fails("model:\n  heads: 4\n  layers: four\n", 3,
              "model.layers: expected an integer, got 'four'", NULL);
  parse_fails("model: {layers: 4.0}", 1, "model.layers: expected an integer, got '4.0'", NULL);
  parse_fails("model: {layers: 1e3}", 1, "model.layers: expected an integer, got '1e3'", NULL);
  parse_fails("model: {layers: 0x10}", 1, "model.layers: expected an integer, got '0x10'", NULL);
  parse_fails("model: {layers: \"4\"}", 1,
              "model.layers: expected an integer, got the quoted string '4'", NULL);
  parse_fails("model:\n  layers:\n", 2, "model.layers: expected an integer, got an empty value",
              NULL);
  parse_fails("model: {layers: 2147483648}", 1,
              "model.layers: 2147483648 does not fit a 32-bit integer", NULL);
  parse_fails("model: {layers: -2147483649}", 1, "model.layers: -2147483649 does not fit", NULL);
  parse_fails("model: {layers: 99999999999999999999999}", 1,
              "model.layers: 99999999999999999999999 does not fit a 32-bit integer", NULL);
  parse_fails("\noptimizer:\n  lr: fast\n", 3, "optimizer.lr: expected a number, got 'fast'", NULL);
  parse_fails("optimizer: {lr: .inf}", 1, "optimizer.lr: expected a number, got '.inf'", NULL);
  parse_fails("optimizer: {lr: nan}", 1, "optimizer.lr: expected a number, got 'nan'", NULL);
  parse_fails("optimizer: {lr: 0x1p3}", 1, "optimizer.lr: expected a number, got '0x1p3'", NULL);
  parse_fails("optimizer: {lr: 1e}", 1, "optimizer.lr: expected a number, got '1e'", NULL);
  parse_fails("optimizer: {lr: 1,5}", 1, "unknown key 'optimizer.5'", NULL);
  parse_fails("optimizer: {lr: '3e-4'}", 1, "optimizer.lr: expected a number, got the quoted",
              NULL);
  parse_fails("optimizer: {lr: 1e999}", 1, "optimizer.lr: 1e999 is out of range", NULL);
  parse_fails("optimizer: {lr: -1e999}", 1, "optimizer.lr: -1e999 is out of range", NULL);
  parse_fails("data:\n  shuffle: yes\n", 2, "data.shuffle: expected true or false, got 'yes'",
              NULL);
  parse_fails("data: {shuffle: 1}", 1, "data.shuffle: expected true or false, got '1'", NULL);
  parse_fails("data: {shuffle: \"true\"}", 1, "data.shuffle: expected true or false, got the",
              NULL);
  /* Collections where a scalar belongs, and the other way round. */
  parse_fails("model:\n  layers: {a: 1}\n", 2, "model.layers: expected an integer, got a mapping",
              NULL);
  parse_fails("data:\n  train: [a.bin, b.bin]\n", 2,
              "data.train: expected a string, got a sequence", NULL);
  parse_fails("name: {first: a}\n", 1, "name: expected a string, got a mapping", NULL);
  parse_fails("model: 4\n", 1,
              "model: expected a mapping (with keys among: layers, heads, channels, vocab, "
              "max_seq, init), got '4'",
              NULL);
  parse_fails("data: [1, 2]\n", 1, "data: expected a mapping", "got a sequence", NULL);
  parse_fails("elastic:\n", 1, "elastic: expected a mapping", "got an empty value", NULL);
  parse_fails("- model\n- data\n", 1, "expected a mapping with keys among: name, model",
              "got a sequence", NULL);
  parse_fails("hello\n", 1, "got 'hello'", NULL);
  parse_fails("name: \"a\\0b\"\n", 1, "name: the string contains a NUL character", NULL);
}
END_TEST

START_TEST(test_error_duplicates)
{
  parse_fails("model:\n  layers: 4\n  layers: 5\n", 3,
              "duplicate key 'model.layers' (first given at line 2)", NULL);
  parse_fails("model: {layers: 4}\ndata: {}\nmodel: {heads: 2}\n", 3,
              "duplicate key 'model' (first given at line 1)", NULL);
  parse_fails("name: a\n\n\nname: b\n", 4, "duplicate key 'name' (first given at line 1)", NULL);
  parse_fails("optimizer: {lr: 1, lr: 2}\n", 1, "duplicate key 'optimizer.lr'", NULL);
}
END_TEST

START_TEST(test_error_syntax)
{
  parse_fails("model:\n  layers: 4\n heads: 4\n", 3, "YAML syntax error",
              "did not find expected key", "line 1", NULL);
  parse_fails("model: {layers: 4\n", 2, "YAML syntax error", "flow mapping at line 1", NULL);
  parse_fails("model:\n  layers: 4\ndata: {train: \"x}\n", 4, "YAML syntax error",
              "quoted scalar at line 3", NULL);
  parse_fails("model:\n\tlayers: 4\n", 2, "YAML syntax error", "cannot start any token", NULL);
  parse_fails("a: b: c\n", 1, "YAML syntax error: mapping values are not allowed", NULL);
  parse_fails("model: *nowhere\n", 1, "YAML syntax error: found undefined alias", NULL);
  parse_fails("model: {}\n---\ndata: {}\n", 3, "expected one YAML document, found a second one",
              NULL);
  /* A syntax error in a later document is still reported. */
  parse_fails("model: {}\n---\ndata: {\n", 4, "YAML syntax error", NULL);
  /* Invalid UTF-8 has no line: libyaml reports the byte offset. */
  parse_fails("name: \xff\xfe\n", 0, "YAML reader error at byte", NULL);
}
END_TEST

/* Deep nesting is refused before libyaml builds the document (whose cost grows with the square
 * of the depth: a 1 MB nested file took minutes; Check's 4 s timeout fails this test then). */
static char *nested(size_t depth)
{
  char *t = malloc(2 * depth + 8);
  ck_assert_ptr_nonnull(t);
  memcpy(t, "name: ", 6);
  memset(t + 6, '[', depth);
  memset(t + 6 + depth, ']', depth);
  memcpy(t + 6 + 2 * depth, "\n", 2);
  return t;
}

START_TEST(test_error_nesting)
{
  char *ok = nested(31), *deep = nested(32), *huge = nested(500000);
  parse_fails(ok, 1, "name: expected a string", NULL); /* 32 levels with the root: parsed */
  parse_fails(deep, 1, "YAML nested more than 32 levels deep (a job spec needs 3)", NULL);
  parse_fails(huge, 1, "YAML nested more than 32 levels deep", NULL);
  free(ok), free(deep), free(huge);
}
END_TEST

/* A failed parse leaves the spec exactly as it was, even when earlier keys were fine. */
START_TEST(test_error_leaves_spec_alone)
{
  spec_t *s = fresh(), *ref = fresh();
  char err[512];
  const char *text = "model: {layers: 9}\nname: x\ndata: {shuffle: maybe}\n";
  ck_assert_int_eq(dt_jobspec_parse_yaml(text, strlen(text), NULL, s, err, sizeof err), DT_EINVAL);
  ck_assert_str_eq(err, "<string>:3: data.shuffle: expected true or false, got 'maybe'");
  ck_assert(dt_jobspec_equal(s, ref));
  ck_assert_int_eq(s->model->layers, 4);
  /* A tiny or absent error buffer is fine. */
  ck_assert_int_eq(dt_jobspec_parse_yaml(text, strlen(text), "j", s, err, 4), DT_EINVAL);
  ck_assert_str_eq(err, "j:3");
  ck_assert_int_eq(dt_jobspec_parse_yaml(text, strlen(text), "j", s, NULL, 0), DT_EINVAL);
  dt_jobspec_free(s);
  dt_jobspec_free(ref);
}
END_TEST

START_TEST(test_parse_file)
{
  char dir[256], path[512], err[1024];
  ut_mkdtemp(dir, sizeof dir);
  spec_t *s = fresh();
  snprintf(path, sizeof path, "%s/missing.yaml", dir);
  ck_assert_int_eq(dt_jobspec_parse_file(path, s, err, sizeof err), DT_ENOENT);
  ck_assert_ptr_nonnull(strstr(err, path));
  ck_assert_ptr_nonnull(strstr(err, "cannot open"));

  snprintf(path, sizeof path, "%s/job.yaml", dir);
  FILE *fp = fopen(path, "w");
  ck_assert_ptr_nonnull(fp);
  fputs("# a job\nmodel:\n  layers: 2\n  heads: two\n", fp);
  fclose(fp);
  ck_assert_int_eq(dt_jobspec_parse_file(path, s, err, sizeof err), DT_EINVAL);
  char want[600];
  snprintf(want, sizeof want, "%s:4: model.heads: expected an integer, got 'two'", path);
  ck_assert_str_eq(err, want);

  fp = fopen(path, "w");
  fputs(k_example, fp);
  fclose(fp);
  ck_assert_int_eq(dt_jobspec_parse_file(path, s, err, sizeof err), 0);
  check_example_values(s);

  /* A directory is not a spec. */
  ck_assert_int_lt(dt_jobspec_parse_file(dir, s, err, sizeof err), 0);
  ck_assert_ptr_nonnull(strstr(err, dir));
  dt_jobspec_free(s);
  ut_rm_rf(dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* --set                                                                                       */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_set)
{
  spec_t *s = fresh();
  set_ok(s, "model.layers=6");
  set_ok(s, "optimizer.lr=1e-3");
  set_ok(s, "data.shuffle=true");
  set_ok(s, "data.train=data/train_*.bin");
  set_ok(s, "name=run=7"); /* only the first '=' splits */
  set_ok(s, "model.init=llmc:/w/gpt2_124M.bin");
  set_ok(s, "parallel.schedule=gpipe");
  ck_assert_int_eq(s->model->layers, 6);
  ck_assert(s->optimizer->lr == 1e-3);
  ck_assert_int_eq(s->data->shuffle, 1);
  ck_assert_str_eq(s->data->train, "data/train_*.bin");
  ck_assert_str_eq(s->name, "run=7");
  /* A blend is a string like any other, and validates. */
  set_ok(s, "data.train=0.7:web/train_*.bin,0.3:/data/code.bin");
  ck_assert_str_eq(s->data->train, "0.7:web/train_*.bin,0.3:/data/code.bin");
  char why[1024];
  ck_assert_msg(dt_jobspec_validate(s, why, sizeof why) == 0, "%s", why);
  /* So are validation sets, validated every training.val_every steps. */
  set_ok(s, "data.val_sets=web=web/val_*.bin,code.v2=/data/code_val.bin");
  set_ok(s, "training.val_every=10");
  ck_assert_msg(dt_jobspec_validate(s, why, sizeof why) == 0, "%s", why);
  ck_assert_str_eq(s->model->init, "llmc:/w/gpt2_124M.bin");
  ck_assert_str_eq(s->parallel->schedule, "gpipe");
  /* Strings are taken literally: empty clears, "null" is text. */
  set_ok(s, "data.val=");
  ck_assert_str_eq(s->data->val, "");
  set_ok(s, "data.val=null");
  ck_assert_str_eq(s->data->val, "null");
  set_ok(s, "data.val= spaced ");
  ck_assert_str_eq(s->data->val, " spaced ");
  dt_jobspec_free(s);

  /* A spec with sections missing (as off the wire) gets the section created. */
  spec_t *bare = distrain__v1__job_spec__unpack(NULL, 0, (const uint8_t *)"");
  ck_assert_ptr_nonnull(bare);
  ck_assert_ptr_null(bare->model);
  set_ok(bare, "model.layers=3");
  ck_assert_ptr_nonnull(bare->model);
  ck_assert_int_eq(bare->model->layers, 3);
  ck_assert_int_eq(bare->model->heads, 0);
  char err[256];
  ck_assert_int_eq(dt_jobspec_validate(bare, err, sizeof err), DT_EINVAL);
  ck_assert_ptr_nonnull(strstr(err, "section 'data' is missing"));
  ck_assert_ptr_null(strstr(err, "section 'model' is missing"));
  parse_ok(bare, "optimizer: {lr: 1}\n");
  ck_assert_ptr_nonnull(bare->optimizer);
  dt_jobspec_free(bare);
}
END_TEST

START_TEST(test_set_errors)
{
  set_fails("model.layers=four",
            "--set model.layers=four: model.layers: expected an integer, "
            "got 'four'",
            NULL);
  set_fails("optimizer.lr2=1", "--set optimizer.lr2=1: unknown key 'optimizer.lr2'",
            "did you mean 'optimizer.lr'?", "expected one of: lr, warmup, schedule", NULL);
  set_fails("optimiser.lr=1", "unknown key 'optimiser'", "did you mean 'optimizer'?", NULL);
  set_fails("model.layers=", "model.layers: expected an integer, got an empty value", NULL);
  set_fails("model.layers=3000000000", "does not fit a 32-bit integer", NULL);
  set_fails("optimizer.lr=1e-3x", "optimizer.lr: expected a number, got '1e-3x'", NULL);
  set_fails("data.shuffle=yes", "data.shuffle: expected true or false, got 'yes'", NULL);
  set_fails("model=4", "'model' is a section; set one of its keys (model.KEY=VALUE): layers", NULL);
  set_fails("name.first=a", "'name' is a single value, not a section", NULL);
  set_fails("model.layers.x=1", "'model.layers' is a single value, not a section", NULL);
  set_fails("model.layers", "--set model.layers: expected section.key=value", NULL);
  set_fails("=5", "expected section.key=value", NULL);
  set_fails("model..layers=1", "empty key component", NULL);
  set_fails(".layers=1", "empty key component", NULL);
  set_fails("model.=1", "empty key component", NULL);
  /* Strings are UTF-8 (YAML's and protobuf's encoding): a shell's raw byte is refused, or the
   * spec would reach the coordinator and never print back as YAML. */
  set_fails("checkpoint.dir=/tmp/x\x8a", "checkpoint.dir: the string is not valid UTF-8", NULL);
  set_fails("name=\xc0\xaf", "name: the string is not valid UTF-8", NULL);     /* overlong '/' */
  set_fails("name=\xed\xa0\x80", "name: the string is not valid UTF-8", NULL); /* surrogate */
  set_fails("name=\xf4\x90\x80\x80", "not valid UTF-8", NULL);                 /* > U+10FFFF */
  set_fails("name=\xe2\x82", "not valid UTF-8", NULL);                         /* truncated */
  spec_t *u = fresh();
  set_ok(u, "name=r\xc3\xa9sum\xc3\xa9-\xe2\x82\xac-\xf0\x9f\x9a\x80");
  ck_assert_str_eq(u->name, "r\xc3\xa9sum\xc3\xa9-\xe2\x82\xac-\xf0\x9f\x9a\x80");
  dt_jobspec_free(u);
  /* A failed --set changes nothing. */
  spec_t *s = fresh(), *ref = fresh();
  char err[256];
  ck_assert_int_eq(dt_jobspec_set(s, "training.batch=big", err, sizeof err), DT_EINVAL);
  ck_assert(dt_jobspec_equal(s, ref));
  dt_jobspec_free(s);
  dt_jobspec_free(ref);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Validation                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* Each rule alone: the overrides break exactly that rule of a valid spec, and the message names
 * the rule and the values. */
static const struct {
  const char *sets[6];
  const char *want;
} k_rules[] = {
    {{"model.layers=0"}, "model.layers (0) must be > 0"},
    {{"model.heads=-1"}, "model.heads (-1) must be > 0"},
    {{"model.channels=0"}, "model.channels (0) must be > 0"},
    {{"model.max_seq=0"}, "model.max_seq (0) must be > 0"},
    {{"model.layers=4097"}, "model.layers (4097) must be <= 4096"},
    {{"model.channels=131584", "model.heads=1"}, "model.channels (131584) must be <= 131072"},
    {{"model.max_seq=16777217", "training.seq=256"},
     "model.max_seq (16777217) must be <= 16777216"},
    {{"model.vocab=1"}, "model.vocab (1) must be in [2, 65536]"},
    {{"model.vocab=65537"}, "model.vocab (65537) must be in [2, 65536]"},
    {{"model.channels=250"}, "model.channels (250) must be divisible by model.heads (4)"},
    {{"model.init=seed:x"},
     "model.init must be seed:N (N >= 0), llmc:PATH, hf:DIR, ckpt:DIR or a checkpoint path, "
     "got 'seed:x'"},
    {{"model.init=seed:-1"}, "model.init must be seed:N"},
    {{"model.init=llmc:"}, "model.init must be seed:N"},
    {{"model.init=hf:"}, "model.init must be seed:N"},
    {{"model.init=ckpt:"}, "model.init must be seed:N"},
    {{"model.init="}, "model.init must be seed:N"},
    {{"data.train="}, "data.train must name the training shards"},
    {{"data.train=0.7:web/*.bin,0:code.bin"},
     "data.train: blend source 2 ('0:code.bin'): the weight must be a positive number (a blend "
     "is WEIGHT:GLOB,WEIGHT:GLOB,...)"},
    {{"data.train=0.7:web/*.bin,code.bin"}, "data.train: blend source 2 ('code.bin') is not"},
    {{"data.val=1:val.bin,v2.bin"}, "data.val: blend source 2 ('v2.bin') is not WEIGHT:GLOB"},
    {{"data.val_sets=web=w.bin,c.bin", "training.val_every=10"},
     "data.val_sets: validation set 2 ('c.bin') is not NAME=GLOB (validation sets are "
     "NAME=GLOB,NAME=GLOB,...)"},
    {{"data.val_sets=web=w.bin,web=c.bin", "training.val_every=10"},
     "data.val_sets: validation set 2: the name 'web' is used twice"},
    {{"data.val_sets=a b=w.bin", "training.val_every=10"},
     "data.val_sets: validation set 1 ('a b=w.bin'): a name is 1 to 31 letters"},
    {{"data.val_sets=web=w.bin"}, "data.val_sets needs training.val_every"},
    {{"training.batch=0"}, "training.batch (0) must be > 0"},
    {{"training.seq=0"}, "training.seq (0) must be > 0"},
    {{"training.steps=0"}, "training.steps (0) must be > 0"},
    {{"training.micro_batch=0"}, "training.micro_batch (0) must be > 0"},
    {{"training.val_batches=0"}, "training.val_batches (0) must be > 0"},
    {{"training.val_every=-1"}, "training.val_every (-1) must be >= 0"},
    {{"training.threads=-2"}, "training.threads (-2) must be >= 0"},
    {{"training.device=tpu"}, "training.device must be auto, cpu or cuda, got 'tpu'"},
    {{"training.precision=fp16"}, "training.precision must be fp32 or bf16, got 'fp16'"},
    {{"training.attention=sdpa"}, "training.attention must be flash or materialized, got 'sdpa'"},
    {{"training.profile=0"},
     "training.profile must be S or S:N (N >= 1 steps from step S >= 1), got '0'"},
    {{"training.profile=5:0"},
     "training.profile must be S or S:N (N >= 1 steps from step S >= 1), got '5:0'"},
    {{"training.profile=soon"},
     "training.profile must be S or S:N (N >= 1 steps from step S >= 1), got 'soon'"},
    {{"training.profile=201"},
     "training.profile starts at step 201, after the last (training.steps 200)"},
    {{"parallel.comm=mpi"}, "parallel.comm must be auto, cpu or nccl, got 'mpi'"},
    {{"parallel.comm=nccl", "training.device=cpu"},
     "parallel.comm nccl needs GPUs: training.device is cpu"},
    {{"training.seq=512"}, "training.seq (512) must be <= model.max_seq (256)"},
    {{"training.val_every=50"}, "training.val_every (50) needs data.val or data.val_sets"},
    {{"training.eval_every=-2"}, "training.eval_every (-2) must be >= 0 (0: data.eval before"},
    {{"training.eval_every=50"}, "training.eval_every (50) needs data.eval"},
    {{"training.prompt=Once upon"}, "training.prompt needs training.sample"},
    {{"data.merge_file=merges.txt"}, "data.merge_file needs data.vocab_file"},
    {{"training.prompt=Once upon", "training.sample=20", "data.vocab_file=vocab.json"},
     "training.prompt with data.vocab_file needs data.merge_file"},
    {{"training.peak_tflops=-1"}, "training.peak_tflops (-1) must be a device's peak TFLOP/s"},
    {{"training.sample_top_k=-1", "training.sample=5"}, "training.sample_top_k (-1) must be >= 0"},
    {{"training.sample_temp=-1", "training.sample=5"},
     "training.sample_temp (-1) must be > 0 and a finite float"},
    {{"training.sample_temp=1e39", "training.sample=5"}, "training.sample_temp (1e+39) must be"},
    {{"training.sample_temp=1e-50", "training.sample=5"}, "training.sample_temp (1e-50) must be"},
    {{"training.sample_top_p=1.5", "training.sample=5"},
     "training.sample_top_p (1.5) must be in (0, 1]"},
    {{"training.sample_top_p=1e-50", "training.sample=5"}, "training.sample_top_p (1e-50) must"},
    {{"training.sample_top_k=40"},
     "training.sample_temp, sample_top_k and sample_top_p need training.sample"},
    {{"training.sample_temp=1.2"}, "training.sample_temp, sample_top_k and sample_top_p need"},
    {{"training.sample_every=-1", "training.sample=5"},
     "training.sample_every (-1) must be >= 0 (0: a sample at the end only)"},
    {{"training.sample_every=100"}, "training.sample_every needs training.sample"},
    {{"training.sample_every=100", "training.sample=5", "data.val="},
     "training.sample_every needs training.prompt or data.val: the samples' prompt"},
    {{"optimizer.lr=-0.1"}, "optimizer.lr (-0.1) must be >= 0"},
    {{"optimizer.warmup=-1"}, "optimizer.warmup (-1) must be >= 0"},
    {{"optimizer.schedule=step"},
     "optimizer.schedule must be cosine, constant, linear or wsd, got 'step'"},
    {{"optimizer.decay_frac=-0.5"}, "optimizer.decay_frac (-0.5) must be in (0, 1]"},
    {{"optimizer.decay_frac=1.5"}, "optimizer.decay_frac (1.5) must be in (0, 1]"},
    {{"optimizer.min_lr_frac=1.5"}, "optimizer.min_lr_frac (1.5) must be in [0, 1]"},
    {{"optimizer.weight_decay=-1"}, "optimizer.weight_decay (-1) must be >= 0"},
    {{"optimizer.beta1=1"}, "optimizer.beta1 (1) must be in [0, 1)"},
    {{"optimizer.beta2=-0.5"}, "optimizer.beta2 (-0.5) must be in [0, 1)"},
    {{"optimizer.eps=0"}, "optimizer.eps (0) must be > 0"},
    {{"optimizer.grad_clip=-1"}, "optimizer.grad_clip (-1) must be >= 0"},
    /* rounded to the trainer's floats (found by tests/fuzz: the spec validated, then every
     * trainer refused its flags) */
    {{"optimizer.eps=1e-50"}, "optimizer.eps (1e-50) must be > 0 and a finite float"},
    {{"optimizer.beta1=0.99999999999"}, "optimizer.beta1 (0.99999999999) must be in [0, 1), also"},
    {{"optimizer.weight_decay=1e300"}, "optimizer.weight_decay (1e+300) must be >= 0 and a finite"},
    {{"optimizer.grad_clip=1e39"}, "optimizer.grad_clip (1e+39) must be >= 0"},
    {{"parallel.dp=0"}, "parallel.dp (0) must be > 0"},
    {{"parallel.tp=0"}, "parallel.tp (0) must be > 0"},
    {{"parallel.pp=0"}, "parallel.pp (0) must be > 0"},
    {{"parallel.cp=0"}, "parallel.cp (0) must be > 0"},
    {{"parallel.zero_stage=4"}, "parallel.zero_stage (4) must be in 0..3"},
    {{"parallel.zero_stage=-1"}, "parallel.zero_stage (-1) must be in 0..3"},
    {{"parallel.schedule=zb-v"},
     "parallel.schedule must be 1f1b, gpipe or interleaved, got 'zb-v'"},
    {{"parallel.schedule=interleaved"},
     "parallel.schedule interleaved needs parallel.pp >= 2 (got 1) and parallel.virtual_stages "
     ">= 2 (got 2)"},
    {{"parallel.virtual_stages=2"},
     "parallel.virtual_stages (2) > 1 needs parallel.schedule interleaved"},
    {{"parallel.virtual_stages=-1"}, "parallel.virtual_stages (-1) must be in 0..16"},
    {{"parallel.schedule=interleaved", "parallel.pp=2", "parallel.virtual_stages=4",
      "training.micro_batch=2"},
     "model.layers (4) must be >= parallel.pp x parallel.virtual_stages (8)"},
    {{"parallel.schedule=interleaved", "parallel.pp=2"},
     "parallel.schedule interleaved: the micro-batches per step (training.batch 8 / (micro_batch "
     "8 x dp 1)) must be a multiple of parallel.pp (2)"},
    {{"model.heads=6", "model.channels=240", "parallel.tp=4"},
     "model.heads (6) must be divisible by parallel.tp (4)"},
    {{"model.vocab=100", "parallel.tp=256", "model.heads=256", "model.channels=256"},
     "the padded vocabulary (model.vocab 100 padded to 128) must be divisible by parallel.tp "
     "(256)"},
    {{"parallel.pp=2", "parallel.partition=3,3"},
     "parallel.partition '3,3' gives 2 stages 6 layers: it must give each of the 2 stages its "
     "layers and cover all 4"},
    {{"parallel.pp=2", "parallel.partition=4,x"},
     "parallel.partition '4,x': expected 2 positive layer counts separated by commas"},
    {{"parallel.pp=8"}, "model.layers (4) must be >= parallel.pp x parallel.virtual_stages (8)"},
    {{"parallel.dp=3"},
     "training.batch (8) must be divisible by training.micro_batch (8) x parallel.dp (3) = 24"},
    {{"training.micro_batch=3"},
     "training.batch (8) must be divisible by training.micro_batch (3) x parallel.dp (1) = 3"},
    {{"parallel.cp=3"}, "training.seq (256) must be divisible by 2 x parallel.cp (3)"},
    {{"model.layers=4096", "parallel.pp=4096", "model.max_seq=2097152", "training.seq=2097152",
      "parallel.cp=1048576"},
     "parallel: world size pp (4096) x dp (1) x cp (1048576) x tp (1) is too large"},
    {{"training.sample=10", "parallel.tp=4", "parallel.sequence_parallel=true", "training.seq=254"},
     "training.sample (10) with parallel.sequence_parallel needs training.seq (254) divisible by "
     "parallel.tp = 4: each window of text is split as a training sequence"},
    {{"training.sample=10", "parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true",
      "training.seq=252"},
     "training.sample (10) with parallel.sequence_parallel needs training.seq (252) divisible by "
     "2 x parallel.cp x parallel.tp = 8"},
    {{"checkpoint.dir="}, "checkpoint.dir must name a directory"},
    {{"checkpoint.every=-1"}, "checkpoint.every (-1) must be >= 0"},
    {{"checkpoint.keep=-1"}, "checkpoint.keep (-1) must be >= 0"},
    {{"checkpoint.every_s=-1"}, "checkpoint.every_s (-1) must be >= 0 (0: saves by steps only)"},
    {{"checkpoint.keep_every=-1"}, "checkpoint.keep_every (-1) must be >= 0"},
    {{"checkpoint.keep_every=150", "checkpoint.every=100"},
     "checkpoint.keep_every (150) must be a multiple of checkpoint.every (100): only the steps "
     "saved can be kept"},
    {{"checkpoint.keep_every=100", "checkpoint.every=0"},
     "checkpoint.keep_every (100) must be a multiple of checkpoint.every (0)"},
    {{"checkpoint.last_save_wait_s=-2"},
     "checkpoint.last_save_wait_s (-2) must be in [1, 86400] s, or 0 (the default, 600) or -1 (a "
     "last save that finds its disk full fails the job at once)"},
    {{"checkpoint.last_save_wait_s=86401"}, "checkpoint.last_save_wait_s (86401) must be in"},
    {{"elastic.min_nodes=0"}, "elastic.min_nodes (0) must be >= 1"},
    {{"elastic.min_nodes=3", "elastic.max_nodes=2"},
     "elastic.max_nodes (2) must be >= elastic.min_nodes (3)"},
    {{"elastic.max_restarts=-1"}, "elastic.max_restarts (-1) must be >= 0"},
    {{"elastic.heartbeat_ms=49"}, "elastic.heartbeat_ms (49) must be >= 50"},
    {{"elastic.hang_timeout_s=-1"}, "elastic.hang_timeout_s (-1) must be in [1, 86400]"},
    {{"elastic.spike_factor=1"}, "elastic.spike_factor (1) must be > 1 (0: off)"},
    {{"elastic.spike_factor=-2"}, "elastic.spike_factor (-2) must be > 1 (0: off)"},
    {{"elastic.spike_factor=1e300"}, "elastic.spike_factor (1e+300) must be > 1 (0: off)"},
    {{"elastic.spike_factor=3", "elastic.spike_skip=-1"},
     "elastic.spike_skip (-1) must be in [1, 10000] (0: 1)"},
    {{"elastic.spike_factor=3", "elastic.spike_skip=10001"},
     "elastic.spike_skip (10001) must be in [1, 10000] (0: 1)"},
    {{"elastic.spike_skip=2"},
     "elastic.spike_skip (2) needs elastic.spike_factor or elastic.grad_spike_factor"},
    {{"elastic.grad_spike_factor=0.5"}, "elastic.grad_spike_factor (0.5) must be > 1 (0: off)"},
    {{"elastic.bad_step=retry"}, "elastic.bad_step must be rollback or skip, got 'retry'"},
    {{"elastic.straggler_drain_s=-1"},
     "elastic.straggler_drain_s (-1) must be in [1, 604800] (0: off)"},
    {{"elastic.straggler_drain_s=604801"},
     "elastic.straggler_drain_s (604801) must be in [1, 604800] (0: off)"},
    {{"elastic.priority=-1001"}, "elastic.priority (-1001) must be in [-1000, 1000]"},
    {{"elastic.priority=1001"}, "elastic.priority (1001) must be in [-1000, 1000]"},
};

START_TEST(test_validate_rules)
{
  for (size_t i = 0; i < sizeof k_rules / sizeof k_rules[0]; i++) {
    spec_t *s = valid_spec();
    for (int k = 0; k < 6 && k_rules[i].sets[k]; k++)
      set_ok(s, k_rules[i].sets[k]);
    char err[1024];
    int rc = dt_jobspec_validate(s, err, sizeof err);
    ck_assert_msg(rc == DT_EINVAL, "rule %zu (%s) not enforced", i, k_rules[i].want);
    /* Exactly one violation: no "; " separator, and it is the expected one. */
    ck_assert_msg(strncmp(err, k_rules[i].want, strlen(k_rules[i].want)) == 0 && !strstr(err, "; "),
                  "rule %zu: got '%s', want '%s'", i, err, k_rules[i].want);
    dt_jobspec_free(s);
  }
}
END_TEST

START_TEST(test_validate_accepts)
{
  /* Shapes the trainer does not run yet are the trainer's call, not the spec's. */
  static const char *const ok[][6] = {
      {"parallel.tp=4", "parallel.pp=2", "parallel.cp=2", "parallel.dp=2", "training.batch=16",
       "training.micro_batch=4"},
      {"parallel.zero_stage=3", "parallel.schedule=gpipe", "optimizer.schedule=constant"},
      {"optimizer.schedule=linear"},
      {"optimizer.schedule=wsd", "optimizer.decay_frac=1"},
      {"training.sample=10", "parallel.pp=2", "parallel.tp=2"}, /* generation through a pipeline */
      {"model.init=llmc:/weights/gpt2_124M.bin", "model.vocab=50257", "model.max_seq=1024"},
      {"model.init=/ckpt/run1", "data.val=val.bin", "training.val_every=10"},
      {"model.init=seed:0", "optimizer.lr=0", "optimizer.grad_clip=0", "checkpoint.every=0",
       "checkpoint.keep=0"},
      {"model.vocab=2", "model.vocab=65536", "elastic.heartbeat_ms=50", "elastic.max_nodes=64"},
  };
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    spec_t *s = valid_spec();
    for (int k = 0; k < 6 && ok[i][k]; k++)
      set_ok(s, ok[i][k]);
    char err[1024];
    ck_assert_msg(dt_jobspec_validate(s, err, sizeof err) == 0, "case %zu: %s", i, err);
    ck_assert_str_eq(err, "");
    dt_jobspec_free(s);
  }
}
END_TEST

START_TEST(test_validate_reports_all)
{
  spec_t *s = fresh(); /* no data.train */
  set_ok(s, "model.heads=3");
  set_ok(s, "elastic.heartbeat_ms=10");
  char err[2048];
  ck_assert_int_eq(dt_jobspec_validate(s, err, sizeof err), DT_EINVAL);
  ck_assert_str_eq(err, "model.channels (256) must be divisible by model.heads (3); data.train "
                        "must name the training shards (a file or a glob); elastic.heartbeat_ms "
                        "(10) must be >= 50");
  /* Strings off the wire are checked too (protobuf-c does not). */
  spec_t *w = fresh();
  set_ok(w, "data.train=x");
  set_ok(w, "data.val=v"); /* on the heap, as unpack leaves a non-empty string */
  free(w->data->val);
  w->data->val = strdup("v\xff");
  ck_assert_int_eq(dt_jobspec_validate(w, err, sizeof err), DT_EINVAL);
  ck_assert_str_eq(err, "data.val is not valid UTF-8");
  dt_jobspec_free(w);
  /* A short buffer holds the first violations, NUL-terminated. */
  char small[20];
  ck_assert_int_eq(dt_jobspec_validate(s, small, sizeof small), DT_EINVAL);
  ck_assert_str_eq(small, "model.channels (256");
  ck_assert_int_eq(dt_jobspec_validate(s, NULL, 0), DT_EINVAL);
  ck_assert_int_eq(dt_jobspec_validate(NULL, err, sizeof err), DT_EINVAL);
  /* NaN from the wire is caught by the range rules. */
  s->optimizer->lr = NAN;
  s->optimizer->beta1 = NAN;
  ck_assert_int_eq(dt_jobspec_validate(s, err, sizeof err), DT_EINVAL);
  ck_assert_ptr_nonnull(strstr(err, "optimizer.lr (nan) must be >= 0"));
  ck_assert_ptr_nonnull(strstr(err, "optimizer.beta1 (nan) must be in [0, 1)"));
  dt_jobspec_free(s);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* YAML output                                                                                 */
/* ------------------------------------------------------------------------------------------ */

/* to_yaml then parse onto a spec whose every field differs gives back an equal spec (so every
 * field is written and read). */
static void check_roundtrip(const spec_t *s)
{
  char *y = NULL, err[1024];
  ck_assert_int_eq(dt_jobspec_to_yaml(s, &y), 0);
  ck_assert_ptr_nonnull(y);
  spec_t *back = fresh();
  parse_ok(back, "name: other\n"
                 "model: {layers: 1, heads: 1, channels: 1, vocab: 1, max_seq: 1, init: x}\n"
                 "data: {train: x, val: x, shuffle: true}\n"
                 "training: {batch: 1, seq: 1, steps: 1, micro_batch: 1, val_every: 1, "
                 "val_batches: 1, threads: 1}\n"
                 "optimizer: {lr: 9, warmup: 9, schedule: x, min_lr_frac: 9, weight_decay: 9, "
                 "beta1: 9, beta2: 9, eps: 9, grad_clip: 9}\n"
                 "parallel: {dp: 9, tp: 9, pp: 9, cp: 9, zero_stage: 9, schedule: x}\n"
                 "checkpoint: {dir: x, every: 9, keep: 9}\n"
                 "elastic: {min_nodes: 9, max_nodes: 9, max_restarts: 9, heartbeat_ms: 9}\n");
  int rc = dt_jobspec_parse_yaml(y, strlen(y), "roundtrip", back, err, sizeof err);
  ck_assert_msg(rc == 0, "%s\n%s", err, y);
  ck_assert_msg(dt_jobspec_equal(s, back), "round trip differs:\n%s", y);
  dt_jobspec_free(back);
  free(y);
}

START_TEST(test_yaml_roundtrip)
{
  spec_t *s = fresh();
  check_roundtrip(s);
  parse_ok(s, k_example);
  check_roundtrip(s);

  /* Strings YAML would otherwise read as something else, or that need escaping. */
  static const char *const names[] = {
      "true",
      "null",
      "~",
      "123",
      "1e3",
      "",
      " lead",
      "trail ",
      "a: b",
      "#x",
      "- x",
      "'q'",
      "\"dq\"",
      "multi\nline\n",
      "tab\there",
      "caf\xc3\xa9",
      "{flow}",
      "*alias",
      "&anchor",
      "--- doc",
      "back\\slash",
      "very long "
      "0123456789012345678901234567890123456789"
      "0123456789012345678901234567890123456789012345678901234567890123456789 end",
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    char assignment[512];
    snprintf(assignment, sizeof assignment, "name=%s", names[i]);
    set_ok(s, assignment);
    ck_assert_str_eq(s->name, names[i]);
    check_roundtrip(s);
  }
  /* Doubles that need all 17 digits, denormals, extremes; int32 extremes. */
  const double doubles[] = {0.1 + 0.2, 1.0 / 3.0, 5e-324,         DBL_MAX,
                            -DBL_MIN,  1e21,      123456789012.5, -0.0};
  for (size_t i = 0; i < sizeof doubles / sizeof doubles[0]; i++) {
    s->optimizer->lr = doubles[i];
    s->optimizer->eps = -doubles[i];
    check_roundtrip(s);
  }
  s->model->layers = INT32_MIN;
  s->model->heads = INT32_MAX;
  s->data->shuffle = 1;
  check_roundtrip(s);
  dt_jobspec_free(s);
}
END_TEST

START_TEST(test_yaml_text)
{
  spec_t *s = fresh();
  parse_ok(s, k_example);
  char *y = NULL;
  ck_assert_int_eq(dt_jobspec_to_yaml(s, &y), 0);
  /* Block style, .proto order, strings quoted, numbers as written by a person. */
  ck_assert_ptr_nonnull(strstr(y, "name: \"\"\nmodel:\n  layers: 4\n  heads: 4\n"));
  ck_assert_ptr_nonnull(strstr(y, "  init: \"seed:1337\"\n"));
  ck_assert_ptr_nonnull(strstr(y, "  shuffle: false\n"));
  ck_assert_ptr_nonnull(strstr(y, "  lr: 0.0003\n"));
  ck_assert_ptr_nonnull(strstr(y, "  eps: 1e-08\n"));
  ck_assert_ptr_nonnull(strstr(y, "  beta1: 0.9\n"));
  ck_assert_ptr_nonnull(strstr(y, "  grad_clip: 1.0\n"));
  ck_assert_ptr_nonnull(strstr(y, "  schedule: \"1f1b\"\n"));
  ck_assert_ptr_nonnull(strstr(y, "elastic:\n  min_nodes: 1\n"));
  ck_assert_ptr_null(strstr(y, "{"));
  free(y);

  /* Absent sections are left out, and the result still parses. */
  spec_t *bare = distrain__v1__job_spec__unpack(NULL, 0, (const uint8_t *)"");
  ck_assert_int_eq(dt_jobspec_set(bare, "data.val=v.bin", NULL, 0), 0);
  ck_assert_int_eq(dt_jobspec_to_yaml(bare, &y), 0);
  ck_assert_str_eq(
      y,
      "name: \"\"\ndata:\n  train: \"\"\n  val: \"v.bin\"\n  shuffle: false\n  vocab_file: \"\"\n  "
      "eval: \"\"\n  val_sets: \"\"\n  merge_file: \"\"\n");
  free(y);
  dt_jobspec_free(bare);
  dt_jobspec_free(s);
}
END_TEST

START_TEST(test_equal)
{
  spec_t *a = fresh(), *b = fresh();
  ck_assert(dt_jobspec_equal(a, b));
  set_ok(b, "elastic.heartbeat_ms=501");
  ck_assert(!dt_jobspec_equal(a, b));
  set_ok(b, "elastic.heartbeat_ms=500");
  ck_assert(dt_jobspec_equal(a, b));
  set_ok(b, "model.init=seed:1338");
  ck_assert(!dt_jobspec_equal(a, b));
  ck_assert(!dt_jobspec_equal(a, NULL));
  ck_assert(dt_jobspec_equal(NULL, NULL));
  dt_jobspec_free(a);
  dt_jobspec_free(b);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Trainer command line                                                                        */
/* ------------------------------------------------------------------------------------------ */

static void check_argv(char **argv, int argc, const char *const *want)
{
  int n = 0;
  while (want[n])
    n++;
  for (int i = 0; i < argc && i < n; i++)
    ck_assert_msg(strcmp(argv[i], want[i]) == 0, "argv[%d] = '%s', want '%s'", i, argv[i], want[i]);
  ck_assert_int_eq(argc, n);
  ck_assert_ptr_null(argv[argc]);
}

/* The value following flag, or NULL when the flag is absent. */
static const char *flag_value(char **argv, const char *flag)
{
  for (int i = 0; argv[i]; i++)
    if (strcmp(argv[i], flag) == 0)
      return argv[i + 1];
  return NULL;
}

static bool has_arg(char **argv, const char *arg)
{
  for (int i = 0; argv[i]; i++)
    if (strcmp(argv[i], arg) == 0)
      return true;
  return false;
}

START_TEST(test_trainer_argv_example)
{
  spec_t *s = fresh();
  parse_ok(s, k_example);
  char **argv = NULL;
  int argc = -1;
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 0, &argv, &argc), 0);
  static const char *const want[] = {
      "--init",      "seed:1337",     "--layers",      "4",           "--heads",        "4",
      "--channels",  "256",           "--vocab",       "256",         "--max-seq",      "256",
      "--train",     "kjv_train.bin", "--val",         "kjv_val.bin", "--batch",        "8",
      "--seq",       "256",           "--grad-accum",  "1",           "--steps",        "200",
      "--device",    "auto",          "--lr",          "0.0003",      "--warmup",       "0",
      "--schedule",  "cosine",        "--min-lr-frac", "0.0",         "--weight-decay", "0.0",
      "--beta1",     "0.9",           "--beta2",       "0.95",        "--eps",          "1e-08",
      "--grad-clip", "1.0",           "--val-every",   "50",          "--val-batches",  "20",
      "--ckpt-dir",  "ckpt",          "--save-every",  "100",         "--keep",         "3",
      NULL,
  };
  check_argv(argv, argc, want);
  dt_argv_free(argv);

  /* resume adds --resume at the end and keeps the seed (it also orders the data). */
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 1, &argv, &argc), 0);
  ck_assert_str_eq(argv[argc - 1], "--resume");
  ck_assert_str_eq(flag_value(argv, "--init"), "seed:1337");
  dt_argv_free(argv);
  dt_argv_free(NULL);
  dt_jobspec_free(s);
}
END_TEST

START_TEST(test_trainer_argv_variants)
{
  spec_t *s = valid_spec();
  char **argv = NULL;
  int argc = 0;

  /* Global batch 32 of micro-batches of 4: accumulation follows the current dp size. */
  set_ok(s, "training.batch=32");
  set_ok(s, "training.micro_batch=4");
  set_ok(s, "parallel.dp=2");
  ck_assert_int_eq(dt_jobspec_grad_accum(s, 2), 4);
  ck_assert_int_eq(dt_jobspec_grad_accum(s, 8), 1);
  ck_assert_int_eq(dt_jobspec_grad_accum(s, 1), 8);
  ck_assert_int_eq(dt_jobspec_grad_accum(s, 3), DT_EINVAL);
  ck_assert_int_eq(dt_jobspec_grad_accum(s, 0), DT_EINVAL);
  ck_assert_int_eq(dt_jobspec_grad_accum(s, 16), DT_EINVAL);
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 2, 0, &argv, &argc), 0);
  ck_assert_str_eq(flag_value(argv, "--batch"), "4");
  ck_assert_str_eq(flag_value(argv, "--grad-accum"), "4");
  dt_argv_free(argv);
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 0, &argv, &argc), 0); /* after losing a rank */
  ck_assert_str_eq(flag_value(argv, "--grad-accum"), "8");
  dt_argv_free(argv);
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 3, 0, &argv, &argc), DT_EINVAL);
  ck_assert_ptr_null(argv);
  ck_assert_int_eq(argc, 0);

  /* Interleaved 1F1B over pp 2 runs micro-batches in rounds of 2. Batch 24 of micro-batches
   * of 4 is 2 per rank at dp 3; after losing a node, dp 2 would give 3, which its trainers
   * refuse, so the re-planner must skip it and take dp 1 (6). 1F1B has no such rule. */
  set_ok(s, "training.batch=24");
  set_ok(s, "parallel.dp=3");
  set_ok(s, "parallel.pp=2");
  set_ok(s, "parallel.schedule=interleaved");
  ck_assert_int_eq(dt_jobspec_grad_accum(s, 3), 2);
  ck_assert_int_eq(dt_jobspec_grad_accum(s, 2), DT_EINVAL);
  ck_assert_int_eq(dt_jobspec_grad_accum(s, 1), 6);
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 2, 0, &argv, &argc), DT_EINVAL);
  set_ok(s, "parallel.schedule=1f1b");
  ck_assert_int_eq(dt_jobspec_grad_accum(s, 2), 3);
  set_ok(s, "parallel.pp=1");
  set_ok(s, "training.batch=32");
  set_ok(s, "parallel.dp=2");

  /* No validation, no val flags; no --val without data.val; threads and shuffle when set. */
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 0, &argv, &argc), 0);
  ck_assert(!has_arg(argv, "--val-every") && !has_arg(argv, "--val-batches"));
  ck_assert(!has_arg(argv, "--val") && !has_arg(argv, "--shuffle"));
  ck_assert(!has_arg(argv, "--val-sets"));
  ck_assert(!has_arg(argv, "--keep-every") && !has_arg(argv, "--last-save-wait"));
  ck_assert(!has_arg(argv, "--save-every-s"));
  ck_assert(!has_arg(argv, "--threads") && !has_arg(argv, "--resume"));
  ck_assert(!has_arg(argv, "--vocab-file") && !has_arg(argv, "--merge-file"));
  ck_assert(!has_arg(argv, "--prompt"));
  ck_assert(!has_arg(argv, "--sample-temp") && !has_arg(argv, "--sample-top-k"));
  ck_assert(!has_arg(argv, "--sample-every"));
  ck_assert(!has_arg(argv, "--sample-top-p"));
  ck_assert(!has_arg(argv, "--eval") && !has_arg(argv, "--eval-every"));
  ck_assert(!has_arg(argv, "--decay-frac")); /* cosine has none */
  ck_assert(!has_arg(argv, "--peak-tflops"));
  ck_assert(!has_arg(argv, "--spike-factor"));
  ck_assert(!has_arg(argv, "--spike-skip"));
  ck_assert(!has_arg(argv, "--bad-step"));
  ck_assert(!has_arg(argv, "--grad-spike-factor"));
  ck_assert_str_eq(flag_value(argv, "--train"), "train_*.bin");
  ck_assert_str_eq(flag_value(argv, "--device"), "auto");
  ck_assert(!has_arg(argv, "--comm"));      /* auto is the trainer's default */
  ck_assert(!has_arg(argv, "--precision")); /* so is fp32 */
  ck_assert(!has_arg(argv, "--attention")); /* and flash */
  ck_assert(!has_arg(argv, "--profile"));   /* and no profile */
  dt_argv_free(argv);
  set_ok(s, "parallel.comm=nccl");
  set_ok(s, "training.precision=bf16");
  set_ok(s, "training.attention=materialized");
  set_ok(s, "training.device=cuda");
  set_ok(s, "training.threads=6");
  set_ok(s, "data.shuffle=true");
  set_ok(s, "data.val=v.bin");
  set_ok(s, "data.val_sets=web=w.bin,code=c/*.bin");
  set_ok(s, "checkpoint.keep_every=1000");
  set_ok(s, "checkpoint.last_save_wait_s=-1");
  set_ok(s, "checkpoint.every_s=1800");
  set_ok(s, "data.vocab_file=gpt2/vocab.json");
  set_ok(s, "data.merge_file=gpt2/merges.txt");
  set_ok(s, "training.prompt=Once upon a time");
  set_ok(s, "training.sample=40");
  set_ok(s, "training.sample_temp=1.5");
  set_ok(s, "training.sample_top_k=50");
  set_ok(s, "training.sample_top_p=0.95");
  set_ok(s, "training.sample_every=500");
  set_ok(s, "data.eval=hellaswag_val.bin");
  set_ok(s, "training.eval_every=250");
  set_ok(s, "optimizer.schedule=wsd");
  set_ok(s, "optimizer.decay_frac=0.1");
  set_ok(s, "training.profile=200");
  set_ok(s, "training.profile=3:2");
  set_ok(s, "training.peak_tflops=756.5");
  set_ok(s, "elastic.spike_factor=2.5");
  set_ok(s, "elastic.spike_skip=200");
  set_ok(s, "elastic.bad_step=skip");
  set_ok(s, "elastic.grad_spike_factor=4");
  set_ok(s, "elastic.straggler_drain_s=604800"); /* the coordinator's: no trainer flag */
  set_ok(s, "elastic.priority=-1000");           /* the coordinator's too */
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 0, &argv, &argc), 0);
  ck_assert_str_eq(flag_value(argv, "--peak-tflops"), "756.5");
  ck_assert_str_eq(flag_value(argv, "--spike-factor"), "2.5");
  ck_assert_str_eq(flag_value(argv, "--spike-skip"), "200");
  ck_assert_str_eq(flag_value(argv, "--bad-step"), "skip");
  ck_assert_str_eq(flag_value(argv, "--grad-spike-factor"), "4.0");
  ck_assert_str_eq(flag_value(argv, "--profile"), "3:2");
  ck_assert_str_eq(flag_value(argv, "--threads"), "6");
  ck_assert_str_eq(flag_value(argv, "--device"), "cuda");
  ck_assert_str_eq(flag_value(argv, "--comm"), "nccl");
  ck_assert_str_eq(flag_value(argv, "--precision"), "bf16");
  ck_assert_str_eq(flag_value(argv, "--attention"), "materialized");
  ck_assert_str_eq(flag_value(argv, "--val"), "v.bin");
  ck_assert_str_eq(flag_value(argv, "--val-sets"), "web=w.bin,code=c/*.bin");
  ck_assert_str_eq(flag_value(argv, "--keep-every"), "1000");
  ck_assert_str_eq(flag_value(argv, "--last-save-wait"), "0"); /* -1: no wait */
  ck_assert_str_eq(flag_value(argv, "--save-every-s"), "1800");
  ck_assert_str_eq(flag_value(argv, "--vocab-file"), "gpt2/vocab.json");
  ck_assert_str_eq(flag_value(argv, "--merge-file"), "gpt2/merges.txt");
  ck_assert_str_eq(flag_value(argv, "--prompt"), "Once upon a time");
  ck_assert_str_eq(flag_value(argv, "--sample"), "40");
  ck_assert_str_eq(flag_value(argv, "--sample-temp"), "1.5");
  ck_assert_str_eq(flag_value(argv, "--sample-top-k"), "50");
  ck_assert_str_eq(flag_value(argv, "--sample-top-p"), "0.95");
  ck_assert_str_eq(flag_value(argv, "--sample-every"), "500");
  ck_assert_str_eq(flag_value(argv, "--eval"), "hellaswag_val.bin");
  ck_assert_str_eq(flag_value(argv, "--eval-every"), "250");
  ck_assert_str_eq(flag_value(argv, "--schedule"), "wsd");
  ck_assert_str_eq(flag_value(argv, "--decay-frac"), "0.1");
  ck_assert(has_arg(argv, "--shuffle"));
  dt_argv_free(argv);
  /* a message that leaves decay_frac unset (0, proto3) gets the default */
  set_ok(s, "optimizer.decay_frac=0");
  set_ok(s, "training.sample_top_p=1"); /* the whole distribution: the trainer's default */
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 0, &argv, &argc), 0);
  ck_assert_str_eq(flag_value(argv, "--decay-frac"), "0.2");
  ck_assert(!has_arg(argv, "--sample-top-p"));
  dt_argv_free(argv);

  /* llm.c's, Hugging Face's and a checkpoint's weights: --init on a fresh start, nothing on
   * resume (the job's own checkpoint has the weights). */
  static const char *const inits[] = {"llmc:/w/gpt2 124M.bin", "hf:/w/gpt2", "ckpt:/runs/base"};
  for (size_t i = 0; i < sizeof inits / sizeof *inits; i++) {
    char set[64];
    snprintf(set, sizeof set, "model.init=%s", inits[i]);
    set_ok(s, set);
    ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 0, &argv, &argc), 0);
    ck_assert_str_eq(flag_value(argv, "--init"), inits[i]);
    dt_argv_free(argv);
    ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 1, &argv, &argc), 0);
    ck_assert(!has_arg(argv, "--init"));
    ck_assert_str_eq(argv[argc - 1], "--resume");
    dt_argv_free(argv);
  }

  /* A distrain checkpoint: --resume=PATH on a fresh start, plain --resume later. */
  set_ok(s, "model.init=/ckpt/base-run");
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 0, &argv, &argc), 0);
  ck_assert_str_eq(argv[0], "--resume=/ckpt/base-run");
  ck_assert(!has_arg(argv, "--init") && !has_arg(argv, "--resume"));
  dt_argv_free(argv);
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 1, &argv, &argc), 0);
  ck_assert_str_eq(argv[0], "--layers");
  ck_assert_str_eq(argv[argc - 1], "--resume");
  dt_argv_free(argv);

  /* Doubles are printed so that they read back exactly. */
  s->optimizer->lr = 0.1 + 0.2;
  s->optimizer->beta2 = 1.0 / 3.0;
  s->optimizer->eps = 5e-324;
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 0, &argv, &argc), 0);
  ck_assert(strtod(flag_value(argv, "--lr"), NULL) == 0.1 + 0.2);
  ck_assert(strtod(flag_value(argv, "--beta2"), NULL) == 1.0 / 3.0);
  ck_assert(strtod(flag_value(argv, "--eps"), NULL) == 5e-324);
  dt_argv_free(argv);

  /* A pipeline passes its schedule, and the chunks per stage when given. */
  set_ok(s, "parallel.pp=2");
  set_ok(s, "parallel.schedule=interleaved");
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 0, &argv, &argc), 0);
  ck_assert_str_eq(flag_value(argv, "--pp-schedule"), "interleaved");
  ck_assert(!has_arg(argv, "--pp-virtual"));
  dt_argv_free(argv);
  set_ok(s, "parallel.virtual_stages=3");
  ck_assert_int_eq(dt_jobspec_trainer_argv(s, 1, 0, &argv, &argc), 0);
  ck_assert_str_eq(flag_value(argv, "--pp-virtual"), "3");
  dt_argv_free(argv);

  /* Missing sections are refused. */
  spec_t *bare = distrain__v1__job_spec__unpack(NULL, 0, (const uint8_t *)"");
  ck_assert_int_eq(dt_jobspec_trainer_argv(bare, 1, 0, &argv, &argc), DT_EINVAL);
  dt_jobspec_free(bare);
  dt_jobspec_free(s);
}
END_TEST

START_TEST(test_mesh_of_spec)
{
  spec_t *s = valid_spec();
  set_ok(s, "parallel.pp=2");
  set_ok(s, "parallel.dp=3");
  set_ok(s, "parallel.tp=4");
  dt_mesh_t m;
  ck_assert_int_eq(dt_jobspec_mesh(s, &m), 0);
  ck_assert_int_eq(m.pp, 2);
  ck_assert_int_eq(m.dp, 3);
  ck_assert_int_eq(m.cp, 1);
  ck_assert_int_eq(m.tp, 4);
  ck_assert_int_eq(dt_mesh_world(&m), 24);
  set_ok(s, "parallel.cp=0");
  ck_assert_int_eq(dt_jobspec_mesh(s, &m), DT_EINVAL);
  ck_assert_int_eq(dt_jobspec_mesh(NULL, &m), DT_EINVAL);
  dt_jobspec_free(s);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */

static Suite *jobspec_suite(void)
{
  Suite *s = suite_create("jobspec");
  TCase *t = tcase_create("defaults");
  tcase_add_test(t, test_defaults);
  tcase_add_test(t, test_example_parses);
  tcase_add_test(t, test_deploy_jobs);
  suite_add_tcase(s, t);

  t = tcase_create("reader");
  tcase_add_test(t, test_layering);
  tcase_add_test(t, test_scalar_types);
  tcase_add_test(t, test_error_unknown_keys);
  tcase_add_test(t, test_error_types);
  tcase_add_test(t, test_error_duplicates);
  tcase_add_test(t, test_error_syntax);
  tcase_add_test(t, test_error_nesting);
  tcase_add_test(t, test_error_leaves_spec_alone);
  tcase_add_test(t, test_parse_file);
  suite_add_tcase(s, t);

  t = tcase_create("set");
  tcase_add_test(t, test_set);
  tcase_add_test(t, test_set_errors);
  suite_add_tcase(s, t);

  t = tcase_create("validate");
  tcase_add_test(t, test_validate_rules);
  tcase_add_test(t, test_validate_accepts);
  tcase_add_test(t, test_validate_reports_all);
  suite_add_tcase(s, t);

  t = tcase_create("output");
  tcase_add_test(t, test_yaml_roundtrip);
  tcase_add_test(t, test_yaml_text);
  tcase_add_test(t, test_equal);
  tcase_add_test(t, test_trainer_argv_example);
  tcase_add_test(t, test_trainer_argv_variants);
  tcase_add_test(t, test_mesh_of_spec);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(jobspec_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
