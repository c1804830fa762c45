"""Benchmark: distrain-train on one CUDA GPU against PyTorch (eager and torch.compile), side by
side in one run, on the same shapes.

Shapes (--model):
  gpt2-124m  L12 H12 C768, vocab 50257 (padded to 50304), T 1024: the headline figure
  gpt2-1.5b  L48 H25 C1600, the same vocabulary and T; distrain runs it with --zero-stage 1
  tiny       L2 H4 C64, vocab 512, T 64: a smoke run of this script (also on --device cpu)

Every implementation runs in a process of its own (its own CUDA context and memory figures),
trains from a random GPT-2 init on random tokens of one llm.c shard read in sequential windows,
with AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, no weight decay), a constant learning rate and
gradient clipping at 1.0.
  * distrain: distrain-train --device cuda --precision bf16 (--distrain-precision; the
    "precision" column): its linear layers and flash attention (tensor-core kernels) in bf16
    with fp32 accumulation, activations and the rest fp32 (unlike PyTorch's bf16 autocast,
    whose activations are bf16); flash attention unless --distrain-attention materialized,
    which is fp32 attention.
  * distrain-tuned: the same under DISTRAIN_CUDA_GEMM_TUNE=1 (each kind of product on the
    fastest of cuBLASLt's candidates, timed on its first product, rather than the heuristic's
    first; the trainer's lines naming each choice are printed after its profile).
  * distrain-wgmma: distrain-tuned, and DISTRAIN_CUDA_WGMMA=1 (the flash attention kernels on
    Hopper's wgmma, at head size 64 on a GPU of compute capability 9.0; refused elsewhere, a
    row that says so): its profile's attention rows against distrain-tuned's are the change.
  * torch-eager / torch-compile: a plain GPT-2 module (pre-LN blocks, tanh GELU, tied
    embeddings, F.scaled_dot_product_attention with is_causal) under bf16 autocast with fp32
    master weights, fused AdamW; torch.compile(model) for the second. PyTorch before 2.0 has
    neither SDPA nor compile: eager then uses masked softmax attention and says so.

Figures per implementation: the median step time over steps 3..N (the first two warm up; the
compiled model compiles in them), tokens/s = B*T*1000/median, MFU = flops_per_token * tokens/s
/ peak with flops_per_token = 6*P + 12*L*C*T (P: all parameters, padded vocabulary included;
the attention term as PaLM and llm.c count it), and GPU memory in use after the steps (total -
free, what nvidia-smi shows, the CUDA context included; measured the same way for every
implementation), plus PyTorch's allocator peak. The default peak, 989 TFLOP/s, is an H100 SXM's
dense bf16; pass --peak-tflops for another GPU. distrain then runs step N+1 under --profile
(every kernel between timed events on its stream; not in the figures above) and the table of
that step follows: each kernel's calls, time, share of the step and TFLOP/s for the products,
GB/s (of the least traffic its arguments imply) for the memory-bound kernels, so that a run
short of its target says which kernels to work on; --trace keeps that step's timeline too
(--profile-trace: the launch gaps between kernels show there).

Exit status 77 (a skip) where distrain-train finds no GPU. tests/gpu/run.sh runs it after the
GPU tests, for gpt2-124m and gpt2-1.5b.

--batch auto takes the largest of 128, 64, ..., 1 at which distrain completes two steps, and
every implementation starts at that batch. PyTorch needs more memory per sequence (its bf16
logits and activations): where torch-eager runs out of memory it retries at half the batch, down
to 1, and torch-compile starts at the batch eager fits (a compiled model needs no more than the
eager one, and each try would compile again). Where PyTorch ends at a smaller batch than
distrain, distrain runs that batch too, so that the ratios come both ways: each implementation
at its largest batch (what a user gets from the GPU) and all at the same batch.

    /usr/bin/python3 tests/bench/bench_gpu.py --build build [--model gpt2-124m] [--steps 20]
        [--batch auto] [--impls distrain,distrain-tuned,distrain-wgmma,torch-eager,torch-compile]
        [--json FILE]
        [--trace FILE]
"""

import argparse
import array
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {  # layers, heads, channels, vocab, seq
    "gpt2-124m": (12, 12, 768, 50257, 1024),
    "gpt2-1.5b": (48, 25, 1600, 50257, 1024),
    "tiny": (2, 4, 64, 512, 64),
}
LR, BETAS, EPS, CLIP = 3e-4, (0.9, 0.95), 1e-8, 1.0
WARMUP_STEPS = 2


def padded(vocab):
    return (vocab + 127) // 128 * 128


def param_count(L, C, V, T):
    """GPT-2's parameters with the vocabulary padded (distrain's and llm.c's layout)."""
    return padded(V) * C + T * C + L * (12 * C * C + 13 * C) + 2 * C


def flops_per_token(L, C, V, T):
    return 6 * param_count(L, C, V, T) + 12 * L * C * T


def write_shard(path, n, vocab):
    """An llm.c token shard of n seeded random tokens below vocab (the standard library only:
    the GPU machines' python3 may lack numpy)."""
    tokens = array.array("H", random.Random(0).randbytes(2 * n))
    tokens = array.array("H", (t % vocab for t in tokens))
    header = array.array("i", [20240520, 1, n] + [0] * 253)
    if sys.byteorder != "little":
        header.byteswap()
        tokens.byteswap()
    with open(path, "wb") as f:
        header.tofile(f)
        tokens.tofile(f)


def summarize(impl, precision, B, T, times_ms, device_mib, extra=None):
    med = statistics.median(times_ms[WARMUP_STEPS:])
    row = {"impl": impl, "precision": precision, "batch": B, "seq": T,
           "median_ms": round(med, 3), "tokens_per_s": round(B * T * 1000.0 / med, 1),
           "device_mib": device_mib}
    row.update(extra or {})
    return row


# ---------------------------------------------------------------------------------------------
# distrain
# ---------------------------------------------------------------------------------------------

# distrain's implementations: the variables each runs under (each unset elsewhere)
DISTRAIN_IMPLS = {
    "distrain": {},
    "distrain-tuned": {"DISTRAIN_CUDA_GEMM_TUNE": "1"},
    "distrain-wgmma": {"DISTRAIN_CUDA_GEMM_TUNE": "1", "DISTRAIN_CUDA_WGMMA": "1"},
}
TORCH_IMPLS = ("torch-eager", "torch-compile")


def trace_path(a, impl):
    """Where impl's profiled step goes: --trace for distrain, beside it for the others
    (x.trace.json -> x-tuned.trace.json)."""
    if impl == "distrain":
        return a.trace
    folder, base = os.path.split(a.trace)
    name, dot, ext = base.partition(".")
    return os.path.join(folder, name + impl[len("distrain"):] + dot + ext)


def run_distrain(a, B, steps, tmp, trace=True, impl="distrain"):
    """One distrain-train run under impl's variables (DISTRAIN_IMPLS; under
    DISTRAIN_CUDA_GEMM_TUNE=1 the trainer's lines naming each kind's algorithm are kept in the
    row's "gemm_tuning"); its row, or {"oom": True}, {"skipped": why} / a failure. A measured
    run takes one step more, profiled (--profile: every kernel timed), which the timings leave
    out; with trace, that step's timeline goes to trace_path."""
    L, H, C, V, T = MODELS[a.model]
    metrics = os.path.join(tmp, "%s_b%d.jsonl" % (impl, B))
    measured = steps > WARMUP_STEPS
    cmd = [os.path.join(a.build, "worker/trainer/distrain-train"), "--device", a.device,
           "--seed", "1337", "--layers", str(L), "--heads", str(H), "--channels", str(C),
           "--vocab", str(V), "--max-seq", str(T), "--train", a.shard, "--batch", str(B),
           "--seq", str(T), "--steps", str(steps + measured), "--lr", str(LR),
           "--schedule", "constant",
           "--warmup", "0", "--weight-decay", "0", "--grad-clip", str(CLIP),
           "--metrics", metrics, "--quiet", "--precision", a.distrain_precision,
           "--attention", a.distrain_attention]
    if a.model == "gpt2-1.5b":
        cmd += ["--zero-stage", "1"]
    if measured:
        cmd += ["--profile", str(steps + 1)]
        if a.trace and trace:
            cmd += ["--profile-trace", trace_path(a, impl)]
    env = dict(os.environ)
    for var in ("DISTRAIN_CUDA_GEMM_TUNE", "DISTRAIN_CUDA_WGMMA"):
        env[var] = DISTRAIN_IMPLS[impl].get(var, "0")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        if "needs a GPU of compute capability 9.0" in p.stderr:
            return {"impl": impl, "batch": B, "skipped": "not run: wgmma needs an H100/H200"}
        if "no usable CUDA GPU" in p.stderr or "built without CUDA" in p.stderr:
            print("bench_gpu: no GPU for distrain-train: skipped\n" + p.stderr[-1000:],
                  file=sys.stderr)
            sys.exit(77)
        if "out of GPU memory" in p.stderr or "out of memory" in p.stderr:
            return {"impl": impl, "batch": B, "oom": True}
        raise SystemExit("bench_gpu: distrain-train exited %d:\n%s" % (p.returncode,
                                                                      p.stderr[-3000:]))
    lines = [json.loads(line) for line in open(metrics)]
    rows = [r for r in lines if "loss" in r][:steps]
    if not measured:  # the batch probe: it fits
        return {"impl": impl, "batch": B}
    profile = [r["profile"] for r in lines if "profile" in r]
    mib = rows[-1].get("device_mib") if rows else None
    if a.distrain_precision == "fp32":
        precision = "fp32" + (", materialized" if a.distrain_attention == "materialized" else "")
    else:
        precision = ("bf16 linear, fp32 materialized" if a.distrain_attention == "materialized"
                     else "bf16 linear+attn")
    extra = {"loss": round(rows[-1]["loss"], 4), "profile": profile[0]}
    if DISTRAIN_IMPLS[impl].get("DISTRAIN_CUDA_GEMM_TUNE") == "1":
        extra["gemm_tuning"] = [line.split(": ", 1)[-1] for line in p.stderr.splitlines()
                                if "(by timing)" in line]
    return summarize(impl, precision, B, T, [r["ms"] for r in rows], mib, extra)


def print_profile(r):
    """distrain's profiled step, kernel by kernel: where the time goes, and the products' speed
    against the peak."""
    p = r["profile"]
    total = sum(k["ms"] for k in p["kernels"])
    print("%s step %d, profiled: %.2f ms (kernels %.2f ms, %.1f%%)" % (
        r["impl"], p["steps"][0], p["step_ms"], total, 100 * total / p["step_ms"]))
    print("  %-36s %6s %10s %7s %14s" % ("kernel", "calls", "ms", "share", "rate"))
    for k in p["kernels"]:
        rate = "-"
        if k["gflop"] > 0:
            rate = "%.1f TFLOP/s" % (k["gflop"] / k["ms"])
        elif k["mbytes"] > 0:
            rate = "%.0f GB/s" % (k["mbytes"] / k["ms"])
        print("  %-36s %6d %10.3f %6.1f%% %14s" % (k["kernel"], k["calls"], k["ms"],
                                                   100 * k["ms"] / p["step_ms"], rate))
    for c in p.get("comm", []):  # a multi-rank run's communication (none on one GPU)
        print("  %-36s %6d %10.3f %6.1f%% %14s" % (
            "comm %s %s%s" % (c["group"], c["op"], " (overlapped)" if c["overlapped"] else ""),
            c["calls"], c["ms"], 100 * c["ms"] / p["step_ms"],
            "%.0f GB/s" % (c["mbytes"] / c["ms"]) if c["mbytes"] > 0 else "-"))
        total += 0 if c["overlapped"] else c["ms"]
    print("  %-36s %6s %10.3f %6.1f%%" % ("(the rest: copies, host)", "",
                                          p["step_ms"] - total,
                                          100 * (p["step_ms"] - total) / p["step_ms"]))


def print_trace_calls(path):
    """The profiled step's calls grouped by kernel and size (the trace's GFLOP or MB per call),
    the largest total first: a product whose shape runs slowly (the H200's first run found the
    LM head's GEMMs at 92-122 TFLOP/s among others at 500-720) shows here, where the table above
    adds it into its kernel's row. Best and median call, and the rate of the best."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    groups = {}
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith("step"):
            args = e.get("args", {})
            key = (e["name"], args.get("gflop", 0), args.get("mbytes", 0))
            groups.setdefault(key, []).append(e["dur"] / 1000.0)
    print("  calls by size (ms):")
    print("  %-36s %10s %6s %9s %9s %14s" % ("kernel", "size", "calls", "best", "median", "rate"))
    for (name, gflop, mb), ms in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        ms.sort()
        size = "%.1f GFLOP" % gflop if gflop else "%.0f MB" % mb if mb else "-"
        rate = ("%.1f TFLOP/s" % (gflop / ms[0]) if gflop else
                "%.0f GB/s" % (mb / ms[0]) if mb else "-")
        print("  %-36s %10s %6d %9.3f %9.3f %14s" % (name, size, len(ms), ms[0], ms[len(ms) // 2],
                                                     rate))


# ---------------------------------------------------------------------------------------------
# PyTorch (in a child process: python3 bench_gpu.py --child torch-eager ...)
# ---------------------------------------------------------------------------------------------

def torch_child(a):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    L, H, C, V, T = MODELS[a.model]
    Vp, B = padded(V), a.batch
    dev = torch.device(a.device)
    sdpa = hasattr(F, "scaled_dot_product_attention")
    compiled = a.child == "torch-compile"
    if compiled and not hasattr(torch, "compile"):
        print(json.dumps({"impl": a.child, "skipped": "PyTorch %s has no torch.compile"
                          % torch.__version__}))
        return

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.fcproj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (z.view(b, t, H, C // H).transpose(1, 2) for z in (q, k, v))
            if sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
                mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
                y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, C))
            return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(Vp, C), nn.Embedding(T, C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.lnf = nn.LayerNorm(C)
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.dim() >= 2:  # GPT-2: N(0, 0.02), residual projections scaled
                    std = 0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.lnf(x) @ self.wte.weight.t()  # tied head
            return F.cross_entropy(logits[..., :V].float().reshape(-1, V), targets.reshape(-1))

    if a.torch_max_batch and B > a.torch_max_batch:  # the retry's smoke test, on a CPU
        print(json.dumps({"impl": a.child, "batch": B, "oom": True}))
        return
    torch.manual_seed(1337)
    model = GPT().to(dev)
    fused = {"fused": True} if dev.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0,
                            **fused)
    step_fn = torch.compile(model) if compiled else model
    with open(a.shard, "rb") as f:
        f.seek(1024)  # the llm.c header: 256 int32
        tokens = torch.frombuffer(bytearray(f.read()), dtype=torch.int16).to(torch.int64)
    tokens = tokens.remainder(65536)  # uint16 ids
    span = B * T + 1
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    try:
        for s in range(a.steps):
            start = (s * B * T) % (len(tokens) - span)
            w = tokens[start:start + span].to(dev)
            x, y = w[:-1].view(B, T), w[1:].view(B, T)
            sync()
            t0 = time.perf_counter()
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                loss = step_fn(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append((time.perf_counter() - t0) * 1000.0)
    except torch.cuda.OutOfMemoryError:
        print(json.dumps({"impl": a.child, "batch": B, "oom": True}))
        return
    mib, extra = None, {"loss": round(loss.item(), 4), "torch": torch.__version__,
                        "attention": "sdpa" if sdpa else "masked softmax"}
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        mib = round((total - free) / 2**20, 1)
        extra["allocator_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    print(json.dumps(summarize(a.child, "bf16 autocast", B, T, times, mib, extra)))


def run_torch(a, impl, B):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--model", a.model,
           "--batch", str(B), "--steps", str(a.steps), "--shard", a.shard, "--device", a.device,
           "--torch-max-batch", str(a.torch_max_batch)]
    env = dict(os.environ)
    if "DT_ORIG_LD_LIBRARY_PATH" in env:  # tests/gpu/run.sh: PyTorch gets its own libraries
        env["LD_LIBRARY_PATH"] = env["DT_ORIG_LD_LIBRARY_PATH"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        if "No module named 'torch'" in p.stderr:
            return {"impl": impl, "skipped": "PyTorch is not installed"}
        raise SystemExit("bench_gpu: %s exited %d:\n%s" % (impl, p.returncode, p.stderr[-3000:]))
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def ratios(rows):
    """distrain's tokens/s over each PyTorch implementation's: each at its largest measured
    batch, and, where PyTorch ran a smaller one, at that batch too."""
    best, at = {}, {}
    for r in rows:
        if "tokens_per_s" in r:
            at[r["impl"], r["batch"]] = r["tokens_per_s"]
            if r["batch"] > best.get(r["impl"], (0, 0))[0]:
                best[r["impl"]] = (r["batch"], r["tokens_per_s"])
    lines = []
    for ours in DISTRAIN_IMPLS:
        for other in TORCH_IMPLS:
            if ours not in best or other not in best:
                continue
            (bd, d), (bo, o) = best[ours], best[other]
            lines.append("%s / %s tokens/s: %.2fx (batch %d / %d%s)" % (
                ours, other, d / o, bd, bo, ", each its largest" if bd != bo else ""))
            if bd != bo and (ours, bo) in at:
                lines.append("%s / %s tokens/s at batch %d: %.2fx" % (
                    ours, other, bo, at[ours, bo] / o))
    return lines


def progress(r):
    """r, its figures also on stderr at once (without the profile): a run cut short by a timeout
    keeps the rows it finished in its output."""
    print("bench_gpu: -> %s" % json.dumps({k: v for k, v in r.items()
                                           if k not in ("profile", "gemm_tuning")}),
          file=sys.stderr, flush=True)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2-124m")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", default="auto", help="micro-batch, or auto (see above)")
    ap.add_argument("--impls", default=",".join(list(DISTRAIN_IMPLS) + list(TORCH_IMPLS)))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    ap.add_argument("--distrain-precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--distrain-attention", choices=("flash", "materialized"), default="flash")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--json", help="write the result lines here too")
    ap.add_argument("--trace", help="write distrain's profiled step here as a Chrome trace")
    ap.add_argument("--shard", help=argparse.SUPPRESS)
    # PyTorch runs out of memory above this batch (0: never): the OOM retry on a machine
    # without a GPU
    ap.add_argument("--torch-max-batch", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        a.batch = int(a.batch)
        return torch_child(a)
    if a.steps <= WARMUP_STEPS:
        ap.error("--steps must be > %d (the warm-up steps)" % WARMUP_STEPS)
    impls = a.impls.split(",")
    unknown = set(impls) - set(DISTRAIN_IMPLS) - set(TORCH_IMPLS)
    if unknown:
        ap.error("--impls: unknown %s" % ", ".join(sorted(unknown)))
    L, H, C, V, T = MODELS[a.model]
    with tempfile.TemporaryDirectory(prefix="dt_bench_gpu_") as tmp:
        a.shard = os.path.join(tmp, "tokens.bin")
        write_shard(a.shard, max(200000, 70 * T * 64), V)
        rows = []
        if a.batch == "auto":
            for B in (128, 64, 32, 16, 8, 4, 2, 1):
                if not run_distrain(a, B, WARMUP_STEPS, tmp).get("oom"):
                    break
            print("bench_gpu: batch %d (the largest distrain fits)" % B, file=sys.stderr)
        else:
            B = int(a.batch)
        torch_batch = B  # where the next PyTorch run starts (auto: the largest eager fits)
        for impl in impls:
            ours = impl.startswith("distrain")
            Bi = B if ours else torch_batch
            while True:
                print("bench_gpu: %s, %s, batch %d x %d, %d steps" % (impl, a.model, Bi, T,
                                                                      a.steps), file=sys.stderr)
                r = (run_distrain(a, Bi, a.steps, tmp, impl=impl) if ours else
                     run_torch(a, impl, Bi))
                rows.append(progress(r))
                if not (r.get("oom") and a.batch == "auto" and not ours and Bi > 1):
                    break
                Bi //= 2
            if impl == "torch-eager" and "tokens_per_s" in r:
                torch_batch = Bi
        if "distrain" in impls and a.batch == "auto":  # distrain at PyTorch's batch as well
            for Bt in sorted({r["batch"] for r in rows if not r["impl"].startswith("distrain")
                              and "tokens_per_s" in r and r["batch"] < B}, reverse=True):
                print("bench_gpu: distrain at PyTorch's batch %d" % Bt, file=sys.stderr)
                rows.append(progress(run_distrain(a, Bt, a.steps, tmp, trace=False)))

    fpt = flops_per_token(L, C, V, T)
    for r in rows:
        if "tokens_per_s" in r:
            r["mfu"] = round(fpt * r["tokens_per_s"] / (a.peak_tflops * 1e12), 4)
    print("%s: %d parameters, %.3g FLOP/token, peak %.0f TFLOP/s" % (
        a.model, param_count(L, C, V, T), fpt, a.peak_tflops))
    print("%-14s %-16s %6s %10s %12s %7s %11s" % ("impl", "precision", "batch", "ms/step",
                                                  "tokens/s", "MFU", "GPU MiB"))
    for r in rows:
        if "tokens_per_s" not in r:
            print("%-14s %s" % (r["impl"], "out of memory at batch %d" % r["batch"]
                                if r.get("oom") else r.get("skipped", "?")))
            continue
        print("%-14s %-16s %6d %10.2f %12.0f %6.1f%% %11s" % (
            r["impl"], r["precision"], r["batch"], r["median_ms"], r["tokens_per_s"],
            100 * r["mfu"], r["device_mib"] if r["device_mib"] is not None else "-"))
    for line in ratios(rows):
        print(line)
    for r in rows:
        if r.get("profile") and r["batch"] == max(x["batch"] for x in rows if x.get("profile")):
            print_profile(r)
            if a.trace and os.path.exists(trace_path(a, r["impl"])):
                print_trace_calls(trace_path(a, r["impl"]))
            if r.get("gemm_tuning"):
                print("  its products' algorithms, each kind timed on its first product:")
                for line in r["gemm_tuning"]:
                    print("    " + line)
    for r in rows:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
