"""Stage 7 (the lesson, flashnb.stages.tensor_cores): FA2's forward on tensor cores against the float64 reference,
over every head dim it takes and lengths at the tile boundaries, dense and causal in both alignments; outputs
fully written; no bank conflicts with the swizzle (and conflicts without it); the cp.async mistakes notebook 12
makes are caught by the sanitizer; bad input refused by name."""

import warnings

import numpy as np
import pytest
from conftest import assert_close
from half_rule import maxerr, torch_half

import flashnb
from flashnb import reference, registry, sim
from flashnb.stages import tensor_cores as tc

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator checks")

# Two warps (Br = 32) and Bc = 16: lengths Br - 1, Br, Br + 1 of queries and 2·Bc - 1, 2·Bc, 2·Bc + 1 of keys put a
# partial, a full and a one-row Q tile, and two or three K/V tiles (the second buffer, then the first refilled),
# under every launch; with Nq > Nk bottom-right the first rows see no key (O = 0, L = -inf).
TILES = dict(Br=32, Bc=16, warps=2)
LENGTHS = [(31, 33), (32, 32), (33, 31)]
CAUSAL = [False, True, "upper_left"]


def _inputs(rng, BH, Nq, Nk, d):
    """float16 q, k, v, their exact float64 values (the reference's inputs) and float16 torch tensors."""
    held = [rng.standard_normal((BH, n, d)).astype(np.float16) for n in (Nq, Nk, Nk)]
    exact = [h.astype(np.float64) for h in held]
    return held, exact, [torch.tensor(e, dtype=torch.float16) for e in exact]


@pytest.mark.parametrize("causal", CAUSAL, ids=["dense", "causal", "upper-left"])
@pytest.mark.parametrize("Nq, Nk", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
@pytest.mark.parametrize("d", tc.HEAD_DIMS)
def test_forward_within_flashattentions_rule(rng, d, Nq, Nk, causal):
    (q, k, v), exact, tensors = _inputs(rng, 2, Nq, Nk, d)
    scale = 1 / np.sqrt(d)
    o, lse = tc.attention(q, k, v, causal=causal, **TILES)        # outputs start NaN-poisoned (common.empty)
    o_ref, lse_ref = reference.attention_forward(*exact, causal=causal)
    o64 = o.astype(np.float64)
    assert not np.isnan(o64).any() and not np.isnan(lse).any()    # every element written
    # float16 inputs, P rounded to float16 before P V_j, O stored in float16: FlashAttention's rule for halves --
    # against the float64 reference of the (exact) half inputs, the output's error is at most 2x that of the same
    # attention computed by PyTorch in float16 (what a user of half precision accepts already).
    pt = torch_half(*tensors, torch.zeros_like(tensors[0]), causal, scale)[0]
    assert maxerr(o64, o_ref) <= 2 * maxerr(pt, o_ref), (maxerr(o64, o_ref), maxerr(pt, o_ref))
    assert np.array_equal(o64[~np.isfinite(lse_ref)], np.zeros_like(o64[~np.isfinite(lse_ref)]))   # no key: O = 0
    # L is float32 from exact half inputs through float32 accumulators: float32 rounding only (measured <= 1e-6);
    # -inf exactly on the rows that see no key
    assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5, what="lse")


def test_default_tiles_and_a_negative_scale(rng):
    """The default tiles (four warps, Bc = 64 at d = 64) on a few heads, and scale < 0 (the max is of the scaled
    scores: a negative scale turns the row's order around)."""
    (q, k, v), exact, tensors = _inputs(rng, 3, 70, 90, 64)
    for scale in (0.125, -0.2):
        o, lse = tc.attention(q, k, v, causal=True, scale=scale)
        o_ref, lse_ref = reference.attention_forward(*exact, causal=True, scale=scale)
        pt = torch_half(*tensors, torch.zeros_like(tensors[0]), True, scale)[0]
        assert maxerr(o.astype(np.float64), o_ref) <= 2 * maxerr(pt, o_ref)
        assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5, what=f"lse, scale {scale}")


def test_swizzle_removes_the_bank_conflicts(rng):
    """Region ``layout``: with the swizzle every ldmatrix phase takes one wavefront; the plain layout (notebook 12's
    counter-example) has conflicts at d = 64."""
    q, k, v = (rng.standard_normal((1, 64, 64)).astype(np.float16) for _ in range(3))
    plain = registry.variant(tc.make_forward, region="layout", replace=("swizzled_layout", "plain_layout"))
    conflicts = {}
    for name, factory in (("swizzled", tc.make_forward), ("plain", plain)):
        with registry.using(tc.make_forward, factory), sim.profile() as prof:
            tc.attention(q, k, v, Br=32, Bc=32, warps=2)
        conflicts[name] = prof.total(memory="shared", op="ld")["bank_conflicts"]
    assert conflicts["swizzled"] == 0 and conflicts["plain"] > 0, conflicts


def test_clean_under_the_sanitizer_and_its_mistakes_caught(rng):
    """The kernel passes the sanitizer's tools; without the wait (region ``kv-load``) a warp reads shared memory no
    copy has written yet (initcheck), without the barrier one another warp's copy wrote, unordered (racecheck)."""
    q, k, v = (rng.standard_normal((1, 40, 16)).astype(np.float16) for _ in range(3))
    with sim.sanitize():
        tc.attention(q, k, v, causal=True, Br=32, Bc=16, warps=2)
    for change, tool in ((("mma.cp_async_wait_group(1)", "pass"), "initcheck"),
                         (("cuda.syncthreads()", "pass"), "racecheck")):
        broken = registry.variant(tc.make_forward, region="kv-load", replace=change)
        with registry.using(tc.make_forward, broken), sim.sanitize(raise_on_error=False) as report, \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)     # NaN from shared memory nothing wrote
            tc.attention(q, k, v, Br=32, Bc=16, warps=2)
        assert tool in {f.tool for f in report.findings}, (change, [f.tool for f in report.findings])


def test_bad_input_is_refused_by_name(rng):
    q = rng.standard_normal((1, 16, 64))
    with pytest.raises(TypeError, match="float16 q"):
        tc.forward(*(flashnb.common.to_device(q) for _ in range(3)), scale=0.1)
    with pytest.raises(ValueError, match="head dim d must be one of"):
        tc.attention(*(q[..., :48].astype(np.float16) for _ in range(3)))
    with pytest.raises(ValueError, match="16·warps"):
        tc.attention(*(q.astype(np.float16) for _ in range(3)), Br=32, warps=1)
    with pytest.raises(ValueError, match="48 KiB"):
        tc.attention(*(q.astype(np.float16) for _ in range(3)), Bc=256)
