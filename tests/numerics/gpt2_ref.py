"""Independent PyTorch reference implementation of GPT-2 training with llm.c semantics.

This module is the single source of truth for the Python side of distrain's numerics
tests and benchmarks. It is imported by:

  * tests/numerics/gen_golden.py  -- writes the golden files the C trainer is checked against
  * tests/bench/bench_torch.py    -- PyTorch throughput baseline

It contains (using only torch, numpy and the standard library):

  * ``GPT2``: a GPT-2 model (learned token + position embeddings, pre-LayerNorm blocks with
    causal multi-head attention and a tanh-GELU MLP, final LayerNorm, LM head tied to wte)
    whose parameters are named and shaped exactly like the llm.c checkpoint tensors
    (per layer; stacked along a leading L axis when serialised);
  * readers/writers for the llm.c model checkpoint (magic 20240326, version 3) and the llm.c
    uint16 token shard (magic 20240520, version 1);
  * the sequential data-window loader, the LR schedule and the AdamW / grad-clip setup of the
    distrain training protocol (see ``train_step``).

All file formats are little-endian.
"""

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MODEL_MAGIC = 20240326
MODEL_VERSION = 3
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
LN_EPS = 1e-5

# Per-layer parameter kinds in llm.c checkpoint order (they sit between wpe and lnfw).
LAYER_PARAMS = ["ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
                "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb"]
# Tensors that receive weight decay (the 2-D matrices and embeddings); all others get 0.
DECAY_PARAMS = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}


def padded_vocab(V, multiple=128):
    """llm.c pads the vocabulary (rows of wte in the checkpoint) to a multiple of 128."""
    return ((V + multiple - 1) // multiple) * multiple


class GPT2Config:
    """Model hyper-parameters: maxT (context), V (real vocab), L (layers), NH (heads), C (width)."""

    def __init__(self, maxT, V, L, NH, C):
        assert C % NH == 0, "C must be divisible by NH"
        self.maxT, self.V, self.L, self.NH, self.C = maxT, V, L, NH, C
        self.Vp = padded_vocab(V)

    def __repr__(self):
        return (f"GPT2Config(maxT={self.maxT}, V={self.V}, Vp={self.Vp}, L={self.L}, "
                f"NH={self.NH}, C={self.C})")


def layer_param_shapes(cfg):
    """Shape of one layer's slice of each per-layer parameter (without the L axis)."""
    C = cfg.C
    return {
        "ln1w": (C,), "ln1b": (C,),
        "qkvw": (3 * C, C), "qkvb": (3 * C,),
        "attprojw": (C, C), "attprojb": (C,),
        "ln2w": (C,), "ln2b": (C,),
        "fcw": (4 * C, C), "fcb": (4 * C,),
        "fcprojw": (C, 4 * C), "fcprojb": (C,),
    }


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x += attn(ln1(x)); x += mlp(ln2(x))."""

    def __init__(self, cfg, dtype):
        super().__init__()
        self.NH = cfg.NH
        for name, shape in layer_param_shapes(cfg).items():
            setattr(self, name, nn.Parameter(torch.zeros(shape, dtype=dtype)))

    def attention(self, x):
        B, T, C = x.shape
        NH = self.NH
        hs = C // NH
        # qkvw rows: [0, C) -> q, [C, 2C) -> k, [2C, 3C) -> v
        qkv = F.linear(x, self.qkvw, self.qkvb)                         # (B, T, 3C)
        q, k, v = qkv.split(C, dim=-1)
        q = q.view(B, T, NH, hs).transpose(1, 2)                        # (B, NH, T, hs)
        k = k.view(B, T, NH, hs).transpose(1, 2)
        v = v.view(B, T, NH, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))         # (B, NH, T, T)
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
        att = att.masked_fill(future, float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = att @ v                                                     # (B, NH, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                # heads concatenated
        return F.linear(y, self.attprojw, self.attprojb)

    def mlp(self, x):
        h = F.gelu(F.linear(x, self.fcw, self.fcb), approximate="tanh")  # (B, T, 4C)
        return F.linear(h, self.fcprojw, self.fcprojb)

    def forward(self, x):
        C = x.shape[-1]
        x = x + self.attention(F.layer_norm(x, (C,), self.ln1w, self.ln1b, LN_EPS))
        x = x + self.mlp(F.layer_norm(x, (C,), self.ln2w, self.ln2b, LN_EPS))
        return x


class GPT2(nn.Module):
    """GPT-2 with llm.c parameter naming. wte is kept as (V, C): the Vp-V padding rows of the
    checkpoint are all zero and never touch the logits, so they are only added on write."""

    def __init__(self, cfg, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(torch.zeros(cfg.V, cfg.C, dtype=dtype))
        self.wpe = nn.Parameter(torch.zeros(cfg.maxT, cfg.C, dtype=dtype))
        self.blocks = nn.ModuleList([Block(cfg, dtype) for _ in range(cfg.L)])
        self.lnfw = nn.Parameter(torch.ones(cfg.C, dtype=dtype))
        self.lnfb = nn.Parameter(torch.zeros(cfg.C, dtype=dtype))

    # ---- parameter bookkeeping in llm.c checkpoint order -------------------------------
    def named_params_ckpt_order(self):
        """[(kind, [tensors])] in checkpoint order; per-layer kinds list L tensors."""
        out = [("wte", [self.wte]), ("wpe", [self.wpe])]
        for name in LAYER_PARAMS:
            out.append((name, [getattr(b, name) for b in self.blocks]))
        out += [("lnfw", [self.lnfw]), ("lnfb", [self.lnfb])]
        return out

    def param_groups(self, weight_decay):
        """Two AdamW groups: 2-D matrices/embeddings with weight decay, the rest without."""
        decay, no_decay = [], []
        for kind, tensors in self.named_params_ckpt_order():
            (decay if kind in DECAY_PARAMS else no_decay).extend(tensors)
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def flat_ckpt(self, use_grad=False):
        """All parameters (or their gradients) as one float32 numpy vector in checkpoint
        layout: wte padded to Vp rows with zeros, per-layer tensors stacked along L."""
        cfg = self.cfg
        pieces = []
        for kind, tensors in self.named_params_ckpt_order():
            ts = [(t.grad if use_grad else t).detach().to(torch.float32).cpu() for t in tensors]
            if kind == "wte":
                w = torch.zeros(cfg.Vp, cfg.C, dtype=torch.float32)
                w[:cfg.V] = ts[0]
                ts = [w]
            pieces.extend(t.reshape(-1).numpy() for t in ts)
        return np.concatenate(pieces).astype("<f4")

    @torch.no_grad()
    def load_flat_ckpt(self, flat):
        """Inverse of flat_ckpt (drops the padded wte rows)."""
        cfg = self.cfg
        off = 0

        def take(shape):
            nonlocal off
            n = int(np.prod(shape))
            t = torch.from_numpy(np.array(flat[off:off + n], dtype=np.float32).reshape(shape))
            off += n
            return t

        self.wte.copy_(take((cfg.Vp, cfg.C))[:cfg.V])
        self.wpe.copy_(take((cfg.maxT, cfg.C)))
        for name, shape in layer_param_shapes(cfg).items():
            stacked = take((cfg.L,) + shape)
            for l, b in enumerate(self.blocks):
                getattr(b, name).copy_(stacked[l])
        self.lnfw.copy_(take((cfg.C,)))
        self.lnfb.copy_(take((cfg.C,)))
        assert off == len(flat), "checkpoint size mismatch"

    @torch.no_grad()
    def init_weights(self, seed):
        """GPT-2 init, drawn on a CPU torch.Generator seeded with `seed`, in checkpoint order
        (each per-layer kind drawn as one (L, ...) tensor, in float32, then cast):
        normal(0, 0.02) for wte, wpe, qkvw, fcw; normal(0, 0.02/sqrt(2L)) for attprojw and
        fcprojw; biases 0; LayerNorm weights 1."""
        cfg = self.cfg
        g = torch.Generator().manual_seed(seed)
        std, proj_std = 0.02, 0.02 / math.sqrt(2 * cfg.L)

        def normal(shape, s):
            return torch.randn(shape, generator=g, dtype=torch.float32) * s

        self.wte.copy_(normal((cfg.V, cfg.C), std))
        self.wpe.copy_(normal((cfg.maxT, cfg.C), std))
        for name, shape in layer_param_shapes(cfg).items():
            if name in ("qkvw", "fcw"):
                stacked = normal((cfg.L,) + shape, std)
            elif name in ("attprojw", "fcprojw"):
                stacked = normal((cfg.L,) + shape, proj_std)
            elif name in ("ln1w", "ln2w"):
                stacked = torch.ones((cfg.L,) + shape)
            else:
                stacked = torch.zeros((cfg.L,) + shape)
            for l, b in enumerate(self.blocks):
                getattr(b, name).copy_(stacked[l])
        self.lnfw.fill_(1.0)
        self.lnfb.zero_()

    # ---- forward -----------------------------------------------------------------------
    def forward(self, idx, targets=None):
        """idx, targets: (B, T) int64. Returns (logits (B, T, V), mean CE loss or None)."""
        B, T = idx.shape
        assert T <= self.cfg.maxT
        pos = torch.arange(T, device=idx.device)
        x = self.wte[idx] + self.wpe[pos]                               # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = F.layer_norm(x, (self.cfg.C,), self.lnfw, self.lnfb, LN_EPS)
        logits = F.linear(x, self.wte)                                  # tied LM head, V cols
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(-1))
        return logits, loss


# ---- llm.c file formats ------------------------------------------------------------------
def write_checkpoint(path, model):
    cfg = model.cfg
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:8] = [MODEL_MAGIC, MODEL_VERSION, cfg.maxT, cfg.V, cfg.L, cfg.NH, cfg.C, cfg.Vp]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(model.flat_ckpt().tobytes())


def read_checkpoint(path, dtype=torch.float32):
    """Returns a GPT2 model loaded from an llm.c checkpoint."""
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_INTS * 4), dtype="<i4")
        assert header[0] == MODEL_MAGIC and header[1] == MODEL_VERSION, "bad model header"
        maxT, V, L, NH, C, Vp = (int(v) for v in header[2:8])
        cfg = GPT2Config(maxT, V, L, NH, C)
        assert cfg.Vp == Vp
        flat = np.frombuffer(f.read(), dtype="<f4")
    model = GPT2(cfg, dtype=torch.float32)
    model.load_flat_ckpt(flat)
    return model.to(dtype)


def write_tokens(path, tokens):
    tokens = np.asarray(tokens)
    assert tokens.min() >= 0 and tokens.max() < 65536
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = [SHARD_MAGIC, SHARD_VERSION, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def read_tokens(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_INTS * 4), dtype="<i4")
        assert header[0] == SHARD_MAGIC and header[1] == SHARD_VERSION, "bad shard header"
        n = int(header[2])
        tokens = np.frombuffer(f.read(n * 2), dtype="<u2")
        assert len(tokens) == n, "truncated shard"
    return tokens.astype(np.int64)


class SequentialLoader:
    """distrain's data windows: micro-batch i reads B*T+1 consecutive tokens from position p
    (p = 0 first), inputs = tok[p:p+B*T] as (B, T), targets = tok[p+1:p+B*T+1], then p += B*T.
    If the next window would run past the end of the shard, p restarts at 0 (`wrap=True`,
    used only by the benchmark) or an error is raised (`wrap=False`, used by the golden runs)."""

    def __init__(self, tokens, B, T, wrap=False):
        self.tok = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        self.B, self.T, self.wrap, self.p = B, T, wrap, 0

    def next(self):
        n = self.B * self.T
        if self.p + n + 1 > len(self.tok):
            if not self.wrap:
                raise RuntimeError("token shard exhausted")
            self.p = 0
        buf = self.tok[self.p:self.p + n + 1]
        self.p += n
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)


def lr_at(step, lr, warmup, total, schedule="constant", min_lr_frac=0.0):
    """Learning rate of 0-based `step`, in Python double."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        min_lr = lr * min_lr_frac
        ratio = (step - warmup) / (total - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
    raise ValueError(f"unknown schedule {schedule}")


def make_optimizer(model, lr, betas, eps, weight_decay):
    """torch AdamW (single-tensor path) with decay only on DECAY_PARAMS tensors."""
    return torch.optim.AdamW(model.param_groups(weight_decay), lr=lr, betas=betas, eps=eps,
                             weight_decay=weight_decay, foreach=False)


def global_grad_norm(params):
    """Global L2 norm of all gradients, computed exactly as clip_grad_norm_ does."""
    return torch.norm(torch.stack([torch.norm(p.grad.detach(), 2.0) for p in params]), 2.0)


def train_step(model, optimizer, loader, step, accum, grad_clip, lr_s, on_grads=None):
    """One optimizer step of the distrain protocol.

    accum (K) micro-batches; each micro-batch loss (mean CE over B*T) is divided by K before
    backward, so grads are the mean over micro-batches. The pre-clip global grad norm is
    always computed; if grad_clip > 0 the grads are clipped with clip_grad_norm_ semantics.
    Every group's lr is set to lr_s, then AdamW steps. Returns (step loss = mean of the K
    micro-batch losses in double, lr_s, pre-clip grad norm as float).
    `on_grads(step)` is called after backward and before clipping (used to dump grads)."""
    params = [p for p in model.parameters()]
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for _ in range(accum):
        x, y = loader.next()
        _, loss = model(x, y)
        losses.append(loss.item())
        (loss / accum).backward()
    if on_grads is not None:
        on_grads(step)
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = global_grad_norm(params)
    for group in optimizer.param_groups:
        group["lr"] = lr_s
    optimizer.step()
    return sum(losses) / accum, lr_s, float(norm)


@torch.no_grad()
def eval_loss(model, tokens, B, T, windows):
    """Mean of the losses of the first `windows` sequential windows of tokens."""
    loader = SequentialLoader(tokens, B, T)
    losses = []
    for _ in range(windows):
        x, y = loader.next()
        losses.append(model(x, y)[1].item())
    return sum(losses) / windows
