/* bench_coordinator.c — load generator for distrain-coordinator (not a CTest test).
 *
 * Simulates many worker agents against a real distrain-coordinator process that it starts
 * itself (fresh --state-dir in a temp dir, --listen 127.0.0.1:0 --port-file, --token-file,
 * --heartbeat-ms). The simulated agents are plain state records driven by ONE thread over ONE
 * gRPC completion queue (gRPC C core async API): thousands of calls are in flight at once,
 * spread over several channels (one TCP connection each). Every scenario starts its own
 * coordinator and prints a human table followed by one JSON line of figures (a line that
 * starts with '{').
 *
 * Scenarios (--scenario LIST, comma separated, or "all"):
 *   register    N agents (each --agents value) register (RegisterWorker, one cpu device):
 *               time until all are registered. Each agent starts heartbeating at its
 *               staggered slot as soon as it is registered, as a real agent does.
 *   heartbeat   N agents heartbeat every --heartbeat-ms (500 ms, staggered) for --hb-seconds
 *               (--hb-seconds-large when N > 1000): client-measured latency p50/p99/max, the
 *               coordinator's CPU (utime+stime from /proc/PID/stat, % of one core) and RSS.
 *   rendezvous  --rdv-agents single-device agents each hold a WatchAssignment long-poll (one
 *               sync watch, then a held one), all heartbeating; one job with parallel.dp = N
 *               (batch N, micro_batch 1, min_nodes = max_nodes = N) is submitted: time from
 *               SubmitJob until every agent's long-poll returned its generation-1 Assignment.
 *   failure     a real distrain-worker (--cpu-devices 1) is started, observed ALIVE in
 *               ListNodes, SIGKILLed; time from the kill until ListNodes shows it DEAD (polled
 *               every 20 ms), against heartbeat period x dead-after + 500 ms. --fd-repeats times.
 *
 * Command lines (from the build dir; binaries are found relative to this one):
 *   tests/bench/bench_coordinator --scenario all
 *   tests/bench/bench_coordinator --scenario register,heartbeat --agents 1000,10000
 *   tests/bench/bench_coordinator --scenario heartbeat --agents 10000 --hb-seconds-large 5
 *   tests/bench/bench_coordinator --scenario rendezvous --rdv-agents 10000
 *   tests/bench/bench_coordinator --scenario failure --fd-repeats 5
 *   DISTRAIN_RPC_PENDING_PER_METHOD=1024 is passed to the coordinator with --pending 1024.
 *
 * Other flags: --channels N (16), --window N (register calls in flight, default all),
 * --watch-window N (sync WatchAssignment calls in flight while setting up, 500),
 * --pre-submit-pause MS (heartbeat MS more before SubmitJob, to attach perf to the coordinator),
 * --submit-first (register: a job with min_nodes = N is submitted first and waits for them all;
 * also prints the time from the first registration until the job is planned),
 * --heartbeat-ms N (500), --coordinator-bin PATH, --worker-bin PATH, --keep-tmp, --verbose.
 *
 * The coordinator and this generator run on the same machine and share its cores; every table
 * also gives the generator's own CPU and what other processes used meanwhile (/proc/stat), so
 * a figure taken while something else was busy is flagged as such. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "distrain.pb-c.h"
#include "rpc.h"

extern char **environ;

/* ------------------------------------------------------------------------------------------ */
/* Small helpers                                                                               */
/* ------------------------------------------------------------------------------------------ */

static int g_verbose;

static double now_ms(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(double ms)
{
  if (ms <= 0)
    return;
  struct timespec ts = {(time_t)(ms / 1e3), (long)((ms - (double)(time_t)(ms / 1e3) * 1e3) * 1e6)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static pid_t g_children[64];
static int g_nchildren;

static void kill_children(void)
{
  for (int i = 0; i < g_nchildren; i++)
    if (g_children[i] > 0)
      kill(g_children[i], SIGKILL);
}

static void die(const char *fmt, ...)
{
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "bench_coordinator: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  kill_children();
  exit(1);
}

static void *xcalloc(size_t n, size_t size)
{
  void *p = calloc(n ? n : 1, size);
  if (!p)
    die("out of memory");
  return p;
}

typedef struct {
  double *v;
  size_t n, cap;
  int sorted;
} samples_t;

static void samples_add(samples_t *s, double x)
{
  if (s->n == s->cap) {
    s->cap = s->cap ? s->cap * 2 : 4096;
    s->v = realloc(s->v, s->cap * sizeof *s->v);
    if (!s->v)
      die("out of memory");
  }
  s->v[s->n++] = x;
  s->sorted = 0;
}

static void samples_reset(samples_t *s)
{
  s->n = 0;
  s->sorted = 0;
}

static int cmp_double(const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Nearest-rank percentile (p in [0, 100]); 0 when empty. */
static double samples_pct(samples_t *s, double p)
{
  if (s->n == 0)
    return 0;
  if (!s->sorted) {
    qsort(s->v, s->n, sizeof *s->v, cmp_double);
    s->sorted = 1;
  }
  size_t k = (size_t)(p / 100.0 * (double)s->n + 0.999999);
  k = k < 1 ? 1 : k > s->n ? s->n : k;
  return s->v[k - 1];
}

/* CPU seconds (utime + stime) and VmRSS (KiB) of a process. */
typedef struct {
  double cpu_s;
  long rss_kb;
  int threads;
} proc_snap_t;

static int proc_snap(pid_t pid, proc_snap_t *out)
{
  char path[64], buf[4096];
  memset(out, 0, sizeof *out);
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *fp = fopen(path, "r");
  if (!fp)
    return -1;
  size_t n = fread(buf, 1, sizeof buf - 1, fp);
  fclose(fp);
  buf[n] = '\0';
  char *p = strrchr(buf, ')');
  if (!p)
    return -1;
  /* after ')': field 3 (state) is token 0; utime is field 14, stime 15, num_threads 20 */
  unsigned long long ut = 0, st = 0;
  long nthreads = 0;
  int field = 3;
  for (char *tok = strtok(p + 1, " "); tok; tok = strtok(NULL, " "), field++) {
    if (field == 14)
      ut = strtoull(tok, NULL, 10);
    else if (field == 15)
      st = strtoull(tok, NULL, 10);
    else if (field == 20) {
      nthreads = strtol(tok, NULL, 10);
      break;
    }
  }
  out->cpu_s = (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
  out->threads = (int)nthreads;
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  fp = fopen(path, "r");
  if (!fp)
    return -1;
  while (fgets(buf, sizeof buf, fp))
    if (strncmp(buf, "VmRSS:", 6) == 0)
      out->rss_kb = strtol(buf + 6, NULL, 10);
  fclose(fp);
  return 0;
}

/* Busy CPU seconds of the whole machine (all cores), from /proc/stat. */
static double machine_busy_s(void)
{
  FILE *fp = fopen("/proc/stat", "r");
  if (!fp)
    return 0;
  unsigned long long v[8] = {0};
  int n = fscanf(fp, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                 &v[4], &v[5], &v[6], &v[7]);
  fclose(fp);
  if (n < 5)
    return 0;
  unsigned long long busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]; /* minus idle, iowait */
  return (double)busy / (double)sysconf(_SC_CLK_TCK);
}

static double self_cpu_s(void)
{
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
         (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

/* CPU use over a measurement window: the coordinator, this generator, everything else. */
typedef struct {
  pid_t pid;
  double t0, coord0, self0, busy0;
  double window_s, coord_pct, gen_pct, other_pct;
  long rss_kb;
  int threads;
} load_t;

static void load_begin(load_t *l, pid_t pid)
{
  proc_snap_t ps;
  memset(l, 0, sizeof *l);
  l->pid = pid;
  proc_snap(pid, &ps);
  l->coord0 = ps.cpu_s;
  l->self0 = self_cpu_s();
  l->busy0 = machine_busy_s();
  l->t0 = now_ms();
}

static void load_end(load_t *l)
{
  proc_snap_t ps;
  proc_snap(l->pid, &ps);
  double coord = ps.cpu_s - l->coord0, self = self_cpu_s() - l->self0;
  double busy = machine_busy_s() - l->busy0;
  l->window_s = (now_ms() - l->t0) / 1e3;
  if (l->window_s <= 0)
    l->window_s = 1e-9;
  l->coord_pct = 100.0 * coord / l->window_s;
  l->gen_pct = 100.0 * self / l->window_s;
  l->other_pct = 100.0 * (busy - coord - self) / l->window_s;
  if (l->other_pct < 0)
    l->other_pct = 0;
  l->rss_kb = ps.rss_kb;
  l->threads = ps.threads;
}

static void print_load(const load_t *l)
{
  printf("  %-40s %10.0f %% / %.0f %% / %.0f %% of one core (%ld CPUs)\n",
         "CPU: coordinator / generator / others", l->coord_pct, l->gen_pct, l->other_pct,
         sysconf(_SC_NPROCESSORS_ONLN));
  printf("  %-40s %10.1f MiB (%d threads)\n", "coordinator RSS", l->rss_kb / 1024.0, l->threads);
  printf("  note: the coordinator and this generator share the machine's cores%s\n",
         l->other_pct > 20 ? "; OTHER PROCESSES WERE BUSY during this window" : "");
}

#define LOAD_JSON_FMT                                                                              \
  "\"coord_cpu_pct\":%.1f,\"gen_cpu_pct\":%.1f,\"other_cpu_pct\":%.1f,\"coord_rss_kb\":%ld,"       \
  "\"ncpu\":%ld"
#define LOAD_JSON_ARGS(l)                                                                          \
  (l).coord_pct, (l).gen_pct, (l).other_pct, (l).rss_kb, sysconf(_SC_NPROCESSORS_ONLN)

/* ------------------------------------------------------------------------------------------ */
/* Options                                                                                     */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
  char coord_bin[PATH_MAX], worker_bin[PATH_MAX];
  int agents[16], n_agents;
  int rdv_agents;
  double hb_seconds, hb_seconds_large;
  int channels;
  int window;
  int watch_window;
  int pre_submit_pause_ms;
  int submit_first;
  int heartbeat_ms;
  int pending; /* DISTRAIN_RPC_PENDING_PER_METHOD for the coordinator; 0: leave it */
  int fd_repeats;
  int keep_tmp;
  int do_register, do_heartbeat, do_rendezvous, do_failure;
} opts_t;

static opts_t g_opt;

/* ------------------------------------------------------------------------------------------ */
/* Coordinator and worker processes                                                            */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
  char dir[256];
  char token_file[300], port_file[300], state_dir[300], log[300];
  char token[128];
  char target[64];
  pid_t pid;
  int port;
} coord_proc_t;

static void register_child(pid_t pid)
{
  for (int i = 0; i < g_nchildren; i++)
    if (g_children[i] <= 0) {
      g_children[i] = pid;
      return;
    }
  if (g_nchildren < (int)(sizeof g_children / sizeof g_children[0]))
    g_children[g_nchildren++] = pid;
}

static void forget_child(pid_t pid)
{
  for (int i = 0; i < g_nchildren; i++)
    if (g_children[i] == pid)
      g_children[i] = 0;
}

/* Spawns argv with stdout and stderr appended to log; extra (NAME=VALUE) added to the env. */
static pid_t spawn(char *const argv[], const char *log, const char *extra)
{
  size_t n = 0;
  while (environ[n])
    n++;
  char **envp = xcalloc(n + 2, sizeof *envp);
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (extra && strncmp(environ[i], extra, (size_t)(strchr(extra, '=') - extra + 1)) == 0)
      continue;
    envp[k++] = environ[i];
  }
  if (extra)
    envp[k++] = (char *)extra;
  envp[k] = NULL;
  int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0)
    die("%s: %s", log, strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd, 1);
  posix_spawn_file_actions_adddup2(&fa, fd, 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, envp);
  posix_spawn_file_actions_destroy(&fa);
  close(fd);
  free(envp);
  if (rc != 0)
    die("cannot start %s: %s", argv[0], strerror(rc));
  register_child(pid);
  return pid;
}

static int rm_rf(const char *path)
{
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
  return system(cmd);
}

static void coord_start(coord_proc_t *cp, int heartbeat_ms)
{
  memset(cp, 0, sizeof *cp);
  const char *tmp = getenv("TMPDIR");
  snprintf(cp->dir, sizeof cp->dir, "%s/dt-bench-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(cp->dir))
    die("mkdtemp: %s", strerror(errno));
  snprintf(cp->token_file, sizeof cp->token_file, "%s/token", cp->dir);
  snprintf(cp->port_file, sizeof cp->port_file, "%s/port", cp->dir);
  snprintf(cp->state_dir, sizeof cp->state_dir, "%s/state", cp->dir);
  snprintf(cp->log, sizeof cp->log, "%s/coordinator.log", cp->dir);
  if (dt_rpc_write_new_token(cp->token_file, cp->token, sizeof cp->token) != 0)
    die("cannot write a token");
  char hb[32], pend[80];
  snprintf(hb, sizeof hb, "%d", heartbeat_ms);
  snprintf(pend, sizeof pend, "DISTRAIN_RPC_PENDING_PER_METHOD=%d", g_opt.pending);
  char *argv[] = {g_opt.coord_bin,
                  "--listen",
                  "127.0.0.1:0",
                  "--state-dir",
                  cp->state_dir,
                  "--token-file",
                  cp->token_file,
                  "--port-file",
                  cp->port_file,
                  "--heartbeat-ms",
                  hb,
                  NULL};
  cp->pid = spawn(argv, cp->log, g_opt.pending > 0 ? pend : NULL);
  double t0 = now_ms();
  while (now_ms() - t0 < 15000) {
    FILE *fp = fopen(cp->port_file, "r");
    if (fp) {
      int port = 0;
      int ok = fscanf(fp, "%d", &port) == 1 && port > 0;
      fclose(fp);
      if (ok) {
        cp->port = port;
        snprintf(cp->target, sizeof cp->target, "127.0.0.1:%d", port);
        return;
      }
    }
    int st;
    if (waitpid(cp->pid, &st, WNOHANG) == cp->pid)
      die("the coordinator exited at start (see %s)", cp->log);
    sleep_ms(5);
  }
  die("the coordinator did not write %s within 15 s", cp->port_file);
}

/* SIGTERM, then SIGKILL after 10 s. */
static void stop_process(pid_t pid)
{
  if (pid <= 0)
    return;
  kill(pid, SIGTERM);
  double t0 = now_ms();
  int st;
  while (waitpid(pid, &st, WNOHANG) == 0) {
    if (now_ms() - t0 > 10000) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      break;
    }
    sleep_ms(5);
  }
  forget_child(pid);
}

static void coord_stop(coord_proc_t *cp)
{
  stop_process(cp->pid);
  cp->pid = 0;
  if (g_opt.keep_tmp)
    printf("  (kept %s)\n", cp->dir);
  else
    rm_rf(cp->dir);
}

/* ------------------------------------------------------------------------------------------ */
/* The async client: channels, one completion queue, calls                                     */
/* ------------------------------------------------------------------------------------------ */

enum { M_REGISTER, M_HEARTBEAT, M_WATCH, M_SUBMIT, M_COUNT };
static const char *const k_method_names[M_COUNT] = {"RegisterWorker", "Heartbeat",
                                                    "WatchAssignment", "SubmitJob"};

typedef enum { W_NONE, W_SYNC, W_HELD, W_DONE } watch_state_t;

typedef struct {
  char node_id[32];
  int registered;
  int hb_inflight;
  uint64_t hb_seq;
  watch_state_t watch;
  uint64_t version;
} agent_t;

typedef struct call {
  struct call *next, *prev; /* in-flight list, for cancelling at the end */
  int method;
  int agent;
  int epoch; /* hb_reset_stats epoch the call was sent in */
  double t0, lag;
  grpc_call *call;
  grpc_byte_buffer *send_bb, *recv_bb;
  grpc_metadata_array recv_md, trailing_md;
  grpc_status_code status;
  grpc_slice details;
} call_t;

typedef struct {
  uint64_t sent, ok, failed;
  int last_status;
  char last_error[160];
} method_stats_t;

typedef struct bench {
  coord_proc_t *coord;
  grpc_completion_queue *cq;
  grpc_channel **ch;
  void **reg; /* [channel][method] registered-call handles */
  int nch;
  grpc_metadata auth;

  agent_t *agents;
  int n;
  call_t inflight; /* list head */
  size_t n_inflight;
  method_stats_t stats[M_COUNT];

  /* registration */
  int reg_sent, reg_done, reg_inflight, reg_window;
  double reg_t0, reg_last_ms;
  samples_t reg_lat;

  /* heartbeats: slot s is agent s % n, due at start + s * period / n */
  int hb_on;
  double hb_start, hb_period;
  uint64_t hb_slot;
  uint64_t hb_skipped; /* slot came while the previous heartbeat was still in flight */
  double hb_lag_max, hb_lag_sum;
  uint64_t hb_lag_n;
  samples_t hb_lat;
  uint64_t hb_reregister;
  int epoch; /* bumped by hb_reset_stats: older calls are not counted */

  /* watches */
  int watch_held, watch_window, watch_sync_inflight;
  int *watch_todo, n_todo; /* agents that must (re)sync their watch */
  int watch_done;          /* agents that received their assignment */
  uint64_t want_gen;       /* generation the rendezvous waits for */
  double submit_t0;        /* when SubmitJob was sent */
  double submit_resp;      /* when its answer came */
  char job_id[64];
  samples_t deliver; /* per-agent delivery time since submit_t0 (ms) */
  uint8_t *rank_seen;
  int ranks_distinct, rank_dups, wrong_world;
  uint64_t watch_empty; /* a held watch answered without the assignment (timeout, etc.) */
} bench_t;

static gpr_timespec deadline_in(double ms)
{
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                      gpr_time_from_micros((int64_t)(ms * 1000.0), GPR_TIMESPAN));
}

static void bench_connect(bench_t *b, coord_proc_t *cp, int n_agents)
{
  memset(b, 0, sizeof *b);
  b->coord = cp;
  b->n = n_agents;
  b->agents = xcalloc((size_t)n_agents, sizeof *b->agents);
  b->inflight.next = b->inflight.prev = &b->inflight;
  b->cq = grpc_completion_queue_create_for_next(NULL);
  b->nch = g_opt.channels;
  b->ch = xcalloc((size_t)b->nch, sizeof *b->ch);
  b->reg = xcalloc((size_t)b->nch * M_COUNT, sizeof *b->reg);
  /* A local subchannel pool per channel: each channel gets its own TCP connection instead of
   * sharing the global pool's one subchannel for the same target. */
  grpc_arg args[3];
  memset(args, 0, sizeof args);
  args[0].type = GRPC_ARG_INTEGER;
  args[0].key = (char *)GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
  args[0].value.integer = 1;
  args[1].type = GRPC_ARG_INTEGER;
  args[1].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  args[1].value.integer = DT_RPC_MAX_MESSAGE;
  args[2].type = GRPC_ARG_INTEGER;
  args[2].key = (char *)GRPC_ARG_ENABLE_RETRIES;
  args[2].value.integer = 0;
  grpc_channel_args ca = {3, args};
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  for (int i = 0; i < b->nch; i++) {
    b->ch[i] = grpc_channel_create(cp->target, creds, &ca);
    for (int m = 0; m < M_COUNT; m++) {
      char path[128];
      snprintf(path, sizeof path, "/%s/%s", distrain__v1__coordinator__descriptor.name,
               k_method_names[m]);
      b->reg[i * M_COUNT + m] = grpc_channel_register_call(b->ch[i], path, NULL, NULL);
    }
    /* connect now, not on the first call */
    grpc_channel_check_connectivity_state(b->ch[i], 1);
  }
  grpc_channel_credentials_release(creds);
  char bearer[300];
  snprintf(bearer, sizeof bearer, "Bearer %s", cp->token);
  b->auth.key = grpc_slice_from_static_string("authorization");
  b->auth.value = grpc_slice_from_copied_string(bearer);
}

static void start_call(bench_t *b, int method, int agent, const ProtobufCMessage *req,
                       double timeout_ms)
{
  call_t *c = xcalloc(1, sizeof *c);
  c->method = method;
  c->agent = agent;
  int chn = (agent < 0 ? 0 : agent) % b->nch;
  c->call = grpc_channel_create_registered_call(b->ch[chn], NULL, GRPC_PROPAGATE_DEFAULTS, b->cq,
                                                b->reg[chn * M_COUNT + method],
                                                deadline_in(timeout_ms), NULL);
  size_t len = protobuf_c_message_get_packed_size(req);
  grpc_slice payload = grpc_slice_malloc(len);
  protobuf_c_message_pack(req, GRPC_SLICE_START_PTR(payload));
  c->send_bb = grpc_raw_byte_buffer_create(&payload, 1);
  grpc_slice_unref(payload);
  grpc_metadata_array_init(&c->recv_md);
  grpc_metadata_array_init(&c->trailing_md);
  c->details = grpc_empty_slice();
  c->status = GRPC_STATUS_UNKNOWN;
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[0].data.send_initial_metadata.count = 1;
  ops[0].data.send_initial_metadata.metadata = &b->auth;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = c->send_bb;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &c->recv_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &c->recv_bb;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &c->trailing_md;
  ops[5].data.recv_status_on_client.status = &c->status;
  ops[5].data.recv_status_on_client.status_details = &c->details;
  c->epoch = b->epoch;
  c->t0 = now_ms();
  grpc_call_error e = grpc_call_start_batch(c->call, ops, 6, c, NULL);
  if (e != GRPC_CALL_OK)
    die("grpc_call_start_batch: error %d", (int)e);
  c->next = b->inflight.next;
  c->prev = &b->inflight;
  b->inflight.next->prev = c;
  b->inflight.next = c;
  b->n_inflight++;
  b->stats[method].sent++;
}

static void call_free(bench_t *b, call_t *c)
{
  c->prev->next = c->next;
  c->next->prev = c->prev;
  b->n_inflight--;
  grpc_byte_buffer_destroy(c->send_bb);
  if (c->recv_bb)
    grpc_byte_buffer_destroy(c->recv_bb);
  grpc_metadata_array_destroy(&c->recv_md);
  grpc_metadata_array_destroy(&c->trailing_md);
  grpc_slice_unref(c->details);
  grpc_call_unref(c->call);
  free(c);
}

/* Unpacks the answer of an OK call (NULL on a malformed one). */
static void *unpack_reply(call_t *c, const ProtobufCMessageDescriptor *d)
{
  if (!c->recv_bb)
    return NULL;
  grpc_byte_buffer_reader r;
  if (!grpc_byte_buffer_reader_init(&r, c->recv_bb))
    return NULL;
  grpc_slice s = grpc_byte_buffer_reader_readall(&r);
  grpc_byte_buffer_reader_destroy(&r);
  void *m = protobuf_c_message_unpack(d, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
  grpc_slice_unref(s);
  return m;
}

/* ---- requests ---- */

static void send_register(bench_t *b, int a)
{
  Distrain__V1__Device dev = DISTRAIN__V1__DEVICE__INIT;
  Distrain__V1__Device *devs[1] = {&dev};
  Distrain__V1__NodeInfo info = DISTRAIN__V1__NODE_INFO__INIT;
  Distrain__V1__RegisterWorkerRequest req = DISTRAIN__V1__REGISTER_WORKER_REQUEST__INIT;
  char host[64];
  snprintf(host, sizeof host, "bench-agent-%d", a);
  dev.kind = "cpu";
  dev.index = 0;
  dev.memory_bytes = 1ull << 30;
  dev.name = "cpu";
  info.hostname = host;
  info.devices = devs;
  info.n_devices = 1;
  info.agent_version = "bench";
  req.node = &info;
  start_call(b, M_REGISTER, a, &req.base, 60000);
}

static void send_heartbeat(bench_t *b, int a, double lag)
{
  agent_t *ag = &b->agents[a];
  Distrain__V1__HeartbeatRequest req = DISTRAIN__V1__HEARTBEAT_REQUEST__INIT;
  req.node_id = ag->node_id;
  req.seq = ++ag->hb_seq;
  ag->hb_inflight = 1;
  start_call(b, M_HEARTBEAT, a, &req.base, 5000); /* the agent's RPC timeout */
  b->inflight.next->lag = lag;
}

static void send_watch(bench_t *b, int a, uint64_t known, uint32_t timeout_ms)
{
  Distrain__V1__WatchAssignmentRequest req = DISTRAIN__V1__WATCH_ASSIGNMENT_REQUEST__INIT;
  req.node_id = b->agents[a].node_id;
  req.known_version = known;
  req.timeout_ms = timeout_ms;
  start_call(b, M_WATCH, a, &req.base, (double)timeout_ms + 15000.0);
}

/* ---- completions ---- */

static void on_register_done(bench_t *b, call_t *c)
{
  agent_t *ag = &b->agents[c->agent];
  b->reg_inflight--;
  Distrain__V1__RegisterWorkerResponse *r =
      c->status == GRPC_STATUS_OK
          ? unpack_reply(c, &distrain__v1__register_worker_response__descriptor)
          : NULL;
  if (r) {
    snprintf(ag->node_id, sizeof ag->node_id, "%s", r->node_id);
    ag->registered = 1;
    b->reg_done++;
    b->reg_last_ms = now_ms();
    samples_add(&b->reg_lat, b->reg_last_ms - c->t0);
    distrain__v1__register_worker_response__free_unpacked(r, NULL);
  } else {
    send_register(b, c->agent); /* retry, as an agent would */
    b->reg_inflight++;
  }
}

static void on_heartbeat_done(bench_t *b, call_t *c)
{
  agent_t *ag = &b->agents[c->agent];
  ag->hb_inflight = 0;
  if (c->status != GRPC_STATUS_OK || c->epoch != b->epoch)
    return;
  samples_add(&b->hb_lat, now_ms() - c->t0);
  b->hb_lag_sum += c->lag;
  b->hb_lag_n++;
  if (c->lag > b->hb_lag_max)
    b->hb_lag_max = c->lag;
  Distrain__V1__HeartbeatResponse *r =
      unpack_reply(c, &distrain__v1__heartbeat_response__descriptor);
  if (r) {
    b->hb_reregister += r->reregister;
    distrain__v1__heartbeat_response__free_unpacked(r, NULL);
  }
}

/* An agent whose watch failed (or never started) syncs again, as a real agent would. */
static void watch_retry(bench_t *b, int a)
{
  agent_t *ag = &b->agents[a];
  if (ag->watch == W_HELD)
    b->watch_held--;
  ag->watch = W_NONE;
  b->watch_todo[b->n_todo++] = a;
}

static void on_watch_done(bench_t *b, call_t *c)
{
  agent_t *ag = &b->agents[c->agent];
  double t = now_ms();
  if (ag->watch == W_SYNC)
    b->watch_sync_inflight--;
  Distrain__V1__WatchAssignmentResponse *r =
      c->status == GRPC_STATUS_OK
          ? unpack_reply(c, &distrain__v1__watch_assignment_response__descriptor)
          : NULL;
  if (!r) {
    if (ag->watch != W_DONE && b->watch_window)
      watch_retry(b, c->agent);
    return;
  }
  ag->version = r->version;
  if (ag->watch == W_SYNC) { /* synced: now hold one, as an idle agent does */
    ag->watch = W_HELD;
    b->watch_held++;
    send_watch(b, c->agent, r->version, 120000);
  } else if (ag->watch == W_HELD) {
    const Distrain__V1__Assignment *as = r->n_assignments ? r->assignments[0] : NULL;
    if (as && b->want_gen && as->generation == b->want_gen) {
      ag->watch = W_DONE;
      b->watch_done++;
      samples_add(&b->deliver, t - b->submit_t0);
      if (as->world_size != b->n)
        b->wrong_world++;
      for (size_t k = 0; k < as->n_ranks; k++) {
        int rank = as->ranks[k]->rank;
        if (rank < 0 || rank >= b->n || b->rank_seen[rank])
          b->rank_dups++;
        else
          b->rank_seen[rank] = 1, b->ranks_distinct++;
      }
    } else if (b->watch_window) {
      b->watch_empty++; /* timeout or an unrelated change: watch again */
      send_watch(b, c->agent, r->version, 120000);
    }
  }
  distrain__v1__watch_assignment_response__free_unpacked(r, NULL);
}

static void on_submit_done(bench_t *b, call_t *c)
{
  b->submit_resp = now_ms();
  if (c->status != GRPC_STATUS_OK)
    return;
  Distrain__V1__SubmitJobResponse *r =
      unpack_reply(c, &distrain__v1__submit_job_response__descriptor);
  if (r) {
    snprintf(b->job_id, sizeof b->job_id, "%s", r->job_id);
    distrain__v1__submit_job_response__free_unpacked(r, NULL);
  }
}

static void on_complete(bench_t *b, call_t *c, int ok)
{
  if (!ok && c->status == GRPC_STATUS_OK)
    c->status = GRPC_STATUS_INTERNAL;
  /* heartbeats sent before the last hb_reset_stats are not counted */
  method_stats_t scratch = {0};
  method_stats_t *st =
      c->method != M_HEARTBEAT || c->epoch == b->epoch ? &b->stats[c->method] : &scratch;
  if (c->status == GRPC_STATUS_OK) {
    st->ok++;
  } else {
    st->failed++;
    st->last_status = (int)c->status;
    char *d = grpc_slice_to_c_string(c->details);
    snprintf(st->last_error, sizeof st->last_error, "%s", d);
    gpr_free(d);
    if (g_verbose)
      fprintf(stderr, "%s agent %d: status %d: %s\n", k_method_names[c->method], c->agent,
              st->last_status, st->last_error);
  }
  switch (c->method) {
  case M_REGISTER:
    on_register_done(b, c);
    break;
  case M_HEARTBEAT:
    on_heartbeat_done(b, c);
    break;
  case M_WATCH:
    on_watch_done(b, c);
    break;
  case M_SUBMIT:
    on_submit_done(b, c);
    break;
  }
  call_free(b, c);
}

/* ---- the one loop ---- */

static double hb_due(const bench_t *b, uint64_t slot)
{
  return b->hb_start + (double)slot * b->hb_period / (double)b->n;
}

static void hb_fire(bench_t *b, double now)
{
  if (!b->hb_on)
    return;
  int fired = 0;
  while (fired < 4096 && hb_due(b, b->hb_slot) <= now) {
    int a = (int)(b->hb_slot % (uint64_t)b->n);
    agent_t *ag = &b->agents[a];
    if (ag->registered) {
      if (ag->hb_inflight)
        b->hb_skipped++;
      else
        send_heartbeat(b, a, now - hb_due(b, b->hb_slot));
      fired++;
    }
    b->hb_slot++;
  }
}

static void reg_pump(bench_t *b)
{
  while (b->reg_sent < b->n && b->reg_inflight < b->reg_window) {
    send_register(b, b->reg_sent++);
    b->reg_inflight++;
  }
}

static void watch_pump(bench_t *b)
{
  while (b->watch_window && b->n_todo > 0 && b->watch_sync_inflight < b->watch_window) {
    int a = b->watch_todo[--b->n_todo];
    b->agents[a].watch = W_SYNC;
    b->watch_sync_inflight++;
    /* a version the coordinator never has: answered at once with the current one */
    send_watch(b, a, UINT64_MAX, 1000);
  }
}

typedef int (*done_fn)(bench_t *b);

/* Runs the generator until done(b) or until the monotonic time `until`. */
static void run_until(bench_t *b, double until, done_fn done)
{
  for (;;) {
    double now = now_ms();
    if ((done && done(b)) || now >= until)
      return;
    reg_pump(b);
    watch_pump(b);
    hb_fire(b, now);
    double wake = until;
    if (b->hb_on && hb_due(b, b->hb_slot) < wake)
      wake = hb_due(b, b->hb_slot);
    if (now + 20 < wake)
      wake = now + 20;
    gpr_timespec dl = wake > now ? deadline_in(wake - now) : gpr_inf_past(GPR_CLOCK_MONOTONIC);
    grpc_event ev = grpc_completion_queue_next(b->cq, dl, NULL);
    int k = 0;
    while (ev.type == GRPC_OP_COMPLETE) {
      on_complete(b, ev.tag, ev.success);
      if (++k >= 1024)
        break;
      ev = grpc_completion_queue_next(b->cq, gpr_inf_past(GPR_CLOCK_MONOTONIC), NULL);
    }
  }
}

static int all_registered(bench_t *b)
{
  return b->reg_done == b->n;
}

static int all_watches_held(bench_t *b)
{
  return b->watch_held == b->n;
}

static int all_delivered(bench_t *b)
{
  return b->watch_done == b->n;
}

static int submit_answered(bench_t *b)
{
  return b->submit_resp > 0;
}

static int nothing_in_flight(bench_t *b)
{
  return b->n_inflight == 0;
}

static void hb_start(bench_t *b, int period_ms)
{
  b->hb_on = 1;
  b->hb_period = period_ms;
  b->hb_start = now_ms();
  b->hb_slot = 0;
}

static void hb_reset_stats(bench_t *b)
{
  samples_reset(&b->hb_lat);
  b->hb_skipped = 0;
  b->hb_lag_max = b->hb_lag_sum = 0;
  b->hb_lag_n = 0;
  b->stats[M_HEARTBEAT] = (method_stats_t){0};
  b->epoch++;
}

/* Stops the load: no new heartbeats, the coordinator is stopped (its held calls fail), every
 * call in flight completes or is cancelled, the channels are closed. */
static void bench_finish(bench_t *b)
{
  b->hb_on = 0;
  b->watch_window = 0;
  b->reg_window = 0;
  run_until(b, now_ms() + 3000, nothing_in_flight); /* heartbeats in flight finish */
  for (call_t *c = b->inflight.next; c != &b->inflight; c = c->next)
    grpc_call_cancel(c->call, NULL);
  run_until(b, now_ms() + 10000, nothing_in_flight);
  if (b->n_inflight)
    fprintf(stderr, "bench_coordinator: %zu calls still in flight at the end\n", b->n_inflight);
  for (int i = 0; i < b->nch; i++)
    grpc_channel_destroy(b->ch[i]);
  grpc_completion_queue_shutdown(b->cq);
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(b->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN)
      break;
    if (ev.type == GRPC_OP_COMPLETE)
      call_free(b, ev.tag);
  }
  grpc_completion_queue_destroy(b->cq);
  grpc_slice_unref(b->auth.value);
  free(b->ch);
  free(b->reg);
  free(b->agents);
  free(b->reg_lat.v);
  free(b->hb_lat.v);
  free(b->deliver.v);
  free(b->rank_seen);
  free(b->watch_todo);
}

static void print_failures(const bench_t *b)
{
  for (int m = 0; m < M_COUNT; m++)
    if (b->stats[m].failed)
      printf("  %-16s %llu failed (last: status %d, %s)\n", k_method_names[m],
             (unsigned long long)b->stats[m].failed, b->stats[m].last_status,
             b->stats[m].last_error);
}

/* ------------------------------------------------------------------------------------------ */
/* Scenario 1: registration                                                                    */
/* ------------------------------------------------------------------------------------------ */

static void start_registration(bench_t *b)
{
  b->reg_window = g_opt.window > 0 ? g_opt.window : b->n;
  b->reg_t0 = now_ms();
  hb_start(b, g_opt.heartbeat_ms); /* registered agents heartbeat from their first slot on */
}

static void submit_job(bench_t *b, int n, const char *ckpt_dir);
static void job_state_name(const coord_proc_t *cp, const char *job_id, char *out, size_t len);

static void scenario_register(int n)
{
  coord_proc_t cp;
  coord_start(&cp, g_opt.heartbeat_ms);
  bench_t b;
  bench_connect(&b, &cp, n);
  if (g_opt.submit_first) { /* a job waits for all n nodes while they register */
    char ckpt[400];
    snprintf(ckpt, sizeof ckpt, "%s/ckpt", cp.dir);
    submit_job(&b, n, ckpt);
    run_until(&b, now_ms() + 10000, submit_answered);
    if (!b.job_id[0])
      die("SubmitJob failed: %s", b.stats[M_SUBMIT].last_error);
  }
  load_t ld;
  load_begin(&ld, cp.pid);
  start_registration(&b);
  run_until(&b, b.reg_t0 + 120000, all_registered);
  double total = b.reg_last_ms - b.reg_t0;
  load_end(&ld);
  int done = b.reg_done;
  double planned_ms = -1;
  char state[32] = "-";
  if (g_opt.submit_first) { /* until the coordinator planned it (GetJob every 20 ms) */
    while (now_ms() - b.reg_t0 < 60000) {
      job_state_name(&cp, b.job_id, state, sizeof state);
      if (strcmp(state, "JOB_PENDING") != 0) {
        planned_ms = now_ms() - b.reg_t0;
        break;
      }
      run_until(&b, now_ms() + 20, NULL);
    }
  }
  printf("\n== register: %d agents (%d channels, window %d, heartbeats start on registration%s)\n",
         n, b.nch, b.reg_window, g_opt.submit_first ? ", a job waiting for all of them" : "");
  printf("  %-40s %10d / %d\n", "registered", done, n);
  printf("  %-40s %10.1f ms\n", "time until all registered", total);
  printf("  %-40s %10.0f /s\n", "registration rate", done / (total / 1e3));
  printf("  %-40s %10.2f / %.2f / %.2f ms\n", "RegisterWorker latency p50/p99/max",
         samples_pct(&b.reg_lat, 50), samples_pct(&b.reg_lat, 99), samples_pct(&b.reg_lat, 100));
  if (g_opt.submit_first)
    printf("  %-40s %10.1f ms (%s)\n", "first registration -> job planned", planned_ms, state);
  print_load(&ld);
  print_failures(&b);
  printf("{\"scenario\":\"register\",\"agents\":%d,\"registered\":%d,\"channels\":%d,"
         "\"pending_per_method\":%d,\"submit_first\":%s,\"total_ms\":%.1f,\"rate_per_s\":%.0f,"
         "\"lat_p50_ms\":%.3f,\"lat_p99_ms\":%.3f,\"lat_max_ms\":%.3f,\"planned_ms\":%.1f,"
         "\"job_state\":\"%s\",\"failed\":%llu," LOAD_JSON_FMT "}\n",
         n, done, b.nch, g_opt.pending, g_opt.submit_first ? "true" : "false", total,
         done / (total / 1e3), samples_pct(&b.reg_lat, 50), samples_pct(&b.reg_lat, 99),
         samples_pct(&b.reg_lat, 100), planned_ms, state,
         (unsigned long long)b.stats[M_REGISTER].failed, LOAD_JSON_ARGS(ld));
  fflush(stdout);
  bench_finish(&b);
  coord_stop(&cp);
}

/* ------------------------------------------------------------------------------------------ */
/* Scenario 2: heartbeats                                                                      */
/* ------------------------------------------------------------------------------------------ */

static int list_nodes_states(const coord_proc_t *cp, int *alive, int *dead, const char *host,
                             int *host_state);

static void scenario_heartbeat(int n, double seconds)
{
  coord_proc_t cp;
  coord_start(&cp, g_opt.heartbeat_ms);
  bench_t b;
  bench_connect(&b, &cp, n);
  start_registration(&b);
  run_until(&b, b.reg_t0 + 120000, all_registered);
  if (b.reg_done != n)
    die("only %d of %d agents registered", b.reg_done, n);
  /* warm up for two periods, then measure */
  run_until(&b, now_ms() + 2.0 * g_opt.heartbeat_ms, NULL);
  hb_reset_stats(&b);
  load_t ld;
  load_begin(&ld, cp.pid);
  uint64_t slot0 = b.hb_slot;
  run_until(&b, ld.t0 + seconds * 1e3, NULL);
  load_end(&ld);
  int alive = -1, dead = -1;
  list_nodes_states(&cp, &alive, &dead, NULL, NULL);
  double win = ld.window_s;
  double target = n * 1000.0 / g_opt.heartbeat_ms;
  uint64_t ok = b.stats[M_HEARTBEAT].ok;
  double lag_mean = b.hb_lag_n ? b.hb_lag_sum / (double)b.hb_lag_n : 0;
  printf("\n== heartbeat: %d agents, period %d ms staggered, window %.1f s (%d channels)\n", n,
         g_opt.heartbeat_ms, win, b.nch);
  printf("  %-40s %10llu (slots due %llu)\n", "heartbeats sent",
         (unsigned long long)b.stats[M_HEARTBEAT].sent, (unsigned long long)(b.hb_slot - slot0));
  printf("  %-40s %10.0f /s (target %.0f /s)\n", "completed OK", ok / win, target);
  printf("  %-40s %10llu\n", "skipped (previous still in flight)",
         (unsigned long long)b.hb_skipped);
  printf("  %-40s %10.2f / %.2f ms\n", "send lag vs schedule mean/max", lag_mean, b.hb_lag_max);
  printf("  %-40s %10.3f / %.3f / %.3f ms\n", "latency p50/p99/max", samples_pct(&b.hb_lat, 50),
         samples_pct(&b.hb_lat, 99), samples_pct(&b.hb_lat, 100));
  printf("  %-40s %10d alive, %d dead\n", "nodes at the end (ListNodes)", alive, dead);
  if (b.hb_reregister)
    printf("  %-40s %10llu\n", "answered reregister", (unsigned long long)b.hb_reregister);
  print_load(&ld);
  print_failures(&b);
  printf("{\"scenario\":\"heartbeat\",\"agents\":%d,\"period_ms\":%d,\"window_s\":%.2f,"
         "\"channels\":%d,\"pending_per_method\":%d,\"sent\":%llu,\"ok\":%llu,\"failed\":%llu,"
         "\"ok_per_s\":%.0f,\"target_per_s\":%.0f,\"skipped\":%llu,\"lag_mean_ms\":%.3f,"
         "\"lag_max_ms\":%.3f,\"lat_p50_ms\":%.3f,\"lat_p99_ms\":%.3f,\"lat_max_ms\":%.3f,"
         "\"alive\":%d,\"dead\":%d," LOAD_JSON_FMT "}\n",
         n, g_opt.heartbeat_ms, win, b.nch, g_opt.pending,
         (unsigned long long)b.stats[M_HEARTBEAT].sent, (unsigned long long)ok,
         (unsigned long long)b.stats[M_HEARTBEAT].failed, ok / win, target,
         (unsigned long long)b.hb_skipped, lag_mean, b.hb_lag_max, samples_pct(&b.hb_lat, 50),
         samples_pct(&b.hb_lat, 99), samples_pct(&b.hb_lat, 100), alive, dead, LOAD_JSON_ARGS(ld));
  fflush(stdout);
  bench_finish(&b);
  coord_stop(&cp);
}

/* ------------------------------------------------------------------------------------------ */
/* Scenario 3: rendezvous                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* A valid spec for a world of n single-device dp ranks (see dt_jobspec_validate). */
static void submit_job(bench_t *b, int n, const char *ckpt_dir)
{
  Distrain__V1__ModelSpec model = DISTRAIN__V1__MODEL_SPEC__INIT;
  model.layers = 1, model.heads = 1, model.channels = 8, model.vocab = 256, model.max_seq = 8;
  model.init = "seed:1";
  Distrain__V1__DataSpec data = DISTRAIN__V1__DATA_SPEC__INIT;
  data.train = "/dev/null";
  Distrain__V1__TrainingSpec tr = DISTRAIN__V1__TRAINING_SPEC__INIT;
  tr.batch = n, tr.seq = 8, tr.steps = 1, tr.micro_batch = 1, tr.val_batches = 1;
  Distrain__V1__OptimizerSpec opt = DISTRAIN__V1__OPTIMIZER_SPEC__INIT;
  opt.lr = 1e-3, opt.schedule = "constant", opt.beta1 = 0.9, opt.beta2 = 0.95, opt.eps = 1e-8;
  opt.grad_clip = 1.0;
  Distrain__V1__ParallelSpec par = DISTRAIN__V1__PARALLEL_SPEC__INIT;
  par.dp = n, par.tp = 1, par.pp = 1, par.cp = 1, par.schedule = "1f1b";
  Distrain__V1__CheckpointSpec ck = DISTRAIN__V1__CHECKPOINT_SPEC__INIT;
  ck.dir = (char *)ckpt_dir;
  Distrain__V1__ElasticSpec el = DISTRAIN__V1__ELASTIC_SPEC__INIT;
  el.min_nodes = n, el.max_nodes = n, el.max_restarts = 0, el.heartbeat_ms = g_opt.heartbeat_ms;
  Distrain__V1__JobSpec spec = DISTRAIN__V1__JOB_SPEC__INIT;
  spec.name = "bench-rendezvous";
  spec.model = &model, spec.data = &data, spec.training = &tr, spec.optimizer = &opt;
  spec.parallel = &par, spec.checkpoint = &ck, spec.elastic = &el;
  Distrain__V1__SubmitJobRequest req = DISTRAIN__V1__SUBMIT_JOB_REQUEST__INIT;
  req.spec = &spec;
  b->submit_t0 = now_ms();
  start_call(b, M_SUBMIT, -1, &req.base, 60000);
}

/* Counts the nodes in each state with one blocking ListNodes (control plane, not the load). */
static int list_nodes_states(const coord_proc_t *cp, int *alive, int *dead, const char *host,
                             int *host_state)
{
  dt_rpc_client_t *cl;
  if (dt_rpc_client_create(cp->target, cp->token, &distrain__v1__coordinator__descriptor, &cl))
    return -1;
  Distrain__V1__ListNodesRequest req = DISTRAIN__V1__LIST_NODES_REQUEST__INIT;
  ProtobufCMessage *resp = NULL;
  char err[256];
  int rc = dt_rpc_client_call(cl, "ListNodes", &req.base, &resp, 10000, 0, err, sizeof err);
  if (rc == 0) {
    Distrain__V1__ListNodesResponse *r = (void *)resp;
    if (alive)
      *alive = 0;
    if (dead)
      *dead = 0;
    if (host_state)
      *host_state = -1;
    for (size_t i = 0; i < r->n_nodes; i++) {
      const Distrain__V1__Node *nd = r->nodes[i];
      if (alive && nd->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE)
        (*alive)++;
      if (dead && nd->state == DISTRAIN__V1__NODE_STATE__NODE_DEAD)
        (*dead)++;
      if (host && host_state && nd->info && strcmp(nd->info->hostname, host) == 0)
        *host_state = nd->state;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  dt_rpc_client_destroy(cl);
  return rc;
}

/* The job's state name ("RENDEZVOUS", "FAILED", ...) from one blocking GetJob. */
static void job_state_name(const coord_proc_t *cp, const char *job_id, char *out, size_t len)
{
  dt_rpc_client_t *cl;
  if (!job_id[0] ||
      dt_rpc_client_create(cp->target, cp->token, &distrain__v1__coordinator__descriptor, &cl))
    return;
  Distrain__V1__GetJobRequest req = DISTRAIN__V1__GET_JOB_REQUEST__INIT;
  req.job_id = (char *)job_id;
  ProtobufCMessage *resp = NULL;
  char err[256];
  if (dt_rpc_client_call(cl, "GetJob", &req.base, &resp, 10000, 0, err, sizeof err) == 0) {
    const Distrain__V1__Job *j = (const void *)resp;
    const ProtobufCEnumValue *v =
        protobuf_c_enum_descriptor_get_value(&distrain__v1__job_state__descriptor, j->state);
    snprintf(out, len, "%s", v ? v->name : "?");
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  dt_rpc_client_destroy(cl);
}

static void scenario_rendezvous(int n)
{
  coord_proc_t cp;
  coord_start(&cp, g_opt.heartbeat_ms);
  bench_t b;
  bench_connect(&b, &cp, n);
  b.rank_seen = xcalloc((size_t)n, 1);
  start_registration(&b);
  run_until(&b, b.reg_t0 + 120000, all_registered);
  if (b.reg_done != n)
    die("only %d of %d agents registered", b.reg_done, n);
  double reg_ms = b.reg_last_ms - b.reg_t0;
  run_until(&b, now_ms() + 2.0 * g_opt.heartbeat_ms, NULL);
  /* every agent: one sync watch (answered at once), then one held */
  b.watch_todo = xcalloc((size_t)n, sizeof *b.watch_todo);
  for (int a = n - 1; a >= 0; a--)
    b.watch_todo[b.n_todo++] = a;
  b.watch_window = g_opt.watch_window;
  double w0 = now_ms();
  run_until(&b, w0 + 60000, all_watches_held);
  double watch_ms = now_ms() - w0;
  /* let the coordinator take every held call, heartbeats going on */
  run_until(&b, now_ms() + 2.0 * g_opt.heartbeat_ms, NULL);
  if (g_opt.pre_submit_pause_ms > 0) { /* time to attach a profiler (perf record -p PID) */
    fprintf(stderr, "bench_coordinator: submitting in %d ms (coordinator pid %d)\n",
            g_opt.pre_submit_pause_ms, (int)cp.pid);
    run_until(&b, now_ms() + g_opt.pre_submit_pause_ms, NULL);
  }
  int alive0 = -1, dead0 = -1;
  list_nodes_states(&cp, &alive0, &dead0, NULL, NULL);
  hb_reset_stats(&b);
  char ckpt[400];
  snprintf(ckpt, sizeof ckpt, "%s/ckpt", cp.dir);
  load_t ld;
  load_begin(&ld, cp.pid);
  b.want_gen = 1;
  submit_job(&b, n, ckpt);
  run_until(&b, b.submit_t0 + 60000, all_delivered);
  double t_all = now_ms();
  load_end(&ld);
  run_until(&b, now_ms() + 10000, submit_answered);
  double total = b.watch_done == n ? t_all - b.submit_t0 : -1;
  /* keep heartbeating a little after the rendezvous, then check nobody was declared dead */
  run_until(&b, now_ms() + 2.0 * g_opt.heartbeat_ms, NULL);
  int alive1 = -1, dead1 = -1;
  list_nodes_states(&cp, &alive1, &dead1, NULL, NULL);
  char job_state[32] = "?";
  job_state_name(&cp, b.job_id, job_state, sizeof job_state);
  printf("\n== rendezvous: %d single-device agents, one job dp=%d (%d channels)\n", n, n, b.nch);
  printf("  %-40s %10.1f ms\n", "registration (setup)", reg_ms);
  printf("  %-40s %10.1f ms\n", "sync + hold WatchAssignment (setup)", watch_ms);
  printf("  %-40s %10d alive, %d dead\n", "nodes before submit", alive0, dead0);
  printf("  %-40s %10.1f ms\n", "SubmitJob answered after",
         b.submit_resp > 0 ? b.submit_resp - b.submit_t0 : -1.0);
  printf("  %-40s %10d / %d\n", "assignments delivered", b.watch_done, n);
  printf("  %-40s %10.1f / %.1f / %.1f ms\n", "delivery first/p50/p99", samples_pct(&b.deliver, 0),
         samples_pct(&b.deliver, 50), samples_pct(&b.deliver, 99));
  printf("  %-40s %10.1f ms   (goal < 2000 ms: %s)\n", "SubmitJob -> every long-poll answered",
         total, total >= 0 && total < 2000 ? "met" : "NOT met");
  printf("  %-40s %10d distinct, %d duplicate, %d wrong world\n", "ranks", b.ranks_distinct,
         b.rank_dups, b.wrong_world);
  printf("  %-40s %10.3f / %.3f / %.3f ms (%llu OK)\n", "heartbeat latency p50/p99/max meanwhile",
         samples_pct(&b.hb_lat, 50), samples_pct(&b.hb_lat, 99), samples_pct(&b.hb_lat, 100),
         (unsigned long long)b.stats[M_HEARTBEAT].ok);
  printf("  %-40s %10llu\n", "heartbeats skipped (previous in flight)",
         (unsigned long long)b.hb_skipped);
  printf("  %-40s %10d alive, %d dead; job %s\n", "after (+2 periods)", alive1, dead1, job_state);
  if (b.watch_empty)
    printf("  %-40s %10llu\n", "held watches answered without it",
           (unsigned long long)b.watch_empty);
  print_load(&ld);
  print_failures(&b);
  printf(
      "{\"scenario\":\"rendezvous\",\"agents\":%d,\"channels\":%d,\"pending_per_method\":%d,"
      "\"heartbeat_ms\":%d,\"register_ms\":%.1f,\"watch_setup_ms\":%.1f,\"alive_before\":%d,"
      "\"dead_before\":%d,\"submit_answer_ms\":%.1f,\"delivered\":%d,\"first_ms\":%.1f,"
      "\"p50_ms\":%.1f,\"p99_ms\":%.1f,\"all_ms\":%.1f,\"goal_ms\":2000,\"met\":%s,"
      "\"ranks_distinct\":%d,\"hb_p50_ms\":%.3f,\"hb_p99_ms\":%.3f,\"hb_max_ms\":%.3f,"
      "\"hb_skipped\":%llu,\"alive_after\":%d,\"dead_after\":%d,\"job_state\":\"%s\"," LOAD_JSON_FMT
      "}\n",
      n, b.nch, g_opt.pending, g_opt.heartbeat_ms, reg_ms, watch_ms, alive0, dead0,
      b.submit_resp > 0 ? b.submit_resp - b.submit_t0 : -1.0, b.watch_done,
      samples_pct(&b.deliver, 0), samples_pct(&b.deliver, 50), samples_pct(&b.deliver, 99), total,
      total >= 0 && total < 2000 ? "true" : "false", b.ranks_distinct, samples_pct(&b.hb_lat, 50),
      samples_pct(&b.hb_lat, 99), samples_pct(&b.hb_lat, 100), (unsigned long long)b.hb_skipped,
      alive1, dead1, job_state, LOAD_JSON_ARGS(ld));
  fflush(stdout);
  bench_finish(&b);
  coord_stop(&cp);
}

/* ------------------------------------------------------------------------------------------ */
/* Scenario 4: failure detection with real processes                                           */
/* ------------------------------------------------------------------------------------------ */

static void scenario_failure(int repeats)
{
  const int dead_after = 3;
  coord_proc_t cp;
  coord_start(&cp, g_opt.heartbeat_ms);
  const double bound = g_opt.heartbeat_ms * dead_after + 500.0;
  samples_t det = {0};
  printf("\n== failure detection: real distrain-worker, SIGKILL -> DEAD in ListNodes "
         "(heartbeat %d ms, dead after %d missed, polled every 20 ms)\n",
         g_opt.heartbeat_ms, dead_after);
  printf("  %-6s %14s %14s %10s\n", "run", "alive after", "kill -> DEAD", "bound");
  for (int k = 0; k < repeats; k++) {
    char host[64], work[400], target[80];
    snprintf(host, sizeof host, "bench-fd-%d", k);
    snprintf(work, sizeof work, "%s/work-%d", cp.dir, k);
    snprintf(target, sizeof target, "%s", cp.target);
    char *argv[] = {g_opt.worker_bin,
                    "--coordinator",
                    target,
                    "--token-file",
                    cp.token_file,
                    "--cpu-devices",
                    "1",
                    "--work-dir",
                    work,
                    "--hostname",
                    host,
                    NULL};
    char log[400];
    snprintf(log, sizeof log, "%s/worker-%d.log", cp.dir, k);
    double t0 = now_ms();
    pid_t pid = spawn(argv, log, NULL);
    int state = -1;
    while (now_ms() - t0 < 20000) {
      if (list_nodes_states(&cp, NULL, NULL, host, &state) == 0 &&
          state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE)
        break;
      sleep_ms(20);
    }
    if (state != DISTRAIN__V1__NODE_STATE__NODE_ALIVE)
      die("worker %s never became ALIVE (see %s)", host, log);
    double alive_ms = now_ms() - t0;
    /* a random phase against the heartbeat timer, like a real crash */
    sleep_ms(300 + rand() % 700);
    kill(pid, SIGKILL);
    double tk = now_ms();
    int st;
    waitpid(pid, &st, 0);
    forget_child(pid);
    double dead_ms = -1;
    while (now_ms() - tk < 30000) {
      if (list_nodes_states(&cp, NULL, NULL, host, &state) == 0 &&
          state == DISTRAIN__V1__NODE_STATE__NODE_DEAD) {
        dead_ms = now_ms() - tk;
        break;
      }
      sleep_ms(20);
    }
    printf("  %-6d %11.0f ms %11.0f ms %7.0f ms %s\n", k + 1, alive_ms, dead_ms, bound,
           dead_ms >= 0 && dead_ms <= bound ? "ok" : "OVER");
    fflush(stdout);
    if (dead_ms >= 0)
      samples_add(&det, dead_ms);
  }
  printf("  %-20s min %.0f / median %.0f / max %.0f ms (bound %.0f ms = %d ms x %d + 500)\n",
         "kill -> DEAD", samples_pct(&det, 0), samples_pct(&det, 50), samples_pct(&det, 100), bound,
         g_opt.heartbeat_ms, dead_after);
  printf("{\"scenario\":\"failure\",\"repeats\":%d,\"detected\":%zu,\"heartbeat_ms\":%d,"
         "\"dead_after\":%d,\"bound_ms\":%.0f,\"min_ms\":%.1f,\"median_ms\":%.1f,"
         "\"max_ms\":%.1f,\"within_bound\":%s}\n",
         repeats, det.n, g_opt.heartbeat_ms, dead_after, bound, samples_pct(&det, 0),
         samples_pct(&det, 50), samples_pct(&det, 100),
         det.n == (size_t)repeats && samples_pct(&det, 100) <= bound ? "true" : "false");
  fflush(stdout);
  free(det.v);
  coord_stop(&cp);
}

/* ------------------------------------------------------------------------------------------ */
/* main                                                                                        */
/* ------------------------------------------------------------------------------------------ */

static void usage(FILE *out)
{
  fprintf(
      out,
      "usage: bench_coordinator [--scenario register,heartbeat,rendezvous,failure|all]\n"
      "         [--agents N[,N...]] [--rdv-agents N] [--hb-seconds S] [--hb-seconds-large S]\n"
      "         [--channels N] [--window N] [--watch-window N] [--heartbeat-ms N] [--pending N]\n"
      "         [--pre-submit-pause MS] [--submit-first]\n"
      "         [--fd-repeats N] [--coordinator-bin PATH] [--worker-bin PATH] [--keep-tmp]\n"
      "         [--verbose]\n");
}

/* Finds a sibling build target: <build>/tests/bench/<self> -> <build>/<rel>. */
static void find_bin(char *out, size_t len, const char *rel)
{
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0)
    die("readlink /proc/self/exe: %s", strerror(errno));
  self[n] = '\0';
  char *dir = dirname(self);
  snprintf(out, len, "%s/../../%s", dir, rel);
}

static void parse_scenarios(const char *s)
{
  char buf[256];
  snprintf(buf, sizeof buf, "%s", s);
  g_opt.do_register = g_opt.do_heartbeat = g_opt.do_rendezvous = g_opt.do_failure = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (strcmp(tok, "all") == 0)
      g_opt.do_register = g_opt.do_heartbeat = g_opt.do_rendezvous = g_opt.do_failure = 1;
    else if (strcmp(tok, "register") == 0)
      g_opt.do_register = 1;
    else if (strcmp(tok, "heartbeat") == 0)
      g_opt.do_heartbeat = 1;
    else if (strcmp(tok, "rendezvous") == 0)
      g_opt.do_rendezvous = 1;
    else if (strcmp(tok, "failure") == 0)
      g_opt.do_failure = 1;
    else
      die("unknown scenario '%s'", tok);
  }
}

static int parse_int(const char *s, int lo, int hi, const char *flag)
{
  char *end;
  long v = strtol(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v < lo || v > hi)
    die("--%s: expected an integer in [%d, %d], got '%s'", flag, lo, hi, s);
  return (int)v;
}

int main(int argc, char **argv)
{
  g_opt.rdv_agents = 10000;
  g_opt.hb_seconds = 10;
  g_opt.hb_seconds_large = 5;
  g_opt.channels = 16;
  g_opt.heartbeat_ms = 500;
  g_opt.watch_window = 500;
  g_opt.fd_repeats = 5;
  g_opt.agents[0] = 1000, g_opt.agents[1] = 10000, g_opt.n_agents = 2;
  parse_scenarios("all");
  static const struct option opts[] = {{"scenario", required_argument, 0, 's'},
                                       {"agents", required_argument, 0, 'a'},
                                       {"rdv-agents", required_argument, 0, 'r'},
                                       {"hb-seconds", required_argument, 0, 'S'},
                                       {"hb-seconds-large", required_argument, 0, 'L'},
                                       {"channels", required_argument, 0, 'c'},
                                       {"window", required_argument, 0, 'w'},
                                       {"heartbeat-ms", required_argument, 0, 'b'},
                                       {"watch-window", required_argument, 0, 'V'},
                                       {"pre-submit-pause", required_argument, 0, 'P'},
                                       {"submit-first", no_argument, 0, 'F'},
                                       {"pending", required_argument, 0, 'p'},
                                       {"fd-repeats", required_argument, 0, 'f'},
                                       {"coordinator-bin", required_argument, 0, 'C'},
                                       {"worker-bin", required_argument, 0, 'W'},
                                       {"keep-tmp", no_argument, 0, 'k'},
                                       {"verbose", no_argument, 0, 'v'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (ch) {
    case 's':
      parse_scenarios(optarg);
      break;
    case 'a': {
      char buf[256];
      snprintf(buf, sizeof buf, "%s", optarg);
      g_opt.n_agents = 0;
      for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && g_opt.n_agents < 16;
           tok = strtok_r(NULL, ",", &save))
        g_opt.agents[g_opt.n_agents++] = parse_int(tok, 1, 1000000, "agents");
      break;
    }
    case 'r':
      g_opt.rdv_agents = parse_int(optarg, 1, 1000000, "rdv-agents");
      break;
    case 'S':
      g_opt.hb_seconds = parse_int(optarg, 1, 3600, "hb-seconds");
      break;
    case 'L':
      g_opt.hb_seconds_large = parse_int(optarg, 1, 3600, "hb-seconds-large");
      break;
    case 'c':
      g_opt.channels = parse_int(optarg, 1, 1024, "channels");
      break;
    case 'w':
      g_opt.window = parse_int(optarg, 1, 1000000, "window");
      break;
    case 'F':
      g_opt.submit_first = 1;
      break;
    case 'P':
      g_opt.pre_submit_pause_ms = parse_int(optarg, 0, 600000, "pre-submit-pause");
      break;
    case 'V':
      g_opt.watch_window = parse_int(optarg, 1, 1000000, "watch-window");
      break;
    case 'b':
      g_opt.heartbeat_ms = parse_int(optarg, 10, 3600000, "heartbeat-ms");
      break;
    case 'p':
      g_opt.pending = parse_int(optarg, 1, 1000000, "pending");
      break;
    case 'f':
      g_opt.fd_repeats = parse_int(optarg, 1, 1000, "fd-repeats");
      break;
    case 'C':
      snprintf(g_opt.coord_bin, sizeof g_opt.coord_bin, "%s", optarg);
      break;
    case 'W':
      snprintf(g_opt.worker_bin, sizeof g_opt.worker_bin, "%s", optarg);
      break;
    case 'k':
      g_opt.keep_tmp = 1;
      break;
    case 'v':
      g_verbose = 1;
      break;
    case 'h':
      usage(stdout);
      return 0;
    default:
      usage(stderr);
      return 2;
    }
  }
  if (optind < argc) {
    usage(stderr);
    return 2;
  }
  if (!g_opt.coord_bin[0])
    find_bin(g_opt.coord_bin, sizeof g_opt.coord_bin, "coordinator/distrain-coordinator");
  if (!g_opt.worker_bin[0])
    find_bin(g_opt.worker_bin, sizeof g_opt.worker_bin, "worker/agent/distrain-worker");
  if (access(g_opt.coord_bin, X_OK) != 0)
    die("%s is not executable (use --coordinator-bin)", g_opt.coord_bin);
  if (g_opt.do_failure && access(g_opt.worker_bin, X_OK) != 0)
    die("%s is not executable (use --worker-bin)", g_opt.worker_bin);

  /* Many calls, a few connections, child processes: raise the descriptor limit anyway. */
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  signal(SIGPIPE, SIG_IGN);
  srand((unsigned)getpid());
  atexit(kill_children);
  grpc_init();
  printf("bench_coordinator: coordinator %s, %ld CPU(s), %d channels, pending/method %s\n",
         g_opt.coord_bin, sysconf(_SC_NPROCESSORS_ONLN), g_opt.channels,
         g_opt.pending ? "set" : "default (32)");
  if (g_opt.pending)
    printf("  DISTRAIN_RPC_PENDING_PER_METHOD=%d for the coordinator\n", g_opt.pending);
  fflush(stdout);
  for (int i = 0; g_opt.do_register && i < g_opt.n_agents; i++)
    scenario_register(g_opt.agents[i]);
  for (int i = 0; g_opt.do_heartbeat && i < g_opt.n_agents; i++)
    scenario_heartbeat(g_opt.agents[i],
                       g_opt.agents[i] > 1000 ? g_opt.hb_seconds_large : g_opt.hb_seconds);
  if (g_opt.do_rendezvous)
    scenario_rendezvous(g_opt.rdv_agents);
  if (g_opt.do_failure)
    scenario_failure(g_opt.fd_repeats);
  grpc_shutdown();
  return 0;
}
