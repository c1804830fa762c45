/* attention.cu — causal multi-head self-attention on the GPU, fp32, forward and backward
 * (reference: kernels/cpu/attention.c).
 *
 * The T x T probabilities are materialised, as the ops contract says. Per batch element b, each
 * product is one cublasSgemmStridedBatched over the NH heads, whose column-major views,
 * leading dimensions and strides gemm.cuh builds (gemm_att_*) and states. The products run over
 * the full T x T square; the softmax kernels then write exact zeros above the diagonal, so the
 * zeros make the following products equal to the causal ones.
 *
 * Context parallelism (the _cp entries): Tq queries at positions [q0, q0 + Tq) of qkv rows
 * holding Tall positions per batch element, against the keys [0, Tk), Tk = q0 + Tq: the same
 * products over a Tq x Tk rectangle, the backward accumulating (+=) into dqkv. The plain
 * entries are the q0 = 0, Tq = Tk = Tall case, writing (=).
 *
 * Invariants: att holds the probabilities with exact zeros above the diagonal; dqkv is written
 * (or added to) in exactly the rows the contract names (every column of q | k | v belongs to one
 * head); the softmax reductions are block reductions of fixed shape (deterministic).
 *
 * Flash attention (the _flash entries, at the end): the kernels are in flash.cuh (fp32) and
 * flash_mma.cuh (bf16 on the tensor cores, the _flash_bf16 entries); this file launches them,
 * but for the bf16 forward and the backward's dk/dv and dq kernels on Hopper's wgmma
 * (flash_wgmma.cuh), which attention_wgmma.cu launches under DISTRAIN_CUDA_WGMMA=1. */
#include <math.h>

#include <type_traits>

#include "cuda_impl.h"
#include "flash.cuh"
#include "flash_mma.cuh"
#include "softmax.cuh"

int dt__cuda_attention_forward_cp(struct dt_device *dev, float *out, float *att, const float *qkv,
                                  int B, int Tq, int q0, int Tall, int C, int NH)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (B <= 0 || Tq <= 0 || C <= 0 || NH <= 0)
    return 0;
  const dt_att_shape_t s = {B, Tq, q0, Tall, C, NH};
  const float scale = 1.0f / sqrtf((float)(C / NH));
  for (int b = 0; b < B; b++) {
    const dt_gemm_t g = gemm_att_scores(s, b, att, qkv, scale);
    DT_CHECK(dt__cuda_gemm(cu, &g));
  }
  causal_softmax_kernel<<<(unsigned)((size_t)B * NH * Tq), ATT_THREADS, 0, cu->stream>>>(
      att, Tq, q0 + Tq, q0);
  DT_CUDA_CHECK(cudaGetLastError());
  for (int b = 0; b < B; b++) {
    const dt_gemm_t g = gemm_att_out(s, b, out, att, qkv);
    DT_CHECK(dt__cuda_gemm(cu, &g));
  }
  return 0;
}

int dt__cuda_attention_forward(struct dt_device *dev, float *out, float *att, const float *qkv,
                               int B, int T, int C, int NH)
{
  return dt__cuda_attention_forward_cp(dev, out, att, qkv, B, T, 0, T, C, NH);
}

/* beta 0: dqkv written (=), 1: accumulated (+=, the _cp contract). */
static int attention_backward(struct dt_device *dev, float *dqkv, float *scratch, const float *dout,
                              const float *qkv, const float *att, int B, int Tq, int q0, int Tall,
                              int C, int NH, float beta)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (B <= 0 || Tq <= 0 || C <= 0 || NH <= 0)
    return 0;
  const dt_att_shape_t s = {B, Tq, q0, Tall, C, NH};
  const float scale = 1.0f / sqrtf((float)(C / NH));
  for (int b = 0; b < B; b++) {
    const dt_gemm_t dA = gemm_att_dA(s, b, scratch, dout, qkv);
    const dt_gemm_t dv = gemm_att_dv(s, b, dqkv, att, dout, beta);
    DT_CHECK(dt__cuda_gemm(cu, &dA));
    DT_CHECK(dt__cuda_gemm(cu, &dv));
  }
  causal_softmax_backward_kernel<<<(unsigned)((size_t)B * NH * Tq), ATT_THREADS, 0, cu->stream>>>(
      scratch, att, Tq, q0 + Tq, q0, scale);
  DT_CUDA_CHECK(cudaGetLastError());
  for (int b = 0; b < B; b++) {
    const dt_gemm_t dq = gemm_att_dq(s, b, dqkv, scratch, qkv, beta);
    const dt_gemm_t dk = gemm_att_dk(s, b, dqkv, scratch, qkv, beta);
    DT_CHECK(dt__cuda_gemm(cu, &dq));
    DT_CHECK(dt__cuda_gemm(cu, &dk));
  }
  return 0;
}

int dt__cuda_attention_backward_cp(struct dt_device *dev, float *dqkv, float *scratch,
                                   const float *dout, const float *qkv, const float *att, int B,
                                   int Tq, int q0, int Tall, int C, int NH)
{
  return attention_backward(dev, dqkv, scratch, dout, qkv, att, B, Tq, q0, Tall, C, NH, 1.0f);
}

int dt__cuda_attention_backward(struct dt_device *dev, float *dqkv, float *scratch,
                                const float *dout, const float *qkv, const float *att, int B, int T,
                                int C, int NH)
{
  return attention_backward(dev, dqkv, scratch, dout, qkv, att, B, T, 0, T, C, NH, 0.0f);
}

/* ------------------------------------------------------------------------------------------ */
/* Flash attention (flash.cuh)                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* One launch of kernel on the device's stream, with its dynamic shared memory (past the
 * default 48 KiB with the kernel's consent). */
template <typename K, typename... A>
static int flash_launch(dt_cuda_impl_t *cu, K kernel, dim3 grid, unsigned threads, size_t smem,
                        A... args)
{
  if (smem > 48 * 1024)
    DT_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<grid, threads, smem, cu->stream>>>(args...);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

/* mma: the tensor-core kernels (flash_mma.cuh) on bf16 q, k, v, else flash.cuh's fp32 ones on
 * fp32 q, k, v. */
template <int HSM>
static int flash_forward(dt_cuda_impl_t *cu, bool mma, void *out, float *lse, const void *qkv,
                         int B, int Tq, int q0, int Tall, int C, int NH)
{
  const float scale = 1.0f / sqrtf((float)(C / NH));
  if (mma && HSM == 64 && cu->wgmma) {
    const int rc = dt__cuda_wgmma_forward(cu, (uint16_t *)out, lse, (const uint16_t *)qkv, B, Tq,
                                          q0, Tall, C, NH, scale);
    if (rc != 0)
      return rc < 0 ? rc : 0;
  }
  if (mma)
    return flash_launch(cu, fmma_forward_kernel<HSM>, flash_grid(fmma_mt_blocks<HSM>(Tq), B, NH),
                        FMMA_THREADS, fmma_fwd_smem_bytes<HSM>(), (uint16_t *)out, lse,
                        (const uint16_t *)qkv, Tq, q0, Tall, C, NH, scale);
  return flash_launch(cu, flash_forward_kernel<HSM>, flash_grid(flash_query_blocks(Tq), B, NH),
                      FLASH_ROWS, flash_kv_smem_bytes<HSM>(), (float *)out, lse, (const float *)qkv,
                      Tq, q0, Tall, C, NH, scale);
}

/* The tensor-core backward, gradients of type G from an output gradient of type O: the D kernel,
 * then per group of sequences or heads the dk/dv kernel and the dq kernel, the score gradients in
 * the workspace between them (fmma_backward_ws: D, then one group's dS tiles), or where one
 * head's tiles would not fit, the dk/dv kernel and the dq kernel that recomputes them. */
template <int HSM, typename G, typename O>
static int fmma_backward(dt_cuda_impl_t *cu, G *dqkv, const O *dout, const uint16_t *qkv,
                         const uint16_t *out, const float *lse, int B, int Tq, int q0, int Tall,
                         int C, int NH, bool add)
{
  const fmma_ws_plan p =
      fmma_backward_ws(B, Tq, q0, NH, cu->flash_ws_max ? cu->flash_ws_max : FMMA_DS_MAX_BYTES);
  void *ws;
  DT_CHECK(dt__cuda_workspace(cu, p.bytes, &ws));
  float *D = (float *)ws;
  uint16_t *ds_tiles = p.heads ? (uint16_t *)((char *)ws + p.ds_offset) : NULL;
  const float scale = 1.0f / sqrtf((float)(C / NH));
  const size_t C3 = 3 * (size_t)C;
  DT_CHECK(flash_launch(cu, fmma_backward_d_kernel<O>, dim3(fmma_d_blocks((size_t)B * Tq * NH)),
                        FMMA_THREADS, 0, D, dout, out, B, Tq, C, NH));
  const int heads = p.heads ? p.heads : NH;
  for (int b0 = 0; b0 < B; b0 += p.seqs)
    for (int h0 = 0; h0 < NH; h0 += heads) {
      const int bn = min(p.seqs, B - b0), hn = min(heads, NH - h0);
      G *dg = dqkv + (size_t)b0 * Tall * C3;
      const uint16_t *qg = qkv + (size_t)b0 * Tall * C3;
      const O *gg = dout + (size_t)b0 * Tq * C;
      const size_t r = (size_t)b0 * NH * Tq; /* the group's first row of D and lse */
      /* the kernels on wgmma (DISTRAIN_CUDA_WGMMA=1) where they take the shape: 1 when launched */
      int wg_dkdv = 0, wg_dq = 0;
      if constexpr (HSM == 64 && std::is_same_v<O, uint16_t>)
        if (cu->wgmma)
          DT_CHECK(wg_dkdv = dt__cuda_wgmma_dkdv(cu, dg, std::is_same_v<G, uint16_t>, ds_tiles,
                                                 (const float *)D + r, gg, qg, lse + r, bn, hn, Tq,
                                                 q0, Tall, C, NH, h0, scale, add));
      if (!wg_dkdv)
        DT_CHECK(flash_launch(cu, fmma_backward_dkdv_kernel<HSM, G, O>,
                              flash_grid(fmma_blocks(q0 + Tq), bn, hn), FMMA_THREADS,
                              fmma_dkdv_smem_bytes<HSM>(), dg, ds_tiles, (const float *)D + r, gg,
                              qg, lse + r, Tq, q0, Tall, C, NH, h0, scale, add));
      if (HSM == 64 && cu->wgmma && ds_tiles)
        DT_CHECK(wg_dq = dt__cuda_wgmma_dq(cu, dg, std::is_same_v<G, uint16_t>, ds_tiles, qg, bn,
                                           hn, Tq, q0, Tall, C, NH, h0, scale, add));
      if (wg_dq)
        continue;
      if (ds_tiles)
        DT_CHECK(flash_launch(cu, fmma_backward_dq_kernel<HSM, G>,
                              flash_grid(fmma_mt_blocks<HSM>(Tq), bn, hn), FMMA_THREADS,
                              fmma_dq_smem_bytes<HSM>(), dg, (const uint16_t *)ds_tiles, qg, Tq, q0,
                              Tall, C, NH, h0, scale, add));
      else
        DT_CHECK(flash_launch(cu, fmma_backward_dq_recompute_kernel<HSM, G, O>,
                              flash_grid(fmma_blocks(Tq), bn, hn), FMMA_THREADS,
                              fmma_smem_bytes<HSM>(6, 0), dg, (const float *)D + r, gg, qg, lse + r,
                              Tq, q0, Tall, C, NH, scale, add));
    }
  return 0;
}

/* Flash attention's backward: each kernel adds its rows into dqkv or (add false) writes them, in
 * bf16 where dqkv16, from a bf16 dout where dout16 (the tensor-core kernels only; dout16 with
 * dqkv16: dt_flash_dqkv16_check); fp32: flash.cuh's dq kernel, then (D in the workspace) its
 * dk/dv kernel. */
template <int HSM>
static int flash_backward(dt_cuda_impl_t *cu, bool mma, void *dqkv, bool dqkv16, const void *dout,
                          bool dout16, const void *qkv, const void *out, const float *lse, int B,
                          int Tq, int q0, int Tall, int C, int NH, bool add)
{
  if (mma) {
    const uint16_t *q16 = (const uint16_t *)qkv, *o16 = (const uint16_t *)out;
    if (dout16)
      return fmma_backward<HSM>(cu, (uint16_t *)dqkv, (const uint16_t *)dout, q16, o16, lse, B, Tq,
                                q0, Tall, C, NH, add);
    if (dqkv16)
      return fmma_backward<HSM>(cu, (uint16_t *)dqkv, (const float *)dout, q16, o16, lse, B, Tq, q0,
                                Tall, C, NH, add);
    return fmma_backward<HSM>(cu, (float *)dqkv, (const float *)dout, q16, o16, lse, B, Tq, q0,
                              Tall, C, NH, add);
  }
  void *ws;
  DT_CHECK(dt__cuda_workspace(cu, (size_t)B * NH * Tq * sizeof(float), &ws));
  float *D = (float *)ws;
  const float scale = 1.0f / sqrtf((float)(C / NH));
  const float *q32 = (const float *)qkv, *g32 = (const float *)dout;
  float *g = (float *)dqkv;
  DT_CHECK(flash_launch(cu, flash_backward_dq_kernel<HSM>,
                        flash_grid(flash_query_blocks(Tq), B, NH), FLASH_ROWS,
                        flash_kv_smem_bytes<HSM>(), g, D, g32, q32, (const float *)out, lse, Tq, q0,
                        Tall, C, NH, scale, add));
  return flash_launch(cu, flash_backward_dkdv_kernel<HSM>,
                      flash_grid(flash_key_blocks(q0 + Tq), B, NH), FLASH_KROWS,
                      flash_dkdv_smem_bytes<HSM>(), g, (const float *)D, g32, q32, lse, Tq, q0,
                      Tall, C, NH, scale, add);
}

/* flash_bucket(hs), or 0 with the error logged. */
static int bucket_or_refuse(int C, int NH)
{
  const int hsm = flash_bucket(C / NH);
  if (!hsm)
    DT_ERROR(KERNEL,
             "flash attention on the GPU takes head sizes up to %d, not %d; use --attention "
             "materialized",
             FLASH_MAX_HS, C / NH);
  return hsm;
}

static int forward_flash(struct dt_device *dev, bool mma, void *out, float *lse, const void *qkv,
                         int B, int Tq, int q0, int Tall, int C, int NH)
{
  if (B <= 0 || Tq <= 0 || C <= 0 || NH <= 0)
    return 0;
  dt_cuda_impl_t *cu = dt__cuda(dev);
  switch (bucket_or_refuse(C, NH)) {
  case 32:
    return flash_forward<32>(cu, mma, out, lse, qkv, B, Tq, q0, Tall, C, NH);
  case 64:
    return flash_forward<64>(cu, mma, out, lse, qkv, B, Tq, q0, Tall, C, NH);
  case 128:
    return flash_forward<128>(cu, mma, out, lse, qkv, B, Tq, q0, Tall, C, NH);
  default:
    return DT_ENOTSUP;
  }
}

static int backward_flash(struct dt_device *dev, bool mma, void *dqkv, bool dqkv16,
                          const void *dout, bool dout16, const void *qkv, const void *out,
                          const float *lse, int B, int Tq, int q0, int Tall, int C, int NH,
                          int accumulate)
{
  const bool add = accumulate != 0;
  if (B <= 0 || Tq <= 0 || C <= 0 || NH <= 0)
    return 0;
  dt_cuda_impl_t *cu = dt__cuda(dev);
  switch (bucket_or_refuse(C, NH)) {
  case 32:
    return flash_backward<32>(cu, mma, dqkv, dqkv16, dout, dout16, qkv, out, lse, B, Tq, q0, Tall,
                              C, NH, add);
  case 64:
    return flash_backward<64>(cu, mma, dqkv, dqkv16, dout, dout16, qkv, out, lse, B, Tq, q0, Tall,
                              C, NH, add);
  case 128:
    return flash_backward<128>(cu, mma, dqkv, dqkv16, dout, dout16, qkv, out, lse, B, Tq, q0, Tall,
                               C, NH, add);
  default:
    return DT_ENOTSUP;
  }
}

int dt__cuda_attention_forward_flash(struct dt_device *dev, float *out, float *lse,
                                     const float *qkv, int B, int Tq, int q0, int Tall, int C,
                                     int NH)
{
  return forward_flash(dev, false, out, lse, qkv, B, Tq, q0, Tall, C, NH);
}

int dt__cuda_attention_backward_flash(struct dt_device *dev, float *dqkv, const float *dout,
                                      const float *qkv, const float *out, const float *lse, int B,
                                      int Tq, int q0, int Tall, int C, int NH, int accumulate)
{
  return backward_flash(dev, false, dqkv, false, dout, false, qkv, out, lse, B, Tq, q0, Tall, C, NH,
                        accumulate);
}

int dt__cuda_attention_forward_flash_bf16(struct dt_device *dev, void *out, float *lse,
                                          const void *qkv, int B, int Tq, int q0, int Tall, int C,
                                          int NH)
{
  return forward_flash(dev, true, out, lse, qkv, B, Tq, q0, Tall, C, NH);
}

int dt__cuda_attention_backward_flash_bf16(struct dt_device *dev, void *dqkv, int dqkv16,
                                           const void *dout, int dout16, const void *qkv,
                                           const void *out, const float *lse, int B, int Tq, int q0,
                                           int Tall, int C, int NH, int accumulate)
{
  DT_CHECK(dt_flash_dqkv16_check(dqkv16, dout16, Tq, q0, Tall, accumulate));
  return backward_flash(dev, true, dqkv, dqkv16 != 0, dout, dout16 != 0, qkv, out, lse, B, Tq, q0,
                        Tall, C, NH, accumulate);
}

extern "C" void dt_cuda_set_flash_ws_max(dt_device_t *dev, size_t bytes)
{
  dt__cuda(dev)->flash_ws_max = bytes;
}
