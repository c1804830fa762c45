/* flash_mma.cuh — flash attention on the tensor cores: bf16 mma.sync.m16n8k16 with fp32
 * accumulation (sm_80 and later). The same algorithm and entry points as flash.cuh's fp32
 * kernels (online softmax forward; a dq kernel that also writes D = dout . out, then a dk/dv
 * kernel; no atomics), for bf16 precision.
 *
 * Numerics (what "bf16 attention" means here, as PyTorch's autocast SDPA): q, k, v and dout
 * are rounded to bf16 (nearest even) when a tile is loaded; every product is a bf16 mma with
 * fp32 accumulation; the softmax (max, exp, sums, lse) is fp32; the probabilities P and the
 * score gradients dS are rounded to bf16 as the operands of the second product of each pass
 * (P V, dS K, P^T dO, dS^T Q); D = dout . out is fp32 from the fp32 tensors. out, lse and the
 * gradients are fp32.
 *
 * Layout: a block is FMMA_WARPS warps; each warp owns 16 rows of the block's 64 (query rows in
 * the forward and dq kernels, key rows in the dk/dv kernel) and streams 64-row tiles of the
 * other side through shared memory, which holds every operand as bf16 rows of FMMA_LD(HSM)
 * elements (head size padded with zeros to the bucket HSM, plus 8 against bank conflicts).
 * The products are fmma_tile calls: a warp-wide C (16 x 8 NT) += A (16 x 16 KS) B (16 KS x 8 NT)
 * with A and B read from shared memory through (row, column) strides, so one helper serves
 * every orientation (K^T, V^T, P^T, ...). Each lane's accumulator element acc[nt][e] is row
 * g + 8 (e / 2), column 8 nt + 2 c + e % 2 of C (g = lane / 4, c = lane % 4: mma's layout).
 * The P and dS operands go through a per-warp shared area (fp32 accumulators rounded to bf16),
 * not the registers: simpler, at the cost of shared-memory traffic.
 *
 * Portability: the kernels use only the CUDA thread model plus three primitives the includer
 * may replace (tests/unit/test_flash_emul.cc runs them on the host): DT_MMA_BF16 (the mma),
 * DT_SHFL_XOR (a float butterfly within the warp) and DT_SYNCWARP. */
#ifndef DT_KERNELS_CUDA_FLASH_MMA_CUH
#define DT_KERNELS_CUDA_FLASH_MMA_CUH

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifndef DT_FLASH_SMEM
#define DT_FLASH_SMEM(name) extern __shared__ float name[]
#endif

#ifndef DT_MMA_BF16
/* d = a b + d for one m16n8k16 tile (a: 4 registers of 2 bf16, b: 2, d: 4 floats). */
__device__ static inline void dt_mma_bf16(float d[4], const uint32_t a[4], const uint32_t b[2])
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap(); /* attention.cu launches these kernels on sm_80 and later only */
#endif
}
#define DT_MMA_BF16(d, a, b) dt_mma_bf16(d, a, b)
#define DT_SHFL_XOR(v, m)    __shfl_xor_sync(0xffffffffu, v, m)
#define DT_SYNCWARP()        __syncwarp()
#endif

#define FMMA_WARPS   4
#define FMMA_THREADS (32 * FMMA_WARPS)
#define FMMA_ROWS    (16 * FMMA_WARPS) /* the block's own rows, and the rows of a streamed tile */
#define FMMA_PLD     (FMMA_ROWS + 8)   /* row length of the per-warp P / dS areas */
#define FMMA_LD(HSM) ((HSM) + 8)       /* row length of a shared operand tile */

/* Shared memory (bytes): `tiles` operand tiles, `areas` per-warp P / dS areas for every warp,
 * and `floats` floats. The forward kernel: q, k, v and P; dq: q, dout, k, v and dS; dk/dv: k,
 * v, q, dout, P, dS, and the tile's lse and D. */
template <int HSM> static constexpr size_t fmma_smem_bytes(int tiles, int areas, int floats)
{
  return ((size_t)tiles * FMMA_ROWS * FMMA_LD(HSM) + (size_t)areas * FMMA_ROWS * FMMA_PLD) * 2 +
         (size_t)floats * sizeof(float);
}

template <int HSM> static constexpr size_t fmma_fwd_smem_bytes(void)
{
  return fmma_smem_bytes<HSM>(3, 1, 0);
}

template <int HSM> static constexpr size_t fmma_dq_smem_bytes(void)
{
  return fmma_smem_bytes<HSM>(4, 1, 0);
}

template <int HSM> static constexpr size_t fmma_dkdv_smem_bytes(void)
{
  return fmma_smem_bytes<HSM>(4, 2, 2 * FMMA_ROWS);
}

static inline unsigned fmma_blocks(int rows)
{
  return (unsigned)((rows + FMMA_ROWS - 1) / FMMA_ROWS);
}

/* x rounded to bf16, to nearest even (NaN stays NaN): dt_bf16_round's rule. */
__device__ static inline uint16_t fmma_bf16(float x)
{
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

__device__ static inline uint32_t fmma_pack(uint16_t lo, uint16_t hi)
{
  return (uint32_t)lo | (uint32_t)hi << 16;
}

/* acc[nt] += A B for the calling warp: A(r, k) = a[r * ars + k * acs] (16 x 16 KS), B(k, n) =
 * b[k * bks + n * bns] (16 KS x 8 NT), bf16 in shared memory; acc in mma's C layout. */
template <int NT, int KS>
__device__ static void fmma_tile(float (*acc)[4], const uint16_t *a, int ars, int acs,
                                 const uint16_t *b, int bks, int bns)
{
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int ks = 0; ks < KS; ks++) {
    const int k = 16 * ks + 2 * c;
    const uint16_t *r0 = a + g * ars, *r1 = a + (g + 8) * ars;
    const uint32_t af[4] = {fmma_pack(r0[k * acs], r0[(k + 1) * acs]),
                            fmma_pack(r1[k * acs], r1[(k + 1) * acs]),
                            fmma_pack(r0[(k + 8) * acs], r0[(k + 9) * acs]),
                            fmma_pack(r1[(k + 8) * acs], r1[(k + 9) * acs])};
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const uint16_t *col = b + (8 * nt + g) * bns;
      const uint32_t bf[2] = {fmma_pack(col[k * bks], col[(k + 1) * bks]),
                              fmma_pack(col[(k + 8) * bks], col[(k + 9) * bks])};
      DT_MMA_BF16(acc[nt], af, bf);
    }
  }
}

/* Rows [r0, r0 + FMMA_ROWS) of src (row stride ld floats, hs values each) into the bf16 tile
 * dst, zero past row rend and past column hs. The block's threads share the loads. */
template <int HSM>
__device__ static void fmma_load(uint16_t *dst, const float *src, size_t ld, int r0, int rend,
                                 int hs)
{
  for (int i = threadIdx.x; i < FMMA_ROWS * HSM; i += blockDim.x) {
    const int r = i / HSM, d = i % HSM;
    dst[r * FMMA_LD(HSM) + d] =
        r0 + r < rend && d < hs ? fmma_bf16(src[(size_t)(r0 + r) * ld + d]) : (uint16_t)0;
  }
}

/* Sum (or max) of v over the 4 lanes that share a row of the C layout. */
__device__ static inline float fmma_row_sum(float v)
{
  v += DT_SHFL_XOR(v, 1);
  return v + DT_SHFL_XOR(v, 2);
}

__device__ static inline float fmma_row_max(float v)
{
  v = fmaxf(v, DT_SHFL_XOR(v, 1));
  return fmaxf(v, DT_SHFL_XOR(v, 2));
}

/* dst[d] = mul acc (or += with add) for the calling lane's columns d < hs of its row g + 8 i of
 * the C layout (acc: NO tiles of 8 columns). */
template <int NO>
__device__ static void fmma_store_row(float *dst, const float (*acc)[4], int i, float mul, int hs,
                                      bool add)
{
  const int c = threadIdx.x % 4;
#pragma unroll
  for (int nd = 0; nd < NO; nd++)
#pragma unroll
    for (int e = 2 * i; e < 2 * i + 2; e++) {
      const int d = 8 * nd + 2 * c + e % 2;
      if (d < hs)
        dst[d] = add ? dst[d] + mul * acc[nd][e] : mul * acc[nd][e];
    }
}

/* Grid flash_grid(fmma_blocks(Tq), B, NH), FMMA_THREADS threads, fmma_fwd_smem_bytes<HSM>(). */
template <int HSM>
__global__ static void __launch_bounds__(FMMA_THREADS)
    fmma_forward_kernel(float *out, float *lse, const float *qkv, int Tq, int q0, int Tall, int C,
                        int NH, float scale)
{
  DT_FLASH_SMEM(smem_f);
  constexpr int LD = FMMA_LD(HSM), NO = HSM / 8;
  uint16_t *qs = (uint16_t *)smem_f, *ks = qs + FMMA_ROWS * LD, *vs = ks + FMMA_ROWS * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  uint16_t *ps = vs + FMMA_ROWS * LD + warp * 16 * FMMA_PLD;
  const int b = blockIdx.z, h = blockIdx.y, bh = b * NH + h, hs = C / NH;
  const size_t C3 = 3 * (size_t)C;
  const float *base = qkv + (size_t)b * Tall * C3 + (size_t)h * hs;
  const int r0 = blockIdx.x * FMMA_ROWS, rend = min(r0 + FMMA_ROWS, Tq), kend = q0 + rend;
  fmma_load<HSM>(qs, base + (size_t)q0 * C3, C3, r0, Tq, hs);
  const int row[2] = {r0 + 16 * warp + g, r0 + 16 * warp + g + 8}; /* this lane's rows */
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[NO][4] = {};
  for (int j0 = 0; j0 < kend; j0 += FMMA_ROWS) {
    __syncthreads(); /* the previous tile's readers are done (and qs is written) */
    fmma_load<HSM>(ks, base + C, C3, j0, kend, hs);
    fmma_load<HSM>(vs, base + 2 * C, C3, j0, kend, hs);
    __syncthreads();
    float s[8][4] = {};
    fmma_tile<8, HSM / 16>(s, qs + 16 * warp * LD, LD, 1, ks, 1, LD);
#pragma unroll
    for (int i = 0; i < 2; i++) { /* key 0 is in the first tile: m is finite from then on */
      float mt = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 2 * i; e < 2 * i + 2; e++) {
          const int key = j0 + 8 * nt + 2 * c + e % 2;
          s[nt][e] = key <= q0 + row[i] ? s[nt][e] * scale : -INFINITY;
          mt = fmaxf(mt, s[nt][e]);
        }
      const float mn = fmaxf(m[i], fmma_row_max(mt)), corr = expf(m[i] - mn);
      l[i] *= corr;
#pragma unroll
      for (int nd = 0; nd < NO; nd++) {
        o[nd][2 * i] *= corr;
        o[nd][2 * i + 1] *= corr;
      }
#pragma unroll
      for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 2 * i; e < 2 * i + 2; e++) {
          const float p = expf(s[nt][e] - mn);
          l[i] += p;
          ps[(g + 8 * i) * FMMA_PLD + 8 * nt + 2 * c + e % 2] = fmma_bf16(p);
        }
      m[i] = mn;
    }
    DT_SYNCWARP();
    fmma_tile<NO, 4>(o, ps, FMMA_PLD, 1, vs, LD, 1);
    DT_SYNCWARP(); /* ps is rewritten by the next tile */
  }
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const float sum = fmma_row_sum(l[i]);
    if (row[i] >= Tq)
      continue;
    fmma_store_row<NO>(out + ((size_t)b * Tq + row[i]) * C + (size_t)h * hs, o, i, 1.0f / sum, hs,
                       false);
    if (c == 0)
      lse[(size_t)bh * Tq + row[i]] = m[i] + logf(sum);
  }
}

/* Grid flash_grid(fmma_blocks(Tq), B, NH), FMMA_THREADS threads, fmma_dq_smem_bytes<HSM>(). Adds
 * the query gradients into dqkv (add false: writes them); Dbuf (B, NH, Tq) gets D = dout . out of
 * every query row. */
template <int HSM>
__global__ static void __launch_bounds__(FMMA_THREADS)
    fmma_backward_dq_kernel(float *dqkv, float *Dbuf, const float *dout, const float *qkv,
                            const float *out, const float *lse, int Tq, int q0, int Tall, int C,
                            int NH, float scale, bool add)
{
  DT_FLASH_SMEM(smem_f);
  constexpr int LD = FMMA_LD(HSM), NO = HSM / 8;
  uint16_t *qs = (uint16_t *)smem_f, *gs = qs + FMMA_ROWS * LD, *ks = gs + FMMA_ROWS * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  uint16_t *vs = ks + FMMA_ROWS * LD, *ss = vs + FMMA_ROWS * LD + warp * 16 * FMMA_PLD;
  const int b = blockIdx.z, h = blockIdx.y, bh = b * NH + h, hs = C / NH;
  const size_t C3 = 3 * (size_t)C;
  const float *base = qkv + (size_t)b * Tall * C3 + (size_t)h * hs;
  const float *gbase = dout + (size_t)b * Tq * C + (size_t)h * hs;
  const int r0 = blockIdx.x * FMMA_ROWS, rend = min(r0 + FMMA_ROWS, Tq), kend = q0 + rend;
  fmma_load<HSM>(qs, base + (size_t)q0 * C3, C3, r0, Tq, hs);
  fmma_load<HSM>(gs, gbase, C, r0, Tq, hs);
  const int row[2] = {r0 + 16 * warp + g, r0 + 16 * warp + g + 8};
  float D[2], L[2];
#pragma unroll
  for (int i = 0; i < 2; i++) { /* D in fp32 from the fp32 tensors; the lanes of a row share */
    float part = 0.0f;
    if (row[i] < Tq) {
      const size_t o = ((size_t)b * Tq + row[i]) * C + (size_t)h * hs;
      for (int d = c; d < hs; d += 4)
        part += dout[o + d] * out[o + d];
    }
    D[i] = fmma_row_sum(part);
    L[i] = row[i] < Tq ? lse[(size_t)bh * Tq + row[i]] : 0.0f;
    if (row[i] < Tq && c == 0)
      Dbuf[(size_t)bh * Tq + row[i]] = D[i];
  }
  float dq[NO][4] = {};
  for (int j0 = 0; j0 < kend; j0 += FMMA_ROWS) {
    __syncthreads();
    fmma_load<HSM>(ks, base + C, C3, j0, kend, hs);
    fmma_load<HSM>(vs, base + 2 * C, C3, j0, kend, hs);
    __syncthreads();
    float s[8][4] = {}, dp[8][4] = {};
    fmma_tile<8, HSM / 16>(s, qs + 16 * warp * LD, LD, 1, ks, 1, LD);
    fmma_tile<8, HSM / 16>(dp, gs + 16 * warp * LD, LD, 1, vs, 1, LD);
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int i = e / 2, key = j0 + 8 * nt + 2 * c + e % 2;
        const float p = key <= q0 + row[i] ? expf(s[nt][e] * scale - L[i]) : 0.0f;
        ss[(g + 8 * i) * FMMA_PLD + 8 * nt + 2 * c + e % 2] = fmma_bf16(p * (dp[nt][e] - D[i]));
      }
    DT_SYNCWARP();
    fmma_tile<NO, 4>(dq, ss, FMMA_PLD, 1, ks, LD, 1);
    DT_SYNCWARP();
  }
#pragma unroll
  for (int i = 0; i < 2; i++) {
    if (row[i] >= Tq)
      continue;
    fmma_store_row<NO>(dqkv + ((size_t)b * Tall + q0 + row[i]) * C3 + (size_t)h * hs, dq, i, scale,
                       hs, add);
  }
}

/* Grid flash_grid(fmma_blocks(q0 + Tq), B, NH), FMMA_THREADS threads, fmma_dkdv_smem_bytes<HSM>().
 * Adds the key and value gradients into dqkv (add false: writes them); Dbuf is the dq kernel's. */
template <int HSM>
__global__ static void __launch_bounds__(FMMA_THREADS)
    fmma_backward_dkdv_kernel(float *dqkv, const float *Dbuf, const float *dout, const float *qkv,
                              const float *lse, int Tq, int q0, int Tall, int C, int NH,
                              float scale, bool add)
{
  DT_FLASH_SMEM(smem_f);
  constexpr int LD = FMMA_LD(HSM), NO = HSM / 8;
  uint16_t *ks = (uint16_t *)smem_f, *vs = ks + FMMA_ROWS * LD, *qs = vs + FMMA_ROWS * LD;
  uint16_t *gs = qs + FMMA_ROWS * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  uint16_t *ps = gs + FMMA_ROWS * LD + warp * 16 * FMMA_PLD, *ss = ps + FMMA_ROWS * FMMA_PLD;
  float *ls = (float *)(gs + FMMA_ROWS * LD + 2 * FMMA_ROWS * FMMA_PLD), *Ds = ls + FMMA_ROWS;
  const int b = blockIdx.z, h = blockIdx.y, bh = b * NH + h, hs = C / NH;
  const size_t C3 = 3 * (size_t)C;
  const float *base = qkv + (size_t)b * Tall * C3 + (size_t)h * hs;
  const float *gbase = dout + (size_t)b * Tq * C + (size_t)h * hs;
  const int k0 = blockIdx.x * FMMA_ROWS, kend = q0 + Tq; /* keys [k0, k0 + 64) of [0, kend) */
  fmma_load<HSM>(ks, base + C, C3, k0, kend, hs);
  fmma_load<HSM>(vs, base + 2 * C, C3, k0, kend, hs);
  const int key[2] = {k0 + 16 * warp + g, k0 + 16 * warp + g + 8};
  float dk[NO][4] = {}, dv[NO][4] = {};
  /* the query rows (chunk-relative) at or after the block's first key */
  for (int t0 = max(k0 - q0, 0); t0 < Tq; t0 += FMMA_ROWS) {
    __syncthreads();
    fmma_load<HSM>(qs, base + (size_t)q0 * C3, C3, t0, Tq, hs);
    fmma_load<HSM>(gs, gbase, C, t0, Tq, hs);
    for (int i = threadIdx.x; i < FMMA_ROWS; i += blockDim.x) {
      const bool ok = t0 + i < Tq;
      ls[i] = ok ? lse[(size_t)bh * Tq + t0 + i] : 0.0f;
      Ds[i] = ok ? Dbuf[(size_t)bh * Tq + t0 + i] : 0.0f;
    }
    __syncthreads();
    float s[8][4] = {}, dp[8][4] = {}; /* transposed: rows are keys, columns query rows */
    fmma_tile<8, HSM / 16>(s, ks + 16 * warp * LD, LD, 1, qs, 1, LD);
    fmma_tile<8, HSM / 16>(dp, vs + 16 * warp * LD, LD, 1, gs, 1, LD);
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int i = e / 2, tt = 8 * nt + 2 * c + e % 2, t = t0 + tt;
        const float p = t < Tq && key[i] <= q0 + t ? expf(s[nt][e] * scale - ls[tt]) : 0.0f;
        ps[(g + 8 * i) * FMMA_PLD + tt] = fmma_bf16(p);
        ss[(g + 8 * i) * FMMA_PLD + tt] = fmma_bf16(p * (dp[nt][e] - Ds[tt]));
      }
    DT_SYNCWARP();
    fmma_tile<NO, 4>(dv, ps, FMMA_PLD, 1, gs, LD, 1);
    fmma_tile<NO, 4>(dk, ss, FMMA_PLD, 1, qs, LD, 1);
    DT_SYNCWARP();
  }
#pragma unroll
  for (int i = 0; i < 2; i++) {
    if (key[i] >= kend)
      continue;
    float *krow = dqkv + ((size_t)b * Tall + key[i]) * C3 + (size_t)h * hs;
    fmma_store_row<NO>(krow + C, dk, i, scale, hs, add);
    fmma_store_row<NO>(krow + 2 * C, dv, i, 1.0f, hs, add);
  }
}

#endif
