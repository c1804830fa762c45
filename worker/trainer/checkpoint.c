/* checkpoint.c — see checkpoint.h for the formats and the commit protocol. */
#include "checkpoint.h"

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

/* ------------------------------------------------------------------------------------------ */
/* llm.c format                                                                                */
/* ------------------------------------------------------------------------------------------ */

#define LLMC_HEADER 256 /* int32 words */

int64_t dt_llmc_num_params(const dt_gpt2_config_t *c)
{
  int64_t n = 0;
#define DT__ADD(name, count, wd) n += (int64_t)(count);
  DT_GPT2_TENSORS(DT__ADD, *c)
#undef DT__ADD
  return n;
}

static int file_size(const char *path, FILE *fp, int64_t *size)
{
  struct stat st;
  if (fstat(fileno(fp), &st) != 0) {
    DT_ERROR(CKPT, "%s: stat failed: %s", path, strerror(errno));
    return DT_EIO;
  }
  *size = st.st_size;
  return 0;
}

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

static int llmc_read_header(const char *path, FILE *fp, dt_gpt2_config_t *cfg)
{
  int32_t h[LLMC_HEADER];
  int64_t size;
  DT_CHECK(file_size(path, fp, &size));
  if (fread(h, sizeof h, 1, fp) != 1) {
    DT_ERROR(CKPT,
             "%s: truncated llm.c checkpoint: expected a %zu-byte header, file has %lld "
             "bytes",
             path, sizeof h, (long long)size);
    return DT_EFORMAT;
  }
  if (h[0] != DT_LLMC_MAGIC) {
    DT_ERROR(CKPT, "%s: bad magic %d: expected %d (llm.c model checkpoint)", path, h[0],
             DT_LLMC_MAGIC);
    return DT_EFORMAT;
  }
  if (h[1] != DT_LLMC_VERSION) {
    DT_ERROR(CKPT, "%s: llm.c checkpoint version %d is not supported: expected %d (fp32)%s", path,
             h[1], DT_LLMC_VERSION, h[1] == 5 ? "; version 5 is bf16" : "");
    return DT_EFORMAT;
  }
  cfg->max_seq = h[2], cfg->vocab = h[3], cfg->layers = h[4], cfg->heads = h[5];
  cfg->channels = h[6], cfg->padded_vocab = h[7];
  char why[256];
  if (dt_gpt2_config_validate(cfg, why, sizeof why) != 0) {
    DT_ERROR(CKPT, "%s: invalid model config in header: %s", path, why);
    return DT_EFORMAT;
  }
  int64_t expect = (int64_t)sizeof h + dt_llmc_num_params(cfg) * 4;
  if (size != expect) {
    DT_ERROR(CKPT, "%s: file is %lld bytes, expected %lld for its header's model%s", path,
             (long long)size, (long long)expect, size < expect ? " (truncated)" : "");
    return DT_EFORMAT;
  }
  return 0;
}

int dt_llmc_read_config(const char *path, dt_gpt2_config_t *cfg)
{
  int ret = 0;
  FILE *fp = open_read(path, &ret);
  if (!fp)
    return ret;
  ret = llmc_read_header(path, fp, cfg);
  fclose(fp);
  return ret;
}

static int config_equal(const dt_gpt2_config_t *a, const dt_gpt2_config_t *b)
{
  return a->max_seq == b->max_seq && a->vocab == b->vocab && a->padded_vocab == b->padded_vocab &&
         a->layers == b->layers && a->heads == b->heads && a->channels == b->channels;
}

static void config_str(const dt_gpt2_config_t *c, char *buf, size_t n)
{
  snprintf(buf, n, "L=%d NH=%d C=%d V=%d Vp=%d maxT=%d", c->layers, c->heads, c->channels, c->vocab,
           c->padded_vocab, c->max_seq);
}

static int config_mismatch(const char *path, const dt_gpt2_config_t *want,
                           const dt_gpt2_config_t *have)
{
  char a[128], b[128];
  config_str(want, a, sizeof a);
  config_str(have, b, sizeof b);
  DT_ERROR(CKPT, "%s: checkpoint model (%s) does not match the configured model (%s)", path, b, a);
  return DT_ESHAPE;
}

/* wte's rows past the vocabulary (the file's first tensor, padded_vocab x channels) set to zero,
 * as llm.c's own files and distrain's initialisation hold them: no token reads them, but a GPU's
 * LM head runs over the padded vocabulary (ops.h's padded_head), where a NaN there would reach
 * every input gradient. Other values are said. */
static void zero_padded_rows(const char *path, const dt_gpt2_config_t *c, float *wte)
{
  size_t changed = 0;
  for (size_t i = (size_t)c->vocab * c->channels; i < (size_t)c->padded_vocab * c->channels; i++) {
    changed += wte[i] != 0.0f; /* NaN too */
    wte[i] = 0.0f;
  }
  if (changed)
    DT_WARN(CKPT,
            "%s: %zu values of wte's padded rows [%d, %d) were not zero; set to zero (no token "
            "reads them)",
            path, changed, c->vocab, c->padded_vocab);
}

int dt_llmc_load(dt_gpt2_t *m, const char *path)
{
  int ret = 0;
  dt_gpt2_config_t cfg;
  FILE *fp = open_read(path, &ret);
  if (!fp)
    return ret;
  DT_CHECK_GOTO(llmc_read_header(path, fp, &cfg), ret, out);
  if (!config_equal(&cfg, &m->cfg)) {
    ret = config_mismatch(path, &m->cfg, &cfg);
    goto out;
  }
  /* The file holds the whole model: a model-parallel rank reads it, then keeps its part. */
  float *global = m->num_params == m->global_params && m->dev->host
                      ? m->params_flat
                      : dt_calloc_aligned(m->global_params * sizeof(float), "weights");
  if (!global) {
    ret = DT_ENOMEM;
    goto out;
  }
  if (fread(global, sizeof(float), m->global_params, fp) != m->global_params) {
    DT_ERROR(CKPT, "%s: short read of %zu parameters", path, m->global_params);
    ret = DT_EIO;
    goto done;
  }
  zero_padded_rows(path, &cfg, global);
  if (global != m->params_flat) {
    ret = dt_gpt2_load_global(m, global);
  } else {
    dt_gpt2_params_written(m);
  }
done:
  if (global != m->params_flat)
    dt_free_aligned(global);
out:
  fclose(fp);
  return ret;
}

int dt_ckpt_load_weights(dt_gpt2_t *m, const char *path, int64_t *step)
{
  const int64_t n = (int64_t)m->global_params;
  float *global = dt_calloc_aligned((size_t)n * sizeof(float), "weights");
  if (!global)
    return DT_ENOMEM;
  dt_train_state_t state = {0};
  int ret = dt_ckpt_load_range(path, &m->cfg, n, 0, n, global, NULL, NULL, &state);
  if (ret == 0)
    ret = dt_gpt2_load_global(m, global);
  if (ret == 0)
    *step = state.step;
  dt_free_aligned(global);
  return ret;
}

int dt_llmc_read(const char *path, dt_gpt2_config_t *cfg, float **params)
{
  int ret = 0;
  FILE *fp = open_read(path, &ret);
  if (!fp)
    return ret;
  float *p = NULL;
  DT_CHECK_GOTO(llmc_read_header(path, fp, cfg), ret, out);
  const size_t n = (size_t)dt_llmc_num_params(cfg);
  p = malloc(n * sizeof *p);
  if (!p) {
    ret = DT_ENOMEM;
    goto out;
  }
  if (fread(p, sizeof *p, n, fp) != n) {
    DT_ERROR(CKPT, "%s: short read of %zu parameters", path, n);
    ret = DT_EIO;
    goto out;
  }
  zero_padded_rows(path, cfg, p);
  *params = p;
  p = NULL;
out:
  free(p);
  fclose(fp);
  return ret;
}

int dt_llmc_save_params(const dt_gpt2_config_t *c, const float *params, size_t n, const char *path)
{
  int32_t h[LLMC_HEADER] = {DT_LLMC_MAGIC, DT_LLMC_VERSION, c->max_seq,  c->vocab,
                            c->layers,     c->heads,        c->channels, c->padded_vocab};
  dt_afile_t af;
  int ret = 0;
  DT_CHECK(dt_afile_open(&af, path));
  DT_CHECK_GOTO(dt_afile_write(&af, h, sizeof h), ret, fail);
  DT_CHECK_GOTO(dt_afile_write(&af, params, n * sizeof(float)), ret, fail);
  return dt_afile_commit(&af);
fail:
  dt_afile_abort(&af);
  return ret;
}

int dt_llmc_save(const dt_gpt2_t *m, const char *path)
{
  return dt_llmc_save_params(&m->cfg, m->params_flat, m->num_params, path);
}

/* ------------------------------------------------------------------------------------------ */
/* distrain checkpoints                                                                        */
/* ------------------------------------------------------------------------------------------ */

/* Shard file versions: 1 holds the global flat range [lo, hi); 2 holds nruns (global offset,
 * length) pairs after the header, then the data of those runs in order, so a tensor-parallel
 * rank's non-contiguous part of the model is one shard. In version 2, [lo, hi) is the shard's
 * place in the concatenation of all shards (what the manifest tiles). 3 (written for runs on a
 * blend of data sources; 2 otherwise, which older builds read) is 2 with data_nsrc int64 after
 * the run table: the global sequences dealt to each source (dataloader.h). */
#define CKPT_SHARD_VERSION 2
#define CKPT_BLEND_VERSION 3
#define CKPT_FLAG_OPTIM    1u
#define CKPT_FLAG_UPDATES  2u /* the updates field is set (padding, hence zero, before it) */
typedef struct {
  uint32_t magic, version, header_bytes, flags;
  int32_t max_seq, vocab, padded_vocab, layers, heads, channels;
  int32_t rank, world;
  int64_t step, num_params, lo, hi;
  int64_t data_epoch, data_shard, data_window;
  uint64_t rng[4];
  uint64_t payload_bytes; /* run table included */
  uint32_t payload_crc32c;
  int32_t threads;        /* compute threads of the writer (GEMM rounding depends on it) */
  uint32_t header_crc32c; /* CRC-32C of this header with this field zero */
  uint32_t data_unit;     /* sequences per data window (0 before the field existed) */
  int64_t nruns;          /* version 2 */
  int64_t data_seqs;      /* global sequences read (0 before the field existed) */
  uint64_t data_blend;    /* fingerprint of the blend read (0: one source) */
  int64_t data_nsrc;      /* version 3: the blend's sources */
  double loss_avg;        /* dt_train_state_t's (0 before the fields existed) */
  int64_t loss_steps;
  int64_t updates; /* with CKPT_FLAG_UPDATES */
  double norm_avg; /* dt_train_state_t's (0 before the fields existed) */
  int64_t norm_steps;
  int64_t skip_until;
  uint8_t pad[16]; /* to 256 bytes (asserted below); zero */
} ckpt_header_t;
_Static_assert(sizeof(ckpt_header_t) == 256, "checkpoint header must stay 256 bytes");

static uint32_t header_crc(const ckpt_header_t *h)
{
  ckpt_header_t copy = *h;
  copy.header_crc32c = 0;
  return dt_crc32c(0, &copy, sizeof copy);
}

int dt_ckpt_write_runs(const dt_gpt2_config_t *cfg, int64_t num_params,
                       const dt_train_state_t *state, const char *dir, int rank, int world,
                       int64_t lo, const dt_gpt2_run_t *runs, size_t nruns, const float *params,
                       const float *m, const float *v, dt_ckpt_shard_info_t *info)
{
  char sdir[4096], path[4200], manifest[4200];
  int ret = 0;
  int64_t n = 0;
  for (size_t i = 0; i < nruns; i++) {
    if (runs[i].global < 0 || runs[i].len < 0 || runs[i].global + runs[i].len > num_params) {
      DT_ERROR(CKPT, "invalid shard run [%lld, %lld) of %lld parameters", (long long)runs[i].global,
               (long long)(runs[i].global + runs[i].len), (long long)num_params);
      return DT_ERANGE;
    }
    n += runs[i].len;
  }
  const int64_t hi = lo + n;
  if (lo < 0 || hi > num_params) {
    DT_ERROR(CKPT, "invalid shard range [%lld, %lld) of %lld parameters", (long long)lo,
             (long long)hi, (long long)num_params);
    return DT_ERANGE;
  }
  dt_ckpt_step_dir(sdir, sizeof sdir, dir, state->step);
  snprintf(manifest, sizeof manifest, "%s/" DT_CKPT_MANIFEST_NAME, sdir);
  if (access(manifest, F_OK) == 0) {
    DT_ERROR(CKPT, "%s: step %lld is already committed; refusing to overwrite it", sdir,
             (long long)state->step);
    return DT_EEXIST;
  }
  int rc = dt_mkdir_p(sdir);
  if (rc != 0) {
    DT_ERROR(CKPT, "%s: cannot create checkpoint directory: %s", sdir, dt_strerror(rc));
    return rc;
  }
  memset(info, 0, sizeof *info);
  info->rank = rank, info->lo = lo, info->hi = hi;
  snprintf(info->name, sizeof info->name, "shard-%05d-of-%05d.bin", rank, world);
  snprintf(path, sizeof path, "%s/%s", sdir, info->name);

  const int has_optim = m != NULL && v != NULL;
  const float *bufs[3] = {params, m, v};
  int64_t *table = malloc((nruns ? nruns : 1) * 2 * sizeof(int64_t));
  if (!table)
    return DT_ENOMEM;
  for (size_t i = 0; i < nruns; i++)
    table[2 * i] = runs[i].global, table[2 * i + 1] = runs[i].len;
  const size_t table_bytes = nruns * 2 * sizeof(int64_t);
  ckpt_header_t h;
  memset(&h, 0, sizeof h);
  const int64_t nsrc = state->data.nsrc;
  const size_t counts_bytes = (size_t)nsrc * sizeof(int64_t);
  h.magic = DT_CKPT_MAGIC, h.header_bytes = sizeof h;
  h.version = nsrc ? CKPT_BLEND_VERSION : CKPT_SHARD_VERSION;
  h.flags = (has_optim ? CKPT_FLAG_OPTIM : 0) | CKPT_FLAG_UPDATES;
  h.max_seq = cfg->max_seq, h.vocab = cfg->vocab, h.padded_vocab = cfg->padded_vocab;
  h.layers = cfg->layers, h.heads = cfg->heads, h.channels = cfg->channels;
  h.rank = rank, h.world = world;
  h.step = state->step, h.num_params = num_params, h.lo = lo, h.hi = hi;
  h.data_epoch = state->data.epoch, h.data_shard = state->data.shard;
  h.data_window = state->data.window;
  h.data_unit = (uint32_t)state->data.unit;
  h.data_seqs = state->data.seqs, h.data_blend = state->data.blend, h.data_nsrc = nsrc;
  memcpy(h.rng, state->rng.s, sizeof h.rng);
  h.threads = state->threads;
  h.loss_avg = state->loss_avg, h.loss_steps = state->loss_steps;
  h.updates = state->updates;
  h.norm_avg = state->norm_avg, h.norm_steps = state->norm_steps;
  h.skip_until = state->skip_until;
  h.nruns = (int64_t)nruns;
  uint32_t crc = dt_crc32c(dt_crc32c(0, table, table_bytes), state->data.taken, counts_bytes);
  h.payload_bytes = table_bytes + counts_bytes;
  for (int k = 0; k < (has_optim ? 3 : 1); k++) {
    for (size_t i = 0; i < nruns; i++)
      crc = dt_crc32c(crc, bufs[k] + runs[i].local, (size_t)runs[i].len * sizeof(float));
    h.payload_bytes += (uint64_t)n * sizeof(float);
  }
  h.payload_crc32c = crc;
  h.header_crc32c = header_crc(&h);

  dt_afile_t af;
  DT_CHECK_GOTO(dt_afile_open(&af, path), ret, out);
  DT_CHECK_GOTO(dt_afile_write(&af, &h, sizeof h), ret, fail);
  DT_CHECK_GOTO(dt_afile_write(&af, table, table_bytes), ret, fail);
  DT_CHECK_GOTO(dt_afile_write(&af, state->data.taken, counts_bytes), ret, fail);
  for (int k = 0; k < (has_optim ? 3 : 1); k++)
    for (size_t i = 0; i < nruns; i++)
      DT_CHECK_GOTO(
          dt_afile_write(&af, bufs[k] + runs[i].local, (size_t)runs[i].len * sizeof(float)), ret,
          fail);
  DT_CHECK_GOTO(dt_afile_commit(&af), ret, out);
  info->bytes = sizeof h + h.payload_bytes;
  info->crc32c = crc;
  goto out;
fail:
  dt_afile_abort(&af);
out:
  free(table);
  return ret;
}

int dt_ckpt_write_range(const dt_gpt2_config_t *cfg, int64_t num_params,
                        const dt_train_state_t *state, const char *dir, int rank, int world,
                        const dt_ckpt_range_t *rg, dt_ckpt_shard_info_t *info)
{
  if (rg->lo < 0 || rg->hi > num_params || rg->lo > rg->hi) {
    DT_ERROR(CKPT, "invalid shard range [%lld, %lld) of %lld parameters", (long long)rg->lo,
             (long long)rg->hi, (long long)num_params);
    return DT_ERANGE;
  }
  dt_gpt2_run_t run = {.global = rg->lo, .local = 0, .len = rg->hi - rg->lo};
  return dt_ckpt_write_runs(cfg, num_params, state, dir, rank, world, rg->lo, &run, 1, rg->params,
                            rg->m, rg->v, info);
}

int dt_ckpt_write_shard(const dt_gpt2_t *m, const dt_train_state_t *state, const char *dir,
                        int rank, int world, int64_t lo, int64_t hi, dt_ckpt_shard_info_t *info)
{
  if (lo < 0 || hi > (int64_t)m->num_params || lo > hi) {
    DT_ERROR(CKPT, "invalid shard range [%lld, %lld) of %zu parameters", (long long)lo,
             (long long)hi, m->num_params);
    return DT_ERANGE;
  }
  dt_ckpt_range_t rg = {lo, hi, m->params_flat + lo, m->m_flat ? m->m_flat + lo : NULL,
                        m->v_flat ? m->v_flat + lo : NULL};
  return dt_ckpt_write_range(&m->cfg, (int64_t)m->num_params, state, dir, rank, world, &rg, info);
}

/* Reads and checks one shard header against the manifest entry. */
static int shard_open(const char *sdir, const dt_ckpt_shard_info_t *s, ckpt_header_t *h, FILE **fpo,
                      char *path, size_t pathn)
{
  int ret = 0;
  int64_t size;
  snprintf(path, pathn, "%s/%s", sdir, s->name);
  FILE *fp = open_read(path, &ret);
  if (!fp)
    return ret;
  DT_CHECK_GOTO(file_size(path, fp, &size), ret, fail);
  if (fread(h, sizeof *h, 1, fp) != 1 || h->magic != DT_CKPT_MAGIC) {
    DT_ERROR(CKPT, "%s: not a distrain checkpoint shard (expected magic 0x%08x)", path,
             DT_CKPT_MAGIC);
    ret = DT_EFORMAT;
    goto fail;
  }
  if (h->version < 1 || h->version > CKPT_BLEND_VERSION || h->header_bytes != sizeof *h) {
    DT_ERROR(CKPT,
             "%s: checkpoint version %u (header %u bytes): expected version 1 to %d (%zu bytes)",
             path, h->version, h->header_bytes, CKPT_BLEND_VERSION, sizeof *h);
    ret = DT_EFORMAT;
    goto fail;
  }
  if (h->header_crc32c != header_crc(h)) {
    DT_ERROR(CKPT, "%s: header checksum mismatch: the shard header is corrupt", path);
    ret = DT_EFORMAT;
    goto fail;
  }
  if (h->version == 1)
    h->nruns = 1; /* the range itself (the field was padding, hence zero, in version 1) */
  if (h->version < CKPT_BLEND_VERSION)
    h->data_nsrc = 0; /* padding before */
  /* The run table and the floats must fit the file: bounded first, so that the sizes below
   * cannot wrap around (a wrapped count once let a short table pass as a long one). */
  const int64_t room = size - (int64_t)sizeof *h;
  const int sections = (h->flags & CKPT_FLAG_OPTIM) ? 3 : 1;
  const int fits = room >= 0 && h->nruns >= 0 && h->nruns <= room / 16 && h->lo >= 0 &&
                   h->hi >= h->lo && h->hi - h->lo <= room / 4 / sections && h->data_nsrc >= 0 &&
                   h->data_nsrc <= DT_BLEND_MAX;
  uint64_t nfloats = fits ? (uint64_t)(h->hi - h->lo) * sections : 0;
  uint64_t table = h->version == 1 || !fits ? 0 : (uint64_t)h->nruns * 16;
  uint64_t counts = fits ? (uint64_t)h->data_nsrc * 8 : 0;
  if (!fits || (uint64_t)size != s->bytes || h->payload_bytes != table + counts + nfloats * 4 ||
      (uint64_t)size != sizeof *h + h->payload_bytes || h->lo != s->lo || h->hi != s->hi) {
    DT_ERROR(CKPT,
             "%s: size %lld bytes / range [%lld, %lld) disagree with the manifest "
             "(%llu bytes, [%lld, %lld))",
             path, (long long)size, (long long)h->lo, (long long)h->hi,
             (unsigned long long)s->bytes, (long long)s->lo, (long long)s->hi);
    ret = DT_EFORMAT;
    goto fail;
  }
  *fpo = fp;
  return 0;
fail:
  fclose(fp);
  return ret;
}

static void header_config(const ckpt_header_t *h, dt_gpt2_config_t *c)
{
  c->max_seq = h->max_seq, c->vocab = h->vocab, c->padded_vocab = h->padded_vocab;
  c->layers = h->layers, c->heads = h->heads, c->channels = h->channels;
}

int dt_ckpt_read_config(const char *path, dt_gpt2_config_t *cfg)
{
  char sdir[4096], spath[4200];
  dt_ckpt_manifest_t mf;
  ckpt_header_t h;
  FILE *fp;
  DT_CHECK(dt_ckpt_resolve_step_dir(path, sdir, sizeof sdir));
  DT_CHECK(dt_ckpt_manifest_read(sdir, &mf));
  int ret = shard_open(sdir, &mf.shards[0], &h, &fp, spath, sizeof spath);
  free(mf.shards);
  if (ret != 0)
    return ret;
  fclose(fp);
  header_config(&h, cfg);
  return 0;
}

/* Wanted runs sorted by global offset, for the merge with a shard's runs. */
static int cmp_run_global(const void *a, const void *b)
{
  const dt_gpt2_run_t *x = a, *y = b;
  return x->global < y->global ? -1 : x->global > y->global;
}

/* Copies the part of global [g, g + k) (values in src) that the wanted runs ask for; counts
 * the elements delivered. want is sorted by global offset and non-overlapping. */
static void deliver(const dt_gpt2_run_t *want, size_t nwant, int64_t g, size_t k, const float *src,
                    float *dst, int64_t *delivered)
{
  /* the first wanted run that ends after g */
  size_t lo = 0, hi = nwant;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (want[mid].global + want[mid].len <= g)
      lo = mid + 1;
    else
      hi = mid;
  }
  for (size_t i = lo; i < nwant && want[i].global < g + (int64_t)k; i++) {
    int64_t a = DT_MAX(g, want[i].global), b = DT_MIN(g + (int64_t)k, want[i].global + want[i].len);
    if (a >= b)
      continue;
    if (dst)
      memcpy(dst + want[i].local + (a - want[i].global), src + (a - g),
             (size_t)(b - a) * sizeof(float));
    *delivered += b - a;
  }
}

static int cmp_pair_global(const void *a, const void *b)
{
  const int64_t *x = a, *y = b;
  return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Whether the shards' runs (all of them: n (global offset, length) pairs) hold each element at
 * most once. Their lengths add up to num_params and each lies inside the model (checked as
 * each table was read), so then they hold every element exactly once; without this check, a
 * run listed twice would make up in the element count for one that is missing, and a load
 * would leave the missing elements unwritten. */
static int runs_disjoint(const char *sdir, int64_t *runs, size_t n)
{
  if (n < 2)
    return 0; /* (runs is NULL when there are none) */
  qsort(runs, n, 2 * sizeof(int64_t), cmp_pair_global);
  for (size_t i = 1; i < n; i++)
    if (runs[2 * (i - 1)] + runs[2 * (i - 1) + 1] > runs[2 * i]) {
      DT_ERROR(CKPT,
               "%s: the shards list global offset %lld twice (runs [%lld, %lld) and [%lld, "
               "%lld)): the checkpoint is corrupt",
               sdir, (long long)runs[2 * i], (long long)runs[2 * (i - 1)],
               (long long)(runs[2 * (i - 1)] + runs[2 * (i - 1) + 1]), (long long)runs[2 * i],
               (long long)(runs[2 * i] + runs[2 * i + 1]));
      return DT_EFORMAT;
    }
  return 0;
}

/* Streams one section (the shard's runs in order, n floats): checksums all of it and delivers
 * the wanted parts to dst. */
static int read_section(FILE *fp, const char *path, const int64_t *table, int64_t nruns,
                        const dt_gpt2_run_t *want, size_t nwant, float *dst, uint32_t *crc,
                        int64_t *delivered)
{
  float buf[16384];
  for (int64_t r = 0; r < nruns; r++) {
    const int64_t g0 = table[2 * r], len = table[2 * r + 1];
    for (int64_t done = 0; done < len;) {
      size_t k = (size_t)DT_MIN(len - done, (int64_t)DT_ARRAY_SIZE(buf));
      if (fread(buf, sizeof(float), k, fp) != k) {
        DT_ERROR(CKPT, "%s: short read", path);
        return DT_EIO;
      }
      *crc = dt_crc32c(*crc, buf, k * sizeof(float));
      deliver(want, nwant, g0 + done, k, buf, dst, delivered);
      done += (int64_t)k;
    }
  }
  return 0;
}

/* The shard's run table: read (version 2) or made from its range (version 1). Checks that the
 * runs hold the shard's element count inside the model. */
static int read_run_table(FILE *fp, const char *path, const ckpt_header_t *h, int64_t **table,
                          uint32_t *crc)
{
  const int64_t nr = h->nruns;
  int64_t *t = malloc((size_t)(nr ? nr : 1) * 2 * sizeof(int64_t)), total = 0;
  if (!t)
    return DT_ENOMEM;
  if (h->version == 1) {
    t[0] = h->lo, t[1] = h->hi - h->lo;
  } else if (fread(t, 2 * sizeof(int64_t), (size_t)nr, fp) != (size_t)nr) {
    DT_ERROR(CKPT, "%s: short read of the run table", path);
    free(t);
    return DT_EIO;
  } else {
    *crc = dt_crc32c(*crc, t, (size_t)nr * 2 * sizeof(int64_t));
  }
  for (int64_t r = 0; r < nr; r++) {
    if (t[2 * r] < 0 || t[2 * r + 1] < 0 || t[2 * r] > h->num_params - t[2 * r + 1]) {
      DT_ERROR(CKPT, "%s: run %lld lies outside the model's %lld parameters", path, (long long)r,
               (long long)h->num_params);
      free(t);
      return DT_EFORMAT;
    }
    total += t[2 * r + 1];
  }
  if (total != h->hi - h->lo) {
    DT_ERROR(CKPT, "%s: runs hold %lld elements, the header says %lld", path, (long long)total,
             (long long)(h->hi - h->lo));
    free(t);
    return DT_EFORMAT;
  }
  *table = t;
  return 0;
}

int dt_ckpt_load_runs(const char *path, const dt_gpt2_config_t *want_cfg, int64_t num_params,
                      const dt_gpt2_run_t *runs, size_t nruns, float *params, float *m, float *v,
                      dt_train_state_t *state)
{
  char sdir[4096], spath[4200];
  dt_ckpt_manifest_t mf;
  int ret = 0;
  int64_t wanted = 0, got[3] = {0, 0, 0};
  dt_gpt2_run_t *want = malloc((nruns ? nruns : 1) * sizeof *want);
  if (!want)
    return DT_ENOMEM;
  memcpy(want, runs, nruns * sizeof *want);
  qsort(want, nruns, sizeof *want, cmp_run_global);
  for (size_t i = 0; i < nruns; i++)
    wanted += want[i].len;
  DT_CHECK_GOTO(dt_ckpt_resolve_step_dir(path, sdir, sizeof sdir), ret, free_want);
  DT_CHECK_GOTO(dt_ckpt_manifest_read(sdir, &mf), ret, free_want);
  int64_t *all = NULL; /* every shard's runs, for runs_disjoint */
  size_t nall = 0;
  if (mf.num_params != num_params) {
    DT_ERROR(CKPT, "%s: checkpoint has %lld parameters, the configured model %lld", sdir,
             (long long)mf.num_params, (long long)num_params);
    ret = DT_ESHAPE;
    goto out;
  }
  for (int r = 0; r < mf.world; r++) {
    ckpt_header_t h;
    FILE *fp;
    int64_t *table = NULL;
    DT_CHECK_GOTO(shard_open(sdir, &mf.shards[r], &h, &fp, spath, sizeof spath), ret, out);
    dt_gpt2_config_t cfg;
    header_config(&h, &cfg);
    if (!config_equal(&cfg, want_cfg)) {
      ret = config_mismatch(spath, want_cfg, &cfg);
      fclose(fp);
      goto out;
    }
    if (h.num_params != mf.num_params) {
      DT_ERROR(CKPT, "%s: the shard is of a %lld-parameter model, the manifest's of %lld", spath,
               (long long)h.num_params, (long long)mf.num_params);
      ret = DT_EFORMAT;
      fclose(fp);
      goto out;
    }
    if (!(h.flags & CKPT_FLAG_OPTIM)) {
      DT_ERROR(CKPT, "%s: shard holds no optimizer state; cannot resume training from it", spath);
      ret = DT_EFORMAT;
      fclose(fp);
      goto out;
    }
    /* Every shard is read whole (its checksum covers all of it); only the parts that the
     * wanted runs ask for are kept, which is what lets any layout load any other's shards. */
    uint32_t crc = 0;
    int64_t taken[DT_BLEND_MAX];
    const size_t counts = (size_t)h.data_nsrc * sizeof *taken;
    ret = read_run_table(fp, spath, &h, &table, &crc);
    if (ret == 0 && fread(taken, 1, counts, fp) != counts) {
      DT_ERROR(CKPT, "%s: short read of the data sources' counts", spath);
      ret = DT_EIO;
    }
    crc = dt_crc32c(crc, taken, counts);
    float *dst[3] = {params, m, v};
    for (int k = 0; k < 3 && ret == 0; k++)
      ret = read_section(fp, spath, table, h.nruns, want, nruns, dst[k], &crc, &got[k]);
    if (ret == 0 && h.nruns > 0) {
      int64_t *grown = realloc(all, (nall + (size_t)h.nruns) * 2 * sizeof(int64_t));
      if (grown) {
        memcpy(grown + 2 * nall, table, (size_t)h.nruns * 2 * sizeof(int64_t));
        all = grown, nall += (size_t)h.nruns;
      } else {
        ret = DT_ENOMEM;
      }
    }
    free(table);
    fclose(fp);
    if (ret != 0)
      goto out;
    if (crc != h.payload_crc32c || crc != mf.shards[r].crc32c) {
      DT_ERROR(CKPT,
               "%s: checksum mismatch (CRC-32C %08x, header %08x, manifest %08x): the "
               "shard is corrupt",
               spath, crc, h.payload_crc32c, mf.shards[r].crc32c);
      ret = DT_EFORMAT;
      goto out;
    }
    if (r == 0) {
      state->step = h.step;
      state->data.epoch = h.data_epoch, state->data.shard = h.data_shard;
      state->data.window = h.data_window;
      state->data.unit = h.data_unit;
      state->data.seqs = h.data_seqs, state->data.blend = h.data_blend;
      state->data.nsrc = (int32_t)h.data_nsrc;
      memcpy(state->data.taken, taken, counts);
      memcpy(state->rng.s, h.rng, sizeof h.rng);
      state->threads = h.threads;
      state->loss_avg = h.loss_avg, state->loss_steps = h.loss_steps;
      state->updates = (h.flags & CKPT_FLAG_UPDATES) ? h.updates : -1;
      state->norm_avg = h.norm_avg, state->norm_steps = h.norm_steps;
      state->skip_until = h.skip_until;
    }
  }
  DT_CHECK_GOTO(runs_disjoint(sdir, all, nall), ret, out);
  if (got[0] != wanted) {
    DT_ERROR(CKPT,
             "%s: the shards hold %lld of the %lld parameters asked for (overlapping or "
             "missing runs)",
             sdir, (long long)got[0], (long long)wanted);
    ret = DT_EFORMAT;
    goto out;
  }
  DT_INFO(CKPT, "loaded checkpoint %s (step %lld)", sdir, (long long)state->step);
out:
  free(all);
  free(mf.shards);
free_want:
  free(want);
  return ret;
}

int dt_ckpt_load_range(const char *path, const dt_gpt2_config_t *want, int64_t num_params,
                       int64_t lo, int64_t hi, float *params, float *m, float *v,
                       dt_train_state_t *state)
{
  dt_gpt2_run_t run = {.global = lo, .local = 0, .len = hi - lo};
  return dt_ckpt_load_runs(path, want, num_params, &run, 1, params, m, v, state);
}

int dt_ckpt_load(dt_gpt2_t *m, dt_train_state_t *state, const char *path)
{
  DT_CHECK(dt_gpt2_alloc_optimizer(m));
  dt_gpt2_params_written(m);
  return dt_ckpt_load_range(path, &m->cfg, (int64_t)m->num_params, 0, (int64_t)m->num_params,
                            m->params_flat, m->m_flat, m->v_flat, state);
}
