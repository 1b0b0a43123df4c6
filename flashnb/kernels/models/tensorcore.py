"""fa2-tc's analytic traffic models: element accesses per launch, equal to the traffic counter's (host side)."""

from __future__ import annotations

from ...common import cdiv
from ..launch.tensorcore import _bwd_tiles, _fit_mask, _tiles
from ..tensorcore.geometry import BWD_LABEL, bwd_geometry, geometry
from .simt import model_bytes, visited_per_head

__all__ = ["model_forward", "model_backward", "hbm_bytes"]


def model_forward(BH, Nq, Nk, d, *, causal=False, storage="float16", Br=None, Bc=None, warps=None, arch=80,
                  group=1, block_mask=None):
    """Element accesses of :func:`forward` (one launch).  Global: Q, O, L once; K_j, V_j once per visited tile
    (the copies read only elements inside the arrays; zero fill is not a read).  Shared, per block: ``Br·Dp``
    written (Q_i, zero-padded to Dp) and read once (its fragments); per visited tile ``2·Bc·Dp`` written
    (K_j, V_j) and, by each warp, ``2·Bc·Dp`` read (its B fragments of both matmuls, each element once: the
    fragments serve all the warp's m-tiles).  ``group`` (GQA's query heads per K/V head) changes nothing: every
    query head's blocks read its K/V head's tiles.  ``block_mask``: as :func:`forward` takes it; its EMPTY tiles
    are not visited (at the tiles the launch fits to it)."""
    t = _tiles(storage, d, Br, Bc, warps, arch)
    given = {n: x for n, x in (("Br", Br), ("Bc", Bc), ("warps", warps)) if x is not None}
    t, M = _fit_mask("forward", d, t, given, block_mask, BH, Nq, Nk)
    g = geometry(storage, d, t["Br"], t["Bc"], t["warps"], arch)
    per_head, checked = visited_per_head("forward", Nq, Nk, t, causal, M, BH)
    visited = [tile for head in per_head for tile in head]
    kv = sum(cols for _, _, _, cols in visited) * d
    blocks = BH * cdiv(Nq, t["Br"])
    n_visited = len(visited)
    Dp = g["Dp"]
    reads = {"Q": BH * Nq * d, "K": kv, "V": kv}
    if M is not None:                                  # lane 0 of each warp reads each tile state in range
        reads["M"] = BH * checked * t["warps"]
    return [dict(launch="FA2 tensor-core forward", reads=reads,
                 writes={"O": BH * Nq * d, "L": BH * Nq}, atomics={},
                 shared_reads=blocks * t["Br"] * Dp + n_visited * t["warps"] * 2 * t["Bc"] * Dp,
                 shared_writes=blocks * t["Br"] * Dp + n_visited * 2 * t["Bc"] * Dp)]



def hbm_bytes(model, config) -> int:
    """Bytes of a model of fa2-tc's launches at the configuration's storage (L, D, dQ's accumulator: 4 bytes)."""
    return sum(m["read_bytes"] + m["write_bytes"] + m["atomic_bytes"]
               for m in model_bytes(model, config.get("storage", "float16")))



def model_backward(BH, Nq, Nk, d, *, causal=False, storage="float16", Br=None, Bc=None, warps=None, group=1,
                   block_mask=None):
    """Element accesses of :func:`backward`: stage 4's preprocessing launch (O, dO read; D, dQ = 0 written), the
    main launch, and (half storage) dQ's narrowing.  Main: K_j, V_j once per block; Q_i, dO_i, L_i, D_i once per
    visited tile (valid rows); dQ's atomics once per valid element of each visited tile; dK, dV written once.
    Shared, per block: K_j, V_j written (``2·Bc·Dp``; read once as A fragments where they stay in registers: V_j's
    with ``kv_regs``, K_j's first ``k_regs`` k-steps of ``KS`` columns); per
    visited tile: Q_i, dO_i (``2·Br·Dp``), L_i, D_i (``2·Br``) and dSᵀ (``Bc·Br``) written; each warp reads Q_i and
    dO_i twice (``4·Br·Dp``: the B fragments of Sᵀ, dPᵀ and of dK_j, dV_j), L_i and D_i once per score (``32·Br``;
    at ``Dp > 64`` once per lane and query: ``16·Br``),
    V_j's fragments (``16·Dp``) and K_j's beyond ``k_regs`` (``16·(Dp - k_regs·KS)``) when they do not stay in
    registers; each part of dQ_i reads dSᵀ
    (``16·Bc``) and K_j (``Bc·NDQ·8``).  ``BH`` counts query heads; with ``group`` of them per K/V head (GQA) a
    block is one K/V head's tile and visits the Q tiles of its ``group`` query heads.  ``block_mask``: as
    :func:`backward` takes it (EMPTY tiles are not visited; K_j, V_j are read and dK_j, dV_j written all the same)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or BH % group:
        raise ValueError(f"group must be a positive int dividing BH={BH}, got {group!r}")
    t = _bwd_tiles(storage, d, Br, Bc, warps, gqa=group > 1)
    given = {n: x for n, x in (("Br", Br), ("Bc", Bc), ("warps", warps)) if x is not None}
    t, M = _fit_mask("backward", d, t, given, block_mask, BH, Nq, Nk)
    t = _bwd_tiles(storage, d, t["Br"], t["Bc"], t["warps"], gqa=group > 1)
    Br_, Bc_, W = t["Br"], t["Bc"], t["warps"]
    g = bwd_geometry(storage, d, Br_, Bc_, W)
    Dp = g["Dp"]
    per_head, checked = visited_per_head("backward", Nq, Nk, t, causal, M, BH)
    visited = [tile for head in per_head for tile in head]
    n = len(visited)
    q_rows = sum(rows for _, _, rows, _ in visited)
    BHk = BH // group                                  # K/V heads
    blocks = BHk * cdiv(Nk, Bc_)
    pre = dict(launch="D = rowsum(dO∘O)", reads={"O": BH * Nq * d, "dO": BH * Nq * d},
               writes={"D": BH * Nq, "dQ": BH * Nq * d}, atomics={}, shared_reads=0, shared_writes=0)
    kept = g["k_regs"] * g["KS"]                       # K_j's columns kept in registers
    ld_reads = (16 if g["one_loop"] else 32) * Br_     # L_i, D_i: per lane and query, or per score
    per_tile = (W * (4 * Br_ * Dp + ld_reads + (0 if g["kv_regs"] else 16 * Dp + 16 * (Dp - kept)))
                + g["PARTS"] * (16 * Bc_ + Bc_ * g["NDQ"] * 8))
    main = dict(launch=BWD_LABEL,
                reads={a: x for a, x in (("Q", q_rows * d), ("K", BHk * Nk * d), ("V", BHk * Nk * d),
                                         ("dO", q_rows * d), ("L", q_rows), ("D", q_rows),
                                         ("M", BH * checked * W)) if x},
                writes={"dK": BHk * Nk * d, "dV": BHk * Nk * d}, atomics={"dQ": q_rows * d} if q_rows else {},
                shared_reads=blocks * ((Bc_ * Dp if g["kv_regs"] else 0) + Bc_ * kept) + n * per_tile,
                shared_writes=blocks * 2 * Bc_ * Dp + n * (2 * Br_ * Dp + 2 * Br_ + Bc_ * Br_))
    if storage == "float32":
        return [pre, main]
    return [pre, main, dict(launch=f"dQ -> {storage}", reads={"dQ": BH * Nq * d}, writes={"dQh": BH * Nq * d},
                            atomics={}, shared_reads=0, shared_writes=0)]

