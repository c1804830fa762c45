/* jobspec.c — job specs: defaults, the YAML reader (libyaml's document loader) and writer
 * (libyaml's emitter), --set overrides, static validation and the trainer command line.
 *
 * The reader, the writer and --set walk the protobuf-c descriptors of Distrain__V1__JobSpec, so
 * the YAML schema is the .proto and cannot drift from it: a message field is a YAML mapping, a
 * scalar field a YAML scalar, with the proto field name as the key. Invariant kept by every
 * function here: a string field holds either protobuf_c_empty_string or a malloc'ed string, and
 * a message field NULL or a malloc'ed message, exactly what protobuf_c_message_free_unpacked
 * (with the default allocator) expects. */
#include "jobspec.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <yaml.h>

#include "blend.h"
#include "dt_error.h"
#include "dt_util.h"

/* Job spec texts larger than this are refused (a spec is a few hundred bytes). */
#define DT_JOBSPEC_MAX_BYTES (1u << 20)
/* Fields per message the reader tracks for duplicate keys; the proto has at most 9. */
#define DT_JOBSPEC_MAX_FIELDS 64
/* Longest dotted key ("optimizer.min_lr_frac") plus room for junk in user input. */
#define DT_JOBSPEC_MAX_PATH 256

typedef Distrain__V1__JobSpec spec_t;

/* ------------------------------------------------------------------------------------------ */
/* Messages and strings                                                                        */
/* ------------------------------------------------------------------------------------------ */

/* The address of field f inside message m. */
static void *field_ptr(ProtobufCMessage *m, const ProtobufCFieldDescriptor *f)
{
  return (char *)m + f->offset;
}

static const void *field_cptr(const ProtobufCMessage *m, const ProtobufCFieldDescriptor *f)
{
  return (const char *)m + f->offset;
}

/* A zeroed (proto default) message of type d on the heap, as protobuf-c's unpack makes them. */
static ProtobufCMessage *msg_new(const ProtobufCMessageDescriptor *d)
{
  ProtobufCMessage *m = malloc(d->sizeof_message);
  if (m)
    d->message_init(m);
  return m;
}

/* Allocates every missing sub-message of m, recursively. 0 or DT_ENOMEM. */
static int msg_fill_sections(ProtobufCMessage *m)
{
  const ProtobufCMessageDescriptor *d = m->descriptor;
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    if (f->type != PROTOBUF_C_TYPE_MESSAGE || f->label == PROTOBUF_C_LABEL_REPEATED)
      continue;
    ProtobufCMessage **sub = field_ptr(m, f);
    if (!*sub && !(*sub = msg_new(f->descriptor)))
      return DT_ENOMEM;
    int rc = msg_fill_sections(*sub);
    if (rc < 0)
      return rc;
  }
  return 0;
}

/* Replaces *slot with a heap copy of s[0..len) (the static empty string for len 0), freeing the
 * old value unless it is the static empty string. 0 or DT_ENOMEM (slot untouched). */
static int str_set(char **slot, const char *s, size_t len)
{
  char *v = (char *)protobuf_c_empty_string;
  if (len > 0) {
    v = malloc(len + 1);
    if (!v)
      return DT_ENOMEM;
    memcpy(v, s, len);
    v[len] = '\0';
  }
  if (*slot && *slot != protobuf_c_empty_string)
    free(*slot);
  *slot = v;
  return 0;
}

static int str_set0(char **slot, const char *s)
{
  return str_set(slot, s, strlen(s));
}

static bool str_empty(const char *s)
{
  return !s || !*s;
}

void dt_jobspec_free(spec_t *spec)
{
  if (spec)
    protobuf_c_message_free_unpacked(&spec->base, NULL);
}

/* A deep copy through the wire encoding (so it has exactly the ownership unpack gives). */
static int spec_clone(const spec_t *spec, spec_t **out)
{
  size_t n = distrain__v1__job_spec__get_packed_size(spec);
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf)
    return DT_ENOMEM;
  distrain__v1__job_spec__pack(spec, buf);
  *out = distrain__v1__job_spec__unpack(NULL, n, buf);
  free(buf);
  return *out ? 0 : DT_ENOMEM;
}

/* Exchanges the contents of two specs (every pointer inside is heap-owned, so the structs can be
 * swapped wholesale); used to commit an update made on a clone. */
static void spec_swap(spec_t *a, spec_t *b)
{
  spec_t t = *a;
  *a = *b;
  *b = t;
}

bool dt_jobspec_equal(const spec_t *a, const spec_t *b)
{
  if (!a || !b)
    return a == b;
  size_t na = distrain__v1__job_spec__get_packed_size(a);
  size_t nb = distrain__v1__job_spec__get_packed_size(b);
  if (na != nb)
    return false;
  uint8_t *ba = malloc(na ? na : 1), *bb = malloc(nb ? nb : 1);
  bool eq = false;
  if (ba && bb) {
    distrain__v1__job_spec__pack(a, ba);
    distrain__v1__job_spec__pack(b, bb);
    eq = memcmp(ba, bb, na) == 0;
  }
  free(ba);
  free(bb);
  return eq;
}

/* ------------------------------------------------------------------------------------------ */
/* Defaults                                                                                    */
/* ------------------------------------------------------------------------------------------ */

int dt_jobspec_new_default(spec_t **out)
{
  *out = NULL;
  spec_t *s = (spec_t *)msg_new(&distrain__v1__job_spec__descriptor);
  if (!s)
    return DT_ENOMEM;
  if (msg_fill_sections(&s->base) < 0)
    goto nomem;

  /* The demo's byte-level GPT-2 (llm.c's tiny config), trained on one device. */
  s->model->layers = 4;
  s->model->heads = 4;
  s->model->channels = 256;
  s->model->vocab = 256;
  s->model->max_seq = 256;
  if (str_set0(&s->model->init, "seed:1337") < 0)
    goto nomem;

  s->data->shuffle = 0; /* data.train and data.val stay empty: a job must name its data */

  s->training->batch = 8;
  s->training->seq = 256;
  s->training->steps = 200;
  s->training->micro_batch = 8;
  s->training->val_every = 0;
  s->training->val_batches = 20;
  s->training->threads = 0;
  if (str_set0(&s->training->device, "auto") < 0 || str_set0(&s->training->precision, "fp32") < 0 ||
      str_set0(&s->training->attention, "flash") < 0)
    goto nomem;

  s->optimizer->lr = 3e-4;
  s->optimizer->warmup = 0;
  if (str_set0(&s->optimizer->schedule, "cosine") < 0)
    goto nomem;
  s->optimizer->min_lr_frac = 0.0;
  s->optimizer->decay_frac = 0.2;
  s->optimizer->weight_decay = 0.0;
  s->optimizer->beta1 = 0.9;
  s->optimizer->beta2 = 0.95;
  s->optimizer->eps = 1e-8;
  s->optimizer->grad_clip = 1.0;

  s->parallel->dp = 1;
  s->parallel->tp = 1;
  s->parallel->pp = 1;
  s->parallel->cp = 1;
  s->parallel->zero_stage = 0;
  if (str_set0(&s->parallel->schedule, "1f1b") < 0 || str_set0(&s->parallel->comm, "auto") < 0)
    goto nomem;

  if (str_set0(&s->checkpoint->dir, "ckpt") < 0)
    goto nomem;
  s->checkpoint->every = 100;
  s->checkpoint->keep = 3;

  s->elastic->min_nodes = 1;
  s->elastic->max_nodes = 1;
  s->elastic->max_restarts = 3;
  s->elastic->heartbeat_ms = 500;
  s->elastic->hang_timeout_s = 30;

  *out = s;
  return 0;

nomem:
  dt_jobspec_free(s);
  return DT_ENOMEM;
}

/* ------------------------------------------------------------------------------------------ */
/* Errors with origin and line                                                                 */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
  const char *origin; /* "job.yaml", or "--set model.layers=4" */
  char *err;
  size_t errlen;
} dt__ctx_t;

/* Writes "origin:line: message" (line 0: "origin: message") and returns DT_EINVAL. */
static int fail(dt__ctx_t *c, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(dt__ctx_t *c, int line, const char *fmt, ...)
{
  if (!c->err || c->errlen == 0)
    return DT_EINVAL;
  int n = line > 0 ? snprintf(c->err, c->errlen, "%s:%d: ", c->origin, line)
                   : snprintf(c->err, c->errlen, "%s: ", c->origin);
  if (n >= 0 && (size_t)n < c->errlen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err + n, c->errlen - (size_t)n, fmt, ap);
    va_end(ap);
  }
  return DT_EINVAL;
}

static int fail_nomem(dt__ctx_t *c)
{
  fail(c, 0, "out of memory");
  return DT_ENOMEM;
}

/* Edit distance between two short strings (for "did you mean"); capped inputs keep it cheap. */
static int edit_distance(const char *a, const char *b)
{
  size_t la = strlen(a), lb = strlen(b);
  if (la > 63 || lb > 63)
    return INT_MAX;
  int row[64];
  for (size_t j = 0; j <= lb; j++)
    row[j] = (int)j;
  for (size_t i = 1; i <= la; i++) {
    int diag = row[0];
    row[0] = (int)i;
    for (size_t j = 1; j <= lb; j++) {
      int up = row[j];
      int best = diag + (a[i - 1] != b[j - 1]);
      best = DT_MIN(best, up + 1);
      best = DT_MIN(best, row[j - 1] + 1);
      row[j] = best;
      diag = up;
    }
  }
  return row[lb];
}

/* "layers, heads, channels, ..." for message d. */
static void field_list(const ProtobufCMessageDescriptor *d, char *buf, size_t n)
{
  size_t used = 0;
  buf[0] = '\0';
  for (unsigned i = 0; i < d->n_fields && used < n; i++) {
    int w = snprintf(buf + used, n - used, "%s%s", i ? ", " : "", d->fields[i].name);
    if (w < 0)
      break;
    used += (size_t)w;
  }
}

/* "unknown key 'model.layer' (did you mean 'model.layers'? expected one of: layers, ...)". */
static int fail_unknown(dt__ctx_t *c, int line, const ProtobufCMessageDescriptor *d,
                        const char *prefix, const char *key)
{
  char list[512], hint[DT_JOBSPEC_MAX_PATH + 32] = "";
  field_list(d, list, sizeof list);
  int best = INT_MAX;
  const char *best_name = NULL;
  for (unsigned i = 0; i < d->n_fields; i++) {
    int dist = edit_distance(key, d->fields[i].name);
    if (dist < best) {
      best = dist;
      best_name = d->fields[i].name;
    }
  }
  if (best_name && best <= 2 && (size_t)best < strlen(best_name))
    snprintf(hint, sizeof hint, "did you mean '%s%s%s'? ", prefix, *prefix ? "." : "", best_name);
  return fail(c, line, "unknown key '%s%s%s' (%sexpected one of: %s)", prefix, *prefix ? "." : "",
              key, hint, list);
}

/* ------------------------------------------------------------------------------------------ */
/* Scalars                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* One value to store in a scalar field, from YAML or from --set. */
typedef struct {
  const char *text; /* NUL-terminated */
  size_t len;       /* may be < strlen only if text has an embedded NUL (refused for strings) */
  bool plain;       /* unquoted: may be a number, a boolean or null */
  bool verbatim;    /* --set: a string field takes text as it is (no null resolution) */
  int line;         /* 1-based, 0 when there is no line */
} dt__scalar_t;

/* [-+]?[0-9]+ — YAML 1.2 core schema decimal integers (no hex/octal in job specs). */
static bool is_decimal_int(const char *s)
{
  if (*s == '+' || *s == '-')
    s++;
  if (!*s)
    return false;
  for (; *s; s++)
    if (*s < '0' || *s > '9')
      return false;
  return true;
}

/* [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)? — YAML 1.2 core finite floats. strtod alone
 * would also take "0x1p3", "inf" and leading blanks. */
static bool is_decimal_number(const char *s)
{
  size_t digits = 0;
  if (*s == '+' || *s == '-')
    s++;
  for (; *s >= '0' && *s <= '9'; s++)
    digits++;
  if (*s == '.')
    for (s++; *s >= '0' && *s <= '9'; s++)
      digits++;
  if (digits == 0)
    return false;
  if (*s == 'e' || *s == 'E') {
    s++;
    if (*s == '+' || *s == '-')
      s++;
    if (*s < '0' || *s > '9')
      return false;
    while (*s >= '0' && *s <= '9')
      s++;
  }
  return *s == '\0';
}

static bool is_null(const dt__scalar_t *v)
{
  return v->plain && (v->len == 0 || strcmp(v->text, "~") == 0 || strcmp(v->text, "null") == 0 ||
                      strcmp(v->text, "Null") == 0 || strcmp(v->text, "NULL") == 0);
}

static const char *type_expect(const ProtobufCFieldDescriptor *f)
{
  switch (f->type) {
  case PROTOBUF_C_TYPE_INT32:
    return "an integer";
  case PROTOBUF_C_TYPE_DOUBLE:
  case PROTOBUF_C_TYPE_FLOAT:
    return "a number";
  case PROTOBUF_C_TYPE_BOOL:
    return "true or false";
  case PROTOBUF_C_TYPE_STRING:
    return "a string";
  case PROTOBUF_C_TYPE_MESSAGE:
    return "a mapping";
  default:
    return "a supported value";
  }
}

/* Why a scalar is not of the wanted type, for the message "path: expected X, got Y". */
static int fail_type(dt__ctx_t *c, const dt__scalar_t *v, const char *path,
                     const ProtobufCFieldDescriptor *f)
{
  if (!v->plain)
    return fail(c, v->line, "%s: expected %s, got the quoted string '%s' (write it without quotes)",
                path, type_expect(f), v->text);
  if (v->len == 0)
    return fail(c, v->line, "%s: expected %s, got an empty value", path, type_expect(f));
  return fail(c, v->line, "%s: expected %s, got '%s'", path, type_expect(f), v->text);
}

/* Stores v into field f of m, typed by the field. */
static int apply_scalar(dt__ctx_t *c, ProtobufCMessage *m, const ProtobufCFieldDescriptor *f,
                        const char *path, const dt__scalar_t *v)
{
  void *p = field_ptr(m, f);
  switch (f->type) {
  case PROTOBUF_C_TYPE_INT32: {
    int64_t x;
    if (!v->plain || !is_decimal_int(v->text) || dt_parse_i64(v->text, &x) != 0) {
      /* strtoll overflow of a well-formed integer is a range error, not a type error. */
      if (v->plain && is_decimal_int(v->text))
        return fail(c, v->line, "%s: %s does not fit a 32-bit integer", path, v->text);
      return fail_type(c, v, path, f);
    }
    if (x < INT32_MIN || x > INT32_MAX)
      return fail(c, v->line, "%s: %s does not fit a 32-bit integer", path, v->text);
    *(int32_t *)p = (int32_t)x;
    return 0;
  }
  case PROTOBUF_C_TYPE_DOUBLE:
  case PROTOBUF_C_TYPE_FLOAT: {
    double x;
    if (!v->plain || !is_decimal_number(v->text))
      return fail_type(c, v, path, f);
    /* As the trainer parses its flags: subnormal values (which the writer may produce) are
     * kept, only overflow to infinity is out of range. */
    if (dt_parse_f64(v->text, &x) != 0)
      return fail(c, v->line, "%s: %s is out of range", path, v->text);
    if (f->type == PROTOBUF_C_TYPE_FLOAT)
      *(float *)p = (float)x;
    else
      *(double *)p = x;
    return 0;
  }
  case PROTOBUF_C_TYPE_BOOL: {
    const char *t = v->text;
    if (v->plain && (!strcmp(t, "true") || !strcmp(t, "True") || !strcmp(t, "TRUE")))
      *(protobuf_c_boolean *)p = 1;
    else if (v->plain && (!strcmp(t, "false") || !strcmp(t, "False") || !strcmp(t, "FALSE")))
      *(protobuf_c_boolean *)p = 0;
    else
      return fail_type(c, v, path, f);
    return 0;
  }
  case PROTOBUF_C_TYPE_STRING:
    if (strlen(v->text) != v->len)
      return fail(c, v->line, "%s: the string contains a NUL character", path);
    if (!dt_utf8_valid(v->text, v->len))
      return fail(c, v->line, "%s: the string is not valid UTF-8", path);
    if (!v->verbatim && is_null(v))
      return str_set((char **)p, "", 0) < 0 ? fail_nomem(c) : 0;
    return str_set((char **)p, v->text, v->len) < 0 ? fail_nomem(c) : 0;
  default:
    fail(c, v->line, "%s: fields of protobuf type %d are not supported in job specs", path,
         (int)f->type);
    return DT_EINTERNAL;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* YAML reader                                                                                 */
/* ------------------------------------------------------------------------------------------ */

static int node_line(const yaml_node_t *n)
{
  return (int)n->start_mark.line + 1;
}

/* "a mapping", "a sequence", "'text'" (scalars quoted, for "got ..." messages). */
static void describe_node(const yaml_node_t *n, char *buf, size_t len)
{
  if (n->type == YAML_MAPPING_NODE)
    snprintf(buf, len, "a mapping");
  else if (n->type == YAML_SEQUENCE_NODE)
    snprintf(buf, len, "a sequence");
  else if (n->type == YAML_SCALAR_NODE && n->data.scalar.length == 0 &&
           n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE)
    snprintf(buf, len, "an empty value");
  else if (n->type == YAML_SCALAR_NODE)
    snprintf(buf, len, "'%s'", (const char *)n->data.scalar.value);
  else
    snprintf(buf, len, "nothing");
}

/* prefix.key into buf. Over-long user keys are cut (only ever shown in messages, since a cut
 * key matches no field). */
static void join_path(char *buf, size_t n, const char *prefix, const char *key)
{
  int w = snprintf(buf, n, "%s%s%s", prefix, *prefix ? "." : "", key);
  if (w < 0 || (size_t)w >= n)
    buf[n - 1] = '\0';
}

/* Applies YAML mapping node map onto message m; prefix is m's dotted path ("" at the top). */
static int apply_mapping(dt__ctx_t *c, yaml_document_t *doc, yaml_node_t *map, ProtobufCMessage *m,
                         const char *prefix)
{
  const ProtobufCMessageDescriptor *d = m->descriptor;
  int seen[DT_JOBSPEC_MAX_FIELDS] = {0}; /* line where each field was first set, 0 = not yet */
  if (d->n_fields > DT_JOBSPEC_MAX_FIELDS) {
    fail(c, node_line(map), "message %s has too many fields", d->name);
    return DT_EINTERNAL;
  }
  for (yaml_node_pair_t *pair = map->data.mapping.pairs.start; pair < map->data.mapping.pairs.top;
       pair++) {
    yaml_node_t *k = yaml_document_get_node(doc, pair->key);
    yaml_node_t *v = yaml_document_get_node(doc, pair->value);
    char what[160], path[DT_JOBSPEC_MAX_PATH];
    if (!k || !v)
      return fail(c, node_line(map), "%s: malformed mapping", *prefix ? prefix : "top level");
    if (k->type != YAML_SCALAR_NODE) {
      describe_node(k, what, sizeof what);
      return fail(c, node_line(k), "%s: keys must be plain words, got %s",
                  *prefix ? prefix : "top level", what);
    }
    const char *key = (const char *)k->data.scalar.value;
    join_path(path, sizeof path, prefix, key);
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field_by_name(d, key);
    if (!f || f->label == PROTOBUF_C_LABEL_REPEATED)
      return fail_unknown(c, node_line(k), d, prefix, key);
    size_t idx = (size_t)(f - d->fields);
    if (seen[idx])
      return fail(c, node_line(k), "duplicate key '%s' (first given at line %d)", path, seen[idx]);
    seen[idx] = node_line(k);

    if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
      if (v->type != YAML_MAPPING_NODE) {
        char list[512];
        describe_node(v, what, sizeof what);
        field_list(f->descriptor, list, sizeof list);
        return fail(c, node_line(v), "%s: expected a mapping (with keys among: %s), got %s", path,
                    list, what);
      }
      ProtobufCMessage **sub = field_ptr(m, f);
      if (!*sub && !(*sub = msg_new(f->descriptor)))
        return fail_nomem(c);
      int rc = apply_mapping(c, doc, v, *sub, path);
      if (rc < 0)
        return rc;
      continue;
    }
    if (v->type != YAML_SCALAR_NODE) {
      describe_node(v, what, sizeof what);
      return fail(c, node_line(v), "%s: expected %s, got %s", path, type_expect(f), what);
    }
    dt__scalar_t sv = {
        .text = (const char *)v->data.scalar.value,
        .len = v->data.scalar.length,
        .plain = v->data.scalar.style == YAML_PLAIN_SCALAR_STYLE,
        .verbatim = false,
        .line = node_line(v),
    };
    int rc = apply_scalar(c, m, f, path, &sv);
    if (rc < 0)
      return rc;
  }
  return 0;
}

/* libyaml's error as "origin:line: YAML syntax error: problem (context at line N)". */
static int fail_yaml(dt__ctx_t *c, const yaml_parser_t *p)
{
  if (p->error == YAML_MEMORY_ERROR)
    return fail_nomem(c);
  const char *problem = p->problem ? p->problem : "unknown error";
  if (p->error == YAML_READER_ERROR)
    return fail(c, 0, "YAML reader error at byte %zu: %s", p->problem_offset, problem);
  if (p->context)
    return fail(c, (int)p->problem_mark.line + 1, "YAML syntax error: %s (%s at line %d)", problem,
                p->context, (int)p->context_mark.line + 1);
  return fail(c, (int)p->problem_mark.line + 1, "YAML syntax error: %s", problem);
}

/* True for a document with no content, or whose root is a plain null ("---" alone, "~"). */
static bool doc_is_empty(yaml_node_t *root)
{
  if (!root)
    return true;
  if (root->type != YAML_SCALAR_NODE)
    return false;
  dt__scalar_t v = {.text = (const char *)root->data.scalar.value,
                    .len = root->data.scalar.length,
                    .plain = root->data.scalar.style == YAML_PLAIN_SCALAR_STYLE};
  return is_null(&v);
}

/* A job spec nests three levels (section, key, list); libyaml's scanner does work per token
 * in proportion to the nesting depth, so a deeply nested file costs quadratic time to load (a
 * 1 MB one took minutes). A first pass over the events stops at the first node deeper than
 * this, in time linear in the bytes read. */
#define MAX_NESTING 32

static int check_nesting(dt__ctx_t *c, const char *text, size_t len)
{
  yaml_parser_t parser;
  if (!yaml_parser_initialize(&parser))
    return fail_nomem(c);
  yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
  int depth = 0, ret = 0;
  for (;;) {
    yaml_event_t ev;
    if (!yaml_parser_parse(&parser, &ev)) {
      ret = fail_yaml(c, &parser);
      break;
    }
    const yaml_event_type_t type = ev.type;
    const int line = (int)ev.start_mark.line + 1;
    yaml_event_delete(&ev);
    if (type == YAML_MAPPING_START_EVENT || type == YAML_SEQUENCE_START_EVENT)
      depth++;
    else if (type == YAML_MAPPING_END_EVENT || type == YAML_SEQUENCE_END_EVENT)
      depth--;
    if (depth > MAX_NESTING) {
      ret = fail(c, line, "YAML nested more than %d levels deep (a job spec needs 3)", MAX_NESTING);
      break;
    }
    if (type == YAML_STREAM_END_EVENT)
      break;
  }
  yaml_parser_delete(&parser);
  return ret;
}

int dt_jobspec_parse_yaml(const char *text, size_t len, const char *origin, spec_t *spec, char *err,
                          size_t errlen)
{
  dt__ctx_t c = {.origin = origin ? origin : "<string>", .err = err, .errlen = errlen};
  yaml_parser_t parser;
  yaml_document_t doc, extra;
  spec_t *work = NULL;
  int ret = 0;
  if (errlen > 0)
    err[0] = '\0';
  if (!spec || (!text && len > 0))
    return fail(&c, 0, "no spec or no text");
  if (len > DT_JOBSPEC_MAX_BYTES)
    return fail(&c, 0, "job spec is %zu bytes, more than the %u allowed", len,
                DT_JOBSPEC_MAX_BYTES);

  if ((ret = check_nesting(&c, text ? text : "", len)) != 0)
    return ret;
  if (!yaml_parser_initialize(&parser))
    return fail_nomem(&c);
  yaml_parser_set_input_string(&parser, (const unsigned char *)(text ? text : ""), len);
  if (!yaml_parser_load(&parser, &doc)) {
    ret = fail_yaml(&c, &parser);
    goto out_parser;
  }
  yaml_node_t *root = yaml_document_get_root_node(&doc);
  if (root) {
    /* One document per spec: a second one is almost certainly a concatenation mistake. */
    if (!yaml_parser_load(&parser, &extra)) {
      ret = fail_yaml(&c, &parser);
      goto out_doc;
    }
    yaml_node_t *extra_root = yaml_document_get_root_node(&extra);
    int extra_line = extra_root ? node_line(extra_root) : 0;
    yaml_document_delete(&extra);
    if (extra_root) {
      ret = fail(&c, extra_line, "expected one YAML document, found a second one");
      goto out_doc;
    }
  }
  if (doc_is_empty(root))
    goto out_doc;
  if (root->type != YAML_MAPPING_NODE) {
    char what[160], list[512];
    describe_node(root, what, sizeof what);
    field_list(&distrain__v1__job_spec__descriptor, list, sizeof list);
    ret = fail(&c, node_line(root), "expected a mapping with keys among: %s; got %s", list, what);
    goto out_doc;
  }
  /* Apply to a copy and swap it in only on success, so a bad file leaves spec as it was. */
  if (spec_clone(spec, &work) < 0) {
    ret = fail_nomem(&c);
    goto out_doc;
  }
  ret = apply_mapping(&c, &doc, root, &work->base, "");
  if (ret == 0)
    spec_swap(spec, work);
  dt_jobspec_free(work);

out_doc:
  yaml_document_delete(&doc);
out_parser:
  yaml_parser_delete(&parser);
  return ret;
}

int dt_jobspec_parse_file(const char *path, spec_t *spec, char *err, size_t errlen)
{
  dt__ctx_t c = {.origin = path, .err = err, .errlen = errlen};
  char *buf = NULL;
  size_t len = 0, cap = 0;
  int ret = 0;
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    int e = errno;
    fail(&c, 0, "cannot open: %s", strerror(e));
    return dt_err_from_errno(e);
  }
  /* Read in chunks rather than by st_size so that pipes and /dev/stdin work too. */
  for (;;) {
    if (len == cap) {
      if (cap > DT_JOBSPEC_MAX_BYTES) {
        ret = fail(&c, 0, "job spec is larger than the %u bytes allowed", DT_JOBSPEC_MAX_BYTES);
        goto out;
      }
      cap = cap ? cap * 2 : 4096;
      char *nb = realloc(buf, cap);
      if (!nb) {
        ret = fail_nomem(&c);
        goto out;
      }
      buf = nb;
    }
    size_t got = fread(buf + len, 1, cap - len, fp);
    len += got;
    if (got == 0)
      break;
  }
  if (ferror(fp)) {
    int e = errno;
    fail(&c, 0, "read error: %s", strerror(e));
    ret = e ? dt_err_from_errno(e) : DT_EIO;
    goto out;
  }
  ret = dt_jobspec_parse_yaml(buf, len, path, spec, err, errlen);
out:
  free(buf);
  fclose(fp);
  return ret;
}

/* ------------------------------------------------------------------------------------------ */
/* --set                                                                                       */
/* ------------------------------------------------------------------------------------------ */

int dt_jobspec_set(spec_t *spec, const char *assignment, char *err, size_t errlen)
{
  char origin[DT_JOBSPEC_MAX_PATH + 64];
  snprintf(origin, sizeof origin, "--set %s", assignment ? assignment : "(null)");
  dt__ctx_t c = {.origin = origin, .err = err, .errlen = errlen};
  if (errlen > 0)
    err[0] = '\0';
  if (!spec || !assignment)
    return fail(&c, 0, "no spec or no assignment");

  const char *eq = strchr(assignment, '=');
  size_t klen = eq ? (size_t)(eq - assignment) : 0;
  if (!eq || klen == 0)
    return fail(&c, 0, "expected section.key=value (for example model.layers=6)");
  if (klen >= DT_JOBSPEC_MAX_PATH)
    return fail(&c, 0, "key too long");
  char key[DT_JOBSPEC_MAX_PATH], prefix[DT_JOBSPEC_MAX_PATH] = "";
  memcpy(key, assignment, klen);
  key[klen] = '\0';

  /* Walk the dotted key down the message tree, one component at a time. */
  ProtobufCMessage *m = &spec->base;
  for (char *part = key;;) {
    char *dot = strchr(part, '.');
    bool last = dot == NULL;
    if (dot)
      *dot = '\0';
    if (*part == '\0')
      return fail(&c, 0, "empty key component in '%.*s' (expected section.key=value)", (int)klen,
                  assignment);
    const ProtobufCMessageDescriptor *d = m->descriptor;
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field_by_name(d, part);
    char path[DT_JOBSPEC_MAX_PATH];
    join_path(path, sizeof path, prefix, part);
    if (!f || f->label == PROTOBUF_C_LABEL_REPEATED)
      return fail_unknown(&c, 0, d, prefix, part);
    if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
      if (last) {
        char list[512];
        field_list(f->descriptor, list, sizeof list);
        return fail(&c, 0, "'%s' is a section; set one of its keys (%s.KEY=VALUE): %s", path, path,
                    list);
      }
      ProtobufCMessage **sub = field_ptr(m, f);
      if (!*sub && !(*sub = msg_new(f->descriptor)))
        return fail_nomem(&c);
      m = *sub;
      snprintf(prefix, sizeof prefix, "%s", path);
      part = dot + 1;
      continue;
    }
    if (!last)
      return fail(&c, 0, "'%s' is a single value, not a section", path);
    const char *value = eq + 1;
    dt__scalar_t sv = {
        .text = value, .len = strlen(value), .plain = true, .verbatim = true, .line = 0};
    return apply_scalar(&c, m, f, path, &sv);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Validation                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* Collects violations into err as "first; second; ...". */
typedef struct {
  char *err;
  size_t errlen, used;
  int count;
} dt__violations_t;

static void bad(dt__violations_t *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bad(dt__violations_t *v, const char *fmt, ...)
{
  v->count++;
  if (!v->err || v->used + 1 >= v->errlen)
    return;
  if (v->count > 1) {
    int w = snprintf(v->err + v->used, v->errlen - v->used, "; ");
    v->used = DT_MIN(v->errlen - 1, v->used + (size_t)(w > 0 ? w : 0));
  }
  va_list ap;
  va_start(ap, fmt);
  int w = vsnprintf(v->err + v->used, v->errlen - v->used, fmt, ap);
  va_end(ap);
  v->used = DT_MIN(v->errlen - 1, v->used + (size_t)(w > 0 ? w : 0));
}

/* "seed:N" (N a non-negative decimal), "llmc:PATH", "hf:DIR", "ckpt:DIR" or a non-empty
 * checkpoint path. */
static bool init_valid(const char *s)
{
  int64_t seed;
  if (str_empty(s))
    return false;
  if (strncmp(s, "seed:", 5) == 0)
    return is_decimal_int(s + 5) && dt_parse_i64(s + 5, &seed) == 0 && seed >= 0;
  if (strncmp(s, "llmc:", 5) == 0)
    return s[5] != '\0';
  if (strncmp(s, "hf:", 3) == 0)
    return s[3] != '\0';
  if (strncmp(s, "ckpt:", 5) == 0)
    return s[5] != '\0';
  return true;
}

#define DT__POSITIVE(v, sect, field)                                                               \
  do {                                                                                             \
    if ((sect)->field < 1)                                                                         \
      bad((v), #sect "." #field " (%d) must be > 0", (int)(sect)->field);                          \
  } while (0)

#define DT__NONNEG(v, sect, field, why)                                                            \
  do {                                                                                             \
    if ((sect)->field < 0)                                                                         \
      bad((v), #sect "." #field " (%d) must be >= 0%s", (int)(sect)->field, (why));                \
  } while (0)

int dt_jobspec_validate(const spec_t *spec, char *err, size_t errlen)
{
  dt__violations_t v = {.err = err, .errlen = errlen};
  if (errlen > 0)
    err[0] = '\0';
  if (!spec) {
    bad(&v, "no spec");
    return DT_EINVAL;
  }
  /* Every section must be present: a spec from the wire may lack one. */
  const ProtobufCMessageDescriptor *d = spec->base.descriptor;
  for (unsigned i = 0; i < d->n_fields; i++)
    if (d->fields[i].type == PROTOBUF_C_TYPE_MESSAGE &&
        !*(ProtobufCMessage *const *)field_cptr(&spec->base, &d->fields[i]))
      bad(&v, "section '%s' is missing", d->fields[i].name);
  if (v.count)
    return DT_EINVAL;
  /* Strings from the wire: protobuf-c does not check their encoding. */
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCMessage *sec = &spec->base;
    const ProtobufCFieldDescriptor *fs = &d->fields[i];
    unsigned nf = 1;
    if (d->fields[i].type == PROTOBUF_C_TYPE_MESSAGE) {
      sec = *(ProtobufCMessage *const *)field_cptr(&spec->base, &d->fields[i]);
      fs = sec->descriptor->fields, nf = sec->descriptor->n_fields;
    }
    for (unsigned k = 0; k < nf; k++) {
      if (fs[k].type != PROTOBUF_C_TYPE_STRING || fs[k].label == PROTOBUF_C_LABEL_REPEATED)
        continue;
      const char *str = *(const char *const *)field_cptr(sec, &fs[k]);
      if (str && !dt_utf8_valid(str, strlen(str)))
        bad(&v, "%s%s%s is not valid UTF-8", sec == &spec->base ? "" : d->fields[i].name,
            sec == &spec->base ? "" : ".", fs[k].name);
    }
  }

  const Distrain__V1__ModelSpec *model = spec->model;
  const Distrain__V1__DataSpec *data = spec->data;
  const Distrain__V1__TrainingSpec *training = spec->training;
  const Distrain__V1__OptimizerSpec *optimizer = spec->optimizer;
  const Distrain__V1__ParallelSpec *parallel = spec->parallel;
  const Distrain__V1__CheckpointSpec *checkpoint = spec->checkpoint;
  const Distrain__V1__ElasticSpec *elastic = spec->elastic;

  /* model */
  DT__POSITIVE(&v, model, layers);
  DT__POSITIVE(&v, model, heads);
  DT__POSITIVE(&v, model, channels);
  DT__POSITIVE(&v, model, max_seq);
  /* The trainer's bounds (worker/trainer/gpt2.h, DT_GPT2_MAX_*): refused here, before any
   * trainer starts. */
  if (model->layers > 4096)
    bad(&v, "model.layers (%d) must be <= 4096", model->layers);
  if (model->channels > 131072)
    bad(&v, "model.channels (%d) must be <= 131072", model->channels);
  if (model->max_seq > 16777216)
    bad(&v, "model.max_seq (%d) must be <= 16777216", model->max_seq);
  if (model->vocab < 2 || model->vocab > 65536)
    bad(&v, "model.vocab (%d) must be in [2, 65536] (token shards hold 16-bit ids)", model->vocab);
  if (model->heads > 0 && model->channels > 0 && model->channels % model->heads != 0)
    bad(&v, "model.channels (%d) must be divisible by model.heads (%d)", model->channels,
        model->heads);
  if (!init_valid(model->init))
    bad(&v,
        "model.init must be seed:N (N >= 0), llmc:PATH, hf:DIR, ckpt:DIR or a checkpoint path, "
        "got '%s'",
        model->init ? model->init : "");

  /* data */
  if (str_empty(data->train))
    bad(&v, "data.train must name the training shards (a file or a glob)");
  const char *const shards[][2] = {{"data.train", data->train}, {"data.val", data->val}};
  for (size_t i = 0; i < DT_ARRAY_SIZE(shards); i++) {
    dt_blend_t b;
    char why[512];
    if (!dt_blend_is(shards[i][1]))
      continue;
    if (dt_blend_parse(shards[i][1], &b, why, sizeof why) != 0)
      bad(&v, "%s: %s (a blend is WEIGHT:GLOB,WEIGHT:GLOB,...)", shards[i][0], why);
    dt_blend_free(&b);
  }
  if (!str_empty(data->val_sets)) {
    dt_valsets_t vs;
    char why[512];
    if (dt_valsets_parse(data->val_sets, &vs, why, sizeof why) != 0)
      bad(&v, "data.val_sets: %s (validation sets are NAME=GLOB,NAME=GLOB,...)", why);
    dt_valsets_free(&vs);
  }

  /* training */
  DT__POSITIVE(&v, training, batch);
  DT__POSITIVE(&v, training, seq);
  DT__POSITIVE(&v, training, steps);
  DT__POSITIVE(&v, training, micro_batch);
  DT__POSITIVE(&v, training, val_batches);
  DT__NONNEG(&v, training, val_every, " (0 disables validation)");
  DT__NONNEG(&v, training, eval_every, " (0: data.eval before training and at the end only)");
  DT__NONNEG(&v, training, threads, " (0 means cores / trainers on the node)");
  DT__NONNEG(&v, training, sample, " (0 means no sample)");
  /* Empty: a client that predates the field (auto). */
  if (!str_empty(training->device) && strcmp(training->device, "auto") != 0 &&
      strcmp(training->device, "cpu") != 0 && strcmp(training->device, "cuda") != 0)
    bad(&v, "training.device must be auto, cpu or cuda, got '%s'", training->device);
  if (!str_empty(training->precision) && strcmp(training->precision, "fp32") != 0 &&
      strcmp(training->precision, "bf16") != 0)
    bad(&v, "training.precision must be fp32 or bf16, got '%s'", training->precision);
  if (!str_empty(training->attention) && strcmp(training->attention, "flash") != 0 &&
      strcmp(training->attention, "materialized") != 0)
    bad(&v, "training.attention must be flash or materialized, got '%s'", training->attention);
  int pfirst, pcount;
  if (!str_empty(training->profile) &&
      dt_parse_step_range(training->profile, &pfirst, &pcount) != 0)
    bad(&v, "training.profile must be S or S:N (N >= 1 steps from step S >= 1), got '%s'",
        training->profile);
  else if (!str_empty(training->profile) && training->steps > 0 && pfirst > training->steps)
    bad(&v, "training.profile starts at step %d, after the last (training.steps %d)", pfirst,
        training->steps);
  if (!str_empty(parallel->comm) && strcmp(parallel->comm, "auto") != 0 &&
      strcmp(parallel->comm, "cpu") != 0 && strcmp(parallel->comm, "nccl") != 0)
    bad(&v, "parallel.comm must be auto, cpu or nccl, got '%s'", parallel->comm);
  if (!str_empty(parallel->comm) && strcmp(parallel->comm, "nccl") == 0 &&
      !str_empty(training->device) && strcmp(training->device, "cpu") == 0)
    bad(&v, "parallel.comm nccl needs GPUs: training.device is cpu");
  if (model->max_seq > 0 && training->seq > model->max_seq)
    bad(&v, "training.seq (%d) must be <= model.max_seq (%d)", training->seq, model->max_seq);
  if (training->val_every > 0 && str_empty(data->val) && str_empty(data->val_sets))
    bad(&v, "training.val_every (%d) needs data.val or data.val_sets (the validation shards)",
        training->val_every);
  if (!str_empty(data->val_sets) && training->val_every == 0)
    bad(&v, "data.val_sets needs training.val_every: the sets are validated every val_every "
            "steps");
  if (!str_empty(training->prompt) && training->sample <= 0)
    bad(&v, "training.prompt needs training.sample (the tokens to generate after it)");
  DT__NONNEG(&v, training, sample_top_k, " (0: all tokens)");
  DT__NONNEG(&v, training, sample_every, " (0: a sample at the end only)");
  if (training->sample_every > 0 && training->sample <= 0)
    bad(&v, "training.sample_every needs training.sample (the tokens to generate)");
  else if (training->sample_every > 0 && str_empty(training->prompt) && str_empty(data->val))
    bad(&v, "training.sample_every needs training.prompt or data.val: the samples' prompt (the "
            "first sequence of data.val, as the training data's position must not move)");
  /* as the trainer's floats will hold them */
  const float temp = (float)training->sample_temp, top_p = (float)training->sample_top_p;
  if (!(training->sample_temp == 0.0 || (temp > 0.0f && isfinite(temp))))
    bad(&v, "training.sample_temp (%g) must be > 0 and a finite float (0: the default, 0.8)",
        training->sample_temp);
  if (!(training->sample_top_p == 0.0 || (top_p > 0.0f && training->sample_top_p <= 1.0)))
    bad(&v, "training.sample_top_p (%g) must be in (0, 1], a float >= 1.4e-45 (0 or 1: off)",
        training->sample_top_p);
  if ((training->sample_temp > 0 || training->sample_top_k > 0 || training->sample_top_p > 0) &&
      training->sample <= 0)
    bad(&v, "training.sample_temp, sample_top_k and sample_top_p need training.sample (the "
            "tokens to generate)");
  if (!str_empty(data->merge_file) && str_empty(data->vocab_file))
    bad(&v, "data.merge_file needs data.vocab_file (GPT-2's BPE is the two files)");
  if (!str_empty(training->prompt) && !str_empty(data->vocab_file) && str_empty(data->merge_file))
    bad(&v, "training.prompt with data.vocab_file needs data.merge_file: encoding text takes "
            "GPT-2's merges");
  if (training->eval_every > 0 && str_empty(data->eval))
    bad(&v, "training.eval_every (%d) needs data.eval (a multiple-choice eval file)",
        training->eval_every);
  if (!(training->peak_tflops >= 0.0 && training->peak_tflops < 1e9))
    bad(&v, "training.peak_tflops (%g) must be a device's peak TFLOP/s, >= 0 (0: a known GPU's)",
        training->peak_tflops);

  /* optimizer */
  if (!(optimizer->lr >= 0.0 && isfinite(optimizer->lr)))
    bad(&v, "optimizer.lr (%g) must be >= 0", optimizer->lr);
  DT__NONNEG(&v, optimizer, warmup, "");
  if (str_empty(optimizer->schedule) ||
      (strcmp(optimizer->schedule, "cosine") != 0 && strcmp(optimizer->schedule, "constant") != 0 &&
       strcmp(optimizer->schedule, "linear") != 0 && strcmp(optimizer->schedule, "wsd") != 0))
    bad(&v, "optimizer.schedule must be cosine, constant, linear or wsd, got '%s'",
        optimizer->schedule ? optimizer->schedule : "");
  if (!(optimizer->decay_frac >= 0.0 && optimizer->decay_frac <= 1.0))
    bad(&v, "optimizer.decay_frac (%g) must be in (0, 1] (0: the default, 0.2)",
        optimizer->decay_frac);
  if (!(optimizer->min_lr_frac >= 0.0 && optimizer->min_lr_frac <= 1.0))
    bad(&v, "optimizer.min_lr_frac (%g) must be in [0, 1]", optimizer->min_lr_frac);
  /* AdamW's own settings are single precision in the trainer: the rules hold for the values
   * rounded to float (an eps of 1e-50 is 0 there, a beta1 of 1 - 1e-9 is 1). */
  const float wd = (float)optimizer->weight_decay, b1 = (float)optimizer->beta1,
              b2 = (float)optimizer->beta2, eps = (float)optimizer->eps,
              clip = (float)optimizer->grad_clip;
  if (!(wd >= 0.0f && isfinite(wd)))
    bad(&v, "optimizer.weight_decay (%g) must be >= 0 and a finite float", optimizer->weight_decay);
  if (!(b1 >= 0.0f && b1 < 1.0f))
    bad(&v, "optimizer.beta1 (%.12g) must be in [0, 1), also rounded to a float", optimizer->beta1);
  if (!(b2 >= 0.0f && b2 < 1.0f))
    bad(&v, "optimizer.beta2 (%.12g) must be in [0, 1), also rounded to a float", optimizer->beta2);
  if (!(eps > 0.0f && isfinite(eps)))
    bad(&v, "optimizer.eps (%g) must be > 0 and a finite float (>= 1.4e-45)", optimizer->eps);
  if (!(clip >= 0.0f && isfinite(clip)))
    bad(&v, "optimizer.grad_clip (%g) must be >= 0 (0 disables clipping) and a finite float",
        optimizer->grad_clip);

  /* parallel: the mesh must divide the model, the batch and the sequence */
  DT__POSITIVE(&v, parallel, dp);
  DT__POSITIVE(&v, parallel, tp);
  DT__POSITIVE(&v, parallel, pp);
  DT__POSITIVE(&v, parallel, cp);
  if (parallel->zero_stage < 0 || parallel->zero_stage > 3)
    bad(&v, "parallel.zero_stage (%d) must be in 0..3", parallel->zero_stage);
  const int interleaved =
      !str_empty(parallel->schedule) && strcmp(parallel->schedule, "interleaved") == 0;
  if (str_empty(parallel->schedule) || (strcmp(parallel->schedule, "1f1b") != 0 &&
                                        strcmp(parallel->schedule, "gpipe") != 0 && !interleaved))
    bad(&v, "parallel.schedule must be 1f1b, gpipe or interleaved, got '%s'",
        parallel->schedule ? parallel->schedule : "");
  /* Interleaving: virtual_stages model chunks per stage (0: 2), pp x chunks virtual stages. */
  const int chunks = parallel->virtual_stages ? parallel->virtual_stages : interleaved ? 2 : 1;
  if (parallel->virtual_stages < 0 || parallel->virtual_stages > 16)
    bad(&v, "parallel.virtual_stages (%d) must be in 0..16 (0: 2 with interleaved, else 1)",
        parallel->virtual_stages);
  else if (chunks > 1 && !interleaved)
    bad(&v, "parallel.virtual_stages (%d) > 1 needs parallel.schedule interleaved",
        parallel->virtual_stages);
  else if (interleaved && (parallel->pp < 2 || chunks < 2))
    bad(&v,
        "parallel.schedule interleaved needs parallel.pp >= 2 (got %d) and "
        "parallel.virtual_stages >= 2 (got %d)",
        parallel->pp, chunks);
  if (interleaved && parallel->pp > 1 && parallel->dp > 0 && training->micro_batch > 0 &&
      training->batch % ((long long)training->micro_batch * parallel->dp) == 0 &&
      dt_jobspec_grad_accum(spec, parallel->dp) < 0)
    bad(&v,
        "parallel.schedule interleaved: the micro-batches per step (training.batch %d / "
        "(micro_batch %d x dp %d)) must be a multiple of parallel.pp (%d)",
        training->batch, training->micro_batch, parallel->dp, parallel->pp);
  if (parallel->tp > 0 && model->heads > 0 && model->heads % parallel->tp != 0)
    bad(&v, "model.heads (%d) must be divisible by parallel.tp (%d)", model->heads, parallel->tp);
  /* The vocabulary is padded to a multiple of 128 (llm.c) and split by rows across tp. */
  const int padded_vocab = (model->vocab + 127) / 128 * 128;
  if (parallel->tp > 0 && model->vocab > 0 && padded_vocab % parallel->tp != 0)
    bad(&v,
        "the padded vocabulary (model.vocab %d padded to %d) must be divisible by "
        "parallel.tp (%d)",
        model->vocab, padded_vocab, parallel->tp);
  const int stages = parallel->pp * chunks; /* virtual stages */
  if (parallel->pp > 0 && model->layers > 0 && model->layers < stages)
    bad(&v,
        "model.layers (%d) must be >= parallel.pp x parallel.virtual_stages (%d): every pipeline "
        "stage needs a layer",
        model->layers, stages);
  if (!str_empty(parallel->partition) && parallel->pp > 0 && model->layers >= stages) {
    int layers[64];
    char why[256];
    if (stages > (int)DT_ARRAY_SIZE(layers))
      bad(&v, "parallel.partition: at most %d stages can be listed", (int)DT_ARRAY_SIZE(layers));
    else if (dt_mesh_parse_partition(parallel->partition, stages, model->layers, layers, why,
                                     sizeof why) != 0)
      bad(&v, "%s", why);
  }
  if (parallel->cp > 1 && training->seq > 0 && training->seq % (2 * parallel->cp) != 0)
    bad(&v,
        "training.seq (%d) must be divisible by 2 x parallel.cp (%d): context parallelism "
        "splits each sequence into 2 x cp chunks",
        training->seq, parallel->cp);
  if (parallel->dp > 0 && training->micro_batch > 0 && training->batch > 0) {
    long long per_step = (long long)training->micro_batch * parallel->dp;
    if (training->batch % per_step != 0)
      bad(&v,
          "training.batch (%d) must be divisible by training.micro_batch (%d) x parallel.dp (%d) "
          "= %lld",
          training->batch, training->micro_batch, parallel->dp, per_step);
  }
  /* generated text runs in windows split as training sequences (distrain-train's --sample) */
  const long long text_unit = (parallel->cp > 1 ? 2LL * parallel->cp : 1LL) * parallel->tp;
  if (training->sample > 0 && parallel->sequence_parallel && text_unit > 0 &&
      training->seq % text_unit != 0)
    bad(&v,
        "training.sample (%d) with parallel.sequence_parallel needs training.seq (%d) divisible "
        "by %s%lld: each window of text is split as a training sequence",
        training->sample, training->seq,
        parallel->cp > 1 ? "2 x parallel.cp x parallel.tp = " : "parallel.tp = ", text_unit);
  if (parallel->dp > 0 && parallel->tp > 0 && parallel->pp > 0 && parallel->cp > 0) {
    dt_mesh_t mesh = {
        .pp = parallel->pp, .dp = parallel->dp, .cp = parallel->cp, .tp = parallel->tp};
    if (dt_mesh_world(&mesh) < 0)
      bad(&v, "parallel: world size pp (%d) x dp (%d) x cp (%d) x tp (%d) is too large",
          parallel->pp, parallel->dp, parallel->cp, parallel->tp);
  }

  /* checkpoint */
  if (str_empty(checkpoint->dir))
    bad(&v, "checkpoint.dir must name a directory (recovery restarts from it)");
  DT__NONNEG(&v, checkpoint, every, " (0 disables periodic checkpoints)");
  DT__NONNEG(&v, checkpoint, every_s, " (0: saves by steps only)");
  DT__NONNEG(&v, checkpoint, keep, " (0 keeps every checkpoint)");
  DT__NONNEG(&v, checkpoint, keep_every, " (0: no milestones beyond the newest keep)");
  if (checkpoint->keep_every > 0 &&
      (checkpoint->every <= 0 || checkpoint->keep_every % checkpoint->every != 0))
    bad(&v,
        "checkpoint.keep_every (%d) must be a multiple of checkpoint.every (%d): only the steps "
        "saved can be kept",
        checkpoint->keep_every, checkpoint->every);
  if (checkpoint->last_save_wait_s < -1 || checkpoint->last_save_wait_s > 86400)
    bad(&v,
        "checkpoint.last_save_wait_s (%d) must be in [1, 86400] s, or 0 (the default, 600) or "
        "-1 (a last save that finds its disk full fails the job at once)",
        checkpoint->last_save_wait_s);

  /* elastic */
  if (elastic->min_nodes < 1)
    bad(&v, "elastic.min_nodes (%d) must be >= 1", elastic->min_nodes);
  if (elastic->max_nodes < elastic->min_nodes)
    bad(&v, "elastic.max_nodes (%d) must be >= elastic.min_nodes (%d)", elastic->max_nodes,
        elastic->min_nodes);
  DT__NONNEG(&v, elastic, max_restarts, "");
  if (elastic->heartbeat_ms < 50)
    bad(&v, "elastic.heartbeat_ms (%d) must be >= 50", elastic->heartbeat_ms);
  if (elastic->hang_timeout_s < 0 || elastic->hang_timeout_s > 86400)
    bad(&v, "elastic.hang_timeout_s (%d) must be in [1, 86400] (0: the default, 30)",
        elastic->hang_timeout_s);
  if (!(elastic->spike_factor == 0.0 ||
        (elastic->spike_factor > 1.0 && elastic->spike_factor < 1e6)))
    bad(&v, "elastic.spike_factor (%g) must be > 1 (0: off)", elastic->spike_factor);
  if (!(elastic->grad_spike_factor == 0.0 ||
        (elastic->grad_spike_factor > 1.0 && elastic->grad_spike_factor < 1e6)))
    bad(&v, "elastic.grad_spike_factor (%g) must be > 1 (0: off)", elastic->grad_spike_factor);
  if (elastic->spike_skip < 0 || elastic->spike_skip > DT_SPIKE_SKIP_MAX)
    bad(&v, "elastic.spike_skip (%d) must be in [1, %d] (0: 1)", elastic->spike_skip,
        DT_SPIKE_SKIP_MAX);
  else if (elastic->spike_skip > 1 && elastic->spike_factor == 0.0 &&
           elastic->grad_spike_factor == 0.0)
    bad(&v, "elastic.spike_skip (%d) needs elastic.spike_factor or elastic.grad_spike_factor",
        elastic->spike_skip);
  if (elastic->straggler_drain_s < 0 || elastic->straggler_drain_s > 604800)
    bad(&v, "elastic.straggler_drain_s (%d) must be in [1, 604800] (0: off)",
        elastic->straggler_drain_s);
  if (elastic->priority < -1000 || elastic->priority > 1000)
    bad(&v, "elastic.priority (%d) must be in [-1000, 1000]", elastic->priority);
  if (!str_empty(elastic->bad_step) && strcmp(elastic->bad_step, "rollback") != 0 &&
      strcmp(elastic->bad_step, "skip") != 0)
    bad(&v, "elastic.bad_step must be rollback or skip, got '%s'", elastic->bad_step);

  return v.count ? DT_EINVAL : 0;
}

#undef DT__POSITIVE
#undef DT__NONNEG

int dt_jobspec_mesh(const spec_t *spec, dt_mesh_t *mesh)
{
  if (!spec || !spec->parallel)
    return DT_EINVAL;
  const Distrain__V1__ParallelSpec *p = spec->parallel;
  return dt_mesh_init(mesh, p->pp, p->dp, p->cp, p->tp);
}

int dt_jobspec_grad_accum(const spec_t *spec, int dp_size)
{
  if (!spec || !spec->training || dp_size < 1)
    return DT_EINVAL;
  const Distrain__V1__TrainingSpec *t = spec->training;
  if (t->batch < 1 || t->micro_batch < 1)
    return DT_EINVAL;
  long long per_step = (long long)t->micro_batch * dp_size;
  if (t->batch % per_step != 0)
    return DT_EINVAL;
  const long long accum = t->batch / per_step;
  /* The interleaved schedule runs micro-batches in rounds of pp. */
  const Distrain__V1__ParallelSpec *p = spec->parallel;
  if (p && p->pp > 1 && p->schedule && strcmp(p->schedule, "interleaved") == 0 && accum % p->pp)
    return DT_EINVAL;
  return (int)accum;
}

int dt_jobspec_place(const spec_t *spec, int min_dp, int max_dp, const int *node_devices,
                     int nnodes, dt_placement_t *pl, char *why, size_t whylen)
{
  dt_mesh_t mesh;
  memset(pl, 0, sizeof *pl);
  if (whylen > 0)
    why[0] = '\0';
  if (dt_jobspec_mesh(spec, &mesh) != 0) {
    snprintf(why, whylen, "invalid mesh");
    return DT_EINVAL;
  }
  for (int d = max_dp; d >= DT_MAX(min_dp, 1); d--) {
    if (dt_jobspec_grad_accum(spec, d) < 1)
      continue;
    char reason[256];
    mesh.dp = d;
    if (dt_mesh_place(&mesh, node_devices, nnodes, pl, reason, sizeof reason) == 0)
      return d;
    dt_placement_free(pl);
    if (whylen > 0 && !why[0])
      snprintf(why, whylen, "%s", reason);
  }
  if (whylen > 0 && !why[0])
    snprintf(why, whylen, "no dp in [%d, %d] divides the batch into whole micro-batches",
             DT_MAX(min_dp, 1), max_dp);
  return DT_EUNAVAIL;
}

/* ------------------------------------------------------------------------------------------ */
/* Number formatting                                                                           */
/* ------------------------------------------------------------------------------------------ */

/* The shortest %.Ng that strtod reads back as exactly x ("0.9", not "0.90000000000000002");
 * non-finite values as YAML writes them (.inf, -.inf, .nan), which the reader refuses. */
static void format_double(double x, char *buf, size_t n)
{
  if (isnan(x)) {
    snprintf(buf, n, ".nan");
    return;
  }
  if (isinf(x)) {
    snprintf(buf, n, x > 0 ? ".inf" : "-.inf");
    return;
  }
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(buf, n, "%.*g", prec, x);
    if (strtod(buf, NULL) == x)
      break;
  }
  /* "1" -> "1.0": the value reads as a float in any YAML reader, and to a person too. */
  if (!strpbrk(buf, ".eEn") && strlen(buf) + 3 <= n)
    strcat(buf, ".0");
}

/* ------------------------------------------------------------------------------------------ */
/* YAML writer                                                                                 */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
  char *buf;
  size_t len, cap;
} dt__sbuf_t;

/* libyaml output handler: appends to a growing NUL-terminated buffer. 1 ok, 0 failure. */
static int sbuf_write(void *data, unsigned char *bytes, size_t size)
{
  dt__sbuf_t *s = data;
  if (s->len + size + 1 > s->cap) {
    size_t cap = DT_MAX(s->cap * 2, s->len + size + 1);
    cap = DT_MAX(cap, (size_t)1024);
    char *nb = realloc(s->buf, cap);
    if (!nb)
      return 0;
    s->buf = nb;
    s->cap = cap;
  }
  memcpy(s->buf + s->len, bytes, size);
  s->len += size;
  s->buf[s->len] = '\0';
  return 1;
}

static int emit_scalar(yaml_emitter_t *e, const char *text, yaml_scalar_style_t style)
{
  yaml_event_t ev;
  if (!yaml_scalar_event_initialize(&ev, NULL, NULL, (yaml_char_t *)text, (int)strlen(text), 1, 1,
                                    style))
    return 0;
  return yaml_emitter_emit(e, &ev);
}

/* Emits message m as a block mapping, fields in .proto order. 1 ok, 0 libyaml failure. */
static int emit_message(yaml_emitter_t *e, const ProtobufCMessage *m)
{
  const ProtobufCMessageDescriptor *d = m->descriptor;
  yaml_event_t ev;
  if (!yaml_mapping_start_event_initialize(&ev, NULL, NULL, 1, YAML_BLOCK_MAPPING_STYLE) ||
      !yaml_emitter_emit(e, &ev))
    return 0;
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    const void *p = field_cptr(m, f);
    char num[64];
    if (f->label == PROTOBUF_C_LABEL_REPEATED)
      continue;
    if (f->type == PROTOBUF_C_TYPE_MESSAGE && !*(const ProtobufCMessage *const *)p)
      continue; /* an absent section: nothing to say about it */
    if (!emit_scalar(e, f->name, YAML_PLAIN_SCALAR_STYLE))
      return 0;
    int ok = 1;
    switch (f->type) {
    case PROTOBUF_C_TYPE_MESSAGE:
      ok = emit_message(e, *(const ProtobufCMessage *const *)p);
      break;
    case PROTOBUF_C_TYPE_INT32:
      snprintf(num, sizeof num, "%d", (int)*(const int32_t *)p);
      ok = emit_scalar(e, num, YAML_PLAIN_SCALAR_STYLE);
      break;
    case PROTOBUF_C_TYPE_DOUBLE:
      format_double(*(const double *)p, num, sizeof num);
      ok = emit_scalar(e, num, YAML_PLAIN_SCALAR_STYLE);
      break;
    case PROTOBUF_C_TYPE_FLOAT:
      format_double((double)*(const float *)p, num, sizeof num);
      ok = emit_scalar(e, num, YAML_PLAIN_SCALAR_STYLE);
      break;
    case PROTOBUF_C_TYPE_BOOL:
      ok = emit_scalar(e, *(const protobuf_c_boolean *)p ? "true" : "false",
                       YAML_PLAIN_SCALAR_STYLE);
      break;
    case PROTOBUF_C_TYPE_STRING: {
      /* Always quoted: "1f1b", "true" or "" stay strings for any YAML reader. */
      const char *s = *(char *const *)p;
      ok = emit_scalar(e, s ? s : "", YAML_DOUBLE_QUOTED_SCALAR_STYLE);
      break;
    }
    default:
      ok = emit_scalar(e, "", YAML_PLAIN_SCALAR_STYLE); /* unreachable for this .proto */
      break;
    }
    if (!ok)
      return 0;
  }
  return yaml_mapping_end_event_initialize(&ev) && yaml_emitter_emit(e, &ev);
}

int dt_jobspec_to_yaml(const spec_t *spec, char **out)
{
  yaml_emitter_t e;
  yaml_event_t ev;
  dt__sbuf_t s = {0};
  *out = NULL;
  if (!spec)
    return DT_EINVAL;
  if (!yaml_emitter_initialize(&e))
    return DT_ENOMEM;
  yaml_emitter_set_output(&e, sbuf_write, &s);
  yaml_emitter_set_unicode(&e, 1);
  yaml_emitter_set_width(&e, -1); /* never fold long strings across lines */
  yaml_emitter_set_indent(&e, 2);
  int ok =
      yaml_stream_start_event_initialize(&ev, YAML_UTF8_ENCODING) && yaml_emitter_emit(&e, &ev) &&
      yaml_document_start_event_initialize(&ev, NULL, NULL, NULL, 1) &&
      yaml_emitter_emit(&e, &ev) && emit_message(&e, &spec->base) &&
      yaml_document_end_event_initialize(&ev, 1) && yaml_emitter_emit(&e, &ev) &&
      yaml_stream_end_event_initialize(&ev) && yaml_emitter_emit(&e, &ev) && yaml_emitter_flush(&e);
  int ret = 0;
  if (!ok) {
    /* The emitter fails only on memory (our handler) or on events we got wrong. */
    ret = e.error == YAML_WRITER_ERROR || e.error == YAML_MEMORY_ERROR ? DT_ENOMEM : DT_EINTERNAL;
    free(s.buf);
  } else {
    *out = s.buf;
  }
  yaml_emitter_delete(&e);
  return ret;
}

/* ------------------------------------------------------------------------------------------ */
/* Trainer command line                                                                        */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
  char **v; /* (cap) NULL-terminated */
  int n, cap;
  bool oom;
} dt__argv_t;

static void av_push(dt__argv_t *a, const char *s)
{
  if (a->oom)
    return;
  if (a->n + 2 > a->cap) {
    int cap = a->cap ? a->cap * 2 : 64;
    char **nv = realloc(a->v, (size_t)cap * sizeof *nv);
    if (!nv) {
      a->oom = true;
      return;
    }
    a->v = nv;
    a->cap = cap;
    a->v[a->n] = NULL; /* keeps the array freeable by dt_argv_free if the next malloc fails */
  }
  size_t len = strlen(s);
  char *copy = malloc(len + 1);
  if (!copy) {
    a->oom = true;
    return;
  }
  memcpy(copy, s, len + 1);
  a->v[a->n++] = copy;
  a->v[a->n] = NULL;
}

/* Pushes "prefix" followed by s as one argument ("--resume=PATH"). */
static void av_concat(dt__argv_t *a, const char *prefix, const char *s)
{
  size_t lp = strlen(prefix), ls = strlen(s);
  char *tmp = malloc(lp + ls + 1);
  if (!tmp) {
    a->oom = true;
    return;
  }
  memcpy(tmp, prefix, lp);
  memcpy(tmp + lp, s, ls + 1);
  av_push(a, tmp);
  free(tmp);
}

static void av_int(dt__argv_t *a, const char *flag, long long x)
{
  char num[32];
  snprintf(num, sizeof num, "%lld", x);
  av_push(a, flag);
  av_push(a, num);
}

static void av_double(dt__argv_t *a, const char *flag, double x)
{
  char num[64];
  format_double(x, num, sizeof num);
  av_push(a, flag);
  av_push(a, num);
}

static void av_str(dt__argv_t *a, const char *flag, const char *s)
{
  av_push(a, flag);
  av_push(a, s);
}

void dt_argv_free(char **argv)
{
  if (!argv)
    return;
  for (char **p = argv; *p; p++)
    free(*p);
  free(argv);
}

int dt_jobspec_trainer_argv(const spec_t *spec, int dp_size, int resume, char ***argv_out,
                            int *argc_out)
{
  *argv_out = NULL;
  if (argc_out)
    *argc_out = 0;
  if (!spec || !spec->model || !spec->data || !spec->training || !spec->optimizer ||
      !spec->checkpoint)
    return DT_EINVAL;
  int accum = dt_jobspec_grad_accum(spec, dp_size);
  if (accum < 0)
    return accum;

  const Distrain__V1__ModelSpec *m = spec->model;
  const Distrain__V1__DataSpec *d = spec->data;
  const Distrain__V1__TrainingSpec *t = spec->training;
  const Distrain__V1__OptimizerSpec *o = spec->optimizer;
  const Distrain__V1__CheckpointSpec *ck = spec->checkpoint;
  dt__argv_t a = {0};
  const char *init = m->init ? m->init : "";

  /* Where the weights come from. On resume they come from checkpoint.dir; the seed is still
   * passed because it also seeds the data order. */
  if (strncmp(init, "seed:", 5) == 0)
    av_str(&a, "--init", init);
  else if (strncmp(init, "llmc:", 5) == 0 || strncmp(init, "hf:", 3) == 0 ||
           strncmp(init, "ckpt:", 5) == 0) {
    if (!resume)
      av_str(&a, "--init", init);
  } else if (*init && !resume) {
    av_concat(&a, "--resume=", init);
  }
  av_int(&a, "--layers", m->layers);
  av_int(&a, "--heads", m->heads);
  av_int(&a, "--channels", m->channels);
  av_int(&a, "--vocab", m->vocab);
  av_int(&a, "--max-seq", m->max_seq);

  av_str(&a, "--train", d->train ? d->train : "");
  if (!str_empty(d->val))
    av_str(&a, "--val", d->val);
  if (!str_empty(d->val_sets))
    av_str(&a, "--val-sets", d->val_sets);
  if (d->shuffle)
    av_push(&a, "--shuffle");
  if (!str_empty(d->vocab_file))
    av_str(&a, "--vocab-file", d->vocab_file);
  if (!str_empty(d->merge_file))
    av_str(&a, "--merge-file", d->merge_file);
  if (!str_empty(d->eval))
    av_str(&a, "--eval", d->eval);

  av_int(&a, "--batch", t->micro_batch);
  av_int(&a, "--seq", t->seq);
  av_int(&a, "--grad-accum", accum);
  av_int(&a, "--steps", t->steps);
  av_str(&a, "--device", str_empty(t->device) ? "auto" : t->device);
  if (!str_empty(t->precision) && strcmp(t->precision, "fp32") != 0)
    av_str(&a, "--precision", t->precision);
  if (!str_empty(t->attention) && strcmp(t->attention, "flash") != 0)
    av_str(&a, "--attention", t->attention);
  if (!str_empty(t->profile))
    av_str(&a, "--profile", t->profile);

  av_double(&a, "--lr", o->lr);
  av_int(&a, "--warmup", o->warmup);
  av_str(&a, "--schedule", o->schedule ? o->schedule : "");
  av_double(&a, "--min-lr-frac", o->min_lr_frac);
  if (o->schedule && strcmp(o->schedule, "wsd") == 0) /* 0: unset in a message (proto3) */
    av_double(&a, "--decay-frac", o->decay_frac > 0.0 ? o->decay_frac : 0.2);
  av_double(&a, "--weight-decay", o->weight_decay);
  av_double(&a, "--beta1", o->beta1);
  av_double(&a, "--beta2", o->beta2);
  av_double(&a, "--eps", o->eps);
  av_double(&a, "--grad-clip", o->grad_clip);

  if (t->val_every > 0) {
    av_int(&a, "--val-every", t->val_every);
    av_int(&a, "--val-batches", t->val_batches);
  }
  if (t->eval_every > 0)
    av_int(&a, "--eval-every", t->eval_every);
  if (t->peak_tflops > 0)
    av_double(&a, "--peak-tflops", t->peak_tflops);
  if (spec->elastic && spec->elastic->spike_factor > 0)
    av_double(&a, "--spike-factor", spec->elastic->spike_factor);
  if (spec->elastic && spec->elastic->grad_spike_factor > 0)
    av_double(&a, "--grad-spike-factor", spec->elastic->grad_spike_factor);
  if (spec->elastic && spec->elastic->spike_skip > 1)
    av_int(&a, "--spike-skip", spec->elastic->spike_skip);
  if (spec->elastic && !str_empty(spec->elastic->bad_step) &&
      strcmp(spec->elastic->bad_step, "skip") == 0) /* rollback: the trainer's default */
    av_str(&a, "--bad-step", spec->elastic->bad_step);
  if (!str_empty(ck->dir)) {
    av_str(&a, "--ckpt-dir", ck->dir);
    av_int(&a, "--save-every", ck->every);
    if (ck->every_s > 0)
      av_int(&a, "--save-every-s", ck->every_s);
    av_int(&a, "--keep", ck->keep);
    if (ck->keep_every > 0)
      av_int(&a, "--keep-every", ck->keep_every);
    if (ck->last_save_wait_s != 0) /* 0: the trainer's default */
      av_int(&a, "--last-save-wait", ck->last_save_wait_s > 0 ? ck->last_save_wait_s : 0);
  }
  if (t->threads > 0)
    av_int(&a, "--threads", t->threads);
  if (t->sample > 0)
    av_int(&a, "--sample", t->sample);
  if (!str_empty(t->prompt))
    av_str(&a, "--prompt", t->prompt);
  if (t->sample > 0 && t->sample_temp > 0)
    av_double(&a, "--sample-temp", t->sample_temp);
  if (t->sample > 0 && t->sample_top_k > 0)
    av_int(&a, "--sample-top-k", t->sample_top_k);
  if (t->sample > 0 && t->sample_top_p > 0 && t->sample_top_p < 1)
    av_double(&a, "--sample-top-p", t->sample_top_p);
  if (t->sample > 0 && t->sample_every > 0)
    av_int(&a, "--sample-every", t->sample_every);
  if (spec->parallel && spec->parallel->zero_stage > 0)
    av_int(&a, "--zero-stage", spec->parallel->zero_stage);
  if (spec->parallel && spec->parallel->pp > 1)
    av_str(&a, "--pp-schedule", spec->parallel->schedule ? spec->parallel->schedule : "");
  if (spec->parallel && spec->parallel->pp > 1 && spec->parallel->virtual_stages > 0)
    av_int(&a, "--pp-virtual", spec->parallel->virtual_stages);
  if (spec->parallel && spec->parallel->pp > 1 && !str_empty(spec->parallel->partition))
    av_str(&a, "--pp-partition", spec->parallel->partition);
  if (spec->parallel && !str_empty(spec->parallel->comm) && strcmp(spec->parallel->comm, "auto"))
    av_str(&a, "--comm", spec->parallel->comm);
  if (spec->parallel && spec->parallel->activation_checkpointing)
    av_push(&a, "--recompute");
  if (spec->parallel && spec->parallel->sequence_parallel)
    av_push(&a, "--sp");
  if (resume)
    av_push(&a, "--resume");

  if (a.oom) {
    dt_argv_free(a.v);
    return DT_ENOMEM;
  }
  *argv_out = a.v;
  if (argc_out)
    *argc_out = a.n;
  return 0;
}
