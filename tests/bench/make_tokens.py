"""Write an llm.c token shard of N uniformly random tokens, for benchmarks.

Header: 256 little-endian int32 [20240520, 1, N, 0...], then N uint16 tokens drawn uniformly
from [0, V) with numpy.random.RandomState(seed).

    /usr/bin/python3 tests/bench/make_tokens.py --out /tmp/bench.bin --tokens 50000 \
        --vocab 8192 --seed 0
"""

import argparse

import numpy as np

SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 256


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output shard path")
    ap.add_argument("--tokens", type=int, required=True, help="number of tokens N")
    ap.add_argument("--vocab", type=int, required=True, help="vocabulary size V (<= 65536)")
    ap.add_argument("--seed", type=int, default=0, help="numpy seed")
    args = ap.parse_args()
    if not (0 < args.vocab <= 65536) or args.tokens <= 0:
        ap.error("need 0 < --vocab <= 65536 and --tokens > 0")

    tokens = np.random.RandomState(args.seed).randint(0, args.vocab, size=args.tokens)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = [SHARD_MAGIC, SHARD_VERSION, args.tokens]
    with open(args.out, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


if __name__ == "__main__":
    main()
