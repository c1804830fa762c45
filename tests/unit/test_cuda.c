/* test_cuda.c — the CUDA backend against the CPU backend (label "gpu").
 *
 * Exits 77 (skipped) on a machine without a usable GPU, which CTest reports as skipped. With a
 * GPU, every entry of the CUDA kernel table (dt_ops_cuda() on a dt_device_cuda_create device)
 * runs on the same random inputs as the CPU table (dt_ops_cpu() on dt_device_cpu()), over odd
 * sizes (n not a multiple of the block size, C not a multiple of 32, prime T, a vocabulary
 * slice with vocab_lo > 0, NULL wpe / bias / dinp, row strides wider than the rows), and the
 * outputs must agree. Outputs that are written (=) start from different garbage on the two
 * sides; outputs that accumulate (+=) start from the same random values.
 *
 * The same file runs in CI as test_cuda_on_emul (tests/emul; DT_TEST_EMULATED): the CUDA backend
 * as built for the emulated GPU, its launches as the .cu files issue them (test_cuda_emul and
 * test_flash_emul run the kernels under launches of their own). The two event tests are left out
 * there: they hold a stream with a kernel that spins on host-mapped memory, which the emulation,
 * running a stream's work only when the host waits for it, does not have.
 *
 * Tolerance. Each output tensor must satisfy
 *     max_i |gpu_i - cpu_i| / max(max_i |cpu_i|, 1e-30) <= 1e-5,
 * the error measured against the tensor's scale rather than element by element: the two
 * backends sum in different orders (cuBLAS vs OpenBLAS tiling, block vs serial reductions), so
 * each element carries rounding of the order of fp32 epsilon times the magnitude of the terms
 * summed, and an element that cancels to nearly 0 (a residual sum, a dlogit, a gradient) would
 * show a huge element-wise relative error for an absolute error that is harmless. 1e-5 is about 80
 * fp32 epsilons of the largest value: far above the rounding of these sums, far below any real bug
 * (a missed term, a wrong stride or a wrong sign moves the result by O(1) of the scale). One
 * case is looser, with its reason where it is used: column sums over 40000 rows (test_layernorm).
 * Exact checks where the contract is exact: zeros above the attention diagonal and in padding
 * columns, the vocabulary-parallel stats of an empty slice, AdamW (bit-identical, see below),
 * the device entries, and run-to-run determinism (bit-identical).
 *
 * AdamW must match kernels/cpu/adamw.c bit for bit over several steps: both follow PyTorch's
 * formula operation by operation, each rounded on its own (the CPU build does not contract into
 * FMAs, the kernel uses the _rn intrinsics), and sqrt and division are IEEE on both. (A relative
 * tolerance would not do: parameters that cancel to ~0 turn a one-ulp difference of an
 * intermediate into a large relative one.) */
#include <check.h>
#include <pthread.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "att_close.h"
#include "cpu_kernels.h"
#include "cuda_kernels.h"
#include "device.h"
#include "dt_error.h"
#include "rng.h"
#include "wgmma_tile.h"

#define TOL 1e-5

static dt_device_t *g_gpu; /* the CUDA device, made in main */
static dt_device_t *g_cpu;
static const dt_ops_t *G; /* dt_ops_cuda() */
static const dt_ops_t *H; /* dt_ops_cpu() */
static dt_rng_t g_rng;

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* A tensor on both sides: h the CPU backend's copy, d the CUDA device's. */
typedef struct {
  float *h;
  float *d;
  size_t n;
} pair_t;

typedef struct {
  int *h;
  int *d;
  size_t n;
} ipair_t;

static void *xmalloc(size_t bytes)
{
  void *p = malloc(bytes ? bytes : 1);
  ck_assert_ptr_nonnull(p);
  return p;
}

static void *dev_alloc(size_t bytes)
{
  void *d = NULL;
  ck_assert_int_eq(g_gpu->alloc(g_gpu, bytes, "test tensor", &d), 0);
  ck_assert_ptr_nonnull(d);
  return d;
}

static void to_dev(void *d, const void *h, size_t bytes)
{
  ck_assert_int_eq(g_gpu->copy(g_gpu, d, h, bytes, DT_COPY_H2D), 0);
}

static void to_host(void *h, const void *d, size_t bytes)
{
  ck_assert_int_eq(g_gpu->copy(g_gpu, h, d, bytes, DT_COPY_D2H), 0);
}

static float *host_rand(size_t n, float mean, float std)
{
  float *h = xmalloc(n * sizeof(float));
  dt_rng_normal(&g_rng, h, n, mean, std);
  return h;
}

/* The same random values on both sides (inputs, and outputs that accumulate). */
static pair_t pair_rand(size_t n, float mean, float std)
{
  pair_t p = {host_rand(n, mean, std), dev_alloc(n * sizeof(float)), n};
  to_dev(p.d, p.h, n * sizeof(float));
  return p;
}

/* Different random values on the two sides (outputs that are written: a missed write shows). */
static pair_t pair_garbage(size_t n)
{
  pair_t p = {host_rand(n, 0.0f, 1.0f), dev_alloc(n * sizeof(float)), n};
  float *junk = host_rand(n, 3.0f, 7.0f);
  to_dev(p.d, junk, n * sizeof(float));
  free(junk);
  return p;
}

/* Random ids in [0, hi) on both sides. */
static ipair_t ipair_below(size_t n, int hi)
{
  ipair_t p = {xmalloc(n * sizeof(int)), dev_alloc(n * sizeof(int)), n};
  for (size_t i = 0; i < n; i++)
    p.h[i] = (int)dt_rng_below(&g_rng, (uint64_t)hi);
  to_dev(p.d, p.h, n * sizeof(int));
  return p;
}

static void pair_free(pair_t *p)
{
  free(p->h);
  g_gpu->free(g_gpu, p->d);
  p->h = p->d = NULL;
}

static void ipair_free(ipair_t *p)
{
  free(p->h);
  g_gpu->free(g_gpu, p->d);
  p->h = p->d = NULL;
}

/* The device copy, fetched into a new host buffer. */
static float *fetch(const pair_t *p)
{
  float *g = xmalloc(p->n * sizeof(float));
  to_host(g, p->d, p->n * sizeof(float));
  return g;
}

/* A bf16 activation buffer (ops.h) of n values on each side: the CPU's holds floats, the GPU's
 * bfloat16s. */
typedef struct {
  float *h;
  void *d;
  size_t n;
} pair16_t;

static pair16_t pair16_alloc(size_t n)
{
  ck_assert_uint_eq(H->bf16_bytes, sizeof(float));
  ck_assert_uint_eq(G->bf16_bytes, 2);
  pair16_t p = {xmalloc(n * sizeof(float)), dev_alloc(n * 2), n};
  return p;
}

/* Checks of every element find the first that fails, then assert once: each passing ck_assert
 * records its line for the runner, and one an element (a million at GPT-2's shapes) took longer
 * than the kernels on the emulated GPU, minutes under ASan. */
/* The GPU's bf16 values must be the CPU's, bit for bit, where both rounded the same floats. */
static void expect_bf16_equal(const char *what, const pair16_t *p, const float *want)
{
  uint16_t *g = xmalloc(p->n * sizeof *g);
  to_host(g, p->d, p->n * sizeof *g);
  float v = 0.0f;
  size_t i = 0; /* the first that differs */
  for (; i < p->n; i++) {
    const uint32_t bits = (uint32_t)g[i] << 16;
    memcpy(&v, &bits, sizeof v);
    if (memcmp(&v, &want[i], sizeof v) != 0)
      break;
  }
  ck_assert_msg(i == p->n, "%s [%zu]: %g, want %g", what, i, (double)v,
                (double)want[i < p->n ? i : 0]);
  free(g);
}

/* The device copy of p becomes its host copy's values (bf16 numbers: exact in 16 bits). */
static void pair16_upload(pair16_t *p)
{
  uint16_t *raw = xmalloc(p->n * sizeof *raw);
  for (size_t i = 0; i < p->n; i++) {
    uint32_t bits;
    memcpy(&bits, &p->h[i], sizeof bits);
    raw[i] = (uint16_t)(bits >> 16);
  }
  to_dev(p->d, raw, p->n * sizeof *raw);
  free(raw);
}

static void pair16_free(pair16_t *p)
{
  free(p->h);
  g_gpu->free(g_gpu, p->d);
}

/* max |gpu - cpu| / max(max |cpu|, 1e-30); infinite when the GPU gave a NaN or infinity. */
static double rel_err(const float *gpu, const float *cpu, size_t n)
{
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)gpu[i] - (double)cpu[i]);
    if (isnan(d) || isinf(d))
      return INFINITY;
    worst = d > worst ? d : worst;
    scale = fabs((double)cpu[i]) > scale ? fabs((double)cpu[i]) : scale;
  }
  return worst / (scale > 1e-30 ? scale : 1e-30);
}

/* The device copy of p must match its host copy within tol (see the top of the file). */
static void expect_close_tol(const char *what, const pair_t *p, double tol)
{
  float *g = fetch(p);
  double e = rel_err(g, p->h, p->n);
  ck_assert_msg(e <= tol, "%s: relative error %.3g > %.0e over %zu values", what, e, tol, p->n);
  free(g);
}

/* The device's bf16 values of p as floats. */
static float *fetch16(const pair16_t *p)
{
  uint16_t *raw = xmalloc(p->n * sizeof *raw);
  float *g = xmalloc(p->n * sizeof *g);
  to_host(raw, p->d, p->n * sizeof *raw);
  for (size_t i = 0; i < p->n; i++) {
    const uint32_t bits = (uint32_t)raw[i] << 16;
    memcpy(&g[i], &bits, sizeof bits);
  }
  free(raw);
  return g;
}

/* The same for bf16 values (the GPU's bits as floats against the CPU's bf16 buffer). */
static void expect_bf16_close(const char *what, const pair16_t *p, double tol)
{
  float *g = fetch16(p);
  double e = rel_err(g, p->h, p->n);
  ck_assert_msg(e <= tol, "%s: relative error %.3g > %.0e over %zu values", what, e, tol, p->n);
  free(g);
}

static void expect_close(const char *what, const pair_t *p)
{
  expect_close_tol(what, p, TOL);
}

/* The device copy of p must equal its host copy bit for bit. */
static void expect_equal(const char *what, const pair_t *p)
{
  float *g = fetch(p);
  ck_assert_msg(memcmp(g, p->h, p->n * sizeof(float)) == 0, "%s: device and host differ", what);
  free(g);
}

/* ------------------------------------------------------------------------------------------ */
/* The device                                                                                  */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_device_fields)
{
  ck_assert_str_eq(g_gpu->name, "cuda:0");
  ck_assert_str_eq(g_gpu->comm_backend, "nccl");
  ck_assert_int_eq(g_gpu->host, 0);
  ck_assert_ptr_eq(g_gpu->ops, dt_ops_cuda());
  ck_assert_str_eq(dt_ops_cuda()->name, "cuda");
  ck_assert_int_eq(g_gpu->sync(g_gpu), 0);
  /* memory: what is in use grows by (at least) what we allocate */
  size_t used0, total, used1, total1;
  ck_assert_int_eq(g_gpu->memory(g_gpu, &used0, &total), 0);
  ck_assert(used0 > 0 && used0 <= total);
  const size_t big = (size_t)256 << 20;
  void *p = dev_alloc(big);
  ck_assert_int_eq(g_gpu->memory(g_gpu, &used1, &total1), 0);
  ck_assert_msg(total1 == total && used1 >= used0 + big, "in use %zu then %zu after %zu more",
                used0, used1, big);
  g_gpu->free(g_gpu, p);
}
END_TEST

#ifndef DT_TEST_EMULATED
/* Events (device.h): event_wait waits for the work queued before the record, and for nothing
 * queued after it. A kernel marks host-mapped memory, the event is recorded, then a kernel holds
 * the stream until the host lets it go: the wait must return with the mark set while the hold is
 * still running (were it waiting for the hold too, the hold would give up after ~5 s and say
 * so); then the host lets go, and sync() finds the hold done without giving up. */
int dt_test_cuda_mark(dt_device_t *dev, volatile int *mark);
int dt_test_cuda_hold(dt_device_t *dev, volatile int *go, volatile int *timed_out);

START_TEST(test_device_events)
{
  volatile int *h = NULL; /* mark, go, timed_out: host-mapped, the same address on the GPU */
  ck_assert_int_eq(cudaHostAlloc((void **)&h, 3 * sizeof(int), cudaHostAllocMapped), cudaSuccess);
  h[0] = h[1] = h[2] = 0;
  void *ev = NULL;
  ck_assert_int_eq(g_gpu->event_create(g_gpu, &ev), 0);
  ck_assert_ptr_nonnull(ev);
  ck_assert_int_eq(dt_test_cuda_mark(g_gpu, &h[0]), 0);
  ck_assert_int_eq(g_gpu->event_record(g_gpu, ev), 0);
  ck_assert_int_eq(dt_test_cuda_hold(g_gpu, &h[1], &h[2]), 0);
  ck_assert_int_eq(g_gpu->event_wait(g_gpu, ev), 0);
  ck_assert_int_eq(h[0], 1);
  ck_assert_int_eq(h[2], 0); /* the hold is still running */
  h[1] = 1;
  ck_assert_int_eq(g_gpu->sync(g_gpu), 0);
  ck_assert_int_eq(h[2], 0);
  g_gpu->event_destroy(g_gpu, ev);
  ck_assert_int_eq(cudaFreeHost((void *)h), cudaSuccess);
}
END_TEST

/* Another thread's copies, accumulations and sync (the data-parallel comm thread's) run on the
 * device's side stream: they complete while the compute stream is held, and that thread's GPU is
 * the device's (not the runtime's default GPU 0). With one shared stream, the thread's D2H copy
 * would wait for the hold, which would give up after ~5 s and say so. */
typedef struct {
  dt_device_t *dev;
  float *d;          /* 2 n floats on the device */
  const float *want; /* n floats: what d[n..2n) must hold after d[n..) += d[0..n) */
  size_t n;
  int rc, ordinal_seen;
} side_job_t;

static void *side_thread(void *arg)
{
  side_job_t *j = arg;
  float *back = xmalloc(j->n * sizeof(float));
  j->rc = j->dev->accumulate(j->dev, j->d + j->n, j->d, j->n);
  if (!j->rc)
    j->rc = j->dev->sync(j->dev);
  if (!j->rc)
    j->rc = j->dev->copy(j->dev, back, j->d + j->n, j->n * sizeof(float), DT_COPY_D2H);
  for (size_t i = 0; !j->rc && i < j->n; i++)
    if (back[i] != j->want[i])
      j->rc = -1000;
  if (cudaGetDevice(&j->ordinal_seen) != cudaSuccess)
    j->ordinal_seen = -1;
  free(back);
  return NULL;
}

START_TEST(test_device_side_stream)
{
  const size_t n = 4099;
  float *h = host_rand(2 * n, -1.0f, 1.0f), *want = xmalloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++)
    want[i] = h[n + i] + h[i];
  volatile int *flags = NULL; /* go, timed_out */
  ck_assert_int_eq(cudaHostAlloc((void **)&flags, 2 * sizeof(int), cudaHostAllocMapped),
                   cudaSuccess);
  flags[0] = flags[1] = 0;
  side_job_t j = {g_gpu, NULL, want, n, 0, -1};
  ck_assert_int_eq(g_gpu->alloc(g_gpu, 2 * n * sizeof(float), "test", (void **)&j.d), 0);
  ck_assert_int_eq(g_gpu->copy(g_gpu, j.d, h, 2 * n * sizeof(float), DT_COPY_H2D), 0);
  ck_assert_int_eq(dt_test_cuda_hold(g_gpu, &flags[0], &flags[1]), 0);
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, side_thread, &j), 0);
  ck_assert_int_eq(pthread_join(t, NULL), 0);
  const int held = flags[1] == 0; /* the hold was still running when the thread finished */
  flags[0] = 1;
  ck_assert_int_eq(g_gpu->sync(g_gpu), 0);
  ck_assert_int_eq(j.rc, 0);
  /* compute-sanitizer's memcheck serialises kernels: the hold then times out first (tests/gpu/
   * run.sh sets DT_COMPUTE_SANITIZER=1 for its runs under it) */
  if (getenv("DT_COMPUTE_SANITIZER"))
    printf("test_device_side_stream: under compute-sanitizer, concurrency not checked\n");
  else
    ck_assert_msg(held, "the other thread's work waited for the compute stream");
  ck_assert_int_eq(j.ordinal_seen, 0); /* g_gpu is cuda:0 here; the thread made it current */
  g_gpu->free(g_gpu, j.d);
  ck_assert_int_eq(cudaFreeHost((void *)flags), cudaSuccess);
  free(h);
  free(want);
}
END_TEST

#endif

START_TEST(test_device_memory)
{
  const size_t n = 100003;
  float *h = host_rand(n, 1.0f, 2.0f), *h2 = host_rand(n, -1.0f, 1.0f);
  float *back = xmalloc(n * sizeof(float));

  /* alloc is zeroed, even where a freed buffer full of data was. */
  float *d = dev_alloc(n * sizeof(float));
  to_dev(d, h, n * sizeof(float));
  g_gpu->free(g_gpu, d);
  d = dev_alloc(n * sizeof(float));
  to_host(back, d, n * sizeof(float));
  size_t i = 0;
  while (i < n && back[i] == 0.0f)
    i++;
  ck_assert_msg(i == n, "alloc: [%zu] = %g, not 0", i, back[i < n ? i : 0]);

  /* copy_2d: every third block of 100 floats of h into consecutive blocks, and back out */
  ck_assert_int_eq(g_gpu->copy_2d(g_gpu, d, 100 * sizeof(float), h, 300 * sizeof(float),
                                  100 * sizeof(float), 333, DT_COPY_H2D),
                   0);
  to_host(back, d, 33300 * sizeof(float));
  i = 0;
  while (i < 33300 && back[i] == h[i / 100 * 300 + i % 100])
    i++;
  ck_assert_msg(i == 33300, "copy_2d H2D: [%zu]", i);
  memset(back, 0, n * sizeof(float));
  ck_assert_int_eq(g_gpu->copy_2d(g_gpu, back, 300 * sizeof(float), d, 100 * sizeof(float),
                                  100 * sizeof(float), 333, DT_COPY_D2H),
                   0);
  i = 0;
  while (i < 99900 && back[i] == (i % 300 < 100 ? h[i] : 0.0f))
    i++;
  ck_assert_msg(i == 99900, "copy_2d D2H: [%zu]", i);

  /* H2D, D2D, D2H round trip */
  float *d2 = dev_alloc(n * sizeof(float));
  to_dev(d, h, n * sizeof(float));
  ck_assert_int_eq(g_gpu->copy(g_gpu, d2, d, n * sizeof(float), DT_COPY_D2D), 0);
  to_host(back, d2, n * sizeof(float));
  ck_assert(memcmp(back, h, n * sizeof(float)) == 0);

  /* zero of a middle range */
  ck_assert_int_eq(g_gpu->zero(g_gpu, d2 + 100, 1000 * sizeof(float)), 0);
  to_host(back, d2, n * sizeof(float));
  i = 0;
  while (i < n && back[i] == (i >= 100 && i < 1100 ? 0.0f : h[i]))
    i++;
  ck_assert_msg(i == n, "zero: [%zu] = %g", i, back[i < n ? i : 0]);

  /* accumulate: the same single fp32 add as the host's */
  to_dev(d, h, n * sizeof(float));
  to_dev(d2, h2, n * sizeof(float));
  ck_assert_int_eq(g_gpu->accumulate(g_gpu, d, d2, n), 0);
  to_host(back, d, n * sizeof(float));
  i = 0;
  while (i < n && back[i] == h[i] + h2[i])
    i++;
  ck_assert_msg(i == n, "accumulate: [%zu] = %g, want the host's single add", i,
                back[i < n ? i : 0]);

  /* owns: this device's memory only */
  ck_assert(g_gpu->owns(g_gpu, d));
  ck_assert(g_gpu->owns(g_gpu, d2 + 7));
  ck_assert(!g_gpu->owns(g_gpu, h));
  ck_assert(!g_gpu->owns(g_gpu, NULL));

  /* An impossible allocation fails cleanly, and the device still works afterwards (the
   * failure must not linger in CUDA's last-error state and fail the next launch check). */
  void *huge = (void *)1;
  ck_assert_int_eq(g_gpu->alloc(g_gpu, (size_t)1 << 50, "a test's impossible buffer", &huge),
                   DT_ENOMEM);
  ck_assert_ptr_null(huge);
  ck_assert_int_eq(g_gpu->accumulate(g_gpu, d, d2, n), 0);
  ck_assert_int_eq(g_gpu->sync(g_gpu), 0);

  g_gpu->free(g_gpu, NULL);
  g_gpu->free(g_gpu, d);
  g_gpu->free(g_gpu, d2);
  free(h), free(h2), free(back);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Layers                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static void check_encoder(int B, int T, int C, int V, int vocab_lo, int vocab_n, int with_wpe)
{
  const size_t BT = (size_t)B * T;
  const int maxT = T + 3;
  ipair_t inp = ipair_below(BT, V);
  pair_t wte = pair_rand((size_t)vocab_n * C, 0.0f, 1.0f);
  pair_t wpe = {0};
  if (with_wpe)
    wpe = pair_rand((size_t)maxT * C, 0.0f, 1.0f);
  pair_t out = pair_garbage(BT * C);
  ck_assert_int_eq(
      H->encoder_forward(g_cpu, out.h, inp.h, wte.h, vocab_lo, vocab_n, wpe.h, B, T, C), 0);
  ck_assert_int_eq(
      G->encoder_forward(g_gpu, out.d, inp.d, wte.d, vocab_lo, vocab_n, wpe.d, B, T, C), 0);
  expect_close("encoder_forward out", &out);

  pair_t dout = pair_rand(BT * C, 0.0f, 1.0f);
  pair_t dwte = pair_rand((size_t)vocab_n * C, 0.0f, 1.0f);
  pair_t dwpe = {0};
  if (with_wpe)
    dwpe = pair_rand((size_t)maxT * C, 0.0f, 1.0f);
  ck_assert_int_eq(
      H->encoder_backward(g_cpu, dwte.h, vocab_lo, vocab_n, dwpe.h, dout.h, inp.h, inp.h, B, T, C),
      0);
  ck_assert_int_eq(
      G->encoder_backward(g_gpu, dwte.d, vocab_lo, vocab_n, dwpe.d, dout.d, inp.d, inp.h, B, T, C),
      0);
  expect_equal("encoder_backward dwte", &dwte); /* each sum in the CPU's order: the same bits */
  if (with_wpe)
    expect_equal("encoder_backward dwpe", &dwpe);

  ipair_free(&inp);
  pair_free(&wte), pair_free(&out), pair_free(&dout), pair_free(&dwte);
  if (with_wpe)
    pair_free(&wpe), pair_free(&dwpe);
}

START_TEST(test_encoder)
{
  check_encoder(3, 37, 67, 101, 0, 101, 1);  /* the full table, with positions */
  check_encoder(2, 45, 96, 300, 120, 77, 0); /* a slice, tokens inside and outside it, no wpe */
  check_encoder(4, 64, 300, 50, 0, 50, 1);   /* rows hit many times; channels over two blocks */
  /* Two backward passes queued back to back, each with tokens of its own: the second sorts its
   * tokens while the first one's list may still wait to be copied up (on the emulation it does:
   * its streams run only when the host waits), and must not overwrite it. */
  const int B = 2, T = 40, C = 48, V = 70;
  ipair_t inp[2] = {ipair_below((size_t)B * T, V), ipair_below((size_t)B * T, V)};
  pair_t dout = pair_rand((size_t)B * T * C, 0.0f, 1.0f);
  pair_t dwte[2] = {pair_rand((size_t)V * C, 0.0f, 1.0f), pair_rand((size_t)V * C, 0.0f, 1.0f)};
  for (int k = 0; k < 2; k++) {
    ck_assert_int_eq(
        H->encoder_backward(g_cpu, dwte[k].h, 0, V, NULL, dout.h, inp[k].h, inp[k].h, B, T, C), 0);
    ck_assert_int_eq(
        G->encoder_backward(g_gpu, dwte[k].d, 0, V, NULL, dout.d, inp[k].d, inp[k].h, B, T, C), 0);
  }
  for (int k = 0; k < 2; k++) {
    expect_equal(k ? "second queued encoder_backward" : "first queued encoder_backward", &dwte[k]);
    ipair_free(&inp[k]), pair_free(&dwte[k]);
  }
  pair_free(&dout);
}
END_TEST

/* tol: for the column sums; see test_layernorm. */
static void check_layernorm(int N, int C, double tol)
{
  const size_t NC = (size_t)N * C;
  pair_t inp = pair_rand(NC, 0.5f, 1.5f);
  pair_t weight = pair_rand((size_t)C, 1.0f, 0.2f), bias = pair_rand((size_t)C, 0.0f, 0.2f);
  pair_t out = pair_garbage(NC), mean = pair_garbage((size_t)N), rstd = pair_garbage((size_t)N);
  ck_assert_int_eq(
      H->layernorm_forward(g_cpu, out.h, mean.h, rstd.h, inp.h, weight.h, bias.h, N, C), 0);
  ck_assert_int_eq(
      G->layernorm_forward(g_gpu, out.d, mean.d, rstd.d, inp.d, weight.d, bias.d, N, C), 0);
  expect_close("layernorm_forward out", &out);
  expect_close("layernorm_forward mean", &mean);
  expect_close("layernorm_forward rstd", &rstd);

  /* with the residual add fused in front: res = inp + other, then the LayerNorm of res */
  pair_t other = pair_rand(NC, 0.0f, 1.0f), res = pair_garbage(NC), out2 = pair_garbage(NC);
  pair_t mean2 = pair_garbage((size_t)N), rstd2 = pair_garbage((size_t)N);
  ck_assert_int_eq(H->residual_layernorm_forward(g_cpu, res.h, out2.h, mean2.h, rstd2.h, inp.h,
                                                 other.h, weight.h, bias.h, N, C),
                   0);
  ck_assert_int_eq(G->residual_layernorm_forward(g_gpu, res.d, out2.d, mean2.d, rstd2.d, inp.d,
                                                 other.d, weight.d, bias.d, N, C),
                   0);
  expect_close("residual_layernorm_forward res", &res);
  expect_close("residual_layernorm_forward out", &out2);
  expect_close("residual_layernorm_forward mean", &mean2);
  expect_close("residual_layernorm_forward rstd", &rstd2);
  /* bf16 outputs: the GPU's own fp32 values rounded (the CPU's to_bf16 of them), bit for bit */
  pair16_t o16 = pair16_alloc(NC);
  float *ln_gpu = fetch(&out), *res_ln_gpu = fetch(&out2);
  ck_assert_int_eq(H->to_bf16(g_cpu, o16.h, ln_gpu, NC), 0);
  ck_assert_int_eq(
      G->layernorm_forward_bf16(g_gpu, o16.d, mean.d, rstd.d, inp.d, weight.d, bias.d, N, C), 0);
  expect_bf16_equal("layernorm_forward_bf16", &o16, o16.h);
  ck_assert_int_eq(H->to_bf16(g_cpu, o16.h, res_ln_gpu, NC), 0);
  ck_assert_int_eq(G->residual_layernorm_forward_bf16(g_gpu, res.d, o16.d, mean2.d, rstd2.d, inp.d,
                                                      other.d, weight.d, bias.d, N, C),
                   0);
  expect_bf16_equal("residual_layernorm_forward_bf16", &o16, o16.h);
  free(ln_gpu), free(res_ln_gpu);
  pair16_free(&o16);
  pair_free(&other), pair_free(&res), pair_free(&out2), pair_free(&mean2), pair_free(&rstd2);

  /* The backward takes the CPU's statistics on both sides, so it is tested on its own. */
  to_dev(mean.d, mean.h, (size_t)N * sizeof(float));
  to_dev(rstd.d, rstd.h, (size_t)N * sizeof(float));
  pair_t dout = pair_rand(NC, 0.0f, 1.0f);
  pair_t dinp = pair_rand(NC, 0.0f, 1.0f); /* += */
  pair_t dweight = pair_rand((size_t)C, 0.0f, 1.0f), dbias = pair_rand((size_t)C, 0.0f, 1.0f);
  ck_assert_int_eq(H->layernorm_backward(g_cpu, dinp.h, dweight.h, dbias.h, dout.h, inp.h, weight.h,
                                         mean.h, rstd.h, N, C),
                   0);
  ck_assert_int_eq(G->layernorm_backward(g_gpu, dinp.d, dweight.d, dbias.d, dout.d, inp.d, weight.d,
                                         mean.d, rstd.d, N, C),
                   0);
  expect_close("layernorm_backward dinp", &dinp);
  expect_close_tol("layernorm_backward dweight", &dweight, tol);
  expect_close_tol("layernorm_backward dbias", &dbias, tol);
  /* from a bf16 dout (each side's to_bf16 of dout: the same values), accumulating on */
  pair16_t d16 = pair16_alloc(NC);
  ck_assert_int_eq(H->to_bf16(g_cpu, d16.h, dout.h, NC), 0);
  ck_assert_int_eq(G->to_bf16(g_gpu, d16.d, dout.d, NC), 0);
  expect_bf16_equal("to_bf16 of dout", &d16, d16.h);
  ck_assert_int_eq(H->layernorm_backward_bf16(g_cpu, dinp.h, dweight.h, dbias.h, d16.h, inp.h,
                                              weight.h, mean.h, rstd.h, N, C),
                   0);
  ck_assert_int_eq(G->layernorm_backward_bf16(g_gpu, dinp.d, dweight.d, dbias.d, d16.d, inp.d,
                                              weight.d, mean.d, rstd.d, N, C),
                   0);
  expect_close("layernorm_backward_bf16 dinp", &dinp);
  expect_close_tol("layernorm_backward_bf16 dweight", &dweight, tol);
  expect_close_tol("layernorm_backward_bf16 dbias", &dbias, tol);
  pair16_free(&d16);

  pair_free(&inp), pair_free(&weight), pair_free(&bias), pair_free(&out), pair_free(&mean);
  pair_free(&rstd), pair_free(&dout), pair_free(&dinp), pair_free(&dweight), pair_free(&dbias);
}

START_TEST(test_layernorm)
{
  check_layernorm(77, 67, TOL);   /* a partial row chunk, C not a multiple of 32 */
  check_layernorm(300, 768, TOL); /* GPT-2 small's width */
  check_layernorm(4099, 64, TOL); /* many row chunks */
  /* The fused backward's shared memory (2 C floats a warp) past 48 KiB: 3 of its 4 warps fit an
   * H100's 227 KiB at 8000 channels; at 29100 not one does (the two kernels apart run). */
  check_layernorm(37, 8000, TOL);
  check_layernorm(5, 29100, TOL);
  /* More rows per chunk than the minimum (the chunk count is capped). The CPU reference sums
   * 40000 rows serially in fp32, which alone carries a relative error of a few 1e-6 (about
   * u * sqrt(N) for unit roundoff u): the column sums get 1e-4, still far below a lost chunk. */
  check_layernorm(40000, 40, 1e-4);
}
END_TEST

/* bf16: the matmul_*_bf16 entries on inp's bf16 values (each side's to_bf16 of the same inp,
 * the GPU's bits equal to the CPU's), whose other operands both sides round to bf16 alike, so
 * only the order of the fp32 sums differs, as in fp32. */
static void check_matmul(int N, int C, int OC, int ld, int with_bias, int with_dinp, int bf16)
{
  pair_t inp = pair_rand((size_t)N * C, 0.0f, 1.0f);
  pair16_t in16 = {0};
  if (bf16) {
    in16 = pair16_alloc(inp.n);
    ck_assert_int_eq(H->to_bf16(g_cpu, in16.h, inp.h, inp.n), 0);
    ck_assert_int_eq(G->to_bf16(g_gpu, in16.d, inp.d, inp.n), 0);
    expect_bf16_equal("to_bf16", &in16, in16.h);
  }
  pair_t weight = pair_rand((size_t)OC * C, 0.0f, 0.1f);
  pair_t bias = {0};
  if (with_bias)
    bias = pair_rand((size_t)OC, 0.0f, 1.0f);
  /* Columns [OC, ld) must be left alone: the same values on both sides, compared at the end. */
  pair_t out = pair_rand((size_t)N * ld, 5.0f, 1.0f);
  if (bf16) {
    ck_assert_int_eq(H->matmul_forward_bf16(g_cpu, out.h, 0, in16.h, weight.h, NULL, bias.h, NULL,
                                            NULL, N, C, OC, ld),
                     0);
    ck_assert_int_eq(G->matmul_forward_bf16(g_gpu, out.d, 0, in16.d, weight.d, NULL, bias.d, NULL,
                                            NULL, N, C, OC, ld),
                     0);
    /* into a bf16 output (the qkv layer's, rows OC apart; the LM head's, ld apart): the fp32
     * results rounded as cuBLASLt stores them; within two bf16 steps of the largest value (the
     * sums' order may move a value across a rounding boundary); columns past OC left alone */
    for (int ldo = OC; ldo <= ld; ldo += ld > OC ? ld - OC : 1) {
      pair16_t o16 = pair16_alloc((size_t)N * ldo);
      for (size_t i = 0; i < o16.n; i++)
        o16.h[i] = 5.0f;
      pair16_upload(&o16);
      ck_assert_int_eq(H->matmul_forward_bf16(g_cpu, o16.h, 1, in16.h, weight.h, NULL, bias.h, NULL,
                                              NULL, N, C, OC, ldo),
                       0);
      ck_assert_int_eq(G->matmul_forward_bf16(g_gpu, o16.d, 1, in16.d, weight.d, NULL, bias.d, NULL,
                                              NULL, N, C, OC, ldo),
                       0);
      expect_bf16_close("matmul_forward_bf16 into bf16", &o16, 8e-3);
      if (ldo % 8 == 0) {
        /* with the GELU (the fc layer's): the pre-activation as above and its GELU from the
         * fp32 value, cuBLASLt's GELU_AUX_BIAS epilogue (GELU_AUX without a bias), whose GELU
         * input needs a leading dimension that is a multiple of 8 (else the product falls back) */
        pair16_t g16 = pair16_alloc(o16.n);
        for (size_t i = 0; i < o16.n; i++)
          o16.h[i] = 5.0f, g16.h[i] = 5.0f;
        pair16_upload(&o16), pair16_upload(&g16);
        ck_assert_int_eq(H->matmul_forward_bf16(g_cpu, o16.h, 1, in16.h, weight.h, NULL, bias.h,
                                                NULL, g16.h, N, C, OC, ldo),
                         0);
        ck_assert_int_eq(G->matmul_forward_bf16(g_gpu, o16.d, 1, in16.d, weight.d, NULL, bias.d,
                                                NULL, g16.d, N, C, OC, ldo),
                         0);
        expect_bf16_close("matmul_forward_bf16 into bf16 beside its GELU", &o16, 8e-3);
        expect_bf16_close("matmul_forward_bf16's GELU", &g16, 8e-3);
        pair16_free(&g16);
      }
      pair16_free(&o16);
    }
    /* with a residual (the projections' under bf16 at tp 1): res + the product, the GEMM's C
     * input on the GPU; columns past OC left alone */
    pair_t res = pair_rand((size_t)N * ld, 0.0f, 1.0f), sum = pair_rand((size_t)N * ld, 5.0f, 1.0f);
    ck_assert_int_eq(H->matmul_forward_bf16(g_cpu, sum.h, 0, in16.h, weight.h, NULL, bias.h, res.h,
                                            NULL, N, C, OC, ld),
                     0);
    ck_assert_int_eq(G->matmul_forward_bf16(g_gpu, sum.d, 0, in16.d, weight.d, NULL, bias.d, res.d,
                                            NULL, N, C, OC, ld),
                     0);
    expect_close("matmul_forward_bf16 + residual", &sum);
    expect_equal("matmul_forward_bf16's residual unchanged", &res);
    pair_free(&res), pair_free(&sum);
  } else {
    ck_assert_int_eq(H->matmul_forward(g_cpu, out.h, inp.h, weight.h, bias.h, N, C, OC, ld), 0);
    ck_assert_int_eq(G->matmul_forward(g_gpu, out.d, inp.d, weight.d, bias.d, N, C, OC, ld), 0);
  }
  expect_close("matmul_forward out", &out);

  pair_t dout = pair_rand((size_t)N * ld, 0.0f, 1.0f);
  pair_t dinp = {0};
  if (with_dinp)
    dinp = pair_garbage((size_t)N * C);
  pair_t dweight = pair_rand((size_t)OC * C, 0.0f, 1.0f);
  pair_t dbias = {0};
  if (with_bias)
    dbias = pair_rand((size_t)OC, 0.0f, 1.0f);
  if (bf16) {
    ck_assert_int_eq(H->matmul_backward_bf16(g_cpu, dinp.h, 0, dweight.h, dbias.h, dout.h, NULL,
                                             in16.h, weight.h, NULL, NULL, N, C, OC, ld),
                     0);
    ck_assert_int_eq(G->matmul_backward_bf16(g_gpu, dinp.d, 0, dweight.d, dbias.d, dout.d, NULL,
                                             in16.d, weight.d, NULL, NULL, N, C, OC, ld),
                     0);
  } else {
    ck_assert_int_eq(H->matmul_backward(g_cpu, dinp.h, dweight.h, dbias.h, dout.h, inp.h, weight.h,
                                        N, C, OC, ld),
                     0);
    ck_assert_int_eq(G->matmul_backward(g_gpu, dinp.d, dweight.d, dbias.d, dout.d, inp.d, weight.d,
                                        N, C, OC, ld),
                     0);
  }
  if (with_dinp)
    expect_close("matmul_backward dinp", &dinp);
  expect_close("matmul_backward dweight", &dweight);
  if (with_bias)
    expect_close("matmul_backward dbias", &dbias);
  if (bf16 && with_dinp && C % 8 == 0) {
    /* dinp through a GELU of a bf16 pre-activation (the MLP projection's), into bf16:
     * cuBLASLt's DGELU epilogue, whose GELU input needs a leading dimension that is a multiple
     * of 8 (else the product falls back); within two bf16 steps of the largest value */
    pair_t x = pair_rand(inp.n, 0.0f, 1.5f);
    pair16_t x16 = pair16_alloc(inp.n), dx = pair16_alloc(inp.n);
    ck_assert_int_eq(H->to_bf16(g_cpu, x16.h, x.h, x.n), 0);
    ck_assert_int_eq(G->to_bf16(g_gpu, x16.d, x.d, x.n), 0);
    pair_t dwx = pair_rand((size_t)OC * C, 0.0f, 1.0f);
    ck_assert_int_eq(H->matmul_backward_bf16(g_cpu, dx.h, 1, dwx.h, NULL, dout.h, NULL, in16.h,
                                             weight.h, NULL, x16.h, N, C, OC, ld),
                     0);
    ck_assert_int_eq(G->matmul_backward_bf16(g_gpu, dx.d, 1, dwx.d, NULL, dout.d, NULL, in16.d,
                                             weight.d, NULL, x16.d, N, C, OC, ld),
                     0);
    expect_bf16_close("matmul_backward_bf16 dinp through the GELU", &dx, 8e-3);
    expect_close("matmul_backward_bf16 dweight beside the GELU", &dwx);
    pair_free(&x), pair16_free(&x16), pair16_free(&dx), pair_free(&dwx);
  }
  if (bf16 && with_bias && with_dinp && OC % 2 == 0) {
    /* a gradient in bf16 only (the fc layer's, as the GELU's backward wrote it): no fp32 dout,
     * dout16 contiguous (ldd = OC * bf16_bytes / 4), dbias the sums of its values */
    pair_t g = pair_rand((size_t)N * OC, 0.0f, 1.0f), di = pair_garbage((size_t)N * C);
    pair_t dw = pair_rand((size_t)OC * C, 0.0f, 1.0f), db = pair_rand((size_t)OC, 0.0f, 1.0f);
    pair16_t g16 = pair16_alloc(g.n);
    ck_assert_int_eq(H->to_bf16(g_cpu, g16.h, g.h, g.n), 0);
    ck_assert_int_eq(G->to_bf16(g_gpu, g16.d, g.d, g.n), 0);
    ck_assert_int_eq(H->matmul_backward_bf16(g_cpu, di.h, 0, dw.h, db.h, NULL, g16.h, in16.h,
                                             weight.h, NULL, NULL, N, C, OC, OC),
                     0);
    ck_assert_int_eq(G->matmul_backward_bf16(g_gpu, di.d, 0, dw.d, db.d, NULL, g16.d, in16.d,
                                             weight.d, NULL, NULL, N, C, OC, OC / 2),
                     0);
    expect_close("matmul_backward_bf16 dinp from a bf16 gradient", &di);
    /* into a bf16 dinp (dinp16: a LayerNorm's output gradient at tp 1) */
    pair16_t di16 = pair16_alloc(di.n);
    ck_assert_int_eq(H->matmul_backward_bf16(g_cpu, di16.h, 1, dw.h, NULL, NULL, g16.h, in16.h,
                                             weight.h, NULL, NULL, N, C, OC, OC),
                     0);
    ck_assert_int_eq(G->matmul_backward_bf16(g_gpu, di16.d, 1, dw.d, NULL, NULL, g16.d, in16.d,
                                             weight.d, NULL, NULL, N, C, OC, OC / 2),
                     0);
    expect_bf16_close("matmul_backward_bf16 dinp into bf16", &di16, 8e-3);
    pair16_free(&di16);
    expect_close("matmul_backward_bf16 dweight from a bf16 gradient", &dw);
    expect_close("matmul_backward_bf16 dbias, the bf16 gradient's sums", &db);
    pair_free(&g), pair_free(&di), pair_free(&dw), pair_free(&db), pair16_free(&g16);
  }
  if (bf16 && !with_bias) {
    /* dout's bf16 values given, in dout's bytes (rows 2 ld values apart), and the weight's (the
     * model's bf16 weight copy), the fp32 weight then unread (NULL) */
    float *r = xmalloc(dout.n * sizeof(float));
    uint16_t *raw = xmalloc(dout.n * sizeof(float));
    ck_assert_int_eq(H->to_bf16(g_cpu, r, dout.h, dout.n), 0);
    for (size_t i = 0; i < (size_t)N; i++)
      for (size_t c = 0; c < (size_t)ld; c++) {
        uint32_t bits;
        memcpy(&bits, &r[i * ld + c], sizeof bits);
        raw[i * 2 * ld + c] = (uint16_t)(bits >> 16); /* exact: r holds bf16 values */
      }
    void *d16 = dev_alloc(dout.n * sizeof(float));
    to_dev(d16, raw, dout.n * sizeof(float));
    pair16_t w16 = pair16_alloc(weight.n);
    ck_assert_int_eq(G->to_bf16(g_gpu, w16.d, weight.d, weight.n), 0);
    pair_t dw2 = pair_rand((size_t)OC * C, 0.0f, 1.0f), di2 = pair_garbage((size_t)N * C);
    ck_assert_int_eq(H->matmul_backward_bf16(g_cpu, di2.h, 0, dw2.h, NULL, dout.h, NULL, in16.h,
                                             weight.h, NULL, NULL, N, C, OC, ld),
                     0);
    ck_assert_int_eq(G->matmul_backward_bf16(g_gpu, di2.d, 0, dw2.d, NULL, NULL, d16, in16.d, NULL,
                                             w16.d, NULL, N, C, OC, ld),
                     0);
    expect_close("matmul_backward_bf16 dinp from dout16 and weight16", &di2);
    expect_close("matmul_backward_bf16 dweight from dout16", &dw2);
    pair_t out2 = pair_rand((size_t)N * ld, 5.0f, 1.0f);
    ck_assert_int_eq(H->matmul_forward_bf16(g_cpu, out2.h, 0, in16.h, weight.h, NULL, NULL, NULL,
                                            NULL, N, C, OC, ld),
                     0);
    ck_assert_int_eq(G->matmul_forward_bf16(g_gpu, out2.d, 0, in16.d, NULL, w16.d, NULL, NULL, NULL,
                                            N, C, OC, ld),
                     0);
    expect_close("matmul_forward_bf16 from weight16", &out2);
    free(r), free(raw), g_gpu->free(g_gpu, d16), pair_free(&dw2), pair_free(&di2);
    pair_free(&out2), pair16_free(&w16);
  }

  pair_free(&inp), pair_free(&weight), pair_free(&out), pair_free(&dout), pair_free(&dweight);
  if (bf16)
    pair16_free(&in16);
  if (with_bias)
    pair_free(&bias), pair_free(&dbias);
  if (with_dinp)
    pair_free(&dinp);
}

/* The products (each epilogue, in fp32 and bf16), then with N > 0 GPT-2's two at N tokens. */
static void check_matmuls(int N)
{
  for (int bf16 = 0; bf16 <= 1; bf16++) {
    check_matmul(75, 67, 45, 50, 1, 1, bf16);     /* row stride wider than OC, bias, dinp */
    check_matmul(33, 64, 96, 96, 0, 0, bf16);     /* no bias, no dinp */
    check_matmul(257, 200, 600, 600, 1, 1, bf16); /* N just over a block, larger K */
    if (N > 0) {
      check_matmul(N, 768, 2304, 2304, 1, 1, bf16); /* GPT-2's qkv */
      check_matmul(N, 3072, 768, 768, 1, 1, bf16);  /* GPT-2's MLP projection */
    }
  }
}

/* On cuBLASLt, with its bias, GELU and GELU-gradient epilogues: no product may have fallen back to
 * cuBLAS (the trainer would still be right, but slower, and this is where it shows). */
START_TEST(test_matmul)
{
  check_matmuls(256);
  ck_assert_msg(dt_cuda_lt_fallbacks(g_gpu) == 0,
                "%ld linear-layer products fell back from cuBLASLt to cuBLAS (see the WARN line)",
                dt_cuda_lt_fallbacks(g_gpu));
}
END_TEST

/* A second device opened with the switch var set to `on`: first refused with var set to the
 * invalid value bad (nothing opened), var unset again after. */
static dt_device_t *device_with(const char *var, const char *bad, const char *on)
{
  dt_device_t *dev = NULL;
  setenv(var, bad, 1);
  ck_assert_int_eq(dt_device_cuda_create(0, &dev), DT_EINVAL);
  ck_assert_ptr_null(dev);
  setenv(var, on, 1);
  ck_assert_int_eq(dt_device_cuda_create(0, &dev), 0);
  unsetenv(var);
  return dev;
}

/* The same products on cuBLAS (DISTRAIN_CUDA_CUBLASLT=0: the bias seeded by a pass of its own,
 * the GELU and its derivative applied by another),
 * the path a product takes when cuBLASLt has no algorithm for it; a bad value is refused. A bf16
 * output is made there in fp32 blocks of columns, here of 8 KiB: the 45-row LM-head-like
 * output (ld 50) in blocks of 45 columns, 2304 rows one column at a time; the staging stays in
 * one 1 MiB granule (the whole qkv product would take 3). GPT-2's products at 40 tokens: 40 blocks
 * of one column where 256 took 256 (83 s of 119 on the emulated GPU under ASan), the same cases. */
START_TEST(test_matmul_cublas)
{
  dt_device_t *lt = g_gpu, *plain = device_with("DISTRAIN_CUDA_CUBLASLT", "yes", "0");
  dt_cuda_set_stage_max(plain, 8 << 10);
  g_gpu = plain;
  check_matmuls(40);
  g_gpu = lt;
  ck_assert_int_eq(dt_cuda_lt_fallbacks(plain), 0);
  ck_assert_msg(dt_cuda_stage_bytes(plain) > 0 && dt_cuda_stage_bytes(plain) <= (1 << 20),
                "bf16 outputs staged in %zu bytes", dt_cuda_stage_bytes(plain));
  dt_device_cuda_destroy(plain);
}
END_TEST

/* The same products with DISTRAIN_CUDA_GEMM_TUNE=1: each kind's algorithm is chosen by timing
 * cuBLASLt's candidates on its first product, whose timing runs must leave every output as the
 * product alone leaves it (dweight accumulates in place: those runs write a scratch matrix; the
 * forward's residual C is read, not written); a bad value is refused. */
START_TEST(test_matmul_tuned)
{
  dt_device_t *lt = g_gpu, *tuned = device_with("DISTRAIN_CUDA_GEMM_TUNE", "2", "1");
  g_gpu = tuned;
  check_matmuls(0);
  g_gpu = lt;
  long timed = 0, untuned = -1;
  const long kinds = dt_cuda_lt_tuned(tuned, &timed, &untuned);
  ck_assert_int_eq(dt_cuda_lt_fallbacks(tuned), 0);
  /* each tuned kind had two candidates or more (the emulated cuBLASLt offers three); none was
   * left untimed (the in-place dweight's among them, timed on a scratch output) */
  ck_assert_msg(kinds > 0 && timed > kinds && untuned == 0,
                "%ld kinds tuned, %ld candidates timed, %ld kinds not tuned", kinds, timed,
                untuned);
  ck_assert_int_eq(dt_cuda_lt_tuned(lt, NULL, NULL), 0);
  dt_device_cuda_destroy(tuned);
}
END_TEST

static void check_attention(int B, int T, int C, int NH)
{
  const size_t BT = (size_t)B * T, att_n = (size_t)B * NH * T * T;
  pair_t qkv = pair_rand(BT * 3 * C, 0.0f, 1.0f);
  pair_t out = pair_garbage(BT * C), att = pair_garbage(att_n);
  ck_assert_int_eq(H->attention_forward(g_cpu, out.h, att.h, qkv.h, B, T, C, NH), 0);
  ck_assert_int_eq(G->attention_forward(g_gpu, out.d, att.d, qkv.d, B, T, C, NH), 0);
  expect_close("attention_forward out", &out);
  expect_close("attention_forward att", &att);
  float *g = fetch(&att);
  const size_t TT = (size_t)T * T, n = B * NH * TT; /* (m, t, j) = i / TT, i % TT / T, i % T */
  size_t i = 0;
  while (i < n && (i % T <= i % TT / T || g[i] == 0.0f))
    i++;
  ck_assert_msg(i == n, "att[%zu][%zu][%zu] = %g above the diagonal", i / TT, i % TT / T, i % T,
                g[i < n ? i : 0]);
  free(g);

  /* The backward takes the CPU's probabilities on both sides. */
  to_dev(att.d, att.h, att_n * sizeof(float));
  pair_t dout = pair_rand(BT * C, 0.0f, 1.0f);
  pair_t dqkv = pair_garbage(BT * 3 * C), scratch = pair_garbage(att_n);
  ck_assert_int_eq(
      H->attention_backward(g_cpu, dqkv.h, scratch.h, dout.h, qkv.h, att.h, B, T, C, NH), 0);
  ck_assert_int_eq(
      G->attention_backward(g_gpu, dqkv.d, scratch.d, dout.d, qkv.d, att.d, B, T, C, NH), 0);
  expect_close("attention_backward dqkv", &dqkv);

  pair_free(&qkv), pair_free(&out), pair_free(&att), pair_free(&dout), pair_free(&dqkv);
  pair_free(&scratch);
}

/* Context parallelism: chunk r's queries of a sequence of T positions split in cp chunks. The
 * rows of dqkv a chunk does not own start equal on both sides and must stay so. */
static void check_attention_cp(int B, int T, int C, int NH, int cp)
{
  const int Tq = T / cp;
  pair_t qkv = pair_rand((size_t)B * T * 3 * C, 0.0f, 1.0f);
  for (int r = 0; r < cp; r++) {
    const int q0 = r * Tq, Tk = q0 + Tq;
    const size_t BQ = (size_t)B * Tq, att_n = (size_t)B * NH * Tq * Tk;
    pair_t out = pair_garbage(BQ * C), att = pair_garbage(att_n);
    ck_assert_int_eq(H->attention_forward_cp(g_cpu, out.h, att.h, qkv.h, B, Tq, q0, T, C, NH), 0);
    ck_assert_int_eq(G->attention_forward_cp(g_gpu, out.d, att.d, qkv.d, B, Tq, q0, T, C, NH), 0);
    expect_close("attention_forward_cp out", &out);
    expect_close("attention_forward_cp att", &att);
    to_dev(att.d, att.h, att_n * sizeof(float));
    pair_t dout = pair_rand(BQ * C, 0.0f, 1.0f),
           dqkv = pair_rand((size_t)B * T * 3 * C, 0.0f, 1.0f);
    pair_t scratch = pair_garbage(att_n);
    ck_assert_int_eq(H->attention_backward_cp(g_cpu, dqkv.h, scratch.h, dout.h, qkv.h, att.h, B, Tq,
                                              q0, T, C, NH),
                     0);
    ck_assert_int_eq(G->attention_backward_cp(g_gpu, dqkv.d, scratch.d, dout.d, qkv.d, att.d, B, Tq,
                                              q0, T, C, NH),
                     0);
    expect_close("attention_backward_cp dqkv", &dqkv);
    pair_free(&out), pair_free(&att), pair_free(&dout), pair_free(&dqkv), pair_free(&scratch);
  }
  pair_free(&qkv);
}

/* Flash attention, chunk by chunk as context parallelism runs it (cp = 1: the whole sequence):
 * out and lse against the CPU's flash kernels, and the backward, which adds, from the same
 * random dqkv on both sides (rows a chunk does not own must stay equal). bf16: the
 * _flash_bf16 entries (tensor cores), whose rounding the CPU's follow (ops.h), from a zero dqkv
 * so that the error is the gradients' own, checked by expect_att_close. */

/* bf16 attention against the CPU's: att_close.h's rule. */
static void expect_att_close(const char *what, const float *gpu, const float *cpu, size_t n)
{
  double l2, worst;
  ck_assert_msg(att_close(gpu, cpu, n, &l2, &worst),
                "%s: relative L2 error %.3g (at most %.0e), largest error %.3g of the largest "
                "value (at most %.0e), over %zu values",
                what, l2, ATT_L2_TOL, worst, ATT_MAX_TOL, n);
}

static void check_attention_flash(int B, int T, int C, int NH, int cp, int bf16)
{
  const int Tq = T / cp;
  pair_t qkv = pair_rand((size_t)B * T * 3 * C, 0.0f, 1.0f);
  pair16_t qkv16 = {0}; /* bf16: the entries' q, k, v, each side's to_bf16 of qkv (equal bits) */
  if (bf16) {
    qkv16 = pair16_alloc(qkv.n);
    ck_assert_int_eq(H->to_bf16(g_cpu, qkv16.h, qkv.h, qkv.n), 0);
    ck_assert_int_eq(G->to_bf16(g_gpu, qkv16.d, qkv.d, qkv.n), 0);
    expect_bf16_equal("to_bf16 of qkv", &qkv16, qkv16.h);
  }
  for (int r = 0; r < cp; r++) {
    const int q0 = r * Tq;
    const size_t BQ = (size_t)B * Tq;
    pair_t out = pair_garbage(BQ * C), lse = pair_garbage((size_t)B * NH * Tq);
    pair16_t out16 = {0}; /* bf16: the output in bf16 (the attention projection's input) */
    if (bf16) {
      out16 = pair16_alloc(BQ * C);
      ck_assert_int_eq(
          H->attention_forward_flash_bf16(g_cpu, out16.h, lse.h, qkv16.h, B, Tq, q0, T, C, NH), 0);
      ck_assert_int_eq(
          G->attention_forward_flash_bf16(g_gpu, out16.d, lse.d, qkv16.d, B, Tq, q0, T, C, NH), 0);
      float *g = fetch16(&out16);
      expect_att_close("attention_forward_flash_bf16 out", g, out16.h, out16.n);
      free(g);
    } else {
      ck_assert_int_eq(H->attention_forward_flash(g_cpu, out.h, lse.h, qkv.h, B, Tq, q0, T, C, NH),
                       0);
      ck_assert_int_eq(G->attention_forward_flash(g_gpu, out.d, lse.d, qkv.d, B, Tq, q0, T, C, NH),
                       0);
      expect_close("attention_forward_flash out", &out);
    }
    expect_close("attention_forward_flash lse", &lse);
    /* The backward takes the CPU's out (bf16: its bf16 one) and lse on both sides. */
    const void *out_h = out.h, *out_d = out.d;
    if (bf16) {
      pair16_upload(&out16);
      out_h = out16.h, out_d = out16.d;
    } else {
      to_dev(out.d, out.h, out.n * sizeof(float));
    }
    to_dev(lse.d, lse.h, lse.n * sizeof(float));
    /* context parallelism's chunks add into dqkv; the whole sequence writes all of it (over
     * garbage: an element not written fails) */
    const int add = cp > 1;
    pair_t dout = pair_rand(BQ * C, 0.0f, 1.0f),
           dqkv = add ? pair_rand((size_t)B * T * 3 * C, 0.0f, bf16 ? 0.0f : 1.0f)
                      : pair_garbage((size_t)B * T * 3 * C);
    if (bf16) {
      ck_assert_int_eq(H->attention_backward_flash_bf16(g_cpu, dqkv.h, 0, dout.h, 0, qkv16.h, out_h,
                                                        lse.h, B, Tq, q0, T, C, NH, add),
                       0);
      ck_assert_int_eq(G->attention_backward_flash_bf16(g_gpu, dqkv.d, 0, dout.d, 0, qkv16.d, out_d,
                                                        lse.d, B, Tq, q0, T, C, NH, add),
                       0);
    } else {
      ck_assert_int_eq(H->attention_backward_flash(g_cpu, dqkv.h, dout.h, qkv.h, out.h, lse.h, B,
                                                   Tq, q0, T, C, NH, add),
                       0);
      ck_assert_int_eq(G->attention_backward_flash(g_gpu, dqkv.d, dout.d, qkv.d, out.d, lse.d, B,
                                                   Tq, q0, T, C, NH, add),
                       0);
    }
    if (bf16) {
      float *g = fetch(&dqkv);
      expect_att_close("attention_backward_flash_bf16 dqkv", g, dqkv.h, dqkv.n);
      free(g);
    } else {
      expect_close("attention_backward_flash dqkv", &dqkv);
    }
    if (bf16 && !add) { /* into bf16 (dqkv16): the CPU's its fp32 gradients rounded, bit for bit;
                         * the GPU's within two bf16 steps of the largest */
      pair16_t d16 = pair16_alloc(dqkv.n);
      float *want = xmalloc(dqkv.n * sizeof(float));
      ck_assert_int_eq(H->to_bf16(g_cpu, want, dqkv.h, dqkv.n), 0);
      ck_assert_int_eq(H->attention_backward_flash_bf16(g_cpu, d16.h, 1, dout.h, 0, qkv16.h, out_h,
                                                        lse.h, B, Tq, q0, T, C, NH, 0),
                       0);
      ck_assert_int_eq(G->attention_backward_flash_bf16(g_gpu, d16.d, 1, dout.d, 0, qkv16.d, out_d,
                                                        lse.d, B, Tq, q0, T, C, NH, 0),
                       0);
      ck_assert(memcmp(d16.h, want, dqkv.n * sizeof(float)) == 0);
      float *g = fetch16(&d16);
      expect_att_close("attention_backward_flash_bf16 dqkv into bf16", g, d16.h, d16.n);
      free(g);
      /* from a bf16 dout too (dout16; each side's to_bf16 of dout: the same values) */
      pair16_t g16 = pair16_alloc(dout.n);
      ck_assert_int_eq(H->to_bf16(g_cpu, g16.h, dout.h, dout.n), 0);
      ck_assert_int_eq(G->to_bf16(g_gpu, g16.d, dout.d, dout.n), 0);
      ck_assert_int_eq(H->attention_backward_flash_bf16(g_cpu, d16.h, 1, g16.h, 1, qkv16.h, out_h,
                                                        lse.h, B, Tq, q0, T, C, NH, 0),
                       0);
      ck_assert_int_eq(G->attention_backward_flash_bf16(g_gpu, d16.d, 1, g16.d, 1, qkv16.d, out_d,
                                                        lse.d, B, Tq, q0, T, C, NH, 0),
                       0);
      g = fetch16(&d16);
      expect_att_close("attention_backward_flash_bf16 from a bf16 dout", g, d16.h, d16.n);
      free(g);
      free(want), pair16_free(&d16), pair16_free(&g16);
    }
    pair_free(&out), pair_free(&lse), pair_free(&dout), pair_free(&dqkv);
    if (bf16)
      pair16_free(&out16);
  }
  pair_free(&qkv);
  if (bf16)
    pair16_free(&qkv16);
}

START_TEST(test_attention_flash)
{
  for (int bf16 = 0; bf16 <= 1; bf16++) {
    check_attention_flash(2, 37, 48, 4, 1, bf16);    /* hs 12 (bucket 32), T prime */
    check_attention_flash(3, 70, 64, 2, 1, bf16);    /* hs 32, T over a 64-row block */
    check_attention_flash(1, 1, 24, 3, 1, bf16);     /* a single position */
    check_attention_flash(2, 40, 45, 3, 1, bf16);    /* hs 15, odd: no paired stores */
    check_attention_flash(2, 256, 256, 4, 1, bf16);  /* hs 64: GPT-2's */
    check_attention_flash(1, 100, 200, 2, 1, bf16);  /* hs 100 (bucket 128) */
    check_attention_flash(2, 150, 48, 4, 3, bf16);   /* chunks of 50: q0 off the tiles */
    check_attention_flash(1, 1100, 128, 2, 2, bf16); /* hs 64, chunks of 550 */
  }
  /* the bf16 backward's other workspace plans: the score gradients of one head at a time (6
   * tiles of 8 KiB at T 130), and none (the dq kernel recomputes them) */
  dt_cuda_set_flash_ws_max(g_gpu, 6 * 8192);
  check_attention_flash(3, 130, 128, 2, 1, 1);
  dt_cuda_set_flash_ws_max(g_gpu, 1);
  check_attention_flash(2, 150, 48, 4, 3, 1);
  dt_cuda_set_flash_ws_max(g_gpu, 0);
  /* B * NH = 65600 heads, more than a grid's y or z may hold. The geometry (flash_grid) is the
   * same for both precisions; fp32 alone, since the emulated GPU takes minutes to run the
   * tensor-core kernels' 65600 blocks. */
  check_attention_flash(4100, 2, 32, 16, 1, 0);
  /* past the largest bucket: refused with a message, nothing launched */
  ck_assert_int_eq(G->attention_forward_flash(g_gpu, NULL, NULL, NULL, 1, 4, 0, 4, 258, 2),
                   DT_ENOTSUP);
  ck_assert_int_eq(G->attention_forward_flash_bf16(g_gpu, NULL, NULL, NULL, 1, 4, 0, 4, 258, 2),
                   DT_ENOTSUP);
}
END_TEST

/* DISTRAIN_CUDA_WGMMA=1: the bf16 flash forward on Hopper's wgmma (flash_wgmma.cuh) where the
 * head size is 64, against the CPU as the mma.sync kernels are (the backward, the same kernels,
 * runs again from its out). A bad value is refused; so is the switch on a GPU other than 9.0. */
START_TEST(test_attention_wgmma)
{
  int major = 0, minor = 0;
  ck_assert_int_eq(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), 0);
  ck_assert_int_eq(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), 0);
  if (major != 9 || minor != 0) {
    dt_device_t *dev = NULL;
    setenv("DISTRAIN_CUDA_WGMMA", "1", 1);
    ck_assert_int_eq(dt_device_cuda_create(0, &dev), DT_EINVAL);
    unsetenv("DISTRAIN_CUDA_WGMMA");
    ck_assert_ptr_null(dev);
    return;
  }
  dt_device_t *plain = g_gpu, *wg = device_with("DISTRAIN_CUDA_WGMMA", "on", "1");
  g_gpu = wg;
  check_attention_flash(2, 256, 256, 4, 1, 1); /* hs 64: two query blocks of 128 */
  check_attention_flash(1, 150, 192, 3, 3, 1); /* chunks of 50: q0 off the tiles */
  g_gpu = plain;
  dt_device_cuda_destroy(wg);
}
END_TEST

START_TEST(test_attention)
{
  check_attention(2, 37, 48, 4);        /* hs 12, T prime */
  check_attention(3, 70, 64, 2);        /* hs 32, T over the CPU's 64-row block */
  check_attention(1, 1, 24, 3);         /* a single position */
  check_attention_cp(2, 150, 48, 4, 3); /* chunks of 50: q0 off the CPU's 64-row blocks */
  check_attention_cp(1, 256, 64, 2, 2); /* chunks of 128 */
}
END_TEST

START_TEST(test_gelu_residual)
{
  const size_t n = 10007; /* not a multiple of the block size */
  pair_t inp = pair_rand(n, 0.0f, 2.0f), out = pair_garbage(n);
  ck_assert_int_eq(H->gelu_forward(g_cpu, out.h, inp.h, n), 0);
  ck_assert_int_eq(G->gelu_forward(g_gpu, out.d, inp.d, n), 0);
  expect_close("gelu_forward", &out);

  pair_t dout = pair_rand(n, 0.0f, 1.0f), dinp = pair_garbage(n);
  ck_assert_int_eq(H->gelu_backward(g_cpu, dinp.h, inp.h, dout.h, n), 0);
  ck_assert_int_eq(G->gelu_backward(g_gpu, dinp.d, inp.d, dout.d, n), 0);
  expect_close("gelu_backward", &dinp);
  /* in place: dinp aliases dout */
  ck_assert_int_eq(H->gelu_backward(g_cpu, dout.h, inp.h, dout.h, n), 0);
  ck_assert_int_eq(G->gelu_backward(g_gpu, dout.d, inp.d, dout.d, n), 0);
  expect_close("gelu_backward in place", &dout);

  pair_t b = pair_rand(n, 0.0f, 1.0f), sum = pair_garbage(n);
  ck_assert_int_eq(H->residual_forward(g_cpu, sum.h, inp.h, b.h, n), 0);
  ck_assert_int_eq(G->residual_forward(g_gpu, sum.d, inp.d, b.d, n), 0);
  expect_close("residual_forward", &sum);

  pair_free(&inp), pair_free(&out), pair_free(&dout), pair_free(&dinp), pair_free(&b);
  pair_free(&sum);
}
END_TEST

/* A cross-entropy entry's bf16 form on the values of logits (n) rounded to bf16: the fp32
 * entry's losses on those values, and its dlogits (or logits, dloss 0) rounded, bit for bit.
 * vocab_lo < 0: the fused entry over V of ld columns; else the vocabulary-parallel stats (equal)
 * and finish over this rank's V columns from vocab_lo, with the group's all_stats (nranks). */
static void expect_ce_bf16(const float *logits, size_t n, int N, const ipair_t *targets,
                           float dloss, int vocab_lo, int V, int ld, const float *all_stats,
                           int nranks)
{
  pair16_t l16 = pair16_alloc(n);
  ck_assert_int_eq(H->to_bf16(g_cpu, l16.h, logits, n), 0);
  pair16_upload(&l16);
  float *l32 = dev_alloc(n * sizeof(float)), *loss32 = dev_alloc((size_t)N * sizeof(float)),
        *loss16 = dev_alloc((size_t)N * sizeof(float));
  to_dev(l32, l16.h, n * sizeof(float));
  if (vocab_lo < 0) {
    ck_assert_int_eq(
        G->crossentropy_forward_backward(g_gpu, loss32, l32, targets->d, dloss, N, V, ld), 0);
    ck_assert_int_eq(
        G->crossentropy_forward_backward_bf16(g_gpu, loss16, l16.d, targets->d, dloss, N, V, ld),
        0);
  } else {
    float *s32 = dev_alloc((size_t)N * 3 * sizeof(float)),
          *s16 = dev_alloc((size_t)N * 3 * sizeof(float));
    ck_assert_int_eq(G->crossentropy_vp_stats(g_gpu, s32, l32, targets->d, vocab_lo, N, V, ld), 0);
    ck_assert_int_eq(
        G->crossentropy_vp_stats_bf16(g_gpu, s16, l16.d, targets->d, vocab_lo, N, V, ld), 0);
    float *a = xmalloc((size_t)N * 3 * sizeof(float)), *b = xmalloc((size_t)N * 3 * sizeof(float));
    to_host(a, s32, (size_t)N * 3 * sizeof(float));
    to_host(b, s16, (size_t)N * 3 * sizeof(float));
    ck_assert_msg(memcmp(a, b, (size_t)N * 3 * sizeof(float)) == 0, "vp stats of bf16 logits");
    free(a), free(b), g_gpu->free(g_gpu, s32), g_gpu->free(g_gpu, s16);
    ck_assert_int_eq(G->crossentropy_vp_finish(g_gpu, loss32, l32, all_stats, nranks, targets->d,
                                               vocab_lo, dloss, N, V, ld),
                     0);
    ck_assert_int_eq(G->crossentropy_vp_finish_bf16(g_gpu, loss16, l16.d, all_stats, nranks,
                                                    targets->d, vocab_lo, dloss, N, V, ld),
                     0);
  }
  float *a = xmalloc((size_t)N * sizeof(float)), *b = xmalloc((size_t)N * sizeof(float));
  to_host(a, loss32, (size_t)N * sizeof(float));
  to_host(b, loss16, (size_t)N * sizeof(float));
  ck_assert_msg(memcmp(a, b, (size_t)N * sizeof(float)) == 0, "losses of bf16 logits");
  float *want = xmalloc(n * sizeof(float));
  to_host(want, l32, n * sizeof(float));
  ck_assert_int_eq(H->to_bf16(g_cpu, want, want, n), 0);
  expect_bf16_equal(dloss != 0.0f ? "bf16 dlogits" : "bf16 logits kept", &l16, want);
  free(a), free(b), free(want);
  g_gpu->free(g_gpu, l32), g_gpu->free(g_gpu, loss32), g_gpu->free(g_gpu, loss16);
  pair16_free(&l16);
}

static void check_crossentropy(int N, int V, int Vp, float dloss)
{
  ipair_t targets = ipair_below((size_t)N, V);
  pair_t logits = pair_rand((size_t)N * Vp, 0.0f, 2.0f);
  pair_t losses = pair_garbage((size_t)N);
  float *orig = xmalloc(logits.n * sizeof(float));
  memcpy(orig, logits.h, logits.n * sizeof(float));
  ck_assert_int_eq(
      H->crossentropy_forward_backward(g_cpu, losses.h, logits.h, targets.h, dloss, N, V, Vp), 0);
  ck_assert_int_eq(
      G->crossentropy_forward_backward(g_gpu, losses.d, logits.d, targets.d, dloss, N, V, Vp), 0);
  expect_close("crossentropy losses", &losses);
  if (dloss == 0.0f) {
    expect_equal("crossentropy logits untouched when dloss == 0", &logits);
  } else {
    expect_close("crossentropy dlogits", &logits);
    float *g = fetch(&logits);
    const size_t n = (size_t)N * Vp;
    size_t i = 0;
    while (i < n && ((int)(i % Vp) < V || g[i] == 0.0f))
      i++;
    ck_assert_msg(i == n, "dlogits[%zu][%zu] = %g in the padding", i / Vp, i % Vp,
                  g[i < n ? i : 0]);
    free(g);
  }
  expect_ce_bf16(orig, logits.n, N, &targets, dloss, -1, V, Vp, NULL, 0);
  free(orig);
  ipair_free(&targets), pair_free(&logits), pair_free(&losses);
}

/* The backward with each row kept in shared memory between its passes, then read twice from
 * memory (ce_keep_max 0): the same bits, fp32 and bf16 (dlogits and losses). */
static void check_crossentropy_kept(int N, int V, int Vp)
{
  ipair_t targets = ipair_below((size_t)N, V);
  float *x = host_rand((size_t)N * Vp, 0.0f, 2.0f);
  float *out[2][2];  /* [kept, twice][fp32, bf16] */
  float *loss[2][2]; /* likewise */
  const size_t keep_max = dt_cuda_set_ce_keep_max(g_gpu, 0);
  for (int k = 0; k < 2; k++) {
    dt_cuda_set_ce_keep_max(g_gpu, k == 0 ? (size_t)Vp * sizeof(float) : 0);
    for (int b = 0; b < 2; b++) {
      const size_t n = (size_t)N * Vp, bytes = n * (b ? 2 : sizeof(float));
      float *ls = dev_alloc((size_t)N * sizeof(float));
      pair16_t l16 = {0};
      void *l = NULL;
      if (b) {
        l16 = pair16_alloc(n);
        ck_assert_int_eq(H->to_bf16(g_cpu, l16.h, x, n), 0);
        pair16_upload(&l16);
        l = l16.d;
        ck_assert_int_eq(
            G->crossentropy_forward_backward_bf16(g_gpu, ls, l, targets.d, 0.5f, N, V, Vp), 0);
      } else {
        l = dev_alloc(bytes);
        to_dev(l, x, bytes);
        ck_assert_int_eq(G->crossentropy_forward_backward(g_gpu, ls, l, targets.d, 0.5f, N, V, Vp),
                         0);
      }
      out[k][b] = xmalloc(bytes);
      loss[k][b] = xmalloc((size_t)N * sizeof(float));
      to_host(out[k][b], l, bytes);
      to_host(loss[k][b], ls, (size_t)N * sizeof(float));
      if (b)
        pair16_free(&l16);
      else
        g_gpu->free(g_gpu, l);
      g_gpu->free(g_gpu, ls);
    }
  }
  dt_cuda_set_ce_keep_max(g_gpu, keep_max);
  for (int b = 0; b < 2; b++) {
    const size_t bytes = (size_t)N * Vp * (b ? 2 : sizeof(float));
    ck_assert_msg(memcmp(out[0][b], out[1][b], bytes) == 0 &&
                      memcmp(loss[0][b], loss[1][b], (size_t)N * sizeof(float)) == 0,
                  "%s crossentropy, V %d Vp %d: the kept row's results differ", b ? "bf16" : "fp32",
                  V, Vp);
    for (int k = 0; k < 2; k++)
      free(out[k][b]), free(loss[k][b]);
  }
  free(x);
  ipair_free(&targets);
}

START_TEST(test_crossentropy)
{
  check_crossentropy(13, 1000, 1024, 0.0f);
  check_crossentropy(13, 1000, 1024, 1.0f / 13);
  check_crossentropy(5, 3001, 3001, 0.25f); /* no padding, V over the block size several times */
  check_crossentropy_kept(7, 1000, 1024);   /* padding; 128 vectors a row: one a thread */
  check_crossentropy_kept(3, 9000, 9088);   /* vectors two a thread and one, the tail */
  check_crossentropy_kept(3, 3001, 3001);   /* one element at a time */
}
END_TEST

/* Vocabulary-parallel cross-entropy: a vocabulary of V split over nr "ranks" (the last one
 * empty), each slice in its own (N, ldl) buffer with padding columns (ldl a multiple of 8: the
 * kernels' 16-byte vectors, then the elements past the last whole one; the fused entry's 3001
 * above goes one element at a time). */
START_TEST(test_crossentropy_vp)
{
  enum { N = 13, V = 1000, NR = 4, LDL = 344 };
  const int lo[NR] = {0, 333, 666, 1000}, vl[NR] = {333, 333, 334, 0};
  float *full = host_rand((size_t)N * V, 0.0f, 2.0f);
  ipair_t targets = ipair_below(N, V);
  pair_t slice[NR], all_stats = pair_garbage((size_t)NR * N * 3);
  for (int r = 0; r < NR; r++) {
    slice[r] = pair_rand((size_t)N * LDL, 9.0f, 1.0f); /* padding: large values */
    for (int i = 0; i < N; i++)
      memcpy(slice[r].h + (size_t)i * LDL, full + (size_t)i * V + lo[r], vl[r] * sizeof(float));
    to_dev(slice[r].d, slice[r].h, (size_t)N * LDL * sizeof(float));

    pair_t stats = pair_garbage((size_t)N * 3);
    ck_assert_int_eq(
        H->crossentropy_vp_stats(g_cpu, stats.h, slice[r].h, targets.h, lo[r], N, vl[r], LDL), 0);
    ck_assert_int_eq(
        G->crossentropy_vp_stats(g_gpu, stats.d, slice[r].d, targets.d, lo[r], N, vl[r], LDL), 0);
    if (vl[r] > 0) {
      expect_close("crossentropy_vp_stats", &stats);
    } else { /* (-inf, 0, 0) exactly */
      expect_equal("crossentropy_vp_stats of an empty slice", &stats);
      ck_assert(isinf(stats.h[0]) && stats.h[0] < 0 && stats.h[1] == 0.0f && stats.h[2] == 0.0f);
    }
    memcpy(all_stats.h + (size_t)r * N * 3, stats.h, (size_t)N * 3 * sizeof(float));
    pair_free(&stats);
  }
  /* finish takes the CPU's gathered stats on both sides */
  to_dev(all_stats.d, all_stats.h, (size_t)NR * N * 3 * sizeof(float));
  const float dlosses[2] = {0.0f, 1.0f / N};
  for (int k = 0; k < 2; k++) {
    for (int r = 0; r < NR - 1; r++) {
      pair_t logits = pair_rand((size_t)N * LDL, 0.0f, 1.0f);
      memcpy(logits.h, slice[r].h, (size_t)N * LDL * sizeof(float));
      to_dev(logits.d, logits.h, (size_t)N * LDL * sizeof(float));
      pair_t losses = pair_garbage(N);
      ck_assert_int_eq(H->crossentropy_vp_finish(g_cpu, losses.h, logits.h, all_stats.h, NR,
                                                 targets.h, lo[r], dlosses[k], N, vl[r], LDL),
                       0);
      ck_assert_int_eq(G->crossentropy_vp_finish(g_gpu, losses.d, logits.d, all_stats.d, NR,
                                                 targets.d, lo[r], dlosses[k], N, vl[r], LDL),
                       0);
      expect_close("crossentropy_vp_finish losses", &losses);
      if (dlosses[k] == 0.0f) {
        expect_equal("crossentropy_vp_finish logits untouched when dloss == 0", &logits);
      } else {
        expect_close("crossentropy_vp_finish dlogits", &logits);
        float *g = fetch(&logits);
        const size_t n = (size_t)N * LDL;
        size_t i = 0;
        while (i < n && ((int)(i % LDL) < vl[r] || g[i] == 0.0f))
          i++;
        ck_assert_msg(i == n, "vp dlogits[%zu][%zu] = %g in the padding", i / LDL, i % LDL,
                      g[i < n ? i : 0]);
        free(g);
      }
      expect_ce_bf16(slice[r].h, (size_t)N * LDL, N, &targets, dlosses[k], lo[r], vl[r], LDL,
                     all_stats.d, NR);
      pair_free(&logits), pair_free(&losses);
    }
  }
  for (int r = 0; r < NR; r++)
    pair_free(&slice[r]);
  pair_free(&all_stats), ipair_free(&targets);
  free(full);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* AdamW and the gradient norm                                                                 */
/* ------------------------------------------------------------------------------------------ */

#define ADAM_N 100003

START_TEST(test_adamw_matches_cpu)
{
  float *p = malloc(ADAM_N * sizeof(float)), *g = malloc(ADAM_N * sizeof(float));
  float *m = calloc(ADAM_N, sizeof(float)), *v = calloc(ADAM_N, sizeof(float));
  float *gp = malloc(ADAM_N * sizeof(float));
  dt_rng_t rng;
  dt_rng_seed(&rng, 3);
  dt_rng_normal(&rng, p, ADAM_N, 0.0f, 0.1f);
  float *dp, *dg, *dm, *dv;
  ck_assert_int_eq(cudaMalloc((void **)&dp, ADAM_N * sizeof(float)), cudaSuccess);
  ck_assert_int_eq(cudaMalloc((void **)&dg, ADAM_N * sizeof(float)), cudaSuccess);
  ck_assert_int_eq(cudaMalloc((void **)&dm, ADAM_N * sizeof(float)), cudaSuccess);
  ck_assert_int_eq(cudaMalloc((void **)&dv, ADAM_N * sizeof(float)), cudaSuccess);
  cudaMemcpy(dp, p, ADAM_N * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemset(dm, 0, ADAM_N * sizeof(float));
  cudaMemset(dv, 0, ADAM_N * sizeof(float));
  for (int t = 1; t <= 5; t++) {
    dt_rng_normal(&rng, g, ADAM_N, 0.0f, 1.0f);
    cudaMemcpy(dg, g, ADAM_N * sizeof(float), cudaMemcpyHostToDevice);
    dt_cpu_adamw_update(p, NULL, g, m, v, ADAM_N, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.7f, t);
    ck_assert_int_eq(
        dt_cuda_adamw_update(dp, dg, dm, dv, ADAM_N, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.7f, t), 0);
  }
  float *gm = malloc(ADAM_N * sizeof(float)), *gv = malloc(ADAM_N * sizeof(float));
  ck_assert_int_eq(cudaMemcpy(gp, dp, ADAM_N * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  ck_assert_int_eq(cudaMemcpy(gm, dm, ADAM_N * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  ck_assert_int_eq(cudaMemcpy(gv, dv, ADAM_N * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  int differ = 0, first = -1;
  double worst = 0.0;
  for (int i = 0; i < ADAM_N; i++) {
    if (gp[i] != p[i] || gm[i] != m[i] || gv[i] != v[i]) {
      differ++;
      first = first < 0 ? i : first;
    }
    worst = fmax(worst, fabs((double)gp[i] - p[i]));
  }
  ck_assert_msg(
      differ == 0, "%d of %d elements differ (first [%d]: param %.9g vs %.9g); max |dparam| %.3g",
      differ, ADAM_N, first, first < 0 ? 0.0 : gp[first], first < 0 ? 0.0 : p[first], worst);
  free(gm), free(gv);
  cudaFree(dp), cudaFree(dg), cudaFree(dm), cudaFree(dv);
  free(p), free(g), free(m), free(v), free(gp);
}
END_TEST

/* The kernel table's adamw_update (the device's stream) is the same kernel: bit-identical, and
 * so is the bf16 copy it writes of the new parameters. */
START_TEST(test_adamw_ops)
{
  pair_t p = pair_rand(ADAM_N, 0.0f, 0.1f);
  pair16_t p16 = pair16_alloc(ADAM_N);
  pair_t m = pair_rand(ADAM_N, 0.0f, 0.01f), v = pair_rand(ADAM_N, 0.0f, 0.001f);
  for (size_t i = 0; i < ADAM_N; i++) /* second moments are never negative */
    v.h[i] = fabsf(v.h[i]);
  to_dev(v.d, v.h, ADAM_N * sizeof(float));
  for (int t = 1; t <= 3; t++) {
    pair_t g = pair_rand(ADAM_N, 0.0f, 1.0f);
    ck_assert_int_eq(H->adamw_update(g_cpu, p.h, p16.h, g.h, m.h, v.h, ADAM_N, 6e-4f, 0.9f, 0.95f,
                                     1e-8f, 0.1f, 0.5f, t),
                     0);
    ck_assert_int_eq(G->adamw_update(g_gpu, p.d, p16.d, g.d, m.d, v.d, ADAM_N, 6e-4f, 0.9f, 0.95f,
                                     1e-8f, 0.1f, 0.5f, t),
                     0);
    pair_free(&g);
  }
  expect_equal("adamw_update param", &p);
  expect_equal("adamw_update m", &m);
  expect_equal("adamw_update v", &v);
  expect_bf16_equal("adamw_update param16", &p16, p16.h);
  pair_free(&p), pair_free(&m), pair_free(&v), pair16_free(&p16);
}
END_TEST

/* Both sum in double, in different orders: agreement to ~1e-16 relative is expected, 1e-12
 * allows for long vectors. */
START_TEST(test_sum_squares)
{
  /* one block; 245 blocks of SS_ELEMS values a thread or more; past SS_BLOCKS of them */
  const size_t sizes[] = {1, 5, 257, 1000003, 4194305};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    pair_t x = pair_rand(sizes[k], 0.3f, 1.0f);
    double cpu = -1.0, gpu = -1.0;
    ck_assert_int_eq(H->sum_squares(g_cpu, x.h, x.n, &cpu), 0);
    ck_assert_int_eq(G->sum_squares(g_gpu, x.d, x.n, &gpu), 0);
    ck_assert_msg(fabs(gpu - cpu) <= 1e-12 * cpu, "sum_squares n=%zu: %.17g vs %.17g", x.n, gpu,
                  cpu);
    pair_free(&x);
  }
  double zero = -1.0;
  ck_assert_int_eq(G->sum_squares(g_gpu, NULL, 0, &zero), 0);
  ck_assert(zero == 0.0);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Determinism: the same inputs give bit-identical results run after run                       */
/* ------------------------------------------------------------------------------------------ */

/* Two device copies of the same host values. */
static void twin(const float *h, size_t n, float **a, float **b)
{
  *a = dev_alloc(n * sizeof(float));
  *b = dev_alloc(n * sizeof(float));
  to_dev(*a, h, n * sizeof(float));
  to_dev(*b, h, n * sizeof(float));
}

static void expect_twins_equal(const char *what, const float *a, const float *b, size_t n)
{
  float *ha = xmalloc(n * sizeof(float)), *hb = xmalloc(n * sizeof(float));
  to_host(ha, a, n * sizeof(float));
  to_host(hb, b, n * sizeof(float));
  ck_assert_msg(memcmp(ha, hb, n * sizeof(float)) == 0, "%s: two runs differ", what);
  free(ha), free(hb);
}

START_TEST(test_determinism)
{
  /* layernorm_backward: several row chunks per channel */
  {
    const int N = 4099, C = 768;
    const size_t NC = (size_t)N * C;
    pair_t inp = pair_rand(NC, 0.0f, 1.0f), dout = pair_rand(NC, 0.0f, 1.0f);
    pair_t weight = pair_rand(C, 1.0f, 0.2f), bias = pair_rand(C, 0.0f, 0.2f);
    pair_t out = pair_garbage(NC), mean = pair_garbage(N), rstd = pair_garbage(N);
    ck_assert_int_eq(
        G->layernorm_forward(g_gpu, out.d, mean.d, rstd.d, inp.d, weight.d, bias.d, N, C), 0);
    float *h_dinp = host_rand(NC, 0.0f, 1.0f), *h_dw = host_rand(C, 0.0f, 1.0f);
    float *dinp[2], *dw[2], *db[2];
    twin(h_dinp, NC, &dinp[0], &dinp[1]);
    twin(h_dw, C, &dw[0], &dw[1]);
    twin(h_dw, C, &db[0], &db[1]);
    for (int run = 0; run < 2; run++)
      ck_assert_int_eq(G->layernorm_backward(g_gpu, dinp[run], dw[run], db[run], dout.d, inp.d,
                                             weight.d, mean.d, rstd.d, N, C),
                       0);
    expect_twins_equal("layernorm_backward dinp", dinp[0], dinp[1], NC);
    expect_twins_equal("layernorm_backward dweight", dw[0], dw[1], C);
    expect_twins_equal("layernorm_backward dbias", db[0], db[1], C);
    for (int run = 0; run < 2; run++) {
      g_gpu->free(g_gpu, dinp[run]), g_gpu->free(g_gpu, dw[run]), g_gpu->free(g_gpu, db[run]);
    }
    free(h_dinp), free(h_dw);
    pair_free(&inp), pair_free(&dout), pair_free(&weight), pair_free(&bias), pair_free(&out);
    pair_free(&mean), pair_free(&rstd);
  }
  /* encoder_backward: a small vocabulary, so every token row is hit many times */
  {
    const int B = 8, T = 64, C = 96, V = 50, maxT = 64;
    ipair_t inp = ipair_below((size_t)B * T, V);
    pair_t dout = pair_rand((size_t)B * T * C, 0.0f, 1.0f);
    float *h_wte = host_rand((size_t)V * C, 0.0f, 1.0f), *h_wpe = host_rand((size_t)maxT * C, 0, 1);
    float *dwte[2], *dwpe[2];
    twin(h_wte, (size_t)V * C, &dwte[0], &dwte[1]);
    twin(h_wpe, (size_t)maxT * C, &dwpe[0], &dwpe[1]);
    for (int run = 0; run < 2; run++)
      ck_assert_int_eq(
          G->encoder_backward(g_gpu, dwte[run], 0, V, dwpe[run], dout.d, inp.d, inp.h, B, T, C), 0);
    expect_twins_equal("encoder_backward dwte", dwte[0], dwte[1], (size_t)V * C);
    expect_twins_equal("encoder_backward dwpe", dwpe[0], dwpe[1], (size_t)maxT * C);
    for (int run = 0; run < 2; run++)
      g_gpu->free(g_gpu, dwte[run]), g_gpu->free(g_gpu, dwpe[run]);
    free(h_wte), free(h_wpe);
    ipair_free(&inp), pair_free(&dout);
  }
  /* sum_squares */
  {
    pair_t x = pair_rand(3000017, 0.0f, 1.0f);
    double s0 = 0.0, s1 = 1.0;
    ck_assert_int_eq(G->sum_squares(g_gpu, x.d, x.n, &s0), 0);
    ck_assert_int_eq(G->sum_squares(g_gpu, x.d, x.n, &s1), 0);
    ck_assert_msg(memcmp(&s0, &s1, sizeof s0) == 0, "sum_squares: %.17g then %.17g", s0, s1);
    pair_free(&x);
  }
}
END_TEST

#ifndef DT_TEST_EMULATED /* test_cuda_emul runs the same kernel on the emulation */
int dt_test_wgmma_tile(int am, int bm, float *c, const uint16_t *a, const uint16_t *b,
                       unsigned lbo);

/* wgmma_tile's product of mode am / bm into got (dc, da, db: its device buffers, a and b
 * uploaded) with lbo: its error against want. */
static double wgmma_tile_error(int am, int bm, float *got, float *dc, const uint16_t *da,
                               const uint16_t *db, unsigned lbo, const float *want)
{
  const size_t n = WG_N * WG_N;
  ck_assert_int_eq(cudaMemset(dc, 0xff, n * sizeof *dc), cudaSuccess); /* NaN */
  const int rc = dt_test_wgmma_tile(am, bm, dc, da, db, lbo);
  ck_assert_msg(rc == 0, "wgmma mode %d/%d: %s", am, bm, cudaGetErrorString((cudaError_t)rc));
  ck_assert_int_eq(cudaMemcpy(got, dc, n * sizeof *got, cudaMemcpyDeviceToHost), cudaSuccess);
  return rel_err(got, want, n);
}

/* Hopper's wgmma (kernels/cuda/wgmma.cuh, through tests/unit/wgmma_tile.cuh): a 64 x 64 x 64 bf16
 * product with each way the operands reach the instruction, against a plain product of the same
 * values, on a device of compute capability 9.0 (the kernel is sm_90a code). This is the check of
 * the emulation's reading of the descriptors and fragment layouts (cuda_emul.h), which
 * test_cuda_emul takes as its reference. The tolerance is 1e-4: the tensor cores' fp32
 * accumulation need not round each addition to nearest; a layout error moves values by O(1).
 * Where an MN-major mode fails with the emulation's reading of the descriptor's two offsets
 * (LBO 16), the message says whether LBO = SBO (what the kernels set) gives the product: then
 * the kernels are right and the emulation must read the offsets the other way. */
START_TEST(test_wgmma)
{
  struct cudaDeviceProp prop;
  ck_assert_int_eq(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  if (prop.major != 9 || prop.minor != 0) {
    printf("test_wgmma: compute capability %d.%d, not 9.0: not run\n", prop.major, prop.minor);
    return;
  }
  static const char *names[WG_A_MODES][WG_B_MODES] = {
      {"A K-major, B K-major", "A K-major, B N-major"},
      {"A M-major, B K-major", "A M-major, B N-major"},
      {"A in registers, B K-major", "A in registers, B N-major"}};
  const size_t n = WG_N * WG_N;
  float *A = malloc(n * sizeof *A), *B = malloc(n * sizeof *B), *want = malloc(n * sizeof *want),
        *got = malloc(n * sizeof *got), *dc;
  uint16_t *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b), *da, *db;
  ck_assert(A && B && want && got && a && b);
  ck_assert_int_eq(cudaMalloc((void **)&dc, n * sizeof *dc), cudaSuccess);
  ck_assert_int_eq(cudaMalloc((void **)&da, n * sizeof *da), cudaSuccess);
  ck_assert_int_eq(cudaMalloc((void **)&db, n * sizeof *db), cudaSuccess);
  for (int am = 0; am < WG_A_MODES; am++)
    for (int bm = 0; bm < WG_B_MODES; bm++) {
      dt_rng_normal(&g_rng, A, n, 0.0f, 1.0f);
      dt_rng_normal(&g_rng, B, n, 0.0f, 1.0f);
      wg_tile_inputs(am, bm, A, B, a, b, want);
      ck_assert_int_eq(cudaMemcpy(da, a, n * sizeof *a, cudaMemcpyHostToDevice), cudaSuccess);
      ck_assert_int_eq(cudaMemcpy(db, b, n * sizeof *b, cudaMemcpyHostToDevice), cudaSuccess);
      const double e = wgmma_tile_error(am, bm, got, dc, da, db, 16, want);
      printf("test_wgmma: %s: relative error %.3g\n", names[am][bm], e);
      char why[128] = "";
      if (e > 1e-4 && (am == WG_A_MN || bm == WG_B_MN)) {
        const double e2 = wgmma_tile_error(am, bm, got, dc, da, db, 1024, want);
        snprintf(why, sizeof why, "; with LBO = SBO %.3g (%s)", e2,
                 e2 <= 1e-4 ? "the kernels are right: fix the emulation's reading of LBO/SBO"
                            : "not the offsets");
      }
      ck_assert_msg(e <= 1e-4, "wgmma %s: relative error %.3g > 1e-4%s", names[am][bm], e, why);
    }
  cudaFree(dc);
  cudaFree(da);
  cudaFree(db);
  free(A), free(B), free(want), free(got), free(a), free(b);
}
END_TEST
#endif

int main(void)
{
  int count = 0;
  if (dt_cuda_device_count(&count) != 0 || count == 0)
    return 77; /* no GPU here: skipped */
  if (dt_device_cuda_create(0, &g_gpu) != 0) {
    fprintf(stderr, "test_cuda: cannot open cuda:0\n");
    return EXIT_FAILURE;
  }
  g_cpu = dt_device_cpu();
  G = dt_ops_cuda();
  H = dt_ops_cpu();
  dt_rng_seed(&g_rng, 12345);

  Suite *s = suite_create("cuda");
  TCase *tc = tcase_create("kernels");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_device_fields);
  tcase_add_test(tc, test_device_memory);
#ifndef DT_TEST_EMULATED
  tcase_add_test(tc, test_device_events);
  tcase_add_test(tc, test_device_side_stream);
#endif
  tcase_add_test(tc, test_encoder);
  tcase_add_test(tc, test_layernorm);
  tcase_add_test(tc, test_matmul);
  tcase_add_test(tc, test_matmul_cublas);
  tcase_add_test(tc, test_matmul_tuned);
  tcase_add_test(tc, test_attention);
  tcase_add_test(tc, test_gelu_residual);
  tcase_add_test(tc, test_crossentropy);
  tcase_add_test(tc, test_crossentropy_vp);
  tcase_add_test(tc, test_adamw_matches_cpu);
  tcase_add_test(tc, test_adamw_ops);
  tcase_add_test(tc, test_sum_squares);
  tcase_add_test(tc, test_determinism);
#ifndef DT_TEST_EMULATED
  tcase_add_test(tc, test_wgmma);
#endif
  suite_add_tcase(s, tc);
  /* a case of its own, which CK_RUN_CASE=flash runs alone (tests/gpu/sanitize_flash.sh) */
  TCase *flash = tcase_create("flash");
  tcase_set_timeout(flash, 300);
  tcase_add_test(flash, test_attention_flash);
  tcase_add_test(flash, test_attention_wgmma);
  suite_add_tcase(s, flash);
  SRunner *sr = srunner_create(s);
  /* CUDA is initialised above (the device count): a forked child could not use it. */
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  dt_device_cuda_destroy(g_gpu);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
