/* handlers.c — one function per RPC of distrain.v1.Coordinator, all on the loop thread.
 * Handlers validate their input, change state through jobs.c, and answer; the three that
 * wait (WatchAssignment, KvGet, GetLogs) keep their call and answer later. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord.h"
#include "ctl.h"
#include "hang.h"
#include "dt_log.h"
#include "dt_util.h"
#include "jobspec.h"

#define WATCH_DEFAULT_MS 30000u
#define WATCH_MAX_MS     300000u
#define KV_MAX_WAIT_MS   600000u

static dt_node_t *node_or_fail(dt_coord_t *c, dt_rpc_call_t *call, const char *id)
{
  dt_node_t *n = dt_coord_node_by_id(&c->st, id);
  if (!n)
    dt_rpc_call_fail(call, DT_RPC_NOT_FOUND, "unknown node '%s'", id);
  return n;
}

static dt_job_t *job_or_fail(dt_coord_t *c, dt_rpc_call_t *call, const char *id)
{
  dt_job_t *j = dt_coord_job_by_id(&c->st, id);
  if (!j)
    dt_rpc_call_fail(call, DT_RPC_NOT_FOUND, "unknown job '%s'", id);
  return j;
}

/* ------------------------------------------------------------------------------------------ */
/* Nodes                                                                                       */
/* ------------------------------------------------------------------------------------------ */

static void fail_store(dt_rpc_call_t *call, const char *what)
{
  dt_rpc_call_fail(call, DT_RPC_UNAVAILABLE,
                   "%s: the coordinator cannot write its state store (its log says why); "
                   "try again",
                   what);
}

/* A call that changed the coordinator's state replies OK only once the change is in the store
 * (after a failed write the whole state is rewritten first: dt_coord_resync); otherwise it
 * fails UNAVAILABLE, and the client tries again. Returns whether it failed the call. */
static int failed_unless_saved(dt_coord_t *c, dt_rpc_call_t *call, const char *what)
{
  if (dt_coord_resync(c, 1) == 0)
    return 0;
  fail_store(call, what);
  return 1;
}

static void handle_register(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__RegisterWorkerRequest *req = (const void *)m;
  if (!req->node || !req->node->hostname[0] || req->node->n_devices == 0) {
    dt_rpc_call_fail(call, DT_RPC_INVALID_ARGUMENT, "a node needs a hostname and devices");
    return;
  }
  Distrain__V1__NodeInfo *info = dt_pb_copy(&req->node->base);
  if (!info) {
    dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  dt_node_t *n = req->node_id[0] ? dt_coord_node_by_id(&c->st, req->node_id) : NULL;
  if (n && strcmp(n->info->hostname, info->hostname) != 0) {
    /* Not that node's agent (its work directory was copied, or another coordinator gave it the
     * id): a node of its own, not a takeover of another host's. */
    DT_WARN(COORD,
            "an agent on %s asked for node id %s, which is %s's: registering it as a new "
            "node",
            info->hostname, n->id, n->info->hostname);
    n = NULL;
  }
  if (n) {
    /* The agent restarted: its trainers died with it, and so did the log reads it had. */
    dt_coord_logs_node_gone(c, n, 1, "its agent restarted");
    distrain__v1__node_info__free_unpacked(n->info, NULL);
    n->info = info;
    dt_node_clear_usage(n);
    if (n->job >= 0 && (size_t)n->job < c->st.n_jobs) {
      DT_WARN(COORD, "node %s (%s) re-registered while running job %s: its trainers are gone",
              n->id, info->hostname, c->st.jobs[n->job]->id);
      n->last_seen_ms = 0; /* fail it over now, then take it back as a fresh node */
      dt_coord_node_dead(c, n);
    }
  } else {
    if ((n = calloc(1, sizeof *n)) != NULL) {
      n->index = (int)c->st.n_nodes;
      snprintf(n->id, sizeof n->id, "node-%d", n->index);
      n->info = info;
      n->job = -1;
    }
    if (!n || dt_coord_add_node(&c->st, n) != 0) {
      free(n);
      distrain__v1__node_info__free_unpacked(info, NULL);
      dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
      return;
    }
  }
  n->state = DISTRAIN__V1__NODE_STATE__NODE_ALIVE;
  n->leaving = 0;
  n->last_seen_ms = dt_coord_now_ms();
  n->last_seen_wall_ms = dt_wall_ms();
  dt_coord_store_put_node(c->store, n);
  if (failed_unless_saved(c, call, "registration")) /* kept in memory; the store catches up */
    return;
  DT_INFO(COORD, "node %s registered: %s, %zu %s device(s)", n->id, info->hostname, info->n_devices,
          info->devices[0]->kind);
  dt_coord_event(c, NULL, 0, "node %s registered: %s, %zu %s device(s)", n->id, info->hostname,
                 info->n_devices, info->devices[0]->kind);
  Distrain__V1__RegisterWorkerResponse resp = DISTRAIN__V1__REGISTER_WORKER_RESPONSE__INIT;
  resp.node_id = n->id;
  resp.heartbeat_ms = (uint32_t)c->cfg.heartbeat_ms;
  dt_rpc_call_reply(call, &resp.base);
  dt_coord_schedule_soon(c);
}

/* The reason of a drain for GPU health (which check_gpu_health alone lifts) starts so. */
#define GPU_HEALTH_DRAIN "GPU health: "

/* A node whose GPUs report a problem (lost, uncorrected ECC errors, memory repairs pending or
 * failed: dt_ctl_gpu_problems) takes no work: it is drained with the problem as its reason, its
 * job moving off it as from any drain, the way Slurm's node health checks drain a node. Once
 * its GPUs' samples show none (reset, or left out by its agent's --gpus) that drain is lifted;
 * an operator's drain stays as it is. */
static void check_gpu_health(dt_coord_t *c, dt_node_t *n)
{
  char problems[400], reason[512];
  const int ours =
      n->drained && strncmp(n->drained, GPU_HEALTH_DRAIN, strlen(GPU_HEALTH_DRAIN)) == 0;
  if (dt_ctl_gpu_problems(n->usage, n->n_usage, problems, sizeof problems)) {
    snprintf(reason, sizeof reason,
             GPU_HEALTH_DRAIN "%s; reset it or leave it out (distrain-worker --gpus), and the "
                              "node takes work again",
             problems);
    if ((!n->drained || ours) && strcmp(n->drained ? n->drained : "", reason) != 0)
      dt_coord_drain(c, n, reason);               /* or the newest words of the drain it is in */
  } else if (ours && n->n_usage && !n->leaving) { /* a stopping agent samples no GPU */
    DT_INFO(COORD, "node %s (%s): its GPUs report no problem now: lifting its drain for GPU health",
            n->id, n->info->hostname);
    dt_coord_drain(c, n, NULL);
  }
}

static void handle_heartbeat(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__HeartbeatRequest *req = (const void *)m;
  Distrain__V1__HeartbeatResponse resp = DISTRAIN__V1__HEARTBEAT_RESPONSE__INIT;
  dt_node_t *n = dt_coord_node_by_id(&c->st, req->node_id);
  if (!n) {
    resp.reregister = 1;
    dt_rpc_call_reply(call, &resp.base);
    return;
  }
  n->last_seen_ms = dt_coord_now_ms();
  n->last_seen_wall_ms = dt_wall_ms();
  int revived = n->state != DISTRAIN__V1__NODE_STATE__NODE_ALIVE;
  if (revived) {
    DT_INFO(COORD, "node %s (%s) is back", n->id, n->info->hostname);
    dt_coord_event(c, NULL, 0, "node %s (%s) is back", n->id, n->info->hostname);
    n->state = DISTRAIN__V1__NODE_STATE__NODE_ALIVE;
    dt_coord_store_put_node(c->store, n);
  }
  if (req->leaving && !n->leaving) {
    n->leaving = 1;
    dt_coord_store_put_node(c->store, n); /* a restarted coordinator plans nothing there */
    DT_INFO(COORD, "node %s (%s) is leaving: its agent is stopping; no new work goes there", n->id,
            n->info->hostname);
    dt_coord_event(c, NULL, 0, "node %s (%s) is leaving (its agent is stopping)", n->id,
                   n->info->hostname);
  }
  for (size_t i = 0; i < n->n_trainers; i++)
    distrain__v1__trainer_status__free_unpacked(n->trainers[i], NULL);
  free(n->trainers);
  n->trainers = calloc(req->n_trainers ? req->n_trainers : 1, sizeof *n->trainers);
  n->n_trainers = 0;
  for (size_t i = 0; n->trainers && i < req->n_trainers; i++) {
    Distrain__V1__TrainerStatus *ts = dt_pb_copy(&req->trainers[i]->base);
    if (ts)
      n->trainers[n->n_trainers++] = ts;
  }
  /* The GPUs' usage: kept for ListNodes, replaced by every heartbeat. Their health first: a
   * trainer that failed with its GPU (an uncorrectable ECC error) is reported in the heartbeat
   * whose sample shows it, and its job must not be placed there again. */
  dt_node_clear_usage(n);
  if (req->n_devices)
    n->usage = calloc(req->n_devices, sizeof *n->usage);
  for (size_t i = 0; n->usage && i < req->n_devices; i++) {
    Distrain__V1__DeviceUsage *u = dt_pb_copy(&req->devices[i]->base);
    if (u && !u->link_rates) /* an older agent's: unknown, not 0 */
      u->pcie_replays_per_min = u->nvlink_replays_per_min = u->nvlink_crc_per_min = -1;
    if (u)
      n->usage[n->n_usage++] = u;
  }
  check_gpu_health(c, n);
  dt_coord_trainer_status(c, n);
  if (req->leaving && req->gone && n->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE)
    dt_coord_node_dead(c, n); /* its agent has exited: no need to wait for its silence */
  if (revived)
    dt_coord_schedule_soon(c);
  /* Step metrics are acknowledged only once stored: while the store fails the heartbeat fails,
   * the agent keeps them for its next one (steps sent again replace ours), and a coordinator
   * killed meanwhile loses none. The rewrite is tried at most every 2 s (not per heartbeat). */
  size_t nmetrics = 0;
  for (size_t i = 0; i < req->n_trainers; i++)
    nmetrics += req->trainers[i]->n_metrics;
  if (nmetrics && dt_coord_resync(c, 0) != 0) {
    fail_store(call, "step metrics");
    return;
  }
  resp.assignment_version = n->assign_version;
  dt_rpc_call_reply(call, &resp.base);
}

static void on_watch_cancel(dt_rpc_call_t *call, void *ud)
{
  dt_node_t *n = ud;
  if (n->watch == call)
    n->watch = NULL;
}

static void handle_watch(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__WatchAssignmentRequest *req = (const void *)m;
  dt_node_t *n = node_or_fail(c, call, req->node_id);
  if (!n)
    return;
  if (n->watch) { /* superseded: the agent only ever has one watch outstanding, and no log
                   * request may go to the call it no longer waits on */
    dt_rpc_call_t *old = n->watch;
    n->watch = NULL;
    dt_rpc_call_on_cancel(old, NULL, NULL);
    dt_rpc_call_fail(old, DT_RPC_CANCELLED, "superseded by a newer WatchAssignment");
  }
  if (req->known_version != n->assign_version || dt_coord_logs_unsent(c, n)) {
    Distrain__V1__WatchAssignmentResponse *r = dt_coord_assignments_for(c, n);
    if (!r) {
      dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
      return;
    }
    dt_rpc_call_reply(call, &r->base);
    dt_coord_free_assignments(r);
    return;
  }
  uint64_t wait = req->timeout_ms ? req->timeout_ms : WATCH_DEFAULT_MS;
  wait = DT_MIN(wait, WATCH_MAX_MS);
  n->watch = call;
  n->watch_deadline_ms = dt_coord_now_ms() + (double)wait;
  dt_rpc_call_on_cancel(call, on_watch_cancel, n); /* the liveness scan answers it at its
                                                    * deadline (dt_coord_notify_node) */
}

void dt_coord_node_view(const dt_node_t *n, Distrain__V1__Node *o)
{
  distrain__v1__node__init(o);
  o->node_id = (char *)n->id;
  o->info = n->info;
  o->state = n->state;
  o->leaving = n->leaving;
  o->drained = n->drained != NULL;
  o->drain_reason = n->drained ? n->drained : "";
  o->last_heartbeat_ms = n->last_seen_wall_ms;
  o->trainers = n->trainers;
  o->n_trainers = n->n_trainers;
  if (n->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE) { /* a dead node's usage is stale */
    o->usage = n->usage;
    o->n_usage = n->n_usage;
  }
}

static void handle_list_nodes(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  (void)m;
  Distrain__V1__ListNodesResponse resp = DISTRAIN__V1__LIST_NODES_RESPONSE__INIT;
  Distrain__V1__Node *nodes = calloc(c->st.n_nodes + 1, sizeof *nodes);
  Distrain__V1__Node **ptrs = calloc(c->st.n_nodes + 1, sizeof *ptrs);
  if (!nodes || !ptrs) {
    free(nodes);
    free(ptrs);
    dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    if (!c->st.nodes[i])
      continue;
    dt_coord_node_view(c->st.nodes[i], &nodes[resp.n_nodes]);
    ptrs[resp.n_nodes] = &nodes[resp.n_nodes];
    resp.n_nodes++;
  }
  resp.nodes = ptrs;
  dt_rpc_call_reply(call, &resp.base);
  free(nodes);
  free(ptrs);
}

/* A node by id, or by a hostname that names one node (or one alive node: an agent from before
 * agents kept their id left a dead node behind when it restarted). */
static dt_node_t *node_named(dt_coord_t *c, dt_rpc_call_t *call, const char *name)
{
  dt_node_t *n = dt_coord_node_by_id(&c->st, name), *found = NULL, *alive = NULL;
  if (n)
    return n;
  char ids[256] = "";
  int count = 0, n_alive = 0;
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    dt_node_t *nd = c->st.nodes[i];
    if (!nd || strcmp(nd->info->hostname, name) != 0)
      continue;
    found = nd;
    if (nd->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE)
      alive = nd, n_alive++;
    const size_t len = strlen(ids);
    if (count++ < 8)
      snprintf(ids + len, sizeof ids - len, "%s%s", count > 1 ? ", " : "", nd->id);
  }
  if (count == 1 || n_alive == 1)
    return count == 1 ? found : alive;
  if (count == 0)
    dt_rpc_call_fail(call, DT_RPC_NOT_FOUND,
                     "no node '%s': neither a node id nor a registered node's hostname", name);
  else
    dt_rpc_call_fail(call, DT_RPC_INVALID_ARGUMENT,
                     "hostname '%s' names %d nodes (%s%s): give a node id", name, count, ids,
                     count > 8 ? ", ..." : "");
  return NULL;
}

#define DRAIN_REASON_MAX 200

static void handle_drain_node(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__DrainNodeRequest *req = (const void *)m;
  const size_t len = strlen(req->reason);
  if (len > DRAIN_REASON_MAX) {
    dt_rpc_call_fail(call, DT_RPC_INVALID_ARGUMENT, "the reason has %zu bytes (at most %d)", len,
                     DRAIN_REASON_MAX);
    return;
  }
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)req->reason[i] < 0x20 || req->reason[i] == 0x7f) {
      dt_rpc_call_fail(call, DT_RPC_INVALID_ARGUMENT,
                       "the reason must be one line of text (byte %zu is a control character)", i);
      return;
    }
  if (req->undo && len) {
    dt_rpc_call_fail(call, DT_RPC_INVALID_ARGUMENT, "undrain takes no reason");
    return;
  }
  dt_node_t *n = node_named(c, call, req->node);
  if (!n)
    return;
  char problems[400];
  if (req->undo && n->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE &&
      dt_ctl_gpu_problems(n->usage, n->n_usage, problems, sizeof problems)) {
    dt_rpc_call_fail(call, DT_RPC_FAILED_PRECONDITION,
                     "%s stays drained: %s (reset the GPU, or restart its agent with --gpus "
                     "leaving it out; the drain lifts itself once its GPUs report no problem)",
                     n->id, problems);
    return;
  }
  if (dt_coord_drain(c, n, req->undo ? NULL : req->reason) != 0) {
    dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  if (failed_unless_saved(c, call,
                          req->undo ? "the node is undrained, but not yet saved"
                                    : "the node is drained, but not yet saved"))
    return;
  Distrain__V1__Node view;
  dt_coord_node_view(n, &view);
  dt_rpc_call_reply(call, &view.base);
}

/* ------------------------------------------------------------------------------------------ */
/* Jobs                                                                                        */
/* ------------------------------------------------------------------------------------------ */

static void handle_submit(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__SubmitJobRequest *req = (const void *)m;
  char err[1024];
  if (!req->spec || !req->spec->model || !req->spec->data || !req->spec->training ||
      !req->spec->optimizer || !req->spec->parallel || !req->spec->checkpoint ||
      !req->spec->elastic) {
    dt_rpc_call_fail(call, DT_RPC_INVALID_ARGUMENT, "spec: every section must be present");
    return;
  }
  if (dt_jobspec_validate(req->spec, err, sizeof err) != 0) {
    dt_rpc_call_fail(call, DT_RPC_INVALID_ARGUMENT, "%s", err);
    return;
  }
  dt_job_t *j;
  int rc = dt_coord_submit_job(c, req->spec, &j);
  if (rc == DT_EIO) {
    fail_store(call, "the job was not submitted");
    return;
  }
  if (rc != 0) {
    dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  DT_INFO(COORD, "job %s submitted%s%s", j->id, req->spec->name[0] ? ": " : "", req->spec->name);
  Distrain__V1__SubmitJobResponse resp = DISTRAIN__V1__SUBMIT_JOB_RESPONSE__INIT;
  resp.job_id = j->id;
  dt_rpc_call_reply(call, &resp.base);
  dt_coord_schedule(c);
}

int dt_coord_rank_views(dt_coord_t *c, const dt_job_t *j, dt_rank_views_t *v)
{
  const int live = !dt_coord_state_terminal(j->job->state) && j->ranks;
  const size_t n = live ? (size_t)j->world : 0;
  memset(v, 0, sizeof *v);
  v->rs = calloc(n ? n : 1, sizeof *v->rs);
  v->ptrs = calloc(n ? n : 1, sizeof *v->ptrs);
  v->waiting = calloc(n ? n : 1, sizeof *v->waiting);
  if (!v->rs || !v->ptrs || !v->waiting) {
    dt_coord_rank_views_free(v);
    return DT_ENOMEM;
  }
  for (size_t r = 0; r < n; r++) {
    const dt_rank_slot_t *s = &j->ranks[r];
    const dt_node_t *nd = c->st.nodes[s->node];
    const double age = dt_coord_report_age_ms(j, (int)r);
    Distrain__V1__RankStatus *o = &v->rs[r];
    distrain__v1__rank_status__init(o);
    o->rank = (int32_t)r;
    o->node_id = (char *)nd->id;
    o->hostname = nd->info->hostname;
    o->state = s->state;
    o->step = s->step;
    dt_hang_describe(s->progress, age, v->waiting[r], sizeof v->waiting[r]);
    o->waiting = v->waiting[r];
    o->report_age_ms = (uint32_t)DT_MIN(age, 4e9);
    o->compute_ms = s->compute_ms;
    o->straggler = s->straggler;
    v->ptrs[r] = o;
  }
  v->n = n;
  return 0;
}

void dt_coord_rank_views_free(dt_rank_views_t *v)
{
  free(v->rs), free(v->ptrs), free(v->waiting);
  memset(v, 0, sizeof *v);
}

/* What a step's metrics may hold beside its own figures. */
typedef enum { HOLDS_VAL, HOLDS_SOURCES, HOLDS_EVAL } holds_t;

/* The job's newest metrics that hold it, or NULL. */
static Distrain__V1__StepMetrics *newest(const dt_job_t *j, holds_t what)
{
  for (size_t i = j->n_metrics; i-- > 0;) {
    const Distrain__V1__StepMetrics *m = j->metrics[i];
    if (what == HOLDS_VAL       ? m->has_val || m->n_val_sets
        : what == HOLDS_SOURCES ? m->n_train_sources > 0
                                : m->has_eval)
      return j->metrics[i];
  }
  return NULL;
}

Distrain__V1__StepMetrics *dt_coord_last_val(const dt_job_t *j)
{
  return newest(j, HOLDS_VAL);
}

void dt_coord_lend_newest(dt_job_t *j, int lend)
{
  j->job->last_val = lend ? newest(j, HOLDS_VAL) : NULL;
  j->job->last_sources = lend ? newest(j, HOLDS_SOURCES) : NULL;
  j->job->last_eval = lend ? newest(j, HOLDS_EVAL) : NULL;
}

/* GetJob adds the current generation's ranks: where each runs, its state and step, and the
 * collective it is blocked in (ListJobs leaves them out: O(world) per job), and the newest
 * validation. */
static void handle_get_job(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__GetJobRequest *req = (const void *)m;
  dt_job_t *j = job_or_fail(c, call, req->job_id);
  if (!j)
    return;
  dt_rank_views_t v;
  if (dt_coord_rank_views(c, j, &v) != 0) {
    dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  j->job->ranks = v.ptrs;
  j->job->n_ranks = v.n;
  dt_coord_lend_newest(j, 1); /* borrowed for the reply */
  dt_rpc_call_reply(call, &j->job->base);
  j->job->ranks = NULL;
  j->job->n_ranks = 0;
  dt_coord_lend_newest(j, 0);
  dt_coord_rank_views_free(&v);
}

static void handle_list_jobs(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  (void)m;
  Distrain__V1__ListJobsResponse resp = DISTRAIN__V1__LIST_JOBS_RESPONSE__INIT;
  Distrain__V1__Job **jobs = calloc(c->st.n_jobs + 1, sizeof *jobs);
  if (!jobs) {
    dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  for (size_t i = 0; i < c->st.n_jobs; i++)
    jobs[i] = c->st.jobs[i]->job;
  resp.jobs = jobs;
  resp.n_jobs = c->st.n_jobs;
  dt_rpc_call_reply(call, &resp.base);
  free(jobs);
}

static void handle_stop_job(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__StopJobRequest *req = (const void *)m;
  dt_job_t *j = job_or_fail(c, call, req->job_id);
  if (!j)
    return;
  Distrain__V1__JobState s = j->job->state;
  if (s != DISTRAIN__V1__JOB_STATE__JOB_COMPLETED && s != DISTRAIN__V1__JOB_STATE__JOB_FAILED &&
      s != DISTRAIN__V1__JOB_STATE__JOB_STOPPED) {
    const int idx = dt_coord_job_index(&c->st, j);
    if (!req->now) /* its trainers save their step first */
      for (size_t i = 0; i < c->st.n_nodes; i++)
        if (c->st.nodes[i] && c->st.nodes[i]->job == idx)
          c->st.nodes[i]->stopped_job = j->id;
    dt_coord_job_transition(c, j, DISTRAIN__V1__JOB_STATE__JOB_STOPPED,
                            req->now ? "stopped by the user (now)" : "stopped by the user");
    dt_coord_release_nodes(c, j);
    dt_coord_schedule(c);
  }
  if (failed_unless_saved(c, call, "the job is stopped, but not yet saved"))
    return;
  dt_rpc_call_reply(call, &j->job->base);
}

static void handle_resume_job(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__ResumeJobRequest *req = (const void *)m;
  dt_job_t *j = job_or_fail(c, call, req->job_id);
  if (!j)
    return;
  const int rc = dt_coord_resume(c, j);
  if (rc == DT_EINVAL) {
    dt_rpc_call_fail(call, DT_RPC_FAILED_PRECONDITION,
                     "job %s is %s: only a STOPPED or FAILED job can be resumed", j->id,
                     dt_ctl_state_name(j->job->state));
    return;
  }
  if (rc == DT_EBUSY) {
    dt_rpc_call_fail(call, DT_RPC_UNAVAILABLE,
                     "job %s's trainers are still saving the step it was stopped at; try again "
                     "once they have exited",
                     j->id);
    return;
  }
  if (failed_unless_saved(c, call, "the job is resumed, but not yet saved"))
    return;
  dt_rpc_call_reply(call, &j->job->base);
}

static void handle_metrics(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  const Distrain__V1__GetJobMetricsRequest *req = (const void *)m;
  dt_job_t *j = job_or_fail(ud, call, req->job_id);
  if (!j)
    return;
  /* metrics are sorted by step: binary search for the first step > after_step */
  size_t lo = 0, hi = j->n_metrics;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (j->metrics[mid]->step <= req->after_step)
      lo = mid + 1;
    else
      hi = mid;
  }
  Distrain__V1__GetJobMetricsResponse resp = DISTRAIN__V1__GET_JOB_METRICS_RESPONSE__INIT;
  if (lo < j->n_metrics) { /* none yet: metrics may be NULL, and NULL + 0 is undefined */
    resp.metrics = j->metrics + lo;
    resp.n_metrics = j->n_metrics - lo;
  }
  dt_rpc_call_reply(call, &resp.base);
}

/* ------------------------------------------------------------------------------------------ */
/* Rendezvous store and checkpoints                                                            */
/* ------------------------------------------------------------------------------------------ */

/* A trainer's generation must be the job's current one. */
static dt_job_t *current_job(dt_coord_t *c, dt_rpc_call_t *call, const char *id, uint64_t gen)
{
  dt_job_t *j = job_or_fail(c, call, id);
  if (j && gen != j->job->generation) {
    dt_rpc_call_fail(call, DT_RPC_FAILED_PRECONDITION,
                     "generation %llu of job %s is stale (current %llu)", (unsigned long long)gen,
                     id, (unsigned long long)j->job->generation);
    return NULL;
  }
  return j;
}

static void handle_kv_put(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__KvPutRequest *req = (const void *)m;
  if (!current_job(c, call, req->job_id, req->generation))
    return;
  if (!req->key[0]) {
    dt_rpc_call_fail(call, DT_RPC_INVALID_ARGUMENT, "empty key");
    return;
  }
  int rc = dt_coord_kv_put(c->kv, req->job_id, req->generation, req->key, req->value.data,
                           req->value.len);
  if (rc != 0) {
    dt_rpc_call_fail(call,
                     rc == DT_ENOMEM ? DT_RPC_RESOURCE_EXHAUSTED
                     : rc == DT_EIO  ? DT_RPC_UNAVAILABLE /* the store: the trainer retries */
                                     : DT_RPC_INTERNAL,
                     "storing key %s: %s", req->key, dt_strerror(rc));
    return;
  }
  Distrain__V1__KvPutResponse resp = DISTRAIN__V1__KV_PUT_RESPONSE__INIT;
  dt_rpc_call_reply(call, &resp.base);
}

static void handle_kv_get(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__KvGetRequest *req = (const void *)m;
  if (!current_job(c, call, req->job_id, req->generation))
    return;
  uint32_t wait = DT_MIN(req->timeout_ms, KV_MAX_WAIT_MS);
  dt_coord_kv_get(c->kv, c->loop, call, req->job_id, req->generation, req->key, wait);
}

static void handle_report_ckpt(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_t *c = ud;
  const Distrain__V1__ReportCheckpointRequest *req = (const void *)m;
  dt_job_t *j = current_job(c, call, req->job_id, req->generation);
  if (!j)
    return;
  char err[512];
  int committed = 0;
  int rc = dt_coord_checkpoint_report(c, j, 0, req, &committed, err, sizeof err);
  if (rc != 0) {
    dt_rpc_call_fail(call,
                     rc == DT_EINVAL     ? DT_RPC_INVALID_ARGUMENT
                     : rc == DT_EUNAVAIL ? DT_RPC_UNAVAILABLE /* the store: the writer retries */
                                         : DT_RPC_INTERNAL,
                     "%s", err);
    return;
  }
  Distrain__V1__ReportCheckpointResponse resp = DISTRAIN__V1__REPORT_CHECKPOINT_RESPONSE__INIT;
  resp.committed = committed > 0;
  resp.abandoned = committed < 0;
  if (resp.abandoned)
    resp.error = j->job->checkpoint_error;
  dt_rpc_call_reply(call, &resp.base);
}

/* ------------------------------------------------------------------------------------------ */
/* Trainer logs (logrelay.c)                                                                   */
/* ------------------------------------------------------------------------------------------ */

static void handle_get_logs(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_get_logs(ud, call, (const Distrain__V1__GetLogsRequest *)m);
}

static void handle_put_logs(dt_rpc_call_t *call, const ProtobufCMessage *m, void *ud)
{
  dt_coord_put_logs(ud, call, (const Distrain__V1__PutLogsRequest *)m);
}

int dt_coord_register_handlers(dt_coord_t *c)
{
  static const struct {
    const char *name;
    dt_rpc_handler_t fn;
  } table[] = {
      {"RegisterWorker", handle_register},
      {"Heartbeat", handle_heartbeat},
      {"WatchAssignment", handle_watch},
      {"SubmitJob", handle_submit},
      {"GetJob", handle_get_job},
      {"ListJobs", handle_list_jobs},
      {"StopJob", handle_stop_job},
      {"ListNodes", handle_list_nodes},
      {"DrainNode", handle_drain_node},
      {"ResumeJob", handle_resume_job},
      {"GetJobMetrics", handle_metrics},
      {"KvPut", handle_kv_put},
      {"KvGet", handle_kv_get},
      {"ReportCheckpoint", handle_report_ckpt},
      {"GetLogs", handle_get_logs},
      {"PutLogs", handle_put_logs},
  };
  for (size_t i = 0; i < DT_ARRAY_SIZE(table); i++)
    DT_CHECK(dt_rpc_server_handle(c->rpc, table[i].name, table[i].fn, c));
  return 0;
}
