/* nccl_host.cc — NCCL on the host, for the emulated GPUs of cuda_host.cc: the emulated trainer
 * and test_comm_nccl_on_emul link it instead of libnccl, so worker/comm/nccl's backend, and the
 * GPU trainer on it, run between emulated GPUs in CI (in threads of one process or in processes).
 * Every function is defined with the prototype nccl.h declares. The transport is distrain's
 * "cpu" communicator (worker/comm, Gloo over TCP): a communicator here is one of those, its
 * rendezvous a directory-backed key-value store whose directory ncclGetUniqueId creates and
 * writes into the id (the process that made it removes it at exit).
 *
 * What it checks, as NCCL would fail or misbehave: every buffer lies in a live cudaMalloc
 * allocation (host memory would fault on a GPU); the data types are the ones distrain sends
 * (ncclFloat for collectives and reductions, bytes for send/recv); a group holds either
 * collectives or sends and receives of one communicator; two ranks of one communicator on one
 * GPU are refused at init (ncclInvalidUsage, "Duplicate GPU detected"), as NCCL refuses them;
 * operations run on a GPU one at a time (an operation that starts while another is in flight
 * there fails: see gpu_acquire).
 *
 * What differs from NCCL, by design:
 * - Each communicator has a thread of its own (its worker) that runs its rendezvous, its splits
 *   and its operations one at a time, in call order, on the host; every call returns at once.
 *   Init and split leave ncclCommGetAsyncError at ncclInProgress until they are done; an
 *   operation, called after the work already queued on its stream has run (the earliest moment
 *   the GPU could start it), holds that stream with a gate (cuda_host.h) until it is done, so
 *   cudaStreamQuery answers cudaErrorNotReady while it waits for its peers, as for NCCL's
 *   kernel. Inputs the caller has not finished producing (a missing synchronization) are read
 *   stale, as they may be on a GPU; the tests see the wrong values.
 * - ncclCommAbort cancels the operation the worker is blocked in (the transport's abort) and
 *   skips the ones not started. A rendezvous cannot be cancelled: an aborted one runs on, its
 *   result unobserved, until the transport's timeout (DT_EMUL_NCCL_TIMEOUT_MS, default 120000).
 *   A blocking communicator (no config, or blocking = 1) differs only in that init and split
 *   return once done.
 * - ncclAvg divides the sum by the ranks after summing (NCCL may scale each contribution
 *   first); reductions run in the transport's order, deterministic from run to run. */
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <ftw.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_host.h"

extern "C" {
#include "comm.h"
#include "dt_error.h"
#include "dt_util.h"
}

/* ------------------------------------------------------------------------------------------ */
/* Communicators                                                                               */
/* ------------------------------------------------------------------------------------------ */

/* The rendezvous store of a communicator and its splits (they rendezvous through the parent's). */
struct rendezvous {
  dt_kv_t kv = {};
  ~rendezvous()
  {
    dt_kv_file_destroy(&kv);
  }
};

/* The directories ncclGetUniqueId made in this process, removed when it exits: by then its ranks
 * are done with them, and so are the other processes' (a peer may read rank 0's split table
 * after rank 0 has moved on, so no communicator's end is a safe moment). */
static std::mutex g_dirs_mu;
static std::vector<std::string> g_dirs;

static void remove_dirs(void)
{
  std::lock_guard<std::mutex> lock(g_dirs_mu);
  for (const std::string &d : g_dirs)
    nftw(
        d.c_str(),
        [](const char *path, const struct stat *, int, struct FTW *) { return remove(path); }, 8,
        FTW_DEPTH | FTW_PHYS);
  g_dirs.clear();
}

/* A communicator. Every call on it returns at once, as a non-blocking NCCL's do: a thread of its
 * own (its worker) runs its rendezvous, the splits of it and its operations, one at a time in
 * the order they were called, and the caller polls ncclCommGetAsyncError (ncclInProgress until
 * an init or split is done) and, for an operation, its stream (held by a gate until the
 * operation is done). ncclCommAbort cancels what the worker is blocked in (the transport's
 * abort) and skips what it has not started; a rendezvous, which the transport cannot cancel,
 * runs on until its own timeout, unobserved. The handle, the worker and a split in progress
 * each hold a reference; the last one frees the communicator and its transport (the handle's,
 * in ncclCommDestroy and ncclCommAbort, which wait for the worker to end, but for an aborted
 * rendezvous). */
struct ncclComm {
  std::atomic<dt_comm_t *> c{nullptr}; /* the transport, once the rendezvous made it */
  std::shared_ptr<rendezvous> rv;
  std::atomic<int> rank{0}, world{0};
  int device = 0;
  std::atomic<int> async{ncclSuccess}; /* ncclInProgress, then the first failure if any */
  std::atomic<int> refs{2};            /* the handle's and the worker's */
  std::atomic<bool> aborted{false};
  std::mutex mu; /* jobs, closing */
  std::condition_variable cv;
  std::deque<std::function<void(bool canceled)>> jobs;
  bool closing = false; /* the handle is gone: the worker ends after its jobs */
  bool ended = false;   /* the worker has ended */
};

static void unref(ncclComm_t comm)
{
  if (--comm->refs == 0) {
    dt_comm_destroy(comm->c.load());
    delete comm;
  }
}

/* The last failure's message, for ncclGetLastError (NCCL keeps one per process too). */
static std::mutex &last_mu(void)
{
  static std::mutex *m = new std::mutex(); /* never destroyed: workers may outlive main */
  return *m;
}
static char g_last[512];

/* Records a failure: the message on stderr and as the last error, and r as comm's async error
 * unless it has one already. Returns r. */
static ncclResult_t failed(ncclComm_t comm, ncclResult_t r, const char *fmt, ...)
{
  char msg[sizeof g_last];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "nccl_host: %s\n", msg);
  {
    std::lock_guard<std::mutex> lock(last_mu());
    memcpy(g_last, msg, sizeof msg);
  }
  int cur = comm ? comm->async.load() : ncclSuccess;
  while (comm && (cur == ncclSuccess || cur == ncclInProgress) &&
         !comm->async.compare_exchange_weak(cur, r)) {
  }
  return r;
}

/* A transport failure: the call "succeeds" (non-blocking NCCL reports failures asynchronously)
 * and the communicator's async error carries it. */
static ncclResult_t transport(ncclComm_t comm, int rc, const char *what)
{
  if (rc == 0)
    return ncclSuccess;
  (void)failed(comm, rc == DT_EREMOTE || rc == DT_ETIMEDOUT ? ncclRemoteError : ncclSystemError,
               "%s on rank %d of %d: %s", what, comm->rank.load(), comm->world.load(),
               dt_strerror(rc));
  return ncclSuccess;
}

static int timeout_ms(void)
{
  const char *s = getenv("DT_EMUL_NCCL_TIMEOUT_MS");
  return s && atoi(s) > 0 ? atoi(s) : 120000;
}

/* The machine's GPU behind the current device: cuda_host.cc names GPU n 0000:00:<n>.0. */
static int machine_gpu(int device)
{
  char bus[32];
  unsigned dom = 0, b = 0, dev = 0;
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) != cudaSuccess ||
      sscanf(bus, "%x:%x:%x", &dom, &b, &dev) != 3)
    return -1;
  return (int)dev;
}

/* Ends an init or split on the worker: takes the joined transport c (or the failure rc), refuses
 * two ranks on one GPU, and leaves ncclInProgress. */
static void joined(ncclComm_t comm, dt_comm_t *c, int rc, const char *what)
{
  if (rc != 0) {
    (void)failed(comm, ncclSystemError, "%s of rank %d of %d: %s", what, comm->rank.load(),
                 comm->world.load(), dt_strerror(rc));
    return;
  }
  comm->c = c;
  comm->rank = dt_comm_rank(c);
  comm->world = dt_comm_world(c);
  const int world = comm->world, rank = comm->rank;
  std::vector<float> gpus((size_t)world, -1.0f);
  const float mine = (float)machine_gpu(comm->device);
  rc = dt_comm_all_gather(c, &mine, gpus.data(), 1);
  if (rc != 0) {
    (void)failed(comm, ncclSystemError, "%s: %s", what, dt_strerror(rc));
    return;
  }
  for (int r = 0; r < world; r++)
    if (r != rank && gpus[(size_t)r] == mine) {
      (void)failed(comm, ncclInvalidUsage,
                   "Duplicate GPU detected : rank %d and rank %d both on GPU %d", DT_MIN(r, rank),
                   DT_MAX(r, rank), (int)mine);
      return;
    }
  int cur = ncclInProgress;
  comm->async.compare_exchange_strong(cur, ncclSuccess);
}

/* A communicator whose rendezvous is still to come (async ncclInProgress), its worker running. */
static ncclComm_t comm_new(int rank, int world, std::shared_ptr<rendezvous> rv)
{
  ncclComm_t comm = new ncclComm;
  comm->rank = rank;
  comm->world = world;
  comm->rv = std::move(rv);
  comm->async = ncclInProgress;
  (void)cudaGetDevice(&comm->device);
  std::thread([comm] {
    for (;;) {
      std::function<void(bool)> job;
      {
        std::unique_lock<std::mutex> lock(comm->mu);
        comm->cv.wait(lock, [comm] { return !comm->jobs.empty() || comm->closing; });
        if (comm->jobs.empty())
          break;
        job = std::move(comm->jobs.front());
        comm->jobs.pop_front();
      }
      job(comm->aborted.load());
    }
    {
      std::lock_guard<std::mutex> lock(comm->mu);
      comm->ended = true;
      comm->cv.notify_all();
    }
    unref(comm);
  }).detach();
  return comm;
}

/* Queues job on comm's worker; canceled tells it that the communicator was aborted first. */
static void post(ncclComm_t comm, std::function<void(bool canceled)> job)
{
  std::lock_guard<std::mutex> lock(comm->mu);
  comm->jobs.push_back(std::move(job));
  comm->cv.notify_all(); /* the worker, not a closer waiting on the same variable */
}

/* The handle's end, once the worker has ended (abort cancels the transport's blocked operation
 * and the jobs not started), so that the communicator is gone when the call returns, as NCCL's
 * is. Except for an aborted rendezvous, which nothing can cancel: its worker ends on its own. */
static void comm_close(ncclComm_t comm, bool abort)
{
  if (abort) {
    comm->aborted = true;
    dt_comm_t *c = comm->c.load();
    if (c)
      (void)dt_comm_abort(c);
  }
  {
    std::unique_lock<std::mutex> lock(comm->mu);
    comm->closing = true;
    comm->cv.notify_all();
    const bool joining = comm->c.load() || comm->async.load() != ncclInProgress;
    if (!abort || joining)
      comm->cv.wait(lock, [comm] { return comm->ended; });
  }
  unref(comm);
}

/* A blocking communicator's call returns when its init or split is done (polling its state). */
static ncclResult_t settle(ncclComm_t comm, const ncclConfig_t *config)
{
  if (config && !config->blocking)
    return ncclInProgress;
  while (comm->async.load() == ncclInProgress)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  return (ncclResult_t)comm->async.load();
}

extern "C" {

ncclResult_t ncclGetVersion(int *version)
{
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId)
{
  const char *tmp = getenv("TMPDIR");
  char dir[NCCL_UNIQUE_ID_BYTES];
  if (snprintf(dir, sizeof dir, "%s/dt-nccl-XXXXXX", tmp && *tmp ? tmp : "/tmp") >=
          (int)sizeof dir ||
      !mkdtemp(dir))
    return failed(nullptr, ncclSystemError, "ncclGetUniqueId: no directory for the rendezvous");
  memset(uniqueId, 0, sizeof *uniqueId);
  memcpy(uniqueId->internal, dir, strlen(dir));
  std::lock_guard<std::mutex> lock(g_dirs_mu);
  static bool at_exit;
  if (!at_exit)
    at_exit = atexit(remove_dirs) == 0;
  g_dirs.push_back(dir);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config)
{
  *comm = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return failed(nullptr, ncclInvalidArgument, "init: rank %d of %d", rank, nranks);
  std::shared_ptr<rendezvous> rv = std::make_shared<rendezvous>();
  const std::string dir(commId.internal, strnlen(commId.internal, sizeof commId.internal));
  if (dt_kv_file_create(&rv->kv, dir.c_str()) != 0)
    return failed(nullptr, ncclSystemError, "init: no rendezvous store in %s", dir.c_str());
  ncclComm_t c = comm_new(rank, nranks, rv);
  post(c, [c, rank, nranks](bool canceled) {
    if (canceled)
      return;
    dt_comm_t *t = nullptr;
    int rc = dt_comm_init(&t, "cpu", &c->rv->kv, "nccl", rank, nranks, timeout_ms());
    joined(c, t, rc, "init");
  });
  *comm = c;
  return settle(c, config);
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank)
{
  return ncclCommInitRankConfig(comm, nranks, commId, rank, nullptr);
}

/* The parent's worker runs the split (collective over the parent); the child, if any, holds its
 * rendezvous state until then. */
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config)
{
  *newcomm = nullptr;
  ncclComm_t child = nullptr;
  if (color != NCCL_SPLIT_NOCOLOR) {
    child = comm_new(-1, -1, comm->rv);
    child->refs++; /* the split's */
  }
  int cur = ncclSuccess;
  comm->async.compare_exchange_strong(cur, ncclInProgress);
  post(comm, [comm, child, color, key](bool canceled) {
    dt_comm_t *t = nullptr;
    int rc = canceled
                 ? DT_ECANCELED
                 : dt_comm_split(comm->c.load(),
                                 color == NCCL_SPLIT_NOCOLOR ? DT_COMM_NO_COLOR : color, key, &t);
    if (rc != 0)
      (void)failed(comm, ncclSystemError, "ncclCommSplit: %s", dt_strerror(rc));
    int busy = ncclInProgress;
    comm->async.compare_exchange_strong(busy, ncclSuccess);
    if (child) {
      joined(child, t, rc, "ncclCommSplit");
      unref(child);
    }
  });
  *newcomm = child;
  return settle(child ? child : comm, config);
}

ncclResult_t ncclCommFinalize(ncclComm_t)
{
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
  if (comm)
    comm_close(comm, false);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm)
{
  if (comm)
    comm_close(comm, true);
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError)
{
  *asyncError = (ncclResult_t)comm->async.load();
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count)
{
  *count = comm->world.load();
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank)
{
  *rank = comm->rank.load();
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t result)
{
  switch (result) {
  case ncclSuccess:
    return "no error";
  case ncclUnhandledCudaError:
    return "unhandled cuda error";
  case ncclSystemError:
    return "unhandled system error";
  case ncclInternalError:
    return "internal error";
  case ncclInvalidArgument:
    return "invalid argument";
  case ncclInvalidUsage:
    return "invalid usage";
  case ncclRemoteError:
    return "remote process exited or there was a network error";
  case ncclInProgress:
    return "NCCL operation in progress";
  default:
    return "unknown result code";
  }
}

const char *ncclGetLastError(ncclComm_t)
{
  static thread_local char copy[sizeof g_last];
  std::lock_guard<std::mutex> lock(last_mu());
  memcpy(copy, g_last, sizeof copy);
  return copy;
}

} /* extern "C" */

/* ------------------------------------------------------------------------------------------ */
/* Operations                                                                                  */
/* ------------------------------------------------------------------------------------------ */

typedef enum {
  OP_ALL_REDUCE,
  OP_REDUCE_SCATTER,
  OP_ALL_GATHER,
  OP_BROADCAST,
  OP_REDUCE,
  OP_P2P
} kind_t;

typedef struct {
  kind_t kind;
  const void *send;
  void *recv;
  size_t count;   /* elements: per rank for reduce-scatter's recv and all-gather's send */
  ncclRedOp_t op; /* reductions: ncclSum or ncclAvg (submit checks) */
  int root;       /* broadcast, reduce; the peer of a send or receive */
  int is_recv;
  ncclComm_t comm;
  cudaStream_t stream;
} op_t;

static thread_local int t_group_depth;
static thread_local std::vector<op_t> t_group;

static bool in_device(const void *p, size_t bytes)
{
  return bytes == 0 || dt_emul_is_device_range(p, bytes);
}

static ncclResult_t run_collective(const op_t &o)
{
  ncclComm_t comm = o.comm;
  dt_comm_t *c = comm->c.load();
  const size_t F = sizeof(float), n = o.count;
  float *recv = (float *)o.recv;
  const dt_comm_op_t op = o.op == ncclAvg ? DT_COMM_AVG : DT_COMM_SUM;
  switch (o.kind) {
  case OP_ALL_REDUCE:
    if (o.send != o.recv)
      memcpy(recv, o.send, n * F);
    return transport(comm, dt_comm_all_reduce(c, recv, n, op), "all-reduce");
  case OP_REDUCE_SCATTER:
    return transport(comm, dt_comm_reduce_scatter(c, (const float *)o.send, recv, n, op),
                     "reduce-scatter");
  case OP_ALL_GATHER:
    return transport(comm, dt_comm_all_gather(c, (const float *)o.send, recv, n), "all-gather");
  case OP_BROADCAST:
    if (comm->rank.load() == o.root && o.send != o.recv)
      memcpy(recv, o.send, n * F);
    return transport(comm, dt_comm_broadcast(c, recv, n, o.root), "broadcast");
  case OP_REDUCE: { /* an all-reduce of a copy, kept by the root */
    std::vector<float> tmp((const float *)o.send, (const float *)o.send + n);
    ncclResult_t r = transport(comm, dt_comm_all_reduce(c, tmp.data(), n, op), "reduce");
    if (comm->rank.load() == o.root && comm->async == ncclSuccess)
      memcpy(recv, tmp.data(), n * F);
    return r;
  }
  default:
    return failed(comm, ncclInternalError, "run_collective: kind %d", (int)o.kind);
  }
}

/* One operation at a time on each GPU. NCCL's kernels wait on their peers, so two
 * communicators' operations in flight on one GPU deadlock unless the GPU runs them side by side
 * (not guaranteed: it depends on their resources) or every rank launched them in the same order;
 * NCCL's guidance ("Using multiple NCCL communicators concurrently") is to complete one
 * communicator's operations before starting another's. Here an operation that is called while
 * another is in flight on its GPU (called and not yet done) fails (ncclInvalidUsage), whatever
 * the order. */
static std::mutex &gpu_mu(void)
{
  static std::mutex *m = new std::mutex(); /* never destroyed: workers may outlive main */
  return *m;
}
static std::map<int, ncclComm_t> &gpu_busy(void) /* GPU -> the communicator running on it */
{
  static std::map<int, ncclComm_t> *m = new std::map<int, ncclComm_t>();
  return *m;
}

static bool gpu_acquire(ncclComm_t comm)
{
  std::lock_guard<std::mutex> lock(gpu_mu());
  auto it = gpu_busy().find(comm->device);
  if (it != gpu_busy().end()) {
    (void)failed(comm, ncclInvalidUsage,
                 "rank %d of %d: an operation started on GPU %d while one of another "
                 "communicator (rank %d of %d) was in flight there; NCCL may deadlock on that "
                 "unless every rank launched them in the same order",
                 comm->rank.load(), comm->world.load(), comm->device, it->second->rank.load(),
                 it->second->world.load());
    return false;
  }
  gpu_busy()[comm->device] = comm;
  return true;
}

static void gpu_release(ncclComm_t comm)
{
  std::lock_guard<std::mutex> lock(gpu_mu());
  gpu_busy().erase(comm->device);
}

/* On the worker: a group's collectives in order, or its sends and receives posted together. */
static void execute(ncclComm_t comm, const std::vector<op_t> &ops)
{
  if (ops[0].kind != OP_P2P) {
    for (const op_t &o : ops)
      if (run_collective(o) != ncclSuccess || comm->async != ncclSuccess)
        break;
    return;
  }
  dt_comm_p2p_t halves[DT_COMM_P2P_MAX];
  for (size_t i = 0; i < ops.size(); i++)
    halves[i] = dt_comm_p2p_t{ops[i].recv, ops[i].count, ops[i].root, 0, ops[i].is_recv};
  (void)transport(comm, dt_comm_p2p(comm->c.load(), halves, (int)ops.size()), "send/recv");
}

/* A group (or a lone operation), after the work queued on its streams: handed to the
 * communicator's worker, its streams held by a gate until the worker is done with it. */
static ncclResult_t run_group(std::vector<op_t> &ops)
{
  if (ops.empty())
    return ncclSuccess;
  ncclComm_t comm = ops[0].comm;
  const bool p2p = ops[0].kind == OP_P2P;
  for (const op_t &o : ops) {
    if (o.comm != comm || (o.kind == OP_P2P) != p2p)
      return failed(comm, ncclInvalidUsage,
                    "a group mixes communicators or collectives with send/recv (distrain never "
                    "does; this emulation does not run it)");
    if (cudaStreamSynchronize(o.stream) != cudaSuccess)
      return failed(comm, ncclUnhandledCudaError, "the operation's stream failed or is not live");
  }
  if (comm->async != ncclSuccess)
    return ncclSuccess; /* a failed communicator runs nothing more; its error stands */
  if (p2p && ops.size() > DT_COMM_P2P_MAX)
    return failed(comm, ncclInvalidUsage, "%zu sends and receives in one group: at most %d here",
                  ops.size(), DT_COMM_P2P_MAX);
  if (!gpu_acquire(comm))
    return ncclSuccess;
  std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
  post(comm, [comm, ops, done](bool canceled) {
    if (!canceled && comm->async == ncclSuccess)
      execute(comm, ops);
    gpu_release(comm);
    *done = true;
  });
  for (size_t i = 0; i < ops.size(); i++)
    if (i == 0 || ops[i].stream != ops[i - 1].stream)
      dt_emul_enqueue_gate(ops[i].stream, [done] { return done->load(); });
  return ncclSuccess;
}

/* Checks an operation and runs it, or keeps it for ncclGroupEnd. */
static ncclResult_t submit(const op_t &o, const char *what, ncclDataType_t type, size_t send_n,
                           size_t recv_n)
{
  ncclComm_t comm = o.comm;
  if (!comm)
    return failed(nullptr, ncclInvalidArgument, "%s: no communicator", what);
  const bool bytes = type == ncclUint8 || type == ncclInt8;
  if (o.kind == OP_P2P ? !bytes : type != ncclFloat)
    return failed(comm, ncclInvalidArgument, "%s: data type %d (distrain sends %s)", what,
                  (int)type, o.kind == OP_P2P ? "bytes" : "ncclFloat");
  const bool reduces =
      o.kind == OP_ALL_REDUCE || o.kind == OP_REDUCE_SCATTER || o.kind == OP_REDUCE;
  if (reduces && o.op != ncclSum && o.op != ncclAvg)
    return failed(comm, ncclInvalidArgument, "%s: op %d (distrain sums or averages)", what,
                  (int)o.op);
  const size_t es = bytes ? 1 : sizeof(float);
  if ((send_n && !in_device(o.send, send_n * es)) || (recv_n && !in_device(o.recv, recv_n * es)))
    return failed(comm, ncclInvalidArgument,
                  "%s on rank %d: a buffer is not device memory of a live allocation (%p, %p)",
                  what, comm->rank.load(), o.send, o.recv);
  if (o.root < 0 || o.root >= comm->world)
    return failed(comm, ncclInvalidArgument, "%s: rank %d of %d", what, o.root, comm->world.load());
  if (t_group_depth > 0) {
    t_group.push_back(o);
    return ncclSuccess;
  }
  std::vector<op_t> one(1, o);
  return run_group(one);
}

extern "C" {

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream)
{
  return submit({OP_ALL_REDUCE, sendbuff, recvbuff, count, op, 0, 0, comm, stream}, "ncclAllReduce",
                datatype, count, count);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream)
{
  return submit({OP_REDUCE_SCATTER, sendbuff, recvbuff, recvcount, op, 0, 0, comm, stream},
                "ncclReduceScatter", datatype, comm ? recvcount * comm->world.load() : 0,
                recvcount);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
  return submit({OP_ALL_GATHER, sendbuff, recvbuff, sendcount, ncclSum, 0, 0, comm, stream},
                "ncclAllGather", datatype, sendcount, comm ? sendcount * comm->world.load() : 0);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
{
  const bool is_root = comm && comm->rank.load() == root;
  return submit({OP_BROADCAST, sendbuff, recvbuff, count, ncclSum, root, 0, comm, stream},
                "ncclBroadcast", datatype, is_root ? count : 0, count);
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream)
{
  const bool is_root = comm && comm->rank.load() == root;
  return submit({OP_REDUCE, sendbuff, recvbuff, count, op, root, 0, comm, stream}, "ncclReduce",
                datatype, count, is_root ? count : 0);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream)
{
  return submit({OP_P2P, sendbuff, (void *)sendbuff, count, ncclSum, peer, 0, comm, stream},
                "ncclSend", datatype, count, 0);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream)
{
  return submit({OP_P2P, recvbuff, recvbuff, count, ncclSum, peer, 1, comm, stream}, "ncclRecv",
                datatype, 0, count);
}

ncclResult_t ncclGroupStart()
{
  t_group_depth++;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd()
{
  if (t_group_depth == 0)
    return failed(nullptr, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--t_group_depth > 0)
    return ncclSuccess;
  std::vector<op_t> ops;
  ops.swap(t_group);
  return run_group(ops);
}

} /* extern "C" */
