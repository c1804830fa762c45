/* test_coord.c — Check suite for the coordinator's job state machine (coordinator/jobs.c) on
 * a real coordinator (dt_coord_start: its SQLite store in a temporary state dir, an RPC server
 * on an ephemeral port that no test calls) whose nodes and heartbeats the tests make up:
 *  - planning: placement over idle nodes, min_nodes, the largest dp that fits;
 *  - recovery: a lost node shrinks the job (gradient accumulation keeps the batch) and it grows
 *    back at the next commit without spending a restart; a failed trainer restarts in place
 *    until max_restarts, an input error fails at once;
 *  - checkpoint commit: all shards in, idempotent and stale reports, a generation that starts
 *    a step over, the manifest on disk, and the pending reports surviving a restart;
 *  - step metrics across generations: replays replace, an older generation's late steps fill
 *    in up to the checkpoint the current generation resumed from;
 *  - draining a node: its job saves its step and restarts without it, uncounted; the drain
 *    outlives a restart, and a state store from before it is upgraded.
 * The same paths over RPC, with real agents and trainers, are test_control_plane's. */
#include <check.h>
#include <sqlite3.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "checkpoint_manifest.h"
#include "coord.h"
#include "dt_error.h"
#include "dt_util.h"
#include "jobspec.h"
#include "ut_fs.h"

typedef struct {
  uv_loop_t loop;
  dt_coord_t c;
  char dir[256], state[300], ckpt[300];
} fx_t;

static void fx_start(fx_t *f)
{
  dt_coord_config_t cfg = {.listen = "127.0.0.1:0",
                           .state_dir = f->state,
                           .token = "test-token",
                           .heartbeat_ms = 200,
                           .dead_after_missed = 3};
  ck_assert_int_eq(dt_coord_start(&f->c, &f->loop, &cfg), 0);
}

static fx_t *fx_new(void)
{
  fx_t *f = calloc(1, sizeof *f);
  ck_assert_ptr_nonnull(f);
  ut_mkdtemp(f->dir, sizeof f->dir);
  snprintf(f->state, sizeof f->state, "%s/state", f->dir);
  snprintf(f->ckpt, sizeof f->ckpt, "%s/ckpt", f->dir);
  ck_assert_int_eq(uv_loop_init(&f->loop), 0);
  fx_start(f);
  return f;
}

static void on_closed(void *ud)
{
  *(int *)ud = 1;
}

static void fx_stop(fx_t *f)
{
  int done = 0;
  dt_coord_close(&f->c, on_closed, &done);
  while (!done)
    uv_run(&f->loop, UV_RUN_ONCE);
}

static void fx_free(fx_t *f)
{
  fx_stop(f);
  ck_assert_int_eq(uv_loop_close(&f->loop), 0);
  ut_rm_rf(f->dir);
  free(f);
}

/* A coordinator killed and started again on the same state dir. */
static void fx_restart(fx_t *f)
{
  fx_stop(f);
  fx_start(f);
}

/* A registered, alive node with ndev devices of a kind ("cpu", "cuda"). */
static dt_node_t *add_node_of(fx_t *f, const char *host, int ndev, const char *kind)
{
  Distrain__V1__NodeInfo info = DISTRAIN__V1__NODE_INFO__INIT;
  Distrain__V1__Device dev[8], *devp[8];
  ck_assert_int_le(ndev, 8);
  for (int i = 0; i < ndev; i++) {
    distrain__v1__device__init(&dev[i]);
    dev[i].kind = (char *)kind;
    dev[i].index = i;
    devp[i] = &dev[i];
  }
  info.hostname = (char *)host;
  info.devices = devp;
  info.n_devices = (size_t)ndev;
  dt_node_t *n = calloc(1, sizeof *n);
  ck_assert_ptr_nonnull(n);
  n->index = (int)f->c.st.n_nodes;
  snprintf(n->id, sizeof n->id, "node-%d", n->index);
  n->info = dt_pb_copy(&info.base);
  ck_assert_ptr_nonnull(n->info);
  n->job = -1;
  n->state = DISTRAIN__V1__NODE_STATE__NODE_ALIVE;
  n->last_seen_ms = dt_coord_now_ms();
  n->last_seen_wall_ms = dt_wall_ms();
  ck_assert_int_eq(dt_coord_add_node(&f->c.st, n), 0);
  ck_assert_int_eq(dt_coord_store_put_node(f->c.store, n), 0);
  return n;
}

static dt_node_t *add_node(fx_t *f, const char *host, int ndev)
{
  return add_node_of(f, host, ndev, "cpu");
}

/* Submits the default spec with these "section.key=value" overrides (NULL-terminated). */
static dt_job_t *submit(fx_t *f, ...)
{
  Distrain__V1__JobSpec *spec;
  char err[512], set[512];
  ck_assert_int_eq(dt_jobspec_new_default(&spec), 0);
  snprintf(set, sizeof set, "checkpoint.dir=%s", f->ckpt);
  ck_assert_int_eq(dt_jobspec_set(spec, set, err, sizeof err), 0);
  ck_assert_int_eq(dt_jobspec_set(spec, "elastic.max_nodes=8", err, sizeof err), 0);
  va_list ap;
  va_start(ap, f);
  for (const char *a; (a = va_arg(ap, const char *));)
    ck_assert_msg(dt_jobspec_set(spec, a, err, sizeof err) == 0, "%s", err);
  va_end(ap);
  dt_job_t *j;
  ck_assert_int_eq(dt_coord_submit_job(&f->c, spec, &j), 0);
  dt_jobspec_free(spec);
  return j;
}

/* A dp=2 job (batch 8 = 2 x micro-batch 4: grad accum 1, or 2 at dp 1). */
static dt_job_t *submit_dp2(fx_t *f, const char *extra)
{
  return submit(f, "parallel.dp=2", "training.micro_batch=4", extra, NULL);
}

/* A coordinator with two one-device nodes and a dp=2 job planned on them (generation 1). */
static fx_t *two_nodes_dp2(const char *extra, dt_job_t **j)
{
  fx_t *f = fx_new();
  add_node(f, "h0", 1);
  add_node(f, "h1", 1);
  *j = submit_dp2(f, extra);
  dt_coord_schedule(&f->c);
  return f;
}

static Distrain__V1__JobState state(const dt_job_t *j)
{
  return j->job->state;
}

/* One heartbeat of node n carrying one trainer's status. */
typedef struct {
  Distrain__V1__TrainerState state;
  int64_t step;
  int exit_code, term_signal;
  uint64_t generation;         /* 0: the job's current one */
  const int64_t *metric_steps; /* rank 0's step metrics (loss = step + loss_offset) */
  int n_metrics;
  double loss_offset;
} status_t;

static void heartbeat(fx_t *f, dt_node_t *n, dt_job_t *j, int rank, status_t s)
{
  Distrain__V1__TrainerStatus ts = DISTRAIN__V1__TRAINER_STATUS__INIT, *tsp = &ts;
  Distrain__V1__StepMetrics m[64], *mp[64];
  ck_assert_int_le(s.n_metrics, 64);
  ts.job_id = j->id;
  ts.generation = s.generation ? s.generation : j->job->generation;
  ts.rank = rank;
  ts.state = s.state;
  ts.step = s.step;
  ts.exit_code = s.exit_code;
  ts.term_signal = s.term_signal;
  ts.last_error = "";
  for (int i = 0; i < s.n_metrics; i++) {
    distrain__v1__step_metrics__init(&m[i]);
    m[i].step = s.metric_steps[i];
    m[i].loss = (double)s.metric_steps[i] + s.loss_offset;
    m[i].ms = 10;
    mp[i] = &m[i];
  }
  ts.metrics = mp;
  ts.n_metrics = (size_t)s.n_metrics;
  n->trainers = &tsp;
  n->n_trainers = 1;
  dt_coord_trainer_status(&f->c, n);
  n->trainers = NULL;
  n->n_trainers = 0;
}

/* Every rank of the current generation reports RUNNING at step. */
static void all_running(fx_t *f, dt_job_t *j, int64_t step)
{
  for (int r = 0; r < j->world; r++)
    heartbeat(f, f->c.st.nodes[j->ranks[r].node], j, r,
              (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, .step = step});
}

/* Rank r's shard report of step (its share of 100 parameters); name holds its shard's name. */
static Distrain__V1__ReportCheckpointRequest
shard_report(fx_t *f, dt_job_t *j, uint64_t gen, int64_t step, int r, int world, char name[32])
{
  Distrain__V1__ReportCheckpointRequest q = DISTRAIN__V1__REPORT_CHECKPOINT_REQUEST__INIT;
  char sdir[512];
  snprintf(name, 32, "shard-%d.bin", r);
  dt_ckpt_step_dir(sdir, sizeof sdir, f->ckpt, step); /* where the writers put their shards */
  mkdir(f->ckpt, 0755);
  mkdir(sdir, 0755);
  q.job_id = j->id;
  q.generation = gen;
  q.step = step;
  q.rank = r;
  q.world = world;
  q.lo = 100 * r / world;
  q.hi = 100 * (r + 1) / world;
  q.bytes = 4 * (uint64_t)(q.hi - q.lo);
  q.crc32c = 0x1234u + (uint32_t)r;
  q.name = name;
  return q;
}

static int report_ckpt(fx_t *f, dt_job_t *j, uint64_t gen, int64_t step, int r, int world,
                       int *committed)
{
  char name[32], err[256];
  Distrain__V1__ReportCheckpointRequest q = shard_report(f, j, gen, step, r, world, name);
  return dt_coord_checkpoint_report(&f->c, j, 0, &q, committed, err, sizeof err);
}

/* Makes step's directory unusable for a manifest (a file where the directory should be), or
 * usable again. */
static void break_step_dir(fx_t *f, int64_t step, int broken)
{
  char sdir[512];
  dt_ckpt_step_dir(sdir, sizeof sdir, f->ckpt, step);
  ut_rm_rf(sdir);
  if (broken)
    ut_write_all(sdir, "not a directory", 15);
  else
    ck_assert_int_eq(mkdir(sdir, 0755), 0);
}

/* Commits step: every rank of the current generation reports its shard. */
static void commit(fx_t *f, dt_job_t *j, int64_t step)
{
  int committed = 0;
  for (int r = 0; r < j->world; r++)
    ck_assert_int_eq(report_ckpt(f, j, j->job->generation, step, r, j->world, &committed), 0);
  ck_assert_int_eq(committed, 1);
  ck_assert_int_eq(j->job->committed_step, step);
}

static int nodes_of(const fx_t *f, const dt_job_t *j)
{
  int n = 0, idx = dt_coord_job_index(&f->c.st, j);
  for (size_t i = 0; i < f->c.st.n_nodes; i++)
    n += f->c.st.nodes[i]->job == idx;
  return n;
}

/* ------------------------------------------------------------------------------------------ */
/* Planning                                                                                    */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_plan_places_ranks_on_idle_nodes)
{
  fx_t *f = fx_new();
  dt_node_t *n[3] = {add_node(f, "h0", 1), add_node(f, "h1", 1), add_node(f, "h2", 1)};
  dt_job_t *j = submit_dp2(f, NULL);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_PENDING);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(j->job->generation, 1);
  ck_assert_int_eq(j->world, 2);
  ck_assert_int_eq(j->grad_accum, 1);
  ck_assert_int_ne(j->ranks[0].node, j->ranks[1].node);
  ck_assert_int_eq(nodes_of(f, j), 2);
  /* The nodes that got ranks have a new assignment naming them; the third stays idle. */
  int idle = 0;
  for (int i = 0; i < 3; i++) {
    Distrain__V1__WatchAssignmentResponse *a = dt_coord_assignments_for(&f->c, n[i]);
    ck_assert_ptr_nonnull(a);
    if (n[i]->job < 0) {
      idle++;
      ck_assert_int_eq(a->n_assignments, 0);
    } else {
      ck_assert_int_eq(a->n_assignments, 1);
      ck_assert_str_eq(a->assignments[0]->job_id, j->id);
      ck_assert_int_eq(a->assignments[0]->generation, 1);
      ck_assert_int_eq(a->assignments[0]->n_ranks, 1);
      ck_assert_int_eq(j->ranks[a->assignments[0]->ranks[0]->rank].node, n[i]->index);
      ck_assert_int_eq(n[i]->assign_version, 1);
    }
    dt_coord_free_assignments(a);
  }
  ck_assert_int_eq(idle, 1);
  /* RUNNING once every rank trains, not before. */
  heartbeat(f, f->c.st.nodes[j->ranks[0].node], j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, .step = 1});
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  all_running(f, j, 1);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RUNNING);
  /* Every rank done: COMPLETED, the nodes free again. */
  for (int r = 0; r < 2; r++)
    heartbeat(f, f->c.st.nodes[j->ranks[r].node], j, r,
              (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_SUCCEEDED, .step = 100});
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_COMPLETED);
  ck_assert_int_eq(nodes_of(f, j), 0);
  fx_free(f);
}
END_TEST

START_TEST(test_plan_waits_for_min_nodes_then_takes_the_largest_dp)
{
  fx_t *f = fx_new();
  add_node(f, "h0", 1);
  dt_job_t *j = submit_dp2(f, "elastic.min_nodes=2");
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_PENDING);
  ck_assert_str_eq(j->job->reason, "waiting for nodes: 1 idle, min_nodes 2");
  ck_assert_int_eq(j->job->generation, 0);
  add_node(f, "h1", 1);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(j->dp, 2);
  /* min_nodes 1 on one node: dp 1 with twice the accumulation keeps the global batch. */
  fx_t *g = fx_new();
  add_node(g, "h0", 1);
  dt_job_t *k = submit_dp2(g, NULL);
  dt_coord_schedule(&g->c);
  ck_assert_int_eq(state(k), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(k->dp, 1);
  ck_assert_int_eq(k->grad_accum, 2);
  ck_assert_int_eq(k->job->requested_dp, 2);
  fx_free(g);
  fx_free(f);
}
END_TEST

/* A job its own elastic.max_nodes keeps from idle nodes it needs says so: the cluster could
 * hold it, its spec does not let it. */
START_TEST(test_plan_names_max_nodes_when_it_limits)
{
  fx_t *f = fx_new();
  add_node(f, "h0", 1);
  add_node(f, "h1", 1);
  dt_job_t *j = submit(f, "parallel.pp=2", "elastic.max_nodes=1", NULL);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_PENDING);
  ck_assert_str_eq(j->job->reason, "world 2 (pp 2 x dp 1 x cp 1 x tp 1) needs 2 devices, 1 node "
                                   "offers 1 (elastic.max_nodes 1; 2 nodes are idle)");
  dt_job_t *k = submit(f, "parallel.pp=2", NULL); /* max_nodes 8 */
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(k), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  fx_free(f);
}
END_TEST

/* A job asking for cuda devices takes only nodes that offer GPUs, one asking for cpu only
 * nodes that offer CPU devices; auto takes either. */
START_TEST(test_plan_matches_the_device_kind)
{
  fx_t *f = fx_new();
  dt_node_t *cpu = add_node(f, "cpu0", 2);
  dt_job_t *j = submit(f, "training.device=cuda", NULL);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_PENDING);
  ck_assert_str_eq(j->job->reason, "waiting for nodes: 0 idle with cuda devices, min_nodes 1");
  dt_node_t *gpu = add_node_of(f, "gpu0", 2, "cuda");
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(gpu->job, dt_coord_job_index(&f->c.st, j));
  ck_assert_int_lt(cpu->job, 0);
  dt_job_t *k = submit(f, "training.device=cpu", NULL);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(k), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(cpu->job, dt_coord_job_index(&f->c.st, k));
  fx_free(f);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Recovery                                                                                    */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_lost_node_shrinks_then_grows_back_at_a_commit)
{
  fx_t *f = fx_new();
  dt_node_t *n0 = add_node(f, "h0", 1), *n1 = add_node(f, "h1", 1);
  dt_job_t *j = submit_dp2(f, NULL);
  dt_coord_schedule(&f->c);
  all_running(f, j, 5);
  commit(f, j, 10);
  dt_coord_node_dead(&f->c, n1);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RECOVERING);
  ck_assert_int_eq(j->job->restarts, 1);
  ck_assert_int_eq(j->restarts_by[DT_RESTART_NODE_DEAD], 1);
  ck_assert_int_eq(j->job->n_failed_nodes, 1);
  ck_assert_str_eq(j->job->failed_nodes[0], n1->id);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(j->job->generation, 2);
  ck_assert_int_eq(j->world, 1);
  ck_assert_int_eq(j->grad_accum, 2);
  ck_assert_int_eq(j->resume_step, 10);
  ck_assert_int_eq(j->ranks[0].node, n0->index);
  all_running(f, j, 11);
  /* The node comes back; nothing happens until the next commit. */
  n1->state = DISTRAIN__V1__NODE_STATE__NODE_ALIVE;
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(j->job->generation, 2);
  commit(f, j, 20);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RECOVERING);
  ck_assert_str_eq(j->job->reason, "growing from dp 1 to dp 2 at checkpoint step 20");
  ck_assert_int_eq(j->job->restarts, 1); /* growing is not a failure */
  ck_assert_int_eq(j->restarts_by[DT_RESTART_GROW], 1);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(j->job->generation, 3);
  ck_assert_int_eq(j->world, 2);
  ck_assert_int_eq(j->grad_accum, 1);
  ck_assert_int_eq(j->resume_step, 20);

  /* Shrunk again, then its last step committed: it has finished, and is not restarted on the
   * node that came back to train no step there. */
  all_running(f, j, 21);
  dt_coord_node_dead(&f->c, n1);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(j->world, 1);
  all_running(f, j, 21);
  n1->state = DISTRAIN__V1__NODE_STATE__NODE_ALIVE;
  const uint64_t gen = j->job->generation;
  commit(f, j, j->job->spec->training->steps);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RUNNING);
  ck_assert_int_eq(j->job->generation, gen);
  fx_free(f);
}
END_TEST

START_TEST(test_failed_trainer_restarts_in_place_until_max_restarts)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2("elastic.max_restarts=2", &j);
  for (int attempt = 1; attempt <= 3; attempt++) {
    all_running(f, j, 3);
    const uint64_t gen = j->job->generation;
    heartbeat(f, f->c.st.nodes[j->ranks[1].node], j, 1,
              (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED, .exit_code = 1});
    if (attempt <= 2) {
      /* dt_coord_trainer_status re-plans at once: same world on the healthy nodes. */
      ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
      ck_assert_int_eq(j->job->restarts, attempt);
      ck_assert_int_eq(j->job->generation, gen + 1);
      ck_assert_int_eq(j->world, 2);
      ck_assert_int_eq(j->restarts_by[DT_RESTART_TRAINER_FAILED], attempt);
    } else {
      ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_FAILED);
      ck_assert_ptr_nonnull(strstr(j->job->reason, "giving up after 2 restarts (max_restarts 2)"));
      ck_assert_int_eq(nodes_of(f, j), 0);
    }
  }
  fx_free(f);
}
END_TEST

START_TEST(test_input_error_fails_without_a_restart)
{
  fx_t *f = fx_new();
  add_node(f, "h0", 1);
  dt_job_t *j = submit(f, NULL);
  dt_coord_schedule(&f->c);
  heartbeat(f, f->c.st.nodes[j->ranks[0].node], j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED, .exit_code = 2});
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_FAILED);
  ck_assert_int_eq(j->job->restarts, 0);
  ck_assert_ptr_nonnull(strstr(j->job->reason, "not restarted"));
  fx_free(f);
}
END_TEST

/* Exit status 3: asked to stop (SIGTERM) after a step every rank saved. The job restarts from
 * it, and no such restart counts against max_restarts, however many there are. */
START_TEST(test_stopped_trainer_restarts_uncounted)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2("elastic.max_restarts=1", &j);
  for (int stop = 1; stop <= 3; stop++) {
    all_running(f, j, 3);
    const uint64_t gen = j->job->generation;
    heartbeat(f, f->c.st.nodes[j->ranks[0].node], j, 0,
              (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED,
                         .exit_code = DT_TRAIN_EXIT_STOPPED});
    ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
    ck_assert_int_eq(j->job->generation, gen + 1);
    ck_assert_int_eq(j->world, 2);
    ck_assert_int_eq(j->job->restarts, 0);
    ck_assert_int_eq(j->restarts_by[DT_RESTART_STOPPED], stop);
  }
  /* Why the newest generation replaced the one before, kept past the reason of its states. */
  ck_assert_msg(strstr(j->job->last_restart, "rank 0 on node-0 exited with code 3; restarting") &&
                    strstr(j->job->reason, "world 2"),
                "%s / %s", j->job->last_restart, j->job->reason);
  fx_free(f);
}
END_TEST

/* A node whose agent said it is leaving takes no new work: a lost job's next generation goes to
 * the spare; and its own loss, once its heartbeats stop, is no failure. */
START_TEST(test_leaving_node_gets_no_work_and_its_loss_is_uncounted)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  add_node(f, "spare", 1);
  all_running(f, j, 3);
  dt_node_t *leaving = f->c.st.nodes[j->ranks[1].node];
  leaving->leaving = 1;
  heartbeat(f, f->c.st.nodes[j->ranks[0].node], j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED,
                       .exit_code = DT_TRAIN_EXIT_STOPPED});
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(j->world, 2);
  ck_assert_int_eq(leaving->job, -1);
  ck_assert_int_eq(f->c.st.nodes[2]->job, dt_coord_job_index(&f->c.st, j));

  /* The spare leaves too, while it runs the job: its death restarts the job on the one node
   * left (dp 1), uncounted. */
  all_running(f, j, 5);
  dt_node_t *spare = f->c.st.nodes[2];
  spare->leaving = 1;
  dt_coord_node_dead(&f->c, spare);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(j->job->restarts, 0);
  ck_assert_int_eq(j->restarts_by[DT_RESTART_STOPPED], 2);
  ck_assert_int_eq(j->world, 1);
  ck_assert_int_eq(nodes_of(f, j), 1);
  fx_free(f);
}
END_TEST

/* Draining a node that runs a dp=2 job: its trainers lose their assignment and are told to save
 * (stopped_job), the job runs on until they have; their exit (stopped by their agent, status 3)
 * restarts it on the other node and the spare, uncounted. The drain is kept across a restart. */
START_TEST(test_drained_node_stops_its_job_and_gets_no_work)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  add_node(f, "spare", 1);
  all_running(f, j, 3);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RUNNING);
  dt_node_t *drained = f->c.st.nodes[j->ranks[1].node];
  const int idx = drained->index;
  ck_assert_int_eq(dt_coord_drain(&f->c, drained, "swap a DIMM"), 0);
  Distrain__V1__WatchAssignmentResponse *w = dt_coord_assignments_for(&f->c, drained);
  ck_assert_uint_eq(w->n_assignments, 0);
  ck_assert_str_eq(w->stopped_job, j->id);
  dt_coord_free_assignments(w);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RUNNING); /* until they have saved */
  const uint64_t gen = j->job->generation;
  heartbeat(f, drained, j, 1,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_STOPPED,
                       .exit_code = DT_TRAIN_EXIT_STOPPED});
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(j->job->generation, gen + 1);
  ck_assert_int_eq(j->world, 2);
  ck_assert_int_eq(j->job->restarts, 0);
  ck_assert_int_eq(j->restarts_by[DT_RESTART_STOPPED], 1);
  ck_assert_int_eq(drained->job, -1);
  ck_assert_int_eq(f->c.st.nodes[2]->job, dt_coord_job_index(&f->c.st, j));

  fx_restart(f);
  drained = f->c.st.nodes[idx];
  ck_assert_str_eq(drained->drained, "swap a DIMM");
  ck_assert_int_eq(dt_coord_drain(&f->c, drained, NULL), 0);
  ck_assert_ptr_null(drained->drained);
  fx_restart(f);
  ck_assert_ptr_null(f->c.st.nodes[idx]->drained);
  fx_free(f);
}
END_TEST

/* elastic.priority: a job the idle nodes cannot hold preempts the running jobs of lower
 * priority that make it fit (the lowest, then the newest first; no more than needed): their
 * trainers lose their assignment and are told to save (stopped_job); once they have (status 3)
 * each waits, uncounted, while the preemptor runs on its nodes, then resumes from the step it
 * saved. A job of equal priority, or one that would not fit anyway, preempts nothing; waiting
 * jobs are planned highest priority first. */
START_TEST(test_priority_preempts_lower_jobs)
{
  fx_t *f = fx_new();
  dt_node_t *n[3] = {add_node(f, "h0", 1), add_node(f, "h1", 1), add_node(f, "h2", 1)};
  dt_job_t *low = submit(f, "elastic.priority=-1", NULL); /* one node each */
  dt_job_t *a = submit(f, NULL), *b = submit(f, NULL);
  dt_coord_schedule(&f->c);
  dt_job_t *run[3] = {low, a, b};
  for (int i = 0; i < 3; i++) {
    all_running(f, run[i], 5);
    commit(f, run[i], 4);
  }
  /* Equal priority, or more nodes than there are: it waits, nothing is preempted. */
  dt_job_t *same = submit(f, "elastic.priority=-1", NULL);
  dt_job_t *big = submit(f, "parallel.dp=4", "training.micro_batch=2", "elastic.min_nodes=4",
                         "elastic.priority=9", NULL);
  dt_coord_schedule(&f->c);
  ck_assert_str_eq(same->job->reason, "waiting for nodes: 0 idle, min_nodes 1 (3 more busy with "
                                      "other jobs)");
  ck_assert_str_eq(big->job->reason, "waiting for nodes: 0 idle, min_nodes 4 (3 more busy with "
                                     "other jobs)");
  for (int i = 0; i < 3; i++)
    ck_assert_str_eq(run[i]->preempted_by, "");
  dt_coord_job_transition(&f->c, same, DISTRAIN__V1__JOB_STATE__JOB_STOPPED, "stopped");
  dt_coord_job_transition(&f->c, big, DISTRAIN__V1__JOB_STATE__JOB_STOPPED, "stopped");

  /* Priority 5 on two nodes: the priority -1 job's, then the newer priority 0 job's. */
  dt_job_t *hi = submit(f, "parallel.dp=2", "training.micro_batch=4", "elastic.min_nodes=2",
                        "elastic.priority=5", NULL);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(hi), DISTRAIN__V1__JOB_STATE__JOB_PENDING);
  char want[256];
  snprintf(want, sizeof want,
           "preempting %s (elastic.priority -1), %s (elastic.priority 0): they save their step, "
           "then leave their nodes to this job",
           low->id, b->id);
  ck_assert_str_eq(hi->job->reason, want);
  ck_assert_str_eq(low->preempted_by, hi->id);
  ck_assert_str_eq(b->preempted_by, hi->id);
  ck_assert_str_eq(a->preempted_by, "");
  for (int i = 0; i < 3; i++) {
    Distrain__V1__WatchAssignmentResponse *w = dt_coord_assignments_for(&f->c, n[i]);
    const dt_job_t *on = f->c.st.jobs[n[i]->job];
    ck_assert_uint_eq(w->n_assignments, on == a ? 1 : 0);
    if (on != a)
      ck_assert_str_eq(w->stopped_job, on->id);
    dt_coord_free_assignments(w);
  }
  ck_assert_int_eq(state(low), DISTRAIN__V1__JOB_STATE__JOB_RUNNING); /* until they have saved */
  dt_coord_schedule(&f->c); /* nothing more is preempted meanwhile */
  ck_assert_str_eq(hi->job->reason, "waiting for the jobs it preempted to save their step and "
                                    "stop");
  ck_assert_str_eq(a->preempted_by, "");

  /* They save step 6 and stop: the preemptor takes their nodes; they wait, uncounted. */
  dt_job_t *victims[2] = {low, b};
  for (int i = 0; i < 2; i++) {
    commit(f, victims[i], 6);
    heartbeat(f, f->c.st.nodes[victims[i]->ranks[0].node], victims[i], 0,
              (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED,
                         .exit_code = DT_TRAIN_EXIT_STOPPED});
    if (i == 0) { /* its node stays free for the preemptor, which waits for the other */
      snprintf(want, sizeof want,
               "; next generation: waiting: %s (elastic.priority 5) takes "
               "the nodes freed first",
               hi->id);
      ck_assert_msg(strstr(low->job->reason, want), "%s", low->job->reason);
      ck_assert_int_lt(n[low->ranks[0].node]->job, 0);
    }
  }
  ck_assert_int_eq(state(hi), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(hi->world, 2);
  for (int i = 0; i < 2; i++) {
    dt_job_t *v = victims[i];
    ck_assert_int_eq(state(v), DISTRAIN__V1__JOB_STATE__JOB_RECOVERING);
    ck_assert_int_eq(v->job->restarts, 0);
    ck_assert_int_eq(v->restarts_by[DT_RESTART_PREEMPTED], 1);
    ck_assert_str_eq(v->preempted_by, "");
    snprintf(want, sizeof want, "(preempted by %s); restarting from checkpoint step 6", hi->id);
    ck_assert_msg(strstr(v->job->reason, want), "%s", v->job->reason);
  }
  /* The preemptor done, they resume from the step they saved. */
  for (int i = 0; i < hi->world; i++)
    heartbeat(f, f->c.st.nodes[hi->ranks[i].node], hi, i,
              (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_SUCCEEDED});
  ck_assert_int_eq(state(hi), DISTRAIN__V1__JOB_STATE__JOB_COMPLETED);
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(state(victims[i]), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
    ck_assert_int_eq(victims[i]->resume_step, 6);
  }
  fx_free(f);

  /* One node, two jobs waiting for it: the higher priority goes first, though submitted last;
   * a job preempted in rendezvous (no step to save yet) gives its nodes up at once. */
  f = fx_new();
  add_node(f, "h0", 1);
  dt_job_t *first = submit(f, NULL);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(first), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  dt_job_t *x = submit(f, "elastic.priority=1", NULL), *y = submit(f, "elastic.priority=2", NULL);
  dt_coord_schedule(&f->c); /* y preempts `first`, still in rendezvous; the next pass places y */
  ck_assert_int_eq(state(first), DISTRAIN__V1__JOB_STATE__JOB_RECOVERING);
  ck_assert_int_eq(first->restarts_by[DT_RESTART_PREEMPTED], 1);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(y), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(state(x), DISTRAIN__V1__JOB_STATE__JOB_PENDING);
  fx_free(f);
}
END_TEST

/* A coordinator restarted while a preempted job saves its step (what it preempted is not
 * stored): the preemptor, still waiting, preempts it again; the trainers' exit then hands the
 * node over as before, uncounted. */
START_TEST(test_preemption_outlives_a_coordinator_restart)
{
  fx_t *f = fx_new();
  add_node(f, "h0", 1);
  dt_job_t *low = submit(f, NULL);
  dt_coord_schedule(&f->c);
  all_running(f, low, 5);
  dt_job_t *hi = submit(f, "elastic.priority=1", NULL);
  dt_coord_schedule(&f->c);
  ck_assert_str_eq(low->preempted_by, hi->id);
  char id[2][32];
  snprintf(id[0], sizeof id[0], "%s", low->id);
  snprintf(id[1], sizeof id[1], "%s", hi->id);
  fx_restart(f);
  uv_run(&f->loop, UV_RUN_NOWAIT);
  low = dt_coord_job_by_id(&f->c.st, id[0]);
  hi = dt_coord_job_by_id(&f->c.st, id[1]);
  dt_coord_schedule(&f->c);
  ck_assert_str_eq(low->preempted_by, hi->id);
  commit(f, low, 6);
  heartbeat(f, f->c.st.nodes[low->ranks[0].node], low, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED,
                       .exit_code = DT_TRAIN_EXIT_STOPPED});
  ck_assert_int_eq(state(hi), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(state(low), DISTRAIN__V1__JOB_STATE__JOB_RECOVERING);
  ck_assert_int_eq(low->job->restarts, 0);
  fx_free(f);
}
END_TEST

/* A one-node job on a drained node waits for nodes, saying that one is drained, and runs
 * again when it is undrained. A trainer there that did not save in time (SIGKILLed after its
 * agent's grace period) is no failure either. */
START_TEST(test_drained_node_job_waits_for_undrain)
{
  fx_t *f = fx_new();
  dt_node_t *n = add_node(f, "h0", 1);
  dt_job_t *j = submit(f, "elastic.max_restarts=0", NULL);
  dt_coord_schedule(&f->c);
  all_running(f, j, 3);
  ck_assert_int_eq(dt_coord_drain(&f->c, n, ""), 0);
  heartbeat(f, n, j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_STOPPED, .term_signal = 9});
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RECOVERING);
  ck_assert_int_eq(j->job->restarts, 0);
  ck_assert_msg(strstr(j->job->reason, "killed by signal 9 (its node is being drained)") &&
                    strstr(j->job->reason, "waiting for nodes: 0 idle, min_nodes 1 (1 drained: "
                                           "distrainctl undrain)"),
                "%s", j->job->reason);
  ck_assert_int_eq(dt_coord_drain(&f->c, n, NULL), 0);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(n->job, dt_coord_job_index(&f->c.st, j));

  /* Undrained before its trainer has stopped: the trainer its agent stopped (killed after the
   * grace period here) still ends the generation (nothing else would), uncounted, and the job
   * runs on there. */
  all_running(f, j, 5);
  ck_assert_int_eq(dt_coord_drain(&f->c, n, "oops"), 0);
  ck_assert_int_eq(dt_coord_drain(&f->c, n, NULL), 0);
  const uint64_t gen = j->job->generation;
  heartbeat(f, n, j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_STOPPED, .term_signal = 9});
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(j->job->generation, gen + 1);
  ck_assert_int_eq(j->job->restarts, 0);
  ck_assert_int_eq(j->restarts_by[DT_RESTART_STOPPED], 2);
  fx_free(f);
}
END_TEST

/* Drained while its job is still in rendezvous (a rank there may not have started, so no step
 * can be saved): the job restarts without it at once, uncounted. */
START_TEST(test_drain_during_rendezvous_restarts_at_once)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  add_node(f, "spare", 1);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  dt_node_t *drained = f->c.st.nodes[j->ranks[0].node];
  ck_assert_int_eq(dt_coord_drain(&f->c, drained, "reboot"), 0);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RECOVERING);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(j->job->generation, 2);
  ck_assert_int_eq(j->job->restarts, 0);
  ck_assert_int_eq(drained->job, -1);
  ck_assert_int_eq(nodes_of(f, j), 2);

  /* Drained, then gone before its trainers were heard from (taken down at once): that loss is
   * no failure either. */
  all_running(f, j, 4);
  dt_node_t *spare = f->c.st.nodes[2];
  ck_assert_int_eq(spare->job, dt_coord_job_index(&f->c.st, j));
  ck_assert_int_eq(dt_coord_drain(&f->c, spare, "reboot"), 0);
  dt_coord_node_dead(&f->c, spare);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RECOVERING);
  ck_assert_int_eq(j->job->restarts, 0);
  ck_assert_int_eq(j->restarts_by[DT_RESTART_STOPPED], 2);
  ck_assert_ptr_nonnull(strstr(j->job->reason, "missed heartbeats for"));
  ck_assert_ptr_nonnull(strstr(j->job->reason, "while being drained"));
  fx_free(f);
}
END_TEST

/* A stopped job resumed: not while a trainer of its last generation still saves its step, then
 * a new generation from its newest committed step; a job that failed after max_restarts gets
 * them all again; a running or completed job is not resumed. */
START_TEST(test_stopped_or_failed_job_resumes_from_its_checkpoint)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2("elastic.max_restarts=1", &j);
  all_running(f, j, 3);
  ck_assert_int_eq(dt_coord_resume(&f->c, j), DT_EINVAL);
  commit(f, j, 10);
  dt_coord_job_transition(&f->c, j, DISTRAIN__V1__JOB_STATE__JOB_STOPPED, "stopped by the user");
  dt_coord_release_nodes(&f->c, j);
  /* Rank 1 is still saving step 12 on its node: its checkpoint is not committed yet. */
  Distrain__V1__TrainerStatus ts = DISTRAIN__V1__TRAINER_STATUS__INIT, *tsp = &ts;
  ts.job_id = j->id;
  ts.generation = j->job->generation;
  ts.rank = 1;
  ts.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING;
  dt_node_t *n1 = f->c.st.nodes[j->ranks[1].node];
  n1->trainers = &tsp;
  n1->n_trainers = 1;
  ck_assert_int_eq(dt_coord_resume(&f->c, j), DT_EBUSY);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_STOPPED);
  ts.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_STOPPED; /* it has exited */
  commit(f, j, 12);
  ck_assert_int_eq(dt_coord_resume(&f->c, j), 0);
  n1->trainers = NULL;
  n1->n_trainers = 0;
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(j->job->generation, 2);
  ck_assert_int_eq(j->resume_step, 12);
  ck_assert_int_eq(nodes_of(f, j), 2);
  ck_assert_str_eq(j->job->last_restart,
                   "resumed by the user (it was STOPPED); restarting from checkpoint step 12");

  /* Failed for good (max_restarts 1), then resumed: a fresh budget of restarts. */
  for (int fail = 0; fail < 2; fail++) {
    all_running(f, j, 13);
    heartbeat(f, f->c.st.nodes[j->ranks[0].node], j, 0,
              (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED, .exit_code = 1});
  }
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_FAILED);
  ck_assert_int_eq(dt_coord_resume(&f->c, j), 0);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(j->job->restarts, 0);
  all_running(f, j, 13);
  heartbeat(f, f->c.st.nodes[j->ranks[0].node], j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED, .exit_code = 1});
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS); /* restart 1 of 1 */

  /* Completed: nothing to resume. */
  for (int r = 0; r < j->world; r++)
    heartbeat(f, f->c.st.nodes[j->ranks[r].node], j, r,
              (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_SUCCEEDED, .step = 40});
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_COMPLETED);
  ck_assert_int_eq(dt_coord_resume(&f->c, j), DT_EINVAL);
  fx_free(f);
}
END_TEST

/* Every node silent for ms more (the liveness scan runs every 100 ms of it). */
static void silent_for(fx_t *f, int ms)
{
  for (int t = 0; t < ms; t += 100) {
    dt_coord_clock_advance(100);
    dt_coord_liveness_scan(&f->c);
  }
}

/* What a signalled coordinator waits for (main.c): alive nodes whose agents are leaving (until
 * their goodbye), and drained nodes while they still run trainers; not other nodes. */
START_TEST(test_stopping_nodes_are_counted)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  all_running(f, j, 3);
  ck_assert_uint_eq(dt_coord_running_jobs(&f->c), 1);
  Distrain__V1__TrainerStatus ts = DISTRAIN__V1__TRAINER_STATUS__INIT, *tsp = &ts;
  ts.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING;
  dt_node_t *n0 = f->c.st.nodes[0], *n1 = f->c.st.nodes[1];
  n1->trainers = &tsp;
  n1->n_trainers = 1;
  ck_assert_uint_eq(dt_coord_stopping_nodes(&f->c), 0);
  n0->leaving = 1; /* with or without trainers listed: its goodbye ends it */
  ck_assert_uint_eq(dt_coord_stopping_nodes(&f->c), 1);
  ck_assert_int_eq(dt_coord_drain(&f->c, n1, ""), 0);
  ck_assert_uint_eq(dt_coord_stopping_nodes(&f->c), 2);
  ts.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_STOPPED; /* it has saved and exited */
  ck_assert_uint_eq(dt_coord_stopping_nodes(&f->c), 1);
  n1->trainers = NULL;
  n1->n_trainers = 0;
  /* A leaving node is silent while its trainers save (its agent sends no heartbeat then): it
   * is not dead after the usual 3 missed heartbeats, only after DISTRAIN_LEAVING_SILENCE_MS. */
  n1->leaving = 1;
  silent_for(f, 5000); /* 3 missed heartbeats are 600 ms here */
  ck_assert_int_eq(n0->state, DISTRAIN__V1__NODE_STATE__NODE_ALIVE);
  ck_assert_int_eq(n1->state, DISTRAIN__V1__NODE_STATE__NODE_ALIVE);
  silent_for(f, 25500);
  ck_assert_int_eq(n0->state, DISTRAIN__V1__NODE_STATE__NODE_DEAD);
  ck_assert_uint_eq(dt_coord_stopping_nodes(&f->c), 0);
  ck_assert_int_eq(j->job->restarts, 0); /* its loss is no failure */
  fx_free(f);
}
END_TEST

/* A state store written before nodes could be drained (schema version 1) is upgraded in place
 * when the coordinator starts on it, its nodes undrained and not leaving; both are kept. */
START_TEST(test_store_from_version_1_is_upgraded)
{
  fx_t *f = fx_new();
  add_node(f, "h0", 1);
  fx_stop(f);
  char path[400];
  snprintf(path, sizeof path, "%s/coordinator.db", f->state);
  sqlite3 *db;
  ck_assert_int_eq(sqlite3_open(path, &db), SQLITE_OK);
  ck_assert_int_eq(sqlite3_exec(db,
                                "ALTER TABLE nodes DROP COLUMN drained;"
                                "ALTER TABLE nodes DROP COLUMN leaving;"
                                "UPDATE meta SET value=1 WHERE key='schema'",
                                NULL, NULL, NULL),
                   SQLITE_OK);
  sqlite3_close(db);
  fx_start(f);
  ck_assert_uint_eq(f->c.st.n_nodes, 1);
  ck_assert_ptr_null(f->c.st.nodes[0]->drained);
  ck_assert_int_eq(f->c.st.nodes[0]->leaving, 0);
  ck_assert_int_eq(dt_coord_drain(&f->c, f->c.st.nodes[0], "upgraded"), 0);
  f->c.st.nodes[0]->leaving = 1;
  ck_assert_int_eq(dt_coord_store_put_node(f->c.store, f->c.st.nodes[0]), 0);
  fx_restart(f);
  ck_assert_str_eq(f->c.st.nodes[0]->drained, "upgraded");
  ck_assert_int_eq(f->c.st.nodes[0]->leaving, 1);
  fx_free(f);
}
END_TEST

START_TEST(test_stale_generation_status_is_ignored)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  all_running(f, j, 1);
  heartbeat(f, f->c.st.nodes[j->ranks[0].node], j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED, .exit_code = 1});
  ck_assert_int_eq(j->job->generation, 2);
  /* The old generation's rank 1 is stopped by its agent: not a second failure. */
  heartbeat(f, f->c.st.nodes[j->ranks[1].node], j, 1,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED,
                       .exit_code = 1,
                       .generation = 1});
  ck_assert_int_eq(j->job->restarts, 1);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  fx_free(f);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Checkpoint commit                                                                           */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_checkpoint_commits_when_every_shard_is_in)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  int committed = -1;
  ck_assert_int_eq(report_ckpt(f, j, 1, 50, 0, 2, &committed), 0);
  ck_assert_int_eq(committed, 0);
  ck_assert_int_eq(report_ckpt(f, j, 1, 50, 0, 2, &committed), 0); /* a retry: counted once */
  ck_assert_int_eq(committed, 0);
  ck_assert_int_eq(j->job->committed_step, 0);
  int64_t latest;
  ck_assert_int_eq(dt_ckpt_latest(f->ckpt, &latest), DT_ENOENT);
  /* Another world for the same step, a rank out of range: refused. */
  ck_assert_int_eq(report_ckpt(f, j, 1, 50, 1, 3, &committed), DT_EINVAL);
  ck_assert_int_eq(report_ckpt(f, j, 1, 50, 2, 2, &committed), DT_EINVAL);
  ck_assert_int_eq(report_ckpt(f, j, 1, 50, 1, 2, &committed), 0);
  ck_assert_int_eq(committed, 1);
  ck_assert_int_eq(j->job->committed_step, 50);
  ck_assert_int_eq(j->n_ckpts, 0);
  ck_assert_int_eq(dt_ckpt_latest(f->ckpt, &latest), 0);
  ck_assert_int_eq(latest, 50);
  char sdir[512];
  dt_ckpt_step_dir(sdir, sizeof sdir, f->ckpt, 50);
  dt_ckpt_manifest_t mf;
  ck_assert_int_eq(dt_ckpt_manifest_read(sdir, &mf), 0);
  ck_assert_int_eq(mf.world, 2);
  ck_assert_int_eq(mf.num_params, 100);
  ck_assert_str_eq(mf.shards[1].name, "shard-1.bin");
  ck_assert_int_eq(mf.shards[1].lo, 50);
  ck_assert_uint_eq(mf.shards[1].crc32c, 0x1235u);
  free(mf.shards);
  /* A report of a committed step (repeated after a coordinator restart): accepted, no-op. */
  ck_assert_int_eq(report_ckpt(f, j, 1, 50, 1, 2, &committed), 0);
  ck_assert_int_eq(committed, 0);
  ck_assert_int_eq(j->n_ckpts, 0);
  fx_free(f);
}
END_TEST

START_TEST(test_new_generation_starts_a_half_reported_step_over)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  int committed;
  ck_assert_int_eq(report_ckpt(f, j, 1, 30, 0, 2, &committed), 0);
  /* Generation 2 writes step 30 again: generation 1's rank 0 must not count toward it. */
  ck_assert_int_eq(report_ckpt(f, j, 2, 30, 1, 2, &committed), 0);
  ck_assert_int_eq(committed, 0);
  ck_assert_int_eq(j->n_ckpts, 1);
  ck_assert_int_eq(j->ckpts[0].received, 1);
  ck_assert_int_eq(j->ckpts[0].generation, 2);
  ck_assert_int_eq(report_ckpt(f, j, 2, 30, 0, 2, &committed), 0);
  ck_assert_int_eq(committed, 1);
  fx_free(f);
}
END_TEST

START_TEST(test_restart_keeps_jobs_plans_and_pending_reports)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  all_running(f, j, 5);
  commit(f, j, 10);
  int committed;
  ck_assert_int_eq(report_ckpt(f, j, 1, 20, 1, 2, &committed), 0);
  const int node0 = j->ranks[0].node, node1 = j->ranks[1].node;
  char id[32];
  snprintf(id, sizeof id, "%s", j->id);
  fx_restart(f);
  ck_assert_int_eq(f->c.st.n_nodes, 2);
  ck_assert_int_eq(f->c.st.n_jobs, 1);
  j = dt_coord_job_by_id(&f->c.st, id);
  ck_assert_ptr_nonnull(j);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RUNNING);
  ck_assert_int_eq(j->job->generation, 1);
  ck_assert_int_eq(j->job->committed_step, 10);
  ck_assert_int_eq(j->world, 2);
  ck_assert_int_eq(j->ranks[0].node, node0);
  ck_assert_int_eq(j->ranks[1].node, node1);
  ck_assert_int_eq(f->c.st.nodes[node0]->job, 0);
  /* Rank 1's report of step 20 came before the restart: rank 0's completes the step. */
  ck_assert_int_eq(j->n_ckpts, 1);
  ck_assert_int_eq(report_ckpt(f, j, 1, 20, 0, 2, &committed), 0);
  ck_assert_int_eq(committed, 1);
  ck_assert_int_eq(j->job->committed_step, 20);
  /* The next job id continues after the restored ones. */
  dt_job_t *k = submit(f, NULL);
  ck_assert_str_eq(k->id, "job-2");
  fx_free(f);
}
END_TEST

/* A job the last coordinator stored but did not plan (it died first) is planned by the next
 * one on its own, with no node event to set it off; one it cannot plan says why. */
START_TEST(test_restart_plans_waiting_jobs)
{
  fx_t *f = fx_new();
  add_node(f, "h0", 1);
  dt_job_t *j = submit(f, NULL);
  dt_job_t *k = submit(f, "parallel.pp=2", NULL); /* world 2: more than h0 has */
  char id[2][32];
  snprintf(id[0], sizeof id[0], "%s", j->id);
  snprintf(id[1], sizeof id[1], "%s", k->id);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_PENDING);
  fx_restart(f);
  uv_run(&f->loop, UV_RUN_NOWAIT);
  j = dt_coord_job_by_id(&f->c.st, id[0]);
  k = dt_coord_job_by_id(&f->c.st, id[1]);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  ck_assert_int_eq(state(k), DISTRAIN__V1__JOB_STATE__JOB_PENDING);
  ck_assert_str_eq(k->job->reason,
                   "waiting for nodes: 0 idle, min_nodes 1 (1 more busy with other jobs)");
  fx_free(f);
}
END_TEST

/* A recovering job that cannot be planned keeps its cause and says what its next generation
 * waits for, as that changes. */
START_TEST(test_recovering_job_says_what_it_waits_for)
{
  fx_t *f = fx_new();
  add_node(f, "h0", 1);
  add_node(f, "h1", 1);
  dt_job_t *j = submit(f, "parallel.pp=2", NULL);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS);
  all_running(f, j, 3);
  dt_node_t *lost = f->c.st.nodes[1];
  lost->state = DISTRAIN__V1__NODE_STATE__NODE_DEAD;
  dt_coord_node_dead(&f->c, lost);
  dt_coord_schedule(&f->c);
  ck_assert_int_eq(state(j), DISTRAIN__V1__JOB_STATE__JOB_RECOVERING);
  const char *tail = " ms; restart 1 of 3 from the beginning (no checkpoint yet); next "
                     "generation: world 2 (pp 2 x dp 1 x cp 1 x tp 1) needs 2 devices, 1 node "
                     "offers 1";
  ck_assert_msg(strncmp(j->job->reason, "node node-1 (h1) missed heartbeats for ", 39) == 0 &&
                    strstr(j->job->reason, tail) &&
                    strlen(strstr(j->job->reason, tail)) == strlen(tail),
                "%s", j->job->reason);
  char before[768];
  snprintf(before, sizeof before, "%s", j->job->reason);
  dt_coord_schedule(&f->c); /* the same wait: the same reason, not a second suffix */
  ck_assert_str_eq(j->job->reason, before);
  fx_free(f);
}
END_TEST

/* A state DB that a coordinator from before the UTF-8 check wrote can hold strings that are
 * not UTF-8 (an agent's host name, a reason cut inside a character): a restart serves them
 * made UTF-8, or every ListNodes / ListJobs answer would be undecodable for other clients. */
START_TEST(test_restart_makes_stored_strings_utf8)
{
  fx_t *f = fx_new();
  add_node(f, "caf\xe9", 1);
  dt_job_t *j = submit(f, NULL);
  char id[32];
  snprintf(id, sizeof id, "%s", j->id);
  free(j->job->reason);
  j->job->reason = strdup("trainer said \xc3");
  ck_assert_int_eq(dt_coord_store_put_job(f->c.store, j), 0);
  fx_restart(f);
  ck_assert_str_eq(f->c.st.nodes[0]->info->hostname, "caf?");
  j = dt_coord_job_by_id(&f->c.st, id);
  ck_assert_str_eq(j->job->reason, "trainer said ?");
  char field[128];
  ck_assert_int_eq(dt_pb_check_utf8(&j->job->base, field, sizeof field), 0);
  fx_free(f);
}
END_TEST

/* A writer whose disk was full reports an error: the report that completes the step learns it
 * was abandoned (-1, which ReportCheckpointResponse.abandoned carries), the job says why and
 * the step's directory is gone; the same step written again (a run's last save, once its disk
 * has room) commits and clears the error. */
START_TEST(test_abandoned_step_is_told_and_written_again)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  char name[32], sdir[512];
  Distrain__V1__ReportCheckpointRequest q = shard_report(f, j, 1, 40, 1, 2, name);
  q.error = "rank 1 on h1 could not write its shard: no space left on device in /ckpt";
  char err[256];
  int committed = 5;
  ck_assert_int_eq(dt_coord_checkpoint_report(&f->c, j, 0, &q, &committed, err, sizeof err), 0);
  ck_assert_int_eq(committed, 0); /* rank 0's report is still to come */
  ck_assert_int_eq(report_ckpt(f, j, 1, 40, 0, 2, &committed), 0);
  ck_assert_int_eq(committed, -1);
  ck_assert_str_eq(j->job->checkpoint_error, "step 40 not saved: rank 1 on h1 could not write "
                                             "its shard: no space left on device in /ckpt");
  ck_assert_int_eq(j->job->committed_step, 0);
  ck_assert_int_eq(j->n_ckpts, 0);
  dt_ckpt_step_dir(sdir, sizeof sdir, f->ckpt, 40);
  ck_assert_int_ne(access(sdir, F_OK), 0);
  commit(f, j, 40);
  ck_assert_str_eq(j->job->checkpoint_error, "");
}
END_TEST

/* A manifest that cannot be written (the step's directory gone, a full disk) leaves the step
 * uncommitted, and never stops the coordinator from starting on its state: its reports leave
 * the store when the live commit fails; reports restored from the store (the coordinator died
 * between storing the last one and writing the manifest) commit at the next start that can. */
START_TEST(test_unwritable_manifest_abandons_the_step)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  char id[32];
  snprintf(id, sizeof id, "%s", j->id);
  int committed = -1;
  ck_assert_int_eq(report_ckpt(f, j, 1, 20, 0, 2, &committed), 0);
  break_step_dir(f, 20, 1);
  ck_assert_int_ne(report_ckpt(f, j, 1, 20, 1, 2, &committed), 0);
  ck_assert_int_eq(committed, 0);
  ck_assert_int_eq(j->job->committed_step, 0);
  ck_assert_int_eq(j->n_ckpts, 0);
  fx_restart(f); /* fx_start asserts that it starts */
  j = dt_coord_job_by_id(&f->c.st, id);
  ck_assert_int_eq(j->job->committed_step, 0);
  ck_assert_int_eq(j->n_ckpts, 0);
  /* Its writer failed, its generation writes step 20 again: the old reports are gone for good,
   * not committed by a later start over shards being rewritten. */
  break_step_dir(f, 20, 0);
  fx_restart(f);
  j = dt_coord_job_by_id(&f->c.st, id);
  ck_assert_int_eq(j->job->committed_step, 0);

  /* Both reports stored, the manifest not written yet when the coordinator died. */
  char names[2][32];
  for (int r = 0; r < 2; r++) {
    Distrain__V1__ReportCheckpointRequest q = shard_report(f, j, 1, 30, r, 2, names[r]);
    ck_assert_int_eq(dt_coord_store_put_ckpt_report(f->c.store, j->id, &q), 0);
  }
  break_step_dir(f, 30, 1);
  fx_restart(f);
  j = dt_coord_job_by_id(&f->c.st, id);
  ck_assert_int_eq(j->job->committed_step, 0);
  break_step_dir(f, 30, 0);
  fx_restart(f);
  j = dt_coord_job_by_id(&f->c.st, id);
  ck_assert_int_eq(j->job->committed_step, 30);
  int64_t latest;
  ck_assert_int_eq(dt_ckpt_latest(f->ckpt, &latest), 0);
  ck_assert_int_eq(latest, 30);
  fx_free(f);
}
END_TEST

/* What a writer can make the coordinator hold is bounded: a report names at most the job's
 * ranks as writers, a generation has at most 8 steps waiting for shards, and a new
 * generation's first report drops the steps its predecessors left unfinished (in memory and in
 * the store: a restart does not bring them back). */
START_TEST(test_checkpoint_reports_are_bounded)
{
  dt_job_t *j;
  fx_t *f = two_nodes_dp2(NULL, &j);
  char id[32];
  snprintf(id, sizeof id, "%s", j->id);
  int committed;
  char name[32], err[256] = "";
  Distrain__V1__ReportCheckpointRequest q = shard_report(f, j, 1, 10, 0, 1 << 20, name);
  ck_assert_int_eq(dt_coord_checkpoint_report(&f->c, j, 0, &q, &committed, err, sizeof err),
                   DT_EINVAL);
  ck_assert_str_eq(err, "step 10: a report of 1048576 writers, but the job has 2 ranks");
  ck_assert_int_eq(j->n_ckpts, 0);
  for (int64_t step = 10; step <= 80; step += 10)
    ck_assert_int_eq(report_ckpt(f, j, 1, step, 0, 2, &committed), 0);
  q = shard_report(f, j, 1, 90, 0, 2, name);
  ck_assert_int_eq(dt_coord_checkpoint_report(&f->c, j, 0, &q, &committed, err, sizeof err),
                   DT_EINVAL);
  ck_assert_str_eq(err, "step 90: 8 earlier steps still wait for shards (at most 8)");
  ck_assert_int_eq(j->n_ckpts, 8);
  /* Rank 1 completes one of them: room again. */
  ck_assert_int_eq(report_ckpt(f, j, 1, 50, 1, 2, &committed), 0);
  ck_assert_int_eq(committed, 1);
  ck_assert_int_eq(report_ckpt(f, j, 1, 90, 0, 2, &committed), 0);
  ck_assert_int_eq(j->n_ckpts, 8);
  /* Generation 2's first report: generation 1's unfinished steps go. */
  ck_assert_int_eq(report_ckpt(f, j, 2, 100, 0, 2, &committed), 0);
  ck_assert_int_eq(committed, 0);
  ck_assert_int_eq(j->n_ckpts, 1);
  fx_restart(f);
  j = dt_coord_job_by_id(&f->c.st, id);
  ck_assert_int_eq(j->job->committed_step, 50);
  ck_assert_int_eq(j->n_ckpts, 1);
  ck_assert_int_eq(j->ckpts[0].step, 100);
  fx_free(f);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Step metrics                                                                                */
/* ------------------------------------------------------------------------------------------ */

static void check_metrics(const dt_job_t *j, int64_t last, const double *loss_offset_by_step)
{
  ck_assert_int_eq(j->n_metrics, last);
  for (int64_t s = 1; s <= last; s++) {
    ck_assert_int_eq(j->metrics[s - 1]->step, s);
    ck_assert_double_eq(j->metrics[s - 1]->loss, (double)s + loss_offset_by_step[s]);
  }
}

START_TEST(test_metrics_across_generations)
{
  fx_t *f = fx_new();
  dt_node_t *n = add_node(f, "h0", 1);
  dt_job_t *j = submit(f, NULL);
  dt_coord_schedule(&f->c);
  const int64_t s12[] = {1, 2}, s3to6[] = {3, 4, 5, 6}, s56[] = {5, 6, 7};
  const Distrain__V1__TrainerState running = DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING;
  heartbeat(f, n, j, 0,
            (status_t){.state = running, .step = 2, .metric_steps = s12, .n_metrics = 2});
  commit(f, j, 4);
  /* Generation 1 fails; generation 2 resumes after step 4 and reports 5..7 (loss + 0.5). */
  heartbeat(f, n, j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED, .exit_code = 1});
  ck_assert_int_eq(j->job->generation, 2);
  ck_assert_int_eq(j->resume_step, 4);
  heartbeat(
      f, n, j, 0,
      (status_t){
          .state = running, .step = 7, .metric_steps = s56, .n_metrics = 3, .loss_offset = 0.5});
  /* Generation 1's last steps (3..6), read by its agent after it exited: 3 and 4 fill the gap,
   * 5 and 6 are generation 2's to report. */
  heartbeat(f, n, j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED,
                       .generation = 1,
                       .metric_steps = s3to6,
                       .n_metrics = 4});
  const double offset[] = {0, 0, 0, 0, 0, 0.5, 0.5, 0.5};
  check_metrics(j, 7, offset);
  /* Sent again (a heartbeat retried): nothing changes. */
  heartbeat(f, n, j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED,
                       .generation = 1,
                       .metric_steps = s3to6,
                       .n_metrics = 4});
  check_metrics(j, 7, offset);
  /* A restart reads back the same series. */
  fx_restart(f);
  j = f->c.st.jobs[0];
  check_metrics(j, 7, offset);
  fx_free(f);
}
END_TEST

/* A generation that replays steps replaces them in the store too: a restart must not bring back
 * the steps of the generation before, which the replay has not reached yet. */
START_TEST(test_replaced_steps_stay_replaced_across_a_restart)
{
  fx_t *f = fx_new();
  dt_node_t *n = add_node(f, "h0", 1);
  dt_job_t *j = submit(f, NULL);
  dt_coord_schedule(&f->c);
  const int64_t s1to6[] = {1, 2, 3, 4, 5, 6}, s12[] = {1, 2};
  const Distrain__V1__TrainerState running = DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING;
  heartbeat(f, n, j, 0,
            (status_t){.state = running, .step = 6, .metric_steps = s1to6, .n_metrics = 6});
  /* No checkpoint: generation 2 starts over, and reports steps 1 and 2 (loss + 0.5). */
  heartbeat(f, n, j, 0,
            (status_t){.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED, .exit_code = 1});
  ck_assert_int_eq(j->job->generation, 2);
  heartbeat(
      f, n, j, 0,
      (status_t){
          .state = running, .step = 2, .metric_steps = s12, .n_metrics = 2, .loss_offset = 0.5});
  const double offset[] = {0, 0.5, 0.5};
  check_metrics(j, 2, offset);
  fx_restart(f);
  check_metrics(f->c.st.jobs[0], 2, offset);
  fx_free(f);
}
END_TEST

static Suite *coord_suite(void)
{
  Suite *s = suite_create("coord");
  TCase *t = tcase_create("jobs");
  tcase_set_timeout(t, 30);
  tcase_add_test(t, test_plan_places_ranks_on_idle_nodes);
  tcase_add_test(t, test_plan_waits_for_min_nodes_then_takes_the_largest_dp);
  tcase_add_test(t, test_plan_matches_the_device_kind);
  tcase_add_test(t, test_plan_names_max_nodes_when_it_limits);
  tcase_add_test(t, test_lost_node_shrinks_then_grows_back_at_a_commit);
  tcase_add_test(t, test_failed_trainer_restarts_in_place_until_max_restarts);
  tcase_add_test(t, test_input_error_fails_without_a_restart);
  tcase_add_test(t, test_stopped_trainer_restarts_uncounted);
  tcase_add_test(t, test_leaving_node_gets_no_work_and_its_loss_is_uncounted);
  tcase_add_test(t, test_stale_generation_status_is_ignored);
  tcase_add_test(t, test_drained_node_stops_its_job_and_gets_no_work);
  tcase_add_test(t, test_drained_node_job_waits_for_undrain);
  tcase_add_test(t, test_priority_preempts_lower_jobs);
  tcase_add_test(t, test_preemption_outlives_a_coordinator_restart);
  tcase_add_test(t, test_drain_during_rendezvous_restarts_at_once);
  tcase_add_test(t, test_store_from_version_1_is_upgraded);
  tcase_add_test(t, test_stopped_or_failed_job_resumes_from_its_checkpoint);
  tcase_add_test(t, test_stopping_nodes_are_counted);
  tcase_add_test(t, test_checkpoint_commits_when_every_shard_is_in);
  tcase_add_test(t, test_new_generation_starts_a_half_reported_step_over);
  tcase_add_test(t, test_restart_keeps_jobs_plans_and_pending_reports);
  tcase_add_test(t, test_restart_makes_stored_strings_utf8);
  tcase_add_test(t, test_restart_plans_waiting_jobs);
  tcase_add_test(t, test_recovering_job_says_what_it_waits_for);
  tcase_add_test(t, test_abandoned_step_is_told_and_written_again);
  tcase_add_test(t, test_unwritable_manifest_abandons_the_step);
  tcase_add_test(t, test_checkpoint_reports_are_bounded);
  tcase_add_test(t, test_metrics_across_generations);
  tcase_add_test(t, test_replaced_steps_stay_replaced_across_a_restart);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(coord_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
