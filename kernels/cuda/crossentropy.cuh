/* crossentropy.cuh — the cross-entropy kernels (crossentropy.cu launches them, one block of
 * CE_THREADS per row; its top comment states the arithmetic). A row is read in 16-byte vectors
 * where it is 16-byte aligned (the LM head's rows are, with Vp a multiple of 128), two a thread
 * at a time, once for the max and the sum together (online softmax); the gradients then read it
 * again from the block's shared memory where the first pass kept it there (crossentropy.cu's
 * choice: where a row fits twice in an SM), else from memory. Device code only, also compiled
 * for the host by tests/unit/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_CROSSENTROPY_CUH
#define DT_KERNELS_CUDA_CROSSENTROPY_CUH

#include <math.h>

#include "block.cuh"

#define CE_THREADS 512     /* a multiple of 32 */
#define CE_VEC     DT__VEC /* elements a thread reads at once (block.cuh's vectors) */

/* Whole vectors of CE_VEC in the first n elements of a row at x whose rows are ld elements
 * apart: n / CE_VEC where x is 16-byte aligned and ld a multiple of CE_VEC, else 0 (the row then
 * goes one element at a time). The same for fp32 and bf16 rows of the same shape, so that both
 * forms split a row among the threads alike and sum in the same order. */
template <typename T> __device__ static inline int ce_vectors(const T *x, int n, int ld)
{
  return ((size_t)x % 16) == 0 && ld % CE_VEC == 0 ? n / CE_VEC : 0;
}

/* Raises a running (max m, sum s of exp(. - m)) to the max v where v is larger, the sum
 * rescaled to it. */
__device__ static inline void ce_rescale(float *m, float *s, float v)
{
  if (v > *m) {
    *s *= expf(*m - v);
    *m = v;
  }
}

/* Adds a vector v to a thread's running (max m, sum s): the max first, then the sum. */
__device__ static inline void ce_add_vec(float *m, float *s, const float v[CE_VEC])
{
  float vm = v[0];
  for (int i = 1; i < CE_VEC; i++)
    vm = v[i] > vm ? v[i] : vm;
  ce_rescale(m, s, vm);
  for (int i = 0; i < CE_VEC; i++)
    *s += expf(v[i] - *m);
}

/* The block's (max M, sum S of exp(x[j] - M)) over row x's first n elements (rows ld apart) in
 * one pass (online softmax): each thread's vectors in order (vector c = threadIdx.x + k
 * blockDim.x; two loaded before either is added, so that two are in flight), then the elements
 * past the last whole vector one at a time, then the threads' pairs rescaled to M and summed in
 * the fixed order of dt__block_reduce (deterministic). keep (or NULL): the block's shared
 * memory, ld elements, which gets the row's first n values as read and 0 past them (the
 * reductions' barriers then make it the whole block's). Every thread of the block must call
 * it. */
template <typename T>
__device__ static inline void ce_row_stats(const T *x, int n, int ld, float *M, float *S, T *keep)
{
  float m = -INFINITY, s = 0.0f;
  const int nv = ce_vectors(x, n, ld), step = (int)blockDim.x;
  int c = threadIdx.x;
  for (; c + step < nv; c += 2 * step) {
    float v[2][CE_VEC];
    dt__load_vec(x + (size_t)c * CE_VEC, v[0]);
    dt__load_vec(x + (size_t)(c + step) * CE_VEC, v[1]);
    for (int k = 0; k < 2; k++) {
      ce_add_vec(&m, &s, v[k]);
      if (keep)
        dt__store_vec(keep + (size_t)(c + k * step) * CE_VEC, v[k]);
    }
  }
  if (c < nv) {
    float v[CE_VEC];
    dt__load_vec(x + (size_t)c * CE_VEC, v);
    ce_add_vec(&m, &s, v);
    if (keep)
      dt__store_vec(keep + (size_t)c * CE_VEC, v);
  }
  for (int j = nv * CE_VEC + threadIdx.x; j < n; j += step) {
    const float v = dt__load(x + j);
    ce_rescale(&m, &s, v);
    s += expf(v - m);
    if (keep)
      dt__store(keep + j, v);
  }
  if (keep)
    for (int j = n + threadIdx.x; j < ld; j += step)
      dt__store(keep + j, 0.0f);
  *M = dt__block_reduce(m, dt__max_op());
  *S = dt__block_reduce(m == -INFINITY ? 0.0f : s * expf(m - *M), dt__sum_op());
}

/* Overwrites row x's first ld elements with the gradients: exp(src[j] - M) * scale for j < n,
 * less dloss at tgt (a column of this row, or outside [0, n) for none), 0 past n. src: the row
 * itself, or ce_row_stats' keep. Each thread reads and writes only its own elements of x (the
 * vectors as ce_row_stats', then the rest). */
template <typename T>
__device__ static inline void ce_row_grads(T *x, const T *src, int n, int ld, float M, float scale,
                                           int tgt, float dloss)
{
  const int nv = ce_vectors(x, ld, ld);
  for (int c = threadIdx.x; c < nv; c += blockDim.x) {
    T *p = x + (size_t)c * CE_VEC;
    float v[CE_VEC];
    dt__load_vec(src + (size_t)c * CE_VEC, v);
    for (int i = 0; i < CE_VEC; i++) {
      const int j = c * CE_VEC + i;
      v[i] = j < n ? expf(v[i] - M) * scale - (j == tgt ? dloss : 0.0f) : 0.0f;
    }
    dt__store_vec(p, v);
  }
  for (int j = nv * CE_VEC + threadIdx.x; j < ld; j += blockDim.x)
    dt__store(x + j,
              j < n ? expf(dt__load(src + j) - M) * scale - (j == tgt ? dloss : 0.0f) : 0.0f);
}

/* T: the logits' element type (float, or __nv_bfloat16 under bf16 compute: the LM head's bf16
 * output), read as fp32; the dlogits overwrite them in place in the same type. The exps are
 * computed again for the gradient rather than kept in place: a bf16 row could not hold them.
 * keep: the row is kept in the block's dynamic shared memory (Vp elements of T) between the
 * passes. */
template <typename T>
__global__ static void crossentropy_kernel(float *losses, T *logits, const int *targets,
                                           float dloss, int V, int Vp, int keep)
{
  DT_DYNAMIC_SMEM(ce_kept);
  const size_t row = blockIdx.x;
  T *x = logits + row * Vp, *kept = keep ? (T *)ce_kept : NULL;
  const int tgt = targets[row];
  const float x_tgt = dt__load(x + tgt);
  float M, S;
  ce_row_stats(x, V, Vp, &M, &S, kept);
  if (threadIdx.x == 0)
    losses[row] = logf(S) - (x_tgt - M);
  if (dloss != 0.0f)
    ce_row_grads(x, kept ? (const T *)kept : x, V, Vp, M, dloss / S, tgt, dloss);
}

/* stats[row] = (local max, local sum of exp(x - max), target logit if held here else 0); a
 * rank holding no columns reports (-inf, 0, 0). */
template <typename T>
__global__ static void vp_stats_kernel(float *stats, const T *logits, const int *targets,
                                       int vocab_lo, int Vl, int ldl)
{
  const size_t row = blockIdx.x;
  const T *x = logits + row * ldl;
  float M, S;
  ce_row_stats(x, Vl, ldl, &M, &S, (T *)NULL);
  if (threadIdx.x == 0) {
    const int t = targets[row] - vocab_lo;
    stats[3 * row + 0] = Vl > 0 ? M : -INFINITY;
    stats[3 * row + 1] = Vl > 0 ? S : 0.0f;
    stats[3 * row + 2] = t >= 0 && t < Vl ? dt__load(x + t) : 0.0f;
  }
}

/* Combines the ranks' triples of one row (every thread computes the same few scalars, in rank
 * order), writes the loss and, when dloss != 0, this rank's dlogits in place (T as
 * crossentropy_kernel's). */
template <typename T>
__global__ static void vp_finish_kernel(float *losses, T *logits, const float *all_stats,
                                        int nranks, const int *targets, int vocab_lo, float dloss,
                                        int N, int Vl, int ldl)
{
  const size_t row = blockIdx.x;
  const size_t rstride = 3 * (size_t)N;
  float M = -INFINITY, xt = 0.0f;
  for (int r = 0; r < nranks; r++) {
    const float *st = all_stats + r * rstride + 3 * row;
    M = st[0] > M ? st[0] : M;
    xt += st[2]; /* one rank holds the target, the others add 0 */
  }
  float S = 0.0f;
  for (int r = 0; r < nranks; r++) {
    const float *st = all_stats + r * rstride + 3 * row;
    if (st[0] != -INFINITY)
      S += st[1] * expf(st[0] - M);
  }
  if (threadIdx.x == 0)
    losses[row] = logf(S) - (xt - M);
  if (dloss != 0.0f)
    ce_row_grads(logits + row * ldl, (const T *)(logits + row * ldl), Vl, ldl, M, dloss / S,
                 targets[row] - vocab_lo, dloss);
}

#endif
