/* link.h — a trainer's links to the system that started it.
 *
 * Under an agent (DISTRAIN_STATUS_FD set) the trainer streams TrainerReport messages to the
 * agent over a pipe: one per completed step, the reason before a failed exit, and every second
 * (DISTRAIN_PROGRESS_MS) from a thread of its own the progress of its communicators, which the
 * coordinator compares across ranks to name the rank a hung group waits for. Under a
 * coordinator (DISTRAIN_COORDINATOR set) checkpoint shards are reported to it, and the
 * coordinator writes the manifest that commits the step once every writer's shard is in.
 * Standalone (neither set) the trainer commits its own checkpoints; these calls are no-ops. */
#ifndef DT_TRAINER_LINK_H
#define DT_TRAINER_LINK_H

#include <stdint.h>

#include "checkpoint_manifest.h"
#include "comm.h"
#include "trainer.h"

typedef struct dt_link dt_link_t;

/* Reads the environment; *out is NULL when running standalone. Also arranges for the trainer
 * to die with its agent (PR_SET_PDEATHSIG) when DISTRAIN_AGENT_PID names its parent. */
int dt_link_open(dt_link_t **out);
void dt_link_close(dt_link_t *l);
/* 1 when checkpoints are committed by the coordinator. */
int dt_link_has_coordinator(const dt_link_t *l);
void dt_link_step(dt_link_t *l, const dt_step_metrics_t *m);
void dt_link_error(dt_link_t *l, const char *msg);
/* The reason for a coming exit: step was bad (its loss or gradient norm NaN/Inf, or over
 * --spike-factor / --grad-spike-factor times the recent average): the coordinator rolls back
 * and has the step skipped. */
void dt_link_nonfinite(dt_link_t *l, int64_t step, dt_bad_step_t bad, const char *msg);
/* Every step so far taken without an update where it was (--bad-step skip), ascending: the
 * coordinator records them, so that a later generation resumed from before them skips them. */
void dt_link_skipped(dt_link_t *l, const int64_t *steps, size_t n);
/* The coming failure is the job's input's (a missing data file, a checkpoint of another
 * model, an option this node cannot honour): restarting would fail the same way. */
void dt_link_input_error(dt_link_t *l);
/* Reports a written shard. error non-NULL: writer info->rank could not write its shard (its
 * disk full), and says why; the coordinator abandons the step (ReportCheckpointRequest.error).
 * *committed: 1 this report completed the step and committed it, -1 it completed the step
 * and the step was abandoned (why: the coordinator's reason, "step S not saved: ..."), 0 the
 * step waits for other writers. */
int dt_link_report_checkpoint(dt_link_t *l, int64_t step, int world,
                              const dt_ckpt_shard_info_t *info, const char *error, int *committed,
                              char *why, size_t n);

/* The coordinator's key-value store (scoped to this trainer's job and generation). */
int dt_link_kv(dt_link_t *l, struct dt_kv *kv);

#endif
