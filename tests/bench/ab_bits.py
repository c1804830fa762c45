"""A/B of numerics: two builds of distrain-train (before and after a change that must not move
a bit: a kernel fused, a buffer stored in another form) on the same short jobs, in several
layouts; every step's loss and gradient norm must be equal, bit for bit (the metrics file's
floats round-trip). Prints one line per layout and exits 1 when any differs.

    /usr/bin/python3 tests/bench/ab_bits.py --a /tmp/old/build --b build [--precision bf16]
        [--steps 12] [--only flash,tp2sp]

The A build is typically a git worktree of the base revision, built with -DDT_CUDA=OFF and
only its distrain-train target. Release builds on both sides: a Debug build vectorises
differently (tanhf, sums), so its bits differ for that reason alone."""

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import test_dp as dp  # noqa: E402  (the launcher, the arguments and the metrics reader)

LAYOUTS = [  # name, world, batch, flags
    ("flash", 1, 4, []),
    ("materialized", 1, 4, ["--attention", "materialized"]),
    ("recompute", 1, 4, ["--recompute"]),
    ("remote", 1, 4, ["--device", "cpu-remote"]),
    ("tp2", 2, 8, ["--tp", "2"]),
    ("tp2sp", 2, 8, ["--tp", "2", "--sp"]),
    ("pp2", 2, 8, ["--pp", "2", "--grad-accum", "2"]),
    ("cp2", 2, 8, ["--cp", "2"]),
    ("zero1", 2, 4, ["--zero-stage", "1"]),
    ("zero2", 2, 4, ["--zero-stage", "2"]),
    ("zero3", 2, 4, ["--zero-stage", "3"]),
]


def run(build, world, batch, flags, steps):
    dp.BUILD = os.path.abspath(build)
    tmp = tempfile.mkdtemp(prefix="ab_bits_")
    metrics = os.path.join(tmp, "metrics.jsonl")
    kv = tempfile.mkdtemp(prefix="kv_", dir=tmp)
    outs = dp.wait_all(dp.launch(world, lambda r: dp.base_args(batch, 1, metrics, steps) + flags,
                                 kv), timeout=600)
    for rc, _, err in outs:
        if rc != 0:
            return "failed: " + err.strip()[-300:]
    return [(m["loss"], m.get("grad_norm")) for m in dp.read_metrics(metrics)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="build directory before the change")
    ap.add_argument("--b", required=True, help="build directory after the change")
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--only", default="", help="comma-separated layout names")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    differ = 0
    for name, world, batch, flags in LAYOUTS:
        if only and name not in only:
            continue
        flags = ["--precision", args.precision] + flags
        a = run(args.a, world, batch, flags, args.steps)
        b = run(args.b, world, batch, flags, args.steps)
        same = isinstance(a, list) and a == b and len(a) == args.steps
        differ += not same
        detail = "" if same else "  A %s\n  B %s" % (str(a)[:200], str(b)[:200])
        print("%-13s %s%s" % (name, "same bits" if same else "DIFFERENT", detail and "\n" + detail))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
