#!/usr/bin/env bash
# install-deps.sh — installs every Debian package that distrain's build, tests and demo need.
#
# Idempotent: packages already present are left alone, and apt-get runs only when something is
# missing. Runs as root on a fresh Debian bookworm machine (uses sudo when not root).
#
#   deploy/install-deps.sh            build + tests + demo
#   deploy/install-deps.sh --torch    also python3-torch (PyTorch reference and benchmarks)
set -euo pipefail

pkgs=(
  build-essential cmake pkg-config git ca-certificates
  libopenblas-dev libopenblas-openmp-dev # CPU GEMM (cblas_sgemm), OpenMP-threaded build
  libuv1-dev                             # event loops of the daemons
  libgrpc-dev protobuf-c-compiler libprotobuf-c-dev  # RPC + wire messages
  libyaml-dev                            # job specs
  libpcre2-dev libjson-c-dev             # GPT-2's BPE tokenizer (distrain-prep, samples)
  libsqlite3-dev                         # coordinator state
  libmicrohttpd-dev                      # /metrics
  prometheus                             # the /metrics test scrapes with a real server
  chromium                               # the dashboard test renders the page headless
  libsystemd-dev                         # sd_notify
  systemd                                # systemd-analyze verify (tests of the units)
  libgloo-dev                            # CPU collectives
  check                                  # unit tests
  python3-regex                          # the tokenizer test's reference BPE
  python3 python3-numpy python3-grpcio python3-protobuf protobuf-compiler protobuf-compiler-grpc  # interop tests (protoc + grpc_python_plugin)
  bible-kjv bible-kjv-text               # demo corpus
  clang-format valgrind                  # CI quality gates
  openssl                                # the TLS tests make their own certificate authority
  gnuplot-nox                            # distrainctl status --plot (loss curves as PNG)
  slurmctld slurmd slurm-client munge    # tests/integration/test_slurm.py: a private one-host Slurm cluster runs deploy/slurm/distrain.sbatch
)
for arg in "$@"; do
  case "$arg" in
    --torch) pkgs+=(python3-torch) ;;
    *) echo "install-deps.sh: unknown option '$arg' (expected --torch)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
