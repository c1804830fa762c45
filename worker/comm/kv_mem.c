/* kv_mem.c — a dt_kv_t in this process's memory (see comm.h), for communicators whose ranks are
 * threads of one process (tests, single-node tools). A list under one mutex: rendezvous puts a
 * few keys per rank, so a linear search is plenty. get sleeps on a condition variable that
 * every put broadcasts, against the monotonic clock. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm.h"
#include "dt_error.h"

typedef struct kv_entry {
  struct kv_entry *next;
  char *key;
  void *val;
  size_t len;
} kv_entry_t;

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  kv_entry_t *head;
} kv_mem_t;

static kv_entry_t *find(kv_mem_t *km, const char *key)
{
  for (kv_entry_t *e = km->head; e; e = e->next)
    if (strcmp(e->key, key) == 0)
      return e;
  return NULL;
}

static int kv_mem_put(void *ud, const char *key, const void *val, size_t len)
{
  kv_mem_t *km = ud;
  if (!key || (len && !val))
    return DT_EINVAL;
  void *copy = malloc(len ? len : 1);
  if (!copy)
    return DT_ENOMEM;
  if (len)
    memcpy(copy, val, len);
  pthread_mutex_lock(&km->mu);
  kv_entry_t *e = find(km, key);
  if (!e) {
    e = calloc(1, sizeof *e);
    if (e && !(e->key = strdup(key))) {
      free(e);
      e = NULL;
    }
    if (!e) {
      pthread_mutex_unlock(&km->mu);
      free(copy);
      return DT_ENOMEM;
    }
    e->next = km->head;
    km->head = e;
  }
  free(e->val);
  e->val = copy;
  e->len = len;
  pthread_cond_broadcast(&km->cv);
  pthread_mutex_unlock(&km->mu);
  return 0;
}

static int kv_mem_get(void *ud, const char *key, void **val, size_t *len, int timeout_ms)
{
  kv_mem_t *km = ud;
  if (!key || !val || !len || timeout_ms < 0)
    return DT_EINVAL;
  struct timespec deadline;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec++;
    deadline.tv_nsec -= 1000000000L;
  }
  int rc = 0;
  pthread_mutex_lock(&km->mu);
  kv_entry_t *e;
  while (!(e = find(km, key))) {
    int w = pthread_cond_timedwait(&km->cv, &km->mu, &deadline);
    if (w == ETIMEDOUT && !(e = find(km, key))) {
      rc = DT_ETIMEDOUT;
      break;
    }
  }
  if (e) {
    void *copy = malloc(e->len ? e->len : 1);
    if (copy) {
      if (e->len)
        memcpy(copy, e->val, e->len);
      *val = copy;
      *len = e->len;
    } else {
      rc = DT_ENOMEM;
    }
  }
  pthread_mutex_unlock(&km->mu);
  return rc;
}

int dt_kv_mem_create(dt_kv_t *kv)
{
  if (!kv)
    return DT_EINVAL;
  kv_mem_t *km = calloc(1, sizeof *km);
  if (!km)
    return DT_ENOMEM;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&km->mu, NULL);
  pthread_cond_init(&km->cv, &ca);
  pthread_condattr_destroy(&ca);
  *kv = (dt_kv_t){.put = kv_mem_put, .get = kv_mem_get, .ud = km};
  return 0;
}

void dt_kv_mem_destroy(dt_kv_t *kv)
{
  if (!kv || !kv->ud)
    return;
  kv_mem_t *km = kv->ud;
  for (kv_entry_t *e = km->head, *next; e; e = next) {
    next = e->next;
    free(e->key);
    free(e->val);
    free(e);
  }
  pthread_cond_destroy(&km->cv);
  pthread_mutex_destroy(&km->mu);
  free(km);
  kv->ud = NULL;
}
