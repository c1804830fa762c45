/* devices.h — which device a trainer computes on, and opening it.
 *
 * "cpu": host memory and the OpenBLAS kernels. "cuda": among the GPUs CUDA_VISIBLE_DEVICES
 * leaves visible, the one DISTRAIN_CUDA_DEVICE numbers (set by the agent, which offers a GPU per
 * device), else the one LOCAL_RANK selects as torchrun's does (modulo their count: several
 * trainers may share one GPU on the host-staged communicator). "auto" (the default): cuda
 * when this build has CUDA and a GPU is present, else cpu. "cpu-remote": the CPU kernels on
 * memory the host must not touch (kernels/device.h), for tests of the GPU code paths. */
#ifndef DT_TRAINER_DEVICES_H
#define DT_TRAINER_DEVICES_H

#include <stddef.h>
#include <stdint.h>

#include "device.h"

/* Opens the device `want` names (NULL: "auto"); DT_EINVAL for an unknown name, DT_ENOTSUP
 * when cuda was asked for and this build or machine cannot give it, each with a log line
 * that says why. */
int dt_train_device_open(const char *want, dt_device_t **out);
/* Whether this process can hand dev's memory to the device's own comm backend (dev->comm_backend,
 * "nccl") instead of staging it through the host: a GPU device and a build with that backend.
 * 1 with *gpu_id set, or 0 with why filled. gpu_id names the GPU across the job (a hash of the
 * host name and the GPU's PCI address, whatever CUDA_VISIBLE_DEVICES calls it): ranks with
 * equal ids share one GPU, which NCCL refuses, so the caller compares them. */
int dt_train_device_comm_able(const dt_device_t *dev, uint64_t *gpu_id, char *why, size_t len);
/* The dense bf16 tensor-core peak of the GPU named name ("NVIDIA H100 80GB HBM3"), in FLOP/s,
 * from NVIDIA's data sheets (A100, H100 SXM / PCIe / NVL, H200, GH200); 0 for other names. */
double dt_gpu_peak_bf16_flops(const char *name);
/* The same for dev's GPU, and the GPU's name into name (n bytes); 0 (and "") for a CPU. */
double dt_train_device_peak_bf16_flops(const dt_device_t *dev, char *name, size_t n);
/* Releases what open acquired (a GPU's stream and handles); NULL is fine. */
void dt_train_device_close(dt_device_t *dev);

#endif
