/* store.h — the coordinator's persistence: nodes, jobs (with their plans and step metrics),
 * rendezvous keys and checkpoint shard reports in one SQLite database in the state dir.
 *
 * Every state change is written here before it is visible over RPC (write-through), so a
 * coordinator killed with SIGKILL comes back with the same jobs, generations, nodes,
 * assignments and committed checkpoints. The store holds an exclusive lock on its directory
 * while open. It knows the state's types (state.h) and nothing of the loop or of RPC. */
#ifndef DT_COORD_STORE_H
#define DT_COORD_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "distrain.pb-c.h"
#include "state.h"

typedef struct dt_coord_store dt_coord_store_t;

int dt_coord_store_open(dt_coord_store_t **out, const char *state_dir);
void dt_coord_store_close(dt_coord_store_t *s);
void dt_coord_store_begin(dt_coord_store_t *s);
/* 0, or DT_EIO when a write since the outermost begin failed (everything since is rolled
 * back). */
int dt_coord_store_commit(dt_coord_store_t *s);
/* Whether a write failed since the last dt_coord_store_retry; while so, writes fail at once. */
int dt_coord_store_unsynced(const dt_coord_store_t *s);
void dt_coord_store_retry(dt_coord_store_t *s);
int dt_coord_store_put_node(dt_coord_store_t *s, const dt_node_t *n);
int dt_coord_store_put_job(dt_coord_store_t *s, const dt_job_t *j);
int dt_coord_store_put_metrics(dt_coord_store_t *s, const char *job,
                               Distrain__V1__StepMetrics *const *m, size_t n);
/* Deletes a job's step metrics from from_step on (a replay replaced them in memory). */
int dt_coord_store_drop_metrics(dt_coord_store_t *s, const char *job, int64_t from_step);
int dt_coord_store_put_kv(dt_coord_store_t *s, const char *job, uint64_t gen, const char *key,
                          const uint8_t *val, size_t len);
/* Deletes a job's keys of generations older than gen. */
int dt_coord_store_expire_kv(dt_coord_store_t *s, const char *job, uint64_t gen);
/* A checkpoint shard report, kept until its step is committed or a newer generation reports
 * the step again; drop deletes the reports of steps [from_step, to_step]. */
int dt_coord_store_put_ckpt_report(dt_coord_store_t *s, const char *job,
                                   const Distrain__V1__ReportCheckpointRequest *r);
int dt_coord_store_drop_ckpt_reports(dt_coord_store_t *s, const char *job, int64_t from_step,
                                     int64_t to_step);

/* What the load hands back beyond the nodes and jobs: the rendezvous keys of the jobs'
 * current generations (the rest is deleted), and the shard reports of checkpoints not yet
 * committed. A non-zero return stops the load with that error. */
typedef struct {
  int (*kv)(void *ud, const char *job, uint64_t gen, const char *key, const uint8_t *val,
            size_t len);
  int (*ckpt_report)(void *ud, dt_job_t *j, const Distrain__V1__ReportCheckpointRequest *r);
  void *ud;
} dt_coord_store_loaders_t;

/* Loads every node and job (with plans and metrics) into st, then the keys and reports through
 * loaders. A loaded node's last_seen_ms is now_ms: its agent gets a full dead-interval to reach
 * the restarted coordinator. */
int dt_coord_store_load(dt_coord_store_t *s, dt_coord_state_t *st, double now_ms,
                        const dt_coord_store_loaders_t *loaders);

#endif
