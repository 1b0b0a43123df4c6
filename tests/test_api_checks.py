"""The API never answers NaN or a silently wrong gradient: scores float32 cannot hold are refused (naming the
argument and the bound), zero and negative scales are computed correctly by every impl, the backward refuses an
o / lse that are not the forward of its inputs, and every impl refuses tiles over 48 KiB of shared memory through
one shared check (flashnb.common.check_shared_fit)."""

import numpy as np
import pytest
from conftest import assert_close, qkv

import flashnb
from flashnb import common, reference
from flashnb.registry import IMPLS

# float32 kernels against the float64 reference on O(1) inputs with Nk <= 12: a few float32 ulps per dot product
TOL = dict(atol=2e-5, rtol=2e-5)
# an impl whose float32 path runs through TF32 tensor cores (10-bit mantissas: inputs and P rounded by up to 2^-11
# relative): errors measured <= 2e-3 at these sizes; see tests/kernels/test_flash_tc.py
TOL_TF32 = dict(atol=5e-3, rtol=5e-3)
# block-sparse impls need at least two tiles to skip one; their masks are checked with these small tiles
SMALL_TILES = {"fa2": dict(Br=16, Bc=16, warps=1), "fa2-sparse": dict(Br=16, Bc=16, warps=1)}


# --------------------------------------------------------------------------- scale = 0 and negative scales


@pytest.mark.parametrize("scale", [0.0, -0.7])
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_zero_and_negative_scales_are_computed(rng, impl, scale):
    # Before: ValueError "scale must be a positive finite real number".  scale = 0 gives uniform weights over the
    # allowed keys; a negative scale weighs the smallest score most.  causal=True: masked keys must stay masked
    # (0 · a masked score must not become a weight).
    entry = IMPLS[impl]
    TOL = TOL_TF32 if entry.precision == "tf32" else globals()["TOL"]
    q, k, v, do = qkv(rng, (1, 6, 4), 10, do=True)
    mask = entry.mask_for(6, 10, 4, True)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, scale=scale, impl=impl)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True, scale=scale, mask=mask)
    assert_close(o, o_ref, **TOL, what=f"{impl} o (scale={scale})")
    assert_close(lse, lse_ref, **TOL, what=f"{impl} lse (scale={scale})")
    if entry.backward is not None:
        grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, scale=scale, impl=impl)
        for name, g, r in zip(("dq", "dk", "dv"), grads,
                              reference.attention_backward(q, k, v, do, causal=True, scale=scale, mask=mask)):
            assert_close(g, r, **TOL, what=f"{impl} {name} (scale={scale})")
    if scale == 0.0:   # uniform attention: o is the mean of the allowed values (here the bottom-right causal rows)
        allowed = np.arange(10)[None, :] <= np.arange(6)[:, None] + 4
        if mask is not None:
            allowed &= mask
        mean = (allowed[None] @ v) / allowed.sum(-1)[None, :, None]
        assert_close(o, mean, **TOL, what=f"{impl} o (scale=0) = mean of the allowed v")


# --------------------------------------------------------------------------- scores beyond float32


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_scores_beyond_float32_are_refused(rng, impl):
    # Before: NaN output and lse = inf from every impl, no error (float64 is finite).
    q = np.full((8, 4), 1e20)
    v = rng.standard_normal((8, 4))
    with pytest.raises(ValueError, match=r"q and k: the dot products q·k reach 4e\+40 .* beyond 1\.7e\+38"):
        flashnb.attention_forward(q, q, v, impl=impl)
    x = rng.standard_normal((8, 4))
    with pytest.raises(ValueError, match=r"scale=1e\+39 is beyond the float32 range \(\|scale\| <= 3\.403e\+38\)"):
        flashnb.attention_forward(x, x, v, scale=1e39, impl=impl)
    with pytest.raises(ValueError, match=r"scale=1e\+38: the scores scale·q·k reach .* beyond 1\.7e\+38"):
        flashnb.attention_forward(x, x, v, scale=1e38, impl=impl)
    if IMPLS[impl].backward is not None:
        with pytest.raises(ValueError, match="q and k: the dot products"):
            flashnb.attention_backward(q, q, v, v, np.zeros(8), v, impl=impl)


def test_values_whose_sums_overflow_float32_are_refused(rng):
    # Before: v = 1e38 over 12 keys gave inf/NaN output silently (the kernels accumulate exp(s - m)·v before
    # dividing by l; o itself, a convex combination of v, would be finite).
    q, k = rng.standard_normal((2, 12, 4))
    v = np.full((12, 4), 1e38)
    with pytest.raises(ValueError, match=r"v: a column sums to 1\.2e\+39 .* beyond 1\.7e\+38"):
        flashnb.attention_forward(q, k, v, impl="fa2")
    # 1e36 over 12 keys sums to 1.2e37: computed, o equal to v's rows (every row of v is the same)
    o = flashnb.attention(q, k, np.full((12, 4), 1e36), impl="fa2")
    assert np.all(np.isfinite(o)) and np.allclose(o, 1e36, rtol=1e-6)
    # the backward: dV = Pᵀ do sums do over the queries, dP = do vᵀ multiplies them
    v = rng.standard_normal((12, 4))
    o, lse = flashnb.attention_forward(q, k, v, impl="fa2")
    with pytest.raises(ValueError, match=r"do: a column sums to 1\.2e\+39"):
        flashnb.attention_backward(q, k, v, o, lse, np.full((12, 4), 1e38), impl="fa2")
    with pytest.raises(ValueError, match=r"do and v: the products dP = do·vᵀ reach"):
        flashnb.attention_backward(q, k, v * 1e20, o * 1e20, lse, np.full((12, 4), 1e19), impl="fa2",
                                   check_forward=False)


def test_large_but_representable_scores_are_computed(rng):
    # scale = 1e36 keeps every score (|q·k| < 17 here) within 1.7e38: computed, equal to the reference (one-hot rows)
    q, k, v = qkv(rng, (16, 8), 16)
    o, lse = flashnb.attention_forward(q, k, v, scale=1e36, impl="fa2")
    o_ref, lse_ref = reference.attention_forward(q, k, v, scale=1e36)
    assert_close(o, o_ref, **TOL, what="o (scale=1e36)")
    assert_close(lse, lse_ref, atol=0, rtol=1e-6, what="lse (scale=1e36)")   # |lse| ~ 1e37: float32 relative
    # Cauchy-Schwarz alone would refuse these (|q|·|k| = 4e38), yet every q·k is exactly 0: the exact bound accepts
    q = np.zeros((4, 2))
    q[:, 0] = 2e19
    k = np.zeros((4, 2))
    k[:, 1] = 2e19
    assert_close(flashnb.attention(q, k, v[:4, :2], impl="fa1"), np.broadcast_to(v[:4, :2].mean(0), (4, 2)), **TOL,
                 what="o of orthogonal huge q, k")


# --------------------------------------------------------------------------- the backward checks o and lse


@pytest.fixture
def fa1_problem(rng):
    q, k, v, do = qkv(rng, (2, 16, 8), 16, do=True)
    o, lse = flashnb.attention_forward(q, k, v, impl="fa1")
    return q, k, v, do, o, lse


@pytest.mark.parametrize("case", ["non-causal o/lse, causal backward", "lse = 0", "o x 3", "lse = -inf"])
def test_backward_refuses_o_lse_that_are_not_the_forward(fa1_problem, case):
    # Before: gradients off by 0.9-81x relative (or all zero for lse = -inf), silently.
    q, k, v, do, o, lse = fa1_problem
    o2, lse2, causal = {"non-causal o/lse, causal backward": (o, lse, True), "lse = 0": (o, 0 * lse, False),
                        "o x 3": (3 * o, lse, False), "lse = -inf": (o, np.full_like(lse, -np.inf), False)}[case]
    with pytest.raises(ValueError, match=r"o and lse are not the forward of these q, k, v .* at row \d+ of batch"):
        flashnb.attention_backward(q, k, v, o2, lse2, do, causal=causal, impl="fa1")
    # the check can be switched off (the gradients are then as wrong as the inputs)
    flashnb.attention_backward(q, k, v, o2, lse2, do, causal=causal, impl="fa1", check_forward=False)
    with pytest.raises(TypeError, match="check_forward"):
        flashnb.attention_backward(q, k, v, o, lse, do, impl="fa1", check_forward="yes")


def test_backward_check_sees_one_corrupted_row_of_a_small_problem(fa1_problem):
    # Before: only 6 rows were sampled, so a corruption of row 5 of head 1 passed; small problems are now
    # checked row by row (a larger one is sampled: the docstring says what that misses).
    q, k, v, do, o, lse = fa1_problem
    o2, lse2 = o.copy(), lse.copy()
    lse2[1, 5] += 0.05           # far above float32 rounding (~1e-6 here), far below "whole forward wrong"
    with pytest.raises(ValueError, match=r"at row 5 of batch·head 1 lse"):
        flashnb.attention_backward(q, k, v, o, lse2, do, impl="fa1")
    o2[0, 9, 3] += 0.05
    with pytest.raises(ValueError, match=r"at row 9 of batch·head 0 lse"):
        flashnb.attention_backward(q, k, v, o2, lse, do, impl="fa1")


def test_backward_check_accepts_the_forward_and_knows_the_masks(rng):
    # the impl's own mask (fa2-sparse's window, fa2's block_mask) is part of "the same inputs and options"
    q, k, v, do = qkv(rng, (1, 32, 8), 32, do=True)
    opts = SMALL_TILES["fa2-sparse"]
    o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa2-sparse", window=1, **opts)
    flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="fa2-sparse", window=1, **opts)
    bm = np.array([[True, False], [False, True]])
    o, lse = flashnb.attention_forward(q, k, v, impl="fa2", block_mask=bm, **SMALL_TILES["fa2"])
    flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2", block_mask=bm, **SMALL_TILES["fa2"])
    o_dense, lse_dense = reference.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="not the forward"):      # dense o / lse, block-sparse backward
        flashnb.attention_backward(q, k, v, o_dense, lse_dense, do, impl="fa2", block_mask=bm, **SMALL_TILES["fa2"])


# --------------------------------------------------------------------------- tiles that cannot fit


def test_fa2_refuses_tiles_over_48_kib(rng):
    # Before: accepted; the simulator then ran for many minutes (a GPU would refuse to compile the kernel).
    q, k, v, do = qkv(rng, (16, 64), 16, do=True)
    with pytest.raises(ValueError, match=r"fa2 forward: tiles Br=1024, Bc=1024 at d=64, warps=4 need 786,432 B of "
                                         r"static shared memory per block, over the 49,152 B \(48 KiB\)"):
        flashnb.attention_forward(q, k, v, impl="fa2", Br=1024, Bc=1024)
    with pytest.raises(ValueError, match="fa2 backward: tiles Br=1024, Bc=1024"):
        flashnb.attention_backward(q, k, v, q, np.zeros(16), do, impl="fa2", Br=1024, Bc=1024, check_forward=False)
    q128 = rng.standard_normal((4, 128))
    with pytest.raises(ValueError, match=r"onepass: tiles tile=64 at d=128 need 65,536 B .* choose a smaller tile"):
        flashnb.attention_forward(q128, q128, q128, impl="onepass", tile=64)


@pytest.mark.parametrize("impl", ["fa1", "fa2", "fa2-sparse", "onepass"])
def test_every_tiled_impl_uses_the_one_shared_check(rng, impl, monkeypatch):
    # with the limit lowered in flashnb.common only, every impl with tile options refuses its default tiles (naive's
    # matmul tiles, at most 32x32 -- 8 KiB -- are far below the limit; the PTX guard checks its default 2 KiB)
    monkeypatch.setattr(common, "SHARED_LIMIT_BYTES", 64)
    q, k, v = qkv(rng, (8, 4), 8)
    with pytest.raises(ValueError, match="static shared memory per block"):
        flashnb.attention_forward(q, k, v, impl=impl)


def test_fa1_M_is_a_memory_size(rng):
    # Before: M=1 accepted (tiles of one row)
    q, k, v = qkv(rng, (8, 16), 8)
    with pytest.raises(ValueError, match="M must be at least 4·d = 64 float32 elements, got M=1"):
        flashnb.attention_forward(q, k, v, impl="fa1", M=1)
    assert flashnb.stages.fa1.tiles(16, M=64)["Bc"] == 4   # the smallest budget: one row each, Bc rounded to warps


# --------------------------------------------------------------------------- array-likes


def test_nested_lists_are_converted_and_ragged_ones_refused_by_name(rng):
    """Nested lists are converted as np.asarray converts them (docs/kernels.md says so): a (H, N, d) list of Python
    floats gives the ndarray's output and gradients.  Before, a ragged list was refused as a bare 'got list': the
    message now names the argument, what the API takes and why NumPy could not make an array of it."""
    q, k, v, do = qkv(rng, (2, 12, 8), 10, do=True)
    o, lse = flashnb.attention_forward(q.tolist(), k, v.tolist(), causal=True, impl="flash")
    o_ref, lse_ref = flashnb.attention_forward(q, k, v, causal=True, impl="flash")
    assert isinstance(o, np.ndarray) and o.dtype == o_ref.dtype
    np.testing.assert_array_equal(o, o_ref)              # the same float32 inputs after conversion: the same bits
    np.testing.assert_array_equal(lse, lse_ref)
    grads = flashnb.attention_backward(q, k.tolist(), v, o, lse, do.tolist(), causal=True, impl="flash")
    for got, want in zip(grads, flashnb.attention_backward(q, k, v, o_ref, lse_ref, do, causal=True, impl="flash")):
        np.testing.assert_array_equal(got, want)
    ragged = k[0].tolist()
    ragged[3] = ragged[3][:5]
    with pytest.raises(TypeError, match=r"^k must be an array of shape .*nested lists of numbers with equal "
                                        r"lengths.*got a list NumPy cannot make one array of \(.+\)$"):
        flashnb.attention(q[0], ragged, v[0])
    with pytest.raises(TypeError, match=r"^v must hold real numbers .*got dtype bool"):
        flashnb.attention(q[0], k[0], (v[0] > 0).tolist())
