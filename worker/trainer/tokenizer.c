/* tokenizer.c — GPT-2 byte-level BPE: vocab.json + merges.txt in, token ids out and back.
 *
 * Tables, all built once by dt_bpe_create:
 *   tokens      id -> its bytes (an arena; ids vocab.json lacks have none)
 *   by_bytes    bytes -> id, open addressing over ids (the merges' lookups, dt_bpe_token_id)
 *   pairs       (left id, right id) -> (merge rank, merged id), open addressing
 *   cache       piece bytes -> its ids, filled as pieces are encoded, emptied when it is big
 * Ranks are merges.txt's line order: the pair to merge in a piece is the adjacent one with
 * the lowest rank, the leftmost among equals (tiktoken's order; OpenAI's encoder.py merges
 * every occurrence of the lowest pair at once, which comes to the same: a merge made later
 * can only create pairs of higher rank). */
#define PCRE2_CODE_UNIT_WIDTH 8

#include "tokenizer.h"

#include <errno.h>
#include <json-c/json.h>
#include <pcre2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"

/* GPT-2's split pattern, with "\s" spelled out as Unicode's White_Space property, which is what
 * tiktoken's regex engine (and so llm.c's data scripts) take it to mean. */
#define WS                                                                                         \
  "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"      \
  "\\x{205F}\\x{3000}"
static const char gpt2_pattern[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS
                                   "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS "])|[" WS "]+";

#define NO_RANK         UINT32_MAX
#define CACHE_MAX_PIECE 256        /* longer pieces (rare: long runs of one class) are not cached */
#define CACHE_MAX_BYTES (64 << 20) /* keys and values together; the cache empties past it */

typedef struct {
  uint64_t hash;
  uint32_t koff, klen, voff, vlen;
} centry_t;

typedef struct {
  uint32_t *slot; /* entry + 1; 0 = empty */
  size_t mask;
  centry_t *e;
  size_t n, ecap;
  uint8_t *keys;
  size_t nkeys, kcap;
  int32_t *vals;
  size_t nvals, vcap;
} piece_cache_t;

struct dt_bpe {
  const dt_bpe_t *parent; /* a clone's: whose tables (everything up to md) it reads */
  int vocab;              /* max id + 1 */
  uint32_t *tok_off;      /* (vocab) offset of each id's bytes in tok_bytes */
  uint32_t *tok_len;      /* (vocab) 0 for an id vocab.json lacks */
  uint8_t *tok_bytes;     /* every token's bytes */
  int32_t *by_bytes;      /* id + 1; 0 = empty */
  size_t by_mask;
  int32_t byte_id[256]; /* the token of each single byte */
  uint64_t *pair_key;   /* left << 32 | right; UINT64_MAX = empty */
  uint64_t *pair_val;   /* rank << 32 | merged id */
  size_t pair_mask;
  pcre2_code *re; /* NULL for a tokenizer that only decodes */
  pcre2_match_data *md;
  piece_cache_t cache;
  int32_t *sym;  /* (scratch) a piece's symbols while it is merged; -1: merged into its prev */
  int32_t *next; /* (scratch) the symbols' list, -1 at its ends */
  int32_t *prev;
  uint64_t *heap; /* (scratch) merge candidates */
  size_t scratch; /* bytes of piece the scratch arrays hold */
};

/* ---------------------------------------------------------------------------------------- */
/* GPT-2's byte <-> character map: printable Latin-1 bytes stand for themselves, the other 68
 * bytes (controls, space, 0x7F-0xA0, 0xAD) for U+0100 onwards in byte order. */

static int16_t char_byte[324]; /* code point -> byte, -1 for none */
static pthread_once_t byte_map_once = PTHREAD_ONCE_INIT;

static void byte_map_init(void)
{
  int extra = 0;
  for (int c = 0; c < 324; c++)
    char_byte[c] = -1;
  for (int b = 0; b < 256; b++) {
    const int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    char_byte[printable ? b : 256 + extra++] = (int16_t)b;
  }
}

/* A token spelled with the map (UTF-8) -> its bytes in out (at most n bytes, the spelling's
 * length is always enough); the byte count, or -1 for a character outside the map. */
static int spelled_bytes(const char *s, size_t n, uint8_t *out)
{
  int len = 0;
  for (size_t i = 0; i < n;) {
    const int k = dt_utf8_next(s + i, n - i);
    if (k <= 0)
      return -1;
    int cp = (unsigned char)s[i];
    if (k > 1) {
      cp &= 0xFF >> (k + 1);
      for (int j = 1; j < k; j++)
        cp = cp << 6 | ((unsigned char)s[i + (size_t)j] & 0x3F);
    }
    if (cp >= 324 || char_byte[cp] < 0)
      return -1;
    out[len++] = (uint8_t)char_byte[cp];
    i += (size_t)k;
  }
  return len;
}

static uint64_t hash_bytes(const uint8_t *p, size_t n)
{
  const uint64_t h = dt_fnv1a(DT_FNV1A_INIT, p, n);
  return h ^ (h >> 31);
}

static size_t pow2_above(size_t n)
{
  size_t c = 16;
  while (c < 2 * n)
    c *= 2;
  return c;
}

/* ---------------------------------------------------------------------------------------- */
/* Lookups */

static int id_of_bytes(const dt_bpe_t *b, const uint8_t *p, size_t n)
{
  for (size_t i = hash_bytes(p, n) & b->by_mask;; i = (i + 1) & b->by_mask) {
    const int32_t v = b->by_bytes[i];
    if (v == 0)
      return -1;
    const int id = v - 1;
    if (b->tok_len[id] == n && memcmp(b->tok_bytes + b->tok_off[id], p, n) == 0)
      return id;
  }
}

static size_t pair_slot(const dt_bpe_t *b, uint64_t key)
{
  size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & b->pair_mask;
  while (b->pair_key[i] != UINT64_MAX && b->pair_key[i] != key)
    i = (i + 1) & b->pair_mask;
  return i;
}

/* The rank of merging (l, r), NO_RANK for none; its merged id in *m. */
static uint32_t pair_rank(const dt_bpe_t *b, int32_t l, int32_t r, int32_t *m)
{
  const size_t i = pair_slot(b, (uint64_t)(uint32_t)l << 32 | (uint32_t)r);
  if (b->pair_key[i] == UINT64_MAX)
    return NO_RANK;
  *m = (int32_t)(uint32_t)b->pair_val[i];
  return (uint32_t)(b->pair_val[i] >> 32);
}

/* ---------------------------------------------------------------------------------------- */
/* Loading */

static int load_vocab(dt_bpe_t *b, const char *path, char *err, size_t errlen)
{
  FILE *fp = fopen(path, "r");
  if (!fp) {
    snprintf(err, errlen, "%s: %s", path, strerror(errno));
    return DT_ENOENT;
  }
  fclose(fp);
  json_object *root = json_object_from_file(path);
  int ret = 0;
  if (!root) {
    const char *why = json_util_get_last_err();
    snprintf(err, errlen, "%s: not a JSON file: %s", path, why ? why : strerror(errno));
    return DT_EFORMAT;
  }
  if (!json_object_is_type(root, json_type_object) || json_object_object_length(root) == 0) {
    snprintf(err, errlen, "%s: expected a JSON object of tokens and their ids", path);
    ret = DT_EFORMAT;
    goto out;
  }
  size_t nbytes = 0;
  int64_t max_id = -1;
  json_object_object_foreach(root, key, val)
  {
    const int64_t id = json_object_is_type(val, json_type_int) ? json_object_get_int64(val) : -1;
    if (id < 0 || id >= (1 << 24)) {
      snprintf(err, errlen, "%s: token \"%s\": expected an id in [0, %d), got %s", path, key,
               1 << 24, json_object_to_json_string(val));
      ret = DT_EFORMAT;
      goto out;
    }
    max_id = id > max_id ? id : max_id;
    nbytes += strlen(key);
  }
  b->vocab = (int)max_id + 1;
  b->tok_off = calloc((size_t)b->vocab, sizeof *b->tok_off);
  b->tok_len = calloc((size_t)b->vocab, sizeof *b->tok_len);
  b->tok_bytes = malloc(nbytes ? nbytes : 1);
  b->by_mask = pow2_above((size_t)json_object_object_length(root)) - 1;
  b->by_bytes = calloc(b->by_mask + 1, sizeof *b->by_bytes);
  if (!b->tok_off || !b->tok_len || !b->tok_bytes || !b->by_bytes) {
    ret = DT_ENOMEM;
    goto out;
  }
  size_t off = 0;
  json_object_object_foreach(root, key2, val2)
  {
    const int id = (int)json_object_get_int64(val2);
    const int len = spelled_bytes(key2, strlen(key2), b->tok_bytes + off);
    if (len <= 0) {
      snprintf(err, errlen,
               "%s: token \"%s\" (id %d) is not spelled with GPT-2's byte-to-character map", path,
               key2, id);
      ret = DT_EFORMAT;
      goto out;
    }
    if (b->tok_len[id] != 0 || id_of_bytes(b, b->tok_bytes + off, (size_t)len) >= 0) {
      snprintf(err, errlen, "%s: token \"%s\" (id %d): its id or its bytes appear twice", path,
               key2, id);
      ret = DT_EFORMAT;
      goto out;
    }
    b->tok_off[id] = (uint32_t)off;
    b->tok_len[id] = (uint32_t)len;
    size_t i = hash_bytes(b->tok_bytes + off, (size_t)len) & b->by_mask;
    while (b->by_bytes[i] != 0)
      i = (i + 1) & b->by_mask;
    b->by_bytes[i] = id + 1;
    off += (size_t)len;
  }
  for (int c = 0; c < 256; c++) {
    const uint8_t byte = (uint8_t)c;
    b->byte_id[c] = id_of_bytes(b, &byte, 1);
  }
out:
  json_object_put(root);
  return ret;
}

static int load_merges(dt_bpe_t *b, const char *path, char *err, size_t errlen)
{
  FILE *fp = fopen(path, "r");
  if (!fp) {
    snprintf(err, errlen, "%s: %s", path, strerror(errno));
    return DT_ENOENT;
  }
  char *line = NULL;
  size_t lcap = 0, nlines = 0;
  ssize_t got;
  while ((got = getline(&line, &lcap, fp)) > 0)
    nlines++;
  b->pair_mask = pow2_above(nlines) - 1;
  b->pair_key = malloc((b->pair_mask + 1) * sizeof *b->pair_key);
  b->pair_val = malloc((b->pair_mask + 1) * sizeof *b->pair_val);
  uint8_t *tmp = malloc(lcap + 1);
  int ret = 0;
  if (!b->pair_key || !b->pair_val || !tmp) {
    ret = DT_ENOMEM;
    goto out;
  }
  memset(b->pair_key, 0xFF, (b->pair_mask + 1) * sizeof *b->pair_key);
  rewind(fp);
  uint32_t rank = 0;
  for (size_t lineno = 1; (got = getline(&line, &lcap, fp)) > 0; lineno++) {
    size_t len = (size_t)got;
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
      line[--len] = '\0';
    if (len == 0 || (lineno == 1 && strncmp(line, "#version", 8) == 0))
      continue;
    char *sp = strchr(line, ' ');
    if (!sp || sp == line || !sp[1] || strchr(sp + 1, ' ')) {
      snprintf(err, errlen, "%s:%zu: expected two tokens separated by one space, got \"%s\"", path,
               lineno, line);
      ret = DT_EFORMAT;
      goto out;
    }
    const int la = spelled_bytes(line, (size_t)(sp - line), tmp);
    const int lb = la > 0 ? spelled_bytes(sp + 1, len - (size_t)(sp + 1 - line), tmp + la) : -1;
    const int ia = la > 0 ? id_of_bytes(b, tmp, (size_t)la) : -1;
    const int ib = lb > 0 ? id_of_bytes(b, tmp + la, (size_t)lb) : -1;
    const int im = ia >= 0 && ib >= 0 ? id_of_bytes(b, tmp, (size_t)(la + lb)) : -1;
    if (im < 0) {
      *sp = '\0';
      snprintf(err, errlen, "%s:%zu: merge \"%s %s\": %s", path, lineno, line, sp + 1,
               ia < 0   ? "its first token is not in the vocabulary"
               : ib < 0 ? "its second token is not in the vocabulary"
                        : "the vocabulary lacks the token it makes");
      ret = DT_EFORMAT;
      goto out;
    }
    const uint64_t key = (uint64_t)(uint32_t)ia << 32 | (uint32_t)ib;
    const size_t i = pair_slot(b, key);
    if (b->pair_key[i] == UINT64_MAX) { /* a repeated merge keeps its first rank */
      b->pair_key[i] = key;
      b->pair_val[i] = (uint64_t)rank << 32 | (uint32_t)im;
    }
    rank++;
  }
  if (ferror(fp)) {
    snprintf(err, errlen, "%s: read failed", path);
    ret = DT_EIO;
  }
out:
  free(tmp);
  free(line);
  fclose(fp);
  return ret;
}

static int compile_pattern(dt_bpe_t *b, char *err, size_t errlen)
{
  int code;
  PCRE2_SIZE at;
  /* anchored here, not per match: a match-time PCRE2_ANCHORED would bypass the JIT */
  b->re = pcre2_compile((PCRE2_SPTR)gpt2_pattern, PCRE2_ZERO_TERMINATED,
                        PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &code, &at, NULL);
  if (!b->re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(code, msg, sizeof msg);
    snprintf(err, errlen, "GPT-2's split pattern does not compile at %zu: %s", (size_t)at,
             (const char *)msg);
    return DT_EINTERNAL;
  }
  (void)pcre2_jit_compile(b->re, PCRE2_JIT_COMPLETE); /* without JIT: the same matches, slower */
  b->md = pcre2_match_data_create_from_pattern(b->re, NULL);
  return b->md ? 0 : DT_ENOMEM;
}

int dt_bpe_create(dt_bpe_t **out, const char *vocab_path, const char *merges_path, char *err,
                  size_t errlen)
{
  pthread_once(&byte_map_once, byte_map_init);
  dt_bpe_t *b = calloc(1, sizeof *b);
  int ret = b ? load_vocab(b, vocab_path, err, errlen) : DT_ENOMEM;
  if (ret == 0 && merges_path) {
    for (int c = 0; c < 256 && ret == 0; c++)
      if (b->byte_id[c] < 0) {
        snprintf(err, errlen, "%s: no token for the byte 0x%02X: encoding needs all 256",
                 vocab_path, c);
        ret = DT_EFORMAT;
      }
    if (ret == 0)
      ret = load_merges(b, merges_path, err, errlen);
    if (ret == 0)
      ret = compile_pattern(b, err, errlen);
  }
  if (ret == DT_ENOMEM)
    snprintf(err, errlen, "%s: out of memory reading the tokenizer", vocab_path);
  if (ret != 0) {
    dt_bpe_destroy(b);
    return ret;
  }
  *out = b;
  return 0;
}

static void cache_free(piece_cache_t *c)
{
  free(c->slot);
  free(c->e);
  free(c->keys);
  free(c->vals);
  memset(c, 0, sizeof *c);
}

int dt_bpe_clone(const dt_bpe_t *b, dt_bpe_t **out)
{
  dt_bpe_t *c = malloc(sizeof *c);
  if (!c)
    return DT_ENOMEM;
  *c = *b; /* the tables' pointers */
  c->parent = b;
  memset(&c->cache, 0, sizeof c->cache);
  c->sym = c->next = c->prev = NULL;
  c->heap = NULL;
  c->scratch = 0;
  c->md = b->re ? pcre2_match_data_create_from_pattern(b->re, NULL) : NULL;
  if (b->re && !c->md) {
    free(c);
    return DT_ENOMEM;
  }
  *out = c;
  return 0;
}

void dt_bpe_destroy(dt_bpe_t *b)
{
  if (!b)
    return;
  cache_free(&b->cache);
  pcre2_match_data_free(b->md);
  free(b->sym);
  free(b->next);
  free(b->prev);
  free(b->heap);
  if (!b->parent) {
    pcre2_code_free(b->re);
    free(b->pair_key);
    free(b->pair_val);
    free(b->by_bytes);
    free(b->tok_bytes);
    free(b->tok_len);
    free(b->tok_off);
  }
  free(b);
}

int dt_bpe_vocab_size(const dt_bpe_t *b)
{
  return b->vocab;
}

int dt_bpe_token_id(const dt_bpe_t *b, const char *token)
{
  const size_t n = strlen(token);
  uint8_t *tmp = malloc(n + 1);
  const int len = tmp ? spelled_bytes(token, n, tmp) : -1;
  const int id = len > 0 ? id_of_bytes(b, tmp, (size_t)len) : -1;
  free(tmp);
  return id;
}

const uint8_t *dt_bpe_decode(const dt_bpe_t *b, int id, size_t *len)
{
  if (id < 0 || id >= b->vocab || b->tok_len[id] == 0)
    return NULL;
  *len = b->tok_len[id];
  return b->tok_bytes + b->tok_off[id];
}

/* ---------------------------------------------------------------------------------------- */
/* Encoding */

/* A binary min-heap of merge candidates, rank << 32 | position: the lowest rank first, the
 * leftmost among equals. */
static void heap_push(uint64_t *h, size_t *n, uint64_t v)
{
  size_t i = (*n)++;
  for (; i > 0 && h[(i - 1) / 2] > v; i = (i - 1) / 2)
    h[i] = h[(i - 1) / 2];
  h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n)
{
  const uint64_t top = h[0], last = h[--*n];
  size_t i = 0;
  for (size_t c; (c = 2 * i + 1) < *n; i = c) {
    if (c + 1 < *n && h[c + 1] < h[c])
      c++;
    if (h[c] >= last)
      break;
    h[i] = h[c];
  }
  h[i] = last;
  return top;
}

static void push_pair(const dt_bpe_t *b, uint64_t *heap, size_t *nh, int32_t l, int32_t r,
                      size_t pos)
{
  int32_t m = 0;
  const uint32_t rank = pair_rank(b, l, r, &m);
  if (rank != NO_RANK)
    heap_push(heap, nh, (uint64_t)rank << 32 | pos);
}

/* Merges piece p (n >= 1 bytes) into b->sym[0, *m_out). The symbols form a linked list (a
 * merge joins a symbol with its next, which dies: sym -1); candidate pairs wait in a heap and
 * are checked when they come out (a pair whose symbols changed since has another rank, ranks
 * being unique), so a piece costs O(n log n) however long its runs of merges. */
static int merge_piece(dt_bpe_t *b, const uint8_t *p, size_t n, size_t *m_out)
{
  if (n > UINT32_MAX)
    return DT_ERANGE;
  if (n > b->scratch) {
    int32_t *sym = realloc(b->sym, n * sizeof *sym);
    if (sym)
      b->sym = sym;
    int32_t *next = realloc(b->next, n * sizeof *next);
    if (next)
      b->next = next;
    int32_t *prev = realloc(b->prev, n * sizeof *prev);
    if (prev)
      b->prev = prev;
    uint64_t *heap = realloc(b->heap, 3 * n * sizeof *heap); /* n - 1, then 2 a merge */
    if (heap)
      b->heap = heap;
    if (!sym || !next || !prev || !heap)
      return DT_ENOMEM;
    b->scratch = n;
  }
  int32_t *sym = b->sym, *next = b->next, *prev = b->prev;
  uint64_t *heap = b->heap;
  size_t nh = 0;
  for (size_t i = 0; i < n; i++) {
    sym[i] = b->byte_id[p[i]];
    next[i] = i + 1 < n ? (int32_t)(i + 1) : -1;
    prev[i] = (int32_t)i - 1;
  }
  for (size_t i = 0; i + 1 < n; i++)
    push_pair(b, heap, &nh, sym[i], sym[i + 1], i);
  while (nh > 0) {
    const uint64_t top = heap_pop(heap, &nh);
    const int32_t i = (int32_t)(uint32_t)top, j = sym[i] >= 0 ? next[i] : -1;
    int32_t m = 0;
    if (j < 0 || pair_rank(b, sym[i], sym[j], &m) != (uint32_t)(top >> 32))
      continue; /* stale: a symbol of the pair was merged since */
    sym[i] = m;
    sym[j] = -1;
    next[i] = next[j];
    if (next[j] >= 0)
      prev[next[j]] = i;
    if (prev[i] >= 0)
      push_pair(b, heap, &nh, sym[prev[i]], sym[i], (size_t)prev[i]);
    if (next[i] >= 0)
      push_pair(b, heap, &nh, sym[i], sym[next[i]], (size_t)i);
  }
  size_t m = 0;
  for (int32_t i = 0; i >= 0; i = next[i])
    sym[m++] = sym[i]; /* m <= i: in place */
  *m_out = m;
  return 0;
}

static int cache_rehash(piece_cache_t *c, size_t slots)
{
  uint32_t *slot = calloc(slots, sizeof *slot);
  if (!slot)
    return DT_ENOMEM;
  free(c->slot);
  c->slot = slot;
  c->mask = slots - 1;
  for (size_t k = 0; k < c->n; k++) {
    size_t i = c->e[k].hash & c->mask;
    while (slot[i] != 0)
      i = (i + 1) & c->mask;
    slot[i] = (uint32_t)k + 1;
  }
  return 0;
}

/* Adds a piece's ids to the cache; the cache forgets everything first when it is full. */
static int cache_put(piece_cache_t *c, uint64_t h, const uint8_t *p, size_t n, const int32_t *ids,
                     size_t m)
{
  if (c->nkeys + c->nvals * sizeof(int32_t) > CACHE_MAX_BYTES) {
    c->n = c->nkeys = c->nvals = 0;
    memset(c->slot, 0, (c->mask + 1) * sizeof *c->slot);
  }
  DT_CHECK(dt_grow((void **)&c->e, &c->ecap, c->n + 1, sizeof *c->e));
  DT_CHECK(dt_grow((void **)&c->keys, &c->kcap, c->nkeys + n, 1));
  DT_CHECK(dt_grow((void **)&c->vals, &c->vcap, c->nvals + m, sizeof *c->vals));
  if (2 * (c->n + 1) > (c->slot ? c->mask + 1 : 0))
    DT_CHECK(cache_rehash(c, pow2_above(c->n + 1) * 2));
  centry_t *e = &c->e[c->n];
  *e = (centry_t){h, (uint32_t)c->nkeys, (uint32_t)n, (uint32_t)c->nvals, (uint32_t)m};
  memcpy(c->keys + c->nkeys, p, n);
  memcpy(c->vals + c->nvals, ids, m * sizeof *ids);
  c->nkeys += n;
  c->nvals += m;
  size_t i = h & c->mask;
  while (c->slot[i] != 0)
    i = (i + 1) & c->mask;
  c->slot[i] = (uint32_t)++c->n;
  return 0;
}

static const centry_t *cache_get(const piece_cache_t *c, uint64_t h, const uint8_t *p, size_t n)
{
  if (!c->slot)
    return NULL;
  for (size_t i = h & c->mask; c->slot[i] != 0; i = (i + 1) & c->mask) {
    const centry_t *e = &c->e[c->slot[i] - 1];
    if (e->hash == h && e->klen == n && memcmp(c->keys + e->koff, p, n) == 0)
      return e;
  }
  return NULL;
}

static int append(int32_t **ids, size_t *n, size_t *cap, const int32_t *v, size_t m)
{
  DT_CHECK(dt_grow((void **)ids, cap, *n + m, sizeof **ids));
  memcpy(*ids + *n, v, m * sizeof *v);
  *n += m;
  return 0;
}

static int encode_piece(dt_bpe_t *b, const uint8_t *p, size_t n, int32_t **ids, size_t *nids,
                        size_t *cap)
{
  if (n == 1)
    return append(ids, nids, cap, &b->byte_id[p[0]], 1);
  const int cacheable = n <= CACHE_MAX_PIECE;
  const uint64_t h = cacheable ? hash_bytes(p, n) : 0;
  const centry_t *e = cacheable ? cache_get(&b->cache, h, p, n) : NULL;
  if (e)
    return append(ids, nids, cap, b->cache.vals + e->voff, e->vlen);
  size_t m = 0;
  DT_CHECK(merge_piece(b, p, n, &m));
  if (cacheable)
    DT_CHECK(cache_put(&b->cache, h, p, n, b->sym, m));
  return append(ids, nids, cap, b->sym, m);
}

/* Why such a cut is safe: the piece before it is the line break alone (the whitespace run is
 * that one character; alone at the end of a text it matches "\s+(?!\S)", before the letter
 * "\s+", the same piece), and no piece of the pattern goes on from a line break into a
 * printable character, or from a printable character back over a line break. */
size_t dt_bpe_next_cut(const char *text, size_t len, size_t from)
{
  const unsigned char *t = (const unsigned char *)text;
  for (size_t p = from > 2 ? from : 2; p < len; p++) {
    const unsigned char *nl = memchr(t + p - 1, '\n', len - (p - 1));
    if (!nl)
      break;
    p = (size_t)(nl - t) + 1; /* just after the line break */
    if (p < len && t[p - 2] > ' ' && t[p - 2] < 0x7F && t[p] > ' ' && t[p] < 0x7F)
      return p;
  }
  return len;
}

int dt_bpe_encode(dt_bpe_t *b, const char *text, size_t len, int32_t **ids, size_t *n, size_t *cap,
                  size_t *bad)
{
  if (!b->re)
    return DT_EINVAL;
  const size_t n0 = *n;
  uint32_t check = 0; /* the first match checks that the whole text is UTF-8 */
  for (size_t off = 0; off < len;) {
    const int rc =
        pcre2_match(b->re, (PCRE2_SPTR)text, len, off, PCRE2_ANCHORED | check, b->md, NULL);
    if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21) {
      *bad = pcre2_get_startchar(b->md);
      *n = n0;
      return DT_EINVAL;
    }
    if (rc < 0) { /* the pattern matches any character; nothing else can fail */
      *n = n0;
      return rc == PCRE2_ERROR_NOMEMORY ? DT_ENOMEM : DT_EINTERNAL;
    }
    check = PCRE2_NO_UTF_CHECK;
    const size_t end = pcre2_get_ovector_pointer(b->md)[1];
    const int ret = encode_piece(b, (const uint8_t *)text + off, end - off, ids, n, cap);
    if (ret != 0) {
      *n = n0;
      return ret;
    }
    off = end;
  }
  return 0;
}
