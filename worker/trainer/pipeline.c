/* pipeline.c — see pipeline.h. Micro-batch i of chunk c uses the chunk's activation slot
 * i % (its slots). */
#include "pipeline.h"

#include <stdlib.h>
#include <string.h>

#include "dt_log.h"
#include "dt_util.h"

/* A receive a transfer left in flight (dt_comm_p2p_post), completed before the op that reads
 * it: the forward of ref for an activation, its backward for a gradient. */
typedef struct {
  dt_comm_pending_t *req;
  int half; /* DT_PIPE_RECV_ACT or DT_PIPE_RECV_GRAD */
  dt_pipe_ref_t ref;
} pending_t;

struct dt_pipeline {
  dt_comm_t *comm;
  int p, s, m, v;
  dt_pipe_op_t *ops; /* this stage's schedule of one step */
  int nops;
  pending_t *pending; /* receives in flight (at most two a transfer) */
  int npending;
  double busy_ms, idle_ms;
  int warm; /* a step has run */
};

int dt_pipeline_create(dt_pipeline_t **out, dt_pipe_kind_t kind, int p, int s, int m, int v,
                       dt_comm_t *comm)
{
  dt_pipeline_t *pl = calloc(1, sizeof *pl);
  const size_t nmax = (size_t)dt_pipe_max_ops(m, v);
  if (!pl || !(pl->ops = calloc(nmax, sizeof *pl->ops)) ||
      !(pl->pending = calloc(2 * nmax, sizeof *pl->pending))) {
    if (pl)
      free(pl->ops);
    free(pl);
    return DT_ENOMEM;
  }
  pl->comm = comm;
  pl->p = p, pl->s = s, pl->m = m, pl->v = v;
  pl->nops = dt_pipe_schedule(kind, p, s, m, v, pl->ops);
  *out = pl;
  return 0;
}

void dt_pipeline_destroy(dt_pipeline_t *pl)
{
  if (!pl)
    return;
  free(pl->ops);
  free(pl->pending);
  free(pl);
}

int dt_pipeline_slots(const dt_pipeline_t *pl, int *slots)
{
  for (int c = 0; c < pl->v; c++)
    slots[c] = dt_pipe_slots(pl->ops, pl->nops, c);
  return pl->v;
}

/* Logs a failed exchange with stages a and c (the same stage, or both neighbours); canceled:
 * whoever aborted it says why. */
static void transfer_failed(const dt_pipeline_t *pl, int a, int c, int rc)
{
  if (rc >= 0 || rc == DT_ECANCELED)
    return;
  if (a == c)
    DT_ERROR(TRAIN, "pipeline stage %d of %d: the transfer with stage %d failed: %s", pl->s, pl->p,
             a, dt_strerror(rc));
  else
    DT_ERROR(TRAIN, "pipeline stage %d of %d: the transfer with stages %d and %d failed: %s", pl->s,
             pl->p, a, c, dt_strerror(rc));
}

/* A transfer's halves as one batch: activations on tag 0 to the next rank (from the
 * previous), gradients on tag 1 to the previous (from the next). It returns once the sends
 * are done; the receives stay in flight (pl->pending) until the ops that read them. */
static int transfer(dt_pipeline_t *pl, const dt_pipe_op_t *op, dt_gpt2_t *m, size_t bytes)
{
  const int next = (pl->s + 1) % pl->p, prev = (pl->s + pl->p - 1) % pl->p;
  dt_comm_p2p_t b[DT_PIPE_HALVES];
  dt_comm_pending_t *req[DT_PIPE_HALVES];
  int n = 0, half[DT_PIPE_HALVES];
  for (int h = 0; h < DT_PIPE_HALVES; h++) {
    const dt_pipe_ref_t r = op->half[h];
    if (r.mb < 0)
      continue;
    const int slot = r.mb % m->nslots[r.chunk];
    half[n] = h;
    switch (h) {
    case DT_PIPE_SEND_ACT:
      b[n++] = (dt_comm_p2p_t){(void *)dt_gpt2_stage_output(m, r.chunk, slot), bytes, next, 0, 0};
      break;
    case DT_PIPE_RECV_ACT:
      b[n++] = (dt_comm_p2p_t){dt_gpt2_stage_input(m, r.chunk, slot), bytes, prev, 0, 1};
      break;
    case DT_PIPE_SEND_GRAD:
      b[n++] = (dt_comm_p2p_t){dt_gpt2_stage_grad(m, r.chunk, slot), bytes, prev, 1, 0};
      break;
    default:
      b[n++] = (dt_comm_p2p_t){dt_gpt2_stage_grad(m, r.chunk, slot), bytes, next, 1, 1};
      break;
    }
  }
  const int rc = dt_comm_p2p_post(pl->comm, b, n, req);
  int a = n > 0 ? b[0].peer : 0, c = a; /* the batch's peers: next, prev or both */
  for (int i = 1; i < n; i++)
    c = b[i].peer != a ? b[i].peer : c;
  transfer_failed(pl, a, c, rc);
  for (int i = 0; i < n && rc == 0; i++)
    if (req[i])
      pl->pending[pl->npending++] = (pending_t){req[i], half[i], op->half[half[i]]};
  return rc;
}

/* Completes the receive in flight into (half, ref), if any. */
static int await(dt_pipeline_t *pl, int half, dt_pipe_ref_t ref)
{
  for (int i = 0; i < pl->npending; i++) {
    const pending_t q = pl->pending[i];
    if (q.half != half || q.ref.chunk != ref.chunk || q.ref.mb != ref.mb)
      continue;
    pl->pending[i] = pl->pending[--pl->npending];
    const double t0 = dt_now_ms();
    const int rc = dt_comm_p2p_wait(pl->comm, q.req);
    const double ms = dt_now_ms() - t0;
    pl->idle_ms += ms;
    DT_TRACE(TRAIN, "pipeline stage %d: wait for %s chunk %d mb %d at %.3f for %.3f ms", pl->s,
             half == DT_PIPE_RECV_ACT ? "act" : "grad", ref.chunk, ref.mb, t0, ms);
    const int peer = half == DT_PIPE_RECV_ACT ? (pl->s + pl->p - 1) % pl->p : (pl->s + 1) % pl->p;
    transfer_failed(pl, peer, peer, rc);
    return rc;
  }
  return 0;
}

/* Runs one op; compute time is busy, transfers and waits for receives idle. At DISTRAIN_DEBUG=trace
 * each op is logged with its start on the host's monotonic clock (dt_now_ms), so that the logs of
 * stages on one host merge into one timeline. */
static int run_op(dt_pipeline_t *pl, const dt_pipe_op_t *op, dt_gpt2_t *m, dt_dp_t *dp,
                  const int *inputs, const int *targets, int B, int T, double *loss_sum,
                  float *token_losses)
{
  const size_t BT = (size_t)B * T;
  const int mb = op->ref.mb, chunk = op->ref.chunk;
  int rc = 0;
  float loss = 0.0f;
  if (op->op != DT_PIPE_XFER)
    DT_CHECK(await(pl, op->op == DT_PIPE_FWD ? DT_PIPE_RECV_ACT : DT_PIPE_RECV_GRAD, op->ref));
  const double t0 = dt_now_ms();
  switch (op->op) {
  case DT_PIPE_FWD:
    dt_dp_begin_micro(dp, mb == pl->m - 1);
    rc = dt_gpt2_stage_forward(m, chunk, mb % m->nslots[chunk], inputs + mb * BT, targets + mb * BT,
                               B, T, 1.0f / (float)pl->m, &loss);
    if (rc == 0 && m->stage.last && chunk == m->stage.chunks - 1) {
      *loss_sum += loss;
      if (token_losses)
        memcpy(token_losses + mb * BT, dt_gpt2_last_losses(m), BT * sizeof(float));
    }
    break;
  case DT_PIPE_BWD:
    dt_dp_begin_micro(dp, mb == pl->m - 1);
    rc = dt_gpt2_stage_backward(m, chunk, mb % m->nslots[chunk], inputs + mb * BT, B, T);
    break;
  case DT_PIPE_XFER:
    rc = transfer(pl, op, m, dt_gpt2_stage_io_floats(m, B, T) * sizeof(float));
    break;
  }
  const double ms = dt_now_ms() - t0;
  if (op->op == DT_PIPE_XFER) {
    pl->idle_ms += ms;
    DT_TRACE(TRAIN,
             "pipeline stage %d: xfer (send act %d, recv act %d, send grad %d, recv grad %d) at "
             "%.3f for %.3f ms",
             pl->s, op->half[DT_PIPE_SEND_ACT].mb, op->half[DT_PIPE_RECV_ACT].mb,
             op->half[DT_PIPE_SEND_GRAD].mb, op->half[DT_PIPE_RECV_GRAD].mb, t0, ms);
  } else {
    pl->busy_ms += ms;
    DT_TRACE(TRAIN, "pipeline stage %d: %s chunk %d mb %d at %.3f for %.3f ms", pl->s,
             op->op == DT_PIPE_FWD ? "fwd" : "bwd", chunk, mb, t0, ms);
  }
  return rc;
}

int dt_pipeline_step(dt_pipeline_t *pl, dt_gpt2_t *m, dt_dp_t *dp, const int *inputs,
                     const int *targets, int B, int T, double *loss_sum, float *token_losses,
                     double *bubble)
{
  const double busy0 = pl->busy_ms, idle0 = pl->idle_ms;
  *loss_sum = 0.0;
  int rc = 0;
  for (int i = 0; i < pl->nops && rc == 0; i++)
    rc = run_op(pl, &pl->ops[i], m, dp, inputs, targets, B, T, loss_sum, token_losses);
  while (rc == 0 && pl->npending > 0) /* none: every receive is read within the step */
    rc = await(pl, pl->pending[0].half, pl->pending[0].ref);
  if (rc != 0) { /* what is still in flight is the communicator's to drop */
    pl->npending = 0;
    return rc;
  }
  const double busy = pl->busy_ms - busy0, idle = pl->idle_ms - idle0;
  *bubble = busy + idle > 0 ? idle / (busy + idle) : 0.0;
  if (!pl->warm) {
    pl->busy_ms = pl->idle_ms = 0.0;
    pl->warm = 1;
  }
  return 0;
}

int dt_pipeline_eval(dt_pipeline_t *pl, dt_gpt2_t *m, const int *inputs, const int *targets, int B,
                     int T, float *loss)
{
  const size_t bytes = dt_gpt2_stage_io_floats(m, B, T) * sizeof(float);
  const int next = (pl->s + 1) % pl->p, prev = (pl->s + pl->p - 1) % pl->p;
  *loss = 0.0f;
  for (int c = 0; c < pl->v; c++) { /* virtual stage c p + s */
    const int first = pl->s == 0 && c == 0, last = pl->s == pl->p - 1 && c == pl->v - 1;
    if (!first)
      DT_CHECK(dt_comm_recv(pl->comm, dt_gpt2_stage_input(m, c, 0), bytes, prev, 0));
    DT_CHECK(dt_gpt2_stage_forward(m, c, 0, inputs, targets, B, T, 0.0f, loss));
    if (!last)
      DT_CHECK(dt_comm_send(pl->comm, dt_gpt2_stage_output(m, c, 0), bytes, next, 0));
  }
  return 0;
}

void dt_pipeline_times(const dt_pipeline_t *pl, double *busy_ms, double *idle_ms)
{
  *busy_ms = pl->busy_ms;
  *idle_ms = pl->idle_ms;
}
