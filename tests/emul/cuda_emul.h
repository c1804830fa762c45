/* cuda_emul.h — CUDA's thread model on the host, for running the GPU kernels of kernels/cuda/ on a
 * CPU: their .cuh headers in the unit suites test_cuda_emul and test_flash_emul, and every .cu
 * file in the emulated trainer (tests/emul/CMakeLists.txt, with emul_launch.h).
 *
 * Each CUDA thread of a block is a fiber of the calling OS thread with its own threadIdx; the
 * blocks of a grid run one after the other, so a function-local static is the block's shared
 * memory (__shared__ is defined as static), and the dynamic shared memory is a heap buffer of
 * exactly the bytes the launch asks for, filled with 0xFF bytes (NaN as a float and as a bf16: a
 * read of an entry no thread wrote poisons the result; a read past it is an ASan error in the
 * sanitizer build). A fiber runs until it reaches a barrier (__syncthreads, or a warp's: shuffles,
 * ldmatrix and mma exchange through per-warp slots) or returns; each phase between barriers runs
 * the waiting fibers in another order (ascending, descending, then shuffled), so a missing barrier
 * shows as a wrong result. A barrier some threads of the block can never reach (one inside
 * divergent code, or after others returned) aborts, saying how many threads wait where.
 * mma.sync.m16n8k16 (bf16) and ldmatrix.x4 are rebuilt from the PTX ISA's fragment layouts;
 * cp.async copies land late or early (cp_async16); Hopper's wgmma.mma_async (m64n64k16, bf16, its
 * shared operands under the 128-byte swizzle) runs at the wait that covers it (wgmma_wait), the
 * dynamic shared memory at a shared-window address that is not 1024-aligned (smem_addr).
 *
 * What this checks: the kernels' indexing, masks, tiles and their edges, reductions and barrier
 * structure. What it cannot: the GPU compiler's code, warp scheduling, memory ordering between
 * blocks, register spills, launch limits (only a block of 1..1024 threads is checked here;
 * emul_launch.h checks the rest); test_cuda (label gpu) runs the same kernels on a GPU. Include
 * it before the kernel headers, after the CUDA headers where those are used (dim3 and
 * __nv_bfloat16 are then theirs).
 *
 * Its state and functions are inline (C++17), never static: one instance in the program however
 * many translation units include it. A device function of a .cuh that is a template (such as
 * dt__block_reduce) has external linkage, so the linker keeps one copy for all units; had this
 * state been static, that copy would run the scheduler of whichever unit it came from (the -O0
 * sanitizer build of the emulated trainer jumped to a stale stack that way). One block runs at
 * a time in the whole process: callers on several threads serialize (the emulated trainer's
 * launches run through cuda_host.cc's stream queues, one piece of work at a time). */
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
inline dim3 threadIdx, blockIdx, blockDim, gridDim; /* the running fiber's; one block at a time */
inline float *g_smem;
inline size_t g_smem_bytes;

/* ---- Fibers: the threads of the running block -------------------------------------------- */

/* A switch between fibers: on x86-64 a stack switch of its own (the SysV callee-saved general
 * registers, nothing else: no kernel changes the rounding modes of MXCSR or the x87), since
 * glibc's swapcontext also makes a sigprocmask system call and took 95% of the emulated
 * trainer's time; elsewhere swapcontext itself. (AddressSanitizer checks the fibers' frames as
 * any others: each instrumented function poisons and unpoisons its own redzones, and a fiber
 * leaves its stack only through fiber_main's last switch, with no kernel frame left on it.) */
#if defined(__x86_64__)
#define DT_EMUL_FAST_SWITCH 1
/* Saves the caller's registers on its stack and its stack pointer in *from, then continues on
 * the stack `to` (one dt_emul_switch left, or one fiber_start prepared). Weak: every translation
 * unit including this header emits it. */
extern "C" void dt_emul_switch(void **from, void *to);
__asm__(".text\n"
        ".weak dt_emul_switch\n"
        ".type dt_emul_switch, @function\n"
        "dt_emul_switch:\n"
        "  pushq %rbp\n"
        "  pushq %rbx\n"
        "  pushq %r12\n"
        "  pushq %r13\n"
        "  pushq %r14\n"
        "  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n"
        "  popq %r14\n"
        "  popq %r13\n"
        "  popq %r12\n"
        "  popq %rbx\n"
        "  popq %rbp\n"
        "  ret\n"
        ".size dt_emul_switch, .-dt_emul_switch\n");
#endif

namespace dt_emul
{
enum { RUNNABLE, AT_BLOCK, AT_WARP, RETURNED };
struct fiber {
#ifdef DT_EMUL_FAST_SWITCH
  void *sp;
#else
  ucontext_t ctx;
#endif
  int state;
};
static const size_t STACK_BYTES = 256u << 10; /* kernels keep register tiles on it */
inline fiber g_fibers[1024];
inline char *g_stacks; /* 1024 stacks, mapped once, touched as used */
/* Each stack's top is lowered by a multiple of STAGGER (nine cache lines), below 64 KiB: at
 * equal offsets in their 256 KiB, the fibers' hot frames would all fall in the same cache sets
 * and evict one another at every switch. */
static const size_t STAGGER = 576;
#ifdef DT_EMUL_FAST_SWITCH
inline void *g_scheduler;
#else
inline ucontext_t g_scheduler;
#endif
inline unsigned g_threads, g_cur, g_at_block, g_returned, g_at_warp[32];
inline unsigned g_exchanges[1024]; /* warp exchanges each thread made (the slot sets below) */
struct cp_copy {                   /* a cp.async (cp_async16 below) */
  void *dst;
  const void *src;
  bool ok;
  unsigned t;  /* the thread that issued it */
  bool fenced; /* waited for, then published to the async proxy by t (fence_proxy_async) */
};
inline std::vector<cp_copy> g_cp_async[1024]; /* each thread's, not yet waited for */
inline std::vector<cp_copy> g_cp_waited;      /* waited for, landing at the next block barrier */
inline bool g_cp_early; /* the copies land as they are issued instead (cp_async16) */
/* cp.async writes through the generic proxy and wgmma reads shared memory through the async
 * proxy: on the GPU the writer must wait for its copies, then fence.proxy.async, and a barrier
 * must follow before wgmma may read them. Per 16 bytes of the dynamic shared memory, 0 or 1 +
 * the thread whose copy wrote them and has not published them since; a wgmma operand there dies
 * (wgmma_elem). Plain stores to shared memory are not seen. */
inline std::vector<uint16_t> g_async_owner;
inline std::vector<size_t> g_unpublished[1024]; /* each thread's copies' chunks not yet published */
/* A product issued and not yet waited for. The GPU reads the shared operands and writes D at
 * some time before the wait that covers it; the emulation does both at that wait, so a kernel
 * that reads D early or changes an operand tile before the wait gets wrong values (and one that
 * leaves out dt_wgmma_fence_acc after the wait dies: g_wgmma_unfenced). A from
 * registers is taken at the issue; the GPU may read those registers until the wait, so a thread
 * whose registers (a_src) no longer hold what they held at the issue by then dies (changed, or
 * gone out of scope and reused). */
struct wgmma_op {
  float *d;
  float a[2][16]; /* A from registers: the rows g and g + 8 of the warp's 16 */
  bool a_regs, ta, tb;
  uint64_t da, db;
  int scale_d;
  unsigned group;
  const uint32_t *a_src; /* this thread's A registers, and what they held at the issue */
  uint32_t a_issued[4];
};
inline std::vector<wgmma_op> g_wgmma[1024]; /* each thread's, in issue order */
inline unsigned g_wgmma_groups[1024];       /* groups each thread committed */
/* Each thread's accumulators a wait completed and no dt_wgmma_fence_acc has fenced since: on the
 * GPU the compiler may move a use of them above the wait (the emulation cannot see a register
 * read; a product issued on one, or the block's end, dies instead). */
inline std::vector<float *> g_wgmma_unfenced[1024];
/* wgmma.fence: on the GPU a product whose registers (its accumulators, its A fragments) other
 * instructions accessed since the thread's last wgmma.fence is undefined. Each thread's
 * registers that its products used, with their values at its last fence, at their last issue or
 * at the wait that last wrote them: a product whose registers no longer hold those values dies,
 * and so does one before the thread's first fence. Reads by other instructions, which the rule
 * covers too, are not seen. */
struct wgmma_regs {
  const void *p;
  size_t bytes;
  unsigned char seen[128];
};
inline std::vector<wgmma_regs> g_wgmma_regs[1024];
inline unsigned g_wgmma_fences[1024];
/* The wgmma instructions are .sync.aligned: every thread of a warpgroup executes the same ones
 * with the same operands. Each warpgroup's sequence of them (kind: 0 fence, 1 product, 2
 * commit, 3 wait; the product's descriptors, modes and scale-d; the wait's count), as its first
 * thread to get there executed them, and how far each thread has come: a thread whose i-th
 * differs dies, and so does a block whose threads of a warpgroup end at different counts. */
struct wgmma_step {
  int kind, scale_d, n;
  bool a_regs, ta, tb;
  uint64_t da, db;
  bool operator==(const wgmma_step &o) const
  {
    return kind == o.kind && scale_d == o.scale_d && n == o.n && a_regs == o.a_regs && ta == o.ta &&
           tb == o.tb && da == o.da && db == o.db;
  }
};
inline std::vector<wgmma_step> g_wgmma_steps[8];
inline size_t g_wgmma_stepped[1024];

inline size_t smem_chunk(const void *p)
{
  return (size_t)((const char *)p - (const char *)g_smem) / 16;
}

inline void cp_land(const cp_copy &c)
{
  if (c.ok)
    memcpy(c.dst, c.src, 16);
  else
    memset(c.dst, 0, 16);
  const size_t i = smem_chunk(c.dst);
  g_async_owner[i] = c.fenced ? 0 : (uint16_t)(c.t + 1);
  if (!c.fenced)
    g_unpublished[c.t].push_back(i);
}
inline void (*g_trampoline)(void *);
inline void *g_body;

[[noreturn]] inline void die(const char *what)
{
  fprintf(stderr, "cuda_emul: %s (block %u,%u,%u of %u,%u,%u; %u threads)\n", what, blockIdx.x,
          blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z, g_threads);
  abort();
}

/* The running fiber gives the OS thread back to the scheduler (run_block). */
inline void to_scheduler(void)
{
#ifdef DT_EMUL_FAST_SWITCH
  dt_emul_switch(&g_fibers[g_cur].sp, g_scheduler);
#else
  if (swapcontext(&g_fibers[g_cur].ctx, &g_scheduler) != 0)
    die("swapcontext failed");
#endif
}

/* The scheduler runs fiber t until it waits or returns. */
inline void to_fiber(unsigned t)
{
#ifdef DT_EMUL_FAST_SWITCH
  dt_emul_switch(&g_scheduler, g_fibers[t].sp);
#else
  if (swapcontext(&g_scheduler, &g_fibers[t].ctx) != 0)
    die("swapcontext failed");
#endif
}

/* A fiber's whole life: the kernel's body, then back to the scheduler for good. */
[[noreturn]] inline void fiber_main(void)
{
  g_trampoline(g_body);
  g_fibers[g_cur].state = RETURNED;
  g_returned++;
  to_scheduler();
  die("a returned fiber was resumed");
}

/* Makes f start at fiber_main on the stack [stack, stack + bytes), bytes a multiple of 16. */
inline void fiber_start(fiber *f, char *stack, size_t bytes)
{
#ifdef DT_EMUL_FAST_SWITCH
  /* The frame dt_emul_switch pops, from the lowest address: r15..r12, rbx, rbp (all 0), the
   * address it returns to (fiber_main); above it a 0 in place of fiber_main's own return
   * address, at 8 mod 16 as a call leaves it. */
  uint64_t *ret = (uint64_t *)(stack + bytes) - 3, *sp = ret - 7;
  memset(sp, 0, 8 * sizeof *sp);
  sp[6] = (uint64_t)(uintptr_t)fiber_main;
  f->sp = sp;
#else
  if (getcontext(&f->ctx) != 0)
    die("getcontext failed");
  f->ctx.uc_stack.ss_sp = stack;
  f->ctx.uc_stack.ss_size = bytes;
  f->ctx.uc_link = NULL;
  makecontext(&f->ctx, (void (*)(void))fiber_main, 0);
#endif
  f->state = RUNNABLE;
}

inline void wait_at(int state)
{
  g_fibers[g_cur].state = state;
  to_scheduler();
}

/* The i-th fiber to run in phase `phase`: ascending, descending, then a fixed shuffle (n is at
 * most 1024; 613 is prime to it). */
inline unsigned order(unsigned phase, unsigned i, unsigned n)
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
inline void run_block(unsigned n)
{
  if (!g_stacks) {
    g_stacks = (char *)mmap(NULL, 1024 * STACK_BYTES, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (g_stacks == MAP_FAILED)
      die("no memory for the fibers' stacks");
  }
  g_threads = n;
  g_at_block = g_returned = 0;
  memset(g_at_warp, 0, sizeof g_at_warp);
  memset(g_exchanges, 0, sizeof g_exchanges);
  memset(g_wgmma_groups, 0, sizeof g_wgmma_groups);
  memset(g_wgmma_fences, 0, sizeof g_wgmma_fences);
  memset(g_wgmma_stepped, 0, sizeof g_wgmma_stepped);
  for (std::vector<wgmma_step> &v : g_wgmma_steps)
    v.clear();
  for (unsigned t = 0; t < n; t++)
    g_wgmma_regs[t].clear();
  for (unsigned t = 0; t < n; t++)
    fiber_start(&g_fibers[t], g_stacks + (size_t)t * STACK_BYTES,
                STACK_BYTES - STAGGER * (t % 113));
  for (unsigned phase = 0; g_returned < n; phase++) {
    for (unsigned i = 0; i < n; i++) {
      const unsigned t = order(phase, i, n);
      if (g_fibers[t].state != RUNNABLE)
        continue;
      g_cur = t;
      threadIdx = dim3(t);
      to_fiber(t);
    }
    /* every fiber now waits at a barrier or has returned: release the complete barriers */
    int released = 0;
    if (g_at_block > 0 && g_at_block == n) {
      for (unsigned t = 0; t < n; t++)
        g_fibers[t].state = RUNNABLE;
      g_at_block = 0;
      released = 1;
      if (!g_cp_early)
        for (const cp_copy &c : g_cp_waited)
          cp_land(c);
      g_cp_waited.clear();
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
  for (unsigned t = 0; t < n; t++)
    if (!g_cp_async[t].empty())
      die("a thread returned with cp.async copies it never waited for");
  for (unsigned t = 0; t < n; t++) {
    if (g_wgmma_stepped[t] != g_wgmma_stepped[t / 128 * 128])
      die("the threads of a warpgroup executed different numbers of wgmma instructions");
    if (!g_wgmma[t].empty()) {
      g_wgmma[t].clear();
      die("a thread returned with wgmma products it never waited for");
    }
    if (!g_wgmma_unfenced[t].empty()) {
      g_wgmma_unfenced[t].clear();
      die("a thread returned with wgmma accumulators never fenced after their wait "
          "(dt_wgmma_fence_acc)");
    }
  }
  if (!g_cp_waited.empty())
    die("cp.async copies waited for, but no barrier made them visible before the block's end");
}
} /* namespace dt_emul */

inline void __syncthreads(void)
{
  dt_emul::g_at_block++;
  dt_emul::wait_at(dt_emul::AT_BLOCK);
}

/* ---- Warp-level primitives: lanes exchange through per-warp slots -------------------------- */

/* Two sets of slots, used by alternate exchanges (a lane's exchange count, the same in all lanes
 * of a warp, picks one): an exchange writes its set, meets the warp at one barrier and reads.
 * A lane can rewrite a set only two exchanges later, past the next barrier, which every lane
 * reaches only once done reading it, so no second barrier is needed. */
inline uint32_t g_lane_a[2][32][32][4], g_lane_b[2][32][32][2];
inline const uint16_t *g_lane_row[2][32][32];
inline double g_lane_v[2][32][32];

/* The calling lane's slot set for its next exchange (counted). */
inline int next_slots(void)
{
  return (int)(dt_emul::g_exchanges[threadIdx.x]++ & 1u);
}

inline void warp_sync(void)
{
  dt_emul::g_at_warp[threadIdx.x / 32]++;
  dt_emul::wait_at(dt_emul::AT_WARP);
}

/* The value of lane src of the calling warp (lane itself where src is out of the warp). */
template <typename T> inline T warp_read(T v, int src)
{
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, set = next_slots();
  g_lane_v[set][w][lane] = (double)v; /* float and double both travel exactly */
  warp_sync();
  return src >= 0 && src < 32 ? (T)g_lane_v[set][w][src] : v;
}

template <typename T> inline T __shfl_xor_sync(unsigned, T v, int m)
{
  return warp_read(v, (int)(threadIdx.x % 32) ^ m);
}

template <typename T> inline T __shfl_down_sync(unsigned, T v, unsigned delta)
{
  return warp_read(v, (int)(threadIdx.x % 32 + delta));
}

inline float bf16_value(uint32_t reg, int hi)
{
  const uint32_t u = (reg >> (16 * hi)) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 from the PTX ISA's fragment layouts (g = lane / 4,
 * c = lane % 4): A's register j holds row g + 8 (j % 2), columns 2c + 8 (j / 2) + {0, 1}; B's
 * register j rows 2c + 8 j + {0, 1} of column g; D's element e row g + 8 (e / 2), column
 * 2c + e % 2. Each lane rebuilds A and B from every lane's registers and computes its four
 * elements, in fp32. */
inline void mma_bf16(float d[4], const uint32_t a[4], const uint32_t b[2])
{
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int set = next_slots();
  memcpy(g_lane_a[set][w][lane], a, sizeof g_lane_a[set][w][lane]);
  memcpy(g_lane_b[set][w][lane], b, sizeof g_lane_b[set][w][lane]);
  warp_sync();
  auto A = [&](int r, int k) {
    return bf16_value(g_lane_a[set][w][(r % 8) * 4 + (k % 8) / 2][r / 8 + 2 * (k / 8)], k % 2);
  };
  auto B = [&](int k, int n) {
    return bf16_value(g_lane_b[set][w][n * 4 + (k % 8) / 2][k / 8], k % 2);
  };
  for (int e = 0; e < 4; e++) {
    const int r = g + 8 * (e / 2), n = 2 * c + e % 2;
    float acc = d[e];
    for (int k = 0; k < 16; k++)
      acc += A(r, k) * B(k, n);
    d[e] = acc;
  }
}

/* ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16 from the PTX ISA: lane l gives the address of
 * row l % 8 of matrix l / 8, 16 bytes in the dynamic shared memory, 16-byte aligned (else the
 * emulation dies, as the GPU would fault); register j of lane (g, c) gets matrix j's elements
 * (g, 2c) and (g, 2c + 1) in its low and high halves, transposed (2c, g) and (2c + 1, g). */
inline void ldmatrix_x4(uint32_t r[4], const uint16_t *row, bool trans)
{
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const char *p = (const char *)row, *smem = (const char *)g_smem;
  if ((uintptr_t)p % 16 != 0 || p < smem || p + 16 > smem + g_smem_bytes)
    dt_emul::die("ldmatrix: a row address outside the shared memory or not 16-byte aligned");
  const int set = next_slots();
  g_lane_row[set][w][lane] = row;
  warp_sync();
  for (int j = 0; j < 4; j++) {
    const uint16_t *const *rows = g_lane_row[set][w] + 8 * j;
    const uint16_t lo = trans ? rows[2 * c][g] : rows[g][2 * c];
    const uint16_t hi = trans ? rows[2 * c + 1][g] : rows[g][2 * c + 1];
    r[j] = (uint32_t)lo | (uint32_t)hi << 16;
  }
}

/* movmatrix.sync.aligned.m8n8.trans.b16 from the PTX ISA: the warp holds an 8 x 8 matrix of
 * 16-bit values, lane (g, c) its elements (g, 2c) and (g, 2c + 1) in register x's low and high
 * halves; the result of lane (g, c) holds elements (2c, g) and (2c + 1, g). */
inline uint32_t movmatrix_t(uint32_t x)
{
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int set = next_slots();
  g_lane_v[set][w][lane] = (double)x; /* 32 bits travel exactly */
  warp_sync();
  auto at = [&](int r, int col) { /* element (r, col) of the matrix */
                                  return (uint32_t)g_lane_v[set][w][4 * r + col / 2] >>
                                             (16 * (col % 2)) &
                                         0xffffu;
  };
  return at(2 * c, g) | at(2 * c + 1, g) << 16;
}

/* ---- Hopper's warpgroup MMA (kernels/cuda/wgmma.cuh) from the PTX ISA ------------------------ */

/* The dynamic shared memory's address in the shared window: not a multiple of 1024 (on a GPU,
 * static shared memory may come first), so a kernel must align its swizzled tiles itself. */
inline const uint32_t g_smem_base = 0x230;

inline uint32_t smem_addr(const void *p)
{
  const char *q = (const char *)p, *smem = (const char *)g_smem;
  if (q < smem || q > smem + g_smem_bytes)
    dt_emul::die("a shared address of a pointer outside the dynamic shared memory");
  return g_smem_base + (uint32_t)(q - smem);
}

/* Element (mn, k) of a wgmma operand (A: mn = row of M; B: mn = column of N) of 16-wide K from
 * its descriptor: 128-byte swizzle only (the XOR of address bits 4-6 with 7-9), K-major or
 * (trans) MN-major, as wgmma.cuh describes the canonical layouts. */
inline float wgmma_elem(uint64_t desc, bool trans, int mn, int k)
{
  if (desc >> 62 != 1 || (desc >> 49 & 7u) != 0)
    dt_emul::die("wgmma: a descriptor other than 128-byte swizzle at base offset 0");
  const uint32_t start = (uint32_t)(desc & 0x3fffu) << 4,
                 lbo = (uint32_t)(desc >> 16 & 0x3fffu) << 4,
                 sbo = (uint32_t)(desc >> 32 & 0x3fffu) << 4;
  const uint32_t m = (uint32_t)mn, kk = (uint32_t)k;
  uint32_t a = trans
                   ? start + m % 8 * 2 + m / 8 % 8 * 16 + m / 64 * lbo + kk % 8 * 128 + kk / 8 * sbo
                   : start + m % 8 * 128 + m / 8 * sbo + kk / 8 * 16 + kk % 8 * 2;
  a ^= (a >> 7 & 7u) << 4;
  if (a < g_smem_base || a + 2 > g_smem_base + g_smem_bytes)
    dt_emul::die("wgmma: an operand element outside the dynamic shared memory");
  if (dt_emul::g_async_owner[(a - g_smem_base) / 16])
    dt_emul::die("wgmma: an operand in shared memory that cp.async wrote and its thread has not "
                 "published to the async proxy (its wait, then fence.proxy.async, then a barrier)");
  uint16_t v;
  memcpy(&v, (const char *)g_smem + (a - g_smem_base), sizeof v);
  return bf16_value(v, 0);
}

/* Registers p (bytes) as a product of this thread uses them: what wgmma_regs recorded of them,
 * or now recorded. */
inline void wgmma_regs_use(const void *p, size_t bytes)
{
  std::vector<dt_emul::wgmma_regs> &mine = dt_emul::g_wgmma_regs[threadIdx.x];
  for (const dt_emul::wgmma_regs &r : mine)
    if (r.p == p && r.bytes == bytes) {
      if (memcmp(r.seen, p, bytes) != 0)
        dt_emul::die("wgmma: a product's registers (accumulators or A) written by other "
                     "instructions since the thread's last wgmma.fence (DT_WGMMA_FENCE)");
      return;
    }
  mine.push_back({p, bytes, {}});
  memcpy(mine.back().seen, p, bytes);
}

/* A byte copy that may read registers gone out of scope (the fence's record of every tile the
 * thread's products used): only compared with them if they come back, so no sanitizer error. */
__attribute__((noinline, no_sanitize_address)) inline void
wgmma_regs_copy(unsigned char *to, const void *p, size_t bytes)
{
  const volatile unsigned char *q = (const volatile unsigned char *)p;
  for (size_t i = 0; i < bytes; i++)
    to[i] = q[i];
}

/* This thread's next wgmma instruction: the one its warpgroup's other threads executed there. */
inline void wgmma_aligned(const dt_emul::wgmma_step &e)
{
  std::vector<dt_emul::wgmma_step> &v = dt_emul::g_wgmma_steps[threadIdx.x / 128];
  const size_t i = dt_emul::g_wgmma_stepped[threadIdx.x]++;
  if (i == v.size())
    v.push_back(e);
  else if (!(v[i] == e))
    dt_emul::die("wgmma: the threads of a warpgroup disagree on an instruction (.sync.aligned: "
                 "each executes the same ones with the same operands)");
}

/* wgmma.fence: this thread's registers may be used by products as they now are. */
inline void wgmma_fence(void)
{
  wgmma_aligned({0, 0, 0, false, false, false, 0, 0});
  dt_emul::g_wgmma_fences[threadIdx.x]++;
  for (dt_emul::wgmma_regs &r : dt_emul::g_wgmma_regs[threadIdx.x])
    wgmma_regs_copy(r.seen, r.p, r.bytes);
}

/* wgmma.mma_async m64n64k16 bf16 -> f32 (a NULL: A from the descriptor da): queued. A warp's lanes
 * meet here when A comes from registers, to exchange their fragments. */
inline void wgmma_issue(float d[32], const uint32_t *a, uint64_t da, uint64_t db, int scale_d,
                        bool ta, bool tb)
{
  wgmma_aligned({1, scale_d != 0, 0, a != NULL, ta, tb, da, db});
  if (dt_emul::g_wgmma_fences[threadIdx.x] == 0)
    dt_emul::die("wgmma: a product before its thread's first wgmma.fence (DT_WGMMA_FENCE)");
  wgmma_regs_use(d, 32 * sizeof *d);
  if (a)
    wgmma_regs_use(a, 4 * sizeof *a);
  dt_emul::wgmma_op op = {d, {}, a != NULL, ta, tb, da, db, scale_d, 0, a, {}};
  if (a) {
    memcpy(op.a_issued, a, sizeof op.a_issued);
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    const int set = next_slots();
    memcpy(g_lane_a[set][w][lane], a, sizeof g_lane_a[set][w][lane]);
    warp_sync();
    for (int h = 0; h < 2; h++)
      for (int k = 0; k < 16; k++)
        op.a[h][k] = bf16_value(g_lane_a[set][w][g * 4 + (k % 8) / 2][h + 2 * (k / 8)], k % 2);
  }
  op.group = dt_emul::g_wgmma_groups[threadIdx.x];
  const std::vector<float *> &unfenced = dt_emul::g_wgmma_unfenced[threadIdx.x];
  if (std::find(unfenced.begin(), unfenced.end(), d) != unfenced.end())
    dt_emul::die("wgmma: a product on accumulators not fenced since the wait that completed them "
                 "(dt_wgmma_fence_acc)");
  dt_emul::g_wgmma[threadIdx.x].push_back(op);
}

/* dt_wgmma_fence_acc: d's values may be used from here on. */
inline void wgmma_fence_acc(float *d)
{
  std::vector<float *> &unfenced = dt_emul::g_wgmma_unfenced[threadIdx.x];
  unfenced.erase(std::remove(unfenced.begin(), unfenced.end(), d), unfenced.end());
}

inline void wgmma_commit(void)
{
  wgmma_aligned({2, 0, 0, false, false, false, 0, 0});
  dt_emul::g_wgmma_groups[threadIdx.x]++;
}

/* wgmma.wait_group n: the products of every committed group but the n newest run now, in issue
 * order, each thread computing its own 32 elements of D in fp32. */
inline void wgmma_wait(unsigned n)
{
  wgmma_aligned({3, 0, (int)n, false, false, false, 0, 0});
  std::vector<dt_emul::wgmma_op> &mine = dt_emul::g_wgmma[threadIdx.x];
  const unsigned committed = dt_emul::g_wgmma_groups[threadIdx.x];
  const int w = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  size_t done = 0;
  for (; done < mine.size() && mine[done].group + n < committed; done++) {
    const dt_emul::wgmma_op &op = mine[done];
    if (op.a_regs && memcmp(op.a_src, op.a_issued, sizeof op.a_issued) != 0)
      dt_emul::die("wgmma: a product's A registers changed before the wait that covers it");
    for (int i = 0; i < 32; i++) {
      const int r = 16 * w + g + 8 * (i / 2 % 2), col = 8 * (i / 4) + 2 * c + i % 2;
      float acc = op.scale_d ? op.d[i] : 0.0f;
      for (int k = 0; k < 16; k++)
        acc += (op.a_regs ? op.a[i / 2 % 2][k] : wgmma_elem(op.da, op.ta, r, k)) *
               wgmma_elem(op.db, op.tb, col, k);
      op.d[i] = acc;
    }
    for (dt_emul::wgmma_regs &r : dt_emul::g_wgmma_regs[threadIdx.x])
      if (r.p == op.d)
        memcpy(r.seen, op.d, r.bytes);
    std::vector<float *> &unfenced = dt_emul::g_wgmma_unfenced[threadIdx.x];
    if (std::find(unfenced.begin(), unfenced.end(), op.d) == unfenced.end())
      unfenced.push_back(op.d);
  }
  mine.erase(mine.begin(), mine.begin() + (ptrdiff_t)done);
}

/* cp.async (16 bytes, zeros where !ok) and cp.async.wait_all. On the GPU a copy lands at some
 * time between its issue and its thread's wait, and the other threads see it after a barrier
 * that follows the wait. The emulation takes the two extremes, one per run: by default a copy
 * lands only at the first block barrier after its thread's wait, so a tile read before that wait
 * or that barrier reads the bytes of before; with dt_emul::g_cp_early it lands as it is issued,
 * so a tile overwritten by copies while other threads still read it is seen as such. A kernel
 * right under both is right in between. (The default is stricter than the GPU in one way: a
 * thread does not see its own copies between its wait and the barrier.) A copy never waited for,
 * or waited for with no barrier after it, aborts at the block's end. The destination must be 16
 * bytes of the dynamic shared memory, 16-byte aligned, and the source 16-byte aligned, or the
 * emulation dies (the GPU would fault). */
inline void cp_async16(void *dst, const void *src, bool ok)
{
  const char *d = (const char *)dst, *smem = (const char *)g_smem;
  if ((uintptr_t)d % 16 != 0 || d < smem || d + 16 > smem + g_smem_bytes)
    dt_emul::die("cp.async: a destination outside the shared memory or not 16-byte aligned");
  if (ok && (uintptr_t)src % 16 != 0)
    dt_emul::die("cp.async: a source not 16-byte aligned");
  const dt_emul::cp_copy c = {dst, src, ok, threadIdx.x, false};
  if (dt_emul::g_cp_early)
    dt_emul::cp_land(c);
  dt_emul::g_cp_async[threadIdx.x].push_back(c);
}

inline void cp_async_wait_all(void)
{
  std::vector<dt_emul::cp_copy> &mine = dt_emul::g_cp_async[threadIdx.x];
  dt_emul::g_cp_waited.insert(dt_emul::g_cp_waited.end(), mine.begin(), mine.end());
  mine.clear();
}

/* fence.proxy.async.shared::cta: this thread's copies that it has waited for are published to
 * the async proxy (those still in flight are not). */
inline void fence_proxy_async(void)
{
  const unsigned t = threadIdx.x;
  for (dt_emul::cp_copy &c : dt_emul::g_cp_waited)
    c.fenced = c.fenced || c.t == t;
  const std::vector<dt_emul::cp_copy> &pending = dt_emul::g_cp_async[t];
  std::vector<size_t> &mine = dt_emul::g_unpublished[t], keep;
  for (size_t i : mine) {
    if (dt_emul::g_async_owner[i] != t + 1)
      continue; /* written again since */
    bool in_flight = false;
    for (const dt_emul::cp_copy &c : pending)
      in_flight = in_flight || dt_emul::smem_chunk(c.dst) == i;
    if (in_flight)
      keep.push_back(i);
    else
      dt_emul::g_async_owner[i] = 0;
  }
  mine.swap(keep);
}

/* ---- Intrinsics: IEEE single operations, each rounded on its own (the suite is compiled with
 * -ffp-contract=off, so none is fused into an FMA); bf16 as its 16 bits ------------------------ */

inline float __fadd_rn(float a, float b)
{
  return a + b;
}
inline float __fmul_rn(float a, float b)
{
  return a * b;
}
inline float __fdiv_rn(float a, float b)
{
  return a / b;
}
inline float __fsqrt_rn(float a)
{
  return sqrtf(a);
}

#ifndef __CUDA_BF16_H__ /* without cuda_bf16.h: its type and conversions */
struct __nv_bfloat16 {
  uint16_t x;
};

/* x rounded to bf16, to nearest even (NaN stays NaN), as cuda_bf16.h's intrinsic */
inline __nv_bfloat16 __float2bfloat16_rn(float x)
{
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{(uint16_t)(u >> 16)};
}

inline float __bfloat162float(__nv_bfloat16 h)
{
  const uint32_t u = (uint32_t)h.x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
#endif

using std::max;
using std::min;
#undef __global__ /* the CUDA headers' (empty for a host compiler) */
#undef __device__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __device__
#define __shared__ static
#define __launch_bounds__(...)
#define DT_DYNAMIC_SMEM(name)                 float *name = g_smem
#define DT_MMA_BF16(d, a, b)                  mma_bf16(d, a, b)
#define DT_LDMATRIX_X4(r, row, trans)         ldmatrix_x4(r, row, trans)
#define DT_MOVMATRIX_T(x)                     movmatrix_t(x)
#define DT_SHFL_XOR(v, m)                     __shfl_xor_sync(0xffffffffu, v, m)
#define DT_CP_ASYNC16(dst, src, ok)           cp_async16(dst, src, ok)
#define DT_CP_ASYNC_WAIT_ALL()                cp_async_wait_all()
#define DT_SMEM_ADDR(p)                       smem_addr(p)
#define DT_WGMMA_SS(d, da, db, scale, ta, tb) wgmma_issue(d, NULL, da, db, scale, ta, tb)
#define DT_WGMMA_RS(d, a, db, scale, tb)      wgmma_issue(d, a, 0, db, scale, false, tb)
#define DT_WGMMA_FENCE()                      wgmma_fence()
#define DT_WGMMA_COMMIT()                     wgmma_commit()
#define DT_WGMMA_WAIT(n)                      wgmma_wait(n)
#define DT_WGMMA_FENCE_ACC(d)                 wgmma_fence_acc(d)
#define DT_FENCE_PROXY_ASYNC()                fence_proxy_async()

/* Runs body once per thread of every block of grid, as kernel<<<grid, threads, smem>>>. */
template <typename F> inline void launch(dim3 grid, unsigned threads, size_t smem_bytes, F body)
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
  for (unsigned z = 0; z < grid.z; z++)
    for (unsigned y = 0; y < grid.y; y++)
      for (unsigned x = 0; x < grid.x; x++) {
        blockIdx = dim3(x, y, z);
        g_smem = (float *)malloc(smem_bytes ? smem_bytes : 1);
        g_smem_bytes = smem_bytes;
        dt_emul::g_async_owner.assign(smem_bytes / 16 + 1, 0);
        for (unsigned t = 0; t < threads; t++)
          dt_emul::g_unpublished[t].clear();
        if (!g_smem)
          dt_emul::die("no memory for the dynamic shared memory");
        memset(g_smem, 0xff, smem_bytes); /* NaN as a float and as a bf16 */
        dt_emul::run_block(threads);
        free(g_smem);
        g_smem = NULL;
      }
}

#endif
