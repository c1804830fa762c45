/* gpu_usage.c — see gpu_usage.h. */
#include "gpu_usage.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "dt_error.h"
#include "dt_log.h"
#include "dt_param.h"
#include "dt_util.h"
#include "nvml_api.h"

/* How often a GPU's link error counters are read: their rates are over the last such window,
 * scaled to a minute (tests shorten it). */
DT_PARAM(GpuErrorWindowMs, "GPU_ERROR_WINDOW_MS", 60000)

/* A GPU's link error counters (dt_gpu_sample_t's order: PCIe replays, NVLink replays and
 * recoveries, NVLink CRC errors) when its current window began, and their rates a minute over
 * the last whole window; -1: unknown. */
enum { PCIE_REPLAYS, NVLINK_REPLAYS, NVLINK_CRC, LINK_COUNTERS };
typedef struct {
  double t0_ms; /* 0: not read yet */
  int64_t base[LINK_COUNTERS], per_min[LINK_COUNTERS];
} link_errors_t;

struct dt_gpu_usage {
  void *lib; /* NULL: no NVML, every sample unknown */
  int n;
  nvmlDevice_t *dev; /* (n) NULL where NVML does not know the GPU */
  nvmlShutdown_fn shutdown;
  nvmlDeviceGetHandleByPciBusId_v2_fn by_pci;
  nvmlErrorString_fn error_string;
  nvmlDeviceGetMemoryInfo_fn memory_info;
  nvmlDeviceGetUtilizationRates_fn utilization;
  nvmlDeviceGetTotalEccErrors_fn ecc_errors; /* the health queries: NULL where NVML lacks one */
  nvmlDeviceGetRetiredPagesPendingStatus_fn retired_pending;
  nvmlDeviceGetRemappedRows_fn remapped_rows;
  nvmlDeviceGetCurrentClocksEventReasons_fn clocks_events;
  nvmlEventSet_t events; /* the GPUs' Xid events, or NULL */
  nvmlEventSetWait_v2_fn event_wait;
  nvmlEventSetFree_fn event_free;
  int *xid;                                  /* (n) each GPU's newest critical Xid, 0: none */
  int ignore[DT_GPU_IGNORED_XIDS], n_ignore; /* dt_gpu_usage_ignore_xids */
  nvmlDeviceGetNvLinkState_fn nvlink_state;
  nvmlDeviceGetCurrPcieLinkWidth_fn pcie_width;
  nvmlDeviceGetMaxPcieLinkWidth_fn pcie_max_width;
  uint64_t *links; /* (n) each GPU's NVLinks active at create (bit i: link i) */
  nvmlDeviceGetPcieReplayCounter_fn pcie_replays;
  nvmlDeviceGetNvLinkErrorCounter_fn nvlink_errors;
  link_errors_t *errors; /* (n) */
};

static const char *nvml_error(const dt_gpu_usage_t *u, nvmlReturn_t r)
{
  const char *s = u->error_string ? u->error_string(r) : NULL;
  return s ? s : "unknown NVML error";
}

/* dlopen and nvmlInit; on any failure u->lib stays NULL and the reason is logged. */
static void load(dt_gpu_usage_t *u, const char *path)
{
  void *lib = dlopen(path ? path : "libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    DT_WARN(WORKER, "NVML not available (%s): GPU memory use and utilisation stay unknown",
            dlerror());
    return;
  }
  /* dlsym gives void *; POSIX guarantees it converts to a function pointer. */
  nvmlInit_v2_fn init = (nvmlInit_v2_fn)dlsym(lib, "nvmlInit_v2");
  u->shutdown = (nvmlShutdown_fn)dlsym(lib, "nvmlShutdown");
  u->error_string = (nvmlErrorString_fn)dlsym(lib, "nvmlErrorString");
  u->memory_info = (nvmlDeviceGetMemoryInfo_fn)dlsym(lib, "nvmlDeviceGetMemoryInfo");
  u->utilization = (nvmlDeviceGetUtilizationRates_fn)dlsym(lib, "nvmlDeviceGetUtilizationRates");
  u->by_pci = (nvmlDeviceGetHandleByPciBusId_v2_fn)dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2");
  u->ecc_errors = (nvmlDeviceGetTotalEccErrors_fn)dlsym(lib, "nvmlDeviceGetTotalEccErrors");
  u->retired_pending = (nvmlDeviceGetRetiredPagesPendingStatus_fn)dlsym(
      lib, "nvmlDeviceGetRetiredPagesPendingStatus");
  u->remapped_rows = (nvmlDeviceGetRemappedRows_fn)dlsym(lib, "nvmlDeviceGetRemappedRows");
  u->clocks_events = (nvmlDeviceGetCurrentClocksEventReasons_fn)dlsym(
      lib, "nvmlDeviceGetCurrentClocksEventReasons");
  if (!u->clocks_events)
    u->clocks_events = (nvmlDeviceGetCurrentClocksEventReasons_fn)dlsym(
        lib, "nvmlDeviceGetCurrentClocksThrottleReasons");
  u->nvlink_state = (nvmlDeviceGetNvLinkState_fn)dlsym(lib, "nvmlDeviceGetNvLinkState");
  u->pcie_width = (nvmlDeviceGetCurrPcieLinkWidth_fn)dlsym(lib, "nvmlDeviceGetCurrPcieLinkWidth");
  u->pcie_max_width = (nvmlDeviceGetMaxPcieLinkWidth_fn)dlsym(lib, "nvmlDeviceGetMaxPcieLinkWidth");
  u->pcie_replays = (nvmlDeviceGetPcieReplayCounter_fn)dlsym(lib, "nvmlDeviceGetPcieReplayCounter");
  u->nvlink_errors =
      (nvmlDeviceGetNvLinkErrorCounter_fn)dlsym(lib, "nvmlDeviceGetNvLinkErrorCounter");
  u->event_wait = (nvmlEventSetWait_v2_fn)dlsym(lib, "nvmlEventSetWait_v2");
  u->event_free = (nvmlEventSetFree_fn)dlsym(lib, "nvmlEventSetFree");
  if (!init || !u->shutdown || !u->memory_info || !u->by_pci) {
    DT_WARN(WORKER, "NVML lacks an entry point the agent needs: GPU usage unknown");
    dlclose(lib);
    return;
  }
  nvmlReturn_t r = init();
  if (r != NVML_SUCCESS) {
    DT_WARN(WORKER, "nvmlInit failed: %s: GPU usage unknown", nvml_error(u, r));
    dlclose(lib);
    return;
  }
  u->lib = lib;
}

int dt_gpu_usage_app_xid(unsigned long long xid)
{
  return xid == 13 || xid == 31 || xid == 43 || xid == 45 || xid == 68 || xid == 109;
}

/* Registers the GPUs' Xid events with one set, polled by every sample; where NVML cannot (no such
 * entry point, a GPU that does not support it) those GPUs have none. */
static void watch_xids(dt_gpu_usage_t *u)
{
  void *lib = u->lib;
  nvmlEventSetCreate_fn create = (nvmlEventSetCreate_fn)dlsym(lib, "nvmlEventSetCreate");
  nvmlDeviceRegisterEvents_fn reg =
      (nvmlDeviceRegisterEvents_fn)dlsym(lib, "nvmlDeviceRegisterEvents");
  if (!create || !reg || !u->event_wait || !u->event_free || create(&u->events) != NVML_SUCCESS) {
    u->events = NULL;
    return;
  }
  for (int i = 0; i < u->n; i++)
    if (u->dev[i] && reg(u->dev[i], nvmlEventTypeXidCriticalError, u->events) != NVML_SUCCESS)
      DT_INFO(WORKER, "GPU %d: NVML reports no Xid events for it", i);
}

void dt_gpu_usage_ignore_xids(dt_gpu_usage_t *u, const int *xids, int n)
{
  u->n_ignore = DT_MIN(n, DT_GPU_IGNORED_XIDS);
  memcpy(u->ignore, xids, (size_t)u->n_ignore * sizeof *xids);
}

static int ignored(const dt_gpu_usage_t *u, unsigned long long xid)
{
  for (int k = 0; k < u->n_ignore; k++)
    if ((unsigned long long)u->ignore[k] == xid)
      return 1;
  return 0;
}

/* Takes the Xid events waiting (at most 64 a call), keeping each GPU's newest critical one. */
static void take_xids(dt_gpu_usage_t *u)
{
  nvmlEventData_t e;
  for (int k = 0; u->events && k < 64 && u->event_wait(u->events, &e, 0) == NVML_SUCCESS; k++) {
    if (!(e.eventType & nvmlEventTypeXidCriticalError) || dt_gpu_usage_app_xid(e.eventData))
      continue;
    for (int i = 0; i < u->n; i++) {
      if (!u->dev[i] || u->dev[i] != e.device)
        continue;
      if (ignored(u, e.eventData)) {
        DT_INFO(WORKER, "GPU %d: Xid %llu (NVML), ignored (--ignore-xids)", i, e.eventData);
        continue;
      }
      u->xid[i] = (int)DT_MIN(e.eventData, 100000ull);
      DT_WARN(WORKER,
              "GPU %d: Xid %llu, a critical error of the GPU (NVML): it stays reported until "
              "this agent restarts",
              i, e.eventData);
    }
  }
}

/* The NVLinks active on GPU d (bit i: link i), 0 where it has none or NVML cannot say; *links:
 * how many links NVML knows of on it, active or not. */
static uint64_t active_links(const dt_gpu_usage_t *u, nvmlDevice_t d, int *links)
{
  uint64_t active = 0;
  *links = 0;
  for (unsigned l = 0; u->nvlink_state && l < NVML_NVLINK_MAX_LINKS; l++) {
    nvmlEnableState_t on;
    if (u->nvlink_state(d, l, &on) != NVML_SUCCESS)
      continue;
    ++*links;
    if (on == NVML_FEATURE_ENABLED)
      active |= 1ull << l;
  }
  return active;
}

/* Counts the links active on each GPU as the agent starts: only those are watched (a link down
 * already is no change to report), so a GPU with NVLinks but fewer active than another of the
 * node's is named in the log. */
static void watch_links(dt_gpu_usage_t *u)
{
  int most = 0;
  int *links = calloc(u->n > 0 ? (size_t)u->n : 1, sizeof *links);
  if (!links)
    return; /* no links watched: none reported down */
  for (int i = 0; i < u->n; i++)
    if (u->dev[i]) {
      u->links[i] = active_links(u, u->dev[i], &links[i]);
      most = DT_MAX(most, __builtin_popcountll(u->links[i]));
    }
  for (int i = 0; i < u->n; i++)
    if (links[i] > 0 && __builtin_popcountll(u->links[i]) < most)
      DT_WARN(WORKER,
              "GPU %d has %d NVLinks active, another GPU of this node %d: a link may be down "
              "(nvidia-smi nvlink --status)",
              i, __builtin_popcountll(u->links[i]), most);
  free(links);
}

int dt_gpu_usage_create(dt_gpu_usage_t **out, const char *lib, const char *const *pci_bus_ids,
                        int n)
{
  dt_gpu_usage_t *u = calloc(1, sizeof *u);
  if (!u)
    return DT_ENOMEM;
  u->n = n;
  u->dev = calloc(n > 0 ? (size_t)n : 1, sizeof *u->dev);
  u->xid = calloc(n > 0 ? (size_t)n : 1, sizeof *u->xid);
  u->links = calloc(n > 0 ? (size_t)n : 1, sizeof *u->links);
  u->errors = calloc(n > 0 ? (size_t)n : 1, sizeof *u->errors);
  if (!u->dev || !u->xid || !u->links || !u->errors) {
    dt_gpu_usage_destroy(u);
    return DT_ENOMEM;
  }
  for (int i = 0; i < n; i++)
    for (int k = 0; k < LINK_COUNTERS; k++)
      u->errors[i].per_min[k] = -1;
  load(u, lib);
  for (int i = 0; u->lib && i < n; i++) {
    nvmlReturn_t r = u->by_pci(pci_bus_ids[i], &u->dev[i]);
    if (r != NVML_SUCCESS) {
      DT_WARN(WORKER, "NVML does not know GPU %d (PCI %s): %s; its usage stays unknown", i,
              pci_bus_ids[i], nvml_error(u, r));
      u->dev[i] = NULL;
    }
  }
  if (u->lib) {
    watch_xids(u);
    watch_links(u);
  }
  *out = u;
  return 0;
}

/* Whether r says the GPU is gone: fallen off the bus, or needing a reset before any use. */
static int gone(nvmlReturn_t r)
{
  return r == NVML_ERROR_GPU_IS_LOST || r == NVML_ERROR_RESET_REQUIRED;
}

/* The health, slowdown and link queries GPU i supports (others leave *s unknown: -1, 0). */
static void sample_health(dt_gpu_usage_t *u, int i, dt_gpu_sample_t *s)
{
  nvmlDevice_t d = u->dev[i];
  unsigned long long ecc;
  nvmlReturn_t r =
      u->ecc_errors ? u->ecc_errors(d, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, &ecc)
                    : NVML_ERROR_NOT_SUPPORTED;
  if (r == NVML_SUCCESS)
    s->ecc_uncorrected = (int64_t)ecc;
  s->lost |= gone(r);
  unsigned corr, unc, pending, failed;
  r = u->remapped_rows ? u->remapped_rows(d, &corr, &unc, &pending, &failed)
                       : NVML_ERROR_NOT_SUPPORTED;
  if (r == NVML_SUCCESS) {
    s->reset_pending |= pending != 0;
    s->remap_failed = failed != 0;
  }
  s->lost |= gone(r);
  nvmlEnableState_t retired;
  r = u->retired_pending ? u->retired_pending(d, &retired) : NVML_ERROR_NOT_SUPPORTED;
  if (r == NVML_SUCCESS)
    s->reset_pending |= retired == NVML_FEATURE_ENABLED;
  s->lost |= gone(r);
  unsigned long long reasons;
  r = u->clocks_events ? u->clocks_events(d, &reasons) : NVML_ERROR_NOT_SUPPORTED;
  if (r == NVML_SUCCESS)
    s->slowdown = reasons & DT_GPU_SLOWDOWN;
  s->lost |= gone(r);
  for (unsigned l = 0; l < NVML_NVLINK_MAX_LINKS; l++) {
    nvmlEnableState_t on;
    if (!(u->links[i] >> l & 1))
      continue;
    r = u->nvlink_state(d, l, &on);
    if (r == NVML_SUCCESS && on != NVML_FEATURE_ENABLED)
      s->nvlink_down |= 1ull << l;
    s->lost |= gone(r);
  }
  unsigned width, max_width;
  if (u->pcie_width && u->pcie_max_width && u->pcie_width(d, &width) == NVML_SUCCESS &&
      u->pcie_max_width(d, &max_width) == NVML_SUCCESS)
    s->pcie_width = (int)width, s->pcie_max_width = (int)max_width;
}

/* GPU i's link error counters now, into now[] (-1 where NVML does not count them): its PCIe
 * replays; over the NVLinks watched (active at create), replays and recoveries, and CRC errors.
 * A sum some link of which did not answer (down, or the GPU lost) is unknown too: without that
 * link's count it would make the next window's rise look larger. */
static void read_link_errors(const dt_gpu_usage_t *u, int i, int64_t now[LINK_COUNTERS])
{
  static const struct {
    nvmlNvLinkErrorCounter_t counter;
    int slot;
  } k[] = {{NVML_NVLINK_ERROR_DL_REPLAY, NVLINK_REPLAYS},
           {NVML_NVLINK_ERROR_DL_RECOVERY, NVLINK_REPLAYS},
           {NVML_NVLINK_ERROR_DL_CRC_FLIT, NVLINK_CRC},
           {NVML_NVLINK_ERROR_DL_CRC_DATA, NVLINK_CRC}};
  nvmlDevice_t d = u->dev[i];
  for (int c = 0; c < LINK_COUNTERS; c++)
    now[c] = -1;
  unsigned replays;
  if (u->pcie_replays && u->pcie_replays(d, &replays) == NVML_SUCCESS)
    now[PCIE_REPLAYS] = replays;
  int failed[LINK_COUNTERS] = {0};
  for (unsigned l = 0; u->nvlink_errors && l < NVML_NVLINK_MAX_LINKS; l++)
    for (size_t j = 0; u->links[i] >> l & 1 && j < DT_ARRAY_SIZE(k); j++) {
      unsigned long long v;
      if (u->nvlink_errors(d, l, k[j].counter, &v) == NVML_SUCCESS)
        now[k[j].slot] = (now[k[j].slot] > 0 ? now[k[j].slot] : 0) + (int64_t)v;
      else
        failed[k[j].slot] = 1;
    }
  for (int c = 0; c < LINK_COUNTERS; c++)
    if (failed[c])
      now[c] = -1;
}

/* GPU i's link error rates into *s: the counters are read once a window (their queries, one per
 * NVLink and counter, are too many for every heartbeat), and each rate is its counter's rise
 * over the last whole window, a minute's worth (a counter that went back, reset, counts 0). */
static void link_error_rates(dt_gpu_usage_t *u, int i, dt_gpu_sample_t *s)
{
  link_errors_t *e = &u->errors[i];
  const double now = dt_now_ms();
  if (!e->t0_ms || now - e->t0_ms >= (double)dt_param_GpuErrorWindowMs()) {
    int64_t cur[LINK_COUNTERS];
    read_link_errors(u, i, cur);
    for (int k = 0; e->t0_ms && k < LINK_COUNTERS; k++) {
      const int64_t rise = cur[k] > e->base[k] ? cur[k] - e->base[k] : 0;
      e->per_min[k] = cur[k] < 0 || e->base[k] < 0
                          ? -1
                          : (int64_t)((double)rise * 60000.0 / (now - e->t0_ms) + 0.5);
    }
    memcpy(e->base, cur, sizeof cur);
    e->t0_ms = now;
  }
  s->pcie_replays_per_min = e->per_min[PCIE_REPLAYS];
  s->nvlink_replays_per_min = e->per_min[NVLINK_REPLAYS];
  s->nvlink_crc_per_min = e->per_min[NVLINK_CRC];
}

int dt_gpu_usage_sample(dt_gpu_usage_t *u, int i, dt_gpu_sample_t *s)
{
  *s = (dt_gpu_sample_t){.known = 0,
                         .utilization_pct = -1,
                         .ecc_uncorrected = -1,
                         .pcie_replays_per_min = -1,
                         .nvlink_replays_per_min = -1,
                         .nvlink_crc_per_min = -1};
  if (i < 0 || i >= u->n || !u->dev[i])
    return 0;
  take_xids(u);
  s->xid = u->xid[i];
  nvmlMemory_t mem;
  nvmlReturn_t r = u->memory_info(u->dev[i], &mem);
  if (gone(r)) {
    s->lost = 1;
    return 1;
  }
  if (r != NVML_SUCCESS)
    return 0;
  s->known = 1;
  s->used_bytes = mem.used;
  s->total_bytes = mem.total;
  nvmlUtilization_t util;
  if (u->utilization && u->utilization(u->dev[i], &util) == NVML_SUCCESS)
    s->utilization_pct = (int)util.gpu;
  sample_health(u, i, s);
  link_error_rates(u, i, s);
  return 1;
}

void dt_gpu_usage_destroy(dt_gpu_usage_t *u)
{
  if (!u)
    return;
  if (u->lib) {
    if (u->events)
      u->event_free(u->events);
    u->shutdown();
    dlclose(u->lib);
  }
  free(u->dev);
  free(u->xid);
  free(u->links);
  free(u->errors);
  free(u);
}
