/* hf.c — GPT-2 between llm.c's flat layout and Hugging Face's config.json + model.safetensors.
 *
 * One table maps each llm.c tensor to its safetensors name; a layered tensor is one safetensors
 * tensor a layer ("h.<l>."), and Conv1D weights are transposed on the way in and out. */
#include "hf.h"

#include <errno.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dt_error.h"
#include "dt_log.h"
#include "checkpoint.h"
#include "dt_util.h"

#define HF_PREFIX       "transformer."
#define HF_MAX_HEADER   (100 << 20) /* safetensors' own limit */
#define HF_LN_EPS       1e-5        /* distrain's LayerNorm epsilon, GPT-2's */
#define HF_CONFIG_FILE  "config.json"
#define HF_WEIGHTS_FILE "model.safetensors"

/* GPT-2's tensors in DT_GPT2_TENSORS order: the safetensors name ("%d": the layer) and whether
 * the file holds the matrix transposed (Conv1D: (in, out)). */
static const struct {
  const char *name;
  int transposed;
} hf_tensors[DT_GPT2_NUM_TENSORS] = {
    [DT_T_WTE] = {"wte.weight", 0},
    [DT_T_WPE] = {"wpe.weight", 0},
    [DT_T_LN1W] = {"h.%d.ln_1.weight", 0},
    [DT_T_LN1B] = {"h.%d.ln_1.bias", 0},
    [DT_T_QKVW] = {"h.%d.attn.c_attn.weight", 1},
    [DT_T_QKVB] = {"h.%d.attn.c_attn.bias", 0},
    [DT_T_ATTPROJW] = {"h.%d.attn.c_proj.weight", 1},
    [DT_T_ATTPROJB] = {"h.%d.attn.c_proj.bias", 0},
    [DT_T_LN2W] = {"h.%d.ln_2.weight", 0},
    [DT_T_LN2B] = {"h.%d.ln_2.bias", 0},
    [DT_T_FCW] = {"h.%d.mlp.c_fc.weight", 1},
    [DT_T_FCB] = {"h.%d.mlp.c_fc.bias", 0},
    [DT_T_FCPROJW] = {"h.%d.mlp.c_proj.weight", 1},
    [DT_T_FCPROJB] = {"h.%d.mlp.c_proj.bias", 0},
    [DT_T_LNFW] = {"ln_f.weight", 0},
    [DT_T_LNFB] = {"ln_f.bias", 0},
};

/* Where a tensor lies in llm.c's layout: its offset, its slices (layers or 1), and each
 * slice's rows x cols as llm.c holds it (cols 1: a vector). wte's rows are the file's, the
 * vocabulary; the flat buffer has padded_vocab of them. */
typedef struct {
  size_t off, slices, rows, cols;
} geom_t;

static void geometry(const dt_gpt2_config_t *c, geom_t g[DT_GPT2_NUM_TENSORS])
{
  const size_t L = (size_t)c->layers, C = (size_t)c->channels;
  const geom_t shape[DT_GPT2_NUM_TENSORS] = {
      [DT_T_WTE] = {0, 1, (size_t)c->vocab, C},
      [DT_T_WPE] = {0, 1, (size_t)c->max_seq, C},
      [DT_T_LN1W] = {0, L, C, 1},
      [DT_T_LN1B] = {0, L, C, 1},
      [DT_T_QKVW] = {0, L, 3 * C, C},
      [DT_T_QKVB] = {0, L, 3 * C, 1},
      [DT_T_ATTPROJW] = {0, L, C, C},
      [DT_T_ATTPROJB] = {0, L, C, 1},
      [DT_T_LN2W] = {0, L, C, 1},
      [DT_T_LN2B] = {0, L, C, 1},
      [DT_T_FCW] = {0, L, 4 * C, C},
      [DT_T_FCB] = {0, L, 4 * C, 1},
      [DT_T_FCPROJW] = {0, L, C, 4 * C},
      [DT_T_FCPROJB] = {0, L, C, 1},
      [DT_T_LNFW] = {0, 1, C, 1},
      [DT_T_LNFB] = {0, 1, C, 1},
  };
  size_t off = 0, i = 0;
#define DT__PLACE(name, count, wd)                                                                 \
  g[i] = shape[i];                                                                                 \
  g[i++].off = off;                                                                                \
  off += (count);
  DT_GPT2_TENSORS(DT__PLACE, *c)
#undef DT__PLACE
}

static void tensor_name(char *buf, size_t n, int t, int layer)
{
  snprintf(buf, n, hf_tensors[t].name, layer);
}

/* ---------------------------------------------------------------------------------------- */
/* Reading */

/* An integer field of config.json: *out, or (absent) *out unchanged when optional. */
static int config_int(json_object *cfg, const char *path, const char *key, int optional, int *out,
                      char *err, size_t errlen)
{
  json_object *v;
  if (!json_object_object_get_ex(cfg, key, &v)) {
    if (optional)
      return 0;
    snprintf(err, errlen, "%s: no \"%s\"", path, key);
    return DT_EFORMAT;
  }
  const int64_t x = json_object_get_int64(v);
  if (!json_object_is_type(v, json_type_int) || x < 1 || x > (1 << 24)) {
    snprintf(err, errlen, "%s: \"%s\": expected a positive integer, got %s", path, key,
             json_object_to_json_string(v));
    return DT_EFORMAT;
  }
  *out = (int)x;
  return 0;
}

static int read_config(const char *path, dt_gpt2_config_t *c, char *err, size_t errlen)
{
  FILE *fp = fopen(path, "r");
  if (!fp) {
    snprintf(err, errlen, "%s: %s", path, strerror(errno));
    return DT_ENOENT;
  }
  fclose(fp);
  json_object *cfg = json_object_from_file(path);
  if (!cfg) {
    snprintf(err, errlen, "%s: not a JSON file", path);
    return DT_EFORMAT;
  }
  int ret = json_object_is_type(cfg, json_type_object) ? 0 : DT_EFORMAT;
  if (ret != 0)
    snprintf(err, errlen, "%s: expected a JSON object", path);
  json_object *v;
  const char *s;
  if (ret == 0 && json_object_object_get_ex(cfg, "model_type", &v) &&
      strcmp(s = json_object_get_string(v), "gpt2") != 0) {
    snprintf(err, errlen, "%s: model_type \"%s\": distrain trains GPT-2 (\"gpt2\")", path, s);
    ret = DT_ENOTSUP;
  }
  if (ret == 0 && json_object_object_get_ex(cfg, "activation_function", &v) &&
      strcmp(s = json_object_get_string(v), "gelu_new") != 0 &&
      strcmp(s, "gelu_pytorch_tanh") != 0) {
    snprintf(err, errlen,
             "%s: activation_function \"%s\": distrain's GPT-2 uses GELU's tanh approximation "
             "(\"gelu_new\")",
             path, s);
    ret = DT_ENOTSUP;
  }
  if (ret == 0 && json_object_object_get_ex(cfg, "layer_norm_epsilon", &v) &&
      (json_object_get_double(v) < HF_LN_EPS * (1 - 1e-6) ||
       json_object_get_double(v) > HF_LN_EPS * (1 + 1e-6))) {
    snprintf(err, errlen, "%s: layer_norm_epsilon %s: distrain's LayerNorm uses %g", path,
             json_object_to_json_string(v), HF_LN_EPS);
    ret = DT_ENOTSUP;
  }
  if (ret == 0 && json_object_object_get_ex(cfg, "tie_word_embeddings", &v) &&
      !json_object_get_boolean(v)) {
    snprintf(err, errlen, "%s: tie_word_embeddings false: distrain's GPT-2 ties the LM head to wte",
             path);
    ret = DT_ENOTSUP;
  }
  memset(c, 0, sizeof *c);
  if (ret == 0)
    ret = config_int(cfg, path, "n_layer", 0, &c->layers, err, errlen);
  if (ret == 0)
    ret = config_int(cfg, path, "n_head", 0, &c->heads, err, errlen);
  if (ret == 0)
    ret = config_int(cfg, path, "n_embd", 0, &c->channels, err, errlen);
  if (ret == 0)
    ret = config_int(cfg, path, "vocab_size", 0, &c->vocab, err, errlen);
  if (ret == 0)
    ret = config_int(cfg, path, "n_ctx", 1, &c->max_seq, err, errlen);
  if (ret == 0)
    ret = config_int(cfg, path, "n_positions", c->max_seq > 0, &c->max_seq, err, errlen);
  if (ret == 0) {
    char why[256];
    c->padded_vocab = dt_gpt2_padded_vocab(c->vocab);
    if (dt_gpt2_config_validate(c, why, sizeof why) != 0) {
      snprintf(err, errlen, "%s: %s", path, why);
      ret = DT_EFORMAT;
    }
  }
  json_object_put(cfg);
  return ret;
}

static float half_to_float(uint16_t h)
{
  const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | man << 13; /* inf, NaN */
  } else if (exp != 0) {
    bits = sign | (exp + 112) << 23 | man << 13;
  } else { /* zero or subnormal: man x 2^-24, exact in a float */
    const float f = (float)man * 0x1p-24f;
    memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* One tensor's entry in the header: its dtype's size (4, 2) and whether it is bf16, its shape
 * checked against want (rank 1 or 2), its bytes checked to lie in the data. */
static int tensor_entry(json_object *e, const char *path, const char *name, const size_t *want,
                        int rank, size_t data_bytes, size_t *begin, int *bf16, size_t *esize,
                        char *err, size_t errlen)
{
  json_object *dtype, *shape, *offs;
  if (!json_object_is_type(e, json_type_object) || !json_object_object_get_ex(e, "dtype", &dtype) ||
      !json_object_object_get_ex(e, "shape", &shape) ||
      !json_object_object_get_ex(e, "data_offsets", &offs) ||
      !json_object_is_type(shape, json_type_array) || !json_object_is_type(offs, json_type_array) ||
      json_object_array_length(offs) != 2) {
    snprintf(err, errlen, "%s: tensor %s: expected dtype, shape and data_offsets", path, name);
    return DT_EFORMAT;
  }
  const char *dt = json_object_get_string(dtype);
  *esize = strcmp(dt, "F32") == 0 ? 4 : strcmp(dt, "F16") == 0 || strcmp(dt, "BF16") == 0 ? 2 : 0;
  *bf16 = strcmp(dt, "BF16") == 0;
  if (*esize == 0) {
    snprintf(err, errlen, "%s: tensor %s: dtype %s (expected F32, F16 or BF16)", path, name, dt);
    return DT_ENOTSUP;
  }
  int ok = (int)json_object_array_length(shape) == rank;
  size_t numel = 1;
  for (int d = 0; ok && d < rank; d++) {
    json_object *x = json_object_array_get_idx(shape, (size_t)d);
    ok = json_object_is_type(x, json_type_int) && json_object_get_int64(x) == (int64_t)want[d];
    numel *= want[d];
  }
  if (!ok) {
    char w[64];
    if (rank == 1)
      snprintf(w, sizeof w, "[%zu]", want[0]);
    else
      snprintf(w, sizeof w, "[%zu, %zu]", want[0], want[1]);
    snprintf(err, errlen, "%s: tensor %s: shape %s, expected %s for config.json's model", path,
             name, json_object_to_json_string(shape), w);
    return DT_ESHAPE;
  }
  const int64_t b = json_object_get_int64(json_object_array_get_idx(offs, 0));
  const int64_t e2 = json_object_get_int64(json_object_array_get_idx(offs, 1));
  if (b < 0 || e2 < b || (size_t)e2 > data_bytes || (size_t)(e2 - b) != numel * *esize) {
    snprintf(err, errlen,
             "%s: tensor %s: data_offsets [%lld, %lld] do not hold its %zu values in the file's "
             "%zu bytes of data",
             path, name, (long long)b, (long long)e2, numel, data_bytes);
    return DT_EFORMAT;
  }
  *begin = (size_t)b;
  return 0;
}

/* Reads a tensor's values as floats into out (n of them). */
static int read_values(FILE *fp, const char *path, size_t at, size_t n, size_t esize, int bf16,
                       float *out, void *scratch)
{
  if (fseeko(fp, (off_t)at, SEEK_SET) != 0 ||
      fread(esize == 4 ? (void *)out : scratch, esize, n, fp) != n)
    return DT_EIO;
  (void)path;
  for (size_t i = 0; esize == 2 && i < n; i++) {
    const uint16_t h = ((const uint16_t *)scratch)[i];
    if (bf16) {
      const uint32_t bits = (uint32_t)h << 16;
      memcpy(&out[i], &bits, sizeof bits);
    } else {
      out[i] = half_to_float(h);
    }
  }
  return 0;
}

/* The header's entry for name, with or without the "transformer." prefix, or NULL. */
static json_object *find_entry(json_object *hdr, const char *name)
{
  char full[160];
  json_object *e;
  snprintf(full, sizeof full, HF_PREFIX "%s", name);
  if (json_object_object_get_ex(hdr, name, &e) || json_object_object_get_ex(hdr, full, &e))
    return e;
  return NULL;
}

/* A key of the header distrain does not read: metadata, the attention's mask buffers, a tied
 * LM head (checked separately). */
static int ignorable(const char *key)
{
  if (strncmp(key, HF_PREFIX, strlen(HF_PREFIX)) == 0)
    key += strlen(HF_PREFIX);
  const size_t n = strlen(key);
  return strcmp(key, "__metadata__") == 0 || strcmp(key, "lm_head.weight") == 0 ||
         (n > 10 && strcmp(key + n - 10, ".attn.bias") == 0) ||
         (n > 17 && strcmp(key + n - 17, ".attn.masked_bias") == 0);
}

static int read_weights(const char *path, const dt_gpt2_config_t *c, float *params, char *err,
                        size_t errlen)
{
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    snprintf(err, errlen, "%s: %s", path, strerror(errno));
    return DT_ENOENT;
  }
  struct stat st;
  uint64_t hlen = 0;
  char *text = NULL;
  json_object *hdr = NULL;
  float *tmp = NULL;
  void *scratch = NULL;
  int ret = 0;
  if (fstat(fileno(fp), &st) != 0 || fread(&hlen, sizeof hlen, 1, fp) != 1 ||
      hlen > HF_MAX_HEADER || hlen + 8 > (uint64_t)st.st_size) {
    snprintf(err, errlen, "%s: not a safetensors file (an 8-byte header size, then the header)",
             path);
    ret = DT_EFORMAT;
    goto out;
  }
  text = malloc(hlen + 1);
  if (!text || fread(text, 1, hlen, fp) != hlen) {
    ret = text ? DT_EIO : DT_ENOMEM;
    snprintf(err, errlen, "%s: reading the header failed", path);
    goto out;
  }
  text[hlen] = '\0';
  enum json_tokener_error jerr = json_tokener_success;
  hdr = json_tokener_parse_verbose(text, &jerr);
  if (!hdr || !json_object_is_type(hdr, json_type_object)) {
    snprintf(err, errlen, "%s: the header is not a JSON object: %s", path,
             hdr ? "another JSON value" : json_tokener_error_desc(jerr));
    ret = DT_EFORMAT;
    goto out;
  }
  json_object_object_foreach(hdr, key, val)
  {
    (void)val;
    char name[128];
    int known = ignorable(key);
    for (int t = 0; !known && t < DT_GPT2_NUM_TENSORS; t++)
      for (int l = 0; !known && l < (strstr(hf_tensors[t].name, "%d") ? c->layers : 1); l++) {
        tensor_name(name, sizeof name, t, l);
        const char *k =
            strncmp(key, HF_PREFIX, strlen(HF_PREFIX)) == 0 ? key + strlen(HF_PREFIX) : key;
        known = strcmp(k, name) == 0;
      }
    if (!known) {
      snprintf(err, errlen, "%s: tensor %s is not one of GPT-2's (config.json: %d layers)", path,
               key, c->layers);
      ret = DT_EFORMAT;
      goto out;
    }
  }
  geom_t g[DT_GPT2_NUM_TENSORS];
  geometry(c, g);
  const size_t data_at = 8 + hlen, data_bytes = (size_t)st.st_size - data_at;
  const size_t C = (size_t)c->channels; /* the largest tensor: wte (or the LM head), wpe, fcw */
  const size_t biggest = DT_MAX(DT_MAX((size_t)c->vocab, (size_t)c->max_seq), 4 * C) * C;
  tmp = malloc(biggest * sizeof *tmp);
  scratch = malloc(biggest * sizeof(uint16_t));
  if (!tmp || !scratch) {
    ret = DT_ENOMEM;
    snprintf(err, errlen, "%s: out of memory", path);
    goto out;
  }
  for (int t = 0; t < DT_GPT2_NUM_TENSORS; t++) {
    const geom_t *q = &g[t];
    const int tr = hf_tensors[t].transposed;
    const size_t n = q->rows * q->cols;
    const size_t want[2] = {tr ? q->cols : q->rows, tr ? q->rows : q->cols};
    for (size_t l = 0; l < q->slices; l++) {
      char name[128];
      tensor_name(name, sizeof name, t, (int)l);
      json_object *e = find_entry(hdr, name);
      size_t begin, esize;
      int bf16;
      if (!e) {
        snprintf(err, errlen, "%s: no tensor %s", path, name);
        ret = DT_EFORMAT;
        goto out;
      }
      ret = tensor_entry(e, path, name, want, q->cols == 1 ? 1 : 2, data_bytes, &begin, &bf16,
                         &esize, err, errlen);
      if (ret != 0)
        goto out;
      float *dst = params + q->off + l * n;
      if (read_values(fp, path, data_at + begin, n, esize, bf16, tr ? tmp : dst, scratch) != 0) {
        snprintf(err, errlen, "%s: tensor %s: read failed", path, name);
        ret = DT_EIO;
        goto out;
      }
      for (size_t i = 0; tr && i < q->cols; i++) /* file (cols, rows) -> llm.c (rows, cols) */
        for (size_t j = 0; j < q->rows; j++)
          dst[j * q->cols + i] = tmp[i * q->rows + j];
    }
  }
  /* An LM head, when the file has one, must be wte (distrain ties them). */
  json_object *head = find_entry(hdr, "lm_head.weight");
  if (head) {
    size_t begin, esize;
    int bf16;
    const size_t want[2] = {(size_t)c->vocab, (size_t)c->channels};
    ret = tensor_entry(head, path, "lm_head.weight", want, 2, data_bytes, &begin, &bf16, &esize,
                       err, errlen);
    if (ret == 0 &&
        read_values(fp, path, data_at + begin, want[0] * want[1], esize, bf16, tmp, scratch) != 0) {
      snprintf(err, errlen, "%s: tensor lm_head.weight: read failed", path);
      ret = DT_EIO;
    }
    if (ret == 0 && memcmp(tmp, params + g[DT_T_WTE].off, want[0] * want[1] * sizeof *tmp) != 0) {
      snprintf(err, errlen,
               "%s: lm_head.weight differs from wte.weight: distrain's GPT-2 ties them", path);
      ret = DT_ENOTSUP;
    }
  }
out:
  free(scratch);
  free(tmp);
  json_object_put(hdr);
  free(text);
  fclose(fp);
  return ret;
}

int dt_hf_read_config(const char *dir, dt_gpt2_config_t *cfg, char *err, size_t errlen)
{
  char path[4200];
  snprintf(path, sizeof path, "%s/" HF_CONFIG_FILE, dir);
  return read_config(path, cfg, err, errlen);
}

int dt_hf_load(dt_gpt2_t *m, const char *dir, char *err, size_t errlen)
{
  dt_gpt2_config_t cfg;
  float *params;
  DT_CHECK(dt_hf_read(dir, &cfg, &params, err, errlen));
  int ret = 0;
  if (memcmp(&cfg, &m->cfg, sizeof cfg) != 0) { /* config.json changed since it was read */
    snprintf(err, errlen, "%s: the model is not the one configured (L=%d C=%d V=%d maxT=%d)", dir,
             m->cfg.layers, m->cfg.channels, m->cfg.vocab, m->cfg.max_seq);
    ret = DT_ESHAPE;
  }
  if (ret == 0)
    ret = dt_gpt2_load_global(m, params);
  free(params);
  return ret;
}

int dt_hf_read(const char *dir, dt_gpt2_config_t *cfg, float **params, char *err, size_t errlen)
{
  char path[4200];
  DT_CHECK(dt_hf_read_config(dir, cfg, err, errlen));
  float *p = calloc((size_t)dt_llmc_num_params(cfg), sizeof *p); /* wte's padded rows stay zero */
  if (!p) {
    snprintf(err, errlen, "%s: out of memory for %zu parameters", dir,
             (size_t)dt_llmc_num_params(cfg));
    return DT_ENOMEM;
  }
  snprintf(path, sizeof path, "%s/" HF_WEIGHTS_FILE, dir);
  const int ret = read_weights(path, cfg, p, err, errlen);
  if (ret != 0) {
    free(p);
    return ret;
  }
  *params = p;
  return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Writing */

static int write_json(const char *path, json_object *obj, int flags, size_t pad_to, char *err,
                      size_t errlen, dt_afile_t *keep)
{
  size_t len;
  const char *s = json_object_to_json_string_length(obj, flags, &len);
  dt_afile_t af;
  int ret = 0;
  if (!s) {
    snprintf(err, errlen, "%s: out of memory", path);
    return DT_ENOMEM;
  }
  ret = dt_afile_open(&af, path);
  if (ret != 0) {
    snprintf(err, errlen, "%s: cannot write: %s", path, dt_strerror(ret));
    return ret;
  }
  if (pad_to) { /* safetensors: the size, then the header padded with spaces */
    const uint64_t n = (len + pad_to - 1) / pad_to * pad_to;
    static const char spaces[8] = "        ";
    ret = dt_afile_write(&af, &n, sizeof n);
    if (ret == 0)
      ret = dt_afile_write(&af, s, len);
    if (ret == 0)
      ret = dt_afile_write(&af, spaces, n - len);
  } else {
    ret = dt_afile_write(&af, s, len);
    if (ret == 0)
      ret = dt_afile_write(&af, "\n", 1);
  }
  if (ret == 0 && keep) {
    *keep = af; /* the caller writes the rest and commits */
    return 0;
  }
  if (ret == 0)
    ret = dt_afile_commit(&af);
  else
    dt_afile_abort(&af);
  if (ret != 0)
    snprintf(err, errlen, "%s: writing failed: %s", path, dt_strerror(ret));
  return ret;
}

static json_object *config_json(const dt_gpt2_config_t *c)
{
  json_object *o = json_object_new_object(), *arch = json_object_new_array();
  json_object_array_add(arch, json_object_new_string("GPT2LMHeadModel"));
  json_object_object_add(o, "architectures", arch);
  json_object_object_add(o, "model_type", json_object_new_string("gpt2"));
  json_object_object_add(o, "vocab_size", json_object_new_int(c->vocab));
  json_object_object_add(o, "n_positions", json_object_new_int(c->max_seq));
  json_object_object_add(o, "n_ctx", json_object_new_int(c->max_seq));
  json_object_object_add(o, "n_embd", json_object_new_int(c->channels));
  json_object_object_add(o, "n_layer", json_object_new_int(c->layers));
  json_object_object_add(o, "n_head", json_object_new_int(c->heads));
  json_object_object_add(o, "activation_function", json_object_new_string("gelu_new"));
  json_object_object_add(o, "layer_norm_epsilon", json_object_new_double(HF_LN_EPS));
  json_object_object_add(o, "tie_word_embeddings", json_object_new_boolean(1));
  /* distrain trains without dropout; so does a model loaded from here unless set */
  json_object_object_add(o, "resid_pdrop", json_object_new_double(0.0));
  json_object_object_add(o, "embd_pdrop", json_object_new_double(0.0));
  json_object_object_add(o, "attn_pdrop", json_object_new_double(0.0));
  json_object_object_add(o, "torch_dtype", json_object_new_string("float32"));
  return o;
}

int dt_hf_write(const char *dir, const dt_gpt2_config_t *c, const float *params, char *err,
                size_t errlen)
{
  char path[4200];
  int ret = dt_mkdir_p(dir);
  if (ret != 0) {
    snprintf(err, errlen, "%s: cannot create directory: %s", dir, dt_strerror(ret));
    return ret;
  }
  geom_t g[DT_GPT2_NUM_TENSORS];
  geometry(c, g);
  /* The header: every tensor, in llm.c's order, back to back from offset 0. */
  json_object *hdr = json_object_new_object(), *meta = json_object_new_object();
  json_object_object_add(meta, "format", json_object_new_string("pt"));
  json_object_object_add(hdr, "__metadata__", meta);
  size_t at = 0;
  for (int t = 0; t < DT_GPT2_NUM_TENSORS; t++)
    for (size_t l = 0; l < g[t].slices; l++) {
      const int tr = hf_tensors[t].transposed;
      char name[128];
      tensor_name(name, sizeof name, t, (int)l);
      json_object *e = json_object_new_object(), *shape = json_object_new_array(),
                  *offs = json_object_new_array();
      json_object_array_add(shape, json_object_new_int64((int64_t)(tr ? g[t].cols : g[t].rows)));
      if (g[t].cols > 1)
        json_object_array_add(shape, json_object_new_int64((int64_t)(tr ? g[t].rows : g[t].cols)));
      const size_t bytes = g[t].rows * g[t].cols * sizeof(float);
      json_object_array_add(offs, json_object_new_int64((int64_t)at));
      json_object_array_add(offs, json_object_new_int64((int64_t)(at + bytes)));
      json_object_object_add(e, "dtype", json_object_new_string("F32"));
      json_object_object_add(e, "shape", shape);
      json_object_object_add(e, "data_offsets", offs);
      json_object_object_add(hdr, name, e);
      at += bytes;
    }
  dt_afile_t af;
  float *tmp = malloc((size_t)c->channels * 4 * (size_t)c->channels * sizeof *tmp);
  snprintf(path, sizeof path, "%s/" HF_WEIGHTS_FILE, dir);
  ret = tmp ? write_json(path, hdr, JSON_C_TO_STRING_PLAIN, 8, err, errlen, &af) : DT_ENOMEM;
  json_object_put(hdr);
  if (ret != 0) {
    free(tmp);
    return ret;
  }
  for (int t = 0; t < DT_GPT2_NUM_TENSORS && ret == 0; t++)
    for (size_t l = 0; l < g[t].slices && ret == 0; l++) {
      const size_t n = g[t].rows * g[t].cols;
      const float *src = params + g[t].off + l * n;
      if (hf_tensors[t].transposed) { /* llm.c (rows, cols) -> file (cols, rows) */
        for (size_t i = 0; i < g[t].rows; i++)
          for (size_t j = 0; j < g[t].cols; j++)
            tmp[j * g[t].rows + i] = src[i * g[t].cols + j];
        src = tmp;
      }
      ret = dt_afile_write(&af, src, n * sizeof *src);
    }
  free(tmp);
  if (ret == 0)
    ret = dt_afile_commit(&af);
  else
    dt_afile_abort(&af);
  if (ret != 0) {
    snprintf(err, errlen, "%s: writing failed: %s", path, dt_strerror(ret));
    return ret;
  }
  json_object *cfg = config_json(c);
  snprintf(path, sizeof path, "%s/" HF_CONFIG_FILE, dir);
  ret = write_json(path, cfg, JSON_C_TO_STRING_PRETTY, 0, err, errlen, NULL);
  json_object_put(cfg);
  return ret;
}
