/* emul_expect.h — the emulation suites' comparison (test_cuda_emul, test_flash_emul). */
#ifndef DT_TESTS_EMUL_EXPECT_H
#define DT_TESTS_EMUL_EXPECT_H

#include <check.h>

#include <algorithm>
#include <cmath>
#include <vector>

/* max |got - want| / max |want| must be <= tol (NaN or inf never passes): test_cuda's measure,
 * the error against the tensor's scale, since the two sides sum in other orders. */
static void expect_close(const char *what, const std::vector<float> &got,
                         const std::vector<float> &want, double tol = 1e-5)
{
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size(); i++) {
    const double d = fabs((double)got[i] - (double)want[i]);
    worst = std::isfinite(d) ? std::max(worst, d) : INFINITY;
    scale = std::max(scale, fabs((double)want[i]));
  }
  const double e = worst / (scale > 1e-30 ? scale : 1e-30);
  ck_assert_msg(e <= tol, "%s: relative error %.3g over %zu values (tolerance %.0e)", what, e,
                want.size(), tol);
}

#endif
