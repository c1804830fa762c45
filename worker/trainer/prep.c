/* prep.c — distrain-prep: text in, llm.c token shards out (and back, to read a shard).
 *
 *   distrain-prep --input FILE [--input FILE ...] --out DIR [--val-fraction X] [--shard-tokens N]
 *                 [--vocab-file vocab.json --merge-file merges.txt [--doc-sep S] [--jsonl-key K]]
 *                 [--threads N]
 *   distrain-prep --decode SHARD [--vocab-file vocab.json]
 *   distrain-prep --hellaswag FILE.jsonl --out DIR [--vocab-file vocab.json
 *                 --merge-file merges.txt]
 *
 * Without a tokenizer the shards are byte-level (token = byte, vocab 256; the inputs one after
 * another), so a demo or test needs no tokenizer files. With GPT-2's BPE files (tokenizer.h)
 * each document is written as an <|endoftext|> token and the document's tokens, as llm.c's data
 * scripts write them. A document is an input file, or each part of one between --doc-sep
 * separators, or, for a FILE ending in .jsonl, the string field K ("text") of each line's JSON
 * object; documents, and the parts a long one is cut into, are encoded on --threads threads.
 * Either way the last val-fraction of the tokens is DIR/val.bin and the rest
 * DIR/train_000000.bin ..., split every shard-tokens. Files are written atomically; nothing is
 * written when an input is bad. Memory does not grow with the corpus: inputs are mapped and
 * dropped as they are encoded, and the tokens past PrepBufferTokens wait in a spill file. --decode
 * writes a shard's text (its tokens' bytes) to stdout.
 * --hellaswag turns HellaSwag's jsonl into DIR/NAME.bin, an eval file for distrain-train --eval
 * (evalset.h), as llm.c's hellaswag.py writes it. */
#define _GNU_SOURCE /* memmem */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <json-c/json.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "dataloader.h"
#include "dt_log.h"
#include "evalset.h"
#include "dt_param.h"
#include "dt_util.h"
#include "tokenizer.h"

#define USAGE                                                                                      \
  "usage: distrain-prep --input FILE [--input FILE ...] --out DIR [--val-fraction X]\n"            \
  "                     [--shard-tokens N] [--vocab-file vocab.json --merge-file merges.txt\n"     \
  "                     [--doc-sep TEXT] [--jsonl-key KEY]] [--threads N]\n"                       \
  "       distrain-prep --decode SHARD [--vocab-file vocab.json]\n"                                \
  "       distrain-prep --hellaswag FILE.jsonl --out DIR [--vocab-file vocab.json\n"               \
  "                     --merge-file merges.txt]\n"

/* A part of a document, encoded by one thread: a whole document, or a piece of a long one cut
 * where its encoding splits cleanly (dt_bpe_next_cut). */
typedef struct {
  const char *text; /* in its input's buffer, or in own */
  char *own;        /* the document's copy (a .jsonl line's), freed with its first part */
  size_t len;
  int doc;          /* the document's first part: <|endoftext|> goes before it */
  const char *path; /* where it is, for errors: line (.jsonl) or byte offset base */
  size_t line, base;
  int32_t *ids; /* its tokens */
  size_t n, cap, bad;
  int rc;
} part_t;

typedef struct {
  dt_bpe_t *bpe;  /* NULL: byte-level */
  dt_bpe_t **enc; /* (threads) each thread's tokenizer: bpe, then clones */
  int threads;
  int eot;
  const char *doc_sep; /* escapes decoded; NULL: a file is one document */
  const char *jsonl_key;
  size_t part_bytes;  /* a longer document is cut into parts of about this size */
  size_t batch_bytes; /* text encoded at once */
  part_t *parts;      /* waiting to be encoded */
  size_t nparts, pcap, pending;
  /* The tokens so far: the first `spilled` in the spill file, the rest in tok. tok grows up
   * to PrepBufferTokens, then goes to the spill: an unlinked file in the output directory, so
   * that a corpus larger than memory can be prepared, and no file is left if prep fails. */
  uint16_t *tok;
  size_t n, cap;
  int spill; /* its descriptor, or -1 */
  size_t spilled;
  const char *out;
  int made_out; /* prep created the output directory (to take it away again on failure) */
  /* the input being read, mapped: its pages below `released` are encoded and dropped */
  const uint8_t *map;
  size_t map_len, released;
  size_t docs, bytes;
} prep_t;

/* A document longer than this is cut into parts of about this size (tests make it small). */
DT_PARAM(PrepPartBytes, "PREP_PART_BYTES", 1 << 20)
/* Text encoded at once, in parallel (tests make it small). */
DT_PARAM(PrepBatchBytes, "PREP_BATCH_BYTES", 64 << 20)
/* Tokens held in memory; more go to the spill file (tests make it small). */
DT_PARAM(PrepBufferTokens, "PREP_BUFFER_TOKENS", 64 << 20)

/* An input's text, mapped (the page cache holds it, not the heap; an empty file is NULL). */
static int map_file(const char *path, const uint8_t **text, size_t *n)
{
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) {
    fprintf(stderr, "distrain-prep: %s: %s\n", path, strerror(errno));
    if (fd >= 0)
      close(fd);
    return DT_ENOENT;
  }
  void *m = st.st_size > 0 ? mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
  close(fd);
  if (m == MAP_FAILED) {
    fprintf(stderr, "distrain-prep: %s: cannot map it: %s\n", path, strerror(errno));
    return DT_EIO;
  }
  if (m)
    madvise(m, (size_t)st.st_size, MADV_SEQUENTIAL);
  *text = m;
  *n = (size_t)st.st_size;
  return 0;
}

/* Writes all of buf (bytes) to fd. */
static int write_all(int fd, const void *buf, size_t bytes)
{
  for (const char *b = buf; bytes > 0;) {
    const ssize_t w = write(fd, b, bytes);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return DT_EIO;
    b += w;
    bytes -= (size_t)w;
  }
  return 0;
}

/* Room for one more token: tok grows up to PrepBufferTokens, then its tokens go to the spill. */
static int make_room(prep_t *p)
{
  const size_t limit = (size_t)DT_MAX(dt_param_PrepBufferTokens(), 1);
  if (p->cap < limit) {
    const size_t cap = DT_MIN(p->cap ? 2 * p->cap : (size_t)1 << 20, limit);
    uint16_t *t = realloc(p->tok, cap * sizeof *t);
    if (!t) {
      fprintf(stderr, "distrain-prep: out of memory at %zu tokens\n", p->spilled + p->n);
      return DT_ENOMEM;
    }
    p->tok = t;
    p->cap = cap;
    return 0;
  }
  if (p->spill < 0) {
    char path[4200];
    int rc = 0;
    if (access(p->out, F_OK) != 0 && (rc = dt_mkdir_p(p->out)) == 0)
      p->made_out = 1;
    snprintf(path, sizeof path, "%s%s.distrain-prep.%d.tokens", p->out,
             p->out[strlen(p->out) - 1] == '/' ? "" : "/", (int)getpid());
    if (rc == 0 && (p->spill = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600)) >= 0)
      unlink(path); /* the file lives while it is open */
    if (p->spill < 0) {
      fprintf(stderr, "distrain-prep: %s: cannot hold the tokens there: %s\n", p->out,
              rc ? dt_strerror(rc) : strerror(errno));
      return DT_EIO;
    }
  }
  if (write_all(p->spill, p->tok, p->n * sizeof *p->tok) != 0) {
    fprintf(stderr, "distrain-prep: %s: writing the tokens there failed: %s\n", p->out,
            strerror(errno));
    return DT_EIO;
  }
  p->spilled += p->n;
  p->n = 0;
  return 0;
}

static inline int put(prep_t *p, uint16_t tok)
{
  if (p->n == p->cap)
    DT_CHECK(make_room(p));
  p->tok[p->n++] = tok;
  return 0;
}

static void part_where(const part_t *q, char *buf, size_t n)
{
  if (q->line)
    snprintf(buf, n, "%s:%zu", q->path, q->line);
  else
    snprintf(buf, n, "%s", q->path);
}

/* Drops the mapped input's pages below upto (read and encoded) from memory: a file larger
 * than memory streams through. A private read-only mapping reads them back if touched. */
static void release_map(prep_t *p, const void *upto)
{
  const uint8_t *u = upto;
  if (!p->map || u < p->map || u > p->map + p->map_len)
    return;
  const size_t page = (size_t)sysconf(_SC_PAGESIZE), end = (size_t)(u - p->map) / page * page;
  if (end > p->released) {
    madvise((void *)(p->map + p->released), end - p->released, MADV_DONTNEED);
    p->released = end;
  }
}

/* Encodes the waiting parts, each on a thread of its own, and appends their tokens in order. */
static int flush(prep_t *p)
{
  const long nparts = (long)p->nparts;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p->threads)
  for (long i = 0; i < nparts; i++) {
    part_t *q = &p->parts[i];
    q->rc = dt_bpe_encode(p->enc[omp_get_thread_num()], q->text, q->len, &q->ids, &q->n, &q->cap,
                          &q->bad);
  }
  int rc = 0;
  for (size_t i = 0; i < p->nparts; i++) {
    part_t *q = &p->parts[i];
    char where[4200];
    if (rc == 0 && q->rc != 0)
      part_where(q, where, sizeof where);
    if (rc == 0 && q->rc == DT_EINVAL) {
      fprintf(stderr,
              "distrain-prep: %s: byte offset %zu%s is not UTF-8 (GPT-2's tokenizer reads UTF-8 "
              "text)\n",
              where, q->base + q->bad, q->line ? " of its text" : "");
      rc = q->rc;
    } else if (rc == 0 && q->rc != 0) {
      fprintf(stderr, "distrain-prep: %s: tokenizing failed: %s\n", where, dt_strerror(q->rc));
      rc = q->rc;
    }
    if (rc == 0 && q->doc)
      rc = put(p, (uint16_t)p->eot);
    for (size_t k = 0; k < q->n && rc == 0; k++)
      rc = put(p, (uint16_t)q->ids[k]);
    free(q->ids);
    free(q->own);
  }
  if (rc == 0 && p->nparts > 0)
    release_map(p, p->parts[p->nparts - 1].text + p->parts[p->nparts - 1].len);
  p->nparts = p->pending = 0;
  return rc;
}

/* One document: <|endoftext|> and its tokens, in parts of about part_bytes, encoded a batch
 * (PrepBatchBytes of text) at a time: a long document's parts too, so that neither its text nor
 * its tokens are held whole. own (or NULL) is the text's buffer, which the document's last
 * part then owns (freed once every part is encoded). */
static int add_document(prep_t *p, const char *text, size_t len, char *own, const char *path,
                        size_t line, size_t base)
{
  int rc = 0;
  for (size_t off = 0, end; rc == 0; off = end) {
    end = len - off > p->part_bytes ? dt_bpe_next_cut(text, len, off + p->part_bytes) : len;
    if (p->nparts == p->pcap) {
      size_t cap = p->pcap ? 2 * p->pcap : 256;
      part_t *grown = realloc(p->parts, cap * sizeof *grown);
      if (!grown) {
        rc = DT_ENOMEM;
        break;
      }
      p->parts = grown;
      p->pcap = cap;
    }
    p->parts[p->nparts++] = (part_t){.text = text + off,
                                     .own = end == len ? own : NULL,
                                     .len = end - off,
                                     .doc = off == 0,
                                     .path = path,
                                     .line = line,
                                     .base = base + off};
    p->pending += end - off;
    if (end == len) {
      p->docs++;
      p->bytes += len;
      return p->pending >= p->batch_bytes ? flush(p) : 0;
    }
    if (p->pending >= p->batch_bytes)
      rc = flush(p);
  }
  free(own); /* no part owns it yet */
  return rc;
}

/* Calls fn with each line's JSON object of a .jsonl file (blank lines skipped), its line number
 * and "FILE:LINE" for messages, until fn returns an error; a line that is not a JSON object
 * is one, reported here. */
typedef int (*jsonl_fn)(void *ud, json_object *obj, const char *path, size_t line,
                        const char *where);

static int for_each_jsonl(const char *path, jsonl_fn fn, void *ud)
{
  FILE *fp = fopen(path, "r");
  if (!fp) {
    fprintf(stderr, "distrain-prep: %s: %s\n", path, strerror(errno));
    return DT_ENOENT;
  }
  char *line = NULL, where[4200];
  size_t cap = 0;
  ssize_t got;
  int rc = 0;
  for (size_t lineno = 1; rc == 0 && (got = getline(&line, &cap, fp)) > 0; lineno++) {
    snprintf(where, sizeof where, "%s:%zu", path, lineno);
    if (strspn(line, " \t\r\n") == (size_t)got)
      continue; /* a blank line (the last one, often) */
    enum json_tokener_error jerr = json_tokener_success;
    json_object *obj = json_tokener_parse_verbose(line, &jerr);
    if (!obj || jerr != json_tokener_success) {
      fprintf(stderr, "distrain-prep: %s: not a JSON object: %s\n", where,
              json_tokener_error_desc(jerr));
      rc = DT_EFORMAT;
    } else if (!json_object_is_type(obj, json_type_object)) {
      fprintf(stderr, "distrain-prep: %s: not a JSON object\n", where);
      rc = DT_EFORMAT;
    } else {
      rc = fn(ud, obj, path, lineno, where);
    }
    json_object_put(obj);
  }
  if (rc == 0 && ferror(fp)) {
    fprintf(stderr, "distrain-prep: %s: read failed\n", path);
    rc = DT_EIO;
  }
  free(line);
  fclose(fp);
  return rc;
}

/* A .jsonl line's document: its string field --jsonl-key. */
static int jsonl_document(void *ud, json_object *obj, const char *path, size_t line,
                          const char *where)
{
  prep_t *p = ud;
  json_object *text;
  if (!json_object_object_get_ex(obj, p->jsonl_key, &text) ||
      !json_object_is_type(text, json_type_string)) {
    fprintf(stderr, "distrain-prep: %s: expected a string field \"%s\" (--jsonl-key)\n", where,
            p->jsonl_key);
    return DT_EFORMAT;
  }
  /* the document outlives the object: it is encoded in a later batch */
  const size_t len = (size_t)json_object_get_string_len(text);
  char *copy = malloc(len ? len : 1);
  if (!copy)
    return DT_ENOMEM;
  memcpy(copy, json_object_get_string(text), len);
  return add_document(p, copy, len, copy, path, line, 0);
}

static int add_input(prep_t *p, const char *path)
{
  const size_t plen = strlen(path);
  if (p->bpe && plen > 6 && strcmp(path + plen - 6, ".jsonl") == 0)
    return for_each_jsonl(path, jsonl_document, p);
  const uint8_t *text;
  size_t n;
  DT_CHECK(map_file(path, &text, &n));
  p->map = text;
  p->map_len = n;
  p->released = 0;
  int rc = 0;
  if (!p->bpe) { /* byte-level */
    for (size_t off = 0; off < n && rc == 0; off += p->batch_bytes) {
      const size_t end = DT_MIN(n, off + p->batch_bytes);
      for (size_t i = off; i < end && rc == 0; i++)
        rc = put(p, text[i]);
      release_map(p, text + end);
    }
    p->bytes += n;
  } else {
    const size_t seplen = p->doc_sep ? strlen(p->doc_sep) : 0;
    for (size_t off = 0; off < n && rc == 0;) {
      const uint8_t *end = seplen ? memmem(text + off, n - off, p->doc_sep, seplen) : NULL;
      const size_t len = end ? (size_t)(end - (text + off)) : n - off;
      if (len > 0)
        rc = add_document(p, (const char *)text + off, len, NULL, path, 0, off);
      off += len + (end ? seplen : 0);
    }
    if (rc == 0)
      rc = flush(p); /* its parts point into text */
  }
  if (text)
    munmap((void *)text, n);
  p->map = NULL;
  return rc;
}

/* --doc-sep's C escapes (\n, \t, \r, \\) decoded in place. */
static int unescape(char *s)
{
  char *w = s;
  for (const char *r = s; *r; r++) {
    if (*r != '\\') {
      *w++ = *r;
      continue;
    }
    switch (*++r) {
    case 'n':
      *w++ = '\n';
      break;
    case 't':
      *w++ = '\t';
      break;
    case 'r':
      *w++ = '\r';
      break;
    case '\\':
      *w++ = '\\';
      break;
    default:
      return -1;
    }
  }
  *w = '\0';
  return w == s ? -1 : 0;
}

/* Tokens [a, b) of all of them (the spill's, then tok's) as the shard path. */
static int write_shard(const prep_t *p, const char *path, size_t a, size_t b, uint16_t *chunk,
                       size_t chunk_tokens)
{
  const size_t ntok = b - a;
  dt_afile_t af;
  DT_CHECK(dt_shard_begin(&af, path, (int64_t)ntok));
  int rc = 0;
  while (rc == 0 && a < p->spilled && a < b) {
    const size_t k = DT_MIN(DT_MIN(b, p->spilled) - a, chunk_tokens);
    if (pread(p->spill, chunk, k * sizeof *chunk, (off_t)(a * sizeof *chunk)) !=
        (ssize_t)(k * sizeof *chunk)) {
      fprintf(stderr, "distrain-prep: reading the tokens back failed: %s\n", strerror(errno));
      rc = DT_EIO;
    } else {
      rc = dt_afile_write(&af, chunk, k * sizeof *chunk);
      a += k;
    }
  }
  if (rc == 0 && a < b)
    rc = dt_afile_write(&af, p->tok + (a - p->spilled), (b - a) * sizeof *p->tok);
  if (rc != 0) {
    dt_afile_abort(&af);
    return rc;
  }
  rc = dt_afile_commit(&af);
  if (rc == 0)
    printf("wrote %s (%zu tokens)\n", path, ntok);
  return rc;
}

static int write_shards(const prep_t *p, double val_frac, int64_t shard_tokens)
{
  const size_t n = p->spilled + p->n, nval = (size_t)((double)n * val_frac);
  if (nval < 2 || n - nval < 2) {
    fprintf(stderr, "distrain-prep: %zu tokens is too little text to split\n", n);
    return DT_EINVAL;
  }
  const char *out = p->out;
  int rc = dt_mkdir_p(out);
  if (rc != 0) {
    fprintf(stderr, "distrain-prep: %s: cannot create directory: %s\n", out, dt_strerror(rc));
    return rc;
  }
  const size_t chunk_tokens = 8u << 20;
  uint16_t *chunk = p->spilled ? malloc(chunk_tokens * sizeof *chunk) : NULL;
  if (p->spilled && !chunk)
    return DT_ENOMEM;
  char path[4200];
  const char *sep = out[strlen(out) - 1] == '/' ? "" : "/"; /* "data/" names data/val.bin */
  const size_t ntrain = n - nval;
  for (size_t off = 0, i = 0; off < ntrain && rc == 0; off += (size_t)shard_tokens, i++) {
    snprintf(path, sizeof path, "%s%strain_%06zu.bin", out, sep, i);
    rc = write_shard(p, path, off, DT_MIN(off + (size_t)shard_tokens, ntrain), chunk, chunk_tokens);
  }
  if (rc == 0) {
    snprintf(path, sizeof path, "%s%sval.bin", out, sep);
    rc = write_shard(p, path, ntrain, n, chunk, chunk_tokens);
  }
  free(chunk);
  return rc;
}

/* A shard's text to stdout: each token's bytes (a byte-level shard's tokens are bytes). */
static int decode(const char *shard, dt_bpe_t *bpe)
{
  uint16_t *tok;
  int64_t n;
  if (dt_shard_read(shard, &tok, &n) != 0) {
    fprintf(stderr, "distrain-prep: %s: not a readable token shard (the log says why)\n", shard);
    return 1;
  }
  int rc = 0;
  for (int64_t i = 0; i < n && rc == 0; i++) {
    size_t len = 1;
    const uint8_t byte = (uint8_t)tok[i];
    const uint8_t *bytes = bpe ? dt_bpe_decode(bpe, tok[i], &len) : tok[i] < 256 ? &byte : NULL;
    if (!bytes) {
      fprintf(stderr, "distrain-prep: %s: token %u at position %lld is not in the %s\n", shard,
              tok[i], (long long)i, bpe ? "vocabulary" : "byte vocabulary (give --vocab-file)");
      rc = 1;
    } else if (fwrite(bytes, 1, len, stdout) != len) {
      fprintf(stderr, "distrain-prep: writing the text failed: %s\n", strerror(errno));
      rc = 1;
    }
  }
  free(tok);
  return rc;
}

/* Appends the tokens of len bytes of text: GPT-2's BPE, or its bytes without a tokenizer. */
static int encode_text(dt_bpe_t *bpe, const char *text, size_t len, int32_t **ids, size_t *n,
                       size_t *cap, size_t *bad)
{
  if (bpe)
    return dt_bpe_encode(bpe, text, len, ids, n, cap, bad);
  DT_CHECK(dt_grow((void **)ids, cap, *n + len, sizeof **ids));
  for (size_t i = 0; i < len; i++)
    (*ids)[(*n)++] = (uint8_t)text[i];
  return 0;
}

typedef struct {
  dt_evalset_t set;
  dt_bpe_t *bpe;
} hellaswag_t;

/* One HellaSwag example (a line's JSON object) into the set: the context ("ctx") and each ending,
 * encoded as " " + ending, as llm.c's hellaswag.py does (GPT-2's tokens of a word include its
 * leading space). Errors are printed with where (FILE:LINE). */
static int hellaswag_example(void *ud, json_object *obj, const char *path, size_t line,
                             const char *where)
{
  (void)path, (void)line;
  dt_evalset_t *e = &((hellaswag_t *)ud)->set;
  dt_bpe_t *bpe = ((hellaswag_t *)ud)->bpe;
  json_object *ctx, *label, *endings;
  if (!json_object_object_get_ex(obj, "ctx", &ctx) || !json_object_is_type(ctx, json_type_string) ||
      !json_object_object_get_ex(obj, "endings", &endings) ||
      !json_object_is_type(endings, json_type_array)) {
    fprintf(stderr,
            "distrain-prep: %s: expected HellaSwag's fields: a string \"ctx\" and an array "
            "\"endings\"\n",
            where);
    return DT_EFORMAT;
  }
  if (!json_object_object_get_ex(obj, "label", &label) ||
      !json_object_is_type(label, json_type_int)) {
    fprintf(stderr,
            "distrain-prep: %s: expected an integer \"label\" (HellaSwag's test split has "
            "none; evaluate on its val split)\n",
            where);
    return DT_EFORMAT;
  }
  const int ncompletions = (int)json_object_array_length(endings);
  if (ncompletions < 2 || ncompletions > DT_EVAL_MAX_COMPLETIONS) {
    fprintf(stderr, "distrain-prep: %s: %d endings (expected 2..%d)\n", where, ncompletions,
            DT_EVAL_MAX_COMPLETIONS);
    return DT_EFORMAT;
  }
  int32_t *ids = NULL; /* the context's tokens, then each ending's */
  size_t n = 0, cap = 0, bad = 0, start[DT_EVAL_MAX_COMPLETIONS + 2];
  char *text = NULL;
  int rc = 0;
  for (int j = -1; j < ncompletions && rc == 0; j++) {
    json_object *s = j < 0 ? ctx : json_object_array_get_idx(endings, (size_t)j);
    if (!json_object_is_type(s, json_type_string)) {
      fprintf(stderr, "distrain-prep: %s: ending %d is not a string\n", where, j);
      rc = DT_EFORMAT;
      break;
    }
    const size_t len = (size_t)json_object_get_string_len(s), lead = j >= 0;
    char *grown = realloc(text, len + lead + 1);
    if (!grown) {
      rc = DT_ENOMEM;
      break;
    }
    text = grown;
    text[0] = ' ';
    memcpy(text + lead, json_object_get_string(s), len);
    start[j + 1] = n;
    rc = encode_text(bpe, text, len + lead, &ids, &n, &cap, &bad);
    if (rc == DT_EINVAL)
      fprintf(stderr, "distrain-prep: %s: byte offset %zu of its %s is not UTF-8\n", where,
              bad - lead, j < 0 ? "context" : "endings");
  }
  start[ncompletions + 1] = n;
  int *tok = rc == 0 ? malloc((n ? n : 1) * sizeof *tok) : NULL;
  if (rc == 0 && !tok)
    rc = DT_ENOMEM;
  if (rc == 0) {
    const int *parts[DT_EVAL_MAX_COMPLETIONS + 1];
    int lens[DT_EVAL_MAX_COMPLETIONS + 1];
    for (size_t i = 0; i < n; i++)
      tok[i] = ids[i];
    for (int j = 0; j <= ncompletions; j++) {
      parts[j] = tok + start[j];
      lens[j] = (int)(start[j + 1] - start[j]);
    }
    char why[160];
    rc = dt_evalset_add(e, json_object_get_int(label), parts[0], lens[0], parts + 1, lens + 1,
                        ncompletions, why, sizeof why);
    if (rc != 0)
      fprintf(stderr, "distrain-prep: %s: %s\n", where, why);
  }
  free(tok);
  free(ids);
  free(text);
  return rc;
}

/* --hellaswag: each line of in (HellaSwag's jsonl) an example, written to DIR/NAME.bin (NAME:
 * in's file name without .jsonl). */
static int hellaswag(dt_bpe_t *bpe, const char *in, const char *out)
{
  hellaswag_t h = {.bpe = bpe};
  dt_evalset_t *e = &h.set;
  int rc = for_each_jsonl(in, hellaswag_example, &h);
  if (rc == 0 && e->n == 0) {
    fprintf(stderr, "distrain-prep: %s: no examples\n", in);
    rc = DT_EFORMAT;
  }
  char path[8400];
  const char *base = strrchr(in, '/') ? strrchr(in, '/') + 1 : in;
  const size_t blen = strlen(base);
  const int cut = blen > 6 && strcmp(base + blen - 6, ".jsonl") == 0 ? 6 : 0;
  snprintf(path, sizeof path, "%s%s%.*s.bin", out, out[strlen(out) - 1] == '/' ? "" : "/",
           (int)(blen - (size_t)cut), base);
  if (rc == 0 && (rc = dt_mkdir_p(out)) != 0)
    fprintf(stderr, "distrain-prep: %s: cannot create directory: %s\n", out, dt_strerror(rc));
  if (rc == 0 && (rc = dt_evalset_save(e, path)) == 0)
    printf("wrote %s (%d examples, %d completions; rows of up to %d tokens)\n", path, e->n, e->rows,
           e->max_tokens);
  dt_evalset_free(e);
  return rc == 0 ? 0 : 1;
}

static dt_bpe_t *open_tokenizer(const char *vocab, const char *merges)
{
  char err[8300];
  dt_bpe_t *bpe;
  if (dt_bpe_create(&bpe, vocab, merges, err, sizeof err) != 0) {
    fprintf(stderr, "distrain-prep: %s\n", err);
    return NULL;
  }
  return bpe;
}

int main(int argc, char **argv)
{
  const char **inputs = calloc((size_t)argc, sizeof *inputs);
  const char *out = NULL, *vocab = NULL, *merges = NULL, *shard = NULL, *hswag = NULL;
  char *doc_sep = NULL;
  int ninputs = 0, ret = 2;
  int threads = omp_get_max_threads();
  double val_frac = 0.1;
  int64_t shard_tokens = 100000000;
  prep_t p = {.jsonl_key = "text", .spill = -1};
  static const struct option opts[] = {{"input", required_argument, 0, 'i'},
                                       {"out", required_argument, 0, 'o'},
                                       {"val-fraction", required_argument, 0, 'v'},
                                       {"shard-tokens", required_argument, 0, 's'},
                                       {"vocab-file", required_argument, 0, 'V'},
                                       {"merge-file", required_argument, 0, 'M'},
                                       {"doc-sep", required_argument, 0, 'S'},
                                       {"jsonl-key", required_argument, 0, 'J'},
                                       {"decode", required_argument, 0, 'D'},
                                       {"threads", required_argument, 0, 'T'},
                                       {"hellaswag", required_argument, 0, 'H'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while (inputs && (c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
    case 'i':
      inputs[ninputs++] = optarg;
      break;
    case 'o':
      out = optarg;
      break;
    case 'v':
      if (dt_parse_f64(optarg, &val_frac) != 0 || val_frac <= 0.0 || val_frac >= 1.0) {
        fprintf(stderr, "distrain-prep: --val-fraction: expected a number in (0, 1), got '%s'\n",
                optarg);
        goto out;
      }
      break;
    case 's':
      if (dt_parse_i64(optarg, &shard_tokens) != 0 || shard_tokens < 1024) {
        fprintf(stderr, "distrain-prep: --shard-tokens: expected an integer >= 1024, got '%s'\n",
                optarg);
        goto out;
      }
      break;
    case 'V':
      vocab = optarg;
      break;
    case 'M':
      merges = optarg;
      break;
    case 'S':
      doc_sep = optarg;
      if (unescape(doc_sep) != 0) {
        fprintf(stderr, "distrain-prep: --doc-sep: expected text, with escapes \\n \\t \\r \\\\ "
                        "only\n");
        goto out;
      }
      break;
    case 'J':
      p.jsonl_key = optarg;
      break;
    case 'D':
      shard = optarg;
      break;
    case 'H':
      hswag = optarg;
      break;
    case 'T':
      if (dt_parse_int_flag("distrain-prep", "--threads", optarg, 1, 1024, &threads) != 0)
        goto out;
      break;
    case 'h':
      printf(USAGE);
      ret = 0;
      goto out;
    default:
      fprintf(stderr, USAGE);
      goto out;
    }
  }
  if (!inputs) {
    ret = 1;
    goto out;
  }
  if (optind < argc) {
    fprintf(stderr, "distrain-prep: unexpected argument '%s'\n%s", argv[optind], USAGE);
    goto out;
  }
  if (shard) {
    if (ninputs || out || merges || doc_sep) {
      fprintf(stderr, "distrain-prep: --decode takes only --vocab-file\n");
      goto out;
    }
    ret = 1;
    if (!vocab || (p.bpe = open_tokenizer(vocab, NULL)))
      ret = decode(shard, p.bpe);
    goto out;
  }
  if (hswag) {
    if (ninputs || doc_sep || !out || !*out || !vocab != !merges) {
      fprintf(stderr, "distrain-prep: --hellaswag takes --out and, for GPT-2's tokens, "
                      "--vocab-file and --merge-file (without them the tokens are bytes)\n");
      goto out;
    }
    ret = 1;
    if (!vocab || (p.bpe = open_tokenizer(vocab, merges)))
      ret = hellaswag(p.bpe, hswag, out);
    goto out;
  }
  if (!ninputs || !out || !*out) {
    fprintf(stderr, "distrain-prep: --input and --out are required\n%s", USAGE);
    goto out;
  }
  if (!vocab != !merges) {
    fprintf(stderr, "distrain-prep: GPT-2's tokenizer needs both --vocab-file and --merge-file\n");
    goto out;
  }
  if (doc_sep && !vocab) {
    fprintf(stderr, "distrain-prep: --doc-sep needs --vocab-file and --merge-file (byte-level "
                    "shards have no separator token)\n");
    goto out;
  }
  p.doc_sep = doc_sep;
  p.out = out;
  p.batch_bytes = (size_t)DT_MAX(dt_param_PrepBatchBytes(), 1);
  ret = 1;
  if (vocab) {
    if (!(p.bpe = open_tokenizer(vocab, merges)))
      goto out;
    p.eot = dt_bpe_token_id(p.bpe, "<|endoftext|>");
    if (p.eot < 0) {
      fprintf(stderr, "distrain-prep: %s: no <|endoftext|> token, which separates documents\n",
              vocab);
      goto out;
    }
    if (dt_bpe_vocab_size(p.bpe) > 65536) {
      fprintf(stderr, "distrain-prep: %s: ids up to %d do not fit llm.c shards' uint16 tokens\n",
              vocab, dt_bpe_vocab_size(p.bpe) - 1);
      goto out;
    }
    p.threads = threads;
    p.part_bytes = (size_t)DT_MAX(dt_param_PrepPartBytes(), 1);
    p.enc = calloc((size_t)p.threads, sizeof *p.enc);
    if (!p.enc)
      goto out;
    p.enc[0] = p.bpe;
    for (int i = 1; i < p.threads; i++)
      if (dt_bpe_clone(p.bpe, &p.enc[i]) != 0)
        goto out;
  }
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < ninputs; i++)
    if (add_input(&p, inputs[i]) != 0)
      goto out;
  if (p.bpe && flush(&p) != 0)
    goto out;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  if (p.bpe) {
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    const size_t ntok = p.spilled + p.n;
    printf("tokenized %zu document%s, %.1f MB, into %zu tokens (%.2f bytes a token) in %.3f s "
           "(%.1f MB/s, %d threads)\n",
           p.docs, p.docs == 1 ? "" : "s", (double)p.bytes / 1e6, ntok,
           ntok ? (double)p.bytes / (double)ntok : 0.0, s, s > 0 ? (double)p.bytes / 1e6 / s : 0.0,
           p.threads);
  }
  if (write_shards(&p, val_frac, shard_tokens) == 0)
    ret = 0;
out:
  for (size_t i = 0; i < p.nparts; i++) { /* left by an error */
    free(p.parts[i].ids);
    free(p.parts[i].own);
  }
  free(p.parts);
  for (int i = 1; p.enc && i < p.threads; i++)
    dt_bpe_destroy(p.enc[i]);
  free(p.enc);
  dt_bpe_destroy(p.bpe);
  free(p.tok);
  if (p.spill >= 0)
    close(p.spill);
  if (ret != 0 && p.made_out)
    rmdir(out); /* the spill's directory: nothing is left of a failed prep */
  free(inputs);
  return ret;
}
