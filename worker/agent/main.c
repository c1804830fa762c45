/* main.c — distrain-worker: flags, signals, and the loop.
 *
 *   distrain-worker --coordinator HOST:PORT --token-file FILE [--cpu-devices N]
 *                   [--gpus all|none|N,N,...] [--ignore-xids N,N,...] [--work-dir DIR]
 *                   [--trainer PATH] [--hostname NAME] [--grace-ms N] [--keep-logs-days N]
 *                   [--tls-cert PEM --tls-key PEM] [--tls-ca PEM]
 *
 * --gpus chooses the GPUs the node offers (agent.h: every one by default; a list, where a GPU
 * named twice is two devices sharing it); --cpu-devices is what it offers without GPUs.
 * --ignore-xids names Xid errors the GPUs' health leaves out (gpu_usage.h). --keep-logs-days
 * deletes the rank logs of jobs gone from the node that long (agent.h).
 *
 * The --tls-* flags (rpc.h, "TLS") reach its trainers through the environment, so they too
 * talk TLS to the coordinator.
 *
 * SIGTERM/SIGINT stop every trainer before exiting, so the agent never leaves orphans: by
 * SIGTERM, on which they save their step as a checkpoint (SIGKILL after the grace period), once
 * the coordinator has heard that the node is leaving; by SIGKILL if it cannot be reached.
 *
 * Under systemd (deploy/systemd/distrain-worker.service, Type=notify) it sends READY=1 after
 * its first successful registration with the coordinator, keeps STATUS= current (node id,
 * trainers and their steps), pings the watchdog from the loop and sends STOPPING=1 on a
 * signal. */
#include <getopt.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "agent.h"
#include "dt_log.h"
#include "dt_notify.h"
#include "dt_util.h"
#include "rpc.h"

static uv_signal_t g_sigterm, g_sigint;
static dt_agent_t *g_agent;
static dt_notify_t g_notify;

static void on_closed(void *ud)
{
  (void)ud;
  uv_close((uv_handle_t *)&g_sigterm, NULL);
  uv_close((uv_handle_t *)&g_sigint, NULL);
  dt_notify_close(&g_notify, NULL);
}

static void notify_status(void *data, char *buf, size_t len)
{
  (void)data;
  if (g_agent)
    dt_agent_summary(g_agent, buf, len);
}

/* Every registration: the first makes the service ready, a later one (after a coordinator
 * restart) refreshes the status at once. */
static void on_registered(void *ud)
{
  (void)ud;
  dt_notify_ready(&g_notify);
}

static void on_signal(uv_signal_t *h, int signum)
{
  (void)h;
  if (!g_agent)
    return;
  DT_INFO(WORKER, "signal %d: stopping trainers and exiting", signum);
  dt_agent_t *a = g_agent;
  g_agent = NULL;
  dt_notify_stopping(&g_notify);
  dt_agent_close(a, on_closed, NULL);
}

/* --ignore-xids: Xid numbers separated by commas, into cfg; an error said, -1, on a bad list. */
static int parse_xids(const char *list, dt_agent_config_t *cfg)
{
  if (dt_parse_int_list(list, 1, 999, cfg->ignore_xids, DT_GPU_IGNORED_XIDS, &cfg->n_ignore_xids) ==
      0)
    return 0;
  fprintf(stderr,
          "distrain-worker: --ignore-xids %s: expected at most %d Xid numbers from 1 to 999 "
          "separated by commas\n",
          list, DT_GPU_IGNORED_XIDS);
  return -1;
}

static void usage(FILE *out)
{
  fprintf(out,
          "usage: distrain-worker --coordinator HOST:PORT --token-file FILE [--cpu-devices N]\n"
          "                       [--gpus all|none|N,N,...] [--ignore-xids N,N,...]\n"
          "                       [--work-dir DIR] [--trainer PATH] [--hostname NAME]\n"
          "                       [--grace-ms N] [--keep-logs-days N]\n"
          "                       " DT_RPC_TLS_USAGE "\n");
}

int main(int argc, char **argv)
{
  static char trainer[PATH_MAX], host[256], work[PATH_MAX];
  dt_agent_config_t cfg = {.cpu_devices = 1, .grace_ms = 10000};
  static const struct option opts[] = {{"coordinator", required_argument, 0, 'c'},
                                       {"token-file", required_argument, 0, 't'},
                                       {"cpu-devices", required_argument, 0, 'n'},
                                       {"gpus", required_argument, 0, 'G'},
                                       {"ignore-xids", required_argument, 0, 'X'},
                                       {"work-dir", required_argument, 0, 'w'},
                                       {"trainer", required_argument, 0, 'x'},
                                       {"hostname", required_argument, 0, 'H'},
                                       {"grace-ms", required_argument, 0, 'g'},
                                       {"keep-logs-days", required_argument, 0, 'k'},
                                       DT_RPC_TLS_OPTIONS,
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  dt_log_init();
  int ch;
  while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (ch) {
    case 'c':
      cfg.coordinator = optarg;
      break;
    case 't':
      cfg.token_file = optarg;
      break;
    case 'w':
      cfg.work_dir = optarg;
      break;
    case 'x':
      cfg.trainer = optarg;
      break;
    case 'G':
      cfg.gpus = optarg;
      break;
    case 'X':
      if (parse_xids(optarg, &cfg) != 0)
        return 2;
      break;
    case 'H':
      cfg.hostname = optarg;
      break;
    case 'n':
      if (dt_parse_int_flag("distrain-worker", "cpu-devices", optarg, 1, 4096, &cfg.cpu_devices) !=
          0)
        return 2;
      break;
    case 'g':
      if (dt_parse_int_flag("distrain-worker", "grace-ms", optarg, 0, 1000000, &cfg.grace_ms) != 0)
        return 2;
      break;
    case 'k':
      if (dt_parse_int_flag("distrain-worker", "keep-logs-days", optarg, 1, 36500,
                            &cfg.keep_logs_days) != 0)
        return 2;
      break;
    case DT_RPC_OPT_TLS_CERT:
    case DT_RPC_OPT_TLS_KEY:
    case DT_RPC_OPT_TLS_CA:
      if (dt_rpc_tls_option("distrain-worker", ch, optarg) != 0)
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
  if (optind < argc || !cfg.coordinator || !cfg.token_file) {
    fprintf(stderr, "distrain-worker: --coordinator and --token-file are required\n");
    usage(stderr);
    return 2;
  }
  if (!cfg.trainer) {
    /* default: distrain-train installed beside us, or in the build tree's trainer dir */
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
      self[n] = '\0';
      char *dir = dirname(self);
      snprintf(trainer, sizeof trainer, "%s/distrain-train", dir);
      if (access(trainer, X_OK) != 0)
        snprintf(trainer, sizeof trainer, "%s/../trainer/distrain-train", dir);
    }
    cfg.trainer = trainer;
  }
  if (access(cfg.trainer, X_OK) != 0) {
    fprintf(stderr, "distrain-worker: trainer %s is not executable (use --trainer PATH)\n",
            cfg.trainer);
    return 2;
  }
  if (!cfg.hostname) {
    gethostname(host, sizeof host - 1);
    cfg.hostname = host;
  }
  if (!dt_utf8_valid(cfg.hostname, strlen(cfg.hostname))) { /* the coordinator would refuse it */
    fprintf(stderr, "distrain-worker: the host name is not UTF-8; name the node with --hostname\n");
    return 2;
  }
  if (!cfg.work_dir) {
    const char *st = getenv("STATE_DIRECTORY");
    snprintf(work, sizeof work, "%s/worker", st && *st ? st : "/var/lib/distrain");
    cfg.work_dir = work;
  }
  char tag[300];
  snprintf(tag, sizeof tag, "worker %s", cfg.hostname);
  dt_log_set_tag(tag);
  signal(SIGPIPE, SIG_IGN);
  uv_loop_t *loop = uv_default_loop();
  /* Before the agent: its first registration may complete on the loop's first turn. */
  dt_notify_init(loop, &g_notify, notify_status, NULL);
  cfg.on_registered = on_registered;
  int rc = dt_agent_start(&g_agent, loop, &cfg);
  if (rc != 0) {
    fprintf(stderr, "distrain-worker: cannot start: %s\n", dt_strerror(rc));
    return 1;
  }
  uv_signal_init(loop, &g_sigterm);
  uv_signal_init(loop, &g_sigint);
  uv_signal_start(&g_sigterm, on_signal, SIGTERM);
  uv_signal_start(&g_sigint, on_signal, SIGINT);
  uv_run(loop, UV_RUN_DEFAULT);
  uv_loop_close(loop);
  return 0;
}
