/* test_kernels.c — every CPU kernel (kernels/cpu/) against an independent reference.
 *
 * Forward kernels are compared with plain, obviously-correct C re-statements written here in
 * double precision (triple-loop matmul, llm.c-style per-(b,t,h) attention, two-pass LayerNorm,
 * ...). Backward kernels are checked by finite differences: for a fixed random R the scalar
 * L = sum(out * R) is evaluated with those double references, and its central differences
 * (eps 1e-4, in double, so truncation and rounding stay ~1e-9) must match the gradient the
 * kernel returns for dout = R.
 *
 * The tests also pin down the contract of kernels/ops.h: parameter gradients (and LayerNorm's
 * residual-stream dinp) ADD to what is already there, so they start from random non-zero
 * contents; activation gradients are written, so they start from 1e30 garbage that must be
 * gone. Inputs a kernel must not read (padded columns) are NaN or 1e30, so any read shows. The
 * reductions documented as thread-count independent are run with 1, 2 and 3 OpenMP threads and
 * must agree bit for bit. Sizes are small and odd on purpose: T = 70 and 130 straddle the
 * attention row blocks of 64, C and OC = 70, 130, 200 leave remainders in DT_CPU_CBLOCK, N = 1
 * and T = 1 are the degenerate cases. */
#include <check.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "device.h"
#include "dt_error.h"
#include "dt_util.h"
#include "ops.h"
#include "rng.h"

/* ---------------------------------------------------------------------------------------------
 * Tolerances. A check passes when |got - want| <= ATOL + RTOL * |want| for every element.
 * ------------------------------------------------------------------------------------------- */

/* One correctly rounded fp32 operation (residual add, embedding add): the result is the exact
 * sum times (1 + d) with |d| <= 2^-24 = 6e-8, so one ulp of relative slack is enough. */
#define EXACT_RTOL 1.2e-7
#define EXACT_ATOL 0.0
/* Elementwise maths of a few fp32 operations, expf/tanhf possibly from libmvec (<= 4 ulp):
 * ~1e-6 relative; the absolute part covers 1 + tanh(u) cancelling for very negative x in GELU,
 * where the error is ~|x| * 4 ulp(1) ~ 1e-6. */
#define ELEM_RTOL 1e-5
#define ELEM_ATOL 1e-5
/* fp32 reductions over up to a few hundred O(1) terms (GEMMs, LayerNorm statistics, softmax
 * sums) against double: rounding grows like sqrt(n) * 2^-24 of the terms' size, ~1e-6 here.
 * 1e-4 leaves two orders of margin and still catches any wrong term, which costs O(1e-2). */
#define ACC_RTOL 1e-4
#define ACC_ATOL 1e-4
/* fp32 analytic gradient against double central differences. The FD itself is good to ~1e-9
 * (truncation eps^2 f'''/6 with eps = 1e-4, rounding ~1e-16 |L| / eps), so what is left is the
 * kernel's fp32 accumulation, ~1e-6 relative; 1e-4 keeps the margin of the forward checks. */
#define GRAD_RTOL 1e-4
#define GRAD_ATOL 1e-4
#define FD_EPS    1e-4

/* Pre-fill of outputs that the kernel must overwrite (ops.h: "written (=)"). */
#define GARBAGE 1e30f
/* Sentinel in padded output columns that the kernel must leave alone. */
#define SENTINEL -12345.5f

/* Sizes stay small enough that the whole suite takes about a second in Release and a few in a
 * Debug + ASan build; Check's default timeout of 4 s per test is raised for the latter. */
#define TCASE_TIMEOUT_S 120

/* ---------------------------------------------------------------------------------------------
 * Allocation: every buffer of a test goes on one list, freed at the end of the test case (and
 * by the checked teardown when an assertion ends it early).
 * ------------------------------------------------------------------------------------------- */

#define MAX_ALLOCS 64
static void *g_allocs[MAX_ALLOCS];
static int g_nallocs;

static void *talloc(size_t bytes)
{
  ck_assert_int_lt(g_nallocs, MAX_ALLOCS);
  void *p = calloc(bytes ? bytes : 1, 1);
  ck_assert_ptr_nonnull(p);
  g_allocs[g_nallocs++] = p;
  return p;
}

static float *falloc(size_t n)
{
  return talloc(n * sizeof(float));
}

static double *dalloc(size_t n)
{
  return talloc(n * sizeof(double));
}

static void tfree_all(void)
{
  while (g_nallocs > 0)
    free(g_allocs[--g_nallocs]);
}

/* ---------------------------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------------------------- */

static float *rand_normal(dt_rng_t *rng, size_t n, float mean, float std)
{
  float *x = falloc(n);
  dt_rng_normal(rng, x, n, mean, std);
  return x;
}

static float *filled(size_t n, float v)
{
  float *x = falloc(n);
  for (size_t i = 0; i < n; i++)
    x[i] = v;
  return x;
}

static float *fcopy(const float *x, size_t n)
{
  float *y = falloc(n);
  memcpy(y, x, n * sizeof(float));
  return y;
}

static double *to_double(const float *x, size_t n)
{
  double *d = dalloc(n);
  for (size_t i = 0; i < n; i++)
    d[i] = x[i];
  return d;
}

static double dot(const double *a, const double *b, size_t n)
{
  double s = 0.0;
  for (size_t i = 0; i < n; i++)
    s += a[i] * b[i];
  return s;
}

static void add_float(double *x, const float *y, size_t n)
{
  for (size_t i = 0; i < n; i++)
    x[i] += y[i];
}

static void set_threads(int n)
{
  omp_set_dynamic(0);
  omp_set_num_threads(n);
}

/* Fails unless |got - want| <= atol + rtol * |want| everywhere (NaN never passes); names the
 * worst element so that a failure says where to look. */
static void check_close_at(const char *file, int line, const char *what, const float *got,
                           const double *want, size_t n, double rtol, double atol)
{
  size_t nbad = 0, worst = 0;
  double worst_ratio = -1.0;
  for (size_t i = 0; i < n; i++) {
    double err = fabs((double)got[i] - want[i]);
    double tol = atol + rtol * fabs(want[i]);
    if (err <= tol)
      continue;
    double ratio = isnan(err) ? INFINITY : err / tol;
    if (nbad++ == 0 || ratio > worst_ratio) {
      worst = i;
      worst_ratio = ratio;
    }
  }
  ck_assert_msg(nbad == 0,
                "%s:%d %s: %zu of %zu elements out of tolerance (rtol %g, atol %g); worst [%zu] "
                "got %.9g want %.9g",
                file, line, what, nbad, n, rtol, atol, worst, nbad ? got[worst] : 0.0f,
                nbad ? want[worst] : 0.0);
}
#define CHECK_CLOSE(what, got, want, n, rtol, atol)                                                \
  check_close_at(__FILE__, __LINE__, what, got, want, n, rtol, atol)

/* Same, with a per-element scale: |got - want| <= rtol * scale[i]. */
static void check_scaled_at(const char *file, int line, const char *what, const float *got,
                            const double *want, const double *scale, size_t n, double rtol)
{
  size_t nbad = 0, first = 0;
  for (size_t i = 0; i < n; i++) {
    if (fabs((double)got[i] - want[i]) <= rtol * scale[i])
      continue;
    if (nbad++ == 0)
      first = i;
  }
  ck_assert_msg(nbad == 0,
                "%s:%d %s: %zu of %zu elements out of tolerance (rtol %g of scale); first [%zu] "
                "got %.9g want %.9g scale %.3g",
                file, line, what, nbad, n, rtol, first, nbad ? got[first] : 0.0f,
                nbad ? want[first] : 0.0, nbad ? scale[first] : 0.0);
}
#define CHECK_SCALED(what, got, want, scale, n, rtol)                                              \
  check_scaled_at(__FILE__, __LINE__, what, got, want, scale, n, rtol)

/* Every element of x[lo..hi) of each of rows rows (stride ld) must still equal v bitwise. */
static void check_untouched(const char *what, const float *x, int rows, int ld, int lo, int hi,
                            float v)
{
  for (int r = 0; r < rows; r++)
    for (int c = lo; c < hi; c++)
      ck_assert_msg(memcmp(&x[(size_t)r * ld + c], &v, sizeof v) == 0,
                    "%s: [%d, %d] = %.9g, expected untouched %.9g", what, r, c,
                    x[(size_t)r * ld + c], v);
}

/* ---------------------------------------------------------------------------------------------
 * Finite differences
 * ------------------------------------------------------------------------------------------- */

typedef double (*objective_fn)(void *ctx);

/* dL/dx[i] by central differences; f reads x through ctx. */
static double fd_one(objective_fn f, void *ctx, double *x, size_t i)
{
  double x0 = x[i];
  x[i] = x0 + FD_EPS;
  double lp = f(ctx);
  x[i] = x0 - FD_EPS;
  double lm = f(ctx);
  x[i] = x0;
  return (lp - lm) / (2.0 * FD_EPS);
}

static double *fd_gradient(objective_fn f, void *ctx, double *x, size_t n)
{
  double *g = dalloc(n);
  for (size_t i = 0; i < n; i++)
    g[i] = fd_one(f, ctx, x, i);
  return g;
}

/* ---------------------------------------------------------------------------------------------
 * Encoder
 * ------------------------------------------------------------------------------------------- */

static void ref_encoder_forward(double *out, const int *inp, const double *wte, const double *wpe,
                                int B, int T, int C)
{
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int c = 0; c < C; c++)
        out[((size_t)b * T + t) * C + c] =
            wte[(size_t)inp[b * T + t] * C + c] + wpe[(size_t)t * C + c];
}

struct enc_ctx {
  const int *inp;
  const double *wte, *wpe, *R;
  double *out;
  int B, T, C;
};

static double enc_objective(void *p)
{
  struct enc_ctx *e = p;
  ref_encoder_forward(e->out, e->inp, e->wte, e->wpe, e->B, e->T, e->C);
  return dot(e->out, e->R, (size_t)e->B * e->T * e->C);
}

static int *rand_tokens(dt_rng_t *rng, int n, int V)
{
  int *tok = talloc((size_t)n * sizeof(int));
  for (int i = 0; i < n; i++)
    tok[i] = (int)dt_rng_below(rng, (uint64_t)V);
  /* A repeated token in one sequence and across sequences, whatever the draw. */
  tok[n - 1] = tok[0];
  if (n > 2)
    tok[n / 2] = tok[0];
  return tok;
}

static void run_encoder(int B, int T, int C, int V, int Vp, uint64_t seed)
{
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  const int maxT = T + 2; /* wpe rows >= T must get no gradient */
  const size_t nout = (size_t)B * T * C, nwte = (size_t)Vp * C, nwpe = (size_t)maxT * C;
  int *inp = rand_tokens(&rng, B * T, V);
  float *wte = rand_normal(&rng, nwte, 0.0f, 1.0f);
  float *wpe = rand_normal(&rng, nwpe, 0.0f, 1.0f);

  /* forward */
  float *out = filled(nout, GARBAGE);
  dt_cpu_encoder_forward(out, inp, wte, 0, Vp, wpe, B, T, C);
  double *wte_d = to_double(wte, nwte), *wpe_d = to_double(wpe, nwpe), *out_d = dalloc(nout);
  ref_encoder_forward(out_d, inp, wte_d, wpe_d, B, T, C);
  CHECK_CLOSE("encoder out", out, out_d, nout, EXACT_RTOL, EXACT_ATOL);

  /* backward: dwte and dwpe accumulate onto non-zero contents */
  float *R = rand_normal(&rng, nout, 0.0f, 1.0f);
  float *dwte0 = rand_normal(&rng, nwte, 0.0f, 1.0f), *dwte = fcopy(dwte0, nwte);
  float *dwpe0 = rand_normal(&rng, nwpe, 0.0f, 1.0f), *dwpe = fcopy(dwpe0, nwpe);
  dt_cpu_encoder_backward(dwte, 0, Vp, dwpe, R, inp, B, T, C);

  struct enc_ctx ctx = {inp, wte_d, wpe_d, to_double(R, nout), out_d, B, T, C};
  double *g_wte = fd_gradient(enc_objective, &ctx, wte_d, nwte);
  double *g_wpe = fd_gradient(enc_objective, &ctx, wpe_d, nwpe);
  add_float(g_wte, dwte0, nwte);
  add_float(g_wpe, dwpe0, nwpe);
  CHECK_CLOSE("encoder dwte (+=)", dwte, g_wte, nwte, GRAD_RTOL, GRAD_ATOL);
  CHECK_CLOSE("encoder dwpe (+=)", dwpe, g_wpe, nwpe, GRAD_RTOL, GRAD_ATOL);
  /* rows of wpe past T, and of wte for tokens that do not occur, are not touched at all */
  ck_assert_msg(memcmp(dwpe + (size_t)T * C, dwpe0 + (size_t)T * C,
                       (size_t)(maxT - T) * C * sizeof(float)) == 0,
                "encoder dwpe rows >= T modified");
  for (int v = 0; v < Vp; v++) {
    int used = 0;
    for (int i = 0; i < B * T; i++)
      used |= inp[i] == v;
    ck_assert_msg(
        used || memcmp(dwte + (size_t)v * C, dwte0 + (size_t)v * C, (size_t)C * sizeof(float)) == 0,
        "encoder dwte row %d of an unused token modified", v);
  }
  tfree_all();
}

START_TEST(test_encoder)
{
  run_encoder(2, 5, 7, 6, 8, 1);     /* 10 tokens from 6: repeats; padded vocabulary */
  run_encoder(1, 1, 1, 1, 1, 2);     /* degenerate */
  run_encoder(3, 17, 70, 5, 5, 3);   /* many repeats, C past one 64-block */
  run_encoder(2, 33, 20, 50, 64, 4); /* unused wte rows get exactly their old contents */
}
END_TEST

/* Vocabulary-parallel slices: the sum of the slices' outputs (rank 0 adds the positions) is
 * bit-identical to the full lookup, and each slice's backward writes exactly its rows of the
 * full backward. */
static void run_encoder_slices(int B, int T, int C, int V, int Vp, int parts, uint64_t seed)
{
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  const size_t nout = (size_t)B * T * C, nwte = (size_t)Vp * C, nwpe = (size_t)T * C;
  const int rows = Vp / parts;
  int *inp = rand_tokens(&rng, B * T, V);
  float *wte = rand_normal(&rng, nwte, 0.0f, 1.0f), *wpe = rand_normal(&rng, nwpe, 0.0f, 1.0f);
  float *full = filled(nout, GARBAGE), *sum = filled(nout, 0.0f), *part = filled(nout, GARBAGE);
  dt_cpu_encoder_forward(full, inp, wte, 0, Vp, wpe, B, T, C);
  for (int r = 0; r < parts; r++) {
    dt_cpu_encoder_forward(part, inp, wte + (size_t)r * rows * C, r * rows, rows,
                           r == 0 ? wpe : NULL, B, T, C);
    for (size_t i = 0; i < nout; i++)
      sum[i] += part[i];
  }
  ck_assert_msg(memcmp(sum, full, nout * sizeof(float)) == 0,
                "encoder: the sum of %d vocabulary slices differs from the full lookup", parts);

  float *dout = rand_normal(&rng, nout, 0.0f, 1.0f);
  float *dfull = filled(nwte, 0.0f), *dslices = filled(nwte, 0.0f);
  float *dwpe = filled(nwpe, 0.0f);
  dt_cpu_encoder_backward(dfull, 0, Vp, dwpe, dout, inp, B, T, C);
  for (int r = 0; r < parts; r++)
    dt_cpu_encoder_backward(dslices + (size_t)r * rows * C, r * rows, rows, NULL, dout, inp, B, T,
                            C);
  ck_assert_msg(memcmp(dfull, dslices, nwte * sizeof(float)) == 0,
                "encoder backward: %d vocabulary slices differ from the full table", parts);
  tfree_all();
}

START_TEST(test_encoder_vocab_parallel)
{
  run_encoder_slices(2, 9, 12, 30, 32, 2, 11);
  run_encoder_slices(3, 7, 70, 20, 32, 4, 12); /* the last slice holds padding only */
  run_encoder_slices(1, 4, 5, 8, 8, 1, 13);
}
END_TEST

/* ---------------------------------------------------------------------------------------------
 * LayerNorm
 * ------------------------------------------------------------------------------------------- */

static void ref_layernorm_forward(double *out, double *mean, double *rstd, const double *inp,
                                  const double *w, const double *b, int N, int C)
{
  for (int i = 0; i < N; i++) {
    const double *x = inp + (size_t)i * C;
    double m = 0.0;
    for (int c = 0; c < C; c++)
      m += x[c];
    m /= C;
    double v = 0.0;
    for (int c = 0; c < C; c++)
      v += (x[c] - m) * (x[c] - m);
    v /= C;
    double s = 1.0 / sqrt(v + 1e-5);
    for (int c = 0; c < C; c++)
      out[(size_t)i * C + c] = (x[c] - m) * s * w[c] + b[c];
    if (mean)
      mean[i] = m;
    if (rstd)
      rstd[i] = s;
  }
}

struct ln_ctx {
  const double *inp, *w, *b, *R;
  double *out;
  int N, C;
};

static double ln_objective(void *p)
{
  struct ln_ctx *e = p;
  ref_layernorm_forward(e->out, NULL, NULL, e->inp, e->w, e->b, e->N, e->C);
  return dot(e->out, e->R, (size_t)e->N * e->C);
}

static void run_layernorm(int N, int C, uint64_t seed)
{
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  const size_t nx = (size_t)N * C;
  float *inp = rand_normal(&rng, nx, 0.0f, 1.0f);
  for (int i = 0; i < N; i++) /* rows with an offset: the mean must be removed */
    for (int c = 0; c < C; c++)
      inp[(size_t)i * C + c] += (float)(i % 3) * 2.0f;
  float *w = rand_normal(&rng, (size_t)C, 1.0f, 0.5f);
  float *b = rand_normal(&rng, (size_t)C, 0.0f, 0.5f);

  /* forward */
  float *out = filled(nx, GARBAGE), *mean = filled((size_t)N, GARBAGE);
  float *rstd = filled((size_t)N, GARBAGE);
  dt_cpu_layernorm_forward(out, mean, rstd, inp, w, b, N, C);
  double *inp_d = to_double(inp, nx), *w_d = to_double(w, (size_t)C);
  double *b_d = to_double(b, (size_t)C);
  double *out_d = dalloc(nx), *mean_d = dalloc((size_t)N), *rstd_d = dalloc((size_t)N);
  ref_layernorm_forward(out_d, mean_d, rstd_d, inp_d, w_d, b_d, N, C);
  CHECK_CLOSE("layernorm out", out, out_d, nx, ACC_RTOL, ACC_ATOL);
  CHECK_CLOSE("layernorm mean", mean, mean_d, (size_t)N, ACC_RTOL, ACC_ATOL);
  CHECK_CLOSE("layernorm rstd", rstd, rstd_d, (size_t)N, ACC_RTOL, ACC_ATOL);

  /* backward: all three gradients accumulate (dinp is the residual stream) */
  float *R = rand_normal(&rng, nx, 0.0f, 1.0f);
  float *dinp0 = rand_normal(&rng, nx, 0.0f, 1.0f), *dinp = fcopy(dinp0, nx);
  float *dw0 = rand_normal(&rng, (size_t)C, 0.0f, 1.0f), *dw = fcopy(dw0, (size_t)C);
  float *db0 = rand_normal(&rng, (size_t)C, 0.0f, 1.0f), *db = fcopy(db0, (size_t)C);
  dt_cpu_layernorm_backward(dinp, dw, db, R, inp, w, mean, rstd, N, C);

  struct ln_ctx ctx = {inp_d, w_d, b_d, to_double(R, nx), out_d, N, C};
  double *g_inp = fd_gradient(ln_objective, &ctx, inp_d, nx);
  double *g_w = fd_gradient(ln_objective, &ctx, w_d, (size_t)C);
  double *g_b = fd_gradient(ln_objective, &ctx, b_d, (size_t)C);
  add_float(g_inp, dinp0, nx);
  add_float(g_w, dw0, (size_t)C);
  add_float(g_b, db0, (size_t)C);
  CHECK_CLOSE("layernorm dinp (+=)", dinp, g_inp, nx, GRAD_RTOL, GRAD_ATOL);
  CHECK_CLOSE("layernorm dweight (+=)", dw, g_w, (size_t)C, GRAD_RTOL, GRAD_ATOL);
  CHECK_CLOSE("layernorm dbias (+=)", db, g_b, (size_t)C, GRAD_RTOL, GRAD_ATOL);
  tfree_all();
}

START_TEST(test_layernorm)
{
  run_layernorm(1, 5, 11);   /* N = 1 */
  run_layernorm(2, 1, 12);   /* C = 1: zero variance, out = bias */
  run_layernorm(5, 70, 13);  /* one CBLOCK + remainder 6 */
  run_layernorm(7, 130, 14); /* two CBLOCKs + remainder 2 */
  run_layernorm(3, 64, 15);  /* exactly one block */
}
END_TEST

/* ---------------------------------------------------------------------------------------------
 * Matmul
 * ------------------------------------------------------------------------------------------- */

/* out (N, OC) dense = inp (N, C) @ w (OC, C)^T + bias (OC, or NULL) */
static void ref_matmul_forward(double *out, const double *inp, const double *w, const double *bias,
                               int N, int C, int OC)
{
  for (int n = 0; n < N; n++)
    for (int o = 0; o < OC; o++) {
      double acc = bias ? bias[o] : 0.0;
      for (int c = 0; c < C; c++)
        acc += inp[(size_t)n * C + c] * w[(size_t)o * C + c];
      out[(size_t)n * OC + o] = acc;
    }
}

struct mm_ctx {
  const double *inp, *w, *bias, *R;
  double *out;
  int N, C, OC;
};

static double mm_objective(void *p)
{
  struct mm_ctx *e = p;
  ref_matmul_forward(e->out, e->inp, e->w, e->bias, e->N, e->C, e->OC);
  return dot(e->out, e->R, (size_t)e->N * e->OC);
}

/* Copies a dense (N, OC) array into rows of stride ld, padding columns with pad. */
static float *strided(const float *x, int N, int OC, int ld, float pad)
{
  float *y = filled((size_t)N * ld, pad);
  for (int n = 0; n < N; n++)
    memcpy(y + (size_t)n * ld, x + (size_t)n * OC, (size_t)OC * sizeof(float));
  return y;
}

static void run_matmul(int N, int C, int OC, int ld, int with_bias, int with_dinp, uint64_t seed)
{
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  const size_t nx = (size_t)N * C, nw = (size_t)OC * C, ny = (size_t)N * OC;
  float *inp = rand_normal(&rng, nx, 0.0f, 1.0f);
  float *w = rand_normal(&rng, nw, 0.0f, 1.0f);
  float *bias = with_bias ? rand_normal(&rng, (size_t)OC, 0.0f, 1.0f) : NULL;

  /* forward into rows of stride ld: the first OC columns are written, the rest untouched */
  float *out = filled((size_t)N * ld, SENTINEL);
  for (int n = 0; n < N; n++)
    for (int o = 0; o < OC; o++)
      out[(size_t)n * ld + o] = GARBAGE;
  dt_cpu_matmul_forward(out, inp, w, bias, N, C, OC, ld);
  double *inp_d = to_double(inp, nx), *w_d = to_double(w, nw);
  double *bias_d = with_bias ? to_double(bias, (size_t)OC) : NULL;
  double *out_d = dalloc(ny);
  ref_matmul_forward(out_d, inp_d, w_d, bias_d, N, C, OC);
  float *out_dense = falloc(ny);
  for (int n = 0; n < N; n++)
    memcpy(out_dense + (size_t)n * OC, out + (size_t)n * ld, (size_t)OC * sizeof(float));
  CHECK_CLOSE("matmul out", out_dense, out_d, ny, ACC_RTOL, ACC_ATOL);
  check_untouched("matmul out padding", out, N, ld, OC, ld, SENTINEL);

  /* backward: dout rows of stride ld with NaN padding that must not be read; dinp written over
   * garbage; dweight and dbias accumulate */
  float *R = rand_normal(&rng, ny, 0.0f, 1.0f);
  float *dout = strided(R, N, OC, ld, NAN);
  float *dinp = with_dinp ? filled(nx, GARBAGE) : NULL;
  float *dw0 = rand_normal(&rng, nw, 0.0f, 1.0f), *dw = fcopy(dw0, nw);
  float *db0 = with_bias ? rand_normal(&rng, (size_t)OC, 0.0f, 1.0f) : NULL;
  float *db = with_bias ? fcopy(db0, (size_t)OC) : NULL;
  dt_cpu_matmul_backward(dinp, dw, db, dout, inp, w, N, C, OC, ld);

  struct mm_ctx ctx = {inp_d, w_d, bias_d, to_double(R, ny), out_d, N, C, OC};
  double *g_w = fd_gradient(mm_objective, &ctx, w_d, nw);
  add_float(g_w, dw0, nw);
  CHECK_CLOSE("matmul dweight (+=)", dw, g_w, nw, GRAD_RTOL, GRAD_ATOL);
  if (with_dinp) {
    double *g_inp = fd_gradient(mm_objective, &ctx, inp_d, nx);
    CHECK_CLOSE("matmul dinp (=)", dinp, g_inp, nx, GRAD_RTOL, GRAD_ATOL);
  }
  if (with_bias) {
    double *g_b = fd_gradient(mm_objective, &ctx, bias_d, (size_t)OC);
    add_float(g_b, db0, (size_t)OC);
    CHECK_CLOSE("matmul dbias (+=)", db, g_b, (size_t)OC, GRAD_RTOL, GRAD_ATOL);
  }
  tfree_all();
}

START_TEST(test_matmul)
{
  /* N, C, OC, ld (ldo = ldd), bias?, dinp?, seed */
  run_matmul(5, 9, 70, 70, 1, 1, 21);   /* dbias: one CBLOCK + remainder */
  run_matmul(4, 7, 11, 16, 1, 1, 22);   /* ldo/ldd > OC */
  run_matmul(1, 13, 5, 5, 0, 1, 23);    /* N = 1, bias NULL */
  run_matmul(6, 10, 67, 72, 1, 0, 24);  /* dinp NULL, strided */
  run_matmul(3, 5, 4, 9, 0, 0, 25);     /* neither, strided */
  run_matmul(1, 1, 1, 1, 1, 1, 26);     /* degenerate */
  run_matmul(9, 6, 130, 131, 1, 1, 27); /* two CBLOCKs + remainder 2, strided */
}
END_TEST

/* Larger forward shapes, where the GEMM takes its blocked paths (no finite differences). */
START_TEST(test_matmul_forward_large)
{
  static const int shapes[][5] = {
      /* N, C, OC, ldo, bias */
      {33, 67, 130, 135, 1},
      {64, 64, 64, 64, 1},
      {8, 160, 24, 31, 0},
      {70, 96, 288, 288, 1},
  };
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    const int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2], ldo = shapes[s][3];
    dt_rng_t rng;
    dt_rng_seed(&rng, 30 + s);
    float *inp = rand_normal(&rng, (size_t)N * C, 0.0f, 1.0f);
    float *w = rand_normal(&rng, (size_t)OC * C, 0.0f, 0.1f);
    float *bias = shapes[s][4] ? rand_normal(&rng, (size_t)OC, 0.0f, 1.0f) : NULL;
    float *out = filled((size_t)N * ldo, SENTINEL);
    for (int n = 0; n < N; n++)
      for (int o = 0; o < OC; o++)
        out[(size_t)n * ldo + o] = GARBAGE;
    dt_cpu_matmul_forward(out, inp, w, bias, N, C, OC, ldo);
    double *out_d = dalloc((size_t)N * OC);
    ref_matmul_forward(out_d, to_double(inp, (size_t)N * C), to_double(w, (size_t)OC * C),
                       bias ? to_double(bias, (size_t)OC) : NULL, N, C, OC);
    float *dense = falloc((size_t)N * OC);
    for (int n = 0; n < N; n++)
      memcpy(dense + (size_t)n * OC, out + (size_t)n * ldo, (size_t)OC * sizeof(float));
    CHECK_CLOSE("matmul out (large)", dense, out_d, (size_t)N * OC, ACC_RTOL, ACC_ATOL);
    check_untouched("matmul out padding (large)", out, N, ldo, OC, ldo, SENTINEL);
    tfree_all();
  }
}
END_TEST

/* ---------------------------------------------------------------------------------------------
 * bf16 compute
 * ------------------------------------------------------------------------------------------- */

/* x rounded to 8 significant bits, ties to even, through frexp / nearbyint (an independent
 * reference for dt_bf16_round on normal floats). */
static float ref_bf16(float x)
{
  int e;
  const double m = frexp((double)x, &e); /* |m| in [0.5, 1) */
  return (float)ldexp(nearbyint(ldexp(m, 8)), e - 8);
}

START_TEST(test_bf16_round)
{
  /* Ties go to the even neighbour: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7. */
  ck_assert(dt_bf16_round(1.0f) == 1.0f);
  ck_assert(dt_bf16_round(1.0f + 0x1p-8f) == 1.0f);
  ck_assert(dt_bf16_round(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);
  ck_assert(dt_bf16_round(1.0f + 0x1p-8f + 0x1p-20f) == 1.0f + 0x1p-7f);
  ck_assert(dt_bf16_round(-1.0f - 0x1p-8f - 0x1p-20f) == -1.0f - 0x1p-7f);
  ck_assert(dt_bf16_round(INFINITY) == INFINITY && dt_bf16_round(-INFINITY) == -INFINITY);
  ck_assert(isnan(dt_bf16_round(NAN)));
  ck_assert(dt_bf16_round(3.4028235e38f) == INFINITY); /* past bf16's largest, 0x1.fep127 */
  ck_assert(dt_bf16_round(0x1.fep127f) == 0x1.fep127f);
  dt_rng_t rng;
  dt_rng_seed(&rng, 77);
  float *x = rand_normal(&rng, 100000, 0.0f, 1.0f);
  for (int i = 0; i < 100000; i++) {
    const float v = x[i] * (i % 2 ? 1e-20f : 1e20f);
    ck_assert_msg(dt_bf16_round(v) == ref_bf16(v), "%a -> %a, want %a", v, dt_bf16_round(v),
                  ref_bf16(v));
  }
}
END_TEST

/* What a variant of the bf16 linear layer's backward is checked against: the rounded operands
 * of the reference, and the weight gradient both accumulate into. */
typedef struct {
  int N, C, OC, ld;
  const float *in16, *dout_r, *inp_r, *w_r;
  float *dw, *dw_w;
} bwd16_case_t;

/* dt_cpu_matmul_backward_bf16 with these dout / dout16 / weight / weight16 / gelu_in and dinp16
 * (with gelu_in) over a GARBAGE dinp: dinp must be want_dinp, and dw the reference's after one
 * more accumulation. */
static void check_bwd16(const bwd16_case_t *t, const float *dout, const float *dout16,
                        const float *w, const float *w16, const float *gelu_in, int dinp16,
                        const float *want_dinp)
{
  const size_t nd = (size_t)t->N * t->C;
  float *dinp = filled(nd, GARBAGE);
  ck_assert_int_eq(dt_cpu_matmul_backward_bf16(dinp, dinp16, t->dw, NULL, dout, dout16, t->in16, w,
                                               w16, gelu_in, t->N, t->C, t->OC, t->ld),
                   0);
  dt_cpu_matmul_backward(NULL, t->dw_w, NULL, t->dout_r, t->inp_r, t->w_r, t->N, t->C, t->OC,
                         t->ld);
  ck_assert(memcmp(dinp, want_dinp, nd * sizeof(float)) == 0);
  ck_assert(memcmp(t->dw, t->dw_w, (size_t)t->OC * t->C * sizeof(float)) == 0);
}

/* The bf16 linear layer is the fp32 one on operands rounded to bf16 (bit for bit: the same
 * GEMM), except dbias, which sums the unrounded gradient; and it is not the fp32 layer. Its
 * input is a bf16 activation: the table's to_bf16 of inp (the reference's rounding, bit for
 * bit). */
START_TEST(test_matmul_bf16)
{
  const int N = 37, C = 45, OC = 70, ld = 75;
  dt_rng_t rng;
  dt_rng_seed(&rng, 78);
  float *inp = rand_normal(&rng, (size_t)N * C, 0.0f, 1.0f);
  float *w = rand_normal(&rng, (size_t)OC * C, 0.0f, 0.1f);
  float *bias = rand_normal(&rng, (size_t)OC, 0.0f, 1.0f);
  float *dout = rand_normal(&rng, (size_t)N * ld, 0.0f, 1.0f);
  float *inp_r = falloc((size_t)N * C), *w_r = falloc((size_t)OC * C);
  float *dout_r = falloc((size_t)N * ld);
  for (size_t i = 0; i < (size_t)N * C; i++)
    inp_r[i] = ref_bf16(inp[i]);
  for (size_t i = 0; i < (size_t)OC * C; i++)
    w_r[i] = ref_bf16(w[i]);
  for (size_t i = 0; i < (size_t)N * ld; i++)
    dout_r[i] = ref_bf16(dout[i]);

  const dt_ops_t *ops = dt_ops_cpu();
  float *in16 = filled((size_t)N * C, GARBAGE);
  ck_assert_uint_eq(ops->bf16_bytes, sizeof(float));
  ck_assert_int_eq(ops->to_bf16(dt_device_cpu(), in16, inp, (size_t)N * C), 0);
  ck_assert(memcmp(in16, inp_r, (size_t)N * C * sizeof(float)) == 0);

  float *out = filled((size_t)N * ld, SENTINEL), *want = filled((size_t)N * ld, SENTINEL);
  float *plain = filled((size_t)N * ld, SENTINEL);
  ck_assert_int_eq(dt_cpu_matmul_forward_bf16(out, in16, w, NULL, bias, N, C, OC, ld), 0);
  dt_cpu_matmul_forward(want, inp_r, w_r, bias, N, C, OC, ld);
  dt_cpu_matmul_forward(plain, inp, w, bias, N, C, OC, ld);
  ck_assert(memcmp(out, want, (size_t)N * ld * sizeof(float)) == 0);
  ck_assert(memcmp(out, plain, (size_t)N * ld * sizeof(float)) != 0);

  float *dinp = filled((size_t)N * C, GARBAGE), *dinp_w = filled((size_t)N * C, GARBAGE);
  float *dw = filled((size_t)OC * C, 0.5f), *dw_w = filled((size_t)OC * C, 0.5f);
  float *db = filled((size_t)OC, 0.25f), *db_w = filled((size_t)OC, 0.25f);
  ck_assert_int_eq(
      dt_cpu_matmul_backward_bf16(dinp, 0, dw, db, dout, NULL, in16, w, NULL, NULL, N, C, OC, ld),
      0);
  dt_cpu_matmul_backward(dinp_w, dw_w, NULL, dout_r, inp_r, w_r, N, C, OC, ld);
  float *dw_unused = filled((size_t)OC * C, 0.0f);
  dt_cpu_matmul_backward(NULL, dw_unused, db_w, dout, inp, w, N, C, OC, ld);
  ck_assert(memcmp(dinp, dinp_w, (size_t)N * C * sizeof(float)) == 0);
  ck_assert(memcmp(dw, dw_w, (size_t)OC * C * sizeof(float)) == 0);
  ck_assert(memcmp(db, db_w, (size_t)OC * sizeof(float)) == 0);
  /* dinp NULL: only the parameter gradients */
  ck_assert_int_eq(
      dt_cpu_matmul_backward_bf16(NULL, 0, dw, NULL, dout, NULL, in16, w, NULL, NULL, N, C, OC, ld),
      0);
  dt_cpu_matmul_backward(NULL, dw_w, NULL, dout_r, inp_r, w_r, N, C, OC, ld);
  ck_assert(memcmp(dw, dw_w, (size_t)OC * C * sizeof(float)) == 0);
  /* the table refuses a bias gradient of a dout whose bytes hold its bf16 values (in place) */
  ck_assert_int_eq(ops->matmul_backward_bf16(dt_device_cpu(), NULL, 0, dw, db, dout, dout, in16, w,
                                             NULL, NULL, N, C, OC, ld),
                   DT_EINVAL);
  /* Variants, each over a GARBAGE dinp and accumulating into dw like the reference's dw_w: */
  const bwd16_case_t t = {N, C, OC, ld, in16, dout_r, inp_r, w_r, dw, dw_w};
  /* dout's bf16 values given (dout16, in dout's places): the same GEMMs, dout unread (NULL); */
  check_bwd16(&t, NULL, dout_r, w, NULL, NULL, 0, dinp_w);
  /* the weight's bf16 values given (weight16): read in place of the weight, here garbage; */
  float *w_bad = filled((size_t)OC * C, GARBAGE), *out16 = filled((size_t)N * ld, SENTINEL);
  ck_assert_int_eq(dt_cpu_matmul_forward_bf16(out16, in16, w_bad, w_r, bias, N, C, OC, ld), 0);
  ck_assert(memcmp(out16, want, (size_t)N * ld * sizeof(float)) == 0);
  check_bwd16(&t, dout, NULL, w_bad, w_r, NULL, 0, dinp_w);
  /* into a bf16 dinp (dinp16): the same dinp rounded to bf16, bit for bit */
  float *dinp_r = falloc((size_t)N * C);
  for (size_t i = 0; i < (size_t)N * C; i++)
    dinp_r[i] = ref_bf16(dinp_w[i]);
  ck_assert(memcmp(dinp_r, dinp_w, (size_t)N * C * sizeof(float)) != 0);
  check_bwd16(&t, dout, NULL, w, NULL, NULL, 1, dinp_r);
  /* through a GELU of a bf16 pre-activation (gelu_in): the GELU's backward of that dinp,
   * rounded to bf16, bit for bit */
  float *x = rand_normal(&rng, (size_t)N * C, 0.0f, 1.0f), *want_x = falloc((size_t)N * C);
  for (size_t i = 0; i < (size_t)N * C; i++)
    x[i] = ref_bf16(x[i]);
  dt_cpu_gelu_backward(want_x, x, dinp_w, (size_t)N * C);
  for (size_t i = 0; i < (size_t)N * C; i++)
    want_x[i] = ref_bf16(want_x[i]);
  ck_assert(memcmp(want_x, dinp_w, (size_t)N * C * sizeof(float)) != 0);
  check_bwd16(&t, dout, NULL, w, NULL, x, 1, want_x);
  /* the table refuses a GELU gradient into an fp32 dinp */
  ck_assert_int_eq(ops->matmul_backward_bf16(dt_device_cpu(), dinp, 0, dw, NULL, dout, NULL, in16,
                                             w, NULL, x, N, C, OC, ld),
                   DT_EINVAL);
  /* a gradient in bf16 only (dout NULL; dout16 (N, OC) contiguous, as the GELU's backward
   * above writes it, ldd = OC * bf16_bytes / 4): the GEMMs of its values, and dbias their sums
   * (against double sums) */
  float *g16 = falloc((size_t)N * OC), *db16 = filled((size_t)OC, 0.25f);
  for (size_t i = 0; i < (size_t)N; i++)
    for (size_t j = 0; j < (size_t)OC; j++)
      g16[i * OC + j] = dout_r[i * ld + j];
  float *dinp16 = filled((size_t)N * C, GARBAGE), *dinp16_w = falloc((size_t)N * C);
  float *dw16 = filled((size_t)OC * C, 0.5f), *dw16_w = filled((size_t)OC * C, 0.5f);
  ck_assert_int_eq(ops->matmul_backward_bf16(dt_device_cpu(), dinp16, 0, dw16, db16, NULL, g16,
                                             in16, w, NULL, NULL, N, C, OC, OC),
                   0);
  dt_cpu_matmul_backward(dinp16_w, dw16_w, NULL, g16, inp_r, w_r, N, C, OC, OC);
  ck_assert(memcmp(dinp16, dinp16_w, (size_t)N * C * sizeof(float)) == 0);
  ck_assert(memcmp(dw16, dw16_w, (size_t)OC * C * sizeof(float)) == 0);
  for (int o = 0; o < OC; o++) {
    double want_b = 0.25;
    for (int i = 0; i < N; i++)
      want_b += g16[(size_t)i * OC + o];
    ck_assert_msg(fabs(db16[o] - want_b) <= 1e-5 * (1.0 + fabs(want_b)), "dbias[%d] %g, want %g", o,
                  (double)db16[o], want_b);
  }
  /* refused: dout16's rows shorter than OC; no gradient at all */
  ck_assert_int_eq(ops->matmul_backward_bf16(dt_device_cpu(), dinp16, 0, dw16, db16, NULL, g16,
                                             in16, w, NULL, NULL, N, C, OC, OC - 1),
                   DT_EINVAL);
  ck_assert_int_eq(ops->matmul_backward_bf16(dt_device_cpu(), dinp16, 0, dw16, NULL, NULL, NULL,
                                             in16, w, NULL, NULL, N, C, OC, OC),
                   DT_EINVAL);
  /* the table's entries */
  ck_assert_ptr_nonnull(ops->matmul_forward_bf16);
  ck_assert_int_eq(ops->matmul_forward_bf16(dt_device_cpu(), plain, 0, in16, w, NULL, bias, NULL,
                                            NULL, N, C, OC, ld),
                   0);
  ck_assert(memcmp(out, plain, (size_t)N * ld * sizeof(float)) == 0);
  /* into a bf16 output (out16), rows OC and ld apart: the fp32 output's values with the bias's
   * bf16 value (as PyTorch autocast), rounded, bit for bit, the columns past OC untouched; rows
   * shorter than OC are refused */
  float *b16 = falloc((size_t)OC), *out_b16 = falloc((size_t)N * ld);
  for (int o = 0; o < OC; o++)
    b16[o] = ref_bf16(bias[o]);
  ck_assert_int_eq(ops->matmul_forward_bf16(dt_device_cpu(), out_b16, 0, in16, w, NULL, b16, NULL,
                                            NULL, N, C, OC, ld),
                   0);
  float *o16 = falloc((size_t)N * ld);
  for (int ldo = OC; ldo <= ld; ldo += ld - OC) {
    for (size_t i = 0; i < (size_t)N * ld; i++)
      o16[i] = GARBAGE;
    ck_assert_int_eq(ops->matmul_forward_bf16(dt_device_cpu(), o16, 1, in16, w, NULL, bias, NULL,
                                              NULL, N, C, OC, ldo),
                     0);
    for (size_t i = 0; i < (size_t)N; i++)
      for (size_t j = 0; j < (size_t)ldo; j++)
        ck_assert(j < (size_t)OC ? o16[i * ldo + j] == ref_bf16(out_b16[i * ld + j])
                                 : o16[i * ldo + j] == GARBAGE);
  }
  ck_assert_int_eq(ops->matmul_forward_bf16(dt_device_cpu(), o16, 1, in16, w, NULL, bias, NULL,
                                            NULL, N, C, OC, OC - 1),
                   DT_EINVAL);
  /* with a residual (res): res + the output above, as residual_forward adds it, bit for bit, the
   * columns past OC untouched; refused into a bf16 output */
  float *res = rand_normal(&rng, (size_t)N * ld, 0.0f, 1.0f), *sum = filled((size_t)N * ld, 0.5f);
  float *want_sum = filled((size_t)N * ld, 0.5f);
  for (size_t i = 0; i < (size_t)N; i++)
    dt_cpu_residual_forward(want_sum + i * ld, res + i * ld, out + i * ld, (size_t)OC);
  ck_assert_int_eq(ops->matmul_forward_bf16(dt_device_cpu(), sum, 0, in16, w, NULL, bias, res, NULL,
                                            N, C, OC, ld),
                   0);
  ck_assert(memcmp(sum, want_sum, (size_t)N * ld * sizeof(float)) == 0);
  ck_assert_int_eq(ops->matmul_forward_bf16(dt_device_cpu(), o16, 1, in16, w, NULL, bias, res, NULL,
                                            N, C, OC, OC),
                   DT_EINVAL);
  /* with the GELU (gelu), rows OC and ld apart: out16's bits as above, and gelu gets the fp32
   * GELU of each unrounded output (out_b16's values, as gelu_forward computes them over the
   * same runs: the whole output where its rows are contiguous, else row by row, since its vector
   * and scalar tanhf may differ in the last ulp) rounded, bit for bit, the columns past OC
   * untouched in both; refused beside an fp32 output or a residual */
  float *x32 = falloc((size_t)N * OC), *g32 = falloc((size_t)N * OC),
        *gl16 = falloc((size_t)N * ld);
  for (size_t i = 0; i < (size_t)N; i++)
    memcpy(x32 + i * OC, out_b16 + i * ld, (size_t)OC * sizeof(float));
  for (int ldo = OC; ldo <= ld; ldo += ld - OC) {
    const size_t runs = ldo == OC ? 1 : (size_t)N, n = (size_t)N * OC / runs;
    for (size_t r = 0; r < runs; r++)
      ck_assert_int_eq(ops->gelu_forward(dt_device_cpu(), g32 + r * n, x32 + r * n, n), 0);
    for (size_t i = 0; i < (size_t)N * ld; i++)
      o16[i] = GARBAGE, gl16[i] = GARBAGE;
    ck_assert_int_eq(ops->matmul_forward_bf16(dt_device_cpu(), o16, 1, in16, w, NULL, bias, NULL,
                                              gl16, N, C, OC, ldo),
                     0);
    for (size_t i = 0; i < (size_t)N; i++)
      for (size_t j = 0; j < (size_t)ldo; j++) {
        const int in_row = j < (size_t)OC;
        ck_assert(in_row ? o16[i * ldo + j] == ref_bf16(out_b16[i * ld + j])
                         : o16[i * ldo + j] == GARBAGE);
        ck_assert(in_row ? gl16[i * ldo + j] == ref_bf16(g32[i * OC + j])
                         : gl16[i * ldo + j] == GARBAGE);
      }
  }
  ck_assert_int_eq(ops->matmul_forward_bf16(dt_device_cpu(), out, 0, in16, w, NULL, bias, NULL,
                                            gl16, N, C, OC, ld),
                   DT_EINVAL);
  ck_assert_int_eq(ops->matmul_forward_bf16(dt_device_cpu(), o16, 1, in16, w, NULL, bias, res, gl16,
                                            N, C, OC, OC),
                   DT_EINVAL);
}
END_TEST

/* ---------------------------------------------------------------------------------------------
 * Attention
 * ------------------------------------------------------------------------------------------- */

/* One (b, h) head of causal self-attention, written the way llm.c's attention_forward is: for
 * each query row t, scaled dot products with keys t2 <= t, a max-subtracted softmax, and the
 * probability-weighted sum of the values. att (B, NH, T, T) gets zeros above the diagonal. */
static void ref_attention_head(double *out, double *att, const double *qkv, int b, int h, int T,
                               int C, int NH)
{
  const int hs = C / NH, C3 = 3 * C;
  const double scale = 1.0 / sqrt((double)hs);
  for (int t = 0; t < T; t++) {
    const double *q = qkv + ((size_t)b * T + t) * C3 + (size_t)h * hs;
    double *a = att + (((size_t)b * NH + h) * T + t) * T;
    double maxv = -INFINITY;
    for (int t2 = 0; t2 <= t; t2++) {
      const double *k = qkv + ((size_t)b * T + t2) * C3 + C + (size_t)h * hs;
      double s = 0.0;
      for (int i = 0; i < hs; i++)
        s += q[i] * k[i];
      a[t2] = s * scale;
      if (a[t2] > maxv)
        maxv = a[t2];
    }
    double sum = 0.0;
    for (int t2 = 0; t2 <= t; t2++) {
      a[t2] = exp(a[t2] - maxv);
      sum += a[t2];
    }
    for (int t2 = 0; t2 <= t; t2++)
      a[t2] /= sum;
    for (int t2 = t + 1; t2 < T; t2++)
      a[t2] = 0.0;
    double *o = out + ((size_t)b * T + t) * C + (size_t)h * hs;
    for (int i = 0; i < hs; i++)
      o[i] = 0.0;
    for (int t2 = 0; t2 <= t; t2++) {
      const double *v = qkv + ((size_t)b * T + t2) * C3 + 2 * C + (size_t)h * hs;
      for (int i = 0; i < hs; i++)
        o[i] += a[t2] * v[i];
    }
  }
}

static void ref_attention_forward(double *out, double *att, const double *qkv, int B, int T, int C,
                                  int NH)
{
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++)
      ref_attention_head(out, att, qkv, b, h, T, C, NH);
}

/* L restricted to one head: an element of qkv belongs to exactly one (b, h), and no other
 * head's output depends on it, so dL/dx = dL_bh/dx and each difference costs one head. */
struct att_ctx {
  const double *qkv, *R;
  double *out, *att;
  int B, T, C, NH, b, h;
};

static double att_head_objective(void *p)
{
  struct att_ctx *e = p;
  const int hs = e->C / e->NH;
  ref_attention_head(e->out, e->att, e->qkv, e->b, e->h, e->T, e->C, e->NH);
  double L = 0.0;
  for (int t = 0; t < e->T; t++) {
    size_t off = ((size_t)e->b * e->T + t) * e->C + (size_t)e->h * hs;
    L += dot(e->out + off, e->R + off, (size_t)hs);
  }
  return L;
}

static void run_attention(int B, int T, int C, int NH, int backward, uint64_t seed)
{
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C;
  const size_t natt = (size_t)B * NH * T * T;
  float *qkv = rand_normal(&rng, nqkv, 0.0f, 1.0f);

  /* forward: out over garbage; att over NaN, every entry must be written */
  float *out = filled(nout, GARBAGE), *att = filled(natt, NAN);
  dt_cpu_attention_forward(out, att, qkv, B, T, C, NH);
  double *qkv_d = to_double(qkv, nqkv), *out_d = dalloc(nout), *att_d = dalloc(natt);
  ref_attention_forward(out_d, att_d, qkv_d, B, T, C, NH);
  CHECK_CLOSE("attention out", out, out_d, nout, ACC_RTOL, ACC_ATOL);
  CHECK_CLOSE("attention att", att, att_d, natt, ACC_RTOL, ACC_ATOL);
  for (size_t bh = 0; bh < (size_t)B * NH; bh++) /* exact zeros above the diagonal */
    for (int t = 0; t < T; t++)
      for (int t2 = t + 1; t2 < T; t2++)
        ck_assert_msg(att[(bh * T + t) * T + t2] == 0.0f, "attention att[%zu, %d, %d] = %g", bh, t,
                      t2, att[(bh * T + t) * T + t2]);
  if (!backward) {
    tfree_all();
    return;
  }

  /* backward: dqkv written over garbage; the scratch is NaN so that any read of an entry the
   * kernel did not write first poisons the result */
  float *R = rand_normal(&rng, nout, 0.0f, 1.0f);
  float *dqkv = filled(nqkv, GARBAGE), *scratch = filled(natt, NAN);
  dt_cpu_attention_backward(dqkv, scratch, R, qkv, att, B, T, C, NH);

  const int hs = C / NH, C3 = 3 * C;
  struct att_ctx ctx = {qkv_d, to_double(R, nout), out_d, att_d, B, T, C, NH, 0, 0};
  double *g = dalloc(nqkv);
  for (size_t i = 0; i < nqkv; i++) {
    ctx.b = (int)(i / ((size_t)T * C3));
    ctx.h = (int)(i % (size_t)C3) % C / hs;
    g[i] = fd_one(att_head_objective, &ctx, qkv_d, i);
  }
  CHECK_CLOSE("attention dqkv (=)", dqkv, g, nqkv, GRAD_RTOL, GRAD_ATOL);
  tfree_all();
}

START_TEST(test_attention)
{
  /* B, T, C, NH, backward?, seed */
  run_attention(1, 1, 4, 1, 1, 41);  /* T = 1: att = 1, dq = dk = 0 */
  run_attention(2, 5, 8, 2, 1, 42);  /* B > 1, one partial block */
  run_attention(1, 70, 8, 2, 1, 43); /* one full block of 64 + remainder 6 */
  run_attention(1, 64, 8, 4, 1, 44); /* exactly one block, hs = 2 */
  /* forward only from here (finite differences at T = 130 would cost seconds under ASan) */
  run_attention(2, 130, 12, 3, 0, 45); /* three row blocks, the last of 2 rows */
  run_attention(1, 129, 64, 4, 0, 46); /* hs = 16 */
}
END_TEST

/* The whole sequence of a chunked attention test: random qkv and R (the output's gradient),
 * the double reference's out and att, and the materialised kernels' dqkv for R (the backward
 * that test_attention checks against finite differences). */
typedef struct {
  float *qkv, *R, *dqkv;
  double *qkv_d, *out_d, *att_d;
} att_case_t;

static att_case_t att_case(int B, int T, int C, int NH, uint64_t seed)
{
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C;
  const size_t natt = (size_t)B * NH * T * T;
  att_case_t x = {.qkv = rand_normal(&rng, nqkv, 0.0f, 1.0f),
                  .R = rand_normal(&rng, nout, 0.0f, 1.0f),
                  .dqkv = filled(nqkv, GARBAGE),
                  .out_d = dalloc(nout),
                  .att_d = dalloc(natt)};
  x.qkv_d = to_double(x.qkv, nqkv);
  ref_attention_forward(x.out_d, x.att_d, x.qkv_d, B, T, C, NH);
  float *att = filled(natt, NAN);
  dt_cpu_attention_forward(filled(nout, GARBAGE), att, x.qkv, B, T, C, NH);
  dt_cpu_attention_backward(x.dqkv, filled(natt, NAN), x.R, x.qkv, att, B, T, C, NH);
  return x;
}

/* Chunk [q0, q0 + Tq)'s rows of R (its dout) and of the reference out. */
static void att_chunk_rows(const att_case_t *x, int B, int T, int C, int q0, int Tq, float **dout,
                           double **out_want)
{
  const size_t row = (size_t)Tq * C;
  *dout = falloc((size_t)B * row);
  *out_want = dalloc((size_t)B * row);
  for (int b = 0; b < B; b++) {
    memcpy(*dout + b * row, x->R + ((size_t)b * T + q0) * C, row * sizeof(float));
    for (size_t i = 0; i < row; i++)
      (*out_want)[b * row + i] = x->out_d[((size_t)b * T + q0) * C + i];
  }
}

/* A backward that writes (accumulate 0) over GARBAGE: the values d of the same backward added
 * onto zeros where it writes, GARBAGE left elsewhere (where d stayed 0). */
static void check_written(const char *what, const float *w, const float *d, size_t n)
{
  size_t written = 0;
  for (size_t i = 0; i < n; i++) {
    ck_assert_msg(w[i] == d[i] || (w[i] == GARBAGE && d[i] == 0.0f), "%s [%zu]: %g, want %g", what,
                  i, (double)w[i], (double)d[i]);
    written += w[i] != GARBAGE;
  }
  ck_assert_msg(written > 0, "%s: nothing written", what);
}

/* A chunk's backward (queries [q0, Tk), keys [0, Tk)) run over zeros (d) and over ones: the
 * rows it owns must hold 1 + its result, the others stay 0 and 1; d is added into sum. */
static void check_chunk_added(const char *what, int r, const float *d, const float *ones,
                              float *sum, int B, int T, int C, int q0, int Tk)
{
  const int C3 = 3 * C;
  for (size_t i = 0; i < (size_t)B * T * C3; i++) {
    const int t = (int)(i / C3 % T), part = (int)(i % C3) / C; /* 0 q, 1 k, 2 v */
    const int mine = part == 0 ? t >= q0 && t < Tk : t < Tk;
    if (!mine)
      ck_assert_msg(d[i] == 0.0f && ones[i] == 1.0f, "%s chunk %d wrote dqkv row %d part %d", what,
                    r, t, part);
    else
      ck_assert_msg(fabsf(ones[i] - (1.0f + d[i])) <= 1e-6f * (1.0f + fabsf(d[i])),
                    "%s chunk %d: row %d part %d not added: %g vs 1 + %g", what, r, t, part,
                    ones[i], d[i]);
    sum[i] += d[i];
  }
}

/* Context parallelism: the sequence split in cp chunks, chunk r's queries against the keys up
 * to its end. Each chunk's out and att rows must be the full attention's rows (the double
 * reference), and the chunks' backward results, summed as the cp group sums them, the full
 * backward's (itself checked against finite differences above). The backward adds to dqkv:
 * over ones, a chunk's rows are 1 + its result and the rows it does not own stay 1. */
static void run_attention_cp(int B, int T, int C, int NH, int cp, uint64_t seed)
{
  const att_case_t x = att_case(B, T, C, NH, seed);
  const int Tq = T / cp;
  const size_t nqkv = (size_t)B * T * 3 * C;
  const float *qkv = x.qkv;
  float *sum = filled(nqkv, 0.0f);
  for (int r = 0; r < cp; r++) {
    const int q0 = r * Tq, Tk = q0 + Tq;
    const size_t nloc = (size_t)B * Tq * C, natt_r = (size_t)B * NH * Tq * Tk;
    float *out = filled(nloc, GARBAGE), *att_r = filled(natt_r, NAN), *dout;
    double *out_want, *att_want = dalloc(natt_r);
    att_chunk_rows(&x, B, T, C, q0, Tq, &dout, &out_want);
    for (int b = 0; b < B; b++) {
      for (int h = 0; h < NH; h++)
        for (int t = 0; t < Tq; t++)
          for (int j = 0; j < Tk; j++)
            att_want[(((size_t)b * NH + h) * Tq + t) * Tk + j] =
                x.att_d[(((size_t)b * NH + h) * T + q0 + t) * T + j];
    }
    dt_cpu_attention_forward_cp(out, att_r, qkv, B, Tq, q0, T, C, NH);
    CHECK_CLOSE("attention_cp out", out, out_want, nloc, ACC_RTOL, ACC_ATOL);
    CHECK_CLOSE("attention_cp att", att_r, att_want, natt_r, ACC_RTOL, ACC_ATOL);
    float *d = filled(nqkv, 0.0f), *ones = filled(nqkv, 1.0f);
    dt_cpu_attention_backward_cp(d, filled(natt_r, NAN), dout, qkv, att_r, B, Tq, q0, T, C, NH);
    dt_cpu_attention_backward_cp(ones, filled(natt_r, NAN), dout, qkv, att_r, B, Tq, q0, T, C, NH);
    check_chunk_added("attention_cp", r, d, ones, sum, B, T, C, q0, Tk);
  }
  CHECK_CLOSE("attention_cp dqkv summed over the chunks", sum, to_double(x.dqkv, nqkv), nqkv, 1e-5,
              1e-6);
  tfree_all();
}

START_TEST(test_attention_cp)
{
  /* B, T, C, NH, cp, seed */
  run_attention_cp(1, 8, 8, 2, 2, 51);    /* one partial block per chunk */
  run_attention_cp(2, 150, 12, 3, 3, 52); /* q0 = 50, 100: not on a block boundary */
  run_attention_cp(1, 256, 16, 2, 2, 53); /* q0 = 128: on one; two row blocks per chunk */
  run_attention_cp(2, 96, 8, 2, 4, 54);   /* four chunks of 24 */
}
END_TEST

/* The log-sum-exp of query row t's scaled scores in (b, h), in double. */
static double ref_lse(const double *qkv, int b, int h, int t, int T, int C, int NH)
{
  const int hs = C / NH, C3 = 3 * C;
  const double *q = qkv + ((size_t)b * T + t) * C3 + (size_t)h * hs;
  double s[t + 1], maxv = -INFINITY, sum = 0.0;
  for (int j = 0; j <= t; j++) {
    const double *k = qkv + ((size_t)b * T + j) * C3 + C + (size_t)h * hs;
    s[j] = dot(q, k, (size_t)hs) / sqrt((double)hs);
    maxv = s[j] > maxv ? s[j] : maxv;
  }
  for (int j = 0; j <= t; j++)
    sum += exp(s[j] - maxv);
  return maxv + log(sum);
}

/* Flash-style attention, the sequence in cp chunks as context parallelism runs it (cp = 1: the
 * whole sequence). Each chunk's out must be the double reference's rows and its lse the
 * reference log-sum-exp; the backward adds (over ones: 1 + its result, the rows it does not own
 * stay 1), and its results summed over the chunks must be the materialised kernel's dqkv (that
 * kernel is checked against finite differences above). Outputs and lse come out bit-identical
 * with 1 and 3 threads. */
static void run_attention_flash(int B, int T, int C, int NH, int cp, uint64_t seed)
{
  const att_case_t x = att_case(B, T, C, NH, seed);
  const int Tq = T / cp;
  const size_t nqkv = (size_t)B * T * 3 * C;
  const float *qkv = x.qkv;
  float *sum = filled(nqkv, 0.0f);
  for (int r = 0; r < cp; r++) {
    const int q0 = r * Tq, Tk = q0 + Tq;
    const size_t nloc = (size_t)B * Tq * C, nlse = (size_t)B * NH * Tq;
    float *out = filled(nloc, GARBAGE), *lse = filled(nlse, NAN), *dout;
    double *out_want, *lse_want = dalloc(nlse);
    att_chunk_rows(&x, B, T, C, q0, Tq, &dout, &out_want);
    for (int b = 0; b < B; b++)
      for (int h = 0; h < NH; h++)
        for (int t = 0; t < Tq; t++)
          lse_want[((size_t)b * NH + h) * Tq + t] = ref_lse(x.qkv_d, b, h, q0 + t, T, C, NH);
    set_threads(1);
    ck_assert_int_eq(dt_cpu_attention_forward_flash(out, lse, qkv, B, Tq, q0, T, C, NH), 0);
    CHECK_CLOSE("attention_flash out", out, out_want, nloc, ACC_RTOL, ACC_ATOL);
    CHECK_CLOSE("attention_flash lse", lse, lse_want, nlse, ACC_RTOL, ACC_ATOL);
    float *out3 = filled(nloc, GARBAGE), *lse3 = filled(nlse, NAN);
    set_threads(3);
    ck_assert_int_eq(dt_cpu_attention_forward_flash(out3, lse3, qkv, B, Tq, q0, T, C, NH), 0);
    ck_assert(memcmp(out, out3, nloc * 4) == 0 && memcmp(lse, lse3, nlse * 4) == 0);

    float *d = filled(nqkv, 0.0f), *ones = filled(nqkv, 1.0f);
    ck_assert_int_eq(
        dt_cpu_attention_backward_flash(d, dout, qkv, out, lse, B, Tq, q0, T, C, NH, 1), 0);
    ck_assert_int_eq(
        dt_cpu_attention_backward_flash(ones, dout, qkv, out, lse, B, Tq, q0, T, C, NH, 1), 0);
    float *w = filled(nqkv, GARBAGE);
    ck_assert_int_eq(
        dt_cpu_attention_backward_flash(w, dout, qkv, out, lse, B, Tq, q0, T, C, NH, 0), 0);
    check_written("attention_flash written", w, d, nqkv);
    check_chunk_added("attention_flash", r, d, ones, sum, B, T, C, q0, Tk);
  }
  set_threads(2);
  CHECK_CLOSE("attention_flash dqkv summed over the chunks", sum, to_double(x.dqkv, nqkv), nqkv,
              GRAD_RTOL, 1e-5);
  tfree_all();
}

START_TEST(test_attention_flash)
{
  /* B, T, C, NH, cp, seed */
  run_attention_flash(1, 1, 4, 1, 1, 61);    /* a single position */
  run_attention_flash(2, 70, 8, 2, 1, 62);   /* one full row block of 64 + remainder 6 */
  run_attention_flash(2, 130, 12, 3, 1, 63); /* three row blocks, the last of 2 rows */
  run_attention_flash(2, 150, 12, 3, 3, 64); /* chunks of 50 at q0 = 50, 100 */
  run_attention_flash(1, 256, 64, 4, 2, 65); /* hs 16, chunks of 128: two row blocks each */
  run_attention_flash(1, 1500, 4, 1, 1, 66); /* past the 16 MiB scratch: bands of 1344 + 156 */
}
END_TEST

/* bf16 flash attention of head (b, h) over the whole sequence (T positions), in double from
 * its definition (ops.h, attention.c): q, k, v and the output gradient R rounded to bf16 (by
 * ref_bf16); each probability exp(s - m) rounded with m the running maximum of the 64-key
 * tiles up to its own, then scaled by exp(m - the row's maximum); the score gradients P (dP -
 * D) rounded, D = R . out unrounded; P rounded for dV. Writes out and lse, adds into dqkv. */
static void ref_flash_bf16_head(double *out, double *lse, double *dqkv, const float *qkv,
                                const float *R, int b, int h, int T, int C, int NH)
{
  const int hs = C / NH, C3 = 3 * C;
  const double scale = 1.0 / sqrt((double)hs);
  double *s = dalloc((size_t)T), *w = dalloc((size_t)T);
#define RB(p) ((double)ref_bf16(p))
  for (int t = 0; t < T; t++) {
    const float *q = qkv + ((size_t)b * T + t) * C3 + (size_t)h * hs;
    const float *g = R + ((size_t)b * T + t) * C + (size_t)h * hs;
    double maxv = -INFINITY, sum = 0.0, m = -INFINITY;
    for (int j = 0; j <= t; j++) {
      const float *k = qkv + ((size_t)b * T + j) * C3 + C + (size_t)h * hs;
      s[j] = 0.0;
      for (int i = 0; i < hs; i++)
        s[j] += RB(q[i]) * RB(k[i]);
      s[j] *= scale;
      maxv = s[j] > maxv ? s[j] : maxv;
    }
    for (int j = 0; j <= t; j++) {
      if (j % 64 == 0) /* a new tile: the running maximum takes in its keys up to t */
        for (int j2 = j; j2 <= t && j2 < j + 64; j2++)
          m = s[j2] > m ? s[j2] : m;
      w[j] = RB((float)exp(s[j] - m)) * exp(m - maxv);
      sum += exp(s[j] - maxv);
    }
    double *o = out + ((size_t)b * T + t) * C + (size_t)h * hs, D = 0.0;
    for (int i = 0; i < hs; i++) {
      o[i] = 0.0;
      for (int j = 0; j <= t; j++)
        o[i] += w[j] * RB(qkv[((size_t)b * T + j) * C3 + 2 * C + (size_t)h * hs + i]);
      o[i] /= sum;
      D += (double)g[i] * o[i];
    }
    const double L = maxv + log(sum);
    lse[((size_t)b * NH + h) * T + t] = L;
    for (int j = 0; j <= t; j++) {
      const size_t kj = ((size_t)b * T + j) * C3 + (size_t)h * hs;
      const double P = exp(s[j] - L);
      double dP = 0.0;
      for (int i = 0; i < hs; i++)
        dP += RB(g[i]) * RB(qkv[kj + 2 * C + i]);
      const double dS = RB((float)(P * (dP - D)));
      for (int i = 0; i < hs; i++) {
        dqkv[((size_t)b * T + t) * C3 + (size_t)h * hs + i] += scale * dS * RB(qkv[kj + C + i]);
        dqkv[kj + C + i] += scale * dS * RB(q[i]);
        dqkv[kj + 2 * C + i] += RB((float)P) * RB(g[i]);
      }
    }
  }
#undef RB
}

/* max |got - want| / max |want| */
static double rel_err(const float *got, const double *want, size_t n)
{
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < n; i++) {
    const double d = fabs((double)got[i] - want[i]);
    worst = isfinite(d) && worst != INFINITY ? fmax(worst, d) : INFINITY;
    scale = fmax(scale, fabs(want[i]));
  }
  return worst / fmax(scale, 1e-30);
}

/* The bf16 flash kernels, chunked as run_attention_flash does it, against the double reference
 * above: out within 1e-4 and the gradients within 5e-4 of their largest value. What separates
 * kernel and reference is fp32 against double before a rounding, which moves a probability or a
 * score gradient by one bf16 step where it lies on a rounding boundary (rare: measured at most
 * 1.5e-5 and 1.1e-4 here). Leaving out the rounding of P (forward or for dV), of dS or of q,
 * k, v (passing the kernels unrounded ones), taking D from P dP, or rounding P against the row's
 * maximum instead of the tiles' running one, each measured 2.9e-4 to 3.5e-3. The fp32 flash kernel
 * must be further off than 1e-3 (the rounding took effect). */
static void run_attention_flash_bf16(int B, int T, int C, int NH, int cp, uint64_t seed)
{
  const att_case_t x = att_case(B, T, C, NH, seed);
  const int Tq = T / cp;
  const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C;
  double *out_d = dalloc(nout), *lse_d = dalloc((size_t)B * NH * T), *dqkv_d = dalloc(nqkv);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++)
      ref_flash_bf16_head(out_d, lse_d, dqkv_d, x.qkv, x.R, b, h, T, C, NH);
  float *qkv16 = falloc(nqkv); /* the kernels' input: a bf16 buffer (ops.h) */
  for (size_t i = 0; i < nqkv; i++)
    qkv16[i] = ref_bf16(x.qkv[i]);
  float *sum = filled(nqkv, 0.0f), *out_all = falloc(nout), *lse_all = falloc((size_t)B * NH * T);
  for (int r = 0; r < cp; r++) {
    const int q0 = r * Tq, Tk = q0 + Tq;
    const size_t nloc = (size_t)B * Tq * C, nlse = (size_t)B * NH * Tq;
    float *out = filled(nloc, GARBAGE), *lse = filled(nlse, NAN), *dout;
    double *unused;
    att_chunk_rows(&x, B, T, C, q0, Tq, &dout, &unused);
    ck_assert_int_eq(dt_cpu_attention_forward_flash_bf16(out, lse, qkv16, B, Tq, q0, T, C, NH), 0);
    for (int b = 0; b < B; b++) {
      memcpy(out_all + ((size_t)b * T + q0) * C, out + (size_t)b * Tq * C, (size_t)Tq * C * 4);
      for (int h = 0; h < NH; h++)
        memcpy(lse_all + ((size_t)b * NH + h) * T + q0, lse + ((size_t)b * NH + h) * Tq,
               (size_t)Tq * 4);
    }
    float *d = filled(nqkv, 0.0f), *ones = filled(nqkv, 1.0f);
    ck_assert_int_eq(
        dt_cpu_attention_backward_flash_bf16(d, dout, qkv16, out, lse, B, Tq, q0, T, C, NH, 1), 0);
    ck_assert_int_eq(
        dt_cpu_attention_backward_flash_bf16(ones, dout, qkv16, out, lse, B, Tq, q0, T, C, NH, 1),
        0);
    float *w = filled(nqkv, GARBAGE);
    ck_assert_int_eq(
        dt_cpu_attention_backward_flash_bf16(w, dout, qkv16, out, lse, B, Tq, q0, T, C, NH, 0), 0);
    check_written("attention_flash_bf16 written", w, d, nqkv);
    check_chunk_added("attention_flash_bf16", r, d, ones, sum, B, T, C, q0, Tk);
    /* the table's bf16 gradients (dqkv16): of one whole sequence only, written rounded */
    const dt_ops_t *ops = dt_ops_cpu();
    float *w16 = filled(nqkv, GARBAGE);
    const int whole = cp == 1;
    ck_assert_int_eq(ops->attention_backward_flash_bf16(dt_device_cpu(), w16, 1, dout, 0, qkv16,
                                                        out, lse, B, Tq, q0, T, C, NH, 0),
                     whole ? 0 : DT_EINVAL);
    for (size_t i = 0; whole && i < nqkv; i++)
      ck_assert(w16[i] == ref_bf16(w[i]));
    /* a bf16 dout (dout16) with bf16 gradients only */
    ck_assert_int_eq(ops->attention_backward_flash_bf16(dt_device_cpu(), w16, 0, dout, 1, qkv16,
                                                        out, lse, B, Tq, q0, T, C, NH, 0),
                     DT_EINVAL);
  }
  const double e_out = rel_err(out_all, out_d, nout), e_dqkv = rel_err(sum, dqkv_d, nqkv);
  const double e_lse = rel_err(lse_all, lse_d, (size_t)B * NH * T);
  ck_assert_msg(e_out <= 1e-4, "attention_flash_bf16 out: relative error %.3g", e_out);
  ck_assert_msg(e_lse <= 1e-5, "attention_flash_bf16 lse: relative error %.3g", e_lse);
  ck_assert_msg(e_dqkv <= 5e-4, "attention_flash_bf16 dqkv: relative error %.3g", e_dqkv);
  float *out32 = falloc(nout), *lse32 = falloc((size_t)B * NH * T);
  ck_assert_int_eq(dt_cpu_attention_forward_flash(out32, lse32, x.qkv, B, T, 0, T, C, NH), 0);
  ck_assert_msg(rel_err(out32, out_d, nout) > 1e-3, "fp32 attention gave the bf16 result");
  tfree_all();
}

START_TEST(test_attention_flash_bf16)
{
  /* B, T, C, NH, cp, seed */
  run_attention_flash_bf16(1, 1, 4, 1, 1, 71);    /* a single position */
  run_attention_flash_bf16(2, 70, 8, 2, 1, 72);   /* one full tile of 64 + remainder 6 */
  run_attention_flash_bf16(2, 150, 12, 3, 3, 73); /* chunks of 50 at q0 = 50, 100 */
  run_attention_flash_bf16(1, 256, 64, 4, 2, 74); /* hs 16, chunks of 128: four key tiles */
}
END_TEST

/* ---------------------------------------------------------------------------------------------
 * GELU and residual
 * ------------------------------------------------------------------------------------------- */

static double ref_gelu(double x)
{
  return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

struct gelu_ctx {
  const double *x, *R;
  size_t n;
};

static double gelu_objective(void *p)
{
  struct gelu_ctx *e = p;
  double L = 0.0;
  for (size_t i = 0; i < e->n; i++)
    L += ref_gelu(e->x[i]) * e->R[i];
  return L;
}

static void run_gelu(size_t n, uint64_t seed)
{
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  float *x = rand_normal(&rng, n, 0.0f, 3.0f);
  static const float special[] = {0.0f, 1e-3f, -1e-3f, 5.0f, -5.0f, 10.0f, -10.0f, -3.0f};
  for (size_t i = 0; i < n && i < sizeof special / sizeof special[0]; i++)
    x[i] = special[i];

  float *out = filled(n, GARBAGE);
  dt_cpu_gelu_forward(out, x, n);
  double *x_d = to_double(x, n), *out_d = dalloc(n);
  for (size_t i = 0; i < n; i++)
    out_d[i] = ref_gelu(x_d[i]);
  CHECK_CLOSE("gelu out", out, out_d, n, ELEM_RTOL, ELEM_ATOL);

  float *R = rand_normal(&rng, n, 0.0f, 1.0f);
  float *dinp = filled(n, GARBAGE);
  dt_cpu_gelu_backward(dinp, x, R, n);
  struct gelu_ctx ctx = {x_d, to_double(R, n), n};
  double *g = fd_gradient(gelu_objective, &ctx, x_d, n);
  /* elementwise, no accumulation: the tighter elementwise tolerance applies */
  CHECK_CLOSE("gelu dinp (=)", dinp, g, n, ELEM_RTOL, ELEM_ATOL);
  /* dinp may alias dout */
  float *inplace = fcopy(R, n);
  dt_cpu_gelu_backward(inplace, x, inplace, n);
  CHECK_CLOSE("gelu dinp in place", inplace, g, n, ELEM_RTOL, ELEM_ATOL);
  tfree_all();
}

START_TEST(test_gelu)
{
  run_gelu(1, 51);
  run_gelu(8, 52);
  run_gelu(1001, 53); /* vector body + remainder */
}
END_TEST

START_TEST(test_residual)
{
  static const size_t sizes[] = {1, 7, 1003};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    const size_t n = sizes[s];
    dt_rng_t rng;
    dt_rng_seed(&rng, 60 + s);
    float *a = rand_normal(&rng, n, 0.0f, 1.0f), *b = rand_normal(&rng, n, 0.0f, 10.0f);
    float *out = filled(n, GARBAGE);
    dt_cpu_residual_forward(out, a, b, n);
    double *want = dalloc(n);
    for (size_t i = 0; i < n; i++)
      want[i] = (double)a[i] + (double)b[i];
    CHECK_CLOSE("residual out", out, want, n, EXACT_RTOL, EXACT_ATOL);
    tfree_all();
  }
}
END_TEST

/* The fused residual add + LayerNorm gives, bit for bit, what the two kernels above give one
 * after the other (each checked against its reference), also with the sum written over a. */
START_TEST(test_residual_layernorm)
{
  const int N = 7, C = 130;
  const size_t n = (size_t)N * C;
  dt_rng_t rng;
  dt_rng_seed(&rng, 64);
  float *a = rand_normal(&rng, n, 0.5f, 1.0f), *b = rand_normal(&rng, n, 0.0f, 2.0f);
  float *w = rand_normal(&rng, C, 1.0f, 0.2f), *bias = rand_normal(&rng, C, 0.0f, 0.2f);
  float *res_ref = filled(n, GARBAGE), *out_ref = filled(n, GARBAGE);
  float *mean_ref = filled(N, GARBAGE), *rstd_ref = filled(N, GARBAGE);
  dt_cpu_residual_forward(res_ref, a, b, n);
  dt_cpu_layernorm_forward(out_ref, mean_ref, rstd_ref, res_ref, w, bias, N, C);
  for (int alias = 0; alias < 2; alias++) {
    float *res = filled(n, GARBAGE), *out = filled(n, GARBAGE);
    float *mean = filled(N, GARBAGE), *rstd = filled(N, GARBAGE);
    const float *x = a;
    if (alias) {
      memcpy(res, a, n * sizeof(float));
      x = res;
    }
    dt_cpu_residual_layernorm_forward(res, out, mean, rstd, x, b, w, bias, N, C);
    ck_assert_msg(memcmp(res, res_ref, n * sizeof(float)) == 0, "sum (alias %d)", alias);
    ck_assert_msg(memcmp(out, out_ref, n * sizeof(float)) == 0, "out (alias %d)", alias);
    ck_assert_msg(memcmp(mean, mean_ref, N * sizeof(float)) == 0, "mean (alias %d)", alias);
    ck_assert_msg(memcmp(rstd, rstd_ref, N * sizeof(float)) == 0, "rstd (alias %d)", alias);
  }
  /* The table's bf16 entries: the same outputs rounded (the reference's rounding), bit for bit,
   * the statistics and the sum unchanged. */
  const dt_ops_t *ops = dt_ops_cpu();
  dt_device_t *dev = dt_device_cpu();
  float *res = filled(n, GARBAGE), *o16 = filled(n, GARBAGE), *r16 = filled(n, GARBAGE);
  float *mean = filled(N, GARBAGE), *rstd = filled(N, GARBAGE);
  ck_assert_int_eq(ops->layernorm_forward_bf16(dev, o16, mean, rstd, res_ref, w, bias, N, C), 0);
  ck_assert(memcmp(mean, mean_ref, N * sizeof(float)) == 0);
  ck_assert(memcmp(rstd, rstd_ref, N * sizeof(float)) == 0);
  ck_assert_int_eq(
      ops->residual_layernorm_forward_bf16(dev, res, r16, mean, rstd, a, b, w, bias, N, C), 0);
  ck_assert(memcmp(res, res_ref, n * sizeof(float)) == 0);
  ck_assert(memcmp(mean, mean_ref, N * sizeof(float)) == 0);
  for (size_t i = 0; i < n; i++) {
    ck_assert_msg(o16[i] == ref_bf16(out_ref[i]), "layernorm_forward_bf16 [%zu]", i);
    ck_assert_msg(r16[i] == ref_bf16(out_ref[i]), "residual_layernorm_forward_bf16 [%zu]", i);
  }
  tfree_all();
}
END_TEST

/* ---------------------------------------------------------------------------------------------
 * Softmax + cross-entropy
 * ------------------------------------------------------------------------------------------- */

static double ref_ce_loss(const double *x, int V, int target)
{
  double maxv = x[0];
  for (int j = 1; j < V; j++)
    maxv = x[j] > maxv ? x[j] : maxv;
  double sum = 0.0;
  for (int j = 0; j < V; j++)
    sum += exp(x[j] - maxv);
  return log(sum) + maxv - x[target];
}

struct ce_ctx {
  const double *logits;
  const int *targets;
  double dloss;
  int N, V, Vp;
};

/* dloss * sum_i losses[i]: the kernel's dlogits is this objective's gradient */
static double ce_objective(void *p)
{
  struct ce_ctx *e = p;
  double L = 0.0;
  for (int i = 0; i < e->N; i++)
    L += ref_ce_loss(e->logits + (size_t)i * e->Vp, e->V, e->targets[i]);
  return e->dloss * L;
}

static void run_crossentropy(int N, int V, int Vp, float dloss, float offset, uint64_t seed)
{
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  const size_t nl = (size_t)N * Vp;
  /* Padded columns must never be read. Huge rather than NaN: a NaN would slip through the
   * max search (every comparison with it is false), 1e30 would win it and zero the softmax. */
  float *logits = filled(nl, GARBAGE);
  for (int i = 0; i < N; i++) {
    dt_rng_normal(&rng, logits + (size_t)i * Vp, (size_t)V, 0.0f, 2.0f);
    if (i == N - 1) /* a row far from 0: the max must be subtracted */
      for (int j = 0; j < V; j++)
        logits[(size_t)i * Vp + j] += offset;
  }
  int *targets = talloc((size_t)N * sizeof(int));
  for (int i = 0; i < N; i++)
    targets[i] = (int)dt_rng_below(&rng, (uint64_t)V);
  targets[0] = V - 1;
  if (N > 1)
    targets[1] = 0;

  double *logits_d = to_double(logits, nl), *loss_d = dalloc((size_t)N);
  for (size_t i = 0; i < nl; i++) /* the FD runs over valid columns only */
    if ((int)(i % (size_t)Vp) >= V)
      logits_d[i] = 0.0;
  for (int i = 0; i < N; i++)
    loss_d[i] = ref_ce_loss(logits_d + (size_t)i * Vp, V, targets[i]);

  /* dloss = 0: losses only, logits bit-identical afterwards */
  float *work = fcopy(logits, nl), *losses = filled((size_t)N, GARBAGE);
  dt_cpu_crossentropy_forward_backward(losses, work, targets, 0.0f, N, V, Vp);
  CHECK_CLOSE("crossentropy losses (dloss 0)", losses, loss_d, (size_t)N, ACC_RTOL, ACC_ATOL);
  ck_assert_msg(memcmp(work, logits, nl * sizeof(float)) == 0,
                "crossentropy with dloss = 0 modified the logits");

  /* dloss != 0: losses, and dlogits in place with zero padded columns */
  float *losses2 = filled((size_t)N, GARBAGE);
  dt_cpu_crossentropy_forward_backward(losses2, work, targets, dloss, N, V, Vp);
  CHECK_CLOSE("crossentropy losses", losses2, loss_d, (size_t)N, ACC_RTOL, ACC_ATOL);
  struct ce_ctx ctx = {logits_d, targets, (double)dloss, N, V, Vp};
  double *g = fd_gradient(ce_objective, &ctx, logits_d, nl);
  CHECK_CLOSE("crossentropy dlogits", work, g, nl, GRAD_RTOL, GRAD_ATOL);
  for (int i = 0; i < N; i++)
    for (int j = V; j < Vp; j++)
      ck_assert_msg(work[(size_t)i * Vp + j] == 0.0f, "crossentropy dlogits[%d, %d] = %g", i, j,
                    work[(size_t)i * Vp + j]);
  tfree_all();
}

START_TEST(test_crossentropy)
{
  /* N, V, Vp, dloss, offset of the last row, seed */
  run_crossentropy(1, 1, 4, 1.0f, 0.0f, 71);       /* V = 1: loss 0, gradient 0 */
  run_crossentropy(7, 50, 64, 1.0f / 7, 0.0f, 72); /* mean over the rows */
  run_crossentropy(5, 37, 37, 0.37f, 0.0f, 73);    /* no padding */
  run_crossentropy(3, 10, 16, 1.0f, 1000.0f, 74);  /* exp(1000) would overflow */
  run_crossentropy(4, 130, 133, 2.5f, -50.0f, 75);
}
END_TEST

/* The vocabulary-parallel pair against the fused full-vocabulary kernel: the logits split into
 * column slices, the stats of every slice exchanged (here: copied), then each slice finished. */
static void run_crossentropy_vp(int N, int V, int Vp, int parts, float dloss, float offset,
                                uint64_t seed)
{
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  const size_t nl = (size_t)N * Vp;
  const int cols = Vp / parts;
  float *logits = filled(nl, GARBAGE);
  for (int i = 0; i < N; i++) {
    dt_rng_normal(&rng, logits + (size_t)i * Vp, (size_t)V, 0.0f, 2.0f);
    for (int j = 0; j < V; j++)
      logits[(size_t)i * Vp + j] += i == N - 1 ? offset : 0.0f;
  }
  int *targets = talloc((size_t)N * sizeof(int));
  for (int i = 0; i < N; i++)
    targets[i] = (int)dt_rng_below(&rng, (uint64_t)V);
  targets[0] = V - 1;
  float *ref = fcopy(logits, nl), *ref_loss = filled((size_t)N, GARBAGE);
  dt_cpu_crossentropy_forward_backward(ref_loss, ref, targets, dloss, N, V, Vp);

  /* slice r: columns [r*cols, (r+1)*cols) packed with row stride cols + 3 (a padded ldl) */
  const int ldl = cols + 3;
  float *slices = filled((size_t)parts * N * ldl, GARBAGE);
  float *stats = filled((size_t)parts * N * 3, GARBAGE), *loss = filled((size_t)N, GARBAGE);
  for (int r = 0; r < parts; r++) {
    const int lo = r * cols, Vl = DT_MAX(0, DT_MIN(V - lo, cols));
    float *x = slices + (size_t)r * N * ldl;
    for (int i = 0; i < N; i++)
      memcpy(x + (size_t)i * ldl, logits + (size_t)i * Vp + lo, (size_t)cols * sizeof(float));
    dt_cpu_crossentropy_vp_stats(stats + (size_t)r * N * 3, x, targets, lo, N, Vl, ldl);
  }
  for (int r = 0; r < parts; r++) {
    const int lo = r * cols, Vl = DT_MAX(0, DT_MIN(V - lo, cols));
    float *x = slices + (size_t)r * N * ldl;
    dt_cpu_crossentropy_vp_finish(loss, x, stats, parts, targets, lo, dloss, N, Vl, ldl);
    for (int i = 0; i < N && dloss != 0.0f; i++)
      for (int j = 0; j < ldl; j++) {
        float want = j < cols ? ref[(size_t)i * Vp + lo + j] : 0.0f;
        float got = x[(size_t)i * ldl + j];
        ck_assert_msg(fabsf(got - want) <= 1e-6f + 1e-5f * fabsf(want),
                      "vp crossentropy slice %d/%d dlogits[%d, %d] = %.9g, full kernel %.9g", r,
                      parts, i, lo + j, got, want);
      }
  }
  for (int i = 0; i < N; i++)
    ck_assert_msg(fabsf(loss[i] - ref_loss[i]) <= 1e-5f * fabsf(ref_loss[i]) + 1e-6f,
                  "vp crossentropy over %d slices: loss[%d] = %.9g, full kernel %.9g", parts, i,
                  loss[i], ref_loss[i]);
  tfree_all();
}

START_TEST(test_crossentropy_vocab_parallel)
{
  /* N, V, Vp, slices, dloss, offset of the last row, seed */
  run_crossentropy_vp(6, 60, 64, 2, 1.0f / 6, 0.0f, 81);
  run_crossentropy_vp(5, 40, 64, 4, 0.5f, 1000.0f, 82); /* slice 3 holds padding only */
  run_crossentropy_vp(3, 64, 64, 1, 1.0f, -50.0f, 83);
  run_crossentropy_vp(4, 100, 128, 8, 0.0f, 0.0f, 84); /* dloss 0: losses only */
}
END_TEST

/* ---------------------------------------------------------------------------------------------
 * AdamW and sum of squares
 * ------------------------------------------------------------------------------------------- */

static void run_adamw(size_t n, float lr, float beta1, float beta2, float eps, float wd,
                      float grad_scale, uint64_t seed)
{
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  float *p = rand_normal(&rng, n, 0.0f, 1.0f), *m = falloc(n), *v = falloc(n);
  float *g = falloc(n), *p2 = falloc(n), *m2 = falloc(n), *v2 = falloc(n);
  float *p16 = filled(n, GARBAGE);
  double *p_ref = dalloc(n), *m_ref = dalloc(n), *v_ref = dalloc(n);
  double *p_scale = dalloc(n), *m_scale = dalloc(n), *v_scale = dalloc(n);
  static const int steps[] = {1, 2, 3, 10, 1000};
  for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
    const int t = steps[s];
    dt_rng_normal(&rng, g, n, 0.0f, 1.0f);
    for (size_t i = 0; i < n; i += 7) /* a parameter that got no gradient */
      g[i] = 0.0f;
    /* PyTorch's AdamW (adamw.c's comment), in double, from the kernel's current float state */
    const double b1 = beta1, b2 = beta2;
    const double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
    for (size_t i = 0; i < n; i++) {
      double gi = (double)g[i] * grad_scale;
      double pi = (double)p[i] * (1.0 - (double)lr * wd);
      m_ref[i] = b1 * m[i] + (1.0 - b1) * gi;
      v_ref[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
      double denom = sqrt(v_ref[i]) / sqrt(bc2) + eps;
      p_ref[i] = pi - ((double)lr / bc1) * m_ref[i] / denom;
      /* Error scales: m sums two terms that may cancel, so its rounding is relative to their
       * magnitudes; p's is relative to |p| plus the update computed from those magnitudes. */
      m_scale[i] = fabs(b1 * m[i]) + fabs((1.0 - b1) * gi);
      v_scale[i] = v_ref[i];
      p_scale[i] = fabs(pi) + ((double)lr / bc1) * m_scale[i] / denom;
    }
    memcpy(p2, p, n * sizeof *p);
    memcpy(m2, m, n * sizeof *m);
    memcpy(v2, v, n * sizeof *v);
    dt_cpu_adamw_update(p, NULL, g, m, v, n, lr, beta1, beta2, eps, wd, grad_scale, t);
    /* the same update writing the bf16 copy: the same state, and the copy is p rounded */
    dt_cpu_adamw_update(p2, p16, g, m2, v2, n, lr, beta1, beta2, eps, wd, grad_scale, t);
    ck_assert(memcmp(p2, p, n * sizeof *p) == 0);
    ck_assert(memcmp(m2, m, n * sizeof *m) == 0);
    ck_assert(memcmp(v2, v, n * sizeof *v) == 0);
    for (size_t i = 0; i < n; i++)
      ck_assert(p16[i] == ref_bf16(p[i]));
    /* A handful of fp32 roundings each (<= ~10 * 2^-24 = 6e-7 of the scale): 1e-6 for the
     * moments; 1e-5 for p, whose update also carries sqrtf and the bias corrections. */
    CHECK_SCALED("adamw m", m, m_ref, m_scale, n, 1e-6);
    CHECK_SCALED("adamw v", v, v_ref, v_scale, n, 1e-6);
    CHECK_SCALED("adamw param", p, p_ref, p_scale, n, 1e-5);
  }
  tfree_all();
}

START_TEST(test_adamw)
{
  run_adamw(1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1.0f, 81);
  run_adamw(1003, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 82);
  run_adamw(1003, 3e-2f, 0.8f, 0.99f, 1e-6f, 0.01f, 0.37f, 83); /* clipped gradient */
}
END_TEST

static double ref_sum_squares(const float *x, size_t n)
{
  double s = 0.0;
  for (size_t i = 0; i < n; i++)
    s += (double)x[i] * x[i];
  return s;
}

/* Sizes: empty, tiny, several 16384-blocks with a remainder, and more than the 256 blocks of
 * the kernel's stack buffer (its heap path). */
static const size_t k_sumsq_sizes[] = {0, 1, 1003, 5 * 16384 + 77, 257 * 16384 + 3};

START_TEST(test_sum_squares)
{
  for (size_t s = 0; s < sizeof k_sumsq_sizes / sizeof k_sumsq_sizes[0]; s++) {
    const size_t n = k_sumsq_sizes[s];
    dt_rng_t rng;
    dt_rng_seed(&rng, 90 + s);
    float *x = falloc(n);
    for (size_t i = 0; i < n; i++)
      x[i] = 2.0f * dt_rng_uniform(&rng) - 1.0f;
    double got = dt_cpu_sum_squares(x, n), want = ref_sum_squares(x, n);
    /* Both sum exact products (float * float fits a double) in double, in different orders:
     * the worst-case bound n * 2^-53 is 5e-10 relative at the largest n. */
    ck_assert_msg(fabs(got - want) <= 1e-9 * want, "sum_squares(n = %zu) = %.17g, want %.17g", n,
                  got, want);
    tfree_all();
  }
}
END_TEST

/* ---------------------------------------------------------------------------------------------
 * Thread-count independence of the reductions that claim it: bit-identical for 1, 2, 3 threads.
 * ------------------------------------------------------------------------------------------- */

static const int k_threads[] = {1, 2, 3};
#define NTHREADS ((int)(sizeof k_threads / sizeof k_threads[0]))

START_TEST(test_determinism_layernorm)
{
  const int N = 37, C = 200;
  const size_t nx = (size_t)N * C;
  dt_rng_t rng;
  dt_rng_seed(&rng, 101);
  float *inp = rand_normal(&rng, nx, 0.5f, 1.0f), *R = rand_normal(&rng, nx, 0.0f, 1.0f);
  float *w = rand_normal(&rng, (size_t)C, 1.0f, 0.5f), *b = rand_normal(&rng, (size_t)C, 0, 1);
  float *out = falloc(nx), *mean = falloc((size_t)N), *rstd = falloc((size_t)N);
  float *dinp0 = rand_normal(&rng, nx, 0.0f, 1.0f), *dw0 = rand_normal(&rng, (size_t)C, 0, 1);
  float *db0 = rand_normal(&rng, (size_t)C, 0.0f, 1.0f);
  float *dinp[NTHREADS], *dw[NTHREADS], *db[NTHREADS];
  for (int k = 0; k < NTHREADS; k++) {
    set_threads(k_threads[k]);
    dt_cpu_layernorm_forward(out, mean, rstd, inp, w, b, N, C);
    dinp[k] = fcopy(dinp0, nx);
    dw[k] = fcopy(dw0, (size_t)C);
    db[k] = fcopy(db0, (size_t)C);
    dt_cpu_layernorm_backward(dinp[k], dw[k], db[k], R, inp, w, mean, rstd, N, C);
  }
  for (int k = 1; k < NTHREADS; k++) {
    ck_assert_msg(memcmp(dw[k], dw[0], (size_t)C * sizeof(float)) == 0,
                  "layernorm dweight differs with %d threads", k_threads[k]);
    ck_assert_msg(memcmp(db[k], db[0], (size_t)C * sizeof(float)) == 0,
                  "layernorm dbias differs with %d threads", k_threads[k]);
    ck_assert_msg(memcmp(dinp[k], dinp[0], nx * sizeof(float)) == 0,
                  "layernorm dinp differs with %d threads", k_threads[k]);
  }
  tfree_all();
}
END_TEST

START_TEST(test_determinism_matmul_dbias)
{
  const int N = 37, C = 16, OC = 200, ldd = 203;
  dt_rng_t rng;
  dt_rng_seed(&rng, 102);
  float *inp = rand_normal(&rng, (size_t)N * C, 0, 1), *w = rand_normal(&rng, (size_t)OC * C, 0, 1);
  float *dout = strided(rand_normal(&rng, (size_t)N * OC, 0, 1), N, OC, ldd, NAN);
  float *db0 = rand_normal(&rng, (size_t)OC, 0.0f, 1.0f), *dw = falloc((size_t)OC * C);
  float *db[NTHREADS];
  for (int k = 0; k < NTHREADS; k++) {
    set_threads(k_threads[k]);
    db[k] = fcopy(db0, (size_t)OC);
    dt_cpu_matmul_backward(NULL, dw, db[k], dout, inp, w, N, C, OC, ldd);
  }
  for (int k = 1; k < NTHREADS; k++)
    ck_assert_msg(memcmp(db[k], db[0], (size_t)OC * sizeof(float)) == 0,
                  "matmul dbias differs with %d threads", k_threads[k]);
  tfree_all();
}
END_TEST

START_TEST(test_determinism_encoder)
{
  const int B = 3, T = 17, C = 130, V = 5, Vp = 8;
  dt_rng_t rng;
  dt_rng_seed(&rng, 103);
  int *inp = rand_tokens(&rng, B * T, V);
  float *dout = rand_normal(&rng, (size_t)B * T * C, 0.0f, 1.0f);
  float *dwte0 = rand_normal(&rng, (size_t)Vp * C, 0, 1),
        *dwpe0 = rand_normal(&rng, (size_t)T * C, 0, 1);
  float *dwte[NTHREADS], *dwpe[NTHREADS];
  for (int k = 0; k < NTHREADS; k++) {
    set_threads(k_threads[k]);
    dwte[k] = fcopy(dwte0, (size_t)Vp * C);
    dwpe[k] = fcopy(dwpe0, (size_t)T * C);
    dt_cpu_encoder_backward(dwte[k], 0, Vp, dwpe[k], dout, inp, B, T, C);
  }
  for (int k = 1; k < NTHREADS; k++) {
    ck_assert_msg(memcmp(dwte[k], dwte[0], (size_t)Vp * C * sizeof(float)) == 0,
                  "encoder dwte differs with %d threads", k_threads[k]);
    ck_assert_msg(memcmp(dwpe[k], dwpe[0], (size_t)T * C * sizeof(float)) == 0,
                  "encoder dwpe differs with %d threads", k_threads[k]);
  }
  tfree_all();
}
END_TEST

START_TEST(test_determinism_sum_squares)
{
  for (size_t s = 0; s < sizeof k_sumsq_sizes / sizeof k_sumsq_sizes[0]; s++) {
    const size_t n = k_sumsq_sizes[s];
    dt_rng_t rng;
    dt_rng_seed(&rng, 110 + s);
    float *x = falloc(n);
    for (size_t i = 0; i < n; i++)
      x[i] = 2.0f * dt_rng_uniform(&rng) - 1.0f;
    double r[NTHREADS];
    for (int k = 0; k < NTHREADS; k++) {
      set_threads(k_threads[k]);
      r[k] = dt_cpu_sum_squares(x, n);
    }
    for (int k = 1; k < NTHREADS; k++)
      ck_assert_msg(memcmp(&r[k], &r[0], sizeof(double)) == 0,
                    "sum_squares(n = %zu) = %.17g with %d threads, %.17g with 1", n, r[k],
                    k_threads[k], r[0]);
    tfree_all();
  }
}
END_TEST

/* ---------------------------------------------------------------------------------------------
 * The kernel table
 * ------------------------------------------------------------------------------------------- */

/* The CPU device: zeroed aligned allocations, copies in every direction, zeroing and the
 * accumulate the ZeRO reductions use; its kernel table is the CPU one. */
START_TEST(test_device_cpu)
{
  dt_device_t *d = dt_device_cpu();
  ck_assert_str_eq(d->name, "cpu");
  ck_assert_str_eq(d->comm_backend, "cpu");
  ck_assert_ptr_eq(d->ops, dt_ops_cpu());
  ck_assert_int_eq(d->host, 1);
  float *a, *b;
  const size_t n = 1000;
  ck_assert_int_eq(d->alloc(d, n * sizeof(float), "test a", (void **)&a), 0);
  ck_assert_int_eq(d->alloc(d, n * sizeof(float), "test b", (void **)&b), 0);
  ck_assert_uint_eq((uintptr_t)a % 64, 0);
  for (size_t i = 0; i < n; i++) {
    ck_assert(a[i] == 0.0f);
    b[i] = (float)i;
  }
  for (int dir = DT_COPY_H2D; dir <= DT_COPY_D2D; dir++) {
    ck_assert_int_eq(d->zero(d, a, n * sizeof(float)), 0);
    ck_assert_int_eq(d->copy(d, a, b, n * sizeof(float), (dt_copy_dir_t)dir), 0);
    ck_assert_int_eq(memcmp(a, b, n * sizeof(float)), 0);
  }
  ck_assert_int_eq(d->accumulate(d, a, b, n), 0);
  for (size_t i = 0; i < n; i++)
    ck_assert(a[i] == 2.0f * (float)i);
  /* copy_2d: 7 pieces of 5 floats, 9 floats apart in b, 13 apart in a; the gaps untouched */
  for (size_t i = 0; i < n; i++)
    a[i] = -1.0f;
  ck_assert_int_eq(d->copy_2d(d, a + 3, 13 * sizeof(float), b + 2, 9 * sizeof(float),
                              5 * sizeof(float), 7, DT_COPY_D2D),
                   0);
  for (size_t i = 0; i < n; i++) {
    const size_t r = (i - 3) / 13, c = (i - 3) % 13;
    const int in = i >= 3 && r < 7 && c < 5;
    ck_assert_msg(a[i] == (in ? (float)(2 + r * 9 + c) : -1.0f), "a[%zu] = %g", i, a[i]);
  }
  ck_assert_int_eq(d->sync(d), 0);
  /* events: host work is done when queued, so they mark nothing and waiting returns at once */
  void *ev = &ev;
  ck_assert_int_eq(d->event_create(d, &ev), 0);
  ck_assert_int_eq(d->event_record(d, ev), 0);
  ck_assert_int_eq(d->event_wait(d, ev), 0);
  d->event_destroy(d, ev);
  d->event_destroy(d, NULL);
  d->free(d, a);
  d->free(d, b);
  d->free(d, NULL);
}
END_TEST

/* The CPU table: every entry present, and a call through it (with the device, returning 0)
 * gives the reference kernel's result bit for bit. */
START_TEST(test_ops_table)
{
  const dt_ops_t *ops = dt_ops_cpu();
  dt_device_t *dev = dt_device_cpu();
  ck_assert_ptr_nonnull(ops);
  ck_assert_str_eq(ops->name, "cpu");
  const void *entries[] = {(const void *)ops->encoder_forward,
                           (const void *)ops->encoder_backward,
                           (const void *)ops->layernorm_forward,
                           (const void *)ops->residual_layernorm_forward,
                           (const void *)ops->layernorm_forward_bf16,
                           (const void *)ops->residual_layernorm_forward_bf16,
                           (const void *)ops->layernorm_backward,
                           (const void *)ops->layernorm_backward_bf16,
                           (const void *)ops->matmul_forward,
                           (const void *)ops->matmul_backward,
                           (const void *)ops->matmul_forward_bf16,
                           (const void *)ops->matmul_backward_bf16,
                           (const void *)ops->to_bf16,
                           (const void *)ops->attention_forward,
                           (const void *)ops->attention_backward,
                           (const void *)ops->attention_forward_flash,
                           (const void *)ops->attention_backward_flash,
                           (const void *)ops->attention_forward_flash_bf16,
                           (const void *)ops->attention_backward_flash_bf16,
                           (const void *)ops->gelu_forward,
                           (const void *)ops->gelu_backward,
                           (const void *)ops->residual_forward,
                           (const void *)ops->crossentropy_forward_backward,
                           (const void *)ops->crossentropy_forward_backward_bf16,
                           (const void *)ops->crossentropy_vp_stats,
                           (const void *)ops->crossentropy_vp_stats_bf16,
                           (const void *)ops->crossentropy_vp_finish,
                           (const void *)ops->crossentropy_vp_finish_bf16,
                           (const void *)ops->adamw_update,
                           (const void *)ops->sum_squares};
  for (size_t i = 0; i < sizeof entries / sizeof *entries; i++)
    ck_assert_msg(entries[i] != NULL, "cpu table entry %zu missing", i);

  dt_rng_t rng;
  dt_rng_seed(&rng, 5);
  const int N = 6, C = 8, OC = 12;
  float *x = rand_normal(&rng, (size_t)N * C, 0.0f, 1.0f),
        *w = rand_normal(&rng, (size_t)OC * C, 0, 1);
  float *bias = rand_normal(&rng, OC, 0.0f, 1.0f);
  float *a = filled((size_t)N * OC, GARBAGE), *b = filled((size_t)N * OC, GARBAGE);
  dt_cpu_matmul_forward(a, x, w, bias, N, C, OC, OC);
  ck_assert_int_eq(ops->matmul_forward(dev, b, x, w, bias, N, C, OC, OC), 0);
  ck_assert_int_eq(memcmp(a, b, (size_t)N * OC * sizeof(float)), 0);
  dt_cpu_gelu_forward(a, x, (size_t)N * C);
  ck_assert_int_eq(ops->gelu_forward(dev, b, x, (size_t)N * C), 0);
  ck_assert_int_eq(memcmp(a, b, (size_t)N * C * sizeof(float)), 0);
  /* the LayerNorm backward from a bf16 dout: the fp32 entry's, on the same (bf16) values */
  float *lw = rand_normal(&rng, C, 1.0f, 0.1f), *lb = rand_normal(&rng, C, 0.0f, 0.1f);
  float *mean = falloc(N), *rstd = falloc(N), *lo = falloc((size_t)N * C);
  float *g16 = falloc((size_t)N * C);
  dt_cpu_layernorm_forward(lo, mean, rstd, x, lw, lb, N, C);
  dt_cpu_to_bf16(g16, lo, (size_t)N * C);
  float *din[2], *dlw[2], *dlb[2];
  for (int k = 0; k < 2; k++)
    din[k] = filled((size_t)N * C, 0.5f), dlw[k] = filled(C, 0.25f), dlb[k] = filled(C, -1.0f);
  ck_assert_int_eq(
      ops->layernorm_backward(dev, din[0], dlw[0], dlb[0], g16, x, lw, mean, rstd, N, C), 0);
  ck_assert_int_eq(
      ops->layernorm_backward_bf16(dev, din[1], dlw[1], dlb[1], g16, x, lw, mean, rstd, N, C), 0);
  ck_assert_int_eq(memcmp(din[0], din[1], (size_t)N * C * sizeof(float)), 0);
  ck_assert_int_eq(memcmp(dlw[0], dlw[1], (size_t)C * sizeof(float)), 0);
  ck_assert_int_eq(memcmp(dlb[0], dlb[1], (size_t)C * sizeof(float)), 0);
  double s1 = dt_cpu_sum_squares(x, (size_t)N * C), s2 = -1.0;
  ck_assert_int_eq(ops->sum_squares(dev, x, (size_t)N * C, &s2), 0);
  ck_assert(s1 == s2);
  /* The vocabulary-parallel finish, one slice of C of OC columns (x's rows as its logits, ld
   * C + 1 with a padding column): bf16 is the fp32 entry's dlogits rounded, the same losses. */
  const int ld = C + 1, nr = 1, tg[6] = {0, 3, 9, 7, 2, 11};
  float *stats = filled((size_t)N * 3, GARBAGE), *l32 = filled((size_t)N * ld, 0.0f);
  for (int i = 0; i < N; i++)
    memcpy(l32 + (size_t)i * ld, x + (size_t)i * C, C * sizeof(float));
  float *l16 = filled((size_t)N * ld, 0.0f), *loss32 = filled(N, GARBAGE),
        *loss16 = filled(N, GARBAGE);
  memcpy(l16, l32, (size_t)N * ld * sizeof(float));
  dt_cpu_crossentropy_vp_stats(stats, l32, tg, 2, N, C, ld);
  float *stats16 = filled((size_t)N * 3, GARBAGE);
  ck_assert_int_eq(ops->crossentropy_vp_stats_bf16(dev, stats16, l32, tg, 2, N, C, ld), 0);
  ck_assert_int_eq(memcmp(stats, stats16, (size_t)N * 3 * sizeof(float)), 0);
  ck_assert_int_eq(ops->crossentropy_vp_finish(dev, loss32, l32, stats, nr, tg, 2, 0.25f, N, C, ld),
                   0);
  ck_assert_int_eq(
      ops->crossentropy_vp_finish_bf16(dev, loss16, l16, stats, nr, tg, 2, 0.25f, N, C, ld), 0);
  ck_assert_int_eq(memcmp(loss32, loss16, (size_t)N * sizeof(float)), 0);
  dt_cpu_to_bf16(l32, l32, (size_t)N * ld);
  ck_assert_int_eq(memcmp(l32, l16, (size_t)N * ld * sizeof(float)), 0);
  tfree_all();
}
END_TEST

/* ---------------------------------------------------------------------------------------------
 * Suite
 * ------------------------------------------------------------------------------------------- */

static void add_tcase(Suite *s, const char *name, const TTest *test)
{
  TCase *tc = tcase_create(name);
  tcase_set_timeout(tc, TCASE_TIMEOUT_S);
  tcase_add_checked_fixture(tc, NULL, tfree_all);
  tcase_add_test(tc, test);
  suite_add_tcase(s, tc);
}

static Suite *kernels_suite(void)
{
  Suite *s = suite_create("kernels_cpu");
  add_tcase(s, "device_cpu", test_device_cpu);
  add_tcase(s, "encoder", test_encoder);
  add_tcase(s, "encoder_vocab_parallel", test_encoder_vocab_parallel);
  add_tcase(s, "layernorm", test_layernorm);
  add_tcase(s, "matmul", test_matmul);
  add_tcase(s, "matmul_forward_large", test_matmul_forward_large);
  add_tcase(s, "bf16_round", test_bf16_round);
  add_tcase(s, "matmul_bf16", test_matmul_bf16);
  add_tcase(s, "attention", test_attention);
  add_tcase(s, "attention_cp", test_attention_cp);
  add_tcase(s, "attention_flash", test_attention_flash);
  add_tcase(s, "attention_flash_bf16", test_attention_flash_bf16);
  add_tcase(s, "gelu", test_gelu);
  add_tcase(s, "residual", test_residual);
  add_tcase(s, "residual_layernorm", test_residual_layernorm);
  add_tcase(s, "crossentropy", test_crossentropy);
  add_tcase(s, "crossentropy_vocab_parallel", test_crossentropy_vocab_parallel);
  add_tcase(s, "adamw", test_adamw);
  add_tcase(s, "sum_squares", test_sum_squares);
  add_tcase(s, "determinism_layernorm", test_determinism_layernorm);
  add_tcase(s, "determinism_matmul_dbias", test_determinism_matmul_dbias);
  add_tcase(s, "determinism_encoder", test_determinism_encoder);
  add_tcase(s, "determinism_sum_squares", test_determinism_sum_squares);
  add_tcase(s, "ops_table", test_ops_table);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(kernels_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
