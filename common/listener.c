/* listener.c — see listener.h. One uv_poll per listening socket (an address the host resolves
 * to), one retry timer; the listener frees itself when all of them have been closed. */
#define _GNU_SOURCE /* accept4 */
#include "listener.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"

#define MAX_SOCKETS        8
#define BACKOFF_MIN_MS     50
#define BACKOFF_MAX_MS     1000
#define ACCEPTS_PER_WAKEUP 64 /* then back to the loop, so a flood cannot starve it */
#define WARN_EVERY_MS      10000.0

struct dt_listener {
  uv_loop_t *loop;
  dt_listener_cb cb;
  void *ud;
  int n;
  int fds[MAX_SOCKETS];
  uv_poll_t polls[MAX_SOCKETS];
  uv_timer_t retry;
  int open_handles; /* polls + timer not yet closed */
  int closing;
  unsigned backoff_ms;  /* 0 while accepting normally */
  unsigned failures;    /* accept failures since the last warning */
  double warned_ms;     /* when the last warning was logged */
  unsigned long failed; /* failures since accepting last worked */
};

/* ------------------------------------------------------------------------------------------ */
/* Accepting                                                                                   */
/* ------------------------------------------------------------------------------------------ */

static void format_peer(const struct sockaddr_storage *ss, char *out, size_t len)
{
  char ip[INET6_ADDRSTRLEN] = "?";
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
    inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    snprintf(out, len, "ipv4:%s:%u", ip, ntohs(a->sin_port));
  } else {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
    inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip);
    snprintf(out, len, "ipv6:[%s]:%u", ip, ntohs(a->sin6_port));
  }
}

/* Low latency for small RPCs, and a dead peer noticed in about a minute: idle 30 s, then three
 * probes 10 s apart; unacknowledged data gives up after 60 s. Best effort: a socket that
 * refuses an option still works. */
static void tune(int fd)
{
  const int on = 1, idle = 30, intvl = 10, cnt = 3;
  const unsigned user_timeout_ms = 60000;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
  (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
  (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

static void poll_all(dt_listener_t *l, int on);
static void on_poll(uv_poll_t *h, int status, int events);

/* Out of descriptors or memory: stop polling (a level-triggered poll would spin on the
 * pending connection) and look again after the backoff. */
static void back_off(dt_listener_t *l, int err)
{
  const double now = dt_now_ms();
  l->failures++;
  l->failed++;
  if (now - l->warned_ms >= WARN_EVERY_MS) {
    DT_WARN(RPC,
            "cannot accept connections: %s (%u failed attempts since the last warning); "
            "still listening, trying again every %d ms at most",
            strerror(err), l->failures, BACKOFF_MAX_MS);
    l->warned_ms = now;
    l->failures = 0;
  }
  l->backoff_ms = l->backoff_ms ? DT_MIN(2 * l->backoff_ms, BACKOFF_MAX_MS) : BACKOFF_MIN_MS;
  poll_all(l, 0); /* and starts the retry timer */
}

static void on_retry(uv_timer_t *t)
{
  dt_listener_t *l = t->data;
  if (!l->closing)
    poll_all(l, 1);
}

static void accept_from(dt_listener_t *l, int lfd)
{
  for (int k = 0; k < ACCEPTS_PER_WAKEUP && !l->closing; k++) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept4(lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      switch (errno) {
      case EINTR:
      case ECONNABORTED: /* the client gave up while queued; and accept(2)'s network errors */
      case EPROTO:
      case ENETDOWN:
      case ENOPROTOOPT:
      case EHOSTDOWN:
      case ENONET:
      case EHOSTUNREACH:
      case ENETUNREACH:
        continue;
      case EAGAIN:
        return;
      default: /* EMFILE, ENFILE, ENOBUFS, ENOMEM, or anything unforeseen: never spin on it */
        back_off(l, errno);
        return;
      }
    }
    if (l->failed) {
      DT_INFO(RPC, "accepting connections again (after %lu failed attempts)", l->failed);
      l->failed = 0;
      l->failures = 0;
    }
    l->backoff_ms = 0;
    tune(fd);
    char peer[64];
    format_peer(&ss, peer, sizeof peer);
    l->cb(fd, peer, l->ud);
  }
}

static void on_poll(uv_poll_t *h, int status, int events)
{
  dt_listener_t *l = h->data;
  (void)events;
  if (status < 0) {
    DT_WARN(RPC, "polling a listening socket failed: %s", uv_strerror(status));
    back_off(l, EIO);
    return;
  }
  accept_from(l, l->fds[h - l->polls]);
}

static void poll_all(dt_listener_t *l, int on)
{
  for (int i = 0; i < l->n; i++) {
    if (on)
      uv_poll_start(&l->polls[i], UV_READABLE, on_poll);
    else
      uv_poll_stop(&l->polls[i]);
  }
  if (!on)
    uv_timer_start(&l->retry, on_retry, l->backoff_ms, 0);
}

/* ------------------------------------------------------------------------------------------ */
/* Binding                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* "host:port", "[v6]:port" or ":port" (every address). */
static int split_hostport(const char *s, char *host, size_t hl, char *port, size_t pl)
{
  const char *colon = strrchr(s, ':');
  if (!colon || !colon[1] || strspn(colon + 1, "0123456789") != strlen(colon + 1))
    return DT_EINVAL;
  const char *h = s;
  size_t n = (size_t)(colon - s);
  if (n >= 2 && s[0] == '[' && s[n - 1] == ']')
    h++, n -= 2;
  if (n >= hl || strlen(colon + 1) >= pl)
    return DT_EINVAL;
  memcpy(host, h, n);
  host[n] = '\0';
  snprintf(port, pl, "%s", colon + 1);
  return 0;
}

static void set_port(struct sockaddr *sa, int port)
{
  if (sa->sa_family == AF_INET)
    ((struct sockaddr_in *)sa)->sin_port = htons((uint16_t)port);
  else
    ((struct sockaddr_in6 *)sa)->sin6_port = htons((uint16_t)port);
}

static int bound_port(int fd)
{
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0)
    return -1;
  return ntohs(ss.ss_family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port
                                       : ((struct sockaddr_in6 *)&ss)->sin6_port);
}

/* One listening socket; -errno on failure. v6only when the host also has IPv4 addresses, so
 * that "::" and "0.0.0.0" can both be bound; "[::]" alone stays dual-stack. */
static int listen_on(struct addrinfo *ai, int v6only)
{
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -errno;
  const int on = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  if (ai->ai_family == AF_INET6)
    (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only);
  if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
    int err = -errno;
    close(fd);
    return err;
  }
  return fd;
}

/* Binds and listens on up to max of the addresses hostport resolves to; *n gets how many. */
static int bind_all(const char *hostport, int *fds, int max, int *n, int *port)
{
  char host[256], service[16];
  *n = 0;
  if (split_hostport(hostport, host, sizeof host, service, sizeof service) != 0 ||
      dt_addr_port_out_of_range(hostport)) {
    DT_ERROR(RPC,
             "bad listen address '%s' (expected host:port, [ipv6]:port or :port, the port in "
             "0..65535)",
             hostport);
    return DT_EINVAL;
  }
  struct addrinfo hints = {.ai_flags = AI_PASSIVE | AI_NUMERICSERV, .ai_socktype = SOCK_STREAM};
  struct addrinfo *res = NULL;
  int gai = getaddrinfo(host[0] ? host : NULL, service, &hints, &res);
  if (gai != 0) {
    DT_ERROR(RPC, "cannot resolve listen address '%s': %s", hostport, gai_strerror(gai));
    return DT_EINVAL;
  }
  int has_v4 = 0, chosen = atoi(service), last_err = 0;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next)
    has_v4 |= ai->ai_family == AF_INET;
  for (struct addrinfo *ai = res; ai && *n < max; ai = ai->ai_next) {
    if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6)
      continue;
    if (chosen) /* port 0: every address gets the port the first one was given */
      set_port(ai->ai_addr, chosen);
    int fd = listen_on(ai, has_v4);
    if (fd < 0) {
      last_err = -fd;
      continue;
    }
    chosen = bound_port(fd);
    fds[(*n)++] = fd;
  }
  freeaddrinfo(res);
  if (*n == 0) {
    DT_ERROR(RPC, "cannot listen on %s: %s", hostport,
             last_err ? strerror(last_err) : "no IPv4 or IPv6 address");
    return DT_EUNAVAIL;
  }
  if (port)
    *port = chosen;
  return 0;
}

int dt_listener_bind(const char *hostport, int *fd, int *port)
{
  int n;
  return bind_all(hostport, fd, 1, &n, port);
}

int dt_listener_open(uv_loop_t *loop, const char *hostport, dt_listener_cb cb, void *ud,
                     dt_listener_t **out, int *port)
{
  dt_listener_t *l = calloc(1, sizeof *l);
  if (!l)
    return DT_ENOMEM;
  int rc = bind_all(hostport, l->fds, MAX_SOCKETS, &l->n, port);
  if (rc != 0) {
    free(l);
    return rc;
  }
  l->loop = loop;
  l->cb = cb;
  l->ud = ud;
  for (int i = 0; i < l->n; i++) {
    uv_poll_init_socket(loop, &l->polls[i], l->fds[i]);
    l->polls[i].data = l;
  }
  uv_timer_init(loop, &l->retry);
  l->retry.data = l;
  l->open_handles = l->n + 1;
  *out = l;
  return 0;
}

void dt_listener_start(dt_listener_t *l)
{
  poll_all(l, 1);
}

static void on_handle_closed(uv_handle_t *h)
{
  dt_listener_t *l = h->data;
  if (--l->open_handles == 0)
    free(l);
}

void dt_listener_close(dt_listener_t *l)
{
  l->closing = 1;
  for (int i = 0; i < l->n; i++) {
    uv_close((uv_handle_t *)&l->polls[i], on_handle_closed);
    close(l->fds[i]); /* the poll is stopped by uv_close: the fd may go now */
  }
  uv_close((uv_handle_t *)&l->retry, on_handle_closed);
}
