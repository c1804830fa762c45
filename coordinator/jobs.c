/* jobs.c — the job state machine, planning and failure handling.
 *
 *   PENDING --(min_nodes idle, placement fits)--> RENDEZVOUS --(every rank RUNNING)--> RUNNING
 *   RUNNING/RENDEZVOUS --(rank failed, node dead)--> RECOVERING --(re-plan)--> RENDEZVOUS
 *   RUNNING --(every rank SUCCEEDED)--> COMPLETED;  any --(stop)--> STOPPED;
 *   RECOVERING --(restarts > max_restarts)--> FAILED
 *   RUNNING --(preempted by a job of higher elastic.priority: its step saved)--> RECOVERING
 *
 * Waiting jobs are planned highest elastic.priority first (then in submission order); one that
 * the idle nodes cannot hold preempts running jobs of lower priority whose nodes make it fit.
 * Every planning step bumps the generation. Re-planning keeps tp x pp x cp and shrinks dp to
 * what the healthy nodes hold, as long as the global batch still divides (gradient
 * accumulation makes up the difference), and resumes from the newest committed checkpoint. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checkpoint_manifest.h"
#include "coord.h"
#include "ctl.h"
#include "hang.h"
#include "dt_log.h"
#include "dt_util.h"
#include "jobspec.h"
#include "mesh.h"

static void set_string(char **field, const char *value)
{
  char *copy = strdup(value);
  if (!copy)
    return; /* keep the old text rather than lose the field */
  if (*field && *field != protobuf_c_empty_string)
    free(*field);
  *field = copy;
}

void dt_coord_job_transition(dt_coord_t *c, dt_job_t *j, Distrain__V1__JobState to, const char *fmt,
                             ...)
{
  char reason[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(reason, sizeof reason, fmt, ap);
  va_end(ap);
  dt_utf8_sanitize(reason); /* a trainer's error cut short may end inside a character */
  Distrain__V1__Job *job = j->job;
  DT_INFO(COORD, "job %s: %s -> %s (generation %llu): %s", j->id, dt_ctl_state_name(job->state),
          dt_ctl_state_name(to), (unsigned long long)job->generation, reason);
  dt_coord_event(c, j->id,
                 to == DISTRAIN__V1__JOB_STATE__JOB_RECOVERING ||
                     to == DISTRAIN__V1__JOB_STATE__JOB_FAILED,
                 "%s -> %s (generation %llu): %s", dt_ctl_state_name(job->state),
                 dt_ctl_state_name(to), (unsigned long long)job->generation, reason);
  job->state = to;
  job->updated_ms = dt_wall_ms();
  set_string(&job->reason, reason);
  if (to == DISTRAIN__V1__JOB_STATE__JOB_RECOVERING)
    set_string(&job->last_restart, reason);
  dt_coord_store_put_job(c->store, j);
  if (dt_coord_state_terminal(to))
    dt_coord_kv_expire(c->kv, j->id, UINT64_MAX); /* no generation of it will rendezvous again */
}

/* ------------------------------------------------------------------------------------------ */
/* Assignments                                                                                 */
/* ------------------------------------------------------------------------------------------ */

void dt_coord_notify_node(dt_coord_t *c, dt_node_t *n)
{
  if (!n->watch)
    return;
  dt_rpc_call_t *call = n->watch;
  n->watch = NULL;
  dt_rpc_call_on_cancel(call, NULL, NULL);
  Distrain__V1__WatchAssignmentResponse *r = dt_coord_assignments_for(c, n);
  if (!r) {
    dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  dt_rpc_call_reply(call, &r->base);
  dt_coord_free_assignments(r);
}

void dt_coord_assignments_changed(dt_coord_t *c, dt_node_t *n)
{
  n->assign_version++;
  dt_coord_store_put_node(c->store, n);
  n->notify_pending = 1;
  c->notify_pending = 1;
  dt_coord_schedule_soon(c);
}

void dt_coord_release_nodes(dt_coord_t *c, dt_job_t *j)
{
  int idx = dt_coord_job_index(&c->st, j);
  dt_coord_store_begin(c->store);
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    dt_node_t *n = c->st.nodes[i];
    if (n && n->job == idx) {
      n->job = -1;
      dt_coord_assignments_changed(c, n);
    }
  }
  dt_coord_store_commit(c->store);
}

void dt_coord_free_assignments(Distrain__V1__WatchAssignmentResponse *r)
{
  if (!r)
    return;
  for (size_t i = 0; i < r->n_assignments; i++) {
    Distrain__V1__Assignment *a = r->assignments[i];
    for (size_t k = 0; k < a->n_ranks; k++)
      free(a->ranks[k]);
    free(a->ranks);
    /* a->spec and a->skip_steps are borrowed from the job, a->job_id from the job id */
    free(a);
  }
  free(r->assignments);
  free(r->log_requests); /* the requests are the held GetLogs calls' (logrelay.c) */
  free(r);
}

static int cmp_node_rank(const void *pa, const void *pb)
{
  const dt_node_rank_t *a = pa, *b = pb;
  if (a->node != b->node)
    return a->node < b->node ? -1 : 1;
  return (a->rank > b->rank) - (a->rank < b->rank);
}

/* The ranks of the current generation on one node, ascending; NULL when out of memory. */
static const dt_node_rank_t *ranks_on_node(dt_job_t *j, int node, int *count)
{
  if (!j->by_node || j->by_node_gen != j->job->generation || j->by_node_world != j->world) {
    dt_node_rank_t *idx = malloc((size_t)DT_MAX(j->world, 1) * sizeof *idx);
    if (!idx)
      return NULL;
    for (int r = 0; r < j->world; r++)
      idx[r] = (dt_node_rank_t){j->ranks[r].node, r};
    qsort(idx, (size_t)j->world, sizeof *idx, cmp_node_rank);
    free(j->by_node);
    j->by_node = idx;
    j->by_node_gen = j->job->generation;
    j->by_node_world = j->world;
  }
  size_t lo = 0, hi = (size_t)j->world;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (j->by_node[mid].node < node)
      lo = mid + 1;
    else
      hi = mid;
  }
  size_t end = lo;
  while (end < (size_t)j->world && j->by_node[end].node == node)
    end++;
  *count = (int)(end - lo);
  return j->by_node + lo;
}

static Distrain__V1__WatchAssignmentResponse *build_assignments(dt_coord_t *c, dt_node_t *n);

Distrain__V1__WatchAssignmentResponse *dt_coord_assignments_for(dt_coord_t *c, dt_node_t *n)
{
  Distrain__V1__WatchAssignmentResponse *r = build_assignments(c, n);
  if (r)
    dt_coord_logs_attach(c, n, r);
  return r;
}

static Distrain__V1__WatchAssignmentResponse *build_assignments(dt_coord_t *c, dt_node_t *n)
{
  Distrain__V1__WatchAssignmentResponse *r = calloc(1, sizeof *r);
  if (!r)
    return NULL;
  distrain__v1__watch_assignment_response__init(r);
  r->version = n->assign_version;
  if (n->stopped_job)
    r->stopped_job = (char *)n->stopped_job; /* borrowed from the job */
  if (n->drained || n->job < 0 || (size_t)n->job >= c->st.n_jobs)
    return r;
  dt_job_t *j = c->st.jobs[n->job];
  if (dt_coord_state_terminal(j->job->state) ||
      j->job->state == DISTRAIN__V1__JOB_STATE__JOB_PENDING ||
      j->job->state == DISTRAIN__V1__JOB_STATE__JOB_RECOVERING || j->preempted_by[0])
    return r; /* a preempted job's trainers save their step and stop (r->stopped_job) */
  Distrain__V1__Assignment *a = calloc(1, sizeof *a);
  r->assignments = calloc(1, sizeof *r->assignments);
  if (!a || !r->assignments) {
    free(a);
    dt_coord_free_assignments(r);
    return NULL;
  }
  distrain__v1__assignment__init(a);
  r->assignments[0] = a;
  r->n_assignments = 1;
  a->job_id = j->id;
  a->generation = j->job->generation;
  a->world_size = j->world;
  a->spec = j->job->spec;
  a->resume = j->resume_step > 0;
  a->skip_steps = j->job->skipped_steps;
  a->n_skip_steps = j->job->n_skipped_steps;
  dt_mesh_t mesh;
  dt_jobspec_mesh(j->job->spec, &mesh);
  mesh.dp = j->dp;
  int local = 0;
  const dt_node_rank_t *mine = ranks_on_node(j, n->index, &local);
  if (!mine) {
    dt_coord_free_assignments(r);
    return NULL;
  }
  a->local_world_size = local;
  a->ranks = calloc((size_t)DT_MAX(local, 1), sizeof *a->ranks);
  if (!a->ranks) {
    dt_coord_free_assignments(r);
    return NULL;
  }
  for (int k = 0; k < local; k++) {
    const int rank = mine[k].rank;
    Distrain__V1__RankAssignment *ra = calloc(1, sizeof *ra);
    if (!ra) {
      dt_coord_free_assignments(r);
      return NULL;
    }
    distrain__v1__rank_assignment__init(ra);
    dt_mesh_coord_t co;
    dt_mesh_coords(&mesh, rank, &co);
    ra->rank = rank;
    ra->local_rank = j->ranks[rank].local_rank;
    ra->device_index = j->ranks[rank].local_rank;
    ra->pp = co.pp, ra->dp = co.dp, ra->cp = co.cp, ra->tp = co.tp;
    a->ranks[a->n_ranks++] = ra;
  }
  return r;
}

/* ------------------------------------------------------------------------------------------ */
/* Planning                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* parallel.dp as submitted (a job stored before requested_dp existed: its spec's). */
/* The kind of device a job's trainers need (training.device): "cuda" or "cpu", or NULL for
 * auto (whatever the node offers). */
static const char *device_kind(const Distrain__V1__JobSpec *spec)
{
  const char *d = spec->training ? spec->training->device : NULL;
  return d && (strcmp(d, "cuda") == 0 || strcmp(d, "cpu") == 0) ? d : NULL;
}

/* Whether node nd may run job j's trainers: alive, neither leaving nor drained, idle or already
 * j's, and offering the kind of device the job asks for. */
static int node_serves(const dt_node_t *nd, int jidx, const char *kind)
{
  return nd && nd->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE && !nd->leaving && !nd->drained &&
         (nd->job < 0 || nd->job == jidx) &&
         (!kind || (nd->info->n_devices > 0 && strcmp(nd->info->devices[0]->kind, kind) == 0));
}

static int priority(const dt_job_t *j)
{
  return j->job->spec->elastic->priority;
}

static int requested_dp(const dt_job_t *j)
{
  return j->job->requested_dp > 0 ? j->job->requested_dp : j->job->spec->parallel->dp;
}

/* The largest dp in [lo, requested] that the job's nodes and the idle alive ones but `without`
 * (up to max_nodes, at least min_nodes of them) can hold, or 0. */
static int placeable_dp(dt_coord_t *c, dt_job_t *j, int lo, const dt_node_t *without)
{
  const Distrain__V1__JobSpec *spec = j->job->spec;
  const Distrain__V1__ElasticSpec *el = spec->elastic;
  const int jidx = dt_coord_job_index(&c->st, j);
  int *devs = malloc((c->st.n_nodes + 1) * sizeof *devs), n = 0, dp = 0;
  if (!devs)
    return 0;
  for (size_t i = 0; i < c->st.n_nodes && (el->max_nodes <= 0 || n < el->max_nodes); i++)
    if (c->st.nodes[i] != without && node_serves(c->st.nodes[i], jidx, device_kind(spec)))
      devs[n++] = (int)c->st.nodes[i]->info->n_devices;
  if (n >= el->min_nodes) {
    dt_placement_t pl;
    dp = dt_jobspec_place(spec, lo, requested_dp(j), devs, n, &pl, NULL, 0);
    dt_placement_free(&pl);
  }
  free(devs);
  return DT_MAX(dp, 0);
}

/* The largest dp in (j->dp, requested] the nodes can hold now, or 0. */
static int larger_dp(dt_coord_t *c, dt_job_t *j)
{
  return placeable_dp(c, j, j->dp + 1, NULL);
}

/* After a checkpoint commit: a job running below its submitted dp (it shrank when a node was
 * lost) grows back when nodes have returned or spares registered. Its trainers stop and a new
 * generation resumes from the step just committed on the larger world: the work lost is what
 * ran past the commit, and the restart does not count against max_restarts. */
static void maybe_grow(dt_coord_t *c, dt_job_t *j)
{
  if (j->job->state != DISTRAIN__V1__JOB_STATE__JOB_RUNNING || j->dp >= requested_dp(j) ||
      j->job->committed_step >= j->job->spec->training->steps || /* it has just finished */
      j->preempted_by[0])
    return;
  const int dp = larger_dp(c, j);
  if (!dp)
    return;
  dt_coord_job_transition(c, j, DISTRAIN__V1__JOB_STATE__JOB_RECOVERING,
                          "growing from dp %d to dp %d at checkpoint step %lld", j->dp, dp,
                          (long long)j->job->committed_step);
  j->restarts_by[DT_RESTART_GROW]++;
  dt_coord_release_nodes(c, j);
  dt_coord_kv_expire(c->kv, j->id, j->job->generation + 1);
  dt_coord_schedule_soon(c);
}

static void recover(dt_coord_t *c, dt_job_t *j, dt_restart_reason_t why, const char *reason);

/* Stops job v for job j, of higher priority, that needs its nodes: its trainers lose their
 * assignment (stopped_job: SIGTERM, so that each saves its step and exits 3, which recovers v
 * uncounted); a job still in rendezvous, with no step to save, recovers at once. */
static void preempt(dt_coord_t *c, dt_job_t *v, const dt_job_t *j)
{
  const int vidx = dt_coord_job_index(&c->st, v);
  char why[160];
  snprintf(why, sizeof why, "preempted by %s (elastic.priority %d over %d)", j->id, priority(j),
           priority(v));
  DT_INFO(COORD, "job %s %s: its trainers save their step and stop; it waits for nodes", v->id,
          why);
  dt_coord_event(c, v->id, 1, "%s: it saves its step and waits for nodes", why);
  snprintf(v->preempted_by, sizeof v->preempted_by, "%s", j->id);
  if (v->job->state == DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS) {
    recover(c, v, DT_RESTART_PREEMPTED, why);
    return;
  }
  dt_coord_store_begin(c->store);
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    dt_node_t *n = c->st.nodes[i];
    if (n && n->job == vidx) {
      n->stopped_job = v->id;
      dt_coord_assignments_changed(c, n);
    }
  }
  dt_coord_store_commit(c->store);
}

/* Sorts jobs by elastic.priority, descending (dir 1) or ascending (-1), keeping the order of
 * equals (an insertion sort: a handful of jobs wait at a time). */
static void sort_by_priority(dt_job_t **jobs, size_t n, int dir)
{
  for (size_t i = 1; i < n; i++) {
    dt_job_t *x = jobs[i];
    size_t k = i;
    for (; k > 0 && dir * (priority(x) - priority(jobs[k - 1])) > 0; k--)
      jobs[k] = jobs[k - 1];
    jobs[k] = x;
  }
}

/* For job j, which the idle nodes cannot hold: the running jobs of lower elastic.priority,
 * lowest first and among equals the newest first, as few as make j fit on their nodes and the
 * idle ones, are preempted. Returns 1 (why says so) when some are (or already were, for j)
 * stopping, 2 when those preempted have given their nodes up at once (all in rendezvous), 0
 * when none would make it fit. */
static int preempt_for(dt_coord_t *c, dt_job_t *j, char *why, size_t whylen)
{
  const Distrain__V1__JobSpec *spec = j->job->spec;
  const Distrain__V1__ElasticSpec *el = spec->elastic;
  const char *kind = device_kind(spec);
  const int max_nodes = el->max_nodes > 0 ? el->max_nodes : (int)c->st.n_nodes;
  dt_job_t **victims = malloc((c->st.n_jobs + 1) * sizeof *victims);
  int *devs = malloc((c->st.n_nodes + 1) * sizeof *devs), nv = 0, n = 0, fits = 0, stopping = 0;
  int ret = 0;
  if (!victims || !devs)
    goto out;
  for (size_t i = c->st.n_jobs; i-- > 0;) { /* the newest first among equals */
    dt_job_t *v = c->st.jobs[i];
    const Distrain__V1__JobState s = v->job->state;
    stopping += strcmp(v->preempted_by, j->id) == 0;
    if (v != j && priority(v) < priority(j) && !v->preempted_by[0] &&
        (s == DISTRAIN__V1__JOB_STATE__JOB_RUNNING || s == DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS))
      victims[nv++] = v;
  }
  if (stopping) {
    snprintf(why, whylen, "waiting for the job%s it preempted to save %s step and stop",
             stopping > 1 ? "s" : "", stopping > 1 ? "their" : "its");
    ret = 1;
    goto out;
  }
  sort_by_priority(victims, (size_t)nv, -1);
  for (size_t i = 0; i < c->st.n_nodes && n < max_nodes; i++)
    if (node_serves(c->st.nodes[i], -1, kind))
      devs[n++] = (int)c->st.nodes[i]->info->n_devices;
  int k = 0;
  for (; k < nv && !fits; k++) {
    const int vidx = dt_coord_job_index(&c->st, victims[k]);
    for (size_t i = 0; i < c->st.n_nodes && n < max_nodes; i++) {
      const dt_node_t *nd = c->st.nodes[i];
      if (nd && nd->job == vidx && node_serves(nd, vidx, kind))
        devs[n++] = (int)nd->info->n_devices;
    }
    if (n >= el->min_nodes) {
      dt_placement_t pl;
      fits = dt_jobspec_place(spec, 1, requested_dp(j), devs, n, &pl, NULL, 0) > 0;
      dt_placement_free(&pl);
    }
  }
  if (!fits)
    goto out;
  size_t len = (size_t)snprintf(why, whylen, "preempting");
  for (int i = 0; i < k; i++) {
    if (len < whylen)
      len += (size_t)snprintf(why + len, whylen - len, "%s %s (elastic.priority %d)", i ? "," : "",
                              victims[i]->id, priority(victims[i]));
    preempt(c, victims[i], j);
  }
  if (len < whylen)
    snprintf(why + len, whylen - len, ": %s, then %s %s nodes to this job",
             k > 1 ? "they save their step" : "it saves its step", k > 1 ? "leave" : "leaves",
             k > 1 ? "their" : "its");
  ret = 2; /* unless one still runs (a job in rendezvous recovers at once) */
  for (int i = 0; i < k; i++)
    ret = victims[i]->preempted_by[0] ? 1 : ret;
out:
  free(victims);
  free(devs);
  return ret;
}

/* Between a recovering job's cause and what its new generation waits for, in its reason. */
#define WAITING_MARK "; next generation: "

/* Tries to place job j on idle alive nodes, unless held_by, a job of higher or equal priority
 * waiting for the jobs it preempted to free their nodes, comes first. Returns 1 when planned. */
static int plan_job(dt_coord_t *c, dt_job_t *j, const dt_job_t *held_by)
{
  Distrain__V1__JobSpec *spec = j->job->spec;
  const Distrain__V1__ElasticSpec *el = spec->elastic;
  int max_nodes = el->max_nodes > 0 ? el->max_nodes : (int)c->st.n_nodes;
  int *idle = malloc((c->st.n_nodes + 1) * sizeof *idle);
  int *devs = malloc((c->st.n_nodes + 1) * sizeof *devs);
  int nidle = 0, nserving = 0, nbusy = 0, ndrained = 0, planned = 0;
  char why[256] = "";
  if (!idle || !devs)
    goto out;
  if (held_by) { /* the nodes the jobs it preempted free are its */
    snprintf(why, sizeof why, "waiting: %s (elastic.priority %d) takes the nodes freed first",
             held_by->id, priority(held_by));
    goto wait;
  }
  const char *kind = device_kind(spec);
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    const dt_node_t *nd = c->st.nodes[i];
    if (node_serves(nd, -1, kind) && nserving++ < max_nodes) {
      idle[nidle] = (int)i;
      devs[nidle++] = (int)nd->info->n_devices;
    }
    nbusy += nd && nd->job >= 0 && node_serves(nd, nd->job, kind); /* another job's */
    ndrained += nd && nd->drained && nd->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE;
  }
  if (nidle < el->min_nodes) {
    snprintf(why, sizeof why, "waiting for nodes: %d idle%s%s%s, min_nodes %d", nidle,
             kind ? " with " : "", kind ? kind : "", kind ? " devices" : "", el->min_nodes);
    if (nbusy > 0) {
      const size_t len = strlen(why);
      snprintf(why + len, sizeof why - len, " (%d more busy with other jobs)", nbusy);
    }
    if (ndrained > 0) {
      const size_t len = strlen(why);
      snprintf(why + len, sizeof why - len, " (%d drained: distrainctl undrain)", ndrained);
    }
    goto wait;
  }
  /* Keep tp x pp x cp; take the largest dp <= the submitted one that fits and divides the
   * batch. */
  dt_placement_t pl;
  const int dp = dt_jobspec_place(spec, 1, requested_dp(j), devs, nidle, &pl, why, sizeof why);
  if (dp < 0) {
    if (nserving > nidle) { /* the job's own limit, not the cluster's */
      const size_t len = strlen(why);
      snprintf(why + len, sizeof why - len, " (elastic.max_nodes %d; %d nodes are idle)", max_nodes,
               nserving);
    }
    goto wait;
  }
  dt_mesh_t mesh;
  dt_jobspec_mesh(spec, &mesh);

  /* Commit the plan: a new generation. */
  dt_job_free_ranks(j);
  j->ranks = calloc((size_t)pl.world, sizeof *j->ranks);
  if (!j->ranks) {
    dt_placement_free(&pl);
    goto out;
  }
  j->world = pl.world;
  j->n_running = j->n_done = 0;
  j->dp = dp;
  j->grad_accum = dt_jobspec_grad_accum(spec, dp);
  spec->parallel->dp = dp; /* agents read the current generation's mesh from the spec */
  for (int r = 0; r < pl.world; r++) {
    j->ranks[r].node = idle[pl.ranks[r].node];
    j->ranks[r].local_rank = pl.ranks[r].local_rank;
    j->ranks[r].state = DISTRAIN__V1__TRAINER_STATE__TRAINER_STARTING;
    j->ranks[r].step = 0;
  }
  dt_coord_remember_ranks(j);
  j->resume_step = j->job->committed_step;
  j->job->generation++;
  j->job->world_size = pl.world;
  dt_coord_kv_expire(c->kv, j->id, j->job->generation);
  int jidx = dt_coord_job_index(&c->st, j);
  char nodes[256] = "";
  for (int k = 0; k < nidle; k++) {
    if (pl.node_nranks[k] == 0)
      continue;
    dt_node_t *n = c->st.nodes[idle[k]];
    n->job = jidx;
    n->stopped_job = NULL;
    size_t len = strlen(nodes);
    snprintf(nodes + len, sizeof nodes - len, "%s%s", len ? "," : "", n->id);
  }
  char meshbuf[64];
  mesh.dp = dp;
  dt_coord_store_begin(c->store);
  dt_mesh_format(&mesh, meshbuf, sizeof meshbuf);
  dt_coord_job_transition(c, j, DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS,
                          "world %d (%s), grad accum %d, on %s%s", pl.world, meshbuf, j->grad_accum,
                          nodes, j->resume_step > 0 ? ", resuming from checkpoint" : "");
  for (int k = 0; k < nidle; k++)
    if (pl.node_nranks[k] > 0)
      dt_coord_assignments_changed(c, c->st.nodes[idle[k]]);
  dt_coord_store_commit(c->store);
  dt_placement_free(&pl);
  planned = 1;
  goto out;
wait:;
  /* Where jobs of lower priority hold the nodes it needs, they make room (why says so). */
  char preempting[256];
  const int preempted = held_by ? 0 : preempt_for(c, j, preempting, sizeof preempting);
  if (preempted == 2) { /* their nodes are free now */
    free(idle);
    free(devs);
    return plan_job(c, j, NULL);
  }
  if (preempted)
    snprintf(why, sizeof why, "%s", preempting);
  /* A waiting job says why; a recovering one keeps its cause first (what failed, which
   * restart) and says what it waits for after it. */
  const char *had = j->job->reason ? j->job->reason : "";
  char reason[768];
  if (j->job->state == DISTRAIN__V1__JOB_STATE__JOB_PENDING) {
    snprintf(reason, sizeof reason, "%s", why);
  } else if (j->job->state == DISTRAIN__V1__JOB_STATE__JOB_RECOVERING) {
    const char *mark = strstr(had, WAITING_MARK);
    snprintf(reason, sizeof reason, "%.*s" WAITING_MARK "%s",
             (int)(mark ? (size_t)(mark - had) : strlen(had)), had, why);
    dt_utf8_sanitize(reason); /* a cut cause */
  } else {
    goto out;
  }
  if (strcmp(had, reason) != 0) {
    set_string(&j->job->reason, reason);
    dt_coord_store_put_job(c->store, j);
  }
out:
  free(idle);
  free(devs);
  return planned;
}

int dt_coord_submit_job(dt_coord_t *c, const Distrain__V1__JobSpec *spec, dt_job_t **out)
{
  dt_job_t *j = calloc(1, sizeof *j);
  if (!j)
    return DT_ENOMEM;
  snprintf(j->id, sizeof j->id, "job-%llu", (unsigned long long)c->st.next_job);
  dt_job_metrics_init(j);
  Distrain__V1__Job tmpl = DISTRAIN__V1__JOB__INIT;
  tmpl.job_id = j->id;
  tmpl.spec = (Distrain__V1__JobSpec *)spec; /* copied with tmpl */
  tmpl.state = DISTRAIN__V1__JOB_STATE__JOB_PENDING;
  tmpl.created_ms = tmpl.updated_ms = dt_wall_ms();
  tmpl.reason = "submitted";
  tmpl.requested_dp = spec->parallel->dp;
  j->job = dt_pb_copy(&tmpl.base);
  if (!j->job || dt_coord_add_job(&c->st, j) != 0) {
    dt_job_free(j);
    return DT_ENOMEM;
  }
  c->st.next_job++;
  dt_coord_store_put_job(c->store, j);
  if (dt_coord_resync(c, 1) != 0) { /* not saved: as if never submitted */
    c->st.n_jobs--;
    c->st.next_job--;
    dt_job_free(j);
    return DT_EIO;
  }
  *out = j;
  return 0;
}

/* Whether a job j preempted is still stopping. */
static int preempting(const dt_coord_t *c, const dt_job_t *j)
{
  for (size_t i = 0; i < c->st.n_jobs; i++)
    if (strcmp(c->st.jobs[i]->preempted_by, j->id) == 0)
      return 1;
  return 0;
}

/* Plans the waiting jobs, highest elastic.priority first, then in submission order; once one
 * waits for the jobs it preempted to stop, those after it wait too (the nodes freed, and the
 * idle ones it counted on, are its). */
void dt_coord_schedule(dt_coord_t *c)
{
  dt_job_t **waiting = malloc((c->st.n_jobs + 1) * sizeof *waiting);
  size_t n = 0;
  for (size_t i = 0; i < c->st.n_jobs; i++) {
    Distrain__V1__JobState s = c->st.jobs[i]->job->state;
    if (s == DISTRAIN__V1__JOB_STATE__JOB_PENDING || s == DISTRAIN__V1__JOB_STATE__JOB_RECOVERING) {
      if (!waiting) /* no memory to order them: in submission order */
        plan_job(c, c->st.jobs[i], NULL);
      else
        waiting[n++] = c->st.jobs[i];
    }
  }
  sort_by_priority(waiting, n, 1);
  const dt_job_t *held_by = NULL;
  for (size_t i = 0; i < n; i++) { /* a job planned may preempt or recover another */
    dt_job_t *w = waiting[i];
    if (w->job->state != DISTRAIN__V1__JOB_STATE__JOB_PENDING &&
        w->job->state != DISTRAIN__V1__JOB_STATE__JOB_RECOVERING)
      continue;
    if (!plan_job(c, w, held_by) && !held_by && preempting(c, w))
      held_by = w;
  }
  free(waiting);
}

/* Where a new generation of j starts: "checkpoint step N", or "the beginning (...)". */
static void restart_point(const dt_job_t *j, char *buf, size_t n)
{
  if (j->job->committed_step > 0)
    snprintf(buf, n, "checkpoint step %lld", (long long)j->job->committed_step);
  else
    snprintf(buf, n, "the beginning (no checkpoint yet)");
}

/* A failure in the current generation: restart from the last checkpoint, or give up. A stop
 * on request (DT_RESTART_STOPPED) is no failure: every rank saved its last step, and the
 * restart does not count against max_restarts. */
static void recover(dt_coord_t *c, dt_job_t *j, dt_restart_reason_t why, const char *reason)
{
  j->blame_deadline_ms = 0;
  j->preempted_by[0] = '\0';
  if (dt_coord_state_terminal(j->job->state) ||
      j->job->state == DISTRAIN__V1__JOB_STATE__JOB_RECOVERING)
    return;
  const int max_restarts = j->job->spec->elastic->max_restarts;
  char from[64];
  restart_point(j, from, sizeof from);
  if (why == DT_RESTART_STOPPED || why == DT_RESTART_PREEMPTED) {
    j->restarts_by[why]++;
    dt_coord_job_transition(c, j, DISTRAIN__V1__JOB_STATE__JOB_RECOVERING,
                            "%s; restarting from %s, not counted against max_restarts", reason,
                            from);
  } else if (j->job->restarts >= max_restarts) {
    dt_coord_job_transition(c, j, DISTRAIN__V1__JOB_STATE__JOB_FAILED,
                            "%s; giving up after %d restarts (max_restarts %d)", reason,
                            j->job->restarts, max_restarts);
    dt_coord_release_nodes(c, j);
    return;
  } else {
    j->job->restarts++;
    j->restarts_by[why]++;
    dt_coord_job_transition(c, j, DISTRAIN__V1__JOB_STATE__JOB_RECOVERING,
                            "%s; restart %d of %d from %s", reason, j->job->restarts, max_restarts,
                            j->job->committed_step > 0 ? "the last committed checkpoint" : from);
  }
  dt_coord_release_nodes(c, j);
  dt_coord_kv_expire(c->kv, j->id, j->job->generation + 1);
}

int dt_coord_drain(dt_coord_t *c, dt_node_t *n, const char *reason)
{
  char *copy = reason ? strdup(reason) : NULL;
  if (reason && !copy)
    return DT_ENOMEM;
  const int was = n->drained != NULL;
  free(n->drained);
  n->drained = copy;
  dt_coord_store_put_node(c->store, n);
  if (!reason) {
    if (was) {
      DT_INFO(COORD, "node %s (%s) undrained: it takes work again", n->id, n->info->hostname);
      dt_coord_event(c, NULL, 0, "node %s (%s) undrained", n->id, n->info->hostname);
    }
    dt_coord_schedule_soon(c); /* a waiting job may fit now */
    return 0;
  }
  if (!was) {
    DT_INFO(COORD, "node %s (%s) drained: no new work goes there%s%s%s", n->id, n->info->hostname,
            reason[0] ? " (reason: " : "", reason, reason[0] ? ")" : "");
    dt_coord_event(c, NULL, 0, "node %s (%s) drained%s%s%s", n->id, n->info->hostname,
                   reason[0] ? " (reason: " : "", reason, reason[0] ? ")" : "");
  }
  if (n->job < 0 || (size_t)n->job >= c->st.n_jobs)
    return 0;
  dt_job_t *j = c->st.jobs[n->job];
  if (n->stopped_job == j->id)
    return 0; /* drained again (a new reason): its trainers are stopping already */
  char why[256];
  snprintf(why, sizeof why, "node %s (%s) drained", n->id, n->info->hostname);
  if (j->job->state == DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS) {
    /* Not every rank is training yet, so no step can be saved (and a rank never started there
     * would leave the others waiting): restart without it now. */
    recover(c, j, DT_RESTART_STOPPED, why);
    dt_coord_schedule_soon(c);
  } else {
    /* Its trainers there get SIGTERM (they have no assignment left): every rank of the job
     * saves the step it is in and exits 3, and the job restarts without this node. */
    n->stopped_job = j->id;
    dt_coord_assignments_changed(c, n);
  }
  return 0;
}

int dt_coord_resume(dt_coord_t *c, dt_job_t *j)
{
  const Distrain__V1__JobState was = j->job->state;
  if (was != DISTRAIN__V1__JOB_STATE__JOB_STOPPED && was != DISTRAIN__V1__JOB_STATE__JOB_FAILED)
    return DT_EINVAL;
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    const dt_node_t *n = c->st.nodes[i];
    for (size_t k = 0; n && k < n->n_trainers; k++) {
      const Distrain__V1__TrainerStatus *ts = n->trainers[k];
      if (ts->generation == j->job->generation && strcmp(ts->job_id, j->id) == 0 &&
          dt_ctl_trainer_active(ts))
        return DT_EBUSY; /* its checkpoint may not be committed yet */
    }
  }
  j->job->restarts = 0;
  j->blame_deadline_ms = 0;
  char from[64];
  restart_point(j, from, sizeof from);
  dt_coord_job_transition(c, j, DISTRAIN__V1__JOB_STATE__JOB_RECOVERING,
                          "resumed by the user (it was %s); restarting from %s",
                          dt_ctl_state_name(was), from);
  dt_coord_schedule(c);
  return 0;
}

void dt_coord_node_dead(dt_coord_t *c, dt_node_t *n)
{
  /* From the wall clock of its last heartbeat: last_seen_ms of a node restored after a
   * coordinator restart includes the restart grace, not the node's real silence. */
  double silent = (double)(dt_wall_ms() - n->last_seen_wall_ms);
  n->state = DISTRAIN__V1__NODE_STATE__NODE_DEAD;
  if (n->leaving) {
    DT_INFO(COORD, "node %s (%s) left: its agent stopped", n->id, n->info->hostname);
    dt_coord_logs_node_gone(c, n, 0, "its agent stopped");
    dt_coord_event(c, NULL, 0, "node %s (%s) left: its agent stopped", n->id, n->info->hostname);
  } else {
    DT_WARN(COORD, "node %s (%s) is dead: no heartbeat for %.0f ms", n->id, n->info->hostname,
            silent);
    dt_coord_logs_node_gone(c, n, 0, "it is dead (missed heartbeats)");
    dt_coord_event(c, NULL, 1, "node %s (%s) is dead: no heartbeat for %.0f ms", n->id,
                   n->info->hostname, silent);
  }
  int jidx = n->job;
  dt_coord_store_put_node(c->store, n);
  if (jidx >= 0 && (size_t)jidx < c->st.n_jobs) {
    dt_job_t *j = c->st.jobs[jidx];
    Distrain__V1__Job *job = j->job;
    char **grown = realloc(job->failed_nodes, (job->n_failed_nodes + 1) * sizeof(char *));
    if (grown) {
      job->failed_nodes = grown;
      job->failed_nodes[job->n_failed_nodes] = strdup(n->id);
      if (job->failed_nodes[job->n_failed_nodes])
        job->n_failed_nodes++;
    }
    char reason[256];
    if (n->leaving) /* its agent was stopped: an operator's doing, not a failure */
      snprintf(reason, sizeof reason, "node %s (%s) left (its agent stopped)", n->id,
               n->info->hostname);
    else
      snprintf(reason, sizeof reason, "node %s (%s) missed heartbeats for %.0f ms%s", n->id,
               n->info->hostname, silent, n->drained ? " while being drained" : "");
    recover(c, j, n->leaving || n->drained ? DT_RESTART_STOPPED : DT_RESTART_NODE_DEAD, reason);
  }
  dt_coord_schedule_soon(c);
}

static int metrics_reserve(dt_job_t *j)
{
  if (j->n_metrics < j->cap_metrics)
    return 0;
  size_t cap = j->cap_metrics ? j->cap_metrics * 2 : 256;
  void *grown = realloc(j->metrics, cap * sizeof *j->metrics);
  if (!grown)
    return DT_ENOMEM;
  j->metrics = grown, j->cap_metrics = cap;
  return 0;
}

/* Rank 0's metrics of the current generation, in step order. */
static void append_metrics(dt_coord_t *c, dt_job_t *j, const Distrain__V1__TrainerStatus *ts)
{
  size_t first_new = j->n_metrics;
  int64_t dropped = INT64_MAX; /* the first step dropped from memory, to drop from the store */
  for (size_t i = 0; i < ts->n_metrics; i++) {
    const Distrain__V1__StepMetrics *m = ts->metrics[i];
    /* A restarted generation replays steps after the checkpoint: its values replace ours. */
    while (j->n_metrics > 0 && j->metrics[j->n_metrics - 1]->step >= m->step) {
      dropped = j->metrics[j->n_metrics - 1]->step;
      distrain__v1__step_metrics__free_unpacked(j->metrics[--j->n_metrics], NULL);
      first_new = DT_MIN(first_new, j->n_metrics);
    }
    if (metrics_reserve(j) != 0)
      break;
    /* Each step counted once per generation, however often a heartbeat repeats it (step 0,
     * the validation before training, not at all). */
    if (m->step > 0 && (ts->generation != j->hist_gen || m->step > j->hist_step)) {
      dt_prom_hist_observe(&j->step_seconds, m->ms / 1000.0);
      j->hist_gen = ts->generation;
      j->hist_step = m->step;
    }
    Distrain__V1__StepMetrics *copy = dt_pb_copy(&m->base);
    if (!copy)
      break;
    j->metrics[j->n_metrics++] = copy;
  }
  if (dropped != INT64_MAX) /* or a restart would bring back the steps replaced */
    dt_coord_store_drop_metrics(c->store, j->id, dropped);
  if (first_new < j->n_metrics)
    dt_coord_store_put_metrics(c->store, j->id, j->metrics + first_new, j->n_metrics - first_new);
}

/* Rank 0's last steps, read by its agent after the trainer exited and so sent after the job
 * moved on to a new generation (or ended): the steps up to `last` are final and go in where
 * they are missing; later ones belong to the generation that replays them. */
static void merge_final_metrics(dt_coord_t *c, dt_job_t *j, const Distrain__V1__TrainerStatus *ts,
                                int64_t last)
{
  for (size_t i = 0; i < ts->n_metrics; i++) {
    const Distrain__V1__StepMetrics *m = ts->metrics[i];
    size_t lo = 0, hi = j->n_metrics; /* first entry at or after m->step */
    while (lo < hi) {
      size_t mid = lo + (hi - lo) / 2;
      if (j->metrics[mid]->step < m->step)
        lo = mid + 1;
      else
        hi = mid;
    }
    if (m->step > last || (lo < j->n_metrics && j->metrics[lo]->step == m->step))
      continue;
    Distrain__V1__StepMetrics *copy = metrics_reserve(j) == 0 ? dt_pb_copy(&m->base) : NULL;
    if (!copy)
      return;
    memmove(j->metrics + lo + 1, j->metrics + lo, (j->n_metrics - lo) * sizeof *j->metrics);
    j->metrics[lo] = copy;
    j->n_metrics++;
    if (m->step > 0)
      dt_prom_hist_observe(&j->step_seconds, m->ms / 1000.0);
    dt_coord_store_put_metrics(c->store, j->id, &j->metrics[lo], 1);
  }
}

/* Job-level transitions after its rank counts changed. */
static void evaluate_job(dt_coord_t *c, dt_job_t *j)
{
  Distrain__V1__JobState s = j->job->state;
  if (s != DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS && s != DISTRAIN__V1__JOB_STATE__JOB_RUNNING)
    return;
  char ranks[32] = "its rank"; /* "all 4 ranks", not "all 1 ranks" */
  if (j->world > 1)
    snprintf(ranks, sizeof ranks, "all %d ranks", j->world);
  if (j->n_done == j->world) {
    dt_coord_job_transition(c, j, DISTRAIN__V1__JOB_STATE__JOB_COMPLETED, "%s finished step %lld",
                            ranks, (long long)j->job->step);
    dt_coord_release_nodes(c, j);
    dt_coord_schedule(c);
  } else if (s == DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS && j->n_running + j->n_done == j->world) {
    dt_coord_job_transition(c, j, DISTRAIN__V1__JOB_STATE__JOB_RUNNING, "%s %s training", ranks,
                            j->world > 1 ? "are" : "is");
  }
}

static void slot_set_state(dt_job_t *j, dt_rank_slot_t *slot, Distrain__V1__TrainerState to)
{
  j->n_running -= slot->state == DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING;
  j->n_done -= slot->state == DISTRAIN__V1__TRAINER_STATE__TRAINER_SUCCEEDED;
  slot->state = to;
  j->n_running += to == DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING;
  j->n_done += to == DISTRAIN__V1__TRAINER_STATE__TRAINER_SUCCEEDED;
}

/* Adds steps first..first+count-1 to the job's skipped steps (kept ascending, each once: another
 * rank's report of the same rollback adds nothing). */
static void skip_steps_later(dt_job_t *j, int64_t first, int64_t count)
{
  Distrain__V1__Job *job = j->job;
  const size_t n = job->n_skipped_steps;
  int64_t *merged = malloc((n + (size_t)count) * sizeof *merged), *old = job->skipped_steps;
  if (!merged)
    return;
  size_t i = 0, m = 0;
  for (int64_t s = first; s < first + count; s++) {
    while (i < n && old[i] < s)
      merged[m++] = old[i++];
    if (i < n && old[i] == s)
      i++;
    merged[m++] = s;
  }
  while (i < n)
    merged[m++] = old[i++];
  free(old);
  job->skipped_steps = merged;
  job->n_skipped_steps = m;
}

/* A trainer's steps taken without an update where they were (elastic.bad_step: skip): those
 * the job did not have yet join its skipped steps, so that a generation resumed from before
 * them takes them so too; each new run of them is said once (every rank reports the same). */
static void note_skipped_in_place(dt_coord_t *c, dt_job_t *j, const Distrain__V1__TrainerStatus *ts,
                                  const char *node)
{
  const size_t n = ts->n_skipped_in_place;
  int64_t(*runs)[2] = malloc(n * sizeof *runs); /* the new runs: first, count */
  if (!runs)
    return;
  size_t nruns = 0;
  const Distrain__V1__Job *job = j->job;
  for (size_t i = 0, m = 0, run; i < n; i += run) { /* both lists ascending */
    const int64_t *v = ts->skipped_in_place + i;
    run = dt_run_length(v, n - i);
    int known = 1;
    for (size_t k = 0; k < run; k++) {
      while (m < job->n_skipped_steps && job->skipped_steps[m] < v[k])
        m++;
      known &= m < job->n_skipped_steps && job->skipped_steps[m] == v[k];
    }
    if (!known)
      runs[nruns][0] = v[0], runs[nruns++][1] = (int64_t)run;
  }
  static const char why[] = "a non-finite or spiking loss; elastic.bad_step: skip";
  for (size_t r = 0; r < nruns; r++) {
    skip_steps_later(j, runs[r][0], runs[r][1]);
    char what[64];
    dt_steps_text(what, sizeof what, runs[r][0], runs[r][1]);
    DT_WARN(COORD, "job %s: rank %d on %s took %s without an update, where it was (%s)", j->id,
            ts->rank, node, what, why);
    dt_coord_event(c, j->id, 1, "rank %d on %s took %s without an update, where it was (%s)",
                   ts->rank, node, what, why);
  }
  if (nruns)
    dt_coord_store_put_job(c->store, j);
  free(runs);
}

double dt_coord_report_age_ms(const dt_job_t *j, int r)
{
  const dt_rank_slot_t *s = &j->ranks[r];
  return s->heard_ms > 0 ? s->report_age_ms + (dt_coord_now_ms() - s->heard_ms) : 0.0;
}

static double hang_timeout_ms(const dt_job_t *j)
{
  const int s = j->job->spec->elastic->hang_timeout_s;
  return 1000.0 * (s > 0 ? s : 30);
}

/* A progress report from rank r: if it has been blocked in a collective past the job's hang
 * timeout, name the ranks it waits for and restart (at most one analysis a second per job).
 * Returns 1 when the job was sent to recovery. */
static int check_hang(dt_coord_t *c, dt_job_t *j, int r)
{
  const double timeout = hang_timeout_ms(j), now = dt_coord_now_ms();
  const Distrain__V1__JobState st = j->job->state;
  if ((st != DISTRAIN__V1__JOB_STATE__JOB_RUNNING &&
       st != DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS) ||
      now - j->hang_checked_ms < 1000.0)
    return 0;
  const Distrain__V1__TrainerProgress *p = j->ranks[r].progress;
  int blocked = 0;
  for (size_t k = 0; k < p->n_comms; k++)
    blocked |= p->comms[k]->op[0] && p->comms[k]->waiting_ms >= timeout;
  if (!blocked)
    return 0;
  j->hang_checked_ms = now;
  dt_hang_rank_t *in = malloc((size_t)j->world * sizeof *in);
  int *blamed = malloc((size_t)j->world * sizeof *blamed);
  int nb = 0;
  char why[768], reason[1024];
  if (in && blamed) {
    for (int k = 0; k < j->world; k++)
      in[k] = (dt_hang_rank_t){j->ranks[k].progress, dt_coord_report_age_ms(j, k)};
    /* Silent for half the timeout (the reports come every second): stopped. */
    nb = dt_hang_analyze(in, j->world, timeout, DT_MIN(timeout / 2, 5000.0), blamed, why,
                         sizeof why);
  }
  if (nb > 0) {
    size_t at = (size_t)snprintf(reason, sizeof reason, "hang: %s; named:", why);
    for (int i = 0; i < nb && i < 8 && at < sizeof reason; i++) {
      const dt_node_t *n = c->st.nodes[j->ranks[blamed[i]].node];
      at += (size_t)snprintf(reason + at, sizeof reason - at, "%s rank %d on %s (%s)", i ? "," : "",
                             blamed[i], n->id, n->info->hostname);
    }
    DT_WARN(COORD, "job %s: %s", j->id, reason);
    recover(c, j, DT_RESTART_HANG, reason);
  }
  free(in);
  free(blamed);
  return nb > 0;
}

static int cmp_double(const void *a, const void *b)
{
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Stragglers: a rank whose compute per step (its step time less what it waited for peers)
 * stays above STRAGGLER_FACTOR x the median rank's for STRAGGLER_CHECKS checks in a row (one a
 * second) is reported in status and the log; it is not restarted. It stops being one once it
 * is back under 1.2x the median. */
#define STRAGGLER_FACTOR 1.5
#define STRAGGLER_CHECKS 3

/* The likely cause of a straggler on device `device` of node nd, where its GPU's latest sample
 * shows it slowed ("; its GPU 1 reports itself slowed: hardware thermal slowdown"), into buf;
 * else buf is left as it is. */
static void slowed_gpu(const dt_node_t *nd, int device, char *buf, size_t n)
{
  for (size_t i = 0; i < nd->n_usage; i++) {
    char words[DT_CTL_SLOWED_MAX];
    if (nd->usage[i]->index == device && dt_ctl_gpu_slowed(nd->usage[i], words, sizeof words))
      snprintf(buf, n, "; its GPU %d reports itself slowed: %s", device, words);
  }
}

/* elastic.straggler_drain_s after rank r of j became a straggler (its compute `ratio` x the
 * median rank's): its node is drained, the job saving its step and going on without it as from
 * any drain, where the job then runs faster: every step waits for the straggler, so with it the
 * job trains at about dp / ratio ranks' pace, without it at dp' (the placement on its other
 * nodes and the idle ones). Else it stays, and the log says why. Judged once a straggler. */
static int judge_straggler(dt_coord_t *c, dt_job_t *j, int r, double ratio)
{
  dt_rank_slot_t *s = &j->ranks[r];
  dt_node_t *nd = c->st.nodes[s->node];
  const Distrain__V1__ElasticSpec *el = j->job->spec->elastic;
  s->drain_judged = 1;
  if (nd->drained)
    return 0;
  const int dp = placeable_dp(c, j, 1, nd);
  char without[64] = "it cannot be placed without it";
  if (dp > 0)
    snprintf(without, sizeof without, "without it at dp %d of %d", dp, j->dp);
  if ((double)dp <= j->dp / ratio) {
    DT_WARN(COORD,
            "job %s: rank %d on %s (%s) has been a straggler for %d s (elastic.straggler_drain_s), "
            "%.1fx the median rank's compute; its node stays: the job runs at 1/%.1f of its pace "
            "with it, %s",
            j->id, r, nd->id, nd->info->hostname, el->straggler_drain_s, ratio, ratio, without);
    return 0;
  }
  char reason[256];
  snprintf(reason, sizeof reason,
           "straggler: rank %d of job %s, %.1fx the median rank's compute for %d s "
           "(elastic.straggler_drain_s); the job runs faster %s",
           r, j->id, ratio, el->straggler_drain_s, without);
  dt_coord_drain(c, nd, reason);
  return 1;
}

static void check_stragglers(dt_coord_t *c, dt_job_t *j)
{
  const double now = dt_coord_now_ms();
  if (j->world < 2 || j->job->state != DISTRAIN__V1__JOB_STATE__JOB_RUNNING ||
      now - j->straggle_checked_ms < 1000.0)
    return;
  j->straggle_checked_ms = now; /* also while ranks are missing: O(world) once a second */
  double *v = malloc((size_t)j->world * sizeof *v);
  if (!v)
    return;
  int n = 0;
  for (int r = 0; r < j->world; r++)
    if (j->ranks[r].compute_ms > 0)
      v[n++] = j->ranks[r].compute_ms;
  if (n < j->world) { /* every rank has reported a step */
    free(v);
    return;
  }
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  const double median = v[(n - 1) / 2];
  free(v);
  for (int r = 0; r < j->world; r++) {
    dt_rank_slot_t *s = &j->ranks[r];
    const dt_node_t *nd = c->st.nodes[s->node];
    if (s->compute_ms > STRAGGLER_FACTOR * median && s->compute_ms - median > 1.0) {
      if (++s->slow_checks >= STRAGGLER_CHECKS && !s->straggler) {
        s->straggler = 1;
        s->straggler_since_ms = now;
        s->drain_judged = 0;
        char cause[DT_CTL_SLOWED_MAX + 64] = "";
        slowed_gpu(nd, s->local_rank, cause, sizeof cause);
        DT_WARN(COORD,
                "job %s: rank %d on %s (%s) is a straggler: %.1f ms of compute per step, the "
                "median rank %.1f ms (reported, not restarted)%s",
                j->id, r, nd->id, nd->info->hostname, s->compute_ms, median, cause);
      }
      const int after_s = j->job->spec->elastic->straggler_drain_s;
      if (s->straggler && after_s > 0 && !s->drain_judged &&
          now - s->straggler_since_ms >= 1000.0 * after_s &&
          judge_straggler(c, j, r, s->compute_ms / median))
        return; /* its job is stopping */
    } else {
      s->slow_checks = 0;
      if (s->straggler && s->compute_ms < 1.2 * median) {
        s->straggler = 0;
        DT_INFO(COORD, "job %s: rank %d on %s is no longer a straggler (%.1f ms, median %.1f ms)",
                j->id, r, nd->id, s->compute_ms, median);
      }
    }
  }
}

void dt_coord_trainer_status(dt_coord_t *c, dt_node_t *n)
{
  int replan = 0;
  /* Cost per heartbeat: O(trainers on the node), independent of the job's world size. */
  for (size_t t = 0; t < n->n_trainers; t++) {
    const Distrain__V1__TrainerStatus *ts = n->trainers[t];
    dt_job_t *j = n->job >= 0 && (size_t)n->job < c->st.n_jobs &&
                          strcmp(c->st.jobs[n->job]->id, ts->job_id) == 0
                      ? c->st.jobs[n->job]
                      : dt_coord_job_by_id(&c->st, ts->job_id);
    if (!j)
      continue;
    const int terminal = dt_coord_state_terminal(j->job->state);
    if (ts->rank == 0 && ts->n_metrics && ts->generation < j->job->generation)
      merge_final_metrics(c, j, ts, j->resume_step);
    else if (ts->rank == 0 && ts->n_metrics && ts->generation == j->job->generation && terminal)
      merge_final_metrics(c, j, ts, INT64_MAX);
    if (ts->generation != j->job->generation || terminal || ts->rank < 0 || ts->rank >= j->world ||
        j->ranks[ts->rank].node != n->index)
      continue; /* stale generation, or not ours */
    dt_rank_slot_t *slot = &j->ranks[ts->rank];
    int changed = slot->state != ts->state;
    if (ts->step > slot->step && ts->compute_ms > 0) {
      slot->compute_ms =
          slot->compute_ms > 0 ? 0.7 * slot->compute_ms + 0.3 * ts->compute_ms : ts->compute_ms;
      check_stragglers(c, j);
    }
    slot_set_state(j, slot, ts->state);
    slot->step = ts->step;
    slot->report_age_ms = ts->report_age_ms;
    slot->heard_ms = dt_coord_now_ms();
    if (ts->progress) { /* sent once: keep the latest */
      if (slot->progress)
        distrain__v1__trainer_progress__free_unpacked(slot->progress, NULL);
      slot->progress = ts->progress;
      ((Distrain__V1__TrainerStatus *)ts)->progress = NULL; /* moved out of the node's copy */
      replan |= check_hang(c, j, ts->rank);
    }
    if (ts->rank == 0) {
      j->job->step = ts->step;
      j->job->loss = ts->loss;
      j->job->tokens_per_s = ts->tokens_per_s;
      append_metrics(c, j, ts);
      if (dt_coord_now_ms() - j->persisted_ms > 1000.0) {
        /* progress (step, loss): at most once a second, not once per heartbeat */
        j->persisted_ms = dt_coord_now_ms();
        dt_coord_store_put_job(c->store, j);
      }
    }
    if (ts->n_skipped_in_place)
      note_skipped_in_place(c, j, ts, n->id);
    /* Stopped by its agent while its job runs: its node is drained or its agent is leaving. */
    const int stopped = ts->state == DISTRAIN__V1__TRAINER_STATE__TRAINER_STOPPED;
    if (ts->state == DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED || stopped) {
      char reason[512];
      if (ts->term_signal)
        snprintf(reason, sizeof reason, "rank %d on %s was killed by signal %d%s%s", ts->rank,
                 n->id, ts->term_signal, ts->last_error[0] ? ": " : "", ts->last_error);
      else
        snprintf(reason, sizeof reason, "rank %d on %s exited with code %d%s%s", ts->rank, n->id,
                 ts->exit_code, ts->last_error[0] ? ": " : "", ts->last_error);
      if (!stopped &&
          (ts->input_error || (ts->exit_code == DT_TRAIN_EXIT_INPUT && !ts->term_signal))) {
        /* Its input is at fault (exit 2: options the trainer refuses): a restart would fail
         * the same way, so the job fails now rather than after max_restarts tries. */
        dt_coord_job_transition(c, j, DISTRAIN__V1__JOB_STATE__JOB_FAILED,
                                "%s (the job's input or configuration: not restarted)", reason);
        dt_coord_release_nodes(c, j);
        replan = 1;
        continue;
      }
      const int saved = ts->exit_code == DT_TRAIN_EXIT_STOPPED && !ts->term_signal;
      if (saved || stopped) {
        /* Asked to stop (SIGTERM: its node preempted or drained, its job preempted by one of
         * higher priority, its agent stopped), after a step all ranks saved: the others stop
         * after it too. One its agent stopped is no failure either when it did not save in time
         * (killed after the agent's grace period): the operator's doing. */
        const int preempted = j->preempted_by[0] != '\0';
        if (n->drained || preempted || !saved) {
          const size_t len = strlen(reason);
          if (preempted)
            snprintf(reason + len, sizeof reason - len, " (preempted by %s)", j->preempted_by);
          else
            snprintf(reason + len, sizeof reason - len, " (%s)",
                     n->drained ? "its node is being drained" : "stopped by its agent");
        }
        recover(c, j, preempted ? DT_RESTART_PREEMPTED : DT_RESTART_STOPPED, reason);
        replan = 1;
        continue;
      }
      if (ts->nonfinite_step > 0) {
        /* Roll back: the next generation resumes from the last checkpoint and takes this step
         * (a spike's: elastic.spike_skip steps from it, within the run) without an update.
         * Every rank stops at the same step; the first report decides. */
        const int64_t s = ts->nonfinite_step, last = j->job->spec->training->steps;
        const int spike = ts->loss_spike || ts->grad_spike;
        const int64_t nskip =
            spike ? DT_MAX(1, DT_MIN(j->job->spec->elastic->spike_skip, last - s + 1)) : 1;
        skip_steps_later(j, s, nskip);
        char skips[96] = "that step's batch";
        if (nskip > 1)
          snprintf(skips, sizeof skips, "the batches of steps %lld-%lld (elastic.spike_skip)",
                   (long long)s, (long long)(s + nskip - 1));
        snprintf(reason, sizeof reason,
                 "rank %d on %s: %s of step %lld %s; rolling back, %s will be skipped (%zu step%s "
                 "skipped so far)",
                 ts->rank, n->id,
                 ts->loss_spike   ? "the loss"
                 : ts->grad_spike ? "the gradient norm"
                                  : "the loss or gradient norm",
                 (long long)s,
                 ts->loss_spike   ? "spiked (over elastic.spike_factor x the recent steps' average)"
                 : ts->grad_spike ? "spiked (over elastic.grad_spike_factor x the recent steps' "
                                    "average)"
                                  : "was non-finite",
                 skips, j->job->n_skipped_steps, j->job->n_skipped_steps == 1 ? "" : "s");
      } else if (strstr(ts->last_error, "DT_EREMOTE") && !ts->term_signal) {
        /* Its peer failed first: wait for the peer's node to be declared dead (one heartbeat
         * window) rather than re-planning onto it and restarting twice. */
        if (!j->blame_deadline_ms) {
          j->blame_deadline_ms =
              dt_coord_now_ms() + (double)c->cfg.heartbeat_ms * (c->cfg.dead_after_missed + 1);
          snprintf(j->blame_reason, sizeof j->blame_reason, "%s", reason);
          DT_INFO(COORD, "job %s: %s; waiting for the failed peer's node before recovering", j->id,
                  reason);
        }
        continue;
      }
      recover(c, j,
              ts->nonfinite_step <= 0 ? DT_RESTART_TRAINER_FAILED
              : ts->loss_spike        ? DT_RESTART_LOSS_SPIKE
              : ts->grad_spike        ? DT_RESTART_GRAD_SPIKE
                                      : DT_RESTART_NONFINITE,
              reason);
      replan = 1;
    } else if (changed) {
      evaluate_job(c, j);
    }
  }
  /* A recovering job's nodes are healthy and idle again: re-plan it now (nothing else would
   * until some node registers, dies or finishes a job). */
  if (replan)
    dt_coord_schedule(c);
}

void dt_coord_blame_expired(dt_coord_t *c)
{
  const double now = dt_coord_now_ms();
  int replan = 0;
  for (size_t i = 0; i < c->st.n_jobs; i++) {
    dt_job_t *j = c->st.jobs[i];
    if (j->blame_deadline_ms > 0 && now >= j->blame_deadline_ms) {
      recover(c, j, DT_RESTART_TRAINER_FAILED, j->blame_reason);
      replan = 1;
    }
  }
  if (replan)
    dt_coord_schedule(c);
}

/* ------------------------------------------------------------------------------------------ */
/* Checkpoints                                                                                 */
/* ------------------------------------------------------------------------------------------ */

/* Steps of one generation waiting for shards at once. Each writer has at most one save in
 * flight, so writers a save apart leave two; more is a trainer reporting steps it never
 * finishes, which would otherwise grow without bound. */
#define MAX_PENDING_CKPTS 8

/* Drops the pending steps of generations before gen, whose writers are gone: no report of
 * theirs is taken any more (handlers.c takes the current generation's only). */
static void drop_stale_ckpts(dt_coord_t *c, dt_job_t *j, uint64_t gen)
{
  for (size_t i = j->n_ckpts; i-- > 0;) {
    dt_ckpt_pending_t *p = &j->ckpts[i];
    if (p->generation >= gen)
      continue;
    dt_coord_store_drop_ckpt_reports(c->store, j->id, p->step, p->step);
    dt_ckpt_pending_free(p);
    *p = j->ckpts[--j->n_ckpts];
  }
}

/* Every writer of p has reported, and the step cannot be saved for lack of space (error: a
 * writer could not write its shard, or this coordinator its manifest): it is not committed, and
 * the shards written for it are deleted, for they take the space the next save needs. The
 * trainers train on; the job shows why until a later step commits. */
static void abandon_ckpt(dt_coord_t *c, dt_job_t *j, dt_ckpt_pending_t *p, const char *error,
                         int restore)
{
  const int64_t step = p->step;
  char why[768];
  snprintf(why, sizeof why, "step %lld not saved: %s", (long long)step, error);
  dt_utf8_sanitize(why);
  dt_ckpt_discard(j->job->spec->checkpoint->dir, step);
  DT_WARN(COORD, "job %s: checkpoint %s; it trains on from its last committed step %lld", j->id,
          why, (long long)j->job->committed_step);
  dt_coord_event(c, j->id, 1, "checkpoint %s", why);
  set_string(&j->job->checkpoint_error, why);
  j->ckpt_failures++;
  if (!restore)
    dt_coord_store_drop_ckpt_reports(c->store, j->id, step, step);
  dt_coord_store_put_job(c->store, j);
  dt_ckpt_pending_free(p);
  *p = j->ckpts[--j->n_ckpts];
}

int dt_coord_checkpoint_report(dt_coord_t *c, dt_job_t *j, int restore,
                               const Distrain__V1__ReportCheckpointRequest *r, int *committed,
                               char *err, size_t errlen)
{
  *committed = 0;
  if (r->world < 1 || r->rank < 0 || r->rank >= r->world || r->world > 1 << 20 || r->step < 1) {
    snprintf(err, errlen, "invalid report: rank %d of world %d, step %lld", r->rank, r->world,
             (long long)r->step);
    return DT_EINVAL;
  }
  /* A report repeated after a coordinator restart, of a step since committed: done already. */
  if (r->step <= j->job->committed_step)
    return 0;
  if (!restore) {
    /* The writers are some of the current generation's ranks (a restored report may be an
     * older generation's, of another world). */
    if (r->world > j->world) {
      snprintf(err, errlen, "step %lld: a report of %d writers, but the job has %d ranks",
               (long long)r->step, r->world, j->world);
      return DT_EINVAL;
    }
    drop_stale_ckpts(c, j, r->generation);
  }
  dt_ckpt_pending_t *p = NULL;
  for (size_t i = 0; i < j->n_ckpts; i++)
    if (j->ckpts[i].step == r->step)
      p = &j->ckpts[i];
  if (p && p->generation != r->generation) {
    /* Left by a generation that failed before committing the step: start over. */
    dt_ckpt_pending_free(p);
    *p = j->ckpts[--j->n_ckpts];
    p = NULL;
    dt_coord_store_drop_ckpt_reports(c->store, j->id, r->step, r->step);
  }
  if (!p && !restore && j->n_ckpts >= MAX_PENDING_CKPTS) {
    snprintf(err, errlen, "step %lld: %zu earlier steps still wait for shards (at most %d)",
             (long long)r->step, j->n_ckpts, MAX_PENDING_CKPTS);
    return DT_EINVAL;
  }
  if (!p) {
    dt_ckpt_pending_t *grown = realloc(j->ckpts, (j->n_ckpts + 1) * sizeof *grown);
    if (!grown)
      return DT_ENOMEM;
    j->ckpts = grown;
    p = &j->ckpts[j->n_ckpts++];
    memset(p, 0, sizeof *p);
    p->step = r->step;
    p->world = r->world;
    p->generation = r->generation;
    p->first_ms = dt_coord_now_ms();
    p->reports = calloc((size_t)r->world, sizeof *p->reports);
    if (!p->reports)
      return DT_ENOMEM;
  }
  if (r->world != p->world) {
    snprintf(err, errlen, "step %lld: world %d disagrees with earlier reports (%d)",
             (long long)r->step, r->world, p->world);
    return DT_EINVAL;
  }
  if (!p->reports[r->rank]) {
    /* Kept in the store first: a restarted coordinator still has it (the writer does not
     * report again once this call has succeeded). */
    int rc = restore ? 0 : dt_coord_store_put_ckpt_report(c->store, j->id, r);
    if (rc != 0) {
      snprintf(err, errlen, "step %lld: cannot record rank %d's report: %s", (long long)r->step,
               r->rank, dt_strerror(rc));
      return rc == DT_EIO ? DT_EUNAVAIL : rc; /* the store failed: worth trying again */
    }
    p->reports[r->rank] = dt_pb_copy(&r->base);
    if (!p->reports[r->rank])
      return DT_ENOMEM;
    p->received++;
  }
  if (p->received < p->world)
    return 0;
  for (int k = 0; k < p->received; k++) /* received == world: every report is in */
    if (p->reports[k]->error[0]) {
      abandon_ckpt(c, j, p, p->reports[k]->error, restore);
      *committed = -1;
      return 0;
    }
  /* Every shard is in: write the manifest, which commits the step. */
  dt_ckpt_shard_info_t *shards = calloc((size_t)p->world, sizeof *shards);
  if (!shards)
    return DT_ENOMEM;
  int64_t num_params = 0;
  for (int k = 0; k < p->world; k++) {
    const Distrain__V1__ReportCheckpointRequest *q = p->reports[k];
    shards[k].rank = q->rank;
    shards[k].lo = q->lo;
    shards[k].hi = q->hi;
    shards[k].bytes = q->bytes;
    shards[k].crc32c = q->crc32c;
    snprintf(shards[k].name, sizeof shards[k].name, "%s", q->name);
    num_params = DT_MAX(num_params, q->hi);
  }
  const char *dir = j->job->spec->checkpoint->dir;
  int rc = dt_ckpt_commit(dir, p->step, num_params, p->world, shards);
  free(shards);
  if (rc == DT_ENOSPC) {
    char why[600];
    snprintf(why, sizeof why,
             "the coordinator could not write its manifest: no space left on device in %s", dir);
    abandon_ckpt(c, j, p, why, restore);
    *committed = -1;
    return 0;
  }
  dt_ckpt_pending_free(p);
  int64_t step = p->step;
  const double first_ms = p->first_ms;
  *p = j->ckpts[--j->n_ckpts];
  if (rc != 0) {
    /* The step is abandoned: the writer that completed it fails, its generation restarts from
     * the last committed step and writes this one again. Its reports leave the store too, or
     * a restarted coordinator would try this commit again (a restore keeps them: it cannot
     * delete the rows it is reading, and trying again at the next start is harmless). */
    snprintf(err, errlen, "writing the manifest of step %lld failed: %s", (long long)step,
             dt_strerror(rc));
    dt_coord_event(c, j->id, 1, "checkpoint step %lld not committed: %s", (long long)step, err);
    if (!restore)
      dt_coord_store_drop_ckpt_reports(c->store, j->id, step, step);
    return rc;
  }
  if (step > j->job->committed_step)
    j->job->committed_step = step;
  set_string(&j->job->checkpoint_error, "");
  j->ckpt_seconds = (dt_coord_now_ms() - first_ms) / 1000.0;
  j->ckpt_wall_ms = dt_wall_ms();
  j->job->committed_ms = (int64_t)j->ckpt_wall_ms;
  dt_coord_store_put_job(c->store, j);
  dt_coord_store_drop_ckpt_reports(c->store, j->id, 0, step);
  *committed = 1;
  maybe_grow(c, j);
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Freeing                                                                                     */
/* ------------------------------------------------------------------------------------------ */
