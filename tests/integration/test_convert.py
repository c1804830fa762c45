#!/usr/bin/env python3
"""test_convert.py — distrain-convert between distrain checkpoints, llm.c files and Hugging
Face's GPT-2 (config.json + model.safetensors).

The Hugging Face side is checked against the format's definition, not against distrain's own
reading of it: the test reads and writes safetensors itself (8-byte header size, JSON header,
raw tensors) and runs GPT-2's forward pass in numpy on the Hugging Face tensors as
transformers' GPT2LMHeadModel computes it (Conv1D: y = x W + b, with W stored (in, out); GELU's
tanh approximation; the LM head tied to wte). On a model distrain trained for a few steps:
  - the forward of the exported Hugging Face weights gives the loss distrain-train computes for
    the same weights and batch (float64 against fp32: 1e-5 relative);
  - ckpt -> hf -> llmc gives the bytes of the trainer's own --export-llmc, and hf -> hf the same
    safetensors bytes;
  - a file written by the test (fp16 tensors, the "transformer." prefix, a tied lm_head, the
    attention's mask buffers) is read with its values;
  - each bad input is refused with one line naming the file and what is wrong.

  /usr/bin/python3 tests/integration/test_convert.py --build build
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import test_dp as dp  # the multi-rank launcher

BUILD = None
L, NH, C, V, T = 2, 2, 32, 256, 16


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        dtype = {"F32": np.float32, "F16": np.float16}[e["dtype"]]
        out[name] = np.frombuffer(data[b:end], dtype=dtype).reshape(e["shape"]).astype(np.float64)
    return header, out


def write_safetensors(path, tensors, dtype="F16"):
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        if dtype == "BF16":  # the top halves of float32s (the values must be bf16 ones)
            b = (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16).astype(
                np.uint16).tobytes()
        else:
            b = np.ascontiguousarray(a, dtype=np.float16 if dtype == "F16" else np.float32).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def hf_logits(w, idx, n_layer, n_head):
    """The logits (B, T, V) of GPT2LMHeadModel (HF's tensors w, float64) on inputs idx (B, T)."""
    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w[p + ".weight"] + w[p + ".bias"]

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    def conv1d(x, p):
        return x @ w[p + ".weight"] + w[p + ".bias"]

    B, T = idx.shape
    x = w["wte.weight"][idx] + w["wpe.weight"][:T]
    width = x.shape[-1]
    hs = width // n_head
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for layer in range(n_layer):
        p = "h.%d." % layer
        q, k, v = np.split(conv1d(ln(x, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
        q, k, v = (a.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3) for a in (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, width)
        x = x + conv1d(y, p + "attn.c_proj")
        x = x + conv1d(gelu(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return ln(x, "ln_f") @ w["wte.weight"].T


def hf_token_losses(w, idx, tgt, n_layer, n_head):
    """Per-token cross-entropy (B, T) of GPT2LMHeadModel (HF's tensors w, float64) on inputs
    idx and targets tgt (B, T)."""
    logits = hf_logits(w, idx, n_layer, n_head)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, tgt[..., None], -1)[..., 0]


def hf_forward_loss(w, tokens, B):
    """Mean cross-entropy of GPT2LMHeadModel (HF's tensors w) on B sequences of T tokens."""
    seq = np.array(tokens[:B * T + 1])
    return hf_token_losses(w, seq[:-1].reshape(B, T), seq[1:].reshape(B, T), L, NH).mean()


def read_llmc(path):
    """An llm.c fp32 model file as Hugging Face's GPT-2 tensors (Conv1D weights (in, out); wte
    without llm.c's padded rows) in float64, and its layers and heads."""
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype="<i4")
        flat = np.frombuffer(f.read(), dtype="<f4").astype(np.float64)
    assert header[0] == 20240326 and header[1] == 3
    maxT, V, L, NH, C, Vp = (int(x) for x in header[2:8])
    at = 0

    def take(*shape):
        nonlocal at
        n = int(np.prod(shape))
        at += n
        return flat[at - n:at].reshape(shape)
    w = {"wte.weight": take(Vp, C)[:V], "wpe.weight": take(maxT, C)}  # without the padding
    per_layer = [("ln_1.weight", (C,)), ("ln_1.bias", (C,)), ("attn.c_attn.weight", (3 * C, C)),
                 ("attn.c_attn.bias", (3 * C,)), ("attn.c_proj.weight", (C, C)),
                 ("attn.c_proj.bias", (C,)), ("ln_2.weight", (C,)), ("ln_2.bias", (C,)),
                 ("mlp.c_fc.weight", (4 * C, C)), ("mlp.c_fc.bias", (4 * C,)),
                 ("mlp.c_proj.weight", (C, 4 * C)), ("mlp.c_proj.bias", (C,))]
    for name, shape in per_layer:  # llm.c keeps each tensor for all layers together
        t = take(L, *shape)
        for layer in range(L):
            w["h.%d.%s" % (layer, name)] = t[layer].T if len(shape) == 2 else t[layer]
    w["ln_f.weight"], w["ln_f.bias"] = take(C), take(C)
    assert at == len(flat)
    return w, L, NH


class Convert(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="dt-conv-")
        d = cls.dir = cls.tmp.name
        text = os.path.join(d, "text.txt")
        with open(text, "w") as f:
            f.write("".join("line %d: the quick brown fox jumps over the lazy dog\n" % i
                            for i in range(400)))
        cls.data = os.path.join(d, "data")
        cls.run_ok([cls.bin("distrain-prep"), "--input", text, "--out", cls.data])
        cls.ckpt = os.path.join(d, "ckpt")
        cls.export = os.path.join(d, "export.bin")
        cls.run_ok(cls.train_args() + ["--steps", "6", "--ckpt-dir", cls.ckpt, "--save-every", "6",
                                       "--export-llmc", cls.export, "--init", "seed:3"])

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @staticmethod
    def bin(name):
        return os.path.join(BUILD, "worker/trainer", name)

    @classmethod
    def train_args(cls):
        return [cls.bin("distrain-train"), "--train", os.path.join(cls.data, "train_*.bin"),
                "--layers", str(L), "--heads", str(NH), "--channels", str(C), "--vocab", str(V),
                "--max-seq", str(T), "--batch", "4", "--seq", str(T), "--lr", "1e-2",
                "--threads", "1", "--quiet"]

    @staticmethod
    def run_ok(args):
        p = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        return p

    def convert(self, src, dst, expect=0):
        p = subprocess.run([self.bin("distrain-convert"), src, dst], capture_output=True,
                           text=True, timeout=120)
        self.assertEqual(p.returncode, expect, p.stdout + p.stderr)
        return p

    def path(self, name):
        return os.path.join(self.dir, name)

    def assert_refused(self, *cases):
        """Each (extra flags, message): a one-step training run with them fails saying it."""
        for args, want in cases:
            p = subprocess.run(self.train_args() + ["--steps", "1"] + args, capture_output=True,
                               text=True, timeout=120)
            self.assertNotEqual(p.returncode, 0, args)
            self.assertIn(want, p.stderr, args)

    def test_exported_weights_give_distrains_loss(self):
        hf = self.path("hf")
        p = self.convert("ckpt:" + self.ckpt, "hf:" + hf)
        self.assertIn("(step 6) -> hf:", p.stdout)
        with open(os.path.join(hf, "config.json")) as f:
            cfg = json.load(f)
        self.assertEqual((cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["vocab_size"],
                          cfg["n_positions"], cfg["model_type"], cfg["activation_function"]),
                         (L, NH, C, V, T, "gpt2", "gelu_new"))
        header, w = read_safetensors(os.path.join(hf, "model.safetensors"))
        self.assertEqual(header["__metadata__"], {"format": "pt"})
        self.assertEqual(w["h.1.attn.c_attn.weight"].shape, (C, 3 * C))  # Conv1D: (in, out)
        self.assertEqual(w["wte.weight"].shape, (V, C))
        # distrain-train's first loss on the same weights (the trainer's own export of them, so
        # that the loss pins what was written, not what distrain-convert reads back) and batch 0
        metrics = self.path("m.jsonl")
        self.run_ok(self.train_args() + ["--steps", "1", "--init", "llmc:" + self.export,
                                         "--metrics", metrics])
        with open(metrics) as f:
            loss = json.loads(f.readline())["loss"]
        with open(os.path.join(self.data, "train_000000.bin"), "rb") as f:
            tokens = np.frombuffer(f.read()[1024:], dtype=np.uint16).astype(np.int64)
        ref = hf_forward_loss(w, tokens, 4)
        self.assertLess(abs(loss - ref), 1e-5 * ref, (loss, ref))
        self.assertGreater(abs(ref - np.log(V)), 0.1, "the model is untrained")

    def test_training_from_hf_dir(self):
        """--init hf:DIR trains as --init llmc: of the same weights, bit for bit."""
        hf = self.path("init-hf")
        self.convert("llmc:" + self.export, "hf:" + hf)
        losses = []
        for init in ("hf:" + hf, "llmc:" + self.export):
            metrics = self.path("init-%d.jsonl" % len(losses))
            self.run_ok(self.train_args() + ["--steps", "3", "--init", init, "--metrics", metrics])
            with open(metrics) as f:
                losses.append([json.loads(line)["loss"] for line in f])
        self.assertEqual(losses[0], losses[1])
        self.assert_refused(
                (["--init", "hf:" + self.path("nowhere")], "config.json: No such file"),
                (["--init", "hf:" + hf, "--layers", "3"], "layers"),
                (["--init", "hf:"], "--init: expected llmc:PATH, hf:DIR, ckpt:DIR or seed:N"))

    def test_training_from_a_checkpoints_weights(self):
        """--init ckpt:DIR (Megatron-LM's --finetune) trains as --init llmc: of the weights the
        run that saved it exported, bit for bit: its weights only, with AdamW's moments, the
        step and the data position afresh (any of them taken from the checkpoint would change
        the losses). The checkpoint root (its newest step) and a step directory alike; one
        saved by dp=2 under ZeRO-3 too."""
        def losses(tag, init):
            metrics = self.path("ft-%s.jsonl" % tag)
            p = self.run_ok(self.train_args() + ["--steps", "3", "--init", init,
                                                 "--metrics", metrics])
            with open(metrics) as f:
                return [json.loads(line)["loss"] for line in f], p.stderr
        ref, _ = losses("llmc", "llmc:" + self.export)
        got, log = losses("root", "ckpt:" + self.ckpt)
        self.assertEqual(got, ref)
        self.assertIn("--init ckpt:%s: the weights of its step 6; AdamW's moments, the step count "
                      "and the data position start afresh" % self.ckpt, log)
        self.assertEqual(losses("step", "ckpt:" + os.path.join(self.ckpt, "step-00000006"))[0],
                         ref)
        # a checkpoint of another layout: dp=2, ZeRO-3, each rank writing its shard
        ck, export = self.path("ckpt-z3"), self.path("export-z3.bin")
        args = self.train_args() + ["--steps", "4", "--init", "seed:5", "--zero-stage", "3",
                                    "--ckpt-dir", ck, "--save-every", "4", "--export-llmc", export]
        args[args.index("--batch") + 1] = "2"  # the same global batch of 4
        outs = dp.wait_all(dp.launch(2, lambda r: args, tempfile.mkdtemp(dir=self.dir)))
        dp.assert_ranks_ok(outs, "dp=2 ZeRO-3")
        self.assertEqual(len(os.listdir(os.path.join(ck, "step-00000004"))), 3)  # 2 shards
        self.assertEqual(losses("z3", "ckpt:" + ck)[0], losses("z3-llmc", "llmc:" + export)[0])
        self.assert_refused(
                (["--init", "ckpt:" + self.path("nowhere")], "nowhere"),
                (["--init", "ckpt:" + self.ckpt, "--layers", "3"], "layers"),
                (["--init", "ckpt:" + self.ckpt, "--ckpt-dir", self.ckpt, "--resume"],
                 "--init llmc:PATH, hf:DIR or ckpt:DIR and --resume are mutually exclusive"),
                (["--init", "ckpt:"], "--init: expected llmc:PATH, hf:DIR, ckpt:DIR or seed:N"))

    def test_round_trips_are_exact(self):
        hf = self.path("rt-hf")
        self.convert("llmc:" + self.export, "hf:" + hf)
        back = self.path("rt.bin")
        self.convert("hf:" + hf, "llmc:" + back)
        with open(back, "rb") as a, open(self.export, "rb") as b:
            self.assertEqual(a.read(), b.read(), "llmc -> hf -> llmc changed the file")
        self.convert("hf:" + hf, "hf:" + self.path("rt-hf2"))
        for name in ("model.safetensors", "config.json"):
            with open(os.path.join(hf, name), "rb") as a, \
                    open(os.path.join(self.path("rt-hf2"), name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
        # the checkpoint's weights are the trainer's export
        self.convert("ckpt:" + self.ckpt, "llmc:" + self.path("ck.bin"))
        with open(self.path("ck.bin"), "rb") as a, open(self.export, "rb") as b:
            self.assertEqual(a.read(), b.read())

    def hf_dir(self, name, tensors, config=None, dtype="F16"):
        d = self.path(name)
        os.makedirs(d, exist_ok=True)
        cfg = {"model_type": "gpt2", "n_layer": L, "n_head": NH, "n_embd": C, "vocab_size": V,
               "n_positions": T, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
        cfg.update(config or {})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        write_safetensors(os.path.join(d, "model.safetensors"), tensors, dtype)
        return d

    def random_tensors(self, prefix="transformer."):
        rng = np.random.default_rng(1)
        t = {"wte.weight": (V, C), "wpe.weight": (T, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
        for layer in range(L):
            for name, shape in (("ln_1", (C,)), ("ln_2", (C,))):
                t["h.%d.%s.weight" % (layer, name)] = shape
                t["h.%d.%s.bias" % (layer, name)] = shape
            for name, i, o in (("attn.c_attn", C, 3 * C), ("attn.c_proj", C, C),
                               ("mlp.c_fc", C, 4 * C), ("mlp.c_proj", 4 * C, C)):
                t["h.%d.%s.weight" % (layer, name)] = (i, o)
                t["h.%d.%s.bias" % (layer, name)] = (o,)
        out = {prefix + k: rng.standard_normal(s).astype(np.float16) for k, s in t.items()}
        for layer in range(L):  # transformers' saved mask buffers, ignored
            out[prefix + "h.%d.attn.bias" % layer] = np.tril(np.ones((1, 1, T, T)))
        out["lm_head.weight"] = out[prefix + "wte.weight"]
        return out

    def test_reads_fp16_with_prefix_and_buffers(self):
        t = self.random_tensors()
        d = self.hf_dir("fp16", t)
        self.convert("hf:" + d, "hf:" + self.path("fp16-out"))
        _, w = read_safetensors(os.path.join(self.path("fp16-out"), "model.safetensors"))
        for name, a in t.items():
            if ".attn.bias" in name or name == "lm_head.weight":
                continue
            np.testing.assert_array_equal(w[name[len("transformer."):]], a.astype(np.float64),
                                          name)

    def test_reads_bf16(self):
        t = {k: v.astype(np.float32) for k, v in self.random_tensors(prefix="").items()}
        t = {k: (v.view(np.uint32) & 0xFFFF0000).view(np.float32) for k, v in t.items()}  # bf16
        d = self.hf_dir("bf16", t, dtype="BF16")
        self.convert("hf:" + d, "hf:" + self.path("bf16-out"))
        _, w = read_safetensors(os.path.join(self.path("bf16-out"), "model.safetensors"))
        for name, a in t.items():
            if ".attn.bias" not in name and name != "lm_head.weight":
                np.testing.assert_array_equal(w[name], a.astype(np.float64), name)

    def test_bad_input(self):
        t = self.random_tensors(prefix="")
        cases = []
        bad = dict(t)
        del bad["h.1.mlp.c_fc.bias"]
        cases.append(("missing", bad, {}, "no tensor h.1.mlp.c_fc.bias"))
        bad = dict(t)
        bad["h.0.attn.c_attn.weight"] = bad["h.0.attn.c_attn.weight"].T
        cases.append(("shape", bad, {}, "tensor h.0.attn.c_attn.weight: shape [ %d, %d ], "
                      "expected [%d, %d]" % (3 * C, C, C, 3 * C)))
        bad = dict(t)
        bad["lm_head.weight"] = bad["lm_head.weight"] + np.float16(1)
        cases.append(("untied", bad, {}, "lm_head.weight differs from wte.weight"))
        bad = dict(t)
        bad["h.2.ln_1.weight"] = t["h.0.ln_1.weight"]
        cases.append(("extra", bad, {}, "tensor h.2.ln_1.weight is not one of GPT-2's "
                      "(config.json: 2 layers)"))
        cases.append(("relu", t, {"activation_function": "relu"},
                      'activation_function "relu": distrain\'s GPT-2 uses'))
        cases.append(("noheads", t, {"n_head": None}, '"n_head": expected a positive integer'))
        for name, tensors, config, want in cases:
            d = self.hf_dir("bad-" + name, tensors, config)
            p = self.convert("hf:" + d, "llmc:" + self.path("bad.bin"), expect=1)
            self.assertIn(want, p.stderr, name)
            self.assertFalse(os.path.exists(self.path("bad.bin")), name)
        d = self.hf_dir("bad-trunc", t)
        st = os.path.join(d, "model.safetensors")
        os.truncate(st, os.path.getsize(st) - 4)
        p = self.convert("hf:" + d, "llmc:" + self.path("bad.bin"), expect=1)
        self.assertIn("data_offsets", p.stderr)
        with open(st, "wb") as f:
            f.write(struct.pack("<Q", 5) + b"[1,2]")
        p = self.convert("hf:" + d, "llmc:" + self.path("bad.bin"), expect=1)
        self.assertIn("the header is not a JSON object", p.stderr)
        p = self.convert("hf:" + self.path("nowhere"), "llmc:" + self.path("bad.bin"), expect=1)
        self.assertIn("config.json: No such file or directory", p.stderr)
        for args in (["llmc:" + self.export], ["ckpt:" + self.ckpt, "ckpt:x"],
                     ["gguf:x", "hf:y"], ["hf:", "llmc:x"]):
            p = subprocess.run([self.bin("distrain-convert"), *args], capture_output=True,
                               text=True)
            self.assertEqual(p.returncode, 2, args)
            self.assertIn("usage: distrain-convert FROM TO", p.stderr)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    args, rest = ap.parse_known_args()
    BUILD = dp.BUILD = os.path.abspath(args.build)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
