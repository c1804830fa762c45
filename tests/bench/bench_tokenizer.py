#!/usr/bin/env python3
"""Benchmark: distrain-prep's GPT-2 tokenizer against tiktoken (what llm.c's data scripts use)
on GPT-2's own vocabulary, for speed and for equal tokens.

For each text file: distrain-prep with 1 thread and with --threads N (default: all cores), and
tiktoken's encode_ordinary (1 thread) and encode_ordinary_batch over ~1 MB runs of the text's
whole lines (N threads), each the best of --rounds; distrain-prep's time is the one it prints
(tokenizing only, not reading the file or writing shards). The tokens must be equal: the
shards' tokens against [<|endoftext|>] + tiktoken's.

Needs tiktoken (`pip install tiktoken` in a virtual environment) and GPT-2's vocab.json
(encoder.json) and merges.txt (vocab.bpe), which tiktoken reads too; without network access,
make them from any copy of GPT-2's ranks (tiktoken's gpt2.tiktoken) with --from-tiktoken.

    VENV/bin/python tests/bench/bench_tokenizer.py --build build --vocab gpt2/vocab.json \\
        --merges gpt2/merges.txt TEXT [TEXT ...]
    VENV/bin/python tests/bench/bench_tokenizer.py --from-tiktoken gpt2.tiktoken --out gpt2/
"""
import argparse
import base64
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from test_tokenizer import EOT, bytes_to_unicode, read_tokens  # noqa: E402


def from_tiktoken(path, out):
    """vocab.json and merges.txt from a .tiktoken rank file: a token of rank r > 255 is the
    merge of the two parts that BPE with the ranks below r leaves of its bytes."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            tok, r = line.split()
            ranks[base64.b64decode(tok)] = int(r)
    b2u = bytes_to_unicode()
    spell = lambda bs: "".join(b2u[b] for b in bs)  # noqa: E731

    def split(tok, limit):
        parts = [bytes([b]) for b in tok]
        while True:
            best = min(((ranks.get(parts[i] + parts[i + 1], limit), i)
                        for i in range(len(parts) - 1)), default=(limit, 0))
            if best[0] >= limit:
                return parts
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]

    merges = []
    for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            a, b = split(tok, r)
            merges.append(spell(a) + " " + spell(b))
    vocab = {spell(t): r for t, r in ranks.items()}
    vocab[EOT] = len(ranks)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    print("wrote %s/vocab.json (%d tokens) and merges.txt (%d merges)"
          % (out, len(vocab), len(merges)))


def shard_tokens(out):
    toks = []
    for path in sorted(glob.glob(os.path.join(out, "train_*.bin"))) + [os.path.join(out, "val.bin")]:
        toks += read_tokens(path)
    return toks


def prep(args, text, threads, out):
    p = subprocess.run([os.path.join(args.build, "worker/trainer/distrain-prep"), "--input", text,
                        "--out", out, "--vocab-file", args.vocab, "--merge-file", args.merges,
                        "--val-fraction", "0.001", "--threads", str(threads)],
                       capture_output=True, text=True, check=True)
    m = re.search(r"in ([0-9.]+) s \(", p.stdout)
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build")
    ap.add_argument("--vocab")
    ap.add_argument("--merges")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--from-tiktoken", metavar="FILE")
    ap.add_argument("--out", default=".")
    ap.add_argument("texts", nargs="*")
    args = ap.parse_args()
    if args.from_tiktoken:
        return from_tiktoken(args.from_tiktoken, args.out)
    if not (args.build and args.vocab and args.merges and args.texts):
        ap.error("--build, --vocab, --merges and a TEXT are needed")
    try:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    except ImportError:
        sys.exit("bench_tokenizer: tiktoken is not installed (pip install tiktoken)")
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=args.merges,
                                            encoder_json_file=args.vocab)
    pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
    enc = tiktoken.Encoding(name="gpt2", pat_str=pat, mergeable_ranks=ranks,
                            special_tokens={EOT: 50256})
    print("%-24s %8s %22s %22s %22s %22s  %s" % (
        "text", "MB", "distrain-prep 1 thr", "distrain-prep %d thr" % args.threads,
        "tiktoken 1 thr", "tiktoken %d thr" % args.threads, "tokens"))
    for text in args.texts:
        with open(text, encoding="utf-8", newline="") as f:
            s = f.read()
        mb = len(s.encode()) / 1e6
        with tempfile.TemporaryDirectory() as out:
            ours = [min(prep(args, text, t, out) for _ in range(args.rounds))
                    for t in (1, args.threads)]
            got = shard_tokens(out)
        chunks, cur = [], ""  # ~1 MB runs of whole lines, one to a thread at a time
        for line in s.splitlines(keepends=True):
            cur += line
            if len(cur) >= 1 << 20:
                chunks.append(cur)
                cur = ""
        chunks.append(cur)
        theirs = []
        for fn in (lambda: enc.encode_ordinary(s),
                   lambda: enc.encode_ordinary_batch(chunks, num_threads=args.threads)):
            best = float("inf")
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            theirs.append(best)
        same = got == [50256] + enc.encode_ordinary(s)
        cell = lambda sec: "%6.3f s %6.1f MB/s" % (sec, mb / sec)  # noqa: E731
        print("%-24s %8.1f %22s %22s %22s %22s  %s" % (
            os.path.basename(text)[:24], mb, cell(ours[0]), cell(ours[1]), cell(theirs[0]),
            cell(theirs[1]), "equal (%d)" % len(got) if same else "DIFFERENT"))
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
