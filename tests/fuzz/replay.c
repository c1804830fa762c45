/* replay.c — main() for a fuzz target outside libFuzzer (CTest): runs LLVMFuzzerTestOneInput on
 * every file named, or in a directory named (sorted, so runs are repeatable), and says how many.
 * A crash, a sanitizer report or a FUZZ_ASSERT fails the test; so does an empty corpus. */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

static int run_file(const char *path)
{
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    perror(path);
    return -1;
  }
  fseek(fp, 0, SEEK_END);
  long n = ftell(fp);
  rewind(fp);
  /* A copy of exactly n bytes, as libFuzzer gives: reading past it is an ASan error. */
  uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
  if (!buf || (n > 0 && fread(buf, 1, (size_t)n, fp) != (size_t)n)) {
    perror(path);
    fclose(fp);
    free(buf);
    return -1;
  }
  fclose(fp);
  if (getenv("FUZZ_VERBOSE"))
    fprintf(stderr, "replay: %s (%ld bytes)\n", path, n);
  LLVMFuzzerTestOneInput(buf, (size_t)n);
  free(buf);
  return 0;
}

static int by_name(const struct dirent **a, const struct dirent **b)
{
  return strcmp((*a)->d_name, (*b)->d_name);
}

int main(int argc, char **argv)
{
  LLVMFuzzerInitialize(&argc, &argv);
  int runs = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      perror(argv[i]);
      return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (run_file(argv[i]) != 0)
        return 1;
      runs++;
      continue;
    }
    struct dirent **names;
    int n = scandir(argv[i], &names, NULL, by_name);
    if (n < 0) {
      perror(argv[i]);
      return 1;
    }
    for (int k = 0; k < n; k++) {
      char path[4096];
      snprintf(path, sizeof path, "%s/%s", argv[i], names[k]->d_name);
      if (names[k]->d_name[0] != '.' && stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
        if (run_file(path) != 0)
          return 1;
        runs++;
      }
      free(names[k]);
    }
    free(names);
  }
  printf("replay: %d inputs, no property violated\n", runs);
  return runs > 0 ? 0 : 1;
}
