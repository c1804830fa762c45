/* test_schedule.c — Check suite for worker/trainer/schedule: the GPipe, 1F1B and interleaved
 * op lists of every stage, run together in a simulation of the trainer's transfers (dt_comm_p2p:
 * a transfer posts all its halves, then completes when each receive has its message and each
 * send has been matched by a receive the peer posted). For p = 1..6 stages, m = 1..12
 * micro-batches and v = 2..4 chunks (interleaved, m a multiple of p) it checks that:
 *   - the stages never deadlock (the trainer, pipeline.c, waits for a receive only before the op
 *     that reads it: later than here, which can only remove waits, while a receive's buffer is
 *     claimed here when it is posted, the earliest its data can land);
 *   - the k-th activation (gradient) a stage receives is the (chunk, micro-batch) it expects;
 *   - between two ranks the messages are received in the order they were sent, whatever their
 *     kind (what NCCL, which pairs by order alone, needs);
 *   - every chunk runs each forward once and each backward once after it, in micro-batch order;
 *   - with dt_pipe_slots slots per chunk (micro-batch i in slot i % slots), no buffer is
 *     overwritten while it holds data still needed: a slot's input (until its backward), its
 *     activations (until the backward and the output's send), its gradient (until the input
 *     gradient's send). 1F1B needs at most p - s slots, GPipe m, an interleaved chunk 2p (its
 *     1/v of the layers: at most twice 1F1B's activation memory);
 *   - with a chunk's forward taking 1/v and its backward 2/v of a unit of time and transfers
 *     taking none, the first stage waits exactly (p - 1) / (v m + p - 1) of its time: the
 *     schedule achieves the textbook bubble (a transfer completes when its last partner
 *     has posted). */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "schedule.h"

#define MAXP   6
#define MAXM   12
#define MAXV   4
#define MAXOPS (6 * MAXM * MAXV + 2)
#define MAXMSG (MAXM * MAXV)

enum { ACT = 0, GRAD = 1 };          /* flows: activations go to s + 1, gradients to s - 1 */
enum { B_IN, B_ACTS, B_GRAD, NBUF }; /* a slot's buffers */

typedef struct {
  int p, m, v;
  dt_pipe_op_t ops[MAXP][MAXOPS];
  int nops[MAXP], pc[MAXP], posted[MAXP];
  /* per flow and sending stage: (chunk, mb) sent in order; how many the receiver took */
  dt_pipe_ref_t sent[2][MAXP][MAXMSG];
  int nsent[2][MAXP], taken[2][MAXP];
  int msg[MAXP][DT_PIPE_HALVES]; /* the current op's send halves: their message numbers */
  /* per directed pair (from, to): flows in send order and in receive order */
  int order_sent[MAXP][MAXP][2 * MAXMSG], nos[MAXP][MAXP];
  int order_recv[MAXP][MAXP][2 * MAXMSG], nor[MAXP][MAXP];
  int fwd[MAXP][MAXV][MAXM], bwd[MAXP][MAXV][MAXM], next_bwd[MAXP][MAXV];
  int slots[MAXP][MAXV];
  /* time: each stage's clock and busy time; when its current transfer was posted; when each
   * message was matched by its receive */
  double clock[MAXP], busy[MAXP], post_t[MAXP], sent_t[2][MAXP][MAXMSG], match_t[2][MAXP][MAXMSG];
  int owner[MAXP][MAXV][MAXM][NBUF]; /* per slot: the micro-batch whose data a buffer holds */
} sim_t;

static int peer(const sim_t *S, int s, int flow)
{
  return flow == ACT ? (s + 1) % S->p : (s - 1 + S->p) % S->p;
}

static int source(const sim_t *S, int s, int flow)
{
  return peer(S, s, 1 - flow);
}

/* The half's flow and direction. */
static int half_flow(int h)
{
  return h == DT_PIPE_SEND_ACT || h == DT_PIPE_RECV_ACT ? ACT : GRAD;
}

static int half_recv(int h)
{
  return h == DT_PIPE_RECV_ACT || h == DT_PIPE_RECV_GRAD;
}

/* Buffer b of (chunk, mb)'s slot on stage s: claims it for mb (must be free), uses it (must be
 * mb's), or frees it. */
static int *buf(sim_t *S, int s, dt_pipe_ref_t r, int b)
{
  return &S->owner[s][r.chunk][r.mb % S->slots[s][r.chunk]][b];
}

static void claim(sim_t *S, int s, dt_pipe_ref_t r, int b, const char *what)
{
  int *o = buf(S, s, r, b);
  ck_assert_msg(*o < 0, "p=%d m=%d v=%d stage %d: %s of chunk %d mb %d overwrites mb %d's", S->p,
                S->m, S->v, s, what, r.chunk, r.mb, *o);
  *o = r.mb;
}

static void use(sim_t *S, int s, dt_pipe_ref_t r, int b, const char *what)
{
  int *o = buf(S, s, r, b);
  ck_assert_msg(*o == r.mb, "p=%d m=%d v=%d stage %d: %s of chunk %d mb %d finds mb %d's data",
                S->p, S->m, S->v, s, what, r.chunk, r.mb, *o);
}

static void release(sim_t *S, int s, dt_pipe_ref_t r, int b)
{
  *buf(S, s, r, b) = -1;
}

/* Tries to finish stage s's current op; 1 if it did. */
static int step_stage(sim_t *S, int s)
{
  const dt_pipe_op_t *op = &S->ops[s][S->pc[s]];
  const int first_vs = 0, last_vs = S->p * S->v - 1;
  if (op->op == DT_PIPE_XFER) {
    if (!S->posted[s]) { /* post the sends: the receivers may take them from now on */
      for (int h = 0; h < DT_PIPE_HALVES; h++) {
        if (op->half[h].mb < 0 || half_recv(h))
          continue;
        const int f = half_flow(h), to = peer(S, s, f);
        S->msg[s][h] = S->nsent[f][s];
        S->sent_t[f][s][S->nsent[f][s]] = S->clock[s];
        S->sent[f][s][S->nsent[f][s]++] = op->half[h];
        S->order_sent[s][to][S->nos[s][to]++] = f;
      }
      S->posted[s] = 1;
      S->post_t[s] = S->clock[s];
    }
    double t = S->clock[s];
    for (int h = 0; h < DT_PIPE_HALVES; h++) {
      if (op->half[h].mb < 0)
        continue;
      const int f = half_flow(h);
      if (half_recv(h)) { /* the sender's next message of this flow is posted */
        const int from = source(S, s, f);
        if (S->taken[f][from] >= S->nsent[f][from])
          return 0;
        continue;
      }
      if (S->taken[f][s] > S->msg[s][h]) { /* matched when the receiver posted */
        t = S->match_t[f][s][S->msg[s][h]] > t ? S->match_t[f][s][S->msg[s][h]] : t;
        continue;
      }
      /* A send is matched once the receiver took it, or posted the receive it will take. */
      const int to = peer(S, s, f), hr = f == ACT ? DT_PIPE_RECV_ACT : DT_PIPE_RECV_GRAD;
      if (S->taken[f][s] < S->msg[s][h] || S->pc[to] >= S->nops[to])
        return 0;
      const dt_pipe_op_t *top = &S->ops[to][S->pc[to]];
      if (top->op != DT_PIPE_XFER || top->half[hr].mb < 0 || !S->posted[to])
        return 0;
      t = S->post_t[to] > t ? S->post_t[to] : t;
    }
    /* A receive completes when its message was sent (posted) and the receive posted. */
    for (int h = 0; h < DT_PIPE_HALVES; h++) {
      if (op->half[h].mb < 0 || !half_recv(h))
        continue;
      const int f = half_flow(h), from = source(S, s, f);
      const double sent = S->sent_t[f][from][S->taken[f][from]];
      t = sent > t ? sent : t;
    }
    S->clock[s] = t;
    for (int h = 0; h < DT_PIPE_HALVES; h++) {
      const dt_pipe_ref_t r = op->half[h];
      if (r.mb < 0)
        continue;
      const int f = half_flow(h);
      if (half_recv(h)) {
        const int from = source(S, s, f);
        S->match_t[f][from][S->taken[f][from]] = S->post_t[s];
        const dt_pipe_ref_t got = S->sent[f][from][S->taken[f][from]++];
        const int vs_from = got.chunk * S->p + from, vs_to = r.chunk * S->p + s;
        ck_assert_msg(got.mb == r.mb && vs_to == vs_from + (f == ACT ? 1 : -1),
                      "p=%d m=%d v=%d stage %d: received chunk %d mb %d's %s for chunk %d mb %d",
                      S->p, S->m, S->v, s, got.chunk, got.mb, f == ACT ? "activation" : "gradient",
                      r.chunk, r.mb);
        S->order_recv[from][s][S->nor[from][s]++] = f;
        claim(S, s, r, f == ACT ? B_IN : B_GRAD, "receive");
      } else if (f == ACT) {
        use(S, s, r, B_ACTS, "send of the output");
      } else {
        use(S, s, r, B_GRAD, "send of the input gradient");
        release(S, s, r, B_GRAD);
      }
    }
  } else {
    const dt_pipe_ref_t r = op->ref;
    const int vs = r.chunk * S->p + s;
    const double cost = (op->op == DT_PIPE_FWD ? 1.0 : 2.0) / S->v;
    S->clock[s] += cost;
    S->busy[s] += cost;
    if (op->op == DT_PIPE_FWD) {
      ck_assert_msg(!S->fwd[s][r.chunk][r.mb]++, "stage %d: forward %d.%d twice", s, r.chunk, r.mb);
      if (vs == first_vs)
        claim(S, s, r, B_IN, "embedding");
      use(S, s, r, B_IN, "forward");
      claim(S, s, r, B_ACTS, "forward");
    } else {
      ck_assert_msg(S->fwd[s][r.chunk][r.mb], "stage %d: backward %d.%d before its forward", s,
                    r.chunk, r.mb);
      ck_assert_msg(r.mb == S->next_bwd[s][r.chunk]++, "stage %d: backward %d.%d out of order", s,
                    r.chunk, r.mb);
      S->bwd[s][r.chunk][r.mb]++;
      if (vs == last_vs)
        claim(S, s, r, B_GRAD, "loss gradient");
      use(S, s, r, B_IN, "backward");
      use(S, s, r, B_ACTS, "backward");
      use(S, s, r, B_GRAD, "backward");
      /* (the output was sent before: its gradient came back) */
      release(S, s, r, B_IN);
      release(S, s, r, B_ACTS);
      if (vs == first_vs)
        release(S, s, r, B_GRAD);
    }
  }
  S->posted[s] = 0;
  S->pc[s]++;
  return 1;
}

static void simulate(dt_pipe_kind_t kind, int p, int m, int v)
{
  sim_t *S = calloc(1, sizeof *S);
  S->p = p, S->m = m, S->v = v;
  memset(S->owner, -1, sizeof S->owner);
  for (int s = 0; s < p; s++) {
    S->nops[s] = dt_pipe_schedule(kind, p, s, m, v, S->ops[s]);
    ck_assert_int_le(S->nops[s], dt_pipe_max_ops(m, v));
    for (int c = 0; c < v; c++)
      S->slots[s][c] = dt_pipe_slots(S->ops[s], S->nops[s], c);
  }
  for (int progress = 1; progress;) {
    progress = 0;
    for (int s = 0; s < p; s++)
      while (S->pc[s] < S->nops[s] && step_stage(S, s))
        progress = 1;
  }
  for (int s = 0; s < p; s++) {
    ck_assert_msg(S->pc[s] == S->nops[s], "%s p=%d m=%d v=%d: stage %d stuck at op %d of %d",
                  dt_pipe_name(kind), p, m, v, s, S->pc[s], S->nops[s]);
    for (int c = 0; c < v; c++)
      for (int i = 0; i < m; i++)
        ck_assert_msg(S->fwd[s][c][i] == 1 && S->bwd[s][c][i] == 1,
                      "%s p=%d m=%d v=%d: stage %d ran %d.%d %d/%d times", dt_pipe_name(kind), p, m,
                      v, s, c, i, S->fwd[s][c][i], S->bwd[s][c][i]);
    for (int t = 0; t < p; t++) {
      ck_assert_int_eq(S->nos[s][t], S->nor[s][t]);
      for (int k = 0; k < S->nos[s][t]; k++)
        ck_assert_msg(S->order_sent[s][t][k] == S->order_recv[s][t][k],
                      "%s p=%d m=%d v=%d: message %d from %d to %d received out of order",
                      dt_pipe_name(kind), p, m, v, k, s, t);
    }
    if (s == 0) {
      const double bubble = 1.0 - S->busy[0] / S->clock[0];
      ck_assert_msg(fabs(bubble - dt_pipe_ideal_bubble(p, m, v)) < 1e-9,
                    "%s p=%d m=%d v=%d: the first stage waits %.4f of its time, not %.4f",
                    dt_pipe_name(kind), p, m, v, bubble, dt_pipe_ideal_bubble(p, m, v));
    }
    if (kind == DT_PIPE_GPIPE)
      ck_assert_int_eq(S->slots[s][0], m);
    if (kind == DT_PIPE_1F1B)
      ck_assert_int_eq(S->slots[s][0], p - s < m ? p - s : m);
    if (kind == DT_PIPE_INTERLEAVED) /* a chunk (1/v of the layers) holds at most 2p */
      for (int c = 0; c < v; c++)
        ck_assert_int_le(S->slots[s][c], 2 * p < m ? 2 * p : m);
  }
  free(S);
}

START_TEST(test_schedules_run_to_completion)
{
  for (int kind = DT_PIPE_GPIPE; kind <= DT_PIPE_1F1B; kind++)
    for (int p = 1; p <= MAXP; p++)
      for (int m = 1; m <= MAXM; m++)
        simulate((dt_pipe_kind_t)kind, p, m, 1);
}
END_TEST

START_TEST(test_interleaved_runs_to_completion)
{
  char why[256];
  for (int p = 2; p <= MAXP; p++)
    for (int v = 2; v <= MAXV; v++)
      for (int m = p; m <= MAXM; m += p) {
        ck_assert_int_eq(dt_pipe_check(DT_PIPE_INTERLEAVED, p, v, m, why, sizeof why), 0);
        simulate(DT_PIPE_INTERLEAVED, p, m, v);
      }
}
END_TEST

START_TEST(test_check)
{
  char why[256];
  ck_assert_int_ne(dt_pipe_check(DT_PIPE_INTERLEAVED, 2, 2, 3, why, sizeof why), 0);
  ck_assert_ptr_nonnull(strstr(why, "multiple of parallel.pp"));
  ck_assert_int_ne(dt_pipe_check(DT_PIPE_INTERLEAVED, 2, 1, 4, why, sizeof why), 0);
  ck_assert_ptr_nonnull(strstr(why, "virtual_stages >= 2"));
  ck_assert_int_ne(dt_pipe_check(DT_PIPE_INTERLEAVED, 1, 2, 4, why, sizeof why), 0);
  ck_assert_int_ne(dt_pipe_check(DT_PIPE_1F1B, 2, 2, 4, why, sizeof why), 0);
  ck_assert_ptr_nonnull(strstr(why, "needs parallel.schedule interleaved"));
  ck_assert_int_ne(
      dt_pipe_check(DT_PIPE_INTERLEAVED, 2, DT_PIPE_MAX_CHUNKS + 1, 4, why, sizeof why), 0);
  ck_assert_int_eq(dt_pipe_check(DT_PIPE_1F1B, 4, 1, 3, why, sizeof why), 0);
}
END_TEST

START_TEST(test_names_and_bubble)
{
  dt_pipe_kind_t k;
  ck_assert_int_eq(dt_pipe_parse("gpipe", &k), 0);
  ck_assert_int_eq(k, DT_PIPE_GPIPE);
  ck_assert_int_eq(dt_pipe_parse("1f1b", &k), 0);
  ck_assert_int_eq(k, DT_PIPE_1F1B);
  ck_assert_int_eq(dt_pipe_parse("interleaved", &k), 0);
  ck_assert_int_eq(k, DT_PIPE_INTERLEAVED);
  ck_assert_int_ne(dt_pipe_parse("zb-v", &k), 0);
  ck_assert_str_eq(dt_pipe_name(DT_PIPE_1F1B), "1f1b");
  ck_assert(dt_pipe_ideal_bubble(4, 8, 1) == 3.0 / 11.0);
  ck_assert(dt_pipe_ideal_bubble(1, 8, 1) == 0.0);
  ck_assert(dt_pipe_ideal_bubble(4, 8, 2) == 3.0 / 19.0);
}
END_TEST

int main(void)
{
  Suite *s = suite_create("schedule");
  TCase *tc = tcase_create("schedule");
  tcase_add_test(tc, test_schedules_run_to_completion);
  tcase_add_test(tc, test_interleaved_runs_to_completion);
  tcase_add_test(tc, test_check);
  tcase_add_test(tc, test_names_and_bubble);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
