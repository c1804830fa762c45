/* dp.c — see dp.h. The ZeRO-2/3 paths run inside the model's backward/forward through the
 * unit hooks (gpt2.h): acquire gathers a unit's parameters (ZeRO-3) and hands out a zeroed
 * working gradient buffer (ZeRO-2/3); release with grads reduce-scatters that buffer into the
 * owned gradient range. Units are used one layer at a time, plus the embeddings (held from the
 * LM head through the encoder's backward) and the final LayerNorm: three working buffers. */
#include "dp.h"

#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"

/* Overlap the ZeRO-0/1 gradient all-reduce with the backward pass on a comm thread: 1 on,
 * 0 off, -1 (default) on when the node has a core to spare for it beyond the compute threads
 * of all its ranks. Measured on a 2-core machine with 2 ranks x 1 thread (no spare core):
 * overlap made a gpt-tiny step slower, 536 ms vs 498 ms, because the comm thread and the
 * transport then take their cycles from the compute threads. */
DT_PARAM(DpOverlap, "DP_OVERLAP", -1)

static int want_overlap(void)
{
  int64_t mode = dt_param_DpOverlap();
  if (mode >= 0)
    return mode != 0;
  const char *lws = getenv("LOCAL_WORLD_SIZE");
  if (!lws)
    lws = getenv("WORLD_SIZE");
  long local = lws ? strtol(lws, NULL, 10) : 1;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return cores > (long)omp_get_max_threads() * (local > 0 ? local : 1);
}

enum { W_EMBED = 0, W_FINAL = 1, W_LAYER = 2, W_KINDS = 3 };

struct dt_dp {
  double comm_ms; /* time this rank's compute thread spent blocked in collectives */
  dt_gpt2_t *m;
  dt_comm_t *comm; /* NULL for one process */
  int stage, rank, world;
  int64_t P, lo, hi;
  size_t n;                         /* hi - lo */
  size_t *counts;                   /* (world) shard sizes */
  size_t *rcounts;                  /* (world) per-range scratch */
  float *p_shard;                   /* ZeRO-3 (n) */
  float *g_shard;                   /* ZeRO-2/3 (n) */
  float *m_shard, *v_shard;         /* ZeRO-1..3 (n) */
  float *wp[W_KINDS], *wg[W_KINDS]; /* working params (ZeRO-3) / grads (ZeRO-2/3) */
  size_t wsize[W_KINDS];
  int ref[W_KINDS]; /* acquisitions outstanding per working buffer */
  float *tmp;       /* reduce-scatter landing buffer */
  size_t tmp_n;
  dt_gpt2_hooks_t hooks;
  /* ZeRO-0/1 overlap: a communication thread all-reduces each unit's gradient ranges as soon
   * as the last micro-batch's backward pass has finished that unit, while the compute thread
   * goes on with the next unit (disjoint memory). Only that thread issues collectives during
   * the backward pass; the compute thread waits for it before any collective of its own. */
  int overlap, last_micro, posted;
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  dt_flat_range_t *queue; /* ranges for the comm thread; reset every step */
  size_t q_head, q_tail, q_cap, in_flight;
  int q_err, stop;
};

static int kind_of(int unit)
{
  return unit == DT_UNIT_EMBED ? W_EMBED : unit == DT_UNIT_FINAL ? W_FINAL : W_LAYER;
}

static int collective(const dt_dp_t *dp)
{
  return dp->comm && dp->world > 1;
}

/* Runs a collective, charges its time to comm_ms (exposed communication) and returns its
 * error from the calling function if it failed. */
#define TIMED_CHECK(dp, call)                                                                      \
  do {                                                                                             \
    double dt__t0 = dt_now_ms();                                                                   \
    int dt__crc = (call);                                                                          \
    (dp)->comm_ms += dt_now_ms() - dt__t0;                                                         \
    DT_CHECK(dt__crc);                                                                             \
  } while (0)

/* counts[r] = |[a, b) ∩ shard r|; returns the element offset of this rank's part in [a, b). */
static void range_counts(const dt_dp_t *dp, size_t a, size_t b, size_t *counts)
{
  for (int r = 0; r < dp->world; r++) {
    int64_t s_lo = 0;
    for (int q = 0; q < r; q++)
      s_lo += (int64_t)dp->counts[q];
    int64_t s_hi = s_lo + (int64_t)dp->counts[r];
    int64_t x = DT_MAX((int64_t)a, s_lo), y = DT_MIN((int64_t)b, s_hi);
    counts[r] = y > x ? (size_t)(y - x) : 0;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Units: gather parameters, scatter gradients                                                 */
/* ------------------------------------------------------------------------------------------ */

static int gather_unit(dt_dp_t *dp, int unit, float *dst)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  int nr = dt_gpt2_unit_ranges(dp->m, unit, r);
  size_t packed = 0;
  for (int i = 0; i < nr; i++) {
    size_t a = r[i].off, b = r[i].off + r[i].len;
    range_counts(dp, a, b, dp->rcounts);
    const float *in = dp->p_shard + (DT_MAX((int64_t)a, dp->lo) - dp->lo);
    if (collective(dp)) {
      TIMED_CHECK(dp, dt_comm_all_gather_v(dp->comm, in, dst + packed, dp->rcounts));
    } else {
      memcpy(dst + packed, dp->p_shard + a, r[i].len * sizeof(float));
    }
    packed += r[i].len;
  }
  return 0;
}

static int scatter_unit(dt_dp_t *dp, int unit, const float *src)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  int nr = dt_gpt2_unit_ranges(dp->m, unit, r);
  size_t packed = 0;
  for (int i = 0; i < nr; i++) {
    size_t a = r[i].off, b = r[i].off + r[i].len;
    range_counts(dp, a, b, dp->rcounts);
    size_t mine = dp->rcounts[dp->rank];
    float *acc = dp->g_shard + (DT_MAX((int64_t)a, dp->lo) - dp->lo);
    if (collective(dp)) {
      DT_CHECK(dt_comm_reduce_scatter_v(dp->comm, src + packed, dp->tmp, dp->rcounts, DT_COMM_AVG));
      for (size_t j = 0; j < mine; j++)
        acc[j] += dp->tmp[j];
    } else {
      for (size_t j = 0; j < r[i].len; j++)
        acc[j] += src[packed + j];
    }
    packed += r[i].len;
  }
  return 0;
}

static void packed_view(const dt_dp_t *dp, int unit, float *base, dt_gpt2_view_t *v)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  int nr = dt_gpt2_unit_ranges(dp->m, unit, r);
  memset(v, 0, sizeof *v);
  size_t packed = 0;
  for (int i = 0; i < nr; i++) {
    v->t[r[i].tensor] = base + packed;
    packed += r[i].len;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* ZeRO-0/1: overlapped all-reduce                                                             */
/* ------------------------------------------------------------------------------------------ */

static void *comm_thread(void *arg)
{
  dt_dp_t *dp = arg;
  pthread_mutex_lock(&dp->lock);
  for (;;) {
    while (!dp->stop && dp->q_head == dp->q_tail)
      pthread_cond_wait(&dp->cond, &dp->lock);
    if (dp->stop)
      break;
    dt_flat_range_t r = dp->queue[dp->q_head++];
    int err = dp->q_err;
    pthread_mutex_unlock(&dp->lock);
    if (!err)
      err = dt_comm_all_reduce(dp->comm, dp->m->grads_flat + r.off, r.len, DT_COMM_AVG);
    pthread_mutex_lock(&dp->lock);
    if (err && !dp->q_err)
      dp->q_err = err;
    dp->in_flight--;
    pthread_cond_broadcast(&dp->cond);
  }
  pthread_mutex_unlock(&dp->lock);
  return NULL;
}

/* Queues a unit's gradient ranges for the comm thread. */
static int post_unit(dt_dp_t *dp, int unit)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  int nr = dt_gpt2_unit_ranges(dp->m, unit, r);
  pthread_mutex_lock(&dp->lock);
  for (int i = 0; i < nr; i++) {
    if (dp->q_tail == dp->q_cap) { /* the queue is reset every step: grow, never wrap */
      size_t cap = dp->q_cap ? dp->q_cap * 2 : 64;
      dt_flat_range_t *grown = realloc(dp->queue, cap * sizeof *grown);
      if (!grown) {
        pthread_mutex_unlock(&dp->lock);
        return DT_ENOMEM;
      }
      dp->queue = grown;
      dp->q_cap = cap;
    }
    dp->queue[dp->q_tail++] = r[i];
    dp->in_flight++;
  }
  dp->posted = 1;
  pthread_cond_broadcast(&dp->cond);
  pthread_mutex_unlock(&dp->lock);
  return 0;
}

/* Waits until the comm thread has drained its queue; returns its first error. */
static int wait_posted(dt_dp_t *dp)
{
  pthread_mutex_lock(&dp->lock);
  while (dp->in_flight > 0)
    pthread_cond_wait(&dp->cond, &dp->lock);
  int err = dp->q_err;
  dp->q_head = dp->q_tail = 0;
  dp->q_err = 0;
  pthread_mutex_unlock(&dp->lock);
  return err;
}

static int overlap_acquire(void *ud, int unit, int grads, dt_gpt2_view_t *p, dt_gpt2_view_t *g)
{
  dt_dp_t *dp = ud;
  dt_gpt2_unit_view(dp->m, unit, dp->m->params_flat, p);
  if (grads)
    dt_gpt2_unit_view(dp->m, unit, dp->m->grads_flat, g);
  return 0;
}

static int overlap_release(void *ud, int unit, int grads)
{
  dt_dp_t *dp = ud;
  return grads && dp->last_micro ? post_unit(dp, unit) : 0;
}

static int hook_acquire(void *ud, int unit, int grads, dt_gpt2_view_t *p, dt_gpt2_view_t *g)
{
  dt_dp_t *dp = ud;
  int k = kind_of(unit);
  if (dp->stage == 3) {
    /* Gathered when first acquired, "freed" (the buffer is free for the next unit of its
     * kind) when the last holder releases it. */
    if (dp->ref[k] == 0)
      DT_CHECK(gather_unit(dp, unit, dp->wp[k]));
    packed_view(dp, unit, dp->wp[k], p);
  } else {
    dt_gpt2_unit_view(dp->m, unit, dp->m->params_flat, p);
  }
  dp->ref[k]++;
  if (grads) {
    memset(dp->wg[k], 0, dp->wsize[k] * sizeof(float));
    packed_view(dp, unit, dp->wg[k], g);
  }
  return 0;
}

static int hook_release(void *ud, int unit, int grads)
{
  dt_dp_t *dp = ud;
  int k = kind_of(unit);
  dp->ref[k]--;
  return grads ? scatter_unit(dp, unit, dp->wg[k]) : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Setup                                                                                       */
/* ------------------------------------------------------------------------------------------ */

static float *alloc_floats(size_t n, const char *what)
{
  return dt_calloc_aligned((n ? n : 1) * sizeof(float), what);
}

int dt_dp_create(dt_dp_t **out, dt_gpt2_t *m, dt_comm_t *comm, int zero_stage)
{
  if (zero_stage < 0 || zero_stage > 3) {
    DT_ERROR(TRAIN, "zero stage %d: expected 0, 1, 2 or 3", zero_stage);
    return DT_EINVAL;
  }
  dt_dp_t *dp = calloc(1, sizeof *dp);
  if (!dp)
    return DT_ENOMEM;
  dp->m = m;
  dp->comm = comm;
  dp->stage = zero_stage;
  dp->rank = comm ? dt_comm_rank(comm) : 0;
  dp->world = comm ? dt_comm_world(comm) : 1;
  dp->P = (int64_t)m->num_params;
  dp->counts = calloc((size_t)dp->world, sizeof *dp->counts);
  dp->rcounts = calloc((size_t)dp->world, sizeof *dp->rcounts);
  if (!dp->counts || !dp->rcounts)
    goto oom;
  const int64_t S = (dp->P + dp->world - 1) / dp->world;
  for (int r = 0; r < dp->world; r++) {
    int64_t a = DT_MIN((int64_t)r * S, dp->P), b = DT_MIN((int64_t)(r + 1) * S, dp->P);
    dp->counts[r] = (size_t)(b - a);
    if (r == dp->rank)
      dp->lo = a, dp->hi = b;
  }
  dp->n = (size_t)(dp->hi - dp->lo);
  if (zero_stage == 0) {
    if (dt_gpt2_alloc_optimizer(m) != 0)
      goto oom;
  } else {
    dp->m_shard = alloc_floats(dp->n, "AdamW first moment shard");
    dp->v_shard = alloc_floats(dp->n, "AdamW second moment shard");
    if (!dp->m_shard || !dp->v_shard)
      goto oom;
  }
  if (zero_stage >= 2) {
    dp->g_shard = alloc_floats(dp->n, "gradient shard");
    if (!dp->g_shard)
      goto oom;
    const int units[W_KINDS] = {DT_UNIT_EMBED, DT_UNIT_FINAL, 0};
    size_t biggest = 0;
    for (int k = 0; k < W_KINDS; k++) {
      dt_flat_range_t r[DT_UNIT_MAX_RANGES];
      int nr = dt_gpt2_unit_ranges(m, units[k], r);
      for (int i = 0; i < nr; i++) {
        dp->wsize[k] += r[i].len;
        biggest = DT_MAX(biggest, r[i].len);
      }
      dp->wg[k] = alloc_floats(dp->wsize[k], "working gradients");
      if (!dp->wg[k])
        goto oom;
      if (zero_stage == 3 && !(dp->wp[k] = alloc_floats(dp->wsize[k], "gathered parameters")))
        goto oom;
    }
    dp->tmp_n = DT_MIN(biggest, DT_MAX(dp->n, (size_t)1));
    if (!(dp->tmp = alloc_floats(dp->tmp_n, "reduce-scatter buffer")))
      goto oom;
    /* Gradients now live in the shard and the working buffers. */
    dt_free_aligned(m->grads_flat);
    m->grads_flat = NULL;
    m->bytes_grads = 0;
    memset(&m->grads, 0, sizeof m->grads);
  }
  if (zero_stage == 3) {
    dp->p_shard = alloc_floats(dp->n, "parameter shard");
    if (!dp->p_shard)
      goto oom;
    memcpy(dp->p_shard, m->params_flat + dp->lo, dp->n * sizeof(float));
    dt_free_aligned(m->params_flat);
    m->params_flat = NULL;
    m->bytes_params = 0;
    memset(&m->params, 0, sizeof m->params);
  }
  if (zero_stage >= 2) {
    dp->hooks = (dt_gpt2_hooks_t){.ud = dp, .acquire = hook_acquire, .release = hook_release};
    m->hooks = &dp->hooks;
  } else if (collective(dp) && want_overlap()) {
    pthread_mutex_init(&dp->lock, NULL);
    pthread_cond_init(&dp->cond, NULL);
    if (pthread_create(&dp->thread, NULL, comm_thread, dp) != 0) {
      pthread_mutex_destroy(&dp->lock);
      pthread_cond_destroy(&dp->cond);
      dt_dp_destroy(dp);
      return DT_ESYS;
    }
    dp->overlap = 1;
    dp->last_micro = 1;
    dp->hooks = (dt_gpt2_hooks_t){.ud = dp, .acquire = overlap_acquire, .release = overlap_release};
    m->hooks = &dp->hooks;
  }
  *out = dp;
  return 0;
oom:
  dt_dp_destroy(dp);
  return DT_ENOMEM;
}

void dt_dp_destroy(dt_dp_t *dp)
{
  if (!dp)
    return;
  if (dp->overlap) {
    pthread_mutex_lock(&dp->lock);
    dp->stop = 1;
    pthread_cond_broadcast(&dp->cond);
    pthread_mutex_unlock(&dp->lock);
    pthread_join(dp->thread, NULL);
    pthread_mutex_destroy(&dp->lock);
    pthread_cond_destroy(&dp->cond);
    free(dp->queue);
  }
  if (dp->m && dp->m->hooks == &dp->hooks)
    dp->m->hooks = NULL;
  free(dp->counts);
  free(dp->rcounts);
  dt_free_aligned(dp->p_shard);
  dt_free_aligned(dp->g_shard);
  dt_free_aligned(dp->m_shard);
  dt_free_aligned(dp->v_shard);
  for (int k = 0; k < W_KINDS; k++) {
    dt_free_aligned(dp->wp[k]);
    dt_free_aligned(dp->wg[k]);
  }
  dt_free_aligned(dp->tmp);
  free(dp);
}

void dt_dp_shard(const dt_dp_t *dp, int64_t *lo, int64_t *hi)
{
  *lo = dp->lo;
  *hi = dp->hi;
}

void dt_dp_memory(const dt_dp_t *dp, dt_dp_memory_t *mem)
{
  const size_t F = sizeof(float), P = (size_t)dp->P;
  mem->params = (dp->stage == 3 ? dp->n : P) * F;
  mem->grads = (dp->stage >= 2 ? dp->n : P) * F;
  mem->optim = 2 * (dp->stage >= 1 ? dp->n : P) * F;
  mem->working = dp->tmp ? dp->tmp_n * F : 0;
  for (int k = 0; k < W_KINDS; k++)
    mem->working += ((dp->wp[k] ? dp->wsize[k] : 0) + (dp->wg[k] ? dp->wsize[k] : 0)) * F;
}

/* ------------------------------------------------------------------------------------------ */
/* Step                                                                                        */
/* ------------------------------------------------------------------------------------------ */

void dt_dp_zero_grad(dt_dp_t *dp)
{
  if (dp->stage >= 2)
    memset(dp->g_shard, 0, dp->n * sizeof(float));
  else
    dt_gpt2_zero_grad(dp->m);
}

void dt_dp_begin_micro(dt_dp_t *dp, int last)
{
  dp->last_micro = last;
}

int dt_dp_reduce_grads(dt_dp_t *dp)
{
  if (dp->stage >= 2 || !collective(dp))
    return 0; /* ZeRO-2/3 reduced unit by unit during the backward pass */
  if (dp->overlap && dp->posted) {
    /* Most of it went out during the backward pass: only the wait is exposed. */
    dp->posted = 0;
    double t0 = dt_now_ms();
    int rc = wait_posted(dp);
    dp->comm_ms += dt_now_ms() - t0;
    return rc;
  }
  TIMED_CHECK(dp, dt_comm_all_reduce(dp->comm, dp->m->grads_flat, (size_t)dp->P, DT_COMM_AVG));
  return 0;
}

/* Sums a double across ranks exactly enough for a norm: as a float pair (hi, lo). */
static int sum_double(dt_dp_t *dp, double *x)
{
  if (!collective(dp))
    return 0;
  float pair[2];
  pair[0] = (float)*x;
  pair[1] = (float)(*x - (double)pair[0]);
  TIMED_CHECK(dp, dt_comm_all_reduce(dp->comm, pair, 2, DT_COMM_SUM));
  *x = (double)pair[0] + (double)pair[1];
  return 0;
}

int dt_dp_grad_norm(dt_dp_t *dp, float *norm)
{
  if (dp->stage < 2) { /* every rank holds the whole reduced gradient */
    *norm = dt_gpt2_grad_norm(dp->m);
    return 0;
  }
  double ss = dp->m->ops->sum_squares(dp->g_shard, dp->n);
  DT_CHECK(sum_double(dp, &ss));
  *norm = (float)sqrt(ss);
  return 0;
}

int dt_dp_step(dt_dp_t *dp, const dt_adamw_t *h, float grad_scale, int t)
{
  dt_gpt2_t *m = dp->m;
  if (dp->stage == 0)
    return dt_gpt2_adamw_step(m, h, grad_scale, t);
  /* The owned range, tensor by tensor (weight decay differs between tensors). */
  float *params = dp->stage == 3 ? dp->p_shard - dp->lo : m->params_flat;
  const float *grads = dp->stage >= 2 ? dp->g_shard - dp->lo : m->grads_flat;
  for (int k = 0; k < DT_GPT2_NUM_TENSORS; k++) {
    int64_t a = DT_MAX(dp->lo, (int64_t)m->tensor_offsets[k]);
    int64_t b = DT_MIN(dp->hi, (int64_t)(m->tensor_offsets[k] + m->tensor_sizes[k]));
    if (a >= b)
      continue;
    m->ops->adamw_update(params + a, grads + a, dp->m_shard + (a - dp->lo),
                         dp->v_shard + (a - dp->lo), (size_t)(b - a), h->lr, h->beta1, h->beta2,
                         h->eps, dt_gpt2_tensor_decays(k) ? h->weight_decay : 0.0f, grad_scale, t);
  }
  if (dp->stage == 3 || !collective(dp))
    return 0;
  TIMED_CHECK(dp,
              dt_comm_all_gather_v(dp->comm, m->params_flat + dp->lo, m->params_flat, dp->counts));
  return 0;
}

double dt_dp_take_comm_ms(dt_dp_t *dp)
{
  double ms = dp->comm_ms;
  dp->comm_ms = 0.0;
  return ms;
}

int dt_dp_average(dt_dp_t *dp, float *x)
{
  if (!collective(dp))
    return 0;
  return dt_comm_all_reduce(dp->comm, x, 1, DT_COMM_AVG);
}

/* ------------------------------------------------------------------------------------------ */
/* Checkpoints                                                                                 */
/* ------------------------------------------------------------------------------------------ */

void dt_dp_ckpt_range(const dt_dp_t *dp, dt_ckpt_range_t *r, int *writes, int *writers,
                      int *writer_rank)
{
  const dt_gpt2_t *m = dp->m;
  if (dp->stage == 0) {
    *r = (dt_ckpt_range_t){0, dp->P, m->params_flat, m->m_flat, m->v_flat};
    *writes = dp->rank == 0;
    *writers = 1;
    *writer_rank = 0;
    return;
  }
  const float *p = dp->stage == 3 ? dp->p_shard : m->params_flat + dp->lo;
  *r = (dt_ckpt_range_t){dp->lo, dp->hi, p, dp->m_shard, dp->v_shard};
  *writes = 1;
  *writers = dp->world;
  *writer_rank = dp->rank;
}

int dt_dp_load(dt_dp_t *dp, const char *path, dt_train_state_t *state)
{
  dt_gpt2_t *m = dp->m;
  const dt_gpt2_config_t *cfg = &m->cfg;
  switch (dp->stage) {
  case 0:
    return dt_ckpt_load_range(path, cfg, dp->P, 0, dp->P, m->params_flat, m->m_flat, m->v_flat,
                              state);
  case 1:
  case 2:
    DT_CHECK(dt_ckpt_load_range(path, cfg, dp->P, 0, dp->P, m->params_flat, NULL, NULL, state));
    return dt_ckpt_load_range(path, cfg, dp->P, dp->lo, dp->hi, NULL, dp->m_shard, dp->v_shard,
                              state);
  default:
    return dt_ckpt_load_range(path, cfg, dp->P, dp->lo, dp->hi, dp->p_shard, dp->m_shard,
                              dp->v_shard, state);
  }
}

int dt_dp_gather_params(dt_dp_t *dp, float *out)
{
  if (dp->stage < 3) {
    memcpy(out, dp->m->params_flat, (size_t)dp->P * sizeof(float));
    return 0;
  }
  if (!collective(dp)) {
    memcpy(out, dp->p_shard, dp->n * sizeof(float));
    return 0;
  }
  return dt_comm_all_gather_v(dp->comm, dp->p_shard, out, dp->counts);
}
