"""Context parallelism: each sequence split into 2 x cp chunks, rank r holding chunks r and
2cp-1-r (zig-zag, for equal attention work), composed with data, tensor and pipeline
parallelism and ZeRO: exactness against one process, checkpoints across layouts, bad input.

Runs the real distrain-train binary as WORLD_SIZE processes (rendezvous through a shared
DISTRAIN_KV_DIR, --cp N) on the tiny golden model and data (seq 32), and checks:
  * cp in {2, 4}, cp=2 with gradient accumulation, cp=2 x dp=2 under ZeRO-1 and ZeRO-3,
    cp=2 x tp=2 (with and without --sp), cp=2 x pp=2 (1F1B) and cp=2 with activation
    checkpointing, and compositions of four axes and the options (cp x pp x dp under ZeRO-2,
    cp x tp x pp with --sp, cp x tp x dp under ZeRO-3 with --sp, cp x tp x pp with --sp and
    recompute, cp x dp under ZeRO-2 with recompute): the per-step loss equals the
    single-process run on the same global batch within 1e-5 relative, and the final weights
    within 1e-5 (relative L2);
  * every rank logs the sequence chunk it holds;
  * a cp=2 x dp=2 checkpoint resumes as one process on the same trajectory;
  * --sample under cp=2, cp=4, cp=2 x tp=2 with --sp and cp=2 x pp=2 prints one process's text;
  * 2 x cp not dividing the sequence: a one-line error naming the rule, before any training.

    /usr/bin/python3 tests/integration/test_cp.py --build build
"""

import argparse
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_dp as dp  # noqa: E402  (the launcher and the single-process reference)
import test_tp as tp  # noqa: E402  (weights comparison, llm.c reader)


class ContextParallel(tp.OneProcessReference):
    PREFIX = "dt_cp_"

    def run_cp(self, world, batch, accum, args, tag):
        kv = tempfile.mkdtemp(prefix="kv_" + tag, dir=self.tmp)  # fresh: no stale addresses
        metrics = os.path.join(self.tmp, tag + ".jsonl")
        weights = os.path.join(self.tmp, tag + ".bin")
        procs = dp.launch(world, lambda r: dp.base_args(batch, accum, metrics)
                          + ["--export-llmc", weights] + list(args), kv)
        outs = dp.wait_all(procs)
        dp.assert_ranks_ok(outs, tag)
        return dp.read_metrics(metrics), tp.read_llmc(weights), [e for _, _, e in outs]

    def test_layouts(self):
        # world, dp, args, accum; the batch per data-parallel rank is 4
        layouts = [
            (2, 1, ["--cp", "2"], 1),
            (2, 1, ["--cp", "2"], 2),
            (4, 1, ["--cp", "4"], 1),
            (4, 2, ["--cp", "2", "--zero-stage", "1"], 1),
            (4, 2, ["--cp", "2", "--zero-stage", "3"], 2),
            (4, 1, ["--cp", "2", "--tp", "2"], 1),
            (4, 1, ["--cp", "2", "--tp", "2", "--sp"], 1),
            (4, 1, ["--cp", "2", "--pp", "2"], 2),
            (2, 1, ["--cp", "2", "--recompute"], 1),
            # four axes and the options at once
            (8, 2, ["--cp", "2", "--pp", "2", "--zero-stage", "2"], 2),
            (8, 1, ["--cp", "2", "--tp", "2", "--sp", "--pp", "2"], 2),
            (8, 2, ["--cp", "2", "--tp", "2", "--sp", "--zero-stage", "3"], 1),
            (8, 1, ["--cp", "2", "--tp", "2", "--pp", "2", "--sp", "--recompute"], 2),
            (4, 2, ["--cp", "2", "--zero-stage", "2", "--recompute"], 1),
        ]
        for world, dps, args, accum in layouts:
            what = "world %d %s accum %d" % (world, " ".join(args), accum)
            with self.subTest(what):
                ref, wref = self.single_run(4 * dps, accum)
                tag = "w%d_k%d_%s" % (world, accum, "_".join(a.strip("-") for a in args))
                got, w, errs = self.run_cp(world, 4, accum, args, tag)
                self.assert_losses(ref, got, what)
                tp.assert_weights(self, wref, w, what)
                cp = int(args[args.index("--cp") + 1])
                for r, err in enumerate(errs):
                    self.assertRegex(err, r"plan: rank %d of %d .* cp (\d+):.*sequence chunk \1 "
                                     r"of %d" % (r, world, cp))

    def test_checkpoint_resumes_as_one_process(self):
        ref, _ = self.single_run(8, 1)
        ckpt = os.path.join(self.tmp, "ckpt_cp")
        m1, m2 = (os.path.join(self.tmp, "ck_%d.jsonl" % i) for i in (1, 2))
        base = dp.base_args(4, 1, m1) + ["--ckpt-dir", ckpt, "--cp", "2", "--zero-stage", "1",
                                         "--stop-at", "4"]
        outs = dp.wait_all(dp.launch(4, lambda r: base, os.path.join(self.tmp, "kv_ck1")))
        dp.assert_ranks_ok(outs, "cp2 x dp2")
        rest = [a for a in dp.base_args(8, 1, m2) if not a.startswith("llmc:") and a != "--init"]
        subprocess.run(rest + ["--ckpt-dir", ckpt, "--resume"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.assert_losses(ref, dp.read_metrics(m1) + dp.read_metrics(m2), "cp2 x dp2 -> one")

    def test_sampling(self):
        """--sample under context parallelism: each window padded after its end to a multiple
        of 2 cp (2 cp tp under --sp) and split as a training sequence, the rank holding its last
        position sampling: the text of one process. At seq 64 the windows grow from the
        32-token prompt through lengths that no such multiple divides; under cp=4 the padding
        (up to 7) can exceed a chunk (5 positions at 40), so the last real position moves off
        the last chunk's rank."""
        def sample(world, extra):
            tag = "sample_" + "_".join(a.strip("-") for a in extra)
            a = dp.base_args(4, 1, os.path.join(self.tmp, tag + ".jsonl")) + [
                "--seq", "64", "--sample", "24"] + list(extra)
            return dp.sample_text(a, world, self.tmp, tag)
        ref = sample(1, ())
        for world, extra in ((2, ("--cp", "2")), (4, ("--cp", "4")),
                             (4, ("--cp", "2", "--tp", "2", "--sp")),
                             (4, ("--cp", "2", "--pp", "2"))):
            with self.subTest(extra=" ".join(extra)):
                self.assertEqual(sample(world, extra), ref)

    def test_bad_input(self):
        m = os.path.join(self.tmp, "bad.jsonl")
        outs = dp.wait_all(dp.launch(3, lambda r: dp.base_args(4, 1, m) + ["--cp", "3"],
                                     os.path.join(self.tmp, "kv_bad")))
        for rc, _, err in outs:
            self.assertNotEqual(rc, 0)
            self.assertIn("training.seq (32) must be divisible by 2 x parallel.cp (3): context "
                          "parallelism splits each sequence into 2 x cp chunks", err)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    args, rest = ap.parse_known_args()
    dp.BUILD = os.path.abspath(args.build)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
