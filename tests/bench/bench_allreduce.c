/* bench_allreduce.c — bus bandwidth of the cpu comm backend (Gloo transport, our ring
 * algorithms) between forked processes on this host, rendezvousing through a directory store.
 *
 * For each size (1, 16, 64 MiB of float32 by default): warm-up iterations, then `iters` timed
 * ones, each a barrier and then `inner` back-to-back operations timed together on rank 0 (as
 * nccl-tests does: the skew of leaving the barrier is amortised); the median per-operation
 * time is reported.
 * Bandwidths follow nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n for all-reduce
 * and * (n-1)/n for reduce-scatter and all-gather (bytes = the full buffer: the all-reduce
 * buffer, the reduce-scatter input, the all-gather output). A table goes to stderr and one JSON
 * line per size to stdout, with the same keys as bench_allreduce_torch.py:
 *   {"bench": "all_reduce", "impl": "distrain-cpu", "world": 2, "bytes": 1048576,
 *    "median_ms": ..., "algbw_gbps": ..., "busbw_gbps": ..., "cpu_ms": ...}
 * cpu_ms is rank 0's process CPU time (user + system, all threads) per timed iteration,
 * barrier included: a figure that, unlike the time, hardly depends on other load.
 * (GB/s = 1e9 bytes per second.) DISTRAIN_COMM_CPU_GLOO_ALLREDUCE=1 times gloo::allreduce
 * instead of ours (impl "gloo-allreduce").
 *
 * sendrecv is the pipeline's exchange: every rank sends the buffer to the next rank and
 * receives one from the previous (dt_comm_sendrecv); its bandwidths are per direction
 * (busbw = algbw).
 *
 *   bench_allreduce [--world N] [--iters K] [--inner I] [--warmup W] [--pin 0|1]
 *       [--op all_reduce|reduce_scatter|all_gather|sendrecv] [--mib S]... [--kib S]...
 * --pin 1 pins rank r to the r-th core this process may use (as bench_pipeline pins stages). */
#define _GNU_SOURCE
#include <dirent.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm.h"
#include "dt_error.h"
#include "dt_util.h"

#define MAX_SIZES 16

typedef enum { OP_ALL_REDUCE, OP_REDUCE_SCATTER, OP_ALL_GATHER, OP_SENDRECV } op_t;
static const char *const g_op_names[] = {"all_reduce", "reduce_scatter", "all_gather", "sendrecv"};

typedef struct {
  int world, iters, inner, warmup;
  op_t op;
  int nsizes;
  size_t bytes[MAX_SIZES];
  int pin; /* rank r on the r-th core this process may use */
  char dir[256];
} opts_t;

static void die(const char *what, int rc)
{
  fprintf(stderr, "bench_allreduce: %s: %s\n", what, dt_strerror(rc));
  exit(1);
}

static int cmp_double(const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* CPU time of this process (all threads: ours and Gloo's event loop), in ms. */
static double cpu_ms(void)
{
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3 +
         (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e3;
}

static int run_op(dt_comm_t *comm, op_t op, float *a, float *b, size_t n, int world)
{
  switch (op) {
  case OP_ALL_REDUCE:
    return dt_comm_all_reduce(comm, a, n, DT_COMM_SUM);
  case OP_REDUCE_SCATTER:
    return dt_comm_reduce_scatter(comm, a, b, n / (size_t)world, DT_COMM_SUM);
  case OP_ALL_GATHER:
    return dt_comm_all_gather(comm, a, b, n / (size_t)world);
  case OP_SENDRECV: {
    const int r = dt_comm_rank(comm);
    return dt_comm_sendrecv(comm, a, n * sizeof(float), (r + 1) % world, b, n * sizeof(float),
                            (r + world - 1) % world, 0);
  }
  }
  return DT_EINVAL;
}

/* Pins the calling process to the rank-th core it may use (where there are that many). */
static void pin_rank(int rank)
{
  cpu_set_t allowed, one;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || rank >= CPU_COUNT(&allowed))
    return;
  for (int c = 0, seen = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &allowed) && seen++ == rank) {
      CPU_ZERO(&one);
      CPU_SET(c, &one);
      sched_setaffinity(0, sizeof one, &one);
      return;
    }
}

static void run_rank(const opts_t *o, int rank)
{
  if (o->pin)
    pin_rank(rank);
  dt_kv_t kv;
  dt_comm_t *comm = NULL;
  int rc = dt_kv_file_create(&kv, o->dir);
  if (rc < 0)
    die("kv", rc);
  if ((rc = dt_comm_init(&comm, "cpu", &kv, "bench/gen0", rank, o->world, 60000)) < 0)
    die("dt_comm_init", rc);

  const char *impl = getenv("DISTRAIN_COMM_CPU_GLOO_ALLREDUCE") &&
                             atoi(getenv("DISTRAIN_COMM_CPU_GLOO_ALLREDUCE")) &&
                             o->op == OP_ALL_REDUCE
                         ? "gloo-allreduce"
                         : "distrain-cpu";
  if (rank == 0)
    fprintf(stderr, "%-14s %-15s %5s %8s %10s %11s %11s %9s\n", "op", "impl", "world", "MiB",
            "median ms", "algbw GB/s", "busbw GB/s", "cpu ms");
  for (int si = 0; si < o->nsizes; si++) {
    size_t n = o->bytes[si] / sizeof(float);
    n -= n % (size_t)o->world;
    float *a = dt_calloc_aligned(n * sizeof(float), "bench buffer");
    float *b = dt_calloc_aligned(n * sizeof(float), "bench buffer");
    double *t = calloc((size_t)o->iters, sizeof *t);
    if (!a || !b || !t)
      die("allocation", DT_ENOMEM);
    for (size_t i = 0; i < n; i++)
      a[i] = 1.f;
    double cpu0 = 0;
    for (int it = 0; it < o->warmup + o->iters; it++) {
      if (it == o->warmup)
        cpu0 = cpu_ms();
      if ((rc = dt_comm_barrier(comm)) < 0)
        die("barrier", rc);
      double t0 = dt_now_ms();
      for (int k = 0; k < o->inner; k++)
        if ((rc = run_op(comm, o->op, a, b, n, o->world)) < 0)
          die(g_op_names[o->op], rc);
      if (it >= o->warmup)
        t[it - o->warmup] = (dt_now_ms() - t0) / o->inner;
    }
    double cpu = (cpu_ms() - cpu0) / ((double)o->iters * o->inner); /* per op, barriers included */
    qsort(t, (size_t)o->iters, sizeof *t, cmp_double);
    double med = o->iters % 2 ? t[o->iters / 2] : 0.5 * (t[o->iters / 2 - 1] + t[o->iters / 2]);
    double nbytes = (double)(n * sizeof(float)), w = o->world;
    double algbw = nbytes / (med * 1e-3) / 1e9;
    double busbw = algbw * (o->op == OP_ALL_REDUCE ? 2 * (w - 1) / w
                            : o->op == OP_SENDRECV ? 1.0
                                                   : (w - 1) / w);
    if (rank == 0) {
      fprintf(stderr, "%-14s %-15s %5d %8.1f %10.3f %11.3f %11.3f %9.2f\n", g_op_names[o->op], impl,
              o->world, nbytes / (1 << 20), med, algbw, busbw, cpu);
      printf("{\"bench\": \"%s\", \"impl\": \"%s\", \"world\": %d, \"bytes\": %.0f, "
             "\"median_ms\": %.4f, \"algbw_gbps\": %.4f, \"busbw_gbps\": %.4f, "
             "\"cpu_ms\": %.3f}\n",
             g_op_names[o->op], impl, o->world, nbytes, med, algbw, busbw, cpu);
      fflush(stdout);
    }
    free(t);
    dt_free_aligned(a);
    dt_free_aligned(b);
  }
  dt_comm_destroy(comm);
  dt_kv_file_destroy(&kv);
}

/* Removes the store directory, which holds only files. */
static void rm_flat_dir(const char *dir)
{
  DIR *d = opendir(dir);
  if (d) {
    struct dirent *e;
    while ((e = readdir(d))) {
      char path[600];
      if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
      }
    }
    closedir(d);
  }
  rmdir(dir);
}

static void usage(void)
{
  fprintf(stderr, "usage: bench_allreduce [--world N] [--iters K] [--inner I] [--warmup W] "
                  "[--pin 0|1] [--op all_reduce|reduce_scatter|all_gather|sendrecv] "
                  "[--mib S]... [--kib S]...\n");
  exit(2);
}

int main(int argc, char **argv)
{
  opts_t o = {.world = 2, .iters = 10, .inner = 5, .warmup = 3, .op = OP_ALL_REDUCE};
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v)
      usage();
    if (strcmp(argv[i], "--world") == 0)
      o.world = atoi(v);
    else if (strcmp(argv[i], "--iters") == 0)
      o.iters = atoi(v);
    else if (strcmp(argv[i], "--inner") == 0)
      o.inner = atoi(v);
    else if (strcmp(argv[i], "--warmup") == 0)
      o.warmup = atoi(v);
    else if (strcmp(argv[i], "--mib") == 0 && o.nsizes < MAX_SIZES)
      o.bytes[o.nsizes++] = (size_t)atoi(v) << 20;
    else if (strcmp(argv[i], "--pin") == 0)
      o.pin = atoi(v);
    else if (strcmp(argv[i], "--kib") == 0 && o.nsizes < MAX_SIZES)
      o.bytes[o.nsizes++] = (size_t)atoi(v) << 10;
    else if (strcmp(argv[i], "--op") == 0) {
      int found = 0;
      for (int k = 0; k < (int)(sizeof g_op_names / sizeof *g_op_names); k++)
        if (strcmp(v, g_op_names[k]) == 0) {
          o.op = (op_t)k;
          found = 1;
        }
      if (!found)
        usage();
    } else
      usage();
    i++;
  }
  if (o.world < 1 || o.world > 64 || o.iters < 1 || o.inner < 1 || o.warmup < 0)
    usage();
  if (o.nsizes == 0) {
    static const size_t def_mib[] = {1, 16, 64};
    for (int k = 0; k < 3; k++)
      o.bytes[k] = def_mib[k] << 20;
    o.nsizes = 3;
  }
  const char *tmp = getenv("TMPDIR");
  snprintf(o.dir, sizeof o.dir, "%s/dt-bench-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(o.dir)) {
    perror("mkdtemp");
    return 1;
  }

  pid_t pids[64];
  for (int r = 1; r < o.world; r++) {
    pids[r] = fork();
    if (pids[r] < 0) {
      perror("fork");
      return 1;
    }
    if (pids[r] == 0) {
      run_rank(&o, r);
      _exit(0);
    }
  }
  run_rank(&o, 0);
  int ok = 1;
  for (int r = 1; r < o.world; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    ok &= WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  rm_flat_dir(o.dir);
  return ok ? 0 : 1;
}
