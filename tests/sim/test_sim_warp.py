"""Warp intrinsics on the simulator (flashnb.sim.warp) against results worked out by hand from CUDA's semantics.

A warp is 32 consecutive linear thread ids (x + y*Dx + z*Dx*Dy); lane = id % 32.  Shuffles read lane
``src & 31`` (shfl_sync), ``lane - d`` / ``lane + d`` (up/down; own value when outside 0..31), ``lane ^ m``
(xor).  Expected values below are written out from those rules, not computed by the code under test.
Every kernel here is also valid for a GPU (see test_sim_warp_ptx.py).
"""

import time

import numpy as np
import pytest
from numba import cuda, float32, int32

import flashnb
from flashnb import sim

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator-only behaviour")

FULL = 0xFFFFFFFF


@pytest.fixture(autouse=True)
def _installed():
    assert sim.install(), "flashnb.sim patch not active"


def lin():
    return np.arange(64)


# --------------------------------------------------------------------------- reductions


@cuda.jit
def warp_sums(x, down, xor):
    tid = cuda.threadIdx.x
    v = x[tid]
    w = x[tid]
    offset = 16
    while offset > 0:
        v += cuda.shfl_down_sync(FULL, v, offset)
        w += cuda.shfl_xor_sync(FULL, w, offset)
        offset //= 2
    down[tid] = v
    xor[tid] = w


def test_warp_sum_shfl_down_and_xor():
    x = np.arange(64, dtype=np.float32)  # small integers: float32 sums are exact
    down = np.full(64, np.nan, np.float32)
    xor = np.full(64, np.nan, np.float32)
    warp_sums[1, 64](x, down, xor)
    # lane 0 of each warp holds the warp's sum after shfl_down (0+..+31 = 496, 32+..+63 = 1520)
    assert down[0] == 496 and down[32] == 1520
    # xor butterfly: every lane holds its warp's sum
    assert (xor[:32] == 496).all() and (xor[32:] == 1520).all()
    # shfl_down at the top of the warp returns the lane's own value: lane 31 adds itself 5 times -> 31 * 32
    assert down[31] == 31 * 32 and down[63] == 63 * 32


# --------------------------------------------------------------------------- broadcast and lane arithmetic


@cuda.jit
def broadcast(x, out):
    tid = cuda.threadIdx.x
    v = x[tid]
    out[tid, 0] = cuda.shfl_sync(FULL, v, 5)
    out[tid, 1] = cuda.shfl_sync(FULL, v, 37)  # 37 & 31 = 5
    out[tid, 2] = cuda.shfl_sync(FULL, v, -1)  # -1 & 31 = 31
    out[tid, 3] = cuda.shfl_up_sync(FULL, v, 3)
    out[tid, 4] = cuda.shfl_down_sync(FULL, v, 3)
    out[tid, 5] = cuda.shfl_xor_sync(FULL, v, 1)
    out[tid, 6] = cuda.laneid


def test_broadcast_and_lane_rules():
    x = (np.arange(64) * 10).astype(np.int32)
    out = np.full((64, 7), -7, np.int32)
    broadcast[1, 64](x, out)
    lane = np.arange(64) % 32
    base = np.arange(64) - lane  # first thread of the warp
    np.testing.assert_array_equal(out[:, 0], (base + 5) * 10)
    np.testing.assert_array_equal(out[:, 1], (base + 5) * 10)
    np.testing.assert_array_equal(out[:, 2], (base + 31) * 10)
    np.testing.assert_array_equal(out[:, 3], np.where(lane >= 3, np.arange(64) - 3, np.arange(64)) * 10)
    np.testing.assert_array_equal(out[:, 4], np.where(lane <= 28, np.arange(64) + 3, np.arange(64)) * 10)
    np.testing.assert_array_equal(out[:, 5], (np.arange(64) ^ 1) * 10)
    np.testing.assert_array_equal(out[:, 6], lane)


@cuda.jit
def inclusive_scan(x, out):
    tid = cuda.threadIdx.x
    lane = cuda.laneid
    v = x[tid]
    d = 1
    while d < 32:
        n = cuda.shfl_up_sync(FULL, v, d)
        if lane >= d:
            v += n
        d *= 2
    out[tid] = v


def test_inclusive_scan_with_shfl_up():
    x = np.array([(3 * i + 1) % 7 for i in range(64)], np.int32)
    out = np.zeros(64, np.int32)
    inclusive_scan[1, 64](x, out)
    expected = np.concatenate([np.cumsum(x[:32]), np.cumsum(x[32:])])  # a scan restarts in every warp
    np.testing.assert_array_equal(out, expected)


# --------------------------------------------------------------------------- votes


@cuda.jit
def votes(p, out):
    tid = cuda.threadIdx.x
    q = p[tid]
    out[tid, 0] = cuda.ballot_sync(FULL, q != 0)
    out[tid, 1] = cuda.all_sync(FULL, q)
    out[tid, 2] = cuda.any_sync(FULL, q)
    out[tid, 3] = cuda.eq_sync(FULL, q)
    out[tid, 4] = cuda.activemask()
    out[tid, 5] = cuda.lanemask_lt()


def test_ballot_all_any_eq():
    p = np.zeros(96, np.int32)
    p[[0, 31]] = 1  # warp 0: lanes 0 and 31
    p[32:64] = 1  # warp 1: all
    # warp 2: none
    out = np.zeros((96, 6), np.int64)
    votes[1, 96](p, out)
    w0, w1, w2 = out[0], out[32], out[64]
    # ballot is int32 in numba: bit 31 set makes it negative (0x80000001 -> -2147483647)
    assert w0[0] == -2147483647 and w1[0] == -1 and w2[0] == 0
    assert (w0[1], w0[2], w0[3]) == (0, 1, 0)
    assert (w1[1], w1[2], w1[3]) == (1, 1, 1)
    assert (w2[1], w2[2], w2[3]) == (0, 0, 1)
    assert (out[:, 4] == 0xFFFFFFFF).all()  # activemask: every lane of a full warp, unsigned
    np.testing.assert_array_equal(out[:, 5], (1 << (np.arange(96) % 32)) - 1)
    for w in range(3):
        assert (out[32 * w : 32 * w + 32, :4] == out[32 * w, :4]).all()  # same answer in every lane


# --------------------------------------------------------------------------- partial masks


@cuda.jit
def half_masks(x, out):
    tid = cuda.threadIdx.x
    lane = cuda.laneid
    v = x[tid]
    if lane < 16:
        out[tid, 0] = cuda.shfl_xor_sync(0x0000FFFF, v, 1)
        out[tid, 1] = cuda.shfl_down_sync(0x0000FFFF, v, 8)  # lanes 8..15 read 16..23: not in the mask
        out[tid, 2] = float32(cuda.ballot_sync(0x0000FFFF, lane % 4 == 0))
    else:
        cuda.syncwarp(0xFFFF0000)
        out[tid, 0] = cuda.shfl_sync(0xFFFF0000, v, 16)
        out[tid, 1] = float32(cuda.any_sync(0xFFFF0000, lane == 31))
        out[tid, 2] = float32(cuda.ballot_sync(0xFFFF0000, lane % 4 == 0))


def test_partial_masks():
    x = np.arange(32, dtype=np.float32) + 100
    out = np.full((32, 3), -1, np.float32)
    half_masks[1, 32](x, out)
    lane = np.arange(32)
    np.testing.assert_array_equal(out[:16, 0], x[lane[:16] ^ 1])
    np.testing.assert_array_equal(out[:8, 1], x[8:16])
    assert np.isnan(out[8:16, 1]).all()  # undefined in CUDA: reads as NaN in the simulator
    assert (out[:16, 2] == 0x1111).all()  # lanes 0, 4, 8, 12
    assert (out[16:, 0] == x[16]).all()
    assert (out[16:, 1] == 1).all()
    assert (out[16:, 2] == float(np.int32(np.uint32(0x11110000).view(np.int32)))).all()


@cuda.jit
def not_in_mask(out):
    out[cuda.threadIdx.x] = cuda.shfl_sync(0x1, cuda.threadIdx.x, 0)


def test_calling_lane_missing_from_mask_is_an_error():
    with pytest.raises(RuntimeError, match="not in mask 0x00000001"):
        not_in_mask[1, 2](np.zeros(2, np.int32))


# --------------------------------------------------------------------------- partial last warp, 2-D blocks


@cuda.jit
def partial_warp(x, out):
    tid = cuda.threadIdx.x
    v = x[tid]
    offset = 8
    while offset > 0:
        v += cuda.shfl_xor_sync(FULL, v, offset)
        offset //= 2
    out[tid, 0] = v
    out[tid, 1] = cuda.ballot_sync(FULL, True)
    out[tid, 2] = cuda.activemask()
    out[tid, 3] = cuda.shfl_down_sync(FULL, x[tid], 8)


def test_partial_last_warp_48_threads():
    x = np.arange(48, dtype=np.int64)
    out = np.zeros((48, 4), np.int64)
    partial_warp[1, 48](x, out)
    groups = np.arange(48) // 16
    np.testing.assert_array_equal(out[:, 0], [x[groups == g].sum() for g in groups])
    assert (out[:32, 1] == -1).all() and (out[32:, 1] == 0xFFFF).all()  # the second warp has 16 lanes
    assert (out[:32, 2] == 0xFFFFFFFF).all() and (out[32:, 2] == 0xFFFF).all()
    np.testing.assert_array_equal(out[:32, 3], np.where(np.arange(32) <= 23, np.arange(32) + 8, np.arange(32)))
    np.testing.assert_array_equal(out[32:40, 3], np.arange(40, 48))
    assert (out[40:, 3] == sim.warp.INT_POISON).all()  # lanes 16..23 of warp 1 do not exist: undefined


@cuda.jit
def two_d(x, out):
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    v = x[ty, tx]
    out[ty, tx, 0] = cuda.shfl_sync(FULL, v, 0)
    out[ty, tx, 1] = cuda.shfl_sync(FULL, v, 17)
    out[ty, tx, 2] = cuda.ballot_sync(FULL, ty % 2 == 1)
    out[ty, tx, 3] = cuda.laneid


def test_2d_block_linearised():
    x = np.arange(64, dtype=np.int32).reshape(4, 16) * 3  # x[y, x] = 3 * (x + 16 y) = 3 * linear id
    out = np.zeros((4, 16, 4), np.int64)
    two_d[1, (16, 4)](x, out)
    tid = np.arange(64).reshape(4, 16)
    warp = tid // 32
    np.testing.assert_array_equal(out[..., 0], 3 * (32 * warp))
    np.testing.assert_array_equal(out[..., 1], 3 * (32 * warp + 17))
    # rows y = 1 and y = 3 are lanes 16..31 of warps 0 and 1
    assert (out[..., 2] == np.int32(np.uint32(0xFFFF0000).view(np.int32))).all()
    np.testing.assert_array_equal(out[..., 3], tid % 32)


# --------------------------------------------------------------------------- syncwarp, match, early return


@cuda.jit
def syncwarp_exchange(out):
    tid = cuda.threadIdx.x
    s = cuda.shared.array(64, int32)
    s[tid] = tid * 2
    cuda.syncwarp()
    out[tid, 0] = s[tid ^ 31]  # a lane of the same warp
    m = cuda.match_any_sync(FULL, tid // 8)
    r = cuda.match_all_sync(FULL, tid // 32)
    out[tid, 1] = m
    out[tid, 2] = r[0]
    out[tid, 3] = r[1]


def test_syncwarp_and_match():
    out = np.zeros((64, 4), np.int64)
    syncwarp_exchange[1, 64](out)
    tid = np.arange(64)
    np.testing.assert_array_equal(out[:, 0], (tid ^ 31) * 2)
    groups = (0xFF << (8 * ((tid % 32) // 8))).astype(np.uint32).view(np.int32)  # 8 equal lanes, as int32
    np.testing.assert_array_equal(out[:, 1], groups)
    assert (out[:, 2] == -1).all() and (out[:, 3] == 1).all()


@cuda.jit
def early_return(x, out):
    tid = cuda.threadIdx.x
    if tid >= 24:
        return
    out[tid, 0] = cuda.shfl_down_sync(FULL, x[tid], 4)
    out[tid, 1] = cuda.ballot_sync(FULL, True)


def test_lanes_that_returned_are_not_waited_for_under_cudas_rule(monkeypatch):
    # CUDA: "all non-exited threads named in mask" must call; reading an exited lane is undefined (NaN here).
    # The simulator's default is stricter (next test); STRICT_EXITED_LANES = False follows the guide.
    monkeypatch.setattr(sim.fastbarrier, "STRICT_EXITED_LANES", False)
    x = np.arange(32, dtype=np.float32)
    out = np.zeros((32, 2), np.float32)
    early_return[1, 32](x, out)
    np.testing.assert_array_equal(out[:20, 0], x[4:24])
    assert np.isnan(out[20:24, 0]).all()
    assert (out[:24, 1] == 0xFFFFFF).all()


def test_masks_naming_returned_lanes_are_rejected_by_default():
    assert sim.fastbarrier.STRICT_EXITED_LANES
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"lanes \[24, 25, .*31\] named in the mask had already returned"):
        early_return[1, 32](np.arange(32, dtype=np.float32), np.zeros((32, 2), np.float32))
    assert time.perf_counter() - start < 10


# --------------------------------------------------------------------------- what a GPU would hang on


@cuda.jit
def divergent_hang(out):
    tid = cuda.threadIdx.x
    if tid < 16:
        out[tid] = cuda.shfl_sync(FULL, tid, 0)  # lanes 16..31 never get here...
    else:
        cuda.syncthreads()  # ...they wait at a barrier that lanes 0..15 never reach
        out[tid] = tid


def test_divergent_full_mask_shuffle_raises_instead_of_hanging():
    start = time.perf_counter()
    with pytest.raises(sim.SimulatorDeadlock, match=r"shfl_sync\(mask=0xffffffff\)") as info:
        divergent_hang[1, 32](np.zeros(32, np.int32))
    assert time.perf_counter() - start < 10
    assert "lane 16 waits in syncthreads()" in str(info.value)


@cuda.jit
def mixed_intrinsics(out):
    tid = cuda.threadIdx.x
    if tid == 0:
        out[tid] = cuda.ballot_sync(FULL, True)
    else:
        out[tid] = cuda.shfl_sync(FULL, tid, 0)


def test_different_intrinsics_same_mask_is_an_error():
    with pytest.raises(RuntimeError, match="must execute the same warp intrinsic"):
        mixed_intrinsics[1, 32](np.zeros(32, np.int64))


@cuda.jit
def barrier_after_shuffle(x, out):
    tid = cuda.threadIdx.x
    v = cuda.shfl_xor_sync(FULL, x[tid], 1)
    cuda.syncthreads()
    out[tid] = v


def test_next_launch_works_after_an_error():
    with pytest.raises(sim.SimulatorDeadlock):
        divergent_hang[1, 32](np.zeros(32, np.int32))
    x = np.arange(40, dtype=np.float32)
    out = np.zeros(40, np.float32)
    barrier_after_shuffle[2, 40](x, out)
    np.testing.assert_array_equal(out[:32], x[np.arange(32) ^ 1])
    np.testing.assert_array_equal(out[32:], x[32 + (np.arange(8) ^ 1)])


@cuda.jit
def sleep_then_write(out, ns):
    cuda.nanosleep(ns)
    out[cuda.threadIdx.x] = float32(cuda.threadIdx.x)


def test_nanosleep_runs_and_checks_its_argument():
    # PTX: nanosleep suspends for some time in [0, 2 ns]; the simulator takes 0 and only checks the uint32 type
    out = np.full(4, np.nan, np.float32)
    sleep_then_write[1, 4](out, np.uint32(1000))
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match="uint32"):
        sleep_then_write[1, 1](out, 1.5)
