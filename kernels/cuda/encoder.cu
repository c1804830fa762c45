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
#include "encoder.cuh"

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
