"""Benchmark: distrain's bf16 flash attention kernels against PyTorch's scaled_dot_product_attention.

Runs tests/bench/bench_attention (the kernels alone on one GPU, each call timed by CUDA events)
at each shape, and PyTorch's causal SDPA in bf16 at the same shape, forward and backward (q, k
and v as views of one (B, T, 3C) tensor, as a GPT-2 layer makes them; the backward timed alone,
after its forward), under PyTorch's own choice of backend and under each of its FlashAttention-2
and cuDNN backends that runs here. distrain's backward is timed in both of its plans: the score
gradients kept for a dq kernel of one product (what the trainer runs) and the dq kernel that
recomputes them (its plan past T 32768). At head size 64 on a GPU of compute capability 9.0
(H100, H200), both passes are also timed on Hopper's wgmma ("distrain (wgmma)": the kernels
DISTRAIN_CUDA_WGMMA=1 turns on, the forward and the backward's dk/dv kernel).

TFLOP/s count as FlashAttention's papers do: a causal forward 2 B NH T^2 hs, the backward 2.5
times that. Each figure is the median of --iters calls after one warm-up call.

    python3 tests/bench/bench_attention.py --build build [--model gpt2-124m gpt2-1.5b]
        [--shape B,T,C,NH ...] [--iters 20] [--bin PATH] [--no-torch] [--check] [--ncu FILE]

--check fails (exit 1) unless each shape gave distrain's three passes with positive times (the
emulated GPU's smoke test runs it so; the wgmma rows are not required). Exit 77 where there is no GPU.

--ncu FILE: where Nsight Compute's ncu is installed (on PATH, under /usr/local/cuda or
/opt/nvidia), also profiles one call of each of distrain's attention kernels at the first shape
with a quarter of its batch (speed of light, occupancy, warp stall reasons, the shared-memory
and pipe tables: what bounds each kernel) into FILE; without ncu, or where the machine denies
access to the GPU's counters, FILE says so and the benchmark goes on.
"""

import argparse
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys

# Shapes as the 124M and 1.5B benchmarks train them (tests/bench/bench_gpu.py), at a batch whose
# backward fits one workspace group.
MODELS = {"gpt2-124m": (64, 1024, 768, 12), "gpt2-1.5b": (16, 1024, 1600, 25)}


def shape_arg(text):
    try:
        b, t, c, nh = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B,T,C,NH, got {text!r}")
    if min(b, t, c, nh) < 1 or c % nh:
        raise argparse.ArgumentTypeError(f"{text}: positive, and NH dividing C")
    return (b, t, c, nh)


def fwd_flop(b, t, c, nh):
    return 2.0 * b * nh * t * t * (c // nh)


def run_distrain(binary, shape, iters):
    """distrain's passes at shape: [(pass, plan, ms)], or None where there is no GPU."""
    proc = subprocess.run([binary, *map(str, shape), str(iters)], capture_output=True, text=True)
    if proc.returncode == 77:
        return None
    if proc.returncode != 0:
        sys.exit(f"{binary} {' '.join(map(str, shape))}: exit {proc.returncode}\n{proc.stderr}")
    rows = []
    for line in proc.stdout.splitlines():
        r = json.loads(line)
        rows.append((r["pass"], "distrain" + ("" if r["plan"] == "-" else f" ({r['plan']})"),
                     r["ms"]))
    return rows


def run_torch(shape, iters):
    """PyTorch's SDPA at shape under each backend that runs: [(pass, impl, ms)], and a note."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return [], "PyTorch is not installed"
    if not torch.cuda.is_available():
        return [], "PyTorch sees no GPU"
    if not hasattr(F, "scaled_dot_product_attention"):  # PyTorch 2.0 on
        return [], f"PyTorch {torch.__version__} has no scaled_dot_product_attention"
    b, t, c, nh = shape
    hs = c // nh
    qkv = torch.randn(b, t, 3 * c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, nh, t, hs, device="cuda", dtype=torch.bfloat16)

    def attend():
        q, k, v = (x.view(b, t, nh, hs).transpose(1, 2) for x in qkv.split(c, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def timed(fn, setup=lambda: None):
        """The median of iters timed calls fn(setup()), setup's work outside the events."""
        times = []
        for i in range(iters + 1):
            arg = setup()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(arg)
            end.record()
            end.synchronize()
            if i:
                times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    rows, notes = [], [f"PyTorch {torch.__version__}, {torch.cuda.get_device_name()}"]
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [("flash", [SDPBackend.FLASH_ATTENTION])]
        if hasattr(SDPBackend, "CUDNN_ATTENTION"):
            backends.append(("cudnn", [SDPBackend.CUDNN_ATTENTION]))
    except ImportError:
        backends = []
        notes.append("no torch.nn.attention: its own choice of backend only")
    for name, chosen in [("its choice", None)] + backends:
        label = f"torch sdpa ({name})"
        try:
            with sdpa_kernel(chosen) if chosen else contextlib.nullcontext():
                fwd = timed(lambda _: attend())
                bwd = timed(lambda out: torch.autograd.grad(out, qkv, dout), attend)
            rows += [("forward", label, fwd), ("backward", label, bwd)]
        except Exception as e:  # the backend does not take this shape or GPU, or none is left
            notes.append(f"sdpa {name}: {(str(e).splitlines() or [type(e).__name__])[0][:80]}")
    return rows, "; ".join(notes)


NCU_SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats",
                "MemoryWorkloadAnalysis_Tables", "ComputeWorkloadAnalysis")


def find_ncu():
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/usr/local/cuda*/bin/ncu",
                    "/opt/nvidia/nsight-compute/*/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def profile_kernels(binary, shape, path):
    """One call of each of distrain's attention kernels under ncu, its report into path."""
    ncu = find_ncu()
    b, t, c, nh = shape
    small = (max(1, b // 4), t, c, nh)
    with open(path, "w") as f:
        if not ncu:
            f.write("no ncu (Nsight Compute) on this machine\n")
            return "no ncu here"
        cmd = [ncu, "--kernel-name", "regex:fmma_|fwg_"]
        for section in NCU_SECTIONS:
            cmd += ["--section", section]
        cmd += [binary, *map(str, small), "1"]
        f.write("$ %s\n" % " ".join(cmd))
        f.flush()
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=120)
        except subprocess.TimeoutExpired:
            f.write("\nncu: timed out after 120 s\n")
            return "ncu timed out"
    return "ncu report of B%d T%d C%d NH%d in %s (exit %d)" % (*small, path, proc.returncode)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--bin", help="the bench_attention binary (default BUILD/tests/bench/...)")
    ap.add_argument("--model", nargs="+", choices=sorted(MODELS), default=None)
    ap.add_argument("--shape", nargs="+", type=shape_arg, default=[])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--ncu", metavar="FILE")
    a = ap.parse_args()
    binary = a.bin or os.path.join(a.build, "tests", "bench", "bench_attention")
    if not os.access(binary, os.X_OK):
        print(f"{binary}: not built (only a build with CUDA makes it): skipped")
        return 77
    shapes = a.shape + [MODELS[m] for m in (a.model or ([] if a.shape else sorted(MODELS)))]

    print("attention, bf16, causal; TFLOP/s as FlashAttention counts them (forward 2 B NH T^2 hs,"
          " backward 2.5x); median of %d calls" % a.iters)
    print("%-22s %-9s %-32s %9s %9s" % ("shape", "pass", "implementation", "ms", "TFLOP/s"))
    for shape in shapes:
        rows = run_distrain(binary, shape, a.iters)
        if rows is None:
            print("no GPU: skipped")
            return 77
        if a.check:
            passes = sorted((p, impl) for p, impl, ms in rows
                            if ms > 0 and impl != "distrain (wgmma)")  # where the GPU has it
            want = [("backward", "distrain (dS tiles)"), ("backward", "distrain (recompute)"),
                    ("forward", "distrain")]
            if passes != want:
                sys.exit(f"--check: {shape}: distrain's passes were {rows}")
        note = ""
        if not a.no_torch:
            more, note = run_torch(shape, a.iters)
            rows += more
        label = "B%d T%d C%d NH%d" % shape
        for p in ("forward", "backward"):
            for pas, impl, ms in rows:
                if pas == p:
                    flop = fwd_flop(*shape) * (1.0 if p == "forward" else 2.5)
                    print("%-22s %-9s %-32s %9.3f %9.1f" % (label, p, impl, ms, flop / ms / 1e9))
                    label = ""
        if note:
            print("  (%s)" % note)
    if a.ncu and shapes:
        print(profile_kernels(binary, shapes[0], a.ncu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
