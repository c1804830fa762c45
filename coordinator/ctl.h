/* ctl.h — distrainctl's pieces: talking to a coordinator, printing jobs, following progress,
 * and the embedded local cluster behind `run --local`. */
#ifndef DT_CTL_H
#define DT_CTL_H

#include <signal.h>
#include <stdio.h>

#include "distrain.pb-c.h"
#include "planner.h"
#include "rpc.h"

typedef struct {
  const char *coordinator; /* host:port */
  const char *token_file;
  int json;
  const char *metrics_path; /* --metrics: rank 0's per-step JSON lines */
  /* Called after each poll of a followed job (dt_ctl_follow_until), with on_poll_ud: run --local
   * prints rank 0's samples so as they come. NULL: nothing. */
  void (*on_poll)(void *ud);
  void *on_poll_ud;
} dt_ctl_opts_t;

/* The deadline of one distrainctl RPC: DISTRAIN_CTL_RPC_TIMEOUT_MS (10000). */
int dt_ctl_rpc_timeout_ms(void);
/* A connected client (token read from opts->token_file). */
int dt_ctl_connect(const dt_ctl_opts_t *o, dt_rpc_client_t **out);
/* Loads JOB.yaml onto the defaults, applies --set overrides, validates, and makes the paths
 * in it absolute (relative to the job file's directory). Errors are printed. */
int dt_ctl_load_spec(const char *path, char **sets, int nsets, Distrain__V1__JobSpec **out);
/* Submits; prints nothing. */
int dt_ctl_submit(dt_rpc_client_t *c, const Distrain__V1__JobSpec *spec, char *job_id, size_t len);
/* Follows a job until it ends, printing progress lines (and metrics to o->metrics_path).
 * Returns 0 if it completed, 1 if it failed or was stopped, <0 on RPC errors. */
int dt_ctl_follow(dt_rpc_client_t *c, const dt_ctl_opts_t *o, const char *job_id);
/* Same, returning early (1) once *stop becomes non-zero (a signal handler sets it). */
int dt_ctl_follow_until(dt_rpc_client_t *c, const dt_ctl_opts_t *o, const char *job_id,
                        volatile sig_atomic_t *stop);
/* status JOB [JOB...] --plot FILE: the jobs' training (and validation) loss per step as a PNG,
 * drawn by gnuplot (ctl_plot.c): several jobs (at most DT_CTL_PLOT_MAX_JOBS, the colours told
 * apart) on one plot, to compare runs. Errors are printed: a job, no steps yet, gnuplot missing
 * or failing. */
#define DT_CTL_PLOT_MAX_JOBS 8
int dt_ctl_plot(dt_rpc_client_t *c, char *const *job_ids, size_t n, const char *path);
/* The loss named `name` among a step's validation sets' (train 0) or its blend sources' (train
 * 1) into *loss; 0 when the step has none of that name. */
int dt_ctl_named_loss(const Distrain__V1__StepMetrics *m, int train, const char *name, float *loss);
/* Human table or JSON of jobs / nodes. */
void dt_ctl_print_job(FILE *out, const Distrain__V1__Job *j, int json);
void dt_ctl_print_jobs(FILE *out, Distrain__V1__Job **jobs, size_t n, int json);
void dt_ctl_print_nodes(FILE *out, Distrain__V1__Node **nodes, size_t n, int json);
/* Whether a trainer is starting or running (not yet exited). */
int dt_ctl_trainer_active(const Distrain__V1__TrainerStatus *ts);
/* Whether a trainer is starting or running on the node (a draining node is drained once none
 * is). */
int dt_ctl_node_busy(const Distrain__V1__Node *nd);
/* Whether a GPU's latest sample shows a problem (DeviceUsage's health: lost, uncorrected ECC
 * errors, memory repairs pending or failed, a critical Xid, an NVLink gone down). The coordinator
 * drains a node with one (its heartbeat handler); distrainctl nodes shows them. */
int dt_ctl_gpu_unhealthy(const Distrain__V1__DeviceUsage *u);
/* A node's GPUs' problems as words into buf ("GPU 1: 2 uncorrected ECC errors since the driver
 * loaded; GPU 3: ..."; "" for none); how many GPUs have one. */
int dt_ctl_gpu_problems(Distrain__V1__DeviceUsage *const *usage, size_t n_usage, char *buf,
                        size_t n);
/* Whether a GPU's latest sample shows it slowed, not unhealthy: its clocks slowed by cooling or
 * power (DeviceUsage.slowdown), its PCIe link trained below its width, a link's error rate past
 * DCGM's health limits (DT_CTL_*_MAX). In words into buf ("hardware thermal slowdown, PCIe link
 * x8 of x16, PCIe link replaying (40 replays a minute)"; "" for none; buf may be NULL). */
#define DT_CTL_PCIE_REPLAYS_MAX   8    /* a minute */
#define DT_CTL_NVLINK_REPLAYS_MAX 1    /* replays and recoveries, a minute */
#define DT_CTL_NVLINK_CRC_MAX     6000 /* a minute: 100 a second */
#define DT_CTL_SLOWED_MAX         320  /* bytes that hold the words of every cause at once */
int dt_ctl_gpu_slowed(const Distrain__V1__DeviceUsage *u, char *buf, size_t n);
const char *dt_ctl_state_name(Distrain__V1__JobState s);
/* A followed job's new state (or generation), as a line; and, where *placed_gen is not its
 * generation and it has ranks, the generation's placement as the RENDEZVOUS reason words it
 * ("world 4 (pp 2 x dp 1 x cp 1 x tp 2) on node-0,node-1"): a rendezvous may fall between two
 * polls. *placed_gen: the last generation whose placement was printed (0 at first). */
void dt_ctl_print_transition(FILE *out, const char *job_id, const Distrain__V1__Job *j,
                             uint64_t *placed_gen);

/* run --local: a coordinator and nodes agents on loopback, then submit and follow. Splits the
 * machine's cores among the trainers when the spec leaves training.threads at 0. */
typedef struct {
  int nodes, devices_per_node;
  const char *run_dir;
} dt_ctl_local_t;
int dt_ctl_run_local(const dt_ctl_local_t *l, dt_ctl_opts_t *o, Distrain__V1__JobSpec *spec);

/* distrainctl plan ARGS (argv[0] is "plan"): the memory/time planner; prints the table, JSON
 * or a job-spec snippet. Returns the exit code: 0, 1 (nothing fits), 2 (usage errors). */
int dt_ctl_plan(int argc, char **argv);
/* The layout of e as job-spec YAML (model, training and parallel sections; Llama shapes get no
 * model section), with a comment line naming the estimate. */
void dt_ctl_plan_emit_spec(FILE *out, const dt_plan_model_t *m, const dt_plan_train_t *tr,
                           const dt_plan_eval_t *e);

/* JSON output helpers (emitting only; strings are escaped per RFC 8259). */
void dt_json_string(FILE *out, const char *s);
/* v printed with fmt ("%.9g"), or null when it is NaN or infinite: JSON has no such numbers,
 * and a "nan" would make the whole document unreadable (the dashboard, `status --json`). */
void dt_json_number(FILE *out, const char *fmt, double v);

#endif
