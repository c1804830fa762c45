/* web.c — the coordinator's HTTP routes: / (the dashboard), /api/status (its data), /metrics.
 *
 * The dashboard is one HTML page with its script and style inline (coordinator/dashboard.html,
 * compiled into the binary by coordinator/embed.cmake): no CDN, no other request than
 * /api/status, which it polls every second. /api/status prints nodes and jobs with the same
 * code as `distrainctl nodes --json` and `distrainctl status JOB --json` (ctl.c), from the same
 * views ListNodes and GetJob answer with (handlers.c), and adds what only a page needs: each
 * job's mesh, its curves (training loss, each blend source's, tokens/s, MFU, validation loss
 * and each set's, the evaluation's accuracies: at most HISTORY_POINTS points each, evenly
 * spaced over the run), and the recent events. Ranks are listed for jobs of at most
 * DASHBOARD_MAX_RANKS ranks. Nothing in it is secret: the token is never part of the state it
 * prints. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blend.h"
#include "coord.h"
#include "ctl.h"
#include "dt_util.h"
#include "prom.h"

#define HISTORY_POINTS      400
#define DASHBOARD_MAX_RANKS 256

#ifndef DT_VERSION
#define DT_VERSION "unknown"
#endif

extern const unsigned char dt_dashboard_html[];
extern const size_t dt_dashboard_html_len;

/* The curves' points: the steps' (from step 1: step 0, the validation before training, has no
 * step's figures), the validations' and the multiple-choice evaluations'. */
typedef enum { CURVE_STEPS, CURVE_VAL, CURVE_EVAL } curve_t;

static int on_curve(const Distrain__V1__StepMetrics *m, curve_t c)
{
  return c == CURVE_VAL ? m->has_val || m->n_val_sets : c == CURVE_EVAL ? m->has_eval : m->step > 0;
}

/* Indices of the job's metrics on curve c, at most HISTORY_POINTS evenly spaced and the newest,
 * into idx (room for HISTORY_POINTS + 1); their count. */
static size_t pick(const dt_job_t *j, curve_t c, size_t *idx)
{
  size_t n = 0, k = 0, seen = 0;
  for (size_t i = 0; i < j->n_metrics; i++)
    n += on_curve(j->metrics[i], c);
  const size_t stride = n > HISTORY_POINTS ? (n + HISTORY_POINTS - 1) / HISTORY_POINTS : 1;
  for (size_t i = 0; i < j->n_metrics; i++) {
    if (!on_curve(j->metrics[i], c))
      continue;
    if (seen % stride == 0 || seen == n - 1)
      idx[k++] = i;
    seen++;
  }
  return k;
}

/* "key": [the metrics' steps] */
static void write_steps(FILE *out, const char *key, const dt_job_t *j, const size_t *idx, size_t n)
{
  fprintf(out, "\"%s\": [", key);
  for (size_t i = 0; i < n; i++)
    fprintf(out, "%s%lld", i ? "," : "", (long long)j->metrics[idx[i]]->step);
  fputc(']', out);
}

/* "name": [its loss in each of the metrics, null where one has none], for each name */
static void write_named(FILE *out, const dt_job_t *j, const size_t *idx, size_t n, int train,
                        const char *const *names, size_t nn)
{
  for (size_t v = 0; v < nn; v++) {
    fputs(v ? ", " : "", out);
    dt_json_string(out, names[v]);
    fputs(": [", out);
    for (size_t i = 0; i < n; i++) {
      float loss;
      fputs(i ? "," : "", out);
      if (dt_ctl_named_loss(j->metrics[idx[i]], train, names[v], &loss))
        dt_json_number(out, "%.7g", loss);
      else
        fputs("null", out);
    }
    fputc(']', out);
  }
}

/* The job's curves for the charts: {"step", "loss", "tokens_per_s", "mfu", "sources" (a blend
 * source's training loss a step, null where the step dealt it nothing), "val" {"step", "loss"
 * (data.val's, null where only sets validated), "sets" (each data.val_sets' loss)}, "eval"
 * {"step", "acc_norm", "acc"} (data.eval's accuracies)}. */
static void write_history(FILE *out, const dt_job_t *j)
{
  size_t idx[HISTORY_POINTS + 1], n = pick(j, CURVE_STEPS, idx);
  fputc('{', out);
  write_steps(out, "step", j, idx, n);
  static const char *const keys[] = {"loss", "tokens_per_s", "mfu"};
  for (int k = 0; k < 3; k++) {
    fprintf(out, ", \"%s\": [", keys[k]);
    for (size_t i = 0; i < n; i++) {
      const Distrain__V1__StepMetrics *m = j->metrics[idx[i]];
      const double v[] = {m->loss, m->tokens_per_s, m->mfu};
      fputs(i ? "," : "", out);
      dt_json_number(out, "%.7g", v[k]);
    }
    fputc(']', out);
  }
  /* the blend's sources, named and ordered as its spec names them */
  const Distrain__V1__JobSpec *spec = j->job->spec;
  char sources[DT_BLEND_MAX][DT_NAME_MAX];
  const int nsrc = dt_blend_names(spec && spec->data ? spec->data->train : NULL, sources);
  const char *names[DT_MAX(DT_BLEND_MAX, DT_VALSETS_MAX)];
  for (int s = 0; s < nsrc; s++)
    names[s] = sources[s];
  fputs(", \"sources\": {", out);
  write_named(out, j, idx, n, 1, names, (size_t)nsrc);
  /* the validation sets, named by the newest step that validated them */
  n = pick(j, CURVE_VAL, idx);
  const Distrain__V1__StepMetrics *sets = NULL;
  for (size_t i = n; i-- > 0 && !sets;)
    sets = j->metrics[idx[i]]->n_val_sets ? j->metrics[idx[i]] : NULL;
  const size_t nsets = sets ? DT_MIN(sets->n_val_sets, DT_VALSETS_MAX) : 0;
  for (size_t v = 0; v < nsets; v++)
    names[v] = sets->val_sets[v]->name;
  fputs("}, \"val\": {", out);
  write_steps(out, "step", j, idx, n);
  fputs(", \"loss\": [", out);
  for (size_t i = 0; i < n; i++) {
    const Distrain__V1__StepMetrics *m = j->metrics[idx[i]];
    fputs(i ? "," : "", out);
    if (m->has_val)
      dt_json_number(out, "%.7g", m->val_loss);
    else
      fputs("null", out);
  }
  fputs("], \"sets\": {", out);
  write_named(out, j, idx, n, 0, names, nsets);
  n = pick(j, CURVE_EVAL, idx);
  fputs("}}, \"eval\": {", out);
  write_steps(out, "step", j, idx, n);
  for (int k = 0; k < 2; k++) {
    fprintf(out, ", \"%s\": [", k ? "acc" : "acc_norm");
    for (size_t i = 0; i < n; i++) {
      fputs(i ? "," : "", out);
      dt_json_number(out, "%.6g",
                     k ? j->metrics[idx[i]]->eval_acc : j->metrics[idx[i]]->eval_acc_norm);
    }
    fputc(']', out);
  }
  fputs("}}", out);
}

static void write_job(FILE *out, dt_coord_t *c, dt_job_t *j)
{
  dt_rank_views_t v = {0};
  const int ranks = j->world <= DASHBOARD_MAX_RANKS && dt_coord_rank_views(c, j, &v) == 0;
  j->job->ranks = ranks ? v.ptrs : NULL;
  j->job->n_ranks = ranks ? v.n : 0;
  dt_coord_lend_newest(j, 1); /* borrowed, as GetJob does */
  fputs("{\"job\": ", out);
  dt_ctl_print_job(out, j->job, 1);
  j->job->ranks = NULL;
  j->job->n_ranks = 0;
  dt_coord_lend_newest(j, 0);
  if (ranks)
    dt_coord_rank_views_free(&v);
  const Distrain__V1__ParallelSpec *p = j->job->spec ? j->job->spec->parallel : NULL;
  fprintf(out, ", \"mesh\": {\"pp\": %d, \"dp\": %d, \"cp\": %d, \"tp\": %d}, \"history\": ",
          p ? p->pp : 1, j->dp > 0 ? j->dp : (p ? p->dp : 1), p ? p->cp : 1, p ? p->tp : 1);
  write_history(out, j);
  fputc('}', out);
}

char *dt_coord_status_json(dt_coord_t *c, size_t *len)
{
  char *buf = NULL;
  size_t size = 0, n_jobs = 0;
  dt_job_t **jobs = dt_coord_shown_jobs(c, &n_jobs);
  Distrain__V1__Node *nodes = calloc(c->st.n_nodes + 1, sizeof *nodes);
  Distrain__V1__Node **ptrs = calloc(c->st.n_nodes + 1, sizeof *ptrs);
  FILE *out = jobs && nodes && ptrs ? open_memstream(&buf, &size) : NULL;
  if (!out) {
    free(jobs), free(nodes), free(ptrs);
    return NULL;
  }
  size_t nn = 0;
  for (size_t i = 0; i < c->st.n_nodes; i++)
    if (c->st.nodes[i]) {
      dt_coord_node_view(c->st.nodes[i], &nodes[nn]);
      ptrs[nn] = &nodes[nn];
      nn++;
    }
  fprintf(out,
          "{\"version\": \"%s\", \"now_ms\": %lld, \"start_ms\": %lld,\n\"nodes\": ", DT_VERSION,
          (long long)dt_wall_ms(), (long long)c->start_wall_ms);
  dt_ctl_print_nodes(out, ptrs, nn, 1);
  fputs(",\n\"jobs\": [", out);
  for (size_t i = 0; i < n_jobs; i++) {
    fputs(i ? ",\n" : "\n", out);
    write_job(out, c, jobs[i]);
  }
  fputs("],\n\"events\": [", out);
  const uint64_t first = c->n_events > DT_COORD_EVENTS ? c->n_events - DT_COORD_EVENTS : 0;
  for (uint64_t i = c->n_events; i-- > first;) { /* newest first */
    const dt_coord_event_t *e = &c->events[i % DT_COORD_EVENTS];
    fprintf(out, "%s{\"ms\": %lld, \"warn\": %s, \"job\": ", i + 1 == c->n_events ? "\n" : ",\n",
            (long long)e->wall_ms, e->warn ? "true" : "false");
    dt_json_string(out, e->job);
    fputs(", \"text\": ", out);
    dt_json_string(out, e->text);
    fputc('}', out);
  }
  fputs("]}\n", out);
  free(jobs), free(nodes), free(ptrs);
  if (fclose(out) != 0) {
    free(buf);
    return NULL;
  }
  *len = size;
  return buf;
}

static char *copy(const void *data, size_t n, size_t *len)
{
  char *out = malloc(n ? n : 1);
  if (out)
    memcpy(out, data, n);
  *len = n;
  return out;
}

void dt_coord_http(const char *path, dt_http_response_t *resp, void *ud)
{
  dt_coord_t *c = ud;
  if (strcmp(path, "/metrics") == 0) {
    resp->content_type = DT_PROM_CONTENT_TYPE;
    resp->body = dt_coord_metrics(c, &resp->len);
  } else if (strcmp(path, "/api/status") == 0) {
    resp->content_type = "application/json";
    resp->body = dt_coord_status_json(c, &resp->len);
  } else if (strcmp(path, "/") == 0 || strcmp(path, "/index.html") == 0) {
    resp->content_type = "text/html; charset=utf-8";
    resp->body = copy(dt_dashboard_html, dt_dashboard_html_len, &resp->len);
  } else {
    static const char msg[] = "not found: this server has /, /api/status and /metrics\n";
    resp->status = 404;
    resp->body = copy(msg, sizeof msg - 1, &resp->len);
  }
}
