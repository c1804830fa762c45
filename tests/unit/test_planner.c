/* test_planner.c — Check suite for common/planner: the textbook ZeRO memory table and
 * distrain's own bf16 one, parameter
 * counts of the presets, the trainer's layer partition, hand-derived communication volumes,
 * the activation formula, layout validation and enumeration, and that --emit-spec's YAML is a
 * job spec the real parser and validator accept. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <math.h>

#include <check.h>

#include "ctl.h"
#include "dt_error.h"
#include "dt_util.h"
#include "jobspec.h"
#include "planner.h"

/* A small GPT-2: 2 layers, h 64, 4 heads, vocabulary 128 (already padded), 32 positions. */
static dt_plan_model_t tiny(void)
{
  dt_plan_model_t m = {DT_PLAN_GPT2, 2, 64, 4, 0, 0, 128, 32};
  char why[256];
  ck_assert_int_eq(dt_plan_model_check(&m, 32, why, sizeof why), 0);
  return m;
}

static dt_plan_cluster_t cluster(int gpus)
{
  return (dt_plan_cluster_t){gpus, 8, 80.0 * (1 << 30), 1e12, 0.5, 100e9, 10e9, 0, 0};
}

/* gpt2-124m at sequence length 1024, checked. */
static dt_plan_model_t gpt2_124m(void)
{
  dt_plan_model_t m;
  char why[256];
  ck_assert_int_eq(dt_plan_preset("gpt2-124m", &m), 0);
  ck_assert_msg(dt_plan_model_check(&m, 1024, why, sizeof why) == 0, "%s", why);
  return m;
}

START_TEST(test_textbook_table)
{
  /* 7B with Adam on 8 GPUs under ZeRO-0..3, bytes. mixed16: Rajbhandari et al. (ZeRO; 7.5B in
   * the paper's figure), 16P, 4P + 12P/N, 2P + 14P/N, 16P/N. bf16, distrain's trainer: fp32
   * master weights (4), gradients (4) and m, v (8) plus a bf16 weight copy (2) wherever the
   * weights are whole: 18P, 10P + 8P/N, 6P + 12P/N, 16P/N. */
  static const struct {
    dt_plan_precision_t prec;
    double want[4];
  } tables[] = {{DT_PLAN_MIXED16, {112e9, 38.5e9, 26.25e9, 14e9}},
                {DT_PLAN_BF16, {126e9, 77e9, 52.5e9, 14e9}}};
  for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++)
    for (int z = 0; z < 4; z++) {
      dt_plan_mem_t m;
      dt_plan_state_bytes(7.0e9, 8, z, tables[i].prec, &m);
      ck_assert_msg(m.total == tables[i].want[z], "precision %d ZeRO-%d: %.17g GB, want %.17g",
                    (int)tables[i].prec, z, m.total / 1e9, tables[i].want[z] / 1e9);
      ck_assert(m.working == 0 && m.acts == 0);
    }
  /* The fp32 trainer's own table (trainer.c's print_memory): 16P, 8P + 8P/N, 4P + 12P/N, 16P/N. */
  const double P = 1e6, N = 4, f32[4] = {16 * P, 8 * P + 8 * P / N, 4 * P + 12 * P / N, 16 * P / N};
  for (int z = 0; z < 4; z++) {
    dt_plan_mem_t m;
    dt_plan_state_bytes(P, (int)N, z, DT_PLAN_FP32, &m);
    ck_assert_double_eq(m.total, f32[z]);
  }
}
END_TEST

START_TEST(test_param_counts)
{
  static const struct {
    const char *name;
    int64_t params;
  } want[] = {{"gpt2-124m", 124439808},     {"gpt2-350m", 354823168},
              {"gpt2-774m", 774030080},     {"gpt2-1.5b", 1557611200},
              {"llama-7b", 6738415616LL},   {"llama-13b", 13015864320LL},
              {"llama-70b", 68976648192LL}, {"llama-405b", 405853388800LL}};
  char why[256];
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    dt_plan_model_t m;
    ck_assert_int_eq(dt_plan_preset(want[i].name, &m), 0);
    ck_assert_int_eq(dt_plan_model_check(&m, 1024, why, sizeof why), 0);
    ck_assert_msg(dt_plan_params(&m) == want[i].params, "%s: %lld", want[i].name,
                  (long long)dt_plan_params(&m));
  }
  dt_plan_model_t m;
  ck_assert_int_eq(dt_plan_preset("gpt2-7b", &m), DT_EINVAL);
  /* Llama-7B is "6.7B". */
  ck_assert_int_eq(dt_plan_preset("llama-7b", &m), 0);
  ck_assert(dt_plan_params(&m) > 6.73e9 && dt_plan_params(&m) < 6.75e9);
}
END_TEST

START_TEST(test_rank_params)
{
  /* gpt2-124m on one rank: the padded vocabulary (50304) adds 47 x 768 rows. */
  dt_plan_model_t m = gpt2_124m();
  ck_assert_int_eq(dt_plan_rank_params(&m, 1, 1, 0), 124439808 + 47 * 768);
  /* The trainer's formula (trainer.c): per layer (12C^2 + 7C)/tp + 6C; the first stage adds
   * wte/tp and wpe, the last wte/tp (the tied copy) and the final LayerNorm. */
  m = tiny();
  const int64_t C = 64, layer2 = (12 * C * C + 7 * C) / 2 + 6 * C, wte2 = 128 * C / 2;
  ck_assert_int_eq(dt_plan_rank_params(&m, 2, 2, 0), layer2 + wte2 + 32 * C);
  ck_assert_int_eq(dt_plan_rank_params(&m, 2, 2, 1), layer2 + wte2 + 2 * C);
  /* The trainer's partition: gpt2-124m over 4 stages, the LM head weighing 5.5 layers. */
  ck_assert_int_eq(dt_plan_preset("gpt2-124m", &m), 0);
  int b[5];
  dt_planner_partition(&m, 4, b);
  ck_assert(b[0] == 0 && b[1] == 4 && b[2] == 9 && b[3] == 11 && b[4] == 12);
}
END_TEST

START_TEST(test_comm_volumes)
{
  dt_plan_model_t m = tiny();
  dt_plan_train_t tr = {32, 16, DT_PLAN_FP32, 0};
  const double P = 128 * 64 + 32 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64; /* 110336 */
  dt_plan_cluster_t c = cluster(4);
  dt_plan_eval_t e;
  /* dp 4, ZeRO-0: ring all-reduce of 4-byte gradients, 2 (N-1)/N x 4P. */
  dt_plan_layout_t l = {4, 1, 1, 0, 2, 2, 0, 0};
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  ck_assert_double_eq(e.comm_dp, 2 * 0.75 * 4 * P);
  ck_assert_double_eq(e.comm, e.comm_dp);
  /* ZeRO-1: reduce-scatter + all-gather, the same volume. */
  l.zero = 1;
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  ck_assert_double_eq(e.comm_dp, 2 * 0.75 * 4 * P);
  /* ZeRO-2: a reduce-scatter per micro-batch (2) + one all-gather. */
  l.zero = 2;
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  ck_assert_double_eq(e.comm_dp, 2 * 0.75 * 4 * P + 0.75 * 4 * P);
  /* ZeRO-3: per micro-batch two all-gathers and a reduce-scatter: 2 x 0.75 x 12P. */
  l.zero = 3;
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  ck_assert_double_eq(e.comm_dp, 2 * 0.75 * 12 * P);
  /* tp 2 (dp 2): 4 all-reduces per layer and micro-batch of b s h floats, 2 (t-1)/t each:
   * 2 layers x 2 micro-batches x 4 x (2 x 4096 x 4 / 2) bytes; 6 with recomputation. */
  l = (dt_plan_layout_t){2, 2, 1, 0, 4, 2, 0, 0};
  c = cluster(4);
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  const double ar = 2.0 * 0.5 * 4 * 32 * 64 * 4;
  ck_assert_double_eq(e.comm_tp, 2 * 2 * 4 * ar);
  l.ckpt = 1;
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  ck_assert_double_eq(e.comm_tp, 2 * 2 * 6 * ar);
  /* pp 2 (dp 1): each stage sends one b s h activation (or gradient) per micro-batch. */
  l = (dt_plan_layout_t){1, 1, 2, 0, 4, 4, 0, 0};
  c = cluster(2);
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  ck_assert_double_eq(e.comm_pp, 4 * 4.0 * 32 * 64 * 4);
  ck_assert_double_eq(e.comm_dp + e.comm_tp, 0);
  /* The bubble (p - 1) / (m + p - 1) and the step (m + p - 1)/m x compute + exposed comm. */
  ck_assert_double_eq_tol(e.bubble, 1.0 / 5.0, 1e-12);
  ck_assert_double_eq_tol(e.t_step, e.t_compute * 5.0 / 4.0 + e.t_comm, 1e-15);
  /* Compute: 6 P tokens / world / (peak x mfu). */
  ck_assert_double_eq_tol(e.t_compute, 6 * P * 16 * 32 / 2 / (1e12 * 0.5), 1e-15);
}
END_TEST

START_TEST(test_activations)
{
  /* mixed16, one stage, no tp, materialised attention: Korthikanti's s b h (34 + 5 a s / h)
   * per layer, plus the stage input and the fp32 logits. */
  dt_plan_model_t m = tiny();
  dt_plan_train_t tr = {32, 8, DT_PLAN_MIXED16, 1};
  dt_plan_layout_t l = {1, 1, 1, 0, 8, 1, 0, 0};
  dt_plan_mem_t mem;
  dt_plan_memory(&m, &tr, &l, 0, &mem);
  const double s = 32, b = 8, h = 64, a = 4, sbh = s * b * h;
  ck_assert_double_eq_tol(mem.acts, 2 * sbh * (34 + 5 * a * s / h) + 2 * sbh + 4 * s * b * 128,
                          1e-6);
  /* Checkpointing keeps 2 s b h per layer plus one layer being recomputed. */
  l.ckpt = 1;
  dt_plan_memory(&m, &tr, &l, 0, &mem);
  ck_assert_double_eq_tol(
      mem.acts, 2 * 2 * sbh + 2 * sbh + 4 * s * b * 128 + sbh * (34 + 5 * a * s / h), 1e-6);
  /* fp32 (the trainer's buffers), one stage, no tp: per layer 15 N C + 4 N + b a s^2 floats,
   * per slot (L + 3) N C + 3 N + N Vp and the 2 N tokens on a GPU, scratch 9 N C + b a s^2. */
  tr.precision = DT_PLAN_FP32;
  l.ckpt = 0;
  dt_plan_memory(&m, &tr, &l, 0, &mem);
  const double N = b * s, C = h, layer = 15 * N * C + 4 * N + b * a * s * s;
  ck_assert_double_eq_tol(
      mem.acts, 4 * (2 * layer + 5 * N * C + 5 * N + N * 128 + 9 * N * C + b * a * s * s), 1e-6);
  /* distrain's bf16: ln1, ln2 (N C each), the MLP's pre-activation and GELU output (4 N C
   * each) of each layer, the final norm's output (N C) and the logits (N Vp) in 2-byte bf16,
   * the rest fp32; in the scratch the pre-activation's gradient (4 N C) is bf16, a bf16 N C is
   * added, and the branch outputs' N C is gone (the projections add them in their GEMMs). */
  tr.precision = DT_PLAN_BF16;
  dt_plan_memory(&m, &tr, &l, 0, &mem);
  const double layer16 = 4 * (5 * N * C + 4 * N + b * a * s * s) + 2 * (10 * N * C);
  const double slot16 = 4 * (4 * N * C + 2 * N) + 2 * layer16 + 2 * (N * C + N * 128) + 4 * 3 * N;
  const double scratch16 = 4 * (4 * N * C + b * a * s * s) + 2 * (4 * N * C + N * C);
  ck_assert_double_eq_tol(mem.acts, slot16 + scratch16, 1e-6);
  /* Flash attention (the default): each query row's lse, b a s floats, in place of the
   * probabilities, none in the scratch; in mixed16, 4 a s b bytes in place of 5 a s^2 b. */
  tr.precision = DT_PLAN_FP32;
  tr.materialized = 0;
  dt_plan_memory(&m, &tr, &l, 0, &mem);
  const double flayer = 15 * N * C + 4 * N + b * a * s;
  ck_assert_double_eq_tol(mem.acts, 4 * (2 * flayer + 5 * N * C + 5 * N + N * 128 + 9 * N * C),
                          1e-6);
  tr.precision = DT_PLAN_MIXED16;
  dt_plan_memory(&m, &tr, &l, 0, &mem);
  ck_assert_double_eq_tol(mem.acts, 2 * (34 * sbh + 4 * a * s * b) + 2 * sbh + 4 * s * b * 128,
                          1e-6);
}
END_TEST

/* Context parallelism: the rule, ZeRO over dp x cp, the trainer's activation buffers with the
 * rank's seq / cp positions, and the q, k, v all-gather / reduce-scatter per layer. */
START_TEST(test_context_parallel)
{
  dt_plan_model_t m = tiny(); /* 2 layers, h 64, 4 heads, Vp 128 */
  dt_plan_train_t tr = {32, 8, DT_PLAN_FP32, 1};
  dt_plan_cluster_t c = cluster(4);
  char why[256];
  dt_plan_layout_t bad = {1, 1, 1, 0, 8, 1, 0, 3};
  c.gpus = 3;
  ck_assert_int_eq(dt_plan_layout_check(&m, &tr, &c, &bad, why, sizeof why), DT_EINVAL);
  ck_assert_msg(strstr(why, "cp (3): 2 x cp must divide the sequence (32)"), "%s", why);
  c.gpus = 4;
  dt_plan_layout_t l = {2, 1, 1, 1, 4, 1, 0, 2}; /* dp 2 x cp 2, ZeRO-1 */
  ck_assert_int_eq(dt_plan_layout_check(&m, &tr, &c, &l, why, sizeof why), 0);
  dt_plan_mem_t mem;
  dt_plan_memory(&m, &tr, &l, 0, &mem);
  const double P = 128 * 64 + 32 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64;
  ck_assert_double_eq(mem.params, 4 * P);
  ck_assert_double_eq(mem.optim, 8 * ceil(P / 4)); /* sharded over dp x cp = 4 */
  /* Per layer the trainer keeps 3 N C + 4 N for its norms and residual, the whole sequence's
   * qkv (cp N 3C), the attention output N C, the two chunks' probabilities b a (s/2)^2 (2 cp +
   * 1) and the MLP's 8 N C, with N = b s over its s = 16 positions; the slot and the scratch as
   * without cp, the scratch plus the gathered rows and their gradients, 2 cp N 3C. */
  const double b = 4, s = 16, N = b * s, C = 64, a = 4, att = b * a * 8 * 8 * 5;
  const double layer = 3 * N * C + 4 * N + 2 * N * 3 * C + N * C + att + 8 * N * C;
  const double slot = 4 * N * C + N * C + 5 * N + N * 128; /* with the 2 N tokens */
  const double scratch = 2 * N * C + 4 * N * C + 3 * N * C + att + 2 * 2 * N * 3 * C;
  ck_assert_double_eq_tol(mem.acts, 4 * (2 * layer + slot + scratch), 1e-6);
  /* Flash attention: the lse of the rank's s rows in place of the probabilities, none in the
   * scratch. */
  tr.materialized = 0;
  dt_plan_memory(&m, &tr, &l, 0, &mem);
  const double fatt = b * a * s;
  ck_assert_double_eq_tol(mem.acts, 4 * (2 * (layer - att + fatt) + slot + scratch - att), 1e-6);
  tr.materialized = 1;
  /* Communication: per layer and micro-batch one all-gather and one reduce-scatter of
   * (cp - 1) N 3C floats; a third with recomputation. */
  dt_plan_eval_t e;
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  ck_assert_double_eq(e.comm_cp, 2 * 1 * 2 * (N * 3 * C) * 4);
  ck_assert_double_eq(e.comm, e.comm_dp + e.comm_cp);
  l.ckpt = 1;
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  ck_assert_double_eq(e.comm_cp, 2 * 1 * 3 * (N * 3 * C) * 4);
  /* Compute is split over all 4 ranks. */
  ck_assert_double_eq_tol(e.t_compute, 8 * P * 8 * 32 / 4 / (1e12 * 0.5), 1e-15);
}
END_TEST

START_TEST(test_layout_check)
{
  dt_plan_model_t m = tiny(); /* 2 layers, 4 heads */
  dt_plan_train_t tr = {32, 16, DT_PLAN_BF16, 0};
  dt_plan_cluster_t c = cluster(6);
  char why[256];
  dt_plan_layout_t ok = {2, 1, 3, 0, 8, 1, 0, 0};
  ck_assert_int_eq(dt_plan_layout_check(&m, &tr, &c, &ok, why, sizeof why), DT_EINVAL);
  ck_assert_msg(strstr(why, "pp (3) must divide the layers (2)"), "%s", why);
  dt_plan_layout_t tp3 = {2, 3, 1, 0, 8, 1, 0, 0};
  ck_assert_int_eq(dt_plan_layout_check(&m, &tr, &c, &tp3, why, sizeof why), DT_EINVAL);
  ck_assert_msg(strstr(why, "tp (3) must divide the attention heads (4)"), "%s", why);
  dt_plan_layout_t world = {4, 1, 1, 0, 4, 1, 0, 0};
  ck_assert_int_eq(dt_plan_layout_check(&m, &tr, &c, &world, why, sizeof why), DT_EINVAL);
  ck_assert_msg(strstr(why, "not the 6 GPUs"), "%s", why);
  dt_plan_layout_t batch = {6, 1, 1, 0, 2, 1, 0, 0};
  ck_assert_int_eq(dt_plan_layout_check(&m, &tr, &c, &batch, why, sizeof why), DT_EINVAL);
  ck_assert_msg(strstr(why, "global batch 16"), "%s", why);
  c = cluster(4);
  c.gpus_per_node = 2;
  dt_plan_layout_t wide = {1, 4, 1, 0, 16, 1, 0, 0};
  ck_assert_int_eq(dt_plan_layout_check(&m, &tr, &c, &wide, why, sizeof why), DT_EINVAL);
  ck_assert_msg(strstr(why, "within a node"), "%s", why);
  dt_plan_layout_t fine = {2, 2, 1, 3, 4, 2, 1, 0};
  ck_assert_int_eq(dt_plan_layout_check(&m, &tr, &c, &fine, why, sizeof why), 0);
}
END_TEST

START_TEST(test_enumerate)
{
  dt_plan_model_t m;
  char why[256];
  ck_assert_int_eq(dt_plan_preset("llama-7b", &m), 0);
  ck_assert_int_eq(dt_plan_model_check(&m, 4096, why, sizeof why), 0);
  dt_plan_train_t tr = {4096, 64, DT_PLAN_BF16, 0};
  dt_plan_cluster_t c = {8, 8, 80.0 * (1 << 30), 989e12, 0.4, 450e9, 50e9, 10e-6, 1 << 30};
  dt_plan_eval_t *v;
  int n;
  ck_assert_int_eq(dt_plan_enumerate(&m, &tr, &c, &v, &n, why, sizeof why), 0);
  ck_assert_int_gt(n, 10);
  int fitting = 0, with_cp = 0;
  for (int i = 0; i < n; i++) {
    const dt_plan_layout_t *l = &v[i].layout;
    ck_assert_int_eq(dt_plan_layout_check(&m, &tr, &c, l, why, sizeof why), 0);
    ck_assert_int_eq(m.heads % l->tp, 0);
    ck_assert_int_eq(m.layers % l->pp, 0);
    ck_assert_int_ge(l->cp, 1);
    ck_assert_int_eq(tr.seq % (2 * l->cp), 0);
    ck_assert_int_eq(l->dp * l->tp * l->pp * l->cp, 8);
    with_cp += l->cp > 1;
    fitting += v[i].fits;
    if (i > 0 && v[i].fits)
      ck_assert(v[i - 1].fits && v[i - 1].t_step <= v[i].t_step);
    if (i > 0 && !v[i].fits && !v[i - 1].fits)
      ck_assert(v[i - 1].mem.total <= v[i].mem.total);
  }
  ck_assert_int_gt(fitting, 0);
  ck_assert_int_gt(with_cp, 0);
  ck_assert(v[0].fits);
  /* 7B under plain DDP needs 18 x 6.74e9 bytes of model state: never fits in 80 GiB. */
  for (int i = 0; i < n; i++)
    if (v[i].layout.dp == 8 && v[i].layout.zero == 0)
      ck_assert(!v[i].fits);
  free(v);
  /* A cluster the batch cannot be split over: no layout. */
  c.gpus = 7;
  ck_assert_int_eq(dt_plan_enumerate(&m, &tr, &c, &v, &n, why, sizeof why), 0);
  ck_assert_int_eq(n, 0);
  free(v);
  c.gpus = 0;
  ck_assert_int_eq(dt_plan_enumerate(&m, &tr, &c, &v, &n, why, sizeof why), DT_EINVAL);
}
END_TEST

/* Layouts the time model cannot tell apart (gpt2-124m over DDP: every micro-batch size hides the
 * all-reduce behind the last backward pass) come with the fewest, largest micro-batches that fit
 * first, not the smallest ones: what a GPU runs fastest. 48 sequences per rank: 3 micro-batches
 * of 16 take the same time as 1 of 48, exactly. */
START_TEST(test_equal_times_prefer_large_micro_batches)
{
  dt_plan_model_t m = gpt2_124m();
  char why[256];
  const struct {
    int global_batch;
    double gib;
    int micro;
  } cases[] = {{512, 80, 64}, {512, 16, 16}, {384, 80, 48}};
  for (size_t k = 0; k < DT_ARRAY_SIZE(cases); k++) {
    dt_plan_train_t tr = {1024, cases[k].global_batch, DT_PLAN_BF16, 0};
    dt_plan_cluster_t c = cluster(8);
    c.gpu_mem = cases[k].gib * (1 << 30);
    dt_plan_eval_t *v;
    int n;
    ck_assert_int_eq(dt_plan_enumerate(&m, &tr, &c, &v, &n, why, sizeof why), 0);
    ck_assert(v[0].fits);
    ck_assert_int_eq(v[0].layout.dp, 8);
    ck_assert_int_eq(v[0].layout.zero, 0);
    ck_assert_msg(v[0].layout.micro == cases[k].micro, "batch %d, %g GiB: micro-batch %d first",
                  cases[k].global_batch, cases[k].gib, v[0].layout.micro);
    for (int i = 1; i < n && v[i].fits; i++)
      if (v[i].t_step == v[i - 1].t_step && v[i].comm == v[i - 1].comm)
        ck_assert_int_le(v[i - 1].layout.accum, v[i].layout.accum);
    int ties = 0; /* the DDP layouts of every micro-batch size that fits are equally fast */
    for (int i = 0; i < n; i++)
      ties += v[i].fits && v[i].layout.dp == 8 && v[i].layout.zero == 0 && !v[i].layout.ckpt &&
              v[i].t_step == v[0].t_step;
    ck_assert_int_ge(ties, 3);
    free(v);
  }
}
END_TEST

/* The GPU trainer's own buffers for gpt2-124m at micro-batch 16 x 1024 (N = 16384 rows), worked
 * out from kernels/cuda's requests: under bf16 the largest request is the flash attention
 * backward's: D (16 x 12 x 1024 floats, 0.75 MiB) and the score gradients' bf16 tiles of 64 x 64
 * on and below the diagonal (16 x 16 / 2 + 8 = 136 a head, 8 KiB each: 16 x 12 x 136 x 8 KiB =
 * 204 MiB, within 1 GiB: one group), 205 MiB when rounded up. With materialized attention under
 * ZeRO-3 the qkv layer's backward is the largest: its output gradient is fp32 there, so a bf16
 * copy of it (N x 2304: 72 MiB), its bias gradient's partial sums (64 blocks of 256 rows x 2304
 * floats, 0.5625 MiB) and the weight's bf16 copy (2304 x 768: 3.375 MiB), 76 MiB when rounded up
 * (the LM head's bf16 copy of the embedding, 50304 x 768, is 73.7 MiB). One sequence of 16384:
 * 256 x 257 / 2 = 32896 tiles a head (257 MiB), 12 heads past 1 GiB, so 4 groups of 3 heads:
 * 771 MiB and D's 0.75, 772 MiB. Of 65536: a head's tiles (4 GiB) never fit, and the dq kernel
 * recomputes; the largest request is then a projection's backward (a bf16 copy of its 65536 x 768
 * output gradient, 96 MiB, and its bias gradient's partial sums, 0.75 MiB): 97 MiB. Under fp32,
 * LayerNorm's partials (512 chunks of 32 rows, 2 x 768 floats each: 3 MiB) and the vector of
 * ones (64 KiB: 1 MiB). Plus cuBLASLt's 32 MiB. */
START_TEST(test_device_buffers)
{
  dt_plan_model_t m = gpt2_124m();
  const double MiB = 1 << 20;
  const struct {
    dt_plan_precision_t prec;
    int dp, zero, materialized, seq, micro;
    double mib;
  } cases[] = {
      {DT_PLAN_BF16, 1, 0, 0, 1024, 16, 32 + 205},   {DT_PLAN_BF16, 8, 3, 1, 1024, 16, 32 + 76},
      {DT_PLAN_FP32, 1, 0, 0, 1024, 16, 32 + 3 + 1}, {DT_PLAN_MIXED16, 1, 0, 0, 1024, 16, 0},
      {DT_PLAN_BF16, 1, 0, 0, 16384, 1, 32 + 772},   {DT_PLAN_BF16, 1, 0, 0, 65536, 1, 32 + 97},
  };
  for (size_t k = 0; k < DT_ARRAY_SIZE(cases); k++) {
    dt_plan_train_t tr = {cases[k].seq, cases[k].micro * cases[k].dp, cases[k].prec,
                          cases[k].materialized};
    dt_plan_layout_t l = {cases[k].dp, 1, 1, cases[k].zero, cases[k].micro, 1, 0, 1};
    dt_plan_mem_t mem;
    dt_plan_memory(&m, &tr, &l, 0, &mem);
    ck_assert_msg(mem.device == cases[k].mib * MiB, "case %zu: %.4f MiB", k, mem.device / MiB);
    ck_assert(mem.total ==
              mem.params + mem.grads + mem.optim + mem.working + mem.acts + mem.device);
  }
  /* The reserve: a layout fits when its total and the reserve do. */
  dt_plan_train_t tr = {1024, 16, DT_PLAN_BF16, 0};
  dt_plan_layout_t l = {1, 1, 1, 0, 16, 1, 0, 1};
  dt_plan_cluster_t c = cluster(1);
  dt_plan_eval_t e;
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  c.gpu_mem = e.mem.total;
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  ck_assert(e.fits);
  c.reserve = 1;
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  ck_assert(!e.fits);
}
END_TEST

START_TEST(test_emit_spec_parses)
{
  dt_plan_model_t m = gpt2_124m();
  char why[256], err[1024];
  dt_plan_train_t tr = {1024, 64, DT_PLAN_BF16, 0};
  dt_plan_cluster_t c = cluster(8);
  dt_plan_layout_t l = {2, 2, 2, 1, 4, 8, 1, 0};
  ck_assert_int_eq(dt_plan_layout_check(&m, &tr, &c, &l, why, sizeof why), 0);
  dt_plan_eval_t e;
  dt_plan_evaluate(&m, &tr, &c, &l, &e);
  char *text = NULL;
  size_t len = 0;
  FILE *fp = open_memstream(&text, &len);
  ck_assert_ptr_nonnull(fp);
  dt_ctl_plan_emit_spec(fp, &m, &tr, &e);
  fclose(fp);
  Distrain__V1__JobSpec *spec;
  ck_assert_int_eq(dt_jobspec_new_default(&spec), 0);
  ck_assert_msg(dt_jobspec_parse_yaml(text, len, "plan", spec, err, sizeof err) == 0, "%s\n%s", err,
                text);
  ck_assert_int_eq(spec->model->layers, 12);
  ck_assert_int_eq(spec->model->channels, 768);
  ck_assert_int_eq(spec->training->batch, 64);
  ck_assert_int_eq(spec->training->micro_batch, 4);
  ck_assert_str_eq(spec->training->precision, "bf16"); /* what the plan assumed */
  ck_assert_int_eq(spec->parallel->dp, 2);
  ck_assert_int_eq(spec->parallel->tp, 2);
  ck_assert_int_eq(spec->parallel->pp, 2);
  ck_assert_int_eq(spec->parallel->zero_stage, 1);
  ck_assert(spec->parallel->activation_checkpointing);
  ck_assert_int_eq(dt_jobspec_grad_accum(spec, 2), 8);
  ck_assert_int_eq(dt_jobspec_set(spec, "data.train=train.bin", err, sizeof err), 0);
  ck_assert_msg(dt_jobspec_validate(spec, err, sizeof err) == 0, "%s\n%s", err, text);
  dt_jobspec_free(spec);
  free(text);
}
END_TEST

static Suite *planner_suite(void)
{
  Suite *s = suite_create("planner");
  TCase *t = tcase_create("model");
  tcase_add_test(t, test_textbook_table);
  tcase_add_test(t, test_param_counts);
  tcase_add_test(t, test_rank_params);
  tcase_add_test(t, test_activations);
  tcase_add_test(t, test_device_buffers);
  suite_add_tcase(s, t);
  t = tcase_create("layouts");
  tcase_add_test(t, test_comm_volumes);
  tcase_add_test(t, test_layout_check);
  tcase_add_test(t, test_context_parallel);
  tcase_add_test(t, test_enumerate);
  tcase_add_test(t, test_equal_times_prefer_large_micro_batches);
  tcase_add_test(t, test_emit_spec_parses);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(planner_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
