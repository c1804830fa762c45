/* state.h — the coordinator's nodes and jobs: their types and lookups, at the bottom of
 * coordinator/ (no loop, no RPC, no store: the store, the state machine and the handlers all
 * build on these).
 *
 * Invariants:
 *  - A node's id is "node-<index>", its index into nodes[]; ids survive restarts (the store).
 *  - A job's generation only grows; an assignment, a key-value entry and a trainer status
 *    all carry the generation they belong to, and anything older than the job's current
 *    generation is stale: never served, never counted. */
#ifndef DT_COORD_STATE_H
#define DT_COORD_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "distrain.pb-c.h"
#include "prom.h"

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
  Distrain__V1__DeviceUsage **usage; /* last heartbeat's GPU usage and health (owned) */
  size_t n_usage;
  /* a held WatchAssignment, or NULL; answered by the liveness scan at its deadline */
  struct dt_rpc_call *watch;
  double watch_deadline_ms;
  int n_log_waits; /* GetLogs calls held for this node's agent (logrelay.c), bounded */
  /* The id of the job the user stopped while it used this node (its trainers get SIGTERM and
   * save their step before they exit), until the node takes another job; or NULL. */
  const char *stopped_job;
  int leaving; /* its agent said it is stopping: no new work (until it registers again, across
                * coordinator restarts too); its loss is no failure */
  /* An operator drained it (DrainNode): why ("" when no reason was given; owned), or NULL.
   * Like leaving, but it stays registered and drained until undrained, restarts included. */
  char *drained;
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
  double compute_ms;         /* per step (StepMetrics.compute_ms), a moving average; 0: none yet */
  int slow_checks;           /* consecutive straggler checks that found it slow */
  int straggler;             /* reported as one (status, log) */
  double straggler_since_ms; /* since when (monotonic), while it is one */
  int drain_judged;          /* elastic.straggler_drain_s has passed and its node was judged */
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
  DT_RESTART_LOSS_SPIKE, /* a loss over elastic.spike_factor x the recent average: rolled back */
  DT_RESTART_GRAD_SPIKE, /* a gradient norm over elastic.grad_spike_factor x the same */
  DT_RESTART_HANG,       /* a collective blocked past the hang timeout */
  DT_RESTART_GROW,       /* nodes came back: grown to a larger dp at a checkpoint */
  DT_RESTART_STOPPED,    /* a trainer was asked to stop (SIGTERM) and saved its step first */
  DT_RESTART_PREEMPTED,  /* the same, for a job of higher elastic.priority that needed its nodes */
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
  /* Stopped for a job of higher elastic.priority (its id), until its trainers have saved their
   * step and it is planned again; "" otherwise. */
  char preempted_by[32];
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
  uint64_t ckpt_failures; /* steps abandoned: a writer could not write its shard */
  double ckpt_seconds;    /* newest commit: its first shard report to its manifest (-1: none) */
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

/* Every node and job the coordinator knows. nodes[i] is node-i (NULL: an index never used);
 * jobs are in submission order. */
typedef struct {
  dt_node_t **nodes;
  size_t n_nodes, cap_nodes;
  dt_job_t **jobs;
  size_t n_jobs, cap_jobs;
  uint64_t next_job; /* the number in the next job's id ("job-N") */
} dt_coord_state_t;

dt_node_t *dt_coord_node_by_id(const dt_coord_state_t *s, const char *id);
dt_job_t *dt_coord_job_by_id(const dt_coord_state_t *s, const char *id);
/* The index of j in s->jobs (what dt_node_t.job holds), or -1. */
int dt_coord_job_index(const dt_coord_state_t *s, const dt_job_t *j);
/* Puts n at nodes[n->index] (growing the array); DT_ENOMEM leaves s unchanged. */
int dt_coord_add_node(dt_coord_state_t *s, dt_node_t *n);
/* Appends j to the jobs; DT_ENOMEM leaves s unchanged. */
int dt_coord_add_job(dt_coord_state_t *s, dt_job_t *j);
/* Frees every node and job. */
void dt_coord_state_free(dt_coord_state_t *s);
/* COMPLETED, FAILED or STOPPED: the job will never run again. */
int dt_coord_state_terminal(Distrain__V1__JobState s);
/* Remembers the node of every rank of the job's current generation (dt_job_t.rank_node). */
void dt_coord_remember_ranks(dt_job_t *j);
/* The node index rank ran on last (see dt_job_t.rank_node), or -1. */
int dt_coord_rank_node(const dt_job_t *j, int rank);
/* A new job's in-memory bookkeeping for /metrics (histogram buckets, no checkpoint yet). */
void dt_job_metrics_init(dt_job_t *j);
/* Frees a pending checkpoint's reports (not p itself). */
void dt_ckpt_pending_free(dt_ckpt_pending_t *p);
/* Frees the current generation's rank slots. */
void dt_job_free_ranks(dt_job_t *j);
void dt_job_free(dt_job_t *j);
void dt_node_free(dt_node_t *n);
/* Forgets a node's GPU usage (it re-registered: its GPUs may have changed). */
void dt_node_clear_usage(dt_node_t *n);

#endif
