/* dt_param.h — tunables declared once, read from the environment once (the NCCL_PARAM idea).
 *
 *   DT_PARAM(HeartbeatMs, "HEARTBEAT_MS", 1000)
 * defines int64_t dt_param_HeartbeatMs(void), which returns DISTRAIN_HEARTBEAT_MS when set to a
 * valid integer and the default otherwise. A malformed value is reported once and ignored, never
 * silently misread. Precedence: a CLI flag (handled by the program) > environment > default. */
#ifndef DT_PARAM_H
#define DT_PARAM_H

#include <stdint.h>

/* Reads DISTRAIN_<env>; returns deflt when unset or malformed. */
int64_t dt__param_env(const char *env, int64_t deflt);

#define DT_PARAM(name, env, deflt)                                                                 \
  static inline int64_t dt_param_##name(void)                                                      \
  {                                                                                                \
    static _Atomic int64_t cache;                                                                  \
    static _Atomic int loaded;                                                                     \
    if (!loaded) { /* idempotent: a race reads the same environment twice */                       \
      cache = dt__param_env(env, (deflt));                                                         \
      loaded = 1;                                                                                  \
    }                                                                                              \
    return cache;                                                                                  \
  }

#endif
