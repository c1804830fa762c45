/* fuzz_tokenizer.c — any bytes as text for GPT-2's BPE tokenizer (tokenizer.h), with a small
 * vocabulary written at start-up (every byte, and merges of English pairs, of a UTF-8 letter's
 * bytes and of spaces). Properties:
 *   - the text is refused exactly when it is not UTF-8, at its first bad byte;
 *   - decoding the ids gives back the text, byte for byte;
 *   - the text encoded in parts cut where dt_bpe_next_cut says gives the same ids as whole
 *     (what distrain-prep's threads rely on), and so does encoding it again (the piece cache). */
#include <string.h>

#include "dt_error.h"
#include "dt_util.h"
#include "fuzz.h"
#include "tokenizer.h"

static dt_bpe_t *g_bpe;

/* byte -> GPT-2's character for it (UTF-8), as tokenizer.c maps it */
static void spell(char *out, int b)
{
  int extra = 0;
  for (int c = 0; c < b; c++)
    extra += !((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE);
  const int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  const int cp = printable ? b : 256 + extra;
  if (cp == '"' || cp == '\\')
    sprintf(out, "\\%c", cp);
  else if (cp < 0x80)
    sprintf(out, "%c", cp);
  else
    sprintf(out, "%c%c", 0xC0 | cp >> 6, 0x80 | (cp & 0x3F));
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
  (void)argc, (void)argv;
  const char *dir = fuzz_setup();
  static char vocab[16384], json[20000], vpath[600], mpath[600];
  /* merges: pairs of byte strings, each made of tokens already in the vocabulary */
  static const char *const merges[][2] = {
      {"t", "h"},   {"h", "e"},  {"th", "e"},  {" ", "t"},           {" t", "he"},
      {"i", "n"},   {" ", "a"},  {"e", "r"},   {"\xC3", "\xA9"},     {" ", " "},
      {"  ", "  "}, {"'", "s"},  {"\n", "\n"}, {"1", "2"},           {"12", "3"},
      {"a", "n"},   {"an", "d"}, {" ", "and"}, {"\xE2\x80", "\x94"}, {"\xE2", "\x80"}};
  int id = 0;
  char tok[64];
  vocab[0] = '\0';
  for (int b = 0; b < 256; b++) {
    spell(tok, b);
    snprintf(vocab + strlen(vocab), sizeof vocab - strlen(vocab), "\"%s\": %d, ", tok, id++);
  }
  char mtext[4096] = "#version: 0.2\n";
  for (size_t m = 0; m < sizeof merges / sizeof *merges; m++) {
    char a[32] = "", bb[32] = "", both[64] = "";
    for (const char *p = merges[m][0]; *p; p++)
      spell(a + strlen(a), (unsigned char)*p);
    for (const char *p = merges[m][1]; *p; p++)
      spell(bb + strlen(bb), (unsigned char)*p);
    snprintf(both, sizeof both, "%s%s", a, bb);
    snprintf(vocab + strlen(vocab), sizeof vocab - strlen(vocab), "\"%s\": %d, ", both, id++);
    snprintf(mtext + strlen(mtext), sizeof mtext - strlen(mtext), "%s %s\n", a, bb);
  }
  snprintf(json, sizeof json, "{%s\"<|endoftext|>\": %d}", vocab, id);
  snprintf(vpath, sizeof vpath, "%s/vocab.json", dir);
  snprintf(mpath, sizeof mpath, "%s/merges.txt", dir);
  fuzz_write(vpath, json, strlen(json));
  fuzz_write(mpath, mtext, strlen(mtext));
  char err[1024];
  if (dt_bpe_create(&g_bpe, vpath, mpath, err, sizeof err) != 0) {
    fprintf(stderr, "fuzz_tokenizer: %s\n", err);
    abort();
  }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  const char *text = (const char *)data;
  int32_t *ids = NULL, *parts = NULL;
  size_t n = 0, cap = 0, np = 0, pcap = 0, bad = 0;
  const int rc = dt_bpe_encode(g_bpe, text, size, &ids, &n, &cap, &bad);
  const int valid = dt_utf8_valid(text, size);
  FUZZ_ASSERT(valid ? rc == 0 : rc == DT_EINVAL, "rc %d for %s text", rc,
              valid ? "UTF-8" : "non-UTF-8");
  if (rc != 0) {
    FUZZ_ASSERT(bad < size && n == 0, "bad byte %zu of %zu, %zu ids", bad, size, n);
    FUZZ_ASSERT(dt_utf8_valid(text, bad), "the text before byte %zu is not UTF-8", bad);
    FUZZ_ASSERT(dt_utf8_next(text + bad, size - bad) <= 0, "byte %zu starts a character", bad);
    free(ids);
    return 0;
  }
  /* decode: the text back */
  size_t off = 0;
  for (size_t i = 0; i < n; i++) {
    size_t len = 0;
    const uint8_t *b = dt_bpe_decode(g_bpe, ids[i], &len);
    FUZZ_ASSERT(b && off + len <= size && memcmp(data + off, b, len) == 0,
                "token %zu (id %d) is not the text's bytes at %zu", i, ids[i], off);
    off += len;
  }
  FUZZ_ASSERT(off == size, "the ids decode to %zu of %zu bytes", off, size);
  /* in parts: every cut, and the parts encoded one after another */
  for (size_t from = 0, cut; from < size; from = cut) {
    cut = dt_bpe_next_cut(text, size, from + 1);
    FUZZ_ASSERT(cut > from && cut <= size, "cut %zu after %zu", cut, from);
    FUZZ_ASSERT(dt_bpe_encode(g_bpe, text + from, cut - from, &parts, &np, &pcap, &bad) == 0,
                "part [%zu, %zu) refused", from, cut);
  }
  FUZZ_ASSERT(np == n && (n == 0 || memcmp(parts, ids, n * sizeof *ids) == 0),
              "%zu ids in parts, %zu whole", np, n);
  np = 0;
  FUZZ_ASSERT(dt_bpe_encode(g_bpe, text, size, &parts, &np, &pcap, &bad) == 0 && np == n &&
                  (n == 0 || memcmp(parts, ids, n * sizeof *ids) == 0),
              "a second encoding differs");
  free(parts);
  free(ids);
  return 0;
}
