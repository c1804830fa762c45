#!/bin/bash
# test_cli.sh — runs the real distrain-train and distrain-prep binaries on bad input and checks
# that each failure exits non-zero with a one-line error on stderr naming the file and what was
# expected (and that nothing is left half-written); then checks the happy path: prep makes shards
# of the right sizes and a few training steps write one JSON metrics line per step.
#
#   bash test_cli.sh PATH/TO/distrain-train PATH/TO/distrain-prep
set -u

TRAIN=${1:?usage: test_cli.sh DISTRAIN_TRAIN DISTRAIN_PREP}
PREP=${2:?usage: test_cli.sh DISTRAIN_TRAIN DISTRAIN_PREP}
PY=/usr/bin/python3
export OMP_NUM_THREADS=2

T=$(mktemp -d "${TMPDIR:-/tmp}/dt-cli-XXXXXX")
trap 'rm -rf "$T"' EXIT

FAILS=0
CHECKS=0
ok() { CHECKS=$((CHECKS + 1)); echo "ok   - $*"; }
bad() {
  CHECKS=$((CHECKS + 1))
  FAILS=$((FAILS + 1))
  echo "FAIL - $*"
}

# The tiny model every run uses (fast; byte-level vocabulary).
MODEL=(--layers 1 --heads 2 --channels 16 --vocab 256 --max-seq 32 --batch 2 --seq 16 --threads 2)

# run NAME CMD... : runs the command, leaving its exit code in RC and stderr in $T/NAME.err.
run() {
  local name=$1
  shift
  "$@" >"$T/$name.out" 2>"$T/$name.err"
  RC=$?
}

# expect_error NAME WANT_RC PATTERN1 PATTERN2 : the last run exited with WANT_RC ("nonzero" for
# any non-zero code) and one stderr line contains both fixed strings.
expect_error() {
  local name=$1 want=$2 p1=$3 p2=$4
  if [[ $want == nonzero && $RC -eq 0 ]] || [[ $want != nonzero && $RC -ne $want ]]; then
    bad "$name: exit code $RC, expected $want"
    sed 's/^/    | /' "$T/$name.err" | tail -5
    return
  fi
  if grep -F -- "$p1" "$T/$name.err" | grep -qF -- "$p2"; then
    ok "$name (exit $RC): $(grep -F -- "$p1" "$T/$name.err" | grep -F -- "$p2" | head -1)"
  else
    bad "$name: no stderr line containing both '$p1' and '$p2'"
    sed 's/^/    | /' "$T/$name.err" | tail -5
  fi
}

# A listing with checksums of everything under a directory, to prove it was left alone.
snapshot() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 -r md5sum); }

# Tokens in a shard, from its header (int32 word 2).
shard_ntok() { od -An -t d4 -j 8 -N 4 "$1" | tr -d ' '; }

# ------------------------------------------------------------------------------------------
# distrain-prep: a small text into train_000000.bin and val.bin of the right sizes
# ------------------------------------------------------------------------------------------
for i in $(seq 1 150); do echo "the quick brown fox number $i jumps over the lazy dog"; done >"$T/text.txt"
NBYTES=$(stat -c %s "$T/text.txt")
NVAL=$((NBYTES / 10)) # --val-fraction 0.1 (the default), rounded down
NTRAIN=$((NBYTES - NVAL))
run prep "$PREP" --input "$T/text.txt" --out "$T/data"
DATA=$T/data/train_000000.bin
VAL=$T/data/val.bin
if [[ $RC -eq 0 && -f $DATA && -f $VAL ]]; then
  ok "prep wrote train_000000.bin and val.bin"
else
  bad "prep: exit $RC, files: $(ls "$T/data" 2>/dev/null | tr '\n' ' ')"
  cat "$T/prep.err"
  echo "cannot continue without data"
  exit 1
fi
for f in "$DATA:$NTRAIN" "$VAL:$NVAL"; do
  path=${f%:*} want=${f##*:}
  got=$(shard_ntok "$path")
  size=$(stat -c %s "$path")
  if [[ $got -eq $want && $size -eq $((1024 + 2 * want)) ]]; then
    ok "$(basename "$path"): $got tokens, $size bytes"
  else
    bad "$(basename "$path"): header says $got tokens ($size bytes), expected $want tokens"
  fi
done
# The tokens are the text's bytes.
if $PY - "$DATA" "$T/text.txt" "$NTRAIN" <<'EOF'; then
import struct, sys
shard, text, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
raw = open(shard, "rb").read()
hdr = struct.unpack("<256i", raw[:1024])
assert hdr[:3] == (20240520, 1, n), hdr[:3]
toks = struct.unpack("<%dH" % n, raw[1024:])
assert bytes(toks) == open(text, "rb").read()[:n]
EOF
  ok "train shard tokens are the first $NTRAIN bytes of the text"
else
  bad "train shard tokens differ from the text"
fi
ls "$T/data" | grep -q tmp && bad "prep left a temporary file behind"
# With at most 500 tokens in memory (the rest spilled to a file, shards of 1024 tokens read
# back from it): the same tokens, and no file left behind.
DISTRAIN_PREP_BUFFER_TOKENS=500 run prep_spill "$PREP" --input "$T/text.txt" --out "$T/spill" \
  --shard-tokens 1024
if [[ $RC -eq 0 ]] && $PY - "$T/spill" "$T/text.txt" <<'EOF'; then
import glob, os, struct, sys
out, text = sys.argv[1], open(sys.argv[2], "rb").read()
got = b""
for f in sorted(glob.glob(os.path.join(out, "train_*.bin"))) + [os.path.join(out, "val.bin")]:
    raw = open(f, "rb").read()
    n = struct.unpack("<3i", raw[:12])[2]
    assert len(raw) == 1024 + 2 * n, f
    got += bytes(struct.unpack("<%dH" % n, raw[1024:]))
assert got == text, "the shards are not the text"
ntrain = len(text) - int(len(text) * 0.1)
assert len(os.listdir(out)) == -(-ntrain // 1024) + 1, sorted(os.listdir(out))
EOF
  ok "prep with 500 tokens in memory: the same tokens in 1024-token shards, nothing else"
else
  bad "prep with a spill file: exit $RC, or other tokens"
  tail -3 "$T/prep_spill.err"
fi

run prep_bad_frac "$PREP" --input "$T/text.txt" --out "$T/data2" --val-fraction 1.5
expect_error prep_bad_frac 2 "--val-fraction" "expected"
run prep_missing "$PREP" --input "$T/no-such.txt" --out "$T/data2"
expect_error prep_missing nonzero "$T/no-such.txt" "No such file"

# ------------------------------------------------------------------------------------------
# distrain-train, happy path: --metrics has one JSON object per step
# ------------------------------------------------------------------------------------------
run good "$TRAIN" --train "$DATA" --val "$VAL" --val-every 2 --val-batches 2 "${MODEL[@]}" \
  --steps 4 --metrics "$T/metrics.jsonl" --export-llmc "$T/model.bin" --quiet
if [[ $RC -eq 0 ]]; then
  ok "train 4 steps"
else
  bad "train 4 steps: exit $RC"
  tail -5 "$T/good.err"
fi
if $PY - "$T/metrics.jsonl" <<'EOF'; then
import json, math, sys
lines = open(sys.argv[1]).read().splitlines()
assert len(lines) == 5, "%d lines" % len(lines)
m0 = json.loads(lines[0])  # the validation loss before training
assert m0["step"] == 0 and math.isfinite(m0["val_loss"]) and set(m0) == {"step", "val_loss"}, m0
lines = lines[1:]
for i, line in enumerate(lines):
    m = json.loads(line)  # one complete JSON object per line
    assert m["step"] == i + 1, m
    for k in ("loss", "lr", "grad_norm", "ms", "tokens_per_s"):
        assert isinstance(m[k], (int, float)) and math.isfinite(m[k]), (k, m)
    assert 0 < m["loss"] < 20, m
    assert ("val_loss" in m) == (m["step"] % 2 == 0), m
EOF
  ok "metrics: step-0 val line, then 4 JSON lines, steps 1..4, val_loss on even steps"
else
  bad "metrics file is not one valid JSON line per step:"
  sed 's/^/    | /' "$T/metrics.jsonl"
fi

# The learning-rate schedules, step by step (the metrics' lr: the rate each step used) against
# their formulas: warmup, then linear decay to lr * min_lr_frac over the steps after it, or
# warmup-stable-decay with the decay over the last decay_frac of them (round(0.3 x 10) = 3).
for sched in linear wsd; do
  run "lr_$sched" "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 12 --warmup 2 --lr 1e-3 \
    --min-lr-frac 0.1 --schedule "$sched" --decay-frac 0.3 --metrics "$T/lr_$sched.jsonl" --quiet
  if [[ $RC -eq 0 ]] && $PY - "$T/lr_$sched.jsonl" "$sched" <<'EOF'; then
import json, sys
lrs = [json.loads(line)["lr"] for line in open(sys.argv[1])]
peak, low, warm, total, decay = 1e-3, 1e-4, 2, 12, 3
def want(s):
    if s < warm:
        return peak * (s + 1) / warm
    if sys.argv[2] == "linear":
        p = (s - warm) / (total - warm)
    else:
        p = max(0.0, (s - (total - decay)) / decay)
    return low + (1 - p) * (peak - low)
assert len(lrs) == total, lrs
for s, lr in enumerate(lrs):
    assert abs(lr - want(s)) <= 1e-7 * peak, (s, lr, want(s))
EOF
    ok "--schedule $sched: the lr of each of 12 steps"
  else
    bad "--schedule $sched: exit $RC, or an lr off its formula"
    sed 's/^/    | /' "$T/lr_$sched.err" | tail -5
  fi
done
# A wsd run is extended from a checkpoint of its stable phase: 12 steps planned, stopped at 6,
# resumed as 20 steps, gives the 20-step run's losses and rates bit for bit.
WSD=(--train "$DATA" "${MODEL[@]}" --warmup 2 --lr 1e-3 --schedule wsd --decay-frac 0.3 --quiet)
run wsd20 "$TRAIN" "${WSD[@]}" --steps 20 --metrics "$T/wsd20.jsonl"
rc20=$RC
run wsd12 "$TRAIN" "${WSD[@]}" --steps 12 --stop-at 6 --ckpt-dir "$T/wsd-ckpt"
rc12=$RC
run wsd_more "$TRAIN" "${WSD[@]}" --steps 20 --ckpt-dir "$T/wsd-ckpt" --resume \
  --metrics "$T/wsd_more.jsonl"
if [[ $rc20 -eq 0 && $rc12 -eq 0 && $RC -eq 0 ]] && $PY - "$T/wsd20.jsonl" "$T/wsd_more.jsonl" <<'EOF'; then
import json, sys
pick = lambda f: [(m["step"], m["loss"], m["lr"]) for m in map(json.loads, open(f))]
full, more = pick(sys.argv[1]), pick(sys.argv[2])
assert [s for s, _, _ in more] == list(range(7, 21)), more
assert more == full[6:], (more, full[6:])
EOF
  ok "a wsd run stopped in its stable phase goes on as a longer run, bit for bit"
else
  bad "wsd extended: exit codes $rc20 $rc12 $RC, or other losses"
  tail -3 "$T/wsd_more.err"
fi

# ------------------------------------------------------------------------------------------
# Bad token shards
# ------------------------------------------------------------------------------------------
cp "$DATA" "$T/magic.bin"
printf '\x01\x02\x03\x04' | dd of="$T/magic.bin" bs=1 seek=0 conv=notrunc status=none
run magic "$TRAIN" --train "$T/magic.bin" "${MODEL[@]}" --steps 1
expect_error magic 1 "$T/magic.bin" "expected 20240520"

cp "$DATA" "$T/version.bin"
printf '\x07\x00\x00\x00' | dd of="$T/version.bin" bs=1 seek=4 conv=notrunc status=none
run version "$TRAIN" --train "$T/version.bin" "${MODEL[@]}" --steps 1
expect_error version 1 "$T/version.bin" "version 7: expected 1"

cp "$DATA" "$T/trunc.bin"
truncate -s -3 "$T/trunc.bin"
run trunc "$TRAIN" --train "$T/trunc.bin" "${MODEL[@]}" --steps 1
expect_error trunc 1 "$T/trunc.bin" "expected $((1024 + 2 * NTRAIN)) bytes (truncated)"

head -c 100 "$DATA" >"$T/header.bin"
run header "$TRAIN" --train "$T/header.bin" "${MODEL[@]}" --steps 1
expect_error header 1 "$T/header.bin" "expected a 1024-byte header"

# Byte-level data has letters (>= 97) that a 64-token vocabulary cannot hold.
run vocab "$TRAIN" --train "$DATA" --layers 1 --heads 2 --channels 16 --vocab 64 --max-seq 32 \
  --batch 2 --seq 16 --steps 1
expect_error vocab 1 "$DATA" ">= vocab 64"

run nomatch "$TRAIN" --train "$T/nothing_*.bin" "${MODEL[@]}" --steps 1
expect_error nomatch 1 "$T/nothing_*.bin" "no token shard matches"

# ------------------------------------------------------------------------------------------
# llm.c checkpoints that disagree with the flags, or are damaged
# ------------------------------------------------------------------------------------------
if [[ -f $T/model.bin ]]; then
  run llmc_layers "$TRAIN" --train "$DATA" --init "llmc:$T/model.bin" --layers 2 --steps 1
  expect_error llmc_layers 1 "$T/model.bin" "checkpoint has layers 1 but 2 was given"
  run llmc_channels "$TRAIN" --train "$DATA" --init "llmc:$T/model.bin" --channels 32 --steps 1
  expect_error llmc_channels 1 "$T/model.bin" "checkpoint has channels 16 but 32 was given"
  # agreeing flags are accepted
  run llmc_ok "$TRAIN" --train "$DATA" --init "llmc:$T/model.bin" "${MODEL[@]}" --steps 1 --quiet
  [[ $RC -eq 0 ]] && ok "llm.c init with agreeing flags" || bad "llm.c init with agreeing flags: exit $RC"

  cp "$T/model.bin" "$T/model_v5.bin"
  printf '\x05\x00\x00\x00' | dd of="$T/model_v5.bin" bs=1 seek=4 conv=notrunc status=none
  run llmc_v5 "$TRAIN" --train "$DATA" --init "llmc:$T/model_v5.bin" --steps 1
  expect_error llmc_v5 1 "$T/model_v5.bin" "expected 3 (fp32); version 5 is bf16"

  cp "$T/model.bin" "$T/model_trunc.bin"
  truncate -s -4 "$T/model_trunc.bin"
  run llmc_trunc "$TRAIN" --train "$DATA" --init "llmc:$T/model_trunc.bin" --steps 1
  expect_error llmc_trunc 1 "$T/model_trunc.bin" "(truncated)"
else
  bad "--export-llmc did not write $T/model.bin"
fi

# ------------------------------------------------------------------------------------------
# Checkpoint directories
# ------------------------------------------------------------------------------------------
: >"$T/plainfile"
run ckpt_unwritable "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 2 --ckpt-dir "$T/plainfile/ckpt" \
  --metrics "$T/unwritable.jsonl"
expect_error ckpt_unwritable 1 "$T/plainfile/ckpt" "cannot create checkpoint directory"
# refused before any step was spent
[[ -s $T/unwritable.jsonl ]] && bad "steps ran although the checkpoint dir is unusable" ||
  ok "no step ran with an unusable checkpoint dir"

run ckpt_first "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 2 --ckpt-dir "$T/ck" --quiet
if [[ $RC -eq 0 && -f $T/ck/step-00000002/MANIFEST ]]; then
  ok "first run committed $T/ck/step-00000002"
else
  bad "first run: exit $RC, $(ls "$T/ck" 2>/dev/null)"
fi
before=$(snapshot "$T/ck")
run ckpt_clobber "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 4 --ckpt-dir "$T/ck"
expect_error ckpt_clobber 1 "$T/ck" "pass --resume"
[[ "$(snapshot "$T/ck")" == "$before" ]] && ok "existing checkpoint dir left untouched" ||
  bad "existing checkpoint dir was modified"
# ... while --resume continues it
run ckpt_resume "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 3 --ckpt-dir "$T/ck" --resume --quiet
[[ $RC -eq 0 && -f $T/ck/step-00000003/MANIFEST ]] && ok "--resume continued to step 3" ||
  bad "--resume: exit $RC"
# A save cut short (a shard, no MANIFEST) that an earlier run left is deleted on resume; a step
# marked bad is kept for inspection.
mkdir -p "$T/ck/step-00000007" "$T/ck/step-00000001"
echo partial >"$T/ck/step-00000007/shard-00000-of-00001.bin.tmp.99"
echo bad >"$T/ck/step-00000001/MANIFEST.bad"
run ckpt_incomplete "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 4 --ckpt-dir "$T/ck" --resume
expect_error ckpt_incomplete 0 "$T/ck: deleted the incomplete save of step 7" \
  "that an earlier run left (no MANIFEST: stopped mid-save)"
[[ ! -e $T/ck/step-00000007 && -f $T/ck/step-00000001/MANIFEST.bad && -f $T/ck/step-00000004/MANIFEST ]] &&
  ok "the incomplete step 7 deleted, the bad step 1 kept, step 4 committed" ||
  bad "after the resume: $(ls "$T/ck" | tr '\n' ' ')"

# Rotation: --keep 1 leaves the newest step, --keep-every 4 the steps 4 divides besides; on
# resume too (the second run prunes what the first left by the same rule).
run keep_every "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 10 --stop-at 6 --ckpt-dir "$T/keep" \
  --save-every 2 --keep 1 --keep-every 4
run keep_every2 "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 10 --ckpt-dir "$T/keep" \
  --save-every 2 --keep 1 --keep-every 4 --resume
kept=$(cd "$T/keep" && ls -d step-*/MANIFEST 2>/dev/null | tr '\n' ' ')
if [[ $RC -eq 0 && $kept == "step-00000004/MANIFEST step-00000008/MANIFEST step-00000010/MANIFEST " ]] &&
  [[ $(cd "$T/keep" && ls | wc -l) -eq 3 ]] &&
  grep -q "checkpoint step 8: written and committed.*(kept for good: a multiple of --keep-every)" \
    "$T/keep_every2.err"; then
  ok "--keep 1 --keep-every 4 over 10 steps (stopped at 6, resumed): steps 4, 8 and 10 kept"
else
  bad "--keep-every: exit $RC, kept: $kept ($(ls "$T/keep"))"
fi
run keep_every_bad "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 4 --ckpt-dir "$T/keep_bad" \
  --save-every 2 --keep 1 --keep-every 3
expect_error keep_every_bad 1 "--keep-every" "a multiple of --save-every"
run save_every_s_bad "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 4 --save-every-s 60
expect_error save_every_s_bad 1 "--save-every-s must be >= 0 and needs --ckpt-dir" \
  "(0: saves by steps only)"

# A checkpoint filesystem too small for the checkpoints a run keeps (a 256 KiB tmpfs in a mount
# namespace of its own; each checkpoint of MODEL is 95 KB): warned before the first step, with
# the sizes. A save that finds it full is abandoned (its shard deleted, the step not committed)
# and training goes on; the next save tries again, and succeeds once there is room: the run's
# last checkpoint is then the same as a run's on a large disk. A last save that cannot be
# written waits for room (--last-save-wait) and is written again once there is; if no room
# comes, it fails the run. With --keep 1 the same run fits, and no warning.
cat >"$T/small.sh" <<'EOF_SMALL'
# small.sh DIR FILLER_KB ERR TRAIN ARGS...: TRAIN on DIR, a fresh 256 KiB tmpfs holding a file of
# FILLER_KB KiB, deleted once ERR says a save was not saved (with STOP_ON set, TRAIN is sent
# SIGTERM once ERR says that instead); then DIR's committed steps and newest manifest go to
# DIR.ls.
dir=$1 filler=$2 err=$3
shift 3
mount -t tmpfs -o size=256k none "$dir" || exit 99
[ "$filler" -gt 0 ] && head -c "$((filler * 1024))" /dev/zero >"$dir/filler"
"$@" &
pid=$!
if [ "$filler" -gt 0 ]; then
  while kill -0 "$pid" 2>/dev/null && ! grep -q "not saved" "$err"; do sleep 0.05; done
  rm -f "$dir/filler"
fi
if [ -n "$STOP_ON" ]; then
  while kill -0 "$pid" 2>/dev/null && ! grep -q "$STOP_ON" "$err"; do sleep 0.05; done
  kill -TERM "$pid"
fi
wait "$pid"
rc=$?
(cd "$dir/ckpt" && ls -d step-* && cat "$(ls -d step-*/MANIFEST | tail -1)") >"$dir.ls" 2>&1
exit $rc
EOF_SMALL
small() { # small NAME FILLER_KB ARGS...: the trainer with $T/small/$NAME a fresh 256 KiB tmpfs
  local name=$1 filler=$2
  shift 2
  mkdir -p "$T/small/$name"
  run "$name" unshare -rm sh "$T/small.sh" "$T/small/$name" "$filler" "$T/$name.err" "$TRAIN" \
    --train "$DATA" "${MODEL[@]}" --save-every 1 --ckpt-dir "$T/small/$name/ckpt" "$@"
}
if unshare -rm true 2>/dev/null; then
  small ckpt_full 0 --steps 6 --keep 0 --last-save-wait 1
  expect_error ckpt_full 1 "0.25 MiB free, but each checkpoint takes 0.09 MiB" \
    "holds up to 7 at once (--keep 0: all): 0.63 MiB"
  expect_error ckpt_full 1 "checkpoint step 3 not saved: rank 0 on $(hostname) could not write its shard: no space left on device in $T/small/ckpt_full/ckpt (0.0" \
    "the shard needs 0.09 MiB). Training goes on and the save of step 4 tries again; a failure now resumes from step 2, the newest committed."
  expect_error ckpt_full 1 "the run's last checkpoint, of step 6, was not saved (a writer's disk is full): waiting up to 1 s" \
    "for room in $T/small/ckpt_full/ckpt to write it again (--last-save-wait, checkpoint.last_save_wait_s)"
  expect_error ckpt_full 1 "the run's last checkpoint, of step 6, was not saved (a writer's disk is full and no room came in 1 s)" \
    "Free space in $T/small/ckpt_full/ckpt and resume it (--resume; distrainctl resume JOB) from step 2"
  # A stop while the last save waits for room ends the run as a stop (exit 3), unsaved.
  STOP_ON="waiting up to" small ckpt_full_stop 0 --steps 4 --keep 0
  expect_error ckpt_full_stop 3 "stopped on request after step 4 of 4: its checkpoint was not saved (a writer's disk is full in $T/small/ckpt_full_stop/ckpt)" \
    "a restart (--resume) resumes from step 2, the newest committed"
  grep -q "step     6/6" "$T/ckpt_full.err" && ok "ckpt_full: trained on to step 6" ||
    bad "ckpt_full: no step 6 line"
  [[ $(head -2 "$T/small/ckpt_full.ls" | tr '\n' ' ') == "step-00000001 step-00000002 " ]] &&
    ok "ckpt_full: the abandoned steps' files deleted; steps 1 and 2 kept" ||
    bad "ckpt_full: left $(tr '\n' ' ' <"$T/small/ckpt_full.ls")"
  # 100 KiB taken by another file: step 2's save does not fit beside step 1 (--keep 1 holds
  # two while the newer is written); the file is deleted once it is reported, and later saves
  # succeed. The same run on a large disk is the reference.
  DISTRAIN_FAULT_SLOW_MS=100 small ckpt_freed 100 --steps 12 --keep 1
  freed_rc=$RC
  run ckpt_ref "$TRAIN" --train "$DATA" "${MODEL[@]}" --save-every 1 --ckpt-dir "$T/ckpt_ref" \
    --steps 12 --keep 1
  ref=$(grep "^shard" "$T/ckpt_ref/step-00000012/MANIFEST")
  if [[ $freed_rc -eq 0 && $RC -eq 0 ]] && grep -q "checkpoint step 2 not saved" "$T/ckpt_freed.err" &&
    [[ $(head -1 "$T/small/ckpt_freed.ls") == step-00000012 ]] && [[ -n $ref ]] &&
    grep -qxF "$ref" "$T/small/ckpt_freed.ls" &&
    [[ "$(grep -o 'step    12/12 | loss [0-9.]*' "$T/ckpt_freed.err")" == \
      "$(grep -o 'step    12/12 | loss [0-9.]*' "$T/ckpt_ref.err")" ]]; then
    ok "ckpt_freed: step 2 not saved, the disk freed, step 12 committed with the reference run's shard (size and CRC) and loss"
  else
    bad "ckpt_freed: exit $freed_rc (reference $RC); $(grep -c 'not saved' "$T/ckpt_freed.err") not saved; $(tr '\n' ' ' <"$T/small/ckpt_freed.ls"); reference: $ref"
    tail -3 "$T/ckpt_freed.err"
  fi
  # 160 KiB taken: the shard (24 pages of 4 KiB) fits, its manifest does not; the step is
  # abandoned the same way, and the next saves succeed once the file is deleted.
  if [[ $(getconf PAGESIZE) == 4096 ]]; then
    DISTRAIN_FAULT_SLOW_MS=100 small ckpt_manifest 160 --steps 4 --keep 1
    [[ $RC -eq 0 ]] && grep -q "checkpoint step 1 not saved: rank 0 could not write its manifest: no space left on device in $T/small/ckpt_manifest/ckpt; training goes on" "$T/ckpt_manifest.err" &&
      [[ $(head -1 "$T/small/ckpt_manifest.ls") == step-00000004 ]] &&
      ok "ckpt_manifest: step 1's manifest did not fit: abandoned, step 4 committed" ||
      bad "ckpt_manifest: exit $RC; $(grep 'not saved' "$T/ckpt_manifest.err"); $(head -1 "$T/small/ckpt_manifest.ls")"
  else
    ok "ckpt_manifest skipped: its sizes are for 4 KiB pages, this machine's are $(getconf PAGESIZE) bytes"
  fi
  # 200 KiB taken: the run's only save, its last, does not fit; the file is deleted once that
  # is reported, and the run, waiting for room, writes the step again and ends saved.
  small ckpt_last_room 200 --steps 1
  [[ $RC -eq 0 ]] && grep -q "checkpoint step 1 not saved: rank 0 on" "$T/ckpt_last_room.err" &&
    grep -q "the run's last checkpoint, of step 1, is saved: written again after [0-9]* s" \
      "$T/ckpt_last_room.err" && [[ $(head -1 "$T/small/ckpt_last_room.ls") == step-00000001 ]] &&
    grep -q "^shard" "$T/small/ckpt_last_room.ls" &&
    ok "ckpt_last_room: the last save did not fit, room came, the step written again and committed" ||
    bad "ckpt_last_room: exit $RC; $(grep -c 'not saved' "$T/ckpt_last_room.err") not saved; $(tr '\n' ' ' <"$T/small/ckpt_last_room.ls")"
  small ckpt_fits 0 --steps 6 --keep 1
  [[ $RC -eq 0 ]] && ! grep -q "free, but" "$T/ckpt_fits.err" &&
    ok "--keep 1: the same run fits, no warning" || bad "--keep 1 on 256 KiB: exit $RC"
else
  ok "skipped: no mount namespace here (unshare -rm) for a small checkpoint filesystem"
fi

# ------------------------------------------------------------------------------------------
# Divergence: a huge learning rate makes the loss non-finite
# ------------------------------------------------------------------------------------------
run nan "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 6 --lr 1e30 --save-every 1 \
  --ckpt-dir "$T/nan" --metrics "$T/nan.jsonl"
expect_error nan nonzero "non-finite" "step "
bad_step=$(grep -o 'step [0-9]*: loss' "$T/nan.err" | head -1 | grep -o '[0-9]*')
if [[ -n $bad_step ]]; then
  bad_dir=$(printf '%s/nan/step-%08d' "$T" "$bad_step")
  if [[ -e $bad_dir ]]; then
    bad "a checkpoint was written for the diverged step $bad_step"
  else
    ok "no checkpoint for the diverged step $bad_step"
  fi
  newer=$(cd "$T/nan" 2>/dev/null && ls -d step-* 2>/dev/null | sed 's/step-0*//' |
    awk -v s="$bad_step" '$1 >= s' | head -1)
  [[ -z $newer ]] && ok "no checkpoint at or after step $bad_step" || bad "checkpoint step $newer exists"
  # and every checkpoint that was committed holds finite numbers only
  if $PY - "$T/nan" <<'EOF'; then
import glob, math, struct, sys
for path in glob.glob(sys.argv[1] + "/step-*/shard-*.bin"):
    raw = open(path, "rb").read()[256:]
    vals = struct.unpack("<%df" % (len(raw) // 4), raw)
    assert all(math.isfinite(v) for v in vals), path
EOF
    ok "committed checkpoints before the divergence are finite"
  else
    bad "a committed checkpoint holds non-finite values"
  fi
  lines=$(wc -l <"$T/nan.jsonl")
  [[ $lines -eq $((bad_step - 1)) ]] && ok "metrics stop before the diverged step" ||
    bad "metrics has $lines lines for divergence at step $bad_step"
else
  bad "could not find the diverged step in stderr"
fi

# ------------------------------------------------------------------------------------------
# Bad flags: exit 2 with a message naming the flag
# ------------------------------------------------------------------------------------------
run flag_batch "$TRAIN" --train "$DATA" --batch abc
expect_error flag_batch 2 "--batch" "expected an integer, got 'abc'"
run flag_batch_trailing "$TRAIN" --train "$DATA" --batch 4x
expect_error flag_batch_trailing 2 "--batch" "got '4x'"
run flag_schedule "$TRAIN" --train "$DATA" --schedule foo
expect_error flag_schedule 2 "--schedule" "expected constant, cosine, linear or wsd, got 'foo'"
run flag_decay "$TRAIN" --train "$DATA" "${MODEL[@]}" --schedule wsd --decay-frac 0 --steps 1
expect_error flag_decay 1 "--decay-frac" "must be in (0, 1]"
run flag_lr "$TRAIN" --train "$DATA" --lr nan
expect_error flag_lr 2 "--lr" "expected a number, got 'nan'"
run flag_skip "$TRAIN" --train "$DATA" --skip-steps 3,0
expect_error flag_skip 2 "--skip-steps" "step numbers >= 1 or S:N (N steps from S), comma-separated, got '3,0'"
run flag_skip_empty "$TRAIN" --train "$DATA" --skip-steps 3,,4
expect_error flag_skip_empty 2 "--skip-steps" "comma-separated, got '3,,4'"
# However many rollbacks a job has had (max_restarts has no bound): 300 steps, of which step 2
# is taken without an update (a fixed array of 256 once refused the list).
SKIPS=2$(seq -s , 1000 1298 | sed 's/^/,/')
run skip_many "$TRAIN" --train "$DATA" "${MODEL[@]}" --steps 3 --skip-steps "$SKIPS" \
  --metrics "$T/skip.jsonl"
if [[ $RC -eq 0 ]] && grep -q "step     2/3 | skipped: no update" "$T/skip_many.err" &&
  [[ $(grep -c '"loss"' "$T/skip.jsonl") -eq 2 ]]; then
  ok "--skip-steps with 300 steps: step 2 skipped, 2 steps trained"
else
  bad "--skip-steps with 300 steps: exit $RC"
  tail -5 "$T/skip_many.err"
fi
run flag_unknown "$TRAIN" --train "$DATA" --frobnicate 3
expect_error flag_unknown 2 "--frobnicate" "unknown"
run flag_missing_arg "$TRAIN" --train "$DATA" --steps
expect_error flag_missing_arg 2 "--steps" "option"
run flag_init "$TRAIN" --train "$DATA" --init bogus
expect_error flag_init 2 "--init" "expected llmc:PATH, hf:DIR, ckpt:DIR or seed:N"
run flag_extra "$TRAIN" --train "$DATA" stray
expect_error flag_extra 2 "stray" "unexpected argument"

# A value the option parser takes but the run's validation refuses (as --precision): exit 1.
run flag_attention "$TRAIN" --train "$DATA" --attention sdpa
expect_error flag_attention 1 "--attention" "expected flash or materialized"
# A model-parallel layout started as one process: how to start its ranks.
run flag_tp_alone "$TRAIN" --train "$DATA" --tp 2
expect_error flag_tp_alone 1 "does not divide WORLD_SIZE 1" "start one distrain-train per rank"

echo "$CHECKS checks, $FAILS failed"
[[ $FAILS -eq 0 ]]
