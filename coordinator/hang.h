/* hang.h — naming the ranks a hung job waits for, from its trainers' progress reports.
 *
 * Every trainer reports, each second, its communicators' progress (CommProgress: operations
 * started and returned, the one in progress and for how long). The ranks of a group make the
 * same operations in the same order, so a rank blocked in operation #n of a group waits for
 * the members that have not started #n (or, point-to-point, for its peer). The analysis starts
 * at the rank that has waited longest, past the timeout, and follows what it waits for: a
 * member that stopped reporting (SIGSTOP, a wedged process) or one that is alive but has not
 * arrived (busy elsewhere) is named; a member that is itself blocked in another group is
 * followed into that group. Ranks that wait for each other in a circle, or a group whose
 * members have all arrived and still wait, are named together.
 *
 * Pure: no coordinator state, so it is tested on its own (tests/unit/test_hang.c). */
#ifndef DT_COORD_HANG_H
#define DT_COORD_HANG_H

#include <stddef.h>

#include "distrain.pb-c.h"

typedef struct {
  const Distrain__V1__TrainerProgress *progress; /* the latest report, or NULL */
  double age_ms; /* since the rank's last report of any kind reached its agent */
} dt_hang_rank_t;

/* Looks for a rank of ranks[0..world) blocked in an operation for at least timeout_ms (its
 * reported wait plus the report's age); ranks silent for stale_ms or more count as stopped.
 * Returns the number of ranks named (their ranks in blamed[], which holds world entries) and
 * a one-line explanation in why; 0 when no rank has waited that long. */
int dt_hang_analyze(const dt_hang_rank_t *ranks, int world, double timeout_ms, double stale_ms,
                    int *blamed, char *why, size_t whylen);

/* "dp all_reduce #57 for 3.2 s" for the operation a rank is blocked in, or "" if none. */
void dt_hang_describe(const Distrain__V1__TrainerProgress *p, double age_ms, char *out, size_t len);

#endif
