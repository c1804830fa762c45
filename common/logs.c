/* logs.c — see logs.h. */
#include "logs.h"

#include <stdio.h>
#include <string.h>

#include "dt_error.h"
#include "dt_util.h"

dt_logs_chunk_t dt_logs_chunk(uint64_t size, uint64_t offset, uint32_t max_bytes)
{
  dt_logs_chunk_t c;
  const uint64_t max = max_bytes == 0 ? DT_LOGS_MAX_CHUNK : DT_MIN(max_bytes, DT_LOGS_MAX_CHUNK);
  c.start = offset <= size ? offset : 0;
  c.len = (size_t)DT_MIN(size - c.start, max);
  c.eof = c.start + c.len == size;
  return c;
}

int dt_logs_job_ok(const char *job)
{
  const size_t n = strlen(job);
  if (n == 0 || n > 63 || job[0] == '.')
    return 0;
  for (size_t i = 0; i < n; i++) {
    const char ch = job[i];
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          ch == '.' || ch == '_' || ch == '-'))
      return 0;
  }
  return 1;
}

int dt_logs_path(const char *work_dir, const char *job, int rank, char *buf, size_t len)
{
  if (!dt_logs_job_ok(job) || rank < 0)
    return DT_EINVAL;
  int n = snprintf(buf, len, "%s/%s/rank-%d.log", work_dir, job, rank);
  return n < 0 || (size_t)n >= len ? DT_ERANGE : 0;
}
