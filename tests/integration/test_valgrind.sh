#!/usr/bin/env bash
# test_valgrind.sh — the daemons under valgrind memcheck through a real job.
#
# Starts distrain-coordinator and one distrain-worker under memcheck (children, i.e. the
# trainers, run natively), submits a small two-rank data-parallel job with distrainctl (so the
# rendezvous goes through the coordinator's key-value store), waits for it to complete,
# fetches /metrics, /api/status and the dashboard (and a 404 and a 405) from the
# coordinator's HTTP server, stops both daemons with SIGTERM, and fails if valgrind reports any memory error or any
# definitely lost block (gRPC's process-lifetime allocations show as "still reachable" and
# are not counted).
#
#   tests/integration/test_valgrind.sh BUILD_DIR
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/../.." && pwd)
command -v valgrind >/dev/null || { echo "valgrind not installed: skipping"; exit 77; }
T=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null || true; rm -rf "$T"' EXIT
VG=(valgrind --quiet --error-exitcode=42 --leak-check=full --errors-for-leak-kinds=definite
    --show-leak-kinds=definite --trace-children=no)

head -c 300000 "$SRC/README.md" >"$T/text.txt"
while [ "$(stat -c %s "$T/text.txt")" -lt 200000 ]; do cat "$T/text.txt" "$T/text.txt" >"$T/t2" && mv "$T/t2" "$T/text.txt"; done
"$BUILD/worker/trainer/distrain-prep" --input "$T/text.txt" --out "$T/data" >/dev/null
echo "valgrind-test-token" >"$T/token"
chmod 600 "$T/token"

"${VG[@]}" --log-file="$T/vg-coordinator.txt" "$BUILD/coordinator/distrain-coordinator" \
  --listen 127.0.0.1:0 --port-file "$T/port" --state-dir "$T/state" --token-file "$T/token" \
  --heartbeat-ms 500 --dead-after 20 --http 127.0.0.1:0 --http-port-file "$T/http.port" \
  >"$T/coord.log" 2>&1 &
COORD=$!
for _ in $(seq 300); do [ -s "$T/port" ] && break; sleep 0.1; done
[ -s "$T/port" ] || { echo "FAIL: coordinator did not start"; cat "$T/coord.log"; exit 1; }
ADDR=127.0.0.1:$(cat "$T/port")
"${VG[@]}" --log-file="$T/vg-worker.txt" "$BUILD/worker/agent/distrain-worker" \
  --coordinator "$ADDR" --token-file "$T/token" --work-dir "$T/work" --hostname vg --cpu-devices 2 \
  --trainer "$BUILD/worker/trainer/distrain-train" >"$T/worker.log" 2>&1 &
WORKER=$!

cat >"$T/job.yaml" <<EOF
model: {layers: 1, heads: 2, channels: 16, vocab: 256, max_seq: 32, init: "seed:1"}
data: {train: "$T/data/train_*.bin", val: "$T/data/val.bin"}
training: {batch: 4, seq: 16, micro_batch: 2, steps: 10, val_every: 5, val_batches: 1, threads: 1}
parallel: {dp: 2, zero_stage: 3}
checkpoint: {dir: "$T/ckpt", every: 5, keep: 1}
elastic: {heartbeat_ms: 500}
EOF
CTL=("$BUILD/coordinator/distrainctl" --coordinator "$ADDR" --token-file "$T/token")
JOB=$("${CTL[@]}" submit "$T/job.yaml")
state=""
for _ in $(seq 600); do
  state=$("${CTL[@]}" status "$JOB" --json | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')
  case "$state" in COMPLETED | FAILED | STOPPED) break ;; esac
  sleep 0.2
done
"${CTL[@]}" nodes >/dev/null
# A drain and an undrain, and a drain left in place when the coordinator stops (its reason freed).
for args in "drain node-0 --reason valgrind" "undrain node-0" "drain node-0 --reason again"; do
  # shellcheck disable=SC2086 # the words of args are distrainctl's arguments
  "${CTL[@]}" $args >/dev/null || { echo "FAIL: distrainctl $args"; fail_drain=1; }
done
/usr/bin/python3 - "$(cat "$T/http.port")" "$JOB" <<'PY' || { echo "FAIL: /metrics"; fail_http=1; }
import json, sys, urllib.error, urllib.request
base = "http://127.0.0.1:%s" % sys.argv[1]
body = urllib.request.urlopen(base + "/metrics", timeout=60).read().decode()
assert 'distrain_job_step{job_id="%s"}' % sys.argv[2] in body, body[:2000]
status = json.loads(urllib.request.urlopen(base + "/api/status", timeout=60).read())
assert [x["job"]["job_id"] for x in status["jobs"]] == [sys.argv[2]], status
assert b"<canvas" in urllib.request.urlopen(base + "/", timeout=60).read()
for method, path, code in (("GET", "/nope", 404), ("POST", "/metrics", 405)):
    try:
        urllib.request.urlopen(urllib.request.Request(base + path, method=method, data=b"x"
                                                      if method == "POST" else None), timeout=60)
        raise AssertionError("%s %s answered 200" % (method, path))
    except urllib.error.HTTPError as e:
        assert e.code == code, (method, path, e.code)
PY
kill -TERM "$WORKER"
wc=0; wait "$WORKER" || wc=$?
kill -TERM "$COORD"
cc=0; wait "$COORD" || cc=$?
fail=$((${fail_http:-0} | ${fail_drain:-0}))
[ "$state" = COMPLETED ] || { echo "FAIL: job ended $state"; tail -20 "$T/coord.log"; fail=1; }
for d in coordinator:$cc worker:$wc; do
  name=${d%%:*} rc=${d##*:}
  if [ "$rc" -ne 0 ]; then
    echo "FAIL: $name exited $rc under valgrind:"
    cat "$T/vg-$name.txt" 2>/dev/null || true
    fail=1
  else
    echo "ok - $name: no memory errors, no definite leaks"
  fi
done
[ $fail -eq 0 ] && echo "2 passed, 0 failed" || echo "$((2 - fail)) passed, $fail failed"
exit $fail
