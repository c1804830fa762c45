/* dt_param.c — environment lookup behind DT_PARAM. */
#include "dt_param.h"

#include <stdio.h>
#include <stdlib.h>

#include "dt_log.h"
#include "dt_util.h"

int64_t dt__param_env(const char *env, int64_t deflt)
{
  char name[128];
  snprintf(name, sizeof name, "DISTRAIN_%s", env);
  const char *s = getenv(name);
  if (!s || !*s)
    return deflt;
  int64_t v;
  if (dt_parse_i64(s, &v) != 0) {
    DT_WARN(INIT, "ignoring %s='%s': expected an integer; using %lld", name, s, (long long)deflt);
    return deflt;
  }
  DT_DEBUG(INIT, "%s = %lld (from environment)", name, (long long)v);
  return v;
}
