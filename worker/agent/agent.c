/* agent.c — see agent.h. */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"
#include "gpu_usage.h"
#include "jobspec.h"
#include "logs.h"

#ifdef DT_HAVE_CUDA
#include "probe.h"
#endif

DT_PARAM(WatchTimeoutMs, "WATCH_TIMEOUT_MS", 10000)
DT_PARAM(RpcTimeoutMs, "AGENT_RPC_TIMEOUT_MS", 5000)
/* How often a log read waiting for new bytes looks at the file again. */
DT_PARAM(LogPollMs, "LOG_POLL_MS", 100)
/* How long an exited trainer's report pipe may stay open before its exit is published. */
DT_PARAM(ExitDrainMs, "EXIT_DRAIN_MS", 2000)

/* Log reads the agent serves at once; more are dropped (the coordinator bounds them too). */
#define LOG_READS_MAX 16

extern char **environ;

/* ------------------------------------------------------------------------------------------ */
/* State                                                                                       */
/* ------------------------------------------------------------------------------------------ */

typedef struct trainer {
  struct trainer *next;
  dt_agent_t *agent;
  uv_process_t proc;
  uv_pipe_t pipe;        /* TrainerReports from the trainer */
  uv_timer_t kill_timer; /* SIGKILL after the grace period */
  int pipe_open, timer_open, proc_open;
  /* reaped: the process is gone; exited: and its reports are all read (pipe EOF, or a grace
   * period after the exit), so its final state is published */
  int reaped, exited, stopping;
  int pipe_eof;                       /* nothing more comes from the pipe */
  int delivering;                     /* its pending metrics ride on the heartbeat in flight */
  Distrain__V1__TrainerStatus status; /* strings below are owned */
  char job_id[64];
  char last_error[512];
  uint8_t *rbuf; /* partial report bytes */
  size_t rlen, rcap;
  /* to forward on the next heartbeat (rank 0); an exited record stays until they are sent */
  Distrain__V1__StepMetrics **pending;
  size_t n_pending;
  uint64_t last_report_ms; /* loop time of its last report, or of its start */
} trainer_t;

/* A LogRequest being served: the file is read on the threadpool and the bytes sent with
 * PutLogs; while it has nothing past the offset (and someone may still write it), the read
 * waits on its timer, looking again every LogPollMs, until wait_ms is over. */
typedef struct log_read {
  struct log_read *next;
  dt_agent_t *agent;
  Distrain__V1__LogRequest req; /* req.job_id owned */
  char node_id[32];             /* ours when it came (the threadpool must not read the agent's) */
  uint64_t deadline;            /* loop time at which it stops waiting for bytes */
  uv_timer_t timer;
  uv_work_t work;
  int busy;     /* its work is queued */
  int writing;  /* set on the loop before each work: a trainer of the rank runs here */
  int expired;  /* set on the loop before each work: the wait is over */
  int answered; /* the work sent PutLogs (or gave up): release it */
} log_read_t;

/* The GPU of one of the node's devices: NodeInfo.devices[i] describes it, usage rides on the
 * heartbeats. */
typedef struct {
  int visible;         /* its position in the trainers' CUDA_VISIBLE_DEVICES */
  char name[256];      /* devices[i].name points here */
  char pci_bus_id[32]; /* how NVML finds it */
  uint64_t memory_bytes;
  Distrain__V1__DeviceUsage usage; /* the heartbeat in flight's sample */
} gpu_t;

struct dt_agent {
  uv_loop_t *loop;
  dt_agent_config_t cfg;
  char token[256];
  char token_file_abs[4096];
  dt_rpc_client_t *rpc;
  char node_id[32];
  Distrain__V1__NodeInfo info;
  Distrain__V1__Device *devices;
  Distrain__V1__Device **device_ptrs;
  gpu_t *gpus; /* (n_gpus) devices[0..n_gpus) are GPUs; none on a CPU node */
  int n_gpus;
  char cuda_visible[1024]; /* the trainers' CUDA_VISIBLE_DEVICES: the offered GPUs, "" for none */
  /* NVML: loaded once off the loop (usage_work), then sampled by every heartbeat's work. Only
   * the loop sets usage; a heartbeat's work reads hb_nvml, set before it is queued. */
  dt_gpu_usage_t *usage, *usage_loaded; /* usage_loaded: usage_work's result, for usage_done */
  uv_work_t usage_work;
  int usage_busy;
  dt_gpu_usage_t *hb_nvml;              /* what the heartbeat in flight samples (or NULL) */
  Distrain__V1__DeviceUsage **hb_usage; /* (n_gpus) the heartbeat's known samples */
  uint32_t heartbeat_ms;
  uv_timer_t hb_timer, retry_timer;
  uv_work_t hb_work, watch_work, reg_work;
  int hb_busy, watch_busy, reg_busy, registered, closing, closing_handles;
  /* A graceful close (the coordinator heard that the node is leaving): trainers get SIGTERM,
   * and each one's last report goes out as it exits; the RPCs are cancelled after that. */
  int graceful_close, rpc_cancelled;
  uint64_t hb_seq, known_version;
  /* work results, filled on the threadpool and read back on the loop */
  Distrain__V1__HeartbeatRequest hb_req;
  Distrain__V1__TrainerStatus **hb_statuses;
  ProtobufCMessage *hb_resp, *watch_resp, *reg_resp;
  int hb_rc, watch_rc, reg_rc;
  int reg_refused; /* registrations refused for the token in a row (backoff) */
  char hb_err[256], watch_err[256], reg_err[256];
  /* the desired state and the trainers */
  Distrain__V1__WatchAssignmentResponse *assignment;
  trainer_t *trainers;
  log_read_t *logs; /* log reads in progress */
  int n_logs;
  void (*close_cb)(void *);
  void *close_ud;
};

static void reconcile(dt_agent_t *a);
static void start_watch(dt_agent_t *a);
static void start_register(dt_agent_t *a);
static void on_heartbeat(uv_timer_t *h);
static void trainer_exited(trainer_t *t);
static void maybe_finish_close(dt_agent_t *a);
static void log_read_start(dt_agent_t *a, const Distrain__V1__LogRequest *lr);

/* ------------------------------------------------------------------------------------------ */
/* Trainers                                                                                    */
/* ------------------------------------------------------------------------------------------ */

static void trainer_free(trainer_t *t)
{
  for (size_t i = 0; i < t->n_pending; i++)
    distrain__v1__step_metrics__free_unpacked(t->pending[i], NULL);
  free(t->pending);
  free(t->rbuf);
  if (t->status.progress)
    distrain__v1__trainer_progress__free_unpacked(t->status.progress, NULL);
  free(t->status.skipped_in_place);
  free(t);
}

static void on_trainer_handle_closed(uv_handle_t *h)
{
  trainer_t *t = h->data;
  if (h == (uv_handle_t *)&t->pipe)
    t->pipe_open = 0;
  else if (h == (uv_handle_t *)&t->kill_timer)
    t->timer_open = 0;
  else
    t->proc_open = 0;
  if (!t->pipe_open && !t->timer_open && !t->proc_open) {
    dt_agent_t *a = t->agent;
    for (trainer_t **pp = &a->trainers; *pp; pp = &(*pp)->next) {
      if (*pp == t) {
        *pp = t->next;
        break;
      }
    }
    trainer_free(t);
    maybe_finish_close(a);
  }
}

/* Closes a trainer's handles once it has exited; keeps the record while its job is assigned
 * so the coordinator sees its final state. */
static void trainer_release(trainer_t *t)
{
  if (t->pipe_open == 1) {
    t->pipe_open = 2;
    uv_close((uv_handle_t *)&t->pipe, on_trainer_handle_closed);
  }
  if (t->timer_open == 1) {
    t->timer_open = 2;
    uv_close((uv_handle_t *)&t->kill_timer, on_trainer_handle_closed);
  }
  if (t->proc_open == 1) {
    t->proc_open = 2;
    uv_close((uv_handle_t *)&t->proc, on_trainer_handle_closed);
  }
}

static void handle_report(trainer_t *t, const uint8_t *data, size_t len)
{
  Distrain__V1__TrainerReport *r = distrain__v1__trainer_report__unpack(NULL, len, data);
  if (!r) {
    DT_WARN(WORKER, "rank %d: malformed trainer report (%zu bytes)", t->status.rank, len);
    return;
  }
  t->last_report_ms = uv_now(t->agent->loop);
  if (r->progress) { /* the newest replaces one not yet sent */
    if (t->status.progress)
      distrain__v1__trainer_progress__free_unpacked(t->status.progress, NULL);
    t->status.progress = r->progress;
    r->progress = NULL; /* moved */
  }
  if (r->memory_bytes)
    t->status.memory_bytes = r->memory_bytes;
  if (r->step) {
    t->status.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING;
    if (r->step->step > 0) { /* step 0: the validation before training, no step's figures */
      t->status.step = r->step->step;
      t->status.loss = r->step->loss;
      t->status.tokens_per_s = r->step->tokens_per_s;
      t->status.compute_ms = r->step->compute_ms;
    }
    if (t->status.rank == 0) {
      Distrain__V1__StepMetrics **grown =
          realloc(t->pending, (t->n_pending + 1) * sizeof *t->pending);
      if (grown) {
        t->pending = grown;
        t->pending[t->n_pending++] = r->step;
        r->step = NULL; /* moved */
      }
    }
  }
  if (r->error && r->error[0]) {
    snprintf(t->last_error, sizeof t->last_error, "%s", r->error);
    dt_utf8_sanitize(t->last_error); /* the coordinator refuses a heartbeat that is not UTF-8 */
  }
  if (r->nonfinite_step > 0) {
    t->status.nonfinite_step = r->nonfinite_step;
    t->status.loss_spike = r->loss_spike;
    t->status.grad_spike = r->grad_spike;
  }
  if (r->n_skipped_in_place) { /* the newest list replaces the last */
    free(t->status.skipped_in_place);
    t->status.skipped_in_place = r->skipped_in_place;
    t->status.n_skipped_in_place = r->n_skipped_in_place;
    r->skipped_in_place = NULL; /* moved */
    r->n_skipped_in_place = 0;
  }
  if (r->input_error)
    t->status.input_error = 1;
  distrain__v1__trainer_report__free_unpacked(r, NULL);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
  trainer_t *t = h->data;
  if (t->rcap - t->rlen < suggested) {
    size_t cap = t->rlen + suggested;
    uint8_t *grown = realloc(t->rbuf, cap);
    if (!grown) {
      *buf = uv_buf_init(NULL, 0);
      return;
    }
    t->rbuf = grown, t->rcap = cap;
  }
  *buf = uv_buf_init((char *)t->rbuf + t->rlen, (unsigned)(t->rcap - t->rlen));
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
  trainer_t *t = s->data;
  (void)buf;
  if (n < 0) {
    uv_read_stop(s); /* EOF: the trainer closed its end (exiting) */
    t->pipe_eof = 1;
    if (t->reaped && !t->exited)
      trainer_exited(t);
    return;
  }
  t->rlen += (size_t)n;
  size_t off = 0;
  while (t->rlen - off >= 4) {
    const uint8_t *p = t->rbuf + off;
    size_t len = (size_t)p[0] | (size_t)p[1] << 8 | (size_t)p[2] << 16 | (size_t)p[3] << 24;
    if (len > 1 << 20) {
      DT_WARN(WORKER, "rank %d: report of %zu bytes is not plausible; ignoring the stream",
              t->status.rank, len);
      uv_read_stop(s);
      t->pipe_eof = 1;
      return;
    }
    if (t->rlen - off - 4 < len)
      break;
    handle_report(t, p + 4, len);
    off += 4 + len;
  }
  memmove(t->rbuf, t->rbuf + off, t->rlen - off);
  t->rlen -= off;
}

/* Before the exit: SIGKILL after the grace period of a stop. After it: the pipe's EOF is late. */
static void on_kill_timer(uv_timer_t *h)
{
  trainer_t *t = h->data;
  if (t->reaped) {
    if (!t->exited) {
      DT_WARN(WORKER, "job %s rank %d: its report pipe is still open %d ms after its exit",
              t->job_id, t->status.rank, (int)dt_param_ExitDrainMs());
      trainer_exited(t);
    }
  } else {
    DT_WARN(WORKER,
            "job %s rank %d did not exit within %d ms of SIGTERM (its step and save): SIGKILL",
            t->job_id, t->status.rank, t->agent->cfg.grace_ms);
    uv_process_kill(&t->proc, SIGKILL);
  }
}

/* A heartbeat saying that this node is leaving, sent synchronously on the loop thread (the
 * agent is stopping: nothing else waits on it), with trainer t's final state and the steps it
 * reported since the last heartbeat, or none. 0 when the coordinator took it. */
static int leaving_heartbeat(dt_agent_t *a, trainer_t *t, int gone, int timeout_ms, char *err,
                             size_t errlen)
{
  Distrain__V1__HeartbeatRequest req = DISTRAIN__V1__HEARTBEAT_REQUEST__INIT;
  Distrain__V1__TrainerStatus ts, *tsp = &ts;
  req.node_id = a->node_id;
  req.seq = ++a->hb_seq;
  req.leaving = 1;
  req.gone = gone;
  if (t) {
    ts = t->status;
    ts.job_id = t->job_id;
    ts.last_error = t->last_error;
    ts.metrics = t->pending;
    ts.n_metrics = t->n_pending;
    req.trainers = &tsp;
    req.n_trainers = 1;
  }
  ProtobufCMessage *resp = NULL;
  const int rc =
      dt_rpc_client_call(a->rpc, "Heartbeat", &req.base, &resp, timeout_ms, 0, err, errlen);
  if (rc == 0)
    protobuf_c_message_free_unpacked(resp, NULL);
  return rc;
}

/* A graceful close's last word on an exited trainer, so that the last steps of a drained
 * node's rank 0 reach the coordinator. */
static void farewell(dt_agent_t *a, trainer_t *t)
{
  char err[256];
  if (leaving_heartbeat(a, t, 0, 2000, err, sizeof err) != 0)
    DT_WARN(WORKER, "job %s rank %d: its last report did not reach the coordinator: %s", t->job_id,
            t->status.rank, err);
}

/* The rank logs (rank-<R>.log, nothing else) in job directory dir: how many there are, and
 * whether all of them were last written before cutoff; with del, those are deleted. */
static int job_logs(const char *dir, time_t cutoff, int del, int *all_old)
{
  DIR *job = opendir(dir);
  int n = 0;
  *all_old = job != NULL;
  for (struct dirent *f; job && (f = readdir(job));) {
    char path[PATH_MAX + 260]; /* dir, "/", a name of up to 255 bytes */
    int rank, end = 0;
    struct stat st;
    if (sscanf(f->d_name, "rank-%d.log%n", &rank, &end) != 1 || f->d_name[end] != '\0')
      continue;
    snprintf(path, sizeof path, "%s/%s", dir, f->d_name);
    if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode))
      continue;
    *all_old &= st.st_mtime < cutoff;
    n += !del || unlink(path) == 0;
  }
  if (job)
    closedir(job);
  return n;
}

/* --keep-logs-days: deletes the rank logs under <work_dir>/<job>/ of each job none of whose
 * trainers is here and none of whose logs was written for that many days (a job's logs go
 * together), then its directory if nothing else is left in it. A few stats a job: done on the
 * loop. */
static void prune_logs(dt_agent_t *a)
{
  const int days = a->cfg.keep_logs_days;
  DIR *work = days > 0 ? opendir(a->cfg.work_dir) : NULL;
  if (!work)
    return;
  const time_t cutoff = time(NULL) - (time_t)days * 86400;
  int deleted = 0, jobs = 0;
  for (struct dirent *e; (e = readdir(work));) {
    int here = 0, all_old;
    for (trainer_t *t = a->trainers; t && !here; t = t->next)
      here = strcmp(t->job_id, e->d_name) == 0;
    char dir[PATH_MAX];
    if (here || !dt_logs_job_ok(e->d_name) ||
        snprintf(dir, sizeof dir, "%s/%s", a->cfg.work_dir, e->d_name) >= (int)sizeof dir ||
        !job_logs(dir, cutoff, 0, &all_old) || !all_old)
      continue;
    deleted += job_logs(dir, cutoff, 1, &all_old);
    jobs += rmdir(dir) == 0; /* only once empty */
  }
  closedir(work);
  if (deleted)
    DT_INFO(WORKER,
            "deleted %d rank log%s of jobs not written for %d day%s (--keep-logs-days), and %d "
            "job director%s left empty, from %s",
            deleted, deleted == 1 ? "" : "s", days, days == 1 ? "" : "s", jobs,
            jobs == 1 ? "y" : "ies", a->cfg.work_dir);
}

/* Publishes the final state: after the last report, so that a SUCCEEDED rank 0 carries its
 * last steps and an older generation's steps reach the coordinator before the next starts. */
static void trainer_exited(trainer_t *t)
{
  dt_agent_t *a = t->agent;
  t->exited = 1;
  if (t->timer_open == 1)
    uv_timer_stop(&t->kill_timer);
  if (a->closing) {
    if (a->graceful_close)
      farewell(a, t);
    trainer_release(t);
    return;
  }
  if (t->n_pending && !a->hb_busy)
    on_heartbeat(&a->hb_timer); /* now, not a heartbeat period later */
  reconcile(a);                 /* a waiting generation may start now */
  prune_logs(a);
}

static void on_exit_cb(uv_process_t *p, int64_t status, int term_signal)
{
  trainer_t *t = p->data;
  t->reaped = 1;
  t->status.exit_code = (int32_t)status;
  t->status.term_signal = term_signal;
  t->status.pid = 0;
  if (t->stopping)
    t->status.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_STOPPED;
  else if (status == 0 && term_signal == 0)
    t->status.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_SUCCEEDED;
  else
    t->status.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED;
  if (t->status.state == DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED)
    DT_WARN(WORKER, "job %s rank %d exited (code %lld, signal %d)%s%s", t->job_id, t->status.rank,
            (long long)status, term_signal, t->last_error[0] ? ": " : "", t->last_error);
  else
    DT_INFO(WORKER, "job %s rank %d %s (code %lld, signal %d)", t->job_id, t->status.rank,
            t->stopping ? "stopped" : "finished", (long long)status, term_signal);
  if (t->pipe_eof || (t->agent->closing && !t->agent->graceful_close)) {
    trainer_exited(t);
    return;
  }
  /* SIGCHLD can come before the pipe's last bytes are read: wait for its EOF, for a while (a
   * child of the trainer may hold the pipe open). */
  uv_timer_start(&t->kill_timer, on_kill_timer, (uint64_t)dt_param_ExitDrainMs(), 0);
}

/* graceful: SIGTERM, on which the trainer saves its step before it exits (the job was stopped
 * by the user, or this agent is stopping), then SIGKILL after the grace period. Otherwise
 * (another generation replaces it: its peers have failed) SIGKILL at once. */
static void trainer_stop(trainer_t *t, int graceful)
{
  if (t->reaped || t->stopping)
    return;
  t->stopping = 1;
  DT_INFO(WORKER, "stopping job %s rank %d (pid %d)%s", t->job_id, t->status.rank, t->proc.pid,
          graceful ? ": it saves its step first" : "");
  uv_process_kill(&t->proc, graceful ? SIGTERM : SIGKILL);
  if (graceful)
    uv_timer_start(&t->kill_timer, on_kill_timer, (uint64_t)t->agent->cfg.grace_ms, 0);
}

/* The variables trainer_env sets, and the directory rendezvous that a trainer under an agent
 * must not use: inherited values of these are dropped (ours win). Everything else in the agent's
 * environment reaches the trainer, DISTRAIN_* tunables included (DISTRAIN_DEBUG,
 * DISTRAIN_COMM_IFACE, DISTRAIN_COMM_TIMEOUT_MS, ...): the operator sets them on the agent, as
 * with torchrun. */
// clang-format off
static const char *const trainer_vars[] = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS",
    "DISTRAIN_JOB_ID", "DISTRAIN_GENERATION", "DISTRAIN_MESH", "DISTRAIN_PP_RANK",
    "DISTRAIN_DP_RANK", "DISTRAIN_CP_RANK", "DISTRAIN_TP_RANK", "DISTRAIN_DEVICE",
    "DISTRAIN_COORDINATOR", "DISTRAIN_TOKEN_FILE", "DISTRAIN_STATUS_FD", "DISTRAIN_AGENT_PID",
    "DISTRAIN_KV_DIR", "DISTRAIN_KV_PREFIX", "CUDA_VISIBLE_DEVICES", "DISTRAIN_CUDA_DEVICE",
    /* systemd's, meant for the agent alone: a trainer is not the service's main process */
    "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"};
// clang-format on

static int is_trainer_var(const char *kv)
{
  for (size_t i = 0; i < sizeof trainer_vars / sizeof *trainer_vars; i++) {
    size_t len = strlen(trainer_vars[i]);
    if (strncmp(kv, trainer_vars[i], len) == 0 && kv[len] == '=')
      return 1;
  }
  return 0;
}

/* Builds KEY=VALUE strings for the trainer: our environment plus the rank's. */
static char **trainer_env(dt_agent_t *a, const Distrain__V1__Assignment *as,
                          const Distrain__V1__RankAssignment *r, int threads)
{
  size_t n = 0;
  while (environ[n])
    n++;
  char **env = calloc(n + 32, sizeof *env);
  if (!env)
    return NULL;
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (!is_trainer_var(environ[i]))
      env[k++] = strdup(environ[i]);
  const Distrain__V1__ParallelSpec *p = as->spec->parallel;
  char buf[4200];
#define ENV(...)                                                                                   \
  do {                                                                                             \
    snprintf(buf, sizeof buf, __VA_ARGS__);                                                        \
    env[k++] = strdup(buf);                                                                        \
  } while (0)
  ENV("RANK=%d", r->rank);
  ENV("LOCAL_RANK=%d", r->local_rank);
  ENV("WORLD_SIZE=%d", as->world_size);
  ENV("LOCAL_WORLD_SIZE=%d", as->local_world_size);
  ENV("DISTRAIN_JOB_ID=%s", as->job_id);
  ENV("DISTRAIN_GENERATION=%llu", (unsigned long long)as->generation);
  ENV("DISTRAIN_MESH=pp%d,dp%d,cp%d,tp%d", p->pp, p->dp, p->cp, p->tp);
  ENV("DISTRAIN_PP_RANK=%d", r->pp);
  ENV("DISTRAIN_DP_RANK=%d", r->dp);
  ENV("DISTRAIN_CP_RANK=%d", r->cp);
  ENV("DISTRAIN_TP_RANK=%d", r->tp);
  ENV("DISTRAIN_DEVICE=%d", r->device_index);
  ENV("DISTRAIN_COORDINATOR=%s", a->cfg.coordinator);
  ENV("DISTRAIN_TOKEN_FILE=%s", a->token_file_abs);
  ENV("DISTRAIN_STATUS_FD=3");
  ENV("DISTRAIN_AGENT_PID=%d", (int)getpid());
  ENV("OMP_NUM_THREADS=%d", threads);
  ENV("CUDA_VISIBLE_DEVICES=%s", a->cuda_visible);
  if (r->device_index >= 0 && r->device_index < a->n_gpus)
    ENV("DISTRAIN_CUDA_DEVICE=%d", a->gpus[r->device_index].visible);
#undef ENV
  env[k] = NULL;
  for (size_t i = 0; i < k; i++)
    if (!env[i]) {
      dt_argv_free(env);
      return NULL;
    }
  return env;
}

static trainer_t *find_trainer(dt_agent_t *a, const char *job, int rank)
{
  for (trainer_t *t = a->trainers; t; t = t->next)
    if (t->status.rank == rank && strcmp(t->job_id, job) == 0)
      return t;
  return NULL;
}

static int spawn_trainer(dt_agent_t *a, const Distrain__V1__Assignment *as,
                         const Distrain__V1__RankAssignment *r)
{
  int ret = 0, logfd = -1;
  char **args = NULL, **env = NULL, **argv = NULL, *skip = NULL;
  trainer_t *t = calloc(1, sizeof *t);
  if (!t)
    return DT_ENOMEM;
  t->agent = a;
  distrain__v1__trainer_status__init(&t->status);
  snprintf(t->job_id, sizeof t->job_id, "%s", as->job_id);
  t->status.job_id = t->job_id;
  t->status.last_error = t->last_error;
  t->status.generation = as->generation;
  t->status.rank = r->rank;
  t->status.local_rank = r->local_rank;
  t->status.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_STARTING;
  t->last_report_ms = uv_now(a->loop);

  int argc;
  DT_CHECK_GOTO(dt_jobspec_trainer_argv(as->spec, as->spec->parallel->dp, as->resume, &args, &argc),
                ret, fail);
  argv = calloc((size_t)argc + 4, sizeof *argv);
  if (!argv) {
    ret = DT_ENOMEM;
    goto fail;
  }
  argv[0] = (char *)a->cfg.trainer;
  for (int i = 0; i < argc; i++)
    argv[i + 1] = args[i];
  /* Steps rolled back after a NaN/Inf or a loss spike: taken without an update. All of them,
   * however many (a fixed buffer once cut the list, and with it the last step number, short). */
  skip = dt_join_steps(as->skip_steps, as->n_skip_steps);
  if (!skip) {
    ret = DT_ENOMEM;
    goto fail;
  }
  if (skip[0]) {
    argv[argc + 1] = (char *)"--skip-steps";
    argv[argc + 2] = skip;
  }
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int threads = as->spec->training->threads > 0
                    ? as->spec->training->threads
                    : (int)DT_MAX(1, cores / DT_MAX(1, as->local_world_size));
  env = trainer_env(a, as, r, threads);
  if (!env) {
    ret = DT_ENOMEM;
    goto fail;
  }
  char dir[4200], log[4300];
  /* The one place a rank's log path is made (GetLogs reads it back through the same helper). */
  DT_CHECK_GOTO(dt_logs_path(a->cfg.work_dir, as->job_id, r->rank, log, sizeof log), ret, fail);
  snprintf(dir, sizeof dir, "%s/%s", a->cfg.work_dir, as->job_id);
  DT_CHECK_GOTO(dt_mkdir_p(dir), ret, fail);
  logfd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (logfd < 0) {
    DT_ERROR(WORKER, "%s: cannot open trainer log: %s", log, strerror(errno));
    ret = DT_EIO;
    goto fail;
  }
  dprintf(logfd, "==== job %s generation %llu rank %d: %s", as->job_id,
          (unsigned long long)as->generation, r->rank, a->cfg.trainer);
  for (int i = 0; i < argc; i++)
    dprintf(logfd, " %s", args[i]);
  dprintf(logfd, "%s%s\n", skip[0] ? " --skip-steps " : "", skip);

  uv_pipe_init(a->loop, &t->pipe, 0);
  t->pipe.data = t;
  t->pipe_open = 1;
  uv_timer_init(a->loop, &t->kill_timer);
  t->kill_timer.data = t;
  t->timer_open = 1;
  uv_stdio_container_t stdio[4];
  stdio[0].flags = UV_IGNORE;
  stdio[1].flags = UV_INHERIT_FD;
  stdio[1].data.fd = logfd;
  stdio[2].flags = UV_INHERIT_FD;
  stdio[2].data.fd = logfd;
  stdio[3].flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE;
  stdio[3].data.stream = (uv_stream_t *)&t->pipe;
  uv_process_options_t opts;
  memset(&opts, 0, sizeof opts);
  opts.file = a->cfg.trainer;
  opts.args = argv;
  opts.env = env;
  opts.cwd = a->cfg.work_dir;
  opts.stdio = stdio;
  opts.stdio_count = 4;
  opts.exit_cb = on_exit_cb;
  t->proc.data = t;
  int uerr = uv_spawn(a->loop, &t->proc, &opts);
  close(logfd);
  logfd = -1;
  if (uerr != 0) {
    DT_ERROR(WORKER, "cannot start %s: %s", a->cfg.trainer, uv_strerror(uerr));
    snprintf(t->last_error, sizeof t->last_error, "cannot start %s: %s", a->cfg.trainer,
             uv_strerror(uerr));
    dt_utf8_sanitize(t->last_error);
    t->status.state = DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED;
    t->reaped = t->exited = t->pipe_eof = 1;
    t->proc_open = 1; /* uv_spawn failures still need uv_close */
  } else {
    t->proc_open = 1;
    t->status.pid = t->proc.pid;
    uv_read_start((uv_stream_t *)&t->pipe, on_alloc, on_read);
    DT_INFO(WORKER, "started job %s generation %llu rank %d (pid %d, %d threads), log %s",
            as->job_id, (unsigned long long)as->generation, r->rank, t->proc.pid, threads, log);
  }
  t->next = a->trainers;
  a->trainers = t;
  dt_argv_free(args);
  dt_argv_free(env);
  free(argv);
  free(skip);
  return 0;
fail:
  if (logfd >= 0)
    close(logfd);
  dt_argv_free(args);
  dt_argv_free(env);
  free(argv);
  free(skip);
  free(t);
  return ret;
}

/* An exited rank 0 whose last steps have not reached the coordinator yet: its record stays, and
 * its job's next generation waits here, so those steps arrive before the next generation's. */
static int undelivered(const trainer_t *t)
{
  return t->n_pending > 0 || t->delivering;
}

/* Brings the running trainers in line with the assignment. */
static void reconcile(dt_agent_t *a)
{
  const Distrain__V1__WatchAssignmentResponse *w = a->assignment;
  /* 1. Stop what is not assigned (other jobs, older generations); forget exited records of
   *    jobs that are no longer assigned. */
  for (trainer_t *t = a->trainers, *next; t; t = next) {
    next = t->next;
    int wanted = 0, job_assigned = 0;
    for (size_t i = 0; w && i < w->n_assignments; i++) {
      const Distrain__V1__Assignment *as = w->assignments[i];
      if (strcmp(as->job_id, t->job_id) != 0)
        continue;
      job_assigned = as->generation == t->status.generation;
      for (size_t k = 0; k < as->n_ranks; k++)
        wanted |= job_assigned && as->ranks[k]->rank == t->status.rank;
    }
    if (!wanted && !t->exited)
      trainer_stop(t, w && w->stopped_job && strcmp(w->stopped_job, t->job_id) == 0);
    else if (!job_assigned && t->exited && !undelivered(t))
      trainer_release(t);
  }
  /* 2. Start assigned ranks, once nothing of an older generation of that job still runs, and
   *    no trainer still saves its step on the way out (its device is not free yet). */
  for (size_t i = 0; w && i < w->n_assignments; i++) {
    const Distrain__V1__Assignment *as = w->assignments[i];
    int busy = 0;
    for (trainer_t *t = a->trainers; t; t = t->next)
      busy |= (strcmp(t->job_id, as->job_id) == 0 && t->status.generation != as->generation &&
               (!t->exited || undelivered(t))) ||
              (t->stopping && !t->exited);
    if (busy)
      continue; /* trainer_exited or hb_done calls us again */
    for (size_t k = 0; k < as->n_ranks; k++) {
      trainer_t *t = find_trainer(a, as->job_id, as->ranks[k]->rank);
      if (t && t->status.generation == as->generation)
        continue; /* running, or finished in this generation */
      if (t && t->exited)
        trainer_release(t); /* an older generation's record */
      spawn_trainer(a, as, as->ranks[k]);
    }
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Coordinator RPCs on the threadpool                                                          */
/* ------------------------------------------------------------------------------------------ */

/* <work_dir>/node-id: the id this node registered under, asked for again after a restart. */
#define NODE_ID_FILE "node-id"

static void load_node_id(dt_agent_t *a)
{
  char path[4200], id[sizeof a->node_id] = "";
  snprintf(path, sizeof path, "%s/" NODE_ID_FILE, a->cfg.work_dir);
  FILE *fp = fopen(path, "r");
  if (!fp)
    return; /* never registered from this work directory */
  if (fgets(id, sizeof id, fp)) {
    id[strcspn(id, "\n")] = '\0';
    snprintf(a->node_id, sizeof a->node_id, "%s", id);
  }
  fclose(fp);
}

static void save_node_id(dt_agent_t *a)
{
  char path[4200];
  dt_afile_t af;
  snprintf(path, sizeof path, "%s/" NODE_ID_FILE, a->cfg.work_dir);
  if (dt_afile_open(&af, path) != 0)
    return;
  fprintf(af.fp, "%s\n", a->node_id);
  if (ferror(af.fp) || dt_afile_commit(&af) != 0) {
    dt_afile_abort(&af);
    DT_WARN(WORKER, "%s: cannot record the node id %s: a restarted agent will be a new node", path,
            a->node_id);
  }
}

static void reg_work(uv_work_t *w)
{
  dt_agent_t *a = w->data;
  Distrain__V1__RegisterWorkerRequest req = DISTRAIN__V1__REGISTER_WORKER_REQUEST__INIT;
  req.node = &a->info;
  req.node_id = a->node_id;
  a->reg_rc = dt_rpc_client_call(a->rpc, "RegisterWorker", &req.base, &a->reg_resp,
                                 (int)dt_param_RpcTimeoutMs(), DT_RPC_WAIT_FOR_READY, a->reg_err,
                                 sizeof a->reg_err);
}

static void on_retry(uv_timer_t *h)
{
  dt_agent_t *a = h->data;
  if (!a->registered)
    start_register(a);
  else
    start_watch(a);
}

static void reg_done(uv_work_t *w, int status)
{
  dt_agent_t *a = w->data;
  (void)status;
  a->reg_busy = 0;
  if (a->closing) {
    if (a->reg_resp)
      protobuf_c_message_free_unpacked(a->reg_resp, NULL);
    maybe_finish_close(a);
    return;
  }
  if (a->reg_rc == DT_EAUTH) {
    /* A wrong token stays wrong: back off (1 s doubling to a minute), and say so less often. */
    const int n = a->reg_refused++;
    const uint64_t delay = n < 6 ? 1000u << n : 60000u;
    if (n < 7)
      DT_WARN(WORKER,
              "the coordinator %s refused our token (%s): check --token-file / "
              "DISTRAIN_TOKEN_FILE; retrying in %llu s%s",
              a->cfg.coordinator, a->reg_err, (unsigned long long)delay / 1000,
              n == 6 ? " and every minute from now on, quietly" : "");
    else
      DT_DEBUG(WORKER, "registering with %s refused: %s", a->cfg.coordinator, a->reg_err);
    uv_timer_start(&a->retry_timer, on_retry, delay, 0);
    return;
  }
  if (a->reg_rc != 0) {
    DT_WARN(WORKER, "registering with %s failed: %s; retrying", a->cfg.coordinator, a->reg_err);
    uv_timer_start(&a->retry_timer, on_retry, 1000, 0);
    return;
  }
  a->reg_refused = 0;
  Distrain__V1__RegisterWorkerResponse *r = (void *)a->reg_resp;
  const int same = strcmp(a->node_id, r->node_id) == 0;
  snprintf(a->node_id, sizeof a->node_id, "%s", r->node_id);
  if (!same)
    save_node_id(a);
  a->heartbeat_ms = r->heartbeat_ms ? r->heartbeat_ms : 500;
  protobuf_c_message_free_unpacked(a->reg_resp, NULL);
  a->reg_resp = NULL;
  a->registered = 1;
  a->known_version = 0;
  DT_INFO(WORKER, "registered as %s with %s (heartbeat %u ms)", a->node_id, a->cfg.coordinator,
          a->heartbeat_ms);
  uv_timer_start(&a->hb_timer, on_heartbeat, 0, a->heartbeat_ms);
  start_watch(a);
  if (a->cfg.on_registered)
    a->cfg.on_registered(a->cfg.ud);
}

static void start_register(dt_agent_t *a)
{
  if (a->reg_busy || a->closing)
    return;
  a->reg_busy = 1;
  a->registered = 0;
  a->reg_work.data = a;
  uv_queue_work(a->loop, &a->reg_work, reg_work, reg_done);
}

/* Whether device i's GPU is also an earlier device's (--gpus listed it twice). */
static int gpu_seen_before(const dt_agent_t *a, int i)
{
  for (int j = 0; j < i; j++)
    if (a->gpus[j].visible == a->gpus[i].visible)
      return 1;
  return 0;
}

/* On the threadpool, before the heartbeat goes out: the GPUs whose memory use NVML knows or that
 * are lost, each once (as its first device), so sums over a node count a shared GPU once. */
static void sample_gpus(dt_agent_t *a)
{
  size_t k = 0;
  for (int i = 0; a->hb_nvml && i < a->n_gpus; i++) {
    dt_gpu_sample_t s;
    if (gpu_seen_before(a, i) || !dt_gpu_usage_sample(a->hb_nvml, i, &s))
      continue;
    Distrain__V1__DeviceUsage *u = &a->gpus[i].usage;
    distrain__v1__device_usage__init(u);
    u->index = i;
    u->memory_used_bytes = s.used_bytes;
    u->memory_total_bytes = s.total_bytes;
    u->utilization_pct = s.utilization_pct;
    u->lost = s.lost;
    u->ecc_uncorrected = s.ecc_uncorrected;
    u->reset_pending = s.reset_pending;
    u->remap_failed = s.remap_failed;
    u->slowdown = s.slowdown;
    u->xid = s.xid;
    u->nvlink_down = s.nvlink_down;
    u->pcie_width = (uint32_t)s.pcie_width;
    u->pcie_max_width = (uint32_t)s.pcie_max_width;
    u->link_rates = 1;
    u->pcie_replays_per_min = s.pcie_replays_per_min;
    u->nvlink_replays_per_min = s.nvlink_replays_per_min;
    u->nvlink_crc_per_min = s.nvlink_crc_per_min;
    a->hb_usage[k++] = u;
  }
  a->hb_req.devices = a->hb_usage;
  a->hb_req.n_devices = k;
}

static void hb_work(uv_work_t *w)
{
  dt_agent_t *a = w->data;
  sample_gpus(a);
  a->hb_rc = dt_rpc_client_call(a->rpc, "Heartbeat", &a->hb_req.base, &a->hb_resp,
                                (int)dt_param_RpcTimeoutMs(), 0, a->hb_err, sizeof a->hb_err);
}

static void hb_done(uv_work_t *w, int status)
{
  dt_agent_t *a = w->data;
  (void)status;
  a->hb_busy = 0;
  /* The metrics went out only if the heartbeat succeeded; otherwise hand them back to their
   * trainer (if it still exists) for the next one, so --metrics streams stay complete. */
  int delivered = 0;
  for (size_t i = 0; i < a->hb_req.n_trainers; i++) {
    Distrain__V1__TrainerStatus *ts = a->hb_statuses[i];
    trainer_t *t = find_trainer(a, ts->job_id, ts->rank);
    if (t && t->status.generation != ts->generation)
      t = NULL;
    if (t && t->delivering) {
      t->delivering = 0;
      delivered |= a->hb_rc == 0 && t->exited;
    }
    if (t && a->hb_rc != 0 && ts->n_metrics) {
      Distrain__V1__StepMetrics **merged = malloc((ts->n_metrics + t->n_pending) * sizeof *merged);
      if (merged) {
        memcpy(merged, ts->metrics, ts->n_metrics * sizeof *merged);
        if (t->n_pending) /* t->pending is NULL when empty: memcpy from NULL is undefined */
          memcpy(merged + ts->n_metrics, t->pending, t->n_pending * sizeof *merged);
        free(t->pending);
        t->pending = merged;
        t->n_pending += ts->n_metrics;
        ts->n_metrics = 0;
      }
    }
    for (size_t k = 0; k < ts->n_metrics; k++)
      distrain__v1__step_metrics__free_unpacked(ts->metrics[k], NULL);
    free(ts->metrics);
    if (ts->progress)
      distrain__v1__trainer_progress__free_unpacked(ts->progress, NULL);
    free(ts->job_id);
    free(ts->last_error);
    free(ts);
  }
  free(a->hb_statuses);
  a->hb_statuses = NULL;
  a->hb_req.n_trainers = 0;
  if (a->closing) {
    if (a->hb_resp)
      protobuf_c_message_free_unpacked(a->hb_resp, NULL);
    maybe_finish_close(a);
    return;
  }
  if (a->hb_rc != 0) {
    DT_DEBUG(WORKER, "heartbeat failed: %s", a->hb_err);
    return;
  }
  if (delivered)
    reconcile(a); /* an exited record may go, a generation waiting on it start */
  Distrain__V1__HeartbeatResponse *r = (void *)a->hb_resp;
  int rereg = r->reregister;
  uint64_t version = r->assignment_version;
  protobuf_c_message_free_unpacked(a->hb_resp, NULL);
  a->hb_resp = NULL;
  if (rereg) {
    DT_WARN(WORKER, "the coordinator does not know %s: registering again", a->node_id);
    a->node_id[0] = '\0';
    start_register(a);
    return;
  }
  if (version != a->known_version)
    start_watch(a);
}

static void on_heartbeat(uv_timer_t *h)
{
  dt_agent_t *a = h->data;
  if (a->hb_busy || !a->registered || a->closing)
    return;
  size_t n = 0;
  for (trainer_t *t = a->trainers; t; t = t->next)
    n++;
  a->hb_statuses = calloc(n ? n : 1, sizeof *a->hb_statuses);
  if (!a->hb_statuses)
    return;
  /* Snapshot of the statuses, taking over the pending metrics (hb_done returns them to their
   * trainer if the heartbeat fails). */
  size_t k = 0;
  for (trainer_t *t = a->trainers; t; t = t->next) {
    Distrain__V1__TrainerStatus *ts = malloc(sizeof *ts);
    if (!ts)
      break;
    /* The RPC packs this on a threadpool thread while the loop goes on: own every string. */
    *ts = t->status;
    ts->job_id = strdup(t->job_id);
    ts->last_error = strdup(t->last_error);
    if (!ts->job_id || !ts->last_error) {
      free(ts->job_id);
      free(ts->last_error);
      free(ts);
      break;
    }
    ts->metrics = t->pending;
    ts->n_metrics = t->n_pending;
    t->delivering = t->n_pending > 0;
    t->pending = NULL;
    t->n_pending = 0;
    t->status.progress = NULL; /* sent once; the coordinator keeps the latest */
    ts->report_age_ms = (uint32_t)DT_MIN(uv_now(a->loop) - t->last_report_ms, UINT32_MAX);
    a->hb_statuses[k++] = ts;
  }
  distrain__v1__heartbeat_request__init(&a->hb_req);
  a->hb_req.node_id = a->node_id;
  a->hb_req.seq = ++a->hb_seq;
  a->hb_req.trainers = a->hb_statuses;
  a->hb_req.n_trainers = k;
  a->hb_nvml = a->usage;
  a->hb_busy = 1;
  a->hb_work.data = a;
  uv_queue_work(a->loop, &a->hb_work, hb_work, hb_done);
}

static void watch_work(uv_work_t *w)
{
  dt_agent_t *a = w->data;
  Distrain__V1__WatchAssignmentRequest req = DISTRAIN__V1__WATCH_ASSIGNMENT_REQUEST__INIT;
  req.node_id = a->node_id;
  req.known_version = a->known_version;
  req.timeout_ms = (uint32_t)dt_param_WatchTimeoutMs();
  a->watch_rc = dt_rpc_client_call(a->rpc, "WatchAssignment", &req.base, &a->watch_resp,
                                   (int)req.timeout_ms + 5000, DT_RPC_WAIT_FOR_READY, a->watch_err,
                                   sizeof a->watch_err);
}

static void watch_done(uv_work_t *w, int status)
{
  dt_agent_t *a = w->data;
  (void)status;
  a->watch_busy = 0;
  if (a->closing) {
    if (a->watch_resp)
      protobuf_c_message_free_unpacked(a->watch_resp, NULL);
    maybe_finish_close(a);
    return;
  }
  if (a->watch_rc != 0) {
    if (a->watch_rc == DT_ENOENT) { /* the coordinator forgot us */
      a->node_id[0] = '\0';
      start_register(a);
    } else {
      DT_DEBUG(WORKER, "watch failed: %s; retrying", a->watch_err);
      uv_timer_start(&a->retry_timer, on_retry, 500, 0);
    }
    return;
  }
  Distrain__V1__WatchAssignmentResponse *r = (void *)a->watch_resp;
  a->watch_resp = NULL;
  for (size_t i = 0; i < r->n_log_requests; i++)
    log_read_start(a, r->log_requests[i]);
  if (r->version != a->known_version) {
    a->known_version = r->version;
    if (a->assignment)
      distrain__v1__watch_assignment_response__free_unpacked(a->assignment, NULL);
    a->assignment = r;
    reconcile(a);
  } else {
    distrain__v1__watch_assignment_response__free_unpacked(r, NULL);
  }
  start_watch(a);
}

static void start_watch(dt_agent_t *a)
{
  if (a->watch_busy || !a->registered || a->closing)
    return;
  a->watch_busy = 1;
  a->watch_work.data = a;
  uv_queue_work(a->loop, &a->watch_work, watch_work, watch_done);
}

/* ------------------------------------------------------------------------------------------ */
/* Trainer logs (GetLogs, relayed by the coordinator)                                          */
/* ------------------------------------------------------------------------------------------ */

static void on_log_read_closed(uv_handle_t *h)
{
  log_read_t *lr = h->data;
  dt_agent_t *a = lr->agent;
  for (log_read_t **pp = &a->logs; *pp; pp = &(*pp)->next) {
    if (*pp == lr) {
      *pp = lr->next;
      break;
    }
  }
  a->n_logs--;
  free(lr->req.job_id);
  free(lr);
  maybe_finish_close(a);
}

static void log_read_release(log_read_t *lr)
{
  uv_timer_stop(&lr->timer);
  uv_close((uv_handle_t *)&lr->timer, on_log_read_closed);
}

/* Reads the planned chunk of an open file into a fresh buffer (*out NULL when len is 0). */
static int read_chunk(int fd, const dt_logs_chunk_t *ch, uint8_t **out)
{
  *out = NULL;
  if (ch->len == 0)
    return 0;
  uint8_t *buf = malloc(ch->len);
  if (!buf)
    return DT_ENOMEM;
  size_t got = 0;
  while (got < ch->len) {
    ssize_t n = pread(fd, buf + got, ch->len - got, (off_t)(ch->start + got));
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      free(buf);
      return DT_EIO;
    }
    got += (size_t)n;
  }
  *out = buf;
  return 0;
}

/* On the threadpool: looks at the file; sends what is past the offset, or sends nothing yet
 * if there is nothing, the wait is not over and someone may still write. */
static void log_work(uv_work_t *w)
{
  log_read_t *lr = w->data;
  dt_agent_t *a = lr->agent;
  Distrain__V1__PutLogsRequest put = DISTRAIN__V1__PUT_LOGS_REQUEST__INIT;
  char path[4300], error[256] = "";
  uint8_t *data = NULL;
  int fd = -1;
  uint64_t size = 0;
  int rc = dt_logs_path(a->cfg.work_dir, lr->req.job_id, lr->req.rank, path, sizeof path);
  if (rc != 0) {
    snprintf(error, sizeof error, "job id '%.64s' and rank %d name no log file", lr->req.job_id,
             lr->req.rank);
    path[0] = '\0';
  } else if ((fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)) < 0) {
    if (errno == ENOENT)
      put.missing = 1; /* not written yet (or never): size 0 */
    else
      snprintf(error, sizeof error, "%s", strerror(errno));
  } else {
    struct stat st;
    if (fstat(fd, &st) != 0)
      snprintf(error, sizeof error, "%s", strerror(errno));
    else
      size = (uint64_t)st.st_size;
  }
  const dt_logs_chunk_t ch = dt_logs_chunk(size, lr->req.offset, lr->req.max_bytes);
  if (!error[0] && ch.len == 0 && !lr->expired && !(lr->req.final && !lr->writing))
    goto out; /* nothing new yet: the loop looks again */
  if (!error[0] && fd >= 0 && (rc = read_chunk(fd, &ch, &data)) != 0)
    snprintf(error, sizeof error, "%s", dt_strerror(rc));
  put.node_id = lr->node_id;
  put.request_id = lr->req.request_id;
  put.job_id = lr->req.job_id;
  put.rank = lr->req.rank;
  put.data.data = data;
  put.data.len = error[0] ? 0 : ch.len;
  put.offset = ch.start;
  put.size = size;
  dt_utf8_sanitize(error); /* shown to the user; the coordinator refuses strings not UTF-8 */
  dt_utf8_sanitize(path);
  put.error = error;
  put.path = path;
  put.writing = lr->writing;
  ProtobufCMessage *resp = NULL;
  char err[256];
  rc = dt_rpc_client_call(a->rpc, "PutLogs", &put.base, &resp, (int)dt_param_RpcTimeoutMs(), 0, err,
                          sizeof err);
  if (rc != 0)
    DT_DEBUG(WORKER, "PutLogs %llu failed: %s", (unsigned long long)lr->req.request_id, err);
  if (resp)
    protobuf_c_message_free_unpacked(resp, NULL);
  lr->answered = 1;
out:
  if (fd >= 0)
    close(fd);
  free(data);
}

static void on_log_poll(uv_timer_t *t);

static void log_work_done(uv_work_t *w, int status)
{
  log_read_t *lr = w->data;
  dt_agent_t *a = lr->agent;
  (void)status;
  lr->busy = 0;
  if (lr->answered || a->closing) {
    log_read_release(lr);
    return;
  }
  const uint64_t now = uv_now(a->loop);
  const uint64_t left = lr->deadline > now ? lr->deadline - now : 0;
  uv_timer_start(&lr->timer, on_log_poll, DT_MIN(left, (uint64_t)dt_param_LogPollMs()), 0);
}

static void log_read_queue(log_read_t *lr)
{
  dt_agent_t *a = lr->agent;
  const trainer_t *t = find_trainer(a, lr->req.job_id, lr->req.rank);
  lr->writing = t && !t->exited;
  lr->expired = uv_now(a->loop) >= lr->deadline;
  lr->busy = 1;
  lr->work.data = lr;
  uv_queue_work(a->loop, &lr->work, log_work, log_work_done);
}

static void on_log_poll(uv_timer_t *t)
{
  log_read_t *lr = t->data;
  if (!lr->agent->closing)
    log_read_queue(lr);
}

/* A LogRequest from a watch answer: the request names a job and a rank, never a path. */
static void log_read_start(dt_agent_t *a, const Distrain__V1__LogRequest *req)
{
  if (a->n_logs >= LOG_READS_MAX) {
    DT_WARN(WORKER, "%d log reads in progress: dropping the one for job %s rank %d", a->n_logs,
            req->job_id, req->rank);
    return;
  }
  log_read_t *lr = calloc(1, sizeof *lr);
  if (!lr)
    return;
  distrain__v1__log_request__init(&lr->req);
  if (!(lr->req.job_id = strdup(req->job_id))) {
    free(lr);
    return;
  }
  lr->req.request_id = req->request_id;
  lr->req.rank = req->rank;
  lr->req.offset = req->offset;
  lr->req.wait_ms = req->wait_ms;
  lr->req.final = req->final;
  lr->req.max_bytes =
      req->max_bytes ? DT_MIN(req->max_bytes, DT_LOGS_MAX_CHUNK) : DT_LOGS_MAX_CHUNK;
  snprintf(lr->node_id, sizeof lr->node_id, "%s", a->node_id);
  lr->agent = a;
  lr->deadline = uv_now(a->loop) + req->wait_ms;
  uv_timer_init(a->loop, &lr->timer);
  lr->timer.data = lr;
  lr->next = a->logs;
  a->logs = lr;
  a->n_logs++;
  log_read_queue(lr);
}

/* ------------------------------------------------------------------------------------------ */
/* Lifecycle                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/* NVML's start can take seconds (it initialises every GPU), longer than the coordinator waits
 * for a heartbeat: it runs on the threadpool, and heartbeats carry usage once it is done. */
static void usage_work(uv_work_t *w)
{
  dt_agent_t *a = w->data;
  const char **ids = calloc((size_t)a->n_gpus, sizeof *ids);
  if (!ids)
    return;
  for (int i = 0; i < a->n_gpus; i++)
    ids[i] = a->gpus[i].pci_bus_id;
  if (dt_gpu_usage_create(&a->usage_loaded, NULL, ids, a->n_gpus) != 0)
    a->usage_loaded = NULL;
  else
    dt_gpu_usage_ignore_xids(a->usage_loaded, a->cfg.ignore_xids, a->cfg.n_ignore_xids);
  free(ids);
}

static void usage_done(uv_work_t *w, int status)
{
  dt_agent_t *a = w->data;
  (void)status;
  a->usage_busy = 0;
  /* Heartbeats queued from now on sample it (on_heartbeat hands it to their work). */
  a->usage = a->usage_loaded;
  a->usage_loaded = NULL;
  if (a->closing)
    maybe_finish_close(a);
}

#ifdef DT_HAVE_CUDA
/* cfg.gpus as GPU numbers below n (agent.h): *count of them into gpu (n_max room), or
 * DT_EINVAL with the rule said. */
static int parse_gpus(const char *spec, int n, int *gpu, int n_max, int *count)
{
  *count = 0;
  if (!spec || strcmp(spec, "all") == 0) {
    for (int i = 0; i < n && i < n_max; i++)
      gpu[(*count)++] = i;
    return 0;
  }
  if (dt_parse_int_list(spec, 0, n - 1, gpu, n_max, count) != 0) {
    DT_ERROR(WORKER,
             "--gpus %s: expected all, none, or at most %d GPU numbers from 0 to %d separated "
             "by commas (this node's CUDA runtime shows %d GPU%s)",
             spec, n_max, n - 1, n, n == 1 ? "" : "s");
    return DT_EINVAL;
  }
  return 0;
}

/* The trainers' CUDA_VISIBLE_DEVICES: the distinct offered GPUs, named as this process's own
 * CUDA_VISIBLE_DEVICES names them (its n-th entry is GPU n) where it is set; each device's
 * `visible` is its GPU's position there. */
static int visible_list(dt_agent_t *a, const int *gpu)
{
  const char *mine = getenv("CUDA_VISIBLE_DEVICES");
  size_t off = 0;
  int distinct[256], nd = 0;
  for (int i = 0; i < a->n_gpus; i++) {
    int k = 0;
    while (k < nd && distinct[k] != gpu[i])
      k++;
    a->gpus[i].visible = k;
    if (k < nd)
      continue;
    distinct[nd++] = gpu[i];
    char name[128];
    snprintf(name, sizeof name, "%d", gpu[i]);
    if (mine) { /* its gpu[i]-th entry (the runtime counted at most that many) */
      const char *e = mine;
      for (int j = 0; j < gpu[i] && e; j++)
        e = strchr(e, ',') ? strchr(e, ',') + 1 : NULL;
      const size_t len = e ? strcspn(e, ",") : 0;
      if (!e || len == 0 || len >= sizeof name) {
        DT_ERROR(WORKER, "GPU %d has no entry in CUDA_VISIBLE_DEVICES=%s", gpu[i], mine);
        return DT_EINVAL;
      }
      snprintf(name, sizeof name, "%.*s", (int)len, e);
    }
    off += (size_t)snprintf(a->cuda_visible + off, sizeof a->cuda_visible - off, "%s%s",
                            off ? "," : "", name);
    if (off >= sizeof a->cuda_visible) {
      DT_ERROR(WORKER, "the offered GPUs' CUDA_VISIBLE_DEVICES is too long");
      return DT_EINVAL;
    }
  }
  return 0;
}
#endif

/* The GPUs the agent offers (cfg.gpus), from the CUDA runtime: their names and memory go to
 * NodeInfo.devices; a driver the runtime cannot use is said once, with both versions. No GPU
 * (none here, "none" asked, or a build without CUDA): CPU devices. */
static int detect_gpus(dt_agent_t *a)
{
  const char *want = a->cfg.gpus;
  const int listed = want && strcmp(want, "all") != 0 && strcmp(want, "none") != 0;
  a->cuda_visible[0] = '\0';
  if (want && strcmp(want, "none") == 0)
    return 0;
#ifdef DT_HAVE_CUDA
  char why[512];
  int n = 0, gpu[256], count;
  if (dt_cuda_probe(&n, why, sizeof why) != 0 || n == 0) {
    if (listed) {
      DT_ERROR(WORKER, "--gpus %s: this node has no usable GPU%s%s", want, why[0] ? ": " : "", why);
      return DT_ENOTSUP;
    }
    if (why[0])
      DT_WARN(WORKER, "no usable GPU: %s; offering %d CPU device%s", why, a->cfg.cpu_devices,
              a->cfg.cpu_devices == 1 ? "" : "s");
    return 0;
  }
  DT_CHECK(parse_gpus(want, n, gpu, (int)(sizeof gpu / sizeof *gpu), &count));
  a->gpus = calloc((size_t)count, sizeof *a->gpus);
  a->hb_usage = calloc((size_t)count, sizeof *a->hb_usage);
  if (!a->gpus || !a->hb_usage)
    return DT_ENOMEM;
  a->n_gpus = count;
  DT_CHECK(visible_list(a, gpu));
  for (int i = 0; i < count; i++) {
    dt_cuda_gpu_t g;
    if (dt_cuda_gpu_info(gpu[i], &g) != 0) /* logged; offered all the same, as "cuda" */
      snprintf(g.name, sizeof g.name, "cuda");
    snprintf(a->gpus[i].name, sizeof a->gpus[i].name, "%s", g.name);
    snprintf(a->gpus[i].pci_bus_id, sizeof a->gpus[i].pci_bus_id, "%s", g.pci_bus_id);
    a->gpus[i].memory_bytes = g.memory_bytes;
    DT_INFO(WORKER, "device %d: GPU %d, %s, %.1f GiB, PCI %s", i, gpu[i], g.name,
            (double)g.memory_bytes / (1 << 30), g.pci_bus_id[0] ? g.pci_bus_id : "?");
  }
  DT_INFO(WORKER, "trainers see CUDA_VISIBLE_DEVICES=%s", a->cuda_visible);
#else
  if (listed) {
    DT_ERROR(WORKER, "--gpus %s: this distrain-worker was built without CUDA", want);
    return DT_ENOTSUP;
  }
#endif
  return 0;
}

static int detect_devices(dt_agent_t *a)
{
  DT_CHECK(detect_gpus(a));
  const int gpu = a->n_gpus > 0;
  const int n = gpu ? a->n_gpus : a->cfg.cpu_devices;
  a->devices = calloc((size_t)n, sizeof *a->devices);
  a->device_ptrs = calloc((size_t)n, sizeof *a->device_ptrs);
  if (!a->devices || !a->device_ptrs)
    return DT_ENOMEM;
  for (int i = 0; i < n; i++) {
    distrain__v1__device__init(&a->devices[i]);
    a->devices[i].kind = gpu ? "cuda" : "cpu";
    a->devices[i].index = i;
    a->devices[i].name = gpu ? a->gpus[i].name : "cpu";
    a->devices[i].memory_bytes = gpu ? a->gpus[i].memory_bytes : 0;
    a->device_ptrs[i] = &a->devices[i];
  }
  if (!gpu)
    DT_INFO(WORKER, "offering %d CPU device%s (no GPU%s)", n, n == 1 ? "" : "s",
            a->cfg.gpus && strcmp(a->cfg.gpus, "none") == 0 ? ": --gpus none" : " found");
  distrain__v1__node_info__init(&a->info);
  a->info.hostname = (char *)a->cfg.hostname;
  a->info.devices = a->device_ptrs;
  a->info.n_devices = (size_t)n;
  a->info.agent_version = "0.1.0";
  return 0;
}

int dt_agent_start(dt_agent_t **out, uv_loop_t *loop, const dt_agent_config_t *cfg)
{
  dt_agent_t *a = calloc(1, sizeof *a);
  int ret = 0;
  if (!a)
    return DT_ENOMEM;
  a->loop = loop;
  a->cfg = *cfg;
  if (!realpath(cfg->token_file, a->token_file_abs)) {
    DT_ERROR(WORKER, "%s: %s", cfg->token_file, strerror(errno));
    free(a);
    return DT_ENOENT;
  }
  DT_CHECK_GOTO(dt_rpc_read_token(cfg->token_file, a->token, sizeof a->token), ret, fail);
  DT_CHECK_GOTO(dt_mkdir_p(cfg->work_dir), ret, fail);
  prune_logs(a);
  load_node_id(a);
  DT_CHECK_GOTO(detect_devices(a), ret, fail);
  DT_CHECK_GOTO(dt_rpc_client_create(cfg->coordinator, a->token,
                                     &distrain__v1__coordinator__descriptor, &a->rpc),
                ret, fail);
  uv_timer_init(loop, &a->hb_timer);
  a->hb_timer.data = a;
  uv_timer_init(loop, &a->retry_timer);
  a->retry_timer.data = a;
  a->heartbeat_ms = 500;
  if (a->n_gpus > 0) {
    a->usage_busy = 1;
    a->usage_work.data = a;
    uv_queue_work(loop, &a->usage_work, usage_work, usage_done);
  }
  DT_INFO(WORKER, "registering with %s as %s", cfg->coordinator, cfg->hostname);
  start_register(a);
  *out = a;
  return 0;
fail:
  free(a->devices);
  free(a->device_ptrs);
  free(a->gpus);
  free(a->hb_usage);
  free(a);
  return ret;
}

void dt_agent_summary(const dt_agent_t *a, char *buf, size_t len)
{
  size_t off = 0, running = 0, shown = 0;
  for (const trainer_t *t = a->trainers; t; t = t->next)
    running += !t->exited;
#define ADD(...)                                                                                   \
  do {                                                                                             \
    if (off < len)                                                                                 \
      off += (size_t)snprintf(buf + off, len - off, __VA_ARGS__);                                  \
  } while (0)
  if (a->registered)
    ADD("%s on %s", a->node_id, a->cfg.coordinator);
  else if (a->reg_busy || !a->reg_err[0]) /* reg_err is the threadpool's while busy */
    ADD("registering with %s", a->cfg.coordinator);
  else
    ADD("registering with %s (last try: %.120s)", a->cfg.coordinator, a->reg_err);
  ADD(", %zu trainer%s running", running, running == 1 ? "" : "s");
  /* The first few ranks with their job and step; the job is named when it changes. */
  const char *job = NULL;
  for (const trainer_t *t = a->trainers; t && shown < 4; t = t->next) {
    if (t->exited)
      continue;
    const int same = job && strcmp(job, t->job_id) == 0;
    ADD("%s", shown ? ", " : " (");
    if (!same)
      ADD("%s ", t->job_id);
    ADD("rank %d step %lld", t->status.rank, (long long)t->status.step);
    job = t->job_id;
    shown++;
  }
  if (shown)
    ADD("%s)", running > shown ? ", ..." : "");
#undef ADD
}

/* The agent is freed once both of its timers have finished closing (their memory is part of
 * the agent, and libuv touches a closing handle until its close callback has run). */
static void on_timer_closed(uv_handle_t *h)
{
  dt_agent_t *a = h->data;
  if (--a->closing_handles > 0)
    return;
  void (*cb)(void *) = a->close_cb;
  void *ud = a->close_ud;
  free(a->devices);
  free(a->device_ptrs);
  free(a->gpus);
  free(a->hb_usage);
  free(a);
  if (cb)
    cb(ud);
}

static void maybe_finish_close(dt_agent_t *a)
{
  if (a->closing == 1 && !a->trainers && !a->rpc_cancelled) {
    char err[256];
    /* Goodbye: the coordinator need not wait for this node's silence (nor wait for it, if it
     * is stopping too: its trainers' steps are all in). */
    if (a->graceful_close && leaving_heartbeat(a, NULL, 1, 1000, err, sizeof err) != 0)
      DT_WARN(WORKER, "could not tell the coordinator that this agent exits: %s", err);
    a->rpc_cancelled = 1; /* the watch long-poll must not hold the exit */
    dt_rpc_client_cancel_all(a->rpc);
  }
  if (!a->closing || a->trainers || a->logs || a->hb_busy || a->watch_busy || a->reg_busy ||
      a->usage_busy || a->closing == 2)
    return;
  a->closing = 2;
  dt_gpu_usage_destroy(a->usage);
  a->usage = NULL;
  if (a->assignment)
    distrain__v1__watch_assignment_response__free_unpacked(a->assignment, NULL);
  a->assignment = NULL;
  dt_rpc_client_destroy(a->rpc);
  a->rpc = NULL;
  a->closing_handles = 2;
  uv_close((uv_handle_t *)&a->hb_timer, on_timer_closed);
  uv_close((uv_handle_t *)&a->retry_timer, on_timer_closed);
}

/* Tells the coordinator, before the trainers are stopped, that this node is leaving: it plans
 * no new work here, and the restart of the job whose trainers save their step and exit is no
 * failure. One try of at most a second on the loop thread: the agent stops either way. 0 when
 * the coordinator took it (and so can commit the trainers' last step). */
static int announce_leaving(dt_agent_t *a)
{
  if (!a->registered)
    return DT_EUNAVAIL;
  char err[256];
  const int rc = leaving_heartbeat(a, NULL, 0, 1000, err, sizeof err);
  if (rc != 0)
    DT_WARN(WORKER,
            "could not tell the coordinator that this node is leaving (%s): its trainers are "
            "killed, as no last step of theirs could be committed",
            err);
  return rc;
}

void dt_agent_close(dt_agent_t *a, void (*cb)(void *ud), void *ud)
{
  a->graceful_close = announce_leaving(a) == 0;
  a->closing = 1;
  a->close_cb = cb;
  a->close_ud = ud;
  uv_timer_stop(&a->hb_timer);
  uv_timer_stop(&a->retry_timer);
  for (trainer_t *t = a->trainers; t; t = t->next) {
    if (t->exited) {
      if (a->graceful_close && undelivered(t))
        farewell(a, t);
      trainer_release(t);
    } else if (t->reaped) {
      trainer_exited(t); /* waits no longer for its pipe */
    } else {
      trainer_stop(t, a->graceful_close);
    }
  }
  for (log_read_t *lr = a->logs, *next; lr; lr = next) {
    next = lr->next;
    if (!lr->busy) /* a busy one is released when its work is done */
      log_read_release(lr);
  }
  maybe_finish_close(a);
}
