"""Stage 3 (FlashAttention-1) against the float64 reference, its tiles, bad options, and counted == model."""

import numpy as np
import pytest
from conftest import assert_close, qkv

import flashnb
from flashnb import common, reference
from flashnb.instruments import traffic
from flashnb.stages import fa1

# Float32 kernels vs the float64 reference.  Each O row is merged across Tc key tiles with rescalings
# e^(m_old - m_new) (a few float32 roundings per tile) on top of dot products of <= 128 O(1) terms, so
# errors are ~1e-6; the backward chains dP, dS and dQ/dK products whose values reach O(10): 1e-4 absolute
# still catches a wrong index, mask or merge (those give O(0.1-1) errors).
FWD = dict(atol=2e-5, rtol=2e-5)
BWD = dict(atol=1e-4, rtol=1e-4)

# (lead, Nq, Nk, d, options): N = 1, Nq != Nk both ways, ragged last tiles in both directions, odd d,
# several key tiles (Tc > 1) so the merge across tiles runs, 1-4 warps, the default tiles for d = 1, 32, 128.
SHAPES = [
    ((1,), 1, 1, 1, {}),
    ((1,), 1, 19, 8, dict(Br=8, Bc=8, warps=2)),
    ((2,), 19, 1, 8, dict(Br=8, Bc=8, warps=2)),
    ((1, 2), 33, 20, 5, dict(Br=8, Bc=6, warps=3)),
    ((1,), 40, 56, 32, {}),
    ((1,), 21, 30, 16, dict(Br=5, Bc=7, warps=1)),
    ((1,), 9, 12, 128, {}),
    ((1,), 45, 37, 4, dict(Br=40, Bc=8, warps=1)),   # Br > 32 threads: the row loops wrap
]


def _ids(shape):
    lead, Nq, Nk, d, opts = shape
    return f"{lead}-{Nq}x{Nk}-d{d}-" + ",".join(f"{k}{v}" for k, v in opts.items())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_forward_matches_reference(rng, shape, causal):
    lead, Nq, Nk, d, opts = shape
    q, k, v = qkv(rng, (*lead, Nq, d), Nk)
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="fa1", **opts)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_backward_matches_reference(rng, shape, causal):
    lead, Nq, Nk, d, opts = shape
    q, k, v, do = qkv(rng, (*lead, Nq, d), Nk, do=True)
    o, lse = reference.attention_forward(q, k, v, causal=causal)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl="fa1", **opts)
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, causal=causal)):
        assert_close(g, r, **BWD, what=name)


def test_forward_then_backward_end_to_end(rng):
    """The backward fed with FA1's own (o, lse), causal, scale != 1/sqrt(d)."""
    q, k, v, do = qkv(rng, (2, 23, 8), 17, do=True)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, scale=0.7, impl="fa1", Br=4, Bc=8, warps=2)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, scale=0.7, impl="fa1", Br=4, Bc=8)
    ref = reference.attention_backward(q, k, v, do, causal=True, scale=0.7)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert_close(g, r, **BWD, what=name)


def test_causal_rows_without_keys_give_zero_and_minus_inf(rng):
    # Nq > Nk, bottom-right aligned: the first Nq - Nk = 6 queries see no key.
    q, k, v, do = qkv(rng, (9, 4), 3, do=True)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa1", Br=4, Bc=4, warps=2)
    assert np.all(o[:6] == 0) and np.all(lse[:6] == -np.inf)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="fa1", Br=4, Bc=4, warps=2)
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, causal=True)):
        assert_close(g, r, **BWD, what=name)


def test_every_output_and_statistic_is_written(rng):
    """Outputs start NaN-poisoned (common.empty); O, l, m, L, dQ, dK, dV must all be overwritten."""
    q, k, v, do = (common.to_device(a) for a in qkv(rng, (2, 13, 4), 11, do=True))
    O, l, m, t = fa1.forward_stats(q, k, v, causal=False, scale=0.5, Br=4, Bc=4, warps=2)
    assert (t["Br"], t["Bc"], t["warps"]) == (4, 4, 2)
    for a in (O, l, m):
        assert not np.isnan(a.copy_to_host()).any()
    O2, L = fa1.forward(q, k, v, causal=False, scale=0.5, Br=4, Bc=4, warps=2)
    np.testing.assert_allclose(L.copy_to_host(), m.copy_to_host() + np.log(l.copy_to_host()), rtol=1e-6)
    for g in fa1.backward(q, k, v, O2, L, do, causal=False, scale=0.5, Br=4, Bc=4, warps=2):
        assert not np.isnan(g.copy_to_host()).any()


# --------------------------------------------------------------------------- tiles


def test_tiles_follow_the_paper_formula():
    # Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d)   (FA1 Alg. 1 line 1)
    assert fa1.tiles(64)["Br"] == fa1.tiles(64)["Bc"] == 16          # M = 4096: 4096 / 256
    assert (fa1.tiles(16)["Br"], fa1.tiles(16)["Bc"]) == (16, 64)
    assert (fa1.tiles(32, M=2048)["Br"], fa1.tiles(32, M=2048)["Bc"]) == (16, 16)
    t = fa1.tiles(96)                                                 # ceil(4096/384) = 11 -> Bc rounded to 12
    assert (t["Br"], t["Bc"]) == (11, 12)
    assert fa1.tiles(8, Br=3, Bc=10, warps=2)["Bc"] == 10


def test_default_tiles_fit_shared_memory_for_every_head_dim():
    for d in range(1, flashnb.api.MAX_HEAD_DIM + 1):
        t = fa1.tiles(d)
        assert t["Bc"] % t["warps"] == 0
        assert max(t["shared_bytes_forward"], t["shared_bytes_backward"]) <= 48 * 1024, d


@pytest.mark.parametrize("opts, exc, word", [
    (dict(Br=0), ValueError, "Br"),
    (dict(Bc=-4), ValueError, "Bc"),
    (dict(Bc=6), ValueError, "Bc"),                # not a multiple of the 4 warps
    (dict(Br=2.5), TypeError, "Br"),
    (dict(Bc=True), TypeError, "Bc"),
    (dict(warps=0), ValueError, "warps"),
    (dict(warps=64), ValueError, "warps"),
    (dict(M=1 << 20), ValueError, "smaller M"),            # tiles over 48 KiB of shared memory
    (dict(Br=64, Bc=128), ValueError, "smaller Br/Bc"),
    (dict(block=3), TypeError, "block"),           # not an fa1 option
])
def test_bad_options_through_the_public_api(rng, opts, exc, word):
    q, k, v, do = qkv(rng, (5, 16), 6, do=True)
    with pytest.raises(exc, match=word):
        flashnb.attention_forward(q, k, v, impl="fa1", **opts)
    o, lse = reference.attention_forward(q, k, v)
    with pytest.raises(exc, match=word):
        flashnb.attention_backward(q, k, v, o, lse, do, impl="fa1", **opts)


def test_bad_inputs_through_the_public_api(rng):
    q, k, v = qkv(rng, (5, 8), 6)
    with pytest.raises(ValueError, match="same head dim"):
        flashnb.attention_forward(q, k[:, :4], v[:, :4], impl="fa1")
    with pytest.raises(ValueError, match="q"):
        flashnb.attention_forward(np.full_like(q, np.nan), k, v, impl="fa1")
    with pytest.raises(ValueError, match="scale"):
        flashnb.attention_forward(q, k, v, scale=float("inf"), impl="fa1")


# --------------------------------------------------------------------------- counted == model


MODEL_CASES = [
    (1, 20, 13, 8, True, dict(Br=8, Bc=8, warps=2)),
    (2, 13, 21, 5, False, dict(Br=4, Bc=6, warps=3)),
    (1, 17, 17, 16, False, {}),
]


@pytest.mark.parametrize("BH, Nq, Nk, d, causal, opts", MODEL_CASES)
def test_counted_traffic_equals_model(rng, BH, Nq, Nk, d, causal, opts):
    q, k, v, do = (common.to_device(a) for a in qkv(rng, (BH, Nq, d), Nk, do=True))
    with traffic.count() as t:
        O, L = fa1.forward(q, k, v, causal=causal, scale=0.4, **opts)
    assert t.summary() == fa1.model_forward(BH, Nq, Nk, d, **opts)
    with traffic.count() as t:
        fa1.backward(q, k, v, O, L, do, causal=causal, scale=0.4, **opts)
    assert t.summary() == fa1.model_backward(BH, Nq, Nk, d, **opts)


@pytest.mark.parametrize("N, d, M", [(1024, 64, 4096), (1000, 32, 2048), (4096, 128, 4096)])
def test_model_is_the_papers_count_plus_init(N, d, M):
    """Main forward kernel = 2Nd + 3·Tc·Nd + 4·Tc·N (the paper's count for Alg. 1); backward =
    4Nd + 5·Tc·Nd + Tc·N (the paper's 2·Tc·N for l and m becomes Tc·N for the single L)."""
    Tc = fa1.cdiv(N, fa1.tiles(d, M=M)["Bc"])
    init, main, lse = fa1.model_forward(1, N, N, d, M=M)
    assert sum(main["reads"].values()) + sum(main["writes"].values()) == 2 * N * d + 3 * Tc * N * d + 4 * Tc * N
    assert sum(init["writes"].values()) == N * d + 2 * N and sum(lse["reads"].values()) == 2 * N
    zero, bwd = fa1.model_backward(1, N, N, d, M=M)
    assert sum(bwd["reads"].values()) + sum(bwd["writes"].values()) == 4 * N * d + 5 * Tc * N * d + Tc * N


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_larger_shapes_default_tiles(rng, causal):
    """N = 128 with d = 64 (default Br = Bc = 16, Tc = Tr = 8) and Nq != Nk at d = 128."""
    for shape_q, Nk in [((2, 128, 64), 128), ((1, 70, 128), 45)]:
        q, k, v, do = qkv(rng, shape_q, Nk, do=True)
        o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="fa1")
        o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
        assert_close(o, o_ref, **FWD, what="o")
        assert_close(lse, lse_ref, **FWD, what="lse")
        grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl="fa1")
        for name, g, r in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, causal=causal)):
            assert_close(g, r, **BWD, what=name)


def test_dry_run_lists_allocations_without_launching():
    """common.dry_run (used by notebooks 04 and 06 for the Table 21 memory comparison) records each array a
    launcher allocates, with no device work -- even at sizes the simulator could never run."""
    from flashnb import common
    from flashnb.stages import naive

    S = common.ShapeOnly
    q = S((16 * 8, 4096, 64))
    assert [a.shape for a in common.dry_run(fa1.forward, q, q, q, causal=False, scale=0.125)] == [
        (128, 4096, 64), (128, 4096), (128, 4096), (128, 4096)]      # O, l, m, L
    assert [a.shape for a in common.dry_run(naive.forward, q, q, q, causal=False, scale=0.125)] == [
        (128, 4096, 4096), (128, 4096, 4096), (128, 4096), (128, 4096, 64)]   # S, P, L, O


# The NumPy transcriptions of Alg. 1 and Alg. 4 (float64) against the float64 reference: the same sums in
# another order, so agreement is to a few ulps of O(1)-O(10) values; 1e-12 still catches any wrong index,
# mask or merge (those give O(0.1-1) errors).  Ragged last tiles, Nq != Nk both ways, both causal alignments,
# rows that see no key (Nq > Nk, lower_right), Tc = 1 and Tc > 1.
NUMPY_SHAPES = [(40, 40, 16, 16, 16, True), (21, 13, 8, 8, 4, True), (13, 21, 8, 5, 7, "upper_left"),
                (19, 1, 8, 8, 8, True), (33, 20, 5, 8, 6, False), (7, 7, 3, 32, 32, False)]


@pytest.mark.parametrize("Nq, Nk, d, Br, Bc, causal", NUMPY_SHAPES)
def test_numpy_transcriptions_match_reference(Nq, Nk, d, Br, Bc, causal):
    rng = np.random.default_rng(Nq * 100 + Nk)
    q, do = rng.standard_normal((2, Nq, d))
    k, v = rng.standard_normal((2, Nk, d))
    O, l, m = fa1.fa1_forward_numpy(q, k, v, Br, Bc, causal=causal)
    o_ref, L_ref = reference.attention_forward(q, k, v, causal=causal)
    np.testing.assert_allclose(O, o_ref, atol=1e-12, rtol=0)
    seen = np.isfinite(L_ref)
    assert (l[~seen] == 0).all() and np.isneginf(m[~seen]).all()      # rows with no key: l = 0, m = -inf
    np.testing.assert_allclose(m[seen] + np.log(l[seen]), L_ref[seen], atol=1e-12, rtol=0)
    grads = fa1.fa1_backward_numpy(q, k, v, O, do, l, m, Br, Bc, causal=causal)
    for g, r in zip(grads, reference.attention_backward(q, k, v, do, causal=causal)):
        np.testing.assert_allclose(g, r, atol=1e-12, rtol=0)


def test_numpy_transcriptions_match_kernel_statistics():
    """The kernel's float32 l and m are Alg. 1's, tile for tile (same Br, Bc, so the same merges)."""
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((3, 40, 16))
    O, l, m = fa1.fa1_forward_numpy(q, k, v, 16, 16, causal=True, scale=0.25)
    qd, kd, vd = (common.to_device(a[None]) for a in (q, k, v))
    O_k, l_k, m_k, _ = fa1.forward_stats(qd, kd, vd, causal=True, scale=0.25, Br=16, Bc=16)
    np.testing.assert_allclose(l_k.copy_to_host()[0], l, **FWD)
    np.testing.assert_allclose(m_k.copy_to_host()[0], m, **FWD)
    np.testing.assert_allclose(O_k.copy_to_host()[0], O, **FWD)
