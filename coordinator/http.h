/* http.h — a small read-only HTTP server on a libuv loop (libmicrohttpd), for the coordinator's
 * /metrics endpoint.
 *
 * libmicrohttpd runs without a thread of its own: its epoll descriptor is watched by a uv_poll_t
 * and its connection timeouts by a uv_timer_t, and MHD_run() is called from their callbacks. The
 * handler therefore runs on the loop thread, between two RPCs, and may read the coordinator's
 * state without locks (coord.h).
 *
 * Invariants:
 *  - Only GET and HEAD reach the handler; any other method is answered 405 (with "Allow: GET,
 *    HEAD") and no request body is ever read. HEAD gets GET's headers without the body.
 *  - At most HTTP_MAX_CONNECTIONS connections at a time, each closed after 30 s idle, so a
 *    client cannot hold the coordinator's descriptors.
 *  - After dt_http_close returns, the handler is never called again. */
#ifndef DT_HTTP_H
#define DT_HTTP_H

#include <stddef.h>
#include <uv.h>

typedef struct dt_http dt_http_t;

/* What the handler fills in. body is malloc'd and becomes the server's; NULL (out of memory)
 * answers 500. content_type must outlive the call (a literal). */
typedef struct {
  int status; /* 200, 404, ... */
  const char *content_type;
  char *body;
  size_t len;
} dt_http_response_t;

/* path is the request's path without its query string ("/metrics"). */
typedef void (*dt_http_handler_t)(const char *path, dt_http_response_t *resp, void *ud);

/* Listens on "host:port" (port 0: a free one, returned in *port) and serves on loop.
 * DT_EINVAL for a malformed address, DT_EUNAVAIL when it cannot be bound, DT_EIO when
 * libmicrohttpd refuses to start. */
int dt_http_start(uv_loop_t *loop, const char *hostport, dt_http_handler_t fn, void *ud,
                  dt_http_t **out, int *port);
/* Closes the listening socket and every connection now; cb(ud) runs (on the loop) once the
 * server's handles are closed and its memory is freed. */
void dt_http_close(dt_http_t *h, void (*cb)(void *ud), void *ud);

#endif
