/* link.c — see link.h. */
#include "link.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "distrain.pb-c.h"
#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"
#include "rpc.h"

DT_PARAM(CkptReportTimeoutMs, "CKPT_REPORT_TIMEOUT_MS", 30000)
DT_PARAM(ProgressMs, "PROGRESS_MS", 1000)

#define MAX_COMMS 16 /* communicators in one progress report (a trainer has at most 6) */

struct dt_link {
  pthread_mutex_t lock; /* status_fd and writes to it: the main and the health thread */
  int status_fd;        /* -1 when no agent */
  pthread_t health;     /* sends progress every ProgressMs, whatever the main thread does */
  pthread_cond_t wake;  /* stops it */
  int health_on, stopping;
  dt_rpc_client_t *coord; /* NULL when no coordinator */
  char job_id[64];
  uint64_t generation;
};

static void *health_main(void *arg);

static uint64_t peak_rss_bytes(void)
{
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (uint64_t)ru.ru_maxrss * 1024u;
}

int dt_link_open(dt_link_t **out)
{
  *out = NULL;
  const char *fd = getenv("DISTRAIN_STATUS_FD"), *coord = getenv("DISTRAIN_COORDINATOR");
  const char *agent = getenv("DISTRAIN_AGENT_PID");
  int64_t v;
  if (agent && dt_parse_i64(agent, &v) == 0) {
    /* Die with the agent: an orphaned trainer would hold devices and ports forever. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != (pid_t)v) {
      DT_ERROR(TRAIN, "agent %lld exited before this trainer started", (long long)v);
      return DT_EREMOTE;
    }
  }
  if (!fd && !coord)
    return 0;
  dt_link_t *l = calloc(1, sizeof *l);
  if (!l)
    return DT_ENOMEM;
  l->status_fd = -1;
  pthread_mutex_init(&l->lock, NULL);
  pthread_cond_init(&l->wake, NULL);
  if (fd) {
    if (dt_parse_i64(fd, &v) != 0 || v < 0) {
      DT_ERROR(TRAIN, "DISTRAIN_STATUS_FD='%s' is not a file descriptor", fd);
      free(l);
      return DT_EINVAL;
    }
    l->status_fd = (int)v;
  }
  if (coord) {
    const char *job = getenv("DISTRAIN_JOB_ID"), *gen = getenv("DISTRAIN_GENERATION");
    const char *token_file = getenv("DISTRAIN_TOKEN_FILE");
    char token[256];
    int64_t g;
    if (!job || !gen || dt_parse_i64(gen, &g) != 0 || !token_file) {
      DT_ERROR(TRAIN, "DISTRAIN_COORDINATOR is set but DISTRAIN_JOB_ID, DISTRAIN_GENERATION or "
                      "DISTRAIN_TOKEN_FILE is missing");
      dt_link_close(l);
      return DT_EINVAL;
    }
    int rc = dt_rpc_read_token(token_file, token, sizeof token);
    if (rc == 0)
      rc = dt_rpc_client_create(coord, token, &distrain__v1__coordinator__descriptor, &l->coord);
    if (rc != 0) {
      dt_link_close(l);
      return rc;
    }
    snprintf(l->job_id, sizeof l->job_id, "%s", job);
    l->generation = (uint64_t)g;
  }
  if (l->status_fd >= 0)
    l->health_on = pthread_create(&l->health, NULL, health_main, l) == 0;
  *out = l;
  return 0;
}

void dt_link_close(dt_link_t *l)
{
  if (!l)
    return;
  if (l->health_on) {
    pthread_mutex_lock(&l->lock);
    l->stopping = 1;
    pthread_cond_signal(&l->wake);
    pthread_mutex_unlock(&l->lock);
    pthread_join(l->health, NULL);
  }
  if (l->status_fd >= 0)
    close(l->status_fd);
  dt_rpc_client_destroy(l->coord);
  pthread_cond_destroy(&l->wake);
  pthread_mutex_destroy(&l->lock);
  free(l);
}

int dt_link_has_coordinator(const dt_link_t *l)
{
  return l && l->coord;
}

/* Length-prefixed (4 bytes, little-endian) TrainerReport on the status pipe; the caller holds
 * l->lock. */
static void send_report_locked(dt_link_t *l, const Distrain__V1__TrainerReport *r)
{
  if (l->status_fd < 0)
    return;
  size_t len = distrain__v1__trainer_report__get_packed_size(r);
  uint8_t buf[4096]; /* PIPE_BUF: one write, never interleaved */
  if (len + 4 > sizeof buf)
    return;
  buf[0] = (uint8_t)len, buf[1] = (uint8_t)(len >> 8), buf[2] = (uint8_t)(len >> 16);
  buf[3] = (uint8_t)(len >> 24);
  distrain__v1__trainer_report__pack(r, buf + 4);
  size_t off = 0, total = len + 4;
  while (off < total) {
    ssize_t w = write(l->status_fd, buf + off, total - off);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0) { /* the agent is gone; keep training, stop reporting */
      close(l->status_fd);
      l->status_fd = -1;
      return;
    }
    off += (size_t)w;
  }
}

static void send_report(dt_link_t *l, const Distrain__V1__TrainerReport *r)
{
  if (!l)
    return;
  pthread_mutex_lock(&l->lock);
  send_report_locked(l, r);
  pthread_mutex_unlock(&l->lock);
}

/* The health reporter: every ProgressMs, this process's communicators' progress (operations
 * started and finished, the one in progress and for how long). It runs while the main thread
 * is blocked in a collective, which is when it matters: the coordinator compares the ranks'
 * counts to name the one a group waits for. A stopped process stops reporting altogether. */
static void *health_main(void *arg)
{
  dt_link_t *l = arg;
  dt_comm_progress_t p[MAX_COMMS];
  Distrain__V1__CommProgress c[MAX_COMMS], *cp[MAX_COMMS];
  int32_t peers[MAX_COMMS][DT_COMM_P2P_MAX];
  pthread_mutex_lock(&l->lock);
  while (!l->stopping && l->status_fd >= 0) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    int64_t ns = until.tv_nsec + dt_param_ProgressMs() * 1000000;
    until.tv_sec += ns / 1000000000;
    until.tv_nsec = ns % 1000000000;
    while (!l->stopping && pthread_cond_timedwait(&l->wake, &l->lock, &until) != ETIMEDOUT) {
    }
    if (l->stopping)
      break;
    pthread_mutex_unlock(&l->lock);
    int n = DT_MIN(dt_comm_progress(p, MAX_COMMS), MAX_COMMS);
    for (int i = 0; i < n; i++) {
      distrain__v1__comm_progress__init(&c[i]);
      c[i].group = p[i].group;
      c[i].label = p[i].label;
      c[i].rank = p[i].rank;
      c[i].world = p[i].world;
      c[i].entered = p[i].entered;
      c[i].done = p[i].done;
      c[i].op = (char *)(p[i].op ? p[i].op : "");
      for (int k = 0; k < p[i].npeers; k++)
        peers[i][k] = p[i].peers[k];
      c[i].peers = peers[i];
      c[i].n_peers = (size_t)p[i].npeers;
      c[i].peer = p[i].npeers ? p[i].peers[0] : -1;
      c[i].waiting_ms = (uint32_t)DT_MIN(p[i].waiting_ms, 4e9);
      cp[i] = &c[i];
    }
    Distrain__V1__TrainerProgress prog = DISTRAIN__V1__TRAINER_PROGRESS__INIT;
    prog.comms = cp;
    prog.n_comms = (size_t)n;
    Distrain__V1__TrainerReport r = DISTRAIN__V1__TRAINER_REPORT__INIT;
    r.progress = &prog;
    pthread_mutex_lock(&l->lock);
    send_report_locked(l, &r);
  }
  pthread_mutex_unlock(&l->lock);
  return NULL;
}

/* n named losses as messages in buf, pointed to by ptrs (returned). */
static Distrain__V1__NamedLoss **named_losses(Distrain__V1__NamedLoss *buf,
                                              Distrain__V1__NamedLoss **ptrs,
                                              const char *const *name, const float *loss, int n)
{
  for (int i = 0; i < n; i++) {
    distrain__v1__named_loss__init(&buf[i]);
    buf[i].name = (char *)name[i];
    buf[i].loss = loss[i];
    ptrs[i] = &buf[i];
  }
  return ptrs;
}

void dt_link_step(dt_link_t *l, const dt_step_metrics_t *m)
{
  Distrain__V1__StepMetrics s = DISTRAIN__V1__STEP_METRICS__INIT;
  s.step = m->step;
  s.loss = m->loss;
  s.lr = m->lr;
  s.grad_norm = m->grad_norm;
  s.ms = m->ms;
  s.tokens_per_s = m->tokens_per_s;
  s.has_val = m->has_val;
  s.val_loss = m->val_loss;
  Distrain__V1__NamedLoss vs[DT_VALSETS_MAX], *vsp[DT_VALSETS_MAX];
  Distrain__V1__NamedLoss src[DT_BLEND_MAX], *srcp[DT_BLEND_MAX];
  s.val_sets = named_losses(vs, vsp, m->val_set_name, m->val_set_loss, m->n_val_sets);
  s.n_val_sets = (size_t)m->n_val_sets;
  s.train_sources = named_losses(src, srcp, m->source_name, m->source_loss, m->n_sources);
  s.n_train_sources = (size_t)m->n_sources;
  s.has_eval = m->has_eval;
  if (m->has_eval) {
    s.eval_acc_norm = (float)m->eval_correct_norm / (float)m->eval_n;
    s.eval_acc = (float)m->eval_correct / (float)m->eval_n;
  }
  s.compute_ms = DT_MAX(0.0, m->ms * (1.0 - m->bubble) - m->comm_ms);
  s.tflops = m->tflops;
  s.mfu = (float)m->mfu;
  Distrain__V1__TrainerReport r = DISTRAIN__V1__TRAINER_REPORT__INIT;
  r.step = &s;
  r.memory_bytes = m->device_bytes ? m->device_bytes : peak_rss_bytes();
  send_report(l, &r);
}

static void send_error(dt_link_t *l, const char *msg, int64_t nonfinite_step, dt_bad_step_t bad)
{
  Distrain__V1__TrainerReport r = DISTRAIN__V1__TRAINER_REPORT__INIT;
  char buf[512];
  snprintf(buf, sizeof buf, "%s", msg);
  r.error = buf;
  r.memory_bytes = peak_rss_bytes();
  r.nonfinite_step = nonfinite_step;
  r.loss_spike = bad == DT_BAD_LOSS_SPIKE;
  r.grad_spike = bad == DT_BAD_GRAD_SPIKE;
  send_report(l, &r);
}

void dt_link_error(dt_link_t *l, const char *msg)
{
  send_error(l, msg, 0, DT_BAD_NONE);
}

void dt_link_nonfinite(dt_link_t *l, int64_t step, dt_bad_step_t bad, const char *msg)
{
  send_error(l, msg, step, bad);
}

void dt_link_skipped(dt_link_t *l, const int64_t *steps, size_t n)
{
  Distrain__V1__TrainerReport r = DISTRAIN__V1__TRAINER_REPORT__INIT;
  r.skipped_in_place = (int64_t *)steps;
  r.n_skipped_in_place = n;
  send_report(l, &r);
}

void dt_link_input_error(dt_link_t *l)
{
  Distrain__V1__TrainerReport r = DISTRAIN__V1__TRAINER_REPORT__INIT;
  r.input_error = 1;
  send_report(l, &r);
}

/* Calls to the coordinator ride out its restart: a call cut off by the connection dropping
 * (UNAVAILABLE) is made again, waiting for the coordinator to be back, until its deadline.
 * The restarted coordinator has what the calls before it wrote (the generation's keys,
 * checkpoint reports: write-through), and answers a repeated call as the first. */
static int coord_call(dt_link_t *l, const char *method, const ProtobufCMessage *req,
                      ProtobufCMessage **resp, int timeout_ms, char *err, size_t errlen)
{
  double deadline = dt_now_ms() + timeout_ms;
  for (;;) {
    int left = (int)DT_MAX(1.0, deadline - dt_now_ms());
    int rc =
        dt_rpc_client_call(l->coord, method, req, resp, left, DT_RPC_WAIT_FOR_READY, err, errlen);
    if (rc != DT_EUNAVAIL || dt_now_ms() + 100 >= deadline)
      return rc;
    DT_WARN(COMM, "%s: %s; retrying until the coordinator is back", method, err);
    dt_sleep_ms(100);
  }
}

int dt_link_report_checkpoint(dt_link_t *l, int64_t step, int world,
                              const dt_ckpt_shard_info_t *info, const char *error, int *committed,
                              char *why, size_t n)
{
  *committed = 0;
  why[0] = 0;
  Distrain__V1__ReportCheckpointRequest req = DISTRAIN__V1__REPORT_CHECKPOINT_REQUEST__INIT;
  req.job_id = l->job_id;
  req.generation = l->generation;
  req.step = step;
  req.rank = info->rank;
  req.world = world;
  req.lo = info->lo;
  req.hi = info->hi;
  req.bytes = info->bytes;
  req.crc32c = info->crc32c;
  req.name = (char *)info->name;
  if (error)
    req.error = (char *)error;
  ProtobufCMessage *resp;
  char err[512];
  int rc = coord_call(l, "ReportCheckpoint", &req.base, &resp, (int)dt_param_CkptReportTimeoutMs(),
                      err, sizeof err);
  if (rc != 0) {
    DT_ERROR(CKPT, "reporting checkpoint step %lld to the coordinator failed: %s", (long long)step,
             err);
    return rc;
  }
  const Distrain__V1__ReportCheckpointResponse *r = (const void *)resp;
  *committed = r->abandoned ? -1 : r->committed;
  if (r->abandoned)
    snprintf(why, n, "%s", r->error);
  protobuf_c_message_free_unpacked(resp, NULL);
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* The coordinator's per-job, per-generation key-value store as a dt_kv_t                      */
/* ------------------------------------------------------------------------------------------ */

static int kv_put(void *ud, const char *key, const void *val, size_t len)
{
  dt_link_t *l = ud;
  Distrain__V1__KvPutRequest req = DISTRAIN__V1__KV_PUT_REQUEST__INIT;
  req.job_id = l->job_id;
  req.generation = l->generation;
  req.key = (char *)key;
  req.value.data = (uint8_t *)val;
  req.value.len = len;
  ProtobufCMessage *resp;
  char err[512];
  int rc = coord_call(l, "KvPut", &req.base, &resp, (int)dt_param_CkptReportTimeoutMs(), err,
                      sizeof err);
  if (rc != 0) {
    DT_ERROR(COMM, "KvPut '%s': %s", key, err);
    return rc;
  }
  protobuf_c_message_free_unpacked(resp, NULL);
  return 0;
}

static int kv_get(void *ud, const char *key, void **val, size_t *len, int timeout_ms)
{
  dt_link_t *l = ud;
  Distrain__V1__KvGetRequest req = DISTRAIN__V1__KV_GET_REQUEST__INIT;
  req.job_id = l->job_id;
  req.generation = l->generation;
  req.key = (char *)key;
  req.timeout_ms = (uint32_t)(timeout_ms > 0 ? timeout_ms : 0);
  ProtobufCMessage *resp;
  char err[512];
  /* The server holds the call up to timeout_ms; give the RPC a little more. */
  int rc = coord_call(l, "KvGet", &req.base, &resp, timeout_ms + 10000, err, sizeof err);
  if (rc == DT_ENOENT && timeout_ms <= 0)
    return DT_ETIMEDOUT; /* a single probe of a missing key */
  if (rc != 0) {
    if (rc != DT_ETIMEDOUT)
      DT_ERROR(COMM, "KvGet '%s': %s", key, err);
    return rc;
  }
  Distrain__V1__KvGetResponse *r = (void *)resp;
  *val = malloc(r->value.len ? r->value.len : 1);
  if (!*val) {
    protobuf_c_message_free_unpacked(resp, NULL);
    return DT_ENOMEM;
  }
  memcpy(*val, r->value.data, r->value.len);
  *len = r->value.len;
  protobuf_c_message_free_unpacked(resp, NULL);
  return 0;
}

int dt_link_kv(dt_link_t *l, dt_kv_t *kv)
{
  if (!dt_link_has_coordinator(l))
    return DT_EINVAL;
  kv->put = kv_put;
  kv->get = kv_get;
  kv->ud = l;
  return 0;
}
