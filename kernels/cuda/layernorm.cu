/* layernorm.cu — LayerNorm over the channel dimension (eps 1e-5) on the GPU, forward and
 * backward (reference: kernels/cpu/layernorm.c, whose arithmetic this follows: float, two-pass
 * statistics, 1 / sqrtf).
 *
 * Forward and the dinp part of backward take one warp per row (LN_ROWS rows a block: a block
 * per row of GPT-2's 768 channels left most of its threads waiting at barriers); the row sums
 * are warp reductions of fixed shape. dweight / dbias are sums over rows, done in two passes
 * without atomics: pass one sums each row chunk's rows per channel into the workspace, in the
 * backward's fused kernel (a block per chunk: each warp its rows' dinp and its own sums in shared
 * memory, then the warps' sums added in order) or, where a block's shared memory cannot hold one
 * warp's 2 C sums, in a kernel of its own after the dinp kernel (one thread per (chunk, channel)
 * summing the chunk's rows in order; it reads dout and inp a second time); pass two adds the
 * chunks' partial sums per channel in the fixed order of block.cuh's dt__column_sums_kernel. The
 * chunking depends on N only and the warps of the fused kernel on C and the GPU's shared memory,
 * so results are bit-identical from run to run. dinp, dweight and dbias accumulate (+=). */
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
  const int rows = ln_chunk_rows(N), nchunks = (N + rows - 1) / rows;
  void *ws = NULL;
  int rc = dt__cuda_workspace(cu, 2 * (size_t)nchunks * C * sizeof(float), &ws);
  if (rc < 0)
    return rc;
  float *part_dw = (float *)ws;
  float *part_db = part_dw + (size_t)nchunks * C;
  int warps = LN_FUSED_WARPS;
  while (warps > 0 && ln_fused_smem_bytes(warps, C) > cu->smem_optin)
    warps--;
  if (warps > 0) {
    const size_t smem = ln_fused_smem_bytes(warps, C);
    if (smem > 48 * 1024)
      DT_CUDA_CHECK(cudaFuncSetAttribute(layernorm_backward_fused_kernel<G>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    layernorm_backward_fused_kernel<G><<<nchunks, 32 * warps, smem, cu->stream>>>(
        dinp, part_dw, part_db, dout, inp, weight, mean, rstd, N, C, rows);
    DT_CUDA_CHECK(cudaGetLastError());
  } else {
    layernorm_backward_dinp_kernel<G>
        <<<ln_blocks(N), LN_THREADS, 0, cu->stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
    DT_CUDA_CHECK(cudaGetLastError());
    dim3 grid((unsigned)((C + LN_COL_THREADS - 1) / LN_COL_THREADS), (unsigned)nchunks);
    layernorm_backward_partial_kernel<G><<<grid, LN_COL_THREADS, 0, cu->stream>>>(
        part_dw, part_db, dout, inp, mean, rstd, N, C, rows);
    DT_CUDA_CHECK(cudaGetLastError());
  }
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
