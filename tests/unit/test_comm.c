/* test_comm.c — Check suite for worker/comm: the key-value stores, and the cpu (Gloo) backend
 * with 2, 3 and 4 forked processes on loopback rendezvousing through a directory store.
 *
 * Every multi-process test forks one child per rank. Children check their own results with
 * CHILD_CHECK (print and _exit(1): Check's asserts belong to the test process only) and the
 * test asserts that every child exited 0 within a deadline, killing stragglers so that a hang
 * is a failure, never a stuck suite. Data are small integers in float32, so every sum is exact
 * and results are compared for equality. */
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <check.h>

#include "comm.h"
#include "device.h"
#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"
#include "ut_fs.h"

/* ------------------------------------------------------------------------------------------ */
/* Harness                                                                                     */
/* ------------------------------------------------------------------------------------------ */

#define MAX_RANKS 8

#define CHILD_CHECK(cond, ...)                                                                     \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "[child %d] %s:%d: check failed: %s: ", (int)getpid(), __FILE__, __LINE__,   \
              #cond);                                                                              \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fprintf(stderr, "\n");                                                                       \
      _exit(1);                                                                                    \
    }                                                                                              \
  } while (0)

#define CHILD_RC(call)                                                                             \
  do {                                                                                             \
    int rc_ = (call);                                                                              \
    CHILD_CHECK(rc_ == 0, "%s returned %s", #call, dt_err_name(rc_));                              \
  } while (0)

typedef struct {
  char dir[512]; /* the KV directory (and scratch files) of this test */
  char prefix[128];
  int world;      /* ranks of the communicator */
  int timeout_ms; /* communicator timeout */
  int arg;        /* test-specific */
} ctx_t;

typedef void (*rank_fn)(const ctx_t *c, int rank);

static void ctx_init(ctx_t *c, int world, int timeout_ms, const char *prefix)
{
  memset(c, 0, sizeof *c);
  ut_mkdtemp(c->dir, sizeof c->dir);
  snprintf(c->prefix, sizeof c->prefix, "%s", prefix);
  c->world = world;
  c->timeout_ms = timeout_ms;
}

/* In a child: a file store on the test directory and a communicator on it (asserting success). */
static dt_comm_t *child_comm(const ctx_t *c, int rank)
{
  static dt_kv_t kv; /* one per child process; lives until _exit */
  CHILD_RC(dt_kv_file_create(&kv, c->dir));
  dt_comm_t *comm = NULL;
  CHILD_RC(dt_comm_init(&comm, "cpu", &kv, c->prefix, rank, c->world, c->timeout_ms));
  CHILD_CHECK(dt_comm_rank(comm) == rank && dt_comm_world(comm) == c->world, "rank/world");
  return comm;
}

/* Forks fn for each rank in ranks[0..n) with stderr, if log is set, appended to <dir>/log. */
static void spawn(const ctx_t *c, rank_fn fn, const int *ranks, int n, pid_t *pids, int log)
{
  for (int i = 0; i < n; i++) {
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
      if (log) {
        char path[600];
        snprintf(path, sizeof path, "%s/log", c->dir);
        FILE *fp = fopen(path, "a");
        if (fp)
          dup2(fileno(fp), 2);
      }
      fn(c, ranks[i]);
      _exit(0);
    }
    pids[i] = pid;
  }
}

/* Waits for the children up to limit_ms; kills and fails on a straggler. Returns elapsed ms;
 * statuses are stored in status (may be NULL: then every child must have exited 0). */
static double reap(pid_t *pids, int n, double limit_ms, int *status)
{
  double t0 = dt_now_ms();
  int left = n, st[MAX_RANKS] = {0}, done[MAX_RANKS] = {0};
  while (left > 0 && dt_now_ms() - t0 < limit_ms) {
    for (int i = 0; i < n; i++) {
      if (!done[i] && waitpid(pids[i], &st[i], WNOHANG) == pids[i]) {
        done[i] = 1;
        left--;
      }
    }
    if (left > 0) {
      struct timespec ts = {0, 2 * 1000 * 1000};
      nanosleep(&ts, NULL);
    }
  }
  double elapsed = dt_now_ms() - t0;
  for (int i = 0; i < n; i++) {
    if (!done[i]) {
      kill(pids[i], SIGKILL);
      waitpid(pids[i], &st[i], 0);
    }
  }
  for (int i = 0; i < n; i++) {
    ck_assert_msg(done[i], "child %d (pid %d) still running after %.0f ms", i, (int)pids[i],
                  limit_ms);
    if (status) {
      status[i] = st[i];
    } else {
      ck_assert_msg(WIFEXITED(st[i]) && WEXITSTATUS(st[i]) == 0, "child %d exited with status 0x%x",
                    i, st[i]);
    }
  }
  return elapsed;
}

/* Runs fn on ranks 0..world-1 and requires all to pass within limit_ms. */
static void run_all(const ctx_t *c, rank_fn fn, double limit_ms)
{
  int ranks[MAX_RANKS];
  pid_t pids[MAX_RANKS] = {0};
  for (int r = 0; r < c->world; r++)
    ranks[r] = r;
  spawn(c, fn, ranks, c->world, pids, 0);
  reap(pids, c->world, limit_ms, NULL);
}

static char *read_log(const ctx_t *c)
{
  char path[600];
  size_t n;
  snprintf(path, sizeof path, "%s/log", c->dir);
  if (!ut_exists(path))
    return strdup("");
  return (char *)ut_read_all(path, &n);
}

/* Rank r's value at index i: small integers, so sums over <= 8 ranks are exact in float32. */
static float val(int r, size_t i)
{
  return (float)((r + 1) * (int)(i % 97) + r);
}

static float sum_over(int world, size_t i)
{
  float s = 0;
  for (int r = 0; r < world; r++)
    s += val(r, i);
  return s;
}

static float *alloc_floats(size_t n)
{
  float *p = malloc((n ? n : 1) * sizeof *p);
  CHILD_CHECK(p != NULL, "out of memory");
  return p;
}

static void sleep_ms(int ms)
{
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Key-value stores                                                                            */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
  dt_kv_t *kv;
  int delay_ms;
} late_put_t;

static void *late_put(void *arg)
{
  late_put_t *lp = arg;
  sleep_ms(lp->delay_ms);
  lp->kv->put(lp->kv->ud, "late/key", "v2", 2);
  return NULL;
}

/* The contract both stores share: round trip, overwrite, zero-length values, odd key bytes,
 * a timed-out get, and a get that waits for a put from another thread. */
static void kv_contract(dt_kv_t *kv)
{
  void *v = NULL;
  size_t len = 0;
  ck_assert_int_eq(kv->put(kv->ud, "job1/gen0/a", "hello", 5), 0);
  ck_assert_int_eq(kv->get(kv->ud, "job1/gen0/a", &v, &len, 0), 0);
  ck_assert_uint_eq(len, 5);
  ck_assert_int_eq(memcmp(v, "hello", 5), 0);
  free(v);

  ck_assert_int_eq(kv->put(kv->ud, "job1/gen0/a", "xy", 2), 0);
  ck_assert_int_eq(kv->get(kv->ud, "job1/gen0/a", &v, &len, 0), 0);
  ck_assert_uint_eq(len, 2);
  ck_assert_int_eq(memcmp(v, "xy", 2), 0);
  free(v);

  /* Keys that differ only in characters the file store escapes stay distinct. */
  const char *odd[] = {".hidden", "a b/c%d", "a_b/c%d", "..", "k\n\x01\xff"};
  for (size_t i = 0; i < DT_ARRAY_SIZE(odd); i++)
    ck_assert_int_eq(kv->put(kv->ud, odd[i], odd[i], strlen(odd[i])), 0);
  for (size_t i = 0; i < DT_ARRAY_SIZE(odd); i++) {
    ck_assert_int_eq(kv->get(kv->ud, odd[i], &v, &len, 0), 0);
    ck_assert_uint_eq(len, strlen(odd[i]));
    ck_assert_int_eq(memcmp(v, odd[i], len), 0);
    free(v);
  }

  ck_assert_int_eq(kv->put(kv->ud, "empty", NULL, 0), 0);
  ck_assert_int_eq(kv->get(kv->ud, "empty", &v, &len, 0), 0);
  ck_assert_uint_eq(len, 0);
  free(v);

  /* A missing key times out, after roughly the timeout. */
  double t0 = dt_now_ms();
  ck_assert_int_eq(kv->get(kv->ud, "job1/gen1/a", &v, &len, 80), DT_ETIMEDOUT);
  double dt = dt_now_ms() - t0;
  ck_assert_msg(dt >= 75 && dt < 1000, "get timed out after %.1f ms", dt);

  /* A get waits for a put that happens later. */
  pthread_t th;
  late_put_t lp = {kv, 50};
  ck_assert_int_eq(pthread_create(&th, NULL, late_put, &lp), 0);
  ck_assert_int_eq(kv->get(kv->ud, "late/key", &v, &len, 5000), 0);
  ck_assert_uint_eq(len, 2);
  ck_assert_int_eq(memcmp(v, "v2", 2), 0);
  free(v);
  pthread_join(th, NULL);

  ck_assert_int_eq(kv->get(kv->ud, "x", &v, &len, -1), DT_EINVAL);
}

START_TEST(test_kv_file)
{
  char dir[512], sub[600];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(sub, sizeof sub, "%s/made/by/create", dir);
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_file_create(&kv, sub), 0);
  kv_contract(&kv);
  /* Keys become single escaped files in the directory; no temporaries are left behind. */
  ck_assert_int_eq(ut_count_entries(sub, "job1%2Fgen0%2Fa"), 1);
  ck_assert_int_eq(ut_count_entries(sub, ".tmp"), 0);
  char longkey[400];
  memset(longkey, '/', sizeof longkey - 1);
  longkey[sizeof longkey - 1] = '\0';
  ck_assert_int_eq(kv.put(kv.ud, longkey, "x", 1), DT_EINVAL);
  dt_kv_file_destroy(&kv);
  ut_rm_rf(dir);
}
END_TEST

/* Two stores on one directory in one process (ranks that are threads): each thread's values
 * land under its own keys. Their temporaries once shared names (a counter per store), so one
 * thread's rename could publish the other's value under its key, or fail. */
typedef struct {
  dt_kv_t kv;
  int id, errors;
  pthread_barrier_t *step; /* both threads put their i-th value together */
} kv_writer_t;

#define KV_PUTS 200

static void *kv_writer(void *arg)
{
  kv_writer_t *w = arg;
  for (int i = 0; i < KV_PUTS; i++) {
    char key[32], val[32];
    snprintf(key, sizeof key, "w%d/%d", w->id, i);
    snprintf(val, sizeof val, "value %d of %d", i, w->id);
    pthread_barrier_wait(w->step);
    w->errors += w->kv.put(w->kv.ud, key, val, strlen(val)) != 0;
  }
  return NULL;
}

START_TEST(test_kv_file_two_stores)
{
  char dir[512];
  ut_mkdtemp(dir, sizeof dir);
  pthread_barrier_t step;
  ck_assert_int_eq(pthread_barrier_init(&step, NULL, 2), 0);
  kv_writer_t w[2] = {{.id = 0, .step = &step}, {.id = 1, .step = &step}};
  pthread_t th[2];
  for (int k = 0; k < 2; k++) {
    ck_assert_int_eq(dt_kv_file_create(&w[k].kv, dir), 0);
    ck_assert_int_eq(pthread_create(&th[k], NULL, kv_writer, &w[k]), 0);
  }
  for (int k = 0; k < 2; k++)
    pthread_join(th[k], NULL);
  pthread_barrier_destroy(&step);
  for (int k = 0; k < 2; k++) {
    ck_assert_int_eq(w[k].errors, 0);
    for (int i = 0; i < KV_PUTS; i++) {
      char key[32], want[48];
      snprintf(key, sizeof key, "w%d/%d", k, i);
      snprintf(want, sizeof want, "value %d of %d", i, k);
      void *v = NULL;
      size_t len = 0;
      ck_assert_int_eq(w[k].kv.get(w[k].kv.ud, key, &v, &len, 0), 0);
      ck_assert_msg(len == strlen(want) && memcmp(v, want, len) == 0, "%s: '%.*s'", key, (int)len,
                    (const char *)v);
      free(v);
    }
    dt_kv_file_destroy(&w[k].kv);
  }
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_kv_mem)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  kv_contract(&kv);
  dt_kv_mem_destroy(&kv);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Collectives (world 2, 3, 4: the loop index)                                                 */
/* ------------------------------------------------------------------------------------------ */

/* Sums of inexact floats: every rank must end with bitwise the same result (data-parallel
 * replicas stay identical), whichever algorithm the size selects. */
static void check_all_reduce_same_bits(dt_comm_t *comm, int rank, int world, size_t n)
{
  float *buf = alloc_floats(n), *all = alloc_floats(n * (size_t)world);
  uint32_t x = 2654435761u * (uint32_t)(rank + 1);
  for (size_t i = 0; i < n; i++) {
    x = x * 1664525u + 1013904223u;
    buf[i] = (float)(x >> 8) / 16777216.0f - 0.5f;
  }
  CHILD_RC(dt_comm_all_reduce(comm, buf, n, DT_COMM_AVG));
  CHILD_RC(dt_comm_all_gather(comm, buf, all, n));
  for (int r = 0; r < world; r++)
    CHILD_CHECK(memcmp(all + (size_t)r * n, buf, n * sizeof(float)) == 0,
                "all_reduce n=%zu: rank %d's result differs from rank %d's", n, r, rank);
  free(buf);
  free(all);
}

static void check_all_reduce(dt_comm_t *comm, int rank, int world)
{
  /* 600001: many Gloo segments; 1100001 (4.4 MB): past the recursive-doubling limit (4 MiB)
   * of world 4, which so takes both algorithms (world 2 always doubles, world 3 rings). */
  static const size_t sizes[] = {0, 1, 7, 1000, 600001, 1100001};
  for (size_t si = 0; si < DT_ARRAY_SIZE(sizes); si++) {
    size_t n = sizes[si];
    float *buf = alloc_floats(n);
    for (int op = DT_COMM_SUM; op <= DT_COMM_AVG; op++) {
      for (size_t i = 0; i < n; i++)
        buf[i] = val(rank, i);
      CHILD_RC(dt_comm_all_reduce(comm, buf, n, (dt_comm_op_t)op));
      for (size_t i = 0; i < n; i++) {
        float want = op == DT_COMM_SUM ? sum_over(world, i) : sum_over(world, i) / (float)world;
        CHILD_CHECK(buf[i] == want, "all_reduce n=%zu op=%d [%zu] = %g, want %g", n, op, i, buf[i],
                    want);
      }
    }
    free(buf);
  }
  check_all_reduce_same_bits(comm, rank, world, 100003);
  check_all_reduce_same_bits(comm, rank, world, 1100001);
}

/* Chunk c of every rank's input holds global indices off[c]..; rank r gets chunk r reduced. */
static void check_reduce_scatter_counts(dt_comm_t *comm, int rank, int world, const size_t *counts,
                                        int equal)
{
  size_t total = 0, mine = 0;
  for (int c = 0; c < world; c++) {
    if (c < rank)
      mine += counts[c];
    total += counts[c];
  }
  float *in = alloc_floats(total), *out = alloc_floats(counts[rank]);
  for (int op = DT_COMM_SUM; op <= DT_COMM_AVG; op++) {
    for (size_t i = 0; i < total; i++)
      in[i] = val(rank, i);
    for (size_t i = 0; i < counts[rank]; i++)
      out[i] = -12345.f;
    if (equal)
      CHILD_RC(dt_comm_reduce_scatter(comm, in, out, counts[0], (dt_comm_op_t)op));
    else
      CHILD_RC(dt_comm_reduce_scatter_v(comm, in, out, counts, (dt_comm_op_t)op));
    for (size_t i = 0; i < counts[rank]; i++) {
      float s = sum_over(world, mine + i);
      float want = op == DT_COMM_SUM ? s : s / (float)world;
      CHILD_CHECK(out[i] == want, "reduce_scatter count=%zu op=%d [%zu] = %g, want %g",
                  counts[rank], op, i, out[i], want);
    }
    for (size_t i = 0; i < total; i++) /* the input is left alone */
      CHILD_CHECK(in[i] == val(rank, i), "reduce_scatter modified its input at %zu", i);
  }
  free(in);
  free(out);
}

static void check_reduce_scatter(dt_comm_t *comm, int rank, int world)
{
  static const size_t equal[] = {0, 1, 5, 200003}; /* 200003 > one 128 Ki-element segment */
  size_t counts[MAX_RANKS];
  for (size_t k = 0; k < DT_ARRAY_SIZE(equal); k++) {
    for (int c = 0; c < world; c++)
      counts[c] = equal[k];
    check_reduce_scatter_counts(comm, rank, world, counts, 1);
  }
  /* Uneven, zeros included (rank 1 gets nothing), one chunk spanning several segments. */
  static const size_t pattern[] = {3, 0, 300001, 1};
  for (int c = 0; c < world; c++)
    counts[c] = pattern[c % 4];
  check_reduce_scatter_counts(comm, rank, world, counts, 0);
  for (int c = 0; c < world; c++)
    counts[c] = (size_t)(world - c) * 1001;
  check_reduce_scatter_counts(comm, rank, world, counts, 0);
}

static void check_all_gather_counts(dt_comm_t *comm, int rank, int world, const size_t *counts,
                                    int equal, int in_place)
{
  size_t total = 0, mine = 0;
  for (int c = 0; c < world; c++) {
    if (c < rank)
      mine += counts[c];
    total += counts[c];
  }
  float *out = alloc_floats(total), *in = in_place ? out + mine : alloc_floats(counts[rank]);
  for (size_t i = 0; i < total; i++)
    out[i] = -1.f;
  for (size_t i = 0; i < counts[rank]; i++)
    in[i] = val(rank, i);
  if (equal)
    CHILD_RC(dt_comm_all_gather(comm, in, out, counts[0]));
  else
    CHILD_RC(dt_comm_all_gather_v(comm, in, out, counts));
  size_t o = 0;
  for (int r = 0; r < world; r++)
    for (size_t i = 0; i < counts[r]; i++, o++)
      CHILD_CHECK(out[o] == val(r, i), "all_gather from rank %d [%zu] = %g, want %g", r, i, out[o],
                  val(r, i));
  if (!in_place)
    free(in);
  free(out);
}

static void check_all_gather(dt_comm_t *comm, int rank, int world)
{
  static const size_t equal[] = {0, 1, 5, 100003};
  size_t counts[MAX_RANKS];
  for (size_t k = 0; k < DT_ARRAY_SIZE(equal); k++) {
    for (int c = 0; c < world; c++)
      counts[c] = equal[k];
    check_all_gather_counts(comm, rank, world, counts, 1, 0);
    check_all_gather_counts(comm, rank, world, counts, 1, 1);
  }
  static const size_t pattern[] = {3, 0, 70001, 1};
  for (int c = 0; c < world; c++)
    counts[c] = pattern[c % 4];
  check_all_gather_counts(comm, rank, world, counts, 0, 0);
  check_all_gather_counts(comm, rank, world, counts, 0, 1);
}

static void check_broadcast(dt_comm_t *comm, int rank, int world)
{
  static const size_t sizes[] = {0, 1, 1000, 300000};
  for (size_t si = 0; si < DT_ARRAY_SIZE(sizes); si++) {
    size_t n = sizes[si];
    float *buf = alloc_floats(n);
    for (int root = 0; root < world; root++) {
      for (size_t i = 0; i < n; i++)
        buf[i] = rank == root ? val(root, i) : -1.f;
      CHILD_RC(dt_comm_broadcast(comm, buf, n, root));
      for (size_t i = 0; i < n; i++)
        CHILD_CHECK(buf[i] == val(root, i), "broadcast n=%zu root=%d [%zu] = %g", n, root, i,
                    buf[i]);
    }
    free(buf);
  }
}

/* The last rank arrives 200 ms late; nobody may leave the barrier before it arrives. The
 * ranks share the host's monotonic clock, so the late rank's arrival time, broadcast as bytes
 * afterwards, is compared with each rank's exit directly (not with each rank's own start,
 * which drifts by however late the rank left the previous barrier). */
static void check_barrier(dt_comm_t *comm, int rank, int world)
{
  CHILD_RC(dt_comm_barrier(comm));
  double arrived = 0;
  if (rank == world - 1) {
    sleep_ms(200);
    arrived = dt_now_ms();
  }
  CHILD_RC(dt_comm_barrier(comm));
  const double left = dt_now_ms();
  float wire[sizeof arrived / sizeof(float)];
  memcpy(wire, &arrived, sizeof arrived);
  CHILD_RC(dt_comm_broadcast(comm, wire, DT_ARRAY_SIZE(wire), world - 1));
  memcpy(&arrived, wire, sizeof arrived);
  CHILD_CHECK(left >= arrived, "left the barrier %.1f ms before the late rank arrived",
              arrived - left);
}

static void collectives_rank(const ctx_t *c, int rank)
{
  dt_comm_t *comm = child_comm(c, rank);
  check_all_reduce(comm, rank, c->world);
  check_reduce_scatter(comm, rank, c->world);
  check_all_gather(comm, rank, c->world);
  check_broadcast(comm, rank, c->world);
  check_barrier(comm, rank, c->world);
  dt_comm_destroy(comm);
}

START_TEST(test_collectives)
{
  ctx_t c;
  ctx_init(&c, _i, 10000, "job1/gen0");
  run_all(&c, collectives_rank, 25000);
  ut_rm_rf(c.dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Point-to-point                                                                              */
/* ------------------------------------------------------------------------------------------ */

static void p2p_rank(const ctx_t *c, int rank)
{
  dt_comm_t *comm = child_comm(c, rank);
  const int w = c->world, right = (rank + 1) % w, left = (rank + w - 1) % w;
  const size_t n = 250000;
  float *a = alloc_floats(n), *b = alloc_floats(n);

  /* A ring shift: every rank sends and receives at once (blocking send-then-recv would
   * deadlock here). Then the same with zero bytes. */
  for (size_t i = 0; i < n; i++)
    a[i] = val(rank, i);
  CHILD_RC(dt_comm_sendrecv(comm, a, n * sizeof *a, right, b, n * sizeof *b, left, 7));
  for (size_t i = 0; i < n; i++)
    CHILD_CHECK(b[i] == val(left, i), "sendrecv [%zu] = %g", i, b[i]);
  CHILD_RC(dt_comm_sendrecv(comm, NULL, 0, right, NULL, 0, left, 8));

  /* A batch with both neighbours at once, as an interleaved pipeline step posts it:
   * activations to the right and gradients to the left on two tags (with two ranks both
   * neighbours are the same peer), two messages of one tag in a row, then the bodies. */
  enum { K = 1000 };
  float *in = alloc_floats(4 * K);
  for (size_t i = 0; i < 4 * K; i++)
    a[i] = val(rank, i);
  const dt_comm_p2p_t batch[6] = {
      {in + 0 * K, K * sizeof *in, left, 0, 1}, {a + 0 * K, K * sizeof *a, right, 0, 0},
      {a + 1 * K, K * sizeof *a, left, 1, 0},   {in + 1 * K, K * sizeof *in, right, 1, 1},
      {a + 2 * K, K * sizeof *a, right, 0, 0},  {in + 2 * K, K * sizeof *in, left, 0, 1},
  };
  CHILD_RC(dt_comm_p2p(comm, batch, 6));
  for (size_t i = 0; i < K; i++) {
    CHILD_CHECK(in[i] == val(left, i), "batch activation [%zu] = %g", i, in[i]);
    CHILD_CHECK(in[K + i] == val(right, K + i), "batch gradient [%zu] = %g", i, in[K + i]);
    CHILD_CHECK(in[2 * K + i] == val(left, 2 * K + i), "batch 2nd activation [%zu]", i);
  }
  CHILD_CHECK(dt_comm_p2p(comm, batch, 0) == DT_EINVAL, "empty batch");
  CHILD_CHECK(dt_comm_p2p(comm, batch, DT_COMM_P2P_MAX + 1) == DT_EINVAL, "batch too long");
  free(in);

  /* Blocking send/recv along a chain 0 -> 1 -> ... -> w-1, two tags in flight, in order. */
  for (int t = 0; t < 2; t++) {
    if (rank > 0) {
      CHILD_RC(dt_comm_recv(comm, b, (size_t)(t + 1) * 1000 * sizeof *b, rank - 1, t));
      for (size_t i = 0; i < (size_t)(t + 1) * 1000; i++)
        CHILD_CHECK(b[i] == val(0, i + (size_t)t), "recv tag %d [%zu] = %g", t, i, b[i]);
    } else {
      for (size_t i = 0; i < n; i++)
        b[i] = val(0, i + (size_t)t);
    }
    if (rank < w - 1)
      CHILD_RC(dt_comm_send(comm, b, (size_t)(t + 1) * 1000 * sizeof *b, rank + 1, t));
  }

  /* Argument errors are caught before any traffic and leave the communicator usable. */
  CHILD_CHECK(dt_comm_send(comm, a, 4, rank, 0) == DT_EINVAL, "send to self");
  CHILD_CHECK(dt_comm_send(comm, a, 4, w, 0) == DT_EINVAL, "send out of range");
  CHILD_CHECK(dt_comm_recv(comm, a, 4, right, -1) == DT_EINVAL, "negative tag");
  CHILD_RC(dt_comm_barrier(comm));
  free(a);
  free(b);
  dt_comm_destroy(comm);
}

START_TEST(test_p2p)
{
  ctx_t c;
  ctx_init(&c, _i, 10000, "job1/gen0");
  run_all(&c, p2p_rank, 15000);
  ut_rm_rf(c.dir);
}
END_TEST

/* A receive expecting a different size, smaller or larger than the message, fails on both
 * sides instead of corrupting memory, ending the process or taking part of a message for all
 * of it: the sender finds the mismatch (DT_ESHAPE) before its payload leaves, the receiver
 * sees its peer fail. */
static void p2p_mismatch_rank(const ctx_t *c, int rank)
{
  dt_comm_t *comm = child_comm(c, rank);
  float buf[64] = {0};
  const size_t want = c->arg ? sizeof buf : sizeof buf / 2; /* the receiver's size */
  int rc;
  if (rank == 0) {
    rc = dt_comm_send(comm, buf, c->arg ? sizeof buf / 2 : sizeof buf, 1, 3);
    CHILD_CHECK(rc == DT_ESHAPE, "sender got %s", dt_err_name(rc));
    /* The communicator is poisoned: the next operation fails at once with the same error. */
    CHILD_CHECK(dt_comm_barrier(comm) == DT_ESHAPE, "poisoned");
  } else {
    rc = dt_comm_recv(comm, buf, want, 0, 3);
    CHILD_CHECK(rc == DT_EREMOTE, "receiver got %s", dt_err_name(rc));
  }
  dt_comm_destroy(comm);
}

START_TEST(test_p2p_size_mismatch)
{
  ctx_t c;
  ctx_init(&c, 2, 5000, "job1/gen0");
  c.arg = _i; /* 0: the message is larger than the receive, 1: smaller */
  run_all(&c, p2p_mismatch_rank, 10000);
  ut_rm_rf(c.dir);
}
END_TEST

/* dt_comm_p2p_post waits for its sends only. Rank 1 sends rank 0's two receives (tag 1, one
 * (peer, tag) pair: they pair up in order) only after a "go" that rank 0 sends once its post
 * has returned, so a post that waited for its receives would time out. Rank 0 waits for them
 * in reverse order, each wait an operation of its own ("recv", with the bytes the post does not
 * count), then leaves one receive to dt_comm_destroy and waits for another after an abort,
 * which fails at once and frees it (the sanitizer build's leak check sees both). */
static int nrecv_waits;
static size_t post_bytes; /* the batch's: its send only */

static void count_recv_waits(void *ud, const dt_comm_event_t *e)
{
  (void)ud;
  nrecv_waits += e->end && strcmp(e->op, "recv") == 0 && e->bytes == 400 * sizeof(float);
  if (e->end && strcmp(e->op, "send/recv") == 0)
    post_bytes = e->bytes;
}

static void p2p_post_rank(const ctx_t *c, int rank)
{
  dt_comm_t *comm = child_comm(c, rank);
  float a[400], b[400], x[400], y[400], go = 1.f;
  if (rank == 0) {
    for (size_t i = 0; i < DT_ARRAY_SIZE(a); i++)
      a[i] = val(0, i), b[i] = x[i] = y[i] = -1.f;
    dt_comm_set_observer(comm, count_recv_waits, NULL);
    const dt_comm_p2p_t ops[] = {
        {a, sizeof a, 1, 0, 0}, {b, sizeof b, 1, 1, 1}, {x, sizeof x, 1, 1, 1}};
    dt_comm_pending_t *req[3];
    CHILD_RC(dt_comm_p2p_post(comm, ops, 3, req));
    CHILD_CHECK(!req[0] && req[1] && req[2], "pending %p %p %p", (void *)req[0], (void *)req[1],
                (void *)req[2]);
    CHILD_RC(dt_comm_send(comm, &go, sizeof go, 1, 2));
    CHILD_RC(dt_comm_p2p_wait(comm, req[2]));
    CHILD_RC(dt_comm_p2p_wait(comm, req[1]));
    CHILD_RC(dt_comm_p2p_wait(comm, NULL));
    CHILD_CHECK(nrecv_waits == 2 && post_bytes == sizeof a, "%d waits observed as recv, %zu bytes",
                nrecv_waits, post_bytes);
    for (size_t i = 0; i < DT_ARRAY_SIZE(b); i++)
      CHILD_CHECK(b[i] == val(1, i) && x[i] == val(1, i + 1), "[%zu] = %g, %g", i, b[i], x[i]);
    const dt_comm_p2p_t left[] = {{y, sizeof y, 1, 3, 1}}, late[] = {{y, sizeof y, 1, 4, 1}};
    CHILD_RC(dt_comm_p2p_post(comm, left, 1, req));
    CHILD_RC(dt_comm_barrier(comm)); /* rank 1's send of it is done: destroy drops it */
    CHILD_RC(dt_comm_p2p_post(comm, late, 1, req + 1));
    CHILD_RC(dt_comm_abort(comm));
    const int rc = dt_comm_p2p_wait(comm, req[1]);
    CHILD_CHECK(rc == DT_ECANCELED, "a wait after abort: %s", dt_err_name(rc));
  } else {
    CHILD_RC(dt_comm_recv(comm, a, sizeof a, 0, 0));
    CHILD_CHECK(a[399] == val(0, 399), "a[399] = %g", a[399]);
    CHILD_RC(dt_comm_recv(comm, &go, sizeof go, 0, 2));
    for (size_t i = 0; i < DT_ARRAY_SIZE(b); i++)
      b[i] = val(1, i), x[i] = val(1, i + 1);
    CHILD_RC(dt_comm_send(comm, b, sizeof b, 0, 1));
    CHILD_RC(dt_comm_send(comm, x, sizeof x, 0, 1));
    CHILD_RC(dt_comm_send(comm, b, sizeof b, 0, 3));
    CHILD_RC(dt_comm_barrier(comm));
    const int rc = dt_comm_recv(comm, y, sizeof y, 0, 5); /* until rank 0 aborts */
    CHILD_CHECK(rc == DT_EREMOTE, "rank 1 got %s once rank 0 aborted", dt_err_name(rc));
  }
  dt_comm_destroy(comm);
}

START_TEST(test_p2p_post)
{
  ctx_t c;
  ctx_init(&c, 2, 3000, "job1/gen0");
  run_all(&c, p2p_post_rank, 10000);
  ut_rm_rf(c.dir);
}
END_TEST

/* A peer that got everything it needed and left while we were blocked on another peer is not
 * a failure. Rank 0 sends to rank 1 and receives from rank 2, which comes 400 ms late; rank 1
 * takes its message and destroys its communicator meanwhile. Rank 0's watchdog interrupts the
 * wait on rank 2 (a pair failed) and so sets Gloo's abort flag on every buffer of the
 * operation: the send to rank 1 has completed, and its wait, which finds rank 1 gone, must take
 * that completion rather than the stale abort flag (a barrier in CI failed so, under load). */
static void p2p_peer_left_rank(const ctx_t *c, int rank)
{
  dt_comm_t *comm = child_comm(c, rank);
  float buf[256];
  for (size_t i = 0; i < DT_ARRAY_SIZE(buf); i++)
    buf[i] = rank == 0 ? -1.f : val(rank, i);
  if (rank == 0) {
    float out[256];
    for (size_t i = 0; i < DT_ARRAY_SIZE(out); i++)
      out[i] = val(0, i);
    const dt_comm_p2p_t ops[] = {
        {.buf = buf, .bytes = sizeof buf, .peer = 2, .tag = 0, .recv = 1},
        {.buf = out, .bytes = sizeof out, .peer = 1, .tag = 0, .recv = 0},
    };
    CHILD_RC(dt_comm_p2p(comm, ops, 2));
    for (size_t i = 0; i < DT_ARRAY_SIZE(buf); i++)
      CHILD_CHECK(buf[i] == val(2, i), "[%zu] = %g", i, buf[i]);
  } else if (rank == 1) {
    CHILD_RC(dt_comm_recv(comm, buf, sizeof buf, 0, 0));
    CHILD_CHECK(buf[255] == val(0, 255), "rank 1 got %g", buf[255]);
  } else {
    sleep_ms(400);
    CHILD_RC(dt_comm_send(comm, buf, sizeof buf, 0, 0));
  }
  dt_comm_destroy(comm);
}

START_TEST(test_p2p_peer_left_during_wait)
{
  ctx_t c;
  ctx_init(&c, 3, 10000, "job1/gen0");
  run_all(&c, p2p_peer_left_rank, 15000);
  ut_rm_rf(c.dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Split                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* World 4 -> two groups by rank parity, with keys reversing the order inside each group; then
 * a second split (tp-like pairs {0,1}, {2,3}) with rank 3 opting out; collectives in each. */
static void split_rank(const ctx_t *c, int rank)
{
  dt_comm_t *comm = child_comm(c, rank), *dp = NULL, *tp = NULL;
  int color = rank % 2;
  CHILD_RC(dt_comm_split(comm, color, -rank, &dp));
  CHILD_CHECK(dp != NULL, "no sub-communicator");
  /* members of color k: {k, k+2}; key -rank puts the higher parent rank first */
  int want_rank = rank < 2 ? 1 : 0;
  CHILD_CHECK(dt_comm_world(dp) == 2 && dt_comm_rank(dp) == want_rank, "dp rank %d/%d",
              dt_comm_rank(dp), dt_comm_world(dp));
  CHILD_CHECK(strcmp(dt_comm_prefix(dp), color ? "job1/gen0/split0/c1" : "job1/gen0/split0/c0") ==
                  0,
              "prefix %s", dt_comm_prefix(dp));
  float x[3] = {(float)rank, 1.f, (float)(10 * rank)};
  CHILD_RC(dt_comm_all_reduce(dp, x, 3, DT_COMM_SUM));
  float want0 = (float)(color + color + 2);
  CHILD_CHECK(x[0] == want0 && x[1] == 2.f && x[2] == 10.f * want0, "dp sum %g %g %g", x[0], x[1],
              x[2]);
  float g[2] = {0};
  float mine = (float)rank;
  CHILD_RC(dt_comm_all_gather(dp, &mine, g, 1));
  CHILD_CHECK(g[0] == (float)(color + 2) && g[1] == (float)color, "dp gather %g %g", g[0], g[1]);

  /* The parent still works alongside its child. */
  float y = 1.f;
  CHILD_RC(dt_comm_all_reduce(comm, &y, 1, DT_COMM_SUM));
  CHILD_CHECK(y == 4.f, "parent sum %g", y);

  CHILD_RC(dt_comm_split(comm, rank == 3 ? DT_COMM_NO_COLOR : rank / 2, 0, &tp));
  if (rank == 3) {
    CHILD_CHECK(tp == NULL, "opted-out rank got a communicator");
  } else {
    CHILD_CHECK(tp != NULL && dt_comm_world(tp) == (rank < 2 ? 2 : 1) &&
                    dt_comm_rank(tp) == rank % 2,
                "tp rank %d/%d", tp ? dt_comm_rank(tp) : -1, tp ? dt_comm_world(tp) : -1);
    float z = (float)(rank + 1);
    CHILD_RC(dt_comm_all_reduce(tp, &z, 1, DT_COMM_AVG));
    CHILD_CHECK(z == (rank < 2 ? 1.5f : 3.f), "tp avg %g", z);
  }
  /* Children and parent are independent: destroy the parent first. */
  dt_comm_destroy(comm);
  CHILD_RC(dt_comm_barrier(dp));
  dt_comm_destroy(dp);
  dt_comm_destroy(tp);
}

START_TEST(test_split)
{
  ctx_t c;
  ctx_init(&c, 4, 10000, "job1/gen0");
  run_all(&c, split_rank, 15000);
  ut_rm_rf(c.dir);
}
END_TEST

static int count_fds(void)
{
  return ut_count_entries("/proc/self/fd", NULL);
}

/* Many short generations back to back, each ending with ranks destroying their communicator
 * as soon as their own part of the last operation is done, while peers may still be finishing
 * theirs: a peer that has sent everything and left is not a failure. Nothing leaks (threads
 * are joined, sockets and the event loop closed). */
static void generations_rank(const ctx_t *c, int rank)
{
  static dt_kv_t kv;
  CHILD_RC(dt_kv_file_create(&kv, c->dir));
  int fds0 = count_fds();
  float buf[1000];
  for (int gen = 0; gen < 25; gen++) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "job1/gen%d", gen);
    dt_comm_t *comm = NULL;
    CHILD_RC(dt_comm_init(&comm, "cpu", &kv, prefix, rank, c->world, c->timeout_ms));
    for (size_t i = 0; i < 1000; i++)
      buf[i] = val(rank, i);
    CHILD_RC(dt_comm_all_reduce(comm, buf, 1000, DT_COMM_SUM));
    CHILD_CHECK(buf[999] == sum_over(c->world, 999), "gen %d sum", gen);
    CHILD_RC(dt_comm_barrier(comm));
    if (gen % 2)
      CHILD_RC(dt_comm_broadcast(comm, buf, 1000, gen % c->world));
    dt_comm_destroy(comm);
  }
  int fds1 = count_fds();
  CHILD_CHECK(fds1 == fds0, "file descriptors: %d before, %d after", fds0, fds1);
}

START_TEST(test_generations_back_to_back)
{
  ctx_t c;
  ctx_init(&c, _i, 10000, "unused");
  run_all(&c, generations_rank, 20000);
  ut_rm_rf(c.dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Failures                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* Ranks 0 and 1 of a world of 4 start; 2 and 3 never do. */
static void missing_rank(const ctx_t *c, int rank)
{
  dt_kv_t kv;
  CHILD_RC(dt_kv_file_create(&kv, c->dir));
  dt_comm_t *comm = (dt_comm_t *)&kv; /* must be overwritten with NULL */
  double t0 = dt_now_ms();
  int rc = dt_comm_init(&comm, "cpu", &kv, c->prefix, rank, c->world, c->timeout_ms);
  double dt = dt_now_ms() - t0;
  CHILD_CHECK(rc == DT_ETIMEDOUT, "init returned %s", dt_err_name(rc));
  CHILD_CHECK(comm == NULL, "*out set on failure");
  CHILD_CHECK(dt >= c->timeout_ms - 5 && dt < c->timeout_ms + 1500, "timed out after %.0f ms", dt);
}

START_TEST(test_missing_peer_times_out)
{
  ctx_t c;
  ctx_init(&c, 4, 800, "job1/gen0");
  int ranks[2] = {0, 1};
  pid_t pids[2] = {0};
  spawn(&c, missing_rank, ranks, 2, pids, 1);
  reap(pids, 2, 5000, NULL);
  char *log = read_log(&c);
  ck_assert_msg(strstr(log, "rank 0/4: rendezvous timed out after 800 ms; missing ranks 2, 3"),
                "log does not name the missing ranks:\n%s", log);
  ck_assert_msg(strstr(log, "rank 1/4: rendezvous timed out after 800 ms; missing ranks 2, 3"),
                "log does not name the missing ranks:\n%s", log);
  free(log);
  ut_rm_rf(c.dir);
}
END_TEST

/* All ranks loop on all-reduces of 4 MiB; the last rank is SIGKILLed by the test after 700 ms,
 * usually in the middle of a message. Survivors must report an error (never hang, never die)
 * long before the timeout. */
static void killed_peer_rank(const ctx_t *c, int rank)
{
  dt_comm_t *comm = child_comm(c, rank);
  const size_t n = 1 << 20;
  float *buf = alloc_floats(n);
  for (size_t i = 0; i < n; i++)
    buf[i] = 0.f;
  int rc = 0;
  for (int it = 0; it < 100000 && rc == 0; it++)
    rc = dt_comm_all_reduce(comm, buf, n, DT_COMM_SUM);
  CHILD_CHECK(rc == DT_EREMOTE || rc == DT_ETIMEDOUT, "all_reduce returned %s", dt_err_name(rc));
  CHILD_CHECK(dt_comm_all_reduce(comm, buf, 1, DT_COMM_SUM) == rc, "poisoned communicator");
  free(buf);
  dt_comm_destroy(comm);
}

START_TEST(test_killed_peer_fails_collective)
{
  ctx_t c;
  ctx_init(&c, _i, 4000, "job1/gen0");
  int ranks[MAX_RANKS];
  pid_t pids[MAX_RANKS] = {0};
  for (int r = 0; r < c.world; r++)
    ranks[r] = r;
  spawn(&c, killed_peer_rank, ranks, c.world, pids, 1);
  sleep_ms(700);
  ck_assert_int_eq(kill(pids[c.world - 1], SIGKILL), 0);
  double t0 = dt_now_ms();
  int st[MAX_RANKS];
  reap(pids, c.world - 1, c.timeout_ms + 3000, st);
  double dt = dt_now_ms() - t0;
  int victim;
  waitpid(pids[c.world - 1], &victim, 0);
  char *log = read_log(&c);
  for (int r = 0; r < c.world - 1; r++)
    ck_assert_msg(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "rank %d status 0x%x; log:\n%s", r,
                  st[r], log);
  /* A dead peer's sockets close at once: survivors must notice long before the timeout. */
  ck_assert_msg(dt < c.timeout_ms / 2, "survivors took %.0f ms; log:\n%s", dt, log);
  free(log);
  ut_rm_rf(c.dir);
}
END_TEST

typedef struct {
  dt_comm_t *comm;
  int delay_ms;
} aborter_t;

static void *aborter(void *arg)
{
  aborter_t *a = arg;
  sleep_ms(a->delay_ms);
  dt_comm_abort(a->comm);
  return NULL;
}

/* Rank 0 blocks in an all-reduce that rank 1 never joins (rank 1 waits in a recv instead); a
 * second thread aborts rank 0 after 300 ms. Rank 0's all-reduce must return DT_ECANCELED at
 * once, and rank 1's recv must see the failure (DT_EREMOTE) long before the 20 s timeout. */
static void abort_rank(const ctx_t *c, int rank)
{
  dt_comm_t *comm = child_comm(c, rank);
  float buf[1000] = {0};
  double t0 = dt_now_ms();
  if (rank == 0) {
    pthread_t th;
    aborter_t a = {comm, 300};
    CHILD_CHECK(pthread_create(&th, NULL, aborter, &a) == 0, "pthread_create");
    int rc = dt_comm_all_reduce(comm, buf, 1000, DT_COMM_SUM);
    double dt = dt_now_ms() - t0;
    pthread_join(th, NULL);
    CHILD_CHECK(rc == DT_ECANCELED, "aborted all_reduce returned %s", dt_err_name(rc));
    CHILD_CHECK(dt >= 290 && dt < 2000, "abort took effect after %.0f ms", dt);
    /* Later operations fail at once; abort is idempotent. */
    CHILD_CHECK(dt_comm_barrier(comm) == DT_ECANCELED, "after abort");
    CHILD_CHECK(dt_comm_abort(comm) == 0, "second abort");
    CHILD_CHECK(dt_comm_send(comm, buf, 4, 1, 0) == DT_ECANCELED, "after abort");
  } else {
    int rc = dt_comm_recv(comm, buf, sizeof buf, 0, 0);
    double dt = dt_now_ms() - t0;
    CHILD_CHECK(rc == DT_EREMOTE, "peer of aborted rank got %s", dt_err_name(rc));
    CHILD_CHECK(dt < 3000, "peer noticed after %.0f ms", dt);
  }
  dt_comm_destroy(comm);
}

START_TEST(test_abort_unblocks)
{
  ctx_t c;
  ctx_init(&c, 2, 20000, "job1/gen0");
  run_all(&c, abort_rank, 10000);
  ut_rm_rf(c.dir);
}
END_TEST

/* An abort before any operation, and an abort of a communicator in the middle of a split:
 * rank 1 never calls split, so rank 0 waits in it until its own thread aborts the parent. */
static void abort_split_rank(const ctx_t *c, int rank)
{
  dt_comm_t *comm = child_comm(c, rank), *sub = NULL;
  if (rank == 0) {
    pthread_t th;
    aborter_t a = {comm, 300};
    CHILD_CHECK(pthread_create(&th, NULL, aborter, &a) == 0, "pthread_create");
    double t0 = dt_now_ms();
    int rc = dt_comm_split(comm, 0, 0, &sub);
    double dt = dt_now_ms() - t0;
    pthread_join(th, NULL);
    CHILD_CHECK(rc == DT_ECANCELED && sub == NULL, "split returned %s", dt_err_name(rc));
    CHILD_CHECK(dt < 2000, "abort took %.0f ms", dt);
  } else {
    sleep_ms(600);
    CHILD_RC(dt_comm_abort(comm));
    float x = 0;
    CHILD_CHECK(dt_comm_all_reduce(comm, &x, 1, DT_COMM_SUM) == DT_ECANCELED, "after abort");
  }
  dt_comm_destroy(comm);
}

START_TEST(test_abort_split)
{
  ctx_t c;
  ctx_init(&c, 2, 20000, "job1/gen0");
  run_all(&c, abort_split_rank, 10000);
  ut_rm_rf(c.dir);
}
END_TEST

static void gen_ok_rank(const ctx_t *c, int rank)
{
  dt_comm_t *comm = child_comm(c, rank);
  float x = 1.f;
  CHILD_RC(dt_comm_all_reduce(comm, &x, 1, DT_COMM_SUM));
  CHILD_CHECK(x == (float)c->world, "sum %g", x);
  dt_comm_destroy(comm);
}

/* Generation 0 completes and leaves its keys behind. In generation 1 only rank 0 starts: it
 * must time out rather than connect to generation 0's stale addresses. Then a full
 * generation 1 succeeds beside the stale keys. */
START_TEST(test_stale_generation_ignored)
{
  ctx_t c;
  ctx_init(&c, 2, 600, "job1/gen0");
  c.timeout_ms = 10000;
  run_all(&c, gen_ok_rank, 15000);
  ck_assert_int_eq(ut_count_entries(c.dir, "job1%2Fgen0%2Fcpu%2Faddr%2F"), 2);

  snprintf(c.prefix, sizeof c.prefix, "job1/gen1");
  c.timeout_ms = 600;
  c.world = 2;
  int ranks[1] = {0};
  pid_t pids[1] = {0};
  spawn(&c, missing_rank, ranks, 1, pids, 1);
  reap(pids, 1, 5000, NULL);
  char *log = read_log(&c);
  ck_assert_msg(strstr(log, "missing rank 1"), "log:\n%s", log);
  free(log);

  snprintf(c.prefix, sizeof c.prefix, "job1/gen2");
  c.timeout_ms = 10000;
  run_all(&c, gen_ok_rank, 15000);
  ck_assert_int_eq(ut_count_entries(c.dir, "job1%2Fgen1%2Fcpu%2Faddr%2F"), 1);
  ck_assert_int_eq(ut_count_entries(c.dir, "job1%2Fgen2%2Fcpu%2Faddr%2F"), 2);
  ut_rm_rf(c.dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* One process: threads as ranks, world 1, argument checks                                     */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
  dt_kv_t *kv;
  int rank, world, rc;
  float out[4];
} thread_rank_t;

static void *thread_rank(void *arg)
{
  thread_rank_t *t = arg;
  dt_comm_t *comm = NULL;
  t->rc = dt_comm_init(&comm, NULL, t->kv, "threads/gen0", t->rank, t->world, 10000);
  if (t->rc < 0)
    return NULL;
  float in[2] = {(float)t->rank, (float)(t->rank * 2)};
  t->rc = dt_comm_all_reduce(comm, in, 2, DT_COMM_SUM);
  if (t->rc == 0)
    t->rc = dt_comm_all_gather(comm, in, t->out, 2);
  dt_comm_destroy(comm);
  return NULL;
}

START_TEST(test_threads_mem_kv)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  pthread_t th[2];
  thread_rank_t t[2];
  for (int r = 0; r < 2; r++) {
    t[r] = (thread_rank_t){.kv = &kv, .rank = r, .world = 2};
    ck_assert_int_eq(pthread_create(&th[r], NULL, thread_rank, &t[r]), 0);
  }
  for (int r = 0; r < 2; r++) {
    pthread_join(th[r], NULL);
    ck_assert_int_eq(t[r].rc, 0);
    ck_assert(t[r].out[0] == 1.f && t[r].out[1] == 2.f && t[r].out[2] == 1.f && t[r].out[3] == 2.f);
  }
  dt_kv_mem_destroy(&kv);
}
END_TEST

/* Progress: rank 1 holds back while rank 0 waits in an all-reduce; dt_comm_progress, from a
 * third thread, shows rank 0 blocked in operation #2 of the group and rank 1 still at #1. */
typedef struct {
  dt_kv_t *kv;
  int rank, rc;
  atomic_int *go;
} progress_rank_t;

static void *progress_rank(void *arg)
{
  progress_rank_t *t = arg;
  dt_comm_t *comm = NULL;
  t->rc = dt_comm_init(&comm, NULL, t->kv, "progress/gen0", t->rank, 2, 10000);
  if (t->rc < 0)
    return NULL;
  dt_comm_set_label(comm, "dp");
  t->rc = dt_comm_barrier(comm);
  while (t->rc == 0 && t->rank == 1 && !atomic_load(t->go))
    sleep_ms(5);
  float x[3] = {1, 2, 3};
  if (t->rc == 0)
    t->rc = dt_comm_all_reduce(comm, x, 3, DT_COMM_SUM);
  dt_comm_destroy(comm);
  return NULL;
}

START_TEST(test_progress)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  atomic_int go;
  atomic_init(&go, 0);
  pthread_t th[2];
  progress_rank_t t[2];
  for (int r = 0; r < 2; r++) {
    t[r] = (progress_rank_t){.kv = &kv, .rank = r, .go = &go};
    ck_assert_int_eq(pthread_create(&th[r], NULL, progress_rank, &t[r]), 0);
  }
  dt_comm_progress_t p[4], *waiter = NULL, *late = NULL;
  for (double t0 = dt_now_ms(); !waiter && dt_now_ms() - t0 < 10000; sleep_ms(5)) {
    int n = dt_comm_progress(p, 4);
    ck_assert_int_le(n, 2);
    for (int i = 0; i < n; i++)
      if (p[i].rank == 0 && p[i].op && p[i].waiting_ms >= 100)
        waiter = &p[i];
    for (int i = 0; waiter && i < n; i++)
      late = p[i].rank == 1 ? &p[i] : late;
  }
  ck_assert_msg(waiter, "rank 0 never showed as waiting in its all-reduce");
  ck_assert_ptr_nonnull(late);
  ck_assert_str_eq(waiter->op, "all_reduce");
  ck_assert_str_eq(waiter->label, "dp");
  ck_assert_str_eq(waiter->group, "progress/gen0");
  ck_assert_str_eq(late->group, waiter->group);
  ck_assert_int_eq(waiter->world, 2);
  ck_assert_int_eq(waiter->npeers, 0);
  ck_assert(waiter->entered == 2 && waiter->done == 1);
  ck_assert(late->entered == 1 && late->done == 1 && late->op == NULL);
  atomic_store(&go, 1);
  for (int r = 0; r < 2; r++) {
    pthread_join(th[r], NULL);
    ck_assert_int_eq(t[r].rc, 0);
  }
  ck_assert_int_eq(dt_comm_progress(p, 4), 0); /* destroyed communicators leave the list */
  dt_kv_mem_destroy(&kv);
}
END_TEST

/* Device memory on the host-staged backend: buffers of the remote CPU device (whose pointers
 * fault if the host dereferences them, kernels/device.h) in every operation, mixed with host
 * buffers, and in a split that inherits the staging. Without staging Gloo would touch them. */
typedef struct {
  dt_kv_t *kv;
  int rank, rc;
  float reduced[2], gathered[4], scattered, bcast[2], got[3], posted[2], sub[2];
} staged_rank_t;

static int staged_is_device(void *ud, const void *p)
{
  dt_device_t *d = ud;
  return d->owns(d, p);
}

static int staged_copy(void *ud, void *dst, const void *src, size_t bytes, int to_host)
{
  dt_device_t *d = ud;
  return d->copy(d, dst, src, bytes, to_host ? DT_COPY_D2H : DT_COPY_H2D);
}

/* Runs the operations on device buffers, reading each result back to the host. */
static int staged_ops(dt_comm_t *comm, dt_device_t *d, staged_rank_t *t)
{
  const int r = t->rank;
  float *buf, *out, *big;
  DT_CHECK(d->alloc(d, 8 * sizeof(float), "test", (void **)&buf));
  DT_CHECK(d->alloc(d, 8 * sizeof(float), "test", (void **)&out));
  DT_CHECK(d->alloc(d, 8 * sizeof(float), "test", (void **)&big));
  float h[4] = {1.0f + r, 10.0f * (r + 1), 100.0f + r, 1000.0f + r};
  DT_CHECK(d->copy(d, buf, h, sizeof h, DT_COPY_H2D));
  DT_CHECK(dt_comm_all_reduce(comm, buf, 2, DT_COMM_SUM));
  DT_CHECK(d->copy(d, t->reduced, buf, 2 * sizeof(float), DT_COPY_D2H));
  DT_CHECK(dt_comm_all_gather(comm, buf + 2, t->gathered, 2));      /* device in, host out */
  DT_CHECK(dt_comm_reduce_scatter(comm, buf, out, 1, DT_COMM_SUM)); /* device in and out */
  DT_CHECK(d->copy(d, &t->scattered, out, sizeof(float), DT_COPY_D2H));
  DT_CHECK(d->copy(d, big, h, sizeof h, DT_COPY_H2D));
  DT_CHECK(dt_comm_broadcast(comm, big, 2, 1));
  DT_CHECK(d->copy(d, t->bcast, big, 2 * sizeof(float), DT_COPY_D2H));
  float mine[3] = {7.0f * (r + 1), 8.0f * (r + 1), 9.0f * (r + 1)};
  DT_CHECK(d->copy(d, big, mine, sizeof mine, DT_COPY_H2D));
  DT_CHECK(dt_comm_sendrecv(comm, big, sizeof mine, 1 - r, out, sizeof mine, 1 - r, 3));
  DT_CHECK(d->copy(d, t->got, out, sizeof mine, DT_COPY_D2H));
  /* A staged receive is complete when dt_comm_p2p_post returns: nothing is left in flight. */
  const dt_comm_p2p_t ops[] = {{big, sizeof mine, 1 - r, 4, 0}, {out, sizeof mine, 1 - r, 4, 1}};
  dt_comm_pending_t *req[2] = {NULL, NULL};
  DT_CHECK(dt_comm_p2p_post(comm, ops, 2, req));
  if (req[0] || req[1])
    return DT_EINVAL;
  DT_CHECK(d->copy(d, t->posted, out, 2 * sizeof(float), DT_COPY_D2H));
  dt_comm_t *sub = NULL;
  DT_CHECK(dt_comm_split(comm, 0, -r, &sub)); /* reversed ranks */
  DT_CHECK(d->copy(d, buf, h, 2 * sizeof(float), DT_COPY_H2D));
  int rc = dt_comm_all_gather(sub, buf, big, 1);
  if (rc == 0)
    rc = d->copy(d, t->sub, big, 2 * sizeof(float), DT_COPY_D2H);
  dt_comm_destroy(sub);
  d->free(d, buf);
  d->free(d, out);
  d->free(d, big);
  return rc;
}

static void *staged_rank(void *arg)
{
  staged_rank_t *t = arg;
  dt_device_t *d = dt_device_cpu_remote();
  const dt_comm_device_t dev = {d, staged_is_device, staged_copy, NULL, NULL, NULL};
  const dt_comm_device_t no_copy = {d, staged_is_device, NULL, NULL, NULL, NULL};
  dt_comm_t *comm = NULL;
  t->rc = dt_comm_init(&comm, "cpu", t->kv, "staged/gen0", t->rank, 2, 10000);
  if (t->rc < 0)
    return NULL;
  t->rc = dt_comm_set_device(comm, &no_copy) == DT_EINVAL ? dt_comm_set_device(comm, &dev) : -1;
  if (t->rc == 0)
    t->rc = staged_ops(comm, d, t);
  dt_comm_destroy(comm);
  return NULL;
}

START_TEST(test_device_buffers_staged)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  pthread_t th[2];
  staged_rank_t t[2];
  for (int r = 0; r < 2; r++) {
    t[r] = (staged_rank_t){.kv = &kv, .rank = r};
    ck_assert_int_eq(pthread_create(&th[r], NULL, staged_rank, &t[r]), 0);
  }
  for (int r = 0; r < 2; r++)
    pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++) {
    const staged_rank_t *x = &t[r];
    ck_assert_int_eq(x->rc, 0);
    ck_assert(x->reduced[0] == 3.0f && x->reduced[1] == 30.0f);
    ck_assert(x->gathered[0] == 100.0f && x->gathered[1] == 1000.0f && x->gathered[2] == 101.0f &&
              x->gathered[3] == 1001.0f);
    ck_assert(x->scattered == 2 * x->reduced[r]);           /* chunk r of the pair, summed again */
    ck_assert(x->bcast[0] == 2.0f && x->bcast[1] == 20.0f); /* rank 1's */
    const int o = 2 - r;                                    /* the peer's multiplier */
    ck_assert(x->got[0] == 7.0f * o && x->got[1] == 8.0f * o && x->got[2] == 9.0f * o);
    ck_assert(x->posted[0] == 7.0f * o && x->posted[1] == 8.0f * o); /* its first 2 floats */
    ck_assert(x->sub[0] == 2.0f && x->sub[1] == 1.0f);               /* sub rank 0 is rank 1 */
  }
  dt_kv_mem_destroy(&kv);
}
END_TEST

START_TEST(test_world1)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  dt_comm_t *comm = NULL, *sub = NULL;
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "solo/gen0", 0, 1, 1000), 0);
  float a[3] = {1, 2, 3}, b[3] = {0};
  ck_assert_int_eq(dt_comm_all_reduce(comm, a, 3, DT_COMM_AVG), 0);
  ck_assert(a[0] == 1 && a[1] == 2 && a[2] == 3);
  ck_assert_int_eq(dt_comm_reduce_scatter(comm, a, b, 3, DT_COMM_SUM), 0);
  ck_assert(b[0] == 1 && b[1] == 2 && b[2] == 3);
  memset(b, 0, sizeof b);
  ck_assert_int_eq(dt_comm_all_gather(comm, a, b, 3), 0);
  ck_assert(b[0] == 1 && b[1] == 2 && b[2] == 3);
  ck_assert_int_eq(dt_comm_broadcast(comm, a, 3, 0), 0);
  ck_assert_int_eq(dt_comm_barrier(comm), 0);
  ck_assert_int_eq(dt_comm_split(comm, 5, 0, &sub), 0);
  ck_assert_ptr_nonnull(sub);
  ck_assert_int_eq(dt_comm_world(sub), 1);
  ck_assert_int_eq(dt_comm_all_reduce(sub, a, 3, DT_COMM_SUM), 0);
  dt_comm_destroy(sub);
  ck_assert_int_eq(dt_comm_abort(comm), 0);
  ck_assert_int_eq(dt_comm_barrier(comm), DT_ECANCELED);
  dt_comm_destroy(comm);
  dt_kv_mem_destroy(&kv);
}
END_TEST

typedef struct {
  int calls, rc;
} gate_t;

static int count_gate(void *ud)
{
  gate_t *g = ud;
  g->calls++;
  return g->rc;
}

/* dt_comm_set_gate: every operation calls the gate first, once; a gate's error fails the
 * operation before it runs (the buffer untouched) and poisons nothing; splits do not inherit
 * it. */
START_TEST(test_gate)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  dt_comm_t *comm = NULL, *sub = NULL;
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "gate/gen0", 0, 1, 1000), 0);
  gate_t g = {0, 0};
  dt_comm_set_gate(comm, count_gate, &g);
  float a[2] = {1, 2}, b[2] = {0};
  ck_assert_int_eq(dt_comm_all_reduce(comm, a, 2, DT_COMM_SUM), 0);
  ck_assert_int_eq(dt_comm_reduce_scatter(comm, a, b, 2, DT_COMM_SUM), 0);
  ck_assert_int_eq(dt_comm_all_gather(comm, a, b, 2), 0);
  ck_assert_int_eq(dt_comm_broadcast(comm, a, 2, 0), 0);
  ck_assert_int_eq(dt_comm_barrier(comm), 0);
  ck_assert_int_eq(dt_comm_split(comm, 0, 0, &sub), 0);
  ck_assert_int_eq(g.calls, 6);
  ck_assert_int_eq(dt_comm_all_reduce(sub, a, 2, DT_COMM_SUM), 0);
  ck_assert_int_eq(g.calls, 6);
  g.rc = DT_ECANCELED;
  ck_assert_int_eq(dt_comm_all_gather(comm, (const float[]){5, 6}, b, 2), DT_ECANCELED);
  ck_assert(b[0] == 1 && b[1] == 2);
  ck_assert_int_eq(g.calls, 7);
  dt_comm_set_gate(comm, NULL, NULL);
  ck_assert_int_eq(dt_comm_all_gather(comm, (const float[]){5, 6}, b, 2), 0);
  ck_assert(b[0] == 5 && b[1] == 6);
  ck_assert_int_eq(g.calls, 7);
  dt_comm_destroy(sub);
  dt_comm_destroy(comm);
  dt_kv_mem_destroy(&kv);
}
END_TEST

typedef struct {
  int n;
  dt_comm_event_t e[16];
  char label[16][16];
} observed_t;

static void observe(void *ud, const dt_comm_event_t *e)
{
  observed_t *o = ud;
  ck_assert_int_lt(o->n, 16);
  snprintf(o->label[o->n], sizeof o->label[o->n], "%s", e->label);
  o->e[o->n++] = *e;
}

/* dt_comm_set_observer: a start and a return for every operation that reaches the backend,
 * named, with the bytes it moves for this rank; nothing for argument errors, empty operations
 * or a canceled communicator; splits do not inherit it. */
START_TEST(test_observer)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  dt_comm_t *comm = NULL, *sub = NULL;
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "obs/gen0", 0, 1, 1000), 0);
  dt_comm_set_label(comm, "tp");
  observed_t o = {0};
  dt_comm_set_observer(comm, observe, &o);
  float a[3] = {1, 2, 3}, b[3] = {0};
  const size_t counts[1] = {2};
  ck_assert_int_eq(dt_comm_all_reduce(comm, a, 3, DT_COMM_SUM), 0);
  ck_assert_int_eq(dt_comm_reduce_scatter_v(comm, a, b, counts, DT_COMM_SUM), 0);
  ck_assert_int_eq(dt_comm_all_gather(comm, a, b, 1), 0);
  ck_assert_int_eq(dt_comm_broadcast(comm, a, 3, 0), 0);
  ck_assert_int_eq(dt_comm_barrier(comm), 0);
  ck_assert_int_eq(dt_comm_split(comm, 0, 0, &sub), 0);
  static const struct {
    const char *op;
    size_t bytes;
  } want[] = {{"all_reduce", 12}, {"reduce_scatter", 8}, {"all_gather", 4},
              {"broadcast", 12},  {"barrier", 0},        {"split", 0}};
  ck_assert_int_eq(o.n, 12);
  for (int i = 0; i < 12; i++) {
    ck_assert_str_eq(o.e[i].op, want[i / 2].op);
    ck_assert_uint_eq(o.e[i].bytes, want[i / 2].bytes);
    ck_assert_int_eq(o.e[i].end, i % 2);
    ck_assert_int_eq(o.e[i].rc, 0);
    ck_assert_str_eq(o.label[i], "tp");
  }
  ck_assert_int_eq(dt_comm_all_reduce(sub, a, 3, DT_COMM_SUM), 0); /* not inherited */
  ck_assert_int_eq(dt_comm_all_reduce(comm, a, 3, (dt_comm_op_t)99), DT_EINVAL);
  ck_assert_int_eq(dt_comm_all_reduce(comm, a, 0, DT_COMM_SUM), 0); /* empty */
  ck_assert_int_eq(dt_comm_abort(comm), 0);
  ck_assert_int_eq(dt_comm_barrier(comm), DT_ECANCELED);
  ck_assert_int_eq(o.n, 12);
  dt_comm_destroy(sub);
  dt_comm_destroy(comm);
  dt_kv_mem_destroy(&kv);
}
END_TEST

START_TEST(test_invalid_arguments)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  dt_comm_t *comm = NULL, *sub = NULL;
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "p", 2, 2, 1000), DT_EINVAL);
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "p", -1, 2, 1000), DT_EINVAL);
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "", 0, 1, 1000), DT_EINVAL);
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "p", 0, 1, -5), DT_EINVAL);
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", NULL, "p", 0, 1, 1000), DT_EINVAL);
  ck_assert_int_eq(dt_comm_init(&comm, "carrier-pigeon", &kv, "p", 0, 1, 1000), DT_ENOTSUP);
  ck_assert(dt_comm_has_backend("cpu") && !dt_comm_has_backend("carrier-pigeon") &&
            !dt_comm_has_backend(NULL));
  /* The backend's switches take 0 or 1 (or unset): a typo is refused, not taken for 0. */
  static const char *const switches[] = {"DISTRAIN_COMM_CPU_IDLE_IO",
                                         "DISTRAIN_COMM_CPU_GLOO_ALLREDUCE"};
  for (size_t i = 0; i < DT_ARRAY_SIZE(switches); i++) {
    setenv(switches[i], "yes", 1);
    ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "p", 0, 1, 1000), DT_EINVAL);
    ck_assert_ptr_null(comm);
    setenv(switches[i], "", 1);
    ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "p", 0, 1, 1000), 0);
    dt_comm_destroy(comm);
    comm = NULL;
    unsetenv(switches[i]);
  }
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "p", 0, 1, 1000), 0);
  float x = 1;
  ck_assert_int_eq(dt_comm_all_reduce(comm, NULL, 4, DT_COMM_SUM), DT_EINVAL);
  ck_assert_int_eq(dt_comm_all_reduce(comm, &x, 1, (dt_comm_op_t)7), DT_EINVAL);
  ck_assert_int_eq(dt_comm_broadcast(comm, &x, 1, 1), DT_EINVAL);
  ck_assert_int_eq(dt_comm_reduce_scatter_v(comm, &x, &x, NULL, DT_COMM_SUM), DT_EINVAL);
  ck_assert_int_eq(dt_comm_split(comm, -2, 0, &sub), DT_EINVAL);
  ck_assert_ptr_null(sub);
  ck_assert_int_eq(dt_comm_all_reduce(NULL, &x, 1, DT_COMM_SUM), DT_EINVAL);
  /* Argument errors do not poison. */
  ck_assert_int_eq(dt_comm_all_reduce(comm, &x, 1, DT_COMM_SUM), 0);
  dt_comm_destroy(comm);
  dt_comm_destroy(NULL);
  dt_kv_mem_destroy(&kv);
}
END_TEST

/* An interface without an address is a settings error, at once, not a rendezvous timeout. */
START_TEST(test_bad_interface)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  setenv("DISTRAIN_COMM_IFACE", "nosuchif0", 1);
  dt_comm_t *comm = NULL;
  double t0 = dt_now_ms();
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "badif", 0, 2, 20000), DT_EINVAL);
  ck_assert_ptr_null(comm);
  ck_assert_msg(dt_now_ms() - t0 < 5000, "took %.0f ms", dt_now_ms() - t0);
  unsetenv("DISTRAIN_COMM_IFACE");
  dt_kv_mem_destroy(&kv);
}
END_TEST

/* Threads of this process in the idle scheduling class. */
static int idle_threads(void)
{
  DIR *d = opendir("/proc/self/task");
  ck_assert_ptr_nonnull(d);
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    n += e->d_name[0] != '.' && sched_getscheduler(atoi(e->d_name)) == SCHED_IDLE;
  closedir(d);
  return n;
}

/* The idle-class threads a world-1 cpu communicator adds to this process. */
static int idle_threads_of_a_comm(void)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  const int before = idle_threads();
  dt_comm_t *comm = NULL;
  ck_assert_int_eq(dt_comm_init(&comm, "cpu", &kv, "io", 0, 1, 1000), 0);
  const int added = idle_threads() - before;
  dt_comm_destroy(comm);
  dt_kv_mem_destroy(&kv);
  return added;
}

/* Gloo's event-loop thread is in the idle class (dt_io_yields; as a normal thread there it
 * preempts the thread holding a lock it needs and spins: see gloo_backend.cc) where the process
 * may run on one CPU only, or where the node has no CPU to spare beyond its ranks' compute
 * threads (dt_set_compute's threads x LOCAL_WORLD_SIZE, else WORLD_SIZE, cover its CPUs) unless
 * collectives overlap compute with ranks on other nodes; a normal thread otherwise.
 * DISTRAIN_COMM_CPU_IDLE_IO=1|0 decides instead. */
START_TEST(test_io_thread_class)
{
  cpu_set_t all, one;
  ck_assert_int_eq(sched_getaffinity(0, sizeof all, &all), 0);
  CPU_ZERO(&one);
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &all)) {
      CPU_SET(c, &one);
      break;
    }
  ck_assert_int_eq(sched_setaffinity(0, sizeof one, &one), 0);
  unsetenv("DISTRAIN_COMM_CPU_IDLE_IO");
  ck_assert_int_eq(idle_threads_of_a_comm(), 1);
  setenv("DISTRAIN_COMM_CPU_IDLE_IO", "0", 1);
  ck_assert_int_eq(idle_threads_of_a_comm(), 0);
  ck_assert_int_eq(sched_setaffinity(0, sizeof all, &all), 0);
  setenv("DISTRAIN_COMM_CPU_IDLE_IO", "1", 1);
  ck_assert_int_eq(idle_threads_of_a_comm(), 1);
  unsetenv("DISTRAIN_COMM_CPU_IDLE_IO");
  if (CPU_COUNT(&all) == 1)
    return;
  ck_assert_int_eq(idle_threads_of_a_comm(), 0);
  char ranks[16];
  snprintf(ranks, sizeof ranks, "%d", CPU_COUNT(&all));
  setenv("WORLD_SIZE", ranks, 1); /* as many one-thread ranks as CPUs */
  ck_assert_int_eq(idle_threads_of_a_comm(), 1);
  dt_set_compute(1, 1); /* overlapping collectives, but all ranks on this node */
  ck_assert_int_eq(idle_threads_of_a_comm(), 1);
  setenv("LOCAL_WORLD_SIZE", "1", 1); /* one rank on this node: a CPU to spare */
  dt_set_compute(1, 0);
  ck_assert_int_eq(idle_threads_of_a_comm(), 0);
  dt_set_compute(CPU_COUNT(&all), 0); /* whose threads take every CPU */
  ck_assert_int_eq(idle_threads_of_a_comm(), 1);
  dt_set_compute(CPU_COUNT(&all), 1); /* ... and whose collectives overlap across nodes */
  ck_assert_int_eq(idle_threads_of_a_comm(), 0);
  dt_set_compute(1, 0);
  unsetenv("LOCAL_WORLD_SIZE");
  unsetenv("WORLD_SIZE");
}
END_TEST

/* ------------------------------------------------------------------------------------------ */

static Suite *comm_suite(void)
{
  Suite *s = suite_create("comm");
  TCase *t = tcase_create("kv");
  tcase_add_test(t, test_kv_file);
  tcase_add_test(t, test_kv_file_two_stores);
  tcase_add_test(t, test_kv_mem);
  suite_add_tcase(s, t);

  t = tcase_create("collectives");
  tcase_set_timeout(t, 60);
  tcase_add_loop_test(t, test_collectives, 2, 5);
  tcase_add_loop_test(t, test_p2p, 2, 4);
  tcase_add_loop_test(t, test_p2p_size_mismatch, 0, 2);
  tcase_add_test(t, test_p2p_post);
  tcase_add_test(t, test_p2p_peer_left_during_wait);
  tcase_add_test(t, test_split);
  tcase_add_loop_test(t, test_generations_back_to_back, 2, 5);
  suite_add_tcase(s, t);

  t = tcase_create("failures");
  tcase_set_timeout(t, 60);
  tcase_add_test(t, test_missing_peer_times_out);
  tcase_add_loop_test(t, test_killed_peer_fails_collective, 2, 5);
  tcase_add_test(t, test_abort_unblocks);
  tcase_add_test(t, test_abort_split);
  tcase_add_test(t, test_stale_generation_ignored);
  suite_add_tcase(s, t);

  t = tcase_create("local");
  tcase_set_timeout(t, 30);
  tcase_add_test(t, test_threads_mem_kv);
  tcase_add_test(t, test_progress);
  tcase_add_test(t, test_device_buffers_staged);
  tcase_add_test(t, test_world1);
  tcase_add_test(t, test_gate);
  tcase_add_test(t, test_observer);
  tcase_add_test(t, test_invalid_arguments);
  tcase_add_test(t, test_bad_interface);
  tcase_add_test(t, test_io_thread_class);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  /* Loopback only, whatever this host's name resolves to. */
  setenv("DISTRAIN_COMM_HOST", "127.0.0.1", 0);
  SRunner *sr = srunner_create(comm_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
