/* cuda_host.h — what tests/emul/cuda_host.cc, the host emulation of the CUDA runtime, cuBLAS and
 * cuBLASLt that the emulated trainer links instead of libcudart / libcublas / libcublasLt, tells
 * beyond the CUDA API: to the emulated kernel launcher (the dynamic shared memory a kernel was
 * allowed, a failed launch as the thread's last error) and to the tests (device ranges, live
 * bytes, whether a TF32 math mode was ever asked for). C++ linkage; thread-safe. */
#ifndef DT_TESTS_EMUL_CUDA_HOST_H
#define DT_TESTS_EMUL_CUDA_HOST_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#include <functional>

/* Whether a launch of func with this configuration on stream may run, as the runtime checks it:
 * the grid and block within the GPU's limits (and, of the emulation, 1D blocks),
 * the dynamic shared memory within what cudaFuncSetAttribute allowed func (48 KiB by default),
 * stream live and of the current GPU. A refusal is reported on stderr and becomes the thread's
 * last error, as a failed launch's does. */
cudaError_t dt_emul_launch_check(const void *func, dim3 grid, dim3 block, size_t smem,
                                 cudaStream_t stream);

/* Sets the calling thread's last error, as a failed launch does (cudaGetLastError returns it). */
void dt_emul_set_last_error(cudaError_t e);

/* Queues work (a checked launch) on stream, to run in order with the stream's other work when
 * the host waits for it (at once on the legacy stream); one piece of work runs at a time in the
 * process, as cuda_emul.h's thread model needs. */
void dt_emul_enqueue(cudaStream_t stream, std::function<void()> work);

/* Queues a gate on stream (a queuing stream, not the legacy one): the stream's later work runs
 * only once passed() is true, which work outside the streams makes so (the emulated NCCL's
 * operations, on threads of their own); until then a host wait on the stream waits, and
 * cudaStreamQuery answers cudaErrorNotReady. passed() is asked with the execution lock held,
 * so it must only read a flag. */
void dt_emul_enqueue_gate(cudaStream_t stream, std::function<bool()> passed);

/* Whether [p, p + bytes) lies inside one live cudaMalloc allocation (any GPU); bytes 0 asks
 * whether p itself does. */
bool dt_emul_is_device_range(const void *p, size_t bytes);

/* 1 if any cuBLAS handle was ever set to a TF32 math mode (CUBLAS_TF32_TENSOR_OP_MATH, with or
 * without flags), else 0: the trainer must never ask for one. */
int dt_emul_math_mode_tf32_seen(void);

/* Bytes of live device memory, all GPUs together. */
size_t dt_emul_live_bytes(void);

#endif
