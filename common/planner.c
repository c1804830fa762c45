/* planner.c — see planner.h for the formulas and their sources. */
#include "planner.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_error.h"
#include "dt_util.h"

/* ------------------------------------------------------------------------------------------ */
/* Models                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static const struct {
  const char *name;
  dt_plan_model_t m;
} presets[] = {
    /* GPT-2 (Radford et al. 2019): vocabulary 50257, 1024 positions. */
    {"gpt2-124m", {DT_PLAN_GPT2, 12, 768, 12, 0, 0, 50257, 1024}},
    {"gpt2-350m", {DT_PLAN_GPT2, 24, 1024, 16, 0, 0, 50257, 1024}},
    {"gpt2-774m", {DT_PLAN_GPT2, 36, 1280, 20, 0, 0, 50257, 1024}},
    {"gpt2-1.5b", {DT_PLAN_GPT2, 48, 1600, 25, 0, 0, 50257, 1024}},
    /* Llama 2 7B/13B/70B (Touvron et al. 2023) and Llama 3.1 405B shapes. */
    {"llama-7b", {DT_PLAN_LLAMA, 32, 4096, 32, 32, 11008, 32000, 0}},
    {"llama-13b", {DT_PLAN_LLAMA, 40, 5120, 40, 40, 13824, 32000, 0}},
    {"llama-70b", {DT_PLAN_LLAMA, 80, 8192, 64, 8, 28672, 32000, 0}},
    {"llama-405b", {DT_PLAN_LLAMA, 126, 16384, 128, 8, 53248, 128256, 0}},
};

int dt_plan_preset(const char *name, dt_plan_model_t *m)
{
  for (size_t i = 0; i < DT_ARRAY_SIZE(presets); i++)
    if (strcmp(name, presets[i].name) == 0) {
      *m = presets[i].m;
      return 0;
    }
  return DT_EINVAL;
}

const char *dt_plan_preset_names(void)
{
  return "gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, llama-7b, llama-13b, llama-70b, llama-405b";
}

int dt_plan_model_check(dt_plan_model_t *m, int seq, char *why, size_t whylen)
{
  if (m->kv_heads == 0)
    m->kv_heads = m->heads;
  if (m->ffn == 0)
    m->ffn = 4 * m->hidden;
  if (m->max_seq == 0)
    m->max_seq = seq;
  if (m->layers < 1 || m->hidden < 1 || m->heads < 1 || m->vocab < 2 || m->kv_heads < 1 ||
      m->ffn < 1 || seq < 1)
    snprintf(why, whylen,
             "layers (%d), hidden (%d), heads (%d), kv heads (%d), ffn (%d) and seq (%d) must be "
             ">= 1 and vocab (%d) >= 2",
             m->layers, m->hidden, m->heads, m->kv_heads, m->ffn, seq, m->vocab);
  else if (m->hidden % m->heads != 0)
    snprintf(why, whylen, "hidden (%d) must be divisible by heads (%d)", m->hidden, m->heads);
  else if (m->heads % m->kv_heads != 0)
    snprintf(why, whylen, "heads (%d) must be divisible by kv heads (%d)", m->heads, m->kv_heads);
  else if (m->arch == DT_PLAN_GPT2 && m->kv_heads != m->heads)
    snprintf(why, whylen, "GPT-2 has no grouped-query attention (kv heads %d != heads %d)",
             m->kv_heads, m->heads);
  else if (m->arch == DT_PLAN_GPT2 && seq > m->max_seq)
    snprintf(why, whylen, "seq (%d) exceeds the model's learned positions (max_seq %d)", seq,
             m->max_seq);
  else
    return 0;
  return DT_EINVAL;
}

static int64_t padded_vocab(const dt_plan_model_t *m)
{
  return ((int64_t)m->vocab + 127) / 128 * 128;
}

/* The kv projection width: kv_heads x head dimension. */
static double kv_width(const dt_plan_model_t *m)
{
  return (double)m->kv_heads * (m->hidden / m->heads);
}

/* One layer's parameters: split over tp, and replicated on every tp rank. */
static void layer_params(const dt_plan_model_t *m, double *split, double *repl)
{
  const double h = m->hidden, f = m->ffn, k = kv_width(m);
  if (m->arch == DT_PLAN_GPT2) {
    /* qkv (3h^2 + 3h), attention projection h^2, fc (hf + f), fc projection fh: split;
     * two LayerNorms (4h) and the row-parallel biases (2h): replicated. */
    *split = 4 * h * h + 3 * h + 2 * h * f + f;
    *repl = 6 * h;
  } else {
    *split = 2 * h * h + 2 * h * k + 3 * h * f; /* q, o; k, v; gate, up, down */
    *repl = 2 * h;                              /* two RMSNorms */
  }
}

int64_t dt_plan_params(const dt_plan_model_t *m)
{
  double split, repl;
  layer_params(m, &split, &repl);
  const int64_t V = m->vocab, h = m->hidden;
  const int64_t layer = (int64_t)(split + repl);
  if (m->arch == DT_PLAN_GPT2)
    return V * h + (int64_t)m->max_seq * h + m->layers * layer + 2 * h;
  return 2 * V * h + m->layers * layer + h;
}

void dt_plan_stage_bounds(int layers, double head_layers, int stages, int *bounds)
{
  const double per_stage = (layers + head_layers) / stages;
  bounds[0] = 0;
  for (int s = 1; s < stages; s++) {
    int b = (int)(s * per_stage + 0.5);
    b = DT_MAX(b, bounds[s - 1] + 1);
    b = DT_MIN(b, layers - (stages - s));
    bounds[s] = b;
  }
  bounds[stages] = layers;
}

void dt_planner_partition(const dt_plan_model_t *m, int pp, int *bounds)
{
  dt_plan_stage_bounds(m->layers, (double)padded_vocab(m) / (12.0 * m->hidden), pp, bounds);
}

/* Layers on stage s. */
static int stage_layers(const dt_plan_model_t *m, int pp, int s)
{
  if (pp == 1)
    return m->layers;
  int *b = malloc(((size_t)pp + 1) * sizeof *b);
  if (!b) /* cannot happen for sane pp; an even split is the best guess */
    return m->layers / pp;
  dt_planner_partition(m, pp, b);
  int n = b[s + 1] - b[s];
  free(b);
  return n;
}

/* Parameters of stage s's rank, as doubles (also the parts ZeRO's working buffers mirror). */
typedef struct {
  double total, layer, embed, final;
} rank_params_t;

static void rank_params(const dt_plan_model_t *m, int tp, int pp, int s, rank_params_t *rp)
{
  double split, repl;
  layer_params(m, &split, &repl);
  const int first = s == 0, last = s == pp - 1, n = stage_layers(m, pp, s);
  const double h = m->hidden, wte = (double)padded_vocab(m) * h / tp;
  rp->layer = split / tp + repl;
  if (m->arch == DT_PLAN_GPT2) {
    rp->embed = (first || last ? wte : 0) + (first ? (double)m->max_seq * h : 0);
    rp->final = last ? 2 * h : 0;
  } else {
    rp->embed = (first ? wte : 0) + (last ? wte : 0);
    rp->final = last ? h : 0;
  }
  rp->total = n * rp->layer + rp->embed + rp->final;
}

int64_t dt_plan_rank_params(const dt_plan_model_t *m, int tp, int pp, int stage)
{
  rank_params_t rp;
  rank_params(m, tp, pp, stage, &rp);
  return (int64_t)llround(rp.total);
}

/* ------------------------------------------------------------------------------------------ */
/* Memory                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* Bytes of each state per parameter (planner.h): the weights (p), the bf16 copy kept beside
 * whole weights (p16), the gradients (g), the optimizer (o); and of each value an activation
 * or gradient message carries (act). */
typedef struct {
  double p, p16, g, o, act;
} prec_bytes_t;

static prec_bytes_t prec_bytes(dt_plan_precision_t prec)
{
  switch (prec) {
  case DT_PLAN_BF16:
    return (prec_bytes_t){4, 2, 4, 8, 4};
  case DT_PLAN_MIXED16:
    return (prec_bytes_t){2, 0, 2, 12, 2};
  default:
    return (prec_bytes_t){4, 0, 4, 8, 4};
  }
}

/* P sharded over n: the biggest shard when `ceil`, else exactly P / n. */
static void state_bytes(double P, int n, int zero, dt_plan_precision_t prec, int ceil_shard,
                        dt_plan_mem_t *out)
{
  const prec_bytes_t b = prec_bytes(prec);
  const double shard = ceil_shard ? ceil(P / n) : P / n;
  out->params = zero >= 3 ? b.p * shard : (b.p + b.p16) * P;
  out->grads = b.g * (zero >= 2 ? shard : P);
  out->optim = b.o * (zero >= 1 ? shard : P);
  out->working = out->acts = 0;
  out->total = out->params + out->grads + out->optim;
}

void dt_plan_state_bytes(double P, int n, int zero, dt_plan_precision_t prec, dt_plan_mem_t *out)
{
  state_bytes(P, n, zero, prec, 0, out);
}

/* Micro-batches whose activations stage s keeps alive (1F1B), or 1 without a pipeline. */
/* Context-parallel ranks (0 in a layout means none: 1). */
static int cp_of(const dt_plan_layout_t *l)
{
  return l->cp > 1 ? l->cp : 1;
}

/* The gradient and ZeRO group: dp x cp ranks. */
static int grad_group(const dt_plan_layout_t *l)
{
  return l->dp * cp_of(l);
}

static int live_slots(const dt_plan_layout_t *l, int s)
{
  return l->pp == 1 ? 1 : DT_MIN(l->pp - s, l->accum);
}

/* Bytes of a value of q, k and v's gradient in distrain's trainer: 2 where the bf16 flash
 * backward writes it in bf16 (one whole sequence, rows of (C + 2k)/t values a whole number of
 * floats), else 4. */
static double dqkv_bytes(const dt_plan_model_t *m, const dt_plan_train_t *tr,
                         const dt_plan_layout_t *l)
{
  const long row = (long)((m->hidden + 2 * kv_width(m)) / l->tp);
  return tr->precision == DT_PLAN_BF16 && !tr->materialized && cp_of(l) == 1 && row % 2 == 0 ? 2
                                                                                             : 4;
}

/* distrain's trainer, float for float (planner.h), bytes. */
static double acts_trainer(const dt_plan_model_t *m, const dt_plan_train_t *tr,
                           const dt_plan_layout_t *l, int s)
{
  const double cp = cp_of(l), b = l->micro, S = tr->seq / cp, N = b * S, C = m->hidden;
  const double t = l->tp, F = m->ffn, k = kv_width(m), a = m->heads;
  const double Vp = (double)padded_vocab(m);
  const int last = s == l->pp - 1, Ls = stage_layers(m, l->pp, s);
  const int bf16 = tr->precision == DT_PLAN_BF16;
  const double w = bf16 ? 2 : 4; /* bytes of a value only a linear layer reads */
  const double mlp = (m->arch == DT_PLAN_LLAMA ? 2 : 1) * N * F / t; /* + the activation */
  /* cp: the whole sequence's q, k, v; each of the rank's two chunks' scores against the keys
   * up to its end, (S/2)^2 (2 cp + 1) per head in all */
  const double qkv = cp * N * (C + 2 * k) / t;
  const double att = !tr->materialized ? b * (a / t) * S /* flash: the rows' lse */
                     : cp > 1          ? b * (a / t) * (S / 2) * (S / 2) * (2 * cp + 1)
                                       : b * (a / t) * S * S;
  /* ln1 and ln2, the MLP's pre-activation and activation, at w bytes; q, k, v and the
   * attention's output too for bf16 flash attention */
  const double qkv_w = !tr->materialized ? w : 4;
  const double layer =
      4 * (N * C + 4 * N + att) + w * mlp + qkv_w * (qkv + N * C / t) + w * (2 * N * C + N * F / t);
  double slot = 4 * ((Ls + 2) * N * C + 2 * N) + (l->ckpt ? 0 : Ls * layer);
  if (last) /* the final norm, its mean and rstd, the losses, the logits */
    slot += w * N * C + 4 * 3 * N + w * N * Vp / t;
  /* dbuf, and the branch outputs' tmp but where bf16 without tp adds them in the GEMMs */
  double scratch = (bf16 && t == 1 ? 1 : 2) * N * C + (tr->materialized ? att : 0);
  if (cp > 1) /* the group's gathered rows and their gradients */
    scratch += 2 * qkv;
  if (t > 1 && last)
    scratch += 3 * (t + 1) * N;
  /* the MLP pre-activation's gradient at w bytes, q, k and v's at dqkv_bytes; bf16: a linear
   * layer's input rounded */
  scratch = 4 * scratch + w * N * F / t + dqkv_bytes(m, tr, l) * N * (C + 2 * k) / t +
            (bf16 ? w * N * C : 0) + (l->ckpt ? layer : 0);
  return scratch + live_slots(l, s) * slot;
}

/* Bytes rounded up to a multiple of unit. */
static double round_up(double bytes, double unit)
{
  return ceil(bytes / unit) * unit;
}

/* The bf16 linear layer's workspace request (kernels/cuda/matmul.cu): a bf16 copy of the weight
 * (OC x IN) when no bf16 copy is kept (ZeRO-3), and of the output gradient (rows x OC) with its
 * bias gradient's partial column sums (one row of OC per COLSUM_ROWS = 256 rows, or more rows
 * per block past the grid's 65535), each piece 256-byte aligned. A gradient held in bf16 (the fc
 * layer's) has no copy: its partial sums are a request of their own, before the weight's. */
static double linear_ws(double rows, double OC, double IN, int weight_copy, int dout_copy, int bias)
{
  const double per_block = 256 * ceil(ceil(rows / 256) / 65535);
  const double weight = weight_copy ? round_up(OC * IN * 2, 256) : 0;
  const double partial = bias ? round_up(ceil(rows / per_block) * OC * 4, 256) : 0;
  return dout_copy ? weight + round_up(rows * OC * 2, 256) + partial : DT_MAX(weight, partial);
}

/* The bf16 flash attention backward's workspace request (kernels/cuda/flash_mma.cuh,
 * fmma_backward_ws) for B sequences of NH heads, Tq queries from position q0: D (B NH Tq floats,
 * 256-byte aligned), then one group's score gradients in bf16 tiles of 64 keys x 64 queries (the
 * key blocks' tiles from the diagonal's on): sequences in balanced groups within 1 GiB of tiles,
 * else one sequence's heads so, else (one head's past 1 GiB: T over 32768) none. */
static double flash_bf16_ws(double B, double NH, double Tq, double q0)
{
  const double GiB = 1024.0 * 1024 * 1024, d = round_up(B * NH * Tq * 4, 256);
  const double nqt = ceil(Tq / 64), nkb = ceil((q0 + Tq) / 64), s = DT_MAX(0, nkb - ceil(q0 / 64));
  const double per_h = (nkb * nqt - s * (s - 1) / 2) * 64 * 64 * 2;
  if (per_h > GiB)
    return d;
  if (NH * per_h <= GiB)
    return d + ceil(B / ceil(B * NH * per_h / GiB)) * NH * per_h;
  return d + ceil(NH / ceil(NH * per_h / GiB)) * per_h;
}

/* What a GPU trainer allocates beside its tensors (planner.h), bytes. */
static double device_trainer(const dt_plan_model_t *m, const dt_plan_train_t *tr,
                             const dt_plan_layout_t *l, int s)
{
  const double MiB = 1024.0 * 1024.0;
  const double cp = cp_of(l), S = tr->seq / cp, N = l->micro * S, C = m->hidden, t = l->tp;
  const double Vl = (double)padded_vocab(m) / t, F = m->ffn / t, Q = (C + 2 * kv_width(m)) / t;
  const double halves = cp > 1 ? 2 : 1; /* attention and the embedding by chunk under cp */
  const int bias = m->arch == DT_PLAN_GPT2, zero3 = l->zero == 3 && grad_group(l) > 1;
  const double ln_rows = DT_MAX(32.0, ceil(N / 1024));
  double ws = 8.0 * (1024 + 1);                   /* the gradient norm's partial sums */
  ws = DT_MAX(ws, 2 * ceil(N / ln_rows) * C * 4); /* LayerNorm's weight gradients */
  if (!tr->materialized) { /* flash: D = dout . out per query (and bf16's score gradients) */
    const double Tq = S / halves, q0 = cp > 1 ? (2 * cp - 1) * Tq : 0; /* rank 0's last chunk */
    ws = DT_MAX(ws, tr->precision == DT_PLAN_BF16 ? flash_bf16_ws(l->micro, m->heads / t, Tq, q0)
                                                  : l->micro * (m->heads / t) * Tq * 4);
  }
  if (s == 0) { /* the tokens sorted by row */
    const double bt = l->micro * S / halves;
    ws = DT_MAX(ws, (2 * DT_MIN(bt, Vl) + 1 + bt) * 4);
  }
  if (tr->precision == DT_PLAN_BF16) {
    const double layers[4][2] = {{Q, C}, {C, C / t}, {F, C}, {C, F}}; /* qkv, proj, fc, proj */
    for (int i = 0; i < 4; i++) { /* fc's output gradient is bf16 already, qkv's may be */
      const int held16 = i == 2 || (i == 0 && dqkv_bytes(m, tr, l) == 2);
      ws = DT_MAX(ws, linear_ws(N, layers[i][0], layers[i][1], zero3, !held16, bias));
      /* the forwards into bf16 (fc's, qkv's under flash): the bias's bf16 copy after the
       * weight's (cuBLASLt's bias epilogue takes a bias of the output's type) */
      if (bias && (i == 2 || (i == 0 && !tr->materialized)))
        ws = DT_MAX(ws, (zero3 ? round_up(layers[i][0] * layers[i][1] * 2, 256) : 0) +
                            round_up(layers[i][0] * 2, 256));
    }
    if (s == l->pp - 1) /* the LM head: its dlogits are bf16 already */
      ws = DT_MAX(ws, linear_ws(N, Vl, C, zero3, 0, 0));
  }
  const double ones = tr->precision == DT_PLAN_FP32 && bias ? round_up(N * 4, MiB) : 0;
  return 32 * MiB + round_up(ws, MiB) + ones;
}

/* The textbook 16-bit trainer: Korthikanti et al. (planner.h), bytes. */
static double acts_mixed16(const dt_plan_model_t *m, const dt_plan_train_t *tr,
                           const dt_plan_layout_t *l, int s)
{
  const double cp = cp_of(l), b = l->micro, S = tr->seq / cp, h = m->hidden, t = l->tp;
  const double a = m->heads, F = m->ffn, k = kv_width(m), sbh = S * b * h;
  const int last = s == l->pp - 1, Ls = stage_layers(m, l->pp, s);
  /* cp: scores of the local queries against the keys up to their chunk's end (as fp32), and
   * the other ranks' k and v rows gathered for them */
  const double s2 = cp > 1 ? (S / 2) * (S / 2) * (2 * cp + 1) : S * S;
  const double kv_gathered = 2 * (cp - 1) * S * b * (h + 2 * k) / t;
  double layer;
  /* the probabilities' bytes (GPT-2: softmax, dropout mask and output; Llama: softmax), or
   * with flash attention each row's fp32 log-sum-exp */
  const double probs = !tr->materialized         ? 4 * a * S * b / t
                       : m->arch == DT_PLAN_GPT2 ? 5 * a * s2 * b / t
                                                 : 2 * a * s2 * b / t;
  if (m->arch == DT_PLAN_GPT2)
    layer = sbh * (10 + (8 + 4 * F / h) / t) + probs + kv_gathered;
  else
    layer = sbh * (8 + (4 + 4 * k / h + 6 * F / h) / t) + probs + kv_gathered;
  const double kept = l->ckpt ? 2 * sbh : layer;
  double slot = Ls * kept + 2 * sbh; /* + the stage's input */
  if (last)
    slot += 4 * S * b * (double)padded_vocab(m) / t;
  return live_slots(l, s) * slot + (l->ckpt ? layer : 0);
}

void dt_plan_memory(const dt_plan_model_t *m, const dt_plan_train_t *tr, const dt_plan_layout_t *l,
                    int stage, dt_plan_mem_t *out)
{
  rank_params_t rp;
  rank_params(m, l->tp, l->pp, stage, &rp);
  const int n = grad_group(l);
  state_bytes(rp.total, n, l->zero, tr->precision, 1, out);
  if (l->zero >= 2 && n > 1) {
    /* The trainer's ZeRO-2/3 slots (embeddings, final norm, two layers) of working
     * gradients, and of gathered parameters under ZeRO-3; a staging buffer of one unit and
     * a reduce-scatter landing buffer (the biggest tensor, at most a shard). */
    const prec_bytes_t pb = prec_bytes(tr->precision);
    const double slots = rp.embed + rp.final + 2 * rp.layer;
    const double shard = ceil(rp.total / n);
    const double biggest = DT_MAX((double)padded_vocab(m) * m->hidden / l->tp, rp.layer);
    const double staging = DT_MAX(rp.final, rp.layer);
    out->working = pb.g * slots + (l->zero == 3 ? pb.p * slots : 0) +
                   pb.p * (staging + DT_MIN(DT_MAX(biggest, staging), shard));
  } else if (n > 1) {
    /* ZeRO-0/1: the staging buffer of one unit through which the comm thread (on by default
     * on a GPU) all-reduces each unit's gradients during the backward pass. */
    out->working = prec_bytes(tr->precision).p * DT_MAX(rp.final, rp.layer);
  }
  const int mixed16 = tr->precision == DT_PLAN_MIXED16;
  out->acts = mixed16 ? acts_mixed16(m, tr, l, stage) : acts_trainer(m, tr, l, stage);
  out->device = mixed16 ? 0 : device_trainer(m, tr, l, stage);
  out->total = out->params + out->grads + out->optim + out->working + out->acts + out->device;
}

/* ------------------------------------------------------------------------------------------ */
/* Layouts, communication and time                                                             */
/* ------------------------------------------------------------------------------------------ */

int dt_plan_layout_check(const dt_plan_model_t *m, const dt_plan_train_t *tr,
                         const dt_plan_cluster_t *c, const dt_plan_layout_t *l, char *why,
                         size_t whylen)
{
  const int64_t world = (int64_t)l->dp * l->tp * l->pp * cp_of(l);
  if (l->dp < 1 || l->tp < 1 || l->pp < 1 || l->micro < 1 || l->accum < 1 || l->cp < 0)
    snprintf(why, whylen,
             "dp (%d), tp (%d), pp (%d), micro (%d) and accum (%d) must be >= 1, cp (%d) >= 0",
             l->dp, l->tp, l->pp, l->micro, l->accum, l->cp);
  else if (world != c->gpus)
    snprintf(why, whylen, "dp x tp x pp x cp = %d x %d x %d x %d = %lld, not the %d GPUs", l->dp,
             l->tp, l->pp, cp_of(l), (long long)world, c->gpus);
  else if (tr->seq % (2 * cp_of(l)) != 0 && cp_of(l) > 1)
    snprintf(why, whylen, "cp (%d): 2 x cp must divide the sequence (%d), split into 2 x cp chunks",
             l->cp, tr->seq);
  else if (l->zero < 0 || l->zero > 3)
    snprintf(why, whylen, "zero stage %d: expected 0..3", l->zero);
  else if (l->ckpt != 0 && l->ckpt != 1)
    snprintf(why, whylen, "activation checkpointing is 0 or 1, got %d", l->ckpt);
  else if (m->heads % l->tp != 0 || m->kv_heads % l->tp != 0)
    snprintf(why, whylen, "tp (%d) must divide the attention heads (%d) and kv heads (%d)", l->tp,
             m->heads, m->kv_heads);
  else if (padded_vocab(m) % l->tp != 0 || m->ffn % l->tp != 0)
    snprintf(why, whylen, "tp (%d) must divide the padded vocabulary (%lld) and the ffn width (%d)",
             l->tp, (long long)padded_vocab(m), m->ffn);
  else if (l->tp > c->gpus_per_node)
    snprintf(why, whylen, "tp (%d) must stay within a node (%d GPUs per node)", l->tp,
             c->gpus_per_node);
  else if (m->layers % l->pp != 0)
    snprintf(why, whylen, "pp (%d) must divide the layers (%d)", l->pp, m->layers);
  else if ((int64_t)l->dp * l->micro * l->accum != tr->global_batch)
    snprintf(why, whylen, "dp x micro x accum = %d x %d x %d must equal the global batch %d", l->dp,
             l->micro, l->accum, tr->global_batch);
  else
    return 0;
  return DT_EINVAL;
}

/* Data-parallel bytes one rank of stage s sends per step, and how much of it is exposed. */
static void dp_comm(const dt_plan_layout_t *l, double P, int units, dt_plan_precision_t prec,
                    double bw, double alpha, double t_bwd_micro, double t_compute, double *bytes,
                    double *exposed)
{
  const prec_bytes_t b = prec_bytes(prec);
  const double p = b.p, g = b.g, N = grad_group(l), f = (N - 1) / N, K = l->accum;
  double overlapped = 0, after = 0, window = 0, n_over = 0;
  switch (l->zero) {
  case 0:
    overlapped = 2 * f * g * P, window = t_bwd_micro, n_over = 1;
    break;
  case 1:
    overlapped = f * g * P, after = f * p * P, window = t_bwd_micro, n_over = 1;
    break;
  case 2:
    overlapped = K * f * g * P, after = f * p * P, window = t_bwd_micro * K, n_over = K * units;
    break;
  default:
    overlapped = K * f * (2 * p + g) * P, window = t_compute, n_over = 3 * K * units;
    break;
  }
  *bytes = overlapped + after;
  *exposed =
      DT_MAX(0.0, overlapped / bw + n_over * alpha - window) + (after > 0 ? after / bw + alpha : 0);
}

void dt_plan_evaluate(const dt_plan_model_t *m, const dt_plan_train_t *tr,
                      const dt_plan_cluster_t *c, const dt_plan_layout_t *l, dt_plan_eval_t *out)
{
  memset(out, 0, sizeof *out);
  out->layout = *l;
  const double cp = cp_of(l), tokens = (double)tr->global_batch * tr->seq;
  const double world = (double)l->dp * l->tp * l->pp * cp;
  const double flops = (l->ckpt ? 8.0 : 6.0) * (double)dt_plan_params(m) * tokens;
  const double bwd_share = l->ckpt ? 6.0 / 8.0 : 4.0 / 6.0; /* (recompute +) backward */
  out->t_compute = flops / world / (c->peak_flops * c->mfu);
  const double K = l->accum, act = prec_bytes(tr->precision).act;
  const double bsh = (double)l->micro * tr->seq / cp * m->hidden; /* a micro-batch's rows */
  const double bw_tp = c->intra_bw;
  const double bw_cp = l->tp * cp <= c->gpus_per_node ? c->intra_bw : c->inter_bw;
  const double bw_dp =
      (int64_t)grad_group(l) * l->tp <= c->gpus_per_node ? c->intra_bw : c->inter_bw;
  const double bw_pp = world <= c->gpus_per_node ? c->intra_bw : c->inter_bw;
  double worst_t = -1;
  for (int s = 0; s < l->pp; s++) {
    dt_plan_mem_t mem;
    dt_plan_memory(m, tr, l, s, &mem);
    if (s == 0 || mem.total > out->mem.total) {
      out->mem = mem;
      out->worst_stage = s;
    }
    rank_params_t rp;
    rank_params(m, l->tp, l->pp, s, &rp);
    double dpb = 0, dpx = 0;
    if (grad_group(l) > 1)
      dp_comm(l, rp.total, stage_layers(m, l->pp, s) + 2, tr->precision, bw_dp, c->latency,
              bwd_share * out->t_compute / K, out->t_compute, &dpb, &dpx);
    const double tpb = l->tp > 1 ? stage_layers(m, l->pp, s) * K * (l->ckpt ? 6 : 4) * 2.0 *
                                       (l->tp - 1) / l->tp * bsh * act
                                 : 0;
    const double ppb = ((s > 0) + (s < l->pp - 1)) * K * bsh * act;
    const double n_tp = l->tp > 1 ? stage_layers(m, l->pp, s) * K * (l->ckpt ? 6 : 4) : 0;
    const double n_pp = ((s > 0) + (s < l->pp - 1)) * K;
    /* cp: per layer and micro-batch the q, k, v rows all-gathered (again when recomputed) and
     * their gradients reduce-scattered, (cp - 1) of the rank's rows sent each time */
    const double n_cp = cp > 1 ? stage_layers(m, l->pp, s) * K * (l->ckpt ? 3 : 2) : 0;
    const double cpb =
        n_cp * (cp - 1) * bsh / m->hidden * (m->hidden + 2 * kv_width(m)) / l->tp * act;
    const double exposed =
        dpx + tpb / bw_tp + ppb / bw_pp + cpb / bw_cp + (n_tp + n_pp + n_cp) * c->latency;
    if (exposed > worst_t) { /* the slowest stage sets the pace */
      worst_t = exposed;
      out->comm_dp = dpb, out->comm_tp = tpb, out->comm_pp = ppb, out->comm_cp = cpb;
      out->comm = dpb + tpb + ppb + cpb;
      out->t_comm = exposed;
    }
  }
  out->bubble = (l->pp - 1) / (K + l->pp - 1);
  out->t_step = out->t_compute + out->t_compute * (l->pp - 1) / K + out->t_comm; /* ties exact */
  out->tokens_per_s = tokens / out->t_step;
  out->fits = out->mem.total + c->reserve <= c->gpu_mem;
}

static int cmp_eval(const void *pa, const void *pb)
{
  const dt_plan_eval_t *a = pa, *b = pb;
  if (a->fits != b->fits)
    return b->fits - a->fits;
  double x = a->fits ? a->t_step : a->mem.total, y = b->fits ? b->t_step : b->mem.total;
  if (x == y && a->fits) /* equally fast: the one that sends less, */
    x = a->comm, y = b->comm;
  /* then the one with fewer, larger micro-batches (the time model's constant MFU does not see
   * that a GPU runs a bigger GEMM closer to its peak and launches fewer kernels per token),
   * then the smaller */
  if (x == y && a->fits)
    x = a->layout.accum, y = b->layout.accum;
  if (x == y)
    x = a->mem.total, y = b->mem.total;
  return x < y ? -1 : x > y;
}

int dt_plan_enumerate(const dt_plan_model_t *m, const dt_plan_train_t *tr,
                      const dt_plan_cluster_t *c, dt_plan_eval_t **out, int *n, char *why,
                      size_t whylen)
{
  *out = NULL;
  *n = 0;
  if (c->gpus < 1 || c->gpus_per_node < 1 || tr->global_batch < 1) {
    snprintf(why, whylen, "gpus (%d), gpus per node (%d) and the global batch (%d) must be >= 1",
             c->gpus, c->gpus_per_node, tr->global_batch);
    return DT_EINVAL;
  }
  size_t cap = 64, cnt = 0;
  dt_plan_eval_t *v = malloc(cap * sizeof *v);
  if (!v)
    return DT_ENOMEM;
  char ignored[256];
  for (int tp = 1; tp <= DT_MIN(c->gpus_per_node, m->heads); tp++) {
    for (int pp = 1; pp <= m->layers; pp++) {
      for (int cp = 1; cp <= c->gpus / (tp * pp); cp++) {
        if (m->heads % tp || m->layers % pp || c->gpus % (tp * pp * cp) || tr->seq % (2 * cp))
          continue;
        const int dp = c->gpus / (tp * pp * cp);
        if (tr->global_batch % dp)
          continue;
        const int per_rank = tr->global_batch / dp;
        for (int micro = 1; micro <= per_rank;
             micro = micro * 2 > per_rank && micro != per_rank ? per_rank : micro * 2) {
          if (per_rank % micro)
            continue;
          for (int zero = 0; zero <= (dp * cp > 1 ? 3 : 0); zero++)
            for (int ckpt = 0; ckpt <= 1; ckpt++) {
              dt_plan_layout_t l = {dp, tp, pp, zero, micro, per_rank / micro, ckpt, cp};
              if (dt_plan_layout_check(m, tr, c, &l, ignored, sizeof ignored) != 0)
                continue;
              if (cnt == cap) {
                dt_plan_eval_t *nv = realloc(v, 2 * cap * sizeof *v);
                if (!nv) {
                  free(v);
                  return DT_ENOMEM;
                }
                v = nv, cap *= 2;
              }
              dt_plan_evaluate(m, tr, c, &l, &v[cnt++]);
            }
        }
      }
    }
  }
  qsort(v, cnt, sizeof *v, cmp_eval);
  *out = v;
  *n = (int)cnt;
  return 0;
}
