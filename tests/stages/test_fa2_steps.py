"""Stage 4, step by step (flashnb.stages.fa2_steps): the NumPy transcriptions of FA2 Alg. 1 and 2, and the step
kernels (a) one thread per row and (b) rows split over warps, forward and backward -- against the float64
reference, counted traffic against their models, the FMAs per shared read and the dQ atomics each step
claims, bad options, and race freedom."""

import numpy as np
import pytest
from conftest import assert_close, qkv

import flashnb
from flashnb import common, reference
from flashnb.instruments import traffic
from flashnb.stages import fa2, fa2_steps

# Float32 kernels vs the float64 reference: every output element is a sum of at most max(Nk, d) <= 64
# products of O(1) values accumulated in float32 (~64 · 6e-8 ≈ 4e-6 relative); a wrong index, mask or
# skipped tile gives errors of O(0.1 - 1), far above this bound (the same bound as tests/stages/test_fa2.py).
FWD = dict(atol=2e-5, rtol=2e-5)
# The backward chains four such sums (S, P, dP, dS) and adds dQ over up to Nk keys in float32: 1e-4, as
# tests/stages/test_fa2.py holds stage 4's backward to.
BWD = dict(atol=1e-4, rtol=1e-4)
# The NumPy transcriptions run in float64 like the reference and differ only in summation order and the
# online rescaling: rounding of O(1e-16) per operation, a few hundred operations per element.
F64 = dict(atol=1e-12, rtol=1e-12)

STEPS = {"fa2-rows": fa2_steps.model_rows_forward, "fa2-splitq": fa2_steps.model_splitq_forward}
BWD_STEPS = {"fa2-rows": fa2_steps.model_rows_backward, "fa2-splitq": fa2_steps.model_splitq_backward}

# (BH, Nq, Nk, d, tiles per impl): Nq != Nk both ways (fully masked causal rows when Nq > Nk), lengths that
# are not multiples of the tiles, N = 1, odd d, two warps, and two rows per lane for split-Q.
SHAPES = [
    (1, 1, 1, 1, {"fa2-rows": dict(Br=16, Bc=8), "fa2-splitq": dict(Br=32, Bc=8, warps=1)}),
    (2, 19, 37, 5, {"fa2-rows": dict(Br=16, Bc=8), "fa2-splitq": dict(Br=32, Bc=8, warps=1)}),
    (1, 40, 24, 12, {"fa2-rows": dict(Br=16, Bc=16), "fa2-splitq": dict(Br=64, Bc=16, warps=1)}),
    (2, 70, 45, 16, {"fa2-rows": dict(Br=64, Bc=16), "fa2-splitq": dict(Br=64, Bc=16, warps=2)}),
]
IDS = [f"BH{s[0]}-{s[1]}x{s[2]}-d{s[3]}" for s in SHAPES]


# --------------------------------------------------------------------------- NumPy transcriptions


NP_SHAPES = [(1, 1, 1, 4, 4), (33, 33, 8, 16, 8), (20, 45, 5, 8, 16), (45, 20, 7, 16, 16), (64, 64, 16, 64, 32)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Nq, Nk, d, Br, Bc", NP_SHAPES)
def test_numpy_algorithm1_matches_reference(rng, Nq, Nk, d, Br, Bc, causal):
    q, k, v = qkv(rng, (Nq, d), Nk)
    O, L = fa2_steps.fa2_forward_numpy(q, k, v, Br, Bc, causal=causal)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
    assert_close(O, o_ref, **F64, what="O")
    assert_close(L, lse_ref, **F64, what="L")   # -inf exactly on rows with no allowed key


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Nq, Nk, d, Br, Bc", NP_SHAPES)
def test_numpy_algorithm2_matches_reference(rng, Nq, Nk, d, Br, Bc, causal):
    q, k, v, do = qkv(rng, (Nq, d), Nk, do=True)
    o, lse = reference.attention_forward(q, k, v, causal=causal, scale=0.3)
    grads = fa2_steps.fa2_backward_numpy(q, k, v, o, do, lse, Br, Bc, causal=causal, scale=0.3)
    for name, g, r in zip(("dQ", "dK", "dV"), grads, reference.attention_backward(q, k, v, do, causal=causal,
                                                                                  scale=0.3)):
        assert_close(g, r, atol=1e-11, rtol=1e-11, what=name)   # values reach O(10): a little more room


def test_numpy_transcriptions_tag_every_line():
    """Every line of the paper's algorithms the transcription implements carries its tag."""
    import inspect
    import re

    for fn, lines in ((fa2_steps.fa2_forward_numpy, range(2, 16)), (fa2_steps.fa2_backward_numpy, range(3, 19))):
        tagged = set()
        for tag in re.findall(r"# lines? (\d+(?:-\d+)?(?:, \d+)*)", inspect.getsource(fn)):
            for part in re.split(r", ", tag):
                a, _, b = part.partition("-")
                tagged.update(range(int(a), int(b or a) + 1))
        missing = set(lines) - tagged - {11, 17}          # 11, 17: "end for"
        assert not missing, f"{fn.__name__}: no tag for lines {sorted(missing)}"


# --------------------------------------------------------------------------- step kernels


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("BH, Nq, Nk, d, tiles", SHAPES, ids=IDS)
@pytest.mark.parametrize("impl", list(STEPS))
def test_step_matches_reference(rng, impl, BH, Nq, Nk, d, tiles, causal):
    q, k, v = qkv(rng, (BH, Nq, d), Nk)
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl=impl, **tiles[impl])
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
    assert_close(o, o_ref, **FWD, what="o")        # also: no NaN poison left, -inf exactly where expected
    assert_close(lse, lse_ref, **FWD, what="lse")


@pytest.mark.parametrize("impl", list(STEPS))
@pytest.mark.parametrize("d", [32, 100])
def test_default_tiles(rng, impl, d):
    """The default tiles (the tour's), both head-dim classes, a scale, and their static shared memory."""
    q, k, v = qkv(rng, (1, 37, d), 29)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, scale=0.3, impl=impl)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True, scale=0.3)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")
    for dd in (1, 64, 65, 128):
        t = fa2_steps.rows_tiles(dd)
        assert 4 * 2 * t["Bc"] * dd <= 48 * 1024
        t = fa2_steps.splitq_tiles(dd)
        assert 4 * (t["Br"] + 2 * t["Bc"]) * dd <= 48 * 1024


def _dev(*arrays):
    return [common.to_device(np.asarray(a, dtype=np.float32)) for a in arrays]


@pytest.mark.parametrize("BH, Nq, Nk, d, causal, tiles", [
    (2, 24, 40, 12, False, {"fa2-rows": dict(Br=16, Bc=16), "fa2-splitq": dict(Br=32, Bc=16, warps=1)}),
    (1, 40, 24, 20, True, {"fa2-rows": dict(Br=32, Bc=8), "fa2-splitq": dict(Br=64, Bc=8, warps=2)}),
    (1, 70, 47, 8, True, {"fa2-rows": dict(Br=64, Bc=16), "fa2-splitq": dict(Br=64, Bc=16, warps=1)}),
])
def test_counted_traffic_equals_model(rng, BH, Nq, Nk, d, causal, tiles):
    q, k, v = _dev(*qkv(rng, (BH, Nq, d), Nk))
    for impl, launcher in (("fa2-rows", fa2_steps.forward_rows), ("fa2-splitq", fa2_steps.forward_splitq)):
        with traffic.count() as t:
            launcher(q, k, v, causal=causal, scale=0.25, **tiles[impl])
        assert t.summary() == STEPS[impl](BH, Nq, Nk, d, causal=causal, **tiles[impl]), impl


def test_fmas_per_shared_read_of_the_three_steps(rng):
    """What each step claims, from counts: (a) one shared read per FMA (Q in registers), (b) 2/3 FMA per read
    (Q_i read from shared memory with every K_j element), (c) fa2's micro-tiles, fa2.fmas_per_shared_read."""
    BH, N, d, Br, Bc, warps = 1, 64, 16, 32, 16, 1
    q, k, v = _dev(*qkv(rng, (BH, N, d), N))
    fmas = 2 * BH * N * N * d                        # S = QKᵀ and P~V, no padding at these sizes
    reads = {}
    for name, call in (("a", lambda: fa2_steps.forward_rows(q, k, v, scale=0.25, Br=Br, Bc=Bc)),
                       ("b", lambda: fa2_steps.forward_splitq(q, k, v, scale=0.25, Br=Br, Bc=Bc, warps=warps)),
                       ("c", lambda: fa2.forward(q, k, v, scale=0.25, Br=Br, Bc=Bc, warps=warps))):
        with traffic.count() as t:
            call()
        reads[name] = t.summary()[0]["shared_reads"]
    assert fmas / reads["a"] == 1.0
    assert fmas / reads["b"] == pytest.approx(2 / 3)
    assert fmas / reads["c"] == pytest.approx(fa2.fmas_per_shared_read(Br, Bc, d, warps)["tile"])


@pytest.mark.parametrize("impl, opts, err, word", [
    ("fa2-splitq", dict(Br=48, warps=1), ValueError, "Br=48"),
    ("fa2-splitq", dict(Br=64, warps=4), ValueError, "Br=64"),
    ("fa2-splitq", dict(warps=0), ValueError, "warps"),
    ("fa2-splitq", dict(Bc=16.0), TypeError, "Bc"),
    ("fa2-rows", dict(Br=2048), ValueError, "Br=2048"),
    ("fa2-rows", dict(Br=True), TypeError, "Br"),
    ("fa2-rows", dict(warps=1), TypeError, "warps"),
])
def test_bad_options(rng, impl, opts, err, word):
    q, k, v = qkv(rng, (1, 8, 8), 8)
    with pytest.raises(err, match=word):
        flashnb.attention_forward(q, k, v, impl=impl, **opts)


# (BH, Nq, Nk, d, backward tiles per impl): the backward's block owns Bc key rows (one thread each in step (a),
# a multiple of 32·warps in step (b)); ragged key blocks, Nq != Nk both ways, two warps, two key rows per lane.
BWD_SHAPES = [
    (1, 1, 1, 1, {"fa2-rows": dict(Br=8, Bc=16), "fa2-splitq": dict(Br=8, Bc=32, warps=1)}),
    (2, 19, 37, 5, {"fa2-rows": dict(Br=16, Bc=8), "fa2-splitq": dict(Br=16, Bc=32, warps=1)}),
    (1, 40, 24, 12, {"fa2-rows": dict(Br=8, Bc=16), "fa2-splitq": dict(Br=16, Bc=64, warps=1)}),
    (2, 45, 70, 16, {"fa2-rows": dict(Br=16, Bc=32), "fa2-splitq": dict(Br=8, Bc=64, warps=2)}),
]
BWD_IDS = [f"BH{s[0]}-{s[1]}x{s[2]}-d{s[3]}" for s in BWD_SHAPES]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("BH, Nq, Nk, d, tiles", BWD_SHAPES, ids=BWD_IDS)
@pytest.mark.parametrize("impl", list(BWD_STEPS))
def test_backward_step_matches_reference(rng, impl, BH, Nq, Nk, d, tiles, causal):
    q, k, v, do = qkv(rng, (BH, Nq, d), Nk, do=True)
    o, lse = reference.attention_forward(q, k, v, causal=causal)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl=impl, **tiles[impl])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, causal=causal)):
        assert_close(g, g_ref, **BWD, what=name)   # also: no NaN poison left in dK, dV


@pytest.mark.parametrize("impl", list(BWD_STEPS))
def test_backward_default_tiles(rng, impl):
    """The default backward tiles of both head-dim classes, a scale, and their static shared memory."""
    for d in (24, 100):
        q, k, v, do = qkv(rng, (1, 37, d), 29, do=True)
        o, lse = reference.attention_forward(q, k, v, causal=True, scale=0.3)
        grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, scale=0.3, impl=impl)
        for name, g, g_ref in zip("qkv", grads, reference.attention_backward(q, k, v, do, causal=True, scale=0.3)):
            assert_close(g, g_ref, **BWD, what="d" + name)
    for dd in (1, 64, 65, 128):
        for step, tiles in (("rows", fa2_steps.rows_tiles(dd, direction="backward")),
                            ("splitq", fa2_steps.splitq_tiles(dd, direction="backward"))):
            assert fa2_steps.shared_bytes(step, tiles["Br"], tiles["Bc"], dd, "backward") <= 48 * 1024


@pytest.mark.parametrize("BH, Nq, Nk, d, causal, tiles", [
    (2, 24, 40, 12, False, {"fa2-rows": dict(Br=16, Bc=16), "fa2-splitq": dict(Br=16, Bc=32, warps=1)}),
    (1, 40, 24, 20, True, {"fa2-rows": dict(Br=8, Bc=32), "fa2-splitq": dict(Br=8, Bc=64, warps=2)}),
    (1, 47, 70, 8, True, {"fa2-rows": dict(Br=16, Bc=16), "fa2-splitq": dict(Br=16, Bc=32, warps=1)}),
])
def test_backward_counted_traffic_equals_model(rng, BH, Nq, Nk, d, causal, tiles):
    q, k, v, do = qkv(rng, (BH, Nq, d), Nk, do=True)
    o, lse = reference.attention_forward(q, k, v, causal=causal)
    args = _dev(q, k, v, o, lse, do)
    for impl, launcher in (("fa2-rows", fa2_steps.backward_rows), ("fa2-splitq", fa2_steps.backward_splitq)):
        with traffic.count() as t:
            launcher(*args, causal=causal, scale=0.25, **tiles[impl])
        assert t.summary() == BWD_STEPS[impl](BH, Nq, Nk, d, causal=causal, **tiles[impl]), impl


def test_dq_atomics_of_the_three_backward_steps(rng):
    """What each backward step claims about Alg. 2 line 15, from counts (no mask, no ragged tile): (a) every key
    row adds its own term, Nq·Nk·d atomics; (b) and (c) the block sums dS_ij K_j first, Tc·Nq·d -- Bc times fewer."""
    BH, N, d, Br, Bc = 1, 64, 8, 16, 32
    q, k, v, do = qkv(rng, (BH, N, d), N, do=True)
    o, lse = reference.attention_forward(q, k, v)
    args = _dev(q, k, v, o, lse, do)
    atomics = {}
    for name, call in (("a", lambda: fa2_steps.backward_rows(*args, scale=0.25, Br=Br, Bc=Bc)),
                       ("b", lambda: fa2_steps.backward_splitq(*args, scale=0.25, Br=Br, Bc=Bc, warps=1)),
                       ("c", lambda: fa2.backward(*args, scale=0.25, Br=Br, Bc=Bc, warps=1))):
        with traffic.count() as t:
            call()
        atomics[name] = t.summary()[1]["atomics"]["dQ"]
    assert atomics["a"] == N * N * d
    assert atomics["b"] == atomics["c"] == (N // Bc) * N * d == atomics["a"] // Bc


@pytest.mark.parametrize("impl, opts, err, word", [
    ("fa2-splitq", dict(Bc=48, warps=1), ValueError, "Bc=48"),
    ("fa2-splitq", dict(Bc=64, warps=4), ValueError, "Bc=64"),
    ("fa2-splitq", dict(Br=64, Bc=64, warps=2), ValueError, "shared memory"),
    ("fa2-rows", dict(Bc=2048), ValueError, "Bc=2048"),
    ("fa2-rows", dict(Br=128), ValueError, "shared memory"),
    ("fa2-rows", dict(Bc=8.0), TypeError, "Bc"),
])
def test_backward_bad_options(rng, impl, opts, err, word):
    q, k, v, do = qkv(rng, (1, 8, 64), 8, do=True)
    o, lse = reference.attention_forward(q, k, v)
    with pytest.raises(err, match=word):
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, **opts)


@pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator-only tool")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_race_free(rng, causal):
    """Two warps per block and several K/V tiles per block, so a missing barrier between one tile's reads
    and the next tile's reload would be a race."""
    from flashnb.sim import racecheck

    q, k, v = qkv(rng, (1, 40, 8), 56)
    for impl, opts in (("fa2-rows", dict(Br=64, Bc=16)), ("fa2-splitq", dict(Br=64, Bc=16, warps=2))):
        with racecheck.check(raise_on_race=True) as report:
            flashnb.attention_forward(q, k, v, causal=causal, impl=impl, **opts)
        assert report.launches == 1 and not report.races, impl


@pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator-only tool")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_race_free(rng, causal):
    """Several query tiles per key block and, in step (b), two warps exchanging dS through shared memory: a
    missing barrier around a tile's load or before the dQ sum would be a race."""
    from flashnb.sim import racecheck

    q, k, v, do = qkv(rng, (1, 40, 8), 56, do=True)
    o, lse = reference.attention_forward(q, k, v, causal=causal)
    for impl, opts in (("fa2-rows", dict(Br=8, Bc=32)), ("fa2-splitq", dict(Br=8, Bc=64, warps=2))):
        with racecheck.check(raise_on_race=True) as report:
            flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl=impl, **opts)
        assert report.launches == 2 and not report.races, impl   # the D launch and the step's
