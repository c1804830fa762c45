/* matmul.cu — the linear layer on the GPU, forward and backward, through cuBLAS (reference:
 * kernels/cpu/matmul.c). PyTorch's nn.Linear convention: weight is (OC, C) and
 * out = inp @ weight^T + bias.
 *
 * cuBLAS is column-major. A row-major (rows, cols) matrix with row stride ld is, read by cuBLAS,
 * the column-major (cols, rows) matrix with leading dimension ld, i.e. its transpose. So every
 * row-major product Y = A B is issued as the column-major Y^T = B^T A^T, with the operands
 * swapped; each call below spells out the view it uses.
 *
 * Invariants: the handle does plain fp32 math (no TF32); beta = 0 never reads the output (so
 * it may hold garbage); only the first OC columns of an (N, ldo) output are written; cuBLAS's
 * results are deterministic on one stream. dweight and dbias accumulate (beta = 1). */
#include "cuda_impl.h"

/* out[i, o] = bias[o] for the first OC columns of each row. */
__global__ static void bias_fill_kernel(float *out, const float *bias, int OC, int ldo,
                                        size_t total)
{
  DT__CUDA_FOR(i, total)
  {
    const size_t row = i / (size_t)OC;
    const size_t o = i % (size_t)OC;
    out[row * ldo + o] = bias[o];
  }
}

int dt__cuda_matmul_forward(struct dt_device *dev, float *out, const float *inp,
                            const float *weight, const float *bias, int N, int C, int OC, int ldo)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (N <= 0 || OC <= 0)
    return 0;
  float beta = 0.0f;
  if (bias) {
    /* Seed each output row with the bias and let the GEMM accumulate onto it (as the CPU). */
    const size_t total = (size_t)N * OC;
    bias_fill_kernel<<<dt__cuda_grid(total, DT__CUDA_THREADS), DT__CUDA_THREADS, 0, cu->stream>>>(
        out, bias, OC, ldo, total);
    DT_CUDA_CHECK(cudaGetLastError());
    beta = 1.0f;
  }
  const float one = 1.0f;
  /* out^T (OC x N, ld ldo) = weight (OC x C) @ inp^T (C x N).
   * weight row-major (OC, C) is column-major (C x OC, ld C): op T gives (OC x C).
   * inp row-major (N, C) is column-major (C x N, ld C): op N. */
  DT_CUBLAS_CHECK(cublasSgemm(cu->blas, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &one, weight, C, inp, C,
                              &beta, out, ldo));
  return 0;
}

int dt__cuda_matmul_backward(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                             const float *dout, const float *inp, const float *weight, int N, int C,
                             int OC, int ldd)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  const float one = 1.0f, zero = 0.0f;
  if (N <= 0 || C <= 0 || OC <= 0)
    return 0;
  if (dinp) {
    /* dinp (N, C) = dout (N, OC) @ weight (OC, C), as
     * dinp^T (C x N, ld C) = weight^T (C x OC) @ dout^T (OC x N).
     * weight row-major is column-major (C x OC, ld C) = weight^T: op N.
     * dout row-major (N, ldd) is column-major (OC x N, ld ldd) = dout^T: op N. */
    DT_CUBLAS_CHECK(cublasSgemm(cu->blas, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, &one, weight, C, dout,
                                ldd, &zero, dinp, C));
  }
  /* dweight (OC, C) += dout^T (OC x N) @ inp (N x C), as
   * dweight^T (C x OC, ld C) += inp^T (C x N) @ dout (N x OC).
   * inp row-major is column-major (C x N, ld C) = inp^T: op N.
   * dout is column-major (OC x N, ld ldd): op T gives (N x OC). */
  DT_CUBLAS_CHECK(cublasSgemm(cu->blas, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, &one, inp, C, dout, ldd,
                              &one, dweight, C));
  if (dbias) {
    /* dbias (OC) += dout^T @ ones: dout as column-major (OC x N, ld ldd), op N, times N ones. */
    const float *ones = NULL;
    int rc = dt__cuda_ones(cu, (size_t)N, &ones);
    if (rc < 0)
      return rc;
    DT_CUBLAS_CHECK(
        cublasSgemv(cu->blas, CUBLAS_OP_N, OC, N, &one, dout, ldd, ones, 1, &one, dbias, 1));
  }
  return 0;
}
