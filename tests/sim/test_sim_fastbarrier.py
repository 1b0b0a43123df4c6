"""The simulator barrier patch (flashnb.sim.fastbarrier): self-test, stock semantics kept, guarded fallback."""

import warnings

import numpy as np
import pytest
from numba import cuda, float32

import flashnb
from flashnb import sim

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator-only behaviour")


@pytest.fixture(autouse=True)
def _restore():
    yield
    sim.uninstall()
    assert sim.install()


def test_installed_on_import_and_idempotent():
    from numba.cuda.simulator import kernel

    assert sim.is_installed()
    assert kernel.BlockManager is sim.fastbarrier.FastBlockManager
    assert sim.install() and sim.install()  # a second call changes nothing
    assert kernel.BlockManager is sim.fastbarrier.FastBlockManager


def test_self_test():
    result = sim.self_test()
    assert result["installed"]
    assert "syncthreads_count/and/or" in result["checks"] and "shfl_xor_sync" in result["checks"]


@cuda.jit
def raises_in_one_thread(out):
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    if tid == 3:
        out[100] = float32(1)  # out of bounds: IndexError in thread 3
    cuda.syncthreads()
    out[tid] = float32(tid)


def test_exception_aborts_the_block_like_stock():
    with pytest.raises(IndexError, match=r"tid=\[3, 0, 0\] ctaid=\[0, 0, 0\]"):
        raises_in_one_thread[1, 8](np.zeros(8, np.float32))


@cuda.jit
def barrier_in_branch(out):
    tid = cuda.threadIdx.x
    if tid < 4:
        cuda.syncthreads()
    out[tid] = float32(tid)


def test_barrier_skipped_by_returning_threads_completes():
    # stock rule: a barrier waits for the *live* threads only, so threads that finish do not block it
    out = np.zeros(8, np.float32)
    barrier_in_branch[1, 8](out)
    np.testing.assert_array_equal(out, np.arange(8))


def test_mismatching_source_hash_falls_back_to_stock_with_one_warning(monkeypatch):
    from numba.cuda.simulator import kernel

    sim.uninstall()
    stock = kernel.BlockManager
    monkeypatch.setitem(sim.EXPECTED_SOURCE_SHA256, "kernel.BlockManager", "0" * 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sim.install() is False
        assert sim.install() is False  # asked again: still stock, no second warning
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    assert "kernel.BlockManager differ" in str(caught[0].message)
    assert not sim.is_installed() and kernel.BlockManager is stock
    assert not hasattr(kernel.FakeCUDAModule, "shfl_sync")
    result = sim.self_test()  # stock simulator still runs barriers (and syncthreads_count/and/or) correctly
    assert result == {"installed": False, "checks": ["syncthreads", "syncthreads_count/and/or", "early return"]}
    monkeypatch.undo()
    sim.uninstall()
    assert sim.install()
