/* fake_rpc_server.c — see fake_rpc_server.h. */
#include "fake_rpc_server.h"

#include <math.h>
#include <stdarg.h>
#include <string.h>

#include "dt_error.h"
#include "dt_util.h"
#include "fuzz.h"

typedef struct {
  dt_rpc_handler_t fn;
  void *ud;
} handler_t;

typedef struct {
  dt_rpc_call_t **v;
  size_t n, cap;
} calls_t;

struct dt_rpc_server {
  const ProtobufCServiceDescriptor *service;
  handler_t *handlers;
  calls_t held;     /* kept by their handlers, not answered */
  calls_t answered; /* freed by the next sweep */
};

struct dt_rpc_call {
  dt_rpc_server_t *server;
  unsigned method;
  int in_handler, replied, status;
  int gone;           /* its client went away (fake_rpc_cancel) */
  double deadline_ms; /* on dt_now_ms's clock; INFINITY: none */
  dt_rpc_cancel_cb cancel_cb;
  void *cancel_ud;
};

static dt_rpc_server_t *g_server;

static void push(calls_t *l, dt_rpc_call_t *c)
{
  if (l->n == l->cap) {
    l->cap = l->cap ? 2 * l->cap : 16;
    l->v = realloc(l->v, l->cap * sizeof *l->v);
    FUZZ_ASSERT(l->v, "out of memory");
  }
  l->v[l->n++] = c;
}

static dt_rpc_call_t *take(calls_t *l, size_t i)
{
  dt_rpc_call_t *c = l->v[i];
  memmove(l->v + i, l->v + i + 1, (l->n - i - 1) * sizeof *l->v);
  l->n--;
  return c;
}

dt_rpc_server_t *fake_rpc_server(void)
{
  return g_server;
}

int dt_rpc_server_create(uv_loop_t *loop, const char *listen, const char *token,
                         const ProtobufCServiceDescriptor *service, dt_rpc_server_t **out)
{
  (void)loop, (void)listen;
  FUZZ_ASSERT(token && *token, "a server without a bearer token");
  dt_rpc_server_t *s = calloc(1, sizeof *s);
  FUZZ_ASSERT(s && (s->handlers = calloc(service->n_methods, sizeof *s->handlers)),
              "out of memory");
  s->service = service;
  *out = g_server = s;
  return 0;
}

int dt_rpc_server_handle(dt_rpc_server_t *s, const char *method, dt_rpc_handler_t fn, void *ud)
{
  const ProtobufCMethodDescriptor *m =
      protobuf_c_service_descriptor_get_method_by_name(s->service, method);
  if (!m)
    return DT_EINVAL;
  s->handlers[m - s->service->methods] = (handler_t){fn, ud};
  return 0;
}

int dt_rpc_server_start(dt_rpc_server_t *s, int *port)
{
  (void)s;
  if (port)
    *port = 1;
  return 0;
}

void dt_rpc_server_on_listener_lost(dt_rpc_server_t *s, void (*cb)(void *ud), void *ud)
{
  (void)s, (void)cb, (void)ud;
}

/* Like gRPC's shutdown: every call still held is cancelled, then cb runs. */
void dt_rpc_server_close(dt_rpc_server_t *s, void (*cb)(void *ud), void *ud)
{
  while (s->held.n)
    fake_rpc_cancel(s, 0);
  fake_rpc_sweep(s);
  free(s->held.v);
  free(s->answered.v);
  free(s->handlers);
  if (g_server == s)
    g_server = NULL;
  free(s);
  if (cb)
    cb(ud);
}

/* The call is answered: from the held list (if it was kept) to the answered one. */
static void answered(dt_rpc_call_t *c, int status)
{
  dt_rpc_server_t *s = c->server;
  const char *name = s->service->methods[c->method].name;
  FUZZ_ASSERT(!c->gone, "an answer to a %s call from its cancel callback", name);
  FUZZ_ASSERT(!c->replied, "a second answer to a %s call", name);
  c->replied = 1;
  c->status = status;
  if (c->in_handler)
    return; /* fake_rpc_call files it */
  for (size_t i = 0; i < s->held.n; i++)
    if (s->held.v[i] == c) {
      push(&s->answered, take(&s->held, i));
      return;
    }
  FUZZ_ASSERT(0, "an answer to a call that is neither running nor held");
}

int dt_rpc_call_reply(dt_rpc_call_t *c, const ProtobufCMessage *resp)
{
  const ProtobufCMethodDescriptor *m = &c->server->service->methods[c->method];
  FUZZ_ASSERT(resp->descriptor == m->output, "%s answered with a %s, not a %s", m->name,
              resp->descriptor->name, m->output->name);
  FUZZ_ASSERT(protobuf_c_message_check(resp), "%s's answer is not a valid %s", m->name,
              m->output->name);
  char field[256];
  FUZZ_ASSERT(dt_pb_check_utf8(resp, field, sizeof field) == 0,
              "%s's answer holds a %s that is not UTF-8: other clients cannot decode it", m->name,
              field);
  const size_t len = protobuf_c_message_get_packed_size(resp);
  FUZZ_ASSERT(len <= DT_RPC_MAX_MESSAGE, "%s's answer is %zu bytes, over the limit", m->name, len);
  uint8_t *buf = malloc(len ? len : 1);
  FUZZ_ASSERT(buf, "out of memory");
  FUZZ_ASSERT(protobuf_c_message_pack(resp, buf) == len, "%s's answer packs short", m->name);
  ProtobufCMessage *back = protobuf_c_message_unpack(m->output, NULL, len, buf);
  FUZZ_ASSERT(back, "%s's answer does not decode", m->name);
  protobuf_c_message_free_unpacked(back, NULL);
  free(buf);
  answered(c, DT_RPC_OK);
  return 0;
}

int dt_rpc_call_fail(dt_rpc_call_t *c, int status, const char *fmt, ...)
{
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  const char *name = c->server->service->methods[c->method].name;
  FUZZ_ASSERT(status > DT_RPC_OK && status <= DT_RPC_UNAUTHENTICATED,
              "%s failed with status %d: %s", name, status, msg);
  FUZZ_ASSERT(msg[0], "%s failed (status %d) without a reason", name, status);
  answered(c, status);
  return 0;
}

void dt_rpc_call_on_cancel(dt_rpc_call_t *c, dt_rpc_cancel_cb cb, void *ud)
{
  c->cancel_cb = cb;
  c->cancel_ud = ud;
}

int64_t dt_rpc_call_remaining_ms(const dt_rpc_call_t *c)
{
  if (c->deadline_ms == INFINITY)
    return INT64_MAX;
  const double left = c->deadline_ms - dt_now_ms();
  return left > 0 ? (int64_t)left : 0;
}

const char *dt_rpc_call_peer(dt_rpc_call_t *c)
{
  (void)c;
  return "fuzz:0";
}

int fake_rpc_call(dt_rpc_server_t *s, unsigned method, const ProtobufCMessage *req,
                  int64_t deadline_ms)
{
  FUZZ_ASSERT(method < s->service->n_methods, "method %u", method);
  const handler_t *h = &s->handlers[method];
  if (!h->fn)
    return DT_RPC_UNIMPLEMENTED;
  char field[256];
  if (dt_pb_check_utf8(req, field, sizeof field) != 0)
    return DT_RPC_INVALID_ARGUMENT; /* refused before any handler, as rpc_server.c does */
  dt_rpc_call_t *c = calloc(1, sizeof *c);
  FUZZ_ASSERT(c, "out of memory");
  c->server = s;
  c->method = method;
  c->deadline_ms = deadline_ms > 0 ? dt_now_ms() + (double)deadline_ms : INFINITY;
  c->in_handler = 1;
  h->fn(c, req, h->ud);
  c->in_handler = 0;
  if (c->replied) {
    push(&s->answered, c);
    return c->status;
  }
  FUZZ_ASSERT(c->cancel_cb, "%s kept its call without a cancel callback",
              s->service->methods[method].name);
  push(&s->held, c);
  return -1;
}

size_t fake_rpc_held(const dt_rpc_server_t *s)
{
  return s->held.n;
}

void fake_rpc_cancel(dt_rpc_server_t *s, size_t i)
{
  dt_rpc_call_t *c = take(&s->held, i);
  dt_rpc_cancel_cb cb = c->cancel_cb;
  c->cancel_cb = NULL;
  c->gone = 1; /* freed after the callback: a later use is a use after free */
  if (cb)
    cb(c, c->cancel_ud);
  free(c);
}

void fake_rpc_sweep(dt_rpc_server_t *s)
{
  for (size_t i = 0; i < s->answered.n; i++)
    free(s->answered.v[i]);
  s->answered.n = 0;
}
