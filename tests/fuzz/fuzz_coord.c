/* fuzz_coord.c — the coordinator, fed a sequence of calls as agents, trainers and distrainctl
 * could send them (authenticated, but from a buggy, old or new version): a real coordinator
 * (dt_coord_start: its SQLite store, key-value store, job state machine, log relay) behind the
 * fake server of fake_rpc_server.c, which checks every answer. An input is a list of records
 *
 *   op (1 byte), length (2 bytes, little-endian), payload (length bytes)
 *
 * op % (methods + 6): 0-13 calls method op of distrain.v1.Coordinator with the payload as its
 * request, and 20 on the methods after the first 14 (20: DrainNode), so that a method added
 * at the end of the service leaves every stored input's meaning alone (one that does not
 * decode is skipped: the server refuses it before any handler); 14 makes the
 * client of a held call (payload[0]) go away; 15 lets time pass (payload[0] x 100 ms, at least
 * 100 ms), then the liveness scan runs; 16 restarts the coordinator on its state; 17 renders
 * /metrics and the dashboard's status; 18 loses the checkpoint directory; 19 makes another process
 * take the store's database, or give it back (the coordinator's writes fail meanwhile). After each
 * record the loop turns once (the coordinator answers watches and plans on the next turn).
 *
 * Properties, besides the fake server's and the sanitizers', after every record: the state's
 * invariants (state.h: node ids match their slots, a node's job exists and has not ended, a
 * job's ranks are on known nodes, its reason is UTF-8); a running job's placement (each rank on
 * a live node the job holds, on a device of its own); a job's generation and committed step
 * never go back, and a job that ended stays ended, but for a STOPPED or FAILED one that
 * ResumeJob resumed. A restart restores every node and job as they were (state, generation,
 * committed step, spec, step metrics), once the store is writable again and the coordinator
 * has rewritten it (dt_coord_resync, as its liveness scan would). /metrics is UTF-8 Prometheus
 * text, a value on every sample line; the dashboard's status is UTF-8 with no "nan" or "inf" (JSON
 * has none). The checkpoint directory of every submitted job is forced under the target's private
 * directory (a commit writes manifests and deletes old steps), and a shard report makes its step's
 * directory there, as its writer would have. Liveness scans run only when op 15 moves the
 * coordinator's clock (dt_coord_clock_advance), so an input replays the same way. */
#include <ctype.h>
#include <limits.h>
#include <sqlite3.h>
#include <string.h>
#include <sys/stat.h>
#include <uv.h>

#include "checkpoint_manifest.h"
#include "coord.h"
#include "dt_error.h"
#include "dt_util.h"
#include "fake_rpc_server.h"
#include "fuzz.h"

/* Ops 14-19 are not calls (see the top); calls to the methods after the first 14 come after. */
#define FIRST_OTHER_OP 14
#define N_OTHER_OPS    6

static char g_state[512], g_ckpt[512];
static sqlite3 *g_locker; /* another process holding the database (op 19), or NULL */

typedef struct {
  char id[32];
  Distrain__V1__JobState state;
  uint64_t generation;
  int64_t committed;
} job_seen_t;

static job_seen_t *g_seen;
static size_t g_n_seen;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
  (void)argc, (void)argv;
  const char *dir = fuzz_setup();
  snprintf(g_state, sizeof g_state, "%s/state", dir);
  snprintf(g_ckpt, sizeof g_ckpt, "%s/ckpt", dir);
  /* No liveness scans on their own (every 1e9 ms): op 15 runs them. A write the locker blocks
   * fails at once rather than after a second. */
  setenv("DISTRAIN_LIVENESS_SCAN_MS", "1000000000", 1);
  setenv("DISTRAIN_STORE_BUSY_TIMEOUT_MS", "0", 1);
  return 0;
}

static void on_closed(void *ud)
{
  *(int *)ud = 1;
}

static void start(dt_coord_t *c, uv_loop_t *loop)
{
  const dt_coord_config_t cfg = {.listen = "127.0.0.1:0",
                                 .state_dir = g_state,
                                 .token = "fuzz",
                                 .heartbeat_ms = 1000,
                                 .dead_after_missed = 3};
  const int rc = dt_coord_start(c, loop, &cfg);
  FUZZ_ASSERT(rc == 0, "the coordinator does not start on its own state: %s", dt_strerror(rc));
}

static void stop(dt_coord_t *c, uv_loop_t *loop)
{
  int done = 0;
  dt_coord_close(c, on_closed, &done);
  while (!done)
    uv_run(loop, UV_RUN_ONCE);
}

static uint8_t *pack(const ProtobufCMessage *m, size_t *len)
{
  *len = m ? protobuf_c_message_get_packed_size(m) : 0;
  uint8_t *buf = malloc(*len + 1);
  FUZZ_ASSERT(buf, "out of memory");
  if (m)
    protobuf_c_message_pack(m, buf);
  return buf;
}

static void forget_jobs(void)
{
  free(g_seen);
  g_seen = NULL;
  g_n_seen = 0;
}

static int cmp_u64(const void *a, const void *b)
{
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

/* A planned job's ranks: each on a live node the job holds, on one of its devices, no device
 * given twice. */
static void check_placement(const dt_coord_state_t *st, const dt_job_t *j, int index)
{
  FUZZ_ASSERT(j->ranks && j->world >= 1, "%s is planned with %d ranks", j->id, j->world);
  uint64_t *used = malloc((size_t)j->world * sizeof *used);
  FUZZ_ASSERT(used, "out of memory");
  for (int r = 0; r < j->world; r++) {
    const dt_rank_slot_t *s = &j->ranks[r];
    const dt_node_t *n = st->nodes[s->node];
    FUZZ_ASSERT(n->job == index && n->state == DISTRAIN__V1__NODE_STATE__NODE_ALIVE,
                "%s's rank %d is on %s, which runs job index %d and is in state %d", j->id, r,
                n->id, n->job, n->state);
    FUZZ_ASSERT(s->local_rank >= 0 && (size_t)s->local_rank < n->info->n_devices,
                "%s's rank %d is on device %d of %s, which has %zu", j->id, r, s->local_rank, n->id,
                n->info->n_devices);
    used[r] = (uint64_t)s->node << 32 | (uint32_t)s->local_rank;
  }
  qsort(used, (size_t)j->world, sizeof *used, cmp_u64);
  for (int r = 1; r < j->world; r++)
    FUZZ_ASSERT(used[r] != used[r - 1], "%s puts two ranks on device %u of node-%u", j->id,
                (unsigned)used[r], (unsigned)(used[r] >> 32));
  free(used);
}

/* The invariants of state.h, and what a job may never undo. */
static void check_state(const dt_coord_t *c)
{
  const dt_coord_state_t *st = &c->st;
  for (size_t i = 0; i < st->n_nodes; i++) {
    const dt_node_t *n = st->nodes[i];
    if (!n)
      continue;
    char id[32];
    snprintf(id, sizeof id, "node-%zu", i);
    FUZZ_ASSERT(n->index == (int)i && strcmp(n->id, id) == 0, "slot %zu holds %s", i, n->id);
    FUZZ_ASSERT(n->job >= -1 && n->job < (int)st->n_jobs, "%s runs job index %d of %zu", n->id,
                n->job, st->n_jobs);
    FUZZ_ASSERT(n->job < 0 || !dt_coord_state_terminal(st->jobs[n->job]->job->state),
                "%s is still held by %s, which has ended", n->id, st->jobs[n->job]->id);
  }
  FUZZ_ASSERT(st->n_jobs >= g_n_seen, "jobs went from %zu to %zu", g_n_seen, st->n_jobs);
  if (st->n_jobs > g_n_seen) {
    g_seen = realloc(g_seen, st->n_jobs * sizeof *g_seen);
    FUZZ_ASSERT(g_seen, "out of memory");
    memset(g_seen + g_n_seen, 0, (st->n_jobs - g_n_seen) * sizeof *g_seen);
  }
  for (size_t i = 0; i < st->n_jobs; i++) {
    const dt_job_t *j = st->jobs[i];
    const Distrain__V1__Job *job = j->job;
    job_seen_t *s = &g_seen[i];
    if (i >= g_n_seen) {
      snprintf(s->id, sizeof s->id, "%s", j->id);
      s->state = job->state;
    }
    FUZZ_ASSERT(strcmp(s->id, j->id) == 0, "job %zu was %s, is %s", i, s->id, j->id);
    FUZZ_ASSERT(dt_utf8_valid(job->reason, strlen(job->reason)), "%s's reason is not UTF-8", j->id);
    FUZZ_ASSERT(!dt_coord_state_terminal(s->state) || job->state == s->state,
                "%s ended (state %d), then went to state %d", j->id, s->state, job->state);
    FUZZ_ASSERT(job->generation >= s->generation && job->committed_step >= s->committed,
                "%s went back: generation %llu -> %llu, committed step %lld -> %lld", j->id,
                (unsigned long long)s->generation, (unsigned long long)job->generation,
                (long long)s->committed, (long long)job->committed_step);
    s->state = job->state;
    s->generation = job->generation;
    s->committed = job->committed_step;
    for (int r = 0; j->ranks && r < j->world; r++) {
      const int n = j->ranks[r].node;
      FUZZ_ASSERT(n >= 0 && (size_t)n < st->n_nodes && st->nodes[n],
                  "%s's rank %d is on node index %d of %zu", j->id, r, n, st->n_nodes);
    }
    if (job->state == DISTRAIN__V1__JOB_STATE__JOB_RUNNING ||
        job->state == DISTRAIN__V1__JOB_STATE__JOB_RENDEZVOUS)
      check_placement(st, j, (int)i);
  }
  g_n_seen = st->n_jobs;
}

/* A ResumeJob call succeeded: the job that had ended (STOPPED or FAILED) runs again. */
static void resumed(const char *id)
{
  for (size_t i = 0; i < g_n_seen; i++)
    if (strcmp(g_seen[i].id, id) == 0) {
      FUZZ_ASSERT(g_seen[i].state == DISTRAIN__V1__JOB_STATE__JOB_STOPPED ||
                      g_seen[i].state == DISTRAIN__V1__JOB_STATE__JOB_FAILED,
                  "%s was resumed in state %d", id, g_seen[i].state);
      g_seen[i].state = DISTRAIN__V1__JOB_STATE__JOB_RECOVERING;
    }
}

/* What a restart must keep: each node's state, each job's spec and step metrics (packed). */
typedef struct {
  Distrain__V1__NodeState *node_states;
  size_t n_nodes, n_jobs;
  uint8_t **specs, **metrics;
  size_t *spec_lens, *metrics_lens;
} kept_t;

/* A job's step metrics as one buffer: each step's packed message after its length. */
static uint8_t *pack_metrics(const dt_job_t *j, size_t *len)
{
  size_t total = 0;
  for (size_t i = 0; i < j->n_metrics; i++)
    total += sizeof(size_t) + protobuf_c_message_get_packed_size(&j->metrics[i]->base);
  uint8_t *buf = malloc(total + 1), *at = buf;
  FUZZ_ASSERT(buf, "out of memory");
  for (size_t i = 0; i < j->n_metrics; i++) {
    const size_t n = protobuf_c_message_get_packed_size(&j->metrics[i]->base);
    memcpy(at, &n, sizeof n);
    at += sizeof n;
    at += protobuf_c_message_pack(&j->metrics[i]->base, at);
  }
  *len = total;
  return buf;
}

static kept_t keep(const dt_coord_t *c)
{
  const dt_coord_state_t *st = &c->st;
  kept_t k = {calloc(st->n_nodes + 1, sizeof *k.node_states),
              st->n_nodes,
              st->n_jobs,
              calloc(st->n_jobs + 1, sizeof *k.specs),
              calloc(st->n_jobs + 1, sizeof *k.metrics),
              calloc(st->n_jobs + 1, sizeof *k.spec_lens),
              calloc(st->n_jobs + 1, sizeof *k.metrics_lens)};
  FUZZ_ASSERT(k.node_states && k.specs && k.metrics && k.spec_lens && k.metrics_lens,
              "out of memory");
  for (size_t i = 0; i < st->n_nodes; i++)
    k.node_states[i] = st->nodes[i] ? st->nodes[i]->state : 0;
  for (size_t i = 0; i < st->n_jobs; i++) {
    k.specs[i] = pack(&st->jobs[i]->job->spec->base, &k.spec_lens[i]);
    k.metrics[i] = pack_metrics(st->jobs[i], &k.metrics_lens[i]);
  }
  return k;
}

/* Restarted on its state: every node and job as it was. */
static void check_restored(const dt_coord_t *c, kept_t *k)
{
  const dt_coord_state_t *st = &c->st;
  FUZZ_ASSERT(st->n_nodes == k->n_nodes && st->n_jobs == k->n_jobs,
              "restored %zu nodes and %zu jobs of %zu and %zu", st->n_nodes, st->n_jobs, k->n_nodes,
              k->n_jobs);
  for (size_t i = 0; i < k->n_nodes; i++)
    FUZZ_ASSERT(st->nodes[i] ? st->nodes[i]->state == k->node_states[i] : k->node_states[i] == 0,
                "node-%zu restored in state %d, was %d", i,
                st->nodes[i] ? (int)st->nodes[i]->state : 0, k->node_states[i]);
  for (size_t i = 0; i < st->n_jobs; i++) {
    const Distrain__V1__Job *job = st->jobs[i]->job;
    const job_seen_t *s = &g_seen[i];
    size_t len;
    uint8_t *spec = pack(&job->spec->base, &len);
    FUZZ_ASSERT(strcmp(s->id, st->jobs[i]->id) == 0 && job->state == s->state &&
                    job->generation == s->generation && job->committed_step == s->committed,
                "%s restored as %s in state %d, generation %llu, committed step %lld; was "
                "state %d, generation %llu, committed step %lld",
                s->id, st->jobs[i]->id, job->state, (unsigned long long)job->generation,
                (long long)job->committed_step, s->state, (unsigned long long)s->generation,
                (long long)s->committed);
    FUZZ_ASSERT(len == k->spec_lens[i] && memcmp(spec, k->specs[i], len) == 0,
                "%s's spec changed across a restart", s->id);
    free(spec);
    uint8_t *metrics = pack_metrics(st->jobs[i], &len);
    FUZZ_ASSERT(len == k->metrics_lens[i] && memcmp(metrics, k->metrics[i], len) == 0,
                "%s's step metrics changed across a restart (%zu steps now)", s->id,
                st->jobs[i]->n_metrics);
    free(metrics);
    free(k->specs[i]);
    free(k->metrics[i]);
  }
  free(k->node_states);
  free(k->specs);
  free(k->metrics);
  free(k->spec_lens);
  free(k->metrics_lens);
}

/* Another process takes the database (every write of the coordinator fails), or lets it go. */
static void lock_store(int on)
{
  if (on && !g_locker) {
    char path[600];
    snprintf(path, sizeof path, "%s/coordinator.db", g_state);
    FUZZ_ASSERT(sqlite3_open(path, &g_locker) == SQLITE_OK &&
                    sqlite3_exec(g_locker, "BEGIN EXCLUSIVE", NULL, NULL, NULL) == SQLITE_OK,
                "locking the store: %s", sqlite3_errmsg(g_locker));
  } else if (!on && g_locker) {
    sqlite3_exec(g_locker, "COMMIT", NULL, NULL, NULL);
    sqlite3_close(g_locker);
    g_locker = NULL;
  }
}

/* The store is writable again, the coordinator has caught up (its liveness scan tries every
 * 2 s), then it restarts. */
static void restart(dt_coord_t *c, uv_loop_t *loop)
{
  lock_store(0);
  FUZZ_ASSERT(dt_coord_resync(c, 1) == 0, "the state could not be rewritten to a healthy store");
  kept_t k = keep(c);
  stop(c, loop);
  start(c, loop);
  check_restored(c, &k);
}

/* Outside its strings a JSON document holds only numbers, punctuation, white space and the
 * literals true, false and null: no "nan", no "inf" (a lexical check, not a parser). */
static void check_json_tokens(const char *json)
{
  for (const char *p = json; *p; p++) {
    if (*p == '"') {
      for (p++; *p && *p != '"'; p++) {
        FUZZ_ASSERT((unsigned char)*p >= 0x20, "a raw control character in a JSON string");
        if (*p == '\\' && p[1])
          p++;
      }
      FUZZ_ASSERT(*p, "an unterminated JSON string");
    } else if (isalpha((unsigned char)*p) &&
               !((*p == 'e' || *p == 'E') && p > json && isdigit((unsigned char)p[-1]))) {
      const size_t n = strspn(p, "abcdefghijklmnopqrstuvwxyz");
      FUZZ_ASSERT((n == 4 && (!strncmp(p, "true", 4) || !strncmp(p, "null", 4))) ||
                      (n == 5 && !strncmp(p, "false", 5)),
                  "'%.*s' in JSON", (int)(n ? n : 1), p);
      p += n ? n - 1 : 0;
    }
  }
}

/* Prometheus text: comments, and samples "name{labels} value" with a number as the value. */
static void check_metrics(dt_coord_t *c)
{
  size_t len;
  char *text = dt_coord_metrics(c, &len);
  FUZZ_ASSERT(text && strlen(text) == len, "/metrics rendered %zu bytes, %zu of them text", len,
              text ? strlen(text) : 0);
  FUZZ_ASSERT(dt_utf8_valid(text, len), "/metrics is not UTF-8");
  for (char *line = text, *next; *line; line = next) {
    char *nl = strchr(line, '\n');
    FUZZ_ASSERT(nl, "/metrics does not end its last line");
    *nl = '\0';
    next = nl + 1;
    if (line[0] == '#')
      continue;
    const char *value = strrchr(line, ' ');
    FUZZ_ASSERT(value && value > line, "/metrics line '%s' is not a sample", line);
    char *end;
    strtod(value + 1, &end);
    FUZZ_ASSERT(end > value + 1 && *end == '\0', "/metrics line '%s' has no value", line);
  }
  free(text);
  char *json = dt_coord_status_json(c, &len);
  FUZZ_ASSERT(json && strlen(json) == len, "the dashboard's status is %zu bytes, %zu of them text",
              len, json ? strlen(json) : 0);
  FUZZ_ASSERT(dt_utf8_valid(json, len), "the dashboard's status is not UTF-8 (nor JSON)");
  check_json_tokens(json);
  free(json);
}

/* A request the harness decoded, before its handler sees it. */
static void confine(Distrain__V1__SubmitJobRequest *req)
{
  if (req->spec && req->spec->checkpoint) {
    if (req->spec->checkpoint->dir != protobuf_c_empty_string)
      free(req->spec->checkpoint->dir);
    req->spec->checkpoint->dir = strdup(g_ckpt);
    FUZZ_ASSERT(req->spec->checkpoint->dir, "out of memory");
  }
}

/* A writer reports its shard once it is in the step's directory: the directory exists. */
static void shard_written(const Distrain__V1__ReportCheckpointRequest *r)
{
  char sdir[600];
  dt_ckpt_step_dir(sdir, sizeof sdir, g_ckpt, r->step);
  mkdir(g_ckpt, 0755);
  mkdir(sdir, 0755);
}

static void remove_state(void)
{
  fuzz_remove_tree(g_state);
  fuzz_remove_tree(g_ckpt);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  uv_loop_t loop;
  dt_coord_t c;
  FUZZ_ASSERT(uv_loop_init(&loop) == 0, "uv_loop_init");
  remove_state();
  start(&c, &loop);
  const ProtobufCServiceDescriptor *svc = &distrain__v1__coordinator__descriptor;
  while (size >= 3) {
    const unsigned op = data[0] % (unsigned)(svc->n_methods + N_OTHER_OPS);
    const unsigned method = op < FIRST_OTHER_OP                  ? op
                            : op >= FIRST_OTHER_OP + N_OTHER_OPS ? op - N_OTHER_OPS
                                                                 : UINT_MAX;
    size_t len = (size_t)data[1] | (size_t)data[2] << 8;
    data += 3, size -= 3;
    len = len < size ? len : size;
    const uint8_t *payload = data;
    data += len, size -= len;
    dt_rpc_server_t *s = fake_rpc_server();
    if (method != UINT_MAX) {
      const ProtobufCMethodDescriptor *m = &svc->methods[method];
      ProtobufCMessage *req = protobuf_c_message_unpack(m->input, NULL, len, payload);
      if (req) {
        if (m->input == &distrain__v1__submit_job_request__descriptor)
          confine((Distrain__V1__SubmitJobRequest *)req);
        if (m->input == &distrain__v1__report_checkpoint_request__descriptor)
          shard_written((const Distrain__V1__ReportCheckpointRequest *)req);
        const int status = fake_rpc_call(s, method, req, 30000);
        if (status == 0 && m->input == &distrain__v1__resume_job_request__descriptor)
          resumed(((const Distrain__V1__ResumeJobRequest *)req)->job_id);
        protobuf_c_message_free_unpacked(req, NULL);
      }
    } else if (op == 14 && fake_rpc_held(s)) {
      fake_rpc_cancel(s, (len ? payload[0] : 0) % fake_rpc_held(s));
    } else if (op == 15) {
      dt_coord_clock_advance(100.0 * (len && payload[0] ? payload[0] : 1));
      dt_coord_liveness_scan(&c);
    } else if (op == 16) {
      uv_run(&loop, UV_RUN_NOWAIT); /* what the last record queued, then the restart */
      check_state(&c);
      restart(&c, &loop);
    } else if (op == 17) {
      check_metrics(&c);
    } else if (op == 18) {
      fuzz_remove_tree(g_ckpt); /* the checkpoint directory is lost */
    } else if (op == 19) {
      lock_store(!g_locker);
    }
    uv_run(&loop, UV_RUN_NOWAIT);
    if (fake_rpc_server())
      fake_rpc_sweep(fake_rpc_server());
    check_state(&c);
  }
  lock_store(0);
  stop(&c, &loop);
  FUZZ_ASSERT(uv_loop_close(&loop) == 0, "the coordinator left handles open on its loop");
  forget_jobs();
  return 0;
}
