"""Exercises of notebook 10 (attention modifiers: from the fixed causal mask to score_mod / mask_mod)."""

from __future__ import annotations

import numpy as np

from . import Wrong, close, exercise, require

# --------------------------------------------------------------------------- 10.1

SINKS, WINDOW = 4, 16


def _sinks_truth(N):
    q = np.arange(N)[:, None]
    kv = np.arange(N)[None, :]
    return (kv <= q) & ((kv < SINKS) | (q - kv < WINDOW))


def _check_compiles(fn, role):
    from .. import flex

    try:
        flex.check_many([(fn, role)])
    except flex.ModifierError as exc:
        raise Wrong(f"it would not run on a GPU: {exc}") from None


@exercise("10.1", "attention sinks: a mask_mod of your own", level=1, minutes=10,
          hint="""Causal first (kv_idx <= q_idx); then a key is allowed when it is one of the first SINKS = 4
          positions or within the last WINDOW = 16 positions (q_idx - kv_idx < WINDOW). Use `and` / `or` between
          comparisons; no NumPy calls inside the modifier.""",
          explain="""StreamingLLM (Xiao et al. 2023) keeps a few "attention sink" tokens at the start next to a sliding
          window. As a mask_mod it is one line of comparisons, which numba compiles into the kernel as a handful of
          integer instructions; its block mask keeps the diagonal band and the first key column: everything else is
          never loaded, so the traffic grows with N·(window + sinks) instead of N².""")
def check_10_1(sinks_mask):
    """sinks_mask(b, h, q_idx, kv_idx) -> bool: causal attention to the first 4 keys and to the last 16 keys (the
    query's own included)."""
    from .. import flex

    require(callable(sinks_mask), "sinks_mask must be a function (b, h, q_idx, kv_idx) -> bool")
    for N in (24, 70):
        got = flex.mask_array(sinks_mask, 1, 1, N, N)[0, 0]
        truth = _sinks_truth(N)
        if not np.array_equal(got, truth):
            i, j = np.argwhere(got != truth)[0]
            raise Wrong(f"at N = {N}, query {i} and key {j}: your mask says {bool(got[i, j])}")
    _check_compiles(sinks_mask, "mask_mod")


@check_10_1.solves
def _():
    def sinks_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx and (kv_idx < 4 or q_idx - kv_idx < 16)

    return dict(sinks_mask=sinks_mask)


@check_10_1.fails
def _():
    def sinks_mask(b, h, q_idx, kv_idx):           # the sinks see the future too: not causal
        return kv_idx < 4 or (kv_idx <= q_idx and q_idx - kv_idx < 16)

    return dict(sinks_mask=sinks_mask)


# --------------------------------------------------------------------------- 10.2

TEMPS = np.array([0.5, 1.0, 2.0, 4.0], dtype=np.float32)


@exercise("10.2", "the derivative the backward needs", level=2, minutes=15,
          hint="""The backward multiplies dS by d score_mod / d score at the *unmodified* score (the chain rule).
          For score_mod(s) = 3·tanh(s/3) + temps[h]·s the derivative is 1 - tanh²(s/3) + temps[h]. Keep every value
          float32: float32(3), float32(math.tanh(...)).""",
          explain="""flashnb asks the user for the derivative instead of deriving it: numba has no automatic
          differentiation, and a finite difference in float32 would cost two more modifier calls per element and
          lose about half the digits. The check compares your function with a float64 central difference of the
          modifier and compiles it for a GPU, as a launch would.""")
def check_10_2(score_grad):
    """score_grad(score, b, h, q_idx, kv_idx): d/d score of ``3·tanh(score / 3) + temps[h]·score`` (temps =
    TEMPS, one per head), returning float32."""
    require(callable(score_grad), "score_grad must be a function (score, b, h, q_idx, kv_idx) -> float32")
    rng = np.random.default_rng(102)
    s = rng.uniform(-8, 8, 64)
    h = rng.integers(0, len(TEMPS), 64)
    eps = 1e-5

    def f(x, hh):
        return 3.0 * np.tanh(x / 3.0) + TEMPS.astype(np.float64)[hh] * x

    want = (f(s + eps, h) - f(s - eps, h)) / (2 * eps)
    for x, hh, w in zip(s, h, want):
        close(float(score_grad(np.float32(x), 0, int(hh), 0, 0)), w, rel=1e-4, abs=1e-5,
              what=f"score_grad at score = {x:.3f}, h = {hh}")
    _check_compiles(score_grad, "score_mod_grad")


@check_10_2.solves
def _():
    import math

    from numba import float32

    from flashnb.exercises.nb10 import TEMPS

    temps = TEMPS

    def score_grad(score, b, h, q_idx, kv_idx):
        t = float32(math.tanh(score / float32(3)))
        return float32(1) - t * t + temps[h]

    return dict(score_grad=score_grad)


@check_10_2.fails
def _():
    from numba import float32

    def score_grad(score, b, h, q_idx, kv_idx):     # the softcap part forgotten
        return float32(1)

    return dict(score_grad=score_grad)
