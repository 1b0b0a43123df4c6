"""Block mask: the three tile states ``EMPTY`` (skipped: never loaded), ``FULL`` (no per-element work), ``PARTIAL``
(``mask_mod`` per element), read per (Q tile, K/V tile) by :func:`tile_state`.  The states arrive as a kernel
argument (``M``, uint8) computed on the host from the :class:`~flashnb.masks.BlockMask` the caller passes."""

from __future__ import annotations

from numba import cuda, int32

from ...masks import EMPTY, FULL, PARTIAL  # noqa: F401  (block-mask tile states, as BlockMask.states writes them)

__all__ = ["EMPTY", "FULL", "PARTIAL", "tile_state"]

FULL_MASK = 0xFFFFFFFF


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
