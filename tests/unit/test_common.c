/* test_common.c — Check suite for common/: the error table, DT_PARAM, strict number parsing,
 * CRC-32C, durable atomic files, mkdir -p, the RNG, the CUDA version messages and the log
 * chunks GetLogs serves. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <check.h>

#include "cuda_version.h"
#include "dt_error.h"
#include "dt_param.h"
#include "dt_util.h"
#include "listener.h"
#include "logs.h"
#include "rng.h"
#include "ut_fs.h"

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* Every entry of the X-macro table must round-trip through both string functions. */
START_TEST(test_strerror_every_code)
{
  int count = 0;
#define CHECK_ONE(name, val, msg)                                                                  \
  ck_assert_int_eq(DT_##name, (val));                                                              \
  ck_assert_int_lt(DT_##name, 0);                                                                  \
  ck_assert_str_eq(dt_strerror(DT_##name), (msg));                                                 \
  ck_assert_str_eq(dt_err_name(DT_##name), "DT_" #name);                                           \
  count++;
  DT_ERRNO_MAP(CHECK_ONE)
#undef CHECK_ONE
  ck_assert_int_eq(count, 25);
  ck_assert_str_eq(dt_strerror(0), "success");
  ck_assert_str_eq(dt_err_name(0), "OK");
}
END_TEST

/* Codes must be distinct, or two errors would print the same name. */
START_TEST(test_error_codes_distinct)
{
  static const int codes[] = {
#define CODE(name, val, msg) DT_##name,
      DT_ERRNO_MAP(CODE)
#undef CODE
  };
  const size_t n = sizeof codes / sizeof codes[0];
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n; j++)
      ck_assert_int_ne(codes[i], codes[j]);
}
END_TEST

START_TEST(test_strerror_unknown)
{
  const int unknown[] = {-26, -999, 1, 5, -2147483647}; /* -26: just past the table */
  for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
    ck_assert_str_eq(dt_strerror(unknown[i]), "unknown error");
    ck_assert_str_eq(dt_err_name(unknown[i]), "DT_UNKNOWN");
  }
}
END_TEST

/* Comma-separated integer lists, as --gpus and --ignore-xids take them. */
START_TEST(test_parse_int_list)
{
  int v[3], n;
  ck_assert_int_eq(dt_parse_int_list("3", 0, 7, v, 3, &n), 0);
  ck_assert(n == 1 && v[0] == 3);
  ck_assert_int_eq(dt_parse_int_list("0,7,2", 0, 7, v, 3, &n), 0);
  ck_assert(n == 3 && v[0] == 0 && v[1] == 7 && v[2] == 2);
  const char *bad[] = {"",   ",", "1,",  ",1",  "1,,2",    "8",
                       "-1", "x", "1,x", "1;2", "0,1,2,3", "99999999999999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
    ck_assert_msg(dt_parse_int_list(bad[i], 0, 7, v, 3, &n) == DT_EINVAL, "'%s'", bad[i]);
}
END_TEST

START_TEST(test_err_from_errno)
{
  ck_assert_int_eq(dt_err_from_errno(0), 0);
  ck_assert_int_eq(dt_err_from_errno(ENOENT), DT_ENOENT);
  ck_assert_int_eq(dt_err_from_errno(ENOTDIR), DT_ENOENT);
  ck_assert_int_eq(dt_err_from_errno(EACCES), DT_EACCES);
  ck_assert_int_eq(dt_err_from_errno(EPERM), DT_EACCES);
  ck_assert_int_eq(dt_err_from_errno(EROFS), DT_EACCES);
  ck_assert_int_eq(dt_err_from_errno(ENOMEM), DT_ENOMEM);
  ck_assert_int_eq(dt_err_from_errno(EEXIST), DT_EEXIST);
  ck_assert_int_eq(dt_err_from_errno(EINVAL), DT_EINVAL);
  ck_assert_int_eq(dt_err_from_errno(ETIMEDOUT), DT_ETIMEDOUT);
  ck_assert_int_eq(dt_err_from_errno(ERANGE), DT_ERANGE);
  ck_assert_int_eq(dt_err_from_errno(ECANCELED), DT_ECANCELED);
  ck_assert_int_eq(dt_err_from_errno(EIO), DT_EIO);
  ck_assert_int_eq(dt_err_from_errno(ENOSPC), DT_ENOSPC); /* a save may be skipped for it */
  ck_assert_int_eq(dt_err_from_errno(EDQUOT), DT_ENOSPC);
  /* Anything else is a generic system failure, never success or a positive value. */
  ck_assert_int_eq(dt_err_from_errno(EBADF), DT_ESYS);
  ck_assert_int_eq(dt_err_from_errno(EPIPE), DT_ESYS);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* DT_PARAM                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* Each parameter caches its first read, so every case gets its own parameter. */
DT_PARAM(UtValid, "UT_PARAM_VALID", 7)
DT_PARAM(UtNegative, "UT_PARAM_NEGATIVE", 7)
DT_PARAM(UtUnset, "UT_PARAM_UNSET", 11)
DT_PARAM(UtEmpty, "UT_PARAM_EMPTY", 12)
DT_PARAM(UtTrailing, "UT_PARAM_TRAILING", 13)
DT_PARAM(UtFloat, "UT_PARAM_FLOAT", 14)
DT_PARAM(UtOverflow, "UT_PARAM_OVERFLOW", 15)
DT_PARAM(UtCached, "UT_PARAM_CACHED", 16)
DT_PARAM(UtBig, "UT_PARAM_BIG", 0)

START_TEST(test_param_valid)
{
  setenv("DISTRAIN_UT_PARAM_VALID", "4096", 1);
  ck_assert_int_eq(dt_param_UtValid(), 4096);
  setenv("DISTRAIN_UT_PARAM_NEGATIVE", "-3", 1);
  ck_assert_int_eq(dt_param_UtNegative(), -3);
  setenv("DISTRAIN_UT_PARAM_BIG", "9000000000", 1); /* needs 64 bits */
  ck_assert_int_eq(dt_param_UtBig(), 9000000000ll);
}
END_TEST

START_TEST(test_param_unset_and_empty)
{
  unsetenv("DISTRAIN_UT_PARAM_UNSET");
  ck_assert_int_eq(dt_param_UtUnset(), 11);
  setenv("DISTRAIN_UT_PARAM_EMPTY", "", 1);
  ck_assert_int_eq(dt_param_UtEmpty(), 12);
}
END_TEST

START_TEST(test_param_malformed_uses_default)
{
  setenv("DISTRAIN_UT_PARAM_TRAILING", "12abc", 1);
  ck_assert_int_eq(dt_param_UtTrailing(), 13);
  setenv("DISTRAIN_UT_PARAM_FLOAT", "1.5", 1);
  ck_assert_int_eq(dt_param_UtFloat(), 14);
  setenv("DISTRAIN_UT_PARAM_OVERFLOW", "99999999999999999999", 1);
  ck_assert_int_eq(dt_param_UtOverflow(), 15);
}
END_TEST

/* dt_env_switch: 0 and 1 set it, unset and empty leave it, anything else is refused. */
START_TEST(test_env_switch)
{
  int on = 7;
  unsetenv("DISTRAIN_UT_SWITCH");
  ck_assert_int_eq(dt_env_switch("DISTRAIN_UT_SWITCH", &on), 0);
  ck_assert_int_eq(on, 7);
  setenv("DISTRAIN_UT_SWITCH", "", 1);
  ck_assert_int_eq(dt_env_switch("DISTRAIN_UT_SWITCH", &on), 0);
  ck_assert_int_eq(on, 7);
  setenv("DISTRAIN_UT_SWITCH", "0", 1);
  ck_assert_int_eq(dt_env_switch("DISTRAIN_UT_SWITCH", &on), 0);
  ck_assert_int_eq(on, 0);
  setenv("DISTRAIN_UT_SWITCH", "1", 1);
  ck_assert_int_eq(dt_env_switch("DISTRAIN_UT_SWITCH", &on), 0);
  ck_assert_int_eq(on, 1);
  const char *bad[] = {"yes", "true", "2", "01", " 1", "1 "};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("DISTRAIN_UT_SWITCH", bad[i], 1);
    on = 5;
    ck_assert_int_eq(dt_env_switch("DISTRAIN_UT_SWITCH", &on), DT_EINVAL);
    ck_assert_int_eq(on, 5);
  }
  unsetenv("DISTRAIN_UT_SWITCH");
}
END_TEST

START_TEST(test_param_read_once)
{
  setenv("DISTRAIN_UT_PARAM_CACHED", "1", 1);
  ck_assert_int_eq(dt_param_UtCached(), 1);
  setenv("DISTRAIN_UT_PARAM_CACHED", "2", 1);
  ck_assert_int_eq(dt_param_UtCached(), 1);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Number parsing                                                                              */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_parse_i64)
{
  int64_t v = 0;
  ck_assert_int_eq(dt_parse_i64("42", &v), 0);
  ck_assert_int_eq(v, 42);
  ck_assert_int_eq(dt_parse_i64("-7", &v), 0);
  ck_assert_int_eq(v, -7);
  ck_assert_int_eq(dt_parse_i64("0", &v), 0);
  ck_assert_int_eq(v, 0);
  ck_assert_int_eq(dt_parse_i64("9223372036854775807", &v), 0);
  ck_assert_int_eq(v, INT64_MAX);
  ck_assert_int_eq(dt_parse_i64("-9223372036854775808", &v), 0);
  ck_assert_int_eq(v, INT64_MIN);

  /* Rejected, and the output left alone. */
  const char *bad[] = {"",
                       "abc",
                       "12abc",
                       "1.5",
                       "0x10",
                       "12 ",
                       " 12",
                       "\t3",
                       "1e3",
                       "-",
                       "+",
                       "--1",
                       "9223372036854775808",
                       "-9223372036854775809",
                       "nan"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    v = 12345;
    ck_assert_msg(dt_parse_i64(bad[i], &v) == DT_EINVAL, "'%s' was accepted", bad[i]);
    ck_assert_int_eq(v, 12345);
  }
  ck_assert_int_eq(dt_parse_i64(NULL, &v), DT_EINVAL);
}
END_TEST

START_TEST(test_parse_step_range)
{
  int first = 0, count = 0;
  ck_assert_int_eq(dt_parse_step_range("5", &first, &count), 0);
  ck_assert_int_eq(first, 5);
  ck_assert_int_eq(count, 1);
  ck_assert_int_eq(dt_parse_step_range("3:4", &first, &count), 0);
  ck_assert_int_eq(first, 3);
  ck_assert_int_eq(count, 4);
  ck_assert_int_eq(dt_parse_step_range("2147483647", &first, &count), 0); /* last step INT_MAX */
  ck_assert_int_eq(dt_parse_step_range("2147483640:8", &first, &count), 0);
  ck_assert_int_eq(count, 8);

  /* Rejected, and the outputs left alone. */
  const char *bad[] = {"",      "0",    "-1",   "x",   "3:",         ":3",           "3:0", "3:-1",
                       "3:1:1", "3 :1", "3: 1", "1.5", "2147483648", "2147483640:9", "3:x"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    first = count = 77;
    ck_assert_msg(dt_parse_step_range(bad[i], &first, &count) == DT_EINVAL, "'%s' was accepted",
                  bad[i]);
    ck_assert_int_eq(first, 77);
    ck_assert_int_eq(count, 77);
  }
  ck_assert_int_eq(dt_parse_step_range(NULL, &first, &count), DT_EINVAL);
}
END_TEST

/* The agent's --skip-steps list: runs of steps as S:N, whole however long (a 2048-byte buffer
 * once cut the list, and its last step number, short). */
START_TEST(test_join_steps)
{
  char *s = dt_join_steps(NULL, 0);
  ck_assert_str_eq(s, "");
  free(s);
  const int64_t few[] = {3, 57, 58, 59, 61, 62, 100};
  s = dt_join_steps(few, 7);
  ck_assert_str_eq(s, "3,57:3,61:2,100");
  free(s);
  int64_t many[300];
  for (int i = 0; i < 300; i++)
    many[i] = 1000000000000 + 2 * i; /* no run */
  s = dt_join_steps(many, 300);
  ck_assert_uint_eq(strlen(s), 300 * 14 - 1);
  ck_assert_str_eq(s + strlen(s) - 13, "1000000000598");
  free(s);
  for (int i = 0; i < 300; i++)
    many[i] = 7 + i; /* one run */
  s = dt_join_steps(many, 300);
  ck_assert_str_eq(s, "7:300");
  free(s);
  ck_assert_uint_eq(dt_run_length(few + 1, 6), 3);
  ck_assert_uint_eq(dt_run_length(few, 7), 1);
  ck_assert_uint_eq(dt_run_length(few, 0), 0);
  char text[64];
  dt_steps_text(text, sizeof text, 70, 3);
  ck_assert_str_eq(text, "steps 70-72");
  dt_steps_text(text, sizeof text, 70, 1);
  ck_assert_str_eq(text, "step 70");
}
END_TEST

/* RFC 3629: what is UTF-8, and sanitizing what is not, byte by byte. */
/* A port above 65535 is refused, not taken modulo 65536 by the resolver (99999 -> 34463). */
START_TEST(test_addr_port_range)
{
  static const char *const ok[] = {
      "127.0.0.1:7470",          "0.0.0.0:0", ":65535", "[::1]:443", "dns:///head:7470",
      "unix:/run/distrain.sock", "head",      ""};
  static const char *const bad[] = {
      "127.0.0.1:65536", "127.0.0.1:99999",     ":123456",
      "[::1]:70000",     "dns:///head:0065536", "h:99999999999999999999"};
  for (size_t i = 0; i < sizeof ok / sizeof *ok; i++)
    ck_assert_msg(!dt_addr_port_out_of_range(ok[i]), "%s", ok[i]);
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
    ck_assert_msg(dt_addr_port_out_of_range(bad[i]), "%s", bad[i]);
  ck_assert(!dt_addr_port_out_of_range(NULL));
  /* and a listener refuses one before binding anything */
  int fd = -1, port = 0;
  ck_assert_int_eq(dt_listener_bind("127.0.0.1:99999", &fd, &port), DT_EINVAL);
  ck_assert_int_eq(fd, -1);
}
END_TEST

START_TEST(test_utf8)
{
  static const struct {
    const char *in, *sanitized;
  } cases[] = {
      {"plain ascii", NULL},
      {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", NULL}, /* é € 😀: valid, unchanged */
      {"caf\xe9.bin", "caf?.bin"},                         /* Latin-1 é */
      {"\xe2\x82", "??"},                                  /* € cut short */
      {"x\xf0\x9f\x98", "x???"},                           /* 😀 cut short */
      {"\xc0\xaf", "??"},                                  /* overlong '/' */
      {"\xed\xa0\x80", "???"},                             /* a surrogate */
      {"\xf4\x90\x80\x80", "????"},                        /* past U+10FFFF */
      {"\x80\xbf", "??"},                                  /* lone continuations */
      {"\xc3\xa9\xc3", "\xc3\xa9?"},                       /* a whole é, then half */
  };
  for (size_t i = 0; i < DT_ARRAY_SIZE(cases); i++) {
    const char *want = cases[i].sanitized ? cases[i].sanitized : cases[i].in;
    ck_assert_msg(dt_utf8_valid(cases[i].in, strlen(cases[i].in)) == (cases[i].sanitized == NULL),
                  "case %zu", i);
    char buf[64];
    snprintf(buf, sizeof buf, "%s", cases[i].in);
    dt_utf8_sanitize(buf);
    ck_assert_str_eq(buf, want);
    ck_assert(dt_utf8_valid(buf, strlen(buf)));
  }
  ck_assert(dt_utf8_valid("a\xc3\xa9", 2) == 0); /* the length given, not the NUL, ends it */
  /* A stream's next character: whole, still coming, or none. */
  ck_assert_int_eq(dt_utf8_next("a", 1), 1);
  ck_assert_int_eq(dt_utf8_next("\xe2\x82\xac!", 4), 3); /* the euro sign */
  ck_assert_int_eq(dt_utf8_next("\xe2\x82", 2), 0);
  ck_assert_int_eq(dt_utf8_next("\xf0", 1), 0);
  ck_assert_int_eq(dt_utf8_next("", 0), 0);
  ck_assert_int_eq(dt_utf8_next("\xe2x", 2), -1);        /* not a continuation */
  ck_assert_int_eq(dt_utf8_next("\xe0\x80\x80", 3), -1); /* overlong */
  ck_assert_int_eq(dt_utf8_next("\xed\xa0\x80", 3), -1); /* a surrogate */
  ck_assert_int_eq(dt_utf8_next("\xff", 1), -1);
}
END_TEST

START_TEST(test_parse_f64)
{
  double v = 0;
  ck_assert_int_eq(dt_parse_f64("1.5", &v), 0);
  ck_assert(v == 1.5);
  ck_assert_int_eq(dt_parse_f64("-2e3", &v), 0);
  ck_assert(v == -2000.0);
  ck_assert_int_eq(dt_parse_f64("3e-4", &v), 0);
  ck_assert(v == 3e-4);
  ck_assert_int_eq(dt_parse_f64("7", &v), 0);
  ck_assert(v == 7.0);
  ck_assert_int_eq(dt_parse_f64("1e30", &v), 0);
  ck_assert(v == 1e30);
  /* Subnormal and underflowing values (strtod's ERANGE) are what they round to, as a job spec
   * reads them: a spec with optimizer.lr 1e-310 used to validate, then fail every trainer. */
  ck_assert_int_eq(dt_parse_f64("1e-310", &v), 0);
  ck_assert(v == 1e-310 && v > 0.0);
  ck_assert_int_eq(dt_parse_f64("4.9406564584124654e-324", &v), 0);
  ck_assert(v == 4.9406564584124654e-324);
  ck_assert_int_eq(dt_parse_f64("1e-400", &v), 0);
  ck_assert(v == 0.0);

  const char *bad[] = {"",    "abc",  "1.5x",  "1.5 ",   " 1.5", "nan", "NaN",
                       "inf", "-inf", "1e400", "-1e400", ".",    "e5",  "1,5"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    v = 42.0;
    ck_assert_msg(dt_parse_f64(bad[i], &v) == DT_EINVAL, "'%s' was accepted", bad[i]);
    ck_assert(v == 42.0);
  }
  ck_assert_int_eq(dt_parse_f64(NULL, &v), DT_EINVAL);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* CRC-32C                                                                                     */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_crc32c_check_value)
{
  ck_assert_uint_eq(dt_crc32c(0, "123456789", 9), 0xE3069283u);
  ck_assert_uint_eq(dt_crc32c(0, "", 0), 0u);
  /* RFC 3720 (iSCSI) B.4 test vectors. */
  uint8_t buf[32];
  memset(buf, 0, sizeof buf);
  ck_assert_uint_eq(dt_crc32c(0, buf, sizeof buf), 0x8A9136AAu);
  memset(buf, 0xFF, sizeof buf);
  ck_assert_uint_eq(dt_crc32c(0, buf, sizeof buf), 0x62A8AB43u);
  for (int i = 0; i < 32; i++)
    buf[i] = (uint8_t)i;
  ck_assert_uint_eq(dt_crc32c(0, buf, sizeof buf), 0x46DD794Eu);
}
END_TEST

START_TEST(test_crc32c_chaining)
{
  uint8_t data[1000];
  dt_rng_t r;
  dt_rng_seed(&r, 99);
  for (size_t i = 0; i < sizeof data; i++)
    data[i] = (uint8_t)dt_rng_u64(&r);
  const uint32_t whole = dt_crc32c(0, data, sizeof data);
  for (size_t split = 0; split <= sizeof data; split += 37) {
    uint32_t c = dt_crc32c(0, data, split);
    c = dt_crc32c(c, data + split, sizeof data - split);
    ck_assert_uint_eq(c, whole);
  }
  /* Three pieces, one of them empty. */
  uint32_t c = dt_crc32c(0, data, 10);
  c = dt_crc32c(c, data + 10, 0);
  c = dt_crc32c(c, data + 10, sizeof data - 10);
  ck_assert_uint_eq(c, whole);
  /* A single flipped bit changes the checksum. */
  data[500] ^= 0x10;
  ck_assert_uint_ne(dt_crc32c(0, data, sizeof data), whole);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Atomic files and mkdir -p                                                                   */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_afile_commit_replaces)
{
  char dir[256], path[512];
  size_t n;
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/file.bin", dir);
  ut_write_all(path, "old contents", 12);

  dt_afile_t af;
  ck_assert_int_eq(dt_afile_open(&af, path), 0);
  ck_assert_int_eq(dt_afile_write(&af, "new", 3), 0);
  ck_assert_int_eq(dt_afile_write(&af, " data!", 6), 0);
  ck_assert_int_eq(dt_afile_write(&af, NULL, 0), 0);
  /* Before the commit the old file is intact and the new data sits in a temporary. */
  uint8_t *before = ut_read_all(path, &n);
  ck_assert_int_eq(n, 12);
  ck_assert_int_eq(memcmp(before, "old contents", 12), 0);
  free(before);
  ck_assert(ut_exists(af.tmp));
  ck_assert_int_eq(ut_count_entries(dir, NULL), 2);

  ck_assert_int_eq(dt_afile_commit(&af), 0);
  uint8_t *after = ut_read_all(path, &n);
  ck_assert_int_eq(n, 9);
  ck_assert_int_eq(memcmp(after, "new data!", 9), 0);
  free(after);
  ck_assert_int_eq(ut_count_entries(dir, ".tmp"), 0);
  ck_assert_int_eq(ut_count_entries(dir, NULL), 1);

  /* A commit onto a path that did not exist creates it. */
  snprintf(path, sizeof path, "%s/fresh.bin", dir);
  ck_assert_int_eq(dt_afile_open(&af, path), 0);
  ck_assert_int_eq(dt_afile_write(&af, "x", 1), 0);
  ck_assert_int_eq(dt_afile_commit(&af), 0);
  ck_assert_int_eq(ut_file_size(path), 1);
  ck_assert_int_eq(ut_count_entries(dir, ".tmp"), 0);
  ut_rm_rf(dir);
}
END_TEST

/* A full disk (/dev/full standing in for the temporary) is DT_ENOSPC, from a write that
 * reaches the disk and from the commit's flush alike, and no temporary is left. */
START_TEST(test_afile_full_disk)
{
  if (access("/dev/full", W_OK) != 0)
    return; /* not on this system: nothing to write to */
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/file.bin", dir);
  static char big[1 << 20];
  for (int flush_at_commit = 0; flush_at_commit < 2; flush_at_commit++) {
    dt_afile_t af;
    ck_assert_int_eq(dt_afile_open(&af, path), 0);
    fclose(af.fp);
    af.fp = fopen("/dev/full", "wb");
    ck_assert_ptr_nonnull(af.fp);
    if (flush_at_commit) {
      ck_assert_int_eq(dt_afile_write(&af, "x", 1), 0); /* buffered */
      ck_assert_int_eq(dt_afile_commit(&af), DT_ENOSPC);
    } else {
      ck_assert_int_eq(dt_afile_write(&af, big, sizeof big), DT_ENOSPC);
      dt_afile_abort(&af); /* as a writer does after a failed write */
    }
    ck_assert(!ut_exists(af.tmp));
    ck_assert(!ut_exists(path));
  }
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_afile_abort_leaves_old)
{
  char dir[256], path[512];
  size_t n;
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/file.bin", dir);
  ut_write_all(path, "keep me", 7);

  dt_afile_t af;
  ck_assert_int_eq(dt_afile_open(&af, path), 0);
  ck_assert_int_eq(dt_afile_write(&af, "garbage garbage", 15), 0);
  dt_afile_abort(&af);
  uint8_t *buf = ut_read_all(path, &n);
  ck_assert_int_eq(n, 7);
  ck_assert_int_eq(memcmp(buf, "keep me", 7), 0);
  free(buf);
  ck_assert_int_eq(ut_count_entries(dir, NULL), 1);
  ck_assert_int_eq(ut_count_entries(dir, ".tmp"), 0);

  /* Abort of a file that never existed leaves nothing at all. */
  snprintf(path, sizeof path, "%s/never.bin", dir);
  ck_assert_int_eq(dt_afile_open(&af, path), 0);
  dt_afile_abort(&af);
  ck_assert(!ut_exists(path));
  ck_assert_int_eq(ut_count_entries(dir, NULL), 1);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_afile_missing_dir)
{
  char dir[256], path[512];
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/no/such/dir/file.bin", dir);
  dt_afile_t af;
  int rc = dt_afile_open(&af, path);
  ck_assert_int_eq(rc, DT_ENOENT);
  ck_assert_ptr_null(af.fp);
  dt_afile_abort(&af); /* harmless after a failed open */
  ck_assert(!ut_exists(path));
  /* Below a regular file: not a directory, still an error. */
  snprintf(path, sizeof path, "%s/plain", dir);
  ut_write_all(path, "x", 1);
  snprintf(path, sizeof path, "%s/plain/file.bin", dir);
  ck_assert_int_lt(dt_afile_open(&af, path), 0);
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_mkdir_p)
{
  char dir[256], path[512];
  struct stat st;
  ut_mkdtemp(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/a/b/c", dir);
  ck_assert_int_eq(dt_mkdir_p(path), 0);
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert(S_ISDIR(st.st_mode));
  /* Existing: still success. Trailing slash: fine. */
  ck_assert_int_eq(dt_mkdir_p(path), 0);
  snprintf(path, sizeof path, "%s/a/b/d/", dir);
  ck_assert_int_eq(dt_mkdir_p(path), 0);
  snprintf(path, sizeof path, "%s/a/b/d", dir);
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert(S_ISDIR(st.st_mode));
  /* A regular file where the directory should be. */
  snprintf(path, sizeof path, "%s/file", dir);
  ut_write_all(path, "x", 1);
  ck_assert_int_eq(dt_mkdir_p(path), DT_EEXIST);
  /* A path below a regular file. */
  snprintf(path, sizeof path, "%s/file/sub/dir", dir);
  ck_assert_int_lt(dt_mkdir_p(path), 0);
  ck_assert(!ut_exists(path));
  ut_rm_rf(dir);
}
END_TEST

START_TEST(test_calloc_aligned)
{
  for (size_t bytes = 0; bytes < 300; bytes += 37) {
    uint8_t *p = dt_calloc_aligned(bytes, "test");
    ck_assert_ptr_nonnull(p);
    ck_assert_uint_eq((uintptr_t)p % 64, 0);
    for (size_t i = 0; i < bytes; i++)
      ck_assert_uint_eq(p[i], 0);
    dt_free_aligned(p);
  }
  double a = dt_now_ms();
  uint64_t b = dt_now_ns();
  ck_assert(dt_now_ms() >= a);
  ck_assert_uint_ge(dt_now_ns(), b);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* RNG                                                                                         */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_rng_deterministic)
{
  dt_rng_t a, b, c;
  dt_rng_seed(&a, 1337);
  dt_rng_seed(&b, 1337);
  dt_rng_seed(&c, 1338);
  int differ = 0;
  for (int i = 0; i < 1000; i++) {
    uint64_t x = dt_rng_u64(&a), y = dt_rng_u64(&b), z = dt_rng_u64(&c);
    ck_assert_uint_eq(x, y);
    differ += x != z;
  }
  ck_assert_int_gt(differ, 990);
  /* The state is the whole story: a copy continues the same stream (checkpoint resume). */
  dt_rng_t saved = a;
  uint64_t next[4];
  for (int i = 0; i < 4; i++)
    next[i] = dt_rng_u64(&a);
  for (int i = 0; i < 4; i++)
    ck_assert_uint_eq(dt_rng_u64(&saved), next[i]);
  /* Seed 0 must not produce the all-zero (stuck) xoshiro state. */
  dt_rng_t z;
  dt_rng_seed(&z, 0);
  ck_assert(z.s[0] | z.s[1] | z.s[2] | z.s[3]);
  ck_assert_uint_ne(dt_rng_u64(&z), dt_rng_u64(&z));
}
END_TEST

START_TEST(test_rng_uniform_range)
{
  dt_rng_t r;
  dt_rng_seed(&r, 5);
  double sum = 0.0;
  const int n = 100000;
  for (int i = 0; i < n; i++) {
    float u = dt_rng_uniform(&r);
    ck_assert(u >= 0.0f && u < 1.0f);
    sum += u;
  }
  ck_assert_double_eq_tol(sum / n, 0.5, 0.01);
}
END_TEST

START_TEST(test_rng_below)
{
  dt_rng_t r;
  dt_rng_seed(&r, 7);
  const uint64_t ns[] = {1, 2, 3, 7, 10, 1000, (1ull << 32) + 1, (1ull << 63) + 5, UINT64_MAX};
  for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++)
    for (int i = 0; i < 2000; i++)
      ck_assert_uint_lt(dt_rng_below(&r, ns[k]), ns[k]);
  /* Every value of a small range appears, in roughly equal numbers. */
  int hist[7] = {0};
  const int draws = 70000;
  for (int i = 0; i < draws; i++)
    hist[dt_rng_below(&r, 7)]++;
  for (int v = 0; v < 7; v++)
    ck_assert_msg(abs(hist[v] - draws / 7) < draws / 7 / 10, "value %d drawn %d times", v, hist[v]);
  /* Just above 1000 (and for a power of two) the values stay in range and fill both ends. */
  const uint64_t edge[] = {1001, 1024};
  for (size_t k = 0; k < 2; k++) {
    uint64_t lo = edge[k], hi = 0;
    for (int i = 0; i < 20000; i++) {
      uint64_t x = dt_rng_below(&r, edge[k]);
      ck_assert_uint_lt(x, edge[k]);
      lo = x < lo ? x : lo;
      hi = x > hi ? x : hi;
    }
    ck_assert_uint_eq(lo, 0);
    ck_assert_uint_eq(hi, edge[k] - 1);
  }
  /* Large n: both halves are reached (a modulo-only bug would skew this heavily). */
  int upper = 0;
  const uint64_t big = (1ull << 63) + (1ull << 62);
  for (int i = 0; i < 10000; i++)
    upper += dt_rng_below(&r, big) >= big / 2;
  ck_assert_int_gt(upper, 4500);
  ck_assert_int_lt(upper, 5500);
}
END_TEST

START_TEST(test_rng_permutation)
{
  dt_rng_t r;
  dt_rng_seed(&r, 11);
  const int64_t sizes[] = {0, 1, 2, 5, 100, 1000};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    const int64_t n = sizes[k];
    int64_t *perm = malloc((size_t)(n ? n : 1) * sizeof *perm);
    uint8_t *seen = calloc((size_t)(n ? n : 1), 1);
    dt_rng_permutation(&r, perm, n);
    int64_t fixed = 0;
    for (int64_t i = 0; i < n; i++) {
      ck_assert(perm[i] >= 0 && perm[i] < n);
      ck_assert_msg(!seen[perm[i]], "value %lld repeated", (long long)perm[i]);
      seen[perm[i]] = 1;
      fixed += perm[i] == i;
    }
    if (n >= 100)
      ck_assert_int_lt(fixed, n / 10); /* actually shuffled */
    free(perm);
    free(seen);
  }
  /* Uniform over all n! orders: for n = 3 each of the 6 permutations turns up about equally
   * often (Sattolo's variant, an off-by-one in Fisher-Yates, only makes the 2 cyclic ones). */
  int counts[27] = {0};
  const int draws = 6000;
  for (int i = 0; i < draws; i++) {
    int64_t p[3];
    dt_rng_permutation(&r, p, 3);
    counts[p[0] * 9 + p[1] * 3 + p[2]]++;
  }
  int kinds = 0;
  for (int i = 0; i < 27; i++) {
    if (counts[i] == 0)
      continue;
    kinds++;
    ck_assert_msg(abs(counts[i] - draws / 6) < draws / 6 / 5, "permutation %d drawn %d times", i,
                  counts[i]);
  }
  ck_assert_int_eq(kinds, 6);

  /* Same seed, same permutation; other seed, another one. */
  int64_t p1[50], p2[50], p3[50];
  dt_rng_t a, b, c;
  dt_rng_seed(&a, 3);
  dt_rng_seed(&b, 3);
  dt_rng_seed(&c, 4);
  dt_rng_permutation(&a, p1, 50);
  dt_rng_permutation(&b, p2, 50);
  dt_rng_permutation(&c, p3, 50);
  ck_assert_int_eq(memcmp(p1, p2, sizeof p1), 0);
  ck_assert_int_ne(memcmp(p1, p3, sizeof p1), 0);
}
END_TEST

START_TEST(test_rng_normal)
{
  const size_t n = 200001; /* odd: the last sample comes from an unpaired draw */
  float *x = malloc(n * sizeof *x);
  dt_rng_t r;
  dt_rng_seed(&r, 21);
  dt_rng_normal(&r, x, n, 3.0f, 2.0f);
  double sum = 0.0, sq = 0.0;
  size_t within1 = 0;
  for (size_t i = 0; i < n; i++) {
    ck_assert(isfinite(x[i]));
    sum += x[i];
    within1 += fabs(x[i] - 3.0) < 2.0;
  }
  const double mean = sum / (double)n;
  for (size_t i = 0; i < n; i++)
    sq += (x[i] - mean) * (x[i] - mean);
  const double std = sqrt(sq / (double)(n - 1));
  ck_assert_double_eq_tol(mean, 3.0, 0.03);
  ck_assert_double_eq_tol(std, 2.0, 0.03);
  /* 68.3% within one standard deviation: a uniform or mis-scaled generator would miss this. */
  ck_assert_double_eq_tol((double)within1 / (double)n, 0.6827, 0.01);
  /* Successive samples are independent (Box-Muller's cos and sin halves are uncorrelated). */
  double cov = 0.0;
  for (size_t i = 0; i + 1 < n; i += 2)
    cov += (x[i] - mean) * (x[i + 1] - mean);
  const double corr = cov / (double)(n / 2) / (std * std);
  ck_assert_msg(fabs(corr) < 0.02, "correlation of sample pairs %g", corr);
  /* Deterministic for a seed. */
  float y[5], z[5];
  dt_rng_seed(&r, 21);
  dt_rng_normal(&r, y, 5, 3.0f, 2.0f);
  ck_assert_int_eq(memcmp(x, y, sizeof y), 0);
  dt_rng_seed(&r, 22);
  dt_rng_normal(&r, z, 5, 3.0f, 2.0f);
  ck_assert_int_ne(memcmp(y, z, sizeof y), 0);
  free(x);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* CUDA versions                                                                               */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_cuda_version_str)
{
  char buf[16];
  const struct {
    int v;
    const char *s;
  } cases[] = {{12040, "12.4"}, {13000, "13.0"}, {11080, "11.8"}, {12090, "12.9"}, {10010, "10.1"}};
  for (size_t i = 0; i < DT_ARRAY_SIZE(cases); i++) {
    dt_cuda_version_str(cases[i].v, buf, sizeof buf);
    ck_assert_str_eq(buf, cases[i].s);
  }
}
END_TEST

START_TEST(test_cuda_driver_older)
{
  ck_assert(dt_cuda_driver_older(12040, 13000));
  ck_assert(dt_cuda_driver_older(12020, 12040)); /* older; the runtime decides if it matters */
  ck_assert(!dt_cuda_driver_older(13000, 13000));
  ck_assert(!dt_cuda_driver_older(13010, 13000));
  ck_assert(!dt_cuda_driver_older(0, 13000)); /* no driver: no GPU, not a mismatch */
}
END_TEST

/* The message names the driver's CUDA version, the runtime's, and both ways out. */
START_TEST(test_cuda_mismatch_message)
{
  char buf[256];
  dt_cuda_mismatch_message(12040, 13000, buf, sizeof buf);
  ck_assert_str_eq(buf, "CUDA driver supports up to 12.4, the runtime is 13.0: update the NVIDIA "
                        "driver or use a CUDA 12.4 build");
  dt_cuda_mismatch_message(11080, 12060, buf, sizeof buf);
  ck_assert_str_eq(buf, "CUDA driver supports up to 11.8, the runtime is 12.6: update the NVIDIA "
                        "driver or use a CUDA 11.8 build");
  /* A short buffer is cut, terminated, and nothing past it is written. */
  char small[24];
  memset(small, 'x', sizeof small);
  dt_cuda_mismatch_message(12040, 13000, small, 16);
  ck_assert_str_eq(small, "CUDA driver sup");
  ck_assert_int_eq(small[16], 'x');
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Log chunks and paths (GetLogs)                                                              */
/* ------------------------------------------------------------------------------------------ */

/* Reads walk the file in chunks of at most max_bytes (0 or more than 1 MiB: 1 MiB), the last
 * one reaching eof; an empty read at the end is eof too. */
START_TEST(test_logs_chunk_walks_the_file)
{
  dt_logs_chunk_t c = dt_logs_chunk(100, 0, 40);
  ck_assert(c.start == 0 && c.len == 40 && !c.eof);
  c = dt_logs_chunk(100, 80, 40);
  ck_assert(c.start == 80 && c.len == 20 && c.eof);
  c = dt_logs_chunk(100, 100, 40);
  ck_assert(c.start == 100 && c.len == 0 && c.eof);
  c = dt_logs_chunk(0, 0, 40); /* no file yet */
  ck_assert(c.start == 0 && c.len == 0 && c.eof);
  const uint64_t big = 5ull * DT_LOGS_MAX_CHUNK + 7;
  uint64_t off = 0;
  int reads = 0;
  for (;;) {
    c = dt_logs_chunk(big, off, 0);
    ck_assert_uint_eq(c.start, off);
    ck_assert_uint_le(c.len, DT_LOGS_MAX_CHUNK);
    off += c.len, reads++;
    if (c.eof)
      break;
  }
  ck_assert_uint_eq(off, big);
  ck_assert_int_eq(reads, 6);
  c = dt_logs_chunk(big, 0, UINT32_MAX);
  ck_assert_uint_eq(c.len, DT_LOGS_MAX_CHUNK);
}
END_TEST

/* An offset past the end means the file was replaced by a shorter one: start over at 0. */
START_TEST(test_logs_chunk_offset_past_the_end)
{
  dt_logs_chunk_t c = dt_logs_chunk(10, 50, 0);
  ck_assert(c.start == 0 && c.len == 10 && c.eof);
  c = dt_logs_chunk(0, 1, 0);
  ck_assert(c.start == 0 && c.len == 0 && c.eof);
}
END_TEST

/* Paths come from the job id and rank alone; a job id that is not one safe path component
 * names no file. */
START_TEST(test_logs_path)
{
  char buf[64];
  ck_assert_int_eq(dt_logs_path("/w", "job-12", 3, buf, sizeof buf), 0);
  ck_assert_str_eq(buf, "/w/job-12/rank-3.log");
  static const char *const bad[] = {"",
                                    ".",
                                    "..",
                                    "../etc",
                                    "a/b",
                                    ".hidden",
                                    "job 1",
                                    "j\n",
                                    "x123456789012345678901234567890123456789012345678901234567890"
                                    "123"};
  for (size_t i = 0; i < DT_ARRAY_SIZE(bad); i++)
    ck_assert_msg(dt_logs_path("/w", bad[i], 0, buf, sizeof buf) == DT_EINVAL, "'%s'", bad[i]);
  ck_assert_int_eq(dt_logs_path("/w", "job-1", -1, buf, sizeof buf), DT_EINVAL);
  ck_assert_int_eq(dt_logs_path("/a/long/work/directory/name", "job-1", 0, buf, 16), DT_ERANGE);
  ck_assert(dt_logs_job_ok("job-1") && dt_logs_job_ok("a.b_c-D9"));
}
END_TEST

/* ------------------------------------------------------------------------------------------ */

static Suite *common_suite(void)
{
  Suite *s = suite_create("common");
  TCase *t = tcase_create("errors");
  tcase_add_test(t, test_strerror_every_code);
  tcase_add_test(t, test_error_codes_distinct);
  tcase_add_test(t, test_strerror_unknown);
  tcase_add_test(t, test_err_from_errno);
  tcase_add_test(t, test_parse_int_list);
  suite_add_tcase(s, t);

  t = tcase_create("param");
  tcase_add_test(t, test_param_valid);
  tcase_add_test(t, test_param_unset_and_empty);
  tcase_add_test(t, test_param_malformed_uses_default);
  tcase_add_test(t, test_param_read_once);
  tcase_add_test(t, test_env_switch);
  suite_add_tcase(s, t);

  t = tcase_create("parse");
  tcase_add_test(t, test_parse_i64);
  tcase_add_test(t, test_parse_step_range);
  tcase_add_test(t, test_parse_f64);
  tcase_add_test(t, test_join_steps);
  tcase_add_test(t, test_utf8);
  tcase_add_test(t, test_addr_port_range);
  suite_add_tcase(s, t);

  t = tcase_create("crc32c");
  tcase_add_test(t, test_crc32c_check_value);
  tcase_add_test(t, test_crc32c_chaining);
  suite_add_tcase(s, t);

  t = tcase_create("files");
  tcase_add_test(t, test_afile_commit_replaces);
  tcase_add_test(t, test_afile_full_disk);
  tcase_add_test(t, test_afile_abort_leaves_old);
  tcase_add_test(t, test_afile_missing_dir);
  tcase_add_test(t, test_mkdir_p);
  tcase_add_test(t, test_calloc_aligned);
  suite_add_tcase(s, t);

  t = tcase_create("rng");
  tcase_add_test(t, test_rng_deterministic);
  tcase_add_test(t, test_rng_uniform_range);
  tcase_add_test(t, test_rng_below);
  tcase_add_test(t, test_rng_permutation);
  tcase_add_test(t, test_rng_normal);
  suite_add_tcase(s, t);

  t = tcase_create("cuda_version");
  tcase_add_test(t, test_cuda_version_str);
  tcase_add_test(t, test_cuda_driver_older);
  tcase_add_test(t, test_cuda_mismatch_message);
  suite_add_tcase(s, t);

  t = tcase_create("logs");
  tcase_add_test(t, test_logs_chunk_walks_the_file);
  tcase_add_test(t, test_logs_chunk_offset_past_the_end);
  tcase_add_test(t, test_logs_path);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(common_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
