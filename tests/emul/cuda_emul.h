/* cuda_emul.h — CUDA's thread model on the host, for running the GPU kernels of kernels/cuda/
 * (their .cuh headers) on a CPU, in the unit suites test_cuda_emul and test_flash_emul.
 *
 * Each CUDA thread of a block is a fiber (ucontext) of the calling OS thread with its own
 * threadIdx; the blocks of a grid run one after the other, so a function-local static is the
 * block's shared memory (__shared__ is defined as static), and the dynamic shared memory is a
 * heap buffer of exactly the bytes the launch asks for, filled with 0xFF bytes (NaN as a float
 * and as a bf16: a read of an entry no thread wrote poisons the result; a read past it is an
 * ASan error in the sanitizer build). A fiber runs until it reaches a barrier (__syncthreads, or
 * a warp's: shuffles and mma exchange through per-warp slots) or returns; each phase between
 * barriers runs the waiting fibers in another order (ascending, descending, then shuffled), so
 * a missing barrier shows as a wrong result. A barrier some threads of the block can never reach
 * (one inside divergent code, or after others returned) aborts, saying how many threads wait
 * where.
 * mma.sync.m16n8k16 (bf16) is rebuilt from the PTX ISA's fragment layouts.
 *
 * What this checks: the kernels' indexing, masks, tiles and their edges, reductions and barrier
 * structure. What it cannot: the GPU compiler's code, warp scheduling, memory ordering between
 * blocks, register spills, launch limits (only a block of 1..1024 threads is checked); test_cuda
 * (label gpu) runs the same kernels on a GPU. Include it before the kernel headers, after the
 * CUDA headers where those are used (dim3 and __nv_bfloat16 are then theirs); one translation
 * unit of a program includes it (its state is static). */
#ifndef DT_TESTS_CUDA_EMUL_H
#define DT_TESTS_CUDA_EMUL_H

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <vector>

#ifndef __VECTOR_TYPES_H__ /* without the CUDA headers: dim3 as theirs */
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
#endif
static dim3 threadIdx, blockIdx, blockDim, gridDim; /* the running fiber's; one block at a time */
static float *g_smem;

/* ---- Fibers: the threads of the running block -------------------------------------------- */

namespace dt_emul
{
enum { RUNNABLE, AT_BLOCK, AT_WARP, RETURNED };
struct fiber {
  ucontext_t ctx;
  int state;
};
static const size_t STACK_BYTES = 256u << 10; /* kernels keep register tiles on it */
static fiber g_fibers[1024];
static char *g_stacks; /* 1024 stacks, mapped once, touched as used */
static ucontext_t g_scheduler;
static unsigned g_threads, g_cur, g_at_block, g_returned, g_at_warp[32];
static void (*g_trampoline)(void *);
static void *g_body;

[[noreturn]] static void die(const char *what)
{
  fprintf(stderr, "cuda_emul: %s (block %u,%u of %u,%u; %u threads)\n", what, blockIdx.x,
          blockIdx.y, gridDim.x, gridDim.y, g_threads);
  abort();
}

static void fiber_main(void)
{
  g_trampoline(g_body);
  g_fibers[g_cur].state = RETURNED;
  g_returned++;
} /* returns to uc_link, the scheduler */

static inline void wait_at(int state)
{
  g_fibers[g_cur].state = state;
  if (swapcontext(&g_fibers[g_cur].ctx, &g_scheduler) != 0)
    die("swapcontext failed");
}

/* The i-th fiber to run in phase `phase`: ascending, descending, then a fixed shuffle (n is at
 * most 1024; 613 is prime to it). */
static inline unsigned order(unsigned phase, unsigned i, unsigned n)
{
  switch (phase % 3) {
  case 0:
    return i;
  case 1:
    return n - 1 - i;
  default:
    return n % 613 == 0 ? i : (unsigned)(((size_t)i * 613 + phase) % n);
  }
}

/* Runs the block's n fibers to their end. */
static void run_block(unsigned n)
{
  if (!g_stacks) {
    g_stacks = (char *)mmap(NULL, 1024 * STACK_BYTES, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (g_stacks == MAP_FAILED)
      die("no memory for the fibers' stacks");
  }
  ucontext_t proto;
  if (getcontext(&proto) != 0)
    die("getcontext failed");
  g_threads = n;
  g_at_block = g_returned = 0;
  memset(g_at_warp, 0, sizeof g_at_warp);
  for (unsigned t = 0; t < n; t++) {
    fiber *f = &g_fibers[t];
    f->ctx = proto;
    f->ctx.uc_stack.ss_sp = g_stacks + (size_t)t * STACK_BYTES;
    f->ctx.uc_stack.ss_size = STACK_BYTES;
    f->ctx.uc_link = &g_scheduler;
    makecontext(&f->ctx, fiber_main, 0);
    f->state = RUNNABLE;
  }
  for (unsigned phase = 0; g_returned < n; phase++) {
    for (unsigned i = 0; i < n; i++) {
      const unsigned t = order(phase, i, n);
      if (g_fibers[t].state != RUNNABLE)
        continue;
      g_cur = t;
      threadIdx = dim3(t);
      if (swapcontext(&g_scheduler, &g_fibers[t].ctx) != 0)
        die("swapcontext failed");
    }
    /* every fiber now waits at a barrier or has returned: release the complete barriers */
    int released = 0;
    if (g_at_block > 0 && g_at_block == n) {
      for (unsigned t = 0; t < n; t++)
        g_fibers[t].state = RUNNABLE;
      g_at_block = 0;
      released = 1;
    }
    for (unsigned w = 0; w * 32 < n; w++)
      if (g_at_warp[w] > 0 && g_at_warp[w] == std::min(32u, n - 32 * w)) {
        for (unsigned t = 32 * w; t < std::min(n, 32 * w + 32); t++)
          g_fibers[t].state = RUNNABLE;
        g_at_warp[w] = 0;
        released = 1;
      }
    if (!released && g_returned < n) {
      char why[160];
      unsigned warp = 0;
      for (unsigned w = 0; w < 32; w++)
        warp += g_at_warp[w];
      snprintf(why, sizeof why,
               "deadlock: %u threads at __syncthreads, %u at a warp barrier, %u returned",
               g_at_block, warp, g_returned);
      die(why);
    }
  }
}
} /* namespace dt_emul */

static inline void __syncthreads(void)
{
  dt_emul::g_at_block++;
  dt_emul::wait_at(dt_emul::AT_BLOCK);
}

/* ---- Warp-level primitives: lanes exchange through per-warp slots -------------------------- */

static uint32_t g_lane_a[32][32][4], g_lane_b[32][32][2];
static double g_lane_v[32][32];

static inline void warp_sync(void)
{
  dt_emul::g_at_warp[threadIdx.x / 32]++;
  dt_emul::wait_at(dt_emul::AT_WARP);
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

#ifndef __CUDA_BF16_H__ /* without cuda_bf16.h: its type and conversions */
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
#endif

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
  if (threads < 1 || threads > 1024)
    dt_emul::die("a block of 1..1024 threads");
  gridDim = grid;
  blockDim = dim3(threads);
  dt_emul::g_trampoline = [](void *b) { (*(F *)b)(); };
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdangling-pointer" /* read only until launch returns */
  dt_emul::g_body = &body;
#pragma GCC diagnostic pop
  for (unsigned y = 0; y < grid.y; y++)
    for (unsigned x = 0; x < grid.x; x++) {
      blockIdx = dim3(x, y);
      g_smem = (float *)malloc(smem_bytes ? smem_bytes : 1);
      if (!g_smem)
        dt_emul::die("no memory for the dynamic shared memory");
      memset(g_smem, 0xff, smem_bytes); /* NaN as a float and as a bf16 */
      dt_emul::run_block(threads);
      free(g_smem);
      g_smem = NULL;
    }
}

#endif
