/* flash_wgmma.cuh — the bf16 flash-attention forward on Hopper's warpgroup MMA (wgmma.cuh,
 * sm_90a), for head size 64 (GPT-2's, 124M to 1.5B): flash_mma.cuh's forward with its two
 * products on wgmma instead of mma.sync. The numerics are flash_mma.cuh's (the same online
 * softmax, exponentials and roundings: P rounded to bf16 as the second product's operand, out
 * to bf16 as stored); only the order of the sums inside each product may differ.
 *
 * A block is one warpgroup (DT_WG_THREADS threads) and owns 128 query rows, two wgmma row tiles
 * of 64 (warp w's rows of tile mt: 64 mt + 16 w + 0..15); key and value tiles of 64 rows stream
 * through shared memory by cp.async, double buffered (the next step's K and V in flight during
 * the whole step, one barrier a step). Every tile is rows of 64 bf16 under the 128-byte swizzle
 * (wgmma.cuh), 1024-aligned: Q (two 8 KiB tiles), K and V twice. Per key tile: S = Q K^T as
 * 2 x 4 products with Q from registers (read from its tiles once) and K K-major, the online
 * softmax in registers (the accumulator of a 64 x 64 product is, per warp, mma.sync's C layout:
 * flash_mma.cuh's softmax and fragments apply as they are), then O += P V as 2 x 4 products with
 * P from registers and V N-major. Needs hs = 64, C a multiple of 8 and qkv 16-byte aligned
 * (fwg_fits).
 *
 * Shared-memory bandwidth sets the kernels' form: a 64 x 64 x 16 product takes 32 cycles of an
 * SM's tensor cores (H100: 4096 bf16 FLOP a cycle) and, with both operands in shared memory,
 * reads 4 KiB of it, 32 cycles at 128 bytes a cycle. So every operand that stays for a kernel's
 * whole loop comes from registers (Q here, K and V in the dk/dv kernel), and the dq kernel reads
 * its dS tiles from global memory into registers. A step's operand reads and tile copies then
 * come to 48 KiB in 512 cycles of products (the forward's and the dk/dv kernel's step of 64
 * keys), 24 KiB in 256 (dq's): three quarters of the bandwidth, from all of it (64 KiB; dq's
 * 56 KiB, 1.7 times) with both operands and dS staged in shared memory. */
#ifndef DT_KERNELS_CUDA_FLASH_WGMMA_CUH
#define DT_KERNELS_CUDA_FLASH_WGMMA_CUH

#include "flash_mma.cuh"
#include "wgmma.cuh"

#define FWG_ROWS  128  /* query rows a block */
#define FWG_KROWS 64   /* key rows a tile */
#define FWG_TILE  8192 /* bytes of a 64-row tile */
/* Q's two tiles, two buffers of K's and V's, and the slack to align them to 1024 in the shared
 * window. */
#define FWG_SMEM_BYTES (6 * FWG_TILE + 1024)

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

/* The calling warp's A operands of the swizzled 64-row tile t for the four k-steps of 16: a[k]
 * holds the warp's rows (16 w.., warp w of the warpgroup), columns 16 k.., in wgmma's register
 * layout (per warp mma.sync's A: fmma_frag_a's matrices), by ldmatrix. Lanes 0-7 address one
 * 16-byte chunk of 8 consecutive rows, which the swizzle puts in 8 different bank groups. */
__device__ static inline void fwg_frag_a(uint32_t a[4][4], const char *t)
{
  const int lane = threadIdx.x % 32, j = lane / 8;
  const unsigned r = 16u * (threadIdx.x / 32) + lane % 8 + 8u * (j % 2);
#pragma unroll
  for (int k = 0; k < 4; k++)
    DT_LDMATRIX_X4(a[k], (const uint16_t *)(t + dt_sw128(128u * r + 32u * k + 16u * (j / 2))),
                   false);
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
  char *qs = (char *)smem_f + pad, *kv = qs + 2 * FWG_TILE; /* Q; K, V; K, V */
  const uint32_t skv = s0 + pad + 2 * FWG_TILE;
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
  const int b = blockIdx.z, h = blockIdx.y, bh = b * NH + h, hs = 64;
  const size_t C3 = 3 * (size_t)C;
  const uint16_t *base = qkv + (size_t)b * Tall * C3 + (size_t)h * hs;
  const int r0 = fmma_query_block_row(FWG_ROWS), rend = min(r0 + FWG_ROWS, Tq), kend = q0 + rend;
  const float sl2 = scale * FMMA_LOG2E;
  /* key rows [j0, j0 + 64) of K and V into buffer buf */
  auto load_kv = [&](int j0, int buf) {
    char *t = kv + 2 * buf * FWG_TILE;
    fwg_load<FWG_KROWS>(t, base + C, C3, j0, kend);
    fwg_load<FWG_KROWS>(t + FWG_TILE, base + 2 * C, C3, j0, kend);
  };
  fwg_load<FWG_ROWS>(qs, base + (size_t)q0 * C3, C3, r0, Tq);
  load_kv(0, 0);
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
  /* Q, the scores' A operand, from registers: it stays for the whole loop, and the products
   * then read only K from shared memory (4 KiB a product to 2: the operands' reads, at 64 x 64 x
   * 16 from shared memory, would alone take its whole bandwidth at the tensor cores' rate) */
  uint32_t qa[2][4][4];
  fwg_tiles_ready();
  fwg_frag_a(qa[0], qs);
  fwg_frag_a(qa[1], qs + FWG_TILE);
  for (int j0 = 0, buf = 0; j0 < kend; j0 += FWG_KROWS, buf ^= 1) {
    fwg_tiles_ready(); /* this step's K and V in place; every thread done with the other buffer */
    if (j0 + FWG_KROWS < kend)
      load_kv(j0 + FWG_KROWS, buf ^ 1);
    const uint32_t sk = skv + 2 * FWG_TILE * buf, sv = sk + FWG_TILE;
    /* Two products a row tile, in groups of their own, so that each softmax runs while the
     * tensor cores compute: S_1 = Q_1 K^T during S_0's softmax, P_0 V during S_1's. */
    float s[2][32];
    uint32_t pa[2][4][4];
    /* S_mt -> P_mt (pa[mt]), its rows' m, l and o rescaled. The mask where a key comes after
     * the tile's first row. Not the warp's: a branch that differs between the warps would make
     * ptxas serialize the products (C7520); masking more is exact. */
    auto softmax = [&](int mt) {
      float(*st)[4] = (float(*)[4])s[mt];
      if (j0 + FWG_KROWS - 1 > q0 + r0 + 64 * mt)
        fmma_online_softmax<true, 8>(st, (float(*)[4])o[mt], m + 2 * mt, l + 2 * mt, qpos + 2 * mt,
                                     j0, sl2);
      else
        fmma_online_softmax<false, 8>(st, (float(*)[4])o[mt], m + 2 * mt, l + 2 * mt, qpos + 2 * mt,
                                      j0, sl2);
      fmma_frag_p<4>(pa[mt], st);
    };
    /* o_mt += P_mt V, a group of its own (o_mt was rescaled and pa[mt] written: the fence) */
    auto pv = [&](int mt) {
      DT_WGMMA_FENCE();
#pragma unroll
      for (int k = 0; k < 4; k++)
        DT_WGMMA_RS(o[mt], pa[mt][k], dt_wgmma_mn(sv, k), 1, 1);
      DT_WGMMA_COMMIT();
    };
    DT_WGMMA_FENCE();
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
#pragma unroll
      for (int k = 0; k < 4; k++)
        DT_WGMMA_RS(s[mt], qa[mt][k], dt_wgmma_k(sk, k), k > 0, 0);
      DT_WGMMA_COMMIT();
    }
    DT_WGMMA_WAIT(1); /* S_0 */
    DT_WGMMA_FENCE_ACC(s[0]);
    softmax(0);
    pv(0);
    DT_WGMMA_WAIT(1); /* S_1 (P_0 V may still run) */
    DT_WGMMA_FENCE_ACC(s[1]);
    softmax(1);
    pv(1);
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

/* The dk/dv kernel's shared memory: K's and V's tiles, two buffers of (Q, dO) tiles, two of lse
 * log2 e and D (64 floats each), and the slack to align the tiles. */
#define FWG_DKDV_SMEM_BYTES (6 * FWG_TILE + 4 * FWG_KROWS * sizeof(float) + 1024)

/* Whether the backward's dk/dv kernel takes this shape and layout: fwg_fits's, dout bf16 and
 * 16-byte aligned too. */
static inline bool fwg_dkdv_fits(int C, int NH, const void *qkv, const void *dout)
{
  return fwg_fits(C, NH, qkv) && (uintptr_t)dout % 16 == 0;
}

/* fmma_backward_dkdv_kernel on wgmma, from a bf16 dout (fwg_dkdv_fits): the same grid
 * (flash_grid(fmma_blocks(q0 + Tq), B, heads)), arguments, dS tiles and bits (on the emulation;
 * on a GPU the products' sums may run in another order), with DT_WG_THREADS threads and
 * FWG_DKDV_SMEM_BYTES. Warp w owns keys k0 + 16 w.. as there. Per query tile of 64 rows, as two
 * products each of 4 steps, K and V from registers (read from their tiles once) and Q and dO
 * K-major: S^T = K Q^T and dP^T = V dO^T (keys are the rows); then P^T and dS^T in registers
 * (fmma_probs, fmma_ds on each half of 32 rows), and dV += P^T dO, dK += dS^T Q with dO and Q
 * N-major. */
template <typename G>
__global__ static void __launch_bounds__(DT_WG_THREADS, 2)
    fwg_backward_dkdv_kernel(G *dqkv, uint16_t *ds_tiles, const float *Dbuf, const uint16_t *dout,
                             const uint16_t *qkv, const float *lse, int Tq, int q0, int Tall, int C,
                             int NH, int h0, float scale, bool add)
{
  DT_DYNAMIC_SMEM(smem_f);
  const uint32_t s0 = DT_SMEM_ADDR(smem_f), pad = (1024u - s0 % 1024u) % 1024u;
  char *ks = (char *)smem_f + pad, *vs = ks + FWG_TILE, *qg = vs + FWG_TILE; /* q, dout; q, dout */
  float *lD = (float *)(qg + 4 * FWG_TILE); /* lse log2 e, D; lse log2 e, D */
  const uint32_t sqg = s0 + pad + 2 * FWG_TILE;
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  const int b = blockIdx.z, h = h0 + blockIdx.y, bh = b * NH + h, hs = 64;
  const size_t C3 = 3 * (size_t)C;
  const uint16_t *base = qkv + (size_t)b * Tall * C3 + (size_t)h * hs;
  const uint16_t *gbase = dout + (size_t)b * Tq * C + (size_t)h * hs;
  const int k0 = blockIdx.x * FWG_KROWS, kend = q0 + Tq; /* keys [k0, k0 + 64) of [0, kend) */
  const float sl2 = scale * FMMA_LOG2E;
  /* query rows [t0, t0 + 64) into buffer buf */
  auto load_queries = [&](int t0, int buf) {
    char *q = qg + 2 * buf * FWG_TILE;
    fwg_load<FWG_KROWS>(q, base + (size_t)q0 * C3, C3, t0, Tq);
    fwg_load<FWG_KROWS>(q + FWG_TILE, gbase, C, t0, Tq);
    float *ld = lD + 2 * buf * FWG_KROWS;
    for (int i = threadIdx.x; i < FWG_KROWS; i += DT_WG_THREADS) {
      const bool ok = t0 + i < Tq;
      ld[i] = ok ? lse[(size_t)bh * Tq + t0 + i] * FMMA_LOG2E : 0.0f;
      ld[FWG_KROWS + i] = ok ? Dbuf[(size_t)bh * Tq + t0 + i] : 0.0f;
    }
  };
  fwg_load<FWG_KROWS>(ks, base + C, C3, k0, kend);
  fwg_load<FWG_KROWS>(vs, base + 2 * C, C3, k0, kend);
  const int tfirst = max(k0 - q0, 0) / FWG_KROWS * FWG_KROWS; /* as fmma_backward_dkdv_kernel */
  load_queries(tfirst, 0);
  const int nqt = (Tq + FMMA_ROWS - 1) / FMMA_ROWS, a = (q0 + FMMA_ROWS - 1) / FMMA_ROWS;
  const size_t gh = (size_t)blockIdx.z * gridDim.y + blockIdx.y;
  uint16_t *ds = ds_tiles
                     ? ds_tiles + (gh * FMMA_DS_BEFORE((int)gridDim.x, nqt, a) +
                                   FMMA_DS_BEFORE((int)blockIdx.x, nqt, a) - tfirst / FMMA_ROWS) *
                                      (size_t)FMMA_DS_TILE
                     : NULL;
  const int key[2] = {k0 + 16 * warp + g, k0 + 16 * warp + g + 8};
  float dk[32] = {}, dv[32] = {};
  uint32_t ka[4][4], va[4][4]; /* K and V, the A operands of S^T and dP^T, from registers */
  fwg_tiles_ready();
  fwg_frag_a(ka, ks);
  fwg_frag_a(va, vs);
  for (int t0 = tfirst, buf = 0; t0 < Tq; t0 += FWG_KROWS, buf ^= 1) {
    fwg_tiles_ready(); /* this step's query tiles in place; the other buffer is free */
    if (t0 + FWG_KROWS < Tq)
      load_queries(t0 + FWG_KROWS, buf ^ 1);
    const uint32_t sq = sqg + 2 * buf * FWG_TILE, sg = sq + FWG_TILE;
    const float *ls = lD + 2 * buf * FWG_KROWS, *Ds = ls + FWG_KROWS;
    /* S^T and dP^T in groups of their own, then dV += P^T dO and dK += dS^T Q: P^T is made
     * while dP^T is computed, dS^T while dV is */
    float s[32], dp[32]; /* transposed: rows are keys, columns query rows */
    DT_WGMMA_FENCE();
#pragma unroll
    for (int k = 0; k < 4; k++)
      DT_WGMMA_RS(s, ka[k], dt_wgmma_k(sq, k), k > 0, 0);
    DT_WGMMA_COMMIT();
#pragma unroll
    for (int k = 0; k < 4; k++)
      DT_WGMMA_RS(dp, va[k], dt_wgmma_k(sg, k), k > 0, 0);
    DT_WGMMA_COMMIT();
    /* the query rows 32 part.. of an element: its L and D, and whether the mask keeps it */
    auto at = [&](int part, int i, int j, float *Li, float *Di) {
      const int tq = 32 * part + j, t = t0 + tq;
      *Li = ls[tq], *Di = Ds[tq];
      return t < Tq && key[i] <= q0 + t;
    };
    /* the mask where the tile crosses the block's first key or the last row (the same for the
     * whole warpgroup: masking more is exact) */
    const bool mask = k0 + FWG_KROWS - 1 > q0 + t0 || t0 + FWG_KROWS > Tq;
    DT_WGMMA_WAIT(1); /* S^T */
    DT_WGMMA_FENCE_ACC(s);
#pragma unroll
    for (int part = 0; part < 2; part++) {
      auto at_part = [&](int i, int j, float *Li, float *Di) { return at(part, i, j, Li, Di); };
      if (mask)
        fmma_probs<true>((float(*)[4])(s + 16 * part), sl2, at_part);
      else
        fmma_probs<false>((float(*)[4])(s + 16 * part), sl2, at_part);
    }
    uint32_t pa[4][4], da[4][4];
    fmma_frag_p<4>(pa, (const float(*)[4])s);
    DT_WGMMA_FENCE();
#pragma unroll
    for (int k = 0; k < 4; k++)
      DT_WGMMA_RS(dv, pa[k], dt_wgmma_mn(sg, k), 1, 1);
    DT_WGMMA_COMMIT();
    DT_WGMMA_WAIT(1); /* dP^T (dV's products may still run) */
    DT_WGMMA_FENCE_ACC(dp);
#pragma unroll
    for (int part = 0; part < 2; part++) {
      auto at_part = [&](int i, int j, float *Li, float *Di) { return at(part, i, j, Li, Di); };
      fmma_ds((float(*)[4])(s + 16 * part), (float(*)[4])(dp + 16 * part), at_part);
    }
    fmma_frag_p<4>(da, (const float(*)[4])dp);
    if (ds) {
      fmma_store_ds(ds + (size_t)(t0 / FMMA_ROWS) * FMMA_DS_TILE, 0, warp, da);
      fmma_store_ds(ds + (size_t)(t0 / FMMA_ROWS) * FMMA_DS_TILE, 2, warp, da + 2);
    }
    DT_WGMMA_FENCE();
#pragma unroll
    for (int k = 0; k < 4; k++)
      DT_WGMMA_RS(dk, da[k], dt_wgmma_mn(sq, k), 1, 1);
    DT_WGMMA_COMMIT();
    DT_WGMMA_WAIT(0);
    DT_WGMMA_FENCE_ACC(dv);
    DT_WGMMA_FENCE_ACC(dk);
  }
#pragma unroll
  for (int i = 0; i < 2; i++) {
    if (key[i] >= kend)
      continue;
    G *krow = dqkv + ((size_t)b * Tall + key[i]) * C3 + (size_t)h * hs;
    fmma_store_row<8>(krow + C, (const float(*)[4])dk, i, scale, hs, add);
    fmma_store_row<8>(krow + 2 * C, (const float(*)[4])dv, i, 1.0f, hs, add);
  }
}

/* The dq kernel's shared memory: two buffers of K's tile. */
#define FWG_DQ_SMEM_BYTES (2 * FWG_TILE + 1024)

/* fmma_backward_dq_kernel on wgmma (fwg_fits): dq = scale dS K from the dk/dv kernel's dS tiles,
 * with its arguments and bits (on the emulation), grid flash_grid(fwg_blocks(Tq), B, heads),
 * DT_WG_THREADS threads and FWG_DQ_SMEM_BYTES. The block's 128 query rows are two wgmma row tiles
 * of 64, one query tile of dS each; warp w's rows of tile mt are 16 w.. of it, whose dS chunks
 * (FMMA_DS_CHUNK(w, kk): mma's A fragments, which are wgmma's per warp) it reads from global
 * memory straight into registers, a key block ahead (staged in shared memory, they would more
 * than double the step's traffic there); K's tile (N-major) streams through shared memory, double
 * buffered. Under 168 registers, three blocks an SM. */
template <typename G>
__global__ static void __launch_bounds__(DT_WG_THREADS, 3)
    fwg_backward_dq_kernel(G *dqkv, const uint16_t *ds_tiles, const uint16_t *qkv, int Tq, int q0,
                           int Tall, int C, int NH, int h0, float scale, bool add)
{
  DT_DYNAMIC_SMEM(smem_f);
  const uint32_t s0 = DT_SMEM_ADDR(smem_f), pad = (1024u - s0 % 1024u) % 1024u;
  char *sm = (char *)smem_f + pad; /* K's tiles, double buffered */
  const uint32_t ssm = s0 + pad;
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  const int b = blockIdx.z, h = h0 + blockIdx.y, hs = 64;
  const size_t C3 = 3 * (size_t)C;
  const uint16_t *kbase = qkv + (size_t)b * Tall * C3 + (size_t)h * hs + C;
  const int r0 = fmma_query_block_row(FWG_ROWS), rend = min(r0 + FWG_ROWS, Tq), kend = q0 + rend;
  const int nqt = (Tq + FMMA_ROWS - 1) / FMMA_ROWS, a = (q0 + FMMA_ROWS - 1) / FMMA_ROWS;
  const int nkb = (q0 + Tq + FMMA_ROWS - 1) / FMMA_ROWS, nk = (kend + FMMA_ROWS - 1) / FMMA_ROWS;
  const uint16_t *ds = ds_tiles + ((size_t)blockIdx.z * gridDim.y + blockIdx.y) *
                                      FMMA_DS_BEFORE(nkb, nqt, a) * (size_t)FMMA_DS_TILE;
  /* key block kb's dS, keys 16 kk.. of row tile mt into pa[mt][kk] (the dk/dv kernel's order of
   * the sums); zeros for a tile that kernel did not write (past the diagonal or the last query
   * tile), by a select after a load from the (b, h)'s first tile: no branch near the products */
  auto fetch_ds = [&](int kb, uint32_t(*pa)[4][4]) {
    const int first = max(0, kb - a);
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
      const int qt = r0 / FMMA_ROWS + mt;
      const bool ok = qt < nqt && qt >= first;
      const uint16_t *t =
          ds + (ok ? (FMMA_DS_BEFORE(kb, nqt, a) + (size_t)(qt - first)) * FMMA_DS_TILE : 0);
#pragma unroll
      for (int kk = 0; kk < 4; kk++) {
        fmma_get16(pa[mt][kk], t + FMMA_DS_CHUNK(warp, kk) + 8 * (threadIdx.x % 32));
#pragma unroll
        for (int j = 0; j < 4; j++)
          pa[mt][kk][j] = ok ? pa[mt][kk][j] : 0u;
      }
    }
  };
  fwg_load<FWG_KROWS>(sm, kbase, C3, 0, kend);
  uint32_t pa[2][4][4], next[2][4][4];
  fetch_ds(0, pa);
  float dq[2][32] = {};
  for (int kb = 0, buf = 0; kb < nk; kb++, buf ^= 1) {
    fwg_tiles_ready(); /* this step's K in place; the other buffer is free */
    if (kb + 1 < nk)
      fwg_load<FWG_KROWS>(sm + (buf ^ 1) * FWG_TILE, kbase, C3, FWG_KROWS * (kb + 1), kend);
    fetch_ds(min(kb + 1, nk - 1), next); /* in flight during the products */
    const uint32_t sk = ssm + buf * FWG_TILE;
    DT_WGMMA_FENCE();
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
      for (int kk = 0; kk < 4; kk++)
        DT_WGMMA_RS(dq[mt], pa[mt][kk], dt_wgmma_mn(sk, kk), 1, 1);
    DT_WGMMA_COMMIT();
    DT_WGMMA_WAIT(0);
    DT_WGMMA_FENCE_ACC(dq[0]);
    DT_WGMMA_FENCE_ACC(dq[1]);
    memcpy(pa, next, sizeof pa);
  }
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const int row = r0 + 64 * (j / 2) + 16 * warp + 8 * (j % 2) + g;
    if (row >= Tq)
      continue;
    fmma_store_row<8>(dqkv + ((size_t)b * Tall + q0 + row) * C3 + (size_t)h * hs,
                      (const float(*)[4])dq[j / 2], j % 2, scale, hs, add);
  }
}

#endif
