/* http.c — see http.h. libmicrohttpd in "external epoll" mode (MHD_USE_EPOLL without
 * MHD_USE_INTERNAL_POLLING_THREAD): one uv_poll_t on MHD's epoll descriptor, one uv_timer_t armed
 * from MHD_get_timeout() after every MHD_run(); the server frees itself once both handles are
 * closed. */
#include "http.h"

#include <microhttpd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dt_error.h"
#include "dt_log.h"
#include "listener.h"

#define HTTP_MAX_CONNECTIONS 64
#define HTTP_IDLE_TIMEOUT_S  30

struct dt_http {
  struct MHD_Daemon *d;
  dt_http_handler_t fn;
  void *ud;
  uv_poll_t poll;   /* MHD's epoll descriptor */
  uv_timer_t timer; /* MHD_get_timeout() */
  int open_handles; /* poll + timer not yet closed */
  void (*closed_cb)(void *);
  void *closed_ud;
};

/* ------------------------------------------------------------------------------------------ */
/* Requests                                                                                    */
/* ------------------------------------------------------------------------------------------ */

static enum MHD_Result reply(struct MHD_Connection *conn, int status, const char *type, char *body,
                             size_t len, const char *allow)
{
  static char oom[] = "out of memory\n";
  struct MHD_Response *r;
  if (body) {
    r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
  } else {
    status = MHD_HTTP_INTERNAL_SERVER_ERROR;
    type = "text/plain; charset=utf-8";
    r = MHD_create_response_from_buffer(sizeof oom - 1, oom, MHD_RESPMEM_PERSISTENT);
  }
  if (!r) {
    free(body);
    return MHD_NO; /* MHD closes the connection */
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
  if (allow)
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
  enum MHD_Result ret = MHD_queue_response(conn, (unsigned)status, r);
  MHD_destroy_response(r);
  return ret;
}

static char *copy_text(const char *s, size_t *len)
{
  *len = strlen(s);
  char *out = malloc(*len + 1);
  if (out)
    memcpy(out, s, *len + 1);
  return out;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls)
{
  static int headers_seen;
  dt_http_t *h = cls;
  (void)version, (void)upload;
  size_t len;
  /* Any other method is refused at once, on the first call (the headers): its body is never
   * read (MHD accepts no response while a body is being received). */
  if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
    char *body = copy_text("read-only: only GET and HEAD are allowed\n", &len);
    return reply(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", body, len,
                 "GET, HEAD");
  }
  /* GET and HEAD: answered once the whole request is in, a body (never used) skipped. */
  if (!*con_cls) {
    *con_cls = &headers_seen;
    return MHD_YES;
  }
  if (*upload_size) {
    *upload_size = 0;
    return MHD_YES;
  }
  dt_http_response_t resp = {.status = MHD_HTTP_OK, .content_type = "text/plain; charset=utf-8"};
  h->fn(url, &resp, h->ud);
  return reply(conn, resp.status, resp.content_type, resp.body, resp.len, NULL);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
  char msg[512];
  (void)cls;
  vsnprintf(msg, sizeof msg, fmt, ap);
  size_t n = strlen(msg);
  while (n && msg[n - 1] == '\n')
    msg[--n] = '\0';
  DT_WARN(COORD, "http: %s", msg);
}

/* ------------------------------------------------------------------------------------------ */
/* The loop                                                                                    */
/* ------------------------------------------------------------------------------------------ */

static void on_timer(uv_timer_t *t);

/* After every MHD_run: MHD must run again within its timeout (0: work is pending now). */
static void run_mhd(dt_http_t *h)
{
  MHD_run(h->d);
  MHD_UNSIGNED_LONG_LONG ms;
  if (MHD_get_timeout(h->d, &ms) == MHD_YES)
    uv_timer_start(&h->timer, on_timer, (uint64_t)ms, 0);
  else
    uv_timer_stop(&h->timer);
}

static void on_timer(uv_timer_t *t)
{
  run_mhd(t->data);
}

static void on_poll(uv_poll_t *p, int status, int events)
{
  (void)events;
  if (status < 0)
    DT_WARN(COORD, "http: polling failed: %s", uv_strerror(status));
  run_mhd(p->data); /* MHD finds out what failed by itself */
}

int dt_http_start(uv_loop_t *loop, const char *hostport, dt_http_handler_t fn, void *ud,
                  dt_http_t **out, int *port)
{
  int fd = -1, ret;
  dt_http_t *h = calloc(1, sizeof *h);
  if (!h)
    return DT_ENOMEM;
  DT_CHECK_GOTO(dt_listener_bind(hostport, &fd, port), ret, fail);
  h->fn = fn;
  h->ud = ud;
  /* No MHD_USE_INTERNAL_POLLING_THREAD: MHD_run() on this thread does all the work. */
  h->d = MHD_start_daemon(MHD_USE_EPOLL | MHD_USE_ERROR_LOG, 0, NULL, NULL, on_request, h,
                          MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, NULL, MHD_OPTION_LISTEN_SOCKET,
                          fd, MHD_OPTION_CONNECTION_LIMIT, (unsigned)HTTP_MAX_CONNECTIONS,
                          MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_IDLE_TIMEOUT_S,
                          MHD_OPTION_END);
  if (!h->d) {
    DT_ERROR(COORD, "http: libmicrohttpd cannot serve %s", hostport);
    ret = DT_EIO;
    goto fail;
  }
  const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_EPOLL_FD);
  if (!info) {
    DT_ERROR(COORD, "http: libmicrohttpd has no epoll descriptor");
    MHD_stop_daemon(h->d); /* closes fd as well */
    free(h);
    return DT_EIO;
  }
  uv_poll_init(loop, &h->poll, info->epoll_fd);
  h->poll.data = h;
  uv_timer_init(loop, &h->timer);
  h->timer.data = h;
  h->open_handles = 2;
  uv_poll_start(&h->poll, UV_READABLE, on_poll);
  run_mhd(h); /* arms the timer, if MHD wants one */
  *out = h;
  return 0;
fail:
  if (fd >= 0)
    close(fd);
  free(h);
  return ret;
}

static void on_handle_closed(uv_handle_t *handle)
{
  dt_http_t *h = handle->data;
  if (--h->open_handles > 0)
    return;
  void (*cb)(void *) = h->closed_cb;
  void *ud = h->closed_ud;
  free(h);
  if (cb)
    cb(ud);
}

void dt_http_close(dt_http_t *h, void (*cb)(void *ud), void *ud)
{
  h->closed_cb = cb;
  h->closed_ud = ud;
  /* uv_close stops the poll at once, so MHD may close its epoll descriptor right after. */
  uv_close((uv_handle_t *)&h->poll, on_handle_closed);
  uv_close((uv_handle_t *)&h->timer, on_handle_closed);
  MHD_stop_daemon(h->d); /* every connection, the listening socket, the epoll descriptor */
  h->d = NULL;
}
