"""What the vectorised simulator cannot run goes to the threads simulator, with one note per kernel and reason;
a kernel's error is never retried there: it is raised exactly as the threads simulator raises it.

PYTEST_DONT_REWRITE: pytest's assertion rewriting changes the code of the kernels defined here (an ``assert`` in
a kernel), which no longer matches their source; the vectorised simulator would then (rightly) refuse them."""

import math
import warnings

import numpy as np
import pytest
from numba import cuda, float32, int32

import flashnb
from flashnb import sim
from flashnb.instruments import traffic
from flashnb.sim import traffic as sim_traffic
from flashnb.sim import vector

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator-only")

FULL = 0xFFFFFFFF


def _both(kernel, grid, block, make_args):
    """Run on each simulator; return ``{mode: (outputs or the exception, launches handed to threads)}``."""
    out = {}
    for mode in ("vector", "threads"):
        with sim.simulating(mode):
            args = make_args()
            before = vector.counts()["threads"]
            try:
                kernel[grid, block](*args)
                res = tuple(a.copy() for a in args if isinstance(a, np.ndarray))
            except Exception as exc:       # noqa: BLE001 -- compared below
                res = exc
            out[mode] = (res, vector.counts()["threads"] - before)
    return out


def _same_error(out):
    (ev, nv), (et, _) = out["vector"], out["threads"]
    assert isinstance(ev, BaseException) and isinstance(et, BaseException), out
    assert type(ev) is type(et) and str(ev) == str(et), (ev, et)
    assert nv == 0, "a kernel error must not be retried on the threads simulator"
    return ev


# --------------------------------------------------------------------------- fallbacks


@cuda.jit
def uses_try(x, out):
    t = cuda.threadIdx.x
    try:
        out[t] = x[t] * float32(2)
    except IndexError:
        out[t] = float32(-1)


@cuda.jit
def divergent_shuffle(x, out):
    t = cuda.threadIdx.x
    if t < 16:
        out[t] = cuda.shfl_sync(FULL, x[t], 20)   # the other half calls it from the else branch
    else:
        out[t] = cuda.shfl_sync(FULL, x[t], 3)


@cuda.jit
def divergent_barrier_after_write(out):
    t = cuda.threadIdx.x
    out[t] += float32(1)                          # written before the fallback: must be undone, not doubled
    if t < 8:
        cuda.syncthreads()
    else:
        cuda.syncthreads()
    out[t] += float32(t)


@cuda.jit
def strings_per_lane(out):
    t = cuda.threadIdx.x
    name = "ab" if t < 3 else "abc"              # a str per lane: len() of each, once per lane
    out[t] = float32(len(name))


@cuda.jit
def shuffle_of_mixed_types(out):
    t = cuda.threadIdx.x
    v = t if t < 3 else float32(t)               # an int on some lanes, a float32 on others
    out[t] = cuda.shfl_sync(FULL, v, (t + 1) % 32)


@cuda.jit
def prints(out):
    t = cuda.threadIdx.x
    print("thread", t)
    out[t] = float32(t)


@pytest.mark.parametrize("kernel, block, reason", [
    (uses_try, 8, "a `try` statement at test_sim_vector_fallback.py:"),
    (divergent_shuffle, 32, "cuda.shfl_sync(mask=0xffffffff) reached by only some of the live lanes"),
    (divergent_barrier_after_write, 16, "syncthreads() reached by only some of a block's live threads"),
    (shuffle_of_mixed_types, 32, "cuda.shfl_sync of values of different types in different lanes"),
])
def test_fallback_notes_once_and_gives_the_threads_result(kernel, block, reason):
    def make():
        return (np.arange(block, dtype=np.float32) + 1, np.zeros(block, np.float32)) if kernel in (
            uses_try, divergent_shuffle) else (np.zeros(block, np.float32),)

    n_notes = len(vector.notes())
    out = _both(kernel, 1, block, make)
    (rv, nv), (rt, _) = out["vector"], out["threads"]
    assert nv == 1                                        # it ran on the threads simulator
    for a, b in zip(rv, rt):
        assert a.tobytes() == b.tobytes()
    new = vector.notes()[n_notes:]
    assert len(new) == 1 and reason in new[0] and kernel.py_func.__name__ in new[0], new
    _both(kernel, 1, block, make)
    assert len(vector.notes()) == n_notes + 1             # once per kernel and reason
    assert vector.explain(kernel) == ("" if kernel is not uses_try else new[0].split("cannot run it: ")[1][:-1])


def test_print_runs_on_the_threads_simulator(capfd):
    out = np.zeros(4, np.float32)
    n_notes = len(vector.notes())
    prints[1, 4](out)
    printed = capfd.readouterr().out
    assert all(str(t) in printed for t in range(4)) and out.tolist() == [0, 1, 2, 3]
    assert "print() in a kernel" in vector.notes()[n_notes]


def test_strings_per_lane_run_vectorised():
    out = _both(strings_per_lane, 1, 8, lambda: (np.zeros(8, np.float32),))
    assert out["vector"][1] == 0 and out["vector"][0][0].tolist() == [2, 2, 2, 3, 3, 3, 3, 3]
    assert out["vector"][0][0].tobytes() == out["threads"][0][0].tobytes()


def test_kernel_without_source_runs_on_threads():
    ns = {"cuda": cuda, "float32": float32}
    exec("@cuda.jit\ndef twice(x):\n    x[cuda.threadIdx.x] *= float32(2)\n", ns)
    x = np.arange(4, dtype=np.float32)
    before = vector.counts()["threads"]
    ns["twice"][1, 4](x)
    assert x.tolist() == [0, 2, 4, 6] and vector.counts()["threads"] == before + 1
    assert "no source" in vector.explain(ns["twice"])


def test_threads_mode_is_a_choice(monkeypatch):
    x = np.arange(4, dtype=np.float32)
    before = vector.counts()
    with sim.simulating("threads"):
        assert sim.mode() == "threads"
        uses_try[1, 4](x, np.zeros(4, np.float32))
    assert vector.counts() == before and sim.mode() == "vector"
    with pytest.raises(ValueError, match="sim must be one of"):
        sim.set_mode("lockstep")


def test_an_unknown_access_observer_falls_back(monkeypatch):
    seen = []

    class Observer:
        locals = False

        def index(self, op, proxy, idx):
            pass

        def access(self, op, proxy, idx):
            seen.append(op)

        def finish(self):
            pass

    monkeypatch.setattr(sim_traffic, "observer_factory", lambda label, kernel: Observer())
    x = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    with traffic.count():
        strings_per_lane[1, 4](out)
        uses_try[1, 4](x, out)
    assert seen                                           # the threads simulator showed it the accesses


# --------------------------------------------------------------------------- kernel errors are not retried


# Each faulty kernel fails in one thread only: when several threads raise, which one the threads simulator
# reports depends on how its threads are scheduled (the vectorised one names the first in its start order).


@cuda.jit
def past_the_end(x, out):
    t = cuda.threadIdx.x
    out[t] = x[t + 3 if t == 5 else t]           # thread 5 reads past the end


@cuda.jit
def divide(x, out, d):
    t = cuda.threadIdx.x
    out[t] = float32(t // (t - d))               # a Python int division by zero in thread d


@cuda.jit
def overflow_exp(x, out):
    t = cuda.threadIdx.x
    out[t] = float32(math.exp(x[t] * float32(1000)))   # Python's math.exp raises from 709.78: thread 6


@cuda.jit
def log_of_negative(x, out):
    t = cuda.threadIdx.x
    if t > 2:
        out[t] = float32(math.log(x[t] - float32(5)))  # thread 3: log(-4)


@cuda.jit
def shift_too_far(out):
    t = cuda.threadIdx.x
    out[t] = int32(1 << (64 if t == 3 else t))   # a shift count of 64 (undefined in compiled code): thread 3


@cuda.jit
def unbound(out):
    t = cuda.threadIdx.x
    if t != 2:
        y = float32(t)
    out[t] = y                                   # UnboundLocalError in thread 2


@cuda.jit
def bool_shuffle(out):
    t = cuda.threadIdx.x
    out[t] = cuda.shfl_sync(FULL, t > 3, 0)


@cuda.jit
def asserts(out):
    t = cuda.threadIdx.x
    assert t != 5, "thread 5 is not welcome"
    out[t] = float32(t)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")   # float32(exp(800)) on the way to the error
@pytest.mark.parametrize("kernel, block, make, match", [
    (past_the_end, 8, lambda: (np.ones(8, np.float32), np.zeros(8, np.float32)),
     r"IndexError\('tid=\[5, 0, 0\] ctaid=\[0, 0, 0\]: index 8 is out of bounds for axis 0 with size 8"),
    (divide, 8, lambda: (np.ones(8, np.float32), np.zeros(8, np.float32), 6),
     r"ZeroDivisionError\('tid=\[6, 0, 0\] ctaid=\[0, 0, 0\]: integer division or modulo by zero"),
    (overflow_exp, 8, lambda: (np.float32([0, -1, 0.5, 0, 0.7, -0.9, 0.8, 0]), np.zeros(8, np.float32)),
     r"OverflowError\('tid=\[6, 0, 0\] ctaid=\[0, 0, 0\]: math range error"),
    (log_of_negative, 8, lambda: (np.float32([9, 9, 9, 1, 9, 9, 9, 9]), np.zeros(8, np.float32)),
     r"ValueError\('tid=\[3, 0, 0\] ctaid=\[0, 0, 0\]: math domain error"),
    (shift_too_far, 8, lambda: (np.zeros(8, np.int64),),
     r"ValueError\('tid=\[3, 0, 0\] ctaid=\[0, 0, 0\]: shift count 64 is outside 0..63 for int64"),
    (unbound, 4, lambda: (np.zeros(4, np.float32),),
     r"UnboundLocalError\(\"tid=\[2, 0, 0\] ctaid=\[0, 0, 0\]: cannot access local variable 'y'"),
    (asserts, 8, lambda: (np.zeros(8, np.float32),),
     r"AssertionError\('tid=\[5, 0, 0\] ctaid=\[0, 0, 0\]: thread 5 is not welcome"),
])
def test_kernel_errors_are_raised_as_the_threads_simulator_raises_them(kernel, block, make, match):
    import re

    err = _same_error(_both(kernel, 1, block, make))
    assert re.match(match, repr(err)), repr(err)


def test_an_error_of_every_thread_names_the_first_thread():
    out = _both(bool_shuffle, 1, 32, lambda: (np.zeros(32, np.float32),))
    (ev, nv), (et, _) = out["vector"], out["threads"]
    assert type(ev) is type(et) is TypeError and nv == 0
    assert str(ev) == ("tid=[0, 0, 0] ctaid=[0, 0, 0]: cuda.shfl_sync only supports 32- and 64-bit ints and floats, "
                       "got bool")
    assert str(et).split(": ", 1)[1] == str(ev).split(": ", 1)[1]


@cuda.jit
def masked_arithmetic(x, out):
    t = cuda.threadIdx.x
    v = x[t]
    if v != float32(0):                          # inactive lanes would divide by zero: no warning for them
        out[t] = float32(1) / v
    if t == 5:
        out[t] = v * float32(3e38)               # an active lane overflows float32: the threads simulator warns


def test_float_exceptions_only_on_active_lanes():
    x = np.array([0, 1, 0, 2, 0, 4, 0, 8], np.float32)
    results = {}
    for mode in ("vector", "threads"):
        with sim.simulating(mode), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = np.zeros(8, np.float32)
            masked_arithmetic[1, 8](x, out)
        results[mode] = (out.tobytes(), sorted({(str(w.message), w.category, w.lineno) for w in caught}))
    assert results["vector"] == results["threads"]
    assert [m for m, _, _ in results["vector"][1]] == ["overflow encountered in scalar multiply"]
    # NumPy's error settings are per thread: the caller's do not reach the threads simulator's threads (nor, to
    # compute the same, the vectorised simulator's lanes) ...
    with np.errstate(over="raise"), pytest.warns(RuntimeWarning, match="overflow encountered in scalar multiply"):
        out = _both(masked_arithmetic, 1, 8, lambda: (x.copy(), np.zeros(8, np.float32)))   # a warning, not raised
    assert out["vector"][0][1].tobytes() == out["threads"][0][1].tobytes() == results["vector"][0]
    # ... but a debug kernel's do: division by zero raises (the simulator's np.seterr(divide="raise"))
    err = _same_error(_both(debug_divide, 1, 8, lambda: (x.copy(), np.zeros(8, np.float32))))
    assert isinstance(err, FloatingPointError) and "tid=[0, 0, 0]" in str(err) and "divide by zero" in str(err)


@cuda.jit(debug=True, opt=False)
def debug_divide(x, out):
    t = cuda.threadIdx.x
    if t < 2:
        out[t] = float32(1) / x[t]               # x[0] = 0: thread 0 divides by zero
