/* dt_util.h — small helpers shared by every binary: clocks, checked allocation, durable file
 * writes (temporary name, fsync, rename, fsync of the directory), checksums, string parsing. */
#ifndef DT_UTIL_H
#define DT_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define DT_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define DT_MIN(a, b)     ((a) < (b) ? (a) : (b))
#define DT_MAX(a, b)     ((a) > (b) ? (a) : (b))

/* Monotonic clock. */
double dt_now_ms(void);
/* Sleeps ms milliseconds (fractions allowed), resuming after signals. */
void dt_sleep_ms(double ms);
uint64_t dt_now_ns(void);
/* Wall clock: milliseconds since the epoch (for timestamps shown to people, never durations). */
int64_t dt_wall_ms(void);

/* 64-byte aligned, zeroed allocation; NULL (and an error log naming what) on failure. */
void *dt_calloc_aligned(size_t bytes, const char *what);
void dt_free_aligned(void *p);
/* Grows *p (an array of *cap elements of elem bytes, realloc'd) to hold at least need, doubling
 * from 64; DT_ENOMEM (*p and *cap unchanged) when memory runs out. */
int dt_grow(void **p, size_t *cap, size_t need, size_t elem);
/* FNV-1a over n bytes, going on from h (DT_FNV1A_INIT to start). */
#define DT_FNV1A_INIT 14695981039346656037ull
uint64_t dt_fnv1a(uint64_t h, const void *p, size_t n);

/* Durable atomic file creation: dt_afile_open writes to "<path>.tmp.<pid>"; dt_afile_commit
 * flushes, fsyncs, renames over path and fsyncs the directory; dt_afile_abort removes the
 * temporary. An existing file at path is untouched until commit succeeds. */
typedef struct {
  FILE *fp;
  char path[4096];
  char tmp[4096];
} dt_afile_t;
int dt_afile_open(dt_afile_t *af, const char *path);
int dt_afile_commit(dt_afile_t *af);
void dt_afile_abort(dt_afile_t *af);
/* Writes n bytes; DT_EIO with the path logged on a short write (DT_ENOSPC, as from commit, when
 * the disk or the quota is full). */
int dt_afile_write(dt_afile_t *af, const void *buf, size_t n);

/* mkdir -p; 0 if it exists. */
int dt_mkdir_p(const char *path);
/* fsyncs the directory that holds path (so a rename inside it is durable). */
int dt_fsync_parent(const char *path);

/* CRC-32C (Castagnoli) over a buffer, chainable: crc = dt_crc32c(crc, buf, n), start with 0. */
uint32_t dt_crc32c(uint32_t crc, const void *buf, size_t n);

/* Strict number parsing: the whole string must be a number in range (for doubles: finite;
 * subnormal and underflowing values are taken as strtod rounds them). 0 or DT_EINVAL. */
int dt_parse_i64(const char *s, int64_t *out);
/* A comma-separated list of integers in [lo, hi] ("0,2,3"; no spaces, no empty entries) into
 * out (room for n_max), *count of them. 0, or DT_EINVAL for a bad entry or more than n_max. */
int dt_parse_int_list(const char *s, int lo, int hi, int *out, int n_max, int *count);
int dt_parse_f64(const char *s, double *out);
/* Whether an address ("host:port", "[v6]:port", ":port", or a gRPC target such as
 * "dns:///host:port") ends with a port number above 65535: resolvers take such a number modulo
 * 65536 (99999 becomes 34463), so a typo would listen on, or connect to, another port. A
 * predicate: 1 when out of range. */
int dt_addr_port_out_of_range(const char *addr);
/* Whether s (n bytes) is UTF-8 (RFC 3629: shortest forms, no surrogates, at most U+10FFFF), as
 * protobuf's string fields and YAML must be (protobuf-c does not check; the official libraries
 * refuse to decode a message with a string that is not). */
int dt_utf8_valid(const char *s, size_t n);
/* The character starting at s (n bytes there): its length when they hold a whole valid one,
 * 0 when they are the start of one still to be completed (a stream's next bytes), -1 when s[0]
 * starts none. */
int dt_utf8_next(const char *s, size_t n);
/* Makes the NUL-terminated s UTF-8 in place: each byte that starts no valid sequence (a
 * Latin-1 byte of a path, a character cut in two by a fixed-size buffer) becomes '?'. */
void dt_utf8_sanitize(char *s);
/* How many of the n values at v run on from v[0] one by one (v[0], v[0] + 1, ...); 0 for n 0. */
size_t dt_run_length(const int64_t *v, size_t n);
/* "step S", or "steps S-E" for count > 1: the count steps from first. */
void dt_steps_text(char *buf, size_t len, int64_t first, int64_t count);
/* The n ascending steps as --skip-steps takes them, "S,S:N,...": comma-separated, each run of
 * consecutive steps as its first and length (dt_parse_step_range), in a malloc'd string ("" for
 * none); NULL when out of memory. (The agent passes the steps to skip so: whole, however many.) */
char *dt_join_steps(const int64_t *v, size_t n);
/* A range of steps, "S" or "S:N": the N >= 1 steps from step S >= 1 (N 1 when left out), so
 * that the last, S + N - 1, is an int. 0 or DT_EINVAL. */
int dt_parse_step_range(const char *s, int *first, int *count);
/* A command-line integer flag in [lo, hi]: on error prints "PROG: --FLAG: expected an integer
 * in [lo, hi], got 'S'" to stderr and returns DT_EINVAL. */
int dt_parse_int_flag(const char *prog, const char *flag, const char *s, int64_t lo, int64_t hi,
                      int *out);
/* A 0/1 switch from the environment: *on set when NAME is 0 or 1 and left alone when it is unset
 * or empty; DT_EINVAL, with an ERROR line naming NAME, for anything else, so that a typo
 * ("true", "yes") is refused instead of passing for 0. */
int dt_env_switch(const char *name, int *on);

/* How this process computes, as the trainer sets it once its device is open, before it
 * communicates: the threads computing (its OpenMP threads on a CPU device, 1 where a GPU computes
 * and its thread only queues work), and whether collectives run on a thread of their own
 * meanwhile (the data-parallel comm thread, dt_dp_overlapped). 1 and 0 until set. */
void dt_set_compute(int threads, int overlap);
/* Whether this node has a CPU to spare beyond the compute threads of its ranks: the CPUs this
 * process may run on (its affinity) outnumber its compute threads times the node's ranks
 * (LOCAL_WORLD_SIZE, else WORLD_SIZE, else 1), each taken to compute with as many. Where none is
 * spare, a helper thread (a comm thread, the CPU communicator's I/O thread) takes its CPU time
 * from a compute thread. */
int dt_cpu_spare(void);
/* Whether the thread that moves this process's messages (the CPU communicator's I/O thread)
 * should yield every CPU to compute (the idle scheduling class): where the process may run on one
 * CPU, or where no CPU is spare, unless collectives overlap compute (dt_set_compute) with ranks on
 * other nodes (LOCAL_WORLD_SIZE below WORLD_SIZE), whose messages it must move while every CPU
 * computes. */
int dt_io_yields(void);

#endif
