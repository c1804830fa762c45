/* stop.c — the thread that waits for a stop signal (see stop.h). SIGTERM stays blocked in every
 * other thread and is taken here by sigwait, so no handler runs inside the trainer's code and no
 * system call of it returns EINTR. */
#include "stop.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

#include "dt_log.h"
#include "dt_util.h"

/* SIGTERMs this soon after the first are the same request: one stop reaches a trainer more than
 * once (Slurm signals every process of a step, and the agent among them signals its trainers;
 * a whole process group or cgroup is signalled, and the agent again). */
#define REPEAT_MS 2000.0

static atomic_int g_signal;
static sigset_t g_set;

static void *watch_main(void *arg)
{
  (void)arg;
  double first = 0.0;
  for (;;) {
    int sig;
    if (sigwait(&g_set, &sig) != 0)
      continue;
    if (!atomic_load(&g_signal)) {
      first = dt_now_ms();
      atomic_store(&g_signal, sig);
      DT_WARN(TRAIN,
              "SIGTERM: stopping at the end of this step with a checkpoint (another SIGTERM "
              "%.0f s from now ends the process at once)",
              REPEAT_MS / 1000.0);
      continue;
    }
    if (dt_now_ms() - first < REPEAT_MS) {
      DT_DEBUG(TRAIN, "SIGTERM again, %.0f ms after the first: the same stop", dt_now_ms() - first);
      continue;
    }
    /* The signal's own action, which ends the process. */
    DT_WARN(TRAIN, "SIGTERM again while stopping: exiting now");
    signal(sig, SIG_DFL);
    pthread_sigmask(SIG_UNBLOCK, &g_set, NULL);
    raise(sig);
  }
  return NULL;
}

int dt_stop_watch(void)
{
  sigemptyset(&g_set);
  sigaddset(&g_set, SIGTERM);
  int rc = pthread_sigmask(SIG_BLOCK, &g_set, NULL);
  pthread_t th;
  if (rc == 0)
    rc = pthread_create(&th, NULL, watch_main, NULL);
  if (rc == 0)
    rc = pthread_detach(th);
  if (rc != 0) {
    DT_ERROR(TRAIN, "cannot watch for SIGTERM: %s", strerror(rc));
    return DT_ESYS;
  }
  return 0;
}

int dt_stop_requested(void)
{
  return atomic_load(&g_signal);
}
