#!/usr/bin/env python3
"""test_sample.py — distrain-train's text generation (--sample) and its filters (--sample-top-k,
--sample-top-p) against GPT-2's forward pass in numpy (test_convert's, float64). The model
(L2 NH4 C64, V 100, whose tokens print as "[id]", so the sample is read back exactly) is trained
here for 20 steps on a cycle through the 100 tokens in a random order, far enough that its
predictions depend on the context but stay uncertain; the reference runs on the llm.c weights
it exports. The prompt is the first --seq tokens of the shard; each token is drawn from the
logits of the last --seq tokens before it. Checks:
  - --sample-top-k 1 is greedy decoding: every token is the reference's argmax, on one process
    and under tp=2 (its logits gathered from two vocabulary slices);
  - at temperature 2, --sample-top-k 4, --sample-top-p 0.5 and the two together: every token is
    among the reference's 4 most likely, in its nucleus (the fewest most likely tokens holding
    half the probability at that temperature, after top-k where both are given), while the same
    seed without a filter draws outside them: the filter, not chance, kept the tokens in; and
    some token falls outside the filter at half its value (top-k 2, top-p 0.25): it keeps no
    fewer tokens than asked;
  - the key/value cache (--seq 64, past the window): greedy decoding the reference's argmax, on
    one process, tp=2, pp=2, cp=2 and 4 (the prompt in pieces), tp=2 with SP (padded feeds),
    cp=2 x tp=2 with SP and an interleaved pipeline (a 4-layer model), the tokens of whole
    windows (--sample-no-cache), and at temperature 2 the same draws as whole windows;
  - --sample-every: samples during training that leave the run as it was, each of the model as
    it was after its step, also through a pipeline;
  - the header names the filters; bad values are refused with one line.

  /usr/bin/python3 tests/integration/test_sample.py --build build
"""
import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_dp as dp  # noqa: E402  (the multi-rank launcher)
from test_blend import write_shard  # noqa: E402  (llm.c's token shard)
from test_convert import hf_logits, read_llmc  # noqa: E402  (GPT-2's forward in numpy)

SEQ, N, V = 32, 24, 100  # the window (and prompt) length; tokens generated; vocabulary
TOL = 1e-4       # fp32 against float64 logits: a token this close to a cut may fall either side


class Sample(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="dt-sample-")
        d = cls.tmp.name
        order = list(range(V))
        random.Random(1).shuffle(order)
        tokens = [order[i % V] for i in range(20000)]
        cls.shard, cls.model = os.path.join(d, "cycle.bin"), os.path.join(d, "model.bin")
        write_shard(cls.shard, tokens)
        p = subprocess.run([os.path.join(BUILD, "worker/trainer/distrain-train"), "--train",
                            cls.shard, "--layers", "2", "--heads", "4", "--channels", "64",
                            "--vocab", str(V), "--max-seq", "64", "--batch", "4", "--seq",
                            str(SEQ), "--steps", "20", "--lr", "1e-2", "--init", "seed:1",
                            "--threads", "1", "--quiet", "--export-llmc", cls.model],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        cls.w, cls.L, cls.NH = read_llmc(cls.model)
        cls.prompt = tokens[:SEQ]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def args(self, *extra):
        return [os.path.join(BUILD, "worker/trainer/distrain-train"), "--steps", "0",
                "--init", "llmc:" + self.model, "--val", self.shard, "--batch", "1", "--seq", str(SEQ),
                "--sample", str(N), "--threads", "1", "--quiet", *extra]

    def sample(self, *extra, header=None):
        """The generated tokens (after the prompt) of a run."""
        p = subprocess.run(self.args(*extra), capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        return self.tokens(p.stdout, header)

    def tokens(self, out, header=None, n=N):
        m = re.search(r"---- sample \((.*)\) ----\n((?:\[\d+\])*)\n---- end of sample ----", out)
        self.assertIsNotNone(m, out)
        if header is not None:
            self.assertEqual(m.group(1), header)
        toks = [int(t) for t in re.findall(r"\d+", m.group(2))]
        self.assertEqual(toks[:SEQ], self.prompt)
        self.assertEqual(len(toks), SEQ + n)
        return toks[SEQ:]

    def logits(self, ctx, window=SEQ):
        """The reference's logits of the token after ctx, from its last `window` tokens."""
        return hf_logits(self.w, np.array([ctx[-window:]]), self.L, self.NH)[0, -1]

    def allowed(self, logits, temp, top_k, top_p):
        """The tokens the filters leave (those within TOL of the cut logit too), and the cut."""
        order = np.sort(logits)[::-1]
        cut = order[top_k - 1] if top_k else -np.inf
        if top_p < 1:
            kept = order[order >= cut]
            p = np.exp((kept - kept[0]) / temp)
            cut = kept[np.searchsorted(np.cumsum(p) / p.sum(), top_p)]
        return set(np.flatnonzero(logits >= cut - TOL)), cut

    def test_greedy_is_the_argmax(self):
        toks = self.sample("--sample-top-k", "1", header="temperature 0.80, top-k 1")
        ctx = list(self.prompt)
        for i, tok in enumerate(toks):
            lg = self.logits(ctx)
            top2 = np.sort(lg)[-2:]
            self.assertGreater(top2[1] - top2[0], TOL, "a tie at token %d: pick another prompt" % i)
            self.assertEqual(tok, int(np.argmax(lg)), "token %d" % i)
            ctx.append(tok)
        self.assertGreater(len(set(toks)), 1)  # not one token repeated: the context matters
        # tp=2: each rank holds half the vocabulary's logits, gathered for the sampled row
        outs = dp.wait_all(dp.launch(2, lambda r: self.args("--tp", "2", "--sample-top-k", "1"),
                                     self.tmp.name))
        dp.assert_ranks_ok(outs, "tp=2")
        self.assertEqual(self.tokens(outs[0][1]), toks)

    def test_key_value_cache(self):
        """--seq 64: the 32-token prompt in one forward through the key/value cache, then a row
        a token until the text fills the window, then whole windows sliding on: greedy decoding
        is the reference's argmax from the last 64 tokens all the way, on one process and under
        tp=2 and pp=2 (each stage its layers' cache), cp=2 and 4 (every rank the whole
        sequence's cache), SP and --sample-no-cache, and at temperature 2 the cache draws the
        tokens whole windows draw, on one process and under cp=2."""
        W, n = 2 * SEQ, 48  # the prompt is --val's first 32 tokens, up to the window's half

        def run(world, *extra):
            argv = self.args("--seq", str(W), "--sample", str(n), *extra)
            kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp.name)  # a rendezvous each
            outs = dp.wait_all(dp.launch(world, lambda r: argv, kv))
            dp.assert_ranks_ok(outs, str(extra))
            log = re.findall(r"sample: (.*)", outs[0][2])
            self.assertEqual(len(log), 1, outs[0][2])
            return self.tokens(outs[0][1], n=n), log[0]

        def cached(positions, split=1, feeds="in one forward", cp=False):
            """The log of a cache of rank 0's share (1 / split: its tp slice or pp stage)."""
            mib = self.L * positions * 3 * 64 // split * 4 / 2**20  # q, k, v rows, fp32, C = 64
            return ("a key/value cache of 64 positions (%.2f MiB): the prompt %s, then one row a "
                    "token while the text fits the window%s" % (
                        mib, feeds, " (every context-parallel rank runs the whole sequence)"
                        if cp else ""))

        greedy = ("--sample-top-k", "1")
        toks, log = run(1, *greedy)
        self.assertEqual(log, cached(W))
        ctx = list(self.prompt)
        for i, tok in enumerate(toks):
            lg = self.logits(ctx, W)
            top2 = np.sort(lg)[-2:]
            self.assertGreater(top2[1] - top2[0], TOL, "a tie at token %d: pick another prompt" % i)
            self.assertEqual(tok, int(np.argmax(lg)), "token %d" % i)
            ctx.append(tok)
        self.assertGreater(len(set(toks)), 1)
        whole = "a forward of the whole window a token (--sample-no-cache)"
        # cp=4 holds activations for 16 positions: the prompt in two forwards; under --sp each
        # feed is padded to rows the 2 tp ranks split (the last position's padding would pass
        # max_seq: whole windows from there)
        for world, extra, want in (
                (2, ("--tp", "2"), cached(W, 2)), (2, ("--pp", "2"), cached(W, 2)),
                (2, ("--cp", "2"), cached(W, cp=True)),
                (4, ("--cp", "4"), cached(W, feeds="in forwards of up to 16 rows", cp=True)),
                # materialized attention: a feed's (rows, 64) probabilities in the (5, 16, 16)
                # of a cp=2 rank's zig-zag halves, 20 rows
                (2, ("--cp", "2", "--attention", "materialized"),
                 cached(W, feeds="in forwards of up to 20 rows", cp=True)),
                (2, ("--tp", "2", "--sp"), cached(W, 2)),
                (4, ("--tp", "2", "--sp", "--cp", "2"), cached(W, 2, cp=True)),
                (1, ("--sample-no-cache",), whole), (2, ("--cp", "2", "--sample-no-cache"), whole)):
            got, got_log = run(world, *(greedy + extra))
            self.assertEqual(got, toks, extra)
            self.assertEqual(got_log, want, extra)
        hot = ("--sample-temp", "2")
        self.assertEqual(run(1, *hot)[0], run(1, *hot, "--sample-no-cache")[0])
        self.assertEqual(run(2, *hot, "--cp", "2")[0], run(1, *hot, "--sample-no-cache")[0])

    def test_key_value_cache_through_virtual_stages(self):
        """An interleaved pipeline (pp=2, 2 chunks a stage) of a 4-layer model trained as the
        class's: each stage caches its two chunks' layers apart and feeds every chunk the same
        positions; greedy decoding past the window gives one process's tokens (cached and
        whole windows alike)."""
        model = os.path.join(self.tmp.name, "model4.bin")
        p = subprocess.run([os.path.join(BUILD, "worker/trainer/distrain-train"), "--train",
                            self.shard, "--layers", "4", "--heads", "4", "--channels", "64",
                            "--vocab", str(V), "--max-seq", "64", "--batch", "4", "--seq",
                            str(SEQ), "--steps", "20", "--lr", "1e-2", "--init", "seed:1",
                            "--threads", "1", "--quiet", "--export-llmc", model],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)

        def run(world, *extra):
            argv = self.args("--seq", str(2 * SEQ), "--sample", "48", "--sample-top-k", "1",
                             *extra)
            argv[argv.index("llmc:" + self.model)] = "llmc:" + model
            kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp.name)
            outs = dp.wait_all(dp.launch(world, lambda r: argv, kv))
            dp.assert_ranks_ok(outs, str(extra))
            return self.tokens(outs[0][1], n=48), re.findall(r"sample: (.*)", outs[0][2])

        toks, log = run(1)
        self.assertTrue(log[0].startswith("a key/value cache"), log)
        self.assertGreater(len(set(toks)), 1)
        pipe = ("--pp", "2", "--pp-schedule", "interleaved", "--grad-accum", "2")
        got, log = run(2, *pipe)
        self.assertTrue(log[0].startswith("a key/value cache"), log)
        self.assertEqual(got, toks)
        got, log = run(2, *pipe, "--sample-no-cache")
        self.assertEqual(log, ["a forward of the whole window a token (--sample-no-cache)"])
        self.assertEqual(got, toks)

    def test_sample_every(self):
        """--sample-every 4 over 10 steps: samples after steps 4 and 8, then the one at the end;
        the run's losses and its end sample are those of a run without them (the samples' RNG
        is their own), bit for bit; greedy, the sample after step 4 is the end sample of a run
        of 4 steps (the model as it was then); pp=2 prints the same three samples."""
        def run(world, steps, *extra):
            metrics = os.path.join(self.tmp.name, "every_%d_%d_%s.jsonl" % (
                world, steps, "_".join(e.strip("-") for e in extra)))
            argv = [os.path.join(BUILD, "worker/trainer/distrain-train"), "--train", self.shard,
                    "--val", self.shard, "--init", "llmc:" + self.model, "--batch", "2", "--seq",
                    str(SEQ), "--steps", str(steps), "--lr", "1e-3", "--threads", "1", "--quiet",
                    "--metrics", metrics, "--sample", "8", *extra]
            kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp.name)
            outs = dp.wait_all(dp.launch(world, lambda r: argv, kv))
            dp.assert_ranks_ok(outs, str(extra))
            with open(metrics) as f:
                losses = re.findall(r'"loss": ([^,]+)', f.read())
            return re.findall(r"---- sample (.*) ----\n(.*)\n---- end of sample ----",
                              outs[0][1]), losses

        plain, losses = run(1, 10)
        every, every_losses = run(1, 10, "--sample-every", "4")
        self.assertEqual(len(losses), 10)
        self.assertEqual(every_losses, losses)
        self.assertEqual([h for h, _ in every], ["after step 4 (temperature 0.80)",
                                                 "after step 8 (temperature 0.80)",
                                                 "(temperature 0.80)"])
        self.assertEqual(every[-1], plain[0])
        self.assertEqual(run(2, 10, "--sample-every", "4", "--pp", "2")[0], every)
        greedy = ("--sample-top-k", "1")
        self.assertEqual(run(1, 10, "--sample-every", "4", *greedy)[0][0][1],
                         run(1, 4, *greedy)[0][0][1])
        # no prompt but the training data's, whose position must not move: refused
        p = subprocess.run([os.path.join(BUILD, "worker/trainer/distrain-train"), "--train",
                            self.shard, "--init", "llmc:" + self.model, "--batch", "2", "--seq",
                            str(SEQ), "--steps", "2", "--sample", "8", "--sample-every", "1"],
                           capture_output=True, text=True, timeout=120)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--sample-every needs --prompt or --val: the samples' prompt", p.stderr)

    def test_filters_keep_the_draws_in(self):
        temp = 2.0
        plain = self.sample("--sample-temp", "2", header="temperature 2.00")
        for top_k, top_p, header in ((4, 1.0, "temperature 2.00, top-k 4"),
                                     (0, 0.5, "temperature 2.00, top-p 0.50"),
                                     (8, 0.5, "temperature 2.00, top-k 8, top-p 0.50")):
            flags = ["--sample-temp", "2"]
            flags += ["--sample-top-k", str(top_k)] if top_k else []
            flags += ["--sample-top-p", str(top_p)] if top_p < 1 else []
            toks = self.sample(*flags, header=header)
            ctx, sizes, wider = list(self.prompt), [], 0
            for i, tok in enumerate(toks):
                lg = self.logits(ctx)
                allowed, _ = self.allowed(lg, temp, top_k, top_p)
                self.assertIn(tok, allowed, "%s: token %d" % (header, i))
                sizes.append(len(allowed))
                wider += tok not in self.allowed(lg, temp, top_k // 2, top_p / 2)[0]
                ctx.append(tok)
            self.assertLess(max(sizes), V, header)  # the filter cut something
            self.assertGreater(wider, 0, header)  # and kept no fewer than asked (half as many)
            # the same seed without the filter, from the same prompt: some draw falls outside
            ctx, outside = list(self.prompt), 0
            for tok in plain:
                outside += tok not in self.allowed(self.logits(ctx), temp, top_k, top_p)[0]
                ctx.append(tok)
            self.assertGreater(outside, 0, header)

    def test_bad_values(self):
        for extra, want in (
                (["--sample-top-k", "-1"], "--sample-top-k must be >= 0 (0: off) and "
                 "--sample-top-p in (0, 1] (1: off)"),
                (["--sample-top-p", "0"], "--sample-top-p in (0, 1]"),
                (["--sample-top-p", "1.5"], "--sample-top-p in (0, 1]"),
                (["--sample-top-p", "most"], "--sample-top-p: expected a number, got 'most'"),
                (["--sample", "0", "--sample-top-k", "5"],
                 "--sample-top-k and --sample-top-p need --sample N"),
                (["--sample", "0", "--sample-no-cache"], "--sample-no-cache needs --sample N"),
                (["--sample-every", "-1"], "--sample-every must be >= 0"),
                (["--sample", "0", "--sample-every", "5"], "--sample-every needs --sample N")):
            p = subprocess.run(self.args(*extra), capture_output=True, text=True, timeout=120)
            self.assertNotEqual(p.returncode, 0, extra)
            self.assertIn(want, p.stderr, extra)
            self.assertNotIn("---- sample", p.stdout, extra)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    args, rest = ap.parse_known_args()
    BUILD = dp.BUILD = os.path.abspath(args.build)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
