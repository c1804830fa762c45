/* web.c — the coordinator's HTTP routes: / (the dashboard), /api/status (its data), /metrics.
 *
 * The dashboard is one HTML page with its script and style inline (coordinator/dashboard.html,
 * compiled into the binary by coordinator/embed.cmake): no CDN, no other request than
 * /api/status, which it polls every second. /api/status prints nodes and jobs with the same
 * code as `distrainctl nodes --json` and `distrainctl status JOB --json` (ctl.c), from the same
 * views ListNodes and GetJob answer with (handlers.c), and adds what only a page needs: each
 * job's mesh, its recent loss and tokens/s (at most HISTORY_POINTS, evenly spaced over the
 * run), and the recent events. Ranks are listed for jobs of at most DASHBOARD_MAX_RANKS ranks.
 * Nothing in it is secret: the token is never part of the state it prints. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static void write_history(FILE *out, const dt_job_t *j)
{
  const size_t n = j->n_metrics;
  /* from step 1: step 0, the validation before training, has no step's figures */
  const size_t from = n > 0 && j->metrics[0]->step == 0;
  const size_t stride =
      n - from > HISTORY_POINTS ? (n - from + HISTORY_POINTS - 1) / HISTORY_POINTS : 1;
  static const char *const keys[] = {"step", "loss", "tokens_per_s", "mfu"};
  fputs("{", out);
  for (int k = 0; k < 4; k++) {
    fprintf(out, "%s\"%s\": [", k ? ", " : "", keys[k]);
    int first = 1;
    for (size_t i = from; i < n; i++) {
      if ((i - from) % stride != 0 && i != n - 1) /* the newest point is always there */
        continue;
      const Distrain__V1__StepMetrics *m = j->metrics[i];
      if (!first)
        fputc(',', out);
      first = 0;
      const double v[] = {0.0, m->loss, m->tokens_per_s, m->mfu};
      if (k == 0)
        fprintf(out, "%lld", (long long)m->step);
      else
        dt_json_number(out, "%.7g", v[k]);
    }
    fputc(']', out);
  }
  fputs("}", out);
}

static void write_job(FILE *out, dt_coord_t *c, dt_job_t *j)
{
  dt_rank_views_t v = {0};
  const int ranks = j->world <= DASHBOARD_MAX_RANKS && dt_coord_rank_views(c, j, &v) == 0;
  j->job->ranks = ranks ? v.ptrs : NULL;
  j->job->n_ranks = ranks ? v.n : 0;
  j->job->last_val = dt_coord_last_val(j); /* borrowed, as GetJob does */
  j->job->last_sources = dt_coord_last_sources(j);
  fputs("{\"job\": ", out);
  dt_ctl_print_job(out, j->job, 1);
  j->job->ranks = NULL;
  j->job->n_ranks = 0;
  j->job->last_val = NULL;
  j->job->last_sources = NULL;
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
