/* matmul.cu — the linear layer on the GPU, forward and backward (reference:
 * kernels/cpu/matmul.c). PyTorch's nn.Linear convention: weight is (OC, C) and
 * out = inp @ weight^T + bias. The GEMMs' column-major views are gemm.cuh's (built there, run
 * here): the layer's products by cuBLASLt (linear_gemm), the forward's bias added by its BIAS
 * epilogue as the product is stored (no pass of its own over the output), the bf16 fc layer's
 * GELU by its GELU_AUX_BIAS epilogue (the activation and the GELU's input, both bf16, in one
 * pass), the bf16 dinp's GELU backward by its DGELU epilogue (into bf16); the bias gradient, a
 * column sum, by cublasSgemv (dt__cuda_gemm, which attention.cu uses too), or under bf16 compute
 * in the pass that copies the output gradient to bf16 (to_bf16_colsum_kernel), which also sums
 * a gradient that exists in bf16 only.
 *
 * Invariants: plain fp32 accumulation (CUBLAS_COMPUTE_32F, CUBLAS_DEFAULT_MATH: no TF32);
 * beta = 0 never reads the output (so it may hold garbage); only the first OC columns of an
 * (N, ldo) output are written; cuBLAS's and cuBLASLt's results are deterministic on one
 * stream, GPU and set of buffer addresses (cuBLASLt's choice of algorithm depends on the
 * pointers' alignment and the GPU). dweight and dbias accumulate (beta = 1). */
#include <cuda_bf16.h>
#include <string.h>

#include "cuda_impl.h"
#include "dt_util.h" /* DT_MIN, DT_MAX */
#include "gelu.cuh"
#include "gemm_lt.h"
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

/* A product's kind (DT__CUDA_LT_KEY values): what cuBLASLt's heuristic sees (the shape, the
 * layouts, the types, the epilogue and, where align is given (lt.align: A, B, C, D), the
 * alignment of each pointer, the bias's and the GELU input's too) and whether C is read. */
static void gemm_kind(const dt_gemm_t *g, cudaDataType_t ab, const uint32_t *align4,
                      long long key[DT__CUDA_LT_KEY])
{
  const long long flags = g->ta | g->tb << 1 | (ab == CUDA_R_16BF) << 2 | (g->bias != NULL) << 3 |
                          g->bias16 << 4 | g->c16 << 5 | (g->gelu_in != NULL) << 6 |
                          (g->Cin != NULL) << 7 | (g->gelu_pre != NULL) << 8 |
                          (g->beta != 0.0f) << 9;
  const void *aux = g->gelu_pre ? (const void *)g->gelu_pre : g->gelu_in;
  long long aligns = 0; /* each a power of two up to 256, or 0: 9 bits apiece */
  if (align4) {
    const uint32_t align[6] = {align4[0],
                               align4[1],
                               align4[2],
                               align4[3],
                               g->bias ? dt_lt_alignment(g->bias) : 0U,
                               aux ? dt_lt_alignment(aux) : 0U};
    for (int i = 0; i < 6; i++)
      aligns = aligns << 9 | align[i];
  }
  const long long k[DT__CUDA_LT_KEY] = {g->m, g->n, g->k, g->A.ld, g->B.ld, g->ldc, flags, aligns};
  memcpy(key, k, sizeof k);
}

static const char *gemm_epilogue_name(const dt_gemm_t *g)
{
  return g->gelu_pre  ? ", GELU epilogue"
         : g->bias    ? (g->Cin      ? ", bias epilogue and a residual C"
                         : g->bias16 ? ", bf16 bias epilogue"
                                     : ", bias epilogue")
         : g->gelu_in ? ", GELU-gradient epilogue"
         : g->Cin     ? ", a residual C"
                      : "";
}

/* Does [p, p + pn) overlap [q, q + qn)? */
static bool overlaps(const void *p, size_t pn, const void *q, size_t qn)
{
  const char *a = (const char *)p, *b = (const char *)q;
  return a && b && pn && qn && a < b + qn && b < a + pn;
}

/* The bytes a column-major rows x cols matrix of esize-byte elements with leading dimension ld
 * spans. */
static size_t mat_bytes(size_t rows, size_t cols, size_t ld, size_t esize)
{
  return cols ? ((cols - 1) * ld + rows) * esize : 0;
}

/* Of cuBLASLt's n candidates for g (res[0] the heuristic's first), the one that ran fastest:
 * each runs once, then LT_TUNE_REPS times between two events, its best run kept; another
 * replaces the first only where at least LT_TUNE_MARGIN faster, so that near-ties keep the
 * heuristic's choice. The runs write D where the product only writes it (beta 0, or C read from
 * a Cin) and D overlaps no input; else (an accumulation in place: dweight) a scratch matrix of
 * D's extent, allocated on the stream for the timing and freed there after it, so that every
 * output holds what it held before once the product itself runs. A product whose GELU input it
 * writes overlaps an input, or whose scratch cannot be allocated, keeps the heuristic's first
 * (*best 0). A candidate that fails is skipped. 0, or DT_ECUDA. */
#define LT_TUNE_REPS   3
#define LT_TUNE_MARGIN 0.02f
static int lt_tune(dt_cuda_impl_t *cu, const dt_gemm_t *g, cudaDataType_t ab,
                   const dt_lt_gemm_t *lt, const cublasLtMatmulHeuristicResult_t *res, int n,
                   int *best)
{
  *best = 0;
  const size_t eab = ab == CUDA_R_16BF ? 2 : 4, ec = g->c16 ? 2 : 4;
  const size_t d_bytes = mat_bytes((size_t)g->m, (size_t)g->n, (size_t)g->ldc, ec);
  struct {
    const void *p;
    size_t bytes;
  } in[] = {
      {g->A.p, mat_bytes((size_t)(g->ta ? g->k : g->m), (size_t)(g->ta ? g->m : g->k),
                         (size_t)g->A.ld, eab)},
      {g->B.p, mat_bytes((size_t)(g->tb ? g->n : g->k), (size_t)(g->tb ? g->k : g->n),
                         (size_t)g->B.ld, eab)},
      {g->bias, g->bias ? (size_t)g->m * (g->bias16 ? 2 : 4) : 0},
      {g->gelu_in, mat_bytes((size_t)g->m, (size_t)g->n, (size_t)g->ldc, 2)},
      {g->Cin, mat_bytes((size_t)g->m, (size_t)g->n, (size_t)g->ldc, 4)},
  };
  bool scratch = g->beta != 0.0f && !g->Cin;
  for (size_t i = 0; i < DT_ARRAY_SIZE(in); i++) {
    if (overlaps(g->gelu_pre, d_bytes, in[i].p, in[i].bytes)) {
      DT_DEBUG(KERNEL, "%s: GEMM m=%d n=%d k=%d: its GELU input overlaps an operand: not tuned",
               cu->name, g->m, g->n, g->k);
      cu->lt_untuned++;
      return 0;
    }
    scratch = scratch || overlaps(g->C, d_bytes, in[i].p, in[i].bytes);
  }
  void *tmp = NULL;
  if (scratch) { /* stream-ordered: cudaFree would synchronize the device (and so wait on other
                  * streams' collectives, whose peers may be tuning too) */
    const cudaError_t e = cudaMallocAsync(&tmp, d_bytes, cu->stream);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      DT_DEBUG(KERNEL, "%s: GEMM m=%d n=%d k=%d: no %zu bytes for the timing's output: not tuned",
               cu->name, g->m, g->n, g->k, d_bytes);
      cu->lt_untuned++;
      return 0;
    }
  }
  void *D = tmp ? tmp : g->C;
  const void *C = g->Cin ? (const void *)g->Cin : D;
  cudaEvent_t ev[2] = {NULL, NULL};
  float ms[8];
  int rc = 0;
  if (tmp)
    DT_CUDA_CHECK_GOTO(cudaMemsetAsync(tmp, 0, d_bytes, cu->stream), rc, out);
  for (int e = 0; e < 2; e++)
    DT_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&ev[e], cudaEventDefault), rc, out);
  for (int i = 0; i < n && i < (int)DT_ARRAY_SIZE(ms); i++) {
    ms[i] = -1.0f; /* failed */
    if (res[i].state != CUBLAS_STATUS_SUCCESS)
      continue;
    for (int r = -1; r < LT_TUNE_REPS; r++) { /* r -1: the untimed first run */
      DT_CUDA_CHECK_GOTO(cudaEventRecord(ev[0], cu->stream), rc, out);
      const cublasStatus_t s =
          cublasLtMatmul(cu->lt, lt->op, &g->alpha, g->A.p, lt->A, g->B.p, lt->B, &g->beta, C,
                         lt->C, D, lt->C, &res[i].algo, cu->lt_ws, cu->lt_ws_bytes, cu->stream);
      if (s != CUBLAS_STATUS_SUCCESS) {
        DT_DEBUG(KERNEL, "%s: GEMM m=%d n=%d k=%d: candidate %d failed: %s", cu->name, g->m, g->n,
                 g->k, i, cublasGetStatusString(s));
        ms[i] = -1.0f;
        break;
      }
      DT_CUDA_CHECK_GOTO(cudaEventRecord(ev[1], cu->stream), rc, out);
      DT_CUDA_CHECK_GOTO(cudaEventSynchronize(ev[1]), rc, out);
      float t = 0.0f;
      DT_CUDA_CHECK_GOTO(cudaEventElapsedTime(&t, ev[0], ev[1]), rc, out);
      if (r >= 0 && (ms[i] < 0.0f || t < ms[i]))
        ms[i] = t;
    }
    if (ms[i] >= 0.0f) {
      cu->lt_timed++;
      if (ms[*best] < 0.0f || ms[i] < ms[*best] * (1.0f - LT_TUNE_MARGIN))
        *best = i;
    }
  }
  if (ms[*best] >= 0.0f) {
    cu->lt_tuned++;
    const double gflop = 2e-9 * g->m * g->n * g->k;
    DT_INFO(KERNEL,
            "%s: GEMM m=%d n=%d k=%d (%s, op %c%c%s%s): cuBLASLt's candidate %d of %d (by "
            "timing): %.3f ms, %.0f TFLOP/s; its first: %.3f ms",
            cu->name, g->m, g->n, g->k, ab == CUDA_R_16BF ? "bf16" : "fp32", g->ta ? 'T' : 'N',
            g->tb ? 'T' : 'N', gemm_epilogue_name(g), g->c16 ? ", bf16 output" : "", *best + 1, n,
            (double)ms[*best], gflop / ms[*best], (double)ms[0]);
  } else {
    *best = 0;
    cu->lt_untuned++;
  }
out:
  for (int e = 0; e < 2; e++)
    if (ev[e])
      (void)cudaEventDestroy(ev[e]);
  if (tmp) { /* after the timing's runs on the stream */
    const cudaError_t e = cudaFreeAsync(tmp, cu->stream);
    if (e != cudaSuccess && rc == 0)
      DT_CUDA_CHECK(e);
  }
  return rc;
}

/* The algorithm of g's kind: remembered, or the heuristic's first (under lt_tune the fastest of
 * its candidates), then remembered while there is room. DT_ENOTSUP where there is none. */
static int lt_algo(dt_cuda_impl_t *cu, const dt_gemm_t *g, cudaDataType_t ab,
                   const dt_lt_gemm_t *lt, cublasLtMatmulAlgo_t *algo)
{
  long long key[DT__CUDA_LT_KEY];
  gemm_kind(g, ab, lt->align, key);
  for (int i = 0; i < cu->lt_nkinds; i++)
    if (memcmp(cu->lt_kinds[i].key, key, sizeof key) == 0) {
      *algo = cu->lt_kinds[i].algo;
      return 0;
    }
  cublasLtMatmulHeuristicResult_t res[8];
  int found = 0, best = 0;
  const cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(cu->lt, lt->op, lt->A, lt->B, lt->C, lt->C, lt->pref,
                                     cu->lt_tune ? (int)DT_ARRAY_SIZE(res) : 1, res, &found);
  /* The heuristic says INVALID_VALUE, not NOT_SUPPORTED, for some shapes it has no kernel for
   * (PyTorch's addmm keeps a single-row or -column operand off cuBLASLt for that reason). */
  if (hs == CUBLAS_STATUS_NOT_SUPPORTED || hs == CUBLAS_STATUS_INVALID_VALUE ||
      (hs == CUBLAS_STATUS_SUCCESS && found < 1)) {
    DT_DEBUG(KERNEL, "%s: cuBLASLt: no algorithm (%s)", cu->name, cublasGetStatusString(hs));
    return DT_ENOTSUP;
  }
  DT_CUBLAS_CHECK(hs);
  if (cu->lt_tune && found > 1)
    DT_CHECK(lt_tune(cu, g, ab, lt, res, found, &best));
  *algo = res[best].algo;
  if (cu->lt_nkinds < DT__CUDA_LT_KINDS) {
    dt__cuda_lt_kind_t *k = &cu->lt_kinds[cu->lt_nkinds++];
    memcpy(k->key, key, sizeof key);
    k->algo = *algo;
  }
  return 0;
}

int dt__cuda_gemm_lt(dt_cuda_impl_t *cu, const dt_gemm_t *g, cudaDataType_t ab)
{
  dt_lt_gemm_t lt;
  cublasLtMatmulAlgo_t algo;
  int rc = 0;
  DT_CHECK(dt_lt_gemm_build(&lt, g, ab, cu->lt_ws_bytes));
  DT_CHECK_GOTO(lt_algo(cu, g, ab, &lt, &algo), rc, out);
  DT_CUBLAS_CHECK_GOTO(cublasLtMatmul(cu->lt, lt.op, &g->alpha, g->A.p, lt.A, g->B.p, lt.B,
                                      &g->beta, g->Cin ? (const void *)g->Cin : g->C, lt.C, g->C,
                                      lt.C, &algo, cu->lt_ws, cu->lt_ws_bytes, cu->stream),
                       rc, out);
out:
  dt_lt_gemm_release(&lt);
  return rc;
}

/* Counts a product cuBLASLt had no algorithm for; 1 for the first of its kind (gemm_kind's
 * fields without the alignments, hashed), up to 8 kinds (cu->lt_warned), so that each gets a
 * WARN line once. */
static int first_fallback(dt_cuda_impl_t *cu, const dt_gemm_t *g, cudaDataType_t ab)
{
  long long f[DT__CUDA_LT_KEY];
  gemm_kind(g, ab, NULL, f);
  unsigned long long h = 1469598103934665603ULL; /* FNV-1a over the fields */
  for (size_t i = 0; i < DT_ARRAY_SIZE(f); i++)
    h = (h ^ (unsigned long long)f[i]) * 1099511628211ULL;
  h |= 1; /* never 0, an empty slot */
  cu->lt_fallbacks++;
  for (size_t i = 0; i < DT_ARRAY_SIZE(cu->lt_warned); i++) {
    if (cu->lt_warned[i] == h)
      return 0;
    if (cu->lt_warned[i] == 0) {
      cu->lt_warned[i] = h;
      return 1;
    }
  }
  return 0;
}

/* One product of the linear layer: by cuBLASLt, or by cuBLAS, the same arithmetic (fp32
 * accumulation, the bias added to the fp32 result, a bf16 output rounded from it, through the
 * GELU or its derivative) with a pass that seeds the output with the bias before (gemm_seeded),
 * and a bf16 output made in fp32 in the staging buffer (by cuBLASLt where only the bf16 output
 * had no algorithm) and rounded from there (gelu_aux_to_bf16_kernel and dgelu_to_bf16_kernel
 * apply the GELU and its derivative on the way): with
 * DISTRAIN_CUDA_CUBLASLT=0, or for a product cuBLASLt has no algorithm for, counted in
 * cu->lt_fallbacks and named in a WARN line (first_fallback), so that a run on a new GPU or
 * library still trains (test_cuda fails on any fallback). */
static int linear_gemm(dt_cuda_impl_t *cu, const dt_gemm_t *g, cudaDataType_t ab)
{
  /* A single row or column (a one-token forward) goes to cuBLAS without asking: not a fallback. */
  if (cu->use_lt && g->m > 1 && g->n > 1 && g->k > 1) {
    const int rc = dt__cuda_gemm_lt(cu, g, ab);
    if (rc != DT_ENOTSUP)
      return rc;
    if (first_fallback(cu, g, ab))
      DT_WARN(KERNEL,
              "%s: cuBLASLt has no algorithm for the %s GEMM m=%d n=%d k=%d (op %c%c, ld %d %d "
              "%d%s%s); %s",
              cu->name, ab == CUDA_R_16BF ? "bf16" : "fp32", g->m, g->n, g->k, g->ta ? 'T' : 'N',
              g->tb ? 'T' : 'N', g->A.ld, g->B.ld, g->ldc, gemm_epilogue_name(g),
              g->c16 ? ", bf16 output" : "",
              g->c16 ? "such products are made in fp32, then rounded to bf16 in a pass of their own"
                     : "such products run on cuBLAS, with the epilogue as a pass of its own");
  }
  if (g->c16) { /* C (m x n, ld ldc; contiguous with a GELU gradient) rounded from the fp32
                 * product (through the GELU or its gradient, the GELU's input into gelu_pre),
                 * staged contiguous, in blocks of columns of at most
                 * stage_max bytes (the LM head's whole product would be 3.3 GB at gpt2-124m b16);
                 * op(B)'s and C's columns are the block's (c16 products are batch 1) */
    const size_t col_bytes = (size_t)g->m * sizeof(float), esize = ab == CUDA_R_16BF ? 2 : 4;
    const int cols = (int)DT_MIN((size_t)g->n, DT_MAX((size_t)1, cu->stage_max / col_bytes));
    void *stage = NULL;
    DT_CHECK(dt__cuda_stage(cu, (size_t)cols * col_bytes, &stage));
    for (int j0 = 0; j0 < g->n; j0 += cols) {
      dt_gemm_t f = *g;
      f.n = DT_MIN(cols, g->n - j0);
      f.B.p = (const char *)g->B.p + (size_t)j0 * (g->tb ? 1 : (size_t)g->B.ld) * esize;
      f.c16 = 0;
      f.gelu_in = NULL;
      f.gelu_pre = NULL;
      f.C = stage;
      f.ldc = g->m;
      DT_CHECK(linear_gemm(cu, &f, ab)); /* on cuBLASLt where it has an fp32-output algorithm */
      const size_t total = (size_t)f.n * g->m;
      __nv_bfloat16 *c = (__nv_bfloat16 *)g->C + (size_t)j0 * g->ldc;
      const unsigned grid = dt__cuda_grid(total, DT__CUDA_THREADS);
      if (g->gelu_in)
        dgelu_to_bf16_kernel<<<grid, DT__CUDA_THREADS, 0, cu->stream>>>(
            c, (const __nv_bfloat16 *)g->gelu_in + (size_t)j0 * g->m, (const float *)stage, total);
      else if (g->gelu_pre)
        gelu_aux_to_bf16_kernel<<<grid, DT__CUDA_THREADS, 0, cu->stream>>>(
            c, (__nv_bfloat16 *)g->gelu_pre + (size_t)j0 * g->ldc, (size_t)g->ldc,
            (const float *)stage, (size_t)g->m, (size_t)g->m, total);
      else
        to_bf16_kernel<<<grid, DT__CUDA_THREADS, 0, cu->stream>>>(
            c, (size_t)g->ldc, (const float *)stage, (size_t)g->m, (size_t)g->m, total);
      DT_CUDA_CHECK(cudaGetLastError());
    }
    return 0;
  }
  const dt_gemm_t s = gemm_seeded(*g);
  if (g->bias || g->Cin) {
    const size_t total = (size_t)g->n * g->m; /* rows of the row-major output, OC columns */
    const unsigned grid = dt__cuda_grid(total, DT__CUDA_THREADS);
    if (g->bias16)
      linear_seed_kernel<__nv_bfloat16><<<grid, DT__CUDA_THREADS, 0, cu->stream>>>(
          (float *)g->C, (const __nv_bfloat16 *)g->bias, g->Cin, g->m, g->ldc, total);
    else
      linear_seed_kernel<float><<<grid, DT__CUDA_THREADS, 0, cu->stream>>>(
          (float *)g->C, (const float *)g->bias, g->Cin, g->m, g->ldc, total);
    DT_CUDA_CHECK(cudaGetLastError());
  }
  if (ab == CUDA_R_32F)
    return dt__cuda_gemm(cu, &s);
  DT_CUBLAS_CHECK(cublasGemmEx(cu->blas, gemm_op(s.ta), gemm_op(s.tb), s.m, s.n, s.k, &s.alpha,
                               s.A.p, ab, s.A.ld, s.B.p, ab, s.B.ld, &s.beta, s.C, CUDA_R_32F,
                               s.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return 0;
}

extern "C" long dt_cuda_lt_fallbacks(const dt_device_t *dev)
{
  return ((const dt_cuda_impl_t *)dev->impl)->lt_fallbacks;
}

extern "C" long dt_cuda_lt_tuned(const dt_device_t *dev, long *timed, long *untuned)
{
  const dt_cuda_impl_t *cu = (const dt_cuda_impl_t *)dev->impl;
  if (timed)
    *timed = cu->lt_timed;
  if (untuned)
    *untuned = cu->lt_untuned;
  return cu->lt_tuned;
}

extern "C" size_t dt_cuda_stage_bytes(const dt_device_t *dev)
{
  return ((const dt_cuda_impl_t *)dev->impl)->stage_bytes;
}

extern "C" void dt_cuda_set_stage_max(dt_device_t *dev, size_t bytes)
{
  ((dt_cuda_impl_t *)dev->impl)->stage_max = bytes;
}

int dt__cuda_matmul_forward(struct dt_device *dev, float *out, const float *inp,
                            const float *weight, const float *bias, int N, int C, int OC, int ldo)
{
  if (N <= 0 || OC <= 0)
    return 0;
  const dt_gemm_t g = gemm_linear_forward(out, inp, weight, bias, N, C, OC, ldo);
  return linear_gemm(dt__cuda(dev), &g, CUDA_R_32F);
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
    DT_CHECK(linear_gemm(cu, &g, CUDA_R_32F));
  }
  const dt_gemm_t g = gemm_linear_dweight(dweight, dout, inp, N, C, OC, ldd);
  DT_CHECK(linear_gemm(cu, &g, CUDA_R_32F));
  return dbias ? bias_backward(cu, dbias, dout, N, OC, ldd) : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* bf16 compute (ops.h): operands rounded to bf16 (to nearest even, as the CPU's dt_bf16_round), */
/* products accumulated in fp32 by cuBLASLt on the tensor cores, fp32 outputs.                  */
/* ------------------------------------------------------------------------------------------ */

/* Carves n <= 2 bf16 copies out of one workspace request (each 256-byte aligned) and fills them;
 * an operand with colsum also gets its fp32 column sums added there in the same pass (the bias
 * gradient: to_bf16_colsum_kernel's partial sums, then one per column). */
typedef struct {
  const float *src;
  size_t rows, cols, lds;
  float *colsum;
  __nv_bfloat16 *dst;
} bf16_operand_t;

static size_t ws_round(size_t bytes)
{
  return (bytes + 255) / 256 * 256;
}

/* Rows per block of to_bf16_colsum_kernel: COLSUM_ROWS, or more where the grid's y would pass
 * its limit of 65535 blocks. */
static int colsum_rows_per_block(size_t rows)
{
  const size_t blocks = (rows + COLSUM_ROWS - 1) / COLSUM_ROWS;
  return COLSUM_ROWS * (int)((blocks + 65534) / 65535);
}

/* Bytes of colsum's partial sums for rows x cols (each row block's), 256-byte aligned. */
static size_t colsum_partial_bytes(size_t rows, size_t cols)
{
  const size_t rpb = (size_t)colsum_rows_per_block(rows);
  return ws_round((rows + rpb - 1) / rpb * cols * sizeof(float));
}

/* colsum (cols) += the column sums of src (rows x cols, row stride lds), with partial (in the
 * workspace: colsum_partial_bytes) between the two passes; dst, where not NULL, gets src's bf16
 * copy in the same pass (to_bf16_colsum_kernel). */
template <typename S>
static int colsum(dt_cuda_impl_t *cu, __nv_bfloat16 *dst, float *partial, float *sum, const S *src,
                  size_t rows, size_t cols, size_t lds)
{
  const int rpb = colsum_rows_per_block(rows);
  const dim3 grid((unsigned)((cols + COLSUM_COLS - 1) / COLSUM_COLS),
                  (unsigned)((rows + rpb - 1) / rpb));
  to_bf16_colsum_kernel<S><<<grid, COLSUM_THREADS, 0, cu->stream>>>(dst, partial, src, (int)rows,
                                                                    (int)cols, (int)lds, rpb);
  DT_CUDA_CHECK(cudaGetLastError());
  const dt__csum_t sums = {{sum, NULL}, {partial, NULL}};
  dt__column_sums_kernel<float><<<dim3((unsigned)((cols + DT__CSUM_COLS - 1) / DT__CSUM_COLS)),
                                  DT__CSUM_THREADS, 0, cu->stream>>>(sums, (int)grid.y, (int)cols);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

static int bf16_operands(dt_cuda_impl_t *cu, bf16_operand_t *ops, int n)
{
  size_t bytes = 0, off[2], poff[2];
  for (int i = 0; i < n; i++) {
    off[i] = bytes;
    bytes += ws_round(ops[i].rows * ops[i].cols * sizeof(__nv_bfloat16));
    poff[i] = bytes;
    if (ops[i].colsum)
      bytes += colsum_partial_bytes(ops[i].rows, ops[i].cols);
  }
  void *ws = NULL;
  DT_CHECK(dt__cuda_workspace(cu, bytes, &ws));
  for (int i = 0; i < n; i++) {
    const bf16_operand_t *o = &ops[i];
    const size_t total = o->rows * o->cols;
    ops[i].dst = (__nv_bfloat16 *)((char *)ws + off[i]);
    if (o->colsum) {
      DT_CHECK(colsum(cu, o->dst, (float *)((char *)ws + poff[i]), o->colsum, o->src, o->rows,
                      o->cols, o->lds));
      continue;
    }
    to_bf16_kernel<<<dt__cuda_grid(total, DT__CUDA_THREADS), DT__CUDA_THREADS, 0, cu->stream>>>(
        o->dst, o->cols, o->src, o->lds, o->cols, total);
    DT_CUDA_CHECK(cudaGetLastError());
  }
  return 0;
}

int dt__cuda_to_bf16(struct dt_device *dev, void *dst, const float *src, size_t n)
{
  if (n == 0)
    return 0;
  to_bf16_kernel<<<dt__cuda_grid(n, DT__CUDA_THREADS), DT__CUDA_THREADS, 0,
                   dt__cuda(dev)->stream>>>((__nv_bfloat16 *)dst, n, src, n, n, n);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

/* inp is a bf16 activation (ops.h): the GEMM reads it as it is; the weight (unless the caller
 * holds its bf16 values) and in the backward dout (likewise) get bf16 copies in the workspace.
 * out16: cuBLASLt writes out in bf16 (C and D bf16), the bias's bf16 copy beside the weight's
 * (its epilogue takes a bias of D's type only). res: the GEMM's C input (beta 1), D out. gelu:
 * D is gelu, and out the GELU_AUX_BIAS epilogue's auxiliary output (the GELU's input). */
int dt__cuda_matmul_forward_bf16(struct dt_device *dev, void *out, int out16, const void *inp,
                                 const float *weight, const void *weight16, const float *bias,
                                 const float *res, void *gelu, int N, int C, int OC, int ldo)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  DT_CHECK(dt_bf16_forward_check(out16, res, gelu, OC, ldo));
  if (N <= 0 || OC <= 0)
    return 0;
  bf16_operand_t op[2] = {{weight, (size_t)OC, (size_t)C, (size_t)C, NULL, NULL},
                          {bias, 1, (size_t)OC, (size_t)OC, NULL, NULL}};
  const int copy_w = !weight16, copy_b = out16 && bias;
  if (copy_w || copy_b)
    DT_CHECK(bf16_operands(cu, op + (copy_w ? 0 : 1), copy_w + copy_b));
  /* with the GELU: D gets GELU(x), the epilogue's auxiliary output x */
  dt_gemm_t g = gemm_linear_forward(gelu ? gelu : out, inp, weight16 ? weight16 : op[0].dst, bias,
                                    N, C, OC, ldo);
  g.gelu_pre = gelu ? out : NULL;
  if (copy_b)
    g.bias = op[1].dst, g.bias16 = 1;
  g.c16 = out16 != 0;
  g.Cin = res;
  g.beta = res ? 1.0f : 0.0f;
  return linear_gemm(cu, &g, CUDA_R_16BF);
}

int dt__cuda_matmul_backward_bf16(struct dt_device *dev, void *dinp, int dinp16, float *dweight,
                                  float *dbias, const float *dout, const void *dout16,
                                  const void *inp, const float *weight, const void *weight16,
                                  const void *gelu_in, int N, int C, int OC, int ldd)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  DT_CHECK(dt_bf16_backward_check(dinp16, dbias, dout, dout16, gelu_in, OC, 2 * (long)ldd));
  if (N <= 0 || C <= 0 || OC <= 0)
    return 0;
  /* The bias gradient sums the fp32 gradient (ops.h): as the pass that copies it to bf16 reads
   * it, or, where the caller holds its bf16 values, by a GEMV of its own; where there is no fp32
   * gradient, the bf16 values' column sums. */
  if (dbias && dout16 && dout)
    DT_CHECK(bias_backward(cu, dbias, dout, N, OC, ldd));
  else if (dbias && dout16) { /* the weight's copy below may take these bytes again: the column
                               * sums, queued before it on the stream, have read them by then */
    void *partial = NULL;
    DT_CHECK(dt__cuda_workspace(cu, colsum_partial_bytes((size_t)N, (size_t)OC), &partial));
    DT_CHECK(colsum(cu, (__nv_bfloat16 *)NULL, (float *)partial, dbias,
                    (const __nv_bfloat16 *)dout16, (size_t)N, (size_t)OC, 2 * (size_t)ldd));
  }
  /* dout's bf16 values: the caller's (rows 2 ldd values apart: ops.h's dout16), or a contiguous
   * copy (ld OC) beside the weight's */
  bf16_operand_t op[2] = {{weight, (size_t)OC, (size_t)C, (size_t)C, NULL, NULL},
                          {dout, (size_t)N, (size_t)OC, (size_t)ldd, dbias, NULL}};
  const int copy_w = dinp && !weight16, copies = copy_w + (dout16 ? 0 : 1);
  if (copies)
    DT_CHECK(bf16_operands(cu, op + (copy_w ? 0 : 1), copies));
  const void *g16 = dout16 ? dout16 : op[1].dst;
  const int ld16 = dout16 ? 2 * ldd : OC;
  if (dinp) { /* through the GELU, where gelu_in is given, in the GEMM's epilogue */
    dt_gemm_t g = gemm_linear_dinp(dinp, g16, weight16 ? weight16 : op[0].dst, N, C, OC, ld16);
    g.gelu_in = gelu_in;
    g.c16 = dinp16 != 0;
    DT_CHECK(linear_gemm(cu, &g, CUDA_R_16BF));
  }
  const dt_gemm_t g = gemm_linear_dweight(dweight, g16, inp, N, C, OC, ld16);
  return linear_gemm(cu, &g, CUDA_R_16BF);
}
