/* probe.h — what the CUDA runtime sees on this machine: how many GPUs, each one's name, memory
 * and PCI address, and why a driver that is present cannot be used. Its own library
 * (dt_cuda_probe, the CUDA runtime only), so the agent learns its GPUs without loading cuBLAS
 * and the kernels. Nothing here creates a CUDA context: these are device property queries. */
#ifndef DT_KERNELS_CUDA_PROBE_H
#define DT_KERNELS_CUDA_PROBE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  char name[256];        /* "NVIDIA H100 80GB HBM3" */
  uint64_t memory_bytes; /* total device memory */
  char pci_bus_id[32];   /* "0000:3B:00.0": NVML finds the same GPU by it */
} dt_cuda_gpu_t;

/* Number of usable CUDA devices. A machine without a GPU or driver gives 0 and returns 0
 * (cudaErrorNoDevice / cudaErrorInsufficientDriver are "no GPU", not failures). */
int dt_cuda_device_count(int *count);

/* The same, saying why when there is a driver the runtime cannot use. *count is the GPUs
 * CUDA_VISIBLE_DEVICES leaves visible. why (len bytes, may be NULL) is empty when the machine
 * has no GPU or no driver, and otherwise says what is wrong: a driver older than the runtime
 * names both versions (cuda_version.h). Returns 0 with *count 0 for every "no usable GPU"
 * case, DT_ECUDA for another runtime failure (why names it). */
int dt_cuda_probe(int *count, char *why, size_t len);

/* Name, total memory and PCI address of GPU `ordinal` (0 <= ordinal < count). 0 or DT_ECUDA
 * with an error logged. */
int dt_cuda_gpu_info(int ordinal, dt_cuda_gpu_t *out);

#ifdef __cplusplus
}
#endif

#endif
