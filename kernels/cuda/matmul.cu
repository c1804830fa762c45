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
#include <cuda_bf16.h>

#include "cuda_impl.h"
#include "matmul.cuh"

/* Seeds each output row with the bias (when there is one) and sets *beta so that the GEMM
 * accumulates onto it, as the CPU does; without a bias *beta stays 0. */
static int bias_seed(dt_cuda_impl_t *cu, float *out, const float *bias, int N, int OC, int ldo,
                     float *beta)
{
  if (!bias)
    return 0;
  const size_t total = (size_t)N * OC;
  bias_fill_kernel<<<dt__cuda_grid(total, DT__CUDA_THREADS), DT__CUDA_THREADS, 0, cu->stream>>>(
      out, bias, OC, ldo, total);
  DT_CUDA_CHECK(cudaGetLastError());
  *beta = 1.0f;
  return 0;
}

int dt__cuda_matmul_forward(struct dt_device *dev, float *out, const float *inp,
                            const float *weight, const float *bias, int N, int C, int OC, int ldo)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (N <= 0 || OC <= 0)
    return 0;
  float beta = 0.0f;
  DT_CHECK(bias_seed(cu, out, bias, N, OC, ldo, &beta));
  const float one = 1.0f;
  /* out^T (OC x N, ld ldo) = weight (OC x C) @ inp^T (C x N).
   * weight row-major (OC, C) is column-major (C x OC, ld C): op T gives (OC x C).
   * inp row-major (N, C) is column-major (C x N, ld C): op N. */
  DT_CUBLAS_CHECK(cublasSgemm(cu->blas, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &one, weight, C, inp, C,
                              &beta, out, ldo));
  return 0;
}

/* dbias (OC) += dout^T @ ones: dout as column-major (OC x N, ld ldd), op N, times N ones. */
static int bias_backward(dt_cuda_impl_t *cu, float *dbias, const float *dout, int N, int OC,
                         int ldd)
{
  const float one = 1.0f;
  const float *ones = NULL;
  DT_CHECK(dt__cuda_ones(cu, (size_t)N, &ones));
  DT_CUBLAS_CHECK(
      cublasSgemv(cu->blas, CUBLAS_OP_N, OC, N, &one, dout, ldd, ones, 1, &one, dbias, 1));
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
  return dbias ? bias_backward(cu, dbias, dout, N, OC, ldd) : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* bf16 compute (ops.h): operands rounded to bf16 (to nearest even, as the CPU's dt_bf16_round), */
/* products accumulated in fp32 by cublasGemmEx on the tensor cores, fp32 outputs.              */
/* ------------------------------------------------------------------------------------------ */

/* Carves n bf16 copies out of one workspace request (each 256-byte aligned) and fills them. */
typedef struct {
  const float *src;
  size_t rows, cols, lds;
  __nv_bfloat16 *dst;
} bf16_operand_t;

static int bf16_operands(dt_cuda_impl_t *cu, bf16_operand_t *ops, int n)
{
  size_t bytes = 0, off[3];
  for (int i = 0; i < n; i++) {
    off[i] = bytes;
    bytes += (ops[i].rows * ops[i].cols * sizeof(__nv_bfloat16) + 255) / 256 * 256;
  }
  void *ws = NULL;
  DT_CHECK(dt__cuda_workspace(cu, bytes, &ws));
  for (int i = 0; i < n; i++) {
    const size_t total = ops[i].rows * ops[i].cols;
    ops[i].dst = (__nv_bfloat16 *)((char *)ws + off[i]);
    to_bf16_kernel<<<dt__cuda_grid(total, DT__CUDA_THREADS), DT__CUDA_THREADS, 0, cu->stream>>>(
        ops[i].dst, ops[i].src, ops[i].cols, ops[i].lds, total);
    DT_CUDA_CHECK(cudaGetLastError());
  }
  return 0;
}

/* The column-major product C (m x n, ld ldc, fp32) = alpha op(A) op(B) + beta C of bf16
 * operands, accumulated in fp32. */
static int gemm_bf16(dt_cuda_impl_t *cu, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                     int k, const __nv_bfloat16 *A, int lda, const __nv_bfloat16 *B, int ldb,
                     float beta, float *C, int ldc)
{
  const float one = 1.0f;
  DT_CUBLAS_CHECK(cublasGemmEx(cu->blas, ta, tb, m, n, k, &one, A, CUDA_R_16BF, lda, B, CUDA_R_16BF,
                               ldb, &beta, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
  return 0;
}

int dt__cuda_matmul_forward_bf16(struct dt_device *dev, float *out, const float *inp,
                                 const float *weight, const float *bias, int N, int C, int OC,
                                 int ldo)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (N <= 0 || OC <= 0)
    return 0;
  float beta = 0.0f;
  DT_CHECK(bias_seed(cu, out, bias, N, OC, ldo, &beta));
  bf16_operand_t op[2] = {{inp, (size_t)N, (size_t)C, (size_t)C, NULL},
                          {weight, (size_t)OC, (size_t)C, (size_t)C, NULL}};
  DT_CHECK(bf16_operands(cu, op, 2));
  /* the views of dt__cuda_matmul_forward */
  return gemm_bf16(cu, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, op[1].dst, C, op[0].dst, C, beta, out,
                   ldo);
}

int dt__cuda_matmul_backward_bf16(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                                  const float *dout, const float *inp, const float *weight, int N,
                                  int C, int OC, int ldd)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (N <= 0 || C <= 0 || OC <= 0)
    return 0;
  if (dbias) /* from the fp32 gradient (ops.h) */
    DT_CHECK(bias_backward(cu, dbias, dout, N, OC, ldd));
  bf16_operand_t op[3] = {{dout, (size_t)N, (size_t)OC, (size_t)ldd, NULL},
                          {inp, (size_t)N, (size_t)C, (size_t)C, NULL},
                          {weight, (size_t)OC, (size_t)C, (size_t)C, NULL}};
  DT_CHECK(bf16_operands(cu, op, dinp ? 3 : 2));
  /* the views of dt__cuda_matmul_backward, with dout now contiguous (ld OC) */
  if (dinp)
    DT_CHECK(gemm_bf16(cu, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, op[2].dst, C, op[0].dst, OC, 0.0f,
                       dinp, C));
  return gemm_bf16(cu, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, op[1].dst, C, op[0].dst, OC, 1.0f,
                   dweight, C);
}
