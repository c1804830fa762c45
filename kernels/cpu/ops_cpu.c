/* ops_cpu.c — the CPU backend's kernel table: the reference kernels of cpu_kernels.h, which take
 * no device and cannot fail, adapted to the table's convention (ops.h), on the host addresses
 * behind the device's pointers (the remote CPU device translates them). */
#include <stdlib.h>

#include "../ops.h"
#include "cpu_kernels.h"
#include "device.h"
#include "dt_error.h"
#include "dt_log.h"

/* Host addresses of the remote CPU device's pointers (device.h). */
#define H(p) dt_device_host_ptr(dev, (p))

static int encoder_forward(struct dt_device *dev, float *out, const int *inp, const float *wte,
                           int vocab_lo, int vocab_n, const float *wpe, int B, int T, int C)
{
  dt_cpu_encoder_forward(H(out), H(inp), H(wte), vocab_lo, vocab_n, H(wpe), B, T, C);
  return 0;
}

static int encoder_backward(struct dt_device *dev, float *dwte, int vocab_lo, int vocab_n,
                            float *dwpe, const float *dout, const int *inp, const int *inp_host,
                            int B, int T, int C)
{
  (void)inp_host; /* one thread walks the tokens in order: no sorting */
  dt_cpu_encoder_backward(H(dwte), vocab_lo, vocab_n, H(dwpe), H(dout), H(inp), B, T, C);
  return 0;
}

static int layernorm_forward(struct dt_device *dev, float *out, float *mean, float *rstd,
                             const float *inp, const float *weight, const float *bias, int N, int C)
{
  dt_cpu_layernorm_forward(H(out), H(mean), H(rstd), H(inp), H(weight), H(bias), N, C);
  return 0;
}

static int residual_layernorm_forward(struct dt_device *dev, float *res, float *out, float *mean,
                                      float *rstd, const float *a, const float *b,
                                      const float *weight, const float *bias, int N, int C)
{
  dt_cpu_residual_layernorm_forward(H(res), H(out), H(mean), H(rstd), H(a), H(b), H(weight),
                                    H(bias), N, C);
  return 0;
}

/* The bf16 LayerNorms: the fp32 kernels' values, rounded in place (a CPU bf16 buffer holds
 * floats). */
static int layernorm_forward_bf16(struct dt_device *dev, void *out, float *mean, float *rstd,
                                  const float *inp, const float *weight, const float *bias, int N,
                                  int C)
{
  dt_cpu_layernorm_forward(H(out), H(mean), H(rstd), H(inp), H(weight), H(bias), N, C);
  dt_cpu_to_bf16(H(out), H(out), (size_t)N * C);
  return 0;
}

static int residual_layernorm_forward_bf16(struct dt_device *dev, float *res, void *out,
                                           float *mean, float *rstd, const float *a, const float *b,
                                           const float *weight, const float *bias, int N, int C)
{
  dt_cpu_residual_layernorm_forward(H(res), H(out), H(mean), H(rstd), H(a), H(b), H(weight),
                                    H(bias), N, C);
  dt_cpu_to_bf16(H(out), H(out), (size_t)N * C);
  return 0;
}

static int layernorm_backward(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                              const float *dout, const float *inp, const float *weight,
                              const float *mean, const float *rstd, int N, int C)
{
  dt_cpu_layernorm_backward(H(dinp), H(dweight), H(dbias), H(dout), H(inp), H(weight), H(mean),
                            H(rstd), N, C);
  return 0;
}

/* A CPU bf16 buffer holds floats (the bf16 values): the fp32 entry. */
static int layernorm_backward_bf16(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                                   const void *dout, const float *inp, const float *weight,
                                   const float *mean, const float *rstd, int N, int C)
{
  return layernorm_backward(dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}

static int matmul_forward(struct dt_device *dev, float *out, const float *inp, const float *weight,
                          const float *bias, int N, int C, int OC, int ldo)
{
  dt_cpu_matmul_forward(H(out), H(inp), H(weight), H(bias), N, C, OC, ldo);
  return 0;
}

static int matmul_backward(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                           const float *dout, const float *inp, const float *weight, int N, int C,
                           int OC, int ldd)
{
  dt_cpu_matmul_backward(H(dinp), H(dweight), H(dbias), H(dout), H(inp), H(weight), N, C, OC, ldd);
  return 0;
}

static int matmul_forward_bf16(struct dt_device *dev, void *out, int out16, const void *inp,
                               const float *weight, const void *weight16, const float *bias,
                               const float *res, void *gelu, int N, int C, int OC, int ldo)
{
  DT_CHECK(dt_bf16_forward_check(out16, res, gelu, OC, ldo));
  float *o = H(out);
  float *b16 = NULL; /* a bf16 output adds the bias's bf16 value (ops.h) */
  if (out16 && bias && !(b16 = dt_cpu_bf16_copy(H(bias), 1, (size_t)OC, (size_t)OC)))
    return DT_ENOMEM;
  const int rc = dt_cpu_matmul_forward_bf16(o, H(inp), H(weight), H(weight16), b16 ? b16 : H(bias),
                                            N, C, OC, ldo);
  free(b16);
  if (rc != 0)
    return DT_ENOMEM;
  /* the CPU's bf16 buffers: the fp32 numbers equal to the rounded values; the GELU of the
   * unrounded x, then rounded (gelu_forward's values); the rows as one run where contiguous */
  float *g = H(gelu);
  const size_t runs = ldo == OC ? 1 : (size_t)N, n = (size_t)OC * (ldo == OC ? (size_t)N : 1);
  for (size_t i = 0; out16 && i < runs; i++) {
    if (g) {
      dt_cpu_gelu_forward(g + i * ldo, o + i * ldo, n);
      dt_cpu_to_bf16(g + i * ldo, g + i * ldo, n);
    }
    dt_cpu_to_bf16(o + i * ldo, o + i * ldo, n);
  }
  const float *r = H(res);
  for (size_t i = 0; r && i < (size_t)N; i++) /* as residual_forward adds a branch: res + it */
    for (size_t j = 0; j < (size_t)OC; j++)
      o[i * ldo + j] = r[i * ldo + j] + o[i * ldo + j];
  return 0;
}

static int matmul_backward_bf16(struct dt_device *dev, void *dinp, int dinp16, float *dweight,
                                float *dbias, const float *dout, const void *dout16,
                                const void *inp, const float *weight, const void *weight16,
                                const void *gelu_in, int N, int C, int OC, int ldd)
{
  DT_CHECK(dt_bf16_backward_check(dinp16, dbias, dout, dout16, gelu_in, OC, ldd));
  return dt_cpu_matmul_backward_bf16(H(dinp), dinp16, H(dweight), H(dbias), H(dout), H(dout16),
                                     H(inp), H(weight), H(weight16), H(gelu_in), N, C, OC, ldd) == 0
             ? 0
             : DT_ENOMEM;
}

static int attention_forward(struct dt_device *dev, float *out, float *att, const float *qkv, int B,
                             int T, int C, int NH)
{
  dt_cpu_attention_forward(H(out), H(att), H(qkv), B, T, C, NH);
  return 0;
}

static int attention_backward(struct dt_device *dev, float *dqkv, float *scratch, const float *dout,
                              const float *qkv, const float *att, int B, int T, int C, int NH)
{
  dt_cpu_attention_backward(H(dqkv), H(scratch), H(dout), H(qkv), H(att), B, T, C, NH);
  return 0;
}

static int attention_forward_cp(struct dt_device *dev, float *out, float *att, const float *qkv,
                                int B, int Tq, int q0, int Tall, int C, int NH)
{
  dt_cpu_attention_forward_cp(H(out), H(att), H(qkv), B, Tq, q0, Tall, C, NH);
  return 0;
}

static int attention_backward_cp(struct dt_device *dev, float *dqkv, float *scratch,
                                 const float *dout, const float *qkv, const float *att, int B,
                                 int Tq, int q0, int Tall, int C, int NH)
{
  dt_cpu_attention_backward_cp(H(dqkv), H(scratch), H(dout), H(qkv), H(att), B, Tq, q0, Tall, C,
                               NH);
  return 0;
}

static int attention_forward_flash(struct dt_device *dev, float *out, float *lse, const float *qkv,
                                   int B, int Tq, int q0, int Tall, int C, int NH)
{
  return dt_cpu_attention_forward_flash(H(out), H(lse), H(qkv), B, Tq, q0, Tall, C, NH) == 0
             ? 0
             : DT_ENOMEM;
}

static int attention_backward_flash(struct dt_device *dev, float *dqkv, const float *dout,
                                    const float *qkv, const float *out, const float *lse, int B,
                                    int Tq, int q0, int Tall, int C, int NH, int accumulate)
{
  return dt_cpu_attention_backward_flash(H(dqkv), H(dout), H(qkv), H(out), H(lse), B, Tq, q0, Tall,
                                         C, NH, accumulate) == 0
             ? 0
             : DT_ENOMEM;
}

/* out: the fp32 output, then rounded in place (the CPU's bf16 buffer). */
static int attention_forward_flash_bf16(struct dt_device *dev, void *out, float *lse,
                                        const void *qkv, int B, int Tq, int q0, int Tall, int C,
                                        int NH)
{
  float *o = H(out);
  if (dt_cpu_attention_forward_flash_bf16(o, H(lse), H(qkv), B, Tq, q0, Tall, C, NH) != 0)
    return DT_ENOMEM;
  dt_cpu_to_bf16(o, o, (size_t)B * Tq * C);
  return 0;
}

/* dqkv16: the fp32 gradients, then rounded in place (the CPU's bf16 buffer); a CPU bf16 dout
 * (dout16) holds floats, the bf16 values, which the same arithmetic reads. */
static int attention_backward_flash_bf16(struct dt_device *dev, void *dqkv, int dqkv16,
                                         const void *dout, int dout16, const void *qkv,
                                         const void *out, const float *lse, int B, int Tq, int q0,
                                         int Tall, int C, int NH, int accumulate)
{
  DT_CHECK(dt_flash_dqkv16_check(dqkv16, dout16, Tq, q0, Tall, accumulate));
  float *g = H(dqkv);
  if (dt_cpu_attention_backward_flash_bf16(g, H(dout), H(qkv), H(out), H(lse), B, Tq, q0, Tall, C,
                                           NH, accumulate) != 0)
    return DT_ENOMEM;
  if (dqkv16)
    dt_cpu_to_bf16(g, g, (size_t)B * Tq * 3 * C);
  return 0;
}

static int gelu_forward(struct dt_device *dev, float *out, const float *inp, size_t n)
{
  dt_cpu_gelu_forward(H(out), H(inp), n);
  return 0;
}

static int to_bf16(struct dt_device *dev, void *dst, const float *src, size_t n)
{
  dt_cpu_to_bf16(H(dst), H(src), n);
  return 0;
}

static int gelu_backward(struct dt_device *dev, float *dinp, const float *inp, const float *dout,
                         size_t n)
{
  dt_cpu_gelu_backward(H(dinp), H(inp), H(dout), n);
  return 0;
}

static int residual_forward(struct dt_device *dev, float *out, const float *a, const float *b,
                            size_t n)
{
  dt_cpu_residual_forward(H(out), H(a), H(b), n);
  return 0;
}

static int crossentropy_forward_backward(struct dt_device *dev, float *losses, float *logits,
                                         const int *targets, float dloss, int N, int V, int Vp)
{
  dt_cpu_crossentropy_forward_backward(H(losses), H(logits), H(targets), dloss, N, V, Vp);
  return 0;
}

/* A CPU bf16 buffer holds floats (the bf16 values): the fp32 arithmetic, the dlogits rounded in
 * place. */
static int crossentropy_forward_backward_bf16(struct dt_device *dev, float *losses, void *logits,
                                              const int *targets, float dloss, int N, int V, int Vp)
{
  dt_cpu_crossentropy_forward_backward(H(losses), H(logits), H(targets), dloss, N, V, Vp);
  if (dloss != 0.0f)
    dt_cpu_to_bf16(H(logits), H(logits), (size_t)N * Vp);
  return 0;
}

static int crossentropy_vp_stats(struct dt_device *dev, float *stats, const float *logits,
                                 const int *targets, int vocab_lo, int N, int Vl, int ldl)
{
  dt_cpu_crossentropy_vp_stats(H(stats), H(logits), H(targets), vocab_lo, N, Vl, ldl);
  return 0;
}

static int crossentropy_vp_finish(struct dt_device *dev, float *losses, float *logits,
                                  const float *all_stats, int nranks, const int *targets,
                                  int vocab_lo, float dloss, int N, int Vl, int ldl)
{
  dt_cpu_crossentropy_vp_finish(H(losses), H(logits), H(all_stats), nranks, H(targets), vocab_lo,
                                dloss, N, Vl, ldl);
  return 0;
}

static int crossentropy_vp_stats_bf16(struct dt_device *dev, float *stats, const void *logits,
                                      const int *targets, int vocab_lo, int N, int Vl, int ldl)
{
  return crossentropy_vp_stats(dev, stats, logits, targets, vocab_lo, N, Vl, ldl);
}

/* dlogits rounded in place, as crossentropy_forward_backward_bf16's. */
static int crossentropy_vp_finish_bf16(struct dt_device *dev, float *losses, void *logits,
                                       const float *all_stats, int nranks, const int *targets,
                                       int vocab_lo, float dloss, int N, int Vl, int ldl)
{
  dt_cpu_crossentropy_vp_finish(H(losses), H(logits), H(all_stats), nranks, H(targets), vocab_lo,
                                dloss, N, Vl, ldl);
  if (dloss != 0.0f)
    dt_cpu_to_bf16(H(logits), H(logits), (size_t)N * ldl);
  return 0;
}

static int adamw_update(struct dt_device *dev, float *param, void *param16, const float *grad,
                        float *m, float *v, size_t n, float lr, float beta1, float beta2, float eps,
                        float weight_decay, float grad_scale, int t)
{
  dt_cpu_adamw_update(H(param), H(param16), H(grad), H(m), H(v), n, lr, beta1, beta2, eps,
                      weight_decay, grad_scale, t);
  return 0;
}

static int sum_squares(struct dt_device *dev, const float *x, size_t n, double *out)
{
  *out = dt_cpu_sum_squares(H(x), n);
  return 0;
}

static const dt_ops_t g_cpu_ops = {
    .name = "cpu",
    .encoder_forward = encoder_forward,
    .encoder_backward = encoder_backward,
    .layernorm_forward = layernorm_forward,
    .residual_layernorm_forward = residual_layernorm_forward,
    .layernorm_forward_bf16 = layernorm_forward_bf16,
    .residual_layernorm_forward_bf16 = residual_layernorm_forward_bf16,
    .layernorm_backward = layernorm_backward,
    .layernorm_backward_bf16 = layernorm_backward_bf16,
    .matmul_forward = matmul_forward,
    .matmul_backward = matmul_backward,
    .matmul_forward_bf16 = matmul_forward_bf16,
    .matmul_backward_bf16 = matmul_backward_bf16,
    .bf16_bytes = sizeof(float),
    .to_bf16 = to_bf16,
    .attention_forward = attention_forward,
    .attention_backward = attention_backward,
    .attention_forward_cp = attention_forward_cp,
    .attention_backward_cp = attention_backward_cp,
    .attention_forward_flash = attention_forward_flash,
    .attention_backward_flash = attention_backward_flash,
    .attention_forward_flash_bf16 = attention_forward_flash_bf16,
    .attention_backward_flash_bf16 = attention_backward_flash_bf16,
    .gelu_forward = gelu_forward,
    .gelu_backward = gelu_backward,
    .residual_forward = residual_forward,
    .crossentropy_forward_backward = crossentropy_forward_backward,
    .crossentropy_forward_backward_bf16 = crossentropy_forward_backward_bf16,
    .crossentropy_vp_stats = crossentropy_vp_stats,
    .crossentropy_vp_stats_bf16 = crossentropy_vp_stats_bf16,
    .crossentropy_vp_finish = crossentropy_vp_finish,
    .crossentropy_vp_finish_bf16 = crossentropy_vp_finish_bf16,
    .adamw_update = adamw_update,
    .sum_squares = sum_squares,
};

const dt_ops_t *dt_ops_cpu(void)
{
  return &g_cpu_ops;
}
