/* cuda_emul.h — CUDA's thread model on the host, for running the GPU kernels of kernels/cuda/
 * (their .cuh headers) in CPU-only test suites against the CPU kernels.
 *
 * Each CUDA thread of a block is an OS thread with its own threadIdx; __syncthreads() is a
 * barrier over the block's threads; the blocks of a grid run one after the other, so a
 * function-local static is the block's shared memory (__shared__ is defined as static), and
 * the dynamic shared memory is a heap buffer of exactly the bytes the launch asks for, filled
 * with 0xFF bytes (NaN as a float and as a bf16: a read of an entry no thread wrote poisons the
 * result; a read past it is an ASan error in the sanitizer build). Warp-level primitives
 * exchange through per-warp slots with a 32-thread barrier; mma.sync.m16n8k16 (bf16) is rebuilt
 * from the PTX ISA's fragment layouts.
 *
 * What this checks: the kernels' indexing, masks, tiles and their edges, reductions and barrier
 * structure. What it cannot: the GPU compiler's code, warp scheduling, memory ordering between
 * blocks, register spills, launch limits; test_cuda (label gpu) runs the same kernels on a GPU.
 * Include it before the kernel headers; a suite includes it once. */
#ifndef DT_TESTS_CUDA_EMUL_H
#define DT_TESTS_CUDA_EMUL_H

#include <check.h>
#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
static thread_local dim3 threadIdx;
static dim3 blockIdx, blockDim, gridDim;                /* one block runs at a time */
static pthread_barrier_t g_barrier, g_warp_barrier[32]; /* the block's, each warp's */
static float *g_smem;

static inline void __syncthreads(void)
{
  pthread_barrier_wait(&g_barrier);
}

/* ---- Warp-level primitives: lanes exchange through per-warp slots -------------------------- */

static uint32_t g_lane_a[32][32][4], g_lane_b[32][32][2];
static double g_lane_v[32][32];

static inline void warp_sync(void)
{
  pthread_barrier_wait(&g_warp_barrier[threadIdx.x / 32]);
}

/* The value of lane src of the calling warp (lane itself where src is out of the warp). */
template <typename T> static T warp_read(T v, int src)
{
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  g_lane_v[w][lane] = (double)v; /* float and double both travel exactly */
  warp_sync();
  const T r = src >= 0 && src < 32 ? (T)g_lane_v[w][src] : v;
  warp_sync(); /* the slot is rewritten by the next exchange */
  return r;
}

template <typename T> static T __shfl_xor_sync(unsigned, T v, int m)
{
  return warp_read(v, (int)(threadIdx.x % 32) ^ m);
}

template <typename T> static T __shfl_down_sync(unsigned, T v, unsigned delta)
{
  return warp_read(v, (int)(threadIdx.x % 32 + delta));
}

static inline float bf16_value(uint32_t reg, int half)
{
  const uint32_t u = (reg >> (16 * half)) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 from the PTX ISA's fragment layouts (g = lane / 4,
 * c = lane % 4): A's register j holds row g + 8 (j % 2), columns 2c + 8 (j / 2) + {0, 1}; B's
 * register j rows 2c + 8 j + {0, 1} of column g; D's element e row g + 8 (e / 2), column
 * 2c + e % 2. Each lane rebuilds A and B from every lane's registers and computes its four
 * elements, in fp32. */
static inline void mma_bf16(float d[4], const uint32_t a[4], const uint32_t b[2])
{
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  memcpy(g_lane_a[w][lane], a, sizeof g_lane_a[w][lane]);
  memcpy(g_lane_b[w][lane], b, sizeof g_lane_b[w][lane]);
  warp_sync();
  auto A = [&](int r, int k) {
    return bf16_value(g_lane_a[w][(r % 8) * 4 + (k % 8) / 2][r / 8 + 2 * (k / 8)], k % 2);
  };
  auto B = [&](int k, int n) { return bf16_value(g_lane_b[w][n * 4 + (k % 8) / 2][k / 8], k % 2); };
  for (int e = 0; e < 4; e++) {
    const int r = g + 8 * (e / 2), n = 2 * c + e % 2;
    float acc = d[e];
    for (int k = 0; k < 16; k++)
      acc += A(r, k) * B(k, n);
    d[e] = acc;
  }
  warp_sync();
}

/* ---- Intrinsics: IEEE single operations, each rounded on its own (the suite is compiled with
 * -ffp-contract=off, so none is fused into an FMA); bf16 as its 16 bits ------------------------ */

static inline float __fadd_rn(float a, float b)
{
  return a + b;
}
static inline float __fmul_rn(float a, float b)
{
  return a * b;
}
static inline float __fdiv_rn(float a, float b)
{
  return a / b;
}
static inline float __fsqrt_rn(float a)
{
  return sqrtf(a);
}

struct __nv_bfloat16 {
  uint16_t x;
};

/* x rounded to bf16, to nearest even (NaN stays NaN), as cuda_bf16.h's intrinsic */
static inline __nv_bfloat16 __float2bfloat16_rn(float x)
{
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{(uint16_t)(u >> 16)};
}

static inline float __bfloat162float(__nv_bfloat16 h)
{
  const uint32_t u = (uint32_t)h.x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

using std::max;
using std::min;
#define __global__
#define __device__
#define __shared__ static
#define __launch_bounds__(n)
#define DT_FLASH_SMEM(name)  float *name = g_smem
#define DT_MMA_BF16(d, a, b) mma_bf16(d, a, b)
#define DT_SHFL_XOR(v, m)    __shfl_xor_sync(0xffffffffu, v, m)
#define DT_SYNCWARP()        warp_sync()

/* Runs body once per thread of every block of grid, as kernel<<<grid, threads, smem>>>. */
template <typename F> static void launch(dim3 grid, unsigned threads, size_t smem_bytes, F body)
{
  gridDim = grid;
  blockDim = dim3(threads);
  for (unsigned y = 0; y < grid.y; y++)
    for (unsigned x = 0; x < grid.x; x++) {
      blockIdx = dim3(x, y);
      g_smem = (float *)malloc(smem_bytes ? smem_bytes : 1);
      ck_assert_ptr_nonnull(g_smem);
      memset(g_smem, 0xff, smem_bytes); /* NaN as a float and as a bf16 */
      ck_assert_int_eq(pthread_barrier_init(&g_barrier, NULL, threads), 0);
      for (unsigned w = 0; w * 32 < threads; w++)
        ck_assert_int_eq(pthread_barrier_init(&g_warp_barrier[w], NULL, min(32u, threads - 32 * w)),
                         0);
      std::vector<std::thread> ts;
      for (unsigned t = 0; t < threads; t++)
        ts.emplace_back([&body, t] {
          threadIdx = dim3(t);
          body();
        });
      for (auto &th : ts)
        th.join();
      pthread_barrier_destroy(&g_barrier);
      for (unsigned w = 0; w * 32 < threads; w++)
        pthread_barrier_destroy(&g_warp_barrier[w]);
      free(g_smem);
      g_smem = NULL;
    }
}

/* max |got - want| / max |want| must be <= tol (NaN or inf never passes): test_cuda's measure,
 * the error against the tensor's scale, since the two sides sum in other orders. */
static void expect_close(const char *what, const std::vector<float> &got,
                         const std::vector<float> &want, double tol = 1e-5)
{
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size(); i++) {
    const double d = fabs((double)got[i] - (double)want[i]);
    worst = std::isfinite(d) ? std::max(worst, d) : INFINITY;
    scale = std::max(scale, fabs((double)want[i]));
  }
  const double e = worst / (scale > 1e-30 ? scale : 1e-30);
  ck_assert_msg(e <= tol, "%s: relative error %.3g over %zu values (tolerance %.0e)", what, e,
                want.size(), tol);
}

#endif
