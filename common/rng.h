/* rng.h — a small, fast, reproducible RNG (xoshiro256**, seeded through splitmix64).
 * Used for weight initialisation, data shuffling and sampling; its whole state is four words,
 * which a checkpoint saves so that a resumed run draws exactly the same numbers. */
#ifndef DT_RNG_H
#define DT_RNG_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  uint64_t s[4];
} dt_rng_t;

void dt_rng_seed(dt_rng_t *r, uint64_t seed);
uint64_t dt_rng_u64(dt_rng_t *r);
/* Uniform in [0, 1) with 24 random bits. */
float dt_rng_uniform(dt_rng_t *r);
/* Uniform integer in [0, n), unbiased. */
uint64_t dt_rng_below(dt_rng_t *r, uint64_t n);
/* n normal samples N(mean, std) (Box-Muller in double). */
void dt_rng_normal(dt_rng_t *r, float *out, size_t n, float mean, float std);
/* Fisher-Yates permutation of 0..n-1 into perm. */
void dt_rng_permutation(dt_rng_t *r, int64_t *perm, int64_t n);

#endif
