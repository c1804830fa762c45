/* gpu_usage.h — the memory in use, the utilisation and the health (lost, uncorrected ECC errors,
 * memory repairs pending or failed, critical Xids, NVLinks gone down) and the links (PCIe width,
 * PCIe and NVLink error rates) of this node's GPUs, through NVML loaded at run time
 * (nvml_api.h says why it is not linked).
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
  /* Health (DeviceUsage's fields of the same names, distrain.proto): */
  int lost;                /* a query said the GPU fell off the bus or needs a reset */
  int64_t ecc_uncorrected; /* uncorrected ECC errors since the driver loaded; -1 unknown */
  int reset_pending;       /* a row remapping or page retirement waits for a reset */
  int remap_failed;        /* a row remapping failed: no spare rows left */
  uint64_t slowdown;       /* NVML's clocks event reasons of trouble (DT_GPU_SLOWDOWN) */
  int xid;                 /* the newest critical Xid since create (dt_gpu_usage_app_xid's
                            * application errors left out); 0: none */
  uint64_t nvlink_down;    /* NVLinks (bit i: link i) active at create, inactive now */
  int pcie_width;          /* the PCIe link's lanes now and at most; 0: unknown */
  int pcie_max_width;
  /* Link errors a minute over the last whole window (DISTRAIN_GPU_ERROR_WINDOW_MS, a minute);
   * -1: unknown (not counted, or no window has passed) */
  int64_t pcie_replays_per_min;
  int64_t nvlink_replays_per_min; /* replays and recoveries over the NVLinks active at create */
  int64_t nvlink_crc_per_min;     /* CRC errors (flow-control digits and data) over them */
} dt_gpu_sample_t;

/* The clocks event reasons that mean trouble with the GPU's cooling or power, kept in
 * dt_gpu_sample_t.slowdown (bits as nvml.h's, DeviceUsage.slowdown's): hardware slowdown (0x8),
 * software thermal (0x20), hardware thermal (0x40), hardware power brake (0x80). Others (idle,
 * application clocks, the software power cap a GPU at its power limit meets) are left out. */
#define DT_GPU_SLOWDOWN 0xe8ull

typedef struct dt_gpu_usage dt_gpu_usage_t;

/* Loads NVML (lib: NULL for the driver's "libnvidia-ml.so.1"; tests pass a stand-in) and looks
 * up the n GPUs (pci_bus_ids[i] as cudaDeviceGetPCIBusId gives it). Warns once when NVML cannot
 * be used. 0, or DT_ENOMEM. */
int dt_gpu_usage_create(dt_gpu_usage_t **out, const char *lib, const char *const *pci_bus_ids,
                        int n);
/* Samples GPU i (0 <= i < n) into *s: its memory use and utilisation, and its health and links
 * where the GPU reports them (its NVLinks: those active at create, each queried). Whether there is
 * anything to report: its memory use is known, or it is lost. Each call first takes the Xid events
 * NVML has for the GPUs (logged as they come): a GPU's newest critical one stays in its samples
 * until create is called again (the agent restarts). */
int dt_gpu_usage_sample(dt_gpu_usage_t *u, int i, dt_gpu_sample_t *s);
/* Whether an Xid is an application's error (13, 31, 43, 45, 68, 109: a graphics engine exception,
 * a GPU memory page fault, ...), after which the GPU is fine, as NVIDIA's Kubernetes device
 * plugin and its Xid catalog judge them; every other Xid NVML reports as critical is the GPU's
 * (ECC, fallen off the bus, NVLink, GSP errors, ...). */
int dt_gpu_usage_app_xid(unsigned long long xid);
/* Xids not to count as a GPU's problem besides an application's (distrain-worker --ignore-xids:
 * an operator's judgement, as NVIDIA's device plugin takes one); logged as they come, not kept.
 * At most DT_GPU_IGNORED_XIDS (more are left out). */
#define DT_GPU_IGNORED_XIDS 32
void dt_gpu_usage_ignore_xids(dt_gpu_usage_t *u, const int *xids, int n);
/* Shuts NVML down and unloads it. NULL is fine. */
void dt_gpu_usage_destroy(dt_gpu_usage_t *u);

#endif
