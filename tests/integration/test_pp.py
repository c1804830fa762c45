"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) composed with tensor and data parallelism and ZeRO:
exactness against one process, activation slots, checkpoints across layouts, bad input.

Runs the real distrain-train binary as WORLD_SIZE processes (rendezvous through a shared
DISTRAIN_KV_DIR; --pp P stages, outermost in rank order, --tp T neighbours, dp the rest) on a
4-layer model (L4 H4 C64, V 100 padded to 128, GPT-2 init from a seed) and the golden data,
4 micro-batches per step, and checks:
  * pp in {2, 4} under GPipe and 1F1B, pp=2 x dp=2 under ZeRO-1 and ZeRO-3, pp=2 x tp=2 (also
    with sequence parallelism) and pp=2 x tp=2 x dp=2 under ZeRO-1, and the interleaved
    schedule (pp=2 with 2 chunks per stage, alone, with recompute, with tp=2 x dp=2 under
    ZeRO-3; pp=4 with 2 chunks on an 8-layer model): the per-step loss equals the
    single-process run on the same global batch within 1e-5 relative, and the final weights
    (llm.c export) within 1e-5 relative (L2; no element off by more than 1e-4);
  * each stage logs its layers, and keeps at most min(pp - stage, m) micro-batches of
    activations under 1F1B, m under GPipe;
  * activation checkpointing (--recompute) gives the same results with fewer activations;
  * a pp=2 x tp=2 checkpoint resumes as dp=4 and as one process, an interleaved pp=2 one as
    one process, and a one-process checkpoint resumes as pp=2 x tp=2: every continuation
    follows the one-process trajectory;
  * an explicit partition (--pp-partition 3,1) is followed exactly;
  * text generation (--sample) through a pipeline, also with tp x dp under ZeRO-3 and the
    interleaved schedule, prints the one-process text;
  * a stage killed mid-training: its neighbour fails with an error at once, naming the stage;
  * pp > layers, a partition that does not cover the layers, an interleaved schedule whose
    micro-batches are not a multiple of pp or whose virtual stages outnumber the layers, and
    virtual stages without the interleaved schedule: a one-line error naming the rule, before
    any training.

    /usr/bin/python3 tests/integration/test_pp.py --build build
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_dp as dp  # noqa: E402  (the launcher)
import test_tp as tpt  # noqa: E402  (llm.c weights reader)

REL_TOL = 1e-5
ACCUM = 4
MODEL = ["--layers", "4", "--heads", "4", "--channels", "64", "--vocab", "100",
         "--max-seq", "64"]


def args(batch, metrics, weights=None, init=True, layers=4):
    a = dp.base_args(batch, ACCUM, metrics)
    i = a.index("--init")
    a[i:i + 2] = ["--init", "seed:7"] if init else []
    a += MODEL + ["--layers", str(layers)]
    return a + (["--export-llmc", weights] if weights else [])


class PipelineParallel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dt_pp_")
        cls.single = {}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def single_run(self, global_batch, layers=4):
        key = (global_batch, layers)
        if key not in self.single:
            m = os.path.join(self.tmp, "single_%d_L%d.jsonl" % key)
            w = os.path.join(self.tmp, "single_%d_L%d.bin" % key)
            subprocess.run(args(global_batch, m, w, layers=layers), check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.single[key] = (dp.read_metrics(m), tpt.read_llmc(w))
        return self.single[key]

    def run_mesh(self, pp, tp, dpn, zero=0, schedule="1f1b", recompute=False, extra=(),
                 layers=4):
        tag = "pp%d_tp%d_dp%d_z%d_%s_r%d_L%d%s" % (pp, tp, dpn, zero, schedule, recompute, layers,
                                                    "".join(extra))
        kv = tempfile.mkdtemp(prefix="kv_" + tag, dir=self.tmp)  # fresh: no stale addresses
        metrics = os.path.join(self.tmp, tag + ".jsonl")
        weights = os.path.join(self.tmp, tag + ".bin")
        world = pp * tp * dpn
        outs = dp.wait_all(dp.launch(world, lambda r: args(4, metrics, weights, layers=layers) + [
            "--pp", str(pp), "--tp", str(tp), "--zero-stage", str(zero),
            "--pp-schedule", schedule] + (["--recompute"] if recompute else []) + list(extra), kv,
            {"DISTRAIN_COMM_TIMEOUT_MS": "60000"}), timeout=300)
        dp.assert_ranks_ok(outs, tag)
        return dp.read_metrics(metrics), tpt.read_llmc(weights), [e for _, _, e in outs]

    def check(self, pp, tp, dpn, zero=0, schedule="1f1b", recompute=False, extra=(), layers=4,
              chunks=1):
        what = "pp=%d tp=%d dp=%d ZeRO-%d %s%s%s" % (pp, tp, dpn, zero, schedule,
                                                     " recompute" if recompute else "",
                                                     " ".join(extra))
        if chunks > 1:
            extra = tuple(extra) + ("--pp-virtual", str(chunks))
        ref, wref = self.single_run(4 * dpn, layers)
        got, w, errs = self.run_mesh(pp, tp, dpn, zero, schedule, recompute, extra, layers)
        self.assertEqual(len(ref), len(got), what)
        for a, b in zip(ref, got):
            rel = abs(a["loss"] - b["loss"]) / abs(a["loss"])
            self.assertLess(rel, REL_TOL, "%s step %d: loss %.9g vs one process %.9g"
                            % (what, a["step"], b["loss"], a["loss"]))
        tpt.assert_weights(self, wref, w, what)
        per = layers // (pp * chunks)
        if pp == 1:
            return errs
        for m in got:  # the first stage's share of each step spent waiting
            self.assertTrue(0.0 <= m["bubble"] < 1.0, m)
        for r, err in enumerate(errs):
            stage = r // (tp * dpn)
            held = ", ".join("%d..%d" % ((c * pp + stage) * per, (c * pp + stage) * per + per - 1)
                             for c in range(chunks))
            self.assertIn("at pp %d tp %d dp %d cp 0: layers %s%s%s," % (
                stage, r % tp, (r // tp) % dpn, held, " + embeddings" if stage == 0 else "",
                " + LM head" if stage == pp - 1 else ""), err)
            slots = {"gpipe": ACCUM, "1f1b": min(pp - stage, ACCUM)}.get(schedule)
            line = re.search(r"pipeline: stage %d of %d, schedule %s, %d micro-batches per step, "
                             r"(\d+) activation slots over %d model chunks?" % (
                                 stage, pp, schedule, ACCUM, chunks), err)
            self.assertTrue(line, err)
            if slots:
                self.assertEqual(int(line.group(1)), slots)
            have, formula = (int(x) for x in re.search(
                r"model parallel: (\d+) of \d+ parameters on this rank \(formula (\d+)",
                err).groups())
            self.assertEqual(have, formula)
            off = float(re.search(r"\(formula [\d.]+ MiB, ([+-][\d.]+)%\)", err).group(1))
            self.assertLess(abs(off), 1.0, "rank %d: ZeRO memory %+.2f%% off its formula" % (r, off))
        return errs

    def test_activation_checkpointing(self):
        """Recomputing each layer's forward in the backward pass changes no bit of the result
        (one process, a GPipe pipeline, and pp x tp x dp with ZeRO-1), and keeps less."""
        def act_mib(err):
            return float(re.search(r"activations: ([\d.]+) MiB", err).group(1))
        for pp, tp, dpn, zero, schedule in ((1, 1, 1, 0, "1f1b"), (2, 1, 1, 0, "gpipe"),
                                            (2, 2, 2, 1, "1f1b")):
            with self.subTest(pp=pp, tp=tp, dp=dpn, schedule=schedule):
                errs = self.check(pp, tp, dpn, zero, schedule, recompute=True)
                _, _, plain = self.run_mesh(pp, tp, dpn, zero, schedule)
                for r, err in enumerate(errs):
                    self.assertIn("activation checkpointing: layer outputs only", err)
                    self.assertLess(act_mib(err), act_mib(plain[r]),
                                    "rank %d keeps no less with recompute" % r)

    def test_pipeline_schedules(self):
        for pp in (2, 4):
            for schedule in ("gpipe", "1f1b"):
                with self.subTest(pp=pp, schedule=schedule):
                    self.check(pp, 1, 1, schedule=schedule)

    def test_interleaved(self):
        """Interleaved 1F1B: two chunks per stage (rank 0 holds layers 0 and 2), alone, with
        recompute, composed with tp x dp and ZeRO-3, and pp=4 on an 8-layer model."""
        for pp, tp, dpn, zero, recompute, layers in ((2, 1, 1, 0, False, 4), (2, 1, 1, 0, True, 4),
                                                     (2, 2, 2, 3, False, 4),
                                                     (4, 1, 1, 0, False, 8)):
            with self.subTest(pp=pp, tp=tp, dp=dpn, zero=zero, recompute=recompute):
                self.check(pp, tp, dpn, zero, "interleaved", recompute, layers=layers, chunks=2)

    def test_pipeline_with_dp_zero_and_tp(self):
        for pp, tp, dpn, zero in ((2, 1, 2, 1), (2, 1, 2, 3), (2, 2, 1, 0), (2, 2, 2, 1)):
            with self.subTest(pp=pp, tp=tp, dp=dpn, zero=zero):
                self.check(pp, tp, dpn, zero)
        with self.subTest(pp=2, tp=2, sequence_parallel=True):
            self.check(2, 2, 1, 0, extra=["--sp"])

    def test_checkpoints_across_layouts(self):
        ref, _ = self.single_run(8)

        def part(pp, tp, dpn, zero, m, ckpt, first, extra):
            world = pp * tp * dpn
            kv = os.path.join(self.tmp, "kv_x_%s_%d_%d" % (os.path.basename(ckpt), world, first))
            a = args(8 // dpn, m, init=first) + ["--ckpt-dir", ckpt, "--pp", str(pp), "--tp",
                                                 str(tp), "--zero-stage", str(zero)] + extra
            if not first:
                a += ["--resume"]
            outs = dp.wait_all(dp.launch(world, lambda r: a, kv), timeout=300)
            dp.assert_ranks_ok(outs, "pp %d tp %d dp %d" % (pp, tp, dpn))

        def assert_follows(got, what):
            self.assertEqual(len(ref), len(got), what)
            for a, b in zip(ref, got):
                self.assertLess(abs(a["loss"] - b["loss"]) / abs(a["loss"]), REL_TOL,
                                "%s step %d: %.9g vs %.9g" % (what, a["step"], b["loss"],
                                                              a["loss"]))

        for name, layout in (("dp4", (1, 1, 4, 2)), ("one", (1, 1, 1, 0))):
            with self.subTest(resume_as=name):
                ckpt = os.path.join(self.tmp, "ckpt_pptp_to_" + name)
                m1, m2 = (os.path.join(self.tmp, "x_%s_%d.jsonl" % (name, i)) for i in (1, 2))
                part(2, 2, 1, 0, m1, ckpt, True, ["--stop-at", "4"])
                with open(os.path.join(ckpt, "step-00000004", "MANIFEST")) as f:
                    self.assertIn("world 4", f.read())
                part(*layout, m2, ckpt, False, [])
                assert_follows(dp.read_metrics(m1) + dp.read_metrics(m2), "pp2 x tp2 -> " + name)
        with self.subTest(interleaved_resume_as="one"):
            ckpt = os.path.join(self.tmp, "ckpt_interleaved_to_one")
            m1, m2 = (os.path.join(self.tmp, "z_%d.jsonl" % i) for i in (1, 2))
            part(2, 1, 1, 0, m1, ckpt, True, ["--stop-at", "4", "--pp-schedule", "interleaved"])
            part(1, 1, 1, 0, m2, ckpt, False, [])
            assert_follows(dp.read_metrics(m1) + dp.read_metrics(m2), "interleaved pp2 -> one")
        with self.subTest(resume_as="pp2_tp2"):
            ckpt = os.path.join(self.tmp, "ckpt_one_to_pptp")
            m1, m2 = (os.path.join(self.tmp, "y_%d.jsonl" % i) for i in (1, 2))
            part(1, 1, 1, 0, m1, ckpt, True, ["--stop-at", "4"])
            part(2, 2, 1, 0, m2, ckpt, False, [])
            assert_follows(dp.read_metrics(m1) + dp.read_metrics(m2), "one -> pp2 x tp2")

    def test_explicit_partition(self):
        ref, wref = self.single_run(4)
        got, w, errs = self.run_mesh(2, 1, 1, extra=("--pp-partition", "3,1"))
        self.assertEqual(len(ref), len(got))
        for a, b in zip(ref, got):
            self.assertLess(abs(a["loss"] - b["loss"]) / abs(a["loss"]), REL_TOL)
        tpt.assert_weights(self, wref, w, "pp=2 partition 3,1")
        self.assertIn("at pp 0 tp 0 dp 0 cp 0: layers 0..2 + embeddings,", errs[0])
        self.assertIn("at pp 1 tp 0 dp 0 cp 0: layers 3..3 + LM head,", errs[1])

    def test_sampling_through_the_pipeline(self):
        """--sample through a pipeline (the last stage samples each token and sends it to the
        others), composed with tp x dp under ZeRO-3 and with the interleaved schedule, and under
        sequence parallelism: the text of one process trained on the same global batch."""
        def sample(world, extra, batch=4):
            tag = "sample_%d_%s" % (batch, "_".join(extra))
            a = args(batch, os.path.join(self.tmp, tag + ".jsonl")) + ["--sample", "24"]
            return dp.sample_text(a + list(extra), world, self.tmp, tag)
        ref = {4: sample(1, ()), 8: sample(1, (), 8)}
        self.assertEqual(len(re.findall(r"\[\d+\]", ref[4])), 32 + 24, ref[4])  # prompt + 24
        for world, extra, batch in ((2, ("--pp", "2"), 4),
                                    (8, ("--pp", "2", "--tp", "2", "--zero-stage", "3"), 8),
                                    (2, ("--pp", "2", "--pp-schedule", "interleaved",
                                         "--pp-virtual", "2"), 4)):
            with self.subTest(extra=" ".join(extra)):
                self.assertEqual(sample(world, extra), ref[batch])
        # Sequence parallelism splits each window's rows among the tp ranks, padded to a multiple
        # of tp: at seq 64 the windows grow from the 32-token prompt through odd lengths.
        long = ("--seq", "64")
        ref_long = sample(1, long)
        for world, extra in ((2, ("--tp", "2", "--sp")), (4, ("--pp", "2", "--tp", "2", "--sp"))):
            with self.subTest(extra=" ".join(long + extra)):
                self.assertEqual(sample(world, long + extra), ref_long)

    def test_stage_dies_mid_training(self):
        """A stage killed mid-step: its neighbour fails at once with an error, not a hang."""
        metrics = os.path.join(self.tmp, "dies.jsonl")
        a = args(4, metrics)
        a[a.index("--steps") + 1] = "100000"
        procs = dp.launch(2, lambda r: a + ["--pp", "2"],
                          tempfile.mkdtemp(prefix="kv_dies", dir=self.tmp),
                          {"DISTRAIN_COMM_TIMEOUT_MS": "5000"})
        deadline = time.time() + 60
        while time.time() < deadline and not (os.path.exists(metrics)
                                              and len(dp.read_metrics(metrics)) >= 3):
            time.sleep(0.05)
        self.assertGreaterEqual(len(dp.read_metrics(metrics)), 3, "training never started")
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.time()
        _, err = procs[0].communicate(timeout=60)
        procs[1].communicate()
        self.assertNotEqual(procs[0].returncode, 0, "the survivor must fail, not finish")
        self.assertLess(time.time() - t0, 5.0 + 5.0)
        self.assertRegex(err, r"(?i)(closed|remote|peer|timed out)")
        # the communicator named by its label: the world (the pipeline's, at pp 2 alone) in a
        # transfer, as most kills find the survivor, or the first and last stages' group ("emb")
        # in the tied embeddings' all-reduce; after a transfer (its sends, or the wait for a
        # receive it left in flight), the stage it exchanged with
        op = re.search(r"comm (world|emb) \(\S+\) rank 0/2: (\S+) failed", err)
        self.assertIsNotNone(op, err[-2000:])
        if op.group(2) in ("send/recv", "send", "recv"):
            self.assertIn("pipeline stage 0 of 2: the transfer with stage 1 failed", err)

    def test_bad_layouts(self):
        kv = os.path.join(self.tmp, "kv_bad")
        outs = dp.wait_all(dp.launch(8, lambda r: args(4, os.path.join(self.tmp, "bad.jsonl"))
                                     + ["--pp", "8"], kv), timeout=60)
        for rc, _, err in outs:
            self.assertNotEqual(rc, 0)
            self.assertIn("parallel.pp (8) must be <= model.layers (4)", err)
        kv = os.path.join(self.tmp, "kv_bad_partition")
        outs = dp.wait_all(dp.launch(2, lambda r: args(4, os.path.join(self.tmp, "bad.jsonl"))
                                     + ["--pp", "2", "--pp-partition", "2,1"], kv), timeout=60)
        for rc, _, err in outs:
            self.assertNotEqual(rc, 0)
            self.assertIn("parallel.partition '2,1' gives 2 stages 3 layers", err)
        for name, extra, rule in (
                ("accum", ["--pp-schedule", "interleaved", "--grad-accum", "3"],
                 "the micro-batches per step (3, the gradient accumulation) must be a multiple "
                 "of parallel.pp (2)"),
                ("layers", ["--pp-schedule", "interleaved", "--pp-virtual", "4"],
                 "model.layers (4) must be >= parallel.pp x parallel.virtual_stages (8)"),
                ("virtual", ["--pp-virtual", "2"],
                 "parallel.virtual_stages (2) > 1 needs parallel.schedule interleaved")):
            kv = os.path.join(self.tmp, "kv_bad_" + name)
            outs = dp.wait_all(dp.launch(2, lambda r: args(4, os.path.join(self.tmp, "bad.jsonl"))
                                         + ["--pp", "2"] + extra, kv), timeout=60)
            for rc, _, err in outs:
                self.assertNotEqual(rc, 0)
                self.assertIn(rule, err)
        kv = os.path.join(self.tmp, "kv_bad_sample_sp")  # a window of 31 rows cannot split in 2
        outs = dp.wait_all(dp.launch(2, lambda r: args(4, os.path.join(self.tmp, "bad.jsonl"))
                                     + ["--tp", "2", "--sp", "--sample", "5", "--seq", "31"], kv),
                           timeout=60)
        for rc, _, err in outs:
            self.assertNotEqual(rc, 0)
            self.assertIn("--sample needs --seq (31) divisible by 2 (--tp under --sp)", err)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ns, rest = ap.parse_known_args()
    dp.BUILD = os.path.abspath(ns.build)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
