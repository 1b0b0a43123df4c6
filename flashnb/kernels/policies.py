"""The product kernels' features as small policies: device functions the fast loop calls, compiled away when off.

Each policy is made by a factory of its compile-time switches and returns the device functions the loop of
:mod:`flashnb.kernels.flash` calls at fixed places; with the feature off they are constants or the identity, which
inline to nothing (``x * 1``, ``s`` unchanged, a constant ``FULL`` tile state), so the kernel compiles to stage 6's
code.  Every function is ``inline="always"``: its per-lane values stay in registers.

============  =============================================================  ===========================================
policy        what the loop calls                                            off
============  =============================================================  ===========================================
storage       ``to_f32(x)`` at every global load, ``from_f32(x)`` at every    ``float32(x)``: no instruction
              store (:func:`storage`: float32, float16, bfloat16 bits)
block mask    ``state(M, z, i, j, lane)`` per tile: ``EMPTY`` (skipped:      the constant ``FULL``
              never loaded), ``FULL`` (no per-element work), ``PARTIAL``
              (``mask_mod`` per element) (:func:`tile_state`)
modifiers     ``score(s, ...)`` per element (``score_mod``), ``grad`` in the  ``s``; all ones; 1
              backward; ``allowed_bits(...)`` per tile: ``mask_mod`` of a
              lane's elements on a ``PARTIAL`` tile (:func:`modifiers`)
dropout       ``state(p, seed_lo, seed_hi)`` once; ``keep_bits(...)`` per     the constant 1
              tile: a lane's ``Z``; ``factor(bits, e, st)`` per element,
              ``Z / (1-p)`` (:func:`dropout`)
GQA / MQA     ``kv_head(z, Q, K)``: the K/V head of query head ``z``; the     ``z``; 1
              backward's ``group(Q, K)`` query heads per K/V head (:func:`gqa`)
edge          ``visible(row, col, Nk, diag)`` on tiles that cross an edge:    (:func:`flashnb.kernels.blocks.
              keys beyond ``Nk``, the causal diagonal in both alignments      make_visible`)
============  =============================================================  ===========================================

Why masks come as bits.  The register tiles stay registers only if every loop that indexes them is unrolled, and
the compiler unrolls a loop nest only while its code stays small: 32 elements per lane each with Philox's ten rounds
(or a long ``mask_mod``) is far past that, and the tile would go to local memory.  So the policies whose per-element
answer is one bit (``mask_mod``, dropout's ``Z``) run in a loop of their own, which may stay a loop, over a lane's
elements, and hand the tile loop a 64-bit mask; what the unrolled code does per element is one bit test.
``score_mod`` changes the score itself, so it is inlined per element: a long one (``tanh`` soft-capping) is given
tiles with fewer elements per lane by the launchers (:func:`flashnb.kernels.flash.default_tiles`).

Nothing here imports a user surface: ``score_mod`` / ``mask_mod`` arrive as Python functions (or ``"module:attr"``
names, as the PTX guard's configs carry them) and are compiled here as inlined device functions; the block mask's
tile states arrive as a kernel argument (``M``, uint8), computed on the host from the
:class:`~flashnb.stages.fa2.BlockMask` the caller passes.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
from numba import cuda, float32, int32, uint64

from ..common import ONE, ZERO, positive_int, storage_conversions
from ..masks import EMPTY, FULL, PARTIAL  # noqa: F401  (block-mask tile states, as BlockMask.states writes them)
from ..rng import check_dropout, dropout_keep, dropout_kernel_args

__all__ = ["EMPTY", "FULL", "PARTIAL", "ALL", "MAX_ELEMENTS", "storage", "tile_state", "modifiers", "is_set",
           "check_features",
           "dropout", "dropout_args", "gqa", "gqa_group",
           "python_modifier", "device_modifier", "DROPOUT_SIG", "NO_DROPOUT", "SAME_POSITIONS",
           "check_dropout_at", "GUARD_ALIBI", "GUARD_WINDOW",
           "GUARD_SOFTCAP", "GUARD_DOCUMENT"]

FULL_MASK = 0xFFFFFFFF


# --------------------------------------------------------------------------- storage


def storage(name: str):
    """``(to_f32, from_f32)`` for arrays kept in HBM as ``name`` (:data:`flashnb.common.STORAGES`): numba casts for
    float32 (no instruction) and float16, bit reinterpretations for bfloat16 (uint16 patterns).  Every tile,
    register and statistic stays float32."""
    return storage_conversions(name)


# --------------------------------------------------------------------------- block mask: three tile states


def tile_state(sparse: bool):
    """``state(M, z, i, j, lane)``: the block mask's entry for Q tile ``i`` and K/V tile ``j`` of head ``z`` -- lane 0
    of each warp reads the byte and shuffles it to the others (warp-uniform; every warp reads the same, so
    ``continue`` on ``EMPTY`` is block-uniform).  Without a block mask: the constant ``FULL`` (``M`` never read)."""

    @cuda.jit(device=True, inline="always")
    def state(M, z, i, j, lane):
        if not sparse:
            return int32(FULL)
        return cuda.shfl_sync(FULL_MASK, int32(M[z, i, j]) if lane == 0 else int32(0), 0)

    return state


# --------------------------------------------------------------------------- score_mod / mask_mod

_DEVICE_FNS: dict = {}


def python_modifier(fn):
    """The Python function of a modifier: ``fn`` itself, the ``py_func`` of a ``cuda.jit`` device function, or the
    object a ``"module:attr"`` string names (how the PTX guard's JSON configs name modifiers)."""
    if isinstance(fn, str):
        module, _, attr = fn.partition(":")
        fn = getattr(importlib.import_module(module), attr)
    return getattr(fn, "py_func", fn)


_DERIVE = None   # flashnb.flex_grad.derivative, registered by flex_grad at its import (no import cycle)


def score_mod_grad_of(score_mod):
    """``d score_mod / d score`` for a backward: ``score_mod.grad`` when the modifier carries one, else derived from
    its source by :func:`flashnb.flex_grad.derivative` (which registers itself here when imported)."""
    grad = getattr(python_modifier(score_mod), "grad", None)
    if grad is not None:
        return grad
    if _DERIVE is None:
        raise RuntimeError("score_mod has no .grad and deriving it needs flashnb.flex_grad: import flashnb (which "
                           "imports it) first, or pass score_mod_grad")
    return _DERIVE(score_mod)


def device_modifier(fn):
    """``fn`` compiled as an inlined device function, one per Python function (every kernel using it shares it;
    a :func:`flashnb.flex.snapshot` brings its frozen copy); ``None`` stays ``None``.  The
    :data:`~flashnb.registry.KERNEL_CACHE_SIZE` most recently used are kept, as the factories keep their kernels:
    a process that makes modifiers in a loop does not keep every one alive."""
    from ..registry import KERNEL_CACHE_SIZE

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


# --------------------------------------------------------------------------- dropout (Philox, flashnb.rng)

#: The kernels' dropout arguments, appended to every product kernel's signature (never read without dropout):
#: ``threshold, inv_keep, seed_lo, seed_hi``, then where the launch's rows and columns sit in a larger attention
#: matrix (:func:`check_dropout_at`): ``row_base, row_step, row_split, row_jump``, the same four for columns.
DROPOUT_SIG = "uint32, float32, uint32, uint32" + ", int32" * 8
#: Rows and columns are their own positions: ``position = 0 + 1·i`` (no jump).
SAME_POSITIONS = ((0, 1, 0, 0), (0, 1, 0, 0))
#: The dropout arguments of a launch without dropout (never read).
NO_DROPOUT = (np.uint32(0), np.float32(0.0), np.uint32(0), np.uint32(0)) + (np.int32(0),) * 8

_INT32_MAX = 2**31 - 1


def check_dropout_at(dropout_at) -> tuple:
    """``dropout_at`` as ``((row_base, row_step, row_split, row_jump), (col_base, col_step, col_split, col_jump))``
    of ints: the launch's local row ``i`` draws the dropout of global row ``row_base + row_step·i + row_jump·(i >=
    row_split)``, and likewise for columns (``None``: :data:`SAME_POSITIONS`).  That covers a shard of a longer
    sequence cut contiguously (step 1), into two chunks (zigzag: the jump) or strided (striped: step W), so a
    context-parallel ring draws exactly the mask one device would.  ValueError / TypeError naming the argument."""
    if dropout_at is None:
        return SAME_POSITIONS
    form = ("dropout_at must be ((row_base, row_step, row_split, row_jump), (col_base, col_step, col_split, "
            "col_jump)) of ints")
    try:
        axes = tuple(tuple(a) for a in dropout_at)
    except TypeError:
        raise TypeError(f"{form}, got {dropout_at!r}") from None
    if len(axes) != 2 or any(len(a) != 4 for a in axes):
        raise ValueError(f"{form}, got {dropout_at!r}")
    out = []
    for name, axis in zip(("row", "col"), axes):
        for what, v in zip(("base", "step", "split", "jump"), axis):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{form}: {name}_{what} = {v!r} is not an int")
        base, step, split, jump = (int(v) for v in axis)
        if step < 1:
            raise ValueError(f"dropout_at: {name}_step must be >= 1 (positions increase), got {step}")
        if base < 0 or base + jump < 0:
            raise ValueError(f"dropout_at: {name} positions must be >= 0, got base {base} and jump {jump}")
        if max(abs(base), abs(split), abs(jump), step, abs(base + jump)) > _INT32_MAX // 2:
            raise ValueError(f"dropout_at: {name} positions must fit in int32, got {axis!r}")
        out.append((base, step, split, jump))
    return tuple(out)


def dropout_args(dropout_p, seed, dropout_at=None) -> tuple:
    """The host side: the kernels' dropout arguments ``(threshold, inv_keep, seed_lo, seed_hi, row_base, row_step,
    row_split, row_jump, col_base, col_step, col_split, col_jump)`` for ``dropout_p``, ``seed`` and
    ``dropout_at`` (:func:`flashnb.rng.dropout_kernel_args`: the keep test's 32-bit threshold ``ceil(p·2^32)``
    and ``1/(1-p)`` rounded once to float32, both computed here on the host; :func:`check_dropout_at`),
    :data:`NO_DROPOUT` when ``dropout_p == 0``."""
    p = check_dropout(dropout_p, seed)
    at = check_dropout_at(dropout_at)
    if p == 0:
        return NO_DROPOUT
    return dropout_kernel_args(p, seed) + tuple(np.int32(v) for axis in at for v in axis)


def dropout(on: bool):
    """``(state, keep_bits, factor)``: attention dropout as FA1 Alg. 2 and 4 do it, each ``Z_ij`` regenerated from
    Philox (:func:`flashnb.rng.dropout_keep`, counter ``(col, row, z, 0)`` of the *global* row and column) where it
    is needed, never stored.

    * ``state(threshold, inv_keep, seed_lo, seed_hi, *positions)``: once per thread, the kernel's dropout
      arguments (:data:`DROPOUT_SIG`);
    * ``keep_bits(st, z, r0, rs, c0, cs, NR, NC, Nq, Nk)``: ``Z`` of a lane's ``NR × NC`` elements ``(r0 + rs·i,
      c0 + cs·j)`` inside the problem, one bit each (bit ``i·NC + j``) -- a run-time loop, so the Philox rounds are
      not unrolled once per element into the tile's register code;
    * ``factor(bits, e, st)``: element ``e``'s ``Z / (1-p)`` (``1/(1-p)`` or 0).

    Off: ``keep_bits`` is never evaluated (its result is unused) and ``factor`` is the constant 1."""

    @cuda.jit(device=True, inline="always")
    def state(threshold, inv_keep, seed_lo, seed_hi, rb, rstep, rsplit, rjump, cb, cstep, csplit, cjump):
        return threshold, seed_lo, seed_hi, inv_keep, rb, rstep, rsplit, rjump, cb, cstep, csplit, cjump

    @cuda.jit(device=True, inline="always")
    def keep_bits(st, z, r0, rs, c0, cs, NR, NC, Nq, Nk):
        bits = uint64(0)
        if not on:
            return bits
        for e in range(NR * NC):
            i = e // NC
            row = r0 + rs * i
            col = c0 + cs * (e - i * NC)
            if row < Nq and col < Nk:
                grow = st[4] + st[5] * row + (st[7] if row >= st[6] else 0)    # the global row and column
                gcol = st[8] + st[9] * col + (st[11] if col >= st[10] else 0)
                if dropout_keep(st[1], st[2], z, grow, gcol, st[0]):
                    bits |= uint64(1) << uint64(e)
        return bits

    @cuda.jit(device=True, inline="always")
    def factor(bits, e, st):
        if not on:
            return ONE
        return st[3] if is_set(bits, e) else ZERO

    return state, keep_bits, factor


# --------------------------------------------------------------------------- grouped- / multi-query attention


def gqa(on: bool):
    """``(kv_head, group)``: ``kv_head(z, Q, K)`` is the K/V head of query head ``z`` (``z // G`` with ``G = BH_q /
    BH_kv`` read from the shapes), ``group(Q, K)`` is ``G``.  Off: ``z`` and 1 (K, V have q's heads)."""

    @cuda.jit(device=True, inline="always")
    def group(Q, K):
        return Q.shape[0] // K.shape[0] if on else 1

    @cuda.jit(device=True, inline="always")
    def kv_head(z, Q, K):
        return z // (Q.shape[0] // K.shape[0]) if on else z

    return kv_head, group


def gqa_group(BH, k, v) -> int:
    """The host side of :func:`gqa`: ``G = BH_q / BH_kv`` for ``BH`` query heads and K, V (1: every query head has
    its own K/V head); ValueError naming k, v when their shapes differ or ``BH`` is not a multiple of theirs."""
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] < 1 or BH % k.shape[0]:
        raise ValueError(f"grouped-query attention: q's batch·heads ({BH}) must be a multiple of k's and v's "
                         f"({k.shape[0]})")
    return BH // k.shape[0]


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
