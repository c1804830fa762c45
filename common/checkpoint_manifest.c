/* checkpoint_manifest.c — see checkpoint_manifest.h. */
#include "checkpoint_manifest.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dt_log.h"
#include "dt_util.h"

#define MANIFEST_NAME  DT_CKPT_MANIFEST_NAME
#define MANIFEST_MAGIC DT_CKPT_MANIFEST_MAGIC

static FILE *open_read(const char *path, int *err)
{
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    int e = errno;
    DT_ERROR(CKPT, "%s: cannot open: %s", path, strerror(e));
    *err = dt_err_from_errno(e);
  }
  return fp;
}

void dt_ckpt_step_dir(char *buf, size_t n, const char *dir, int64_t step)
{
  snprintf(buf, n, "%s/step-%08" PRId64, dir, step);
}

static int dt__path_exists(const char *path)
{
  struct stat st;
  return stat(path, &st) == 0;
}

int dt_ckpt_commit(const char *dir, int64_t step, int64_t num_params, int world,
                   const dt_ckpt_shard_info_t *shards)
{
  char sdir[4096], path[4200];
  int ret = 0;
  /* The shards must tile [0, P) in rank order. */
  int64_t expect_lo = 0;
  for (int r = 0; r < world; r++) {
    if (shards[r].lo != expect_lo || shards[r].hi < shards[r].lo) {
      DT_ERROR(CKPT, "step %lld: shard %d covers [%lld, %lld), expected to start at %lld",
               (long long)step, r, (long long)shards[r].lo, (long long)shards[r].hi,
               (long long)expect_lo);
      return DT_EINVAL;
    }
    expect_lo = shards[r].hi;
  }
  if (expect_lo != num_params) {
    DT_ERROR(CKPT, "step %lld: shards cover %lld of %lld parameters", (long long)step,
             (long long)expect_lo, (long long)num_params);
    return DT_EINVAL;
  }
  dt_ckpt_step_dir(sdir, sizeof sdir, dir, step);
  snprintf(path, sizeof path, "%s/" MANIFEST_NAME, sdir);
  dt_afile_t af;
  DT_CHECK(dt_afile_open(&af, path));
  fprintf(af.fp, MANIFEST_MAGIC " %d\nstep %" PRId64 "\nnum_params %" PRId64 "\nworld %d\n",
          DT_CKPT_VERSION, step, num_params, world);
  for (int r = 0; r < world; r++)
    fprintf(af.fp, "shard %d %" PRId64 " %" PRId64 " %" PRIu64 " %08x %s\n", shards[r].rank,
            shards[r].lo, shards[r].hi, shards[r].bytes, shards[r].crc32c, shards[r].name);
  if (ferror(af.fp)) {
    dt_afile_abort(&af);
    return DT_EIO;
  }
  DT_CHECK_GOTO(dt_afile_commit(&af), ret, out);
  DT_INFO(CKPT, "committed checkpoint %s", sdir);
out:
  return ret;
}

/* Lists the step directories under dir (unsorted): the committed ones (incomplete 0), or those
 * neither committed nor marked bad (incomplete 1: saves that never finished). */
static int list_steps(const char *dir, int incomplete, int64_t **steps_out, int *n_out)
{
  *steps_out = NULL;
  *n_out = 0;
  DIR *d = opendir(dir);
  if (!d)
    return errno == ENOENT ? 0 : dt_err_from_errno(errno);
  int cap = 0, n = 0;
  int64_t *steps = NULL;
  struct dirent *e;
  while ((e = readdir(d))) {
    int64_t s;
    if (strncmp(e->d_name, "step-", 5) != 0 || dt_parse_i64(e->d_name + 5, &s) != 0 || s < 0)
      continue;
    char manifest[4200], bad[4200];
    snprintf(manifest, sizeof manifest, "%s/%s/" MANIFEST_NAME, dir, e->d_name);
    snprintf(bad, sizeof bad, "%s/%s/" MANIFEST_NAME ".bad", dir, e->d_name);
    if (incomplete ? dt__path_exists(manifest) || dt__path_exists(bad) : !dt__path_exists(manifest))
      continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 16;
      int64_t *grown = realloc(steps, (size_t)cap * sizeof *steps);
      if (!grown) {
        free(steps);
        closedir(d);
        return DT_ENOMEM;
      }
      steps = grown;
    }
    steps[n++] = s;
  }
  closedir(d);
  *steps_out = steps;
  *n_out = n;
  return 0;
}

static int cmp_i64(const void *a, const void *b)
{
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

int dt_ckpt_latest(const char *dir, int64_t *step)
{
  int64_t *steps;
  int n;
  DT_CHECK(list_steps(dir, 0, &steps, &n));
  if (n == 0)
    return DT_ENOENT;
  int64_t best = steps[0];
  for (int i = 1; i < n; i++)
    best = steps[i] > best ? steps[i] : best;
  free(steps);
  *step = best;
  return 0;
}

/* Removes a step directory's files and the directory (what can be removed). */
static void remove_files(const char *sdir)
{
  char path[4400];
  DIR *d = opendir(sdir);
  if (d) {
    struct dirent *e;
    while ((e = readdir(d)))
      if (e->d_name[0] != '.') {
        snprintf(path, sizeof path, "%s/%s", sdir, e->d_name);
        unlink(path);
      }
    closedir(d);
  }
  rmdir(sdir);
}

int dt_ckpt_discard(const char *dir, int64_t step)
{
  char sdir[4096], manifest[4200];
  dt_ckpt_step_dir(sdir, sizeof sdir, dir, step);
  snprintf(manifest, sizeof manifest, "%s/" MANIFEST_NAME, sdir);
  if (dt__path_exists(manifest)) {
    DT_ERROR(CKPT, "%s: step %lld is committed; not discarding it", sdir, (long long)step);
    return DT_EEXIST;
  }
  remove_files(sdir);
  return 0;
}

int dt_ckpt_discard_incomplete(const char *dir, int64_t **steps, int *n)
{
  DT_CHECK(list_steps(dir, 1, steps, n));
  if (*n > 0)
    qsort(*steps, (size_t)*n, sizeof **steps, cmp_i64);
  for (int i = 0; i < *n; i++)
    dt_ckpt_discard(dir, (*steps)[i]);
  return 0;
}

int dt_ckpt_prune(const char *dir, int keep, int keep_every)
{
  if (keep <= 0)
    return 0;
  int64_t *steps;
  int n;
  DT_CHECK(list_steps(dir, 0, &steps, &n));
  qsort(steps, (size_t)n, sizeof *steps, cmp_i64);
  for (int i = 0; i + keep < n; i++) {
    char sdir[4096], path[4400];
    if (keep_every > 0 && steps[i] % keep_every == 0)
      continue; /* a milestone */
    dt_ckpt_step_dir(sdir, sizeof sdir, dir, steps[i]);
    /* Uncommit first (the manifest goes), then the shards: a crash midway leaves an
     * uncommitted directory that loaders ignore, never a committed one with missing shards. */
    snprintf(path, sizeof path, "%s/" MANIFEST_NAME, sdir);
    unlink(path);
    dt_fsync_parent(path);
    remove_files(sdir);
    DT_DEBUG(CKPT, "pruned %s", sdir);
  }
  free(steps);
  return 0;
}

/* A parsed manifest. */

/* Resolves path (a step dir, or a checkpoint root whose newest committed step is used). */
int dt_ckpt_mark_bad(const char *sdir)
{
  char from[4200], to[4200];
  snprintf(from, sizeof from, "%s/" MANIFEST_NAME, sdir);
  snprintf(to, sizeof to, "%s/" MANIFEST_NAME ".bad", sdir);
  if (rename(from, to) != 0) {
    int e = errno;
    DT_ERROR(CKPT, "%s: cannot mark the checkpoint bad: %s", from, strerror(e));
    return dt_err_from_errno(e);
  }
  return dt_fsync_parent(to);
}

int dt_ckpt_resolve_step_dir(const char *path, char *sdir, size_t n)
{
  char manifest[4200];
  snprintf(manifest, sizeof manifest, "%s/" MANIFEST_NAME, path);
  if (dt__path_exists(manifest)) {
    snprintf(sdir, n, "%s", path);
    return 0;
  }
  int64_t step;
  int rc = dt_ckpt_latest(path, &step);
  if (rc == DT_ENOENT) {
    DT_ERROR(CKPT, "%s: no committed checkpoint (no step-*/" MANIFEST_NAME ")", path);
    return rc;
  }
  if (rc != 0) {
    DT_ERROR(CKPT, "%s: cannot list checkpoints: %s", path, dt_strerror(rc));
    return rc;
  }
  dt_ckpt_step_dir(sdir, n, path, step);
  return 0;
}

/* Whether the shards cover [0, num_params) in rank order without gaps or overlaps. */
static int shards_tile(const dt_ckpt_shard_info_t *shards, int world, int64_t num_params)
{
  int64_t expect_lo = 0;
  for (int r = 0; r < world; r++) {
    if (shards[r].lo != expect_lo || shards[r].hi < shards[r].lo)
      return 0;
    expect_lo = shards[r].hi;
  }
  return expect_lo == num_params;
}

int dt_ckpt_manifest_read(const char *sdir, dt_ckpt_manifest_t *mf)
{
  char path[4200], line[512];
  int ret = 0, version = 0, seen = 0;
  memset(mf, 0, sizeof *mf);
  snprintf(path, sizeof path, "%s/" MANIFEST_NAME, sdir);
  FILE *fp = open_read(path, &ret);
  if (!fp)
    return ret;
  if (!fgets(line, sizeof line, fp) || sscanf(line, MANIFEST_MAGIC " %d", &version) != 1 ||
      version != DT_CKPT_VERSION)
    goto bad;
  if (!fgets(line, sizeof line, fp) || sscanf(line, "step %" SCNd64, &mf->step) != 1)
    goto bad;
  if (!fgets(line, sizeof line, fp) || sscanf(line, "num_params %" SCNd64, &mf->num_params) != 1)
    goto bad;
  if (!fgets(line, sizeof line, fp) || sscanf(line, "world %d", &mf->world) != 1 || mf->world < 1 ||
      mf->world > 1 << 20)
    goto bad;
  mf->shards = calloc((size_t)mf->world, sizeof *mf->shards);
  if (!mf->shards) {
    ret = DT_ENOMEM;
    goto out;
  }
  while (fgets(line, sizeof line, fp)) {
    dt_ckpt_shard_info_t s;
    memset(&s, 0, sizeof s);
    if (sscanf(line, "shard %d %" SCNd64 " %" SCNd64 " %" SCNu64 " %x %63s", &s.rank, &s.lo, &s.hi,
               &s.bytes, &s.crc32c, s.name) != 6 ||
        s.rank < 0 || s.rank >= mf->world || mf->shards[s.rank].name[0] != '\0' ||
        strchr(s.name, '/') || strcmp(s.name, ".") == 0 || strcmp(s.name, "..") == 0)
      goto bad; /* a rank listed twice, or a name that is not a file in the step directory */
    mf->shards[s.rank] = s;
    seen++;
  }
  if (seen != mf->world)
    goto bad;
  /* The shards must tile [0, num_params) in rank order, as dt_ckpt_commit requires: otherwise a
   * load would leave a hole of unread weights, or write past the model. */
  if (!shards_tile(mf->shards, mf->world, mf->num_params))
    goto bad;
  goto out;
bad:
  DT_ERROR(CKPT,
           "%s: malformed manifest (expected '" MANIFEST_MAGIC " %d', step, num_params, "
           "world and one shard line per rank naming a file of the step directory, the shards "
           "tiling [0, num_params))",
           path, DT_CKPT_VERSION);
  ret = DT_EFORMAT;
out:
  fclose(fp);
  if (ret != 0) {
    free(mf->shards);
    mf->shards = NULL;
  }
  return ret;
}
