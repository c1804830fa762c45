/* hang.c — see hang.h. */
#include "hang.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One communicator of one rank, sorted by (group, group rank) to find a group's members. */
typedef struct {
  const Distrain__V1__CommProgress *c;
  int rank; /* global */
} member_t;

typedef struct {
  const dt_hang_rank_t *ranks;
  int world;
  double stale_ms;
  member_t *m;
  size_t n;
} index_t;

static int member_cmp(const void *pa, const void *pb)
{
  const member_t *a = pa, *b = pb;
  int d = strcmp(a->c->group, b->c->group);
  return d ? d : (a->c->rank > b->c->rank) - (a->c->rank < b->c->rank);
}

static int stale(const index_t *ix, int r)
{
  return ix->ranks[r].age_ms >= ix->stale_ms;
}

/* The operation rank r has been blocked in longest, or NULL. */
static const Distrain__V1__CommProgress *blocked_in(const dt_hang_rank_t *rk)
{
  const Distrain__V1__CommProgress *best = NULL;
  for (size_t k = 0; rk->progress && k < rk->progress->n_comms; k++) {
    const Distrain__V1__CommProgress *c = rk->progress->comms[k];
    if (c->op[0] && (!best || c->waiting_ms > best->waiting_ms))
      best = c;
  }
  return best;
}

/* The members of group (a range of ix->m). */
static const member_t *group_members(const index_t *ix, const char *group, size_t *count)
{
  size_t lo = 0, hi = ix->n;
  while (lo < hi) { /* first entry >= group */
    size_t mid = (lo + hi) / 2;
    if (strcmp(ix->m[mid].c->group, group) < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  size_t end = lo;
  while (end < ix->n && strcmp(ix->m[end].c->group, group) == 0)
    end++;
  *count = end - lo;
  return ix->m + lo;
}

/* Whether group rank g is a point-to-point peer of c (peers; a trainer older than that field
 * sends only the first, peer). */
static int is_peer(const Distrain__V1__CommProgress *c, int g)
{
  for (size_t i = 0; i < c->n_peers; i++)
    if (c->peers[i] == g)
      return 1;
  return c->n_peers == 0 && c->peer == g;
}

/* The ranks that rank w, blocked in c, waits for: its point-to-point peers (all of them: which
 * half of a send/recv is pending is not known; a peer that is itself blocked is followed);
 * else the members that have not started the operation; else (all have) the members that
 * stopped reporting. Writes them to out (world entries) and returns how many. */
static int waits_for(const index_t *ix, int w, const Distrain__V1__CommProgress *c, int *out)
{
  size_t n;
  const member_t *m = group_members(ix, c->group, &n);
  int k = 0;
  if (c->n_peers > 0 || c->peer >= 0) {
    for (size_t i = 0; i < n; i++)
      if (is_peer(c, m[i].c->rank))
        out[k++] = m[i].rank;
    return k;
  }
  for (size_t i = 0; i < n; i++)
    if (m[i].rank != w && m[i].c->entered < c->entered)
      out[k++] = m[i].rank;
  for (size_t i = 0; k == 0 && i < n; i++)
    if (m[i].rank != w && stale(ix, m[i].rank))
      out[k++] = m[i].rank;
  /* Members that never reported this group at all (stopped before their first report). */
  for (int r = 0; k == 0 && n < (size_t)c->world && r < ix->world; r++)
    if (r != w && !ix->ranks[r].progress && stale(ix, r))
      out[k++] = r;
  return k;
}

static void appendf(char *buf, size_t len, size_t *at, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void appendf(char *buf, size_t len, size_t *at, const char *fmt, ...)
{
  if (*at >= len)
    return;
  va_list ap;
  va_start(ap, fmt);
  int w = vsnprintf(buf + *at, len - *at, fmt, ap);
  va_end(ap);
  if (w > 0)
    *at += (size_t)w;
}

void dt_hang_describe(const Distrain__V1__TrainerProgress *p, double age_ms, char *out, size_t len)
{
  dt_hang_rank_t rk = {p, age_ms};
  const Distrain__V1__CommProgress *c = blocked_in(&rk);
  if (!c) {
    snprintf(out, len, "%s", "");
    return;
  }
  snprintf(out, len, "%s %s #%llu for %.1f s", c->label, c->op, (unsigned long long)c->entered,
           (c->waiting_ms + age_ms) / 1000.0);
}

int dt_hang_analyze(const dt_hang_rank_t *ranks, int world, double timeout_ms, double stale_ms,
                    int *blamed, char *why, size_t whylen)
{
  why[0] = '\0';
  /* The longest-blocked rank among those still reporting. */
  int w = -1;
  const Distrain__V1__CommProgress *wc = NULL;
  for (int r = 0; r < world; r++) {
    const Distrain__V1__CommProgress *c = blocked_in(&ranks[r]);
    if (c && ranks[r].age_ms < stale_ms && c->waiting_ms + ranks[r].age_ms >= timeout_ms &&
        (!wc || c->waiting_ms + ranks[r].age_ms > wc->waiting_ms + ranks[w].age_ms))
      w = r, wc = c;
  }
  if (w < 0)
    return 0;

  index_t ix = {.ranks = ranks, .world = world, .stale_ms = stale_ms};
  size_t total = 0;
  for (int r = 0; r < world; r++)
    total += ranks[r].progress ? ranks[r].progress->n_comms : 0;
  ix.m = malloc((total ? total : 1) * sizeof *ix.m);
  int *queue = malloc((size_t)world * 2 * sizeof *queue); /* two halves: queue, scratch */
  char *seen = calloc((size_t)world, 1);
  if (!ix.m || !queue || !seen) {
    free(ix.m), free(queue), free(seen);
    snprintf(why, whylen, "rank %d is blocked in %s %s (out of memory naming the others)", w,
             wc->label, wc->op);
    blamed[0] = w;
    return 1;
  }
  for (int r = 0; r < world; r++)
    for (size_t k = 0; ranks[r].progress && k < ranks[r].progress->n_comms; k++)
      ix.m[ix.n++] = (member_t){ranks[r].progress->comms[k], r};
  qsort(ix.m, ix.n, sizeof *ix.m, member_cmp);

  /* Follow what the waiter waits for, through ranks that are themselves blocked, to the ranks
   * that are not: stopped (silent) or alive elsewhere. */
  int head = 0, tail = 0, nb = 0;
  int *scratch = queue + world;
  seen[w] = 1;
  for (int s = w;;) {
    const Distrain__V1__CommProgress *sc = s == w ? wc : blocked_in(&ranks[s]);
    int k = waits_for(&ix, s, sc, scratch);
    for (int i = 0; i < k; i++)
      if (!seen[scratch[i]])
        seen[scratch[i]] = 1, queue[tail++] = scratch[i];
    for (s = -1; s < 0 && head < tail;) {
      s = queue[head++];
      if (stale(&ix, s) || !blocked_in(&ranks[s])) {
        blamed[nb++] = s;
        s = -1;
      }
    }
    if (s < 0)
      break;
  }

  size_t at = 0;
  appendf(why, whylen, &at, "rank %d has waited %.1f s in %s %s #%llu", w,
          (wc->waiting_ms + ranks[w].age_ms) / 1000.0, wc->label, wc->op,
          (unsigned long long)wc->entered);
  if (nb == 0) {
    /* Nobody outside the blocked ranks: they wait for each other, or all arrived and the
     * operation itself does not finish. Name every blocked rank reached. */
    for (int r = 0; r < world; r++)
      if (seen[r])
        blamed[nb++] = r;
    appendf(why, whylen, &at, "; %s", nb > 1 ? "ranks" : "rank");
    for (int i = 0; i < nb && i < 8; i++)
      appendf(why, whylen, &at, "%s%d", i ? ", " : " ", blamed[i]);
    appendf(why, whylen, &at,
            "%s %s blocked with no rank missing (a deadlock, or a stalled "
            "transfer)",
            nb > 8 ? " and more" : "", nb > 1 ? "are all" : "is");
  } else {
    for (int i = 0; i < nb && i < 4; i++) {
      int s = blamed[i];
      if (stale(&ix, s))
        appendf(why, whylen, &at, "; rank %d sent no report for %.1f s (stopped or wedged)", s,
                ranks[s].age_ms / 1000.0);
      else
        appendf(why, whylen, &at, "; rank %d is running but has not arrived", s);
    }
    if (nb > 4)
      appendf(why, whylen, &at, "; and %d more ranks", nb - 4);
  }
  free(ix.m), free(queue), free(seen);
  return nb;
}
