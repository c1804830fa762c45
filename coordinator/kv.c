/* kv.c — see kv.h: per job, per generation, in memory.
 *
 * Trainers exchange communicator ids and addresses through it: rank 0 puts, the others get
 * with a timeout (the call is held until the key appears). Keys are scoped by (job,
 * generation): a new generation never sees an old one's keys, and calls still waiting on an
 * old generation are failed FAILED_PRECONDITION when the generation moves on. Keys are written
 * through (the coordinator's SQLite store) before a put is answered, so trainers in the
 * middle of a rendezvous ride out a coordinator restart (they retry their calls; the restarted
 * coordinator reloads the live generations' keys). */
#include "kv.h"

#include <stdlib.h>
#include <string.h>

#include "distrain.pb-c.h"
#include "dt_error.h"
#include "dt_log.h"

typedef struct kv_entry {
  struct kv_entry *next;
  char *job, *key;
  uint64_t gen;
  uint8_t *val;
  size_t len;
} kv_entry_t;

typedef struct kv_waiter {
  struct kv_waiter *next, **pprev;
  dt_coord_kv_t *kv;
  dt_rpc_call_t *call;
  char *job, *key;
  uint64_t gen;
  uv_timer_t timer;
} kv_waiter_t;

struct dt_coord_kv {
  kv_entry_t *entries;
  kv_waiter_t *waiters;
  dt_coord_kv_persist_t persist; /* all NULL: memory only */
};

dt_coord_kv_t *dt_coord_kv_create(const dt_coord_kv_persist_t *persist)
{
  dt_coord_kv_t *kv = calloc(1, sizeof *kv);
  if (kv && persist)
    kv->persist = *persist;
  return kv;
}

static void entry_free(kv_entry_t *e)
{
  free(e->job);
  free(e->key);
  free(e->val);
  free(e);
}

static void waiter_closed(uv_handle_t *h)
{
  kv_waiter_t *w = h->data;
  free(w->job);
  free(w->key);
  free(w);
}

/* Unlinks a waiter and releases it (the call must already be answered or cancelled). */
static void waiter_done(kv_waiter_t *w)
{
  *w->pprev = w->next;
  if (w->next)
    w->next->pprev = w->pprev;
  uv_timer_stop(&w->timer);
  uv_close((uv_handle_t *)&w->timer, waiter_closed);
}

void dt_coord_kv_destroy(dt_coord_kv_t *kv)
{
  if (!kv)
    return;
  while (kv->waiters) {
    kv_waiter_t *w = kv->waiters;
    dt_rpc_call_on_cancel(w->call, NULL, NULL);
    dt_rpc_call_fail(w->call, DT_RPC_UNAVAILABLE, "coordinator shutting down");
    waiter_done(w);
  }
  for (kv_entry_t *e = kv->entries, *next; e; e = next) {
    next = e->next;
    entry_free(e);
  }
  free(kv);
}

static kv_entry_t *find(dt_coord_kv_t *kv, const char *job, uint64_t gen, const char *key)
{
  for (kv_entry_t *e = kv->entries; e; e = e->next)
    if (e->gen == gen && strcmp(e->key, key) == 0 && strcmp(e->job, job) == 0)
      return e;
  return NULL;
}

static void reply_value(dt_rpc_call_t *call, const kv_entry_t *e)
{
  Distrain__V1__KvGetResponse resp = DISTRAIN__V1__KV_GET_RESPONSE__INIT;
  resp.value.data = e->val;
  resp.value.len = e->len;
  dt_rpc_call_reply(call, &resp.base);
}

int dt_coord_kv_put(dt_coord_kv_t *kv, const char *job, uint64_t gen, const char *key,
                    const uint8_t *val, size_t len)
{
  if (kv->persist.put)
    DT_CHECK(kv->persist.put(kv->persist.ud, job, gen, key, val, len));
  return dt_coord_kv_restore(kv, job, gen, key, val, len);
}

int dt_coord_kv_restore(dt_coord_kv_t *kv, const char *job, uint64_t gen, const char *key,
                        const uint8_t *val, size_t len)
{
  kv_entry_t *e = find(kv, job, gen, key);
  if (!e) {
    e = calloc(1, sizeof *e);
    if (!e || !(e->job = strdup(job)) || !(e->key = strdup(key))) {
      if (e)
        entry_free(e);
      return DT_ENOMEM;
    }
    e->gen = gen;
    e->next = kv->entries;
    kv->entries = e;
  }
  uint8_t *copy = malloc(len ? len : 1);
  if (!copy)
    return DT_ENOMEM;
  if (len) /* an empty value may come as NULL, and memcpy(p, NULL, 0) is undefined */
    memcpy(copy, val, len);
  free(e->val);
  e->val = copy;
  e->len = len;
  for (kv_waiter_t *w = kv->waiters, *next; w; w = next) {
    next = w->next;
    if (w->gen == gen && strcmp(w->key, key) == 0 && strcmp(w->job, job) == 0) {
      dt_rpc_call_on_cancel(w->call, NULL, NULL);
      reply_value(w->call, e);
      waiter_done(w);
    }
  }
  return 0;
}

static void on_waiter_timeout(uv_timer_t *t)
{
  kv_waiter_t *w = t->data;
  dt_rpc_call_on_cancel(w->call, NULL, NULL);
  dt_rpc_call_fail(w->call, DT_RPC_DEADLINE_EXCEEDED,
                   "key '%s' of job %s generation %llu was not set in time", w->key, w->job,
                   (unsigned long long)w->gen);
  waiter_done(w);
}

static void on_waiter_cancel(dt_rpc_call_t *call, void *ud)
{
  (void)call;
  waiter_done(ud);
}

void dt_coord_kv_get(dt_coord_kv_t *kv, uv_loop_t *loop, dt_rpc_call_t *call, const char *job,
                     uint64_t gen, const char *key, uint32_t timeout_ms)
{
  kv_entry_t *e = find(kv, job, gen, key);
  if (e) {
    reply_value(call, e);
    return;
  }
  if (timeout_ms == 0) {
    dt_rpc_call_fail(call, DT_RPC_NOT_FOUND, "key '%s' is not set", key);
    return;
  }
  kv_waiter_t *w = calloc(1, sizeof *w);
  if (!w || !(w->job = strdup(job)) || !(w->key = strdup(key))) {
    if (w) {
      free(w->job);
      free(w);
    }
    dt_rpc_call_fail(call, DT_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  w->kv = kv;
  w->call = call;
  w->gen = gen;
  w->next = kv->waiters;
  w->pprev = &kv->waiters;
  if (kv->waiters)
    kv->waiters->pprev = &w->next;
  kv->waiters = w;
  uv_timer_init(loop, &w->timer);
  w->timer.data = w;
  uv_timer_start(&w->timer, on_waiter_timeout, timeout_ms, 0);
  dt_rpc_call_on_cancel(call, on_waiter_cancel, w);
}

void dt_coord_kv_expire(dt_coord_kv_t *kv, const char *job, uint64_t gen)
{
  if (kv->persist.expire)
    kv->persist.expire(kv->persist.ud, job, gen);
  for (kv_entry_t **pp = &kv->entries; *pp;) {
    kv_entry_t *e = *pp;
    if (e->gen < gen && strcmp(e->job, job) == 0) {
      *pp = e->next;
      entry_free(e);
    } else {
      pp = &e->next;
    }
  }
  for (kv_waiter_t *w = kv->waiters, *next; w; w = next) {
    next = w->next;
    if (w->gen < gen && strcmp(w->job, job) == 0) {
      dt_rpc_call_on_cancel(w->call, NULL, NULL);
      dt_rpc_call_fail(w->call, DT_RPC_FAILED_PRECONDITION,
                       "generation %llu of job %s is stale (current %llu)",
                       (unsigned long long)w->gen, job, (unsigned long long)gen);
      waiter_done(w);
    }
  }
}
