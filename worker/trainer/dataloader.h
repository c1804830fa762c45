/* dataloader.h — llm.c token shards in, (B, T) input/target batches out.
 *
 * Shard format (llm.c): 256 int32 header {20240520, 1, ntok, 0...} then ntok uint16 tokens.
 * A pattern may be one file or a glob; shards are used in sorted order.
 *
 * Windows: a window is one optimizer step's data, world*B*accum sequences of T tokens, taken
 * as consecutive tokens (plus one for the last target); in micro-step k (0 <= k < accum) rank r
 * of a data-parallel group of size world reads sequences [(k*world + r)*B, (k*world + r + 1)*B)
 * of it. A window does not depend on how the global batch is split: dp 4 x accum 1 and dp 2 x
 * accum 2 read the same sequences in every step, so a job resized between checkpoints (the
 * coordinator keeps the global batch) goes on with the data it would have had. Windows are
 * taken sequentially from the start of each shard (llm.c's unshuffled order) or, with
 * shuffling, in a seeded permutation of shards and of windows within each shard, re-drawn
 * every epoch. The position is (epoch, shard, window): a pure function of the seed, so a
 * checkpoint stores those numbers (and the window's size) and nothing else.
 *
 * Blends (blend.h: "0.7:web/train_*.bin,0.3:code/train_*.bin"). Each source is read as a stream of
 * single sequences, by the rules above with windows of one sequence (its own seed when shuffled),
 * and the global sequences are dealt to the sources as Megatron-LM's BlendedDataset deals samples:
 * sequence i goes to the source whose count falls furthest below weight x max(i, 1) (the first
 * on a tie), so every prefix of the run holds each source's share to within one sequence. A
 * window is still the step's world*B*accum consecutive global sequences, split over ranks and
 * micro-steps as above, so the layout does not change the data either. A blend's position is
 * the count of global sequences read (`seqs`) and how many each source was dealt (`taken`),
 * which give the sources' places; a checkpoint stores them and a fingerprint of the blend. A
 * run resumed with another blend (or from one source's checkpoint) goes on where the new
 * blend's sources would be after as many sequences, dealing them again to find out (about a
 * second per 10^8 sequences).
 * One source resumed from a blend's checkpoint goes on from window seqs / (world*B*accum) of
 * its stream, and a blend from one source's checkpoint from its `seqs` the same way.
 *
 * Every shard's header and size are checked when the loader opens; its tokens are checked
 * against the vocabulary the first time the shard is loaded. Errors name the file. */
#ifndef DT_TRAINER_DATALOADER_H
#define DT_TRAINER_DATALOADER_H

#include <stddef.h>
#include <stdint.h>

#include "blend.h"
#include "dt_util.h"

#define DT_SHARD_MAGIC   20240520
#define DT_SHARD_VERSION 1
#define DT_SHARD_HEADER  256 /* int32 words */

typedef struct {
  int64_t epoch;  /* completed passes over all shards */
  int64_t shard;  /* position in this epoch's shard order */
  int64_t window; /* position in this shard's window order */
  int64_t unit;   /* sequences per window (world*B*accum) of the loader that was there; 0 in
                     checkpoints older than the field, whose windows were world*B sequences */
  int64_t seqs;   /* global sequences read: windows x unit, summed over the run (0 in
                     checkpoints older than the field); a blend's position */
  uint64_t blend; /* fingerprint of the blend read (weights and shard sizes); 0: one source */
  int32_t nsrc;   /* a blend's sources, and the global sequences each was dealt */
  int64_t taken[DT_BLEND_MAX];
} dt_data_pos_t;

typedef struct dt_dataloader {
  int B, T, rank, world, accum, vocab, shuffle;
  int micro; /* micro-steps of the current window read */
  uint64_t seed;
  char **paths;     /* sorted shard paths */
  int64_t *ntok_of; /* tokens per shard, from the headers */
  int nshards;
  int64_t *shard_order;  /* (nshards) this epoch's order */
  int64_t *window_order; /* (nwindows) this shard's order, when shuffled */
  uint8_t *checked;      /* (nshards) tokens validated once */
  dt_data_pos_t pos;
  /* the current shard, memory-mapped */
  int loaded; /* index into paths, -1 when none */
  void *map;
  size_t map_bytes;
  const uint16_t *tokens; /* (ntok) */
  int64_t ntok, nwindows;
  int *inputs;  /* (B, T) */
  int *targets; /* (B, T) */
  /* a blend (nsrc > 0; the fields above then hold only B, T, rank, world, accum, micro, pos and
   * the batch buffers) */
  int nsrc;
  struct dt_dataloader *src; /* (nsrc) one loader of one-sequence windows per source */
  char **src_pattern;        /* (nsrc) */
  char src_name[DT_BLEND_MAX][DT_NAME_MAX]; /* (nsrc) as the blend names them (blend.h) */
  int *row_src;                /* (B) the source of each row of the current micro-batch */
  double *weight;              /* (nsrc) normalised to sum 1 */
  int64_t taken[DT_BLEND_MAX]; /* global sequences dealt to each source so far */
  uint64_t fingerprint;
} dt_dataloader_t;

/* Opens the shards matching pattern, or every source's of a blend ("W:GLOB,...": blend.h).
 * vocab bounds the token ids (tokens >= vocab are an error). rank/world select the
 * data-parallel slice (0/1 for one process), accum the micro-steps of an optimizer step. */
int dt_dataloader_init(dt_dataloader_t *dl, const char *pattern, int B, int T, int rank, int world,
                       int accum, int vocab, int shuffle, uint64_t seed);
/* Fills dl->inputs / dl->targets with the next micro-batch and advances. */
int dt_dataloader_next(dt_dataloader_t *dl);
/* Back to the first window of the first epoch. */
int dt_dataloader_reset(dt_dataloader_t *dl);
/* Moves to a saved position (from a checkpoint), taken at a step boundary. A position saved
 * with another window size (the global batch changed) is converted through its sequence
 * count, rounding down with a warning if it falls inside a window. */
int dt_dataloader_seek(dt_dataloader_t *dl, dt_data_pos_t pos);
/* Number of windows (optimizer steps' data) in one epoch (all shards); a blend: -1. */
int64_t dt_dataloader_epoch_windows(const dt_dataloader_t *dl);
/* How many windows from the start hold no sequence twice, at most max: one epoch's of one
 * source; a blend's before one of its sources would begin a second pass. */
int64_t dt_dataloader_windows_within(const dt_dataloader_t *dl, int64_t max);
void dt_dataloader_free(dt_dataloader_t *dl);

/* Writes tokens as an llm.c shard (temporary name, fsync, rename). */
int dt_shard_write(const char *path, const uint16_t *tokens, int64_t ntok);
/* The same in pieces: a shard of ntok tokens begun at path (its header written, under a
 * temporary name); the caller writes the tokens with dt_afile_write, then dt_afile_commit, or
 * dt_afile_abort. */
int dt_shard_begin(dt_afile_t *af, const char *path, int64_t ntok);
/* Reads a whole shard, checked as the loader checks it; *tokens is the caller's to free. */
int dt_shard_read(const char *path, uint16_t **tokens, int64_t *ntok);

#endif
