/* dataloader.c — see dataloader.h. */
#include "dataloader.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "blend.h"
#include "dt_log.h"
#include "dt_util.h"
#include "rng.h"

/* Distinct streams for the two permutations, so that shard and window orders are unrelated. */
#define SHUFFLE_SHARDS_SALT  0x5348415244ull /* "SHARD" */
#define SHUFFLE_WINDOWS_SALT 0x57494E44ull   /* "WIND" */
/* A blend's source d is shuffled with seed + (d + 1) x this (its own orders). */
#define BLEND_SOURCE_SEED 0xD1B54A32D192ED03ull

static int64_t window_seqs(const dt_dataloader_t *dl)
{
  return (int64_t)dl->world * dl->B * dl->accum;
}

static int64_t window_tokens(const dt_dataloader_t *dl)
{
  return window_seqs(dl) * dl->T;
}

/* Reads and checks one shard header; returns its token count through ntok. */
static int shard_check_header(const char *path, int64_t *ntok)
{
  int32_t hdr[DT_SHARD_HEADER];
  int ret = 0;
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    int e = errno;
    DT_ERROR(DATA, "%s: cannot open token shard: %s", path, strerror(e));
    return dt_err_from_errno(e);
  }
  struct stat st;
  if (fstat(fileno(fp), &st) != 0 || fread(hdr, sizeof hdr, 1, fp) != 1) {
    DT_ERROR(DATA, "%s: truncated token shard: expected a %zu-byte header", path, sizeof hdr);
    ret = DT_EFORMAT;
    goto out;
  }
  if (hdr[0] != DT_SHARD_MAGIC) {
    DT_ERROR(DATA, "%s: bad magic %d in token shard header: expected %d (llm.c token shard)", path,
             hdr[0], DT_SHARD_MAGIC);
    ret = DT_EFORMAT;
    goto out;
  }
  if (hdr[1] != DT_SHARD_VERSION) {
    DT_ERROR(DATA, "%s: unsupported token shard version %d: expected %d", path, hdr[1],
             DT_SHARD_VERSION);
    ret = DT_EFORMAT;
    goto out;
  }
  int64_t n = hdr[2];
  int64_t expect = (int64_t)sizeof hdr + n * 2;
  if (n < 0 || st.st_size != expect) {
    DT_ERROR(DATA,
             "%s: token shard size %lld bytes does not match its header (%lld tokens): "
             "expected %lld bytes%s",
             path, (long long)st.st_size, (long long)n, (long long)expect,
             st.st_size < expect ? " (truncated)" : "");
    ret = DT_EFORMAT;
    goto out;
  }
  *ntok = n;
out:
  fclose(fp);
  return ret;
}

static void unload_shard(dt_dataloader_t *dl)
{
  if (dl->map)
    munmap(dl->map, dl->map_bytes);
  dl->map = NULL;
  dl->tokens = NULL;
  dl->loaded = -1;
}

/* Maps shard index s and prepares its window order for the current epoch. */
static int load_shard(dt_dataloader_t *dl, int64_t s)
{
  const char *path = dl->paths[s];
  if (dl->loaded != s) {
    unload_shard(dl);
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
      int e = errno;
      DT_ERROR(DATA, "%s: cannot open token shard: %s", path, strerror(e));
      return dt_err_from_errno(e);
    }
    dl->map_bytes = (size_t)(DT_SHARD_HEADER * 4 + dl->ntok_of[s] * 2);
    dl->map = mmap(NULL, dl->map_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (dl->map == MAP_FAILED) {
      dl->map = NULL;
      DT_ERROR(DATA, "%s: mmap failed: %s", path, strerror(errno));
      return DT_EIO;
    }
    dl->tokens = (const uint16_t *)((const char *)dl->map + DT_SHARD_HEADER * 4);
    dl->ntok = dl->ntok_of[s];
    dl->loaded = (int)s;
    if (!dl->checked[s]) {
      for (int64_t i = 0; i < dl->ntok; i++) {
        if (dl->tokens[i] >= dl->vocab) {
          DT_ERROR(DATA, "%s: token %u at position %lld is >= vocab %d", path, dl->tokens[i],
                   (long long)i, dl->vocab);
          unload_shard(dl);
          return DT_ERANGE;
        }
      }
      dl->checked[s] = 1;
    }
  }
  dl->nwindows = (dl->ntok - 1) / window_tokens(dl);
  free(dl->window_order);
  dl->window_order = NULL;
  if (dl->shuffle) {
    dl->window_order = malloc((size_t)dl->nwindows * sizeof(int64_t));
    if (!dl->window_order)
      return DT_ENOMEM;
    dt_rng_t rng;
    dt_rng_seed(&rng, dl->seed ^ SHUFFLE_WINDOWS_SALT ^ ((uint64_t)dl->pos.epoch << 32) ^
                          (uint64_t)s * 0x9E3779B97F4A7C15ull);
    dt_rng_permutation(&rng, dl->window_order, dl->nwindows);
  }
  return 0;
}

static void draw_shard_order(dt_dataloader_t *dl)
{
  if (dl->shuffle) {
    dt_rng_t rng;
    dt_rng_seed(&rng, dl->seed ^ SHUFFLE_SHARDS_SALT ^ ((uint64_t)dl->pos.epoch << 32));
    dt_rng_permutation(&rng, dl->shard_order, dl->nshards);
  } else {
    for (int i = 0; i < dl->nshards; i++)
      dl->shard_order[i] = i;
  }
}

/* One source: the shards matching pattern. */
static int open_source(dt_dataloader_t *dl, const char *pattern, int B, int T, int rank, int world,
                       int accum, int vocab, int shuffle, uint64_t seed)
{
  int ret = 0;
  glob_t g;
  memset(dl, 0, sizeof *dl);
  dl->loaded = -1;
  if (B < 1 || T < 1 || world < 1 || rank < 0 || rank >= world || accum < 1 || vocab < 1) {
    DT_ERROR(DATA, "invalid data loader arguments: B=%d T=%d rank=%d world=%d accum=%d vocab=%d", B,
             T, rank, world, accum, vocab);
    return DT_EINVAL;
  }
  dl->B = B, dl->T = T, dl->rank = rank, dl->world = world, dl->accum = accum, dl->vocab = vocab;
  dl->shuffle = shuffle, dl->seed = seed;
  int grc = glob(pattern, GLOB_ERR, NULL, &g);
  if (grc != 0) {
    DT_ERROR(DATA, "%s: no token shard matches this path or pattern", pattern);
    if (grc != GLOB_NOMATCH)
      globfree(&g);
    return DT_ENOENT;
  }
  dl->nshards = (int)g.gl_pathc; /* glob sorts the names */
  dl->paths = calloc((size_t)dl->nshards, sizeof(char *));
  dl->ntok_of = calloc((size_t)dl->nshards, sizeof(int64_t));
  dl->shard_order = calloc((size_t)dl->nshards, sizeof(int64_t));
  dl->checked = calloc((size_t)dl->nshards, 1);
  dl->inputs = calloc((size_t)B * T, sizeof(int));
  dl->targets = calloc((size_t)B * T, sizeof(int));
  if (!dl->paths || !dl->ntok_of || !dl->shard_order || !dl->checked || !dl->inputs ||
      !dl->targets) {
    ret = DT_ENOMEM;
    goto fail;
  }
  for (int i = 0; i < dl->nshards; i++) {
    dl->paths[i] = strdup(g.gl_pathv[i]);
    if (!dl->paths[i]) {
      ret = DT_ENOMEM;
      goto fail;
    }
    DT_CHECK_GOTO(shard_check_header(dl->paths[i], &dl->ntok_of[i]), ret, fail);
    if (dl->ntok_of[i] < window_tokens(dl) + 1) {
      DT_ERROR(DATA,
               "%s: %lld tokens is too few for one step: need at least %lld "
               "(world %d x batch %d x accum %d x seq %d + 1)",
               dl->paths[i], (long long)dl->ntok_of[i], (long long)window_tokens(dl) + 1, world, B,
               accum, T);
      ret = DT_EFORMAT;
      goto fail;
    }
  }
  globfree(&g);
  DT_CHECK_GOTO(dt_dataloader_reset(dl), ret, fail_noglob);
  return 0;
fail:
  globfree(&g);
fail_noglob:
  dt_dataloader_free(dl);
  return ret;
}

static int blend_seek(dt_dataloader_t *dl, dt_data_pos_t pos);
static int seek_window_index(dt_dataloader_t *dl, int64_t w, int64_t seqs);

/* A position's global sequence count as whole windows of this loader (rounded down, with a
 * warning, when the global batch changed). */
static int64_t whole_windows(const dt_dataloader_t *dl, int64_t seqs, const char *where)
{
  const int64_t unit = window_seqs(dl);
  if (seqs % unit)
    DT_WARN(DATA,
            "the data position (%lld sequences %s) is not at a step boundary of this run's "
            "%lld-sequence steps (the global batch changed): going on from %lld",
            (long long)seqs, where, (long long)unit, (long long)(seqs / unit * unit));
  return seqs / unit;
}

int dt_dataloader_seek(dt_dataloader_t *dl, dt_data_pos_t pos)
{
  if (dl->nsrc)
    return blend_seek(dl, pos);
  if (pos.blend) {
    if (pos.seqs < 0) {
      DT_ERROR(DATA, "invalid data position: %lld sequences", (long long)pos.seqs);
      return DT_ERANGE;
    }
    const int64_t w = whole_windows(dl, pos.seqs, "into the run");
    DT_INFO(DATA,
            "the checkpoint's run read a blend of sources; this run reads one, from window %lld of "
            "its stream (%lld sequences in)",
            (long long)w, (long long)pos.seqs);
    return seek_window_index(dl, w, w * window_seqs(dl));
  }
  const int64_t unit = window_seqs(dl);
  /* Older checkpoints counted windows of world*B sequences, one per micro-step. */
  const int64_t saved = pos.unit ? pos.unit : unit / dl->accum;
  /* A window past every shard's end (or its sequence count past 64 bits) is as invalid as a
   * negative one: checked before the conversion below multiplies by it. */
  if (pos.epoch < 0 || pos.shard < 0 || pos.shard >= dl->nshards || pos.window < 0 || saved < 1 ||
      pos.window > INT64_MAX / saved) {
    DT_ERROR(DATA,
             "invalid data position epoch=%lld shard=%lld window=%lld of %lld sequences (%d "
             "shards)",
             (long long)pos.epoch, (long long)pos.shard, (long long)pos.window, (long long)saved,
             dl->nshards);
    return DT_ERANGE;
  }
  if (saved != unit)
    pos.window = whole_windows(dl, pos.window * saved, "into the shard");
  pos.unit = unit;
  pos.blend = 0;
  dl->pos = pos;
  dl->micro = 0;
  draw_shard_order(dl);
  DT_CHECK(load_shard(dl, dl->shard_order[pos.shard]));
  if (pos.window > dl->nwindows) {
    DT_ERROR(DATA, "data position window %lld is past the end of %s (%lld windows)",
             (long long)pos.window, dl->paths[dl->loaded], (long long)dl->nwindows);
    return DT_ERANGE;
  }
  return 0;
}

/* Moves a loader of one source to the w-th window of its stream (epochs and shards in their
 * order), read after seqs global sequences. */
static int seek_window_index(dt_dataloader_t *dl, int64_t w, int64_t seqs)
{
  const int64_t per_epoch = dt_dataloader_epoch_windows(dl);
  dt_data_pos_t pos = {.epoch = w / per_epoch, .unit = window_seqs(dl), .seqs = seqs};
  int64_t rest = w % per_epoch;
  dl->pos.epoch = pos.epoch;
  draw_shard_order(dl);
  for (;; pos.shard++) {
    const int64_t n = (dl->ntok_of[dl->shard_order[pos.shard]] - 1) / window_tokens(dl);
    if (rest < n)
      break;
    rest -= n;
  }
  pos.window = rest;
  return dt_dataloader_seek(dl, pos);
}

int dt_dataloader_reset(dt_dataloader_t *dl)
{
  dt_data_pos_t zero = {0};
  zero.unit = window_seqs(dl);
  return dt_dataloader_seek(dl, zero);
}

/* The next micro-batch of one source into inputs/targets ((B, T) each), or past it when they
 * are NULL. */
static int advance(dt_dataloader_t *dl, int *inputs, int *targets)
{
  if (dl->micro == 0 && dl->pos.window >= dl->nwindows) {
    /* Next shard, or the next epoch after the last one. */
    dl->pos.window = 0;
    if (++dl->pos.shard >= dl->nshards) {
      dl->pos.shard = 0;
      dl->pos.epoch++;
      draw_shard_order(dl);
    }
    DT_CHECK(load_shard(dl, dl->shard_order[dl->pos.shard]));
  }
  int64_t w = dl->shuffle ? dl->window_order[dl->pos.window] : dl->pos.window;
  const uint16_t *src = dl->tokens + w * window_tokens(dl) +
                        ((int64_t)dl->micro * dl->world + dl->rank) * dl->B * dl->T;
  const size_t n = inputs ? (size_t)dl->B * dl->T : 0;
  for (size_t i = 0; i < n; i++) {
    inputs[i] = src[i];
    targets[i] = src[i + 1];
  }
  if (++dl->micro == dl->accum) {
    dl->micro = 0;
    dl->pos.window++;
    dl->pos.seqs += window_seqs(dl);
  }
  return 0;
}

static int blend_next(dt_dataloader_t *dl);

int dt_dataloader_next(dt_dataloader_t *dl)
{
  return dl->nsrc ? blend_next(dl) : advance(dl, dl->inputs, dl->targets);
}

static int64_t blend_windows_within(const dt_dataloader_t *dl, int64_t max);

int64_t dt_dataloader_windows_within(const dt_dataloader_t *dl, int64_t max)
{
  if (dl->nsrc)
    return blend_windows_within(dl, max);
  const int64_t n = dt_dataloader_epoch_windows(dl);
  return n < max ? n : max;
}

int64_t dt_dataloader_epoch_windows(const dt_dataloader_t *dl)
{
  if (dl->nsrc)
    return -1;
  int64_t total = 0;
  for (int i = 0; i < dl->nshards; i++)
    total += (dl->ntok_of[i] - 1) / window_tokens(dl);
  return total;
}

/* ------------------------------------------------------------------------------------------ */
/* Blends                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* The source of global sequence i, given the counts taken dealt before it (Megatron-LM's
 * build_blending_indices rule). */
static int blend_pick(const dt_dataloader_t *dl, const int64_t *taken, int64_t i)
{
  const double x = i > 1 ? (double)i : 1.0;
  int best = 0;
  double best_err = dl->weight[0] * x - (double)taken[0];
  for (int d = 1; d < dl->nsrc; d++) {
    const double err = dl->weight[d] * x - (double)taken[d];
    if (err > best_err)
      best = d, best_err = err;
  }
  return best;
}

/* Deals the first max windows' sequences until a source would give one of its pass again. */
static int64_t blend_windows_within(const dt_dataloader_t *dl, int64_t max)
{
  int64_t taken[DT_BLEND_MAX] = {0}, pass[DT_BLEND_MAX];
  const int64_t unit = window_seqs(dl);
  for (int d = 0; d < dl->nsrc; d++)
    pass[d] = dt_dataloader_epoch_windows(&dl->src[d]);
  for (int64_t i = 0; i < max * unit; i++) {
    const int d = blend_pick(dl, taken, i);
    if (taken[d]++ == pass[d])
      return i / unit;
  }
  return max;
}

static int blend_open(dt_dataloader_t *dl, const char *spec, int B, int T, int rank, int world,
                      int accum, int vocab, int shuffle, uint64_t seed)
{
  char why[512];
  dt_blend_t b;
  memset(dl, 0, sizeof *dl);
  dl->loaded = -1;
  if (dt_blend_parse(spec, &b, why, sizeof why) != 0) {
    DT_ERROR(DATA, "%s: %s", spec, why);
    return DT_EINVAL;
  }
  int ret = 0;
  if (B < 1 || T < 1 || world < 1 || rank < 0 || rank >= world || accum < 1) {
    DT_ERROR(DATA, "invalid data loader arguments: B=%d T=%d rank=%d world=%d accum=%d", B, T, rank,
             world, accum);
    ret = DT_EINVAL;
    goto out;
  }
  dl->B = B, dl->T = T, dl->rank = rank, dl->world = world, dl->accum = accum, dl->vocab = vocab;
  dl->nsrc = b.n;
  dl->src = calloc((size_t)b.n, sizeof *dl->src);
  dl->src_pattern = calloc((size_t)b.n, sizeof(char *));
  dl->weight = calloc((size_t)b.n, sizeof(double));
  dl->inputs = calloc((size_t)B * T, sizeof(int));
  dl->targets = calloc((size_t)B * T, sizeof(int));
  dl->row_src = calloc((size_t)B, sizeof(int));
  if (!dl->src || !dl->src_pattern || !dl->weight || !dl->inputs || !dl->targets || !dl->row_src) {
    ret = DT_ENOMEM;
    goto out;
  }
  double sum = 0.0;
  for (int d = 0; d < b.n; d++)
    sum += b.weight[d];
  uint64_t h = dt_fnv1a(DT_FNV1A_INIT, &b.n, sizeof b.n);
  for (int d = 0; d < b.n; d++) {
    dt_dataloader_t *s = &dl->src[d];
    DT_CHECK_GOTO(open_source(s, b.pattern[d], 1, T, 0, 1, 1, vocab, shuffle,
                              seed + (uint64_t)(d + 1) * BLEND_SOURCE_SEED),
                  ret, out);
    dl->src_pattern[d] = b.pattern[d], b.pattern[d] = NULL;
    memcpy(dl->src_name[d], b.name[d], DT_NAME_MAX);
    dl->weight[d] = b.weight[d] / sum;
    h = dt_fnv1a(h, &dl->weight[d], sizeof dl->weight[d]);
    h = dt_fnv1a(h, &s->nshards, sizeof s->nshards);
    h = dt_fnv1a(h, s->ntok_of, (size_t)s->nshards * sizeof *s->ntok_of);
    DT_INFO(DATA, "blend source %d (%s): %s, weight %.4f: %d shard%s, %lld sequences of %d a pass",
            d + 1, dl->src_name[d], dl->src_pattern[d], dl->weight[d], s->nshards,
            s->nshards == 1 ? "" : "s", (long long)dt_dataloader_epoch_windows(s), T);
  }
  dl->fingerprint = h ? h : 1; /* 0 means one source */
  ret = dt_dataloader_reset(dl);
out:
  dt_blend_free(&b);
  if (ret != 0)
    dt_dataloader_free(dl);
  return ret;
}

static int blend_seek(dt_dataloader_t *dl, dt_data_pos_t pos)
{
  const int64_t unit = window_seqs(dl);
  if (pos.seqs < 0 || pos.nsrc < 0 || pos.nsrc > DT_BLEND_MAX) {
    DT_ERROR(DATA, "invalid data position: %lld sequences, %d sources", (long long)pos.seqs,
             pos.nsrc);
    return DT_ERANGE;
  }
  const int64_t n = whole_windows(dl, pos.seqs, "into the run") * unit;
  if (pos.blend == dl->fingerprint && pos.nsrc == dl->nsrc && n == pos.seqs) {
    int64_t left = n;
    for (int d = 0; d < pos.nsrc && left >= 0; d++)
      left = pos.taken[d] < 0 || pos.taken[d] > left ? -1 : left - pos.taken[d];
    if (left != 0) {
      DT_ERROR(DATA, "invalid data position: the sources' counts do not add up to %lld sequences",
               (long long)n);
      return DT_ERANGE;
    }
    memcpy(dl->taken, pos.taken, sizeof dl->taken);
  } else {
    /* Checkpoints of one source's run, of another blend or batch: deal the sequences again. */
    if (n > 0)
      DT_INFO(DATA,
              "the checkpoint's run read %s: this blend goes on where its sources would be after "
              "%lld sequences",
              pos.blend == 0                 ? "one source"
              : pos.blend != dl->fingerprint ? "another blend (other weights or shards)"
                                             : "this blend in steps of another size",
              (long long)n);
    memset(dl->taken, 0, sizeof dl->taken);
    for (int64_t i = 0; i < n; i++)
      dl->taken[blend_pick(dl, dl->taken, i)]++;
  }
  for (int d = 0; d < dl->nsrc; d++) {
    dt_dataloader_t *s = &dl->src[d];
    DT_CHECK(seek_window_index(s, dl->taken[d], dl->taken[d]));
  }
  dl->pos = (dt_data_pos_t){
      .window = n / unit, .unit = unit, .seqs = n, .blend = dl->fingerprint, .nsrc = dl->nsrc};
  memcpy(dl->pos.taken, dl->taken, sizeof dl->taken);
  dl->micro = 0;
  return 0;
}

/* The micro-batch's sequences are global sequences [first, first + world*B) of which this rank
 * reads B; every rank deals all of them, so each source advances past the others' rows. */
static int blend_next(dt_dataloader_t *dl)
{
  const int64_t per_micro = (int64_t)dl->world * dl->B;
  const int64_t first = dl->pos.seqs + dl->micro * per_micro;
  for (int64_t j = 0; j < per_micro; j++) {
    const int d = blend_pick(dl, dl->taken, first + j);
    dl->taken[d]++;
    const int64_t row = j - (int64_t)dl->rank * dl->B;
    const int mine = row >= 0 && row < dl->B;
    if (mine)
      dl->row_src[row] = d;
    DT_CHECK(advance(&dl->src[d], mine ? dl->inputs + row * dl->T : NULL,
                     mine ? dl->targets + row * dl->T : NULL));
  }
  if (++dl->micro == dl->accum) {
    dl->micro = 0;
    dl->pos.window++;
    dl->pos.seqs += window_seqs(dl);
    memcpy(dl->pos.taken, dl->taken, sizeof dl->taken);
  }
  return 0;
}

int dt_dataloader_init(dt_dataloader_t *dl, const char *pattern, int B, int T, int rank, int world,
                       int accum, int vocab, int shuffle, uint64_t seed)
{
  if (dt_blend_is(pattern))
    return blend_open(dl, pattern, B, T, rank, world, accum, vocab, shuffle, seed);
  return open_source(dl, pattern, B, T, rank, world, accum, vocab, shuffle, seed);
}

void dt_dataloader_free(dt_dataloader_t *dl)
{
  for (int d = 0; d < dl->nsrc; d++) {
    if (dl->src)
      dt_dataloader_free(&dl->src[d]);
    if (dl->src_pattern)
      free(dl->src_pattern[d]);
  }
  free(dl->src);
  free(dl->src_pattern);
  free(dl->weight);
  free(dl->row_src);
  unload_shard(dl);
  if (dl->paths)
    for (int i = 0; i < dl->nshards; i++)
      free(dl->paths[i]);
  free(dl->paths);
  free(dl->ntok_of);
  free(dl->shard_order);
  free(dl->window_order);
  free(dl->checked);
  free(dl->inputs);
  free(dl->targets);
  memset(dl, 0, sizeof *dl);
  dl->loaded = -1;
}

int dt_shard_begin(dt_afile_t *af, const char *path, int64_t ntok)
{
  if (ntok < 0 || ntok > INT32_MAX) {
    DT_ERROR(DATA, "%s: %lld tokens do not fit one shard (max %d)", path, (long long)ntok,
             INT32_MAX);
    return DT_ERANGE;
  }
  int32_t hdr[DT_SHARD_HEADER] = {DT_SHARD_MAGIC, DT_SHARD_VERSION, (int32_t)ntok};
  DT_CHECK(dt_afile_open(af, path));
  const int rc = dt_afile_write(af, hdr, sizeof hdr);
  if (rc != 0)
    dt_afile_abort(af);
  return rc;
}

int dt_shard_write(const char *path, const uint16_t *tokens, int64_t ntok)
{
  dt_afile_t af;
  DT_CHECK(dt_shard_begin(&af, path, ntok));
  const int rc = dt_afile_write(&af, tokens, (size_t)ntok * sizeof(uint16_t));
  if (rc != 0) {
    dt_afile_abort(&af);
    return rc;
  }
  return dt_afile_commit(&af);
}

int dt_shard_read(const char *path, uint16_t **tokens, int64_t *ntok)
{
  int64_t n;
  DT_CHECK(shard_check_header(path, &n));
  uint16_t *t = malloc((size_t)(n ? n : 1) * sizeof *t);
  FILE *fp = fopen(path, "rb");
  int ret = !t || !fp ? DT_ENOMEM : 0;
  if (ret == 0 && (fseek(fp, DT_SHARD_HEADER * 4, SEEK_SET) != 0 ||
                   fread(t, sizeof *t, (size_t)n, fp) != (size_t)n)) {
    DT_ERROR(DATA, "%s: read failed", path);
    ret = DT_EIO;
  }
  if (fp)
    fclose(fp);
  if (ret != 0) {
    free(t);
    return ret;
  }
  *tokens = t;
  *ntok = n;
  return 0;
}
