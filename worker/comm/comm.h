/* comm.h — distrain's communication layer: communicators over a pluggable backend.
 *
 * A communicator (dt_comm_t, opaque) joins `world` processes, each with a distinct `rank`, for
 * collectives on float32 buffers (all-reduce, reduce-scatter, all-gather, broadcast, barrier)
 * and point-to-point transfers. Peers find each other through a key-value store (dt_kv_t): the
 * trainer binds it to the coordinator's per-job KV RPCs; tests use the directory-backed or the
 * in-process store below. Backends: "cpu" (Gloo over TCP, worker/comm/cpu/; buffers in host
 * memory) and, in builds with CUDA and NCCL, "nccl" (worker/comm/nccl/; buffers in device memory
 * of the communicator's device, the one current on the thread that called dt_comm_init; inputs
 * must be complete on the GPU when a call is made, results are complete when it returns).
 *
 * Invariants and contracts, as in NCCL:
 *  - Every collective is called by every rank of the communicator, in the same order, with
 *    matching sizes (n, counts, root). Point-to-point calls pair up by (peer, tag) in order.
 *  - Operations on one communicator are issued from one thread at a time. dt_comm_abort() is the
 *    exception: any thread may call it while an operation is blocked.
 *  - Every call returns 0 or a negative DT_E* code and never aborts the process. Blocking is
 *    bounded by the communicator's timeout: every wait for a peer (rendezvous, or progress
 *    inside an operation) gives up after timeout_ms with DT_ETIMEDOUT.
 *  - A failed operation poisons the communicator (as a NCCL error does): later operations fail
 *    at once with the first error (DT_ECANCELED after an abort). Peers see the failure too,
 *    because the backend closes its connections: a dead or failed peer surfaces as DT_EREMOTE
 *    (or DT_ETIMEDOUT). Recovery is: destroy, and rendezvous again under a new generation.
 *    Argument errors (DT_EINVAL) are caught before any communication and poison nothing.
 *    An operation fails only if it needs a peer that is gone: a rank may destroy its
 *    communicator as soon as its own last operation returned, while peers finish theirs.
 *  - Keys: every key is "<prefix>/<backend key>", so giving each generation its own prefix
 *    ("job7/gen3") guarantees that a new generation never reads a stale generation's keys. */
#ifndef DT_COMM_COMM_H
#define DT_COMM_COMM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------ */
/* Key-value store used for rendezvous                                                         */
/* ------------------------------------------------------------------------------------------ */

/* put stores len bytes under key (overwriting). get waits up to timeout_ms (0: a single probe)
 * for key to exist, then returns a malloc'd copy of its value in *val (the caller frees it) and
 * its length in *len; DT_ETIMEDOUT if the key did not appear in time. Both return 0 or a
 * negative DT_E* code and must be safe to call from several threads. */
typedef struct dt_kv {
  int (*put)(void *ud, const char *key, const void *val, size_t len);
  int (*get)(void *ud, const char *key, void **val, size_t *len, int timeout_ms);
  void *ud;
} dt_kv_t;

/* A store in a directory shared by the processes (one node, or a shared file system): put
 * writes a temporary file and renames it over the key's file (readers never see a partial
 * value); get polls for the file. Keys may hold any byte except NUL: the file name escapes
 * everything outside [A-Za-z0-9_.-] as %XX. The directory is created if missing and is not
 * removed by destroy. */
int dt_kv_file_create(dt_kv_t *kv, const char *dir);
void dt_kv_file_destroy(dt_kv_t *kv);

/* A store in this process's memory, for communicators whose ranks are threads. */
int dt_kv_mem_create(dt_kv_t *kv);
void dt_kv_mem_destroy(dt_kv_t *kv);

/* ------------------------------------------------------------------------------------------ */
/* Communicators                                                                               */
/* ------------------------------------------------------------------------------------------ */

typedef struct dt_comm dt_comm_t;

typedef enum {
  DT_COMM_SUM = 0,
  DT_COMM_AVG = 1, /* the sum divided by world (in float32, after the sum; "nccl" uses ncclAvg,
                      which may instead scale each contribution by 1/world, then sum) */
} dt_comm_op_t;

/* dt_comm_split: a color meaning "this rank joins no sub-communicator" (*out becomes NULL). */
#define DT_COMM_NO_COLOR (-1)

/* Joins a communicator: posts this rank's connection details under prefix, waits for all other
 * ranks', connects. backend is "cpu" (NULL means "cpu") or "nccl" (DT_ENOTSUP where this build
 * lacks it). kv is copied (its ud must outlive the communicator). prefix names the job and
 * generation, e.g. "job7/gen3" (non-empty, no NUL).
 * Timeout: ranks that have not posted within timeout_ms give DT_ETIMEDOUT and a log line naming
 * them. Environment: DISTRAIN_COMM_IFACE (network interface) or DISTRAIN_COMM_HOST (host name or
 * address to bind; default: this host's name) choose the address the cpu backend listens on. */
int dt_comm_init(dt_comm_t **out, const char *backend, const dt_kv_t *kv, const char *prefix,
                 int rank, int world, int timeout_ms);

int dt_comm_rank(const dt_comm_t *comm);
int dt_comm_world(const dt_comm_t *comm);
/* The key prefix this communicator rendezvoused under. */
const char *dt_comm_prefix(const dt_comm_t *comm);

/* Buffers on the other side of the backend. A GPU trainer hands its communicators buffers in
 * device memory and host scalars alike. With a device set, every operand on the side the
 * backend cannot read is staged: device memory (is_device) for a host-memory backend ("cpu"),
 * host memory for a device-memory backend ("nccl"). It is copied into a staging buffer on the
 * backend's side before the operation (operands the operation reads) and back after it (those
 * it writes); other operands go to the backend as they are. A device-memory backend runs on its
 * own stream, so it first calls sync, which completes the device work the calling thread queued
 * (the work that produced the inputs; a GPU device keeps one stream per thread, kernels/device.h:
 * another thread waits for the compute thread's work on an event first); its results are
 * complete when the call returns. Splits made after the call inherit the device. Set it before
 * the first operation; ud must outlive the communicator. */
typedef struct {
  void *ud;
  int (*is_device)(void *ud, const void *p);
  /* bytes from src to dst; to_host: device to host, else host to device. 0 or a DT_E* code. */
  int (*copy)(void *ud, void *dst, const void *src, size_t bytes, int to_host);
  /* Device-memory backends only (NULL otherwise): staging memory on the device, its release,
   * and the wait for the device work the calling thread queued so far. */
  int (*alloc)(void *ud, size_t bytes, void **out);
  void (*release)(void *ud, void *p);
  int (*sync)(void *ud);
} dt_comm_device_t;
/* DT_EINVAL (nothing set) when a device-memory backend gets a device without alloc, release
 * and sync. */
int dt_comm_set_device(dt_comm_t *comm, const dt_comm_device_t *dev);
/* A function every operation on comm calls first, on the calling thread (NULL: none; splits do
 * not inherit it). A negative return fails the operation with that code before any
 * communication, poisoning nothing. The trainer uses it to keep two "nccl" communicators from
 * running operations at once on one GPU (worker/trainer/dp.h, dt_dp_order_before). */
void dt_comm_set_gate(dt_comm_t *comm, int (*gate)(void *ud), void *ud);
/* An operation's start or return, as dt_comm_set_observer's function sees it. */
typedef struct {
  const char *label; /* the communicator's (dt_comm_set_label) */
  const char *op;    /* "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier",
                        "split", "send", "recv" or "send/recv" (a batch of halves): a string
                        literal */
  size_t bytes;      /* the data it moves for this rank: the buffer of an all-reduce or a
                        broadcast, the whole buffer of an all-gather (its output) or of a
                        reduce-scatter (its input), a point-to-point's halves added up */
  int end;           /* 0: it starts (before it waits for the device work it follows); 1: it
                        returned, with rc */
  int rc;
} dt_comm_event_t;
/* Calls fn on the calling thread at the start and at the return of every operation on comm that
 * reaches its backend (argument errors and empty operations do not); NULL: none. Splits do not
 * inherit it. Set it before any thread operates on comm. distrain-train --profile times the
 * communication so (worker/trainer/profile.h). */
void dt_comm_set_observer(dt_comm_t *comm, void (*fn)(void *ud, const dt_comm_event_t *e),
                          void *ud);
/* Whether this build has the backend: "cpu" always, "nccl" in builds with CUDA and NCCL. */
int dt_comm_has_backend(const char *backend);

#define DT_COMM_P2P_MAX 8 /* halves in one batch */
/* Progress, for naming the rank a hung group waits for. Every communicator counts the
 * operations that reach its backend (entered, done) and remembers the one in progress. The
 * ranks of a group make the same calls in the same order, so while they progress their counts
 * agree; a rank blocked in operation #n waits for the members whose count is below n (or, for
 * point-to-point, for its peers). dt_comm_progress() lists this process's live communicators from
 * any thread (the trainer's health reporter): it fills up to max entries and returns how many
 * communicators there are. */
typedef struct {
  char group[128]; /* the communicator's key prefix: the same on every member of one group */
  char label[16];  /* dt_comm_set_label ("dp", "tp", ...); "world" or "group" by default */
  int rank, world;
  unsigned long long entered, done; /* operations started / returned */
  const char *op;                   /* the operation in progress (entered > done), else NULL */
  int peers[DT_COMM_P2P_MAX];       /* the distinct peers (group ranks) of the point-to-point in */
  int npeers;                       /* progress (0: a collective, or none) */
  double waiting_ms;                /* how long the operation in progress has been running */
} dt_comm_progress_t;
int dt_comm_progress(dt_comm_progress_t *out, int max);
/* Names the communicator in progress reports (at most 15 characters kept). */
void dt_comm_set_label(dt_comm_t *comm, const char *label);

/* In place: buf holds this rank's contribution and receives the reduction. */
int dt_comm_all_reduce(dt_comm_t *comm, float *buf /* (n) */, size_t n, dt_comm_op_t op);

/* Equal chunks: in is world chunks of n; rank r receives the reduction of chunk r. Callers with
 * uneven shards either pad to a common n or use the _v form. in is not modified; out must not
 * overlap it. */
int dt_comm_reduce_scatter(dt_comm_t *comm, const float *in /* (world*n) */, float *out /* (n) */,
                           size_t n, dt_comm_op_t op);
/* Uneven chunks: chunk c has counts[c] elements (zero allowed); the same counts on every rank. */
int dt_comm_reduce_scatter_v(dt_comm_t *comm, const float *in /* (sum(counts)) */,
                             float *out /* (counts[rank]) */, const size_t *counts /* (world) */,
                             dt_comm_op_t op);

/* Rank r's n elements land at out + r*n on every rank. in may equal out + rank*n. */
int dt_comm_all_gather(dt_comm_t *comm, const float *in /* (n) */, float *out /* (world*n) */,
                       size_t n);
/* Uneven: rank r contributes counts[r] elements, placed after those of ranks 0..r-1. */
int dt_comm_all_gather_v(dt_comm_t *comm, const float *in /* (counts[rank]) */,
                         float *out /* (sum(counts)) */, const size_t *counts /* (world) */);

/* root's buf is copied into every other rank's buf. */
int dt_comm_broadcast(dt_comm_t *comm, float *buf /* (n) */, size_t n, int root);

/* Point-to-point (pipeline stages), in bytes. A send completes once the matching recv (same
 * peer and tag, in order) has been posted and the data handed to the transport; the buffer is
 * then reusable. Sizes must match. tag >= 0. */
int dt_comm_send(dt_comm_t *comm, const void *buf, size_t bytes, int peer, int tag);
int dt_comm_recv(dt_comm_t *comm, void *buf, size_t bytes, int peer, int tag);
/* Posts the send and the recv together, then waits for both: a ring shift or a 1F1B
 * send-forward/recv-backward exchange that would deadlock as a blocking send then recv. */
int dt_comm_sendrecv(dt_comm_t *comm, const void *sendbuf, size_t send_bytes, int dst,
                     void *recvbuf, size_t recv_bytes, int src, int tag);

/* One half of a batched exchange: send bytes of buf to peer, or receive them into buf. */
typedef struct {
  void *buf; /* read by a send, written by a receive */
  size_t bytes;
  int peer, tag; /* tag >= 0 */
  int recv;      /* 0: send, 1: receive */
} dt_comm_p2p_t;

/* Posts every half at once, then waits for all of them (NCCL's group of sends and receives,
 * PyTorch's batch_isend_irecv): an interleaved pipeline stage exchanges activations and
 * gradients with both neighbours in one step, which no order of blocking calls could do
 * without deadlock. Messages between two ranks pair up in order: per tag with "cpu", across
 * tags with "nccl" (so both sides must post their halves to one peer in the same order of
 * tags). At most DT_COMM_P2P_MAX halves. */
int dt_comm_p2p(dt_comm_t *comm, const dt_comm_p2p_t *ops, int n);

/* A receive dt_comm_p2p_post left in flight. */
typedef struct dt_comm_pending dt_comm_pending_t;
/* As dt_comm_p2p, but it waits only for the sends (Megatron's overlapped pipeline exchange):
 * each receive half i is left in flight as pending[i], to be completed by dt_comm_p2p_wait
 * before its buffer is read or written; pending[i] is NULL for a send, and for a receive that
 * is complete already ("nccl", and any communicator with a device set, dt_comm_set_device,
 * complete every half here). A send still waits for its receiver to post (so the pairing rules
 * and the deadlock-freedom of dt_comm_p2p hold), but a stage no longer waits here for data it
 * needs only after other work. A receive's wait is an operation of its own ("recv", moving its
 * bytes: the post's count only the rest), with its peer named in progress reports. */
int dt_comm_p2p_post(dt_comm_t *comm, const dt_comm_p2p_t *ops, int n, dt_comm_pending_t **pending);
/* Waits for the receive, then frees pending (NULL: nothing to wait for, 0). It fails as any
 * operation does; on a failed or aborted communicator it fails at once, freeing pending. A
 * receive not waited for is dropped by dt_comm_destroy (its buffer may be written until then). */
int dt_comm_p2p_wait(dt_comm_t *comm, dt_comm_pending_t *pending);

int dt_comm_barrier(dt_comm_t *comm);

/* Collective over comm: ranks with the same color (>= 0) form a sub-communicator, ordered by
 * (key, parent rank); DT_COMM_NO_COLOR joins none (*out = NULL, still 0). The children
 * rendezvous through the parent's KV under "<parent prefix>/split<seq>/c<color>", where seq
 * counts this parent's splits, so repeated splits never collide ("nccl" agrees on the groups
 * through the KV the same way, then makes the children with ncclCommSplit). Children are
 * independent communicators: destroy each (in any order relative to the parent). */
int dt_comm_split(dt_comm_t *comm, int color, int key, dt_comm_t **out);

/* Callable from any thread, any number of times: the blocked operation (if any) and all later
 * ones fail promptly with DT_ECANCELED; peers blocked on this rank fail with DT_EREMOTE (with
 * "nccl", when NCCL notices, which may be only at their timeout: DT_ETIMEDOUT). A split in
 * progress on this communicator is canceled too. Not concurrent with destroy. */
int dt_comm_abort(dt_comm_t *comm);

/* Frees the communicator (NULL is fine). Not collective; does not wait for peers. Exception:
 * a healthy "nccl" communicator is finalized first (ncclCommFinalize flushes NCCL's in-flight
 * traffic and waits for this communicator's other ranks on this host to finalize too); if that
 * takes longer than its timeout, it is aborted instead. */
void dt_comm_destroy(dt_comm_t *comm);

#ifdef __cplusplus
}
#endif

#endif
