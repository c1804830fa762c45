/* distrainctl.c — the user's CLI.
 *
 *   distrainctl run --local [--nodes N] [--devices-per-node M] [--run-dir DIR] JOB.yaml
 *   distrainctl submit JOB.yaml            distrainctl status [JOB] [--watch] [--plot PNG]
 *   distrainctl stop JOB                   distrainctl resume JOB
 *   distrainctl nodes
 *   distrainctl drain NODE [--reason TEXT] [--wait [--timeout S]]   distrainctl undrain NODE
 *   distrainctl logs JOB [--rank R] [--follow] [--work-dir DIR]
 *   distrainctl plan --model PRESET --seq S --global-batch B --gpus N ... (see plan --help)
 * Common: --coordinator HOST:PORT (default $DISTRAIN_COORDINATOR or 127.0.0.1:7470),
 * --token-file FILE ($DISTRAIN_TOKEN_FILE or /etc/distrain/token), --json, --set S.K=V,
 * --metrics FILE, --tls-cert/--tls-key/--tls-ca PEM (rpc.h, "TLS"). Exit codes: 0 success (run: the
 * job completed), 1 the job failed or an operation failed, 2 usage errors, 3 drain --wait
 * --timeout ran out with trainers still on the node. */
#include <getopt.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"
#include "dt_log.h"
#include "dt_util.h"
#include "jobspec.h"
#include "rpc.h"

#define MAX_SETS 128

typedef struct {
  dt_ctl_opts_t o;
  dt_ctl_local_t local;
  int is_local, watch, rank, follow, now, wait;
  double timeout_s; /* drain --wait --timeout; < 0: none */
  const char *work_dir, *plot, *reason;
  char *sets[MAX_SETS];
  int nsets;
  char *pos[2 + DT_CTL_PLOT_MAX_JOBS]; /* the command, then status's JOBs at the most */
  int npos;
} args_t;

static void usage(FILE *out)
{
  fprintf(out,
          "usage: distrainctl COMMAND [options]\n"
          "  run --local [--nodes N] [--devices-per-node M] [--run-dir DIR] JOB.yaml\n"
          "                     start a coordinator and N agents here, run the job, exit with "
          "its result\n"
          "  submit JOB.yaml    submit to a running coordinator; prints the job id\n"
          "  status [JOB] [--watch] [--plot loss.png]   all jobs, or one (follow it with "
          "--watch;\n"
          "                     --plot draws its loss curve with gnuplot; status JOB JOB...\n"
          "                     --plot draws up to 8 jobs' curves on one plot, to compare)\n"
          "  stop JOB [--now]   stop a job: its trainers save their step as a checkpoint, then\n"
          "                     exit (--now: kill them at once)\n"
          "  resume JOB         run a stopped or failed job again from its last checkpoint\n"
          "  nodes              registered nodes\n"
          "  drain NODE [--reason TEXT] [--wait [--timeout S]]   no new work goes to NODE (a\n"
          "                     node id or a hostname); a job running there saves its step and\n"
          "                     restarts on the other nodes, uncounted (--wait: until no trainer\n"
          "                     runs there; --timeout: exit 3 if one still does after S seconds)\n"
          "  undrain NODE       NODE takes work again\n"
          "  logs JOB [--rank R] [--follow]   a trainer's log (rank 0 by default) from its node,\n"
          "                     through the coordinator; --work-dir DIR reads local files instead\n"
          "  plan --model PRESET --seq S --global-batch B --gpus N [...]   memory/time per "
          "layout (plan --help)\n"
          "options: --coordinator HOST:PORT  --token-file FILE  --json  --set SECTION.KEY=VALUE\n"
          "         --metrics FILE (rank 0's per-step JSON, with run and status --watch)\n"
          "         " DT_RPC_TLS_USAGE " (TLS; run --local passes them on)\n");
}

static int parse(int argc, char **argv, args_t *a)
{
  static const struct option opts[] = {{"coordinator", required_argument, 0, 'c'},
                                       {"token-file", required_argument, 0, 't'},
                                       {"json", no_argument, 0, 'j'},
                                       {"metrics", required_argument, 0, 'm'},
                                       {"set", required_argument, 0, 's'},
                                       {"local", no_argument, 0, 'L'},
                                       {"nodes", required_argument, 0, 'n'},
                                       {"devices-per-node", required_argument, 0, 'd'},
                                       {"run-dir", required_argument, 0, 'r'},
                                       {"watch", no_argument, 0, 'w'},
                                       {"rank", required_argument, 0, 'R'},
                                       {"work-dir", required_argument, 0, 'W'},
                                       {"plot", required_argument, 0, 'P'},
                                       DT_RPC_TLS_OPTIONS,
                                       {"follow", no_argument, 0, 'f'},
                                       {"now", no_argument, 0, 'N'},
                                       {"reason", required_argument, 0, 'e'},
                                       {"wait", no_argument, 0, 'T'},
                                       {"timeout", required_argument, 0, 'O'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int ch;
  int64_t v;
  opterr = 0;
  while ((ch = getopt_long(argc, argv, "-h", opts, NULL)) != -1) {
    switch (ch) {
    case 1: /* positional, in order */
      if (a->npos == (int)DT_ARRAY_SIZE(a->pos))
        return DT_EINVAL;
      a->pos[a->npos++] = optarg;
      break;
    case 'c':
      a->o.coordinator = optarg;
      break;
    case 't':
      a->o.token_file = optarg;
      break;
    case 'j':
      a->o.json = 1;
      break;
    case 'm':
      a->o.metrics_path = optarg;
      break;
    case 's':
      if (a->nsets == MAX_SETS) {
        fprintf(stderr, "distrainctl: too many --set options (max %d)\n", MAX_SETS);
        return DT_EINVAL;
      }
      a->sets[a->nsets++] = optarg;
      break;
    case 'L':
      a->is_local = 1;
      break;
    case 'w':
      a->watch = 1;
      break;
    case 'f':
      a->follow = 1;
      break;
    case 'N':
      a->now = 1;
      break;
    case 'e':
      a->reason = optarg;
      break;
    case 'T':
      a->wait = 1;
      break;
    case 'O':
      if (dt_parse_f64(optarg, &a->timeout_s) != 0 || !(a->timeout_s >= 0.0)) {
        fprintf(stderr, "distrainctl: --timeout: expected seconds >= 0, got '%s'\n", optarg);
        return DT_EINVAL;
      }
      break;
    case 'r':
      a->local.run_dir = optarg;
      break;
    case 'W':
      a->work_dir = optarg;
      break;
    case 'P':
      a->plot = optarg;
      break;
    case DT_RPC_OPT_TLS_CERT:
    case DT_RPC_OPT_TLS_KEY:
    case DT_RPC_OPT_TLS_CA:
      if (dt_rpc_tls_option("distrainctl", ch, optarg) != 0)
        return DT_EINVAL;
      break;
    case 'n':
    case 'd':
    case 'R':
      /* a rank of the largest world the coordinator plans; a local cluster's size */
      if (dt_parse_i64(optarg, &v) != 0 || v < (ch == 'R' ? 0 : 1) ||
          v > (ch == 'R' ? (1 << 20) - 1 : 4096)) {
        fprintf(stderr, "distrainctl: %s: expected an integer in %d..%d, got '%s'\n",
                ch == 'n'   ? "--nodes"
                : ch == 'd' ? "--devices-per-node"
                            : "--rank",
                ch == 'R' ? 0 : 1, ch == 'R' ? (1 << 20) - 1 : 4096, optarg);
        return DT_EINVAL;
      }
      *(ch == 'n' ? &a->local.nodes : ch == 'd' ? &a->local.devices_per_node : &a->rank) = (int)v;
      break;
    case 'h':
      usage(stdout);
      exit(0);
    default:
      fprintf(stderr, "distrainctl: unknown or incomplete option '%s'\n", argv[optind - 1]);
      return DT_EINVAL;
    }
  }
  return 0;
}

static int need(const args_t *a, int n, const char *what)
{
  if (a->npos != n + 1) {
    fprintf(stderr, "distrainctl %s: expected %s\n", a->pos[0], what);
    return 0;
  }
  return 1;
}

static int cmd_run(args_t *a)
{
  if (!a->is_local) {
    fprintf(stderr, "distrainctl run: only --local is supported; use submit for a cluster\n");
    return 2;
  }
  if (!need(a, 1, "JOB.yaml"))
    return 2;
  Distrain__V1__JobSpec *spec;
  if (dt_ctl_load_spec(a->pos[1], a->sets, a->nsets, &spec) != 0)
    return 1;
  int rc = dt_ctl_run_local(&a->local, &a->o, spec);
  dt_jobspec_free(spec);
  return rc == 0 ? 0 : 1;
}

static int with_client(args_t *a, dt_rpc_client_t **c)
{
  if (dt_ctl_connect(&a->o, c) != 0) {
    fprintf(stderr, "distrainctl: cannot connect to %s (token %s)\n", a->o.coordinator,
            a->o.token_file);
    return 0;
  }
  return 1;
}

static int call(dt_rpc_client_t *c, const char *method, const ProtobufCMessage *req,
                ProtobufCMessage **resp)
{
  char err[1024];
  int rc = dt_rpc_client_call(c, method, req, resp, dt_ctl_rpc_timeout_ms(), 0, err, sizeof err);
  if (rc != 0)
    fprintf(stderr, "distrainctl: %s: %s\n", method, err);
  return rc;
}

static int cmd_submit(args_t *a)
{
  if (!need(a, 1, "JOB.yaml"))
    return 2;
  Distrain__V1__JobSpec *spec;
  dt_rpc_client_t *c;
  if (dt_ctl_load_spec(a->pos[1], a->sets, a->nsets, &spec) != 0)
    return 1;
  if (!with_client(a, &c)) {
    dt_jobspec_free(spec);
    return 1;
  }
  char id[64];
  int rc = dt_ctl_submit(c, spec, id, sizeof id);
  if (rc == 0) {
    if (a->o.json) {
      fputs("{\"job_id\": ", stdout);
      dt_json_string(stdout, id);
      fputs("}\n", stdout);
    } else {
      printf("%s\n", id);
    }
  }
  dt_jobspec_free(spec);
  dt_rpc_client_destroy(c);
  return rc == 0 ? 0 : 1;
}

static int cmd_status(args_t *a)
{
  dt_rpc_client_t *c;
  ProtobufCMessage *resp;
  int rc;
  if (a->npos > 2 && !a->plot) {
    fprintf(stderr, "distrainctl status: expected at most one JOB (several with --plot FILE, "
                    "their loss curves compared)\n");
    return 2;
  }
  if (a->plot && (a->npos < 2 || a->npos > 1 + DT_CTL_PLOT_MAX_JOBS || a->watch)) {
    fprintf(stderr,
            "distrainctl status: --plot FILE needs one JOB, or up to %d to compare (and no "
            "--watch)\n",
            DT_CTL_PLOT_MAX_JOBS);
    return 2;
  }
  if (!with_client(a, &c))
    return 1;
  if (a->plot) {
    rc = dt_ctl_plot(c, a->pos + 1, (size_t)a->npos - 1, a->plot);
    if (rc == 0)
      printf("%s\n", a->plot);
  } else if (a->npos == 2 && a->watch) {
    rc = dt_ctl_follow(c, &a->o, a->pos[1]);
  } else if (a->npos == 2) {
    Distrain__V1__GetJobRequest req = DISTRAIN__V1__GET_JOB_REQUEST__INIT;
    req.job_id = a->pos[1];
    if ((rc = call(c, "GetJob", &req.base, &resp)) == 0) {
      dt_ctl_print_job(stdout, (void *)resp, a->o.json);
      protobuf_c_message_free_unpacked(resp, NULL);
    }
  } else {
    Distrain__V1__ListJobsRequest req = DISTRAIN__V1__LIST_JOBS_REQUEST__INIT;
    if ((rc = call(c, "ListJobs", &req.base, &resp)) == 0) {
      Distrain__V1__ListJobsResponse *r = (void *)resp;
      dt_ctl_print_jobs(stdout, r->jobs, r->n_jobs, a->o.json);
      protobuf_c_message_free_unpacked(resp, NULL);
    }
  }
  dt_rpc_client_destroy(c);
  return rc == 0 ? 0 : 1;
}

#define RESUME_WAIT_MS 60000 /* for the trainers of a job just stopped to finish saving */

/* A call on the job a->pos[1] (req names it) that answers with the job (stop, resume),
 * printed. While the coordinator answers UNAVAILABLE it is asked again every second for up to
 * wait_ms, saying why once. */
static int job_call(args_t *a, const char *method, const ProtobufCMessage *req, int wait_ms)
{
  if (!need(a, 1, "JOB"))
    return 2;
  dt_rpc_client_t *c;
  ProtobufCMessage *resp;
  if (!with_client(a, &c))
    return 1;
  char err[1024];
  int rc;
  for (int waited = 0;; waited += 1000) {
    rc = dt_rpc_client_call(c, method, req, &resp, dt_ctl_rpc_timeout_ms(), 0, err, sizeof err);
    if (rc != DT_EUNAVAIL || waited >= wait_ms)
      break;
    if (waited == 0)
      fprintf(stderr, "distrainctl %s: %s; waiting\n", a->pos[0], err);
    dt_sleep_ms(1000);
  }
  if (rc == 0) {
    dt_ctl_print_job(stdout, (void *)resp, a->o.json);
    protobuf_c_message_free_unpacked(resp, NULL);
  } else {
    fprintf(stderr, "distrainctl: %s: %s\n", method, err);
  }
  dt_rpc_client_destroy(c);
  return rc == 0 ? 0 : 1;
}

static int cmd_stop(args_t *a)
{
  Distrain__V1__StopJobRequest req = DISTRAIN__V1__STOP_JOB_REQUEST__INIT;
  req.job_id = a->pos[1]; /* NULL without one: job_call says so first */
  req.now = a->now;
  return job_call(a, "StopJob", &req.base, 0);
}

/* Waits while the trainers of a job just stopped still save their step (or the coordinator is
 * restarting). */
static int cmd_resume(args_t *a)
{
  Distrain__V1__ResumeJobRequest req = DISTRAIN__V1__RESUME_JOB_REQUEST__INIT;
  req.job_id = a->pos[1];
  return job_call(a, "ResumeJob", &req.base, RESUME_WAIT_MS);
}

static int cmd_nodes(args_t *a)
{
  dt_rpc_client_t *c;
  ProtobufCMessage *resp;
  if (!need(a, 0, "no arguments") || !with_client(a, &c))
    return a->npos == 1 ? 1 : 2;
  Distrain__V1__ListNodesRequest req = DISTRAIN__V1__LIST_NODES_REQUEST__INIT;
  int rc = call(c, "ListNodes", &req.base, &resp);
  if (rc == 0) {
    Distrain__V1__ListNodesResponse *r = (void *)resp;
    dt_ctl_print_nodes(stdout, r->nodes, r->n_nodes, a->o.json);
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  dt_rpc_client_destroy(c);
  return rc == 0 ? 0 : 1;
}

#define DRAIN_WAIT_POLL_MS 1000

/* One node, from ListNodes: *out is a Distrain__V1__Node of its own (free it unpacked). */
static int node_by_id(dt_rpc_client_t *c, const char *id, ProtobufCMessage **out)
{
  Distrain__V1__ListNodesRequest req = DISTRAIN__V1__LIST_NODES_REQUEST__INIT;
  ProtobufCMessage *resp;
  int rc = call(c, "ListNodes", &req.base, &resp);
  if (rc != 0)
    return rc;
  Distrain__V1__ListNodesResponse *r = (void *)resp;
  rc = DT_ENOENT;
  for (size_t i = 0; i < r->n_nodes && rc == DT_ENOENT; i++)
    if (strcmp(r->nodes[i]->node_id, id) == 0)
      rc = (*out = dt_pb_copy(&r->nodes[i]->base)) ? 0 : DT_ENOMEM;
  if (rc == DT_ENOENT)
    fprintf(stderr, "distrainctl: node %s is no longer listed\n", id);
  protobuf_c_message_free_unpacked(resp, NULL);
  return rc;
}

/* drain NODE / undrain NODE. With --wait, drain returns once no trainer starts or runs on the
 * node (its trainers have saved their step and exited): the node can be taken down. */
static int cmd_drain(args_t *a)
{
  const int undo = strcmp(a->pos[0], "undrain") == 0;
  if (!need(a, 1, "NODE (a node id or a hostname)"))
    return 2;
  if (undo && (a->reason || a->wait)) {
    fprintf(stderr, "distrainctl undrain: --reason and --wait are for drain\n");
    return 2;
  }
  if (a->timeout_s >= 0.0 && !a->wait) {
    fprintf(stderr, "distrainctl %s: --timeout is for drain --wait\n", a->pos[0]);
    return 2;
  }
  dt_rpc_client_t *c;
  ProtobufCMessage *resp;
  if (!with_client(a, &c))
    return 1;
  Distrain__V1__DrainNodeRequest req = DISTRAIN__V1__DRAIN_NODE_REQUEST__INIT;
  req.node = a->pos[1];
  req.undo = undo;
  req.reason = (char *)(a->reason ? a->reason : "");
  int rc = call(c, "DrainNode", &req.base, &resp), timed_out = 0;
  char id[64] = "";
  if (rc == 0)
    snprintf(id, sizeof id, "%s", ((Distrain__V1__Node *)resp)->node_id);
  const double deadline = dt_now_ms() + 1000.0 * a->timeout_s;
  for (;;) {
    const Distrain__V1__Node *nd = rc == 0 ? (const void *)resp : NULL;
    if (!nd || !a->wait || nd->state != DISTRAIN__V1__NODE_STATE__NODE_ALIVE ||
        !dt_ctl_node_busy(nd))
      break;
    const double left = deadline - dt_now_ms();
    if (a->timeout_s >= 0.0 && left <= 0.0) {
      timed_out = 1;
      break;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    dt_sleep_ms(a->timeout_s >= 0.0 ? DT_MIN(left, DRAIN_WAIT_POLL_MS) : DRAIN_WAIT_POLL_MS);
    rc = node_by_id(c, id, &resp);
  }
  if (rc == 0) {
    Distrain__V1__Node *nd = (void *)resp;
    dt_ctl_print_nodes(stdout, &nd, 1, a->o.json);
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  if (timed_out)
    fprintf(stderr,
            "distrainctl drain: %s still runs trainers after %g s; it stays drained (wait "
            "again with drain --wait, or stop the job)\n",
            id, a->timeout_s);
  dt_rpc_client_destroy(c);
  return rc != 0 ? 1 : timed_out ? 3 : 0;
}

/* logs --work-dir DIR: the rank's log file under DIR/JOB/ (DIR may be a glob). For what no
 * coordinator serves any more: `run --local`'s node directories once it has exited. */
static int logs_local(args_t *a)
{
  char pattern[4200];
  snprintf(pattern, sizeof pattern, "%s/%s/rank-%d.log", a->work_dir, a->pos[1], a->rank);
  glob_t g;
  int found = 0;
  if (glob(pattern, 0, NULL, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; i++) {
      FILE *fp = fopen(g.gl_pathv[i], "r");
      if (!fp)
        continue;
      found++;
      if (g.gl_pathc > 1)
        printf("==> %s <==\n", g.gl_pathv[i]);
      char buf[8192];
      size_t n;
      while ((n = fread(buf, 1, sizeof buf, fp)) > 0)
        fwrite(buf, 1, n, stdout);
      fclose(fp);
    }
    globfree(&g);
  }
  if (!found) {
    fprintf(stderr, "distrainctl logs: no log of %s rank %d in %s\n", a->pos[1], a->rank,
            a->work_dir);
    return 1;
  }
  return 0;
}

#define LOGS_FOLLOW_WAIT_MS 2000 /* how long one --follow call waits for new bytes */
#define LOGS_FOLLOW_RETRIES 5    /* unreachable node or late answer in a row: give up */
#define LOGS_FOLLOW_BUSY    30   /* the node's log reads at their bound, in a row: give up */

/* logs JOB: GetLogs from offset 0 until the end of the file (the whole log, in chunks of up to
 * 1 MiB); with --follow, on from there until the job has ended and its log is read. A rank that
 * moved to another node (a new generation) is followed there, from the start of its log on that
 * node. */
static int logs_rpc(args_t *a)
{
  dt_rpc_client_t *c;
  if (!with_client(a, &c))
    return 1;
  char node[64] = "", err[1024];
  uint64_t offset = 0;
  int rc = 0, retries = 0, busy = 0;
  for (;;) {
    Distrain__V1__GetLogsRequest req = DISTRAIN__V1__GET_LOGS_REQUEST__INIT;
    req.job_id = a->pos[1];
    req.rank = a->rank;
    req.offset = offset;
    req.node_id = node;
    req.wait_ms = a->follow ? LOGS_FOLLOW_WAIT_MS : 0;
    ProtobufCMessage *m;
    rc = dt_rpc_client_call(c, "GetLogs", &req.base, &m, (int)req.wait_ms + dt_ctl_rpc_timeout_ms(),
                            0, err, sizeof err);
    /* A follower outlives a moment when other readers fill the node's bound of held reads:
     * those expire within their wait, so it waits (quietly after the first time) too. */
    const int again = rc == DT_EBUSY ? ++busy <= LOGS_FOLLOW_BUSY
                                     : (rc == DT_EUNAVAIL || rc == DT_ETIMEDOUT) &&
                                           ++retries <= LOGS_FOLLOW_RETRIES;
    if (rc != 0 && a->follow && again) {
      if (rc != DT_EBUSY || busy == 1)
        fprintf(stderr, "distrainctl logs: %s; trying again\n", err);
      dt_sleep_ms(1000);
      continue;
    }
    if (rc != 0) {
      fprintf(stderr, "distrainctl logs: %s\n", err);
      break;
    }
    retries = busy = 0;
    const Distrain__V1__GetLogsResponse *r = (const void *)m;
    if (strcmp(node, r->node_id) != 0)
      fprintf(stderr, "==> %s rank %d %s %s (%s): %s <==\n", a->pos[1], a->rank,
              node[0] ? "moved to" : "on", r->node_id, r->hostname, r->path);
    if (r->data.len) /* data is NULL when empty */
      fwrite(r->data.data, 1, r->data.len, stdout);
    fflush(stdout);
    snprintf(node, sizeof node, "%s", r->node_id);
    offset = r->next_offset;
    const int done = a->follow ? r->complete : r->eof;
    protobuf_c_message_free_unpacked(m, NULL);
    if (done)
      break;
  }
  dt_rpc_client_destroy(c);
  return rc == 0 ? 0 : 1;
}

/* Trainer logs live on the nodes; their agents serve them through the coordinator. */
static int cmd_logs(args_t *a)
{
  if (!need(a, 1, "JOB"))
    return 2;
  if (a->work_dir && a->follow) {
    fprintf(stderr, "distrainctl logs: --follow reads through the coordinator, not --work-dir\n");
    return 2;
  }
  return a->work_dir ? logs_local(a) : logs_rpc(a);
}

int main(int argc, char **argv)
{
  args_t a;
  memset(&a, 0, sizeof a);
  a.local.nodes = 1;
  a.local.devices_per_node = 1;
  a.local.run_dir = "distrain-run";
  a.timeout_s = -1.0;
  const char *env_coord = getenv("DISTRAIN_COORDINATOR"), *env_tok = getenv("DISTRAIN_TOKEN_FILE");
  a.o.coordinator = env_coord && *env_coord ? env_coord : "127.0.0.1:7470";
  a.o.token_file = env_tok && *env_tok ? env_tok : "/etc/distrain/token";
  dt_log_init();
  dt_log_set_tag("distrainctl");
  if (argc > 1 && strcmp(argv[1], "plan") == 0) /* its own options: no coordinator involved */
    return dt_ctl_plan(argc - 1, argv + 1);
  if (parse(argc, argv, &a) != 0) {
    usage(stderr);
    return 2;
  }
  if (a.npos == 0) {
    usage(stderr);
    return 2;
  }
  static const struct {
    const char *name;
    int (*fn)(args_t *);
  } cmds[] = {{"run", cmd_run},     {"submit", cmd_submit}, {"status", cmd_status},
              {"stop", cmd_stop},   {"nodes", cmd_nodes},   {"logs", cmd_logs},
              {"drain", cmd_drain}, {"undrain", cmd_drain}, {"resume", cmd_resume}};
  for (size_t i = 0; i < DT_ARRAY_SIZE(cmds); i++)
    if (strcmp(a.pos[0], cmds[i].name) == 0)
      return cmds[i].fn(&a);
  fprintf(stderr, "distrainctl: unknown command '%s'\n", a.pos[0]);
  usage(stderr);
  return 2;
}
