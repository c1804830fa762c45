/* cuda_check.h — check macros that turn CUDA runtime, cuBLAS and cuBLASLt failures into DT_ECUDA.
 *
 * Each macro evaluates its call once; on failure it logs an ERROR line (subsystem "kernel") with
 * the call's text, the library's error name and message, and the source file:line (the log
 * prints file:line itself only at debug level, so the message carries them), then either
 * returns DT_ECUDA from the enclosing int function or stores it in ret and jumps to label:
 *   DT_CUDA_CHECK(call)                   call returns cudaError_t
 *   DT_CUDA_CHECK_GOTO(call, ret, label)
 *   DT_CUBLAS_CHECK(call)                 call returns cublasStatus_t (cuBLAS and cuBLASLt)
 *   DT_CUBLAS_CHECK_GOTO(call, ret, label)
 * After a kernel launch, check the launch itself with DT_CUDA_CHECK(cudaGetLastError()).
 * Included from .cu files only (C++), so the C headers are wrapped in extern "C". */
#ifndef DT_KERNELS_CUDA_CHECK_H
#define DT_KERNELS_CUDA_CHECK_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "dt_error.h"
#include "dt_log.h"
#ifdef __cplusplus
}
#endif

#define DT__CUDA_LOG(call, e)                                                                      \
  DT_ERROR(KERNEL, "%s failed: %s: %s (%s:%d)", #call, cudaGetErrorName(e), cudaGetErrorString(e), \
           __FILE__, __LINE__)

#define DT__CUBLAS_LOG(call, s)                                                                    \
  DT_ERROR(KERNEL, "%s failed: cuBLAS status %d: %s (%s:%d)", #call, (int)(s),                     \
           cublasGetStatusString(s), __FILE__, __LINE__)

#define DT_CUDA_CHECK(call)                                                                        \
  do {                                                                                             \
    cudaError_t dt__ce = (call);                                                                   \
    if (dt__ce != cudaSuccess) {                                                                   \
      DT__CUDA_LOG(call, dt__ce);                                                                  \
      return DT_ECUDA;                                                                             \
    }                                                                                              \
  } while (0)

#define DT_CUDA_CHECK_GOTO(call, ret, label)                                                       \
  do {                                                                                             \
    cudaError_t dt__ce = (call);                                                                   \
    if (dt__ce != cudaSuccess) {                                                                   \
      DT__CUDA_LOG(call, dt__ce);                                                                  \
      (ret) = DT_ECUDA;                                                                            \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

#define DT_CUBLAS_CHECK(call)                                                                      \
  do {                                                                                             \
    cublasStatus_t dt__bs = (call);                                                                \
    if (dt__bs != CUBLAS_STATUS_SUCCESS) {                                                         \
      DT__CUBLAS_LOG(call, dt__bs);                                                                \
      return DT_ECUDA;                                                                             \
    }                                                                                              \
  } while (0)

#define DT_CUBLAS_CHECK_GOTO(call, ret, label)                                                     \
  do {                                                                                             \
    cublasStatus_t dt__bs = (call);                                                                \
    if (dt__bs != CUBLAS_STATUS_SUCCESS) {                                                         \
      DT__CUBLAS_LOG(call, dt__bs);                                                                \
      (ret) = DT_ECUDA;                                                                            \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

#endif
