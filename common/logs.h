/* logs.h — trainer log files and the chunks GetLogs serves from them (pure helpers).
 *
 * An agent writes rank R of job J to <work_dir>/<J>/rank-<R>.log, appending across
 * generations. A reader asks for bytes from an offset and gets at most DT_LOGS_MAX_CHUNK of
 * them; the next read starts at next_offset. The path is always built here from the job id
 * and rank, never taken from a request: a job id is a single path component. */
#ifndef DT_LOGS_H
#define DT_LOGS_H

#include <stddef.h>
#include <stdint.h>

/* Most bytes one GetLogs answer carries (a request for more, or for 0, gets this many). */
#define DT_LOGS_MAX_CHUNK (1u << 20)

/* One read of a file of size bytes, asked from offset for max_bytes. */
typedef struct {
  uint64_t start; /* where the bytes start: offset, or 0 if the file is shorter than offset
                   * (it was replaced: a reader then starts over) */
  size_t len;     /* bytes to read from start: <= DT_LOGS_MAX_CHUNK */
  int eof;        /* start + len reaches size */
} dt_logs_chunk_t;

/* Plans one read (never fails). */
dt_logs_chunk_t dt_logs_chunk(uint64_t size, uint64_t offset, uint32_t max_bytes);

/* Whether a job id is a safe single path component: 1-63 of [A-Za-z0-9._-], not starting
 * with '.'. */
int dt_logs_job_ok(const char *job);

/* <work_dir>/<job>/rank-<rank>.log into buf. DT_EINVAL for an unsafe job id or a negative rank,
 * DT_ERANGE if it does not fit. */
int dt_logs_path(const char *work_dir, const char *job, int rank, char *buf, size_t len);

#endif
