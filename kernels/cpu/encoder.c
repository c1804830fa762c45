/* encoder.c — token + position embedding, forward and backward. */
#include "cpu_kernels.h"

void dt_cpu_encoder_forward(float *out, const int *inp, const float *wte, const float *wpe, int B,
                            int T, int C)
{
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; bt++) {
    const float *te = wte + (size_t)inp[bt] * C;
    const float *pe = wpe + (size_t)(bt % T) * C;
    float *o = out + (size_t)bt * C;
    for (int c = 0; c < C; c++)
      o[c] = te[c] + pe[c];
  }
}

/* Several rows may hit the same token, so the wte scatter is serial per token row; the
 * channels are split across threads instead, which keeps every write private to one thread
 * and the summation order identical to the serial one (results do not depend on threads). */
void dt_cpu_encoder_backward(float *dwte, float *dwpe, const float *dout, const int *inp, int B,
                             int T, int C)
{
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int c = 0; c < C; c++) {
      for (int bt = 0; bt < B * T; bt++) {
        float d = dout[(size_t)bt * C + c];
        dwte[(size_t)inp[bt] * C + c] += d;
      }
    }
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
