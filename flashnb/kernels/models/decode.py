"""Flash-decoding's models (:mod:`flashnb.kernels.decode`, launched by :mod:`flashnb.kernels.launch.decode`):
:func:`model_forward` (element accesses per launch, equal to the traffic counter's) and :func:`modelled_time` (a
per-SM roofline that sees idle SMs; **modelled, not measured**), with :func:`fa2_modelled_time` for the comparison
with FA2's forward."""

from __future__ import annotations

import heapq

from ...common import causal_diag, cdiv, positive_int
from ...instruments import roofline
from ...reference import check_causal
from ...stages import fa2
from ..decode import WARP
from ..launch.decode import _check_warps, _row_blocks, chunk_length, default_splits

__all__ = ["model_forward", "launch_blocks", "modelled_time", "fa2_modelled_time"]


def _launch(name, reads, writes, shared_reads, shared_writes):
    return dict(launch=name, reads={a: n for a, n in reads.items() if n},
                writes={a: n for a, n in writes.items() if n}, atomics={},
                shared_reads=int(shared_reads), shared_writes=int(shared_writes))


def _split_blocks(Nq, length, causal, S, Bc, group=1):
    """``[(s, b, rows, keys)]`` per block of one K/V head: its valid rows (of the ``group·Nq`` sharing the K/V
    head) and the keys its chunk reads (``hi - lo``), in launch order (x fastest)."""
    diag = causal_diag(causal, Nq, length)
    NQ, n_blocks = _row_blocks(Nq, group)
    F = group * Nq
    chunk = chunk_length(length, S, Bc)
    out = []
    for b in range(n_blocks):
        f0, f1 = b * NQ, min(b * NQ + NQ, F) - 1
        q_hi = Nq if f1 // Nq > f0 // Nq else f1 % Nq + 1     # one past the last query of these rows
        for s in range(S):
            lo = s * chunk
            hi = min(lo + chunk, length)
            if causal:
                hi = min(hi, q_hi + diag)
            out.append((s, b, f1 - f0 + 1, max(0, hi - lo)))
    return out


def _plan(BH, Nq, length, d, causal, num_splits, warps, gpu, group):
    causal = check_causal(causal, Nq, length)
    if BH % positive_int("group", group):
        raise ValueError(f"group={group} must divide batch·heads = {BH}")
    NQ, _ = _row_blocks(Nq, group)
    warps = _check_warps(warps, d, NQ)
    S = default_splits(BH, Nq, length, d, warps, gpu, group=group) if num_splits is None \
        else positive_int("num_splits", num_splits)
    return causal, NQ, warps, S


def model_forward(BH, Nq, Nk, d, *, causal=False, num_splits=None, warps=None, gpu="H100 SXM", group=1):
    """Element accesses of :func:`decode` with ``Nk`` = the cache length (two launches).

    Split: every block reads its group's Q rows and the keys of its chunk once (K and V: ``(hi - lo)·d``, V
    straight from HBM), writes ``O_part``, ``L_part`` rows; shared: ``Q_i`` written (NQ·d), per tile ``K_j``
    written (Bc·d) and read by every thread (d, plus NQ·d of ``Q_i``), then the warps' states written
    (2·warps·NQ + warps·NQ·Dp) and read 4·warps times per output element.  Merge: ``L_part`` read twice, ``O_part``
    once, O and L written; shared: 2 writes and 64 reads per row (:func:`flashnb.stages.softmax.warp_reduce_state`).
    ``group`` (GQA, ``BH_q / BH_kv``): the blocks run per K/V head, each on up to 8 of the ``group·Nq`` rows that
    share it, so K and V are read once per K/V head and chunk (per 8 rows)."""
    causal, NQ, warps, S = _plan(BH, Nq, Nk, d, causal, num_splits, warps, gpu, group)
    Bc, Dp = WARP * warps, WARP * cdiv(d, WARP)
    blocks = _split_blocks(Nq, Nk, causal, S, Bc, group)
    BHkv = BH // group
    keys = sum(kk for *_, kk in blocks)
    tiles = sum(cdiv(kk, Bc) for *_, kk in blocks)
    n = len(blocks)
    split = _launch("split-KV partials", {"Q": BH * S * Nq * d, "K": BHkv * keys * d, "V": BHkv * keys * d},
                    {"O_part": BH * S * Nq * d, "L_part": BH * S * Nq},
                    BHkv * (tiles * Bc * d * (NQ + 1) + n * NQ * d * 4 * warps),
                    BHkv * (n * NQ * d + tiles * Bc * d + n * warps * NQ * (2 + Dp)))
    merge = _launch("merge splits", {"O_part": BH * Nq * S * d, "L_part": 2 * BH * Nq * S},
                    {"O": BH * Nq * d, "L": BH * Nq}, BH * Nq * 2 * WARP, BH * Nq * 2)
    return [split, merge]


def launch_blocks(BH, Nq, Nk, d, *, causal=True, num_splits=None, warps=None, gpu="H100 SXM", group=1) -> dict:
    """Thread blocks of each launch of :func:`decode`: ``{"split-KV partials": S · BH_kv · ceil(group·Nq / 8),
    "merge splits": Nq · BH}``."""
    causal, NQ, warps, S = _plan(BH, Nq, Nk, d, causal, num_splits, warps, gpu, group)
    return {"split-KV partials": S * (BH // group) * _row_blocks(Nq, group)[1], "merge splits": Nq * BH}


def _schedule(blocks, g) -> tuple[float, int]:
    """Per-SM roofline: each SM gets ``1/SMs`` of the HBM bandwidth and of the FP32 peak; a block lasts
    ``max(bytes / its bandwidth, FLOPs / its peak)``; blocks go, in launch order, to the SM that frees first.
    Returns (seconds until the last SM is done, SMs that get a block)."""
    bw, peak = g.hbm_bandwidth / g.sm_count, g.fp32_peak / g.sm_count
    heap = [0.0] * g.sm_count
    for nbytes, flops in blocks:
        heapq.heappush(heap, heapq.heappop(heap) + max(nbytes / bw, flops / peak))
    return max(heap), min(len(blocks), g.sm_count)


def modelled_time(BH, Nq, Nk, d, *, causal=True, num_splits=None, warps=None, gpu="H100 SXM", group=1) -> dict:
    """**Modelled, not measured**: :func:`decode`'s time on ``gpu`` by a per-SM roofline (see ``_schedule``:
    one SM is assumed to reach only its share of the bandwidth, so idle SMs cost time; launch overhead, caches
    and latency are left out).  Per block: HBM bytes of its own accesses (as :func:`model_forward` counts
    them), FLOPs ``4·d·rows·keys`` (the scores it computes, masked or not).  Returns blocks, busy SMs, bytes,
    seconds of each launch and in all (the two launches run one after the other)."""
    g = roofline.get_gpu(gpu)
    causal, NQ, warps, S = _plan(BH, Nq, Nk, d, causal, num_splits, warps, gpu, group)
    split = [(4 * (2 * rows * d + rows + 2 * keys * d), 4 * d * rows * keys)
             for _ in range(BH // group) for _, _, rows, keys in _split_blocks(Nq, Nk, causal, S, WARP * warps, group)]
    merge = [(4 * (2 * S + S * d + d + 1), 2 * S * d)] * (BH * Nq)
    t_split, busy_split = _schedule(split, g)
    t_merge, busy_merge = _schedule(merge, g)
    return dict(impl="flash-decoding", num_splits=S, blocks=len(split) + len(merge), split_blocks=len(split),
                merge_blocks=len(merge), busy_sms=busy_split, sms=g.sm_count,
                bytes=sum(b for b, _ in split) + sum(b for b, _ in merge),
                seconds=t_split + t_merge, split_seconds=t_split, merge_seconds=t_merge, gpu=g.name,
                kind="modelled")


def fa2_modelled_time(BH, Nq, Nk, d, *, causal=True, gpu="H100 SXM", Br=None, Bc=None, warps=None) -> dict:
    """FA2's forward (:mod:`flashnb.stages.fa2`, default tiles) by the same per-SM roofline as :func:`modelled_time`:
    one block per ``Br`` query rows of each head, each reading Q_i, its visited K/V tiles, writing O_i, L_i."""
    g = roofline.get_gpu(gpu)
    causal = check_causal(causal, Nq, Nk)
    t = fa2.default_tiles(d)
    Br, Bc = Br or t["Br"], Bc or t["Bc"]
    per_block = {}
    for i, _, rows, cols in fa2.tiles_visited(Nq, Nk, Br, Bc, causal):
        per_block[i] = per_block.get(i, 0) + cols
    blocks = []
    for _ in range(BH):
        for i in range(cdiv(Nq, Br)):
            rows, cols = min(Br, Nq - i * Br), per_block.get(i, 0)
            blocks.append((4 * (2 * rows * d + rows + 2 * cols * d), 4 * d * rows * cols))
    seconds, busy = _schedule(blocks, g)
    return dict(impl="fa2", blocks=len(blocks), busy_sms=busy, sms=g.sm_count, bytes=sum(b for b, _ in blocks),
                seconds=seconds, gpu=g.name, kind="modelled")
