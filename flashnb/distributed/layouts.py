"""How a sequence of N tokens is split over the W ranks of a context-parallel group.

Every rank holds ``n = N / W`` tokens of Q, K and V, in the order given by :func:`positions`:

* ``"contiguous"`` -- rank ``r`` holds tokens ``r·n … (r+1)·n − 1``.  Simple, but with a causal mask the last
  rank's queries see every key and the first rank's see almost none: the ring waits on the busiest rank.
* ``"zigzag"`` -- the sequence is cut into ``2W`` equal chunks and rank ``r`` holds chunks ``r`` and
  ``2W − 1 − r``, in that order (Llama 3's split, zhuzilin/ring-flash-attention's ``zigzag``): a cheap early
  chunk and an expensive late one, so every rank attends the same number of pairs.
* ``"striped"`` -- rank ``r`` holds tokens ``r, r + W, r + 2W, …`` (Striped Attention, Brandon et al. 2023):
  each rank's tokens are spread over the whole sequence.

Within a rank, tokens are always in increasing global position, so a causal mask between any rank's queries
and any rank's keys keeps, in each query row, a *prefix* of the keys (:mod:`flashnb.distributed.blocks`
builds the block computations from that).
"""

from __future__ import annotations

import numpy as np

__all__ = ["LAYOUTS", "positions", "shard", "unshard", "check_layout", "check_split"]

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout) -> str:
    """``layout`` if it is one of :data:`LAYOUTS`, else ValueError naming it."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_rank_world(rank, world) -> tuple[int, int]:
    for name, value in (("world", world), ("rank", rank)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    world, rank = int(world), int(rank)
    if world < 1:
        raise ValueError(f"world must be >= 1 (the number of ranks), got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1} (world = {world}), got {rank}")
    return rank, world


def _parts(layout: str, world: int) -> int:
    """Equal parts the sequence is cut into: W, or 2W for zigzag."""
    return 2 * world if layout == "zigzag" else world


def check_split(N, layout: str, world: int) -> int:
    """``N`` if ``layout`` splits it over ``world`` ranks into equal shards, else ValueError saying why and
    naming the nearest lengths that do split (contiguous and striped: a multiple of W; zigzag: of 2W)."""
    layout = check_layout(layout)
    if isinstance(N, (bool, np.bool_)) or not isinstance(N, (int, np.integer)):
        raise TypeError(f"N (the sequence length) must be an int, got {N!r}")
    N, parts = int(N), _parts(layout, world)
    if N < parts or N % parts:
        below, above = (N // parts) * parts, (N // parts + 1) * parts
        near = f"{below} or {above}" if below >= parts else f"{above}"
        what = f"2W = {parts} equal chunks" if layout == "zigzag" else f"W = {parts} equal shards"
        raise ValueError(f"sequence length N = {N} cannot be split by layout {layout!r} over {world} ranks: it needs "
                         f"{what} (N a positive multiple of {parts}); use N = {near}")
    return N


def positions(N: int, layout: str, rank: int, world: int) -> np.ndarray:
    """The global token positions rank ``rank`` holds, in its local order (int64, increasing, length N/W)."""
    rank, world = _check_rank_world(rank, world)
    N = check_split(N, layout, world)
    n = N // world
    if layout == "contiguous":
        return np.arange(rank * n, (rank + 1) * n, dtype=np.int64)
    if layout == "zigzag":
        c = N // (2 * world)
        late = 2 * world - 1 - rank
        early = np.arange(rank * c, (rank + 1) * c, dtype=np.int64)
        return np.concatenate([early, np.arange(late * c, (late + 1) * c, dtype=np.int64)])
    return np.arange(rank, N, world, dtype=np.int64)


def _is_torch(x) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _axis(x, dim: int) -> int:
    if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"dim must be an int, got {dim!r}")
    ndim = x.dim() if _is_torch(x) else np.ndim(x)
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim = {dim} is out of range for an array of {ndim} dimensions")
    return int(dim) % ndim


def shard(x, *, layout: str, rank: int, world: int, dim: int = -2):
    """Rank ``rank``'s shard of ``x`` (a torch tensor or NumPy array holding all N tokens along ``dim``): the
    tokens :func:`positions` names, in that order, as a new contiguous tensor (array)."""
    axis = _axis(x, dim)
    N = x.shape[axis]
    pos = positions(N, layout, rank, world)
    if _is_torch(x):
        import torch

        return x.index_select(axis, torch.from_numpy(pos).to(x.device)).contiguous()
    return np.ascontiguousarray(np.take(np.asarray(x), pos, axis=axis))


def unshard(parts, *, layout: str, world: int, dim: int = -2):
    """The whole sequence from the ``world`` shards ``parts`` (in rank order), the inverse of :func:`shard`."""
    parts = list(parts)
    _check_rank_world(0, world)
    if len(parts) != world:
        raise ValueError(f"parts must hold one shard per rank ({world}), got {len(parts)}")
    axis = _axis(parts[0], dim)
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise ValueError(f"parts must all have one shape (N/W tokens along dim {dim}), got shapes {sorted(shapes)}")
    N = parts[0].shape[axis] * world
    order = np.argsort(np.concatenate([positions(N, layout, r, world) for r in range(world)]))
    if _is_torch(parts[0]):
        import torch

        whole = torch.cat(parts, dim=axis)
        return whole.index_select(axis, torch.from_numpy(order).to(whole.device)).contiguous()
    return np.ascontiguousarray(np.take(np.concatenate([np.asarray(p) for p in parts], axis=axis), order, axis=axis))
