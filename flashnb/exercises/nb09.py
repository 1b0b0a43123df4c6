"""Exercises of notebook 09 (a transformer trained on flashnb's kernels).  Needs PyTorch, like the notebook."""

from __future__ import annotations

import functools

import numpy as np

from . import close, exercise, require

#: The notebook's training run: ten AdamW steps of a two-layer, width-16 character decoder, one sequence of 16.
CFG = dict(steps=10, batch=1, context=16, width=16, heads=2, layers=2, lr=1e-2, seed=0)
TILES = dict(Br=16, Bc=16, warps=1)
IMPLS = ("fa2", "fa1", "naive")


@functools.lru_cache(maxsize=None)
def _loss_differences(dtype: str = "float32", impls: tuple = IMPLS) -> dict:
    """max over the steps of |loss with impl - loss with SDPA|, training the notebook's model in ``dtype``."""
    import torch

    from .. import tiny_transformer as tt

    text = tt.zen_text()
    vocab = tt.Vocab(text)
    data = vocab.encode(text)
    dt = getattr(torch, dtype)
    base = tt.train(tt.attention_fn("sdpa"), data, len(vocab), dtype=dt, **CFG)[1]
    out = {}
    for impl in impls:
        opts = dict(TILES) if impl == "fa2" else {}
        if dt == torch.float64:
            opts["allow_float64"] = True
        losses = tt.train(tt.attention_fn(impl, **opts), data, len(vocab), dtype=dt, **CFG)[1]
        out[impl] = max(abs(a - b) for a, b in zip(losses, base))
    return out


# --------------------------------------------------------------------------- 09.1


@exercise("09.1", "three kernels, one loss curve", level=2, minutes=15,
          hint="""tt.train(tt.attention_fn(impl), data, len(vocab), **CFG) for impl = "fa1" and "naive" (and "fa2" with
          TILES), each against the SDPA run's losses: max |difference| over the steps; the largest of the three.""",
          explain="""All three agree with SDPA to float32 rounding -- a wrong mask or a missing term would differ by 0.1
          or more: each kernel computes the same softmax in float32 and only the order of the sums differs (FA2 and
          FA1 accumulate tile by tile with rescaling, naive attention materialises S and P). The differences are a
          few units in the last place of a loss near 4 (one float32 ulp there is 2^-21, about 4.8e-7), compounded
          over ten AdamW steps; which kernel lands closest is a matter of summation order, and two or all three may
          tie, or reproduce SDPA's losses bit for bit.""")
def check_09_1(largest_difference, same_order):
    """largest_difference: the largest, over "fa2", "fa1" and "naive", of max |loss with the impl - loss with SDPA|
    over the notebook's ten steps; same_order: True if the largest of the three is at most 10 times the smallest."""
    d = _loss_differences()
    values = sorted(d.values())
    # the same ten steps on the same machine give the same losses: a relative tolerance for how the learner
    # sums (float64 or float32 subtraction of the same float32 losses)
    close(largest_difference, values[-1], rel=1e-3, abs=1e-12, what="largest_difference")
    require(bool(same_order) == (values[-1] <= 10 * values[0]), "same_order: compare the largest and the smallest "
            "of the three max |differences|")
    return ", ".join(f"{k} {v:.1e}" for k, v in d.items())


@check_09_1.solves
def _():
    d = _loss_differences()
    values = sorted(d.values())
    return dict(largest_difference=values[-1], same_order=values[-1] <= 10 * values[0])


@check_09_1.fails
def _():
    return dict(largest_difference=0.1, same_order=True)          # the size of a wrong mask, not of rounding


@check_09_1.fails
def _():
    d = _loss_differences()
    values = sorted(d.values())
    return dict(largest_difference=values[-1], same_order=not values[-1] <= 10 * values[0])


# --------------------------------------------------------------------------- 09.2


@exercise("09.2", "train in float64: where does the difference come from?", level=2, minutes=15,
          hint="""tt.train(..., dtype=torch.float64) casts the model; flashnb's attention takes float64 tensors with
          allow_float64=True (tt.attention_fn("fa2", allow_float64=True, **TILES)). Compare with SDPA in float64.""",
          explain="""In float64 the rest of the model stops rounding at float32, so the difference shrinks -- but it
          stays far above float64's rounding (~1e-15), because flashnb still computes attention in float32
          (allow_float64 converts, computes in float32 and converts back). What remains is flashnb's float32
          attention: the float32 runs' difference was that plus float32 rounding everywhere else.""")
def check_09_2(diff64, float32_inside):
    """diff64: max |loss(fa2) - loss(SDPA)| over the notebook's ten steps, both trained in float64; float32_inside:
    True if what remains is flashnb's float32 attention (the difference stays far above float64 rounding)."""
    measured = _loss_differences("float64", ("fa2",))["fa2"]
    close(diff64, measured, rel=0.05, what="diff64")
    require(float32_inside is (measured > 1e-10), "float32_inside: is the float64 difference at float64 rounding "
            "(~1e-15), or far above it?")
    return f"{measured:.1e} in float64 against {_loss_differences()['fa2']:.1e} in float32"


@check_09_2.solves
def _():
    return dict(diff64=_loss_differences("float64", ("fa2",))["fa2"], float32_inside=True)


@check_09_2.fails
def _():
    return dict(diff64=_loss_differences("float64", ("fa2",))["fa2"], float32_inside=False)


# --------------------------------------------------------------------------- 09.3


@exercise("09.3", "decoding: which causal alignment?", level=1, minutes=10,
          hint="""One new query (Nq = 1) at the last position, against all Nk cached keys. causal=True (lower_right)
          keeps j <= i + Nk - Nq; "upper_left" keeps j <= i. With i = 0, how many keys does each keep?""",
          explain="""causal=True (bottom-right, FlashAttention's) keeps j <= 0 + Nk - 1: every cached key, which is
          right for the newest token. "upper_left" (SDPA's is_causal) keeps j <= 0: the query attends to the first
          key only, and returns v_0.""")
def check_09_3(right, keys_seen_by_other):
    """right: the causal argument that gives the right answer for a single new query against a KV cache (True or
    "upper_left"); keys_seen_by_other: how many keys the other alignment lets that query see."""
    import torch

    from .. import pytorch as ft

    g = torch.Generator().manual_seed(93)
    q, k, v = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 12, 8, generator=g), \
        torch.randn(1, 1, 12, 8, generator=g)
    want = torch.softmax((q @ k.transpose(-1, -2)).double() * 8 ** -0.5, -1) @ v.double()
    ok = {c: torch.allclose(ft.attention(q, k, v, causal=c).double(), want, atol=1e-5) for c in (True, "upper_left")}
    truth = next(c for c, good in ok.items() if good)
    require(right is truth or right == truth or (truth is True and right == "lower_right"),
            f"causal={right!r} does not give the attention over the whole cache")
    other = "upper_left" if truth is True else True
    o_other = ft.attention(q, k, v, causal=other).double()
    seen = 1 if torch.allclose(o_other, v[:, :, :1].double(), atol=1e-6) else None
    close(keys_seen_by_other, seen if seen is not None else float("nan"), what="keys_seen_by_other")


@check_09_3.solves
def _():
    return dict(right=True, keys_seen_by_other=1)


@check_09_3.fails
def _():
    return dict(right="upper_left", keys_seen_by_other=12)


# --------------------------------------------------------------------------- 09.4


def _step_bytes(impl: str, context: int) -> int:
    """HBM bytes of attention in one training step of the notebook's model at ``context`` (every layer's forward
    and backward), from the traffic models (fa2's equal its counts)."""
    from ..stages import fa2, naive

    B, H, d, L = CFG["batch"], CFG["heads"], CFG["width"] // CFG["heads"], CFG["layers"]
    mod, opts = (fa2, TILES) if impl == "fa2" else (naive, {})
    model = mod.model_forward(B * H, context, context, d, causal=True, **opts) + \
        mod.model_backward(B * H, context, context, d, causal=True, **opts)
    return L * 4 * sum(sum(x["reads"].values()) + sum(x["writes"].values()) + sum(x.get("atomics", {}).values())
                       for x in model)


@exercise("09.4", "when does naive attention move ten times more bytes?", level=2, minutes=15,
          hint="""hbm_bytes of naive.model_forward + naive.model_backward and of fa2's (the notebook's cell), times the
          layers, for context = 16, 32, 48, ...; fa2's model equals what traffic.count() counts.""",
          explain="""Naive attention writes and rereads S and P: Θ(N²) elements per head, forward and backward. FA2
          moves Θ(N·d) per query block of Br rows, re-reading K and V once per block: Θ(N²d/Br). The ratio grows
          about linearly with N until it is ten.""")
def check_09_4(context_10x):
    """context_10x: the smallest context (a multiple of 16, the notebook's tile) at which one training step's
    attention moves at least ten times more HBM bytes with naive attention than with fa2 (TILES)."""
    require(isinstance(context_10x, (int, np.integer)) and context_10x % 16 == 0 and context_10x > 0,
            "context_10x must be a positive multiple of 16")
    want = _context_10x()
    require(_step_bytes("naive", int(context_10x)) >= 10 * _step_bytes("fa2", int(context_10x)),
            f"at context {context_10x} naive moves less than ten times fa2's bytes")
    require(int(context_10x) == want, f"context {context_10x} is not the smallest: try shorter ones")
    return f"naive {_step_bytes('naive', want):,} B, fa2 {_step_bytes('fa2', want):,} B per step at {want}"


@functools.lru_cache(maxsize=None)
def _context_10x() -> int:
    return next(c for c in range(16, 8193, 16) if _step_bytes("naive", c) >= 10 * _step_bytes("fa2", c))


@check_09_4.solves
def _():
    return dict(context_10x=next(c for c in range(16, 8193, 16)
                                 if _step_bytes("naive", c) >= 10 * _step_bytes("fa2", c)))


@check_09_4.fails
def _():
    return dict(context_10x=2 * _context_10x())        # ten times, but not the smallest context
