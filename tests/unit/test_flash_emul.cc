/* test_flash_emul.cc — the CUDA flash-attention kernels (kernels/cuda/flash.cuh) run on the
 * host, against the CPU's flash kernels (kernels/cpu/attention.c), on machines without a GPU.
 *
 * flash.cuh is compiled here as plain C++ under the emulation of CUDA's thread model in
 * cuda_emul.h (what it checks and what it cannot are said there). The launches mirror
 * kernels/cuda/attention.cu's: the same grids, block sizes and shared memory from flash.cuh,
 * the dq kernel then the dk/dv kernel with D between them (the tensor-core backward: D, then
 * per group of batch elements dk/dv and dq, the score gradients' tiles between them). Beyond
 * test_cuda_emul's kernels these check the online softmax, the causal masks of the tiles and the
 * head-size buckets. The tolerance is test_cuda's: max |emulated - cpu| <= 1e-5 of the tensor's
 * largest value (the sums run in other orders). The tensor-core kernels (flash_mma.cuh) are checked
 * against the CPU's bf16 flash kernels, which round at the same points (check_mma states the
 * bounds). */
#include <check.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

extern "C" {
#include "cpu_kernels.h"
#include "rng.h"
}

#include "att_close.h"
#include "cuda_emul.h"
#include "emul_expect.h"
#include "flash.cuh"
#include "flash_mma.cuh"
#include "flash_wgmma.cuh"

/* attention.cu's flash_forward and flash_backward, launched on the emulation. */
template <int HSM>
static void emul_forward(float *out, float *lse, const float *qkv, int B, int Tq, int q0, int Tall,
                         int C, int NH)
{
  const float scale = 1.0f / sqrtf((float)(C / NH));
  launch(flash_grid(flash_query_blocks(Tq), B, NH), FLASH_ROWS, flash_kv_smem_bytes<HSM>(),
         [&] { flash_forward_kernel<HSM>(out, lse, qkv, Tq, q0, Tall, C, NH, scale); });
}

template <int HSM>
static void emul_backward(float *dqkv, const float *dout, const float *qkv, const float *out,
                          const float *lse, int B, int Tq, int q0, int Tall, int C, int NH,
                          bool add)
{
  const float scale = 1.0f / sqrtf((float)(C / NH));
  std::vector<float> D((size_t)B * NH * Tq, NAN);
  launch(flash_grid(flash_query_blocks(Tq), B, NH), FLASH_ROWS, flash_kv_smem_bytes<HSM>(), [&] {
    flash_backward_dq_kernel<HSM>(dqkv, D.data(), dout, qkv, out, lse, Tq, q0, Tall, C, NH, scale,
                                  add);
  });
  launch(flash_grid(flash_key_blocks(q0 + Tq), B, NH), FLASH_KROWS, flash_dkdv_smem_bytes<HSM>(),
         [&] {
           flash_backward_dkdv_kernel<HSM>(dqkv, D.data(), dout, qkv, lse, Tq, q0, Tall, C, NH,
                                           scale, add);
         });
}

/* attention.cu's tensor-core launches of flash_mma.cuh's kernels. */
template <int HSM>
static void emul_mma_forward(uint16_t *out, float *lse, const uint16_t *qkv, int B, int Tq, int q0,
                             int Tall, int C, int NH)
{
  const float scale = 1.0f / sqrtf((float)(C / NH));
  launch(flash_grid(fmma_mt_blocks<HSM>(Tq), B, NH), FMMA_THREADS, fmma_fwd_smem_bytes<HSM>(),
         [&] { fmma_forward_kernel<HSM>(out, lse, qkv, Tq, q0, Tall, C, NH, scale); });
}

/* attention.cu's launch of flash_wgmma.cuh's forward (head size 64, on Hopper). */
static void emul_wgmma_forward(uint16_t *out, float *lse, const uint16_t *qkv, int B, int Tq,
                               int q0, int Tall, int C, int NH)
{
  const float scale = 1.0f / sqrtf((float)(C / NH));
  launch(flash_grid(fwg_blocks(Tq), B, NH), DT_WG_THREADS, FWG_SMEM_BYTES,
         [&] { fwg_forward_kernel(out, lse, qkv, Tq, q0, Tall, C, NH, scale); });
}

/* The D kernel, then per group of sequences or heads (fmma_backward_ws's, with max_bytes) the
 * dk/dv and dq kernels, the workspace's dS tiles between them, or the recomputing dq kernel.
 * wgmma: the dk/dv and dq kernels on wgmma (flash_wgmma.cuh; a bf16 dout), as attention.cu
 * launches them under DISTRAIN_CUDA_WGMMA=1. */
template <int HSM, typename G, typename O>
static void emul_mma_backward(G *dqkv, const O *dout, const uint16_t *qkv, const uint16_t *out,
                              const float *lse, int B, int Tq, int q0, int Tall, int C, int NH,
                              bool add, size_t max_bytes = FMMA_DS_MAX_BYTES, bool wgmma = false)
{
  const float scale = 1.0f / sqrtf((float)(C / NH));
  const fmma_ws_plan ws = fmma_backward_ws(B, Tq, q0, NH, max_bytes);
  std::vector<float> D((size_t)B * NH * Tq, NAN);
  /* the tiles over all-ones bits (NaN): a tile the dq kernel reads but no dk/dv block wrote fails
   */
  std::vector<uint16_t> tiles((ws.bytes - ws.ds_offset) / sizeof(uint16_t) + 8, (uint16_t)0xffff);
  uint16_t *ds_tiles = ws.heads ? tiles.data() : nullptr;
  launch(dim3(fmma_d_blocks((size_t)B * Tq * NH)), FMMA_THREADS, 0,
         [&] { fmma_backward_d_kernel<O>(D.data(), dout, out, B, Tq, C, NH); });
  const size_t C3 = 3 * (size_t)C;
  const int heads = ws.heads ? ws.heads : NH;
  for (int b0 = 0; b0 < B; b0 += ws.seqs)
    for (int h0 = 0; h0 < NH; h0 += heads) {
      const int bn = std::min(ws.seqs, B - b0), hn = std::min(heads, NH - h0);
      G *dg = dqkv + (size_t)b0 * Tall * C3;
      const uint16_t *qg = qkv + (size_t)b0 * Tall * C3;
      const O *gg = dout + (size_t)b0 * Tq * C;
      const size_t r = (size_t)b0 * NH * Tq;
      if constexpr (!std::is_same_v<O, uint16_t>)
        ck_assert(!wgmma); /* the wgmma dk/dv kernel takes a bf16 dout */
      else if (wgmma) {
        ck_assert(fwg_dkdv_fits(C, NH, qkv, dout));
        launch(flash_grid(fmma_blocks(q0 + Tq), bn, hn), DT_WG_THREADS, FWG_DKDV_SMEM_BYTES, [&] {
          fwg_backward_dkdv_kernel<G>(dg, ds_tiles, D.data() + r, gg, qg, lse + r, Tq, q0, Tall, C,
                                      NH, h0, scale, add);
        });
      }
      if (!wgmma)
        launch(flash_grid(fmma_blocks(q0 + Tq), bn, hn), FMMA_THREADS, fmma_dkdv_smem_bytes<HSM>(),
               [&] {
                 fmma_backward_dkdv_kernel<HSM, G, O>(dg, ds_tiles, D.data() + r, gg, qg, lse + r,
                                                      Tq, q0, Tall, C, NH, h0, scale, add);
               });
      if (ds_tiles && wgmma)
        launch(flash_grid(fwg_blocks(Tq), bn, hn), DT_WG_THREADS, FWG_DQ_SMEM_BYTES, [&] {
          fwg_backward_dq_kernel<G>(dg, ds_tiles, qg, Tq, q0, Tall, C, NH, h0, scale, add);
        });
      else if (ds_tiles)
        launch(flash_grid(fmma_mt_blocks<HSM>(Tq), bn, hn), FMMA_THREADS, fmma_dq_smem_bytes<HSM>(),
               [&] {
                 fmma_backward_dq_kernel<HSM, G>(dg, ds_tiles, qg, Tq, q0, Tall, C, NH, h0, scale,
                                                 add);
               });
      else
        launch(flash_grid(fmma_blocks(Tq), bn, hn), FMMA_THREADS, fmma_smem_bytes<HSM>(6, 0), [&] {
          fmma_backward_dq_recompute_kernel<HSM, G, O>(dg, D.data() + r, gg, qg, lse + r, Tq, q0,
                                                       Tall, C, NH, scale, add);
        });
    }
}

/* ---- The checks --------------------------------------------------------------------------- */

static dt_rng_t g_rng;

static std::vector<float> randn(size_t n)
{
  std::vector<float> v(n);
  dt_rng_normal(&g_rng, v.data(), n, 0.0f, 1.0f);
  return v;
}

/* Chunk r of cp as context parallelism runs it (cp = 1: the whole sequence): out and lse over
 * garbage, then the backward from the same random dqkv on both sides (it adds), and for the
 * whole sequence the backward that writes dqkv, over NaN on the emulated side (an element it
 * does not write fails). */
template <int HSM> static void check(int B, int T, int C, int NH, int cp)
{
  ck_assert_int_eq(flash_bucket(C / NH), HSM);
  const int Tq = T / cp;
  const std::vector<float> qkv = randn((size_t)B * T * 3 * C);
  for (int r = 0; r < cp; r++) {
    const int q0 = r * Tq;
    const size_t nout = (size_t)B * Tq * C, nlse = (size_t)B * NH * Tq;
    std::vector<float> out_h(nout, 1e30f), lse_h(nlse, 1e30f), out_g(nout, -1e30f),
        lse_g(nlse, -1e30f);
    ck_assert_int_eq(
        dt_cpu_attention_forward_flash(out_h.data(), lse_h.data(), qkv.data(), B, Tq, q0, T, C, NH),
        0);
    emul_forward<HSM>(out_g.data(), lse_g.data(), qkv.data(), B, Tq, q0, T, C, NH);
    expect_close("forward out", out_g, out_h);
    expect_close("forward lse", lse_g, lse_h);

    const std::vector<float> dout = randn(nout);
    for (int add = 1; add >= (cp == 1 ? 0 : 1); add--) {
      std::vector<float> dqkv_h = randn((size_t)B * T * 3 * C), dqkv_g = dqkv_h;
      if (!add)
        std::fill(dqkv_g.begin(), dqkv_g.end(), NAN);
      ck_assert_int_eq(dt_cpu_attention_backward_flash(dqkv_h.data(), dout.data(), qkv.data(),
                                                       out_h.data(), lse_h.data(), B, Tq, q0, T, C,
                                                       NH, add),
                       0);
      emul_backward<HSM>(dqkv_g.data(), dout.data(), qkv.data(), out_h.data(), lse_h.data(), B, Tq,
                         q0, T, C, NH, add);
      expect_close(add ? "backward dqkv (+=)" : "backward dqkv (=)", dqkv_g, dqkv_h);
    }
  }
}

static std::vector<float> minus(const std::vector<float> &a, const std::vector<float> &b)
{
  std::vector<float> d(a.size());
  for (size_t i = 0; i < a.size(); i++)
    d[i] = a[i] - b[i];
  return d;
}

/* The value of bf16 bits b (the GPU's buffers). */
static float bf16_value(uint16_t b)
{
  const uint32_t bits = (uint32_t)b << 16;
  float v;
  memcpy(&v, &bits, sizeof v);
  return v;
}

/* q, k, v (or out) as the bf16 kernels take them: the CPU's bf16 buffer (the rounded fp32
 * numbers) and the GPU's (their top 16 bits). */
static void bf16_qkv(const std::vector<float> &x, std::vector<float> *cpu,
                     std::vector<uint16_t> *gpu)
{
  cpu->resize(x.size());
  gpu->resize(x.size());
  for (size_t i = 0; i < x.size(); i++) {
    uint32_t u;
    (*cpu)[i] = dt_bf16_round(x[i]);
    memcpy(&u, &(*cpu)[i], sizeof u);
    (*gpu)[i] = (uint16_t)(u >> 16);
  }
}

/* The tensor-core kernels against the CPU's bf16 flash kernels, which round the same values at
 * the same points (attention.c, flash_mma.cuh), on the same bf16 q, k, v. Both compute the
 * probabilities in fp32 before rounding them to bf16, but by other formulas (the CPU's e^(s scale
 * - m), the kernels' 2^(s sl2 - m sl2)), which differ by a few fp32 ulps: now and then a
 * probability p falls on the other side of a bf16 rounding boundary, a change of at most
 * 2^-7 p. So out (bf16) is within 2^-7 (|out| + sum p |v| / l) of the CPU's, the second term
 * what such changes can add up to (the attention output of |v|, computed by the CPU kernel), the
 * first the two bf16 roundings of out; lse within 1e-5. The gradients move likewise where a
 * probability or a score gradient rounds the other way, an element by up to a few percent of the
 * tensor's largest value where p is near 1: they are checked as test_cuda checks the GPU's
 * (att_close.h: relative L2 error within 1e-3, the largest error within 5e-2 of the
 * largest value), compared as what each side added to the same dqkv, and for the whole sequence
 * as what each side wrote (over NaN on the emulated side). */
static void expect_att_close(const char *what, const std::vector<float> &got,
                             const std::vector<float> &want)
{
  double l2, worst;
  ck_assert_msg(att_close(got.data(), want.data(), want.size(), &l2, &worst),
                "%s: relative L2 error %.3g (at most %.0e), largest error %.3g of the largest "
                "value (at most %.0e), over %zu values",
                what, l2, ATT_L2_TOL, worst, ATT_MAX_TOL, want.size());
}

template <int HSM> static void check_mma(int B, int T, int C, int NH, int cp, bool off16 = false)
{
  ck_assert_int_eq(flash_bucket(C / NH), HSM);
  const int Tq = T / cp;
  std::vector<float> qkv;
  std::vector<uint16_t> qkv16;
  bf16_qkv(randn((size_t)B * T * 3 * C), &qkv, &qkv16);
  /* off16: the kernels' q, k, v and dout 8 bytes past a 16-byte boundary (std::vector's data is
   * 16-byte aligned), which the tiles' 16-byte loads must not be used for. */
  if (off16)
    qkv16.insert(qkv16.begin(), 4, (uint16_t)0);
  const uint16_t *qkv_g = qkv16.data() + (off16 ? 4 : 0);
  for (int r = 0; r < cp; r++) {
    const int q0 = r * Tq;
    const size_t nout = (size_t)B * Tq * C, nlse = (size_t)B * NH * Tq;
    std::vector<float> out_h(nout, 1e30f), lse_h(nlse, 1e30f), lse_g(nlse, -1e30f);
    std::vector<uint16_t> out_g(nout, (uint16_t)0xffff); /* bf16 out: all-ones bits (NaN) */
    ck_assert_int_eq(dt_cpu_attention_forward_flash_bf16(out_h.data(), lse_h.data(), qkv.data(), B,
                                                         Tq, q0, T, C, NH),
                     0);
    emul_mma_forward<HSM>(out_g.data(), lse_g.data(), qkv_g, B, Tq, q0, T, C, NH);
    if (fwg_fits(C, NH, qkv_g)) {
      /* the wgmma forward: the same bits here, where both products sum in the same order (a
       * GPU's tensor cores may not: test_cuda compares them within its tolerance there) */
      std::vector<uint16_t> out_w(nout, (uint16_t)0xffff);
      std::vector<float> lse_w(nlse, -1e30f);
      emul_wgmma_forward(out_w.data(), lse_w.data(), qkv_g, B, Tq, q0, T, C, NH);
      ck_assert(out_w == out_g);
      ck_assert(memcmp(lse_w.data(), lse_g.data(), nlse * sizeof lse_w[0]) == 0);
    }
    /* out in bf16 against the CPU's fp32 out rounded (the backward takes the CPU's on both sides),
     * within the bound above: abs_h is the CPU's attention output with |v| for v */
    std::vector<float> out_r, qkv_abs(qkv), abs_h(nout), lse_abs(nlse);
    for (size_t i = 0; i < qkv_abs.size(); i++)
      if (i % (3 * (size_t)C) >= 2 * (size_t)C)
        qkv_abs[i] = fabsf(qkv_abs[i]);
    ck_assert_int_eq(dt_cpu_attention_forward_flash_bf16(abs_h.data(), lse_abs.data(),
                                                         qkv_abs.data(), B, Tq, q0, T, C, NH),
                     0);
    std::vector<uint16_t> out16;
    bf16_qkv(out_h, &out_r, &out16);
    size_t i = 0; /* the first out of bounds, then one assertion (each records its line) */
    while (i < nout &&
           fabsf(bf16_value(out_g[i]) - out_r[i]) <= 0x1p-7f * (fabsf(out_r[i]) + abs_h[i]))
      i++;
    ck_assert_msg(i == nout, "bf16 forward out [%zu]: %g, %g (|v| attention %g)", i,
                  (double)bf16_value(out_g[i % nout]), (double)out_r[i % nout],
                  (double)abs_h[i % nout]);
    expect_close("bf16 forward lse", lse_g, lse_h);

    const std::vector<float> dout = randn(nout), dqkv0 = randn((size_t)B * T * 3 * C);
    std::vector<float> dout_g(dout);
    if (off16)
      dout_g.insert(dout_g.begin(), 2, 0.0f);
    const float *dout_gp = dout_g.data() + (off16 ? 2 : 0);
    for (int add = 1; add >= (cp == 1 ? 0 : 1); add--) {
      std::vector<float> dqkv_h = dqkv0, dqkv_g(dqkv0.size(), NAN);
      if (add)
        dqkv_g = dqkv0;
      ck_assert_int_eq(dt_cpu_attention_backward_flash_bf16(dqkv_h.data(), dout.data(), qkv.data(),
                                                            out_r.data(), lse_h.data(), B, Tq, q0,
                                                            T, C, NH, add),
                       0);
      emul_mma_backward<HSM>(dqkv_g.data(), dout_gp, qkv_g, out16.data(), lse_h.data(), B, Tq, q0,
                             T, C, NH, add);
      if (add == (cp > 1) && !dt_emul::g_cp_early) {
        /* the workspace's other plans, the same bits: one head's tiles at a time (one sequence
         * where NH is 1), and none (the recomputing dq kernel); once a shape */
        const fmma_ws_plan w = fmma_backward_ws(B, Tq, q0, NH);
        const size_t per_h = (w.bytes - w.ds_offset) / ((size_t)w.seqs * w.heads);
        for (size_t max_bytes : {per_h, (size_t)1}) {
          ck_assert_int_eq(fmma_backward_ws(B, Tq, q0, NH, max_bytes).heads, max_bytes > 1);
          std::vector<float> other(dqkv0.size(), NAN);
          if (add)
            other = dqkv0;
          emul_mma_backward<HSM>(other.data(), dout_gp, qkv_g, out16.data(), lse_h.data(), B, Tq,
                                 q0, T, C, NH, add, max_bytes);
          ck_assert(memcmp(other.data(), dqkv_g.data(), other.size() * sizeof other[0]) == 0);
        }
      }
      if (add) {
        expect_att_close("bf16 backward dqkv (+=)", minus(dqkv_g, dqkv0), minus(dqkv_h, dqkv0));
        continue;
      }
      expect_att_close("bf16 backward dqkv (=)", dqkv_g, dqkv_h);
      /* into bf16 (the whole sequence's dqkv16): the same gradients, rounded as stored, bit for
       * bit, over all-ones bits (an element not written fails) */
      std::vector<uint16_t> d16(dqkv0.size(), (uint16_t)0xffff);
      emul_mma_backward<HSM>(d16.data(), dout_gp, qkv_g, out16.data(), lse_h.data(), B, Tq, q0, T,
                             C, NH, false);
      size_t j = 0;
      while (j < d16.size() && bf16_value(d16[j]) == dt_bf16_round(dqkv_g[j]))
        j++;
      ck_assert_msg(j == d16.size(), "bf16 backward dqkv into bf16 [%zu]: %g, %g", j,
                    (double)bf16_value(d16[j % d16.size()]), (double)dqkv_g[j % d16.size()]);
      /* from a bf16 dout (dout16: the attention projection's bf16 input gradient), with the
       * same offset: the gradients of dout's values rounded in fp32, bit for bit */
      std::vector<float> dout_r;
      std::vector<uint16_t> dout16, e16(d16.size(), (uint16_t)0xffff), f16 = e16;
      bf16_qkv(dout, &dout_r, &dout16);
      if (off16)
        dout_r.insert(dout_r.begin(), 2, 0.0f), dout16.insert(dout16.begin(), 4, (uint16_t)0);
      emul_mma_backward<HSM>(e16.data(), dout_r.data() + (off16 ? 2 : 0), qkv_g, out16.data(),
                             lse_h.data(), B, Tq, q0, T, C, NH, false);
      emul_mma_backward<HSM>(f16.data(), dout16.data() + (off16 ? 4 : 0), qkv_g, out16.data(),
                             lse_h.data(), B, Tq, q0, T, C, NH, false);
      ck_assert(f16 == e16);
    }
    std::vector<float> dout_r;
    std::vector<uint16_t> g16;
    bf16_qkv(dout, &dout_r, &g16);
    if (fwg_dkdv_fits(C, NH, qkv_g, g16.data())) {
      /* the dk/dv and dq kernels on wgmma, from the bf16 dout: the same bits here (as the
       * forward's), added into fp32 under each workspace plan, and (the whole sequence) into bf16
       */
      for (size_t max_bytes : {FMMA_DS_MAX_BYTES, (size_t)1}) {
        std::vector<float> p32 = dqkv0, w32 = dqkv0;
        emul_mma_backward<HSM>(p32.data(), g16.data(), qkv_g, out16.data(), lse_h.data(), B, Tq, q0,
                               T, C, NH, true, max_bytes);
        emul_mma_backward<HSM>(w32.data(), g16.data(), qkv_g, out16.data(), lse_h.data(), B, Tq, q0,
                               T, C, NH, true, max_bytes, true);
        ck_assert(memcmp(p32.data(), w32.data(), p32.size() * sizeof p32[0]) == 0);
      }
      if (cp == 1) {
        std::vector<uint16_t> p16(dqkv0.size(), (uint16_t)0xffff), w16 = p16;
        emul_mma_backward<HSM>(p16.data(), g16.data(), qkv_g, out16.data(), lse_h.data(), B, Tq, q0,
                               T, C, NH, false);
        emul_mma_backward<HSM>(w16.data(), g16.data(), qkv_g, out16.data(), lse_h.data(), B, Tq, q0,
                               T, C, NH, false, FMMA_DS_MAX_BYTES, true);
        ck_assert(w16 == p16);
      }
    }
  }
}

START_TEST(test_flash_kernels)
{
  dt_rng_seed(&g_rng, 71);
  check<32>(2, 37, 48, 4, 1);             /* hs 12, T prime: partial tiles everywhere */
  check<32>(3, 70, 64, 2, 1);             /* hs 32, T over a 64-row block */
  check<32>(1, 1, 24, 3, 1);              /* a single position */
  check<32>(2, 40, 45, 3, 1);             /* hs 15, odd: no pairs, no 16-byte rows */
  check<64>(1, 130, 128, 2, 1);           /* hs 64 (GPT-2's): three query blocks, five key blocks */
  check<128>(1, 75, 200, 2, 1);           /* hs 100 */
  check<32>(2, 150, 48, 4, 3);            /* chunks of 50: q0 off the tiles */
  check<64>(1, 200, 128, 2, 2);           /* chunks of 100 */
  ck_assert_int_eq(flash_bucket(129), 0); /* attention.cu refuses it */
}
END_TEST

START_TEST(test_flash_mma_kernels)
{
  /* cp.async copies landing as late, then as early, as the GPU may land them (cuda_emul.h) */
  for (int early = 0; early <= 1; early++) {
    dt_emul::g_cp_early = early;
    dt_rng_seed(&g_rng, 72);
    check_mma<32>(2, 37, 48, 4, 1);         /* hs 12, T prime: partial tiles everywhere */
    check_mma<64>(1, 130, 128, 2, 1);       /* hs 64 (GPT-2's): three row blocks */
    check_mma<32>(1, 1, 24, 3, 1);          /* a single position */
    check_mma<128>(1, 75, 200, 2, 1);       /* hs 100 */
    check_mma<64>(1, 150, 192, 3, 3);       /* chunks of 50: q0 off the tiles */
    check_mma<64>(1, 120, 128, 2, 2);       /* chunks of 60: the diagonal 3 keys into a tile */
    check_mma<32>(2, 40, 90, 3, 1);         /* hs 30, rows of 270 floats: the tiles' 4-byte loads */
    check_mma<64>(1, 130, 128, 2, 1, true); /* hs 64 off a 16-byte boundary: 4-byte loads too */
    check_mma<64>(1, 1, 64, 1, 1);          /* hs 64, a single position: one key tile */
    check_mma<64>(2, 256, 128, 2, 1);       /* hs 64, whole tiles: 4 key steps, both buffers */
  }
  dt_emul::g_cp_early = false;
}
END_TEST

int main(void)
{
  Suite *s = suite_create("flash_emulated");
  TCase *tc = tcase_create("kernels");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_flash_kernels);
  tcase_add_test(tc, test_flash_mma_kernels);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  const int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
