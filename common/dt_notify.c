/* dt_notify.c — see dt_notify.h. */
#include "dt_notify.h"

#include <stdio.h>
#include <string.h>

#ifdef DT_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"

DT_PARAM(NotifyStatusMs, "NOTIFY_STATUS_MS", 2000)
DT_PARAM(FaultBlockLoopMs, "FAULT_BLOCK_LOOP_MS", 0)

/* The fault hook fires this long after READY=1, so that a test sees regular pings first. */
#define FAULT_DELAY_MS 1000

/* ------------------------------------------------------------------------------------------ */
/* Messages                                                                                    */
/* ------------------------------------------------------------------------------------------ */

int dt_notify_send(const char *msg)
{
#ifdef DT_HAVE_SYSTEMD
  /* unset_environment = 0: every later message needs NOTIFY_SOCKET too. The agent keeps it
   * away from its trainers (trainer_env), so nothing else talks for this service. */
  int rc = sd_notify(0, msg);
  if (rc < 0) {
    DT_DEBUG(INIT, "sd_notify(\"%.40s\"): %s", msg, strerror(-rc));
    return dt_err_from_errno(-rc);
  }
  return rc > 0;
#else
  (void)msg;
  return 0;
#endif
}

uint64_t dt_notify_watchdog_usec(void)
{
#ifdef DT_HAVE_SYSTEMD
  uint64_t usec = 0;
  /* > 0 only when WATCHDOG_USEC is set and WATCHDOG_PID, if set, is our pid. */
  if (sd_watchdog_enabled(0, &usec) > 0)
    return usec;
#endif
  return 0;
}

/* STATUS= (prefixed with READY=1 the first time) if the text changed or force. */
static void send_status(dt_notify_t *n, const char *prefix, int force)
{
  char text[sizeof n->last_status] = "";
  if (n->status_fn)
    n->status_fn(n->data, text, sizeof text);
  if (!force && strcmp(text, n->last_status) == 0)
    return;
  snprintf(n->last_status, sizeof n->last_status, "%s", text);
  char msg[sizeof text + 64];
  snprintf(msg, sizeof msg, "%s%sSTATUS=%s", prefix, prefix[0] ? "\n" : "", text);
  dt_notify_send(msg);
}

/* ------------------------------------------------------------------------------------------ */
/* Timers                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static void on_watchdog(uv_timer_t *t)
{
  (void)t;
  dt_notify_send("WATCHDOG=1");
}

/* Before READY=1 too: "registering with head:7470 (last try: ...)" is what an operator
 * waiting on `systemctl start` wants to see. */
static void on_status(uv_timer_t *t)
{
  dt_notify_refresh(t->data);
}

static void on_fault(uv_timer_t *t)
{
  const int64_t ms = dt_param_FaultBlockLoopMs();
  (void)t;
  DT_WARN(INIT, "DISTRAIN_FAULT_BLOCK_LOOP_MS: blocking the event loop for %lld ms (test hook)",
          (long long)ms);
  dt_sleep_ms((double)ms);
  DT_WARN(INIT, "DISTRAIN_FAULT_BLOCK_LOOP_MS: the event loop runs again");
}

int dt_notify_init(uv_loop_t *loop, dt_notify_t *n, dt_notify_status_fn status_fn, void *data)
{
  memset(n, 0, sizeof *n);
  n->loop = loop;
  n->data = data;
  n->status_fn = status_fn;
  uv_timer_init(loop, &n->watchdog);
  uv_timer_init(loop, &n->status);
  uv_timer_init(loop, &n->fault);
  n->watchdog.data = n->status.data = n->fault.data = n;
  n->open_handles = 3;
  /* None of the timers may keep the loop alive: a daemon's loop ends when its own handles
   * close, whether or not dt_notify_close has run yet. */
  uv_unref((uv_handle_t *)&n->watchdog);
  uv_unref((uv_handle_t *)&n->status);
  uv_unref((uv_handle_t *)&n->fault);
  n->watchdog_usec = dt_notify_watchdog_usec();
  if (n->watchdog_usec) {
    /* Half the interval, as sd_watchdog_enabled(3) advises; at least 1 ms. */
    const uint64_t ms = DT_MAX((uint64_t)1, n->watchdog_usec / 2000);
    DT_INFO(INIT, "systemd watchdog: %.3f s, pinging every %llu ms from the event loop",
            (double)n->watchdog_usec / 1e6, (unsigned long long)ms);
    dt_notify_send("WATCHDOG=1");
    uv_timer_start(&n->watchdog, on_watchdog, ms, ms);
  }
  if (status_fn) {
    const uint64_t ms = (uint64_t)DT_MAX(100, dt_param_NotifyStatusMs());
    uv_timer_start(&n->status, on_status, ms, ms);
  }
  return 0;
}

void dt_notify_ready(dt_notify_t *n)
{
  if (n->stopping)
    return;
  if (n->ready) {
    dt_notify_refresh(n);
    return;
  }
  n->ready = 1;
  send_status(n, "READY=1", 1);
  const int64_t block = dt_param_FaultBlockLoopMs();
  if (block > 0)
    uv_timer_start(&n->fault, on_fault, FAULT_DELAY_MS, 0);
}

void dt_notify_refresh(dt_notify_t *n)
{
  if (!n->stopping)
    send_status(n, "", 0);
}

static void on_closed(uv_handle_t *h)
{
  dt_notify_t *n = h->data;
  if (--n->open_handles == 0 && n->close_cb)
    n->close_cb(n);
}

void dt_notify_stopping(dt_notify_t *n)
{
  if (n->stopping)
    return;
  n->stopping = 1;
  uv_timer_stop(&n->status);
  uv_timer_stop(&n->fault);
  dt_notify_send("STOPPING=1");
}

void dt_notify_close(dt_notify_t *n, void (*cb)(dt_notify_t *n))
{
  dt_notify_stopping(n);
  n->close_cb = cb;
  uv_close((uv_handle_t *)&n->watchdog, on_closed);
  uv_close((uv_handle_t *)&n->status, on_closed);
  uv_close((uv_handle_t *)&n->fault, on_closed);
}
