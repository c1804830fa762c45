/* flash.cuh — the flash-attention kernels (kernels/ops.h: attention_forward_flash,
 * attention_backward_flash; reference: kernels/cpu/attention.c's _flash kernels).
 *
 * No (T, T) matrix, fp32 on the CUDA cores. One thread per query row (forward; dq) or per key row
 * (dk, dv) keeps its row and its accumulators in registers, sized by a head-size bucket (HSM = 32,
 * 64 or 128 >= hs, the rest zero), while the block streams tiles of the other side's rows through
 * shared memory:
 * - forward: the online softmax (running max m and sum l, o rescaled when m grows) over key
 *   tiles; writes out and lse = m + log l;
 * - backward, two kernels and no atomics (deterministic): the first, per query row, computes
 *   D = dout . out (kept in the workspace for the second), recomputes p = exp(s - lse) over
 *   its keys and adds dq = scale sum_j p (dp_j - D) k_j with dp_j = dout . v_j; the second, per
 *   key row, walks the query rows at or after it and adds dv = sum_t p dout_t and
 *   dk = scale sum_t p (dp - D_t) q_t (each adds into dqkv, or with add false writes it: every
 *   row is one thread's). The scores are computed twice: the price of no atomics.
 * Sums run in other orders than the CPU's GEMMs: the tolerance is test_cuda's 1e-5 of scale.
 *
 * Only the kernels and their launch geometry live here, written against nothing but CUDA C++'s
 * thread model (blockIdx, threadIdx, __syncthreads, dynamic shared memory through
 * DT_DYNAMIC_SMEM): tests/unit/test_flash_emul.cc compiles this file for the host, with a CUDA
 * thread-model emulation (a POSIX thread per CUDA thread, a barrier for __syncthreads, shared
 * memory of exactly the launch's bytes), and checks the kernels against the CPU ones on
 * machines without a GPU. */
#ifndef DT_KERNELS_CUDA_FLASH_CUH
#define DT_KERNELS_CUDA_FLASH_CUH

#include <math.h>
#include <stddef.h>

#ifndef DT_DYNAMIC_SMEM
#define DT_DYNAMIC_SMEM(name) extern __shared__ float name[]
#endif

#define FLASH_ROWS   64  /* threads per block of the forward and dq kernels: query rows */
#define FLASH_KEYS   32  /* key rows per shared tile (forward, dq) */
#define FLASH_KROWS  32  /* threads per block of the dk/dv kernel: key rows */
#define FLASH_QTILE  32  /* query rows per shared tile (dk/dv) */
#define FLASH_MAX_HS 128 /* the largest head-size bucket */

/* The head-size bucket (HSM) of head size hs: 32, 64 or 128; 0 past FLASH_MAX_HS. */
static inline int flash_bucket(int hs)
{
  return hs <= 32 ? 32 : hs <= 64 ? 64 : hs <= FLASH_MAX_HS ? 128 : 0;
}

/* Launch geometry: query-row blocks of the forward and dq kernels, key-row blocks of the dk/dv
 * kernel, the grid of all three, and their dynamic shared memory. */

/* (blocks, NH, B): block (x, h, b) works on head h of sequence b. A grid's y and z stop at 65535
 * (its x does not), so neither axis carries B * NH, which a large micro-batch passes. */
static inline dim3 flash_grid(unsigned blocks, int B, int NH)
{
  return dim3(blocks, (unsigned)NH, (unsigned)B);
}

static inline unsigned flash_query_blocks(int Tq)
{
  return (unsigned)((Tq + FLASH_ROWS - 1) / FLASH_ROWS);
}

static inline unsigned flash_key_blocks(int Tk)
{
  return (unsigned)((Tk + FLASH_KROWS - 1) / FLASH_KROWS);
}

template <int HSM> static constexpr size_t flash_kv_smem_bytes(void)
{
  return 2 * FLASH_KEYS * HSM * sizeof(float);
}

/* Rows [j0, j0 + FLASH_KEYS) of k and v (of the head at base) into ks, vs (FLASH_KEYS x HSM),
 * zero past row jend and past column hs. The block's threads share the loads. */
template <int HSM>
__device__ static void flash_load_kv(float *ks, float *vs, const float *base, int j0, int jend,
                                     int hs, int C)
{
  const size_t C3 = 3 * (size_t)C;
  for (int i = threadIdx.x; i < FLASH_KEYS * HSM; i += blockDim.x) {
    const int jj = i / HSM, d = i % HSM;
    const bool ok = j0 + jj < jend && d < hs;
    ks[i] = ok ? base[(size_t)(j0 + jj) * C3 + C + d] : 0.0f;
    vs[i] = ok ? base[(size_t)(j0 + jj) * C3 + 2 * C + d] : 0.0f;
  }
}

/* Grid flash_grid(query blocks, B, NH), FLASH_ROWS threads, 2 FLASH_KEYS HSM floats of shared
 * memory. */
template <int HSM>
__global__ static void __launch_bounds__(FLASH_ROWS)
    flash_forward_kernel(float *out, float *lse, const float *qkv, int Tq, int q0, int Tall, int C,
                         int NH, float scale)
{
  DT_DYNAMIC_SMEM(smem);
  float *ks = smem, *vs = smem + FLASH_KEYS * HSM;
  const int b = blockIdx.z, h = blockIdx.y, bh = b * NH + h, hs = C / NH;
  const int r = blockIdx.x * FLASH_ROWS + threadIdx.x, pos = q0 + r;
  const bool valid = r < Tq;
  const float *base = qkv + (size_t)b * Tall * 3 * C + (size_t)h * hs;
  float q[HSM], o[HSM];
#pragma unroll
  for (int d = 0; d < HSM; d++) {
    q[d] = valid && d < hs ? base[(size_t)pos * 3 * C + d] : 0.0f;
    o[d] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int rend = min((int)(blockIdx.x + 1) * FLASH_ROWS, Tq), kend = q0 + rend;
  for (int j0 = 0; j0 < kend; j0 += FLASH_KEYS) {
    __syncthreads(); /* the previous tile's readers are done */
    flash_load_kv<HSM>(ks, vs, base, j0, kend, hs, C);
    __syncthreads();
    if (!valid || j0 > pos)
      continue;
    float s[FLASH_KEYS], mt = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < FLASH_KEYS; jj++) {
      float acc = 0.0f;
#pragma unroll
      for (int d = 0; d < HSM; d++)
        acc += q[d] * ks[jj * HSM + d];
      s[jj] = j0 + jj <= pos ? acc * scale : -INFINITY;
      mt = fmaxf(mt, s[jj]);
    }
    const float mn = fmaxf(m, mt), corr = expf(m - mn); /* key j0 <= pos: mn is finite */
    l *= corr;
#pragma unroll
    for (int d = 0; d < HSM; d++)
      o[d] *= corr;
#pragma unroll
    for (int jj = 0; jj < FLASH_KEYS; jj++) {
      const float p = expf(s[jj] - mn); /* 0 for the masked keys */
      l += p;
#pragma unroll
      for (int d = 0; d < HSM; d++)
        o[d] += p * vs[jj * HSM + d];
    }
    m = mn;
  }
  if (!valid)
    return;
  const float inv = 1.0f / l;
  float *orow = out + ((size_t)b * Tq + r) * C + (size_t)h * hs;
#pragma unroll
  for (int d = 0; d < HSM; d++)
    if (d < hs)
      orow[d] = o[d] * inv;
  lse[(size_t)bh * Tq + r] = m + logf(l);
}

/* Grid flash_grid(query blocks, B, NH), FLASH_ROWS threads, 2 FLASH_KEYS HSM floats of shared
 * memory. Dbuf (B, NH, Tq) gets D = dout . out of every query row. */
template <int HSM>
__global__ static void __launch_bounds__(FLASH_ROWS)
    flash_backward_dq_kernel(float *dqkv, float *Dbuf, const float *dout, const float *qkv,
                             const float *out, const float *lse, int Tq, int q0, int Tall, int C,
                             int NH, float scale, bool add)
{
  DT_DYNAMIC_SMEM(smem);
  float *ks = smem, *vs = smem + FLASH_KEYS * HSM;
  const int b = blockIdx.z, h = blockIdx.y, bh = b * NH + h, hs = C / NH;
  const int r = blockIdx.x * FLASH_ROWS + threadIdx.x, pos = q0 + r;
  const bool valid = r < Tq;
  const float *base = qkv + (size_t)b * Tall * 3 * C + (size_t)h * hs;
  const size_t orow = ((size_t)b * Tq + r) * C + (size_t)h * hs;
  float q[HSM], g[HSM], dq[HSM], D = 0.0f;
#pragma unroll
  for (int d = 0; d < HSM; d++) {
    const bool ok = valid && d < hs;
    q[d] = ok ? base[(size_t)pos * 3 * C + d] : 0.0f;
    g[d] = ok ? dout[orow + d] : 0.0f;
    D += ok ? g[d] * out[orow + d] : 0.0f;
    dq[d] = 0.0f;
  }
  const float L = valid ? lse[(size_t)bh * Tq + r] : 0.0f;
  if (valid)
    Dbuf[(size_t)bh * Tq + r] = D;
  const int rend = min((int)(blockIdx.x + 1) * FLASH_ROWS, Tq), kend = q0 + rend;
  for (int j0 = 0; j0 < kend; j0 += FLASH_KEYS) {
    __syncthreads();
    flash_load_kv<HSM>(ks, vs, base, j0, kend, hs, C);
    __syncthreads();
    if (!valid || j0 > pos)
      continue;
#pragma unroll 4
    for (int jj = 0; jj < FLASH_KEYS; jj++) {
      if (j0 + jj > pos) /* a later key */
        continue;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int d = 0; d < HSM; d++) {
        s += q[d] * ks[jj * HSM + d];
        dp += g[d] * vs[jj * HSM + d];
      }
      const float ds = expf(s * scale - L) * (dp - D);
#pragma unroll
      for (int d = 0; d < HSM; d++)
        dq[d] += ds * ks[jj * HSM + d];
    }
  }
  if (!valid)
    return;
  float *dqrow = dqkv + ((size_t)b * Tall + pos) * 3 * C + (size_t)h * hs;
#pragma unroll
  for (int d = 0; d < HSM; d++)
    if (d < hs)
      dqrow[d] = add ? dqrow[d] + scale * dq[d] : scale * dq[d];
}

/* Shared memory of the dk/dv kernel: its key rows' k and v (rows padded to HSM + 1 so that the
 * threads' row-wise reads fall in distinct banks), a tile of q and dout rows, their lse and D. */
template <int HSM> static constexpr size_t flash_dkdv_smem_bytes(void)
{
  return (2 * FLASH_KROWS * (HSM + 1) + 2 * FLASH_QTILE * HSM + 2 * FLASH_QTILE) * sizeof(float);
}

/* Grid flash_grid(key blocks, B, NH), FLASH_KROWS threads: key j = q0 + Tq keys in all. */
template <int HSM>
__global__ static void __launch_bounds__(FLASH_KROWS)
    flash_backward_dkdv_kernel(float *dqkv, const float *Dbuf, const float *dout, const float *qkv,
                               const float *lse, int Tq, int q0, int Tall, int C, int NH,
                               float scale, bool add)
{
  DT_DYNAMIC_SMEM(smem);
  float *kown = smem, *vown = smem + FLASH_KROWS * (HSM + 1);
  float *qs = vown + FLASH_KROWS * (HSM + 1), *gs = qs + FLASH_QTILE * HSM;
  float *Ls = gs + FLASH_QTILE * HSM, *Ds = Ls + FLASH_QTILE;
  const int b = blockIdx.z, h = blockIdx.y, bh = b * NH + h, hs = C / NH, tid = threadIdx.x;
  const int jlo = blockIdx.x * FLASH_KROWS, j = jlo + tid;
  const bool valid = j < q0 + Tq;
  const float *base = qkv + (size_t)b * Tall * 3 * C + (size_t)h * hs;
  float *kr = kown + tid * (HSM + 1), *vr = vown + tid * (HSM + 1);
  float dk[HSM], dv[HSM];
#pragma unroll
  for (int d = 0; d < HSM; d++) {
    const bool ok = valid && d < hs;
    kr[d] = ok ? base[(size_t)j * 3 * C + C + d] : 0.0f;
    vr[d] = ok ? base[(size_t)j * 3 * C + 2 * C + d] : 0.0f;
    dk[d] = dv[d] = 0.0f;
  }
  /* The queries that see one of this block's keys: positions >= jlo. */
  for (int t0 = max(0, jlo - q0); t0 < Tq; t0 += FLASH_QTILE) {
    const int nq = min(FLASH_QTILE, Tq - t0);
    __syncthreads();
    for (int i = tid; i < FLASH_QTILE * HSM; i += blockDim.x) {
      const int ii = i / HSM, d = i % HSM;
      const bool ok = ii < nq && d < hs;
      qs[i] = ok ? base[(size_t)(q0 + t0 + ii) * 3 * C + d] : 0.0f;
      gs[i] = ok ? dout[((size_t)b * Tq + t0 + ii) * C + (size_t)h * hs + d] : 0.0f;
    }
    for (int i = tid; i < FLASH_QTILE; i += blockDim.x) {
      Ls[i] = i < nq ? lse[(size_t)bh * Tq + t0 + i] : 0.0f;
      Ds[i] = i < nq ? Dbuf[(size_t)bh * Tq + t0 + i] : 0.0f;
    }
    __syncthreads();
    if (!valid)
      continue;
    for (int ii = 0; ii < nq; ii++) {
      if (q0 + t0 + ii < j) /* a query before this key does not see it */
        continue;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int d = 0; d < HSM; d++) {
        s += qs[ii * HSM + d] * kr[d];
        dp += gs[ii * HSM + d] * vr[d];
      }
      const float p = expf(s * scale - Ls[ii]), ds = p * (dp - Ds[ii]);
#pragma unroll
      for (int d = 0; d < HSM; d++) {
        dv[d] += p * gs[ii * HSM + d];
        dk[d] += ds * qs[ii * HSM + d];
      }
    }
  }
  if (!valid)
    return;
  float *dkrow = dqkv + ((size_t)b * Tall + j) * 3 * C + C + (size_t)h * hs, *dvrow = dkrow + C;
#pragma unroll
  for (int d = 0; d < HSM; d++)
    if (d < hs) {
      dkrow[d] = add ? dkrow[d] + scale * dk[d] : scale * dk[d];
      dvrow[d] = add ? dvrow[d] + dv[d] : dv[d];
    }
}

#endif
