/* bench_blend.c — what a blend's position costs on resume (worker/trainer/dataloader.h).
 *
 * A checkpoint of the same blend holds each source's count, and the seek is a lookup; one of
 * another blend or of a one-source run holds only the sequence count, and the loader deals
 * that many sequences again to find the counts. This times both for a blend of SOURCES sources
 * weighted 1, 2, 3, ... (one small shard each, made here) at the sequence counts given.
 *
 *   build/tests/bench/bench_blend [SOURCES (default 2)] [SEQUENCES ...] (default 1e6 1e7 1e8)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dataloader.h"
#include "dt_util.h"

static double now_s(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv)
{
  const int nsrc = argc > 1 ? atoi(argv[1]) : 2;
  if (nsrc < 1 || nsrc > DT_BLEND_MAX) {
    fprintf(stderr, "bench_blend: SOURCES must be in 1..%d\n", DT_BLEND_MAX);
    return 2;
  }
  char dir[] = "/tmp/bench-blend-XXXXXX", spec[DT_BLEND_MAX * 64] = "", path[64];
  if (!mkdtemp(dir))
    return 1;
  uint16_t tokens[1025] = {0};
  for (int d = 0; d < nsrc; d++) {
    snprintf(path, sizeof path, "%s/s%d.bin", dir, d);
    if (dt_shard_write(path, tokens, 1025) != 0)
      return 1;
    /* unequal weights: 1, 2, 3, ... */
    snprintf(spec + strlen(spec), sizeof spec - strlen(spec), "%s%d:%s", d ? "," : "", d + 1, path);
  }
  dt_dataloader_t dl;
  if (dt_dataloader_init(&dl, spec, 1, 32, 0, 1, 1, 65536, 0, 0) != 0)
    return 1;
  static const char *const defaults[] = {"1e6", "1e7", "1e8"};
  const int n = argc > 2 ? argc - 2 : 3;
  printf("blend of %d sources: seek to a position\n%14s %16s %16s\n", nsrc, "sequences",
         "dealt again (s)", "with counts (s)");
  for (int i = 0; i < n; i++) {
    const int64_t seqs = (int64_t)atof(argc > 2 ? argv[i + 2] : defaults[i]);
    dt_data_pos_t pos = {.seqs = seqs};
    double t0 = now_s();
    if (dt_dataloader_seek(&dl, pos) != 0)
      return 1;
    const double again = now_s() - t0;
    pos = dl.pos;
    t0 = now_s();
    if (dt_dataloader_seek(&dl, pos) != 0)
      return 1;
    printf("%14lld %16.3f %16.6f\n", (long long)seqs, again, now_s() - t0);
  }
  dt_dataloader_free(&dl);
  for (int d = 0; d < nsrc; d++) {
    snprintf(path, sizeof path, "%s/s%d.bin", dir, d);
    unlink(path);
  }
  rmdir(dir);
  return 0;
}
