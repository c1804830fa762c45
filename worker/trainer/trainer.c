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
#include <pthread.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "blend.h"
#include "checkpoint.h"
#include "dataloader.h"
#include "evalset.h"
#include "devices.h"
#include "dp.h"
#include "plan.h"
#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"
#include "link.h"
#include "rng.h"
#include "pipeline.h"
#include "profile.h"
#include "schedule.h"
#include "stop.h"
#include "tokenizer.h"
#include "hf.h"
#include "jobspec.h"

/* --spike-factor (--grad-spike-factor): a step's loss (global gradient norm, before clipping)
 * against the average of the recent steps', their mean over the first SPIKE_HORIZON updated
 * steps and then an exponential moving average giving the newest 1/SPIKE_HORIZON of the weight
 * (about the last SPIKE_HORIZON steps). It is kept in the checkpoints (dt_train_state_t), so a
 * resumed run judges each step as the uninterrupted run would; the guard is armed once
 * SPIKE_HORIZON steps are in it. Skipped steps add nothing. */
#define SPIKE_HORIZON 50

/* How long a rank waits for its peers, at rendezvous and inside a collective. */
DT_PARAM(CommTimeoutMs, "COMM_TIMEOUT_MS", 300000)
/* Fault injection (tests): the loss of this step becomes NaN on every rank. */
DT_PARAM(FaultNanStep, "FAULT_NAN_STEP", 0)
/* Fault injection (tests): every step of this trainer takes this much longer (a straggler). */
DT_PARAM(FaultSlowMs, "FAULT_SLOW_MS", 0)
/* Fault injection (tests): this trainer's save of this step (-1: of every step) finds its disk
 * full, the first time it is written. */
DT_PARAM(FaultNoSpaceStep, "FAULT_NOSPACE_STEP", 0)

/* OpenBLAS's own thread control (not in cblas.h of every build). */
extern void openblas_set_num_threads(int num_threads);

double dt_lr_at(const dt_lr_schedule_t *sch, int s)
{
  if (s < sch->warmup)
    return sch->lr * (double)(s + 1) / (double)sch->warmup;
  const int D = sch->total_steps - sch->warmup;
  if (sch->schedule == DT_SCHEDULE_CONSTANT || D <= 0)
    return sch->lr;
  const double min_lr = sch->lr * sch->min_lr_frac;
  double p = (double)(s - sch->warmup) / (double)D;
  if (sch->schedule == DT_SCHEDULE_WSD) {
    const int decay = DT_MAX((int)lround(sch->decay_frac * D), 1);
    p = (double)(s - (sch->total_steps - decay)) / (double)decay;
    if (p < 0.0)
      return sch->lr; /* the stable phase */
  }
  p = DT_MIN(p, 1.0);
  if (sch->schedule == DT_SCHEDULE_COSINE)
    return min_lr + 0.5 * (1.0 + cos(M_PI * p)) * (sch->lr - min_lr);
  return min_lr + (1.0 - p) * (sch->lr - min_lr); /* linear, and wsd's decay */
}

int dt_lr_schedule_parse(const char *name, dt_schedule_t *out)
{
  static const char *const names[] = {"constant", "cosine", "linear", "wsd"}; /* by value */
  for (int i = 0; i < (int)(sizeof names / sizeof *names); i++)
    if (strcmp(name, names[i]) == 0) {
      *out = (dt_schedule_t)i;
      return 0;
    }
  return -1;
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
                                .decay_frac = 0.2,
                                .warmup = 0,
                                .total_steps = 100,
                                .schedule = DT_SCHEDULE_CONSTANT};
  o->beta1 = 0.9f;
  o->beta2 = 0.95f;
  o->eps = 1e-8f;
  o->weight_decay = 0.0f;
  o->grad_clip = 0.0f;
  o->keep = 0;
  o->last_save_wait = 600;
  o->pp_schedule = DT_PIPE_1F1B;
  o->sample_temp = 0.8f;
  o->sample_top_p = 1.0f;
  o->spike_skip = 1;
}

int dt_train_opts_validate(const dt_train_opts_t *o, char *why, size_t n)
{
  const char *msg = NULL;
  if (!o->train_pattern && o->steps > 0)
    msg = "--train is required (only a run of --steps 0, which evaluates or samples a model as "
          "it is, goes without)";
  else if (!o->train_pattern && !o->val_pattern && o->sample_tokens > 0 && !o->prompt)
    msg = "--sample needs --prompt, or --train or --val: its prompt is then their first sequence";
  else if (o->prompt && (!*o->prompt || o->sample_tokens == 0))
    msg = "--prompt needs --sample N (the tokens to generate after it) and a text";
  else if (o->merge_file && !o->vocab_file)
    msg = "--merge-file needs --vocab-file (GPT-2's BPE is the two files)";
  else if (o->prompt && o->vocab_file && !o->merge_file)
    msg = "--prompt with --vocab-file needs --merge-file too: encoding text takes GPT-2's merges";
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
  else if (!(o->sched.decay_frac > 0.0 && o->sched.decay_frac <= 1.0))
    msg = "--decay-frac must be in (0, 1]";
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
  else if (o->save_every_s < 0 || (o->save_every_s > 0 && !o->ckpt_dir))
    msg = "--save-every-s must be >= 0 and needs --ckpt-dir (0: saves by steps only)";
  else if (o->last_save_wait < 0 || o->last_save_wait > 86400)
    msg = "--last-save-wait must be in [0, 86400] s (0: a last save that finds its disk full "
          "fails the run at once)";
  else if (o->keep_every < 0)
    msg = "--keep-every must be >= 0 (0: no step is kept beyond the newest --keep)";
  else if (o->keep_every > 0 && (o->save_every == 0 || o->keep_every % o->save_every != 0))
    msg = "--keep-every must be a multiple of --save-every: only the steps saved can be kept";
  else if (o->resume && !o->ckpt_dir && !o->resume_path)
    msg = "--resume needs --ckpt-dir (or a path)";
  else if (o->val_every > 0 && !o->val_pattern && !o->val_sets)
    msg = "--val-every needs --val or --val-sets";
  else if (o->val_sets && o->val_every == 0)
    msg = "--val-sets needs --val-every: the sets are validated every --val-every steps";
  else if (o->eval_every < 0)
    msg = "--eval-every must be >= 0 (0: before training and after the last step only)";
  else if ((o->eval_every > 0 || o->eval_out) && !o->eval_path)
    msg = "--eval-every and --eval-out need --eval";
  else if ((o->init_llmc || o->init_hf || o->init_ckpt) && o->resume)
    msg = "--init llmc:PATH, hf:DIR or ckpt:DIR and --resume are mutually exclusive (--resume "
          "goes on with a checkpoint's optimizer, step and data; --init ckpt: takes its weights "
          "only)";
  else if (o->sample_tokens < 0 || !(o->sample_temp > 0.0f))
    msg = "--sample must be >= 0 and --sample-temp > 0";
  else if (o->sample_top_k < 0 || !(o->sample_top_p > 0.0f && o->sample_top_p <= 1.0f))
    msg = "--sample-top-k must be >= 0 (0: off) and --sample-top-p in (0, 1] (1: off)";
  else if ((o->sample_top_k > 0 || o->sample_top_p < 1.0f) && o->sample_tokens == 0)
    msg = "--sample-top-k and --sample-top-p need --sample N (the tokens to generate)";
  else if (o->sample_no_cache && o->sample_tokens == 0)
    msg = "--sample-no-cache needs --sample N (the tokens to generate)";
  else if (o->sample_every < 0)
    msg = "--sample-every must be >= 0 (0: a sample at the end only)";
  else if (o->sample_every > 0 && o->sample_tokens == 0)
    msg = "--sample-every needs --sample N (the tokens to generate)";
  else if (o->sample_every > 0 && !o->prompt && !o->val_pattern)
    msg = "--sample-every needs --prompt or --val: the samples' prompt (the first sequence of "
          "--val, as the training data's position must not move)";
  else if (!(o->spike_factor == 0.0 || (o->spike_factor > 1.0 && isfinite(o->spike_factor))))
    msg = "--spike-factor must be > 1 (0: off)";
  else if (!(o->grad_spike_factor == 0.0 ||
             (o->grad_spike_factor > 1.0 && isfinite(o->grad_spike_factor))))
    msg = "--grad-spike-factor must be > 1 (0: off)";
  else if (o->spike_skip < 1 || o->spike_skip > DT_SPIKE_SKIP_MAX)
    msg = "--spike-skip must be in [1, 10000]";
  else if (o->spike_skip > 1 && o->spike_factor == 0.0 && o->grad_spike_factor == 0.0)
    msg = "--spike-skip needs --spike-factor or --grad-spike-factor";
  else if (o->threads < 0)
    msg = "--threads must be >= 0";
  else if (o->precision && strcmp(o->precision, "fp32") && strcmp(o->precision, "bf16"))
    msg = "--precision: expected fp32 or bf16";
  else if (o->attention && strcmp(o->attention, "flash") && strcmp(o->attention, "materialized"))
    msg = "--attention: expected flash or materialized";
  else if (o->comm && strcmp(o->comm, "auto") && strcmp(o->comm, "cpu") && strcmp(o->comm, "nccl"))
    msg = "--comm: expected cpu, nccl or auto";
  else if (o->comm && strcmp(o->comm, "nccl") == 0 && !dt_comm_has_backend("nccl"))
    msg = "--comm nccl: this distrain-train was built without NCCL (not found at configure "
          "time); use --comm cpu";
  else if (!(o->peak_tflops >= 0.0 && o->peak_tflops < 1e9))
    msg = "--peak-tflops must be a number of TFLOP/s >= 0 (0: a known GPU's)";
  else if (o->stop_at < 0)
    msg = "--stop-at must be >= 0";
  else if (o->zero_stage < 0 || o->zero_stage > 3)
    msg = "--zero-stage must be 0, 1, 2 or 3";
  if (msg) {
    snprintf(why, n, "%s", msg);
    return DT_EINVAL;
  }
  const char *const shards[][2] = {{"--train", o->train_pattern}, {"--val", o->val_pattern}};
  for (size_t i = 0; i < DT_ARRAY_SIZE(shards); i++) {
    dt_blend_t b;
    char bad[512] = "out of memory";
    if (!dt_blend_is(shards[i][1]))
      continue;
    const int rc = dt_blend_parse(shards[i][1], &b, bad, sizeof bad);
    dt_blend_free(&b);
    if (rc != 0) {
      snprintf(why, n, "%s %s: %s (a blend is WEIGHT:GLOB,WEIGHT:GLOB,...)", shards[i][0],
               shards[i][1], bad);
      return rc;
    }
  }
  if (o->val_sets) {
    dt_valsets_t v;
    char bad[512] = "out of memory";
    const int rc = dt_valsets_parse(o->val_sets, &v, bad, sizeof bad);
    dt_valsets_free(&v);
    if (rc != 0) {
      snprintf(why, n, "--val-sets %s: %s (validation sets are NAME=GLOB,NAME=GLOB,...)",
               o->val_sets, bad);
      return rc;
    }
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
static int prepare_ckpt_dir(const char *dir, int resuming, int in_job)
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
    if (in_job) /* the flags are the coordinator's: say it in the job spec's terms */
      DT_ERROR(CKPT,
               "%s already holds a committed checkpoint (step %lld): set the job's model.init "
               "to \"%s\" to continue it, or use another checkpoint.dir",
               dir, (long long)step, dir);
    else
      DT_ERROR(CKPT,
               "%s already holds a committed checkpoint (step %lld): pass --resume to "
               "continue it, or use another --ckpt-dir",
               dir, (long long)step);
    return DT_EEXIST;
  }
  return 0;
}

/* Deletes the step directories an earlier run left without committing them (its writers killed
 * mid-save): each may hold a whole checkpoint's worth of shards that nothing will read. Rank 0,
 * before the first step, when no save of this run can be in flight; an earlier generation's
 * writers can no longer commit (the coordinator takes the current generation's reports only). */
static int discard_incomplete(const char *dir)
{
  int64_t *steps;
  int n;
  DT_CHECK(dt_ckpt_discard_incomplete(dir, &steps, &n));
  char which[128] = "";
  if (n > 1)
    snprintf(which, sizeof which, "%d incomplete saves, of steps %lld to %lld,", n,
             (long long)steps[0], (long long)steps[n - 1]);
  else if (n == 1)
    snprintf(which, sizeof which, "the incomplete save of step %lld", (long long)steps[0]);
  if (n > 0)
    DT_WARN(CKPT, "%s: deleted %s that an earlier run left (no MANIFEST: stopped mid-save)", dir,
            which);
  free(steps);
  return 0;
}

/* Warns before the first step (from `step`, of a model of `params` parameters) where the
 * checkpoint directory's filesystem cannot hold the checkpoints the run will keep: each holds every
 * parameter's weight and two AdamW moments in fp32 (12 bytes a parameter over all the shards), and
 * --keep K holds K + 1 at once while the newest is written (pruned after its commit; 0: all of
 * them; milestones not counted). A warning, not an error: a shared filesystem's free space moves,
 * and space may be freed before the run needs it; a save that finds it full is skipped (no_space)
 * and only the last one's failure fails the run. */
static void check_ckpt_space(const dt_train_opts_t *o, int64_t step, int64_t params)
{
  struct statvfs fs;
  if (statvfs(o->ckpt_dir, &fs) != 0)
    return;
  const int64_t left = DT_MAX(0, o->steps - step);
  const int64_t saves = (o->save_every > 0 ? left / o->save_every : 0) + 1; /* and the last */
  /* Saves by time (--save-every-s) are not counted but where --keep bounds them. */
  const int64_t held = o->keep > 0 && o->save_every_s > 0 ? (int64_t)o->keep + 1
                       : o->keep > 0                      ? DT_MIN(saves, (int64_t)o->keep + 1)
                                                          : saves;
  const double each = 12.0 * (double)params;
  const double room = (double)fs.f_bavail * fs.f_frsize, need = (double)held * each;
  if (room >= need)
    return;
  const double unit = need >= (1 << 30) ? 1 << 30 : 1 << 20;
  const char *u = unit > (1 << 20) ? "GiB" : "MiB";
  DT_WARN(
      CKPT,
      "%s: %.2f %s free, but each checkpoint takes %.2f %s (the weights and AdamW's two "
      "moments in fp32) and this run holds up to %lld at once (--keep %d%s): %.2f %s. Saves that "
      "find the disk full are skipped; the last one waits for room (--last-save-wait) and the "
      "run fails if none comes: free space, lower --keep (checkpoint.keep) or use another "
      "--ckpt-dir",
      o->ckpt_dir, room / unit, u, each / unit, u, (long long)held, o->keep,
      o->keep > 0 ? "" : ": all", need / unit, u);
}

/* ------------------------------------------------------------------------------------------ */
/* The trainer: setup, step, eval, finish                                                      */
/* ------------------------------------------------------------------------------------------ */

/* A device's memory as a communicator sees it (dt_comm_set_device). */
static int comm_is_device(void *ud, const void *p)
{
  dt_device_t *dev = ud;
  return dev->owns(dev, p);
}

static int comm_copy(void *ud, void *dst, const void *src, size_t bytes, int to_host)
{
  dt_device_t *dev = ud;
  return dev->copy(dev, dst, src, bytes, to_host ? DT_COPY_D2H : DT_COPY_H2D);
}

static int comm_alloc(void *ud, size_t bytes, void **out)
{
  dt_device_t *dev = ud;
  return dev->alloc(dev, bytes, "the communicator's staging of host scalars", out);
}

static void comm_release(void *ud, void *p)
{
  dt_device_t *dev = ud;
  dev->free(dev, p);
}

static int comm_sync(void *ud)
{
  dt_device_t *dev = ud;
  return dev->sync(dev);
}

typedef struct {
  const dt_train_opts_t *o;
  dt_gpt2_config_t cfg;
  dt_device_t *dev;    /* where the model's tensors live and its kernels run */
  dt_device_t *opened; /* the device as opened: dev wraps it under --profile */
  dt_profile_t *prof;  /* --profile, else NULL */
  int prof_logged;
  dt_comm_device_t comm_dev; /* its memory, for communicators that stage it through the host */
  dt_comm_t *world;          /* NULL: one process; "cpu", for host scalars and the plan's groups */
  dt_comm_t *devworld;       /* the device's own backend ("nccl") for the plan's groups, or NULL */
  dt_plan_t plan;
  dt_gpt2_t model;
  dt_dp_t *dp;
  dt_dataloader_t train, val;
  dt_valsets_t valsets;               /* --val-sets */
  dt_dataloader_t vs[DT_VALSETS_MAX]; /* their loaders */
  int64_t vs_windows[DT_VALSETS_MAX]; /* and the global batches each is validated on */
  dt_train_state_t state;
  FILE *metrics;
  const char *resume_from;
  int lead;   /* world rank 0: reports, logs steps and writes files */
  int dprank; /* this rank's data-parallel coordinate and group size */
  int dpsize;
  /* context parallelism: the group size, this rank's chunk of every sequence (positions
   * [cprank*seq, (cprank+1)*seq)) and its local length */
  int cp, cprank, seq;
  int *cp_inputs, *cp_targets; /* (B, seq) this rank's chunk of a batch (cp > 1) */
  dt_lr_schedule_t sched;
  double tokens_per_step;
  int64_t val_windows;    /* the global batches evaluate reads: --val-batches, or fewer */
  double flops_per_token; /* the model's, forward and backward: 6 P + 12 L C T */
  double peak_flops;      /* a device's, for the MFU; 0: unknown */
  /* pipeline (pp > 1) */
  int pp, stage;               /* stages, this rank's */
  dt_pipeline_t *pipe;         /* runs this stage's schedule; NULL when pp == 1 */
  int *mb_inputs, *mb_targets; /* (K, B*seq) the step's micro-batches (this rank's chunks) */
  /* training on a blend of several sources, for its losses by source (source_losses): the
   * source of each row of the step's micro-batches, the last stage's per-token losses */
  int *mb_src;       /* (K, B) */
  float *tok_losses; /* (K, B*seq) */
  /* --bad-step skip: the steps taken without an update where they were (bad ones and their
   * windows), ascending; the newest window's last step */
  int64_t *here;
  size_t n_here, cap_here;
  int64_t here_end;
  /* checkpoint saves: the step's shard is snapshotted into snap, then written and committed
   * by a thread of its own (--ckpt-sync: by the step itself); at most one in flight */
  float *snap;
  size_t snap_cap; /* floats */
  pthread_t saver;
  int saving;
  struct save_job *save;
  int64_t unsaved_step; /* the newest save's step when it was abandoned (known here), else 0 */
  int save_try;         /* the last step's save written again: how many times (wait_for_room) */
  double shard_mib;     /* this writer's newest shard's size */
  double saved_ms;      /* when the newest save began (--save-every-s counts from it) */
  int device_logged;    /* the device memory line (device_memory) was printed */
  dt_bpe_t *bpe;        /* --vocab-file: prints the sample's tokens as text */
  int *prompt;          /* --prompt's tokens (prompt_n), or NULL */
  int prompt_n;
  dt_evalset_t evalset; /* --eval */
  int eval_T;           /* the longest window its rows are evaluated in (<= --seq) */
  int eval_unit;        /* a window's positions are a multiple of it (window_unit) */
  int *eval_order;      /* (rows) the rows, the longest first: a micro-batch's are alike */
  FILE *eval_out;       /* --eval-out (rank 0) */
} trainer_t;

/* The last stage's scalar on every stage of the pipeline. */
static int from_last_stage(trainer_t *t, float *x)
{
  return t->pp > 1 ? dt_comm_broadcast(t->plan.pp, x, 1, t->pp - 1) : 0;
}

/* This rank's two chunks of each of B sequences of T tokens into dst, half-major (2, B,
 * T/(2cp)): chunk cprank of every sequence, then chunk 2cp-1-cprank (gpt2.h, context
 * parallelism); with cp = 1 the sequences themselves. */
static const int *chunks_of(const trainer_t *t, const int *batch, int B, int T, int *dst)
{
  if (t->cp == 1)
    return batch;
  const int h = T / (2 * t->cp);
  for (int j = 0; j < 2; j++) {
    const int c = j ? 2 * t->cp - 1 - t->cprank : t->cprank;
    for (int b = 0; b < B; b++)
      memcpy(dst + ((size_t)j * B + b) * h, batch + (size_t)b * T + (size_t)c * h,
             (size_t)h * sizeof(int));
  }
  return dst;
}

/* chunks_of a training or validation batch */
static const int *seq_chunk(const trainer_t *t, const int *batch, int *dst)
{
  return chunks_of(t, batch, t->o->batch, t->o->seq, dst);
}

/* Mean validation loss over the first `windows` global batches of a validation set (its
 * windows, as training's: batch x dp x accum sequences), so that the same sequences count
 * whatever the layout; each data-parallel rank reads its slice of every window in accum
 * micro-batches of equal size, and the result is averaged over the ranks. */
static int evaluate(trainer_t *t, dt_dataloader_t *val, int64_t windows, float *out)
{
  const int n = (int)windows * t->o->grad_accum;
  double acc = 0.0;
  DT_CHECK(dt_dataloader_reset(val));
  for (int i = 0; i < n; i++) {
    float loss;
    DT_CHECK(dt_dataloader_next(val));
    const int *in = seq_chunk(t, val->inputs, t->cp_inputs);
    const int *tg = seq_chunk(t, val->targets, t->cp_targets);
    if (t->pipe)
      DT_CHECK(dt_pipeline_eval(t->pipe, &t->model, in, tg, val->B, t->seq, &loss));
    else
      DT_CHECK(dt_gpt2_stage_forward(&t->model, 0, 0, in, tg, val->B, t->seq, 0.0f, &loss));
    acc += loss;
  }
  *out = (float)(acc / n);
  DT_CHECK(from_last_stage(t, out));
  return dt_dp_average(t->dp, out);
}

/* The validation after a step (or before the first): --val's loss and each --val-sets set's. */
static int validate(trainer_t *t, dt_step_metrics_t *sm)
{
  if (t->o->val_pattern) {
    sm->has_val = 1;
    DT_CHECK(evaluate(t, &t->val, t->val_windows, &sm->val_loss));
  }
  sm->n_val_sets = t->valsets.n;
  for (int i = 0; i < t->valsets.n; i++) {
    sm->val_set_name[i] = t->valsets.name[i];
    DT_CHECK(evaluate(t, &t->vs[i], t->vs_windows[i], &sm->val_set_loss[i]));
  }
  return 0;
}

/* The step line's validation (dt_valsets_line). */
static void format_val(char *buf, size_t n, const dt_step_metrics_t *sm)
{
  dt_valsets_line(buf, n, sm->has_val ? &sm->val_loss : NULL, sm->n_val_sets, sm->val_set_name,
                  sm->val_set_loss);
}

/* ', "key": {"name": loss, ...}' of a metrics line; nothing for n = 0. */
static void write_named(FILE *fp, const char *key, const char *const *name, const float *loss,
                        int n)
{
  for (int i = 0; i < n; i++) {
    if (i == 0)
      fprintf(fp, ", \"%s\": {", key);
    else
      fputs(", ", fp);
    fprintf(fp, "\"%s\": %.9g%s", name[i], loss[i], i == n - 1 ? "}" : "");
  }
}

/* Descending, NaN last (a diverged model's logits still sort). */
static int cmp_desc(const void *pa, const void *pb)
{
  const float a = *(const float *)pa, b = *(const float *)pb;
  if (isnan(a) || isnan(b))
    return isnan(a) - isnan(b);
  return (a < b) - (a > b);
}

/* The lowest logit a token may have to be drawn (-INFINITY: any): the k-th largest under
 * top_k > 0, then, under top_p < 1, the smallest of the nucleus: the fewest most likely of those
 * tokens whose probabilities at temp (renormalized over them) sum to at least top_p. Tokens tied
 * with the cut stay in. The filters of Hugging Face's generate (top-k first, then top-p) and
 * nanoGPT's top-k. sorted: V floats of scratch. */
static float sample_cut(const float *logits, int V, float temp, int top_k, float top_p,
                        float *sorted)
{
  if ((top_k <= 0 || top_k >= V) && top_p >= 1.0f)
    return -INFINITY;
  memcpy(sorted, logits, (size_t)V * sizeof *sorted);
  qsort(sorted, (size_t)V, sizeof *sorted, cmp_desc);
  float cut = top_k > 0 && top_k < V ? sorted[top_k - 1] : -INFINITY;
  if (top_p < 1.0f) {
    double sum = 0.0, cdf = 0.0;
    int n = 0;
    for (; n < V && sorted[n] >= cut; n++)
      sum += exp((sorted[n] - sorted[0]) / temp);
    for (int i = 0; i < n; i++) {
      cdf += exp((sorted[i] - sorted[0]) / temp);
      if (cdf >= top_p * sum) {
        cut = sorted[i];
        break;
      }
    }
  }
  return cut;
}

/* Multinomial sampling with temperature from the last position's logits, among the tokens
 * sample_cut leaves. One draw from rng a token, filtered or not. */
static int sample_token(const float *logits, int V, float temp, float cut, dt_rng_t *rng)
{
  float maxv = -INFINITY;
  for (int j = 0; j < V; j++)
    maxv = logits[j] > maxv ? logits[j] : maxv;
  double sum = 0.0;
  for (int j = 0; j < V; j++)
    if (!(logits[j] < cut))
      sum += exp((logits[j] - maxv) / temp);
  double u = (double)dt_rng_uniform(rng) * sum, cdf = 0.0;
  int last = V - 1;
  for (int j = 0; j < V; j++) {
    if (logits[j] < cut)
      continue;
    cdf += exp((logits[j] - maxv) / temp);
    last = j;
    if (u < cdf)
      return j;
  }
  return last;
}

/* A sample's text as it is generated: with --vocab-file each token's bytes, with a byte-level
 * model each token as its byte, written as UTF-8: each character once its last byte is in,
 * U+FFFD for a byte that starts none (a model early in training emits any bytes; the log, and
 * the terminal or tool reading it, get valid text). Other vocabularies, and ids the
 * vocabulary file lacks, print as "[id]". */
typedef struct {
  FILE *out;
  int byte_vocab;
  const dt_bpe_t *bpe;
  unsigned char pending[4]; /* the start of a character */
  int n;
} text_out_t;

/* Writes the pending bytes that are decided; with flush, the rest too (U+FFFD each). */
static void text_drain(text_out_t *o, int flush)
{
  while (o->n > 0) {
    int len = dt_utf8_next((const char *)o->pending, (size_t)o->n);
    if (len == 0 && !flush)
      return; /* a character whose next bytes are still to come */
    if (len > 0) {
      fwrite(o->pending, 1, (size_t)len, o->out);
    } else {
      fputs("\xEF\xBF\xBD", o->out); /* U+FFFD */
      len = 1;
    }
    o->n -= len;
    memmove(o->pending, o->pending + len, (size_t)o->n);
  }
}

static void text_token(text_out_t *o, int tok)
{
  size_t len = 1;
  const unsigned char byte = (unsigned char)tok;
  const unsigned char *bytes = o->bpe ? dt_bpe_decode(o->bpe, tok, &len) : &byte;
  if (!bytes || (!o->bpe && !o->byte_vocab)) {
    text_drain(o, 1);
    fprintf(o->out, "[%d]", tok);
    return;
  }
  for (size_t i = 0; i < len; i++) { /* at most 3 bytes wait: pending never overflows */
    o->pending[o->n++] = bytes[i];
    text_drain(o, 0);
  }
}

/* The logits of local row r over the whole vocabulary into row (Vp floats), from the model's
 * last chunk (slot 0): under tensor parallelism each rank holds a slice of the columns,
 * gathered for this one row only. Under bf16 compute they are bf16 values, bf16_bytes each:
 * 2-byte ones are widened here. */
static int row_logits(dt_gpt2_t *m, int r, float *row)
{
  const dt_gpt2_acts_t *a = &m->acts[m->slot_base[m->stage.chunks - 1]];
  const size_t Vp = (size_t)m->cfg.padded_vocab, Vl = Vp / (size_t)m->tp.tp;
  const size_t vb = a->logits16 ? m->ops->bf16_bytes : sizeof(float); /* a value's bytes */
  const char *mine = (const char *)(a->logits16 ? a->logits16 : (void *)a->logits);
  mine += (size_t)r * Vl * vb;
  if (m->tp.tp == 1)
    DT_CHECK(m->dev->copy(m->dev, row, mine, Vl * vb, DT_COPY_D2H));
  else /* a row of bf16 values is a whole number of floats (dt_gpt2_set_precision) */
    DT_CHECK(dt_comm_all_gather(m->tp.comm, (const float *)mine, row, Vl * vb / sizeof(float)));
  for (size_t j = Vp; vb == 2 && j-- > 0;) { /* in place from the back: bf16 j's bits are the */
    uint16_t h;                              /* top half of float j's */
    memcpy(&h, (const char *)row + 2 * j, sizeof h);
    const uint32_t bits = (uint32_t)h << 16;
    memcpy(row + j, &bits, sizeof bits);
  }
  return 0;
}

/* Rows a window of generated text is padded to a multiple of, so that it splits as a training
 * sequence does: into 2 cp chunks under context parallelism, its rows among the tp ranks under
 * sequence parallelism. */
static int window_unit(int cp, int tp, int sp)
{
  return (cp > 1 ? 2 * cp : 1) * (sp ? tp : 1);
}

/* Whether generate feeds its tokens through the key/value cache (*cached): unless
 * --sample-no-cache, where the prompt leaves room in the window and the layout has one. print:
 * the log says which. An error only where the cache could not be allocated. */
static int cache_begin(trainer_t *t, int plen, int print, int *cached)
{
  dt_gpt2_t *m = &t->model;
  const int T = t->o->seq;
  char why[256] = "--sample-no-cache";
  int rc = DT_ENOTSUP;
  if (!t->o->sample_no_cache && plen < T)
    rc = dt_gpt2_kv_begin(m, T, why, sizeof why);
  if (rc != 0 && rc != DT_ENOTSUP) {
    DT_ERROR(TRAIN, "sample: %s", why);
    return rc;
  }
  *cached = rc == 0;
  if (print && *cached) {
    char feeds[64] = "one forward";
    if (plen > m->kv_feed)
      snprintf(feeds, sizeof feeds, "forwards of up to %d rows", m->kv_feed);
    DT_INFO(TRAIN,
            "sample: a key/value cache of %d positions (%.2f MiB): the prompt in %s, then one "
            "row a token while the text fits the window%s",
            T, (double)m->kv_bytes / 1048576.0, feeds,
            t->cp > 1 ? " (every context-parallel rank runs the whole sequence)" : "");
  } else if (print)
    DT_INFO(TRAIN, "sample: a forward of the whole window a token (%s)",
            plen >= T ? "the prompt fills the window" : why);
  return 0;
}

/* Generates n tokens after a prompt taken from the start of the given batch; prints them
 * when print is set. Every rank runs the same forwards (collective under ZeRO-3 and tensor
 * parallelism; through the stages of a pipeline, whose last one samples each token and sends
 * it to the others) and draws from the same RNG state, so the text is the one process's. Each
 * window runs padded after its end with token 0 to a multiple of window_unit (the causal mask
 * keeps the padding out of the real positions' logits; the run checked that the unit divides
 * the sequence length), split among the context-parallel ranks as training splits a sequence;
 * the one holding the window's last position samples and sends the token to the others.
 * While the text fits the window, each token is fed once instead (the prompt in forwards of
 * as many rows as the activations hold, then a row a token) through a key/value cache
 * (dt_gpt2_kv_begin), unless the device has none or --sample-no-cache turns it off: the same
 * logits up to rounding, at the cost of one position a token (under context parallelism every
 * rank runs them whole; under SP each is padded to rows the tp ranks split). during: the step a
 * --sample-every sample follows (0: the end's). */
static int generate(trainer_t *t, const int *prompt, int plen, int n, dt_rng_t *rng, int print,
                    int64_t during)
{
  const dt_train_opts_t *o = t->o;
  dt_gpt2_t *m = &t->model;
  const int T = t->o->seq, V = m->cfg.vocab, cp = t->cp;
  const int unit = window_unit(cp, m->tp.tp, m->sp);
  text_out_t text = {.out = stdout, .byte_vocab = V == 256, .bpe = t->bpe};
  int *ctx = calloc((size_t)(plen + n + unit), sizeof(int)); /* zero past the text: padding */
  float *row = calloc((size_t)m->cfg.padded_vocab, sizeof(float));
  float *sorted = malloc((size_t)V * sizeof(float));
  int ret = 0;
  if (!ctx || !row || !sorted) {
    ret = DT_ENOMEM;
    goto out;
  }
  memcpy(ctx, prompt, (size_t)plen * sizeof(int));
  int cached = 0; /* the same on every rank: a matter of the layout */
  DT_CHECK_GOTO(cache_begin(t, plen, print, &cached), ret, out);
  if (print) {
    if (during > 0) /* --sample-every */
      fprintf(stdout, "---- sample after step %lld (temperature %.2f", (long long)during,
              o->sample_temp);
    else
      fprintf(stdout, "---- sample (temperature %.2f", o->sample_temp);
    if (o->sample_top_k > 0)
      fprintf(stdout, ", top-k %d", o->sample_top_k);
    if (o->sample_top_p < 1.0f)
      fprintf(stdout, ", top-p %.2f", o->sample_top_p);
    fprintf(stdout, ") ----\n");
    for (int i = 0; i < plen; i++)
      text_token(&text, ctx[i]);
  }
  for (int len = plen; len < plen + n; len++) {
    const int start = len > T ? len - T : 0, tlen = len - start;
    const int rows = (tlen + unit - 1) / unit * unit; /* <= T */
    float unused, tok = 0.0f; /* a token id, exact in a float (V <= 65536) */
    int owner = 0, r = tlen - 1;
    if (cached && len > T) { /* the window slides: every position moves, whole windows on */
      dt_gpt2_kv_end(m);
      cached = 0;
    }
    /* the tokens not in the cache yet (the prompt at first, in pieces the activations hold,
     * then the newest), each piece padded to rows SP splits (ctx is 0 past the text) */
    while (cached && m->kv_pos < len) {
      const int pos = m->kv_pos, fed = DT_MIN(len - pos, m->kv_feed);
      const int piece = (fed + m->kv_unit - 1) / m->kv_unit * m->kv_unit;
      if (piece > m->kv_cap - pos) { /* its padding past max_seq: whole windows on */
        dt_gpt2_kv_end(m);
        cached = 0;
        break;
      }
      if (t->pipe)
        DT_CHECK_GOTO(dt_pipeline_eval(t->pipe, m, ctx + pos, NULL, 1, piece, &unused), ret, out);
      else
        DT_CHECK_GOTO(dt_gpt2_stage_forward(m, 0, 0, ctx + pos, NULL, 1, piece, 0.0f, &unused), ret,
                      out);
      DT_CHECK_GOTO(dt_gpt2_kv_seek(m, pos + fed), ret, out);
      r = fed - 1;
    }
    if (!cached) {
      const int *in = chunks_of(t, ctx + start, 1, rows, t->cp_inputs);
      if (t->pipe)
        DT_CHECK_GOTO(dt_pipeline_eval(t->pipe, m, in, NULL, 1, rows / cp, &unused), ret, out);
      else
        DT_CHECK_GOTO(dt_gpt2_stage_forward(m, 0, 0, in, NULL, 1, rows / cp, 0.0f, &unused), ret,
                      out);
    }
    /* position tlen - 1: in chunk k of 2 cp (of h positions), which this rank holds as its
     * first or second half (through the cache every rank holds it) */
    if (cp > 1 && !cached) {
      const int h = rows / (2 * cp), k = (tlen - 1) / h;
      owner = k < cp ? k : 2 * cp - 1 - k;
      r = (k < cp ? 0 : h) + (tlen - 1) % h;
    }
    if (m->stage.last && t->cprank == owner) {
      DT_CHECK_GOTO(row_logits(m, r, row), ret, out);
      const float cut =
          sample_cut(row, V, o->sample_temp, o->sample_top_k, o->sample_top_p, sorted);
      tok = (float)sample_token(row, V, o->sample_temp, cut, rng);
    } else {
      (void)dt_rng_uniform(rng); /* sample_token's one draw: the ranks' RNGs stay equal */
    }
    if (cp > 1 && m->stage.last)
      DT_CHECK_GOTO(dt_comm_broadcast(t->plan.cp, &tok, 1, owner), ret, out);
    DT_CHECK_GOTO(from_last_stage(t, &tok), ret, out);
    ctx[len] = (int)tok;
    if (print) {
      text_token(&text, ctx[len]);
      fflush(stdout);
    }
  }
  if (print) {
    text_drain(&text, 1);
    fprintf(stdout, "\n---- end of sample ----\n");
    fflush(stdout);
  }
out:
  dt_gpt2_kv_end(m);
  free(sorted);
  free(row);
  free(ctx);
  return ret;
}

/* The summed loss of each row of the eval set (a completion after its context) into sums
 * (rows). Rows go B to a micro-batch, longest first (eval_order), the micro-batches round-robin
 * over the data-parallel ranks, each micro-batch in a window of its longest row's positions
 * (rounded up to eval_unit; the rows padded with token 0 after their ends, which the causal
 * mask keeps out of their positions) split as a training sequence is: sorted, the rows of a
 * micro-batch are alike in length, and the padding computed is little. The rank that holds a
 * row's losses whole (the last stage's first tp rank; under context parallelism the first cp
 * rank, after gathering the others' chunks) adds them up in position order, as one process
 * would, and the sums reach every rank through one all-reduce in which each row has that one
 * term. */
static int eval_row_losses(trainer_t *t, float *sums)
{
  const dt_evalset_t *e = &t->evalset;
  dt_gpt2_t *m = &t->model;
  const int B = t->o->batch, cp = t->cp, unit = t->eval_unit;
  const size_t most = (size_t)B * (size_t)(t->eval_T / cp); /* a rank's positions, at most */
  const int sums_here = m->stage.last && m->tp.rank == 0 && t->cprank == 0;
  int *in = malloc((size_t)B * t->eval_T * sizeof *in);
  int *tg = malloc((size_t)B * t->eval_T * sizeof *tg);
  int *first = malloc((size_t)B * sizeof *first), *count = malloc((size_t)B * sizeof *count);
  float *losses = malloc(most * sizeof *losses);
  float *gathered = cp > 1 ? malloc(most * (size_t)cp * sizeof *gathered) : losses;
  int ret = in && tg && first && count && losses && gathered ? 0 : DT_ENOMEM;
  memset(sums, 0, (size_t)e->rows * sizeof *sums);
  for (int base = 0; ret == 0 && base < e->rows; base += B * t->dpsize) {
    const int row0 = base + t->dprank * B;
    /* this micro-batch's window: its first row's positions, the longest (eval_order) */
    const int need = row0 < e->rows ? dt_evalset_row_positions(e, t->eval_order[row0]) : 1;
    const int T = DT_MIN((need + unit - 1) / unit * unit, t->eval_T), h = T / (2 * cp);
    const size_t local = (size_t)B * (size_t)(T / cp);
    for (int b = 0; b < B; b++) {
      int *bin = in + (size_t)b * T, *btg = tg + (size_t)b * T;
      count[b] = 0;
      if (row0 + b < e->rows) {
        dt_evalset_row(e, t->eval_order[row0 + b], T, bin, btg, &first[b], &count[b]);
      } else { /* past the last row: padding, summed nowhere */
        memset(bin, 0, (size_t)T * sizeof *bin);
        memset(btg, 0, (size_t)T * sizeof *btg);
      }
    }
    const int *cin = chunks_of(t, in, B, T, t->cp_inputs);
    const int *ctg = chunks_of(t, tg, B, T, t->cp_targets);
    float unused;
    if (t->pipe)
      DT_CHECK_GOTO(dt_pipeline_eval(t->pipe, m, cin, ctg, B, T / cp, &unused), ret, out);
    else
      DT_CHECK_GOTO(dt_gpt2_stage_forward(m, 0, 0, cin, ctg, B, T / cp, 0.0f, &unused), ret, out);
    if (!m->stage.last)
      continue;
    DT_CHECK_GOTO(dt_gpt2_token_losses(m, local, losses), ret, out);
    if (cp > 1) /* rank r's chunks r and 2cp-1-r, half-major (chunks_of) */
      DT_CHECK_GOTO(dt_comm_all_gather(t->plan.cp, losses, gathered, local), ret, out);
    for (int b = 0; sums_here && b < B; b++) {
      double acc = 0.0;
      for (int p = first[b]; p < first[b] + count[b]; p++) {
        size_t at = (size_t)b * T + (size_t)p;
        if (cp > 1) {
          const int k = p / h, j = k >= cp, owner = j ? 2 * cp - 1 - k : k;
          at = (size_t)owner * local + ((size_t)j * B + (size_t)b) * (size_t)h + (size_t)(p % h);
        }
        acc += gathered[at];
      }
      if (count[b] > 0)
        sums[t->eval_order[row0 + b]] = (float)acc;
    }
  }
  if (ret == 0 && t->world)
    ret = dt_comm_all_reduce(t->world, sums, (size_t)e->rows, DT_COMM_SUM);
out:
  free(in);
  free(tg);
  free(first);
  free(count);
  if (gathered != losses)
    free(gathered);
  free(losses);
  return ret;
}

/* The multiple-choice evaluation: each example's pick is the completion with the lowest
 * total loss (acc) and the lowest mean loss over its tokens (acc_norm), the first one on a
 * tie (torch.argmin's choice). Rank 0 appends each example's losses to --eval-out. */
static int evaluate_choices(trainer_t *t, int64_t step, dt_step_metrics_t *sm)
{
  const dt_evalset_t *e = &t->evalset;
  float *sums = malloc((size_t)e->rows * sizeof *sums);
  if (!sums)
    return DT_ENOMEM;
  int ret = eval_row_losses(t, sums);
  sm->has_eval = ret == 0;
  sm->eval_n = e->n;
  sm->eval_correct = sm->eval_correct_norm = 0;
  for (int i = 0; ret == 0 && i < e->n; i++) {
    const dt_eval_example_t *x = &e->ex[i];
    int pick = 0, pick_norm = 0;
    double best = INFINITY, best_norm = INFINITY;
    for (int j = 0; j < x->nrows; j++) {
      const int tokens = e->stream[e->row[x->row0 + j]];
      const double sum = sums[x->row0 + j], mean = sum / tokens;
      if (sum < best)
        best = sum, pick = j;
      if (mean < best_norm)
        best_norm = mean, pick_norm = j;
    }
    sm->eval_correct += pick == x->label;
    sm->eval_correct_norm += pick_norm == x->label;
    if (!t->eval_out)
      continue;
    fprintf(t->eval_out, "{\"step\": %lld, \"example\": %d, \"label\": %d, \"loss_sum\": [",
            (long long)step, i, x->label);
    for (int j = 0; j < x->nrows; j++)
      fprintf(t->eval_out, "%s%.9g", j ? ", " : "", sums[x->row0 + j]);
    fprintf(t->eval_out, "], \"tokens\": [");
    for (int j = 0; j < x->nrows; j++)
      fprintf(t->eval_out, "%s%d", j ? ", " : "", e->stream[e->row[x->row0 + j]]);
    fprintf(t->eval_out, "]}\n");
  }
  if (ret == 0 && t->eval_out && fflush(t->eval_out) != 0) {
    DT_ERROR(TRAIN, "--eval-out %s: %s", t->o->eval_out, strerror(errno));
    ret = DT_EIO;
  }
  free(sums);
  return ret;
}

static void log_eval(const trainer_t *t, int64_t step, const dt_step_metrics_t *sm)
{
  if (sm->has_eval && t->lead && !t->o->quiet)
    DT_INFO(TRAIN, "step %5lld/%d | eval %s: acc_norm %.4f (%d/%d), acc %.4f (%d/%d)",
            (long long)step, t->o->steps, t->o->eval_path,
            (double)sm->eval_correct_norm / sm->eval_n, sm->eval_correct_norm, sm->eval_n,
            (double)sm->eval_correct / sm->eval_n, sm->eval_correct, sm->eval_n);
}

static double peak_rss_mb(void)
{
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_maxrss / 1024.0;
}

/* The evaluations' fields of a metrics line. */
static void write_evals(FILE *fp, const dt_step_metrics_t *s)
{
  if (s->has_val)
    fprintf(fp, ", \"val_loss\": %.9g", s->val_loss);
  write_named(fp, "val_sets", s->val_set_name, s->val_set_loss, s->n_val_sets);
  if (s->has_eval)
    fprintf(fp, ", \"eval_acc_norm\": %.6f, \"eval_acc\": %.6f, \"eval_examples\": %d",
            (double)s->eval_correct_norm / s->eval_n, (double)s->eval_correct / s->eval_n,
            s->eval_n);
}

static void write_metrics(FILE *fp, const dt_step_metrics_t *s, int pipelined)
{
  fprintf(fp,
          "{\"step\": %lld, \"loss\": %.9g, \"lr\": %.9g, \"grad_norm\": %.9g, \"ms\": %.3f, "
          "\"tokens_per_s\": %.1f, \"comm_ms\": %.3f",
          (long long)s->step, s->loss, s->lr, s->grad_norm, s->ms, s->tokens_per_s, s->comm_ms);
  write_named(fp, "loss_sources", s->source_name, s->source_loss, s->n_sources);
  write_evals(fp, s);
  if (pipelined) /* rank 0's stage: the first */
    fprintf(fp, ", \"bubble\": %.4f", s->bubble);
  if (s->device_bytes)
    fprintf(fp, ", \"device_mib\": %.1f", (double)s->device_bytes / (1 << 20));
  fprintf(fp, ", \"tflops\": %.6g", s->tflops);
  if (s->mfu > 0)
    fprintf(fp, ", \"mfu\": %.6f", s->mfu);
  fprintf(fp, "}\n");
  fflush(fp);
}

/* One shard to write and commit, with a snapshot of its data: the step goes on meanwhile. */
typedef struct save_job {
  trainer_t *t;
  dt_train_state_t state; /* of the step saved */
  dt_gpt2_run_t *runs;
  size_t nruns;
  const float *params, *m, *v; /* in t->snap */
  int64_t vlo;
  int wrank, writers, rc;
  double mib;    /* the shard's size */
  int async;     /* on a thread of its own */
  int abandoned; /* the step was not committed: a writer's disk was full (known here to the
                  * writer itself, and to the rank that completed the step: rank 0 without a
                  * coordinator, the writer whose report came last under one) */
  double t0;     /* when the save started */
} save_job_t;

/* A writer's shard, or why it could not write it, to the committing rank of a run without a
 * coordinator (through the key-value store). */
typedef struct {
  dt_ckpt_shard_info_t info;
  char error[512];
} shard_report_t;

/* Commits a step once every writer's shard is in: itself when standalone (rank 0, after
 * collecting the other writers' reports through the key-value store), through the coordinator
 * (which writes the manifest) under one. error non-NULL: this writer could not write its shard
 * (its disk full), and the step is abandoned instead: its shards are deleted. */
static int commit_checkpoint(save_job_t *j, const dt_ckpt_shard_info_t *info, const char *error,
                             int *committed)
{
  trainer_t *t = j->t;
  const dt_train_opts_t *o = t->o;
  const int64_t P = (int64_t)t->model.global_params, step = j->state.step;
  const int writers = j->writers;
  j->abandoned = error != NULL;
  if (dt_link_has_coordinator(o->link)) {
    char why[1024];
    const int rc =
        dt_link_report_checkpoint(o->link, step, writers, info, error, committed, why, sizeof why);
    if (rc == 0 && *committed < 0) { /* this report completed the step, and it is abandoned */
      j->abandoned = 1;
      *committed = 0;
      if (!error) /* a writer that failed says so itself */
        DT_WARN(CKPT, "checkpoint %s; training goes on", why);
    }
    return rc;
  }
  shard_report_t mine = {.info = *info};
  snprintf(mine.error, sizeof mine.error, "%s", error ? error : "");
  char key[64], bad[sizeof mine.error];
  memcpy(bad, mine.error, sizeof bad);
  dt_ckpt_shard_info_t *all = calloc((size_t)writers, sizeof *all);
  if (!all)
    return DT_ENOMEM;
  all[0] = *info;
  int rc = 0;
  if (writers > 1) { /* the lead collects the writers' reports */
    snprintf(key, sizeof key, "ckpt/%lld/%d/%d", (long long)step, t->save_try, j->wrank);
    rc = o->kv->put(o->kv->ud, key, &mine, sizeof mine);
    if (!t->lead) {
      free(all);
      return rc;
    }
    for (int r = 0; r < writers && rc == 0; r++) {
      void *val;
      size_t len;
      snprintf(key, sizeof key, "ckpt/%lld/%d/%d", (long long)step, t->save_try, r);
      rc = o->kv->get(o->kv->ud, key, &val, &len, 600000);
      if (rc == 0 && len == sizeof mine) {
        const shard_report_t *got = val;
        all[r] = got->info;
        if (!bad[0] && got->error[0])
          memcpy(bad, got->error, sizeof bad), bad[sizeof bad - 1] = 0;
      } else if (rc == 0) {
        rc = DT_EFORMAT;
      }
      if (rc == 0)
        free(val);
    }
  }
  if (rc == 0 && !bad[0]) {
    rc = dt_ckpt_commit(o->ckpt_dir, step, P, writers, all);
    if (rc == DT_ENOSPC)
      snprintf(bad, sizeof bad,
               "rank %d could not write its manifest: no space left on device in %s", o->rank,
               o->ckpt_dir);
    *committed = rc == 0;
  }
  if (bad[0] && (rc == 0 || rc == DT_ENOSPC)) {
    j->abandoned = 1;
    if (strcmp(bad, mine.error) != 0) /* a writer that failed says so itself */
      DT_WARN(CKPT, "checkpoint step %lld not saved: %s; training goes on", (long long)step, bad);
    rc = dt_ckpt_discard(o->ckpt_dir, step);
  }
  free(all);
  return rc;
}

/* Where writer wrank's shard starts in the concatenation of all shards (in writer order): the
 * writers' indices and element counts are exchanged as floats that carry integers below 2^24
 * exactly (counts as two halves; a gather copies, it does not round). */
static int shard_offset(trainer_t *t, int writes, int wrank, int64_t count, int64_t *vlo)
{
  *vlo = 0;
  if (!t->world)
    return 0;
  const int W = dt_comm_world(t->world);
  float mine[3] = {(float)(writes ? wrank : -1), (float)(count >> 24), (float)(count & 0xFFFFFF)};
  float *all = calloc(3 * (size_t)W, sizeof *all);
  if (!all)
    return DT_ENOMEM;
  int rc = dt_comm_all_gather(t->world, mine, all, 3);
  for (int r = 0; r < W && rc == 0; r++)
    if (all[3 * r] >= 0 && (int)all[3 * r] < wrank)
      *vlo += ((int64_t)all[3 * r + 1] << 24) + (int64_t)all[3 * r + 2];
  free(all);
  return rc;
}

/* Where a failure now resumes from: "step K, the newest committed", or the start. */
static void resumes_from(const char *dir, char *buf, size_t n)
{
  int64_t last = 0;
  if (dt_ckpt_latest(dir, &last) == 0 && last > 0)
    snprintf(buf, n, "step %lld, the newest committed", (long long)last);
  else
    snprintf(buf, n, "the start (no step committed)");
}

/* This writer's shard did not fit on its disk: says so, with the sizes, and why as the report to
 * the committing rank or the coordinator. The run goes on; the next save tries again. */
static void no_space(const save_job_t *j, char *why, size_t n)
{
  const trainer_t *t = j->t;
  const dt_train_opts_t *o = t->o;
  int64_t step = j->state.step, next = o->steps;
  struct statvfs fs;
  char host[256] = "?", room[64] = "";
  gethostname(host, sizeof host);
  host[sizeof host - 1] = 0;
  if (statvfs(o->ckpt_dir, &fs) == 0)
    snprintf(room, sizeof room, "%.2f MiB free, ", (double)fs.f_bavail * fs.f_frsize / (1 << 20));
  snprintf(why, n,
           "rank %d on %s could not write its shard: no space left on device in %s (%sthe "
           "shard needs %.2f MiB)",
           o->rank, host, o->ckpt_dir, room, j->mib);
  if (o->save_every > 0 && step + o->save_every - step % o->save_every < next)
    next = step + o->save_every - step % o->save_every;
  char then[96] = "";
  if (next > step && o->save_every_s > 0) /* a save by time may come first */
    snprintf(then, sizeof then, "Training goes on and the next save tries again; ");
  else if (next > step)
    snprintf(then, sizeof then, "Training goes on and the save of step %lld tries again; ",
             (long long)next);
  char from[64];
  resumes_from(o->ckpt_dir, from, sizeof from);
  DT_ERROR(CKPT,
           "checkpoint step %lld not saved: %s. %s%s failure now resumes from %s. Free space "
           "there, or keep fewer checkpoints (--keep, checkpoint.keep)",
           (long long)step, why, then, then[0] ? "a" : "A", from);
}

static void *save_main(void *arg)
{
  save_job_t *j = arg;
  trainer_t *t = j->t;
  dt_ckpt_shard_info_t info;
  int committed = 0;
  char why[512];
  const int64_t full = dt_param_FaultNoSpaceStep();
  j->rc = (full == j->state.step || full < 0) && !t->save_try
              ? DT_ENOSPC
              : dt_ckpt_write_runs(&t->cfg, (int64_t)t->model.global_params, &j->state,
                                   t->o->ckpt_dir, j->wrank, j->writers, j->vlo, j->runs, j->nruns,
                                   j->params, j->m, j->v, &info);
  const int nospace = j->rc == DT_ENOSPC; /* not the run's failure: the step is abandoned */
  if (nospace) {
    no_space(j, why, sizeof why);
    memset(&info, 0, sizeof info);
    info.rank = j->wrank;
    j->rc = 0;
  }
  if (j->rc == 0)
    j->rc = commit_checkpoint(j, &info, nospace ? why : NULL, &committed);
  if (j->rc == 0 && committed)
    j->rc = dt_ckpt_prune(t->o->ckpt_dir, t->o->keep, t->o->keep_every);
  const int milestone = t->o->keep_every > 0 && j->state.step % t->o->keep_every == 0;
  /* Under a coordinator the writer whose report completes the step learns it committed. */
  const int pending = !committed && dt_link_has_coordinator(t->o->link);
  if (j->rc == 0 && t->lead && !t->o->quiet && !j->abandoned)
    DT_INFO(CKPT, "checkpoint step %lld: written%s%s in %.1f ms%s%s", (long long)j->state.step,
            pending ? "" : " and committed", j->async ? " in the background" : "",
            dt_now_ms() - j->t0, milestone ? " (kept for good: a multiple of --keep-every)" : "",
            pending ? " (its shard: the coordinator commits the step once every writer's is in)"
                    : "");
  return NULL;
}

/* Waits for the save in flight, if any; its failure is the run's. */
static int save_wait(trainer_t *t)
{
  save_job_t *j = t->save;
  if (!j)
    return 0;
  if (t->saving)
    pthread_join(t->saver, NULL);
  t->saving = 0;
  t->save = NULL;
  const int rc = j->rc;
  t->unsaved_step = j->abandoned ? j->state.step : 0;
  t->shard_mib = j->mib;
  free(j->runs);
  free(j);
  return rc;
}

/* Copies this rank's shard (params, m, v of rg) into t->snap: host memory the step will not
 * touch while the shard is written. */
static int snapshot(trainer_t *t, const dt_ckpt_range_t *rg, save_job_t *j)
{
  const size_t len = (size_t)(rg->hi - rg->lo);
  if (3 * len > t->snap_cap) {
    dt_free_aligned(t->snap);
    t->snap_cap = 0;
    if (!(t->snap = dt_calloc_aligned(3 * len * sizeof(float) + 1, "checkpoint snapshot")))
      return DT_ENOMEM;
    t->snap_cap = 3 * len;
  }
  const float *src[3] = {rg->params, rg->m, rg->v};
  const float **dst[3] = {&j->params, &j->m, &j->v};
  for (int k = 0; k < 3; k++) {
    *dst[k] = NULL;
    if (!src[k] || !len)
      continue;
    float *h = t->snap + (size_t)k * len;
    DT_CHECK(t->dev->copy(t->dev, h, src[k], len * sizeof(float), DT_COPY_D2H));
    *dst[k] = h;
  }
  return 0;
}

/* Saves this rank's shard of the step just completed: the step pauses only to snapshot it;
 * a thread writes and commits it while training goes on (--ckpt-sync: the step does). The
 * save before must have finished first: its error fails the run here. Writers are the
 * data-parallel writers of every (pp, tp) position; each writes the global runs of the part of
 * its local range it owns (replicated tensors on tp rank 0, wte on the first stage), so the
 * shards hold every parameter once and any layout can read the checkpoint. */
static int save_checkpoint(trainer_t *t)
{
  const double t0 = dt_now_ms();
  t->saved_ms = t0;
  DT_CHECK(save_wait(t));
  const double waited = dt_now_ms() - t0;
  dt_ckpt_range_t rg;
  int writes, dpw, dwrank;
  dt_dp_ckpt_range(t->dp, &rg, &writes, &dpw, &dwrank);
  const int tr = t->plan.coord.tp, tp = t->plan.mesh.tp;
  const int writers = t->pp * tp * dpw, wrank = (t->stage * tp + tr) * dpw + dwrank;
  const int64_t count = rg.hi - rg.lo - dt_gpt2_unowned_in(&t->model, rg.lo, rg.hi);
  int64_t vlo;
  DT_CHECK(shard_offset(t, writes, wrank, count, &vlo));
  if (!writes)
    return 0;
  save_job_t *j = calloc(1, sizeof *j);
  if (!j)
    return DT_ENOMEM;
  *j = (save_job_t){
      .t = t, .state = t->state, .vlo = vlo, .wrank = wrank, .writers = writers, .t0 = t0};
  int rc = dt_gpt2_runs(&t->model, tr, rg.lo, rg.hi, 1, &j->runs, &j->nruns);
  if (rc == 0)
    rc = snapshot(t, &rg, j);
  for (size_t i = 0; rc == 0 && i < j->nruns; i++)
    j->mib += (double)j->runs[i].len * sizeof(float) * (j->m ? 3 : 1) / (1 << 20);
  if (rc != 0) {
    free(j->runs);
    free(j);
    return rc;
  }
  t->save = j;
  j->async = !t->o->ckpt_sync;
  if (j->async && pthread_create(&t->saver, NULL, save_main, j) == 0) {
    t->saving = 1;
    if (t->lead && !t->o->quiet && !t->save_try)
      DT_INFO(CKPT,
              "checkpoint step %lld: the step paused %.1f ms (%.1f ms for the previous save, "
              "%.1f ms to snapshot %.1f MiB)",
              (long long)j->state.step, dt_now_ms() - t0, waited, dt_now_ms() - t0 - waited,
              3.0 * (double)(rg.hi - rg.lo) * sizeof(float) / (1 << 20));
    return 0;
  }
  j->async = 0; /* --ckpt-sync, or no thread to be had: write it now */
  save_main(j);
  return save_wait(t);
}

/* The whole model in llm.c layout on every rank (export), from this rank's gathered local
 * parameters: each rank places the parameters it owns, and the ranks holding the other parts
 * (tp x pp) sum the buffers: every element has exactly one non-zero contribution, so the sum
 * is exact. */
static int gather_global(trainer_t *t, const float *local, float *out)
{
  dt_gpt2_t *m = &t->model;
  dt_gpt2_run_t *runs;
  size_t n;
  DT_CHECK(dt_gpt2_runs(m, m->tp.rank, 0, (int64_t)m->num_params, 1, &runs, &n));
  memset(out, 0, m->global_params * sizeof(float));
  for (size_t i = 0; i < n; i++)
    memcpy(out + runs[i].global, local + runs[i].local, (size_t)runs[i].len * sizeof(float));
  free(runs);
  return dt_comm_all_reduce(t->plan.mp, out, m->global_params, DT_COMM_SUM);
}

/* Resolves the model config from (in order) the checkpoint to resume, the file or checkpoint
 * --init names, or the options, checking that explicit flags agree with a file. */
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
  if (o->init_ckpt) {
    DT_CHECK(dt_ckpt_read_config(o->init_ckpt, cfg));
    return check_model_flags(o, cfg, o->init_ckpt);
  }
  if (o->init_hf) {
    char err[8300];
    const int rc = dt_hf_read_config(o->init_hf, cfg, err, sizeof err);
    if (rc != 0) {
      DT_ERROR(TRAIN, "--init hf: %s", err);
      return rc;
    }
    return check_model_flags(o, cfg, o->init_hf);
  }
  *cfg = o->model;
  cfg->padded_vocab = dt_gpt2_padded_vocab(cfg->vocab);
  return 0;
}

/* Device bytes of the rank's tensors: model state, ZeRO working buffers, activations and the
 * bf16 weight copy. */
static double tensor_bytes(trainer_t *t)
{
  dt_dp_memory_t mem;
  dt_dp_memory(t->dp, &mem);
  return (double)(mem.params + mem.grads + mem.optim + mem.working + t->model.bytes_acts) +
         (t->model.params16 ? (double)t->model.num_params * t->model.ops->bf16_bytes : 0.0);
}

/* After the first step, when the kernels' scratch has grown to what a step needs: the rank's
 * tensors, the device's own buffers, and what the GPU shows in use (which adds the CUDA
 * context, NCCL's buffers and other processes). */
static void device_memory(trainer_t *t, size_t used, size_t total)
{
  const double MiB = 1024.0 * 1024.0, tensors = tensor_bytes(t);
  char what[160] = "";
  const double own = t->dev->own_bytes ? (double)t->dev->own_bytes(t->dev, what, sizeof what) : 0;
  t->device_logged = 1;
  DT_INFO(TRAIN,
          "device memory after the first step: tensors %.2f MiB + the device's own %.2f MiB (%s) "
          "= %.2f MiB; %s shows %.2f of %.0f MiB in use (with the CUDA context, NCCL and other "
          "processes)",
          tensors / MiB, own / MiB, what, (tensors + own) / MiB, t->dev->name, used / MiB,
          total / MiB);
}

static void print_memory(trainer_t *t)
{
  const double MiB = 1024.0 * 1024.0, P = (double)t->model.num_params, N = t->dpsize * t->cp;
  const int zero = t->o->zero_stage, tp = t->model.tp.tp;
  dt_dp_memory_t mem;
  dt_dp_memory(t->dp, &mem);
  /* The ZeRO formulas for fp32 AdamW over the local parameters, in bytes (16P baseline); N is
   * the sharding group, dp x cp (printed as dp). */
  const double formula[4] = {16 * P, 8 * P + 8 * P / N, 4 * P + 12 * P / N, 16 * P / N};
  const double have = (double)(mem.params + mem.grads + mem.optim);
  if (tp > 1 || t->pp > 1) {
    /* Per layer 12C^2 + 7C split over tp, 6C replicated (LayerNorms, row-parallel biases);
     * the first stage adds wte/tp and wpe, the last wte/tp (tied copy) and the final LN. */
    const dt_gpt2_config_t *c = &t->cfg;
    const double C = c->channels, n = t->model.L, wte = (double)c->padded_vocab * C / tp;
    const int first = t->model.stage.first, last = t->model.stage.last;
    const double formula_p = n * ((12 * C * C + 7 * C) / tp + 6 * C) +
                             (first ? wte + (double)c->max_seq * C : 0) +
                             (last ? (first ? 0 : wte) + 2 * C : 0);
    DT_INFO(TRAIN,
            "model parallel: %.0f of %zu parameters on this rank (formula %.0f: %d layers / tp "
            "%d%s%s)",
            P, t->model.global_params, formula_p, t->model.L, tp, first ? " + embeddings" : "",
            last ? " + LM head" : "");
  }
  DT_INFO(TRAIN,
          "memory (ZeRO-%d, dp %d): params %.2f MiB, grads %.2f MiB, optimizer %.2f MiB = %.2f MiB "
          "(formula %.2f MiB, %+.2f%%) + working %.2f MiB; activations %.1f MiB",
          zero, t->dpsize * t->cp, mem.params / MiB, mem.grads / MiB, mem.optim / MiB, have / MiB,
          formula[zero] / MiB, 100.0 * (have / formula[zero] - 1.0), mem.working / MiB,
          t->model.bytes_acts / MiB);
}

/* The mesh: the one given (DISTRAIN_MESH), or dp = world / (tp x pp). */
static int resolve_mesh(const dt_train_opts_t *o, int world, dt_mesh_t *mesh)
{
  if (o->mesh.tp > 0) {
    *mesh = o->mesh;
    return 0;
  }
  const int tp = o->tp > 0 ? o->tp : 1, pp = o->pp > 0 ? o->pp : 1, cp = o->cp > 0 ? o->cp : 1;
  if (world % (tp * pp * cp) != 0) {
    DT_ERROR(TRAIN, "--tp %d x --pp %d x --cp %d does not divide WORLD_SIZE %d%s", tp, pp, cp,
             world,
             world == 1 ? " (start one distrain-train per rank with WORLD_SIZE, RANK and "
                          "DISTRAIN_KV_DIR set, or run the job with distrainctl run --local)"
                        : "");
    return DT_EINVAL;
  }
  return dt_mesh_init(mesh, pp, world / (tp * pp * cp), cp, tp);
}

/* How many of the steps 1..step --skip-steps lists. */
static int skipped_through(const dt_train_opts_t *o, int64_t step)
{
  int n = 0;
  for (int i = 0; i < o->n_skip_steps; i++)
    n += o->skip_steps[i] <= step;
  return n;
}

/* Loads the checkpoint to resume from. From a checkpoint directory: its newest committed
 * step that every rank reads intact; a step whose shards fail verification on any rank (CRC,
 * size, a missing shard) is marked bad (dt_ckpt_mark_bad) and the one before it is tried, so
 * a job never spends its restarts on the same corrupt step. An explicit step directory is
 * loaded as it is. */
static int resume(trainer_t *t)
{
  for (;;) {
    char sdir[4096], manifest[4200];
    DT_CHECK(dt_ckpt_resolve_step_dir(t->resume_from, sdir, sizeof sdir));
    const int explicit_step = strcmp(sdir, t->resume_from) == 0;
    int rc = dt_dp_load(t->dp, sdir, &t->state);
    const int corrupt = rc == DT_EFORMAT || rc == DT_EIO || rc == DT_ENOENT;
    float bad[2] = {corrupt, rc != 0 && !corrupt}; /* over every rank */
    if (t->world)
      DT_CHECK(dt_comm_all_reduce(t->world, bad, 2, DT_COMM_SUM));
    if (bad[0] == 0.0f && bad[1] == 0.0f)
      return 0;
    if (bad[1] > 0.0f || explicit_step) {
      DT_ERROR(TRAIN, "%s: cannot resume: %s", sdir,
               rc ? dt_strerror(rc) : "the checkpoint failed on another rank");
      return rc ? rc : DT_EREMOTE;
    }
    snprintf(manifest, sizeof manifest, "%s/MANIFEST", sdir);
    DT_WARN(TRAIN,
            "%s: fails verification on %.0f rank(s)%s; marked bad (MANIFEST.bad), resuming "
            "from the committed step before it",
            sdir, bad[0], corrupt ? " (this one included)" : "");
    if (t->lead && access(manifest, F_OK) == 0)
      DT_CHECK(dt_ckpt_mark_bad(sdir));
    if (t->world)
      DT_CHECK(dt_comm_barrier(t->world));
  }
}

/* Orders (gpu id, rank) rows for the shared-GPU check. */
static int cmp_gpu(const void *a, const void *b)
{
  const uint64_t *x = a, *y = b;
  return x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : x[1] < y[1] ? -1 : x[1] > y[1];
}

/* The communicator the plan's groups split from. t->world ("cpu") carries host scalars; on a
 * GPU it stages device buffers through the host. The device's own backend ("nccl") moves device
 * memory directly, but needs every rank on a GPU of its own: --comm nccl asks for it, auto takes
 * it when that holds, cpu never. The ranks all-gather whether they can and which GPU they hold,
 * so every rank reaches the same answer. */
static int open_device_comm(trainer_t *t, int world)
{
  const dt_train_opts_t *o = t->o;
  const char *want = o->comm ? o->comm : "auto";
  if (strcmp(want, "cpu") == 0)
    return 0;
  const int need = strcmp(want, "nccl") == 0;
  char why[256];
  uint64_t id;
  const int able = dt_train_device_comm_able(t->dev, &id, why, sizeof why);
  enum { ROW = 5 }; /* able, then the id in 16-bit pieces (exact in float32) */
  float mine[ROW] = {(float)able};
  for (int k = 0; k < 4; k++)
    mine[1 + k] = (float)((id >> (16 * k)) & 0xffff);
  float *all = malloc((size_t)world * ROW * sizeof *all);
  uint64_t *ids = malloc((size_t)world * 2 * sizeof *ids);
  int rc = all && ids ? dt_comm_all_gather(t->world, mine, all, ROW) : DT_ENOMEM;
  int unable = 0, shared = -1, with = -1, n = 0;
  for (int r = 0; rc == 0 && r < world; r++) {
    if (all[r * ROW] == 0.0f) {
      unable++;
      continue;
    }
    ids[2 * n] = 0;
    for (int k = 0; k < 4; k++)
      ids[2 * n] |= (uint64_t)all[r * ROW + 1 + k] << (16 * k);
    ids[2 * n++ + 1] = (uint64_t)r;
  }
  if (rc == 0)
    qsort(ids, (size_t)n, 2 * sizeof *ids, cmp_gpu);
  for (int i = 1; rc == 0 && shared < 0 && i < n; i++)
    if (ids[2 * i] == ids[2 * i - 2]) {
      with = (int)ids[2 * i - 1];
      shared = (int)ids[2 * i + 1];
    }
  free(all);
  free(ids);
  DT_CHECK(rc);
  char whynot[384] = "";
  if (unable)
    snprintf(whynot, sizeof whynot, "%d of %d ranks cannot use NCCL (rank %d %s%s)", unable, world,
             o->rank, able ? "can" : "cannot: ", able ? "" : why);
  else if (shared >= 0)
    snprintf(whynot, sizeof whynot, "ranks %d and %d share one GPU, which NCCL refuses", with,
             shared);
  if (whynot[0] && need) {
    DT_ERROR(TRAIN, "--comm nccl: %s; use --comm cpu", whynot);
    return DT_ENOTSUP;
  }
  if (whynot[0]) {
    if (!t->dev->host && t->lead)
      DT_INFO(TRAIN, "--comm auto: %s; collectives stage through the host", whynot);
    return 0;
  }
  char prefix[512];
  snprintf(prefix, sizeof prefix, "%s/%s", o->kv_prefix, t->dev->comm_backend);
  DT_CHECK(dt_comm_init(&t->devworld, t->dev->comm_backend, o->kv, prefix, o->rank, world,
                        (int)dt_param_CommTimeoutMs()));
  DT_CHECK(dt_comm_set_device(t->devworld, &t->comm_dev));
  dt_comm_set_label(t->devworld, "world"); /* its prefix, under the job's, reads as a group's */
  if (t->lead)
    DT_INFO(TRAIN, "collectives: %s on %d ranks, one GPU each", t->dev->comm_backend, world);
  return 0;
}

/* --prompt's tokens: GPT-2's BPE with --vocab-file and --merge-file (checked against the model's
 * vocabulary at the vocabulary's loading), or, for a model of 256 tokens without them, its
 * bytes. */
static int encode_prompt(trainer_t *t)
{
  const char *text = t->o->prompt;
  const size_t len = strlen(text);
  int32_t *ids = NULL;
  size_t n = 0, cap = 0, bad = 0;
  int rc = 0;
  if (t->bpe) {
    rc = dt_bpe_encode(t->bpe, text, len, &ids, &n, &cap, &bad);
    if (rc == DT_EINVAL)
      DT_ERROR(TRAIN, "--prompt: byte %zu is not UTF-8", bad);
  } else if (t->cfg.vocab == 256) {
    ids = malloc(len * sizeof *ids);
    rc = ids ? 0 : DT_ENOMEM;
    for (n = 0; rc == 0 && n < len; n++)
      ids[n] = (unsigned char)text[n];
  } else {
    DT_ERROR(TRAIN,
             "--prompt: a model of %d tokens needs --vocab-file and --merge-file (GPT-2's BPE) "
             "to encode it; only a model of 256 takes its bytes",
             t->cfg.vocab);
    rc = DT_EINVAL;
  }
  t->prompt = rc == 0 ? malloc(n * sizeof *t->prompt) : NULL;
  if (rc == 0 && !t->prompt)
    rc = DT_ENOMEM;
  for (size_t i = 0; rc == 0 && i < n; i++)
    t->prompt[i] = ids[i];
  t->prompt_n = (int)n;
  free(ids);
  if (rc == 0 && t->lead)
    DT_INFO(TRAIN, "--prompt: %d tokens", t->prompt_n);
  return rc;
}

/* A validation set (--val, or one of --val-sets, named by flag): its loader, reading windows of
 * the global batch as training does (see evaluate), and how many of them validation reads:
 * --val-batches, or fewer where the set holds fewer before it (or a source of its blend) would
 * begin again. */
static int open_val(trainer_t *t, const char *flag, const char *pattern, dt_dataloader_t *dl,
                    int64_t *windows)
{
  const dt_train_opts_t *o = t->o;
  DT_CHECK(dt_dataloader_init(dl, pattern, o->batch, o->seq, t->dprank, t->dpsize, o->grad_accum,
                              t->cfg.vocab, 0, 0));
  const int64_t n = *windows = dt_dataloader_windows_within(dl, o->val_batches);
  if (n == 0) {
    DT_ERROR(TRAIN,
             "%s %s: a source of the blend begins its data again within the first global "
             "batch (%d sequences): give it more data or less weight",
             flag, pattern, o->batch * t->dpsize * o->grad_accum);
    return DT_EFORMAT;
  }
  if (n < o->val_batches)
    DT_INFO(TRAIN, "%s %s holds %lld global batches without a repeat: validation uses those", flag,
            pattern, (long long)n);
  return 0;
}

/* Rows by their positions, the longest first, then in order. */
typedef struct {
  int len, row;
} row_len_t;

static int cmp_rows(const void *pa, const void *pb)
{
  const row_len_t *a = pa, *b = pb;
  return a->len != b->len ? b->len - a->len : a->row - b->row;
}

/* --eval: the set, checked against the model's vocabulary and the sequence length; the longest
 * window its rows are evaluated in: the longest row's positions (its tokens but the last),
 * rounded up to split as a training sequence does (unit), at most --seq; and the rows' order. */
static int open_eval(trainer_t *t, int unit)
{
  const dt_train_opts_t *o = t->o;
  DT_CHECK(dt_evalset_load(&t->evalset, o->eval_path, t->cfg.vocab));
  const int need = t->evalset.max_tokens - 1;
  if (need > o->seq) {
    DT_ERROR(TRAIN,
             "--eval %s: its longest example needs %d positions (context and completion, "
             "%d tokens, but the last), more than --seq %d",
             o->eval_path, need, t->evalset.max_tokens, o->seq);
    return DT_ERANGE;
  }
  t->eval_T = DT_MIN((need + unit - 1) / unit * unit, o->seq);
  t->eval_unit = unit;
  const int rows = t->evalset.rows;
  row_len_t *by = malloc((size_t)rows * sizeof *by);
  if (!by || !(t->eval_order = malloc((size_t)rows * sizeof *t->eval_order))) {
    free(by);
    return DT_ENOMEM;
  }
  for (int r = 0; r < rows; r++)
    by[r] = (row_len_t){dt_evalset_row_positions(&t->evalset, r), r};
  qsort(by, (size_t)rows, sizeof *by, cmp_rows);
  for (int r = 0; r < rows; r++)
    t->eval_order[r] = by[r].row;
  free(by);
  if (t->lead && o->eval_out && !(t->eval_out = fopen(o->eval_out, "a"))) {
    DT_ERROR(TRAIN, "--eval-out %s: %s", o->eval_out, strerror(errno));
    return DT_EACCES;
  }
  if (t->lead)
    DT_INFO(TRAIN,
            "eval %s: %d examples, %d completions, evaluated the longest first in windows of up "
            "to %d positions",
            o->eval_path, t->evalset.n, t->evalset.rows, t->eval_T);
  return 0;
}

/* The model FLOPs a token costs, as llm.c, Megatron-LM and PaLM count them for the MFU: 6 per
 * parameter (forward and backward GEMMs; the padded vocabulary included, recomputation not)
 * and 12 L C T for attention's two products; and the peak they are held against: --peak-tflops,
 * else a known GPU's dense bf16 peak in a bf16 run. */
static void log_flops(trainer_t *t)
{
  const dt_gpt2_config_t *c = &t->cfg;
  t->flops_per_token =
      6.0 * (double)t->model.global_params + 12.0 * c->layers * c->channels * (double)t->o->seq;
  char gpu[256] = "", peak[400];
  t->peak_flops = t->o->peak_tflops * 1e12;
  if (t->peak_flops > 0)
    snprintf(peak, sizeof peak, "MFU against %g TFLOP/s a device (--peak-tflops)",
             t->o->peak_tflops);
  else if (t->model.bf16 &&
           (t->peak_flops = dt_train_device_peak_bf16_flops(t->dev, gpu, sizeof gpu)) > 0)
    snprintf(peak, sizeof peak, "MFU against %g TFLOP/s a device (%s, dense bf16)",
             t->peak_flops / 1e12, gpu);
  else
    snprintf(peak, sizeof peak, "no MFU: the peak of %s%s is not known (--peak-tflops gives it)",
             gpu[0] ? gpu : t->dev->name, t->model.bf16 ? "" : " in fp32");
  DT_INFO(TRAIN, "model FLOPs: %.4g a token (6 P + 12 L C T); %s", t->flops_per_token, peak);
}

/* How often the run will read each source of a blend: a source read many times over is
 * repeated data. */
static void log_blend(const trainer_t *t)
{
  const dt_dataloader_t *dl = &t->train;
  const double seqs = (double)(t->o->steps - t->state.step) * dl->B * dl->world * dl->accum;
  for (int d = 0; d < dl->nsrc; d++)
    DT_INFO(
        TRAIN, "blend source %d (%s, %s): %.0f sequences in steps %lld..%d, %.3g passes over it",
        d + 1, dl->src_name[d], dl->src_pattern[d], seqs * dl->weight[d], (long long)t->state.step,
        t->o->steps, seqs * dl->weight[d] / (double)dt_dataloader_epoch_windows(&dl->src[d]));
}

/* Whether a spike guard (flag, factor) is armed: the average of the recent steps' (what) from
 * the checkpoint, or how many steps must set it first. */
static void log_guard(const char *flag, double factor, const char *what, double avg, int64_t n)
{
  if (factor > 0 && n >= SPIKE_HORIZON)
    DT_INFO(TRAIN, "%s %g: armed (the recent steps' average %s from the checkpoint: %.4f)", flag,
            factor, what, avg);
  else if (factor > 0)
    DT_INFO(TRAIN, "%s %g: armed once %lld more steps have set the average %s", flag, factor,
            (long long)(SPIKE_HORIZON - n), what);
}

/* A checkpoint saved inside a window of steps skipped where they were (--bad-step skip): the
 * rest of the window is skipped too. */
static int resume_window(trainer_t *t)
{
  const int64_t step = t->state.step, end = t->state.skip_until;
  if (end <= step)
    return 0;
  t->here = malloc((size_t)(end - step) * sizeof *t->here);
  if (!t->here)
    return DT_ENOMEM;
  for (int64_t s = step + 1; s <= end; s++)
    t->here[t->n_here++] = s;
  t->cap_here = t->n_here;
  t->here_end = end;
  DT_INFO(TRAIN, "steps %lld-%lld: the rest of a window skipped where it was (--bad-step skip)",
          (long long)(step + 1), (long long)end);
  return 0;
}

/* Everything before the first step: options, plan, model, data, checkpoints, metrics. */
static int setup(trainer_t *t, const dt_train_opts_t *o)
{
  char why[256];
  dt_mesh_t mesh;
  t->o = o;
  if (dt_train_opts_validate(o, why, sizeof why) != 0) {
    DT_ERROR(TRAIN, "%s", why);
    return DT_EINVAL;
  }
  const int world = o->world > 1 ? o->world : 1;
  t->lead = o->rank == 0;
  if (world > 1 && (!o->kv || !o->kv_prefix)) {
    DT_ERROR(TRAIN, "parallel training needs the rendezvous key-value store");
    return DT_EINVAL;
  }
  if (o->threads > 0) {
    omp_set_num_threads(o->threads);
    openblas_set_num_threads(o->threads);
  }
  DT_CHECK(resolve_config(o, &t->cfg, &t->resume_from));
  if (o->seq > t->cfg.max_seq) {
    DT_ERROR(TRAIN, "--seq %d exceeds the model's max_seq %d", o->seq, t->cfg.max_seq);
    return DT_EINVAL;
  }
  /* Every layout rule is checked before this rank meets its peers. */
  int bounds[DT_UNIT_MAX_ORDER + 1], layers[DT_UNIT_MAX_ORDER];
  DT_CHECK(resolve_mesh(o, world, &mesh));
  const int chunks = o->pp_virtual ? o->pp_virtual : o->pp_schedule == DT_PIPE_INTERLEAVED ? 2 : 1;
  if (mesh.pp * chunks > DT_UNIT_MAX_ORDER) {
    DT_ERROR(TRAIN, "parallel.pp (%d) x virtual_stages (%d): at most %d pipeline stages", mesh.pp,
             chunks, DT_UNIT_MAX_ORDER);
    return DT_EINVAL;
  }
  if (dt_plan_check(&mesh, &t->cfg, o->seq, why, sizeof why) != 0 ||
      (mesh.pp > 1 &&
       dt_pipe_check(o->pp_schedule, mesh.pp, chunks, o->grad_accum, why, sizeof why) != 0) ||
      (o->pp_partition && dt_mesh_parse_partition(o->pp_partition, mesh.pp * chunks, t->cfg.layers,
                                                  layers, why, sizeof why) != 0) ||
      dt_plan_partition(&t->cfg, mesh.pp * chunks, o->pp_partition ? layers : NULL, bounds, why,
                        sizeof why) != 0) {
    DT_ERROR(TRAIN, "%s", why);
    return DT_EINVAL;
  }
  const int unit = window_unit(mesh.cp, mesh.tp, o->sequence_parallel);
  if (o->sample_tokens > 0 && o->seq % unit != 0) {
    DT_ERROR(TRAIN,
             "--sample needs --seq (%d) divisible by %d (%s): each window of text is split as a "
             "training sequence",
             o->seq, unit,
             mesh.cp == 1 ? "--tp under --sp"
                          : (o->sequence_parallel ? "2 x --cp x --tp under --sp" : "2 x --cp"));
    return DT_EINVAL;
  }
  t->cp = mesh.cp;
  t->seq = o->seq / mesh.cp; /* dt_plan_check: cp divides seq */
  if (o->sequence_parallel && (mesh.tp == 1 || (o->batch * t->seq) % mesh.tp != 0)) {
    DT_ERROR(TRAIN,
             "--sp: sequence parallelism needs tp > 1 dividing batch x seq / cp (%d x %d; tp %d)",
             o->batch, t->seq, mesh.tp);
    return DT_EINVAL;
  }
  DT_CHECK(dt_train_device_open(o->device, &t->dev));
  t->opened = t->dev;
  dt_set_compute(t->dev->host ? omp_get_max_threads() : 1, /* ZeRO's group: dp x cp */
                 dt_dp_overlapped(mesh.dp * mesh.cp, o->zero_stage, t->dev));
  if (o->profile_from > 0) {
    if (o->profile_from > o->steps) {
      DT_ERROR(TRAIN, "--profile (or DISTRAIN_PROFILE) from step %d: the run has %d steps",
               o->profile_from, o->steps);
      return DT_EINVAL;
    }
    if (o->profile_trace && o->world > 1 && !strstr(o->profile_trace, "%r")) {
      DT_ERROR(TRAIN,
               "--profile-trace %s: %d ranks would write one file; put %%r (the rank) in its "
               "name",
               o->profile_trace, o->world);
      return DT_EINVAL;
    }
    DT_CHECK(dt_profile_create(&t->prof, t->dev));
    if (o->profile_trace)
      dt_profile_keep_spans(t->prof);
    t->dev = dt_profile_device(t->prof);
  }
  if (world > 1) {
    DT_CHECK(dt_comm_init(&t->world, "cpu", o->kv, o->kv_prefix, o->rank, world,
                          (int)dt_param_CommTimeoutMs()));
    dt_comm_set_label(t->world, "world"); /* whatever the job's prefix */
    if (!t->dev->host) {
      t->comm_dev = (dt_comm_device_t){t->dev,     comm_is_device, comm_copy,
                                       comm_alloc, comm_release,   comm_sync};
      DT_CHECK(dt_comm_set_device(t->world, &t->comm_dev));
    }
    DT_CHECK(open_device_comm(t, world));
  }
  DT_CHECK(dt_plan_create(&t->plan, &mesh, bounds, mesh.pp > 1 ? chunks : 1,
                          t->devworld ? t->devworld : t->world));
  if (t->prof) { /* before any thread operates on them */
    dt_comm_t *all[] = {t->world,   t->devworld, t->plan.tp, t->plan.dp,
                        t->plan.pp, t->plan.emb, t->plan.mp, t->plan.cp};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
      dt_profile_watch(t->prof, all[i]);
  }
  t->dprank = t->plan.coord.dp;
  t->dpsize = mesh.dp;
  t->pp = mesh.pp;
  t->stage = t->plan.coord.pp;
  const dt_gpt2_tp_t tp = {.tp = mesh.tp, .rank = t->plan.coord.tp, .comm = t->plan.tp};
  DT_CHECK(dt_gpt2_create(&t->model, &t->cfg, t->dev, &tp, &t->plan.stage));
  DT_CHECK(dt_gpt2_set_precision(&t->model, o->precision && strcmp(o->precision, "bf16") == 0));
  DT_CHECK(dt_gpt2_set_attention(&t->model, !o->attention || strcmp(o->attention, "flash") == 0));
  t->cprank = t->plan.coord.cp;
  const dt_gpt2_cp_t cp = {.cp = mesh.cp, .rank = t->cprank, .comm = t->plan.cp};
  DT_CHECK(dt_gpt2_set_context_parallel(&t->model, &cp));
  if (t->cp > 1 && (!(t->cp_inputs = calloc((size_t)o->batch * t->seq, sizeof(int))) ||
                    !(t->cp_targets = calloc((size_t)o->batch * t->seq, sizeof(int)))))
    return DT_ENOMEM;
  if (o->init_llmc) {
    DT_CHECK(dt_llmc_load(&t->model, o->init_llmc));
  } else if (o->init_hf) {
    char err[8300];
    const int rc = dt_hf_load(&t->model, o->init_hf, err, sizeof err);
    if (rc != 0) {
      DT_ERROR(TRAIN, "--init hf: %s", err);
      return rc;
    }
  } else if (o->init_ckpt) {
    int64_t step;
    DT_CHECK(dt_ckpt_load_weights(&t->model, o->init_ckpt, &step));
    if (t->lead)
      DT_INFO(TRAIN,
              "--init ckpt:%s: the weights of its step %lld; AdamW's moments, the step count and "
              "the data position start afresh",
              o->init_ckpt, (long long)step);
  } else {
    DT_CHECK(dt_gpt2_init_weights(&t->model, o->seed));
  }
  dt_rng_seed(&t->state.rng, o->seed);
  t->state.threads = omp_get_max_threads();

  if (o->vocab_file) {
    char err[8300];
    int rc = dt_bpe_create(&t->bpe, o->vocab_file, o->merge_file, err, sizeof err);
    if (rc != 0) {
      DT_ERROR(TRAIN, "--vocab-file: %s", err);
      return rc;
    }
    if (dt_bpe_vocab_size(t->bpe) > t->cfg.vocab) {
      DT_ERROR(TRAIN, "--vocab-file %s: %d tokens, more than the model's vocabulary (%d)",
               o->vocab_file, dt_bpe_vocab_size(t->bpe), t->cfg.vocab);
      return DT_ESHAPE;
    }
  }
  if (o->prompt)
    DT_CHECK(encode_prompt(t));
  /* Each data-parallel rank reads its slice of every global window; tp peers read the same. */
  if (o->train_pattern)
    DT_CHECK(dt_dataloader_init(&t->train, o->train_pattern, o->batch, o->seq, t->dprank, t->dpsize,
                                o->grad_accum, t->cfg.vocab, o->shuffle, o->seed));
  if (o->val_pattern)
    DT_CHECK(open_val(t, "--val", o->val_pattern, &t->val, &t->val_windows));
  if (o->val_sets) {
    char bad[512];
    DT_CHECK(dt_valsets_parse(o->val_sets, &t->valsets, bad, sizeof bad)); /* validated */
    for (int i = 0; i < t->valsets.n; i++) {
      char flag[64];
      snprintf(flag, sizeof flag, "--val-sets %s:", t->valsets.name[i]);
      DT_CHECK(open_val(t, flag, t->valsets.pattern[i], &t->vs[i], &t->vs_windows[i]));
    }
  }
  if (o->eval_path)
    DT_CHECK(open_eval(t, window_unit(t->cp, t->model.tp.tp, t->model.sp)));
  if (o->ckpt_dir)
    DT_CHECK(
        prepare_ckpt_dir(o->ckpt_dir, t->resume_from != NULL, dt_link_has_coordinator(o->link)));
  DT_CHECK(dt_dp_create(&t->dp, &t->model, t->plan.dp, t->plan.mp, t->plan.emb, o->zero_stage));
  if (t->devworld) { /* NCCL: one group's operations at a time on the GPU (dp.h) */
    dt_comm_t *mine[] = {t->plan.tp, t->plan.cp, t->plan.pp, t->plan.emb, t->plan.mp};
    for (size_t i = 0; i < sizeof mine / sizeof *mine; i++)
      DT_CHECK(dt_dp_order_before(t->dp, mine[i]));
  }
  if (t->resume_from) {
    DT_CHECK(resume(t));
    if (t->state.threads != omp_get_max_threads())
      DT_WARN(TRAIN,
              "resuming with %d threads; the checkpoint was written with %d: GEMM "
              "rounding differs, so losses match an uninterrupted run only to ~1e-6",
              omp_get_max_threads(), t->state.threads);
    t->state.threads = omp_get_max_threads();
    if (t->state.updates < 0) /* a checkpoint older than the count: --skip-steps says */
      t->state.updates = t->state.step - skipped_through(o, t->state.step);
    DT_CHECK(resume_window(t));
    if (o->train_pattern) {
      /* Checkpoints older than the sequence count: each step read one global batch. */
      if (t->state.data.seqs == 0)
        t->state.data.seqs = t->state.step * t->train.B * t->train.world * t->train.accum;
      DT_CHECK(dt_dataloader_seek(&t->train, t->state.data));
    }
  }
  if (o->ckpt_dir && t->lead) {
    DT_CHECK(discard_incomplete(o->ckpt_dir));
    check_ckpt_space(o, t->state.step, (int64_t)t->model.global_params);
  }
  if (t->train.nsrc > 1) {
    const size_t rows = (size_t)o->grad_accum * o->batch;
    t->mb_src = calloc(rows, sizeof *t->mb_src);
    t->tok_losses = calloc(rows * t->seq, sizeof *t->tok_losses);
    if (!t->mb_src || !t->tok_losses)
      return DT_ENOMEM;
  }
  int slots[DT_GPT2_MAX_CHUNKS] = {1}, nslots = 1;
  if (t->pp > 1) {
    const int K = o->grad_accum;
    t->mb_inputs = calloc((size_t)K * o->batch * t->seq, sizeof(int));
    t->mb_targets = calloc((size_t)K * o->batch * t->seq, sizeof(int));
    if (!t->mb_inputs || !t->mb_targets)
      return DT_ENOMEM;
    DT_CHECK(dt_pipeline_create(&t->pipe, o->pp_schedule, t->pp, t->stage, K, t->plan.stage.chunks,
                                t->plan.pp));
    const int held = dt_pipeline_slots(t->pipe, slots);
    nslots = 0;
    for (int c = 0; c < held; c++)
      nslots += slots[c];
  }
  DT_CHECK(dt_gpt2_set_sequence_parallel(&t->model, o->sequence_parallel));
  DT_CHECK(dt_gpt2_alloc_activations(&t->model, o->batch, t->seq, slots, o->recompute));
  if (o->metrics_path && t->lead) {
    t->metrics = fopen(o->metrics_path, t->resume_from ? "a" : "w");
    if (!t->metrics) {
      DT_ERROR(TRAIN, "%s: cannot open metrics file: %m", o->metrics_path);
      return DT_EACCES;
    }
  }

  const dt_gpt2_config_t *cfg = &t->cfg;
  DT_INFO(TRAIN,
          "model: L=%d NH=%d C=%d V=%d (Vp %d) maxT=%d, %zu parameters; device %s, %d threads, "
          "%s, %s attention",
          cfg->layers, cfg->heads, cfg->channels, cfg->vocab, cfg->padded_vocab, cfg->max_seq,
          t->model.global_params, t->dev->name, omp_get_max_threads(),
          t->model.bf16 ? "bf16 linear layers (fp32 accumulation and master weights)" : "fp32",
          t->model.flash ? (t->model.bf16 ? "bf16 flash" : "flash")
                         : (t->model.bf16 ? "materialized fp32" : "materialized"));
  if (world > 1)
    dt_plan_log(&t->plan, cfg);
  if (t->pp > 1)
    DT_INFO(TRAIN,
            "pipeline: stage %d of %d, schedule %s, %d micro-batches per step, %d activation "
            "slots over %d model chunk%s",
            t->stage, t->pp, dt_pipe_name(o->pp_schedule), o->grad_accum, nslots,
            t->model.stage.chunks, t->model.stage.chunks == 1 ? "" : "s");
  DT_INFO(TRAIN, "activations: %.2f MiB in %d slot%s%s%s; bf16 weight copy %.2f MiB",
          t->model.bytes_acts / (1024.0 * 1024.0), nslots, nslots == 1 ? "" : "s",
          o->recompute ? " (activation checkpointing: layer outputs only)" : "",
          o->sequence_parallel ? " (sequence parallel: residual stream split over tp)" : "",
          t->model.params16 ? t->model.num_params * t->model.ops->bf16_bytes / (1024.0 * 1024.0)
                            : 0.0);
  print_memory(t);
  t->tokens_per_step = (double)o->batch * o->seq * o->grad_accum * t->dpsize;
  char epoch[64] = "a blend";
  if (!t->train.nsrc)
    snprintf(epoch, sizeof epoch, "%lld windows per epoch",
             (long long)dt_dataloader_epoch_windows(&t->train));
  DT_INFO(TRAIN, "batch %d x seq %d x accum %d x dp %d = %.0f tokens/step; %s; steps %lld..%d",
          o->batch, o->seq, o->grad_accum, t->dpsize, t->tokens_per_step, epoch,
          (long long)t->state.step, o->steps);
  log_blend(t);
  log_flops(t);
  log_guard("--spike-factor", o->spike_factor, "loss", t->state.loss_avg, t->state.loss_steps);
  log_guard("--grad-spike-factor", o->grad_spike_factor, "gradient norm", t->state.norm_avg,
            t->state.norm_steps);
  t->sched = o->sched;
  t->sched.total_steps = o->steps;
  return 0;
}

/* The step's micro-batch k from the data loader (and, on a blend, its rows' sources). */
static int next_micro(trainer_t *t, int k)
{
  DT_CHECK(dt_dataloader_next(&t->train));
  if (t->mb_src)
    memcpy(t->mb_src + (size_t)k * t->o->batch, t->train.row_src, t->o->batch * sizeof(int));
  return 0;
}

/* A blend's loss over each source's tokens of the step into sm: every rank knows how many of
 * the step's global sequences each source was dealt (the loader's counts since taken0), the last
 * stage's ranks hold their rows' token losses; each source's share of its mean is summed over
 * the data-parallel (and context-parallel) ranks, then sent from the last stage to the others.
 * A rank's row b of a micro-batch holds positions (j, b, h) of its chunks (chunks_of). */
static int source_losses(trainer_t *t, const int64_t *taken0, dt_step_metrics_t *sm)
{
  const dt_dataloader_t *dl = &t->train;
  const size_t B = (size_t)t->o->batch, N = B * t->seq, K = (size_t)t->o->grad_accum;
  const size_t h = t->cp > 1 ? (size_t)t->seq / 2 : (size_t)t->seq;
  double sum[DT_BLEND_MAX] = {0};
  for (size_t k = 0; k < K && t->model.stage.last; k++)
    for (size_t i = 0; i < N; i++)
      sum[t->mb_src[k * B + (i / h) % B]] += t->tok_losses[k * N + i];
  float mean[DT_BLEND_MAX] = {0};
  for (int d = 0; d < dl->nsrc; d++) {
    const int64_t rows = dl->taken[d] - taken0[d];
    mean[d] = rows ? (float)(sum[d] / ((double)rows * t->o->seq)) : 0.0f;
  }
  DT_CHECK(dt_dp_sum(t->dp, mean, (size_t)dl->nsrc));
  if (t->pp > 1)
    DT_CHECK(dt_comm_broadcast(t->plan.pp, mean, (size_t)dl->nsrc, t->pp - 1));
  sm->n_sources = 0;
  for (int d = 0; d < dl->nsrc; d++)
    if (dl->taken[d] > taken0[d]) {
      sm->source_name[sm->n_sources] = dl->src_name[d];
      sm->source_loss[sm->n_sources++] = mean[d];
    }
  return 0;
}

/* The step's micro-batches through the pipeline. Every stage reads the same micro-batches (the
 * first needs the inputs, the last the targets, all keep the same data position for
 * checkpoints). */
static int pipe_step(trainer_t *t, double *loss_acc, double *bubble)
{
  const dt_train_opts_t *o = t->o;
  const size_t BT = (size_t)o->batch * t->seq;
  for (int k = 0; k < o->grad_accum; k++) {
    DT_CHECK(next_micro(t, k));
    memcpy(t->mb_inputs + k * BT, seq_chunk(t, t->train.inputs, t->cp_inputs), BT * sizeof(int));
    memcpy(t->mb_targets + k * BT, seq_chunk(t, t->train.targets, t->cp_targets), BT * sizeof(int));
  }
  return dt_pipeline_step(t->pipe, &t->model, t->dp, t->mb_inputs, t->mb_targets, o->batch, t->seq,
                          loss_acc, t->tok_losses, bubble);
}

/* A spike guard's average of the recent values (SPIKE_HORIZON, above): x joins it. */
static void note_recent(double *avg, int64_t *n, float x)
{
  ++*n;
  *avg += (x - *avg) / (double)DT_MIN(*n, SPIKE_HORIZON);
}

/* Whether x is over factor times the average of n recent values, once the guard is armed. */
static int spiked(double factor, double avg, int64_t n, float x)
{
  return factor > 0 && n >= SPIKE_HORIZON && x > factor * avg;
}

/* A step of --skip-steps: the batches it would train on are consumed, nothing is updated. */
static int skip_step(trainer_t *t, dt_step_metrics_t *sm)
{
  const dt_train_opts_t *o = t->o;
  for (int k = 0; k < o->grad_accum; k++)
    DT_CHECK(dt_dataloader_next(&t->train));
  t->state.step++;
  t->state.data = t->train.pos;
  *sm = (dt_step_metrics_t){
      .step = t->state.step, .lr = dt_lr_at(&t->sched, (int)t->state.step - 1), .skipped = 1};
  return 0;
}

static int cmp_i64(const void *a, const void *b)
{
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Whether step is in the n ascending steps of v. */
static int listed(const int64_t *v, size_t n, int64_t step)
{
  return n > 0 && bsearch(&step, v, n, sizeof step, cmp_i64) != NULL;
}

/* Whether step is taken without an update: --skip-steps lists it, or a bad step skipped where
 * it was (--bad-step skip) put it in its window. */
static int is_skipped(const trainer_t *t, int64_t step)
{
  return listed(t->o->skip_steps, (size_t)t->o->n_skip_steps, step) ||
         listed(t->here, t->n_here, step);
}

/* Step s + 1 (its batches consumed, its gradients reduced) had a non-finite loss or gradient
 * norm, or a loss spike. Every rank sees the same (averaged) loss and global norm, and keeps the
 * same average of the recent losses, so all come here together. A spike's window: this step's
 * batch and --spike-skip - 1 more, within the run. With --bad-step skip (and not right after
 * the window of the last one) the step and its window are taken without an update here and the
 * run goes on (0, sm a skipped step); else it stops for a rollback (DT_ENAN / DT_ESPIKE). */
static int bad_step(trainer_t *t, float loss, float norm, dt_bad_step_t bad, dt_step_metrics_t *sm)
{
  const dt_train_opts_t *o = t->o;
  const dt_train_state_t *st = &t->state;
  const int s = (int)st->step, spike = bad != DT_BAD_NONFINITE;
  const int nskip = spike ? DT_MIN(o->spike_skip, o->steps - s) : 1;
  const int here = o->bad_step_skip && !(t->here_end > 0 && s + 1 == t->here_end + 1);
  char what[160], skips[96], resume[32], msg[512];
  if (bad == DT_BAD_LOSS_SPIKE)
    snprintf(what, sizeof what,
             "loss %.4f, %.2fx the average of the recent steps' (%.4f; --spike-factor %g): a "
             "spike",
             loss, loss / st->loss_avg, st->loss_avg, o->spike_factor);
  else if (bad == DT_BAD_GRAD_SPIKE)
    snprintf(what, sizeof what,
             "gradient norm %.4f, %.2fx the average of the recent steps' (%.4f; "
             "--grad-spike-factor %g): a spike",
             norm, norm / st->norm_avg, st->norm_avg, o->grad_spike_factor);
  else
    snprintf(what, sizeof what, "loss %g, gradient norm %g: non-finite", loss, norm);
  if (nskip > 1) {
    snprintf(skips, sizeof skips, "the batches of steps %d-%d (--spike-skip %d)", s + 1, s + nskip,
             o->spike_skip);
    snprintf(resume, sizeof resume, "%d:%d", s + 1, nskip);
  } else {
    snprintf(skips, sizeof skips, "this step's batch");
    snprintf(resume, sizeof resume, "%d", s + 1);
  }
  if (here) {
    if (t->n_here + (size_t)nskip > t->cap_here) {
      const size_t cap = DT_MAX(2 * t->cap_here, t->n_here + (size_t)nskip);
      int64_t *grown = realloc(t->here, cap * sizeof *grown);
      if (!grown)
        return DT_ENOMEM;
      t->here = grown, t->cap_here = cap;
    }
    for (int k = 1; k <= nskip; k++) /* after every step skipped before: ascending */
      t->here[t->n_here++] = s + k;
    t->here_end = t->state.skip_until = s + nskip; /* checkpoints inside the window keep it */
    DT_WARN(TRAIN,
            "step %d: %s; skipped where it is: no update (--bad-step skip; %s), training goes on "
            "(another right after rolls back)",
            s + 1, what, nskip > 1 ? skips : "this step only");
    dt_link_skipped(o->link, t->here, t->n_here);
    t->state.step = s + 1;
    t->state.data = t->train.pos;
    *sm = (dt_step_metrics_t){.step = t->state.step, .lr = dt_lr_at(&t->sched, s), .skipped = 1};
    return 0;
  }
  snprintf(msg, sizeof msg,
           "step %d: %s; stopped before the update (under distrainctl the job rolls back to its "
           "last checkpoint and skips %s; alone, resume with --skip-steps %s)%s",
           s + 1, what, skips, resume,
           o->bad_step_skip ? " (right after a step skipped where it was: --bad-step skip)" : "");
  DT_ERROR(TRAIN, "%s", msg);
  dt_link_nonfinite(o->link, s + 1, bad, msg);
  return spike ? DT_ESPIKE : DT_ENAN;
}

/* --profile-trace: the file, its %r replaced by the rank. A failure to write it is logged, not
 * fatal: the training it describes is done. */
static void profile_trace(trainer_t *t)
{
  char path[4096], rank[16];
  const char *name = t->o->profile_trace, *at = strstr(name, "%r");
  snprintf(rank, sizeof rank, "%d", t->o->rank);
  if (at)
    snprintf(path, sizeof path, "%.*s%s%s", (int)(at - name), name, rank, at + 2);
  else
    snprintf(path, sizeof path, "%s", name);
  FILE *f = fopen(path, "w");
  int rc = f ? dt_profile_trace(t->prof, f, t->o->rank) : DT_EIO;
  if (f && fclose(f) != 0)
    rc = DT_EIO;
  if (rc == 0)
    DT_INFO(TRAIN, "profile trace: %s (chrome://tracing, ui.perfetto.dev)", path);
  else
    DT_ERROR(TRAIN, "--profile-trace: cannot write %s: %m", path);
}

/* The --profile table in the log, and on rank 0 in the metrics file; once. */
static void profile_report(trainer_t *t)
{
  const int first = t->o->profile_from, last = first + t->o->profile_steps - 1;
  char what[64];
  if (first == last)
    snprintf(what, sizeof what, "step %d", first);
  else
    snprintf(what, sizeof what, "steps %d-%d", first, last);
  dt_profile_log(t->prof, what);
  if (t->metrics)
    dt_profile_json(t->prof, t->metrics, first, last);
  t->prof_logged = 1;
  if (t->o->profile_trace)
    profile_trace(t);
}

/* One optimizer step: K micro-batches, gradient reduction, norm, clipping, AdamW. */
static int step(trainer_t *t, dt_step_metrics_t *sm)
{
  const dt_train_opts_t *o = t->o;
  const int s = (int)t->state.step;
  if (is_skipped(t, s + 1))
    return skip_step(t, sm);
  double t0 = dt_now_ms(), bubble = 0.0;
  const int profiled =
      t->prof && s + 1 >= o->profile_from && s + 1 < o->profile_from + o->profile_steps;
  if (profiled)
    dt_profile_begin(t->prof, s + 1, t0);
  if (dt_param_FaultSlowMs() > 0)
    dt_sleep_ms((double)dt_param_FaultSlowMs());
  DT_CHECK(dt_dp_zero_grad(t->dp));
  double loss_acc = 0.0;
  int64_t taken0[DT_BLEND_MAX];
  memcpy(taken0, t->train.taken, sizeof taken0);
  if (t->pp > 1)
    DT_CHECK(pipe_step(t, &loss_acc, &bubble));
  for (int k = 0; k < o->grad_accum && t->pp == 1; k++) {
    DT_CHECK(next_micro(t, k));
    dt_dp_begin_micro(t->dp, k == o->grad_accum - 1);
    float micro_loss;
    DT_CHECK(dt_gpt2_forward_backward(&t->model, seq_chunk(t, t->train.inputs, t->cp_inputs),
                                      seq_chunk(t, t->train.targets, t->cp_targets), o->batch,
                                      t->seq, 1.0f / (float)o->grad_accum, &micro_loss));
    if (t->tok_losses) {
      const size_t N = (size_t)o->batch * t->seq;
      memcpy(t->tok_losses + k * N, dt_gpt2_last_losses(&t->model), N * sizeof(float));
    }
    loss_acc += micro_loss;
  }
  DT_CHECK(dt_dp_reduce_grads(t->dp));
  float loss = (float)(loss_acc / o->grad_accum), norm;
  DT_CHECK(from_last_stage(t, &loss));
  DT_CHECK(dt_dp_average(t->dp, &loss));
  DT_CHECK(dt_dp_grad_norm(t->dp, &norm));
  if (dt_param_FaultNanStep() == s + 1)
    loss = NAN; /* fault injection for the rollback tests: every rank sees it, as a real one */
  dt_train_state_t *st = &t->state;
  const dt_bad_step_t bad =
      !isfinite(loss) || !isfinite(norm)                                 ? DT_BAD_NONFINITE
      : spiked(o->spike_factor, st->loss_avg, st->loss_steps, loss)      ? DT_BAD_LOSS_SPIKE
      : spiked(o->grad_spike_factor, st->norm_avg, st->norm_steps, norm) ? DT_BAD_GRAD_SPIKE
                                                                         : DT_BAD_NONE;
  if (bad != DT_BAD_NONE) {
    if (profiled)
      DT_CHECK(dt_profile_end(t->prof));
    return bad_step(t, loss, norm, bad, sm);
  }
  note_recent(&st->loss_avg, &st->loss_steps, loss);
  note_recent(&st->norm_avg, &st->norm_steps, norm);
  float scale = 1.0f;
  if (o->grad_clip > 0.0f) {
    scale = o->grad_clip / (norm + 1e-6f);
    scale = scale > 1.0f ? 1.0f : scale;
  }
  const double lr = dt_lr_at(&t->sched, s);
  const dt_adamw_t h = {.lr = (float)lr,
                        .beta1 = o->beta1,
                        .beta2 = o->beta2,
                        .eps = o->eps,
                        .weight_decay = o->weight_decay};
  DT_CHECK(dt_dp_step(t->dp, &h, scale, (int)++t->state.updates));
  t->state.step = s + 1;
  t->state.data = t->train.pos;
  if (profiled) /* waits for the device: the step's time then includes its last kernels */
    DT_CHECK(dt_profile_end(t->prof));
  const double ms = dt_now_ms() - t0;
  *sm = (dt_step_metrics_t){.step = t->state.step,
                            .loss = loss,
                            .grad_norm = norm,
                            .lr = lr,
                            .ms = ms,
                            .tokens_per_s = t->tokens_per_step * 1000.0 / ms,
                            .comm_ms = dt_dp_take_comm_ms(t->dp),
                            .bubble = bubble};
  if (t->mb_src)
    DT_CHECK(source_losses(t, taken0, sm));
  const int devices = o->world > 1 ? o->world : 1;
  sm->tflops = t->flops_per_token * sm->tokens_per_s / devices / 1e12;
  sm->mfu = t->peak_flops > 0 ? sm->tflops * 1e12 / t->peak_flops : 0.0;
  size_t used, total;
  if (t->dev->memory && t->dev->memory(t->dev, &used, &total) == 0) {
    sm->device_bytes = used;
    if (!t->device_logged)
      device_memory(t, used, total);
  }
  return 0;
}

/* A completed step: every rank tells its agent (the job is RUNNING once all ranks train, and
 * each rank's progress is visible); rank 0 also logs it, writes the metrics file and calls the
 * observers. */
static void report(trainer_t *t, const dt_step_metrics_t *sm)
{
  const dt_train_opts_t *o = t->o;
  if (sm->skipped) {
    if (t->lead)
      DT_WARN(TRAIN,
              "step %5lld/%d | skipped: no update (a non-finite or spiking loss or gradient "
              "norm, or a spike's --spike-skip window)",
              (long long)sm->step, o->steps);
    return;
  }
  if (o->link)
    dt_link_step(o->link, sm);
  if (!t->lead)
    return;
  if (!o->quiet) {
    char valbuf[1024], srcbuf[DT_BLEND_MAX * (DT_NAME_MAX + 16)], mfu[32] = "";
    format_val(valbuf, sizeof valbuf, sm);
    dt_sources_line(srcbuf, sizeof srcbuf, sm->n_sources, sm->source_name, sm->source_loss);
    if (sm->mfu > 0)
      snprintf(mfu, sizeof mfu, " | MFU %.1f%%", 100 * sm->mfu);
    DT_INFO(TRAIN, "step %5lld/%d | loss %.6f%s%s | lr %.3e | norm %.4f | %.1f ms | %.0f tok/s%s",
            (long long)sm->step, o->steps, sm->loss, srcbuf, valbuf, sm->lr, sm->grad_norm, sm->ms,
            sm->tokens_per_s, mfu);
    log_eval(t, sm->step, sm);
  }
  if (t->metrics)
    write_metrics(t->metrics, sm, t->pp > 1);
  if (o->on_step)
    o->on_step(o->on_step_ud, sm);
}

/* Tensor parallelism keeps the replicated parameters (LayerNorms, wpe, row-parallel biases)
 * identical on every tp rank without communicating them: each rank computes their update
 * from bit-identical inputs. Checked at the end of a run: the CRC-32C of each rank's
 * replicated tensors must agree across the tp group, bit for bit. */
static int check_replicated(trainer_t *t, const float *local)
{
  dt_gpt2_t *m = &t->model;
  if (m->tp.tp == 1)
    return 0;
  int ret = 0;
  float *crcs = calloc((size_t)m->tp.tp, sizeof *crcs);
  if (!crcs)
    return DT_ENOMEM;
  uint32_t crc = 0;
  for (int i = 0; i < DT_GPT2_NUM_TENSORS; i++)
    if (m->place[i].split == DT_SPLIT_NONE)
      crc = dt_crc32c(crc, local + m->tensor_offsets[i], m->tensor_sizes[i] * sizeof(float));
  float bits; /* the CRC travels as the bits of a float: gathers copy, never compute */
  memcpy(&bits, &crc, sizeof bits);
  DT_CHECK_GOTO(dt_comm_all_gather(m->tp.comm, &bits, crcs, 1), ret, out);
  for (int r = 0; r < m->tp.tp; r++) {
    uint32_t theirs;
    memcpy(&theirs, &crcs[r], sizeof theirs);
    if (theirs != crc) {
      DT_ERROR(TRAIN,
               "replicated parameters differ between tp ranks %d (CRC-32C %08x) and %d "
               "(%08x): tensor-parallel replicas diverged",
               m->tp.rank, crc, r, theirs);
      ret = DT_EINTERNAL;
      goto out;
    }
  }
  DT_INFO(TRAIN, "replicated parameters identical on all %d tp ranks (CRC-32C %08x, %zu values)",
          m->tp.tp, crc, m->replicated);
out:
  free(crcs);
  return ret;
}

/* Export (collective), after the replica check; both read this rank's local parameters,
 * gathered over the dp group once. */
static int check_and_export(trainer_t *t)
{
  const dt_train_opts_t *o = t->o;
  dt_gpt2_t *m = &t->model;
  if (m->tp.tp == 1 && !o->export_llmc)
    return 0;
  int ret = 0;
  float *global = NULL;
  float *local = dt_calloc_aligned(m->num_params * sizeof(float), "local parameters");
  if (!local)
    return DT_ENOMEM;
  DT_CHECK_GOTO(dt_dp_gather_params(t->dp, local), ret, out);
  DT_CHECK_GOTO(check_replicated(t, local), ret, out);
  if (!o->export_llmc)
    goto out;
  if (t->plan.mp) {
    if (!(global = malloc(m->global_params * sizeof(float)))) {
      ret = DT_ENOMEM;
      goto out;
    }
    DT_CHECK_GOTO(gather_global(t, local, global), ret, out);
  }
  if (t->lead) {
    DT_CHECK_GOTO(
        dt_llmc_save_params(&t->cfg, global ? global : local, m->global_params, o->export_llmc),
        ret, out);
    DT_INFO(TRAIN, "exported llm.c checkpoint %s", o->export_llmc);
  }
out:
  free(global);
  dt_free_aligned(local);
  return ret;
}

/* A sample's prompt: --prompt's tokens, else the first sequence of --val, else of --train (read
 * again from its start: after the last step only), up to 32 tokens. */
static int sample_prompt(trainer_t *t, const int **prompt, int *plen)
{
  const dt_train_opts_t *o = t->o;
  if (t->prompt) {
    *prompt = t->prompt;
    *plen = t->prompt_n;
    return 0;
  }
  dt_dataloader_t *src = o->val_pattern ? &t->val : &t->train;
  DT_CHECK(dt_dataloader_reset(src));
  DT_CHECK(dt_dataloader_next(src));
  *prompt = src->inputs;
  *plen = o->seq < 32 ? o->seq : 32;
  return 0;
}

/* --sample-every: a sample after this step, drawn from an RNG of its own (seeded by the run's
 * seed and the step), so that the run's state, data and results are those of a run without it.
 * Every rank generates (generate: its forwards are collective); rank 0 prints. */
static int sample_during(trainer_t *t)
{
  const int *prompt;
  int plen;
  DT_CHECK(sample_prompt(t, &prompt, &plen));
  dt_rng_t rng;
  dt_rng_seed(&rng, t->o->seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)t->state.step));
  return generate(t, prompt, plen, t->o->sample_tokens, &rng, t->lead, t->state.step);
}

/* After the last step: the replica check and export, sampling (all collective), then the
 * summary. */
static int finish(trainer_t *t)
{
  const dt_train_opts_t *o = t->o;
  DT_CHECK(check_and_export(t));
  if (o->sample_tokens > 0) {
    const int *prompt;
    int plen;
    DT_CHECK(sample_prompt(t, &prompt, &plen));
    DT_CHECK(generate(t, prompt, plen, o->sample_tokens, &t->state.rng, t->lead, 0));
  }
  if (t->pipe) {
    double busy, idle;
    dt_pipeline_times(t->pipe, &busy, &idle);
    /* A later stage's pipeline time ends with its last transfer, before the flush ends on the
     * first stage: it waits for the rest after the pipeline, in the step's next collective. */
    DT_INFO(TRAIN,
            "pipeline stage %d, steps after the first: busy %.1f ms, waiting %.1f ms: bubble "
            "%.1f%% (a balanced %s pipeline: %.1f%%%s)",
            t->stage, busy, idle, 100.0 * idle / DT_MAX(busy + idle, 1e-9),
            dt_pipe_name(o->pp_schedule),
            100.0 * dt_pipe_ideal_bubble(t->pp, o->grad_accum, t->model.stage.chunks),
            t->stage ? "; this stage's wait for the flush comes after its pipeline time" : "");
  }
  if (t->prof && !t->prof_logged) /* the run ended (or began) inside the profiled steps */
    profile_report(t);
  DT_INFO(TRAIN, "done: %lld steps, peak RSS %.1f MiB", (long long)t->state.step, peak_rss_mb());
  return 0;
}

/* A failure to set up that the job's input causes: the same on every restart. */
static int input_error(int rc)
{
  return rc == DT_EINVAL || rc == DT_ENOENT || rc == DT_EFORMAT || rc == DT_ESHAPE ||
         rc == DT_ERANGE || rc == DT_EACCES || rc == DT_EEXIST || rc == DT_ENOTSUP;
}

static void teardown(trainer_t *t)
{
  save_wait(t);
  dt_free_aligned(t->snap);
  if (t->metrics)
    fclose(t->metrics);
  dt_dp_destroy(t->dp);
  dt_dataloader_free(&t->train);
  dt_dataloader_free(&t->val);
  for (int i = 0; i < t->valsets.n; i++)
    dt_dataloader_free(&t->vs[i]);
  dt_valsets_free(&t->valsets);
  dt_evalset_free(&t->evalset);
  free(t->eval_order);
  if (t->eval_out)
    fclose(t->eval_out);
  dt_bpe_destroy(t->bpe);
  free(t->prompt);
  /* The communicators before the model: a pipeline receive a failed step left in flight
   * (dt_comm_p2p_post) writes into the model's buffers until its communicator is gone. */
  dt_plan_destroy(&t->plan);
  dt_comm_destroy(t->devworld);
  dt_comm_destroy(t->world);
  dt_gpt2_destroy(&t->model);
  dt_pipeline_destroy(t->pipe);
  free(t->mb_inputs);
  free(t->mb_targets);
  free(t->mb_src);
  free(t->tok_losses);
  free(t->here);
  free(t->cp_inputs);
  free(t->cp_targets);
  dt_profile_destroy(t->prof);
  dt_train_device_close(t->opened);
}

/* At the end of every step, agreed by every rank (summed over the world at the same point, so
 * that all of them act after the same step): whether any rank was asked to stop (stop.h), and
 * whether --save-every-s has passed since the last save began (rank 0's clock decides). */
static int step_agreed(trainer_t *t, int *stop, int *save_due)
{
  const double every_ms = 1000.0 * t->o->save_every_s;
  float flag[2] = {dt_stop_requested() ? 1.0f : 0.0f,
                   t->lead && every_ms > 0 && dt_now_ms() - t->saved_ms >= every_ms ? 1.0f : 0.0f};
  if (t->world)
    DT_CHECK(dt_comm_all_reduce(t->world, flag, 2, DT_COMM_SUM));
  *stop = flag[0] > 0.0f;
  *save_due = flag[1] > 0.0f;
  return 0;
}

/* Whether the save of the step the run ends at was abandoned, a writer's disk full: that
 * writer knows, and the rank that completed the step (rank 0 standalone, under a coordinator
 * the writer whose report came last); every rank learns it here, so that all end alike. */
static int unsaved_agreed(trainer_t *t)
{
  float flag = t->unsaved_step && t->unsaved_step == t->state.step ? 1.0f : 0.0f;
  if (t->world)
    DT_CHECK(dt_comm_all_reduce(t->world, &flag, 1, DT_COMM_SUM));
  t->unsaved_step = flag > 0.0f ? t->state.step : 0;
  return 0;
}

/* Whether every writer's disk has room for its shard now, whether the wait is over (rank 0's
 * clock decides for all) and whether any rank was asked to stop: agreed by every rank. */
static int room_agreed(trainer_t *t, double deadline, int *room, int *over, int *stop)
{
  float v[3] = {0.0f, t->lead && dt_now_ms() >= deadline ? 1.0f : 0.0f,
                dt_stop_requested() ? 1.0f : 0.0f};
  struct statvfs fs;
  if (t->shard_mib > 0 && (statvfs(t->o->ckpt_dir, &fs) != 0 ||
                           (double)fs.f_bavail * fs.f_frsize / (1 << 20) < t->shard_mib))
    v[0] = 1.0f;
  if (t->world)
    DT_CHECK(dt_comm_all_reduce(t->world, v, 3, DT_COMM_SUM));
  *room = v[0] == 0.0f;
  *stop = v[2] > 0.0f;
  *over = v[1] > 0.0f || *stop;
  return 0;
}

/* The run's last save was abandoned (unsaved_agreed): rather than fail and lose the steps since
 * the newest committed, every rank waits up to --last-save-wait seconds, looking each second
 * whether every writer's disk has room for its shard; when they do, the step is written again
 * from the state still in memory (a try that finds a disk full again is abandoned like the
 * first, and the next waits twice as long, up to 30 s, for disks shared by several writers).
 * A stop requested meanwhile ends the wait (*stop): the run ends as stopped. */
static int wait_for_room(trainer_t *t, int *stop)
{
  const dt_train_opts_t *o = t->o;
  const double t0 = dt_now_ms(), deadline = t0 + 1000.0 * o->last_save_wait;
  if (t->lead)
    DT_WARN(CKPT,
            "the run's last checkpoint, of step %lld, was not saved (a writer's disk is full): "
            "waiting up to %d s for room in %s to write it again (--last-save-wait, "
            "checkpoint.last_save_wait_s)",
            (long long)t->state.step, o->last_save_wait, o->ckpt_dir);
  double gap_s = 1.0;
  int room, over = 0;
  while (t->unsaved_step && !over) {
    DT_CHECK(room_agreed(t, deadline, &room, &over, stop));
    if (room && !over) {
      t->save_try++;
      DT_CHECK(save_checkpoint(t));
      DT_CHECK(save_wait(t));
      DT_CHECK(unsaved_agreed(t));
      if (t->unsaved_step)
        gap_s = gap_s * 2 < 30.0 ? gap_s * 2 : 30.0;
    }
    if (t->unsaved_step && !over)
      usleep((useconds_t)(gap_s * 1e6));
  }
  if (!t->unsaved_step && t->lead)
    DT_INFO(CKPT, "the run's last checkpoint, of step %lld, is saved: written again after %.0f s",
            (long long)t->state.step, (dt_now_ms() - t0) / 1000.0);
  return 0;
}

/* The end of a requested stop. Past the barrier every rank's save has returned, so the last
 * shard is in and the step committed (or abandoned, as every rank knows) before any rank
 * exits: a restart resumes from it. A stop does not wait for room (its grace period is short):
 * a save abandoned ends it all the same, and the restart resumes from the newest committed. */
static int stopped(trainer_t *t)
{
  if (t->world)
    DT_CHECK(dt_comm_barrier(t->world));
  char from[64];
  if (t->lead && t->unsaved_step) {
    resumes_from(t->o->ckpt_dir, from, sizeof from);
    DT_ERROR(CKPT,
             "stopped on request after step %lld of %d: its checkpoint was not saved (a "
             "writer's disk is full in %s): a restart (--resume) resumes from %s",
             (long long)t->state.step, t->o->steps, t->o->ckpt_dir, from);
  } else if (t->lead) {
    DT_WARN(TRAIN, "stopped on request after step %lld of %d: %s", (long long)t->state.step,
            t->o->steps,
            t->o->ckpt_dir ? "its checkpoint is committed (continue with --resume)"
                           : "nothing saved (no --ckpt-dir)");
  }
  return DT_TRAIN_STOPPED;
}

/* The run's last save was abandoned, its disk full, and no room came while it waited: the run
 * fails rather than end as if saved, and the job is not restarted either (a restart would train
 * the same steps to the same full disk): the user frees space and resumes it. */
static int last_save_missing(trainer_t *t)
{
  char from[64], waited[64] = "";
  resumes_from(t->o->ckpt_dir, from, sizeof from);
  if (t->o->last_save_wait > 0)
    snprintf(waited, sizeof waited, " and no room came in %d s", t->o->last_save_wait);
  DT_ERROR(CKPT,
           "the run's last checkpoint, of step %lld, was not saved (a writer's disk is full%s): "
           "the run fails rather than end without it. Free space in %s and resume it "
           "(--resume; distrainctl resume JOB) from %s",
           (long long)t->state.step, waited, t->o->ckpt_dir, from);
  dt_link_input_error(t->o->link);
  return DT_ENOSPC;
}

int dt_train_run(const dt_train_opts_t *o)
{
  trainer_t t;
  memset(&t, 0, sizeof t);
  int ret = setup(&t, o);
  if (input_error(ret))
    dt_link_input_error(o->link);
  if (ret == 0 && (o->val_every > 0 || o->eval_path) && t.state.step == 0) {
    /* The starting point, so that the fall of the validation loss is visible. */
    dt_step_metrics_t s0 = {0};
    if (o->val_every > 0)
      ret = validate(&t, &s0);
    if (ret == 0 && o->val_every > 0 && !o->quiet && t.lead) {
      char val[1024];
      format_val(val, sizeof val, &s0);
      DT_INFO(TRAIN, "step %5d/%d%s (before training)", 0, o->steps, val);
    }
    if (ret == 0 && o->eval_path)
      ret = evaluate_choices(&t, 0, &s0);
    log_eval(&t, 0, &s0);
    if (ret == 0 && o->link) /* step 0: its validation and evaluation, no training */
      dt_link_step(o->link, &s0);
    if (ret == 0 && t.metrics) {
      fprintf(t.metrics, "{\"step\": 0");
      write_evals(t.metrics, &s0);
      fprintf(t.metrics, "}\n");
      fflush(t.metrics);
    }
  }
  const int end = o->stop_at > 0 && o->stop_at < o->steps ? o->stop_at : o->steps;
  int stop = 0, save_due = 0;
  t.saved_ms = dt_now_ms(); /* --save-every-s counts from the first step */
  while (ret == 0 && t.state.step < end && !stop) {
    dt_step_metrics_t sm;
    DT_CHECK_GOTO(step(&t, &sm), ret, out);
    DT_CHECK_GOTO(step_agreed(&t, &stop, &save_due), ret, out);
    const int last = t.state.step == end;
    if (o->val_every > 0 && (t.state.step % o->val_every == 0 || last))
      DT_CHECK_GOTO(validate(&t, &sm), ret, out);
    if (o->eval_path && ((o->eval_every > 0 && t.state.step % o->eval_every == 0) || last))
      DT_CHECK_GOTO(evaluate_choices(&t, t.state.step, &sm), ret, out);
    report(&t, &sm);
    if (o->sample_every > 0 && t.state.step % o->sample_every == 0 && t.state.step < o->steps)
      DT_CHECK_GOTO(sample_during(&t), ret, out); /* the last step's comes after the run */
    if (t.prof && t.state.step == o->profile_from + o->profile_steps - 1)
      profile_report(&t);
    if (o->ckpt_dir &&
        ((o->save_every > 0 && t.state.step % o->save_every == 0) || last || stop || save_due))
      DT_CHECK_GOTO(save_checkpoint(&t), ret, out);
  }
  if (ret == 0)
    ret = save_wait(&t); /* the last checkpoint is committed before the run ends */
  if (ret == 0 && o->ckpt_dir)
    ret = unsaved_agreed(&t);
  if (ret == 0 && t.state.step < end) {
    ret = stopped(&t);
  } else if (ret == 0) {
    if (t.unsaved_step && o->last_save_wait > 0)
      ret = wait_for_room(&t, &stop);
    if (ret == 0 && t.unsaved_step && stop)
      ret = stopped(&t);
    else if (ret == 0)
      ret = t.unsaved_step ? last_save_missing(&t) : finish(&t);
  }
out:
  teardown(&t);
  return ret;
}
