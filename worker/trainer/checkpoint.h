/* checkpoint.h — model files: llm.c fp32 checkpoints in and out, and distrain's own sharded
 * training checkpoints (weights, AdamW moments, step, data position, RNG).
 *
 * distrain checkpoint layout:
 *   <dir>/step-<S, 8 digits>/shard-<rank>-of-<world>.bin   one per writer, a flat range
 *   <dir>/step-<S>/MANIFEST                                 written last: commits step S
 * Each shard file is written to a temporary name, fsynced and renamed; the manifest lists every
 * shard with its size and CRC-32C and is itself written atomically, so a step directory without
 * a MANIFEST is an incomplete save that loaders ignore. A shard holds a list of runs (global
 * offset in llm.c's flat layout, length) and their parameters and moments: a data-parallel
 * ZeRO shard is one run, a tensor-parallel rank's part of the model many (one per row block or
 * per row of a split matrix). Replicated tensors are written by one writer only, so the shards
 * hold every parameter exactly once, and any layout (dp, tp, ZeRO stage) loads any other's
 * checkpoint: a loader asks for the global runs of its own part and verifies it got all of them.
 * The manifest's [lo, hi) ranges tile the concatenation of the shards. */
#ifndef DT_TRAINER_CHECKPOINT_H
#define DT_TRAINER_CHECKPOINT_H

#include <stdint.h>

#include "checkpoint_manifest.h"
#include "dataloader.h"
#include "gpt2.h"
#include "rng.h"

#define DT_LLMC_MAGIC   20240326
#define DT_LLMC_VERSION 3 /* fp32 weights */

#define DT_CKPT_MAGIC 0x4B435444u /* "DTCK" little-endian */

/* Training state saved beside the weights. */
typedef struct {
  int64_t step; /* optimizer steps completed */
  dt_data_pos_t data;
  dt_rng_t rng;
  int threads; /* compute threads of the run that wrote it */
  /* The recent training losses, for --spike-factor (trainer.c): an exponential moving average
   * over the losses of loss_steps updated steps (0 in checkpoints older than the field). */
  double loss_avg;
  int64_t loss_steps;
  double norm_avg; /* the same of the gradient norms, for --grad-spike-factor */
  int64_t norm_steps;
  /* --bad-step skip: the last step of the window of steps skipped where they were, when it is
   * past step (a resumed run skips the rest of it); 0 for none (and in older checkpoints) */
  int64_t skip_until;
  /* AdamW updates through step: steps taken without one (--skip-steps, a bad step skipped in
   * place) are not counted; -1 read from a checkpoint older than the field */
  int64_t updates;
} dt_train_state_t;

/* Parameters of a model of config cfg in llm.c's flat layout (DT_GPT2_TENSORS; wte padded). */
int64_t dt_llmc_num_params(const dt_gpt2_config_t *cfg);
/* Reads only the config from an llm.c checkpoint header. */
int dt_llmc_read_config(const char *path, dt_gpt2_config_t *cfg);
/* Loads llm.c weights into a model created with the same config. */
int dt_llmc_load(dt_gpt2_t *m, const char *path);
/* Reads an llm.c checkpoint's config and weights (*params: malloc'ed, llm.c's flat layout). */
int dt_llmc_read(const char *path, dt_gpt2_config_t *cfg, float **params);
/* Exports the weights in llm.c format (version 3, fp32). */
int dt_llmc_save(const dt_gpt2_t *m, const char *path);
/* Same, from a flat buffer of n parameters (e.g. gathered from ZeRO-3 shards). */
int dt_llmc_save_params(const dt_gpt2_config_t *cfg, const float *params, size_t n,
                        const char *path);

/* A writer's flat range [lo, hi) of the weights and (optionally) the AdamW moments; the
 * pointers address element lo. m and v NULL: weights only (cannot be resumed from). */
typedef struct {
  int64_t lo, hi;
  const float *params, *m, *v;
} dt_ckpt_range_t;

/* Writes one shard of step state->step: the runs (global offset, length) of a rank's part of
 * the model, their data read at params/m/v + run.local (m and v NULL: weights only). lo is the
 * shard's start in the concatenation of all writers' shards (the range the manifest tiles).
 * Refuses an already committed step. */
int dt_ckpt_write_runs(const dt_gpt2_config_t *cfg, int64_t num_params,
                       const dt_train_state_t *state, const char *dir, int rank, int world,
                       int64_t lo, const dt_gpt2_run_t *runs, size_t nruns, const float *params,
                       const float *m, const float *v, dt_ckpt_shard_info_t *info);
/* Writes one shard of step state->step holding the global range rg. Refuses an already
 * committed step. */
int dt_ckpt_write_range(const dt_gpt2_config_t *cfg, int64_t num_params,
                        const dt_train_state_t *state, const char *dir, int rank, int world,
                        const dt_ckpt_range_t *rg, dt_ckpt_shard_info_t *info);
/* Loads the flat range [lo, hi) of a committed step (any number of writers, any ranges) into
 * params/m/v (each (hi - lo) floats, addressing element lo; m or v may be NULL), verifying
 * every shard's size and checksum and that the model config is want's. */
int dt_ckpt_load_range(const char *path, const dt_gpt2_config_t *want, int64_t num_params,
                       int64_t lo, int64_t hi, float *params, float *m, float *v,
                       dt_train_state_t *state);

/* Loads the wanted runs (global offset, length) of a committed step (any writers, any
 * layout) into params/m/v + run.local (m or v may be NULL), verifying every shard's size and
 * checksum, that the model config is want's, and that every wanted element was found. */
int dt_ckpt_load_runs(const char *path, const dt_gpt2_config_t *want, int64_t num_params,
                      const dt_gpt2_run_t *runs, size_t nruns, float *params, float *m, float *v,
                      dt_train_state_t *state);

/* Writes this writer's shard of step state->step: the flat range [lo, hi) of the weights and,
 * when the model has them, the AdamW moments. Refuses to touch an already committed step. */
int dt_ckpt_write_shard(const dt_gpt2_t *m, const dt_train_state_t *state, const char *dir,
                        int rank, int world, int64_t lo, int64_t hi, dt_ckpt_shard_info_t *info);
/* Loads a committed step (weights, moments, state), verifying sizes, checksums and that the
 * checkpoint's model config equals m's. path is a checkpoint dir (newest step) or a step dir. */
int dt_ckpt_load(dt_gpt2_t *m, dt_train_state_t *state, const char *path);
/* Loads only the weights of a committed step (path: a checkpoint dir, its newest step, or a step
 * dir; any layout it was written in) into m, whatever m's layout: how --init ckpt: starts a run
 * from them, AdamW's moments, the step count and the data position afresh (fine-tuning). *step:
 * the step loaded. */
int dt_ckpt_load_weights(dt_gpt2_t *m, const char *path, int64_t *step);
/* Reads the model config of a committed checkpoint (dir or step dir). */
int dt_ckpt_read_config(const char *path, dt_gpt2_config_t *cfg);

#endif
