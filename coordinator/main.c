/* main.c — distrain-coordinator: flags, signals, and the loop.
 *
 *   distrain-coordinator [--listen HOST:PORT] [--state-dir DIR] [--token-file FILE]
 *                        [--heartbeat-ms N] [--dead-after N] [--port-file FILE]
 *                        [--tls-cert PEM --tls-key PEM] [--tls-ca PEM]
 *                        [--http HOST:PORT|off] [--http-port-file FILE]
 *
 * With --tls-cert/--tls-key it serves TLS; with --tls-ca too, mutual TLS: agents, trainers and
 * distrainctl must present a certificate signed by that CA (rpc.h, "TLS").
 *
 * --http serves /metrics (Prometheus) and the dashboard over plain HTTP, read-only and without
 * the token, on 127.0.0.1:7471 by default: loopback only unless an address is given. When the
 * default port is taken the coordinator warns and runs without it; an address given
 * explicitly must be bound.
 *
 * The state directory defaults to $STATE_DIRECTORY (set by systemd's StateDirectory=) or
 * /var/lib/distrain. SIGTERM/SIGINT shut down cleanly: calls are cancelled, state is already
 * on disk (write-through), and the process exits 0. While jobs run, it first waits a second for
 * agents to say they are leaving (a plain `scancel` or a preemption signals every daemon of an
 * allocation at once), then for those agents' goodbyes (their trainers have saved their step,
 * which needs this coordinator to commit it, and have exited) and for the trainers of drained
 * nodes: at most DISTRAIN_STOP_WAIT_MS (30 s). A second signal ends the wait.
 *
 * Under systemd (deploy/systemd/distrain-coordinator.service, Type=notify) it sends READY=1
 * once the state is loaded and the server listens, keeps STATUS= current (nodes, running jobs
 * and their steps), pings the watchdog from the loop and sends STOPPING=1 on a signal. */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <uv.h>

#include "coord.h"
#include "dt_log.h"
#include "dt_notify.h"
#include "dt_param.h"
#include "dt_util.h"

static void usage(FILE *out)
{
  fprintf(out, "usage: distrain-coordinator [--listen HOST:PORT] [--state-dir DIR] "
               "[--token-file FILE]\n"
               "                            [--heartbeat-ms N] [--dead-after MISSED] "
               "[--port-file FILE]\n"
               "                            " DT_RPC_TLS_USAGE "\n"
               "                            [--http HOST:PORT|off] [--http-port-file FILE]\n");
}

/* How long a signalled coordinator waits at most for the trainers of leaving nodes. */
DT_PARAM(StopWaitMs, "STOP_WAIT_MS", 30000)
/* How long it waits for agents to say they are leaving, when jobs run: the daemons of an
 * allocation get the signal at about the same time, an agent announces at once. */
#define STOP_SETTLE_MS 1000.0
#define STOP_POLL_MS   50

static uv_signal_t g_sigterm, g_sigint;
static uv_timer_t g_stop_wait; /* a signalled coordinator waiting for trainers to save */
static double g_signalled_ms;  /* when the first signal came (0: none) */
static dt_notify_t g_notify;
static int g_exit_code;

static void on_closed(void *ud)
{
  uv_loop_t *loop = ud;
  uv_close((uv_handle_t *)&g_sigterm, NULL);
  uv_close((uv_handle_t *)&g_sigint, NULL);
  uv_close((uv_handle_t *)&g_stop_wait, NULL);
  dt_notify_close(&g_notify, NULL);
  (void)loop;
}

static void notify_status(void *data, char *buf, size_t len)
{
  dt_coord_summary(data, buf, len);
}

static void shut_down(dt_coord_t *c)
{
  if (c->closing)
    return;
  dt_notify_stopping(&g_notify);
  dt_coord_close(c, on_closed, c->loop);
}

static void on_stop_wait(uv_timer_t *t)
{
  dt_coord_t *c = t->data;
  const double waited = dt_now_ms() - g_signalled_ms;
  const size_t saving = dt_coord_stopping_nodes(c);
  if ((saving == 0 && waited < STOP_SETTLE_MS && dt_coord_running_jobs(c) > 0) ||
      (saving > 0 && waited < (double)dt_param_StopWaitMs()))
    return;
  if (saving)
    DT_WARN(COORD, "%zu leaving or drained node(s) still stopping after %.0f ms: shutting down",
            saving, waited);
  else if (waited >= STOP_SETTLE_MS)
    DT_INFO(COORD, "no leaving or drained node is stopping any more: shutting down");
  uv_timer_stop(t);
  shut_down(c);
}

/* While jobs run, the shutdown waits for the trainers that are saving their step (on_stop_wait);
 * a second signal ends the wait. */
static void on_signal(uv_signal_t *h, int signum)
{
  dt_coord_t *c = h->data;
  if (g_signalled_ms > 0 || dt_coord_running_jobs(c) == 0) {
    DT_INFO(COORD, "signal %d: shutting down", signum);
    shut_down(c);
    return;
  }
  g_signalled_ms = dt_now_ms();
  DT_INFO(COORD,
          "signal %d: shutting down once the trainers of leaving or drained nodes have saved "
          "their step (waiting at most %lld ms; signal again to shut down now)",
          signum, (long long)dt_param_StopWaitMs());
  dt_notify_stopping(&g_notify);
  uv_timer_start(&g_stop_wait, on_stop_wait, STOP_POLL_MS, STOP_POLL_MS);
}

/* Under TLS only (rpc.h): a coordinator nobody can reach is worse than a restart, which loses
 * nothing (state is on disk) and which systemd's Restart=on-failure does at once. */
static void on_listener_lost(void *ud)
{
  DT_ERROR(COORD, "exiting with status 75 so that the supervisor restarts the coordinator");
  g_exit_code = 75; /* EX_TEMPFAIL */
  shut_down(ud);
}

/* Written atomically so a launcher polling for it never reads half a number. */
static int write_port_file(const char *path, int port)
{
  dt_afile_t af;
  char buf[32];
  int n = snprintf(buf, sizeof buf, "%d\n", port);
  if (dt_afile_open(&af, path) != 0 || dt_afile_write(&af, buf, (size_t)n) != 0 ||
      dt_afile_commit(&af) != 0) {
    fprintf(stderr, "distrain-coordinator: cannot write %s\n", path);
    return -1;
  }
  return 0;
}

int main(int argc, char **argv)
{
  const char *listen = "0.0.0.0:7470", *token_file = NULL, *port_file = NULL;
  const char *http = NULL, *http_port_file = NULL;
  const char *state_dir = getenv("STATE_DIRECTORY");
  int heartbeat_ms = 500, dead_after = 3;
  static const struct option opts[] = {{"listen", required_argument, 0, 'l'},
                                       {"state-dir", required_argument, 0, 's'},
                                       {"token-file", required_argument, 0, 't'},
                                       {"heartbeat-ms", required_argument, 0, 'b'},
                                       {"dead-after", required_argument, 0, 'd'},
                                       {"port-file", required_argument, 0, 'p'},
                                       DT_RPC_TLS_OPTIONS,
                                       {"http", required_argument, 0, 'H'},
                                       {"http-port-file", required_argument, 0, 'P'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  dt_log_init();
  dt_log_set_tag("coordinator");
  int ch;
  while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (ch) {
    case 'l':
      listen = optarg;
      break;
    case 's':
      state_dir = optarg;
      break;
    case 't':
      token_file = optarg;
      break;
    case 'p':
      port_file = optarg;
      break;
    case 'H':
      http = optarg;
      break;
    case 'P':
      http_port_file = optarg;
      break;
    case 'b':
      if (dt_parse_int_flag("distrain-coordinator", "heartbeat-ms", optarg, 10, 3600000,
                            &heartbeat_ms) != 0)
        return 2;
      break;
    case 'd':
      if (dt_parse_int_flag("distrain-coordinator", "dead-after", optarg, 1, 3600000,
                            &dead_after) != 0)
        return 2;
      break;
    case DT_RPC_OPT_TLS_CERT:
    case DT_RPC_OPT_TLS_KEY:
    case DT_RPC_OPT_TLS_CA:
      if (dt_rpc_tls_option("distrain-coordinator", ch, optarg) != 0)
        return 2;
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
    fprintf(stderr, "distrain-coordinator: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  if (!state_dir || !*state_dir)
    state_dir = "/var/lib/distrain";
  if (!token_file) {
    fprintf(stderr, "distrain-coordinator: --token-file is required (every RPC is "
                    "authenticated with its bearer token)\n");
    return 2;
  }
  char token[256];
  if (dt_rpc_read_token(token_file, token, sizeof token) != 0)
    return 1;

  signal(SIGPIPE, SIG_IGN);
  /* Every agent, trainer and client holds a connection: the usual soft limit of 1024 open
   * files is far below a cluster's. Raised to the hard limit, as the kernel allows. */
  struct rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    rlim_t was = nofile.rlim_cur;
    nofile.rlim_cur = nofile.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &nofile) == 0)
      DT_INFO(COORD, "open files limit raised from %llu to %llu", (unsigned long long)was,
              (unsigned long long)nofile.rlim_max);
  }
  uv_loop_t *loop = uv_default_loop();
  static dt_coord_t coord;
  dt_coord_config_t cfg = {.listen = listen,
                           .state_dir = state_dir,
                           .token = token,
                           .heartbeat_ms = heartbeat_ms,
                           .dead_after_missed = dead_after,
                           .http = http ? http : "127.0.0.1:7471",
                           .http_optional = !http};
  if (strcmp(cfg.http, "off") == 0)
    cfg.http = NULL;
  if (http_port_file && !cfg.http) {
    fprintf(stderr, "distrain-coordinator: --http-port-file needs --http\n");
    return 2;
  }
  int rc = dt_coord_start(&coord, loop, &cfg);
  if (rc != 0) {
    fprintf(stderr, "distrain-coordinator: cannot start: %s\n", dt_strerror(rc));
    return 1;
  }
  DT_INFO(COORD, "listening on port %d (state %s, heartbeat %d ms, dead after %d missed)",
          coord.port, state_dir, heartbeat_ms, dead_after);
  /* The HTTP port first: a launcher that waits for --port-file finds both. */
  if (http_port_file && coord.http && write_port_file(http_port_file, coord.http_port) != 0)
    return 1;
  if (port_file && write_port_file(port_file, coord.port) != 0)
    return 1;
  dt_rpc_server_on_listener_lost(coord.rpc, on_listener_lost, &coord);
  uv_signal_init(loop, &g_sigterm);
  uv_signal_init(loop, &g_sigint);
  uv_timer_init(loop, &g_stop_wait);
  g_stop_wait.data = &coord;
  g_sigterm.data = g_sigint.data = &coord;
  uv_signal_start(&g_sigterm, on_signal, SIGTERM);
  uv_signal_start(&g_sigint, on_signal, SIGINT);
  dt_notify_init(loop, &g_notify, notify_status, &coord);
  dt_notify_ready(&g_notify);
  uv_run(loop, UV_RUN_DEFAULT);
  uv_loop_close(loop);
  DT_INFO(COORD, "stopped");
  return g_exit_code;
}
