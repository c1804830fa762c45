/* backend.h — the table a communication backend fills in (internal to worker/comm).
 *
 * comm.c owns everything backend-independent: argument checks, the poisoned/aborted state,
 * zero-size shortcuts, the split protocol. A backend only moves data. Its functions see valid
 * arguments (non-NULL buffers where sizes are non-zero, ranks in range, counts with a non-zero
 * total) and return 0 or a negative DT_E* code after logging the cause once; they must turn
 * every foreign error (C++ exception, NCCL result) into such a code. Buffers are host memory for
 * "cpu" and device memory for "nccl". To add a backend: write its table, add it to
 * g_backends in comm.c. */
#ifndef DT_COMM_BACKEND_H
#define DT_COMM_BACKEND_H

#include <stddef.h>

#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dt_comm_backend {
  const char *name;
  /* Rendezvous and connect (see dt_comm_init). share is NULL or a live instance of this backend
   * (the parent of a split): the new instance may share its resources (threads, devices), and
   * an abort of share must cancel this init promptly. */
  int (*init)(void **impl, const dt_kv_t *kv, const char *prefix, int rank, int world,
              int timeout_ms, void *share);
  /* Frees the instance; in-flight peers see its connections close. */
  void (*destroy)(void *impl);
  /* From any thread: fail the blocked operation and all later ones with DT_ECANCELED. */
  void (*abort)(void *impl);

  int (*all_reduce)(void *impl, float *buf /* (n) */, size_t n, dt_comm_op_t op);
  /* in: (sum(counts)), out: (counts[rank]) */
  int (*reduce_scatter)(void *impl, const float *in, float *out, const size_t *counts,
                        dt_comm_op_t op);
  /* in: (counts[rank]), out: (sum(counts)) */
  int (*all_gather)(void *impl, const float *in, float *out, const size_t *counts);
  int (*broadcast)(void *impl, float *buf /* (n) */, size_t n, int root);
  /* n (1..DT_COMM_P2P_MAX) halves, posted together; sizes may be zero. */
  int (*p2p)(void *impl, const dt_comm_p2p_t *ops, int n);
  /* Optional (NULL: comm.c completes every receive in p2p). As p2p, but only the sends are
   * waited for: receive half i is left in flight, pending[i] what p2p_wait takes to complete it
   * (NULL for a send). p2p_wait waits for it and frees it; with drop, it only frees it (the
   * instance has failed or is about to be destroyed: whatever arrives is not wanted). */
  int (*p2p_post)(void *impl, const dt_comm_p2p_t *ops, int n, void **pending);
  int (*p2p_wait)(void *impl, void *pending, int drop);
  int (*barrier)(void *impl);

  /* Optional (NULL: comm.c splits by calling init on each child with share = the parent). A
   * backend whose library has its own split (NCCL: ncclCommSplit) fills it in. comm.c has
   * already run the split table protocol, so new_rank and new_world are this rank's place in its
   * child (ordered by key, then parent rank: the backend must keep that order, e.g. by passing
   * new_rank as its library's key); prefix names the child in log lines. Collective over the
   * parent: comm.c calls it on every parent rank, DT_COMM_NO_COLOR ones included (color < 0,
   * new_rank -1, new_world 0: *impl stays NULL). Bounded by timeout_ms; an abort of parent
   * cancels it promptly (DT_ECANCELED). On failure the parent may be unusable (comm.c poisons
   * it). */
  int (*split)(void *parent, const char *prefix, int color, int new_rank, int new_world,
               int timeout_ms, void **impl);
  int device_memory; /* its buffers are device memory ("nccl"), else host memory */
  /* Optional: the instance's name in its later log lines becomes "label (prefix)"
   * (dt_comm_set_label's label: "pp", "tp", ...), so that an operation's failure names the
   * group as progress reports do. Called before the instance's first operation. */
  void (*set_label)(void *impl, const char *label);
} dt_comm_backend_t;

/* Waits for key until deadline_ms (dt_now_ms() clock) in slices of at most 100 ms, giving up
 * early with DT_ECANCELED once canceled(arg) returns non-zero (canceled may be NULL).
 * DT_ETIMEDOUT at the deadline; other KV errors are returned as they come. */
int dt__comm_kv_wait(const dt_kv_t *kv, const char *key, void **val, size_t *len,
                     double deadline_ms, int (*canceled)(void *arg), void *arg);

/* worker/comm/cpu/gloo_backend.cc */
extern const dt_comm_backend_t dt__comm_cpu_backend;
/* worker/comm/nccl/nccl_backend.c (built when CUDA and NCCL are found: DT_HAVE_NCCL) */
extern const dt_comm_backend_t dt__comm_nccl_backend;

#ifdef __cplusplus
}
#endif

#endif
