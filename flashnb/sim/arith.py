"""Scalar arithmetic as numba types it: what one thread computes for ``a op b`` and ``op x``, in both simulators.

:mod:`.numba_typing` gives numba's signature of each operator on each pair of scalar types; here it is applied to
one thread's values.  The rules, for an operation that involves a NumPy number (``np.int32``, ``np.float32``,
...):

* the operands are converted to the signature's argument types (an integer conversion wraps, as a GPU's does),
  the operation is done in those types, and the result is a NumPy scalar of numba's result type:
  ``int32 * int32`` is an ``np.int64``; ``float32 * 0.1`` an ``np.float64`` (the store into a float32 array
  rounds it once); a comparison of ``uint64`` and ``int64`` compares their float64 values, as numba does;
* integer results wrap at their width, silently (a GPU raises nothing); ``-x`` and ``~x`` of an integer are
  computed in ``x``'s own type and then widened to numba's result type (``-int32(-2**31)`` is ``-2**31``);
* integer ``//`` and ``%`` are Python's (floor) semantics, as numba's; an integer divisor of zero raises
  ``ZeroDivisionError`` (on a GPU the result is undefined);
* a shift count outside ``0 .. width - 1`` raises ``ValueError`` (undefined on a GPU); ``>>`` of a signed value is
  arithmetic;
* an integer raised to a negative integer power raises ``ValueError`` (NumPy's message);
* a pair numba has no signature for (``float32 << 1``, ``~float32``) raises ``TypeError``.

Python numbers on both sides keep Python's rules, which are numba's for ``int64``/``float64``/``boolean`` except
where noted: an ``int`` result wraps at 64 bits, a shift count must be below 64, ``~True`` is ``False``
(numba's ``~`` of a boolean is ``not``), and an ``int`` compared with a ``float`` compares float64 values.  A
Python ``int`` beside a NumPy number is an ``int64`` (a ``uint64`` when only that holds it), a ``float`` a
``float64``, a ``bool`` a ``boolean``.

Float operations warn (NumPy's ``RuntimeWarning``) where the NumPy scalar operation in the signature's types
warns; such a warning names this module's line in both simulators.  ``**`` of floats is NumPy's ``power`` in the
signature's types (a GPU computes ``float ** int`` by repeated multiplication: the last bit may differ).
"""

from __future__ import annotations

import math
import operator
import sys
import warnings

import numpy as np

from .numba_typing import lookup, lookup_unary

__all__ = ["binop", "unop", "BINARY", "UNARY", "fast", "name_of", "NP_TYPES", "wrap", "ZERO_DIV", "shift_error",
           "pow_error"]

NP_TYPES = {"bool": np.bool_, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
            "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
            "float16": np.float16, "float32": np.float32, "float64": np.float64}
_NAME = {v: k for k, v in NP_TYPES.items()}
_NAME.update({int: "int64", float: "float64", bool: "bool"})
_PY = (int, float, bool)
_BITS = {n: np.dtype(t).itemsize * 8 for n, t in NP_TYPES.items() if n != "bool"}
_SIGNED = {n: np.dtype(t).kind == "i" for n, t in NP_TYPES.items()}
_FN = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
       "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow, "lshift": operator.lshift,
       "rshift": operator.rshift, "and": operator.and_, "or": operator.or_, "xor": operator.xor,
       "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
       "ne": operator.ne}
_COMPARE = frozenset(("lt", "le", "gt", "ge", "eq", "ne"))
_INT_RESULT_PY = frozenset(("add", "sub", "mul", "floordiv", "mod", "and", "or", "xor", "lshift", "rshift"))
ZERO_DIV = "integer division or modulo by zero"
_INT64_MIN, _INT64_END = -(1 << 63), 1 << 63


def shift_error(count, name) -> ValueError:
    return ValueError(f"shift count {count} is outside 0..{_BITS[name] - 1} for {name}: undefined in compiled code")


def pow_error() -> ValueError:
    return ValueError("Integers to negative integer powers are not allowed.")


def name_of(t, value=None):
    """The numba type name of a thread's scalar type ``t`` (a Python int by its value: int64, else uint64)."""
    if t is int and value is not None and not _INT64_MIN <= value < _INT64_END:
        if 0 <= value < (1 << 64):
            return "uint64"
        raise OverflowError(f"Python int too large for numba's integer types: {value}")
    return _NAME.get(t)


def wrap(v: int, name: str) -> int:
    """Python int ``v`` reduced to the integer type ``name`` (two's complement), as a Python int."""
    bits = _BITS[name]
    v &= (1 << bits) - 1
    if _SIGNED[name] and v >> (bits - 1):
        v -= 1 << bits
    return v


def _to_int(x, name) -> int:
    """``x`` converted to integer type ``name`` as a Python int (from a bool or any integer: wrapped)."""
    if name == "bool":
        return int(bool(x))
    return wrap(int(x), name)


def _to(x, name):
    """``x`` converted to numba type ``name`` as a NumPy scalar."""
    t = NP_TYPES[name]
    if name == "bool":
        return np.bool_(bool(x))
    if _BITS.get(name) and np.dtype(t).kind in "iu":
        return t(_to_int(x, name))
    return t(x)


# --------------------------------------------------------------------------- binary


def _python_plan(op):
    fn = _FN[op]
    if op in _COMPARE:
        def compare(a, b):
            if (type(a) is float) is not (type(b) is float) and (type(a) is float or type(b) is float):
                return fn(float(a), float(b))      # numba compares an int64 with a float64 as float64 values
            return fn(a, b)
        return compare
    if op in ("lshift", "rshift"):
        def shift(a, b):
            if not 0 <= b < 64:
                raise shift_error(b, "int64")
            r = fn(a, b)
            return wrap(r, "int64") if not _INT64_MIN <= r < _INT64_END else r
        return shift
    if op == "pow":
        def power(a, b):
            if type(a) is float or type(b) is float or b < 0:
                return a ** b
            return wrap(pow(int(a), int(b), 1 << 64), "int64")
        return power
    if op in _INT_RESULT_PY:
        def arith(a, b):
            r = fn(a, b)
            if type(r) is int and not _INT64_MIN <= r < _INT64_END:
                return wrap(r, "int64")
            return r
        return arith
    return fn


def _numba_plan(op, na, nb):
    sig = lookup(op, na, nb)
    if sig is None:
        def untyped(a, b):
            raise TypeError(f"numba has no {op} of {na} and {nb} (the kernel would not compile)")
        return untyped
    a1, a2, r = sig
    fn = _FN[op]
    if op in _COMPARE:
        def compare(x, y):
            return np.bool_(fn(_to(x, a1), _to(y, a2)))
        return compare
    rt = NP_TYPES[r]
    if r == "bool":
        def logical(x, y):
            return np.bool_(fn(bool(x), bool(y)))
        return logical
    if np.dtype(rt).kind == "f":
        if op == "pow":
            def fpow(x, y):
                v = np.power(_to(x, a1), _to(y, a2))
                return v if type(v) is rt else rt(v)
            return fpow

        def farith(x, y):
            v = fn(_to(x, a1), _to(y, a2))
            return v if type(v) is rt else rt(v)
        return farith
    # an integer result: computed on Python ints, wrapped to the result type
    if op in ("lshift", "rshift"):
        def ishift(x, y):
            count = _to_int(y, a2)
            if not 0 <= count < _BITS[r]:
                raise shift_error(count, r)
            return rt(wrap(fn(_to_int(x, r), count), r))
        return ishift
    if op in ("floordiv", "mod"):
        def idiv(x, y):
            d = _to_int(y, r)
            if d == 0:
                raise ZeroDivisionError(ZERO_DIV)
            return rt(wrap(fn(_to_int(x, r), d), r))
        return idiv
    if op == "pow":
        def ipow(x, y):
            e = _to_int(y, r)
            if e < 0:
                raise pow_error()
            return rt(wrap(pow(_to_int(x, r), e, 1 << _BITS[r]), r))
        return ipow

    def iarith(x, y):
        return rt(wrap(fn(_to_int(x, a1), _to_int(y, a2)), r))
    return iarith


class _Plans(dict):
    __slots__ = ("op",)

    def __missing__(self, key):
        ta, tb = key
        if ta in _PY and tb in _PY:
            plan = _python_plan(self.op)
        elif ta not in _NAME or tb not in _NAME:
            plan = _FN[self.op]                     # not numbers (tuples, arrays ...): Python's operator
        else:
            plan = _numba_plan(self.op, _NAME[ta], _NAME[tb])
        self[key] = plan
        return plan


def _make(op):
    plans = _Plans()
    plans.op = op

    def scalar(a, b):
        ta = type(a)
        tb = type(b)
        if ta is int and tb not in _PY and tb in _NAME and not _INT64_MIN <= a < _INT64_END:
            return plans[(np.uint64, tb)](_to(a, name_of(int, a)), b)
        if tb is int and ta not in _PY and ta in _NAME and not _INT64_MIN <= b < _INT64_END:
            return plans[(ta, np.uint64)](a, _to(b, name_of(int, b)))
        return plans[(ta, tb)](a, b)

    scalar.__name__ = f"numba_{op}"
    scalar.__qualname__ = scalar.__name__
    return scalar


#: ``BINARY[op](a, b)``: one thread's ``a op b`` as numba computes it
BINARY = {op: _make(op) for op in _FN}


def binop(op, a, b):
    return BINARY[op](a, b)


class _Fast(dict):
    """``FAST[op][(type_a, type_b)]``: True where Python's own operator already computes numba's result, type
    and warnings included (the threads simulator then runs the operator itself)."""

    __slots__ = ("op",)

    def __missing__(self, key):
        self[key] = r = _fast(self.op, *key)
        return r


def _fast(op, ta, tb) -> bool:
    if ta in _PY and tb in _PY:
        return (ta is float and tb is float and op not in ("pow",)) or (ta is bool and tb is bool and op in (
            "and", "or", "xor", "eq", "ne"))
    if ta not in _NAME or tb not in _NAME or ta is int or tb is int:
        return False
    sig = lookup(op, _NAME[ta], _NAME[tb])
    if sig is None or op == "pow":
        return False
    a1, a2, r = sig
    if a1 != _NAME[ta] or a2 != _NAME[tb] or a1 != a2:
        return False
    if op in _COMPARE:
        return True
    if r != a1:
        return False
    return np.dtype(NP_TYPES[r]).kind == "f" or r == "bool"


FAST = {op: _Fast() for op in _FN}
for _op, _d in FAST.items():
    _d.op = _op


def fast(op, ta, tb) -> bool:
    return FAST[op][(ta, tb)]


# --------------------------------------------------------------------------- unary

_UFN = {"neg": operator.neg, "pos": operator.pos, "invert": operator.invert}


def _unary_plan(op, t):
    fn = _UFN[op]
    if t in _PY:
        if t is bool:
            if op == "invert":
                return operator.not_
            return lambda x: fn(int(x))
        if t is int and op == "neg":
            return lambda x: wrap(-x, "int64") if x == _INT64_MIN else -x
        return fn
    name = _NAME.get(t)
    if name is None:
        return fn
    sig = lookup_unary(op, name)
    if sig is None:
        def untyped(x):
            raise TypeError(f"numba has no {op} of {name} (the kernel would not compile)")
        return untyped
    a, r = sig
    rt = NP_TYPES[r]
    if r == "bool":
        return lambda x: np.bool_(not bool(x))
    if np.dtype(rt).kind == "f":
        return lambda x: fn(_to(x, a))
    if a == "bool":
        return lambda x: rt(wrap(fn(int(bool(x))), r))
    return lambda x: rt(wrap(wrap(fn(_to_int(x, a)), a), r))      # in the operand's type, then widened


class _UPlans(dict):
    __slots__ = ("op",)

    def __missing__(self, t):
        self[t] = p = _unary_plan(self.op, t)
        return p


def _make_unary(op):
    plans = _UPlans()
    plans.op = op

    def scalar(x):
        return plans[type(x)](x)

    scalar.__name__ = f"numba_{op}"
    return scalar


#: ``UNARY[op](x)``: one thread's ``-x``, ``+x``, ``~x`` as numba computes it
UNARY = {op: _make_unary(op) for op in _UFN}


def unop(op, x):
    return UNARY[op](x)


def to_type(value, dtype):
    """``value`` converted to NumPy ``dtype``'s scalar type as numba converts it (integers wrap)."""
    name = _NAME.get(dtype.type)
    return _to(value, name) if name is not None else value


def cast_int_python(t, value):
    """numba's ``t(value)`` for an integer type ``t`` (a NumPy integer type) and an integer ``value``: wrapped."""
    return t(wrap(int(value), _NAME[t]))


# --------------------------------------------------------------------------- math functions of a float32

#: the ``math`` functions numba types float32 -> float32 (libdevice's float32 functions on a GPU)
MATH_F32 = frozenset((math.exp, math.log, math.log2, math.log10, math.expm1, math.log1p, math.sqrt, math.tanh,
                      math.sinh, math.cosh, math.sin, math.cos, math.tan, math.atan, math.asin, math.acos,
                      math.fabs))
MATH_NAMES = frozenset(f.__name__ for f in MATH_F32)
#: files of the simulator's own frames between a kernel's line and :func:`math_call` (warnings name the kernel)
CALLER_SKIP: set = set()
_F32_MAX = 3.4028234663852886e38


def math_call(f, x):
    """``f(x)`` in a kernel: a float32 result for a float32 ``x`` and one of :data:`MATH_F32` (computed in
    float64 by the C library, then rounded once: a GPU's float32 function may differ in the last bits), else
    Python's call.  An overflow of the rounding warns at the kernel's line, as NumPy's cast would."""
    if type(x) is not np.float32 or f not in MATH_F32:
        return f(x)
    r = f(float(x))
    if -_F32_MAX <= r <= _F32_MAX or r != r or r in (math.inf, -math.inf):
        return np.float32(r)
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename in CALLER_SKIP:
        frame = frame.f_back
    g = frame.f_globals
    module = sys.modules.get(g.get("__name__", ""))
    registry = vars(module).setdefault("__warningregistry__", {}) if module is not None else None
    warnings.warn_explicit("overflow encountered in cast", RuntimeWarning, frame.f_code.co_filename,
                           frame.f_lineno, module=g.get("__name__", "kernel"), registry=registry)
    with np.errstate(over="ignore"):
        return np.float32(r)
