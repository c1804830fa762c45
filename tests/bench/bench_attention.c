/* bench_attention.c — the bf16 flash attention kernels on one GPU, alone: each pass timed by the
 * device's own events, so the figures hold none of a training step's host or neighbour effects
 * (tests/bench/bench_attention.py runs it beside PyTorch's scaled_dot_product_attention).
 *
 *   bench_attention B T C NH [ITERS=20]
 *
 * Causal self-attention over B sequences of T tokens, C channels in NH heads, as the bf16
 * trainer runs it (qkv packed as (B, T, 3C) bf16, bf16 out and dout, bf16 dqkv written, not
 * added). Passes: the forward; the backward as the trainer runs it (the score gradients kept in
 * the workspace, in groups within its bound, for a dq kernel of one product); the backward whose
 * dq kernel recomputes S and dP instead (the plan past T 32768; here forced by a workspace bound of
 * one byte), to compare the two plans on one machine; at head size 64 on a GPU of compute
 * capability 9.0, both passes on Hopper's wgmma too (DISTRAIN_CUDA_WGMMA=1: the forward, and the
 * backward's dk/dv and dq kernels in the dS tiles plan).
 *
 * Prints one JSON object per pass: {"pass", "plan", "B", "T", "C", "NH", "iters", "ms" (median
 * call), "ms_min", "tflops" (at the median)}. FLOPs count as FlashAttention's papers count them:
 * a causal forward 2 B NH T^2 hs (two products of T^2 hs / 2 multiply-adds), the backward 2.5
 * times that. Exit 77 where there is no GPU (skipped), 2 on bad arguments. */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_kernels.h"
#include "dt_error.h"
#include "dt_util.h"
#include "rng.h"

typedef struct {
  dt_device_t *dev;
  const dt_ops_t *k;
  int B, T, C, NH;
  void *qkv16, *out16, *dout16, *dqkv16;
  float *lse;
} bench_t;

static int cmp_double(const void *a, const void *b)
{
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* A device buffer of n random bf16 values (normal, std 1), through an fp32 staging buffer. */
static int rand_bf16(bench_t *b, dt_rng_t *rng, size_t n, void **out)
{
  float *h = malloc(n * sizeof *h), *d = NULL;
  if (!h)
    return DT_ENOMEM;
  dt_rng_normal(rng, h, n, 0.0f, 1.0f);
  int rc = b->dev->alloc(b->dev, n * sizeof(float), "staging", (void **)&d);
  if (rc == 0)
    rc = b->dev->copy(b->dev, d, h, n * sizeof(float), DT_COPY_H2D);
  if (rc == 0)
    rc = b->dev->alloc(b->dev, n * b->k->bf16_bytes, "bf16 tensor", out);
  if (rc == 0)
    rc = b->k->to_bf16(b->dev, *out, d, n);
  if (rc == 0)
    rc = b->dev->sync(b->dev);
  if (d)
    b->dev->free(b->dev, d);
  free(h);
  return rc;
}

static int forward(bench_t *b)
{
  return b->k->attention_forward_flash_bf16(b->dev, b->out16, b->lse, b->qkv16, b->B, b->T, 0, b->T,
                                            b->C, b->NH);
}

static int backward(bench_t *b)
{
  return b->k->attention_backward_flash_bf16(b->dev, b->dqkv16, 1, b->dout16, 1, b->qkv16, b->out16,
                                             b->lse, b->B, b->T, 0, b->T, b->C, b->NH, 0);
}

/* Times iters calls of pass (after one warm-up call), each between two timed events, and prints
 * its line. */
static int measure(bench_t *b, const char *pass, const char *plan, int (*fn)(bench_t *), int iters)
{
  double *ms = calloc((size_t)iters, sizeof *ms);
  void *ev[2] = {NULL, NULL};
  int rc = ms ? fn(b) : DT_ENOMEM;
  for (int e = 0; e < 2 && rc == 0; e++)
    rc = b->dev->timed_event_create(b->dev, &ev[e]);
  for (int i = 0; i < iters && rc == 0; i++) {
    rc = b->dev->event_record(b->dev, ev[0]);
    if (rc == 0)
      rc = fn(b);
    if (rc == 0)
      rc = b->dev->event_record(b->dev, ev[1]);
    if (rc == 0)
      rc = b->dev->event_wait(b->dev, ev[1]);
    if (rc == 0)
      rc = b->dev->event_ms(b->dev, ev[0], ev[1], &ms[i]);
  }
  if (rc == 0) {
    qsort(ms, (size_t)iters, sizeof *ms, cmp_double);
    const double med = ms[iters / 2], hs = (double)b->C / b->NH;
    const double fwd_flop = 2.0 * b->B * b->NH * (double)b->T * b->T * hs;
    const double flop = pass[0] == 'f' ? fwd_flop : 2.5 * fwd_flop;
    printf("{\"pass\": \"%s\", \"plan\": \"%s\", \"B\": %d, \"T\": %d, \"C\": %d, \"NH\": %d, "
           "\"iters\": %d, \"ms\": %.4f, \"ms_min\": %.4f, \"tflops\": %.2f}\n",
           pass, plan, b->B, b->T, b->C, b->NH, iters, med, ms[0], flop / (med * 1e-3) / 1e12);
    fflush(stdout);
  } else {
    fprintf(stderr, "bench_attention: %s (%s): %s\n", pass, plan, dt_strerror(rc));
  }
  for (int e = 0; e < 2; e++)
    b->dev->event_destroy(b->dev, ev[e]);
  free(ms);
  return rc;
}

int main(int argc, char **argv)
{
  int64_t v[5] = {0, 0, 0, 0, 20};
  int ok = argc == 5 || argc == 6;
  for (int i = 1; ok && i < argc; i++)
    ok = dt_parse_i64(argv[i], &v[i - 1]) == 0 && v[i - 1] >= 1 && v[i - 1] <= (1 << 20);
  if (!ok || v[2] % v[3] != 0) {
    fprintf(stderr, "usage: bench_attention B T C NH [ITERS=20] (positive; NH divides C)\n");
    return 2;
  }
  int count = 0;
  if (dt_cuda_device_count(&count) != 0 || count == 0) {
    fprintf(stderr, "bench_attention: no GPU: skipped\n");
    return 77;
  }
  bench_t b = {.B = (int)v[0], .T = (int)v[1], .C = (int)v[2], .NH = (int)v[3]};
  const int iters = (int)v[4];
  if (dt_device_cuda_create(0, &b.dev) != 0)
    return 1;
  b.k = dt_ops_cuda();
  dt_rng_t rng;
  dt_rng_seed(&rng, 1);
  const size_t BTC = (size_t)b.B * b.T * b.C;
  int rc = rand_bf16(&b, &rng, 3 * BTC, &b.qkv16);
  if (rc == 0)
    rc = rand_bf16(&b, &rng, BTC, &b.dout16);
  if (rc == 0)
    rc = b.dev->alloc(b.dev, BTC * b.k->bf16_bytes, "out", &b.out16);
  if (rc == 0)
    rc = b.dev->alloc(b.dev, 3 * BTC * b.k->bf16_bytes, "dqkv", &b.dqkv16);
  if (rc == 0)
    rc = b.dev->alloc(b.dev, (size_t)b.B * b.NH * b.T * sizeof(float), "lse", (void **)&b.lse);
  if (rc == 0)
    rc = measure(&b, "forward", "-", forward, iters);
  if (rc == 0)
    rc = measure(&b, "backward", "dS tiles", backward, iters);
  if (rc == 0) {
    dt_cuda_set_flash_ws_max(b.dev, 1); /* no head's tiles fit: the dq kernel recomputes */
    rc = measure(&b, "backward", "recompute", backward, iters);
  }
  if (rc == 0 && b.C / b.NH == 64) { /* on Hopper's wgmma, where the GPU takes it */
    dt_device_t *plain = b.dev, *wg = NULL;
    setenv("DISTRAIN_CUDA_WGMMA", "1", 1);
    if (dt_device_cuda_create(0, &wg) == 0) {
      b.dev = wg;
      rc = measure(&b, "forward", "wgmma", forward, iters);
      if (rc == 0)
        rc = measure(&b, "backward", "wgmma", backward, iters);
      b.dev = plain;
      dt_device_cuda_destroy(wg);
    }
    unsetenv("DISTRAIN_CUDA_WGMMA");
  }
  void *bufs[] = {b.qkv16, b.out16, b.dout16, b.dqkv16, b.lse};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
    if (bufs[i])
      b.dev->free(b.dev, bufs[i]);
  dt_device_cuda_destroy(b.dev);
  return rc != 0;
}
