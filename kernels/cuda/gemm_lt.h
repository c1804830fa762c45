/* gemm_lt.h — a gemm.cuh descriptor as cuBLASLt's: the operation (transposes, fp32 accumulation,
 * the bias, GELU and GELU-gradient epilogues), the three matrix layouts and the algorithm
 * preferences (workspace, the operands' actual alignment) that matmul.cu hands to
 * cublasLtMatmulAlgoGetHeuristic and cublasLtMatmul. Built apart from any device: cuBLASLt's
 * descriptors are host objects that it validates as they are set (an attribute of the wrong size or
 * value is refused), so tests/unit/test_cuda_lt.c builds the linear layer's on machines without a
 * GPU and reads them back against gemm.cuh's semantics. Plain C; the caller links cuBLASLt. */
#ifndef DT_KERNELS_CUDA_GEMM_LT_H
#define DT_KERNELS_CUDA_GEMM_LT_H

#include <stdint.h>

#include <cublasLt.h>

#include "gemm.cuh"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t A, B, C; /* C's is also D's (D is C, or beside g->Cin, laid out alike) */
  cublasLtMatmulPreference_t pref;
  uint32_t align[4]; /* A, B, C, D: the alignment in bytes the algorithm may assume */
} dt_lt_gemm_t;

/* Builds the cuBLASLt form of g (batch 1) with A and B of type ab (CUDA_R_32F or CUDA_R_16BF),
 * C fp32 (bf16 with g->c16), CUBLAS_COMPUTE_32F (no TF32), an fp32 bias, and at most ws_bytes
 * of workspace. 0, or DT_EINVAL for a batched descriptor, one with a bias and the GELU gradient
 * or with the GELU and its gradient, a bf16 C that is read (beta != 0), an fp32 C that gets the
 * GELU or its gradient, or a leading dimension shorter than its stored rows (which cuBLASLt would
 * only refuse on the GPU), or DT_ENOTSUP (nothing logged) for a GELU input (read or written)
 * whose leading dimension cuBLASLt does not take (not a multiple of 8), or DT_ECUDA with
 * the refused call logged; on failure *lt holds nothing to release. */
int dt_lt_gemm_build(dt_lt_gemm_t *lt, const dt_gemm_t *g, cudaDataType_t ab, size_t ws_bytes);
void dt_lt_gemm_release(dt_lt_gemm_t *lt);

/* The alignment, in bytes, that an algorithm may assume of p: the largest power of two dividing
 * its address, up to the 256 the preferences default to. */
uint32_t dt_lt_alignment(const void *p);

#ifdef __cplusplus
}
#endif

#endif
