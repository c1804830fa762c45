/* softmax.cuh — the causal softmax kernels of the materialised attention (attention.cu
 * launches them between its GEMMs, one block of ATT_THREADS per row of scores). Device code
 * only, also compiled for the host by tests/unit/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_SOFTMAX_CUH
#define DT_KERNELS_CUDA_SOFTMAX_CUH

#include <math.h>

#include "block.cuh"

#define ATT_THREADS 256 /* softmax kernels, one block per row of one (b, h) matrix */

/* Row r of the (B*NH*Tq, Tk) matrix of scores is query position t = q0 + r % Tq: probabilities
 * over j <= t, exact zeros after. The scores arrive already scaled by 1/sqrt(hs) (the GEMM's
 * alpha). */
__global__ static void causal_softmax_kernel(float *att, int Tq, int Tk, int q0)
{
  float *row = att + (size_t)blockIdx.x * Tk;
  const int t = q0 + (int)(blockIdx.x % (unsigned)Tq);
  float m = -INFINITY;
  for (int j = threadIdx.x; j <= t; j += blockDim.x)
    m = row[j] > m ? row[j] : m;
  m = dt__block_reduce(m, dt__max_op());
  float s = 0.0f;
  for (int j = threadIdx.x; j <= t; j += blockDim.x) {
    const float e = expf(row[j] - m);
    row[j] = e;
    s += e;
  }
  s = dt__block_reduce(s, dt__sum_op());
  const float inv = 1.0f / s;
  /* Each thread rescales the entries it wrote itself above. */
  for (int j = threadIdx.x; j < Tk; j += blockDim.x)
    row[j] = j <= t ? row[j] * inv : 0.0f;
}

/* Softmax backward with the 1/sqrt(hs) of the scores folded in, in place on the datt rows:
 * dS = scale * A * (dA - sum_j A dA) for j <= t, exact zeros after. */
__global__ static void causal_softmax_backward_kernel(float *dS, const float *att, int Tq, int Tk,
                                                      int q0, float scale)
{
  float *d = dS + (size_t)blockIdx.x * Tk;
  const float *a = att + (size_t)blockIdx.x * Tk;
  const int t = q0 + (int)(blockIdx.x % (unsigned)Tq);
  float dot = 0.0f;
  for (int j = threadIdx.x; j <= t; j += blockDim.x)
    dot += a[j] * d[j];
  dot = dt__block_reduce(dot, dt__sum_op());
  for (int j = threadIdx.x; j < Tk; j += blockDim.x)
    d[j] = j <= t ? scale * a[j] * (d[j] - dot) : 0.0f;
}

#endif
