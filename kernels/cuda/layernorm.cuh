/* layernorm.cuh — the LayerNorm kernels (layernorm.cu launches them; its top comment states
 * the algorithm): one warp per row for the forward pass and the backward's dinp, then the two
 * column passes of dweight / dbias. The forward kernels write fp32 or, for a bf16 activation
 * (ops.h), the same values rounded to bf16 (dt__store). Device code only, also compiled for
 * the host by tests/unit/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_LAYERNORM_CUH
#define DT_KERNELS_CUDA_LAYERNORM_CUH

#include "block.cuh"

#define LN_EPS         1e-5f
#define LN_ROWS        8 /* per-row kernels: a warp per row, LN_ROWS rows a block */
#define LN_THREADS     (32 * LN_ROWS)
#define LN_COL_THREADS 256  /* channels per block in the column passes */
#define LN_CHUNK_ROWS  32   /* at least this many rows per partial sum */
#define LN_MAX_CHUNKS  1024 /* at most this many partial sums per channel */
#define LN_FUSED_WARPS 4    /* warps a block of the fused backward, at most */

/* Rows per chunk of the column passes for N rows: a function of N only (determinism). */
static inline int ln_chunk_rows(int N)
{
  const int rows = (N + LN_MAX_CHUNKS - 1) / LN_MAX_CHUNKS;
  return rows < LN_CHUNK_ROWS ? LN_CHUNK_ROWS : rows;
}

/* Blocks of the per-row kernels for N rows. */
static inline unsigned ln_blocks(int N)
{
  return (unsigned)((N + LN_ROWS - 1) / LN_ROWS);
}

/* The row of the calling warp in a per-row kernel (N rows, LN_ROWS a block), or -1 past N: the
 * warp then has nothing to do (the per-row kernels never synchronise the block). */
__device__ static inline long ln_row(int N)
{
  const long row = (long)blockIdx.x * LN_ROWS + (long)(threadIdx.x / 32);
  return row < N ? row : -1;
}

/* One row by one warp: o = (x - mean) * rstd * weight + bias, its statistics stored. Each lane
 * reads only the channels c = lane + 32 k, so x may have been written by the same lane just
 * before without a barrier; the row's sums are warp reductions (no block barrier: a block's
 * warps work on their rows independently). */
template <typename O>
__device__ static void layernorm_row(O *o, float *mean, float *rstd, const float *x,
                                     const float *weight, const float *bias, int C)
{
  const int lane = (int)(threadIdx.x % 32);
  float s = 0.0f;
  for (int c = lane; c < C; c += 32)
    s += x[c];
  const float m = dt__warp_reduce(s, dt__sum_op()) / (float)C;
  float v = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float d = x[c] - m;
    v += d * d;
  }
  v = dt__warp_reduce(v, dt__sum_op()) / (float)C;
  const float rs = 1.0f / sqrtf(v + LN_EPS);
  for (int c = lane; c < C; c += 32)
    dt__store(o + c, (x[c] - m) * rs * weight[c] + bias[c]);
  if (lane == 0) {
    *mean = m;
    *rstd = rs;
  }
}

template <typename O>
__global__ static void layernorm_forward_kernel(O *out, float *mean, float *rstd, const float *inp,
                                                const float *weight, const float *bias, int N,
                                                int C)
{
  const long row = ln_row(N);
  if (row < 0)
    return;
  layernorm_row(out + row * C, mean + row, rstd + row, inp + row * C, weight, bias, C);
}

/* res = a + b, then the LayerNorm of res, one warp per row: the sum is read back by the lane
 * that wrote it (from L1), so the pair costs one pass less over memory than the residual kernel
 * and the LayerNorm apart, with the same bits. res may alias a or b. */
template <typename O>
__global__ static void residual_layernorm_forward_kernel(float *res, O *out, float *mean,
                                                         float *rstd, const float *a,
                                                         const float *b, const float *weight,
                                                         const float *bias, int N, int C)
{
  const long row = ln_row(N);
  if (row < 0)
    return;
  float *r = res + row * C;
  for (int c = (int)(threadIdx.x % 32); c < C; c += 32)
    r[c] = a[row * C + c] + b[row * C + c];
  layernorm_row(out + row * C, mean + row, rstd + row, r, weight, bias, C);
}

/* dinp[row] += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd for one row by one
 * warp; SUMS: also dw[c] += norm * dout and db[c] += dout, each lane its channels c = lane + 32 k.
 * G: dout's element type (float, or __nv_bfloat16: a bf16 dout read as fp32), as below. */
template <bool SUMS, typename G>
__device__ static void layernorm_backward_row(float *dx, const G *g, const float *x,
                                              const float *weight, float m, float s, int C,
                                              float *dw, float *db)
{
  const int lane = (int)(threadIdx.x % 32);
  float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float norm = (x[c] - m) * s;
    const float dnorm = weight[c] * dt__load(g + c);
    dnorm_mean += dnorm;
    dnorm_norm_mean += dnorm * norm;
  }
  dnorm_mean = dt__warp_reduce(dnorm_mean, dt__sum_op()) / (float)C;
  dnorm_norm_mean = dt__warp_reduce(dnorm_norm_mean, dt__sum_op()) / (float)C;
  for (int c = lane; c < C; c += 32) {
    const float norm = (x[c] - m) * s, gc = dt__load(g + c);
    const float dnorm = weight[c] * gc;
    dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    if (SUMS) {
      dw[c] += norm * gc;
      db[c] += gc;
    }
  }
}

/* dinp's rows, one warp per row (where the fused kernel below cannot run: past its shared
 * memory). */
template <typename G>
__global__ static void layernorm_backward_dinp_kernel(float *dinp, const G *dout, const float *inp,
                                                      const float *weight, const float *mean,
                                                      const float *rstd, int N, int C)
{
  const long row = ln_row(N);
  if (row < 0)
    return;
  layernorm_backward_row<false>(dinp + row * C, dout + row * C, inp + row * C, weight, mean[row],
                                rstd[row], C, (float *)NULL, (float *)NULL);
}

/* The shared memory of layernorm_backward_fused_kernel with `warps` warps a block. */
static inline size_t ln_fused_smem_bytes(int warps, int C)
{
  return 2 * (size_t)warps * (size_t)C * sizeof(float);
}

/* dinp and pass one of dweight / dbias in one read of dout and inp (the two kernels apart read
 * both twice): block b takes the rows of chunk b ([b rows, (b + 1) rows) of N, ln_chunk_rows),
 * its W = blockDim.x / 32 warps the rows w, w + W, ... of it, each warp its rows' dinp (the
 * same bits as layernorm_backward_dinp_kernel) while it sums norm * dout and dout per channel in
 * its own 2 C floats of the dynamic shared memory (ln_fused_smem_bytes); then the block adds its
 * warps' sums, in warp order, into the chunk's partial sums (the same layout as pass one's). */
template <typename G>
__global__ static void layernorm_backward_fused_kernel(float *dinp, float *part_dw, float *part_db,
                                                       const G *dout, const float *inp,
                                                       const float *weight, const float *mean,
                                                       const float *rstd, int N, int C, int rows)
{
  DT_DYNAMIC_SMEM(sums);
  const int W = (int)(blockDim.x / 32), warp = (int)(threadIdx.x / 32);
  float *dw = sums + 2 * (size_t)warp * C, *db = dw + C;
  for (int c = (int)(threadIdx.x % 32); c < C; c += 32)
    dw[c] = 0.0f, db[c] = 0.0f;
  const long r0 = (long)blockIdx.x * rows, r1 = r0 + rows < N ? r0 + rows : N;
  for (long row = r0 + warp; row < r1; row += W)
    layernorm_backward_row<true>(dinp + row * C, dout + row * C, inp + row * C, weight, mean[row],
                                 rstd[row], C, dw, db);
  __syncthreads();
  for (int c = (int)threadIdx.x; c < C; c += (int)blockDim.x) {
    float sw = 0.0f, sb = 0.0f;
    for (int w = 0; w < W; w++) {
      sw += sums[2 * (size_t)w * C + c];
      sb += sums[(2 * (size_t)w + 1) * C + c];
    }
    part_dw[(size_t)blockIdx.x * C + c] = sw;
    part_db[(size_t)blockIdx.x * C + c] = sb;
  }
}

/* Pass one: thread (chunk = blockIdx.y, channel c) sums rows [chunk * rows, ...) in order. */
template <typename G>
__global__ static void layernorm_backward_partial_kernel(float *part_dw, /* (nchunks, C) */
                                                         float *part_db, /* (nchunks, C) */
                                                         const G *dout, const float *inp,
                                                         const float *mean, const float *rstd,
                                                         int N, int C, int rows)
{
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C)
    return;
  const int chunk = blockIdx.y;
  const int r0 = chunk * rows;
  const int r1 = r0 + rows < N ? r0 + rows : N;
  float dw = 0.0f, db = 0.0f;
  for (int i = r0; i < r1; i++) {
    const float g = dt__load(dout + (size_t)i * C + c);
    db += g;
    dw += (inp[(size_t)i * C + c] - mean[i]) * rstd[i] * g;
  }
  part_dw[(size_t)chunk * C + c] = dw;
  part_db[(size_t)chunk * C + c] = db;
}

#endif
