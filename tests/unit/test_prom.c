/* test_prom.c — Check suite for coordinator/prom: the Prometheus text format the coordinator's
 * /metrics writes. Escaping of label values and HELP text, exact value formatting (NaN, +Inf,
 * integers, 0.1), and histograms: bucket boundaries inclusive, buckets cumulative, le="+Inf"
 * equal to _count, _sum. The whole endpoint, scraped by a real Prometheus server, is
 * tests/integration/test_metrics.py. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "prom.h"

/* What fn wrote, as a malloc'd string. */
#define CAPTURE(var, ...)                                                                          \
  char *var = NULL;                                                                                \
  do {                                                                                             \
    size_t size_;                                                                                  \
    FILE *out = open_memstream(&var, &size_);                                                      \
    ck_assert_ptr_nonnull(out);                                                                    \
    __VA_ARGS__;                                                                                   \
    fclose(out);                                                                                   \
  } while (0)

START_TEST(test_label_values_are_escaped)
{
  const dt_prom_label_t l[] = {{"job", "a\"b\\c\nd"}, {"host", "plain"}};
  CAPTURE(s, dt_prom_sample(out, "m", l, 2, 1));
  ck_assert_str_eq(s, "m{job=\"a\\\"b\\\\c\\nd\",host=\"plain\"} 1\n");
  free(s);
  CAPTURE(bare, dt_prom_sample(out, "m", NULL, 0, 2));
  ck_assert_str_eq(bare, "m 2\n");
  free(bare);
}
END_TEST

START_TEST(test_help_is_escaped)
{
  CAPTURE(s, dt_prom_family(out, "m", "counter", "a \\ b\nc \"q\""));
  /* HELP escapes backslash and newline only: a double quote stays as it is */
  ck_assert_str_eq(s, "# HELP m a \\\\ b\\nc \"q\"\n# TYPE m counter\n");
  free(s);
}
END_TEST

START_TEST(test_values)
{
  static const struct {
    double v;
    const char *text;
  } cases[] = {
      {0, "0"},
      {1, "1"},
      {-3, "-3"},
      {0.1, "0.1"},
      {2.5, "2.5"},
      {1e-300, "1e-300"},
      {123456789, "123456789"},
      {9007199254740993.0, "9007199254740992"},
      {1.0 / 3.0, "0.33333333333333331"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    CAPTURE(s, dt_prom_value(out, cases[i].v));
    ck_assert_str_eq(s, cases[i].text);
    ck_assert(strtod(s, NULL) == cases[i].v); /* reads back exactly */
    free(s);
  }
  CAPTURE(nan_, dt_prom_value(out, NAN));
  ck_assert_str_eq(nan_, "NaN");
  CAPTURE(pinf, dt_prom_value(out, INFINITY));
  ck_assert_str_eq(pinf, "+Inf");
  CAPTURE(ninf, dt_prom_value(out, -INFINITY));
  ck_assert_str_eq(ninf, "-Inf");
  free(nan_), free(pinf), free(ninf);
}
END_TEST

START_TEST(test_histogram_cumulative)
{
  static const double bounds[] = {0.25, 0.5, 1};
  dt_prom_hist_t h;
  dt_prom_hist_init(&h, bounds, 3);
  /* 0.25 is in the first bucket (le is inclusive); 5 only in +Inf; NaN is not counted (the
   * values are exact in binary, so is their sum) */
  const double obs[] = {0.125, 0.25, 0.375, 0.75, 0.75, 5, NAN};
  for (size_t i = 0; i < sizeof obs / sizeof obs[0]; i++)
    dt_prom_hist_observe(&h, obs[i]);
  ck_assert_uint_eq(h.count, 6);
  const dt_prom_label_t l[] = {{"job", "job-1"}};
  CAPTURE(s, dt_prom_hist_write(out, "d_seconds", l, 1, &h));
  ck_assert_str_eq(s, "d_seconds_bucket{job=\"job-1\",le=\"0.25\"} 2\n"
                      "d_seconds_bucket{job=\"job-1\",le=\"0.5\"} 3\n"
                      "d_seconds_bucket{job=\"job-1\",le=\"1\"} 5\n"
                      "d_seconds_bucket{job=\"job-1\",le=\"+Inf\"} 6\n"
                      "d_seconds_sum{job=\"job-1\"} 7.25\n"
                      "d_seconds_count{job=\"job-1\"} 6\n");
  free(s);
}
END_TEST

START_TEST(test_histogram_empty_and_unlabelled)
{
  static const double bounds[] = {1};
  dt_prom_hist_t h;
  dt_prom_hist_init(&h, bounds, 1);
  CAPTURE(s, dt_prom_hist_write(out, "x", NULL, 0, &h));
  ck_assert_str_eq(s, "x_bucket{le=\"1\"} 0\nx_bucket{le=\"+Inf\"} 0\nx_sum 0\nx_count 0\n");
  free(s);
}
END_TEST

START_TEST(test_histogram_bucket_limit)
{
  double bounds[DT_PROM_MAX_BUCKETS + 4];
  for (int i = 0; i < DT_PROM_MAX_BUCKETS + 4; i++)
    bounds[i] = i + 1;
  dt_prom_hist_t h;
  dt_prom_hist_init(&h, bounds, DT_PROM_MAX_BUCKETS + 4);
  ck_assert_uint_eq(h.n_bounds, DT_PROM_MAX_BUCKETS); /* never past the counts array */
  dt_prom_hist_observe(&h, 1000);
  ck_assert_uint_eq(h.counts[DT_PROM_MAX_BUCKETS], 1);
}
END_TEST

static Suite *prom_suite(void)
{
  Suite *s = suite_create("prom");
  TCase *t = tcase_create("format");
  tcase_add_test(t, test_label_values_are_escaped);
  tcase_add_test(t, test_help_is_escaped);
  tcase_add_test(t, test_values);
  tcase_add_test(t, test_histogram_cumulative);
  tcase_add_test(t, test_histogram_empty_and_unlabelled);
  tcase_add_test(t, test_histogram_bucket_limit);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(prom_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
