"""The formulas of context parallelism, written from the schedules' definitions (tests hold the counted runs
to them): bytes per rank, attended pairs per rank and step, the K/V a rank holds, and when the transfers hide
behind the compute.

Notation: ``W`` ranks, ``N`` tokens, ``n = N/W`` per rank, batch ``B``, ``H`` query heads and ``H_kv`` K/V
heads of dimension ``d``; ``b`` bytes per element of K/V (dK/dV travel in float32: 4).

* One K/V message (a rank's shard): ``2·B·n·H_kv·d·b`` bytes.
* Ring forward, per rank: ``W − 1`` messages sent and received, ``(W−1)·2·B·n·H_kv·d·b``.
* Ring backward: the same K/V hops, plus dK/dV over ``W`` hops (the last one home): ``+ W·2·B·n·H_kv·d·4``.
* All-gather forward: the same ``(W−1)`` messages' payload, in one collective; backward: K/V gathered again
  plus a reduce-scatter of dK/dV, ``+ (W−1)·2·B·n·H_kv·d·4``.

Overlap (Liu et al. 2023, Ring Attention): a step computes ``c`` queries against ``c`` keys, ``4·c²·d·H`` FLOPs
(the FlashAttention benchmark's count), while ``2·c·d·H_kv·b`` bytes cross the link.  The transfer hides when
``4c²dH / F ≥ 2c·d·H_kv·b / B_link``, i.e. ``c ≥ (b·H_kv / (2H)) · F / B_link`` -- ``c ≥ F / B_link`` for bf16
(``b = 2``) and ``H_kv = H``.  The flop rate and link bandwidths here are datasheet values: a model, not a
measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layouts import check_layout, positions

__all__ = ["kv_message_bytes", "comm_bytes", "pairs_per_step", "brute_force_pairs", "imbalance", "step_imbalance",
           "imbalance_limit", "kv_bytes_held", "Link", "LINKS", "step_times", "min_block_tokens", "block_hbm_bytes"]


def kv_message_bytes(B: int, n: int, H_kv: int, d: int, itemsize: int = 4) -> int:
    """Bytes of one K/V shard as it travels: K and V, ``2·B·n·H_kv·d·itemsize``."""
    return 2 * B * n * H_kv * d * itemsize


def comm_bytes(mode: str, phase: str, W: int, B: int, n: int, H_kv: int, d: int, itemsize: int = 4) -> int:
    """Bytes one rank sends (and receives) in one phase ("forward" / "backward") of ``mode`` (module docstring)."""
    kv = kv_message_bytes(B, n, H_kv, d, itemsize)
    dkv = kv_message_bytes(B, n, H_kv, d, 4)
    if W == 1:
        return 0
    if phase == "forward":
        return (W - 1) * kv
    if mode == "ring":
        return (W - 1) * kv + W * dkv
    return (W - 1) * kv + (W - 1) * dkv


def pairs_per_step(layout: str, W: int, N: int, causal: bool) -> np.ndarray:
    """``(W ranks, W steps)``: the (query, key) pairs of one batch·head rank ``r`` attends at step ``t`` (the
    K/V of rank ``s = (r − t) mod W``), from the layout's definition.

    Non-causal: ``n²`` everywhere.  Causal, contiguous: ``n²`` when ``s < r`` (all of an earlier shard),
    ``n(n+1)/2`` when ``s = r`` (the diagonal), 0 when ``s > r``.  Zigzag (chunks of ``c = n/2``): step 0
    ``2c² + c`` (the two diagonal chunks and the late chunk against the early one), every other step ``2c²``
    (both query chunks against the earlier K/V chunk, or the late query chunk against both).  Striped:
    ``n(n+1)/2`` when ``s ≤ r``, ``n(n−1)/2`` when ``s > r`` (a diagonal one token lower)."""
    check_layout(layout)
    n = N // W
    out = np.zeros((W, W), dtype=np.int64)
    for r in range(W):
        for t in range(W):
            s = (r - t) % W
            if not causal:
                out[r, t] = n * n
            elif layout == "contiguous":
                out[r, t] = n * n if s < r else (n * (n + 1) // 2 if s == r else 0)
            elif layout == "zigzag":
                c = n // 2
                out[r, t] = 2 * c * c + c if s == r else 2 * c * c
            else:
                out[r, t] = n * (n + 1) // 2 if s <= r else n * (n - 1) // 2
    return out


def brute_force_pairs(layout: str, W: int, N: int, causal: bool) -> np.ndarray:
    """:func:`pairs_per_step` counted element by element from the positions (an independent check)."""
    out = np.zeros((W, W), dtype=np.int64)
    for r in range(W):
        qp = positions(N, layout, r, W)
        for t in range(W):
            kp = positions(N, layout, (r - t) % W, W)
            out[r, t] = int((kp[None, :] <= qp[:, None]).sum()) if causal else qp.size * kp.size
    return out


def imbalance(pairs: np.ndarray) -> float:
    """max over ranks / mean over ranks of the pairs each rank attends in total."""
    per_rank = np.asarray(pairs).sum(axis=1)
    return float(per_rank.max() / per_rank.mean())


def step_imbalance(pairs: np.ndarray) -> float:
    """The ring's critical path over the ideal: ``Σ_t max_r pairs[r, t]`` (every step waits for its busiest
    rank) over ``Σ pairs / W`` (all work spread evenly)."""
    pairs = np.asarray(pairs)
    return float(pairs.max(axis=0).sum() / (pairs.sum() / pairs.shape[0]))


def imbalance_limit(layout: str, W: int) -> float:
    """The causal imbalance for long shards (n → ∞): ``(2W − 1)/W`` contiguous, 1 for zigzag and striped."""
    check_layout(layout)
    return (2 * W - 1) / W if layout == "contiguous" else 1.0


def kv_bytes_held(mode: str, phase: str, W: int, B: int, n: int, H_kv: int, d: int, itemsize: int = 4) -> int:
    """The most K/V (and dK/dV) bytes a rank's schedule holds at once.  Ring: its K/V and the one arriving
    (backward: plus two dK/dV buffers) -- O(N/W); all-gather: all W shards (backward: plus every shard's
    dK/dV) -- O(N)."""
    kv = kv_message_bytes(B, n, H_kv, d, itemsize)
    dkv = kv_message_bytes(B, n, H_kv, d, 4)
    if mode == "ring":
        if W == 1:
            return kv + (dkv if phase == "backward" else 0)
        return 2 * kv + (2 * dkv if phase == "backward" else 0)
    return W * kv + (W * dkv if phase == "backward" else 0)


@dataclass(frozen=True)
class Link:
    """A link between two ranks: ``bandwidth`` in bytes/s, one direction (a ring sends one way)."""

    name: str
    bandwidth: float
    source: str


LINKS = {
    # NVIDIA H100 datasheet: NVLink 900 GB/s per GPU, both directions together (18 links of 50 GB/s).
    "NVLink 4 (H100 SXM)": Link("NVLink 4 (H100 SXM)", 450e9, "H100 datasheet: 900 GB/s bidirectional"),
    # NVIDIA ConnectX-7 / Quantum-2: InfiniBand NDR, 400 Gb/s per port and direction.
    "InfiniBand NDR (400 Gb/s)": Link("InfiniBand NDR (400 Gb/s)", 400e9 / 8, "NDR: 400 Gb/s per port"),
}


def step_times(c: int, d: int, H: int, H_kv: int, itemsize: int, flops: float, bandwidth: float):
    """``(compute seconds, transfer seconds)`` of one ring step with ``c`` tokens per block (module docstring)."""
    return 4.0 * c * c * d * H / flops, 2.0 * c * d * H_kv * itemsize / bandwidth


def min_block_tokens(flops: float, bandwidth: float, *, H: int = 1, H_kv: int = 1, itemsize: int = 2) -> float:
    """The smallest block (tokens per rank and step) whose compute hides its K/V transfer:
    ``(itemsize·H_kv / (2H)) · flops / bandwidth``."""
    return itemsize * H_kv / (2.0 * H) * flops / bandwidth


def block_hbm_bytes(blocks, B: int, H: int, H_kv: int, d: int, direction: str = "forward", **tiles) -> int:
    """HBM bytes flashnb's kernels move for a step's ``blocks`` (:func:`flashnb.distributed.blocks.plan`), from the
    product kernel's traffic model (:func:`flashnb.kernels.models.simt.model_forward` / ``model_backward``; ``tiles``:
    Br, Bc, warps)."""
    from ..kernels.models import simt as models

    model = models.model_forward if direction == "forward" else models.model_backward
    total = 0
    for b in blocks:
        for launch in models.model_bytes(model(B * H, b.rows, b.keys, d, causal=b.causal, group=H // H_kv, **tiles)):
            total += launch["read_bytes"] + launch["write_bytes"] + launch["atomic_bytes"]
    return total
