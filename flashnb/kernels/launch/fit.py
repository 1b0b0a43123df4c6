"""Tile fitting for the product kernels: the defaults per head dim, how options and a block mask's blocks shape them,
and the block mask's tile states at the chosen tiles (host side of :mod:`flashnb.kernels.launch.flash`; the
tensor-core launchers read the same block masks and limits)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from ...common import check_shared_fit
from ...masks import BlockMask
from ...stages import fa2
from ..policies import PARTIAL
from ..simt.blocks import LC, LR, bwd_geometry, bwd_shared_bytes, geometry, needs_dynamic, shared_bytes
from ..simt.defaults import DESIGN_OPTIN_BYTES, _dynamic_bytes, bwd_default_tiles, default_tiles  # noqa: F401

__all__ = ["default_tiles", "bwd_default_tiles", "mask_tiles", "prepare_block_mask", "PreparedMask",
           "DESIGN_OPTIN_BYTES"]


def mask_tiles(d: int) -> dict:
    """The block size a plain boolean ``block_mask`` array is read at (without ``Br``/``Bc`` options), and that the
    user surfaces build a ``mask_mod``'s block mask at: ``Br × Bc`` = 64 × 32 up to d = 64, 32 × 32 at d = 128 --
    FA2's forward tiles (:func:`flashnb.stages.fa2.default_tiles`), so one mask array means the same blocks to every
    impl. The kernels run at tiles that divide it."""
    t = fa2.default_tiles(d)
    return dict(Br=t["Br"], Bc=t["Bc"])


def _option(name, value):
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _largest_divisor(n: int, cap: int, step: int) -> int | None:
    """The largest ``x <= cap`` dividing ``n`` that is a multiple of ``step`` (None if there is none)."""
    return next((x for x in range(cap - cap % step, 0, -step) if n % x == 0), None)


def _fit(direction, t, within, given):
    """Tiles ``t`` made to divide the block mask's ``within = (mBr, mBc)`` (each tile inside one mask block): a given
    tile must divide it (ValueError naming both), a default one shrinks to the largest divisor the layout allows."""
    mBr, mBc = within
    step = {"forward": (LR, LC), "backward": (LC, LR)}[direction]
    for name, m, s in (("Br", mBr, step[0]), ("Bc", mBc, step[1])):
        if m % t[name] == 0:
            continue
        if name in given:
            raise ValueError(f"block_mask was built for tiles Br={mBr}, Bc={mBc}; the flash {direction} tiles "
                             f"Br={t['Br']}, Bc={t['Bc']} must divide them: build the mask for these tiles or pass "
                             f"Br, Bc that divide {mBr}, {mBc}")
        x = _largest_divisor(m, t[name], s)
        if x is None:
            raise ValueError(f"block_mask was built for tiles Br={mBr}, Bc={mBc}: the flash {direction} kernel needs "
                             f"{name} a multiple of {s} dividing {m}; build the mask for tiles that are multiples of "
                             f"{max(LR, LC)} (both directions' tiles then divide them), e.g. "
                             f"flashnb.flex.create_block_mask(..., {name}={max(8, m - m % 8)})")
        t[name] = x
    if "warps" not in given:             # the most warps (up to the default) the tiles still split into
        split = t["Br"] if direction == "forward" else t["Bc"]
        t["warps"] = max(w for w in range(1, t["warps"] + 1) if split % (LR * w) == 0
                         and (direction == "forward" or t["Br"] % w == 0))   # (the backward's warps split dQ_i)
    return t


def _tiles(direction, d, Br, Bc, warps, within=None, *, optin=DESIGN_OPTIN_BYTES, static=False, scored=False):
    """Validated tiles of a launch: the defaults (``static``: the forward's static ones; ``scored``: a score_mod's)
    overridden by the options, made to divide a block mask's tiles ``within``; the forward's get ``dynamic`` (more
    than 48 KiB: dynamic shared memory up to ``optin``, more is a ValueError naming tiles and limit), the
    backward's must fit 48 KiB."""
    given = {n: _option(n, v) for n, v in (("Br", Br), ("Bc", Bc), ("warps", warps)) if v is not None}
    t = dict(default_tiles(d, static, scored) if direction == "forward" else bwd_default_tiles(d), **given)
    if within is not None:
        t = _fit(direction, t, within, given)
    what = f"Br={t['Br']}, Bc={t['Bc']} at d={d}"
    if direction == "forward":
        geometry(t["Br"], t["Bc"], d, t["warps"])
        check_shared_fit("flash forward", what, shared_bytes(t["Br"], t["Bc"], d, t["warps"]), "choose smaller Br/Bc",
                         optin=optin)
        t["dynamic"] = needs_dynamic(t["Br"], t["Bc"], d, t["warps"])
    else:
        bwd_geometry(t["Br"], t["Bc"], d, t["warps"])
        check_shared_fit("flash backward", what, bwd_shared_bytes(t["Br"], t["Bc"], d, t["warps"]),
                         "choose smaller Br/Bc")
    return t


# --------------------------------------------------------------------------- block masks at the kernel's tiles


@dataclass(frozen=True)
class PreparedMask:
    """A block mask mapped onto one launch's tiles and copied to the device (:func:`prepare_block_mask`): pass it as
    ``block_mask=`` to reuse it without host work per call (e.g. outside a timed loop)."""

    direction: str
    tiles: dict = field(hash=False)
    M: object = field(hash=False, repr=False)
    shape: tuple = ()          # (BH, Nq, Nk, d) it was prepared for
    mask_mod: object = None    # the mask_mod of a block mask from flashnb.flex.create_block_mask
    partial: bool = False      # whether M has PARTIAL tiles (mask_mod per element)


def _as_block_mask(block_mask, d, Br, Bc):
    """``block_mask`` as a :class:`flashnb.masks.BlockMask`: a plain boolean array is read at the ``Br``, ``Bc``
    options, else at :func:`mask_tiles` ``(d)``."""
    if isinstance(block_mask, BlockMask):
        return block_mask
    t = mask_tiles(d)
    return BlockMask(np.asarray(block_mask), Br=t["Br"] if Br is None else Br, Bc=t["Bc"] if Bc is None else Bc)


def _mask_at_tiles(direction, d, Br, Bc, warps, block_mask, BH, Nq, Nk, optin=DESIGN_OPTIN_BYTES, static=False,
                   scored=False):
    """``(tiles, M or None, mask_mod)``: the launch's tiles (dividing the block mask's) and the mask's tile states at
    them, uint8 ``(BH, ceil(Nq/Br), ceil(Nk/Bc))`` -- asked of the mask itself (:meth:`BlockMask.at_tiles`: a
    ``mask_mod``'s mask recomputes its states at the finer tiles, a plain one repeats its entries)."""
    if block_mask is None:
        return _tiles(direction, d, Br, Bc, warps, optin=optin, static=static, scored=scored), None, None
    bm = _as_block_mask(block_mask, d, Br, Bc)
    bm.check(Nq, Nk, BH=BH)
    t = _tiles(direction, d, Br, Bc, warps, (bm.Br, bm.Bc), optin=optin, static=static, scored=scored)
    return t, bm.at_tiles(t["Br"], t["Bc"], Nq, Nk, BH), bm.mask_mod


def _device_mask(M):
    """M on the device; dense kernels get a 1x1x1 placeholder they never read."""
    if M is None:
        return cuda.device_array((1, 1, 1), dtype=np.uint8)
    return cuda.to_device(np.ascontiguousarray(M, dtype=np.uint8))


def prepare_block_mask(block_mask, *, direction, BH, Nq, Nk, d, Br=None, Bc=None, warps=None) -> PreparedMask:
    """The block mask mapped onto the ``direction``'s tiles and copied to the device, once."""
    if block_mask is None:
        raise ValueError("block_mask is required")
    t, M, mask_mod = _mask_at_tiles(direction, d, Br, Bc, warps, block_mask, BH, Nq, Nk)
    return PreparedMask(direction, t, _device_mask(M), (BH, Nq, Nk, d), mask_mod, bool((M == PARTIAL).any()))


def _launch_mask(direction, d, Br, Bc, warps, block_mask, BH, Nq, Nk, **kw):
    """``(tiles, device M or None, mask_mod, partial)`` of a launch: from nothing, a mask, or a prepared mask."""
    if isinstance(block_mask, PreparedMask):
        if block_mask.direction != direction or block_mask.shape != (BH, Nq, Nk, d):
            raise ValueError(f"block_mask was prepared for the {block_mask.direction} of (BH, Nq, Nk, d) = "
                             f"{block_mask.shape}, not the {direction} of {(BH, Nq, Nk, d)}")
        return dict(block_mask.tiles), block_mask.M, block_mask.mask_mod, block_mask.partial
    t, M, mask_mod = _mask_at_tiles(direction, d, Br, Bc, warps, block_mask, BH, Nq, Nk, **kw)
    if M is None:
        return t, None, None, False
    return t, _device_mask(M), mask_mod, bool((M == PARTIAL).any())
