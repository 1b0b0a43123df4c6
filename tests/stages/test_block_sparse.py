"""Block-sparse FlashAttention (FA1 Alg. 5 on the FA2 kernels): forward and backward against the float64
reference with the block mask expanded to elements, the patterns, fully masked rows, how a mask maps onto
the backward's tiles, counted traffic against the model (and its proportionality to s), and bad masks."""

import numpy as np
import pytest
from conftest import BLOCK_MASK_IMPLS, MODULE_OF, assert_close, qkv

import flashnb
from flashnb import common, reference
from flashnb.common import cdiv
from flashnb.instruments import traffic
from flashnb.stages import block_sparse as bs
from flashnb.stages import fa2

# As in test_fa2: float32 sums of at most max(Nk, d) <= 128 O(1) products (~1e-5 relative worst case); the
# backward chains four such products with values up to O(10) and dQ is summed by atomics in any order.  A
# block computed that should have been skipped (or the reverse) changes outputs by O(0.1 - 1).
FWD = dict(atol=2e-5, rtol=2e-5)
BWD = dict(atol=1e-4, rtol=1e-4)
ONE_WARP = dict(warps=1)


def _check(q, k, v, do, bm, causal, *, tiles=ONE_WARP, bwd_tiles=None, impl="fa2"):
    """``impl`` with ``block_mask=bm`` vs the reference with ``mask=`` its element expansion, both directions."""
    Nq, Nk = q.shape[-2], k.shape[-2]
    arr = bm.mask if isinstance(bm, bs.BlockMask) else bm
    Br = bm.Br if isinstance(bm, bs.BlockMask) else tiles["Br"]
    Bc = bm.Bc if isinstance(bm, bs.BlockMask) else tiles["Bc"]
    mask = reference.expand_block_mask(arr, Nq, Nk, Br, Bc)
    if mask.ndim > 2:                                 # per-head masks: (BH, Nq, Nk) under q's leading axes
        mask = mask.reshape(q.shape[:-2] + mask.shape[-2:])
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl=impl, block_mask=bm, **tiles)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal, mask=mask)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")
    grads = flashnb.attention_backward(q, k, v, o_ref, lse_ref, do, causal=causal, impl=impl, block_mask=bm,
                                       **(tiles if bwd_tiles is None else bwd_tiles))
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, causal=causal,
                                                                                       mask=mask)):
        assert_close(g, g_ref, **BWD, what=name)
    return o, lse, grads


# (lead, Nq, Nk, d, mask builder, causal): ragged lengths (not multiples of the tiles), Nq != Nk both ways,
# Br != Bc, every pattern, densities from 0.25 to 1.
CASES = [
    ((1,), 37, 53, 8, lambda Nq, Nk: bs.random(Nq, Nk, 16, 16, 0.5, seed=3), False),
    ((1,), 37, 53, 8, lambda Nq, Nk: bs.random(Nq, Nk, 16, 16, 0.25, seed=4), True),
    ((2,), 50, 30, 8, lambda Nq, Nk: bs.local(Nq, Nk, 16, 8, 2), True),
    ((1,), 64, 64, 16, lambda Nq, Nk: bs.butterfly(Nq, Nk, 8, 8), False),
    ((1,), 45, 70, 8, lambda Nq, Nk: bs.strided(Nq, Nk, 8, 16, 2), True),
    ((1,), 48, 41, 8, lambda Nq, Nk: bs.fixed(Nq, Nk, 8, 8, 3, 1, causal=False), False),
    ((1,), 40, 56, 32, lambda Nq, Nk: bs.dense(Nq, Nk, 16, 16), True),
]
IDS = ["random.5", "random.25-causal", "local-BrneBc", "butterfly", "strided-causal", "fixed", "dense-d32"]


@pytest.mark.parametrize("impl", BLOCK_MASK_IMPLS)
@pytest.mark.parametrize("lead, Nq, Nk, d, build, causal", CASES, ids=IDS)
def test_matches_masked_reference(rng, lead, Nq, Nk, d, build, causal, impl):
    q, k, v, do = qkv(rng, (*lead, Nq, d), Nk, do=True)
    _check(q, k, v, do, build(Nq, Nk), causal, impl=impl)


@pytest.mark.parametrize("impl", BLOCK_MASK_IMPLS)
def test_per_head_masks_and_raw_array(rng, impl):
    """A (B, H, Tr, Tc) plain boolean array, different for every head, read at the explicit tiles."""
    q, k, v, do = qkv(rng, (1, 2, 33, 8), 47, do=True)
    arr = bs.random(33, 47, 16, 8, 0.5, seed=9, lead=(1, 2)).mask
    assert not np.array_equal(arr[0, 0], arr[0, 1])
    _check(q, k, v, do, arr, False, tiles=dict(Br=16, Bc=8, warps=1), impl=impl)


def test_default_tiles_backward_refines_the_mask(rng):
    """A plain array is read at the forward's default tiles (d = 8: 64 x 32); the backward runs its own
    defaults (32 x 32), each backward tile inside one mask block, and skips exactly the same elements."""
    Nq, Nk, d = 70, 90, 8
    t = fa2.default_tiles(d)
    arr = np.array([[True, False, True], [False, True, True]])
    assert arr.shape == (cdiv(Nq, t["Br"]), cdiv(Nk, t["Bc"]))
    q, k, v, do = qkv(rng, (1, Nq, d), Nk, do=True)
    _check(q, k, v, do, arr, False, tiles=dict(Br=t["Br"], Bc=t["Bc"]), bwd_tiles={})
    tb, M = fa2.block_tiles(d, "backward", None, None, None, arr, 1, Nq, Nk)
    assert (tb["Br"], tb["Bc"]) == (32, 32) and M.shape == (1, 3, 3)
    assert np.array_equal(M[0], np.repeat(arr, 2, axis=0)[:3])


@pytest.mark.parametrize("impl", BLOCK_MASK_IMPLS)
def test_fully_masked_rows_give_zeros_not_nan(rng, impl):
    """Query block 1 has no block; key block 0 is never used: O = 0, LSE = -inf, dQ = 0 there; dK = dV = 0."""
    Nq, Nk, d = 40, 40, 8
    bm = bs.BlockMask(np.array([[False, True, True], [False, False, False], [False, True, False]]), 16, 16)
    q, k, v, do = qkv(rng, (1, Nq, d), Nk, do=True)
    o, lse, (dq, dk, dv) = _check(q, k, v, do, bm, False, impl=impl)
    assert np.all(o[:, 16:32] == 0) and np.all(np.isneginf(lse[:, 16:32])) and np.all(dq[:, 16:32] == 0)
    assert np.all(dk[:, :16] == 0) and np.all(dv[:, :16] == 0)


def test_causal_blocks_with_causal_is_exact_causal(rng):
    """causal-as-blocks AND causal=True is causal attention; it visits exactly fa2's causal tiles."""
    Nq, Nk, d = 40, 24, 8
    q, k, v = qkv(rng, (1, Nq, d), Nk)
    bm = bs.causal(Nq, Nk, 16, 8)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa2", block_mask=bm, warps=1)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")
    for Nq, Nk, Br, Bc in ((64, 64, 16, 16), (40, 24, 16, 8), (24, 70, 8, 16), (50, 50, 16, 32)):
        m = bs.causal(Nq, Nk, Br, Bc).mask
        assert {(i, j) for i, j, _, _ in fa2.tiles_visited(Nq, Nk, Br, Bc, True)} == set(zip(*np.nonzero(m)))


def test_fa2_sparse_impl(rng):
    q, k, v, do = qkv(rng, (1, 64, 8), 64, do=True)
    bm = bs.local(64, 64, 16, 16, 2, causal=False)
    o = flashnb.attention(q, k, v, impl="fa2-sparse", window=2, Br=16, Bc=16, warps=1)
    assert_close(o, reference.attention(q, k, v, mask=bm.expand(64, 64)), **FWD, what="o")


# --------------------------------------------------------------------------- patterns


def test_patterns_shapes_and_density():
    for name, make in bs.PATTERNS.items():
        bm = make(100, 70, 16, 8)
        assert bm.shape == (7, 9) and bm.mask.dtype == np.bool_, name
        assert bm.density == bm.mask.mean() and 0 < bm.density <= 1, name
    r = bs.random(128, 128, 16, 16, 0.375, seed=1)
    assert r.mask.sum() == 24 and np.array_equal(r.mask, bs.random(128, 128, 16, 16, 0.375, seed=1).mask)
    assert not np.array_equal(r.mask, bs.random(128, 128, 16, 16, 0.375, seed=2).mask)
    assert np.array_equal(bs.local(64, 64, 16, 16, 1).mask, np.eye(4, dtype=bool))
    assert np.array_equal(bs.local(64, 64, 16, 16, 2).mask, np.eye(4, dtype=bool) | np.eye(4, k=-1, dtype=bool))
    b = bs.butterfly(128, 128, 16, 16).mask          # 8 x 8: the diagonal and 3 one-bit partners per row
    assert (b.sum(axis=1) == 4).all() and np.array_equal(b, b.T) and b[0, 4] and not b[0, 3]
    f = bs.fixed(128, 128, 16, 16, 4, 1).mask         # own chunk (causal) + the last block of earlier chunks
    assert f[5, 3] and f[5, 4] and f[5, 5] and not f[5, 2] and not f[5, 6] and not f[2, 3]
    s = bs.strided(128, 128, 16, 16, 3).mask          # window of 3, then every 3rd block back
    assert list(np.nonzero(s[7])[0]) == [1, 4, 5, 6, 7]


def test_pattern_bad_arguments():
    with pytest.raises(ValueError, match="density"):
        bs.random(64, 64, 16, 16, 1.5)
    with pytest.raises(ValueError, match="window"):
        bs.local(64, 64, 16, 16, 0)
    with pytest.raises(TypeError, match="Br"):
        bs.causal(64, 64, 16.0, 16)
    with pytest.raises(ValueError, match="c must"):
        bs.fixed(64, 64, 16, 16, 2, 3)


# --------------------------------------------------------------------------- traffic


def _dev(*arrays):
    return [common.to_device(np.asarray(a, dtype=np.float32)) for a in arrays]


@pytest.mark.parametrize("BH, Nq, Nk, d, build, causal, tiles", [
    (2, 37, 53, 8, lambda Nq, Nk: bs.random(Nq, Nk, 16, 16, 0.5, seed=5, lead=(2,)), False, ONE_WARP),
    (1, 50, 30, 8, lambda Nq, Nk: bs.local(Nq, Nk, 16, 8, 2), True, ONE_WARP),
    (1, 64, 64, 8, lambda Nq, Nk: bs.butterfly(Nq, Nk, 16, 16), False, dict(Br=8, Bc=16, warps=1)),
    (1, 45, 70, 8, lambda Nq, Nk: bs.strided(Nq, Nk, 16, 16, 2), True, dict(warps=2)),
], ids=["random-per-head", "local-causal", "butterfly-refined", "strided-2warps"])
@pytest.mark.parametrize("impl", BLOCK_MASK_IMPLS)
def test_counted_traffic_equals_model(rng, BH, Nq, Nk, d, build, causal, tiles, impl):
    mod = MODULE_OF[impl]
    bm = build(Nq, Nk)
    q, k, v, do = qkv(rng, (BH, Nq, d), Nk, do=True)
    with traffic.count() as t:
        o, lse = mod.forward(*_dev(q, k, v), causal=causal, scale=0.3, block_mask=bm, **tiles)
    assert t.summary() == mod.model_forward(BH, Nq, Nk, d, causal=causal, block_mask=bm, **tiles)
    with traffic.count() as t:
        mod.backward(*_dev(q, k, v), o, lse, *_dev(do), causal=causal, scale=0.3, block_mask=bm, **tiles)
    assert t.summary() == mod.model_backward(BH, Nq, Nk, d, causal=causal, block_mask=bm, **tiles)


@pytest.mark.parametrize("impl", BLOCK_MASK_IMPLS)
def test_dense_mask_costs_only_the_mask_reads(impl):
    """An all-ones mask visits the dense tiles: the same counts, plus one byte of M per warp per tile."""
    mod = MODULE_OF[impl]
    dense = mod.model_forward(1, 64, 64, 16, Br=16, Bc=16, warps=1)[0]
    ones = mod.model_forward(1, 64, 64, 16, Br=16, Bc=16, warps=1, block_mask=bs.dense(64, 64, 16, 16))[0]
    assert ones["reads"].pop("M") == 16 and ones == dense


@pytest.mark.parametrize("impl", BLOCK_MASK_IMPLS)
def test_model_traffic_is_proportional_to_s_plus_the_Nd_term(impl):
    """Proposition 4's shape, exactly: K, V reads = 2 · s · Tr · Tc · Bc · d; Q, O, L do not depend on s."""
    BH, N, d, Br, Bc = 2, 1024, 64, 64, 32
    Tr, Tc = N // Br, N // Bc
    mod = MODULE_OF[impl]
    warps = mod.default_tiles(d)["warps"]          # the forward's default tiles are 64 x 32 for both impls
    for s in (0.125, 0.25, 0.5, 1.0):
        bm = bs.random(N, N, Br, Bc, s, seed=0)
        fwd = mod.model_forward(BH, N, N, d, block_mask=bm)[0]
        assert fwd["reads"]["K"] + fwd["reads"]["V"] == 2 * BH * round(s * Tr * Tc) * Bc * d
        nd = (fwd["reads"]["Q"], fwd["writes"]["O"], fwd["writes"]["L"], fwd["reads"]["M"])
        assert nd == (BH * N * d, BH * N * d, BH * N, BH * Tr * Tc * warps)   # lane 0 of each warp
        bwd = mod.model_backward(BH, N, N, d, block_mask=bm)[1]
        assert bwd["reads"]["Q"] == bwd["atomics"]["dQ"] == BH * round(s * Tr * Tc) * 2 * 32 * d  # 32 x 32 tiles
        assert (bwd["reads"]["K"], bwd["writes"]["dK"]) == (BH * N * d, BH * N * d)


# --------------------------------------------------------------------------- bad masks


@pytest.mark.parametrize("impl", BLOCK_MASK_IMPLS)
@pytest.mark.parametrize("mask, opts, err, words", [
    (np.ones((3, 3), dtype=bool), dict(Br=16, Bc=16), ValueError, r"block_mask must have shape \(\.\.\., 3, 4\)"),
    (np.ones((3, 4), dtype=np.int8), dict(Br=16, Bc=16), TypeError, "block_mask must be a boolean"),
    (np.ones((3, 3, 4), dtype=bool), dict(Br=16, Bc=16), ValueError, "block_mask.*batch·heads = 2"),
    (bs.random(40, 56, 16, 16, 0.5), dict(Br=32), ValueError, "block_mask was built for tiles Br=16, Bc=16"),
    (bs.random(40, 40, 16, 16, 0.5), {}, ValueError, r"block_mask must have shape \(\.\.\., 3, 4\)"),
    (np.ones((3, 4), dtype=bool), {}, ValueError, r"block_mask must have shape \(\.\.\., 1, 2\)"),  # d=8: 64x32
], ids=["shape", "dtype", "heads", "tiles", "other-problem", "default-tiles"])
def test_bad_block_mask(rng, mask, opts, err, words, impl):
    q, k, v = qkv(rng, (2, 40, 8), 56)
    with pytest.raises(err, match=words):
        flashnb.attention_forward(q, k, v, impl=impl, block_mask=mask, **opts)


@pytest.mark.parametrize("impl", BLOCK_MASK_IMPLS)
def test_bad_block_mask_backward(rng, impl):
    q, k, v, do = qkv(rng, (1, 40, 8), 56, do=True)
    o, lse = reference.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="block_mask was built for tiles Br=16, Bc=16"):
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, block_mask=bs.dense(40, 56, 16, 16), Bc=32)
    with pytest.raises(ValueError, match=r"block_mask must have shape \(\.\.\., 3, 4\)"):
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, block_mask=np.ones((2, 2), bool), Br=16, Bc=16)


def test_fa2_sparse_impl_is_local_attention_checked_against_its_own_mask(rng):
    """impl="fa2-sparse" is not dense attention: it matches the reference with the impl's own mask, and
    differs from dense attention once some keys fall outside the window."""
    from flashnb.registry import IMPLS

    q, k, v = (rng.standard_normal((1, n, 8)) for n in (40, 56, 56))
    entry = IMPLS["fa2-sparse"]
    mask = entry.mask_for(40, 56, 8, True)
    assert mask.shape == (40, 56) and 0 < mask.mean() < 1
    o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa2-sparse")
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True, mask=mask)
    # float32 kernel vs float64 reference over <= 16 keys per row: ~1e-7; 1e-5 leaves margin
    assert np.abs(o - o_ref).max() < 1e-5 and np.abs(lse - lse_ref).max() < 1e-5
    o_dense, _ = reference.attention_forward(q, k, v, causal=True)
    assert np.abs(o - o_dense).max() > 1e-2


@pytest.mark.parametrize("impl", BLOCK_MASK_IMPLS)
def test_prepared_mask_is_reused_and_checked(rng, impl):
    """fa2.prepare_block_mask maps a mask onto a launch's tiles once (outside timed loops); reusing it gives the
    same result as passing the BlockMask, and using it for another direction or shape is an error."""
    BH, Nq, Nk, d = 1, 40, 48, 8
    bm = bs.local(Nq, Nk, 16, 16, 2, causal=False)
    q, k, v = (common.to_device(a) for a in qkv(rng, (BH, Nq, d), Nk))
    mod = MODULE_OF[impl]
    pm = mod.prepare_block_mask(bm, direction="forward", BH=BH, Nq=Nq, Nk=Nk, d=d)
    o1, l1 = mod.forward(q, k, v, scale=0.5, block_mask=bm)
    o2, l2 = mod.forward(q, k, v, scale=0.5, block_mask=pm)
    assert np.array_equal(o1.copy_to_host(), o2.copy_to_host()) and np.array_equal(l1.copy_to_host(), l2.copy_to_host())
    with pytest.raises(ValueError, match="prepared for the forward"):
        mod.backward(q, k, v, o1, l1, q, scale=0.5, block_mask=pm)
    with pytest.raises(ValueError, match="prepared for"):
        mod.forward(q, q, q, scale=0.5, block_mask=pm)   # Nk = 40, not 48


def test_sparse_flops_count_only_computed_pairs():
    from flashnb.registry import IMPLS

    dense, sparse = IMPLS["fa2"], IMPLS["fa2-sparse"]
    assert dense.flops(1, 1, 64, 64, 16, False) == 4 * 64 * 64 * 16
    # window 1 on 16 x 16 blocks, not causal: the 4 diagonal blocks of 16 x 16 out of a 4 x 4 grid
    assert sparse.flops(1, 1, 64, 64, 16, False) == 4 * 16 * (4 * 16 * 16)
    assert sparse.flops(1, 1, 64, 64, 16, False, "backward") == 2.5 * 4 * 16 * (4 * 16 * 16)
