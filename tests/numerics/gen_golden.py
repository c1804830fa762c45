"""Generate the golden files that distrain's C trainer is checked against (CI has no torch).

Uses the independent PyTorch GPT-2 reference in gpt2_ref.py (llm.c semantics), float32 on
CPU with deterministic algorithms and one thread, to run two short training runs on a tiny
model (V=100 -> Vp=128, maxT=64, L=2, NH=4, C=64; B=4, T=32, 20 steps, init seed 1337):

  tiny_adamw : lr 3e-4, AdamW(0.9, 0.95, eps 1e-8), wd 0,   constant lr, no warmup, no clip, K=1
  tiny_full  : lr 1e-3, AdamW(0.9, 0.95, eps 1e-8), wd 0.1, cosine (warmup 5, min 0.1*lr),
               grad clip 1.0, K=2 micro-batches per step

and writes into --out: tiny_model.bin, tiny_train.bin, tiny_val.bin, <run>_losses.txt,
tiny_adamw_grads0.bin, tiny_adamw_final.bin, tiny_adamw_val.txt (see README.md next to this
file). It also repeats tiny_adamw in float64 and prints the max |loss_fp32 - loss_fp64|, the
inherent float32 noise of the losses.

    /usr/bin/python3 tests/numerics/gen_golden.py --out tests/numerics/golden
"""

import argparse
import hashlib
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_ref as ref  # noqa: E402

# ---- the tiny configuration --------------------------------------------------------------
CFG = dict(maxT=64, V=100, L=2, NH=4, C=64)
B, T, STEPS, INIT_SEED = 4, 32, 20, 1337
VAL_WINDOWS = 4
TRAIN_TOKENS = 8192          # >= STEPS * 2 * B * T + 1 = 5121, with slack
VAL_TOKENS = 4096
CHAIN_SEED, TRAIN_SEED, VAL_SEED = 20240520, 1, 2

RUNS = {
    "tiny_adamw": dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                       schedule="constant", warmup=0, min_lr_frac=0.0, grad_clip=0.0, accum=1),
    "tiny_full": dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                      schedule="cosine", warmup=5, min_lr_frac=0.1, grad_clip=1.0, accum=2),
}


def markov_transitions(V, seed):
    """A sparse, learnable first-order Markov chain over V tokens with a Zipf-like unigram
    skew (so the loss falls visibly within 20 small steps). With zipf(i) ~ 1/(i+1): from each
    token, 30% of the mass follows zipf and 70% goes to 3 successors (0.4, 0.2, 0.1) drawn
    without replacement with probabilities zipf."""
    rng = np.random.RandomState(seed)
    zipf = 1.0 / np.arange(1, V + 1)
    zipf /= zipf.sum()
    P = np.tile(0.3 * zipf, (V, 1))
    for a in range(V):
        succ = rng.choice(V, size=3, replace=False, p=zipf)
        P[a, succ] += [0.4, 0.2, 0.1]
    return P / P.sum(axis=1, keepdims=True)


def sample_chain(P, n, seed):
    """n tokens from the chain P, start state uniform, via inverse-CDF sampling (numpy)."""
    rng = np.random.RandomState(seed)
    cdf = np.cumsum(P, axis=1)
    u = rng.random_sample(n)
    tok = np.empty(n, dtype=np.int64)
    tok[0] = rng.randint(P.shape[0])
    for i in range(1, n):
        tok[i] = min(int(np.searchsorted(cdf[tok[i - 1]], u[i], side="right")), P.shape[0] - 1)
    return tok


def run_training(init_model, train_tokens, hp, dtype, on_grads=None):
    """Train a copy of init_model (cast to dtype) for STEPS steps with hyper-parameters hp.
    on_grads(step, model), if given, runs after backward and before clipping.
    Returns (model, [(step, loss, lr, grad_norm)])."""
    model = ref.GPT2(init_model.cfg, dtype=dtype)
    with torch.no_grad():
        for p, q in zip(model.parameters(), init_model.parameters()):
            p.copy_(q.to(dtype))
    opt = ref.make_optimizer(model, hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"])
    loader = ref.SequentialLoader(train_tokens, B, T)
    hook = (lambda s: on_grads(s, model)) if on_grads is not None else None
    log = []
    for s in range(STEPS):
        lr_s = ref.lr_at(s, hp["lr"], hp["warmup"], STEPS, hp["schedule"], hp["min_lr_frac"])
        loss, lr_s, norm = ref.train_step(model, opt, loader, s, hp["accum"], hp["grad_clip"],
                                          lr_s, hook)
        log.append((s, loss, lr_s, norm))
    return model, log


def write_losses(path, log):
    with open(path, "w") as f:
        for s, loss, lr_s, norm in log:
            f.write("%d %.9g %.9g %.9g\n" % (s, loss, lr_s, norm))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "golden"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = lambda name: os.path.join(args.out, name)  # noqa: E731

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    # data: train and val shards sampled from the same Markov chain
    P = markov_transitions(CFG["V"], CHAIN_SEED)
    train_tok = sample_chain(P, TRAIN_TOKENS, TRAIN_SEED)
    val_tok = sample_chain(P, VAL_TOKENS, VAL_SEED)
    ref.write_tokens(out("tiny_train.bin"), train_tok)
    ref.write_tokens(out("tiny_val.bin"), val_tok)
    assert np.array_equal(ref.read_tokens(out("tiny_train.bin")), train_tok)

    # initial weights; every run starts from the round-tripped checkpoint
    cfg = ref.GPT2Config(**CFG)
    model0 = ref.GPT2(cfg)
    model0.init_weights(INIT_SEED)
    ref.write_checkpoint(out("tiny_model.bin"), model0)
    init = ref.read_checkpoint(out("tiny_model.bin"))
    assert np.array_equal(init.flat_ckpt(), model0.flat_ckpt())
    print(f"{cfg}, params in checkpoint: {len(model0.flat_ckpt())}")

    logs = {}
    for name, hp in RUNS.items():
        on_grads = None
        if name == "tiny_adamw":
            def on_grads(step, model, name=name):
                if step == 0:  # raw fp32 step-0 grads in checkpoint layout, no header
                    with open(out(f"{name}_grads0.bin"), "wb") as f:
                        f.write(model.flat_ckpt(use_grad=True).tobytes())
        model, log = run_training(init, train_tok, hp, torch.float32, on_grads)
        logs[name] = log
        write_losses(out(f"{name}_losses.txt"), log)
        print(f"[{name}] step loss lr grad_norm")
        for s, loss, lr_s, norm in log:
            print("  %2d %.9g %.9g %.9g" % (s, loss, lr_s, norm))
        if name == "tiny_adamw":
            ref.write_checkpoint(out("tiny_adamw_final.bin"), model)
            val = ref.eval_loss(model, val_tok, B, T, VAL_WINDOWS)
            with open(out("tiny_adamw_val.txt"), "w") as f:
                f.write("%.9g\n" % val)
            print(f"[tiny_adamw] val loss over {VAL_WINDOWS} windows: {val:.9g}")

    # float64 repeat of tiny_adamw: the inherent float32 noise of the losses
    _, log64 = run_training(init, train_tok, RUNS["tiny_adamw"], torch.float64)
    diffs = [abs(a[1] - b[1]) for a, b in zip(logs["tiny_adamw"], log64)]
    print("[tiny_adamw] fp64 losses:", " ".join("%.9g" % e[1] for e in log64))
    print("[tiny_adamw] max |loss_fp32 - loss_fp64| over %d steps: %.3g (at step %d)"
          % (STEPS, max(diffs), int(np.argmax(diffs))))

    print("sha256:")
    for fn in sorted(os.listdir(args.out)):
        with open(out(fn), "rb") as f:
            print("  %s  %s" % (hashlib.sha256(f.read()).hexdigest(), fn))


if __name__ == "__main__":
    main()
