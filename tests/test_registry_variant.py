"""registry.variant / registry.using: a learner edits a registered kernel factory (without copying it or
registering it twice) and runs the edit through the library's own launchers."""

import inspect

import numpy as np
import pytest

import flashnb
from flashnb import reference, registry, sim
from flashnb.stages import fa2

BARRIER = "cuda.syncthreads()                       # every warp is done with K_{j-1}, V_{j-1}"


def _qkv(n=48, d=8):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, n, d)) for _ in range(3)]


def test_an_identical_variant_runs_through_the_launcher_and_matches_the_reference():
    same = registry.variant(fa2.make_forward, replace=("# line 6", "# line 6 (variant)"))
    q, k, v = _qkv()
    with registry.using(fa2.make_forward, same) as used:
        assert used is same and fa2.make_forward is same
        o = flashnb.attention(q, k, v, impl="fa2", Br=16, Bc=16, warps=2)
    assert fa2.make_forward is registry.KERNELS["fa2.forward"].factory      # restored
    # float32 accumulation over <= 48 keys of O(1) products: well within 1e-5
    assert np.abs(o - reference.attention(q, k, v)).max() < 1e-5
    assert "# line 6 (variant)" in inspect.getsource(same.__wrapped__)   # the source lives in linecache
    assert same(16, 16, 8, 2, False) is same(Br=16, Bc=16, d=8, warps=2, causal=False)   # memoised
    assert "fa2.forward" in registry.KERNELS and sum(1 for s in registry.KERNELS.values()
                                                     if s.factory is same) == 0   # registered nowhere


@pytest.mark.skipif(flashnb.MODE != "sim", reason="the sanitizer runs on the simulator")
def test_removing_a_barrier_is_reported_at_the_variants_lines():
    no_barrier = registry.variant(fa2.make_forward, replace=(BARRIER, "pass"))
    q, k, v = _qkv()
    with registry.using(fa2.make_forward, no_barrier), sim.sanitize(tools="racecheck", raise_on_error=False) as rep:
        flashnb.attention(q, k, v, impl="fa2", Br=16, Bc=16, warps=2)
    assert rep.findings and all("<variant of flashnb.stages.fa2.make_forward>" in f.where for f in rep.findings)
    assert {f.message.split(" race on shared ")[1].split("[")[0] for f in rep.findings} == {"KsT", "Vs"}


def test_bad_edits_are_clear_errors():
    with pytest.raises(ValueError, match="occurs 0 times"):
        registry.variant(fa2.make_forward, replace=("no such text", "x"))
    with pytest.raises(ValueError, match=r"occurs \d+ times"):
        registry.variant(fa2.make_forward, replace=("cuda.syncthreads()", "pass"))   # more than once
    with pytest.raises(TypeError, match="pair"):
        registry.variant(fa2.make_forward, replace=[("a",)])
    with pytest.raises(ValueError, match="exactly one function"):
        registry.variant(fa2.make_forward, source="x = 1\n")
    with pytest.raises(ValueError, match="module attribute"):
        registry.using(lambda: None, fa2.make_forward)
