"""Block masks: which ``(Q block i, K/V block j)`` pairs of attention are computed.

A :class:`BlockMask` is the ``M`` of block-sparse FlashAttention (FA1 paper, Algorithm 5): ``M_ij = 0`` blocks are
never loaded.  Stage 5's lesson kernel (:mod:`flashnb.stages.block_sparse`, on stage 4's FA2) reads two states,
empty and computed; the product kernel (:mod:`flashnb.kernels.launch.flash`) reads three, as a block mask built from a
``mask_mod`` (:func:`flashnb.flex.create_block_mask`) carries them: ``EMPTY`` (skipped), ``FULL`` (every element
allowed: no per-element work) and ``PARTIAL`` (``mask_mod`` per element).  The type lives here, below the stages
and the kernels, so that both read it and neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .common import cdiv, positive_int

__all__ = ["BlockMask", "EMPTY", "FULL", "PARTIAL"]

EMPTY, FULL, PARTIAL = 0, 1, 2   # the tile states of BlockMask.states, as the kernels read them

@dataclass(frozen=True, eq=False)
class BlockMask:
    """A boolean block mask ``(..., Tr, Tc)`` (True = compute the block) and the tiles ``Br × Bc`` it was
    built for.  Leading axes, if any, are the problem's leading (batch, head) axes, flattened or not.

    From a ``mask_mod`` (:func:`flashnb.flex.create_block_mask`) it has three states: ``partial`` (boolean, a
    subset of ``mask``) marks the computed blocks where ``mask_mod`` is applied per element; the other computed
    blocks are full (every element allowed: no per-element work), the rest empty (never loaded).  Such a mask
    keeps its ``mask_mod`` (a snapshot: what it captured when these tiles were computed) and leading axes
    ``(B, H)``, with what the surface that built it gave to recompute it exactly: ``retile(B, H, Nq, Nk, Br, Bc)``,
    the mask at finer tiles, and ``elements(B, H, Nq, Nk)``, the boolean element mask."""

    mask: np.ndarray
    Br: int
    Bc: int
    partial: np.ndarray | None = None
    mask_mod: object = None
    retile: object = field(default=None, repr=False)
    elements: object = field(default=None, repr=False)

    def __post_init__(self):
        a = np.asarray(self.mask)
        if a.dtype != np.bool_:
            raise TypeError(f"block_mask must be a boolean array (True = compute the block), got dtype {a.dtype}")
        if a.ndim < 2:
            raise ValueError(f"block_mask must have shape (..., ceil(Nq/Br), ceil(Nk/Bc)), got {a.shape}")
        if (self.partial is None) != (self.mask_mod is None):
            raise ValueError("block_mask: partial blocks and mask_mod come together (flashnb.flex.create_block_mask)")
        if self.partial is not None:
            p = np.asarray(self.partial)
            if p.dtype != np.bool_ or p.shape != a.shape or np.any(p & ~a):
                raise ValueError(f"block_mask.partial must be a boolean array of the mask's shape {a.shape} marking "
                                 "computed blocks only")
            object.__setattr__(self, "partial", p)
            if self.retile is None or self.elements is None:
                raise ValueError("block_mask: a mask from a mask_mod is made by flashnb.flex.create_block_mask "
                                 "(which gives it its finer tiles and elements)")
        object.__setattr__(self, "mask", a)
        object.__setattr__(self, "Br", positive_int("Br", self.Br))
        object.__setattr__(self, "Bc", positive_int("Bc", self.Bc))

    @property
    def shape(self) -> tuple:
        return self.mask.shape

    @property
    def density(self) -> float:
        """``s``: the fraction of nonzero blocks."""
        return float(self.mask.mean())

    def check(self, Nq: int, Nk: int, BH: int | None = None) -> None:
        """ValueError naming ``block_mask`` unless the shape is ``(..., ceil(Nq/Br), ceil(Nk/Bc))`` with leading
        axes of ``BH`` (or 1) problems."""
        Tr, Tc = cdiv(Nq, self.Br), cdiv(Nk, self.Bc)
        lead = int(np.prod(self.mask.shape[:-2], dtype=np.int64))
        if self.mask.shape[-2:] != (Tr, Tc) or (BH is not None and lead not in (1, BH)):
            heads = "" if BH is None else f" (leading axes: none, or batch·heads = {BH} in all)"
            raise ValueError(f"block_mask must have shape (..., {Tr}, {Tc}) = (..., ceil(Nq/Br), ceil(Nk/Bc)) for "
                             f"Nq={Nq}, Nk={Nk} and the tiles Br={self.Br}, Bc={self.Bc} it is read at{heads}; "
                             f"got {self.mask.shape}")

    @property
    def states(self) -> np.ndarray:
        """uint8 entries as the kernels read them: ``EMPTY`` (0), ``FULL`` (1), ``PARTIAL`` (2)."""
        m = self.mask.astype(np.uint8)
        return m if self.partial is None else m + self.partial.astype(np.uint8)

    def at_tiles(self, Br: int, Bc: int, Nq: int, Nk: int, BH: int) -> np.ndarray:
        """The mask at finer tiles ``Br × Bc`` (dividing this mask's): uint8 ``(BH, ceil(Nq/Br), ceil(Nk/Bc))``,
        each entry repeated over the tiles inside its block (one with a ``mask_mod`` is recomputed from it at
        those tiles: a partial block may hold empty and full tiles)."""
        self.check(Nq, Nk, BH)
        if self.Br % Br or self.Bc % Bc:
            raise ValueError(f"block_mask built for Br={self.Br}, Bc={self.Bc} cannot be read at tiles "
                             f"Br={Br}, Bc={Bc} (they must divide {self.Br}, {self.Bc})")
        if self.mask_mod is not None:
            B, H = self.mask.shape[:2] if self.mask.ndim == 4 else (1, 1)
            m = self.states if (Br, Bc) == (self.Br, self.Bc) else self.retile(B, H, Nq, Nk, Br, Bc).states
            m = m.reshape((-1,) + m.shape[-2:])
            return np.ascontiguousarray(np.broadcast_to(m, (BH,) + m.shape[1:]), dtype=np.uint8)
        m = self.mask.reshape((-1,) + self.mask.shape[-2:])
        m = np.repeat(np.repeat(m, self.Br // Br, axis=1), self.Bc // Bc, axis=2)[:, :cdiv(Nq, Br), :cdiv(Nk, Bc)]
        return np.ascontiguousarray(np.broadcast_to(m, (BH,) + m.shape[1:]), dtype=np.uint8)

    def expand(self, Nq: int, Nk: int) -> np.ndarray:
        """The element mask ``(..., Nq, Nk)`` (for :mod:`flashnb.reference`'s ``mask=``)."""
        from .reference import expand_block_mask

        self.check(Nq, Nk)
        if self.mask_mod is not None:
            B, H = self.mask.shape[:2] if self.mask.ndim == 4 else (1, 1)
            return self.elements(B, H, Nq, Nk).reshape(self.mask.shape[:-2] + (Nq, Nk))
        return expand_block_mask(self.mask, Nq, Nk, self.Br, self.Bc)

    def __and__(self, other: "BlockMask") -> "BlockMask":
        return self._combine(other, np.logical_and)

    def __or__(self, other: "BlockMask") -> "BlockMask":
        return self._combine(other, np.logical_or)

    def _combine(self, other, op):
        if not isinstance(other, BlockMask) or (other.Br, other.Bc) != (self.Br, self.Bc):
            raise ValueError("block masks combine only with block masks built for the same tiles")
        if self.mask_mod is not None or other.mask_mod is not None:
            raise ValueError("block masks made from a mask_mod combine through their mask_mods: "
                             "flashnb.flex.and_masks / or_masks, then create_block_mask")
        return BlockMask(op(self.mask, other.mask), self.Br, self.Bc)

    def __repr__(self):
        Tr, Tc = self.mask.shape[-2:]
        flex = "" if self.partial is None else \
            f", partial={float(self.partial.mean()):.3f}, mask_mod={getattr(self.mask_mod, '__name__', '?')}"
        return f"BlockMask({Tr}x{Tc} blocks of {self.Br}x{self.Bc}, s={self.density:.3f}{flex})"
