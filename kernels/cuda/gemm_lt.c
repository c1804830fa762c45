/* gemm_lt.c — see gemm_lt.h. */
#include "gemm_lt.h"

#include <string.h>

#include "cuda_check.h"

uint32_t dt_lt_alignment(const void *p)
{
  uint32_t a = 256;
  while (a > 1 && (uintptr_t)p % a)
    a /= 2;
  return a;
}

static int set_op(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const void *v,
                  size_t bytes)
{
  DT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, attr, v, bytes));
  return 0;
}

static int set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                    const void *v, size_t bytes)
{
  DT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, v, bytes));
  return 0;
}

int dt_lt_gemm_build(dt_lt_gemm_t *lt, const dt_gemm_t *g, cudaDataType_t ab, size_t ws_bytes)
{
  static const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  const cublasOperation_t ta = g->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = g->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue =
      g->gelu_pre  ? (g->bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
      : g->bias    ? CUBLASLT_EPILOGUE_BIAS
      : g->gelu_in ? CUBLASLT_EPILOGUE_DGELU
                   : CUBLASLT_EPILOGUE_DEFAULT;
  const void *aux = g->gelu_pre ? (const void *)g->gelu_pre : g->gelu_in;
  const cudaDataType_t fp32 = CUDA_R_32F, cd = g->c16 ? CUDA_R_16BF : CUDA_R_32F;
  const int64_t aux_ld = g->ldc;
  memset(lt, 0, sizeof *lt);
  if (g->batch != 1 || (g->bias && g->gelu_in) || (g->c16 && g->beta != 0.0f) ||
      ((g->gelu_in || g->gelu_pre) && !g->c16) || (g->gelu_pre && g->gelu_in)) {
    DT_ERROR(KERNEL,
             "cuBLASLt GEMM: batch %d%s%s%s%s (only single products, with one epilogue; a bf16 C "
             "only written; a GELU or its gradient into a bf16 C)",
             g->batch, g->bias && g->gelu_in ? ", bias and GELU gradient" : "",
             g->c16 ? ", bf16 C" : "", g->gelu_in ? ", GELU gradient" : "",
             g->gelu_pre ? ", GELU" : "");
    return DT_EINVAL;
  }
  /* cuBLASLt's rules: the GELU input's leading dimension a multiple of 8; the bias of D's type
   * (a bf16 bias with a bf16 C only; an fp32 bias with an fp32 C only) */
  if (((g->gelu_in || g->gelu_pre) && aux_ld % 8) || (g->bias && g->bias16 != g->c16))
    return DT_ENOTSUP;
  /* Stored column-major: op(A) is m x k, so a transposed A is stored k x m; likewise B. */
  const int a_rows = g->ta ? g->k : g->m, a_cols = g->ta ? g->m : g->k;
  const int b_rows = g->tb ? g->n : g->k, b_cols = g->tb ? g->k : g->n;
  const int ld[3] = {g->A.ld, g->B.ld, g->ldc}, rows[3] = {a_rows, b_rows, g->m};
  for (int i = 0; i < 3; i++)
    if (ld[i] < rows[i]) {
      DT_ERROR(KERNEL,
               "cuBLASLt GEMM m=%d n=%d k=%d: %c's leading dimension %d is shorter than its %d "
               "stored rows",
               g->m, g->n, g->k, "ABC"[i], ld[i], rows[i]);
      return DT_EINVAL;
    }
  lt->align[0] = dt_lt_alignment(g->A.p);
  lt->align[1] = dt_lt_alignment(g->B.p);
  lt->align[2] = dt_lt_alignment(g->Cin ? (const void *)g->Cin : g->C); /* where C is read */
  lt->align[3] = dt_lt_alignment(g->C);
  int rc = 0;
  DT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescCreate(&lt->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), rc, fail);
  DT_CHECK_GOTO(set_op(lt->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), rc, fail);
  DT_CHECK_GOTO(set_op(lt->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), rc, fail);
  DT_CHECK_GOTO(set_op(lt->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue), rc,
                fail);
  /* The bias is added to the fp32 result before a bf16 C's rounding. Its type is left unset (then
   * D's) for a bf16 bias, as for the GELU input below. */
  if (g->bias) { /* the heuristic reads the pointer for its alignment */
    DT_CHECK_GOTO(set_op(lt->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g->bias, sizeof g->bias), rc,
                  fail);
    if (!g->bias16)
      DT_CHECK_GOTO(set_op(lt->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &fp32, sizeof fp32), rc,
                    fail);
  }
  /* The GELU input, laid out like C (the heuristic reads its alignment): read by DGELU, written
   * by GELU_AUX_BIAS. Its type is left unset: it then is D's (bf16, as the forward's bf16 output
   * wrote it), and cublasLt.h warns that setting it for a combination the library does not list
   * makes cublasLtMatmul fail with INVALID_VALUE. */
  if (aux) {
    DT_CHECK_GOTO(set_op(lt->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux), rc,
                  fail);
    DT_CHECK_GOTO(set_op(lt->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld), rc,
                  fail);
  }
  DT_CUBLAS_CHECK_GOTO(cublasLtMatrixLayoutCreate(&lt->A, ab, a_rows, a_cols, g->A.ld), rc, fail);
  DT_CUBLAS_CHECK_GOTO(cublasLtMatrixLayoutCreate(&lt->B, ab, b_rows, b_cols, g->B.ld), rc, fail);
  DT_CUBLAS_CHECK_GOTO(cublasLtMatrixLayoutCreate(&lt->C, cd, g->m, g->n, g->ldc), rc, fail);
  DT_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceCreate(&lt->pref), rc, fail);
  DT_CHECK_GOTO(
      set_pref(lt->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes), rc,
      fail);
  for (int i = 0; i < 4; i++)
    DT_CHECK_GOTO(set_pref(lt->pref, align_attr[i], &lt->align[i], sizeof lt->align[i]), rc, fail);
  return 0;
fail:
  dt_lt_gemm_release(lt);
  return rc;
}

void dt_lt_gemm_release(dt_lt_gemm_t *lt)
{
  if (lt->pref)
    (void)cublasLtMatmulPreferenceDestroy(lt->pref);
  if (lt->C)
    (void)cublasLtMatrixLayoutDestroy(lt->C);
  if (lt->B)
    (void)cublasLtMatrixLayoutDestroy(lt->B);
  if (lt->A)
    (void)cublasLtMatrixLayoutDestroy(lt->A);
  if (lt->op)
    (void)cublasLtMatmulDescDestroy(lt->op);
  memset(lt, 0, sizeof *lt);
}
