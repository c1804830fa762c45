#!/usr/bin/env bash
# quickstart.sh — the README's two commands.
#
#   deploy/quickstart.sh demo   install deps, build, train the demo model on the KJV Bible (CPU)
#   deploy/quickstart.sh test   install deps, build, run every test and the quality gates
#
# Both are idempotent and run as root on a fresh Debian bookworm machine (sudo otherwise).
# Environment: BUILD_DIR (default build), JOBS (default nproc), DEMO_STEPS (default 600).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}

build() { # build DIR [cmake args...]
  local dir=$1
  shift
  cmake -S "$ROOT" -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
  cmake --build "$dir" -j "$JOBS"
}

demo() {
  build "$BUILD_DIR"
  local bin="$BUILD_DIR/worker/trainer" work
  work="$(cd "$BUILD_DIR" && pwd)/demo"
  mkdir -p "$work"
  if [ ! -f "$work/data/val.bin" ]; then
    echo "== preparing the King James Bible as byte-level token shards"
    bible -f Gen1:1-Rev22:21 >"$work/kjv.txt"
    "$bin/distrain-prep" --input "$work/kjv.txt" --out "$work/data" --val-fraction 0.05
  fi
  rm -rf "$work/ckpt"
  echo "== training a 4-layer byte-level GPT on $(nproc) CPU cores (local coordinator + agent)"
  "$BUILD_DIR/coordinator/distrainctl" run --local --run-dir "$work/run" \
    --set data.train="$work/data/train_*.bin" --set data.val="$work/data/val.bin" \
    --set checkpoint.dir="$work/ckpt" --set training.steps="${DEMO_STEPS:-600}" \
    --metrics "$work/metrics.jsonl" deploy/jobs/kjv-demo.yaml
  echo "== done: checkpoints in $work/ckpt, per-step metrics in $work/metrics.jsonl, logs in $work/run"
}

tests() {
  echo "== release build + all tests"
  build "$BUILD_DIR"
  (cd "$BUILD_DIR" && ctest --output-on-failure -j 2)
  echo "== clang-format check"
  git ls-files '*.c' '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror
  echo "== ASan/UBSan build without CUDA + unit, numerics and integration tests"
  cmake -S "$ROOT" -B "$BUILD_DIR-asan" -DCMAKE_BUILD_TYPE=Debug -DDT_SANITIZE=ON -DDT_CUDA=OFF \
    >/dev/null
  cmake --build "$BUILD_DIR-asan" -j "$JOBS"
  (cd "$BUILD_DIR-asan" && ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS=suppressions="$ROOT/tests/lsan.supp" ctest --output-on-failure -j 2 -L 'unit|numerics|integration' -LE valgrind)
}

case "${1:-}" in
demo | test)
  deploy/install-deps.sh
  if [ "$1" = demo ]; then demo; else tests; fi
  ;;
*)
  echo "usage: deploy/quickstart.sh demo|test" >&2
  exit 2
  ;;
esac
