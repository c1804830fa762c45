/* schedule.c — see schedule.h. */
#include "schedule.h"

#include <stdio.h>
#include <string.h>

#include "dt_error.h"

static const char *const g_names[] = {"gpipe", "1f1b", "interleaved"};

int dt_pipe_parse(const char *name, dt_pipe_kind_t *kind)
{
  for (int k = 0; k < 3; k++)
    if (strcmp(name, g_names[k]) == 0) {
      *kind = (dt_pipe_kind_t)k;
      return 0;
    }
  return DT_EINVAL;
}

const char *dt_pipe_name(dt_pipe_kind_t kind)
{
  return kind >= DT_PIPE_GPIPE && kind <= DT_PIPE_INTERLEAVED ? g_names[kind] : "?";
}

int dt_pipe_check(dt_pipe_kind_t kind, int p, int v, int m, char *why, size_t whylen)
{
  if (p < 1 || v < 1 || m < 1) {
    snprintf(why, whylen, "pipeline: %d stages, %d chunks each, %d micro-batches: all must be >= 1",
             p, v, m);
    return DT_EINVAL;
  }
  if (kind != DT_PIPE_INTERLEAVED && v != 1) {
    snprintf(why, whylen,
             "parallel.virtual_stages (%d) > 1 needs parallel.schedule interleaved (got %s)", v,
             dt_pipe_name(kind));
    return DT_EINVAL;
  }
  if (v > DT_PIPE_MAX_CHUNKS) {
    snprintf(why, whylen, "parallel.virtual_stages (%d): at most %d", v, DT_PIPE_MAX_CHUNKS);
    return DT_EINVAL;
  }
  if (kind == DT_PIPE_INTERLEAVED && (p < 2 || v < 2)) {
    snprintf(why, whylen,
             "parallel.schedule interleaved needs parallel.pp >= 2 (got %d) and "
             "parallel.virtual_stages >= 2 (got %d)",
             p, v);
    return DT_EINVAL;
  }
  if (kind == DT_PIPE_INTERLEAVED && m % p != 0) {
    snprintf(why, whylen,
             "parallel.schedule interleaved: the micro-batches per step (%d, the gradient "
             "accumulation) must be a multiple of parallel.pp (%d)",
             m, p);
    return DT_EINVAL;
  }
  return 0;
}

int dt_pipe_max_ops(int m, int v)
{
  return 6 * m * v + 2;
}

typedef struct {
  dt_pipe_op_t *ops;
  int n;
} out_t;

static const dt_pipe_ref_t NONE = {0, -1};

static void compute(out_t *o, dt_pipe_op_kind_t kind, int chunk, int mb)
{
  o->ops[o->n++] = (dt_pipe_op_t){.op = kind, .ref = {chunk, mb}};
}

/* A transfer of the halves given (NONE: absent); nothing when all are absent. */
static void xfer(out_t *o, dt_pipe_ref_t send_act, dt_pipe_ref_t recv_act, dt_pipe_ref_t send_grad,
                 dt_pipe_ref_t recv_grad)
{
  if (send_act.mb < 0 && recv_act.mb < 0 && send_grad.mb < 0 && recv_grad.mb < 0)
    return;
  o->ops[o->n++] = (dt_pipe_op_t){
      .op = DT_PIPE_XFER, .ref = NONE, .half = {send_act, recv_act, send_grad, recv_grad}};
}

static dt_pipe_ref_t ref(int present, int mb)
{
  return present ? (dt_pipe_ref_t){0, mb} : NONE;
}

/* GPipe and 1F1B: one chunk. The first stage receives no activations, the last no gradients. */
static void flat(out_t *o, dt_pipe_kind_t kind, int p, int s, int m)
{
  const int first = s == 0, last = s == p - 1;
  if (kind == DT_PIPE_GPIPE) {
    for (int i = 0; i < m; i++) {
      xfer(o, NONE, ref(!first, i), NONE, NONE);
      compute(o, DT_PIPE_FWD, 0, i);
      xfer(o, ref(!last, i), NONE, NONE, NONE);
    }
    for (int i = 0; i < m; i++) {
      xfer(o, NONE, NONE, NONE, ref(!last, i));
      compute(o, DT_PIPE_BWD, 0, i);
      xfer(o, NONE, NONE, ref(!first, i), NONE);
    }
    return;
  }
  /* 1F1B, as Megatron-LM's schedule without interleaving: each steady-state transfer pairs a
   * send with the receive the neighbour posts at the same moment. */
  const int w = p - s - 1 < m ? p - s - 1 : m, r = m - w;
  for (int i = 0; i < w; i++) {
    xfer(o, NONE, ref(!first, i), NONE, NONE);
    compute(o, DT_PIPE_FWD, 0, i);
    xfer(o, ref(!last, i), NONE, NONE, NONE);
  }
  if (r > 0)
    xfer(o, NONE, ref(!first, w), NONE, NONE);
  for (int i = 0; i < r; i++) {
    compute(o, DT_PIPE_FWD, 0, w + i);
    xfer(o, ref(!last, w + i), NONE, NONE, ref(!last, i));
    compute(o, DT_PIPE_BWD, 0, i);
    xfer(o, NONE, ref(!first && i < r - 1, w + i + 1), ref(!first, i), NONE);
  }
  for (int i = r; i < m; i++) {
    xfer(o, NONE, NONE, NONE, ref(!last, i));
    compute(o, DT_PIPE_BWD, 0, i);
    xfer(o, NONE, NONE, ref(!first, i), NONE);
  }
}

/* Interleaved 1F1B, after Megatron-LM's forward_backward_pipelining_with_interleaving: virtual
 * step k (of v m) is the forward (or backward) of micro-batch mb_of(k) in chunk chunk_of(k);
 * micro-batches go through the chunks in groups of p. Every step ends in one transfer with
 * both neighbours; what it receives is for the chunk the neighbour's step fed. */
typedef struct {
  int p, s, m, v;
  int got_act[DT_PIPE_MAX_CHUNKS],
      got_grad[DT_PIPE_MAX_CHUNKS]; /* per chunk: inputs and output gradients received so far */
} il_t;

static int chunk_of(const il_t *t, int k, int forward)
{
  const int g = t->p * t->v, c = ((k % g) + g) % g / t->p;
  return forward ? c : t->v - 1 - c;
}

static int mb_of(const il_t *t, int k)
{
  return k / (t->p * t->v) * t->p + k % t->p;
}

/* A forward's output leaves unless it is the last virtual stage's; a backward's input gradient
 * unless it is the first's. */
static dt_pipe_ref_t out_act(const il_t *t, int c, int mb)
{
  return t->s == t->p - 1 && c == t->v - 1 ? NONE : (dt_pipe_ref_t){c, mb};
}

static dt_pipe_ref_t out_grad(const il_t *t, int c, int mb)
{
  return t->s == 0 && c == 0 ? NONE : (dt_pipe_ref_t){c, mb};
}

/* The next input of chunk c (its inputs arrive in micro-batch order), or NONE. */
static dt_pipe_ref_t in_act(il_t *t, int recv, int c)
{
  return recv ? (dt_pipe_ref_t){c, t->got_act[c]++} : NONE;
}

static dt_pipe_ref_t in_grad(il_t *t, int recv, int c)
{
  return recv ? (dt_pipe_ref_t){c, t->got_grad[c]++} : NONE;
}

static void interleaved(out_t *o, int p, int s, int m, int v)
{
  il_t t = {.p = p, .s = s, .m = m, .v = v};
  const int first = s == 0, last = s == p - 1, total = m * v;
  const int all_warmup = m == p;
  int warmup = all_warmup ? total : (p - s - 1) * 2 + (v - 1) * p;
  warmup = warmup < total ? warmup : total;
  const int remaining = total - warmup;

  xfer(o, NONE, in_act(&t, !first, 0), NONE, NONE);
  for (int k = 0; k < warmup; k++) {
    const int c = chunk_of(&t, k, 1), mb = mb_of(&t, k), nc = chunk_of(&t, k + 1, 1);
    compute(o, DT_PIPE_FWD, c, mb);
    const int recv_prev = !(first && nc == 0) && k != total - 1;
    const dt_pipe_ref_t ra = in_act(&t, recv_prev, nc);
    if (k == warmup - 1 && !all_warmup) /* the steady state's first gradient, too */
      xfer(o, out_act(&t, c, mb), ra, NONE, in_grad(&t, !last, v - 1));
    else
      xfer(o, out_act(&t, c, mb), ra, NONE, NONE);
  }
  for (int k = 0; k < remaining; k++) {
    const int fk = k + warmup;
    const int fc = chunk_of(&t, fk, 1), fmb = mb_of(&t, fk);
    const int bc = chunk_of(&t, k, 0), bmb = mb_of(&t, k);
    compute(o, DT_PIPE_FWD, fc, fmb);
    compute(o, DT_PIPE_BWD, bc, bmb);
    /* The first rank's input comes from the last rank's step p - 1 back (its chunk + 1);
     * the last rank's gradient from the first rank's (its chunk - 1). */
    int recv_prev = 1, next_fc, recv_next = 1, next_bc;
    if (first) {
      next_fc = chunk_of(&t, fk - (p - 1), 1);
      recv_prev = next_fc != v - 1;
      next_fc++;
    } else {
      next_fc = chunk_of(&t, fk + 1, 1);
    }
    if (last) {
      next_bc = chunk_of(&t, k - (p - 1), 0);
      recv_next = next_bc != 0;
      next_bc--;
    } else {
      next_bc = chunk_of(&t, k + 1, 0);
    }
    recv_prev = recv_prev && k != remaining - 1;
    const dt_pipe_ref_t ra = in_act(&t, recv_prev, next_fc);
    const dt_pipe_ref_t rg = in_grad(&t, recv_next, next_bc);
    xfer(o, out_act(&t, fc, fmb), ra, out_grad(&t, bc, bmb), rg);
  }
  if (all_warmup)
    xfer(o, NONE, NONE, NONE, in_grad(&t, !last, v - 1));
  for (int k = remaining; k < total; k++) {
    const int c = chunk_of(&t, k, 0), mb = mb_of(&t, k), nc = chunk_of(&t, k + 1, 0);
    compute(o, DT_PIPE_BWD, c, mb);
    const int recv_next = !(last && nc == v - 1) && k != total - 1;
    xfer(o, NONE, NONE, out_grad(&t, c, mb), in_grad(&t, recv_next, nc));
  }
}

int dt_pipe_schedule(dt_pipe_kind_t kind, int p, int s, int m, int v, dt_pipe_op_t *ops)
{
  out_t o = {ops, 0};
  if (kind == DT_PIPE_INTERLEAVED)
    interleaved(&o, p, s, m, v);
  else
    flat(&o, kind, p, s, m);
  return o.n;
}

/* Whether op refers to micro-batch mb of chunk (computes it or transfers its data). */
static int touches(const dt_pipe_op_t *op, int chunk, int mb)
{
  if (op->op != DT_PIPE_XFER)
    return op->ref.chunk == chunk && op->ref.mb == mb;
  for (int h = 0; h < DT_PIPE_HALVES; h++)
    if (op->half[h].chunk == chunk && op->half[h].mb == mb)
      return 1;
  return 0;
}

int dt_pipe_slots(const dt_pipe_op_t *ops, int n, int chunk)
{
  int peak = 1;
  /* Micro-batch mb is alive from its first op to its backward; chunks start and finish their
   * micro-batches in order, so the ones alive at an op are those started and not finished. */
  for (int i = 0, started = 0, finished = 0; i < n; i++) {
    while (touches(&ops[i], chunk, started))
      started++;
    const int alive = started - finished;
    peak = alive > peak ? alive : peak;
    if (ops[i].op == DT_PIPE_BWD && ops[i].ref.chunk == chunk)
      finished++;
  }
  return peak;
}

double dt_pipe_ideal_bubble(int p, int m, int v)
{
  return (double)(p - 1) / ((double)v * m + p - 1);
}
