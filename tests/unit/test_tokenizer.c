/* test_tokenizer.c — Check suite for worker/trainer/tokenizer: GPT-2's BPE on a hand-made
 * vocabulary whose every expected encoding is worked out by hand in the comments (merge order,
 * the split pattern's pieces, ids taken from the file rather than assumed), decoding, and a
 * clear error for each kind of bad vocab.json / merges.txt. tests/integration/test_tokenizer.py
 * checks whole texts against a reference implementation. */
#include <stdlib.h>
#include <string.h>

#include <check.h>

#include "dt_error.h"
#include "tokenizer.h"
#include "ut_fs.h"

static char dir[256], vocab_path[512], merges_path[512];

/* GPT-2's byte-to-character map, written out again here: printable Latin-1 bytes are
 * themselves, the rest U+0100... in byte order. Appends byte b's character to s (UTF-8). */
static void spell_byte(char *s, int b)
{
  int cp = b, extra = 0;
  const int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  if (!printable) {
    for (int c = 0; c < b; c++)
      extra += !((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE);
    cp = 256 + extra;
  }
  size_t n = strlen(s);
  if (cp < 0x80) {
    s[n++] = (char)cp;
  } else {
    s[n++] = (char)(0xC0 | cp >> 6);
    s[n++] = (char)(0x80 | (cp & 0x3F));
  }
  s[n] = '\0';
}

static void write_text(const char *path, const char *text)
{
  FILE *fp = fopen(path, "w");
  ck_assert_ptr_nonnull(fp);
  fputs(text, fp);
  fclose(fp);
}

/* The 256 byte tokens at ids 1000 + byte (so nothing may assume id = byte), then extra. */
static void write_vocab(const char *extra)
{
  static char json[16384];
  strcpy(json, "{");
  for (int b = 0; b < 256; b++) {
    char tok[8] = "";
    spell_byte(tok, b);
    const char *esc = strcmp(tok, "\"") == 0 ? "\\\"" : strcmp(tok, "\\") == 0 ? "\\\\" : tok;
    snprintf(json + strlen(json), sizeof json - strlen(json), "\"%s\": %d, ", esc, 1000 + b);
  }
  snprintf(json + strlen(json), sizeof json - strlen(json), "%s}", extra);
  write_text(vocab_path, json);
}

/* "Ġ" is the space byte's character (U+0120). */
#define VOCAB_EXTRA                                                                                \
  "\"ab\": 1, \"bc\": 2, \"abc\": 3, \"\\u0120t\": 7, \"\\u0120th\": 8, \"\\u0120the\": 4, "       \
  "\"<|endoftext|>\": 5, \"\\u0120\\u0120\": 6"
#define MERGES                                                                                     \
  "#version: 0.2\n"                                                                                \
  "b c\n"                                                                                          \
  "a b\n"                                                                                          \
  "a bc\n"                                                                                         \
  "\xC4\xA0 t\n"                                                                                   \
  "\xC4\xA0t h\n"                                                                                  \
  "\xC4\xA0th e\n"                                                                                 \
  "\xC4\xA0 \xC4\xA0\n"

static void setup(void)
{
  ut_mkdtemp(dir, sizeof dir);
  snprintf(vocab_path, sizeof vocab_path, "%s/vocab.json", dir);
  snprintf(merges_path, sizeof merges_path, "%s/merges.txt", dir);
  write_vocab(VOCAB_EXTRA);
  write_text(merges_path, MERGES);
}

static void teardown(void)
{
  ut_rm_rf(dir);
}

static dt_bpe_t *open_ok(void)
{
  char err[1024] = "";
  dt_bpe_t *b = NULL;
  ck_assert_msg(dt_bpe_create(&b, vocab_path, merges_path, err, sizeof err) == 0, "%s", err);
  return b;
}

/* Encodes text and compares with the expected ids (terminated by -1). */
static void expect(dt_bpe_t *b, const char *text, const int *want)
{
  int32_t *ids = NULL;
  size_t n = 0, cap = 0, bad = 0;
  ck_assert_int_eq(dt_bpe_encode(b, text, strlen(text), &ids, &n, &cap, &bad), 0);
  size_t k = 0;
  while (want[k] >= 0)
    k++;
  ck_assert_msg(n == k, "\"%s\": %zu tokens, expected %zu", text, n, k);
  for (size_t i = 0; i < n; i++)
    ck_assert_msg(ids[i] == want[i], "\"%s\": token %zu is %d, expected %d", text, i, ids[i],
                  want[i]);
  free(ids);
}

#define B(c) (1000 + (c)) /* a byte's token */

START_TEST(test_merge_order)
{
  dt_bpe_t *b = open_ok();
  /* "abc": b c (rank 0) before a b (rank 1), then a bc (rank 2): one token. */
  expect(b, "abc", (const int[]){3, -1});
  expect(b, "ab", (const int[]){1, -1});
  /* "abcab": a b c a b -> b c first: a bc a b -> a b (rank 1) at the end: a bc ab -> a bc:
   * abc ab. */
  expect(b, "abcab", (const int[]){3, 1, -1});
  /* "cab": c a has no merge; a b does. */
  expect(b, "cab", (const int[]){B('c'), 1, -1});
  dt_bpe_destroy(b);
}
END_TEST

START_TEST(test_split_pattern)
{
  dt_bpe_t *b = open_ok();
  /* " the the": two pieces " the", each Ġ t h e merged step by step into Ġthe. */
  expect(b, " the the", (const int[]){4, 4, -1});
  /* "a  b": "a", then whitespace not followed by a non-space (" ": the last space goes with
   * the word), then " b" (no Ġ b merge). At the end of the text both spaces are one piece,
   * which the Ġ Ġ merge makes one token. */
  expect(b, "a  b", (const int[]){B('a'), B(' '), B(' '), B('b'), -1});
  expect(b, "a  ", (const int[]){B('a'), 6, -1});
  /* "it's": "it", "'s"; "THE" has no merges (case matters). */
  expect(b, "it's THE",
         (const int[]){B('i'), B('t'), B('\''), B('s'), B(' '), B('T'), B('H'), B('E'), -1});
  /* a special token written in the text is plain text: "<|", "endoftext", "|>" */
  expect(b, "<|endoftext|>",
         (const int[]){B('<'), B('|'), B('e'), B('n'), B('d'), B('o'), B('f'), B('t'), B('e'),
                       B('x'), B('t'), B('|'), B('>'), -1});
  /* "é" (2 bytes) is one letter piece: its two byte tokens. */
  expect(b, "\xC3\xA9", (const int[]){B(0xC3), B(0xA9), -1});
  expect(b, "", (const int[]){-1});
  dt_bpe_destroy(b);
}
END_TEST

START_TEST(test_not_utf8)
{
  dt_bpe_t *b = open_ok();
  int32_t *ids = NULL;
  size_t n = 0, cap = 0, bad = 0;
  ck_assert_int_eq(dt_bpe_encode(b,
                                 "ab\xFF"
                                 "cd",
                                 5, &ids, &n, &cap, &bad),
                   DT_EINVAL);
  ck_assert_uint_eq(bad, 2);
  ck_assert_uint_eq(n, 0);
  /* a character cut at the end */
  ck_assert_int_eq(dt_bpe_encode(b, "abc\xC3", 4, &ids, &n, &cap, &bad), DT_EINVAL);
  ck_assert_uint_eq(bad, 3);
  free(ids);
  dt_bpe_destroy(b);
}
END_TEST

START_TEST(test_decode_and_ids)
{
  dt_bpe_t *b = open_ok();
  size_t len = 0;
  const uint8_t *p = dt_bpe_decode(b, 4, &len);
  ck_assert_ptr_nonnull(p);
  ck_assert_uint_eq(len, 4);
  ck_assert_int_eq(memcmp(p, " the", 4), 0);
  p = dt_bpe_decode(b, B(0x0A), &len);
  ck_assert(p && len == 1 && p[0] == '\n');
  ck_assert_ptr_null(dt_bpe_decode(b, 9, &len)); /* no id 9 in the file */
  ck_assert_ptr_null(dt_bpe_decode(b, 5000, &len));
  ck_assert_int_eq(dt_bpe_token_id(b, "<|endoftext|>"), 5);
  ck_assert_int_eq(dt_bpe_token_id(b, "\xC4\xA0the"), 4);
  ck_assert_int_eq(dt_bpe_token_id(b, "<|im_start|>"), -1);
  ck_assert_int_eq(dt_bpe_vocab_size(b), 1256);
  dt_bpe_destroy(b);
}
END_TEST

START_TEST(test_decode_only)
{
  char err[1024] = "";
  dt_bpe_t *b = NULL;
  write_vocab("\"ab\": 1"); /* merges.txt would not load now: "Ġt" is gone */
  ck_assert_int_eq(dt_bpe_create(&b, vocab_path, NULL, err, sizeof err), 0);
  int32_t *ids = NULL;
  size_t n = 0, cap = 0, bad = 0;
  ck_assert_int_eq(dt_bpe_encode(b, "ab", 2, &ids, &n, &cap, &bad), DT_EINVAL);
  size_t len;
  ck_assert_ptr_nonnull(dt_bpe_decode(b, 1, &len));
  dt_bpe_destroy(b);
}
END_TEST

/* dt_bpe_create fails with rc and an error containing want. */
static void expect_error(int rc, const char *want)
{
  char err[1024] = "";
  dt_bpe_t *b = NULL;
  ck_assert_int_eq(dt_bpe_create(&b, vocab_path, merges_path, err, sizeof err), rc);
  ck_assert_msg(strstr(err, want) != NULL, "error \"%s\" lacks \"%s\"", err, want);
}

START_TEST(test_bad_files)
{
  write_text(vocab_path, "{\"a\": 1,");
  expect_error(DT_EFORMAT, "vocab.json: not a JSON file");
  write_text(vocab_path, "[1, 2]");
  expect_error(DT_EFORMAT, "expected a JSON object");
  write_vocab(VOCAB_EXTRA ", \"xy\": -3");
  expect_error(DT_EFORMAT, "token \"xy\": expected an id");
  write_vocab(VOCAB_EXTRA ", \"a b\": 9"); /* a raw space is not in the map */
  expect_error(DT_EFORMAT, "token \"a b\" (id 9) is not spelled");
  write_vocab(VOCAB_EXTRA ", \"abcd\": 3");
  expect_error(DT_EFORMAT, "appear twice");
  write_vocab("\"ab\": 1"); /* no "bc" */
  expect_error(DT_EFORMAT, "merges.txt:2: merge \"b c\": the vocabulary lacks the token");
  write_vocab(VOCAB_EXTRA);
  write_text(merges_path, "#version: 0.2\nb c\nq z\n");
  expect_error(DT_EFORMAT, "merges.txt:3: merge \"q z\": the vocabulary lacks the token");
  write_text(merges_path, "b c\nbc x\n");
  expect_error(DT_EFORMAT, "merges.txt:2: merge \"bc x\": the vocabulary lacks the token");
  write_text(merges_path, "b c\nzz c\n");
  expect_error(DT_EFORMAT, "merges.txt:2: merge \"zz c\": its first token is not in");
  write_text(merges_path, "b c\nabc\n");
  expect_error(DT_EFORMAT, "merges.txt:2: expected two tokens separated by one space");
  unlink(merges_path);
  expect_error(DT_ENOENT, "merges.txt: No such file");
  /* encoding needs every byte */
  write_text(merges_path, MERGES);
  write_text(vocab_path, "{\"a\": 0, \"b\": 1, \"ab\": 2}");
  expect_error(DT_EFORMAT, "no token for the byte 0x00");
}
END_TEST

static Suite *tokenizer_suite(void)
{
  Suite *s = suite_create("tokenizer");
  TCase *t = tcase_create("bpe");
  tcase_add_checked_fixture(t, setup, teardown);
  tcase_add_test(t, test_merge_order);
  tcase_add_test(t, test_split_pattern);
  tcase_add_test(t, test_not_utf8);
  tcase_add_test(t, test_decode_and_ids);
  tcase_add_test(t, test_decode_only);
  tcase_add_test(t, test_bad_files);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(tokenizer_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
