/* gelu.c — GELU with the tanh approximation (GPT-2's), forward and backward:
 *   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
#include <math.h>

#include "cpu_kernels.h"
#include "vecmath.h"

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */

/* Threads take whole blocks, and each block is one simd loop: which elements go through the
 * vector tanhf and which through the scalar tail is then fixed by n alone, so results do not
 * depend on the thread count (the two tanhf variants may differ in the last ulp). */
#define GELU_BLOCK 4096

void dt_cpu_gelu_forward(float *out, const float *inp, size_t n)
{
#pragma omp parallel for schedule(static)
  for (size_t b = 0; b < n; b += GELU_BLOCK) {
    size_t end = b + GELU_BLOCK < n ? b + GELU_BLOCK : n;
#pragma omp simd
    for (size_t i = b; i < end; i++) {
      float x = inp[i];
      float u = GELU_SCALE * (x + 0.044715f * x * x * x);
      out[i] = 0.5f * x * (1.0f + tanhf(u));
    }
  }
}

void dt_cpu_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n)
{
#pragma omp parallel for schedule(static)
  for (size_t b = 0; b < n; b += GELU_BLOCK) {
    size_t end = b + GELU_BLOCK < n ? b + GELU_BLOCK : n;
#pragma omp simd
    for (size_t i = b; i < end; i++) {
      float x = inp[i];
      float u = GELU_SCALE * (x + 0.044715f * x * x * x);
      float th = tanhf(u);
      float sech2 = 1.0f - th * th;
      float local =
          0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
      dinp[i] = local * dout[i];
    }
  }
}
