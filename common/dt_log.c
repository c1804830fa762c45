/* dt_log.c — one formatted line per call, written with a single write(2) so that lines from
 * concurrent processes sharing stderr (trainers under one agent) never interleave. */
#include "dt_log.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static dt_log_level_t g_level = DT_LOG_INFO;
static unsigned g_subsys = ~0u;
static int g_journal = 0;
static int g_inited = 0;
static char g_tag[64];
/* The text of the latest ERROR line, for a process that reports why it failed (a trainer
 * tells its agent). Written under a mutex; errors are rare. */
static char g_last_error[512];
static pthread_mutex_t g_last_error_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *const g_level_names[] = {"ERROR", "WARN", "INFO", "DEBUG", "TRACE"};
/* journald/syslog priorities: err, warning, info, debug, debug */
static const int g_level_prio[] = {3, 4, 6, 7, 7};

static unsigned parse_subsys(const char *s)
{
  unsigned mask = 0;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", s);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (strcmp(tok, "all") == 0)
      return ~0u;
#define DT__SUBSYS_MATCH(name, bit, str)                                                           \
  if (strcmp(tok, str) == 0)                                                                       \
    mask |= DT_SUBSYS_##name;
    DT_SUBSYS_MAP(DT__SUBSYS_MATCH)
#undef DT__SUBSYS_MATCH
  }
  return mask;
}

void dt_log_init(void)
{
  if (g_inited)
    return;
  g_inited = 1;
  const char *lvl = getenv("DISTRAIN_DEBUG");
  if (lvl && *lvl) {
    for (int i = 0; i <= DT_LOG_TRACE; i++)
      if (strcasecmp(lvl, g_level_names[i]) == 0)
        g_level = (dt_log_level_t)i;
  }
  const char *sub = getenv("DISTRAIN_DEBUG_SUBSYS");
  if (sub && *sub)
    g_subsys = parse_subsys(sub);
  g_journal = getenv("JOURNAL_STREAM") != NULL;
}

void dt_log_set_level(dt_log_level_t level)
{
  dt_log_init();
  g_level = level;
}

void dt_log_set_tag(const char *tag)
{
  snprintf(g_tag, sizeof g_tag, "%s", tag ? tag : "");
}

int dt_log_enabled(dt_log_level_t level, unsigned subsys)
{
  dt_log_init();
  if (level > g_level)
    return 0;
  return level <= DT_LOG_INFO || (subsys & g_subsys) != 0;
}

void dt_log_write(dt_log_level_t level, unsigned subsys, const char *file, int line,
                  const char *fmt, ...)
{
  char buf[2048];
  int n = 0;
  if (g_journal) {
    n = snprintf(buf, sizeof buf, "<%d>", g_level_prio[level]);
  } else {
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    localtime_r(&ts.tv_sec, &tm);
    n = snprintf(buf, sizeof buf, "%02d:%02d:%02d.%03ld ", tm.tm_hour, tm.tm_min, tm.tm_sec,
                 ts.tv_nsec / 1000000);
  }
  if (g_tag[0])
    n += snprintf(buf + n, sizeof buf - (size_t)n, "[%s] ", g_tag);
  if (level != DT_LOG_INFO)
    n += snprintf(buf + n, sizeof buf - (size_t)n, "%s ", g_level_names[level]);
  if (level >= DT_LOG_DEBUG) {
    const char *base = strrchr(file, '/');
    n += snprintf(buf + n, sizeof buf - (size_t)n, "%s:%d ", base ? base + 1 : file, line);
  }
  (void)subsys;
  va_list ap;
  va_start(ap, fmt);
  int msg_start = n < (int)sizeof buf ? n : (int)sizeof buf - 1;
  if (n < (int)sizeof buf)
    n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
  va_end(ap);
  if (level == DT_LOG_ERROR) {
    pthread_mutex_lock(&g_last_error_lock);
    snprintf(g_last_error, sizeof g_last_error, "%s", buf + msg_start);
    pthread_mutex_unlock(&g_last_error_lock);
  }
  if (n > (int)sizeof buf - 2)
    n = (int)sizeof buf - 2;
  buf[n++] = '\n';
  ssize_t w = write(STDERR_FILENO, buf, (size_t)n);
  (void)w;
}

void dt_log_last_error(char *out, size_t n)
{
  pthread_mutex_lock(&g_last_error_lock);
  snprintf(out, n, "%s", g_last_error);
  pthread_mutex_unlock(&g_last_error_lock);
}
