/* prep.c — distrain-prep: turns a UTF-8 text file into byte-level llm.c token shards
 * (token = byte, vocab 256), so a demo or test needs no tokenizer.
 *
 *   distrain-prep --input FILE --out DIR [--val-fraction 0.1] [--shard-tokens N]
 * writes DIR/val.bin (the last val-fraction of the text) and DIR/train_000000.bin ... (the
 * rest, split every shard-tokens). Files are written atomically. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dataloader.h"
#include "dt_log.h"
#include "dt_util.h"

static int read_file(const char *path, uint8_t **buf, size_t *n)
{
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    fprintf(stderr, "distrain-prep: %s: %s\n", path, strerror(errno));
    return DT_ENOENT;
  }
  size_t cap = 1 << 20, len = 0;
  uint8_t *b = malloc(cap);
  size_t got;
  while (b && (got = fread(b + len, 1, cap - len, fp)) > 0) {
    len += got;
    if (len == cap) {
      uint8_t *grown = realloc(b, cap *= 2);
      if (!grown) {
        free(b);
        b = NULL;
      }
      b = grown;
    }
  }
  int err = ferror(fp);
  fclose(fp);
  if (!b || err) {
    free(b);
    fprintf(stderr, "distrain-prep: %s: read failed\n", path);
    return DT_EIO;
  }
  *buf = b;
  *n = len;
  return 0;
}

static int write_bytes(const char *path, const uint8_t *bytes, size_t n)
{
  uint16_t *tok = malloc((n ? n : 1) * sizeof(uint16_t));
  if (!tok)
    return DT_ENOMEM;
  for (size_t i = 0; i < n; i++)
    tok[i] = bytes[i];
  int rc = dt_shard_write(path, tok, (int64_t)n);
  free(tok);
  if (rc == 0)
    printf("wrote %s (%zu tokens)\n", path, n);
  return rc;
}

int main(int argc, char **argv)
{
  const char *input = NULL, *out = NULL;
  double val_frac = 0.1;
  int64_t shard_tokens = 100000000;
  static const struct option opts[] = {{"input", required_argument, 0, 'i'},
                                       {"out", required_argument, 0, 'o'},
                                       {"val-fraction", required_argument, 0, 'v'},
                                       {"shard-tokens", required_argument, 0, 's'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
    case 'i':
      input = optarg;
      break;
    case 'o':
      out = optarg;
      break;
    case 'v':
      if (dt_parse_f64(optarg, &val_frac) != 0 || val_frac <= 0.0 || val_frac >= 1.0) {
        fprintf(stderr, "distrain-prep: --val-fraction: expected a number in (0, 1), got '%s'\n",
                optarg);
        return 2;
      }
      break;
    case 's':
      if (dt_parse_i64(optarg, &shard_tokens) != 0 || shard_tokens < 1024) {
        fprintf(stderr, "distrain-prep: --shard-tokens: expected an integer >= 1024, got '%s'\n",
                optarg);
        return 2;
      }
      break;
    case 'h':
      printf("usage: distrain-prep --input FILE --out DIR [--val-fraction X] [--shard-tokens N]\n");
      return 0;
    default:
      fprintf(stderr, "usage: distrain-prep --input FILE --out DIR [--val-fraction X] "
                      "[--shard-tokens N]\n");
      return 2;
    }
  }
  if (!input || !out || !*out || optind < argc) {
    fprintf(stderr, "distrain-prep: --input and --out are required\n");
    return 2;
  }
  uint8_t *text;
  size_t n;
  if (read_file(input, &text, &n) != 0)
    return 1;
  size_t nval = (size_t)((double)n * val_frac);
  if (nval < 2 || n - nval < 2) {
    fprintf(stderr, "distrain-prep: %s: %zu bytes is too little text to split\n", input, n);
    free(text);
    return 1;
  }
  int rc = dt_mkdir_p(out);
  if (rc != 0) {
    fprintf(stderr, "distrain-prep: %s: cannot create directory: %s\n", out, dt_strerror(rc));
    free(text);
    return 1;
  }
  char path[4200];
  const char *sep = out[strlen(out) - 1] == '/' ? "" : "/"; /* "data/" names data/val.bin */
  size_t ntrain = n - nval;
  for (size_t off = 0, i = 0; off < ntrain && rc == 0; off += (size_t)shard_tokens, i++) {
    size_t len = DT_MIN((size_t)shard_tokens, ntrain - off);
    snprintf(path, sizeof path, "%s%strain_%06zu.bin", out, sep, i);
    rc = write_bytes(path, text + off, len);
  }
  if (rc == 0) {
    snprintf(path, sizeof path, "%s%sval.bin", out, sep);
    rc = write_bytes(path, text + ntrain, nval);
  }
  free(text);
  return rc == 0 ? 0 : 1;
}
