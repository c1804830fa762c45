/* logrelay.c — GetLogs: trainer logs of any node, relayed through its agent.
 *
 * Agents only dial out, so the coordinator cannot call them. A GetLogs call is held as a
 * log wait: a LogRequest for the node that holds the rank, handed to its agent in the answer
 * to its held WatchAssignment (answered at once) or to its next one. The agent reads its own
 * file (it maps job and rank to a path itself) and sends the bytes back with PutLogs; the wait
 * then replies to the held GetLogs. A wait ends exactly once: answered (PutLogs), timed out
 * (DEADLINE_EXCEEDED: the agent did not answer), failed (the node died, UNAVAILABLE) or
 * cancelled (the client went away; its cancel callback forgets it). Every other path clears the
 * call's cancel callback before answering, as the other held calls do (handlers.c, kv.c).
 *
 * Bounds: at most LOGS_MAX_PER_NODE waits per node, DT_LOGS_MAX_CHUNK bytes per answer, and
 * LOGS_MAX_WAIT_MS of waiting for new bytes per call. */
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"
#include "logs.h"

/* How long an agent has to answer a log request beyond the reader's own wait. */
DT_PARAM(LogsAnswerMs, "LOGS_ANSWER_MS", 10000)

#define LOGS_MAX_PER_NODE 8
#define LOGS_MAX_WAIT_MS  60000u

struct dt_log_wait {
  dt_log_wait_t *next, **pprev;
  dt_coord_t *c;
  dt_rpc_call_t *call;
  int node;                     /* index into c->st.nodes */
  int sent;                     /* handed to the agent in a watch answer */
  Distrain__V1__LogRequest req; /* req.job_id owned */
  uv_timer_t timer;
};

/* ------------------------------------------------------------------------------------------ */
/* Waits                                                                                       */
/* ------------------------------------------------------------------------------------------ */

static void wait_closed(uv_handle_t *h)
{
  dt_log_wait_t *w = h->data;
  free(w->req.job_id);
  free(w);
}

/* Unlinks a wait and releases it (its call must already be answered or cancelled). */
static void wait_done(dt_log_wait_t *w)
{
  *w->pprev = w->next;
  if (w->next)
    w->next->pprev = w->pprev;
  dt_node_t *n = w->c->st.nodes[w->node];
  n->n_log_waits--;
  uv_timer_stop(&w->timer);
  uv_close((uv_handle_t *)&w->timer, wait_closed);
}

/* Takes the call back from the wait so the caller can answer it; the wait is released. */
static dt_rpc_call_t *wait_take(dt_log_wait_t *w)
{
  dt_rpc_call_t *call = w->call;
  dt_rpc_call_on_cancel(call, NULL, NULL);
  wait_done(w);
  return call;
}

static void on_wait_cancel(dt_rpc_call_t *call, void *ud)
{
  (void)call;
  wait_done(ud);
}

static void on_wait_timeout(uv_timer_t *t)
{
  dt_log_wait_t *w = t->data;
  const dt_node_t *n = w->c->st.nodes[w->node];
  const uint64_t id = w->req.request_id;
  const int rank = w->req.rank, sent = w->sent;
  char job[64];
  snprintf(job, sizeof job, "%s", w->req.job_id);
  dt_rpc_call_t *call = wait_take(w);
  DT_WARN(COORD, "log request %llu (job %s rank %d) to node %s timed out (%s)",
          (unsigned long long)id, job, rank, n->id,
          sent ? "handed to the agent, no answer" : "the agent did not poll");
  dt_rpc_call_fail(call, DT_RPC_DEADLINE_EXCEEDED,
                   "node %s (%s) did not send the log of job %s rank %d in time (%s); try again",
                   n->id, n->info->hostname, job, rank,
                   sent ? "it was asked but did not answer"
                        : "its agent has not polled the coordinator");
}

static dt_log_wait_t *find_wait(dt_coord_t *c, uint64_t id)
{
  for (dt_log_wait_t *w = c->log_waits; w; w = w->next)
    if (w->req.request_id == id)
      return w;
  return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* GetLogs                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* The node holding the rank's log, or NULL after failing the call. */
static dt_node_t *log_node(dt_coord_t *c, dt_rpc_call_t *call, const dt_job_t *j, int rank)
{
  const int idx = dt_coord_rank_node(j, rank);
  if (idx < 0 || (size_t)idx >= c->st.n_nodes || !c->st.nodes[idx]) {
    if (!j->ranks && j->n_rank_node == 0)
      dt_rpc_call_fail(call, DT_RPC_NOT_FOUND,
                       "job %s has not started on any node yet (%s): no logs", j->id,
                       j->job->reason ? j->job->reason : "pending");
    else
      dt_rpc_call_fail(call, DT_RPC_NOT_FOUND, "job %s has no rank %d (its ranks are 0 to %d)",
                       j->id, rank, DT_MAX(j->world, j->n_rank_node) - 1);
    return NULL;
  }
  dt_node_t *n = c->st.nodes[idx];
  if (n->state != DISTRAIN__V1__NODE_STATE__NODE_ALIVE) {
    dt_rpc_call_fail(call, DT_RPC_UNAVAILABLE,
                     "rank %d of job %s ran last on node %s (%s), which is dead: its log is out "
                     "of reach until the node comes back",
                     rank, j->id, n->id, n->info->hostname);
    return NULL;
  }
  if (n->n_log_waits >= LOGS_MAX_PER_NODE) {
    dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED,
                     "node %s already has %d log reads waiting; try again", n->id, n->n_log_waits);
    return NULL;
  }
  return n;
}

void dt_coord_get_logs(dt_coord_t *c, dt_rpc_call_t *call, const Distrain__V1__GetLogsRequest *req)
{
  dt_job_t *j = dt_coord_job_by_id(&c->st, req->job_id);
  if (!j) {
    dt_rpc_call_fail(call, DT_RPC_NOT_FOUND, "unknown job '%s'", req->job_id);
    return;
  }
  if (req->rank < 0) {
    dt_rpc_call_fail(call, DT_RPC_INVALID_ARGUMENT, "rank %d: ranks are >= 0", req->rank);
    return;
  }
  dt_node_t *n = log_node(c, call, j, req->rank);
  if (!n)
    return;
  dt_log_wait_t *w = calloc(1, sizeof *w);
  if (w)
    distrain__v1__log_request__init(&w->req);
  if (!w || !(w->req.job_id = strdup(j->id))) {
    free(w);
    dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  w->c = c;
  w->call = call;
  w->node = n->index;
  w->req.request_id = ++c->next_log_id;
  w->req.rank = req->rank;
  /* The caller's offset is into the file on the node it read before: on another node (the
   * rank moved) the answer starts over from the beginning. */
  w->req.offset = req->node_id[0] && strcmp(req->node_id, n->id) != 0 ? 0 : req->offset;
  w->req.max_bytes = req->max_bytes ? DT_MIN(req->max_bytes, DT_LOGS_MAX_CHUNK) : DT_LOGS_MAX_CHUNK;
  w->req.wait_ms = DT_MIN(req->wait_ms, LOGS_MAX_WAIT_MS);
  w->req.final = dt_coord_state_terminal(j->job->state);
  /* Fail before the caller's deadline, so it hears why rather than its own timeout. */
  int64_t limit = (int64_t)w->req.wait_ms + dt_param_LogsAnswerMs();
  const int64_t left = dt_rpc_call_remaining_ms(call);
  if (left != INT64_MAX)
    limit = DT_MAX(1, DT_MIN(limit, left - 250));
  w->next = c->log_waits;
  w->pprev = &c->log_waits;
  if (c->log_waits)
    c->log_waits->pprev = &w->next;
  c->log_waits = w;
  n->n_log_waits++;
  uv_timer_init(c->loop, &w->timer);
  w->timer.data = w;
  uv_timer_start(&w->timer, on_wait_timeout, (uint64_t)limit, 0);
  dt_rpc_call_on_cancel(call, on_wait_cancel, w);
  DT_DEBUG(COORD, "log request %llu: job %s rank %d from %llu on node %s",
           (unsigned long long)w->req.request_id, j->id, req->rank,
           (unsigned long long)w->req.offset, n->id);
  /* No store transaction is open in a handler: the watch may be answered now (its assignments
   * are committed), as dt_coord_notify_node is from the scheduling pass. */
  dt_coord_notify_node(c, n);
}

int dt_coord_logs_unsent(const dt_coord_t *c, const dt_node_t *n)
{
  for (const dt_log_wait_t *w = c->log_waits; w; w = w->next)
    if (!w->sent && w->node == n->index)
      return 1;
  return 0;
}

int dt_coord_logs_attach(dt_coord_t *c, const dt_node_t *n,
                         Distrain__V1__WatchAssignmentResponse *r)
{
  if (!n->n_log_waits || !dt_coord_logs_unsent(c, n))
    return 0;
  Distrain__V1__LogRequest **reqs = calloc((size_t)n->n_log_waits, sizeof *reqs);
  if (!reqs)
    return DT_ENOMEM;
  size_t k = 0;
  for (dt_log_wait_t *w = c->log_waits; w && k < (size_t)n->n_log_waits; w = w->next) {
    if (w->sent || w->node != n->index)
      continue;
    w->sent = 1;
    reqs[k++] = &w->req;
  }
  r->log_requests = reqs;
  r->n_log_requests = k;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* PutLogs                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* The GetLogs answer from the agent's. */
static void answer(dt_coord_t *c, dt_rpc_call_t *call, const dt_node_t *n,
                   const Distrain__V1__PutLogsRequest *req)
{
  const dt_job_t *j = dt_coord_job_by_id(&c->st, req->job_id);
  const int ended = !j || dt_coord_state_terminal(j->job->state);
  if (req->error[0]) {
    dt_rpc_call_fail(call, DT_RPC_INTERNAL, "node %s (%s) could not read %s (job %s rank %d): %s",
                     n->id, n->info->hostname, req->path[0] ? req->path : "the log", req->job_id,
                     req->rank, req->error);
    return;
  }
  if (req->missing && ended) {
    dt_rpc_call_fail(call, DT_RPC_NOT_FOUND, "node %s (%s) has no log of job %s rank %d (%s)",
                     n->id, n->info->hostname, req->job_id, req->rank, req->path);
    return;
  }
  Distrain__V1__GetLogsResponse resp = DISTRAIN__V1__GET_LOGS_RESPONSE__INIT;
  resp.data = req->data;
  resp.offset = req->offset;
  resp.next_offset = req->offset + req->data.len;
  resp.size = req->size;
  resp.eof = resp.next_offset >= req->size;
  resp.complete = resp.eof && ended && !req->writing;
  resp.node_id = (char *)n->id;
  resp.hostname = n->info->hostname;
  resp.path = req->path;
  dt_rpc_call_reply(call, &resp.base);
}

void dt_coord_put_logs(dt_coord_t *c, dt_rpc_call_t *call, const Distrain__V1__PutLogsRequest *req)
{
  Distrain__V1__PutLogsResponse ok = DISTRAIN__V1__PUT_LOGS_RESPONSE__INIT;
  dt_log_wait_t *w = find_wait(c, req->request_id);
  dt_node_t *n = w ? c->st.nodes[w->node] : NULL;
  if (!w || strcmp(n->id, req->node_id) != 0 || !w->sent) {
    /* The reader gave up (timeout, cancel) or this is not the node it asked: nothing to do. */
    DT_DEBUG(COORD, "late or stray log answer %llu from %s", (unsigned long long)req->request_id,
             req->node_id);
    dt_rpc_call_reply(call, &ok.base);
    return;
  }
  const int too_big = req->data.len > w->req.max_bytes;
  dt_rpc_call_t *reader = wait_take(w);
  if (too_big) {
    dt_rpc_call_fail(reader, DT_RPC_INTERNAL,
                     "node %s sent %zu bytes of log, more than the %u asked", n->id, req->data.len,
                     (unsigned)DT_LOGS_MAX_CHUNK);
    dt_rpc_call_fail(call, DT_RPC_INVALID_ARGUMENT, "more log bytes than asked for");
    return;
  }
  answer(c, reader, n, req);
  dt_rpc_call_reply(call, &ok.base);
}

/* ------------------------------------------------------------------------------------------ */
/* Nodes going away, shutdown                                                                  */
/* ------------------------------------------------------------------------------------------ */

void dt_coord_logs_node_gone(dt_coord_t *c, dt_node_t *n, int sent_only, const char *why)
{
  for (dt_log_wait_t *w = c->log_waits, *next; w; w = next) {
    next = w->next;
    if (w->node != n->index || (sent_only && !w->sent))
      continue;
    const int rank = w->req.rank;
    char job[64];
    snprintf(job, sizeof job, "%s", w->req.job_id);
    dt_rpc_call_fail(wait_take(w), DT_RPC_UNAVAILABLE,
                     "node %s (%s), which holds the log of job %s rank %d: %s", n->id,
                     n->info->hostname, job, rank, why);
  }
}

void dt_coord_logs_close(dt_coord_t *c)
{
  while (c->log_waits)
    dt_rpc_call_fail(wait_take(c->log_waits), DT_RPC_UNAVAILABLE, "coordinator shutting down");
}
