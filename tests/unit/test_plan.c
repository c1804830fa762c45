/* test_plan.c — Check suite for worker/trainer/plan: DISTRAIN_MESH parsing, the layout rules
 * (one message naming the key and the rule each), and the stage partition (balanced by cost
 * with the LM head on the last stage, or explicit). The communicators it splits are exercised
 * by the tensor- and pipeline-parallel integration tests. */
#include <check.h>
#include <string.h>

#include "dt_error.h"
#include "plan.h"

static const dt_gpt2_config_t CFG = {
    .max_seq = 64, .vocab = 100, .padded_vocab = 128, .layers = 8, .heads = 4, .channels = 64};

START_TEST(test_parse_mesh)
{
  dt_mesh_t m;
  char why[256];
  ck_assert_int_eq(dt_plan_parse_mesh("pp2,dp3,cp1,tp4", &m, why, sizeof why), 0);
  ck_assert_int_eq(m.pp, 2);
  ck_assert_int_eq(m.dp, 3);
  ck_assert_int_eq(m.cp, 1);
  ck_assert_int_eq(m.tp, 4);
  ck_assert_int_eq(dt_plan_parse_mesh("tp2,dp2", &m, why, sizeof why), 0); /* any order */
  ck_assert_int_eq(m.pp * m.dp * m.cp * m.tp, 4);
  const char *bad[] = {"pp2,pp2", "xx2", "tp0", "tp", "tp2;dp2", "tp-1", "dp2,"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    ck_assert_int_eq(dt_plan_parse_mesh(bad[i], &m, why, sizeof why), DT_EINVAL);
    ck_assert_msg(strstr(why, "DISTRAIN_MESH") != NULL, "%s: %s", bad[i], why);
  }
}
END_TEST

START_TEST(test_check_rules)
{
  char why[256];
  struct {
    dt_mesh_t mesh;
    int seq, rc;
    const char *msg;
  } cases[] = {
      {{.pp = 2, .dp = 2, .cp = 1, .tp = 4}, 64, 0, NULL},
      {{.pp = 1, .dp = 1, .cp = 1, .tp = 3},
       64,
       DT_EINVAL,
       "model.heads (4) must be divisible by parallel.tp (3)"},
      {{.pp = 9, .dp = 1, .cp = 1, .tp = 1},
       64,
       DT_EINVAL,
       "parallel.pp (9) must be <= model.layers (8)"},
      {{.pp = 1, .dp = 1, .cp = 2, .tp = 1}, 64, 0, NULL},
      {{.pp = 1, .dp = 1, .cp = 3, .tp = 1},
       64,
       DT_EINVAL,
       "training.seq (64) must be divisible by 2 x parallel.cp (3)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    why[0] = 0;
    ck_assert_int_eq(dt_plan_check(&cases[i].mesh, &CFG, cases[i].seq, why, sizeof why),
                     cases[i].rc);
    if (cases[i].msg)
      ck_assert_msg(strstr(why, cases[i].msg) != NULL, "case %zu: '%s'", i, why);
  }
  dt_gpt2_config_t wide = CFG;
  wide.heads = 256;
  wide.channels = 256;
  dt_mesh_t tp256 = {.pp = 1, .dp = 1, .cp = 1, .tp = 256};
  ck_assert_int_eq(dt_plan_check(&tp256, &wide, 64, why, sizeof why), DT_EINVAL);
  ck_assert_msg(strstr(why, "padded vocabulary (128) must be divisible by parallel.tp (256)"), "%s",
                why);
}
END_TEST

START_TEST(test_partition)
{
  char why[256];
  int b[5];
  /* balanced: every stage gets layers, the bounds cover all of them in order */
  for (int pp = 1; pp <= 4; pp++) {
    ck_assert_int_eq(dt_plan_partition(&CFG, pp, NULL, b, why, sizeof why), 0);
    ck_assert_int_eq(b[0], 0);
    ck_assert_int_eq(b[pp], CFG.layers);
    for (int s = 0; s < pp; s++)
      ck_assert_int_ge(b[s + 1] - b[s], 1);
  }
  /* a heavy LM head (Vp >> 12C) moves layers off the last stage */
  dt_gpt2_config_t heavy = CFG;
  heavy.vocab = 8000;
  heavy.padded_vocab = 8064;
  heavy.channels = 16;
  heavy.heads = 4;
  ck_assert_int_eq(dt_plan_partition(&heavy, 2, NULL, b, why, sizeof why), 0);
  ck_assert_int_gt(b[1] - b[0], b[2] - b[1]);
  /* explicit */
  int layers[4];
  ck_assert_int_eq(dt_mesh_parse_partition("5,3", 2, 8, layers, why, sizeof why), 0);
  ck_assert_int_eq(dt_plan_partition(&CFG, 2, layers, b, why, sizeof why), 0);
  ck_assert_int_eq(b[1], 5);
  ck_assert_int_eq(b[2], 8);
  ck_assert_int_eq(dt_mesh_parse_partition("5,2", 2, 8, layers, why, sizeof why), DT_EINVAL);
  ck_assert_msg(strstr(why, "parallel.partition '5,2' gives 2 stages 7 layers"), "%s", why);
  ck_assert_int_eq(dt_mesh_parse_partition("4,4,0", 3, 8, layers, why, sizeof why), DT_EINVAL);
  /* counts whose sum passes INT_MAX (a signed overflow, caught by the sanitizer build) */
  ck_assert_int_eq(
      dt_mesh_parse_partition("2147483647,2147483647", 2, 2147483647, layers, why, sizeof why),
      DT_EINVAL);
  ck_assert_msg(strstr(why, "gives 2 stages 4294967294 layers"), "%s", why);
  ck_assert_int_eq(dt_mesh_parse_partition("8", 2, 8, layers, why, sizeof why), DT_EINVAL);
}
END_TEST

int main(void)
{
  Suite *s = suite_create("plan");
  TCase *tc = tcase_create("plan");
  tcase_add_test(tc, test_parse_mesh);
  tcase_add_test(tc, test_check_rules);
  tcase_add_test(tc, test_partition);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
