"""Grouped- / multi-query attention: the K/V head of a query head, and the group size."""

from __future__ import annotations

from numba import cuda

__all__ = ["gqa", "gqa_group"]


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
