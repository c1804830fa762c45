/* trainer.c — the single-process training loop (see trainer.h).
 *
 * Order of one step, identical to PyTorch's reference loop:
 *   zero_grad; K x (next micro-batch; forward+backward of loss/K); global grad norm;
 *   clip scale = min(1, clip/(norm+1e-6)); AdamW at lr(step); then validation and checkpoint.
 * A non-finite loss or gradient norm stops the run before the update, so no checkpoint ever
 * holds NaN weights. */
#include "trainer.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "checkpoint.h"
#include "dataloader.h"
#include "dp.h"
#include "dt_log.h"
#include "dt_util.h"
#include "link.h"
#include "rng.h"

/* OpenBLAS's own thread control (not in cblas.h of every build). */
extern void openblas_set_num_threads(int num_threads);

double dt_lr_at(const dt_lr_schedule_t *sch, int s)
{
  if (s < sch->warmup)
    return sch->lr * (double)(s + 1) / (double)sch->warmup;
  if (sch->schedule == DT_SCHEDULE_CONSTANT || sch->total_steps <= sch->warmup)
    return sch->lr;
  double ratio = (double)(s - sch->warmup) / (double)(sch->total_steps - sch->warmup);
  if (ratio > 1.0)
    ratio = 1.0;
  double min_lr = sch->lr * sch->min_lr_frac;
  return min_lr + 0.5 * (1.0 + cos(M_PI * ratio)) * (sch->lr - min_lr);
}

void dt_train_opts_default(dt_train_opts_t *o)
{
  memset(o, 0, sizeof *o);
  o->model = (dt_gpt2_config_t){
      .max_seq = 256, .vocab = 256, .padded_vocab = 256, .layers = 4, .heads = 4, .channels = 256};
  o->seed = 1337;
  o->val_every = 0;
  o->val_batches = 20;
  o->batch = 8;
  o->seq = 256;
  o->grad_accum = 1;
  o->steps = 100;
  o->sched = (dt_lr_schedule_t){.lr = 3e-4,
                                .min_lr_frac = 0.0,
                                .warmup = 0,
                                .total_steps = 100,
                                .schedule = DT_SCHEDULE_CONSTANT};
  o->beta1 = 0.9f;
  o->beta2 = 0.95f;
  o->eps = 1e-8f;
  o->weight_decay = 0.0f;
  o->grad_clip = 0.0f;
  o->keep = 0;
  o->sample_temp = 0.8f;
}

int dt_train_opts_validate(const dt_train_opts_t *o, char *why, size_t n)
{
  const char *msg = NULL;
  if (!o->train_pattern)
    msg = "--train is required";
  else if (o->batch < 1)
    msg = "--batch must be >= 1";
  else if (o->seq < 1)
    msg = "--seq must be >= 1";
  else if (o->grad_accum < 1)
    msg = "--grad-accum must be >= 1";
  else if (o->steps < 0)
    msg = "--steps must be >= 0";
  else if (!(o->sched.lr >= 0.0))
    msg = "--lr must be >= 0";
  else if (o->sched.warmup < 0)
    msg = "--warmup must be >= 0";
  else if (!(o->sched.min_lr_frac >= 0.0 && o->sched.min_lr_frac <= 1.0))
    msg = "--min-lr-frac must be in [0, 1]";
  else if (!(o->beta1 >= 0.0f && o->beta1 < 1.0f) || !(o->beta2 >= 0.0f && o->beta2 < 1.0f))
    msg = "--beta1/--beta2 must be in [0, 1)";
  else if (!(o->eps > 0.0f))
    msg = "--eps must be > 0";
  else if (!(o->weight_decay >= 0.0f))
    msg = "--weight-decay must be >= 0";
  else if (!(o->grad_clip >= 0.0f))
    msg = "--grad-clip must be >= 0 (0 disables clipping)";
  else if (o->save_every < 0 || o->keep < 0 || o->val_every < 0 || o->val_batches < 1)
    msg = "--save-every, --keep and --val-every must be >= 0, --val-batches >= 1";
  else if (o->save_every > 0 && !o->ckpt_dir)
    msg = "--save-every needs --ckpt-dir";
  else if (o->resume && !o->ckpt_dir && !o->resume_path)
    msg = "--resume needs --ckpt-dir (or a path)";
  else if (o->val_every > 0 && !o->val_pattern)
    msg = "--val-every needs --val";
  else if (o->init_llmc && o->resume)
    msg = "--init llmc:PATH and --resume are mutually exclusive";
  else if (o->sample_tokens < 0 || !(o->sample_temp > 0.0f))
    msg = "--sample must be >= 0 and --sample-temp > 0";
  else if (o->threads < 0)
    msg = "--threads must be >= 0";
  else if (o->stop_at < 0)
    msg = "--stop-at must be >= 0";
  else if (o->zero_stage < 0 || o->zero_stage > 3)
    msg = "--zero-stage must be 0, 1, 2 or 3";
  if (msg) {
    snprintf(why, n, "%s", msg);
    return DT_EINVAL;
  }
  return 0;
}

/* Explicitly given model flags must agree with the config a file brings. */
static int check_model_flags(const dt_train_opts_t *o, const dt_gpt2_config_t *file,
                             const char *path)
{
  struct {
    int bit;
    const char *flag;
    int given, have;
  } f[] = {{DT_MODEL_LAYERS, "--layers", o->model.layers, file->layers},
           {DT_MODEL_HEADS, "--heads", o->model.heads, file->heads},
           {DT_MODEL_CHANNELS, "--channels", o->model.channels, file->channels},
           {DT_MODEL_VOCAB, "--vocab", o->model.vocab, file->vocab},
           {DT_MODEL_MAXSEQ, "--max-seq", o->model.max_seq, file->max_seq}};
  for (size_t i = 0; i < DT_ARRAY_SIZE(f); i++) {
    if ((o->model_set_mask & f[i].bit) && f[i].given != f[i].have) {
      DT_ERROR(TRAIN, "%s: checkpoint has %s %d but %d was given", path, f[i].flag + 2, f[i].have,
               f[i].given);
      return DT_ESHAPE;
    }
  }
  return 0;
}

/* A fresh run must not clobber an earlier run's checkpoints, and the directory must be
 * writable before the first step is spent. */
static int prepare_ckpt_dir(const char *dir, int resuming)
{
  int rc = dt_mkdir_p(dir);
  if (rc != 0) {
    DT_ERROR(CKPT, "%s: cannot create checkpoint directory: %s", dir, dt_strerror(rc));
    return rc;
  }
  char probe[4200];
  snprintf(probe, sizeof probe, "%s/.write-probe.%ld", dir, (long)getpid());
  FILE *fp = fopen(probe, "wb");
  if (!fp || fclose(fp) != 0) {
    DT_ERROR(CKPT, "%s: checkpoint directory is not writable", dir);
    return DT_EACCES;
  }
  unlink(probe);
  int64_t step;
  if (!resuming && dt_ckpt_latest(dir, &step) == 0) {
    DT_ERROR(CKPT,
             "%s already holds a committed checkpoint (step %lld): pass --resume to "
             "continue it, or use another --ckpt-dir",
             dir, (long long)step);
    return DT_EEXIST;
  }
  return 0;
}

/* Mean validation loss over the first batches of the validation set; each data-parallel rank
 * takes its slice of every window and the result is averaged over the ranks. */
static int evaluate(dt_gpt2_t *m, dt_dp_t *dp, dt_dataloader_t *val, int batches, float *out)
{
  int64_t avail = dt_dataloader_epoch_windows(val);
  int n = batches < avail ? batches : (int)avail;
  double acc = 0.0;
  DT_CHECK(dt_dataloader_reset(val));
  for (int i = 0; i < n; i++) {
    float loss;
    DT_CHECK(dt_dataloader_next(val));
    DT_CHECK(dt_gpt2_eval_loss(m, val->inputs, val->targets, val->B, val->T, &loss));
    acc += loss;
  }
  *out = (float)(acc / n);
  return dt_dp_average(dp, out);
}

/* Multinomial sampling with temperature from the last position's logits. */
static int sample_token(const float *logits, int V, float temp, dt_rng_t *rng)
{
  float maxv = -INFINITY;
  for (int j = 0; j < V; j++)
    maxv = logits[j] > maxv ? logits[j] : maxv;
  double sum = 0.0;
  for (int j = 0; j < V; j++)
    sum += exp((logits[j] - maxv) / temp);
  double u = (double)dt_rng_uniform(rng) * sum, cdf = 0.0;
  for (int j = 0; j < V; j++) {
    cdf += exp((logits[j] - maxv) / temp);
    if (u < cdf)
      return j;
  }
  return V - 1;
}

static void print_token(FILE *out, int tok, int byte_vocab)
{
  if (!byte_vocab)
    fprintf(out, "[%d]", tok);
  else
    fputc(tok, out);
}

/* Generates n tokens after a prompt taken from the start of the given batch; prints them
 * when print is set (every data-parallel rank runs the same sampling). */
static int generate(dt_gpt2_t *m, const int *prompt, int plen, int n, float temp, dt_rng_t *rng,
                    int print)
{
  const int T = m->acts.T, V = m->cfg.vocab, byte_vocab = m->cfg.vocab == 256;
  int *ctx = calloc((size_t)(plen + n), sizeof(int));
  int ret = 0;
  if (!ctx)
    return DT_ENOMEM;
  memcpy(ctx, prompt, (size_t)plen * sizeof(int));
  if (print) {
    fprintf(stdout, "---- sample (temperature %.2f) ----\n", temp);
    for (int i = 0; i < plen; i++)
      print_token(stdout, ctx[i], byte_vocab);
  }
  for (int len = plen; len < plen + n; len++) {
    int start = len > T ? len - T : 0;
    int tlen = len - start;
    DT_CHECK_GOTO(dt_gpt2_forward(m, ctx + start, 1, tlen), ret, out);
    int tok = sample_token(m->acts.logits + (size_t)(tlen - 1) * m->cfg.padded_vocab, V, temp, rng);
    ctx[len] = tok;
    if (print) {
      print_token(stdout, tok, byte_vocab);
      fflush(stdout);
    }
  }
  if (print) {
    fprintf(stdout, "\n---- end of sample ----\n");
    fflush(stdout);
  }
out:
  free(ctx);
  return ret;
}

static double peak_rss_mb(void)
{
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_maxrss / 1024.0;
}

static void write_metrics(FILE *fp, const dt_step_metrics_t *s)
{
  fprintf(fp,
          "{\"step\": %lld, \"loss\": %.9g, \"lr\": %.9g, \"grad_norm\": %.9g, \"ms\": %.3f, "
          "\"tokens_per_s\": %.1f, \"comm_ms\": %.3f",
          (long long)s->step, s->loss, s->lr, s->grad_norm, s->ms, s->tokens_per_s, s->comm_ms);
  if (s->has_val)
    fprintf(fp, ", \"val_loss\": %.9g", s->val_loss);
  fprintf(fp, "}\n");
  fflush(fp);
}

/* Writes this process's shard of the step just completed and commits the step: itself when
 * standalone (rank 0, after collecting the other writers' shard reports through the key-value
 * store), through the coordinator (which writes the manifest) under one. */
static int save_checkpoint(const dt_train_opts_t *o, dt_dp_t *dp, const dt_gpt2_t *m,
                           const dt_train_state_t *state, int rank)
{
  dt_ckpt_range_t rg;
  dt_ckpt_shard_info_t info;
  int writes, writers, wrank, committed = 0;
  dt_dp_ckpt_range(dp, &rg, &writes, &writers, &wrank);
  if (!writes)
    return 0;
  DT_CHECK(dt_ckpt_write_range(&m->cfg, (int64_t)m->num_params, state, o->ckpt_dir, wrank, writers,
                               &rg, &info));
  if (dt_link_has_coordinator(o->link)) {
    DT_CHECK(dt_link_report_checkpoint(o->link, state->step, writers, &info, &committed));
  } else if (writers == 1) {
    DT_CHECK(dt_ckpt_commit(o->ckpt_dir, state->step, (int64_t)m->num_params, 1, &info));
    committed = 1;
  } else {
    char key[64];
    snprintf(key, sizeof key, "ckpt/%lld/%d", (long long)state->step, wrank);
    DT_CHECK(o->kv->put(o->kv->ud, key, &info, sizeof info));
    if (rank != 0)
      return 0;
    dt_ckpt_shard_info_t *all = calloc((size_t)writers, sizeof *all);
    if (!all)
      return DT_ENOMEM;
    int rc = 0;
    for (int r = 0; r < writers && rc == 0; r++) {
      void *val;
      size_t len;
      snprintf(key, sizeof key, "ckpt/%lld/%d", (long long)state->step, r);
      rc = o->kv->get(o->kv->ud, key, &val, &len, 600000);
      if (rc == 0 && len == sizeof *all)
        memcpy(&all[r], val, sizeof *all);
      else if (rc == 0)
        rc = DT_EFORMAT;
      if (rc == 0)
        free(val);
    }
    if (rc == 0)
      rc = dt_ckpt_commit(o->ckpt_dir, state->step, (int64_t)m->num_params, writers, all);
    free(all);
    DT_CHECK(rc);
    committed = 1;
  }
  return committed ? dt_ckpt_prune(o->ckpt_dir, o->keep) : 0;
}

/* Resolves the model config from (in order) the checkpoint to resume, the llm.c file, or the
 * options, checking that explicit flags agree with a file. */
static int resolve_config(const dt_train_opts_t *o, dt_gpt2_config_t *cfg, const char **resume_from)
{
  *resume_from = NULL;
  if (o->resume) {
    *resume_from = o->resume_path ? o->resume_path : o->ckpt_dir;
    DT_CHECK(dt_ckpt_read_config(*resume_from, cfg));
    return check_model_flags(o, cfg, *resume_from);
  }
  if (o->init_llmc) {
    DT_CHECK(dt_llmc_read_config(o->init_llmc, cfg));
    return check_model_flags(o, cfg, o->init_llmc);
  }
  *cfg = o->model;
  cfg->padded_vocab = dt_gpt2_padded_vocab(cfg->vocab);
  return 0;
}

static void print_memory(const dt_train_opts_t *o, const dt_gpt2_t *m, dt_dp_t *dp, int world)
{
  const double MiB = 1024.0 * 1024.0, P = (double)m->num_params, N = world;
  dt_dp_memory_t mem;
  dt_dp_memory(dp, &mem);
  /* The ZeRO formulas for fp32 AdamW, in bytes (16P baseline). */
  const double formula[4] = {16 * P, 8 * P + 8 * P / N, 4 * P + 12 * P / N, 16 * P / N};
  const double have = (double)(mem.params + mem.grads + mem.optim);
  DT_INFO(TRAIN,
          "memory (ZeRO-%d, dp %d): params %.2f MiB, grads %.2f MiB, optimizer %.2f MiB = %.2f MiB "
          "(formula %.2f MiB, %+.2f%%) + working %.2f MiB; activations %.1f MiB",
          o->zero_stage, world, mem.params / MiB, mem.grads / MiB, mem.optim / MiB, have / MiB,
          formula[o->zero_stage] / MiB, 100.0 * (have / formula[o->zero_stage] - 1.0),
          mem.working / MiB, m->bytes_acts / MiB);
}

int dt_train_run(const dt_train_opts_t *o)
{
  int ret = 0;
  char why[256];
  dt_gpt2_t model;
  dt_dataloader_t train, val;
  dt_train_state_t state;
  dt_dp_t *dp = NULL;
  FILE *metrics = NULL;
  const char *resume_from;
  dt_gpt2_config_t cfg;
  float *gathered = NULL;
  memset(&model, 0, sizeof model);
  memset(&train, 0, sizeof train);
  memset(&val, 0, sizeof val);
  memset(&state, 0, sizeof state);

  if (dt_train_opts_validate(o, why, sizeof why) != 0) {
    DT_ERROR(TRAIN, "%s", why);
    return DT_EINVAL;
  }
  const int rank = o->comm ? dt_comm_rank(o->comm) : 0;
  const int world = o->comm ? dt_comm_world(o->comm) : 1;
  const int lead = rank == 0; /* rank 0 reports, logs steps and writes files */
  if (world > 1 && !o->kv) {
    DT_ERROR(TRAIN, "data parallelism needs the rendezvous key-value store");
    return DT_EINVAL;
  }
  if (o->threads > 0) {
    omp_set_num_threads(o->threads);
    openblas_set_num_threads(o->threads);
  }
  DT_CHECK(resolve_config(o, &cfg, &resume_from));
  if (o->seq > cfg.max_seq) {
    DT_ERROR(TRAIN, "--seq %d exceeds the model's max_seq %d", o->seq, cfg.max_seq);
    return DT_EINVAL;
  }
  DT_CHECK(dt_gpt2_create(&model, &cfg, dt_ops_cpu()));
  if (o->init_llmc)
    DT_CHECK_GOTO(dt_llmc_load(&model, o->init_llmc), ret, out);
  else
    dt_gpt2_init_weights(&model, o->seed);
  dt_rng_seed(&state.rng, o->seed);
  state.threads = omp_get_max_threads();

  /* Each data-parallel rank reads its slice of every global window. */
  DT_CHECK_GOTO(dt_dataloader_init(&train, o->train_pattern, o->batch, o->seq, rank, world,
                                   cfg.vocab, o->shuffle, o->seed),
                ret, out);
  if (o->val_pattern)
    DT_CHECK_GOTO(
        dt_dataloader_init(&val, o->val_pattern, o->batch, o->seq, rank, world, cfg.vocab, 0, 0),
        ret, out);
  if (o->ckpt_dir)
    DT_CHECK_GOTO(prepare_ckpt_dir(o->ckpt_dir, resume_from != NULL), ret, out);
  DT_CHECK_GOTO(dt_dp_create(&dp, &model, o->comm, o->zero_stage), ret, out);
  if (resume_from) {
    DT_CHECK_GOTO(dt_dp_load(dp, resume_from, &state), ret, out);
    if (state.threads != omp_get_max_threads())
      DT_WARN(TRAIN,
              "resuming with %d threads; the checkpoint was written with %d: GEMM "
              "rounding differs, so losses match an uninterrupted run only to ~1e-6",
              omp_get_max_threads(), state.threads);
    state.threads = omp_get_max_threads();
    DT_CHECK_GOTO(dt_dataloader_seek(&train, state.data), ret, out);
  }
  DT_CHECK_GOTO(dt_gpt2_alloc_activations(&model, o->batch, o->seq), ret, out);
  if (o->metrics_path && lead) {
    metrics = fopen(o->metrics_path, resume_from ? "a" : "w");
    if (!metrics) {
      DT_ERROR(TRAIN, "%s: cannot open metrics file: %m", o->metrics_path);
      ret = DT_EACCES;
      goto out;
    }
  }

  DT_INFO(TRAIN, "model: L=%d NH=%d C=%d V=%d (Vp %d) maxT=%d, %zu parameters; %d threads",
          cfg.layers, cfg.heads, cfg.channels, cfg.vocab, cfg.padded_vocab, cfg.max_seq,
          model.num_params, omp_get_max_threads());
  print_memory(o, &model, dp, world);
  DT_INFO(TRAIN,
          "batch %d x seq %d x accum %d x dp %d = %d tokens/step; %lld windows per epoch; "
          "steps %lld..%d",
          o->batch, o->seq, o->grad_accum, world, o->batch * o->seq * o->grad_accum * world,
          (long long)dt_dataloader_epoch_windows(&train), (long long)state.step, o->steps);

  dt_lr_schedule_t sched = o->sched;
  sched.total_steps = o->steps;
  const dt_adamw_t base = {.lr = 0.0f,
                           .beta1 = o->beta1,
                           .beta2 = o->beta2,
                           .eps = o->eps,
                           .weight_decay = o->weight_decay};
  const double tokens_per_step = (double)o->batch * o->seq * o->grad_accum * world;
  if (o->val_every > 0 && state.step == 0) {
    /* The starting point, so that the fall of the validation loss is visible. */
    float v0;
    DT_CHECK_GOTO(evaluate(&model, dp, &val, o->val_batches, &v0), ret, out);
    if (!o->quiet && lead)
      DT_INFO(TRAIN, "step %5d/%d | val %.4f (before training)", 0, o->steps, v0);
    if (metrics) {
      fprintf(metrics, "{\"step\": 0, \"val_loss\": %.9g}\n", v0);
      fflush(metrics);
    }
  }
  const int end = o->stop_at > 0 && o->stop_at < o->steps ? o->stop_at : o->steps;
  while (state.step < end) {
    const int s = (int)state.step;
    double t0 = dt_now_ms();
    dt_dp_zero_grad(dp);
    double loss_acc = 0.0;
    for (int k = 0; k < o->grad_accum; k++) {
      DT_CHECK_GOTO(dt_dataloader_next(&train), ret, out);
      dt_dp_begin_micro(dp, k == o->grad_accum - 1);
      float micro_loss;
      DT_CHECK_GOTO(dt_gpt2_forward_backward(&model, train.inputs, train.targets, o->batch, o->seq,
                                             1.0f / (float)o->grad_accum, &micro_loss),
                    ret, out);
      loss_acc += micro_loss;
    }
    DT_CHECK_GOTO(dt_dp_reduce_grads(dp), ret, out);
    float loss = (float)(loss_acc / o->grad_accum), norm;
    DT_CHECK_GOTO(dt_dp_average(dp, &loss), ret, out);
    DT_CHECK_GOTO(dt_dp_grad_norm(dp, &norm), ret, out);
    if (!isfinite(loss) || !isfinite(norm)) {
      DT_ERROR(TRAIN,
               "step %d: loss %g, gradient norm %g: training diverged (non-finite); "
               "stopping before the update, last checkpoint kept",
               s + 1, loss, norm);
      ret = DT_ENAN;
      goto out;
    }
    float scale = 1.0f;
    if (o->grad_clip > 0.0f) {
      scale = o->grad_clip / (norm + 1e-6f);
      scale = scale > 1.0f ? 1.0f : scale;
    }
    dt_adamw_t h = base;
    double lr = dt_lr_at(&sched, s);
    h.lr = (float)lr;
    DT_CHECK_GOTO(dt_dp_step(dp, &h, scale, s + 1), ret, out);
    state.step = s + 1;
    state.data = train.pos;
    double ms = dt_now_ms() - t0;

    dt_step_metrics_t sm = {.step = state.step,
                            .loss = loss,
                            .grad_norm = norm,
                            .lr = lr,
                            .ms = ms,
                            .tokens_per_s = tokens_per_step * 1000.0 / ms,
                            .comm_ms = dt_dp_take_comm_ms(dp)};
    const int last = state.step == end;
    if (o->val_every > 0 && (state.step % o->val_every == 0 || last)) {
      sm.has_val = 1;
      DT_CHECK_GOTO(evaluate(&model, dp, &val, o->val_batches, &sm.val_loss), ret, out);
    }
    if (lead) {
      if (!o->quiet) {
        char valbuf[48] = "";
        if (sm.has_val)
          snprintf(valbuf, sizeof valbuf, " | val %.4f", sm.val_loss);
        DT_INFO(TRAIN, "step %5lld/%d | loss %.6f%s | lr %.3e | norm %.4f | %.1f ms | %.0f tok/s",
                (long long)state.step, o->steps, loss, valbuf, lr, norm, ms, sm.tokens_per_s);
      }
      if (metrics)
        write_metrics(metrics, &sm);
      if (o->on_step)
        o->on_step(o->on_step_ud, &sm);
      if (o->link)
        dt_link_step(o->link, &sm);
    }
    if (o->ckpt_dir && ((o->save_every > 0 && state.step % o->save_every == 0) || last))
      DT_CHECK_GOTO(save_checkpoint(o, dp, &model, &state, rank), ret, out);
  }
  if (o->export_llmc) {
    gathered = malloc(model.num_params * sizeof(float));
    if (!gathered) {
      ret = DT_ENOMEM;
      goto out;
    }
    DT_CHECK_GOTO(dt_dp_gather_params(dp, gathered), ret, out);
    if (lead) {
      DT_CHECK_GOTO(dt_llmc_save_params(&cfg, gathered, model.num_params, o->export_llmc), ret,
                    out);
      DT_INFO(TRAIN, "exported llm.c checkpoint %s", o->export_llmc);
    }
  }
  if (o->sample_tokens > 0) {
    /* Every rank generates (ZeRO-3 forwards are collective); rank 0 prints. */
    dt_dataloader_t *src = o->val_pattern ? &val : &train;
    DT_CHECK_GOTO(dt_dataloader_reset(src), ret, out);
    DT_CHECK_GOTO(dt_dataloader_next(src), ret, out);
    int plen = o->seq < 32 ? o->seq : 32;
    DT_CHECK_GOTO(
        generate(&model, src->inputs, plen, o->sample_tokens, o->sample_temp, &state.rng, lead),
        ret, out);
  }
  DT_INFO(TRAIN, "done: %lld steps, peak RSS %.1f MiB", (long long)state.step, peak_rss_mb());
out:
  free(gathered);
  if (metrics)
    fclose(metrics);
  dt_dp_destroy(dp);
  dt_dataloader_free(&train);
  dt_dataloader_free(&val);
  dt_gpt2_destroy(&model);
  return ret;
}
