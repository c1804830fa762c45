/* encoder.cu — token + position embedding on the GPU, forward and backward (reference:
 * kernels/cpu/encoder.c).
 *
 * The token table may be a vocabulary-parallel slice, rows [vocab_lo, vocab_lo + vocab_n);
 * tokens outside it contribute 0. wpe / dwpe may be NULL (no position term).
 *
 * Determinism without atomics: in the backward pass one thread owns one channel of dwte and
 * walks the tokens in order, and one thread owns one (t, c) of dwpe and walks the batch in
 * order. Every gradient element is therefore summed by a single thread in the CPU reference's
 * order, so the result is bit-identical to it and from run to run. */
#include "cuda_impl.h"

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

int dt__cuda_encoder_forward(struct dt_device *dev, float *out, const int *inp, const float *wte,
                             int vocab_lo, int vocab_n, const float *wpe, int B, int T, int C)
{
  const size_t total = (size_t)B * T * C;
  if (total == 0)
    return 0;
  encoder_forward_kernel<<<dt__cuda_grid(total, DT__CUDA_THREADS), DT__CUDA_THREADS, 0,
                           dt__cuda(dev)->stream>>>(out, inp, wte, vocab_lo, vocab_n, wpe, T, C,
                                                    total);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

/* One thread per channel c: dwte[row, c] += dout[bt, c] for bt = 0, 1, ... in order. Threads of
 * a warp take consecutive channels, so the dout and dwte accesses are coalesced. */
__global__ static void encoder_backward_wte_kernel(float *dwte, int vocab_lo, int vocab_n,
                                                   const float *dout, const int *inp, size_t BT,
                                                   int C)
{
  DT__CUDA_FOR(c, (size_t)C)
  {
    for (size_t bt = 0; bt < BT; bt++) {
      const int row = inp[bt] - vocab_lo;
      if (row >= 0 && row < vocab_n)
        dwte[(size_t)row * C + c] += dout[bt * C + c];
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

int dt__cuda_encoder_backward(struct dt_device *dev, float *dwte, int vocab_lo, int vocab_n,
                              float *dwpe, const float *dout, const int *inp, int B, int T, int C)
{
  cudaStream_t s = dt__cuda(dev)->stream;
  const size_t BT = (size_t)B * T;
  if (BT == 0 || C <= 0)
    return 0;
  /* Few channels, long loops: small blocks spread them over more multiprocessors. */
  const unsigned wte_threads = 32;
  encoder_backward_wte_kernel<<<dt__cuda_grid((size_t)C, wte_threads), wte_threads, 0, s>>>(
      dwte, vocab_lo, vocab_n, dout, inp, BT, C);
  DT_CUDA_CHECK(cudaGetLastError());
  if (dwpe) {
    const size_t TC = (size_t)T * C;
    encoder_backward_wpe_kernel<<<dt__cuda_grid(TC, DT__CUDA_THREADS), DT__CUDA_THREADS, 0, s>>>(
        dwpe, dout, B, T, C);
    DT_CUDA_CHECK(cudaGetLastError());
  }
  return 0;
}
