/* checkpoint_manifest.h — the commit protocol of distrain checkpoints, shared by the trainer
 * (standalone runs commit their own steps) and the coordinator (which commits a step once
 * every writer has reported its shard).
 *
 * Layout:
 *   <dir>/step-<S, 8 digits>/shard-<rank>-of-<world>.bin   one per writer, a flat range
 *   <dir>/step-<S>/MANIFEST                                 written last: commits step S
 * The manifest is a small text file of our own ("distrain-checkpoint 1", step, num_params,
 * world, then one "shard RANK LO HI BYTES CRC32C NAME" line per writer), written atomically.
 * A step directory without a MANIFEST is an incomplete save that every reader ignores. The
 * shard ranges must tile [0, num_params) in rank order. */
#ifndef DT_CHECKPOINT_MANIFEST_H
#define DT_CHECKPOINT_MANIFEST_H

#include <stddef.h>
#include <stdint.h>

#define DT_CKPT_VERSION        1
#define DT_CKPT_MANIFEST_NAME  "MANIFEST"
#define DT_CKPT_MANIFEST_MAGIC "distrain-checkpoint"

/* What a writer reports about the shard it wrote (the coordinator collects these). */
typedef struct {
  int rank;
  int64_t lo, hi;  /* flat parameter range held */
  uint64_t bytes;  /* file size */
  uint32_t crc32c; /* CRC-32C of the payload after the header */
  char name[64];   /* file name inside the step directory */
} dt_ckpt_shard_info_t;

/* A parsed manifest (dt_ckpt_manifest_read; free shards with free()). */
typedef struct {
  int64_t step, num_params;
  int world;
  dt_ckpt_shard_info_t *shards;
} dt_ckpt_manifest_t;

/* "<dir>/step-<8 digits>" */
void dt_ckpt_step_dir(char *buf, size_t n, const char *dir, int64_t step);
/* Commits step: writes the manifest naming all world shards (which must tile [0, P)). */
int dt_ckpt_commit(const char *dir, int64_t step, int64_t num_params, int world,
                   const dt_ckpt_shard_info_t *shards);
/* Finds the newest committed step under dir: 0 and *step set, or DT_ENOENT if none. */
int dt_ckpt_latest(const char *dir, int64_t *step);
/* Deletes the shards an abandoned save of step left (a writer could not write its own): the step
 * directory and its files. DT_EEXIST, deleting nothing, where the step is committed. */
int dt_ckpt_discard(const char *dir, int64_t step);
/* Deletes every step directory under dir that is neither committed nor marked bad: saves cut
 * short (their writers killed, or their step abandoned before its shards could be deleted).
 * Only where no save can be in flight: before a run's first step. *steps (malloc'ed, ascending;
 * free it) and *n: the steps deleted. */
int dt_ckpt_discard_incomplete(const char *dir, int64_t **steps, int *n);
/* Deletes committed steps older than the newest keep (keep <= 0: delete nothing), except the
 * multiples of keep_every (> 0: milestones that are never deleted; 0: none). */
int dt_ckpt_prune(const char *dir, int keep, int keep_every);
/* path is a step dir (has a MANIFEST) or a checkpoint root (its newest committed step). */
int dt_ckpt_resolve_step_dir(const char *path, char *sdir, size_t n);
/* Uncommits a step whose shards failed verification: its MANIFEST becomes MANIFEST.bad (kept
 * for inspection), so no loader or dt_ckpt_latest takes the step again. */
int dt_ckpt_mark_bad(const char *sdir);
/* Reads and checks sdir/MANIFEST (format, one line per rank, ranges tile [0, P)). */
int dt_ckpt_manifest_read(const char *sdir, dt_ckpt_manifest_t *mf);

#endif
