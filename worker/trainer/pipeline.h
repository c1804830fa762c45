/* pipeline.h — runs a stage's part of a training step by its schedule (schedule.h): the
 * forward and backward passes of the step's micro-batches through the model's activation slots,
 * and the transfers of activations and their gradients to and from the neighbouring stages over
 * the pipeline communicator (a transfer waits for its sends; each receive is waited for only
 * before the op that reads it, as Megatron-LM overlaps its pipeline exchanges). Also the
 * forward-only pass of evaluation, and the time the stage spent computing and waiting. */
#ifndef DT_TRAINER_PIPELINE_H
#define DT_TRAINER_PIPELINE_H

#include "comm.h"
#include "dp.h"
#include "gpt2.h"
#include "schedule.h"

typedef struct dt_pipeline dt_pipeline_t;

/* Stage s of p (the model's stage, with v chunks) running m micro-batches per step by schedule
 * kind (arguments checked with dt_pipe_check); comm is the pipeline group (its rank s is this
 * stage; NULL when p == 1). */
int dt_pipeline_create(dt_pipeline_t **out, dt_pipe_kind_t kind, int p, int s, int m, int v,
                       dt_comm_t *comm);
void dt_pipeline_destroy(dt_pipeline_t *pl);
/* The activation slots each chunk needs into slots (v entries); returns v. */
int dt_pipeline_slots(const dt_pipeline_t *pl, int *slots);

/* One step: micro-batch i is (inputs, targets) + i*B*T. Gradients of each micro-batch's mean
 * loss / m accumulate (dp is told before each pass which micro-batch is the step's last);
 * *loss_sum gets the last stage's sum of micro-batch losses (0 on the other stages), the last
 * stage's token_losses + i*B*T micro-batch i's per-token losses (when not NULL; the other
 * stages' are left alone), *bubble the share of the step this stage waited for its
 * neighbours. */
int dt_pipeline_step(dt_pipeline_t *pl, dt_gpt2_t *m, dt_dp_t *dp, const int *inputs,
                     const int *targets, int B, int T, double *loss_sum, float *token_losses,
                     double *bubble);
/* One micro-batch forward through the stages (every chunk in turn), without gradients
 * (evaluation), in each chunk's slot 0: *loss is the mean loss on the last stage, 0
 * elsewhere. Without targets (NULL: text generation) the last stage ends with the logits in
 * its last chunk's slot 0, and *loss is 0. */
int dt_pipeline_eval(dt_pipeline_t *pl, dt_gpt2_t *m, const int *inputs, const int *targets, int B,
                     int T, float *loss);
/* Milliseconds computing and waiting over the steps after the first (allocation and page
 * faults make the first unrepresentative). */
void dt_pipeline_times(const dt_pipeline_t *pl, double *busy_ms, double *idle_ms);

#endif
