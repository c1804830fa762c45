/* coord.h — the coordinator's state and its internal API.
 *
 * Everything here is owned by the one loop thread: RPC handlers (handlers.c), the liveness
 * timer, the job state machine (jobs.c), the key-value store (kv.c) and persistence
 * (store.c) all run on it, so nothing is locked.
 *
 * The layers, bottom up: state.h (nodes and jobs, their lookups), store.h (SQLite) and
 * kv.h (rendezvous keys), then this header's state machine (jobs.c), handlers, log relay,
 * /metrics and dashboard, and the lifecycle (coord.c) that wires the store under the rest.
 *
 * Invariants (more in state.h and store.h):
 *  - Trainer logs are not scoped by generation (a rank's file on a node appends every
 *    generation it ran there): GetLogs reads the node that holds the rank in the current
 *    generation, or the last one that did (dt_job_t.rank_node), through that node's agent. */
#ifndef DT_COORD_H
#define DT_COORD_H

#include <stdint.h>
#include <uv.h>

#include "distrain.pb-c.h"
#include "http.h"
#include "kv.h"
#include "prom.h"
#include "rpc.h"
#include "state.h"
#include "store.h"

typedef struct dt_coord dt_coord_t;

typedef struct {
  const char *listen;    /* "host:port" */
  const char *state_dir; /* SQLite database lives here */
  const char *token;     /* bearer token every RPC must carry */
  int heartbeat_ms;      /* period agents are told to keep */
  int dead_after_missed; /* heartbeats missed before a node is dead */
  const char *http;      /* "host:port" of /metrics, or NULL: none */
  int http_optional;     /* http cannot be bound: warn and go on without it (the default
                          * address), rather than fail to start (an address asked for) */
} dt_coord_config_t;

typedef struct dt_log_wait dt_log_wait_t;
/* Something an operator wants to see on the dashboard: a job's transition, a node lost or back
 * (memory only: the newest DT_COORD_EVENTS since the coordinator started). */
#define DT_COORD_EVENTS 64
typedef struct {
  int64_t wall_ms;
  int warn; /* a failure (restart, failed job, dead node) */
  char job[32];
  char text[384];
} dt_coord_event_t;

struct dt_coord {
  uv_loop_t *loop;
  dt_coord_config_t cfg;
  dt_rpc_server_t *rpc;
  dt_coord_store_t *store;
  int port;
  dt_coord_state_t st; /* the nodes and jobs */
  dt_coord_kv_t *kv;
  uv_timer_t liveness;
  double scan_ms, last_scan_ms; /* liveness scan period; when the last scan ran */
  double last_resync_ms;        /* last attempt to rewrite the store after a failed write */
  uv_timer_t sched;             /* dt_coord_schedule_soon: one planning pass per loop iteration */
  int notify_pending;           /* some node's notify_pending is set */
  dt_log_wait_t *log_waits;     /* held GetLogs calls (logrelay.c) */
  uint64_t next_log_id;
  dt_http_t *http; /* /metrics, or NULL */
  int http_port;
  int64_t start_wall_ms;
  dt_coord_event_t events[DT_COORD_EVENTS]; /* a ring: event i is at i % DT_COORD_EVENTS */
  uint64_t n_events;                        /* ever recorded */
  int closing;
};

/* ---- lifecycle (coord.c) ---- */
int dt_coord_start(dt_coord_t *c, uv_loop_t *loop, const dt_coord_config_t *cfg);
void dt_coord_close(dt_coord_t *c, void (*cb)(void *ud), void *ud);
/* The coordinator's clock (ms, monotonic): dt_now_ms, plus what dt_coord_clock_advance added. */
double dt_coord_now_ms(void);
/* Moves the coordinator's clock forward (process-wide): tests and fuzz_coord see what time does
 * (nodes that stop heartbeating die, held watches reach their deadline) without waiting. */
void dt_coord_clock_advance(double ms);
/* One liveness scan (the timer runs one every DT_PARAM LivenessScanMs): declares silent nodes
 * dead, answers watches at their deadline, recovers jobs whose blame wait is over, and tries to
 * rewrite a store that failed. */
void dt_coord_liveness_scan(dt_coord_t *c);
/* Records an event (job may be NULL or ""). */
void dt_coord_event(dt_coord_t *c, const char *job, int warn, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Nodes whose trainers are saving their step on the way out and need this coordinator to
 * commit it: alive nodes whose agents said they are leaving (until their goodbye), and drained
 * nodes that still run trainers. */
size_t dt_coord_stopping_nodes(const dt_coord_t *c);
/* Jobs whose trainers run (RENDEZVOUS or RUNNING). */
size_t dt_coord_running_jobs(const dt_coord_t *c);
/* One line for systemd's STATUS= ("2 nodes, 1 job running (job-3 step 1200)"). */
void dt_coord_summary(const dt_coord_t *c, char *buf, size_t len);

/* ---- nodes and jobs (jobs.c) ---- */
/* Sets a job's state with a logged, persisted reason. */
void dt_coord_job_transition(dt_coord_t *c, dt_job_t *j, Distrain__V1__JobState to, const char *fmt,
                             ...) __attribute__((format(printf, 4, 5)));
/* Adds a PENDING job for spec (validated by the caller), saved before it is visible: DT_EIO
 * when the store cannot be written (nothing submitted, its id not used up), or DT_ENOMEM. */
int dt_coord_submit_job(dt_coord_t *c, const Distrain__V1__JobSpec *spec, dt_job_t **out);
/* Plans every job that waits (PENDING, RECOVERING) over the idle alive nodes. */
void dt_coord_schedule(dt_coord_t *c);
/* The same, coalesced: runs dt_coord_schedule once on the next loop iteration however many
 * nodes registered, came back or died in this one (a planning pass is O(nodes)). */
void dt_coord_schedule_soon(dt_coord_t *c);
/* A node's assignments changed: bumps its version, persists it, and answers its held
 * WatchAssignment on the next loop iteration, that is after the caller's store transaction
 * has committed (an agent never acts on an assignment a crash could take back). */
void dt_coord_assignments_changed(dt_coord_t *c, dt_node_t *n);
/* Drains node n with reason (non-NULL, may be ""), or undrains it (reason NULL), persisted. A
 * drained node takes no new work; a running job there stops its trainers the way a preempted
 * node's stop (each rank saves its step, then exits) and restarts without it, uncounted. A job
 * still in rendezvous restarts at once. DT_ENOMEM leaves n unchanged. */
int dt_coord_drain(dt_coord_t *c, dt_node_t *n, const char *reason);
/* Runs a STOPPED or FAILED job again from its newest committed step (RECOVERING, its restarts
 * from 0), planned at once where nodes are free. DT_EINVAL for a job in another state, DT_EBUSY
 * while a trainer of its last generation still runs (saving the step it was stopped at). */
int dt_coord_resume(dt_coord_t *c, dt_job_t *j);
/* A node stopped heartbeating: fail over every job on it. */
void dt_coord_node_dead(dt_coord_t *c, dt_node_t *n);
/* Folds one heartbeat's trainer statuses into the job state machines. */
void dt_coord_trainer_status(dt_coord_t *c, dt_node_t *n);
/* How long rank r of job j has been silent: its last report's age at its agent plus the time
 * since that heartbeat (0 before the first). */
double dt_coord_report_age_ms(const dt_job_t *j, int r);
/* Recovers the jobs whose wait for a dying peer's node (blame_deadline_ms) is over. */
void dt_coord_blame_expired(dt_coord_t *c);
/* Removes a job's assignments from its nodes (agents stop its trainers). */
void dt_coord_release_nodes(dt_coord_t *c, dt_job_t *j);
/* Builds the node's WatchAssignment answer, with the log requests it has not been handed yet
 * (dt_coord_logs_attach). */
Distrain__V1__WatchAssignmentResponse *dt_coord_assignments_for(dt_coord_t *c, dt_node_t *n);
void dt_coord_free_assignments(Distrain__V1__WatchAssignmentResponse *r);
/* Wakes a node's held WatchAssignment call, if any, after its assignments changed. */
void dt_coord_notify_node(dt_coord_t *c, dt_node_t *n);
/* Records a checkpoint shard report (kept in the store first, unless restore: it is being read
 * back from there); writes the manifest when the step is complete. A manifest that cannot be
 * written abandons the step (its reports leave memory, and the store unless restore) and
 * fails the report that completed it. *committed: 1 this report completed the step and
 * committed it; -1 it completed the step, which is abandoned (a writer's disk or the
 * manifest's full: the job's checkpoint_error says why); 0 the step waits for more. */
int dt_coord_checkpoint_report(dt_coord_t *c, dt_job_t *j, int restore,
                               const Distrain__V1__ReportCheckpointRequest *r, int *committed,
                               char *err, size_t errlen);

/* ---- trainer logs, relayed through the agents (logrelay.c) ---- */
/* GetLogs: holds the call, asks the node holding the rank for the bytes (its held watch is
 * answered now, else its next one carries the request), and replies on its PutLogs; fails
 * at once for an unknown job or rank, a dead node, or a node with too many reads waiting, and
 * DEADLINE_EXCEEDED when the agent does not answer in time. */
void dt_coord_get_logs(dt_coord_t *c, dt_rpc_call_t *call, const Distrain__V1__GetLogsRequest *req);
/* PutLogs: an agent's answer; replies to the GetLogs it belongs to (if still waiting). */
void dt_coord_put_logs(dt_coord_t *c, dt_rpc_call_t *call, const Distrain__V1__PutLogsRequest *req);
/* Whether the node has log requests its agent has not been handed yet. */
int dt_coord_logs_unsent(const dt_coord_t *c, const dt_node_t *n);
/* Adds those to a watch answer (borrowed: dt_coord_free_assignments frees only the array) and
 * marks them handed out. DT_ENOMEM leaves them for the next answer. */
int dt_coord_logs_attach(dt_coord_t *c, const dt_node_t *n,
                         Distrain__V1__WatchAssignmentResponse *r);
/* The node died (all its reads fail UNAVAILABLE) or its agent restarted (sent_only: the reads
 * it had been handed are lost; the others go to the new agent). */
void dt_coord_logs_node_gone(dt_coord_t *c, dt_node_t *n, int sent_only, const char *why);
/* Shutdown: fails every held GetLogs. */
void dt_coord_logs_close(dt_coord_t *c);

/* ---- /metrics (metrics.c) ---- */
/* Renders every metric in the Prometheus text format into a malloc'd string (NULL: out of
 * memory). Jobs: every one not yet finished, and the DT_PARAM MetricsFinishedJobs (10) that
 * finished last; per-rank series only for jobs of at most DT_PARAM MetricsMaxRanks (64) ranks. */
char *dt_coord_metrics(dt_coord_t *c, size_t *len);
/* The jobs /metrics and the dashboard show, in submission order (malloc'd; NULL: out of
 * memory): every unfinished one and the MetricsFinishedJobs that finished last. */
dt_job_t **dt_coord_shown_jobs(dt_coord_t *c, size_t *n);

/* ---- the dashboard (web.c) ---- */
/* /api/status: nodes and jobs as `distrainctl nodes --json` / `status JOB --json` print them,
 * with each shown job's mesh, recent loss and tokens/s, and the recent events. */
char *dt_coord_status_json(dt_coord_t *c, size_t *len);
/* The HTTP server's handler: / (the dashboard), /api/status, /metrics; 404 otherwise. */
void dt_coord_http(const char *path, dt_http_response_t *resp, void *ud);

/* ---- handlers (handlers.c) ---- */
/* The current generation's ranks as GetJob answers them (borrowing from the job and its
 * nodes: valid until the state changes); none for a finished job. */
typedef struct {
  Distrain__V1__RankStatus *rs; /* (n) */
  Distrain__V1__RankStatus **ptrs;
  char (*waiting)[96];
  size_t n;
} dt_rank_views_t;
int dt_coord_rank_views(dt_coord_t *c, const dt_job_t *j, dt_rank_views_t *v);
void dt_coord_rank_views_free(dt_rank_views_t *v);
/* Rank 0's newest step with a validation (data.val, data.val_sets), or NULL. */
Distrain__V1__StepMetrics *dt_coord_last_val(const dt_job_t *j);
/* lend 1: points j->job's last_val, last_sources and last_eval at rank 0's newest steps with a
 * validation, losses by blend source and a multiple-choice evaluation (NULL where none),
 * borrowed from the job's metrics for a reply or a print; lend 0 clears them again. */
void dt_coord_lend_newest(dt_job_t *j, int lend);
/* A node as ListNodes answers it (borrowing from n). */
void dt_coord_node_view(const dt_node_t *n, Distrain__V1__Node *o);
int dt_coord_register_handlers(dt_coord_t *c);
/* After a store write failed: rewrites every node, job (with its metrics) and the rendezvous
 * and checkpoint-report cleanups into the store in one transaction — memory is the truth — and
 * returns 0 once the store is in step again (at once when it already is). Without force, tries
 * at most every 2 s: a store that stays unwritable stalls the loop for a busy timeout per try. */
int dt_coord_resync(dt_coord_t *c, int force);

#endif
