/* ctl_local.c — `distrainctl run --local`: the embedded default cluster.
 *
 * Starts a distrain-coordinator and N distrain-worker agents (the binaries installed beside
 * distrainctl, or found in the build tree) on loopback, with a fresh state directory and a
 * random token under the run directory, submits the job once every agent has registered,
 * follows it to the end, then stops the agents (which stop their trainers) and the coordinator.
 * Ctrl-C stops the job first; the daemons die with distrainctl however it exits. Run
 * layout: <run_dir>/{token,coordinator.log,state/,node-<i>/{agent.log,<job>/rank-<r>.log}}.
 *
 * Devices: every node offers devices_per_node devices. A job on the CPU (training.device cpu,
 * or auto on a machine without a usable GPU) gets CPU devices. Otherwise they are this
 * machine's GPUs, handed out round robin (distrain-worker --gpus): node i takes GPUs
 * i x devices_per_node, ... modulo their count, so each trainer has a GPU of its own while
 * there are enough, and trainers share GPUs (through the host-staged communicator) when not.
 * training.device cuda on a machine without a usable GPU is refused before anything starts. */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctl.h"
#include "dt_log.h"
#include "dt_util.h"
#include "jobspec.h"
#ifdef DT_HAVE_CUDA
#include "probe.h"
#endif

static volatile sig_atomic_t g_interrupted;

static void on_sigint(int sig)
{
  (void)sig;
  g_interrupted = 1;
}

/* Finds a sibling binary: beside distrainctl (installed), or in the build tree. */
static int find_binary(const char *name, const char *build_subdir, char *out, size_t n)
{
  char self[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0)
    return DT_ESYS;
  self[len] = '\0';
  char *dir = dirname(self);
  snprintf(out, n, "%s/%s", dir, name);
  if (access(out, X_OK) == 0)
    return 0;
  snprintf(out, n, "%s/../%s/%s", dir, build_subdir, name);
  if (access(out, X_OK) == 0)
    return 0;
  fprintf(stderr, "distrainctl: cannot find %s next to distrainctl\n", name);
  return DT_ENOENT;
}

/* Starts argv with stdout/stderr appended to log and stdin from /dev/null; returns the pid or
 * -1. The child gets SIGTERM when distrainctl exits, however it exits (killed, its output pipe
 * closed, its terminal gone), so a local cluster never outlives the command that started it:
 * the agents then stop their trainers. fork rather than posix_spawn for that prctl; the child
 * makes only async-signal-safe calls before exec, and an exec failure comes back as its errno
 * through a close-on-exec pipe. */
static pid_t spawn_logged(char *const argv[], const char *log)
{
  const pid_t parent = getpid();
  int fds[2];
  if (pipe(fds) != 0) {
    fprintf(stderr, "distrainctl: cannot start %s: %s\n", argv[0], strerror(errno));
    return -1;
  }
  fcntl(fds[0], F_SETFD, FD_CLOEXEC);
  fcntl(fds[1], F_SETFD, FD_CLOEXEC);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != parent)
      _exit(127); /* distrainctl is already gone */
    const int out = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const int in = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (out >= 0 && in >= 0 && dup2(out, 1) == 1 && dup2(out, 2) == 2 && dup2(in, 0) == 0)
      execv(argv[0], argv);
    const int err = errno;
    (void)!write(fds[1], &err, sizeof err);
    _exit(127);
  }
  const int fork_err = errno;
  close(fds[1]);
  int err = 0;
  ssize_t n;
  while ((n = read(fds[0], &err, sizeof err)) < 0 && errno == EINTR)
    ;
  close(fds[0]);
  if (pid < 0 || n == (ssize_t)sizeof err) {
    fprintf(stderr, "distrainctl: cannot start %s: %s\n", argv[0],
            strerror(pid < 0 ? fork_err : err));
    if (pid > 0)
      waitpid(pid, NULL, 0);
    return -1;
  }
  return pid;
}

/* SIGTERM, then SIGKILL if it has not exited within grace_ms. */
static void stop_process(pid_t pid, int grace_ms)
{
  if (pid <= 0)
    return;
  kill(pid, SIGTERM);
  for (int waited = 0; waited < grace_ms; waited += 50) {
    if (waitpid(pid, NULL, WNOHANG) == pid)
      return;
    usleep(50000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
}

static int wait_port_file(const char *path, pid_t pid, int timeout_ms, int *port)
{
  for (int waited = 0; waited < timeout_ms; waited += 20) {
    FILE *fp = fopen(path, "r");
    if (fp) {
      int ok = fscanf(fp, "%d", port) == 1;
      fclose(fp);
      if (ok)
        return 0;
    }
    if (waitpid(pid, NULL, WNOHANG) == pid)
      return DT_EREMOTE;
    usleep(20000);
  }
  return DT_ETIMEDOUT;
}

/* The GPUs this machine's nodes share out: 0 for a job on the CPU. DT_ENOTSUP, said, for a job
 * that asks for cuda on a machine without a usable GPU. */
static int local_gpus(const Distrain__V1__JobSpec *spec, int *gpus)
{
  const char *want = spec->training && spec->training->device && spec->training->device[0]
                         ? spec->training->device
                         : "auto";
  char why[512] = "";
  *gpus = 0;
  if (strcmp(want, "cpu") == 0)
    return 0;
#ifdef DT_HAVE_CUDA
  if (dt_cuda_probe(gpus, why, sizeof why) != 0)
    *gpus = 0;
#endif
  if (*gpus == 0 && strcmp(want, "cuda") == 0) {
    fprintf(stderr,
            "distrainctl: training.device is cuda, but this machine has no usable GPU%s%s; set "
            "training.device: cpu (or auto)\n",
            why[0] ? ": " : "", why[0] ? why : "");
    return DT_ENOTSUP;
  }
  return 0;
}

/* distrain-worker --gpus for node i (the module comment): "none", or its GPU numbers. */
static void node_gpus(const dt_ctl_local_t *l, int gpus, int node, char *out, size_t n)
{
  size_t off = 0;
  if (gpus == 0)
    snprintf(out, n, "none");
  for (int k = 0; gpus > 0 && k < l->devices_per_node && off < n; k++)
    off += (size_t)snprintf(out + off, n - off, "%s%d", k ? "," : "",
                            (node * l->devices_per_node + k) % gpus);
}

/* A local cluster's nodes are all it will ever have: a job that cannot be placed on them would
 * wait for nodes forever, so it is refused before anything starts. (The coordinator plans the
 * job itself, with the same dt_jobspec_place.) */
static int check_fits(const dt_ctl_local_t *l, const Distrain__V1__JobSpec *spec)
{
  const Distrain__V1__ElasticSpec *el = spec->elastic;
  const int n = DT_MIN(l->nodes, el->max_nodes);
  char why[256] = "";
  if (el->min_nodes > l->nodes) {
    snprintf(why, sizeof why, "elastic.min_nodes is %d", el->min_nodes);
  } else {
    int *devs = malloc((size_t)n * sizeof *devs);
    if (!devs)
      return DT_ENOMEM;
    for (int i = 0; i < n; i++)
      devs[i] = l->devices_per_node;
    dt_placement_t pl;
    const int dp = dt_jobspec_place(spec, 1, spec->parallel->dp, devs, n, &pl, why, sizeof why);
    dt_placement_free(&pl);
    free(devs);
    if (dp > 0 && dp < spec->parallel->dp) {
      /* Elastic: the job runs, with the same losses, on fewer data-parallel ranks than it
       * asked for. Said, since it is not what the job spec says. */
      fprintf(stderr, "distrainctl: the job asks for dp %d but runs at dp %d: ", spec->parallel->dp,
              dp);
      if (n < l->nodes)
        fprintf(stderr,
                "elastic.max_nodes %d lets it use %d of the %d nodes (--set "
                "elastic.max_nodes=%d lets it use all)\n",
                el->max_nodes, n, l->nodes, l->nodes);
      else
        fprintf(stderr,
                "that is what %d node%s of %d device%s hold%s (--nodes, --devices-per-node)\n", n,
                n == 1 ? "" : "s", l->devices_per_node, l->devices_per_node == 1 ? "" : "s",
                n == 1 ? "s" : "");
    }
    if (dp > 0)
      return 0;
  }
  fprintf(stderr,
          "distrainctl: this local cluster can never run the job: %s. It has %d node%s of %d "
          "device%s (--nodes, --devices-per-node)",
          why, l->nodes, l->nodes == 1 ? "" : "s", l->devices_per_node,
          l->devices_per_node == 1 ? "" : "s");
  if (n < l->nodes)
    fprintf(stderr, ", of which the job may use %d (--set elastic.max_nodes=%d lets it use all)", n,
            l->nodes);
  fputc('\n', stderr);
  return DT_EINVAL;
}

/* The text rank 0 generated (training.sample, after steps of training.sample_every and at the
 * end), for the person watching: every whole block ("---- sample" to "---- end of sample") of
 * each node's rank-0 log, printed once, as it appears. The coordinator numbers nodes as they
 * register, not as they were started, and a restart may have moved rank 0, so every node's
 * rank-0 log is read; off[i]: how far node i's has been. */
typedef struct {
  const char *dir, *job_id;
  int nodes;
  long *off;
} samples_t;

static void print_samples(void *ud)
{
  samples_t *s = ud;
  for (int i = 0; i < s->nodes; i++) {
    char path[PATH_MAX + 128], line[4096];
    snprintf(path, sizeof path, "%s/node-%d/%s/rank-0.log", s->dir, i, s->job_id);
    FILE *fp = fopen(path, "r");
    if (!fp || fseek(fp, s->off[i], SEEK_SET) != 0) {
      if (fp)
        fclose(fp);
      continue;
    }
    char *block = NULL;
    size_t len = 0;
    FILE *b = NULL; /* the block being read */
    while (fgets(line, sizeof line, fp)) {
      if (!strchr(line, '\n') && strlen(line) < sizeof line - 1)
        break; /* a line still being written: read again from the block's start next time */
      if (!b && strncmp(line, "---- sample", 11) == 0 && !(b = open_memstream(&block, &len)))
        break;
      if (b)
        fputs(line, b);
      if (b && strncmp(line, "---- end of sample", 18) == 0) {
        fclose(b);
        b = NULL;
        fwrite(block, 1, len, stdout);
        fflush(stdout);
        free(block);
        block = NULL;
      }
      if (!b)
        s->off[i] = ftell(fp);
    }
    if (b) {
      fclose(b);
      free(block);
    }
    fclose(fp);
  }
}

/* Waits until every agent has registered. The coordinator places a job on the nodes it has
 * when the job arrives (elastic.min_nodes, default 1), so a job submitted while the last agents
 * were still starting would run on fewer nodes than the cluster has, at a smaller dp, and grow
 * only at its first checkpoint. */
static int wait_agents(dt_rpc_client_t *c, const dt_ctl_local_t *l, pid_t *agents, const char *dir)
{
  const int timeout_ms = 30000;
  size_t registered = 0;
  for (int waited = 0; waited < timeout_ms; waited += 50) {
    Distrain__V1__ListNodesRequest req = DISTRAIN__V1__LIST_NODES_REQUEST__INIT;
    ProtobufCMessage *resp;
    char err[256];
    if (dt_rpc_client_call(c, "ListNodes", &req.base, &resp, 5000, 0, err, sizeof err) == 0) {
      registered = ((Distrain__V1__ListNodesResponse *)resp)->n_nodes;
      protobuf_c_message_free_unpacked(resp, NULL);
      if (registered >= (size_t)l->nodes)
        return 0;
    }
    for (int i = 0; i < l->nodes; i++)
      if (waitpid(agents[i], NULL, WNOHANG) == agents[i]) {
        agents[i] = -1; /* reaped */
        fprintf(
            stderr,
            "distrainctl: the agent of node %d exited while starting; see %s/node-%d/agent.log\n",
            i, dir, i);
        return DT_EREMOTE;
      }
    usleep(50000);
  }
  fprintf(stderr, "distrainctl: %zu of %d agents registered within %d s; see %s/node-*/agent.log\n",
          registered, l->nodes, timeout_ms / 1000, dir);
  return DT_ETIMEDOUT;
}

static void stop_job(dt_rpc_client_t *c, const char *job_id)
{
  Distrain__V1__StopJobRequest req = DISTRAIN__V1__STOP_JOB_REQUEST__INIT;
  req.job_id = (char *)job_id;
  ProtobufCMessage *resp;
  char err[256];
  if (dt_rpc_client_call(c, "StopJob", &req.base, &resp, 5000, 0, err, sizeof err) == 0)
    protobuf_c_message_free_unpacked(resp, NULL);
}

int dt_ctl_run_local(const dt_ctl_local_t *l, dt_ctl_opts_t *o, Distrain__V1__JobSpec *spec)
{
  char coord_bin[PATH_MAX], worker_bin[PATH_MAX], dir[PATH_MAX];
  char token_path[PATH_MAX + 64], port_path[PATH_MAX + 64], addr[64], token[256];
  pid_t coord = -1, *agents = calloc((size_t)l->nodes, sizeof(pid_t));
  dt_rpc_client_t *client = NULL;
  int ret = 0, port = 0, gpus = 0;
  if (!agents)
    return DT_ENOMEM;
  DT_CHECK_GOTO(local_gpus(spec, &gpus), ret, out);
  DT_CHECK_GOTO(check_fits(l, spec), ret, out);
  DT_CHECK_GOTO(find_binary("distrain-coordinator", "coordinator", coord_bin, sizeof coord_bin),
                ret, out);
  DT_CHECK_GOTO(find_binary("distrain-worker", "worker/agent", worker_bin, sizeof worker_bin), ret,
                out);
  if (dt_mkdir_p(l->run_dir) != 0 || !realpath(l->run_dir, dir)) {
    fprintf(stderr, "distrainctl: cannot create run directory %s\n", l->run_dir);
    ret = DT_EACCES;
    goto out;
  }
  /* A fresh cluster every run: old state would resurrect old jobs. */
  char cmd[4 * PATH_MAX + 128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s/state' '%s'/node-* '%s/port' '%s'/*.log", dir, dir, dir,
           dir);
  if (system(cmd) != 0) {
    fprintf(stderr, "distrainctl: cannot clean %s\n", dir);
    ret = DT_EIO;
    goto out;
  }
  snprintf(token_path, sizeof token_path, "%s/token", dir);
  snprintf(port_path, sizeof port_path, "%s/port", dir);
  DT_CHECK_GOTO(dt_rpc_write_new_token(token_path, token, sizeof token), ret, out);

  char state[PATH_MAX + 16], log[PATH_MAX + 32];
  snprintf(state, sizeof state, "%s/state", dir);
  snprintf(log, sizeof log, "%s/coordinator.log", dir);
  char hb[16];
  snprintf(hb, sizeof hb, "%d",
           spec->elastic->heartbeat_ms > 0 ? spec->elastic->heartbeat_ms : 500);
  char *cargv[] = {
      coord_bin,  "--listen",    "127.0.0.1:0", "--state-dir",    state, "--token-file",
      token_path, "--port-file", port_path,     "--heartbeat-ms", hb,    NULL};
  coord = spawn_logged(cargv, log);
  if (coord < 0 || wait_port_file(port_path, coord, 10000, &port) != 0) {
    fprintf(stderr, "distrainctl: the coordinator did not start; see %s\n", log);
    ret = DT_EREMOTE;
    goto out;
  }
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  const int devices = l->nodes * l->devices_per_node;
  fprintf(stderr, "distrainctl: local cluster in %s: coordinator on %s, %d node%s x %d %s device%s",
          dir, addr, l->nodes, l->nodes == 1 ? "" : "s", l->devices_per_node, gpus ? "GPU" : "CPU",
          l->devices_per_node == 1 ? "" : "s");
  if (gpus)
    fprintf(stderr, " on this machine's %d GPU%s%s", gpus, gpus == 1 ? "" : "s",
            devices > gpus ? " (trainers share them: parallel.comm nccl would refuse)" : "");
  fputc('\n', stderr);
  /* Every node of a local cluster is this machine: trainers reach each other over loopback,
   * whatever the host name resolves to (unless the user chose an interface or address). */
  if (!getenv("DISTRAIN_COMM_IFACE"))
    setenv("DISTRAIN_COMM_HOST", "127.0.0.1", 0);
  for (int i = 0; i < l->nodes; i++) {
    char work[PATH_MAX + 32], alog[PATH_MAX + 64], host[32], devs[16], gpu_list[1024];
    snprintf(work, sizeof work, "%s/node-%d", dir, i);
    snprintf(alog, sizeof alog, "%s/agent.log", work);
    snprintf(host, sizeof host, "local-%d", i);
    snprintf(devs, sizeof devs, "%d", l->devices_per_node);
    node_gpus(l, gpus, i, gpu_list, sizeof gpu_list);
    if (dt_mkdir_p(work) != 0) {
      ret = DT_EIO;
      goto out;
    }
    char *wargv[] = {worker_bin, "--coordinator", addr,   "--token-file",
                     token_path, "--work-dir",    work,   "--hostname",
                     host,       "--cpu-devices", devs,   "--gpus",
                     gpu_list,   "--grace-ms",    "5000", NULL};
    agents[i] = spawn_logged(wargv, alog);
    if (agents[i] < 0) {
      ret = DT_EREMOTE;
      goto out;
    }
  }
  /* Every agent of a local cluster shares this machine's cores: split them among all the
   * trainers instead of letting each agent hand out all of them. */
  if (spec->training->threads == 0) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    long trainers = (long)l->nodes * l->devices_per_node;
    spec->training->threads = (int32_t)(cores / trainers > 0 ? cores / trainers : 1);
  }
  o->coordinator = addr;
  o->token_file = token_path;
  DT_CHECK_GOTO(dt_ctl_connect(o, &client), ret, out);
  DT_CHECK_GOTO(wait_agents(client, l, agents, dir), ret, out);
  char job_id[64];
  DT_CHECK_GOTO(dt_ctl_submit(client, spec, job_id, sizeof job_id), ret, out);
  fprintf(stderr, "distrainctl: submitted %s; trainer logs in %s/node-*/%s/\n", job_id, dir,
          job_id);
  struct sigaction sa, old_int, old_term;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  samples_t samples = {.dir = dir,
                       .job_id = job_id,
                       .nodes = l->nodes,
                       .off = calloc((size_t)l->nodes, sizeof(long))};
  if (samples.off) {
    o->on_poll = print_samples;
    o->on_poll_ud = &samples;
  }
  ret = dt_ctl_follow_until(client, o, job_id, &g_interrupted);
  o->on_poll = NULL;
  if (g_interrupted) {
    fprintf(stderr, "distrainctl: interrupted: stopping %s\n", job_id);
    stop_job(client, job_id);
    ret = 1;
  }
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
  if (samples.off) /* the end's, written after the last poll */
    print_samples(&samples);
  free(samples.off);
out:
  dt_rpc_client_destroy(client);
  for (int i = 0; i < l->nodes; i++)
    stop_process(agents[i], 10000);
  stop_process(coord, 5000);
  free(agents);
  return ret;
}
