/* test_model.c — Check suite for the model's set-up choices against its device's kernel table
 * (worker/trainer/gpt2.h): what dt_gpt2_set_precision and dt_gpt2_set_attention take from the
 * table under bf16, and what they refuse, each with DT_ENOTSUP (an input error: the trainer
 * exits before training). The devices are the CPU device with edited copies of its table.
 * Also the bf16 weight copy: what the linear layers read, kept equal to the parameters; text
 * generation's key/value cache against forwards of the whole window; and the devices' peaks the
 * MFU is measured against (devices.h). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <check.h>

#include "cpu_kernels.h"
#include "device.h"
#include "devices.h"
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

/* Stand-ins for the table's flash forward entries: the fp32 one fails (a bf16 model must not
 * call it); the bf16 one notes whether every q, k, v value it gets is a bf16 number (the qkv
 * layer's output rounded, ops.h) and runs the CPU's. */
static int g_qkv_bf16 = -1;

static int refused_flash(struct dt_device *dev, float *out, float *lse, const float *qkv, int B,
                         int Tq, int q0, int Tall, int C, int NH)
{
  (void)dev, (void)out, (void)lse, (void)qkv, (void)B, (void)Tq, (void)q0, (void)Tall, (void)C;
  (void)NH;
  return DT_EINVAL;
}

static int spied_flash_bf16(struct dt_device *dev, void *out, float *lse, const void *qkv, int B,
                            int Tq, int q0, int Tall, int C, int NH)
{
  const float *x = qkv; /* the CPU's bf16 buffer: the fp32 numbers equal to bf16 values */
  g_qkv_bf16 = 1;
  for (size_t i = 0; i < (size_t)B * Tall * 3 * C; i++)
    g_qkv_bf16 &= dt_bf16_round(x[i]) == x[i];
  return dt_ops_cpu()->attention_forward_flash_bf16(dev, out, lse, qkv, B, Tq, q0, Tall, C, NH);
}

/* Stand-ins for the bf16 entries, which run the CPU's and count the calls whose bf16 buffers all
 * hold bf16 numbers: the GELU's input (the fc layer's bf16 output), the GELU-gradient backward's
 * input and output, a linear layer's backward from a bf16 gradient alone (and those with a bias
 * gradient) and into a bf16 dinp, the loss's logits (the LM head's bf16 output), a LayerNorm
 * backward's output gradient. */
static int g_gelu_calls, g_gelu_bf16, g_dgelu_calls, g_dgelu_bf16, g_dout16_calls, g_dout16_bf16,
    g_dout16_bias, g_ce_calls, g_ce_bf16, g_dinp16_calls, g_dinp16_bf16, g_ln16_calls, g_ln16_bf16;

static int all_bf16(const void *p, size_t n)
{
  const float *x = p; /* the CPU's bf16 buffer */
  for (size_t i = 0; i < n; i++)
    if (dt_bf16_round(x[i]) != x[i])
      return 0;
  return 1;
}

static int spied_layernorm_backward_bf16(struct dt_device *dev, float *dinp, float *dweight,
                                         float *dbias, const void *dout, const float *inp,
                                         const float *weight, const float *mean, const float *rstd,
                                         int N, int C)
{
  g_ln16_calls++;
  g_ln16_bf16 += all_bf16(dout, (size_t)N * C);
  return dt_ops_cpu()->layernorm_backward_bf16(dev, dinp, dweight, dbias, dout, inp, weight, mean,
                                               rstd, N, C);
}

static int g_datt16_calls, g_datt16_bf16;

static int spied_flash_backward_bf16(struct dt_device *dev, void *dqkv, int dqkv16,
                                     const void *dout, int dout16, const void *qkv, const void *out,
                                     const float *lse, int B, int Tq, int q0, int Tall, int C,
                                     int NH, int accumulate)
{
  g_datt16_calls += dout16;
  g_datt16_bf16 += dout16 && all_bf16(dout, (size_t)B * Tq * C);
  return dt_ops_cpu()->attention_backward_flash_bf16(dev, dqkv, dqkv16, dout, dout16, qkv, out, lse,
                                                     B, Tq, q0, Tall, C, NH, accumulate);
}

static int spied_backward_bf16(struct dt_device *dev, void *dinp, int dinp16, float *dweight,
                               float *dbias, const float *dout, const void *dout16, const void *inp,
                               const float *weight, const void *weight16, const void *gelu_in,
                               int N, int C, int OC, int ldd)
{
  const int rc = dt_ops_cpu()->matmul_backward_bf16(dev, dinp, dinp16, dweight, dbias, dout, dout16,
                                                    inp, weight, weight16, gelu_in, N, C, OC, ldd);
  if (dinp16 && !gelu_in) {
    g_dinp16_calls++;
    g_dinp16_bf16 += all_bf16(dinp, (size_t)N * C);
  }
  if (gelu_in) {
    g_dgelu_calls++;
    g_dgelu_bf16 += all_bf16(gelu_in, (size_t)N * C) && all_bf16(dinp, (size_t)N * C);
  }
  if (!dout) { /* the CPU's bf16 rows are ldd values apart */
    g_dout16_calls++;
    g_dout16_bf16 += all_bf16(dout16, (size_t)N * ldd);
    g_dout16_bias += dbias != NULL;
  }
  return rc;
}

/* The residual stream's adds: in the projections' GEMMs (res), or by passes of their own. */
static int g_gemm_res, g_residual_passes;

static int spied_forward_bf16(struct dt_device *dev, void *out, int out16, const void *inp,
                              const float *weight, const void *weight16, const float *bias,
                              const float *res, void *gelu, int N, int C, int OC, int ldo)
{
  g_gemm_res += res != NULL;
  const int rc = dt_ops_cpu()->matmul_forward_bf16(dev, out, out16, inp, weight, weight16, bias,
                                                   res, gelu, N, C, OC, ldo);
  if (gelu) { /* the MLP's pre-activation and activation, both bf16 (contiguous rows here) */
    g_gelu_calls++;
    g_gelu_bf16 += all_bf16(out, (size_t)N * OC) && all_bf16(gelu, (size_t)N * OC);
  }
  return rc;
}

static int spied_residual(struct dt_device *dev, float *out, const float *a, const float *b,
                          size_t n)
{
  g_residual_passes++;
  return dt_ops_cpu()->residual_forward(dev, out, a, b, n);
}

static int spied_residual_layernorm_bf16(struct dt_device *dev, float *res, void *out, float *mean,
                                         float *rstd, const float *a, const float *b,
                                         const float *weight, const float *bias, int N, int C)
{
  g_residual_passes++;
  return dt_ops_cpu()->residual_layernorm_forward_bf16(dev, res, out, mean, rstd, a, b, weight,
                                                       bias, N, C);
}

static int spied_crossentropy_bf16(struct dt_device *dev, float *losses, void *logits,
                                   const int *targets, float dloss, int N, int V, int Vp)
{
  g_ce_calls++;
  g_ce_bf16 += all_bf16(logits, (size_t)N * Vp);
  return dt_ops_cpu()->crossentropy_forward_backward_bf16(dev, losses, logits, targets, dloss, N, V,
                                                          Vp);
}

static const int TOKENS[2][16] = {{1, 7, 3, 9, 42, 0, 5, 5, 17, 2, 8, 49, 30, 11, 4, 6},
                                  {7, 3, 9, 42, 0, 5, 5, 17, 2, 8, 49, 30, 11, 4, 6, 13}};

/* One forward and backward of a fresh model on dev: its error. */
static int step(dt_device_t *dev, int bf16)
{
  dt_gpt2_t m;
  float loss = 0.0f;
  ck_assert_int_eq(choose(dev, bf16, 1, &m), 0);
  ck_assert_ptr_eq(m.ops, dev->ops); /* the device's table, in either precision */
  ck_assert_int_eq(dt_gpt2_init_weights(&m, 5), 0);
  ck_assert_int_eq(dt_gpt2_alloc_activations(&m, 2, 8, (int[]){1}, 0), 0);
  const int rc = dt_gpt2_forward_backward(&m, TOKENS[0], TOKENS[1], 2, 8, 1.0f, &loss);
  dt_gpt2_destroy(&m);
  return rc;
}

/* bf16 calls the table's bf16 flash attention on q, k, v that the qkv layer wrote in bf16, and
 * never its fp32 flash entry; fp32 the reverse (the linear layers and the GELU pick their bf16
 * entries by m.bf16 alike, on bf16 activations). */
START_TEST(test_bf16_takes_the_bf16_entries)
{
  dt_device_t *dev = edited_cpu();
  g_ops.attention_forward_flash = refused_flash;
  g_ops.attention_forward_flash_bf16 = spied_flash_bf16;
  ck_assert_int_eq(step(dev, 1), 0);
  ck_assert_int_eq(g_qkv_bf16, 1);
  ck_assert_int_eq(step(dev, 0), DT_EINVAL); /* fp32 took the fp32 entry */
  dev = edited_cpu();
  g_ops.attention_forward_flash_bf16 = spied_flash_bf16;
  g_qkv_bf16 = -1;
  ck_assert_int_eq(step(dev, 0), 0);
  ck_assert_int_eq(g_qkv_bf16, -1); /* fp32 never called the bf16 entry */
}
END_TEST

/* bf16 keeps the MLP's pre-activation and its gradient in bf16 (as autocast does): every layer's
 * fc GEMM writes its pre-activation and GELU in bf16 (the GELU in its epilogue), the GELU's
 * backward writes bf16 values, and the fc layer's backward takes that
 * gradient with no fp32 one, its bias gradient too; so does the qkv layer's with the bf16 flash
 * backward's q, k, v gradient (one whole sequence, as here). The logits are bf16 too: the loss
 * reads the LM head's bf16 output, and the LM head's backward takes the bf16 dlogits alone.
 * With whole rows here (tp 1), each projection adds its branch to the residual stream in its
 * GEMM, with no residual pass of its own, and each LayerNorm's backward reads its output's
 * gradient in bf16, as the linear layer after it wrote it; so does the flash backward the
 * attention output's. */
START_TEST(test_bf16_mlp)
{
  dt_device_t *dev = edited_cpu();
  g_ops.matmul_backward_bf16 = spied_backward_bf16;
  g_ops.crossentropy_forward_backward_bf16 = spied_crossentropy_bf16;
  g_ops.matmul_forward_bf16 = spied_forward_bf16;
  g_ops.residual_forward = spied_residual;
  g_ops.residual_layernorm_forward_bf16 = spied_residual_layernorm_bf16;
  g_ops.layernorm_backward_bf16 = spied_layernorm_backward_bf16;
  g_ops.attention_backward_flash_bf16 = spied_flash_backward_bf16;
  ck_assert_int_eq(step(dev, 1), 0);
  const int L = CFG.layers;
  ck_assert_int_eq(g_gelu_calls, L);
  ck_assert_int_eq(g_gelu_bf16, L);
  ck_assert_int_eq(g_dgelu_calls, L);
  ck_assert_int_eq(g_dgelu_bf16, L);
  ck_assert_int_eq(g_dout16_calls, 2 * L + 1); /* fc and qkv, the LM head */
  ck_assert_int_eq(g_dout16_bf16, 2 * L + 1);
  ck_assert_int_eq(g_dout16_bias, 2 * L); /* the tied LM head has no bias */
  ck_assert_int_eq(g_ce_calls, 1);
  ck_assert_int_eq(g_ce_bf16, 1);
  ck_assert_int_eq(g_gemm_res, 2 * L); /* both projections add to the residual stream */
  ck_assert_int_eq(g_residual_passes, 0);
  /* every LayerNorm's output gradient bf16: the qkv, fc and LM head layers' dinp16 */
  ck_assert_int_eq(g_dinp16_bf16, 3 * L + 1);
  ck_assert_int_eq(g_ln16_calls, 2 * L + 1);
  ck_assert_int_eq(g_ln16_bf16, 2 * L + 1);
  /* and the attention output's, from the projection's backward into the flash backward */
  ck_assert_int_eq(g_dinp16_calls, 2 * L + 1 + L);
  ck_assert_int_eq(g_datt16_calls, L);
  ck_assert_int_eq(g_datt16_bf16, L);
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
  g_ops.crossentropy_forward_backward_bf16 = NULL; /* nor without the loss on bf16 logits, */
  ck_assert_int_eq(choose(dev, 1, 0, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
  dev = edited_cpu();
  g_ops.crossentropy_vp_stats_bf16 = NULL; /* the tensor-parallel one too, */
  ck_assert_int_eq(choose(dev, 1, 0, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
  /* 2-byte bf16 values: a row of bf16 dlogits must be a whole number of floats (ops.h's
   * dout16), so an odd padded vocabulary is refused, an even one taken */
  for (int vp = 51; vp <= 52; vp++) {
    dt_gpt2_config_t cfg = CFG;
    cfg.padded_vocab = vp;
    dev = edited_cpu();
    g_ops.bf16_bytes = 2;
    ck_assert_int_eq(dt_gpt2_create(&m, &cfg, dev, NULL, NULL), 0);
    ck_assert_int_eq(dt_gpt2_set_precision(&m, 1), vp % 2 ? DT_EINVAL : 0);
    dt_gpt2_destroy(&m);
  }
  dev = edited_cpu();
  g_ops.residual_layernorm_forward_bf16 = NULL; /* or a LayerNorm into bf16, */
  ck_assert_int_eq(choose(dev, 1, 0, &m), DT_ENOTSUP);
  dt_gpt2_destroy(&m);
  dev = edited_cpu();
  g_ops.layernorm_backward_bf16 = NULL; /* or its backward from bf16, */
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

/* ------------------------------------------------------------------------------------------ */
/* The bf16 weight copy                                                                         */
/* ------------------------------------------------------------------------------------------ */

/* A bf16 model on the CPU from seed's weights, with activations for (2, 8). */
static void bf16_model(dt_gpt2_t *m, uint64_t seed)
{
  ck_assert_int_eq(choose(dt_device_cpu(), 1, 1, m), 0);
  ck_assert_int_eq(dt_gpt2_init_weights(m, seed), 0);
  ck_assert_int_eq(dt_gpt2_alloc_activations(m, 2, 8, (int[]){1}, 0), 0);
}

/* The mean loss of the test batch (its gradients accumulate). */
static float loss_of(dt_gpt2_t *m)
{
  float loss = 0.0f;
  ck_assert_int_eq(dt_gpt2_forward_backward(m, TOKENS[0], TOKENS[1], 2, 8, 1.0f, &loss), 0);
  return loss;
}

static int same_bits(float a, float b)
{
  return memcmp(&a, &b, sizeof a) == 0;
}

/* Only bf16 keeps a copy. The copy follows a load (dt_gpt2_load_global) and an AdamW step,
 * which writes it in the same pass: each time the losses are those of a model that rounded the
 * same parameters afresh. */
START_TEST(test_bf16_copy_follows_the_parameters)
{
  dt_gpt2_t fp32, a, b, c;
  ck_assert_int_eq(choose(dt_device_cpu(), 0, 1, &fp32), 0);
  ck_assert_int_eq(dt_gpt2_alloc_activations(&fp32, 2, 8, (int[]){1}, 0), 0);
  ck_assert_ptr_null(fp32.params16);
  dt_gpt2_destroy(&fp32);

  bf16_model(&a, 1);
  bf16_model(&b, 2);
  ck_assert_ptr_nonnull(a.params16);
  const float a1 = loss_of(&a), b1 = loss_of(&b);
  ck_assert(!same_bits(a1, b1));
  ck_assert_int_eq(dt_gpt2_load_global(&a, b.params_flat), 0); /* one process: global layout */
  ck_assert(same_bits(loss_of(&a), b1));

  const dt_adamw_t h = {
      .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  ck_assert_int_eq(dt_gpt2_zero_grad(&a), 0);
  ck_assert_int_eq(dt_gpt2_zero_grad(&b), 0);
  ck_assert(same_bits(loss_of(&a), loss_of(&b)));
  ck_assert_int_eq(dt_gpt2_adamw_step(&a, &h, 1.0f, 1), 0);
  ck_assert_int_eq(dt_gpt2_adamw_step(&b, &h, 1.0f, 1), 0);
  bf16_model(&c, 3);
  ck_assert_int_eq(dt_gpt2_load_global(&c, a.params_flat), 0);
  const float a2 = loss_of(&a);
  ck_assert(!same_bits(a2, b1)); /* the step changed the weights */
  ck_assert(same_bits(a2, loss_of(&b)));
  ck_assert(same_bits(a2, loss_of(&c)));
  dt_gpt2_destroy(&a);
  dt_gpt2_destroy(&b);
  dt_gpt2_destroy(&c);
}
END_TEST

/* The linear layers read the copy, not the fp32 weights: a weight written behind the model's
 * back changes nothing until dt_gpt2_params_written. */
START_TEST(test_bf16_linear_layers_read_the_copy)
{
  dt_gpt2_t a;
  bf16_model(&a, 1);
  const float before = loss_of(&a);
  float *qkvw = a.params_flat + a.tensor_offsets[DT_T_QKVW];
  for (size_t i = 0; i < a.tensor_sizes[DT_T_QKVW]; i++)
    qkvw[i] += 0.5f;
  ck_assert(same_bits(loss_of(&a), before));
  dt_gpt2_params_written(&a);
  ck_assert(!same_bits(loss_of(&a), before));
  dt_gpt2_destroy(&a);
}
END_TEST

/* The names cudaGetDeviceProperties gives, against NVIDIA's data sheets' dense bf16 figures;
 * a CPU and a GPU not in the table have none. */
/* ------------------------------------------------------------------------------------------ */
/* Text generation's key/value cache                                                            */
/* ------------------------------------------------------------------------------------------ */

/* Row r of the newest forward's logits (the real vocabulary), as floats: bf16 values of
 * ops->bf16_bytes each (the CPU's hold floats) widened. */
static void logits_row(const dt_gpt2_t *m, int r, float *out)
{
  const dt_gpt2_acts_t *a = &m->acts[0];
  const size_t vb = m->ops->bf16_bytes;
  for (int v = 0; v < CFG.vocab; v++) {
    const size_t i = (size_t)r * CFG.padded_vocab + (size_t)v;
    if (a->logits16 && vb == 2) {
      uint16_t h;
      memcpy(&h, (const char *)a->logits16 + 2 * i, sizeof h);
      const uint32_t bits = (uint32_t)h << 16;
      memcpy(&out[v], &bits, sizeof bits);
    } else {
      memcpy(&out[v],
             a->logits16 ? (const char *)a->logits16 + vb * i : (const char *)&a->logits[i],
             sizeof(float));
    }
  }
}

/* The logits of the newest forward's rows (positions first ...) against the whole window's. */
static void expect_rows(const dt_gpt2_t *m, int first, int rows, float (*ref)[50], float tol)
{
  float got[50];
  for (int r = 0; r < rows; r++) {
    const float *want = ref[first + r];
    logits_row(m, r, got);
    for (int v = 0; v < CFG.vocab; v++)
      ck_assert_msg(fabsf(got[v] - want[v]) <= tol * (1.0f + fabsf(want[v])),
                    "position %d (fed with %d rows), logit %d: %.9g, whole window %.9g", first + r,
                    rows, v, (double)got[v], (double)want[v]);
  }
}

/* The 12 tokens' logits from one forward of them, against the cache's: the first 8 in one
 * forward (the same products as the whole window's, on fewer rows), then one token at a time
 * (each a forward of one row at its position, attending over the cached keys): equal within
 * fp32 rounding (bf16: a bf16 step of a logit), in fp32 with flash and materialized attention
 * and in bf16. The cache's bounds and refusals; after dt_gpt2_kv_end a whole window again
 * gives the first forward's logits bit for bit. */
START_TEST(test_kv_cache)
{
  static const struct {
    int bf16, flash;
    float tol;
  } cases[] = {{0, 1, 1e-5f}, {0, 0, 1e-5f}, {1, 1, 2e-2f}};
  enum { N = 12, PRE = 8 };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    dt_gpt2_t m;
    ck_assert_int_eq(choose(dt_device_cpu(), cases[c].bf16, cases[c].flash, &m), 0);
    ck_assert_int_eq(dt_gpt2_init_weights(&m, 3), 0);
    ck_assert_int_eq(dt_gpt2_alloc_activations(&m, 1, 16, (int[]){1}, 0), 0);
    float ref[N][50], got[50], unused = 0.0f;
    ck_assert_int_eq(dt_gpt2_stage_forward(&m, 0, 0, TOKENS[0], NULL, 1, N, 0.0f, &unused), 0);
    for (int r = 0; r < N; r++)
      logits_row(&m, r, ref[r]);

    char why[256] = "";
    ck_assert_int_eq(dt_gpt2_kv_begin(&m, 17, why, sizeof why), DT_EINVAL); /* > max_seq */
    ck_assert_str_eq(why, "a key/value cache of 17 positions (max_seq 16, activations for 16 "
                          "positions)");
    ck_assert_int_eq(dt_gpt2_kv_begin(&m, 16, why, sizeof why), 0);
    ck_assert_int_eq(dt_gpt2_stage_forward(&m, 0, 0, TOKENS[0], NULL, 1, PRE, 0.0f, &unused), 0);
    ck_assert_int_eq(m.kv_pos, PRE);
    for (int pos = PRE; pos <= N; pos++) {
      const int rows = pos == PRE ? PRE : 1; /* the prefix's rows, then each token's one */
      for (int r = 0; r < rows; r++) {
        logits_row(&m, r, got);
        const float *want = ref[pos - rows + r];
        for (int v = 0; v < CFG.vocab; v++)
          ck_assert_msg(fabsf(got[v] - want[v]) <= cases[c].tol * (1.0f + fabsf(want[v])),
                        "case %zu, position %d, logit %d: %.9g, whole window %.9g", c,
                        pos - rows + r, v, (double)got[v], (double)want[v]);
      }
      if (pos < N)
        ck_assert_int_eq(
            dt_gpt2_stage_forward(&m, 0, 0, &TOKENS[0][pos], NULL, 1, 1, 0.0f, &unused), 0);
    }
    ck_assert_int_eq(m.kv_pos, N);
    /* one sequence at a time, no loss, up to the capacity */
    ck_assert_int_eq(dt_gpt2_stage_forward(&m, 0, 0, TOKENS[0], NULL, 2, 1, 0.0f, &unused),
                     DT_EINVAL);
    ck_assert_int_eq(dt_gpt2_stage_forward(&m, 0, 0, TOKENS[0], TOKENS[1], 1, 1, 0.0f, &unused),
                     DT_EINVAL);
    ck_assert_int_eq(dt_gpt2_stage_forward(&m, 0, 0, TOKENS[0], NULL, 1, 5, 0.0f, &unused),
                     DT_EINVAL);
    ck_assert_int_eq(m.kv_pos, N);
    dt_gpt2_kv_end(&m);
    ck_assert_ptr_null(m.kv);
    ck_assert_int_eq(dt_gpt2_stage_forward(&m, 0, 0, TOKENS[0], NULL, 1, N, 0.0f, &unused), 0);
    for (int r = 0; r < N; r++) {
      logits_row(&m, r, got);
      ck_assert_mem_eq(got, ref[r], sizeof got);
    }
    dt_gpt2_destroy(&m);

    /* Activations for 8 positions, a cache of 12: the 12 tokens in forwards of at most kv_feed
     * rows (8; with materialized attention the (rows, 12) probabilities of a head must fit its
     * (8, 8): 5) give the whole window's logits. A forward of more rows is refused; after a
     * seek back the positions are fed again (what a padded feed's padding gets). */
    ck_assert_int_eq(choose(dt_device_cpu(), cases[c].bf16, cases[c].flash, &m), 0);
    ck_assert_int_eq(dt_gpt2_init_weights(&m, 3), 0);
    ck_assert_int_eq(dt_gpt2_alloc_activations(&m, 1, 8, (int[]){1}, 0), 0);
    ck_assert_int_eq(dt_gpt2_kv_begin(&m, 12, why, sizeof why), 0);
    ck_assert_int_eq(m.kv_feed, cases[c].flash ? 8 : 5);
    ck_assert_int_eq(
        dt_gpt2_stage_forward(&m, 0, 0, TOKENS[0], NULL, 1, m.kv_feed + 1, 0.0f, &unused),
        DT_EINVAL);
    for (int pos = 0; pos < N; pos = m.kv_pos) {
      const int fed = N - pos < m.kv_feed ? N - pos : m.kv_feed;
      ck_assert_int_eq(
          dt_gpt2_stage_forward(&m, 0, 0, &TOKENS[0][pos], NULL, 1, fed, 0.0f, &unused), 0);
      expect_rows(&m, pos, fed, ref, cases[c].tol);
    }
    ck_assert_int_eq(dt_gpt2_kv_seek(&m, N - 2), 0); /* the last two again */
    ck_assert_int_eq(dt_gpt2_stage_forward(&m, 0, 0, &TOKENS[0][N - 2], NULL, 1, 2, 0.0f, &unused),
                     0);
    expect_rows(&m, N - 2, 2, ref, cases[c].tol);
    ck_assert_int_eq(m.kv_pos, N);
    ck_assert_int_eq(dt_gpt2_kv_seek(&m, N + 1), DT_EINVAL); /* only back */
    dt_gpt2_destroy(&m);
  }
  /* a row of probabilities over the cache's positions must fit the activations */
  dt_gpt2_t m;
  char why[256];
  ck_assert_int_eq(choose(dt_device_cpu(), 0, 0, &m), 0);
  ck_assert_int_eq(dt_gpt2_alloc_activations(&m, 1, 2, (int[]){1}, 0), 0);
  ck_assert_int_eq(dt_gpt2_kv_begin(&m, 12, why, sizeof why), DT_EINVAL);
  ck_assert_str_eq(why, "a key/value cache of 12 positions (max_seq 16, activations for 2 "
                        "positions: no row fits them)");
  ck_assert_int_eq(dt_gpt2_kv_seek(&m, 0), DT_EINVAL); /* no cache */
  dt_gpt2_destroy(&m);
  /* materialized attention needs the device's context-parallel entry for queries past 0 */
  dt_device_t *dev = edited_cpu();
  g_ops.attention_forward_cp = NULL;
  ck_assert_int_eq(choose(dev, 0, 0, &m), 0);
  ck_assert_int_eq(dt_gpt2_alloc_activations(&m, 1, 16, (int[]){1}, 0), 0);
  ck_assert_int_eq(dt_gpt2_kv_begin(&m, 16, why, sizeof why), DT_ENOTSUP);
  ck_assert_str_eq(why, "no key/value cache with materialized attention on this device (no "
                        "attention_forward_cp)");
  dt_gpt2_destroy(&m);
}
END_TEST

START_TEST(test_peak_flops)
{
  static const struct {
    const char *name;
    double tflops;
  } cases[] = {{"NVIDIA H100 80GB HBM3", 989}, {"NVIDIA H100 PCIe", 756},
               {"NVIDIA H100 NVL", 835},       {"NVIDIA H200", 989},
               {"NVIDIA H200 NVL", 835},       {"NVIDIA GH200 480GB", 989},
               {"NVIDIA A100-SXM4-80GB", 312}, {"NVIDIA A100 80GB PCIe", 312},
               {"NVIDIA GeForce RTX 4090", 0}, {"", 0}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    ck_assert_msg(dt_gpu_peak_bf16_flops(cases[i].name) == cases[i].tflops * 1e12, "%s",
                  cases[i].name);
  ck_assert(dt_gpu_peak_bf16_flops(NULL) == 0);
  char name[64] = "x";
  ck_assert(dt_train_device_peak_bf16_flops(dt_device_cpu(), name, sizeof name) == 0);
  ck_assert_str_eq(name, "");
}
END_TEST

int main(void)
{
  Suite *s = suite_create("model");
  TCase *t = tcase_create("choices");
  tcase_add_test(t, test_bf16_takes_the_bf16_entries);
  tcase_add_test(t, test_bf16_mlp);
  tcase_add_test(t, test_refusals);
  tcase_add_test(t, test_flash_head_size_limit);
  suite_add_tcase(s, t);
  TCase *w = tcase_create("bf16 weights");
  tcase_add_test(w, test_bf16_copy_follows_the_parameters);
  tcase_add_test(w, test_bf16_linear_layers_read_the_copy);
  suite_add_tcase(s, w);
  TCase *kv = tcase_create("key/value cache");
  tcase_add_test(kv, test_kv_cache);
  suite_add_tcase(s, kv);
  TCase *p = tcase_create("peaks");
  tcase_add_test(p, test_peak_flops);
  suite_add_tcase(s, p);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  const int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
