"""A warp operation whose mask names lanes that returned early, or that took a branch without it and returned,
is an error in both simulators (a GPU does not wait for exited lanes, and what it reads from them is undefined),
and the sanitizer's synccheck reports it at the kernel line."""

import numpy as np
import pytest
from numba import cuda, float32

from flashnb import sim
from flashnb.sim import fastbarrier

FULL = 0xFFFFFFFF


@cuda.jit
def reduce_after_early_return(x, out, n):
    t = cuda.threadIdx.x
    if t >= n:
        return                                        # the tail of the warp leaves before the reduction
    v = x[t]
    off = 16
    while off > 0:
        v += cuda.shfl_down_sync(FULL, v, off)        # full mask: names the lanes that returned
        off //= 2
    if t == 0:
        out[0] = v


@cuda.jit
def vote_in_one_branch(x, out):
    t = cuda.threadIdx.x
    if x[t] > float32(0):
        out[t] = cuda.ballot_sync(FULL, x[t] > float32(1))   # the other lanes never get here, and finish
    else:
        out[t] = -1


def _launch(kernel, args, mode):
    with sim.simulating(mode):
        kernel[1, 32](*args)


@pytest.mark.parametrize("mode", ["vector", "threads"])
def test_full_mask_shuffle_after_early_return_is_an_error(mode):
    x = np.arange(32, dtype=np.float32)
    with pytest.raises(RuntimeError, match=r"lanes \[27, 28, 29, 30, 31\] named in the mask had already returned"):
        _launch(reduce_after_early_return, (x, np.zeros(1, np.float32), 27), mode)
    out = np.zeros(1, np.float32)
    _launch(reduce_after_early_return, (x, out, 32), mode)        # every lane there: fine
    assert out[0] == x.sum()


@pytest.mark.parametrize("mode", ["vector", "threads"])
def test_vote_that_some_lanes_skip_is_an_error(mode):
    x = np.where(np.arange(32) % 3 == 0, -1.0, 2.0).astype(np.float32)
    with pytest.raises(RuntimeError, match=r"ballot_sync\(mask=0xffffffff\) in warp 0: lanes \[0, 3, 6,"):
        _launch(vote_in_one_branch, (x, np.zeros(32, np.int32)), mode)


@pytest.mark.parametrize("mode", ["vector", "threads"])
def test_synccheck_reports_it_at_the_kernel_line(mode):
    x = np.arange(32, dtype=np.float32)
    with sim.simulating(mode), sim.sanitize(("synccheck",), raise_on_error=False) as report:
        reduce_after_early_return[1, 32](x, np.zeros(1, np.float32), 20)
    found = report.by_tool("synccheck")
    assert found and found[0].kind == "warp operation after exit"
    line = next(i for i, text in enumerate(open(__file__), 1) if "+= cuda.shfl_down_sync" in text)
    assert f"test_sim_warp_exit.py:{line} (reduce_after_early_return)" in found[0].message
    assert "lanes [20, 21," in found[0].message


def test_cudas_own_rule_on_request(monkeypatch):
    """``STRICT_EXITED_LANES = False``: CUDA's rule, the exited lanes are not waited for (what a shuffle reads
    from them is the simulator's poison, NaN for a float)."""
    monkeypatch.setattr(fastbarrier, "STRICT_EXITED_LANES", False)
    x = np.arange(32, dtype=np.float32)
    for mode in ("vector", "threads"):
        out = np.zeros(1, np.float32)
        _launch(reduce_after_early_return, (x, out, 27), mode)
        assert np.isnan(out[0])
