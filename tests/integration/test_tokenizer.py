#!/usr/bin/env python3
"""test_tokenizer.py — distrain-prep's GPT-2 BPE tokenizer against a reference implementation.

The reference below is OpenAI's GPT-2 encoder algorithm (encoder.py): GPT-2's split pattern
verbatim, on the `regex` module (Debian's python3-regex), and in each piece every occurrence of
the best-ranked pair merged until no pair has a merge. GPT-2's own vocab.json / merges.txt are
not on the CI machines, so the test trains a vocabulary of its own (byte-level BPE, 1200
merges, the way GPT-2's was made) on a mixed corpus: the README's prose, Python source, a
shuffle of snippets in many scripts, digits, emoji and whitespace characters, and runs of one
character or pattern (pieces of hundreds of bytes, merged many times each); and it numbers the
tokens in a random order, so that nothing may rely on GPT-2's id layout. Then:
  - the shards distrain-prep writes hold, for every document, <|endoftext|> and the reference's
    ids, with documents from a file, from --doc-sep separated parts and from .jsonl lines;
  - --decode gives back the exact text;
  - distrain-train --sample --vocab-file prints its prompt as the prompt's text;
  - every bad input gets one clear line and its exit code, and writes nothing.
(Against GPT-2's real files and tiktoken, see tests/bench/bench_tokenizer.py.)

  /usr/bin/python3 tests/integration/test_tokenizer.py --build build
"""
import argparse
import glob
import heapq
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import unittest
from collections import Counter

import regex

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = None
PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
EOT = "<|endoftext|>"


def bytes_to_unicode():
    """GPT-2's byte -> character map (encoder.py)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


B2U = bytes_to_unicode()
U2B = {c: b for b, c in B2U.items()}


def spell(bs):
    return "".join(B2U[b] for b in bs)


def train_bpe(text, merges):
    """Byte-level BPE training: repeatedly merge the most frequent adjacent pair (ties: the
    smallest pair), counted over the split pattern's pieces. Returns the merges as byte pairs."""
    words = [[bytes([b]) for b in w.encode()] for w in PAT.findall(text)]
    counts = Counter(map(tuple, words))
    words = [list(w) for w in counts]
    freq = [counts[tuple(w)] for w in words]
    pair_count, where = Counter(), {}
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pair_count[p] += freq[i]
            where.setdefault(p, set()).add(i)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < merges:
        c, p = heapq.heappop(heap)
        if -c != pair_count.get(p, 0) or -c < 2:
            continue  # stale entry
        out.append(p)
        merged = p[0] + p[1]
        for i in list(where.get(p, ())):
            w, f = words[i], freq[i]
            for q in zip(w, w[1:]):
                pair_count[q] -= f
            j, nw = 0, []
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == p:
                    nw.append(merged)
                    j += 2
                else:
                    nw.append(w[j])
                    j += 1
            words[i] = nw
            for q in zip(nw, nw[1:]):
                pair_count[q] += f
                where.setdefault(q, set()).add(i)
                heapq.heappush(heap, (-pair_count[q], q))
        pair_count.pop(p, None)
    return out


class Reference:
    """OpenAI's GPT-2 encoder (encoder.py's bpe()), on vocab.json's and merges.txt's contents."""

    def __init__(self, encoder, merges):
        self.encoder = encoder
        self.decoder = {v: k for k, v in encoder.items()}
        self.ranks = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
        self.cache = {}

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            bigram = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if bigram not in self.ranks:
                break
            first, second = bigram
            new, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
                    new.append(first + second)
                    i += 2
                else:
                    new.append(word[i])
                    i += 1
            word = tuple(new)
        self.cache[token] = word
        return word

    def encode(self, text):
        ids = []
        for piece in PAT.findall(text):
            ids += [self.encoder[t] for t in self.bpe(spell(piece.encode()))]
        return ids

    def decode(self, ids):
        return b"".join(bytes(U2B[c] for c in self.decoder[i]) for i in ids)


def snippets_text(seed, n):
    """Snippets in many scripts, with digits of several kinds, emoji, combining marks, and the
    whitespace characters the pattern tells apart (a White_Space set, and ones outside it)."""
    pieces = ["Hello", "world", "don't", "DON'T", "it's", "we've", "they'll", "I'd", "'s", "'",
              "x'y", "日本語のテキスト", "Ελληνικά", "русский текст", "عربي", "हिन्दी", "한국어",
              "ñandú", "e\u0301", "\u0300", "٣٤٥", "²³", "Ⅻ", "½", "123456789012", "3.14159",
              "😀😃🎉", "👨\u200d👩\u200d👧", "\ufeff", "\u00ad", " ", "  ", "   ", "\t", "\n",
              "\r\n", "\n\n\n", "\u00a0", "\u2003", "\u3000", "\x1c", "\x1f", "\x85", "\x0b",
              "\x0c", "\u2028", "\u202f", "\u180e", "\u200b", "!!!", "...", "—", "«»", "$$",
              EOT, "\x00", "\x7f", "a", "Z", "_", "__init__", "self.x", "(1, 2)", "#", "\\",
              "\"quoted\""]
    rng = random.Random(seed)
    return "".join(rng.choice(pieces) + (" " if rng.random() < 0.3 else "") for _ in range(n))


def runs_text(seed, n):
    """Runs of one character or short pattern, up to 300 long: pieces of hundreds of bytes,
    which merge many times each."""
    rng = random.Random(seed)
    kinds = [" ", "\t", "\n", "a", "ab", "the", "1", "=", "é", "  \n", " x", "\u3000", "-_"]
    return "".join(rng.choice(kinds) * rng.randint(1, 300 // 3) for _ in range(n))


def read(path, mode="r"):
    with open(path, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
        return f.read()


def write(path, data):
    with open(path, "wb" if isinstance(data, bytes) else "w",
              **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
        f.write(data)


def read_tokens(path):
    raw = read(path, "rb")
    magic, version, n = struct.unpack("<3i", raw[:12])
    assert (magic, version) == (20240520, 1) and len(raw) == 1024 + 2 * n, path
    return list(struct.unpack("<%dH" % n, raw[1024:]))


def write_shard(path, tokens):
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


class Tokenizer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="dt-tok-")
        d = cls.dir = cls.tmp.name
        prose = read(os.path.join(ROOT, "README.md"))
        code = "".join(read(p) for p in sorted(glob.glob(os.path.join(HERE, "*.py"))))
        cls.prose, cls.code = prose, code
        cls.jsonl_docs = ([snippets_text(seed, 300) for seed in range(40)] +
                          [runs_text(seed, 60) for seed in range(5)])
        merges = train_bpe(prose + code[:200000] + snippets_text(99, 20000) + runs_text(99, 200),
                           1200)
        tokens = [bytes([b]) for b in range(256)]
        for a, b in merges:
            if a + b not in tokens:  # two merges can make the same bytes
                tokens.append(a + b)
        ids = list(range(len(tokens) + 1))
        random.Random(5).shuffle(ids)
        encoder = {spell(t): i for t, i in zip(tokens, ids)}
        encoder[EOT] = ids[-1]
        cls.vocab_size = len(ids)
        cls.vocab = os.path.join(d, "vocab.json")
        cls.merges = os.path.join(d, "merges.txt")
        with open(cls.vocab, "w", encoding="utf-8") as f:
            json.dump(encoder, f, ensure_ascii=False)
        with open(cls.merges, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(spell(a) + " " + spell(b) + "\n"
                                                for a, b in merges))
        cls.ref = Reference(encoder, [spell(a) + " " + spell(b) for a, b in merges])
        cls.eot = encoder[EOT]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def prep(self, *args, expect=0, env=None):
        p = subprocess.run([os.path.join(BUILD, "worker/trainer/distrain-prep"), *args],
                           capture_output=True, timeout=120, env=dict(os.environ, **(env or {})))
        self.assertEqual(p.returncode, expect, p.stderr.decode(errors="replace"))
        return p

    def prep_bpe(self, out, *args, expect=0, env=None):
        return self.prep("--vocab-file", self.vocab, "--merge-file", self.merges, "--out", out,
                         *args, expect=expect, env=env)

    def shards(self, out):
        return sorted(glob.glob(os.path.join(out, "train_*.bin"))) + [os.path.join(out, "val.bin")]

    def test_documents_equal_the_reference(self):
        d = self.dir
        prose, code = os.path.join(d, "prose.txt"), os.path.join(d, "code.txt")
        jsonl = os.path.join(d, "snippets.jsonl")
        write(prose, self.prose)
        write(code, self.code)
        with open(jsonl, "w", encoding="utf-8") as f:
            for i, doc in enumerate(self.jsonl_docs):
                f.write(json.dumps({"id": i, "text": doc}) + "\n")
            f.write("\n")  # a blank last line is no document
        docs = ([p for p in self.prose.split("\n\n") if p] + [p for p in self.code.split("\n\n") if p]
                + self.jsonl_docs)
        want = []
        for doc in docs:
            want += [self.eot] + self.ref.encode(doc)
        # Long documents are cut into parts that threads encode (dt_bpe_next_cut): parts of 64
        # bytes cut nearly every line, and the tokens must not change.
        # And with at most 1000 tokens in memory, the rest spilled to a file, and batches of
        # 1000 bytes, which encode a long document's parts a few at a time: the same shards.
        for name, env in (("docs", {}), ("parts", {"DISTRAIN_PREP_PART_BYTES": "64"}),
                          ("spilled", {"DISTRAIN_PREP_BUFFER_TOKENS": "1000",
                                       "DISTRAIN_PREP_BATCH_BYTES": "1000",
                                       "DISTRAIN_PREP_PART_BYTES": "64"})):
            out = os.path.join(d, name)
            p = self.prep_bpe(out, "--input", prose, "--input", code, "--input", jsonl,
                              "--doc-sep", "\\n\\n", "--shard-tokens", "50000", "--threads", "2",
                              env=env)
            got = []
            for s in self.shards(out):
                got += read_tokens(s)
            self.assertGreater(len(self.shards(out)), 2)
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            self.assertEqual((len(got), first), (len(want), None),
                             "%s: first difference at token %s" % (name, first))
            self.assertIn(b"tokenized %d documents" % len(docs), p.stdout)
        # --decode: each shard's text, together the documents with their separators
        text = b"".join(self.prep("--decode", s, "--vocab-file", self.vocab).stdout
                        for s in self.shards(out))
        self.assertEqual(text, "".join(EOT + doc for doc in docs).encode())
        # a whole file is one document without --doc-sep (here cut into ~4,000 parts)
        out1 = os.path.join(d, "one")
        self.prep_bpe(out1, "--input", code, env={"DISTRAIN_PREP_PART_BYTES": "64"})
        got = []
        for s in self.shards(out1):
            got += read_tokens(s)
        self.assertEqual(got, [self.eot] + self.ref.encode(self.code))

    def test_hellaswag_eval_file(self):
        """--hellaswag: each context's tokens, and each ending's as " " + ending (as llm.c's
        hellaswag.py encodes them), in llm.c's eval format, as the test's own writer does."""
        import test_eval  # noqa: E402  (llm.c's eval format)
        rng = random.Random(3)
        docs = self.jsonl_docs[:40]
        rows = [{"ctx": docs[i][:rng.randint(1, 150)], "label": rng.randrange(4),
                 "endings": [rng.choice(docs)[:rng.randint(1, 60)].strip() or "x"
                             for _ in range(4)]} for i in range(len(docs))]
        src = os.path.join(self.dir, "hellaswag_val.jsonl")
        with open(src, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        out = os.path.join(self.dir, "hswag")
        self.prep_bpe(out, "--hellaswag", src)
        want = os.path.join(self.dir, "hswag-want.bin")
        test_eval.write_evalfile(want, [(r["label"], self.ref.encode(r["ctx"]),
                                         [self.ref.encode(" " + e) for e in r["endings"]])
                                        for r in rows])
        self.assertEqual(read(os.path.join(out, "hellaswag_val.bin"), "rb"), read(want, "rb"))

    def test_sample_prints_text(self):
        d = self.dir
        src = os.path.join(d, "sample.txt")
        write(src, self.prose)
        out = os.path.join(d, "sample")
        self.prep_bpe(out, "--input", src)
        train = [os.path.join(BUILD, "worker/trainer/distrain-train"),
                 "--train", os.path.join(out, "train_*.bin"), "--val", os.path.join(out, "val.bin"),
                 "--layers", "1", "--heads", "2", "--channels", "32", "--max-seq", "64",
                 "--batch", "2", "--seq", "64", "--steps", "1", "--sample", "8", "--quiet",
                 "--vocab-file", self.vocab, "--threads", "1"]
        p = subprocess.run(train + ["--vocab", str(self.vocab_size)], capture_output=True,
                           timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr.decode(errors="replace"))
        prompt = self.ref.decode(read_tokens(os.path.join(out, "val.bin"))[:32])
        head = b"---- sample (temperature 0.80) ----\n"
        self.assertIn(head, p.stdout)
        after = p.stdout.split(head, 1)[1]
        self.assertTrue(after.startswith(prompt.decode("utf-8", errors="ignore").encode()),
                        (after[:200], prompt))
        # a vocabulary larger than the model's is refused before training
        p = subprocess.run(train + ["--vocab", "300"], capture_output=True, timeout=120)
        self.assertEqual(p.returncode, 1)
        self.assertIn(b"--vocab-file %s: %d tokens, more than the model's vocabulary (300)"
                      % (self.vocab.encode(), self.vocab_size), p.stderr)

    def test_sample_from_a_prompt(self):
        """--prompt TEXT: the sample goes on from the text's BPE tokens, as from a --val shard
        that starts with the reference tokenizer's encoding of it (same model, same seed: the
        same sample, byte for byte); a 256-token model takes the prompt's bytes."""
        text = "In the beginning God created the heaven and the earth. ÄÖ"
        toks = self.ref.encode(text)
        val = os.path.join(self.dir, "prompt-val.bin")
        write_shard(val, toks + toks[:1])  # one window of len(toks), and its target
        run = [os.path.join(BUILD, "worker/trainer/distrain-train"), "--steps", "0",
               "--layers", "1", "--heads", "2", "--channels", "32", "--max-seq", "64",
               "--vocab", str(self.vocab_size), "--batch", "1", "--seq", str(len(toks)),
               "--sample", "12", "--init", "seed:7", "--threads", "1", "--quiet",
               "--vocab-file", self.vocab]
        outs = []
        for extra in (["--val", val], ["--prompt", text, "--merge-file", self.merges]):
            p = subprocess.run(run + extra, capture_output=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stderr.decode(errors="replace"))
            outs.append(p.stdout)
        self.assertEqual(outs[0], outs[1])
        self.assertIn(b"---- sample (temperature 0.80) ----\n" + text.encode(), outs[1])
        # a byte-level model: the prompt's bytes, whatever they are
        byte = [os.path.join(BUILD, "worker/trainer/distrain-train"), "--steps", "0",
                "--layers", "1", "--heads", "2", "--channels", "16", "--max-seq", "32",
                "--vocab", "256", "--batch", "1", "--seq", "32", "--sample", "5", "--quiet",
                "--threads", "1", "--prompt", "Hello, world"]
        p = subprocess.run(byte, capture_output=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr.decode(errors="replace"))
        self.assertIn(b"---- sample (temperature 0.80) ----\nHello, world", p.stdout)
        for extra, want in (
                (["--vocab", "300"], b"--prompt: a model of 300 tokens needs --vocab-file and "
                 b"--merge-file (GPT-2's BPE) to encode it"),
                (["--sample", "0"], b"--prompt needs --sample N"),
                (["--vocab-file", self.vocab, "--vocab", str(self.vocab_size)],
                 b"--prompt with --vocab-file needs --merge-file too"),
                (["--vocab-file", self.vocab, "--vocab", str(self.vocab_size), "--merge-file",
                  self.merges, "--prompt", b"caf\xe9!"], b"--prompt: byte 3 is not UTF-8")):
            p = subprocess.run(byte + extra, capture_output=True, timeout=120)
            self.assertEqual(p.returncode, 1, (extra, p.stderr))
            self.assertIn(want, p.stderr, extra)

    def test_bad_input(self):
        d = self.dir
        out = os.path.join(d, "bad")
        bad = os.path.join(d, "latin1.txt")
        write(bad, "naïve café".encode("latin-1"))
        p = self.prep_bpe(out, "--input", bad, expect=1)
        self.assertIn(b"latin1.txt: byte offset 2 is not UTF-8", p.stderr)
        jsonl = os.path.join(d, "bad.jsonl")
        write(jsonl, '{"text": "ok"}\n{"text": \n')
        p = self.prep_bpe(out, "--input", jsonl, expect=1)
        self.assertIn(b"bad.jsonl:2: not a JSON object", p.stderr)
        write(jsonl, b'{"text": "ok"}\n{"text": "a\xffb"}\n')
        p = self.prep_bpe(out, "--input", jsonl, expect=1)
        self.assertIn(b"bad.jsonl:2: byte offset 1 of its text is not UTF-8", p.stderr)
        write(jsonl, '{"text": "ok"}\n{"body": "x"}\n')
        p = self.prep_bpe(out, "--input", jsonl, expect=1)
        self.assertIn(b'bad.jsonl:2: expected a string field "text" (--jsonl-key)', p.stderr)
        self.assertFalse(os.path.exists(out), "a failed prep wrote %s" % out)
        # a bad input after tokens went to the spill file: no file, no directory left
        prose = os.path.join(d, "prose-bad.txt")
        write(prose, self.prose)
        p = self.prep_bpe(out, "--input", prose, "--input", bad, expect=1,
                          env={"DISTRAIN_PREP_BUFFER_TOKENS": "100"})
        self.assertIn(b"latin1.txt: byte offset 2 is not UTF-8", p.stderr)
        self.assertFalse(os.path.exists(out), "a failed prep wrote %s" % out)
        noeot = os.path.join(d, "noeot.json")
        enc = dict(self.ref.encoder)
        del enc[EOT]
        write(noeot, json.dumps(enc, ensure_ascii=False))
        p = self.prep("--vocab-file", noeot, "--merge-file", self.merges, "--out", out,
                      "--input", bad, expect=1)
        self.assertIn(b"no <|endoftext|> token, which separates documents", p.stderr)
        p = self.prep("--vocab-file", self.vocab, "--input", bad, "--out", out, expect=2)
        self.assertIn(b"needs both --vocab-file and --merge-file", p.stderr)
        p = self.prep("--doc-sep", "\\n", "--input", bad, "--out", out, expect=2)
        self.assertIn(b"--doc-sep needs --vocab-file", p.stderr)
        p = self.prep_bpe(out, "--input", bad, "--doc-sep", "\\q", expect=2)
        self.assertIn(b"--doc-sep: expected text", p.stderr)
        # --decode: ids the vocabulary lacks, and a BPE shard read as bytes
        shard = os.path.join(d, "ids.bin")
        top = self.vocab_size - 1  # an id >= 256
        write_shard(shard, [top, 65000])
        p = self.prep("--decode", shard, "--vocab-file", self.vocab, expect=1)
        self.assertIn(b"token 65000 at position 1 is not in the vocabulary", p.stderr)
        p = self.prep("--decode", shard, expect=1)
        self.assertIn(b"token %d at position 0 is not in the byte vocabulary" % top, p.stderr)
        self.assertFalse(os.path.exists(out), "a failed prep wrote %s" % out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    args, rest = ap.parse_known_args()
    BUILD = os.path.abspath(args.build)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
