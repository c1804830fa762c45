/* ctl_plot.c — `distrainctl status JOB --plot loss.png`: a job's loss curve as a PNG.
 *
 * gnuplot draws it (Debian's gnuplot-nox, its cairo PNG terminal): distrainctl fetches every
 * step's metrics from the coordinator and writes gnuplot a script on its standard input, the
 * data inline, so no temporary file is left behind. Training loss as a line, validation loss
 * (where the job evaluated) and each validation set's (data.val_sets) as points, the step on x.
 * gnuplot rather than a C plotting library: Debian's PLplot development package pulls in
 * Qt 5, GTK 3 and wxWidgets, gnuplot-nox four small packages. */
#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctl.h"
#include "dt_error.h"

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

/* The loss of validation set `name` at metrics i; 0 when that step did not validate it. */
static int val_set_at(const Distrain__V1__StepMetrics *m, const char *name, float *loss)
{
  for (size_t v = 0; v < m->n_val_sets; v++)
    if (strcmp(m->val_sets[v]->name, name) == 0) {
      *loss = m->val_sets[v]->loss;
      return 1;
    }
  return 0;
}

static void write_script(FILE *f, const Distrain__V1__Job *job,
                         const Distrain__V1__GetJobMetricsResponse *m, const char *path)
{
  size_t nval = 0;
  fputs("set terminal pngcairo size 960,540 font 'sans,10' noenhanced\nset output ", f);
  gp_string(f, path);
  char title[512];
  const char *name = job->spec && job->spec->name ? job->spec->name : "";
  snprintf(title, sizeof title, "%s%s%s%s: loss, %zu steps (%s)", job->job_id, *name ? " (" : "",
           name, *name ? ")" : "", m->n_metrics, dt_ctl_state_name(job->state));
  fputs("\nset title ", f);
  gp_string(f, title);
  fputs("\nset xlabel 'step'\nset ylabel 'loss'\nset grid\nset key top right\n$train << EOD\n", f);
  for (size_t i = 0; i < m->n_metrics; i++) {
    fprintf(f, "%lld %.9g\n", (long long)m->metrics[i]->step, m->metrics[i]->loss);
    nval += m->metrics[i]->has_val;
  }
  fputs("EOD\n", f);
  if (nval) {
    fputs("$val << EOD\n", f);
    for (size_t i = 0; i < m->n_metrics; i++)
      if (m->metrics[i]->has_val)
        fprintf(f, "%lld %.9g\n", (long long)m->metrics[i]->step, m->metrics[i]->val_loss);
    fputs("EOD\n", f);
  }
  /* The validation sets, named by the newest step that validated them: a series each. */
  const Distrain__V1__StepMetrics *sets = NULL;
  for (size_t i = m->n_metrics; i-- > 0 && !sets;)
    sets = m->metrics[i]->n_val_sets ? m->metrics[i] : NULL;
  const size_t nsets = sets ? sets->n_val_sets : 0;
  for (size_t v = 0; v < nsets; v++) {
    fprintf(f, "$set%zu << EOD\n", v);
    for (size_t i = 0; i < m->n_metrics; i++) {
      float loss;
      if (val_set_at(m->metrics[i], sets->val_sets[v]->name, &loss))
        fprintf(f, "%lld %.9g\n", (long long)m->metrics[i]->step, loss);
    }
    fputs("EOD\n", f);
  }
  fprintf(f, "plot $train using 1:2 with lines linewidth 1.5 title 'train'%s",
          nval ? ", $val using 1:2 with linespoints pointtype 7 title 'validation'" : "");
  for (size_t v = 0; v < nsets; v++) {
    char t[64];
    snprintf(t, sizeof t, "validation: %.31s", sets->val_sets[v]->name);
    fprintf(f, ", $set%zu using 1:2 with linespoints pointtype %zu title ", v, 9 + 2 * (v % 4));
    gp_string(f, t);
  }
  fputc('\n', f);
}

/* Runs gnuplot on the script; 0 once it exited 0 and wrote a non-empty file. */
static int run_gnuplot(const Distrain__V1__Job *job, const Distrain__V1__GetJobMetricsResponse *m,
                       const char *path)
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
    write_script(f, job, m, path);
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

int dt_ctl_plot(dt_rpc_client_t *c, const char *job_id, const char *path)
{
  char err[1024];
  ProtobufCMessage *jresp = NULL, *mresp = NULL;
  Distrain__V1__GetJobRequest jreq = DISTRAIN__V1__GET_JOB_REQUEST__INIT;
  Distrain__V1__GetJobMetricsRequest mreq = DISTRAIN__V1__GET_JOB_METRICS_REQUEST__INIT;
  jreq.job_id = mreq.job_id = (char *)job_id;
  mreq.after_step = -1;
  const int timeout_ms = dt_ctl_rpc_timeout_ms();
  int rc = dt_rpc_client_call(c, "GetJob", &jreq.base, &jresp, timeout_ms, 0, err, sizeof err);
  if (rc == 0)
    rc = dt_rpc_client_call(c, "GetJobMetrics", &mreq.base, &mresp, timeout_ms, 0, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "distrainctl: %s\n", err);
  } else if (((Distrain__V1__GetJobMetricsResponse *)mresp)->n_metrics == 0) {
    fprintf(stderr, "distrainctl: job %s has reported no steps yet: nothing to plot\n", job_id);
    rc = DT_ENOENT;
  } else {
    rc = run_gnuplot((void *)jresp, (void *)mresp, path);
  }
  if (jresp)
    protobuf_c_message_free_unpacked(jresp, NULL);
  if (mresp)
    protobuf_c_message_free_unpacked(mresp, NULL);
  return rc;
}
