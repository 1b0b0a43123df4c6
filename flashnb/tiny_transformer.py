"""A tiny character-level decoder (GPT-style) whose attention is pluggable: SDPA or flashnb (notebook 09).

Needs PyTorch (``pip install "flashnb[torch]"``).  The text is the Zen of Python, which ships with Python
(``import this``), so nothing is downloaded.  :func:`measure_gpu` times one training step per attention on a GPU
(``bench.on_gpu("flashnb.tiny_transformer:measure_gpu")``).
"""

from __future__ import annotations

import codecs
import contextlib
import copy
import io

import torch
import torch.nn.functional as F
from torch import nn

from . import pytorch as ft
from .instruments import rehearsal

__all__ = ["zen_text", "Vocab", "attention_fn", "CharDecoder", "batches", "train", "resume", "loss_and_grads",
           "generate", "measure_gpu"]


def zen_text() -> str:
    """The Zen of Python (``this.s`` is stored rot13-encoded; importing ``this`` prints it, silenced here)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


class Vocab:
    """Characters <-> integer ids."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self):
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def attention_fn(impl: str, **options):
    """``f(q, k, v)`` causal self-attention on ``(B, H, N, d)``: ``"sdpa"`` is PyTorch's
    ``scaled_dot_product_attention(is_causal=True)``, anything else a flashnb impl via :func:`flashnb.pytorch.attention`
    (``causal=True``: the same mask, since queries and keys are the same positions, Nq == Nk)."""
    if impl == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return lambda q, k, v: ft.attention(q, k, v, causal=True, impl=impl, **options)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, attn):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
        y = attn(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class CharDecoder(nn.Module):
    """Token + learned position embeddings, ``layers`` blocks, final LayerNorm, a linear head to the vocabulary."""

    def __init__(self, vocab: int, *, context: int, width: int, heads: int, layers: int):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, attn):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, attn)
        return self.head(self.ln(x))


def batches(data: torch.Tensor, steps: int, batch: int, context: int, seed: int):
    """``steps`` (x, y) pairs of ``batch`` random windows (y = x shifted by one), from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        i = torch.randint(len(data) - context - 1, (batch,), generator=g)
        x = torch.stack([data[j:j + context] for j in i])
        out.append((x, torch.stack([data[j + 1:j + context + 1] for j in i])))
    return out


def train(attn, data, vocab: int, *, steps: int, batch: int, context: int, width: int, heads: int, layers: int,
          lr: float = 3e-3, seed: int = 0, device="cpu", on_step=None, dtype=torch.float32, state=None):
    """Train a fresh :class:`CharDecoder` (initialised from ``seed``, then cast to ``dtype``) with AdamW; returns
    ``(model, losses)``.  The same seed gives the same initial weights and the same batches whatever ``attn`` is.

    ``state``: a dict that receives, after every step, ``state[step] = (model weights, optimiser state)`` for the
    steps it already holds as keys (copies), so that :func:`resume` can run a window of steps from there with
    another attention."""
    torch.manual_seed(seed)
    model = CharDecoder(vocab, context=context, width=width, heads=heads, layers=layers).to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step, (x, y) in enumerate(batches(data, steps, batch, context, seed)):
        if state is not None and step in state:
            state[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        losses.append(_step(model, opt, attn, x.to(device), y.to(device)))
        if on_step is not None:
            on_step(step, losses[-1])
    return model, losses


def resume(attn, saved, data, vocab: int, *, first: int, window: int, steps: int, batch: int, context: int,
           width: int, heads: int, layers: int, lr: float = 3e-3, seed: int = 0, device="cpu",
           dtype=torch.float32) -> list:
    """The losses of steps ``first .. first + window - 1`` of the :func:`train` run with these arguments, run
    from its saved state at ``first`` (``saved = state[first]``) with ``attn``: the same batches, weights and
    optimiser moments, only the attention differs."""
    model = CharDecoder(vocab, context=context, width=width, heads=heads, layers=layers).to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    todo = batches(data, steps, batch, context, seed)[first:first + window]
    return [_step(model, opt, attn, x.to(device), y.to(device)) for x, y in todo]


def loss_and_grads(attn, saved, data, vocab: int, *, at: int, steps: int, batch: int, context: int, width: int,
                   heads: int, layers: int, seed: int = 0, device="cpu", dtype=torch.float32, **_):
    """Step ``at``'s loss and every parameter's gradient with ``attn``, from the :func:`train` run's saved weights
    at that step (``saved = state[at]``) and its batch: one step compared from the same state."""
    model = CharDecoder(vocab, context=context, width=width, heads=heads, layers=layers).to(device, dtype)
    model.load_state_dict(saved[0])
    x, y = batches(data, steps, batch, context, seed)[at]
    loss = F.cross_entropy(model(x.to(device), attn).flatten(0, 1), y.to(device).flatten())
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _step(model, opt, attn, x, y) -> float:
    loss = F.cross_entropy(model(x, attn).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


@torch.no_grad()
def generate(model, attn, prompt: torch.Tensor, n: int, seed: int | None = None) -> torch.Tensor:
    """``n`` more ids after ``prompt`` (the context window slides): sampled from the softmax with a generator
    seeded by ``seed``, or greedy (argmax) when ``seed`` is None."""
    g = None if seed is None else torch.Generator().manual_seed(seed)
    ids = prompt.clone()
    for _ in range(n):
        logits = model(ids[-model.context:][None], attn)[0, -1]
        nxt = logits.argmax() if g is None else torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[0]
        ids = torch.cat([ids, nxt[None]])
    return ids


def measure_gpu(impls=("sdpa", "fa2", "fa1"), *, batch: int = 8, context: int = 256, width: int = 128,
                heads: int = 4, layers: int = 2, repeats: int = 5, warmup: int = 2, seed: int = 0) -> list[dict]:
    """CUDA-event time of one training step (forward, backward, AdamW) per attention, on a GPU (notebook 09).
    Rehearsed on the simulator with CPU tensors taking the CUDA-tensor path (``flashnb.pytorch.rehearse_cuda``)."""
    from .instruments import bench

    rehearsing = rehearsal.active()
    device = "cpu" if rehearsing else "cuda"
    info = bench.device_info()
    data = Vocab(zen_text())
    text = data.encode(zen_text())
    x, y = batches(text, 1, batch, context, seed)[0]
    x, y = x.to(device), y.to(device)
    rows = []
    for impl in impls:
        torch.manual_seed(seed)
        model = CharDecoder(len(data), context=context, width=width, heads=heads, layers=layers).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        attn = attention_fn(impl)

        def step():
            loss = F.cross_entropy(model(x, attn).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        with ft.rehearse_cuda() if rehearsing else contextlib.nullcontext():
            timing = bench.time_call(step, repeats=repeats, warmup=warmup, info=info)
        rows.append(timing.row(impl=impl, batch=batch, context=context, width=width, heads=heads, layers=layers))
    return rows
