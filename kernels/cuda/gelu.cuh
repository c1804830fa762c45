/* gelu.cuh — the GELU kernels (gelu.cu launches them, elementwise over a capped grid; its top
 * comment states the expression). Device code only, also compiled for the host by
 * tests/unit/cuda_emul.h. The forward reads fp32 and writes fp32; under bf16 compute the forward
 * and the backward are cuBLASLt's epilogues of the fc layer's forward and of the projection's
 * dinp (matmul.cu), or gelu_aux_to_bf16_kernel and dgelu_to_bf16_kernel where cuBLASLt has no
 * algorithm for them. */
#ifndef DT_KERNELS_CUDA_GELU_CUH
#define DT_KERNELS_CUDA_GELU_CUH

#include <math.h>

#include "block.cuh"

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */

__device__ static inline float gelu(float x)
{
  const float u = GELU_SCALE * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

/* In vectors of DT__VEC where both buffers are 16-byte aligned (launch gelu_threads(n) threads
 * or fewer), the elements past the last whole vector one at a time; each element the same
 * expression either way. */
template <typename I, typename O>
__global__ static void gelu_forward_kernel(O *out, const I *inp, size_t n)
{
  const size_t nv = (size_t)inp % 16 == 0 && (size_t)out % 16 == 0 ? n / DT__VEC : 0;
  DT__CUDA_FOR(k, nv)
  {
    float v[DT__VEC];
    dt__load_vec(inp + k * DT__VEC, v);
    for (int i = 0; i < DT__VEC; i++)
      v[i] = gelu(v[i]);
    dt__store_vec(out + k * DT__VEC, v);
  }
  DT__CUDA_FOR(i, n - nv * DT__VEC)
  {
    dt__store(out + nv * DT__VEC + i, gelu(dt__load(inp + nv * DT__VEC + i)));
  }
}

/* Threads gelu_forward_kernel wants for n elements: one a vector. */
static inline size_t gelu_threads(size_t n)
{
  return (n + DT__VEC - 1) / DT__VEC;
}

__device__ static inline float gelu_grad(float x)
{
  const float u = GELU_SCALE * (x + 0.044715f * x * x * x);
  const float th = tanhf(u);
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
}

__global__ static void gelu_backward_kernel(float *dinp, const float *inp, const float *dout,
                                            size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    dinp[i] = gelu_grad(inp[i]) * dout[i];
  }
}

/* dst = GELU(x) and pre = x, both rounded to bf16, of each fp32 x of src (rows of cols values,
 * lds apart; dst's and pre's ldd apart): the bf16 linear layer's GELU_AUX epilogue as a pass of
 * its own (src the fp32 product, its bias added). */
__global__ static void gelu_aux_to_bf16_kernel(__nv_bfloat16 *dst, __nv_bfloat16 *pre, size_t ldd,
                                               const float *src, size_t lds, size_t cols,
                                               size_t total)
{
  DT__CUDA_FOR(i, total)
  {
    const size_t r = i / cols, c = i % cols;
    const float x = src[r * lds + c];
    dst[r * ldd + c] = __float2bfloat16_rn(gelu(x));
    pre[r * ldd + c] = __float2bfloat16_rn(x);
  }
}

/* dinp = dout * gelu'(inp), rounded to bf16, inp a bf16 activation: the bf16 linear layer's
 * GELU-gradient epilogue as a pass of its own (dout the fp32 product). */
__global__ static void dgelu_to_bf16_kernel(__nv_bfloat16 *dinp, const __nv_bfloat16 *inp,
                                            const float *dout, size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    dinp[i] = __float2bfloat16_rn(gelu_grad(__bfloat162float(inp[i])) * dout[i]);
  }
}

#endif
