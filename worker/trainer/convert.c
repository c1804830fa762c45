/* convert.c — distrain-convert: GPT-2 weights from one format to another.
 *
 *   distrain-convert FROM TO
 *     FROM  llmc:FILE   an llm.c fp32 checkpoint (what --init llmc: reads, --export-llmc writes)
 *           hf:DIR      Hugging Face's GPT-2: DIR/config.json and DIR/model.safetensors (hf.h)
 *           ckpt:DIR    the weights of a distrain checkpoint: its newest committed step, or
 *                       the step directory given (any layout it was trained with)
 *     TO    llmc:FILE or hf:DIR
 *
 * So a Hugging Face model trains from `--init llmc:` of its conversion, and a distrain
 * checkpoint goes to transformers' GPT2LMHeadModel.from_pretrained(DIR). Files are written
 * atomically; exit code 1 with one line naming the file on a bad input, 2 on bad usage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "dt_log.h"
#include "hf.h"

#define USAGE                                                                                      \
  "usage: distrain-convert FROM TO\n"                                                              \
  "  FROM  llmc:FILE | hf:DIR | ckpt:DIR   (an llm.c checkpoint, a Hugging Face GPT-2 "            \
  "directory,\n"                                                                                   \
  "                                         a distrain checkpoint's newest committed step)\n"      \
  "  TO    llmc:FILE | hf:DIR\n"

/* "kind:path" -> kind's index in kinds (path in *path), or -1. */
static int parse_spec(const char *s, const char *const *kinds, int n, const char **path)
{
  for (int i = 0; i < n; i++) {
    const size_t k = strlen(kinds[i]);
    if (strncmp(s, kinds[i], k) == 0 && s[k] == ':' && s[k + 1]) {
      *path = s + k + 1;
      return i;
    }
  }
  return -1;
}

enum { LLMC, HF, CKPT };

static int load(int kind, const char *path, dt_gpt2_config_t *cfg, float **params, char *what,
                size_t n)
{
  char err[8300] = "";
  int ret = 0;
  if (kind == LLMC) {
    ret = dt_llmc_read(path, cfg, params);
    snprintf(what, n, "llm.c checkpoint %s", path);
  } else if (kind == HF) {
    ret = dt_hf_read(path, cfg, params, err, sizeof err);
    snprintf(what, n, "Hugging Face model %s", path);
  } else {
    dt_train_state_t state = {0};
    ret = dt_ckpt_read_config(path, cfg);
    const size_t np = ret == 0 ? (size_t)dt_llmc_num_params(cfg) : 0;
    float *p = ret == 0 ? malloc(np * sizeof *p) : NULL;
    if (ret == 0 && !p)
      ret = DT_ENOMEM;
    if (ret == 0)
      ret = dt_ckpt_load_range(path, cfg, (int64_t)np, 0, (int64_t)np, p, NULL, NULL, &state);
    if (ret == 0)
      *params = p;
    else
      free(p);
    snprintf(what, n, "distrain checkpoint %s (step %lld)", path,
             ret == 0 ? (long long)state.step : -1LL);
  }
  if (ret != 0)
    fprintf(stderr, "distrain-convert: %s\n", *err ? err : "cannot read it (the log says why)");
  return ret;
}

int main(int argc, char **argv)
{
  static const char *const from_kinds[] = {"llmc", "hf", "ckpt"};
  const char *from, *to;
  if (argc == 2 && (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0)) {
    printf(USAGE);
    return 0;
  }
  const int fk = argc == 3 ? parse_spec(argv[1], from_kinds, 3, &from) : -1;
  const int tk = argc == 3 ? parse_spec(argv[2], from_kinds, 2, &to) : -1;
  if (fk < 0 || tk < 0) {
    fprintf(stderr, "%s", USAGE);
    return 2;
  }
  dt_gpt2_config_t cfg;
  float *params = NULL;
  char what[4400];
  if (load(fk, from, &cfg, &params, what, sizeof what) != 0)
    return 1;
  char err[8300] = "";
  int ret = tk == LLMC ? dt_llmc_save_params(&cfg, params, (size_t)dt_llmc_num_params(&cfg), to)
                       : dt_hf_write(to, &cfg, params, err, sizeof err);
  if (ret != 0)
    fprintf(stderr, "distrain-convert: %s\n", *err ? err : "writing failed (the log says why)");
  else
    printf("%s -> %s: GPT-2 of %d layer%s, %d heads, %d channels, vocabulary %d, context %d "
           "(%zu parameters)\n",
           what, argv[2], cfg.layers, cfg.layers == 1 ? "" : "s", cfg.heads, cfg.channels,
           cfg.vocab, cfg.max_seq,
           (size_t)dt_llmc_num_params(&cfg) -
               (size_t)(cfg.padded_vocab - cfg.vocab) * cfg.channels);
  free(params);
  return ret == 0 ? 0 : 1;
}
