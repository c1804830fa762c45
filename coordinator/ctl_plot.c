/* ctl_plot.c — `distrainctl status JOB [JOB...] --plot loss.png`: loss curves as a PNG.
 *
 * gnuplot draws it (Debian's gnuplot-nox, its cairo PNG terminal): distrainctl fetches every
 * step's metrics of each job from the coordinator and writes gnuplot a script on its standard
 * input, the data inline, so no temporary file is left behind. Training loss as a line (and
 * each blend source's, data.train, as a dashed one), validation loss (where the job
 * evaluated) and each validation set's (data.val_sets) as points, the step on x. One job: a colour
 * each (gnuplot's first three for training, validation and the sets); several (runs to compare): a
 * colour each job, its validation points in it, joined by dashes. gnuplot rather than a C plotting
 * library: Debian's PLplot development package pulls in Qt 5, GTK 3 and wxWidgets, gnuplot-nox four
 * small packages. */
#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "blend.h"
#include "ctl.h"
#include "dt_error.h"
#include "dt_util.h"

extern char **environ;

/* s as a gnuplot single-quoted string (a quote inside is doubled). */
static void gp_string(FILE *f, const char *s)
{
  fputc('\'', f);
  for (; *s; s++) {
    if (*s == '\'')
      fputc('\'', f);
    if (*s != '\n')
      fputc(*s, f);
  }
  fputc('\'', f);
}

/* A series per name, $set<k>_<v> or $src<k>_<v>: each step's loss of that validation set
 * (train 0: points) or blend source (train 1: a dashed line), titled "<label>validation:
 * NAME" or "<label>train: NAME", extra added to its style (the job's colour). */
static void write_named_series(FILE *f, FILE *plot, const Distrain__V1__GetJobMetricsResponse *m,
                               size_t k, int train, const char *const *names, size_t n,
                               const char *label, const char *extra)
{
  const char *id = train ? "src" : "set";
  for (size_t v = 0; v < n; v++) {
    fprintf(f, "$%s%zu_%zu << EOD\n", id, k, v);
    for (size_t i = 0; i < m->n_metrics; i++) {
      float loss;
      if (dt_ctl_named_loss(m->metrics[i], train, names[v], &loss))
        fprintf(f, "%lld %.9g\n", (long long)m->metrics[i]->step, loss);
    }
    fputs("EOD\n", f);
    char t[256];
    snprintf(t, sizeof t, "%s%s: %.31s", label, train ? "train" : "validation", names[v]);
    if (train)
      fprintf(plot, ", $src%zu_%zu using 1:2 with lines linewidth 1.2 dashtype %d%s title ", k, v,
              v % 2 ? 4 : 2, extra);
    else
      fprintf(plot, ", $set%zu_%zu using 1:2 with linespoints pointtype %zu%s title ", k, v,
              9 + 2 * (v % 4), extra);
    gp_string(plot, t);
  }
}

/* A job and its metrics. */
typedef struct {
  const Distrain__V1__Job *job;
  const Distrain__V1__GetJobMetricsResponse *m;
} plotted_t;

/* Job k's series: $train<k>, $src<k>_<s> per source of a blend (data.train), $val<k> (if it
 * validated) and $set<k>_<v> per validation set; the plot command's clauses for them go into
 * plot (lc: the job's colour, 0 for one job). */
static void write_job_series(FILE *f, FILE *plot, const plotted_t *p, size_t k, int lc)
{
  const Distrain__V1__GetJobMetricsResponse *m = p->m;
  char label[160] = "";
  if (lc) { /* several jobs: each series names its job */
    const char *name = p->job->spec && p->job->spec->name ? p->job->spec->name : "";
    snprintf(label, sizeof label, "%s%s%.64s%s ", p->job->job_id, *name ? " (" : "", name,
             *name ? ")" : "");
  }
  char colour[32] = "", points[48] = ""; /* points: validation, dashed beside the line */
  if (lc) {
    snprintf(colour, sizeof colour, " linecolor %d", lc);
    snprintf(points, sizeof points, " linecolor %d dashtype 2", lc);
  }
  size_t nval = 0;
  fprintf(f, "$train%zu << EOD\n", k);
  for (size_t i = 0; i < m->n_metrics; i++) {
    if (m->metrics[i]->step > 0) /* step 0: the validation before training, no loss */
      fprintf(f, "%lld %.9g\n", (long long)m->metrics[i]->step, m->metrics[i]->loss);
    nval += m->metrics[i]->has_val;
  }
  fputs("EOD\n", f);
  char t[256];
  snprintf(t, sizeof t, "%strain", label);
  fprintf(plot, "%s$train%zu using 1:2 with lines linewidth 1.5%s title ", k ? ", " : "", k,
          colour);
  gp_string(plot, t);
  /* The blend's sources, named as its spec names them: a dashed line each. */
  const Distrain__V1__JobSpec *spec = p->job->spec;
  char sources[DT_BLEND_MAX][DT_NAME_MAX];
  const int nsrc = dt_blend_names(spec && spec->data ? spec->data->train : NULL, sources);
  const char *names[DT_BLEND_MAX];
  for (int d = 0; d < nsrc; d++)
    names[d] = sources[d];
  write_named_series(f, plot, m, k, 1, names, (size_t)nsrc, label, colour);
  if (nval) {
    fprintf(f, "$val%zu << EOD\n", k);
    for (size_t i = 0; i < m->n_metrics; i++)
      if (m->metrics[i]->has_val)
        fprintf(f, "%lld %.9g\n", (long long)m->metrics[i]->step, m->metrics[i]->val_loss);
    fputs("EOD\n", f);
    snprintf(t, sizeof t, "%svalidation", label);
    fprintf(plot, ", $val%zu using 1:2 with linespoints pointtype 7%s title ", k, points);
    gp_string(plot, t);
  }
  /* The validation sets, named by the newest step that validated them: a series each. */
  const Distrain__V1__StepMetrics *sets = NULL;
  for (size_t i = m->n_metrics; i-- > 0 && !sets;)
    sets = m->metrics[i]->n_val_sets ? m->metrics[i] : NULL;
  const size_t nsets = sets ? sets->n_val_sets : 0;
  const char *set_names[DT_VALSETS_MAX];
  for (size_t v = 0; v < nsets && v < DT_VALSETS_MAX; v++)
    set_names[v] = sets->val_sets[v]->name;
  write_named_series(f, plot, m, k, 0, set_names, DT_MIN(nsets, DT_VALSETS_MAX), label, points);
}

static void write_script(FILE *f, const plotted_t *jobs, size_t n, const char *path)
{
  fputs("set terminal pngcairo size 960,540 font 'sans,10' noenhanced\nset output ", f);
  gp_string(f, path);
  char title[512];
  if (n == 1) {
    const Distrain__V1__Job *job = jobs[0].job;
    const char *name = job->spec && job->spec->name ? job->spec->name : "";
    snprintf(title, sizeof title, "%s%s%s%s: loss, %zu steps (%s)", job->job_id, *name ? " (" : "",
             name, *name ? ")" : "",
             jobs[0].m->n_metrics - (jobs[0].m->metrics[0]->step == 0), /* step 0: none */
             dt_ctl_state_name(job->state));
  } else {
    size_t len = (size_t)snprintf(title, sizeof title, "loss:");
    for (size_t k = 0; k < n && len < sizeof title; k++)
      len += (size_t)snprintf(title + len, sizeof title - len, "%s %s", k ? "," : "",
                              jobs[k].job->job_id);
  }
  fputs("\nset title ", f);
  gp_string(f, title);
  fputs("\nset xlabel 'step'\nset ylabel 'loss'\nset grid\nset key top right\n", f);
  char *cmd = NULL;
  size_t cmd_len = 0;
  FILE *plot = open_memstream(&cmd, &cmd_len);
  if (!plot)
    return; /* gnuplot then fails on the missing plot command: the caller reports it */
  for (size_t k = 0; k < n; k++)
    write_job_series(f, plot, &jobs[k], k, n > 1 ? (int)k + 1 : 0);
  fclose(plot);
  fprintf(f, "plot %s\n", cmd);
  free(cmd);
}

/* Runs gnuplot on the script; 0 once it exited 0 and wrote a non-empty file. */
static int run_gnuplot(const plotted_t *jobs, size_t n, const char *path)
{
  int fds[2];
  if (pipe(fds) != 0)
    return DT_ESYS;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[0], 0);
  posix_spawn_file_actions_addclose(&fa, fds[1]);
  char *argv[] = {"gnuplot", NULL};
  pid_t pid;
  int rc = posix_spawnp(&pid, "gnuplot", &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(fds[0]);
  if (rc != 0) {
    close(fds[1]);
    fprintf(stderr,
            "distrainctl: --plot needs gnuplot (%s); on Debian: apt-get install "
            "gnuplot-nox\n",
            strerror(rc));
    return DT_ENOENT;
  }
  void (*was)(int) = signal(SIGPIPE, SIG_IGN); /* gnuplot may stop reading on an error */
  FILE *f = fdopen(fds[1], "w");
  if (f) {
    write_script(f, jobs, n, path);
    fclose(f);
  } else {
    close(fds[1]);
  }
  signal(SIGPIPE, was);
  int status;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  struct stat st;
  if (!f || !WIFEXITED(status) || WEXITSTATUS(status) != 0 || stat(path, &st) != 0 ||
      st.st_size == 0) {
    fprintf(stderr, "distrainctl: gnuplot could not write %s (see its message above)\n", path);
    return DT_EIO;
  }
  return 0;
}

int dt_ctl_plot(dt_rpc_client_t *c, char *const *job_ids, size_t n, const char *path)
{
  char err[1024];
  ProtobufCMessage *resp[2 * DT_CTL_PLOT_MAX_JOBS] = {0};
  plotted_t jobs[DT_CTL_PLOT_MAX_JOBS];
  const int timeout_ms = dt_ctl_rpc_timeout_ms();
  int rc = n >= 1 && n <= DT_CTL_PLOT_MAX_JOBS ? 0 : DT_EINVAL;
  for (size_t k = 0; k < n && rc == 0; k++) {
    Distrain__V1__GetJobRequest jreq = DISTRAIN__V1__GET_JOB_REQUEST__INIT;
    Distrain__V1__GetJobMetricsRequest mreq = DISTRAIN__V1__GET_JOB_METRICS_REQUEST__INIT;
    jreq.job_id = mreq.job_id = job_ids[k];
    mreq.after_step = -1;
    rc = dt_rpc_client_call(c, "GetJob", &jreq.base, &resp[2 * k], timeout_ms, 0, err, sizeof err);
    if (rc == 0)
      rc = dt_rpc_client_call(c, "GetJobMetrics", &mreq.base, &resp[2 * k + 1], timeout_ms, 0, err,
                              sizeof err);
    if (rc != 0) {
      fprintf(stderr, "distrainctl: %s\n", err);
      break;
    }
    jobs[k] = (plotted_t){(void *)resp[2 * k], (void *)resp[2 * k + 1]};
    const Distrain__V1__GetJobMetricsResponse *m = jobs[k].m;
    if (m->n_metrics == 0 || m->metrics[m->n_metrics - 1]->step == 0) {
      fprintf(stderr, "distrainctl: job %s has reported no steps yet: nothing to plot\n",
              job_ids[k]);
      rc = DT_ENOENT;
    }
  }
  if (rc == 0)
    rc = run_gnuplot(jobs, n, path);
  for (size_t i = 0; i < 2 * DT_CTL_PLOT_MAX_JOBS; i++)
    if (resp[i])
      protobuf_c_message_free_unpacked(resp[i], NULL);
  return rc;
}
