#!/usr/bin/env bash
# test_gpu_bundle.sh — tests/gpu/run.sh end to end on a machine without a GPU: bundles BUILD_DIR
# into a temporary directory, runs the bundle, and checks that the run exits 0, that the results
# list every test labelled gpu (as CTest knows them), the flash kernels' compute-sanitizer item,
# the GPU benchmark's two shapes, the attention, sampling and pipeline benchmarks, each as SKIP,
# GPU_FIRST's items first, that GPU_BENCH=only runs just the benchmarks (GPU_FIRST's first),
# that GPU_BUDGET lists what it leaves no time for as NOT RUN, that a failed test runs again
# under compute-sanitizer (a stand-in here, and a test made to fail), and that the bundle holds
# no glibc and no NVIDIA library. Skips (77) where a GPU is present, since the gpu tests would
# run there instead of skipping: use tests/gpu/run.sh directly.
#
#   tests/integration/test_gpu_bundle.sh BUILD_DIR [CTEST]
set -euo pipefail
BUILD=$(cd "${1:?usage: test_gpu_bundle.sh BUILD_DIR [CTEST]}" && pwd)
export CTEST=${2:-ctest}
RUN=$(cd "$(dirname "$0")/../gpu" && pwd)/run.sh
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  echo "a GPU is present: skipping (run $RUN directly)"
  exit 77
fi
T=$(mktemp -d "${TMPDIR:-/tmp}/dt-gpu-bundle-test-XXXXXX")
trap 'rm -rf "$T"' EXIT

FAILS=0
ok() { echo "ok   - $*"; }
bad() {
  echo "FAIL - $*"
  FAILS=$((FAILS + 1))
}

"$RUN" bundle "$BUILD" "$T/bundle.tar.gz" || { bad "bundle failed"; exit 1; }
rc=0
# The runs get one core, so that the pipeline benchmark skips here as on any machine of fewer
# than 4 (it needs no GPU, and would run for minutes on a larger one).
ONE_CORE=(taskset -c "$(python3 -c 'import os; print(min(os.sched_getaffinity(0)))')")
"${ONE_CORE[@]}" "$RUN" run "$T/bundle.tar.gz" "$T/results.txt" >"$T/run.log" 2>&1 || rc=$?
if [ $rc -eq 0 ]; then
  ok "run exits 0"
else
  bad "run exited $rc:"
  cat "$T/run.log"
fi
[ -f "$T/results.txt" ] || { bad "no results file"; exit 1; }

# has_line PREFIX: a line of the results starts with PREFIX (a fixed string).
has_line() { awk -v p="$1" 'index($0, p) == 1 { f = 1 } END { exit !f }' "$T/results.txt"; }

mapfile -t want < <("$CTEST" --test-dir "$BUILD" -N -L gpu | sed -n 's/^ *Test *#[0-9]*: *//p')
for t in "${want[@]}"; do
  if has_line "== $t: SKIP ("; then ok "$t: SKIP"; else bad "$t is not listed as SKIP"; fi
done
for t in bench_gpu_gpt2-124m bench_gpu_gpt2-1.5b bench_attention bench_sample bench_pipeline; do
  if has_line "== $t: SKIP ("; then ok "$t: SKIP"; else bad "$t is not listed as SKIP"; fi
done
# run.sh's own item beside test_cuda: the flash kernels under compute-sanitizer (none here)
extra=0
if printf '%s\n' "${want[@]}" | grep -qx test_cuda; then
  extra=1
  if has_line "== racecheck_flash: SKIP ("; then ok "racecheck_flash: SKIP"; else
    bad "racecheck_flash is not listed as SKIP"
  fi
fi
listed=$(grep -c '^== ' "$T/results.txt" || true)
if [ "$listed" -eq $((${#want[@]} + extra + 5)) ]; then
  ok "results list ${#want[@]} gpu tests, $extra sanitizer item and 5 benchmarks"
else
  bad "results list $listed entries, CTest has ${#want[@]} labelled gpu (+ $extra + 5 benchmarks)"
fi
if has_line "summary: "; then ok "summary line"; else bad "no summary line"; fi
# The default GPU_FIRST's items that the bundle has (a build without CUDA has no gpu test) come
# first, in its order.
first=()
for t in test_cuda test_golden_cuda bench_gpu_gpt2-124m bench_attention; do
  if has_line "== $t: "; then first+=("$t:"); fi
done
order=$(grep '^== ' "$T/results.txt" | head -n ${#first[@]} | cut -d' ' -f2 | paste -sd ' ' -)
if [ "$order" = "${first[*]}" ]; then
  ok "GPU_FIRST's items run first (${first[*]})"
else
  bad "the first ${#first[@]} items are $order, not ${first[*]}"
fi
if has_line "bundle: commit: "; then ok "header names the commit"; else bad "no commit in the header"; fi
GPU_BENCH=only GPU_BENCH_MODELS=tiny "${ONE_CORE[@]}" "$RUN" run "$T/bundle.tar.gz" "$T/bench.txt" \
  >"$T/run.log" 2>&1 ||
  bad "GPU_BENCH=only run failed: $(cat "$T/run.log")"
if [ "$(grep '^== ' "$T/bench.txt" | cut -d' ' -f2-3 | paste -sd,)" = \
  "bench_attention: SKIP,bench_gpu_tiny: SKIP,bench_sample: SKIP,bench_pipeline: SKIP" ]; then
  ok "GPU_BENCH=only runs the benchmark alone"
else
  bad "GPU_BENCH=only ran: $(grep '^== ' "$T/bench.txt")"
fi

rc=0
GPU_BUDGET=1 GPU_BENCH=only GPU_BENCH_MODELS=tiny "${ONE_CORE[@]}" "$RUN" run "$T/bundle.tar.gz" \
  "$T/budget.txt" >"$T/run.log" 2>&1 || rc=$?
if [ $rc -eq 0 ] && [ "$(grep -c '^== bench_[a-z_]*: NOT RUN (budget: ' "$T/budget.txt")" -eq 4 ] &&
  grep -q '^summary: .*; 4 not run within the budget of 1 s' "$T/budget.txt"; then
  ok "GPU_BUDGET lists what it has no time for as NOT RUN"
else
  bad "GPU_BUDGET=1 run (exit $rc): $(grep '^== \|^summary' "$T/budget.txt")"
fi

# A test that fails, added to a copy of the bundle, and a compute-sanitizer that says it ran.
mkdir -p "$T/failing" "$T/bin"
tar -C "$T/failing" -xzf "$T/bundle.tar.gz"
printf 'fails_on_purpose\t-\t20\t@B@\t-\tbash -c "echo boom; exit 3"\n' \
  >>"$T/failing/gpu-bundle/MANIFEST"
tar -C "$T/failing" -czf "$T/failing.tar.gz" gpu-bundle
printf '#!/bin/sh\necho "sanitizer: $*"\nshift 7\nexec "$@"\n' >"$T/bin/compute-sanitizer"
chmod +x "$T/bin/compute-sanitizer"
rc=0
PATH=$T/bin:$PATH GPU_BENCH=0 GPU_TESTS='^fails_on_purpose$' "${ONE_CORE[@]}" "$RUN" run \
  "$T/failing.tar.gz" "$T/failing.txt" >"$T/run.log" 2>&1 || rc=$?
if [ $rc -eq 1 ] && grep -q '^== fails_on_purpose: FAIL (' "$T/failing.txt" &&
  grep -q '^== sanitize_fails_on_purpose: FAIL (' "$T/failing.txt" &&
  grep -q '^sanitizer: --tool memcheck --target-processes all --print-limit 20 bash' \
    "$T/failing.txt"; then
  ok "a failed test runs again under compute-sanitizer"
else
  bad "the failing run (exit $rc): $(grep '^== \|^summary\|^sanitizer' "$T/failing.txt")"
fi

forbidden=$(tar -tzf "$T/bundle.tar.gz" |
  grep -E '/lib(-gcc)?/(libc|libm|libpthread|libdl|ld-linux[^/]*|libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvrtc|libnvidia-[^/]*)\.so' || true)
if [ -z "$forbidden" ]; then ok "no glibc or NVIDIA library bundled"; else bad "bundled: $forbidden"; fi

if [ $FAILS -gt 0 ]; then
  echo "$FAILS checks failed"
  exit 1
fi
echo "all checks passed"
