/* dp.c — see dp.h.
 *
 * ZeRO-2/3 run inside the model's forward and backward through the unit hooks (gpt2.h).
 * Working buffers live in slots: one for the embeddings (held from the LM head through the
 * encoder's backward), one for the final LayerNorm and two for layers, so that one layer can be
 * computed while the next is gathered (ZeRO-3 prefetch) or the previous one's gradients are
 * reduce-scattered. A slot remembers whose parameters it holds: a unit is gathered again only
 * after the optimizer step has changed the shards, so the embeddings are gathered once per
 * step (not once for the encoder and once for the LM head, per micro-batch) and the backward
 * pass starts with the last two layers still in place.
 *
 * Collectives of the forward and backward passes are tasks in one FIFO. With the comm thread
 * (DISTRAIN_DP_OVERLAP) they run there, in the order posted (the same on every rank, since the
 * schedule depends only on the model), while the compute thread goes on; without it they run
 * in place when posted. Either way each unit costs one all-gather and one reduce-scatter: its
 * ranges (12 per layer) are packed rank-major into a staging buffer, so the latency of a
 * collective is paid once per unit, not once per tensor. The compute thread issues collectives
 * of its own (norms, ZeRO-1's all-gather, averages) only after draining the FIFO, and on NCCL
 * its model-parallel ones too (dt_dp_order_before).
 *
 * A task is posted with a device event recorded behind the work queued so far: the kernels that
 * produced its unit's gradients, or last read the slot it gathers into. The comm thread waits for
 * that event, not for the whole device: on a GPU the compute thread queues later layers
 * meanwhile, and a collective need not wait for them. The comm thread's own copies and
 * accumulations go to the device's side stream (kernels/device.h), which the collectives wait
 * for (the communicator syncs the calling thread's stream) and which the comm thread drains
 * before it reports a task done, so the compute thread may use the results at once. */
#include "dp.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"

/* Run the data-parallel collectives on a comm thread, overlapped with compute: 1 on, 0 off,
 * -1 (default) on under ZeRO-2/3 and on a GPU (whose compute thread only queues kernels, so the
 * comm thread takes no core from the compute: DDP's bucketed all-reduce during the backward
 * pass), and under ZeRO-0/1 on the CPU when the node has a core to spare beyond the compute
 * threads of all its ranks. Measured on a 2-core machine with 2 ranks x 1 thread
 * (no spare core; gpt-tiny, 5 alternating rounds, tests/bench/bench_dp.py): the comm thread made
 * ZeRO-2 steps faster in every round (median 458 vs 470 ms) and ZeRO-3 faster or equal (477 vs
 * 500 ms; its prefetch then really runs ahead), while ZeRO-0 came out even (470 vs 472 ms, one
 * round 6% slower): its one all-reduce per unit has little to hide behind on a busy core. */
DT_PARAM(DpOverlap, "DP_OVERLAP", -1)

int dt_dp_overlapped(int world, int zero_stage, const dt_device_t *dev)
{
  if (world < 2)
    return 0;
  int64_t mode = dt_param_DpOverlap();
  if (mode >= 0)
    return mode != 0;
  return zero_stage >= 2 || !dev->host || dt_cpu_spare();
}

/* Working-buffer slots: fixed ones for the embeddings and the final LayerNorm, two for layers. */
enum { S_EMBED = 0, S_FINAL = 1, S_LAYER0 = 2, S_COUNT = 4 };
#define NO_UNIT (-1000)

typedef struct {
  float *p;     /* gathered parameters (ZeRO-3) */
  float *g;     /* working gradients (ZeRO-2/3) */
  size_t size;  /* floats in p and g */
  int unit;     /* whose parameters p holds or is being gathered into; NO_UNIT */
  int ref;      /* acquisitions outstanding */
  uint64_t use; /* last acquisition (least recently used layer slot is reused first) */
  uint64_t gather_seq, scatter_seq; /* tasks to wait for before reading p / reusing g */
} slot_t;

typedef enum { TASK_ALL_REDUCE, TASK_GATHER, TASK_SCATTER } task_kind_t;

typedef struct {
  task_kind_t kind;
  int unit, slot;
  void *ready; /* device event: the work queued before the task was posted (comm thread only) */
} task_t;

struct dt_dp {
  double comm_ms; /* time this rank's compute thread spent blocked in collectives */
  dt_gpt2_t *m;
  dt_device_t *dev; /* m's */
  dt_comm_t *comm;  /* NULL for one process */
  dt_comm_t *mp;    /* the model-parallel group the gradient norm also sums over, or NULL */
  int stage, rank, world;
  int64_t P, lo, hi;
  size_t n;                 /* hi - lo */
  size_t *counts;           /* (world) shard sizes */
  int64_t *displs;          /* (world + 1) shard starts; displs[world] = P */
  size_t *rcounts;          /* (world) per-collective scratch */
  float *p_shard;           /* ZeRO-3 (n) */
  float *g_shard;           /* ZeRO-2/3 (n) */
  float *m_shard, *v_shard; /* ZeRO-1..3 (n) */
  slot_t slots[S_COUNT];    /* ZeRO-2/3 */
  uint64_t uses;
  int order[2][DT_UNIT_MAX_ORDER]; /* the model's unit order, forward and backward */
  int norder[2], cursor[2];        /* ZeRO-3 prefetch: where each pass is in its order */
  dt_comm_t *emb; /* pipeline: first and last stage, whose tied wte gradients are summed */
  int emb_fresh;  /* ZeRO-2/3 with emb: the embeddings' working gradients start this step */
  float *staging; /* a unit's ranges packed rank-major (units up to staging_n floats) */
  size_t staging_n;
  float *tmp; /* reduce-scatter landing buffer */
  size_t tmp_n;
  dt_gpt2_hooks_t hooks;
  int last_micro; /* ZeRO-0/1 overlap: reduce during this micro-batch's backward */
  int posted;     /* ZeRO-0/1 overlap: this step's all-reduces went to the comm thread */
  /* Task FIFO. seq_posted/seq_done count tasks; a task's seq is seq_posted after posting it. */
  int threaded;
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  task_t *queue;
  size_t q_head, q_tail, q_cap;
  uint64_t seq_posted, seq_done;
  int q_err, stop;
  dt_comm_t *gated[8]; /* dt_dp_order_before's communicators, released by destroy */
  int ngated;
};

static int collective(const dt_dp_t *dp)
{
  return dp->comm && dp->world > 1;
}

/* Tensor memory is the device's: copies, zeroing and sums go through it. */
static int dcopy(dt_dp_t *dp, float *dst, const float *src, size_t n)
{
  return dp->dev->copy(dp->dev, dst, src, n * sizeof(float), DT_COPY_D2D);
}

static int dzero(dt_dp_t *dp, float *p, size_t n)
{
  return dp->dev->zero(dp->dev, p, n * sizeof(float));
}

/* Runs a collective from the compute thread, charges its time to comm_ms (exposed
 * communication) and returns its error from the calling function if it failed. */
#define TIMED_CHECK(dp, call)                                                                      \
  do {                                                                                             \
    double dt__t0 = dt_now_ms();                                                                   \
    int dt__crc = (call);                                                                          \
    (dp)->comm_ms += dt_now_ms() - dt__t0;                                                         \
    DT_CHECK(dt__crc);                                                                             \
  } while (0)

/* The part of range r inside rank q's shard: [*a, *a + return value). */
static size_t part_of(const dt_dp_t *dp, const dt_flat_range_t *r, int q, int64_t *a)
{
  int64_t x = DT_MAX((int64_t)r->off, dp->displs[q]);
  int64_t y = DT_MIN((int64_t)(r->off + r->len), dp->displs[q + 1]);
  *a = x;
  return y > x ? (size_t)(y - x) : 0;
}

/* rcounts[q] = the elements of ranges r[0..nr) in rank q's shard. */
static void unit_counts(dt_dp_t *dp, const dt_flat_range_t *r, int nr)
{
  int64_t a;
  for (int q = 0; q < dp->world; q++) {
    dp->rcounts[q] = 0;
    for (int i = 0; i < nr; i++)
      dp->rcounts[q] += part_of(dp, &r[i], q, &a);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Unit collectives                                                                            */
/* ------------------------------------------------------------------------------------------ */

/* A unit's ranges (returns how many), where each starts when they are packed in order, and
 * their total size. */
static int unit_layout(const dt_gpt2_t *m, int unit, dt_flat_range_t *r, size_t *poff,
                       size_t *total)
{
  int nr = dt_gpt2_unit_ranges(m, unit, r);
  *total = 0;
  for (int i = 0; i < nr; i++) {
    poff[i] = *total;
    *total += r[i].len;
  }
  return nr;
}

/* Points a view at a unit's tensors packed in order in base (a working buffer). */
static void packed_view(const dt_dp_t *dp, int unit, float *base, dt_gpt2_view_t *v)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  size_t poff[DT_UNIT_MAX_RANGES], total;
  int nr = unit_layout(dp->m, unit, r, poff, &total);
  memset(v, 0, sizeof *v);
  for (int i = 0; i < nr; i++)
    v->t[r[i].tensor] = base + poff[i];
}

/* A unit's parameters, gathered from the shards into dst (its ranges packed in order). Units
 * that fit the staging buffer (layers, final LayerNorm) take one all-gather: each rank's parts
 * of every range arrive rank-major and are unpacked. Bigger ones (the embeddings: two ranges)
 * take one all-gather per range, straight into dst. */
static int gather_unit(dt_dp_t *dp, int unit, float *dst)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  size_t poff[DT_UNIT_MAX_RANGES], total;
  int nr = unit_layout(dp->m, unit, r, poff, &total);
  int64_t a;
  if (!collective(dp)) {
    for (int i = 0; i < nr; i++)
      DT_CHECK(dcopy(dp, dst + poff[i], dp->p_shard + r[i].off, r[i].len));
    return 0;
  }
  if (total > dp->staging_n) {
    for (int i = 0; i < nr; i++) {
      unit_counts(dp, &r[i], 1);
      part_of(dp, &r[i], dp->rank, &a);
      DT_CHECK(
          dt_comm_all_gather_v(dp->comm, dp->p_shard + (a - dp->lo), dst + poff[i], dp->rcounts));
    }
    return 0;
  }
  unit_counts(dp, r, nr);
  float *mine = dp->staging;
  for (int q = 0; q < dp->rank; q++)
    mine += dp->rcounts[q];
  size_t off = 0;
  for (int i = 0; i < nr; i++) {
    size_t len = part_of(dp, &r[i], dp->rank, &a);
    DT_CHECK(dcopy(dp, mine + off, dp->p_shard + (a - dp->lo), len));
    off += len;
  }
  DT_CHECK(dt_comm_all_gather_v(dp->comm, mine, dp->staging, dp->rcounts));
  const float *src = dp->staging;
  for (int q = 0; q < dp->world; q++)
    for (int i = 0; i < nr; i++) {
      size_t len = part_of(dp, &r[i], q, &a);
      DT_CHECK(dcopy(dp, dst + poff[i] + (size_t)(a - (int64_t)r[i].off), src, len));
      src += len;
    }
  return 0;
}

/* A unit's working gradients (src, packed like gather_unit's dst) averaged over the ranks and
 * added into the owned gradient shard: the mirror image of gather_unit. */
static int scatter_unit(dt_dp_t *dp, int unit, const float *src)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  size_t poff[DT_UNIT_MAX_RANGES], total;
  int nr = unit_layout(dp->m, unit, r, poff, &total);
  int64_t a;
  if (!collective(dp)) {
    for (int i = 0; i < nr; i++)
      DT_CHECK(dp->dev->accumulate(dp->dev, dp->g_shard + r[i].off, src + poff[i], r[i].len));
    return 0;
  }
  if (total > dp->staging_n) {
    for (int i = 0; i < nr; i++) {
      unit_counts(dp, &r[i], 1);
      size_t len = part_of(dp, &r[i], dp->rank, &a);
      DT_CHECK(
          dt_comm_reduce_scatter_v(dp->comm, src + poff[i], dp->tmp, dp->rcounts, DT_COMM_AVG));
      DT_CHECK(dp->dev->accumulate(dp->dev, dp->g_shard + (a - dp->lo), dp->tmp, len));
    }
    return 0;
  }
  unit_counts(dp, r, nr);
  float *dst = dp->staging;
  for (int q = 0; q < dp->world; q++)
    for (int i = 0; i < nr; i++) {
      size_t len = part_of(dp, &r[i], q, &a);
      DT_CHECK(dcopy(dp, dst, src + poff[i] + (size_t)(a - (int64_t)r[i].off), len));
      dst += len;
    }
  DT_CHECK(dt_comm_reduce_scatter_v(dp->comm, dp->staging, dp->tmp, dp->rcounts, DT_COMM_AVG));
  const float *got = dp->tmp;
  for (int i = 0; i < nr; i++) {
    size_t len = part_of(dp, &r[i], dp->rank, &a);
    DT_CHECK(dp->dev->accumulate(dp->dev, dp->g_shard + (a - dp->lo), got, len));
    got += len;
  }
  return 0;
}

/* ZeRO-0/1: a unit's gradients (in the model's full buffer) averaged over the ranks, in one
 * all-reduce when the unit fits the staging buffer, else one per range. */
static int all_reduce_unit(dt_dp_t *dp, int unit)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  size_t poff[DT_UNIT_MAX_RANGES], total;
  int nr = unit_layout(dp->m, unit, r, poff, &total);
  float *grads = dp->m->grads_flat;
  if (total > dp->staging_n) {
    for (int i = 0; i < nr; i++)
      DT_CHECK(dt_comm_all_reduce(dp->comm, grads + r[i].off, r[i].len, DT_COMM_AVG));
    return 0;
  }
  for (int i = 0; i < nr; i++)
    DT_CHECK(dcopy(dp, dp->staging + poff[i], grads + r[i].off, r[i].len));
  DT_CHECK(dt_comm_all_reduce(dp->comm, dp->staging, total, DT_COMM_AVG));
  for (int i = 0; i < nr; i++)
    DT_CHECK(dcopy(dp, grads + r[i].off, dp->staging + poff[i], r[i].len));
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Task FIFO and the comm thread                                                               */
/* ------------------------------------------------------------------------------------------ */

static int run_task(dt_dp_t *dp, const task_t *t)
{
  switch (t->kind) {
  case TASK_ALL_REDUCE:
    return all_reduce_unit(dp, t->unit);
  case TASK_GATHER:
    return gather_unit(dp, t->unit, dp->slots[t->slot].p);
  default:
    return scatter_unit(dp, t->unit, dp->slots[t->slot].g);
  }
}

static void *comm_thread(void *arg)
{
  dt_dp_t *dp = arg;
  dt_device_t *dev = dp->dev;
  pthread_mutex_lock(&dp->lock);
  for (;;) {
    while (!dp->stop && dp->q_head == dp->q_tail)
      pthread_cond_wait(&dp->cond, &dp->lock);
    if (dp->stop)
      break;
    task_t t = dp->queue[dp->q_head++];
    int err = dp->q_err;
    pthread_mutex_unlock(&dp->lock);
    if (!err)
      err = dev->event_wait(dev, t.ready);
    dev->event_destroy(dev, t.ready);
    if (!err) /* after a failure the rest is skipped (the communicator is poisoned anyway) */
      err = run_task(dp, &t);
    if (!err) /* this thread's copies and accumulations are done before the task is */
      err = dev->sync(dev);
    pthread_mutex_lock(&dp->lock);
    if (err && !dp->q_err)
      dp->q_err = err;
    dp->seq_done++;
    pthread_cond_broadcast(&dp->cond);
  }
  pthread_mutex_unlock(&dp->lock);
  return NULL;
}

/* Hands a task to the comm thread (or runs it now, without one); *seq identifies it for
 * wait_task. Returns the first error of any task so far. */
static int post_task(dt_dp_t *dp, task_t t, uint64_t *seq)
{
  if (!dp->threaded) {
    double t0 = dt_now_ms();
    int rc = run_task(dp, &t);
    dp->comm_ms += dt_now_ms() - t0;
    *seq = dp->seq_done = ++dp->seq_posted;
    return rc;
  }
  dt_device_t *dev = dp->dev;
  DT_CHECK(dev->event_create(dev, &t.ready));
  int err = dev->event_record(dev, t.ready);
  pthread_mutex_lock(&dp->lock);
  if (!err)
    err = dp->q_err;
  if (!err && dp->q_head == dp->q_tail)
    dp->q_head = dp->q_tail = 0; /* drained: start over instead of growing */
  if (!err && dp->q_tail == dp->q_cap) {
    size_t cap = dp->q_cap ? dp->q_cap * 2 : 64;
    task_t *grown = realloc(dp->queue, cap * sizeof *grown);
    if (grown) {
      dp->queue = grown;
      dp->q_cap = cap;
    } else {
      err = DT_ENOMEM;
    }
  }
  if (!err) {
    dp->queue[dp->q_tail++] = t;
    *seq = ++dp->seq_posted;
    pthread_cond_broadcast(&dp->cond);
  }
  pthread_mutex_unlock(&dp->lock);
  if (err)
    dev->event_destroy(dev, t.ready);
  return err;
}

/* Waits until task seq (and every task before it) has run; the wait is exposed communication.
 * Returns the first error of any task so far. */
static int wait_task(dt_dp_t *dp, uint64_t seq)
{
  if (!dp->threaded)
    return 0;
  double t0 = dt_now_ms();
  pthread_mutex_lock(&dp->lock);
  while (dp->seq_done < seq)
    pthread_cond_wait(&dp->cond, &dp->lock);
  int err = dp->q_err;
  pthread_mutex_unlock(&dp->lock);
  dp->comm_ms += dt_now_ms() - t0;
  return err;
}

/* Before the compute thread issues a collective itself. */
static int drain(dt_dp_t *dp)
{
  return wait_task(dp, dp->seq_posted);
}

static int drain_gate(void *ud)
{
  return drain(ud);
}

int dt_dp_order_before(dt_dp_t *dp, dt_comm_t *other)
{
  if (!dp->threaded || !other || other == dp->comm)
    return 0;
  if (dp->ngated == (int)DT_ARRAY_SIZE(dp->gated))
    return DT_EINVAL;
  dt_comm_set_gate(other, drain_gate, dp);
  dp->gated[dp->ngated++] = other;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Hooks                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* ZeRO-0/1 with the comm thread: a unit's gradient ranges are all-reduced as soon as the last
 * micro-batch's backward has finished with them, while compute goes on with the next unit
 * (disjoint memory). */
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
  if (!grads || !dp->last_micro)
    return 0;
  uint64_t seq;
  dp->posted = 1;
  return post_task(dp, (task_t){.kind = TASK_ALL_REDUCE, .unit = unit}, &seq);
}

/* The slot for a unit: its fixed slot, or the layer slot that holds it, or else the least
 * recently used free layer slot; -1 if both layer slots are in use. */
static int slot_for(const dt_dp_t *dp, int unit)
{
  if (unit == DT_UNIT_EMBED)
    return S_EMBED;
  if (unit == DT_UNIT_FINAL)
    return S_FINAL;
  int best = -1;
  for (int s = S_LAYER0; s < S_COUNT; s++) {
    if (dp->slots[s].unit == unit)
      return s;
    if (dp->slots[s].ref == 0 && (best < 0 || dp->slots[s].use < dp->slots[best].use))
      best = s;
  }
  return best;
}

/* The unit the model acquires after this one, from the order the model publishes
 * (dt_gpt2_unit_order); NO_UNIT at the end of a pass. A unit may appear twice in a pass (the
 * embeddings: encoder and LM head), so each direction keeps a cursor. */
static int next_unit(dt_dp_t *dp, int unit, int backward)
{
  const int *o = dp->order[backward], n = dp->norder[backward];
  int i = dp->cursor[backward];
  while (i < n && o[i] != unit)
    i++;
  if (i == n) /* not where the cursor expected it: a new pass */
    for (i = 0; i < n && o[i] != unit; i++)
      ;
  if (i >= n - 1) {
    dp->cursor[backward] = 0;
    return NO_UNIT;
  }
  dp->cursor[backward] = i + 1;
  return o[i + 1];
}

/* ZeRO-3: makes sure slot s holds (or will hold) unit's parameters. */
static int ensure_gathered(dt_dp_t *dp, int s, int unit)
{
  slot_t *sl = &dp->slots[s];
  if (sl->unit == unit)
    return 0;
  DT_DEBUG(TRAIN, "dp: gather unit %d into slot %d", unit, s);
  sl->unit = unit;
  return post_task(dp, (task_t){.kind = TASK_GATHER, .unit = unit, .slot = s}, &sl->gather_seq);
}

static int hook_acquire(void *ud, int unit, int grads, dt_gpt2_view_t *p, dt_gpt2_view_t *g)
{
  dt_dp_t *dp = ud;
  int s = slot_for(dp, unit);
  if (s < 0) {
    DT_ERROR(TRAIN, "dp: unit %d acquired while both layer buffers are in use", unit);
    return DT_EINVAL;
  }
  slot_t *sl = &dp->slots[s];
  sl->ref++;
  sl->use = ++dp->uses;
  if (dp->stage == 3) {
    DT_CHECK(ensure_gathered(dp, s, unit));
    DT_CHECK(wait_task(dp, sl->gather_seq));
    packed_view(dp, unit, sl->p, p);
    /* Prefetch the next unit into a free slot while this one computes. */
    int next = next_unit(dp, unit, grads);
    int ns = next == NO_UNIT ? -1 : slot_for(dp, next);
    if (ns >= 0 && ns != s)
      DT_CHECK(ensure_gathered(dp, ns, next));
  } else {
    sl->unit = unit;
    dt_gpt2_unit_view(dp->m, unit, dp->m->params_flat, p);
  }
  if (grads) {
    DT_CHECK(wait_task(dp, sl->scatter_seq)); /* its previous gradients have left */
    /* Under a pipeline the embeddings' gradients accumulate over the step's micro-batches
     * and leave once, after the tied sum between the first and last stage. */
    if (!(unit == DT_UNIT_EMBED && dp->emb) || dp->emb_fresh)
      DT_CHECK(dzero(dp, sl->g, sl->size));
    if (unit == DT_UNIT_EMBED)
      dp->emb_fresh = 0;
    packed_view(dp, unit, sl->g, g);
  }
  return 0;
}

static int hook_release(void *ud, int unit, int grads)
{
  dt_dp_t *dp = ud;
  int s = slot_for(dp, unit); /* the slot that holds it: acquired units are never evicted */
  if (s < 0 || dp->slots[s].ref <= 0) {
    DT_ERROR(TRAIN, "dp: unit %d released but not acquired", unit);
    return DT_EINVAL;
  }
  slot_t *sl = &dp->slots[s];
  sl->ref--;
  if (!grads || (unit == DT_UNIT_EMBED && dp->emb))
    return 0;
  return post_task(dp, (task_t){.kind = TASK_SCATTER, .unit = unit, .slot = s}, &sl->scatter_seq);
}

/* After the shards changed (optimizer step, checkpoint load): no slot holds valid parameters. */
static void invalidate_slots(dt_dp_t *dp)
{
  for (int s = 0; s < S_COUNT; s++)
    dp->slots[s].unit = NO_UNIT;
}

/* ------------------------------------------------------------------------------------------ */
/* Setup                                                                                       */
/* ------------------------------------------------------------------------------------------ */

static float *alloc_floats(dt_dp_t *dp, size_t n, const char *what)
{
  void *p = NULL;
  return dp->dev->alloc(dp->dev, (n ? n : 1) * sizeof(float), what, &p) == 0 ? p : NULL;
}

static size_t unit_size(const dt_gpt2_t *m, int unit, size_t *biggest_range)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  size_t poff[DT_UNIT_MAX_RANGES], total;
  int nr = unit_layout(m, unit, r, poff, &total);
  for (int i = 0; i < nr; i++)
    *biggest_range = DT_MAX(*biggest_range, r[i].len);
  return total;
}

/* ZeRO-2/3 working buffers; the model's full gradient (and ZeRO-3: parameter) buffers go. */
static int create_slots(dt_dp_t *dp)
{
  dt_gpt2_t *m = dp->m;
  size_t biggest_range = 0;
  for (int s = 0; s < S_COUNT; s++) {
    slot_t *sl = &dp->slots[s];
    int unit = s == S_EMBED ? DT_UNIT_EMBED : s == S_FINAL ? DT_UNIT_FINAL : 0;
    sl->size = m->L > 0 || s < S_LAYER0 ? unit_size(m, unit, &biggest_range) : 0;
    sl->unit = NO_UNIT;
    if (!(sl->g = alloc_floats(dp, sl->size, "working gradients")))
      return DT_ENOMEM;
    if (dp->stage == 3 && !(sl->p = alloc_floats(dp, sl->size, "gathered parameters")))
      return DT_ENOMEM;
  }
  dp->g_shard = alloc_floats(dp, dp->n, "gradient shard");
  dp->tmp_n = DT_MIN(DT_MAX(biggest_range, dp->staging_n), DT_MAX(dp->n, (size_t)1));
  dp->tmp = alloc_floats(dp, dp->tmp_n, "reduce-scatter buffer");
  if (!dp->g_shard || !dp->tmp)
    return DT_ENOMEM;
  dp->dev->free(dp->dev, m->grads_flat);
  m->grads_flat = NULL;
  m->bytes_grads = 0;
  memset(&m->grads, 0, sizeof m->grads);
  if (dp->stage == 3) {
    if (!(dp->p_shard = alloc_floats(dp, dp->n, "parameter shard")))
      return DT_ENOMEM;
    DT_CHECK(dcopy(dp, dp->p_shard, m->params_flat + dp->lo, dp->n));
    dp->dev->free(dp->dev, m->params_flat);
    dp->dev->free(dp->dev, m->params16); /* the gathered weights are rounded as they are used */
    m->params_flat = NULL;
    m->params16 = NULL;
    m->bytes_params = 0;
    memset(&m->params, 0, sizeof m->params);
  }
  return 0;
}

static int start_thread(dt_dp_t *dp)
{
  pthread_mutex_init(&dp->lock, NULL);
  pthread_cond_init(&dp->cond, NULL);
  if (pthread_create(&dp->thread, NULL, comm_thread, dp) != 0) {
    pthread_mutex_destroy(&dp->lock);
    pthread_cond_destroy(&dp->cond);
    DT_ERROR(TRAIN, "dp: cannot start the comm thread");
    return DT_ESYS;
  }
  dp->threaded = 1;
  return 0;
}

int dt_dp_create(dt_dp_t **out, dt_gpt2_t *m, dt_comm_t *comm, dt_comm_t *mp, dt_comm_t *emb,
                 int zero_stage)
{
  if (zero_stage < 0 || zero_stage > 3) {
    DT_ERROR(TRAIN, "zero stage %d: expected 0, 1, 2 or 3", zero_stage);
    return DT_EINVAL;
  }
  int rc = DT_ENOMEM;
  dt_dp_t *dp = calloc(1, sizeof *dp);
  if (!dp)
    return DT_ENOMEM;
  dp->m = m;
  dp->dev = m->dev;
  dp->comm = comm;
  dp->mp = mp;
  dp->emb = emb;
  if (m->L + 3 > DT_UNIT_MAX_ORDER) {
    DT_ERROR(TRAIN, "%d layers on one stage: at most %d", m->L, DT_UNIT_MAX_ORDER - 3);
    free(dp);
    return DT_EINVAL;
  }
  dp->norder[0] = dt_gpt2_unit_order(m, 0, dp->order[0]);
  dp->norder[1] = dt_gpt2_unit_order(m, 1, dp->order[1]);
  dp->stage = zero_stage;
  dp->rank = comm ? dt_comm_rank(comm) : 0;
  dp->world = comm ? dt_comm_world(comm) : 1;
  dp->P = (int64_t)m->num_params;
  dp->counts = calloc((size_t)dp->world, sizeof *dp->counts);
  dp->displs = calloc((size_t)dp->world + 1, sizeof *dp->displs);
  dp->rcounts = calloc((size_t)dp->world, sizeof *dp->rcounts);
  if (!dp->counts || !dp->displs || !dp->rcounts)
    goto fail;
  const int64_t S = (dp->P + dp->world - 1) / dp->world;
  for (int r = 0; r <= dp->world; r++)
    dp->displs[r] = DT_MIN((int64_t)r * S, dp->P);
  for (int r = 0; r < dp->world; r++)
    dp->counts[r] = (size_t)(dp->displs[r + 1] - dp->displs[r]);
  dp->lo = dp->displs[dp->rank];
  dp->hi = dp->displs[dp->rank + 1];
  dp->n = (size_t)(dp->hi - dp->lo);
  if (zero_stage == 0) {
    if (dt_gpt2_alloc_optimizer(m) != 0)
      goto fail;
  } else {
    dp->m_shard = alloc_floats(dp, dp->n, "AdamW first moment shard");
    dp->v_shard = alloc_floats(dp, dp->n, "AdamW second moment shard");
    if (!dp->m_shard || !dp->v_shard)
      goto fail;
  }
  int overlap = collective(dp) && dt_dp_overlapped(dp->world, zero_stage, dp->dev);
  if (collective(dp) && dp->rank == 0)
    DT_INFO(TRAIN, "data parallel: %d ranks, ZeRO-%d, collectives %s (DISTRAIN_DP_OVERLAP=%lld)",
            dp->world, zero_stage, overlap ? "on a comm thread, overlapped" : "in place",
            (long long)dt_param_DpOverlap());
  if (collective(dp) && (zero_stage >= 2 || overlap)) {
    /* Every unit but the embeddings (two ranges, the biggest) is packed through staging. */
    size_t unused = 0;
    dp->staging_n =
        DT_MAX(unit_size(m, DT_UNIT_FINAL, &unused), m->L > 0 ? unit_size(m, 0, &unused) : 0);
    if (!(dp->staging = alloc_floats(dp, dp->staging_n, "staging buffer")))
      goto fail;
  }
  if (zero_stage >= 2)
    DT_CHECK_GOTO(create_slots(dp), rc, fail);
  if (overlap)
    DT_CHECK_GOTO(start_thread(dp), rc, fail);
  if (zero_stage >= 2) {
    dp->hooks = (dt_gpt2_hooks_t){.ud = dp, .acquire = hook_acquire, .release = hook_release};
    m->hooks = &dp->hooks;
  } else if (overlap) {
    dp->last_micro = 1;
    dp->hooks = (dt_gpt2_hooks_t){.ud = dp, .acquire = overlap_acquire, .release = overlap_release};
    m->hooks = &dp->hooks;
  }
  *out = dp;
  return 0;
fail:
  dt_dp_destroy(dp);
  return rc;
}

void dt_dp_destroy(dt_dp_t *dp)
{
  if (!dp)
    return;
  if (dp->threaded) {
    pthread_mutex_lock(&dp->lock);
    dp->stop = 1;
    pthread_cond_broadcast(&dp->cond);
    pthread_mutex_unlock(&dp->lock);
    pthread_join(dp->thread, NULL);
    pthread_mutex_destroy(&dp->lock);
    pthread_cond_destroy(&dp->cond);
    for (size_t i = dp->q_head; i < dp->q_tail; i++) /* posted, never run */
      dp->dev->event_destroy(dp->dev, dp->queue[i].ready);
  }
  free(dp->queue);
  for (int i = 0; i < dp->ngated; i++)
    dt_comm_set_gate(dp->gated[i], NULL, NULL);
  if (dp->m && dp->m->hooks == &dp->hooks)
    dp->m->hooks = NULL;
  free(dp->counts);
  free(dp->displs);
  free(dp->rcounts);
  dt_device_t *dev = dp->dev;
  dev->free(dev, dp->p_shard);
  dev->free(dev, dp->g_shard);
  dev->free(dev, dp->m_shard);
  dev->free(dev, dp->v_shard);
  for (int s = 0; s < S_COUNT; s++) {
    dev->free(dev, dp->slots[s].p);
    dev->free(dev, dp->slots[s].g);
  }
  dev->free(dev, dp->staging);
  dev->free(dev, dp->tmp);
  free(dp);
}

void dt_dp_memory(const dt_dp_t *dp, dt_dp_memory_t *mem)
{
  const size_t F = sizeof(float), P = (size_t)dp->P;
  mem->params = (dp->stage == 3 ? dp->n : P) * F;
  mem->grads = (dp->stage >= 2 ? dp->n : P) * F;
  mem->optim = 2 * (dp->stage >= 1 ? dp->n : P) * F;
  mem->working = ((dp->tmp ? dp->tmp_n : 0) + (dp->staging ? dp->staging_n : 0)) * F;
  for (int s = 0; s < S_COUNT; s++)
    mem->working +=
        ((dp->slots[s].p ? dp->slots[s].size : 0) + (dp->slots[s].g ? dp->slots[s].size : 0)) * F;
}

/* ------------------------------------------------------------------------------------------ */
/* Step                                                                                        */
/* ------------------------------------------------------------------------------------------ */

int dt_dp_zero_grad(dt_dp_t *dp)
{
  dp->emb_fresh = 1;
  if (dp->stage >= 2)
    return dzero(dp, dp->g_shard, dp->n);
  return dt_gpt2_zero_grad(dp->m);
}

void dt_dp_begin_micro(dt_dp_t *dp, int last)
{
  dp->last_micro = last;
}

/* Pipeline: the first and the last stage each hold wte (the LM head is tied to the token
 * embedding) and each computed part of its gradient; both copies get the sum, so both take
 * the same update. Linear, so it may follow the data-parallel average. */
static int sum_tied(dt_dp_t *dp, float *wte_grad)
{
  const size_t n = dp->m->tensor_sizes[DT_T_WTE];
  DT_CHECK(drain(dp));
  TIMED_CHECK(dp, dt_comm_all_reduce(dp->emb, wte_grad, n, DT_COMM_SUM));
  return 0;
}

int dt_dp_reduce_grads(dt_dp_t *dp)
{
  if (dp->stage >= 2) { /* reduce-scattered unit by unit during the backward pass */
    if (dp->emb) {      /* but the embeddings once per step, after the tied sum */
      slot_t *sl = &dp->slots[S_EMBED];
      uint64_t seq;
      DT_CHECK(sum_tied(dp, sl->g)); /* wte comes first in the packed unit */
      DT_CHECK(post_task(dp, (task_t){.kind = TASK_SCATTER, .unit = DT_UNIT_EMBED, .slot = S_EMBED},
                         &seq));
    }
    return drain(dp);
  }
  if (collective(dp)) {
    if (dp->posted) { /* most of it went out during the backward pass: only the wait is exposed */
      dp->posted = 0;
      DT_CHECK(drain(dp));
    } else {
      TIMED_CHECK(dp, dt_comm_all_reduce(dp->comm, dp->m->grads_flat, (size_t)dp->P, DT_COMM_AVG));
    }
  }
  return dp->emb ? sum_tied(dp, dp->m->grads.wte) : 0;
}

/* Sums a double across a communicator's ranks exactly enough for a norm: as a float pair
 * (hi, lo). */
static int sum_double(dt_dp_t *dp, dt_comm_t *comm, double *x)
{
  if (!comm || dt_comm_world(comm) == 1)
    return 0;
  float pair[2];
  pair[0] = (float)*x;
  pair[1] = (float)(*x - (double)pair[0]);
  DT_CHECK(drain(dp));
  TIMED_CHECK(dp, dt_comm_all_reduce(comm, pair, 2, DT_COMM_SUM));
  *x = (double)pair[0] + (double)pair[1];
  return 0;
}

int dt_dp_grad_norm(dt_dp_t *dp, float *norm)
{
  double ss;
  if (dp->stage < 2) { /* every rank holds the whole reduced local gradient */
    DT_CHECK(dt_gpt2_sumsq(dp->m, dp->m->grads_flat, 0, dp->P, &ss));
  } else {
    DT_CHECK(dt_gpt2_sumsq(dp->m, dp->g_shard, dp->lo, dp->hi, &ss));
    DT_CHECK(sum_double(dp, collective(dp) ? dp->comm : NULL, &ss));
  }
  DT_CHECK(sum_double(dp, dp->mp, &ss));
  *norm = (float)sqrt(ss);
  return 0;
}

int dt_dp_step(dt_dp_t *dp, const dt_adamw_t *h, float grad_scale, int t)
{
  dt_gpt2_t *m = dp->m;
  DT_CHECK(drain(dp));
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
    DT_CHECK(m->ops->adamw_update(
        m->dev, params + a, NULL, grads + a, dp->m_shard + (a - dp->lo), dp->v_shard + (a - dp->lo),
        (size_t)(b - a), h->lr, h->beta1, h->beta2, h->eps,
        dt_gpt2_tensor_decays(k) ? h->weight_decay : 0.0f, grad_scale, t));
  }
  invalidate_slots(dp);
  dt_gpt2_params_written(m); /* the other ranks' ranges arrive below */
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

static int reduce(dt_dp_t *dp, float *x, size_t n, dt_comm_op_t op)
{
  if (!collective(dp))
    return 0;
  DT_CHECK(drain(dp));
  return dt_comm_all_reduce(dp->comm, x, n, op);
}

int dt_dp_average(dt_dp_t *dp, float *x)
{
  return reduce(dp, x, 1, DT_COMM_AVG);
}

int dt_dp_sum(dt_dp_t *dp, float *x, size_t n)
{
  return reduce(dp, x, n, DT_COMM_SUM);
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

/* Loads local range [lo, hi) of the parameters and/or moments from a checkpoint of any layout:
 * the range's runs in the global layout are what is read. */
static int load_local(dt_dp_t *dp, const char *path, int64_t lo, int64_t hi, float *params,
                      float *m, float *v, dt_train_state_t *state)
{
  const dt_gpt2_t *model = dp->m;
  dt_device_t *dev = dp->dev;
  const size_t len = (size_t)(hi - lo);
  float *dst[3] = {params, m, v}, *host[3] = {params, m, v};
  dt_gpt2_run_t *runs;
  size_t n;
  int rc = 0;
  /* A device that is not host memory: read into host buffers, then copy them over. */
  for (int k = 0; k < 3 && !dev->host; k++)
    if (dst[k] && !(host[k] = dt_calloc_aligned(len * sizeof(float), "checkpoint staging")))
      rc = DT_ENOMEM;
  if (rc == 0)
    rc = dt_gpt2_runs(model, model->tp.rank, lo, hi, 0, &runs, &n);
  if (rc == 0) {
    rc = dt_ckpt_load_runs(path, &model->cfg, (int64_t)model->global_params, runs, n, host[0],
                           host[1], host[2], state);
    free(runs);
  }
  for (int k = 0; k < 3 && !dev->host; k++) {
    if (rc == 0 && dst[k])
      rc = dev->copy(dev, dst[k], host[k], len * sizeof(float), DT_COPY_H2D);
    dt_free_aligned(host[k]);
  }
  return rc;
}

int dt_dp_load(dt_dp_t *dp, const char *path, dt_train_state_t *state)
{
  dt_gpt2_t *m = dp->m;
  DT_CHECK(drain(dp));
  invalidate_slots(dp);
  dt_gpt2_params_written(m);
  switch (dp->stage) {
  case 0:
    return load_local(dp, path, 0, dp->P, m->params_flat, m->m_flat, m->v_flat, state);
  case 1:
  case 2:
    DT_CHECK(load_local(dp, path, 0, dp->P, m->params_flat, NULL, NULL, state));
    return load_local(dp, path, dp->lo, dp->hi, NULL, dp->m_shard, dp->v_shard, state);
  default:
    return load_local(dp, path, dp->lo, dp->hi, dp->p_shard, dp->m_shard, dp->v_shard, state);
  }
}

int dt_dp_gather_params(dt_dp_t *dp, float *out)
{
  if (dp->stage < 3)
    return dp->dev->copy(dp->dev, out, dp->m->params_flat, (size_t)dp->P * sizeof(float),
                         DT_COPY_D2H);
  if (!collective(dp))
    return dp->dev->copy(dp->dev, out, dp->p_shard, dp->n * sizeof(float), DT_COPY_D2H);
  DT_CHECK(drain(dp));
  return dt_comm_all_gather_v(dp->comm, dp->p_shard, out, dp->counts);
}
