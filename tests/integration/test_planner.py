"""distrainctl plan against the trainer: memory per rank and step time on CPU runs.

Runs the real distrain-train (the small GPT-2 of test_pp.py, fp32 on CPU) in several layouts,
reads every rank's measured memory ("memory (ZeRO-z, dp n): params X MiB, grads X MiB,
optimizer X MiB = ... + working X MiB" and "activations: X MiB in N slots"), asks
`distrainctl plan --precision fp32 --layout ... --json` for the same layout, and checks, rank by
rank (pipeline stages differ), that the predicted params + grads + optimizer and activations
are within 10% of the measured ones (ZeRO working buffers are printed, not asserted).

Step time: one single-process run calibrates the CPU's FLOP/s (6 P tokens / measured step);
the planner then predicts the other layouts with that peak and the error is printed. Timing is
never asserted (a shared 2-core machine is no stopwatch).

bf16 on a GPU: the same comparison with `--precision bf16` (the planner's default, distrain's
own layout: fp32 master weights, gradients and Adam state plus a 2-byte bf16 weight copy, and
2-byte LayerNorm and GELU outputs) against the CUDA trainer's allocations, within 2%. It runs
tests/emul's distrain-train-emul (the CUDA trainer with its runtime emulated on the CPU: the same
allocations, 2-byte bf16), or --gpu-trainer's binary; without either it is skipped. With --gpu
(CTest planner_gpu, label gpu: tests/gpu/run.sh runs it) it is the build's trainer on a real GPU.

    /usr/bin/python3 tests/integration/test_planner.py --build build
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_dp as dp  # noqa: E402  (the launcher)

MIB = 1024.0 * 1024.0
# The CPU backend's cost per collective on loopback, assumed (not fitted to these runs).
LATENCY_US = 200
SEQ, MICRO, STEPS = 32, 4, 6
DIMS = {"layers": 4, "heads": 4, "channels": 64, "vocab": 100, "max_seq": 64}
# (name, dp, tp, pp, zero, accum, recompute, cp, materialized attention)
LAYOUTS = [("dp2 ZeRO-0", 2, 1, 1, 0, 1, False, 1, False),
           ("dp2 ZeRO-3", 2, 1, 1, 3, 2, False, 1, False),
           ("dp2 ZeRO-2 recompute", 2, 1, 1, 2, 1, True, 1, False),
           ("tp2", 1, 2, 1, 0, 2, False, 1, False),
           ("tp2 materialized", 1, 2, 1, 0, 2, False, 1, True),
           ("pp2", 1, 1, 2, 0, 2, False, 1, False),
           ("cp2 ZeRO-1", 1, 1, 1, 1, 2, False, 2, False),
           ("cp2 ZeRO-1 materialized", 1, 1, 1, 1, 2, False, 2, True),
           ("cp2 x tp2 recompute", 1, 2, 1, 0, 2, True, 2, False)]

# (name, dp, tp, pp, zero, accum, recompute, cp, materialized attention) under bf16 on a GPU
GPU_LAYOUTS = [("single", 1, 1, 1, 0, 2, False, 1, False),
               ("dp2 ZeRO-1", 2, 1, 1, 1, 1, False, 1, False),
               ("dp2 ZeRO-3", 2, 1, 1, 3, 1, False, 1, False),
               ("tp2 materialized", 1, 2, 1, 0, 2, False, 1, True),
               ("pp2 recompute", 1, 1, 2, 0, 2, True, 1, False)]
GPU_TRAINER = None  # the CUDA trainer's binary (main)
DEVICE = re.compile(r"device memory after the first step: tensors ([\d.]+) MiB \+ the device's own "
                    r"([\d.]+) MiB \([^)]*\) = [\d.]+ MiB; \S+ shows ([\d.]+) of")

MEM = re.compile(r"memory \(ZeRO-\d, dp \d+\): params ([\d.]+) MiB, grads ([\d.]+) MiB, "
                 r"optimizer ([\d.]+) MiB = [\d.]+ MiB \(formula [^)]*\) \+ working ([\d.]+) MiB")
ACTS = re.compile(r"activations: ([\d.]+) MiB in \d+ slots?[^;\n]*; bf16 weight copy ([\d.]+) MiB")


def trainer_args(dpn, tp, pp, zero, accum, recompute, cp, mat, metrics):
    a = dp.base_args(MICRO, accum, metrics, steps=STEPS)
    i = a.index("--init")
    a[i:i + 2] = ["--init", "seed:7"]
    a += ["--layers", "4", "--heads", "4", "--channels", "64", "--vocab", "100", "--max-seq",
          "64", "--tp", str(tp), "--pp", str(pp), "--cp", str(cp), "--zero-stage", str(zero)]
    return a + (["--recompute"] if recompute else []) + \
        (["--attention", "materialized"] if mat else [])


def plan(dpn, tp, pp, zero, accum, recompute, cp, mat, peak_tflops=None, precision="fp32"):
    ctl = os.path.join(dp.BUILD, "coordinator", "distrainctl")
    batch = dpn * MICRO * accum
    cmd = [ctl, "plan", "--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "100",
           "--max-seq", "64", "--seq", str(SEQ), "--global-batch", str(batch), "--precision",
           precision, "--json", "--mfu", "1", "--intra-gbps", "2", "--latency-us", str(LATENCY_US),
           "--layout",
           "dp=%d,tp=%d,pp=%d,cp=%d,zero=%d,micro=%d,ckpt=%d" % (dpn, tp, pp, cp, zero, MICRO,
                                                                recompute)]
    if mat:
        cmd += ["--attention", "materialized"]
    if peak_tflops:
        cmd += ["--peak-tflops", "%.9g" % peak_tflops]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)


class PlannerAgainstTrainer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dt_planner_")
        cls.report = []

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)
        print("\n" + "\n".join(cls.report), file=sys.stderr)

    def run_layout(self, name, dpn, tp, pp, zero, accum, recompute, cp, mat, gpu=False):
        tag = re.sub(r"\W+", "_", name) + ("_gpu" if gpu else "")
        kv = tempfile.mkdtemp(prefix="kv_" + tag, dir=self.tmp)
        metrics = os.path.join(self.tmp, tag + ".jsonl")
        world = dpn * tp * pp * cp

        def args(r):
            a = trainer_args(dpn, tp, pp, zero, accum, recompute, cp, mat, metrics)
            if not gpu:
                return a
            i = a.index("--steps")
            a[i + 1] = "1"  # the allocations are made before the first step
            return [GPU_TRAINER] + a[1:] + ["--device", "cuda", "--precision", "bf16"]
        outs = dp.wait_all(dp.launch(world, args, kv, {"LOCAL_RANK": "0"} if gpu else None),
                           timeout=300)
        dp.assert_ranks_ok(outs, name)
        errs = [err for _, _, err in outs]
        steps = dp.read_metrics(metrics)
        ms = statistics.median(m["ms"] for m in steps[1:]) if len(steps) > 1 else 0
        return errs, ms

    def check_memory(self, name, errs, lay, dpn, tp, cp, zero, tol, check_working=False):
        """Rank by rank, the planner's params + grads + optimizer (with the bf16 weight copy)
        and activations against the trainer's lines, and if check_working the working buffers
        (those of the GPU trainer, whose comm thread is on under every ZeRO stage); returns the
        worst relative errors."""
        worst_state = worst_acts = 0.0
        for r, err in enumerate(errs):
            m = MEM.search(err)
            a = ACTS.search(err)
            self.assertTrue(m and a, "%s rank %d: no memory lines in:\n%s" % (name, r, err[-2000:]))
            stage = r // (tp * cp * dpn)  # the mesh: pp x dp x cp x tp
            want = lay["stages"][stage]
            state = (sum(float(x) for x in m.groups()[:3]) + float(a.group(2))) * MIB
            pstate = want["params"] + want["grads"] + want["optim"]
            acts = float(a.group(1)) * MIB
            e_state = pstate / state - 1.0
            e_acts = want["acts"] / acts - 1.0
            worst_state = max(worst_state, abs(e_state))
            worst_acts = max(worst_acts, abs(e_acts))
            self.assertLess(abs(e_state), tol, "%s rank %d: params+grads+optim predicted %.0f, "
                            "measured %.0f bytes" % (name, r, pstate, state))
            self.assertLess(abs(e_acts), tol, "%s rank %d: activations predicted %.0f, measured "
                            "%.0f bytes" % (name, r, want["acts"], acts))
            if check_working:  # printed with 2 decimals
                self.assertAlmostEqual(want["working"] / MIB, float(m.group(4)), delta=0.006,
                                       msg="%s rank %d: working buffers" % (name, r))
            if r == 0 and (zero >= 2 or check_working):
                self.report.append("    %s: working buffers predicted %.3f MiB, measured %s MiB"
                                   % (name, want["working"] / MIB, m.group(4)))
        return worst_state, worst_acts

    def test_memory_and_time(self):
        # Calibration: one process, the whole batch of the dp=2 layouts' global batch 8.
        errs, ms1 = self.run_layout("single", 1, 1, 1, 0, 2, False, 1, False)
        p1 = plan(1, 1, 1, 0, 2, False, 1, False)
        params = p1["model"]["params"]
        flops = 6.0 * params * 8 * SEQ
        peak = flops / (ms1 / 1000.0) / 1e12  # TFLOP/s one trainer thread reaches
        self.report.append("planner vs trainer (fp32, CPU, %d parameters; calibrated peak "
                           "%.3f GFLOP/s from the single-process step of %.1f ms):"
                           % (params, peak * 1e3, ms1))
        for name, dpn, tp, pp, zero, accum, recompute, cp, mat in \
                [("single", 1, 1, 1, 0, 2, False, 1, False)] + LAYOUTS:
            if name != "single":
                errs, ms = self.run_layout(name, dpn, tp, pp, zero, accum, recompute, cp, mat)
            else:
                ms = ms1
            lay = plan(dpn, tp, pp, zero, accum, recompute, cp, mat, peak)["layouts"][0]
            # the CPU trainer reads a micro-batch's tokens where they are; the planner counts
            # the 2 N ints a GPU slot holds
            worst_state, worst_acts = self.check_memory(name, errs, lay, dpn, tp, cp, zero, 0.10)
            t_pred = lay["t_step"] * 1000.0
            self.report.append("  %-22s state err %5.2f%%  acts err %5.2f%%  step predicted "
                               "%6.1f ms, measured %6.1f ms (%+.0f%%)"
                               % (name, 100 * worst_state, 100 * worst_acts, t_pred, ms,
                                  100 * (t_pred / ms - 1)))

    def test_bf16_memory_on_a_gpu(self):
        if not GPU_TRAINER:
            self.skipTest("no CUDA trainer (tests/emul's distrain-train-emul is built where the "
                          "CUDA headers are)")
        self.report.append("planner vs trainer (bf16, CUDA trainer %s):"
                           % os.path.basename(GPU_TRAINER))
        for name, dpn, tp, pp, zero, accum, recompute, cp, mat in GPU_LAYOUTS:
            errs, _ = self.run_layout(name, dpn, tp, pp, zero, accum, recompute, cp, mat, True)
            lay = plan(dpn, tp, pp, zero, accum, recompute, cp, mat,
                       precision="bf16")["layouts"][0]
            worst_state, worst_acts = self.check_memory(name, errs, lay, dpn, tp, cp, zero, 0.02,
                                                        check_working=True)
            self.report.append("  %-22s state err %5.2f%%  acts err %5.2f%%"
                               % (name, 100 * worst_state, 100 * worst_acts))
            for r, err in enumerate(errs):
                stage = r // (tp * cp * dpn)
                self.check_device_total(name, r, err, lay["stages"][stage]["device"])

    def check_device_total(self, name, r, err, planned):
        """The trainer's tensors and the device's own buffers (cuBLASLt's workspace, the kernel
        scratch) are everything the process allocates on the GPU: on the emulated one, whose
        memory in use is the process's allocations and nothing else, they sum to it; a real
        GPU adds its CUDA context, NCCL and other processes. The planner's "device" is the
        own buffers to the byte (printed in MiB with 2 decimals)."""
        d = DEVICE.search(err)
        self.assertTrue(d, "%s rank %d: no device memory line in:\n%s" % (name, r, err[-2000:]))
        tensors, own, used = (float(x) for x in d.groups())
        self.assertGreater(own, 0, "%s rank %d: %s" % (name, r, d.group(0)))
        self.assertAlmostEqual(planned / MIB, own, delta=0.006,
                               msg="%s rank %d: the device's own buffers, planned %.3f MiB: %s"
                               % (name, r, planned / MIB, d.group(0)))
        if r == 0:
            self.report.append("    %s: device's own buffers predicted %.3f MiB, measured %.2f MiB"
                               % (name, planned / MIB, own))
        if "emul" in os.path.basename(GPU_TRAINER):
            self.assertAlmostEqual(tensors + own, used, delta=0.02,
                                   msg="%s rank %d: %s" % (name, r, d.group(0)))
        else:
            self.assertGreaterEqual(used + 0.02, tensors + own, d.group(0))

    def test_device_buffers_on_a_gpu(self):
        """The device's own buffers past the scratch's first MiB: a wider model (C 256) and
        4032 rows per micro-batch, where the bf16 copy of a projection's output gradient
        (1.97 MiB; the MLP's and q, k, v's are bf16 already) sets the scratch (2 MiB), its
        weight's copy under ZeRO-3 takes it to 3 MiB, and fp32 keeps LayerNorm's partials and
        the ones; the planner's "device" against the trainer's line, rank by rank."""
        if not GPU_TRAINER:
            self.skipTest("no CUDA trainer (tests/emul's distrain-train-emul is built where the "
                          "CUDA headers are)")
        ctl = os.path.join(dp.BUILD, "coordinator", "distrainctl")
        model = ["--layers", "1", "--heads", "4", "--vocab", "100", "--max-seq", "64"]
        for name, world, tp, zero, precision in (("bf16", 1, 1, 0, "bf16"),
                                                 ("bf16 dp2 ZeRO-3", 2, 1, 3, "bf16"),
                                                 ("bf16 tp2", 2, 2, 0, "bf16"),
                                                 ("fp32", 1, 1, 0, "fp32")):
            with self.subTest(name):
                dpn = world // tp
                tag = re.sub(r"\W+", "_", name) + "_dev"
                a = dp.base_args(63, 1, os.path.join(self.tmp, tag + ".jsonl"), steps=1)
                i = a.index("--init")
                a[i:i + 2] = ["--init", "seed:7"]
                a[a.index("--seq") + 1] = "64"
                a = [GPU_TRAINER] + a[1:] + model + [
                    "--channels", "256", "--tp", str(tp), "--zero-stage", str(zero), "--device",
                    "cuda", "--precision", precision]
                outs = dp.wait_all(dp.launch(world, lambda r: a, tempfile.mkdtemp(
                    prefix="kv_" + tag, dir=self.tmp), {"LOCAL_RANK": "0"}), timeout=300)
                dp.assert_ranks_ok(outs, name)
                lay = json.loads(subprocess.run(
                    [ctl, "plan"] + model + ["--hidden", "256", "--seq", "64", "--global-batch",
                                             str(63 * dpn), "--precision", precision, "--json",
                                             "--layout", "dp=%d,tp=%d,zero=%d,micro=63"
                                             % (dpn, tp, zero)],
                    check=True, stdout=subprocess.PIPE, text=True).stdout)["layouts"][0]
                self.assertGreater(lay["stages"][0]["device"], 33 * MIB, name)  # past 1 MiB
                for r, (_, _, err) in enumerate(outs):
                    self.check_device_total(name, r, err, lay["stages"][0]["device"])

    def test_cli_errors(self):
        ctl = os.path.join(dp.BUILD, "coordinator", "distrainctl")

        def run(*args):
            return subprocess.run([ctl, "plan"] + list(args), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)

        cases = [(("--model", "gpt5", "--global-batch", "8", "--gpus", "8"), 2,
                  "--model 'gpt5': unknown preset (known: gpt2-124m"),
                 (("--model", "gpt2-124m", "--gpus", "8"), 2, "--global-batch is needed"),
                 (("--global-batch", "8", "--gpus", "8"), 2, "a model is needed"),
                 (("--model", "gpt2-124m", "--global-batch", "8", "--layout", "dp=1,tp=5"), 2,
                  "tp (5) must divide the attention heads (12)"),
                 (("--model", "gpt2-124m", "--global-batch", "8", "--layout", "dp=1,pp=5"), 2,
                  "pp (5) must divide the layers (12)"),
                 (("--model", "gpt2-124m", "--global-batch", "8", "--gpus", "8", "--layout",
                   "dp=4"), 2, "not the 8 GPUs"),
                 (("--model", "gpt2-124m", "--seq", "1000", "--global-batch", "8", "--layout",
                   "dp=1,cp=3"), 2, "cp (3): 2 x cp must divide the sequence (1000)"),
                 (("--model", "gpt2-124m", "--global-batch", "8", "--gpus", "x"), 2,
                  "--gpus: expected an integer from 1 to 1073741824, got 'x'"),
                 (("--model", "gpt2-124m", "--global-batch", "8", "--gpus", "2147483647"), 2,
                  "--gpus: expected an integer from 1 to 1073741824, got '2147483647'"),
                 (("--model", "gpt2-124m", "--global-batch", "8", "--gpus", "8", "--reserve-gib",
                   "-1"), 2, "--reserve-gib: expected a number >= 0, got '-1'"),
                 (("--model", "gpt2-124m", "--global-batch", "8", "--gpus", "8", "--precision",
                   "fp8"), 2, "expected bf16, fp32 or mixed16"),
                 (("--model", "gpt2-124m", "--global-batch", "8", "--gpus", "8", "--precision",
                   "mixed16", "--emit-spec"), 2, "--emit-spec: mixed16 is the textbook trainer's"),
                 (("--model", "llama-405b", "--seq", "8192", "--global-batch", "16", "--gpus",
                   "8"), 1, "nothing fits in 80 GiB per GPU (1 GiB left free): the smallest layout"),
                 (("--model", "gpt2-124m", "--global-batch", "7", "--gpus", "5"), 2,
                  "no valid layout of 5 GPUs"),
                 (("--model", "gpt2-124m", "--global-batch", "8", "--gpus", "8", "--peak-tflops",
                   "1e-308"), 2, "these figures give no finite step time (1e-308 TFLOP/s")]
        for args, code, msg in cases:
            r = run(*args)
            self.assertEqual(r.returncode, code, "%s: %s" % (args, r.stderr))
            self.assertIn(msg, r.stderr, args)
        r = run("--model", "gpt2-124m", "--global-batch", "512", "--gpus", "8", "--top", "3")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("124439808 parameters", r.stdout)
        self.assertIn("recommended: dp8 tp1 pp1", r.stdout)
        r = run("--model", "gpt2-124m", "--global-batch", "512", "--gpus", "8", "--emit-spec")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("precision: bf16", r.stdout)  # the plan's, not the job's default fp32
        self.assertIn("parallel: {dp: 8, tp: 1, pp: 1, cp: 1, zero_stage:", r.stdout)

    def test_job_precision(self):
        """--job plans the precision the job runs (training.precision, default fp32);
        --precision overrides it."""
        ctl = os.path.join(dp.BUILD, "coordinator", "distrainctl")
        job = os.path.join(self.tmp, "job.yaml")
        for line, extra, want in [("", [], "fp32"), (", precision: bf16", [], "bf16"),
                                  (", precision: bf16", ["--precision", "fp32"], "fp32")]:
            with open(job, "w") as f:
                f.write("model: {layers: 4, heads: 4, channels: 64, vocab: 100, max_seq: 64}\n"
                        "training: {batch: 8, seq: 32%s}\n" % line)
            r = subprocess.run([ctl, "plan", "--job", job, "--gpus", "2", "--json"] + extra,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(json.loads(r.stdout)["precision"], want, (line, extra))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--gpu-trainer", help="the CUDA trainer for the bf16 check (default: the "
                    "build's tests/emul/distrain-train-emul)")
    ap.add_argument("--gpu", action="store_true", help="the bf16 check on this machine's GPU "
                    "with the build's distrain-train; exits 77 without a usable GPU")
    args, rest = ap.parse_known_args()
    dp.BUILD = os.path.abspath(args.build)
    emul = os.path.join(dp.BUILD, "tests", "emul", "distrain-train-emul")
    GPU_TRAINER = os.path.abspath(args.gpu_trainer) if args.gpu_trainer else \
        emul if os.path.exists(emul) else None
    if args.gpu:
        import test_gpu_trainer  # noqa: E402
        if not test_gpu_trainer.has_gpu():
            print("no usable CUDA GPU (or a build without CUDA): skipped", file=sys.stderr)
            sys.exit(77)
        GPU_TRAINER = dp.trainer()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
