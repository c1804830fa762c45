"""torch.distributed (gloo backend) all-reduce bandwidth: the baseline for bench_allreduce.

Runs `world` processes on this host (torch.multiprocessing, init_method file://), and for each
size (1, 16, 64 MiB of float32 by default) does warm-up iterations, then `iters` timed ones,
each a barrier and then `inner` back-to-back all-reduces timed together on rank 0; the median
per-operation time is reported. Bandwidths
follow nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n (GB/s = 1e9 bytes/s).
A table goes to stderr and one JSON line per size to stdout, with the same keys as
bench_allreduce.c:
  {"bench": "all_reduce", "impl": "torch-gloo", "world": 2, "bytes": 1048576,
   "median_ms": ..., "algbw_gbps": ..., "busbw_gbps": ..., "cpu_ms": ...}
cpu_ms is rank 0's process CPU time (user + system, all threads, Gloo's included) per timed
iteration, barrier included.

    /usr/bin/python3 tests/bench/bench_allreduce_torch.py [--world 2] [--iters 10] [--inner 5]
        [--mib 1 16 64]
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def cpu_ms():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return (ru.ru_utime + ru.ru_stime) * 1e3


def run(rank, args, init_file):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=args.world)
    w = args.world
    if rank == 0:
        print(f"{'op':<14} {'impl':<15} {'world':>5} {'MiB':>8} {'median ms':>10} "
              f"{'algbw GB/s':>11} {'busbw GB/s':>11} {'cpu ms':>9}", file=sys.stderr)
    for mib in args.mib:
        n = (mib << 20) // 4
        n -= n % w
        x = torch.ones(n, dtype=torch.float32)
        times = []
        cpu0 = 0.0
        for it in range(args.warmup + args.iters):
            if it == args.warmup:
                cpu0 = cpu_ms()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.inner):
                dist.all_reduce(x)
            dt = (time.perf_counter() - t0) * 1e3 / args.inner
            if it >= args.warmup:
                times.append(dt)
        cpu = (cpu_ms() - cpu0) / (args.iters * args.inner)
        med = statistics.median(times)
        nbytes = n * 4
        algbw = nbytes / (med * 1e-3) / 1e9
        busbw = algbw * 2 * (w - 1) / w
        if rank == 0:
            print(f"{'all_reduce':<14} {'torch-gloo':<15} {w:>5} {nbytes / 2**20:>8.1f} "
                  f"{med:>10.3f} {algbw:>11.3f} {busbw:>11.3f} {cpu:>9.2f}", file=sys.stderr)
            print(json.dumps({"bench": "all_reduce", "impl": "torch-gloo", "world": w,
                              "bytes": nbytes, "median_ms": round(med, 4),
                              "algbw_gbps": round(algbw, 4), "busbw_gbps": round(busbw, 4),
                              "cpu_ms": round(cpu, 3)}),
                  flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mib", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    # Same conditions as bench_allreduce: loopback, and no intra-op thread pool competing with
    # the two processes for the cores.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="dt-bench-torch-") as tmp:
        mp.spawn(run, args=(args, os.path.join(tmp, "init")), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
