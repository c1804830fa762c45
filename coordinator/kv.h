/* kv.h — the rendezvous key-value store the trainers meet in (KvPut, KvGet).
 *
 * Keys are scoped by (job, generation): a generation's trainers never see an older one's.
 * A get for a key not yet put is held until the put or its timeout. Writes go through to
 * the caller's persistence (the coordinator's store) before they are visible, through the
 * callbacks given at creation, so this file knows no database. */
#ifndef DT_COORD_KV_H
#define DT_COORD_KV_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "rpc.h"

typedef struct dt_coord_kv dt_coord_kv_t;

/* Where keys are written through: put before a key is visible (non-zero: refused, nothing
 * changes), expire when a job's older generations are dropped. */
typedef struct {
  int (*put)(void *ud, const char *job, uint64_t gen, const char *key, const uint8_t *val,
             size_t len);
  void (*expire)(void *ud, const char *job, uint64_t gen);
  void *ud;
} dt_coord_kv_persist_t;

/* persist: NULL for memory only (copied). */
dt_coord_kv_t *dt_coord_kv_create(const dt_coord_kv_persist_t *persist);
void dt_coord_kv_destroy(dt_coord_kv_t *kv);
/* Stores a value for (job, generation, key), writes it through, and answers the calls waiting
 * on it. Its persistence's error if that refused it (nothing changed then). */
int dt_coord_kv_put(dt_coord_kv_t *kv, const char *job, uint64_t gen, const char *key,
                    const uint8_t *val, size_t len);
/* The same without writing it through (loading it back). */
int dt_coord_kv_restore(dt_coord_kv_t *kv, const char *job, uint64_t gen, const char *key,
                        const uint8_t *val, size_t len);
/* Answers call now if the key exists, else holds it until a put or timeout_ms. */
void dt_coord_kv_get(dt_coord_kv_t *kv, uv_loop_t *loop, dt_rpc_call_t *call, const char *job,
                     uint64_t gen, const char *key, uint32_t timeout_ms);
/* Drops every key of a job older than gen (UINT64_MAX: all of them; the job ended) here and
 * in the persistence; waiting calls for them fail as stale. */
void dt_coord_kv_expire(dt_coord_kv_t *kv, const char *job, uint64_t gen);

#endif
