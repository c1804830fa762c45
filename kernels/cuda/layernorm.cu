/* layernorm.cu — LayerNorm over the channel dimension (eps 1e-5) on the GPU, forward and
 * backward (reference: kernels/cpu/layernorm.c, whose arithmetic this follows: float, two-pass
 * statistics, 1 / sqrtf).
 *
 * Forward and the dinp part of backward take one warp per row (LN_ROWS rows a block: a block
 * per row of GPT-2's 768 channels left most of its threads waiting at barriers); the row sums
 * are warp reductions of fixed shape. dweight / dbias are sums over rows, done in two passes
 * without atomics: pass one gives each (row chunk, channel) one thread that sums its chunk's rows
 * in order into the workspace; pass two adds the chunks' partial sums per channel in the fixed
 * order of block.cuh's dt__column_sums_kernel. The chunking depends on N only, so results are
 * bit-identical from run to run (and on any GPU). dinp, dweight and dbias accumulate (+=). */
#include <cuda_bf16.h>

#include "cuda_impl.h"
#include "layernorm.cuh"

template <typename O>
static int layernorm_forward(struct dt_device *dev, O *out, float *mean, float *rstd,
                             const float *inp, const float *weight, const float *bias, int N, int C)
{
  if (N <= 0 || C <= 0)
    return 0;
  layernorm_forward_kernel<O><<<ln_blocks(N), LN_THREADS, 0, dt__cuda(dev)->stream>>>(
      out, mean, rstd, inp, weight, bias, N, C);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

template <typename O>
static int residual_layernorm_forward(struct dt_device *dev, float *res, O *out, float *mean,
                                      float *rstd, const float *a, const float *b,
                                      const float *weight, const float *bias, int N, int C)
{
  if (N <= 0 || C <= 0)
    return 0;
  residual_layernorm_forward_kernel<O><<<ln_blocks(N), LN_THREADS, 0, dt__cuda(dev)->stream>>>(
      res, out, mean, rstd, a, b, weight, bias, N, C);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int dt__cuda_layernorm_forward(struct dt_device *dev, float *out, float *mean, float *rstd,
                               const float *inp, const float *weight, const float *bias, int N,
                               int C)
{
  return layernorm_forward(dev, out, mean, rstd, inp, weight, bias, N, C);
}

int dt__cuda_layernorm_forward_bf16(struct dt_device *dev, void *out, float *mean, float *rstd,
                                    const float *inp, const float *weight, const float *bias, int N,
                                    int C)
{
  return layernorm_forward(dev, (__nv_bfloat16 *)out, mean, rstd, inp, weight, bias, N, C);
}

int dt__cuda_residual_layernorm_forward(struct dt_device *dev, float *res, float *out, float *mean,
                                        float *rstd, const float *a, const float *b,
                                        const float *weight, const float *bias, int N, int C)
{
  return residual_layernorm_forward(dev, res, out, mean, rstd, a, b, weight, bias, N, C);
}

int dt__cuda_residual_layernorm_forward_bf16(struct dt_device *dev, float *res, void *out,
                                             float *mean, float *rstd, const float *a,
                                             const float *b, const float *weight, const float *bias,
                                             int N, int C)
{
  return residual_layernorm_forward(dev, res, (__nv_bfloat16 *)out, mean, rstd, a, b, weight, bias,
                                    N, C);
}

template <typename G>
static int layernorm_backward(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                              const G *dout, const float *inp, const float *weight,
                              const float *mean, const float *rstd, int N, int C)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (N <= 0 || C <= 0)
    return 0;
  layernorm_backward_dinp_kernel<G>
      <<<ln_blocks(N), LN_THREADS, 0, cu->stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
  DT_CUDA_CHECK(cudaGetLastError());

  const int rows = ln_chunk_rows(N), nchunks = (N + rows - 1) / rows;
  void *ws = NULL;
  int rc = dt__cuda_workspace(cu, 2 * (size_t)nchunks * C * sizeof(float), &ws);
  if (rc < 0)
    return rc;
  float *part_dw = (float *)ws;
  float *part_db = part_dw + (size_t)nchunks * C;
  dim3 grid((unsigned)((C + LN_COL_THREADS - 1) / LN_COL_THREADS), (unsigned)nchunks);
  layernorm_backward_partial_kernel<G><<<grid, LN_COL_THREADS, 0, cu->stream>>>(
      part_dw, part_db, dout, inp, mean, rstd, N, C, rows);
  DT_CUDA_CHECK(cudaGetLastError());
  const dt__csum_t sums = {{dweight, dbias}, {part_dw, part_db}};
  dt__column_sums_kernel<float><<<dim3((unsigned)((C + DT__CSUM_COLS - 1) / DT__CSUM_COLS), 1, 2),
                                  DT__CSUM_THREADS, 0, cu->stream>>>(sums, nchunks, C);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int dt__cuda_layernorm_backward(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                                const float *dout, const float *inp, const float *weight,
                                const float *mean, const float *rstd, int N, int C)
{
  return layernorm_backward(dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}

int dt__cuda_layernorm_backward_bf16(struct dt_device *dev, float *dinp, float *dweight,
                                     float *dbias, const void *dout, const float *inp,
                                     const float *weight, const float *mean, const float *rstd,
                                     int N, int C)
{
  return layernorm_backward(dev, dinp, dweight, dbias, (const __nv_bfloat16 *)dout, inp, weight,
                            mean, rstd, N, C);
}
