"""Bugs that would bite only on a GPU, caught here: CUDA's launch limits (the simulator refuses what a GPU refuses,
and batch·heads beyond gridDim.y's 65,535 are split into launches that fit -- checked with the limit lowered, so
the simulator runs a few heads instead of 65,536), and outputs larger than the memory left (refused before any
allocation; on a GPU poisoned by a device memset, never through a host buffer the size of the output)."""

import numpy as np
import pytest
from numba import cuda

import flashnb
from flashnb import common, reference
from flashnb.instruments import traffic
from flashnb.registry import IMPLS

pytestmark = pytest.mark.skipif(not flashnb.is_simulator(), reason="simulator launch checks")


@cuda.jit
def touch(a):
    a[0] = 1


@pytest.mark.parametrize("grid, block, says", [
    ((1, 65536), 32, "gridDim.y = 65,536 is over CUDA's limit of 65,535"),
    ((1, 1, 70000), 32, "gridDim.z = 70,000"),
    (1, 1025, "blockDim.x = 1,025 is over CUDA's limit of 1,024"),
    (1, (32, 1, 65), "blockDim.z = 65 is over CUDA's limit of 64"),
    (1, (64, 32), "2,048 threads per block"),
])
def test_the_simulator_refuses_what_a_gpu_refuses(grid, block, says):
    a = common.to_device(np.zeros(1, np.float32))
    with pytest.raises(ValueError, match=says):
        touch[grid, block](a)                       # a direct launch, as a learner writes it
    with pytest.raises(ValueError, match=says):
        common.launch(touch, grid, block, a)        # and flashnb's own launches


def test_the_limits_themselves_are_allowed():
    common.check_launch_dims("k", (2**31 - 1, 65535, 65535), (32, 32, 1))   # no error: exactly at the limits
    touch[1, (16, 64)](common.to_device(np.zeros(1, np.float32)))           # 1,024 threads run


# fa2 puts batch·heads on gridDim.y, naive's matmuls on gridDim.z; every impl goes through the same wrapper
@pytest.mark.parametrize("impl", [pytest.param("naive", marks=pytest.mark.slow), "fa2"])   # naive: CI budget
def test_batch_heads_beyond_grid_y_are_split_into_launches_that_fit(monkeypatch, rng, impl):
    # Before: fa2 put all 70,000 batch·heads on gridDim.y (CUDA refuses > 65,535) and the simulator ran it.
    monkeypatch.setattr(common, "MAX_GRID", (2**31 - 1, 3, 3))    # as if 65,535 were 3
    BH, N, d = 7, 8, 4
    q, k, v, do = (rng.standard_normal((BH, N, d)) for _ in range(4))
    opts = dict(Br=16, Bc=16, warps=1) if impl == "fa2" else {}     # one warp a block: fewer simulated threads
    with traffic.count() as t:
        o, lse = flashnb.attention_forward(q, k, v, causal=True, impl=impl, **opts)
    assert all(lt.grid[1] <= 3 and lt.grid[2] <= 3 for lt in t.launches)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
    # float32 kernels vs float64: d = 4 dot products and 8-term sums, errors ~1e-7; 2e-5 as elsewhere
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, lse_ref, atol=2e-5, rtol=2e-5)
    if IMPLS[impl].backward is not None:
        grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl=impl, **opts)
        for g, r in zip(grads, reference.attention_backward(q, k, v, do, causal=True)):
            np.testing.assert_allclose(g, r, atol=2e-5, rtol=2e-5)


def test_an_output_larger_than_memory_is_refused_before_allocating(monkeypatch, rng):
    # Before: the naive path built a host NaN array the size of S and ran out of host memory first.
    monkeypatch.setattr(common, "available_bytes", lambda: 1 << 20)          # 1 MiB left
    q = rng.standard_normal((600, 8))
    with pytest.raises(common.OutOfMemory, match=r"shape \(1, 600, 600\) \(float32\) needs 1\.4 MiB, but only "
                       r"1\.0 MiB of memory is available"):
        flashnb.attention(q, q, q, impl="naive")
    flashnb.attention(q[:24], q[:24], q[:24], impl="naive")                 # 24 x 24 fits


def test_gpu_outputs_are_poisoned_on_the_device(monkeypatch):
    # The GPU branch of common.empty, with numba's device calls replaced by recorders: NaN bytes are set on the
    # device (cuMemsetD8 with 0xFF: float32 0xFFFFFFFF is a NaN), and no host array of the output's size is made.
    import numba.cuda.cudadrv.driver as drv

    calls = []

    class FakeDeviceArray:
        def __init__(self, shape, dtype, stream):
            self.shape, self.dtype = shape, dtype

    monkeypatch.setattr(common.runtime, "MODE", "gpu")
    monkeypatch.setattr(common, "available_bytes", lambda: 1 << 40)
    monkeypatch.setattr(common.cuda, "device_array", lambda shape, dtype, stream: FakeDeviceArray(shape, dtype, stream))
    monkeypatch.setattr(drv, "device_memset", lambda dst, val, size, stream=0: calls.append((dst.shape, val, size)))
    monkeypatch.setattr(np, "full", lambda *a, **k: pytest.fail("a host buffer was made"))
    out = common.empty((2, 3, 5))
    assert isinstance(out, FakeDeviceArray) and calls == [((2, 3, 5), 0xFF, 2 * 3 * 5 * 4)]
    assert np.isnan(np.frombuffer(bytes([0xFF] * 4), dtype=np.float32)[0])


def test_launched_resources_read_the_loaded_kernel(monkeypatch):
    # flashnb inspect shows the compile_ptx + ptxas build; on a GPU numba launches an nvJitLink build, whose
    # own attributes inspect.launched reads (here from stand-ins for numba's compiled-kernel objects).
    from flashnb import instruments as fi

    with pytest.raises(RuntimeError, match="nothing is loaded"):
        fi.launched(touch)

    class Loaded:
        regs_per_thread, shared_mem_per_block, local_mem_per_thread = 40, 8192, 16
        const_mem_size, max_threads_per_block = 0, 1024

    class Kernel:
        overloads = {("float32[:, :, ::1]", "int32"): Loaded()}

        def py_func(self):
            pass

    monkeypatch.setattr(flashnb.runtime, "MODE", "gpu")
    assert fi.launched(Kernel()) == [dict(kernel="py_func", signature="float32[:, :, ::1], int32", registers=40,
                                          shared_bytes=8192, local_bytes=16, const_bytes=0,
                                          max_threads_per_block=1024)]
