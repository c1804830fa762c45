/* wgmma_tile.cuh — the check of kernels/cuda/wgmma.cuh: one warpgroup computes a 64 x 64 x 64
 * bf16 product C = A B in four k-steps, with each way an operand can reach the instruction: A
 * from shared memory K-major or M-major (transposed), or from registers; B from shared memory
 * K-major (B^T's rows) or N-major (transposed). Compiled for the GPU by test_cuda_wgmma.cu
 * (test_cuda, sm_90a) and for the host under tests/emul/cuda_emul.h by test_cuda_emul.cc: both
 * compare C with a plain product, so that the emulation's reading of the PTX ISA's layouts is
 * itself checked against the hardware.
 *
 * a: A (64 x 64, row-major) for WG_A_K and WG_A_REGS, A^T for WG_A_MN; b: B^T (row-major) for
 * WG_B_K, B for WG_B_MN (wg_tile_inputs makes them); c: C, row-major fp32. lbo: the MN-major
 * descriptors' leading byte offset, which a 64-wide tile does not use as the emulation reads the
 * PTX ISA (SBO is the step between groups of 8 rows along K): 16 checks that reading, 1024
 * (= SBO, as wgmma.cuh's dt_wgmma_mn sets it) is right under the other reading too. One block of
 * DT_WG_THREADS threads and WG_TILE_SMEM bytes of dynamic shared memory. */
#ifndef DT_TESTS_WGMMA_TILE_CUH
#define DT_TESTS_WGMMA_TILE_CUH

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "wgmma.cuh"
#include "wgmma_tile.h"

template <int AM, int BM>
__global__ void __launch_bounds__(DT_WG_THREADS)
    wgmma_tile_kernel(float *c, const uint16_t *a, const uint16_t *b, uint32_t lbo)
{
  DT_DYNAMIC_SMEM(smem);
  const uint32_t base = DT_SMEM_ADDR(smem);
  char *ta = (char *)smem + (1024u - base % 1024u) % 1024u, *tb = ta + WG_TILE_BYTES;
  const int t = threadIdx.x, w = t / 32, g = t % 32 / 4, cc = t % 4;
  for (int i = t; i < 512; i += DT_WG_THREADS) { /* chunk j of row r, swizzled */
    const int r = i / 8, j = i % 8;
    if (AM != WG_A_REGS)
      memcpy(ta + dt_sw128(128u * r + 16u * j), a + 64 * r + 8 * j, 16);
    memcpy(tb + dt_sw128(128u * r + 16u * j), b + 64 * r + 8 * j, 16);
  }
  DT_FENCE_PROXY_ASYNC();
  __syncthreads();

  [[maybe_unused]] uint32_t ar[4]
                              [4]; /* A from registers: k-step s, register j (wgmma.cuh's layout) */
  if constexpr (AM == WG_A_REGS)
    for (int s = 0; s < 4; s++)
      for (int j = 0; j < 4; j++) {
        const uint16_t *p = a + 64 * (16 * w + g + 8 * (j % 2)) + 16 * s + 2 * cc + 8 * (j / 2);
        ar[s][j] = (uint32_t)p[0] | (uint32_t)p[1] << 16;
      }
  float d[32];
  for (int i = 0; i < 32; i++)
    d[i] = NAN; /* the first step does not read D (scale_d 0) */
  const uint32_t sa = DT_SMEM_ADDR(ta), sb = DT_SMEM_ADDR(tb);
  DT_WGMMA_FENCE();
  for (int s = 0; s < 4; s++) {
    const uint64_t db = BM == WG_B_K ? dt_wgmma_desc(sb + 32u * s, 16u, 1024u)
                                     : dt_wgmma_desc(sb + 2048u * s, lbo, 1024u);
    if constexpr (AM == WG_A_REGS) {
      DT_WGMMA_RS(d, ar[s], db, s > 0, BM == WG_B_MN);
    } else {
      const uint64_t da = AM == WG_A_K ? dt_wgmma_desc(sa + 32u * s, 16u, 1024u)
                                       : dt_wgmma_desc(sa + 2048u * s, lbo, 1024u);
      DT_WGMMA_SS(d, da, db, s > 0, AM == WG_A_MN, BM == WG_B_MN);
    }
    if (s == 1)
      DT_WGMMA_COMMIT(); /* two groups: steps 0-1, then 2-3 */
  }
  DT_WGMMA_COMMIT();
  DT_WGMMA_WAIT(1); /* the first group done: D holds steps 0-1 */
  DT_WGMMA_WAIT(0);
  DT_WGMMA_FENCE_ACC(d);
  for (int i = 0; i < 32; i++)
    c[64 * (16 * w + g + 8 * (i / 2 % 2)) + 8 * (i / 4) + 2 * cc + i % 2] = d[i];
}

#endif
