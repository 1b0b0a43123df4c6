"""Attention dropout: Philox (:mod:`flashnb.rng`) regenerated per element where it is needed, never stored; the
kernels' dropout arguments and their host side."""

from __future__ import annotations

import numpy as np
from numba import cuda, uint64

from ...common import ONE, ZERO
from ...rng import check_dropout, dropout_keep, dropout_kernel_args
from .modifiers import is_set

__all__ = ["DROPOUT_SIG", "SAME_POSITIONS", "NO_DROPOUT", "check_dropout_at", "dropout_args", "dropout"]

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
