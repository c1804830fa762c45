/* fuzz_manifest.c — a checkpoint step's MANIFEST as found on disk (a crash mid-write, a
 * truncated copy, a hand edit): dt_ckpt_manifest_read either refuses it or returns a manifest a
 * loader can trust: world >= 1, one entry per rank in rank order, each naming a file inside the
 * step directory, the ranges tiling [0, num_params). */
#include <string.h>

#include "checkpoint_manifest.h"
#include "fuzz.h"

static char g_manifest[512];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
  (void)argc, (void)argv;
  snprintf(g_manifest, sizeof g_manifest, "%s/" DT_CKPT_MANIFEST_NAME, fuzz_setup());
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  fuzz_write(g_manifest, data, size);
  dt_ckpt_manifest_t mf;
  if (dt_ckpt_manifest_read(fuzz_setup(), &mf) != 0) {
    FUZZ_ASSERT(mf.shards == NULL, "a refused manifest left its shards allocated");
    return 0;
  }
  FUZZ_ASSERT(mf.world >= 1 && mf.shards, "accepted with world %d", mf.world);
  int64_t lo = 0;
  for (int r = 0; r < mf.world; r++) {
    const dt_ckpt_shard_info_t *s = &mf.shards[r];
    FUZZ_ASSERT(s->rank == r, "entry %d is rank %d's: a rank listed twice, another missing", r,
                s->rank);
    FUZZ_ASSERT(s->name[0] != '\0' && !strchr(s->name, '/') && strcmp(s->name, ".") != 0 &&
                    strcmp(s->name, "..") != 0,
                "rank %d's shard is '%s', not a file in the step directory", r, s->name);
    FUZZ_ASSERT(s->lo == lo && s->hi >= s->lo, "rank %d holds [%lld, %lld) after %lld", r,
                (long long)s->lo, (long long)s->hi, (long long)lo);
    lo = s->hi;
  }
  FUZZ_ASSERT(lo == mf.num_params, "the shards end at %lld of %lld", (long long)lo,
              (long long)mf.num_params);
  free(mf.shards);
  return 0;
}
