/* dt_log.h — levels, subsystem masks and the check macros.
 *
 * DISTRAIN_DEBUG=error|warn|info|debug|trace sets the level (default info);
 * DISTRAIN_DEBUG_SUBSYS=train,data,... limits debug/trace output to those subsystems (errors,
 * warnings and info always print). Output goes to stderr; under systemd (JOURNAL_STREAM set)
 * each line starts with the journald <N> priority prefix instead of a timestamp.
 *
 * The check macros log file:line and the foreign message, then return or jump:
 *   DT_CHECK(call)                 call returns a dt error: return it if negative
 *   DT_CHECK_GOTO(call, ret, lbl)  same, but store it in ret and goto lbl
 *   DT_SYS_CHECK(call, what)       call returns -1 and sets errno (POSIX style)
 *   DT_SYS_CHECK_GOTO(call, what, ret, lbl) */
#ifndef DT_LOG_H
#define DT_LOG_H

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include "dt_error.h"

typedef enum {
  DT_LOG_ERROR = 0,
  DT_LOG_WARN = 1,
  DT_LOG_INFO = 2,
  DT_LOG_DEBUG = 3,
  DT_LOG_TRACE = 4,
} dt_log_level_t;

/* name, bit */
#define DT_SUBSYS_MAP(X)                                                                           \
  X(INIT, 0, "init")                                                                               \
  X(TRAIN, 1, "train")                                                                             \
  X(DATA, 2, "data")                                                                               \
  X(CKPT, 3, "ckpt")                                                                               \
  X(COMM, 4, "comm")                                                                               \
  X(RPC, 5, "rpc")                                                                                 \
  X(COORD, 6, "coord")                                                                             \
  X(WORKER, 7, "worker")                                                                           \
  X(KERNEL, 8, "kernel")                                                                           \
  X(CTL, 9, "ctl")

typedef enum {
#define DT__SUBSYS_ENUM(name, bit, str) DT_SUBSYS_##name = 1u << (bit),
  DT_SUBSYS_MAP(DT__SUBSYS_ENUM)
#undef DT__SUBSYS_ENUM
} dt_subsys_t;

/* Reads DISTRAIN_DEBUG / DISTRAIN_DEBUG_SUBSYS (once; later calls are no-ops unless forced). */
void dt_log_init(void);
/* Overrides the level (CLI beats environment). */
void dt_log_set_level(dt_log_level_t level);
/* Prefixes every line with this tag ("rank 3", "coordinator"); NULL for none. */
void dt_log_set_tag(const char *tag);
int dt_log_enabled(dt_log_level_t level, unsigned subsys);
/* Copies the message of the latest ERROR line ("" if none) into out. */
void dt_log_last_error(char *out, size_t n);
void dt_log_write(dt_log_level_t level, unsigned subsys, const char *file, int line,
                  const char *fmt, ...) __attribute__((format(printf, 5, 6)));

#define DT_LOG(level, subsys, ...)                                                                 \
  do {                                                                                             \
    if (dt_log_enabled((level), (subsys)))                                                         \
      dt_log_write((level), (subsys), __FILE__, __LINE__, __VA_ARGS__);                            \
  } while (0)
#define DT_ERROR(subsys, ...) DT_LOG(DT_LOG_ERROR, DT_SUBSYS_##subsys, __VA_ARGS__)
#define DT_WARN(subsys, ...)  DT_LOG(DT_LOG_WARN, DT_SUBSYS_##subsys, __VA_ARGS__)
#define DT_INFO(subsys, ...)  DT_LOG(DT_LOG_INFO, DT_SUBSYS_##subsys, __VA_ARGS__)
#define DT_DEBUG(subsys, ...) DT_LOG(DT_LOG_DEBUG, DT_SUBSYS_##subsys, __VA_ARGS__)
#define DT_TRACE(subsys, ...) DT_LOG(DT_LOG_TRACE, DT_SUBSYS_##subsys, __VA_ARGS__)

#define DT_CHECK(call)                                                                             \
  do {                                                                                             \
    int dt__rc = (call);                                                                           \
    if (dt__rc < 0) {                                                                              \
      DT_DEBUG(INIT, "%s failed: %s", #call, dt_strerror(dt__rc));                                 \
      return dt__rc;                                                                               \
    }                                                                                              \
  } while (0)

#define DT_CHECK_GOTO(call, ret, label)                                                            \
  do {                                                                                             \
    int dt__rc = (call);                                                                           \
    if (dt__rc < 0) {                                                                              \
      DT_DEBUG(INIT, "%s failed: %s", #call, dt_strerror(dt__rc));                                 \
      (ret) = dt__rc;                                                                              \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

#define DT_SYS_CHECK(call, what)                                                                   \
  do {                                                                                             \
    if ((call) == -1) {                                                                            \
      int dt__e = errno;                                                                           \
      DT_ERROR(INIT, "%s: %s", (what), strerror(dt__e));                                           \
      return dt_err_from_errno(dt__e);                                                             \
    }                                                                                              \
  } while (0)

#define DT_SYS_CHECK_GOTO(call, what, ret, label)                                                  \
  do {                                                                                             \
    if ((call) == -1) {                                                                            \
      int dt__e = errno;                                                                           \
      DT_ERROR(INIT, "%s: %s", (what), strerror(dt__e));                                           \
      (ret) = dt_err_from_errno(dt__e);                                                            \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

#endif
