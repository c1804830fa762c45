/* test_cuda_lt.c — the cuBLASLt form of the linear layer's GEMMs (kernels/cuda/gemm_lt.h), built
 * and read back on a machine without a GPU (label "unit", configured wherever the CUDA toolkit
 * is).
 *
 * cuBLASLt's descriptors are host objects: creating them and setting their attributes needs no
 * driver, and cuBLASLt refuses an attribute of the wrong size or value as it is set. So this
 * test runs every call of dt_lt_gemm_build that matmul.cu makes before the heuristic, for each
 * product of the linear layer (forward with and without its bias epilogue, dinp, dweight), in
 * fp32 and bf16, and reads the result back through cuBLASLt's getters against what the layer's
 * row-major buffers are as column-major matrices: weight (OC, C) is C x OC with ld C, inp
 * (N, C) is C x N with ld C, dout (N, ldd) is OC x N with ld ldd, out (N, ldo) is OC x N with
 * ld ldo. Those expectations come from the buffers' shapes, not from gemm.cuh: a transposed
 * layout stored the wrong way round, a leading dimension or an epilogue lost on the way from
 * the descriptor to cuBLASLt fails here instead of on a GPU. What cuBLASLt then computes
 * (the heuristic's algorithm, the product) is test_cuda's, on a GPU. */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>

#include "dt_error.h"
#include "gemm_lt.h"

/* What one stored matrix must be. */
typedef struct {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
} want_t;

/* One attribute read back, of exactly the size cuBLASLt stores. */
static void layout_get(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr, void *v,
                       size_t bytes)
{
  size_t got = 0;
  ck_assert_int_eq(cublasLtMatrixLayoutGetAttribute(l, attr, v, bytes, &got),
                   CUBLAS_STATUS_SUCCESS);
  ck_assert_uint_eq(got, bytes);
}

static void op_get(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, void *v,
                   size_t bytes)
{
  size_t got = 0;
  ck_assert_int_eq(cublasLtMatmulDescGetAttribute(op, attr, v, bytes, &got), CUBLAS_STATUS_SUCCESS);
  ck_assert_uint_eq(got, bytes);
}

static void check_layout(cublasLtMatrixLayout_t l, want_t w, const char *what)
{
  int32_t type = -1, order = -1, batch = -1;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  layout_get(l, CUBLASLT_MATRIX_LAYOUT_TYPE, &type, sizeof type);
  layout_get(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof rows);
  layout_get(l, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof cols);
  layout_get(l, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld);
  layout_get(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof order);
  layout_get(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch);
  ck_assert_msg(type == (int32_t)w.type && rows == w.rows && cols == w.cols && ld == w.ld,
                "%s: type %d rows %llu cols %llu ld %lld; want type %d rows %llu cols %llu ld %lld",
                what, type, (unsigned long long)rows, (unsigned long long)cols, (long long)ld,
                (int)w.type, (unsigned long long)w.rows, (unsigned long long)w.cols,
                (long long)w.ld);
  ck_assert_msg(order == CUBLASLT_ORDER_COL && batch == 1, "%s: order %d batch %d", what, order,
                batch);
}

/* The operation: fp32 accumulation and scale, the transposes, the epilogue and its bias or GELU
 * input, read (gelu_in) or written (gelu_pre) (D's type, bf16; leading dimension gelu_ld). */
static void check_op(const dt_lt_gemm_t *lt, int ta, int tb, const void *bias, int bias16,
                     const void *gelu_in, const void *gelu_pre, int64_t gelu_ld)
{
  int32_t compute = -1, scale = -1, opa = -1, opb = -1;
  uint32_t epilogue = 0;
  const void *ptr = (const void *)1;
  op_get(lt->op, CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, &compute, sizeof compute);
  op_get(lt->op, CUBLASLT_MATMUL_DESC_SCALE_TYPE, &scale, sizeof scale);
  op_get(lt->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
  op_get(lt->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
  op_get(lt->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue);
  op_get(lt->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof ptr);
  ck_assert_int_eq(compute, CUBLAS_COMPUTE_32F); /* not _FAST_TF32: fp32 products stay fp32 */
  ck_assert_int_eq(scale, CUDA_R_32F);
  ck_assert_int_eq(opa, ta ? CUBLAS_OP_T : CUBLAS_OP_N);
  ck_assert_int_eq(opb, tb ? CUBLAS_OP_T : CUBLAS_OP_N);
  ck_assert_int_eq(epilogue,
                   gelu_pre  ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                   : bias    ? CUBLASLT_EPILOGUE_BIAS
                   : gelu_in ? CUBLASLT_EPILOGUE_DGELU
                             : CUBLASLT_EPILOGUE_DEFAULT);
  ck_assert_ptr_eq(ptr, bias);
  if (bias) {
    int32_t btype = -1;
    op_get(lt->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &btype, sizeof btype);
    ck_assert_int_eq(btype, bias16 ? -1 : CUDA_R_32F); /* bf16: unset, D's type */
  }
  const void *aux = (const void *)1;
  op_get(lt->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
  ck_assert_ptr_eq(aux, gelu_pre ? gelu_pre : gelu_in);
  if (aux) {
    int64_t ld = 0;
    int32_t type = 0;
    op_get(lt->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld);
    op_get(lt->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &type, sizeof type);
    ck_assert_int_eq(ld, gelu_ld);
    ck_assert_int_eq(type, -1); /* unset: D's type (cublasLt.h advises not to set it) */
  }
}

static void check_pref(const dt_lt_gemm_t *lt, size_t ws, const uint32_t align[4])
{
  static const cublasLtMatmulPreferenceAttributes_t attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  uint64_t bytes = 0;
  size_t got = 0;
  ck_assert_int_eq(cublasLtMatmulPreferenceGetAttribute(lt->pref,
                                                        CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        &bytes, sizeof bytes, &got),
                   CUBLAS_STATUS_SUCCESS);
  ck_assert_uint_eq(bytes, ws);
  for (int i = 0; i < 4; i++) {
    uint32_t a = 0;
    ck_assert_int_eq(cublasLtMatmulPreferenceGetAttribute(lt->pref, attr[i], &a, sizeof a, &got),
                     CUBLAS_STATUS_SUCCESS);
    ck_assert_uint_eq(a, align[i]);
  }
}

/* Fake device addresses: only their alignment matters (nothing is dereferenced). */
static const void *at(uintptr_t base, size_t elems, size_t elem_bytes)
{
  return (const void *)(base + elems * elem_bytes);
}

/* The linear layer's three products for (N, C, OC) with output / dout row stride ld, operands
 * of type ab (elem bytes each) at the given element offsets from 256-aligned bases. */
static void check_linear(int N, int C, int OC, int ld, cudaDataType_t ab, size_t eb, size_t off)
{
  const size_t ws = (size_t)32 << 20;
  const void *inp = at(0x10000, off, eb), *w = at(0x20000, off, eb), *dout = at(0x30000, off, eb);
  void *out = (void *)at(0x40000, off, 4), *dinp = (void *)at(0x50000, off, 4),
       *dw = (void *)at(0x60000, off, 4);
  const float *bias = (const float *)at(0x70000, off, 4);
  const want_t weight = {ab, (uint64_t)C, (uint64_t)OC, C},
               input = {ab, (uint64_t)C, (uint64_t)N, C},
               grad = {ab, (uint64_t)OC, (uint64_t)N, ld};
  const uint32_t in_al = dt_lt_alignment(inp), w_al = dt_lt_alignment(w),
                 d_al = dt_lt_alignment(dout), o_al = dt_lt_alignment(out);
  dt_lt_gemm_t lt;

  for (int with_bias = 0; with_bias < 2; with_bias++) {
    const dt_gemm_t g = gemm_linear_forward(out, inp, w, with_bias ? bias : NULL, N, C, OC, ld);
    ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, ab, ws), 0);
    check_op(&lt, 1, 0, with_bias ? bias : NULL, 0, NULL, NULL, 0);
    check_layout(lt.A, weight, "forward A (weight)");
    check_layout(lt.B, input, "forward B (inp)");
    check_layout(lt.C, (want_t){CUDA_R_32F, (uint64_t)OC, (uint64_t)N, ld}, "forward C (out)");
    check_pref(&lt, ws, (const uint32_t[4]){w_al, in_al, o_al, o_al});
    dt_lt_gemm_release(&lt);
    ck_assert_ptr_null(lt.op);
  }

  /* bf16: the forward adding a residual (Cin, beta 1): C's alignment is the residual's, where
   * it is read, D's the output's */
  if (ab == CUDA_R_16BF) {
    const float *res = (const float *)at(0x90000, off + 1, 4);
    dt_gemm_t g = gemm_linear_forward(out, inp, w, bias, N, C, OC, ld);
    g.Cin = res, g.beta = 1.0f;
    ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, ab, ws), 0);
    check_layout(lt.C, (want_t){CUDA_R_32F, (uint64_t)OC, (uint64_t)N, ld}, "forward C (res)");
    ck_assert_uint_ne(dt_lt_alignment(res), o_al);
    check_pref(&lt, ws, (const uint32_t[4]){w_al, in_al, dt_lt_alignment(res), o_al});
    dt_lt_gemm_release(&lt);
  }

  /* bf16: the forward into a bf16 output (the qkv layer's): C bf16 and its bias bf16 (D's type,
   * which cuBLASLt requires); an fp32 bias there, or a bf16 one with an fp32 C, has no algorithm
   * (refused before the heuristic is asked) */
  if (ab == CUDA_R_16BF) {
    dt_gemm_t g = gemm_linear_forward(out, inp, w, bias, N, C, OC, ld);
    g.c16 = 1;
    ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, ab, ws), DT_ENOTSUP);
    ck_assert_ptr_null(lt.op);
    g.c16 = 0, g.bias16 = 1;
    ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, ab, ws), DT_ENOTSUP);
    g.c16 = 1;
    ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, ab, ws), 0);
    check_op(&lt, 1, 0, bias, 1, NULL, NULL, 0);
    check_layout(lt.C, (want_t){CUDA_R_16BF, (uint64_t)OC, (uint64_t)N, ld}, "forward C (bf16)");
    dt_lt_gemm_release(&lt);
    /* through the GELU (the fc layer's): D the GELU, its input written to gelu_pre (laid out
     * like D, bf16 like it), with the bias (GELU_AUX_BIAS) or without (GELU_AUX); a leading
     * dimension not a multiple of 8 is not cuBLASLt's */
    void *pre = (void *)at(0xa0000, off, 4);
    g.gelu_pre = pre;
    for (int with_bias = 0; with_bias < 2; with_bias++) {
      g.bias = with_bias ? bias : NULL;
      g.bias16 = with_bias;
      const int rc = dt_lt_gemm_build(&lt, &g, ab, ws);
      ck_assert_int_eq(rc, ld % 8 ? DT_ENOTSUP : 0);
      if (rc)
        continue;
      check_op(&lt, 1, 0, g.bias, with_bias, NULL, pre, ld);
      check_layout(lt.C, (want_t){CUDA_R_16BF, (uint64_t)OC, (uint64_t)N, ld}, "forward C (GELU)");
      dt_lt_gemm_release(&lt);
    }
  }

  /* dinp, and (bf16, C a multiple of 8) through a GELU into bf16: the GELU input (N, C) laid
   * out like dinp, bf16 like it */
  const void *gelu_in = at(0x80000, off, 4);
  for (int through_gelu = 0; through_gelu < (ab == CUDA_R_16BF && C % 8 == 0 ? 2 : 1);
       through_gelu++) {
    dt_gemm_t g = gemm_linear_dinp(dinp, dout, w, N, C, OC, ld);
    g.gelu_in = through_gelu ? gelu_in : NULL;
    g.c16 = through_gelu;
    ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, ab, ws), 0);
    check_op(&lt, 0, 0, NULL, 0, g.gelu_in, NULL, C);
    check_layout(lt.A, weight, "dinp A (weight)");
    check_layout(lt.B, grad, "dinp B (dout)");
    check_layout(lt.C,
                 (want_t){through_gelu ? CUDA_R_16BF : CUDA_R_32F, (uint64_t)C, (uint64_t)N, C},
                 "dinp C (dinp)");
    check_pref(&lt, ws,
               (const uint32_t[4]){w_al, d_al, dt_lt_alignment(dinp), dt_lt_alignment(dinp)});
    dt_lt_gemm_release(&lt);
  }

  dt_gemm_t g = gemm_linear_dweight(dw, dout, inp, N, C, OC, ld);
  ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, ab, ws), 0);
  check_op(&lt, 0, 1, NULL, 0, NULL, NULL, 0);
  check_layout(lt.A, input, "dweight A (inp)");
  check_layout(lt.B, grad, "dweight B (dout)");
  check_layout(lt.C, (want_t){CUDA_R_32F, (uint64_t)C, (uint64_t)OC, C}, "dweight C (dweight)");
  check_pref(&lt, ws, (const uint32_t[4]){in_al, d_al, dt_lt_alignment(dw), dt_lt_alignment(dw)});
  dt_lt_gemm_release(&lt);
}

START_TEST(test_linear_fp32)
{
  check_linear(5, 7, 6, 9, CUDA_R_32F, 4, 0);          /* odd sizes, padded output rows */
  check_linear(64, 768, 2304, 2304, CUDA_R_32F, 4, 3); /* GPT-2's qkv, operands 4-byte aligned */
}
END_TEST

START_TEST(test_linear_bf16)
{
  /* the bf16 copies are contiguous (dout's too: ld = OC) */
  check_linear(5, 7, 6, 6, CUDA_R_16BF, 2, 1);
  check_linear(64, 768, 3072, 3072, CUDA_R_16BF, 2, 0);
  check_linear(64, 3072, 768, 768, CUDA_R_16BF, 2, 0); /* the MLP projection, dinp through GELU */
}
END_TEST

START_TEST(test_alignment_and_refusals)
{
  ck_assert_uint_eq(dt_lt_alignment((const void *)0x1000), 256);
  ck_assert_uint_eq(dt_lt_alignment((const void *)0x1010), 16);
  ck_assert_uint_eq(dt_lt_alignment((const void *)0x1004), 4);
  ck_assert_uint_eq(dt_lt_alignment((const void *)0x1002), 2);
  /* a batched descriptor is cublasSgemmStridedBatched's, not cuBLASLt's */
  dt_gemm_t g =
      gemm_linear_dinp((void *)0x1000, (const void *)0x2000, (const void *)0x3000, 4, 8, 8, 8);
  g.batch = 2;
  dt_lt_gemm_t lt;
  ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, CUDA_R_32F, 1 << 20), DT_EINVAL);
  ck_assert_ptr_null(lt.op);
  /* a leading dimension shorter than the stored rows (A is weight^T: C = 8 rows) */
  g = gemm_linear_dinp((void *)0x1000, (const void *)0x2000, (const void *)0x3000, 4, 8, 8, 8);
  g.A.ld = 4;
  ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, CUDA_R_32F, 1 << 20), DT_EINVAL);
  ck_assert_ptr_null(lt.op);
  /* a GELU input whose leading dimension is not a multiple of 8: not cuBLASLt's (the caller
   * falls back), and both epilogues at once: no such product */
  g = gemm_linear_dinp((void *)0x1000, (const void *)0x2000, (const void *)0x3000, 4, 12, 8, 8);
  g.gelu_in = (const void *)0x4000;
  g.c16 = 1;
  ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, CUDA_R_16BF, 1 << 20), DT_ENOTSUP);
  ck_assert_ptr_null(lt.op);
  g.bias = (const float *)0x5000;
  ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, CUDA_R_16BF, 1 << 20), DT_EINVAL);
  ck_assert_ptr_null(lt.op);
  /* the GELU gradient only into a bf16 C (its input is bf16); a bf16 C is only written, not
   * read (beta != 0) */
  g = gemm_linear_dinp((void *)0x1000, (const void *)0x2000, (const void *)0x3000, 4, 16, 8, 8);
  g.gelu_in = (const void *)0x4000;
  ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, CUDA_R_16BF, 1 << 20), DT_EINVAL);
  ck_assert_ptr_null(lt.op);
  g.gelu_in = NULL;
  g.c16 = 1;
  g.beta = 1.0f;
  ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, CUDA_R_16BF, 1 << 20), DT_EINVAL);
  ck_assert_ptr_null(lt.op);
  /* the GELU only into a bf16 C, and never beside its gradient */
  g = gemm_linear_forward((void *)0x1000, (const void *)0x2000, (const void *)0x3000, NULL, 4, 16,
                          8, 8);
  g.gelu_pre = (void *)0x4000;
  ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, CUDA_R_16BF, 1 << 20), DT_EINVAL);
  ck_assert_ptr_null(lt.op);
  g.c16 = 1;
  g.gelu_in = (const void *)0x5000;
  ck_assert_int_eq(dt_lt_gemm_build(&lt, &g, CUDA_R_16BF, 1 << 20), DT_EINVAL);
  ck_assert_ptr_null(lt.op);
}
END_TEST

int main(void)
{
  Suite *s = suite_create("cuda_lt");
  TCase *tc = tcase_create("descriptors");
  tcase_add_test(tc, test_linear_fp32);
  tcase_add_test(tc, test_linear_bf16);
  tcase_add_test(tc, test_alignment_and_refusals);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
