/* norm.cu — the sum of squares of a device vector (for the global gradient norm), accumulated
 * in double (reference: dt_cpu_sum_squares in kernels/cpu/adamw.c).
 *
 * Deterministic two-pass reduction, no atomics: a grid of ss_blocks(n) blocks (up to
 * SS_BLOCKS, fewer where each thread would have fewer than SS_ELEMS values) walks the vector
 * grid-stride, each thread summing its elements in order, each block reducing its threads in a
 * fixed tree into one partial; then one block adds the partials in a fixed tree. The shape
 * depends on nothing but n and the constants of norm.cuh, so the result is bit-identical from
 * run to run and across GPU models. (A grid of SS_BLOCKS for any n made each small tensor's
 * call, one a tensor under tensor parallelism, a quarter of a million threads mostly idle.) The
 * result goes to the host through the workspace, and is complete when the entry returns (the stream
 * is synchronised). */
#include "cuda_impl.h"
#include "norm.cuh"

int dt__cuda_sum_squares(struct dt_device *dev, const float *x, size_t n, double *out)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  *out = 0.0;
  if (n == 0)
    return 0;
  void *ws = NULL;
  int rc = dt__cuda_workspace(cu, (SS_BLOCKS + 1) * sizeof(double), &ws);
  if (rc < 0)
    return rc;
  double *partial = (double *)ws;
  double *result = partial + SS_BLOCKS;
  /* The grid is n's alone (not dt__cuda_grid(n)): the grid-stride loop covers any n. */
  const unsigned blocks = ss_blocks(n);
  sumsq_partial_kernel<<<blocks, SS_THREADS, 0, cu->stream>>>(partial, x, n);
  DT_CUDA_CHECK(cudaGetLastError());
  sumsq_final_kernel<<<1, SS_THREADS, 0, cu->stream>>>(result, partial, (int)blocks);
  DT_CUDA_CHECK(cudaGetLastError());
  double host = 0.0;
  DT_CUDA_CHECK(cudaMemcpyAsync(&host, result, sizeof host, cudaMemcpyDeviceToHost, cu->stream));
  DT_CUDA_CHECK(cudaStreamSynchronize(cu->stream));
  *out = host;
  return 0;
}
