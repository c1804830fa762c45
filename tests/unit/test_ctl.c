/* test_ctl.c — Check suite for distrainctl's output (coordinator/ctl.c): `nodes` as a table
 * and as JSON, for GPU nodes with and without usage, mixed and CPU nodes, from Node messages
 * built here as ListNodes would return them; a followed job's transitions and placement, from
 * Job messages as GetJob would return them; a job file's relative paths made absolute. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <check.h>
#include <math.h>

#include "ctl.h"
#include "jobspec.h"
#include "ut_fs.h"

#define GIB (1024ull * 1024 * 1024)

/* A node of up to 4 devices and their usage, all in one struct (no allocation). */
typedef struct {
  Distrain__V1__Node node;
  Distrain__V1__NodeInfo info;
  Distrain__V1__Device dev[4], *dev_ptrs[4];
  Distrain__V1__DeviceUsage use[4], *use_ptrs[4];
} node_t;

static void node_make(node_t *n, const char *id, const char *host, const char *kind, int ndev)
{
  memset(n, 0, sizeof *n);
  distrain__v1__node__init(&n->node);
  distrain__v1__node_info__init(&n->info);
  n->node.node_id = (char *)id;
  n->node.info = &n->info;
  n->node.state = DISTRAIN__V1__NODE_STATE__NODE_ALIVE;
  n->node.last_heartbeat_ms = (int64_t)time(NULL) * 1000;
  n->info.hostname = (char *)host;
  n->info.devices = n->dev_ptrs;
  n->info.n_devices = (size_t)ndev;
  for (int i = 0; i < ndev; i++) {
    distrain__v1__device__init(&n->dev[i]);
    n->dev[i].kind = (char *)kind;
    n->dev[i].index = i;
    n->dev[i].name = (char *)kind;
    n->dev_ptrs[i] = &n->dev[i];
  }
  n->node.usage = n->use_ptrs;
}

static void node_gpu(node_t *n, int i, const char *name, uint64_t memory)
{
  n->dev[i].name = (char *)name;
  n->dev[i].memory_bytes = memory;
}

static void node_usage(node_t *n, int index, uint64_t used, uint64_t total, int util)
{
  Distrain__V1__DeviceUsage *u = &n->use[n->node.n_usage];
  distrain__v1__device_usage__init(u);
  u->index = index;
  u->memory_used_bytes = used;
  u->memory_total_bytes = total;
  u->utilization_pct = util;
  n->use_ptrs[n->node.n_usage++] = u;
}

/* dt_ctl_print_nodes into a string (free it). */
static char *print_nodes(node_t **nodes, size_t n, int json)
{
  Distrain__V1__Node *ptrs[8];
  for (size_t i = 0; i < n; i++)
    ptrs[i] = &nodes[i]->node;
  char *buf = NULL;
  size_t len = 0;
  FILE *fp = open_memstream(&buf, &len);
  ck_assert_ptr_nonnull(fp);
  dt_ctl_print_nodes(fp, ptrs, n, json);
  fclose(fp);
  return buf;
}

/* Line `k` (0: the header) of s, without its newline, into line. */
static void nth_line(const char *s, int k, char *line, size_t n)
{
  for (int i = 0; i < k && s; i++) {
    s = strchr(s, '\n');
    s = s ? s + 1 : NULL;
  }
  ck_assert_msg(s && *s, "no line %d", k);
  size_t len = strcspn(s, "\n");
  ck_assert_uint_lt(len, n);
  memcpy(line, s, len);
  line[len] = '\0';
}

/* The DEVICES column: what follows the last heartbeat's "ago" and its padding. */
static const char *devices_col(const char *line)
{
  const char *p = strstr(line, "s ago");
  ck_assert_ptr_nonnull(p);
  p += strlen("s ago");
  while (*p == ' ')
    p++;
  return p;
}

/* ------------------------------------------------------------------------------------------ */
/* Table                                                                                       */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_nodes_table)
{
  node_t gpu, cpu, bare, part, mixed, draining, drained;
  /* Two H100s reporting 12.5 and 10 GiB used of 80, 87% and 84% busy. */
  node_make(&gpu, "node-0", "gpu-a", "cuda", 2);
  node_gpu(&gpu, 0, "NVIDIA H100 80GB HBM3", 80 * GIB);
  node_gpu(&gpu, 1, "NVIDIA H100 80GB HBM3", 80 * GIB);
  node_usage(&gpu, 0, 25 * GIB / 2, 80 * GIB, 87);
  node_usage(&gpu, 1, 10 * GIB, 80 * GIB, 84); /* a mean of 85.5: rounded, 86 */
  gpu.node.n_trainers = 2;
  /* The CPU fallback, on a node whose agent is stopping. */
  node_make(&cpu, "node-1", "cpu-b", "cpu", 4);
  cpu.node.leaving = 1;
  /* A GPU without NVML: no usage, its total memory from the device list. */
  node_make(&bare, "node-2", "gpu-c", "cuda", 1);
  node_gpu(&bare, 0, "NVIDIA A100-SXM4-40GB", 40 * GIB);
  /* Two GPUs, one reporting memory but not utilisation. */
  node_make(&part, "node-3", "gpu-d", "cuda", 2);
  node_gpu(&part, 0, "NVIDIA L4", 24 * GIB);
  node_gpu(&part, 1, "NVIDIA L4", 24 * GIB);
  node_usage(&part, 1, 6 * GIB, 24 * GIB, -1);
  part.node.state = DISTRAIN__V1__NODE_STATE__NODE_DEAD;
  /* Different GPU models on one node, counted per model in order. */
  node_make(&mixed, "node-4", "gpu-e", "cuda", 3);
  node_gpu(&mixed, 0, "NVIDIA A100", 40 * GIB);
  node_gpu(&mixed, 1, "NVIDIA H100", 80 * GIB);
  node_gpu(&mixed, 2, "NVIDIA A100", 40 * GIB);
  node_usage(&mixed, 0, 1 * GIB, 40 * GIB, 10);
  node_usage(&mixed, 1, 2 * GIB, 80 * GIB, 21);
  node_usage(&mixed, 2, 3 * GIB, 40 * GIB, 0);
  /* Drained by an operator: DRAINING while a trainer still runs there (an exited one's record
   * does not count), then DRAINED; the reason, if any, after the devices. */
  Distrain__V1__TrainerStatus ts[2], *tsp[2] = {&ts[0], &ts[1]};
  distrain__v1__trainer_status__init(&ts[0]);
  distrain__v1__trainer_status__init(&ts[1]);
  ts[0].state = DISTRAIN__V1__TRAINER_STATE__TRAINER_STOPPED;
  ts[1].state = DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING;
  node_make(&draining, "node-5", "cpu-f", "cpu", 2);
  draining.node.drained = 1;
  draining.node.drain_reason = "swap a DIMM";
  draining.node.trainers = tsp;
  draining.node.n_trainers = 2;
  node_make(&drained, "node-6", "cpu-g", "cpu", 1);
  drained.node.drained = 1;
  drained.node.trainers = tsp; /* the stopped one only */
  drained.node.n_trainers = 1;

  node_t *all[] = {&gpu, &cpu, &bare, &part, &mixed, &draining, &drained};
  char *out = print_nodes(all, 7, 0);
  char line[512];
  nth_line(out, 0, line, sizeof line);
  ck_assert_str_eq(line,
                   "NODE       HOST                 STATE    TRAINERS  LAST HEARTBEAT  DEVICES");

  nth_line(out, 1, line, sizeof line);
  ck_assert_msg(strncmp(line, "node-0     gpu-a                ALIVE           2  ", 51) == 0, "%s",
                line);
  ck_assert_str_eq(devices_col(line), "2x NVIDIA H100 80GB HBM3, mem 22.5/160.0 GiB, util 86%");

  nth_line(out, 2, line, sizeof line);
  ck_assert_msg(strncmp(line, "node-1     cpu-b                LEAVING         0  ", 51) == 0, "%s",
                line);
  ck_assert_str_eq(devices_col(line), "4x cpu");

  nth_line(out, 3, line, sizeof line);
  ck_assert_str_eq(devices_col(line), "1x NVIDIA A100-SXM4-40GB, 40.0 GiB");

  nth_line(out, 4, line, sizeof line);
  ck_assert_msg(strncmp(line, "node-3     gpu-d                DEAD     ", 41) == 0, "%s", line);
  ck_assert_str_eq(devices_col(line), "2x NVIDIA L4, mem 6.0/24.0 GiB (1 of 2 reporting)");

  nth_line(out, 5, line, sizeof line);
  ck_assert_str_eq(devices_col(line),
                   "2x NVIDIA A100, 1x NVIDIA H100, mem 6.0/160.0 GiB, util 10%");

  nth_line(out, 6, line, sizeof line);
  ck_assert_msg(strncmp(line, "node-5     cpu-f                DRAINING        2  ", 51) == 0, "%s",
                line);
  ck_assert_str_eq(devices_col(line), "2x cpu  [drained: swap a DIMM]");
  nth_line(out, 7, line, sizeof line);
  ck_assert_msg(strncmp(line, "node-6     cpu-g                DRAINED         1  ", 51) == 0, "%s",
                line);
  ck_assert_str_eq(devices_col(line), "1x cpu  [drained]");
  int lines = 0; /* a header and one line per node, nothing else */
  for (const char *p = out; *p; p++)
    lines += *p == '\n';
  ck_assert_int_eq(lines, 8);
  free(out);
}
END_TEST

/* GPUs' health: each problem in words, a lost GPU's unknown memory left out of the sums, and
 * a node's problems shown once (in its drain's reason when the coordinator drained it so). */
START_TEST(test_nodes_gpu_health)
{
  node_t ecc, lost, drained;
  node_make(&ecc, "node-0", "gpu-a", "cuda", 2);
  node_gpu(&ecc, 0, "NVIDIA H100", 80 * GIB);
  node_gpu(&ecc, 1, "NVIDIA H100", 80 * GIB);
  node_usage(&ecc, 0, 10 * GIB, 80 * GIB, 50);
  node_usage(&ecc, 1, 10 * GIB, 80 * GIB, 50);
  ecc.use[1].ecc_uncorrected = 1;
  ecc.use[0].ecc_uncorrected = -1; /* unknown: no problem */
  ecc.use[0].slowdown = 0xc0;      /* no problem either: shown with the usage */
  ecc.use[0].pcie_width = 8;       /* nor a PCIe link trained down */
  ecc.use[0].pcie_max_width = 16;
  ecc.use[1].pcie_width = 16; /* at its width: not slowed */
  ecc.use[1].pcie_max_width = 16;
  node_make(&lost, "node-1", "gpu-b", "cuda", 2);
  node_gpu(&lost, 0, "NVIDIA H100", 80 * GIB);
  node_gpu(&lost, 1, "NVIDIA H100", 80 * GIB);
  node_usage(&lost, 0, 0, 0, -1);
  lost.use[0].lost = 1;
  node_usage(&lost, 1, 5 * GIB, 80 * GIB, 30);
  lost.use[1].remap_failed = 1;
  lost.use[1].reset_pending = 1;
  lost.use[1].ecc_uncorrected = 7;
  lost.use[1].nvlink_down = 0x11;
  node_make(&drained, "node-2", "gpu-c", "cuda", 1);
  node_gpu(&drained, 0, "NVIDIA H100", 80 * GIB);
  node_usage(&drained, 0, 1 * GIB, 80 * GIB, 0);
  drained.use[0].reset_pending = 1;
  drained.node.drained = 1;
  drained.node.drain_reason = "GPU health: GPU 0: memory repairs wait for a reset (row remapping "
                              "or page retirement); reset it";

  char buf[512];
  ck_assert_int_eq(dt_ctl_gpu_problems(ecc.node.usage, 2, buf, sizeof buf), 1);
  ck_assert_str_eq(buf, "GPU 1: 1 uncorrected ECC error since the driver loaded");
  ck_assert_int_eq(dt_ctl_gpu_problems(lost.node.usage, 2, buf, sizeof buf), 2);
  ck_assert_str_eq(buf, "GPU 0: lost (it fell off the bus or needs a reset); GPU 1: 7 uncorrected "
                        "ECC errors since the driver loaded, a row remapping failed (no spare "
                        "memory rows left), memory repairs wait for a reset (row remapping or "
                        "page retirement), NVLinks 0, 4 down (active when its agent started)");
  lost.use[1].nvlink_down = 0x8;
  ck_assert_int_eq(dt_ctl_gpu_problems(lost.node.usage + 1, 1, buf, sizeof buf), 1);
  ck_assert_msg(strstr(buf, "), NVLink 3 down (active when its agent started)"), "%s", buf);
  lost.use[1].nvlink_down = 0;
  lost.use[1].ecc_uncorrected = lost.use[1].remap_failed = lost.use[1].reset_pending = 0;
  ck_assert_int_eq(dt_ctl_gpu_problems(lost.node.usage + 1, 1, buf, sizeof buf), 0);
  lost.use[1].nvlink_down = 1ull << 35; /* the 36th link: the last nvml.h knows */
  ck_assert_int_eq(dt_ctl_gpu_problems(lost.node.usage + 1, 1, buf, sizeof buf), 1);
  ck_assert_str_eq(buf, "GPU 1: NVLink 35 down (active when its agent started)");
  lost.use[1].nvlink_down = 0;
  lost.use[1].ecc_uncorrected = 7;
  lost.use[1].remap_failed = lost.use[1].reset_pending = 1;
  ck_assert_int_eq(dt_ctl_gpu_problems(ecc.node.usage, 1, buf, sizeof buf), 0);
  ck_assert_str_eq(buf, "");
  ck_assert_int_eq(dt_ctl_gpu_problems(lost.node.usage, 2, buf, 12), 2); /* cut, not overrun */
  ck_assert_str_eq(buf, "GPU 0: lost");

  node_t *all[] = {&ecc, &lost, &drained};
  char *out = print_nodes(all, 3, 0);
  char line[1024];
  nth_line(out, 1, line, sizeof line);
  ck_assert_str_eq(devices_col(line),
                   "2x NVIDIA H100, mem 20.0/160.0 GiB, util 50%, GPU 0 slowed (hardware thermal "
                   "slowdown, hardware power brake, PCIe link x8 of x16)  [unhealthy: GPU 1: 1 "
                   "uncorrected ECC error since the driver loaded]");
  nth_line(out, 2, line, sizeof line);
  ck_assert_msg(strstr(line, "2x NVIDIA H100, mem 5.0/80.0 GiB, util 30% (1 of 2 reporting)  "
                             "[unhealthy: GPU 0: lost (it fell off the bus or needs a reset); "
                             "GPU 1: 7 uncorrected"),
                "%s", line);
  nth_line(out, 3, line, sizeof line);
  ck_assert_str_eq(devices_col(line), "1x NVIDIA H100, mem 1.0/80.0 GiB, util 0%  [drained: GPU "
                                      "health: GPU 0: memory repairs wait for a reset (row "
                                      "remapping or page retirement); reset it]");
  free(out);
}
END_TEST

/* A link's error rate slows its GPU past DCGM's health limits (more than 8 PCIe replays, 1
 * NVLink replay or recovery, 6000 NVLink CRC errors a minute), not at them; unknown (-1) is
 * nothing. */
START_TEST(test_gpu_slowed_by_link_errors)
{
  Distrain__V1__DeviceUsage u = DISTRAIN__V1__DEVICE_USAGE__INIT;
  char buf[256];
  u.pcie_replays_per_min = u.nvlink_replays_per_min = u.nvlink_crc_per_min = -1;
  ck_assert(!dt_ctl_gpu_slowed(&u, buf, sizeof buf));
  u.pcie_replays_per_min = 8;
  u.nvlink_replays_per_min = 1;
  u.nvlink_crc_per_min = 6000;
  ck_assert(!dt_ctl_gpu_slowed(&u, buf, sizeof buf));
  ck_assert_str_eq(buf, "");
  u.nvlink_crc_per_min = 6001;
  ck_assert(dt_ctl_gpu_slowed(&u, NULL, 0));
  ck_assert(dt_ctl_gpu_slowed(&u, buf, sizeof buf));
  ck_assert_str_eq(buf, "NVLink CRC errors (6001 errors a minute)");
  u.pcie_replays_per_min = 9;
  u.nvlink_replays_per_min = 2;
  u.slowdown = 0x40;
  ck_assert(dt_ctl_gpu_slowed(&u, buf, sizeof buf));
  ck_assert_str_eq(buf, "hardware thermal slowdown, PCIe link replaying (9 replays a minute), "
                        "NVLink errors (2 replays and recoveries a minute), NVLink CRC errors "
                        "(6001 errors a minute)");
  /* Every cause at once, with long counts, fits the callers' buffer whole. */
  u.slowdown = 0xe8;
  u.pcie_width = 4;
  u.pcie_max_width = 16;
  u.pcie_replays_per_min = u.nvlink_replays_per_min = u.nvlink_crc_per_min = INT64_MAX;
  char whole[DT_CTL_SLOWED_MAX];
  ck_assert(dt_ctl_gpu_slowed(&u, whole, sizeof whole));
  const char *tail = "NVLink CRC errors (9223372036854775807 errors a minute)";
  ck_assert_msg(strlen(whole) < sizeof whole - 1 && strlen(whole) > strlen(tail) &&
                    strcmp(whole + strlen(whole) - strlen(tail), tail) == 0,
                "%s", whole);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* JSON                                                                                        */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_nodes_json)
{
  node_t gpu, cpu;
  node_make(&gpu, "node-0", "gpu-a", "cuda", 2);
  node_gpu(&gpu, 0, "NVIDIA H100 80GB HBM3", 85520809984ull);
  node_gpu(&gpu, 1, "NVIDIA H100 80GB HBM3", 85520809984ull);
  node_usage(&gpu, 0, 13207024435ull, 85520809984ull, 87);
  node_usage(&gpu, 1, 1048576ull, 85520809984ull, -1);
  gpu.use[0].slowdown = 0x28;
  gpu.use[1].ecc_uncorrected = 3;
  gpu.use[1].reset_pending = 1;
  gpu.use[1].xid = 79;
  gpu.use[1].nvlink_down = 0x6;
  gpu.use[1].pcie_width = 4;
  gpu.use[1].pcie_max_width = 16;
  gpu.use[1].pcie_replays_per_min = 40;
  gpu.use[1].nvlink_replays_per_min = -1;
  gpu.node.n_trainers = 1;
  gpu.node.last_heartbeat_ms = 1700000000123;
  node_make(&cpu, "node-1", "cpu \"b\"", "cpu", 1);
  cpu.node.last_heartbeat_ms = 1700000000456;
  cpu.node.drained = 1;
  cpu.node.drain_reason = "for \"good\"";

  node_t *all[] = {&gpu, &cpu};
  char *out = print_nodes(all, 2, 1);
  ck_assert_str_eq(
      out, "[{\"node_id\": \"node-0\", \"hostname\": \"gpu-a\", \"state\": \"ALIVE\", "
           "\"drained\": false, \"drain_reason\": \"\", "
           "\"device_kind\": \"cuda\", \"devices\": ["
           "{\"kind\": \"cuda\", \"index\": 0, \"name\": \"NVIDIA H100 80GB HBM3\", "
           "\"memory_bytes\": 85520809984}, "
           "{\"kind\": \"cuda\", \"index\": 1, \"name\": \"NVIDIA H100 80GB HBM3\", "
           "\"memory_bytes\": 85520809984}], \"usage\": ["
           "{\"index\": 0, \"memory_used_bytes\": 13207024435, \"memory_total_bytes\": "
           "85520809984, \"utilization_pct\": 87, \"lost\": false, \"ecc_uncorrected\": 0, "
           "\"reset_pending\": false, \"remap_failed\": false, \"xid\": 0, \"nvlink_down\": 0, "
           "\"pcie_width\": 0, \"pcie_max_width\": 0, \"pcie_replays_per_min\": 0, "
           "\"nvlink_replays_per_min\": 0, \"nvlink_crc_per_min\": 0, "
           "\"slowdown\": \"hardware slowdown, software thermal slowdown\"}, "
           "{\"index\": 1, \"memory_used_bytes\": 1048576, \"memory_total_bytes\": 85520809984, "
           "\"utilization_pct\": -1, \"lost\": false, \"ecc_uncorrected\": 3, "
           "\"reset_pending\": true, \"remap_failed\": false, \"xid\": 79, \"nvlink_down\": 6, "
           "\"pcie_width\": 4, \"pcie_max_width\": 16, \"pcie_replays_per_min\": 40, "
           "\"nvlink_replays_per_min\": -1, \"nvlink_crc_per_min\": 0, \"slowdown\": \"PCIe "
           "link x4 of x16, PCIe link replaying (40 replays a minute)\"}], "
           "\"gpu_problems\": \"GPU 1: 3 uncorrected ECC errors since the driver loaded, memory "
           "repairs wait for a reset (row remapping or page retirement), Xid 79 (reported until "
           "its agent restarts), NVLinks 1, 2 down (active when its agent started)\", "
           "\"trainers\": 1, \"last_heartbeat_ms\": 1700000000123}, "
           "{\"node_id\": \"node-1\", \"hostname\": \"cpu \\\"b\\\"\", \"state\": \"DRAINED\", "
           "\"drained\": true, \"drain_reason\": \"for \\\"good\\\"\", "
           "\"device_kind\": \"cpu\", \"devices\": ["
           "{\"kind\": \"cpu\", \"index\": 0, \"name\": \"cpu\", \"memory_bytes\": 0}], "
           "\"usage\": [], \"gpu_problems\": \"\", \"trainers\": 0, \"last_heartbeat_ms\": "
           "1700000000456}]\n");
  free(out);

  out = print_nodes(all, 0, 1);
  ck_assert_str_eq(out, "[]\n");
  free(out);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* A followed job                                                                              */
/* ------------------------------------------------------------------------------------------ */

/* What dt_ctl_print_transition prints for j, *placed_gen updated. */
static char *print_transition(const Distrain__V1__Job *j, uint64_t *placed_gen)
{
  char *buf = NULL;
  size_t len = 0;
  FILE *fp = open_memstream(&buf, &len);
  ck_assert_ptr_nonnull(fp);
  dt_ctl_print_transition(fp, "job-1", j, placed_gen);
  fclose(fp);
  return buf;
}

/* What dt_ctl_print_job prints for j (json: its JSON form). */
static char *print_job(const Distrain__V1__Job *j, int json)
{
  char *buf = NULL;
  size_t len = 0;
  FILE *fp = open_memstream(&buf, &len);
  ck_assert_ptr_nonnull(fp);
  dt_ctl_print_job(fp, j, json);
  fclose(fp);
  return buf;
}

/* JSON has no NaN or infinity: a job whose loss diverged prints null there, and the document
 * stays readable (json_job printed "nan", which no JSON reader takes). */
START_TEST(test_job_json_non_finite)
{
  Distrain__V1__Job j = DISTRAIN__V1__JOB__INIT;
  j.job_id = "job-1";
  j.reason = "diverged";
  j.loss = NAN;
  j.tokens_per_s = INFINITY;
  char *buf = print_job(&j, 1);
  ck_assert_msg(strstr(buf, "\"loss\": null, \"tokens_per_s\": null, \"committed_step\": 0"), "%s",
                buf);
  ck_assert_ptr_null(strstr(buf, "nan"));
  ck_assert_ptr_null(strstr(buf, "inf"));
  free(buf);
  size_t len = 0;
  FILE *fp = open_memstream(&buf, &len);
  dt_json_number(fp, "%.3f", 2.5);
  fclose(fp);
  ck_assert_str_eq(buf, "2.500");
  free(buf);
}
END_TEST

/* A step whose save was abandoned (a writer's disk full): status says why under the committed
 * step, and JSON carries it; nothing is printed without one. */
START_TEST(test_job_checkpoint_error)
{
  Distrain__V1__Job j = DISTRAIN__V1__JOB__INIT;
  j.job_id = "job-1";
  j.reason = "running";
  j.committed_step = 200;
  j.checkpoint_error = "step 300 not saved: rank 1 on h1 could not write its shard: no space";
  char *buf = print_job(&j, 0);
  ck_assert_msg(strstr(buf, "checkpoint:  step 200 committed in ?\n"
                            "checkpoint:  step 300 not saved: rank 1 on h1 could not write its "
                            "shard: no space\n"),
                "%s", buf);
  free(buf);
  /* When it was committed, and while the job runs the steps since: what a failure would cost. */
  j.committed_ms = ((int64_t)time(NULL) - 252) * 1000;
  j.state = DISTRAIN__V1__JOB_STATE__JOB_RUNNING;
  j.step = 237;
  buf = print_job(&j, 0);
  ck_assert_msg(strstr(buf, "checkpoint:  step 200 committed 4m1") &&
                    strstr(buf, "s ago in ? (37 steps since)\n"),
                "%s", buf);
  free(buf);
  buf = print_job(&j, 1);
  char want[128];
  snprintf(want, sizeof want,
           "\"committed_step\": 200, \"committed_ms\": %lld, \"checkpoint_error\": \"step 300 "
           "not saved: rank 1 on h1",
           (long long)j.committed_ms);
  ck_assert_msg(strstr(buf, want), "%s", buf);
  free(buf);
  j.committed_ms = ((int64_t)time(NULL) + 5) * 1000; /* the coordinator's clock ahead */
  buf = print_job(&j, 0);
  ck_assert_msg(strstr(buf, "checkpoint:  step 200 committed 0s ago in ? (37 steps since)\n"), "%s",
                buf);
  free(buf);
  j.checkpoint_error = "";
  buf = print_job(&j, 0);
  ck_assert_msg(!strstr(buf, "not saved") && strstr(buf, "step 200 committed"), "%s", buf);
  free(buf);
}
END_TEST

/* A poll that sees RUNNING where the rendezvous fell between two polls prints the placement
 * from the ranks (4 ranks, 2 a node); one that saw RENDEZVOUS (whose reason names it) does
 * not print it again, nor does a later state of the same generation; a new generation does,
 * without its nodes where it has already ended (a fast job: PENDING, then COMPLETED). */
START_TEST(test_transitions_show_the_placement)
{
  Distrain__V1__ParallelSpec par = DISTRAIN__V1__PARALLEL_SPEC__INIT;
  par.pp = 2, par.dp = 1, par.cp = 1, par.tp = 2;
  Distrain__V1__JobSpec spec = DISTRAIN__V1__JOB_SPEC__INIT;
  spec.parallel = &par;
  Distrain__V1__RankStatus rs[4], *ranks[4];
  const char *node_of[4] = {"node-1", "node-1", "node-0", "node-0"};
  for (int r = 0; r < 4; r++) {
    distrain__v1__rank_status__init(&rs[r]);
    rs[r].rank = r;
    rs[r].node_id = (char *)node_of[r];
    ranks[r] = &rs[r];
  }
  Distrain__V1__Job j = DISTRAIN__V1__JOB__INIT;
  j.spec = &spec;
  j.state = DISTRAIN__V1__JOB_STATE__JOB_PENDING;
  j.reason = "waiting for nodes: 0 idle, min_nodes 2";
  uint64_t placed = 0;
  char *out = print_transition(&j, &placed);
  ck_assert_str_eq(out, "[job-1] PENDING (generation 0): waiting for nodes: 0 idle, min_nodes 2\n");
  free(out);

  j.state = DISTRAIN__V1__JOB_STATE__JOB_RUNNING, j.generation = 1, j.world_size = 4;
  j.reason = "all 4 ranks running";
  j.ranks = ranks, j.n_ranks = 4;
  out = print_transition(&j, &placed);
  ck_assert_str_eq(out, "[job-1] RUNNING (generation 1): all 4 ranks running\n"
                        "[job-1] generation 1: world 4 (pp 2 x dp 1 x cp 1 x tp 2) on "
                        "node-1,node-0\n");
  free(out);
  ck_assert_uint_eq(placed, 1);

  j.state = DISTRAIN__V1__JOB_STATE__JOB_COMPLETED, j.reason = "all 4 ranks finished step 10";
  out = print_transition(&j, &placed);
  ck_assert_str_eq(out, "[job-1] COMPLETED (generation 1): all 4 ranks finished step 10\n");
  free(out);

  j.state = DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS, j.generation = 2;
  j.reason = "world 4 (pp 2 x dp 1 x cp 1 x tp 2), grad accum 2, on node-0,node-1";
  out = print_transition(&j, &placed);
  ck_assert_str_eq(out, "[job-1] RENDEZVOUS (generation 2): world 4 (pp 2 x dp 1 x cp 1 x tp 2), "
                        "grad accum 2, on node-0,node-1\n");
  free(out);
  j.state = DISTRAIN__V1__JOB_STATE__JOB_RUNNING, j.reason = "all 4 ranks running";
  out = print_transition(&j, &placed);
  ck_assert_str_eq(out, "[job-1] RUNNING (generation 2): all 4 ranks running\n");
  free(out);

  j.state = DISTRAIN__V1__JOB_STATE__JOB_FAILED, j.generation = 3, j.ranks = NULL, j.n_ranks = 0;
  j.reason = "rank 0 on node-0 exited with code 1";
  out = print_transition(&j, &placed); /* ended: its world, not its nodes */
  ck_assert_str_eq(out, "[job-1] FAILED (generation 3): rank 0 on node-0 exited with code 1\n"
                        "[job-1] generation 3: world 4 (pp 2 x dp 1 x cp 1 x tp 2)\n");
  free(out);
  ck_assert_uint_eq(placed, 3);
}
END_TEST

/* Writes text as the job file path and loads it (as distrainctl submit does). */
static Distrain__V1__JobSpec *load_text(const char *path, const char *text)
{
  FILE *fp = fopen(path, "w");
  ck_assert_ptr_nonnull(fp);
  fputs(text, fp);
  fclose(fp);
  Distrain__V1__JobSpec *spec = NULL;
  ck_assert_int_eq(dt_ctl_load_spec(path, NULL, 0, &spec), 0);
  return spec;
}

/* Paths in a job file are relative to the file: every path field, whatever the cwd. */
START_TEST(test_spec_paths_relative_to_the_file)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/job.yaml", dir);
  Distrain__V1__JobSpec *spec =
      load_text(path, "data: {train: \"d/train_*.bin\", val: \"d/val.bin\", vocab_file: "
                      "\"gpt2/vocab.json\",\n"
                      "       merge_file: \"gpt2/merges.txt\", eval: \"hs/hellaswag_val.bin\"}\n"
                      "model: {init: \"llmc:w/gpt2.bin\"}\n"
                      "checkpoint: {dir: \"/abs/ckpt\"}\n");
  char real[4096], want[8400];
  ck_assert_ptr_nonnull(realpath(dir, real));
  snprintf(want, sizeof want, "%s/d/train_*.bin", real);
  ck_assert_str_eq(spec->data->train, want);
  snprintf(want, sizeof want, "%s/d/val.bin", real);
  ck_assert_str_eq(spec->data->val, want);
  snprintf(want, sizeof want, "%s/gpt2/vocab.json", real);
  ck_assert_str_eq(spec->data->vocab_file, want);
  snprintf(want, sizeof want, "%s/gpt2/merges.txt", real);
  ck_assert_str_eq(spec->data->merge_file, want);
  snprintf(want, sizeof want, "%s/hs/hellaswag_val.bin", real);
  ck_assert_str_eq(spec->data->eval, want);
  snprintf(want, sizeof want, "llmc:%s/w/gpt2.bin", real);
  ck_assert_str_eq(spec->model->init, want);
  ck_assert_str_eq(spec->checkpoint->dir, "/abs/ckpt");
  dt_jobspec_free(spec);
  /* Hugging Face's weights, and a checkpoint's (fine-tuning) */
  static const char *const kinds[] = {"hf:", "ckpt:"};
  for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
    char text[128];
    snprintf(text, sizeof text, "data: {train: \"t.bin\"}\nmodel: {init: \"%smodels/w\"}\n",
             kinds[k]);
    spec = load_text(path, text);
    snprintf(want, sizeof want, "%s%s/models/w", kinds[k], real);
    ck_assert_str_eq(spec->model->init, want);
    dt_jobspec_free(spec);
  }
  /* Each source of a blend; its weights and names as written. Each validation set. */
  spec = load_text(path, "data: {train: \"0.7:web=web/train_*.bin,0.3:/abs/code.bin,1e-1:x.bin\",\n"
                         "       val: \"1:web/val.bin,1:code_val.bin\",\n"
                         "       val_sets: \"web=web/val_*.bin,code=/abs/code_val.bin\"}\n"
                         "training: {val_every: 10}\n");
  snprintf(want, sizeof want, "0.7:web=%s/web/train_*.bin,0.3:/abs/code.bin,0.1:%s/x.bin", real,
           real);
  ck_assert_str_eq(spec->data->train, want);
  snprintf(want, sizeof want, "1:%s/web/val.bin,1:%s/code_val.bin", real, real);
  ck_assert_str_eq(spec->data->val, want);
  /* Each validation set; its name kept. */
  snprintf(want, sizeof want, "web=%s/web/val_*.bin,code=/abs/code_val.bin", real);
  ck_assert_str_eq(spec->data->val_sets, want);
  dt_jobspec_free(spec);
  ut_rm_rf(dir);
}
END_TEST

static Suite *ctl_suite(void)
{
  Suite *s = suite_create("ctl");
  TCase *t = tcase_create("nodes");
  tcase_add_test(t, test_nodes_table);
  tcase_add_test(t, test_nodes_gpu_health);
  tcase_add_test(t, test_gpu_slowed_by_link_errors);
  tcase_add_test(t, test_nodes_json);
  tcase_add_test(t, test_job_json_non_finite);
  tcase_add_test(t, test_job_checkpoint_error);
  tcase_add_test(t, test_transitions_show_the_placement);
  tcase_add_test(t, test_spec_paths_relative_to_the_file);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(ctl_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
