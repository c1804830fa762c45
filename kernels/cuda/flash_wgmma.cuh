/* flash_wgmma.cuh — the bf16 flash-attention forward on Hopper's warpgroup MMA (wgmma.cuh,
 * sm_90a), for head size 64 (GPT-2's, 124M to 1.5B): flash_mma.cuh's forward with its two
 * products on wgmma instead of mma.sync. The numerics are flash_mma.cuh's (the same online
 * softmax, exponentials and roundings: P rounded to bf16 as the second product's operand, out
 * to bf16 as stored); only the order of the sums inside each product may differ.
 *
 * A block is one warpgroup (DT_WG_THREADS threads) and owns 128 query rows, two wgmma row tiles
 * of 64 (warp w's rows of tile mt: 64 mt + 16 w + 0..15); key and value tiles of 64 rows stream
 * through shared memory by cp.async, the next K's in flight during the softmax and P V, V's
 * during the scores (flash_mma.cuh's order). Every tile is rows of 64 bf16 under the 128-byte
 * swizzle (wgmma.cuh), 1024-aligned: Q (two 8 KiB tiles), K and V. Per key tile: S = Q K^T as
 * 2 x 4 products from shared memory (both K-major), the online softmax in registers (the
 * accumulator of a 64 x 64 product is, per warp, mma.sync's C layout: flash_mma.cuh's softmax
 * and fragments apply as they are), then O += P V as 2 x 4 products with P from registers and V
 * N-major. Needs hs = 64, C a multiple of 8 and qkv 16-byte aligned (fwg_fits). */
#ifndef DT_KERNELS_CUDA_FLASH_WGMMA_CUH
#define DT_KERNELS_CUDA_FLASH_WGMMA_CUH

#include "flash_mma.cuh"
#include "wgmma.cuh"

#define FWG_ROWS  128  /* query rows a block */
#define FWG_KROWS 64   /* key rows a tile */
#define FWG_TILE  8192 /* bytes of a 64-row tile */
/* Q's two tiles, K's and V's, and the slack to align them to 1024 in the shared window. */
#define FWG_SMEM_BYTES (4 * FWG_TILE + 1024)

/* Whether the kernel takes this shape and layout. */
static inline bool fwg_fits(int C, int NH, const void *qkv)
{
  return C % NH == 0 && C / NH == 64 && C % 8 == 0 && (uintptr_t)qkv % 16 == 0;
}

static inline unsigned fwg_blocks(int Tq)
{
  return (unsigned)((Tq + FWG_ROWS - 1) / FWG_ROWS);
}

/* Rows [r0, r0 + ROWS) of src (64 bf16 a row, row stride ld) into the swizzled tile dst by
 * cp.async, zeros from row rend on. */
template <int ROWS>
__device__ static void fwg_load(char *dst, const uint16_t *src, size_t ld, int r0, int rend)
{
  for (int i = threadIdx.x; i < ROWS * 8; i += DT_WG_THREADS) {
    const int r = i / 8, j = i % 8;
    const bool ok = r0 + r < rend;
    DT_CP_ASYNC16(dst + dt_sw128(128u * r + 16u * j),
                  ok ? src + (size_t)(r0 + r) * ld + 8 * j : src, ok);
  }
}

/* The calling thread's copies landed, published to the tensor cores, and every thread past. */
__device__ static inline void fwg_tiles_ready(void)
{
  DT_CP_ASYNC_WAIT_ALL();
  DT_FENCE_PROXY_ASYNC();
  __syncthreads();
}

/* Grid flash_grid(fwg_blocks(Tq), B, NH), DT_WG_THREADS threads, FWG_SMEM_BYTES; arguments as
 * fmma_forward_kernel's. */
__global__ static void __launch_bounds__(DT_WG_THREADS, 2)
    fwg_forward_kernel(uint16_t *out, float *lse, const uint16_t *qkv, int Tq, int q0, int Tall,
                       int C, int NH, float scale)
{
  DT_DYNAMIC_SMEM(smem_f);
  const uint32_t s0 = DT_SMEM_ADDR(smem_f), pad = (1024u - s0 % 1024u) % 1024u;
  char *qs = (char *)smem_f + pad, *ks = qs + 2 * FWG_TILE, *vs = ks + FWG_TILE;
  const uint32_t sq = s0 + pad, sk = sq + 2 * FWG_TILE, sv = sk + FWG_TILE;
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
  const int b = blockIdx.z, h = blockIdx.y, bh = b * NH + h, hs = 64;
  const size_t C3 = 3 * (size_t)C;
  const uint16_t *base = qkv + (size_t)b * Tall * C3 + (size_t)h * hs;
  const int r0 = fmma_query_block_row(FWG_ROWS), rend = min(r0 + FWG_ROWS, Tq), kend = q0 + rend;
  const float sl2 = scale * FMMA_LOG2E;
  fwg_load<FWG_ROWS>(qs, base + (size_t)q0 * C3, C3, r0, Tq);
  fwg_load<FWG_KROWS>(ks, base + C, C3, 0, kend);
  int row[4], qpos[4]; /* this thread's rows: 2 mt + i is row g + 8 i of its warp in tile mt */
#pragma unroll
  for (int j = 0; j < 4; j++) {
    row[j] = r0 + 64 * (j / 2) + 16 * warp + 8 * (j % 2) + g;
    qpos[j] = q0 + row[j];
  }
  float m[4], l[4], o[2][32] = {};
#pragma unroll
  for (int j = 0; j < 4; j++)
    m[j] = -INFINITY, l[j] = 0.0f;
  for (int j0 = 0; j0 < kend; j0 += FWG_KROWS) {
    fwg_tiles_ready(); /* K's tile (and Q) in place; every thread done with the previous V's */
    fwg_load<FWG_KROWS>(vs, base + 2 * C, C3, j0, kend);
    float s[2][32];
    DT_WGMMA_FENCE();
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
      for (int k = 0; k < 4; k++)
        DT_WGMMA_SS(s[mt], dt_wgmma_desc(sq + FWG_TILE * mt + 32u * k, 16u, 1024u),
                    dt_wgmma_desc(sk + 32u * k, 16u, 1024u), k > 0, 0, 0);
    DT_WGMMA_COMMIT();
    DT_WGMMA_WAIT(0);
    DT_WGMMA_FENCE_ACC(s[0]);
    DT_WGMMA_FENCE_ACC(s[1]);
    fwg_tiles_ready(); /* V's tile in place; every thread done with K's */
    if (j0 + FWG_KROWS < kend)
      fwg_load<FWG_KROWS>(ks, base + C, C3, j0 + FWG_KROWS, kend);
    uint32_t pa[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
      float(*st)[4] = (float(*)[4])s[mt];
      /* a key after the tile's first row. Not the warp's: a branch that differs between the
       * warps would make ptxas serialize the products (C7520); masking more is exact */
      if (j0 + FWG_KROWS - 1 > q0 + r0 + 64 * mt)
        fmma_online_softmax<true, 8>(st, (float(*)[4])o[mt], m + 2 * mt, l + 2 * mt, qpos + 2 * mt,
                                     j0, sl2);
      else
        fmma_online_softmax<false, 8>(st, (float(*)[4])o[mt], m + 2 * mt, l + 2 * mt, qpos + 2 * mt,
                                      j0, sl2);
      fmma_frag_p<4>(pa[mt], st);
    }
    DT_WGMMA_FENCE(); /* o was rescaled by the softmax */
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
      for (int k = 0; k < 4; k++)
        DT_WGMMA_RS(o[mt], pa[mt][k], dt_wgmma_desc(sv + 2048u * k, 16u, 1024u), 1, 1);
    DT_WGMMA_COMMIT();
    DT_WGMMA_WAIT(0);
    DT_WGMMA_FENCE_ACC(o[0]);
    DT_WGMMA_FENCE_ACC(o[1]);
  }
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const float sum = fmma_row_sum(l[j]);
    if (row[j] >= Tq)
      continue;
    fmma_store_row<8>(out + ((size_t)b * Tq + row[j]) * C + (size_t)h * hs,
                      (const float(*)[4])o[j / 2], j % 2, 1.0f / sum, hs, false);
    if (c == 0)
      lse[(size_t)bh * Tq + row[j]] = m[j] * scale + logf(sum);
  }
}

#endif
