#!/bin/sh
# The tensor-core flash-attention kernels' shared-memory pipelines (kernels/cuda/flash_mma.cuh
# and, on a GPU of compute capability 9.0, flash_wgmma.cuh: tiles copied by cp.async, waits
# and barriers) under compute-sanitizer's racecheck and synccheck, through test_cuda's flash
# case alone (CK_RUN_CASE=flash: every head-size bucket, context-parallel chunks, and the
# wgmma kernels' test), one kernel family instrumented a run (fwg_, then fmma_: the rest, such
# as the fp32 case of 65,600 heads, run at full speed). The emulation of
# tests/emul/cuda_emul.h checks the same pipeline off the GPU, but not the hardware's memory
# ordering. Run by tests/gpu/run.sh as the item racecheck_flash. Exit 77 (skipped) where the
# machine has no compute-sanitizer, or test_cuda no GPU.
set -eu
test_cuda=$1
if [ ! -x "$test_cuda" ]; then
  echo "sanitize_flash: no $test_cuda (a build without CUDA)"
  exit 77
fi
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
  /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n 1) || true
if [ -z "$san" ]; then
  echo "sanitize_flash: no compute-sanitizer here"
  exit 77
fi
for kernels in fwg_ fmma_; do
  for tool in racecheck synccheck; do
    echo "== compute-sanitizer --tool $tool, kernels $kernels*"
    CK_RUN_CASE=flash "$san" --tool "$tool" --kernel-name "kns=$kernels" --error-exitcode 1 \
      "$test_cuda"
  done
done
