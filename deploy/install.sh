#!/usr/bin/env bash
# install.sh — installs distrain's binaries, its systemd units and example configuration.
#
#   deploy/install.sh [--prefix DIR] [--destdir DIR] [--build DIR] [--unitdir DIR]
#
#   --prefix DIR   where the binaries live on the node (default /usr/local: DIR/bin/distrain-*);
#                  the units' ExecStart= lines name DIR/bin
#   --destdir DIR  staging root prepended to every path written (packaging, tests); the units
#                  still name the final paths (default: none, install for real)
#   --build DIR    the CMake build tree to install from (default build)
#   --unitdir DIR  where the units go (default /etc/systemd/system)
#
# Installs distrain-coordinator, distrain-worker, distrain-train (beside distrain-worker, where
# the agent looks for it), distrain-prep, distrain-convert and distrainctl;
# distrain-coordinator.service and distrain-worker.service; Prometheus alerting rules
# (PREFIX/share/distrain/distrain-alerts.yml); /etc/distrain/coordinator.env and
# worker.env (examples, never overwriting files already there); and /etc/distrain/token (mode
# 0600) if there is none.
# Needs no running systemd: it only writes files, then says what to run.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
prefix=/usr/local
destdir=
build=$root/build
unitdir=/etc/systemd/system
confdir=/etc/distrain # ConfigurationDirectory=distrain: systemd fixes it under /etc

usage() {
  sed -n '4,11s/^# \{0,1\}//p' "$0" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case "$1" in
  --prefix | --destdir | --build | --unitdir)
    [ $# -ge 2 ] || usage
    case "$1" in
    --prefix) prefix=$2 ;;
    --destdir) destdir=$2 ;;
    --build) build=$2 ;;
    --unitdir) unitdir=$2 ;;
    esac
    shift 2
    ;;
  -h | --help) usage ;;
  *)
    echo "install.sh: unknown option '$1'" >&2
    usage
    ;;
  esac
done
case "$prefix" in
/*) ;;
*) echo "install.sh: --prefix must be an absolute path, not '$prefix'" >&2 && exit 2 ;;
esac
if [[ "$prefix" =~ [[:space:]\\\$%] ]]; then
  # It goes into ExecStart= lines, where these characters have meanings of their own.
  echo "install.sh: --prefix '$prefix' contains whitespace, \\, \$ or %: not allowed in a unit" >&2
  exit 2
fi
prefix=${prefix%/}
if [ -n "$destdir" ]; then
  mkdir -p "$destdir"
  destdir=$(cd "$destdir" && pwd)
fi

for f in coordinator/distrain-coordinator coordinator/distrainctl worker/agent/distrain-worker \
  worker/trainer/distrain-train worker/trainer/distrain-prep worker/trainer/distrain-convert; do
  if [ ! -x "$build/$f" ]; then
    echo "install.sh: $build/$f is missing: build first (cmake -S . -B build && cmake --build build)" >&2
    exit 1
  fi
done

echo "== binaries -> $destdir$prefix/bin"
# CMake's own install rules (install(TARGETS ...)), honouring DESTDIR.
DESTDIR=$destdir cmake --install "$build" --prefix "$prefix" >/dev/null

echo "== units -> $destdir$unitdir"
install -d -m 0755 "$destdir$unitdir"
for unit in distrain-coordinator.service distrain-worker.service; do
  sed "s|^ExecStart=/usr/local/bin/|ExecStart=$prefix/bin/|" "$here/systemd/$unit" \
    >"$destdir$unitdir/$unit.tmp"
  chmod 0644 "$destdir$unitdir/$unit.tmp"
  mv "$destdir$unitdir/$unit.tmp" "$destdir$unitdir/$unit"
done

echo "== Prometheus alerting rules -> $destdir$prefix/share/distrain"
install -d -m 0755 "$destdir$prefix/share/distrain"
install -m 0644 "$here/prometheus/distrain-alerts.yml" "$destdir$prefix/share/distrain/"

echo "== configuration -> $destdir$confdir"
install -d -m 0755 "$destdir$confdir"
for env in coordinator.env worker.env; do
  if [ -e "$destdir$confdir/$env" ]; then
    echo "   $confdir/$env exists: kept (the example is $here/systemd/$env)"
  else
    install -m 0644 "$here/systemd/$env" "$destdir$confdir/$env"
  fi
done
token=$destdir$confdir/token
if [ -e "$token" ]; then
  echo "   $confdir/token exists: kept"
else
  # 24 random bytes as 48 hex digits, the format distrainctl run --local writes; 0600 from
  # the start (the daemons refuse a token file group or others can read).
  (
    umask 077
    od -An -N24 -tx1 /dev/urandom | tr -d ' \n' >"$token.tmp"
    echo >>"$token.tmp"
    mv "$token.tmp" "$token"
  )
  echo "   $confdir/token: a new token (copy this file, mode 0600, to every node)"
fi

cat <<EOF

Installed. Next steps on the head node:
  edit $confdir/coordinator.env (--listen)
  systemctl daemon-reload
  systemctl enable --now distrain-coordinator
on every node (the same $confdir/token on each):
  edit $confdir/worker.env (--coordinator HEAD:7470)
  systemctl daemon-reload
  systemctl enable --now distrain-worker
Jobs' checkpoint directories must be writable by both services (ProtectSystem=strict):
  systemctl edit distrain-worker   (and distrain-coordinator), then add
    [Service]
    ReadWritePaths=/path/to/checkpoints
Check with: systemctl status distrain-coordinator; journalctl -u distrain-worker -f
Alerts: add $prefix/share/distrain/distrain-alerts.yml to rule_files in prometheus.yml.
EOF
