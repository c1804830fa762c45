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

static int64_t llmc_num_params(const dt_gpt2_config_t *c)
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
  int64_t expect = (int64_t)sizeof h + llmc_num_params(cfg) * 4;
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
  if (fread(m->params_flat, sizeof(float), m->num_params, fp) != m->num_params) {
    DT_ERROR(CKPT, "%s: short read of %zu parameters", path, m->num_params);
    ret = DT_EIO;
  }
out:
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

#define CKPT_FLAG_OPTIM 1u
typedef struct {
  uint32_t magic, version, header_bytes, flags;
  int32_t max_seq, vocab, padded_vocab, layers, heads, channels;
  int32_t rank, world;
  int64_t step, num_params, lo, hi;
  int64_t data_epoch, data_shard, data_window;
  uint64_t rng[4];
  uint64_t payload_bytes;
  uint32_t payload_crc32c;
  int32_t threads;        /* compute threads of the writer (GEMM rounding depends on it) */
  uint32_t header_crc32c; /* CRC-32C of this header with this field zero */
  uint8_t pad[256 - 4 * 4 - 8 * 4 - 8 * 7 - 8 * 4 - 8 - 8 - 4];
} ckpt_header_t;
_Static_assert(sizeof(ckpt_header_t) == 256, "checkpoint header must stay 256 bytes");

static uint32_t header_crc(const ckpt_header_t *h)
{
  ckpt_header_t copy = *h;
  copy.header_crc32c = 0;
  return dt_crc32c(0, &copy, sizeof copy);
}

int dt_ckpt_write_range(const dt_gpt2_config_t *cfg, int64_t num_params,
                        const dt_train_state_t *state, const char *dir, int rank, int world,
                        const dt_ckpt_range_t *rg, dt_ckpt_shard_info_t *info)
{
  char sdir[4096], path[4200], manifest[4200];
  int ret = 0;
  const int64_t lo = rg->lo, hi = rg->hi;
  if (lo < 0 || hi > num_params || lo > hi) {
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

  const int has_optim = rg->m != NULL && rg->v != NULL;
  const size_t n = (size_t)(hi - lo);
  const float *bufs[3] = {rg->params, rg->m, rg->v};
  ckpt_header_t h;
  memset(&h, 0, sizeof h);
  h.magic = DT_CKPT_MAGIC, h.version = DT_CKPT_VERSION, h.header_bytes = sizeof h;
  h.flags = has_optim ? CKPT_FLAG_OPTIM : 0;
  h.max_seq = cfg->max_seq, h.vocab = cfg->vocab, h.padded_vocab = cfg->padded_vocab;
  h.layers = cfg->layers, h.heads = cfg->heads, h.channels = cfg->channels;
  h.rank = rank, h.world = world;
  h.step = state->step, h.num_params = num_params, h.lo = lo, h.hi = hi;
  h.data_epoch = state->data.epoch, h.data_shard = state->data.shard;
  h.data_window = state->data.window;
  memcpy(h.rng, state->rng.s, sizeof h.rng);
  h.threads = state->threads;
  uint32_t crc = 0;
  for (int k = 0; k < (has_optim ? 3 : 1); k++) {
    crc = dt_crc32c(crc, bufs[k], n * sizeof(float));
    h.payload_bytes += n * sizeof(float);
  }
  h.payload_crc32c = crc;
  h.header_crc32c = header_crc(&h);

  dt_afile_t af;
  DT_CHECK(dt_afile_open(&af, path));
  DT_CHECK_GOTO(dt_afile_write(&af, &h, sizeof h), ret, fail);
  for (int k = 0; k < (has_optim ? 3 : 1); k++)
    DT_CHECK_GOTO(dt_afile_write(&af, bufs[k], n * sizeof(float)), ret, fail);
  DT_CHECK_GOTO(dt_afile_commit(&af), ret, out);
  info->bytes = sizeof h + h.payload_bytes;
  info->crc32c = crc;
  return 0;
fail:
  dt_afile_abort(&af);
out:
  return ret;
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
  if (h->version != DT_CKPT_VERSION || h->header_bytes != sizeof *h) {
    DT_ERROR(CKPT, "%s: checkpoint version %u (header %u bytes): expected version %d (%zu bytes)",
             path, h->version, h->header_bytes, DT_CKPT_VERSION, sizeof *h);
    ret = DT_EFORMAT;
    goto fail;
  }
  if (h->header_crc32c != header_crc(h)) {
    DT_ERROR(CKPT, "%s: header checksum mismatch: the shard header is corrupt", path);
    ret = DT_EFORMAT;
    goto fail;
  }
  uint64_t nfloats = (uint64_t)(h->hi - h->lo) * ((h->flags & CKPT_FLAG_OPTIM) ? 3 : 1);
  if ((uint64_t)size != s->bytes || h->payload_bytes != nfloats * 4 ||
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

/* Streams one section of n floats: checksums all of it, copies the part in [lo, hi). */
static int read_section(FILE *fp, const char *path, int64_t sec_lo, size_t n, int64_t lo,
                        int64_t hi, float *dst, uint32_t *crc)
{
  float buf[16384];
  for (size_t done = 0; done < n;) {
    size_t k = DT_MIN(n - done, DT_ARRAY_SIZE(buf));
    if (fread(buf, sizeof(float), k, fp) != k) {
      DT_ERROR(CKPT, "%s: short read", path);
      return DT_EIO;
    }
    *crc = dt_crc32c(*crc, buf, k * sizeof(float));
    int64_t a = DT_MAX(sec_lo + (int64_t)done, lo), b = DT_MIN(sec_lo + (int64_t)(done + k), hi);
    if (dst && a < b)
      memcpy(dst + (a - lo), buf + (a - sec_lo - (int64_t)done), (size_t)(b - a) * sizeof(float));
    done += k;
  }
  return 0;
}

int dt_ckpt_load_range(const char *path, const dt_gpt2_config_t *want, int64_t num_params,
                       int64_t lo, int64_t hi, float *params, float *m, float *v,
                       dt_train_state_t *state)
{
  char sdir[4096], spath[4200];
  dt_ckpt_manifest_t mf;
  int ret = 0;
  DT_CHECK(dt_ckpt_resolve_step_dir(path, sdir, sizeof sdir));
  DT_CHECK(dt_ckpt_manifest_read(sdir, &mf));
  if (mf.num_params != num_params) {
    DT_ERROR(CKPT, "%s: checkpoint has %lld parameters, the configured model %lld", sdir,
             (long long)mf.num_params, (long long)num_params);
    ret = DT_ESHAPE;
    goto out;
  }
  for (int r = 0; r < mf.world; r++) {
    ckpt_header_t h;
    FILE *fp;
    DT_CHECK_GOTO(shard_open(sdir, &mf.shards[r], &h, &fp, spath, sizeof spath), ret, out);
    dt_gpt2_config_t cfg;
    header_config(&h, &cfg);
    if (!config_equal(&cfg, want)) {
      ret = config_mismatch(spath, want, &cfg);
      fclose(fp);
      goto out;
    }
    if (!(h.flags & CKPT_FLAG_OPTIM)) {
      DT_ERROR(CKPT, "%s: shard holds no optimizer state; cannot resume training from it", spath);
      ret = DT_EFORMAT;
      fclose(fp);
      goto out;
    }
    /* Every shard is read whole (its checksum covers all of it); only the overlap with
     * [lo, hi) is kept, which is what lets dp=4 shards load into dp=3 ranks. */
    size_t n = (size_t)(h.hi - h.lo);
    float *dst[3] = {params, m, v};
    uint32_t crc = 0;
    for (int k = 0; k < 3 && ret == 0; k++)
      ret = read_section(fp, spath, h.lo, n, lo, hi, dst[k], &crc);
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
      memcpy(state->rng.s, h.rng, sizeof h.rng);
      state->threads = h.threads;
    }
  }
  DT_INFO(CKPT, "loaded checkpoint %s (step %lld)", sdir, (long long)state->step);
out:
  free(mf.shards);
  return ret;
}

int dt_ckpt_load(dt_gpt2_t *m, dt_train_state_t *state, const char *path)
{
  DT_CHECK(dt_gpt2_alloc_optimizer(m));
  return dt_ckpt_load_range(path, &m->cfg, (int64_t)m->num_params, 0, (int64_t)m->num_params,
                            m->params_flat, m->m_flat, m->v_flat, state);
}
