/* agent.h — distrain-worker: the node agent.
 *
 * One libuv loop thread. It registers the node, heartbeats every heartbeat_ms (the RPC runs on
 * the libuv threadpool so a slow coordinator never stalls the loop), keeps one WatchAssignment
 * long-poll outstanding, and reconciles the trainers it runs with the assignment it was given:
 * trainers no longer assigned are stopped (those of a job the user stopped by SIGTERM, on which
 * a trainer saves its step before it exits, then SIGKILL after the grace period; any other by
 * SIGKILL at once: a failure ended its generation), and assigned ranks not running are spawned
 * with uv_spawn once no trainer is on its way out. Each trainer writes its output to a
 * per-rank log file and its TrainerReports to a pipe; their statuses ride on the heartbeats.
 *
 * Invariants: at most one heartbeat and one watch in flight; a new generation of a job starts
 * only after every trainer of its previous generation on this node has exited; trainers die
 * with the agent (PR_SET_PDEATHSIG, set by the trainer itself from DISTRAIN_AGENT_PID). */
#ifndef DT_AGENT_H
#define DT_AGENT_H

#include <stdint.h>
#include <uv.h>

#include "distrain.pb-c.h"
#include "gpu_usage.h"
#include "rpc.h"

typedef struct {
  const char *coordinator; /* host:port */
  const char *token_file;
  const char *trainer;  /* path of distrain-train */
  const char *work_dir; /* per-rank logs: <work_dir>/<job>/rank-<R>.log; <work_dir>/node-id:
                         * the id it registered under, asked for again when it restarts (so a
                         * restarted agent is the same node: drained, leaving, its logs) */
  const char *hostname;
  int cpu_devices; /* devices to offer when there is no GPU */
  /* The GPUs to offer: NULL or "all" (every GPU the CUDA runtime shows; CPU devices where it
   * shows none), "none" (CPU devices), or a comma-separated list of GPU numbers as this process's
   * CUDA runtime counts them (after its CUDA_VISIBLE_DEVICES); a GPU listed twice is two devices
   * whose trainers share it. Trainers see the offered GPUs only (their CUDA_VISIBLE_DEVICES),
   * and none when the agent offers CPU devices. */
  const char *gpus;
  /* Xids the GPUs' health leaves out besides an application's (--ignore-xids; gpu_usage.h) */
  int ignore_xids[DT_GPU_IGNORED_XIDS], n_ignore_xids;
  int grace_ms; /* SIGTERM -> SIGKILL */
  /* > 0: the rank logs (<work_dir>/<job>/rank-<R>.log) of a job with no trainer here none of
   * whose logs was written for this many days are deleted, and the job's directory once it
   * holds nothing else: at start and whenever a trainer exits (--keep-logs-days; 0: kept) */
  int keep_logs_days;
  /* Called on the loop after every successful registration (NULL: none); the first one is
   * when the agent is ready (systemd's READY=1). */
  void (*on_registered)(void *ud);
  void *ud;
} dt_agent_config_t;

typedef struct dt_agent dt_agent_t;

int dt_agent_start(dt_agent_t **out, uv_loop_t *loop, const dt_agent_config_t *cfg);
/* Stops every trainer (SIGTERM, SIGKILL after grace) and frees; cb runs when all exited. */
void dt_agent_close(dt_agent_t *a, void (*cb)(void *ud), void *ud);
/* One line for systemd's STATUS= ("node-2 on head:7470, 2 trainers running (job-3 rank 0 step
 * 1200, rank 1 step 1200)"). */
void dt_agent_summary(const dt_agent_t *a, char *buf, size_t len);

#endif
