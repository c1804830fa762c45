/* ctl.c — distrainctl's client side: specs in, jobs and nodes out, progress followed. */
#include "ctl.h"

#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "blend.h"
#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"
#include "jobspec.h"
#include "mesh.h"

DT_PARAM(CtlPollMs, "CTL_POLL_MS", 500)
DT_PARAM(CtlRpcTimeoutMs, "CTL_RPC_TIMEOUT_MS", 10000)

int dt_ctl_rpc_timeout_ms(void)
{
  return (int)dt_param_CtlRpcTimeoutMs();
}

static const char *const k_states[] = {"UNKNOWN",    "PENDING",   "RENDEZVOUS", "RUNNING",
                                       "RECOVERING", "COMPLETED", "FAILED",     "STOPPED"};

const char *dt_ctl_state_name(Distrain__V1__JobState s)
{
  return (unsigned)s < DT_ARRAY_SIZE(k_states) ? k_states[s] : "?";
}

int dt_ctl_connect(const dt_ctl_opts_t *o, dt_rpc_client_t **out)
{
  char token[256];
  DT_CHECK(dt_rpc_read_token(o->token_file, token, sizeof token));
  return dt_rpc_client_create(o->coordinator, token, &distrain__v1__coordinator__descriptor, out);
}

/* ------------------------------------------------------------------------------------------ */
/* Specs                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* Replaces a relative path field by base/path. */
static int absolutize(char **field, const char *base, const char *prefix)
{
  const char *v = *field;
  size_t plen = prefix ? strlen(prefix) : 0;
  if (!v || !*v || (prefix && strncmp(v, prefix, plen) != 0))
    return 0;
  if (v[plen] == '/' || v[plen] == '\0')
    return 0;
  char buf[PATH_MAX * 2];
  snprintf(buf, sizeof buf, "%.*s%s/%s", (int)plen, v, base, v + plen);
  char *copy = strdup(buf);
  if (!copy)
    return DT_ENOMEM;
  if (*field != protobuf_c_empty_string)
    free(*field);
  *field = copy;
  return 0;
}

/* Sets a string field to s (a new string: NULL when out of memory), freeing the one before. */
static int replace_field(char **field, char *s, int rc)
{
  if (!s)
    return rc ? rc : DT_ENOMEM;
  if (*field != protobuf_c_empty_string)
    free(*field);
  *field = s;
  return 0;
}

/* The same for each source of a blend ("W:GLOB,..."), or the one path. */
static int absolutize_shards(char **field, const char *base)
{
  if (!dt_blend_is(*field))
    return absolutize(field, base, NULL);
  dt_blend_t b;
  char why[512];
  int rc = dt_blend_parse(*field, &b, why, sizeof why); /* validated before: only ENOMEM */
  for (int i = 0; rc == 0 && i < b.n; i++)
    rc = absolutize(&b.pattern[i], base, NULL);
  char *s = rc == 0 ? dt_blend_format(&b) : NULL;
  dt_blend_free(&b);
  return replace_field(field, s, rc);
}

/* And for each of the named validation sets ("NAME=GLOB,..."). */
static int absolutize_val_sets(char **field, const char *base)
{
  if (!*field || !**field)
    return 0;
  dt_valsets_t v;
  char why[512];
  int rc = dt_valsets_parse(*field, &v, why, sizeof why); /* validated before: only ENOMEM */
  for (int i = 0; rc == 0 && i < v.n; i++)
    rc = absolutize(&v.pattern[i], base, NULL);
  char *s = rc == 0 ? dt_valsets_format(&v) : NULL;
  dt_valsets_free(&v);
  return replace_field(field, s, rc);
}

int dt_ctl_load_spec(const char *path, char **sets, int nsets, Distrain__V1__JobSpec **out)
{
  char err[2048];
  Distrain__V1__JobSpec *spec;
  DT_CHECK(dt_jobspec_new_default(&spec));
  int rc = dt_jobspec_parse_file(path, spec, err, sizeof err);
  for (int i = 0; rc == 0 && i < nsets; i++)
    rc = dt_jobspec_set(spec, sets[i], err, sizeof err);
  if (rc == 0)
    rc = dt_jobspec_validate(spec, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "distrainctl: %s\n", err);
    dt_jobspec_free(spec);
    return rc;
  }
  /* Paths in a job file are relative to the file, wherever distrainctl runs. */
  char copy[PATH_MAX], base[PATH_MAX];
  snprintf(copy, sizeof copy, "%s", path);
  if (!realpath(dirname(copy), base)) {
    fprintf(stderr, "distrainctl: %s: %s\n", path, strerror(errno));
    dt_jobspec_free(spec);
    return DT_ENOENT;
  }
  rc = absolutize_shards(&spec->data->train, base);
  if (rc == 0)
    rc = absolutize_shards(&spec->data->val, base);
  if (rc == 0)
    rc = absolutize_val_sets(&spec->data->val_sets, base);
  if (rc == 0)
    rc = absolutize(&spec->data->vocab_file, base, NULL);
  if (rc == 0)
    rc = absolutize(&spec->data->merge_file, base, NULL);
  if (rc == 0)
    rc = absolutize(&spec->data->eval, base, NULL);
  if (rc == 0)
    rc = absolutize(&spec->checkpoint->dir, base, NULL);
  /* model.init: the path after its kind, or a checkpoint path as it is; not a seed */
  static const char *const kinds[] = {"llmc:", "hf:", "ckpt:"};
  int kinded = strncmp(spec->model->init, "seed:", 5) == 0;
  for (size_t k = 0; rc == 0 && k < DT_ARRAY_SIZE(kinds); k++) {
    kinded |= strncmp(spec->model->init, kinds[k], strlen(kinds[k])) == 0;
    rc = absolutize(&spec->model->init, base, kinds[k]);
  }
  if (rc == 0 && !kinded)
    rc = absolutize(&spec->model->init, base, NULL);
  if (rc != 0) {
    dt_jobspec_free(spec);
    return rc;
  }
  *out = spec;
  return 0;
}

int dt_ctl_submit(dt_rpc_client_t *c, const Distrain__V1__JobSpec *spec, char *job_id, size_t len)
{
  Distrain__V1__SubmitJobRequest req = DISTRAIN__V1__SUBMIT_JOB_REQUEST__INIT;
  req.spec = (Distrain__V1__JobSpec *)spec;
  ProtobufCMessage *resp;
  char err[1024];
  int rc = dt_rpc_client_call(c, "SubmitJob", &req.base, &resp, dt_ctl_rpc_timeout_ms(),
                              DT_RPC_WAIT_FOR_READY, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "distrainctl: the coordinator refused the job: %s\n", err);
    return rc;
  }
  snprintf(job_id, len, "%s", ((Distrain__V1__SubmitJobResponse *)resp)->job_id);
  protobuf_c_message_free_unpacked(resp, NULL);
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Output                                                                                      */
/* ------------------------------------------------------------------------------------------ */

void dt_json_string(FILE *out, const char *s)
{
  fputc('"', out);
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    switch (*p) {
    case '"':
      fputs("\\\"", out);
      break;
    case '\\':
      fputs("\\\\", out);
      break;
    case '\n':
      fputs("\\n", out);
      break;
    case '\r':
      fputs("\\r", out);
      break;
    case '\t':
      fputs("\\t", out);
      break;
    default:
      if (*p < 0x20)
        fprintf(out, "\\u%04x", *p);
      else
        fputc(*p, out);
    }
  }
  fputc('"', out);
}

void dt_json_number(FILE *out, const char *fmt, double v)
{
  if (isfinite(v))
    fprintf(out, fmt, v);
  else
    fputs("null", out);
}

static const char *trainer_state(Distrain__V1__TrainerState s)
{
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value(&distrain__v1__trainer_state__descriptor, (int)s);
  return v ? v->name + strlen("TRAINER_") : "UNKNOWN";
}

/* The first max of n named losses as arrays of names and losses; returns how many. */
static int unzip_named(Distrain__V1__NamedLoss *const *l, size_t n, size_t max, const char **names,
                       float *losses)
{
  const size_t k = DT_MIN(n, max);
  for (size_t i = 0; i < k; i++)
    names[i] = l[i]->name, losses[i] = l[i]->loss;
  return (int)k;
}

/* ', "key": {"name": loss, ...}' of n named losses; nothing for none. */
static void write_named(FILE *fp, const char *key, Distrain__V1__NamedLoss *const *l, size_t n)
{
  for (size_t i = 0; i < n; i++) { /* names come from trainers: escaped */
    if (i == 0)
      fprintf(fp, ", \"%s\": {", key);
    else
      fputs(", ", fp);
    dt_json_string(fp, l[i]->name);
    fprintf(fp, ": %.9g%s", l[i]->loss, i == n - 1 ? "}" : "");
  }
}

/* A duration as the status lines show it: "1h05m", "4m12s", "37s" ("?" out of range). */
static void fmt_duration(char *buf, size_t n, double seconds)
{
  if (!(seconds >= 0) || seconds > 1e7)
    snprintf(buf, n, "?");
  else if (seconds >= 3600)
    snprintf(buf, n, "%dh%02dm", (int)(seconds / 3600), (int)fmod(seconds / 60, 60));
  else if (seconds >= 60)
    snprintf(buf, n, "%dm%02ds", (int)(seconds / 60), (int)fmod(seconds, 60));
  else
    snprintf(buf, n, "%.0fs", seconds);
}

/* A step's validation as the trainer's step line has it (dt_valsets_line). */
static void fmt_val(char *buf, size_t n, const Distrain__V1__StepMetrics *s)
{
  const char *names[DT_VALSETS_MAX];
  float losses[DT_VALSETS_MAX];
  const int nsets = unzip_named(s->val_sets, s->n_val_sets, DT_VALSETS_MAX, names, losses);
  dt_valsets_line(buf, n, s->has_val ? &s->val_loss : NULL, nsets, names, losses);
}

/* A step's losses by source as the trainer's step line has them (dt_sources_line). */
static void fmt_sources(char *buf, size_t n, const Distrain__V1__StepMetrics *s)
{
  const char *names[DT_BLEND_MAX];
  float losses[DT_BLEND_MAX];
  const int nsrc = unzip_named(s->train_sources, s->n_train_sources, DT_BLEND_MAX, names, losses);
  dt_sources_line(buf, n, nsrc, names, losses);
}

int dt_ctl_named_loss(const Distrain__V1__StepMetrics *m, int train, const char *name, float *loss)
{
  const size_t n = train ? m->n_train_sources : m->n_val_sets;
  Distrain__V1__NamedLoss *const *l = train ? m->train_sources : m->val_sets;
  for (size_t v = 0; v < n; v++)
    if (strcmp(l[v]->name, name) == 0) {
      *loss = l[v]->loss;
      return 1;
    }
  return 0;
}

/* A step's validation as JSON: {"step", "loss" (data.val's, or null), "sets" (name -> loss)}. */
static void json_val(FILE *out, const Distrain__V1__StepMetrics *m)
{
  fprintf(out, "{\"step\": %lld, \"loss\": ", (long long)m->step);
  if (m->has_val)
    dt_json_number(out, "%.9g", m->val_loss);
  else
    fputs("null", out);
  fputs(", \"sets\": {", out);
  for (size_t v = 0; v < m->n_val_sets; v++) {
    fputs(v ? ", " : "", out);
    dt_json_string(out, m->val_sets[v]->name);
    fputs(": ", out);
    dt_json_number(out, "%.9g", m->val_sets[v]->loss);
  }
  fputs("}}", out);
}

static void json_job(FILE *out, const Distrain__V1__Job *j)
{
  fprintf(out, "{\"job_id\": ");
  dt_json_string(out, j->job_id);
  fprintf(out, ", \"name\": ");
  dt_json_string(out, j->spec ? j->spec->name : "");
  fprintf(out, ", \"state\": ");
  dt_json_string(out, dt_ctl_state_name(j->state));
  fprintf(out, ", \"reason\": ");
  dt_json_string(out, j->reason);
  fprintf(out, ", \"last_restart\": ");
  dt_json_string(out, j->last_restart);
  fprintf(out,
          ", \"generation\": %llu, \"restarts\": %d, \"world_size\": %d, \"step\": %lld, "
          "\"steps\": %d, \"loss\": ",
          (unsigned long long)j->generation, j->restarts, j->world_size, (long long)j->step,
          j->spec && j->spec->training ? j->spec->training->steps : 0);
  dt_json_number(out, "%.9g", j->loss);
  fputs(", \"tokens_per_s\": ", out);
  dt_json_number(out, "%.1f", j->tokens_per_s);
  fprintf(out, ", \"committed_step\": %lld, \"committed_ms\": %lld, \"checkpoint_error\": ",
          (long long)j->committed_step, (long long)j->committed_ms);
  dt_json_string(out, j->checkpoint_error);
  fprintf(out, ", \"failed_nodes\": [");
  for (size_t i = 0; i < j->n_failed_nodes; i++) {
    if (i)
      fputs(", ", out);
    dt_json_string(out, j->failed_nodes[i]);
  }
  fprintf(out, "], \"skipped_steps\": [");
  for (size_t i = 0; i < j->n_skipped_steps; i++)
    fprintf(out, "%s%lld", i ? ", " : "", (long long)j->skipped_steps[i]);
  fprintf(out, "], \"created_ms\": %lld, \"updated_ms\": %lld", (long long)j->created_ms,
          (long long)j->updated_ms);
  if (j->last_val) {
    fputs(", \"val\": ", out);
    json_val(out, j->last_val);
  }
  if (j->last_eval) {
    fprintf(out, ", \"eval\": {\"step\": %lld, \"acc_norm\": ", (long long)j->last_eval->step);
    dt_json_number(out, "%.6g", j->last_eval->eval_acc_norm);
    fputs(", \"acc\": ", out);
    dt_json_number(out, "%.6g", j->last_eval->eval_acc);
    fputc('}', out);
  }
  if (j->last_sources) { /* {"step", "loss": {source: loss}} */
    fprintf(out, ", \"sources\": {\"step\": %lld", (long long)j->last_sources->step);
    write_named(out, "loss", j->last_sources->train_sources, j->last_sources->n_train_sources);
    fputc('}', out);
  }
  if (j->n_ranks) {
    fputs(", \"ranks\": [", out);
    for (size_t i = 0; i < j->n_ranks; i++) {
      const Distrain__V1__RankStatus *r = j->ranks[i];
      fprintf(out, "%s{\"rank\": %d, \"node_id\": ", i ? ", " : "", r->rank);
      dt_json_string(out, r->node_id);
      fputs(", \"hostname\": ", out);
      dt_json_string(out, r->hostname);
      fprintf(out, ", \"state\": \"%s\", \"step\": %lld, \"waiting\": ", trainer_state(r->state),
              (long long)r->step);
      dt_json_string(out, r->waiting);
      fprintf(out, ", \"report_age_ms\": %u, \"compute_ms\": ", r->report_age_ms);
      dt_json_number(out, "%.3f", r->compute_ms);
      fprintf(out, ", \"straggler\": %s}", r->straggler ? "true" : "false");
    }
    fputc(']', out);
  }
  fputc('}', out);
}

void dt_ctl_print_job(FILE *out, const Distrain__V1__Job *j, int json)
{
  if (json) {
    json_job(out, j);
    fputc('\n', out);
    return;
  }
  const int steps = j->spec && j->spec->training ? j->spec->training->steps : 0;
  const int prio = j->spec && j->spec->elastic ? j->spec->elastic->priority : 0;
  fprintf(out, "job:         %s%s%s", j->job_id, j->spec && j->spec->name[0] ? "  " : "",
          j->spec ? j->spec->name : "");
  if (prio) /* the default, 0, goes unsaid */
    fprintf(out, "  (elastic.priority %d)", prio);
  fputc('\n', out);
  fprintf(out, "state:       %s (generation %llu, %d restart%s)\n", dt_ctl_state_name(j->state),
          (unsigned long long)j->generation, j->restarts, j->restarts == 1 ? "" : "s");
  fprintf(out, "reason:      %s\n", j->reason);
  if (j->last_restart[0] && j->state != DISTRAIN__V1__JOB_STATE__JOB_RECOVERING)
    fprintf(out, "restarted:   %s\n", j->last_restart); /* why this generation replaced one */
  fprintf(out, "world:       %d\n", j->world_size);
  fprintf(out, "progress:    step %lld/%d, loss %.4f, %.0f tokens/s\n", (long long)j->step, steps,
          j->loss, j->tokens_per_s);
  if (j->last_sources) {
    char src[DT_BLEND_MAX * (DT_NAME_MAX + 16)];
    fmt_sources(src, sizeof src, j->last_sources);
    fprintf(out, "by source:   step %lld%s\n", (long long)j->last_sources->step, src);
  }
  if (j->last_val) {
    char val[1024];
    fmt_val(val, sizeof val, j->last_val);
    fprintf(out, "validation:  step %lld%s\n", (long long)j->last_val->step, val);
  }
  if (j->last_eval)
    fprintf(out, "evaluation:  step %lld: acc_norm %.4f, acc %.4f\n", (long long)j->last_eval->step,
            j->last_eval->eval_acc_norm, j->last_eval->eval_acc);
  if (j->committed_step > 0) {
    /* How much a failure now would cost: the time and steps since the newest commit. */
    char ago[48] = "", since[48] = "";
    if (j->committed_ms > 0) {
      const double age = (double)time(NULL) - (double)j->committed_ms / 1000.0;
      fmt_duration(ago, sizeof ago, age > 0 ? age : 0); /* the clocks may disagree a little */
      strncat(ago, " ago", sizeof ago - strlen(ago) - 1);
    }
    if (j->state == DISTRAIN__V1__JOB_STATE__JOB_RUNNING && j->step > j->committed_step)
      snprintf(since, sizeof since, " (%lld steps since)",
               (long long)(j->step - j->committed_step));
    fprintf(out, "checkpoint:  step %lld committed%s%s in %s%s\n", (long long)j->committed_step,
            ago[0] ? " " : "", ago, j->spec && j->spec->checkpoint ? j->spec->checkpoint->dir : "?",
            since);
  }
  if (j->checkpoint_error[0])
    fprintf(out, "checkpoint:  %s\n", j->checkpoint_error);
  for (size_t i = 0; i < j->n_failed_nodes; i++)
    fprintf(out, "failed node: %s\n", j->failed_nodes[i]);
  for (size_t i = 0, run; i < j->n_skipped_steps; i += run) { /* runs of steps on one line */
    run = dt_run_length(j->skipped_steps + i, j->n_skipped_steps - i);
    char what[64];
    dt_steps_text(what, sizeof what, j->skipped_steps[i], (int64_t)run);
    fprintf(out, "skipped:     %s (a non-finite or spiking loss or gradient norm)\n", what);
  }
  const size_t shown = DT_MIN(j->n_ranks, (size_t)32);
  for (size_t i = 0; i < shown; i++) {
    const Distrain__V1__RankStatus *r = j->ranks[i];
    fprintf(out, "%-12s %-4d %s (%s)  %-9s step %-7lld %6.1f ms/step compute%s%s%s\n",
            i ? "" : "ranks:", r->rank, r->node_id, r->hostname, trainer_state(r->state),
            (long long)r->step, r->compute_ms, r->straggler ? "  STRAGGLER" : "",
            r->waiting[0] ? "  blocked in " : "", r->waiting);
  }
  if (j->n_ranks > shown)
    fprintf(out, "%-12s ... and %zu more ranks (--json lists them all)\n", "", j->n_ranks - shown);
}

void dt_ctl_print_jobs(FILE *out, Distrain__V1__Job **jobs, size_t n, int json)
{
  if (json) {
    fputc('[', out);
    for (size_t i = 0; i < n; i++) {
      if (i)
        fputs(", ", out);
      json_job(out, jobs[i]);
    }
    fputs("]\n", out);
    return;
  }
  fprintf(out, "%-10s %-12s %4s %6s %13s %9s  %s\n", "JOB", "STATE", "GEN", "WORLD", "STEP", "LOSS",
          "REASON");
  for (size_t i = 0; i < n; i++) {
    const Distrain__V1__Job *j = jobs[i];
    char step[32];
    snprintf(step, sizeof step, "%lld/%d", (long long)j->step,
             j->spec && j->spec->training ? j->spec->training->steps : 0);
    fprintf(out, "%-10s %-12s %4llu %6d %13s %9.4f  %s\n", j->job_id, dt_ctl_state_name(j->state),
            (unsigned long long)j->generation, j->world_size, step, j->loss, j->reason);
  }
}

int dt_ctl_trainer_active(const Distrain__V1__TrainerStatus *ts)
{
  return ts->state == DISTRAIN__V1__TRAINER_STATE__TRAINER_STARTING ||
         ts->state == DISTRAIN__V1__TRAINER_STATE__TRAINER_RUNNING;
}

int dt_ctl_node_busy(const Distrain__V1__Node *nd)
{
  for (size_t i = 0; i < nd->n_trainers; i++)
    if (dt_ctl_trainer_active(nd->trainers[i]))
      return 1;
  return 0;
}

/* Alive nodes that take no new work: LEAVING (its agent is stopping), DRAINING (drained by an
 * operator, trainers still running there) and DRAINED. */
static const char *node_state(const Distrain__V1__Node *nd)
{
  const Distrain__V1__NodeState s = nd->state;
  if (s == DISTRAIN__V1__NODE_STATE__NODE_ALIVE)
    return nd->leaving    ? "LEAVING"
           : !nd->drained ? "ALIVE"
                          : (dt_ctl_node_busy(nd) ? "DRAINING" : "DRAINED");
  return s == DISTRAIN__V1__NODE_STATE__NODE_DEAD ? "DEAD" : "UNKNOWN";
}

/* snprintf at buf + *off, advancing *off but never past the end (output is cut, not overrun). */
static void appendf(char *buf, size_t n, size_t *off, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void appendf(char *buf, size_t n, size_t *off, const char *fmt, ...)
{
  if (*off >= n)
    return;
  va_list ap;
  va_start(ap, fmt);
  int w = vsnprintf(buf + *off, n - *off, fmt, ap);
  va_end(ap);
  if (w > 0)
    *off = DT_MIN(n - 1, *off + (size_t)w);
}

int dt_ctl_gpu_unhealthy(const Distrain__V1__DeviceUsage *u)
{
  return u->lost || u->ecc_uncorrected > 0 || u->reset_pending || u->remap_failed || u->xid ||
         u->nvlink_down;
}

int dt_ctl_gpu_problems(Distrain__V1__DeviceUsage *const *usage, size_t n_usage, char *buf,
                        size_t n)
{
  size_t off = 0;
  int bad = 0;
  if (n)
    buf[0] = '\0';
  for (size_t i = 0; i < n_usage; i++) {
    const Distrain__V1__DeviceUsage *u = usage[i];
    if (!dt_ctl_gpu_unhealthy(u))
      continue;
    appendf(buf, n, &off, "%sGPU %d", bad++ ? "; " : "", u->index);
    const char *sep = ": ";
    if (u->lost) {
      appendf(buf, n, &off, "%slost (it fell off the bus or needs a reset)", sep);
      sep = ", ";
    }
    if (u->ecc_uncorrected > 0) {
      appendf(buf, n, &off, "%s%lld uncorrected ECC error%s since the driver loaded", sep,
              (long long)u->ecc_uncorrected, u->ecc_uncorrected == 1 ? "" : "s");
      sep = ", ";
    }
    if (u->remap_failed) {
      appendf(buf, n, &off, "%sa row remapping failed (no spare memory rows left)", sep);
      sep = ", ";
    }
    if (u->reset_pending) {
      appendf(buf, n, &off, "%smemory repairs wait for a reset (row remapping or page retirement)",
              sep);
      sep = ", ";
    }
    if (u->xid) {
      appendf(buf, n, &off, "%sXid %d (reported until its agent restarts)", sep, u->xid);
      sep = ", ";
    }
    if (u->nvlink_down) {
      appendf(buf, n, &off, "%sNVLink%s ", sep, u->nvlink_down & (u->nvlink_down - 1) ? "s" : "");
      for (int l = 0, k = 0; l < 64; l++)
        if (u->nvlink_down >> l & 1)
          appendf(buf, n, &off, "%s%d", k++ ? ", " : "", l);
      appendf(buf, n, &off, " down (active when its agent started)");
    }
  }
  return bad;
}

int dt_ctl_gpu_slowed(const Distrain__V1__DeviceUsage *u, char *buf, size_t n)
{
  static const struct {
    uint64_t bit;
    const char *words;
  } k[] = {{0x8, "hardware slowdown"},
           {0x20, "software thermal slowdown"},
           {0x40, "hardware thermal slowdown"},
           {0x80, "hardware power brake"}};
  const int narrow = u->pcie_width > 0 && u->pcie_width < u->pcie_max_width;
  const struct {
    int64_t per_min, max;
    const char *what, *unit;
  } rate[] = {{u->pcie_replays_per_min, DT_CTL_PCIE_REPLAYS_MAX, "PCIe link replaying", "replays"},
              {u->nvlink_replays_per_min, DT_CTL_NVLINK_REPLAYS_MAX, "NVLink errors",
               "replays and recoveries"},
              {u->nvlink_crc_per_min, DT_CTL_NVLINK_CRC_MAX, "NVLink CRC errors", "errors"}};
  size_t off = 0;
  int slowed = u->slowdown != 0 || narrow;
  if (buf && n)
    buf[0] = '\0';
  for (size_t i = 0; buf && i < DT_ARRAY_SIZE(k); i++)
    if (u->slowdown & k[i].bit)
      appendf(buf, n, &off, "%s%s", off ? ", " : "", k[i].words);
  if (buf && narrow)
    appendf(buf, n, &off, "%sPCIe link x%u of x%u", off ? ", " : "", u->pcie_width,
            u->pcie_max_width);
  for (size_t i = 0; i < DT_ARRAY_SIZE(rate); i++) {
    if (rate[i].per_min <= rate[i].max)
      continue;
    slowed = 1;
    if (buf)
      appendf(buf, n, &off, "%s%s (%lld %s a minute)", off ? ", " : "", rate[i].what,
              (long long)rate[i].per_min, rate[i].unit);
  }
  return slowed;
}

#define GIB (1024.0 * 1024.0 * 1024.0)

/* A node's devices in one line: "2x NVIDIA H100 80GB HBM3, mem 24.6/159.2 GiB, util 86%".
 * Devices are counted by name in the order listed; memory is summed over the GPUs with usage and
 * utilisation averaged over those that report it. Without usage, the GPUs' total memory. */
static void devices_summary(const Distrain__V1__Node *nd, char *buf, size_t n)
{
  const Distrain__V1__NodeInfo *info = nd->info;
  const size_t ndev = info ? info->n_devices : 0;
  size_t off = 0;
  buf[0] = '\0';
  if (ndev == 0) {
    appendf(buf, n, &off, "-");
    return;
  }
  uint64_t total = 0;
  for (size_t i = 0; i < ndev; i++) {
    const Distrain__V1__Device *d = info->devices[i];
    total += d->memory_bytes;
    size_t first = 0, count = 0; /* the first device of this name, and how many there are */
    while (strcmp(info->devices[first]->name, d->name) != 0)
      first++;
    if (first != i)
      continue;
    for (size_t k = i; k < ndev; k++)
      count += strcmp(info->devices[k]->name, d->name) == 0;
    appendf(buf, n, &off, "%s%zux %s", i ? ", " : "", count, d->name[0] ? d->name : d->kind);
  }
  uint64_t used = 0, have = 0;
  int util = 0, n_util = 0;
  size_t known = 0; /* GPUs whose memory use is known (not a lost one's) */
  for (size_t i = 0; i < nd->n_usage; i++) {
    const Distrain__V1__DeviceUsage *u = nd->usage[i];
    known += u->memory_total_bytes > 0;
    used += u->memory_used_bytes;
    have += u->memory_total_bytes;
    if (u->utilization_pct >= 0) {
      util += u->utilization_pct;
      n_util++;
    }
  }
  if (known) {
    appendf(buf, n, &off, ", mem %.1f/%.1f GiB", (double)used / GIB, (double)have / GIB);
    if (n_util)
      appendf(buf, n, &off, ", util %d%%", (util + n_util / 2) / n_util);
    if (known < ndev)
      appendf(buf, n, &off, " (%zu of %zu reporting)", known, ndev);
    for (size_t i = 0; i < nd->n_usage; i++) {
      char words[DT_CTL_SLOWED_MAX];
      if (dt_ctl_gpu_slowed(nd->usage[i], words, sizeof words))
        appendf(buf, n, &off, ", GPU %d slowed (%s)", nd->usage[i]->index, words);
    }
  } else if (total) {
    appendf(buf, n, &off, ", %.1f GiB", (double)total / GIB);
  }
}

static void json_node(FILE *out, const Distrain__V1__Node *nd)
{
  const Distrain__V1__NodeInfo *info = nd->info;
  const size_t ndev = info ? info->n_devices : 0;
  fprintf(out, "{\"node_id\": ");
  dt_json_string(out, nd->node_id);
  fprintf(out, ", \"hostname\": ");
  dt_json_string(out, info ? info->hostname : "");
  fprintf(out, ", \"state\": ");
  dt_json_string(out, node_state(nd));
  fprintf(out, ", \"drained\": %s, \"drain_reason\": ", nd->drained ? "true" : "false");
  dt_json_string(out, nd->drain_reason);
  fprintf(out, ", \"device_kind\": ");
  dt_json_string(out, ndev ? info->devices[0]->kind : "-");
  fputs(", \"devices\": [", out);
  for (size_t i = 0; i < ndev; i++) {
    const Distrain__V1__Device *d = info->devices[i];
    fprintf(out, "%s{\"kind\": ", i ? ", " : "");
    dt_json_string(out, d->kind);
    fprintf(out, ", \"index\": %d, \"name\": ", d->index);
    dt_json_string(out, d->name);
    fprintf(out, ", \"memory_bytes\": %llu}", (unsigned long long)d->memory_bytes);
  }
  fputs("], \"usage\": [", out);
  for (size_t i = 0; i < nd->n_usage; i++) {
    const Distrain__V1__DeviceUsage *u = nd->usage[i];
    fprintf(out,
            "%s{\"index\": %d, \"memory_used_bytes\": %llu, \"memory_total_bytes\": %llu, "
            "\"utilization_pct\": %d, \"lost\": %s, \"ecc_uncorrected\": %lld, "
            "\"reset_pending\": %s, \"remap_failed\": %s, \"xid\": %d, \"nvlink_down\": %llu, "
            "\"pcie_width\": %u, \"pcie_max_width\": %u, \"pcie_replays_per_min\": %lld, "
            "\"nvlink_replays_per_min\": %lld, \"nvlink_crc_per_min\": %lld, \"slowdown\": ",
            i ? ", " : "", u->index, (unsigned long long)u->memory_used_bytes,
            (unsigned long long)u->memory_total_bytes, u->utilization_pct,
            u->lost ? "true" : "false", (long long)u->ecc_uncorrected,
            u->reset_pending ? "true" : "false", u->remap_failed ? "true" : "false", u->xid,
            (unsigned long long)u->nvlink_down, u->pcie_width, u->pcie_max_width,
            (long long)u->pcie_replays_per_min, (long long)u->nvlink_replays_per_min,
            (long long)u->nvlink_crc_per_min);
    char words[DT_CTL_SLOWED_MAX];
    dt_ctl_gpu_slowed(u, words, sizeof words);
    dt_json_string(out, words);
    fputc('}', out);
  }
  char problems[512];
  dt_ctl_gpu_problems(nd->usage, nd->n_usage, problems, sizeof problems);
  fprintf(out, "], \"gpu_problems\": ");
  dt_json_string(out, problems);
  fprintf(out, ", \"trainers\": %zu, \"last_heartbeat_ms\": %lld}", nd->n_trainers,
          (long long)nd->last_heartbeat_ms);
}

void dt_ctl_print_nodes(FILE *out, Distrain__V1__Node **nodes, size_t n, int json)
{
  if (json) {
    fputc('[', out);
    for (size_t i = 0; i < n; i++) {
      if (i)
        fputs(", ", out);
      json_node(out, nodes[i]);
    }
    fputs("]\n", out);
    return;
  }
  fprintf(out, "%-10s %-20s %-8s %8s  %-14s  %s\n", "NODE", "HOST", "STATE", "TRAINERS",
          "LAST HEARTBEAT", "DEVICES");
  const time_t now = time(NULL);
  for (size_t i = 0; i < n; i++) {
    const Distrain__V1__Node *nd = nodes[i];
    char seen[32], dev[4096];
    snprintf(seen, sizeof seen, "%llds ago", (long long)(now - nd->last_heartbeat_ms / 1000));
    devices_summary(nd, dev, sizeof dev);
    fprintf(out, "%-10s %-20s %-8s %8zu  %-14s  %s", nd->node_id,
            nd->info ? nd->info->hostname : "?", node_state(nd), nd->n_trainers, seen, dev);
    if (nd->drained) /* a dead node stays drained too */
      fprintf(out, "  [drained%s%s]", nd->drain_reason[0] ? ": " : "", nd->drain_reason);
    char problems[512];
    if (dt_ctl_gpu_problems(nd->usage, nd->n_usage, problems, sizeof problems) &&
        !(nd->drained && strstr(nd->drain_reason, problems)))
      fprintf(out, "  [unhealthy: %s]", problems);
    fputc('\n', out);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Following a job                                                                             */
/* ------------------------------------------------------------------------------------------ */

/* As the trainer's --metrics lines: step 0 (the validation before training) without a step's
 * figures. */
static void write_metric(FILE *fp, const Distrain__V1__StepMetrics *m)
{
  fprintf(fp, "{\"step\": %lld", (long long)m->step);
  if (m->step > 0)
    fprintf(fp,
            ", \"loss\": %.9g, \"lr\": %.9g, \"grad_norm\": %.9g, \"ms\": %.3f, "
            "\"tokens_per_s\": %.1f",
            m->loss, m->lr, m->grad_norm, m->ms, m->tokens_per_s);
  write_named(fp, "loss_sources", m->train_sources, m->n_train_sources);
  if (m->has_val)
    fprintf(fp, ", \"val_loss\": %.9g", m->val_loss);
  write_named(fp, "val_sets", m->val_sets, m->n_val_sets);
  if (m->has_eval)
    fprintf(fp, ", \"eval_acc_norm\": %.6f, \"eval_acc\": %.6f", m->eval_acc_norm, m->eval_acc);
  if (m->step > 0)
    fprintf(fp, ", \"tflops\": %.6g", m->tflops);
  if (m->mfu > 0)
    fprintf(fp, ", \"mfu\": %.6f", m->mfu);
  fputs("}\n", fp);
}

void dt_ctl_print_transition(FILE *out, const char *job_id, const Distrain__V1__Job *j,
                             uint64_t *placed_gen)
{
  fprintf(out, "[%s] %s (generation %llu): %s\n", job_id, dt_ctl_state_name(j->state),
          (unsigned long long)j->generation, j->reason);
  if (j->state == DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS) { /* its reason names the placement */
    *placed_gen = j->generation;
    return;
  }
  if (j->generation == *placed_gen || j->world_size == 0)
    return;
  /* The rendezvous fell between two polls: the placement from the ranks, each node once in rank
   * order, worded as the rendezvous's reason words it (a generation that has ended, as a fast
   * job's may have by then, has no ranks left to say where it ran). */
  const Distrain__V1__ParallelSpec *p = j->spec ? j->spec->parallel : NULL;
  char mesh_s[64] = "?", nodes[256] = "";
  dt_mesh_t mesh;
  if (p && dt_mesh_init(&mesh, DT_MAX(p->pp, 1), DT_MAX(p->dp, 1), DT_MAX(p->cp, 1),
                        DT_MAX(p->tp, 1)) == 0)
    dt_mesh_format(&mesh, mesh_s, sizeof mesh_s);
  for (size_t i = 0; i < j->n_ranks; i++) {
    const char *id = j->ranks[i]->node_id;
    size_t k = 0;
    while (k < i && strcmp(j->ranks[k]->node_id, id) != 0)
      k++;
    const size_t len = strlen(nodes);
    if (k == i)
      snprintf(nodes + len, sizeof nodes - len, "%s%s", len ? "," : "", id);
  }
  fprintf(out, "[%s] generation %llu: world %d (%s)%s%s\n", job_id,
          (unsigned long long)j->generation, j->world_size, mesh_s, nodes[0] ? " on " : "", nodes);
  *placed_gen = j->generation;
}

int dt_ctl_follow(dt_rpc_client_t *c, const dt_ctl_opts_t *o, const char *job_id)
{
  return dt_ctl_follow_until(c, o, job_id, NULL);
}

int dt_ctl_follow_until(dt_rpc_client_t *c, const dt_ctl_opts_t *o, const char *job_id,
                        volatile sig_atomic_t *stop)
{
  FILE *mf = NULL;
  if (o->metrics_path && !(mf = fopen(o->metrics_path, "w"))) {
    fprintf(stderr, "distrainctl: %s: %s\n", o->metrics_path, strerror(errno));
    return DT_EACCES;
  }
  int64_t after = -1; /* step 0 too: the validation before training */
  Distrain__V1__JobState last_state = DISTRAIN__V1__JOB_STATE__JOB_UNKNOWN;
  uint64_t last_gen = 0, placed_gen = 0, recovering_gen = 0; /* the last RECOVERING printed */
  char last_reason[512] = ""; /* a waiting job's reason changes as nodes come and go */
  int ret = 0, failures = 0;
  double ms_ewma = 0.0;
  while (!(stop && *stop)) {
    char err[512];
    Distrain__V1__GetJobRequest greq = DISTRAIN__V1__GET_JOB_REQUEST__INIT;
    greq.job_id = (char *)job_id;
    ProtobufCMessage *resp;
    int rc = dt_rpc_client_call(c, "GetJob", &greq.base, &resp, dt_ctl_rpc_timeout_ms(),
                                DT_RPC_WAIT_FOR_READY, err, sizeof err);
    if (rc != 0) {
      /* The coordinator may be restarting; give it a while before giving up. */
      if (++failures > 60) {
        fprintf(stderr, "distrainctl: lost the coordinator: %s\n", err);
        ret = rc;
        break;
      }
      usleep(500000);
      continue;
    }
    failures = 0;
    Distrain__V1__Job *j = (void *)resp;
    const int steps = j->spec->training->steps;
    const char *reason = j->reason ? j->reason : "";
    const int done = j->state == DISTRAIN__V1__JOB_STATE__JOB_COMPLETED ||
                     j->state == DISTRAIN__V1__JOB_STATE__JOB_FAILED ||
                     j->state == DISTRAIN__V1__JOB_STATE__JOB_STOPPED;
    /* A job that has ended says so after its last steps, which this poll's metrics may hold. */
    const int changed = j->state != last_state || j->generation != last_gen ||
                        ((j->state == DISTRAIN__V1__JOB_STATE__JOB_PENDING ||
                          j->state == DISTRAIN__V1__JOB_STATE__JOB_RECOVERING) &&
                         strncmp(reason, last_reason, sizeof last_reason - 1) != 0);
    /* A restart between two polls: the RECOVERING state it went through, with its cause. */
    if (last_gen && j->generation > last_gen && recovering_gen != j->generation - 1 &&
        j->state != DISTRAIN__V1__JOB_STATE__JOB_RECOVERING && j->last_restart[0] && !o->json)
      fprintf(stderr, "[%s] %s (generation %llu): %s\n", job_id,
              dt_ctl_state_name(DISTRAIN__V1__JOB_STATE__JOB_RECOVERING),
              (unsigned long long)j->generation - 1, j->last_restart);
    if (changed && !done && !o->json)
      dt_ctl_print_transition(stderr, job_id, j, &placed_gen);
    if (changed) {
      if (j->state == DISTRAIN__V1__JOB_STATE__JOB_RECOVERING)
        recovering_gen = j->generation;
      last_state = j->state;
      last_gen = j->generation;
      snprintf(last_reason, sizeof last_reason, "%s", reason);
    }
    Distrain__V1__GetJobMetricsRequest mreq = DISTRAIN__V1__GET_JOB_METRICS_REQUEST__INIT;
    mreq.job_id = (char *)job_id;
    mreq.after_step = after;
    ProtobufCMessage *mresp;
    if (dt_rpc_client_call(c, "GetJobMetrics", &mreq.base, &mresp, dt_ctl_rpc_timeout_ms(), 0, err,
                           sizeof err) == 0) {
      Distrain__V1__GetJobMetricsResponse *m = (void *)mresp;
      const int every = steps >= 20 ? steps / 20 : 1;
      for (size_t i = 0; i < m->n_metrics; i++) {
        const Distrain__V1__StepMetrics *s = m->metrics[i];
        if (mf)
          write_metric(mf, s);
        after = s->step;
        char val[1024];
        fmt_val(val, sizeof val, s);
        if (s->has_eval)
          snprintf(val + strlen(val), sizeof val - strlen(val), " | eval acc_norm %.4f",
                   s->eval_acc_norm);
        if (s->step == 0) {
          if (!o->json)
            fprintf(stderr, "step %6d/%d%s (before training)\n", 0, steps, val);
          continue;
        }
        ms_ewma = ms_ewma > 0 ? 0.9 * ms_ewma + 0.1 * s->ms : s->ms;
        if (!o->json && (s->has_val || s->n_val_sets || s->has_eval || s->step % every == 0 ||
                         s->step == steps)) {
          char eta[32];
          fmt_duration(eta, sizeof eta, (steps - s->step) * ms_ewma / 1000.0);
          char mfu[32] = "", src[DT_BLEND_MAX * (DT_NAME_MAX + 16)];
          if (s->mfu > 0)
            snprintf(mfu, sizeof mfu, " | MFU %.1f%%", 100 * s->mfu);
          fmt_sources(src, sizeof src, s);
          fprintf(stderr, "step %6lld/%d | loss %.4f%s%s | %8.0f tok/s%s | ETA %s\n",
                  (long long)s->step, steps, s->loss, src, val, s->tokens_per_s, mfu, eta);
        }
      }
      if (mf)
        fflush(mf);
      protobuf_c_message_free_unpacked(mresp, NULL);
    }
    if (done) {
      if (changed && !o->json)
        dt_ctl_print_transition(stderr, job_id, j, &placed_gen);
      if (o->json)
        dt_ctl_print_job(stdout, j, 1);
      ret = j->state == DISTRAIN__V1__JOB_STATE__JOB_COMPLETED ? 0 : 1;
      protobuf_c_message_free_unpacked(resp, NULL);
      break;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    if (o->on_poll)
      o->on_poll(o->on_poll_ud);
    usleep((useconds_t)dt_param_CtlPollMs() * 1000);
  }
  if (mf)
    fclose(mf);
  return stop && *stop ? 1 : ret;
}
