/* comm.c — the backend-independent half of dt_comm: the backend registry, argument checks,
 * the poisoned/aborted state, zero-size shortcuts and the split protocol (see comm.h).
 *
 * Invariant: comm->err is 0 until an operation fails; from then on every operation returns it
 * without touching the backend, so a failure is reported once (by the backend, with its cause)
 * and never turns into a hang on a half-dead connection. DT_EINVAL from argument checks is
 * returned before any communication and leaves the communicator usable. */
#include "comm.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"

struct dt_comm {
  const dt_comm_backend_t *be;
  void *impl;
  dt_kv_t kv;
  char *prefix;
  int rank, world, timeout_ms;
  unsigned split_seq;   /* splits started on this communicator: names their keys */
  int err;              /* first failure (0 while healthy); only the operating thread writes it */
  atomic_int aborted;   /* set by dt_comm_abort from any thread */
  dt_comm_device_t dev; /* dev.is_device NULL: no staging (dt_comm_set_device) */
  char *stage;          /* staging buffer on the backend's side (host, or device memory) */
  size_t stage_cap;
  int (*gate)(void *ud); /* dt_comm_set_gate, or NULL */
  void *gate_ud;
  void (*observe)(void *ud, const dt_comm_event_t *e); /* dt_comm_set_observer, or NULL */
  void *observe_ud;
  size_t op_bytes; /* the operation in progress's (operating thread only) */
  /* progress (dt_comm_progress): written by the operating thread, read by any */
  char label[16];
  atomic_uint_fast64_t entered, done;
  _Atomic(const char *) op; /* the operation in progress (a string literal), or NULL */
  atomic_int peers[DT_COMM_P2P_MAX], npeers;
  atomic_int_fast64_t op_start_us;
  struct dt_comm *live_prev, *live_next; /* g_live, under g_live_lock */
  dt_comm_pending_t *pending;            /* receives in flight (dt_comm_p2p_post) */
};

/* A receive in flight: the backend's handle, and what progress reports name while it waits. */
struct dt_comm_pending {
  void *be;
  dt_comm_p2p_t op;
  dt_comm_pending_t *prev, *next; /* comm->pending */
};

/* Every live communicator of the process, for dt_comm_progress. */
static pthread_mutex_t g_live_lock = PTHREAD_MUTEX_INITIALIZER;
static dt_comm_t *g_live;

static const dt_comm_backend_t *const g_backends[] = {
    &dt__comm_cpu_backend,
#ifdef DT_HAVE_NCCL
    &dt__comm_nccl_backend,
#endif
};

static void release_stage(dt_comm_t *comm);

/* Slice of a blocking KV get: bounds how long an abort waits to be noticed during rendezvous. */
#define DT_COMM_KV_SLICE_MS 100

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                     */
/* ------------------------------------------------------------------------------------------ */

int dt__comm_kv_wait(const dt_kv_t *kv, const char *key, void **val, size_t *len,
                     double deadline_ms, int (*canceled)(void *arg), void *arg)
{
  for (;;) {
    if (canceled && canceled(arg))
      return DT_ECANCELED;
    double left = deadline_ms - dt_now_ms();
    int slice = left <= 0 ? 0 : (int)DT_MIN(left + 1, (double)DT_COMM_KV_SLICE_MS);
    int rc = kv->get(kv->ud, key, val, len, slice);
    if (rc != DT_ETIMEDOUT)
      return rc;
    if (left <= 0)
      return DT_ETIMEDOUT;
  }
}

static char *str_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *str_printf(const char *fmt, ...)
{
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0)
    return NULL;
  char *s = malloc((size_t)n + 1);
  if (!s)
    return NULL;
  va_start(ap, fmt);
  vsnprintf(s, (size_t)n + 1, fmt, ap);
  va_end(ap);
  return s;
}

static int comm_canceled(void *arg)
{
  return atomic_load(&((dt_comm_t *)arg)->aborted);
}

/* Whether comm may start an operation. */
static int comm_usable(const dt_comm_t *comm)
{
  if (!comm)
    return DT_EINVAL;
  if (atomic_load(&comm->aborted))
    return DT_ECANCELED;
  return comm->err;
}

/* Gate at the start of every operation (the equal-count forms check only, and pass the gate
 * in their _v form). */
static int comm_enter(dt_comm_t *comm)
{
  DT_CHECK(comm_usable(comm));
  return comm->gate ? comm->gate(comm->gate_ud) : 0;
}

/* Marks the start of an operation that reaches the backend (ops: a point-to-point's halves,
 * whose distinct peers are remembered; NULL for a collective). Every rank of a group makes
 * the same calls in the same order, so their counts agree while they progress; a rank blocked
 * in operation n names the members still below n, or its point-to-point peers. The observer
 * hears of it first, and of its end in comm_leave. */
static void op_begin(dt_comm_t *comm, const char *op, size_t bytes, const dt_comm_p2p_t *ops, int n)
{
  if (comm->observe)
    comm->observe(comm->observe_ud, &(dt_comm_event_t){comm->label, op, bytes, 0, 0});
  comm->op_bytes = bytes;
  int np = 0;
  for (int i = 0; i < n; i++) {
    int k = 0;
    while (k < np && atomic_load(&comm->peers[k]) != ops[i].peer)
      k++;
    if (k == np)
      atomic_store(&comm->peers[np++], ops[i].peer);
  }
  atomic_store(&comm->op_start_us, (int_fast64_t)(dt_now_ms() * 1000.0));
  atomic_store(&comm->npeers, np);
  atomic_store(&comm->op, op);
  atomic_fetch_add(&comm->entered, 1);
}

/* Ends the operation op_begin started; records its first failure (argument errors excepted). */
static int comm_leave(dt_comm_t *comm, int rc)
{
  const char *op = atomic_load(&comm->op);
  atomic_store(&comm->op, NULL);
  atomic_fetch_add(&comm->done, 1);
  if (rc < 0 && rc != DT_EINVAL) {
    if (atomic_load(&comm->aborted))
      rc = DT_ECANCELED;
    if (!comm->err)
      comm->err = rc;
  }
  if (comm->observe)
    comm->observe(comm->observe_ud, &(dt_comm_event_t){comm->label, op, comm->op_bytes, 1, rc});
  return rc;
}

static int sum_counts(const dt_comm_t *comm, const size_t *counts, size_t *total)
{
  size_t t = 0;
  for (int r = 0; r < comm->world; r++) {
    if (counts[r] > SIZE_MAX / sizeof(float) - t)
      return DT_ERANGE;
    t += counts[r];
  }
  *total = t;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Lifetime                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* Wraps a live backend instance (from init or split, started at t0) in a dt_comm_t; destroys the
 * instance if that fails. */
static int comm_wrap(dt_comm_t **out, const dt_comm_backend_t *be, void *impl, const dt_kv_t *kv,
                     const char *prefix, int rank, int world, int timeout_ms, double t0)
{
  dt_comm_t *comm = calloc(1, sizeof *comm);
  if (!comm)
    goto fail;
  comm->prefix = strdup(prefix);
  if (!comm->prefix)
    goto fail_comm;
  comm->be = be;
  comm->impl = impl;
  comm->kv = *kv;
  comm->rank = rank;
  comm->world = world;
  comm->timeout_ms = timeout_ms;
  atomic_init(&comm->aborted, 0);
  snprintf(comm->label, sizeof comm->label, "%s", strchr(prefix, '/') ? "group" : "world");
  atomic_init(&comm->entered, 0);
  atomic_init(&comm->done, 0);
  atomic_init(&comm->op, NULL);
  atomic_init(&comm->npeers, 0);
  atomic_init(&comm->op_start_us, 0);
  pthread_mutex_lock(&g_live_lock);
  comm->live_next = g_live;
  if (g_live)
    g_live->live_prev = comm;
  g_live = comm;
  pthread_mutex_unlock(&g_live_lock);
  DT_DEBUG(COMM, "comm %s: rank %d/%d up (%s) in %.1f ms", prefix, rank, world, be->name,
           dt_now_ms() - t0);
  *out = comm;
  return 0;

fail_comm:
  free(comm);
fail:
  be->destroy(impl);
  return DT_ENOMEM;
}

static int comm_create(dt_comm_t **out, const dt_comm_backend_t *be, const dt_kv_t *kv,
                       const char *prefix, int rank, int world, int timeout_ms, void *share)
{
  void *impl = NULL;
  double t0 = dt_now_ms();
  DT_CHECK(be->init(&impl, kv, prefix, rank, world, timeout_ms, share));
  return comm_wrap(out, be, impl, kv, prefix, rank, world, timeout_ms, t0);
}

static const dt_comm_backend_t *find_backend(const char *name)
{
  for (size_t i = 0; i < DT_ARRAY_SIZE(g_backends); i++)
    if (strcmp(g_backends[i]->name, name) == 0)
      return g_backends[i];
  return NULL;
}

int dt_comm_has_backend(const char *backend)
{
  return backend && find_backend(backend) != NULL;
}

int dt_comm_init(dt_comm_t **out, const char *backend, const dt_kv_t *kv, const char *prefix,
                 int rank, int world, int timeout_ms)
{
  if (!out || !kv || !kv->put || !kv->get || !prefix || !*prefix || world < 1 || rank < 0 ||
      rank >= world || timeout_ms < 0) {
    DT_ERROR(COMM, "dt_comm_init: invalid arguments (rank %d, world %d, timeout %d ms)", rank,
             world, timeout_ms);
    return DT_EINVAL;
  }
  *out = NULL;
  dt_log_init();
  const char *name = backend ? backend : "cpu";
  const dt_comm_backend_t *be = find_backend(name);
  if (be)
    return comm_create(out, be, kv, prefix, rank, world, timeout_ms, NULL);
  char have[64] = "";
  for (size_t i = 0; i < DT_ARRAY_SIZE(g_backends); i++) {
    size_t len = strlen(have);
    snprintf(have + len, sizeof have - len, "%s%s", i ? ", " : "", g_backends[i]->name);
  }
  DT_ERROR(COMM, "dt_comm_init: unknown backend \"%s\" (this build has: %s)", name, have);
  return DT_ENOTSUP;
}

int dt_comm_abort(dt_comm_t *comm)
{
  if (!comm)
    return DT_EINVAL;
  if (atomic_exchange(&comm->aborted, 1) == 0) {
    DT_INFO(COMM, "comm %s: rank %d/%d aborted", comm->prefix, comm->rank, comm->world);
    comm->be->abort(comm->impl);
  }
  return 0;
}

void dt_comm_destroy(dt_comm_t *comm)
{
  if (!comm)
    return;
  pthread_mutex_lock(&g_live_lock);
  if (comm->live_prev)
    comm->live_prev->live_next = comm->live_next;
  else
    g_live = comm->live_next;
  if (comm->live_next)
    comm->live_next->live_prev = comm->live_prev;
  pthread_mutex_unlock(&g_live_lock);
  while (comm->pending) {
    dt_comm_pending_t *p = comm->pending;
    comm->pending = p->next;
    comm->be->p2p_wait(comm->impl, p->be, 1);
    free(p);
  }
  comm->be->destroy(comm->impl);
  release_stage(comm);
  free(comm->prefix);
  free(comm);
}

int dt_comm_rank(const dt_comm_t *comm)
{
  return comm->rank;
}

int dt_comm_world(const dt_comm_t *comm)
{
  return comm->world;
}

const char *dt_comm_prefix(const dt_comm_t *comm)
{
  return comm->prefix;
}

void dt_comm_set_label(dt_comm_t *comm, const char *label)
{
  pthread_mutex_lock(&g_live_lock);
  snprintf(comm->label, sizeof comm->label, "%s", label);
  pthread_mutex_unlock(&g_live_lock);
  if (comm->be->set_label)
    comm->be->set_label(comm->impl, comm->label);
}

int dt_comm_progress(dt_comm_progress_t *out, int max)
{
  const double now_us = dt_now_ms() * 1000.0;
  int n = 0;
  pthread_mutex_lock(&g_live_lock);
  for (const dt_comm_t *c = g_live; c; c = c->live_next, n++) {
    if (n >= max)
      continue;
    dt_comm_progress_t *p = &out[n];
    snprintf(p->group, sizeof p->group, "%s", c->prefix);
    snprintf(p->label, sizeof p->label, "%s", c->label);
    p->rank = c->rank;
    p->world = c->world;
    /* done before entered: a reader never sees more completed than started */
    p->done = atomic_load(&c->done);
    p->entered = atomic_load(&c->entered);
    p->op = p->entered > p->done ? atomic_load(&c->op) : NULL;
    p->npeers = p->op ? DT_MIN(atomic_load(&c->npeers), DT_COMM_P2P_MAX) : 0;
    for (int k = 0; k < p->npeers; k++)
      p->peers[k] = atomic_load(&c->peers[k]);
    p->waiting_ms = p->op ? (now_us - (double)atomic_load(&c->op_start_us)) / 1000.0 : 0.0;
  }
  pthread_mutex_unlock(&g_live_lock);
  return n;
}

void dt_comm_set_observer(dt_comm_t *comm, void (*fn)(void *ud, const dt_comm_event_t *e), void *ud)
{
  comm->observe = fn;
  comm->observe_ud = ud;
}

void dt_comm_set_gate(dt_comm_t *comm, int (*gate)(void *ud), void *ud)
{
  comm->gate = gate;
  comm->gate_ud = ud;
}

int dt_comm_set_device(dt_comm_t *comm, const dt_comm_device_t *dev)
{
  if (!comm || !dev || !dev->is_device || !dev->copy ||
      (comm->be->device_memory && (!dev->alloc || !dev->release || !dev->sync)))
    return DT_EINVAL;
  release_stage(comm); /* staged on the other device's side */
  comm->dev = *dev;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Host staging of device operands (dt_comm_set_device)                                        */
/* ------------------------------------------------------------------------------------------ */

/* One buffer of an operation: the caller's pointer, its size, whether the backend reads it
 * (in) and writes it (out), and the pointer the backend gets (p, or a host staging copy). */
typedef struct {
  void *p;
  size_t bytes;
  int in, out;
  void *h;
} operand_t;

#define STAGE_ALIGN 64

/* An operand's share of the staging buffer. */
static size_t stage_bytes(const operand_t *o)
{
  return (o->bytes + STAGE_ALIGN - 1) / STAGE_ALIGN * STAGE_ALIGN;
}

static void release_stage(dt_comm_t *comm)
{
  if (comm->stage && comm->be->device_memory)
    comm->dev.release(comm->dev.ud, comm->stage);
  else
    free(comm->stage);
  comm->stage = NULL;
  comm->stage_cap = 0;
}

/* A staging buffer of at least bytes on the backend's side. */
static int grow_stage(dt_comm_t *comm, size_t bytes)
{
  if (bytes <= comm->stage_cap)
    return 0;
  release_stage(comm);
  void *p = NULL;
  const int rc = comm->be->device_memory ? comm->dev.alloc(comm->dev.ud, bytes, &p)
                 : posix_memalign(&p, STAGE_ALIGN, bytes) == 0 ? 0
                                                               : DT_ENOMEM;
  if (rc != 0) {
    DT_ERROR(COMM, "comm %s: out of %s memory staging %zu bytes of %s buffers", comm->prefix,
             comm->be->device_memory ? "device" : "host", bytes,
             comm->be->device_memory ? "host" : "device");
    return rc;
  }
  comm->stage = p;
  comm->stage_cap = bytes;
  return 0;
}

/* Points each operand's h at p, or, for an operand on the side the backend cannot read, at its
 * part of the staging buffer, filled from p when the backend reads it. A device-memory backend
 * first waits for the device work this thread queued (that produces its inputs). */
static int stage_in(dt_comm_t *comm, operand_t *o, int n)
{
  if (!comm->dev.is_device) {
    for (int i = 0; i < n; i++)
      o[i].h = o[i].p;
    return 0;
  }
  const int dev_be = comm->be->device_memory;
  size_t total = 0;
  for (int i = 0; i < n; i++) {
    o[i].h = o[i].p;
    const int on_device = comm->dev.is_device(comm->dev.ud, o[i].p) != 0;
    if (o[i].bytes && on_device != dev_be) {
      o[i].h = NULL;
      total += stage_bytes(&o[i]);
    }
  }
  if (dev_be)
    DT_CHECK(comm->dev.sync(comm->dev.ud));
  if (total == 0)
    return 0;
  DT_CHECK(grow_stage(comm, total));
  char *h = comm->stage;
  for (int i = 0; i < n; i++) {
    if (o[i].h)
      continue;
    o[i].h = h;
    h += stage_bytes(&o[i]);
    if (o[i].in)
      DT_CHECK(comm->dev.copy(comm->dev.ud, o[i].h, o[i].p, o[i].bytes, !dev_be));
  }
  return 0;
}

/* Copies the staged operands the backend wrote back to their owners' side. */
static int stage_out(dt_comm_t *comm, const operand_t *o, int n, int rc)
{
  for (int i = 0; i < n && rc == 0; i++)
    if (o[i].out && o[i].h != o[i].p)
      rc = comm->dev.copy(comm->dev.ud, o[i].p, o[i].h, o[i].bytes, comm->be->device_memory);
  return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* Collectives                                                                                 */
/* ------------------------------------------------------------------------------------------ */

static int valid_op(dt_comm_op_t op)
{
  return op == DT_COMM_SUM || op == DT_COMM_AVG;
}

int dt_comm_all_reduce(dt_comm_t *comm, float *buf, size_t n, dt_comm_op_t op)
{
  DT_CHECK(comm_enter(comm));
  if ((n && !buf) || !valid_op(op))
    return DT_EINVAL;
  if (n == 0)
    return 0;
  operand_t o[1] = {{buf, n * sizeof(float), 1, 1, NULL}};
  op_begin(comm, "all_reduce", n * sizeof(float), NULL, 0);
  int rc = stage_in(comm, o, 1);
  if (rc == 0)
    rc = stage_out(comm, o, 1, comm->be->all_reduce(comm->impl, o[0].h, n, op));
  return comm_leave(comm, rc);
}

int dt_comm_reduce_scatter_v(dt_comm_t *comm, const float *in, float *out, const size_t *counts,
                             dt_comm_op_t op)
{
  DT_CHECK(comm_enter(comm));
  size_t total;
  if (!counts || !valid_op(op) || sum_counts(comm, counts, &total) < 0)
    return DT_EINVAL;
  if ((total && !in) || (counts[comm->rank] && !out))
    return DT_EINVAL;
  if (total == 0)
    return 0;
  operand_t o[2] = {{(void *)in, total * sizeof(float), 1, 0, NULL},
                    {out, counts[comm->rank] * sizeof(float), 0, 1, NULL}};
  op_begin(comm, "reduce_scatter", total * sizeof(float), NULL, 0);
  int rc = stage_in(comm, o, 2);
  if (rc == 0)
    rc = stage_out(comm, o, 2, comm->be->reduce_scatter(comm->impl, o[0].h, o[1].h, counts, op));
  return comm_leave(comm, rc);
}

int dt_comm_reduce_scatter(dt_comm_t *comm, const float *in, float *out, size_t n, dt_comm_op_t op)
{
  DT_CHECK(comm_usable(comm));
  size_t *counts = malloc((size_t)comm->world * sizeof *counts);
  if (!counts)
    return DT_ENOMEM;
  for (int r = 0; r < comm->world; r++)
    counts[r] = n;
  int rc = dt_comm_reduce_scatter_v(comm, in, out, counts, op);
  free(counts);
  return rc;
}

int dt_comm_all_gather_v(dt_comm_t *comm, const float *in, float *out, const size_t *counts)
{
  DT_CHECK(comm_enter(comm));
  size_t total;
  if (!counts || sum_counts(comm, counts, &total) < 0)
    return DT_EINVAL;
  if ((counts[comm->rank] && !in) || (total && !out))
    return DT_EINVAL;
  if (total == 0)
    return 0;
  operand_t o[2] = {{(void *)in, counts[comm->rank] * sizeof(float), 1, 0, NULL},
                    {out, total * sizeof(float), 0, 1, NULL}};
  op_begin(comm, "all_gather", total * sizeof(float), NULL, 0);
  int rc = stage_in(comm, o, 2);
  if (rc == 0)
    rc = stage_out(comm, o, 2, comm->be->all_gather(comm->impl, o[0].h, o[1].h, counts));
  return comm_leave(comm, rc);
}

int dt_comm_all_gather(dt_comm_t *comm, const float *in, float *out, size_t n)
{
  DT_CHECK(comm_usable(comm));
  size_t *counts = malloc((size_t)comm->world * sizeof *counts);
  if (!counts)
    return DT_ENOMEM;
  for (int r = 0; r < comm->world; r++)
    counts[r] = n;
  int rc = dt_comm_all_gather_v(comm, in, out, counts);
  free(counts);
  return rc;
}

int dt_comm_broadcast(dt_comm_t *comm, float *buf, size_t n, int root)
{
  DT_CHECK(comm_enter(comm));
  if ((n && !buf) || root < 0 || root >= comm->world)
    return DT_EINVAL;
  if (n == 0)
    return 0;
  operand_t o[1] = {{buf, n * sizeof(float), comm->rank == root, comm->rank != root, NULL}};
  op_begin(comm, "broadcast", n * sizeof(float), NULL, 0);
  int rc = stage_in(comm, o, 1);
  if (rc == 0)
    rc = stage_out(comm, o, 1, comm->be->broadcast(comm->impl, o[0].h, n, root));
  return comm_leave(comm, rc);
}

int dt_comm_barrier(dt_comm_t *comm)
{
  DT_CHECK(comm_enter(comm));
  op_begin(comm, "barrier", 0, NULL, 0);
  return comm_leave(comm, comm->be->barrier(comm->impl));
}

/* ------------------------------------------------------------------------------------------ */
/* Point-to-point                                                                              */
/* ------------------------------------------------------------------------------------------ */

static int valid_peer(const dt_comm_t *comm, int peer)
{
  return peer >= 0 && peer < comm->world && peer != comm->rank;
}

/* dt_comm_p2p, and with pending dt_comm_p2p_post: where the backend can leave receives in
 * flight and no device is set (nothing to stage back), they are (their bytes count in their
 * waits), else all complete here. */
static int p2p(dt_comm_t *comm, const dt_comm_p2p_t *ops, int n, dt_comm_pending_t **pending)
{
  DT_CHECK(comm_enter(comm));
  if (n < 1 || n > DT_COMM_P2P_MAX || !ops)
    return DT_EINVAL;
  for (int i = 0; i < n; i++)
    if (ops[i].tag < 0 || !valid_peer(comm, ops[i].peer) || (ops[i].bytes && !ops[i].buf))
      return DT_EINVAL;
  operand_t o[DT_COMM_P2P_MAX];
  dt_comm_p2p_t staged[DT_COMM_P2P_MAX];
  dt_comm_pending_t *mine[DT_COMM_P2P_MAX] = {0};
  void *be[DT_COMM_P2P_MAX] = {0};
  const int defer = pending && comm->be->p2p_post && !comm->dev.is_device;
  size_t bytes = 0;
  for (int i = 0; i < n; i++) {
    o[i] = (operand_t){ops[i].buf, ops[i].bytes, !ops[i].recv, ops[i].recv, NULL};
    bytes += defer && ops[i].recv ? 0 : ops[i].bytes;
  }
  op_begin(comm, n == 1 ? (ops[0].recv ? "recv" : "send") : "send/recv", bytes, ops, n);
  int rc = stage_in(comm, o, n);
  for (int i = 0; i < n; i++) {
    staged[i] = ops[i];
    staged[i].buf = o[i].h;
  }
  for (int i = 0; i < n && defer && rc == 0; i++)
    if (ops[i].recv && !(mine[i] = calloc(1, sizeof *mine[i])))
      rc = DT_ENOMEM;
  if (rc == 0 && defer)
    rc = comm->be->p2p_post(comm->impl, staged, n, be);
  else if (rc == 0)
    rc = stage_out(comm, o, n, comm->be->p2p(comm->impl, staged, n));
  for (int i = 0; i < n && pending; i++) {
    pending[i] = rc == 0 && defer && ops[i].recv ? mine[i] : NULL;
    if (!pending[i]) {
      free(mine[i]);
      continue;
    }
    *mine[i] = (dt_comm_pending_t){be[i], ops[i], NULL, comm->pending};
    if (comm->pending)
      comm->pending->prev = mine[i];
    comm->pending = mine[i];
  }
  return comm_leave(comm, rc);
}

int dt_comm_p2p(dt_comm_t *comm, const dt_comm_p2p_t *ops, int n)
{
  return p2p(comm, ops, n, NULL);
}

int dt_comm_p2p_post(dt_comm_t *comm, const dt_comm_p2p_t *ops, int n, dt_comm_pending_t **pending)
{
  for (int i = 0; i < n && pending; i++)
    pending[i] = NULL;
  return pending ? p2p(comm, ops, n, pending) : DT_EINVAL;
}

int dt_comm_p2p_wait(dt_comm_t *comm, dt_comm_pending_t *pending)
{
  if (!pending)
    return 0;
  if (pending->prev)
    pending->prev->next = pending->next;
  else
    comm->pending = pending->next;
  if (pending->next)
    pending->next->prev = pending->prev;
  void *be = pending->be;
  const dt_comm_p2p_t op = pending->op;
  free(pending);
  int rc = comm_enter(comm);
  if (rc != 0) {
    comm->be->p2p_wait(comm->impl, be, 1);
    return rc;
  }
  op_begin(comm, "recv", op.bytes, &op, 1);
  return comm_leave(comm, comm->be->p2p_wait(comm->impl, be, 0));
}

int dt_comm_sendrecv(dt_comm_t *comm, const void *sendbuf, size_t send_bytes, int dst,
                     void *recvbuf, size_t recv_bytes, int src, int tag)
{
  dt_comm_p2p_t ops[2];
  int n = 0;
  if (dst >= 0)
    ops[n++] = (dt_comm_p2p_t){(void *)sendbuf, send_bytes, dst, tag, 0};
  if (src >= 0)
    ops[n++] = (dt_comm_p2p_t){recvbuf, recv_bytes, src, tag, 1};
  return dt_comm_p2p(comm, ops, n);
}

int dt_comm_send(dt_comm_t *comm, const void *buf, size_t bytes, int peer, int tag)
{
  return dt_comm_sendrecv(comm, buf, bytes, peer, NULL, 0, -1, tag);
}

int dt_comm_recv(dt_comm_t *comm, void *buf, size_t bytes, int peer, int tag)
{
  return dt_comm_sendrecv(comm, NULL, 0, -1, buf, bytes, peer, tag);
}

/* ------------------------------------------------------------------------------------------ */
/* Split                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* Protocol (all keys under base = "<prefix>/split<seq>"): every rank puts "base/ck/<rank>" =
 * "<color> <key>"; rank 0 collects them and puts the whole table as "base/table"; every other
 * rank reads that one key. So the KV sees O(world) requests rather than O(world^2). Each rank
 * then derives its group from the table and joins it under "base/c<color>". */

typedef struct {
  int color, key, rank;
} split_entry_t;

static int split_cmp(const void *a, const void *b)
{
  const split_entry_t *x = a, *y = b;
  if (x->key != y->key)
    return x->key < y->key ? -1 : 1;
  return x->rank < y->rank ? -1 : x->rank > y->rank;
}

/* Rank 0: gathers every rank's (color, key) into a table of world lines "<color> <key>\n". */
static int split_gather(dt_comm_t *comm, const char *base, double deadline, char **table,
                        size_t *table_len)
{
  int rc = 0;
  size_t cap = (size_t)comm->world * 24 + 1, len = 0;
  char *t = malloc(cap);
  if (!t)
    return DT_ENOMEM;
  for (int r = 0; r < comm->world; r++) {
    char key[512];
    void *val = NULL;
    size_t vlen = 0;
    snprintf(key, sizeof key, "%s/ck/%d", base, r);
    rc = dt__comm_kv_wait(&comm->kv, key, &val, &vlen, deadline, comm_canceled, comm);
    if (rc == DT_ETIMEDOUT) {
      DT_ERROR(COMM,
               "comm %s: split timed out after %d ms: rank %d (and maybe later ones) "
               "never posted its color",
               comm->prefix, comm->timeout_ms, r);
    }
    if (rc < 0)
      goto fail;
    int color, k;
    char line[24];
    int ok = vlen < sizeof line;
    if (ok) {
      memcpy(line, val, vlen);
      line[vlen] = '\0';
      ok = sscanf(line, "%d %d", &color, &k) == 2;
    }
    free(val);
    if (!ok) {
      DT_ERROR(COMM, "comm %s: malformed split entry under %s", comm->prefix, key);
      rc = DT_EFORMAT;
      goto fail;
    }
    len += (size_t)snprintf(t + len, cap - len, "%d %d\n", color, k);
  }
  *table = t;
  *table_len = len;
  return 0;

fail:
  free(t);
  return rc;
}

/* Parses the table into entries (world of them). */
static int split_parse(const dt_comm_t *comm, const char *table, size_t len, split_entry_t *e)
{
  const char *p = table, *end = table + len;
  for (int r = 0; r < comm->world; r++) {
    char *next;
    long c = strtol(p, &next, 10);
    if (next == p || next >= end)
      return DT_EFORMAT;
    p = next;
    long k = strtol(p, &next, 10);
    if (next == p || next >= end || *next != '\n')
      return DT_EFORMAT;
    p = next + 1;
    e[r] = (split_entry_t){.color = (int)c, .key = (int)k, .rank = r};
  }
  return 0;
}

static int split_run(dt_comm_t *comm, int color, int key, dt_comm_t **out)
{
  int rc;
  double deadline = dt_now_ms() + comm->timeout_ms;
  char *base = str_printf("%s/split%u", comm->prefix, comm->split_seq++);
  char *table = NULL, *child_prefix = NULL;
  size_t table_len = 0;
  split_entry_t *e = calloc((size_t)comm->world, sizeof *e);
  if (!base || !e) {
    rc = DT_ENOMEM;
    goto out;
  }

  char k[512], v[32];
  int vlen = snprintf(v, sizeof v, "%d %d", color, key);
  snprintf(k, sizeof k, "%s/ck/%d", base, comm->rank);
  DT_CHECK_GOTO(comm->kv.put(comm->kv.ud, k, v, (size_t)vlen), rc, out);
  snprintf(k, sizeof k, "%s/table", base);
  if (comm->rank == 0) {
    DT_CHECK_GOTO(split_gather(comm, base, deadline, &table, &table_len), rc, out);
    DT_CHECK_GOTO(comm->kv.put(comm->kv.ud, k, table, table_len), rc, out);
  } else {
    void *val = NULL;
    rc = dt__comm_kv_wait(&comm->kv, k, &val, &table_len, deadline, comm_canceled, comm);
    if (rc == DT_ETIMEDOUT)
      DT_ERROR(COMM, "comm %s: split timed out after %d ms waiting for rank 0's table (%s)",
               comm->prefix, comm->timeout_ms, k);
    if (rc < 0)
      goto out;
    table = val;
  }
  rc = split_parse(comm, table, table_len, e);
  if (rc < 0) {
    DT_ERROR(COMM, "comm %s: malformed split table under %s", comm->prefix, k);
    goto out;
  }

  /* Keep this color's members, ordered by (key, parent rank); NO_COLOR ranks have none. */
  int n = 0, new_rank = -1;
  if (color >= 0) {
    for (int r = 0; r < comm->world; r++)
      if (e[r].color == color)
        e[n++] = e[r];
    qsort(e, (size_t)n, sizeof *e, split_cmp);
    for (int i = 0; i < n; i++)
      if (e[i].rank == comm->rank)
        new_rank = i;
    if (new_rank < 0) { /* our own entry must be there, or the table is not ours */
      DT_ERROR(COMM, "comm %s: split table under %s lacks rank %d", comm->prefix, k, comm->rank);
      rc = DT_EFORMAT;
      goto out;
    }
  }
  child_prefix = color >= 0 ? str_printf("%s/c%d", base, color) : str_printf("%s", base);
  if (!child_prefix) {
    rc = DT_ENOMEM;
    goto out;
  }
  if (comm->be->split) {
    /* The backend's own split (NCCL: ncclCommSplit) is collective over the parent, so NO_COLOR
     * ranks call it too. */
    void *impl = NULL;
    double t0 = dt_now_ms();
    rc = comm->be->split(comm->impl, child_prefix, color, new_rank, n, comm->timeout_ms, &impl);
    if (rc == 0 && impl)
      rc = comm_wrap(out, comm->be, impl, &comm->kv, child_prefix, new_rank, n, comm->timeout_ms,
                     t0);
  } else if (color >= 0) {
    rc = comm_create(out, comm->be, &comm->kv, child_prefix, new_rank, n, comm->timeout_ms,
                     comm->impl);
  } else {
    *out = NULL;
    rc = 0;
  }
  if (rc == 0 && *out)
    (*out)->dev = comm->dev;

out:
  free(child_prefix);
  free(table);
  free(e);
  free(base);
  return rc;
}

int dt_comm_split(dt_comm_t *comm, int color, int key, dt_comm_t **out)
{
  DT_CHECK(comm_enter(comm));
  if (!out || color < DT_COMM_NO_COLOR)
    return DT_EINVAL;
  *out = NULL;
  op_begin(comm, "split", 0, NULL, 0);
  return comm_leave(comm, split_run(comm, color, key, out));
}
