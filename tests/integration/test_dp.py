"""Data parallelism and ZeRO: exactness against one process, memory, resharding, failures.

Runs the real distrain-train binary as N processes (WORLD_SIZE/RANK, rendezvous through a
shared DISTRAIN_KV_DIR, as under a launcher without a coordinator) on the tiny golden model
and data, and checks:
  * dp in {2, 4} x ZeRO in {0, 1, 2, 3}, with and without gradient accumulation: the per-step
    loss equals the single-process run on the same global batch within 1e-5 relative; again
    with the comm thread forced on (DISTRAIN_DP_OVERLAP=1: overlap, ZeRO-3 prefetch);
  * the per-rank parameter + gradient + optimizer bytes the trainer reports match the ZeRO
    formula (16P, 8P + 8P/N, 4P + 12P/N, 16P/N) within 5%;
  * embeddings bigger than a layer, as in GPT-2 (ZeRO moves them a tensor at a time): dp=3
    under ZeRO-1/2/3, and pp=2 x dp=3 under ZeRO-2, give the single-process losses and weights;
  * the validation loss covers the same sequences however the global batch is split (one
    process with or without accumulation, dp=2 with it): equal within 1e-6;
  * a checkpoint written by dp=4 (ZeRO-1 shards) resumes on dp=3 (ZeRO-2) and continues the
    single-process trajectory;
  * a peer that never arrives: rank 0 fails within the timeout and names the missing rank;
  * a peer's address left in the store by an earlier run: rank 0 fails within the timeout
    and says to use a fresh store;
  * a peer killed mid-training: the survivor fails with an error, not a hang (collectives on
    the compute thread, and on the comm thread);
  * SIGTERM to one rank: every rank stops after the same step with its checkpoint committed
    (exit 3), and the resumed run gives the uninterrupted losses; a SIGTERM 2 s after the first
    ends a rank that cannot reach its step's end, one sooner does not.

    /usr/bin/python3 tests/integration/test_dp.py --build build
"""

import argparse
import json
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
GOLDEN = os.path.join(HERE, "..", "numerics", "golden")
BUILD = "build"
STEPS = 8
REL_TOL = 1e-5


def trainer():
    return os.path.join(BUILD, "worker", "trainer", "distrain-train")


def base_args(batch, accum, metrics, steps=STEPS):
    return [trainer(), "--init", "llmc:" + os.path.join(GOLDEN, "tiny_model.bin"),
            "--train", os.path.join(GOLDEN, "tiny_train.bin"), "--seq", "32",
            "--batch", str(batch), "--grad-accum", str(accum), "--steps", str(steps),
            "--lr", "1e-3", "--schedule", "cosine", "--warmup", "2", "--weight-decay", "0.1",
            "--grad-clip", "1.0", "--threads", "1", "--quiet", "--metrics", metrics]


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def launch(world, args_for_rank, kv, extra_env=None):
    """Starts world ranks; extra_env is a dict for every rank, or a function of the rank."""
    procs = []
    for r in range(world):  # pipes are closed by communicate() in wait_all
        env = dict(os.environ, WORLD_SIZE=str(world), RANK=str(r), DISTRAIN_KV_DIR=kv,
                   OMP_NUM_THREADS="1")
        env.update((extra_env(r) if callable(extra_env) else extra_env) or {})
        procs.append(subprocess.Popen(args_for_rank(r), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def wait_all(procs, timeout=120):
    """(returncode, stdout, stderr) of every process; past the timeout all are killed and the
    failure shows what each rank printed last (a hang names where it hung)."""
    outs = []
    deadline = time.time() + timeout
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.time()))
            outs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = ["rank %d:\n%s" % (r, (p.communicate()[1] or "")[-1500:])
                 for r, p in enumerate(procs)]
        raise AssertionError("ranks still running after %d s:\n%s" % (timeout, "\n".join(tails)))
    return outs


def assert_ranks_ok(outs, what, tail=2500):
    """Fails unless every rank exited 0. The message gives every rank's status (a signal by
    name) and the stderr of each rank that failed, and of every rank when any failed: the
    first rank to fail is usually not rank 0, whose error only says that a peer went away."""
    if all(rc == 0 for rc, _, _ in outs):
        return
    def status(rc):
        if rc < 0:
            try:
                return "killed by " + signal.Signals(-rc).name
            except ValueError:
                return "killed by signal %d" % -rc
        return "exit %d" % rc
    report = ["%s: %s" % (what, ", ".join("rank %d %s" % (r, status(rc))
                                         for r, (rc, _, _) in enumerate(outs)))]
    for r, (rc, _, err) in enumerate(outs):
        report.append("--- rank %d (%s), stderr:\n%s" % (r, status(rc), (err or "")[-tail:]))
    raise AssertionError("\n".join(report))


def sample_text(args, world, tmp, tag, timeout=300):
    """Runs world ranks of args (which hold --sample) and returns the text rank 0 printed, from
    "---- sample" to "---- end of sample ----"; fails unless every rank exited 0, rank 0 printed
    a sample and no other rank did."""
    outs = wait_all(launch(world, lambda r: args, tempfile.mkdtemp(prefix="kv_" + tag, dir=tmp)),
                    timeout=timeout)
    assert_ranks_ok(outs, tag)
    text = re.search(r"---- sample.*?---- end of sample ----", outs[0][1], re.S)
    if not text:
        raise AssertionError("%s: rank 0 printed no sample:\n%s" % (tag, outs[0][1]))
    for r, (_, out, _) in enumerate(outs[1:], 1):
        if "---- sample" in out:
            raise AssertionError("%s: rank %d printed a sample too; only rank 0 prints" % (tag, r))
    return text.group(0)


class DataParallel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dt_dp_")
        cls.single = {}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)
        print("\n  largest relative loss difference against one process: %.2g" % cls.worst,
              file=sys.stderr)

    def single_run(self, global_batch, accum):
        key = (global_batch, accum)
        if key not in self.single:
            m = os.path.join(self.tmp, "single_%d_%d.jsonl" % key)
            subprocess.run(base_args(global_batch, accum, m), check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.single[key] = read_metrics(m)
        return self.single[key]

    worst = 0.0  # largest relative loss difference seen, printed at the end

    def assert_close(self, ref, got, what):
        self.assertEqual(len(ref), len(got), what)
        for a, b in zip(ref, got):
            self.assertEqual(a["step"], b["step"])
            rel = abs(a["loss"] - b["loss"]) / abs(a["loss"])
            DataParallel.worst = max(DataParallel.worst, rel)
            self.assertLess(rel, REL_TOL, "%s step %d: loss %.9g vs one process %.9g"
                            % (what, a["step"], b["loss"], a["loss"]))

    def run_dp(self, world, zero, accum, overlap=-1):
        tag = "dp%d_z%d_k%d_o%d" % (world, zero, accum, overlap)
        kv = os.path.join(self.tmp, "kv_" + tag)
        metrics = os.path.join(self.tmp, tag + ".jsonl")
        procs = launch(world, lambda r: base_args(4, accum, metrics) + ["--zero-stage", str(zero)],
                       kv, {"DISTRAIN_DP_OVERLAP": str(overlap)})
        outs = wait_all(procs)
        assert_ranks_ok(outs, tag)
        return read_metrics(metrics), outs[0][2]

    def test_exact_against_one_process(self):
        for world in (2, 4):
            for accum in (1, 2):
                ref = self.single_run(4 * world, accum)
                for zero in (0, 1, 2, 3):
                    with self.subTest(dp=world, zero=zero, accum=accum):
                        # In place (no comm thread); test_exact_with_comm_thread has the other.
                        got, err = self.run_dp(world, zero, accum, overlap=0)
                        self.assert_close(ref, got, "dp=%d zero=%d accum=%d" % (world, zero,
                                                                                  accum))
                        self.check_memory(err, world, zero)

    def test_exact_with_comm_thread(self):
        # The comm thread (forced on: the default leaves it off for ZeRO-0/1 on a machine with
        # no core to spare) runs every collective of the forward and backward passes, overlapped
        # with compute (ZeRO-0/1 all-reduce, ZeRO-2/3 reduce-scatter, ZeRO-3 prefetch); same
        # losses.
        for world, accum in ((2, 2), (4, 1)):
            ref = self.single_run(4 * world, accum)
            for zero in (0, 1, 2, 3):
                with self.subTest(dp=world, zero=zero, accum=accum):
                    got, _ = self.run_dp(world, zero, accum, overlap=1)
                    self.assert_close(ref, got, "comm thread: dp=%d zero=%d accum=%d"
                                      % (world, zero, accum))

    def test_validation_whatever_the_split(self):
        """val_batches counts global batches: 3 of 8 sequences, whether one process reads them
        whole or in 4 micro-batches of 2, or 2 ranks in 2 micro-batches of 2 each (it once
        counted micro-batches, so these evaluated 24, 6 and 12 sequences)."""
        val = ["--val", os.path.join(GOLDEN, "tiny_train.bin"), "--val-every", "2",
               "--val-batches", "3"]

        def run(world, batch, accum):
            tag = "val_w%d_b%d_k%d" % (world, batch, accum)
            m = os.path.join(self.tmp, tag + ".jsonl")
            procs = launch(world, lambda r: base_args(batch, accum, m, steps=2) + val,
                           os.path.join(self.tmp, "kv_" + tag))
            assert_ranks_ok(wait_all(procs), tag)
            with open(m) as f:
                got = [(j["step"], j["val_loss"]) for j in map(json.loads, f) if "val_loss" in j]
            self.assertEqual([step for step, _ in got], [0, 2], tag)
            return got

        ref = run(1, 8, 1)
        for world, batch, accum in ((1, 2, 4), (2, 2, 2)):
            for (step, want), (_, got) in zip(ref, run(world, batch, accum)):
                self.assertLess(abs(got - want) / want, 1e-6,
                                "dp=%d batch %d accum %d, step %d: validation loss %.9g, one "
                                "process without accumulation %.9g" % (world, batch, accum, step,
                                                                       got, want))

    def test_embeddings_bigger_than_a_layer(self):
        """In GPT-2 the embeddings (wte 38.6M floats) outweigh a layer (7.1M), so ZeRO moves
        them one tensor at a time instead of packing them through the staging buffer sized for
        a layer; the golden model's (12K floats against 50K) fit it. A vocabulary of 3000 over
        C32 gives GPT-2's proportions: dp=3 (uneven shards) under ZeRO-1 on the comm thread
        (all-reduce), ZeRO-2 (reduce-scatter) and ZeRO-3 (all-gather), pp=2 x dp=3 under
        ZeRO-2 (the tied embeddings summed between the stages first) and ZeRO-1, and tp=2 x dp=3
        under ZeRO-0 (the all-reduces of ZeRO-0/1 on the comm thread next to the pipeline's and
        tp's own operations: a GPU's default), against one process."""
        import test_tp  # the weights comparison (test_tp imports this module)

        def run(world, dp_size, zero, extra=()):
            tag = "bigvocab_w%d_z%d" % (world, zero)
            metrics, weights = (os.path.join(self.tmp, tag + ext) for ext in (".jsonl", ".bin"))
            args = base_args(6 // dp_size, 2, metrics) + [
                "--zero-stage", str(zero), "--export-llmc", weights] + list(extra)
            at = args.index("--init")
            args[at + 1:at + 2] = ["seed:7", "--vocab", "3000", "--layers", "2", "--heads", "2",
                                   "--channels", "32", "--max-seq", "32"]
            outs = wait_all(launch(world, lambda r: args, os.path.join(self.tmp, "kv_" + tag),
                                   {"DISTRAIN_DP_OVERLAP": "1"}))
            assert_ranks_ok(outs, tag)
            return read_metrics(metrics), test_tp.read_llmc(weights)

        ref, wref = run(1, 1, 0)
        for world, zero, extra in ((3, 1, ()), (3, 2, ()), (3, 3, ()), (6, 2, ("--pp", "2")),
                                   (6, 1, ("--pp", "2")), (6, 0, ("--tp", "2"))):
            what = "vocabulary 3000, %s dp=3 ZeRO-%d" % (" ".join(extra), zero)
            with self.subTest(world=world, zero=zero):
                got, w = run(world, 3, zero, extra)
                self.assert_close(ref, got, what)
                test_tp.assert_weights(self, wref, w, what)

    def check_memory(self, stderr, world, zero):
        params = int(re.search(r"(\d+) parameters", stderr).group(1))
        m = re.search(r"params ([\d.]+) MiB, grads ([\d.]+) MiB, optimizer ([\d.]+) MiB", stderr)
        have = sum(float(x) for x in m.groups()) * 1024 * 1024
        P, N = float(params), float(world)
        formula = [16 * P, 8 * P + 8 * P / N, 4 * P + 12 * P / N, 16 * P / N][zero]
        self.assertLess(abs(have / formula - 1.0), 0.05,
                        "ZeRO-%d dp %d: %.0f bytes vs formula %.0f" % (zero, world, have, formula))

    def test_reshard_dp4_to_dp3(self):
        ref = self.single_run(12, 1)
        ckpt = os.path.join(self.tmp, "reshard_ckpt")
        m1 = os.path.join(self.tmp, "reshard_a.jsonl")
        m2 = os.path.join(self.tmp, "reshard_b.jsonl")
        args = lambda batch, m: base_args(batch, 1, m) + ["--ckpt-dir", ckpt]
        outs = wait_all(launch(4, lambda r: args(3, m1) + ["--zero-stage", "1", "--stop-at", "4"],
                               os.path.join(self.tmp, "kv_r4")))
        assert_ranks_ok(outs, "dp4 until step 4")
        with open(os.path.join(ckpt, "step-00000004", "MANIFEST")) as f:
            manifest = f.read()
        self.assertIn("world 4", manifest)
        # the weights come from the checkpoint: no --init on resume
        resume = [a for a in args(4, m2) if not a.startswith("llmc:") and a != "--init"]
        outs = wait_all(launch(3, lambda r: resume + ["--zero-stage", "2", "--resume"],
                               os.path.join(self.tmp, "kv_r3")))
        assert_ranks_ok(outs, "dp3 resume")
        got = read_metrics(m1) + read_metrics(m2)
        self.assert_close(ref, got, "dp4 -> dp3 resume")

    def test_corrupt_newest_checkpoint_is_skipped(self):
        """The newest committed checkpoint has a corrupt shard: resuming marks it bad and
        resumes from the one before it, on every rank, and the trajectory is unchanged."""
        ref = self.single_run(8, 1)
        ckpt = os.path.join(self.tmp, "corrupt_ckpt")
        m1 = os.path.join(self.tmp, "corrupt_a.jsonl")
        m2 = os.path.join(self.tmp, "corrupt_b.jsonl")
        args = lambda m: base_args(4, 1, m) + ["--ckpt-dir", ckpt, "--save-every", "2",
                                               "--zero-stage", "1"]
        outs = wait_all(launch(2, lambda r: args(m1) + ["--stop-at", "6"],
                               os.path.join(self.tmp, "kv_c1")))
        assert_ranks_ok(outs, "dp2 until step 6")
        newest = os.path.join(ckpt, "step-00000006")
        shard = sorted(f for f in os.listdir(newest) if f != "MANIFEST")[-1]
        with open(os.path.join(newest, shard), "r+b") as f:
            f.seek(-64, os.SEEK_END)
            f.write(b"\xff" * 8)
        resume = [a for a in args(m2) if not a.startswith("llmc:") and a != "--init"]
        outs = wait_all(launch(2, lambda r: resume + ["--resume"], os.path.join(self.tmp, "kv_c2")))
        assert_ranks_ok(outs, "dp2 resume")
        for err in (e for _, _, e in outs):
            self.assertIn("step-00000006: fails verification on", err)
        # Resumed from step 4; step 6 was trained again and committed anew.
        self.assertEqual(read_metrics(m2)[0]["step"], 5)
        got = read_metrics(m1)[:4] + read_metrics(m2)
        self.assertEqual([m["step"] for m in got], list(range(1, STEPS + 1)))
        self.assert_close(ref, got, "resumed from step 4 past a corrupt step 6")

    def test_async_checkpoints_equal_sync_ones(self):
        """Checkpoints written by the saver thread while training goes on (the default) are
        byte for byte those the step writes itself (--ckpt-sync), for every saved step of a
        dp=2 ZeRO-3 run, and the losses are the same: the snapshot is the step's state."""
        runs = {}
        for mode in ("sync", "async"):
            ckpt = os.path.join(self.tmp, "ckpt_" + mode)
            m = os.path.join(self.tmp, "ckpt_%s.jsonl" % mode)
            extra = ["--ckpt-dir", ckpt, "--save-every", "2", "--keep", "0", "--zero-stage", "3"]
            extra += ["--ckpt-sync"] if mode == "sync" else []
            args = [a for a in base_args(4, 1, m) if a != "--quiet"] + extra
            outs = wait_all(launch(2, lambda r: args, os.path.join(self.tmp, "kv_" + mode)))
            assert_ranks_ok(outs, "%s checkpoints" % mode)
            files = {}
            for d in sorted(os.listdir(ckpt)):
                for f in sorted(os.listdir(os.path.join(ckpt, d))):
                    with open(os.path.join(ckpt, d, f), "rb") as fh:
                        files[(d, f)] = fh.read()
            runs[mode] = (files, [x["loss"] for x in read_metrics(m)], outs[0][2])
        self.assertEqual(len([k for k in runs["sync"][0] if k[1] == "MANIFEST"]), STEPS // 2)
        self.assertEqual(sorted(runs["sync"][0]), sorted(runs["async"][0]))
        for k in runs["sync"][0]:
            self.assertEqual(runs["sync"][0][k], runs["async"][0][k], "%s/%s differs" % k)
        self.assertEqual(runs["sync"][1], runs["async"][1])
        self.assertRegex(runs["async"][2], r"checkpoint step 2: the step paused [\d.]+ ms")
        self.assertIn("written and committed in the background", runs["async"][2])

    def test_full_disk_on_one_writer(self):
        """A dp=3 ZeRO-1 run whose rank 2 finds its disk full saving step F
        (DISTRAIN_FAULT_NOSPACE_STEP, its first write of the step): the step is abandoned (the
        other shards of it deleted, no manifest), ranks 2 and 0 (which commits for the run) say
        so, and the run trains on to the end with the losses of a run that saved every step. At
        the last step with --last-save-wait 0 every rank fails alike, rank 1 too, which wrote
        its shard and learns only from the others; by default the ranks wait for room (here at
        once) and write the step again, and the run ends saved."""
        ref = self.single_run(12, 1)
        for fault, wait, want_rc, want_steps in ((4, ["--last-save-wait", "0"], 0, (2, 6, 8)),
                                                 (8, ["--last-save-wait", "0"], 1, (2, 4, 6)),
                                                 (8, [], 0, (2, 4, 6, 8))):
            what = "full disk at %d%s" % (fault, " (no wait)" if wait else "")
            ckpt = os.path.join(self.tmp, "full_%d_%d" % (fault, len(wait)))
            m = os.path.join(self.tmp, "full_%d_%d.jsonl" % (fault, len(wait)))
            args = [a for a in base_args(4, 1, m) if a != "--quiet"] + [
                "--ckpt-dir", ckpt, "--save-every", "2", "--keep", "0", "--zero-stage", "1"] + wait
            outs = wait_all(launch(3, lambda r: args, ckpt + ".kv", lambda r: {
                "DISTRAIN_FAULT_NOSPACE_STEP": str(fault)} if r == 2 else {}))
            errs = "\n".join(e[-1500:] for _, _, e in outs)
            self.assertEqual([rc for rc, _, _ in outs], [want_rc] * 3, errs)
            self.assertEqual(sorted(os.listdir(ckpt)), ["step-%08d" % s for s in want_steps], what)
            why = (r"checkpoint step %d not saved: rank 2 on \S+ could not write its shard: no "
                   r"space left on device in %s \([\d.]+ MiB free, the shard needs [\d.]+ MiB\)"
                   % (fault, re.escape(ckpt)))
            self.assertRegex(outs[0][2], why + "; training goes on")
            self.assertRegex(outs[2][2], why + r"\. " + (
                "Training goes on and the save of step 6 tries again; a failure now resumes "
                "from step 2," if fault == 4 else "A failure now resumes from step 6,"))
            self.assert_close(ref, read_metrics(m), what)
            last = "the run's last checkpoint, of step 8, was not saved (a writer's disk is full"
            if want_rc:
                for _, _, err in outs:
                    self.assertIn(last + "): the run fails rather than end without it. Free "
                                  "space in %s and resume it" % ckpt, err)
            elif fault == 8:
                self.assertIn(last + "): waiting up to 600 s for room in %s" % ckpt, outs[0][2])
                self.assertRegex(outs[0][2], r"the run's last checkpoint, of step 8, is saved: "
                                 r"written again after \d+ s")
                self.assertTrue(os.path.exists(os.path.join(ckpt, "step-00000008", "MANIFEST")))

    def test_saves_by_time_are_agreed(self):
        """--save-every-s 1 on a dp=2 ZeRO-1 run (two writers) whose steps take 250 ms: rank 0's
        clock decides and both ranks save after the same steps, so every step saved is committed
        (a disagreement would leave a step without its manifest, or hang), some before the last;
        the losses are one process's."""
        ref = self.single_run(8, 1)
        ckpt = os.path.join(self.tmp, "by_time")
        m = os.path.join(self.tmp, "by_time.jsonl")
        args = [a for a in base_args(4, 1, m) if a != "--quiet"] + [
            "--ckpt-dir", ckpt, "--save-every-s", "1", "--keep", "0", "--zero-stage", "1"]
        outs = wait_all(launch(2, lambda r: args, ckpt + ".kv",
                               {"DISTRAIN_FAULT_SLOW_MS": "250"}))
        assert_ranks_ok(outs, "saves by time")
        steps = sorted(int(d[5:]) for d in os.listdir(ckpt))
        self.assertEqual(steps[-1], STEPS)
        self.assertGreater(len(steps), 1, steps)
        for s in steps:
            self.assertTrue(os.path.exists(os.path.join(ckpt, "step-%08d" % s, "MANIFEST")), s)
        self.assert_close(ref, read_metrics(m), "saves by time")

    def test_stop_whose_save_finds_a_full_disk(self):
        """SIGTERM to a dp=3 run whose rank 2 finds its disk full saving (every save,
        DISTRAIN_FAULT_NOSPACE_STEP=-1): the ranks stop after the same step as ever (exit 3, a
        stop, not a failure: the stop's grace period is no time to wait for room), nothing of
        the step is left on disk, and rank 0 says that the stop's checkpoint was not saved
        instead of that it is committed."""
        ckpt = os.path.join(self.tmp, "stop_full")
        m = os.path.join(self.tmp, "stop_full.jsonl")
        args = [a for a in base_args(4, 1, m) if a != "--quiet"] + [
            "--ckpt-dir", ckpt, "--zero-stage", "1"]
        procs = launch(3, lambda r: args, ckpt + ".kv", lambda r: dict(
            {"DISTRAIN_FAULT_SLOW_MS": "300"}, **({"DISTRAIN_FAULT_NOSPACE_STEP": "-1"}
                                                   if r == 2 else {})))
        self.wait_steps(m, 2)
        procs[1].send_signal(signal.SIGTERM)
        outs = wait_all(procs)
        self.assertEqual([rc for rc, _, _ in outs], [3, 3, 3],
                         "\n".join(e[-1500:] for _, _, e in outs))
        self.assertRegex(outs[0][2], r"stopped on request after step \d+ of %d: its checkpoint "
                         r"was not saved \(a writer's disk is full in %s\): a restart "
                         r"\(--resume\) resumes from the start \(no step committed\)"
                         % (STEPS, re.escape(ckpt)))
        self.assertNotIn("is committed", outs[0][2])
        self.assertEqual(os.listdir(ckpt), [])

    def wait_steps(self, metrics, n):
        deadline = time.time() + 60
        while time.time() < deadline:
            if os.path.exists(metrics) and len(read_metrics(metrics)) >= n:
                return
            time.sleep(0.05)
        self.fail("training never reached step %d" % n)

    def test_stop_signal_saves_the_step_and_resumes(self):
        """SIGTERM to one rank of a dp=2 ZeRO-1 run (as a scheduler preempting its node), twice
        in a row (Slurm signals a step's every process, and the agent among them its trainer):
        both ranks stop after the same step, whose checkpoint is committed, and exit 3; resumed,
        the run gives the uninterrupted losses. Steps are slowed (DISTRAIN_FAULT_SLOW_MS) so
        that the signals land mid-run."""
        ref = self.single_run(8, 1)
        ckpt = os.path.join(self.tmp, "stop_ckpt")
        m1 = os.path.join(self.tmp, "stop_a.jsonl")
        m2 = os.path.join(self.tmp, "stop_b.jsonl")
        args = lambda m: [a for a in base_args(4, 1, m) if a != "--quiet"] + [
            "--ckpt-dir", ckpt, "--zero-stage", "1"]
        procs = launch(2, lambda r: args(m1), os.path.join(self.tmp, "kv_stop1"),
                       {"DISTRAIN_FAULT_SLOW_MS": "300"})
        self.wait_steps(m1, 2)
        procs[1].send_signal(signal.SIGTERM)
        time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        outs = wait_all(procs)
        self.assertEqual([rc for rc, _, _ in outs], [3, 3],
                         "\n".join(e[-1500:] for _, _, e in outs))
        stopped = re.search(r"stopped on request after step (\d+) of %d: its checkpoint is "
                            r"committed" % STEPS, outs[0][2])
        self.assertTrue(stopped, outs[0][2][-2000:])
        step = int(stopped.group(1))
        self.assertLess(step, STEPS)
        self.assertEqual(os.listdir(ckpt), ["step-%08d" % step])
        self.assertTrue(os.path.exists(os.path.join(ckpt, "step-%08d" % step, "MANIFEST")))
        self.assertEqual([m["step"] for m in read_metrics(m1)], list(range(1, step + 1)))
        resume = [a for a in args(m2) if not a.startswith("llmc:") and a != "--init"]
        outs = wait_all(launch(2, lambda r: resume + ["--resume"],
                               os.path.join(self.tmp, "kv_stop2")))
        assert_ranks_ok(outs, "dp2 resume after the stop")
        self.assert_close(ref, read_metrics(m1) + read_metrics(m2), "stopped at step %d, resumed"
                          % step)

    def test_second_stop_signal_ends_a_blocked_rank(self):
        """A rank whose peer is stopped (SIGSTOP) cannot reach its step's end: the first SIGTERM
        leaves it waiting, and so does one 1 s later (the same request, delivered twice); one
        2 s or more after the first ends it at once, by the signal."""
        m = os.path.join(self.tmp, "stop_blocked.jsonl")
        procs = launch(2, lambda r: base_args(4, 1, m, steps=100000),
                       os.path.join(self.tmp, "kv_stop_blocked"))
        try:
            self.wait_steps(m, 2)
            procs[1].send_signal(signal.SIGSTOP)
            procs[0].send_signal(signal.SIGTERM)
            time.sleep(1.0)
            procs[0].send_signal(signal.SIGTERM)
            time.sleep(1.5)
            self.assertIsNone(procs[0].poll(), "rank 0 cannot have stopped: its peer is stopped")
            procs[0].send_signal(signal.SIGTERM)
            procs[0].wait(timeout=10)
            self.assertEqual(procs[0].returncode, -signal.SIGTERM)
        finally:
            for p in procs:
                p.kill()
                p.communicate()

    def rank0_alone(self, kv, tag):
        """Rank 0 of a world of 2 started alone on store kv with a 2 s comm timeout: it must fail
        within the timeout plus 5 s. Returns the finished process."""
        env = dict(os.environ, WORLD_SIZE="2", RANK="0", DISTRAIN_KV_DIR=kv,
                   DISTRAIN_COMM_TIMEOUT_MS="2000")
        t0 = time.time()
        p = subprocess.run(base_args(4, 1, os.path.join(self.tmp, tag + ".jsonl")), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
        elapsed = time.time() - t0
        self.assertNotEqual(p.returncode, 0)
        self.assertLess(elapsed, 2.0 + 5.0, "gave up after %.1f s" % elapsed)
        return p

    def test_peer_never_arrives(self):
        p = self.rank0_alone(os.path.join(self.tmp, "kv_missing"), "missing")
        self.assertRegex(p.stderr, r"(?i)rank.*1", "the error names the missing rank")
        self.assertIn("timed out", p.stderr.lower())

    def test_stale_address_in_the_store(self):
        """Rank 1's addresses from an earlier run, still in the store, with a port above any live
        one: rank 0 reads them as this run's, compares its own address as the smaller and
        listens for a connection that never comes. It fails within DISTRAIN_COMM_TIMEOUT_MS
        (Gloo alone waits five times that for a connection) and says what to do."""
        old = os.path.join(self.tmp, "kv_stale_old")
        outs = wait_all(launch(2, lambda r: base_args(4, 1, os.path.join(self.tmp, "stale.jsonl"),
                                                      steps=1), old))
        assert_ranks_ok(outs, "the earlier run")
        new = os.path.join(self.tmp, "kv_stale_new")
        os.makedirs(new)
        for name in (n for n in os.listdir(old) if n.endswith("%2F1")):  # rank 1's keys
            with open(os.path.join(old, name), "rb") as f:
                addr = bytearray(f.read())  # one Gloo address (sockaddr_storage, seq): peer 0's
            addr[2:4] = b"\xff\xff"  # sin_port: 65535
            with open(os.path.join(new, name), "wb") as f:
                f.write(addr)
        p = self.rank0_alone(new, "stale2")
        self.assertIn("rank 1 did not connect within 2000 ms", p.stderr)
        self.assertIn("use a fresh one (a new DISTRAIN_KV_DIR or DISTRAIN_KV_PREFIX)", p.stderr)

    def test_peer_dies_mid_training(self):
        # Collectives on the compute thread (ZeRO-0 here), and on the comm thread while the
        # compute thread waits for a prefetched unit (ZeRO-3, overlap forced on).
        for zero, overlap in ((0, -1), (3, 1)):
            with self.subTest(zero=zero, overlap=overlap):
                self.peer_dies(zero, overlap)

    def peer_dies(self, zero, overlap):
        tag = "dies_z%d_o%d" % (zero, overlap)
        kv = os.path.join(self.tmp, "kv_" + tag)
        metrics = os.path.join(self.tmp, tag + ".jsonl")
        procs = launch(2, lambda r: base_args(4, 1, metrics, steps=100000)
                       + ["--zero-stage", str(zero)], kv,
                       {"DISTRAIN_COMM_TIMEOUT_MS": "5000", "DISTRAIN_DP_OVERLAP": str(overlap)})
        # wait until training is under way (rank 0 wrote a few steps)
        deadline = time.time() + 60
        while time.time() < deadline:
            if os.path.exists(metrics) and len(read_metrics(metrics)) >= 3:
                break
            time.sleep(0.05)
        self.assertGreaterEqual(len(read_metrics(metrics)), 3, "training never started")
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.time()
        out, err = procs[0].communicate(timeout=60)
        elapsed = time.time() - t0
        procs[1].communicate()
        self.assertNotEqual(procs[0].returncode, 0, "the survivor must fail, not finish")
        self.assertLess(elapsed, 5.0 + 5.0, "survivor took %.1f s to fail" % elapsed)
        self.assertRegex(err, r"(?i)(closed|remote|peer|timed out)")
        print("\n  %s: survivor failed %.2f s after its peer was killed" % (tag, elapsed),
              file=sys.stderr)

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    args, rest = ap.parse_known_args()
    BUILD = os.path.abspath(args.build)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
