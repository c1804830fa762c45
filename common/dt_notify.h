/* dt_notify.h — the daemons' side of systemd's service protocol (sd_notify(3)).
 *
 * A unit with Type=notify waits for READY=1 before it counts the service as started; STATUS=
 * is the line `systemctl status` shows; with WatchdogSec= set, systemd restarts the service
 * when WATCHDOG=1 stops arriving; STOPPING=1 says a shutdown is under way.
 *
 * dt_notify_t is a loop object (libuv style: caller-allocated, _init ... _close(cb)). Its
 * timers run on the daemon's one loop thread, so the watchdog pings measure what matters: a
 * loop that is blocked (a deadlock, a stuck disk write on the loop) stops pinging, and systemd
 * restarts the daemon. Pings go out every half of the interval systemd asked for
 * (sd_watchdog_enabled: WATCHDOG_USEC, and WATCHDOG_PID when set must be our pid), as
 * sd_watchdog_enabled(3) recommends. STATUS= is refreshed from a callback every
 * DISTRAIN_NOTIFY_STATUS_MS (2000), before READY=1 too, and sent only when the text changed.
 *
 * Outside systemd (no NOTIFY_SOCKET) every call is a cheap no-op, and so is all of it in a
 * build without libsystemd (DT_HAVE_SYSTEMD undefined: CMake's -DDT_SYSTEMD=OFF, or the library
 * not found).
 *
 * Test hook: DISTRAIN_FAULT_BLOCK_LOOP_MS=N makes the loop sleep N ms once, one second after
 * READY=1, as a deadlocked daemon would; the integration test checks that the watchdog pings
 * stop for that long. Never set it in production. */
#ifndef DT_NOTIFY_H
#define DT_NOTIFY_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

/* Writes the daemon's one-line status into buf (len bytes, NUL-terminated). */
typedef void (*dt_notify_status_fn)(void *data, char *buf, size_t len);

typedef struct dt_notify {
  void *data; /* the status callback's argument */
  /* private */
  uv_loop_t *loop;
  uv_timer_t watchdog; /* WATCHDOG=1 every half interval (only when systemd asked) */
  uv_timer_t status;   /* STATUS= refresh */
  uv_timer_t fault;    /* the DISTRAIN_FAULT_BLOCK_LOOP_MS hook */
  dt_notify_status_fn status_fn;
  char last_status[512];
  uint64_t watchdog_usec; /* 0: no watchdog */
  int ready, stopping, open_handles;
  void (*close_cb)(struct dt_notify *);
} dt_notify_t;

/* Sends one raw message ("READY=1\nSTATUS=..."). Returns 1 if sent, 0 if there is no
 * NOTIFY_SOCKET (or no libsystemd), a negative DT_E* on failure. */
int dt_notify_send(const char *msg);
/* Whether systemd asked for watchdog pings, and their interval (0: no). */
uint64_t dt_notify_watchdog_usec(void);

/* Starts the watchdog pings (when asked for) and the status refresh on loop. status_fn may be
 * NULL (no STATUS=). Sends nothing else: READY=1 comes from dt_notify_ready. */
int dt_notify_init(uv_loop_t *loop, dt_notify_t *n, dt_notify_status_fn status_fn, void *data);
/* READY=1 with the current STATUS=; later calls only refresh the status. */
void dt_notify_ready(dt_notify_t *n);
/* Asks status_fn for the text now and sends STATUS= if it changed. */
void dt_notify_refresh(dt_notify_t *n);
/* STOPPING=1 (once) as a shutdown begins: no more STATUS=, but the watchdog pings go on while
 * the loop runs (stopping trainers takes the agent up to its grace period). */
void dt_notify_stopping(dt_notify_t *n);
/* dt_notify_stopping if not done yet, then closes the timers; cb (may be NULL) runs once they
 * are closed. */
void dt_notify_close(dt_notify_t *n, void (*cb)(dt_notify_t *n));

#endif
