/* fuzz.h — what the fuzz targets share (tests/fuzz/README in CMakeLists.txt: each target is one
 * libFuzzer entry point, LLVMFuzzerTestOneInput, built twice: with clang's -fsanitize=fuzzer for
 * a fuzzing campaign (tests/fuzz/run.sh), and with replay.c's main for CTest, which feeds it
 * every file of its corpus/<target>/ directory: the seeds and every input that once found a
 * bug). A target checks properties of the code it drives, not only that it does not crash:
 * FUZZ_ASSERT aborts with a message, which both builds report as a failure. */
#ifndef DT_TESTS_FUZZ_H
#define DT_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_ASSERT(cond, ...)                                                                     \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "%s:%d: property violated: %s: ", __FILE__, __LINE__, #cond);                \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fputc('\n', stderr);                                                                         \
      abort();                                                                                     \
    }                                                                                              \
  } while (0)

/* Once per process: keeps distrain's log to its ERROR lines (one per refused input;
 * FUZZ_VERBOSE=1 logs everything) and makes a private directory for the target's files, on
 * /dev/shm where there is one (checkpoint commits fsync), removed at exit. Returns its path. */
const char *fuzz_setup(void);
/* Writes size bytes to path (replacing it); aborts on failure (the harness's, not the input's). */
void fuzz_write(const char *path, const void *data, size_t size);
/* Removes path and everything under it (nothing when it does not exist). */
void fuzz_remove_tree(const char *path);

#endif
