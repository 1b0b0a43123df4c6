"""Flash-decoding (flashnb.kernels.decode): split-KV partials and their merge against the float64 reference, the merge
kernel alone against NumPy, the KV-cache append helper, counted traffic against the model, the split heuristic,
the modelled comparison with FA2's forward at Nq = 1, and bad inputs."""

import math

import numpy as np
import pytest
from conftest import assert_close, qkv

import flashnb
from flashnb import common, reference
from flashnb.instruments import roofline, traffic
from flashnb.instruments.measure import decode as measure
from flashnb.kernels import decode
from flashnb.kernels.launch import decode as host
from flashnb.kernels.models import decode as decode_models
from flashnb.stages import fa2

# Float32 kernels vs the float64 reference.  Each output element is a dot product of d <= 64 terms (the score),
# then a sum over <= 128 keys of weights <= 1 times O(1) values, split into chunks and re-weighted once by the
# merge: a few float32 sums of <= 128 terms, ~128 · 6e-8 ≈ 8e-6 each.  A wrong chunk boundary, mask or
# merge weight gives errors of O(0.1 - 1), far above.
TOL = dict(atol=2e-5, rtol=2e-5)
CAPACITY = 128   # the cache is larger than its filled part: positions >= length hold NaN (the poison)


def _cache(k, v, capacity=CAPACITY):
    return host.KVCache(k.shape[0], capacity, k.shape[2]).append(k, v)


# (BH_q, BH_kv, Nq, length, d, num_splits, warps, causal): lengths not a multiple of the tile (32·warps);
# more splits than tiles (empty splits: 100 keys in 5 chunks of 32, the last one empty; 40 keys in 2 chunks
# of 64); length < Nq (causal: the first queries see no key, lse = -inf); grouped-query K/V (3 query heads
# share a K/V head: 9 rows, a block of 8 straddling query heads and a block of 1); 8 queries.
CASES = [
    (2, 2, 1, 70, 16, 3, 1, True),
    (6, 2, 3, 45, 8, 2, 1, "upper_left"),
    (1, 1, 3, 100, 8, 5, 1, True),
    (1, 1, 8, 40, 20, 2, 2, False),
    (1, 1, 5, 3, 8, 2, 1, True),
    (4, 2, 2, 50, 8, 2, 1, True),
    (1, 1, 1, 128, 64, 4, 1, True),
]
IDS = [f"bh{c[0]}/{c[1]}-nq{c[2]}-len{c[3]}-d{c[4]}-s{c[5]}-w{c[6]}-{c[7] if c[7] else 'full'}" for c in CASES]


@pytest.mark.parametrize("BH, BHkv, Nq, length, d, S, warps, causal", CASES, ids=IDS)
def test_decode_matches_reference(rng, BH, BHkv, Nq, length, d, S, warps, causal):
    q = rng.standard_normal((BH, Nq, d))
    k, v = rng.standard_normal((2, BHkv, length, d))
    O, L = host.decode(q, _cache(k, v), causal=causal, num_splits=S, warps=warps)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
    assert_close(O.copy_to_host(), o_ref, **TOL, what="o")    # also: no NaN left, -inf exactly where expected
    assert_close(L.copy_to_host(), lse_ref, **TOL, what="lse")


def test_public_api_4d_gqa_upper_left_and_query_groups(rng):
    """flashnb.attention(impl="flash-decoding"): (B, H, N, d) inputs with fewer K/V heads, both causal
    alignments, and 11 queries (two groups of at most 8 on gridDim.z)."""
    q = rng.standard_normal((1, 2, 2, 8))
    k, v = rng.standard_normal((2, 1, 1, 45, 8))
    for causal in (True, "upper_left"):
        o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="flash-decoding", num_splits=3, warps=1)
        o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
        assert_close(o, o_ref, **TOL, what=f"o ({causal})")
        assert_close(lse, lse_ref, **TOL, what=f"lse ({causal})")
    q, k, v = qkv(rng, (1, 11, 4), 20)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="flash-decoding", num_splits=2, warps=1)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
    assert_close(o, o_ref, **TOL, what="o (11 queries)")
    assert_close(lse, lse_ref, **TOL, what="lse (11 queries)")


# --------------------------------------------------------------------------- the merge kernel alone


def test_merge_kernel_alone_matches_numpy(rng):
    BH, S, Nq, d = 2, 37, 3, 40                       # S > 32: two rounds of the lanes; d > 32: two columns per lane
    O_part = rng.standard_normal((BH, S, Nq, d))
    L_part = 3 * rng.standard_normal((BH, S, Nq))
    L_part[0, ::4, 1] = -np.inf                       # splits with no allowed key
    L_part[1, :, 2] = -np.inf                         # a row with no key at all
    O_part[L_part == -np.inf] = 0.0                   # what the split kernel writes there
    O = common.empty((BH, Nq, d))
    L = common.empty((BH, Nq))
    common.launch(decode.make_merge(d), (Nq, BH), 32, common.to_device(O_part), common.to_device(L_part), O, L)
    O_part32, L_part32 = O_part.astype(np.float32).astype(np.float64), L_part.astype(np.float32).astype(np.float64)
    want_L = np.logaddexp.reduce(L_part32, axis=1)    # log Σ_s e^(L_s), -inf when every split is -inf
    with np.errstate(invalid="ignore"):
        weights = np.where(np.isfinite(want_L)[:, None], np.exp(L_part32 - want_L[:, None]), 0.0)
    want_O = np.einsum("bsq,bsqd->bqd", np.nan_to_num(weights), O_part32)
    # 37 float32 terms of O(1) weights times O(1) values; exp/log of O(10) arguments: ~1e-6, 1e-5 leaves room
    assert_close(O.copy_to_host(), want_O, atol=1e-5, rtol=1e-5, what="merged O")
    assert_close(L.copy_to_host(), want_L, atol=1e-5, rtol=1e-5, what="merged L")


# --------------------------------------------------------------------------- the cache


def test_append_writes_rows_and_leaves_the_rest_unwritten(rng):
    cache = host.KVCache(2, 10, 5)
    k1, v1 = rng.standard_normal((2, 2, 3, 5))
    k2, v2 = rng.standard_normal((2, 2, 4, 5))
    cache.append(k1, v1).append(common.to_device(k2), common.to_device(v2))   # NumPy, then device arrays
    assert cache.length == 7 and cache.free == 3
    K, V = cache.K.copy_to_host(), cache.V.copy_to_host()
    np.testing.assert_array_equal(K[:, :7], np.concatenate([k1, k2], axis=1).astype(np.float32))
    np.testing.assert_array_equal(V[:, :7], np.concatenate([v1, v2], axis=1).astype(np.float32))
    assert np.isnan(K[:, 7:]).all() and np.isnan(V[:, 7:]).all()    # the poison: never written
    with pytest.raises(ValueError, match=r"cache is full: 4 new positions do not fit in the 3 left"):
        cache.append(k2, v2)
    assert cache.length == 7


@pytest.mark.parametrize("k_new, error, says", [
    (np.ones((2, 3, 4)), ValueError, r"k_new must have shape \(heads, n_new, d\) = \(2, n_new >= 1, 5\), got "
                                     r"\(2, 3, 4\)"),
    (np.ones((3, 5)), ValueError, r"k_new must have shape \(heads, n_new, d\)"),
    (np.ones((2, 3, 5), dtype=complex), TypeError, "k_new must hold real numbers"),
    (np.full((2, 3, 5), np.nan), ValueError, "k_new contains NaN or inf"),
    ("device float64", TypeError, "k_new must be float32"),
])
def test_append_refuses_bad_rows(k_new, error, says):
    from numba import cuda

    cache = host.KVCache(2, 10, 5)
    if isinstance(k_new, str):
        k_new = cuda.to_device(np.ones((2, 3, 5)))
    with pytest.raises(error, match=says):
        cache.append(k_new, np.ones((2, 3, 5)))
    assert cache.length == 0


# --------------------------------------------------------------------------- traffic and models


@pytest.mark.parametrize("BH, BHkv, Nq, length, d, S, warps, causal", [
    (2, 1, 3, 100, 8, 5, 1, True),      # GQA (two query heads' 6 rows in one block), empty split, causal
    (1, 1, 10, 70, 12, 2, 2, False),    # two blocks of rows, two warps
    (4, 1, 3, 50, 8, 3, 1, "upper_left"),   # GQA, 12 rows: a block of 8 rows straddling query heads, then 4
])
def test_counted_traffic_equals_model(rng, BH, BHkv, Nq, length, d, S, warps, causal):
    q = rng.standard_normal((BH, Nq, d))
    k, v = rng.standard_normal((2, BHkv, length, d))
    cache = _cache(k, v)
    with traffic.count() as t:
        host.decode(q, cache, causal=causal, num_splits=S, warps=warps)
    G = BH // BHkv
    model = decode_models.model_forward(BH, Nq, length, d, causal=causal, num_splits=S, warps=warps, group=G)
    assert t.summary() == model
    # K/V read once per K/V head and chunk (each block's rows share them): at most length·d each per block row
    assert model[0]["reads"]["K"] <= BHkv * math.ceil(G * Nq / 8) * length * d
    # the per-block time model prices the same global bytes
    mt = decode_models.modelled_time(BH, Nq, length, d, causal=causal, num_splits=S, warps=warps, group=G)
    assert mt["bytes"] == 4 * sum(sum(x[key].values()) for x in model for key in ("reads", "writes"))
    assert [lt.grid for lt in t.launches] == [(S, BHkv, math.ceil(G * Nq / 8)), (Nq, BH, 1)]
    assert mt["split_blocks"] == S * BHkv * math.ceil(G * Nq / 8) and mt["merge_blocks"] == Nq * BH


def test_split_heuristic_fills_the_sms_within_the_cache():
    sms = roofline.get_gpu("H100 SXM").sm_count
    assert host.default_splits(8, 1, 32768, 128) == sms // 8 == 16         # 8 heads: 128 blocks in one wave
    assert host.default_splits(8, 1, 32768, 128, gpu="A100 80GB SXM") == 108 // 8
    assert host.default_splits(8, 12, 32768, 128) == sms // 16             # 12 queries: two blocks of <= 8
    assert host.default_splits(32, 1, 32768, 128, group=4) == sms // 8     # 4 query heads per K/V head: 8 blocks
    assert host.default_splits(4, 1, 100, 64) == 1                          # 100 keys: one tile of 128
    assert host.default_splits(1, 1, 300, 64, warps=1) == 10                # 10 tiles of 32 < 132
    assert host.default_splits(256, 1, 32768, 64) == 1                      # enough heads already
    assert host.default_splits(100, 1, 32768, 64) == 1                      # 2 splits would need a 2nd wave
    assert host.chunk_length(100, 5, 32) == 32 and host.chunk_length(128, 3, 32) == 64


def test_fa2_model_is_fa2s_traffic_and_decode_uses_more_sms_at_nq_1():
    BH, Nk, d = 8, 32768, 128
    f = decode_models.fa2_modelled_time(BH, 1, Nk, d, causal=True)
    model = fa2.model_forward(BH, 1, Nk, d, causal=True)
    assert f["bytes"] == 4 * sum(sum(x[key].values()) for x in model for key in ("reads", "writes"))
    assert f["blocks"] == BH and f["busy_sms"] == BH                          # one block per head
    g = decode_models.modelled_time(BH, 1, Nk, d, causal=True)
    assert g["split_blocks"] == BH * host.default_splits(BH, 1, Nk, d) == 128 and g["busy_sms"] == 128
    # same keys read once, plus the partials: a few KiB more than fa2, and (modelled) faster by the idle SMs
    assert 0 < g["bytes"] - f["bytes"] < 0.001 * f["bytes"]
    assert g["seconds"] < f["seconds"] / 10


# --------------------------------------------------------------------------- bad inputs


def test_bad_inputs_are_clear_errors(rng):
    cache = host.KVCache(2, 16, 8)
    q = rng.standard_normal((2, 1, 8))
    with pytest.raises(ValueError, match="cache is empty"):
        host.decode(q, cache)
    cache.append(*rng.standard_normal((2, 2, 4, 8)))
    with pytest.raises(TypeError, match="cache must be a flashnb.kernels.launch.decode.KVCache"):
        host.decode(q, "cache")
    with pytest.raises(ValueError, match=r"q must have shape \(BH, Nq, d\) with the cache's d = 8"):
        host.decode(rng.standard_normal((2, 1, 4)), cache)
    with pytest.raises(ValueError, match=r"q's batch·heads \(3\) must be a multiple of the cache's heads \(2\)"):
        host.decode(rng.standard_normal((3, 1, 8)), cache)
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        host.decode(q, cache, num_splits=0)
    wide = host.KVCache(1, 8, 128).append(*rng.standard_normal((2, 1, 8, 128)))
    with pytest.raises(ValueError, match=r"flash-decoding: tiles of Bc=128 keys \(warps=4\) at d=128, Nq=1 need "
                       r"68,640 B .* over the 49,152 B \(48 KiB\).*use fewer warps"):
        host.decode(rng.standard_normal((1, 1, 128)), wide, warps=4)
    with pytest.raises(ValueError, match=r"warps must be in 1..32"):
        host.decode(q, cache, warps=33)
    with pytest.raises(TypeError, match="causal must be"):
        host.decode(q, cache, causal="diagonal")
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        host.KVCache(1, 0, 8)
    with pytest.raises(ValueError, match="has no backward"):
        flashnb.attention_backward(q, q, q, q, np.zeros((2, 1)), q, impl="flash-decoding")
    with pytest.raises(TypeError, match=r"got unexpected option\(s\) \['Br'\]"):
        flashnb.attention(q, q, q, impl="flash-decoding", Br=16)


def test_torch_forward_only():
    torch = pytest.importorskip("torch")
    import flashnb.pytorch as ft

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 8, generator=g) for n in (1, 30, 30))
    o = ft.attention(q, k, v, causal=True, impl="flash-decoding", num_splits=2, warps=1)
    assert_close(o.numpy(), reference.attention(q.numpy(), k.numpy(), v.numpy(), causal=True), **TOL, what="o")
    with pytest.raises(ValueError, match="impl 'flash-decoding' has no backward"):
        ft.attention(q.requires_grad_(), k, v, impl="flash-decoding")


def test_decode_passes_all_four_sanitizer_tools(rng):
    """memcheck, racecheck, initcheck, synccheck on a launch whose two warps reload K_j (140 keys in 2 chunks
    of 128 keys: split 0 loads 2 tiles of 64, split 1 one partial tile); the cache is allocated inside the
    sanitizer, so its unwritten positions are watched.  The checks can fail: without the barrier before the
    K_j reload racecheck reports the race, and a length claiming 4 unwritten positions is an initcheck error."""
    from flashnb import registry, sim

    q = rng.standard_normal((1, 3, 8))
    k, v = rng.standard_normal((2, 1, 140, 8))

    def run(length=None):
        cache = _cache(k, v, capacity=144)
        cache.length = length or cache.length
        host.decode(q, cache, causal=True, num_splits=2, warps=2)

    with sim.sanitize() as report:
        run()
    assert report.launches == 3 and not report.findings          # append, split, merge
    with pytest.raises(sim.SanitizerError, match=r"initcheck\] read of uninitialized global memory K\[0, 14[0-3]"):
        with sim.sanitize():
            run(length=144)
    barrier = "cuda.syncthreads()                       # every warp is done with K_{j-1}"
    racy = registry.variant(decode.make_split, replace=(barrier, "pass"))
    with registry.using(decode.make_split, racy), pytest.raises(sim.SanitizerError, match=r"racecheck\] .* on "
                                                                                            r"shared Ks"):
        with sim.sanitize():
            run()


def test_gpu_measurement_rehearsal():
    """notebook 11's GPU cell: measure_gpu's GPU branches run (kernels still on the simulator), rows labelled
    rehearsal; on the simulator itself it refuses to time."""
    from flashnb.instruments.rehearsal import pretend_gpu

    with pytest.raises(RuntimeError, match="measure_gpu times kernels on a GPU"):
        measure.measure_gpu(BH=1, length=64, d=8)
    with pretend_gpu():
        rows = measure.measure_gpu(BH=1, length=64, d=8, splits=(2, None), repeats=1, warmup=0)
    assert [(r["impl"], r["num_splits"]) for r in rows] == [("flash-decoding", 2), ("flash-decoding", 1),
                                                            ("fa2", None)]
    assert [r["blocks"] for r in rows] == [2 + 1, 1 + 1, 1] and all(r["mode"] == "rehearsal" for r in rows)


def test_decode_and_the_impl_agree_on_causal(rng):
    """Before: decode.decode defaulted to causal=True while attention(impl="flash-decoding") defaulted to False, so
    the two gave different answers for Nq > 1 without a word.  Now with one query every mask is the same (causal
    may be left out of decode, and both match the dense reference); with several, decode needs causal (a
    ValueError naming it) and each choice equals the impl with the same causal."""
    k, v = rng.standard_normal((2, 2, 40, 8))
    cache = _cache(k, v)
    for Nq in (1, 3):
        q = rng.standard_normal((2, Nq, 8))
        impl = {c: flashnb.attention(q, k, v, causal=c, impl="flash-decoding", num_splits=2, warps=1)
                for c in ((False, True) if Nq > 1 else (False,))}
        if Nq == 1:
            o = host.decode(q, cache, num_splits=2, warps=1)[0].copy_to_host()
            assert_close(o, reference.attention(q, k, v), **TOL, what="o")
            assert_close(impl[False], reference.attention(q, k, v), **TOL, what="impl o")
            continue
        with pytest.raises(ValueError, match=r"causal: decoding Nq = 3 new queries needs causal=True"):
            host.decode(q, cache, num_splits=2, warps=1)
        for c in (False, True):
            o = host.decode(q, cache, causal=c, num_splits=2, warps=1)[0].copy_to_host()
            assert_close(o, impl[c], **TOL, what=f"causal={c}")
            assert_close(o, reference.attention(q, k, v, causal=c), **TOL, what=f"causal={c} vs reference")


def test_old_names_reach_the_new_homes():
    """``decode.KVCache``, ``decode.model_forward``, ``decode.measure_gpu``: the host side, the models and the GPU
    measurement left the kernels' module; their old names there still give the same objects."""
    assert decode.KVCache is host.KVCache and decode.decode is host.decode and decode.forward is host.forward
    assert decode.model_forward is decode_models.model_forward and decode.measure_gpu is measure.measure_gpu
    assert flashnb.decode is decode
