/* attention_wgmma.cu — the launch of flash_wgmma.cuh's forward. Built for sm_90a alone (the
 * object library dt_kernels_cuda_sm90a): its kernel runs on compute capability 9.0 (H100, H200)
 * and nowhere else, which device.cu checks before it lets DISTRAIN_CUDA_WGMMA turn it on. */
#include <math.h>

#include "cuda_impl.h"
#include "flash.cuh" /* flash_grid */
#include "flash_wgmma.cuh"

int dt__cuda_wgmma_forward(dt_cuda_impl_t *cu, uint16_t *out, float *lse, const uint16_t *qkv,
                           int B, int Tq, int q0, int Tall, int C, int NH)
{
  if (!fwg_fits(C, NH, qkv))
    return 0;
  fwg_forward_kernel<<<flash_grid(fwg_blocks(Tq), B, NH), DT_WG_THREADS, FWG_SMEM_BYTES,
                       cu->stream>>>(out, lse, qkv, Tq, q0, Tall, C, NH,
                                     1.0f / sqrtf((float)(C / NH)));
  DT_CUDA_CHECK(cudaGetLastError());
  return 1;
}
