/* emul_launch.h — the kernel launch of the emulated trainer: cu2cc.py rewrites each
 * `kernel<<<grid, block, smem, stream>>>(args)` of kernels/cuda/ into
 * `dt_emul_launch(kernel, grid, block, smem, stream)(args)`, which runs the kernel under
 * cuda_emul.h's thread model when the runtime would launch it.
 *
 * Checked as the GPU checks them, and refused with the thread's last error set (the caller's
 * DT_CUDA_CHECK(cudaGetLastError()) sees it): the grid and block limits, the dynamic shared
 * memory the kernel is allowed, the stream (cuda_host.cc's dt_emul_launch_check). Checked beyond
 * the GPU, because the host would let it pass: every non-null pointer argument must point into
 * a live cudaMalloc allocation — a kernel handed host memory would read it here and fault there.
 * The kernel, with copies of its arguments, is queued on the stream (cuda_host.cc's streams: it
 * runs when the host waits for that stream's work, one kernel at a time in the process).
 * Included after cuda_emul.h, by the files cu2cc.py writes only. */
#ifndef DT_TESTS_EMUL_LAUNCH_H
#define DT_TESTS_EMUL_LAUNCH_H

#include <type_traits>

#include "cuda_host.h"

namespace dt_emul
{
template <typename T> inline bool device_pointer_ok(const T &v)
{
  if constexpr (std::is_pointer<T>::value) {
    if (v && !dt_emul_is_device_range((const void *)v, 0)) {
      fprintf(stderr, "cuda_emul: a kernel argument %p is not device memory\n", (const void *)v);
      return false;
    }
  }
  return true;
}

template <typename K> struct launcher {
  K kernel;
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;

  template <typename... A> void operator()(A... args) const
  {
    if (dt_emul_launch_check(reinterpret_cast<const void *>(kernel), grid, block, smem, stream) !=
        cudaSuccess)
      return;
    if (!(device_pointer_ok(args) && ...)) {
      dt_emul_set_last_error(cudaErrorIllegalAddress);
      return;
    }
    const K k = kernel; /* the closure outlives this launcher */
    const dim3 g = grid;
    const unsigned threads = block.x;
    const size_t bytes = smem;
    dt_emul_enqueue(stream, [=] { launch(g, threads, bytes, [&] { k(args...); }); });
  }
};
} /* namespace dt_emul */

/* cuda_runtime.h's overload for a kernel itself (nvcc's only, under __CUDACC__). */
template <typename T>
static cudaError_t cudaFuncSetAttribute(T *entry, enum cudaFuncAttribute attr, int value)
{
  return cudaFuncSetAttribute(reinterpret_cast<const void *>(entry), attr, value);
}

template <typename K>
static dt_emul::launcher<K> dt_emul_launch(K kernel, dim3 grid, dim3 block, size_t smem = 0,
                                           cudaStream_t stream = 0)
{
  return dt_emul::launcher<K>{kernel, grid, block, smem, stream};
}

#endif
