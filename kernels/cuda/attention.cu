/* attention.cu — causal multi-head self-attention on the GPU, fp32, forward and backward
 * (reference: kernels/cpu/attention.c).
 *
 * The T x T probabilities are materialised, as the ops contract says. Per batch element b, each
 * product is one cublasSgemmStridedBatched over the NH heads: head h's q, k and v start at
 * columns h*hs, C + h*hs and 2C + h*hs of the packed (T, 3C) rows (leading dimension 3C, batch
 * stride hs); its (T, T) block of att / scratch follows the previous head's (stride T*T). The
 * products run over the full T x T square; the softmax kernels then write exact zeros above the
 * diagonal, so the zeros make the following products equal to the causal ones.
 *
 * cuBLAS is column-major: a row-major (rows, cols) matrix with row stride ld is the
 * column-major (cols, rows) matrix, its transpose, with leading dimension ld. Each row-major
 * product Y = A B is issued as Y^T = B^T A^T; the comments give the view used.
 *
 * Context parallelism (the _cp entries): Tq queries at positions [q0, q0 + Tq) of qkv rows
 * holding Tall positions per batch element, against the keys [0, Tk), Tk = q0 + Tq: the same
 * products over a Tq x Tk rectangle, the backward accumulating (+=) into dqkv. The plain
 * entries are the q0 = 0, Tq = Tk = Tall case, writing (=).
 *
 * Invariants: att holds the probabilities with exact zeros above the diagonal; dqkv is written
 * (or added to) in exactly the rows the contract names (every column of q | k | v belongs to one
 * head); the softmax reductions are block reductions of fixed shape (deterministic).
 *
 * Flash attention (the _flash entries, at the end): no (T, T) matrix, fp32 on the CUDA cores.
 * One thread per query row (forward; dq) or per key row (dk, dv) keeps its row and its
 * accumulators in registers, sized by a head-size bucket (HSM = 32, 64 or 128 >= hs, the rest
 * zero), while the block streams tiles of the other side's rows through shared memory:
 * - forward: the online softmax (running max m and sum l, o rescaled when m grows) over key
 *   tiles; writes out and lse = m + log l;
 * - backward, two kernels and no atomics (deterministic): the first, per query row, computes
 *   D = dout . out (kept in the workspace for the second), recomputes p = exp(s - lse) over
 *   its keys and adds dq = scale sum_j p (dp_j - D) k_j with dp_j = dout . v_j; the second, per
 *   key row, walks the query rows at or after it and adds dv = sum_t p dout_t and
 *   dk = scale sum_t p (dp - D_t) q_t. The scores are computed twice: the price of no atomics.
 * Sums run in other orders than the CPU's GEMMs: the tolerance is test_cuda's 1e-5 of scale. */
#include <math.h>

#include "cuda_impl.h"

#define ATT_THREADS 256 /* softmax kernels, one block per row of one (b, h) matrix */

/* Row r of the (B*NH*Tq, Tk) matrix of scores is query position t = q0 + r % Tq: probabilities
 * over j <= t, exact zeros after. The scores arrive already scaled by 1/sqrt(hs) (the GEMM's
 * alpha). */
__global__ static void causal_softmax_kernel(float *att, int Tq, int Tk, int q0)
{
  float *row = att + (size_t)blockIdx.x * Tk;
  const int t = q0 + (int)(blockIdx.x % (unsigned)Tq);
  float m = -INFINITY;
  for (int j = threadIdx.x; j <= t; j += blockDim.x)
    m = row[j] > m ? row[j] : m;
  m = dt__block_reduce(m, dt__max_op());
  float s = 0.0f;
  for (int j = threadIdx.x; j <= t; j += blockDim.x) {
    const float e = expf(row[j] - m);
    row[j] = e;
    s += e;
  }
  s = dt__block_reduce(s, dt__sum_op());
  const float inv = 1.0f / s;
  /* Each thread rescales the entries it wrote itself above. */
  for (int j = threadIdx.x; j < Tk; j += blockDim.x)
    row[j] = j <= t ? row[j] * inv : 0.0f;
}

/* Softmax backward with the 1/sqrt(hs) of the scores folded in, in place on the datt rows:
 * dS = scale * A * (dA - sum_j A dA) for j <= t, exact zeros after. */
__global__ static void causal_softmax_backward_kernel(float *dS, const float *att, int Tq, int Tk,
                                                      int q0, float scale)
{
  float *d = dS + (size_t)blockIdx.x * Tk;
  const float *a = att + (size_t)blockIdx.x * Tk;
  const int t = q0 + (int)(blockIdx.x % (unsigned)Tq);
  float dot = 0.0f;
  for (int j = threadIdx.x; j <= t; j += blockDim.x)
    dot += a[j] * d[j];
  dot = dt__block_reduce(dot, dt__sum_op());
  for (int j = threadIdx.x; j < Tk; j += blockDim.x)
    d[j] = j <= t ? scale * a[j] * (d[j] - dot) : 0.0f;
}

int dt__cuda_attention_forward_cp(struct dt_device *dev, float *out, float *att, const float *qkv,
                                  int B, int Tq, int q0, int Tall, int C, int NH)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (B <= 0 || Tq <= 0 || C <= 0 || NH <= 0)
    return 0;
  const int hs = C / NH, C3 = 3 * C, Tk = q0 + Tq;
  const float scale = 1.0f / sqrtf((float)hs), one = 1.0f, zero = 0.0f;
  const long long QK = (long long)Tq * Tk;
  for (int b = 0; b < B; b++) {
    const float *q = qkv + ((size_t)b * Tall + q0) * C3;
    const float *k = qkv + (size_t)b * Tall * C3 + C;
    float *A = att + (size_t)b * NH * QK;
    /* scores (Tq x Tk) = scale * Q K^T, as scores^T = scale * K Q^T:
     * K as stored is column-major (hs x Tk, ld 3C) = K^T, op T gives K (Tk x hs);
     * Q as stored is Q^T (hs x Tq), op N. */
    DT_CUBLAS_CHECK(cublasSgemmStridedBatched(cu->blas, CUBLAS_OP_T, CUBLAS_OP_N, Tk, Tq, hs,
                                              &scale, k, C3, hs, q, C3, hs, &zero, A, Tk, QK, NH));
  }
  causal_softmax_kernel<<<(unsigned)((size_t)B * NH * Tq), ATT_THREADS, 0, cu->stream>>>(att, Tq,
                                                                                         Tk, q0);
  DT_CUDA_CHECK(cudaGetLastError());
  for (int b = 0; b < B; b++) {
    const float *v = qkv + (size_t)b * Tall * C3 + 2 * C;
    const float *A = att + (size_t)b * NH * QK;
    float *o = out + (size_t)b * Tq * C;
    /* out (Tq x hs, ld C) = A V, as out^T (hs x Tq) = V^T A^T:
     * V as stored is V^T (hs x Tk, ld 3C), op N; A as stored is A^T (Tk x Tq, ld Tk), op N. */
    DT_CUBLAS_CHECK(cublasSgemmStridedBatched(cu->blas, CUBLAS_OP_N, CUBLAS_OP_N, hs, Tq, Tk, &one,
                                              v, C3, hs, A, Tk, QK, &zero, o, C, hs, NH));
  }
  return 0;
}

int dt__cuda_attention_forward(struct dt_device *dev, float *out, float *att, const float *qkv,
                               int B, int T, int C, int NH)
{
  return dt__cuda_attention_forward_cp(dev, out, att, qkv, B, T, 0, T, C, NH);
}

/* beta 0: dqkv written (=), 1: accumulated (+=, the _cp contract). */
static int attention_backward(struct dt_device *dev, float *dqkv, float *scratch, const float *dout,
                              const float *qkv, const float *att, int B, int Tq, int q0, int Tall,
                              int C, int NH, float beta)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (B <= 0 || Tq <= 0 || C <= 0 || NH <= 0)
    return 0;
  const int hs = C / NH, C3 = 3 * C, Tk = q0 + Tq;
  const float scale = 1.0f / sqrtf((float)hs), one = 1.0f, zero = 0.0f;
  const long long QK = (long long)Tq * Tk;
  for (int b = 0; b < B; b++) {
    const float *v = qkv + (size_t)b * Tall * C3 + 2 * C;
    const float *dO = dout + (size_t)b * Tq * C;
    const float *A = att + (size_t)b * NH * QK;
    float *dS = scratch + (size_t)b * NH * QK;
    float *dv = dqkv + (size_t)b * Tall * C3 + 2 * C;
    /* dA (Tq x Tk) = dO V^T, as dA^T = V dO^T:
     * V as stored is V^T (hs x Tk, ld 3C), op T gives V (Tk x hs);
     * dO as stored is dO^T (hs x Tq, ld C), op N. */
    DT_CUBLAS_CHECK(cublasSgemmStridedBatched(cu->blas, CUBLAS_OP_T, CUBLAS_OP_N, Tk, Tq, hs, &one,
                                              v, C3, hs, dO, C, hs, &zero, dS, Tk, QK, NH));
    /* dV (Tk x hs, ld 3C) = A^T dO, as dV^T (hs x Tk) = dO^T A:
     * dO as stored is dO^T (hs x Tq, ld C), op N; A as stored is A^T (ld Tk), op T gives A. */
    DT_CUBLAS_CHECK(cublasSgemmStridedBatched(cu->blas, CUBLAS_OP_N, CUBLAS_OP_T, hs, Tk, Tq, &one,
                                              dO, C, hs, A, Tk, QK, &beta, dv, C3, hs, NH));
  }
  causal_softmax_backward_kernel<<<(unsigned)((size_t)B * NH * Tq), ATT_THREADS, 0, cu->stream>>>(
      scratch, att, Tq, Tk, q0, scale);
  DT_CUDA_CHECK(cudaGetLastError());
  for (int b = 0; b < B; b++) {
    const float *q = qkv + ((size_t)b * Tall + q0) * C3;
    const float *k = qkv + (size_t)b * Tall * C3 + C;
    const float *dS = scratch + (size_t)b * NH * QK;
    float *dq = dqkv + ((size_t)b * Tall + q0) * C3;
    float *dk = dqkv + (size_t)b * Tall * C3 + C;
    /* dQ (Tq x hs, ld 3C) = dS K, as dQ^T (hs x Tq) = K^T dS^T:
     * K as stored is K^T (hs x Tk, ld 3C), op N; dS as stored is dS^T (ld Tk), op N. */
    DT_CUBLAS_CHECK(cublasSgemmStridedBatched(cu->blas, CUBLAS_OP_N, CUBLAS_OP_N, hs, Tq, Tk, &one,
                                              k, C3, hs, dS, Tk, QK, &beta, dq, C3, hs, NH));
    /* dK (Tk x hs, ld 3C) = dS^T Q, as dK^T (hs x Tk) = Q^T dS:
     * Q as stored is Q^T (hs x Tq, ld 3C), op N; dS as stored is dS^T (ld Tk), op T gives dS. */
    DT_CUBLAS_CHECK(cublasSgemmStridedBatched(cu->blas, CUBLAS_OP_N, CUBLAS_OP_T, hs, Tk, Tq, &one,
                                              q, C3, hs, dS, Tk, QK, &beta, dk, C3, hs, NH));
  }
  return 0;
}

int dt__cuda_attention_backward_cp(struct dt_device *dev, float *dqkv, float *scratch,
                                   const float *dout, const float *qkv, const float *att, int B,
                                   int Tq, int q0, int Tall, int C, int NH)
{
  return attention_backward(dev, dqkv, scratch, dout, qkv, att, B, Tq, q0, Tall, C, NH, 1.0f);
}

int dt__cuda_attention_backward(struct dt_device *dev, float *dqkv, float *scratch,
                                const float *dout, const float *qkv, const float *att, int B, int T,
                                int C, int NH)
{
  return attention_backward(dev, dqkv, scratch, dout, qkv, att, B, T, 0, T, C, NH, 0.0f);
}

/* ------------------------------------------------------------------------------------------ */
/* Flash attention                                                                             */
/* ------------------------------------------------------------------------------------------ */

#define FLASH_ROWS   64  /* threads per block of the forward and dq kernels: query rows */
#define FLASH_KEYS   32  /* key rows per shared tile (forward, dq) */
#define FLASH_KROWS  32  /* threads per block of the dk/dv kernel: key rows */
#define FLASH_QTILE  32  /* query rows per shared tile (dk/dv) */
#define FLASH_MAX_HS 128 /* the largest head-size bucket */

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

/* Grid (query blocks, B * NH), FLASH_ROWS threads, 2 FLASH_KEYS HSM floats of shared memory. */
template <int HSM>
__global__ static void __launch_bounds__(FLASH_ROWS)
    flash_forward_kernel(float *out, float *lse, const float *qkv, int Tq, int q0, int Tall, int C,
                         int NH, float scale)
{
  extern __shared__ float smem[];
  float *ks = smem, *vs = smem + FLASH_KEYS * HSM;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH, hs = C / NH;
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

/* Grid (query blocks, B * NH), FLASH_ROWS threads, 2 FLASH_KEYS HSM floats of shared memory.
 * Dbuf (B, NH, Tq) gets D = dout . out of every query row. */
template <int HSM>
__global__ static void __launch_bounds__(FLASH_ROWS)
    flash_backward_dq_kernel(float *dqkv, float *Dbuf, const float *dout, const float *qkv,
                             const float *out, const float *lse, int Tq, int q0, int Tall, int C,
                             int NH, float scale)
{
  extern __shared__ float smem[];
  float *ks = smem, *vs = smem + FLASH_KEYS * HSM;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH, hs = C / NH;
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
      dqrow[d] += scale * dq[d];
}

/* Shared floats of the dk/dv kernel: its key rows' k and v (rows padded to HSM + 1 so that the
 * threads' row-wise reads fall in distinct banks), a tile of q and dout rows, their lse and D. */
template <int HSM> static constexpr size_t flash_dkdv_smem_floats(void)
{
  return 2 * FLASH_KROWS * (HSM + 1) + 2 * FLASH_QTILE * HSM + 2 * FLASH_QTILE;
}

/* Grid (key blocks, B * NH), FLASH_KROWS threads: key j = q0 + Tq keys in all. */
template <int HSM>
__global__ static void __launch_bounds__(FLASH_KROWS)
    flash_backward_dkdv_kernel(float *dqkv, const float *Dbuf, const float *dout, const float *qkv,
                               const float *lse, int Tq, int q0, int Tall, int C, int NH,
                               float scale)
{
  extern __shared__ float smem[];
  float *kown = smem, *vown = smem + FLASH_KROWS * (HSM + 1);
  float *qs = vown + FLASH_KROWS * (HSM + 1), *gs = qs + FLASH_QTILE * HSM;
  float *Ls = gs + FLASH_QTILE * HSM, *Ds = Ls + FLASH_QTILE;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH, hs = C / NH, tid = threadIdx.x;
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
      dkrow[d] += scale * dk[d];
      dvrow[d] += dv[d];
    }
}

/* Dynamic shared memory past the default 48 KiB needs the kernel's consent. */
template <typename K> static int flash_smem(K kernel, size_t bytes)
{
  if (bytes > 48 * 1024)
    DT_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  return 0;
}

template <int HSM>
static int flash_forward(dt_cuda_impl_t *cu, float *out, float *lse, const float *qkv, int B,
                         int Tq, int q0, int Tall, int C, int NH)
{
  const dim3 grid((unsigned)((Tq + FLASH_ROWS - 1) / FLASH_ROWS), (unsigned)(B * NH));
  const size_t smem = 2 * FLASH_KEYS * HSM * sizeof(float);
  DT_CHECK(flash_smem(flash_forward_kernel<HSM>, smem));
  flash_forward_kernel<HSM><<<grid, FLASH_ROWS, smem, cu->stream>>>(
      out, lse, qkv, Tq, q0, Tall, C, NH, 1.0f / sqrtf((float)(C / NH)));
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

template <int HSM>
static int flash_backward(dt_cuda_impl_t *cu, float *dqkv, const float *dout, const float *qkv,
                          const float *out, const float *lse, int B, int Tq, int q0, int Tall,
                          int C, int NH)
{
  void *ws;
  DT_CHECK(dt__cuda_workspace(cu, (size_t)B * NH * Tq * sizeof(float), &ws));
  float *D = (float *)ws;
  const float scale = 1.0f / sqrtf((float)(C / NH));
  const dim3 qgrid((unsigned)((Tq + FLASH_ROWS - 1) / FLASH_ROWS), (unsigned)(B * NH));
  const size_t qsmem = 2 * FLASH_KEYS * HSM * sizeof(float);
  DT_CHECK(flash_smem(flash_backward_dq_kernel<HSM>, qsmem));
  flash_backward_dq_kernel<HSM><<<qgrid, FLASH_ROWS, qsmem, cu->stream>>>(
      dqkv, D, dout, qkv, out, lse, Tq, q0, Tall, C, NH, scale);
  DT_CUDA_CHECK(cudaGetLastError());
  const dim3 kgrid((unsigned)((q0 + Tq + FLASH_KROWS - 1) / FLASH_KROWS), (unsigned)(B * NH));
  const size_t ksmem = flash_dkdv_smem_floats<HSM>() * sizeof(float);
  DT_CHECK(flash_smem(flash_backward_dkdv_kernel<HSM>, ksmem));
  flash_backward_dkdv_kernel<HSM><<<kgrid, FLASH_KROWS, ksmem, cu->stream>>>(
      dqkv, D, dout, qkv, lse, Tq, q0, Tall, C, NH, scale);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

/* The head-size bucket of hs: 32, 64 or 128; 0 (with the error logged) past FLASH_MAX_HS. */
static int flash_bucket(int C, int NH)
{
  const int hs = C / NH;
  if (hs <= 32)
    return 32;
  if (hs <= 64)
    return 64;
  if (hs <= FLASH_MAX_HS)
    return 128;
  DT_ERROR(KERNEL,
           "flash attention on the GPU takes head sizes up to %d, not %d; use --attention "
           "materialized",
           FLASH_MAX_HS, hs);
  return 0;
}

int dt__cuda_attention_forward_flash(struct dt_device *dev, float *out, float *lse,
                                     const float *qkv, int B, int Tq, int q0, int Tall, int C,
                                     int NH)
{
  if (B <= 0 || Tq <= 0 || C <= 0 || NH <= 0)
    return 0;
  dt_cuda_impl_t *cu = dt__cuda(dev);
  switch (flash_bucket(C, NH)) {
  case 32:
    return flash_forward<32>(cu, out, lse, qkv, B, Tq, q0, Tall, C, NH);
  case 64:
    return flash_forward<64>(cu, out, lse, qkv, B, Tq, q0, Tall, C, NH);
  case 128:
    return flash_forward<128>(cu, out, lse, qkv, B, Tq, q0, Tall, C, NH);
  default:
    return DT_ENOTSUP;
  }
}

int dt__cuda_attention_backward_flash(struct dt_device *dev, float *dqkv, const float *dout,
                                      const float *qkv, const float *out, const float *lse, int B,
                                      int Tq, int q0, int Tall, int C, int NH)
{
  if (B <= 0 || Tq <= 0 || C <= 0 || NH <= 0)
    return 0;
  dt_cuda_impl_t *cu = dt__cuda(dev);
  switch (flash_bucket(C, NH)) {
  case 32:
    return flash_backward<32>(cu, dqkv, dout, qkv, out, lse, B, Tq, q0, Tall, C, NH);
  case 64:
    return flash_backward<64>(cu, dqkv, dout, qkv, out, lse, B, Tq, q0, Tall, C, NH);
  case 128:
    return flash_backward<128>(cu, dqkv, dout, qkv, out, lse, B, Tq, q0, Tall, C, NH);
  default:
    return DT_ENOTSUP;
  }
}
