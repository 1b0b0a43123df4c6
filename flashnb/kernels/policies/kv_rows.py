"""K/V row addressing: where the rows of a K/V tile are stored, asked by every loop before it loads ``K_j, V_j``.

Today K and V are contiguous ``(BH_kv, Nk, d)`` arrays, so K/V tile ``j`` of K/V head ``kz`` (:func:`~flashnb.kernels.
policies.gqa.gqa`'s ``kv_head``) is rows ``j0 .. j0 + Bc - 1`` of ``K[kz]``: the identity, which inlines to nothing.
A paged KV cache maps the logical rows through its block table here, and the loops stay as they are.
"""

from __future__ import annotations

from numba import cuda

__all__ = ["kv_rows"]


def kv_rows():
    """``kv_tile(kz, j0)``: ``(head, row)`` of the K, V arrays where the tile of K/V head ``kz`` starting at key
    ``j0`` is stored (contiguous storage: ``(kz, j0)``)."""

    @cuda.jit(device=True, inline="always")
    def kv_tile(kz, j0):
        return kz, j0

    return kv_tile
