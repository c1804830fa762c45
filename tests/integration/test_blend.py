#!/usr/bin/env python3
"""test_blend.py — training on a weighted blend of data sources (`--train 3:a/*.bin,1:b/*.bin`,
Megatron-LM's `--data-path 3 a 1 b`), end to end through distrain-train.

The reference is written here from Megatron-LM's description of its BlendedDataset: global
sequence i is taken from the source whose count falls furthest below weight x max(i, 1) (the
first source on a tie), and each source gives its sequences in its own order (shards sorted,
windows of --seq tokens from the start of each, around again after the last). The test writes
those sequences, in that order, as one shard each, so that a run on them reads, sequence for
sequence, what the blend must deal. Checks:
  - the blended run's losses equal the reference run's bit for bit, over more than one pass of
    every source;
  - a shuffled blend stopped mid-run (--stop-at) and resumed equals the uninterrupted run bit for
    bit, and dp=2 and --grad-accum 2 layouts of its global batch give its losses within 1e-5;
  - the start-up log says how often the run reads each source;
  - each step's loss by source (named `W:NAME=GLOB`, else src1, src2, ...): at step 1 GPT-2's
    forward pass in numpy on the sequences dealt, by source; every step's loss their mean
    weighted by the tokens dealt (a source dealt none left out); layouts within 1e-5;
  - --val on a blend gives the validation loss of the dealt sequences bit for bit, as many
    global batches as come before a source would repeat;
  - bad blends are refused with one line naming them.

And named validation sets (`--val-sets web=...,code=...`, Megatron-LM's
--multiple-validation-sets), each validated alone: before training each set's loss is GPT-2's
forward pass on its sequences, computed here in numpy from the llm.c weights; after steps it is
what a run validating on that set alone (--val) reports, bit for bit; layouts agree; training is
unchanged; bad sets are refused with one line.

  /usr/bin/python3 tests/integration/test_blend.py --build build
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_dp as dp  # noqa: E402  (the multi-rank launcher)
from test_convert import hf_token_losses, read_llmc  # noqa: E402  (GPT-2's forward in numpy)

GOLDEN = os.path.join(HERE, "..", "numerics", "golden")
MODEL = os.path.join(GOLDEN, "tiny_model.bin")  # L2 NH4 C64, V 100, maxT 64
SEQ, V = 32, 100


def write_shard(path, tokens):
    """llm.c's token shard: 256 int32 {20240520, 1, ntok}, then uint16 tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.array(tokens, dtype="<u2").tobytes())


def megatron_sources(weights, n):
    """The source of each of the first n global sequences (Megatron-LM's blending rule)."""
    w = [x / sum(weights) for x in weights]
    taken, out = [0] * len(w), []
    for i in range(n):
        x = max(float(i), 1.0)
        errs = [w[d] * x - taken[d] for d in range(len(w))]
        d = errs.index(max(errs))  # the first of equal errors
        out.append(d)
        taken[d] += 1
    return out


class Blend(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="dt-blend-")
        rng = random.Random(5)
        # source a: two shards of 7 and 4 sequences (the second with a short tail), b: one of 3
        cls.shards = {"a": [7 * SEQ + 1, 4 * SEQ + 9], "b": [3 * SEQ + 1]}
        cls.tokens = {}
        for src, sizes in cls.shards.items():
            os.mkdir(cls.path(src))
            cls.tokens[src] = []
            for k, ntok in enumerate(sizes):
                toks = [rng.randrange(V) for _ in range(ntok)]
                write_shard(cls.path("%s/%s_%d.bin" % (src, src, k)), toks)
                cls.tokens[src].append(toks)
        cls.blend = "3:%s,1:%s" % (cls.path("a/a_*.bin"), cls.path("b/b_*.bin"))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @classmethod
    def path(cls, name):
        return os.path.join(cls.tmp.name, name)

    def source_sequences(self, src):
        """A source's sequences (SEQ + 1 tokens each) in one pass, unshuffled."""
        out = []
        for toks in self.tokens[src]:
            out += [toks[j * SEQ:(j + 1) * SEQ + 1] for j in range((len(toks) - 1) // SEQ)]
        return out

    def args(self, tag, train, batch, steps, *extra):
        return [dp.trainer(), "--init", "llmc:" + MODEL, "--train", train, "--seq", str(SEQ),
                "--batch", str(batch), "--steps", str(steps), "--lr", "1e-3", "--threads", "1",
                "--metrics", self.path(tag + ".metrics")] + list(extra)

    def run_one(self, args, expect=0):
        p = subprocess.run(args, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.assertEqual(p.returncode, expect, p.stdout + p.stderr[-3000:])
        return p

    def losses(self, tag):
        return {m["step"]: m["loss"] for m in dp.read_metrics(self.path(tag + ".metrics"))}

    def test_reads_what_the_blend_deals(self):
        steps = 32  # a: 11 sequences a pass, read 24 times; b: 3 a pass, read 8
        seqs = {s: self.source_sequences(s) for s in ("a", "b")}
        self.assertEqual((len(seqs["a"]), len(seqs["b"])), (11, 3))
        taken = {"a": 0, "b": 0}
        os.mkdir(self.path("ref"))
        for i, d in enumerate(megatron_sources([3, 1], steps)):
            s = "ab"[d]
            write_shard(self.path("ref/seq_%05d.bin" % i), seqs[s][taken[s] % len(seqs[s])])
            taken[s] += 1
        self.assertEqual(taken, {"a": 24, "b": 8})
        self.run_one(self.args("ref", self.path("ref/seq_*.bin"), 1, steps))
        p = self.run_one(self.args("blend", self.blend, 1, steps))
        ref, got = self.losses("ref"), self.losses("blend")
        self.assertEqual(len(ref), steps)
        self.assertEqual(got, ref)  # bit for bit: the same sequences in the same order
        self.assertIn("blend source 1 (src1): %s, weight 0.7500: 2 shards, 11 sequences of %d a "
                      "pass" % (self.path("a/a_*.bin"), SEQ), p.stderr)
        self.assertIn("blend source 2 (src2, %s): 8 sequences in steps 0..32, 2.67 passes over "
                      "it" % self.path("b/b_*.bin"), p.stderr)

    def test_resume_and_layouts(self):
        shuffled = ["--shuffle", "--seed", "3"]
        self.run_one(self.args("full", self.blend, 4, 10, *shuffled))
        full = self.losses("full")
        ckpt = self.path("ckpt")
        self.run_one(self.args("part", self.blend, 4, 10, *shuffled, "--ckpt-dir", ckpt,
                               "--stop-at", "4"))
        resume = self.args("part", self.blend, 4, 10, *shuffled, "--ckpt-dir", ckpt, "--resume")
        del resume[1:3]  # the model comes from the checkpoint
        self.run_one(resume)
        self.assertEqual(self.losses("part"), full)  # bit for bit, steps 1-4 and 5-10
        self.run_one(self.args("accum", self.blend, 2, 10, *shuffled, "--grad-accum", "2"))
        kv = tempfile.mkdtemp(prefix="kv", dir=self.tmp.name)
        outs = dp.wait_all(dp.launch(2, lambda r: self.args("dp2", self.blend, 2, 10, *shuffled),
                                     kv))
        dp.assert_ranks_ok(outs, "dp=2")
        for tag in ("accum", "dp2"):
            got = self.losses(tag)
            self.assertEqual(sorted(got), sorted(full))
            for step in full:
                self.assertAlmostEqual(got[step], full[step], delta=1e-5 * abs(full[step]),
                                       msg="%s step %d" % (tag, step))

    def sources(self, tag):
        """{step: {source: loss}} of a run's metrics."""
        return {m["step"]: m.get("loss_sources", {})
                for m in dp.read_metrics(self.path(tag + ".metrics"))}

    def test_losses_by_source(self):
        """Each step's loss over each source's tokens: at step 1 GPT-2's forward pass (numpy) on
        the sequences the blend deals, by source; every step's loss is their mean weighted by
        the tokens dealt; a source dealt nothing is left out; layouts agree within 1e-5."""
        blend = "3:web=%s,1:%s" % (self.path("a/a_*.bin"), self.path("b/b_*.bin"))
        steps, batch = 6, 4
        p = self.run_one(self.args("src", blend, batch, steps))
        got, loss = self.sources("src"), self.losses("src")
        self.assertEqual(sorted(got), list(range(1, steps + 1)))
        dealt = megatron_sources([3, 1], steps * batch)
        names = ["web", "src2"]
        for step in got:
            counts = [dealt[(step - 1) * batch:step * batch].count(d) for d in (0, 1)]
            self.assertEqual(list(got[step]), [names[d] for d in (0, 1) if counts[d]], step)
            mean = sum(counts[d] * got[step][names[d]] for d in (0, 1) if counts[d]) / batch
            self.assertAlmostEqual(mean, loss[step], delta=1e-6 * loss[step], msg=step)
        # step 1 trains on sequences a0, b0, a1, a2 with the initial weights
        seqs = {s: self.source_sequences(s) for s in ("a", "b")}
        self.assertEqual(dealt[:batch], [0, 1, 0, 0])
        w, L, NH = read_llmc(MODEL)
        for name, rows in (("web", [seqs["a"][0], seqs["a"][1], seqs["a"][2]]),
                           ("src2", [seqs["b"][0]])):
            rows = np.array(rows)
            ref = hf_token_losses(w, rows[:, :-1], rows[:, 1:], L, NH).mean()
            self.assertAlmostEqual(got[1][name], ref, delta=1e-5 * ref, msg=name)
        self.assertRegex(p.stderr, r"step +1/6 \| loss [0-9.]+ \(web %.4f, src2 %.4f\) \| lr"
                         % (got[1]["web"], got[1]["src2"]))
        self.assertIn("blend source 1 (web): %s, weight 0.7500" % self.path("a/a_*.bin"),
                      p.stderr)
        # one sequence a step: the one source dealt it, its loss the step's
        self.run_one(self.args("src-b1", blend, 1, 4))
        one, loss = self.sources("src-b1"), self.losses("src-b1")
        for step in one:
            self.assertEqual(list(one[step]), [names[dealt[step - 1]]], step)
            self.assertAlmostEqual(list(one[step].values())[0], loss[step],
                                   delta=1e-6 * loss[step])
        # layouts of the same global batch: each rank reads its rows' sources itself
        layouts = [("dp2", 2, 2, []), ("accum", 1, 2, ["--grad-accum", "2"]),
                   ("zero3", 2, 2, ["--zero-stage", "3"]), ("tp2", 2, 4, ["--tp", "2"]),
                   ("pp2", 2, 2, ["--pp", "2", "--grad-accum", "2"]),
                   ("cp2", 2, 4, ["--cp", "2"])]
        for tag, world, b, extra in layouts:
            with self.subTest(layout=tag):
                if world == 1:
                    self.run_one(self.args("src-" + tag, blend, b, steps, *extra))
                else:
                    kv = tempfile.mkdtemp(prefix="kv", dir=self.tmp.name)
                    outs = dp.wait_all(dp.launch(world, lambda r: self.args(
                        "src-" + tag, blend, b, steps, *extra), kv))
                    dp.assert_ranks_ok(outs, tag)
                lay = self.sources("src-" + tag)
                self.assertEqual({s: list(v) for s, v in lay.items()},
                                 {s: list(v) for s, v in got.items()})
                for step in got:
                    for name, ref in got[step].items():
                        self.assertAlmostEqual(lay[step][name], ref, delta=1e-5 * ref,
                                               msg="step %d %s" % (step, name))

    def test_bad_blends(self):
        cases = [("3:%s,0:%s" % (self.path("a/a_*.bin"), self.path("b/b_*.bin")),
                  "blend source 2 ('0:%s'): the weight must be a positive number"
                  % self.path("b/b_*.bin")),
                 ("3:%s,%s" % (self.path("a/a_*.bin"), self.path("b/b_*.bin")),
                  "blend source 2 ('%s') is not WEIGHT:GLOB" % self.path("b/b_*.bin")),
                 ("3:%s,1:%s" % (self.path("a/a_*.bin"), self.path("c/*.bin")),
                  "%s: no token shard matches this path or pattern" % self.path("c/*.bin")),
                 ("3:web=%s,1:web=%s" % (self.path("a/a_*.bin"), self.path("b/b_*.bin")),
                  "blend source 2: the name 'web' is used twice"),
                 ("3:%s,1:src1=%s" % (self.path("a/a_*.bin"), self.path("b/b_*.bin")),
                  "blend source 2: the name 'src1' is used twice"),
                 ("3:web=,1:%s" % self.path("b/b_*.bin"),
                  "blend source 1 ('3:web=') names no shards")]
        for train, msg in cases:
            with self.subTest(train=train):
                p = self.run_one(self.args("bad", train, 1, 2, "--quiet"), expect=1)
                self.assertIn(msg, p.stderr)
        # a validation blend whose source 2 (3 sequences) begins again inside the first batch
        val = "1:%s,0.01:%s" % (self.path("b/b_*.bin"), self.path("a/a_*.bin"))
        p = self.run_one(self.args("bad", self.blend, 8, 2, "--quiet", "--val", val,
                                   "--val-every", "1"), expect=1)
        self.assertIn("--val %s: a source of the blend begins its data again within the first "
                      "global batch (8 sequences)" % val, p.stderr)

    def test_validation_on_a_blend(self):
        """--val on a blend: the first --val-batches global batches it deals, as many as hold
        no sequence twice (with weights 1:1, b's 3 sequences last 7)."""
        seqs = {s: self.source_sequences(s) for s in ("a", "b")}
        taken = {"a": 0, "b": 0}
        os.mkdir(self.path("valref"))
        for i, d in enumerate(megatron_sources([1, 1], 7)):
            s = "ab"[d]
            write_shard(self.path("valref/seq_%05d.bin" % i), seqs[s][taken[s]])
            taken[s] += 1
        self.assertEqual(taken, {"a": 4, "b": 3})
        train = os.path.join(GOLDEN, "tiny_train.bin")
        val = "1:%s,1:%s" % (self.path("a/a_*.bin"), self.path("b/b_*.bin"))
        common = ["--val-every", "2", "--val-batches", "10"]
        self.run_one(self.args("valref", train, 1, 4, "--val", self.path("valref/seq_*.bin"),
                               *common))
        p = self.run_one(self.args("valblend", train, 1, 4, "--val", val, *common))
        self.assertIn("--val %s holds 7 global batches without a repeat: validation uses those"
                      % val, p.stderr)
        read = lambda tag: [(m["step"], m["val_loss"]) for m in  # noqa: E731
                            dp.read_metrics(self.path(tag + ".metrics")) if "val_loss" in m]
        ref = read("valref")
        self.assertEqual([s for s, _ in ref], [2, 4])
        self.assertEqual(read("valblend"), ref)  # bit for bit


    def val_sets(self, tag):
        """{step: {set: loss}} of a run's metrics, and {step: val_loss}."""
        with open(self.path(tag + ".metrics")) as f:  # step 0's line too: it has no loss
            ms = [json.loads(line) for line in f]
        return ({m["step"]: m["val_sets"] for m in ms if "val_sets" in m},
                {m["step"]: m["val_loss"] for m in ms if "val_loss" in m})

    def test_validation_sets(self):
        train = os.path.join(GOLDEN, "tiny_train.bin")
        web, code = self.path("a/a_*.bin"), self.path("b/b_*.bin")
        sets = "web=%s,code=%s" % (web, code)
        # 4 global batches of one sequence; code holds 3
        common = ["--val-every", "2", "--val-batches", "4"]
        p = self.run_one(self.args("sets", train, 1, 4, "--val-sets", sets, *common))
        self.assertIn("--val-sets code: %s holds 3 global batches without a repeat: validation "
                      "uses those" % code, p.stderr)
        got, no_val = self.val_sets("sets")
        self.assertEqual(sorted(got), [0, 2, 4])
        self.assertEqual(no_val, {})
        self.assertEqual([list(v) for v in got.values()], [["web", "code"]] * 3)  # in order
        # before training: GPT-2's forward pass on each set's first sequences, in numpy
        w, L, NH = read_llmc(MODEL)
        for name, src, n in (("web", "a", 4), ("code", "b", 3)):
            seqs = np.array(self.source_sequences(src)[:n])
            ref = hf_token_losses(w, seqs[:, :-1], seqs[:, 1:], L, NH).mean()
            self.assertAlmostEqual(got[0][name], ref, delta=1e-5 * ref, msg=name)
        # after steps: each set's loss is a run validating on it alone, bit for bit
        for name, pattern in (("web", web), ("code", code)):
            self.run_one(self.args("only-" + name, train, 1, 4, "--val", pattern, *common))
            _, alone = self.val_sets("only-" + name)
            self.assertEqual({s: v[name] for s, v in got.items()}, alone, name)
        # training is as without validation; --val beside the sets is reported as before
        self.run_one(self.args("plain", train, 1, 4))
        p = self.run_one(self.args("both", train, 1, 4, "--val", web, "--val-sets", sets,
                                   *common))
        self.assertEqual(self.losses("both"), self.losses("plain"))
        self.assertEqual(self.val_sets("both"), (got, {s: v["web"] for s, v in got.items()}))
        self.assertRegex(p.stderr, r"step +2/4 \| loss [0-9.]+ \| val %.4f \(web %.4f, code "
                         r"%.4f\) \| lr" % (got[2]["web"], got[2]["web"], got[2]["code"]))

    def test_validation_sets_in_layouts(self):
        """dp=2 and tp=2 report each set's loss of one process within 1e-5."""
        train = os.path.join(GOLDEN, "tiny_train.bin")
        sets = "web=%s,code=%s" % (self.path("a/a_*.bin"), self.path("b/b_*.bin"))
        common = ["--val-sets", sets, "--val-every", "2", "--val-batches", "3"]
        self.run_one(self.args("one", train, 2, 4, *common))
        one, _ = self.val_sets("one")
        self.assertEqual(sorted(one), [0, 2, 4])
        for tag, batch, extra in (("vs-dp2", 1, []), ("vs-tp2", 2, ["--tp", "2"])):
            kv = tempfile.mkdtemp(prefix="kv", dir=self.tmp.name)
            outs = dp.wait_all(dp.launch(2, lambda r: self.args(tag, train, batch, 4, *common,
                                                                *extra), kv))
            dp.assert_ranks_ok(outs, tag)
            got, _ = self.val_sets(tag)
            self.assertEqual(sorted(got), sorted(one), tag)
            for step in one:
                for name in ("web", "code"):
                    self.assertAlmostEqual(got[step][name], one[step][name],
                                           delta=1e-5 * one[step][name],
                                           msg="%s step %d %s" % (tag, step, name))

    def test_bad_validation_sets(self):
        a = self.path("a/a_*.bin")
        train = os.path.join(GOLDEN, "tiny_train.bin")
        cases = [("web=%s,%s" % (a, a), "validation set 2 ('%s') is not NAME=GLOB" % a),
                 ("web=%s,web=%s" % (a, a), "validation set 2: the name 'web' is used twice"),
                 ("we b=%s" % a, "validation set 1 ('we b=%s'): a name is 1 to 31 letters, "
                  "digits, '_', '.' or '-'" % a),
                 ("web=", "validation set 1 ('web=') names no shards")]
        for sets, msg in cases:
            with self.subTest(sets=sets):
                p = self.run_one(self.args("bad", train, 1, 2, "--quiet", "--val-sets", sets,
                                           "--val-every", "1"), expect=1)
                self.assertIn("--val-sets %s: %s" % (sets, msg), p.stderr)
        p = self.run_one(self.args("bad", train, 1, 2, "--quiet", "--val-sets", "web=" + a),
                         expect=1)
        self.assertIn("--val-sets needs --val-every", p.stderr)
        missing = self.path("c/*.bin")
        p = self.run_one(self.args("bad", train, 1, 2, "--quiet", "--val-every", "1",
                                   "--val-sets", "web=%s,code=%s" % (a, missing)), expect=1)
        self.assertIn("%s: no token shard matches this path or pattern" % missing, p.stderr)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    args, rest = ap.parse_known_args()
    dp.BUILD = os.path.abspath(args.build)
    unittest.main(argv=[sys.argv[0]] + rest)
