/* kv_file.c — a dt_kv_t over a directory: one file per key (see comm.h).
 *
 * Invariant: a key's file only ever appears complete, because put writes a private temporary
 * file (".tmp.<pid>.<n>", a name no escaped key can take since keys escape a leading '.') and
 * renames it into place. Nothing is fsynced: rendezvous data is worthless after a reboot, and
 * rename alone gives the atomic visibility readers need. get polls with a backoff of 1 to 10 ms. */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "comm.h"
#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"

typedef struct {
  char *dir;
} kv_file_t;

/* Numbers the temporaries of the whole process: two stores on one directory (ranks that are
 * threads) must not write the same temporary file. */
static atomic_uint g_tmp_seq;

/* dir + "/" + escaped key; DT_EINVAL when the escaped name would exceed NAME_MAX. */
static int key_path(const kv_file_t *kf, const char *key, char *path, size_t cap)
{
  static const char hex[] = "0123456789ABCDEF";
  char name[256];
  size_t n = 0;
  for (const unsigned char *p = (const unsigned char *)key; *p; p++) {
    int plain = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
                *p == '_' || *p == '-' || (*p == '.' && p != (const unsigned char *)key);
    if (n + 4 > sizeof name)
      return DT_EINVAL;
    if (plain) {
      name[n++] = (char)*p;
    } else {
      name[n++] = '%';
      name[n++] = hex[*p >> 4];
      name[n++] = hex[*p & 15];
    }
  }
  if (n == 0)
    return DT_EINVAL;
  name[n] = '\0';
  if (snprintf(path, cap, "%s/%s", kf->dir, name) >= (int)cap)
    return DT_EINVAL;
  return 0;
}

static int write_all(int fd, const void *buf, size_t len)
{
  const char *p = buf;
  while (len > 0) {
    ssize_t w = write(fd, p, len);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      return -1;
    }
    p += w;
    len -= (size_t)w;
  }
  return 0;
}

static int kv_file_put(void *ud, const char *key, const void *val, size_t len)
{
  kv_file_t *kf = ud;
  char path[4096], tmp[4096];
  if (!key || (len && !val))
    return DT_EINVAL;
  if (key_path(kf, key, path, sizeof path) < 0) {
    DT_ERROR(COMM, "kv %s: key too long: %s", kf->dir, key);
    return DT_EINVAL;
  }
  snprintf(tmp, sizeof tmp, "%s/.tmp.%ld.%u", kf->dir, (long)getpid(),
           atomic_fetch_add(&g_tmp_seq, 1));
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    int e = errno;
    DT_ERROR(COMM, "kv: open %s: %s", tmp, strerror(e));
    return dt_err_from_errno(e);
  }
  int e = write_all(fd, val, len) < 0 ? errno : 0;
  if (close(fd) < 0 && !e)
    e = errno;
  if (e) {
    DT_ERROR(COMM, "kv: write %s: %s", tmp, strerror(e));
    unlink(tmp);
    return dt_err_from_errno(e);
  }
  if (rename(tmp, path) < 0) {
    e = errno;
    DT_ERROR(COMM, "kv: rename %s -> %s: %s", tmp, path, strerror(e));
    unlink(tmp);
    return dt_err_from_errno(e);
  }
  return 0;
}

/* One attempt: 0 with the value, DT_ENOENT if absent, another error otherwise. */
static int read_file(const char *path, void **val, size_t *len)
{
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT ? DT_ENOENT : dt_err_from_errno(errno);
  int rc = 0;
  struct stat st;
  char *buf = NULL;
  if (fstat(fd, &st) < 0) {
    rc = dt_err_from_errno(errno);
    goto out;
  }
  size_t size = (size_t)st.st_size, got = 0;
  buf = malloc(size ? size : 1);
  if (!buf) {
    rc = DT_ENOMEM;
    goto out;
  }
  while (got < size) {
    ssize_t r = read(fd, buf + got, size - got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0) { /* files are replaced, never truncated, so a short read is an error */
      rc = r < 0 ? dt_err_from_errno(errno) : DT_EIO;
      goto out;
    }
    got += (size_t)r;
  }
  *val = buf;
  *len = size;
  buf = NULL;
out:
  free(buf);
  close(fd);
  return rc;
}

static int kv_file_get(void *ud, const char *key, void **val, size_t *len, int timeout_ms)
{
  kv_file_t *kf = ud;
  char path[4096];
  if (!key || !val || !len || timeout_ms < 0)
    return DT_EINVAL;
  if (key_path(kf, key, path, sizeof path) < 0)
    return DT_EINVAL;
  double deadline = dt_now_ms() + timeout_ms;
  long sleep_us = 1000;
  for (;;) {
    int rc = read_file(path, val, len);
    if (rc != DT_ENOENT) {
      if (rc < 0)
        DT_ERROR(COMM, "kv: read %s: %s", path, dt_strerror(rc));
      return rc;
    }
    double left_ms = deadline - dt_now_ms();
    if (left_ms <= 0)
      return DT_ETIMEDOUT;
    dt_sleep_ms(DT_MIN(sleep_us / 1000.0, left_ms));
    sleep_us = DT_MIN(sleep_us * 2, 10000);
  }
}

int dt_kv_file_create(dt_kv_t *kv, const char *dir)
{
  if (!kv || !dir || !*dir)
    return DT_EINVAL;
  DT_CHECK(dt_mkdir_p(dir));
  kv_file_t *kf = calloc(1, sizeof *kf);
  if (!kf)
    return DT_ENOMEM;
  kf->dir = strdup(dir);
  if (!kf->dir) {
    free(kf);
    return DT_ENOMEM;
  }
  *kv = (dt_kv_t){.put = kv_file_put, .get = kv_file_get, .ud = kf};
  return 0;
}

void dt_kv_file_destroy(dt_kv_t *kv)
{
  if (!kv || !kv->ud)
    return;
  kv_file_t *kf = kv->ud;
  free(kf->dir);
  free(kf);
  kv->ud = NULL;
}
