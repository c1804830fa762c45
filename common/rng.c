/* rng.c — xoshiro256** (Blackman & Vigna, public domain algorithm), written from the paper. */
#include "rng.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x)
{
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k)
{
  return (x << k) | (x >> (64 - k));
}

void dt_rng_seed(dt_rng_t *r, uint64_t seed)
{
  uint64_t x = seed;
  for (int i = 0; i < 4; i++)
    r->s[i] = splitmix64(&x);
}

uint64_t dt_rng_u64(dt_rng_t *r)
{
  uint64_t *s = r->s;
  uint64_t result = rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

float dt_rng_uniform(dt_rng_t *r)
{
  return (float)(dt_rng_u64(r) >> 40) * (1.0f / 16777216.0f);
}

uint64_t dt_rng_below(dt_rng_t *r, uint64_t n)
{
  /* Rejection sampling on the top of the range removes the modulo bias. */
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do {
    x = dt_rng_u64(r);
  } while (x >= limit);
  return x % n;
}

void dt_rng_normal(dt_rng_t *r, float *out, size_t n, float mean, float std)
{
  for (size_t i = 0; i < n; i += 2) {
    double u1 = ((double)(dt_rng_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740992.0); /* (0, 1] */
    double u2 = (double)(dt_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    double rad = sqrt(-2.0 * log(u1));
    out[i] = (float)(mean + std * rad * cos(2.0 * M_PI * u2));
    if (i + 1 < n)
      out[i + 1] = (float)(mean + std * rad * sin(2.0 * M_PI * u2));
  }
}

void dt_rng_permutation(dt_rng_t *r, int64_t *perm, int64_t n)
{
  for (int64_t i = 0; i < n; i++)
    perm[i] = i;
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = (int64_t)dt_rng_below(r, (uint64_t)i + 1);
    int64_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
}
