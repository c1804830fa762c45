"""Benchmark: distrain-train vs PyTorch on workload gpt-tiny, side by side in one run.

gpt-tiny: L=4, NH=4, C=256, V=8192, maxT=256, B=8, T=256, fp32 AdamW (lr 3e-4, betas
0.9/0.95, eps 1e-8, wd 0), random init, sequential windows of one random-token shard.
Both run the same number of steps with the same thread count; the figure is the median
step time over steps 3..N (the first two are warm-up), tokens/s = B*T*1000/median_ms, and
peak RSS of each process. PyTorch runs only when python3-torch is installed
(deploy/install-deps.sh --torch); use /usr/bin/python3.

    /usr/bin/python3 tests/bench/bench_train.py --build build [--threads 2] [--steps 20]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
B, T, V = 8, 256, 8192


def run_child(cmd, env=None):
    """Runs cmd; returns (stdout, peak RSS in MiB of exactly that child, from wait4)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit("bench_train: %s exited with %d" % (cmd[0], proc.returncode))
        out.seek(0)
        return out.read(), usage.ru_maxrss / 1024.0


def bench_distrain(build, shard, threads, steps, tmp, extra=()):
    metrics = os.path.join(tmp, "metrics.jsonl")
    cmd = [os.path.join(build, "worker/trainer/distrain-train"), "--seed", "1337",
           "--layers", "4", "--heads", "4", "--channels", "256", "--vocab", str(V),
           "--max-seq", "256", "--train", shard, "--batch", str(B), "--seq", str(T),
           "--steps", str(steps), "--lr", "3e-4", "--threads", str(threads),
           "--metrics", metrics, "--quiet"] + list(extra)
    _, rss = run_child(cmd)
    ms = [json.loads(line)["ms"] for line in open(metrics)]
    med = statistics.median(ms[2:])
    return {"impl": "distrain", "threads": threads, "median_ms": round(med, 3),
            "tokens_per_s": round(B * T * 1000.0 / med, 1), "peak_rss_mb": round(rss, 1)}


def bench_torch(shard, threads, steps):
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    # PyTorch's BLAS is whatever libblas.so.3 resolves to. Debian's default is the pthread
    # OpenBLAS, whose threads fight torch's OpenMP pool (1,650 tok/s here); the OpenMP build
    # is PyTorch's best configuration on these machines (2,970 tok/s), so compare against that.
    env = dict(os.environ)
    omp_blas = "/usr/lib/x86_64-linux-gnu/openblas-openmp"
    if os.path.isdir(omp_blas):
        env["LD_LIBRARY_PATH"] = omp_blas + ":" + env.get("LD_LIBRARY_PATH", "")
    out, rss = run_child([sys.executable, os.path.join(HERE, "bench_torch.py"), "--train", shard,
                          "--threads", str(threads), "--steps", str(steps)], env)
    res = json.loads(out.strip().splitlines()[-1])
    res["peak_rss_mb"] = round(rss, 1)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build", help="CMake build directory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shard = os.path.join(tmp, "tokens.bin")
        subprocess.run([sys.executable, os.path.join(HERE, "make_tokens.py"), "--out", shard,
                        "--tokens", str(args.steps * B * T + 1 + 4096), "--vocab", str(V),
                        "--seed", "0"], check=True, stdout=subprocess.DEVNULL)
        rows = [bench_distrain(args.build, shard, args.threads, args.steps, tmp)]
        torch_row = bench_torch(shard, args.threads, args.steps)
        if torch_row:
            rows.append(torch_row)
    print("workload gpt-tiny (L4 H4 C256 V8192, B8 T256, fp32 AdamW), %d threads, "
          "median of steps 3..%d" % (args.threads, args.steps))
    print("%-10s %12s %12s %14s" % ("impl", "ms/step", "tokens/s", "peak RSS MiB"))
    for r in rows:
        print("%-10s %12.1f %12.1f %14.1f" % (r["impl"], r["median_ms"], r["tokens_per_s"],
                                              r["peak_rss_mb"]))
    if torch_row:
        print("speedup distrain / pytorch: %.2fx" % (rows[0]["tokens_per_s"] /
                                                     torch_row["tokens_per_s"]))
    else:
        print("(python3-torch not installed: PyTorch not measured)")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
