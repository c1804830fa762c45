/* rpc_server.c — the server half of rpc.h. Each call is a small state machine:
 *
 *   slot posted (grpc_server_request_registered_call) --NEW--> call live on the loop
 *   call live: a RECV_CLOSE_ON_SERVER batch is started at once (CLOSED completes when the call
 *   ends: after our status, or when the client cancels); the bearer token is checked, and
 *   only then is the request message read (RECV: an unauthenticated body is never buffered);
 *   then the handler runs, and a reply starts a SEND batch (SENT). The call is freed when it
 *   is closed and no receive or send is pending.
 *
 * Every tag handed to gRPC is a dt__rpc_tag_t naming its kind and object; the completion-queue
 * thread only forwards (tag, ok) pairs to the loop. */
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_posix.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/string_util.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"
#include "listener.h"
#include "rpc.h"
#include "rpc_grpc.h"

/* Requests kept posted per method, so bursts (thousands of heartbeats) never wait for the
 * loop to re-post one. */
DT_PARAM(RpcPendingPerMethod, "RPC_PENDING_PER_METHOD", 32)

typedef enum { TAG_NEW, TAG_NEW_UNKNOWN, TAG_RECV, TAG_CLOSED, TAG_SENT, TAG_SHUTDOWN } tag_kind_t;

typedef struct {
  tag_kind_t kind;
  void *obj;
} dt__rpc_tag_t;

typedef struct {
  const char *name; /* method name ("Heartbeat") */
  const ProtobufCMessageDescriptor *input;
  void *registered; /* grpc_server_register_method handle */
  dt_rpc_handler_t fn;
  void *ud;
} method_t;

struct dt_rpc_call {
  dt_rpc_server_t *server;
  method_t *method; /* NULL for an unknown method */
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload;
  grpc_call_details details; /* unknown methods only */
  dt__rpc_tag_t tag_new, tag_recv, tag_closed, tag_sent;
  int cancelled;
  int closed, recv_pending, send_pending, replied;
  dt_rpc_cancel_cb cancel_cb;
  void *cancel_ud;
  char *peer;
  /* storage that must outlive the send batch */
  grpc_byte_buffer *send_buf;
  grpc_slice status_details;
};

typedef struct {
  void *tag;
  int ok;
} event_t;

struct dt_rpc_server {
  uv_loop_t *loop;
  uv_async_t async;
  uv_thread_t thread;
  uv_mutex_t lock;
  event_t *events; /* queue filled by the cq thread, drained by the loop */
  size_t nevents, cap;
  grpc_server *server;
  grpc_server_credentials *creds;
  dt_listener_t *listener; /* accepts connections and hands them to server */
  char (*peers)[64];       /* the address of the connection last accepted on each fd */
  size_t npeers;
  grpc_completion_queue *cq;
  const ProtobufCServiceDescriptor *service;
  method_t *methods;
  char token[256];
  char bearer[300];
  int started, shutting_down;
  double auth_warned_ms; /* last warning about calls with a bad token; how many since */
  unsigned auth_rejected;
  dt__rpc_tag_t tag_shutdown;
  _Atomic int listener_lost; /* set by gRPC's log line (grpc_log), read on the loop */
  void (*lost_cb)(void *ud);
  void *lost_ud;
  void (*close_cb)(void *);
  void *close_ud;
};

/* The process's TLS server (NULL when plaintext or closed), told when gRPC's listener stops. */
static pthread_mutex_t g_tls_server_lock = PTHREAD_MUTEX_INITIALIZER;
static dt_rpc_server_t *g_tls_server;

/* From gRPC's log line (any thread): forwarded to the TLS server's loop
 * (dt_rpc_server_on_listener_lost). */
static void tls_accept_failed(void)
{
  pthread_mutex_lock(&g_tls_server_lock);
  if (g_tls_server) {
    g_tls_server->listener_lost = 1;
    uv_async_send(&g_tls_server->async);
  }
  pthread_mutex_unlock(&g_tls_server_lock);
}

/* ------------------------------------------------------------------------------------------ */
/* Completion-queue thread → loop                                                              */
/* ------------------------------------------------------------------------------------------ */

static void cq_thread(void *arg)
{
  dt_rpc_server_t *s = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN)
      return;
    if (ev.type != GRPC_OP_COMPLETE)
      continue;
    uv_mutex_lock(&s->lock);
    if (s->nevents == s->cap) {
      size_t cap = s->cap ? s->cap * 2 : 256;
      event_t *grown = realloc(s->events, cap * sizeof *grown);
      if (!grown) {
        /* Cannot queue: this is fatal for the daemon's RPC layer; say so loudly. */
        uv_mutex_unlock(&s->lock);
        DT_ERROR(RPC, "out of memory queueing a gRPC completion; dropping it");
        continue;
      }
      s->events = grown, s->cap = cap;
    }
    s->events[s->nevents++] = (event_t){ev.tag, ev.success};
    uv_mutex_unlock(&s->lock);
    uv_async_send(&s->async);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Calls                                                                                       */
/* ------------------------------------------------------------------------------------------ */

static void call_free(dt_rpc_call_t *c)
{
  if (c->call)
    grpc_call_unref(c->call);
  grpc_metadata_array_destroy(&c->md);
  if (c->payload)
    grpc_byte_buffer_destroy(c->payload);
  if (!c->method)
    grpc_call_details_destroy(&c->details);
  if (c->send_buf)
    grpc_byte_buffer_destroy(c->send_buf);
  grpc_slice_unref(c->status_details);
  if (c->peer)
    gpr_free(c->peer);
  free(c);
}

static int post_slot(dt_rpc_server_t *s, method_t *m)
{
  dt_rpc_call_t *c = calloc(1, sizeof *c);
  if (!c)
    return DT_ENOMEM;
  c->server = s;
  c->method = m;
  c->status_details = grpc_empty_slice();
  grpc_metadata_array_init(&c->md);
  c->tag_new = (dt__rpc_tag_t){m ? TAG_NEW : TAG_NEW_UNKNOWN, c};
  c->tag_recv = (dt__rpc_tag_t){TAG_RECV, c};
  c->tag_closed = (dt__rpc_tag_t){TAG_CLOSED, c};
  c->tag_sent = (dt__rpc_tag_t){TAG_SENT, c};
  grpc_call_error e;
  if (m) {
    /* No payload yet: the request message is read only once the token checks out. */
    e = grpc_server_request_registered_call(s->server, m->registered, &c->call, &c->deadline,
                                            &c->md, NULL, s->cq, s->cq, &c->tag_new);
  } else {
    grpc_call_details_init(&c->details);
    e = grpc_server_request_call(s->server, &c->call, &c->details, &c->md, s->cq, s->cq,
                                 &c->tag_new);
  }
  if (e != GRPC_CALL_OK) {
    DT_ERROR(RPC, "posting a call slot failed (grpc_call_error %d)", (int)e);
    c->call = NULL;
    call_free(c);
    return DT_ERPC;
  }
  return 0;
}

static void maybe_free(dt_rpc_call_t *c)
{
  if (c->closed && !c->recv_pending && !c->send_pending)
    call_free(c);
}

/* Starts the final batch: initial metadata, optional message, status. */
static int send_final(dt_rpc_call_t *c, grpc_byte_buffer *msg, int status, const char *details)
{
  if (c->replied) {
    DT_ERROR(RPC, "internal: second reply on one call");
    if (msg)
      grpc_byte_buffer_destroy(msg);
    return DT_EINTERNAL;
  }
  c->replied = 1;
  if (c->closed) { /* client already gone: nothing to send */
    if (msg)
      grpc_byte_buffer_destroy(msg);
    return DT_ECANCELED;
  }
  grpc_op ops[3];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (msg) {
    c->send_buf = msg;
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = msg;
  }
  c->status_details = grpc_slice_from_copied_string(details ? details : "");
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = (grpc_status_code)status;
  ops[n].data.send_status_from_server.status_details = &c->status_details;
  n++;
  grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->tag_sent, NULL);
  if (e != GRPC_CALL_OK) {
    DT_ERROR(RPC, "sending a reply failed (grpc_call_error %d)", (int)e);
    return DT_ERPC;
  }
  c->send_pending = 1;
  return 0;
}

int dt_rpc_call_reply(dt_rpc_call_t *c, const ProtobufCMessage *resp)
{
  size_t len = protobuf_c_message_get_packed_size(resp);
  grpc_slice slice = grpc_slice_malloc(len);
  protobuf_c_message_pack(resp, GRPC_SLICE_START_PTR(slice));
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&slice, 1);
  grpc_slice_unref(slice);
  return send_final(c, bb, DT_RPC_OK, NULL);
}

int dt_rpc_call_fail(dt_rpc_call_t *c, int status, const char *fmt, ...)
{
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return send_final(c, NULL, status, msg);
}

void dt_rpc_call_on_cancel(dt_rpc_call_t *c, dt_rpc_cancel_cb cb, void *ud)
{
  c->cancel_cb = cb;
  c->cancel_ud = ud;
}

int64_t dt_rpc_call_remaining_ms(const dt_rpc_call_t *c)
{
  gpr_timespec dl = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
  if (gpr_time_cmp(dl, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0)
    return INT64_MAX;
  gpr_timespec left = gpr_time_sub(dl, gpr_now(GPR_CLOCK_MONOTONIC));
  int64_t ms = (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
  return ms < 0 ? 0 : ms;
}

const char *dt_rpc_call_peer(dt_rpc_call_t *c)
{
  if (c->peer)
    return c->peer;
  c->peer = grpc_call_get_peer(c->call);
  /* A connection handed over as a descriptor is "fd:N" to gRPC; name its address instead. */
  const dt_rpc_server_t *s = c->server;
  int fd;
  if (c->peer && sscanf(c->peer, "fd:%d", &fd) == 1 && fd >= 0 && (size_t)fd < s->npeers &&
      s->peers[fd][0]) {
    gpr_free(c->peer);
    c->peer = gpr_strdup(s->peers[fd]);
  }
  return c->peer;
}

static int authorized(const dt_rpc_server_t *s, const grpc_metadata_array *md)
{
  for (size_t i = 0; i < md->count; i++) {
    if (grpc_slice_str_cmp(md->metadata[i].key, "authorization") == 0)
      return grpc_slice_str_cmp(md->metadata[i].value, s->bearer) == 0;
  }
  return 0;
}

/* A new call arrived: re-post its slot, watch for its end, check the token, dispatch. */
static void on_new_call(dt_rpc_server_t *s, dt_rpc_call_t *c, int ok)
{
  if (!ok || s->shutting_down) { /* the server is shutting down: the slot was never used */
    if (c->call) {
      grpc_call_unref(c->call);
      c->call = NULL;
    }
    call_free(c);
    return;
  }
  post_slot(s, c->method);
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &c->cancelled;
  if (grpc_call_start_batch(c->call, &op, 1, &c->tag_closed, NULL) != GRPC_CALL_OK) {
    DT_ERROR(RPC, "cannot watch a call's end; dropping it");
    c->closed = 1;
    call_free(c);
    return;
  }
  if (!c->method) {
    char *m = grpc_slice_to_c_string(c->details.method);
    DT_DEBUG(RPC, "unimplemented method %s from %s", m, dt_rpc_call_peer(c));
    dt_rpc_call_fail(c, DT_RPC_UNIMPLEMENTED, "method %s is not implemented", m);
    gpr_free(m);
    return;
  }
  if (!authorized(s, &c->md)) {
    /* One line per 10 s at most: a client with the wrong token retrying must not flood. */
    const double now = dt_now_ms();
    s->auth_rejected++;
    if (now - s->auth_warned_ms >= 10000.0) {
      DT_WARN(RPC,
              "%s: rejected %s call without a valid bearer token (%u such calls since the "
              "last report)",
              dt_rpc_call_peer(c), c->method->name, s->auth_rejected);
      s->auth_warned_ms = now;
      s->auth_rejected = 0;
    }
    dt_rpc_call_fail(c, DT_RPC_UNAUTHENTICATED, "missing or invalid bearer token");
    return;
  }
  /* Authorized: now read the request (an unauthorized one is never buffered). */
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &c->payload;
  if (grpc_call_start_batch(c->call, &op, 1, &c->tag_recv, NULL) != GRPC_CALL_OK) {
    dt_rpc_call_fail(c, DT_RPC_INTERNAL, "cannot read the request");
    return;
  }
  c->recv_pending = 1;
}

/* The request message of an authorized call arrived: decode it, run the handler. */
static void on_request(dt_rpc_call_t *c)
{
  if (!c->payload) {
    dt_rpc_call_fail(c, DT_RPC_INVALID_ARGUMENT, "no request message");
    return;
  }
  grpc_byte_buffer_reader reader;
  if (!grpc_byte_buffer_reader_init(&reader, c->payload)) {
    dt_rpc_call_fail(c, DT_RPC_INVALID_ARGUMENT, "unreadable request payload");
    return;
  }
  grpc_slice slice = grpc_byte_buffer_reader_readall(&reader);
  grpc_byte_buffer_reader_destroy(&reader);
  ProtobufCMessage *req = protobuf_c_message_unpack(
      c->method->input, NULL, GRPC_SLICE_LENGTH(slice), GRPC_SLICE_START_PTR(slice));
  grpc_slice_unref(slice);
  if (!req) {
    dt_rpc_call_fail(c, DT_RPC_INVALID_ARGUMENT, "malformed %s message", c->method->input->name);
    return;
  }
  char field[256];
  if (dt_pb_check_utf8(req, field, sizeof field) != 0) {
    dt_rpc_call_fail(c, DT_RPC_INVALID_ARGUMENT, "%s: %s is not UTF-8 (protobuf strings must be)",
                     c->method->name, field);
    protobuf_c_message_free_unpacked(req, NULL);
    return;
  }
  if (!c->method->fn) {
    dt_rpc_call_fail(c, DT_RPC_UNIMPLEMENTED, "method %s has no handler", c->method->name);
  } else {
    c->method->fn(c, req, c->method->ud);
  }
  protobuf_c_message_free_unpacked(req, NULL);
}

static void finish_shutdown(dt_rpc_server_t *s);

/* Handles one completion on the loop thread; returns 1 for the shutdown tag. */
static int dispatch(dt_rpc_server_t *s, const event_t *ev)
{
  dt__rpc_tag_t *tag = ev->tag;
  dt_rpc_call_t *c = tag->obj;
  switch (tag->kind) {
  case TAG_NEW:
  case TAG_NEW_UNKNOWN:
    on_new_call(s, c, ev->ok);
    break;
  case TAG_RECV:
    c->recv_pending = 0;
    if (ev->ok && !c->closed && !s->shutting_down)
      on_request(c);
    else
      maybe_free(c);
    break;
  case TAG_CLOSED:
    c->closed = 1;
    if (!c->replied && c->cancel_cb) {
      dt_rpc_cancel_cb cb = c->cancel_cb;
      c->cancel_cb = NULL;
      cb(c, c->cancel_ud);
    }
    maybe_free(c);
    break;
  case TAG_SENT:
    c->send_pending = 0;
    maybe_free(c);
    break;
  case TAG_SHUTDOWN:
    return 1;
  }
  return 0;
}

static void on_async(uv_async_t *h)
{
  dt_rpc_server_t *s = h->data;
  int shutdown = 0;
  for (;;) {
    event_t batch[256];
    uv_mutex_lock(&s->lock);
    size_t n = DT_MIN(s->nevents, DT_ARRAY_SIZE(batch));
    memcpy(batch, s->events, n * sizeof *batch);
    memmove(s->events, s->events + n, (s->nevents - n) * sizeof *batch);
    s->nevents -= n;
    uv_mutex_unlock(&s->lock);
    if (n == 0)
      break;
    for (size_t i = 0; i < n; i++)
      shutdown |= dispatch(s, &batch[i]);
  }
  if (s->listener_lost && !s->shutting_down) {
    s->listener_lost = 0;
    DT_ERROR(RPC, "gRPC's TLS listener has stopped accepting connections (see the error "
                  "above); nothing can reach this server any more");
    if (s->lost_cb)
      s->lost_cb(s->lost_ud);
  }
  if (shutdown)
    finish_shutdown(s); /* frees s */
}

void dt_rpc_server_on_listener_lost(dt_rpc_server_t *s, void (*cb)(void *ud), void *ud)
{
  s->lost_cb = cb;
  s->lost_ud = ud;
}

/* ------------------------------------------------------------------------------------------ */
/* Server lifecycle                                                                            */
/* ------------------------------------------------------------------------------------------ */

/* A connection from the listener: gRPC takes it over (and closes it when done). */
static void on_connection(int fd, const char *peer, void *ud)
{
  dt_rpc_server_t *s = ud;
  if ((size_t)fd >= s->npeers) {
    size_t n = DT_MAX((size_t)fd + 1, 2 * s->npeers);
    char(*grown)[64] = realloc(s->peers, n * sizeof *grown);
    if (grown) {
      memset(grown + s->npeers, 0, (n - s->npeers) * sizeof *grown);
      s->peers = grown, s->npeers = n;
    }
  }
  if ((size_t)fd < s->npeers)
    snprintf(s->peers[fd], sizeof *s->peers, "%s", peer);
  grpc_server_add_channel_from_fd(s->server, fd, s->creds);
}

static void server_free(dt_rpc_server_t *s)
{
  grpc_server_credentials_release(s->creds);
  free(s->peers);
  free(s->events);
  free(s->methods);
  free(s);
}

int dt_rpc_server_create(uv_loop_t *loop, const char *listen, const char *token,
                         const ProtobufCServiceDescriptor *service, dt_rpc_server_t **out)
{
  if (!token || !*token || strlen(token) >= sizeof((dt_rpc_server_t *)0)->token) {
    DT_ERROR(RPC, "a non-empty bearer token (< 256 bytes) is required");
    return DT_EINVAL;
  }
  dt__rpc_init(tls_accept_failed);
  dt_rpc_server_t *s = calloc(1, sizeof *s);
  if (!s)
    return DT_ENOMEM;
  s->loop = loop;
  s->service = service;
  snprintf(s->token, sizeof s->token, "%s", token);
  snprintf(s->bearer, sizeof s->bearer, "Bearer %s", token);
  if (dt__rpc_tls_config() != 0) {
    free(s);
    return DT_EINVAL;
  }
  s->methods = calloc(service->n_methods, sizeof *s->methods);
  s->creds = dt__rpc_server_creds();
  s->cq = grpc_completion_queue_create_for_next(NULL);
  s->server = grpc_server_create(dt__rpc_server_args(), NULL);
  if (!s->methods || !s->cq || !s->server) {
    server_free(s);
    return DT_ENOMEM;
  }
  grpc_server_register_completion_queue(s->server, s->cq, NULL);
  for (unsigned i = 0; i < service->n_methods; i++) {
    char path[256];
    snprintf(path, sizeof path, "/%s/%s", service->name, service->methods[i].name);
    s->methods[i].name = service->methods[i].name;
    s->methods[i].input = service->methods[i].input;
    s->methods[i].registered =
        grpc_server_register_method(s->server, path, NULL, GRPC_SRM_PAYLOAD_NONE, 0);
  }
  int port = 0, err = 0;
  if (dt_rpc_tls_server_enabled()) {
    /* gRPC's own listener: only it can put TLS on a connection. */
    port = dt_addr_port_out_of_range(listen)
               ? 0
               : grpc_server_add_http2_port(s->server, listen, s->creds);
    if (port <= 0) {
      DT_ERROR(RPC, "cannot listen on %s (TLS)", listen);
      err = DT_EUNAVAIL;
    }
  } else {
    err = dt_listener_open(loop, listen, on_connection, s, &s->listener, &port);
  }
  if (err) {
    grpc_server_destroy(s->server);
    grpc_completion_queue_shutdown(s->cq);
    grpc_completion_queue_destroy(s->cq);
    server_free(s);
    return err;
  }
  s->tag_shutdown = (dt__rpc_tag_t){TAG_SHUTDOWN, s};
  /* the bound port is remembered in started until start() reports it */
  s->started = -port;
  *out = s;
  return 0;
}

int dt_rpc_server_handle(dt_rpc_server_t *s, const char *method, dt_rpc_handler_t fn, void *ud)
{
  for (unsigned i = 0; i < s->service->n_methods; i++) {
    if (strcmp(s->methods[i].name, method) == 0) {
      s->methods[i].fn = fn;
      s->methods[i].ud = ud;
      return 0;
    }
  }
  DT_ERROR(RPC, "service %s has no method %s", s->service->name, method);
  return DT_EINVAL;
}

int dt_rpc_server_start(dt_rpc_server_t *s, int *port)
{
  int bound = -s->started;
  uv_mutex_init(&s->lock);
  uv_async_init(s->loop, &s->async, on_async);
  s->async.data = s;
  grpc_server_start(s->server);
  const int pending = (int)DT_MAX(1, dt_param_RpcPendingPerMethod());
  for (unsigned i = 0; i < s->service->n_methods; i++)
    for (int k = 0; k < pending; k++)
      DT_CHECK(post_slot(s, &s->methods[i]));
  for (int k = 0; k < 4; k++)
    DT_CHECK(post_slot(s, NULL));
  if (uv_thread_create(&s->thread, cq_thread, s) != 0)
    return DT_ESYS;
  s->started = 1;
  if (s->listener) {
    dt_listener_start(s->listener);
  } else {
    pthread_mutex_lock(&g_tls_server_lock);
    g_tls_server = s;
    pthread_mutex_unlock(&g_tls_server_lock);
  }
  if (port)
    *port = bound;
  return 0;
}

static void on_async_closed(uv_handle_t *h)
{
  dt_rpc_server_t *s = h->data;
  void (*cb)(void *) = s->close_cb;
  void *ud = s->close_ud;
  uv_mutex_destroy(&s->lock);
  server_free(s);
  if (cb)
    cb(ud);
}

static void finish_shutdown(dt_rpc_server_t *s)
{
  /* Every call has been cancelled and every posted slot returned before the shutdown tag;
   * stop the queue, join its thread, and handle whatever completions raced with the tag. */
  grpc_server_destroy(s->server);
  grpc_completion_queue_shutdown(s->cq);
  uv_thread_join(&s->thread);
  for (size_t i = 0; i < s->nevents; i++)
    dispatch(s, &s->events[i]);
  s->nevents = 0;
  grpc_completion_queue_destroy(s->cq);
  uv_close((uv_handle_t *)&s->async, on_async_closed);
}

void dt_rpc_server_close(dt_rpc_server_t *s, void (*cb)(void *ud), void *ud)
{
  s->close_cb = cb;
  s->close_ud = ud;
  if (s->listener)
    dt_listener_close(s->listener); /* no new connections; gRPC's shutdown ends the others */
  if (s->started != 1) {            /* created but never started */
    grpc_server_destroy(s->server);
    grpc_completion_queue_shutdown(s->cq);
    grpc_completion_queue_destroy(s->cq);
    server_free(s);
    if (cb)
      cb(ud);
    return;
  }
  s->shutting_down = 1;
  pthread_mutex_lock(&g_tls_server_lock);
  if (g_tls_server == s)
    g_tls_server = NULL;
  pthread_mutex_unlock(&g_tls_server_lock);
  grpc_server_shutdown_and_notify(s->server, s->cq, &s->tag_shutdown);
  grpc_server_cancel_all_calls(s->server);
}
