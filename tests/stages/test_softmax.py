"""Stage 2: row softmax kernels, the merge, and the one-pass attention rows (flashnb.stages.softmax)."""

import numpy as np
import pytest
from conftest import assert_close

import flashnb
from flashnb import reference
from flashnb.common import to_device
from flashnb.instruments import traffic
from flashnb.stages import softmax as S

try:  # warp shuffles on the simulator come from flashnb.sim
    from flashnb import sim as _sim

    WARP_OK = not flashnb.is_simulator() or _sim.install()
except ImportError:  # pragma: no cover
    WARP_OK = not flashnb.is_simulator()

needs_warp = pytest.mark.skipif(not WARP_OK, reason="warp shuffles need flashnb.sim on the simulator")

# float32 softmax: every output is one expf and one multiply by 1/d, where d sums <= 100 terms in float32
# (relative error <= n·2^-24 ~ 6e-6); outputs are <= 1, so 1e-6 absolute + 1e-5 relative is ample.
SOFTMAX_TOL = dict(atol=1e-6, rtol=1e-5)
# attention rows: d <= 16 products per score, <= 40 keys accumulated in float32 with rescaling on each step;
# |o| <= max|V| ~ 3, so errors of a few 1e-6 are expected -- 1e-5 absolute + 1e-4 relative.
ATTN_TOL = dict(atol=1e-5, rtol=1e-4)


def ref_softmax(x):
    """float64 row softmax of the (float32-rounded) input; a row of only -inf gives zeros."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    s = e.sum(axis=-1, keepdims=True)
    return e / np.where(s > 0, s, 1.0)


def rows(rng, r, n, scale=1.0):
    return (scale * rng.standard_normal((r, n))).astype(np.float32)


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("method", S.METHODS)
@pytest.mark.parametrize("reduce", ["block", pytest.param("warp", marks=needs_warp)])
@pytest.mark.parametrize("threads", [32, 64])       # 64: the warp reduction's cross-warp step runs
def test_random_rows_longer_than_block(rng, method, reduce, threads):
    x = rows(rng, 3, 77 + threads, scale=3.0)        # longer than the block: each thread loops
    assert_close(S.softmax(x, method, reduce=reduce, threads=threads), ref_softmax(x), **SOFTMAX_TOL, what=method)


@pytest.mark.parametrize("method", S.METHODS)
def test_row_of_length_one_and_short_rows(rng, method):
    assert_close(S.softmax(np.array([[0.7], [-3.0]]), method, threads=8), np.ones((2, 1)), **SOFTMAX_TOL,
                 what="n=1")
    x = rows(rng, 2, 5)                                # fewer elements than threads: idle threads
    assert_close(S.softmax(x, method, threads=8), ref_softmax(x), **SOFTMAX_TOL, what="n<threads")
    assert S.softmax(x[0], method, threads=8).shape == (5,)   # 1-D in, 1-D out


@pytest.mark.parametrize("method", ["safe", "online"])
@pytest.mark.parametrize("reduce", ["block", pytest.param("warp", marks=needs_warp)])
def test_huge_values_and_masked_entries(rng, method, reduce):
    x = rows(rng, 4, 40, scale=1e4)                   # ±1e4: e^x would be inf, e^(x - m) is fine
    x[0] += 1e4
    x[1, ::3] = -np.inf                               # masked entries
    x[2] = -np.inf                                    # a fully masked row -> zeros
    x[3, 7] = 1e4                                     # one dominating entry
    y = S.softmax(x, method, reduce=reduce, threads=32)
    assert not np.isnan(y).any() and np.isfinite(y).all()
    assert_close(y, ref_softmax(x), **SOFTMAX_TOL, what=f"{method} ±1e4 / -inf")
    assert np.all(y[2] == 0) and np.all(y[1, ::3] == 0)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_unsafe_overflows_where_float32_does(rng):
    # e^88.7 fits in float32, e^88.8 does not (float16: e^11 fits, e^11.1 does not -- numpy on the host).
    assert np.isfinite(np.exp(np.float32(88.7))) and np.isinf(np.exp(np.float32(88.8)))
    assert np.isfinite(np.exp(np.float16(11.0))) and np.isinf(np.exp(np.float16(11.1)))
    assert 88.7 < S.FLOAT32_EXP_OVERFLOW < 88.8 and 11.0 < S.FLOAT16_EXP_OVERFLOW < 11.1
    x = rows(rng, 1, 16) + np.float32(100.0)          # all inputs > 88.72: e^x = inf, inf / inf = NaN
    y = S.softmax(x, "unsafe", threads=8)
    assert np.isnan(y).all()
    assert_close(S.softmax(x, "online", threads=8), ref_softmax(x), **SOFTMAX_TOL, what="online at 100")
    if flashnb.is_simulator():                         # Python's math.exp raises from 709.78 on: refused
        with pytest.raises(ValueError, match="OverflowError"):
            S.softmax(np.full((1, 4), 800.0), "unsafe", threads=4)


def test_bad_arguments():
    x = np.zeros((2, 3)) + 0.5
    with pytest.raises(ValueError, match="method"):
        S.softmax(x, "fast")
    with pytest.raises(ValueError, match="reduce"):
        S.softmax(x, reduce="grid")
    with pytest.raises(ValueError, match="threads"):
        S.softmax(x, threads=24)
    with pytest.raises(ValueError, match="threads"):
        S.softmax(x, reduce="warp", threads=16)
    with pytest.raises(TypeError, match="threads"):
        S.softmax(x, threads=32.0)
    with pytest.raises(ValueError, match="x must not contain NaN"):
        S.softmax(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="x must be a non-empty"):
        S.softmax(np.zeros((2, 2, 2)))
    with pytest.raises(TypeError, match="x must hold real"):
        S.softmax(np.array(["a"]))
    with pytest.raises(ValueError, match="chunks"):
        S.online_partials(x, 4)
    with pytest.raises(ValueError, match="tile"):
        S.attention_rows(np.ones(128), np.ones((4, 128)), np.ones((4, 128)), tile=64)


# --------------------------------------------------------------------------- counted accesses == model


@pytest.mark.parametrize("method, per_element", [("unsafe", 3), ("safe", 4), ("online", 3)])
@pytest.mark.parametrize("reduce", ["block", pytest.param("warp", marks=needs_warp)])
def test_counted_accesses_equal_model(rng, method, per_element, reduce):
    r, n, threads = 2, 45, 32
    x = rows(rng, r, n)
    with traffic.count() as t:
        y = S.softmax(x, method, reduce=reduce, threads=threads)
    assert not np.isnan(y).any()
    model = S.model_softmax(r, n, method, reduce=reduce, threads=threads)
    assert t.summary() == model
    launch = model[0]
    assert (sum(launch["reads"].values()) + sum(launch["writes"].values())) == per_element * r * n


def test_partials_and_attention_counts_equal_model(rng):
    x = rows(rng, 2, 30)
    with traffic.count() as t:
        S.online_partials(x, 3, threads=8)
    assert t.summary() == S.model_online_partials(2, 30, 3, threads=8)
    q, k, v = (to_device(a) for a in rng.standard_normal((3, 2, 9, 4)))
    for tile in (None, 4):
        for causal in (False, True):
            with traffic.count() as t:
                S.forward(q, k, v, causal=causal, scale=0.5, tile=tile)
            assert t.summary() == S.model_forward(2, 9, 9, 4, causal=causal, tile=tile), (tile, causal)


# --------------------------------------------------------------------------- the merge


def test_merge_is_associative_and_has_an_identity(rng):
    # states of random chunks of one row: [max, sum e^(x - max)]
    chunks = [rng.standard_normal(int(rng.integers(1, 9))) * 5 for _ in range(7)]
    chunks[3] = np.array([-np.inf, -np.inf])           # an all-masked chunk: state [-inf, 0]
    states = [(c.max(), np.exp(c - c.max()).sum() if np.isfinite(c.max()) else 0.0) for c in chunks]
    allx = np.concatenate(chunks)
    whole = (allx.max(), np.exp(allx - allx.max()).sum())
    left = states[0]
    for s in states[1:]:
        left = S.merge(left, s)                        # ((a ⊕ b) ⊕ c) ⊕ ...
    right = states[-1]
    for s in states[-2::-1]:
        right = S.merge(s, right)                      # a ⊕ (b ⊕ (c ⊕ ...))
    level = states
    while len(level) > 1:                              # a tree, as the threads of a block merge
        level = [S.merge(level[i], level[i + 1]) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    for got in (left, right, level[0]):
        assert got[0] == whole[0]
        assert got[1] == pytest.approx(whole[1], rel=1e-12)   # float64 rounding only
    a, b = states[0], states[1]
    assert S.merge(a, b)[1] == pytest.approx(S.merge(b, a)[1], rel=1e-15)
    empty = (-np.inf, 0.0)
    assert S.merge(a, empty) == (a[0], a[1]) and S.merge(empty, empty) == (-np.inf, 0.0)


def test_block_partials_merge_to_the_row_state(rng):
    x = rows(rng, 3, 50, scale=4.0)
    x[1, :20] = -np.inf                                # first chunk(s) of row 1 fully masked
    M, D = S.online_partials(x, 4, threads=8)
    assert not np.isnan(M).any() and not np.isnan(D).any()
    m, d = S.merge_all(M, D)
    x64 = x.astype(np.float64)
    assert np.array_equal(m, x64.max(axis=1))
    # float32 running sums of <= 13 terms per chunk: relative error well under 1e-5
    np.testing.assert_allclose(d, np.exp(x64 - x64.max(axis=1, keepdims=True)).sum(axis=1), rtol=1e-5)


# --------------------------------------------------------------------------- one-pass attention


@pytest.mark.parametrize("tile", [None, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Nq", [6, 40])                # 40: several (ragged) query blocks
def test_attention_rows_match_reference(rng, tile, causal, Nq):
    q = rng.standard_normal((Nq, 16))
    K = rng.standard_normal((21, 16))                  # 21 keys: a ragged last tile
    V = rng.standard_normal((21, 16))
    o, lse = S.attention_rows(q, K, V, tile=tile, causal=causal, return_lse=True)
    ro, rl = reference.attention_forward(q, K, V, causal=causal)
    assert_close(o, ro, **ATTN_TOL, what="o")
    assert_close(lse, rl, **ATTN_TOL, what="lse")
    assert S.attention_rows(q[0], K, V, tile=tile).shape == (16,)


@pytest.mark.parametrize("tile", [None, 4])
def test_onepass_impl_contract(rng, tile):
    # Nq > Nk with causal: the first Nq - Nk query rows see no key -> o = 0, lse = -inf (the API's rule)
    q = rng.standard_normal((2, 9, 8)) * 30            # large scores: the online rescaling matters
    k = rng.standard_normal((2, 6, 8))
    v = rng.standard_normal((2, 6, 8))
    for causal in (False, True):
        o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="onepass", tile=tile)
        ro, rl = reference.attention_forward(q, k, v, causal=causal)
        assert_close(o, ro, **ATTN_TOL, what=f"o causal={causal}")
        assert_close(lse, rl, **ATTN_TOL, what=f"lse causal={causal}")
    assert np.all(o[:, :3] == 0) and np.all(lse[:, :3] == -np.inf)
