"""Tensor parallelism (Megatron-LM) composed with data parallelism and ZeRO: exactness against
one process, placement, replicas, checkpoints across layouts, bad input.

Runs the real distrain-train binary as WORLD_SIZE processes (rendezvous through a shared
DISTRAIN_KV_DIR, --tp N: tensor-parallel peers are neighbours in rank order, dp = world / tp)
on the tiny golden model (L2 H4 C64, V 100 padded to 128) and data, and checks:
  * tp in {2, 4}, and tp=2 x dp=2 under ZeRO-1 and ZeRO-3 (with and without gradient
    accumulation): the per-step loss equals the single-process run on the same global batch
    within 1e-5 relative, and the final weights (exported in llm.c format) within 1e-5
    relative (L2; no element off by more than 1e-4);
  * every rank logs its plan (heads and vocabulary rows it holds), the parameters per rank
    match (P - R)/tp + R, and the replicated parameters (LayerNorms, wpe, row-parallel biases)
    end bit-identical on all tp ranks (the trainer compares their CRC-32C and fails if not);
  * text sampled after training (--sample) under tp=2 and tp=2 x dp=2 ZeRO-3 is the one
    process's;
  * a tp=2 x dp=2 checkpoint resumes as dp=4 (no tp) and as one process, and a one-process
    checkpoint resumes as tp=2: every continuation follows the single-process trajectory;
  * sequence parallelism (--sp) on tp=2, tp=4 and tp=2 x dp=2 under ZeRO-3: the same losses
    and weights, less activation memory per rank (printed with and without);
  * tp that does not divide the heads or the padded vocabulary, or WORLD_SIZE: a one-line
    error naming the rule, before any training.

    /usr/bin/python3 tests/integration/test_tp.py --build build
"""

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_dp as dp  # noqa: E402  (the launcher and the single-process reference)

REL_TOL = 1e-5
STEPS = 8


def assert_weights(test, ref, got, what):
    """Final weights: relative L2 error below 1e-5, and no element off by more than 1e-4 (a
    tenth of the learning rate: AdamW's m/sqrt(v) turns a last-bit difference in a gradient
    near zero into an update difference of up to lr, so elements are not held to 1e-5)."""
    test.assertEqual(len(ref), len(got), what)
    diff = sum((a - b) ** 2 for a, b in zip(ref, got)) ** 0.5
    norm = sum(a * a for a in ref) ** 0.5
    worst = max(abs(a - b) for a, b in zip(ref, got))
    test.assertLess(diff / norm, REL_TOL, "%s: final weights differ by %.3g (L2, relative)"
                    % (what, diff / norm))
    test.assertLess(worst, 1e-4, "%s: a final weight differs by %.3g" % (what, worst))


def read_llmc(path):
    with open(path, "rb") as f:
        data = f.read()
    return struct.unpack("<%df" % ((len(data) - 1024) // 4), data[1024:])


class OneProcessReference(unittest.TestCase):
    """A temporary directory per class, and the single-process runs the layouts compare with
    (test_cp.py builds on it too)."""
    PREFIX = "dt_tp_"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix=cls.PREFIX)
        cls.single = {}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def single_run(self, global_batch, accum):
        """Losses and final weights of one process on the same global batch."""
        key = (global_batch, accum)
        if key not in self.single:
            m = os.path.join(self.tmp, "single_%d_%d.jsonl" % key)
            w = os.path.join(self.tmp, "single_%d_%d.bin" % key)
            subprocess.run(dp.base_args(global_batch, accum, m) + ["--export-llmc", w],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.single[key] = (dp.read_metrics(m), read_llmc(w))
        return self.single[key]

    def assert_losses(self, ref, got, what):
        self.assertEqual(len(ref), len(got), what)
        for a, b in zip(ref, got):
            rel = abs(a["loss"] - b["loss"]) / abs(a["loss"])
            self.assertLess(rel, REL_TOL, "%s step %d: loss %.9g vs one process %.9g"
                            % (what, a["step"], b["loss"], a["loss"]))


class TensorParallel(OneProcessReference):
    def run_tp(self, world, tp, zero, accum, extra=(), tag=None):
        tag = tag or "w%d_tp%d_z%d_k%d" % (world, tp, zero, accum)
        kv = tempfile.mkdtemp(prefix="kv_" + tag, dir=self.tmp)  # fresh: no stale addresses
        metrics = os.path.join(self.tmp, tag + ".jsonl")
        weights = os.path.join(self.tmp, tag + ".bin")
        batch = 4  # per data-parallel rank
        procs = dp.launch(world, lambda r: dp.base_args(batch, accum, metrics)
                          + ["--tp", str(tp), "--zero-stage", str(zero),
                             "--export-llmc", weights] + list(extra), kv)
        outs = dp.wait_all(procs)
        dp.assert_ranks_ok(outs, tag)
        return dp.read_metrics(metrics), read_llmc(weights), [e for _, _, e in outs]

    def assert_weights(self, ref, got, what):
        assert_weights(self, ref, got, what)

    def check_ranks(self, errs, tp):
        params = None
        for r, err in enumerate(errs):
            self.assertRegex(err, r"plan: rank %d of %d .* at pp 0 tp %d dp %d cp 0: layers 0\.\.1 "
                             r"\+ embeddings \+ LM head, heads %d\.\.%d of 4, vocabulary rows "
                             r"%d\.\.%d of 128"
                             % (r, len(errs), r % tp, r // tp, (r % tp) * 4 // tp,
                                (r % tp + 1) * 4 // tp - 1, (r % tp) * 128 // tp,
                                (r % tp + 1) * 128 // tp - 1))
            self.assertIn("replicated parameters identical on all %d tp ranks" % tp, err)
            have, whole, formula = (int(x) for x in re.search(
                r"model parallel: (\d+) of (\d+) parameters on this rank \(formula (\d+)",
                err).groups())
            self.assertEqual(have, formula)
            # ZeRO's per-rank bytes over this rank's local parameters (16P, 8P + 8P/N, ...)
            off = float(re.search(r"\(formula [\d.]+ MiB, ([+-][\d.]+)%\)", err).group(1))
            self.assertLess(abs(off), 1.0, "rank %d: ZeRO memory %+.2f%% off its formula" % (r, off))
            params = have
        return params

    def test_tp_alone(self):
        for tp in (2, 4):
            for accum in (1, 2):
                with self.subTest(tp=tp, accum=accum):
                    ref, wref = self.single_run(4, accum)
                    got, w, errs = self.run_tp(tp, tp, 0, accum)
                    self.assert_losses(ref, got, "tp=%d accum=%d" % (tp, accum))
                    self.assert_weights(wref, w, "tp=%d accum=%d" % (tp, accum))
                    self.check_ranks(errs, tp)

    def test_tp_with_dp_and_zero(self):
        for zero in (1, 3):
            for accum in (1, 2):
                with self.subTest(zero=zero, accum=accum):
                    ref, wref = self.single_run(8, accum)
                    got, w, errs = self.run_tp(4, 2, zero, accum)
                    what = "tp=2 x dp=2 ZeRO-%d accum=%d" % (zero, accum)
                    self.assert_losses(ref, got, what)
                    self.assert_weights(wref, w, what)
                    self.check_ranks(errs, 2)

    def test_sequence_parallel(self):
        """Megatron-SP: the LayerNorm and residual rows split over the tp group (all-gather
        before column-parallel layers, reduce-scatter after row-parallel ones): the same
        losses and weights, fewer activations per rank."""
        def act_mib(err):
            return float(re.search(r"activations: ([\d.]+) MiB", err).group(1))
        for world, tp, zero, accum in ((2, 2, 0, 1), (4, 4, 0, 2), (4, 2, 3, 1)):
            with self.subTest(world=world, tp=tp, zero=zero, accum=accum):
                ref, wref = self.single_run(4 * world // tp, accum)
                what = "tp=%d dp=%d ZeRO-%d accum=%d --sp" % (tp, world // tp, zero, accum)
                got, w, errs = self.run_tp(world, tp, zero, accum, extra=["--sp"],
                                           tag="sp_w%d_tp%d_z%d_k%d" % (world, tp, zero, accum))
                self.assert_losses(ref, got, what)
                self.assert_weights(wref, w, what)
                self.check_ranks(errs, tp)
                _, _, plain = self.run_tp(world, tp, zero, accum)
                for r, err in enumerate(errs):
                    self.assertIn("sequence parallel: residual stream split over tp", err)
                    self.assertLess(act_mib(err), act_mib(plain[r]), "rank %d" % r)
                    print("\n  %s rank %d: activations %.2f MiB, without SP %.2f MiB"
                          % (what, r, act_mib(err), act_mib(plain[r])), file=sys.stderr)

    def test_sampling(self):
        """--sample after training: under tensor parallelism every rank runs the forward pass
        and the last position's vocabulary slices are gathered (ZeRO-3 also gathers the weights
        layer by layer); rank 0 prints the same text as one process."""
        def sample(world, tp, zero, batch, tag):
            kv = tempfile.mkdtemp(prefix="kv_" + tag, dir=self.tmp)
            outs = dp.wait_all(dp.launch(world, lambda r: dp.base_args(
                batch, 1, os.path.join(self.tmp, tag + ".jsonl")) + [
                "--tp", str(tp), "--zero-stage", str(zero), "--sample", "24"], kv))
            dp.assert_ranks_ok(outs, tag)
            text = re.search(r"---- sample .*?---- end of sample ----", outs[0][1], re.S)
            self.assertIsNotNone(text, "%s: no sample on rank 0's stdout" % tag)
            for r, (_, out, _) in enumerate(outs[1:], 1):
                self.assertNotIn("---- sample", out, "%s: rank %d printed too" % (tag, r))
            return text.group(0)
        one = sample(1, 1, 0, 8, "sample_one")
        self.assertEqual(len(re.findall(r"\[\d+\]", one)), 32 + 24, one)  # prompt + sample
        for world, tp, zero in ((2, 2, 0), (4, 2, 3)):
            with self.subTest(tp=tp, dp=world // tp, zero=zero):
                self.assertEqual(sample(world, tp, zero, 8 * tp // world, "sample_w%d_tp%d_z%d"
                                        % (world, tp, zero)), one)

    def test_checkpoints_across_layouts(self):
        ref, _ = self.single_run(8, 1)

        def part(world, tp, zero, batch, m, ckpt, first, extra):
            kv = os.path.join(self.tmp, "kv_x_%s_%d_%d" % (os.path.basename(ckpt), world, first))
            base = dp.base_args(batch, 1, m) + ["--ckpt-dir", ckpt, "--tp", str(tp),
                                                "--zero-stage", str(zero)] + extra
            if not first:  # the weights come from the checkpoint
                base = [a for a in base if not a.startswith("llmc:") and a != "--init"]
                base += ["--resume"]
            outs = dp.wait_all(dp.launch(world, lambda r: base, kv))
            dp.assert_ranks_ok(outs, "world %d tp %d" % (world, tp))

        # tp=2 x dp=2 (ZeRO-1) to step 4, then dp=4 (ZeRO-2), and one process, to the end
        for name, world, tp, zero, batch in (("dp4", 4, 1, 2, 2), ("one", 1, 1, 0, 8)):
            with self.subTest(resume_as=name):
                ckpt = os.path.join(self.tmp, "ckpt_tp_to_" + name)
                m1, m2 = (os.path.join(self.tmp, "x_%s_%d.jsonl" % (name, i)) for i in (1, 2))
                part(4, 2, 1, 4, m1, ckpt, True, ["--stop-at", "4"])
                with open(os.path.join(ckpt, "step-00000004", "MANIFEST")) as f:
                    self.assertIn("world 4", f.read())
                part(world, tp, zero, batch, m2, ckpt, False, [])
                self.assert_losses(ref, dp.read_metrics(m1) + dp.read_metrics(m2),
                                   "tp2 x dp2 -> " + name)
        # one process to step 4, then tp=2 (one dp rank: the same global batch)
        with self.subTest(resume_as="tp2"):
            ckpt = os.path.join(self.tmp, "ckpt_one_to_tp2")
            m1, m2 = (os.path.join(self.tmp, "y_%d.jsonl" % i) for i in (1, 2))
            part(1, 1, 0, 8, m1, ckpt, True, ["--stop-at", "4"])
            part(2, 2, 0, 8, m2, ckpt, False, [])
            self.assert_losses(ref, dp.read_metrics(m1) + dp.read_metrics(m2), "one -> tp2")

    def test_bad_layouts(self):
        cases = [
            # (world, tp, what the error must say)
            (3, 3, "model.heads (4) must be divisible by parallel.tp (3)"),
            (3, 2, "--tp 2 x --pp 1 x --cp 1 does not divide WORLD_SIZE 3"),
        ]
        for world, tp, msg in cases:
            with self.subTest(world=world, tp=tp):
                kv = os.path.join(self.tmp, "kv_bad_%d_%d" % (world, tp))
                outs = dp.wait_all(dp.launch(world, lambda r: dp.base_args(
                    4, 1, os.path.join(self.tmp, "bad.jsonl")) + ["--tp", str(tp)], kv,
                    {"DISTRAIN_COMM_TIMEOUT_MS": "10000"}), timeout=60)
                for rc, _, err in outs:
                    self.assertNotEqual(rc, 0)
                    self.assertIn(msg, err)
                    self.assertNotIn("step ", err.replace("--stop", ""))
        # the padded vocabulary (128) split 256 ways: checked before the model is built
        env = dict(os.environ, DISTRAIN_MESH="pp1,dp1,cp1,tp256", WORLD_SIZE="256", RANK="0",
                   DISTRAIN_KV_DIR=os.path.join(self.tmp, "kv_vp"))
        p = subprocess.run(dp.base_args(4, 1, os.path.join(self.tmp, "bad.jsonl")), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertRegex(p.stderr, r"must be divisible by parallel\.tp \(256\)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    args, rest = ap.parse_known_args()
    dp.BUILD = os.path.abspath(args.build)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
