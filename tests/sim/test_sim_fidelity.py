"""The simulator computes scalar arithmetic as numba types it on a GPU, in both modes.

Each case is a small device function run by a kernel on the simulator (vectorised and threads).  Its expected
values come from numba itself, never from the simulator: the same Python function compiled by numba's CPU
``@njit`` (which shares numba's scalar typing rules; the test checks that its result type is the one numba-cuda's
own typing gives for that operation), and, for ``ballot_sync``, the PTX numba-cuda generates.  The table the
simulator computes by is compared with a fresh derivation from numba-cuda's CUDA typing context.
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import cuda, njit, uint32

from flashnb import sim
from flashnb.sim import numba_typing

RNG = np.random.default_rng(20261206)


# --------------------------------------------------------------------------- the cases (device functions)

def mul(a, b):
    return a * b


def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def times_point_one(a, b):
    return a * 0.1            # a Python float is a float64: the product is float64, rounded once at the store


def times_two(a, b):
    return a * 2              # a Python int is an int64: float32 * int64 is a float64


def floordiv(a, b):
    return a // b


def mod(a, b):
    return a % b


def floordiv_literal(a, b):
    return a // 3


def truediv(a, b):
    return a / b


def lshift_3(a, b):
    return a << 3


def rshift_1(a, b):
    return a >> 1


def greater(a, b):
    return a > b


def less_equal(a, b):
    return a <= b


def neg(a, b):
    return -a


def invert(a, b):
    return ~a


def to_uint32_from_python_int(a, b):
    return uint32(12884901888 + int(a))      # 3 * 2**32 + a: numba's cast truncates


def to_uint32(a, b):
    return uint32(a)


def mixed(a, b):
    return (a * b + 7) // 5 - (a - b) % 3


def _ints(dtype, n, lo=None, hi=None):
    info = np.iinfo(dtype)
    lo = info.min if lo is None else lo
    hi = info.max if hi is None else hi
    edge = [v for v in (lo, hi, 0, 1, -1, 2, -7, 7, 100000, -100000) if lo <= v <= hi]
    return np.concatenate([np.array(edge, dtype), RNG.integers(lo, hi, n - len(edge), dtype=dtype, endpoint=True)])


def _f32(n):
    return (RNG.standard_normal(n) * 10.0 ** RNG.integers(-3, 4, n)).astype(np.float32)


N = 64
I32 = _ints(np.int32, N)
I32B = _ints(np.int32, N)
NONZERO = np.where(I32B == 0, 3, I32B).astype(np.int32)
U32 = _ints(np.uint32, N)
U32B = _ints(np.uint32, N)
F32 = _f32(N)
F32B = _f32(N)
U64 = np.concatenate([np.array([2**63 + 1, 2**64 - 1, 2**63, 0, 1], np.uint64),
                      RNG.integers(0, 2**64 - 1, N - 5, dtype=np.uint64, endpoint=True)])
I64 = np.concatenate([np.array([2**63 - 1, -1, 2**63 - 1, 0, -2**63], np.int64),
                      RNG.integers(-2**63, 2**63 - 1, N - 5, dtype=np.int64, endpoint=True)])
BOOL = RNG.integers(0, 2, N).astype(np.bool_)
BOOLB = RNG.integers(0, 2, N).astype(np.bool_)

# (id, device function, a, b, the dtype of the output array, numba's typing to check njit against: (op, a, b))
CASES = [
    ("int32*int32", mul, I32, I32B, np.int64, ("mul", "int32", "int32")),
    ("int32+int32", add, I32, I32B, np.int64, ("add", "int32", "int32")),
    ("int32-int32", sub, I32, I32B, np.int64, ("sub", "int32", "int32")),
    ("float32*0.1", times_point_one, F32, F32B, np.float32, ("mul", "float32", "float64")),
    ("float32*0.1 (float64 out)", times_point_one, F32, F32B, np.float64, ("mul", "float32", "float64")),
    ("float32*2", times_two, F32, F32B, np.float64, ("mul", "float32", "int64")),
    ("float32+int32", add, F32, I32, np.float64, ("add", "float32", "int32")),
    ("float32*float32", mul, F32, F32B, np.float32, ("mul", "float32", "float32")),
    ("uint32+uint32", add, U32, U32B, np.uint64, ("add", "uint32", "uint32")),
    ("uint32*uint32", mul, U32, U32B, np.uint64, ("mul", "uint32", "uint32")),
    ("uint32-uint32", sub, U32, U32B, np.uint64, ("sub", "uint32", "uint32")),
    ("int32//int32", floordiv, I32, NONZERO, np.int64, ("floordiv", "int32", "int32")),
    ("int32%int32", mod, I32, NONZERO, np.int64, ("mod", "int32", "int32")),
    ("int32//3", floordiv_literal, I32, I32B, np.int64, ("floordiv", "int32", "int64")),
    ("int32/int32", truediv, I32, NONZERO, np.float64, ("truediv", "int32", "int32")),
    ("int32<<3", lshift_3, I32, I32B, np.int64, ("lshift", "int32", "int64")),
    ("int32>>1", rshift_1, I32, I32B, np.int64, ("rshift", "int32", "int64")),
    ("uint32>>1", rshift_1, U32, U32B, np.uint64, ("rshift", "uint32", "int64")),
    ("uint64+int64", add, U64, I64, np.int64, ("add", "uint64", "int64")),
    ("uint64>int64", greater, U64, I64, np.bool_, ("gt", "uint64", "int64")),
    ("int32<=uint32", less_equal, I32, U32, np.bool_, ("le", "int32", "uint32")),
    ("float32>int32", greater, F32, I32, np.bool_, ("gt", "float32", "int32")),
    ("-int32", neg, I32, I32B, np.int64, None),
    ("~uint32", invert, U32, U32B, np.uint64, None),
    ("bool+bool", add, BOOL, BOOLB, np.int64, ("add", "bool", "bool")),
    ("uint32(python int)", to_uint32_from_python_int, I32, I32B, np.uint32, None),
    ("uint32(int64)", to_uint32, I64, I64, np.uint32, None),
    ("mixed int32", mixed, I32, I32B, np.int64, None),
]


def _kernel_for(fn):
    dev = cuda.jit(device=True)(fn)

    @cuda.jit
    def kernel(a, b, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = dev(a[i], b[i])

    return kernel


_KERNELS = {}


def _store(out, i, v):
    out[i] = v


def _simulate(fn, a, b, out_dtype, mode):
    kernel = _KERNELS.get(fn)
    if kernel is None:
        kernel = _KERNELS[fn] = _kernel_for(fn)
    out = np.zeros(a.size, out_dtype)
    with sim.simulating(mode), np.errstate(all="ignore"):
        kernel[2, 32](a, b, out)
    return out


def _numba_cpu(fn, a, b, out_dtype):
    """numba's own result of ``fn`` on each pair (CPU ``@njit``: numba's scalar typing and arithmetic), stored as
    numba stores a value into an array of ``out_dtype``; and the numba type of the result."""
    jitted = njit(fn)
    vals = [jitted(x, y) for x, y in zip(a, b)]
    rtype = jitted.nopython_signatures[0].return_type
    as_np = np.dtype("bool" if str(rtype) == "bool" else str(rtype)).type
    vals = [as_np(v) for v in vals]           # njit returns Python numbers: back to numba's result type
    # the store: numba converts the value to the array's type (float64 -> float32 rounds once, ints truncate)
    store = njit(_store)
    out = np.zeros(a.size, out_dtype)
    for i, v in enumerate(vals):
        store(out, i, v)
    return out, str(rtype)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_simulated_scalar_arithmetic_is_numbas(case):
    _, fn, a, b, out_dtype, typing = case
    want, rtype = _numba_cpu(fn, a, b, out_dtype)
    if typing is not None:         # njit's result type is numba-cuda's (the table is checked against numba-cuda)
        assert rtype == numba_typing.lookup(*typing)[2], (rtype, numba_typing.lookup(*typing))
    got = {mode: _simulate(fn, a, b, out_dtype, mode) for mode in ("vector", "threads")}
    assert got["vector"].tobytes() == got["threads"].tobytes()
    bad = np.flatnonzero(got["vector"] != want)
    assert bad.size == 0, (f"lane {bad[0]}: {a[bad[0]]!r}, {b[bad[0]]!r} -> simulated {got['vector'][bad[0]]!r}, "
                           f"numba {want[bad[0]]!r}")


def test_the_cases_tell_numbas_rules_from_numpys():
    """The corpus would fail a simulator with NumPy's scalar rules: on these inputs NumPy's results differ."""
    with np.errstate(all="ignore"):
        wrapped = (I32 * I32B).astype(np.int64)                       # int32 wraps in NumPy
        f32 = (F32 * np.float32(0.1)).astype(np.float32)              # a float32 product in NumPy
        u32 = (U32 + U32B).astype(np.uint64)
    assert (wrapped != _numba_cpu(mul, I32, I32B, np.int64)[0]).any()
    assert (f32 != _numba_cpu(times_point_one, F32, F32B, np.float32)[0]).any()
    assert (u32 != _numba_cpu(add, U32, U32B, np.uint64)[0]).any()
    assert (np.greater(U64, I64) != _numba_cpu(greater, U64, I64, np.bool_)[0]).any()


def test_integer_division_by_zero_raises_in_both_modes():
    """A GPU's integer division by zero gives an undefined value; the simulator stops at the line instead."""
    a = np.arange(64, dtype=np.int32)
    b = np.ones(64, np.int32)
    b[40] = 0
    for mode in ("vector", "threads"):
        with pytest.raises(ZeroDivisionError):
            _simulate(floordiv, a, b, np.int64, mode)


@cuda.jit
def _ballot(x, out):
    t = cuda.threadIdx.x
    out[t] = cuda.ballot_sync(0xFFFFFFFF, x[t] > 0)


_PTX_BALLOT = r"""
import math
import os
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
from numba import cuda, int64, float32
def k(x, out):
    t = cuda.threadIdx.x
    out[t] = cuda.ballot_sync(0xFFFFFFFF, x[t] > 0)
ptx, _ = cuda.compile_ptx(k, (float32[::1], int64[::1]), cc=(8, 0))
print("SIGNED" if "cvt.s64.s32" in ptx else ("UNSIGNED" if "cvt.u64.u32" in ptx else "OTHER"))
"""


def test_ballot_sync_is_a_signed_int32_as_numba_types_it():
    """numba-cuda's PTX sign-extends ``ballot_sync``'s result (an int32) into an int64 array: lane 31's bit makes
    it negative; both simulators store the same."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    res = subprocess.run([sys.executable, "-c", _PTX_BALLOT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    signed = res.stdout.strip().splitlines()[-1]
    assert signed in ("SIGNED", "UNSIGNED"), res.stdout
    x = np.ones(32, np.float32)
    x[3] = -1.0
    bits = 0xFFFFFFFF & ~(1 << 3)
    want = bits - (1 << 32) if signed == "SIGNED" else bits
    for mode in ("vector", "threads"):
        out = np.zeros(32, np.int64)
        with sim.simulating(mode):
            _ballot[1, 32](x, out)
        assert (out == want).all(), (mode, out[:2], want)


def test_the_typing_table_is_numba_cudas():
    """The table both simulators compute by, derived again from numba-cuda's CUDA typing context."""
    fresh = numba_typing.derive()
    table = {k: tuple(v) if v else None for k, v in fresh["binary"].items()}
    assert table == numba_typing.TABLE
    unary = {k: tuple(v) if v else None for k, v in fresh["unary"].items()}
    assert unary == numba_typing.UNARY_TABLE


@cuda.jit
def _atomic_scaled(x, out):
    t = cuda.threadIdx.x
    cuda.atomic.add(out, t, x[t] * 0.1)      # a float64 value into a float32 array


_PTX_ATOMIC = r"""
import math
import os
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
from numba import cuda, float32
def k(x, out):
    t = cuda.threadIdx.x
    cuda.atomic.add(out, t, x[t] * 0.1)
ptx, _ = cuda.compile_ptx(k, (float32[::1], float32[::1]), cc=(8, 0))
lines = [l.strip() for l in ptx.splitlines()]
print("F32ATOM" if any(l.startswith("atom.global.add.f32") or l.startswith("red.global.add.f32") for l in lines)
      and any(l.startswith("cvt.rn.f32.f64") for l in lines) else "OTHER")
"""


def test_atomic_add_converts_its_value_to_the_arrays_type_first():
    """numba-cuda's PTX rounds a float64 value to float32 (``cvt.rn.f32.f64``) and adds in float32
    (``atom``/``red .add.f32``): the simulators do the same, not NumPy's float64 in-place add."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    res = subprocess.run([sys.executable, "-c", _PTX_ATOMIC], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "F32ATOM", res.stdout
    x = (RNG.standard_normal(32) * 100).astype(np.float32)
    y = (RNG.standard_normal(32) * 100).astype(np.float32)
    want = (y + (x.astype(np.float64) * 0.1).astype(np.float32)).astype(np.float32)    # round, then a float32 add
    numpy_inplace = (y.astype(np.float64) + x.astype(np.float64) * 0.1).astype(np.float32)
    assert (want != numpy_inplace).any()          # the inputs tell the two rules apart
    for mode in ("vector", "threads"):
        out = y.copy()
        with sim.simulating(mode):
            _atomic_scaled[1, 32](x, out)
        assert out.tobytes() == want.tobytes(), mode


@cuda.jit
def _exp_times(x, y, out):
    t = cuda.threadIdx.x
    out[t] = math.exp(x[t]) * y[t]           # numba: a float32 exp (libdevice's expf), then a float32 product


_PTX_EXP = r"""
import math, os
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
from numba import cuda, float32
def k(x, y, out):
    t = cuda.threadIdx.x
    out[t] = math.exp(x[t]) * y[t]
ptx, _ = cuda.compile_ptx(k, (float32[::1], float32[::1], float32[::1]), cc=(8, 0))
print("F64" if ".f64" in ptx else "F32ONLY")
"""


def test_math_of_a_float32_is_a_float32():
    """numba-cuda computes ``math.exp(float32)`` and the product with a float32 in float32 (its PTX has no
    ``.f64``); the simulators give a float32 exp (the C library's, rounded once) and a float32 product."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    res = subprocess.run([sys.executable, "-c", _PTX_EXP], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "F32ONLY", res.stdout
    x = RNG.uniform(-5, 5, 32).astype(np.float32)
    y = (RNG.standard_normal(32) * 3).astype(np.float32)
    e = np.array([math.exp(float(v)) for v in x]).astype(np.float32)
    want = e * y                                                    # float32 * float32
    wide = (np.array([math.exp(float(v)) for v in x]) * y.astype(np.float64)).astype(np.float32)
    assert (want != wide).any()                                     # the inputs tell the two typings apart
    for mode in ("vector", "threads"):
        out = np.zeros(32, np.float32)
        with sim.simulating(mode):
            _exp_times[1, 32](x, y, out)
        assert out.tobytes() == want.tobytes(), mode
