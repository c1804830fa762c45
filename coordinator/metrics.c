/* metrics.c — /metrics: the coordinator's state in the Prometheus text format (prom.h).
 *
 * Rendered on the loop thread from the same state GetJob, ListJobs and ListNodes answer with
 * (rank 0's step, loss and tokens/s on the job; the ranks' slots; the nodes' last heartbeats),
 * so a scrape and `distrainctl status` never disagree. A scrape costs O(nodes + jobs + ranks of
 * the jobs shown per rank) and allocates only its output.
 *
 * Label cardinality is bounded: series per node (the cluster's size) and per job, for the jobs
 * not finished yet and the MetricsFinishedJobs (10) that finished last; per-rank series only for
 * jobs of at most MetricsMaxRanks (64) ranks. Counters and the histogram count since the
 * coordinator started (distrain_coordinator_start_time_seconds tells when). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blend.h"
#include "coord.h"
#include "ctl.h"
#include "dt_param.h"
#include "dt_util.h"
#include "jobspec.h"
#include "mesh.h"
#include "prom.h"

DT_PARAM(MetricsMaxRanks, "METRICS_MAX_RANKS", 64)
DT_PARAM(MetricsFinishedJobs, "METRICS_FINISHED_JOBS", 10)

#ifndef DT_VERSION
#define DT_VERSION "unknown"
#endif

typedef dt_prom_label_t label_t;

static const char *const k_states[] = {"PENDING",   "RENDEZVOUS", "RUNNING", "RECOVERING",
                                       "COMPLETED", "FAILED",     "STOPPED"};

/* ------------------------------------------------------------------------------------------ */
/* Which jobs                                                                                  */
/* ------------------------------------------------------------------------------------------ */

static int cmp_newest_first(const void *pa, const void *pb)
{
  const dt_job_t *a = *(dt_job_t *const *)pa, *b = *(dt_job_t *const *)pb;
  return (a->job->updated_ms < b->job->updated_ms) - (a->job->updated_ms > b->job->updated_ms);
}

dt_job_t **dt_coord_shown_jobs(dt_coord_t *c, size_t *n)
{
  dt_job_t **finished = malloc((c->st.n_jobs + 1) * sizeof *finished);
  dt_job_t **out = malloc((c->st.n_jobs + 1) * sizeof *out);
  size_t nf = 0;
  *n = 0;
  if (!finished || !out) {
    free(finished);
    free(out);
    return NULL;
  }
  for (size_t i = 0; i < c->st.n_jobs; i++)
    if (dt_coord_state_terminal(c->st.jobs[i]->job->state))
      finished[nf++] = c->st.jobs[i];
  qsort(finished, nf, sizeof *finished, cmp_newest_first);
  const size_t keep = (size_t)DT_MAX(0, dt_param_MetricsFinishedJobs());
  for (size_t i = 0; i < c->st.n_jobs; i++) {
    dt_job_t *j = c->st.jobs[i];
    int show = !dt_coord_state_terminal(j->job->state);
    for (size_t k = 0; !show && k < DT_MIN(nf, keep); k++)
      show = finished[k] == j;
    if (show)
      out[(*n)++] = j;
  }
  free(finished);
  return out;
}

/* The current generation's ranks are shown one by one. */
static int per_rank(const dt_job_t *j)
{
  return j->ranks && j->world > 0 && j->world <= dt_param_MetricsMaxRanks() &&
         !dt_coord_state_terminal(j->job->state);
}

/* ------------------------------------------------------------------------------------------ */
/* Families                                                                                    */
/* ------------------------------------------------------------------------------------------ */

static void write_coordinator(FILE *out, const dt_coord_t *c)
{
  dt_prom_family(out, "distrain_build_info", "gauge",
                 "Always 1; the coordinator's version in the label.");
  dt_prom_sample(out, "distrain_build_info", (label_t[]){{"version", DT_VERSION}}, 1, 1);
  dt_prom_family(out, "distrain_coordinator_start_time_seconds", "gauge",
                 "When this coordinator process started (Unix time): counters and histograms "
                 "count from here.");
  dt_prom_sample(out, "distrain_coordinator_start_time_seconds", NULL, 0,
                 (double)c->start_wall_ms / 1000.0);
}

static void write_nodes(FILE *out, const dt_coord_t *c)
{
  const int64_t now = dt_wall_ms();
  dt_prom_family(out, "distrain_node_up", "gauge",
                 "1 while the node heartbeats, 0 once it missed too many heartbeats.");
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    const dt_node_t *n = c->st.nodes[i];
    if (n)
      dt_prom_sample(out, "distrain_node_up",
                     (label_t[]){{"node", n->id}, {"host", n->info->hostname}}, 2,
                     n->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE);
  }
  dt_prom_family(out, "distrain_node_drained", "gauge",
                 "1 while an operator has the node drained (distrainctl drain): it takes no work.");
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    const dt_node_t *n = c->st.nodes[i];
    if (n)
      dt_prom_sample(out, "distrain_node_drained", (label_t[]){{"node", n->id}}, 1,
                     n->drained != NULL);
  }
  dt_prom_family(out, "distrain_heartbeat_age_seconds", "gauge",
                 "Time since the node's last heartbeat reached the coordinator.");
  for (size_t i = 0; i < c->st.n_nodes; i++) {
    const dt_node_t *n = c->st.nodes[i];
    if (n)
      dt_prom_sample(out, "distrain_heartbeat_age_seconds", (label_t[]){{"node", n->id}}, 1,
                     (double)DT_MAX(0, now - n->last_seen_wall_ms) / 1000.0);
  }
  /* GPUs of alive nodes, from their latest heartbeat (a dead node's numbers are stale). */
  static const struct {
    const char *name, *help;
  } gpu[] = {
      {"distrain_gpu_memory_used_bytes", "GPU memory in use (NVML), from the node's heartbeat."},
      {"distrain_gpu_memory_total_bytes", "GPU memory in total (NVML)."},
      {"distrain_gpu_utilization_ratio",
       "Fraction of NVML's last sample period the GPU was busy (absent where unknown)."},
      {"distrain_gpu_healthy",
       "0 while NVML reports a problem with the GPU (lost, uncorrected ECC errors, memory "
       "repairs pending or failed, a critical Xid, an NVLink down): its node is drained until it "
       "clears."},
      {"distrain_gpu_ecc_uncorrected_errors",
       "Uncorrected ECC errors since the driver loaded (NVML's volatile count; absent where "
       "unknown)."},
      {"distrain_gpu_slowed",
       "1 while NVML reports the GPU slowed: its clocks by trouble with cooling or power "
       "(hardware slowdown, thermal slowdown, power brake), its PCIe link trained below its "
       "width, or a link's errors past DCGM's health limits (PCIe replays, NVLink replays and "
       "recoveries, NVLink CRC errors)."},
      {"distrain_gpu_pcie_replays_per_minute",
       "PCIe replays over the last whole minute (NVML; absent where unknown)."},
      {"distrain_gpu_nvlink_replays_per_minute",
       "NVLink replays and recoveries over the last whole minute, over the NVLinks active when "
       "the agent started (NVML; absent where unknown)."},
      {"distrain_gpu_nvlink_crc_errors_per_minute",
       "NVLink CRC errors (flow-control digits and data) over the last whole minute (NVML; "
       "absent where unknown)."},
  };
  for (size_t f = 0; f < DT_ARRAY_SIZE(gpu); f++) {
    dt_prom_family(out, gpu[f].name, "gauge", gpu[f].help);
    for (size_t i = 0; i < c->st.n_nodes; i++) {
      const dt_node_t *n = c->st.nodes[i];
      if (!n || n->state != DISTRAIN__V1__NODE_STATE__NODE_ALIVE)
        continue;
      for (size_t k = 0; k < n->n_usage; k++) {
        const Distrain__V1__DeviceUsage *u = n->usage[k];
        char idx[16];
        snprintf(idx, sizeof idx, "%d", u->index);
        const label_t l[] = {{"node", n->id}, {"gpu", idx}};
        const int known = u->memory_total_bytes > 0; /* a lost GPU's memory is not */
        if (f == 0 && known)
          dt_prom_sample(out, gpu[f].name, l, 2, (double)u->memory_used_bytes);
        else if (f == 1 && known)
          dt_prom_sample(out, gpu[f].name, l, 2, (double)u->memory_total_bytes);
        else if (f == 2 && u->utilization_pct >= 0)
          dt_prom_sample(out, gpu[f].name, l, 2, u->utilization_pct / 100.0);
        else if (f == 3)
          dt_prom_sample(out, gpu[f].name, l, 2, !dt_ctl_gpu_unhealthy(u));
        else if (f == 4 && u->ecc_uncorrected >= 0)
          dt_prom_sample(out, gpu[f].name, l, 2, (double)u->ecc_uncorrected);
        else if (f == 5)
          dt_prom_sample(out, gpu[f].name, l, 2, dt_ctl_gpu_slowed(u, NULL, 0));
        else if (f == 6 && u->pcie_replays_per_min >= 0)
          dt_prom_sample(out, gpu[f].name, l, 2, (double)u->pcie_replays_per_min);
        else if (f == 7 && u->nvlink_replays_per_min >= 0)
          dt_prom_sample(out, gpu[f].name, l, 2, (double)u->nvlink_replays_per_min);
        else if (f == 8 && u->nvlink_crc_per_min >= 0)
          dt_prom_sample(out, gpu[f].name, l, 2, (double)u->nvlink_crc_per_min);
      }
    }
  }
}

/* One gauge per job: value(j). */
static void job_gauge(FILE *out, dt_job_t **jobs, size_t n, const char *name, const char *help,
                      double (*value)(const dt_job_t *))
{
  dt_prom_family(out, name, "gauge", help);
  for (size_t i = 0; i < n; i++)
    dt_prom_sample(out, name, (label_t[]){{"job_id", jobs[i]->id}}, 1, value(jobs[i]));
}

static double job_step(const dt_job_t *j)
{
  return (double)j->job->step;
}
static double job_generation(const dt_job_t *j)
{
  return (double)j->job->generation;
}
static double job_world(const dt_job_t *j)
{
  return (double)j->job->world_size;
}
static double job_loss(const dt_job_t *j)
{
  return j->job->loss;
}
/* The newest of rank 0's steps that carries an evaluation (eval: the multiple-choice one,
 * else the validation loss), or NULL. */
static const Distrain__V1__StepMetrics *last_evaluated(const dt_job_t *j, int eval)
{
  for (size_t i = j->n_metrics; i-- > 0;)
    if (eval ? j->metrics[i]->has_eval : j->metrics[i]->has_val)
      return j->metrics[i];
  return NULL;
}

/* A gauge of the jobs' newest evaluation, for the jobs that have one. */
static void eval_gauge(FILE *out, dt_job_t **jobs, size_t n, const char *name, const char *help,
                       int eval)
{
  dt_prom_family(out, name, "gauge", help);
  for (size_t i = 0; i < n; i++) {
    const Distrain__V1__StepMetrics *m = last_evaluated(jobs[i], eval);
    if (m)
      dt_prom_sample(out, name, (label_t[]){{"job_id", jobs[i]->id}}, 1,
                     eval ? m->eval_acc_norm : m->val_loss);
  }
}

/* The newest loss of each job's validation sets (data.val_sets), labelled with the set. */
static void val_set_gauge(FILE *out, dt_job_t **jobs, size_t n)
{
  static const char name[] = "distrain_val_set_loss";
  dt_prom_family(out, name, "gauge",
                 "The newest validation loss of each of the job's validation sets "
                 "(data.val_sets), labelled with its name.");
  for (size_t i = 0; i < n; i++) { /* validated with data.val, if any: the newest validation */
    const Distrain__V1__StepMetrics *m = dt_coord_last_val(jobs[i]);
    for (size_t v = 0; m && v < m->n_val_sets; v++)
      dt_prom_sample(out, name, (label_t[]){{"job_id", jobs[i]->id}, {"set", m->val_sets[v]->name}},
                     2, m->val_sets[v]->loss);
  }
}

/* The loss of the named blend source in the job's newest step that was dealt it; 0 if none. */
static int newest_source_loss(const dt_job_t *j, const char *source, float *loss)
{
  for (size_t i = j->n_metrics; i-- > 0;)
    for (size_t s = 0; s < j->metrics[i]->n_train_sources; s++)
      if (strcmp(j->metrics[i]->train_sources[s]->name, source) == 0) {
        *loss = j->metrics[i]->train_sources[s]->loss;
        return 1;
      }
  return 0;
}

/* The newest training loss of each source of a job training on a blend (data.train), labelled
 * with the source's name, in the blend's order. */
static void source_gauge(FILE *out, dt_job_t **jobs, size_t n)
{
  static const char name[] = "distrain_train_source_loss";
  dt_prom_family(out, name, "gauge",
                 "The newest training loss over the tokens of each source of the job's data "
                 "blend (data.train \"W:NAME=GLOB,...\"), labelled with its name.");
  for (size_t i = 0; i < n; i++) {
    const Distrain__V1__JobSpec *spec = jobs[i]->job->spec;
    char names[DT_BLEND_MAX][DT_NAME_MAX];
    const int nsrc = dt_blend_names(spec && spec->data ? spec->data->train : NULL, names);
    float loss;
    for (int d = 0; d < nsrc; d++)
      if (newest_source_loss(jobs[i], names[d], &loss))
        dt_prom_sample(out, name, (label_t[]){{"job_id", jobs[i]->id}, {"source", names[d]}}, 2,
                       loss);
  }
}

/* A gauge of each job's newest step report, for the jobs that have one (and, with positive, a
 * positive value in it). */
static void step_gauge(FILE *out, dt_job_t **jobs, size_t n, const char *name, const char *help,
                       double (*value)(const Distrain__V1__StepMetrics *), int positive)
{
  dt_prom_family(out, name, "gauge", help);
  for (size_t i = 0; i < n; i++) {
    const dt_job_t *j = jobs[i];
    /* step 0, the validation before training, is no step */
    const Distrain__V1__StepMetrics *m = j->n_metrics ? j->metrics[j->n_metrics - 1] : NULL;
    const double v = m && m->step > 0 ? value(m) : 0.0;
    if (m && m->step > 0 && (!positive || v > 0))
      dt_prom_sample(out, name, (label_t[]){{"job_id", j->id}}, 1, v);
  }
}

static double step_tflops(const Distrain__V1__StepMetrics *m)
{
  return m->tflops;
}
static double step_mfu(const Distrain__V1__StepMetrics *m)
{
  return m->mfu;
}

static double job_tokens(const dt_job_t *j)
{
  return j->job->tokens_per_s;
}
static double job_committed(const dt_job_t *j)
{
  return (double)j->job->committed_step;
}

static void write_jobs(FILE *out, dt_job_t **jobs, size_t n)
{
  dt_prom_family(out, "distrain_job_info", "gauge", "Always 1; the job's name in the label.");
  for (size_t i = 0; i < n; i++) {
    const Distrain__V1__JobSpec *spec = jobs[i]->job->spec;
    dt_prom_sample(out, "distrain_job_info",
                   (label_t[]){{"job_id", jobs[i]->id}, {"name", spec ? spec->name : ""}}, 2, 1);
  }
  dt_prom_family(out, "distrain_job_state", "gauge",
                 "1 for the job's current state, 0 for the others.");
  for (size_t i = 0; i < n; i++)
    for (size_t s = 0; s < DT_ARRAY_SIZE(k_states); s++)
      dt_prom_sample(out, "distrain_job_state",
                     (label_t[]){{"job_id", jobs[i]->id}, {"state", k_states[s]}}, 2,
                     (size_t)jobs[i]->job->state == s + 1);
  job_gauge(out, jobs, n, "distrain_job_step", "Rank 0's last reported training step.", job_step);
  job_gauge(out, jobs, n, "distrain_job_generation",
            "The job's generation: bumped every time it is planned (a start, a restart).",
            job_generation);
  job_gauge(out, jobs, n, "distrain_job_world_size", "Ranks of the current generation.", job_world);
  job_gauge(out, jobs, n, "distrain_train_loss", "Rank 0's last reported training loss.", job_loss);
  source_gauge(out, jobs, n);
  job_gauge(out, jobs, n, "distrain_tokens_per_second",
            "Training throughput of the whole job, as rank 0 last reported it.", job_tokens);
  step_gauge(out, jobs, n, "distrain_model_tflops_per_device",
             "Model TFLOP/s per device in rank 0's newest step: (6 P + 12 L C T) FLOPs a token "
             "x tokens/s / ranks.",
             step_tflops, 0);
  step_gauge(out, jobs, n, "distrain_mfu",
             "Model FLOPs utilisation in rank 0's newest step (training.peak_tflops, or a "
             "known GPU's dense bf16 peak), for jobs that know their devices' peak.",
             step_mfu, 1);
  eval_gauge(out, jobs, n, "distrain_val_loss",
             "The newest validation loss (training.val_every), for jobs that have one.", 0);
  val_set_gauge(out, jobs, n);
  eval_gauge(out, jobs, n, "distrain_eval_accuracy",
             "The newest multiple-choice evaluation's accuracy (data.eval, acc_norm: the "
             "lowest mean loss picked), for jobs that have one.",
             1);

  dt_prom_family(out, "distrain_step_duration_seconds", "histogram",
                 "Rank 0's time per training step, counted once per step reported since the "
                 "coordinator started.");
  for (size_t i = 0; i < n; i++)
    dt_prom_hist_write(out, "distrain_step_duration_seconds", (label_t[]){{"job_id", jobs[i]->id}},
                       1, &jobs[i]->step_seconds);

  dt_prom_family(out, "distrain_restarts_total", "counter",
                 "Times the job was planned again after losing a generation, by reason, since "
                 "the coordinator started (grow: restarted on more nodes at a checkpoint).");
  for (size_t i = 0; i < n; i++)
    for (int r = 0; r < DT_RESTART_N; r++)
      dt_prom_sample(out, "distrain_restarts_total",
                     (label_t[]){{"job_id", jobs[i]->id}, {"reason", dt_restart_reason_names[r]}},
                     2, (double)jobs[i]->restarts_by[r]);

  job_gauge(out, jobs, n, "distrain_checkpoint_step",
            "The newest committed checkpoint's step (0: none yet).", job_committed);
  dt_prom_family(out, "distrain_checkpoint_seconds", "gauge",
                 "The newest checkpoint committed since the coordinator started: from its first "
                 "shard's report to its manifest, i.e. how far apart its writers finished plus "
                 "the commit.");
  for (size_t i = 0; i < n; i++)
    if (jobs[i]->ckpt_seconds >= 0)
      dt_prom_sample(out, "distrain_checkpoint_seconds", (label_t[]){{"job_id", jobs[i]->id}}, 1,
                     jobs[i]->ckpt_seconds);
  dt_prom_family(out, "distrain_checkpoint_timestamp_seconds", "gauge",
                 "When that checkpoint was committed (Unix time).");
  for (size_t i = 0; i < n; i++)
    if (jobs[i]->ckpt_seconds >= 0)
      dt_prom_sample(out, "distrain_checkpoint_timestamp_seconds",
                     (label_t[]){{"job_id", jobs[i]->id}}, 1,
                     (double)jobs[i]->ckpt_wall_ms / 1000.0);
  dt_prom_family(out, "distrain_checkpoint_failures_total", "counter",
                 "Checkpoint steps not saved since the coordinator started: a writer could not "
                 "write its shard (its disk or quota full); the job trained on.");
  for (size_t i = 0; i < n; i++)
    dt_prom_sample(out, "distrain_checkpoint_failures_total", (label_t[]){{"job_id", jobs[i]->id}},
                   1, (double)jobs[i]->ckpt_failures);
}

/* The trainer status rank r of j last sent, or NULL. */
static const Distrain__V1__TrainerStatus *rank_status(const dt_coord_t *c, const dt_job_t *j, int r)
{
  const dt_node_t *n = c->st.nodes[j->ranks[r].node];
  for (size_t t = 0; n && t < n->n_trainers; t++) {
    const Distrain__V1__TrainerStatus *ts = n->trainers[t];
    if (ts->rank == r && ts->generation == j->job->generation && strcmp(ts->job_id, j->id) == 0)
      return ts;
  }
  return NULL;
}

static void write_ranks(FILE *out, const dt_coord_t *c, dt_job_t **jobs, size_t n)
{
  static const char *const names[] = {"distrain_rank_info",
                                      "distrain_rank_step",
                                      "distrain_rank_compute_seconds",
                                      "distrain_rank_report_age_seconds",
                                      "distrain_rank_straggler",
                                      "distrain_rank_memory_bytes"};
  static const char *const helps[] = {
      "Always 1: where each rank runs (node, host) and its place in the mesh (pp, dp, tp); "
      "only for jobs of at most DISTRAIN_METRICS_MAX_RANKS (64) ranks, as every distrain_rank_ "
      "series.",
      "The rank's last reported step.",
      "The rank's compute time per step, without waiting for peers (a moving average).",
      "Time since the rank's last report.",
      "1 while the rank is reported as a straggler.",
      "The rank's peak memory (RSS on CPU, device memory on GPU).",
  };
  for (size_t f = 0; f < DT_ARRAY_SIZE(names); f++) {
    dt_prom_family(out, names[f], "gauge", helps[f]);
    for (size_t i = 0; i < n; i++) {
      const dt_job_t *j = jobs[i];
      if (!per_rank(j))
        continue;
      dt_mesh_t mesh;
      if (dt_jobspec_mesh(j->job->spec, &mesh) != 0)
        continue;
      mesh.dp = j->dp;
      for (int r = 0; r < j->world; r++) {
        const dt_rank_slot_t *s = &j->ranks[r];
        char rank[16];
        snprintf(rank, sizeof rank, "%d", r);
        const label_t l[] = {{"job_id", j->id}, {"rank", rank}};
        if (f == 0) {
          const dt_node_t *nd = c->st.nodes[s->node];
          dt_mesh_coord_t co = {0};
          dt_mesh_coords(&mesh, r, &co);
          char pp[16], dp[16], tp[16];
          snprintf(pp, sizeof pp, "%d", co.pp);
          snprintf(dp, sizeof dp, "%d", co.dp);
          snprintf(tp, sizeof tp, "%d", co.tp);
          dt_prom_sample(out, names[f],
                         (label_t[]){{"job_id", j->id},
                                     {"rank", rank},
                                     {"node", nd->id},
                                     {"host", nd->info->hostname},
                                     {"pp", pp},
                                     {"dp", dp},
                                     {"tp", tp}},
                         7, 1);
        } else if (f == 1) {
          dt_prom_sample(out, names[f], l, 2, (double)s->step);
        } else if (f == 2 && s->compute_ms > 0) {
          dt_prom_sample(out, names[f], l, 2, s->compute_ms / 1000.0);
        } else if (f == 3 && s->heard_ms > 0) {
          dt_prom_sample(out, names[f], l, 2, dt_coord_report_age_ms(j, r) / 1000.0);
        } else if (f == 4) {
          dt_prom_sample(out, names[f], l, 2, s->straggler);
        } else if (f == 5) {
          const Distrain__V1__TrainerStatus *ts = rank_status(c, j, r);
          if (ts && ts->memory_bytes)
            dt_prom_sample(out, names[f], l, 2, (double)ts->memory_bytes);
        }
      }
    }
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Entry points                                                                                */
/* ------------------------------------------------------------------------------------------ */

char *dt_coord_metrics(dt_coord_t *c, size_t *len)
{
  char *buf = NULL;
  size_t size = 0;
  size_t n = 0;
  dt_job_t **jobs = dt_coord_shown_jobs(c, &n);
  FILE *out = jobs ? open_memstream(&buf, &size) : NULL;
  if (!out) {
    free(jobs);
    return NULL;
  }
  write_coordinator(out, c);
  write_nodes(out, c);
  write_jobs(out, jobs, n);
  write_ranks(out, c, jobs, n);
  free(jobs);
  if (fclose(out) != 0) {
    free(buf);
    return NULL;
  }
  *len = size;
  return buf;
}
