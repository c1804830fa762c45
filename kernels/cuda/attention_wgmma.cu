/* attention_wgmma.cu — the launches of flash_wgmma.cuh's kernels (the forward, the backward's
 * dk/dv and dq kernels), scale being the attention's 1 / sqrt(head size). Built for sm_90a alone
 * (the object library dt_kernels_cuda_sm90a): its kernels run on compute capability 9.0 (H100,
 * H200) and nowhere else, which device.cu checks before it lets DISTRAIN_CUDA_WGMMA turn them on.
 */
#include "cuda_impl.h"
#include "flash.cuh" /* flash_grid */
#include "flash_wgmma.cuh"

int dt__cuda_wgmma_forward(dt_cuda_impl_t *cu, uint16_t *out, float *lse, const uint16_t *qkv,
                           int B, int Tq, int q0, int Tall, int C, int NH, float scale)
{
  if (!fwg_fits(C, NH, qkv))
    return 0;
  DT_CUDA_CHECK(cudaFuncSetAttribute(
      fwg_forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)FWG_SMEM_BYTES));
  fwg_forward_kernel<<<flash_grid(fwg_blocks(Tq), B, NH), DT_WG_THREADS, FWG_SMEM_BYTES,
                       cu->stream>>>(out, lse, qkv, Tq, q0, Tall, C, NH, scale);
  DT_CUDA_CHECK(cudaGetLastError());
  return 1;
}

template <typename G>
static int dkdv(dt_cuda_impl_t *cu, G *dqkv, uint16_t *ds_tiles, const float *D,
                const uint16_t *dout, const uint16_t *qkv, const float *lse, int bn, int hn, int Tq,
                int q0, int Tall, int C, int NH, int h0, float scale, bool add)
{
  DT_CUDA_CHECK(cudaFuncSetAttribute(fwg_backward_dkdv_kernel<G>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)FWG_DKDV_SMEM_BYTES));
  fwg_backward_dkdv_kernel<G>
      <<<flash_grid(fmma_blocks(q0 + Tq), bn, hn), DT_WG_THREADS, FWG_DKDV_SMEM_BYTES,
         cu->stream>>>(dqkv, ds_tiles, D, dout, qkv, lse, Tq, q0, Tall, C, NH, h0, scale, add);
  DT_CUDA_CHECK(cudaGetLastError());
  return 1;
}

template <typename G>
static int dq(dt_cuda_impl_t *cu, G *dqkv, const uint16_t *ds_tiles, const uint16_t *qkv, int bn,
              int hn, int Tq, int q0, int Tall, int C, int NH, int h0, float scale, bool add)
{
  DT_CUDA_CHECK(cudaFuncSetAttribute(fwg_backward_dq_kernel<G>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)FWG_DQ_SMEM_BYTES));
  fwg_backward_dq_kernel<G>
      <<<flash_grid(fwg_blocks(Tq), bn, hn), DT_WG_THREADS, FWG_DQ_SMEM_BYTES, cu->stream>>>(
          dqkv, ds_tiles, qkv, Tq, q0, Tall, C, NH, h0, scale, add);
  DT_CUDA_CHECK(cudaGetLastError());
  return 1;
}

int dt__cuda_wgmma_dq(dt_cuda_impl_t *cu, void *dqkv, int dqkv16, const uint16_t *ds_tiles,
                      const uint16_t *qkv, int bn, int hn, int Tq, int q0, int Tall, int C, int NH,
                      int h0, float scale, int add)
{
  if (!fwg_fits(C, NH, qkv))
    return 0;
  return dqkv16 ? dq(cu, (uint16_t *)dqkv, ds_tiles, qkv, bn, hn, Tq, q0, Tall, C, NH, h0, scale,
                     add != 0)
                : dq(cu, (float *)dqkv, ds_tiles, qkv, bn, hn, Tq, q0, Tall, C, NH, h0, scale,
                     add != 0);
}

int dt__cuda_wgmma_dkdv(dt_cuda_impl_t *cu, void *dqkv, int dqkv16, uint16_t *ds_tiles,
                        const float *D, const uint16_t *dout, const uint16_t *qkv, const float *lse,
                        int bn, int hn, int Tq, int q0, int Tall, int C, int NH, int h0,
                        float scale, int add)
{
  if (!fwg_dkdv_fits(C, NH, qkv, dout))
    return 0;
  return dqkv16 ? dkdv(cu, (uint16_t *)dqkv, ds_tiles, D, dout, qkv, lse, bn, hn, Tq, q0, Tall, C,
                       NH, h0, scale, add != 0)
                : dkdv(cu, (float *)dqkv, ds_tiles, D, dout, qkv, lse, bn, hn, Tq, q0, Tall, C, NH,
                       h0, scale, add != 0);
}
