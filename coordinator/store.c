/* store.c — the coordinator's state in SQLite (<state-dir>/coordinator.db).
 *
 * Write-through: every change the loop makes is written before it is visible over RPC. Rows
 * hold protobuf-encoded messages (the wire contract doubles as the storage format) plus a
 * small binary plan per job. WAL mode with synchronous=NORMAL: a committed transaction
 * survives the process being killed (the case that matters: kill -9 and restart); a power
 * loss may drop the last transactions, never corrupt the database. */
#include "store.h"

#include <errno.h>
#include <fcntl.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"
#include "rpc.h"

/* How long a write waits for another process holding the database (an operator's sqlite3
 * shell) before it fails and the store is out of step (the coordinator rewrites it later). */
DT_PARAM(StoreBusyTimeoutMs, "STORE_BUSY_TIMEOUT_MS", 1000)

struct dt_coord_store {
  sqlite3 *db;
  sqlite3_stmt *put_node; /* prepared once: planning writes one node row per node */
  sqlite3_stmt *put_kv;   /* prepared once: a rendezvous puts one key per rank */
  int depth;              /* dt_coord_store_begin nesting */
  int in_txn;             /* the outermost begin opened a transaction */
  int unsynced;           /* a write failed: later ones fail at once until dt_coord_store_retry */
  int lock_fd;            /* <state-dir>/LOCK, held (flock) while open */
  char path[4200];
};

/* 2: nodes.drained and nodes.leaving. A version-1 database is upgraded in place when opened. */
#define STORE_SCHEMA_VERSION 2

static const char *const k_schema =
    "PRAGMA journal_mode=WAL;"
    "PRAGMA synchronous=NORMAL;"
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS nodes ("
    "  idx INTEGER PRIMARY KEY, id TEXT NOT NULL, info BLOB NOT NULL, state INTEGER NOT NULL,"
    "  assign_version INTEGER NOT NULL, job INTEGER NOT NULL, last_seen_wall INTEGER NOT NULL,"
    "  drained TEXT, leaving INTEGER NOT NULL DEFAULT 0);"
    "CREATE TABLE IF NOT EXISTS jobs ("
    "  id TEXT PRIMARY KEY, seq INTEGER NOT NULL, job BLOB NOT NULL, plan BLOB);"
    "CREATE TABLE IF NOT EXISTS metrics ("
    "  job TEXT NOT NULL, step INTEGER NOT NULL, m BLOB NOT NULL, PRIMARY KEY (job, step));"
    "CREATE TABLE IF NOT EXISTS kv ("
    "  job TEXT NOT NULL, generation INTEGER NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,"
    "  PRIMARY KEY (job, generation, key));"
    "CREATE TABLE IF NOT EXISTS ckpt_reports ("
    "  job TEXT NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL, report BLOB NOT NULL,"
    "  PRIMARY KEY (job, step, rank));";

static int sql_fail(dt_coord_store_t *s, const char *what)
{
  DT_ERROR(COORD, "%s: %s: %s", s->path, what, sqlite3_errmsg(s->db));
  s->unsynced = 1;
  return DT_EIO;
}

/* Every write starts here. Once one has failed the store is out of step with the coordinator's
 * memory, and each further write would stall the loop for the busy timeout only to fail too:
 * they fail at once until the coordinator rewrites its whole state (dt_coord_resync). */
#define WRITE_GATE(s)                                                                              \
  do {                                                                                             \
    if ((s)->unsynced)                                                                             \
      return DT_EIO;                                                                               \
  } while (0)

int dt_coord_store_unsynced(const dt_coord_store_t *s)
{
  return s->unsynced;
}

void dt_coord_store_retry(dt_coord_store_t *s)
{
  s->unsynced = 0;
}

int dt_coord_store_open(dt_coord_store_t **out, const char *state_dir)
{
  int rc = dt_mkdir_p(state_dir);
  if (rc != 0) {
    DT_ERROR(COORD, "%s: cannot create state directory: %s", state_dir, dt_strerror(rc));
    return rc;
  }
  dt_coord_store_t *s = calloc(1, sizeof *s);
  if (!s)
    return DT_ENOMEM;
  /* One coordinator per state directory: a second one would hand out the same job ids. The
   * lock goes with the process (kill -9 included), so a restart never finds it stale. */
  snprintf(s->path, sizeof s->path, "%s/LOCK", state_dir);
  s->lock_fd = open(s->path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (s->lock_fd < 0 || flock(s->lock_fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    char pid[32] = "?";
    if (s->lock_fd >= 0) {
      ssize_t n = pread(s->lock_fd, pid, sizeof pid - 1, 0);
      pid[n > 0 ? n : 0] = '\0';
      pid[strcspn(pid, "\n")] = '\0';
    }
    DT_ERROR(COORD, "%s: %s", s->path,
             e == EWOULDBLOCK ? "the state directory is in use by another coordinator"
                              : strerror(e));
    if (e == EWOULDBLOCK)
      DT_ERROR(COORD, "that coordinator's pid: %s; stop it, or give this one its own --state-dir",
               pid);
    if (s->lock_fd >= 0)
      close(s->lock_fd);
    free(s);
    return e == EWOULDBLOCK ? DT_EEXIST : dt_err_from_errno(e);
  }
  char pid[32];
  int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
  if (ftruncate(s->lock_fd, 0) != 0 || pwrite(s->lock_fd, pid, (size_t)n, 0) != n)
    DT_WARN(COORD, "%s: cannot record this coordinator's pid: %m", s->path);
  snprintf(s->path, sizeof s->path, "%s/coordinator.db", state_dir);
  if (sqlite3_open(s->path, &s->db) != SQLITE_OK) {
    rc = sql_fail(s, "cannot open database");
    goto fail;
  }
  /* Only another process (an operator's sqlite3 shell) can hold the database: wait for it a
   * little, not long enough to stall the loop's heartbeats. */
  sqlite3_busy_timeout(s->db, (int)DT_MIN(DT_MAX(dt_param_StoreBusyTimeoutMs(), 0), 60000));
  char *msg = NULL;
  if (sqlite3_exec(s->db, k_schema, NULL, NULL, &msg) != SQLITE_OK) {
    DT_ERROR(COORD, "%s: schema: %s", s->path, msg ? msg : "?");
    sqlite3_free(msg);
    rc = DT_EIO;
    goto fail;
  }
  /* A database from a different schema version is refused, not misread. */
  sqlite3_stmt *st;
  sqlite3_prepare_v2(s->db, "SELECT value FROM meta WHERE key='schema'", -1, &st, NULL);
  int have = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int(st, 0) : -1;
  sqlite3_finalize(st);
  if (have == -1) {
    char sql[128];
    snprintf(sql, sizeof sql, "INSERT INTO meta VALUES ('schema', %d)", STORE_SCHEMA_VERSION);
    sqlite3_exec(s->db, sql, NULL, NULL, NULL);
  } else if (have == 1) { /* a node's drained reason (NULL for none), whether it is leaving */
    if (sqlite3_exec(s->db,
                     "BEGIN; ALTER TABLE nodes ADD COLUMN drained TEXT;"
                     "ALTER TABLE nodes ADD COLUMN leaving INTEGER NOT NULL DEFAULT 0;"
                     "UPDATE meta SET value=2 WHERE key='schema'; COMMIT;",
                     NULL, NULL, &msg) != SQLITE_OK) {
      DT_ERROR(COORD, "%s: upgrading the state from schema version 1: %s", s->path,
               msg ? msg : "?");
      sqlite3_free(msg);
      sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
      rc = DT_EIO;
      goto fail;
    }
    DT_INFO(COORD, "%s: state upgraded from schema version 1 to %d", s->path, STORE_SCHEMA_VERSION);
  } else if (have != STORE_SCHEMA_VERSION) {
    DT_ERROR(COORD, "%s: state schema version %d, this coordinator expects %d", s->path, have,
             STORE_SCHEMA_VERSION);
    rc = DT_EFORMAT;
    goto fail;
  }
  *out = s;
  return 0;
fail:
  sqlite3_close(s->db);
  close(s->lock_fd);
  free(s);
  return rc;
}

void dt_coord_store_close(dt_coord_store_t *s)
{
  if (!s)
    return;
  sqlite3_finalize(s->put_node);
  sqlite3_finalize(s->put_kv);
  sqlite3_close(s->db);
  close(s->lock_fd);
  free(s);
}

/* Packs a protobuf-c message into a malloc'ed buffer. */
static uint8_t *pack(const ProtobufCMessage *m, size_t *len)
{
  *len = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(*len ? *len : 1);
  if (buf)
    protobuf_c_message_pack(m, buf);
  return buf;
}

/* Groups the writes between begin and commit in one transaction (one fsync of the WAL instead
 * of one per row): planning a 10,000-rank job touches 10,000 node rows. Nestable. */
void dt_coord_store_begin(dt_coord_store_t *s)
{
  if (s->depth++ == 0 && !s->unsynced) {
    s->in_txn = sqlite3_exec(s->db, "BEGIN", NULL, NULL, NULL) == SQLITE_OK;
    if (!s->in_txn)
      sql_fail(s, "begin");
  }
}

/* A transaction in which a write failed is rolled back whole: the coordinator's resync
 * rewrites all of it. */
int dt_coord_store_commit(dt_coord_store_t *s)
{
  if (--s->depth > 0)
    return s->unsynced ? DT_EIO : 0;
  if (s->in_txn) {
    s->in_txn = 0;
    if (!s->unsynced && sqlite3_exec(s->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
      sql_fail(s, "commit");
    if (s->unsynced)
      sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
  }
  return s->unsynced ? DT_EIO : 0;
}

int dt_coord_store_put_node(dt_coord_store_t *s, const dt_node_t *n)
{
  WRITE_GATE(s);
  size_t len;
  uint8_t *info = pack(&n->info->base, &len);
  if (!info)
    return DT_ENOMEM;
  int ret = 0;
  if (!s->put_node &&
      sqlite3_prepare_v2(s->db, "INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?,?,?,?,?)", -1,
                         &s->put_node, NULL) != SQLITE_OK) {
    s->put_node = NULL;
    free(info);
    return sql_fail(s, "prepare node");
  }
  sqlite3_stmt *st = s->put_node;
  sqlite3_bind_int(st, 1, n->index);
  sqlite3_bind_text(st, 2, n->id, -1, SQLITE_STATIC);
  sqlite3_bind_blob(st, 3, info, (int)len, SQLITE_STATIC);
  sqlite3_bind_int(st, 4, (int)n->state);
  sqlite3_bind_int64(st, 5, (sqlite3_int64)n->assign_version);
  sqlite3_bind_int(st, 6, n->job);
  sqlite3_bind_int64(st, 7, n->last_seen_wall_ms);
  if (n->drained)
    sqlite3_bind_text(st, 8, n->drained, -1, SQLITE_STATIC);
  else
    sqlite3_bind_null(st, 8);
  sqlite3_bind_int(st, 9, n->leaving);
  if (sqlite3_step(st) != SQLITE_DONE)
    ret = sql_fail(s, "write node");
  sqlite3_reset(st);
  sqlite3_clear_bindings(st); /* info, n->id and n->drained are not ours to keep */
  free(info);
  return ret;
}

/* plan blob: int32 world, dp, grad_accum, resume step, then (node, local_rank) per rank */
int dt_coord_store_put_job(dt_coord_store_t *s, const dt_job_t *j)
{
  WRITE_GATE(s);
  size_t len;
  uint8_t *blob = pack(&j->job->base, &len);
  size_t plan_len = (size_t)(4 + 2 * j->world) * sizeof(int32_t);
  int32_t *plan = malloc(plan_len);
  if (!blob || !plan) {
    free(blob);
    free(plan);
    return DT_ENOMEM;
  }
  plan[0] = j->world, plan[1] = j->dp, plan[2] = j->grad_accum,
  plan[3] = (int32_t)DT_MIN(j->resume_step, INT32_MAX);
  for (int r = 0; r < j->world; r++) {
    plan[4 + 2 * r] = j->ranks[r].node;
    plan[5 + 2 * r] = j->ranks[r].local_rank;
  }
  int64_t seq = 0;
  sscanf(j->id, "job-%lld", (long long *)&seq);
  sqlite3_stmt *st;
  int ret = 0;
  if (sqlite3_prepare_v2(s->db, "INSERT OR REPLACE INTO jobs VALUES (?,?,?,?)", -1, &st, NULL) !=
      SQLITE_OK) {
    free(blob);
    free(plan);
    return sql_fail(s, "prepare job");
  }
  sqlite3_bind_text(st, 1, j->id, -1, SQLITE_STATIC);
  sqlite3_bind_int64(st, 2, seq);
  sqlite3_bind_blob(st, 3, blob, (int)len, SQLITE_STATIC);
  sqlite3_bind_blob(st, 4, plan, (int)plan_len, SQLITE_STATIC);
  if (sqlite3_step(st) != SQLITE_DONE)
    ret = sql_fail(s, "write job");
  sqlite3_finalize(st);
  free(blob);
  free(plan);
  return ret;
}

int dt_coord_store_put_metrics(dt_coord_store_t *s, const char *job,
                               Distrain__V1__StepMetrics *const *m, size_t n)
{
  WRITE_GATE(s);
  if (n == 0)
    return 0;
  sqlite3_stmt *st;
  int ret = 0;
  if (sqlite3_prepare_v2(s->db, "INSERT OR REPLACE INTO metrics VALUES (?,?,?)", -1, &st, NULL) !=
      SQLITE_OK)
    return sql_fail(s, "prepare metrics");
  dt_coord_store_begin(s);
  for (size_t i = 0; i < n && ret == 0; i++) {
    size_t len;
    uint8_t *blob = pack(&m[i]->base, &len);
    if (!blob) {
      ret = DT_ENOMEM;
      break;
    }
    sqlite3_bind_text(st, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 2, m[i]->step);
    sqlite3_bind_blob(st, 3, blob, (int)len, SQLITE_TRANSIENT);
    if (sqlite3_step(st) != SQLITE_DONE)
      ret = sql_fail(s, "write metrics");
    sqlite3_reset(st);
    free(blob);
  }
  sqlite3_finalize(st);
  int rc = dt_coord_store_commit(s);
  return ret ? ret : rc;
}

static int load_nodes(dt_coord_store_t *s, dt_coord_state_t *c, double now_ms)
{
  sqlite3_stmt *st;
  if (sqlite3_prepare_v2(s->db,
                         "SELECT idx, id, info, state, assign_version, job, "
                         "last_seen_wall, drained, leaving FROM nodes ORDER BY idx",
                         -1, &st, NULL) != SQLITE_OK)
    return sql_fail(s, "read nodes");
  int ret = 0;
  while (ret == 0 && sqlite3_step(st) == SQLITE_ROW) {
    int idx = sqlite3_column_int(st, 0);
    dt_node_t *n = calloc(1, sizeof *n);
    if (!n) {
      ret = DT_ENOMEM;
      break;
    }
    n->index = idx;
    snprintf(n->id, sizeof n->id, "%s", (const char *)sqlite3_column_text(st, 1));
    n->info = distrain__v1__node_info__unpack(NULL, (size_t)sqlite3_column_bytes(st, 2),
                                              sqlite3_column_blob(st, 2));
    n->state = (Distrain__V1__NodeState)sqlite3_column_int(st, 3);
    n->assign_version = (uint64_t)sqlite3_column_int64(st, 4);
    n->job = sqlite3_column_int(st, 5);
    n->last_seen_wall_ms = sqlite3_column_int64(st, 6);
    n->leaving = sqlite3_column_int(st, 8); /* its agent was stopping: no work until it is back */
    if (sqlite3_column_type(st, 7) != SQLITE_NULL &&
        !(n->drained = strdup((const char *)sqlite3_column_text(st, 7)))) {
      dt_node_free(n);
      ret = DT_ENOMEM;
      break;
    }
    /* The agents get a full dead-interval to reach the restarted coordinator. */
    n->last_seen_ms = now_ms;
    if (!n->info || idx < 0) {
      dt_node_free(n);
      ret = sql_fail(s, "corrupt node row");
      break;
    }
    dt_pb_sanitize_utf8(&n->info->base); /* a row a version before the check wrote */
    if ((ret = dt_coord_add_node(c, n)) != 0)
      dt_node_free(n);
  }
  sqlite3_finalize(st);
  return ret;
}

static int load_metrics(dt_coord_store_t *s, dt_job_t *j)
{
  sqlite3_stmt *st;
  if (sqlite3_prepare_v2(s->db, "SELECT m FROM metrics WHERE job=? ORDER BY step", -1, &st, NULL) !=
      SQLITE_OK)
    return sql_fail(s, "read metrics");
  sqlite3_bind_text(st, 1, j->id, -1, SQLITE_STATIC);
  int ret = 0;
  while (ret == 0 && sqlite3_step(st) == SQLITE_ROW) {
    Distrain__V1__StepMetrics *m = distrain__v1__step_metrics__unpack(
        NULL, (size_t)sqlite3_column_bytes(st, 0), sqlite3_column_blob(st, 0));
    if (!m) {
      ret = sql_fail(s, "corrupt metrics row");
      break;
    }
    if (j->n_metrics == j->cap_metrics) {
      size_t cap = j->cap_metrics ? j->cap_metrics * 2 : 256;
      void *grown = realloc(j->metrics, cap * sizeof *j->metrics);
      if (!grown) {
        distrain__v1__step_metrics__free_unpacked(m, NULL);
        ret = DT_ENOMEM;
        break;
      }
      j->metrics = grown, j->cap_metrics = cap;
    }
    j->metrics[j->n_metrics++] = m;
  }
  sqlite3_finalize(st);
  return ret;
}

static int load_jobs(dt_coord_store_t *s, dt_coord_state_t *c)
{
  sqlite3_stmt *st;
  if (sqlite3_prepare_v2(s->db, "SELECT id, seq, job, plan FROM jobs ORDER BY seq", -1, &st,
                         NULL) != SQLITE_OK)
    return sql_fail(s, "read jobs");
  int ret = 0;
  while (ret == 0 && sqlite3_step(st) == SQLITE_ROW) {
    dt_job_t *j = calloc(1, sizeof *j);
    if (!j) {
      ret = DT_ENOMEM;
      break;
    }
    snprintf(j->id, sizeof j->id, "%s", (const char *)sqlite3_column_text(st, 0));
    dt_job_metrics_init(j);
    c->next_job = DT_MAX(c->next_job, (uint64_t)sqlite3_column_int64(st, 1) + 1);
    j->job = distrain__v1__job__unpack(NULL, (size_t)sqlite3_column_bytes(st, 2),
                                       sqlite3_column_blob(st, 2));
    const int32_t *plan = sqlite3_column_blob(st, 3);
    int plan_bytes = sqlite3_column_bytes(st, 3);
    if (!j->job || plan_bytes < 16 || plan_bytes != (4 + 2 * plan[0]) * 4) {
      free(j);
      ret = sql_fail(s, "corrupt job row");
      break;
    }
    dt_pb_sanitize_utf8(&j->job->base);
    j->world = plan[0], j->dp = plan[1], j->grad_accum = plan[2], j->resume_step = plan[3];
    j->ranks = calloc((size_t)DT_MAX(j->world, 1), sizeof *j->ranks);
    for (int r = 0; j->ranks && r < j->world; r++) {
      j->ranks[r].node = plan[4 + 2 * r];
      j->ranks[r].local_rank = plan[5 + 2 * r];
    }
    dt_coord_remember_ranks(j);
    if ((ret = dt_coord_add_job(c, j)) != 0) {
      dt_job_free(j);
      break;
    }
    ret = load_metrics(s, j);
  }
  sqlite3_finalize(st);
  return ret;
}

int dt_coord_store_put_kv(dt_coord_store_t *s, const char *job, uint64_t gen, const char *key,
                          const uint8_t *val, size_t len)
{
  WRITE_GATE(s);
  if (!s->put_kv && sqlite3_prepare_v2(s->db, "INSERT OR REPLACE INTO kv VALUES (?,?,?,?)", -1,
                                       &s->put_kv, NULL) != SQLITE_OK)
    return sql_fail(s, "prepare kv");
  sqlite3_bind_text(s->put_kv, 1, job, -1, SQLITE_STATIC);
  sqlite3_bind_int64(s->put_kv, 2, (int64_t)gen);
  sqlite3_bind_text(s->put_kv, 3, key, -1, SQLITE_STATIC);
  sqlite3_bind_blob(s->put_kv, 4, len ? val : (const void *)"", (int)len, SQLITE_STATIC);
  int ret = sqlite3_step(s->put_kv) == SQLITE_DONE ? 0 : sql_fail(s, "write kv");
  sqlite3_reset(s->put_kv);
  return ret;
}

int dt_coord_store_expire_kv(dt_coord_store_t *s, const char *job, uint64_t gen)
{
  WRITE_GATE(s);
  sqlite3_stmt *st;
  /* Generations are small positive integers; UINT64_MAX (every generation) is not an int64. */
  const char *sql = gen > INT64_MAX ? "DELETE FROM kv WHERE job=?"
                                    : "DELETE FROM kv WHERE job=? AND generation<?";
  if (sqlite3_prepare_v2(s->db, sql, -1, &st, NULL) != SQLITE_OK)
    return sql_fail(s, "prepare kv expiry");
  sqlite3_bind_text(st, 1, job, -1, SQLITE_STATIC);
  if (gen <= INT64_MAX)
    sqlite3_bind_int64(st, 2, (int64_t)gen);
  int ret = sqlite3_step(st) == SQLITE_DONE ? 0 : sql_fail(s, "expire kv");
  sqlite3_finalize(st);
  return ret;
}

/* The current generation's keys of every job still in progress; the rest is deleted. */
static int load_kv(dt_coord_store_t *s, const dt_coord_state_t *c,
                   const dt_coord_store_loaders_t *loaders)
{
  sqlite3_stmt *st;
  int ret = 0;
  for (size_t i = 0; i < c->n_jobs && ret == 0; i++) {
    const dt_job_t *j = c->jobs[i];
    ret = dt_coord_store_expire_kv(
        s, j->id, dt_coord_state_terminal(j->job->state) ? UINT64_MAX : j->job->generation);
  }
  if (ret != 0)
    return ret;
  if (sqlite3_prepare_v2(s->db, "SELECT job, generation, key, value FROM kv", -1, &st, NULL) !=
      SQLITE_OK)
    return sql_fail(s, "read kv");
  size_t n = 0;
  while (ret == 0 && sqlite3_step(st) == SQLITE_ROW) {
    const char *job = (const char *)sqlite3_column_text(st, 0);
    uint64_t gen = (uint64_t)sqlite3_column_int64(st, 1);
    const char *key = (const char *)sqlite3_column_text(st, 2);
    const uint8_t *val = sqlite3_column_blob(st, 3);
    size_t len = (size_t)sqlite3_column_bytes(st, 3);
    ret = loaders->kv(loaders->ud, job, gen, key, val ? val : (const uint8_t *)"", len);
    n++;
  }
  sqlite3_finalize(st);
  if (n)
    DT_INFO(COORD, "%s: %zu rendezvous keys of live generations restored", s->path, n);
  return ret;
}

int dt_coord_store_put_ckpt_report(dt_coord_store_t *s, const char *job,
                                   const Distrain__V1__ReportCheckpointRequest *r)
{
  WRITE_GATE(s);
  sqlite3_stmt *st;
  size_t len;
  uint8_t *buf = pack(&r->base, &len);
  if (!buf)
    return DT_ENOMEM;
  if (sqlite3_prepare_v2(s->db, "INSERT OR REPLACE INTO ckpt_reports VALUES (?,?,?,?)", -1, &st,
                         NULL) != SQLITE_OK) {
    free(buf);
    return sql_fail(s, "prepare checkpoint report");
  }
  sqlite3_bind_text(st, 1, job, -1, SQLITE_STATIC);
  sqlite3_bind_int64(st, 2, r->step);
  sqlite3_bind_int(st, 3, r->rank);
  sqlite3_bind_blob(st, 4, buf, (int)len, SQLITE_STATIC);
  int ret = sqlite3_step(st) == SQLITE_DONE ? 0 : sql_fail(s, "write checkpoint report");
  sqlite3_finalize(st);
  free(buf);
  return ret;
}

/* Deletes the rows of table for job's steps [from_step, to_step]. */
static int delete_steps(dt_coord_store_t *s, const char *table, const char *job, int64_t from_step,
                        int64_t to_step)
{
  WRITE_GATE(s);
  char sql[128];
  snprintf(sql, sizeof sql, "DELETE FROM %s WHERE job=? AND step BETWEEN ? AND ?", table);
  sqlite3_stmt *st;
  if (sqlite3_prepare_v2(s->db, sql, -1, &st, NULL) != SQLITE_OK)
    return sql_fail(s, sql);
  sqlite3_bind_text(st, 1, job, -1, SQLITE_STATIC);
  sqlite3_bind_int64(st, 2, from_step);
  sqlite3_bind_int64(st, 3, to_step);
  int ret = sqlite3_step(st) == SQLITE_DONE ? 0 : sql_fail(s, sql);
  sqlite3_finalize(st);
  return ret;
}

int dt_coord_store_drop_ckpt_reports(dt_coord_store_t *s, const char *job, int64_t from_step,
                                     int64_t to_step)
{
  return delete_steps(s, "ckpt_reports", job, from_step, to_step);
}

int dt_coord_store_drop_metrics(dt_coord_store_t *s, const char *job, int64_t from_step)
{
  return delete_steps(s, "metrics", job, from_step, INT64_MAX);
}

/* The shard reports of checkpoints not yet committed: a restart keeps what the writers
 * reported before it (they do not report again). */
static int load_ckpt_reports(dt_coord_store_t *s, const dt_coord_state_t *c,
                             const dt_coord_store_loaders_t *loaders)
{
  sqlite3_stmt *st;
  if (sqlite3_prepare_v2(s->db, "SELECT job, report FROM ckpt_reports ORDER BY job, step, rank", -1,
                         &st, NULL) != SQLITE_OK)
    return sql_fail(s, "read checkpoint reports");
  int ret = 0;
  while (ret == 0 && sqlite3_step(st) == SQLITE_ROW) {
    dt_job_t *j = dt_coord_job_by_id(c, (const char *)sqlite3_column_text(st, 0));
    Distrain__V1__ReportCheckpointRequest *r = distrain__v1__report_checkpoint_request__unpack(
        NULL, (size_t)sqlite3_column_bytes(st, 1), sqlite3_column_blob(st, 1));
    if (!r) {
      ret = sql_fail(s, "corrupt checkpoint report row");
      break;
    }
    if (j && !dt_coord_state_terminal(j->job->state))
      ret = loaders->ckpt_report(loaders->ud, j, r);
    distrain__v1__report_checkpoint_request__free_unpacked(r, NULL);
  }
  sqlite3_finalize(st);
  return ret;
}

int dt_coord_store_load(dt_coord_store_t *s, dt_coord_state_t *st, double now_ms,
                        const dt_coord_store_loaders_t *loaders)
{
  DT_CHECK(load_nodes(s, st, now_ms));
  DT_CHECK(load_jobs(s, st));
  DT_CHECK(load_kv(s, st, loaders));
  return load_ckpt_reports(s, st, loaders);
}
