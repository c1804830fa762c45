/* pipeline.c — see pipeline.h. Micro-batch i uses activation slot i % (the model's slots). */
#include "pipeline.h"

#include <stdlib.h>

#include "dt_log.h"
#include "dt_util.h"

struct dt_pipeline {
  dt_comm_t *comm;
  int p, s, m;
  dt_pipe_op_t *ops; /* this stage's schedule of one step */
  int nops;
  double busy_ms, idle_ms;
  int warm; /* a step has run */
};

int dt_pipeline_create(dt_pipeline_t **out, dt_pipe_kind_t kind, int p, int s, int m,
                       dt_comm_t *comm)
{
  dt_pipeline_t *pl = calloc(1, sizeof *pl);
  if (!pl || !(pl->ops = calloc(6 * (size_t)m, sizeof *pl->ops))) {
    free(pl);
    return DT_ENOMEM;
  }
  pl->comm = comm;
  pl->p = p, pl->s = s, pl->m = m;
  pl->nops = dt_pipe_schedule(kind, p, s, m, pl->ops);
  *out = pl;
  return 0;
}

void dt_pipeline_destroy(dt_pipeline_t *pl)
{
  if (!pl)
    return;
  free(pl->ops);
  free(pl);
}

/* Runs one op; compute time is busy, transfers idle. */
static int run_op(dt_pipeline_t *pl, const dt_pipe_op_t *op, dt_gpt2_t *m, dt_dp_t *dp,
                  const int *inputs, const int *targets, int B, int T, double *loss_sum)
{
  const size_t BT = (size_t)B * T;
  const size_t bytes = dt_gpt2_stage_io_floats(m, B, T) * sizeof(float);
  const int first = m->stage.first, last = m->stage.last, prev = pl->s - 1, next = pl->s + 1;
  const int slot = op->mb % m->nslots, slot2 = op->mb2 >= 0 ? op->mb2 % m->nslots : 0;
  dt_comm_t *c = pl->comm;
  const double t0 = dt_now_ms();
  int rc = 0;
  float loss = 0.0f;
  switch (op->op) {
  case DT_PIPE_FWD:
    dt_dp_begin_micro(dp, op->mb == pl->m - 1);
    rc = dt_gpt2_stage_forward(m, slot, inputs + op->mb * BT, targets + op->mb * BT, B, T,
                               1.0f / (float)pl->m, &loss);
    *loss_sum += last ? loss : 0.0f;
    break;
  case DT_PIPE_BWD:
    dt_dp_begin_micro(dp, op->mb == pl->m - 1);
    rc = dt_gpt2_stage_backward(m, slot, inputs + op->mb * BT, B, T);
    break;
  case DT_PIPE_RECV_FWD:
    rc = first ? 0 : dt_comm_recv(c, dt_gpt2_stage_input(m, slot), bytes, prev, 0);
    break;
  case DT_PIPE_SEND_FWD:
    rc = last ? 0 : dt_comm_send(c, dt_gpt2_stage_output(m, slot), bytes, next, 0);
    break;
  case DT_PIPE_RECV_BWD:
    rc = last ? 0 : dt_comm_recv(c, dt_gpt2_stage_grad(m, slot), bytes, next, 0);
    break;
  case DT_PIPE_SEND_BWD:
    rc = first ? 0 : dt_comm_send(c, dt_gpt2_stage_grad(m, slot), bytes, prev, 0);
    break;
  case DT_PIPE_SEND_FWD_RECV_BWD:
    rc = last ? 0
              : dt_comm_sendrecv(c, dt_gpt2_stage_output(m, slot), bytes, next,
                                 dt_gpt2_stage_grad(m, slot2), bytes, next, 0);
    break;
  case DT_PIPE_SEND_BWD_RECV_FWD:
    rc = first ? 0
               : dt_comm_sendrecv(c, dt_gpt2_stage_grad(m, slot), bytes, prev,
                                  dt_gpt2_stage_input(m, slot2), bytes, prev, 0);
    break;
  }
  const double ms = dt_now_ms() - t0;
  if (op->op == DT_PIPE_FWD || op->op == DT_PIPE_BWD)
    pl->busy_ms += ms;
  else
    pl->idle_ms += ms;
  return rc;
}

int dt_pipeline_step(dt_pipeline_t *pl, dt_gpt2_t *m, dt_dp_t *dp, const int *inputs,
                     const int *targets, int B, int T, double *loss_sum, double *bubble)
{
  const double busy0 = pl->busy_ms, idle0 = pl->idle_ms;
  *loss_sum = 0.0;
  for (int i = 0; i < pl->nops; i++)
    DT_CHECK(run_op(pl, &pl->ops[i], m, dp, inputs, targets, B, T, loss_sum));
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
  *loss = 0.0f;
  if (!m->stage.first)
    DT_CHECK(dt_comm_recv(pl->comm, dt_gpt2_stage_input(m, 0), bytes, pl->s - 1, 0));
  DT_CHECK(dt_gpt2_stage_forward(m, 0, inputs, targets, B, T, 0.0f, loss));
  if (!m->stage.last)
    DT_CHECK(dt_comm_send(pl->comm, dt_gpt2_stage_output(m, 0), bytes, pl->s + 1, 0));
  return 0;
}

void dt_pipeline_times(const dt_pipeline_t *pl, double *busy_ms, double *idle_ms)
{
  *busy_ms = pl->busy_ms;
  *idle_ms = pl->idle_ms;
}
