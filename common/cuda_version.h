/* cuda_version.h — CUDA version numbers in words, and the message for a driver too old for the
 * runtime this build links. Plain C with no CUDA dependency, so every build (and its tests)
 * has it; kernels/cuda/probe.cu feeds it the numbers the runtime reports.
 *
 * A version is as cudaDriverGetVersion / cudaRuntimeGetVersion give it: 1000 * major +
 * 10 * minor (12040 is 12.4). A driver version is the newest CUDA it supports; 0 means no
 * driver is installed. */
#ifndef DT_CUDA_VERSION_H
#define DT_CUDA_VERSION_H

#include <stddef.h>

/* "12.4" for 12040. */
void dt_cuda_version_str(int version, char *buf, size_t n);

/* Whether a driver is present but older than the runtime (driver 0 is no driver: not a
 * mismatch). The runtime's own verdict (cudaErrorInsufficientDriver) is what counts: a driver
 * of the same major version may run a newer minor runtime (minor version compatibility). */
int dt_cuda_driver_older(int driver, int runtime);

/* "CUDA driver supports up to 12.4, the runtime is 13.0: update the NVIDIA driver or use a
 * CUDA 12.4 build" — what to tell the user when the runtime refused the driver. */
void dt_cuda_mismatch_message(int driver, int runtime, char *buf, size_t n);

#endif
