/* encoder.cu — token + position embedding on the GPU, forward and backward (reference:
 * kernels/cpu/encoder.c).
 *
 * The token table may be a vocabulary-parallel slice, rows [vocab_lo, vocab_lo + vocab_n);
 * tokens outside it contribute 0. wpe / dwpe may be NULL (no position term).
 *
 * Determinism without atomics: in the backward pass the host sorts the tokens by row (its copy
 * of them, encoder_buckets), and one thread owns one channel of one row of dwte and adds that
 * row's tokens in order; one thread owns one (t, c) of dwpe and walks the batch in order. Every
 * gradient element is therefore summed by a single thread in the CPU reference's order, so the
 * result is bit-identical to it and from run to run. The list goes up through a pinned host
 * buffer (cudaMemcpyAsync from pageable memory would wait for the stream) that the next call
 * rewrites only once the copy is done. */
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

/* The bucket list of inp_host (encoder_buckets) in device memory, *nb buckets: built in the
 * device's pinned buffer, copied on the stream into the workspace. */
static int upload_buckets(dt_cuda_impl_t *cu, const int *inp_host, size_t BT, int vocab_lo,
                          int vocab_n, const int **list, int *nb)
{
  const size_t ints = 2 * (BT < (size_t)vocab_n ? BT : (size_t)vocab_n) + 1 + BT;
  if (!cu->pin_copied)
    DT_CUDA_CHECK(cudaEventCreateWithFlags(&cu->pin_copied, cudaEventDisableTiming));
  else
    DT_CUDA_CHECK(cudaEventSynchronize(cu->pin_copied)); /* the last upload has left the buffer */
  if (cu->pin_bytes < (ints + (size_t)vocab_n + 1) * sizeof(int)) {
    if (cu->pin)
      DT_CUDA_CHECK(cudaFreeHost(cu->pin));
    cu->pin = NULL;
    cu->pin_bytes = 0;
    const size_t bytes = (ints + (size_t)vocab_n + 1) * sizeof(int);
    DT_CUDA_CHECK(cudaMallocHost(&cu->pin, bytes));
    cu->pin_bytes = bytes;
  }
  int *host = (int *)cu->pin;
  *nb = encoder_buckets(inp_host, BT, vocab_lo, vocab_n, host + ints, host);
  const size_t bytes = (2 * (size_t)*nb + 1 + (size_t)(host[*nb] - host[0])) * sizeof(int);
  void *dev = NULL;
  DT_CHECK(dt__cuda_workspace(cu, bytes, &dev));
  DT_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, cu->stream));
  DT_CUDA_CHECK(cudaEventRecord(cu->pin_copied, cu->stream));
  *list = (const int *)dev;
  return 0;
}

int dt__cuda_encoder_backward(struct dt_device *dev, float *dwte, int vocab_lo, int vocab_n,
                              float *dwpe, const float *dout, const int *inp, const int *inp_host,
                              int B, int T, int C)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  const size_t BT = (size_t)B * T;
  (void)inp; /* the host's copy gives the order */
  if (BT == 0 || C <= 0)
    return 0;
  const int *list = NULL;
  int nb = 0;
  DT_CHECK(upload_buckets(cu, inp_host, BT, vocab_lo, vocab_n, &list, &nb));
  if (nb > 0) {
    const unsigned threads = C < 256 ? (unsigned)(C + 31) / 32 * 32 : 256;
    const dim3 grid((unsigned)nb, (unsigned)((C + (int)threads - 1) / (int)threads));
    encoder_backward_wte_kernel<<<grid, threads, 0, cu->stream>>>(dwte, dout, list, nb, C);
    DT_CUDA_CHECK(cudaGetLastError());
  }
  if (dwpe) {
    const size_t TC = (size_t)T * C;
    encoder_backward_wpe_kernel<<<dt__cuda_grid(TC, DT__CUDA_THREADS), DT__CUDA_THREADS, 0,
                                  cu->stream>>>(dwpe, dout, B, T, C);
    DT_CUDA_CHECK(cudaGetLastError());
  }
  return 0;
}
