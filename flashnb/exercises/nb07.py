"""Exercises of notebook 07 (block-sparse FlashAttention: skip the tiles a mask zeroes)."""

from __future__ import annotations

import functools

import numpy as np

from . import Wrong, close, exercise, require


def _as_mask(rows):
    return np.array(rows, dtype=bool)


# --------------------------------------------------------------------------- 07.1

_COUNTED = [(_as_mask([[1, 0], [1, 1]]), 16, 1), (_as_mask([[0, 1, 0], [0, 0, 0]]), 16, 2)]


@functools.lru_cache(maxsize=None)
def _counted_mask_reads(i):
    """Reads of M that the traffic counter sees in fa2's block-sparse forward for _COUNTED[i] (non-causal)."""
    from .. import api
    from ..instruments import traffic
    from ..stages.block_sparse import BlockMask

    mask, B, warps = _COUNTED[i]
    Tr, Tc = mask.shape
    rng = np.random.default_rng(71 + i)
    q = rng.standard_normal((1, Tr * B, 8))
    k, v = (rng.standard_normal((1, Tc * B, 8)) for _ in range(2))
    with traffic.count() as t:
        api.attention_forward(q, k, v, impl="fa2", block_mask=BlockMask(mask, B, B), Br=B, Bc=B, warps=warps)
    return t.totals_by_array()["M"]["reads"]


def _csr_reads(mask, warps):
    mask = np.asarray(mask, dtype=bool)
    return warps * (2 * mask.shape[0] + int(mask.sum()))


@exercise("07.1", "the mask term: dense layout vs CSR", level=2, minutes=20,
          hint="""In the forward, lane 0 of every warp reads M[z, i, j] once per tile the loop reaches -- look at the
          kernel's region block-skip: show_source(fa2.make_forward, region="block-skip"). Count it with
          traffic.count() (totals_by_array()["M"]).
          For CSR: block row i's warps read row_ptr[i] and row_ptr[i + 1], then one column index per nonzero block of
          the row (and never look at the zero blocks).""",
          explain="""Today every warp reads M_ij for every tile (i, j) the causal limit lets it reach, zero or not:
          warps·Tr·Tc reads per head (non-causal), independent of s. With CSR the loop runs over the nonzero blocks
          only -- `for p in range(row_ptr[i], row_ptr[i + 1]): j = col_idx[p]` -- so each warp reads 2 row pointers
          and one index per nonzero block: warps·(2·Tr + s·Tr·Tc), a term ∝ s plus one ∝ Tr. Both are tiny next to the
          Q/K/V/O traffic (a byte per tile against Bc·d floats), which is why the kernel keeps the dense layout: it
          matters only when the mask is very sparse and very large (e.g. many heads with their own masks).""")
def check_07_1(mask_reads_now, mask_reads_csr):
    """mask_reads_now(mask, warps), mask_reads_csr(mask, warps): reads of the block mask per head in fa2's
    non-causal block-sparse forward, today and with a CSR layout (mask: a bool (Tr, Tc) array at the kernel's
    tiles; warps: warps per thread block)."""
    require(callable(mask_reads_now) and callable(mask_reads_csr),
            "mask_reads_now and mask_reads_csr must be functions (mask, warps) -> a number")
    for i, (mask, _, warps) in enumerate(_COUNTED):
        close(mask_reads_now(mask.copy(), warps), _counted_mask_reads(i),
              what=f"mask_reads_now for a {mask.shape[0]}x{mask.shape[1]} mask with {int(mask.sum())} nonzero "
                   f"block(s), warps = {warps}")
    rng = np.random.default_rng(70)
    masks = [m for m, _, _ in _COUNTED] + [rng.random((Tr, Tc)) < s for Tr, Tc, s in [(8, 8, 0.3), (16, 4, 0.1)]]
    for mask in masks:
        for warps in (1, 4):
            close(mask_reads_csr(mask.copy(), warps), _csr_reads(mask, warps),
                  what=f"mask_reads_csr for a {mask.shape[0]}x{mask.shape[1]} mask with {int(mask.sum())} nonzero "
                       f"block(s), warps = {warps}")


@check_07_1.solves
def _():
    def mask_reads_now(mask, warps):
        Tr, Tc = mask.shape
        return warps * Tr * Tc            # lane 0 of every warp reads M_ij for every tile, zero or not

    def mask_reads_csr(mask, warps):
        Tr, _ = mask.shape
        return warps * (2 * Tr + int(mask.sum()))   # row_ptr[i], row_ptr[i+1], then one index per nonzero

    return dict(mask_reads_now=mask_reads_now, mask_reads_csr=mask_reads_csr)


@check_07_1.fails
def _():
    return dict(mask_reads_now=lambda mask, warps: warps * int(mask.sum()),       # as if zeros were never read
                mask_reads_csr=lambda mask, warps: warps * int(mask.sum()))       # row pointers forgotten


# --------------------------------------------------------------------------- 07.2


@exercise("07.2", "query blocks with no nonzero block", level=1, minutes=15,
          hint="""A query row with no allowed key has L = -inf in
          reference.attention_forward(..., mask=bm.expand(N, N)). The skipped blocks no longer read Q_i, but
          their rows of O and L still have to be written (O = 0, L = -inf) -- by a fill kernel, or by the block
          itself before it returns.""",
          explain="""Skipping an empty query block saves its Q_i reads only: O_i = 0 and L_i = -inf must still reach
          HBM (the backward and the user read them), so the writes stay -- moved to a fill kernel or done by the
          block right before it exits (which is what the kernel already does after an empty loop). The Nd term
          shrinks by (rows in empty block rows)·d out of 2·Nq·d + Nq. For `bs.local` every block row contains its
          diagonal block, so nothing is saved at all: the optimisation only pays for masks with empty rows
          (e.g. random ones at low density), and there it is at most a third of the Nd term.""")
def check_07_2(q_reads_saved, local_saved):
    """q_reads_saved(mask, Br, Nq, d): Q elements (one head) no longer read when the forward skips query blocks
    with no nonzero block (mask: bool (Tr, Tc), non-causal); local_saved: the same for
    bs.local(1024, 1024, 64, 64, window=2).mask at d = 64."""
    from .. import reference
    from ..stages import block_sparse as bs

    require(callable(q_reads_saved), "q_reads_saved must be a function (mask, Br, Nq, d) -> a number")
    rng = np.random.default_rng(72)
    for Nq, Nk, B, d, density in [(96, 96, 16, 8, 0.2), (72, 48, 16, 4, 0.3), (64, 64, 8, 16, 0.08)]:
        bm = bs.random(Nq, Nk, B, B, density, seed=int(rng.integers(1000)))
        q, k, v = rng.standard_normal((Nq, d)), rng.standard_normal((Nk, d)), rng.standard_normal((Nk, d))
        _, lse = reference.attention_forward(q, k, v, mask=bm.expand(Nq, Nk))
        truth = int(np.isneginf(lse).sum()) * d           # rows with no key = rows of the empty block rows
        close(q_reads_saved(bm.mask.copy(), B, Nq, d), truth,
              what=f"q_reads_saved for a random {bm.mask.shape[0]}x{bm.mask.shape[1]} mask "
                   f"(Br = {B}, Nq = {Nq}, d = {d})")
    close(local_saved, 0, what="local_saved")


@check_07_2.solves
def _():
    import numpy as np

    def q_reads_saved(mask, Br, Nq, d):
        empty = np.flatnonzero(~mask.any(axis=1))             # query blocks with no nonzero block
        rows = sum(min(Br, Nq - i * Br) for i in empty)       # the last block may be cut at Nq
        return rows * d                                       # Q_i not read; O_i, L_i still written

    from flashnb.stages import block_sparse as bs

    local = bs.local(1024, 1024, 64, 64, 2).mask
    return dict(q_reads_saved=q_reads_saved, local_saved=q_reads_saved(local, 64, 1024, 64))


@check_07_2.fails
def _():
    def saves_writes_too(mask, Br, Nq, d):                    # O and L rows "saved" as well: nobody writes them
        return int((~mask.any(axis=1)).sum()) * Br * (2 * d + 1)

    return dict(q_reads_saved=saves_writes_too, local_saved=0)


# --------------------------------------------------------------------------- 07.3


def _block_tiles_128(direction):
    from ..stages import fa2
    from ..stages.block_sparse import local

    bm = local(256, 256, 128, 128, window=1)
    t, _ = fa2.block_tiles(64, direction, None, None, None, bm, 1, 256, 256)
    return t["Br"], t["Bc"]


@exercise("07.3", "a mask at 128 x 128 tiles, kernels at d = 64", level=1, minutes=10,
          hint="""Build bm = bs.local(256, 256, 128, 128) and ask
          fa2.block_tiles(64, direction, None, None, None, bm, 1, 256, 256) for "forward" and "backward" (its
          docstring says how it picks). Then try flashnb.attention_forward(..., impl="fa2", block_mask=bm, Br=48)
          on (256, 64) inputs.""",
          explain="""The kernels keep their own default tiles when those divide the mask's: the forward runs at
          Br = 64, Bc = 32 and the backward at 32 × 32, each mask entry repeated over the 2 × 4 (or 4 × 4) kernel tiles
          inside its block. A kernel tile must lie inside one mask block: the kernel skips or computes whole tiles,
          so a tile straddling a zero and a nonzero block could only be computed in full (keys of the zero block
          would leak in) or skipped in full (keys of the nonzero block lost). Br = 48 does not divide 128, and the
          launcher refuses with a ValueError instead of computing the wrong attention.""")
def check_07_3(forward_tiles, backward_tiles, Br48_raises):
    """forward_tiles, backward_tiles: (Br, Bc) the fa2 forward and backward run at, d = 64, with a block mask built
    for 128 x 128 tiles (N = 256); Br48_raises: does the forward refuse Br = 48 with that mask?"""
    from ..stages import fa2
    from ..stages.block_sparse import local

    for name, yours, direction in (("forward_tiles", forward_tiles, "forward"),
                                   ("backward_tiles", backward_tiles, "backward")):
        try:
            pair = tuple(int(x) for x in yours)
        except (TypeError, ValueError):
            raise Wrong(f"{name} must be a pair (Br, Bc)") from None
        require(pair == _block_tiles_128(direction), f"{name} is not the tiles the {direction} runs at")
    try:
        fa2.block_tiles(64, "forward", 48, None, None, local(256, 256, 128, 128, window=1), 1, 256, 256)
        raises = False
    except ValueError:
        raises = True
    require(isinstance(Br48_raises, (bool, np.bool_)), "Br48_raises must be True or False")
    require(bool(Br48_raises) == raises, "Br48_raises is not right: try it")


@check_07_3.solves
def _():
    import numpy as np

    import flashnb
    from flashnb.stages import block_sparse as bs
    from flashnb.stages import fa2

    bm = bs.local(256, 256, 128, 128)
    fwd, _ = fa2.block_tiles(64, "forward", None, None, None, bm, 1, 256, 256)
    bwd, _ = fa2.block_tiles(64, "backward", None, None, None, bm, 1, 256, 256)
    q = np.zeros((256, 64))
    try:
        flashnb.attention_forward(q, q, q, impl="fa2", block_mask=bm, Br=48)
        raises = False
    except ValueError:                 # "the fa2 forward tiles Br=48, Bc=32 must divide them"
        raises = True
    return dict(forward_tiles=(fwd["Br"], fwd["Bc"]), backward_tiles=(bwd["Br"], bwd["Bc"]), Br48_raises=raises)


@check_07_3.fails
def _():
    return dict(forward_tiles=(128, 128), backward_tiles=(128, 128), Br48_raises=False)   # the mask's tiles


# --------------------------------------------------------------------------- 07.4


@functools.lru_cache(maxsize=None)
def _butterfly_vs_local():
    """The true answers: the worked answer below computes them from the library's masks and models."""
    got = check_07_4.solution()
    return got["s_butterfly"], got["window"], got["traffic_ratio"]


@exercise("07.4", "butterfly vs local at the same density", level=2, minutes=15,
          hint="""bs.butterfly(4096, 4096, 64, 64).density is s. Try bs.local(4096, 4096, 64, 64, w, causal=False) for
          w = 1, 2, ... and keep the w whose density is closest. fa2.model_forward(1, 4096, 4096, 64, block_mask=bm)
          gives each one's modelled traffic (sum its reads and writes).""",
          explain="""The flat butterfly keeps log2(64) + 1 = 7 blocks per block row (s = 7/64 ≈ 0.11), as does a
          non-causal local window of 4 blocks (the diagonal ± 3; a little less at the edges). Their modelled traffic
          is within a few percent: Proposition 4's Θ(Nd + N²d²s/M) depends on s, not on where the blocks are. On the
          "positional" input, whose attention mass sits near the diagonal, the local window keeps the blocks that
          carry the mass and should be the closer approximation; the butterfly spends most of its blocks on far-away
          keys (distance 1, 2, 4, ... 32 blocks), which pays off when information must travel far in few layers, not
          for a single layer's approximation error.""")
def check_07_4(s_butterfly, window, traffic_ratio):
    """s_butterfly: density of bs.butterfly(4096, 4096, 64, 64); window: the non-causal local window with the
    closest density; traffic_ratio: butterfly's modelled forward traffic / that local mask's (d = 64, one head)."""
    s, w, ratio = _butterfly_vs_local()
    close(s_butterfly, s, rel=0.005, what="s_butterfly")
    close(window, w, what="window")
    close(traffic_ratio, ratio, rel=0.005, what="traffic_ratio")


@check_07_4.solves
def _():
    from flashnb.stages import block_sparse as bs
    from flashnb.stages import fa2

    def total(model):
        return sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)

    N, B, d = 4096, 64, 64
    bf = bs.butterfly(N, N, B, B)
    window = min(range(1, 33), key=lambda w: abs(bs.local(N, N, B, B, w, causal=False).density - bf.density))
    lo = bs.local(N, N, B, B, window, causal=False)
    ratio = total(fa2.model_forward(1, N, N, d, block_mask=bf)) / total(fa2.model_forward(1, N, N, d, block_mask=lo))
    return dict(s_butterfly=bf.density, window=window, traffic_ratio=ratio)


@check_07_4.fails
def _():
    from flashnb.stages import block_sparse as bs

    bf = bs.butterfly(4096, 4096, 64, 64)
    return dict(s_butterfly=bf.density, window=7, traffic_ratio=1.0)    # a causal window's count of blocks
