/* blas.c — checks on the OpenBLAS library that the CPU kernels run their GEMMs through.
 *
 * OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels from CPUID when the library is
 * loaded. A CPU newer than the library is not recognised and gets the generic "Prescott" (SSE3)
 * kernels: Debian bookworm's 0.3.21 does this on a Sapphire Rapids VM, where gpt-tiny's step took
 * 1,554 ms instead of 547 ms with the AVX-512 kernels (tests/bench, one thread). OPENBLAS_CORETYPE
 * overrides the choice but is read only at load time, so the trainer re-executes itself with it
 * set (worker/trainer/main.c). A CPU that OpenBLAS does recognise is left alone. */
#include <strings.h>

#include "cpu_kernels.h"

extern char *openblas_get_corename(void);

const char *dt_cpu_blas_better_coretype(void)
{
  const char *name = openblas_get_corename();
  if (!name || strcasecmp(name, "Prescott") != 0) /* OpenBLAS's fallback for unknown x86 CPUs */
    return NULL;
#if defined(__x86_64__) && defined(__GNUC__)
  /* GCC's checks include the OS's support for the registers (XGETBV), not only CPUID. */
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return "Haswell";
#endif
  return NULL;
}
