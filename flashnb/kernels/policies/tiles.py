"""The tiles a loop visits, written once: the causal tile range of both directions, the heavy-first order of the
Q blocks, and the host's list of visited (Q tile, K/V tile) pairs.

``causal`` is bottom-right aligned by ``diag`` (row ``r`` sees keys ``<= r + diag``; :func:`flashnb.common.
causal_diag`).  A K/V tile entirely above the diagonal of a Q block, and a Q tile whose rows all precede a K/V
block's first key, are never visited (FA2 Section 3.1.1).  The device functions are ``inline="always"`` and take
``causal`` as a compile-time constant: without it they are ``ceil(N/B)`` and 0.  The host's :func:`tiles_visited`
calls the same functions (their ``py_func``), so the traffic models count what the kernels visit.
"""

from __future__ import annotations

from numba import cuda

from ...common import causal_diag, cdiv
from ...masks import EMPTY

__all__ = ["kv_tile_count", "kv_tile_range", "q_tile_range", "heavy_first", "tiles_visited"]


@cuda.jit(device=True, inline="always")
def kv_tile_count(i0, Br, Bc, Nq, Nk, diag, causal):
    """FA2 Alg. 1 line 6: how many K/V tiles the Q block starting at row ``i0`` visits -- all ``Tc``, or with
    ``causal`` only up to the tile of the last key the block's last row may see."""
    n_tiles = (Nk + Bc - 1) // Bc
    if causal:                                         # skip K/V blocks entirely above the diagonal
        last = min(i0 + Br, Nq) - 1 + diag
        n_tiles = min(n_tiles, last // Bc + 1) if last >= 0 else 0
    return n_tiles


@cuda.jit(device=True, inline="always")
def kv_tile_range(i0, Br, Bc, Nq, Nk, diag, causal):
    """``(n_tiles, n_full)``: :func:`kv_tile_count`, and the leading tiles no mask touches (every key inside ``Nk``
    and, with ``causal``, at or below the diagonal for the block's first row)."""
    n_tiles = kv_tile_count(i0, Br, Bc, Nq, Nk, diag, causal)
    n_full = Nk // Bc
    if causal:
        n_full = min(n_full, max(0, (i0 + diag + 1) // Bc))
    return n_tiles, min(n_full, n_tiles)


@cuda.jit(device=True, inline="always")
def q_tile_range(j0, Br, Bc, Nq, diag, causal):
    """FA2 Alg. 2 line 8: ``(i_first, i_full, n_i)`` for the K/V block starting at key ``j0`` -- it visits Q tiles
    ``i_first .. n_i - 1``: with ``causal`` from the tile of row ``j0 - diag`` (the first that may see key
    ``j0``); from ``i_full`` on no causal mask touches a tile (0 without ``causal``)."""
    n_i = (Nq + Br - 1) // Br
    i_first = 0
    i_full = 0
    if causal:                                         # skip Q blocks whose rows all precede key j0
        first = j0 - diag
        i_first = first // Br if first > 0 else 0
        i_full = max(i_first, (j0 + Bc - 1 - diag + Br - 1) // Br)
        i_full = min(i_full, n_i)
    return i_first, i_full, n_i


@cuda.jit(device=True, inline="always")
def heavy_first(qb, Tr, causal):
    """The Q block that launch-order block ``qb`` of ``Tr`` computes: with ``causal`` the heaviest (the last, which
    sees the most K/V tiles) first, so the longest blocks do not start last."""
    if causal:
        return Tr - 1 - qb
    return qb


def tiles_visited(Nq, Nk, Br, Bc, causal, direction="forward", states=None):
    """``[(outer, inner, rows, cols), ...]``: the (Q tile, K/V tile) pairs a launch computes for one head, with their
    valid row and column counts -- forward: outer = Q block i, inner = K/V block j; backward the reverse.  ``states``:
    the block mask's ``(ceil(Nq/Br), ceil(Nk/Bc))`` tile states (or booleans) at these tiles (``EMPTY`` pairs are
    left out).  The ranges are the device's (:func:`kv_tile_count`, :func:`q_tile_range`)."""
    diag = causal_diag(causal, Nq, Nk)
    causal = bool(causal)
    out = []
    if direction == "forward":
        for i in range(cdiv(Nq, Br)):
            n = kv_tile_count.py_func(i * Br, Br, Bc, Nq, Nk, diag, causal)
            out += [(i, j, min(Br, Nq - i * Br), min(Bc, Nk - j * Bc)) for j in range(n)]
    else:
        for j in range(cdiv(Nk, Bc)):
            i_first, _, n_i = q_tile_range.py_func(j * Bc, Br, Bc, Nq, diag, causal)
            out += [(j, i, min(Br, Nq - i * Br), min(Bc, Nk - j * Bc)) for i in range(i_first, n_i)]
    if states is not None:
        ij = (lambda o, n: (o, n)) if direction == "forward" else (lambda o, n: (n, o))
        out = [tile for tile in out if states[ij(tile[0], tile[1])] != EMPTY]
    return out
