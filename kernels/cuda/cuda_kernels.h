/* cuda_kernels.h — the CUDA backend's entry points (built only when nvcc is present).
 * It grows into a full dt_ops_t in the CUDA-backend issue; each kernel is checked against its
 * CPU reference in kernels/cpu/ by a test labelled "gpu" that skips without a device. */
#ifndef DT_KERNELS_CUDA_H
#define DT_KERNELS_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices. A machine without a GPU or driver gives 0 and returns 0
 * (cudaErrorNoDevice / cudaErrorInsufficientDriver are "no GPU", not failures). */
int dt_cuda_device_count(int *count);

/* AdamW on device buffers, same contract as dt_cpu_adamw_update (kernels/ops.h). */
int dt_cuda_adamw_update(float *param, const float *grad, float *m, float *v, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                         int t);

#ifdef __cplusplus
}
#endif

#endif
