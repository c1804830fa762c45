/* fuzz_data.c — a token shard as found on disk (llm.c's format: a 256-word header, then
 * uint16 tokens): the data loader opens it (header, size, enough tokens for a window) and
 * serves batches, shuffled or not as the input's last byte says, or refuses it with a reason.
 * Then it seeks to a saved position (what a checkpoint restores), taken from header words 8-15
 * (unused by the format) as four int64: epoch, shard, window and the window size it was saved
 * with, and serves more. Property: every token it serves is below the vocabulary and each
 * target is the token after its input; a position it cannot honour is refused. */
#include <string.h>

#include "dataloader.h"
#include "fuzz.h"

#define VOCAB 50257

static char g_path[600];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
  (void)argc, (void)argv;
  snprintf(g_path, sizeof g_path, "%s/shard_000000.bin", fuzz_setup());
  return 0;
}

static void serve(dt_dataloader_t *dl, int B, int T)
{
  for (int step = 0; step < 4; step++) {
    if (dt_dataloader_next(dl) != 0)
      break;
    for (int i = 0; i < B * T; i++) {
      FUZZ_ASSERT(dl->inputs[i] >= 0 && dl->inputs[i] < VOCAB && dl->targets[i] >= 0 &&
                      dl->targets[i] < VOCAB,
                  "token %d / target %d outside the vocabulary", dl->inputs[i], dl->targets[i]);
      if (i % T != T - 1)
        FUZZ_ASSERT(dl->targets[i] == dl->inputs[i + 1], "target %d is not the next input", i);
    }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  fuzz_write(g_path, data, size);
  const int B = 2, T = 3, shuffle = size ? data[size - 1] & 1 : 0;
  dt_dataloader_t dl;
  if (dt_dataloader_init(&dl, g_path, B, T, 0, 1, 1, VOCAB, shuffle, 7) != 0)
    return 0;
  serve(&dl, B, T);
  dt_data_pos_t pos;
  memcpy(&pos, data + 8 * 4, sizeof pos); /* the loader accepted a 1024-byte header */
  if (dt_dataloader_seek(&dl, pos) == 0) {
    FUZZ_ASSERT(dl.pos.window >= 0 && dl.pos.window <= dl.nwindows,
                "seek to window %lld (saved in windows of %lld sequences) gave window %lld of %lld",
                (long long)pos.window, (long long)pos.unit, (long long)dl.pos.window,
                (long long)dl.nwindows);
    serve(&dl, B, T);
  }
  dt_dataloader_free(&dl);
  return 0;
}
