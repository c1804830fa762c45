/* cuda_kernels.h — the CUDA backend's public entry points (built only when nvcc is present).
 *
 * dt_device_cuda_create gives a dt_device_t (kernels/device.h) whose memory is GPU memory and
 * whose kernel table is dt_ops_cuda(): the same contract as the CPU backend (kernels/ops.h),
 * each kernel checked against its CPU reference in kernels/cpu/ by tests/unit/test_cuda.c
 * (label "gpu", skipped without a device).
 *
 * Threading: kernels run from the thread that created the device (create makes its GPU the
 * thread's current device), on its compute stream. Copy, zero, accumulate, sync and the events
 * may also be called from another thread (the data-parallel comm thread): they make the device's
 * GPU current first, and that thread's copies, zeroes and accumulations go to the device's side
 * stream, which its sync() waits for (device.cu). */
#ifndef DT_KERNELS_CUDA_H
#define DT_KERNELS_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "device.h"
#include "probe.h" /* dt_cuda_device_count, dt_cuda_probe, dt_cuda_gpu_info */

/* Opens GPU `ordinal`: makes it the calling thread's current device, creates its stream
 * (non-blocking), its cuBLAS and cuBLASLt handles (fp32 math, no TF32), cuBLASLt's workspace
 * and an empty scratch workspace.
 * *out is the device, name "cuda:<ordinal>", comm backend "nccl", kernel table dt_ops_cuda().
 * 0, or DT_ECUDA / DT_ENOMEM with an error logged (*out NULL). */
int dt_device_cuda_create(int ordinal, dt_device_t **out);
/* Waits for the device's work, then frees its workspace, handle and stream. NULL is fine. Memory
 * handed out by alloc() is not tracked: free it first. */
void dt_device_cuda_destroy(dt_device_t *d);

/* The CUDA kernel table; its entries take a device made by dt_device_cuda_create. */
const dt_ops_t *dt_ops_cuda(void);

/* How many of the device's linear-layer products cuBLASLt had no algorithm for (run by cuBLAS
 * instead, the same arithmetic; the first is logged as a WARN). test_cuda requires 0. */
long dt_cuda_lt_fallbacks(const dt_device_t *dev);
/* Under DISTRAIN_CUDA_GEMM_TUNE=1: how many kinds of product had their algorithm chosen by
 * timing, how many of cuBLASLt's candidates were timed for them (*timed), and how many kinds
 * with several candidates kept the heuristic's first untimed (*untuned: no memory for a scratch
 * output, an auxiliary output overlapping an input, or every candidate failed); each pointer
 * may be NULL. */
long dt_cuda_lt_tuned(const dt_device_t *dev, long *timed, long *untuned);
/* The fp32 staging of bf16 outputs that cuBLASLt cannot write (such products are made in blocks
 * of columns): its size now, and the blocks' size (DT__CUDA_STAGE_MAX, 256 MiB, at create; tests
 * make it small). */
size_t dt_cuda_stage_bytes(const dt_device_t *dev);
void dt_cuda_set_stage_max(dt_device_t *dev, size_t bytes);
/* The bf16 flash attention backward keeps the score gradients of as many sequences (else heads)
 * at a time as fit this many bytes, or where one head's do not, recomputes them (0: the default,
 * 1 GiB; tests make it small). */
void dt_cuda_set_flash_ws_max(dt_device_t *dev, size_t bytes);
/* The cross-entropy's backward keeps each row in shared memory between its two passes where the
 * row takes at most this many bytes (default: half the opt-in shared memory of a block, so that
 * two blocks fit an SM; 0: never, each row read twice; tests set both). Returns the bound it
 * replaces. */
size_t dt_cuda_set_ce_keep_max(dt_device_t *dev, size_t bytes);

/* AdamW on device buffers, same contract as dt_cpu_adamw_update (kernels/ops.h), issued on the
 * legacy default stream; the kernel table's adamw_update runs the same kernel on the device's
 * stream. */
int dt_cuda_adamw_update(float *param, const float *grad, float *m, float *v, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                         int t);

#ifdef __cplusplus
}
#endif

#endif
