/* wgmma.cuh — Hopper's warpgroup matrix multiply (wgmma.mma_async, sm_90a): the primitives a
 * kernel needs to run bf16 products with fp32 accumulation on a warpgroup (4 warps, 128
 * threads), its operands in shared memory or (A) in registers. The attention kernels of
 * flash_mma.cuh use mma.sync (sm_80), which on an H100/H200 reaches about two thirds of the
 * tensor cores' rate; wgmma is the instruction that reaches all of it.
 *
 * One instruction (DT_WGMMA_SS / DT_WGMMA_RS) is D (64 x 64, fp32) = A (64 x 16) B (16 x 64) + D
 * (or without + D where scale_d is 0: D's old values are not read). Products are asynchronous:
 * issue them, close the group (DT_WGMMA_COMMIT), and wait (DT_WGMMA_WAIT(n): all but the n newest
 * groups are done) before D is read or an operand is changed; DT_WGMMA_FENCE goes before the first
 * product that reads registers written since (D, or A from registers), and dt_wgmma_fence_acc(d)
 * after the wait, so that the compiler moves no use of d across it. Shared memory written by
 * threads (stores or cp.async) must be published to the tensor cores, which read it through the
 * async proxy: DT_FENCE_PROXY_ASYNC() then __syncthreads(), before the products.
 *
 * Layouts (the PTX ISA's canonical layouts, 128-byte swizzle; CUTLASS's GMMA Layout_*_SW128_Atom).
 * Every operand tile here is rows of 64 bf16 (128 bytes), row r at byte 128 r of a tile whose
 * shared address is a multiple of 1024, each 16-byte chunk j of a row stored at chunk j ^ (r % 8):
 * dt_sw128 gives where a byte of the unswizzled tile lands. The hardware applies the same XOR
 * to address bits, so a tile that is not 1024-aligned in the shared window reads wrong values.
 *  - K-major (the tile's rows run along K: A as M x K, B as N x K, i.e. B^T): the k-th 16-column
 *    step's descriptor starts 32 k bytes into the tile; SBO = 1024 (8 rows), LBO unused (16).
 *  - MN-major (the rows run along M or N: A^T as K x M, B as K x N; transposed, trans = 1): the
 *    k-th 16-row step starts 2048 k bytes in; SBO = 1024 (the next 8 rows of K), LBO the distance
 *    to the next 64 columns of M or N (none within a 64-wide tile).
 * Register fragments (thread t, warp w = t / 32 % 4, g = t % 32 / 4, c = t % 4): d[i] is row
 * 16 w + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2 c + i % 2 of D; A's register j holds row
 * 16 w + g + 8 (j % 2), columns 2 c + 8 (j / 2) + {0, 1} of the 64 x 16 A, low half first
 * (mma.sync.m16n8k16's A layout, per warp).
 *
 * Portability: as flash_mma.cuh, the includer may replace the primitives (tests/emul/cuda_emul.h
 * runs them on the host: DT_SMEM_ADDR, DT_WGMMA_*, DT_FENCE_PROXY_ASYNC). On the GPU they need
 * code compiled for sm_90a (`90a` in CUDA_ARCHITECTURES); elsewhere they trap. */
#ifndef DT_KERNELS_CUDA_WGMMA_CUH
#define DT_KERNELS_CUDA_WGMMA_CUH

#include <stdint.h>

#ifndef DT_DYNAMIC_SMEM
#define DT_DYNAMIC_SMEM(name) extern __shared__ float name[]
#endif

#define DT_WG_THREADS 128 /* a warpgroup */

/* Where byte off of a 1024-aligned tile of 128-byte rows is stored under the 128-byte swizzle. */
__device__ static inline uint32_t dt_sw128(uint32_t off)
{
  return off ^ ((off >> 7 & 7u) << 4);
}

/* A shared-memory matrix descriptor, 128-byte swizzle: the operand's start (its shared address),
 * leading and stride byte offsets (multiples of 16, below 256 KiB). */
__device__ static inline uint64_t dt_wgmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
  return (uint64_t)(addr >> 4 & 0x3fffu) | (uint64_t)(lbo >> 4 & 0x3fffu) << 16 |
         (uint64_t)(sbo >> 4 & 0x3fffu) << 32 | 1ull << 62;
}

/* The descriptor of the k-th 16-wide step along K of a tile of 64-bf16 rows at shared address t
 * (1024-aligned): K-major, and MN-major. An MN-major tile of 64 columns has one group of 64
 * along M or N, so its LBO is unused; it is set equal to SBO, which makes the descriptor right
 * under either reading of the two offsets (tests/unit/wgmma_tile.cuh checks the emulation's
 * reading with distinct values). */
__device__ static inline uint64_t dt_wgmma_k(uint32_t t, int k)
{
  return dt_wgmma_desc(t + 32u * (uint32_t)k, 16u, 1024u);
}

__device__ static inline uint64_t dt_wgmma_mn(uint32_t t, int k)
{
  return dt_wgmma_desc(t + 2048u * (uint32_t)k, 1024u, 1024u);
}

#ifndef DT_WGMMA_SS
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DT__WGMMA_SM90A 1
#endif

/* The shared-window address of p (a pointer into shared memory). */
__device__ static inline uint32_t dt_smem_addr(const void *p)
{
#if defined(__CUDA_ARCH__)
  return (uint32_t)__cvta_generic_to_shared(p);
#else
  (void)p;
  return 0u;
#endif
}

#define DT__D32(i) "+f"(d[i])
#define DT__D32X8(i)                                                                               \
  DT__D32(i), DT__D32(i + 1), DT__D32(i + 2), DT__D32(i + 3), DT__D32(i + 4), DT__D32(i + 5),      \
      DT__D32(i + 6), DT__D32(i + 7)
#define DT__DREGS                                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "    \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

/* d (+)= A B, m64n64k16, A and B from shared memory (transposed where TA / TB: MN-major). */
template <int TA, int TB>
__device__ static inline void dt_wgmma_ss(float d[32], uint64_t da, uint64_t db, int scale_d)
{
#ifdef DT__WGMMA_SM90A
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DT__DREGS
               ", %32, %33, p, 1, 1, %35, %36;\n}\n"
               : DT__D32X8(0), DT__D32X8(8), DT__D32X8(16), DT__D32X8(24)
               : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
#else
  (void)d, (void)da, (void)db, (void)scale_d;
  __trap();
#endif
}

/* d (+)= A B, m64n64k16, A from registers (4 of 2 bf16), B from shared memory. */
template <int TB>
__device__ static inline void dt_wgmma_rs(float d[32], const uint32_t a[4], uint64_t db,
                                          int scale_d)
{
#ifdef DT__WGMMA_SM90A
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DT__DREGS
               ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
               : DT__D32X8(0), DT__D32X8(8), DT__D32X8(16), DT__D32X8(24)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
#else
  (void)d, (void)a, (void)db, (void)scale_d;
  __trap();
#endif
}

__device__ static inline void dt_wgmma_fence(void)
{
#ifdef DT__WGMMA_SM90A
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}

__device__ static inline void dt_wgmma_commit(void)
{
#ifdef DT__WGMMA_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}

template <int N> __device__ static inline void dt_wgmma_wait(void)
{
#ifdef DT__WGMMA_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#else
  __trap();
#endif
}

__device__ static inline void dt_fence_proxy_async(void)
{
#ifdef DT__WGMMA_SM90A
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#else
  __trap();
#endif
}

/* After a wait: d's registers are "written here", so no use of them moves above the wait. */
__device__ static inline void dt_wgmma_fence_acc(float d[32])
{
#ifdef __CUDA_ARCH__
#pragma unroll
  for (int i = 0; i < 32; i++)
    asm volatile("" : "+f"(d[i])::"memory");
#else
  (void)d;
#endif
}

#define DT_SMEM_ADDR(p)                       dt_smem_addr(p)
#define DT_WGMMA_SS(d, da, db, scale, ta, tb) dt_wgmma_ss<ta, tb>(d, da, db, scale)
#define DT_WGMMA_RS(d, a, db, scale, tb)      dt_wgmma_rs<tb>(d, a, db, scale)
#define DT_WGMMA_FENCE()                      dt_wgmma_fence()
#define DT_WGMMA_COMMIT()                     dt_wgmma_commit()
#define DT_WGMMA_WAIT(n)                      dt_wgmma_wait<n>()
#define DT_WGMMA_FENCE_ACC(d)                 dt_wgmma_fence_acc(d)
#define DT_FENCE_PROXY_ASYNC()                dt_fence_proxy_async()
#endif

#endif
