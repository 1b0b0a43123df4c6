"""Exercises of notebook 13 (context parallelism: layouts, the ring's causal work, its bytes, the overlap
condition).  The checks need no processes: the ground truth is the layouts' positions, masks counted element by
element, and :mod:`flashnb.distributed.model`'s formulas (which the tests hold to counted ring runs)."""

from __future__ import annotations

import numpy as np

from . import Wrong, exercise, require

# --------------------------------------------------------------------------- 13.1


@exercise("13.1", "the zigzag layout", level=1, minutes=5,
          hint="""Cut the N tokens into 2W chunks of c = N / (2W). Rank r takes chunk r, then chunk 2W - 1 - r,
          each chunk's tokens in increasing order.""",
          explain="""Pairing chunk r (early: its queries see few keys under a causal mask) with chunk 2W - 1 - r
          (late: they see many) gives every rank the same amount of causal work. Keeping the two chunks in
          increasing order keeps the rank's positions sorted, so a whole step-0 block is one causal diagonal.""")
def check_13_1(zigzag):
    """zigzag(N, rank, world) -> the global token positions rank ``rank`` holds (a list or array, local order)."""
    from ..distributed import positions

    require(callable(zigzag), "zigzag must be a function (N, rank, world) -> positions")
    for N, W in ((8, 2), (12, 3), (32, 4)):
        for r in range(W):
            got = np.asarray(zigzag(N, r, W)).ravel().tolist()
            want = positions(N, "zigzag", r, W).tolist()
            if sorted(got) != sorted(want):
                raise Wrong(f"N = {N}, W = {W}, rank {r}: you give the tokens {got}, which are not the two chunks that "
                            "rank holds")
            if got != want:
                raise Wrong(f"N = {N}, W = {W}, rank {r}: the right tokens, in the wrong order (chunk r comes first, "
                            "each chunk in increasing order)")


@check_13_1.solves
def _():
    def zigzag(N, rank, world):
        c = N // (2 * world)
        late = 2 * world - 1 - rank
        return list(range(rank * c, (rank + 1) * c)) + list(range(late * c, (late + 1) * c))

    return dict(zigzag=zigzag)


@check_13_1.fails
def _():
    def zigzag(N, rank, world):                       # chunk W - 1 - r: the mirror inside the first half
        c = N // (2 * world)
        other = world - 1 - rank
        return list(range(rank * c, (rank + 1) * c)) + list(range(other * c, (other + 1) * c))

    return dict(zigzag=zigzag)


# --------------------------------------------------------------------------- 13.2


@exercise("13.2", "the diagonal of a striped step", level=1, minutes=10,
          hint="""Rank r holds tokens r + iW (i = 0, 1, ...), rank s tokens s + jW. Key j is visible to query i when
          s + jW <= r + iW. Solve for j, and remember j and i are integers.""",
          explain="""s + jW <= r + iW means j <= i + (r - s)/W, and |r - s| < W: the keys up to j = i are visible when
          s <= r (offset 0), only those up to j = i - 1 when s > r (offset -1). Every step of a striped ring is one
          causal block, its diagonal on or one below the main one, so every rank attends about n²/2 pairs at every
          step: the balance of the layout. flashnb computes the offset -1 block as a bottom-right causal block on the
          first n - 1 keys (flashnb.distributed.blocks.plan).""")
def check_13_2(striped_offset):
    """striped_offset(rank, src, world) -> the integer ``o`` such that, with the striped layout, query row ``i`` of
    rank ``rank`` may attend to key row ``j`` of rank ``src`` exactly when ``j <= i + o`` (causal mask)."""
    from ..distributed import positions

    require(callable(striped_offset), "striped_offset must be a function (rank, src, world) -> offset")
    for W in (2, 3, 5):
        N = 4 * W
        for r in range(W):
            qp = positions(N, "striped", r, W)
            for s in range(W):
                kp = positions(N, "striped", s, W)
                got = striped_offset(r, s, W)
                require(isinstance(got, (int, np.integer)), f"the offset must be an int, got {got!r}")
                i, j = np.arange(qp.size)[:, None], np.arange(kp.size)[None, :]
                if not np.array_equal(j <= i + int(got), kp[None, :] <= qp[:, None]):
                    raise Wrong(f"W = {W}, rank {r}, src {s}: j <= i + ({got}) is not the causal mask of those "
                                "positions")


@check_13_2.solves
def _():
    def striped_offset(rank, src, world):
        return 0 if src <= rank else -1

    return dict(striped_offset=striped_offset)


@check_13_2.fails
def _():
    def striped_offset(rank, src, world):             # the contiguous layout's answer
        return 0

    return dict(striped_offset=striped_offset)


# --------------------------------------------------------------------------- 13.3


@exercise("13.3", "causal work per rank and step", level=2, minutes=20,
          hint="""At step t rank r holds the K/V of rank s = (r - t) mod W. With contiguous shards of n tokens,
          count the pairs key <= query for s < r, s = r and s > r; with zigzag (two chunks of c = n/2) do the same for
          each of the four chunk pairs.""",
          explain="""Contiguous: n² when s < r (an earlier shard: everything visible), n(n+1)/2 on the diagonal, 0
          when s > r. Rank W-1 attends (W-1)n² + n(n+1)/2 pairs, the mean rank about half the off-diagonal work, so
          max/mean -> (2W-1)/W: 1.75 at W = 4. Every ring step lasts as long as its busiest rank, and with contiguous
          shards some rank computes a full n² block at every step but the first. Zigzag: 2c² + c at step 0 and 2c²
          at every other step, on every rank: max/mean = 1.""")
def check_13_3(pairs):
    """pairs(layout, W, N) -> a (W, W) array: the (query, key) pairs of one head rank r attends at step t
    (causal mask of global positions), for layout "contiguous" or "zigzag"."""
    from ..distributed import model

    require(callable(pairs), "pairs must be a function (layout, W, N) -> (W, W) array")
    for layout in ("contiguous", "zigzag"):
        for W, N in ((2, 8), (3, 12), (4, 32)):
            want = model.brute_force_pairs(layout, W, N, True)
            got = np.asarray(pairs(layout, W, N))
            require(got.shape == want.shape, f"{layout}, W = {W}: the array must have shape {want.shape}, got "
                                             f"{got.shape}")
            if not np.array_equal(got, want):
                r, t = np.argwhere(got != want)[0]
                raise Wrong(f"{layout}, W = {W}, N = {N}: rank {r} at step {t} (the K/V of rank {(r - t) % W}) -- "
                            f"you count {got[r, t]}, the mask has {'more' if want[r, t] > got[r, t] else 'fewer'}")


@check_13_3.solves
def _():
    def pairs(layout, W, N):
        n = N // W
        c = n // 2
        out = np.zeros((W, W), dtype=int)
        for r in range(W):
            for t in range(W):
                s = (r - t) % W
                if layout == "contiguous":
                    out[r, t] = n * n if s < r else (n * (n + 1) // 2 if s == r else 0)
                else:
                    out[r, t] = 2 * c * c + c if s == r else 2 * c * c
        return out

    return dict(pairs=pairs)


@check_13_3.fails
def _():
    def pairs(layout, W, N):                          # the diagonal block counted as full (no mask)
        n = N // W
        out = np.zeros((W, W), dtype=int)
        for r in range(W):
            for t in range(W):
                s = (r - t) % W
                out[r, t] = n * n if (s <= r or layout == "zigzag") else 0
        return out

    return dict(pairs=pairs)


# --------------------------------------------------------------------------- 13.4


@exercise("13.4", "the ring's bytes", level=1, minutes=10,
          hint="""A rank's K/V shard is 2 (K and V) · B · n · H_kv · d elements. The forward passes it W - 1 hops.
          The backward passes K/V the same W - 1 hops, and the dK/dV (float32, 4 bytes) of each shard follow it for
          W hops: the last one brings it home.""",
          explain="""Forward: (W-1)·2·B·n·H_kv·d·b bytes per rank, independent of the layout and of the causal mask
          (a ring sends every shard everywhere, whether it is needed or not). Backward: the same plus
          W·2·B·n·H_kv·d·4 for dK/dV. Grouped-query attention shrinks both by H/H_kv: the queries never travel. The
          tests count these bytes from the tensors the ring hands to torch.distributed.""")
def check_13_4(ring_bytes):
    """ring_bytes(phase, W, B, N, H_kv, d, itemsize) -> bytes one rank sends in the ring's ``phase``
    ("forward" or "backward"), K/V stored at ``itemsize`` bytes per element."""
    from ..distributed import model

    require(callable(ring_bytes), "ring_bytes must be a function (phase, W, B, N, H_kv, d, itemsize) -> bytes")
    for phase in ("forward", "backward"):
        for W, B, N, H_kv, d, b in ((2, 1, 16, 1, 8, 4), (4, 2, 64, 2, 16, 2), (8, 1, 4096, 8, 128, 2)):
            want = model.comm_bytes("ring", phase, W, B, N // W, H_kv, d, b)
            got = ring_bytes(phase, W, B, N, H_kv, d, b)
            if got != want:
                raise Wrong(f"{phase}, W = {W}, B = {B}, N = {N}, H_kv = {H_kv}, d = {d}, itemsize = {b}: you say "
                            f"{got!r} bytes, the ring sends {'more' if want > got else 'fewer'}")


@check_13_4.solves
def _():
    def ring_bytes(phase, W, B, N, H_kv, d, itemsize):
        n = N // W
        kv = 2 * B * n * H_kv * d
        return (W - 1) * kv * itemsize + (W * kv * 4 if phase == "backward" else 0)

    return dict(ring_bytes=ring_bytes)


@check_13_4.fails
def _():
    def ring_bytes(phase, W, B, N, H_kv, d, itemsize):   # dK/dV counted W - 1 hops (the hop home forgotten)
        kv = 2 * B * (N // W) * H_kv * d
        return (W - 1) * kv * itemsize + ((W - 1) * kv * 4 if phase == "backward" else 0)

    return dict(ring_bytes=ring_bytes)


# --------------------------------------------------------------------------- 13.5


def _crossing(flops, bandwidth, itemsize, H, H_kv):
    """The smallest block c whose modelled compute time reaches its transfer time, found by bisection on
    :func:`flashnb.distributed.model.step_times` (d cancels)."""
    from ..distributed import model

    lo, hi = 1e-6, 1e9
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        compute, transfer = model.step_times(mid, 64, H, H_kv, itemsize, flops, bandwidth)
        lo, hi = (mid, hi) if compute < transfer else (lo, mid)
    return hi


@exercise("13.5", "when the transfers hide", level=2, minutes=15,
          hint="""One ring step computes c queries against c keys: 4·c²·d·H FLOPs (two matmuls of 2·c²·d each, per
          query head). Meanwhile 2·c·d·H_kv·itemsize bytes of K/V cross the link. Set the two times equal.""",
          explain="""4c²dH/F = 2c·d·H_kv·b/B gives c = (b·H_kv/(2H))·F/B: with bf16 (b = 2) and H_kv = H, c = F/B
          (Liu et al.'s condition). On one H100's dense bf16 rate, NVLink needs blocks of a few thousand tokens per
          rank and InfiniBand of tens of thousands; grouped-query attention divides both by H/H_kv. The condition
          counts the forward; the backward computes 2.5x more for 2-3x the bytes, so it hides about as well.""")
def check_13_5(min_tokens):
    """min_tokens(flops, bandwidth, itemsize, H, H_kv) -> the smallest number of tokens per rank and step whose
    modelled compute time (FLOPs / ``flops``) is at least its K/V transfer time (bytes / ``bandwidth``)."""
    require(callable(min_tokens), "min_tokens must be a function (flops, bandwidth, itemsize, H, H_kv) -> tokens")
    for flops, bw, b, H, H_kv in ((989.5e12, 450e9, 2, 32, 32), (989.5e12, 50e9, 2, 32, 8), (67e12, 50e9, 4, 8, 1)):
        want = _crossing(flops, bw, b, H, H_kv)
        got = min_tokens(flops, bw, b, H, H_kv)
        try:
            ok = abs(float(got) - want) <= 1e-6 * want
        except (TypeError, ValueError):
            raise Wrong(f"min_tokens must return a number, got {got!r}") from None
        if not ok:
            raise Wrong(f"F = {flops:.4g} FLOP/s, B = {bw:.4g} B/s, itemsize {b}, H = {H}, H_kv = {H_kv}: your block "
                        f"is too {'small' if float(got) < want else 'large'}")


@check_13_5.solves
def _():
    def min_tokens(flops, bandwidth, itemsize, H, H_kv):
        return itemsize * H_kv / (2 * H) * flops / bandwidth

    return dict(min_tokens=min_tokens)


@check_13_5.fails
def _():
    def min_tokens(flops, bandwidth, itemsize, H, H_kv):   # F/B, true only for bf16 and H_kv = H
        return flops / bandwidth

    return dict(min_tokens=min_tokens)
