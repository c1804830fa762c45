#!/usr/bin/env python3
"""test_eval.py — multiple-choice evaluation (HellaSwag): distrain-prep --hellaswag and
distrain-train --eval, against an independent reference.

The eval file is llm.c's format (dev/data/data_common.py's write_evalfile): this test writes
its own files from the format's description, and distrain-prep's must equal them byte for byte.
A completion's score is its tokens' summed cross-entropy after the context, as llm.c's
hellaswag.py computes it; the reference here is GPT-2's forward pass in numpy (test_convert's,
on the Hugging Face export of the golden tiny model), row by row. Checks:
  - every completion's summed loss equals the reference within 1e-5 relative, and acc /
    acc_norm (lowest sum / lowest mean) are the reference's picks (a run of --steps 0 without
    training data: a model evaluated as it is);
  - dp=2 under ZeRO-3, tp=2 with --sp, pp=2, cp=2 and cp=2 x tp=2 give the one-process
    results at every evaluation of a short training run (before, between and after steps);
  - distrain-prep --hellaswag writes HellaSwag's jsonl as the reference writer does (byte-level
    here; test_tokenizer.py checks it with GPT-2's BPE);
  - each bad input is refused with one line naming it.

  /usr/bin/python3 tests/integration/test_eval.py --build build
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
import test_convert as conv  # noqa: E402  (GPT-2's forward in numpy, safetensors reader)
import test_dp as dp  # noqa: E402  (the multi-rank launcher)

GOLDEN = os.path.join(HERE, "..", "numerics", "golden")
MODEL = os.path.join(GOLDEN, "tiny_model.bin")  # L2 NH4 C64, V 100, maxT 64
SEQ, V = 32, 100


def write_evalfile(path, examples):
    """llm.c's eval file: 256 int32 {20240522, 1, examples, longest example's bytes}, then per
    example the uint16 stream 65535, its bytes, its index, label, completions, the context's
    length and tokens, and each completion's length and tokens. examples: (label, context,
    [completion, ...]) with token lists."""
    stream, longest = [], 0
    for i, (label, ctx, comps) in enumerate(examples):
        ex = [65535, 0, i, label, len(comps), len(ctx)] + list(ctx)
        for c in comps:
            ex += [len(c)] + list(c)
        ex[1] = 2 * len(ex)
        longest = max(longest, ex[1])
        stream += ex
    header = np.zeros(256, dtype="<i4")
    header[:4] = [20240522, 1, len(examples), longest]
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.array(stream, dtype="<u2").tobytes())


def random_examples(seed, n):
    """n examples of 2 to 5 completions, the longest row exactly SEQ + 1 tokens (SEQ
    positions), the others shorter."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        nctx = rng.randint(1, 20)
        comps = [[rng.randrange(V) for _ in range(rng.randint(1, SEQ + 1 - nctx))]
                 for _ in range(rng.randint(2, 5))]
        if i == 3:
            comps[1] = [rng.randrange(V) for _ in range(SEQ + 1 - nctx)]
        out.append((rng.randrange(len(comps)), [rng.randrange(V) for _ in range(nctx)], comps))
    return out


def picks(sums, examples):
    """(acc, acc_norm) counts from each completion's summed loss: the lowest sum, the lowest
    mean, the first one on a tie."""
    acc = acc_norm = 0
    for s, (label, _, comps) in zip(sums, examples):
        means = [x / len(c) for x, c in zip(s, comps)]
        acc += int(np.argmin(s)) == label
        acc_norm += int(np.argmin(means)) == label
    return acc, acc_norm


def read_eval_out(path):
    """{step: [(loss_sum list, tokens list) per example]}"""
    steps = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            steps.setdefault(r["step"], []).append((r["example"], r["label"], r["loss_sum"],
                                                    r["tokens"]))
    for s in steps.values():
        assert [e for e, _, _, _ in s] == list(range(len(s))), "examples out of order"
    return steps


class Eval(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="dt-eval-")
        cls.examples = random_examples(7, 37)
        cls.evalfile = cls.path("set.bin")
        write_evalfile(cls.evalfile, cls.examples)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @classmethod
    def path(cls, name):
        return os.path.join(cls.tmp.name, name)

    @staticmethod
    def exe(name):
        return os.path.join(conv.BUILD, "worker/trainer", name)

    def train_args(self, tag, batch, steps, *extra):
        return [self.exe("distrain-train"), "--init", "llmc:" + MODEL,
                "--train", os.path.join(GOLDEN, "tiny_train.bin"), "--seq", str(SEQ),
                "--batch", str(batch), "--steps", str(steps), "--lr", "1e-3", "--threads", "1",
                "--quiet", "--eval", self.evalfile, "--eval-out", self.path(tag + ".eval.jsonl"),
                "--metrics", self.path(tag + ".metrics")] + list(extra)

    def run_one(self, args, expect=0):
        p = subprocess.run(args, capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, expect, p.stdout + p.stderr)
        return p

    def test_losses_against_reference(self):
        hf = self.path("hf")
        self.run_one([self.exe("distrain-convert"), "llmc:" + MODEL, "hf:" + hf])
        _, w = conv.read_safetensors(os.path.join(hf, "model.safetensors"))
        w = {k: v.astype(np.float64) for k, v in w.items()}
        ref = []
        for _, ctx, comps in self.examples:
            sums = []
            for c in comps:
                row = np.array(ctx + c)
                losses = conv.hf_token_losses(w, row[None, :-1], row[None, 1:], 2, 4)[0]
                sums.append(losses[len(ctx) - 1:].sum())
            ref.append(sums)
        # batch 3: rows split across micro-batches, the last one padded
        args = self.train_args("ref", 3, 0)
        args.remove("--quiet")  # for the log line
        i = args.index("--train")
        del args[i:i + 2]  # a run of --steps 0 evaluates a model as it is, without data
        p = self.run_one(args)
        got = read_eval_out(self.path("ref.eval.jsonl"))
        self.assertEqual(list(got), [0])
        for (i, label, sums, tokens), r, (lab, _, comps) in zip(got[0], ref, self.examples):
            self.assertEqual((label, tokens), (lab, [len(c) for c in comps]), i)
            np.testing.assert_allclose(sums, r, rtol=1e-5, err_msg="example %d" % i)
        with open(self.path("ref.metrics")) as f:
            m = json.loads(f.readline())
        acc, acc_norm = picks(ref, self.examples)
        n = len(self.examples)
        self.assertEqual((m["step"], m["eval_examples"]), (0, n))
        self.assertAlmostEqual(m["eval_acc"], acc / n, places=6)
        self.assertAlmostEqual(m["eval_acc_norm"], acc_norm / n, places=6)
        self.assertNotEqual(acc, acc_norm, "the two picks should differ somewhere on this set")
        self.assertIn("eval %s: acc_norm %.4f (%d/%d), acc %.4f (%d/%d)"
                      % (self.evalfile, acc_norm / n, acc_norm, n, acc / n, acc, n), p.stderr)
        self.assertIn("evaluated the longest first in windows of up to %d positions" % SEQ,
                      p.stderr)

    def run_layout(self, tag, world, batch, extra):
        args = self.train_args(tag, batch, 3, "--eval-every", "2", *extra)
        if world == 1:
            self.run_one(args)
        else:
            kv = tempfile.mkdtemp(prefix="kv_" + tag, dir=self.tmp.name)
            dp.assert_ranks_ok(dp.wait_all(dp.launch(world, lambda r: args, kv)), tag)
        with open(self.path(tag + ".metrics")) as f:
            evals = [{k: v for k, v in json.loads(line).items() if k.startswith("eval")}
                     for line in f if '"eval_acc"' in line]
        return read_eval_out(self.path(tag + ".eval.jsonl")), evals

    def test_layouts_give_the_one_process_results(self):
        ref, ref_metrics = self.run_layout("one", 1, 4, [])
        self.assertEqual(sorted(ref), [0, 2, 3])  # before training, every 2 steps, the last
        layouts = [("dp2", 2, 2, ["--zero-stage", "3"]),
                   ("tp2sp", 2, 4, ["--tp", "2", "--sp"]),
                   ("pp2", 2, 2, ["--pp", "2", "--grad-accum", "2"]),
                   ("cp2", 2, 4, ["--cp", "2"]),
                   ("cp2tp2", 4, 4, ["--cp", "2", "--tp", "2"])]
        for tag, world, batch, extra in layouts:
            with self.subTest(layout=tag):
                got, metrics = self.run_layout(tag, world, batch, extra)
                self.assertEqual(sorted(got), sorted(ref))
                self.assertEqual(metrics, ref_metrics)
                for step in ref:
                    for (i, _, a, _), (_, _, b, _) in zip(ref[step], got[step]):
                        np.testing.assert_allclose(b, a, rtol=1e-5,
                                                   err_msg="%s step %d example %d" % (tag, step, i))

    def prep(self, *args, expect=0):
        p = subprocess.run([self.exe("distrain-prep"), *args], capture_output=True, timeout=120)
        self.assertEqual(p.returncode, expect, p.stderr.decode(errors="replace"))
        return p

    def test_prep_writes_llmc_format(self):
        rows = [{"ctx": "A man is sitting on a roof. he", "label": 3, "ind": 24,
                 "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                             "is holding a rubik's cube.", "starts pulling up roofing on a roof."]},
                {"ctx": "Ein Mann sitzt auf dem Dach \u00e9\u4e16\U0001f600 \"quoted\"", "label": 0,
                 "endings": ["a", "\t\u00fc"]}]
        src = self.path("hellaswag_val.jsonl")
        with open(src, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows) + "\n")
        out = self.path("prep")
        p = self.prep("--hellaswag", src, "--out", out)
        self.assertIn(b"(2 examples, 6 completions", p.stdout)
        want = self.path("want.bin")
        write_evalfile(want, [(r["label"], list(r["ctx"].encode()),
                               [list((" " + e).encode()) for e in r["endings"]]) for r in rows])
        with open(os.path.join(out, "hellaswag_val.bin"), "rb") as f, open(want, "rb") as g:
            self.assertEqual(f.read(), g.read())

    def test_bad_input(self):
        def train(evalfile, expect, msg, *extra):
            args = self.train_args("bad", 4, 1, *extra)
            args[args.index("--eval") + 1] = evalfile
            p = self.run_one(args, expect)
            self.assertIn(msg, p.stderr)

        with open(self.evalfile, "rb") as f:
            good = f.read()
        cases = {
            "shard.bin": (os.path.join(GOLDEN, "tiny_val.bin"), "not an eval file"),
            "truncated.bin": (good[:-4], "runs past the end of the file"),
            "odd.bin": (good[:-3], "bytes after the header, not a whole number of uint16"),
            "count.bin": (good[:8] + (38).to_bytes(4, "little") + good[12:],
                          "truncated: example 37 of the header's count is missing"),
            "trailing.bin": (good + b"\0\0", "2 bytes after the header's 37 examples"),
            "index.bin": (good[:1024 + 4] + b"\x05\x00" + good[1024 + 6:],
                          "example 0: expected its start (65535) and index 0, found 65535 and 5"),
        }
        for name, (data, msg) in cases.items():
            path = data if name == "shard.bin" else self.path(name)
            if name != "shard.bin":
                with open(path, "wb") as f:
                    f.write(data)
            with self.subTest(case=name):
                train(path, 1, msg)
        big = self.path("vocab.bin")
        write_evalfile(big, [(0, [1, 2], [[3], [150]])])
        train(big, 1, "example 0: token 150 is not below the vocabulary size 100")
        label = self.path("label.bin")
        write_evalfile(label, [(2, [1, 2], [[3], [4]])])
        train(label, 1, "example 0: label 2 is not one of its 2 completions")
        long = self.path("long.bin")
        write_evalfile(long, [(0, [1] * 20, [[3], [4] * 14])])
        train(long, 1, "its longest example needs %d positions (context and completion, %d "
              "tokens, but the last), more than --seq %d" % (SEQ + 1, SEQ + 2, SEQ))
        train(self.path("missing.bin"), 1, "missing.bin: No such file or directory")
        args = self.train_args("bad", 4, 1)
        del args[args.index("--eval"):args.index("--eval") + 2]
        p = self.run_one(args + ["--eval-every", "2"], 1)
        self.assertIn("--eval-every and --eval-out need --eval", p.stderr)
        i = args.index("--train")
        p = self.run_one(args[:i] + args[i + 2:], 1)
        self.assertIn("--train is required (only a run of --steps 0", p.stderr)
        p = self.run_one(self.train_args("bad", 4, 1, "--eval-every", "-1"), 1)
        self.assertIn("--eval-every must be >= 0", p.stderr)
        p = self.run_one(self.train_args("bad", 4, 1, "--eval-out", "/nonexistent/x.jsonl"), 1)
        self.assertIn("--eval-out /nonexistent/x.jsonl: No such file or directory", p.stderr)

        lines = {
            "notjson": ("{\"ctx\": ", "not a JSON object"),
            "nolabel": (json.dumps({"ctx": "a", "endings": ["b", "c"]}),
                        "expected an integer \"label\" (HellaSwag's test split has none"),
            "range": (json.dumps({"ctx": "a", "label": 2, "endings": ["b", "c"]}),
                      "label 2 is not one of its 2 completions"),
            "one": (json.dumps({"ctx": "a", "label": 0, "endings": ["b"]}),
                    "1 endings (expected 2..64)"),
            "noctx": (json.dumps({"label": 0, "endings": ["b", "c"]}),
                      "expected HellaSwag's fields"),
            "emptyctx": (json.dumps({"ctx": "", "label": 0, "endings": ["b", "c"]}),
                         "an empty context"),
            "notstr": (json.dumps({"ctx": "a", "label": 0, "endings": ["b", 3]}),
                       "ending 1 is not a string"),
        }
        for name, (line, msg) in lines.items():
            with self.subTest(jsonl=name):
                src = self.path(name + ".jsonl")
                with open(src, "w") as f:
                    f.write(json.dumps({"ctx": "x", "label": 0, "endings": ["y", "z"]}) + "\n"
                            + line + "\n")
                out = self.path("out-" + name)
                p = self.prep("--hellaswag", src, "--out", out, expect=1)
                err = p.stderr.decode()
                self.assertIn("%s:2: %s" % (src, msg), err)
                self.assertEqual(err.count("\n"), 1, err)
                self.assertFalse(os.path.exists(out), "nothing is written")
        p = self.prep("--hellaswag", src, "--out", out, "--input", src, expect=2)
        self.assertIn(b"--hellaswag takes --out and", p.stderr)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    args, rest = ap.parse_known_args()
    conv.BUILD = os.path.abspath(args.build)
    dp.BUILD = conv.BUILD
    unittest.main(argv=[sys.argv[0]] + rest)
