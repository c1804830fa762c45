"""Benchmark: one distrain-train workload on two builds (A: before a change, B: after), in
alternating rounds, for the "no regression within 3%" checks of a change on a shared machine.

Each round runs both builds once, in alternating order (A first in even rounds), with
bench_train.py's gpt-tiny workload (its bench_distrain: L4 NH4 C256 V8192, B8 T256, the median
step over steps 3..N). It prints every run, then the median of each build's medians, B/A, and
in how many rounds B was faster. Single runs on a shared 2-core machine move by +-10%: trust
the median of 8 or more rounds, and read B/A within the spread as "no difference".

    git worktree add /tmp/ab-old <rev> && cmake -S /tmp/ab-old -B /tmp/ab-old/b -DDT_CUDA=OFF \\
        && cmake --build /tmp/ab-old/b -j2 --target distrain-train
    /usr/bin/python3 tests/bench/bench_ab.py --a /tmp/ab-old/b --b build [--rounds 8]

--a-args / --b-args add distrain-train flags to one side, so that one build can also be
compared with itself under two settings (--a build --b build --a-args "--attention
materialized").
"""

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_train as bt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="build directory before the change")
    ap.add_argument("--b", required=True, help="build directory after the change")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--a-args", default="", help="extra distrain-train flags for A")
    ap.add_argument("--b-args", default="", help="extra distrain-train flags for B")
    args = ap.parse_args()
    for d in (args.a, args.b):
        if not os.access(os.path.join(d, "worker/trainer/distrain-train"), os.X_OK):
            ap.error("%s has no worker/trainer/distrain-train" % d)
    ms = {"a": [], "b": []}
    with tempfile.TemporaryDirectory(prefix="dt_bench_ab_") as tmp:
        shard = os.path.join(tmp, "tokens.bin")
        subprocess.run([sys.executable, os.path.join(HERE, "make_tokens.py"), "--out", shard,
                        "--tokens", "200000", "--vocab", str(bt.V)], check=True,
                       stdout=subprocess.DEVNULL)
        for r in range(args.rounds):
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                run = tempfile.mkdtemp(dir=tmp)
                row = bt.bench_distrain(getattr(args, side), shard, args.threads, args.steps, run,
                                        shlex.split(getattr(args, side + "_args")))
                ms[side].append(row["median_ms"])
                print("round %d %s: %.1f ms/step" % (r, side.upper(), row["median_ms"]),
                      flush=True)
    med = {s: statistics.median(v) for s, v in ms.items()}
    faster = sum(1 for a, b in zip(ms["a"], ms["b"]) if b < a)
    for s in ("a", "b"):
        print("%s: median %.1f ms/step (runs %.1f..%.1f)" % (s.upper(), med[s], min(ms[s]),
                                                            max(ms[s])))
    print("B/A time %.3f; B faster in %d of %d rounds" % (med["b"] / med["a"], faster,
                                                         args.rounds))


if __name__ == "__main__":
    main()
