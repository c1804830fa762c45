#!/usr/bin/env bash
# tests/fuzz/run.sh — a fuzzing campaign: builds the libFuzzer targets of tests/fuzz with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer (in build-fuzz, CUDA off), then runs each
# target for SECONDS on the committed corpus plus what earlier campaigns found
# (build-fuzz/fuzz-work/<target>/corpus). A crash, a sanitizer report or a violated property
# stops the target; its input is saved under build-fuzz/fuzz-work/<target>/ and the run exits 1.
# Fix the bug, then commit the input as tests/fuzz/corpus/<target>/regress-<what>: the
# fuzz_<target> CTest test replays it from then on.
#
#   tests/fuzz/run.sh [SECONDS (default 60)] [TARGET ...]
#     targets: jobspec manifest ckpt data coord tokenizer hf eval
#
# Environment: FUZZ_BUILD (default build-fuzz), FUZZ_JOBS (parallel fuzzing processes per
# target, default 1), FUZZ_VERBOSE=1 (distrain's whole log).
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-60}
[ $# -gt 0 ] && shift
targets=${*:-jobspec manifest ckpt data coord tokenizer hf eval}
build=${FUZZ_BUILD:-build-fuzz}

# The warnings gate is gcc's (CI's builds); clang's own remarks, such as a '#pragma omp simd'
# loop it does not vectorize, are not errors here.
CC=clang CXX=clang++ cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DDT_FUZZ=ON \
  -DDT_SANITIZE=ON -DDT_CUDA=OFF -DDT_WERROR=OFF >/dev/null
# shellcheck disable=SC2046
cmake --build "$build" -j "$(nproc)" --target $(printf 'fuzz_%s ' $targets) >"$build/fuzz-build.log" 2>&1 ||
  { tail -30 "$build/fuzz-build.log"; exit 2; }

failed=0
for t in $targets; do
  work="$build/fuzz-work/$t"
  mkdir -p "$work/corpus"
  echo "== fuzz_$t for ${secs} s"
  jobs=()
  [ "${FUZZ_JOBS:-1}" -gt 1 ] && jobs=(-jobs="$FUZZ_JOBS" -workers="$FUZZ_JOBS")
  if ! "$build/tests/fuzz/fuzz_$t" -max_total_time="$secs" "${jobs[@]}" \
    -print_final_stats=1 -artifact_prefix="$work/" \
    "$work/corpus" "tests/fuzz/corpus/$t" $([ "$t" = jobspec ] && echo deploy/jobs) \
    >"$work/log.txt" 2>&1; then
    failed=1
    echo "fuzz_$t FAILED: $(ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* 2>/dev/null | tr '\n' ' ')"
    grep -E "property violated|ERROR: (Address|Leak|libFuzzer)|runtime error" "$work/log.txt" | head -5
  else
    grep -E "stat::number_of_executed_units|cov:" "$work/log.txt" | tail -2
  fi
done
exit $failed
