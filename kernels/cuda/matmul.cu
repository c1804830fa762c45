/* matmul.cu — the linear layer on the GPU, forward and backward, through cuBLAS (reference:
 * kernels/cpu/matmul.c). PyTorch's nn.Linear convention: weight is (OC, C) and
 * out = inp @ weight^T + bias. The GEMMs' column-major views are gemm.cuh's (built there, run
 * here by dt__cuda_gemm, which attention.cu uses too).
 *
 * Invariants: the handle does plain fp32 math (no TF32); beta = 0 never reads the output (so
 * it may hold garbage); only the first OC columns of an (N, ldo) output are written; cuBLAS's
 * results are deterministic on one stream. dweight and dbias accumulate (beta = 1). */
#include <cuda_bf16.h>

#include "cuda_impl.h"
#include "matmul.cuh"

static cublasOperation_t gemm_op(int t)
{
  return t ? CUBLAS_OP_T : CUBLAS_OP_N;
}

int dt__cuda_gemm(dt_cuda_impl_t *cu, const dt_gemm_t *g)
{
  const float *A = (const float *)g->A.p, *B = (const float *)g->B.p;
  float *C = (float *)g->C;
  if (g->batch == 1 && g->n == 1 && !g->tb) /* a matrix-vector product: op(A) times B's column */
    DT_CUBLAS_CHECK(cublasSgemv(cu->blas, gemm_op(g->ta), g->ta ? g->k : g->m, g->ta ? g->m : g->k,
                                &g->alpha, A, g->A.ld, B, 1, &g->beta, C, 1));
  else if (g->batch == 1)
    DT_CUBLAS_CHECK(cublasSgemm(cu->blas, gemm_op(g->ta), gemm_op(g->tb), g->m, g->n, g->k,
                                &g->alpha, A, g->A.ld, B, g->B.ld, &g->beta, C, g->ldc));
  else
    DT_CUBLAS_CHECK(cublasSgemmStridedBatched(cu->blas, gemm_op(g->ta), gemm_op(g->tb), g->m, g->n,
                                              g->k, &g->alpha, A, g->A.ld, g->A.stride, B, g->B.ld,
                                              g->B.stride, &g->beta, C, g->ldc, g->sC, g->batch));
  return 0;
}

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
  const dt_gemm_t g = gemm_linear_forward(out, inp, weight, N, C, OC, ldo, beta);
  return dt__cuda_gemm(cu, &g);
}

static int bias_backward(dt_cuda_impl_t *cu, float *dbias, const float *dout, int N, int OC,
                         int ldd)
{
  const float *ones = NULL;
  DT_CHECK(dt__cuda_ones(cu, (size_t)N, &ones));
  const dt_gemm_t g = gemm_linear_dbias(dbias, dout, ones, N, OC, ldd);
  return dt__cuda_gemm(cu, &g);
}

int dt__cuda_matmul_backward(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                             const float *dout, const float *inp, const float *weight, int N, int C,
                             int OC, int ldd)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (N <= 0 || C <= 0 || OC <= 0)
    return 0;
  if (dinp) {
    const dt_gemm_t g = gemm_linear_dinp(dinp, dout, weight, N, C, OC, ldd);
    DT_CHECK(dt__cuda_gemm(cu, &g));
  }
  const dt_gemm_t g = gemm_linear_dweight(dweight, dout, inp, N, C, OC, ldd);
  DT_CHECK(dt__cuda_gemm(cu, &g));
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

/* A gemm.cuh descriptor over bf16 operands (one product), accumulated in fp32 into fp32 C. */
static int gemm_bf16(dt_cuda_impl_t *cu, const dt_gemm_t *g)
{
  DT_CUBLAS_CHECK(cublasGemmEx(cu->blas, gemm_op(g->ta), gemm_op(g->tb), g->m, g->n, g->k,
                               &g->alpha, g->A.p, CUDA_R_16BF, g->A.ld, g->B.p, CUDA_R_16BF,
                               g->B.ld, &g->beta, g->C, CUDA_R_32F, g->ldc, CUBLAS_COMPUTE_32F,
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
  const dt_gemm_t g = gemm_linear_forward(out, op[0].dst, op[1].dst, N, C, OC, ldo, beta);
  return gemm_bf16(cu, &g);
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
  /* dout's copy is contiguous (ld OC) */
  if (dinp) {
    const dt_gemm_t g = gemm_linear_dinp(dinp, op[0].dst, op[2].dst, N, C, OC, OC);
    DT_CHECK(gemm_bf16(cu, &g));
  }
  const dt_gemm_t g = gemm_linear_dweight(dweight, op[0].dst, op[1].dst, N, C, OC, OC);
  return gemm_bf16(cu, &g);
}
