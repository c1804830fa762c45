/* test_cuda_events.cu — kernels for test_cuda's check of the device's events: one that marks
 * host-mapped memory, one that holds the device's stream until the host lets it go (or a bound
 * of about five seconds passes, which it reports). Launched on the device's own stream. */
#include "cuda_impl.h"

__global__ static void mark_kernel(volatile int *mark)
{
  *mark = 1;
  __threadfence_system();
}

__global__ static void hold_kernel(volatile int *go, volatile int *timed_out)
{
  const long long t0 = clock64(), bound = 10000000000LL; /* cycles: ~5 s at 2 GHz */
  while (!*go)
    if (clock64() - t0 > bound) {
      *timed_out = 1;
      break;
    }
  __threadfence_system();
}

extern "C" int dt_test_cuda_mark(dt_device_t *dev, volatile int *mark)
{
  mark_kernel<<<1, 1, 0, dt__cuda(dev)->stream>>>(mark);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

extern "C" int dt_test_cuda_hold(dt_device_t *dev, volatile int *go, volatile int *timed_out)
{
  hold_kernel<<<1, 1, 0, dt__cuda(dev)->stream>>>(go, timed_out);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}
