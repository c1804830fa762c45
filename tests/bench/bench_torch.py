"""PyTorch CPU throughput baseline for distrain (workload gpt-tiny).

Trains the reference GPT-2 of tests/numerics/gpt2_ref.py (the same model the golden files
come from) in float32: L=4, NH=4, C=256, V=8192 (Vp 8192), maxT=256, B=8, T=256,
AdamW(lr 3e-4, betas 0.9/0.95, eps 1e-8, wd 0), constant lr, no clipping, one micro-batch
per step, random init from seed 1337, data from an llm.c token shard read in sequential
windows (wrapping to the start when exhausted).

A step is timed from zero_grad to the end of optimizer.step(). One line per step goes to
stderr; at the end one JSON line goes to stdout:
  {"impl": "pytorch", "threads": N, "median_ms": ..., "tokens_per_s": ..., "peak_rss_mb": ...}
median_ms is over 1-based steps 3..steps (the first two are warm-up), tokens_per_s =
B*T*1000/median_ms, peak_rss_mb = ru_maxrss (KiB) / 1024.

    /usr/bin/python3 tests/bench/make_tokens.py --out /tmp/bench.bin --tokens 50000 --vocab 8192
    /usr/bin/python3 tests/bench/bench_torch.py --train /tmp/bench.bin --threads 2
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "numerics"))
import gpt2_ref as ref  # noqa: E402

WORKLOAD = dict(maxT=256, V=8192, L=4, NH=4, C=256)
B, T = 8, 256
LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.0
WARMUP_STEPS = 2


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", required=True, help="llm.c token shard (tokens < 8192)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps (> 2)")
    ap.add_argument("--seed", type=int, default=1337, help="init seed")
    args = ap.parse_args()
    if args.steps <= WARMUP_STEPS:
        ap.error("--steps must exceed %d" % WARMUP_STEPS)

    torch.set_num_threads(args.threads)
    tokens = ref.read_tokens(args.train)
    if tokens.max() >= WORKLOAD["V"]:
        sys.exit("bench_torch: token %d out of range for V=%d" % (tokens.max(), WORKLOAD["V"]))
    if len(tokens) < B * T + 1:
        sys.exit("bench_torch: shard has fewer than B*T+1 = %d tokens" % (B * T + 1))

    cfg = ref.GPT2Config(**WORKLOAD)
    model = ref.GPT2(cfg)
    model.init_weights(args.seed)
    opt = ref.make_optimizer(model, LR, BETAS, EPS, WD)
    loader = ref.SequentialLoader(tokens, B, T, wrap=True)

    times_ms = []
    for s in range(args.steps):
        t0 = time.perf_counter()
        loss, _, norm = ref.train_step(model, opt, loader, s, 1, 0.0, LR)
        dt = (time.perf_counter() - t0) * 1000.0
        times_ms.append(dt)
        print("step %d/%d loss %.6f norm %.4f %.1f ms %.0f tok/s"
              % (s + 1, args.steps, loss, norm, dt, B * T * 1000.0 / dt), file=sys.stderr)

    median_ms = statistics.median(times_ms[WARMUP_STEPS:])
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps({"impl": "pytorch", "threads": args.threads,
                      "median_ms": round(median_ms, 3),
                      "tokens_per_s": round(B * T * 1000.0 / median_ms, 1),
                      "peak_rss_mb": round(peak_rss_mb, 1)}))


if __name__ == "__main__":
    main()
