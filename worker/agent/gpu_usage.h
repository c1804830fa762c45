/* gpu_usage.h — the memory in use and the utilisation of this node's GPUs, through NVML
 * loaded at run time (nvml_api.h says why it is not linked).
 *
 * GPUs are named by PCI address, which is how a CUDA ordinal (ordered fastest first, renumbered
 * by CUDA_VISIBLE_DEVICES) and an NVML handle (PCI order, every GPU) meet. Without NVML, or for
 * a GPU NVML does not know, the usage is unknown: never an error, the agent runs on. Create
 * and sample block (NVML initialises every GPU; a query talks to the driver): call them off
 * the agent's loop, one thread at a time. */
#ifndef DT_AGENT_GPU_USAGE_H
#define DT_AGENT_GPU_USAGE_H

#include <stdint.h>

typedef struct {
  int known;           /* the memory query succeeded */
  uint64_t used_bytes; /* in use, by any process */
  uint64_t total_bytes;
  int utilization_pct; /* -1 unknown (some GPUs, MIG instances, do not report it) */
} dt_gpu_sample_t;

typedef struct dt_gpu_usage dt_gpu_usage_t;

/* Loads NVML (lib: NULL for the driver's "libnvidia-ml.so.1"; tests pass a stand-in) and looks
 * up the n GPUs (pci_bus_ids[i] as cudaDeviceGetPCIBusId gives it). Warns once when NVML cannot
 * be used. 0, or DT_ENOMEM. */
int dt_gpu_usage_create(dt_gpu_usage_t **out, const char *lib, const char *const *pci_bus_ids,
                        int n);
/* Samples GPU i (0 <= i < n) into *s; whether its memory use is known. */
int dt_gpu_usage_sample(dt_gpu_usage_t *u, int i, dt_gpu_sample_t *s);
/* Shuts NVML down and unloads it. NULL is fine. */
void dt_gpu_usage_destroy(dt_gpu_usage_t *u);

#endif
