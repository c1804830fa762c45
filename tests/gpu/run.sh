#!/usr/bin/env bash
# run.sh — carries the GPU tests from the CPU-only build machine to a bare GPU machine and runs
# them there, writing every result into one file.
#
#   tests/gpu/run.sh bundle [BUILD_DIR] [OUT]     on the build machine
#       BUILD_DIR defaults to build, OUT to BUILD_DIR/gpu-bundle.tar.gz. Packs every CTest
#       labelled gpu (found with ctest, never listed here), the trainer and daemon binaries,
#       tests/ (scripts, golden files) and the shared libraries all of them link into one
#       .tar.gz of at most 60 MiB, with a manifest of the tests and the build's identity.
#   tests/gpu/run.sh run [BUNDLE] [RESULTS]       on the GPU machine
#       BUNDLE defaults to build/gpu-bundle.tar.gz, RESULTS to ${OUT:-.}/gpu-results.txt.
#       Unpacks into a temporary directory, points the loader at the bundled libraries and at the
#       target's CUDA ones, reports how every library resolves, runs each test with a timeout and
#       writes PASS/FAIL/SKIP, wall times and output tails to RESULTS. Exits 1 if a test failed.
#
# Invariants of a bundle:
#   - It never holds glibc (libc, libm, ld-linux, ...; they must match the target's loader) nor an
#     NVIDIA library (driver, cudart, cuBLAS, NCCL, ...; they must match the target's driver).
#   - Everything else the binaries link is in it: our Debian libraries (gRPC, OpenBLAS, Gloo,
#     ...) in lib/, always used; the GCC runtime (libstdc++, libgcc_s, libgomp, ...) in lib-gcc/,
#     used only where the target's own copy lacks a symbol version we need, because a process
#     that also loads PyTorch must not get an older libstdc++ than the one it was built for.
#   - The run step reads only the bundle, never the CTest files, which hold this machine's
#     absolute paths. gpu-bundle/ holds MANIFEST (one test a line, tab-separated: name, skip
#     code or -, timeout or 0, working directory, environment or -, command; the last three as
#     shell words whose paths start with @B@, the unpacked bundle), INFO (commit, build type,
#     nvcc), NEEDS (file, soname, symbol version), ELFS (the binaries), lib/, lib-gcc/, build/
#     (binaries at their build-tree paths) and src/ (tests/ and any source path a test names).
#
# Environment of the bundle step: CTEST (the ctest to ask, default ctest on PATH).
# Environment of the run step: GPU_TESTS (a regular expression: run only the tests whose name
# matches), GPU_TEST_TIMEOUT (seconds for a test without a CTest TIMEOUT, default 300),
# GPU_BENCH (1, the default: the tests, then tests/bench/bench_gpu.py for each of
# GPU_BENCH_MODELS, default "gpt2-124m gpt2-1.5b" (the 1.5B against PyTorch eager only: on an
# H200 torch.compile took more than 240 s to compile it; distrain both as it is and with
# DISTRAIN_CUDA_GEMM_TUNE=1), each within GPU_BENCH_TIMEOUT seconds, default 420, its profiled
# steps' Chrome traces beside RESULTS (bench_gpu_<model>.trace.json, -tuned.trace.json);
# 0: the tests only; only: the benchmark only; the benchmark also runs
# tests/bench/bench_attention.py, the flash attention kernels alone against PyTorch's SDPA,
# within 180 s (and, where ncu is installed, their Nsight Compute report beside RESULTS:
# ncu_attention.txt), and tests/bench/bench_pipeline.py for p = 4 stages on the machine's CPU
# cores (p = 2 needs only the 2 cores of the machines that build), skipped where fewer than 4,
# a row whose stages are more than 3% apart run twice (--repeat 2), within GPU_BENCH_TIMEOUT,
# and tests/bench/bench_sample.py, GPT-2 124M's text generation in bf16 through the key/value
# cache against whole windows, within 120 s),
# GPU_BUDGET (seconds for the whole run, 0 or unset: none; with it no item starts once fewer
# than GPU_MIN_LEFT seconds, default 30, are left, each is listed NOT RUN instead, and an item's
# timeout is cut to what is left), GPU_FIRST (the names run first, in this order, before the
# rest in their usual order; default "test_cuda test_golden_cuda bench_gpu_gpt2-124m
# bench_attention": the kernels against the CPU's, the trainer against the golden files, the
# headline benchmark, the attention's share of it),
# racecheck_flash follows the bundle's tests where it has test_cuda: the tensor-core flash
# kernels' shared memory (mma.sync and wgmma) under compute-sanitizer's racecheck and synccheck
# within 240 s
# (tests/gpu/sanitize_flash.sh),
# GPU_SANITIZE (1, the default: each failed test again under compute-sanitizer's memcheck, where
# the machine has it and 60 s of the budget are left; 0: not),
# GPU_LIB_DIRS (colon-separated directories searched before the detected CUDA ones). Tests see
# DT_SOURCE_DIR and DT_BINARY_DIR pointing at the bundle's copies of the two trees.
# bench_pipeline (CPU only) runs last, alone: beside the GPU items, on 4 cores of its own, its
# stages' times on an H200 machine's 16 vCPUs moved by 30-490%.
set -euo pipefail

PROG=tests/gpu/run.sh
MAX_BYTES=$((60 * 1024 * 1024))
TAIL_LINES=200
# Binaries bundled besides the tests (when built), relative to the build directory: what a GPU
# test that trains or starts daemons runs.
EXTRA_BINS=(worker/trainer/distrain-train worker/trainer/distrain-prep tests/bench/bench_attention
  worker/agent/distrain-worker coordinator/distrain-coordinator coordinator/distrainctl)
# Sonames never bundled: glibc and the loader, and the NVIDIA/CUDA libraries.
GLIBC_RE='^(linux-vdso|linux-gate|ld-linux[^ ]*|libc|libm|libmvec|libpthread|libdl|librt|libutil|libresolv|libnsl|libanl|libBrokenLocale|libthread_db|libnss_[a-z]+)\.so'
NVIDIA_RE='^lib(cuda|cudart|cublas|cublasLt|cufft|cufftw|curand|cusolver|cusparse|cusparseLt|cudnn[a-z_]*|cupti|nccl|nvrtc|nvrtc-builtins|nvJitLink|nvToolsExt|nvblas|nvidia-[a-z0-9_-]+)\.so'
# The GCC runtime: bundled, but the target's copy wins when it is new enough.
GCCRT_RE='^lib(stdc\+\+|gcc_s|gomp|gfortran|quadmath|atomic|itm|asan|ubsan|lsan|tsan)\.so'

usage() {
  cat >&2 <<EOF
usage: $PROG bundle [BUILD_DIR=build] [OUT=BUILD_DIR/gpu-bundle.tar.gz]
       $PROG run [BUNDLE=build/gpu-bundle.tar.gz] [RESULTS=\${OUT:-.}/gpu-results.txt]
EOF
  exit 2
}
die() {
  echo "$PROG: $*" >&2
  exit 1
}
is_elf() { readelf -h "$1" >/dev/null 2>&1; }

# ---------------------------------------------------------------------------------------------
# bundle
# ---------------------------------------------------------------------------------------------

# cache_get BUILD KEY: a value from BUILD/CMakeCache.txt (empty when absent).
cache_get() { sed -n "s/^$2:[A-Z]*=//p" "$1/CMakeCache.txt" | head -n 1; }

# write_manifest JSON SRC BUILD MANIFEST COPIES: turns CTest's json-v1 test list into MANIFEST
# (name, skip code, timeout, working directory, environment, command; tab-separated, the last
# three as shell words with this machine's build and source paths rewritten to @B@/build and
# @B@/src) and lists in COPIES the files and directories the commands name ("build|src REL").
write_manifest() {
  python3 - "$@" <<'EOF'
import json, os, re, shlex, sys

ctest_json, src, build, manifest, copies_path = sys.argv[1:6]
roots = [(os.path.normpath(build), "build"), (os.path.normpath(src), "src")]  # build may sit in src
copies = set()

def map_path(p, copy=True):
    p = os.path.normpath(p)
    for root, tag in roots:
        if p == root or p.startswith(root + "/"):
            rel = p[len(root) + 1:]
            if copy and rel and os.path.exists(p):
                copies.add(f"{tag}|{rel}")
            return f"@B@/{tag}" + (f"/{rel}" if rel else "")
    return None

def map_word(w):  # "/path" or "KEY=/path"; anything else is kept
    if w.startswith("/") and map_path(w):
        return map_path(w)
    key, eq, val = w.partition("=")
    if eq and val.startswith("/") and map_path(val):
        return key + "=" + map_path(val)
    return w

def words(ws):
    for w in ws:
        if "\t" in w or "\n" in w:
            sys.exit(f"a test argument holds a tab or newline: {w!r}")
    return " ".join(shlex.quote(w) for w in ws)

lines = []
for t in json.load(open(ctest_json))["tests"]:
    name = t["name"]
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        sys.exit(f"test name {name!r} is not a plain file name")
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    if props.get("DISABLED"):
        continue
    if "command" not in t:
        sys.exit(f"test {name} has no command (its executable was not built?)")
    cmd = [map_word(w) for w in t["command"]]
    if re.fullmatch(r"/\S*/python3(\.\d+)?", t["command"][0]):
        cmd[0] = "python3"  # the target's python3 on PATH: the one with PyTorch
    wd = map_path(props.get("WORKING_DIRECTORY", build), copy=False) or "@B@"
    env = [map_word(e) for e in props.get("ENVIRONMENT", [])]
    skip = str(props.get("SKIP_RETURN_CODE", "-"))
    timeout = str(int(float(props.get("TIMEOUT", 0))))
    lines.append("\t".join([name, skip, timeout, shlex.quote(wd), words(env) or "-", words(cmd)]))

with open(manifest, "w") as f:
    f.write("".join(l + "\n" for l in lines))
with open(copies_path, "w") as f:
    f.write("".join(c + "\n" for c in sorted(copies)))
EOF
}

# copy_tree_path FROM_ROOT REL TO_ROOT: copies FROM_ROOT/REL (file or directory) to TO_ROOT/REL.
copy_tree_path() {
  mkdir -p "$(dirname "$3/$2")"
  cp -a "$1/$2" "$3/$2"
}

# copy_sources SRC STAGE: tests/ of the source tree (scripts, golden files; tracked and untracked
# files, not ignored ones) into STAGE/src/tests.
copy_sources() {
  local src=$1 stage=$2 f
  if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$src" ls-files -co --exclude-standard -z -- tests | while IFS= read -r -d '' f; do
      if [ -f "$src/$f" ]; then copy_tree_path "$src" "$f" "$stage/src"; fi
    done
  else
    copy_tree_path "$src" tests "$stage/src"
  fi
}

# bundle_libs STAGE ELF...: copies the shared libraries the ELF files load (ldd: the whole
# closure) into STAGE/lib or STAGE/lib-gcc, under their sonames, skipping glibc and NVIDIA.
bundle_libs() {
  local stage=$1 elf soname arrow path rest
  shift
  for elf in "$@"; do
    while read -r soname arrow path rest; do
      [ "$arrow" = "=>" ] || continue # the loader and the vDSO: "NAME (0x...)"
      [[ $soname =~ $GLIBC_RE || $soname =~ $NVIDIA_RE ]] && continue
      if [ "$path" = not ]; then
        die "${elf#"$stage"/}: $soname not found on this machine (ldd); cannot bundle it"
      fi
      local dir=lib
      [[ $soname =~ $GCCRT_RE ]] && dir=lib-gcc
      [ -e "$stage/$dir/$soname" ] || cp -L "$path" "$stage/$dir/$soname"
    done < <(ldd "$elf" 2>/dev/null || true)
  done
}

# drop_rpaths FILE...: LD_LIBRARY_PATH does not override a DT_RPATH (only a DT_RUNPATH), so a
# bundled file with one could load a target library of the same name instead of ours. Removed
# with patchelf when installed; otherwise a warning, since this machine's directories rarely
# exist on the target.
drop_rpaths() {
  local f rpath
  for f in "$@"; do
    rpath=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(RPATH).*\[\(.*\)\]/\1/p')
    [ -n "$rpath" ] || continue
    if command -v patchelf >/dev/null; then
      patchelf --remove-rpath "$f"
    else
      echo "$PROG: warning: ${f##*/} has DT_RPATH $rpath, which wins over LD_LIBRARY_PATH;" \
        "install patchelf to strip it" >&2
    fi
  done
}

# write_needs STAGE ELF...: STAGE/NEEDS, "file soname version" for every symbol version an ELF
# file needs (readelf's version-needs section; file relative to the bundle), which the run step
# checks against the target's libraries.
write_needs() {
  local stage=$1 f
  shift
  for f in "$@"; do
    readelf -V --wide "$f" 2>/dev/null | awk -v f="${f#"$stage"/}" '
      /^Version needs section/ { on = 1; next }
      /^Version (definition|symbols) section/ { on = 0 }
      on && /File:/ { for (i = 1; i < NF; i++) if ($i == "File:") lib = $(i + 1) }
      on && /Name:/ { for (i = 1; i < NF; i++) if ($i == "Name:") print f, lib, $(i + 1) }'
  done | sort -u >"$stage/NEEDS"
}

# write_info SRC BUILD STAGE: the build's identity, shown in the results header.
write_info() {
  local src=$1 build=$2 stage=$3 commit=unknown dirty="" nvcc archs
  if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
    commit=$(git -C "$src" rev-parse HEAD)
    git -C "$src" diff --quiet HEAD -- 2>/dev/null || dirty=" (dirty: uncommitted changes)"
  fi
  nvcc=$(cache_get "$build" CMAKE_CUDA_COMPILER)
  if [ -n "$nvcc" ] && [ -x "$nvcc" ]; then
    nvcc=$("$nvcc" --version | sed -n 's/.*release \(.*\)$/\1/p')
  else
    nvcc="none (CUDA off)"
  fi
  # The CUDA code generated, from the compile flags of the targets built with nvcc.
  archs=$(find "$build" -name flags.make -not -path '*/CMakeFiles/[0-9]*' -not -path '*/CheckCUDA/*' \
    -exec grep -ho -- '--generate-code=arch=[^ ]*' {} + 2>/dev/null |
    sed 's/--generate-code=//' | sort -u | paste -sd ' ' -) || true
  {
    echo "commit: $commit$dirty"
    echo "build type: $(cache_get "$build" CMAKE_BUILD_TYPE)"
    echo "nvcc: $nvcc"
    echo "cuda code: ${archs:-unknown}"
    echo "built on: $(hostname), $(getconf GNU_LIBC_VERSION 2>/dev/null || echo 'glibc ?')"
    echo "bundled: $(date -u '+%Y-%m-%d %H:%M:%S UTC') from $(cd "$build" && pwd)"
  } >"$stage/INFO"
}

cmd_bundle() {
  [ $# -le 2 ] || usage
  local build=${1:-build}
  [ -f "$build/CMakeCache.txt" ] || die "$build is not a CMake build directory (no CMakeCache.txt)"
  local out=${2:-$build/gpu-bundle.tar.gz}
  local src cbuild
  src=$(cache_get "$build" CMAKE_HOME_DIRECTORY)
  cbuild=$(cache_get "$build" CMAKE_CACHEFILE_DIR) # the spelling CTest's files use
  [ -d "$src" ] || die "source directory $src (from $build/CMakeCache.txt) does not exist"
  local ctest=${CTEST:-ctest}
  command -v "$ctest" >/dev/null || die "$ctest not found (set CTEST to CMake's ctest)"

  local tmp stage
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/dt-gpu-bundle-XXXXXX")
  # shellcheck disable=SC2064 # expand now: tmp is local
  trap "rm -rf '$tmp'" EXIT
  stage=$tmp/gpu-bundle
  mkdir -p "$stage/lib" "$stage/lib-gcc" "$stage/build" "$stage/src"

  # The tests: every one labelled gpu, with what its command line names.
  "$ctest" --test-dir "$build" --show-only=json-v1 -L gpu >"$tmp/ctest.json" ||
    die "$ctest --test-dir $build --show-only=json-v1 -L gpu failed"
  write_manifest "$tmp/ctest.json" "$src" "$cbuild" "$stage/MANIFEST" "$tmp/copies" ||
    die "cannot read the gpu tests of $build"
  [ -s "$stage/MANIFEST" ] || echo "$PROG: warning: $build has no test labelled gpu (CUDA off?)" >&2
  copy_sources "$src" "$stage"
  local tag rel
  while IFS='|' read -r tag rel; do
    if [ "$tag" = build ]; then
      copy_tree_path "$cbuild" "$rel" "$stage/build"
    elif [ ! -e "$stage/src/$rel" ]; then
      copy_tree_path "$src" "$rel" "$stage/src"
    fi
  done <"$tmp/copies"
  for rel in "${EXTRA_BINS[@]}"; do
    if [ -x "$build/$rel" ] && [ ! -e "$stage/build/$rel" ]; then
      copy_tree_path "$build" "$rel" "$stage/build"
    fi
  done

  # Their libraries, and the symbol versions everything needs.
  local elfs=() f
  while IFS= read -r -d '' f; do
    if is_elf "$f"; then elfs+=("$f"); fi
  done < <(find "$stage/build" "$stage/src" -type f -perm -u+x -print0 | sort -z)
  [ ${#elfs[@]} -gt 0 ] || die "nothing to bundle: no gpu test and no trainer binary in $build"
  printf '%s\n' "${elfs[@]#"$stage"/}" >"$stage/ELFS"
  bundle_libs "$stage" "${elfs[@]}"
  local libs
  shopt -s nullglob
  libs=("$stage"/lib/* "$stage"/lib-gcc/*)
  shopt -u nullglob
  drop_rpaths "${elfs[@]}" "${libs[@]}"
  write_needs "$stage" "${elfs[@]}" "${libs[@]}"
  write_info "$src" "$build" "$stage"

  mkdir -p "$(dirname "$out")"
  tar -C "$tmp" --owner=0 --group=0 --numeric-owner -czf "$out.tmp" gpu-bundle
  mv "$out.tmp" "$out"
  local size
  size=$(stat -c %s "$out")
  echo "$PROG: $out: $(awk -v b="$size" 'BEGIN { printf "%.1f MiB", b / 1048576 }'):" \
    "$(wc -l <"$stage/MANIFEST") gpu tests, ${#elfs[@]} binaries, ${#libs[@]} libraries"
  sed 's/^/  /' "$stage/INFO"
  if [ "$size" -gt "$MAX_BYTES" ]; then
    rm -f "$out"
    echo "$PROG: the bundle is over 60 MiB (the most a GPU machine is sent); largest parts:" >&2
    (cd "$stage" && du -ab . | sort -n | tail -n 8) >&2
    exit 1
  fi
}

# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------

# cuda_lib_dirs: the target's CUDA runtime, cuBLAS and NCCL directories, one a line: GPU_LIB_DIRS,
# then the pip wheels' nvidia/*/lib (what PyTorch loads, so that one process gets one copy),
# then the toolkit's. The driver's libcuda comes from the loader's default paths.
cuda_lib_dirs() {
  local d
  if [ -n "${GPU_LIB_DIRS:-}" ]; then tr ':' '\n' <<<"$GPU_LIB_DIRS"; fi
  python3 - 2>/dev/null <<'EOF' || true
import os
import nvidia  # namespace package of the nvidia-* wheels
for p in nvidia.__path__:
    for d in sorted(os.listdir(p)):
        if os.path.isdir(os.path.join(p, d, "lib")):
            print(os.path.join(p, d, "lib"))
EOF
  for d in /usr/local/cuda /usr/local/cuda-*; do
    [ -d "$d" ] || continue
    printf '%s\n' "$d/lib64" "$d/targets/x86_64-linux/lib" "$d/lib"
    if [ "$d" = /usr/local/cuda ]; then break; fi # the default toolkit; versioned ones only without it
  done
}

# ldconfig_lib SONAME: where the target's loader cache puts SONAME (x86-64), or nothing.
ldconfig_lib() { awk -v s="$1" '$1 == s && /x86-64/ { print $NF; exit }' "$WORK/ldconfig"; }

# missing_versions LIB SONAME NEEDS: the versions that NEEDS (a file in NEEDS' format) asks of
# SONAME and LIB does not define. Without relying on binutils there: version names are
# NUL-terminated strings in LIB's string table, which shares tails (OMP_1.0 is the end of
# GOMP_1.0), so a version is defined when some string ends with it.
missing_versions() {
  awk -v s="$2" '$2 == s { print $3 }' "$3" | sort -u >"$WORK/want"
  tr '\0' '\n' <"$1" | { LC_ALL=C grep -a '_[0-9]' || true; } | LC_ALL=C awk '
    NR == FNR { want[$0]; next }
    { for (v in want) if (substr($0, length($0) - length(v) + 1) == v) delete want[v] }
    END { for (v in want) print v }' "$WORK/want" - | sort | paste -sd ' ' -
}

# choose_libs: decides, for each GCC runtime library, between the target's copy and ours (linked
# into lib/), and checks that the target's glibc defines what the files in use need. Writes its
# notes to $WORK/libnotes.
choose_libs() {
  local f soname sys miss
  : >"$WORK/libnotes"
  for f in "$B"/lib-gcc/*; do
    [ -e "$f" ] || continue
    soname=${f##*/}
    sys=$(ldconfig_lib "$soname")
    miss=""
    [ -z "$sys" ] || miss=$(missing_versions "$sys" "$soname" "$B/NEEDS")
    if [ -n "$sys" ] && [ -z "$miss" ]; then
      echo "$soname: the target's $sys" >>"$WORK/libnotes"
    else
      ln -s "../lib-gcc/$soname" "$B/lib/$soname"
      echo "$soname: bundled (target's: ${sys:-none}${miss:+, lacks $miss})" >>"$WORK/libnotes"
    fi
  done
  # The files in use: the binaries, lib/ and the GCC runtime libraries linked into it.
  { cat "$B/ELFS"; (cd "$B" && find lib -type f && find lib -type l -printf 'lib-gcc/%f\n'); } |
    awk 'NR == FNR { use[$1]; next } $1 in use' - "$B/NEEDS" >"$WORK/needs"
  awk '{ print $2 }' "$WORK/needs" | sort -u | while read -r soname; do
    [[ $soname =~ $GLIBC_RE ]] || continue
    sys=$(ldconfig_lib "$soname")
    [ -n "$sys" ] || continue
    miss=$(missing_versions "$sys" "$soname" "$WORK/needs")
    [ -z "$miss" ] || echo "!! $soname: the target's $sys lacks $miss (the bundle's build" \
      "machine: $(sed -n 's/^built on: .*, //p' "$B/INFO")): binaries will not load" >>"$WORK/libnotes"
  done
}

# report_libs: ldd of every bundled binary under the final LD_LIBRARY_PATH; writes the libraries
# that resolve outside the bundle, and every one not found, to $WORK/ldd.
report_libs() {
  local elf line
  if ! command -v ldd >/dev/null; then
    echo "(ldd not installed: library resolution not checked)" >"$WORK/ldd"
    return
  fi
  : >"$WORK/ldd.all"
  while IFS= read -r elf; do
    ldd "$B/$elf" 2>&1 | while IFS= read -r line; do
      case "$line" in
      *"not found"*) echo "!! NOT FOUND: $elf: ${line#"${line%%[![:space:]]*}"}" ;;
      *" => $B/"*) echo "bundle ${line%% =>*}" ;;
      *" => /"*) echo "$line" | sed 's/^[[:space:]]*//; s/ (0x[0-9a-f]*)$//' ;;
      esac
    done >>"$WORK/ldd.all"
  done <"$B/ELFS"
  {
    grep '^!!' "$WORK/ldd.all" || true
    grep -v '^!!\|^bundle ' "$WORK/ldd.all" | sort -u || true
    echo "$(awk '/^bundle / { n[$2] } END { print length(n) }' "$WORK/ldd.all") more from the bundle"
  } >"$WORK/ldd"
}

# gpu_line: one line naming the GPUs and the driver, from nvidia-smi.
gpu_line() {
  if ! command -v nvidia-smi >/dev/null; then
    echo "none (nvidia-smi not found)"
  elif ! nvidia-smi -L >/dev/null 2>&1; then
    echo "none (nvidia-smi -L failed)"
  else
    nvidia-smi --query-gpu=index,name,driver_version,compute_cap,memory.total \
      --format=csv,noheader 2>/dev/null | sed 's/^/[/; s/, /] /; s/$/;/' | tr '\n' ' ' ||
      nvidia-smi -L | tr '\n' ' '
  fi
}

# now_ms: wall clock in milliseconds.
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# run_test NAME SKIP LIMIT WD ENVS CMD: runs one manifest entry and appends its result to
# RESULTS; sets STATUS. CAP (seconds, when positive) cuts LIMIT.
run_test() {
  local name=$1 skip=$2 limit=$3 wd=$4 envs=$5 cmd=$6 argv envv rc=0 t0 ms note=""
  # The manifest is ours (write_manifest quotes every word): eval only splits the words.
  eval "argv=($cmd)"
  eval "wd=$wd"
  envv=()
  [ "$envs" = - ] || eval "envv=($envs)"
  argv=("${argv[@]//@B@/$B}")
  [ ${#envv[@]} -eq 0 ] || envv=("${envv[@]//@B@/$B}")
  wd=${wd//@B@/$B}
  [ "$limit" -gt 0 ] || limit=${GPU_TEST_TIMEOUT:-300}
  [ "${CAP:-0}" -le 0 ] || [ "$limit" -le "$CAP" ] || limit=$CAP
  mkdir -p "$wd"
  local log=$WORK/logs/$name.log
  t0=$(now_ms)
  (cd "$wd" && exec env ${envv[@]+"${envv[@]}"} timeout -k 10 "$limit" \
    "${argv[@]}") \
    </dev/null >"$log" 2>&1 || rc=$?
  ms=$(($(now_ms) - t0))
  if [ $rc -eq 0 ]; then
    STATUS=PASS
  elif [ "$skip" != - ] && [ $rc -eq "$skip" ]; then
    STATUS=SKIP
  else
    STATUS=FAIL
    [ $rc -ne 124 ] && [ $rc -ne 137 ] || note=", timed out after ${limit} s"
    [ $rc -ne 127 ] || note=", command or library not found"
  fi
  local line shown
  printf -v shown '%q ' ${envv[@]+"${envv[@]}"} "${argv[@]}"
  line=$(printf '%s: %s (%d.%d s, exit %d%s)' "$name" "$STATUS" $((ms / 1000)) $((ms % 1000 / 100)) "$rc" "$note")
  echo "$line"
  [ "$STATUS" != FAIL ] || tail -n 30 "$log" | sed 's/^/    /'
  {
    echo
    echo "== $line"
    echo "   \$ (cd ${wd//"$B"/BUNDLE} && ${shown//"$B"/BUNDLE})"
    echo "-- last $TAIL_LINES lines of output ($(wc -l <"$log") in all):"
    tail -n "$TAIL_LINES" "$log"
  } >>"$RESULTS"
}

cmd_run() {
  [ $# -le 2 ] || usage
  local bundle=${1:-build/gpu-bundle.tar.gz}
  RESULTS=${2:-${OUT:-.}/gpu-results.txt}
  [ -f "$bundle" ] || die "no bundle at $bundle (make one on the build machine: $PROG bundle)"
  for tool in tar timeout python3; do
    command -v "$tool" >/dev/null || die "$tool not found on this machine"
  done
  mkdir -p "$(dirname "$RESULTS")"
  RESULTS=$(cd "$(dirname "$RESULTS")" && pwd)/$(basename "$RESULTS")
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/dt-gpu-run-XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  tar -C "$WORK" -xzf "$bundle" || die "cannot unpack $bundle"
  B=$WORK/gpu-bundle
  for f in MANIFEST INFO NEEDS ELFS; do
    [ -f "$B/$f" ] || die "$bundle is not a GPU test bundle (no gpu-bundle/$f)"
  done
  mkdir -p "$WORK/logs"

  # The loader: our libraries, then the target's CUDA ones.
  local ldconfig=ldconfig
  command -v ldconfig >/dev/null || ldconfig=/sbin/ldconfig
  "$ldconfig" -p >"$WORK/ldconfig" 2>/dev/null || : >"$WORK/ldconfig"
  choose_libs
  local path=$B/lib d
  while IFS= read -r d; do
    if [ -d "$d" ] && [[ ":$path:" != *":$d:"* ]]; then path=$path:$d; fi
  done < <(cuda_lib_dirs)
  export DT_ORIG_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} # for PyTorch in the benchmark
  export LD_LIBRARY_PATH=$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export DT_SOURCE_DIR=$B/src DT_BINARY_DIR=$B/build
  report_libs

  echo "== nvidia-smi"
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi 2>&1; then
    echo "(nvidia-smi not available or failing: no GPU or no driver here)"
  fi
  echo "== libraries (LD_LIBRARY_PATH=${LD_LIBRARY_PATH//"$B"/BUNDLE})"
  cat "$WORK/libnotes" "$WORK/ldd"
  if grep -q '^!!' "$WORK/libnotes" "$WORK/ldd"; then
    echo "!! SOME LIBRARIES DO NOT RESOLVE OR ARE TOO OLD: the tests that need them will fail" >&2
  fi

  {
    echo "distrain GPU test results"
    echo "date:   $(date '+%Y-%m-%d %H:%M:%S %Z')"
    echo "host:   $(hostname), $(getconf GNU_LIBC_VERSION 2>/dev/null || echo 'glibc ?')"
    echo "gpu:    $(gpu_line)"
    sed 's/^/bundle: /' "$B/INFO"
    echo "libraries (LD_LIBRARY_PATH=${LD_LIBRARY_PATH//"$B"/BUNDLE}):"
    cat "$WORK/libnotes" "$WORK/ldd" | sed 's/^/  /'
  } >"$RESULTS"

  # The items: the gpu tests, then the benchmarks, in MANIFEST's format; GPU_FIRST's first.
  local resdir model impls
  resdir=$(dirname "$RESULTS")
  {
    if [ "${GPU_BENCH:-1}" != only ]; then
      {
        cat "$B/MANIFEST"
        if grep -q '^test_cuda'$'\t' "$B/MANIFEST"; then
          printf '%s\t77\t240\t@B@/build/tests/unit\t-\t%s\n' racecheck_flash \
            "sh @B@/src/tests/gpu/sanitize_flash.sh @B@/build/tests/unit/test_cuda"
        fi
      } | awk -F '\t' -v re="${GPU_TESTS:-}" 're == "" || $1 ~ re'
    fi
    if [ "${GPU_BENCH:-1}" != 0 ]; then
      for model in ${GPU_BENCH_MODELS:-gpt2-124m gpt2-1.5b}; do
        impls=distrain,distrain-tuned,distrain-wgmma,torch-eager,torch-compile
        [ "$model" != gpt2-1.5b ] || impls=distrain,distrain-tuned,distrain-wgmma,torch-eager
        printf '%s\t77\t%s\t@B@/src\t-\t%s\n' "bench_gpu_$model" "${GPU_BENCH_TIMEOUT:-420}" \
          "python3 @B@/src/tests/bench/bench_gpu.py --build @B@/build --model $model --impls $impls --trace $(printf %q "$resdir/bench_gpu_$model.trace.json")"
      done
      printf '%s\t77\t180\t@B@/src\t-\t%s\n' bench_attention \
        "python3 @B@/src/tests/bench/bench_attention.py --build @B@/build --ncu $(printf %q "$resdir/ncu_attention.txt")"
      printf '%s\t77\t120\t@B@/src\t-\t%s\n' bench_sample \
        "python3 @B@/src/tests/bench/bench_sample.py --build @B@/build --device cuda --precision bf16 --layers 12 --heads 12 --channels 768 --vocab 50257"
      printf '%s\t77\t%s\t@B@/src\t-\t%s\n' bench_pipeline "${GPU_BENCH_TIMEOUT:-420}" \
        "python3 @B@/src/tests/bench/bench_pipeline.py --build @B@/build --stages 4 --require-cores 4 --repeat 2"
    fi
  } | awk -F '\t' -v first="${GPU_FIRST-test_cuda test_golden_cuda bench_gpu_gpt2-124m bench_attention}" '
    BEGIN { n = split(first, f, " "); for (i = 1; i <= n; i++) rank[f[i]] = i }
    { line[NR] = $0; key[NR] = ($1 in rank) ? rank[$1] : n + 1 }
    END { for (k = 1; k <= n + 1; k++) for (i = 1; i <= NR; i++) if (key[i] == k) print line[i] }
  ' >"$WORK/items"

  local budget=${GPU_BUDGET:-0} min_left=${GPU_MIN_LEFT:-30} deadline=0
  [ "$budget" -le 0 ] || deadline=$(($(date +%s) + budget))
  echo "== tests and benchmarks$([ "$deadline" -eq 0 ] || echo " (budget $budget s)")"
  local name skip limit wd envs cmd pass=0 fail=0 skipped=0 notrun=0 failed="" benches="" left
  # record NAME: counts STATUS, a test's or a benchmark's.
  record() {
    if [[ $1 == bench_* ]]; then
      benches="$benches; $1: $STATUS"
      [ "$STATUS" != "NOT RUN" ] || notrun=$((notrun + 1))
      return
    fi
    case $STATUS in
    PASS) pass=$((pass + 1)) ;;
    SKIP) skipped=$((skipped + 1)) ;;
    "NOT RUN") notrun=$((notrun + 1)) ;;
    *) fail=$((fail + 1)) failed="$failed $1" ;;
    esac
  }
  while IFS=$'\t' read -r -u 3 name skip limit wd envs cmd; do
    CAP=0
    if [ "$deadline" -gt 0 ]; then
      left=$((deadline - $(date +%s)))
      if [ "$left" -lt "$min_left" ]; then
        STATUS="NOT RUN"
        echo "$name: NOT RUN (budget: ${left} s left)"
        printf '\n== %s: NOT RUN (budget: %d s of %d left)\n' "$name" "$left" "$budget" >>"$RESULTS"
        record "$name"
        continue
      fi
      CAP=$left
    fi
    run_test "$name" "$skip" "$limit" "$wd" "$envs" "$cmd"
    record "$name"
  done 3<"$WORK/items"
  # The failed tests again under compute-sanitizer's memcheck (their child processes too), in
  # the time left: the first run on a new GPU gets the fault's kernel and address along with
  # the failure. Reported as sanitize_<test>, counted apart from the tests.
  local sanitizer="" sane=""
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
    /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n 1) || true
  for name in $failed; do
    [ "${GPU_SANITIZE:-1}" != 0 ] && [ -n "$sanitizer" ] || break
    left=$((deadline > 0 ? deadline - $(date +%s) : ${GPU_TEST_TIMEOUT:-300}))
    [ "$left" -ge 60 ] || break
    IFS=$'\t' read -r name skip limit wd envs cmd < <(grep -m 1 "^$name"$'\t' "$WORK/items")
    CAP=$left
    # DT_COMPUTE_SANITIZER=1: memcheck runs one kernel at a time, so a test of two streams'
    # concurrency (test_cuda's test_device_side_stream) checks the rest only
    [ "$envs" != - ] || envs=""
    run_test "sanitize_$name" "$skip" "$limit" "$wd" "$envs DT_COMPUTE_SANITIZER=1" \
      "$(printf %q "$sanitizer") --tool memcheck --target-processes all --print-limit 20 $cmd"
    sane="$sane; sanitize_$name: $STATUS"
  done
  local total=$((pass + fail + skipped)) summary
  summary="summary: $total tests, $pass passed, $fail failed, $skipped skipped${failed:+ (failed:$failed)}"
  [ $total -gt 0 ] || summary="summary: no gpu tests in the bundle${GPU_TESTS:+ matching $GPU_TESTS}"
  [ "${GPU_BENCH:-1}" != only ] || summary="summary: benchmark only (GPU_BENCH=only)"
  [ $notrun -eq 0 ] || summary="$summary; $notrun not run within the budget of $budget s"
  summary="$summary$benches$sane"
  printf '\n%s\n' "$summary" >>"$RESULTS"
  echo "$summary"
  echo "results: $RESULTS"
  [ $fail -eq 0 ]
}

case "${1:-}" in
bundle)
  shift
  cmd_bundle "$@"
  ;;
run)
  shift
  cmd_run "$@"
  ;;
*) usage ;;
esac
