/* test_model.c — Check suite for the model's set-up choices against its device's kernel table
 * (worker/trainer/gpt2.h): what dt_gpt2_set_precision and dt_gpt2_set_attention take from the
 * table under bf16, and what they refuse, each with DT_ENOTSUP (an input error: the trainer
 * exits before training). The devices are the CPU device with edited copies of its table. */
#include <stdlib.h>

#include <check.h>

#include "device.h"
#include "dt_error.h"
#include "gpt2.h"

/* heads 2 x head size 8 */
static const dt_gpt2_config_t CFG = {
    .max_seq = 16, .vocab = 50, .padded_vocab = 128, .layers = 1, .heads = 2, .channels = 16};

static dt_ops_t g_ops;
static dt_device_t g_dev;

/* The CPU device with a copy of its table that the test may edit. */
static dt_device_t *edited_cpu(void)
{
  g_ops = *dt_ops_cpu();
  g_dev = *dt_device_cpu();
  g_dev.ops = &g_ops;
  return &g_dev;
}

/* 0 or the error of set_precision(bf16) then set_attention(flash) on a fresh model. */
static int choose(dt_device_t *dev, int bf16, int flash, dt_gpt2_t *m)
{
  ck_assert_int_eq(dt_gpt2_create(m, &CFG, dev, NULL, NULL), 0);
  int rc = dt_gpt2_set_precision(m, bf16);
  return rc ? rc : dt_gpt2_set_attention(m, flash);
}

/* bf16 swaps in the table's bf16 flash attention, nothing else (the linear layers and the GELU
 * pick their bf16 entries by m.bf16, on bf16 activations: the entries' types differ). */
START_TEST(test_bf16_takes_the_bf16_entries)
{
  dt_gpt2_t m;
  dt_device_t *dev = edited_cpu();
  ck_assert_int_eq(choose(dev, 1, 1, &m), 0);
  ck_assert_int_eq(m.bf16, 1);
  ck_assert_ptr_eq(m.ops->matmul_forward, g_ops.matmul_forward);
  ck_assert_ptr_eq(m.ops->gelu_forward, g_ops.gelu_forward);
  ck_assert_ptr_eq(m.ops->attention_forward_flash, g_ops.attention_forward_flash_bf16);
  ck_assert_ptr_eq(m.ops->attention_backward_flash, g_ops.attention_backward_flash_bf16);
  ck_assert_ptr_eq(m.ops->attention_forward_cp, g_ops.attention_forward_cp); /* fp32 */
  ck_assert_ptr_eq(m.ops->layernorm_forward, g_ops.layernorm_forward);
  dt_gpt2_destroy(&m);
  ck_assert_int_eq(choose(dev, 0, 1, &m), 0);
  ck_assert_ptr_eq(m.ops, &g_ops);
  dt_gpt2_destroy(&m);
}
END_TEST

START_TEST(test_refusals)
{
  dt_gpt2_t m;
  dt_device_t *dev = edited_cpu();
  g_ops.matmul_forward_bf16 = NULL; /* no bf16 linear layers: bf16 refused */
  ck_assert_int_eq(choose(dev, 1, 0, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
  dev = edited_cpu();
  g_ops.gelu_forward_bf16 = NULL; /* nor without the GELU into bf16, */
  ck_assert_int_eq(choose(dev, 1, 0, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
  dev = edited_cpu();
  g_ops.crossentropy_forward_backward_bf16 = NULL; /* or the dlogits in bf16, */
  ck_assert_int_eq(choose(dev, 1, 0, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
  dev = edited_cpu();
  g_ops.residual_layernorm_forward_bf16 = NULL; /* or a LayerNorm into bf16, */
  ck_assert_int_eq(choose(dev, 1, 0, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
  dev = edited_cpu();
  g_ops.bf16_bytes = 0; /* or without bf16 activation buffers */
  ck_assert_int_eq(choose(dev, 1, 0, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);

  dev = edited_cpu();
  g_ops.attention_backward_flash_bf16 = NULL; /* bf16 with flash refused, materialized taken */
  ck_assert_int_eq(choose(dev, 1, 1, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
  ck_assert_int_eq(choose(dev, 1, 0, &m), 0);
  dt_gpt2_destroy(&m);
  ck_assert_int_eq(choose(dev, 0, 1, &m), 0);
  dt_gpt2_destroy(&m);

  dev = edited_cpu();
  g_ops.attention_forward_flash = NULL; /* no flash kernels */
  ck_assert_int_eq(choose(dev, 0, 1, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
}
END_TEST

/* A table whose flash kernels take head sizes up to some limit (the GPU's: 128): the model's
 * head size 8 is refused under a limit of 4 (flash only, in either precision), taken at 8. */
START_TEST(test_flash_head_size_limit)
{
  dt_gpt2_t m;
  dt_device_t *dev = edited_cpu();
  g_ops.flash_max_head_size = 4;
  ck_assert_int_eq(choose(dev, 0, 1, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
  ck_assert_int_eq(choose(dev, 1, 1, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
  ck_assert_int_eq(choose(dev, 0, 0, &m), 0);
  dt_gpt2_destroy(&m);
  g_ops.flash_max_head_size = 8;
  ck_assert_int_eq(choose(dev, 1, 1, &m), 0);
  dt_gpt2_destroy(&m);
}
END_TEST

int main(void)
{
  Suite *s = suite_create("model");
  TCase *t = tcase_create("choices");
  tcase_add_test(t, test_bf16_takes_the_bf16_entries);
  tcase_add_test(t, test_refusals);
  tcase_add_test(t, test_flash_head_size_limit);
  suite_add_tcase(s, t);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  const int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
