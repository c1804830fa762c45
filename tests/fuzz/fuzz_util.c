/* fuzz_util.c — see fuzz.h. */
#define _XOPEN_SOURCE 700 /* nftw */
#include <ftw.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dt_log.h"
#include "fuzz.h"

static char dir[256];

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
  (void)st, (void)flag, (void)ftw;
  return remove(path);
}

void fuzz_remove_tree(const char *path)
{
  nftw(path, remove_one, 16, FTW_DEPTH | FTW_PHYS);
}

static void remove_dir(void)
{
  fuzz_remove_tree(dir);
}

const char *fuzz_setup(void)
{
  if (dir[0])
    return dir;
  const char *v = getenv("FUZZ_VERBOSE");
  if (!v || strcmp(v, "1") != 0)
    dt_log_set_level(DT_LOG_ERROR);
  struct stat st;
  const char *base = getenv("TMPDIR");
  if (!base || !*base)
    base = stat("/dev/shm", &st) == 0 && access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  snprintf(dir, sizeof dir, "%s/dt-fuzz-XXXXXX", base);
  if (!mkdtemp(dir)) {
    perror(dir);
    abort();
  }
  atexit(remove_dir);
  return dir;
}

void fuzz_write(const char *path, const void *data, size_t size)
{
  FILE *fp = fopen(path, "wb");
  if (!fp || (size && fwrite(data, 1, size, fp) != size) || fclose(fp) != 0) {
    perror(path);
    abort();
  }
}
