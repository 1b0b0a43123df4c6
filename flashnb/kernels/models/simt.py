"""The product kernels' analytic traffic models: element accesses per launch, equal to the traffic counter's, and
their bytes at a storage (host side of :mod:`flashnb.kernels.launch.flash`)."""

from __future__ import annotations

from ...common import cdiv, check_storage, positive_int, storage_dtype
from ..launch.fit import _mask_at_tiles
from ..policies.tiles import tiles_visited
from ..simt.blocks import bwd_geometry, geometry

__all__ = ["tiles_visited", "visited_per_head", "model_forward", "model_backward", "itemsizes", "model_bytes"]


def visited_per_head(direction, Nq, Nk, t, causal, M, BH):
    """The visited tiles of each of the BH query heads (one list for all when dense) and the pairs whose block-mask
    entry each warp reads (the causal-limited set: lane 0 of every warp reads ``M`` once per pair)."""
    checked = tiles_visited(Nq, Nk, t["Br"], t["Bc"], causal, direction)
    if M is None:
        return [checked] * BH, 0
    memo = {}                                          # heads sharing one mask share one list
    for z in range(BH):
        key = M[z].tobytes()
        if key not in memo:
            memo[key] = tiles_visited(Nq, Nk, t["Br"], t["Bc"], causal, direction, M[z])
    return [memo[M[z].tobytes()] for z in range(BH)], len(checked)


def _launch_model(name, reads, writes, atomics=None, shared_reads=0, shared_writes=0):
    return dict(launch=name, reads={a: n for a, n in reads.items() if n}, writes={a: n for a, n in writes.items() if n},
                atomics={a: n for a, n in (atomics or {}).items() if n}, shared_reads=int(shared_reads),
                shared_writes=int(shared_writes))


def model_forward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None, block_mask=None, group=1,
                  storage="float32", score_mod=None):
    """Element accesses of :func:`forward` (one launch): Q, O, L once; K_j, V_j once per visited tile; with a block
    mask, one byte of ``M`` per warp per tile the causal limit lets a block reach (lane 0 reads, the warp shares) and
    no K/V for ``EMPTY`` tiles.  ``group`` (GQA) changes nothing: every query head's blocks stream their K/V head's
    tiles.  ``storage`` changes no element count (bytes: :func:`model_bytes`).  Dropout and modifiers move no memory
    (Philox in registers; captured modifier arrays are constants of the kernel); a ``score_mod`` only changes the
    default tiles (:func:`default_tiles`).

    Shared, per block: ``Br·Dp`` written (Q_i), then ``Br·Dp`` written and ``rows·d`` read back (O_i staged); per
    visited tile ``2·Bc·Dp`` written (K_j, V_j) and, per thread, ``Dp·(TM + TN)`` (line 8) and ``Bc·DN`` (line 10)
    read."""
    check_storage(storage)
    positive_int("group", group)
    t, M, _ = _mask_at_tiles("forward", d, Br, Bc, warps, block_mask, BH, Nq, Nk, scored=score_mod is not None)
    g = geometry(t["Br"], t["Bc"], d, t["warps"])
    per_head, checked = visited_per_head("forward", Nq, Nk, t, causal, M, BH)
    kv = sum(cols for visited in per_head for _, _, _, cols in visited) * d
    n = sum(len(visited) for visited in per_head)
    blocks_ = BH * cdiv(Nq, t["Br"])
    per_tile_reads = g["threads"] * (g["Dp"] * (g["TM"] + g["TN"]) + t["Bc"] * g["DN"])
    return [_launch_model("flash forward", {"Q": BH * Nq * d, "K": kv, "V": kv, "M": BH * checked * t["warps"]},
                          {"O": BH * Nq * d, "L": BH * Nq},
                          shared_reads=n * per_tile_reads + BH * Nq * d,
                          shared_writes=2 * blocks_ * t["Br"] * g["Dp"] + n * 2 * t["Bc"] * g["Dp"])]


def model_backward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None, block_mask=None, group=1,
                   storage="float32"):
    """Element accesses of :func:`backward`: the preprocessing launch (O, dO read; D, dQ = 0 written), then the main
    launch -- K_j, V_j once per block, i.e. once per *K/V* head (``group`` = BH_q / BH_kv query heads share them: GQA
    reads K, V and writes dK, dV once per group); Q_i, dO_i, L_i, D_i once per visited tile; ``rows·d`` atomic adds
    into dQ per visited tile; one byte of ``M`` per warp per reachable pair with a block mask; then, with half
    ``storage``, dQ read once and dQh written (:func:`make_convert`).

    Shared, per block: ``2·Bc·Dp`` written (K_j, V_j), then ``2·Bc·Dp`` written and ``2·keys·d`` read back (dK_j, dV_j
    staged).  Per visited tile: ``2·Br·Dp + 2·Br`` written (Q_i, dO_i, L_i, D_i) and ``Br·Bc`` (dS_ij); per thread
    ``2·Dp·(TM + TN)`` (lines 10, 13), ``2·TN`` (L, D), ``2·Br·DN`` (lines 12, 16) and ``Bc·(TQ + E)`` (line 15)
    read."""
    check_storage(storage)
    BHkv = BH // positive_int("group", group)
    t, M, _ = _mask_at_tiles("backward", d, Br, Bc, warps, block_mask, BH, Nq, Nk)
    Br_, Bc_ = t["Br"], t["Bc"]
    g = bwd_geometry(Br_, Bc_, d, t["warps"])
    per_head, checked = visited_per_head("backward", Nq, Nk, t, causal, M, BH)
    q_rows = sum(rows for visited in per_head for _, _, rows, _ in visited)
    n = sum(len(visited) for visited in per_head)
    blocks_ = BHkv * cdiv(Nk, Bc_)
    pre = _launch_model("D = rowsum(dO∘O)", {"O": BH * Nq * d, "dO": BH * Nq * d}, {"D": BH * Nq, "dQ": BH * Nq * d})
    per_tile_reads = g["threads"] * (2 * g["Dp"] * (g["TM"] + g["TN"]) + 2 * g["TN"] + 2 * Br_ * g["DN"]
                                     + Bc_ * (g["TQ"] + g["E"]))
    main = _launch_model("flash backward",
                         {"Q": q_rows * d, "K": BHkv * Nk * d, "V": BHkv * Nk * d, "dO": q_rows * d, "L": q_rows,
                          "D": q_rows, "M": BH * checked * t["warps"]},
                         {"dK": BHkv * Nk * d, "dV": BHkv * Nk * d}, {"dQ": q_rows * d},
                         shared_reads=n * per_tile_reads + 2 * BHkv * Nk * d,
                         shared_writes=blocks_ * 4 * Bc_ * g["Dp"] + n * (2 * Br_ * g["Dp"] + 2 * Br_ + Br_ * Bc_))
    if storage == "float32":
        return [pre, main]
    return [pre, main, _launch_model(f"dQ -> {storage}", {"dQ": BH * Nq * d}, {"dQh": BH * Nq * d})]


def itemsizes(storage="float32") -> dict:
    """Bytes per element of every global array the flash launches touch, by kernel parameter name: Q, K, V, O, dO, dK,
    dV and the converted dQh in ``storage`` (4 or 2 bytes); L, D and the dQ accumulator always 4; the block mask M 1."""
    h = storage_dtype(storage).itemsize
    return dict(Q=h, K=h, V=h, O=h, dO=h, dK=h, dV=h, dQh=h, L=4, D=4, dQ=4, M=1)


def model_bytes(model, storage="float32") -> list:
    """A traffic model (elements) in bytes at ``storage``: per launch ``dict(launch, read_bytes, write_bytes,
    atomic_bytes)``, each the sum of elements × :func:`itemsizes` (what the traffic counter reports)."""
    size = itemsizes(storage)
    return [dict(launch=m["launch"], read_bytes=sum(n * size[a] for a, n in m["reads"].items()),
                 write_bytes=sum(n * size[a] for a, n in m["writes"].items()),
                 atomic_bytes=sum(n * size[a] for a, n in m["atomics"].items())) for m in model]
