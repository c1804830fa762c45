/* gpt2.h — the GPT-2 model: parameters, activations, forward, backward, optimizer step.
 *
 * Architecture exactly as llm.c / PyTorch GPT-2: learned token and position embeddings,
 * pre-LayerNorm blocks (eps 1e-5) with causal multi-head attention and a 4x GELU(tanh) MLP,
 * final LayerNorm, LM head tied to the token embedding, vocabulary padded to Vp.
 *
 * Tensor parallelism (Megatron-LM), when the model is created with tp > 1: attention heads
 * and MLP columns are split across the tp ranks (QKV and fc column-parallel, the attention
 * and MLP output projections row-parallel, one all-reduce per row-parallel layer forward and
 * per column-parallel layer backward), the token embedding and the LM head are split by
 * vocabulary rows with a vocabulary-parallel cross-entropy (no rank holds full-vocabulary
 * logits), and the LayerNorms, wpe and the row-parallel biases are replicated: every tp rank
 * computes them from bit-identical inputs, so they stay bit-identical without communication.
 * Sequence parallelism (optional) also splits the LayerNorm and residual rows over the group.
 *
 * Pipeline parallelism: a model may hold one stage: one range of layers, or with an
 * interleaved schedule several (model chunks, each a virtual stage; dt_gpt2_stage_t). It runs
 * a micro-batch's forward and backward through one chunk in an activation slot of that chunk;
 * the caller moves each chunk's input, output and their gradients between neighbours
 * (schedule.h).
 *
 * Invariants:
 *  - All of a rank's parameters live in one flat fp32 buffer in llm.c's checkpoint order (16
 *    tensors, see DT_GPT2_TENSORS) with this rank's *local* shapes and layers
 *    (dt_gpt2_place_t, dt_gpt2_stage_t; tensors a stage does not hold have size 0); with one
 *    rank that is exactly llm.c's layout. Gradients and AdamW moments use the same flat
 *    layout, so a ZeRO shard is a flat range [lo, hi) of every local buffer, and
 *    dt_gpt2_runs maps any local range to the global (llm.c) offsets it holds.
 *  - Gradients accumulate over micro-batches until dt_gpt2_zero_grad.
 *  - The backward pass keeps one residual-stream gradient and reuses a handful of scratch
 *    buffers across layers instead of llm.c's full mirror of the activations. */
#ifndef DT_TRAINER_GPT2_H
#define DT_TRAINER_GPT2_H

#include <stddef.h>
#include <stdint.h>

#include "device.h"
#include "ops.h"

struct dt_comm;

typedef struct {
  int max_seq;      /* maxT */
  int vocab;        /* V: real vocabulary */
  int padded_vocab; /* Vp: V rounded up to a multiple of 128 (llm.c) */
  int layers;       /* L */
  int heads;        /* NH */
  int channels;     /* C */
} dt_gpt2_config_t;

/* name, shape as (a, b, c) element counts, is a weight matrix (takes weight decay) */
#define DT_GPT2_TENSORS(X, cfg)                                                                    \
  X(wte, (size_t)(cfg).padded_vocab *(cfg).channels, 1)                                            \
  X(wpe, (size_t)(cfg).max_seq *(cfg).channels, 1)                                                 \
  X(ln1w, (size_t)(cfg).layers *(cfg).channels, 0)                                                 \
  X(ln1b, (size_t)(cfg).layers *(cfg).channels, 0)                                                 \
  X(qkvw, (size_t)(cfg).layers * 3 * (cfg).channels * (cfg).channels, 1)                           \
  X(qkvb, (size_t)(cfg).layers * 3 * (cfg).channels, 0)                                            \
  X(attprojw, (size_t)(cfg).layers *(cfg).channels *(cfg).channels, 1)                             \
  X(attprojb, (size_t)(cfg).layers *(cfg).channels, 0)                                             \
  X(ln2w, (size_t)(cfg).layers *(cfg).channels, 0)                                                 \
  X(ln2b, (size_t)(cfg).layers *(cfg).channels, 0)                                                 \
  X(fcw, (size_t)(cfg).layers * 4 * (cfg).channels * (cfg).channels, 1)                            \
  X(fcb, (size_t)(cfg).layers * 4 * (cfg).channels, 0)                                             \
  X(fcprojw, (size_t)(cfg).layers *(cfg).channels * 4 * (cfg).channels, 1)                         \
  X(fcprojb, (size_t)(cfg).layers *(cfg).channels, 0)                                              \
  X(lnfw, (size_t)(cfg).channels, 0)                                                               \
  X(lnfb, (size_t)(cfg).channels, 0)

#define DT_GPT2_NUM_TENSORS 16

/* How a tensor is split across tensor-parallel ranks. Shapes are per layer: a layered tensor
 * is `layers` equal (rows, cols) matrices (biases and LayerNorm vectors have cols 1 or rows 1).
 *   NONE  replicated on every tp rank
 *   ROWS  output rows split (column-parallel layers, vocabulary-parallel wte): the rows form
 *         `blocks` equal blocks (qkvw: q, k, v) and rank r holds the r-th 1/tp of every block,
 *         so its q, k and v rows belong to the same heads
 *   COLS  input columns split (row-parallel layers): rank r holds columns [r*cols/tp, ...) */
typedef enum { DT_SPLIT_NONE = 0, DT_SPLIT_ROWS = 1, DT_SPLIT_COLS = 2 } dt_split_t;

typedef struct {
  size_t layers, rows, cols; /* global shape: layers x (rows, cols) */
  dt_split_t split;
  int blocks; /* ROWS: equal row blocks split separately (3 for qkv), else 1 */
} dt_gpt2_place_t;

/* A contiguous piece of a local buffer and where it sits in the global (llm.c) layout. */
typedef struct {
  int64_t global; /* offset in the global flat layout */
  int64_t local;  /* offset in the local buffer, relative to the range asked for */
  int64_t len;
} dt_gpt2_run_t;

/* Tensor parallelism of one model replica: tp ranks, this one's position, its communicator
 * (NULL when tp == 1; a tp > 1 model without one can be placed, loaded and saved, not run). */
typedef struct {
  int tp, rank;
  struct dt_comm *comm;
} dt_gpt2_tp_t;

/* Context parallelism of one model replica: every sequence split into 2 x cp chunks of T/2
 * positions (T: the local length), rank r holding chunks r and 2cp-1-r (a zig-zag: each rank
 * then does the same causal-attention work), its rows half-major (2, B, T/2). Each layer
 * gathers the group's q, k, v rows, attends each chunk's queries to the keys up to that
 * chunk's end, and sums the keys' and values' gradients back to their owners. comm is NULL
 * when cp == 1. */
typedef struct {
  int cp, rank;
  struct dt_comm *comm;
} dt_gpt2_cp_t;

#define DT_GPT2_MAX_CHUNKS 16

/* The pipeline stage a rank holds: chunks of layers, chunk c being global layers
 * [lo[c], hi[c]) (ascending; one chunk without interleaving). The first stage also holds the
 * embeddings (wte, wpe) before its chunk 0, the last the final LayerNorm and the LM head
 * after its last chunk (wte again, tied: the two copies' gradients are summed between the
 * stages, so they stay identical). */
typedef struct {
  int chunks;
  int lo[DT_GPT2_MAX_CHUNKS], hi[DT_GPT2_MAX_CHUNKS];
  int first, last;
} dt_gpt2_stage_t;

/* Pointers into one flat buffer (parameters, or gradients with the same layout). */
typedef struct {
  float *wte;      /* (Vp, C) */
  float *wpe;      /* (maxT, C) */
  float *ln1w;     /* (L, C) */
  float *ln1b;     /* (L, C) */
  float *qkvw;     /* (L, 3C, C) */
  float *qkvb;     /* (L, 3C) */
  float *attprojw; /* (L, C, C) */
  float *attprojb; /* (L, C) */
  float *ln2w;     /* (L, C) */
  float *ln2b;     /* (L, C) */
  float *fcw;      /* (L, 4C, C) */
  float *fcb;      /* (L, 4C) */
  float *fcprojw;  /* (L, C, 4C) */
  float *fcprojb;  /* (L, C) */
  float *lnfw;     /* (C) */
  float *lnfb;     /* (C) */
} dt_gpt2_tensors_t;

/* Index of each tensor in DT_GPT2_TENSORS order (= the flat layout and llm.c's file order). */
enum {
  DT_T_WTE,
  DT_T_WPE,
  DT_T_LN1W,
  DT_T_LN1B,
  DT_T_QKVW,
  DT_T_QKVB,
  DT_T_ATTPROJW,
  DT_T_ATTPROJB,
  DT_T_LN2W,
  DT_T_LN2B,
  DT_T_FCW,
  DT_T_FCB,
  DT_T_FCPROJW,
  DT_T_FCPROJB,
  DT_T_LNFW,
  DT_T_LNFB,
};

/* Units: the groups of parameters the model uses together. Layer l is unit l (0..L-1) and
 * holds layer l's slice of tensors DT_T_LN1W..DT_T_FCPROJB; the embeddings (wte, wpe) and the
 * final LayerNorm (lnfw, lnfb) are units of their own. A unit is a list of flat ranges. */
#define DT_UNIT_EMBED      (-1)
#define DT_UNIT_FINAL      (-2)
#define DT_UNIT_MAX_RANGES 12
#define DT_UNIT_MAX_ORDER  4096 /* units in one pass: layers + 3 */

typedef struct {
  size_t off, len; /* flat offset and element count */
  int tensor;      /* DT_T_* */
} dt_flat_range_t;

/* Pointers to a unit's tensors: t[DT_T_x] addresses that tensor's slice for the unit (layer
 * units: the layer's slice; other entries are unused). */
typedef struct {
  float *t[DT_GPT2_NUM_TENSORS];
  const void *t16[DT_GPT2_NUM_TENSORS]; /* parameters only: the tensors' bf16 values where the
                                           model keeps them (params16), else NULL */
} dt_gpt2_view_t;

/* How the model obtains parameters and gradient accumulators, unit by unit. Without hooks it
 * uses its own full buffers. With them (ZeRO-3, ZeRO-2) another component supplies gathered
 * parameters and working gradient buffers, and learns when each unit's gradients of the
 * current micro-batch are complete (release with grads=1) so it can reduce them. */
typedef struct {
  void *ud;
  int (*acquire)(void *ud, int unit, int grads, dt_gpt2_view_t *params, dt_gpt2_view_t *gradv);
  int (*release)(void *ud, int unit, int grads);
} dt_gpt2_hooks_t;

/* Forward activations kept for the backward pass, for a (B, T) batch; N = B*T. Under tensor
 * parallelism the attention and MLP activations have local widths (3C/tp, C/tp, 4C/tp, NH/tp
 * heads); the residual stream and LayerNorm outputs are full width and replicated, or, with
 * sequence parallelism (Megatron-SP), hold this rank's N/tp rows (encoded, ln1, ln2,
 * residual2, residual3, dresidual and the LayerNorm statistics). */
/* One slot holds one chunk's layers (L below); the scratch buffers (and, with activation
 * checkpointing, a layer's inner activations) are shared by all slots. */
typedef struct {
  float *encoded;   /* (N, C) residual stream entering the chunk's first layer: the embeddings,
                       or the previous virtual stage's output */
  float *ln1;       /* (L, N, C); NULL when ln1_16 holds it */
  void *ln1_16;     /* (L, N, C) bf16 compute without sequence parallelism: the LayerNorm's output
                       as bf16 values (ops.h), all the next linear layer reads of it; so ln2_16,
                       fch_gelu16 and lnf16 */
  float *ln1_mean;  /* (L, N) */
  float *ln1_rstd;  /* (L, N) */
  float *qkv;       /* (L, N, 3C); context parallel: (L, B, cp*T, 3C), the whole sequence;
                       bf16 compute with flash attention: a bf16 buffer (ops.h) */
  float *atty;      /* (L, N, C) attention output, heads concatenated; bf16 compute with flash
                       attention: a bf16 buffer (ops.h), as the qkv */
  float *att;       /* (L, B, NH, T, T) softmax probabilities; with context parallelism each
                       chunk's (B, NH, T/2, the keys up to its end), one after the other; with
                       flash attention (L, B, NH, T) log-sum-exps (cp: each chunk's (B, NH,
                       T/2)) */
  float *residual2; /* (L, N, C) after the attention branch */
  float *ln2;       /* (L, N, C); NULL when ln2_16 holds it */
  void *ln2_16;     /* (L, N, C) */
  float *ln2_mean;  /* (L, N) */
  float *ln2_rstd;  /* (L, N) */
  float *fch;       /* (L, N, 4C) MLP pre-activation; NULL when fch16 holds it */
  void *fch16;      /* (L, N, 4C) bf16 compute: the pre-activation in bf16, as PyTorch autocast
                       keeps it (the fc layer's out16 output, the GELU's input) */
  float *fch_gelu;  /* (L, N, 4C); NULL under bf16 compute, which keeps fch_gelu16 */
  void *fch_gelu16; /* (L, N, 4C) bf16 compute (with sequence parallelism too) */
  float *residual3; /* (L, N, C) after the MLP branch = next layer's input */
  float *lnf;       /* (N, C); NULL when lnf16 holds it */
  void *lnf16;      /* (N, C) */
  float *lnf_mean;  /* (N) */
  float *lnf_rstd;  /* (N) */
  float *logits;    /* (N, Vl) this rank's vocabulary columns (Vl = Vp/tp); overwritten by
                       dlogits in a training step. NULL when logits16 holds them */
  void *logits16;   /* (N, Vl) bf16 compute: the logits in bf16, as PyTorch autocast keeps them
                       (the LM head's out16 output), then the dlogits in bf16 */
  float *losses;    /* (N) per-token loss */
  float *ce_stats;  /* (tp, N, 3) vocabulary-parallel cross-entropy stats, all tp ranks */
  float *gath;      /* (N, C) sequence parallel: rows gathered from the tp group */
  float *tmps;      /* (N/tp, C) sequence parallel: this rank's rows of a branch output */
  float *lngrad;    /* (2C) sequence parallel: a LayerNorm's gradients over this rank's rows */
  float *cpbuf;     /* (cp, N, 3C) context parallel: the group's q, k, v rows, rank by rank */
  float *dqkv_full; /* (B, cp*T, 3C) context parallel: this rank's part of every row's dqkv */
  /* backward scratch, shared by all layers */
  float *dresidual; /* (N, C) gradient of the residual stream */
  float *dbuf;      /* (N, C); under bf16 without tp it holds the bf16 gradients of the
                       LayerNorms' outputs (and with bf16 flash ones, the attention output's) */
  float *dbuf4;     /* (N, 4C) the MLP pre-activation's gradient; NULL when dfch16 holds it */
  void *dfch16;     /* (N, 4C) bf16 compute: that gradient in bf16 (the fc-proj layer's dinp
                       through the GELU), all the fc layer's backward reads of it */
  float *dqkv;      /* (N, 3C); NULL when dqkv16 holds it */
  void *dqkv16;     /* (N, 3C) bf16 flash attention over one whole sequence: its q, k, v
                       gradient in bf16, all the qkv layer's backward reads of it */
  float *datt;      /* like one layer's att (not with flash attention) */
  float *tmp;       /* (N, C) branch outputs before the residual add; NULL under bf16 without
                       tp, whose projections add them in their GEMMs */
  void *x16;        /* (N, C) bf16 compute: a linear layer's input rounded to bf16 (where its
                       producer keeps fp32) */
  int *tokens;      /* (2, N) on a device that is not host memory: the micro-batch's inputs
                       then targets, copied there by the forward pass (NULL on the host) */
  int B, T;         /* the size these buffers were allocated for */
} dt_gpt2_acts_t;

typedef struct {
  dt_gpt2_config_t cfg; /* the global model */
  dt_device_t *dev;     /* where its tensors live: every buffer below is device memory */
  const dt_ops_t *ops;  /* dev's kernels (each layer chooses its bf16 entries under bf16) */
  int bf16;             /* bf16 compute */
  int flash;            /* flash attention: att holds each query row's lse, no (T, T) matrix */
  dt_gpt2_tp_t tp;
  dt_gpt2_cp_t cp;
  dt_gpt2_stage_t stage;
  int L; /* layers held (units 0..L-1: the chunks' layers in order) */
  int chunk_off[DT_GPT2_MAX_CHUNKS + 1]; /* chunk c: units [chunk_off[c], chunk_off[c + 1]) */
  size_t num_params;    /* P, total elements of this rank's flat buffer (local shapes) */
  size_t global_params; /* elements of the whole model (llm.c layout) */
  size_t replicated;    /* elements of the local buffer that every tp rank holds */
  size_t owned;         /* elements this rank writes: replicated ones on tp rank 0 only, the
                           last stage's copy of wte never (the first stage's is written) */
  dt_gpt2_place_t place[DT_GPT2_NUM_TENSORS];
  size_t tensor_sizes[DT_GPT2_NUM_TENSORS]; /* local */
  size_t tensor_offsets[DT_GPT2_NUM_TENSORS];
  size_t global_offsets[DT_GPT2_NUM_TENSORS];
  float *params_flat;     /* (P) */
  float *grads_flat;      /* (P) */
  float *m_flat, *v_flat; /* (P) AdamW moments, allocated on first step */
  void *params16;         /* (P values of bf16_bytes) bf16 compute: params_flat rounded to bf16,
                             the weights the linear layers read; allocated with the activations
                             where the model holds its whole parameters (not under ZeRO-3, whose
                             gathered weights are rounded as each layer uses them), else NULL */
  int params16_stale;     /* params16 is behind params_flat: rounded again before the next
                             forward (dt_gpt2_params_written); dt_gpt2_adamw_step keeps it */
  dt_gpt2_tensors_t params, grads;
  dt_gpt2_acts_t *acts; /* activation slots (micro-batches in flight), chunk by chunk: chunk
                           c's slot j is acts[slot_base[c] + j] */
  int nslots[DT_GPT2_MAX_CHUNKS], slot_base[DT_GPT2_MAX_CHUNKS];
  dt_gpt2_acts_t scratch;   /* the buffers every slot shares */
  float *host_losses;       /* (N) the last stage's per-token losses read back from a device
                               that is not host memory (NULL on the host) */
  const float *last_losses; /* dt_gpt2_last_losses */
  int recompute;            /* activation checkpointing */
  int sp;                   /* sequence parallelism over the tp group */
  /* Text generation's key/value cache (dt_gpt2_kv_begin): each of the stage's layers' q, k, v
   * rows of the positions so far, (L, kv_cap, 3C) in the qkv activations' type; NULL when not
   * generating so; kv_bytes its size. kv_pos: the position the next token fed takes; kv_feed:
   * the most rows one forward takes, a multiple of kv_unit (tp under sequence parallelism,
   * whose forwards split their rows among the tp ranks: a feed is padded to it; else 1). */
  void *kv;
  size_t kv_bytes;
  int kv_cap, kv_pos, kv_feed, kv_unit;
  size_t bytes_params, bytes_grads, bytes_optim, bytes_acts; /* counted by the allocator */
  const dt_gpt2_hooks_t *hooks;                              /* NULL: the full buffers above */
} dt_gpt2_t;

/* AdamW hyper-parameters of one step (the schedule is applied by the caller). */
typedef struct {
  float lr, beta1, beta2, eps, weight_decay;
} dt_adamw_t;

/* Rounds V up to llm.c's padded vocabulary (multiple of 128). */
int dt_gpt2_padded_vocab(int vocab);
/* A config's bounds: far above any GPT's, they keep every size and the parameter count inside
 * 64 bits. dt_gpt2_config_validate's messages and dt_jobspec_validate repeat the numbers. */
#define DT_GPT2_MAX_LAYERS   4096
#define DT_GPT2_MAX_CHANNELS 131072
#define DT_GPT2_MAX_ROWS     16777216 /* max_seq and padded_vocab */
/* Checks a configuration (sizes within the bounds above); on failure writes a one-line reason
 * into why. */
int dt_gpt2_config_validate(const dt_gpt2_config_t *cfg, char *why, size_t whylen);
/* Checks that tp ranks can split the model (heads and padded vocabulary divisible by tp);
 * writes a one-line reason naming the rule on failure. */
int dt_gpt2_tp_validate(const dt_gpt2_config_t *cfg, int tp, char *why, size_t whylen);
/* Allocates this rank's parameters and gradients (zeroed) on dev, whose kernels it runs; tp
 * NULL means no tensor parallelism, stage NULL all layers with the embeddings and the head. */
int dt_gpt2_create(dt_gpt2_t *m, const dt_gpt2_config_t *cfg, dt_device_t *dev,
                   const dt_gpt2_tp_t *tp, const dt_gpt2_stage_t *stage);
void dt_gpt2_destroy(dt_gpt2_t *m);
/* GPT-2 initialisation from a seed: N(0, 0.02) weights, residual projections scaled by
 * 1/sqrt(2L), zero biases, unit LayerNorm weights; padded vocabulary rows zero. Every tp layout
 * gets its part of the same global weights. */
int dt_gpt2_init_weights(dt_gpt2_t *m, uint64_t seed);
/* Copies this rank's part of a global (llm.c layout) parameter buffer into its parameters. */
int dt_gpt2_load_global(dt_gpt2_t *m, const float *global);
/* The runs of local range [lo, hi) of tp rank tp_rank's buffer (any rank of this model's tp
 * group and stage: they differ only in global offsets), in local order, merged where
 * contiguous in both layouts. owned_only: only the tensors that rank writes (see owned). *runs
 * is malloc'd. */
int dt_gpt2_runs(const dt_gpt2_t *m, int tp_rank, int64_t lo, int64_t hi, int owned_only,
                 dt_gpt2_run_t **runs, size_t *nruns);
/* Elements of local range [lo, hi) that this rank holds but does not own. */
int64_t dt_gpt2_unowned_in(const dt_gpt2_t *m, int64_t lo, int64_t hi);
/* Allocates slots[c] activation slots (micro-batches in flight) for each chunk c, for batches
 * up to (B, T). With recompute (activation checkpointing) a slot keeps each layer's output
 * only, and the backward pass reruns each layer's forward before its backward (same bits,
 * about a third more compute, the layers' inner activations held for one layer at a time). */
int dt_gpt2_alloc_activations(dt_gpt2_t *m, int B, int T, const int *slots, int recompute);
/* Sequence parallelism (Megatron-SP, tp > 1, before the activations are allocated): the
 * LayerNorm and residual regions work on N/tp rows per rank, with an all-gather before each
 * column-parallel layer and a reduce-scatter after each row-parallel one in place of the
 * all-reduce. B*T must be divisible by tp. */
int dt_gpt2_set_sequence_parallel(dt_gpt2_t *m, int on);
/* Context parallelism (before the activations are allocated; B, T are then the local sizes):
 * DT_ENOTSUP when the device has no context-parallel attention kernels. */
int dt_gpt2_set_context_parallel(dt_gpt2_t *m, const dt_gpt2_cp_t *cp);
/* Compute precision: bf16 0 is fp32 everywhere; 1 runs every linear layer (QKV, attention
 * projection, MLP, LM head; forward and backward) as a bf16 GEMM with fp32 accumulation (the
 * device's matmul_*_bf16 kernels, ops.h) and flash attention's products in bf16 (its
 * attention_*_flash_bf16 kernels; materialized attention stays fp32), while parameters (the
 * fp32 master weights), gradients, optimizer state, activations, LayerNorm, GELU and the loss
 * stay fp32: PyTorch autocast's rule for linear layers and SDPA. Call it before
 * dt_gpt2_set_attention. DT_ENOTSUP when the device has no bf16 linear layers. */
int dt_gpt2_set_precision(dt_gpt2_t *m, int bf16);
/* Attention kernels (before the activations are allocated): flash 1 keeps no (T, T) matrix of
 * probabilities, only each query row's log-sum-exp, and recomputes the probabilities in the
 * backward pass (the device's attention_*_flash kernels); 0 keeps the probabilities (B, NH, T,
 * T) of every layer. The same results up to fp32 rounding. A model starts with 0; the trainer
 * sets 1 unless --attention materialized. DT_ENOTSUP when the device has no flash kernels (in
 * the model's precision). */
int dt_gpt2_set_attention(dt_gpt2_t *m, int flash);
/* Floats of a stage's input or output activation (the rows this rank holds, times C). */
size_t dt_gpt2_stage_io_floats(const dt_gpt2_t *m, int B, int T);
/* The order in which a forward (backward = 0) or backward pass acquires its units: ZeRO-3
 * prefetches by it. Returns the count (at most L + 3). */
int dt_gpt2_unit_order(const dt_gpt2_t *m, int backward, int *units);
/* Tells the model that its parameters were written by something other than
 * dt_gpt2_adamw_step (a load, ZeRO's update of a shard and gather): its bf16 weight copy
 * (params16) is rounded again before the next forward. */
void dt_gpt2_params_written(dt_gpt2_t *m);
/* Allocates the AdamW moments (zeroed) if not yet allocated. */
int dt_gpt2_alloc_optimizer(dt_gpt2_t *m);

/* The flat ranges of a unit; returns how many (<= DT_UNIT_MAX_RANGES). */
int dt_gpt2_unit_ranges(const dt_gpt2_t *m, int unit, dt_flat_range_t *ranges);
/* Points a view at a unit's tensors inside a flat buffer laid out like the parameters. */
void dt_gpt2_unit_view(const dt_gpt2_t *m, int unit, float *flat, dt_gpt2_view_t *v);

/* Forward + backward of one micro-batch; gradients of (mean loss * grad_scale) accumulate into
 * the gradient buffers (or the hooks'). *loss gets the micro-batch's mean loss. One stage. */
int dt_gpt2_forward_backward(dt_gpt2_t *m, const int *inputs, const int *targets, int B, int T,
                             float grad_scale, float *loss);

/* Pipeline stages. A micro-batch's forward through chunk `chunk` into its activation slot
 * `slot`: the model's first chunk embeds inputs, the others start from dt_gpt2_stage_input
 * (filled by the caller with the previous virtual stage's output). The model's last chunk ends
 * with the loss: *loss gets the mean, and when grad_scale != 0 the logits become the gradient
 * of (mean loss * grad_scale); without targets (NULL: text generation) it ends with the
 * logits, and *loss is left alone. Other chunks leave their output in dt_gpt2_stage_output. */
int dt_gpt2_stage_forward(dt_gpt2_t *m, int chunk, int slot, const int *inputs, const int *targets,
                          int B, int T, float grad_scale, float *loss);
/* The backward of the micro-batch in the chunk's slot: the model's last chunk starts from its
 * loss, the others from dt_gpt2_stage_grad (filled by the caller with the next virtual
 * stage's input gradient); chunks other than the model's first leave the gradient of their
 * input in dt_gpt2_stage_grad. */
int dt_gpt2_stage_backward(dt_gpt2_t *m, int chunk, int slot, const int *inputs, int B, int T);
/* Text generation with a key/value cache: after dt_gpt2_kv_begin, dt_gpt2_stage_forward of
 * one sequence's T tokens (B = 1, no targets; T <= kv_feed, a multiple of kv_unit) takes them
 * as positions [kv_pos, kv_pos + T), after the ones fed before: each layer computes only those
 * rows, adds their keys and values to the cache and attends over all cached ones (the flash or
 * materialized kernels' queries at q0 = kv_pos), then kv_pos advances by T (after the stage's
 * last chunk: every chunk of a virtual pipeline takes the same positions); the logits are the T
 * rows'. A prompt fed in pieces, then a token at a time, gives the logits of forwards of the
 * whole window up to fp32 rounding (the GEMMs see fewer rows), at a cost a token that does not
 * grow with the window but for attention. Under context parallelism every rank of the group
 * runs the whole sequence alone (its cache holds every position, not its chunks'); under
 * sequence parallelism a feed of fewer real tokens than a multiple of kv_unit is padded after
 * them (the causal mask keeps the padding out of their rows) and dt_gpt2_kv_seek moves kv_pos
 * back to the first padding position, which the next feed overwrites. cap positions (<= max_seq)
 * and the padding of one feed, up to max_seq. DT_ENOTSUP with the reason in why where the device
 * cannot (materialized attention without attention_forward_cp), another error, with why, where
 * the cache cannot be allocated or no row fits the activations. dt_gpt2_kv_end frees it and
 * returns to whole-window forwards. */
int dt_gpt2_kv_begin(dt_gpt2_t *m, int cap, char *why, size_t whylen);
int dt_gpt2_kv_seek(dt_gpt2_t *m, int pos); /* 0 <= pos <= kv_pos, else DT_EINVAL */
void dt_gpt2_kv_end(dt_gpt2_t *m);
/* The per-token losses (n = B*T of them) of the last forward with targets through the model's
 * last chunk (its slot 0), copied to host memory: the evaluations read them one by one. */
int dt_gpt2_token_losses(dt_gpt2_t *m, size_t n, float *out);
/* The per-token losses (B*T) of the newest dt_gpt2_stage_forward with targets, in host memory
 * (the ones its mean loss was taken of), until the next such forward. */
const float *dt_gpt2_last_losses(const dt_gpt2_t *m);
float *dt_gpt2_stage_input(dt_gpt2_t *m, int chunk, int slot);        /* (B*T, C) */
const float *dt_gpt2_stage_output(dt_gpt2_t *m, int chunk, int slot); /* (B*T, C) */
float *dt_gpt2_stage_grad(dt_gpt2_t *m, int chunk, int slot);         /* (B*T, C) */
int dt_gpt2_zero_grad(dt_gpt2_t *m);
/* *out = sum of squares of the gradients (or any buffer laid out like them) of local range
 * [lo, hi), buf addressing element lo, over the elements this rank owns, so that the sum over
 * the tp and pp groups counts every parameter of the model once. */
int dt_gpt2_sumsq(dt_gpt2_t *m, const float *buf, int64_t lo, int64_t hi, double *out);
/* 1 if the tensor (DT_T_*) takes weight decay: weight matrices and embeddings. */
int dt_gpt2_tensor_decays(int tensor);
/* One AdamW step at 1-based step t; grad_scale multiplies every gradient (clipping). Weight
 * decay applies to the weight matrices and embeddings only (GPT-2/nanoGPT/llm.c convention).
 * The bf16 weight copy, where the model keeps one, is written in the same pass. */
int dt_gpt2_adamw_step(dt_gpt2_t *m, const dt_adamw_t *h, float grad_scale, int t);

#endif
