"""Stage 4, step by step (flashnb.stages.fa2_steps): the NumPy transcriptions of FA2 Alg. 1 and 2, and the step
kernels (a) one thread per row and (b) split-Q warps -- against the float64 reference, counted traffic
against their models, the FMAs per shared read each step claims, bad options, and race freedom."""

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
# The NumPy transcriptions run in float64 like the reference and differ only in summation order and the
# online rescaling: rounding of O(1e-16) per operation, a few hundred operations per element.
F64 = dict(atol=1e-12, rtol=1e-12)

STEPS = {"fa2-rows": fa2_steps.model_rows_forward, "fa2-splitq": fa2_steps.model_splitq_forward}

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


def test_forward_only(rng):
    q, k, v, do = qkv(rng, (1, 8, 8), 8, do=True)
    o, lse = reference.attention_forward(q, k, v)
    for impl in STEPS:
        with pytest.raises(ValueError, match="backward"):
            flashnb.attention_backward(q, k, v, o, lse, do, impl=impl)


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
