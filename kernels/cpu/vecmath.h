/* vecmath.h — lets the compiler vectorise expf/tanhf loops through glibc's libmvec.
 *
 * glibc only declares its vector variants (_ZGVdN8v_expf, ...) under -ffast-math, which we
 * will not use: it would also license reassociation and break NaN detection. Declaring the
 * functions "omp declare simd" ourselves gives the vector calls (<= 4 ulp, glibc's documented
 * bound) while every other operation keeps strict IEEE semantics. Loops that should use them
 * are marked "#pragma omp simd". */
#ifndef DT_KERNELS_CPU_VECMATH_H
#define DT_KERNELS_CPU_VECMATH_H

#include <math.h>

#if defined(__x86_64__) && defined(__GLIBC__) && defined(DT_HAVE_LIBMVEC)
#pragma omp declare simd notinbranch
extern float expf(float);
#pragma omp declare simd notinbranch
extern float tanhf(float);
#endif

#endif
