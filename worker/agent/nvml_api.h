/* nvml_api.h — the few NVML declarations the agent uses, written out by hand.
 *
 * NVML (libnvidia-ml.so.1) ships with the NVIDIA driver, not with the CUDA toolkit: a CPU
 * machine has neither the library nor nvml.h, and the agent must run there. So the agent
 * dlopens the library at run time (gpu_usage.c) and declares what it calls here, as in nvml.h
 * of CUDA 12.x and 13 (NVML API versions 12 and 13, drivers r525 and later). The memory,
 * utilisation and lookup entry points and structs have kept this form since NVML API version 6;
 * the health queries, the clocks event reasons, the Xid events and the NVLink and PCIe link
 * queries (state, width, error counters) are looked up one by one, and
 * a driver whose NVML lacks one goes without it. Add a declaration only from nvml.h, exactly as
 * it is there. */
#ifndef DT_AGENT_NVML_API_H
#define DT_AGENT_NVML_API_H

typedef int nvmlReturn_t; /* an enum in nvml.h; int-sized */
#define NVML_SUCCESS              0
#define NVML_ERROR_NOT_SUPPORTED  3
#define NVML_ERROR_TIMEOUT        10
#define NVML_ERROR_GPU_IS_LOST    15 /* fallen off the bus or otherwise inaccessible */
#define NVML_ERROR_RESET_REQUIRED 16 /* needs a reset before it can be used again */

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;

#define nvmlEventTypeXidCriticalError 0x0000000000000008LL

typedef struct nvmlEventData_st {
  nvmlDevice_t device;          /* where the event occurred */
  unsigned long long eventType; /* which event */
  unsigned long long eventData; /* an Xid event's Xid (999: unknown) */
  unsigned int gpuInstanceId;   /* MIG: the GPU instance, or 0xFFFFFFFF */
  unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct nvmlMemory_st {
  unsigned long long total; /* bytes */
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_t;

typedef struct nvmlUtilization_st {
  unsigned int gpu;    /* percent of the sample period a kernel was running */
  unsigned int memory; /* percent of it device memory was being read or written */
} nvmlUtilization_t;

typedef enum nvmlEnableState_enum {
  NVML_FEATURE_DISABLED = 0,
  NVML_FEATURE_ENABLED = 1
} nvmlEnableState_t;

typedef enum nvmlMemoryErrorType_enum {
  NVML_MEMORY_ERROR_TYPE_CORRECTED = 0,
  NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1,
  NVML_MEMORY_ERROR_TYPE_COUNT
} nvmlMemoryErrorType_t;

typedef enum nvmlEccCounterType_enum {
  NVML_VOLATILE_ECC = 0,  /* reset each time the driver loads */
  NVML_AGGREGATE_ECC = 1, /* the device's lifetime */
  NVML_ECC_COUNTER_TYPE_COUNT
} nvmlEccCounterType_t;

/* Clocks event reasons (bits of nvmlDeviceGetCurrentClocksEventReasons) that mean trouble: */
#define nvmlClocksThrottleReasonHwSlowdown           0x0000000000000008LL
#define nvmlClocksEventReasonSwThermalSlowdown       0x0000000000000020LL
#define nvmlClocksThrottleReasonHwThermalSlowdown    0x0000000000000040LL
#define nvmlClocksThrottleReasonHwPowerBrakeSlowdown 0x0000000000000080LL

/* The functions, as pointer types for dlsym. */
typedef nvmlReturn_t (*nvmlInit_v2_fn)(void);
typedef nvmlReturn_t (*nvmlShutdown_fn)(void);
typedef const char *(*nvmlErrorString_fn)(nvmlReturn_t result);
typedef nvmlReturn_t (*nvmlDeviceGetHandleByPciBusId_v2_fn)(const char *pciBusId,
                                                            nvmlDevice_t *device);
typedef nvmlReturn_t (*nvmlDeviceGetMemoryInfo_fn)(nvmlDevice_t device, nvmlMemory_t *memory);
typedef nvmlReturn_t (*nvmlDeviceGetUtilizationRates_fn)(nvmlDevice_t device,
                                                         nvmlUtilization_t *utilization);
/* Health: ECC since Fermi, page retirement since Kepler, row remapping since Ampere (and not
 * under MIG with active instances); NVML_ERROR_NOT_SUPPORTED where a GPU lacks one. */
typedef nvmlReturn_t (*nvmlDeviceGetTotalEccErrors_fn)(nvmlDevice_t device,
                                                       nvmlMemoryErrorType_t errorType,
                                                       nvmlEccCounterType_t counterType,
                                                       unsigned long long *eccCounts);
typedef nvmlReturn_t (*nvmlDeviceGetRetiredPagesPendingStatus_fn)(nvmlDevice_t device,
                                                                  nvmlEnableState_t *isPending);
/* Events (Xid errors): a set, the GPUs registered with it, a wait (timeout 0: a poll). */
typedef nvmlReturn_t (*nvmlEventSetCreate_fn)(nvmlEventSet_t *set);
typedef nvmlReturn_t (*nvmlDeviceRegisterEvents_fn)(nvmlDevice_t device,
                                                    unsigned long long eventTypes,
                                                    nvmlEventSet_t set);
typedef nvmlReturn_t (*nvmlEventSetWait_v2_fn)(nvmlEventSet_t set, nvmlEventData_t *data,
                                               unsigned int timeoutms);
typedef nvmlReturn_t (*nvmlEventSetFree_fn)(nvmlEventSet_t set);
/* nvmlDeviceGetCurrentClocksEventReasons (drivers r535 on), or before it under its older name
 * nvmlDeviceGetCurrentClocksThrottleReasons: the same function. */
typedef nvmlReturn_t (*nvmlDeviceGetCurrentClocksEventReasons_fn)(
    nvmlDevice_t device, unsigned long long *clocksEventReasons);
/* Links: NVLink's state per link (Pascal on; NOT_SUPPORTED or INVALID_ARGUMENT for a link the
 * GPU does not have), and the PCIe link's width now and at most (lanes; Fermi on). */
#define NVML_NVLINK_MAX_LINKS 36
typedef nvmlReturn_t (*nvmlDeviceGetNvLinkState_fn)(nvmlDevice_t device, unsigned int link,
                                                    nvmlEnableState_t *isActive);
typedef nvmlReturn_t (*nvmlDeviceGetCurrPcieLinkWidth_fn)(nvmlDevice_t device,
                                                          unsigned int *currLinkWidth);
typedef nvmlReturn_t (*nvmlDeviceGetMaxPcieLinkWidth_fn)(nvmlDevice_t device,
                                                         unsigned int *maxLinkWidth);
/* Link error counters: the PCIe link's replays (Kepler on), and an NVLink's data-link errors
 * (Pascal on). */
typedef enum nvmlNvLinkErrorCounter_enum {
  NVML_NVLINK_ERROR_DL_REPLAY = 0,   /* transmit replays */
  NVML_NVLINK_ERROR_DL_RECOVERY = 1, /* transmit recoveries */
  NVML_NVLINK_ERROR_DL_CRC_FLIT = 2, /* receive flow-control digit CRC errors */
  NVML_NVLINK_ERROR_DL_CRC_DATA = 3, /* receive data CRC errors */
  NVML_NVLINK_ERROR_DL_ECC_DATA = 4,
  NVML_NVLINK_ERROR_COUNT
} nvmlNvLinkErrorCounter_t;
typedef nvmlReturn_t (*nvmlDeviceGetPcieReplayCounter_fn)(nvmlDevice_t device, unsigned int *value);
typedef nvmlReturn_t (*nvmlDeviceGetNvLinkErrorCounter_fn)(nvmlDevice_t device, unsigned int link,
                                                           nvmlNvLinkErrorCounter_t counter,
                                                           unsigned long long *counterValue);
typedef nvmlReturn_t (*nvmlDeviceGetRemappedRows_fn)(nvmlDevice_t device, unsigned int *corrRows,
                                                     unsigned int *uncRows, unsigned int *isPending,
                                                     unsigned int *failureOccurred);

#endif
