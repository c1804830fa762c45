/* att_close.h — how test_cuda (the GPU's) and test_flash_emul (the emulated) bf16 attention
 * kernels are compared with the CPU's.
 *
 * The two sides' exponentials differ by a few fp32 ulps (the GPU's 2^x of one FMA, glibc's e^x:
 * ops.h), so now and then a probability or a score gradient rounds to the next bf16 value on one
 * side: that element's terms move by a bf16 step (2^-8 relative), which where p is near 1 is a
 * few percent of the tensor's largest value (test_cuda's hs-64, T-1100 chunks met 0.73% of it,
 * from one such p), while every other element differs only by fp32 summation order. So: the
 * relative L2 error within ATT_L2_TOL (a few such elements among thousands barely move it; a
 * wrong tile, mask or row moves many), and the largest error within ATT_MAX_TOL of the largest
 * value (no element off by more than a few such steps). C and C++ alike. */
#ifndef DT_TESTS_ATT_CLOSE_H
#define DT_TESTS_ATT_CLOSE_H

#include <math.h>
#include <stddef.h>

#define ATT_L2_TOL  1e-3
#define ATT_MAX_TOL 5e-2

/* 1 when got is within both bounds of want; *l2 and *worst the two errors (infinite where got
 * holds a NaN or an infinity). */
static inline int att_close(const float *got, const float *want, size_t n, double *l2,
                            double *worst)
{
  double d2 = 0.0, w2 = 0.0, dmax = 0.0, wmax = 0.0;
  for (size_t i = 0; i < n; i++) {
    const double d = fabs((double)got[i] - (double)want[i]), w = fabs((double)want[i]);
    d2 += d * d;
    w2 += w * w;
    dmax = d > dmax || isnan(d) ? d : dmax;
    wmax = w > wmax ? w : wmax;
  }
  *l2 = isfinite(d2) ? sqrt(d2 / (w2 > 1e-60 ? w2 : 1e-60)) : INFINITY;
  *worst = isfinite(dmax) ? dmax / (wmax > 1e-30 ? wmax : 1e-30) : INFINITY;
  return *l2 <= ATT_L2_TOL && *worst <= ATT_MAX_TOL;
}

#endif
