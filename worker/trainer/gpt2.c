/* gpt2.c — GPT-2 forward, backward and AdamW step over the dt_ops_t kernel table.
 * See gpt2.h for the layout invariants. */
#include "gpt2.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_log.h"
#include "dt_util.h"
#include "comm.h"
#include "rng.h"

/* ------------------------------------------------------------------------------------------ */
/* Configuration and allocation                                                                */
/* ------------------------------------------------------------------------------------------ */

int dt_gpt2_padded_vocab(int vocab)
{
  return (vocab + 127) / 128 * 128;
}

int dt_gpt2_config_validate(const dt_gpt2_config_t *c, char *why, size_t whylen)
{
  /* The upper bounds are far above any GPT (GPT-3 175B: 96 layers, 12288 channels) and keep
   * every tensor's size, and their sum, well inside 64 bits (under 2^51 elements). */
  const char *msg = NULL;
  if (c->layers < 1 || c->layers > DT_GPT2_MAX_LAYERS)
    msg = "layers must be in [1, 4096]";
  else if (c->heads < 1)
    msg = "heads must be >= 1";
  else if (c->channels < 1 || c->channels > DT_GPT2_MAX_CHANNELS || c->channels % c->heads != 0)
    msg = "channels must be a multiple of heads in [1, 131072]";
  else if (c->vocab < 2 || c->vocab > 65536)
    msg = "vocab must be in [2, 65536] (tokens are uint16)";
  else if (c->padded_vocab < c->vocab || c->padded_vocab > DT_GPT2_MAX_ROWS)
    msg = "padded vocab must be in [vocab, 16777216]";
  else if (c->max_seq < 1 || c->max_seq > DT_GPT2_MAX_ROWS)
    msg = "max_seq must be in [1, 16777216]";
  if (msg) {
    snprintf(why, whylen, "%s (layers=%d heads=%d channels=%d vocab=%d padded_vocab=%d max_seq=%d)",
             msg, c->layers, c->heads, c->channels, c->vocab, c->padded_vocab, c->max_seq);
    return DT_EINVAL;
  }
  return 0;
}

static void point_tensors(dt_gpt2_tensors_t *t, float *flat, const size_t *offsets)
{
  float **ptrs[DT_GPT2_NUM_TENSORS] = {
      &t->wte,  &t->wpe,  &t->ln1w, &t->ln1b, &t->qkvw,    &t->qkvb,    &t->attprojw, &t->attprojb,
      &t->ln2w, &t->ln2b, &t->fcw,  &t->fcb,  &t->fcprojw, &t->fcprojb, &t->lnfw,     &t->lnfb};
  for (int i = 0; i < DT_GPT2_NUM_TENSORS; i++)
    *ptrs[i] = flat + offsets[i];
}

int dt_gpt2_tp_validate(const dt_gpt2_config_t *c, int tp, char *why, size_t whylen)
{
  if (tp < 1)
    snprintf(why, whylen, "tp must be >= 1, got %d", tp);
  else if (c->heads % tp != 0)
    snprintf(why, whylen, "model.heads (%d) must be divisible by parallel.tp (%d)", c->heads, tp);
  else if (c->padded_vocab % tp != 0)
    snprintf(why, whylen, "the padded vocabulary (%d) must be divisible by parallel.tp (%d)",
             c->padded_vocab, tp);
  else
    return 0;
  return DT_EINVAL;
}

/* The global shape and tensor-parallel split of every tensor (DT_GPT2_TENSORS order). */
static void placement(const dt_gpt2_config_t *c, dt_gpt2_place_t *pl)
{
  const size_t L = (size_t)c->layers, C = (size_t)c->channels;
  const dt_gpt2_place_t t[DT_GPT2_NUM_TENSORS] = {
      {1, (size_t)c->padded_vocab, C, DT_SPLIT_ROWS, 1}, /* wte: vocabulary-parallel */
      {1, (size_t)c->max_seq, C, DT_SPLIT_NONE, 1},      /* wpe */
      {L, 1, C, DT_SPLIT_NONE, 1},                       /* ln1w */
      {L, 1, C, DT_SPLIT_NONE, 1},                       /* ln1b */
      {L, 3 * C, C, DT_SPLIT_ROWS, 3},                   /* qkvw: heads of q, k and v */
      {L, 3 * C, 1, DT_SPLIT_ROWS, 3},                   /* qkvb */
      {L, C, C, DT_SPLIT_COLS, 1},                       /* attprojw: row-parallel */
      {L, 1, C, DT_SPLIT_NONE, 1},                       /* attprojb */
      {L, 1, C, DT_SPLIT_NONE, 1},                       /* ln2w */
      {L, 1, C, DT_SPLIT_NONE, 1},                       /* ln2b */
      {L, 4 * C, C, DT_SPLIT_ROWS, 1},                   /* fcw: column-parallel */
      {L, 4 * C, 1, DT_SPLIT_ROWS, 1},                   /* fcb */
      {L, C, 4 * C, DT_SPLIT_COLS, 1},                   /* fcprojw: row-parallel */
      {L, 1, C, DT_SPLIT_NONE, 1},                       /* fcprojb */
      {1, 1, C, DT_SPLIT_NONE, 1},                       /* lnfw */
      {1, 1, C, DT_SPLIT_NONE, 1},                       /* lnfb */
  };
  memcpy(pl, t, sizeof t);
}

/* Tensors with one slice per layer. */
static int layered(int i)
{
  return i >= DT_T_LN1W && i <= DT_T_FCPROJB;
}

/* Whether this rank holds tensor i, and whether it writes it (owns it): replicated tensors
 * are written by tp rank 0, the last stage's copy of wte by nobody (the first stage's is). */
static int holds(const dt_gpt2_t *m, int i)
{
  const dt_gpt2_stage_t *st = &m->stage;
  if (i == DT_T_WTE)
    return st->first || st->last;
  if (i == DT_T_WPE)
    return st->first;
  if (i == DT_T_LNFW || i == DT_T_LNFB)
    return st->last;
  return 1;
}

static int owns(const dt_gpt2_t *m, int tp_rank, int i)
{
  if (i == DT_T_WTE && !m->stage.first)
    return 0;
  return m->place[i].split != DT_SPLIT_NONE || tp_rank == 0;
}

int dt_gpt2_create(dt_gpt2_t *m, const dt_gpt2_config_t *cfg, dt_device_t *dev,
                   const dt_gpt2_tp_t *tp, const dt_gpt2_stage_t *stage)
{
  char why[256];
  memset(m, 0, sizeof *m);
  if (dt_gpt2_config_validate(cfg, why, sizeof why) != 0) {
    DT_ERROR(TRAIN, "invalid model config: %s", why);
    return DT_EINVAL;
  }
  m->tp = tp ? *tp : (dt_gpt2_tp_t){.tp = 1, .rank = 0, .comm = NULL};
  m->cp = (dt_gpt2_cp_t){.cp = 1, .rank = 0, .comm = NULL};
  if (dt_gpt2_tp_validate(cfg, m->tp.tp, why, sizeof why) != 0 || m->tp.rank < 0 ||
      m->tp.rank >= m->tp.tp) {
    DT_ERROR(TRAIN, "invalid tensor parallelism (tp %d, rank %d): %s", m->tp.tp, m->tp.rank, why);
    return DT_EINVAL;
  }
  m->stage =
      stage ? *stage
            : (dt_gpt2_stage_t){.chunks = 1, .lo = {0}, .hi = {cfg->layers}, .first = 1, .last = 1};
  const dt_gpt2_stage_t *st = &m->stage;
  if (st->chunks < 1 || st->chunks > DT_GPT2_MAX_CHUNKS) {
    DT_ERROR(TRAIN, "invalid pipeline stage: %d chunks (1..%d)", st->chunks, DT_GPT2_MAX_CHUNKS);
    return DT_EINVAL;
  }
  for (int c = 0; c < st->chunks; c++) {
    if (st->lo[c] < (c ? st->hi[c - 1] : 0) || st->hi[c] > cfg->layers || st->lo[c] >= st->hi[c]) {
      DT_ERROR(TRAIN, "invalid pipeline stage: chunk %d holds layers [%d, %d) of %d", c, st->lo[c],
               st->hi[c], cfg->layers);
      return DT_EINVAL;
    }
    m->chunk_off[c + 1] = m->chunk_off[c] + st->hi[c] - st->lo[c];
  }
  m->L = m->chunk_off[st->chunks];
  m->cfg = *cfg;
  m->dev = dev;
  m->ops = dev->ops;
  placement(cfg, m->place);
  size_t off = 0, goff = 0;
  for (int i = 0; i < DT_GPT2_NUM_TENSORS; i++) {
    const dt_gpt2_place_t *pl = &m->place[i];
    const size_t whole = pl->layers * pl->rows * pl->cols;
    const size_t here = layered(i) ? (size_t)m->L * pl->rows * pl->cols : whole;
    const size_t n = !holds(m, i) ? 0 : pl->split == DT_SPLIT_NONE ? here : here / (size_t)m->tp.tp;
    m->tensor_sizes[i] = n;
    m->tensor_offsets[i] = off;
    m->global_offsets[i] = goff;
    m->replicated += pl->split == DT_SPLIT_NONE ? n : 0;
    m->owned += owns(m, m->tp.rank, i) ? n : 0;
    off += n;
    goff += whole;
  }
  m->num_params = off;
  m->global_params = goff;
  m->bytes_params = m->bytes_grads = off * sizeof(float);
  int rc = dev->alloc(dev, m->bytes_params, "parameters", (void **)&m->params_flat);
  if (rc == 0)
    rc = dev->alloc(dev, m->bytes_grads, "gradients", (void **)&m->grads_flat);
  if (rc != 0) {
    dt_gpt2_destroy(m);
    return rc;
  }
  point_tensors(&m->params, m->params_flat, m->tensor_offsets);
  point_tensors(&m->grads, m->grads_flat, m->tensor_offsets);
  return 0;
}

/* The buffers of an activation slot, in a fixed order. */
#define DT__ACTS_FIELDS(a)                                                                         \
  {                                                                                                \
    &(a)->encoded, &(a)->ln1, &(a)->ln1_mean, &(a)->ln1_rstd, &(a)->qkv, &(a)->atty, &(a)->att,    \
        &(a)->residual2, &(a)->ln2, &(a)->ln2_mean, &(a)->ln2_rstd, &(a)->fch, &(a)->fch_gelu,     \
        &(a)->residual3, &(a)->lnf, &(a)->lnf_mean, &(a)->lnf_rstd, &(a)->logits, &(a)->losses,    \
        &(a)->dresidual, &(a)->dbuf, &(a)->dbuf4, &(a)->dqkv, &(a)->datt, &(a)->tmp,               \
        &(a)->ce_stats, &(a)->gath, &(a)->tmps, &(a)->lngrad, &(a)->cpbuf, &(a)->dqkv_full         \
  }

/* Its bf16 activation buffers (ops.h), also in a fixed order. */
#define DT__ACTS_BF16_FIELDS(a)                                                                    \
  {                                                                                                \
    &(a)->ln1_16, &(a)->ln2_16, &(a)->fch16, &(a)->fch_gelu16, &(a)->lnf16, &(a)->logits16,        \
        &(a)->x16, &(a)->dfch16, &(a)->dqkv16                                                      \
  }

/* Frees a slot's buffers, except those it shares with the scratch (NULL: frees all). */
static void free_acts(dt_device_t *dev, dt_gpt2_acts_t *a, dt_gpt2_acts_t *scratch)
{
  float **mine[] = DT__ACTS_FIELDS(a);
  void **mine16[] = DT__ACTS_BF16_FIELDS(a);
  dt_gpt2_acts_t none = {0};
  float **shared[] = DT__ACTS_FIELDS(scratch ? scratch : &none);
  void **shared16[] = DT__ACTS_BF16_FIELDS(scratch ? scratch : &none);
  for (size_t k = 0; k < DT_ARRAY_SIZE(mine); k++)
    if (*mine[k] != *shared[k])
      dev->free(dev, *mine[k]);
  for (size_t k = 0; k < DT_ARRAY_SIZE(mine16); k++)
    if (*mine16[k] != *shared16[k])
      dev->free(dev, *mine16[k]);
  dev->free(dev, a->tokens);
}

/* Points a slot at the scratch's buffers (those the scratch has). */
static void share_scratch(dt_gpt2_acts_t *a, dt_gpt2_acts_t *scratch)
{
  float **mine[] = DT__ACTS_FIELDS(a);
  float **shared[] = DT__ACTS_FIELDS(scratch);
  void **mine16[] = DT__ACTS_BF16_FIELDS(a);
  void **shared16[] = DT__ACTS_BF16_FIELDS(scratch);
  for (size_t k = 0; k < DT_ARRAY_SIZE(mine); k++)
    if (*shared[k])
      *mine[k] = *shared[k];
  for (size_t k = 0; k < DT_ARRAY_SIZE(mine16); k++)
    if (*shared16[k])
      *mine16[k] = *shared16[k];
}

void dt_gpt2_destroy(dt_gpt2_t *m)
{
  dt_device_t *dev = m->dev;
  if (!dev) { /* never created */
    memset(m, 0, sizeof *m);
    return;
  }
  dev->free(dev, m->params_flat);
  dev->free(dev, m->grads_flat);
  dev->free(dev, m->m_flat);
  dev->free(dev, m->v_flat);
  dev->free(dev, m->params16);
  dev->free(dev, m->kv);
  for (int c = 0; m->acts && c < m->stage.chunks; c++)
    for (int j = 0; j < m->nslots[c]; j++)
      free_acts(dev, &m->acts[m->slot_base[c] + j], &m->scratch);
  free_acts(dev, &m->scratch, NULL);
  free(m->acts);
  free(m->host_losses);
  memset(m, 0, sizeof *m);
}

/* GPT-2 initialisation of a global (llm.c layout) buffer. */
static void init_global(const dt_gpt2_config_t *c, float *flat, uint64_t seed)
{
  dt_gpt2_place_t pl[DT_GPT2_NUM_TENSORS];
  float *t[DT_GPT2_NUM_TENSORS];
  size_t n[DT_GPT2_NUM_TENSORS], off = 0;
  placement(c, pl);
  for (int i = 0; i < DT_GPT2_NUM_TENSORS; i++) {
    n[i] = pl[i].layers * pl[i].rows * pl[i].cols;
    t[i] = flat + off;
    off += n[i];
  }
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  memset(flat, 0, off * sizeof(float));
  const float std = 0.02f;
  const float proj_std = 0.02f / sqrtf(2.0f * (float)c->layers);
  /* Embeddings: only the real vocabulary rows; the padding stays zero. */
  dt_rng_normal(&rng, t[DT_T_WTE], (size_t)c->vocab * c->channels, 0.0f, std);
  dt_rng_normal(&rng, t[DT_T_WPE], n[DT_T_WPE], 0.0f, std);
  dt_rng_normal(&rng, t[DT_T_QKVW], n[DT_T_QKVW], 0.0f, std);
  dt_rng_normal(&rng, t[DT_T_ATTPROJW], n[DT_T_ATTPROJW], 0.0f, proj_std);
  dt_rng_normal(&rng, t[DT_T_FCW], n[DT_T_FCW], 0.0f, std);
  dt_rng_normal(&rng, t[DT_T_FCPROJW], n[DT_T_FCPROJW], 0.0f, proj_std);
  const int ones[] = {DT_T_LN1W, DT_T_LN2W, DT_T_LNFW};
  for (int k = 0; k < 3; k++)
    for (size_t j = 0; j < n[ones[k]]; j++)
      t[ones[k]][j] = 1.0f;
}

int dt_gpt2_init_weights(dt_gpt2_t *m, uint64_t seed)
{
  if (m->num_params == m->global_params && m->dev->host) {
    init_global(&m->cfg, m->params_flat, seed);
    dt_gpt2_params_written(m);
    return 0;
  }
  /* The same weights as one process, then this rank's part: the whole model is held once in
   * host memory, briefly, at start-up. */
  float *global = dt_calloc_aligned(m->global_params * sizeof(float), "initial weights");
  if (!global)
    return DT_ENOMEM;
  init_global(&m->cfg, global, seed);
  int rc = dt_gpt2_load_global(m, global);
  dt_free_aligned(global);
  return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* Placement: local <-> global                                                                 */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
  dt_gpt2_run_t *v;
  size_t n, cap;
  int oom;
} runs_t;

/* Appends global [g, g + len) held at local l, clipped to the local range [lo, hi). */
static void runs_add(runs_t *r, int64_t g, int64_t l, int64_t len, int64_t lo, int64_t hi)
{
  int64_t a = DT_MAX(l, lo), b = DT_MIN(l + len, hi);
  if (a >= b || r->oom)
    return;
  g += a - l;
  if (r->n > 0) {
    dt_gpt2_run_t *last = &r->v[r->n - 1];
    if (last->global + last->len == g && lo + last->local + last->len == a) {
      last->len += b - a;
      return;
    }
  }
  if (r->n == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 64;
    dt_gpt2_run_t *grown = realloc(r->v, cap * sizeof *grown);
    if (!grown) {
      r->oom = 1;
      return;
    }
    r->v = grown;
    r->cap = cap;
  }
  r->v[r->n++] = (dt_gpt2_run_t){.global = g, .local = a - lo, .len = b - a};
}

/* The global index of local layer l. */
static int layer_of(const dt_gpt2_t *m, int l)
{
  int c = 0;
  while (l >= m->chunk_off[c + 1])
    c++;
  return m->stage.lo[c] + l - m->chunk_off[c];
}

int dt_gpt2_runs(const dt_gpt2_t *m, int tp_rank, int64_t lo, int64_t hi, int owned_only,
                 dt_gpt2_run_t **out, size_t *nout)
{
  runs_t r = {0};
  const int64_t tp = m->tp.tp;
  for (int i = 0; i < DT_GPT2_NUM_TENSORS; i++) {
    const dt_gpt2_place_t *pl = &m->place[i];
    const int64_t loc = (int64_t)m->tensor_offsets[i], glob = (int64_t)m->global_offsets[i];
    const int64_t R = (int64_t)pl->rows, Cc = (int64_t)pl->cols;
    if (loc >= hi || loc + (int64_t)m->tensor_sizes[i] <= lo || m->tensor_sizes[i] == 0 ||
        (owned_only && !owns(m, tp_rank, i)))
      continue;
    if (!layered(i) && pl->split == DT_SPLIT_NONE) {
      runs_add(&r, glob, loc, (int64_t)m->tensor_sizes[i], lo, hi);
      continue;
    }
    /* Layer by layer: local layer l is global layer layer_of(l). */
    int64_t l_off = loc;
    for (int l = 0; l < (layered(i) ? m->L : 1); l++) {
      const int64_t g_layer = glob + (layered(i) ? layer_of(m, l) : 0) * R * Cc;
      if (pl->split == DT_SPLIT_NONE) {
        runs_add(&r, g_layer, l_off, R * Cc, lo, hi);
        l_off += R * Cc;
      } else if (pl->split == DT_SPLIT_ROWS) {
        const int64_t block = R / pl->blocks, part = block / tp;
        for (int b = 0; b < pl->blocks; b++, l_off += part * Cc)
          runs_add(&r, g_layer + (b * block + tp_rank * part) * Cc, l_off, part * Cc, lo, hi);
      } else {
        const int64_t part = Cc / tp;
        for (int64_t row = 0; row < R; row++, l_off += part)
          runs_add(&r, g_layer + row * Cc + tp_rank * part, l_off, part, lo, hi);
      }
    }
  }
  if (r.oom) {
    free(r.v);
    return DT_ENOMEM;
  }
  *out = r.v;
  *nout = r.n;
  return 0;
}

int64_t dt_gpt2_unowned_in(const dt_gpt2_t *m, int64_t lo, int64_t hi)
{
  int64_t n = 0;
  for (int i = 0; i < DT_GPT2_NUM_TENSORS; i++) {
    if (owns(m, m->tp.rank, i))
      continue;
    int64_t a = DT_MAX(lo, (int64_t)m->tensor_offsets[i]);
    int64_t b = DT_MIN(hi, (int64_t)(m->tensor_offsets[i] + m->tensor_sizes[i]));
    n += b > a ? b - a : 0;
  }
  return n;
}

int dt_gpt2_load_global(dt_gpt2_t *m, const float *global)
{
  dt_gpt2_run_t *runs;
  size_t n;
  int rc = 0;
  DT_CHECK(dt_gpt2_runs(m, m->tp.rank, 0, (int64_t)m->num_params, 0, &runs, &n));
  for (size_t i = 0; i < n && rc == 0; i++)
    rc = m->dev->copy(m->dev, m->params_flat + runs[i].local, global + runs[i].global,
                      (size_t)runs[i].len * sizeof(float), DT_COPY_H2D);
  free(runs);
  dt_gpt2_params_written(m);
  return rc;
}

void dt_gpt2_params_written(dt_gpt2_t *m)
{
  m->params16_stale = 1;
}

/* Context parallelism splits each sequence into 2 x cp chunks of h = T/2 positions (T: the
 * local length) and gives rank r chunks r and 2cp-1-r, a zig-zag: causal attention then costs
 * every rank the same, (2cp+1) h keys per pair of query rows. A rank's rows are half-major,
 * (2, B, h): the first chunk of every sequence, then the second. cp_chunk: the chunk index of
 * half 0 or 1 (its first position is cp_chunk * h). */
static int cp_chunk(const dt_gpt2_t *m, int half)
{
  return half ? 2 * m->cp.cp - 1 - m->cp.rank : m->cp.rank;
}

/* Elements of one layer's attention probabilities for (B, T) with NH heads: (B, NH, T, T), or
 * with context parallelism each half's (B, NH, h, its chunk's end), one after the other; with
 * flash attention the rows' log-sum-exps, (B, NH, T) (each half's (B, NH, h)). */
static size_t att_elems(const dt_gpt2_t *m, int B, int NH, int T)
{
  if (m->flash)
    return (size_t)B * NH * T;
  if (m->cp.cp == 1)
    return (size_t)B * NH * T * T;
  const size_t h = (size_t)T / 2;
  return (size_t)B * NH * h * (size_t)(cp_chunk(m, 0) + cp_chunk(m, 1) + 2) * h;
}

/* Whether q, k, v are a bf16 buffer: bf16 flash attention reads them so (ops.h), which the qkv
 * layer then writes (its GEMM's output rounded as it is stored); else fp32. */
static int qkv16(const dt_gpt2_t *m)
{
  return m->bf16 && m->flash;
}

/* Whether their gradient is a bf16 buffer too: the bf16 flash backward writes it so over one
 * whole sequence (ops.h; context parallelism adds the chunks' parts in fp32), in rows the qkv
 * layer's backward can take (ops.h's dout16: 3 C/tp values a row, a whole number of floats). */
static int dqkv16(const dt_gpt2_t *m)
{
  const size_t row = 3 * (size_t)(m->cfg.channels / m->tp.tp);
  return qkv16(m) && m->cp.cp == 1 && row * m->ops->bf16_bytes % sizeof(float) == 0;
}

/* bf16 compute where each rank holds whole rows of the residual stream's width (no tensor
 * parallelism: no branch output or input gradient is a partial sum to all-reduce in fp32). Then
 * the projections add their branch to the stream in their GEMM (ops.h's res), and the linear
 * layers write the gradients of the LayerNorms' outputs in bf16 (dinp16), as autocast's bf16
 * GEMMs return them, which the LayerNorms' backward reads as they are. */
static int whole_bf16(const dt_gpt2_t *m)
{
  return m->bf16 && m->tp.tp == 1;
}

/* whole_bf16 with bf16 flash gradients (dqkv16): the attention projection's input gradient is
 * bf16 too (its dinp16), as autocast's bf16 GEMM returns it, and the flash backward reads it as
 * it is (its dout16). */
static int datty16(const dt_gpt2_t *m)
{
  return whole_bf16(m) && dqkv16(m);
}

/* Bytes of a q, k, v value, and of a value of the attention's output (bf16 flash attention
 * writes it in bf16 too, what the attention projection reads). */
static size_t qkv_bytes(const dt_gpt2_t *m)
{
  return qkv16(m) ? m->ops->bf16_bytes : sizeof(float);
}

/* Rows of the residual stream this rank holds for an allocated (B, T): all, or N/tp. */
static size_t stream_rows(const dt_gpt2_t *m, size_t N)
{
  return m->sp ? N / (size_t)m->tp.tp : N;
}

#define DT__ALLOC_BYTES(field, count, size)                                                        \
  do {                                                                                             \
    ok = ok &&                                                                                     \
         m->dev->alloc(m->dev, (count) * (size), "activation " #field, (void **)&a->field) == 0;   \
    total += (count) * (size);                                                                     \
  } while (0)
#define DT__ALLOC(field, count) DT__ALLOC_BYTES(field, count, sizeof(float))

/* A layer's inner activations for Lh layers (the slot's layers, or with activation
 * checkpointing one layer's worth in the scratch that every layer reuses). With sequence
 * parallelism the residual stream and the LayerNorm regions hold this rank's Ns = N / tp rows
 * only. Returns 0 when out of memory. */
static int alloc_layers(dt_gpt2_t *m, dt_gpt2_acts_t *a, size_t Lh, int B, int T, size_t *bytes)
{
  const dt_gpt2_config_t *c = &m->cfg;
  const size_t N = (size_t)B * T, C = (size_t)c->channels, tp = (size_t)m->tp.tp;
  const size_t NH = (size_t)c->heads / tp, Cl = C / tp, Ns = stream_rows(m, N);
  size_t total = 0;
  int ok = 1;
  const int keep16 = m->bf16 && !m->sp; /* SP gathers the LayerNorms' rows: fp32 there */
  if (keep16)
    DT__ALLOC_BYTES(ln1_16, Lh * Ns * C, m->ops->bf16_bytes);
  else
    DT__ALLOC(ln1, Lh * Ns * C);
  DT__ALLOC(ln1_mean, Lh * Ns);
  DT__ALLOC(ln1_rstd, Lh * Ns);
  DT__ALLOC_BYTES(qkv, Lh * N * (size_t)m->cp.cp * 3 * Cl, qkv_bytes(m));
  DT__ALLOC_BYTES(atty, Lh * N * Cl, qkv_bytes(m));
  DT__ALLOC(att, Lh * att_elems(m, B, (int)NH, T));
  DT__ALLOC(residual2, Lh * Ns * C);
  if (keep16)
    DT__ALLOC_BYTES(ln2_16, Lh * Ns * C, m->ops->bf16_bytes);
  else
    DT__ALLOC(ln2, Lh * Ns * C);
  DT__ALLOC(ln2_mean, Lh * Ns);
  DT__ALLOC(ln2_rstd, Lh * Ns);
  if (m->bf16) { /* the GELU and its gradient read the one, the next linear layer the other */
    DT__ALLOC_BYTES(fch16, Lh * N * 4 * Cl, m->ops->bf16_bytes);
    DT__ALLOC_BYTES(fch_gelu16, Lh * N * 4 * Cl, m->ops->bf16_bytes);
  } else {
    DT__ALLOC(fch, Lh * N * 4 * Cl);
    DT__ALLOC(fch_gelu, Lh * N * 4 * Cl);
  }
  *bytes += total;
  return ok;
}

/* The buffers every slot shares: the backward pass's and the collectives' scratch, which no
 * pass keeps between calls. Returns its bytes, 0 when out of memory. */
static size_t alloc_scratch(dt_gpt2_t *m, int B, int T)
{
  dt_gpt2_acts_t *a = &m->scratch;
  const dt_gpt2_config_t *c = &m->cfg;
  const size_t N = (size_t)B * T, C = (size_t)c->channels, tp = (size_t)m->tp.tp;
  const size_t NH = (size_t)c->heads / tp, Cl = C / tp;
  size_t total = 0;
  int ok = !m->recompute || alloc_layers(m, a, 1, B, T, &total);
  if (m->sp) {
    DT__ALLOC(gath, N * C);
    DT__ALLOC(tmps, N / tp * C);
    DT__ALLOC(lngrad, 2 * C);
  }
  DT__ALLOC(dbuf, N * C);
  if (m->bf16)
    DT__ALLOC_BYTES(dfch16, N * 4 * Cl, m->ops->bf16_bytes);
  else
    DT__ALLOC(dbuf4, N * 4 * Cl);
  if (dqkv16(m))
    DT__ALLOC_BYTES(dqkv16, N * 3 * Cl, m->ops->bf16_bytes);
  else
    DT__ALLOC(dqkv, N * 3 * Cl);
  if (!m->flash)
    DT__ALLOC(datt, att_elems(m, B, (int)NH, T));
  if (m->cp.cp > 1) {
    DT__ALLOC(cpbuf, (size_t)m->cp.cp * N * 3 * Cl);
    DT__ALLOC(dqkv_full, (size_t)m->cp.cp * N * 3 * Cl);
  }
  if (!whole_bf16(m)) /* else the projections add their branches in their GEMMs */
    DT__ALLOC(tmp, N * C);
  if (m->bf16)
    DT__ALLOC_BYTES(x16, N * C, m->ops->bf16_bytes);
  if (tp > 1 && m->stage.last)
    DT__ALLOC(ce_stats, (tp + 1) * N * 3); /* all ranks' stats, then this rank's */
  return ok ? total : 0;
}

/* One activation slot of chunk; returns its bytes, 0 when out of memory. */
static size_t alloc_slot(dt_gpt2_t *m, dt_gpt2_acts_t *a, int chunk, int B, int T)
{
  const dt_gpt2_config_t *c = &m->cfg;
  const size_t N = (size_t)B * T, C = (size_t)c->channels, Ns = stream_rows(m, N);
  const size_t L = (size_t)(m->chunk_off[chunk + 1] - m->chunk_off[chunk]);
  const size_t Vl = (size_t)c->padded_vocab / (size_t)m->tp.tp;
  size_t total = 0;
  int ok = 1;
  /* The layer outputs (residual3) are kept for every layer, with checkpointing too. */
  DT__ALLOC(encoded, Ns * C);
  ok = ok && (m->recompute || alloc_layers(m, a, L, B, T, &total));
  DT__ALLOC(residual3, L * Ns * C);
  if (m->stage.last && chunk == m->stage.chunks - 1) {
    if (m->bf16 && !m->sp)
      DT__ALLOC_BYTES(lnf16, N * C, m->ops->bf16_bytes);
    else
      DT__ALLOC(lnf, N * C); /* gathered: the LM head needs every row */
    DT__ALLOC(lnf_mean, Ns);
    DT__ALLOC(lnf_rstd, Ns);
    if (m->bf16)
      DT__ALLOC_BYTES(logits16, N * Vl, m->ops->bf16_bytes);
    else
      DT__ALLOC(logits, N * Vl);
    DT__ALLOC(losses, N);
  }
  DT__ALLOC(dresidual, Ns * C);
  if (!m->dev->host) {
    ok = ok &&
         m->dev->alloc(m->dev, 2 * N * sizeof(int), "micro-batch tokens", (void **)&a->tokens) == 0;
    total += 2 * N * sizeof(int);
  }
  share_scratch(a, &m->scratch);
  a->B = B;
  a->T = T;
  return ok ? total : 0;
}
#undef DT__ALLOC
#undef DT__ALLOC_BYTES

int dt_gpt2_alloc_activations(dt_gpt2_t *m, int B, int T, const int *slots, int recompute)
{
  if (T > m->cfg.max_seq) {
    DT_ERROR(TRAIN, "sequence length %d exceeds the model's max_seq %d", T, m->cfg.max_seq);
    return DT_EINVAL;
  }
  if (m->sp && ((size_t)B * T) % (size_t)m->tp.tp != 0) {
    DT_ERROR(TRAIN, "sequence parallelism: batch x seq (%d x %d) must be divisible by tp (%d)", B,
             T, m->tp.tp);
    return DT_EINVAL;
  }
  int total = 0;
  for (int c = 0; c < m->stage.chunks; c++) {
    if (slots[c] < 1) {
      DT_ERROR(TRAIN, "activations: %d slots for chunk %d asked for", slots[c], c);
      return DT_EINVAL;
    }
    total += slots[c];
  }
  if (m->acts) {
    DT_ERROR(TRAIN, "activations: already allocated");
    return DT_EINVAL;
  }
  m->acts = calloc((size_t)total, sizeof *m->acts);
  if (!m->acts)
    return DT_ENOMEM;
  m->recompute = recompute;
  if (!m->dev->host && m->stage.last &&
      !(m->host_losses = calloc((size_t)B * T, sizeof *m->host_losses)))
    return DT_ENOMEM;
  m->bytes_acts = alloc_scratch(m, B, T);
  if (!m->bytes_acts)
    return DT_ENOMEM;
  if (m->bf16 && m->params_flat) {
    DT_CHECK(m->dev->alloc(m->dev, m->num_params * m->ops->bf16_bytes, "bf16 weight copy",
                           &m->params16));
    m->params16_stale = 1;
  }
  for (int c = 0, base = 0; c < m->stage.chunks; base += slots[c++]) {
    m->slot_base[c] = base;
    m->nslots[c] = slots[c];
    for (int j = 0; j < slots[c]; j++) {
      size_t bytes = alloc_slot(m, &m->acts[base + j], c, B, T);
      if (!bytes)
        return DT_ENOMEM;
      m->bytes_acts += bytes;
    }
  }
  return 0;
}

int dt_gpt2_set_sequence_parallel(dt_gpt2_t *m, int on)
{
  if (on && m->tp.tp == 1) {
    DT_ERROR(TRAIN, "sequence parallelism needs tensor parallelism (tp > 1)");
    return DT_EINVAL;
  }
  if (m->acts) {
    DT_ERROR(TRAIN, "sequence parallelism must be chosen before the activations are allocated");
    return DT_EINVAL;
  }
  m->sp = on;
  return 0;
}

int dt_gpt2_set_precision(dt_gpt2_t *m, int bf16)
{
  const dt_ops_t *k = m->dev->ops;
  if (bf16 &&
      (!k->matmul_forward_bf16 || !k->matmul_backward_bf16 || !k->to_bf16 ||
       !k->layernorm_forward_bf16 || !k->residual_layernorm_forward_bf16 ||
       !k->layernorm_backward_bf16 || !k->crossentropy_forward_backward_bf16 ||
       !k->crossentropy_vp_stats_bf16 || !k->crossentropy_vp_finish_bf16 || !k->bf16_bytes)) {
    DT_ERROR(TRAIN, "--precision bf16: the %s kernels have no bf16 linear layers and activations",
             k->name);
    return DT_ENOTSUP;
  }
  /* the bf16 dlogits' rows, as matmul_backward_bf16 takes them, are a whole number of floats */
  const int Vl = m->cfg.padded_vocab / m->tp.tp;
  if (bf16 && (size_t)Vl * k->bf16_bytes % sizeof(float) != 0) {
    DT_ERROR(TRAIN,
             "--precision bf16 needs an even vocabulary slice per tp rank: padded vocab %d "
             "/ tp %d = %d",
             m->cfg.padded_vocab, m->tp.tp, Vl);
    return DT_EINVAL;
  }
  if (m->acts) {
    DT_ERROR(TRAIN, "the precision must be chosen before the activations are allocated");
    return DT_EINVAL;
  }
  m->bf16 = bf16; /* dt_gpt2_set_attention refuses flash when the bf16 flash entries are NULL */
  return 0;
}

int dt_gpt2_set_attention(dt_gpt2_t *m, int flash)
{
  const dt_ops_t *k = m->dev->ops;
  if (m->acts) {
    DT_ERROR(TRAIN, "the attention kernels must be chosen before the activations are allocated");
    return DT_EINVAL;
  }
  if (flash && (!k->attention_forward_flash || !k->attention_backward_flash)) {
    DT_ERROR(TRAIN, "--attention flash: the %s kernels have no flash attention", k->name);
    return DT_ENOTSUP;
  }
  const int hs = m->cfg.channels / m->cfg.heads;
  if (flash && k->flash_max_head_size && hs > k->flash_max_head_size) {
    DT_ERROR(TRAIN,
             "--attention flash: the %s flash kernels take head sizes up to %d, the model's is %d "
             "(channels %d / heads %d); use --attention materialized",
             k->name, k->flash_max_head_size, hs, m->cfg.channels, m->cfg.heads);
    return DT_ENOTSUP;
  }
  if (flash && m->bf16 && (!k->attention_forward_flash_bf16 || !k->attention_backward_flash_bf16)) {
    DT_ERROR(TRAIN,
             "--precision bf16 with --attention flash: the %s kernels have no bf16 flash "
             "attention; use --attention materialized (fp32 attention)",
             k->name);
    return DT_ENOTSUP;
  }
  m->flash = flash;
  return 0;
}

int dt_gpt2_set_context_parallel(dt_gpt2_t *m, const dt_gpt2_cp_t *cp)
{
  if (m->acts) {
    DT_ERROR(TRAIN, "context parallelism must be chosen before the activations are allocated");
    return DT_EINVAL;
  }
  if (cp->cp < 1 || cp->rank < 0 || cp->rank >= cp->cp || (cp->cp > 1 && !cp->comm)) {
    DT_ERROR(TRAIN, "invalid context parallelism (cp %d, rank %d)", cp->cp, cp->rank);
    return DT_EINVAL;
  }
  if (cp->cp > 1 && (!m->ops->attention_forward_cp || !m->ops->attention_backward_cp)) {
    DT_ERROR(TRAIN, "context parallelism (cp %d) has no attention kernels on the %s device yet",
             cp->cp, m->ops->name);
    return DT_ENOTSUP;
  }
  m->cp = *cp;
  return 0;
}

size_t dt_gpt2_stage_io_floats(const dt_gpt2_t *m, int B, int T)
{
  return stream_rows(m, (size_t)B * T) * (size_t)m->cfg.channels;
}

int dt_gpt2_alloc_optimizer(dt_gpt2_t *m)
{
  if (m->m_flat)
    return 0;
  dt_device_t *dev = m->dev;
  DT_CHECK(dev->alloc(dev, m->bytes_params, "AdamW first moment", (void **)&m->m_flat));
  DT_CHECK(dev->alloc(dev, m->bytes_params, "AdamW second moment", (void **)&m->v_flat));
  m->bytes_optim = 2 * m->bytes_params;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Units                                                                                       */
/* ------------------------------------------------------------------------------------------ */

int dt_gpt2_unit_ranges(const dt_gpt2_t *m, int unit, dt_flat_range_t *r)
{
  int n = 0;
  if (unit == DT_UNIT_EMBED || unit == DT_UNIT_FINAL) {
    int first = unit == DT_UNIT_EMBED ? DT_T_WTE : DT_T_LNFW;
    for (int k = first; k < first + 2; k++)
      if (m->tensor_sizes[k] > 0) /* a stage holds a subset of these */
        r[n++] = (dt_flat_range_t){m->tensor_offsets[k], m->tensor_sizes[k], k};
    return n;
  }
  for (int k = DT_T_LN1W; k <= DT_T_FCPROJB; k++) {
    size_t per = m->tensor_sizes[k] / (size_t)m->L;
    r[n++] = (dt_flat_range_t){m->tensor_offsets[k] + (size_t)unit * per, per, k};
  }
  return n;
}

int dt_gpt2_unit_order(const dt_gpt2_t *m, int backward, int *u)
{
  const int first = m->stage.first, last = m->stage.last, L = m->L;
  int n = 0;
  if (!backward) {
    if (first)
      u[n++] = DT_UNIT_EMBED;
    for (int l = 0; l < L; l++)
      u[n++] = l;
    if (last) {
      u[n++] = DT_UNIT_FINAL;
      u[n++] = DT_UNIT_EMBED; /* the LM head */
    }
    return n;
  }
  if (last) { /* LM head; one stage holds the embeddings on to the encoder */
    u[n++] = DT_UNIT_EMBED;
    u[n++] = DT_UNIT_FINAL;
  }
  for (int l = L - 1; l >= 0; l--)
    u[n++] = l;
  if (first && !last)
    u[n++] = DT_UNIT_EMBED;
  return n;
}

void dt_gpt2_unit_view(const dt_gpt2_t *m, int unit, float *flat, dt_gpt2_view_t *v)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  int n = dt_gpt2_unit_ranges(m, unit, r);
  memset(v, 0, sizeof *v);
  for (int i = 0; i < n; i++)
    v->t[r[i].tensor] = flat + r[i].off;
}

/* A unit's parameters (with their bf16 copies where the model keeps them: then the parameters
 * are params_flat's, the hooks' too) and, with grads, its gradient accumulators. */
static int acquire(dt_gpt2_t *m, int unit, int grads, dt_gpt2_view_t *p, dt_gpt2_view_t *g)
{
  if (m->hooks) {
    DT_CHECK(m->hooks->acquire(m->hooks->ud, unit, grads, p, g));
  } else {
    dt_gpt2_unit_view(m, unit, m->params_flat, p);
    if (grads)
      dt_gpt2_unit_view(m, unit, m->grads_flat, g);
  }
  if (m->params16) {
    dt_flat_range_t r[DT_UNIT_MAX_RANGES];
    const int n = dt_gpt2_unit_ranges(m, unit, r);
    for (int i = 0; i < n; i++)
      p->t16[r[i].tensor] = (const char *)m->params16 + r[i].off * m->ops->bf16_bytes;
  }
  return 0;
}

static int release(dt_gpt2_t *m, int unit, int grads)
{
  return m->hooks ? m->hooks->release(m->hooks->ud, unit, grads) : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Local widths under tensor parallelism (all equal to the model's when tp = 1). */
typedef struct {
  int C, NH, Cl, NHl, Vl, vlo, Vreal; /* Vreal: real (< V) vocabulary columns of this rank */
} dims_t;

static dims_t dims(const dt_gpt2_t *m)
{
  const dt_gpt2_config_t *c = &m->cfg;
  const int tp = m->tp.tp, Vl = c->padded_vocab / tp, vlo = m->tp.rank * Vl;
  return (dims_t){.C = c->channels,
                  .NH = c->heads,
                  .Cl = c->channels / tp,
                  .NHl = c->heads / tp,
                  .Vl = Vl,
                  .vlo = vlo,
                  .Vreal = DT_MAX(0, DT_MIN(c->vocab - vlo, Vl))};
}

/* The vocabulary columns the LM head's products run over (ops.h's padded_head). */
static int head_cols(const dt_gpt2_t *m, dims_t d)
{
  return m->ops->padded_head ? d.Vl : d.Vreal;
}

/* Sums a full-width partial result over the tensor-parallel group (row-parallel forward,
 * column-parallel backward). */
static int tp_sum(dt_gpt2_t *m, float *buf, size_t n)
{
  if (m->tp.tp == 1)
    return 0;
  if (!m->tp.comm) {
    DT_ERROR(TRAIN, "a tensor-parallel model (tp %d) needs its communicator to run", m->tp.tp);
    return DT_EINVAL;
  }
  return dt_comm_all_reduce(m->tp.comm, buf, n, DT_COMM_SUM);
}

/* Sequence parallelism moves between the two layouts of the residual stream around the
 * tensor-parallel layers. gather_rows: this rank's rows (N/tp) -> every row (N) in a->gath, the
 * input of a column-parallel layer; without SP the rows are all here already. */
static int gather_rows(dt_gpt2_t *m, dt_gpt2_acts_t *a, const float *mine, size_t N,
                       const float **all)
{
  if (!m->sp) {
    *all = mine;
    return 0;
  }
  *all = a->gath;
  return dt_comm_all_gather(m->tp.comm, mine, a->gath, N / (size_t)m->tp.tp * m->cfg.channels);
}

/* The sum over the tp group of a partial (N, C) result (a row-parallel layer's output, a
 * column-parallel layer's input gradient), in the residual stream's layout: all rows in place
 * (all-reduce), or with SP this rank's rows in a->tmps (reduce-scatter). */
static int reduce_rows(dt_gpt2_t *m, dt_gpt2_acts_t *a, float *partial, size_t N, const float **out)
{
  if (!m->sp) {
    *out = partial;
    return tp_sum(m, partial, N * m->cfg.channels);
  }
  *out = a->tmps;
  return dt_comm_reduce_scatter(m->tp.comm, partial, a->tmps,
                                N / (size_t)m->tp.tp * m->cfg.channels, DT_COMM_SUM);
}

/* Context parallelism moves q, k, v rows (or their gradients) of `bytes` a value between the
 * group's layout, rank by rank and each rank's rows half-major, (cp, 2, B, h, 3C/tp) in
 * a->cpbuf, and the sequence's, (B, 2cp*h, 3C/tp): rank r's half j of sequence b is chunk
 * c = (j ? 2cp-1-r : r) of it. to_seq 1: the group's layout into seq, 0: back. */
static int cp_permute(dt_gpt2_t *m, void *group, void *seq, size_t bytes, int B, int T, int to_seq)
{
  const int cp = m->cp.cp, h = T / 2;
  const size_t row = 3 * (size_t)dims(m).Cl, piece = (size_t)h * row * bytes;
  /* One strided copy per (r, j): its B pieces lie piece apart in the group's layout and
   * 2cp pieces apart in the sequence's. */
  for (int r = 0; r < cp; r++)
    for (int j = 0; j < 2; j++) {
      const int c = j ? 2 * cp - 1 - r : r;
      char *g = (char *)group + ((size_t)r * 2 + j) * B * piece;
      char *q = (char *)seq + (size_t)c * piece;
      const size_t gp = piece, qp = 2 * (size_t)cp * piece;
      DT_CHECK(m->dev->copy_2d(m->dev, to_seq ? q : g, to_seq ? qp : gp, to_seq ? g : q,
                               to_seq ? gp : qp, piece, (size_t)B, DT_COPY_D2D));
    }
  return 0;
}

/* cp_gather_qkv: every rank's q, k, v rows (this rank's are in a->cpbuf already, at mine) into
 * qkv, the whole sequence. */
static int cp_gather_qkv(dt_gpt2_t *m, dt_gpt2_acts_t *a, void *qkv, const void *mine, int B, int T)
{
  /* counted in floats: a rank's (B, T, 3C/tp) values, whose count is even (T is) */
  const size_t values = (size_t)B * T * 3 * dims(m).Cl;
  DT_CHECK(dt_comm_all_gather(m->cp.comm, mine, a->cpbuf, values * qkv_bytes(m) / sizeof(float)));
  return cp_permute(m, a->cpbuf, qkv, qkv_bytes(m), B, T, 1);
}

/* The attention backward's dqkv over the whole sequence (a->dqkv_full, added to by this rank's
 * queries) summed over the group: each rank receives its own rows, in a->dqkv. */
static int cp_reduce_dqkv(dt_gpt2_t *m, dt_gpt2_acts_t *a, int B, int T)
{
  DT_CHECK(cp_permute(m, a->cpbuf, a->dqkv_full, sizeof(float), B, T, 0));
  return dt_comm_reduce_scatter(m->cp.comm, a->cpbuf, a->dqkv, (size_t)B * T * 3 * dims(m).Cl,
                                DT_COMM_SUM);
}

/* Attention of the Tq queries at [q0, q0 + Tq) of the Tall positions in qkv: forward (dout
 * NULL) into out and att, or backward with out the forward's into dqkv (Tall rows), adding
 * under context parallelism (a chunk of the queries), else writing it (flash, every query). */
static int attention(dt_gpt2_t *m, dt_gpt2_acts_t *a, void *out, float *att, const void *qkv,
                     const float *dout, void *dqkv, int B, int Tq, int q0, int Tall)
{
  const dims_t d = dims(m);
  const dt_ops_t *k = m->ops;
  const int add = m->cp.cp > 1;
  if (qkv16(m))
    return dout ? k->attention_backward_flash_bf16(m->dev, dqkv, dqkv16(m), dout, datty16(m), qkv,
                                                   out, att, B, Tq, q0, Tall, d.Cl, d.NHl, add)
                : k->attention_forward_flash_bf16(m->dev, out, att, qkv, B, Tq, q0, Tall, d.Cl,
                                                  d.NHl);
  if (m->flash)
    return dout ? k->attention_backward_flash(m->dev, dqkv, dout, qkv, out, att, B, Tq, q0, Tall,
                                              d.Cl, d.NHl, add)
                : k->attention_forward_flash(m->dev, out, att, qkv, B, Tq, q0, Tall, d.Cl, d.NHl);
  return dout ? k->attention_backward_cp(m->dev, dqkv, a->datt, dout, qkv, att, B, Tq, q0, Tall,
                                         d.Cl, d.NHl)
              : k->attention_forward_cp(m->dev, out, att, qkv, B, Tq, q0, Tall, d.Cl, d.NHl);
}

/* This rank's two query chunks against the keys up to each one's end (forward: out, att; or,
 * with dout, backward: added into dqkv_full, out the forward's, datt the scratch). */
static int cp_attention(dt_gpt2_t *m, dt_gpt2_acts_t *a, void *out, float *att, const void *qkv,
                        const float *dout, int B, int T)
{
  const dims_t d = dims(m);
  const int h = T / 2, Tall = 2 * m->cp.cp * h;
  size_t att_off = 0;
  for (int j = 0; j < 2; j++) {
    const int q0 = cp_chunk(m, j) * h;
    const size_t rows = (size_t)j * B * h;
    DT_CHECK(attention(m, a, (char *)out + rows * d.Cl * qkv_bytes(m), att + att_off, qkv,
                       dout ? dout + rows * d.Cl : NULL, a->dqkv_full, B, h, q0, Tall));
    att_off += (size_t)B * d.NHl * h * (size_t)(m->flash ? 1 : q0 + h);
  }
  return 0;
}

/* LayerNorm backward over the rows this rank holds, from dout's bf16 values where dout16
 * (whole_bf16). With SP each rank sees N/tp rows, so the weight and bias gradients are partial
 * sums: computed apart, summed over the tp group, then accumulated (the all-reduce must not see
 * the accumulator of earlier micro-batches). */
static int layernorm_backward(dt_gpt2_t *m, dt_gpt2_acts_t *a, float *dinp, float *dweight,
                              float *dbias, const float *dout, int dout16, const float *inp,
                              const float *weight, const float *mean, const float *rstd,
                              size_t rows)
{
  const int C = m->cfg.channels;
  if (dout16)
    return m->ops->layernorm_backward_bf16(m->dev, dinp, dweight, dbias, dout, inp, weight, mean,
                                           rstd, (int)rows, C);
  if (!m->sp) {
    DT_CHECK(m->ops->layernorm_backward(m->dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                        (int)rows, C));
    return 0;
  }
  DT_CHECK(m->dev->zero(m->dev, a->lngrad, 2 * (size_t)C * sizeof(float)));
  DT_CHECK(m->ops->layernorm_backward(m->dev, dinp, a->lngrad, a->lngrad + C, dout, inp, weight,
                                      mean, rstd, (int)rows, C));
  DT_CHECK(dt_comm_all_reduce(m->tp.comm, a->lngrad, 2 * (size_t)C, DT_COMM_SUM));
  DT_CHECK(m->dev->accumulate(m->dev, dweight, a->lngrad, (size_t)C));
  return m->dev->accumulate(m->dev, dbias, a->lngrad + C, (size_t)C);
}

/* Runs one micro-batch through this stage's layers in activation slot a, from the embeddings
 * (first stage) or the slot's input, to the final LayerNorm and the logits (last stage).
 * A batch (B, T) smaller than the allocated one uses the buffers with the per-layer strides of
 * the allocated size. Row-parallel biases are added on tp rank 0 only, so that the all-reduce
 * adds them once. Every unit acquired is released. */
/* The activations of layer l inside slot a: the layer's own buffers, or with activation
 * checkpointing the one layer's worth that every layer reuses. */
typedef struct {
  float *ln1, *ln1_mean, *ln1_rstd, *att, *res2, *ln2, *ln2_mean, *ln2_rstd, *fch, *fchg, *res3;
  void *qkv, *atty;                       /* qkv_bytes a value */
  void *ln1_16, *ln2_16, *fch16, *fchg16; /* bf16 compute: kept in bf16 (fp32's NULL then) */
} layer_acts_t;

/* Element off of an fp32 or a bf16 activation buffer that may be absent (NULL stays NULL). */
static float *f32_at(float *p, size_t off)
{
  return p ? p + off : NULL;
}

static void *bf16_at(const dt_gpt2_t *m, void *p, size_t off)
{
  return p ? (char *)p + off * m->ops->bf16_bytes : NULL;
}

static layer_acts_t layer_acts(const dt_gpt2_t *m, const dt_gpt2_acts_t *a, int l)
{
  const dims_t d = dims(m);
  const size_t C = (size_t)d.C, Cl = (size_t)d.Cl, An = (size_t)a->B * a->T;
  const size_t Rn = stream_rows(m, An); /* rows of the sequence-parallel buffers */
  const size_t h = m->recompute ? 0 : (size_t)l;
  const size_t att_stride = att_elems(m, a->B, d.NHl, a->T);
  return (layer_acts_t){.ln1 = f32_at(a->ln1, h * Rn * C),
                        .ln1_16 = bf16_at(m, a->ln1_16, h * Rn * C),
                        .ln1_mean = a->ln1_mean + h * Rn,
                        .ln1_rstd = a->ln1_rstd + h * Rn,
                        .qkv = (char *)a->qkv + h * An * (size_t)m->cp.cp * 3 * Cl * qkv_bytes(m),
                        .atty = (char *)a->atty + h * An * Cl * qkv_bytes(m),
                        .att = a->att + h * att_stride,
                        .res2 = a->residual2 + h * Rn * C,
                        .ln2 = f32_at(a->ln2, h * Rn * C),
                        .ln2_16 = bf16_at(m, a->ln2_16, h * Rn * C),
                        .ln2_mean = a->ln2_mean + h * Rn,
                        .ln2_rstd = a->ln2_rstd + h * Rn,
                        .fch = f32_at(a->fch, h * An * 4 * Cl),
                        .fch16 = bf16_at(m, a->fch16, h * An * 4 * Cl),
                        .fchg = f32_at(a->fch_gelu, h * An * 4 * Cl),
                        .fchg16 = bf16_at(m, a->fch_gelu16, h * An * 4 * Cl),
                        .res3 = a->residual3 + (size_t)l * Rn * C};
}

/* A linear layer's input under bf16 compute: in16 where the producer stored the bf16 values,
 * else in (n values) rounded into the scratch's x16. */
static int bf16_input(dt_gpt2_t *m, dt_gpt2_acts_t *a, const float *in, const void **in16, size_t n)
{
  if (*in16)
    return 0;
  DT_CHECK(m->ops->to_bf16(m->dev, a->x16, in, n));
  *in16 = a->x16;
  return 0;
}

/* The linear layer out = in @ w^T + b (ops.h) with weight tensor w of view p: in fp32, or under
 * bf16 compute on in's bf16 values (bf16_input) and w's (the view's bf16 copy where it has one,
 * else rounded by the kernel), into a bf16 out where out16, plus res where not NULL (bf16
 * compute only: whole_bf16), and where gelu16 is not NULL (bf16 compute, out16) the GELU of each
 * output into it, from its fp32 value (ops.h). */
static int linear_forward(dt_gpt2_t *m, dt_gpt2_acts_t *a, void *out, int out16, const float *res,
                          const float *in, const void *in16, const dt_gpt2_view_t *p, int w,
                          const float *b, int N, int C, int OC, int ldo, void *gelu16)
{
  const dt_ops_t *k = m->ops;
  if (!m->bf16)
    return k->matmul_forward(m->dev, out, in, p->t[w], b, N, C, OC, ldo);
  DT_CHECK(bf16_input(m, a, in, &in16, (size_t)N * C));
  return k->matmul_forward_bf16(m->dev, out, out16, in16, p->t[w], p->t16[w], b, res, gelu16, N, C,
                                OC, ldo);
}

/* The ldd of an output gradient of cols values a row: cols for an fp32 one, or where g16 holds
 * it in bf16 (the dlogits, the MLP pre-activation's, the attention's q, k, v) the row's bytes in
 * floats, as ops.h's dout16 takes it. */
static int grad_ld(const dt_gpt2_t *m, const void *g16, int cols)
{
  return g16 ? (int)((size_t)cols * m->ops->bf16_bytes / sizeof(float)) : cols;
}

/* Its backward, with the same choice of inputs (ops.h: dinp =, dweight and dbias +=); under
 * bf16 compute dout16, where not NULL, is the gradient, held in bf16 only (the dlogits, the MLP
 * pre-activation's, q, k, v's), and dout NULL; dinp is bf16 where dinp16 (bf16 compute only).
 * gelu_in, where not NULL: in was GELU(gelu_in), and dinp becomes gelu_in's gradient (under
 * bf16 compute both are bf16 buffers, and on a GPU the GELU's derivative is the GEMM's
 * epilogue). */
static int linear_backward(dt_gpt2_t *m, dt_gpt2_acts_t *a, void *dinp, int dinp16, float *dw,
                           float *db, const float *dout, const void *dout16, const float *in,
                           const void *in16, const dt_gpt2_view_t *p, int w, const void *gelu_in,
                           int N, int C, int OC, int ldd)
{
  const dt_ops_t *k = m->ops;
  if (m->bf16) {
    DT_CHECK(bf16_input(m, a, in, &in16, (size_t)N * C));
    return k->matmul_backward_bf16(m->dev, dinp, dinp16 || gelu_in, dw, db, dout, dout16, in16,
                                   p->t[w], p->t16[w], gelu_in, N, C, OC, ldd);
  }
  DT_CHECK(k->matmul_backward(m->dev, dinp, dw, db, dout, in, p->t[w], N, C, OC, ldd));
  return gelu_in ? k->gelu_backward(m->dev, dinp, gelu_in, dinp, (size_t)N * C) : 0;
}

/* Layer l of slot a (the stage's layer u) forward from its input x with parameters p (acquired
 * by the caller); also what activation checkpointing reruns before the layer's backward
 * (deterministic kernels and collectives: the same bits as the first time). */
static int layer_forward(dt_gpt2_t *m, dt_gpt2_acts_t *a, int l, int u, const float *x, int B,
                         int T, const dt_gpt2_view_t *p)
{
  const dt_ops_t *k = m->ops;
  const dims_t d = dims(m);
  const int C = d.C, Cl = d.Cl, lead = m->tp.rank == 0;
  const size_t N = (size_t)B * T, R = stream_rows(m, N);
  const layer_acts_t y = layer_acts(m, a, l);
  const float *in, *branch;
  if (y.ln1_16)
    DT_CHECK(k->layernorm_forward_bf16(m->dev, y.ln1_16, y.ln1_mean, y.ln1_rstd, x, p->t[DT_T_LN1W],
                                       p->t[DT_T_LN1B], (int)R, C));
  else
    DT_CHECK(k->layernorm_forward(m->dev, y.ln1, y.ln1_mean, y.ln1_rstd, x, p->t[DT_T_LN1W],
                                  p->t[DT_T_LN1B], (int)R, C));
  DT_CHECK(gather_rows(m, a, y.ln1, N, &in)); /* NULL with ln1_16 (no SP then) */
  if (m->kv) { /* the T new positions' q, k, v into the cache, their queries against it */
    const int pos = m->kv_pos;
    void *cache = (char *)m->kv + (size_t)u * m->kv_cap * 3 * Cl * qkv_bytes(m);
    DT_CHECK(linear_forward(m, a, (char *)cache + (size_t)pos * 3 * Cl * qkv_bytes(m), qkv16(m),
                            NULL, in, y.ln1_16, p, DT_T_QKVW, p->t[DT_T_QKVB], T, C, 3 * Cl, 3 * Cl,
                            NULL));
    if (m->flash)
      DT_CHECK(attention(m, a, y.atty, y.att, cache, NULL, NULL, 1, T, pos, pos + T));
    else
      DT_CHECK(
          k->attention_forward_cp(m->dev, y.atty, y.att, cache, 1, T, pos, pos + T, Cl, d.NHl));
  } else if (m->cp.cp == 1) {
    DT_CHECK(linear_forward(m, a, y.qkv, qkv16(m), NULL, in, y.ln1_16, p, DT_T_QKVW,
                            p->t[DT_T_QKVB], (int)N, C, 3 * Cl, 3 * Cl, NULL));
    if (m->flash)
      DT_CHECK(attention(m, a, y.atty, y.att, y.qkv, NULL, NULL, B, T, 0, T));
    else
      DT_CHECK(k->attention_forward(m->dev, y.atty, y.att, y.qkv, B, T, Cl, d.NHl));
  } else {
    void *mine = (char *)a->cpbuf + (size_t)m->cp.rank * N * 3 * Cl * qkv_bytes(m);
    DT_CHECK(linear_forward(m, a, mine, qkv16(m), NULL, in, y.ln1_16, p, DT_T_QKVW, p->t[DT_T_QKVB],
                            (int)N, C, 3 * Cl, 3 * Cl, NULL));
    DT_CHECK(cp_gather_qkv(m, a, y.qkv, mine, B, T));
    DT_CHECK(cp_attention(m, a, y.atty, y.att, y.qkv, NULL, B, T));
  }
  /* Each branch's projection: added to the residual stream by its GEMM where the branch is whole
   * here (whole_bf16), else after the tensor-parallel sum (the first fused with LN2). */
  const int fuse = whole_bf16(m);
  DT_CHECK(linear_forward(m, a, fuse ? y.res2 : a->tmp, 0, fuse ? x : NULL,
                          qkv16(m) ? NULL : y.atty, qkv16(m) ? y.atty : NULL, p, DT_T_ATTPROJW,
                          lead ? p->t[DT_T_ATTPROJB] : NULL, (int)N, Cl, C, C, NULL));
  if (fuse) {
    DT_CHECK(k->layernorm_forward_bf16(m->dev, y.ln2_16, y.ln2_mean, y.ln2_rstd, y.res2,
                                       p->t[DT_T_LN2W], p->t[DT_T_LN2B], (int)R, C));
  } else {
    DT_CHECK(reduce_rows(m, a, a->tmp, N, &branch));
    if (y.ln2_16)
      DT_CHECK(k->residual_layernorm_forward_bf16(m->dev, y.res2, y.ln2_16, y.ln2_mean, y.ln2_rstd,
                                                  x, branch, p->t[DT_T_LN2W], p->t[DT_T_LN2B],
                                                  (int)R, C));
    else
      DT_CHECK(k->residual_layernorm_forward(m->dev, y.res2, y.ln2, y.ln2_mean, y.ln2_rstd, x,
                                             branch, p->t[DT_T_LN2W], p->t[DT_T_LN2B], (int)R, C));
  }
  DT_CHECK(gather_rows(m, a, y.ln2, N, &in));
  DT_CHECK(linear_forward(m, a, m->bf16 ? y.fch16 : y.fch, m->bf16, NULL, in, y.ln2_16, p, DT_T_FCW,
                          p->t[DT_T_FCB], (int)N, C, 4 * Cl, 4 * Cl, m->bf16 ? y.fchg16 : NULL));
  if (!m->bf16)
    DT_CHECK(k->gelu_forward(m->dev, y.fchg, y.fch, N * 4 * Cl));
  DT_CHECK(linear_forward(m, a, fuse ? y.res3 : a->tmp, 0, fuse ? y.res2 : NULL, y.fchg, y.fchg16,
                          p, DT_T_FCPROJW, lead ? p->t[DT_T_FCPROJB] : NULL, (int)N, 4 * Cl, C, C,
                          NULL));
  if (fuse)
    return 0;
  DT_CHECK(reduce_rows(m, a, a->tmp, N, &branch));
  return k->residual_forward(m->dev, y.res3, y.res2, branch, R * C);
}

/* The input of layer l in slot a: the stage's input or the previous layer's output. */
static const float *layer_input(const dt_gpt2_t *m, const dt_gpt2_acts_t *a, int l)
{
  return l == 0 ? a->encoded
                : a->residual3 +
                      (size_t)(l - 1) * stream_rows(m, (size_t)a->B * a->T) * m->cfg.channels;
}

/* Whether chunk is the model's first (after the embeddings) or its last (before the head). */
static int embeds(const dt_gpt2_t *m, int chunk)
{
  return m->stage.first && chunk == 0;
}

static int heads(const dt_gpt2_t *m, int chunk)
{
  return m->stage.last && chunk == m->stage.chunks - 1;
}

static dt_gpt2_acts_t *slot_acts(dt_gpt2_t *m, int chunk, int slot)
{
  return &m->acts[m->slot_base[chunk] + slot];
}

/* The kernels' view of a micro-batch's host tokens: the host array itself, or on a device that
 * is not host memory, its copy in the slot (which = 0: inputs, 1: targets). */
static int device_tokens(dt_gpt2_t *m, dt_gpt2_acts_t *a, int which, const int *host, size_t N,
                         const int **out)
{
  if (m->dev->host) {
    *out = host;
    return 0;
  }
  int *dst = a->tokens + (size_t)which * N;
  DT_CHECK(m->dev->copy(m->dev, dst, host, N * sizeof(int), DT_COPY_H2D));
  *out = dst;
  return 0;
}

static int forward_stage(dt_gpt2_t *m, dt_gpt2_acts_t *a, int chunk, const int *inputs, int B,
                         int T)
{
  const dt_ops_t *k = m->ops;
  const dims_t d = dims(m);
  const int C = d.C, u0 = m->chunk_off[chunk], L = m->chunk_off[chunk + 1] - u0;
  const int lead = m->tp.rank == 0;
  const size_t N = (size_t)B * T;
  dt_gpt2_view_t p, unused;

  if (m->params16 && m->params16_stale) { /* the parameters were written: one rounding pass */
    DT_CHECK(k->to_bf16(m->dev, m->params16, m->params_flat, m->num_params));
    m->params16_stale = 0;
  }
  if (embeds(m, chunk)) {
    DT_CHECK(device_tokens(m, a, 0, inputs, N, &inputs));
    DT_CHECK(acquire(m, DT_UNIT_EMBED, 0, &p, &unused));
    float *e = m->sp ? a->tmp : a->encoded; /* SP: all rows, then this rank's sum */
    const float *sum;
    /* context parallel: each half of the rows is one chunk, at its own positions (but through
     * the key/value cache, which runs the whole sequence on every rank) */
    const int halves = m->cp.cp > 1 && !m->kv ? 2 : 1, Th = T / halves;
    for (int j = 0; j < halves; j++) {
      const size_t rows = (size_t)j * B * Th,
                   pos = halves > 1 ? (size_t)cp_chunk(m, j) * Th : (size_t)m->kv_pos;
      DT_CHECK(k->encoder_forward(m->dev, e + rows * C, inputs + rows, p.t[DT_T_WTE], d.vlo, d.Vl,
                                  lead ? p.t[DT_T_WPE] + pos * C : NULL, B, Th, C));
    }
    DT_CHECK(release(m, DT_UNIT_EMBED, 0));
    DT_CHECK(reduce_rows(m, a, e, N, &sum));
    if (m->sp)
      DT_CHECK(m->dev->copy(m->dev, a->encoded, sum, stream_rows(m, N) * C * sizeof(float),
                            DT_COPY_D2D));
  }
  for (int l = 0; l < L; l++) {
    DT_CHECK(acquire(m, u0 + l, 0, &p, &unused));
    DT_CHECK(layer_forward(m, a, l, u0 + l, layer_input(m, a, l), B, T, &p));
    DT_CHECK(release(m, u0 + l, 0));
  }
  const float *x = layer_input(m, a, L);
  if (!heads(m, chunk))
    return 0;
  DT_CHECK(acquire(m, DT_UNIT_FINAL, 0, &p, &unused));
  const size_t R = stream_rows(m, N);
  float *mine = f32_at(a->lnf, m->sp ? (size_t)m->tp.rank * R * C : 0); /* gathered in place */
  if (a->lnf16)
    DT_CHECK(k->layernorm_forward_bf16(m->dev, a->lnf16, a->lnf_mean, a->lnf_rstd, x,
                                       p.t[DT_T_LNFW], p.t[DT_T_LNFB], (int)R, C));
  else
    DT_CHECK(k->layernorm_forward(m->dev, mine, a->lnf_mean, a->lnf_rstd, x, p.t[DT_T_LNFW],
                                  p.t[DT_T_LNFB], (int)R, C));
  DT_CHECK(release(m, DT_UNIT_FINAL, 0));
  if (m->sp)
    DT_CHECK(dt_comm_all_gather(m->tp.comm, mine, a->lnf, R * C));
  /* The real vocabulary columns, or on a GPU the whole padded slice (ops.h's padded_head); the
   * rest are never read. */
  DT_CHECK(acquire(m, DT_UNIT_EMBED, 0, &p, &unused));
  if (d.Vreal > 0)
    DT_CHECK(linear_forward(m, a, m->bf16 ? a->logits16 : a->logits, m->bf16, NULL, a->lnf,
                            a->lnf16, &p, DT_T_WTE, NULL, (int)N, C, head_cols(m, d), d.Vl, NULL));
  return release(m, DT_UNIT_EMBED, 0);
}

/* The mean of slot a's n per-token losses, read back from the device when it is not the host. */
static int mean_loss(dt_gpt2_t *m, const dt_gpt2_acts_t *a, size_t n, float *out)
{
  const float *losses = a->losses;
  if (!m->dev->host) {
    DT_CHECK(m->dev->copy(m->dev, m->host_losses, a->losses, n * sizeof(float), DT_COPY_D2H));
    losses = m->host_losses;
  }
  double acc = 0.0;
  for (size_t i = 0; i < n; i++)
    acc += losses[i];
  *out = (float)(acc / (double)n);
  m->last_losses = losses;
  return 0;
}

const float *dt_gpt2_last_losses(const dt_gpt2_t *m)
{
  return m->last_losses;
}

int dt_gpt2_token_losses(dt_gpt2_t *m, size_t n, float *out)
{
  const dt_gpt2_acts_t *a = &m->acts[m->slot_base[m->stage.chunks - 1]];
  return m->dev->copy(m->dev, out, a->losses, n * sizeof(float), DT_COPY_D2H);
}

/* Per-token losses of slot a's logits into a->losses and, when dloss != 0, dlogits in place of
 * the logits (in bf16 under bf16 compute). One process: the fused kernel. Tensor parallel: the
 * vocabulary-parallel pair around one all-gather of 3N floats per rank. */
static int cross_entropy(dt_gpt2_t *m, dt_gpt2_acts_t *a, const int *targets, float dloss, int N)
{
  const dt_ops_t *k = m->ops;
  const dims_t d = dims(m);
  const int V = m->cfg.vocab, Vp = m->cfg.padded_vocab;
  if (m->tp.tp == 1)
    return a->logits16 ? k->crossentropy_forward_backward_bf16(m->dev, a->losses, a->logits16,
                                                               targets, dloss, N, V, Vp)
                       : k->crossentropy_forward_backward(m->dev, a->losses, a->logits, targets,
                                                          dloss, N, V, Vp);
  float *mine = a->ce_stats + (size_t)m->tp.tp * 3 * N;
  if (a->logits16)
    DT_CHECK(
        k->crossentropy_vp_stats_bf16(m->dev, mine, a->logits16, targets, d.vlo, N, d.Vreal, d.Vl));
  else
    DT_CHECK(k->crossentropy_vp_stats(m->dev, mine, a->logits, targets, d.vlo, N, d.Vreal, d.Vl));
  DT_CHECK(dt_comm_all_gather(m->tp.comm, mine, a->ce_stats, 3 * (size_t)N));
  if (a->logits16)
    return k->crossentropy_vp_finish_bf16(m->dev, a->losses, a->logits16, a->ce_stats, m->tp.tp,
                                          targets, d.vlo, dloss, N, d.Vreal, d.Vl);
  return k->crossentropy_vp_finish(m->dev, a->losses, a->logits, a->ce_stats, m->tp.tp, targets,
                                   d.vlo, dloss, N, d.Vreal, d.Vl);
}

int dt_gpt2_stage_forward(dt_gpt2_t *m, int chunk, int slot, const int *inputs, const int *targets,
                          int B, int T, float grad_scale, float *loss)
{
  dt_gpt2_acts_t *a = slot_acts(m, chunk, slot);
  if (m->kv &&
      (B != 1 || targets || T > m->kv_feed || T % m->kv_unit != 0 || T > m->kv_cap - m->kv_pos))
    return DT_EINVAL; /* the cache takes one sequence, rows it can split, up to its capacity */
  DT_CHECK(forward_stage(m, a, chunk, inputs, B, T));
  m->kv_pos += m->kv && chunk == m->stage.chunks - 1 ? T : 0;
  if (!heads(m, chunk) || !targets)
    return 0;
  /* d(mean loss)/d(loss_i) = 1/N, times the caller's scale (1/K for K micro-batches). */
  const size_t N = (size_t)B * T;
  DT_CHECK(device_tokens(m, a, 1, targets, N, &targets));
  DT_CHECK(cross_entropy(m, a, targets, grad_scale / (float)N, (int)N));
  return mean_loss(m, a, N, loss);
}

int dt_gpt2_kv_begin(dt_gpt2_t *m, int cap, char *why, size_t whylen)
{
  if (!m->flash && !m->ops->attention_forward_cp) {
    snprintf(why, whylen,
             "no key/value cache with materialized attention on this device (no "
             "attention_forward_cp)");
    return DT_ENOTSUP;
  }
  /* A forward's rows: at most the positions the activations hold for one sequence (the local
   * ones under context parallelism), whose stream rows SP splits among the tp ranks; with
   * materialized attention also the (rows, cap) probabilities of each head in its buffer. */
  const dt_gpt2_acts_t *a = m->acts;
  const int unit = m->sp ? m->tp.tp : 1, NH = dims(m).NHl;
  const int room = DT_MIN(cap + unit - 1, m->cfg.max_seq); /* a padded feed at the end too */
  size_t feed = a ? (size_t)a->T : 0;
  if (a && !m->flash && room > 0)
    feed = DT_MIN(feed, att_elems(m, a->B, NH, a->T) / ((size_t)NH * (size_t)room));
  feed -= feed % (size_t)unit;
  if (cap < 1 || cap > m->cfg.max_seq || feed < 1) {
    snprintf(why, whylen,
             "a key/value cache of %d positions (max_seq %d, activations for %d positions%s)", cap,
             m->cfg.max_seq, a ? a->T : 0, a && cap >= 1 && feed < 1 ? ": no row fits them" : "");
    return DT_EINVAL;
  }
  dt_gpt2_kv_end(m);
  const size_t bytes = (size_t)m->L * (size_t)room * 3 * (size_t)dims(m).Cl * qkv_bytes(m);
  const int rc = m->dev->alloc(m->dev, bytes, "the key/value cache of text generation", &m->kv);
  if (rc != 0) {
    snprintf(why, whylen,
             "no room for a key/value cache of %.1f MiB (--sample-no-cache runs "
             "without one)",
             (double)bytes / 1048576.0);
    return rc;
  }
  m->kv_bytes = bytes;
  m->kv_cap = room;
  m->kv_pos = 0;
  m->kv_feed = (int)feed;
  m->kv_unit = unit;
  return 0;
}

int dt_gpt2_kv_seek(dt_gpt2_t *m, int pos)
{
  if (!m->kv || pos < 0 || pos > m->kv_pos)
    return DT_EINVAL;
  m->kv_pos = pos;
  return 0;
}

void dt_gpt2_kv_end(dt_gpt2_t *m)
{
  m->dev->free(m->dev, m->kv);
  m->kv = NULL;
  m->kv_bytes = 0;
  m->kv_cap = m->kv_pos = m->kv_feed = m->kv_unit = 0;
}

float *dt_gpt2_stage_input(dt_gpt2_t *m, int chunk, int slot)
{
  return slot_acts(m, chunk, slot)->encoded;
}

const float *dt_gpt2_stage_output(dt_gpt2_t *m, int chunk, int slot)
{
  return layer_input(m, slot_acts(m, chunk, slot), m->chunk_off[chunk + 1] - m->chunk_off[chunk]);
}

float *dt_gpt2_stage_grad(dt_gpt2_t *m, int chunk, int slot)
{
  return slot_acts(m, chunk, slot)->dresidual;
}

/* ------------------------------------------------------------------------------------------ */
/* Backward                                                                                    */
/* ------------------------------------------------------------------------------------------ */

int dt_gpt2_stage_backward(dt_gpt2_t *m, int chunk, int slot, const int *inputs, int B, int T)
{
  const dt_ops_t *k = m->ops;
  const dims_t d = dims(m);
  const int C = d.C, Cl = d.Cl, u0 = m->chunk_off[chunk], L = m->chunk_off[chunk + 1] - u0;
  const int first = embeds(m, chunk), last = heads(m, chunk);
  dt_gpt2_acts_t *a = slot_acts(m, chunk, slot);
  const size_t N = (size_t)B * T, R = stream_rows(m, N);
  dt_gpt2_view_t p, g, ep, eg;
  const float *din, *dout, *in;
  const int din16 = whole_bf16(m); /* the LayerNorms' output gradients in dbuf as bf16 values */

  if (last) {
    /* The embeddings' gradients accumulate from the LM head now (and, on one stage, from the
     * encoder at the end: the unit stays acquired until then). */
    DT_CHECK(acquire(m, DT_UNIT_EMBED, 1, &ep, &eg));
    /* LM head (tied): dlnf = dlogits @ wte[:V]; dwte[:V] += dlogits^T @ lnf, over the forward's
     * columns (a GPU's padded ones have zero dlogits) */
    if (d.Vreal > 0)
      DT_CHECK(linear_backward(m, a, a->dbuf, din16, eg.t[DT_T_WTE], NULL, a->logits, a->logits16,
                               a->lnf, a->lnf16, &ep, DT_T_WTE, NULL, (int)N, C, head_cols(m, d),
                               grad_ld(m, a->logits16, d.Vl)));
    else
      DT_CHECK(m->dev->zero(m->dev, a->dbuf, N * C * sizeof(float)));
    if (!first)
      DT_CHECK(release(m, DT_UNIT_EMBED, 1));
    DT_CHECK(reduce_rows(m, a, a->dbuf, N, &din));
    DT_CHECK(m->dev->zero(m->dev, a->dresidual, R * C * sizeof(float)));
    DT_CHECK(acquire(m, DT_UNIT_FINAL, 1, &p, &g));
    DT_CHECK(layernorm_backward(m, a, a->dresidual, g.t[DT_T_LNFW], g.t[DT_T_LNFB], din, din16,
                                layer_input(m, a, L), p.t[DT_T_LNFW], a->lnf_mean, a->lnf_rstd, R));
    DT_CHECK(release(m, DT_UNIT_FINAL, 1));
  } /* else: dresidual holds the next stage's input gradient */

  for (int l = L - 1; l >= 0; l--) {
    const float *x = layer_input(m, a, l);
    const layer_acts_t y = layer_acts(m, a, l);
    DT_CHECK(acquire(m, u0 + l, 1, &p, &g));
    if (m->recompute) /* activation checkpointing: this layer's activations again */
      DT_CHECK(layer_forward(m, a, l, u0 + l, x, B, T, &p));
    /* MLP branch: the residual gradient flows unchanged into the branch output (SP: all rows
     * of it). The row-parallel bias gradient is the same sum on every tp rank (replicated). */
    DT_CHECK(gather_rows(m, a, a->dresidual, N, &dout));
    DT_CHECK(linear_backward(m, a, m->bf16 ? a->dfch16 : (void *)a->dbuf4, 0, g.t[DT_T_FCPROJW],
                             g.t[DT_T_FCPROJB], dout, NULL, y.fchg, y.fchg16, &p, DT_T_FCPROJW,
                             m->bf16 ? y.fch16 : (const void *)y.fch, (int)N, 4 * Cl, C, C));
    DT_CHECK(gather_rows(m, a, y.ln2, N, &in));
    DT_CHECK(linear_backward(m, a, a->dbuf, din16, g.t[DT_T_FCW], g.t[DT_T_FCB], a->dbuf4,
                             a->dfch16, in, y.ln2_16, &p, DT_T_FCW, NULL, (int)N, C, 4 * Cl,
                             grad_ld(m, a->dfch16, 4 * Cl)));
    DT_CHECK(reduce_rows(m, a, a->dbuf, N, &din));
    DT_CHECK(layernorm_backward(m, a, a->dresidual, g.t[DT_T_LN2W], g.t[DT_T_LN2B], din, din16,
                                y.res2, p.t[DT_T_LN2W], y.ln2_mean, y.ln2_rstd, R));
    /* Attention branch. */
    DT_CHECK(gather_rows(m, a, a->dresidual, N, &dout));
    DT_CHECK(linear_backward(m, a, a->dbuf, datty16(m), g.t[DT_T_ATTPROJW], g.t[DT_T_ATTPROJB],
                             dout, NULL, qkv16(m) ? NULL : y.atty, qkv16(m) ? y.atty : NULL, &p,
                             DT_T_ATTPROJW, NULL, (int)N, Cl, C, C));
    if (m->cp.cp == 1 && m->flash) {
      DT_CHECK(attention(m, a, y.atty, y.att, y.qkv, a->dbuf,
                         dqkv16(m) ? a->dqkv16 : (void *)a->dqkv, B, T, 0, T));
    } else if (m->cp.cp == 1) {
      DT_CHECK(
          k->attention_backward(m->dev, a->dqkv, a->datt, a->dbuf, y.qkv, y.att, B, T, Cl, d.NHl));
    } else {
      DT_CHECK(m->dev->zero(m->dev, a->dqkv_full, (size_t)m->cp.cp * N * 3 * Cl * sizeof(float)));
      DT_CHECK(cp_attention(m, a, y.atty, y.att, y.qkv, a->dbuf, B, T));
      DT_CHECK(cp_reduce_dqkv(m, a, B, T));
    }
    DT_CHECK(gather_rows(m, a, y.ln1, N, &in));
    DT_CHECK(linear_backward(m, a, a->dbuf, din16, g.t[DT_T_QKVW], g.t[DT_T_QKVB], a->dqkv,
                             a->dqkv16, in, y.ln1_16, &p, DT_T_QKVW, NULL, (int)N, C, 3 * Cl,
                             grad_ld(m, a->dqkv16, 3 * Cl)));
    DT_CHECK(reduce_rows(m, a, a->dbuf, N, &din));
    DT_CHECK(layernorm_backward(m, a, a->dresidual, g.t[DT_T_LN1W], g.t[DT_T_LN1B], din, din16, x,
                                p.t[DT_T_LN1W], y.ln1_mean, y.ln1_rstd, R));
    DT_CHECK(release(m, u0 + l, 1));
  }
  if (!first)
    return 0; /* dresidual now holds this chunk's input gradient */
  if (!last)
    DT_CHECK(acquire(m, DT_UNIT_EMBED, 1, &ep, &eg));
  DT_CHECK(gather_rows(m, a, a->dresidual, N, &dout));
  /* the forward pass copied them to the device; the host's are the kernel's inp_host */
  const int *dev_inputs = m->dev->host ? inputs : a->tokens;
  const int halves = m->cp.cp > 1 ? 2 : 1, Th = T / halves;
  for (int j = 0; j < halves; j++) {
    const size_t rows = (size_t)j * B * Th, pos = m->cp.cp > 1 ? (size_t)cp_chunk(m, j) * Th : 0;
    DT_CHECK(k->encoder_backward(m->dev, eg.t[DT_T_WTE], d.vlo, d.Vl,
                                 eg.t[DT_T_WPE] ? eg.t[DT_T_WPE] + pos * C : NULL, dout + rows * C,
                                 dev_inputs + rows, inputs + rows, B, Th, C));
  }
  return release(m, DT_UNIT_EMBED, 1);
}

int dt_gpt2_forward_backward(dt_gpt2_t *m, const int *inputs, const int *targets, int B, int T,
                             float grad_scale, float *loss)
{
  DT_CHECK(dt_gpt2_stage_forward(m, 0, 0, inputs, targets, B, T, grad_scale, loss));
  return dt_gpt2_stage_backward(m, 0, 0, inputs, B, T);
}

int dt_gpt2_zero_grad(dt_gpt2_t *m)
{
  return m->dev->zero(m->dev, m->grads_flat, m->bytes_grads);
}

int dt_gpt2_sumsq(dt_gpt2_t *m, const float *buf, int64_t lo, int64_t hi, double *out)
{
  if (m->owned == m->num_params)
    return m->ops->sum_squares(m->dev, buf, (size_t)(hi - lo), out);
  double ss = 0.0, part;
  for (int i = 0; i < DT_GPT2_NUM_TENSORS; i++) {
    int64_t a = DT_MAX(lo, (int64_t)m->tensor_offsets[i]);
    int64_t b = DT_MIN(hi, (int64_t)(m->tensor_offsets[i] + m->tensor_sizes[i]));
    if (a < b && owns(m, m->tp.rank, i)) {
      DT_CHECK(m->ops->sum_squares(m->dev, buf + (a - lo), (size_t)(b - a), &part));
      ss += part;
    }
  }
  *out = ss;
  return 0;
}

int dt_gpt2_tensor_decays(int tensor)
{
  static const int decays[DT_GPT2_NUM_TENSORS] = {
#define DT__WD(name, n, wd) wd,
      DT_GPT2_TENSORS(DT__WD, (dt_gpt2_config_t){0})
#undef DT__WD
  };
  return tensor >= 0 && tensor < DT_GPT2_NUM_TENSORS && decays[tensor];
}

int dt_gpt2_adamw_step(dt_gpt2_t *m, const dt_adamw_t *h, float grad_scale, int t)
{
  DT_CHECK(dt_gpt2_alloc_optimizer(m));
  /* The bf16 weight copy is written in the same pass, whole (the tensors tile the buffer). */
  for (int i = 0; i < DT_GPT2_NUM_TENSORS; i++) {
    const size_t off = m->tensor_offsets[i];
    void *p16 = m->params16 ? (char *)m->params16 + off * m->ops->bf16_bytes : NULL;
    DT_CHECK(m->ops->adamw_update(
        m->dev, m->params_flat + off, p16, m->grads_flat + off, m->m_flat + off, m->v_flat + off,
        m->tensor_sizes[i], h->lr, h->beta1, h->beta2, h->eps,
        dt_gpt2_tensor_decays(i) ? h->weight_decay : 0.0f, grad_scale, t));
  }
  m->params16_stale = 0;
  return 0;
}
