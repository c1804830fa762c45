/* coord.h — the coordinator's state and its internal API.
 *
 * Everything here is owned by the one loop thread: RPC handlers (handlers.c), the liveness
 * timer, the job state machine (jobs.c), the key-value store (kv.c) and persistence
 * (store.c) all run on it, so nothing is locked.
 *
 * Invariants:
 *  - A node's id is "node-<index>", index into coord->nodes; ids survive restarts (SQLite).
 *  - A job's generation only grows; an assignment, a key-value entry and a trainer status
 *    all carry the generation they belong to, and anything older than the job's current
 *    generation is stale: never served, never counted.
 *  - Trainer logs are not scoped by generation (a rank's file on a node appends every
 *    generation it ran there): GetLogs reads the node that holds the rank in the current
 *    generation, or the last one that did (dt_job_t.rank_node), through that node's agent.
 *  - Every state change is written to SQLite before it is visible over RPC (write-through),
 *    so a coordinator killed with SIGKILL comes back with the same jobs, generations, nodes,
 *    assignments and committed checkpoints. */
#ifndef DT_COORD_H
#define DT_COORD_H

#include <stdint.h>
#include <uv.h>

#include "distrain.pb-c.h"
#include "http.h"
#include "prom.h"
#include "rpc.h"

typedef struct dt_coord dt_coord_t;
typedef struct dt_store dt_store_t;

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

/* One registered node. */
typedef struct {
  int index;
  char id[32];
  Distrain__V1__NodeInfo *info; /* owned */
  Distrain__V1__NodeState state;
  double last_seen_ms; /* monotonic */
  int64_t last_seen_wall_ms;
  uint64_t assign_version;                /* bumped whenever its assignments change */
  int notify_pending;                     /* its held watch is answered on the next turn */
  int job;                                /* index of the job using it, -1 if idle */
  Distrain__V1__TrainerStatus **trainers; /* last heartbeat's statuses (owned) */
  size_t n_trainers;
  Distrain__V1__DeviceUsage **usage; /* last heartbeat's GPU usage (owned; memory only) */
  size_t n_usage;
  dt_rpc_call_t *watch;         /* a held WatchAssignment, or NULL */
  struct dt_coord *watch_owner; /* for the watch timer's callback */
  uv_timer_t watch_timer;
  int watch_timer_active;
  int n_log_waits; /* GetLogs calls held for this node's agent (logrelay.c), bounded */
} dt_node_t;

/* Per-rank bookkeeping of the current generation. */
typedef struct {
  int node; /* node index */
  int local_rank;
  Distrain__V1__TrainerState state;
  int64_t step;
  Distrain__V1__TrainerProgress *progress; /* its latest progress report (owned), or NULL */
  double report_age_ms;                    /* its report's age when the heartbeat came... */
  double heard_ms;                         /* ...at this time (0: no heartbeat yet) */
  double compute_ms; /* per step (StepMetrics.compute_ms), a moving average; 0: none yet */
  int slow_checks;   /* consecutive straggler checks that found it slow */
  int straggler;     /* reported as one (status, log) */
} dt_rank_slot_t;

/* One rank of a job and the node it runs on (the job's by-node index). */
typedef struct {
  int node, rank;
} dt_node_rank_t;

/* A checkpoint step being collected from its writers. */
typedef struct {
  int64_t step;
  int world, received;
  uint64_t generation;                             /* of the reports */
  double first_ms;                                 /* when its first report came */
  Distrain__V1__ReportCheckpointRequest **reports; /* (world) owned copies */
} dt_ckpt_pending_t;

/* Why a job's generation ended early and the job was planned again (distrain_restarts_total). */
typedef enum {
  DT_RESTART_NODE_DEAD,      /* a node of the job missed its heartbeats */
  DT_RESTART_TRAINER_FAILED, /* a trainer exited or was killed */
  DT_RESTART_NONFINITE,      /* a non-finite loss or gradient: rolled back */
  DT_RESTART_HANG,           /* a collective blocked past the hang timeout */
  DT_RESTART_GROW,           /* nodes came back: grown to a larger dp at a checkpoint */
  DT_RESTART_N
} dt_restart_reason_t;

extern const char *const dt_restart_reason_names[DT_RESTART_N]; /* "node_dead", ... */

typedef struct {
  char id[32];
  Distrain__V1__Job *job; /* owned; job->spec is the submitted spec */
  /* current generation's plan */
  int world, dp, grad_accum;
  dt_rank_slot_t *ranks; /* (world) */
  int *nodes;            /* node indices in rank order of their first rank */
  int n_nodes;
  /* The committed step this generation's trainers resumed from (0: from scratch); an older
   * generation's steps up to it are final, the later ones this generation replays. */
  int64_t resume_step;
  /* A rank failed because a peer did (DT_EREMOTE): the peer's node may be dying, and its
   * heartbeats are the better witness. Recovery waits until blame_deadline_ms (0: none) for a
   * node of the job to be declared dead, then goes ahead with blame_reason. */
  double blame_deadline_ms;
  char blame_reason[512];
  int n_running, n_done;      /* ranks of this generation RUNNING / SUCCEEDED */
  double hang_checked_ms;     /* when a report past the hang timeout was last analysed */
  double straggle_checked_ms; /* when the ranks' compute times were last compared */
  double persisted_ms;        /* when progress (step, loss) was last written */
  /* rank 0's per-step metrics (the --metrics stream) */
  Distrain__V1__StepMetrics **metrics;
  size_t n_metrics, cap_metrics;
  dt_ckpt_pending_t *ckpts;
  size_t n_ckpts;
  /* Counted since the coordinator started (not persisted): /metrics. */
  dt_prom_hist_t step_seconds; /* rank 0's step times (StepMetrics.ms) */
  uint64_t hist_gen;           /* the generation and step last counted in it */
  int64_t hist_step;
  uint64_t restarts_by[DT_RESTART_N];
  double ckpt_seconds; /* newest commit: its first shard report to its manifest (-1: none) */
  int64_t ckpt_wall_ms;
  /* ranks sorted by (node, rank), rebuilt lazily once per generation: a node's assignment
   * then costs O(log world + its ranks), not O(world) */
  dt_node_rank_t *by_node;
  uint64_t by_node_gen;
  int by_node_world;
  /* rank -> node index of the newest generation that had the rank (its log is there), -1 for
   * none; kept when the job shrinks, so a rank that no longer exists still has its log */
  int *rank_node;
  int n_rank_node;
} dt_job_t;

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
  dt_store_t *store;
  int port;
  dt_node_t **nodes;
  size_t n_nodes, cap_nodes;
  dt_job_t **jobs;
  size_t n_jobs, cap_jobs;
  uint64_t next_job;
  struct dt_kv *kv;
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
double dt_coord_now_ms(void);
/* Records an event (job may be NULL or ""). */
void dt_coord_event(dt_coord_t *c, const char *job, int warn, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* One line for systemd's STATUS= ("2 nodes, 1 job running (job-3 step 1200)"). */
void dt_coord_summary(const dt_coord_t *c, char *buf, size_t len);

/* ---- nodes and jobs (jobs.c) ---- */
dt_node_t *dt_coord_node_by_id(dt_coord_t *c, const char *id);
dt_job_t *dt_coord_job_by_id(dt_coord_t *c, const char *id);
/* COMPLETED, FAILED or STOPPED: the job will never run again. */
int dt_coord_state_terminal(Distrain__V1__JobState s);
/* Sets a job's state with a logged, persisted reason. */
void dt_coord_job_transition(dt_coord_t *c, dt_job_t *j, Distrain__V1__JobState to, const char *fmt,
                             ...) __attribute__((format(printf, 4, 5)));
/* Plans every job that waits (PENDING, RECOVERING) over the idle alive nodes. */
void dt_coord_schedule(dt_coord_t *c);
/* The same, coalesced: runs dt_coord_schedule once on the next loop iteration however many
 * nodes registered, came back or died in this one (a planning pass is O(nodes)). */
void dt_coord_schedule_soon(dt_coord_t *c);
/* A node's assignments changed: bumps its version, persists it, and answers its held
 * WatchAssignment on the next loop iteration, that is after the caller's store transaction
 * has committed (an agent never acts on an assignment a crash could take back). */
void dt_coord_assignments_changed(dt_coord_t *c, dt_node_t *n);
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
/* Remembers the node of every rank of the job's current generation (dt_job_t.rank_node). */
void dt_coord_remember_ranks(dt_job_t *j);
/* The node index rank ran on last (see dt_job_t.rank_node), or -1. */
int dt_coord_rank_node(const dt_job_t *j, int rank);
/* Builds the node's WatchAssignment answer, with the log requests it has not been handed yet
 * (dt_coord_logs_attach). */
Distrain__V1__WatchAssignmentResponse *dt_coord_assignments_for(dt_coord_t *c, dt_node_t *n);
void dt_coord_free_assignments(Distrain__V1__WatchAssignmentResponse *r);
/* Wakes a node's held WatchAssignment call, if any, after its assignments changed. */
void dt_coord_notify_node(dt_coord_t *c, dt_node_t *n);
/* Records a checkpoint shard report (kept in the store first, unless restore: it is being read
 * back from there); writes the manifest when the step is complete. */
int dt_coord_checkpoint_report(dt_coord_t *c, dt_job_t *j, int restore,
                               const Distrain__V1__ReportCheckpointRequest *r, int *committed,
                               char *err, size_t errlen);
void dt_job_free(dt_job_t *j);
void dt_node_free(dt_node_t *n);
/* Forgets a node's GPU usage (it re-registered: its GPUs may have changed). */
void dt_node_clear_usage(dt_node_t *n);

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
/* A new job's in-memory bookkeeping for /metrics (histogram buckets, no checkpoint yet). */
void dt_job_metrics_init(dt_job_t *j);

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
/* A node as ListNodes answers it (borrowing from n). */
void dt_coord_node_view(const dt_node_t *n, Distrain__V1__Node *o);
int dt_coord_register_handlers(dt_coord_t *c);
/* After a store write failed: rewrites every node, job (with its metrics) and the rendezvous
 * and checkpoint-report cleanups into the store in one transaction — memory is the truth — and
 * returns 0 once the store is in step again (at once when it already is). Without force, tries
 * at most every 2 s: a store that stays unwritable stalls the loop for a busy timeout per try. */
int dt_coord_resync(dt_coord_t *c, int force);

/* ---- key-value store (kv.c) ---- */
/* store: where keys are written through (NULL: memory only). */
struct dt_kv *dt_kv_create(dt_store_t *store);
void dt_kv_destroy(struct dt_kv *kv);
/* Stores a value for (job, generation, key), writes it through to the store, and answers the
 * calls waiting on it. DT_EIO if the store refused it (nothing changed then). */
int dt_kv_put(struct dt_kv *kv, const char *job, uint64_t gen, const char *key, const uint8_t *val,
              size_t len);
/* The same without writing to the store (loading it). */
int dt_kv_restore(struct dt_kv *kv, const char *job, uint64_t gen, const char *key,
                  const uint8_t *val, size_t len);
/* Answers call now if the key exists, else holds it until a put or timeout_ms. */
void dt_kv_get(struct dt_kv *kv, uv_loop_t *loop, dt_rpc_call_t *call, const char *job,
               uint64_t gen, const char *key, uint32_t timeout_ms);
/* Drops every key of a job older than gen (UINT64_MAX: all of them; the job ended) from memory
 * and the store; waiting calls for them fail as stale. */
void dt_kv_expire(struct dt_kv *kv, const char *job, uint64_t gen);

/* ---- persistence (store.c) ---- */
int dt_store_open(dt_store_t **out, const char *state_dir);
void dt_store_close(dt_store_t *s);
void dt_store_begin(dt_store_t *s);
/* 0, or DT_EIO when a write since the outermost begin failed (everything since is rolled
 * back). */
int dt_store_commit(dt_store_t *s);
/* Whether a write failed since the last dt_store_retry; while so, writes fail at once. */
int dt_store_unsynced(const dt_store_t *s);
void dt_store_retry(dt_store_t *s);
int dt_store_put_node(dt_store_t *s, const dt_node_t *n);
int dt_store_put_job(dt_store_t *s, const dt_job_t *j);
int dt_store_put_metrics(dt_store_t *s, const char *job, Distrain__V1__StepMetrics *const *m,
                         size_t n);
/* Loads every node and job (with plans and metrics) into c, and the rendezvous keys of their
 * current generations into c->kv (deleting the rest). */
int dt_store_load(dt_store_t *s, dt_coord_t *c);
int dt_store_put_kv(dt_store_t *s, const char *job, uint64_t gen, const char *key,
                    const uint8_t *val, size_t len);
/* Deletes a job's keys of generations older than gen. */
int dt_store_expire_kv(dt_store_t *s, const char *job, uint64_t gen);
/* A checkpoint shard report, kept until its step is committed or a newer generation reports
 * the step again; drop deletes the reports of steps [from_step, to_step]. */
int dt_store_put_ckpt_report(dt_store_t *s, const char *job,
                             const Distrain__V1__ReportCheckpointRequest *r);
int dt_store_drop_ckpt_reports(dt_store_t *s, const char *job, int64_t from_step, int64_t to_step);

#endif
