"""Benchmark: how long a checkpoint save stalls training, synchronous vs asynchronous.

Workload gpt-tiny (L4 H4 C256 V8192, B8 T256, fp32 AdamW: 3.3M parameters, a 40 MiB shard
with the optimizer state), one process, a checkpoint every --every steps. Synchronous
(--ckpt-sync): the step writes and commits its shard (the stall is the whole save, from the
trainer's "written and committed in X ms" line). Asynchronous (the default): the step
snapshots its shard and a thread writes and commits it (the stall is "the step paused X ms",
which includes waiting for the previous save if it is still running). Also printed: the
median step time with and without saves in flight, and the total run time of each mode.
The checkpoint directory is on --dir (default: a temporary directory; pass a directory on the
disk you care about).

    /usr/bin/python3 tests/bench/bench_ckpt.py --build build [--steps 40] [--every 5] [--dir D]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
B, T, V = 8, 256, 8192


def run(build, shard, steps, every, ckpt, sync, threads):
    metrics = os.path.join(os.path.dirname(ckpt), "metrics-%s.jsonl" % ("sync" if sync else "async"))
    cmd = [os.path.join(build, "worker/trainer/distrain-train"), "--seed", "1337",
           "--layers", "4", "--heads", "4", "--channels", "256", "--vocab", str(V),
           "--max-seq", "256", "--train", shard, "--batch", str(B), "--seq", str(T),
           "--steps", str(steps), "--lr", "3e-4", "--threads", str(threads),
           "--ckpt-dir", ckpt, "--save-every", str(every), "--keep", "2", "--metrics", metrics]
    cmd += ["--ckpt-sync"] if sync else []
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit("bench_ckpt: the trainer failed:\n" + p.stdout[-3000:])
    pat = (r"checkpoint step \d+: written and committed in ([\d.]+) ms" if sync else
           r"checkpoint step \d+: the step paused ([\d.]+) ms")
    stalls = [float(x) for x in re.findall(pat, p.stdout)]
    writes = [float(x) for x in re.findall(r"written and committed(?: in the background)? in "
                                           r"([\d.]+) ms", p.stdout)]
    ms = [json.loads(line)["ms"] for line in open(metrics) if '"ms"' in line]
    return {"mode": "sync" if sync else "async", "saves": len(stalls),
            "stall_ms_median": round(statistics.median(stalls), 1),
            "stall_ms_max": round(max(stalls), 1),
            "write_ms_median": round(statistics.median(writes), 1),
            "step_ms_median": round(statistics.median(ms[2:]), 1), "wall_s": round(wall, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build", help="CMake build directory")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", help="where the checkpoints go (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        shard = os.path.join(tmp, "tokens.bin")
        subprocess.run([sys.executable, os.path.join(HERE, "make_tokens.py"), "--out", shard,
                        "--tokens", str(args.steps * B * T + 1 + 4096), "--vocab", str(V),
                        "--seed", "0"], check=True, stdout=subprocess.DEVNULL)
        rows = [run(args.build, shard, args.steps, args.every, os.path.join(tmp, "ckpt-" + m),
                    m == "sync", args.threads) for m in ("sync", "async")]
    print("workload gpt-tiny (L4 H4 C256 V8192, B8 T256, fp32 AdamW), a save every %d of %d "
          "steps, %d threads" % (args.every, args.steps, args.threads))
    print("%-6s %6s %16s %13s %15s %14s %8s" % ("mode", "saves", "stall ms median",
                                                 "stall ms max", "write ms median",
                                                 "step ms median", "wall s"))
    for r in rows:
        print("%-6s %6d %16.1f %13.1f %15.1f %14.1f %8.2f" % (
            r["mode"], r["saves"], r["stall_ms_median"], r["stall_ms_max"], r["write_ms_median"],
            r["step_ms_median"], r["wall_s"]))
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
