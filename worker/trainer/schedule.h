/* schedule.h — pipeline schedules: the order in which one stage runs the forward and backward
 * passes of a step's micro-batches, and the point-to-point transfers around them.
 *
 * A pipeline of p stages (ranks) runs p * v virtual stages: with v model chunks per rank
 * (interleaving), rank s holds virtual stages s, s + p, ..., s + (v - 1) p as its chunks
 * 0..v-1; without it (v = 1) one. Activations flow from virtual stage k to k + 1, so from rank
 * s to rank (s + 1) % p (the last rank's chunk c feeds the first rank's chunk c + 1), and
 * gradients back.
 *
 * A schedule is a list of ops for stage s: forward or backward of (chunk, micro-batch), and
 * transfers. A transfer posts up to four halves at once (send an activation, receive one,
 * send a gradient, receive one; dt_comm_p2p) and waits for all of them, so that exchanges with
 * both neighbours in one step cannot deadlock; halves that would cross the ends of the
 * pipeline (the first virtual stage's input, the last one's output) are never listed. (The
 * trainer waits there for the sends only and for each receive just before the op that reads
 * it, pipeline.c: that moves no buffer's write earlier and no wait earlier, so what holds for
 * the schedule as listed holds for it.)
 *   GPipe: all forwards, then all backwards (m activation slots per stage).
 *   1F1B (PipeDream-flush): min(p - s - 1, m) warm-up forwards, then one forward and one
 *   backward alternately, then the remaining backwards (at most p - s slots).
 *   Interleaved 1F1B (Megatron-LM's virtual pipeline): the same over the p * v virtual stages,
 *   micro-batches taken in groups of p through each chunk in turn; m must be a multiple of p.
 *   The bubble shrinks to (p - 1) / (v m + p - 1).
 * Each chunk runs its backwards in micro-batch order, so every parameter's gradients
 * accumulate in the order of one process's gradient accumulation (exact results). */
#ifndef DT_TRAINER_SCHEDULE_H
#define DT_TRAINER_SCHEDULE_H

#include <stddef.h>

#define DT_PIPE_MAX_CHUNKS 16 /* model chunks per stage (virtual stages / p) */

typedef enum { DT_PIPE_GPIPE = 0, DT_PIPE_1F1B = 1, DT_PIPE_INTERLEAVED = 2 } dt_pipe_kind_t;

typedef enum { DT_PIPE_FWD, DT_PIPE_BWD, DT_PIPE_XFER } dt_pipe_op_kind_t;

/* The halves of a transfer, in the order every stage posts them (a backend that pairs the
 * messages between two ranks by order alone then matches them too). Activations go to rank
 * (s + 1) % p and come from (s - 1) % p; gradients the other way. */
enum {
  DT_PIPE_SEND_ACT,  /* the chunk's output to the next virtual stage */
  DT_PIPE_RECV_ACT,  /* the chunk's input from the previous one */
  DT_PIPE_SEND_GRAD, /* the gradient of the chunk's input to the previous one */
  DT_PIPE_RECV_GRAD, /* the gradient of the chunk's output from the next one */
  DT_PIPE_HALVES
};

typedef struct {
  int chunk, mb; /* mb < 0: none */
} dt_pipe_ref_t;

typedef struct {
  dt_pipe_op_kind_t op;
  dt_pipe_ref_t ref;                  /* DT_PIPE_FWD, DT_PIPE_BWD */
  dt_pipe_ref_t half[DT_PIPE_HALVES]; /* DT_PIPE_XFER: the halves it posts */
} dt_pipe_op_t;

/* "gpipe", "1f1b" or "interleaved" into *kind; DT_EINVAL otherwise. */
int dt_pipe_parse(const char *name, dt_pipe_kind_t *kind);
const char *dt_pipe_name(dt_pipe_kind_t kind);
/* Whether p stages with v chunks each can run m micro-batches by kind; one-line reason. */
int dt_pipe_check(dt_pipe_kind_t kind, int p, int v, int m, char *why, size_t whylen);
/* Room dt_pipe_schedule needs for m micro-batches and v chunks. */
int dt_pipe_max_ops(int m, int v);
/* Stage s's ops into ops (room for dt_pipe_max_ops); returns their count. The arguments must
 * pass dt_pipe_check. */
int dt_pipe_schedule(dt_pipe_kind_t kind, int p, int s, int m, int v, dt_pipe_op_t *ops);
/* Activation slots chunk needs under a stage's ops: micro-batches in flight at once, each from
 * its first op (an input received or its forward) to its backward. Micro-batch i of the chunk
 * uses slot i % slots: a chunk's micro-batches start and finish in order. */
int dt_pipe_slots(const dt_pipe_op_t *ops, int n, int chunk);
/* The bubble of the schedule on a balanced pipeline: (p - 1) / (v m + p - 1). */
double dt_pipe_ideal_bubble(int p, int m, int v);

#endif
