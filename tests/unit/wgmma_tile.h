/* wgmma_tile.h — the host side of wgmma_tile.cuh's check (C and C++): the modes, and the
 * operands and expected product built from two random 64 x 64 matrices. */
#ifndef DT_TESTS_WGMMA_TILE_H
#define DT_TESTS_WGMMA_TILE_H

#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

enum { WG_A_K, WG_A_MN, WG_A_REGS, WG_A_MODES };
enum { WG_B_K, WG_B_MN, WG_B_MODES };
#define WG_N          64                         /* M = N = K */
#define WG_TILE_BYTES (WG_N * WG_N * 2)          /* 64 rows of 128 bytes */
#define WG_TILE_SMEM  (2 * WG_TILE_BYTES + 1024) /* both tiles, aligned to 1024 within */

/* a and b: A and B (row-major, rounded to bf16) laid out as mode am / bm reads them (A or A^T,
 * B^T or B), as bf16 bit patterns; want: their product in double, rounded to float. */
static inline void wg_tile_inputs(int am, int bm, const float *A, const float *B, uint16_t *a,
                                  uint16_t *b, float *want)
{
  for (int i = 0; i < WG_N; i++)
    for (int j = 0; j < WG_N; j++) {
      const float x = dt_bf16_round(A[WG_N * i + j]), y = dt_bf16_round(B[WG_N * i + j]);
      uint32_t ux, uy;
      memcpy(&ux, &x, 4);
      memcpy(&uy, &y, 4);
      a[am == WG_A_MN ? WG_N * j + i : WG_N * i + j] = (uint16_t)(ux >> 16); /* A[i][j] */
      b[bm == WG_B_MN ? WG_N * i + j : WG_N * j + i] = (uint16_t)(uy >> 16); /* B[i][j] */
    }
  for (int m = 0; m < WG_N; m++)
    for (int n = 0; n < WG_N; n++) {
      double s = 0.0;
      for (int k = 0; k < WG_N; k++)
        s += (double)dt_bf16_round(A[WG_N * m + k]) * (double)dt_bf16_round(B[WG_N * k + n]);
      want[WG_N * m + n] = (float)s;
    }
}

#endif
