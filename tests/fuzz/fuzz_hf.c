/* fuzz_hf.c — a Hugging Face GPT-2 directory whose model.safetensors is the input (config.json
 * fixed: 1 layer, 2 heads, 8 channels, vocabulary 16, context 4): distrain-convert's reader
 * (hf.h) refuses it with a reason or reads it. Properties: a refusal says why; what it reads,
 * written back and read again, gives the same weights bit for bit, and wte's padded rows are
 * zero. */
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "fuzz.h"
#include "hf.h"

static char g_dir[600], g_out[600], g_weights[700];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
  (void)argc, (void)argv;
  const char *dir = fuzz_setup();
  snprintf(g_dir, sizeof g_dir, "%s/in", dir);
  snprintf(g_out, sizeof g_out, "%s/out", dir);
  snprintf(g_weights, sizeof g_weights, "%s/model.safetensors", g_dir);
  char path[700];
  static const char config[] = "{\"model_type\": \"gpt2\", \"n_layer\": 1, \"n_head\": 2, "
                               "\"n_embd\": 8, \"vocab_size\": 16, \"n_positions\": 4}";
  snprintf(path, sizeof path, "%s/config.json", g_dir);
  if (mkdir(g_dir, 0755) != 0) {
    perror(g_dir);
    abort();
  }
  fuzz_write(path, config, strlen(config));
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  fuzz_write(g_weights, data, size);
  dt_gpt2_config_t cfg, again_cfg;
  float *params = NULL, *again = NULL;
  char err[1024] = "";
  if (dt_hf_read(g_dir, &cfg, &params, err, sizeof err) != 0) {
    FUZZ_ASSERT(err[0] != '\0', "refused without a reason");
    return 0;
  }
  const size_t n = (size_t)dt_llmc_num_params(&cfg);
  for (size_t i = (size_t)cfg.vocab * cfg.channels; i < (size_t)cfg.padded_vocab * cfg.channels;
       i++)
    FUZZ_ASSERT(params[i] == 0.0f, "padded wte element %zu is %g", i, (double)params[i]);
  FUZZ_ASSERT(dt_hf_write(g_out, &cfg, params, err, sizeof err) == 0, "write: %s", err);
  FUZZ_ASSERT(dt_hf_read(g_out, &again_cfg, &again, err, sizeof err) == 0, "read back: %s", err);
  FUZZ_ASSERT(memcmp(&cfg, &again_cfg, sizeof cfg) == 0, "the config changed");
  FUZZ_ASSERT(memcmp(params, again, n * sizeof *params) == 0, "the weights changed");
  free(again);
  free(params);
  return 0;
}
