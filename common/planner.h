/* planner.h — the memory and time planner behind `distrainctl plan`: per-GPU memory,
 * communication volume and step time of a parallel layout, and the enumeration of layouts.
 *
 * Pure arithmetic: no I/O, no allocation except dt_plan_enumerate's result. Sizes are bytes
 * (double, so a 405B model's figures are exact enough and the textbook table is exact),
 * bandwidths bytes/s, compute FLOP/s, times seconds.
 *
 * ---- Model ------------------------------------------------------------------------------------
 * GPT-2 (arch DT_PLAN_GPT2): token embedding tied to the LM head, learned positions (max_seq
 * rows), LayerNorm with bias, GELU MLP of width ffn (4h), biases everywhere:
 *   P = V h + S h + L (12 h^2 + 13 h) + 2 h        (124,439,808 for gpt2-124m)
 * Llama (DT_PLAN_LLAMA): untied embedding and head, no positions, RMSNorm (weight only),
 * SwiGLU MLP (gate, up, down of width ffn), grouped-query attention (kv_heads), no biases:
 *   P = 2 V h + L (2 h^2 + 2 h k + 3 h f + 2 h) + h,  k = kv_heads * h / heads
 * The counts use the real vocabulary; the per-rank memory uses the vocabulary padded to a
 * multiple of 128 as the trainer allocates it (50304 rows for GPT-2's 50257).
 *
 * ---- Layout -----------------------------------------------------------------------------------
 * world = pp x dp x cp x tp (tp fastest, as the trainer's mesh). cp splits each sequence into
 * 2 cp chunks (2 cp divides seq), rank r holding chunks r and 2cp-1-r: a rank's activations are
 * those of seq/cp positions, except that each layer keeps the whole sequence's q, k and v; the
 * dp x cp ranks form the gradient and ZeRO group. tp splits attention heads (and kv
 * heads), MLP columns and vocabulary rows (Megatron-LM); norms and row-parallel biases are
 * replicated. pp splits layers by the trainer's rule (dt_plan_stage_bounds: by cost, the LM head
 * counting on the last stage); the first stage holds the embeddings, the last the LM head (a
 * second copy of the tied wte for GPT-2). Each data-parallel rank runs accum micro-batches of
 * micro sequences: global_batch = dp x micro x accum. With pp > 1 the schedule is 1F1B: stage
 * s keeps min(pp - s, accum) micro-batches' activations alive; without pp one.
 *
 * ---- Model state per rank (P = the rank's local parameters, N = dp) --------------------------
 * Three precisions. fp32 and bf16 are distrain's trainer, the bytes it allocates; mixed16 is the
 * textbook (ZeRO paper) trainer, to compare with DeepSpeed/Megatron-style ones.
 *   fp32:    weights, gradients and Adam m, v in fp32: (p, g, o) = (4, 4, 8).
 *   bf16:    distrain's --precision bf16 (PyTorch autocast's rule): fp32 master weights,
 *            gradients and Adam m, v, plus the bf16 copy of the weights the linear layers read
 *            (2 bytes, kept wherever the rank holds its whole weights, i.e. not under ZeRO-3,
 *            which rounds each gathered layer as it uses it): (4 + 2, 4, 8), 18P at ZeRO-0.
 *   mixed16: bf16 weights and gradients, fp32 master weights, m and v: (2, 2, 12).
 * ZeRO shards over dp:
 *   stage 0: (p + g + o) P      1: (p + g) P + o P/N      2: p P + (g + o) P/N    3: (p+g+o) P/N
 * In mixed16 that is the textbook 16P, 4P + 12P/N, 2P + 14P/N, 16P/N (7B on 8 GPUs: 112, 38.5,
 * 26.25, 14 GB); distrain's bf16 needs 18P, 10P + 8P/N, 6P + 12P/N, 16P/N (126, 77, 52.5, 14 GB).
 * Shards are ceil(P/N), as the trainer splits them. ZeRO-2/3 add working buffers (the trainer's
 * slots: the embeddings, the final norm and two layers, gradients and, under ZeRO-3, gathered
 * parameters, plus a staging and a landing buffer of one layer; fp32 in distrain's trainer);
 * ZeRO-0/1 with N > 1 the staging buffer of one layer, which the GPU trainer's comm thread
 * all-reduces each layer's gradients through (on a CPU only with a core to spare).
 *
 * ---- Activations per rank --------------------------------------------------------------------
 * distrain's trainer (fp32 and bf16), float for float (b = micro, s = seq, N = b s, C = h,
 * t = tp, a = heads, F = ffn, k = kv width, Vp the padded vocabulary; with cp, s is the rank's
 * seq / cp and q, k, v count cp times, b (a/t) s^2 becomes b (a/t) (s/2)^2 (2 cp + 1), and the
 * scratch adds 2 cp N (C + 2k)/t, the gathered rows and their gradients):
 *   per layer kept:  3 N C + 4 N + N (C + 2k)/t + N C/t + b (a/t) s^2 + (2 or 3) N F/t
 *                    (ln1, ln2, residual2, their mean/rstd; qkv; attention output; softmax
 *                    probabilities; MLP pre-activation and activation, Llama also "up")
 *   per slot:        (L_stage + 2) N C (layer outputs, the stage input, the residual gradient)
 *                    + 2 N (the micro-batch's tokens, on a GPU: the CPU trainer reads them in
 *                    place) + on the last stage N C + 2 N + N Vp/t + N (final norm, logits,
 *                    losses)
 *   shared scratch:  2 N C + N F/t + N (C + 2k)/t + b (a/t) s^2 (backward buffers)
 *                    + 3 (t + 1) N on the last stage when t > 1 (vocab-parallel loss stats)
 *   checkpointing:   the per-layer part is kept once in the scratch (the layer being
 *                    recomputed), not per layer and slot: layer outputs only.
 * all in 4-byte floats, except under bf16, where the values only a linear layer reads are 2-byte
 * bf16 (the GPU's bf16_bytes): the LayerNorm outputs (ln1, ln2, the final norm), the MLP
 * pre-activation and activation, the logits (the LM head writes them in bf16, the loss reads
 * them and writes the bf16 dlogits over them), and with flash attention q, k, v (the qkv layer
 * writes them in bf16 for the bf16 flash kernels) and the attention's output (which they write in
 * bf16); in the scratch the MLP pre-activation's gradient (N F/t) is bf16 too, and so is q, k, v's
 * (N (C + 2k)/t) with flash attention and no cp (where a row of it is a whole number of floats),
 * and one N C bf16 buffer is added (a linear layer's rounded input), while at t = 1 one of the
 * 2 N C is not (the branch outputs, which the projections add to the stream in their GEMMs).
 * This is exact against the trainer's "activations: X MiB" line (tests/integration/
 * test_planner.py: fp32 on the CPU, bf16 on the emulated GPU). Those are the terms of materialised
 * attention (train.materialized); flash attention, the default, keeps each query row's log-sum-exp
 * instead, b (a/t) s per layer (with cp too: the rank's s rows), and no probabilities in the
 * scratch. mixed16 (a Megatron-style GPU trainer; Korthikanti et al. 2022, 16-bit activations with
 * dropout masks, no sequence parallelism): per layer and micro-batch, GPT-2 s b h (10 + (8 + 4
 * F/h)/t) + 5 a s^2 b / t   bytes
 * (= s b h (34 + 5 a s / h) at t = 1) Llama (no dropout, GQA, SwiGLU): s b h (8 + (4 + 4 k/h + 6
 * F/h)/t) + 2 a s^2 b / t. With full recomputation 2 s b h per layer is kept, plus one layer's full
 * set while it is recomputed. The last stage adds fp32 logits 4 s b Vp / t; slots as above. With cp
 * (an extension, modelled as distrain's trainer does it): s is seq / cp, s^2 becomes (s/2)^2 (2 cp
 * + 1), and each layer adds the other ranks' k and v, 2 (cp-1) s b (h + 2k)/t. Flash attention
 * replaces the a s^2 b terms (5 for GPT-2, 2 for Llama) by the fp32 log-sum-exp of each query row,
 * 4 a s b / t.
 *
 * ---- The device's own buffers (fp32 and bf16: distrain's GPU trainer) -------------------------
 * What kernels/cuda allocates beside the tensors, as the trainer's "device's own" line reports it
 * after the first step: cuBLASLt's workspace (32 MiB, an H100's), the kernels' scratch (one
 * buffer grown to the step's largest single request, in whole MiB) and under fp32 the vector of
 * N ones the bias gradients are summed with (in whole MiB). The requests, N = b s rows:
 *   the gradient norm's 1025 partial sums (doubles); LayerNorm's weight-gradient partials
 *   2 C ceil(N / max(32, ceil(N / 1024))) floats; flash attention's D, b (a/t) s floats (s/2
 *   under cp, which runs each chunk apart), under bf16 followed (256-byte aligned) by the
 *   backward's score gradients: per sequence and head the bf16 tiles of 64 keys x 64 queries
 *   on and below the diagonal (136 at s 1024: 1.1 MB; rank 0's last chunk under cp), sequences
 *   (else heads) in balanced groups within 1 GiB of tiles (none past s 32768, where the dq kernel
 *   recomputes them); on the first stage the tokens sorted by row,
 *   2 min(n, Vp/t) + 1 + n ints (n = b s, halved under cp); under bf16 each linear layer's bf16
 *   copy of its output gradient (N OC values; the LM head's dlogits are bf16 already) with its
 *   bias gradient's partial sums (OC floats per 256 rows), plus under ZeRO-3 the weight's bf16
 *   copy (the LM head's too), each piece 256-byte aligned.
 * The CUDA context and NCCL's buffers are not counted: a cluster's `reserve` leaves room for them
 * (a layout fits when its total plus the reserve is within the GPU's memory). mixed16, another
 * trainer, counts none of this.
 *
 * ---- Communication per rank and step (bytes sent; g = gradient bytes/param) ----------------
 * distrain's trainer sends fp32 in both its precisions (gradients, gathered weights and
 * activations: 4 bytes a value); mixed16 sends 2.
 *   dp, ZeRO-0: ring all-reduce of the gradients 2 (N-1)/N g P;  ZeRO-1: reduce-scatter +
 *   all-gather, the same volume; ZeRO-2: a reduce-scatter per micro-batch (N-1)/N g P accum
 *   + the parameters' all-gather (N-1)/N p P; ZeRO-3: per micro-batch an all-gather in the
 *   forward and again in the backward plus a reduce-scatter, (N-1)/N (2 p + g) P accum.
 *   tp: 4 all-reduces per layer and micro-batch (2 forward, 2 backward; 6 with recomputation)
 *   of b s h activations, 2 (t-1)/t each.   pp: one b s h activation forward and one gradient
 *   back per micro-batch and stage boundary.   cp: per layer and micro-batch an all-gather
 *   of the q, k, v rows (again with recomputation) and a reduce-scatter of their gradients,
 *   (cp-1) b s (h + 2k)/t each (s the rank's seq / cp), within a node when tp cp fits.
 * ---- Time ---------------------------------------------------------------------------------------
 *   compute = 6 P_total tokens (8 with recomputation) / world / (peak x mfu);
 *   step = compute (accum + pp - 1) / accum + exposed communication. tp and pp traffic is
 *   exposed; dp traffic overlaps the backward pass it follows (ZeRO-0/1: the last micro-batch's,
 *   ZeRO-2: all of them; ZeRO-3: the whole step), the ZeRO-1/2 all-gather is exposed. Links:
 *   tp and a dp group within a node (dp x tp <= gpus_per_node) use the intra-node bandwidth,
 *   otherwise the inter-node one; pp uses intra-node only when the whole job is in one node.
 *   Each collective or message also costs `latency` (the alpha of the alpha-beta model):
 *   dp (the dp x cp group): ZeRO-0 one all-reduce, ZeRO-1 two, ZeRO-2 one reduce-scatter per
 *   unit (layers,
 *   embeddings, final norm) and micro-batch plus an all-gather, ZeRO-3 three per unit and
 *   micro-batch (the trainer's unit-by-unit collectives); tp one per all-reduce; pp one per
 *   message. It dominates small models (the CPU test's), and is noise for large ones.
 *   The bubble reported is the idle share of a stage, (pp - 1) / (accum + pp - 1). */
#ifndef DT_PLANNER_H
#define DT_PLANNER_H

#include <stddef.h>
#include <stdint.h>

typedef enum { DT_PLAN_GPT2 = 0, DT_PLAN_LLAMA = 1 } dt_plan_arch_t;
/* fp32 and bf16: distrain's trainer in that --precision; mixed16: the textbook 16-bit trainer
 * (the ZeRO paper's 2 + 2 + 12 bytes per parameter; see above). */
typedef enum { DT_PLAN_FP32 = 0, DT_PLAN_BF16 = 1, DT_PLAN_MIXED16 = 2 } dt_plan_precision_t;

typedef struct {
  dt_plan_arch_t arch;
  int layers, hidden, heads;
  int kv_heads; /* Llama GQA; 0 = heads */
  int ffn;      /* MLP width; 0 = 4 hidden */
  int vocab;    /* real vocabulary (padded to 128 for memory) */
  int max_seq;  /* GPT-2's learned positions; 0 = seq */
} dt_plan_model_t;

typedef struct {
  int gpus, gpus_per_node;
  double gpu_mem;    /* bytes */
  double peak_flops; /* FLOP/s per GPU */
  double mfu;        /* fraction of peak reached by compute, (0, 1] */
  double intra_bw;   /* bytes/s per GPU within a node */
  double inter_bw;   /* bytes/s per GPU across nodes */
  double latency;    /* seconds per collective or message (alpha of the alpha-beta model) */
  double reserve;    /* bytes of a GPU left free for what the planner does not count */
} dt_plan_cluster_t;

typedef struct {
  int seq, global_batch; /* tokens per sequence; sequences per optimizer step */
  dt_plan_precision_t precision;
  int materialized; /* attention keeps its (s, s) probabilities (0: flash, the default) */
} dt_plan_train_t;

typedef struct {
  int dp, tp, pp;
  int zero;  /* 0..3 */
  int micro; /* sequences per micro-batch */
  int accum; /* micro-batches per step per data-parallel rank */
  int ckpt;  /* activation checkpointing */
  int cp;    /* context parallelism: each sequence over cp ranks (0 or 1: none) */
} dt_plan_layout_t;

/* One rank's memory, bytes. total = params + grads + optim + working + acts + device. */
typedef struct {
  double params, grads, optim, working, acts, device, total;
} dt_plan_mem_t;

typedef struct {
  dt_plan_layout_t layout;
  dt_plan_mem_t mem;                               /* the rank that needs the most */
  int worst_stage;                                 /* its pipeline stage */
  double comm_dp, comm_tp, comm_pp, comm_cp, comm; /* bytes sent per rank per step (worst stage) */
  double t_compute, t_comm, t_step;                /* seconds: compute, exposed comm, whole step */
  double bubble;                                   /* idle fraction of a stage */
  double tokens_per_s;
  int fits; /* mem.total + cluster reserve <= cluster gpu_mem */
} dt_plan_eval_t;

/* GPT-2 124M/350M/774M/1.5B ("gpt2-124m", ...) or Llama-shaped 7B/13B/70B/405B ("llama-7b",
 * ...) into *m. 0, or DT_EINVAL for an unknown name. */
int dt_plan_preset(const char *name, dt_plan_model_t *m);
/* The preset names, separated by ", " (for messages). */
const char *dt_plan_preset_names(void);

/* Fills the defaults (kv_heads, ffn, max_seq from seq) and checks the shape: sizes positive,
 * hidden divisible by heads, heads by kv_heads, seq <= max_seq. 0 or DT_EINVAL with why. */
int dt_plan_model_check(dt_plan_model_t *m, int seq, char *why, size_t whylen);

/* Parameters of the whole model (real vocabulary). */
int64_t dt_plan_params(const dt_plan_model_t *m);
/* Parameters one rank of stage `stage` holds under tp and pp (padded vocabulary). */
int64_t dt_plan_rank_params(const dt_plan_model_t *m, int tp, int pp, int stage);

/* The split of `layers` layers over `stages` pipeline stages by cost, the trainer's and the
 * planner's: head_layers is the LM head's cost in layers (its GEMM against a layer's 12 h^2
 * per token: padded_vocab / (12 h)); each stage gets as many layers as keep it near its share,
 * at least one, leaving one per later stage. bounds[0..stages], stage s holding layers
 * [bounds[s], bounds[s + 1]). stages <= layers. */
void dt_plan_stage_bounds(int layers, double head_layers, int stages, int *bounds);
/* dt_plan_stage_bounds for model m over pp stages. */
void dt_planner_partition(const dt_plan_model_t *m, int pp, int *bounds);

/* Model-state bytes of P parameters sharded over n data-parallel ranks under a ZeRO stage:
 * params, grads and optim (see the table above; exact, no ceil). */
void dt_plan_state_bytes(double P, int n, int zero, dt_plan_precision_t prec, dt_plan_mem_t *out);

/* Whether a layout is valid for this model, batch and cluster: dp tp pp >= 1, world ==
 * gpus, tp divides heads (and kv heads) and the padded vocabulary, tp <= gpus_per_node, pp
 * divides layers, global_batch == dp micro accum, zero in 0..3, ckpt 0/1. 0, or DT_EINVAL
 * with one line saying which rule fails. */
int dt_plan_layout_check(const dt_plan_model_t *m, const dt_plan_train_t *tr,
                         const dt_plan_cluster_t *c, const dt_plan_layout_t *l, char *why,
                         size_t whylen);

/* Memory of one rank of pipeline stage `stage` (layout assumed valid). */
void dt_plan_memory(const dt_plan_model_t *m, const dt_plan_train_t *tr, const dt_plan_layout_t *l,
                    int stage, dt_plan_mem_t *out);

/* Memory (worst stage), communication and time of a valid layout. */
void dt_plan_evaluate(const dt_plan_model_t *m, const dt_plan_train_t *tr,
                      const dt_plan_cluster_t *c, const dt_plan_layout_t *l, dt_plan_eval_t *out);

/* Every valid layout: tp a divisor of heads up to gpus_per_node, pp a divisor of layers,
 * dp = gpus / (tp pp), micro a power of two dividing global_batch / dp, ZeRO 0..3 (only 0
 * at dp = 1), checkpointing off and on. Sorted: layouts that fit first, fastest first (equally
 * fast ones: less communication, then fewer and larger micro-batches, then less memory); then
 * the rest, smallest memory first. *out is malloc'ed (free it); *n may be 0 (no valid
 * layout). 0, DT_EINVAL (model or cluster invalid, why says) or DT_ENOMEM. */
int dt_plan_enumerate(const dt_plan_model_t *m, const dt_plan_train_t *tr,
                      const dt_plan_cluster_t *c, dt_plan_eval_t **out, int *n, char *why,
                      size_t whylen);

#endif
