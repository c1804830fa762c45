/* ops.h — the kernel table every compute backend fills in.
 *
 * The trainer calls layers only through a dt_ops_t, so a CUDA backend (kernels/cuda/) can stand
 * in for the CPU one (kernels/cpu/) without touching the model code. Entries take the device
 * (kernels/device.h) and return an error code; the CPU table adapts the plain reference
 * kernels of cpu_kernels.h to that convention. One entry per layer,
 * forward and backward side by side; the CPU implementation of each is also the reference the
 * GPU kernels are tested against.
 *
 * Conventions (all tensors fp32, row-major, contiguous unless a stride is given):
 *   N  = number of rows (B*T tokens), C = channels, OC = output channels, NH = heads,
 *   hs = C/NH head size, Vp = padded vocabulary, V = real vocabulary.
 *   Parameter gradients ACCUMULATE (+=): they are summed over the micro-batches of a step and
 *   zeroed by the optimizer. Activation gradients are WRITTEN (=) unless a comment says +=; the
 *   residual-stream gradient is the one activation gradient that accumulates, because both the
 *   branch and the skip path feed it. */
#ifndef DT_KERNELS_OPS_H
#define DT_KERNELS_OPS_H

#include <stddef.h>

#include "dt_error.h"
#include "dt_log.h"

struct dt_device;

/* Every kernel takes the device it runs on (its stream, its handles) and returns 0 or a
 * negative DT_E* code: a GPU launch can fail, a CPU kernel does not. */
typedef struct dt_ops {
  const char *name; /* "cpu", "cuda" */

  /* out = wte[inp] + wpe[t]. wte may be a vocabulary-parallel slice holding the rows
   * [vocab_lo, vocab_lo + vocab_n) of the table: other tokens contribute 0 (their rank adds
   * them; the tensor-parallel all-reduce of the slices' outputs is exact). wpe NULL: no
   * position term. */
  int (*encoder_forward)(struct dt_device *dev, float *out,           /* (N=B*T, C) */
                         const int *inp,                              /* (B, T) token ids < V */
                         const float *wte,                            /* (vocab_n, C) */
                         int vocab_lo, int vocab_n, const float *wpe, /* (maxT, C) or NULL */
                         int B, int T, int C);
  /* dwte[inp - vocab_lo] += dout for the tokens in the slice, in token order; dwpe[t] += dout
   * (dwpe may be NULL). inp_host holds the same tokens in host memory (the caller's copy of
   * the micro-batch; inp itself on a host device): a GPU sorts them by row there, so that each
   * row's sum runs on its own threads. */
  int (*encoder_backward)(struct dt_device *dev, float *dwte,     /* (vocab_n, C) += */
                          int vocab_lo, int vocab_n, float *dwpe, /* (maxT, C) += or NULL */
                          const float *dout,                      /* (B*T, C) */
                          const int *inp,                         /* (B, T) */
                          const int *inp_host,                    /* (B, T), host memory */
                          int B, int T, int C);

  /* out = (inp - mean) * rstd * weight + bias, eps 1e-5; mean/rstd saved for backward */
  int (*layernorm_forward)(struct dt_device *dev, float *out, /* (N, C) */
                           float *mean,                       /* (N) */
                           float *rstd,                       /* (N) */
                           const float *inp,                  /* (N, C) */
                           const float *weight,               /* (C) */
                           const float *bias,                 /* (C) */
                           int N, int C);
  /* res = a + b, then out = LayerNorm(res) as above: the residual add and the LayerNorm that
   * reads it in one pass, with the bits of residual_forward then layernorm_forward on the same
   * device. res may alias a or b. */
  int (*residual_layernorm_forward)(struct dt_device *dev, float *res, /* (N, C) */
                                    float *out, float *mean, float *rstd, const float *a,
                                    const float *b, /* (N, C) each */
                                    const float *weight, const float *bias, int N, int C);
  /* The same two writing out into a bf16 activation buffer (bf16_bytes below): their fp32
   * outputs rounded to bf16, the input of the next linear layer under --precision bf16. NULL
   * without a bf16 path. */
  int (*layernorm_forward_bf16)(struct dt_device *dev, void *out, float *mean, float *rstd,
                                const float *inp, const float *weight, const float *bias, int N,
                                int C);
  int (*residual_layernorm_forward_bf16)(struct dt_device *dev, float *res, void *out, float *mean,
                                         float *rstd, const float *a, const float *b,
                                         const float *weight, const float *bias, int N, int C);
  int (*layernorm_backward)(struct dt_device *dev, float *dinp, /* (N, C) += (residual stream) */
                            float *dweight,                     /* (C) += */
                            float *dbias,                       /* (C) += */
                            const float *dout,                  /* (N, C) */
                            const float *inp,                   /* (N, C) */
                            const float *weight,                /* (C) */
                            const float *mean,                  /* (N) */
                            const float *rstd,                  /* (N) */
                            int N, int C);
  /* The same from a dout held in bf16 (a bf16 buffer of (N, C) values: the next linear layer's
   * dinp16 output), read as it is. NULL without a bf16 path. */
  int (*layernorm_backward_bf16)(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                                 const void *dout, const float *inp, const float *weight,
                                 const float *mean, const float *rstd, int N, int C);

  /* out = inp @ weight^T + bias (bias may be NULL); out has row stride ldo >= OC */
  int (*matmul_forward)(struct dt_device *dev, float *out, /* (N, ldo) */
                        const float *inp,                  /* (N, C) */
                        const float *weight,               /* (OC, C) */
                        const float *bias,                 /* (OC) or NULL */
                        int N, int C, int OC, int ldo);
  /* dinp = dout @ weight (dinp may be NULL); dweight += dout^T @ inp; dbias += sum_n dout */
  int (*matmul_backward)(struct dt_device *dev, float *dinp, /* (N, C) = */
                         float *dweight,                     /* (OC, C) += */
                         float *dbias,                       /* (OC) += or NULL */
                         const float *dout,                  /* (N, ldd) */
                         const float *inp,                   /* (N, C) */
                         const float *weight,                /* (OC, C) */
                         int N, int C, int OC, int ldd);

  /* The same two layers in bf16 compute (--precision bf16, PyTorch autocast's rule for linear
   * layers): every GEMM operand (inp, weight, dout) is a bfloat16 value and the products
   * accumulate in fp32, into fp32 outputs unless out16 / dinp16 below. inp is a bf16 activation
   * buffer (below), (N, C)
   * contiguous; weight and dout are fp32, rounded to bf16 (to nearest even) inside. The bias and
   * its gradient stay fp32 (dbias sums the unrounded dout), except that a bf16 output (out16)
   * adds the bias's bf16 value, as PyTorch autocast, which rounds a linear layer's bias too (and
   * cuBLASLt's bias epilogue takes a bias of the output's type only). weight16, where the caller
   * holds weight's bf16 values (a bf16 buffer of OC x C, e.g. what adamw_update's param16 wrote),
   * is read instead of rounding weight, which is then not read (the backward reads either only for
   * dinp). dout16, where the caller holds dout's bf16 values already, is used instead of
   * rounding dout: a bf16 buffer whose rows are ldd * 4 / bf16_bytes values apart; dout is then
   * read only for dbias (dbias with dout16 in dout's own bytes, whose fp32 values are gone, is
   * DT_EINVAL). dout NULL: the gradient exists in bf16 only (the cross-entropy's bf16 dlogits,
   * ldd = Vl * bf16_bytes / 4, Vl this rank's padded vocabulary columns; the MLP's pre-activation
   * gradient, as the gelu_in backward below wrote it, ldd = OC * bf16_bytes / 4) and dbias sums
   * dout16's values. dinp16: dinp is a bf16 buffer of (N, C) values, the fp32 results rounded to
   * bf16 (to nearest even; on a GPU as the GEMM stores them), else fp32 (N, C). gelu_in, where not
   * NULL (with dinp16; (N, C) like dinp), says the layer's input was GELU(gelu_in) and holds the
   * pre-activation as a bf16 buffer (the forward's out16 output): dinp is then gelu'(gelu_in) *
   * (dout @ weight), computed in fp32 before the rounding (on a GPU in the GEMM's epilogue, with no
   * pass of its own). out16 (forward): out is a bf16 activation buffer of N rows ldo values apart
   * (ldo >= OC; the columns past OC are not written) that gets the fp32 results, the bias's bf16
   * value added, rounded to bf16 (to nearest even; on a GPU as the GEMM stores them), else the fp32
   * (N, ldo) output above. res, where not NULL (fp32 out only): out = res + (inp @ weight^T +
   * bias), res laid out like out (a residual add with no pass of its own: on a GPU the GEMM's C
   * input; the fp32 sums may be added in another order there, as a GEMM's own are). gelu, where
   * not NULL (with out16, without res): a bf16 activation buffer laid out like out that gets
   * GELU(x) (tanh approximation, in fp32) of each fp32 result x, the bias's bf16 value added,
   * rounded to bf16, while out gets x rounded: the MLP's pre-activation and activation in one
   * pass (on a GPU cuBLASLt's GELU_AUX_BIAS epilogue, out its auxiliary output); the GELU of
   * x, not of x rounded (PyTorch autocast's GELU reads the rounded linear output: the two
   * differ by a bf16 rounding of the GELU's input). NULL where a backend has no bf16 path. */
  int (*matmul_forward_bf16)(struct dt_device *dev, void *out, int out16, const void *inp,
                             const float *weight, const void *weight16, const float *bias,
                             const float *res, void *gelu, int N, int C, int OC, int ldo);
  int (*matmul_backward_bf16)(struct dt_device *dev, void *dinp, int dinp16, float *dweight,
                              float *dbias, const float *dout, const void *dout16, const void *inp,
                              const float *weight, const void *weight16, const void *gelu_in, int N,
                              int C, int OC, int ldd);
  /* bf16 activation buffers: bf16_bytes bytes per value (0 where a backend has no bf16 path):
   * 2 on a GPU (bfloat16), 4 on the CPU (the fp32 number equal to the bfloat16, which its BLAS
   * reads as it is). A buffer of n values takes n * bf16_bytes bytes. */
  size_t bf16_bytes;
  /* dst (n bf16 values) = src rounded to bf16, to nearest even (NaN stays NaN) */
  int (*to_bf16)(struct dt_device *dev, void *dst, const float *src, size_t n);
  /* 1: the LM head's products run over the rank's whole padded vocabulary slice (a GPU's
   * tensor-core GEMMs stay on their slow unaligned kernels for GPT-2's 50257 columns; the padded
   * rows of wte are zero and get zero gradients, the cross-entropy reads the real columns only);
   * 0: over the real columns only (the CPU's BLAS takes any size: fewer products, and the bits
   * the golden files were made with). */
  int padded_head;

  /* causal multi-head self-attention over packed qkv; att keeps the softmax probabilities */
  int (*attention_forward)(struct dt_device *dev, float *out, /* (B, T, C) heads concatenated */
                           float *att,       /* (B, NH, T, T) probabilities, upper part 0 */
                           const float *qkv, /* (B, T, 3C) q | k | v */
                           int B, int T, int C, int NH);
  int (*attention_backward)(struct dt_device *dev, float *dqkv, /* (B, T, 3C) = */
                            float *scratch,                     /* (B, NH, T, T) workspace */
                            const float *dout,                  /* (B, T, C) */
                            const float *qkv,                   /* (B, T, 3C) */
                            const float *att,                   /* (B, NH, T, T) */
                            int B, int T, int C, int NH);
  /* Context parallelism: the Tq queries at positions [q0, q0 + Tq) of a sequence whose qkv holds
   * Tall positions per batch element (gathered from the cp group), against keys [0, q0 + Tq).
   * att and scratch are (B, NH, Tq, q0 + Tq); out and dout (B, Tq, C). Backward ADDS (+=) dq of
   * rows [q0, q0 + Tq) and dk, dv of rows [0, q0 + Tq) into dqkv (B, Tall, 3C) (the caller
   * zeroes it, adds each of its query chunks, then sums it over the group). A backend may leave
   * them NULL: the trainer then refuses cp > 1 on it. */
  int (*attention_forward_cp)(struct dt_device *dev, float *out, float *att, const float *qkv,
                              int B, int Tq, int q0, int Tall, int C, int NH);
  int (*attention_backward_cp)(struct dt_device *dev, float *dqkv, float *scratch,
                               const float *dout, const float *qkv, const float *att, int B, int Tq,
                               int q0, int Tall, int C, int NH);

  /* Flash-style (memory-efficient) attention over the same query and key ranges as the _cp
   * entries (q0 = 0, Tq = Tall: the whole sequence): no (T, T) matrix is kept. Forward writes
   * out (B, Tq, C) and lse (B, NH, Tq), each query row's log-sum-exp of its scaled scores.
   * Backward recomputes the probabilities from qkv and lse, takes the forward's out for
   * D = dout . out, and ADDS (+=, accumulate 1) or writes (=, accumulate 0) dq of rows
   * [q0, q0 + Tq) and dk, dv of rows [0, q0 + Tq) into dqkv (B, Tall, 3C): with q0 = 0 and
   * Tq = Tall a write covers all of dqkv, so it need not be zeroed first. NULL where a backend
   * has none: the trainer then keeps att. */
  int (*attention_forward_flash)(struct dt_device *dev, float *out, float *lse, const float *qkv,
                                 int B, int Tq, int q0, int Tall, int C, int NH);
  /* The largest head size C / NH the flash entries (both precisions) take; 0: any. The model
   * checks it when flash attention is chosen, so that a job is refused at start-up. */
  int flash_max_head_size;
  int (*attention_backward_flash)(struct dt_device *dev, float *dqkv, const float *dout,
                                  const float *qkv, const float *out, const float *lse, int B,
                                  int Tq, int q0, int Tall, int C, int NH, int accumulate);
  /* The flash entries in bf16 compute (--precision bf16, as PyTorch autocast's SDPA): qkv is a
   * bf16 activation buffer (B, Tall, 3C) (the qkv layer's out16 output) and dout is rounded to
   * bf16; every product a bf16 GEMM accumulating in fp32; the softmax, lse and D = dout . out
   * in fp32 (from dout's fp32 values and out's bf16 ones); the probabilities and score
   * gradients rounded to bf16 as the operands of their products, the probabilities relative to
   * the running maximum of 64-key tiles (the GPU's flash_mma.cuh streams the keys so; the CPU
   * follows it exactly; the exponentials themselves are each device's: the GPU's 2^x of one FMA,
   * a few fp32 ulps from the CPU's e^x, which now and then rounds a probability to the next bf16
   * value). out is a bf16 activation buffer (B, Tq, C) that gets the output
   * rounded to bf16 (as autocast's SDPA returns it; the attention projection's input as it is),
   * lse stays fp32, and so do the gradients added into a context-parallel buffer; with dqkv16
   * (one whole sequence: q0 0, Tall Tq, accumulate 0) dqkv is a bf16 buffer of (B, Tq, 3C)
   * values that gets the gradients rounded to bf16 (to nearest even; as autocast's SDPA returns
   * them, and what the qkv layer's backward reads as they are); with dout16 too (dqkv16's cases
   * only) dout is a bf16 buffer of (B, Tq, C) values (the attention projection's dinp16 output),
   * read as it is, and D is computed from those values. NULL where a backend has none: bf16 is
   * then refused with flash attention. */
  int (*attention_forward_flash_bf16)(struct dt_device *dev, void *out, float *lse, const void *qkv,
                                      int B, int Tq, int q0, int Tall, int C, int NH);
  int (*attention_backward_flash_bf16)(struct dt_device *dev, void *dqkv, int dqkv16,
                                       const void *dout, int dout16, const void *qkv,
                                       const void *out, const float *lse, int B, int Tq, int q0,
                                       int Tall, int C, int NH, int accumulate);

  /* GELU, tanh approximation (under --precision bf16 matmul_forward_bf16's gelu output) */
  int (*gelu_forward)(struct dt_device *dev, float *out, const float *inp, size_t n);
  /* dinp = dout * gelu'(inp); dinp may alias dout */
  int (*gelu_backward)(struct dt_device *dev, float *dinp, const float *inp, const float *dout,
                       size_t n);

  /* out = a + b */
  int (*residual_forward)(struct dt_device *dev, float *out, const float *a, const float *b,
                          size_t n);

  /* Fused softmax + cross-entropy over the first V of Vp columns, forward and backward in one
   * pass. losses[i] = -log softmax(logits[i])[targets[i]]. When dloss != 0, logits is
   * overwritten in place by dlogits = (softmax - onehot) * dloss (columns >= V set to 0). */
  int (*crossentropy_forward_backward)(struct dt_device *dev, float *losses, /* (N) */
                                       float *logits,      /* (N, Vp) in: logits, out: dlogits */
                                       const int *targets, /* (N) */
                                       float dloss, int N, int V, int Vp);
  /* The same on bf16 logits (the LM head's out16 output under bf16 compute): logits is a bf16
   * buffer of (N, Vp) values, read as they are, and when dloss != 0 overwritten in place by the
   * dlogits rounded to bf16 (to nearest even), which all the LM head's bf16 GEMMs read as they
   * are. NULL without a bf16 path. */
  int (*crossentropy_forward_backward_bf16)(struct dt_device *dev, float *losses, void *logits,
                                            const int *targets, float dloss, int N, int V, int Vp);

  /* Vocabulary-parallel cross-entropy over logits of columns [vocab_lo, vocab_lo + Vl)
   * (row stride ldl >= Vl). stats gets per row (local max, local sum of exp(x - max), target
   * logit if held here else 0); after the tensor-parallel group has exchanged them (all_stats:
   * nranks blocks of (N, 3)), finish combines them into losses and, when dloss != 0,
   * overwrites the logits with dlogits = (softmax - onehot) * dloss (columns >= Vl zeroed). */
  int (*crossentropy_vp_stats)(struct dt_device *dev, float *stats, /* (N, 3) */
                               const float *logits,                 /* (N, ldl) */
                               const int *targets,                  /* (N) */
                               int vocab_lo, int N, int Vl, int ldl);
  int (*crossentropy_vp_finish)(struct dt_device *dev, float *losses, /* (N) */
                                float *logits,          /* (N, ldl) in: logits, out: dlogits */
                                const float *all_stats, /* (nranks, N, 3) */
                                int nranks, const int *targets, int vocab_lo, float dloss, int N,
                                int Vl, int ldl);
  /* The pair on bf16 logits, as crossentropy_forward_backward_bf16 takes them: (N, ldl) values
   * of a bf16 buffer, overwritten in place by the dlogits rounded to bf16. NULL without a bf16
   * path. */
  int (*crossentropy_vp_stats_bf16)(struct dt_device *dev, float *stats, const void *logits,
                                    const int *targets, int vocab_lo, int N, int Vl, int ldl);
  int (*crossentropy_vp_finish_bf16)(struct dt_device *dev, float *losses, void *logits,
                                     const float *all_stats, int nranks, const int *targets,
                                     int vocab_lo, float dloss, int N, int Vl, int ldl);

  /* PyTorch AdamW, one tensor: p *= 1 - lr*wd; m,v moments; p -= (lr/bc1) * m / (sqrt(v)/sqrt(bc2)
   * + eps) with bc1 = 1 - beta1^t, bc2 = 1 - beta2^t; grad is multiplied by grad_scale first
   * (clip). param16, where not NULL, gets the new p rounded to bf16 (n values of a bf16 buffer,
   * bf16_bytes each; the weights the bf16 linear layers read) in the same pass. */
  int (*adamw_update)(struct dt_device *dev, float *param, void *param16, const float *grad,
                      float *m, float *v, size_t n, float lr, float beta1, float beta2, float eps,
                      float weight_decay, float grad_scale, int t);
  /* *out = sum of squares, accumulated in double */
  int (*sum_squares)(struct dt_device *dev, const float *x, size_t n, double *out);
} dt_ops_t;

/* matmul_forward_bf16's rules on a bf16 output (ops.h above), for every backend: 0, or
 * DT_EINVAL (logged). */
static inline int dt_bf16_forward_check(int out16, const float *res, const void *gelu, int OC,
                                        int ldo)
{
  if (out16 && ldo < OC) {
    DT_ERROR(KERNEL,
             "matmul_forward_bf16: a bf16 output's rows are %d values apart, fewer than OC %d", ldo,
             OC);
    return DT_EINVAL;
  }
  if (out16 && res) {
    DT_ERROR(KERNEL, "matmul_forward_bf16: a residual add into a bf16 output");
    return DT_EINVAL;
  }
  if (gelu && (!out16 || res)) {
    DT_ERROR(KERNEL, "matmul_forward_bf16: a GELU output beside an fp32 output or a residual add");
    return DT_EINVAL;
  }
  return 0;
}

/* matmul_backward_bf16's rules on dout and dout16 (ops.h above), for every backend, whose
 * dout16 rows are row16 values apart (ldd * 4 / bf16_bytes): 0, or DT_EINVAL (logged). */
static inline int dt_bf16_backward_check(int dinp16, const float *dbias, const float *dout,
                                         const void *dout16, const void *gelu_in, int OC,
                                         long row16)
{
  if (gelu_in && !dinp16) {
    DT_ERROR(KERNEL, "matmul_backward_bf16: a GELU gradient (gelu_in) is a bf16 dinp (dinp16)");
    return DT_EINVAL;
  }
  if (!dout && !dout16) {
    DT_ERROR(KERNEL, "matmul_backward_bf16: no output gradient (dout and dout16 NULL)");
    return DT_EINVAL;
  }
  if (dout16 && row16 < OC) {
    DT_ERROR(KERNEL, "matmul_backward_bf16: dout16's rows are %ld values apart, shorter than OC %d",
             row16, OC);
    return DT_EINVAL;
  }
  if (dbias && dout16 && dout16 == (const void *)dout) {
    DT_ERROR(KERNEL, "matmul_backward_bf16: dbias asked of a dout overwritten by its bf16 values");
    return DT_EINVAL;
  }
  return 0;
}

/* attention_backward_flash_bf16's rules on dqkv16 and dout16 (above), for every backend: 0, or
 * DT_EINVAL (logged). */
static inline int dt_flash_dqkv16_check(int dqkv16, int dout16, int Tq, int q0, int Tall,
                                        int accumulate)
{
  if (dout16 && !dqkv16) {
    DT_ERROR(KERNEL,
             "attention_backward_flash_bf16: a bf16 dout with bf16 gradients (dqkv16) only");
    return DT_EINVAL;
  }
  if (dqkv16 && (q0 != 0 || Tall != Tq || accumulate)) {
    DT_ERROR(KERNEL,
             "attention_backward_flash_bf16: bf16 gradients of one whole sequence only (q0 %d, "
             "Tq %d, Tall %d, accumulate %d)",
             q0, Tq, Tall, accumulate);
    return DT_EINVAL;
  }
  return 0;
}

/* The CPU backend (always available). */
const dt_ops_t *dt_ops_cpu(void);

#endif
