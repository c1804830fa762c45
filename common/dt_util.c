/* dt_util.c — see dt_util.h. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "dt_util.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "dt_error.h"
#include "dt_log.h"

uint64_t dt_now_ns(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double dt_now_ms(void)
{
  return (double)dt_now_ns() / 1e6;
}

int64_t dt_wall_ms(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void dt_sleep_ms(double ms)
{
  if (ms <= 0)
    return;
  struct timespec ts = {.tv_sec = (time_t)(ms / 1000.0), .tv_nsec = (long)(fmod(ms, 1000.0) * 1e6)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

void *dt_calloc_aligned(size_t bytes, const char *what)
{
  void *p = NULL;
  size_t rounded = (bytes + 63) & ~(size_t)63;
  if (rounded == 0)
    rounded = 64;
  if (posix_memalign(&p, 64, rounded) != 0) {
    DT_ERROR(INIT, "out of memory allocating %zu bytes for %s", bytes, what);
    return NULL;
  }
  memset(p, 0, rounded);
  return p;
}

void dt_free_aligned(void *p)
{
  free(p);
}

int dt_grow(void **p, size_t *cap, size_t need, size_t elem)
{
  if (need <= *cap)
    return 0;
  size_t c = *cap ? *cap : 64;
  while (c < need)
    c *= 2;
  void *q = realloc(*p, c * elem);
  if (!q)
    return DT_ENOMEM;
  *p = q;
  *cap = c;
  return 0;
}

uint64_t dt_fnv1a(uint64_t h, const void *p, size_t n)
{
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

int dt_afile_open(dt_afile_t *af, const char *path)
{
  memset(af, 0, sizeof *af);
  if (strlen(path) + 32 >= sizeof af->tmp) {
    DT_ERROR(INIT, "%s: path too long", path);
    return DT_EINVAL;
  }
  snprintf(af->path, sizeof af->path, "%s", path);
  snprintf(af->tmp, sizeof af->tmp, "%s.tmp.%ld", path, (long)getpid());
  af->fp = fopen(af->tmp, "wb");
  if (!af->fp) {
    int e = errno;
    DT_ERROR(INIT, "%s: cannot create: %s", af->tmp, strerror(e));
    return dt_err_from_errno(e);
  }
  return 0;
}

/* A failed write: DT_ENOSPC for a full disk or quota (the callers tell it apart: a save may be
 * skipped), DT_EIO otherwise. */
static int write_error(int e)
{
  return dt_err_from_errno(e) == DT_ENOSPC ? DT_ENOSPC : DT_EIO;
}

int dt_afile_write(dt_afile_t *af, const void *buf, size_t n)
{
  if (n && fwrite(buf, 1, n, af->fp) != n) {
    const int e = errno;
    DT_ERROR(INIT, "%s: write failed: %s", af->tmp, strerror(e));
    return write_error(e);
  }
  return 0;
}

int dt_afile_commit(dt_afile_t *af)
{
  int ret = 0;
  if (fflush(af->fp) != 0 || fsync(fileno(af->fp)) != 0) {
    const int e = errno;
    DT_ERROR(INIT, "%s: flush/fsync failed: %s", af->tmp, strerror(e));
    ret = write_error(e);
  }
  if (fclose(af->fp) != 0 && ret == 0) {
    const int e = errno;
    DT_ERROR(INIT, "%s: close failed: %s", af->tmp, strerror(e));
    ret = write_error(e);
  }
  af->fp = NULL;
  if (ret == 0 && rename(af->tmp, af->path) != 0) {
    int e = errno;
    DT_ERROR(INIT, "rename %s -> %s failed: %s", af->tmp, af->path, strerror(e));
    ret = dt_err_from_errno(e);
  }
  if (ret != 0) {
    unlink(af->tmp);
    return ret;
  }
  return dt_fsync_parent(af->path);
}

void dt_afile_abort(dt_afile_t *af)
{
  if (af->fp) {
    fclose(af->fp);
    af->fp = NULL;
  }
  if (af->tmp[0])
    unlink(af->tmp);
}

int dt_mkdir_p(const char *path)
{
  char buf[4096];
  if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
    return DT_EINVAL;
  for (char *p = buf + 1; *p; p++) {
    if (*p != '/')
      continue;
    *p = '\0';
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
      return dt_err_from_errno(errno);
    *p = '/';
  }
  if (mkdir(buf, 0755) != 0 && errno != EEXIST)
    return dt_err_from_errno(errno);
  struct stat st;
  if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode))
    return DT_EEXIST;
  return 0;
}

int dt_fsync_parent(const char *path)
{
  char buf[4096];
  snprintf(buf, sizeof buf, "%s", path);
  const char *dir = dirname(buf);
  int fd = open(dir, O_RDONLY | O_DIRECTORY);
  if (fd < 0) {
    int e = errno;
    DT_ERROR(INIT, "%s: cannot open directory for fsync: %s", dir, strerror(e));
    return dt_err_from_errno(e);
  }
  int rc = fsync(fd);
  int e = errno;
  close(fd);
  if (rc != 0) {
    DT_ERROR(INIT, "%s: fsync failed: %s", dir, strerror(e));
    return DT_EIO;
  }
  return 0;
}

/* CRC-32C, byte-at-a-time table (4 KiB, built on first use). Checkpoint shards are checksummed
 * once per save, so table speed is ample; a hardware (SSE4.2) path can come later. */
static uint32_t g_crc_table[256];
static void crc_init(void)
{
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++)
      c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    g_crc_table[i] = c;
  }
}

uint32_t dt_crc32c(uint32_t crc, const void *buf, size_t n)
{
  static _Atomic int inited;
  if (!inited) {
    crc_init();
    inited = 1;
  }
  const uint8_t *p = buf;
  crc = ~crc;
  for (size_t i = 0; i < n; i++)
    crc = g_crc_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

/* strtoll/strtod skip leading white space; a strict parse must not (" 12" is not a number any
 * more than "12 " is). */
static int starts_like_number(const char *s)
{
  return s && *s && !isspace((unsigned char)*s);
}

int dt_parse_i64(const char *s, int64_t *out)
{
  if (!starts_like_number(s))
    return DT_EINVAL;
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno != 0 || *end != '\0')
    return DT_EINVAL;
  *out = v;
  return 0;
}

int dt_parse_int_list(const char *s, int lo, int hi, int *out, int n_max, int *count)
{
  *count = 0;
  char buf[32];
  for (const char *p = s;;) {
    const char *comma = strchr(p, ',');
    const size_t len = comma ? (size_t)(comma - p) : strlen(p);
    int64_t v;
    if (len >= sizeof buf || *count == n_max)
      return DT_EINVAL;
    memcpy(buf, p, len);
    buf[len] = '\0';
    if (dt_parse_i64(buf, &v) != 0 || v < lo || v > hi)
      return DT_EINVAL;
    out[(*count)++] = (int)v;
    if (!comma)
      return 0;
    p = comma + 1;
  }
}

int dt_parse_step_range(const char *s, int *first, int *count)
{
  char buf[64];
  int64_t f, n = 1;
  if (!s || strlen(s) >= sizeof buf)
    return DT_EINVAL;
  snprintf(buf, sizeof buf, "%s", s);
  char *colon = strchr(buf, ':');
  if (colon)
    *colon = '\0';
  if (dt_parse_i64(buf, &f) != 0 || f < 1 || f > INT_MAX ||
      (colon && dt_parse_i64(colon + 1, &n) != 0) || n < 1 || n > INT_MAX - f + 1)
    return DT_EINVAL;
  *first = (int)f;
  *count = (int)n;
  return 0;
}

size_t dt_run_length(const int64_t *v, size_t n)
{
  size_t run = n > 0;
  while (run < n && v[run] == v[0] + (int64_t)run)
    run++;
  return run;
}

void dt_steps_text(char *buf, size_t len, int64_t first, int64_t count)
{
  if (count > 1)
    snprintf(buf, len, "steps %lld-%lld", (long long)first, (long long)(first + count - 1));
  else
    snprintf(buf, len, "step %lld", (long long)first);
}

char *dt_join_steps(const int64_t *v, size_t n)
{
  char *out = malloc(n * 21 + 1); /* "-9223372036854775808," is 21; "S:N," no more than its S's */
  if (!out)
    return NULL;
  size_t at = 0;
  out[0] = '\0';
  for (size_t i = 0, run; i < n; i += run) {
    run = dt_run_length(v + i, n - i);
    at += (size_t)sprintf(out + at, "%s%lld", i ? "," : "", (long long)v[i]);
    if (run > 1)
      at += (size_t)sprintf(out + at, ":%zu", run);
  }
  return out;
}

int dt_parse_f64(const char *s, double *out)
{
  if (!starts_like_number(s))
    return DT_EINVAL;
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  /* glibc sets ERANGE for a subnormal result (5e-324) as for an underflow to zero: both are
   * what the text rounds to, as a job spec's YAML reads them. Only overflow is out of range. */
  if ((errno != 0 && errno != ERANGE) || *end != '\0' || !isfinite(v))
    return DT_EINVAL;
  *out = v;
  return 0;
}

int dt_addr_port_out_of_range(const char *addr)
{
  const char *colon = addr ? strrchr(addr, ':') : NULL;
  if (!colon || !colon[1] || strspn(colon + 1, "0123456789") != strlen(colon + 1))
    return 0;
  return strlen(colon + 1) > 5 || atoi(colon + 1) > 65535;
}

int dt_parse_int_flag(const char *prog, const char *flag, const char *s, int64_t lo, int64_t hi,
                      int *out)
{
  int64_t v;
  if (dt_parse_i64(s, &v) != 0 || v < lo || v > hi) {
    fprintf(stderr, "%s: --%s: expected an integer in [%lld, %lld], got '%s'\n", prog, flag,
            (long long)lo, (long long)hi, s);
    return DT_EINVAL;
  }
  *out = (int)v;
  return 0;
}

int dt_env_switch(const char *name, int *on)
{
  const char *v = getenv(name);
  if (!v || !*v)
    return 0;
  if (strcmp(v, "0") == 0 || strcmp(v, "1") == 0) {
    *on = v[0] == '1';
    return 0;
  }
  DT_ERROR(INIT, "%s=%s: expected 0 or 1, or unset", name, v);
  return DT_EINVAL;
}

int dt_utf8_next(const char *s, size_t n)
{
  const unsigned char *p = (const unsigned char *)s;
  if (n == 0)
    return 0;
  const unsigned c = p[0];
  if (c < 0x80)
    return 1;
  size_t more;
  unsigned cp, min;
  if (c >= 0xC2 && c <= 0xDF)
    more = 1, cp = c & 0x1F, min = 0x80;
  else if (c >= 0xE0 && c <= 0xEF)
    more = 2, cp = c & 0x0F, min = 0x800;
  else if (c >= 0xF0 && c <= 0xF4)
    more = 3, cp = c & 0x07, min = 0x10000;
  else
    return -1;
  for (size_t k = 1; k <= more; k++) {
    if (k == n)
      return 0; /* so far the start of one */
    if ((p[k] & 0xC0) != 0x80)
      return -1;
    cp = cp << 6 | (p[k] & 0x3F);
  }
  return cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF) ? -1 : (int)more + 1;
}

int dt_utf8_valid(const char *s, size_t n)
{
  for (size_t i = 0; i < n;) {
    const int k = dt_utf8_next(s + i, n - i);
    if (k <= 0)
      return 0;
    i += (size_t)k;
  }
  return 1;
}

void dt_utf8_sanitize(char *s)
{
  const size_t n = strlen(s);
  for (size_t i = 0; i < n;) {
    const int k = dt_utf8_next(s + i, n - i);
    if (k <= 0)
      s[i] = '?';
    i += k > 0 ? (size_t)k : 1;
  }
}

static atomic_int g_compute_threads = 1, g_compute_overlap = 0;

void dt_set_compute(int threads, int overlap)
{
  atomic_store(&g_compute_threads, threads > 0 ? threads : 1);
  atomic_store(&g_compute_overlap, overlap != 0);
}

/* A positive count from the environment variable name, else 0. */
static long env_count(const char *name)
{
  const char *v = getenv(name);
  const long n = v && *v ? strtol(v, NULL, 10) : 0;
  return n > 0 ? n : 0;
}

static long affinity_cpus(void)
{
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                     : sysconf(_SC_NPROCESSORS_ONLN);
}

int dt_cpu_spare(void)
{
  long local = env_count("LOCAL_WORLD_SIZE");
  if (!local)
    local = env_count("WORLD_SIZE");
  return affinity_cpus() > (long)atomic_load(&g_compute_threads) * (local ? local : 1);
}

int dt_io_yields(void)
{
  if (affinity_cpus() == 1)
    return 1;
  const long local = env_count("LOCAL_WORLD_SIZE"), world = env_count("WORLD_SIZE");
  const int other_nodes = local && world > local;
  return !dt_cpu_spare() && !(atomic_load(&g_compute_overlap) && other_nodes);
}
