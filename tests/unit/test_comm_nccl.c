/* test_comm_nccl.c — Check suite for the "nccl" backend of worker/comm (label "gpu").
 *
 * Without a GPU it only checks that dt_comm_init(..., "nccl", ...) fails cleanly (a DT_E* code,
 * no crash), then exits 77 (skipped). With one GPU: a world-1 communicator (every collective and
 * both kinds of split, against host-computed values), host operands staged to the device, a
 * world-2 rendezvous that only this rank joins (DT_ETIMEDOUT within about the timeout, from rank
 * 0's NCCL init and from rank 1's wait for the id), and an abort that cancels an init in
 * progress. With two or more GPUs: world N over threads, one device each (NCCL refuses two ranks
 * of one communicator on one GPU), and an operation whose peer never comes, ended by the
 * communicator's timeout and by an abort from another thread.
 *
 * The same file runs in CI as test_comm_nccl_on_emul (DT_TEST_EMULATED): on three emulated GPUs
 * (tests/emul/cuda_host.cc) and the host emulation of NCCL (tests/emul/nccl_host.cc), whose calls
 * return at once and complete on threads of their own, as a non-blocking NCCL's do.
 *
 * CUDA cannot be used in a child forked from a process that initialised it, and Check forks
 * every test, so main counts the GPUs in a throw-away child and never touches CUDA itself while
 * there are GPUs. Data are small integers in float32, so sums are exact; averages are compared
 * with a tolerance, since NCCL may scale before summing. */
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <check.h>

#include "backend.h"
#include "comm.h"
#include "cuda_kernels.h"
#include "dt_error.h"
#include "dt_util.h"

#define MAX_GPUS 8

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* A device copy of h (n > 0). NULL on failure. */
static float *upload(const float *h, size_t n)
{
  float *d = NULL;
  if (cudaMalloc((void **)&d, n * sizeof *d) != cudaSuccess)
    return NULL;
  if (cudaMemcpy(d, h, n * sizeof *d, cudaMemcpyHostToDevice) != cudaSuccess) {
    cudaFree(d);
    return NULL;
  }
  return d;
}

static int download(float *h, const float *d, size_t n)
{
  return cudaMemcpy(h, d, n * sizeof *h, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -1;
}

/* Rank r's element i: a small integer, so every sum over ranks is exact in float32. */
static float val(int r, size_t i)
{
  return (float)((int)(i % 23) - 11 + 3 * r);
}

/* val(0, i) + ... + val(ranks - 1, i), in rank order (exact: small integers). */
static float val_sum(int ranks, size_t i)
{
  float s = 0;
  for (int r = 0; r < ranks; r++)
    s += val(r, i);
  return s;
}

/* ------------------------------------------------------------------------------------------ */
/* One GPU                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Every collective of a world-1 communicator, and split into a child and into nothing. */
START_TEST(test_world1)
{
  enum { N = 4099 };
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  dt_comm_t *comm = NULL, *sub = NULL;
  ck_assert_int_eq(dt_comm_init(&comm, "nccl", &kv, "nccl1/gen0", 0, 1, 20000), 0);
  ck_assert_int_eq(dt_comm_world(comm), 1);

  float *h = malloc(N * sizeof *h), *g = malloc(N * sizeof *g);
  ck_assert(h && g);
  for (size_t i = 0; i < N; i++)
    h[i] = val(0, i);
  float *d = upload(h, N), *o = upload(h, N);
  ck_assert(d && o);

  ck_assert_int_eq(dt_comm_all_reduce(comm, d, N, DT_COMM_SUM), 0);
  ck_assert_int_eq(download(g, d, N), 0);
  ck_assert(memcmp(g, h, N * sizeof *h) == 0);
  ck_assert_int_eq(dt_comm_all_reduce(comm, d, N, DT_COMM_AVG), 0);
  ck_assert_int_eq(download(g, d, N), 0);
  ck_assert(memcmp(g, h, N * sizeof *h) == 0);

  size_t counts[1] = {N};
  ck_assert_int_eq(cudaMemset(o, 0, N * sizeof *o), cudaSuccess);
  ck_assert_int_eq(dt_comm_reduce_scatter_v(comm, d, o, counts, DT_COMM_SUM), 0);
  ck_assert_int_eq(download(g, o, N), 0);
  ck_assert(memcmp(g, h, N * sizeof *h) == 0);
  ck_assert_int_eq(cudaMemset(o, 0, N * sizeof *o), cudaSuccess);
  ck_assert_int_eq(dt_comm_all_gather_v(comm, d, o, counts), 0);
  ck_assert_int_eq(download(g, o, N), 0);
  ck_assert(memcmp(g, h, N * sizeof *h) == 0);
  counts[0] = 0; /* nothing to move: comm.c answers without the backend */
  ck_assert_int_eq(dt_comm_all_gather_v(comm, d, o, counts), 0);
  ck_assert_int_eq(dt_comm_broadcast(comm, d, N, 0), 0);
  ck_assert_int_eq(download(g, d, N), 0);
  ck_assert(memcmp(g, h, N * sizeof *h) == 0);
  ck_assert_int_eq(dt_comm_barrier(comm), 0);

  /* A child (ncclCommSplit), then a split this rank sits out. */
  ck_assert_int_eq(dt_comm_split(comm, 0, 7, &sub), 0);
  ck_assert_ptr_nonnull(sub);
  ck_assert_int_eq(dt_comm_rank(sub), 0);
  ck_assert_int_eq(dt_comm_world(sub), 1);
  ck_assert_int_eq(dt_comm_all_reduce(sub, d, N, DT_COMM_SUM), 0);
  ck_assert_int_eq(download(g, d, N), 0);
  ck_assert(memcmp(g, h, N * sizeof *h) == 0);
  dt_comm_t *none = sub; /* must be overwritten with NULL */
  ck_assert_int_eq(dt_comm_split(comm, DT_COMM_NO_COLOR, 0, &none), 0);
  ck_assert_ptr_null(none);
  ck_assert_int_eq(dt_comm_barrier(sub), 0);
  dt_comm_destroy(sub);
  ck_assert_int_eq(dt_comm_barrier(comm), 0);

  ck_assert_int_eq(dt_comm_abort(comm), 0);
  ck_assert_int_eq(dt_comm_barrier(comm), DT_ECANCELED);
  dt_comm_destroy(comm);
  cudaFree(d);
  cudaFree(o);
  free(h);
  free(g);
  dt_kv_mem_destroy(&kv);
}
END_TEST

/* A GPU trainer's device set on a world-1 communicator: host operands (the trainer's scalars)
 * are staged into device memory for NCCL, device operands go as they are, and the device's
 * queued work is waited for before NCCL reads. Without the staging NCCL gets host pointers. */
typedef struct {
  dt_device_t *d;
  int syncs;
} staged_dev_t;

static int sd_is_device(void *ud, const void *p)
{
  staged_dev_t *s = ud;
  return s->d->owns(s->d, p);
}

static int sd_copy(void *ud, void *dst, const void *src, size_t bytes, int to_host)
{
  staged_dev_t *s = ud;
  return s->d->copy(s->d, dst, src, bytes, to_host ? DT_COPY_D2H : DT_COPY_H2D);
}

static int sd_alloc(void *ud, size_t bytes, void **out)
{
  staged_dev_t *s = ud;
  return s->d->alloc(s->d, bytes, "staging", out);
}

static void sd_release(void *ud, void *p)
{
  staged_dev_t *s = ud;
  s->d->free(s->d, p);
}

static int sd_sync(void *ud)
{
  staged_dev_t *s = ud;
  s->syncs++;
  return s->d->sync(s->d);
}

START_TEST(test_host_operands_staged)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  staged_dev_t sd = {NULL, 0};
  ck_assert_int_eq(dt_device_cuda_create(0, &sd.d), 0);
  dt_comm_t *comm = NULL, *sub = NULL;
  ck_assert_int_eq(dt_comm_init(&comm, "nccl", &kv, "staged/gen0", 0, 1, 20000), 0);
  const dt_comm_device_t no_alloc = {&sd, sd_is_device, sd_copy, NULL, NULL, NULL};
  const dt_comm_device_t dev = {&sd, sd_is_device, sd_copy, sd_alloc, sd_release, sd_sync};
  ck_assert_int_eq(dt_comm_set_device(comm, &no_alloc), DT_EINVAL);
  ck_assert_int_eq(dt_comm_set_device(comm, &dev), 0);

  float pair[2] = {3.0f, -4.0f}, all[4] = {0}, back[4] = {0};
  ck_assert_int_eq(dt_comm_all_reduce(comm, pair, 2, DT_COMM_SUM), 0); /* host in and out */
  ck_assert(pair[0] == 3.0f && pair[1] == -4.0f);
  ck_assert_int_eq(sd.syncs, 1);
  float *d = NULL;
  ck_assert_int_eq(sd.d->alloc(sd.d, 4 * sizeof(float), "test", (void **)&d), 0);
  ck_assert_int_eq(sd.d->copy(sd.d, d, (float[]){1, 2, 3, 4}, 4 * sizeof(float), DT_COPY_H2D), 0);
  ck_assert_int_eq(dt_comm_all_gather(comm, d + 1, all, 2), 0); /* device in, host out */
  ck_assert(all[0] == 2.0f && all[1] == 3.0f);
  ck_assert_int_eq(dt_comm_all_gather(comm, pair, d, 2), 0); /* host in, device out */
  ck_assert_int_eq(sd.d->copy(sd.d, back, d, 4 * sizeof(float), DT_COPY_D2H), 0);
  ck_assert(back[0] == 3.0f && back[1] == -4.0f && back[2] == 3.0f && back[3] == 4.0f);
  ck_assert_int_eq(dt_comm_split(comm, 0, 0, &sub), 0); /* the child inherits the device */
  float x = 5.0f;
  ck_assert_int_eq(dt_comm_broadcast(sub, &x, 1, 0), 0);
  ck_assert(x == 5.0f);
  ck_assert_int_eq(sd.syncs, 4);
  ck_assert_int_eq(dt_comm_all_reduce(comm, d, 4, DT_COMM_SUM), 0); /* every operation syncs */
  ck_assert_int_eq(sd.syncs, 5);
  dt_comm_destroy(sub);
  dt_comm_destroy(comm); /* releases the device staging buffer through the device */
  sd.d->free(sd.d, d);
  dt_device_cuda_destroy(sd.d);
  dt_kv_mem_destroy(&kv);
}
END_TEST

/* World 2, only rank 0 ever comes: its NCCL init times out; so does a lone rank 1 waiting for
 * rank 0's id. Both within about the timeout. */
START_TEST(test_missing_peer_times_out)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  for (int rank = 0; rank < 2; rank++) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "nccl2/gen%d", rank);
    dt_comm_t *comm = NULL;
    double t0 = dt_now_ms();
    int rc = dt_comm_init(&comm, "nccl", &kv, prefix, rank, 2, 1500);
    double dt = dt_now_ms() - t0;
    ck_assert_msg(rc == DT_ETIMEDOUT, "rank %d: %s", rank, dt_err_name(rc));
    ck_assert_ptr_null(comm);
    ck_assert_msg(dt >= 1400 && dt < 5000, "rank %d gave up after %.0f ms", rank, dt);
  }
  dt_kv_mem_destroy(&kv);
}
END_TEST

static void sleep_ms(int ms)
{
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* An abort must cancel an init that is waiting for peers. dt_comm_init hands out no handle
 * before it returns, so this goes through the backend table: an init with share = a live
 * instance is canceled by that instance's abort (backend.h), the path of every wait in init. */
typedef struct {
  const dt_kv_t *kv;
  void *share;
  int rc;
  double returned_ms;
} init_arg_t;

static void *init_thread(void *arg)
{
  init_arg_t *a = arg;
  void *impl = NULL;
  a->rc = dt__comm_nccl_backend.init(&impl, a->kv, "nccl3/child", 0, 2, 60000, a->share);
  a->returned_ms = dt_now_ms();
  if (a->rc == 0)
    dt__comm_nccl_backend.destroy(impl);
  return NULL;
}

START_TEST(test_abort_cancels_init)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  void *parent = NULL;
  ck_assert_int_eq(dt__comm_nccl_backend.init(&parent, &kv, "nccl3/parent", 0, 1, 20000, NULL), 0);
  init_arg_t a = {.kv = &kv, .share = parent, .rc = 1};
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, init_thread, &a), 0);
  sleep_ms(500); /* rank 0 of 2 is now inside NCCL's init, waiting for rank 1 */
  double t_abort = dt_now_ms();
  dt__comm_nccl_backend.abort(parent);
  pthread_join(th, NULL);
  ck_assert_msg(a.rc == DT_ECANCELED, "init returned %s", dt_err_name(a.rc));
  ck_assert_msg(a.returned_ms - t_abort < 3000, "canceled after %.0f ms", a.returned_ms - t_abort);
  dt__comm_nccl_backend.destroy(parent);
  dt_kv_mem_destroy(&kv);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Several GPUs: one thread per rank                                                           */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
  dt_kv_t *kv;
  int rank, world;
  char err[512]; /* first failure, "" if none (Check's asserts belong to the test's thread) */
} rank_arg_t;

#define T_FAIL(t, ...)                                                                             \
  do {                                                                                             \
    snprintf((t)->err, sizeof(t)->err, __VA_ARGS__);                                               \
    goto out;                                                                                      \
  } while (0)
#define T_RC(t, call)                                                                              \
  do {                                                                                             \
    int rc_ = (call);                                                                              \
    if (rc_ != 0)                                                                                  \
      T_FAIL(t, "rank %d: %s returned %s", (t)->rank, #call, dt_err_name(rc_));                    \
  } while (0)
#define T_CHECK(t, cond, ...)                                                                      \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      T_FAIL(t, __VA_ARGS__);                                                                      \
  } while (0)

/* Uneven chunk sizes with one empty chunk: rank world-1's. */
static size_t chunk(int c, int world)
{
  return c == world - 1 ? 0 : (size_t)(1000 + 37 * c);
}

static void *rank_thread(void *arg)
{
  rank_arg_t *t = arg;
  const int R = t->rank, W = t->world;
  enum { N = 100003 };
  size_t counts[MAX_GPUS], off[MAX_GPUS + 1] = {0};
  for (int c = 0; c < W; c++) {
    counts[c] = chunk(c, W);
    off[c + 1] = off[c] + counts[c];
  }
  const size_t total = off[W];
  dt_comm_t *comm = NULL, *sub = NULL;
  float *h = malloc(N * sizeof *h), *g = malloc(N * sizeof *g), *d = NULL, *o = NULL;
  if (!h || !g)
    T_FAIL(t, "rank %d: out of memory", R);
  if (cudaSetDevice(R) != cudaSuccess)
    T_FAIL(t, "rank %d: cudaSetDevice failed", R);
  T_RC(t, dt_comm_init(&comm, "nccl", t->kv, "ncclN/gen0", R, W, 30000));
  for (size_t i = 0; i < N; i++)
    h[i] = val(R, i);
  d = upload(h, N);
  o = upload(h, N);
  T_CHECK(t, d && o, "rank %d: upload failed", R);

  /* all-reduce, sum and average */
  T_RC(t, dt_comm_all_reduce(comm, d, N, DT_COMM_SUM));
  T_CHECK(t, download(g, d, N) == 0, "rank %d: download", R);
  for (size_t i = 0; i < N; i++) {
    float want = val_sum(W, i);
    T_CHECK(t, g[i] == want, "rank %d: all-reduce sum [%zu] = %g, want %g", R, i, g[i], want);
  }
  T_CHECK(t, cudaMemcpy(d, h, N * sizeof *h, cudaMemcpyHostToDevice) == cudaSuccess, "copy");
  T_RC(t, dt_comm_all_reduce(comm, d, N, DT_COMM_AVG));
  T_CHECK(t, download(g, d, N) == 0, "rank %d: download", R);
  for (size_t i = 0; i < N; i++) {
    double want = (double)val_sum(W, i) / W;
    T_CHECK(t, fabs(g[i] - want) <= 1e-5 * (1 + fabs(want)), "rank %d: avg [%zu] = %g, want %g", R,
            i, g[i], want);
  }

  /* reduce-scatter, uneven (one ncclReduce per chunk) then even (ncclReduceScatter) */
  T_CHECK(t, cudaMemcpy(d, h, N * sizeof *h, cudaMemcpyHostToDevice) == cudaSuccess, "copy");
  T_CHECK(t, cudaMemset(o, 0, N * sizeof *o) == cudaSuccess, "memset");
  T_RC(t, dt_comm_reduce_scatter_v(comm, d, o, counts, DT_COMM_SUM));
  T_CHECK(t, download(g, o, N) == 0, "rank %d: download", R);
  for (size_t i = 0; i < counts[R]; i++) {
    float want = val_sum(W, off[R] + i);
    T_CHECK(t, g[i] == want, "rank %d: reduce-scatter-v [%zu] = %g, want %g", R, i, g[i], want);
  }
  T_CHECK(t, counts[R] > 0 || g[0] == 0, "rank %d: the empty chunk wrote out", R);
  const size_t n = N / (size_t)W;
  T_RC(t, dt_comm_reduce_scatter(comm, d, o, n, DT_COMM_SUM));
  T_CHECK(t, download(g, o, n) == 0, "rank %d: download", R);
  for (size_t i = 0; i < n; i++) {
    float want = val_sum(W, (size_t)R * n + i);
    T_CHECK(t, g[i] == want, "rank %d: reduce-scatter [%zu] = %g, want %g", R, i, g[i], want);
  }

  /* all-gather, uneven (one ncclBroadcast per rank) then even (ncclAllGather), from d = h */
  T_CHECK(t, cudaMemset(o, 0, N * sizeof *o) == cudaSuccess, "memset");
  T_RC(t, dt_comm_all_gather_v(comm, d, o, counts));
  T_CHECK(t, download(g, o, total) == 0, "rank %d: download", R);
  for (int r = 0; r < W; r++)
    for (size_t i = 0; i < counts[r]; i++)
      T_CHECK(t, g[off[r] + i] == val(r, i), "rank %d: all-gather-v from %d [%zu] = %g", R, r, i,
              g[off[r] + i]);
  T_RC(t, dt_comm_all_gather(comm, d, o, n));
  T_CHECK(t, download(g, o, n * (size_t)W) == 0, "rank %d: download", R);
  for (int r = 0; r < W; r++)
    for (size_t i = 0; i < n; i++)
      T_CHECK(t, g[(size_t)r * n + i] == val(r, i), "rank %d: all-gather from %d [%zu]", R, r, i);

  /* broadcast from the last rank; a ring shift with sendrecv; barrier */
  T_RC(t, dt_comm_broadcast(comm, d, N, W - 1));
  T_CHECK(t, download(g, d, N) == 0, "rank %d: download", R);
  for (size_t i = 0; i < N; i++)
    T_CHECK(t, g[i] == val(W - 1, i), "rank %d: broadcast [%zu] = %g", R, i, g[i]);
  T_CHECK(t, cudaMemcpy(d, h, N * sizeof *h, cudaMemcpyHostToDevice) == cudaSuccess, "copy");
  T_RC(t, dt_comm_sendrecv(comm, d, N * sizeof(float), (R + 1) % W, o, N * sizeof(float),
                           (R + W - 1) % W, 0));
  T_CHECK(t, download(g, o, N) == 0, "rank %d: download", R);
  for (size_t i = 0; i < N; i++)
    T_CHECK(t, g[i] == val((R + W - 1) % W, i), "rank %d: sendrecv [%zu] = %g", R, i, g[i]);
  T_RC(t, dt_comm_barrier(comm));

  /* split: the last rank sits out, the others form a child in reverse order (key -rank) */
  T_RC(t, dt_comm_split(comm, R == W - 1 ? DT_COMM_NO_COLOR : 0, -R, &sub));
  if (R == W - 1) {
    T_CHECK(t, sub == NULL, "rank %d: NO_COLOR gave a communicator", R);
  } else {
    T_CHECK(t, sub && dt_comm_world(sub) == W - 1 && dt_comm_rank(sub) == W - 2 - R,
            "rank %d: child rank %d of %d", R, sub ? dt_comm_rank(sub) : -1,
            sub ? dt_comm_world(sub) : -1);
    T_CHECK(t, cudaMemcpy(d, h, N * sizeof *h, cudaMemcpyHostToDevice) == cudaSuccess, "copy");
    T_RC(t, dt_comm_all_reduce(sub, d, N, DT_COMM_SUM));
    T_CHECK(t, download(g, d, N) == 0, "rank %d: download", R);
    for (size_t i = 0; i < N; i++) {
      float want = val_sum(W - 1, i);
      T_CHECK(t, g[i] == want, "rank %d: child sum [%zu] = %g, want %g", R, i, g[i], want);
    }
  }
  T_RC(t, dt_comm_barrier(comm));

out:
  dt_comm_destroy(sub);
  dt_comm_destroy(comm);
  cudaFree(d);
  cudaFree(o);
  free(h);
  free(g);
  return NULL;
}

START_TEST(test_threads_one_gpu_each)
{
  int count = 0;
  ck_assert_int_eq(cudaGetDeviceCount(&count), cudaSuccess);
  const int W = count < MAX_GPUS ? count : MAX_GPUS;
  ck_assert_int_ge(W, 2);
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  pthread_t th[MAX_GPUS];
  rank_arg_t t[MAX_GPUS];
  for (int r = 0; r < W; r++) {
    t[r] = (rank_arg_t){.kv = &kv, .rank = r, .world = W};
    ck_assert_int_eq(pthread_create(&th[r], NULL, rank_thread, &t[r]), 0);
  }
  for (int r = 0; r < W; r++)
    pthread_join(th[r], NULL);
  for (int r = 0; r < W; r++)
    ck_assert_msg(t[r].err[0] == '\0', "%s", t[r].err);
  dt_kv_mem_destroy(&kv);
}
END_TEST

/* An operation whose peer never comes, world 2 on two GPUs: rank 1 joins, takes part in one
 * all-reduce and then stays away until rank 0 is done. Rank 0's next all-reduce must end on its
 * own (DT_ETIMEDOUT at the communicator's timeout, NCCL's kernel still waiting) or, with abort,
 * when another thread aborts the communicator (DT_ECANCELED); the communicator then refuses
 * what follows at once. Rank 1 leaves cleanly after. */
typedef struct {
  dt_kv_t *kv;
  const char *prefix;
  int timeout_ms;
  atomic_int rank0_done;      /* rank 0 has its result: rank 1 may leave */
  _Atomic(dt_comm_t *) comm0; /* rank 0's, once its first all-reduce is done */
  int rc, rc_after;           /* rank 0's operation left alone, and the next one */
  double returned_ms;
  char err[2][256];
} lone_t;

typedef struct {
  lone_t *l;
  int rank;
} lone_arg_t;

static void *lone_rank(void *arg)
{
  lone_t *l = ((lone_arg_t *)arg)->l;
  const int R = ((lone_arg_t *)arg)->rank;
  enum { N = 4096 };
  float h[N];
  dt_comm_t *comm = NULL;
  float *d = NULL;
  for (size_t i = 0; i < N; i++)
    h[i] = val(R, i);
  if (cudaSetDevice(R) != cudaSuccess || !(d = upload(h, N)))
    snprintf(l->err[R], sizeof l->err[R], "rank %d: no device buffer", R);
  else if (dt_comm_init(&comm, "nccl", l->kv, l->prefix, R, 2, l->timeout_ms) != 0 ||
           dt_comm_all_reduce(comm, d, N, DT_COMM_SUM) != 0)
    snprintf(l->err[R], sizeof l->err[R], "rank %d: init or the first all-reduce failed", R);
  if (R == 0) {
    if (!l->err[0][0]) {
      atomic_store(&l->comm0, comm);
      l->rc = dt_comm_all_reduce(comm, d, N, DT_COMM_SUM);
      l->returned_ms = dt_now_ms();
      l->rc_after = dt_comm_all_reduce(comm, d, N, DT_COMM_SUM);
    }
    atomic_store(&l->rank0_done, 1);
  } else {
    while (!atomic_load(&l->rank0_done))
      sleep_ms(10);
  }
  dt_comm_destroy(comm);
  if (d)
    cudaFree(d);
  return NULL;
}

static void lone_operation(int abort_it)
{
  dt_kv_t kv;
  ck_assert_int_eq(dt_kv_mem_create(&kv), 0);
  lone_t l = {.kv = &kv,
              .prefix = abort_it ? "nccl_lone/abort" : "nccl_lone/timeout",
              .timeout_ms = abort_it ? 30000 : 1500};
  lone_arg_t args[2] = {{&l, 0}, {&l, 1}};
  pthread_t th[2];
  for (int r = 0; r < 2; r++)
    ck_assert_int_eq(pthread_create(&th[r], NULL, lone_rank, &args[r]), 0);
  while (!atomic_load(&l.comm0) && !atomic_load(&l.rank0_done))
    sleep_ms(5);
  double t0 = dt_now_ms();
  if (abort_it && atomic_load(&l.comm0)) {
    sleep_ms(300); /* rank 0 is inside the all-reduce that rank 1 never joins */
    t0 = dt_now_ms();
    dt_comm_abort(atomic_load(&l.comm0));
  }
  for (int r = 0; r < 2; r++)
    pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++)
    ck_assert_msg(l.err[r][0] == '\0', "%s", l.err[r]);
  const double waited = l.returned_ms - t0;
  if (abort_it) {
    ck_assert_msg(l.rc == DT_ECANCELED, "the aborted all-reduce returned %s", dt_err_name(l.rc));
    ck_assert_msg(waited < 3000, "it returned %.0f ms after the abort", waited);
  } else {
    ck_assert_msg(l.rc == DT_ETIMEDOUT, "the lone all-reduce returned %s", dt_err_name(l.rc));
    ck_assert_msg(waited >= 1400 && waited < 5000, "it gave up after %.0f ms", waited);
  }
  ck_assert_msg(l.rc_after < 0, "the failed communicator ran another all-reduce");
  dt_kv_mem_destroy(&kv);
}

START_TEST(test_lone_operation_times_out)
{
  lone_operation(0);
}
END_TEST

START_TEST(test_abort_cancels_operation)
{
  lone_operation(1);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */

/* GPUs, counted in a child process (see the file comment). */
static int gpu_count(void)
{
  pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    if (dt_cuda_device_count(&n) != 0)
      n = 0;
    _exit(n > 100 ? 100 : n);
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st))
    return 0;
  return WEXITSTATUS(st);
}

/* No GPU: "nccl" must fail with a DT_E* code (CUDA finds no device), not crash or hang. */
static int check_no_gpu(void)
{
  dt_kv_t kv;
  if (dt_kv_mem_create(&kv) != 0)
    return EXIT_FAILURE;
  dt_comm_t *comm = NULL;
  int rc = dt_comm_init(&comm, "nccl", &kv, "nogpu/gen0", 0, 1, 1000);
  dt_kv_mem_destroy(&kv);
  if (rc >= 0 || comm) {
    fprintf(stderr, "dt_comm_init(\"nccl\") without a GPU returned %s\n", dt_err_name(rc));
    dt_comm_destroy(comm);
    return EXIT_FAILURE;
  }
  return 77; /* skipped */
}

int main(void)
{
  int gpus = gpu_count();
  if (gpus == 0)
    return check_no_gpu();
  Suite *s = suite_create("comm_nccl");
  TCase *tc = tcase_create("one_gpu");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_world1);
  tcase_add_test(tc, test_host_operands_staged);
  tcase_add_test(tc, test_missing_peer_times_out);
  tcase_add_test(tc, test_abort_cancels_init);
  suite_add_tcase(s, tc);
  if (gpus >= 2) {
    tc = tcase_create("multi_gpu");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_threads_one_gpu_each);
    tcase_add_test(tc, test_lone_operation_times_out);
    tcase_add_test(tc, test_abort_cancels_operation);
    suite_add_tcase(s, tc);
  }
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
