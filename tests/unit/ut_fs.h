/* ut_fs.h — filesystem helpers shared by the unit suites: a private temporary directory per test,
 * recursive removal, and whole-file read/write/patch helpers for corrupting files on purpose.
 * Header-only (static functions) so each suite stays a single translation unit. */
#ifndef DT_TESTS_UT_FS_H
#define DT_TESTS_UT_FS_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <check.h>

/* Creates a fresh directory under $TMPDIR (or /tmp) into buf. */
static inline void ut_mkdtemp(char *buf, size_t n)
{
  const char *base = getenv("TMPDIR");
  snprintf(buf, n, "%s/dt-ut-XXXXXX", base && *base ? base : "/tmp");
  ck_assert_msg(mkdtemp(buf) != NULL, "mkdtemp(%s) failed", buf);
}

/* rm -rf path (files and directories; no symlink following). */
static inline void ut_rm_rf(const char *path)
{
  struct stat st;
  if (lstat(path, &st) != 0)
    return;
  if (S_ISDIR(st.st_mode)) {
    DIR *d = opendir(path);
    if (d) {
      struct dirent *e;
      while ((e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
          continue;
        char child[4096];
        if (snprintf(child, sizeof child, "%s/%s", path, e->d_name) < (int)sizeof child)
          ut_rm_rf(child);
      }
      closedir(d);
    }
    rmdir(path);
  } else {
    unlink(path);
  }
}

static inline int ut_exists(const char *path)
{
  struct stat st;
  return stat(path, &st) == 0;
}

static inline long long ut_file_size(const char *path)
{
  struct stat st;
  return stat(path, &st) == 0 ? (long long)st.st_size : -1;
}

/* Reads a whole file into a malloc'ed buffer (NUL-terminated for convenience). */
static inline uint8_t *ut_read_all(const char *path, size_t *n)
{
  FILE *fp = fopen(path, "rb");
  ck_assert_msg(fp != NULL, "cannot open %s", path);
  fseek(fp, 0, SEEK_END);
  long len = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  uint8_t *buf = malloc((size_t)len + 1);
  ck_assert_ptr_nonnull(buf);
  ck_assert_int_eq(fread(buf, 1, (size_t)len, fp), (size_t)len);
  buf[len] = 0;
  fclose(fp);
  *n = (size_t)len;
  return buf;
}

static inline void ut_write_all(const char *path, const void *buf, size_t n)
{
  FILE *fp = fopen(path, "wb");
  ck_assert_msg(fp != NULL, "cannot create %s", path);
  ck_assert_int_eq(fwrite(buf, 1, n, fp), n);
  ck_assert_int_eq(fclose(fp), 0);
}

/* Overwrites n bytes at offset (in place, no truncation). */
static inline void ut_patch(const char *path, long offset, const void *bytes, size_t n)
{
  FILE *fp = fopen(path, "r+b");
  ck_assert_msg(fp != NULL, "cannot open %s", path);
  ck_assert_int_eq(fseek(fp, offset, SEEK_SET), 0);
  ck_assert_int_eq(fwrite(bytes, 1, n, fp), n);
  ck_assert_int_eq(fclose(fp), 0);
}

/* Flips every bit of the byte at offset. */
static inline void ut_flip_byte(const char *path, long offset)
{
  FILE *fp = fopen(path, "r+b");
  ck_assert_msg(fp != NULL, "cannot open %s", path);
  ck_assert_int_eq(fseek(fp, offset, SEEK_SET), 0);
  int c = fgetc(fp);
  ck_assert_int_ne(c, EOF);
  ck_assert_int_eq(fseek(fp, offset, SEEK_SET), 0);
  fputc(c ^ 0xFF, fp);
  ck_assert_int_eq(fclose(fp), 0);
}

/* Counts directory entries whose name contains needle (NULL: all, except . and ..). */
static inline int ut_count_entries(const char *dir, const char *needle)
{
  DIR *d = opendir(dir);
  if (!d)
    return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    if (!needle || strstr(e->d_name, needle))
      n++;
  }
  closedir(d);
  return n;
}

#endif
