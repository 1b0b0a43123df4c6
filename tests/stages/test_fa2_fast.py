"""Stage 6 (fa2-fast): the tuned FA2 forward and backward against the float64 reference, every output element
written, counted traffic equal to the model, race-free, conflict-free and ideally coalesced on full tiles -- and
the speed properties of their SASS (hot-loop FFMA share, 128-bit shared loads, no local memory), so that they
cannot regress silently."""

import json

import numpy as np
import pytest
from conftest import assert_close, qkv

import flashnb
from flashnb import common, reference, sim
from flashnb import instruments as fi
from flashnb.instruments import sass, traffic
from flashnb.sim import racecheck
from flashnb.stages import fa2_fast

FWD = dict(atol=2e-5, rtol=2e-5)     # as tests/stages/test_fa2.py: float32 sums of <= 128 products of O(1) values
# as tests/stages/test_fa2.py: each gradient is a float32 sum over <= 64 keys or queries of products of P, dP - D
# (itself a float32 sum of d products) and O(1) inputs, partial sums added atomically in any order: measured errors are
# ~1e-6, and 1e-4 leaves room for the summation order without hiding a wrong term (a missing tile is O(0.1))
BWD = dict(atol=1e-4, rtol=1e-4)

ONE_WARP = dict(Br=16, Bc=8, warps=1)      # cheap on the simulator: 32 threads, TM = 4, TN = 1

# (leading axes, Nq, Nk, d, tiles): Nq != Nk both ways (fully masked causal rows when Nq > Nk), lengths that
# are not multiples of the tiles, N = 1, odd head dims (padded to Dp = 32·⌈d/32⌉ internally), two warps, the
# defaults; the tile loads' three shapes (rows per pass, passes per row, neither).
SHAPES = [
    ((1,), 1, 1, 1, ONE_WARP),
    ((2,), 19, 37, 5, ONE_WARP),
    ((1, 2), 33, 20, 7, dict(Br=16, Bc=16, warps=2)),
    ((1,), 24, 40, 64, ONE_WARP),
    ((1,), 70, 45, 33, {}),                  # default tiles (Br = 64, Bc = 32, two warps)
    ((1,), 20, 40, 70, {}),                  # Dp = 96: the general tile-load loop (64 threads, 96 columns)
]
IDS = [f"{'x'.join(map(str, s[0]))}-{s[1]}x{s[2]}-d{s[3]}" for s in SHAPES]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lead, Nq, Nk, d, tiles", SHAPES, ids=IDS)
def test_forward_matches_reference(rng, lead, Nq, Nk, d, tiles, causal):
    q, k, v = qkv(rng, (*lead, Nq, d), Nk)
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="fa2-fast", **tiles)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
    assert_close(o, o_ref, **FWD, what="o")   # also: no NaN poison left, -inf exactly where expected
    assert_close(lse, lse_ref, **FWD, what="lse")


def test_default_tiles_at_d128(rng):
    """d = 128's default tiles (Br = Bc = 64, four warps: 100,352 B, dynamic shared memory), causal with Nq < Nk."""
    q, k, v = qkv(rng, (1, 30, 128), 50)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa2-fast")
    assert fa2_fast.last_forward == dict(d=128, Br=64, Bc=64, warps=4, dynamic=True, shared_bytes=100_352,
                                         fallback=None)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
    assert_close(o, o_ref, **FWD, what="o")   # also: no NaN poison left
    assert_close(lse, lse_ref, **FWD, what="lse")


# --------------------------------------------------------------------------- dynamic shared memory


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dynamic_kernel_at_small_tiles(rng, causal):
    """The dynamic-shared-memory kernel (one array carved into Q_i, K_j, V_j) with small tiles -- several K/V
    tiles, the last one partial, O_i staged in Q_i's space -- against the reference, with the counted traffic
    equal to the static kernel's model (the carving moves no element more or less)."""
    BH, Nq, Nk, d, tiles = 2, 20, 27, 12, dict(Br=16, Bc=8, warps=1)
    q, k, v = qkv(rng, (BH, Nq, d), Nk)
    qd, kd, vd = _dev(q, k, v)
    O, L = common.empty((BH, Nq, d)), common.empty((BH, Nq))
    kernel = fa2_fast.make_forward(tiles["Br"], tiles["Bc"], d, tiles["warps"], causal, True)
    with traffic.count() as t:
        common.launch(kernel, (common.cdiv(Nq, tiles["Br"]), BH), 32 * tiles["warps"], qd, kd, vd, O, L,
                      0.25, common.causal_diag(causal, Nq, Nk), label="FA2 fast forward",
                      shared=fa2_fast.shared_bytes(d=d, **tiles))
    assert t.summary() == fa2_fast.model_forward(BH, Nq, Nk, d, causal=causal, **tiles)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal, scale=0.25)
    assert_close(O.copy_to_host(), o_ref, **FWD, what="o")
    assert_close(L.copy_to_host(), lse_ref, **FWD, what="lse")


def test_dynamic_kernel_is_race_free(rng):
    """Two warps, three K/V tiles (the last partial), Q_i's part of the one dynamic array reused for O_i."""
    Nq, Nk, d, tiles = 20, 20, 8, dict(Br=16, Bc=8, warps=2)
    qd, kd, vd = _dev(*qkv(rng, (1, Nq, d), Nk))
    O, L = common.empty((1, Nq, d)), common.empty((1, Nq))
    kernel = fa2_fast.make_forward(tiles["Br"], tiles["Bc"], d, tiles["warps"], True, True)
    with racecheck.check(raise_on_race=False) as report:
        common.launch(kernel, (common.cdiv(Nq, tiles["Br"]), 1), 64, qd, kd, vd, O, L, 0.5,
                      common.causal_diag(True, Nq, Nk), shared=fa2_fast.shared_bytes(d=d, **tiles))
    assert report.launches == 1 and not report.races


def test_fallback_to_static_tiles_when_the_device_refuses(rng, monkeypatch):
    """A device whose opt-in limit is below the d = 128 defaults' 100,352 B (a faked limit here), or whose opt-in
    call fails: the launch falls back to the static tiles (Br = 24), warns, and says so in last_forward."""
    q, k, v = qkv(rng, (1, 9, 128), 11)
    o_ref, lse_ref = reference.attention_forward(q, k, v)
    monkeypatch.setattr(fa2_fast, "shared_optin_limit", lambda: 48 * 1024 + 512)
    with pytest.warns(RuntimeWarning, match="falling back to the static tiles Br=24, Bc=32"):
        o, lse = flashnb.attention_forward(q, k, v, impl="fa2-fast")
    assert fa2_fast.last_forward["dynamic"] is False and fa2_fast.last_forward["Br"] == 24
    assert "opt-in limit of 49,664 B" in fa2_fast.last_forward["fallback"]
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")

    monkeypatch.undo()

    def refuse(kernel, signature, nbytes):
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE (faked)")

    monkeypatch.setattr(fa2_fast, "allow_dynamic_shared", refuse)
    with pytest.warns(RuntimeWarning, match="opt-in call for 100,352 B failed"):
        o, lse = flashnb.attention_forward(q, k, v, impl="fa2-fast")
    assert fa2_fast.last_forward["Br"] == 24 and "faked" in fa2_fast.last_forward["fallback"]
    assert_close(o, o_ref, **FWD, what="o")
    # tiles given explicitly are never changed behind the caller's back: the refusal is an error
    with pytest.raises(RuntimeError, match="refused 50,176 B of dynamic shared memory for tiles Br=32, Bc=32"):
        fa2_fast.forward(*_dev(q, k, v), scale=1.0, Br=32, Bc=32, warps=2)


def test_tiles_beyond_the_opt_in_limit_are_refused(monkeypatch):
    x = common.to_device(np.zeros((1, 8, 128), np.float32))
    # 200,704 B: over the simulator's opt-in limit (the A100's 163 KiB)
    with pytest.raises(ValueError, match=r"tiles Br=128, Bc=128 at d=128 need 200,704 B .* opt-in limit of "
                                         r"166,912 B"):
        fa2_fast.forward(x, x, x, scale=1.0, Br=128, Bc=128, warps=4)
    monkeypatch.setattr(fa2_fast, "shared_optin_limit", lambda: 48 * 1024)   # a device without the opt-in
    with pytest.raises(ValueError, match=r"tiles Br=32, Bc=32 at d=128 need 50,176 B .* 49,152 B"):
        fa2_fast.forward(x, x, x, scale=1.0, Br=32, Bc=32, warps=2)


def test_rehearsed_gpu_path_asks_the_driver_for_the_dynamic_bytes(rng):
    """Under pretend_gpu (GPU branches taken, kernels on the simulator): the device's opt-in limit is read (the
    pretend H200's 227 KiB) and the opt-in request is made for exactly the bytes the launch gives."""
    from flashnb.instruments import rehearsal

    q, k, v = qkv(rng, (1, 5, 128), 5)
    before = len(rehearsal.dynamic_shared_requests)
    with rehearsal.pretend_gpu():
        assert common.shared_optin_limit() == 227 * 1024
        fa2_fast.forward(*_dev(q, k, v), scale=1.0)
    assert rehearsal.dynamic_shared_requests[before:] == [("fa2_fast_forward", fa2_fast._FWD_SIG, 100_352)]
    assert fa2_fast.last_forward["dynamic"] and fa2_fast.last_forward["fallback"] is None


def test_guard_and_occupancy_count_the_dynamic_bytes():
    """The registry tells the guard each config's dynamic bytes; the guard refuses static > 48 KiB and static +
    dynamic over the sm_80 / sm_90 opt-in limit; occupancy (and so the SASS time model) counts them."""
    from flashnb.registry import KERNELS

    spec = KERNELS["fa2_fast.forward"]
    config = fa2_fast.sass_config(128, False)
    assert config["dynamic"] and spec.dynamic_shared_for(config) == 100_352
    assert spec.dynamic_shared_for(fa2_fast.sass_config(64, False)) == 0
    ok = fi.Resources("k", {}, (8, 0), registers=168, shared_bytes=0, dynamic_shared_bytes=50_176,
                      stack_bytes=0, spill_store_bytes=0, spill_load_bytes=0)
    assert fi.problems(ok) == []
    over = fi.Resources("k", {}, (8, 0), registers=168, shared_bytes=1024, dynamic_shared_bytes=163 * 1024,
                        stack_bytes=0, spill_store_bytes=0, spill_load_bytes=0)
    assert any("opt-in limit" in p for p in fi.problems(over)), fi.problems(over)
    over.cc = (9, 0)
    assert fi.problems(over) == []                      # 164 KiB fit sm_90's 227 KiB
    over.cc = (7, 5)      # not held to sm_75's 64 KiB: a T4's launch reads its limit and falls back
    assert fi.problems(over) == [] and over.occupancy(64).blocks_per_sm == 0
    # 168 registers allow 6 blocks of 2 warps; 50,176 + 1,024 reserved bytes allow 228 KiB // 51,200 = 4 on sm_90
    assert ok.occupancy(64, (9, 0)).blocks_per_sm == 4 and ok.occupancy(64, (9, 0)).limiter == "shared memory"
    assert fi.occupancy(168, 0, 64, (9, 0)).blocks_per_sm == 6
    assert ok.occupancy(64, (8, 0)).blocks_per_sm == 3     # 164 KiB // 51,200
    assert fi.occupancy(168, 0, 64, (8, 0), dynamic_bytes=164 * 1024).blocks_per_sm == 0   # over the opt-in


def test_scale_and_backward_through_the_impl(rng):
    """A non-default scale; the impl's backward (from this forward's O and L) matches too."""
    q, k, v, do = qkv(rng, (1, 21, 12), 30, do=True)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, scale=0.3, impl="fa2-fast", **ONE_WARP)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True, scale=0.3)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, scale=0.3, impl="fa2-fast", **ONE_WARP)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads,
                              reference.attention_backward(q, k, v, do, causal=True, scale=0.3)):
        assert_close(g, g_ref, **BWD, what=name)


def test_bad_tiles_are_refused():
    q = common.to_device(np.zeros((1, 8, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="multiple of 8"):
        fa2_fast.forward(q, q, q, scale=1.0, Br=16, Bc=12, warps=1)
    with pytest.raises(ValueError, match="multiple of"):
        fa2_fast.forward(q, q, q, scale=1.0, Br=24, Bc=8, warps=4)
    with pytest.raises(ValueError, match="opt-in limit"):          # 200,704 B (dynamic: > the opt-in limit)
        fa2_fast.forward(common.to_device(np.zeros((1, 8, 128), np.float32)), *[common.to_device(
            np.zeros((1, 8, 128), np.float32))] * 2, scale=1.0, Br=128, Bc=128, warps=4)


# --------------------------------------------------------------------------- traffic, races, memory profile


def _dev(*arrays):
    return [common.to_device(np.asarray(a, dtype=np.float32)) for a in arrays]


@pytest.mark.parametrize("BH, Nq, Nk, d, causal, tiles", [
    (2, 24, 40, 12, False, dict(Br=16, Bc=8, warps=2)),
    (1, 33, 47, 16, True, dict(Br=16, Bc=16, warps=2)),
])
def test_counted_traffic_equals_model(rng, BH, Nq, Nk, d, causal, tiles):
    q, k, v = qkv(rng, (BH, Nq, d), Nk)
    with traffic.count() as t:
        fa2_fast.forward(*_dev(q, k, v), causal=causal, scale=0.25, **tiles)
    assert t.summary() == fa2_fast.model_forward(BH, Nq, Nk, d, causal=causal, **tiles)


def test_race_free_with_several_warps_and_tiles(rng):
    # two warps, three K/V tiles (the last one partial), the Q_i space reused for O_i at the end
    q, k, v = qkv(rng, (1, 20, 8), 20)
    with racecheck.check(raise_on_race=False) as report:
        flashnb.attention_forward(q, k, v, causal=True, impl="fa2-fast", Br=16, Bc=8, warps=2)
    assert report.launches == 1 and not report.races


def test_full_tiles_are_conflict_free_and_ideally_coalesced(rng):
    # default tiles at d = 32 (Br = 64, Bc = 32, two warps), two full K/V tiles: every shared-memory request
    # (the row copies, the line-8 and line-10 reads, the O_i staging) is one wavefront, every global request
    # touches exactly its ideal sectors -- where stage 4 has 32-way conflicts storing Q_i and K_j transposed
    q, k, v = qkv(rng, (1, 64, 32), 64)
    with sim.profile() as prof:
        flashnb.attention_forward(q, k, v, impl="fa2-fast")
    lines = prof.select(launch="FA2 fast forward")
    assert {s.array for s in lines} == {"Q", "K", "V", "O", "L", "Qs", "Ks", "Vs"}
    for s in lines:
        assert s.cost == s.ideal, (s.array, s.op, s.line, s.cost, s.ideal)


# --------------------------------------------------------------------------- SASS (the speed properties)


# The configurations tuned with `flashnb sass fa2_fast.forward --config ...`: the default tiles at d = 64 and
# d = 128 (dynamic shared memory), and d = 128's static fallback.  The hot loop (the innermost loop with the most
# FFMAs) is line 10's P~V loop; line 8's loop is the other loop with FFMAs.  Measured on sm_90: hot loop 84.8%
# FFMA at d = 64, 87.7% at d = 128 causal (84.6% static, Br = 24); line 8: 87%, 87% (77%).  Stage 4: hot loop 65% and
# 56%, 32-bit shared loads, local memory.  The dynamic array is carved by constant offsets, not slices (whose
# clamped bounds hide the 16-byte alignment: LDS.32).
TUNED = [dict(Br=64, Bc=32, warps=2, d=64, causal=False), dict(Br=64, Bc=64, warps=4, d=128, causal=True, dynamic=True),
         dict(Br=24, Bc=32, warps=2, d=128, causal=True)]


BWD_TUNED = dict(Br=32, Bc=32, warps=2, d=64, causal=False)


@pytest.fixture(scope="module")
def tuned_sass():
    """The SASS of every tuned configuration, compiled in one batch (one NVVM pass each, in parallel child
    processes) instead of one compile process per test."""
    jobs = [("fa2_fast.forward", c) for c in TUNED] + [("fa2_fast.backward", BWD_TUNED)]
    return dict(zip(((n, json.dumps(c, sort_keys=True)) for n, c in jobs), sass.sass_many(jobs)))


@pytest.mark.parametrize("config", TUNED, ids=["d64", "d128-causal-dynamic", "d128-causal-static"])
def test_sass_hot_loop_is_mostly_ffma_with_no_local_memory(tuned_sass, config):
    s = tuned_sass[("fa2_fast.forward", json.dumps(config, sort_keys=True))]
    hot = s.hot_loop
    assert s.fma_fraction(hot) >= 0.75, s.table()
    mix = s.mix()
    assert mix["ldl"] == mix["stl"] == 0 and mix["fp64"] == 0, s.table()    # registers only, float32 only
    assert s.load_widths(hot) == {128: s.mix(hot)["lds"]}, s.table()        # only 128-bit shared loads
    ffma_loops = [s.instructions[a:b + 1] for a, b in s.innermost_loops()
                  if any(i.category == "ffma" for i in s.instructions[a:b + 1])]
    assert len(ffma_loops) == 2, s.table()                                  # line 8 and line 10, unrolled
    for loop in ffma_loops:
        assert s.fma_fraction(loop) >= 0.7 and set(s.load_widths(loop)) == {128}


def test_time_model_counts_the_dynamic_shared_memory_in_the_occupancy():
    """d = 128's default (dynamic) config, as compiled for the SASS test above: ptxas reports 0 B static shared
    memory (3 blocks of 4 warps by registers); the launch's 100,352 dynamic bytes + 1 KiB reserved per block
    leave 2 blocks per H100 SM, and that is what the time model schedules."""
    from flashnb.instruments import sass_model

    t = sass_model.forward_time("fa2_fast.forward", 1, 64, 64, 128, causal=True, gpu="H100 SXM")
    res = fi.resources_for("fa2_fast.forward", fa2_fast.sass_config(128, True), (9, 0))
    assert res.shared_bytes == 0 and res.dynamic_shared_bytes == 100_352
    assert t.blocks_per_sm == res.occupancy(128, (9, 0)).blocks_per_sm == 2
    assert fi.occupancy(res.registers, 0, 128, (9, 0)).blocks_per_sm > 2       # what ptxas's 0 B alone would say


# --------------------------------------------------------------------------- backward (FA2 Alg. 2)


# (leading axes, Nq, Nk, d, tiles, causal): Nq < Nk and Nq > Nk (fully masked causal rows: L = -inf), odd head
# dims, lengths that are not multiples of the tiles, one and two warps, the default tiles (full tiles: the
# unchecked tile loads), Dp = 96 (the general tile-load loop), and "upper_left" with Nq < Nk: key blocks that
# no query sees, whose dK_j, dV_j must still be written (zeros)
BWD_SHAPES = [
    ((1,), 19, 37, 5, dict(Br=16, Bc=8, warps=1), True),
    ((1,), 33, 20, 7, dict(Br=16, Bc=16, warps=2), True),
    ((1,), 32, 40, 32, {}, False),           # default tiles at d = 32: Br = Bc = 32, two warps
    ((1,), 12, 20, 70, dict(Br=8, Bc=16, warps=2), False),
    ((1,), 8, 40, 3, dict(Br=8, Bc=8, warps=1), "upper_left"),
]
BWD_IDS = [f"{'x'.join(map(str, s[0]))}-{s[1]}x{s[2]}-d{s[3]}-{s[5]}" for s in BWD_SHAPES]


@pytest.mark.parametrize("lead, Nq, Nk, d, tiles, causal", BWD_SHAPES, ids=BWD_IDS)
def test_backward_matches_reference(rng, lead, Nq, Nk, d, tiles, causal):
    q, k, v, do = qkv(rng, (*lead, Nq, d), Nk, do=True)
    o, lse = reference.attention_forward(q, k, v, causal=causal)     # O, L as the forward returns them
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl="fa2-fast", **tiles)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, causal=causal)):
        assert_close(g, g_ref, **BWD, what=name)          # also: no NaN poison left


def test_backward_tiles_are_checked():
    q = common.to_device(np.zeros((1, 8, 8), dtype=np.float32))
    lse = common.to_device(np.zeros((1, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="Bc=12 must be a multiple of 4·warps = 8"):
        fa2_fast.backward(q, q, q, q, lse, q, scale=1.0, Br=16, Bc=12, warps=2)
    with pytest.raises(ValueError, match="Br=12 must be a multiple of 8"):
        fa2_fast.backward(q, q, q, q, lse, q, scale=1.0, Br=12, Bc=8, warps=1)
    with pytest.raises(ValueError, match="48 KiB"):
        fa2_fast.backward(*[common.to_device(np.zeros((1, 8, 128), np.float32))] * 4, lse,
                          common.to_device(np.zeros((1, 8, 128), np.float32)), scale=1.0, Br=32, Bc=32, warps=2)


@pytest.mark.parametrize("BH, Nq, Nk, d, causal, tiles", [
    (2, 12, 20, 12, False, dict(Br=8, Bc=8, warps=2)),
    (1, 17, 20, 16, True, dict(Br=8, Bc=8, warps=1)),
])
def test_backward_counted_traffic_equals_model(rng, BH, Nq, Nk, d, causal, tiles):
    q, k, v, do = qkv(rng, (BH, Nq, d), Nk, do=True)
    o, lse = reference.attention_forward(q, k, v, causal=causal)
    args = _dev(q, k, v, o, lse, do)
    with traffic.count() as t:
        fa2_fast.backward(*args, causal=causal, scale=0.25, **tiles)
    assert t.summary() == fa2_fast.model_backward(BH, Nq, Nk, d, causal=causal, **tiles)


def test_backward_race_free_with_several_warps_and_tiles(rng):
    # two warps, three Q tiles per K/V block (the last partial): Q_i, dO_i, L_i, D_i and dS_ij reloaded by
    # every warp, dS_ij exchanged between the warps, K_j's and V_j's space reused for dK_j, dV_j at the end
    q, k, v, do = qkv(rng, (1, 20, 8), 12, do=True)
    o, lse = reference.attention_forward(q, k, v, causal=True)
    with racecheck.check(raise_on_race=False) as report:
        flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="fa2-fast", Br=8, Bc=8, warps=2)
    assert report.launches == 2 and not report.races


def test_backward_full_tiles_are_conflict_free_and_ideally_coalesced(rng):
    # default tiles at d = 32 (Br = Bc = 32, two warps), one full tile: every shared-memory request (the row
    # copies, lines 10-16's reads, the dS_ij exchange, the dK_j/dV_j staging) is one wavefront, every global
    # request (the dQ atomics included) touches exactly its ideal sectors
    q, k, v, do = qkv(rng, (1, 32, 32), 32, do=True)
    o, lse = reference.attention_forward(q, k, v)
    with sim.profile() as prof:
        flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2-fast")
    lines = prof.select(launch="FA2 fast backward")
    assert {s.array for s in lines} == {"Q", "K", "V", "dO", "L", "D", "dQ", "dK", "dV",
                                        "Ks", "Vs", "Qs", "dOs", "dSs", "Ls", "Ds"}
    for s in lines:
        assert s.cost == s.ideal, (s.array, s.op, s.line, s.cost, s.ideal)


# `flashnb sass fa2_fast.backward --config '{"Br": 32, "Bc": 32, "warps": 2, "d": 64, "causal": false}'`: the
# three loops with FFMAs are lines 10/13 (Sᵀ, dPᵀ), lines 12/16 (dV_j, dK_j; the hot loop) and line 15 (dQ_i).
# Measured on sm_90: 84.8%, 82.6% and 80.0% FFMA; at d = 128 (Br = 16, Bc = 24) 73.8%, 85.0% and 80.0%.
def test_backward_sass_loops_are_mostly_ffma_with_no_local_memory(tuned_sass):
    s = tuned_sass[("fa2_fast.backward", json.dumps(BWD_TUNED, sort_keys=True))]
    hot = s.hot_loop
    assert s.fma_fraction(hot) >= 0.5, s.table()
    mix = s.mix()
    assert mix["ldl"] == mix["stl"] == 0 and mix["fp64"] == 0, s.table()    # registers only, float32 only
    assert s.load_widths(hot) == {128: s.mix(hot)["lds"]}, s.table()        # only 128-bit shared loads
    ffma_loops = [s.instructions[a:b + 1] for a, b in s.innermost_loops()
                  if any(i.category == "ffma" for i in s.instructions[a:b + 1])]
    assert len(ffma_loops) == 3, s.table()
    for loop in ffma_loops:
        assert s.fma_fraction(loop) >= 0.5 and 128 in s.load_widths(loop), s.table()
