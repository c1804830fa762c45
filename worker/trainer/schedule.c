/* schedule.c — see schedule.h. */
#include "schedule.h"

#include <string.h>

#include "dt_error.h"

int dt_pipe_parse(const char *name, dt_pipe_kind_t *kind)
{
  if (strcmp(name, "gpipe") == 0)
    *kind = DT_PIPE_GPIPE;
  else if (strcmp(name, "1f1b") == 0)
    *kind = DT_PIPE_1F1B;
  else
    return DT_EINVAL;
  return 0;
}

const char *dt_pipe_name(dt_pipe_kind_t kind)
{
  return kind == DT_PIPE_GPIPE ? "gpipe" : "1f1b";
}

static int warmup(int p, int s, int m)
{
  return p - s - 1 < m ? p - s - 1 : m;
}

int dt_pipe_slots(dt_pipe_kind_t kind, int p, int s, int m)
{
  if (kind == DT_PIPE_GPIPE)
    return m;
  return warmup(p, s, m) + 1 < m ? warmup(p, s, m) + 1 : m;
}

int dt_pipe_schedule(dt_pipe_kind_t kind, int p, int s, int m, dt_pipe_op_t *ops)
{
  int n = 0;
#define OP(kind_, mb_, mb2_) (ops[n++] = (dt_pipe_op_t){.op = (kind_), .mb = (mb_), .mb2 = (mb2_)})
  if (kind == DT_PIPE_GPIPE) {
    for (int i = 0; i < m; i++) {
      OP(DT_PIPE_RECV_FWD, i, -1);
      OP(DT_PIPE_FWD, i, -1);
      OP(DT_PIPE_SEND_FWD, i, -1);
    }
    for (int i = 0; i < m; i++) {
      OP(DT_PIPE_RECV_BWD, i, -1);
      OP(DT_PIPE_BWD, i, -1);
      OP(DT_PIPE_SEND_BWD, i, -1);
    }
    return n;
  }
  /* 1F1B, as Megatron-LM's schedule without interleaving. */
  const int w = warmup(p, s, m), r = m - w;
  for (int i = 0; i < w; i++) {
    OP(DT_PIPE_RECV_FWD, i, -1);
    OP(DT_PIPE_FWD, i, -1);
    OP(DT_PIPE_SEND_FWD, i, -1);
  }
  if (r > 0)
    OP(DT_PIPE_RECV_FWD, w, -1);
  for (int i = 0; i < r; i++) {
    OP(DT_PIPE_FWD, w + i, -1);
    OP(DT_PIPE_SEND_FWD_RECV_BWD, w + i, i);
    OP(DT_PIPE_BWD, i, -1);
    if (i == r - 1)
      OP(DT_PIPE_SEND_BWD, i, -1);
    else
      OP(DT_PIPE_SEND_BWD_RECV_FWD, i, w + i + 1);
  }
  for (int i = r; i < m; i++) {
    OP(DT_PIPE_RECV_BWD, i, -1);
    OP(DT_PIPE_BWD, i, -1);
    OP(DT_PIPE_SEND_BWD, i, -1);
  }
#undef OP
  return n;
}

double dt_pipe_ideal_bubble(int p, int m)
{
  return (double)(p - 1) / (double)(m + p - 1);
}
