"""flashnb.sim.racecheck: hand-made races are found (and their fixed versions are not), then every
registered implementation runs race-free (in tests/sim/test_sim_sanitizer.py, as one of the four tools)."""

import numpy as np
import pytest
from numba import cuda, float32

import flashnb
from flashnb import sim
from flashnb.common import launch, to_device
from flashnb.sim import racecheck

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator-only tool")

FULL = 0xFFFFFFFF


@pytest.fixture(autouse=True)
def _installed():
    assert sim.install()


@cuda.jit
def rotate(x, out, barrier):
    """out[t] = x[t + 1]: through shared memory; without the barrier thread t reads a slot t+1 writes."""
    sh = cuda.shared.array(64, float32)
    t = cuda.threadIdx.x
    sh[t] = x[t]
    if barrier:
        cuda.syncthreads()
    out[t] = sh[(t + 1) % cuda.blockDim.x]


def _run(kernel, grid, block, *args, raise_on_race=False):
    with racecheck.check(raise_on_race=raise_on_race) as report:
        kernel[grid, block](*args)
    return report


def test_missing_syncthreads_is_a_race_and_the_barrier_fixes_it():
    x = to_device(np.arange(64, dtype=np.float32))
    out = to_device(np.full(64, np.nan, np.float32))
    report = _run(rotate, 1, 64, x, out, False)
    assert [(r.kind, r.array, r.memory) for r in report.races] == [("read/write", "sh", "shared")]
    race = report.races[0]
    # every slot s is written by thread s and read by thread s - 1 (mod 64) in the same phase: 64 pairs;
    # the read and the write lines are named
    assert race.count == 64 and {race.first.op, race.second.op} == {"read", "write"}
    assert "rotate" in race.first.where and "rotate" in race.second.where
    assert not _run(rotate, 1, 64, x, out, True).races
    np.testing.assert_array_equal(out.copy_to_host(), np.roll(np.arange(64), -1))
    with pytest.raises(racecheck.RaceError, match="read/write race on shared sh"):
        _run(rotate, 1, 64, x, out, False, raise_on_race=True)


@cuda.jit
def everyone_writes_one(out):
    out[0] = float32(cuda.blockIdx.x)


@cuda.jit
def everyone_adds_one(out, also_read, dst):
    cuda.atomic.add(out, 0, float32(1.0))
    if also_read and cuda.threadIdx.x == 0 and cuda.blockIdx.x == 1:
        dst[0] = out[0]


def test_global_races_between_blocks_and_atomics():
    out = to_device(np.zeros(1, np.float32))
    report = _run(everyone_writes_one, 3, 1, out)
    assert [(r.kind, r.memory, r.count) for r in report.races] == [("write/write", "global", 2)]
    dst = to_device(np.zeros(1, np.float32))
    assert not _run(everyone_adds_one, 2, 4, out, False, dst).races       # atomics never race with atomics
    report = _run(everyone_adds_one, 2, 4, out, True, dst)                # a plain read beside them does
    assert {r.kind for r in report.races} == {"atomic/plain"}


@cuda.jit
def lane_swap(out, sync):
    """Lane l writes sh[l], then reads its partner's slot: needs syncwarp (a shuffle orders no memory)."""
    sh = cuda.shared.array(32, float32)
    lane = cuda.threadIdx.x
    sh[lane] = float32(lane)
    if sync:
        cuda.syncwarp(FULL)
    else:
        cuda.shfl_sync(FULL, lane, 0)
    out[lane] = sh[lane ^ 1]


def test_syncwarp_orders_lanes_of_a_warp_and_a_shuffle_does_not():
    out = to_device(np.zeros(32, np.float32))
    assert not _run(lane_swap, 1, 32, out, True).races
    assert [r.kind for r in _run(lane_swap, 1, 32, out, False).races] == ["read/write"]


def test_racecheck_cannot_nest_and_needs_the_simulator_runtime():
    with racecheck.check():
        with pytest.raises(RuntimeError, match="already active"):
            with racecheck.check():
                pass


# Every registered impl (forward and backward, causal and not) and the stage-2 kernels run race-free under
# racecheck as one of the sanitizer's tools: tests/sim/test_sim_sanitizer.py (test_every_impl_passes_all_four_tools).


def test_launch_through_common_launch_is_watched():
    x = to_device(np.arange(64, dtype=np.float32))
    out = to_device(np.zeros(64, np.float32))
    with racecheck.check(raise_on_race=False) as report:
        launch(rotate, 1, 64, x, out, False, label="rotate (no barrier)")
    assert report.races and report.races[0].launch == "rotate (no barrier)"


def _summary(report):
    return [(r.kind, r.array, r.memory, r.index, r.count, r.first, r.second) for r in report.races]


@pytest.mark.parametrize("grid", [1, 3])
def test_shared_races_stay_inside_their_block_and_match_the_threads_simulator(grid):
    """Each block has its own copy of ``sh``: three blocks race three times as often as one, never with each
    other; the vectorised analysis (one sort over packed element, phase, thread) reports exactly what the
    threads simulator's shadow memory reports."""
    x = to_device(np.arange(64, dtype=np.float32))
    out = to_device(np.full(64, np.nan, np.float32))
    reports = {}
    for mode in ("vector", "threads"):
        with sim.simulating(mode):
            reports[mode] = _summary(_run(rotate, grid, 64, x, out, False))
    assert reports["vector"] == reports["threads"]
    races = {(r[0], r[2]): r[4] for r in reports["vector"]}
    assert races.pop(("read/write", "shared")) == 64 * grid
    # and every block writes all of ``out``: blocks 2 and 3 overwrite block 1's 64 elements
    assert races == ({} if grid == 1 else {("write/write", "global"): 64 * (grid - 1)})
