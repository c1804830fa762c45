/* cuda_impl.h — what the CUDA backend's files share (internal, .cu files only): the device's
 * private state, its scratch buffers, launch geometry, block reductions and the entries that
 * ops_cuda.cu puts in the kernel table.
 *
 * Invariants every kernel file keeps:
 * - All kernel-table work is issued on the device's compute stream (dt__cuda(dev)->stream),
 *   including cuBLAS calls (the handle is bound to that stream at create time); only device.cu's
 *   copy, zero and accumulate also serve other threads, on the side stream.
 * - No atomics: every reduction has a fixed shape that depends on the problem size only (not on
 *   the GPU model or on timing), so results are bit-identical from run to run.
 * - Elementwise kernels use size_t indices and grid-stride loops over a capped grid, so any n
 *   works; per-row kernels take one block per row (N < 2^31 blocks is within gridDim.x).
 * - Entries return 0 at once for empty problems (a zero-block launch is an error) and check
 *   every launch with DT_CUDA_CHECK(cudaGetLastError()). */
#ifndef DT_KERNELS_CUDA_IMPL_H
#define DT_KERNELS_CUDA_IMPL_H

#include <pthread.h>
#include <stddef.h>

#include "block.cuh"
#include "cuda_check.h"
#include "cuda_kernels.h"
#include "gemm.cuh"

/* ------------------------------------------------------------------------------------------ */
/* The device                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* The fp32 staging of a bf16 output that cuBLASLt cannot write holds at most this many bytes
 * at a time (matmul.cu's linear_gemm makes such a product in blocks of columns): 256 MiB, within
 * the 1 GiB the planner leaves free by default. */
#define DT__CUDA_STAGE_MAX ((size_t)256 << 20)

/* The linear layer's products remember cuBLASLt's algorithm for each kind of product they meet
 * (matmul.cu's gemm_kind: shape, layouts, types, epilogue, the pointers' alignments), up to this
 * many kinds (GPT-2 makes about 15); past them each product asks the heuristic again. */
#define DT__CUDA_LT_KINDS 64
#define DT__CUDA_LT_KEY   8
typedef struct {
  long long key[DT__CUDA_LT_KEY];
  cublasLtMatmulAlgo_t algo;
} dt__cuda_lt_kind_t;

typedef struct dt_cuda_impl {
  dt_device_t dev; /* the public face; dev.impl points back to this struct */
  int ordinal;
  pthread_t owner;     /* the thread that created it: the one that runs kernels */
  cudaStream_t stream; /* the owner's kernels, memsets, copies and cuBLAS calls */
  cudaStream_t side;   /* other threads' copies, zeroes and accumulations (device.cu) */
  cublasHandle_t blas; /* bound to stream, CUBLAS_DEFAULT_MATH (no TF32) */
  cublasLtHandle_t lt; /* the linear layer's GEMMs (matmul.cu), issued on stream */
  void *lt_ws;         /* cuBLASLt's workspace, fixed at create (only ever used on stream) */
  size_t lt_ws_bytes;
  int use_lt;        /* DISTRAIN_CUDA_CUBLASLT (default 1): 0 runs the linear layer on cuBLAS */
  long lt_fallbacks; /* products cuBLASLt had no algorithm for, run by cuBLAS instead */
  unsigned long long lt_warned[8]; /* the first distinct such products' signatures (WARNed) */
  int lt_tune; /* DISTRAIN_CUDA_GEMM_TUNE (default 0): each kind's algorithm by timing */
  int wgmma;   /* DISTRAIN_CUDA_WGMMA (default 0; 9.0 only): bf16 flash attention on wgmma */
  int lt_nkinds;
  dt__cuda_lt_kind_t lt_kinds[DT__CUDA_LT_KINDS]; /* the algorithm of each kind met so far */
  long lt_tuned;   /* kinds whose algorithm was chosen by timing cuBLASLt's candidates */
  long lt_timed;   /* candidates timed for them */
  long lt_untuned; /* kinds with candidates to time that kept the first (scratch, overlap) */
  void *ws;        /* scratch for partial sums; grows, never shrinks */
  size_t ws_bytes;
  void *stage; /* fp32 products on their way to a bf16 output, where cuBLAS writes them */
  size_t stage_bytes;
  size_t stage_max;    /* their blocks' size (DT__CUDA_STAGE_MAX; a column of m floats at least) */
  size_t flash_ws_max; /* the bf16 flash backward's score gradients at a time (0: 1 GiB) */
  size_t smem_optin;   /* the most dynamic shared memory a block may ask for (opting in) */
  size_t ce_keep_max;  /* the cross-entropy keeps rows of at most this many bytes on chip */
  float *ones;         /* ones_n floats equal to 1.0f (column sums through GEMV) */
  size_t ones_n;       /* its allocation is ones_n floats (0 when there is none) */
  void *pin;           /* pinned host memory: encoder.cu's token lists on their way up */
  size_t pin_bytes;    /* grows, never shrinks */
  cudaEvent_t pin_copied; /* the last copy out of pin (created on first use) */
  char name[32];          /* "cuda:<ordinal>" */
} dt_cuda_impl_t;

static inline dt_cuda_impl_t *dt__cuda(struct dt_device *d)
{
  return (dt_cuda_impl_t *)d->impl;
}

/* At least `bytes` of device scratch, valid until the next call (one request per entry: a
 * second request may move the buffer). Growing waits for the stream, since queued kernels may
 * still read the old buffer. 0 or DT_ENOMEM / DT_ECUDA. */
int dt__cuda_workspace(dt_cuda_impl_t *c, size_t bytes, void **out);
/* At least `bytes` of device memory for matmul.cu's fp32 products that a bf16 output gets
 * rounded from, when cuBLASLt cannot write it (its own buffer, like the workspace: grows, never
 * shrinks, valid until the next call). */
int dt__cuda_stage(dt_cuda_impl_t *c, size_t bytes, void **out);
/* A device vector of at least n ones (its own buffer, independent of the workspace). */
int dt__cuda_ones(dt_cuda_impl_t *c, size_t n, const float **out);
/* The bf16 flash forward on Hopper's wgmma (attention_wgmma.cu, sm_90a; under
 * DISTRAIN_CUDA_WGMMA=1 on a GPU of compute capability 9.0; scale 1 / sqrt(head size)): 1
 * launched, 0 when the shape is not one it takes (head size 64, C a multiple of 8, qkv 16-byte
 * aligned), or DT_ECUDA. */
int dt__cuda_wgmma_forward(dt_cuda_impl_t *cu, uint16_t *out, float *lse, const uint16_t *qkv,
                           int B, int Tq, int q0, int Tall, int C, int NH, float scale);
/* The bf16 backward's dk/dv kernel on wgmma, in place of fmma_backward_dkdv_kernel for one group
 * of bn sequences and hn heads from h0 (its arguments; dqkv bf16 where dqkv16, else fp32; dout
 * bf16): 1 launched, 0 when it does not take the shape (also dout 16-byte aligned), or DT_ECUDA. */
int dt__cuda_wgmma_dkdv(dt_cuda_impl_t *cu, void *dqkv, int dqkv16, uint16_t *ds_tiles,
                        const float *D, const uint16_t *dout, const uint16_t *qkv, const float *lse,
                        int bn, int hn, int Tq, int q0, int Tall, int C, int NH, int h0,
                        float scale, int add);
/* Its dq kernel from the dS tiles, in place of fmma_backward_dq_kernel: the same answers. */
int dt__cuda_wgmma_dq(dt_cuda_impl_t *cu, void *dqkv, int dqkv16, const uint16_t *ds_tiles,
                      const uint16_t *qkv, int bn, int hn, int Tq, int q0, int Tall, int C, int NH,
                      int h0, float scale, int add);

/* Runs a gemm.cuh descriptor of fp32 operands on the device's handle: cublasSgemm,
 * cublasSgemmStridedBatched for batch > 1, cublasSgemv for one column (n = 1, B not
 * transposed). No bias epilogue (that is dt__cuda_gemm_lt's). */
int dt__cuda_gemm(dt_cuda_impl_t *c, const dt_gemm_t *g);
/* Runs a batch-1 descriptor through cuBLASLt (gemm_lt.h builds its form: A and B of type ab,
 * CUDA_R_32F or CUDA_R_16BF, C fp32, fp32 accumulation, the bias epilogue when g->bias is set),
 * with the algorithm cuBLASLt's heuristic ranks first, or under DISTRAIN_CUDA_GEMM_TUNE=1 the
 * fastest of its candidates (timed on the first product of each kind); either is remembered for
 * the kind. DT_ENOTSUP when cuBLASLt has no algorithm for it (nothing was run; logged at debug
 * level). */
int dt__cuda_gemm_lt(dt_cuda_impl_t *c, const dt_gemm_t *g, cudaDataType_t ab);

/* Launch geometry, grid-stride loops and block reductions: block.cuh (device code that the
 * kernels' .cuh headers share, also compiled on the host by tests/unit/cuda_emul.h). */

/* ------------------------------------------------------------------------------------------ */
/* Kernel-table entries (contracts in kernels/ops.h)                                            */
/* ------------------------------------------------------------------------------------------ */

int dt__cuda_encoder_forward(struct dt_device *dev, float *out, const int *inp, const float *wte,
                             int vocab_lo, int vocab_n, const float *wpe, int B, int T, int C);
int dt__cuda_encoder_backward(struct dt_device *dev, float *dwte, int vocab_lo, int vocab_n,
                              float *dwpe, const float *dout, const int *inp, const int *inp_host,
                              int B, int T, int C);
int dt__cuda_layernorm_forward(struct dt_device *dev, float *out, float *mean, float *rstd,
                               const float *inp, const float *weight, const float *bias, int N,
                               int C);
int dt__cuda_residual_layernorm_forward(struct dt_device *dev, float *res, float *out, float *mean,
                                        float *rstd, const float *a, const float *b,
                                        const float *weight, const float *bias, int N, int C);
int dt__cuda_layernorm_forward_bf16(struct dt_device *dev, void *out, float *mean, float *rstd,
                                    const float *inp, const float *weight, const float *bias, int N,
                                    int C);
int dt__cuda_residual_layernorm_forward_bf16(struct dt_device *dev, float *res, void *out,
                                             float *mean, float *rstd, const float *a,
                                             const float *b, const float *weight, const float *bias,
                                             int N, int C);
int dt__cuda_layernorm_backward(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                                const float *dout, const float *inp, const float *weight,
                                const float *mean, const float *rstd, int N, int C);
int dt__cuda_layernorm_backward_bf16(struct dt_device *dev, float *dinp, float *dweight,
                                     float *dbias, const void *dout, const float *inp,
                                     const float *weight, const float *mean, const float *rstd,
                                     int N, int C);
int dt__cuda_matmul_forward(struct dt_device *dev, float *out, const float *inp,
                            const float *weight, const float *bias, int N, int C, int OC, int ldo);
int dt__cuda_matmul_backward(struct dt_device *dev, float *dinp, float *dweight, float *dbias,
                             const float *dout, const float *inp, const float *weight, int N, int C,
                             int OC, int ldd);
int dt__cuda_matmul_forward_bf16(struct dt_device *dev, void *out, int out16, const void *inp,
                                 const float *weight, const void *weight16, const float *bias,
                                 const float *res, void *gelu, int N, int C, int OC, int ldo);
int dt__cuda_matmul_backward_bf16(struct dt_device *dev, void *dinp, int dinp16, float *dweight,
                                  float *dbias, const float *dout, const void *dout16,
                                  const void *inp, const float *weight, const void *weight16,
                                  const void *gelu_in, int N, int C, int OC, int ldd);
int dt__cuda_to_bf16(struct dt_device *dev, void *dst, const float *src, size_t n);
int dt__cuda_attention_forward(struct dt_device *dev, float *out, float *att, const float *qkv,
                               int B, int T, int C, int NH);
int dt__cuda_attention_backward(struct dt_device *dev, float *dqkv, float *scratch,
                                const float *dout, const float *qkv, const float *att, int B, int T,
                                int C, int NH);
int dt__cuda_attention_forward_cp(struct dt_device *dev, float *out, float *att, const float *qkv,
                                  int B, int Tq, int q0, int Tall, int C, int NH);
int dt__cuda_attention_backward_cp(struct dt_device *dev, float *dqkv, float *scratch,
                                   const float *dout, const float *qkv, const float *att, int B,
                                   int Tq, int q0, int Tall, int C, int NH);
int dt__cuda_attention_forward_flash(struct dt_device *dev, float *out, float *lse,
                                     const float *qkv, int B, int Tq, int q0, int Tall, int C,
                                     int NH);
int dt__cuda_attention_backward_flash(struct dt_device *dev, float *dqkv, const float *dout,
                                      const float *qkv, const float *out, const float *lse, int B,
                                      int Tq, int q0, int Tall, int C, int NH, int accumulate);
/* The same contracts in bf16 on the tensor cores (flash_mma.cuh states the numerics; the CPU's
 * _flash_bf16 kernels follow them), the model's attention under --precision bf16;
 * tests/unit/test_flash_emul.cc checks the kernels on the host, test_cuda on a GPU. */
int dt__cuda_attention_forward_flash_bf16(struct dt_device *dev, void *out, float *lse,
                                          const void *qkv, int B, int Tq, int q0, int Tall, int C,
                                          int NH);
int dt__cuda_attention_backward_flash_bf16(struct dt_device *dev, void *dqkv, int dqkv16,
                                           const void *dout, int dout16, const void *qkv,
                                           const void *out, const float *lse, int B, int Tq, int q0,
                                           int Tall, int C, int NH, int accumulate);
int dt__cuda_gelu_forward(struct dt_device *dev, float *out, const float *inp, size_t n);
int dt__cuda_gelu_backward(struct dt_device *dev, float *dinp, const float *inp, const float *dout,
                           size_t n);
int dt__cuda_residual_forward(struct dt_device *dev, float *out, const float *a, const float *b,
                              size_t n);
int dt__cuda_crossentropy_forward_backward(struct dt_device *dev, float *losses, float *logits,
                                           const int *targets, float dloss, int N, int V, int Vp);
int dt__cuda_crossentropy_forward_backward_bf16(struct dt_device *dev, float *losses, void *logits,
                                                const int *targets, float dloss, int N, int V,
                                                int Vp);
int dt__cuda_crossentropy_vp_stats(struct dt_device *dev, float *stats, const float *logits,
                                   const int *targets, int vocab_lo, int N, int Vl, int ldl);
int dt__cuda_crossentropy_vp_stats_bf16(struct dt_device *dev, float *stats, const void *logits,
                                        const int *targets, int vocab_lo, int N, int Vl, int ldl);
int dt__cuda_crossentropy_vp_finish(struct dt_device *dev, float *losses, float *logits,
                                    const float *all_stats, int nranks, const int *targets,
                                    int vocab_lo, float dloss, int N, int Vl, int ldl);
int dt__cuda_crossentropy_vp_finish_bf16(struct dt_device *dev, float *losses, void *logits,
                                         const float *all_stats, int nranks, const int *targets,
                                         int vocab_lo, float dloss, int N, int Vl, int ldl);
int dt__cuda_adamw_update(struct dt_device *dev, float *param, void *param16, const float *grad,
                          float *m, float *v, size_t n, float lr, float beta1, float beta2,
                          float eps, float weight_decay, float grad_scale, int t);
int dt__cuda_sum_squares(struct dt_device *dev, const float *x, size_t n, double *out);

#endif
