/* state.c — see state.h. */
#include "state.h"

#include <stdlib.h>
#include <string.h>

#include "dt_error.h"
#include "dt_util.h"

const char *const dt_restart_reason_names[DT_RESTART_N] = {[DT_RESTART_NODE_DEAD] = "node_dead",
                                                           [DT_RESTART_TRAINER_FAILED] =
                                                               "trainer_failed",
                                                           [DT_RESTART_NONFINITE] = "nonfinite",
                                                           [DT_RESTART_LOSS_SPIKE] = "loss_spike",
                                                           [DT_RESTART_GRAD_SPIKE] = "grad_spike",
                                                           [DT_RESTART_HANG] = "hang",
                                                           [DT_RESTART_GROW] = "grow",
                                                           [DT_RESTART_STOPPED] = "stopped",
                                                           [DT_RESTART_PREEMPTED] = "preempted"};

/* Upper bounds of distrain_step_duration_seconds: a tiny CPU model's 1 ms to a large model's
 * minute-long steps. */
static const double k_step_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                       0.5,   1,      2.5,   5,    10,    30,   60};

void dt_job_metrics_init(dt_job_t *j)
{
  dt_prom_hist_init(&j->step_seconds, k_step_bounds, DT_ARRAY_SIZE(k_step_bounds));
  j->ckpt_seconds = -1;
}

int dt_coord_state_terminal(Distrain__V1__JobState s)
{
  return s == DISTRAIN__V1__JOB_STATE__JOB_COMPLETED || s == DISTRAIN__V1__JOB_STATE__JOB_FAILED ||
         s == DISTRAIN__V1__JOB_STATE__JOB_STOPPED;
}

dt_node_t *dt_coord_node_by_id(const dt_coord_state_t *s, const char *id)
{
  int64_t idx;
  if (!id || strncmp(id, "node-", 5) != 0 || dt_parse_i64(id + 5, &idx) != 0 || idx < 0 ||
      (size_t)idx >= s->n_nodes)
    return NULL;
  return s->nodes[idx];
}

dt_job_t *dt_coord_job_by_id(const dt_coord_state_t *s, const char *id)
{
  for (size_t i = 0; i < s->n_jobs; i++)
    if (strcmp(s->jobs[i]->id, id) == 0)
      return s->jobs[i];
  return NULL;
}

int dt_coord_job_index(const dt_coord_state_t *s, const dt_job_t *j)
{
  for (size_t i = 0; i < s->n_jobs; i++)
    if (s->jobs[i] == j)
      return (int)i;
  return -1;
}

void dt_job_free_ranks(dt_job_t *j)
{
  for (int r = 0; j->ranks && r < j->world; r++)
    if (j->ranks[r].progress)
      distrain__v1__trainer_progress__free_unpacked(j->ranks[r].progress, NULL);
  free(j->ranks);
  j->ranks = NULL;
}

void dt_coord_remember_ranks(dt_job_t *j)
{
  if (!j->ranks)
    return;
  if (j->world > j->n_rank_node) {
    int *grown = realloc(j->rank_node, (size_t)j->world * sizeof *grown);
    if (!grown)
      return; /* the older ranks' nodes stay known */
    for (int r = j->n_rank_node; r < j->world; r++)
      grown[r] = -1;
    j->rank_node = grown;
    j->n_rank_node = j->world;
  }
  for (int r = 0; r < j->world; r++)
    j->rank_node[r] = j->ranks[r].node;
}

int dt_coord_rank_node(const dt_job_t *j, int rank)
{
  if (rank < 0)
    return -1;
  if (j->ranks && rank < j->world)
    return j->ranks[rank].node;
  return rank < j->n_rank_node ? j->rank_node[rank] : -1;
}

void dt_ckpt_pending_free(dt_ckpt_pending_t *p)
{
  for (int k = 0; p->reports && k < p->world; k++)
    if (p->reports[k])
      distrain__v1__report_checkpoint_request__free_unpacked(p->reports[k], NULL);
  free(p->reports);
}

void dt_job_free(dt_job_t *j)
{
  if (!j)
    return;
  if (j->job)
    distrain__v1__job__free_unpacked(j->job, NULL);
  for (size_t i = 0; i < j->n_metrics; i++)
    distrain__v1__step_metrics__free_unpacked(j->metrics[i], NULL);
  free(j->metrics);
  for (size_t i = 0; i < j->n_ckpts; i++)
    dt_ckpt_pending_free(&j->ckpts[i]);
  free(j->ckpts);
  dt_job_free_ranks(j);
  free(j->nodes);
  free(j->by_node);
  free(j->rank_node);
  free(j);
}

void dt_node_free(dt_node_t *n)
{
  if (!n)
    return;
  if (n->info)
    distrain__v1__node_info__free_unpacked(n->info, NULL);
  for (size_t i = 0; i < n->n_trainers; i++)
    distrain__v1__trainer_status__free_unpacked(n->trainers[i], NULL);
  free(n->trainers);
  dt_node_clear_usage(n);
  free(n->drained);
  free(n);
}

void dt_node_clear_usage(dt_node_t *n)
{
  for (size_t i = 0; i < n->n_usage; i++)
    distrain__v1__device_usage__free_unpacked(n->usage[i], NULL);
  free(n->usage);
  n->usage = NULL;
  n->n_usage = 0;
}

int dt_coord_add_node(dt_coord_state_t *s, dt_node_t *n)
{
  const size_t idx = (size_t)n->index;
  while (idx >= s->cap_nodes) {
    size_t cap = s->cap_nodes ? s->cap_nodes * 2 : 64;
    dt_node_t **grown = realloc(s->nodes, cap * sizeof *grown);
    if (!grown)
      return DT_ENOMEM;
    memset(grown + s->cap_nodes, 0, (cap - s->cap_nodes) * sizeof *grown);
    s->nodes = grown, s->cap_nodes = cap;
  }
  s->nodes[idx] = n;
  s->n_nodes = DT_MAX(s->n_nodes, idx + 1);
  return 0;
}

int dt_coord_add_job(dt_coord_state_t *s, dt_job_t *j)
{
  if (s->n_jobs == s->cap_jobs) {
    size_t cap = s->cap_jobs ? s->cap_jobs * 2 : 16;
    void *grown = realloc(s->jobs, cap * sizeof *s->jobs);
    if (!grown)
      return DT_ENOMEM;
    s->jobs = grown, s->cap_jobs = cap;
  }
  s->jobs[s->n_jobs++] = j;
  return 0;
}

void dt_coord_state_free(dt_coord_state_t *s)
{
  for (size_t i = 0; i < s->n_jobs; i++)
    dt_job_free(s->jobs[i]);
  free(s->jobs);
  for (size_t i = 0; i < s->n_nodes; i++)
    dt_node_free(s->nodes[i]);
  free(s->nodes);
  memset(s, 0, sizeof *s);
}
