"""Storage: ``(to_f32, from_f32)``, called at every global load and store of the arrays kept in HBM (float32: no
instruction; float16; bfloat16 as uint16 bit patterns).  Tiles, registers and statistics stay float32."""

from __future__ import annotations

from ...common import storage_conversions

__all__ = ["storage"]


def storage(name: str):
    """``(to_f32, from_f32)`` for arrays kept in HBM as ``name`` (:data:`flashnb.common.STORAGES`): numba casts for
    float32 (no instruction) and float16, bit reinterpretations for bfloat16 (uint16 patterns).  Every tile,
    register and statistic stays float32."""
    return storage_conversions(name)
