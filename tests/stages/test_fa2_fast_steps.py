"""Stage 6 step by step (flashnb.stages.fa2_fast_steps): every step computes S = Q Kᵀ right, and each changes what it
claims to change -- bank conflicts (simulator profile) and the SASS of the line-8 loop (nvdisasm)."""

import numpy as np
import pytest

import flashnb  # noqa: F401
from flashnb import sim
from flashnb.instruments import sass
from flashnb.stages import fa2_fast_steps as st


@pytest.mark.parametrize("name, kernel, factory", st.STEPS, ids=[s[0] for s in st.STEPS])
def test_each_step_computes_q_k_transpose_and_its_conflicts(name, kernel, factory):
    d = 32
    with sim.profile() as prof:
        S, ref = st.run(factory, d, seed=3)
    assert not np.isnan(S).any(), f"{name}: an element of S was never written"
    # float32 sums of d = 32 products of N(0, 1) values: each |partial sum| <= ~3 sqrt(d); rounding error of a
    # d-term float32 sum is below d · 2^-24 · that, about 1e-4 -- 1e-3 leaves room, a wrong index fails by O(1)
    np.testing.assert_allclose(S, ref, rtol=0, atol=1e-3)
    assert prof.total(memory="shared", op="ld")["bank_conflicts"] == 0    # reads: broadcasts, distinct banks
    stores = prof.total(memory="shared", op="st")["bank_conflicts"]
    if name in ("stage 4", "32-bit indices"):
        assert stores > 0                      # QsT[k, r]: the lanes store down a column
    else:
        assert stores == 0                     # padded or swizzled rows


@pytest.mark.parametrize("prefetch", [False, True])
def test_streaming_step_computes_every_tile(prefetch):
    S, ref = st.run_stream(prefetch, tiles=3, seed=4)
    assert not np.isnan(S).any()
    np.testing.assert_allclose(S, ref, rtol=0, atol=1e-3)     # as above: float32 sums of d = 32 products


def test_sass_steps_change_what_they_claim():
    if sass.find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (it comes with flashnb's pinned toolchain)")
    jobs = [(kernel, dict(d=64)) for _, kernel, _ in st.STEPS]
    jobs += [("fa2_fast_steps.stream", dict(d=32, prefetch=p)) for p in (False, True)]
    compiled = sass.sass_many(jobs)
    plain, prefetched = compiled[-2:]
    # register prefetch: every K_{j+1} load is issued a whole tile of work before its result is needed (the
    # plain copy's loads are used within the copy), for the registers that hold the next tile
    assert min(st.load_to_use(prefetched)) > 2 * max(st.load_to_use(plain))
    assert prefetched.resources.registers > plain.resources.registers
    mixes = {}
    for (name, _, _), s in zip(st.STEPS, compiled):
        hot = s.hot_loop
        mixes[name] = (s.mix(hot), s.load_widths(hot), s.fma_fraction(hot), len(s.instructions), s.mix()["ldl"])
    for name, (mix, widths, _, _, local) in mixes.items():
        assert local == 0 and mix["fp64"] == 0, name
        assert set(widths) == ({32} if name in ("stage 4", "32-bit indices") else {128}), (name, widths)
    assert mixes["32-bit indices"][3] < mixes["stage 4"][3]              # fewer instructions in all
    assert mixes["32-bit indices"][0]["int"] < mixes["stage 4"][0]["int"]
    assert mixes["128-bit loads, padded rows"][2] > 0.8 > mixes["32-bit indices"][2]
