/* norm.cu — the sum of squares of a device vector (for the global gradient norm), accumulated
 * in double (reference: dt_cpu_sum_squares in kernels/cpu/adamw.c).
 *
 * Deterministic two-pass reduction, no atomics: a fixed grid of SS_BLOCKS blocks walks the
 * vector grid-stride, each thread summing its elements in order, each block reducing its
 * threads in a fixed tree into one partial; then one block adds the partials in a fixed tree.
 * The shape depends on nothing but the constants below, so the result is bit-identical from
 * run to run and across GPU models. The result goes to the host through the workspace, and is
 * complete when the entry returns (the stream is synchronised). */
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
  /* The grid is fixed (not dt__cuda_grid(n)): the grid-stride loop covers any n. */
  sumsq_partial_kernel<<<SS_BLOCKS, SS_THREADS, 0, cu->stream>>>(partial, x, n);
  DT_CUDA_CHECK(cudaGetLastError());
  sumsq_final_kernel<<<1, SS_THREADS, 0, cu->stream>>>(result, partial, SS_BLOCKS);
  DT_CUDA_CHECK(cudaGetLastError());
  double host = 0.0;
  DT_CUDA_CHECK(cudaMemcpyAsync(&host, result, sizeof host, cudaMemcpyDeviceToHost, cu->stream));
  DT_CUDA_CHECK(cudaStreamSynchronize(cu->stream));
  *out = host;
  return 0;
}
