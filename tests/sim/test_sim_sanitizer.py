"""flashnb.sim.sanitize: one hand-made faulty kernel per tool is caught at the right line (and its fixed
version is not), then every registered implementation -- forward and backward, causal and not -- and the
stage-2 kernels no impl launches pass all four tools."""

import inspect
import re

import numpy as np
import pytest
from numba import cuda, float32

import flashnb
from flashnb import cli, sim
from flashnb.common import empty, launch, to_device
from flashnb.registry import IMPLS
from flashnb.sim import SimulatorDeadlock
from flashnb.sim.sanitizer import TOOLS, MemcheckError, SanitizerError

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator-only tool")


@pytest.fixture(autouse=True)
def _installed():
    assert sim.install()


def _line(kernel, marker="# BUG"):
    """file:line of the line of ``kernel`` that carries ``marker`` (what a finding must name)."""
    fn = getattr(kernel, "py_func", kernel)
    lines, first = inspect.getsourcelines(fn)
    (k,) = [i for i, text in enumerate(lines) if marker in text]
    return f"test_sim_sanitizer.py:{first + k} ({fn.__name__})"


def _run(kernel, grid, block, *args, tools=TOOLS):
    with sim.sanitize(tools=tools, raise_on_error=False) as report:
        kernel[grid, block](*args)
    return report


def _x(n=32, seed=0):
    return to_device(np.random.default_rng(seed).standard_normal(n))


# --------------------------------------------------------------------------- memcheck


@cuda.jit
def shift_left(x, out, fixed):
    t = cuda.threadIdx.x
    if fixed:
        out[t] = x[t - 1] if t > 0 else x[t]
    else:
        out[t] = x[t - 1]                   # BUG: thread 0 reads x[-1]


@cuda.jit
def shared_off_by_one(x, out, fixed):
    sh = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    sh[t] = x[t]
    cuda.syncthreads()
    if fixed:
        out[t] = sh[(t + 1) % 32]
    else:
        out[t] = sh[t + 1]                  # BUG: thread 31 reads sh[32]


@cuda.jit
def local_negative(x, out, fixed):
    acc = cuda.local.array(4, float32)
    t = cuda.threadIdx.x
    for i in range(4):
        acc[i] = x[t]
    j = t % 4 if fixed else t % 4 - 1
    out[t] = acc[j]                         # BUG: j = -1 for every 4th thread


@cuda.jit
def row_view(X, out, fixed):
    t = cuda.threadIdx.x
    r = t if fixed else t - 1
    row = X[r]                              # BUG: a view of row -1
    out[t] = row[0]


@cuda.jit
def slice_view(X, out, fixed):
    t = cuda.threadIdx.x
    upper = X[16:]                          # rows 16..31 of X: its own rows are 0..15
    r = t % 16 if fixed else t
    out[t] = upper[r, 1]                    # BUG: threads 16..31 read upper[16..31], past X's end


@cuda.jit
def atomic_past_end(hist, fixed):
    t = cuda.threadIdx.x
    cuda.atomic.add(hist, t % 8 if fixed else t % 9, float32(1))   # BUG: bin 8 of 8


def test_memcheck_negative_global_index_is_caught_at_its_line():
    x, out = _x(), to_device(np.zeros(32, np.float32))
    report = _run(shift_left, 1, 32, x, out, False)
    (f,) = report.findings
    assert f.tool == "memcheck" and f.kind == "out of bounds" and f.where == _line(shift_left)
    assert "invalid global read of x[-1]" in f.message and "thread [0, 0, 0]" in f.message
    assert "outside 0..31 of dimension 0" in f.message and "wrap" in f.message
    assert not _run(shift_left, 1, 32, x, out, True)


@pytest.mark.parametrize("kernel, text", [
    (shared_off_by_one, "invalid shared read of sh[32]"),
    (local_negative, "invalid local read of acc[-1]"),
    (row_view, "invalid global view of X[-1]"),
])
def test_memcheck_shared_local_and_view_indices(kernel, text):
    X = to_device(np.random.default_rng(1).standard_normal((32, 4)))
    args = (X,) if kernel is row_view else (_x(),)
    out = to_device(np.zeros(32, np.float32))
    report = _run(kernel, 1, 32, *args, out, False)
    (f,) = report.findings
    assert text in f.message and f.where == _line(kernel), f.message
    assert not _run(kernel, 1, 32, *args, out, True)


def test_memcheck_on_a_view_of_a_slice_names_the_view_and_its_own_extent():
    X = to_device(np.random.default_rng(2).standard_normal((32, 4)))
    out = to_device(np.zeros(32, np.float32))
    report = _run(slice_view, 1, 32, X, out, False)
    (f,) = report.findings
    # the index is the view's own (16 = one past its last row), shown as the kernel wrote it
    assert "invalid global read of X[16:][16, 1]" in f.message, f.message
    assert "outside 0..15 of dimension 0 of the view X[16:] (shape (16, 4))" in f.message, f.message
    assert "slice(" not in f.message and f.where == _line(slice_view)
    assert not _run(slice_view, 1, 32, X, out, True)


def test_memcheck_atomic_past_the_end_and_abort():
    hist = to_device(np.zeros(8, np.float32))
    with pytest.raises(SanitizerError, match=r"invalid global atomic of hist\[8\]") as info:
        with sim.sanitize(tools="memcheck"):
            atomic_past_end[1, 32](hist, False)
            raise AssertionError("not reached: memcheck aborts the launch and ends the block")
    assert isinstance(info.value.__cause__, MemcheckError)
    assert not _run(atomic_past_end, 1, 32, hist, True)


# --------------------------------------------------------------------------- initcheck


@cuda.jit
def reverse_in_shared(x, out, fixed):
    sh = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    if fixed or t > 0:                      # the bug: thread 0 forgets its element
        sh[t] = x[cuda.blockIdx.x * 32 + t]
    cuda.syncthreads()
    out[cuda.blockIdx.x * 32 + t] = sh[31 - t]   # BUG: thread 31 reads sh[0]


@cuda.jit
def partial_sums(x, out, fixed):
    acc = cuda.local.array(2, float32)
    t = cuda.threadIdx.x
    acc[0] = x[t]
    if fixed:
        acc[1] = float32(0)
    acc[1] += x[t]                          # BUG: acc[1] never initialised
    out[t] = acc[0] + acc[1]


@cuda.jit
def write_some(x, out):
    t = cuda.threadIdx.x
    if t != 5:
        out[t] = x[t]


@cuda.jit
def read_back(y, out):
    t = cuda.threadIdx.x
    out[t] = y[t] * float32(2)              # BUG: y[5] was never written


def test_initcheck_stale_shared_memory_of_an_earlier_block():
    # two blocks: on the simulator the second block's sh[0] still holds the first block's value; no thread of
    # either block wrote it, so both reads are reported
    x, out = _x(64), to_device(np.zeros(64, np.float32))
    report = _run(reverse_in_shared, 2, 32, x, out, False, tools="initcheck")
    (f,) = report.findings
    assert f.kind == "uninitialized shared read" and f.where == _line(reverse_in_shared)
    assert "sh[0]" in f.message and "thread [31, 0, 0]" in f.message and f.count == 2   # once per block
    assert not _run(reverse_in_shared, 2, 32, x, out, True, tools="initcheck")


def test_initcheck_local_array():
    x, out = _x(), to_device(np.zeros(32, np.float32))
    (f,) = _run(partial_sums, 1, 32, x, out, False, tools="initcheck").findings
    assert f.kind == "uninitialized local read" and "acc[1]" in f.message and f.count == 32
    assert f.where == _line(partial_sums)
    assert not _run(partial_sums, 1, 32, x, out, True, tools="initcheck")


def test_initcheck_poisoned_output_never_written():
    x = _x()
    with sim.sanitize(tools="initcheck", raise_on_error=False) as report:
        y, out = empty(32), empty(32)       # NaN-poisoned by the launcher, as every flashnb output
        write_some[1, 32](x, y)
        read_back[1, 32](y, out)
    (f,) = report.findings
    assert f.kind == "uninitialized global read" and "y[5]" in f.message and f.where == _line(read_back)
    with sim.sanitize(tools="initcheck"):   # every element written first: clean
        y, out = empty(32), empty(32)
        launch(shift_left, 1, 32, x, y, True, label="y = shift(x)")
        read_back[1, 32](y, out)


# --------------------------------------------------------------------------- synccheck


@cuda.jit
def two_barriers(x, out, fixed):
    sh = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    sh[t] = x[t]
    if fixed or t < 16:
        cuda.syncthreads()                  # BUG: the first half waits here ...
    else:
        cuda.syncthreads()                  # ... and the second half here
    out[t] = sh[31 - t]


@cuda.jit
def early_exit(x, out, fixed):
    sh = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    if not fixed and t >= 24:
        return
    sh[t] = x[t]
    cuda.syncthreads()                      # BUG: threads 24..31 have returned
    if t < 24:
        out[t] = sh[23 - t]


def test_synccheck_barriers_from_different_call_sites():
    x, out = _x(), to_device(np.zeros(32, np.float32))
    (f,) = _run(two_barriers, 1, 32, x, out, False, tools="synccheck").findings
    assert f.kind == "divergent barrier" and "threads 0..15" in f.message and "threads 16..31" in f.message
    first = _line(two_barriers)
    line = int(re.search(r":(\d+) ", first).group(1))
    assert f.where == f"{first} / test_sim_sanitizer.py:{line + 2} (two_barriers)"
    assert not _run(two_barriers, 1, 32, x, out, True, tools="synccheck")


def test_synccheck_barrier_after_an_early_return():
    x, out = _x(), to_device(np.zeros(32, np.float32))
    (f,) = _run(early_exit, 1, 32, x, out, False, tools="synccheck").findings
    assert f.kind == "barrier after exit" and "threads 24..31" in f.message and f.where == _line(early_exit)
    assert not _run(early_exit, 1, 32, x, out, True, tools="synccheck")


@cuda.jit
def hang(out):
    t = cuda.threadIdx.x
    if t < 8:
        cuda.syncthreads()                  # the others never arrive and never return: a GPU hangs
        out[t] = float32(1)
    else:
        cuda.syncwarp(0xFFFFFF00)
        cuda.syncwarp(0xFFFFFFFF)


def test_a_real_deadlock_is_still_a_deadlock_under_the_sanitizer():
    with pytest.raises(SimulatorDeadlock):
        with sim.sanitize(raise_on_error=False):
            hang[1, 32](to_device(np.zeros(32, np.float32)))


# --------------------------------------------------------------------------- the entry point


@cuda.jit
def rotate(x, out, barrier):
    sh = cuda.shared.array(64, float32)
    t = cuda.threadIdx.x
    sh[t] = x[t]
    if barrier:
        cuda.syncthreads()
    out[t] = sh[(t + 1) % cuda.blockDim.x]


def test_racecheck_is_one_of_the_tools():
    x, out = _x(64), to_device(np.zeros(64, np.float32))
    report = _run(rotate, 1, 64, x, out, False)
    (f,) = report.by_tool("racecheck")
    assert f.kind == "read/write race"
    # the unordered read may also run before the write it needed (the simulator runs threads in turn): then
    # initcheck sees a read of shared memory no thread had written yet, which is what it would be on a GPU
    assert {g.tool for g in report.findings} <= {"racecheck", "initcheck"}
    assert not _run(rotate, 1, 64, x, out, True)
    assert not _run(rotate, 1, 64, x, out, False, tools=("memcheck", "synccheck"))   # not their business


def test_bad_tools_and_nesting_are_refused():
    with pytest.raises(ValueError, match="tools must be"):
        with sim.sanitize(tools=("memcheck", "valgrind")):
            pass
    with sim.sanitize():
        with pytest.raises(RuntimeError, match="already active"):
            with sim.sanitize():
                pass


def test_cli_sanitize_a_script(tmp_path, capsys):
    script = tmp_path / "my_kernel.py"
    script.write_text(
        "import numpy as np\nimport flashnb\nfrom numba import cuda\n\n@cuda.jit\ndef k(x, y):\n"
        "    i = cuda.threadIdx.x\n    y[i] = x[i - 1]\n\n"
        "k[1, 8](flashnb.common.to_device(np.ones(8)), flashnb.common.to_device(np.ones(8)))\n")
    assert cli.main(["sanitize", str(script), "--tool", "memcheck"]) == 1
    out = capsys.readouterr().out
    assert "invalid global read of x[-1]" in out and "my_kernel.py:8 (k)" in out
    assert cli.main(["sanitize", "onepass", "--nq", "8", "--nk", "12", "--d", "4"]) == 0
    assert "onepass: no errors in 1 launch(es) (memcheck, racecheck, initcheck, synccheck)" in capsys.readouterr().out


# --------------------------------------------------------------------------- every impl


# Small tiles so every loop runs several iterations with several warps: the races a missing barrier makes
# are between one iteration's reads of a shared tile and the next iteration's reload of it.
OPTIONS = {"fa1": dict(Br=8, Bc=16, warps=2), "fa2": dict(Br=16, Bc=16, warps=2),
           "fa2-rows": dict(Br=64, Bc=16), "fa2-splitq": dict(Br=64, Bc=16, warps=2),
           "fa2-fast": dict(Br=8, Bc=8, warps=2), "flash": dict(Br=8, Bc=8, warps=2),
           "fa2-tc": dict(Br=32, Bc=32, warps=2)}


# CI runs every impl causal (its masked, partial and skipped tiles are a superset of the non-causal code paths at
# these shapes: Nk = 20 is not a multiple of any tile, and Nq > Nk leaves the first causal rows no key); the
# non-causal runs are `slow` (CI's time budget). So are
# naive (one thread per element of S, the slowest to sanitize), the stage-4 step impls (fa2-rows, fa2-splitq),
# fa2-sparse and onepass: CI sanitizes fa1, fa2, fa2-fast, flash and fa2-tc; the others' races are checked in their
# own tests (flash's features: tests/kernels/test_flash.py; fa2-tc's cp.async path: tests/kernels/test_flash_tc.py).
_CI = ("fa1", "fa2", "fa2-fast", "flash", "fa2-tc")   # fa2-tc here: float64 inputs, its float32 (TF32) path


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.parametrize("name", [n if n in _CI else pytest.param(n, marks=pytest.mark.slow) for n in IMPLS])
def test_every_impl_passes_all_four_tools(name, causal):
    rng = np.random.default_rng(7)
    q, k, v, do = (rng.standard_normal((1, n, 8)) for n in (24, 20, 20, 24))   # Nk not a multiple of a tile
    entry, opts = IMPLS[name], OPTIONS.get(name, {})
    with sim.sanitize() as report:          # raises SanitizerError listing everything it finds
        o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl=name, **opts)
        if entry.backward is not None:
            flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl=name, **opts)
    assert report.launches >= 1 and not report.findings


def test_softmax_kernels_pass_all_four_tools():
    # the stage-2 kernels that no impl launches: the three softmaxes with block and warp reductions (two
    # warps, so the warp partials meet in shared memory), the chunked online partials, one-pass attention
    # rows (key by key, and tiled with several key tiles)
    from flashnb.stages import softmax

    x = np.random.default_rng(3).standard_normal((3, 100))
    q, k, v = (np.random.default_rng(4).standard_normal(s) for s in ((5, 8), (37, 8), (37, 8)))
    with sim.sanitize() as report:
        for method in softmax.METHODS:
            for reduce in softmax.REDUCTIONS:
                softmax.softmax(x, method, reduce=reduce, threads=64)
        softmax.online_partials(x, 3, threads=32)
        softmax.attention_rows(q, k, v, causal=True, tile=None)   # key by key from global memory
        softmax.attention_rows(q, k, v, causal=True, tile=4)      # K, V tiles through shared memory
    assert report.launches == 9 and not report.findings
