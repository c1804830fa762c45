/* test_schedule.c — Check suite for worker/trainer/schedule: the GPipe and 1F1B op lists of
 * every stage, run together in a simulation of the trainer's blocking transfers (a send or a
 * receive completes only when its partner has been posted; a combined op posts both halves at
 * once; the first stage skips transfers to its predecessor, the last to its successor, as
 * pipeline.c does). For p = 1..6 stages and m = 1..10 micro-batches it checks that the stages
 * never deadlock, that the k-th activation (gradient) sent is the one the neighbour expects,
 * that every stage runs each forward once and each backward once after it, backwards in
 * micro-batch order, and that a stage never holds more micro-batches than its activation
 * slots (dt_pipe_slots): 1F1B at most p - s, GPipe m. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "schedule.h"

#define MAXP   6
#define MAXM   10
#define MAXOPS (6 * MAXM)

enum { ACT = 0, GRAD = 1 }; /* flows: activations go to s + 1, gradients to s - 1 */

typedef struct {
  dt_pipe_op_t ops[MAXP][MAXOPS];
  int nops[MAXP], pc[MAXP];
  /* per flow and sending stage: micro-batches sent, in order; how many the receiver took */
  int sent[2][MAXP][MAXM], nsent[2][MAXP], taken[2][MAXP];
  int posted[MAXP], msg[MAXP]; /* the send half of the current op is posted, as message msg */
  int fwd[MAXP][MAXM], bwd[MAXP][MAXM], live[MAXP], peak[MAXP], next_bwd[MAXP];
} sim_t;

/* The halves of an op that really transfer on stage s of p: send (flow, mb) and receive
 * (flow, mb), -1 when absent. */
static void halves(const dt_pipe_op_t *op, int s, int p, int *sf, int *smb, int *rf, int *rmb)
{
  const int first = s == 0, last = s == p - 1;
  *sf = *rf = -1;
  *smb = *rmb = -1;
  switch (op->op) {
  case DT_PIPE_RECV_FWD:
    if (!first)
      *rf = ACT, *rmb = op->mb;
    break;
  case DT_PIPE_SEND_FWD:
    if (!last)
      *sf = ACT, *smb = op->mb;
    break;
  case DT_PIPE_RECV_BWD:
    if (!last)
      *rf = GRAD, *rmb = op->mb;
    break;
  case DT_PIPE_SEND_BWD:
    if (!first)
      *sf = GRAD, *smb = op->mb;
    break;
  case DT_PIPE_SEND_FWD_RECV_BWD:
    if (!last)
      *sf = ACT, *smb = op->mb, *rf = GRAD, *rmb = op->mb2;
    break;
  case DT_PIPE_SEND_BWD_RECV_FWD:
    if (!first)
      *sf = GRAD, *smb = op->mb, *rf = ACT, *rmb = op->mb2;
    break;
  default:
    break;
  }
}

/* Tries to finish stage s's current op; 1 if it did. */
static int step_stage(sim_t *S, int s, int p, int m)
{
  const dt_pipe_op_t *op = &S->ops[s][S->pc[s]];
  int sf, smb, rf, rmb;
  halves(op, s, p, &sf, &smb, &rf, &rmb);
  /* Post the send half (the receiver may take it from now on). */
  if (sf >= 0 && !S->posted[s]) {
    S->msg[s] = S->nsent[sf][s];
    S->sent[sf][s][S->nsent[sf][s]++] = smb;
    S->posted[s] = 1;
  }
  /* The receive half needs the sender's next message of that flow posted. */
  if (rf >= 0) {
    const int from = rf == ACT ? s - 1 : s + 1;
    if (S->taken[rf][from] >= S->nsent[rf][from])
      return 0;
  }
  /* The send half completes when the receiver has posted its matching receive: it took our
   * message already, or its current op receives this flow and our message is next. */
  if (sf >= 0 && S->taken[sf][s] <= S->msg[s]) {
    const int to = sf == ACT ? s + 1 : s - 1;
    int tf, tmb, trf, trmb;
    if (S->pc[to] >= S->nops[to])
      return 0;
    halves(&S->ops[to][S->pc[to]], to, p, &tf, &tmb, &trf, &trmb);
    if (trf != sf || S->taken[sf][s] != S->msg[s])
      return 0;
  }
  if (rf >= 0) {
    const int from = rf == ACT ? s - 1 : s + 1;
    const int got = S->sent[rf][from][S->taken[rf][from]++];
    ck_assert_msg(got == rmb, "stage %d received micro-batch %d's %s, expected %d", s, got,
                  rf == ACT ? "activation" : "gradient", rmb);
    if (rf == ACT && ++S->live[s] > S->peak[s])
      S->peak[s] = S->live[s];
  }
  if (op->op == DT_PIPE_FWD) {
    ck_assert_msg(!S->fwd[s][op->mb]++, "stage %d: forward %d twice", s, op->mb);
    if (s == 0 && ++S->live[s] > S->peak[s]) /* the first stage's input is its own */
      S->peak[s] = S->live[s];
  }
  if (op->op == DT_PIPE_BWD) {
    ck_assert_msg(S->fwd[s][op->mb], "stage %d: backward %d before its forward", s, op->mb);
    ck_assert_msg(op->mb == S->next_bwd[s]++, "stage %d: backward %d out of order", s, op->mb);
    S->bwd[s][op->mb]++;
    S->live[s]--;
  }
  (void)m;
  S->posted[s] = 0;
  S->pc[s]++;
  return 1;
}

static void simulate(dt_pipe_kind_t kind, int p, int m)
{
  sim_t *S = calloc(1, sizeof *S);
  for (int s = 0; s < p; s++)
    S->nops[s] = dt_pipe_schedule(kind, p, s, m, S->ops[s]);
  for (int progress = 1; progress;) {
    progress = 0;
    for (int s = 0; s < p; s++)
      while (S->pc[s] < S->nops[s] && step_stage(S, s, p, m))
        progress = 1;
  }
  for (int s = 0; s < p; s++) {
    ck_assert_msg(S->pc[s] == S->nops[s], "%s p=%d m=%d: stage %d stuck at op %d of %d",
                  dt_pipe_name(kind), p, m, s, S->pc[s], S->nops[s]);
    for (int i = 0; i < m; i++)
      ck_assert_msg(S->fwd[s][i] == 1 && S->bwd[s][i] == 1,
                    "%s p=%d m=%d: stage %d ran micro-batch %d %d/%d times", dt_pipe_name(kind), p,
                    m, s, i, S->fwd[s][i], S->bwd[s][i]);
    const int slots = dt_pipe_slots(kind, p, s, m);
    ck_assert_msg(S->peak[s] <= slots, "%s p=%d m=%d: stage %d held %d micro-batches, %d slots",
                  dt_pipe_name(kind), p, m, s, S->peak[s], slots);
    ck_assert_int_eq(slots, kind == DT_PIPE_GPIPE ? m : (p - s < m ? p - s : m));
  }
  free(S);
}

START_TEST(test_schedules_run_to_completion)
{
  for (int kind = DT_PIPE_GPIPE; kind <= DT_PIPE_1F1B; kind++)
    for (int p = 1; p <= MAXP; p++)
      for (int m = 1; m <= MAXM; m++)
        simulate((dt_pipe_kind_t)kind, p, m);
}
END_TEST

START_TEST(test_names_and_bubble)
{
  dt_pipe_kind_t k;
  ck_assert_int_eq(dt_pipe_parse("gpipe", &k), 0);
  ck_assert_int_eq(k, DT_PIPE_GPIPE);
  ck_assert_int_eq(dt_pipe_parse("1f1b", &k), 0);
  ck_assert_int_eq(k, DT_PIPE_1F1B);
  ck_assert_int_ne(dt_pipe_parse("interleaved", &k), 0);
  ck_assert_str_eq(dt_pipe_name(DT_PIPE_1F1B), "1f1b");
  ck_assert(dt_pipe_ideal_bubble(4, 8) == 3.0 / 11.0);
  ck_assert(dt_pipe_ideal_bubble(1, 8) == 0.0);
}
END_TEST

int main(void)
{
  Suite *s = suite_create("schedule");
  TCase *tc = tcase_create("schedule");
  tcase_add_test(tc, test_schedules_run_to_completion);
  tcase_add_test(tc, test_names_and_bubble);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
