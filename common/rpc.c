/* rpc.c — see rpc.h: gRPC's set-up and log, TLS configuration, the client, tokens. The server
 * is rpc_server.c. */
#include "rpc.h"

#include <errno.h>
#include <fcntl.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/log.h>
#include <grpc/support/string_util.h>
#include <grpc/support/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"
#include "rpc_grpc.h"

/* Client reconnect backoff. gRPC's defaults (1 s, growing x1.6 up to 120 s) would leave an
 * agent silent for many heartbeat periods after a coordinator restart, and the restarted
 * coordinator would declare its node dead although its trainers never stopped. */
DT_PARAM(RpcReconnectInitialMs, "RPC_RECONNECT_INITIAL_MS", 100)
DT_PARAM(RpcReconnectMaxMs, "RPC_RECONNECT_MAX_MS", 1000)
/* A server connection with no call for this long is closed (GOAWAY; clients reconnect on
 * their next call). Agents and trainers call every second, so this only reaps connections
 * that were opened and abandoned — or never finished their HTTP/2 preface. */
DT_PARAM(RpcIdleMs, "RPC_IDLE_MS", 60000)

/* The process's hook for gRPC's listener failing (rpc_server.c sets it). */
static void (*_Atomic g_accept_failed)(void);

/* gRPC's log lines (errors only, unless GRPC_VERBOSITY asks for more) go through ours: our
 * tag, levels and journald priorities. One of them is the only sign that gRPC's listener has
 * stopped accepting for good (gRPC 1.51 tcp_server_posix.cc, on EMFILE and any error other
 * than EAGAIN/ECONNABORTED): it matters only to a TLS server, which uses that listener, and
 * is forwarded to it (dt_rpc_server_on_listener_lost). */
static void grpc_log(gpr_log_func_args *a)
{
  const char *file = strrchr(a->file, '/');
  dt_log_write(a->severity == GPR_LOG_SEVERITY_ERROR  ? DT_LOG_ERROR
               : a->severity == GPR_LOG_SEVERITY_INFO ? DT_LOG_INFO
                                                      : DT_LOG_DEBUG,
               DT_SUBSYS_RPC, file ? file + 1 : a->file, a->line, "grpc: %s", a->message);
  void (*fn)(void) = g_accept_failed;
  if (fn && strncmp(a->message, "Failed accept", 13) == 0)
    fn();
}

void dt__rpc_init(void (*accept_failed)(void))
{
  /* grpc_init is reference counted; we never call grpc_shutdown while the process lives
   * because gRPC's background threads may still be draining. */
  static _Atomic int done;
  if (accept_failed)
    g_accept_failed = accept_failed;
  if (!done) {
    gpr_set_log_function(grpc_log);
    grpc_init();
    done = 1;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* TLS configuration (rpc.h)                                                                   */
/* ------------------------------------------------------------------------------------------ */

static const char *const tls_vars[] = {"DISTRAIN_TLS_CERT", "DISTRAIN_TLS_KEY", "DISTRAIN_TLS_CA"};

static struct {
  uv_once_t once;
  int err;               /* 0, or DT_EINVAL: the configuration is unusable */
  char *pem[3];          /* cert, key, ca (NULL: not configured) */
  char server_name[256]; /* DISTRAIN_TLS_SERVER_NAME, or "" */
} g_tls = {.once = UV_ONCE_INIT};

int dt_rpc_tls_option(const char *prog, int opt, const char *path)
{
  char abs[4096];
  if (opt < DT_RPC_OPT_TLS_CERT || opt > DT_RPC_OPT_TLS_CA)
    return DT_EINVAL;
  if (!realpath(path, abs)) {
    fprintf(stderr, "%s: --%s %s: %s\n", prog,
            opt == DT_RPC_OPT_TLS_CERT  ? "tls-cert"
            : opt == DT_RPC_OPT_TLS_KEY ? "tls-key"
                                        : "tls-ca",
            path, strerror(errno));
    return DT_EINVAL;
  }
  setenv(tls_vars[opt - DT_RPC_OPT_TLS_CERT], abs, 1);
  return 0;
}

/* Reads a whole PEM file (NUL-terminated); NULL and an error naming it on failure. */
static char *read_pem(const char *var, const char *path)
{
  char *buf = NULL;
  FILE *f = fopen(path, "rb");
  long n = -1;
  if (f && fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && n < (1 << 20) &&
      fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1)) &&
      fread(buf, 1, (size_t)n, f) == (size_t)n) {
    buf[n] = 0;
    if (strstr(buf, "-----BEGIN ")) {
      fclose(f);
      return buf;
    }
    DT_ERROR(RPC, "%s=%s is not a PEM file", var, path);
  } else {
    DT_ERROR(RPC, "%s=%s: %s", var, path, n >= (1 << 20) ? "too large" : strerror(errno));
  }
  free(buf);
  if (f)
    fclose(f);
  return NULL;
}

static void tls_load(void)
{
  for (int i = 0; i < 3; i++) {
    const char *path = getenv(tls_vars[i]);
    if (path && *path && !(g_tls.pem[i] = read_pem(tls_vars[i], path)))
      g_tls.err = DT_EINVAL;
  }
  if (!g_tls.pem[0] != !g_tls.pem[1] && !g_tls.err) {
    DT_ERROR(RPC, "TLS needs both a certificate and its key (--tls-cert and --tls-key; "
                  "DISTRAIN_TLS_CERT and DISTRAIN_TLS_KEY)");
    g_tls.err = DT_EINVAL;
  }
  const char *name = getenv("DISTRAIN_TLS_SERVER_NAME");
  snprintf(g_tls.server_name, sizeof g_tls.server_name, "%s", name ? name : "");
}

int dt__rpc_tls_config(void)
{
  uv_once(&g_tls.once, tls_load);
  return g_tls.err;
}

int dt_rpc_tls_server_enabled(void)
{
  return dt__rpc_tls_config() == 0 && g_tls.pem[0] && g_tls.pem[1];
}

/* The server's credentials: TLS (mutual with a CA) when configured, plaintext otherwise. */
grpc_server_credentials *dt__rpc_server_creds(void)
{
  if (!dt_rpc_tls_server_enabled())
    return grpc_insecure_server_credentials_create();
  grpc_ssl_pem_key_cert_pair pair = {.private_key = g_tls.pem[1], .cert_chain = g_tls.pem[0]};
  return grpc_ssl_server_credentials_create_ex(
      g_tls.pem[2], &pair, 1,
      g_tls.pem[2] ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
      NULL);
}

/* A client's credentials: TLS when any of the three files is configured. */
static grpc_channel_credentials *client_creds(void)
{
  if (!g_tls.pem[0] && !g_tls.pem[1] && !g_tls.pem[2])
    return grpc_insecure_credentials_create();
  grpc_ssl_pem_key_cert_pair pair = {.private_key = g_tls.pem[1], .cert_chain = g_tls.pem[0]};
  return grpc_ssl_credentials_create(g_tls.pem[2], g_tls.pem[0] ? &pair : NULL, NULL, NULL);
}

static grpc_channel_args *message_size_args(void)
{
  static grpc_arg args[2];
  static grpc_channel_args ca = {2, args};
  args[0].type = GRPC_ARG_INTEGER;
  args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  args[0].value.integer = DT_RPC_MAX_MESSAGE;
  args[1].type = GRPC_ARG_INTEGER;
  args[1].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
  args[1].value.integer = DT_RPC_MAX_MESSAGE;
  return &ca;
}

/* The server: the message sizes, and no BDP probing, so a stream's receive window stays at
 * HTTP/2's initial 64 KiB until a message is read. A request is read only once its token
 * checks out, so an unauthenticated body stalls in the sender after 64 KiB instead of growing
 * the window (and the coordinator's memory) to take it all. Requests are small; the large
 * messages are replies, whose window is the client's. Idle connections are closed. */
grpc_channel_args *dt__rpc_server_args(void)
{
  static grpc_arg args[4];
  static grpc_channel_args ca = {4, args};
  args[0] = message_size_args()->args[0];
  args[1] = message_size_args()->args[1];
  args[2].type = GRPC_ARG_INTEGER;
  args[2].key = (char *)GRPC_ARG_HTTP2_BDP_PROBE;
  args[2].value.integer = 0;
  args[3].type = GRPC_ARG_INTEGER;
  args[3].key = (char *)GRPC_ARG_MAX_CONNECTION_IDLE_MS;
  args[3].value.integer = (int)DT_MIN(DT_MAX(dt_param_RpcIdleMs(), 100), INT32_MAX);
  return &ca;
}

/* Client channels: the message sizes, a reconnect backoff bounded by a second, and the name
 * TLS checks the server's certificate against when DISTRAIN_TLS_SERVER_NAME sets one. */
static grpc_channel_args *client_args(void)
{
  static grpc_arg args[5];
  static grpc_channel_args ca = {4, args};
  args[0] = message_size_args()->args[0];
  args[1] = message_size_args()->args[1];
  args[2].type = GRPC_ARG_INTEGER;
  args[2].key = (char *)GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS;
  args[2].value.integer = (int)DT_MAX(10, dt_param_RpcReconnectInitialMs());
  args[3].type = GRPC_ARG_INTEGER;
  args[3].key = (char *)GRPC_ARG_MAX_RECONNECT_BACKOFF_MS;
  args[3].value.integer =
      (int)DT_MAX(args[2].value.integer, DT_MIN(dt_param_RpcReconnectMaxMs(), 120000));
  if (g_tls.server_name[0]) {
    args[4].type = GRPC_ARG_STRING;
    args[4].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
    args[4].value.string = g_tls.server_name;
    ca.num_args = 5;
  }
  return &ca;
}

/* ------------------------------------------------------------------------------------------ */
/* Client                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* Calls in flight, so that dt_rpc_client_cancel_all can reach them from another thread. */
typedef struct inflight {
  struct inflight *next;
  grpc_call *call;
} inflight_t;

struct dt_rpc_client {
  grpc_channel *channel;
  const ProtobufCServiceDescriptor *service;
  char bearer[300];
  char target[256];
  uv_mutex_t lock;
  inflight_t *inflight;
  int cancelled; /* set by cancel_all: later calls fail at once */
};

int dt_rpc_client_create(const char *target, const char *token,
                         const ProtobufCServiceDescriptor *service, dt_rpc_client_t **out)
{
  dt__rpc_init(NULL);
  if (dt_addr_port_out_of_range(target)) {
    DT_ERROR(RPC, "bad address '%s': the port must be in 1..65535", target);
    return DT_EINVAL;
  }
  if (dt__rpc_tls_config() != 0)
    return DT_EINVAL;
  dt_rpc_client_t *c = calloc(1, sizeof *c);
  if (!c)
    return DT_ENOMEM;
  snprintf(c->bearer, sizeof c->bearer, "Bearer %s", token ? token : "");
  snprintf(c->target, sizeof c->target, "%s", target);
  c->service = service;
  uv_mutex_init(&c->lock);
  grpc_channel_credentials *creds = client_creds();
  c->channel = grpc_channel_create(target, creds, client_args());
  grpc_channel_credentials_release(creds);
  if (!c->channel) {
    free(c);
    return DT_ERPC;
  }
  *out = c;
  return 0;
}

void dt_rpc_client_destroy(dt_rpc_client_t *c)
{
  if (!c)
    return;
  grpc_channel_destroy(c->channel);
  uv_mutex_destroy(&c->lock);
  free(c);
}

void dt_rpc_client_cancel_all(dt_rpc_client_t *c)
{
  uv_mutex_lock(&c->lock);
  c->cancelled = 1;
  for (inflight_t *f = c->inflight; f; f = f->next)
    grpc_call_cancel(f->call, NULL);
  uv_mutex_unlock(&c->lock);
}

void *dt_pb_copy(const ProtobufCMessage *m)
{
  const size_t len = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(len ? len : 1);
  if (!buf)
    return NULL;
  protobuf_c_message_pack(m, buf);
  void *copy = protobuf_c_message_unpack(m->descriptor, NULL, len, buf);
  free(buf);
  return copy;
}

/* Walks every string of m (nested and repeated messages too): the first that is not UTF-8
 * names its field and fails, or, with fix, each is made UTF-8 in place. */
static int pb_utf8(const ProtobufCMessage *m, int fix, char *field, size_t len)
{
  const ProtobufCMessageDescriptor *d = m->descriptor;
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    if (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE)
      continue;
    const char *member = (const char *)m + f->offset;
    void *const *values = (void *const *)member; /* one, or the repeated array */
    size_t n = 1;
    if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      n = *(const size_t *)((const char *)m + f->quantifier_offset);
      values = *(void *const *const *)member;
    } else if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
               *(const uint32_t *)((const char *)m + f->quantifier_offset) != f->id) {
      continue;
    }
    for (size_t k = 0; k < n; k++) {
      if (!values[k])
        continue;
      if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
        if (pb_utf8(values[k], fix, field, len) != 0)
          return DT_EINVAL;
      } else if (!dt_utf8_valid(values[k], strlen(values[k]))) {
        if (fix) {
          dt_utf8_sanitize(values[k]);
          continue;
        }
        snprintf(field, len, "%s.%s", d->name, f->name);
        return DT_EINVAL;
      }
    }
  }
  return 0;
}

int dt_pb_check_utf8(const ProtobufCMessage *m, char *field, size_t len)
{
  return pb_utf8(m, 0, field, len);
}

void dt_pb_sanitize_utf8(ProtobufCMessage *m)
{
  pb_utf8(m, 1, NULL, 0);
}

int dt_rpc_status_to_err(int status)
{
  switch (status) {
  case DT_RPC_OK:
    return 0;
  case DT_RPC_UNAVAILABLE:
    return DT_EUNAVAIL;
  case DT_RPC_DEADLINE_EXCEEDED:
    return DT_ETIMEDOUT;
  case DT_RPC_UNAUTHENTICATED:
    return DT_EAUTH;
  case DT_RPC_INVALID_ARGUMENT:
    return DT_EINVAL;
  case DT_RPC_NOT_FOUND:
    return DT_ENOENT;
  case DT_RPC_ALREADY_EXISTS:
    return DT_EEXIST;
  case DT_RPC_FAILED_PRECONDITION:
    return DT_ESTALE;
  case DT_RPC_UNIMPLEMENTED:
    return DT_ENOTSUP;
  case DT_RPC_CANCELLED:
    return DT_ECANCELED;
  case DT_RPC_RESOURCE_EXHAUSTED:
    return DT_EBUSY;
  default:
    return DT_ERPC;
  }
}

int dt_rpc_client_call(dt_rpc_client_t *c, const char *method, const ProtobufCMessage *req,
                       ProtobufCMessage **resp, int timeout_ms, int flags, char *err, size_t errlen)
{
  const ProtobufCMethodDescriptor *md =
      protobuf_c_service_descriptor_get_method_by_name(c->service, method);
  char path[256];
  int ret = 0;
  if (err && errlen)
    err[0] = '\0';
  *resp = NULL;
  if (!md) {
    snprintf(path, sizeof path, "/%s/%s", c->service->name, method);
  } else {
    snprintf(path, sizeof path, "/%s/%s", c->service->name, md->name);
  }

  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  gpr_timespec deadline = timeout_ms > 0
                              ? gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                             gpr_time_from_millis(timeout_ms, GPR_TIMESPAN))
                              : gpr_inf_future(GPR_CLOCK_MONOTONIC);
  grpc_slice method_slice = grpc_slice_from_copied_string(path);
  grpc_call *call = grpc_channel_create_call(c->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                             method_slice, NULL, deadline, NULL);
  grpc_slice_unref(method_slice);

  size_t len = protobuf_c_message_get_packed_size(req);
  grpc_slice payload = grpc_slice_malloc(len);
  protobuf_c_message_pack(req, GRPC_SLICE_START_PTR(payload));
  grpc_byte_buffer *send_bb = grpc_raw_byte_buffer_create(&payload, 1);
  grpc_slice_unref(payload);

  grpc_metadata auth;
  memset(&auth, 0, sizeof auth);
  auth.key = grpc_slice_from_static_string("authorization");
  auth.value = grpc_slice_from_copied_string(c->bearer);

  grpc_metadata_array recv_md, trailing_md;
  grpc_metadata_array_init(&recv_md);
  grpc_metadata_array_init(&trailing_md);
  grpc_byte_buffer *recv_bb = NULL;
  grpc_status_code status = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();

  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[0].data.send_initial_metadata.count = 1;
  ops[0].data.send_initial_metadata.metadata = &auth;
  if (flags & DT_RPC_WAIT_FOR_READY)
    ops[0].flags =
        GRPC_INITIAL_METADATA_WAIT_FOR_READY | GRPC_INITIAL_METADATA_WAIT_FOR_READY_EXPLICITLY_SET;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = send_bb;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &recv_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &recv_bb;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &trailing_md;
  ops[5].data.recv_status_on_client.status = &status;
  ops[5].data.recv_status_on_client.status_details = &details;

  inflight_t me = {NULL, call};
  uv_mutex_lock(&c->lock);
  int cancelled = c->cancelled;
  if (!cancelled) {
    me.next = c->inflight;
    c->inflight = &me;
  }
  uv_mutex_unlock(&c->lock);
  if (cancelled)
    grpc_call_cancel(call, NULL);
  int tag;
  grpc_call_error e = grpc_call_start_batch(call, ops, 6, &tag, NULL);
  if (e == GRPC_CALL_OK) {
    grpc_event ev = grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type != GRPC_OP_COMPLETE || !ev.success)
      status = GRPC_STATUS_INTERNAL;
  } else {
    status = GRPC_STATUS_INTERNAL;
  }
  uv_mutex_lock(&c->lock);
  for (inflight_t **pp = &c->inflight; *pp; pp = &(*pp)->next) {
    if (*pp == &me) {
      *pp = me.next;
      break;
    }
  }
  uv_mutex_unlock(&c->lock);
  if (status == GRPC_STATUS_OK) {
    grpc_byte_buffer_reader reader;
    if (recv_bb && grpc_byte_buffer_reader_init(&reader, recv_bb)) {
      grpc_slice s = grpc_byte_buffer_reader_readall(&reader);
      grpc_byte_buffer_reader_destroy(&reader);
      *resp = protobuf_c_message_unpack(md ? md->output : NULL, NULL, GRPC_SLICE_LENGTH(s),
                                        GRPC_SLICE_START_PTR(s));
      grpc_slice_unref(s);
    }
    if (!*resp) {
      ret = DT_ERPC;
      if (err)
        snprintf(err, errlen, "%s: malformed response", method);
    }
  } else {
    ret = dt_rpc_status_to_err(status);
    if (err) {
      char *d = grpc_slice_to_c_string(details);
      snprintf(err, errlen, "%s", *d ? d : dt_strerror(ret));
      gpr_free(d);
    }
  }

  if (recv_bb)
    grpc_byte_buffer_destroy(recv_bb);
  grpc_byte_buffer_destroy(send_bb);
  grpc_slice_unref(details);
  grpc_slice_unref(auth.value);
  grpc_metadata_array_destroy(&recv_md);
  grpc_metadata_array_destroy(&trailing_md);
  grpc_call_unref(call);
  grpc_completion_queue_shutdown(cq);
  grpc_completion_queue_destroy(cq);
  return ret;
}

/* ------------------------------------------------------------------------------------------ */
/* Tokens                                                                                      */
/* ------------------------------------------------------------------------------------------ */

int dt_rpc_read_token(const char *path, char *token, size_t len)
{
  FILE *fp = fopen(path, "r");
  if (!fp) {
    int e = errno;
    DT_ERROR(RPC, "%s: cannot read token file: %s", path, strerror(e));
    return dt_err_from_errno(e);
  }
  /* Like ssh's private keys: a secret others can read is refused, not used. */
  struct stat st;
  if (fstat(fileno(fp), &st) == 0 && (st.st_mode & 077)) {
    DT_ERROR(RPC, "%s: token file is accessible by group or others (mode %04o); chmod 600 it", path,
             (unsigned)(st.st_mode & 07777));
    fclose(fp);
    return DT_EACCES;
  }
  if (!fgets(token, (int)len, fp))
    token[0] = '\0';
  fclose(fp);
  size_t n = strlen(token);
  while (n && (token[n - 1] == '\n' || token[n - 1] == '\r' || token[n - 1] == ' '))
    token[--n] = '\0';
  if (n == 0) {
    DT_ERROR(RPC, "%s: token file is empty", path);
    return DT_EINVAL;
  }
  return 0;
}

int dt_rpc_write_new_token(const char *path, char *token, size_t len)
{
  unsigned char raw[24];
  int fd = open("/dev/urandom", O_RDONLY);
  if (fd < 0 || read(fd, raw, sizeof raw) != (ssize_t)sizeof raw) {
    if (fd >= 0)
      close(fd);
    DT_ERROR(RPC, "cannot read /dev/urandom for a token");
    return DT_ESYS;
  }
  close(fd);
  if (len < 2 * sizeof raw + 1)
    return DT_EINVAL;
  for (size_t i = 0; i < sizeof raw; i++)
    snprintf(token + 2 * i, 3, "%02x", raw[i]);
  int out = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (out < 0) {
    int e = errno;
    DT_ERROR(RPC, "%s: cannot create token file: %s", path, strerror(e));
    return dt_err_from_errno(e);
  }
  size_t n = strlen(token);
  int ok = write(out, token, n) == (ssize_t)n && write(out, "\n", 1) == 1 && fsync(out) == 0;
  close(out);
  return ok ? 0 : DT_EIO;
}
