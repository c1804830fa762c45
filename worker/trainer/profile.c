/* profile.c — the timed kernel table of profile.h.
 *
 * Invariants: marks[0..n) are the calls of the step being profiled, in order, kernels and the
 * profiled thread's communication alike; on a device with timed events, mark i is bracketed by
 * events[2i] and events[2i+1] (a pool that grows to the longest step and is reused). Totals are
 * per row, over every profiled step: a dt_ops_t entry (row k < K_COUNT) or a group's operation
 * (row K_COUNT + j, comm[j]). Other threads' operations go straight to the totals and spans,
 * under the lock, which the profiled thread also takes to touch them. */
#include "profile.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"

/* Every function entry of dt_ops_t, in its order. */
#define DT__PROFILE_KERNELS(X)                                                                     \
  X(encoder_forward)                                                                               \
  X(encoder_backward)                                                                              \
  X(layernorm_forward)                                                                             \
  X(residual_layernorm_forward)                                                                    \
  X(layernorm_forward_bf16)                                                                        \
  X(residual_layernorm_forward_bf16)                                                               \
  X(layernorm_backward)                                                                            \
  X(layernorm_backward_bf16)                                                                       \
  X(matmul_forward)                                                                                \
  X(matmul_backward)                                                                               \
  X(matmul_forward_bf16)                                                                           \
  X(matmul_backward_bf16)                                                                          \
  X(to_bf16)                                                                                       \
  X(attention_forward)                                                                             \
  X(attention_backward)                                                                            \
  X(attention_forward_cp)                                                                          \
  X(attention_backward_cp)                                                                         \
  X(attention_forward_flash)                                                                       \
  X(attention_backward_flash)                                                                      \
  X(attention_forward_flash_bf16)                                                                  \
  X(attention_backward_flash_bf16)                                                                 \
  X(gelu_forward)                                                                                  \
  X(gelu_backward)                                                                                 \
  X(residual_forward)                                                                              \
  X(crossentropy_forward_backward)                                                                 \
  X(crossentropy_forward_backward_bf16)                                                            \
  X(crossentropy_vp_stats)                                                                         \
  X(crossentropy_vp_stats_bf16)                                                                    \
  X(crossentropy_vp_finish)                                                                        \
  X(crossentropy_vp_finish_bf16)                                                                   \
  X(adamw_update)                                                                                  \
  X(sum_squares)

enum {
#define DT__PROFILE_ENUM(e) K_##e,
  DT__PROFILE_KERNELS(DT__PROFILE_ENUM)
#undef DT__PROFILE_ENUM
      K_COUNT
};

static const char *const g_names[K_COUNT] = {
#define DT__PROFILE_NAME(e) #e,
    DT__PROFILE_KERNELS(DT__PROFILE_NAME)
#undef DT__PROFILE_NAME
};

/* Communication rows: a group's operation, on the profiled thread or overlapped. */
#define MAX_COMM_ROWS (DT_PROFILE_MAX_ROWS - K_COUNT)
#define NROWS         DT_PROFILE_MAX_ROWS
_Static_assert(K_COUNT + 16 <= DT_PROFILE_MAX_ROWS,
               "DT_PROFILE_MAX_ROWS leaves too few rows for communication");

typedef struct {
  char group[16];
  const char *op; /* a string literal (dt_comm_event_t) */
  int overlapped;
  char name[48]; /* "comm <group> <op>" */
} comm_row_t;

typedef struct {
  int kernel;
  double flop, bytes;
  double t0, t1; /* host clock (devices without timed events) */
} mark_t;

/* A call or a step on the host's monotonic clock (dt_now_ms), for the trace. */
typedef struct {
  int kernel; /* its row; -1: the step */
  int step;
  double start_ms, ms, flop, bytes;
} span_t;

struct dt_profile {
  dt_device_t dev; /* handed out: inner's entries and state, ops = &ops */
  dt_ops_t ops;
  dt_device_t *inner;
  pthread_t owner;  /* the profiled thread */
  atomic_int armed; /* between dt_profile_begin and dt_profile_end */
  int step;         /* the step being profiled */
  double t0_ms;     /* its start */
  int comm_open;    /* the profiled thread's operation in progress was marked (call_begin) */
  int comm_err;     /* the first failure to mark one, for dt_profile_end */
  pthread_mutex_t lock;
  comm_row_t comm[MAX_COMM_ROWS]; /* under lock */
  int ncomm, comm_full;
  mark_t *marks; /* (cap) this step's calls */
  size_t n, cap;
  void **events; /* (nevents) timed events, two per mark */
  size_t nevents, events_cap;
  double anchor_ms; /* host clock when the step's first call was queued */
  int keep_spans;
  span_t *spans; /* (nspans) every profiled call and step, when keep_spans */
  size_t nspans, spans_cap;
  int steps;
  double wall_ms;
  double calls[NROWS], ms[NROWS], flop[NROWS], bytes[NROWS];
};

static dt_profile_t *of(dt_device_t *d)
{
  return (dt_profile_t *)((char *)d - offsetof(dt_profile_t, dev));
}

/* ------------------------------------------------------------------------------------------ */
/* Marking a call                                                                              */
/* ------------------------------------------------------------------------------------------ */

/* Room for element n of an array *arr of *cap elements of size bytes: its capacity doubled
 * (first: the first capacity) when full. */
static int reserve(void **arr, size_t *cap, size_t n, size_t size, size_t first)
{
  if (n < *cap)
    return 0;
  const size_t c = *cap ? 2 * *cap : first;
  void *v = realloc(*arr, c * size);
  if (!v)
    return DT_ENOMEM;
  *arr = v;
  *cap = c;
  return 0;
}

static int call_begin(dt_profile_t *p)
{
  if (!p->armed)
    return 0;
  void *marks = p->marks;
  int rc = reserve(&marks, &p->cap, p->n, sizeof *p->marks, 256);
  p->marks = marks;
  DT_CHECK(rc);
  dt_device_t *in = p->inner;
  if (p->n == 0)
    p->anchor_ms = dt_now_ms();
  if (!in->timed_event_create) {
    p->marks[p->n].t0 = dt_now_ms();
    return 0;
  }
  for (; p->nevents < 2 * (p->n + 1); p->nevents++) { /* the pool grows by doubling */
    void *ev = p->events;
    rc = reserve(&ev, &p->events_cap, p->nevents, sizeof *p->events, 512);
    p->events = ev;
    DT_CHECK(rc);
    DT_CHECK(in->timed_event_create(in, &p->events[p->nevents]));
  }
  return in->event_record(in, p->events[2 * p->n]);
}

static int call_end(dt_profile_t *p, int kernel, double flop, double bytes, int rc)
{
  if (!p->armed || rc < 0)
    return rc;
  dt_device_t *in = p->inner;
  mark_t *m = &p->marks[p->n];
  if (in->timed_event_create)
    DT_CHECK(in->event_record(in, p->events[2 * p->n + 1]));
  else
    m->t1 = dt_now_ms();
  m->kernel = kernel;
  m->flop = flop;
  m->bytes = bytes;
  p->n++;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* The timed entries                                                                           */
/* ------------------------------------------------------------------------------------------ */

/* static int timed_<entry>(PARAMS): <entry> of the inner table on the inner device, marked,
 * counting `flop` and `bytes` (expressions of the parameters and of h, the bytes of a bf16
 * activation value). */
#define TIMED(entry, flop, bytes, PARAMS, ...)                                                     \
  static int timed_##entry PARAMS                                                                  \
  {                                                                                                \
    dt_profile_t *p = of(dev);                                                                     \
    const double h = (double)p->ops.bf16_bytes;                                                    \
    (void)h;                                                                                       \
    int rc = call_begin(p);                                                                        \
    if (rc == 0)                                                                                   \
      rc = p->inner->ops->entry(p->inner, __VA_ARGS__);                                            \
    return call_end(p, K_##entry, (flop), (bytes), rc);                                            \
  }

/* FLOPs of attention over the queries [q0, q0 + Tq) against the keys up to each: per_pair hs
 * per (query, key) pair of every head, that is per_pair C per pair of every batch element. */
static double attn_flop(double per_pair, int B, int Tq, int q0, int C)
{
  return per_pair * C * B * ((double)Tq * q0 + (double)Tq * (Tq + 1) / 2.0);
}

TIMED(encoder_forward, 0, 4.0 * (2.0 * B * T * C + (wpe ? (double)T * C : 0.0) + (double)B * T),
      (dt_device_t * dev, float *out, const int *inp, const float *wte, int vocab_lo, int vocab_n,
       const float *wpe, int B, int T, int C),
      out, inp, wte, vocab_lo, vocab_n, wpe, B, T, C)
TIMED(encoder_backward, 0, 4.0 * (3.0 * B * T * C + (dwpe ? 2.0 * T * C : 0.0) + (double)B * T),
      (dt_device_t * dev, float *dwte, int vocab_lo, int vocab_n, float *dwpe, const float *dout,
       const int *inp, const int *inp_host, int B, int T, int C),
      dwte, vocab_lo, vocab_n, dwpe, dout, inp, inp_host, B, T, C)
TIMED(layernorm_forward, 0, 4.0 * (2.0 * N * C + 2.0 * C + 2.0 * N),
      (dt_device_t * dev, float *out, float *mean, float *rstd, const float *inp,
       const float *weight, const float *bias, int N, int C),
      out, mean, rstd, inp, weight, bias, N, C)
TIMED(residual_layernorm_forward, 0, 4.0 * (4.0 * N * C + 2.0 * C + 2.0 * N),
      (dt_device_t * dev, float *res, float *out, float *mean, float *rstd, const float *a,
       const float *b, const float *weight, const float *bias, int N, int C),
      res, out, mean, rstd, a, b, weight, bias, N, C)
TIMED(layernorm_forward_bf16, 0, (4.0 + h) * N * C + 4.0 * (2.0 * C + 2.0 * N),
      (dt_device_t * dev, void *out, float *mean, float *rstd, const float *inp,
       const float *weight, const float *bias, int N, int C),
      out, mean, rstd, inp, weight, bias, N, C)
TIMED(residual_layernorm_forward_bf16, 0, (12.0 + h) * N * C + 4.0 * (2.0 * C + 2.0 * N),
      (dt_device_t * dev, float *res, void *out, float *mean, float *rstd, const float *a,
       const float *b, const float *weight, const float *bias, int N, int C),
      res, out, mean, rstd, a, b, weight, bias, N, C)
TIMED(layernorm_backward, 0, 4.0 * (4.0 * N * C + 5.0 * C + 2.0 * N),
      (dt_device_t * dev, float *dinp, float *dweight, float *dbias, const float *dout,
       const float *inp, const float *weight, const float *mean, const float *rstd, int N, int C),
      dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C)
TIMED(layernorm_backward_bf16, 0, (12.0 + h) * N * C + 4.0 * (5.0 * C + 2.0 * N),
      (dt_device_t * dev, float *dinp, float *dweight, float *dbias, const void *dout,
       const float *inp, const float *weight, const float *mean, const float *rstd, int N, int C),
      dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C)
TIMED(matmul_forward, 2.0 * N * C * OC, 0,
      (dt_device_t * dev, float *out, const float *inp, const float *weight, const float *bias,
       int N, int C, int OC, int ldo),
      out, inp, weight, bias, N, C, OC, ldo)
TIMED(matmul_backward, (dinp ? 4.0 : 2.0) * N * C * OC, 0,
      (dt_device_t * dev, float *dinp, float *dweight, float *dbias, const float *dout,
       const float *inp, const float *weight, int N, int C, int OC, int ldd),
      dinp, dweight, dbias, dout, inp, weight, N, C, OC, ldd)
TIMED(matmul_forward_bf16, 2.0 * N * C * OC, 0,
      (dt_device_t * dev, void *out, int out16, const void *inp, const float *weight,
       const void *weight16, const float *bias, const float *res, void *gelu, int N, int C, int OC,
       int ldo),
      out, out16, inp, weight, weight16, bias, res, gelu, N, C, OC, ldo)
TIMED(matmul_backward_bf16, (dinp ? 4.0 : 2.0) * N * C * OC, 0,
      (dt_device_t * dev, void *dinp, int dinp16, float *dweight, float *dbias, const float *dout,
       const void *dout16, const void *inp, const float *weight, const void *weight16,
       const void *gelu_in, int N, int C, int OC, int ldd),
      dinp, dinp16, dweight, dbias, dout, dout16, inp, weight, weight16, gelu_in, N, C, OC, ldd)
TIMED(to_bf16, 0, (4.0 + h) * n, (dt_device_t * dev, void *dst, const float *src, size_t n), dst,
      src, n)
TIMED(attention_forward, attn_flop(4, B, T, 0, C), 0,
      (dt_device_t * dev, float *out, float *att, const float *qkv, int B, int T, int C, int NH),
      out, att, qkv, B, T, C, NH)
TIMED(attention_backward, attn_flop(8, B, T, 0, C), 0,
      (dt_device_t * dev, float *dqkv, float *scratch, const float *dout, const float *qkv,
       const float *att, int B, int T, int C, int NH),
      dqkv, scratch, dout, qkv, att, B, T, C, NH)
TIMED(attention_forward_cp, attn_flop(4, B, Tq, q0, C), 0,
      (dt_device_t * dev, float *out, float *att, const float *qkv, int B, int Tq, int q0, int Tall,
       int C, int NH),
      out, att, qkv, B, Tq, q0, Tall, C, NH)
TIMED(attention_backward_cp, attn_flop(8, B, Tq, q0, C), 0,
      (dt_device_t * dev, float *dqkv, float *scratch, const float *dout, const float *qkv,
       const float *att, int B, int Tq, int q0, int Tall, int C, int NH),
      dqkv, scratch, dout, qkv, att, B, Tq, q0, Tall, C, NH)
TIMED(attention_forward_flash, attn_flop(4, B, Tq, q0, C), 0,
      (dt_device_t * dev, float *out, float *lse, const float *qkv, int B, int Tq, int q0, int Tall,
       int C, int NH),
      out, lse, qkv, B, Tq, q0, Tall, C, NH)
TIMED(attention_backward_flash, attn_flop(10, B, Tq, q0, C), 0,
      (dt_device_t * dev, float *dqkv, const float *dout, const float *qkv, const float *out,
       const float *lse, int B, int Tq, int q0, int Tall, int C, int NH, int accumulate),
      dqkv, dout, qkv, out, lse, B, Tq, q0, Tall, C, NH, accumulate)
TIMED(attention_forward_flash_bf16, attn_flop(4, B, Tq, q0, C), 0,
      (dt_device_t * dev, void *out, float *lse, const void *qkv, int B, int Tq, int q0, int Tall,
       int C, int NH),
      out, lse, qkv, B, Tq, q0, Tall, C, NH)
TIMED(attention_backward_flash_bf16, attn_flop(10, B, Tq, q0, C), 0,
      (dt_device_t * dev, void *dqkv, int dqkv16, const void *dout, int dout16, const void *qkv,
       const void *out, const float *lse, int B, int Tq, int q0, int Tall, int C, int NH,
       int accumulate),
      dqkv, dqkv16, dout, dout16, qkv, out, lse, B, Tq, q0, Tall, C, NH, accumulate)
TIMED(gelu_forward, 0, 8.0 * n, (dt_device_t * dev, float *out, const float *inp, size_t n), out,
      inp, n)
TIMED(gelu_backward, 0, 12.0 * n,
      (dt_device_t * dev, float *dinp, const float *inp, const float *dout, size_t n), dinp, inp,
      dout, n)
TIMED(residual_forward, 0, 12.0 * n,
      (dt_device_t * dev, float *out, const float *a, const float *b, size_t n), out, a, b, n)
TIMED(crossentropy_forward_backward, 0, (4.0 + (dloss != 0.0f ? 4.0 : 0.0)) * N * Vp + 8.0 * N,
      (dt_device_t * dev, float *losses, float *logits, const int *targets, float dloss, int N,
       int V, int Vp),
      losses, logits, targets, dloss, N, V, Vp)
TIMED(crossentropy_forward_backward_bf16, 0, (dloss != 0.0f ? 2.0 : 1.0) * h * N * Vp + 8.0 * N,
      (dt_device_t * dev, float *losses, void *logits, const int *targets, float dloss, int N,
       int V, int Vp),
      losses, logits, targets, dloss, N, V, Vp)
TIMED(crossentropy_vp_stats, 0, 4.0 * N * Vl + 16.0 * N,
      (dt_device_t * dev, float *stats, const float *logits, const int *targets, int vocab_lo,
       int N, int Vl, int ldl),
      stats, logits, targets, vocab_lo, N, Vl, ldl)
TIMED(crossentropy_vp_stats_bf16, 0, 1.0 * h * N * Vl + 16.0 * N,
      (dt_device_t * dev, float *stats, const void *logits, const int *targets, int vocab_lo, int N,
       int Vl, int ldl),
      stats, logits, targets, vocab_lo, N, Vl, ldl)
TIMED(crossentropy_vp_finish, 0,
      (4.0 + (dloss != 0.0f ? 4.0 : 0.0)) * N * Vl + 12.0 * N * nranks + 8.0 * N,
      (dt_device_t * dev, float *losses, float *logits, const float *all_stats, int nranks,
       const int *targets, int vocab_lo, float dloss, int N, int Vl, int ldl),
      losses, logits, all_stats, nranks, targets, vocab_lo, dloss, N, Vl, ldl)
TIMED(crossentropy_vp_finish_bf16, 0,
      (dloss != 0.0f ? 2.0 * h * N * Vl : 0.0) + 12.0 * N * nranks + 8.0 * N,
      (dt_device_t * dev, float *losses, void *logits, const float *all_stats, int nranks,
       const int *targets, int vocab_lo, float dloss, int N, int Vl, int ldl),
      losses, logits, all_stats, nranks, targets, vocab_lo, dloss, N, Vl, ldl)
TIMED(adamw_update, 0, (28.0 + (param16 ? h : 0.0)) * n,
      (dt_device_t * dev, float *param, void *param16, const float *grad, float *m, float *v,
       size_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
       float grad_scale, int t),
      param, param16, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t)
TIMED(sum_squares, 0, 4.0 * n, (dt_device_t * dev, const float *x, size_t n, double *out), x, n,
      out)

/* ------------------------------------------------------------------------------------------ */
/* Communication                                                                               */
/* ------------------------------------------------------------------------------------------ */

/* The name of row k. */
static const char *row_name(const dt_profile_t *p, int k)
{
  return k < K_COUNT ? g_names[k] : p->comm[k - K_COUNT].name;
}

/* The row of e's group and operation, on the profiled thread or not (overlapped), made on first
 * use; -1 when every row is taken (said once). Under lock. */
static int comm_row(dt_profile_t *p, const dt_comm_event_t *e, int overlapped)
{
  for (int j = 0; j < p->ncomm; j++) {
    const comm_row_t *r = &p->comm[j];
    if (r->op == e->op && r->overlapped == overlapped && strcmp(r->group, e->label) == 0)
      return K_COUNT + j;
  }
  if (p->ncomm == MAX_COMM_ROWS) {
    if (!p->comm_full++)
      DT_WARN(TRAIN,
              "profile: more than %d kinds of communication; comm %s %s and later "
              "kinds are left out",
              MAX_COMM_ROWS, e->label, e->op);
    return -1;
  }
  comm_row_t *r = &p->comm[p->ncomm];
  snprintf(r->group, sizeof r->group, "%s", e->label);
  snprintf(r->name, sizeof r->name, "comm %s %s", e->label, e->op);
  r->op = e->op;
  r->overlapped = overlapped;
  return K_COUNT + p->ncomm++;
}

static int add_span(dt_profile_t *p, span_t sp);

/* Another thread's operation in progress: when it started, if inside a profiled step (else
 * -1). */
static _Thread_local double t_comm_start = -1.0;

/* dt_comm_set_observer's function. The profiled thread's operations are marked as its kernel
 * calls are; another thread's go to the totals at their return, on the host clock, if they
 * started and ended inside the profiled step. */
static void observe(void *ud, const dt_comm_event_t *e)
{
  dt_profile_t *p = ud;
  if (pthread_equal(pthread_self(), p->owner)) {
    if (!e->end) {
      const int rc = call_begin(p);
      p->comm_open = p->armed && rc == 0;
      if (rc < 0 && !p->comm_err)
        p->comm_err = rc;
      return;
    }
    if (!p->comm_open)
      return;
    p->comm_open = 0;
    pthread_mutex_lock(&p->lock);
    const int row = comm_row(p, e, 0);
    pthread_mutex_unlock(&p->lock);
    const int rc = row >= 0 && e->rc >= 0 ? call_end(p, row, 0.0, (double)e->bytes, 0) : 0;
    if (rc < 0 && !p->comm_err)
      p->comm_err = rc;
    return;
  }
  if (!e->end) {
    t_comm_start = p->armed ? dt_now_ms() : -1.0;
    return;
  }
  if (!p->armed || e->rc < 0 || t_comm_start < 0)
    return;
  const double end = dt_now_ms();
  pthread_mutex_lock(&p->lock);
  const int row = comm_row(p, e, 1);
  if (row >= 0) {
    p->calls[row] += 1;
    p->ms[row] += end - t_comm_start;
    p->bytes[row] += (double)e->bytes;
    const int rc = add_span(p, (span_t){.kernel = row,
                                        .step = p->step,
                                        .start_ms = t_comm_start,
                                        .ms = end - t_comm_start,
                                        .bytes = (double)e->bytes});
    if (rc < 0 && !p->comm_err)
      p->comm_err = rc;
  }
  pthread_mutex_unlock(&p->lock);
}

void dt_profile_watch(dt_profile_t *p, dt_comm_t *comm)
{
  if (comm)
    dt_comm_set_observer(comm, observe, p);
}

/* ------------------------------------------------------------------------------------------ */
/* Life cycle and steps                                                                        */
/* ------------------------------------------------------------------------------------------ */

int dt_profile_create(dt_profile_t **out, dt_device_t *inner)
{
  dt_profile_t *p = calloc(1, sizeof *p);
  *out = NULL;
  if (!p)
    return DT_ENOMEM;
  p->inner = inner;
  p->owner = pthread_self();
  atomic_init(&p->armed, 0);
  pthread_mutex_init(&p->lock, NULL);
  p->ops = *inner->ops;
  /* A backend's missing entries stay missing: the model reads them as "no such path". */
#define DT__PROFILE_WRAP(e)                                                                        \
  if (p->ops.e)                                                                                    \
    p->ops.e = timed_##e;
  DT__PROFILE_KERNELS(DT__PROFILE_WRAP)
#undef DT__PROFILE_WRAP
  p->dev = *inner;
  p->dev.ops = &p->ops;
  *out = p;
  return 0;
}

void dt_profile_destroy(dt_profile_t *p)
{
  if (!p)
    return;
  free(p->spans);
  for (size_t i = 0; i < p->nevents; i++)
    p->inner->event_destroy(p->inner, p->events[i]);
  free(p->events);
  free(p->marks);
  pthread_mutex_destroy(&p->lock);
  free(p);
}

dt_device_t *dt_profile_device(dt_profile_t *p)
{
  return &p->dev;
}

void dt_profile_begin(dt_profile_t *p, int step, double t0_ms)
{
  p->n = 0;
  p->step = step;
  p->t0_ms = t0_ms;
  atomic_store(&p->armed, 1);
}

void dt_profile_keep_spans(dt_profile_t *p)
{
  p->keep_spans = 1;
}

/* Under lock. */
static int add_span(dt_profile_t *p, span_t sp)
{
  if (!p->keep_spans)
    return 0;
  void *spans = p->spans;
  int rc = reserve(&spans, &p->spans_cap, p->nspans, sizeof *p->spans, 1024);
  p->spans = spans;
  DT_CHECK(rc);
  p->spans[p->nspans++] = sp;
  return 0;
}

/* The step's marks into the totals and spans. Under lock. */
static int add_marks(dt_profile_t *p)
{
  dt_device_t *in = p->inner;
  for (size_t i = 0; i < p->n; i++) {
    const mark_t *m = &p->marks[i];
    double ms = m->t1 - m->t0, start = m->t0;
    if (in->timed_event_create) {
      /* on the host clock from the moment the step's first call was queued */
      DT_CHECK(in->event_ms(in, p->events[2 * i], p->events[2 * i + 1], &ms));
      DT_CHECK(in->event_ms(in, p->events[0], p->events[2 * i], &start));
      start += p->anchor_ms;
    }
    p->calls[m->kernel] += 1;
    p->ms[m->kernel] += ms;
    p->flop[m->kernel] += m->flop;
    p->bytes[m->kernel] += m->bytes;
    DT_CHECK(add_span(p, (span_t){.kernel = m->kernel,
                                  .step = p->step,
                                  .start_ms = start,
                                  .ms = ms,
                                  .flop = m->flop,
                                  .bytes = m->bytes}));
  }
  return 0;
}

int dt_profile_end(dt_profile_t *p)
{
  dt_device_t *in = p->inner;
  atomic_store(&p->armed, 0);
  DT_CHECK(in->sync(in));
  const double wall = dt_now_ms() - p->t0_ms;
  pthread_mutex_lock(&p->lock);
  int rc = p->comm_err;
  if (rc == 0)
    rc = add_span(p, (span_t){.kernel = -1, .step = p->step, .start_ms = p->t0_ms, .ms = wall});
  if (rc == 0)
    rc = add_marks(p);
  pthread_mutex_unlock(&p->lock);
  DT_CHECK(rc);
  p->n = 0;
  p->steps++;
  p->wall_ms += wall;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Reports                                                                                     */
/* ------------------------------------------------------------------------------------------ */

static int by_time(const void *a, const void *b)
{
  const dt_profile_row_t *x = a, *y = b;
  return (x->ms < y->ms) - (x->ms > y->ms);
}

int dt_profile_summary(const dt_profile_t *p, int *steps, double *step_ms, dt_profile_row_t *rows)
{
  dt_profile_t *q = (dt_profile_t *)p; /* the lock only */
  pthread_mutex_lock(&q->lock);
  *steps = p->steps;
  *step_ms = p->steps ? p->wall_ms / p->steps : 0.0;
  int n = 0;
  for (int k = 0; k < K_COUNT + p->ncomm && p->steps; k++) {
    if (p->calls[k] <= 0)
      continue;
    const comm_row_t *c = k < K_COUNT ? NULL : &p->comm[k - K_COUNT];
    rows[n++] = (dt_profile_row_t){.kernel = row_name(p, k),
                                   .group = c ? c->group : NULL,
                                   .op = c ? c->op : NULL,
                                   .overlapped = c && c->overlapped,
                                   .calls = p->calls[k] / p->steps,
                                   .ms = p->ms[k] / p->steps,
                                   .flop = p->flop[k] / p->steps,
                                   .bytes = p->bytes[k] / p->steps};
  }
  pthread_mutex_unlock(&q->lock);
  qsort(rows, (size_t)n, sizeof *rows, by_time);
  return n;
}

/* A row of the table in the log (share: percent of the step per millisecond). */
static void log_row(const dt_profile_row_t *r, double share)
{
  const double s = DT_MAX(r->ms, 1e-9) / 1e3;
  char work[32] = "-", rate[32] = "-";
  if (r->flop > 0) {
    snprintf(work, sizeof work, "%.6g GFLOP", r->flop / 1e9);
    snprintf(rate, sizeof rate, "%.3f TFLOP/s", r->flop / s / 1e12);
  } else if (r->bytes > 0) {
    snprintf(work, sizeof work, "%.6g MB", r->bytes / 1e6);
    snprintf(rate, sizeof rate, "%.1f GB/s", r->bytes / s / 1e9);
  }
  DT_INFO(TRAIN, "  %-36s %8.0f %10.3f %6.1f%% %16s %16s", r->kernel, r->calls, r->ms,
          r->ms * share, work, rate);
}

void dt_profile_log(const dt_profile_t *p, const char *what)
{
  dt_profile_row_t rows[DT_PROFILE_MAX_ROWS];
  int steps, overlapped = 0;
  double step_ms, kernel_ms = 0.0, calls = 0.0, comm_ms = 0.0, comm_calls = 0.0;
  const int n = dt_profile_summary(p, &steps, &step_ms, rows);
  if (steps == 0) {
    DT_WARN(TRAIN, "profile of %s: this process ran none of those steps", what);
    return;
  }
  for (int i = 0; i < n; i++) {
    overlapped += rows[i].overlapped;
    if (rows[i].overlapped)
      continue;
    *(rows[i].group ? &comm_ms : &kernel_ms) += rows[i].ms;
    *(rows[i].group ? &comm_calls : &calls) += rows[i].calls;
  }
  const double share = 100.0 / DT_MAX(step_ms, 1e-9), rest = step_ms - kernel_ms - comm_ms;
  char comm[96] = "";
  if (comm_calls > 0)
    snprintf(comm, sizeof comm, ", %.3f ms (%.1f%%) in %.0f communication calls", comm_ms,
             comm_ms * share, comm_calls);
  DT_INFO(TRAIN,
          "profile of %s on %s: %.3f ms per step, %.3f ms of it (%.1f%%) in %.0f kernel calls%s",
          what, p->inner->name, step_ms, kernel_ms, kernel_ms * share, calls, comm);
  DT_INFO(TRAIN, "  %-36s %8s %10s %7s %16s %16s", "kernel (per step)", "calls", "ms", "share",
          "work", "rate");
  for (int i = 0; i < n; i++)
    if (!rows[i].overlapped)
      log_row(&rows[i], share);
  DT_INFO(TRAIN, "  %-36s %8s %10.3f %6.1f%%",
          comm_calls > 0 ? "(the rest: copies, host)" : "(the rest: copies, communication, host)",
          "", rest, rest * share);
  if (overlapped)
    DT_INFO(TRAIN, "  overlapped with the above, on the data-parallel comm thread:");
  for (int i = 0; i < n; i++)
    if (rows[i].overlapped)
      log_row(&rows[i], share);
}

void dt_profile_json(const dt_profile_t *p, FILE *f, int first, int last)
{
  dt_profile_row_t rows[DT_PROFILE_MAX_ROWS];
  int steps;
  double step_ms;
  const int n = dt_profile_summary(p, &steps, &step_ms, rows);
  fprintf(f,
          "{\"profile\": {\"steps\": [%d, %d], \"profiled\": %d, \"device\": \"%s\", "
          "\"step_ms\": %.6g, \"kernels\": [",
          first, last, steps, p->inner->name, step_ms);
  for (int i = 0, k = 0; i < n; i++)
    if (!rows[i].group)
      fprintf(f,
              "%s{\"kernel\": \"%s\", \"calls\": %.6g, \"ms\": %.6g, \"gflop\": %.9g, "
              "\"mbytes\": %.9g}",
              k++ ? ", " : "", rows[i].kernel, rows[i].calls, rows[i].ms, rows[i].flop / 1e9,
              rows[i].bytes / 1e6);
  fprintf(f, "], \"comm\": [");
  for (int i = 0, k = 0; i < n; i++)
    if (rows[i].group)
      fprintf(f,
              "%s{\"group\": \"%s\", \"op\": \"%s\", \"overlapped\": %s, \"calls\": %.6g, "
              "\"ms\": %.6g, \"mbytes\": %.9g}",
              k++ ? ", " : "", rows[i].group, rows[i].op, rows[i].overlapped ? "true" : "false",
              rows[i].calls, rows[i].ms, rows[i].bytes / 1e6);
  fprintf(f, "]}}\n");
  fflush(f);
}

/* Chrome's trace event format: complete ("X") events in microseconds, metadata ("M") events
 * naming the process and its rows. */
int dt_profile_trace(const dt_profile_t *p, FILE *f, int rank)
{
  static const char *const tids[] = {"steps", "kernels", "communication",
                                     "communication, overlapped (data-parallel comm thread)"};
  fprintf(f,
          "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n"
          "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, "
          "\"args\": {\"name\": \"rank %d (%s)\"}}",
          rank, rank, p->inner->name);
  for (int t = 0; t < 4; t++)
    fprintf(f,
            ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
            "\"args\": {\"name\": \"%s\"}}",
            rank, t + 1, tids[t]);
  dt_profile_t *q = (dt_profile_t *)p; /* the lock only */
  pthread_mutex_lock(&q->lock);
  for (size_t i = 0; i < p->nspans; i++) {
    const span_t *sp = &p->spans[i];
    const comm_row_t *c = sp->kernel >= K_COUNT ? &p->comm[sp->kernel - K_COUNT] : NULL;
    char name[48] = "";
    if (sp->kernel < 0)
      snprintf(name, sizeof name, "step %d", sp->step);
    fprintf(f,
            ",\n{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, "
            "\"ts\": %.3f, \"dur\": %.3f, \"args\": {\"step\": %d, \"gflop\": %.9g, "
            "\"mbytes\": %.9g}}",
            sp->kernel < 0 ? name : row_name(p, sp->kernel),
            sp->kernel < 0 ? "step"
            : c            ? "comm"
                           : "kernel",
            rank,
            sp->kernel < 0  ? 1
            : !c            ? 2
            : c->overlapped ? 4
                            : 3,
            sp->start_ms * 1e3, sp->ms * 1e3, sp->step, sp->flop / 1e9, sp->bytes / 1e6);
  }
  pthread_mutex_unlock(&q->lock);
  fprintf(f, "\n]}\n");
  return ferror(f) ? DT_EIO : 0;
}
