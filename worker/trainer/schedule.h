/* schedule.h — pipeline schedules: the order in which one stage runs the forward and backward
 * passes of a step's micro-batches, and the point-to-point transfers around them.
 *
 * A schedule is a list of ops for stage s of p over m micro-batches; the trainer executes it
 * (receives into and sends from the model's activation slots: micro-batch i uses slot
 * i % dt_pipe_slots). Transfers are blocking and pair up in order per direction, so the
 * schedules combine a send with the receive the neighbour posts at the same moment (Megatron's
 * send_forward_recv_backward) wherever two stages would otherwise each wait for the other.
 *   GPipe: all forwards, then all backwards (m activation slots per stage).
 *   1F1B (PipeDream-flush): min(p - s - 1, m) warm-up forwards, then one forward and one
 *   backward alternately, then the remaining backwards (at most p - s slots).
 * Backwards run in micro-batch order on every stage, so gradients accumulate in the order of
 * one process's gradient accumulation. */
#ifndef DT_TRAINER_SCHEDULE_H
#define DT_TRAINER_SCHEDULE_H

typedef enum { DT_PIPE_GPIPE = 0, DT_PIPE_1F1B = 1 } dt_pipe_kind_t;

typedef enum {
  DT_PIPE_RECV_FWD,          /* input of mb from the previous stage (not on the first) */
  DT_PIPE_FWD,               /* forward of mb */
  DT_PIPE_SEND_FWD,          /* output of mb to the next stage (not on the last) */
  DT_PIPE_SEND_FWD_RECV_BWD, /* output of mb to the next stage, gradient of mb2 from it */
  DT_PIPE_BWD,               /* backward of mb */
  DT_PIPE_SEND_BWD,          /* input gradient of mb to the previous stage (not on the first) */
  DT_PIPE_SEND_BWD_RECV_FWD, /* input gradient of mb to the previous stage, input of mb2 */
  DT_PIPE_RECV_BWD,          /* gradient of mb from the next stage (not on the last) */
} dt_pipe_op_kind_t;

typedef struct {
  dt_pipe_op_kind_t op;
  int mb, mb2;
} dt_pipe_op_t;

/* "gpipe" or "1f1b" into *kind; DT_EINVAL otherwise. */
int dt_pipe_parse(const char *name, dt_pipe_kind_t *kind);
const char *dt_pipe_name(dt_pipe_kind_t kind);
/* Activation slots stage s needs: micro-batches in flight at once. */
int dt_pipe_slots(dt_pipe_kind_t kind, int p, int s, int m);
/* Stage s's ops into ops (room for 6 * m); returns their count. */
int dt_pipe_schedule(dt_pipe_kind_t kind, int p, int s, int m, dt_pipe_op_t *ops);
/* The bubble of the schedule on a balanced pipeline: (p - 1) / (m + p - 1). */
double dt_pipe_ideal_bubble(int p, int m);

#endif
