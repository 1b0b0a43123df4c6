"""Attention modifiers on the device: ``score_mod`` per score, ``mask_mod`` per element of a ``PARTIAL`` tile as a
lane's 64-bit mask, the backward's ``d score_mod / d score``; and the modifiers the PTX guard compiles in.

``score_mod`` / ``mask_mod`` arrive as Python functions (or ``"module:attr"`` names, as the PTX guard's configs carry
them) and are compiled here as inlined device functions.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
from numba import cuda, float32, int32, uint64

from ...common import ONE, positive_int
from ...masks import PARTIAL

__all__ = ["ALL", "MAX_ELEMENTS", "modifiers", "is_set", "check_features", "python_modifier", "device_modifier",
           "score_mod_grad_of", "GUARD_ALIBI", "GUARD_WINDOW", "GUARD_SOFTCAP", "GUARD_DOCUMENT"]

_DEVICE_FNS: dict = {}


def python_modifier(fn):
    """The Python function of a modifier: ``fn`` itself, the ``py_func`` of a ``cuda.jit`` device function, or the
    object a ``"module:attr"`` string names (how the PTX guard's JSON configs name modifiers)."""
    if isinstance(fn, str):
        module, _, attr = fn.partition(":")
        fn = getattr(importlib.import_module(module), attr)
    return getattr(fn, "py_func", fn)


def score_mod_grad_of(score_mod):
    """``d score_mod / d score`` for a backward given none: ``score_mod.grad`` (the gallery's modifiers and the PTX
    guard's carry one).  The kernels never derive one: the user surfaces resolve a modifier without ``.grad``
    before they launch (:func:`flashnb.flex_grad.score_mod_grad_of` derives it from the source) and pass it as
    ``score_mod_grad``."""
    grad = getattr(python_modifier(score_mod), "grad", None)
    if grad is None:
        name = getattr(python_modifier(score_mod), "__name__", None) or repr(score_mod)
        raise ValueError(f"score_mod {name!r} has no .grad: pass score_mod_grad=, or call through flashnb."
                         "attention_backward / flashnb.pytorch, which derive it from the source "
                         "(flashnb.flex.derivative)")
    return grad


def device_modifier(fn):
    """``fn`` compiled as an inlined device function, one per Python function (every kernel using it shares it;
    a :func:`flashnb.flex.snapshot` brings its frozen copy); ``None`` stays ``None``.  The
    :data:`~flashnb.registry.KERNEL_CACHE_SIZE` most recently used are kept, as the factories keep their kernels:
    a process that makes modifiers in a loop does not keep every one alive."""
    from ...registry import KERNEL_CACHE_SIZE

    if fn is None:
        return None
    fn = python_modifier(fn)
    dev = _DEVICE_FNS.pop(fn, None) or cuda.jit(device=True, inline="always")(fn)
    _DEVICE_FNS[fn] = dev                            # (re)inserted last: the most recently used
    while len(_DEVICE_FNS) > KERNEL_CACHE_SIZE:
        del _DEVICE_FNS[next(iter(_DEVICE_FNS))]
    return dev


@cuda.jit(device=True, inline="always")
def _same_score(s, b, h, q_idx, kv_idx):
    return s


@cuda.jit(device=True, inline="always")
def _allow_all(b, h, q_idx, kv_idx):
    return True


@cuda.jit(device=True, inline="always")
def _unit_grad(s, b, h, q_idx, kv_idx):
    return ONE


@cuda.jit(device=True, inline="always")
def is_set(bits, e):
    """Bit ``e`` of a lane's element mask (``e`` a compile-time constant in the unrolled element loops)."""
    return (bits >> uint64(e)) & uint64(1) != uint64(0)


ALL = uint64(0xFFFFFFFFFFFFFFFF)   # every element allowed
MAX_ELEMENTS = 64                  # elements of a lane's micro-tile one 64-bit mask holds


def check_features(sparse, mask_mod, dropout, H, elements):
    """``H`` checked, and the constraints of the element-mask policies for a kernel whose lanes hold ``elements``
    scores per mask: ``mask_mod`` reaches a kernel through its block mask (which says which tiles are partial), and
    ``mask_mod``'s and dropout's bits of those scores fit one 64-bit mask."""
    if mask_mod is not None and not sparse:
        raise ValueError("mask_mod needs sparse=True: the kernel reads which tiles are partial from the block mask")
    if (mask_mod is not None or dropout) and elements > MAX_ELEMENTS:
        raise ValueError(f"tiles with {elements} scores per lane: mask_mod and dropout hold a lane's elements in one "
                         f"{MAX_ELEMENTS}-bit mask; choose smaller Br/Bc or more warps")
    return positive_int("H", H)


def modifiers(score_mod=None, mask_mod=None, H=1, score_mod_grad=None):
    """``(score, allowed_bits, grad)`` for ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx,
    kv_idx)`` (FlexAttention's arguments; ``b = z // H``, ``h = z % H``; indices as int32):

    * ``score(s, z, row, col, Nq, Nk)``: ``score_mod`` of the scaled score ``s`` inside ``Nq × Nk`` (``s`` outside,
      and without a ``score_mod``: a modifier indexing a captured array by ``q_idx``/``kv_idx`` never sees an
      index beyond the problem);
    * ``allowed_bits(z, r0, rs, c0, cs, NR, NC, Nq, Nk, st)``: on a ``PARTIAL`` tile, ``mask_mod`` of a lane's
      ``NR × NC`` elements ``(r0 + rs·i, c0 + cs·j)`` as one 64-bit mask (bit ``i·NC + j``; elements outside the
      problem are left set, for the edge mask); :data:`ALL` on a ``FULL`` tile and without a ``mask_mod``.  A
      run-time loop, so that however long ``mask_mod`` is, the tile's unrolled register code holds only one bit
      test per element;
    * ``grad(s, z, row, col)``: ``score_mod_grad`` (``d score_mod / d score``; 1 without a ``score_mod``), called
      only inside the problem."""
    sm = device_modifier(score_mod) or _same_score
    sg = device_modifier(score_mod_grad) or _unit_grad
    mm = device_modifier(mask_mod) or _allow_all
    scored, masked = score_mod is not None, mask_mod is not None

    @cuda.jit(device=True, inline="always")
    def score(s, z, row, col, Nq, Nk):
        if not scored or row >= Nq or col >= Nk:
            return s
        b = int32(z // H)
        return float32(sm(s, b, int32(z - b * H), int32(row), int32(col)))

    @cuda.jit(device=True, inline="always")
    def allowed_bits(z, r0, rs, c0, cs, NR, NC, Nq, Nk, st):
        if not masked or st != PARTIAL:
            return ALL
        b = int32(z // H)
        h = int32(z - b * H)
        bits = ALL
        for e in range(NR * NC):
            i = e // NC
            row = r0 + rs * i
            col = c0 + cs * (e - i * NC)
            if row < Nq and col < Nk and not mm(b, h, int32(row), int32(col)):
                bits &= ~(uint64(1) << uint64(e))
        return bits

    @cuda.jit(device=True, inline="always")
    def grad(s, z, row, col):
        if not scored:
            return ONE
        b = int32(z // H)
        return float32(sg(s, b, int32(z - b * H), int32(row), int32(col)))

    return score, allowed_bits, grad


# --------------------------------------------------------------------------- modifiers the PTX guard compiles in
# Named "flashnb.kernels.policies:GUARD_..." in the kernels' guard configs (JSON): an ALiBi bias with captured slopes,
# a sliding window, tanh soft-capping, a causal document mask over a captured id array.

_SLOPES = (2.0 ** (-8.0 * np.arange(1, 5) / 4)).astype(np.float32)
_CAP = np.float32(20.0)
_DOCS = np.repeat(np.arange(16, dtype=np.int32), 64)


def GUARD_ALIBI(score, b, h, q_idx, kv_idx):
    return score + _SLOPES[h] * float32(kv_idx - q_idx)


def _alibi_grad(score, b, h, q_idx, kv_idx):
    return float32(1)


GUARD_ALIBI.grad = _alibi_grad


def GUARD_WINDOW(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx and q_idx - kv_idx < 16


def GUARD_SOFTCAP(score, b, h, q_idx, kv_idx):
    return _CAP * float32(math.tanh(score / _CAP))


def _softcap_grad(score, b, h, q_idx, kv_idx):
    t = float32(math.tanh(score / _CAP))
    return float32(1) - t * t


GUARD_SOFTCAP.grad = _softcap_grad


def GUARD_DOCUMENT(b, h, q_idx, kv_idx):
    return _DOCS[q_idx] == _DOCS[kv_idx] and kv_idx <= q_idx
