/* fake_nvml.c — a stand-in for libnvidia-ml, for test_gpu_usage and test_gpu_cluster: the
 * agent's NVML path run without a GPU or a driver. Built from the agent's own declarations
 * (nvml_api.h), so it checks how gpu_usage.c uses them, not that they match the real nvml.h.
 *
 * GPU "0000:3B:00.0": 80 GiB, 12 GiB used, 87% busy. GPU "0000:86:00.0": 40 GiB, 1 GiB used,
 * no utilisation (NOT_SUPPORTED, as on some MIG setups). GPUs "0000:00:0<n>.0", n < 4, are
 * tests/emul's emulated GPUs n (8 GiB, its default), as the agent's NVML sees them in
 * test_gpu_cluster.py: n + 1 GiB used, 10 (n + 1)% busy. Any other PCI address: NOT_FOUND. */
#include <string.h>

#include "nvml_api.h"

#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND     6

/* What the test reads back (through dlsym on the same library). */
int fake_nvml_inits, fake_nvml_shutdowns;

static struct nvmlDevice_st {
  const char *pci;
  unsigned long long total, used;
  int util; /* -1: NOT_SUPPORTED */
} gpus[] = {
    {"0000:3B:00.0", 80ull << 30, 12ull << 30, 87}, {"0000:86:00.0", 40ull << 30, 1ull << 30, -1},
    {"0000:00:00.0", 8ull << 30, 1ull << 30, 10},   {"0000:00:01.0", 8ull << 30, 2ull << 30, 20},
    {"0000:00:02.0", 8ull << 30, 3ull << 30, 30},   {"0000:00:03.0", 8ull << 30, 4ull << 30, 40}};

nvmlReturn_t nvmlInit_v2(void)
{
  fake_nvml_inits++;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void)
{
  fake_nvml_shutdowns++;
  return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r)
{
  return r == NVML_ERROR_NOT_FOUND ? "Not Found" : "Unknown Error";
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pci, nvmlDevice_t *device)
{
  for (size_t i = 0; i < sizeof gpus / sizeof *gpus; i++)
    if (strcmp(pci, gpus[i].pci) == 0) {
      *device = &gpus[i];
      return NVML_SUCCESS;
    }
  return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
  m->total = d->total;
  m->used = d->used;
  m->free = d->total - d->used;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
  if (d->util < 0)
    return NVML_ERROR_NOT_SUPPORTED;
  u->gpu = (unsigned)d->util;
  u->memory = 0;
  return NVML_SUCCESS;
}
