/* trainer.h — the training loop behind distrain-train: options, the learning rate schedule,
 * and dt_train_run (setup: plan, model, data, resume; steps with gradient accumulation,
 * clipping, AdamW; validation; checkpoints; finish: export, sampling). One process, or one rank
 * of a tp x dp mesh. The CLI (main.c) only fills the options. */
#ifndef DT_TRAINER_TRAINER_H
#define DT_TRAINER_TRAINER_H

#include <stdint.h>
#include <stdio.h>

#include "blend.h"
#include "gpt2.h"
#include "mesh.h"
#include "schedule.h"

typedef enum {
  DT_SCHEDULE_CONSTANT = 0,
  DT_SCHEDULE_COSINE = 1,
  DT_SCHEDULE_LINEAR = 2,
  DT_SCHEDULE_WSD = 3,
} dt_schedule_t;

typedef struct {
  double lr, min_lr_frac; /* min_lr = lr * min_lr_frac (the floor of the decays) */
  double decay_frac;      /* wsd: the share of the steps after warmup spent decaying */
  int warmup;             /* linear warmup steps */
  int total_steps;
  dt_schedule_t schedule;
} dt_lr_schedule_t;

/* Learning rate of 0-based step s: linear warmup lr*(s+1)/warmup, then over the D steps from
 * warmup to total_steps (progress p = (s - warmup) / D):
 *   constant  lr
 *   cosine    min_lr + (lr - min_lr) (1 + cos(pi p)) / 2   (nanoGPT, llm.c, Megatron's cosine)
 *   linear    min_lr + (lr - min_lr) (1 - p)               (Megatron's linear)
 *   wsd       warmup-stable-decay: lr until the last round(decay_frac D) steps (at least 1),
 *             then linearly down to min_lr over them, as linear does over D
 * p is capped at 1: steps past total_steps stay at min_lr. */
double dt_lr_at(const dt_lr_schedule_t *sch, int s);
/* The schedule named "constant", "cosine", "linear" or "wsd"; -1 for another name. */
int dt_lr_schedule_parse(const char *name, dt_schedule_t *out);

/* What made a step bad: it stops before its update (a rollback, or --bad-step skip). */
typedef enum {
  DT_BAD_NONE,
  DT_BAD_NONFINITE,  /* a NaN/Inf loss or gradient norm */
  DT_BAD_LOSS_SPIKE, /* a loss over --spike-factor x the recent steps' average */
  DT_BAD_GRAD_SPIKE, /* a gradient norm over --grad-spike-factor x the recent steps' average */
} dt_bad_step_t;

/* Per-step figures, as written to --metrics (step is 1-based: steps completed). */
typedef struct {
  int64_t step;
  float loss, grad_norm;
  double lr, ms, tokens_per_s;
  double comm_ms; /* exposed (not overlapped) communication in this step */
  double bubble;  /* pipeline: the share of the step this stage waited for its neighbours */
  int has_val;
  float val_loss;
  int n_sources; /* training on a blend of several sources: the step's loss over each one's
                    tokens, in the blend's order, of the sources dealt rows this step */
  const char *source_name[DT_BLEND_MAX];
  float source_loss[DT_BLEND_MAX];
  int n_val_sets; /* --val-sets evaluated after this step: their names and losses, in order */
  const char *val_set_name[DT_VALSETS_MAX];
  float val_set_loss[DT_VALSETS_MAX];
  int has_eval;             /* a multiple-choice evaluation ran after this step */
  int eval_n, eval_correct; /* examples, and those whose right completion had the lowest */
  int eval_correct_norm;    /* total loss (acc), mean loss (acc_norm) */
  int skipped;              /* a step of --skip-steps: its batch consumed, no update, no loss */
  uint64_t device_bytes;    /* GPU memory in use after the step (dt_device_t.memory); 0 on a CPU */
  double tflops;            /* model TFLOP/s per device: (6 P + 12 L C T) x tokens/s / ranks */
  double mfu;               /* tflops / the device's peak; 0 when the peak is unknown */
} dt_step_metrics_t;

typedef struct {
  /* model: either from init_llmc / a checkpoint, or these (the config must agree with a file) */
  dt_gpt2_config_t model;
  int model_set_mask;    /* which model fields were given explicitly (bit per field) */
  const char *init_llmc; /* llm.c weights to start from */
  const char *init_hf;   /* or Hugging Face's GPT-2 directory (hf.h) */
  const char *init_ckpt; /* or a distrain checkpoint's weights only (dt_ckpt_load_weights) */
  uint64_t seed;         /* init seed, and the data shuffle seed */
  /* data */
  const char *train_pattern, *val_pattern;
  /* named validation sets, "NAME=GLOB,..." (blend.h): each validated as --val is, its loss
   * reported alone under its name */
  const char *val_sets;
  int shuffle, val_every, val_batches;
  /* a multiple-choice eval (evalset.h), evaluated before training (from step 0), after the
   * last step and every eval_every steps (0: only those two); eval_out: each evaluation's
   * per-example losses as JSON lines (rank 0 appends them) */
  const char *eval_path, *eval_out;
  int eval_every;
  /* batch */
  int batch, seq, grad_accum, steps;
  int stop_at; /* > 0: stop (with a checkpoint) once this step is reached, e.g. before a
                  scheduler's time limit; the schedule still runs to steps */
  /* Steps taken without an update (--skip-steps; the coordinator's rollback after a NaN/Inf
   * loss or gradient norm): the batches are consumed and the learning-rate schedule moves on;
   * AdamW's bias correction counts the updates made. Ascending. */
  const int64_t *skip_steps;
  int n_skip_steps;
  /* optimizer */
  dt_lr_schedule_t sched;
  float beta1, beta2, eps, weight_decay, grad_clip;
  /* checkpoints */
  const char *ckpt_dir;
  int save_every, keep;
  int save_every_s;        /* > 0: also save once this many seconds have passed since the last */
  int keep_every;          /* > 0: the steps it divides are kept whatever keep says (milestones) */
  int ckpt_sync;           /* write checkpoints in the step, not on a thread of their own */
  int last_save_wait;      /* s the run's last save waits for room on a full disk (0: fails) */
  int resume;              /* resume from the newest committed step (of resume_path or ckpt_dir) */
  const char *resume_path; /* a checkpoint dir or step dir; NULL means ckpt_dir */
  const char *export_llmc;
  /* output */
  const char *metrics_path;
  double peak_tflops; /* a device's peak for the MFU (0: a known GPU's bf16 peak under bf16) */
  /* --profile S[:N]: time every kernel of steps S..S+N-1 (profile.h) and log the table after
   * them (rank 0 also into the metrics file); 0: off */
  int profile_from, profile_steps;
  /* --profile-trace FILE: those steps' kernel calls as a Chrome trace ("%r": the rank) */
  const char *profile_trace;
  int sample_tokens;
  float sample_temp;
  int sample_top_k;       /* draw among the k most likely tokens (0: all) */
  float sample_top_p;     /* ... and the fewest of those holding this much probability (1: all) */
  int sample_no_cache;    /* every token from a forward of its whole window (no key/value cache) */
  int sample_every;       /* also sample after every this many steps (0: at the end only) */
  const char *vocab_file; /* GPT-2 BPE vocab.json to print the sample with (tokenizer.h) */
  const char *merge_file; /* and its merges.txt, to encode the prompt with */
  const char *prompt;     /* the sample's prompt (NULL: the first sequence of --val or --train) */
  /* a step whose loss exceeds this times the recent steps' average stops before its update,
   * as a non-finite one does (0: off) */
  double spike_factor;
  double grad_spike_factor; /* the same of the global gradient norm (before clipping) */
  int spike_skip;    /* and its batch and the next spike_skip - 1 are skipped after the rollback */
  int bad_step_skip; /* --bad-step skip: such a step (and its window) is taken without an update
                        where it is, with no rollback; one right after such a window rolls back */
  int threads;
  int quiet;
  const char *device; /* "cpu", "cuda", "auto" (NULL) or "cpu-remote" (devices.h) */
  /* the backend of the model's collectives (world > 1): "cpu" (host-staged on a GPU), "nccl",
   * or "auto" (NULL): nccl when every rank can use it (dt_train_device_comm_able) */
  const char *comm;
  /* "fp32" (NULL) or "bf16": linear layers as bf16 GEMMs with fp32 accumulation, fp32 master
   * weights and everything else (dt_gpt2_set_precision) */
  const char *precision;
  /* "flash" (NULL) or "materialized": the attention kernels (dt_gpt2_set_attention) */
  const char *attention;
  /* the agent/coordinator link (link.h), NULL when standalone */
  struct dt_link *link;
  /* parallelism: this process's rank in a world of `world` (1: one process), the rendezvous
   * store and key prefix its communicators meet under (also used to commit multi-writer
   * checkpoints when standalone), the mesh (tp 0: dp = world / tp), the tensor- and pipeline-
   * parallel degrees and the pipeline schedule, and the ZeRO stage (0..3) over the dp groups */
  int rank, world;
  const struct dt_kv *kv;
  const char *kv_prefix;
  dt_mesh_t mesh;
  int tp, pp, cp;             /* --tp, --pp, --cp (0: not given) */
  dt_pipe_kind_t pp_schedule; /* pipeline schedule (pp > 1) */
  int pp_virtual;             /* model chunks per stage (interleaved; 0: 2 there, else 1) */
  const char *pp_partition;   /* layers per stage, "3,1"; NULL: balanced by cost */
  int zero_stage;
  int recompute;         /* activation checkpointing */
  int sequence_parallel; /* Megatron-SP over the tp group */
  /* observer for tests: called after every step */
  void (*on_step)(void *ud, const dt_step_metrics_t *m);
  void *on_step_ud;
} dt_train_opts_t;

enum {
  DT_MODEL_LAYERS = 1,
  DT_MODEL_HEADS = 2,
  DT_MODEL_CHANNELS = 4,
  DT_MODEL_VOCAB = 8,
  DT_MODEL_MAXSEQ = 16,
};

/* The defaults: the demo's tiny byte-level model and llm.c's optimizer settings. */
void dt_train_opts_default(dt_train_opts_t *o);
/* Checks the options; writes a one-line reason on failure. */
int dt_train_opts_validate(const dt_train_opts_t *o, char *why, size_t whylen);
/* dt_train_run's result when a stop signal ended the run early (stop.h): every rank stopped
 * after the same step, whose checkpoint (with --ckpt-dir) is committed. */
#define DT_TRAIN_STOPPED 1
/* Runs training to o->steps. 0 on success, DT_TRAIN_STOPPED, or a negative DT_E* (the reason
 * is logged). */
int dt_train_run(const dt_train_opts_t *o);

#endif
