"""The CUDA-core product kernels' default tiles per head dim (stage 6's), and the dynamic shared memory a forward
configuration asks for: what the kernels' registered configurations and the launchers' tile fitting
(:mod:`flashnb.kernels.launch.fit`) start from."""

from __future__ import annotations

from .blocks import shared_bytes

__all__ = ["default_tiles", "bwd_default_tiles", "DESIGN_OPTIN_BYTES"]

# Stage 6's tiles (flashnb.stages.fa2_fast: chosen by the SASS mix, ptxas's registers and the SASS time model), per
# head-dim class; d = 128's forward default needs dynamic shared memory (100,352 B), the static table is the
# fallback where a device refuses it.
_FWD = {32: dict(Br=64, Bc=32, warps=2), 64: dict(Br=64, Bc=32, warps=2), 128: dict(Br=64, Bc=64, warps=4)}
_FWD_STATIC = {32: dict(Br=64, Bc=32, warps=2), 64: dict(Br=64, Bc=32, warps=2), 128: dict(Br=24, Bc=32, warps=2)}
_BWD = {32: dict(Br=32, Bc=32, warps=2), 64: dict(Br=32, Bc=32, warps=2), 128: dict(Br=16, Bc=24, warps=2)}
# With a score_mod the forward's tiles hold at most 16 scores per lane (TM·TN <= 16): score_mod is inlined once per
# score, and at 32 per lane a long one (tanh soft-capping) makes the compiler stop unrolling the tile's register
# code, which then lives in local memory.  (The backward's defaults hold 16 and 6.)
_FWD_SCORED = {32: dict(Br=32, Bc=32, warps=2), 64: dict(Br=32, Bc=32, warps=2), 128: dict(Br=64, Bc=32, warps=4)}
#: Opt-in limit the defaults are chosen against (sm_80's 163 KiB, the smaller of sm_80 and sm_90).
DESIGN_OPTIN_BYTES = 163 * 1024


def _table(table, d):
    for dmax in sorted(table):
        if d <= dmax:
            return dict(table[dmax])
    raise ValueError(f"head dim d must be <= {max(table)}, got {d}")


def default_tiles(d: int, static: bool = False, score_mod: bool = False) -> dict:
    """The forward's default ``Br, Bc, warps`` at head dim ``d`` (stage 6's); ``static``: the largest within 48 KiB
    of static shared memory (the fallback when a device refuses dynamic shared memory); ``score_mod``: at most 16
    scores per lane (a score_mod is inlined once per score: see ``_FWD_SCORED``)."""
    return _table(_FWD_STATIC if static else _FWD_SCORED if score_mod else _FWD, d)


def bwd_default_tiles(d: int) -> dict:
    """The backward's default ``Br, Bc, warps`` (Alg. 2's names: ``Br`` query rows per Q tile, ``Bc`` keys per
    block)."""
    return _table(_BWD, d)


def _dynamic_bytes(Br, Bc, d, warps, dynamic=False, **_):
    """Dynamic shared memory a forward launch of this configuration asks for (0 for a static kernel)."""
    return shared_bytes(Br, Bc, d, warps) if dynamic else 0
