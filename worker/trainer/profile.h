/* profile.h — where a trainer's step goes, kernel by kernel (distrain-train --profile).
 *
 * A profile wraps the trainer's device: dt_profile_device() is that device in every respect
 * (the same memory, streams, events and communication backend: its entries are the inner
 * device's, on the inner device's state) except its kernel table, whose entries time each call
 * made between dt_profile_begin and dt_profile_end and otherwise only pass it on. On a GPU a
 * call is bracketed by two timed events on the compute stream, so it is charged from the moment
 * the stream reached it to the moment its last kernel ended (a kernel that waited for the host
 * to launch it counts that wait: a launch-bound step shows as slow small kernels); on a host
 * device by the host clock. Kernels run on the thread that created the device only (device.h),
 * so the profile needs no lock.
 *
 * FLOPs are counted for the products, as the model-FLOPs convention does: a linear layer
 * 2·N·C·OC forward; backward 2·N·C·OC for its weight gradient and as much again when the input
 * gradient is wanted; attention over the (query, key) pairs the causal mask keeps, 4·hs per
 * pair forward (the scores and the weighted sum), 8·hs backward (four products) and 10·hs for
 * flash attention's backward (which recomputes the scores). The other kernels are memory-bound:
 * they count bytes, the least memory traffic their arguments imply (every input read once, every
 * output written once, a += output both; fp32 4 bytes a value, a bf16 activation buffer the
 * device's bf16_bytes).
 *
 * Communication is timed too, on the communicators the trainer hands to dt_profile_watch: an
 * operation the profiled thread makes is a row "comm <group> <op>" among the kernels (bracketed
 * as a kernel call is: on a GPU it is charged from the moment the stream finished the work before
 * it to its return, so the time the step lost to it), with the bytes it moves for this rank
 * (comm.h, dt_comm_event_t) and their rate; an operation another thread makes (the data-parallel
 * comm thread's, overlapped with the compute) is a row of its own, marked overlapped, on the host
 * clock, not part of the step's time. A pipeline stage's send and receive rows are its bubble
 * and its transfers; a tensor-parallel group's rows are its all-reduces, or with sequence
 * parallelism its all-gathers and reduce-scatters. */
#ifndef DT_TRAINER_PROFILE_H
#define DT_TRAINER_PROFILE_H

#include <stdio.h>

#include "comm.h"
#include "device.h"

typedef struct dt_profile dt_profile_t;

/* A profile of the kernels of `inner`, which must outlive it. The thread that creates it is the
 * profiled one: the thread that runs the kernels and the step. */
int dt_profile_create(dt_profile_t **out, dt_device_t *inner);
void dt_profile_destroy(dt_profile_t *p); /* NULL is fine */
/* The device to hand to the model and everything else in place of inner. */
dt_device_t *dt_profile_device(dt_profile_t *p);

/* Also times the operations on comm (NULL: nothing), which must outlive the profile's use; call
 * it before any thread operates on comm (dt_comm_set_observer). */
void dt_profile_watch(dt_profile_t *p, dt_comm_t *comm);

/* Times the kernel calls and the communication from now on: step number `step`, which began at
 * t0_ms (dt_now_ms()'s clock). */
void dt_profile_begin(dt_profile_t *p, int step, double t0_ms);
/* Stops timing, waits for the device to finish the step's work, and adds the step (its wall
 * time: from t0_ms to now) and its calls to the totals. */
int dt_profile_end(dt_profile_t *p);
/* Keeps every profiled call and step from now on, for dt_profile_trace. */
void dt_profile_keep_spans(dt_profile_t *p);

/* One row of the table over the profiled steps, per step: a kernel-table entry or a group's
 * operation. */
typedef struct {
  const char *kernel;     /* the dt_ops_t entry ("matmul_backward_bf16"), or "comm <group> <op>" */
  const char *group, *op; /* communication: the communicator's label and the operation; NULL for
                             a kernel */
  int overlapped;         /* communication of another thread, not part of the step's time */
  double calls;
  double ms;
  double flop;  /* the products' */
  double bytes; /* the memory-bound kernels' and the communication's */
} dt_profile_row_t;

/* The profiled steps so far (0: none): *step_ms their mean wall time, rows (room for
 * DT_PROFILE_MAX_ROWS: every entry of dt_ops_t and the communication) the kernels and the
 * operations they ran, the most time first; returns the number of rows. */
#define DT_PROFILE_MAX_ROWS 64
int dt_profile_summary(const dt_profile_t *p, int *steps, double *step_ms, dt_profile_row_t *rows);
/* The summary as a table in the log (INFO, subsystem train), headed by `what` ("steps 5-6"). */
void dt_profile_log(const dt_profile_t *p, const char *what);
/* The summary as one JSON line {"profile": {...}} of a metrics file: steps [first, last], the
 * steps profiled, the device, step_ms, kernels [{"kernel", "calls", "ms", "gflop", "mbytes"}]
 * and comm [{"group", "op", "overlapped", "calls", "ms", "mbytes"}] (per step). */
void dt_profile_json(const dt_profile_t *p, FILE *f, int first, int last);

/* The kept spans as a Chrome trace (JSON for chrome://tracing and ui.perfetto.dev): process
 * `rank`, a row of steps (tid 1, cat "step"), one of kernel calls (tid 2, cat "kernel"), one of
 * the profiled thread's communication (tid 3) and one of the other threads' (tid 4, both cat
 * "comm"), each call with its step, GFLOP and MB. Times
 * are on the host's monotonic clock (dt_now_ms, in microseconds), which every process of a host
 * shares, so that the ranks' traces of one host line up when merged (their traceEvents
 * concatenated). A GPU's calls are placed from the moment the step's first call was queued, by
 * the timed events' offsets from it. 0, or DT_EIO. */
int dt_profile_trace(const dt_profile_t *p, FILE *f, int rank);

#endif
