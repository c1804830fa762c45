"""Benchmark: data parallelism, distrain vs PyTorch DDP (gloo), side by side in one run.

Workload gpt-tiny (L4 H4 C256 V8192, maxT 256), global batch 8 x T 256 split over dp=2
processes (4 sequences each), fp32 AdamW (lr 3e-4), 1 compute thread per process on this
2-core machine. distrain ranks rendezvous through a shared directory (DISTRAIN_KV_DIR), as
under a launcher; PyTorch runs torch.nn.parallel.DistributedDataParallel over gloo with the
reference model of tests/numerics/gpt2_ref.py. Reported: median ms/step over steps 3..N and
tokens/s (global), and for distrain the fraction of the step spent in exposed (not
overlapped) communication, from the trainer's per-step "comm_ms".

    /usr/bin/python3 tests/bench/bench_dp.py --build build [--steps 20] [--zero 0 ...]
        [--overlap -1 ...]   (DISTRAIN_DP_OVERLAP: -1 auto, 0 off, 1 comm thread)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
B_RANK, T, V, WORLD = 4, 256, 8192, 2
OMP_BLAS = "/usr/lib/x86_64-linux-gnu/openblas-openmp"
RUN_TIMEOUT_S = 300


def wait(p):
    """Waits for a rank, at most RUN_TIMEOUT_S: a run that hangs fails the benchmark."""
    try:
        return p.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        raise SystemExit("bench_dp: a rank ran longer than %d s" % RUN_TIMEOUT_S)


def make_shard(path, tokens):
    subprocess.run([sys.executable, os.path.join(HERE, "make_tokens.py"), "--out", path,
                    "--tokens", str(tokens), "--vocab", str(V), "--seed", "0"], check=True,
                   stdout=subprocess.DEVNULL)


def bench_distrain(build, shard, steps, zero, overlap, tmp):
    tag = "z%d_o%d" % (zero, overlap)
    kv = tempfile.mkdtemp(prefix="kv_" + tag, dir=tmp)  # fresh per run: no stale addresses
    metrics = os.path.join(tmp, "dp_metrics_%s.jsonl" % tag)
    args = [os.path.join(build, "worker/trainer/distrain-train"), "--seed", "1337", "--layers",
            "4", "--heads", "4", "--channels", "256", "--vocab", str(V), "--max-seq", "256",
            "--train", shard, "--batch", str(B_RANK), "--seq", str(T), "--steps", str(steps),
            "--lr", "3e-4", "--threads", "1", "--zero-stage", str(zero), "--metrics", metrics,
            "--quiet"]
    procs = []
    for r in range(WORLD):
        # Both implementations' ranks connect over loopback, whatever the host name resolves to
        # (DISTRAIN_COMM_HOST here, GLOO_SOCKET_IFNAME for PyTorch's gloo).
        env = dict(os.environ, WORLD_SIZE=str(WORLD), RANK=str(r), DISTRAIN_KV_DIR=kv,
                   OMP_NUM_THREADS="1", DISTRAIN_DP_OVERLAP=str(overlap),
                   DISTRAIN_COMM_HOST="127.0.0.1", DISTRAIN_COMM_TIMEOUT_MS="60000")
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    for p in procs:
        if wait(p) != 0:
            raise SystemExit("bench_dp: distrain-train failed (exit %s)" % p.returncode)
    rows = [json.loads(line) for line in open(metrics) if '"loss"' in line][2:]
    med = statistics.median(r["ms"] for r in rows)
    exposed = statistics.median(r["comm_ms"] / r["ms"] for r in rows)
    return {"impl": "distrain", "zero": zero, "overlap": overlap, "median_ms": round(med, 2),
            "tokens_per_s": round(WORLD * B_RANK * T * 1000.0 / med, 1),
            "exposed_comm_frac": round(exposed, 3)}


TORCH_WORKER = r"""
import os, sys, time, statistics, json
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import gpt2_ref as ref
rank, world, init, shard, steps = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
cfg = ref.GPT2Config(maxT=256, V=8192, L=4, NH=4, C=256)
model = ref.GPT2(cfg); model.init_weights(1337)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
tokens = torch.from_numpy(ref.read_tokens(shard).astype("int64"))
B, T = %d, %d
times = []
for s in range(steps):
    t0 = time.perf_counter()
    off = ((s * world + rank) * B * T) %% (len(tokens) - B * T - 1)
    x = tokens[off:off + B * T].view(B, T); y = tokens[off + 1:off + B * T + 1].view(B, T)
    opt.zero_grad(set_to_none=True)
    _, loss = ddp(x, y)
    loss.backward()
    opt.step()
    times.append((time.perf_counter() - t0) * 1000.0)
if rank == 0:
    print(json.dumps({"median_ms": statistics.median(times[2:])}))
""" % (B_RANK, T)


def bench_torch(shard, steps, tmp):
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    script = os.path.join(tmp, "ddp_worker.py")
    with open(script, "w") as f:
        f.write(TORCH_WORKER)
    init = os.path.join(tmp, "ddp_init")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    if os.path.isdir(OMP_BLAS):  # PyTorch's best BLAS setup here (see bench_train.py)
        env["LD_LIBRARY_PATH"] = OMP_BLAS + ":" + env.get("LD_LIBRARY_PATH", "")
    ref_dir = os.path.join(HERE, "..", "numerics")
    procs = [subprocess.Popen([sys.executable, script, ref_dir, str(r), str(WORLD), init, shard,
                               str(steps)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for r in range(WORLD)]
    outs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("bench_dp: the PyTorch DDP run failed")
    med = json.loads(outs[0].strip().splitlines()[-1])["median_ms"]
    return {"impl": "pytorch-ddp-gloo", "median_ms": round(med, 2),
            "tokens_per_s": round(WORLD * B_RANK * T * 1000.0 / med, 1)}


def median_row(rows):
    """The run with the median ms/step among rounds of one configuration."""
    return sorted(rows, key=lambda r: r["median_ms"])[(len(rows) - 1) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--zero", type=int, nargs="+", default=[0])
    ap.add_argument("--overlap", type=int, nargs="+", default=[-1],
                    help="DISTRAIN_DP_OVERLAP values: -1 auto, 0 off, 1 comm thread")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternate the configurations this many times; report each one's "
                         "median over rounds (load from other tenants drifts over minutes)")
    args = ap.parse_args()
    configs = [(z, o) for z in args.zero for o in args.overlap]
    runs = {c: [] for c in configs}
    torch_runs = []
    with tempfile.TemporaryDirectory() as tmp:
        shard = os.path.join(tmp, "tokens.bin")
        make_shard(shard, args.steps * WORLD * B_RANK * T + 1 + 4096)
        for _ in range(args.rounds):
            for z, o in configs:
                runs[(z, o)].append(bench_distrain(args.build, shard, args.steps, z, o, tmp))
                print("# " + json.dumps(runs[(z, o)][-1]), file=sys.stderr, flush=True)
            t = bench_torch(shard, args.steps, tmp)
            if t:
                torch_runs.append(t)
                print("# " + json.dumps(t), file=sys.stderr, flush=True)
    rows = [median_row(runs[c]) for c in configs]
    t = median_row(torch_runs) if torch_runs else None
    print("workload gpt-tiny, dp=%d x 1 thread, global batch %d x %d, median of steps 3..%d, "
          "median of %d alternating rounds" % (WORLD, WORLD * B_RANK, T, args.steps, args.rounds))
    print("%-18s %6s %8s %10s %10s %14s" % ("impl", "zero", "overlap", "ms/step", "tokens/s",
                                             "exposed comm"))
    for r in rows:
        print("%-18s %6d %8d %10.1f %10.1f %13.1f%%" % (r["impl"], r["zero"], r["overlap"],
                                                         r["median_ms"], r["tokens_per_s"],
                                                         100 * r["exposed_comm_frac"]))
    if t:
        print("%-18s %6s %8s %10.1f %10.1f %14s" % (t["impl"], "-", "-", t["median_ms"],
                                                    t["tokens_per_s"], "-"))
        print("speedup distrain (zero %d) / pytorch ddp: %.2fx"
              % (rows[0]["zero"], rows[0]["tokens_per_s"] / t["tokens_per_s"]))
    for r in rows + ([t] if t else []):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
