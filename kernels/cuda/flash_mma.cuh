/* flash_mma.cuh — flash attention on the tensor cores: bf16 mma.sync.m16n8k16 with fp32
 * accumulation (sm_80 and later). The forward is flash.cuh's online softmax; the backward (no
 * atomics) is a D kernel (D = dout . out per query row), a dk/dv kernel that also stores the
 * score gradients dS as bf16 tiles in a workspace, then a dq kernel of one product, dq = dS K
 * (flash.cuh's fp32 dq kernel recomputes S and dP instead: two products more).
 *
 * Numerics (what "bf16 attention" means here, as PyTorch's autocast SDPA): q, k, v are bf16
 * (qkv is the bf16 output of the qkv layer) and dout is rounded to bf16 (nearest even) when a
 * tile is loaded, or is bf16 already (the attention projection's bf16 input gradient); every
 * product is a bf16 mma with fp32 accumulation; the softmax (max, exp, sums, lse) is fp32, its
 * exponentials 2^x of one FMA each (fmma_exp2: the CPU's e^x in another form, a few ulps off); the
 * probabilities P and the score gradients dS are rounded to bf16 as the operands of the second
 * product of each pass (P V, dS K, P^T dO, dS^T Q); D = dout . out is fp32 from dout's values
 * (fp32 or bf16) and out's bf16 ones. out is rounded to bf16 as it is stored, lse is fp32, and the
 * gradients are fp32 added into a context-parallel buffer, else rounded to bf16 as they are stored
 * (G = uint16_t); autocast's SDPA returns out and the gradients in bf16.
 *
 * Layout: a block is FMMA_WARPS warps; each warp owns 16 rows of the block's 64 (key rows in
 * the dk/dv kernel; the forward's and the dq kernel's warps own FMMA_MT tiles of 16 query rows:
 * 32 of 128 at head sizes up to 64) and streams 64-row tiles of the
 * other side through shared memory, which holds every operand as bf16 rows of FMMA_LD(HSM)
 * elements (head size padded with zeros to the bucket HSM, plus 8 against bank conflicts),
 * copied from q, k, v (and a bf16 dout) by cp.async and converted from an fp32 dout with 16-byte
 * loads. The copies of the next tile are in flight while the current one is used (the forward
 * alternates its K and V tiles, the backward kernels double-buffer theirs), and the causal mask
 * is applied only to the tiles that cross the diagonal. Each pass is two warp-wide
 * products: the scores (fmma_abt: S = Q K^T, its A and B operands read from the tiles with
 * ldmatrix), then the product of the probabilities (fmma_pv: P V), whose A operand P never leaves
 * the registers: mma's C layout of S, rounded to bf16 and packed in pairs, is the A layout of P
 * (fmma_frag_p), and V's B operand comes through the transposing ldmatrix. Each lane's accumulator
 * element acc[nt][e] is row g + 8 (e / 2), column 8 nt + 2 c + e % 2 of C (g = lane / 4, c = lane %
 * 4: mma's layout).
 *
 * Portability: the kernels use only the CUDA thread model plus six primitives the includer
 * may replace (tests/unit/test_flash_emul.cc runs them on the host): DT_MMA_BF16 (the mma),
 * DT_LDMATRIX_X4 (ldmatrix, plain or transposing), DT_MOVMATRIX_T (movmatrix.trans), DT_SHFL_XOR
 * (a float butterfly within the warp), DT_CP_ASYNC16 and DT_CP_ASYNC_WAIT_ALL (cp.async and its
 * wait). */
#ifndef DT_KERNELS_CUDA_FLASH_MMA_CUH
#define DT_KERNELS_CUDA_FLASH_MMA_CUH

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#include <cuda_bf16.h>
#endif

#ifndef DT_DYNAMIC_SMEM
#define DT_DYNAMIC_SMEM(name) extern __shared__ float name[]
#endif

#ifndef DT_MMA_BF16
/* d = a b + d for one m16n8k16 tile (a: 4 registers of 2 bf16, b: 2, d: 4 floats). */
__device__ static inline void dt_mma_bf16(float d[4], const uint32_t a[4], const uint32_t b[2])
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap(); /* attention.cu launches these kernels on sm_80 and later only */
#endif
}

/* ldmatrix.m8n8.x4 (trans: .trans) of the 16-bit shared-memory rows the lanes address. */
__device__ static inline void dt_ldmatrix_x4(uint32_t r[4], const uint16_t *row, bool trans)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(row);
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#else
  (void)r, (void)row, (void)trans;
  __trap();
#endif
}

/* movmatrix.m8n8.trans.b16: the transpose of the 8 x 8 matrix of 16-bit values the warp holds
 * in mma's layout (register x of lane (g, c): elements (g, 2c), (g, 2c + 1)); lane (g, c) gets
 * elements (2c, g), (2c + 1, g). */
__device__ static inline uint32_t dt_movmatrix_t(uint32_t x)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
#else
  (void)x;
  __trap();
  return 0u;
#endif
}

/* cp.async of 16 bytes from global src to shared dst (16-byte aligned both), or 16 zero bytes
 * where !ok (a source size of 0: src is not read); cp.async.wait_all: the calling thread's
 * copies have landed (other threads see them after a barrier). */
__device__ static inline void dt_cp_async16(void *dst, const void *src, bool ok)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0)
               : "memory");
#else
  (void)dst, (void)src, (void)ok;
  __trap();
#endif
}

__device__ static inline void dt_cp_async_wait_all(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#else
  __trap();
#endif
}
#define DT_MMA_BF16(d, a, b)          dt_mma_bf16(d, a, b)
#define DT_LDMATRIX_X4(r, row, trans) dt_ldmatrix_x4(r, row, trans)
#define DT_MOVMATRIX_T(x)             dt_movmatrix_t(x)
#define DT_SHFL_XOR(v, m)             __shfl_xor_sync(0xffffffffu, v, m)
#define DT_CP_ASYNC16(dst, src, ok)   dt_cp_async16(dst, src, ok)
#define DT_CP_ASYNC_WAIT_ALL()        dt_cp_async_wait_all()
#endif

#define FMMA_WARPS   4
#define FMMA_THREADS (32 * FMMA_WARPS)
#define FMMA_ROWS    (16 * FMMA_WARPS) /* the block's own rows, and the rows of a streamed tile */
#define FMMA_LD(HSM) ((HSM) + 8)       /* row length of a shared operand tile */
#define FMMA_DS_TILE (FMMA_ROWS * FMMA_ROWS) /* values in a tile of dS (the workspace's, below) */
/* The blocks an SM is to hold at once, the launch bounds' second argument: n64 at head sizes up
 * to 64 (GPT-2's), n128 above. ptxas (sm_90, CUDA 13) then keeps the forward kernel within 168
 * registers a thread at hs 64 (3 blocks of 37 KiB of shared memory; its two row tiles a warp),
 * the dq and dk/dv kernels within 128 (4 blocks: their double-buffered tiles take 54 and 55 KiB;
 * dk/dv spills 12-20 bytes); at hs 128 the forward in 159 (3 blocks), the dq kernel in 158 (3
 * blocks of 52 KiB) and the dk/dv kernel in 242-253 (2 blocks of 102 KiB). The warps of the other
 * blocks hide what the tiles' copies and barriers leave. */
#define FMMA_MIN_BLOCKS(HSM, n64, n128) ((HSM) <= 64 ? (n64) : (n128))
/* The forward and dq kernels' row tiles a warp (FA2's layout at hs 64): each K and V fragment
 * read from shared memory then serves FMMA_MT 16-row tiles, half the shared-memory reads an mma
 * of one (which at 64 rows a block took about as long as the mma themselves); at hs 128 the
 * forward's accumulators of two would not fit the registers. The block's query rows: 64 FMMA_MT. */
#define FMMA_MT(HSM) ((HSM) <= 64 ? 2 : 1)

/* Shared memory (bytes): `tiles` operand tiles and `floats` floats. The forward kernel: q, k
 * and v; dq: k and its FMMA_MT dS tiles (FMMA_DS_TILE values), twice (double buffered);
 * dk/dv: k, v, and q, dout and the tile's lse and D twice; the recomputing dq kernel: q, dout,
 * and k and v twice (fmma_smem_bytes<HSM>(6, 0)). */
template <int HSM> static constexpr size_t fmma_smem_bytes(int tiles, int floats)
{
  return (size_t)tiles * FMMA_ROWS * FMMA_LD(HSM) * 2 + (size_t)floats * sizeof(float);
}

template <int HSM> static constexpr size_t fmma_fwd_smem_bytes(void)
{
  return fmma_smem_bytes<HSM>(FMMA_MT(HSM) + 2, 0);
}

template <int HSM> static constexpr size_t fmma_dq_smem_bytes(void)
{
  return 2 * (fmma_smem_bytes<HSM>(1, 0) + FMMA_MT(HSM) * FMMA_DS_TILE * sizeof(uint16_t));
}

template <int HSM> static constexpr size_t fmma_dkdv_smem_bytes(void)
{
  return fmma_smem_bytes<HSM>(6, 4 * FMMA_ROWS);
}

/* Blocks of the dk/dv kernel (FMMA_ROWS rows each), and of the forward and dq kernels. */
static inline unsigned fmma_blocks(int rows)
{
  return (unsigned)((rows + FMMA_ROWS - 1) / FMMA_ROWS);
}

template <int HSM> static inline unsigned fmma_mt_blocks(int rows)
{
  return (unsigned)((rows + FMMA_ROWS * FMMA_MT(HSM) - 1) / (FMMA_ROWS * FMMA_MT(HSM)));
}

/* ---- The backward's workspace: D (B NH Tq floats), then the score gradients dS in bf16 tiles
 * of 64 query rows x 64 keys (FMMA_DS_TILE values), which the dk/dv kernel of key block kb writes
 * for each query tile qt (of 64 chunk rows) it reaches: qt from
 * max(0, kb - a), a = ceil(q0 / 64), to nqt - 1 (the tile holding position 64 kb, the diagonal's,
 * on). A (b, h) has FMMA_DS_BEFORE(nkb, nqt, a) tiles, ordered by kb then qt; the dq kernel of
 * query tile qt reads tile (kb, qt) for every key block up to its last row. The tiles of a group
 * of sequences (or, where one sequence's do not fit, of heads) at a time stay within max_bytes
 * (FMMA_DS_MAX_BYTES by default): at GPT-2 124M's T 1024, 136 tiles of 8 KiB a head, 1.7 GB for
 * batch 128, so two groups. Past T 32768 one head's tiles (T^2 bytes) do not fit, and the dq
 * kernel recomputes the scores instead (fmma_backward_dq_recompute_kernel). A tile is in the dq
 * kernel's operand order: 16 chunks of 16 query rows x 16 keys, chunk FMMA_DS_CHUNK(qb, kb) for
 * rows 16 qb.. and keys 16 kb.., each the A operand of one mma as the warp holds it, lane l's four
 * registers at 8 l: the dk/dv kernel stores them and the dq kernel reads them 16 bytes a lane,
 * 512 contiguous bytes a warp, with no ldmatrix. ---- */
#define FMMA_DS_MAX_BYTES     ((size_t)1 << 30)
#define FMMA_DS_CHUNK(qb, kb) ((FMMA_ROWS / 16 * (qb) + (kb)) * 16 * 16)
/* The tiles of one (b, h) before key block kb's: kb nqt less the query tiles the key blocks
 * before it skip (block k's first tile is max(0, k - a)). A macro: host and device code use it. */
#define FMMA_DS_BEFORE(kb, nqt, a)                                                                 \
  ((size_t)(kb) * (size_t)(nqt) -                                                                  \
   ((kb) > (a) ? (size_t)((kb) - (a)) * (size_t)((kb) - (a)-1) / 2 : (size_t)0))

/* A backward's workspace: D at its start, the tiles from ds_offset (256-byte aligned), `seqs`
 * sequences times `heads` heads at a time (the last groups may be smaller; heads 0: no tiles, the
 * dq kernel recomputes), bytes in all. */
struct fmma_ws_plan {
  size_t ds_offset, bytes;
  int seqs, heads;
};

static inline fmma_ws_plan fmma_backward_ws(int B, int Tq, int q0, int NH,
                                            size_t max_bytes = FMMA_DS_MAX_BYTES)
{
  const int nqt = (Tq + FMMA_ROWS - 1) / FMMA_ROWS, nkb = (q0 + Tq + FMMA_ROWS - 1) / FMMA_ROWS;
  const int a = (q0 + FMMA_ROWS - 1) / FMMA_ROWS;
  const size_t per_h = FMMA_DS_BEFORE(nkb, nqt, a) * FMMA_DS_TILE * sizeof(uint16_t);
  fmma_ws_plan p;
  p.ds_offset = ((size_t)B * NH * Tq * sizeof(float) + 255) / 256 * 256;
  p.seqs = 1, p.heads = 0;
  if (per_h > max_bytes) { /* not one head: recompute */
    p.seqs = B;
  } else if ((size_t)NH * per_h <= max_bytes) { /* whole sequences, in balanced groups */
    const size_t groups = ((size_t)B * NH * per_h + max_bytes - 1) / max_bytes;
    p.seqs = (int)(((size_t)B + groups - 1) / groups), p.heads = NH;
  } else { /* one sequence's heads, in balanced groups */
    const size_t groups = ((size_t)NH * per_h + max_bytes - 1) / max_bytes;
    p.heads = (int)(((size_t)NH + groups - 1) / groups);
  }
  p.bytes = p.ds_offset + (size_t)p.seqs * p.heads * per_h;
  return p;
}

/* The first query row of the forward and dq kernels' block of `rows` rows: the last rows' blocks
 * first, as they have the most keys to stream and a grid's blocks start in order of blockIdx (the
 * dk/dv kernel's first key blocks, the busiest there, already come first). */
__device__ static inline int fmma_query_block_row(int rows)
{
  return (int)(gridDim.x - 1 - blockIdx.x) * rows;
}

/* x rounded to bf16, to nearest even (NaN stays NaN): dt_bf16_round's rule. */
__device__ static inline uint16_t fmma_bf16(float x)
{
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* The value of an fp32 x, and of bf16 bits x. */
__device__ static inline float fmma_f32(float x)
{
  return x;
}

__device__ static inline float fmma_f32(uint16_t x)
{
  const uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* lo and hi rounded to bf16 (fmma_bf16's rule; on the GPU one conversion instruction, whose NaN
 * may carry another payload), packed as an mma register holds them: lo in the low half. */
__device__ static inline uint32_t fmma_pack2(float lo, float hi)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, sizeof u);
  return u;
#else
  return (uint32_t)fmma_bf16(lo) | (uint32_t)fmma_bf16(hi) << 16;
#endif
}

/* ---- Operands: ldmatrix's 8 x 8 matrices of 16-bit values, lane l giving the address of row
 * l % 8 of matrix l / 8; register j of lane (g, c) gets matrix j's elements (g, 2c), (g, 2c + 1),
 * or transposed (2c, g), (2c + 1, g). Every address is a row start plus a multiple of 8 columns
 * of a tile whose rows are multiples of 16 bytes long: 16-byte aligned, as ldmatrix needs. -- */

/* The calling warp's A operand: rows 0..15, columns 0..15 of the row-major tile t (row length
 * ld). Matrices (rows 0-7, columns 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15): A's registers. */
__device__ static inline void fmma_frag_a(uint32_t a[4], const uint16_t *t, int ld)
{
  const int lane = threadIdx.x % 32, j = lane / 8;
  DT_LDMATRIX_X4(a, t + (lane % 8 + 8 * (j % 2)) * ld + 8 * (j / 2), false);
}

/* The B operands of two adjacent 8-column tiles (b[0..1] columns 0..7, b[2..3] 8..15), k 0..15:
 * with rows_are_n B(k, n) = t[n * ld + k] (K^T of a row-major K), else B(k, n) = t[k * ld + n]
 * (a row-major V, through the transposing load). */
__device__ static inline void fmma_frag_b(uint32_t b[4], const uint16_t *t, int ld, bool rows_are_n)
{
  const int lane = threadIdx.x % 32, j = lane / 8, n = 8 * (j / 2), k = 8 * (j % 2);
  if (rows_are_n)
    DT_LDMATRIX_X4(b, t + (n + lane % 8) * ld + k, false);
  else
    DT_LDMATRIX_X4(b, t + (k + lane % 8) * ld + n, true);
}

/* acc (MT tiles of 16 x 8 NT, mma's C layout; tile mt at acc[NT mt]) += A_mt B^T for the calling
 * warp: A_mt the 16 rows of tile a from row 16 mt, B^T the 8 NT rows of tile b, over HSM columns
 * (the scores Q K^T, dO V^T, K Q^T, V dO^T); each B fragment is read once for the MT row tiles. */
template <int HSM, int NT, int MT = 1>
__device__ static void fmma_abt(float (*acc)[4], const uint16_t *a, const uint16_t *b)
{
  constexpr int LD = FMMA_LD(HSM);
#pragma unroll
  for (int ks = 0; ks < HSM / 16; ks++) {
    uint32_t af[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
      fmma_frag_a(af[mt], a + 16 * mt * LD + 16 * ks, LD);
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t bf[4];
      fmma_frag_b(bf, b + 8 * nt * LD + 16 * ks, LD, true);
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        DT_MMA_BF16(acc[NT * mt + nt], af[mt], bf);
        DT_MMA_BF16(acc[NT * mt + nt + 1], af[mt], bf + 2);
      }
    }
  }
}

/* A operands from registers: p (16 x 16 KS in mma's C layout, fmma_abt's output) rounded to
 * bf16. C tiles 2 ks and 2 ks + 1 hold k-slice ks: (row g, columns 2c, 2c + 1), (g + 8, ...), then
 * the same 8 columns on: A's four registers, in order. */
template <int KS> __device__ static inline void fmma_frag_p(uint32_t (*pa)[4], const float (*p)[4])
{
#pragma unroll
  for (int ks = 0; ks < KS; ks++)
#pragma unroll
    for (int j = 0; j < 4; j++)
      pa[ks][j] = fmma_pack2(p[2 * ks + j / 2][2 * (j % 2)], p[2 * ks + j / 2][2 * (j % 2) + 1]);
}

/* acc (MT tiles of 16 x HSM, tile mt at acc[HSM / 8 mt]) += P_mt V for the calling warp: P_mt
 * (16 x 16 KS) the register operands pa[KS mt ..] (fmma_frag_p), V the 16 KS rows of HSM columns
 * of tile v, each of its fragments read once for the MT tiles: P V, dS K, P^T dO, dS^T Q. */
template <int HSM, int KS, int MT = 1>
__device__ static void fmma_pv(float (*acc)[4], const uint32_t (*pa)[4], const uint16_t *v)
{
  constexpr int LD = FMMA_LD(HSM), NO = HSM / 8;
#pragma unroll
  for (int ks = 0; ks < KS; ks++)
#pragma unroll
    for (int nt = 0; nt < NO; nt += 2) {
      uint32_t bf[4];
      fmma_frag_b(bf, v + 16 * ks * LD + 8 * nt, LD, false);
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        DT_MMA_BF16(acc[NO * mt + nt], pa[KS * mt + ks], bf);
        DT_MMA_BF16(acc[NO * mt + nt + 1], pa[KS * mt + ks], bf + 2);
      }
    }
}

/* Off the GPU (the emulation, whose cuda_emul.h comes first), a vector access at an address
 * not a multiple of its size aborts, as it would fault on the GPU: x86 would let it pass. */
#ifdef __CUDACC__
#define FMMA_ALIGNED(p, bytes) ((void)0)
#else
#define FMMA_ALIGNED(p, bytes)                                                                     \
  ((uintptr_t)(p) % (bytes) ? dt_emul::die("a " #bytes "-byte vector access, misaligned") : (void)0)
#endif

/* v = the 16 bytes at p (16-byte aligned, in global or shared memory) in one load, as 4 values
 * of 4 bytes (fp32 values, or registers of bf16 pairs); q[0..3] = the 8-byte aligned bf16 pairs
 * lo, hi in one store. */
template <typename T> __device__ static inline void fmma_get16(T v[4], const void *p)
{
  static_assert(sizeof(T) == 4, "4 values of 4 bytes");
  FMMA_ALIGNED(p, 16);
#ifdef __CUDACC__
  const uint4 x = *(const uint4 *)p;
  memcpy(v, &x, 16);
#else
  memcpy(v, p, 16);
#endif
}

__device__ static inline void fmma_store4(uint16_t *q, uint32_t lo, uint32_t hi)
{
  FMMA_ALIGNED(q, 8);
#ifdef __CUDACC__
  *(uint2 *)q = make_uint2(lo, hi);
#else
  memcpy(q, &lo, sizeof lo);
  memcpy(q + 2, &hi, sizeof hi);
#endif
}

/* The 16 bytes at p (16-byte aligned), or zeros where !ok, as bf16 values at q: 4 fp32 values
 * rounded (8 bytes stored), or 8 bf16 values as they are (16 bytes). */
__device__ static inline void fmma_move16(uint16_t *q, const float *p, bool ok)
{
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (ok)
    fmma_get16(v, p);
  fmma_store4(q, fmma_pack2(v[0], v[1]), fmma_pack2(v[2], v[3]));
}

__device__ static inline void fmma_move16(uint16_t *q, const uint16_t *p, bool ok)
{
  FMMA_ALIGNED(q, 16);
  if (ok)
    FMMA_ALIGNED(p, 16);
#ifdef __CUDACC__
  *(uint4 *)q = ok ? *(const uint4 *)p : make_uint4(0u, 0u, 0u, 0u);
#else
  if (ok)
    memcpy(q, p, 16);
  else
    memset(q, 0, 16);
#endif
}

/* p[0..7] = the 4 registers r (bf16 pairs) in one store, p 16-byte aligned. */
__device__ static inline void fmma_put16(uint16_t *p, const uint32_t r[4])
{
  FMMA_ALIGNED(p, 16);
#ifdef __CUDACC__
  *(uint4 *)p = make_uint4(r[0], r[1], r[2], r[3]);
#else
  memcpy(p, r, 16);
#endif
}

/* The calling warp's 16 keys (16 kb..) x 32 query rows (16 qb..) of dS^T (pa: fmma_frag_p's
 * registers of it) into the workspace tile t as chunks of dS (FMMA_DS_CHUNK): register j of pa[ks]
 * holds the 8 x 8 matrix of keys 8 (j % 2).. and rows 16 ks + 8 (j / 2)..; transposed
 * (movmatrix), it is register 2 (j % 2) + j / 2 of the A operand of chunk (qb + ks, kb). Two
 * 16-byte stores a lane. */
__device__ static inline void fmma_store_ds(uint16_t *t, int qb, int kb, const uint32_t (*pa)[4])
{
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int ks = 0; ks < 2; ks++) {
    uint32_t a[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
      a[j] = DT_MOVMATRIX_T(pa[ks][2 * (j % 2) + j / 2]);
    fmma_put16(t + FMMA_DS_CHUNK(qb + ks, kb) + 8 * lane, a);
  }
}

/* One value as bf16: an fp32 one rounded, a bf16 one as it is. */
__device__ static inline uint16_t fmma_to_bf16(float x)
{
  return fmma_bf16(x);
}

__device__ static inline uint16_t fmma_to_bf16(uint16_t x)
{
  return x;
}

/* Rows [r0, r0 + FMMA_ROWS) of src (fp32: dout; bf16: q, k, v or dout; row stride ld values, hs
 * values each) into the bf16 tile dst, zero past row rend and past column hs. The block's
 * threads share the loads: 16 bytes a load where hs, ld and src allow it (every shape with hs
 * a multiple of 4 for fp32, of 8 for bf16), else one value. */
template <int HSM, typename S>
__device__ static void fmma_load(uint16_t *dst, const S *src, size_t ld, int r0, int rend, int hs)
{
  constexpr int V = 16 / sizeof(S); /* values a load */
  if (hs % V == 0 && ld % V == 0 && (uintptr_t)src % 16 == 0) {
    constexpr int Q = HSM / V; /* loads a row */
    const S *rows = src + (size_t)r0 * ld;
    for (int i = threadIdx.x; i < FMMA_ROWS * Q; i += blockDim.x) {
      const int r = i / Q, d = V * (i % Q);
      fmma_move16(dst + r * FMMA_LD(HSM) + d, rows + (size_t)r * ld + d, r0 + r < rend && d < hs);
    }
    return;
  }
  for (int i = threadIdx.x; i < FMMA_ROWS * HSM; i += blockDim.x) {
    const int r = i / HSM, d = i % HSM;
    dst[r * FMMA_LD(HSM) + d] =
        r0 + r < rend && d < hs ? fmma_to_bf16(src[(size_t)(r0 + r) * ld + d]) : (uint16_t)0;
  }
}

/* fmma_load's tile, by cp.async where the rows allow its 16-byte bf16 loads (the copies land when
 * the thread waits, DT_CP_ASYNC_WAIT_ALL; the other threads see them after the next barrier),
 * else by fmma_load at once. Either way the tile may be overwritten only once every thread is
 * done reading what it held, and read only past a wait and a barrier. */
template <int HSM>
__device__ static void fmma_load_async(uint16_t *dst, const uint16_t *src, size_t ld, int r0,
                                       int rend, int hs)
{
  if (hs % 8 != 0 || ld % 8 != 0 || (uintptr_t)src % 16 != 0) {
    fmma_load<HSM>(dst, src, ld, r0, rend, hs);
    return;
  }
  constexpr int Q = HSM / 8; /* copies a row */
  for (int i = threadIdx.x; i < FMMA_ROWS * Q; i += blockDim.x) {
    const int r = i / Q, d = 8 * (i % Q);
    const bool ok = r0 + r < rend && d < hs; /* else zeros, and src (read nowhere) stands in */
    DT_CP_ASYNC16(dst + r * FMMA_LD(HSM) + d, ok ? src + (size_t)(r0 + r) * ld + d : src, ok);
  }
}

template <int HSM>
__device__ static void fmma_load_async(uint16_t *dst, const float *src, size_t ld, int r0, int rend,
                                       int hs)
{
  fmma_load<HSM>(dst, src, ld, r0, rend, hs); /* fp32 values are rounded on the way */
}

/* 2^x: the GPU's ex2.approx.ftz (one instruction, relative error ~2^-22; results below 2^-126
 * flushed to 0), exp2f off it. The softmax exponentials are exp2 of a single FMA, the scale folded
 * with log2(e) into one factor (FA2's form): p = 2^(s sl2 - m sl2) = e^(scale s - scale m). */
#define FMMA_LOG2E 1.4426950408889634f
__device__ static inline float fmma_exp2(float x)
{
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

/* Sum (or max) of v over the 4 lanes that share a row of the C layout. */
__device__ static inline float fmma_row_sum(float v)
{
  v += DT_SHFL_XOR(v, 1);
  return v + DT_SHFL_XOR(v, 2);
}

__device__ static inline float fmma_row_max(float v)
{
  v = fmaxf(v, DT_SHFL_XOR(v, 1));
  return fmaxf(v, DT_SHFL_XOR(v, 2));
}

/* dst[d] = mul acc (or += with add) for the calling lane's columns d < hs of its row g + 8 i of
 * the C layout (acc: NO tiles of 8 columns); a bf16 dst gets the value rounded (add is false
 * there: the caller's). A lane's columns come in pairs (2 c, 2 c + 1 of each tile), stored in one
 * access (4 bytes of bf16, 8 of fp32) where hs is even and the row aligned to a pair: a quad then
 * writes 16 or 32 contiguous bytes, where single values used a quarter of each 32-byte sector
 * they touched (on an H200 the pairs took the bf16 forward from 0.594 to 0.549 ms at GPT-2
 * 124M's shape, batch 64, and the backward from 1.93 to 1.71). */
__device__ static inline void fmma_store_one(float *dst, float v, bool add)
{
  *dst = add ? *dst + v : v;
}

__device__ static inline void fmma_store_one(uint16_t *dst, float v, bool add)
{
  (void)add;
  *dst = fmma_bf16(v);
}

__device__ static inline void fmma_store_two(float *dst, float v0, float v1, bool add)
{
  FMMA_ALIGNED(dst, 8);
#ifdef __CUDACC__
  float2 *p = (float2 *)dst;
  const float2 old = add ? *p : make_float2(0.0f, 0.0f);
  *p = add ? make_float2(old.x + v0, old.y + v1) : make_float2(v0, v1);
#else
  fmma_store_one(dst, v0, add);
  fmma_store_one(dst + 1, v1, add);
#endif
}

__device__ static inline void fmma_store_two(uint16_t *dst, float v0, float v1, bool add)
{
  (void)add;
  FMMA_ALIGNED(dst, 4);
  const uint32_t u = (uint32_t)fmma_bf16(v0) | (uint32_t)fmma_bf16(v1) << 16;
#ifdef __CUDACC__
  *(uint32_t *)dst = u;
#else
  memcpy(dst, &u, sizeof u);
#endif
}

template <int NO, typename G>
__device__ static void fmma_store_row(G *dst, const float (*acc)[4], int i, float mul, int hs,
                                      bool add)
{
  const int c = threadIdx.x % 4;
  const bool pairs = hs % 2 == 0 && (uintptr_t)dst % (2 * sizeof(G)) == 0;
#pragma unroll
  for (int nd = 0; nd < NO; nd++) {
    const int d = 8 * nd + 2 * c;
    if (pairs && d < hs)
      fmma_store_two(dst + d, mul * acc[nd][2 * i], mul * acc[nd][2 * i + 1], add);
    else if (!pairs)
#pragma unroll
      for (int e = 0; e < 2; e++)
        if (d + e < hs)
          fmma_store_one(dst + d + e, mul * acc[nd][2 * i + e], add);
  }
}

/* The online softmax of one tile of keys j0.. for the calling lane's two rows (query positions
 * qpos): the raw scores s (Q K^T, mma's C layout) become 2^(s sl2 - m sl2), m and l (the rows'
 * running max of the raw scores and sum) are updated and o rescaled as m grows. MASK: the keys
 * past a row's position get -inf first (the tiles that reach past the block's first row). */
template <bool MASK, int NO>
__device__ static inline void fmma_online_softmax(float (*s)[4], float (*o)[4], float m[2],
                                                  float l[2], const int qpos[2], int j0, float sl2)
{
  const int c = threadIdx.x % 4;
#pragma unroll
  for (int i = 0; i < 2; i++) { /* key 0 is in the first tile: m is finite from then on */
    float mt = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
      for (int e = 2 * i; e < 2 * i + 2; e++) {
        if (MASK && j0 + 8 * nt + 2 * c + e % 2 > qpos[i])
          s[nt][e] = -INFINITY;
        mt = fmaxf(mt, s[nt][e]);
      }
    const float mn = fmaxf(m[i], fmma_row_max(mt)), mb = mn * sl2;
    const float corr = fmma_exp2(fmaf(m[i], sl2, -mb)); /* 0 while m was -inf */
    l[i] *= corr;
#pragma unroll
    for (int nd = 0; nd < NO; nd++) {
      o[nd][2 * i] *= corr;
      o[nd][2 * i + 1] *= corr;
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
      for (int e = 2 * i; e < 2 * i + 2; e++) {
        s[nt][e] = fmma_exp2(fmaf(s[nt][e], sl2, -mb));
        l[i] += s[nt][e];
      }
    m[i] = mn;
  }
}

/* Grid flash_grid(fmma_mt_blocks<HSM>(Tq), B, NH), FMMA_THREADS threads,
 * fmma_fwd_smem_bytes<HSM>(). Each warp owns MT = FMMA_MT(HSM) tiles of 16 query rows. The K
 * and V tiles of one step take turns in flight (FA2's order): V's lands while the scores are
 * computed, the next K's during the softmax and P V. */
template <int HSM>
__global__ static void __launch_bounds__(FMMA_THREADS, 3)
    fmma_forward_kernel(uint16_t *out, float *lse, const uint16_t *qkv, int Tq, int q0, int Tall,
                        int C, int NH, float scale)
{
  DT_DYNAMIC_SMEM(smem_f);
  constexpr int LD = FMMA_LD(HSM), NO = HSM / 8, MT = FMMA_MT(HSM), ROWS = FMMA_ROWS * MT;
  uint16_t *qs = (uint16_t *)smem_f, *ks = qs + ROWS * LD, *vs = ks + FMMA_ROWS * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int b = blockIdx.z, h = blockIdx.y, bh = b * NH + h, hs = C / NH;
  const size_t C3 = 3 * (size_t)C;
  const uint16_t *base = qkv + (size_t)b * Tall * C3 + (size_t)h * hs;
  const int r0 = fmma_query_block_row(ROWS), rend = min(r0 + ROWS, Tq), kend = q0 + rend;
  const float sl2 = scale * FMMA_LOG2E;
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
    fmma_load_async<HSM>(qs + FMMA_ROWS * mt * LD, base + (size_t)q0 * C3, C3, r0 + FMMA_ROWS * mt,
                         Tq, hs);
  fmma_load_async<HSM>(ks, base + C, C3, 0, kend, hs);
  const int w0 = r0 + 16 * MT * warp; /* the warp's first row; this lane's: row[2 mt + i] */
  int row[2 * MT], qpos[2 * MT];
#pragma unroll
  for (int j = 0; j < 2 * MT; j++) {
    row[j] = w0 + 16 * (j / 2) + 8 * (j % 2) + g;
    qpos[j] = q0 + row[j];
  }
  float m[2 * MT], l[2 * MT], o[MT * NO][4] = {};
#pragma unroll
  for (int j = 0; j < 2 * MT; j++)
    m[j] = -INFINITY, l[j] = 0.0f;
  for (int j0 = 0; j0 < kend; j0 += FMMA_ROWS) {
    DT_CP_ASYNC_WAIT_ALL();
    __syncthreads(); /* K's tile (and q) in place; every warp done with the previous V's */
    fmma_load_async<HSM>(vs, base + 2 * C, C3, j0, kend, hs);
    float s[MT * 8][4] = {};
    fmma_abt<HSM, 8, MT>(s, qs + 16 * MT * warp * LD, ks);
    DT_CP_ASYNC_WAIT_ALL();
    __syncthreads(); /* V's tile in place; every warp done with K's */
    if (j0 + FMMA_ROWS < kend)
      fmma_load_async<HSM>(ks, base + C, C3, j0 + FMMA_ROWS, kend, hs);
    uint32_t pa[MT * 4][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      float(*st)[4] = s + 8 * mt;
      if (j0 + FMMA_ROWS - 1 > q0 + w0 + 16 * mt) /* a key after the row tile's first row */
        fmma_online_softmax<true, NO>(st, o + NO * mt, m + 2 * mt, l + 2 * mt, qpos + 2 * mt, j0,
                                      sl2);
      else
        fmma_online_softmax<false, NO>(st, o + NO * mt, m + 2 * mt, l + 2 * mt, qpos + 2 * mt, j0,
                                       sl2);
      fmma_frag_p<4>(pa + 4 * mt, st);
    }
    fmma_pv<HSM, 4, MT>(o, pa, vs);
  }
#pragma unroll
  for (int j = 0; j < 2 * MT; j++) {
    const float sum = fmma_row_sum(l[j]);
    if (row[j] >= Tq)
      continue;
    fmma_store_row<NO>(out + ((size_t)b * Tq + row[j]) * C + (size_t)h * hs, o + NO * (j / 2),
                       j % 2, 1.0f / sum, hs, false);
    if (c == 0)
      lse[(size_t)bh * Tq + row[j]] = m[j] * scale + logf(sum);
  }
}

/* The backward's probabilities and score gradients for the calling lane's 16 x 32 elements of a
 * half tile: fmma_probs makes s (scores) P = 2^(s sl2 - L), fmma_ds then dp (dP) dS = P (dP - D),
 * where at(i, j, &L, &D) gives element (row g + 8 i, column 8 nt + 2 c + (e % 2)) its L (lse
 * log2 e) and D and says whether the causal mask keeps it; MASK: P = 0 where it does not (the
 * tiles that cross the diagonal, or past the last row). */
template <bool MASK, bool P, bool DS, typename F>
__device__ static inline void fmma_scores_pass(float (*s)[4], float (*dp)[4], float sl2, F at)
{
  const int c = threadIdx.x % 4;
#pragma unroll
  for (int nt = 0; nt < 4; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      float L, D;
      const bool keep = at(e / 2, 8 * nt + 2 * c + e % 2, &L, &D);
      if (P) {
        const float p = fmma_exp2(fmaf(s[nt][e], sl2, -L));
        s[nt][e] = MASK && !keep ? 0.0f : p;
      }
      if (DS)
        dp[nt][e] = s[nt][e] * (dp[nt][e] - D);
    }
}

template <bool MASK, typename F>
__device__ static inline void fmma_probs(float (*s)[4], float sl2, F at)
{
  fmma_scores_pass<MASK, true, false>(s, NULL, sl2, at);
}

template <typename F> __device__ static inline void fmma_ds(float (*p)[4], float (*dp)[4], F at)
{
  fmma_scores_pass<false, false, true>(p, dp, 0.0f, at);
}

/* Both in one pass: where dP is ready with S. */
template <bool MASK, typename F>
__device__ static inline void fmma_dscores(float (*s)[4], float (*dp)[4], float sl2, F at)
{
  fmma_scores_pass<MASK, true, true>(s, dp, sl2, at);
}

/* Grid fmma_d_blocks(B Tq NH), FMMA_THREADS threads: D = dout . out of every query row and
 * head into Dbuf (B, NH, Tq), in fp32 from dout's values (O: float, or bf16 bits) and out's bf16
 * ones; the 4 lanes of a quad share a (row, head). Where hs and C are multiples of 8 and both
 * tensors 16-byte aligned, lane c sums the 8 columns from 8 c, 8 c + 32, ... read in 16-byte
 * loads (a warp's 8 quads read 8 adjacent heads: contiguous memory), else columns c, c + 4, ...
 * one value a load (on an H200, 22.4 us then 11.3 for B4 T1024 C1600 NH25). */
#define FMMA_D_ROWS (FMMA_THREADS / 4)
static inline unsigned fmma_d_blocks(size_t rows)
{
  return (unsigned)((rows + FMMA_D_ROWS - 1) / FMMA_D_ROWS);
}

/* The 8 values at p (16-byte aligned) as fp32. */
__device__ static inline void fmma_load8(float v[8], const float *p)
{
  fmma_get16(v, p);
  fmma_get16(v + 4, p + 4);
}

__device__ static inline void fmma_load8(float v[8], const uint16_t *p)
{
  FMMA_ALIGNED(p, 16);
  uint16_t u[8];
#ifdef __CUDACC__
  const uint4 x = *(const uint4 *)p;
  memcpy(u, &x, sizeof u);
#else
  memcpy(u, p, sizeof u);
#endif
#pragma unroll
  for (int j = 0; j < 8; j++)
    v[j] = fmma_f32(u[j]);
}

template <typename O>
__global__ static void __launch_bounds__(FMMA_THREADS)
    fmma_backward_d_kernel(float *Dbuf, const O *dout, const uint16_t *out, int B, int Tq, int C,
                           int NH)
{
  const size_t i = (size_t)blockIdx.x * FMMA_D_ROWS + threadIdx.x / 4; /* (b, t, h), h fastest */
  const int c = threadIdx.x % 4, hs = C / NH, h = (int)(i % NH);
  const size_t bt = i / NH;
  const bool ok = bt < (size_t)B * Tq;
  const bool vec =
      hs % 8 == 0 && C % 8 == 0 && (uintptr_t)dout % 16 == 0 && (uintptr_t)out % 16 == 0;
  float part = 0.0f;
  if (ok) {
    const size_t o = bt * C + (size_t)h * hs;
    if (vec)
      for (int d = 8 * c; d < hs; d += 32) {
        float x[8], y[8];
        fmma_load8(x, dout + o + d);
        fmma_load8(y, out + o + d);
#pragma unroll
        for (int j = 0; j < 8; j++)
          part += x[j] * y[j];
      }
    else
      for (int d = c; d < hs; d += 4)
        part += fmma_f32(dout[o + d]) * fmma_f32(out[o + d]);
  }
  const float D = fmma_row_sum(part); /* every lane: the butterfly needs the whole warp */
  if (ok && c == 0)
    Dbuf[((bt / Tq) * NH + h) * Tq + bt % Tq] = D;
}

/* Grid flash_grid(fmma_blocks(q0 + Tq), B, heads), FMMA_THREADS threads,
 * fmma_dkdv_smem_bytes<HSM>(), after the D kernel (Dbuf): block (x, y, b) works on head h0 + y of
 * sequence b. Adds the key and value gradients into dqkv (add false: writes them; G = uint16_t:
 * as bf16, never added) and, where ds_tiles is not NULL, stores the score gradients dS of its
 * key block, rounded to bf16 as the products take them, into its tiles of ds_tiles (the
 * workspace's, of this group of heads) for the dq kernel. O: dout's type (float, rounded to bf16 as
 * it is loaded; uint16_t: bf16 values, read as they are). The query tiles (q, dout, lse log2 e and
 * D) are double buffered: the next step's land while this one's are used. */
template <int HSM, typename G, typename O>
__global__ static void __launch_bounds__(FMMA_THREADS, FMMA_MIN_BLOCKS(HSM, 4, 2))
    fmma_backward_dkdv_kernel(G *dqkv, uint16_t *ds_tiles, const float *Dbuf, const O *dout,
                              const uint16_t *qkv, const float *lse, int Tq, int q0, int Tall,
                              int C, int NH, int h0, float scale, bool add)
{
  DT_DYNAMIC_SMEM(smem_f);
  constexpr int LD = FMMA_LD(HSM), NO = HSM / 8, TILE = FMMA_ROWS * LD;
  uint16_t *ks = (uint16_t *)smem_f, *vs = ks + TILE, *qg = vs + TILE; /* qg: q, dout; q, dout */
  float *lD = (float *)(qg + 4 * TILE); /* lse log2 e, D; lse log2 e, D (FMMA_ROWS each) */
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
  const int b = blockIdx.z, h = h0 + blockIdx.y, bh = b * NH + h, hs = C / NH;
  const size_t C3 = 3 * (size_t)C;
  const uint16_t *base = qkv + (size_t)b * Tall * C3 + (size_t)h * hs;
  const O *gbase = dout + (size_t)b * Tq * C + (size_t)h * hs;
  const int k0 = blockIdx.x * FMMA_ROWS, kend = q0 + Tq; /* keys [k0, k0 + 64) of [0, kend) */
  const float sl2 = scale * FMMA_LOG2E;
  /* the query rows [t0, t0 + 64) (chunk-relative) into buffer buf */
  auto load_queries = [&](int t0, int buf) {
    uint16_t *q = qg + 2 * buf * TILE;
    fmma_load_async<HSM>(q, base + (size_t)q0 * C3, C3, t0, Tq, hs);
    fmma_load_async<HSM>(q + TILE, gbase, C, t0, Tq, hs);
    float *ld = lD + 2 * buf * FMMA_ROWS;
    for (int i = threadIdx.x; i < FMMA_ROWS; i += blockDim.x) {
      const bool ok = t0 + i < Tq;
      ld[i] = ok ? lse[(size_t)bh * Tq + t0 + i] * FMMA_LOG2E : 0.0f;
      ld[FMMA_ROWS + i] = ok ? Dbuf[(size_t)bh * Tq + t0 + i] : 0.0f;
    }
  };
  fmma_load_async<HSM>(ks, base + C, C3, k0, kend, hs);
  fmma_load_async<HSM>(vs, base + 2 * C, C3, k0, kend, hs);
  /* the query tile (of 64 chunk rows) holding the block's first key's position: tfirst < Tq */
  const int tfirst = max(k0 - q0, 0) / FMMA_ROWS * FMMA_ROWS;
  load_queries(tfirst, 0);
  const int nqt = (Tq + FMMA_ROWS - 1) / FMMA_ROWS, a = (q0 + FMMA_ROWS - 1) / FMMA_ROWS;
  const size_t gh = (size_t)blockIdx.z * gridDim.y + blockIdx.y; /* (b, h) in the group */
  uint16_t *ds = ds_tiles
                     ? ds_tiles + (gh * FMMA_DS_BEFORE((int)gridDim.x, nqt, a) +
                                   FMMA_DS_BEFORE((int)blockIdx.x, nqt, a) - tfirst / FMMA_ROWS) *
                                      (size_t)FMMA_DS_TILE /* + qt tiles: query tile qt's */
                     : NULL;
  const int key[2] = {k0 + 16 * warp + g, k0 + 16 * warp + g + 8};
  float dk[NO][4] = {}, dv[NO][4] = {};
  for (int t0 = tfirst, buf = 0; t0 < Tq; t0 += FMMA_ROWS, buf ^= 1) {
    DT_CP_ASYNC_WAIT_ALL();
    __syncthreads(); /* this step's query tiles (and k, v) in place; the other buffer is free */
    if (t0 + FMMA_ROWS < Tq)
      load_queries(t0 + FMMA_ROWS, buf ^ 1);
    const uint16_t *qs = qg + 2 * buf * TILE, *gs = qs + TILE;
    const float *ls = lD + 2 * buf * FMMA_ROWS, *Ds = ls + FMMA_ROWS;
    /* The tile's query rows in two halves of 32 (the same products per accumulator, in the same
     * order): dk and dv hold 2 HSM / 4 registers a lane, so S^T and dP^T get half a tile. */
#pragma unroll 1
    for (int tq = 0; tq < FMMA_ROWS; tq += 32) {
      float s[4][4] = {}, dp[4][4] = {}; /* transposed: rows are keys, columns query rows */
      fmma_abt<HSM, 4>(s, ks + 16 * warp * LD, qs + tq * LD);
      fmma_abt<HSM, 4>(dp, vs + 16 * warp * LD, gs + tq * LD);
      auto at = [&](int i, int j, float *Li, float *Di) { /* P^T and dS^T */
                                                          const int t = t0 + tq + j;
                                                          *Li = ls[tq + j], *Di = Ds[tq + j];
                                                          return t < Tq && key[i] <= q0 + t;
      };
      if (k0 + FMMA_ROWS - 1 > q0 + t0 + tq || t0 + tq + 32 > Tq) /* past a row, or the last */
        fmma_dscores<true>(s, dp, sl2, at);
      else
        fmma_dscores<false>(s, dp, sl2, at);
      uint32_t pa[2][4]; /* one operand at a time */
      fmma_frag_p<2>(pa, s);
      fmma_pv<HSM, 2>(dv, pa, gs + tq * LD);
      fmma_frag_p<2>(pa, dp);
      if (ds)
        fmma_store_ds(ds + (size_t)(t0 / FMMA_ROWS) * FMMA_DS_TILE, tq / 16, warp, pa);
      fmma_pv<HSM, 2>(dk, pa, qs + tq * LD);
    }
  }
#pragma unroll
  for (int i = 0; i < 2; i++) {
    if (key[i] >= kend)
      continue;
    G *krow = dqkv + ((size_t)b * Tall + key[i]) * C3 + (size_t)h * hs;
    fmma_store_row<NO>(krow + C, dk, i, scale, hs, add);
    fmma_store_row<NO>(krow + 2 * C, dv, i, 1.0f, hs, add);
  }
}

/* The mma dq kernel's MT dS tiles of key block kb for the query tiles from the block's row r0 into
 * dst, by cp.async (the block's threads share the copies): from ds, the workspace's tiles of the
 * block's (b, h) (nqt query tiles, a: FMMA_DS_BEFORE's), zeros for a tile the dk/dv kernel did
 * not write (past the diagonal or the last query tile; ds, read nowhere, stands in). */
template <int MT>
__device__ static inline void fmma_load_ds(uint16_t *dst, const uint16_t *ds, int kb, int r0,
                                           int nqt, int a)
{
  const int first = max(0, kb - a);
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    const int qt = r0 / FMMA_ROWS + mt;
    const bool ok = qt < nqt && qt >= first;
    const uint16_t *src =
        ok ? ds + (FMMA_DS_BEFORE(kb, nqt, a) + (size_t)(qt - first)) * FMMA_DS_TILE : ds;
    for (int i = 8 * threadIdx.x; i < FMMA_DS_TILE; i += 8 * blockDim.x)
      DT_CP_ASYNC16(dst + mt * FMMA_DS_TILE + i, src + (ok ? i : 0), ok);
  }
}

/* Grid flash_grid(fmma_mt_blocks<HSM>(Tq), B, heads), FMMA_THREADS threads,
 * fmma_dq_smem_bytes<HSM>(), after the dk/dv kernel, on its heads: adds the query gradients
 * dq = scale dS K into dqkv (add false: writes them; G = uint16_t: as bf16, never added), dS from
 * the dk/dv kernel's tiles ds_tiles. Each warp owns MT = FMMA_MT(HSM) tiles of 16 query rows; a
 * tile of K and the block's MT dS tiles stream through shared memory, double buffered (a tile the
 * dk/dv kernel did not write, past the diagonal or the last query tile, is zeros). */
template <int HSM, typename G>
__global__ static void __launch_bounds__(FMMA_THREADS, FMMA_MIN_BLOCKS(HSM, 4, 3))
    fmma_backward_dq_kernel(G *dqkv, const uint16_t *ds_tiles, const uint16_t *qkv, int Tq, int q0,
                            int Tall, int C, int NH, int h0, float scale, bool add)
{
  DT_DYNAMIC_SMEM(smem_f);
  constexpr int LD = FMMA_LD(HSM), NO = HSM / 8, MT = FMMA_MT(HSM);
  constexpr int ROWS = FMMA_ROWS * MT, KT = FMMA_ROWS * LD, BUF = KT + MT * FMMA_DS_TILE;
  uint16_t *sm = (uint16_t *)smem_f; /* per buffer: K's tile, then the MT dS tiles */
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  const int b = blockIdx.z, h = h0 + blockIdx.y, hs = C / NH;
  const size_t C3 = 3 * (size_t)C;
  const uint16_t *kbase = qkv + (size_t)b * Tall * C3 + (size_t)h * hs + C;
  const int r0 = fmma_query_block_row(ROWS), rend = min(r0 + ROWS, Tq), kend = q0 + rend;
  const int nqt = (Tq + FMMA_ROWS - 1) / FMMA_ROWS, a = (q0 + FMMA_ROWS - 1) / FMMA_ROWS;
  const int nkb = (q0 + Tq + FMMA_ROWS - 1) / FMMA_ROWS, nk = (kend + FMMA_ROWS - 1) / FMMA_ROWS;
  const uint16_t *ds = ds_tiles + ((size_t)blockIdx.z * gridDim.y + blockIdx.y) *
                                      FMMA_DS_BEFORE(nkb, nqt, a) * (size_t)FMMA_DS_TILE;
  /* key block kb's K and dS tiles into buffer buf */
  auto load = [&](int kb, int buf) {
    uint16_t *t = sm + buf * BUF;
    fmma_load_async<HSM>(t, kbase, C3, FMMA_ROWS * kb, kend, hs);
    fmma_load_ds<MT>(t + KT, ds, kb, r0, nqt, a);
  };
  load(0, 0);
  const int wr = 16 * MT * warp; /* the warp's first row in the block */
  float dq[MT * NO][4] = {};
  for (int kb = 0, buf = 0; kb < nk; kb++, buf ^= 1) {
    DT_CP_ASYNC_WAIT_ALL();
    __syncthreads(); /* this step's tiles in place; the other buffer is free */
    if (kb + 1 < nk)
      load(kb + 1, buf ^ 1);
    const uint16_t *ks = sm + buf * BUF, *st = ks + KT + wr / FMMA_ROWS * FMMA_DS_TILE;
    const int qb = wr % FMMA_ROWS / 16; /* the warp's first 16 rows in its dS tile */
    /* keys 16 kk.. of the tile, in the order of the dk/dv kernel's (and of flash.cuh's) sums */
#pragma unroll
    for (int kk = 0; kk < FMMA_ROWS / 16; kk++) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
        fmma_get16(pa[mt], st + FMMA_DS_CHUNK(qb + mt, kk) + 8 * (threadIdx.x % 32));
      fmma_pv<HSM, 1, MT>(dq, pa, ks + 16 * kk * LD);
    }
  }
#pragma unroll
  for (int j = 0; j < 2 * MT; j++) {
    const int row = r0 + wr + 16 * (j / 2) + 8 * (j % 2) + g;
    if (row >= Tq)
      continue;
    fmma_store_row<NO>(dqkv + ((size_t)b * Tall + q0 + row) * C3 + (size_t)h * hs,
                       dq + NO * (j / 2), j % 2, scale, hs, add);
  }
}

/* Grid flash_grid(fmma_blocks(Tq), B, NH), FMMA_THREADS threads, fmma_smem_bytes<HSM>(6, 0),
 * after the D kernel, where the score gradients' tiles would not fit (fmma_backward_ws): adds the
 * query gradients into dqkv as fmma_backward_dq_kernel does, with the same bits, recomputing S and
 * dP (as the dk/dv kernel does) instead of reading dS: two products more. Its warps own 16 query
 * rows; the key and value tiles are double buffered. */
template <int HSM, typename G, typename O>
__global__ static void __launch_bounds__(FMMA_THREADS, FMMA_MIN_BLOCKS(HSM, 4, 2))
    fmma_backward_dq_recompute_kernel(G *dqkv, const float *Dbuf, const O *dout,
                                      const uint16_t *qkv, const float *lse, int Tq, int q0,
                                      int Tall, int C, int NH, float scale, bool add)
{
  DT_DYNAMIC_SMEM(smem_f);
  constexpr int LD = FMMA_LD(HSM), NO = HSM / 8, TILE = FMMA_ROWS * LD;
  uint16_t *qs = (uint16_t *)smem_f, *gs = qs + TILE, *kv = gs + TILE; /* kv: K, V; K, V */
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  const int b = blockIdx.z, h = blockIdx.y, bh = b * NH + h, hs = C / NH;
  const size_t C3 = 3 * (size_t)C;
  const uint16_t *base = qkv + (size_t)b * Tall * C3 + (size_t)h * hs;
  const O *gbase = dout + (size_t)b * Tq * C + (size_t)h * hs;
  const int r0 = fmma_query_block_row(FMMA_ROWS), rend = min(r0 + FMMA_ROWS, Tq);
  const int kend = q0 + rend;
  const float sl2 = scale * FMMA_LOG2E;
  fmma_load_async<HSM>(qs, base + (size_t)q0 * C3, C3, r0, Tq, hs);
  fmma_load_async<HSM>(gs, gbase, C, r0, Tq, hs);
  fmma_load_async<HSM>(kv, base + C, C3, 0, kend, hs);
  fmma_load_async<HSM>(kv + TILE, base + 2 * C, C3, 0, kend, hs);
  const int row[2] = {r0 + 16 * warp + g, r0 + 16 * warp + g + 8};
  const int qpos[2] = {q0 + row[0], q0 + row[1]};
  float D[2], L[2];
#pragma unroll
  for (int i = 0; i < 2; i++) {
    D[i] = row[i] < Tq ? Dbuf[(size_t)bh * Tq + row[i]] : 0.0f;
    L[i] = row[i] < Tq ? lse[(size_t)bh * Tq + row[i]] * FMMA_LOG2E : 0.0f;
  }
  float dq[NO][4] = {};
  for (int j0 = 0, buf = 0; j0 < kend; j0 += FMMA_ROWS, buf ^= 1) {
    DT_CP_ASYNC_WAIT_ALL();
    __syncthreads(); /* this step's K and V (and q, dout) in place; the other pair is free */
    if (j0 + FMMA_ROWS < kend) {
      uint16_t *next = kv + 2 * (buf ^ 1) * TILE;
      fmma_load_async<HSM>(next, base + C, C3, j0 + FMMA_ROWS, kend, hs);
      fmma_load_async<HSM>(next + TILE, base + 2 * C, C3, j0 + FMMA_ROWS, kend, hs);
    }
    const uint16_t *ks = kv + 2 * buf * TILE, *vs = ks + TILE;
    /* The tile's keys in two halves of 32, as the dk/dv kernel's query rows (same bits). */
#pragma unroll 1
    for (int jh = 0; jh < FMMA_ROWS; jh += 32) {
      float s[4][4] = {}, dp[4][4] = {};
      fmma_abt<HSM, 4>(s, qs + 16 * warp * LD, ks + jh * LD);
      fmma_abt<HSM, 4>(dp, gs + 16 * warp * LD, vs + jh * LD);
      auto at = [&](int i, int j, float *Li, float *Di) {
        *Li = L[i], *Di = D[i];
        return j0 + jh + j <= qpos[i];
      };
      if (j0 + jh + 31 > q0 + r0) /* a key after the block's first row */
        fmma_dscores<true>(s, dp, sl2, at);
      else
        fmma_dscores<false>(s, dp, sl2, at);
      uint32_t da[2][4];
      fmma_frag_p<2>(da, dp);
      fmma_pv<HSM, 2>(dq, da, ks + jh * LD);
    }
  }
#pragma unroll
  for (int i = 0; i < 2; i++) {
    if (row[i] >= Tq)
      continue;
    fmma_store_row<NO>(dqkv + ((size_t)b * Tall + q0 + row[i]) * C3 + (size_t)h * hs, dq, i, scale,
                       hs, add);
  }
}

#endif
