#!/usr/bin/env python3
"""test_spike.py — distrain-train's loss-spike guard (--spike-factor F; job spec
elastic.spike_factor): a step whose loss is over F times the average of the recent steps' stops
before its update, as a NaN one does, so that the job rolls back and skips that step's batch.

The data is a cycle through the 100 tokens in a random order, which the model learns within
tens of steps, with the windows of one step (SPIKE) replaced by random tokens: that step's loss
is many times the rest. Checks:
  - without the guard the run trains through the spike (so the data does make one); with it,
    the run stops at that step, names it, the loss and the average, and exits non-zero;
  - resumed from its last checkpoint with --skip-steps SPIKE (what the coordinator does), its
    losses equal, bit for bit, those of an uninterrupted run with --skip-steps SPIKE;
  - the average is kept in checkpoints: a run stopped 20 steps before the spike and resumed
    (fewer steps than the guard needs to arm) catches it with the same average, to the bit the
    message prints;
  - --spike-skip 5 names five steps (SPIKE:5) and resumed skipping them equals a run skipping
    them listed one by one; a window past the last step ends at it;
  - --bad-step skip: the spike, its window, or a NaN, taken without an update where it is; the
    run goes on to the losses of a run told --skip-steps (bit for bit), resumed or not; a
    second spike right after rolls back;
  - --grad-spike-factor: the spike's gradient norm stops it the same way, its average kept in
    checkpoints too;
  - dp=2: both ranks stop at the spike, with the same message;
  - bad values are refused with one line.

  /usr/bin/python3 tests/integration/test_spike.py --build build
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
import test_dp as dp  # noqa: E402  (the multi-rank launcher)
from test_blend import write_shard  # noqa: E402  (llm.c's token shard)

BUILD = None
V, B, T, STEPS, SPIKE = 100, 4, 32, 80, 70  # the guard arms after 50 steps


def write_spiky_shard(path, spike_step, count=1):
    """The cycle, with the tokens of the windows (batch B of T, sequential) of count steps from
    spike_step random."""
    order = list(range(V))
    random.Random(1).shuffle(order)
    tokens = [order[i % V] for i in range(B * T * (STEPS + 10))]
    rng = random.Random(2)
    for i in range(B * T * (spike_step - 1) + 1, B * T * (spike_step + count - 1) + 1):
        tokens[i] = rng.randrange(V)  # targets included
    write_shard(path, tokens)


class Spike(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="dt-spike-")
        cls.shard = os.path.join(cls.tmp.name, "spiky.bin")
        write_spiky_shard(cls.shard, SPIKE)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def args(self, *extra):
        return [os.path.join(BUILD, "worker/trainer/distrain-train"), "--train", self.shard,
                "--layers", "2", "--heads", "4", "--channels", "64", "--vocab", str(V),
                "--max-seq", "64", "--batch", str(B), "--seq", str(T), "--steps", str(STEPS),
                "--lr", "1e-2", "--init", "seed:1", "--threads", "1", "--quiet", *extra]

    def run_one(self, *extra, expect=0):
        p = subprocess.run(self.args(*extra), capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, expect, p.stderr)
        return p

    def losses(self, metrics):
        with open(metrics) as f:
            return {m["step"]: m["loss"] for m in map(json.loads, f) if "loss" in m}

    _refs = {}

    def ref(self, skip):
        """The losses of an uninterrupted run told --skip-steps skip (run once per class)."""
        if skip not in Spike._refs:
            path = self.path("ref-%s.jsonl" % skip.replace(":", "_").replace(",", "_"))
            self.run_one("--skip-steps", skip, "--metrics", path)
            Spike._refs[skip] = self.losses(path)
        return Spike._refs[skip]

    def assert_losses(self, metrics, steps, want):
        """The run's metrics hold exactly these steps, each loss want's, bit for bit."""
        got = self.losses(metrics)
        self.assertEqual(sorted(got), list(steps))
        self.assertEqual(got, {s: want[s] for s in got})

    def resume_past_spike(self, tag, *common):
        """Resumed (common: the guard and checkpoints) with --skip-steps SPIKE, what the
        coordinator does: the reference's losses from step 61, bit for bit."""
        resumed = self.path(tag)
        self.run_one(*common, "--resume", "--skip-steps", str(SPIKE), "--metrics", resumed)
        self.assert_losses(resumed, [s for s in range(61, STEPS + 1) if s != SPIKE],
                           self.ref(str(SPIKE)))

    def resumed_at_50(self, ck, *guard):
        """Stopped after step 50 without the guard, resumed with it: 20 steps before the spike,
        fewer than the guard needs to arm without the checkpoint's average. Its stderr."""
        self.run_one("--ckpt-dir", ck, "--save-every", "25", "--stop-at", "50")
        return self.run_one(*guard, "--ckpt-dir", ck, "--save-every", "25", "--resume", expect=1)

    def caught(self, stderr, skips="this step's batch", resume=str(SPIKE)):
        """The guard's message: (loss, the average), for step SPIKE."""
        m = re.search(r"ERROR step %d: loss ([0-9.]+), [0-9.]+x the average of the recent "
                      r"steps' \(([0-9.]+); --spike-factor 3\): a spike; stopped before the "
                      r"update \(under distrainctl the job rolls back to its last checkpoint "
                      r"and skips %s; alone, resume with --skip-steps %s\)"
                      % (SPIKE, re.escape(skips), resume), stderr)
        self.assertIsNotNone(m, stderr)
        self.assertIn("failed: loss or gradient-norm spike (--spike-factor, --grad-spike-factor)",
                      stderr)
        return m.group(1), m.group(2)

    def test_caught_and_rolled_back(self):
        plain = self.path("plain.jsonl")
        self.run_one("--metrics", plain)
        losses = self.losses(plain)
        before = [losses[s] for s in range(SPIKE - 10, SPIKE)]
        self.assertGreater(losses[SPIKE], 5 * max(before))  # the data makes a spike
        ck = self.path("ck")
        p = self.run_one("--spike-factor", "3", "--ckpt-dir", ck, "--save-every", "20", expect=1)
        loss, avg = self.caught(p.stderr)
        self.assertIn("--spike-factor 3: armed once 50 more steps have set the average loss",
                      p.stderr)
        self.assertAlmostEqual(float(loss), losses[SPIKE], places=3)
        self.assertEqual(sorted(os.listdir(ck)), ["step-00000020", "step-00000040",
                                                  "step-00000060"])
        self.resume_past_spike("resumed.jsonl", "--spike-factor", "3", "--ckpt-dir", ck,
                               "--save-every", "20")
        # the average comes back from a checkpoint
        p = self.resumed_at_50(self.path("ck2"), "--spike-factor", "3")
        self.assertEqual(self.caught(p.stderr), (loss, avg))
        self.assertRegex(p.stderr, r"--spike-factor 3: armed \(the recent steps' average loss "
                         r"from the checkpoint: [0-9.]+\)")

    def test_skip_window(self):
        """--spike-skip 5: the message names steps SPIKE..SPIKE+4 and --skip-steps SPIKE:5,
        which resumes to the losses of an uninterrupted run skipping the five steps listed one
        by one (bit for bit); a window past the last step ends at it."""
        ck = self.path("ckw")
        p = self.run_one("--spike-factor", "3", "--spike-skip", "5", "--ckpt-dir", ck,
                         "--save-every", "20", expect=1)
        self.caught(p.stderr, "the batches of steps %d-%d (--spike-skip 5)" % (SPIKE, SPIKE + 4),
                    "%d:5" % SPIKE)
        resumed, ref = self.path("resumed-w.jsonl"), self.path("ref-w.jsonl")
        self.run_one("--spike-factor", "3", "--spike-skip", "5", "--ckpt-dir", ck, "--save-every",
                     "20", "--resume", "--skip-steps", "%d:5" % SPIKE, "--metrics", resumed)
        self.run_one("--skip-steps", ",".join(str(SPIKE + k) for k in (4, 0, 2, 1, 3, 2)),
                     "--metrics", ref)
        self.assert_losses(resumed, [s for s in range(61, STEPS + 1)
                                     if not SPIKE <= s < SPIKE + 5], self.losses(ref))
        args = self.args("--spike-factor", "3", "--spike-skip", "50")
        args[args.index("--steps") + 1] = str(SPIKE + 2)
        p = subprocess.run(args, capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.caught(p.stderr, "the batches of steps %d-%d (--spike-skip 50)" % (SPIKE, SPIKE + 2),
                    "%d:3" % SPIKE)

    def test_skipped_in_place(self):
        """--bad-step skip: the spike (or a NaN) is taken without an update where it is and the
        run goes on, its losses those of a run told --skip-steps, bit for bit (a window too);
        resumed from a checkpoint after the skip, without --skip-steps, still (the updates so
        far are in the checkpoint: AdamW's bias correction); a second spike right after the
        first rolls back."""
        here = self.path("here.jsonl")
        p = self.run_one("--spike-factor", "3", "--bad-step", "skip", "--metrics", here)
        self.assertRegex(p.stderr, r"WARN step %d: loss [0-9.]+, [0-9.]+x the average of the "
                         r"recent steps' \([0-9.]+; --spike-factor 3\): a spike; skipped where "
                         r"it is: no update \(--bad-step skip; this step only\), training goes "
                         r"on" % SPIKE)
        self.assertEqual(self.losses(here), self.ref(str(SPIKE)))
        self.run_one("--spike-factor", "3", "--bad-step", "skip", "--spike-skip", "3",
                     "--metrics", here)
        self.assertEqual(self.losses(here), self.ref("%d:3" % SPIKE))
        # stopped after the skip, resumed without --skip-steps: the same losses
        ck = self.path("ck-here")
        common = ("--spike-factor", "3", "--bad-step", "skip", "--ckpt-dir", ck,
                  "--save-every", "25")
        self.run_one(*common, "--stop-at", str(SPIKE + 3))
        part = self.path("part-here.jsonl")
        self.run_one(*common, "--resume", "--metrics", part)
        self.assert_losses(part, range(SPIKE + 4, STEPS + 1), self.ref(str(SPIKE)))
        # stopped inside a window (70-72 skipped, stopped after 71): the rest of it is skipped
        ck3 = self.path("ck-here3")
        common = ("--spike-factor", "3", "--bad-step", "skip", "--spike-skip", "3", "--ckpt-dir",
                  ck3, "--save-every", "25")
        self.run_one(*common, "--stop-at", str(SPIKE + 1))
        p = self.run_one(*common, "--resume", "--metrics", part)
        self.assertIn("steps %d-%d: the rest of a window skipped where it was"
                      % (SPIKE + 2, SPIKE + 2), p.stderr)
        self.assert_losses(part, range(SPIKE + 3, STEPS + 1), self.ref("%d:3" % SPIKE))
        # a NaN is skipped where it is as well
        nan = self.path("nan-here.jsonl")
        p = subprocess.run(self.args("--bad-step", "skip", "--metrics", nan), capture_output=True,
                           text=True, timeout=120, env=dict(os.environ,
                                                            DISTRAIN_FAULT_NAN_STEP="30"))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("WARN step 30: loss nan, gradient norm", p.stderr)
        got = self.losses(nan)
        self.assertEqual(got, {s: v for s, v in self.ref("30").items() if s in got})
        self.assertNotIn(30, got)
        # two spiky steps in a row: the second is not skipped in place, it rolls back
        shard2 = self.path("spiky2.bin")
        write_spiky_shard(shard2, SPIKE, count=2)
        args = self.args("--spike-factor", "3", "--bad-step", "skip")
        args[args.index("--train") + 1] = shard2
        p = subprocess.run(args, capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("WARN step %d: loss" % SPIKE, p.stderr)
        self.assertRegex(p.stderr, r"ERROR step %d: loss [0-9.]+, .*: a spike; stopped before "
                         r"the update .* resume with --skip-steps %d\) \(right after a step "
                         r"skipped where it was: --bad-step skip\)" % (SPIKE + 1, SPIKE + 1))

    def test_gradient_norm_spike(self):
        """--grad-spike-factor 3 alone: the spike's gradient norm stops the run before the update
        (the message names it, the norm and the average); resumed with --skip-steps it equals the
        reference bit for bit; the average comes back from a checkpoint (stopped 20 steps
        before); --bad-step skip goes on as a run told --skip-steps."""
        ck = self.path("ck-grad")
        common = ("--grad-spike-factor", "3", "--ckpt-dir", ck, "--save-every", "20")
        p = self.run_one(*common, expect=1)
        self.assertIn("--grad-spike-factor 3: armed once 50 more steps have set the average "
                      "gradient norm", p.stderr)
        pattern = (r"ERROR step %d: gradient norm ([0-9.]+), [0-9.]+x the average of the recent "
                   r"steps' \(([0-9.]+); --grad-spike-factor 3\): a spike; stopped before the "
                   r"update \(under distrainctl the job rolls back to its last checkpoint and "
                   r"skips this step's batch; alone, resume with --skip-steps %d\)"
                   % (SPIKE, SPIKE))
        caught = re.search(pattern, p.stderr)
        self.assertIsNotNone(caught, p.stderr)
        self.resume_past_spike("resumed-grad.jsonl", *common)
        p = self.resumed_at_50(self.path("ck-grad2"), "--grad-spike-factor", "3")
        again = re.search(pattern, p.stderr)
        self.assertIsNotNone(again, p.stderr)
        self.assertEqual(again.groups(), caught.groups())
        self.assertRegex(p.stderr, r"--grad-spike-factor 3: armed \(the recent steps' average "
                         r"gradient norm from the checkpoint: [0-9.]+\)")
        here = self.path("here-grad.jsonl")
        self.run_one("--grad-spike-factor", "3", "--bad-step", "skip", "--metrics", here)
        self.assertEqual(self.losses(here), self.ref(str(SPIKE)))

    def test_data_parallel_ranks_stop_together(self):
        args = self.args("--spike-factor", "3")
        args[args.index("--batch") + 1] = str(B // 2)  # the same global batch over dp=2
        outs = dp.wait_all(dp.launch(2, lambda r: args, self.path("kv")))
        self.assertEqual([rc for rc, _, _ in outs], [1, 1], [e[-800:] for _, _, e in outs])
        self.assertEqual(self.caught(outs[0][2]), self.caught(outs[1][2]))

    def test_bad_values(self):
        for value, want in (("1", "--spike-factor must be > 1 (0: off)"),
                            ("-2", "--spike-factor must be > 1 (0: off)"),
                            ("0.5", "--spike-factor must be > 1 (0: off)"),
                            ("big", "--spike-factor: expected a number, got 'big'")):
            p = subprocess.run(self.args("--spike-factor", value), capture_output=True,
                               text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0, value)
            self.assertIn(want, p.stderr, value)
        ranges = "expected step numbers >= 1 or S:N (N steps from S), comma-separated"
        for extra, want in ((["--spike-factor", "3", "--spike-skip", "0"],
                             "--spike-skip must be in [1, 10000]"),
                            (["--spike-factor", "3", "--spike-skip", "10001"],
                             "--spike-skip must be in [1, 10000]"),
                            (["--spike-skip", "2"],
                             "--spike-skip needs --spike-factor or --grad-spike-factor"),
                            (["--grad-spike-factor", "0.5"],
                             "--grad-spike-factor must be > 1 (0: off)"),
                            (["--skip-steps", "5:0"], ranges),
                            (["--skip-steps", "0:2"], ranges),
                            (["--skip-steps", "3-4"], ranges),
                            (["--skip-steps", "1:999999,2000000:2"], "at most 1000000 steps"),
                            (["--bad-step", "retry"],
                             "--bad-step: expected rollback or skip, got 'retry'")):
            p = subprocess.run(self.args(*extra), capture_output=True, text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0, extra)
            self.assertIn(want, p.stderr, extra)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    args, rest = ap.parse_known_args()
    BUILD = dp.BUILD = os.path.abspath(args.build)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
