"""The traffic counter (flashnb.instruments.traffic): hand-counted tiny kernels, then stage 1 against its analytic
model."""

import numpy as np
import pytest
from numba import cuda, float32

import flashnb
from flashnb import common, runtime
from flashnb.instruments import traffic
from flashnb.stages import naive

pytestmark = pytest.mark.skipif(not flashnb.is_simulator(), reason="traffic counting needs the simulator")


# --------------------------------------------------------------------------- tiny kernels, counted by hand


@cuda.jit
def copy_kernel(src, dst):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < src.shape[0]:
        dst[i] = src[i]


@cuda.jit
def read_twice(src, dst):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < src.shape[0]:
        dst[i] = src[i] + src[i]


@cuda.jit
def two_shared(src, dst):
    a = cuda.shared.array(8, float32)
    b = cuda.shared.array(8, float32)
    t = cuda.threadIdx.x
    a[t] = src[t]
    b[t] = float32(2.0) * src[t]
    cuda.syncthreads()
    dst[t] = a[t] + b[(t + 1) % 8] + b[t]    # 1 read of a, 2 of b; a wrong alias of a and b breaks dst


@cuda.jit
def via_views(src, dst):
    z = cuda.blockIdx.x
    t = cuda.threadIdx.x
    row = src[z]              # a view: not an access
    out = dst[z, :]           # a view: not an access
    out[t] = row[t] * row[t]  # 2 reads of src, 1 write of dst


@cuda.jit
def atomic_sum(x, total):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < x.shape[0]:
        cuda.atomic.add(total, 0, x[i])


@cuda.jit
def uneven(src, dst):
    """Thread i of the grid reads src i % 4 times and writes dst once: per-thread counts differ."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    acc = float32(0.0)
    for _ in range(i % 4):
        acc += src[i]
    dst[i] = acc


def _dev(a):
    return cuda.to_device(np.ascontiguousarray(a, dtype=np.float32))


def _one(t):
    assert len(t.launches) == 1
    return t.launches[0]


def test_copy_counts_one_read_and_one_write_per_element(rng):
    x = rng.standard_normal(13)
    src, dst = _dev(x), common.empty(13)
    with traffic.count() as t:
        common.launch(copy_kernel, 2, 8, src, dst, label="copy")
    np.testing.assert_array_equal(dst.copy_to_host(), x.astype(np.float32))
    assert t.summary() == [dict(launch="copy", reads={"src": 13}, writes={"dst": 13}, atomics={},
                                shared_reads=0, shared_writes=0)]
    lt = _one(t)
    assert (lt.kernel, lt.grid, lt.block) == ("copy_kernel", (2, 1, 1), (8, 1, 1))
    assert t.global_read_bytes == t.global_write_bytes == 13 * 4
    assert t.atomics == t.shared_reads == t.shared_writes == 0


def test_reading_an_element_twice_counts_two_reads(rng):
    src, dst = _dev(rng.standard_normal(5)), common.empty(5)
    with traffic.count() as t:
        common.launch(read_twice, 1, 8, src, dst)
    lt = _one(t)
    assert lt.label == "read_twice"       # no label given: the kernel's name
    assert (lt.reads, lt.writes) == ({"src": 10}, {"dst": 5})


def test_direct_launch_without_common_launch_is_counted_too(rng):
    src, dst = _dev(rng.standard_normal(4)), common.empty(4)
    with traffic.count() as t:
        copy_kernel[1, 4](src, dst)
    assert t.summary()[0]["reads"] == {"src": 4}


def test_shared_arrays_on_different_lines_are_counted_apart_and_do_not_alias(rng):
    x = rng.standard_normal(8).astype(np.float32)
    expected = x + 2 * np.roll(x, -1) + 2 * x
    src, dst = _dev(x), common.empty(8)
    with traffic.count() as t:
        common.launch(two_shared, 1, 8, src, dst)
    np.testing.assert_allclose(dst.copy_to_host(), expected, rtol=1e-6)   # float32 sums of three terms
    lt = _one(t)
    assert lt.shared_writes == {"a": 8, "b": 8}
    assert lt.shared_reads == {"a": 8, "b": 16}
    assert (lt.reads, lt.writes) == ({"src": 16}, {"dst": 8})
    assert t.shared_reads == 24 and t.shared_writes == 16
    # the patched allocator stays correct (no aliasing) when nothing is counting
    dst2 = common.empty(8)
    common.launch(two_shared, 1, 8, src, dst2)
    np.testing.assert_allclose(dst2.copy_to_host(), expected, rtol=1e-6)


def test_views_share_the_parent_counter(rng):
    x = rng.standard_normal((2, 4))
    src, dst = _dev(x), common.empty((2, 4))
    with traffic.count() as t:
        common.launch(via_views, 2, 4, src, dst)
    np.testing.assert_allclose(dst.copy_to_host(), (x * x).astype(np.float32), rtol=1e-6)
    assert (t.launches[0].reads, t.launches[0].writes) == ({"src": 16}, {"dst": 8})


def test_atomic_add_is_one_atomic_and_no_read_or_write(rng):
    x = rng.standard_normal(11)
    total = _dev(np.zeros(1))
    with traffic.count() as t:
        common.launch(atomic_sum, 2, 8, _dev(x), total, label="sum")
    assert total.copy_to_host()[0] == pytest.approx(x.sum(), abs=1e-5)   # 11 float32 adds of O(1) values
    assert t.summary() == [dict(launch="sum", reads={"x": 11}, writes={}, atomics={"total": 11},
                                shared_reads=0, shared_writes=0)]
    assert t.atomics == 11 and t.global_write_bytes == 0 and t.global_read_bytes == 44


def test_multi_block_per_thread_counts_are_summed(rng):
    n_blocks, n_threads = 3, 5
    n = n_blocks * n_threads
    src, dst = _dev(rng.standard_normal(n)), common.empty(n)
    with traffic.count() as t:
        common.launch(uneven, n_blocks, n_threads, src, dst)
    assert t.launches[0].reads == {"src": sum(i % 4 for i in range(n))}
    assert t.launches[0].writes == {"dst": n}


def test_nested_counters_each_see_their_launches(rng):
    src, dst = _dev(rng.standard_normal(4)), common.empty(4)
    with traffic.count() as outer:
        common.launch(copy_kernel, 1, 4, src, dst, label="first")
        with traffic.count() as inner:
            common.launch(read_twice, 1, 4, src, dst, label="second")
        common.launch(copy_kernel, 1, 4, src, dst, label="third")
    assert [lt.label for lt in outer.launches] == ["first", "second", "third"]
    assert [lt.label for lt in inner.launches] == ["second"]
    assert outer.global_reads == 4 + 8 + 4 and inner.global_reads == 8
    common.launch(copy_kernel, 1, 4, src, dst)            # after the block: not counted anywhere
    assert len(outer.launches) == 3
    with pytest.raises(traffic.TrafficError, match="already used"):
        with outer:
            pass


def test_rendering_and_totals(rng):
    src, dst = _dev(rng.standard_normal(8)), common.empty(8)
    with traffic.count() as t:
        common.launch(two_shared, 1, 8, src, dst, label="shared demo")
        common.launch(copy_kernel, 1, 8, src, dst, label="copy")
    text = str(t)
    for word in ("shared demo", "copy", "two_shared", "src", "dst", "a (shared)", "b (shared)", "64 B"):
        assert word in text
    html = t._repr_html_()
    assert "<table>" in html and "shared demo" in html
    by_array = t.totals_by_array()
    assert by_array["src"] == dict(kind="global", reads=16 + 8, writes=0, atomics=0, read_bytes=96, write_bytes=0)
    assert by_array["shared:b"]["reads"] == 16
    assert t.totals_by_launch()["copy"]["read_bytes"] == 32


def test_gpu_mode_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(runtime, "MODE", "gpu")
    with pytest.raises(traffic.TrafficError, match="FLASHNB_DEVICE=sim"):
        traffic.count()


# --------------------------------------------------------------------------- stage 1 against its model


def _inputs(rng, BH, Nq, Nk, d):
    return (rng.standard_normal((BH, Nq, d)), rng.standard_normal((BH, Nk, d)), rng.standard_normal((BH, Nk, d)),
            rng.standard_normal((BH, Nq, d)))


# Ragged shapes (not multiples of the 16-wide tile, Nq < Nk and Nq > Nk; with causal and Nq > Nk the first
# rows see no key) and one tile-aligned shape with BH = 2.
MODEL_CASES = [(1, 17, 33, 5, False), (1, 17, 33, 5, True), (1, 33, 17, 5, True), (2, 16, 16, 16, False)]


@pytest.mark.parametrize("BH, Nq, Nk, d, causal", MODEL_CASES)
def test_naive_forward_matches_model(rng, BH, Nq, Nk, d, causal):
    q, k, v, _ = _inputs(rng, BH, Nq, Nk, d)
    with traffic.count() as t:
        flashnb.attention_forward(q, k, v, causal=causal, impl="naive")
    assert t.summary() == naive.model_forward(BH, Nq, Nk, d, causal=causal)


@pytest.mark.parametrize("BH, Nq, Nk, d, causal", MODEL_CASES[1:])
def test_naive_backward_matches_model(rng, BH, Nq, Nk, d, causal):
    q, k, v, do = _inputs(rng, BH, Nq, Nk, d)
    dev = [common.to_device(a) for a in (q, k, v, do)]
    o, lse = naive.forward(*dev[:3], causal=causal, scale=0.5)
    with traffic.count() as t:
        naive.backward(*dev[:3], o, lse, dev[3], causal=causal, scale=0.5)
    assert t.summary() == naive.model_backward(BH, Nq, Nk, d, causal=causal)


def test_counting_does_not_change_results(rng):
    BH, Nq, Nk, d = 1, 17, 20, 8
    q, k, v, do = (common.to_device(a) for a in _inputs(rng, BH, Nq, Nk, d))
    plain = naive.forward(q, k, v, causal=True, scale=0.3)
    with traffic.count():
        counted = naive.forward(q, k, v, causal=True, scale=0.3)
    for a, b in zip(plain, counted):
        np.testing.assert_array_equal(a.copy_to_host(), b.copy_to_host())   # same float32 ops: bit-identical


def test_a_failing_launch_leaves_the_counter_usable(rng):
    src, dst = _dev(rng.standard_normal(4)), common.empty(4)
    with traffic.count() as t:
        with pytest.raises(IndexError):
            common.launch(copy_kernel, 1, 4, src, common.empty(2))   # threads 2, 3 write past dst's end
        common.launch(copy_kernel, 1, 4, src, dst, label="after")
    assert [lt.label for lt in t.launches] == ["after"]              # the failed launch is not recorded
    assert t.launches[0].reads == {"src": 4}
