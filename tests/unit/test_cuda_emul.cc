/* test_cuda_emul.cc — the CUDA backend's own kernels (the .cuh headers of kernels/cuda: LayerNorm,
 * cross-entropy, embeddings, causal softmax, GELU, residual, AdamW, the linear layer's bias seed
 * and bf16 copies, the device's accumulate and fill) run on the host under cuda_emul.h, against
 * the CPU kernels (kernels/cpu/) or, where the CPU has no kernel of its own, a plain reference:
 * on machines without a GPU, so that every CI run executes the GPU code, not only compiles it.
 * (The flash kernels are test_flash_emul's.) What cuBLAS runs is checked as gemm.cuh's
 * descriptors, the column-major views (and the bias epilogue) matmul.cu and attention.cu issue,
 * through a reference GEMM; cuBLAS and cuBLASLt themselves run only on a GPU, in test_cuda.
 *
 * The launches mirror the .cu files' (grids, block sizes, the layernorm chunking from
 * layernorm.cuh). Shapes are small, since each CUDA thread is an OS thread here, but every
 * path of the kernels is taken: C not a multiple of 32, several row chunks, rows shorter and
 * longer than a block, a vocabulary slice with tokens outside it, an empty slice, q0 > 0. The
 * tolerance is test_cuda's (max |gpu - cpu| <= 1e-5 of the tensor's largest value: the two sum
 * in other orders); what has no sum to reorder must be bit-identical (embeddings, AdamW, the
 * residual, the copies), and so must a fused kernel and the kernels it fuses. GELU is within 1e-6:
 * tanhf here is glibc's on both sides. */
#include <check.h>

#include <algorithm>
#include <cmath>
#include <vector>

extern "C" {
#include "cpu_kernels.h"
#include "rng.h"
}

#include "cuda_emul.h"
#include "emul_expect.h"
#include "adamw.cuh"
#include "crossentropy.cuh"
#include "device.cuh"
#include "encoder.cuh"
#include "gelu.cuh"
#include "gemm.cuh"
#include "layernorm.cuh"
#include "matmul.cuh"
#include "norm.cuh"
#include "residual.cuh"
#include "softmax.cuh"
#include "wgmma_tile.cuh"

static dt_rng_t g_rng;

static std::vector<float> randn(size_t n, float mean = 0.0f, float std = 1.0f)
{
  std::vector<float> v(n);
  dt_rng_normal(&g_rng, v.data(), n, mean, std);
  return v;
}

/* ---- LayerNorm (layernorm.cu's launches) --------------------------------------------------- */

START_TEST(test_layernorm)
{
  dt_rng_seed(&g_rng, 81);
  const int N = 100, C = 67; /* 4 row chunks of 32; C not a multiple of 32 */
  const size_t NC = (size_t)N * C;
  const std::vector<float> inp = randn(NC, 0.5f, 1.5f), w = randn(C, 1.0f, 0.2f),
                           b = randn(C, 0.0f, 0.2f);
  std::vector<float> out_h(NC), mean_h(N), rstd_h(N), out_g(NC, NAN), mean_g(N, NAN),
      rstd_g(N, NAN);
  dt_cpu_layernorm_forward(out_h.data(), mean_h.data(), rstd_h.data(), inp.data(), w.data(),
                           b.data(), N, C);
  launch(dim3(ln_blocks(N)), LN_THREADS, 0, [&] {
    layernorm_forward_kernel(out_g.data(), mean_g.data(), rstd_g.data(), inp.data(), w.data(),
                             b.data(), N, C);
  });
  expect_close("layernorm forward out", out_g, out_h);
  expect_close("layernorm forward mean", mean_g, mean_h);
  expect_close("layernorm forward rstd", rstd_g, rstd_h);

  /* backward, from the CPU's statistics; dinp, dweight, dbias accumulate (+=) */
  const std::vector<float> dout = randn(NC), dinp0 = randn(NC), dw0 = randn(C), db0 = randn(C);
  std::vector<float> dinp_h = dinp0, dw_h = dw0, db_h = db0;
  dt_cpu_layernorm_backward(dinp_h.data(), dw_h.data(), db_h.data(), dout.data(), inp.data(),
                            w.data(), mean_h.data(), rstd_h.data(), N, C);
  const int rows = ln_chunk_rows(N), nchunks = (N + rows - 1) / rows;
  ck_assert_int_eq(nchunks, 4);
  /* pass one as layernorm.cu runs it, from dout of type G: the fused kernel with `warps` warps,
   * or (warps 0) the dinp kernel and the partial sums' own; dinp += into dinp, the partial sums
   * into part (over NaN: a sum not written fails) */
  auto pass_one = [&](int warps, const auto *g, std::vector<float> &dinp,
                      std::vector<float> &part) {
    part.assign((size_t)2 * nchunks * C, NAN);
    float *pdw = part.data(), *pdb = pdw + (size_t)nchunks * C;
    if (warps > 0) {
      launch(dim3(nchunks), 32 * warps, ln_fused_smem_bytes(warps, C), [&] {
        layernorm_backward_fused_kernel(dinp.data(), pdw, pdb, g, inp.data(), w.data(),
                                        mean_h.data(), rstd_h.data(), N, C, rows);
      });
      return;
    }
    launch(dim3(ln_blocks(N)), LN_THREADS, 0, [&] {
      layernorm_backward_dinp_kernel(dinp.data(), g, inp.data(), w.data(), mean_h.data(),
                                     rstd_h.data(), N, C);
    });
    launch(dim3((C + LN_COL_THREADS - 1) / LN_COL_THREADS, nchunks), LN_COL_THREADS, 0, [&] {
      layernorm_backward_partial_kernel(pdw, pdb, g, inp.data(), mean_h.data(), rstd_h.data(), N, C,
                                        rows);
    });
  };
  std::vector<float> dinp_plain;
  for (int warps : {0, LN_FUSED_WARPS, 3, 1}) { /* fewer warps: wider rows' shared memory */
    std::vector<float> dinp_g = dinp0, dw_g = dw0, db_g = db0, part;
    pass_one(warps, dout.data(), dinp_g, part);
    const dt__csum_t sums = {{dw_g.data(), db_g.data()},
                             {part.data(), part.data() + (size_t)nchunks * C}};
    launch(dim3((C + DT__CSUM_COLS - 1) / DT__CSUM_COLS, 1, 2), DT__CSUM_THREADS, 0,
           [&] { dt__column_sums_kernel(sums, nchunks, C); });
    expect_close("layernorm backward dinp (+=)", dinp_g, dinp_h);
    expect_close("layernorm backward dweight (+=)", dw_g, dw_h);
    expect_close("layernorm backward dbias (+=)", db_g, db_h);
    if (warps == 0)
      dinp_plain = dinp_g;
    ck_assert(dinp_g == dinp_plain); /* the fused kernel's dinp: the dinp kernel's bits */

    /* from a bf16 dout: the fp32 kernels' results on the same values, bit for bit */
    std::vector<__nv_bfloat16> d16(NC);
    std::vector<float> dr(NC), dinp_r = dinp0, dinp_b = dinp0, part_r, part_b;
    for (size_t i = 0; i < NC; i++)
      d16[i] = __float2bfloat16_rn(dout[i]), dr[i] = dt_bf16_round(dout[i]);
    pass_one(warps, dr.data(), dinp_r, part_r);
    pass_one(warps, d16.data(), dinp_b, part_b);
    ck_assert(dinp_b == dinp_r);
    ck_assert(part_b == part_r);
  }
}
END_TEST

/* ---- Cross-entropy (crossentropy.cu's launches: a block of CE_THREADS per row) ------------- */

static std::vector<int> targets(int N, int V)
{
  std::vector<int> t(N);
  for (int i = 0; i < N; i++)
    t[i] = (int)dt_rng_below(&g_rng, (uint64_t)V);
  return t;
}

START_TEST(test_crossentropy)
{
  dt_rng_seed(&g_rng, 82);
  const int N = 13, V = 77, Vp = 96;
  const std::vector<int> tgt = targets(N, V);
  for (float dloss : {0.25f, 0.0f}) /* 0: the logits are left alone */
    for (int keep : {0, 1}) {       /* the row kept in shared memory between the passes */
      std::vector<float> logits_h = randn((size_t)N * Vp, 0.0f, 3.0f), logits_g = logits_h;
      std::vector<float> loss_h(N), loss_g(N, NAN);
      dt_cpu_crossentropy_forward_backward(loss_h.data(), logits_h.data(), tgt.data(), dloss, N, V,
                                           Vp);
      launch(dim3(N), CE_THREADS, keep ? Vp * sizeof(float) : 0, [&] {
        crossentropy_kernel<float>(loss_g.data(), logits_g.data(), tgt.data(), dloss, V, Vp, keep);
      });
      expect_close("crossentropy losses", loss_g, loss_h);
      expect_close(dloss != 0.0f ? "crossentropy dlogits" : "crossentropy logits kept", logits_g,
                   logits_h);
    }
  /* bf16 logits, over several passes of the block (Vp > CE_THREADS; vectors two a thread, then
   * one): the same losses as the fp32 kernel on the same values, and its dlogits rounded, bit for
   * bit, in place of the bf16 logits (the padding columns 0); the row kept in shared memory
   * between the passes or read twice: the same bits. */
  const int N2 = 3, V2 = 9000, Vp2 = 9088;
  const std::vector<int> tgt2 = targets(N2, V2);
  std::vector<float> l32 = randn((size_t)N2 * Vp2, 0.0f, 3.0f);
  std::vector<__nv_bfloat16> l16(l32.size());
  for (size_t i = 0; i < l32.size(); i++)
    l16[i] = __float2bfloat16_rn(l32[i]), l32[i] = dt_bf16_round(l32[i]);
  for (float dloss : {0.5f, 0.0f}) {
    std::vector<float> twice32, twice_loss;
    for (int keep : {0, 1}) {
      std::vector<float> g32 = l32, loss32(N2, NAN), loss16(N2, NAN);
      std::vector<__nv_bfloat16> g16 = l16;
      launch(dim3(N2), CE_THREADS, keep ? Vp2 * sizeof(float) : 0, [&] {
        crossentropy_kernel<float>(loss32.data(), g32.data(), tgt2.data(), dloss, V2, Vp2, keep);
      });
      launch(dim3(N2), CE_THREADS, keep ? Vp2 * sizeof(__nv_bfloat16) : 0, [&] {
        crossentropy_kernel<__nv_bfloat16>(loss16.data(), g16.data(), tgt2.data(), dloss, V2, Vp2,
                                           keep);
      });
      ck_assert(loss16 == loss32);
      size_t i = 0;
      while (i < g16.size() && __bfloat162float(g16[i]) == dt_bf16_round(g32[i]))
        i++;
      ck_assert_msg(i == g16.size(), "bf16 dlogit [%zu][%zu] (dloss %g, keep %d): %g, want %g",
                    i / Vp2, i % Vp2, (double)dloss, keep,
                    (double)__bfloat162float(g16[i < g16.size() ? i : 0]),
                    (double)dt_bf16_round(g32[i < g16.size() ? i : 0]));
      if (keep)
        ck_assert(g32 == twice32 && loss32 == twice_loss);
      else
        twice32 = g32, twice_loss = loss32;
    }
  }
}
END_TEST

/* Two ranks' slices of the vocabulary, [0, 40) and [40, 77), rows ldl apart, then a rank with
 * an empty slice: each one's stats, then the finish from all the stats, against the CPU. */
START_TEST(test_crossentropy_vocab_parallel)
{
  dt_rng_seed(&g_rng, 83);
  const int N = 9, V = 77, ldl = 48, R = 3, lo[R] = {0, 40, 77}, Vl[R] = {40, 37, 0};
  const std::vector<int> tgt = targets(N, V);
  std::vector<std::vector<float>> logits(R);
  std::vector<float> all_h((size_t)R * N * 3), all_g((size_t)R * N * 3, NAN);
  for (int r = 0; r < R; r++) {
    logits[r] = randn((size_t)N * ldl, 0.0f, 3.0f);
    dt_cpu_crossentropy_vp_stats(all_h.data() + (size_t)r * N * 3, logits[r].data(), tgt.data(),
                                 lo[r], N, Vl[r], ldl);
    launch(dim3(N), CE_THREADS, 0, [&] {
      vp_stats_kernel(all_g.data() + (size_t)r * N * 3, logits[r].data(), tgt.data(), lo[r], Vl[r],
                      ldl);
    });
  }
  for (size_t i = 0; i < all_h.size(); i++) /* -inf for the empty slice: compare it exactly */
    if (std::isinf(all_h[i])) {
      ck_assert_msg(all_g[i] == all_h[i], "vp stats[%zu] = %g, want %g", i, all_g[i], all_h[i]);
      all_g[i] = all_h[i] = 0.0f;
    }
  expect_close("crossentropy vp stats", all_g, all_h);
  for (int r = 0; r < R; r++) /* the finish takes the CPU's stats on both sides */
    dt_cpu_crossentropy_vp_stats(all_h.data() + (size_t)r * N * 3, logits[r].data(), tgt.data(),
                                 lo[r], N, Vl[r], ldl);
  for (int r = 0; r < R - 1; r++) {
    std::vector<float> lh = logits[r], lg = logits[r], loss_h(N), loss_g(N, NAN);
    dt_cpu_crossentropy_vp_finish(loss_h.data(), lh.data(), all_h.data(), R, tgt.data(), lo[r],
                                  0.5f, N, Vl[r], ldl);
    launch(dim3(N), CE_THREADS, 0, [&] {
      vp_finish_kernel(loss_g.data(), lg.data(), all_h.data(), R, tgt.data(), lo[r], 0.5f, N, Vl[r],
                       ldl);
    });
    expect_close("crossentropy vp losses", loss_g, loss_h);
    expect_close("crossentropy vp dlogits (padding zeroed)", lg, lh);
  }
  /* bf16 slices: stats, losses and the dlogits (rounded) those of the fp32 kernels on the same
   * values, bit for bit */
  for (int r = 0; r < R; r++) {
    std::vector<float> l32 = logits[r], s32(N * 3, NAN), s16(N * 3, NAN), loss32(N, NAN),
                       loss16(N, NAN);
    std::vector<__nv_bfloat16> l16(l32.size());
    for (size_t i = 0; i < l32.size(); i++)
      l16[i] = __float2bfloat16_rn(l32[i]), l32[i] = dt_bf16_round(l32[i]);
    launch(dim3(N), CE_THREADS, 0,
           [&] { vp_stats_kernel(s32.data(), l32.data(), tgt.data(), lo[r], Vl[r], ldl); });
    launch(dim3(N), CE_THREADS, 0,
           [&] { vp_stats_kernel(s16.data(), l16.data(), tgt.data(), lo[r], Vl[r], ldl); });
    ck_assert(memcmp(s32.data(), s16.data(), s32.size() * sizeof(float)) == 0);
    launch(dim3(N), CE_THREADS, 0, [&] {
      vp_finish_kernel(loss32.data(), l32.data(), all_h.data(), R, tgt.data(), lo[r], 0.5f, N,
                       Vl[r], ldl);
    });
    launch(dim3(N), CE_THREADS, 0, [&] {
      vp_finish_kernel(loss16.data(), l16.data(), all_h.data(), R, tgt.data(), lo[r], 0.5f, N,
                       Vl[r], ldl);
    });
    ck_assert(loss16 == loss32);
    for (size_t i = 0; i < l16.size(); i++)
      ck_assert_msg(__bfloat162float(l16[i]) == dt_bf16_round(l32[i]),
                    "vp bf16 dlogit [%zu][%zu] of rank %d: %g, want %g", i / ldl, i % ldl, r,
                    (double)__bfloat162float(l16[i]), (double)dt_bf16_round(l32[i]));
  }
}
END_TEST

/* ---- Embeddings (encoder.cu's launches) ------------------------------------------------------ */

/* encoder.cu's token-gradient pass: the host's buckets (encoder_buckets), then the kernel with
 * its launch geometry (16 channels a block here, so that C spans several). */
static void backward_wte(float *dwte, int lo, int vn, const float *dout, const int *inp, size_t BT,
                         int C)
{
  std::vector<int> count((size_t)vn + 1), list(2 * std::min(BT, (size_t)vn) + 1 + BT, -1);
  const int nb = encoder_buckets(inp, BT, lo, vn, count.data(), list.data());
  const unsigned threads = 16;
  launch(dim3((unsigned)nb, (unsigned)((C + 15) / 16)), threads, 0,
         [&] { encoder_backward_wte_kernel(dwte, dout, list.data(), nb, C); });
}

START_TEST(test_encoder)
{
  dt_rng_seed(&g_rng, 84);
  const int B = 3, T = 11, C = 40, V = 90, lo = 30, vn = 45, maxT = 16;
  const size_t BT = (size_t)B * T;
  const std::vector<int> inp = targets((int)BT, V); /* tokens inside and outside the slice */
  const std::vector<float> wte = randn((size_t)vn * C), wpe = randn((size_t)maxT * C);
  std::vector<float> out_h(BT * C), out_g(BT * C, NAN);
  dt_cpu_encoder_forward(out_h.data(), inp.data(), wte.data(), lo, vn, wpe.data(), B, T, C);
  const size_t total = BT * C;
  launch(dim3(dt__cuda_grid(total, DT__CUDA_THREADS)), DT__CUDA_THREADS, 0, [&] {
    encoder_forward_kernel(out_g.data(), inp.data(), wte.data(), lo, vn, wpe.data(), T, C, total);
  });
  ck_assert(out_g == out_h);

  const std::vector<float> dout = randn(BT * C), dwte0 = randn((size_t)vn * C),
                           dwpe0 = randn((size_t)maxT * C);
  std::vector<float> dwte_h = dwte0, dwpe_h = dwpe0, dwte_g = dwte0, dwpe_g = dwpe0;
  dt_cpu_encoder_backward(dwte_h.data(), lo, vn, dwpe_h.data(), dout.data(), inp.data(), B, T, C);
  backward_wte(dwte_g.data(), lo, vn, dout.data(), inp.data(), BT, C);
  const size_t TC = (size_t)T * C;
  launch(dim3(dt__cuda_grid(TC, DT__CUDA_THREADS)), DT__CUDA_THREADS, 0,
         [&] { encoder_backward_wpe_kernel(dwpe_g.data(), dout.data(), B, T, C); });
  ck_assert(dwte_g == dwte_h); /* one thread per element, the CPU's order: the same bits */
  ck_assert(dwpe_g == dwpe_h);

  /* A vocabulary of 6 and a slice of rows 1..4: every row hit many times, and tokens 0 and 5
   * outside the slice. */
  const std::vector<int> few = targets((int)BT, 6);
  const std::vector<float> dwte4 = randn((size_t)4 * C);
  std::vector<float> few_h = dwte4, few_g = dwte4;
  dt_cpu_encoder_backward(few_h.data(), 1, 4, NULL, dout.data(), few.data(), B, T, C);
  backward_wte(few_g.data(), 1, 4, dout.data(), few.data(), BT, C);
  ck_assert(few_g == few_h);
}
END_TEST

/* ---- Causal softmax (attention.cu's materialised path) ------------------------------------- */

/* Rows of Tq queries at q0 (over BH heads) against Tk = q0 + Tq keys: the probabilities over
 * keys j <= q0 + t and exact zeros after, then the softmax backward dS = scale A (dA - sum A dA),
 * against double references. */
START_TEST(test_causal_softmax)
{
  dt_rng_seed(&g_rng, 85);
  const int BH = 3, Tq = 5, q0 = 300, Tk = q0 + Tq; /* rows longer than a block of 256 */
  const float scale = 0.125f;
  const size_t n = (size_t)BH * Tq * Tk;
  const std::vector<float> scores = randn(n, 0.0f, 2.0f), dA = randn(n);
  std::vector<float> att = scores, want(n), dS = dA, dwant(n);
  for (size_t r = 0; r < (size_t)BH * Tq; r++) {
    const int t = q0 + (int)(r % Tq);
    const float *s = &scores[r * Tk];
    double m = -INFINITY, sum = 0.0;
    for (int j = 0; j <= t; j++)
      m = std::max(m, (double)s[j]);
    for (int j = 0; j <= t; j++)
      sum += exp((double)s[j] - m);
    for (int j = 0; j < Tk; j++)
      want[r * Tk + j] = j <= t ? (float)(exp((double)s[j] - m) / sum) : 0.0f;
  }
  launch(dim3(BH * Tq), ATT_THREADS, 0, [&] { causal_softmax_kernel(att.data(), Tq, Tk, q0); });
  expect_close("causal softmax", att, want);
  for (size_t i = 0; i < n; i++)
    if (want[i] == 0.0f)
      ck_assert_msg(att[i] == 0.0f, "causal softmax [%zu] = %g above the diagonal", i, att[i]);

  for (size_t r = 0; r < (size_t)BH * Tq; r++) {
    const int t = q0 + (int)(r % Tq);
    double dot = 0.0;
    for (int j = 0; j <= t; j++)
      dot += (double)want[r * Tk + j] * dA[r * Tk + j];
    for (int j = 0; j < Tk; j++)
      dwant[r * Tk + j] =
          j <= t ? (float)(scale * want[r * Tk + j] * ((double)dA[r * Tk + j] - dot)) : 0.0f;
  }
  launch(dim3(BH * Tq), ATT_THREADS, 0,
         [&] { causal_softmax_backward_kernel(dS.data(), want.data(), Tq, Tk, q0, scale); });
  expect_close("causal softmax backward", dS, dwant);
}
END_TEST

/* ---- Elementwise kernels (their launches: dt__cuda_grid(n, DT__CUDA_THREADS) blocks) ------- */

/* Runs body over n elements as the .cu files launch elementwise kernels. */
template <typename F> static void launch_elementwise(size_t n, F body)
{
  launch(dim3(dt__cuda_grid(n, DT__CUDA_THREADS)), DT__CUDA_THREADS, 0, body);
}

START_TEST(test_gelu_residual)
{
  dt_rng_seed(&g_rng, 86);
  const size_t n = 3001;
  const std::vector<float> x = randn(n, 0.0f, 2.0f), y = randn(n), dout = randn(n);
  std::vector<float> out_h(n), out_g(n, NAN);
  dt_cpu_gelu_forward(out_h.data(), x.data(), n);
  launch_elementwise(n, [&] { gelu_forward_kernel(out_g.data(), x.data(), n); });
  expect_close("gelu forward", out_g, out_h, 1e-6);
  /* bf16 output: the fp32 kernel's values rounded to nearest even, bit for bit (the bf16
   * activation the next linear layer reads); the CPU's (rounded floats) agree to bf16's ulp */
  std::vector<__nv_bfloat16> out16(n, __nv_bfloat16{0xffffu});
  launch_elementwise(n, [&] { gelu_forward_kernel(out16.data(), x.data(), n); });
  std::vector<float> out16_h(n);
  dt_cpu_gelu_forward(out16_h.data(), x.data(), n);
  dt_cpu_to_bf16(out16_h.data(), out16_h.data(), n);
  float scale = 0.0f;
  for (size_t i = 0; i < n; i++)
    scale = fmaxf(scale, fabsf(out_h[i]));
  for (size_t i = 0; i < n; i++) { /* within bf16's half ulp of each, plus the fp32 tolerance */
    const float v = __bfloat162float(out16[i]);
    ck_assert_msg(v == dt_bf16_round(out_g[i]), "gelu bf16 [%zu]: %g, the fp32 kernel's %g", i,
                  (double)v, (double)out_g[i]);
    ck_assert_msg(fabsf(v - out16_h[i]) <= 0x1p-8f * fabsf(out16_h[i]) + 1e-6f * scale,
                  "gelu bf16 [%zu]: %g, the CPU's %g", i, (double)v, (double)out16_h[i]);
  }
  /* bf16 input (the fc layer's bf16 output): the fp32 kernel's values on the same rounded
   * inputs, rounded, bit for bit */
  std::vector<__nv_bfloat16> x16(n), outb(n, __nv_bfloat16{0xffffu});
  std::vector<float> xr(n), outr(n, NAN);
  for (size_t i = 0; i < n; i++)
    x16[i] = __float2bfloat16_rn(x[i]), xr[i] = dt_bf16_round(x[i]);
  launch_elementwise(n, [&] { gelu_forward_kernel(outb.data(), x16.data(), n); });
  launch_elementwise(n, [&] { gelu_forward_kernel(outr.data(), xr.data(), n); });
  for (size_t i = 0; i < n; i++)
    ck_assert_msg(__bfloat162float(outb[i]) == dt_bf16_round(outr[i]), "gelu bf16 in [%zu]", i);
  std::vector<float> din_h(n), din_g = dout; /* dinp aliases dout on the GPU side */
  dt_cpu_gelu_backward(din_h.data(), x.data(), dout.data(), n);
  launch_elementwise(n, [&] { gelu_backward_kernel(din_g.data(), x.data(), din_g.data(), n); });
  expect_close("gelu backward (in place)", din_g, din_h, 1e-6);
  std::vector<float> sum_h(n), sum_g(n, NAN);
  dt_cpu_residual_forward(sum_h.data(), x.data(), y.data(), n);
  launch_elementwise(n, [&] { residual_forward_kernel(sum_g.data(), x.data(), y.data(), n); });
  ck_assert(sum_g == sum_h);
}
END_TEST

/* The residual add fused in front of the LayerNorm (layernorm.cu's launch: a block per row):
 * the bits of the residual kernel then the LayerNorm kernel, launched as their .cu files
 * launch them, and the CPU's fused kernel within the tolerance; the sum also over a. */
START_TEST(test_residual_layernorm)
{
  dt_rng_seed(&g_rng, 87);
  const int N = 9, C = 300; /* C: more than a block's threads, not a multiple of 32 */
  const size_t NC = (size_t)N * C;
  const std::vector<float> a = randn(NC, 0.5f, 1.0f), b = randn(NC, 0.0f, 2.0f),
                           w = randn(C, 1.0f, 0.2f), bias = randn(C, 0.0f, 0.2f);
  std::vector<float> sum_s(NC, NAN), out_s(NC, NAN), mean_s(N, NAN), rstd_s(N, NAN);
  launch_elementwise(NC, [&] { residual_forward_kernel(sum_s.data(), a.data(), b.data(), NC); });
  launch(dim3(ln_blocks(N)), LN_THREADS, 0, [&] {
    layernorm_forward_kernel(out_s.data(), mean_s.data(), rstd_s.data(), sum_s.data(), w.data(),
                             bias.data(), N, C);
  });
  std::vector<float> sum_h(NC), out_h(NC), mean_h(N), rstd_h(N);
  dt_cpu_residual_layernorm_forward(sum_h.data(), out_h.data(), mean_h.data(), rstd_h.data(),
                                    a.data(), b.data(), w.data(), bias.data(), N, C);
  for (int alias = 0; alias < 2; alias++) {
    std::vector<float> sum_g = alias ? a : std::vector<float>(NC, NAN), out_g(NC, NAN),
                       mean_g(N, NAN), rstd_g(N, NAN);
    const float *x = alias ? sum_g.data() : a.data();
    launch(dim3(ln_blocks(N)), LN_THREADS, 0, [&] {
      residual_layernorm_forward_kernel(sum_g.data(), out_g.data(), mean_g.data(), rstd_g.data(), x,
                                        b.data(), w.data(), bias.data(), N, C);
    });
    ck_assert(sum_g == sum_s && out_g == out_s && mean_g == mean_s && rstd_g == rstd_s);
    ck_assert(sum_g == sum_h);
    expect_close("residual layernorm out", out_g, out_h);
    expect_close("residual layernorm mean", mean_g, mean_h);
    expect_close("residual layernorm rstd", rstd_g, rstd_h);
  }
  /* bf16 outputs: the fp32 kernels' values rounded to nearest even, bit for bit, the rest equal */
  std::vector<__nv_bfloat16> o16(NC, __nv_bfloat16{0xffffu}), r16(NC, __nv_bfloat16{0xffffu});
  std::vector<float> m16(N, NAN), s16(N, NAN), mr16(N, NAN), sr16(N, NAN), sum16(NC, NAN);
  launch(dim3(ln_blocks(N)), LN_THREADS, 0, [&] {
    layernorm_forward_kernel(o16.data(), m16.data(), s16.data(), sum_s.data(), w.data(),
                             bias.data(), N, C);
  });
  launch(dim3(ln_blocks(N)), LN_THREADS, 0, [&] {
    residual_layernorm_forward_kernel(sum16.data(), r16.data(), mr16.data(), sr16.data(), a.data(),
                                      b.data(), w.data(), bias.data(), N, C);
  });
  ck_assert(m16 == mean_s && s16 == rstd_s && mr16 == mean_s && sr16 == rstd_s && sum16 == sum_s);
  for (size_t i = 0; i < NC; i++) {
    ck_assert_msg(__bfloat162float(o16[i]) == dt_bf16_round(out_s[i]), "layernorm bf16 [%zu]", i);
    ck_assert_msg(__bfloat162float(r16[i]) == dt_bf16_round(out_s[i]), "residual bf16 [%zu]", i);
  }
}
END_TEST

/* ---- The products cuBLAS runs (gemm.cuh's descriptors, as matmul.cu and attention.cu issue
 * them), through a reference column-major GEMM: what cuBLAS computes for a descriptor, per its
 * documented semantics. beta = 0 never reads C, and nothing outside the m x n blocks is written,
 * so the NaN and sentinel fills below stay where they are or the check fails. */

/* GELU (the tanh form, GPT-2's) and its derivative, in double. */
static double ref_gelu(double x)
{
  return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

static double ref_dgelu(double x)
{
  const double s = sqrt(2.0 / M_PI), u = s * (x + 0.044715 * x * x * x), th = tanh(u);
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * s * (1.0 + 3.0 * 0.044715 * x * x);
}

static void ref_gemm(const dt_gemm_t &g)
{
  for (int t = 0; t < g.batch; t++) {
    const float *A = (const float *)g.A.p + t * g.A.stride;
    const float *B = (const float *)g.B.p + t * g.B.stride;
    float *C = (float *)g.C + t * g.sC;
    for (int j = 0; j < g.n; j++)
      for (int i = 0; i < g.m; i++) {
        double acc = 0.0;
        for (int p = 0; p < g.k; p++) {
          const double a = g.ta ? A[p + (size_t)i * g.A.ld] : A[i + (size_t)p * g.A.ld];
          const double b = g.tb ? B[j + (size_t)p * g.B.ld] : B[p + (size_t)j * g.B.ld];
          acc += a * b;
        }
        const size_t at = i + (size_t)j * g.ldc;
        const double d =
            g.gelu_in ? ref_dgelu(__bfloat162float(((const __nv_bfloat16 *)g.gelu_in)[at])) : 1.0;
        const float *Cin = g.Cin ? g.Cin + t * g.sC : C; /* fp32 C only */
        const double c = g.beta != 0.0f ? (double)g.beta * Cin[at] : 0.0;
        const double b = !g.bias    ? 0.0
                         : g.bias16 ? (double)__bfloat162float(((const __nv_bfloat16 *)g.bias)[i])
                                    : (double)((const float *)g.bias)[i];
        float v = (float)((g.alpha * acc + c + b) * d);
        if (g.gelu_pre) { /* GELU_AUX: x into gelu_pre, GELU(x) into C */
          ((__nv_bfloat16 *)g.gelu_pre)[at] = __float2bfloat16_rn(v);
          v = (float)ref_gelu(v);
        }
        if (g.c16) /* rounded as it is stored */
          ((__nv_bfloat16 *)g.C + t * g.sC)[at] = __float2bfloat16_rn(v);
        else
          C[at] = v;
      }
  }
}

/* The linear layer as matmul.cu runs it (the forward's bias as the GEMM's epilogue; dinp
 * written, through a GELU by the DGELU epilogue, dweight and dbias accumulated), against the
 * CPU's, with padded output rows (ldo, ldd > OC) and with the contiguous dout of the bf16 path
 * (ldd = OC). */
static void check_linear(int N, int C, int OC, int ld, bool bias)
{
  const float pad = 7.25f;
  const std::vector<float> inp = randn((size_t)N * C), w = randn((size_t)OC * C), b = randn(OC),
                           dout = randn((size_t)N * ld), dw0 = randn((size_t)OC * C);
  std::vector<float> out_h((size_t)N * ld, pad), out_g((size_t)N * ld, pad);
  for (int r = 0; r < N; r++)
    for (int o = 0; o < OC; o++)
      out_g[(size_t)r * ld + o] = NAN; /* beta = 0 must not read it */
  dt_cpu_matmul_forward(out_h.data(), inp.data(), w.data(), bias ? b.data() : NULL, N, C, OC, ld);
  ref_gemm(gemm_linear_forward(out_g.data(), inp.data(), w.data(), bias ? b.data() : NULL, N, C, OC,
                               ld));
  expect_close("linear forward", out_g, out_h);
  const size_t total = (size_t)N * OC;
  if (bias) { /* the cuBLAS form (matmul.cu's fallback): the seed pass, then the product onto it */
    std::vector<float> out_s((size_t)N * ld, pad);
    launch_elementwise(total,
                       [&] { linear_seed_kernel(out_s.data(), b.data(), NULL, OC, ld, total); });
    ref_gemm(gemm_seeded(
        gemm_linear_forward(out_s.data(), inp.data(), w.data(), b.data(), N, C, OC, ld)));
    expect_close("linear forward, bias seeded", out_s, out_h);
  }
  /* With a residual (Cin, beta 1, as matmul.cu's forward with res): res + the CPU's output, by
   * the epilogue's form and by the cuBLAS form (seeded with res + bias); Cin itself unchanged */
  const std::vector<float> res = randn((size_t)N * ld);
  std::vector<float> want((size_t)N * ld, pad);
  for (int r = 0; r < N; r++)
    for (int o = 0; o < OC; o++)
      want[(size_t)r * ld + o] = res[(size_t)r * ld + o] + out_h[(size_t)r * ld + o];
  for (const bool seeded : {false, true}) {
    std::vector<float> out_r((size_t)N * ld, pad);
    dt_gemm_t g = gemm_linear_forward(out_r.data(), inp.data(), w.data(), bias ? b.data() : NULL, N,
                                      C, OC, ld);
    g.Cin = res.data(), g.beta = 1.0f;
    if (seeded) {
      launch_elementwise(total, [&] {
        linear_seed_kernel(out_r.data(), bias ? b.data() : NULL, res.data(), OC, ld, total);
      });
      g = gemm_seeded(g);
    }
    ref_gemm(g);
    expect_close(seeded ? "linear forward + residual, seeded" : "linear forward + residual", out_r,
                 want);
  }

  const std::vector<float> db0 = randn(OC), ones(N, 1.0f);
  std::vector<float> dinp_h((size_t)N * C), dinp_g((size_t)N * C, NAN), dw_h = dw0, dw_g = dw0,
                                                                        db_h = db0, db_g = db0;
  dt_cpu_matmul_backward(dinp_h.data(), dw_h.data(), db_h.data(), dout.data(), inp.data(), w.data(),
                         N, C, OC, ld);
  ref_gemm(gemm_linear_dinp(dinp_g.data(), dout.data(), w.data(), N, C, OC, ld));
  ref_gemm(gemm_linear_dweight(dw_g.data(), dout.data(), inp.data(), N, C, OC, ld));
  ref_gemm(gemm_linear_dbias(db_g.data(), dout.data(), ones.data(), N, OC, ld));
  expect_close("linear backward dinp", dinp_g, dinp_h);
  expect_close("linear backward dweight (+=)", dw_g, dw_h);
  expect_close("linear backward dbias (+=)", db_g, db_h);

  /* Into the MLP's activation (bf16, rows ld apart): GELU(x) and x itself (gelu_pre) of each
   * output x, by the GELU_AUX epilogue's form and matmul.cu's fallback (the fp32 product staged,
   * then gelu_aux_to_bf16_kernel), against the CPU's output, GELU and rounding: within bf16's ulp,
   * plus the fp32 tolerance; the columns past OC untouched */
  {
    const size_t no = (size_t)N * ld;
    std::vector<float> gl_h((size_t)N * OC), stage_f(total, NAN);
    for (int r = 0; r < N; r++)
      dt_cpu_gelu_forward(gl_h.data() + (size_t)r * OC, out_h.data() + (size_t)r * ld, (size_t)OC);
    std::vector<__nv_bfloat16> ge(no, __nv_bfloat16{0x7777u}), pe = ge, gs = ge, ps = ge;
    dt_gemm_t g =
        gemm_linear_forward(ge.data(), inp.data(), w.data(), bias ? b.data() : NULL, N, C, OC, ld);
    g.gelu_pre = pe.data(), g.c16 = 1;
    ref_gemm(g);
    dt_gemm_t f = g; /* linear_gemm's staged form: contiguous fp32, then the pass */
    f.C = stage_f.data(), f.ldc = OC, f.c16 = 0, f.gelu_pre = NULL;
    if (bias)
      launch_elementwise(
          total, [&] { linear_seed_kernel(stage_f.data(), b.data(), NULL, OC, OC, total); });
    ref_gemm(gemm_seeded(f));
    launch_elementwise(total, [&] {
      gelu_aux_to_bf16_kernel(gs.data(), ps.data(), (size_t)ld, stage_f.data(), (size_t)OC,
                              (size_t)OC, total);
    });
    float scale = 0.0f;
    for (size_t i = 0; i < total; i++)
      scale = fmaxf(scale, fmaxf(fabsf(gl_h[i]), fabsf(out_h[i / OC * ld + i % OC])));
    for (int r = 0; r < N; r++)
      for (int o = 0; o < ld; o++) {
        const size_t at = (size_t)r * ld + o;
        if (o >= OC) {
          ck_assert(ge[at].x == 0x7777u && pe[at].x == 0x7777u && gs[at].x == 0x7777u &&
                    ps[at].x == 0x7777u);
          continue;
        }
        const float wg = gl_h[(size_t)r * OC + o], wp = out_h[at];
        const float got[4] = {__bfloat162float(ge[at]), __bfloat162float(gs[at]),
                              __bfloat162float(pe[at]), __bfloat162float(ps[at])};
        for (int k = 0; k < 4; k++) {
          const float ref = k < 2 ? wg : wp;
          ck_assert_msg(fabsf(got[k] - ref) <= 0x1p-8f * fabsf(ref) + 1e-5f * scale,
                        "linear forward into the GELU [%d, %d]: %s %s %g, the CPU's %g", r, o,
                        k % 2 ? "staged" : "epilogue", k < 2 ? "GELU" : "input", (double)got[k],
                        (double)ref);
        }
      }
  }

  /* dinp through a GELU of x (bf16, as is dinp then): the epilogue's form, and matmul.cu's
   * fallback (the fp32 product staged, then dgelu_to_bf16_kernel), against the CPU's product,
   * GELU backward and rounding: within bf16's ulp, plus the fp32 tolerance */
  const size_t nx = (size_t)N * C;
  std::vector<float> x = randn(nx), dx_h(nx), stage(nx, NAN);
  std::vector<__nv_bfloat16> x16(nx), dx_g(nx, __nv_bfloat16{0xffffu}), dx_s = dx_g;
  for (size_t i = 0; i < nx; i++)
    x16[i] = __float2bfloat16_rn(x[i]), x[i] = dt_bf16_round(x[i]);
  dt_cpu_gelu_backward(dx_h.data(), x.data(), dinp_h.data(), nx);
  dt_cpu_to_bf16(dx_h.data(), dx_h.data(), nx);
  dt_gemm_t g = gemm_linear_dinp(dx_g.data(), dout.data(), w.data(), N, C, OC, ld);
  g.gelu_in = x16.data();
  g.c16 = 1;
  ref_gemm(g);
  dt_gemm_t f = g; /* linear_gemm's staged form */
  f.C = stage.data(), f.c16 = 0, f.gelu_in = NULL;
  ref_gemm(gemm_seeded(f));
  launch_elementwise(nx, [&] { dgelu_to_bf16_kernel(dx_s.data(), x16.data(), stage.data(), nx); });
  float scale = 0.0f;
  for (size_t i = 0; i < nx; i++)
    scale = fmaxf(scale, fabsf(dx_h[i]));
  for (size_t i = 0; i < nx; i++) {
    const float e = __bfloat162float(dx_g[i]), f2 = __bfloat162float(dx_s[i]);
    ck_assert_msg(fabsf(e - dx_h[i]) <= 0x1p-8f * fabsf(dx_h[i]) + 1e-5f * scale,
                  "dinp through the GELU [%zu]: epilogue %g, the CPU's %g", i, (double)e,
                  (double)dx_h[i]);
    ck_assert_msg(fabsf(f2 - dx_h[i]) <= 0x1p-8f * fabsf(dx_h[i]) + 1e-5f * scale,
                  "dinp through the GELU [%zu]: staged %g, the CPU's %g", i, (double)f2,
                  (double)dx_h[i]);
  }
}

/* The materialised attention as attention.cu runs it: per batch element the batched products,
 * the emulated softmax kernels between them; against the CPU's out, att and dqkv. q0 > 0 is
 * context parallelism's chunk, whose backward accumulates. */
static void check_attention(int B, int Tq, int q0, int Tall, int C, int NH)
{
  const int Tk = q0 + Tq;
  const dt_att_shape_t s = {B, Tq, q0, Tall, C, NH};
  const size_t natt = (size_t)B * NH * Tq * Tk, nqkv = (size_t)B * Tall * 3 * C;
  const std::vector<float> qkv = randn(nqkv), dout = randn((size_t)B * Tq * C);
  std::vector<float> out_h((size_t)B * Tq * C), att_h(natt), out_g(out_h.size(), NAN),
      att_g(natt, NAN);
  dt_cpu_attention_forward_cp(out_h.data(), att_h.data(), qkv.data(), B, Tq, q0, Tall, C, NH);
  const float scale = 1.0f / sqrtf((float)(C / NH));
  for (int b = 0; b < B; b++)
    ref_gemm(gemm_att_scores(s, b, att_g.data(), qkv.data(), scale));
  launch(dim3(B * NH * Tq), ATT_THREADS, 0,
         [&] { causal_softmax_kernel(att_g.data(), Tq, Tk, q0); });
  for (int b = 0; b < B; b++)
    ref_gemm(gemm_att_out(s, b, out_g.data(), att_g.data(), qkv.data()));
  expect_close("attention forward att", att_g, att_h);
  expect_close("attention forward out", out_g, out_h);

  /* backward from the CPU's probabilities; q0 > 0 accumulates (beta 1) onto dqkv */
  const float beta = q0 > 0 ? 1.0f : 0.0f;
  const std::vector<float> dqkv0 = q0 > 0 ? randn(nqkv) : std::vector<float>(nqkv, 0.0f);
  std::vector<float> dqkv_h = dqkv0, dqkv_g = dqkv0, scratch_h(natt), scratch_g(natt, NAN);
  if (q0 > 0) {
    dt_cpu_attention_backward_cp(dqkv_h.data(), scratch_h.data(), dout.data(), qkv.data(),
                                 att_h.data(), B, Tq, q0, Tall, C, NH);
  } else {
    dt_cpu_attention_backward(dqkv_h.data(), scratch_h.data(), dout.data(), qkv.data(),
                              att_h.data(), B, Tq, C, NH);
    std::fill(dqkv_g.begin(), dqkv_g.end(), NAN); /* written, never read */
  }
  for (int b = 0; b < B; b++) {
    ref_gemm(gemm_att_dA(s, b, scratch_g.data(), dout.data(), qkv.data()));
    ref_gemm(gemm_att_dv(s, b, dqkv_g.data(), att_h.data(), dout.data(), beta));
  }
  launch(dim3(B * NH * Tq), ATT_THREADS, 0, [&] {
    causal_softmax_backward_kernel(scratch_g.data(), att_h.data(), Tq, Tk, q0, scale);
  });
  for (int b = 0; b < B; b++) {
    ref_gemm(gemm_att_dq(s, b, dqkv_g.data(), scratch_g.data(), qkv.data(), beta));
    ref_gemm(gemm_att_dk(s, b, dqkv_g.data(), scratch_g.data(), qkv.data(), beta));
  }
  expect_close("attention backward dqkv", dqkv_g, dqkv_h);
}

START_TEST(test_gemm_views)
{
  dt_rng_seed(&g_rng, 88);
  check_linear(5, 7, 6, 9, true);     /* padded rows, with a bias */
  check_linear(4, 3, 11, 11, false);  /* contiguous (the bf16 copies), no bias */
  check_attention(2, 6, 0, 6, 12, 3); /* the plain entries */
  check_attention(2, 3, 4, 8, 8, 2);  /* a context-parallel chunk: keys [0, 7) of 8 */
}
END_TEST

/* Three steps with weight decay and a gradient scale, from the same state: bit-identical to the
 * CPU reference (adamw.cu's claim), the scalars derived by adamw_scalars as the launcher does;
 * and the bf16 copy of the parameters that both write, bit for bit. */
START_TEST(test_adamw)
{
  dt_rng_seed(&g_rng, 87);
  const size_t n = 1003;
  std::vector<float> p_h = randn(n), m_h = randn(n, 0.0f, 0.1f), v_h(n);
  for (size_t i = 0; i < n; i++)
    v_h[i] = (float)dt_rng_uniform(&g_rng) * 1e-3f;
  std::vector<float> p_g = p_h, m_g = m_h, v_g = v_h, p16_h(n);
  std::vector<__nv_bfloat16> p16_g(n, __nv_bfloat16{0xffffu});
  const float lr = 3e-4f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, scale = 0.7f;
  for (int t = 1; t <= 3; t++) {
    const std::vector<float> g = randn(n);
    dt_cpu_adamw_update(p_h.data(), p16_h.data(), g.data(), m_h.data(), v_h.data(), n, lr, b1, b2,
                        eps, wd, scale, t);
    const adamw_scalars_t k = adamw_scalars(lr, b1, b2, wd, t);
    /* the last step also writes the bf16 copy */
    launch_elementwise(n, [&] {
      adamw_kernel(p_g.data(), t == 3 ? p16_g.data() : nullptr, g.data(), m_g.data(), v_g.data(), n,
                   k.decay, k.step_size, k.bc2_sqrt, b1, b2, k.one_m_b1, k.one_m_b2, eps, scale);
    });
  }
  ck_assert(p_g == p_h);
  ck_assert(m_g == m_h);
  ck_assert(v_g == v_h);
  for (size_t i = 0; i < n; i++)
    ck_assert(__bfloat162float(p16_g[i]) == p16_h[i]);
}
END_TEST

/* The linear layer's seed (bias, a residual, or their sum, in the first OC of ldo columns; the
 * rest untouched), the bf16 copies of strided operands (against dt_bf16_round) and with their
 * column sums, and the device's accumulate and fill. */
START_TEST(test_matmul_and_device_kernels)
{
  dt_rng_seed(&g_rng, 88);
  const int N = 37, OC = 45, ldo = 50;
  const std::vector<float> bias = randn(OC), res = randn((size_t)N * ldo);
  const size_t total = (size_t)N * OC;
  for (int k = 0; k < 3; k++) { /* bias, residual, both */
    const float *b = k != 1 ? bias.data() : NULL, *r = k != 0 ? res.data() : NULL;
    std::vector<float> out((size_t)N * ldo, -7.0f);
    launch_elementwise(total, [&] { linear_seed_kernel(out.data(), b, r, OC, ldo, total); });
    for (size_t i = 0; i < (size_t)N; i++)
      for (size_t o = 0; o < (size_t)ldo; o++) {
        const float want = o >= (size_t)OC ? -7.0f
                           : !r            ? bias[o]
                           : !b            ? res[i * ldo + o]
                                           : res[i * ldo + o] + bias[o];
        ck_assert(out[i * ldo + o] == want);
      }
  }

  const size_t rows = 29, cols = 33, lds = 40;
  const std::vector<float> src = randn(rows * lds, 0.0f, 5.0f);
  for (const size_t ldd : {cols, cols + 3}) { /* contiguous; rows longer, the rest untouched */
    std::vector<__nv_bfloat16> dst(rows * ldd, __nv_bfloat16{0xffffu});
    launch_elementwise(
        rows * cols, [&] { to_bf16_kernel(dst.data(), ldd, src.data(), lds, cols, rows * cols); });
    for (size_t r = 0; r < rows; r++)
      for (size_t c = 0; c < ldd; c++)
        ck_assert(c < cols ? __bfloat162float(dst[r * ldd + c]) == dt_bf16_round(src[r * lds + c])
                           : dst[r * ldd + c].x == 0xffffu);
  }

  /* The bf16 copy with the column sums (the bias gradient) in the same pass: the copy bit for
   * bit, the sums against double ones added to what the target held. Partial tiles of columns
   * and rows; one row block per 256 rows, then per 512 (the grid's y limit's way out). */
  for (const int rpb : {COLSUM_ROWS, 2 * COLSUM_ROWS}) {
    const int R = 600, Cc = 70, L = 75, by = (R + rpb - 1) / rpb;
    const std::vector<float> g = randn((size_t)R * L);
    std::vector<__nv_bfloat16> d16((size_t)R * Cc, __nv_bfloat16{0xffffu});
    std::vector<float> partial((size_t)by * Cc, NAN), sums = randn(Cc), want(Cc);
    for (int c = 0; c < Cc; c++) {
      double t = sums[c];
      for (int r = 0; r < R; r++)
        t += g[(size_t)r * L + c];
      want[c] = (float)t;
    }
    launch(dim3((Cc + COLSUM_COLS - 1) / COLSUM_COLS, by), COLSUM_THREADS, 0,
           [&] { to_bf16_colsum_kernel(d16.data(), partial.data(), g.data(), R, Cc, L, rpb); });
    const dt__csum_t pass2 = {{sums.data(), NULL}, {partial.data(), NULL}};
    launch(dim3((Cc + DT__CSUM_COLS - 1) / DT__CSUM_COLS), DT__CSUM_THREADS, 0,
           [&] { dt__column_sums_kernel(pass2, by, Cc); });
    for (int r = 0; r < R; r++)
      for (int c = 0; c < Cc; c++)
        ck_assert(__bfloat162float(d16[(size_t)r * Cc + c]) == dt_bf16_round(g[(size_t)r * L + c]));
    expect_close("to_bf16_colsum column sums", sums, want);
    /* a bf16 gradient (no copy to make): the column sums of its values */
    std::vector<__nv_bfloat16> g16((size_t)R * L);
    std::vector<float> sums16 = randn(Cc), want16(Cc);
    for (size_t i = 0; i < g16.size(); i++)
      g16[i] = __float2bfloat16_rn(g[i]);
    for (int c = 0; c < Cc; c++) {
      double t = sums16[c];
      for (int r = 0; r < R; r++)
        t += __bfloat162float(g16[(size_t)r * L + c]);
      want16[c] = (float)t;
    }
    std::fill(partial.begin(), partial.end(), NAN);
    launch(dim3((Cc + COLSUM_COLS - 1) / COLSUM_COLS, by), COLSUM_THREADS, 0, [&] {
      to_bf16_colsum_kernel((__nv_bfloat16 *)NULL, partial.data(), g16.data(), R, Cc, L, rpb);
    });
    const dt__csum_t pass16 = {{sums16.data(), NULL}, {partial.data(), NULL}};
    launch(dim3((Cc + DT__CSUM_COLS - 1) / DT__CSUM_COLS), DT__CSUM_THREADS, 0,
           [&] { dt__column_sums_kernel(pass16, by, Cc); });
    expect_close("to_bf16_colsum column sums of a bf16 gradient", sums16, want16);
  }

  /* The column sums' second pass alone, on two matrices of more rows than its 32 lanes (and
   * not a multiple of them) and columns over three blocks: against double sums. */
  {
    const int R = 1000, Cc = 70;
    const std::vector<float> m0 = randn((size_t)R * Cc), m1 = randn((size_t)R * Cc);
    std::vector<float> s0 = randn(Cc), s1 = randn(Cc), w0(Cc), w1(Cc);
    for (int c = 0; c < Cc; c++) {
      double t0 = s0[c], t1 = s1[c];
      for (int r = 0; r < R; r++)
        t0 += m0[(size_t)r * Cc + c], t1 += m1[(size_t)r * Cc + c];
      w0[c] = (float)t0, w1[c] = (float)t1;
    }
    const dt__csum_t two = {{s0.data(), s1.data()}, {m0.data(), m1.data()}};
    launch(dim3((Cc + DT__CSUM_COLS - 1) / DT__CSUM_COLS, 1, 2), DT__CSUM_THREADS, 0,
           [&] { dt__column_sums_kernel(two, R, Cc); });
    expect_close("column sums, first matrix", s0, w0);
    expect_close("column sums, second matrix", s1, w1);
  }

  const size_t n = 2049;
  const std::vector<float> a = randn(n), b = randn(n);
  std::vector<float> acc = a, want(n), ones(n, NAN);
  for (size_t i = 0; i < n; i++)
    want[i] = a[i] + b[i];
  launch_elementwise(n, [&] { accumulate_kernel(acc.data(), b.data(), n); });
  ck_assert(acc == want);
  launch_elementwise(n, [&] { fill_kernel(ones.data(), 1.0f, n); });
  ck_assert(ones == std::vector<float>(n, 1.0f));
}
END_TEST

/* The sum of squares' two passes in double, on a grid of 7 blocks instead of norm.cu's
 * ss_blocks(n) (25 here): the kernels take any grid, and the grid-stride loop, the double block
 * reduction and the final pass are the same code. */
START_TEST(test_sum_squares)
{
  dt_rng_seed(&g_rng, 89);
  const size_t n = 100003;
  const std::vector<float> x = randn(n, 0.5f, 2.0f);
  const unsigned blocks = 7;
  std::vector<double> partial(blocks, NAN);
  double got = NAN;
  launch(dim3(blocks), SS_THREADS, 0, [&] { sumsq_partial_kernel(partial.data(), x.data(), n); });
  launch(dim3(1), SS_THREADS, 0, [&] { sumsq_final_kernel(&got, partial.data(), (int)blocks); });
  const double want = dt_cpu_sum_squares(x.data(), n);
  ck_assert_msg(fabs(got - want) <= 1e-12 * want, "sum of squares %.17g, want %.17g", got, want);
}
END_TEST

/* ---- Hopper's wgmma (wgmma.cuh, through tests/unit/wgmma_tile.cuh) ------------------------ */

/* Every way an operand reaches the instruction, against a plain product of the same bf16 values
 * (test_cuda runs the same kernel on an H100/H200): 1e-5 of the largest value, since the sums of
 * 64 products run in other orders. */
template <int AM, int BM> static void check_wgmma_tile(const char *what)
{
  const std::vector<float> A = randn(WG_N * WG_N), B = randn(WG_N * WG_N);
  std::vector<uint16_t> a(WG_N * WG_N), b(WG_N * WG_N);
  std::vector<float> want(WG_N * WG_N), c(WG_N * WG_N, NAN);
  wg_tile_inputs(AM, BM, A.data(), B.data(), a.data(), b.data(), want.data());
  for (uint32_t lbo : {16u, 1024u}) {
    launch(dim3(1), DT_WG_THREADS, WG_TILE_SMEM,
           [&] { wgmma_tile_kernel<AM, BM>(c.data(), a.data(), b.data(), lbo); });
    expect_close(what, c, want);
  }
}

START_TEST(test_wgmma)
{
  dt_rng_seed(&g_rng, 97);
  check_wgmma_tile<WG_A_K, WG_B_K>("wgmma: A K-major, B K-major");
  check_wgmma_tile<WG_A_K, WG_B_MN>("wgmma: A K-major, B N-major");
  check_wgmma_tile<WG_A_MN, WG_B_K>("wgmma: A M-major, B K-major");
  check_wgmma_tile<WG_A_MN, WG_B_MN>("wgmma: A M-major, B N-major");
  check_wgmma_tile<WG_A_REGS, WG_B_K>("wgmma: A in registers, B K-major");
  check_wgmma_tile<WG_A_REGS, WG_B_MN>("wgmma: A in registers, B N-major");
}
END_TEST

int main(void)
{
  Suite *s = suite_create("cuda_emulated");
  TCase *tc = tcase_create("kernels");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_layernorm);
  tcase_add_test(tc, test_crossentropy);
  tcase_add_test(tc, test_crossentropy_vocab_parallel);
  tcase_add_test(tc, test_encoder);
  tcase_add_test(tc, test_causal_softmax);
  tcase_add_test(tc, test_gelu_residual);
  tcase_add_test(tc, test_residual_layernorm);
  tcase_add_test(tc, test_gemm_views);
  tcase_add_test(tc, test_adamw);
  tcase_add_test(tc, test_matmul_and_device_kernels);
  tcase_add_test(tc, test_sum_squares);
  tcase_add_test(tc, test_wgmma);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  const int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
