/* encoder.cuh — the embedding kernels (encoder.cu launches them; its top comment states the
 * order of the sums) and the host's bucketing of the tokens for the backward pass; also compiled
 * for the host by tests/emul/cuda_emul.h. */
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

/* The token gradients' buckets, built on the host from the host's copy of the tokens (a
 * stable counting sort, O(BT + vocab_n)): the tokens of the slice [vocab_lo, vocab_lo +
 * vocab_n) grouped by row, each group in token order. out gets, as ints, start[0..nb] (group g
 * is order[start[g] .. start[g + 1])), row[0..nb-1] (its row of the slice, ascending) and
 * order[] (token indices); it needs 2 min(BT, vocab_n) + 1 + BT ints. count is scratch of
 * vocab_n + 1 ints. Returns nb, the number of rows hit. */
static inline int encoder_buckets(const int *inp, size_t BT, int vocab_lo, int vocab_n, int *count,
                                  int *out)
{
  for (int r = 0; r <= vocab_n; r++)
    count[r] = 0;
  for (size_t bt = 0; bt < BT; bt++) {
    const int row = inp[bt] - vocab_lo;
    if (row >= 0 && row < vocab_n)
      count[row + 1]++;
  }
  int nb = 0;
  for (int r = 0; r < vocab_n; r++) {
    nb += count[r + 1] > 0;
    count[r + 1] += count[r]; /* count[r]: where row r's tokens start in order[] */
  }
  int *start = out, *rows = out + nb + 1, *order = rows + nb;
  for (int r = 0, g = 0; r < vocab_n; r++)
    if (count[r + 1] > count[r]) {
      start[g] = count[r];
      rows[g++] = r;
    }
  start[nb] = count[vocab_n];
  for (size_t bt = 0; bt < BT; bt++) {
    const int row = inp[bt] - vocab_lo;
    if (row >= 0 && row < vocab_n)
      order[count[row]++] = (int)bt;
  }
  return nb;
}

/* One block per bucket of encoder_buckets' list (blockIdx.x), one thread per channel c:
 * dwte[row, c] += dout[bt, c] over the bucket's tokens in order, the CPU reference's additions
 * in its order. The loads of dout are independent of each other and of any store, so they stay
 * in flight together; every row hit runs in parallel, where a thread per channel walking all
 * the tokens had C threads for the whole GPU and one dependent chain per token. */
__global__ static void encoder_backward_wte_kernel(float *dwte, const float *dout,
                                                   const int *buckets, int nb, int C)
{
  const int c = (int)(blockIdx.y * blockDim.x + threadIdx.x);
  if (c >= C)
    return;
  const int g = (int)blockIdx.x;
  const int *start = buckets, *order = buckets + 2 * nb + 1;
  float *w = dwte + (size_t)buckets[nb + 1 + g] * C + c;
  float sum = *w;
  for (int i = start[g]; i < start[g + 1]; i++)
    sum += dout[(size_t)order[i] * C + c];
  *w = sum;
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
