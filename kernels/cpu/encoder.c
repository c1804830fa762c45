/* encoder.c — token + position embedding, forward and backward.
 *
 * The token table may be a vocabulary-parallel slice: rows [vocab_lo, vocab_lo + vocab_n) of
 * the full table. Tokens outside it contribute nothing (their rows live on another rank), so
 * the sum over the slices (an all-reduce) equals the full lookup exactly: adding zeros does
 * not round. wpe NULL leaves the position term out (it is added on one rank only). */
#include "cpu_kernels.h"

void dt_cpu_encoder_forward(float *out, const int *inp, const float *wte, int vocab_lo, int vocab_n,
                            const float *wpe, int B, int T, int C)
{
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; bt++) {
    const int row = inp[bt] - vocab_lo;
    const float *te = row >= 0 && row < vocab_n ? wte + (size_t)row * C : NULL;
    const float *pe = wpe ? wpe + (size_t)(bt % T) * C : NULL;
    float *o = out + (size_t)bt * C;
    for (int c = 0; c < C; c++)
      o[c] = (te ? te[c] : 0.0f) + (pe ? pe[c] : 0.0f);
  }
}

/* Several rows may hit the same token, so the wte scatter is serial per token row; the
 * channels are split across threads instead, which keeps every write private to one thread
 * and the summation order identical to the serial one (results do not depend on threads). */
void dt_cpu_encoder_backward(float *dwte, int vocab_lo, int vocab_n, float *dwpe, const float *dout,
                             const int *inp, int B, int T, int C)
{
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int c = 0; c < C; c++) {
      for (int bt = 0; bt < B * T; bt++) {
        const int row = inp[bt] - vocab_lo;
        if (row >= 0 && row < vocab_n)
          dwte[(size_t)row * C + c] += dout[(size_t)bt * C + c];
      }
    }
    if (dwpe) {
#pragma omp for schedule(static)
      for (int t = 0; t < T; t++) {
        float *dp = dwpe + (size_t)t * C;
        for (int b = 0; b < B; b++) {
          const float *d = dout + ((size_t)b * T + t) * C;
          for (int c = 0; c < C; c++)
            dp[c] += d[c];
        }
      }
    }
  }
}
