/* coord.c — coordinator lifecycle: open the state, serve RPCs, watch node liveness.
 *
 * The liveness timer runs every DT_PARAM LivenessScanMs (100 ms): a node silent for
 * heartbeat_ms x dead_after_missed is declared dead, so detection takes at most that plus one
 * scan interval (plus any time the loop itself was stalled: see on_liveness). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord.h"
#include "ctl.h"
#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"

DT_PARAM(LivenessScanMs, "LIVENESS_SCAN_MS", 100)
/* After a restart, the nodes restored from the state get at least this long to reach the new
 * coordinator: their agents must notice the restart and reconnect, backing off up to
 * RPC_RECONNECT_MAX_MS (1 s) between attempts, before their next heartbeat can arrive. */
DT_PARAM(RestartGraceMs, "RESTART_GRACE_MS", 3000)
/* A leaving node's agent sends no heartbeat while its trainers save their step (it says
 * goodbye once they have): declared dead only after this long silent, so that a long save is
 * not cut short by a new generation. */
DT_PARAM(LeavingSilenceMs, "LEAVING_SILENCE_MS", 30000)

static double g_clock_skew_ms; /* dt_coord_clock_advance */

double dt_coord_now_ms(void)
{
  return dt_now_ms() + g_clock_skew_ms;
}

void dt_coord_clock_advance(double ms)
{
  g_clock_skew_ms += ms;
}

void dt_coord_event(dt_coord_t *c, const char *job, int warn, const char *fmt, ...)
{
  dt_coord_event_t *e = &c->events[c->n_events++ % DT_COORD_EVENTS];
  e->wall_ms = dt_wall_ms();
  e->warn = warn;
  snprintf(e->job, sizeof e->job, "%s", job ? job : "");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->text, sizeof e->text, fmt, ap);
  va_end(ap);
  dt_utf8_sanitize(e->text); /* what was cut short may end inside a character */
}

int dt_coord_resync(dt_coord_t *c, int force)
{
  if (!dt_coord_store_unsynced(c->store))
    return 0;
  const double now = dt_coord_now_ms();
  if (!force && now - c->last_resync_ms < 2000.0)
    return DT_EIO;
  c->last_resync_ms = now;
  dt_coord_store_retry(c->store);
  dt_coord_store_begin(c->store);
  for (size_t i = 0; i < c->st.n_nodes; i++)
    if (c->st.nodes[i])
      dt_coord_store_put_node(c->store, c->st.nodes[i]);
  for (size_t i = 0; i < c->st.n_jobs; i++) {
    const dt_job_t *j = c->st.jobs[i];
    const Distrain__V1__Job *job = j->job;
    dt_coord_store_put_job(c->store, j);
    dt_coord_store_drop_metrics(c->store, j->id, INT64_MIN); /* steps replayed meanwhile too */
    dt_coord_store_put_metrics(c->store, j->id, j->metrics, j->n_metrics);
    dt_coord_store_expire_kv(c->store, j->id,
                             dt_coord_state_terminal(job->state) ? UINT64_MAX : job->generation);
    dt_coord_store_drop_ckpt_reports(c->store, j->id, 0, job->committed_step);
  }
  int rc = dt_coord_store_commit(c->store);
  if (rc == 0)
    DT_INFO(COORD, "the state store is writable again: %zu nodes and %zu jobs rewritten",
            c->st.n_nodes, c->st.n_jobs);
  return rc;
}

size_t dt_coord_stopping_nodes(const dt_coord_t *c)
{
  size_t n = 0;
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    const dt_node_t *nd = c->st.nodes[i];
    if (!nd || nd->state != DISTRAIN__V1__NODE_STATE__NODE_ALIVE)
      continue;
    int running = 0;
    for (size_t k = 0; k < nd->n_trainers; k++)
      running |= dt_ctl_trainer_active(nd->trainers[k]);
    n += nd->leaving || (nd->drained && running);
  }
  return n;
}

size_t dt_coord_running_jobs(const dt_coord_t *c)
{
  size_t n = 0;
  for (size_t i = 0; i < c->st.n_jobs; i++)
    n += c->st.jobs[i]->job->state == DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS ||
         c->st.jobs[i]->job->state == DISTRAIN__V1__JOB_STATE__JOB_RUNNING;
  return n;
}

void dt_coord_summary(const dt_coord_t *c, char *buf, size_t len)
{
  size_t alive = 0, dead = 0, running = 0, waiting = 0, off = 0;
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    if (c->st.nodes[i] && c->st.nodes[i]->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE)
      alive++;
    else if (c->st.nodes[i])
      dead++;
  }
  for (size_t i = 0; i < c->st.n_jobs; i++) {
    const Distrain__V1__JobState s = c->st.jobs[i]->job->state;
    running += s == DISTRAIN__V1__JOB_STATE__JOB_RUNNING;
    waiting += !dt_coord_state_terminal(s) && s != DISTRAIN__V1__JOB_STATE__JOB_RUNNING;
  }
#define ADD(...)                                                                                   \
  do {                                                                                             \
    if (off < len)                                                                                 \
      off += (size_t)snprintf(buf + off, len - off, __VA_ARGS__);                                  \
  } while (0)
  ADD("%zu node%s", alive, alive == 1 ? "" : "s");
  if (dead)
    ADD(" (%zu dead)", dead);
  ADD(", %zu job%s running", running, running == 1 ? "" : "s");
  /* The first few running jobs by name, with their step: what an operator looks for. */
  int shown = 0;
  for (size_t i = 0; i < c->st.n_jobs && shown < 3; i++) {
    const Distrain__V1__Job *job = c->st.jobs[i]->job;
    if (job->state != DISTRAIN__V1__JOB_STATE__JOB_RUNNING)
      continue;
    ADD("%s%s step %lld", shown ? ", " : " (", c->st.jobs[i]->id, (long long)job->step);
    shown++;
  }
  if (shown)
    ADD("%s)", running > (size_t)shown ? ", ..." : "");
  if (waiting)
    ADD(", %zu waiting or recovering", waiting);
#undef ADD
}

void dt_coord_liveness_scan(dt_coord_t *c)
{
  const double limit = (double)c->cfg.heartbeat_ms * c->cfg.dead_after_missed;
  const double leaving_limit = (double)dt_param_LeavingSilenceMs();
  const double now = dt_coord_now_ms();
  /* libuv runs timers before the I/O that queued up while the loop was busy: after a stall
   * (planning and answering a 10,000-rank job, a slow disk) the heartbeats that arrived
   * meanwhile are not handled yet. Credit every node with the time this scan is late, so a
   * busy coordinator does not declare healthy nodes dead (a dead one is found that much
   * later: it could not have been seen during the stall anyway). */
  const double late = c->last_scan_ms > 0 ? now - c->last_scan_ms - c->scan_ms : 0;
  c->last_scan_ms = now;
  int in_txn = 0;
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    dt_node_t *n = c->st.nodes[i];
    if (n && late > c->scan_ms)
      n->last_seen_ms += late;
    if (n && n->watch && now >= n->watch_deadline_ms)
      dt_coord_notify_node(c, n); /* nothing changed: answered with the same version */
    if (n && n->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE &&
        now - n->last_seen_ms > (n->leaving ? DT_MAX(limit, leaving_limit) : limit)) {
      if (!in_txn) { /* many deaths in one scan: one transaction, not one per node */
        dt_coord_store_begin(c->store);
        in_txn = 1;
      }
      dt_coord_node_dead(c, n);
    }
  }
  if (in_txn)
    dt_coord_store_commit(c->store);
  dt_coord_blame_expired(c);
  dt_coord_resync(c, 0);
}

static void on_liveness(uv_timer_t *t)
{
  dt_coord_liveness_scan(t->data);
}

static void on_sched(uv_timer_t *t)
{
  dt_coord_t *c = t->data;
  dt_coord_schedule(c);
  /* Committed by now (every transaction ends within the callback that began it). */
  if (!c->notify_pending)
    return;
  c->notify_pending = 0;
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    dt_node_t *n = c->st.nodes[i];
    if (n && n->notify_pending) {
      n->notify_pending = 0;
      dt_coord_notify_node(c, n);
    }
  }
}

void dt_coord_schedule_soon(dt_coord_t *c)
{
  if (!c->closing && !uv_is_active((uv_handle_t *)&c->sched))
    uv_timer_start(&c->sched, on_sched, 0, 0);
}

/* The store under the key-value store and the load (neither knows the other). */
static int kv_persist(void *ud, const char *job, uint64_t gen, const char *key, const uint8_t *val,
                      size_t len)
{
  return dt_coord_store_put_kv(ud, job, gen, key, val, len);
}

static void kv_persist_expire(void *ud, const char *job, uint64_t gen)
{
  dt_coord_store_expire_kv(ud, job, gen);
}

static int load_kv(void *ud, const char *job, uint64_t gen, const char *key, const uint8_t *val,
                   size_t len)
{
  dt_coord_t *c = ud;
  return dt_coord_kv_restore(c->kv, job, gen, key, val, len);
}

static int load_ckpt_report(void *ud, dt_job_t *j, const Distrain__V1__ReportCheckpointRequest *r)
{
  dt_coord_t *c = ud;
  char err[256];
  int committed;
  int ret = dt_coord_checkpoint_report(c, j, 1, r, &committed, err, sizeof err);
  if (ret == DT_ENOMEM)
    return ret;
  /* Any other failure is the step's own (its manifest cannot be written: the directory is
   * gone, the disk is full): that step stays uncommitted, and the coordinator still starts. */
  if (ret != 0)
    DT_ERROR(COORD, "job %s: restoring a checkpoint report: %s", j->id, err);
  return 0;
}

int dt_coord_start(dt_coord_t *c, uv_loop_t *loop, const dt_coord_config_t *cfg)
{
  int ret;
  memset(c, 0, sizeof *c);
  c->loop = loop;
  c->cfg = *cfg;
  c->st.next_job = 1;
  DT_CHECK(dt_coord_store_open(&c->store, cfg->state_dir));
  const dt_coord_kv_persist_t persist = {kv_persist, kv_persist_expire, c->store};
  c->kv = dt_coord_kv_create(&persist);
  if (!c->kv) {
    ret = DT_ENOMEM;
    goto fail;
  }
  const dt_coord_store_loaders_t loaders = {load_kv, load_ckpt_report, c};
  DT_CHECK_GOTO(dt_coord_store_load(c->store, &c->st, dt_coord_now_ms(), &loaders), ret, fail);
  for (size_t i = 0; i < c->st.n_jobs; i++) {
    /* A restarted coordinator resumes its jobs as they were; the trainers never stopped. */
    Distrain__V1__Job *job = c->st.jobs[i]->job;
    if (!dt_coord_state_terminal(job->state))
      DT_INFO(COORD, "restored job %s: state %d, generation %llu, step %lld", c->st.jobs[i]->id,
              job->state, (unsigned long long)job->generation, (long long)job->step);
  }
  if (c->st.n_nodes)
    DT_INFO(COORD, "restored %zu nodes and %zu jobs from %s", c->st.n_nodes, c->st.n_jobs,
            cfg->state_dir);
  /* dt_coord_store_load gave every node one dead-interval from now; stretch it to the grace. */
  const double extra = DT_MAX(0.0, (double)dt_param_RestartGraceMs() -
                                       (double)cfg->heartbeat_ms * cfg->dead_after_missed);
  for (size_t i = 0; i < c->st.n_nodes; i++)
    if (c->st.nodes[i])
      c->st.nodes[i]->last_seen_ms += extra;
  DT_CHECK_GOTO(dt_rpc_server_create(loop, cfg->listen, cfg->token,
                                     &distrain__v1__coordinator__descriptor, &c->rpc),
                ret, fail);
  DT_CHECK_GOTO(dt_coord_register_handlers(c), ret, fail_rpc);
  DT_CHECK_GOTO(dt_rpc_server_start(c->rpc, &c->port), ret, fail_rpc);
  c->start_wall_ms = dt_wall_ms();
  if (cfg->http) {
    ret = dt_http_start(loop, cfg->http, dt_coord_http, c, &c->http, &c->http_port);
    if (ret != 0 && !cfg->http_optional)
      goto fail_rpc;
    if (ret != 0)
      DT_WARN(COORD,
              "no /metrics: cannot serve HTTP on %s (%s); set --http to another address "
              "or off",
              cfg->http, dt_strerror(ret));
    else
      DT_INFO(COORD, "serving /metrics on %s (port %d)", cfg->http, c->http_port);
  }
  uv_timer_init(loop, &c->liveness);
  c->liveness.data = c;
  uint64_t scan = (uint64_t)DT_MAX(10, dt_param_LivenessScanMs());
  c->scan_ms = (double)scan;
  c->last_scan_ms = dt_coord_now_ms();
  uv_timer_start(&c->liveness, on_liveness, scan, scan);
  uv_timer_init(loop, &c->sched);
  c->sched.data = c;
  /* Restored jobs that wait (PENDING, or RECOVERING with their nodes released) are planned
   * now: the last coordinator may have died before it did, and nothing else would until a
   * node registers, dies or finishes a job. */
  dt_coord_schedule_soon(c);
  return 0;
fail_rpc:
  dt_rpc_server_close(c->rpc, NULL, NULL);
  c->rpc = NULL;
fail:
  dt_coord_store_close(c->store);
  dt_coord_kv_destroy(c->kv);
  dt_coord_state_free(&c->st);
  return ret;
}

/* Shutdown order: stop taking calls (their cancel callbacks forget held calls), then free
 * state once the timers and the HTTP server have closed. */
typedef struct {
  dt_coord_t *c;
  void (*cb)(void *);
  void *ud;
  size_t pending;
} close_ctx_t;

static void finish_close(close_ctx_t *x)
{
  dt_coord_t *c = x->c;
  dt_coord_state_free(&c->st);
  dt_coord_store_close(c->store);
  void (*cb)(void *) = x->cb;
  void *ud = x->ud;
  free(x);
  if (cb)
    cb(ud);
}

static void on_handle_closed(uv_handle_t *h)
{
  close_ctx_t *x = h->data; /* every handle closed at shutdown points at the context */
  if (--x->pending == 0)
    finish_close(x);
}

static void on_http_closed(void *ud)
{
  close_ctx_t *x = ud;
  if (--x->pending == 0)
    finish_close(x);
}

static void on_rpc_closed(void *ud)
{
  close_ctx_t *x = ud;
  dt_coord_t *c = x->c;
  dt_coord_kv_destroy(c->kv);
  c->kv = NULL;
  dt_coord_logs_close(c);
  x->pending = 2;
  if (c->http) {
    x->pending++;
    dt_http_close(c->http, on_http_closed, x);
    c->http = NULL;
  }
  c->liveness.data = x;
  uv_close((uv_handle_t *)&c->liveness, on_handle_closed);
  c->sched.data = x;
  uv_close((uv_handle_t *)&c->sched, on_handle_closed);
}

void dt_coord_close(dt_coord_t *c, void (*cb)(void *ud), void *ud)
{
  close_ctx_t *x = calloc(1, sizeof *x);
  if (!x)
    return;
  x->c = c, x->cb = cb, x->ud = ud;
  c->closing = 1;
  uv_timer_stop(&c->liveness);
  uv_timer_stop(&c->sched);
  dt_rpc_server_close(c->rpc, on_rpc_closed, x);
}
