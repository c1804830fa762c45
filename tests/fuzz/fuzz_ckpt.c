/* fuzz_ckpt.c — model files as found on disk. An input that starts with llm.c's magic is an
 * llm.c checkpoint (dt_llmc_read_config, then dt_llmc_load into a model of its config when that
 * is small); any other is a distrain checkpoint shard, which the target commits as step 1 of a
 * one-writer checkpoint of its header's model (the manifest lists [0, num_params), whatever
 * range the header claims) and loads (dt_ckpt_read_config, dt_ckpt_load_runs) in two runs that
 * ask for the whole model out of order.
 *
 * A shard's checksums would stop almost every mutation at the header. So the target compiles
 * checkpoint.c itself (for its header type) and reseals each input: the header's CRC and the
 * payload's (also written to the manifest, with the file's size) are made to match, and the
 * checks behind them (sizes, run tables, ranges, the model config) see the mutations.
 * Property: every load either fails with a reason or fills every wanted element. */
#include "../../worker/trainer/checkpoint.c"

#include "fuzz.h"

#define SMALL_MODEL (1 << 16)                 /* parameters: larger configs are read, not loaded */
static const uint32_t SENTINEL = 0x7fa5a5a5u; /* a NaN: what an element no load wrote holds */

static char g_dir[512], g_sdir[600], g_shard[700], g_model[600];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
  (void)argc, (void)argv;
  snprintf(g_dir, sizeof g_dir, "%s", fuzz_setup());
  dt_ckpt_step_dir(g_sdir, sizeof g_sdir, g_dir, 1);
  snprintf(g_shard, sizeof g_shard, "%s/shard-00000-of-00001.bin", g_sdir);
  snprintf(g_model, sizeof g_model, "%s/model.bin", g_dir);
  FUZZ_ASSERT(dt_mkdir_p(g_sdir) == 0, "cannot create %s", g_sdir);
  return 0;
}

static void llmc(const uint8_t *data, size_t size)
{
  fuzz_write(g_model, data, size);
  dt_gpt2_config_t cfg;
  if (dt_llmc_read_config(g_model, &cfg) != 0)
    return;
  char why[256];
  FUZZ_ASSERT(dt_gpt2_config_validate(&cfg, why, sizeof why) == 0, "accepted config: %s", why);
  FUZZ_ASSERT((uint64_t)size == LLMC_HEADER * 4 + (uint64_t)dt_llmc_num_params(&cfg) * 4,
              "accepted a %zu-byte file for %lld parameters", size,
              (long long)dt_llmc_num_params(&cfg));
  if (dt_llmc_num_params(&cfg) > SMALL_MODEL)
    return;
  dt_gpt2_t m;
  FUZZ_ASSERT(dt_gpt2_create(&m, &cfg, dt_device_cpu(), NULL, NULL) == 0, "model");
  FUZZ_ASSERT(dt_llmc_load(&m, g_model) == 0, "the header was accepted, the load failed");
  dt_gpt2_destroy(&m);
}

static void shard(const uint8_t *data, size_t size)
{
  ckpt_header_t h;
  if (size < sizeof h)
    return;
  memcpy(&h, data, sizeof h);
  h.payload_crc32c = dt_crc32c(0, data + sizeof h, size - sizeof h);
  h.header_crc32c = header_crc(&h);
  FILE *fp = fopen(g_shard, "wb");
  FUZZ_ASSERT(fp && fwrite(&h, sizeof h, 1, fp) == 1 &&
                  fwrite(data + sizeof h, 1, size - sizeof h, fp) == size - sizeof h &&
                  fclose(fp) == 0,
              "cannot write %s", g_shard);
  if (h.num_params < 0)
    return;
  dt_ckpt_shard_info_t info = {
      .rank = 0, .lo = 0, .hi = h.num_params, .bytes = size, .crc32c = h.payload_crc32c};
  snprintf(info.name, sizeof info.name, "shard-00000-of-00001.bin");
  FUZZ_ASSERT(dt_ckpt_commit(g_dir, 1, h.num_params, 1, &info) == 0, "cannot commit");

  dt_gpt2_config_t cfg;
  if (dt_ckpt_read_config(g_dir, &cfg) != 0 || h.num_params > SMALL_MODEL)
    return;
  const int64_t P = h.num_params, cut = P / 3;
  float *buf = calloc((size_t)(P ? P : 1) * 3, sizeof(float));
  FUZZ_ASSERT(buf, "out of memory");
  for (int64_t i = 0; i < 3 * P; i++)
    memcpy(&buf[i], &SENTINEL, 4);
  const dt_gpt2_run_t runs[2] = {{.global = cut, .local = cut, .len = P - cut},
                                 {.global = 0, .local = 0, .len = cut}};
  dt_train_state_t st;
  if (dt_ckpt_load_runs(g_dir, &cfg, P, runs, 2, buf, buf + P, buf + 2 * P, &st) == 0) {
    /* Every element was written, unless the file itself holds the sentinel's bits. */
    const size_t payload = size - sizeof h;
    int in_file = 0;
    for (size_t i = 0; i + 4 <= payload && !in_file; i++)
      in_file = memcmp(data + sizeof h + i, &SENTINEL, 4) == 0;
    for (int64_t i = 0; i < 3 * P && !in_file; i++)
      FUZZ_ASSERT(memcmp(&buf[i], &SENTINEL, 4) != 0,
                  "the load succeeded but left element %lld of %s unwritten", (long long)(i % P),
                  i < P       ? "the weights"
                  : i < 2 * P ? "m"
                              : "v");
    FUZZ_ASSERT(st.step == h.step, "state of step %lld from a header of step %lld",
                (long long)st.step, (long long)h.step);
  }
  free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  int32_t magic = 0;
  if (size >= 4)
    memcpy(&magic, data, 4);
  if (magic == DT_LLMC_MAGIC)
    llmc(data, size);
  else
    shard(data, size);
  unlink(g_model);
  unlink(g_shard);
  char manifest[700];
  snprintf(manifest, sizeof manifest, "%s/" DT_CKPT_MANIFEST_NAME, g_sdir);
  unlink(manifest);
  return 0;
}
