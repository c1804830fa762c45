/* coord_seeds.c — writes the seeds of fuzz_coord (tests/fuzz/corpus/coord/seed-*): call
 * sequences as the control plane makes them, for the fuzzer to mutate from. Regenerate with
 *
 *   build/tests/fuzz/fuzz_coord_seeds tests/fuzz/corpus/coord
 *
 * (their layout is fuzz_coord.c's: op, 2-byte length, payload). The job is dp=4 over two nodes
 * of two CPU devices each: node-0 holds ranks 0-1 and node-1 ranks 2-3 of generation 1. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distrain.pb-c.h"
#include "dt_util.h"
#include "jobspec.h"

enum { OP_GONE = 14, OP_TIME = 15, OP_RESTART = 16, OP_RENDER = 17, OP_LOCK = 19 };

static FILE *g_out;
static uint32_t g_waiting_ms = 50; /* how long the ranks of a heartbeat wait in all_reduce */
static int g_exit_code = 1;        /* of the ranks of a heartbeat with an error */
static float g_loss = 4.5f;        /* the ranks' loss */
static double g_compute_ms = 100;  /* node-1's ranks' compute per step (node-0's: 100) */

static void rec(unsigned op, const ProtobufCMessage *m)
{
  size_t len = m ? protobuf_c_message_get_packed_size(m) : 0;
  uint8_t *buf = calloc(1, len ? len : 1);
  if (!buf || len > 0xffff)
    abort();
  if (m)
    protobuf_c_message_pack(m, buf);
  const uint8_t head[3] = {(uint8_t)op, (uint8_t)len, (uint8_t)(len >> 8)};
  fwrite(head, 1, 3, g_out);
  fwrite(buf, 1, len, g_out);
  free(buf);
}

/* Time passes (tenths of a second), then the liveness scan runs. */
static void time_passes(uint8_t tenths)
{
  const uint8_t r[4] = {OP_TIME, 1, 0, tenths};
  fwrite(r, 1, sizeof r, g_out);
}

static void call(const char *method, const ProtobufCMessage *m)
{
  const ProtobufCMethodDescriptor *d = protobuf_c_service_descriptor_get_method_by_name(
      &distrain__v1__coordinator__descriptor, method);
  if (!d)
    abort();
  const unsigned index = (unsigned)(d - distrain__v1__coordinator__descriptor.methods);
  rec(index < OP_GONE ? index : index + 6, m); /* fuzz_coord.c: after the 6 other ops */
}

static void open_seed(const char *dir, const char *name)
{
  char path[4096];
  snprintf(path, sizeof path, "%s/seed-%s", dir, name);
  if (!(g_out = fopen(path, "wb"))) {
    perror(path);
    exit(1);
  }
}

static void register_node(const char *host, const char *old_id)
{
  Distrain__V1__Device dev[2] = {DISTRAIN__V1__DEVICE__INIT, DISTRAIN__V1__DEVICE__INIT};
  Distrain__V1__Device *devs[2] = {&dev[0], &dev[1]};
  for (int i = 0; i < 2; i++) {
    dev[i].kind = "cpu";
    dev[i].index = i;
    dev[i].name = "cpu";
    dev[i].memory_bytes = 1ull << 30;
  }
  Distrain__V1__NodeInfo info = DISTRAIN__V1__NODE_INFO__INIT;
  info.hostname = (char *)host;
  info.n_devices = 2;
  info.devices = devs;
  info.agent_version = "0.1.0";
  Distrain__V1__RegisterWorkerRequest r = DISTRAIN__V1__REGISTER_WORKER_REQUEST__INIT;
  r.node = &info;
  r.node_id = (char *)old_id;
  call("RegisterWorker", &r.base);
}

static void submit(void)
{
  Distrain__V1__JobSpec *spec;
  char err[512];
  const char *sets[] = {
      "name=seed",           "data.train=/data/train_*.bin", "parallel.dp=4",
      "training.batch=8",    "training.micro_batch=2",       "training.steps=40",
      "checkpoint.every=10", "elastic.min_nodes=1",          "elastic.max_nodes=2"};
  if (dt_jobspec_new_default(&spec) != 0)
    abort();
  for (size_t i = 0; i < DT_ARRAY_SIZE(sets); i++)
    if (dt_jobspec_set(spec, sets[i], err, sizeof err) != 0) {
      fprintf(stderr, "%s\n", err);
      exit(1);
    }
  if (dt_jobspec_validate(spec, err, sizeof err) != 0) {
    fprintf(stderr, "%s\n", err);
    exit(1);
  }
  Distrain__V1__SubmitJobRequest r = DISTRAIN__V1__SUBMIT_JOB_REQUEST__INIT;
  r.spec = spec;
  call("SubmitJob", &r.base);
  dt_jobspec_free(spec);
}

static void watch(const char *node, uint64_t known)
{
  Distrain__V1__WatchAssignmentRequest r = DISTRAIN__V1__WATCH_ASSIGNMENT_REQUEST__INIT;
  r.node_id = (char *)node;
  r.known_version = known;
  r.timeout_ms = 30000;
  call("WatchAssignment", &r.base);
}

/* A heartbeat of a node whose two ranks (first, first + 1) are in state s at step. */
static void heartbeat(const char *node, int first, Distrain__V1__TrainerState s, int64_t step,
                      const char *error)
{
  Distrain__V1__TrainerStatus ts[2] = {DISTRAIN__V1__TRAINER_STATUS__INIT,
                                       DISTRAIN__V1__TRAINER_STATUS__INIT};
  Distrain__V1__TrainerStatus *tp[2] = {&ts[0], &ts[1]};
  Distrain__V1__StepMetrics sm = DISTRAIN__V1__STEP_METRICS__INIT;
  Distrain__V1__StepMetrics *smp[1] = {&sm};
  sm.step = step;
  sm.loss = g_loss;
  sm.lr = 3e-4;
  sm.ms = 120;
  sm.tokens_per_s = 4000;
  sm.compute_ms = 100;
  Distrain__V1__CommProgress cp = DISTRAIN__V1__COMM_PROGRESS__INIT;
  Distrain__V1__CommProgress *cpp[1] = {&cp};
  cp.group = "job-1/1/dp";
  cp.label = "dp";
  cp.world = 4;
  cp.entered = 10;
  cp.done = 9;
  cp.op = "all_reduce";
  cp.peer = -1;
  cp.waiting_ms = g_waiting_ms;
  Distrain__V1__TrainerProgress prog = DISTRAIN__V1__TRAINER_PROGRESS__INIT;
  prog.n_comms = 1;
  prog.comms = cpp;
  for (int i = 0; i < 2; i++) {
    ts[i].job_id = "job-1";
    ts[i].generation = 1;
    ts[i].rank = first + i;
    ts[i].local_rank = i;
    ts[i].state = s;
    ts[i].pid = 100 + first + i;
    ts[i].step = step;
    ts[i].loss = g_loss;
    ts[i].memory_bytes = 1 << 28;
    ts[i].compute_ms = first == 0 ? 100 : g_compute_ms;
    ts[i].progress = &prog;
    ts[i].last_error = (char *)(error ? error : "");
    ts[i].exit_code = error ? g_exit_code : 0;
  }
  ts[0].n_metrics = first == 0 ? 1 : 0;
  ts[0].metrics = smp;
  Distrain__V1__HeartbeatRequest r = DISTRAIN__V1__HEARTBEAT_REQUEST__INIT;
  r.node_id = (char *)node;
  r.seq = (uint64_t)step + 1;
  r.n_trainers = 2;
  r.trainers = tp;
  call("Heartbeat", &r.base);
}

static void kv(const char *key, int get)
{
  if (get) {
    Distrain__V1__KvGetRequest r = DISTRAIN__V1__KV_GET_REQUEST__INIT;
    r.job_id = "job-1";
    r.generation = 1;
    r.key = (char *)key;
    r.timeout_ms = 10000;
    call("KvGet", &r.base);
  } else {
    Distrain__V1__KvPutRequest r = DISTRAIN__V1__KV_PUT_REQUEST__INIT;
    r.job_id = "job-1";
    r.generation = 1;
    r.key = (char *)key;
    r.value.data = (uint8_t *)"127.0.0.1:29500";
    r.value.len = 15;
    call("KvPut", &r.base);
  }
}

/* Every rank's shard report of a checkpoint step: 4 writers over [0, 4000). */
static void checkpoint(int64_t step, int ranks)
{
  for (int r = 0; r < ranks; r++) {
    Distrain__V1__ReportCheckpointRequest q = DISTRAIN__V1__REPORT_CHECKPOINT_REQUEST__INIT;
    char name[64];
    snprintf(name, sizeof name, "shard-%05d.bin", r);
    q.job_id = "job-1";
    q.generation = 1;
    q.step = step;
    q.rank = r;
    q.world = 4;
    q.lo = 1000 * r;
    q.hi = 1000 * (r + 1);
    q.bytes = 12000;
    q.crc32c = 0x1234u + (uint32_t)r;
    q.name = name;
    call("ReportCheckpoint", &q.base);
  }
}

static void job_call(const char *method)
{
  if (strcmp(method, "GetJobMetrics") == 0) {
    Distrain__V1__GetJobMetricsRequest r = DISTRAIN__V1__GET_JOB_METRICS_REQUEST__INIT;
    r.job_id = "job-1";
    call(method, &r.base);
  } else { /* GetJob, StopJob and ResumeJob share a request layout */
    Distrain__V1__GetJobRequest r = DISTRAIN__V1__GET_JOB_REQUEST__INIT;
    r.job_id = "job-1";
    call(method, &r.base);
  }
}

static void logs(void)
{
  Distrain__V1__GetLogsRequest g = DISTRAIN__V1__GET_LOGS_REQUEST__INIT;
  g.job_id = "job-1";
  g.rank = 1;
  g.max_bytes = 4096;
  call("GetLogs", &g.base);
  watch("node-0", 99); /* the agent's next watch carries the log request (id 1) */
  Distrain__V1__PutLogsRequest p = DISTRAIN__V1__PUT_LOGS_REQUEST__INIT;
  p.node_id = "node-0";
  p.request_id = 1;
  p.job_id = "job-1";
  p.rank = 1;
  p.data.data = (uint8_t *)"step 1 loss 4.5\n";
  p.data.len = 16;
  p.size = 16;
  p.path = "/var/log/distrain/job-1/rank-1.log";
  p.writing = 1;
  call("PutLogs", &p.base);
}

static void drain(const char *node, int undo, const char *reason)
{
  Distrain__V1__DrainNodeRequest r = DISTRAIN__V1__DRAIN_NODE_REQUEST__INIT;
  r.node = (char *)node;
  r.undo = undo;
  r.reason = (char *)reason;
  call("DrainNode", &r.base);
}

/* Two nodes register, a job is planned on them and its trainers start. */
static void running_job(void)
{
  register_node("node-a", "");
  register_node("node-b", "");
  submit();
  rec(OP_RENDER, NULL); /* and the loop turns */
  watch("node-0", 0);
  watch("node-1", 0);
  kv("rank0/addr", 0);
  kv("rank0/addr", 1);
  heartbeat("node-0", 0, DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, 1, NULL);
  heartbeat("node-1", 2, DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, 1, NULL);
}

int main(int argc, char **argv)
{
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const char *dir = argv[1];

  open_seed(dir, "lifecycle"); /* run, checkpoint, restart, finish */
  running_job();
  heartbeat("node-0", 0, DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, 10, NULL);
  checkpoint(10, 4);
  job_call("GetJob");
  job_call("GetJobMetrics");
  call("ListJobs", NULL);
  call("ListNodes", NULL);
  rec(OP_RENDER, NULL);
  rec(OP_RESTART, NULL);
  heartbeat("node-0", 0, DISTRAIN__V1__TRAINER_STATE__TRAINER_SUCCEEDED, 40, NULL);
  heartbeat("node-1", 2, DISTRAIN__V1__TRAINER_STATE__TRAINER_SUCCEEDED, 40, NULL);
  job_call("GetJob");
  fclose(g_out);

  open_seed(dir, "failover"); /* a node dies, a trainer fails, the job recovers */
  running_job();
  checkpoint(10, 3);
  time_passes(20);
  heartbeat("node-1", 2, DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, 11, NULL);
  time_passes(20);      /* node-0 has been silent for 4 s: dead */
  rec(OP_RENDER, NULL); /* and the loop turns */
  watch("node-1", 1);
  heartbeat("node-1", 2, DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED, 12, "peer gone");
  register_node("node-a", "node-0");
  rec(OP_RENDER, NULL); /* and the loop turns */
  job_call("GetJob");
  rec(OP_RENDER, NULL);
  rec(OP_RESTART, NULL);
  job_call("StopJob");
  fclose(g_out);

  open_seed(dir, "store-outage"); /* writes fail while another process holds the database */
  running_job();
  rec(OP_LOCK, NULL);
  heartbeat("node-0", 0, DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, 5, NULL);
  checkpoint(10, 4);
  register_node("node-c", "");
  job_call("StopJob");
  rec(OP_LOCK, NULL);
  rec(OP_RESTART, NULL);
  job_call("GetJob");
  fclose(g_out);

  open_seed(dir, "hang"); /* node-1's ranks wait in all_reduce past the hang timeout */
  running_job();
  time_passes(10);
  heartbeat("node-0", 0, DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, 7, NULL);
  g_waiting_ms = 31000;
  heartbeat("node-1", 2, DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, 7, NULL);
  g_waiting_ms = 50;
  job_call("GetJob");
  rec(OP_RENDER, NULL);
  fclose(g_out);

  open_seed(dir, "utf8");       /* strings that are not UTF-8, and UTF-8 cut short by a buffer */
  register_node("caf\xe9", ""); /* refused: it would reach every ListNodes answer */
  call("ListNodes", NULL);
  running_job();
  char long_error[602] = "x";
  for (int i = 0; i < 300; i++)
    strcat(long_error, "\xc3\xa9"); /* 300 x U+00E9: the job's reason cuts one in two */
  g_exit_code = 2;                  /* the job's input: it fails at once, and its reason stays */
  heartbeat("node-1", 2, DISTRAIN__V1__TRAINER_STATE__TRAINER_FAILED, 3, long_error);
  g_exit_code = 1;
  rec(OP_RENDER, NULL);
  job_call("GetJob");
  call("ListJobs", NULL);
  fclose(g_out);

  open_seed(dir, "diverged"); /* a NaN loss on the dashboard (JSON has no NaN) */
  running_job();
  g_loss = NAN;
  heartbeat("node-0", 0, DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, 2, NULL);
  g_loss = 4.5f;
  rec(OP_RENDER, NULL);
  fclose(g_out);

  open_seed(dir, "straggler"); /* node-1's ranks compute 3x as long: reported, then not */
  running_job();
  for (int step = 2; step < 16; step++) {
    g_compute_ms = step < 7 ? 300 : 100;
    time_passes(11); /* one straggler check a second */
    heartbeat("node-0", 0, DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, step, NULL);
    heartbeat("node-1", 2, DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING, step, NULL);
    if (step == 6)
      job_call("GetJob");
  }
  g_compute_ms = 100;
  rec(OP_RENDER, NULL);
  fclose(g_out);

  open_seed(dir, "ckpt-flood"); /* steps that never get their last shard: at most 8 kept */
  running_job();
  for (int64_t step = 10; step <= 100; step += 10)
    checkpoint(step, 3);
  rec(OP_RESTART, NULL);
  checkpoint(100, 4);
  job_call("GetJob");
  fclose(g_out);

  open_seed(dir, "drain"); /* node-1 drained mid-job: its ranks save and stop; then undrained;
                            * the job stopped and resumed */
  running_job();
  drain("node-b", 0, "swap a DIMM"); /* by hostname */
  watch("node-1", 1);
  g_exit_code = 3;
  heartbeat("node-1", 2, DISTRAIN__V1__TRAINER_STATE__TRAINER_STOPPED, 5, "stopped on request");
  g_exit_code = 1;
  rec(OP_RENDER, NULL);
  rec(OP_RESTART, NULL);
  call("ListNodes", NULL);
  drain("node-1", 1, "");
  rec(OP_RENDER, NULL);
  job_call("StopJob");
  job_call("ResumeJob");
  job_call("ResumeJob"); /* refused: it is not stopped any more */
  rec(OP_RESTART, NULL);
  fclose(g_out);

  open_seed(dir, "held-calls"); /* long polls, logs, clients that go away */
  running_job();
  kv("never/set", 1);
  watch("node-0", 1);
  logs();
  rec(OP_GONE, NULL);
  job_call("StopJob");
  rec(OP_RESTART, NULL);
  rec(OP_RENDER, NULL);
  fclose(g_out);
  return 0;
}
