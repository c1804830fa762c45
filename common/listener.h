/* listener.h — TCP listening sockets on a libuv loop that keep accepting through errors.
 *
 * gRPC 1.51's own listener stops accepting for good after any accept error other than EAGAIN
 * or ECONNABORTED — EMFILE included — while the process lives on, so a coordinator that ran
 * out of file descriptors once answered nothing ever after and no supervisor restarted it.
 * The RPC server therefore owns its listening sockets: the loop accepts, and every accepted
 * connection goes to a callback (which hands it to gRPC).
 *
 * Invariants:
 * - Accept errors never stop the listener. On EMFILE, ENFILE, ENOBUFS or ENOMEM it stops
 *   polling, warns (at most once per 10 s, with a count), and polls again after a backoff
 *   (50 ms doubling to 1 s, reset by the next accepted connection); connections wait in the
 *   kernel's backlog meanwhile. Other errors are logged and skipped.
 * - Accepted sockets are non-blocking and close-on-exec, with TCP_NODELAY, and TCP keepalive
 *   plus TCP_USER_TIMEOUT so that a peer that vanished is noticed in about a minute.
 * - The listening sockets use SO_REUSEADDR (a restarted daemon rebinds at once) but not
 *   SO_REUSEPORT: a second daemon on the same port fails with "address in use". */
#ifndef DT_LISTENER_H
#define DT_LISTENER_H

#include <uv.h>

typedef struct dt_listener dt_listener_t;

/* A new connection: fd belongs to the callee from here. peer is "ipv4:1.2.3.4:5678" or
 * "ipv6:[::1]:5678" (gRPC's format), valid during the call. */
typedef void (*dt_listener_cb)(int fd, const char *peer, void *ud);

/* Binds and listens on "host:port" ("0.0.0.0:7470", "[::]:7470", "localhost:0"; port 0 picks a
 * free one, shared by every address the host resolves to) without accepting yet; *port gets
 * the bound port. DT_EINVAL for a malformed address, DT_EUNAVAIL when it cannot be bound. */
int dt_listener_open(uv_loop_t *loop, const char *hostport, dt_listener_cb cb, void *ud,
                     dt_listener_t **out, int *port);
/* One listening socket (non-blocking, close-on-exec) on the first address "host:port" resolves
 * to, for a server that accepts by itself (the coordinator's HTTP endpoint); *port gets the
 * bound port. The same errors as dt_listener_open. */
int dt_listener_bind(const char *hostport, int *fd, int *port);
/* Starts accepting on the loop. */
void dt_listener_start(dt_listener_t *l);
/* Closes the sockets; the listener frees itself once its handles are closed (the loop must
 * run). No callback runs after this returns. */
void dt_listener_close(dt_listener_t *l);

#endif
