/* cpu_kernels.h — the CPU implementations behind dt_ops_cpu(); see kernels/ops.h for the shape
 * and accumulation contract of each. Exposed so that tests and kernel harnesses can call them
 * directly. Threading: OpenMP over rows; GEMMs through OpenBLAS (the OpenMP build, so a GEMM
 * inside a parallel region runs single-threaded instead of oversubscribing the cores). */
#ifndef DT_KERNELS_CPU_H
#define DT_KERNELS_CPU_H

#include <stddef.h>

/* Channel block for reductions over rows (bias and LayerNorm weight gradients): each block is
 * summed by one thread in row order, so our reductions do not depend on the thread count. */
#define DT_CPU_CBLOCK 64

void dt_cpu_encoder_forward(float *out, const int *inp, const float *wte, int vocab_lo, int vocab_n,
                            const float *wpe, int B, int T, int C);
void dt_cpu_encoder_backward(float *dwte, int vocab_lo, int vocab_n, float *dwpe, const float *dout,
                             const int *inp, int B, int T, int C);
void dt_cpu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C);
/* res = a + b, then out = LayerNorm(res): dt_cpu_residual_forward and dt_cpu_layernorm_forward
 * in one pass over the rows, bit for bit. res may alias a or b. */
void dt_cpu_residual_layernorm_forward(float *res, float *out, float *mean, float *rstd,
                                       const float *a, const float *b, const float *weight,
                                       const float *bias, int N, int C);
void dt_cpu_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int N, int C);
void dt_cpu_matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                           int N, int C, int OC, int ldo);
void dt_cpu_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC, int ldd);
/* bf16 compute (ops.h): inp holds bf16 values already (the CPU's bf16 activations are the fp32
 * numbers equal to them: dt_cpu_to_bf16), weight (unless weight16 holds its values) and dout
 * (unless dout16 does) are rounded to bfloat16 in scratch copies, then the fp32 kernels above
 * run (bf16 x bf16 products are exact in fp32, so this is a bf16 GEMM with fp32 accumulation,
 * as a GPU's tensor cores do it, up to the order of the sums), and with gelu_in
 * dt_cpu_gelu_backward on dinp; dinp16 (which gelu_in needs): dinp rounded to bf16 last. dout
 * NULL: dbias sums dout16. 0, or -1 when the copies do not fit in memory (nothing written
 * then). */
int dt_cpu_matmul_forward_bf16(float *out, const float *inp, const float *weight,
                               const float *weight16, const float *bias, int N, int C, int OC,
                               int ldo);
int dt_cpu_matmul_backward_bf16(float *dinp, int dinp16, float *dweight, float *dbias,
                                const float *dout, const float *dout16, const float *inp,
                                const float *weight, const float *weight16, const float *gelu_in,
                                int N, int C, int OC, int ldd);
/* x rounded to the nearest bfloat16 (ties to even), as a float: the top 16 bits of its
 * pattern. Infinities stay; NaN stays NaN; finite values beyond bf16's range become inf. */
static inline float dt_bf16_round(float x)
{
  union {
    float f;
    unsigned u;
  } v = {x};
  if ((v.u & 0x7f800000u) == 0x7f800000u) /* inf, or NaN kept quiet with its sign */
    v.u = (v.u & 0x007fffffu) ? (v.u | 0x00400000u) & 0xffff0000u : v.u;
  else
    v.u = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u;
  return v.f;
}
/* rows x cols of src (row stride lds) rounded to bf16 into a new contiguous malloc'd buffer;
 * NULL when out of memory. */
float *dt_cpu_bf16_copy(const float *src, size_t rows, size_t cols, size_t lds);
/* dst[i] = dt_bf16_round(src[i]) (a CPU bf16 activation buffer); dst may be src. */
void dt_cpu_to_bf16(float *dst, const float *src, size_t n);
void dt_cpu_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C,
                              int NH);
void dt_cpu_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                               const float *att, int B, int T, int C, int NH);
/* Context parallelism: queries [q0, q0 + Tq) of Tall positions (attention.c). */
void dt_cpu_attention_forward_cp(float *out, float *att, const float *qkv, int B, int Tq, int q0,
                                 int Tall, int C, int NH);
void dt_cpu_attention_backward_cp(float *dqkv, float *scratch, const float *dout, const float *qkv,
                                  const float *att, int B, int Tq, int q0, int Tall, int C, int NH);
/* Flash-style: no (T, T) matrix, lse per query row instead (ops.h); 0, or -1 when a thread's
 * scratch does not fit in memory. */
int dt_cpu_attention_forward_flash(float *out, float *lse, const float *qkv, int B, int Tq, int q0,
                                   int Tall, int C, int NH);
int dt_cpu_attention_backward_flash(float *dqkv, const float *dout, const float *qkv,
                                    const float *out, const float *lse, int B, int Tq, int q0,
                                    int Tall, int C, int NH, int accumulate);
/* The same in bf16, with the GPU tensor-core kernels' arithmetic (attention.c states it): qkv
 * holds bf16 values (a CPU bf16 activation buffer), dout is rounded in a copy. */
int dt_cpu_attention_forward_flash_bf16(float *out, float *lse, const float *qkv, int B, int Tq,
                                        int q0, int Tall, int C, int NH);
int dt_cpu_attention_backward_flash_bf16(float *dqkv, const float *dout, const float *qkv,
                                         const float *out, const float *lse, int B, int Tq, int q0,
                                         int Tall, int C, int NH, int accumulate);
void dt_cpu_gelu_forward(float *out, const float *inp, size_t n);
void dt_cpu_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n);
void dt_cpu_residual_forward(float *out, const float *a, const float *b, size_t n);
void dt_cpu_crossentropy_forward_backward(float *losses, float *logits, const int *targets,
                                          float dloss, int N, int V, int Vp);
/* param16, where not NULL, gets the new parameters rounded to bf16 (dt_bf16_round). */
void dt_cpu_adamw_update(float *param, float *param16, const float *grad, float *m, float *v,
                         size_t n, float lr, float beta1, float beta2, float eps,
                         float weight_decay, float grad_scale, int t);
void dt_cpu_crossentropy_vp_stats(float *stats, const float *logits, const int *targets,
                                  int vocab_lo, int N, int Vl, int ldl);
void dt_cpu_crossentropy_vp_finish(float *losses, float *logits, const float *all_stats, int nranks,
                                   const int *targets, int vocab_lo, float dloss, int N, int Vl,
                                   int ldl);
double dt_cpu_sum_squares(const float *x, size_t n);

/* The OPENBLAS_CORETYPE that would give this CPU its proper kernels when the loaded OpenBLAS
 * fell back to its generic ones because it does not know the CPU; NULL otherwise (blas.c). */
const char *dt_cpu_blas_better_coretype(void);

#endif
