"""Benchmark: the pipeline bubble, measured against (p - 1) / (v m + p - 1).

Runs distrain-train as p pipeline stages (one process each, one compute thread, rendezvous
through a temporary DISTRAIN_KV_DIR) on a balanced model, m micro-batches per step, under GPipe,
1F1B and interleaved 1F1B with v = 2 model chunks per stage (v = 1 for the others). Balanced:
8 layers of C256 per stage and a vocabulary of 128, so that the last stage's LM head, final
LayerNorm and loss add about 1% to its last chunk's work (with 4 layers and a vocabulary of
256 they added 4-5% to an interleaved chunk, and every stage before it waited that long per
micro-batch). The "imbalance" column is the measured spread of the stages' compute time
(slowest / fastest - 1), which also holds the run-to-run noise of the machine.
Each stage reports the share of its pipeline time it spent waiting for its neighbours. The
table prints the first stage's next to the ideal bubble (as the per-step metrics do), and the
other stages' range: a step's pipeline ends, for the whole pipeline, with the first stage's last
backward pass (the flush), while a later stage's pipeline time ends with its own last transfer,
so its wait for the flush falls in the step's next collective and the pipeline time undercounts
it (gpipe p=2 m=4: first stage 21.9%, second 8.7%, ideal 20%). Waiting includes the
point-to-point transfers themselves (loopback TCP here).

A stage needs a core of its own for its waiting time to mean anything: with p stages on
fewer cores, stages also wait for the CPU, and the row is marked "oversubscribed". When the
cores suffice, stage r is pinned to the r-th core this process may use (its compute thread
and its communicator's threads alike), as a trainer per device is pinned on a GPU node:
unpinned, the scheduler moves the stages' threads between cores, and every move shows up as
waiting at the next exchange (measured here: interleaved p=2 m=16 at 13% unpinned against 6.8%
pinned, for an ideal 3.0%).

    /usr/bin/python3 tests/bench/bench_pipeline.py --build build [--stages 2 4] [--micro 4 8 16]
        [--schedules gpipe 1f1b interleaved] [--require-cores N]

--require-cores N exits 77 (skipped) where fewer than N cores are allowed: tests/gpu/run.sh
runs it so on the GPU machines (16 cores), whose p = 4 rows this 2-core machine cannot give.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS_PER_STAGE, VOCAB = 8, 128


def pin_to(cpu):
    """In the child before exec: run on that core only (left unpinned where the kernel refuses)."""
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        pass


def run(build, shard, p, m, schedule, steps, tmp, chunks, cpus):
    kv = tempfile.mkdtemp(prefix="kv_p%d_m%d_%s_" % (p, m, schedule), dir=tmp)
    cmd = [os.path.join(build, "worker", "trainer", "distrain-train"), "--init", "seed:1",
           "--layers", str(LAYERS_PER_STAGE * p), "--heads", "4", "--channels", "256",
           "--vocab", str(VOCAB),
           "--max-seq", "128", "--train", shard, "--batch", "2", "--seq", "128",
           "--grad-accum", str(m), "--steps", str(steps), "--lr", "1e-4", "--threads", "1",
           "--quiet", "--pp", str(p), "--pp-schedule", schedule]
    if chunks > 1:
        cmd += ["--pp-virtual", str(chunks)]
    procs = []
    for r in range(p):
        env = dict(os.environ, WORLD_SIZE=str(p), RANK=str(r), DISTRAIN_KV_DIR=kv,
                   OMP_NUM_THREADS="1", DISTRAIN_COMM_HOST="127.0.0.1")
        pin = (lambda c=cpus[r]: pin_to(c)) if p <= len(cpus) else None
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, preexec_fn=pin,
                                      stderr=subprocess.PIPE, text=True))
    bubbles, busy = [], []
    for r, proc in enumerate(procs):
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            sys.exit("stage %d failed:\n%s" % (r, err[-2000:]))
        found = re.search(r"busy ([\d.]+) ms.*bubble ([\d.]+)%", err)
        busy.append(float(found.group(1)))
        bubbles.append(float(found.group(2)))
    return bubbles, 100.0 * (max(busy) / min(busy) - 1.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--require-cores", type=int, default=0)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    cores = len(cpus)
    if cores < args.require_cores:
        print("bench_pipeline: %d cores here, %d required: skipped" % (cores, args.require_cores))
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        shard = os.path.join(tmp, "tokens.bin")
        subprocess.run([sys.executable, os.path.join(HERE, "make_tokens.py"), "--out", shard,
                        "--tokens", "2000000", "--vocab", str(VOCAB), "--seed", "0"], check=True,
                       stdout=subprocess.DEVNULL)
        print("pipeline bubble: stages p, micro-batches m; %d layers per stage of C256, "
              "vocabulary %d, batch 2 x 128 per micro-batch; %d cores"
              % (LAYERS_PER_STAGE, VOCAB, cores))
        print("%-3s %-4s %-14s %9s %11s %18s %12s" % ("p", "m", "sched", "ideal %", "measured %",
                                                      "later stages %", "imbalance %"))
        for p in args.stages:
            for m in args.micro:
                for schedule in args.schedules:
                    v = 2 if schedule == "interleaved" else 1
                    if m % p and v > 1:
                        continue  # interleaving takes micro-batches in groups of p
                    b, imbalance = run(args.build, shard, p, m, schedule, args.steps, tmp, v,
                                       cpus)
                    ideal = 100.0 * (p - 1) / (v * m + p - 1)
                    print("%-3d %-4d %-14s %9.1f %11.1f %12.1f-%-5.1f %12.1f %s" % (
                        p, m, schedule + (" v=%d" % v if v > 1 else ""), ideal, b[0],
                        min(b[1:]), max(b[1:]), imbalance,
                        "oversubscribed" if p > cores else "pinned"), flush=True)


if __name__ == "__main__":
    main()
