"""Layouts drawn at random: every composition of the parallel axes and options trains as one
process does, and a checkpoint moves between any two of them.

The fixed compositions live in test_dp, test_tp, test_pp and test_cp; this samples the space
they span, seeded, so that a combination nobody wrote down is tried too. On the tiny golden
model and data (L2 NH4 C64, seq 32), as WORLD_SIZE processes of distrain-train (rendezvous
through a shared DISTRAIN_KV_DIR):
  * DT_LAYOUTS (default 16) layouts of up to 8 ranks: tp, pp, cp in {1, 2} and dp in {1, 2, 3},
    each with a random micro-batch and accumulation, fp32 or bf16, flash or materialized
    attention, --sp under tp, a ZeRO stage where dp x cp > 1, a 1F1B or GPipe schedule, --recompute
    and the data-parallel comm thread on or off: the per-step losses equal one process's on
    the same global batch within 1e-5 relative (bf16: 3e-3, its roundings fall elsewhere);
  * DT_LAYOUTS / 2 pairs: 3 steps in one layout with a checkpoint, --resume in another for 3
    more: one process's 6 losses within 1e-5;
  * DT_LAYOUTS / 2 layouts of the golden model trained 20 steps (so that its next token depends
    on the context), each evaluating a multiple-choice set (rows of many lengths, in windows of
    each micro-batch's longest) and generating 40 tokens greedily after a 32-token prompt, past
    the 64-token window, through the key/value cache: one process's summed completion losses within 1e-5 and its tokens.
A failure names the layout; DT_LAYOUT_SEED (default 1) draws other ones.

    /usr/bin/python3 tests/integration/test_layouts.py --build build
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_dp as dp  # noqa: E402  (the multi-rank launcher and the golden model's flags)
from test_eval import random_examples, write_evalfile  # noqa: E402  (llm.c's eval file)

SEED = int(os.environ.get("DT_LAYOUT_SEED", "1"))
COUNT = int(os.environ.get("DT_LAYOUTS", "16"))


def draw(rng, options=True):
    """(world, dp, extra flags, environment) of a random layout of at most 8 ranks."""
    while True:
        tp, pp, cp, d = (rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2]),
                         rng.choice([1, 2, 3]))
        if 1 < tp * pp * cp * d <= 8:
            break
    extra = []
    if tp > 1:
        extra += ["--tp", "2"] + (["--sp"] if rng.random() < 0.5 else [])
    if pp > 1:
        extra += ["--pp", "2"] + (["--pp-schedule", rng.choice(["1f1b", "gpipe"])]
                                  if options else [])
    if cp > 1:
        extra += ["--cp", "2"]
    if d * cp > 1:
        extra += ["--zero-stage", str(rng.choice([0, 1, 2, 3]))]
    if options and rng.random() < 0.4:
        extra += ["--recompute"]
    env = {"DISTRAIN_DP_OVERLAP": rng.choice(["0", "1"])} if options else {}
    return tp * pp * cp * d, d, extra, env


class Layouts(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="dt-layouts-")
        cls.refs = {}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def run_ranks(self, world, batch, accum, steps, extra, env=None, what=""):
        """Per-step losses of one run (rank 0's metrics); fails naming `what` otherwise."""
        metrics = tempfile.mktemp(dir=self.tmp.name, suffix=".jsonl")
        kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp.name)
        argv = dp.base_args(batch, accum, metrics, steps)
        if "--resume" in extra:  # the checkpoint's weights, not the golden file's
            at = argv.index("--init")
            del argv[at:at + 2]
        argv += extra
        outs = dp.wait_all(dp.launch(world, lambda r: argv, kv, env), timeout=300)
        dp.assert_ranks_ok(outs, what)
        return [m["loss"] for m in dp.read_metrics(metrics)]

    def reference(self, batch, accum, steps, extra):
        key = (batch, accum, steps) + tuple(extra)
        if key not in self.refs:
            self.refs[key] = self.run_ranks(1, batch, accum, steps, list(extra), what="reference")
        return self.refs[key]

    def assert_close(self, ref, got, tol, what):
        self.assertEqual(len(got), len(ref), what)
        for i, (a, b) in enumerate(zip(ref, got)):
            self.assertLessEqual(abs(a - b) / abs(a), tol,
                                 "%s: step %d %.9g, one process %.9g" % (what, i + 1, b, a))

    def test_random_layouts_train_as_one_process(self):
        rng = random.Random(SEED)
        for i in range(COUNT):
            world, d, extra, env = draw(rng)
            batch, accum = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
            prec = rng.choice(["fp32", "fp32", "bf16"])
            common = ["--precision", prec, "--attention", rng.choice(["flash", "materialized"])]
            what = "seed %d layout %d: world %d --batch %d --grad-accum %d %s %s" % (
                SEED, i, world, batch, accum, " ".join(common + extra), env)
            with self.subTest(what):
                ref = self.reference(batch * d, accum, 6, common)
                got = self.run_ranks(world, batch, accum, 6, common + extra, env, what)
                self.assert_close(ref, got, 1e-5 if prec == "fp32" else 3e-3, what)

    def test_checkpoints_move_between_random_layouts(self):
        rng = random.Random(SEED + 1000)
        ref = self.reference(6, 2, 6, [])  # a global batch of 6 splits over dp 1, 2 and 3
        for i in range(max(COUNT // 2, 1)):
            (w1, d1, e1, _), (w2, d2, e2, _) = draw(rng, False), draw(rng, False)
            what = "seed %d pair %d: world %d %s, then world %d %s" % (
                SEED, i, w1, " ".join(e1), w2, " ".join(e2))
            with self.subTest(what):
                ckpt = ["--ckpt-dir", tempfile.mkdtemp(prefix="ckpt_", dir=self.tmp.name),
                        "--save-every", "3"]
                got = self.run_ranks(w1, 6 // d1, 2, 3, e1 + ckpt, what=what)
                got += self.run_ranks(w2, 6 // d2, 2, 6, e2 + ckpt + ["--resume"], what=what)
                self.assert_close(ref, got, 1e-5, what)


    def test_random_layouts_sample_and_evaluate_as_one_process(self):
        tmp = self.tmp.name
        model, evalfile = os.path.join(tmp, "trained.bin"), os.path.join(tmp, "eval.bin")
        metrics = os.path.join(tmp, "train.jsonl")
        p = subprocess.run(dp.base_args(4, 1, metrics, 20) + ["--export-llmc", model],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        write_evalfile(evalfile, random_examples(7, 12))

        def run(world, extra, what):
            """Rank 0's sample tokens and per-example summed losses."""
            out = os.path.join(tmp, "eval_%d.jsonl" % random.getrandbits(32))
            argv = [dp.trainer(), "--init", "llmc:" + model, "--steps", "0", "--val",
                    os.path.join(dp.GOLDEN, "tiny_val.bin"), "--seq", "64", "--batch", "2",
                    "--eval", evalfile, "--eval-out", out, "--sample", "40", "--sample-top-k",
                    "1", "--threads", "1", "--quiet"] + extra
            outs = dp.wait_all(dp.launch(world, lambda r: argv, tempfile.mkdtemp(dir=tmp)))
            dp.assert_ranks_ok(outs, what)
            self.assertIn("sample: a key/value cache of 64 positions", outs[0][2], what)
            m = re.search(r"---- sample \(.*\) ----\n(.*)\n---- end of sample", outs[0][1])
            self.assertIsNotNone(m, what + ": " + outs[0][1][-500:])
            with open(out) as f:
                return m.group(1), [json.loads(line)["loss_sum"] for line in f]

        text, sums = run(1, [], "one process")
        self.assertGreater(len(set(re.findall(r"\[\d+\]", text))), 1)  # the context matters
        rng = random.Random(SEED + 2000)
        for i in range(max(COUNT // 2, 1)):
            world, _, extra, env = draw(rng, False)
            what = "seed %d layout %d: world %d %s" % (SEED, i, world, " ".join(extra))
            with self.subTest(what):
                got_text, got_sums = run(world, extra, what)
                self.assertEqual(got_text, text, what)
                for a, b in zip(sums, got_sums):
                    for x, y in zip(a, b):
                        self.assertLessEqual(abs(x - y) / abs(x), 1e-5, what)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    args, rest = ap.parse_known_args()
    dp.BUILD = os.path.abspath(args.build)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
