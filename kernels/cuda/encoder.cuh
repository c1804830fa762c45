/* encoder.cuh — the embedding kernels (encoder.cu launches them; its top comment states the
 * order of the sums). Device code only, also compiled for the host by tests/unit/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_ENCODER_CUH
#define DT_KERNELS_CUDA_ENCODER_CUH

#include "block.cuh"

__global__ static void encoder_forward_kernel(float *out, const int *inp, const float *wte,
                                              int vocab_lo, int vocab_n, const float *wpe, int T,
                                              int C, size_t total)
{
  DT__CUDA_FOR(i, total)
  {
    const size_t bt = i / (size_t)C;
    const size_t c = i % (size_t)C;
    const int row = inp[bt] - vocab_lo;
    const float te = row >= 0 && row < vocab_n ? wte[(size_t)row * C + c] : 0.0f;
    const float pe = wpe ? wpe[(bt % (size_t)T) * C + c] : 0.0f;
    out[i] = te + pe;
  }
}

/* One thread per channel c: dwte[row, c] += dout[bt, c] for bt = 0, 1, ... in order. Threads of
 * a warp take consecutive channels, so the dout and dwte accesses are coalesced. A thread walks
 * the tokens ENC_BATCH at a time: their rows, gradients and current dwte values are loaded
 * together (so many loads are in flight, not one dependent chain per token), then added in
 * order, a row that repeats within the batch continuing from its earlier sum; the stores follow
 * in order, the last one of a repeated row holding its final sum. The same additions in the same
 * order as one token at a time. */
#define ENC_BATCH 8
__global__ static void encoder_backward_wte_kernel(float *dwte, int vocab_lo, int vocab_n,
                                                   const float *dout, const int *inp, size_t BT,
                                                   int C)
{
  DT__CUDA_FOR(c, (size_t)C)
  {
    for (size_t bt0 = 0; bt0 < BT; bt0 += ENC_BATCH) {
      const int n = BT - bt0 < ENC_BATCH ? (int)(BT - bt0) : ENC_BATCH;
      int row[ENC_BATCH];
      float sum[ENC_BATCH], g[ENC_BATCH];
#pragma unroll
      for (int j = 0; j < ENC_BATCH; j++) {
        row[j] = j < n ? inp[bt0 + j] - vocab_lo : -1;
        if (row[j] >= vocab_n)
          row[j] = -1;
        sum[j] = row[j] >= 0 ? dwte[(size_t)row[j] * C + c] : 0.0f;
        g[j] = row[j] >= 0 ? dout[(bt0 + j) * C + c] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < ENC_BATCH; j++) {
        if (row[j] < 0)
          continue;
        for (int i = 0; i < j; i++) /* the latest earlier sum of the same row */
          if (row[i] == row[j])
            sum[j] = sum[i];
        sum[j] += g[j];
      }
#pragma unroll
      for (int j = 0; j < ENC_BATCH; j++)
        if (row[j] >= 0)
          dwte[(size_t)row[j] * C + c] = sum[j];
    }
  }
}

/* One thread per (t, c): dwpe[t, c] += dout[b, t, c] for b = 0, 1, ... in order. */
__global__ static void encoder_backward_wpe_kernel(float *dwpe, const float *dout, int B, int T,
                                                   int C)
{
  const size_t TC = (size_t)T * C;
  DT__CUDA_FOR(i, TC)
  {
    float acc = dwpe[i];
    for (int b = 0; b < B; b++)
      acc += dout[(size_t)b * TC + i];
    dwpe[i] = acc;
  }
}

#endif
