/* nccl_backend.c — the "nccl" communication backend: NCCL communicators behind the C table
 * dt_comm_backend_t (see ../backend.h). Buffers are device memory on the communicator's device.
 *
 * Device. An instance belongs to the CUDA device that was current on the thread that created it
 * (init), or to its parent's device (split). Every entry point switches the calling thread to
 * that device and back, because operations may come from another thread than the one that
 * created the communicator (a comm thread overlapping the backward pass).
 *
 * Why non-blocking NCCL (ncclConfig_t.blocking = 0). A blocking communicator can hang inside
 * ncclCommInitRank (a peer never arrives) or inside a collective's launch, where no timeout and
 * no abort can reach the waiting thread. In non-blocking mode every NCCL call returns at once
 * (often with ncclInProgress) and the calling thread polls: ncclCommGetAsyncError until the
 * call has completed on the host, then cudaStreamQuery until the GPU work has drained. The poll
 * loop owns the deadline (the communicator's timeout, per operation) and watches the abort flag,
 * so a missing peer gives DT_ETIMEDOUT and dt_comm_abort gives DT_ECANCELED promptly. In both
 * cases the waiting thread calls ncclCommAbort, which stops NCCL's kernels and proxy threads;
 * abort() itself only sets a flag, because ncclCommAbort must not race with the thread that
 * uses the communicator. Note that the stream being idle is not enough: until NCCL has finished
 * enqueueing (async state ncclSuccess) the stream may simply not have the kernel yet.
 *
 * Ordering with the caller's GPU work. Each communicator enqueues on its own non-blocking
 * stream and every call returns only once that stream has drained, so results are complete on
 * return. Inputs are read when the call is made: the caller must have finished the GPU work that
 * produces them (e.g. synchronised its stream).
 *
 * Failure model. Any NCCL or CUDA error, timeout or abort ends in ncclCommAbort; the instance
 * then only fails (comm.c stops calling it). NCCL propagates little: a peer blocked on an
 * aborted or dead rank notices when its network transport breaks (DT_EREMOTE) or at its own
 * timeout (DT_ETIMEDOUT).
 *
 * Rendezvous: rank 0 posts ncclGetUniqueId's id under "<prefix>/nccl/id"; the other ranks read
 * it from the key-value store, then all call ncclCommInitRankConfig. Sub-communicators come from
 * ncclCommSplit (collective over the parent; comm.c calls split on every parent rank). */
#include <cuda_runtime.h>
#include <nccl.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"

typedef struct nccl {
  char *prefix; /* its KV prefix */
  char *name;   /* in log lines: the prefix, or "label (prefix)" once nccl_set_label has run */
  int rank, world, timeout_ms;
  int device;               /* CUDA device of the communicator */
  ncclComm_t comm;          /* NULL until created, and again once aborted or destroyed */
  cudaStream_t stream;      /* every operation enqueues here */
  float *scratch;           /* (1) device float for the barrier's all-reduce */
  int failed;               /* first failure (0 while healthy): destroy then aborts */
  atomic_int aborted;       /* set by nccl_abort from any thread */
  const struct nccl *share; /* during init only: an instance whose abort cancels this init */
} nccl_t;

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* In non-blocking mode ncclInProgress means "issued, poll for completion", not a failure. */
static int nccl_ok(ncclResult_t r)
{
  return r == ncclSuccess || r == ncclInProgress;
}

static int nccl_code(ncclResult_t r)
{
  switch (r) {
  case ncclSuccess:
  case ncclInProgress:
    return 0;
  case ncclUnhandledCudaError:
    return DT_ECUDA;
  case ncclSystemError: /* a socket or a system call failed on this host */
    return DT_EIO;
  case ncclRemoteError: /* a peer died or the network failed */
    return DT_EREMOTE;
  default: /* internal error, invalid argument or usage: a bug here or in NCCL */
    return DT_ENCCL;
  }
}

static int cuda_code(cudaError_t e)
{
  return e == cudaErrorMemoryAllocation ? DT_ENOMEM : DT_ECUDA;
}

/* Logs a failed NCCL call once, at the caller's file:line, with NCCL's messages; returns the
 * DT_E* code for it. */
static int nccl_fail_at(const nccl_t *c, ncclResult_t r, const char *what, const char *file,
                        int line)
{
  if (dt_log_enabled(DT_LOG_ERROR, DT_SUBSYS_COMM))
    dt_log_write(DT_LOG_ERROR, DT_SUBSYS_COMM, file, line, "comm %s rank %d/%d: %s failed: %s (%s)",
                 c->name, c->rank, c->world, what, ncclGetErrorString(r), ncclGetLastError(NULL));
  return nccl_code(r);
}
#define NB_NCCL_FAIL(c, r, what) nccl_fail_at((c), (r), (what), __FILE__, __LINE__)

/* A CUDA call that must succeed: log (once, at the call site) and jump. */
#define NB_CUDA_CHECK_GOTO(c, call, ret, label)                                                    \
  do {                                                                                             \
    cudaError_t nb__e = (call);                                                                    \
    if (nb__e != cudaSuccess) {                                                                    \
      DT_ERROR(COMM, "comm %s rank %d/%d: %s failed: %s (%s)", (c)->name, (c)->rank, (c)->world,   \
               #call, cudaGetErrorName(nb__e), cudaGetErrorString(nb__e));                         \
      (ret) = cuda_code(nb__e);                                                                    \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

/* The first failure among the calls of one group (ncclInProgress is none). */
static ncclResult_t first_err(ncclResult_t acc, ncclResult_t r)
{
  return nccl_ok(acc) ? r : acc;
}

/* ------------------------------------------------------------------------------------------ */
/* Device switching, waiting, aborting                                                         */
/* ------------------------------------------------------------------------------------------ */

/* Makes c's device current on this thread; *prev receives the device to restore (or -1). */
static int dev_enter(const nccl_t *c, int *prev)
{
  int rc = 0;
  *prev = -1;
  NB_CUDA_CHECK_GOTO(c, cudaGetDevice(prev), rc, out);
  if (*prev != c->device)
    NB_CUDA_CHECK_GOTO(c, cudaSetDevice(c->device), rc, out);
out:
  return rc;
}

static void dev_leave(const nccl_t *c, int prev)
{
  if (prev >= 0 && prev != c->device)
    (void)cudaSetDevice(prev);
}

static int canceled(const nccl_t *c)
{
  return atomic_load(&c->aborted) || (c->share && atomic_load(&c->share->aborted));
}

static int canceled_cb(void *arg)
{
  return canceled(arg);
}

/* Between polls: spin briefly (a small collective finishes in microseconds), then yield, then
 * sleep 50 us, which bounds the cost of a long wait to a few percent of one core. */
static void backoff(unsigned polls)
{
  if (polls < 16)
    return;
  if (polls < 256) {
    sched_yield();
    return;
  }
  struct timespec ts = {0, 50 * 1000};
  nanosleep(&ts, NULL);
}

/* Polls until no NCCL call is in progress on comm and, if stream is set, the stream has drained.
 * NCCL and CUDA errors are logged here; DT_ETIMEDOUT (deadline) and DT_ECANCELED (abort of c,
 * or of the instance c->share) are returned unlogged, for the caller to say what it waited for.
 * c names the instance in log lines and whose abort flag counts. */
static int wait_done(const nccl_t *c, ncclComm_t comm, cudaStream_t stream, double deadline_ms,
                     const char *what)
{
  for (unsigned polls = 0;; polls++) {
    ncclResult_t st = ncclInProgress;
    ncclResult_t r = ncclCommGetAsyncError(comm, &st);
    if (r != ncclSuccess)
      return NB_NCCL_FAIL(c, r, "ncclCommGetAsyncError");
    if (st != ncclSuccess && st != ncclInProgress)
      return NB_NCCL_FAIL(c, st, what);
    if (st == ncclSuccess) {
      if (!stream)
        return 0;
      cudaError_t e = cudaStreamQuery(stream);
      if (e == cudaSuccess)
        return 0;
      if (e != cudaErrorNotReady) {
        DT_ERROR(COMM, "comm %s rank %d/%d: %s failed on the GPU: %s (%s)", c->name, c->rank,
                 c->world, what, cudaGetErrorName(e), cudaGetErrorString(e));
        return cuda_code(e);
      }
    }
    if (canceled(c))
      return DT_ECANCELED;
    if (dt_now_ms() >= deadline_ms)
      return DT_ETIMEDOUT;
    backoff(polls);
  }
}

/* Aborts c's NCCL communicator (stops its kernels and proxy threads, frees it) and records the
 * failure, so that destroy does not try an orderly shutdown. */
static void kill_comm(nccl_t *c, int rc)
{
  if (!c->failed)
    c->failed = rc < 0 ? rc : DT_ECANCELED;
  if (!c->comm)
    return;
  ncclResult_t r = ncclCommAbort(c->comm);
  c->comm = NULL;
  if (!nccl_ok(r))
    (void)NB_NCCL_FAIL(c, r, "ncclCommAbort");
}

/* Orderly shutdown: ncclCommFinalize flushes what NCCL still has in flight (the proxy may still
 * be sending after our kernels finished) and waits for this communicator's other ranks on this
 * host to finalize too; we give it the communicator's timeout, then abort. */
static void close_comm(nccl_t *c)
{
  if (!c->comm)
    return;
  if (c->failed || atomic_load(&c->aborted)) {
    kill_comm(c, c->failed);
    return;
  }
  double deadline = dt_now_ms() + c->timeout_ms;
  ncclResult_t r = ncclCommFinalize(c->comm);
  int rc = nccl_ok(r) ? wait_done(c, c->comm, NULL, deadline, "ncclCommFinalize")
                      : NB_NCCL_FAIL(c, r, "ncclCommFinalize");
  if (rc < 0) {
    if (rc == DT_ETIMEDOUT)
      DT_WARN(COMM, "comm %s rank %d/%d: NCCL did not finalize within %d ms; aborting it", c->name,
              c->rank, c->world, c->timeout_ms);
    kill_comm(c, rc);
    return;
  }
  r = ncclCommDestroy(c->comm);
  c->comm = NULL;
  if (!nccl_ok(r))
    (void)NB_NCCL_FAIL(c, r, "ncclCommDestroy");
}

/* ------------------------------------------------------------------------------------------ */
/* Lifetime                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* Frees an instance in any state of construction. The caller has made c's device current. */
static void nccl_free(nccl_t *c)
{
  if (!c)
    return;
  close_comm(c);
  if (c->stream)
    (void)cudaStreamDestroy(c->stream);
  if (c->scratch)
    (void)cudaFree(c->scratch);
  free(c->prefix);
  free(c->name);
  free(c);
}

/* An instance with its stream and scratch, no communicator yet. device < 0: the current one
 * (which the caller has otherwise made current). */
static int nccl_new(nccl_t **out, const char *prefix, int rank, int world, int timeout_ms,
                    int device)
{
  int rc = DT_ENOMEM;
  nccl_t *c = calloc(1, sizeof *c);
  if (!c)
    return DT_ENOMEM;
  c->rank = rank;
  c->world = world;
  c->timeout_ms = timeout_ms;
  atomic_init(&c->aborted, 0);
  c->prefix = strdup(prefix);
  c->name = strdup(prefix);
  if (!c->prefix || !c->name)
    goto fail;
  if (device < 0)
    NB_CUDA_CHECK_GOTO(c, cudaGetDevice(&device), rc, fail);
  c->device = device;
  NB_CUDA_CHECK_GOTO(c, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), rc, fail);
  NB_CUDA_CHECK_GOTO(c, cudaMalloc((void **)&c->scratch, sizeof(float)), rc, fail);
  *out = c;
  return 0;

fail:
  nccl_free(c);
  return rc;
}

/* Rank 0 creates the NCCL id and posts it; the others wait for it. */
static int exchange_id(nccl_t *c, const dt_kv_t *kv, double deadline_ms, ncclUniqueId *id)
{
  int rc;
  size_t klen = strlen(c->prefix) + sizeof "/nccl/id";
  char *key = malloc(klen);
  if (!key)
    return DT_ENOMEM;
  snprintf(key, klen, "%s/nccl/id", c->prefix);
  if (c->rank == 0) {
    ncclResult_t r = ncclGetUniqueId(id);
    rc = nccl_ok(r) ? kv->put(kv->ud, key, id, sizeof *id) : NB_NCCL_FAIL(c, r, "ncclGetUniqueId");
    if (nccl_ok(r) && rc < 0)
      DT_ERROR(COMM, "comm %s rank %d/%d: posting the NCCL id under %s failed: %s", c->name,
               c->rank, c->world, key, dt_strerror(rc));
    goto out;
  }
  void *val = NULL;
  size_t len = 0;
  rc = dt__comm_kv_wait(kv, key, &val, &len, deadline_ms, canceled_cb, c);
  if (rc == DT_ETIMEDOUT)
    DT_ERROR(COMM,
             "comm %s rank %d/%d: rendezvous timed out after %d ms: rank 0 never posted the "
             "NCCL id (%s)",
             c->name, c->rank, c->world, c->timeout_ms, key);
  else if (rc < 0 && rc != DT_ECANCELED)
    DT_ERROR(COMM, "comm %s rank %d/%d: reading %s failed: %s", c->name, c->rank, c->world, key,
             dt_strerror(rc));
  if (rc == 0 && len != sizeof *id) {
    DT_ERROR(COMM, "comm %s rank %d/%d: %s holds %zu bytes, expected an NCCL id of %zu", c->name,
             c->rank, c->world, key, len, sizeof *id);
    rc = DT_EFORMAT;
  }
  if (rc == 0)
    memcpy(id, val, sizeof *id);
  free(val);
out:
  free(key);
  return rc;
}

static ncclConfig_t nonblocking_config(void)
{
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  return cfg;
}

/* share: see backend.h; NCCL shares nothing between our instances, so only its abort counts. */
static int nccl_init(void **impl, const dt_kv_t *kv, const char *prefix, int rank, int world,
                     int timeout_ms, void *share)
{
  double deadline = dt_now_ms() + timeout_ms;
  nccl_t *c = NULL;
  DT_CHECK(nccl_new(&c, prefix, rank, world, timeout_ms, -1));
  c->share = share;
  ncclUniqueId id;
  int rc = exchange_id(c, kv, deadline, &id);
  if (rc < 0)
    goto fail;
  ncclConfig_t cfg = nonblocking_config();
  ncclResult_t r = ncclCommInitRankConfig(&c->comm, world, id, rank, &cfg);
  rc = nccl_ok(r) ? wait_done(c, c->comm, NULL, deadline, "ncclCommInitRankConfig")
                  : NB_NCCL_FAIL(c, r, "ncclCommInitRankConfig");
  if (rc == DT_ETIMEDOUT)
    DT_ERROR(COMM, "comm %s rank %d/%d: rendezvous timed out after %d ms: peers never joined",
             prefix, rank, world, timeout_ms);
  if (rc < 0) {
    kill_comm(c, rc);
    goto fail;
  }
  c->share = NULL;
  *impl = c;
  return 0;

fail:
  nccl_free(c);
  return rc;
}

/* Collective over the parent p: every parent rank calls it, NO_COLOR ranks included. new_rank is
 * passed to NCCL as the key, so NCCL orders the child exactly as comm.c's split table did. While
 * ncclCommSplit runs, the child's handle is not published yet and the parent reports
 * ncclInProgress, so we poll the parent first, then the child. On failure both are aborted: the
 * parent's abort is what stops the child's initialisation, and comm.c poisons the parent
 * anyway. */
static int nccl_split(void *parent, const char *prefix, int color, int new_rank, int new_world,
                      int timeout_ms, void **impl)
{
  nccl_t *p = parent, *c = NULL;
  double deadline = dt_now_ms() + timeout_ms;
  ncclComm_t child = NULL;
  int prev, rc;
  *impl = NULL;
  DT_CHECK(dev_enter(p, &prev));
  if (color >= 0) {
    rc = nccl_new(&c, prefix, new_rank, new_world, timeout_ms, p->device);
    if (rc < 0)
      goto out;
  }
  ncclConfig_t cfg = nonblocking_config();
  ncclResult_t r =
      ncclCommSplit(p->comm, color >= 0 ? color : NCCL_SPLIT_NOCOLOR, new_rank, &child, &cfg);
  rc = nccl_ok(r) ? wait_done(p, p->comm, NULL, deadline, "ncclCommSplit")
                  : NB_NCCL_FAIL(p, r, "ncclCommSplit");
  if (rc == 0 && child)
    rc = wait_done(p, child, NULL, deadline, "ncclCommSplit");
  if (rc == DT_ETIMEDOUT)
    DT_ERROR(COMM,
             "comm %s rank %d/%d: split timed out after %d ms: a parent rank never called split "
             "or a child rank never joined",
             p->name, p->rank, p->world, timeout_ms);
  if (rc == 0 && color >= 0) {
    int nr = -1, nw = -1;
    if (!child || ncclCommUserRank(child, &nr) != ncclSuccess ||
        ncclCommCount(child, &nw) != ncclSuccess || nr != new_rank || nw != new_world) {
      DT_ERROR(COMM, "comm %s rank %d/%d: NCCL's split made rank %d of %d, the table %d of %d",
               prefix, new_rank, new_world, nr, nw, new_rank, new_world);
      rc = DT_EINTERNAL;
    }
  }
  if (rc < 0) {
    kill_comm(p, rc);
    if (child)
      (void)ncclCommAbort(child);
    goto out;
  }
  if (c) {
    c->comm = child;
    *impl = c;
    c = NULL;
  }
out:
  nccl_free(c);
  dev_leave(p, prev);
  return rc;
}

static void nccl_destroy(void *impl)
{
  nccl_t *c = impl;
  int prev;
  if (!c)
    return;
  int device = c->device;
  int rc = dev_enter(c, &prev);
  nccl_free(c); /* with the wrong device current, NCCL and CUDA fail and it still frees memory */
  if (rc == 0 && prev >= 0 && prev != device)
    (void)cudaSetDevice(prev);
}

/* Only a flag: the thread inside the operation (or the next one) calls ncclCommAbort. */
static void nccl_abort(void *impl)
{
  atomic_store(&((nccl_t *)impl)->aborted, 1);
}

/* ------------------------------------------------------------------------------------------ */
/* Operations                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* Every operation: op_begin, enqueue on c->stream, op_end(the enqueue's result). */
static int op_begin(nccl_t *c, int *prev)
{
  *prev = -1;
  if (!c->comm)
    return c->failed ? c->failed : DT_EINTERNAL;
  return dev_enter(c, prev);
}

static int op_end(nccl_t *c, const char *what, ncclResult_t enq, int prev)
{
  int rc = nccl_ok(enq) ? wait_done(c, c->comm, c->stream, dt_now_ms() + c->timeout_ms, what)
                        : NB_NCCL_FAIL(c, enq, what);
  if (rc == DT_ETIMEDOUT)
    DT_ERROR(COMM,
             "comm %s rank %d/%d: %s timed out after %d ms (a peer is missing or stalled); "
             "aborting the communicator",
             c->name, c->rank, c->world, what, c->timeout_ms);
  if (rc < 0)
    kill_comm(c, rc);
  dev_leave(c, prev);
  return rc;
}

static ncclRedOp_t red_op(dt_comm_op_t op)
{
  /* For float, NCCL's average may scale each contribution by 1/world before summing (see the
   * note on DT_COMM_AVG in comm.h). */
  return op == DT_COMM_AVG ? ncclAvg : ncclSum;
}

static int all_equal(const size_t *counts, int world)
{
  for (int r = 1; r < world; r++)
    if (counts[r] != counts[0])
      return 0;
  return 1;
}

static int nccl_all_reduce(void *impl, float *buf, size_t n, dt_comm_op_t op)
{
  nccl_t *c = impl;
  int prev;
  DT_CHECK(op_begin(c, &prev));
  ncclResult_t r = ncclAllReduce(buf, buf, n, ncclFloat, red_op(op), c->comm, c->stream);
  return op_end(c, "all-reduce", r, prev);
}

/* Uneven chunks: one ncclReduce per non-empty chunk, to the rank that owns it, all in one group
 * (NCCL launches them together). A non-root's receive buffer is unused: NULL. */
static int nccl_reduce_scatter(void *impl, const float *in, float *out, const size_t *counts,
                               dt_comm_op_t op)
{
  nccl_t *c = impl;
  int prev;
  DT_CHECK(op_begin(c, &prev));
  ncclResult_t r;
  if (all_equal(counts, c->world)) {
    r = ncclReduceScatter(in, out, counts[0], ncclFloat, red_op(op), c->comm, c->stream);
  } else {
    size_t off = 0;
    r = ncclGroupStart();
    for (int root = 0; root < c->world; off += counts[root], root++)
      if (counts[root])
        r = first_err(r, ncclReduce(in + off, root == c->rank ? out : NULL, counts[root], ncclFloat,
                                    red_op(op), root, c->comm, c->stream));
    r = first_err(r, ncclGroupEnd());
  }
  return op_end(c, "reduce-scatter", r, prev);
}

/* Uneven counts: one ncclBroadcast per non-empty contribution, from its owner into its place in
 * out, all in one group. A non-root's send buffer is unused: we pass its receive place. */
static int nccl_all_gather(void *impl, const float *in, float *out, const size_t *counts)
{
  nccl_t *c = impl;
  int prev;
  DT_CHECK(op_begin(c, &prev));
  ncclResult_t r;
  if (all_equal(counts, c->world)) {
    r = ncclAllGather(in, out, counts[0], ncclFloat, c->comm, c->stream);
  } else {
    size_t off = 0;
    r = ncclGroupStart();
    for (int root = 0; root < c->world; off += counts[root], root++)
      if (counts[root])
        r = first_err(r, ncclBroadcast(root == c->rank ? in : out + off, out + off, counts[root],
                                       ncclFloat, root, c->comm, c->stream));
    r = first_err(r, ncclGroupEnd());
  }
  return op_end(c, "all-gather", r, prev);
}

static int nccl_broadcast(void *impl, float *buf, size_t n, int root)
{
  nccl_t *c = impl;
  int prev;
  DT_CHECK(op_begin(c, &prev));
  ncclResult_t r = ncclBroadcast(buf, buf, n, ncclFloat, root, c->comm, c->stream);
  return op_end(c, "broadcast", r, prev);
}

/* tag is unused: NCCL has no tags and matches sends and receives per peer in issue order. Our
 * calls are blocking, so at most one send and one receive per peer are in flight, and comm.h's
 * "pair up by (peer, tag) in order" is that same order. NCCL cannot check that sizes match (the
 * cpu backend can): a mismatch is undefined and usually ends in a timeout. */
static int nccl_p2p(void *impl, const dt_comm_p2p_t *ops, int n)
{
  nccl_t *c = impl;
  int prev;
  DT_CHECK(op_begin(c, &prev));
  ncclResult_t r = ncclGroupStart();
  for (int i = 0; i < n; i++)
    r = first_err(
        r, ops[i].recv
               ? ncclRecv(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, c->comm, c->stream)
               : ncclSend(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, c->comm, c->stream));
  r = first_err(r, ncclGroupEnd());
  return op_end(c, "send/recv", r, prev);
}

static int nccl_barrier(void *impl)
{
  nccl_t *c = impl;
  int prev;
  DT_CHECK(op_begin(c, &prev));
  ncclResult_t r = ncclAllReduce(c->scratch, c->scratch, 1, ncclFloat, ncclSum, c->comm, c->stream);
  return op_end(c, "barrier", r, prev);
}

static void nccl_set_label(void *impl, const char *label)
{
  nccl_t *c = impl;
  const size_t n = strlen(label) + strlen(c->prefix) + sizeof " ()";
  char *name = malloc(n);
  if (!name)
    return; /* the prefix alone names it */
  snprintf(name, n, "%s (%s)", label, c->prefix);
  free(c->name);
  c->name = name;
}

const dt_comm_backend_t dt__comm_nccl_backend = {
    .name = "nccl",
    .device_memory = 1,
    .init = nccl_init,
    .destroy = nccl_destroy,
    .abort = nccl_abort,
    .all_reduce = nccl_all_reduce,
    .reduce_scatter = nccl_reduce_scatter,
    .all_gather = nccl_all_gather,
    .broadcast = nccl_broadcast,
    .p2p = nccl_p2p,
    .barrier = nccl_barrier,
    .split = nccl_split,
    .set_label = nccl_set_label,
};
