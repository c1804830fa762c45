/* test_cuda_wgmma.cu — wgmma_tile.cuh's kernel on the GPU, for test_cuda's check of wgmma.cuh.
 * Compiled for sm_90a alone (its own object library): it runs on a device of compute
 * capability 9.0 (H100, H200) and nowhere else. */
#include <cuda_runtime.h>

#include "wgmma_tile.cuh"

template <int AM, int BM>
static cudaError_t run_tile(float *c, const uint16_t *a, const uint16_t *b, unsigned lbo)
{
  wgmma_tile_kernel<AM, BM><<<1, DT_WG_THREADS, WG_TILE_SMEM>>>(c, a, b, lbo);
  return cudaGetLastError();
}

/* Mode am / bm's product into c (a, b, c: device memory; lbo: the MN-major descriptors'),
 * waited for: 0, or the CUDA error. */
extern "C" int dt_test_wgmma_tile(int am, int bm, float *c, const uint16_t *a, const uint16_t *b,
                                  unsigned lbo)
{
  typedef cudaError_t (*tile_fn)(float *, const uint16_t *, const uint16_t *, unsigned);
  static const tile_fn modes[WG_A_MODES][WG_B_MODES] = {
      {run_tile<WG_A_K, WG_B_K>, run_tile<WG_A_K, WG_B_MN>},
      {run_tile<WG_A_MN, WG_B_K>, run_tile<WG_A_MN, WG_B_MN>},
      {run_tile<WG_A_REGS, WG_B_K>, run_tile<WG_A_REGS, WG_B_MN>}};
  cudaError_t e = modes[am][bm](c, a, b, lbo);
  if (e == cudaSuccess)
    e = cudaDeviceSynchronize();
  return (int)e;
}
