/* nvml_api.h — the few NVML declarations the agent uses, written out by hand.
 *
 * NVML (libnvidia-ml.so.1) ships with the NVIDIA driver, not with the CUDA toolkit: a CPU
 * machine has neither the library nor nvml.h, and the agent must run there. So the agent
 * dlopens the library at run time (gpu_usage.c) and declares what it calls here, as in NVML
 * API version 12 (nvml.h of CUDA 12.x, drivers r525 and later). These entry points and structs
 * have kept this form since the _v2 entry points of NVML API version 6, so older drivers serve
 * them too. Add a declaration only from nvml.h, exactly as it is there. */
#ifndef DT_AGENT_NVML_API_H
#define DT_AGENT_NVML_API_H

typedef int nvmlReturn_t; /* an enum in nvml.h; int-sized */
#define NVML_SUCCESS 0

typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct nvmlMemory_st {
  unsigned long long total; /* bytes */
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_t;

typedef struct nvmlUtilization_st {
  unsigned int gpu;    /* percent of the sample period a kernel was running */
  unsigned int memory; /* percent of it device memory was being read or written */
} nvmlUtilization_t;

/* The functions, as pointer types for dlsym. */
typedef nvmlReturn_t (*nvmlInit_v2_fn)(void);
typedef nvmlReturn_t (*nvmlShutdown_fn)(void);
typedef const char *(*nvmlErrorString_fn)(nvmlReturn_t result);
typedef nvmlReturn_t (*nvmlDeviceGetHandleByPciBusId_v2_fn)(const char *pciBusId,
                                                            nvmlDevice_t *device);
typedef nvmlReturn_t (*nvmlDeviceGetMemoryInfo_fn)(nvmlDevice_t device, nvmlMemory_t *memory);
typedef nvmlReturn_t (*nvmlDeviceGetUtilizationRates_fn)(nvmlDevice_t device,
                                                         nvmlUtilization_t *utilization);

#endif
