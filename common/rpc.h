/* rpc.h — gRPC C core glue: protobuf-c messages over unary gRPC calls.
 *
 * Server (daemons): one libuv loop thread owns all state. A helper thread blocks in
 * grpc_completion_queue_next and hands every completion to the loop through uv_async, so
 * handlers run on the loop thread and never need locks. A handler may reply at once or keep
 * the call and reply later (long-poll, blocking key-value get); if the client goes away first
 * (deadline, cancel, shutdown) the call's cancel callback runs and the call must be forgotten.
 * Every call is checked for "authorization: Bearer <token>" before its handler sees it; calls
 * to methods nobody registered are answered UNIMPLEMENTED at once. The server accepts
 * connections itself (listener.h) and hands them to gRPC, whose own listener would stop for
 * good after running out of file descriptors; connections idle for DISTRAIN_RPC_IDLE_MS are
 * closed.
 *
 * Client (agents, distrainctl, trainers): blocking unary calls with a deadline, safe from any
 * thread, each on its own pluck completion queue. gRPC status codes map to DT_E* codes and
 * the status message is returned in err. */
#ifndef DT_RPC_H
#define DT_RPC_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

/* gRPC status codes used by distrain (values are gRPC's). */
enum {
  DT_RPC_OK = 0,
  DT_RPC_CANCELLED = 1,
  DT_RPC_INVALID_ARGUMENT = 3,
  DT_RPC_DEADLINE_EXCEEDED = 4,
  DT_RPC_NOT_FOUND = 5,
  DT_RPC_ALREADY_EXISTS = 6,
  DT_RPC_RESOURCE_EXHAUSTED = 8,
  DT_RPC_FAILED_PRECONDITION = 9,
  DT_RPC_UNIMPLEMENTED = 12,
  DT_RPC_INTERNAL = 13,
  DT_RPC_UNAVAILABLE = 14,
  DT_RPC_UNAUTHENTICATED = 16,
};

/* Largest message either side accepts (job lists and metrics can exceed gRPC's 4 MiB). */
#define DT_RPC_MAX_MESSAGE (64 << 20)

/* ------------------------------------------------------------------------------------------ */
/* Server                                                                                      */
/* ------------------------------------------------------------------------------------------ */

typedef struct dt_rpc_server dt_rpc_server_t;
typedef struct dt_rpc_call dt_rpc_call_t;

/* Runs on the loop thread. req is freed when the handler returns: copy what you keep. */
typedef void (*dt_rpc_handler_t)(dt_rpc_call_t *call, const ProtobufCMessage *req, void *ud);
/* The client is gone; the call pointer is invalid after this returns. */
typedef void (*dt_rpc_cancel_cb)(dt_rpc_call_t *call, void *ud);

/* listen is "host:port" (port 0 picks a free one). token must be non-empty. */
int dt_rpc_server_create(uv_loop_t *loop, const char *listen, const char *token,
                         const ProtobufCServiceDescriptor *service, dt_rpc_server_t **out);
/* Registers the handler of one method of the service, by name ("Heartbeat"). */
int dt_rpc_server_handle(dt_rpc_server_t *s, const char *method, dt_rpc_handler_t fn, void *ud);
/* Starts serving; *port receives the bound port. */
int dt_rpc_server_start(dt_rpc_server_t *s, int *port);
/* Under TLS, gRPC's own listener accepts (see "TLS" below), and it stops for good after an
 * accept error such as EMFILE while the process lives on. cb then runs on the loop: a daemon
 * should exit non-zero so that its supervisor restarts it (the coordinator exits 75). Never
 * called for a plaintext server, whose listener recovers by itself (listener.h). */
void dt_rpc_server_on_listener_lost(dt_rpc_server_t *s, void (*cb)(void *ud), void *ud);
/* Cancels every call (their cancel callbacks run), stops, frees; cb runs when done. */
void dt_rpc_server_close(dt_rpc_server_t *s, void (*cb)(void *ud), void *ud);

/* Replies with a message and OK. Returns 0 or DT_E*; the call is finished either way. */
int dt_rpc_call_reply(dt_rpc_call_t *call, const ProtobufCMessage *resp);
/* Replies with an error status and a message. */
int dt_rpc_call_fail(dt_rpc_call_t *call, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* For calls kept past the handler: called if the client goes away before the reply. */
void dt_rpc_call_on_cancel(dt_rpc_call_t *call, dt_rpc_cancel_cb cb, void *ud);
/* Milliseconds until the client's deadline (INT64_MAX when it set none). */
int64_t dt_rpc_call_remaining_ms(const dt_rpc_call_t *call);
/* The client's address ("ipv4:127.0.0.1:5312"), for logs. Freed with the call. */
const char *dt_rpc_call_peer(dt_rpc_call_t *call);

/* ------------------------------------------------------------------------------------------ */
/* Client                                                                                      */
/* ------------------------------------------------------------------------------------------ */

typedef struct dt_rpc_client dt_rpc_client_t;

#define DT_RPC_WAIT_FOR_READY 1 /* queue the call while the server is unreachable */

int dt_rpc_client_create(const char *target, const char *token,
                         const ProtobufCServiceDescriptor *service, dt_rpc_client_t **out);
void dt_rpc_client_destroy(dt_rpc_client_t *c);
/* Cancels every call in flight (from any thread) and makes later calls fail at once with
 * DT_ECANCELED: how a daemon's shutdown unblocks its long-polls. */
void dt_rpc_client_cancel_all(dt_rpc_client_t *c);
/* Blocking unary call of method (by name). On success *resp holds the unpacked answer (free
 * with protobuf_c_message_free_unpacked(*resp, NULL)). Errors: DT_EUNAVAIL (no server),
 * DT_ETIMEDOUT (deadline), DT_EAUTH, DT_EINVAL, DT_ENOENT, DT_ESTALE (failed precondition),
 * DT_ENOTSUP (unimplemented), DT_EBUSY (resource exhausted), DT_ERPC (other); err gets the
 * status message. */
int dt_rpc_client_call(dt_rpc_client_t *c, const char *method, const ProtobufCMessage *req,
                       ProtobufCMessage **resp, int timeout_ms, int flags, char *err,
                       size_t errlen);
/* Maps a gRPC status code to a DT_E* code (0 for OK). */
int dt_rpc_status_to_err(int status);
/* A deep copy of a message through its wire encoding, owned as an unpacked one (free with
 * protobuf_c_message_free_unpacked); NULL when out of memory. For keeping what a call's request
 * holds past the handler. */
void *dt_pb_copy(const ProtobufCMessage *m);
/* Whether every string of m, in nested and repeated messages too, is UTF-8 (dt_utf8_valid), as
 * protobuf requires (protobuf-c does not check; the official libraries refuse to decode a
 * message holding one that is not): 0, or DT_EINVAL with the first such field's full name in
 * field ("distrain.v1.NodeInfo.hostname"). The server refuses such a request
 * (INVALID_ARGUMENT): whatever it stored of one would reach every client in its answers. */
int dt_pb_check_utf8(const ProtobufCMessage *m, char *field, size_t len);
/* Makes every string of m UTF-8 in place (dt_utf8_sanitize): for messages read back from
 * storage that an older version wrote before it checked. m must be an unpacked (writable)
 * one. */
void dt_pb_sanitize_utf8(ProtobufCMessage *m);

/* ------------------------------------------------------------------------------------------ */
/* TLS                                                                                         */
/* ------------------------------------------------------------------------------------------ */

/* Transport security is process-wide, like the program's identity: every server and client
 * of the process reads it once, at its first creation, from DISTRAIN_TLS_CERT,
 * DISTRAIN_TLS_KEY and DISTRAIN_TLS_CA (PEM files) and DISTRAIN_TLS_SERVER_NAME. The programs'
 * --tls-cert/--tls-key/--tls-ca flags set those variables (to absolute paths) before any RPC
 * object exists, so the processes they start — an agent's trainers, `run --local`'s daemons —
 * inherit them. The bearer token is checked under TLS as without it.
 *  - Server: cert+key serve TLS; with ca too, a client must present a certificate signed by
 *    ca (mutual TLS) or its handshake fails. Neither: plaintext. Under TLS gRPC accepts the
 *    connections itself (it takes a ready descriptor only for plaintext), so listener.h's
 *    recovery from running out of descriptors does not apply; see dt_rpc_server_create.
 *  - Client: any of the three makes it TLS. ca verifies the server's certificate (the system's
 *    roots otherwise) against the target's host name, or DISTRAIN_TLS_SERVER_NAME when set
 *    (a certificate naming "coordinator.example" reached as 10.0.0.5); cert+key are presented
 *    to a server that asks for them.
 * Errors (a missing or unreadable file, a key without its certificate) fail the creation of
 * the first server or client with DT_EINVAL and a message naming the file. */
enum { DT_RPC_OPT_TLS_CERT = 0x7400, DT_RPC_OPT_TLS_KEY, DT_RPC_OPT_TLS_CA };
/* The getopt_long entries of the three flags, to put in a program's option table. */
#define DT_RPC_TLS_OPTIONS                                                                         \
  {"tls-cert", required_argument, 0, DT_RPC_OPT_TLS_CERT},                                         \
      {"tls-key", required_argument, 0, DT_RPC_OPT_TLS_KEY},                                       \
  {                                                                                                \
    "tls-ca", required_argument, 0, DT_RPC_OPT_TLS_CA                                              \
  }
#define DT_RPC_TLS_USAGE "[--tls-cert PEM --tls-key PEM] [--tls-ca PEM]"
/* Handles one of them (opt is its DT_RPC_OPT_TLS_* value): sets the variable to the file's
 * absolute path. Prints "prog: ..." and returns DT_EINVAL when the file does not exist. */
int dt_rpc_tls_option(const char *prog, int opt, const char *path);
/* Whether this process's servers serve TLS (cert and key configured); loads the configuration
 * (0 when it is invalid). */
int dt_rpc_tls_server_enabled(void);

/* Reads a bearer token from a file (first line, trimmed); errors name the file. */
int dt_rpc_read_token(const char *path, char *token, size_t len);
/* Creates a file holding a fresh random token (mode 0600). */
int dt_rpc_write_new_token(const char *path, char *token, size_t len);

#endif
