/* dp.h — data parallelism and ZeRO sharding over a communicator.
 *
 * Sharding is by flat ranges of the rank's local parameter buffer (its tensor-parallel and
 * pipeline part of the model; the whole model without them): with P local parameters and N
 * ranks in the data-parallel group, rank r owns
 * [r*S, min((r+1)*S, P)) with S = ceil(P/N) (the last ranks may own less, or nothing), so any
 * parameter count works. What each stage keeps per rank (fp32 AdamW):
 *   ZeRO-0  params P, grads P, moments 2P              grads all-reduced (average)
 *   ZeRO-1  params P, grads P, moments 2P/N            all-reduce; update own range; all-gather
 *   ZeRO-2  params P, grads P/N, moments 2P/N          each unit's grads reduce-scattered into
 *                                                      the owned range as backward produces them
 *   ZeRO-3  params P/N, grads P/N, moments 2P/N        + each unit's params all-gathered before
 *                                                      its forward and backward, the next unit
 *                                                      prefetched while this one computes
 * plus working buffers (dt_dp_memory_t.working): for ZeRO-2/3 the gradients (ZeRO-3: and
 * parameters) of the embeddings, the final LayerNorm and two layers, and a staging buffer of
 * one layer through which a unit's ranges travel packed, one collective per unit.
 *
 * Overlap (DISTRAIN_DP_OVERLAP): with it, the collectives of the forward and backward passes
 * run on a comm thread while compute goes on: ZeRO-0/1 all-reduce each unit's gradients as
 * soon as the last micro-batch's backward has finished with it, ZeRO-2/3 reduce-scatter them,
 * ZeRO-3 gathers the next unit ahead. Without it ZeRO-0/1 all-reduce all gradients once
 * after the backward pass, and ZeRO-2/3 run the same unit collectives in place.
 *
 * Every rank must make the same calls in the same order (they are collectives). Results equal
 * the single-process run on the same global batch up to the summation order of the
 * reductions (tests/integration/test_dp.py checks 1e-5 relative). */
#ifndef DT_TRAINER_DP_H
#define DT_TRAINER_DP_H

#include <stddef.h>
#include <stdint.h>

#include "checkpoint.h"
#include "comm.h"
#include "gpt2.h"

typedef struct dt_dp dt_dp_t;

/* Per-rank memory for parameters, gradients and optimizer state, counted as allocated. */
typedef struct {
  size_t params, grads, optim, working;
} dt_dp_memory_t;

/* Takes over m's buffers as the stage needs (frees what the stage does not keep) and installs
 * the model hooks for ZeRO-2/3. m must hold the initial weights of its (local) buffer: under
 * tensor and pipeline parallelism ZeRO shards each rank's local buffer over the ranks of comm
 * (its dp group); the gradient norm also sums over mp (the ranks holding the other parts of
 * the model: tp x pp; NULL when none), and emb (a pipeline's first and last stage; NULL when
 * none) sums the tied wte gradients once per step. */
int dt_dp_create(dt_dp_t **out, dt_gpt2_t *m, dt_comm_t *comm, dt_comm_t *mp, dt_comm_t *emb,
                 int zero_stage);
void dt_dp_destroy(dt_dp_t *dp);
/* Whether world data-parallel ranks of ZeRO stage zero_stage on dev run their collectives on
 * the comm thread (DISTRAIN_DP_OVERLAP above), as dt_dp_create will decide. */
int dt_dp_overlapped(int world, int zero_stage, const dt_device_t *dev);

/* With the comm thread, makes every operation this process starts on `other` (a model-parallel
 * group of the compute thread: tp, cp, pp, ...) first wait until the data-parallel collectives
 * posted so far are done (dt_comm_set_gate); without it, does nothing. NCCL may deadlock when
 * two communicators have operations in flight on one GPU at once, unless every rank launched
 * them in the same order (NCCL's "Using multiple NCCL communicators concurrently"), and the two
 * threads' interleaving differs from rank to rank. Gated, a GPU runs one communicator's
 * operation at a time, in program order, the same on every rank; the comm thread still
 * overlaps each collective with the compute up to the compute thread's next one. The trainer
 * gates its groups when they are NCCL's; the "cpu" backend needs no gate. dt_dp_destroy removes
 * the gates, so destroy dp before those communicators. 0, or DT_EINVAL past 8 communicators. */
int dt_dp_order_before(dt_dp_t *dp, dt_comm_t *other);

void dt_dp_memory(const dt_dp_t *dp, dt_dp_memory_t *mem);

/* Before the first micro-batch of a step. */
int dt_dp_zero_grad(dt_dp_t *dp);
/* Before each micro-batch's forward/backward: last is set for the last one of the step
 * (ZeRO-0/1 start reducing a unit's gradients as soon as its backward is done). */
void dt_dp_begin_micro(dt_dp_t *dp, int last);
/* After the last micro-batch: completes the gradient reduction. */
int dt_dp_reduce_grads(dt_dp_t *dp);
/* Global L2 norm of the (reduced) gradients; identical on every rank. */
int dt_dp_grad_norm(dt_dp_t *dp, float *norm);
/* AdamW on the owned range (the whole model for ZeRO-0), then whatever all-gather the stage
 * needs so that every rank holds the parameters it computes with. */
int dt_dp_step(dt_dp_t *dp, const dt_adamw_t *h, float grad_scale, int t);
/* Milliseconds the caller spent blocked in collectives since the last call (exposed, i.e.
 * not overlapped, communication), and resets the counter. */
double dt_dp_take_comm_ms(dt_dp_t *dp);
/* Averages a scalar over the ranks (the loss, validation loss). */
int dt_dp_average(dt_dp_t *dp, float *x);
/* Sums n floats over the ranks (a blend's losses by source). */
int dt_dp_sum(dt_dp_t *dp, float *x, size_t n);

/* Checkpoint: the shard this rank writes (writers = ranks that write; ZeRO-0: rank 0 only,
 * *writes = 0 elsewhere); its pointers address device memory. */
void dt_dp_ckpt_range(const dt_dp_t *dp, dt_ckpt_range_t *r, int *writes, int *writers,
                      int *writer_rank);
/* Loads this rank's state from a committed checkpoint (written with any dp and tp sizes). */
int dt_dp_load(dt_dp_t *dp, const char *path, dt_train_state_t *state);
/* Gathers this rank's full local weights into out (P floats of host memory) on every rank of
 * the group (export, the replica check, ZeRO-3). */
int dt_dp_gather_params(dt_dp_t *dp, float *out);

#endif
