/* layernorm.cu — LayerNorm over the channel dimension (eps 1e-5) on the GPU, forward and
 * backward (reference: kernels/cpu/layernorm.c, whose arithmetic this follows: float, two-pass
 * statistics, 1 / sqrtf).
 *
 * Forward and the dinp part of backward take one block per row; the row sums are block
 * reductions of fixed shape. dweight / dbias are sums over rows, done in two passes without
 * atomics: pass one gives each (row chunk, channel) one thread that sums its chunk's rows in
 * order into the workspace; pass two gives each channel one thread that adds the chunks' partial
 * sums in chunk order. The chunking depends on N only, so results are bit-identical from run
 * to run (and on any GPU). dinp, dweight and dbias accumulate (+=). */
#include "cuda_impl.h"

#define LN_EPS         1e-5f
#define LN_THREADS     256  /* per-row kernels (a multiple of 32) */
#define LN_COL_THREADS 256  /* channels per block in the column passes */
#define LN_CHUNK_ROWS  32   /* at least this many rows per partial sum */
#define LN_MAX_CHUNKS  1024 /* at most this many partial sums per channel */

__global__ static void layernorm_forward_kernel(float *out, float *mean, float *rstd,
                                                const float *inp, const float *weight,
                                                const float *bias, int C)
{
  const size_t row = blockIdx.x;
  const float *x = inp + row * C;
  float *o = out + row * C;
  float s = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    s += x[c];
  const float m = dt__block_reduce(s, dt__sum_op()) / (float)C;
  float v = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = x[c] - m;
    v += d * d;
  }
  v = dt__block_reduce(v, dt__sum_op()) / (float)C;
  const float rs = 1.0f / sqrtf(v + LN_EPS);
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    o[c] = (x[c] - m) * rs * weight[c] + bias[c];
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

int dt__cuda_layernorm_forward(struct dt_device *dev, float *out, float *mean, float *rstd,
                               const float *inp, const float *weight, const float *bias, int N,
                               int C)
{
  if (N <= 0 || C <= 0)
    return 0;
  layernorm_forward_kernel<<<(unsigned)N, LN_THREADS, 0, dt__cuda(dev)->stream>>>(
      out, mean, rstd, inp, weight, bias, C);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

/* dinp[row] += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, one block per row. */
__global__ static void layernorm_backward_dinp_kernel(float *dinp, const float *dout,
                                                      const float *inp, const float *weight,
                                                      const float *mean, const float *rstd, int C)
{
  const size_t row = blockIdx.x;
  const float *x = inp + row * C;
  const float *g = dout + row * C;
  float *dx = dinp + row * C;
  const float m = mean[row], s = rstd[row];
  float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float norm = (x[c] - m) * s;
    const float dnorm = weight[c] * g[c];
    dnorm_mean += dnorm;
    dnorm_norm_mean += dnorm * norm;
  }
  dnorm_mean = dt__block_reduce(dnorm_mean, dt__sum_op()) / (float)C;
  dnorm_norm_mean = dt__block_reduce(dnorm_norm_mean, dt__sum_op()) / (float)C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float norm = (x[c] - m) * s;
    const float dnorm = weight[c] * g[c];
    dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
  }
}

/* Pass one: thread (chunk = blockIdx.y, channel c) sums rows [chunk * rows, ...) in order. */
__global__ static void layernorm_backward_partial_kernel(float *part_dw, /* (nchunks, C) */
                                                         float *part_db, /* (nchunks, C) */
                                                         const float *dout, const float *inp,
                                                         const float *mean, const float *rstd,
                                                         int N, int C, int rows)
{
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C)
    return;
  const int chunk = blockIdx.y;
  const int r0 = chunk * rows;
  const int r1 = r0 + rows < N ? r0 + rows : N;
  float dw = 0.0f, db = 0.0f;
  for (int i = r0; i < r1; i++) {
    const float g = dout[(size_t)i * C + c];
    db += g;
    dw += (inp[(size_t)i * C + c] - mean[i]) * rstd[i] * g;
  }
  part_dw[(size_t)chunk * C + c] = dw;
  part_db[(size_t)chunk * C + c] = db;
}

/* Pass two: one thread per channel adds the chunks in order. */
__global__ static void layernorm_backward_final_kernel(float *dweight, float *dbias,
                                                       const float *part_dw, const float *part_db,
                                                       int nchunks, int C)
{
  DT__CUDA_FOR(c, (size_t)C)
  {
    float dw = 0.0f, db = 0.0f;
    for (int k = 0; k < nchunks; k++) {
      dw += part_dw[(size_t)k * C + c];
      db += part_db[(size_t)k * C + c];
    }
    dweight[c] += dw;
    dbias[c] += db;
  }
}

int dt__cuda_layernorm_backward(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                                const float *dout, const float *inp, const float *weight,
                                const float *mean, const float *rstd, int N, int C)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (N <= 0 || C <= 0)
    return 0;
  layernorm_backward_dinp_kernel<<<(unsigned)N, LN_THREADS, 0, cu->stream>>>(dinp, dout, inp,
                                                                             weight, mean, rstd, C);
  DT_CUDA_CHECK(cudaGetLastError());

  int rows = (N + LN_MAX_CHUNKS - 1) / LN_MAX_CHUNKS;
  if (rows < LN_CHUNK_ROWS)
    rows = LN_CHUNK_ROWS;
  const int nchunks = (N + rows - 1) / rows;
  void *ws = NULL;
  int rc = dt__cuda_workspace(cu, 2 * (size_t)nchunks * C * sizeof(float), &ws);
  if (rc < 0)
    return rc;
  float *part_dw = (float *)ws;
  float *part_db = part_dw + (size_t)nchunks * C;
  dim3 grid((unsigned)((C + LN_COL_THREADS - 1) / LN_COL_THREADS), (unsigned)nchunks);
  layernorm_backward_partial_kernel<<<grid, LN_COL_THREADS, 0, cu->stream>>>(
      part_dw, part_db, dout, inp, mean, rstd, N, C, rows);
  DT_CUDA_CHECK(cudaGetLastError());
  layernorm_backward_final_kernel<<<dt__cuda_grid((size_t)C, LN_COL_THREADS), LN_COL_THREADS, 0,
                                    cu->stream>>>(dweight, dbias, part_dw, part_db, nchunks, C);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}
