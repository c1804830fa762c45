"""Benchmark: text generation (distrain-train --sample) through the key/value cache against
whole windows (--sample-no-cache), side by side in one run.

The model: random init, L=6, NH=6, C=384, V=8192 (the shapes are flags), a window of --seq
positions; the prompt is the first 32 tokens of a random-token shard; --sample N tokens
follow, greedy (--sample-top-k 1), so both runs print the same tokens (checked). The figure
is the wall time of the whole run (start-up and the prompt included) and the generated
tokens a second; each run is repeated --rounds times and the fastest kept. Exits 77 where
--device cuda finds no GPU, or the build has no CUDA (tests/gpu/run.sh runs it on a GPU: GPT-2
124M's shape in bf16).

    /usr/bin/python3 tests/bench/bench_sample.py --build build [--seq 1024] [--sample 480] \
        [--device cpu|cuda] [--precision fp32|bf16] [--cp N]

--cp N runs N context-parallel ranks (local processes, --threads each; the time is the slowest
rank's, the text rank 0's).
"""

import argparse
import array
import os
import random
import re
import subprocess
import sys
import tempfile
import time



def write_shard(path, n, vocab):
    """An llm.c token shard of n random tokens (make_tokens.py's format, without numpy: the
    GPU machine's bundle runs this with whatever python3 it has)."""
    rng = random.Random(1)
    with open(path, "wb") as f:
        f.write(array.array("i", [20240520, 1, n] + [0] * 253).tobytes())
        f.write(array.array("H", [rng.randrange(vocab) for _ in range(n)]).tobytes())


def run(cmd, ranks, tmp):
    """(seconds, the sample's text) of one run of `ranks` processes (rank 0's text)."""
    kv = tempfile.mkdtemp(prefix="kv_", dir=tmp)  # the ranks' rendezvous, a fresh one a run
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, WORLD_SIZE=str(ranks), RANK=str(r),
                                       DISTRAIN_KV_DIR=kv)) for r in range(ranks)]
    outs = [q.communicate() for q in procs]
    dt = time.perf_counter() - t0
    p = subprocess.CompletedProcess(cmd, max(q.returncode for q in procs), *outs[0])
    if ranks > 1 and p.returncode != 0:
        p.stderr = "\n".join(err for _, err in outs)
    if p.returncode != 0 and ("no usable CUDA GPU" in p.stderr or
                              "was built without CUDA" in p.stderr):
        print("no GPU (or a build without CUDA): skipped")
        sys.exit(77)
    if p.returncode != 0:
        raise SystemExit("bench_sample: %s exited with %d:\n%s" % (cmd[0], p.returncode,
                                                                  p.stderr[-2000:]))
    m = re.search(r"---- sample .*?---- end of sample ----", p.stdout, re.S)
    if not m:
        raise SystemExit("bench_sample: no sample in the output:\n" + p.stdout[-2000:])
    return dt, m.group(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--channels", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--sample", type=int, default=480)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--cp", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dt-bench-sample-") as tmp:
        shard = os.path.join(tmp, "val.bin")
        write_shard(shard, 4 * args.seq, args.vocab)
        cmd = [os.path.join(args.build, "worker/trainer/distrain-train"), "--steps", "0",
               "--init", "seed:1", "--layers", str(args.layers), "--heads", str(args.heads),
               "--channels", str(args.channels), "--vocab", str(args.vocab), "--max-seq",
               str(args.seq), "--val", shard, "--batch", "1", "--seq", str(args.seq),
               "--sample", str(args.sample), "--sample-top-k", "1", "--threads",
               str(args.threads), "--device", args.device, "--precision", args.precision,
               "--quiet"] + (["--cp", str(args.cp)] if args.cp > 1 else [])
        print("model L%d NH%d C%d V%d, window %d, prompt 32 + %d tokens, greedy, %s %s, %d "
              "threads%s" % (args.layers, args.heads, args.channels, args.vocab, args.seq,
                             args.sample, args.device, args.precision, args.threads,
                             " x %d context-parallel ranks" % args.cp if args.cp > 1 else ""))
        best, texts = {}, {}
        for _ in range(args.rounds):
            for name, extra in (("key/value cache", []), ("whole windows", ["--sample-no-cache"])):
                dt, texts[name] = run(cmd + extra, args.cp, tmp)
                best[name] = min(best.get(name, dt), dt)
        if len(set(texts.values())) != 1:
            raise SystemExit("bench_sample: the two runs printed different tokens")
        for name, dt in best.items():
            print("%-16s %8.2f s  %8.1f tokens/s" % (name, dt, args.sample / dt))
        print("speed-up %.1fx" % (best["whole windows"] / best["key/value cache"]))


if __name__ == "__main__":
    main()
