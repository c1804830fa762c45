/* test_hang.c — Check suite for coordinator/hang: which ranks a hung job's progress reports
 * name. Each case builds the reports a situation produces (a stopped rank, one stopped inside
 * the collective, one busy elsewhere, a chain through a second group, a pipeline peer, a
 * deadlock, a 4096-rank group) and checks the ranks named and the explanation. The reports
 * themselves come from dt_comm_progress (test_comm) through the agent; the whole path, with a
 * SIGSTOPped trainer, is test_control_plane's T9. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "hang.h"

#define TIMEOUT 30000.0
#define STALE   5000.0

/* Reports of up to 4096 ranks with up to 2 communicators each. */
typedef struct {
  Distrain__V1__CommProgress c[2];
  Distrain__V1__CommProgress *cp[2];
  Distrain__V1__TrainerProgress p;
} report_t;

static report_t *reports(int world)
{
  report_t *r = calloc((size_t)world, sizeof *r);
  ck_assert_ptr_nonnull(r);
  for (int i = 0; i < world; i++) {
    distrain__v1__trainer_progress__init(&r[i].p);
    r[i].p.comms = r[i].cp;
  }
  return r;
}

/* Adds a communicator to rank r's report: group, its rank in it, its size, the operations
 * entered, and the one in progress (op NULL: none) with its peer and wait. */
static void comm(report_t *rep, int r, const char *group, const char *label, int grank, int gworld,
                 unsigned entered, const char *op, int peer, unsigned waiting_ms)
{
  report_t *x = &rep[r];
  Distrain__V1__CommProgress *c = &x->c[x->p.n_comms];
  distrain__v1__comm_progress__init(c);
  c->group = (char *)group;
  c->label = (char *)label;
  c->rank = grank;
  c->world = gworld;
  c->entered = entered;
  c->done = op ? entered - 1 : entered;
  c->op = (char *)(op ? op : "");
  c->peer = peer;
  c->waiting_ms = op ? waiting_ms : 0;
  x->cp[x->p.n_comms++] = c;
}

static int analyze(report_t *rep, const double *age, int world, int *blamed, char *why)
{
  dt_hang_rank_t *in = calloc((size_t)world, sizeof *in);
  ck_assert_ptr_nonnull(in);
  for (int r = 0; r < world; r++)
    in[r] = (dt_hang_rank_t){rep[r].p.n_comms ? &rep[r].p : NULL, age ? age[r] : 500.0};
  int n = dt_hang_analyze(in, world, TIMEOUT, STALE, blamed, why, 512);
  free(in);
  return n;
}

START_TEST(test_no_hang_below_the_timeout)
{
  report_t *rep = reports(2);
  comm(rep, 0, "job-1/gen1", "world", 0, 2, 5, "all_reduce", -1, 26500);
  comm(rep, 1, "job-1/gen1", "world", 1, 2, 4, NULL, -1, 0);
  int blamed[2];
  char why[512];
  ck_assert_int_eq(analyze(rep, NULL, 2, blamed, why), 0);
  ck_assert_str_eq(why, "");
  /* The report's age counts: 26.5 s waited when sent, 4 s ago. */
  const double age[2] = {4000, 500};
  ck_assert_int_eq(analyze(rep, age, 2, blamed, why), 1);
  ck_assert_int_eq(blamed[0], 1);
  free(rep);
}
END_TEST

START_TEST(test_stopped_rank_is_named)
{
  report_t *rep = reports(2);
  comm(rep, 0, "job-1/gen1", "world", 0, 2, 57, "all_reduce", -1, 31000);
  comm(rep, 1, "job-1/gen1", "world", 1, 2, 56, NULL, -1, 0);
  const double age[2] = {400, 29000};
  int blamed[2];
  char why[512];
  ck_assert_int_eq(analyze(rep, age, 2, blamed, why), 1);
  ck_assert_int_eq(blamed[0], 1);
  ck_assert_msg(strstr(why, "rank 0 has waited 31.4 s in world all_reduce #57") != NULL, "%s", why);
  ck_assert_msg(strstr(why, "rank 1 sent no report for 29.0 s (stopped or wedged)") != NULL, "%s",
                why);
  free(rep);
}
END_TEST

/* Stopped inside the collective: its count says it arrived, its silence names it. */
START_TEST(test_rank_stopped_inside_the_collective)
{
  report_t *rep = reports(3);
  for (int r = 0; r < 3; r++)
    comm(rep, r, "g", "dp", r, 3, 9, "reduce_scatter", -1, r == 2 ? 100 : 40000);
  const double age[3] = {300, 800, 39000};
  int blamed[3];
  char why[512];
  ck_assert_int_eq(analyze(rep, age, 3, blamed, why), 1);
  ck_assert_int_eq(blamed[0], 2);
  free(rep);
}
END_TEST

START_TEST(test_busy_rank_is_named)
{
  report_t *rep = reports(2);
  comm(rep, 0, "g", "dp", 0, 2, 12, "all_reduce", -1, 45000);
  comm(rep, 1, "g", "dp", 1, 2, 11, NULL, -1, 0);
  int blamed[2];
  char why[512];
  ck_assert_int_eq(analyze(rep, NULL, 2, blamed, why), 1);
  ck_assert_int_eq(blamed[0], 1);
  ck_assert_msg(strstr(why, "rank 1 is running but has not arrived") != NULL, "%s", why);
  free(rep);
}
END_TEST

/* dp x tp = 2 x 2: rank 0 waits in its dp group {0, 2}; rank 2 arrived there late because it
 * waits in its tp group {2, 3} for rank 3, which stopped. Only rank 3 is named. */
START_TEST(test_chain_through_another_group)
{
  report_t *rep = reports(4);
  comm(rep, 0, "dp0", "dp", 0, 2, 7, "all_reduce", -1, 35000);
  comm(rep, 0, "tp0", "tp", 0, 2, 3, NULL, -1, 0);
  comm(rep, 1, "dp1", "dp", 0, 2, 6, NULL, -1, 0);
  comm(rep, 1, "tp0", "tp", 1, 2, 3, NULL, -1, 0);
  comm(rep, 2, "dp0", "dp", 1, 2, 6, NULL, -1, 0);
  comm(rep, 2, "tp1", "tp", 0, 2, 3, "all_reduce", -1, 34000);
  comm(rep, 3, "dp1", "dp", 1, 2, 6, NULL, -1, 0);
  comm(rep, 3, "tp1", "tp", 1, 2, 2, NULL, -1, 0);
  const double age[4] = {500, 500, 500, 33000};
  int blamed[4];
  char why[512];
  ck_assert_int_eq(analyze(rep, age, 4, blamed, why), 1);
  ck_assert_int_eq(blamed[0], 3);
  free(rep);
}
END_TEST

/* A pipeline stage blocked receiving from its peer (group rank 0 = global rank 4) names it,
 * whatever their operation counts. */
START_TEST(test_pipeline_peer)
{
  report_t *rep = reports(8);
  comm(rep, 4, "pp", "pp", 0, 2, 100, NULL, -1, 0);
  comm(rep, 5, "pp", "pp", 1, 2, 80, "recv", 0, 31000);
  const double age[8] = {500, 500, 500, 500, 40000, 500, 500, 500};
  int blamed[8];
  char why[512];
  ck_assert_int_eq(analyze(rep, age, 8, blamed, why), 1);
  ck_assert_int_eq(blamed[0], 4);
  ck_assert_msg(strstr(why, "in pp recv #80") != NULL, "%s", why);
  free(rep);
}
END_TEST

/* The middle stage of three sends forward and receives from behind in one send/recv (its
 * first half's peer is the next stage). The next stage waits for it; the one behind stopped.
 * Every peer is followed, so the stopped stage is named, not a "deadlock" of the two blocked
 * stages that following only the first peer found. */
START_TEST(test_send_recv_names_the_peer_behind)
{
  static int32_t middle_peers[2] = {2, 0};
  report_t *rep = reports(3);
  comm(rep, 0, "pp", "pp", 0, 3, 40, NULL, -1, 0);
  comm(rep, 1, "pp", "pp", 1, 3, 41, "send/recv", 2, 31000);
  rep[1].c[0].peers = middle_peers;
  rep[1].c[0].n_peers = 2;
  comm(rep, 2, "pp", "pp", 2, 3, 41, "recv", 1, 30500);
  const double age[3] = {40000, 500, 500};
  int blamed[3];
  char why[512];
  ck_assert_int_eq(analyze(rep, age, 3, blamed, why), 1);
  ck_assert_int_eq(blamed[0], 0);
  ck_assert_msg(strstr(why, "rank 0 sent no report") != NULL, "%s", why);
  free(rep);
}
END_TEST

/* Two stages each blocked receiving from the other: nobody is missing; both are named. */
START_TEST(test_deadlock_names_every_blocked_rank)
{
  report_t *rep = reports(2);
  comm(rep, 0, "pp", "pp", 0, 2, 10, "recv", 1, 31000);
  comm(rep, 1, "pp", "pp", 1, 2, 10, "recv", 0, 30500);
  int blamed[2];
  char why[512];
  ck_assert_int_eq(analyze(rep, NULL, 2, blamed, why), 2);
  ck_assert_int_eq(blamed[0] + blamed[1], 1);
  ck_assert_msg(strstr(why, "ranks 0, 1 are all blocked with no rank missing") != NULL, "%s", why);
  free(rep);
}
END_TEST

/* A stopped rank's own old report never makes it the waiter; with nobody else blocked there
 * is nothing to name (its agent's heartbeats and the others' waits will). */
START_TEST(test_silent_ranks_are_not_waiters)
{
  report_t *rep = reports(2);
  comm(rep, 0, "g", "dp", 0, 2, 3, NULL, -1, 0);
  comm(rep, 1, "g", "dp", 1, 2, 4, "all_reduce", -1, 90000);
  const double age[2] = {500, 60000};
  int blamed[2];
  char why[512];
  ck_assert_int_eq(analyze(rep, age, 2, blamed, why), 0);
  free(rep);
}
END_TEST

/* A rank that stopped before its first progress report: not in the group's reports, silent. */
START_TEST(test_rank_without_reports)
{
  report_t *rep = reports(3);
  comm(rep, 0, "g", "world", 0, 3, 1, "all_reduce", -1, 31000);
  comm(rep, 1, "g", "world", 1, 3, 1, "all_reduce", -1, 31000);
  const double age[3] = {500, 500, 31000};
  int blamed[3];
  char why[512];
  ck_assert_int_eq(analyze(rep, age, 3, blamed, why), 1);
  ck_assert_int_eq(blamed[0], 2);
  free(rep);
}
END_TEST

/* One stopped rank among 4096 in one data-parallel group. */
START_TEST(test_large_group)
{
  enum { W = 4096, STOPPED = 1234 };
  report_t *rep = reports(W);
  double *age = malloc(W * sizeof *age);
  for (int r = 0; r < W; r++) {
    comm(rep, r, "dp", "dp", r, W, r == STOPPED ? 40 : 41, r == STOPPED ? NULL : "all_reduce", -1,
         31000 + (unsigned)r);
    age[r] = r == STOPPED ? 31000 : 700;
  }
  int *blamed = malloc(W * sizeof *blamed);
  char why[512];
  ck_assert_int_eq(analyze(rep, age, W, blamed, why), 1);
  ck_assert_int_eq(blamed[0], STOPPED);
  ck_assert_msg(strstr(why, "rank 4095 has waited") != NULL, "%s", why); /* the longest wait */
  free(blamed);
  free(age);
  free(rep);
}
END_TEST

START_TEST(test_describe)
{
  report_t *rep = reports(1);
  char out[96];
  dt_hang_describe(NULL, 0, out, sizeof out);
  ck_assert_str_eq(out, "");
  comm(rep, 0, "a", "tp", 0, 2, 4, NULL, -1, 0);
  dt_hang_describe(&rep[0].p, 100, out, sizeof out);
  ck_assert_str_eq(out, "");
  comm(rep, 0, "b", "dp", 0, 2, 57, "all_reduce", -1, 3100);
  dt_hang_describe(&rep[0].p, 100, out, sizeof out);
  ck_assert_str_eq(out, "dp all_reduce #57 for 3.2 s");
  free(rep);
}
END_TEST

static Suite *hang_suite(void)
{
  Suite *s = suite_create("hang");
  TCase *t = tcase_create("analyze");
  tcase_add_test(t, test_no_hang_below_the_timeout);
  tcase_add_test(t, test_stopped_rank_is_named);
  tcase_add_test(t, test_rank_stopped_inside_the_collective);
  tcase_add_test(t, test_busy_rank_is_named);
  tcase_add_test(t, test_chain_through_another_group);
  tcase_add_test(t, test_pipeline_peer);
  tcase_add_test(t, test_send_recv_names_the_peer_behind);
  tcase_add_test(t, test_deadlock_names_every_blocked_rank);
  tcase_add_test(t, test_silent_ranks_are_not_waiters);
  tcase_add_test(t, test_rank_without_reports);
  tcase_add_test(t, test_large_group);
  tcase_add_test(t, test_describe);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(hang_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
