"""The vectorised simulator's per-lane arithmetic against Python's and NumPy's scalar arithmetic (what the threads
simulator computes): every binary operator, unary operator, cast and math function on every pair of kinds a
kernel's values have (Python int, float, bool; NumPy float16/32/64, int8/16/32/64, uint8/16/32/64, bool), over edge
values (zeros of both signs, infinities, NaN, integer limits ...).  Each lane must give the scalar's type and
bits; a lane whose scalar operation raises must raise the same exception, with the same message."""

import math
import struct
import warnings

import numpy as np
import pytest
from numba import cuda, float32, uint32

from flashnb import sim
from flashnb.sim import arith, vector
from flashnb.sim.fallback import KernelFault, Unsupported
from flashnb.sim.vector import values
from flashnb.sim.vector.values import BINOPS, V

F32 = np.float32
VALUES = {
    int: [0, 1, -1, 2, 3, 7, -7, 100, -129, 255, 65535, 2**31 - 1, -2**31, 2**32 - 1, 2**40],
    float: [0.0, -0.0, 0.5, -1.5, 2.0, 3.25, 1e30, -1e-30, math.inf, -math.inf, math.nan, 1e308],
    bool: [False, True],
    np.float32: [F32(v) for v in (0, -0.0, 0.5, -1.5, 3, 1e30, 3e38, 1e-40, np.inf, -np.inf, np.nan, 16777217)],
    np.float64: [np.float64(v) for v in (0, -0.0, 0.1, -2.5, 1e300, np.inf, np.nan)],
    np.float16: [np.float16(v) for v in (0, 0.5, -2, 60000, np.inf, np.nan)],
    np.int8: [np.int8(v) for v in (0, 1, -1, 127, -128)],
    np.int32: [np.int32(v) for v in (0, 1, -1, 7, -7, 2**31 - 1, -2**31)],
    np.int64: [np.int64(v) for v in (0, 1, -3, 2**40, -2**63)],
    np.uint8: [np.uint8(v) for v in (0, 1, 200, 255)],
    np.uint32: [np.uint32(v) for v in (0, 1, 7, 2**31, 2**32 - 1)],
    np.bool_: [np.False_, np.True_],
    np.uint64: [np.uint64(v) for v in (0, 1, 5, 2**63, 2**64 - 1)],      # the dropout generator's words
    np.int16: [np.int16(v) for v in (0, -1, 300, 32767, -32768)],
    np.uint16: [np.uint16(v) for v in (0, 1, 65535)],
}
KINDS = list(VALUES)


def _lanes(vals, kind):
    a = np.array([np.asarray(v).astype(values.dtype_of(kind)) for v in vals], dtype=values.dtype_of(kind))
    return values.make(a, kind) if kind is int else V(a, kind)


def _same(got, lane, want):
    """Lane ``lane`` of ``got`` (a V or a uniform value) is ``want`` in type and bits."""
    g = values.scalar_at(got, lane)
    if type(g) is not type(want):
        return False
    if isinstance(want, float):
        return struct.pack("<d", g) == struct.pack("<d", want) or (math.isnan(g) and math.isnan(want))
    if isinstance(want, np.floating):
        return g.tobytes() == want.tobytes() or (np.isnan(g) and np.isnan(want))
    return g == want


def _scalar(fn, *args):
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn(*args), None
        except Exception as exc:   # noqa: BLE001 -- the exception is what is compared
            return None, exc


def _huge(op, a, b):
    """Python ``a ** b`` or ``a << b`` with Python ints and ``b`` beyond 64: a number of billions of bits, which
    Python would spend all memory on computing (the vectorised simulator refuses them: see the last test)."""
    return op in ("pow", "lshift") and type(a) in (int, bool) and type(b) in (int, bool) and b > 64


def _unheld(result) -> bool:
    """A scalar result no lane can hold: a Python int over 64 bits (lanes of Python ints are int64) or a value
    that is not a number kind (``(-8) ** 0.5`` is complex).  Those lanes are checked on their own
    (:func:`_refused`), not with the lanes beside them."""
    if type(result) is int:
        return not -2**63 <= result < 2**63
    return result is not None and type(result) not in values.KINDS


def _refused(fn, *args, lane=None, want=None):
    """Whether ``fn(*args)``, run on the one lane ``lane`` whose scalar result is ``want`` (one no lane can hold),
    refuses it (Unsupported: the threads simulator runs the kernel) or gives exactly ``want`` as a value the
    same on every lane (a complex on the only active lane); any other outcome is returned for the message."""
    try:
        got = fn(*args)
    except Unsupported:
        return True, None
    except Exception as exc:   # noqa: BLE001 -- reported
        return False, exc
    if lane is not None and not values.is_lanes(got) and _same(got, lane, want):
        return True, None
    return False, got


@pytest.fixture(autouse=True)
def _lanes_env():
    values.now.rank = None
    values.now.user_err = dict(divide="ignore", over="ignore", under="ignore", invalid="ignore")
    with np.errstate(all="ignore"):
        yield


@pytest.mark.parametrize("op", list(BINOPS))
def test_binary_operators_on_every_pair_of_kinds(op):
    fn = values._OPS[op].fn
    failures = []
    for ka in KINDS:
        for kb in KINDS:
            pairs = [(a, b) for a in VALUES[ka] for b in VALUES[kb] if not _huge(op, a, b)]
            n = len(pairs)
            values.now.L = n
            A = [p[0] for p in pairs]
            B = [p[1] for p in pairs]
            expected = [_scalar(fn, a, b) for a, b in pairs]
            raises = np.array([e[1] is not None for e in expected])
            # a result no lane can hold (a Python int over 64 bits, a complex): refused, checked just below
            big = np.array([_unheld(e[0]) for e in expected])
            ok = ~raises & ~big
            va, vb = _lanes(A, ka), _lanes(B, kb)
            for i in np.flatnonzero(big)[:3]:
                refused, got = _refused(BINOPS[op], va, vb, np.arange(n) == i, lane=i, want=expected[i][0])
                if not refused:
                    failures.append(f"{A[i]!r} {op} {B[i]!r}: {got!r}, not refused (Python {expected[i][0]!r})")
            if ok.any():
                try:
                    got = BINOPS[op](va, vb, ok if not ok.all() else None)
                except Exception as exc:   # noqa: BLE001
                    failures.append(f"{ka.__name__} {op} {kb.__name__}: raised {exc!r} on lanes that do not")
                    continue
                for i in np.flatnonzero(ok):
                    if not _same(got, i, expected[i][0]):
                        failures.append(f"{ka.__name__}({A[i]!r}) {op} {kb.__name__}({B[i]!r}): lanes give "
                                        f"{values.scalar_at(got, i)!r}, Python {expected[i][0]!r}")
                        break
            for i in np.flatnonzero(raises)[:3]:
                m = np.zeros(n, bool)
                m[i] = True
                try:
                    BINOPS[op](va, vb, m)
                    failures.append(f"{A[i]!r} {op} {B[i]!r}: no error, Python raises {expected[i][1]!r}")
                except KernelFault as f:
                    want = expected[i][1]
                    if type(f.exc) is not type(want) or str(f.exc) != str(want) or f.lane != i:
                        failures.append(f"{A[i]!r} {op} {B[i]!r}: {f.exc!r} (lane {f.lane}), Python {want!r}")
    assert not failures, "\n".join(failures[:20])


def test_uniform_operand_beside_lanes():
    """One operand the same on every lane (a Python or NumPy scalar), the other per lane."""
    failures = []
    for op in ("add", "sub", "mul", "truediv", "floordiv", "lt", "eq", "and", "lshift"):
        fn = values._OPS[op].fn
        for ka in KINDS:
            for kb in KINDS:
                values.now.L = len(VALUES[kb])
                vb = _lanes(VALUES[kb], kb)
                for a in VALUES[ka]:
                    # a huge Python shift is not computed (refused: test_huge_python_ints_are_refused_early)
                    expected = [_scalar(fn, a, b) if not _huge(op, a, b) else (None, None) for b in VALUES[kb]]
                    ok = np.array([e[1] is None and e[0] is not None and not _unheld(e[0]) for e in expected])
                    if not ok.any():
                        continue
                    try:
                        got = BINOPS[op](a, vb, ok if not ok.all() else None)
                    except Exception as exc:   # noqa: BLE001
                        failures.append(f"{a!r} {op} {kb.__name__}: raised {exc!r}")
                        continue
                    for i in np.flatnonzero(ok):
                        if not _same(got, i, expected[i][0]):
                            failures.append(f"{a!r} {op} {VALUES[kb][i]!r}: {values.scalar_at(got, i)!r}, "
                                            f"Python {expected[i][0]!r}")
                            break
    assert not failures, "\n".join(failures[:20])


UNARY = {"neg": (arith.UNARY["neg"], values.u_neg), "pos": (arith.UNARY["pos"], values.u_pos),
         "invert": (arith.UNARY["invert"], values.u_invert), "not": (lambda x: not x, values.u_not),
         "int": (int, values.cast_int), "float": (float, values.cast_float), "bool": (bool, values.cast_bool),
         "abs": (abs, values.b_abs),
         **{f"np.{t.__name__}": (t, (lambda t: lambda x, m: values.cast_np(t, x, m))(t))
            for t in (np.float32, np.float16, np.float64, np.int32, np.uint32, np.uint16, np.int64, np.bool_)}}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_operators_and_casts(name):
    fn, vec = UNARY[name]
    failures = []
    for k in KINDS:
        vals = VALUES[k]
        values.now.L = len(vals)
        x = _lanes(vals, k)
        expected = [_scalar(fn, v) for v in vals]
        big = np.array([_unheld(e[0]) for e in expected])      # int(1e30): refused, checked here
        for i in np.flatnonzero(big):
            refused, got = _refused(vec, x, np.arange(len(vals)) == i, lane=i, want=expected[i][0])
            if not refused:
                failures.append(f"{name}({vals[i]!r}): {got!r}, not refused (Python {expected[i][0]!r})")
        ok = np.array([e[1] is None for e in expected]) & ~big
        if ok.any():
            try:
                got = vec(x, ok if not ok.all() else None)
            except Exception as exc:   # noqa: BLE001
                failures.append(f"{name}({k.__name__}): raised {exc!r}")
                continue
            for i in np.flatnonzero(ok):
                if not _same(got, i, expected[i][0]):
                    failures.append(f"{name}({vals[i]!r}): {values.scalar_at(got, i)!r}, Python {expected[i][0]!r}")
        for i in np.flatnonzero(~ok & ~big)[:2]:
            m = np.zeros(len(vals), bool)
            m[i] = True
            try:
                vec(x, m)
                failures.append(f"{name}({vals[i]!r}): no error, Python raises {expected[i][1]!r}")
            except KernelFault as f:
                if type(f.exc) is not type(expected[i][1]) or str(f.exc) != str(expected[i][1]):
                    failures.append(f"{name}({vals[i]!r}): {f.exc!r}, Python {expected[i][1]!r}")
    assert not failures, "\n".join(failures[:20])


MATH = [math.exp, math.log, math.sqrt, math.tanh, math.log2, math.expm1, math.sin, math.floor, math.ceil,
        math.isfinite, math.isnan]


@pytest.mark.parametrize("fn", MATH, ids=[f.__name__ for f in MATH])
def test_math_functions_and_their_float32_results(fn):
    """``math.fn(x)`` per lane is the C library's (Python's); ``float32(math.fn(x))`` too, on many values near
    float32 rounding boundaries (from random float32 inputs)."""
    r = np.random.default_rng(0)
    xs = np.concatenate([r.standard_normal(4000) * 30, r.uniform(-1e-3, 1e-3, 500), [0, -0.0, 88.7, 89, 709,
                         710, -745, -800, np.inf, -np.inf, np.nan, 1e-39, 1e30, -1e30]]).astype(np.float32)
    values.now.L = len(xs)
    x = V(xs, np.float32)
    # numba types math.fn(float32) as a float32 (flashnb.sim.arith.math_call: the C library's value, rounded once)
    one = (lambda v: arith.math_call(fn, v)) if fn in arith.MATH_F32 else fn
    expected = [_scalar(one, v) for v in xs]
    big = np.array([_unheld(e[0]) for e in expected])          # math.floor(1e30): refused
    for i in np.flatnonzero(big):
        refused, res = _refused(values.math_call, fn, (x,), np.arange(len(xs)) == i)
        assert refused, f"{fn.__name__}({xs[i]!r}): {res!r}, not refused (Python {expected[i][0]!r})"
    ok = np.array([e[1] is None for e in expected]) & ~big
    got = values.math_call(fn, (x,), ok)
    bad = [i for i in np.flatnonzero(ok) if not _same(got, i, expected[i][0])]
    assert not bad, f"{fn.__name__}({xs[bad[0]]!r}): {values.scalar_at(got, bad[0])!r}, {expected[bad[0]][0]!r}"
    raises = np.array([e[1] is not None for e in expected])
    first_err = int(np.argmax(raises)) if raises.any() else None
    if first_err is not None:
        with pytest.raises(KernelFault) as info:
            values.math_call(fn, (x,), None)
        assert info.value.lane == first_err and type(info.value.exc) is type(expected[first_err][1])
    if fn in values._FAST_MATH:
        want = [_scalar(lambda v: np.float32(fn(v)), v) for v in xs]
        okf = np.array([w[1] is None for w in want])
        got32 = values.f32_math(np.float32, fn, (x,), okf)
        bad = [i for i in np.flatnonzero(okf) if not _same(got32, i, want[i][0])]
        assert not bad, f"float32({fn.__name__}({xs[bad[0]]!r})): {got32.a[bad[0]]!r}, {want[bad[0]][0]!r}"


def test_python_ints_wrap_at_64_bits_as_numba_int64():
    """Python ints are int64 lanes with a bound on their bits: an operation that may leave 64 bits is computed
    exactly per lane and wrapped as numba's int64 arithmetic wraps (compared with NumPy's wrapping int64 arrays)."""
    values.now.L = 3
    x = values.make(np.array([2**40, 3, -2**40], np.int64), int)
    y = values.make(np.array([3, 5, -7], np.int64), int)
    assert BINOPS["mul"](x, y, None).a.tolist() == [3 * 2**40, 15, 7 * 2**40]
    z = values.make(np.array([2**22, 1, 2], np.int64), int)
    assert BINOPS["mul"](x, z, None).a.tolist() == [2**62, 3, -2**41]      # bounds say maybe not: exact
    got = BINOPS["mul"](x, x, None)                                         # 2**80: wraps to 0
    assert got.a.tolist() == np.multiply(x.a, x.a).tolist()


def test_huge_python_shifts_raise_and_powers_wrap():
    """``a << b`` with Python ints and ``b >= 64`` is undefined in compiled code: an error naming the first such
    lane; ``a ** b`` is numba's wrapping int64 power (checked against repeated wrapping multiplication)."""
    n = 10**6
    values.now.L = 3
    va = values.make(np.array([0, 0, 5], np.int64), int)
    vb = values.make(np.array([n, n + 1, n], np.int64), int)
    with pytest.raises(KernelFault) as info:
        BINOPS["lshift"](va, vb, None)
    assert info.value.lane == 0 and "outside 0..63" in str(info.value.exc)
    with pytest.raises(KernelFault, match="outside 0..63"):
        BINOPS["lshift"](5, vb, None)
    va = values.make(np.array([1, -1, 3], np.int64), int)
    got = BINOPS["pow"](va, values.make(np.array([70, 71, 70], np.int64), int), None)
    want = []
    for base, e in ((1, 70), (-1, 71), (3, 70)):
        acc = np.array([1], np.int64)
        for _ in range(e):
            acc = np.multiply(acc, np.int64(base))
        want.append(int(acc[0]))
    assert [values.scalar_at(got, i) for i in range(3)] == want


@cuda.jit
def _casts_and_divisions(x, n, out_u, out_q):
    t = cuda.threadIdx.x
    out_u[t] = uint32(x[t])                 # -inf, NaN, 3e9, -1.5 ...: C's cast of each lane's float32
    out_q[t] = float32(n[t] / 300)          # an int8 by a Python int out of int8's range: float64 division


def test_casts_and_divisions_in_a_kernel_as_the_threads_simulator():
    """The per-lane rules above, reached from a kernel's source: the same bytes and the same warnings (the
    'invalid' cast of -inf and NaN, from numba's uint32 cast) in both modes, and no launch handed to threads."""
    x = np.array([-1.5, -np.inf, np.nan, 3e9, 2.5, 1e30, 7, -0.0], np.float32)
    n = np.array([1, -128, 127, 0, 5, -1, 100, 3], np.int8)
    results = {}
    for mode in ("vector", "threads"):
        before = vector.counts()["threads"]
        with sim.simulating(mode), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out_u = np.full(8, 12345, np.uint32)
            out_q = np.full(8, np.nan, np.float32)
            _casts_and_divisions[1, 8](x, n, out_u, out_q)
        results[mode] = (out_u.tobytes(), out_q.tobytes(),
                         sorted({(str(w.message), w.category, w.filename, w.lineno) for w in caught}))
        if mode == "vector":
            assert vector.counts()["threads"] == before, "the vectorised launch fell back to threads"
    assert results["vector"] == results["threads"]
    assert not np.isnan(np.frombuffer(results["vector"][1], np.float32)).any()
    assert [w[0] for w in results["vector"][2]] == ["invalid value encountered in cast"]
