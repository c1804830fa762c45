/* fake_nvml.c — a stand-in for libnvidia-ml, for test_gpu_usage and test_gpu_cluster: the
 * agent's NVML path run without a GPU or a driver. Built from the agent's own declarations
 * (nvml_api.h), so it checks how gpu_usage.c uses them, not that they match the real nvml.h.
 *
 * GPU "0000:3B:00.0": 80 GiB, 12 GiB used, 87% busy. GPU "0000:86:00.0": 40 GiB, 1 GiB used,
 * no utilisation (NOT_SUPPORTED, as on some MIG setups). GPUs "0000:00:0<n>.0", n < 4, are
 * tests/emul's emulated GPUs n (8 GiB, its default), as the agent's NVML sees them in
 * test_gpu_cluster.py: n + 1 GiB used, 10 (n + 1)% busy. Any other PCI address: NOT_FOUND.
 *
 * Health: every GPU but "0000:86:00.0" counts ECC errors and remaps rows, as an Ampere or later
 * data-centre GPU does (page retirement NOT_SUPPORTED); "0000:86:00.0" supports none of it. All
 * are healthy unless the file FAKE_NVML_HEALTH names (read at every query, so that a test can
 * change a GPU's health while the agent runs) has a line "PCI key=value ..." for it, with keys
 * lost (1: every query of it fails GPU_IS_LOST), ecc (the volatile uncorrected count), pending
 * and failed (the row remapper's flags), retired (1: page retirement supported and pending) and
 * slow (clocks event reasons, e.g. 0x40: hardware thermal slowdown; always with the idle and
 * software power cap bits, which are no trouble), xid (an Xid event, delivered once for each
 * new value; "0000:86:00.0" registers no events), nvlink_down (a mask of its 18 NVLinks that are
 * inactive), pcie (its PCIe link's width, of 16), pcie_replays (its PCIe replay counter),
 * nvlink_replays and nvlink_crc (NVLink 0's transmit replay and flow-control CRC error counters;
 * the other links' and counters' are 0; a link down does not answer them); "0000:86:00.0" has
 * none of the link queries. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nvml_api.h"

#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND        6
#define NVML_ERROR_UNKNOWN          999
#define FAKE_NVLINKS                18 /* an H100 SXM's */

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

/* The value of key for GPU d in FAKE_NVML_HEALTH; 0 where it has none. */
static unsigned long long health(const struct nvmlDevice_st *d, const char *key)
{
  const char *path = getenv("FAKE_NVML_HEALTH");
  FILE *f = path ? fopen(path, "r") : NULL;
  unsigned long long v = 0;
  char line[512];
  while (f && fgets(line, sizeof line, f)) {
    char *save;
    const char *tok = strtok_r(line, " \t\n", &save);
    if (!tok || strcmp(tok, d->pci) != 0)
      continue;
    while ((tok = strtok_r(NULL, " \t\n", &save)))
      if (strncmp(tok, key, strlen(key)) == 0 && tok[strlen(key)] == '=')
        v = strtoull(tok + strlen(key) + 1, NULL, 0);
  }
  if (f)
    fclose(f);
  return v;
}

/* NOT_SUPPORTED for "0000:86:00.0", GPU_IS_LOST for a lost GPU, else SUCCESS. */
static nvmlReturn_t health_query(const struct nvmlDevice_st *d)
{
  if (strcmp(d->pci, "0000:86:00.0") == 0)
    return NVML_ERROR_NOT_SUPPORTED;
  return health(d, "lost") ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

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
  if (health(d, "lost"))
    return NVML_ERROR_GPU_IS_LOST;
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

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, nvmlMemoryErrorType_t type,
                                         nvmlEccCounterType_t counter, unsigned long long *count)
{
  nvmlReturn_t r = health_query(d);
  if (r != NVML_SUCCESS)
    return r;
  /* the agent reads only the volatile uncorrected count: any other is 1000, to be caught */
  *count = type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED && counter == NVML_VOLATILE_ECC
               ? health(d, "ecc")
               : 1000;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failed)
{
  nvmlReturn_t r = health_query(d);
  if (r != NVML_SUCCESS)
    return r;
  *corr = 0;
  *unc = (unsigned)health(d, "pending");
  *pending = (unsigned)health(d, "pending");
  *failed = (unsigned)health(d, "failed");
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, nvmlEnableState_t *pending)
{
  nvmlReturn_t r = health_query(d);
  if (r != NVML_SUCCESS)
    return r;
  if (!health(d, "retired"))
    return NVML_ERROR_NOT_SUPPORTED;
  *pending = NVML_FEATURE_ENABLED;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *reasons)
{
  nvmlReturn_t r = health_query(d);
  if (r != NVML_SUCCESS)
    return r;
  *reasons = 0x1 | 0x4 | health(d, "slow"); /* idle, software power cap: no trouble */
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, nvmlEnableState_t *on)
{
  nvmlReturn_t r = health_query(d);
  if (r != NVML_SUCCESS)
    return r;
  if (link >= FAKE_NVLINKS)
    return NVML_ERROR_INVALID_ARGUMENT;
  *on = health(d, "nvlink_down") >> link & 1 ? NVML_FEATURE_DISABLED : NVML_FEATURE_ENABLED;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned int *width)
{
  nvmlReturn_t r = health_query(d);
  if (r == NVML_SUCCESS)
    *width = health(d, "pcie") ? (unsigned)health(d, "pcie") : 16;
  return r;
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned int *width)
{
  nvmlReturn_t r = health_query(d);
  if (r == NVML_SUCCESS)
    *width = 16;
  return r;
}

nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t d, unsigned int *value)
{
  nvmlReturn_t r = health_query(d);
  if (r == NVML_SUCCESS)
    *value = (unsigned)health(d, "pcie_replays");
  return r;
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t d, unsigned int link,
                                             nvmlNvLinkErrorCounter_t counter,
                                             unsigned long long *value)
{
  nvmlReturn_t r = health_query(d);
  if (r != NVML_SUCCESS)
    return r;
  if (link >= FAKE_NVLINKS || counter >= NVML_NVLINK_ERROR_COUNT)
    return NVML_ERROR_INVALID_ARGUMENT;
  if (health(d, "nvlink_down") >> link & 1)
    return NVML_ERROR_UNKNOWN; /* a link down does not answer */
  *value = link != 0                                  ? 0
           : counter == NVML_NVLINK_ERROR_DL_REPLAY   ? health(d, "nvlink_replays")
           : counter == NVML_NVLINK_ERROR_DL_CRC_FLIT ? health(d, "nvlink_crc")
                                                      : 0;
  return NVML_SUCCESS;
}

/* One event set (the agent makes one): which GPUs are registered, and the Xid each was last
 * sent. */
static struct nvmlEventSet_st {
  int registered[sizeof gpus / sizeof *gpus];
  unsigned long long sent[sizeof gpus / sizeof *gpus];
} the_set;

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
  memset(&the_set, 0, sizeof the_set);
  *set = &the_set;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set)
{
  nvmlReturn_t r = health_query(d);
  if (r != NVML_SUCCESS || types != nvmlEventTypeXidCriticalError)
    return r != NVML_SUCCESS ? r : NVML_ERROR_NOT_SUPPORTED;
  set->registered[d - gpus] = 1;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *e, unsigned int timeoutms)
{
  (void)timeoutms; /* nothing arrives while it waits */
  for (size_t i = 0; i < sizeof gpus / sizeof *gpus; i++) {
    const unsigned long long xid = set->registered[i] ? health(&gpus[i], "xid") : 0;
    if (xid && xid != set->sent[i]) {
      set->sent[i] = xid;
      *e = (nvmlEventData_t){.device = &gpus[i],
                             .eventType = nvmlEventTypeXidCriticalError,
                             .eventData = xid,
                             .gpuInstanceId = 0xFFFFFFFFu,
                             .computeInstanceId = 0xFFFFFFFFu};
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_TIMEOUT;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
  memset(set, 0, sizeof *set);
  return NVML_SUCCESS;
}
