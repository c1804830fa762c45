/* gemm.cuh — every GEMM the CUDA backend hands to cuBLAS, as data: the column-major product
 * each layer issues (matmul.cu: the linear layer, run by cuBLASLt with its bias and GELU-gradient
 * epilogues;
 * attention.cu: the materialised attention's per-head products, run by
 * cublasSgemmStridedBatched), built here and run there. Plain host code, so that
 * tests/unit/test_cuda_emul.cc runs the same descriptors through a reference column-major GEMM
 * against the CPU kernels: the views, leading dimensions and batch strides below are where a GPU
 * GEMM goes wrong, and this way they are checked on machines without a GPU.
 *
 * cuBLAS is column-major. A row-major (rows, cols) matrix with row stride ld is, read by cuBLAS,
 * the column-major (cols, rows) matrix with leading dimension ld, i.e. its transpose. So every
 * row-major product Y = A B is issued as the column-major Y^T = B^T A^T, with the operands
 * swapped; each builder spells out the view it uses. Pointers are untyped and dimensions count
 * elements, so the bf16 path issues the same descriptors over its bf16 copies. */
#ifndef DT_KERNELS_CUDA_GEMM_CUH
#define DT_KERNELS_CUDA_GEMM_CUH

#include <stddef.h>

/* An operand: its first element, leading dimension, and the distance to the next product's. */
typedef struct {
  const void *p;
  int ld;
  long long stride;
} dt_gemm_mat_t;

/* C (m x n, ld ldc) = alpha op(A) op(B) + beta C (+ bias), column-major, for each of batch
 * products. bias (m values, or NULL): cuBLASLt's BIAS epilogue, bias[i] added to every
 * element of row i after the product (only the linear layer's forward, batch 1, sets it); fp32,
 * or bf16 where bias16 (with c16 only: cuBLASLt takes a bias of D's type, "Bias vector elements
 * are the same type as the elements of output matrix (Dtype)", so a bf16 C has a bf16 bias).
 * gelu_in (bf16, laid out like C, or NULL): cuBLASLt's DGELU epilogue, each element of the
 * product multiplied by the GELU's derivative at gelu_in's element as it is stored (only the
 * bf16 linear layer's dinp, beta 0, c16, sets it: the backward of a layer whose input was
 * GELU(gelu_in)). gelu_pre (bf16, laid out like C, or NULL): cuBLASLt's GELU_AUX_BIAS
 * epilogue, C getting GELU(x) of each element x of the product (the bias added) and gelu_pre x
 * itself (only the bf16 linear layer's forward into the MLP's activation, beta 0, c16, bias16,
 * sets it). c16: C is bf16, each element the fp32 result (the bias added, the GELU or its
 * derivative applied) rounded to nearest even as it is stored (only the bf16 linear layer's
 * forward with a bf16 output and its bf16 dinp, through the GELU or not, beta 0, set it); else C
 * is fp32.
 * Cin (fp32, laid out like C, or NULL: C itself): where beta C is read from, C then only
 * written (only the bf16 linear layer's forward with a residual, beta 1, sets it). */
typedef struct {
  int ta, tb; /* 1: op is the transpose */
  int m, n, k;
  float alpha, beta;
  dt_gemm_mat_t A, B;
  void *C;
  int ldc;
  long long sC;
  int batch;
  const void *bias;
  const void *gelu_in;
  void *gelu_pre;
  int c16;
  const float *Cin;
  int bias16;
} dt_gemm_t;

static inline dt_gemm_mat_t gemm_mat(const void *p, int ld, long long stride)
{
  dt_gemm_mat_t x = {p, ld, stride};
  return x;
}

static inline dt_gemm_t gemm_make(int ta, int tb, int m, int n, int k, float alpha, dt_gemm_mat_t A,
                                  dt_gemm_mat_t B, float beta, void *C, int ldc, long long sC,
                                  int batch)
{
  dt_gemm_t g = {ta,  tb, m,     n,    k,    alpha, beta, A,    B, C,
                 ldc, sC, batch, NULL, NULL, NULL,  0,    NULL, 0};
  return g;
}

/* ---- The linear layer: weight (OC, C), out = inp @ weight^T + bias ------------------------- */

/* out^T (OC x N, ld ldo) = weight (OC x C) @ inp^T (C x N) + bias (OC, one per row of out^T).
 * weight row-major (OC, C) is column-major (C x OC, ld C): op T gives (OC x C).
 * inp row-major (N, C) is column-major (C x N, ld C): op N. */
static inline dt_gemm_t gemm_linear_forward(void *out, const void *inp, const void *weight,
                                            const float *bias, int N, int C, int OC, int ldo)
{
  dt_gemm_t g = gemm_make(1, 0, OC, N, C, 1.0f, gemm_mat(weight, C, 0), gemm_mat(inp, C, 0), 0.0f,
                          out, ldo, 0, 1);
  g.bias = bias;
  return g;
}

/* g without its epilogues, for cuBLAS (which has none): the caller seeds every row i of C with
 * bias[i] first (the first m values of each of the n columns, bf16 where bias16), plus Cin's
 * element (beta 1) where g has one, and the product accumulates onto it (only for a product that
 * does not otherwise read C: beta 0, or 1 with a Cin, as the forward's). A GELU gradient comes with
 * a bf16 C, which linear_gemm makes in fp32 first and then applies it; so does the GELU. */
static inline dt_gemm_t gemm_seeded(dt_gemm_t g)
{
  g.beta = g.bias || g.Cin ? 1.0f : g.beta;
  g.bias = NULL;
  g.bias16 = 0;
  g.gelu_in = NULL;
  g.gelu_pre = NULL;
  g.Cin = NULL;
  return g;
}

/* dinp (N, C) = dout (N, OC) @ weight (OC, C), as dinp^T (C x N, ld C) = weight^T @ dout^T.
 * weight row-major is column-major (C x OC, ld C) = weight^T: op N.
 * dout row-major (N, ldd) is column-major (OC x N, ld ldd) = dout^T: op N. */
static inline dt_gemm_t gemm_linear_dinp(void *dinp, const void *dout, const void *weight, int N,
                                         int C, int OC, int ldd)
{
  return gemm_make(0, 0, C, N, OC, 1.0f, gemm_mat(weight, C, 0), gemm_mat(dout, ldd, 0), 0.0f, dinp,
                   C, 0, 1);
}

/* dweight (OC, C) += dout^T (OC x N) @ inp (N x C), as dweight^T (C x OC, ld C) += inp^T @ dout.
 * inp row-major is column-major (C x N, ld C) = inp^T: op N.
 * dout is column-major (OC x N, ld ldd): op T gives (N x OC). */
static inline dt_gemm_t gemm_linear_dweight(void *dweight, const void *dout, const void *inp, int N,
                                            int C, int OC, int ldd)
{
  return gemm_make(0, 1, C, OC, N, 1.0f, gemm_mat(inp, C, 0), gemm_mat(dout, ldd, 0), 1.0f, dweight,
                   C, 0, 1);
}

/* dbias (OC) += dout^T (OC x N) @ ones (N): dout as column-major (OC x N, ld ldd), op N, times
 * a column of N ones (n = 1: dt__cuda_gemm runs it as a GEMV). */
static inline dt_gemm_t gemm_linear_dbias(void *dbias, const void *dout, const void *ones, int N,
                                          int OC, int ldd)
{
  return gemm_make(0, 0, OC, 1, N, 1.0f, gemm_mat(dout, ldd, 0), gemm_mat(ones, N, 0), 1.0f, dbias,
                   OC, 0, 1);
}

/* ---- Attention, per batch element b, batched over the NH heads ------------------------------
 * Queries at positions [q0, q0 + Tq) of qkv rows (B, Tall, 3C) against the keys [0, Tk),
 * Tk = q0 + Tq. Head h's q, k and v start at columns h*hs, C + h*hs and 2C + h*hs of the packed
 * rows (ld 3C, batch stride hs); out / dout rows are (B, Tq, C), head h at column h*hs; att
 * and dS hold one (Tq, Tk) block per (b, h), in that order. */
typedef struct {
  int B, Tq, q0, Tall, C, NH;
} dt_att_shape_t;

/* Element b's q, k, v, out and att blocks, as offsets in elements. */
typedef struct {
  size_t q, k, v, o, a;
  int hs, Tk, ld3; /* head size, keys, qkv's row stride */
  long long qk;    /* one head's (Tq, Tk) block */
} dt_att_view_t;

static inline dt_att_view_t att_view(dt_att_shape_t s, int b)
{
  const size_t row = (size_t)b * s.Tall * 3 * s.C;
  const long long qk = (long long)s.Tq * (s.q0 + s.Tq);
  dt_att_view_t v = {row + (size_t)s.q0 * 3 * s.C,
                     row + s.C,
                     row + 2 * (size_t)s.C,
                     (size_t)b * s.Tq * s.C,
                     (size_t)b * s.NH * qk,
                     s.C / s.NH,
                     s.q0 + s.Tq,
                     3 * s.C,
                     qk};
  return v;
}

/* scores (Tq x Tk) = scale * Q K^T into att, as scores^T = scale * K Q^T:
 * K as stored is column-major (hs x Tk, ld 3C) = K^T, op T gives K (Tk x hs);
 * Q as stored is Q^T (hs x Tq), op N. */
static inline dt_gemm_t gemm_att_scores(dt_att_shape_t s, int b, float *att, const float *qkv,
                                        float scale)
{
  const dt_att_view_t v = att_view(s, b);
  return gemm_make(1, 0, v.Tk, s.Tq, v.hs, scale, gemm_mat(qkv + v.k, v.ld3, v.hs),
                   gemm_mat(qkv + v.q, v.ld3, v.hs), 0.0f, att + v.a, v.Tk, v.qk, s.NH);
}

/* out (Tq x hs, ld C) = A V, as out^T (hs x Tq) = V^T A^T:
 * V as stored is V^T (hs x Tk, ld 3C), op N; A as stored is A^T (Tk x Tq, ld Tk), op N. */
static inline dt_gemm_t gemm_att_out(dt_att_shape_t s, int b, float *out, const float *att,
                                     const float *qkv)
{
  const dt_att_view_t v = att_view(s, b);
  return gemm_make(0, 0, v.hs, s.Tq, v.Tk, 1.0f, gemm_mat(qkv + v.v, v.ld3, v.hs),
                   gemm_mat(att + v.a, v.Tk, v.qk), 0.0f, out + v.o, s.C, v.hs, s.NH);
}

/* dA (Tq x Tk) = dO V^T into dS, as dA^T = V dO^T:
 * V as stored is V^T (hs x Tk, ld 3C), op T gives V (Tk x hs);
 * dO as stored is dO^T (hs x Tq, ld C), op N. */
static inline dt_gemm_t gemm_att_dA(dt_att_shape_t s, int b, float *dS, const float *dout,
                                    const float *qkv)
{
  const dt_att_view_t v = att_view(s, b);
  return gemm_make(1, 0, v.Tk, s.Tq, v.hs, 1.0f, gemm_mat(qkv + v.v, v.ld3, v.hs),
                   gemm_mat(dout + v.o, s.C, v.hs), 0.0f, dS + v.a, v.Tk, v.qk, s.NH);
}

/* dV (Tk x hs, ld 3C) = A^T dO, as dV^T (hs x Tk) = dO^T A:
 * dO as stored is dO^T (hs x Tq, ld C), op N; A as stored is A^T (ld Tk), op T gives A. */
static inline dt_gemm_t gemm_att_dv(dt_att_shape_t s, int b, float *dqkv, const float *att,
                                    const float *dout, float beta)
{
  const dt_att_view_t v = att_view(s, b);
  return gemm_make(0, 1, v.hs, v.Tk, s.Tq, 1.0f, gemm_mat(dout + v.o, s.C, v.hs),
                   gemm_mat(att + v.a, v.Tk, v.qk), beta, dqkv + v.v, v.ld3, v.hs, s.NH);
}

/* dQ (Tq x hs, ld 3C) = dS K, as dQ^T (hs x Tq) = K^T dS^T:
 * K as stored is K^T (hs x Tk, ld 3C), op N; dS as stored is dS^T (ld Tk), op N. */
static inline dt_gemm_t gemm_att_dq(dt_att_shape_t s, int b, float *dqkv, const float *dS,
                                    const float *qkv, float beta)
{
  const dt_att_view_t v = att_view(s, b);
  return gemm_make(0, 0, v.hs, s.Tq, v.Tk, 1.0f, gemm_mat(qkv + v.k, v.ld3, v.hs),
                   gemm_mat(dS + v.a, v.Tk, v.qk), beta, dqkv + v.q, v.ld3, v.hs, s.NH);
}

/* dK (Tk x hs, ld 3C) = dS^T Q, as dK^T (hs x Tk) = Q^T dS:
 * Q as stored is Q^T (hs x Tq, ld 3C), op N; dS as stored is dS^T (ld Tk), op T gives dS. */
static inline dt_gemm_t gemm_att_dk(dt_att_shape_t s, int b, float *dqkv, const float *dS,
                                    const float *qkv, float beta)
{
  const dt_att_view_t v = att_view(s, b);
  return gemm_make(0, 1, v.hs, v.Tk, s.Tq, 1.0f, gemm_mat(qkv + v.q, v.ld3, v.hs),
                   gemm_mat(dS + v.a, v.Tk, v.qk), beta, dqkv + v.k, v.ld3, v.hs, s.NH);
}

#endif
