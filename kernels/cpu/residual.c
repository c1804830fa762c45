/* residual.c — the residual add. Its backward is the identity on both inputs, so the model
 * passes the residual-stream gradient through without a kernel. */
#include "cpu_kernels.h"

void dt_cpu_residual_forward(float *out, const float *a, const float *b, size_t n)
{
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++)
    out[i] = a[i] + b[i];
}
