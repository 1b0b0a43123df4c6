"""The helpers translated kernels call: indexing, function calls, loops, returns (see :mod:`.translate`).

A call in a kernel is resolved when it runs, as in the threads simulator (names are looked up in the kernel's
globals and closure): a ``cuda.jit`` device function runs its translated version on the active lanes; a
method of the vectorised ``cuda`` gets the mask and the call site; numba and NumPy number types and
``int``/``float``/``bool`` are casts, ``math`` functions and ``max``/``min``/``abs`` are computed per lane; any
other Python function is called once with its arguments when none of them differs per lane (what every lane
would do), and otherwise once per active lane with that lane's scalars (exact, slow), unless it is one of the
known element-wise NumPy functions (:data:`ELEMENTWISE`), which take the lanes' arrays at once.
"""

from __future__ import annotations

import builtins

import numpy as np

from .. import arith as _arith
from ..fallback import KernelFault, Unsupported
from . import arrays, tools
from .arrays import Arr, Local
from .values import (
    Mixed,
    U,
    V,
    b_abs,
    b_max,
    b_min,
    cast,
    collapse_int,
    first_lane,
    is_lanes,
    is_math,
    lanes_in_order,
    m_andnot,
    m_or,
    make,
    math_call,
    merge,
    now,
    scalarise,
    truth,
)

_arith.CALLER_SKIP.add(__file__)

__all__ = ["load", "store", "call", "LoopState", "RetState", "range_iter", "ELEMENTWISE"]

#: Host functions (called from device code on the simulator) known to be element-wise on NumPy arrays: called
#: once with every lane's values as arrays instead of once per lane.  Keyed by ``module.qualname``.
ELEMENTWISE = {"flashnb.common.to_bfloat16", "flashnb.common.from_bfloat16"}

#: ``translate.instance`` (a device function's lane version for this launch), set by :mod:`.translate`
INSTANCE = [None]


# --------------------------------------------------------------------------- indexing


def _plain(obj):
    """A device array reached through a kernel's globals/closure (not an argument): its NumPy array."""
    a = getattr(obj, "_ary", None)
    if a is None:
        item = getattr(obj, "__dict__", {}).get("_item")
        a = getattr(item, "_ary", None)
    return a


def load(obj, idx, m, site):
    t = type(obj)
    if t is _ZeroD:
        if idx == ():
            return V(obj.a, obj.a.dtype.type)
        raise Unsupported("indexing the result of an element-wise host function")
    if t is Arr:
        return arrays.load(obj, idx, m, site)
    if t is Local:
        return arrays.local_load(obj, idx, m, site)
    lanes = is_lanes(idx)
    if not lanes and t is not V and t is not Mixed:
        try:
            return obj[idx]                  # the same object for every lane: Python's (NumPy's) own indexing
        except Exception as exc:
            raise KernelFault(exc, first_lane(m)) from None
    if t is np.ndarray:
        return arrays.const_load(obj, idx, m)
    if t is V:
        if idx == () and obj.k not in (int, float, bool):
            return obj
        raise Unsupported("indexing a per-lane scalar")
    if t is tuple or t is list:
        if not lanes:
            return obj[idx]
        return _seq_gather(obj, idx, m)
    if t is Mixed:
        obj.fail()
    if lanes:
        a = _plain(obj)
        if a is not None:
            return arrays.const_load(a, idx, m)
        raise Unsupported(f"indexing a {t.__name__} with per-lane indices")
    return obj[idx]


def _seq_gather(seq, idx, m):
    if type(idx) is not V or idx.k not in (int, np.int32, np.int64, np.uint32, np.int16, np.uint16, np.int8,
                                            np.uint8, np.uint64):
        raise Unsupported("indexing a tuple or list with a per-lane tuple index")
    kinds = {type(x) for x in seq}
    if len(kinds) != 1 or next(iter(kinds)) not in (int, float, bool, np.float32, np.float64, np.int32, np.int64,
                                                    np.uint32):
        raise Unsupported("indexing a tuple of mixed or non-numeric values per lane")
    from .values import dtype_of

    k = next(iter(kinds))
    table = np.array(seq, dtype=dtype_of(k))
    i = idx.a.astype(np.int64)
    n = len(seq)
    w = np.where(i < 0, i + n, i)
    bad = (w < 0) | (w >= n)
    act = bad if m is None else bad & m
    if act.any():
        lane = first_lane(act)
        raise KernelFault(IndexError(f"{type(seq).__name__} index out of range"), lane)
    w = np.where(bad, 0, w)
    return make(table[w], k) if k is int else V(table[w], k)


def store(obj, idx, value, m, site):
    t = type(obj)
    if t is Arr:
        return arrays.store(obj, idx, value, m, site)
    if t is Local:
        return arrays.local_store(obj, idx, value, m, site)
    if t is np.ndarray:
        if not is_lanes(idx) and not is_lanes(value) and m is None:
            tools.cur.before_write(obj)
            obj[idx] = value
            return
        return arrays.const_store(obj, idx, value, m)
    a = _plain(obj)
    if a is not None:
        return arrays.const_store(a, idx, value, m)
    raise Unsupported(f"an item assignment to a {t.__name__} in a kernel")


# --------------------------------------------------------------------------- calls


def _fake_kernel_class():
    from .._numba_adapter import sim

    FakeCUDAKernel = sim("kernel", "FakeCUDAKernel")
    return FakeCUDAKernel


#: Globals this module's launches rebind or fill (the course grader's integrity check leaves them out).
_RUNTIME_STATE = ("_FakeKernel", "_NUMBA_TYPE_BASE")
_FakeKernel = None
_NUMBA_TYPE_BASE = None


def _is_numba_type(f):
    global _NUMBA_TYPE_BASE
    if _NUMBA_TYPE_BASE is None:
        from numba.core import types as nbt
        _NUMBA_TYPE_BASE = nbt.Type
    return isinstance(f, _NUMBA_TYPE_BASE)


def _b_len(args, m):
    (x,) = args
    if type(x) is V:
        raise Unsupported("len() of a per-lane value")
    if type(x) is Mixed:
        return scalarise(len, args, m)
    return len(x)


def _b_range(args, m):
    if any(is_lanes(a) for a in args):
        raise Unsupported("range() with per-lane bounds outside a for loop")
    return range(*args)


def _b_print(args, m):
    raise Unsupported("print() in a kernel (its output is per thread, in thread order)")


def _b_isinstance(args, m):
    raise Unsupported("isinstance() in a kernel")


_BUILTINS = {
    builtins.max: lambda args, m: b_max(args, m),
    builtins.min: lambda args, m: b_min(args, m),
    builtins.abs: lambda args, m: b_abs(args[0], m) if len(args) == 1 else abs(*args),
    builtins.len: _b_len,
    builtins.range: _b_range,
    builtins.print: _b_print,
}


def call(f, m, site, args, kw=None, used=True):
    """``f(*args, **kw)`` on the active lanes ``m`` (see the module docstring)."""
    tools.cur.site = site
    if getattr(f, "_lanes", False):
        if not used and getattr(f, "_atomic", False):
            return f(m, site, *args, _used=False, **(kw or {}))
        return f(m, site, *args, **(kw or {}))
    global _FakeKernel
    if _FakeKernel is None:
        _FakeKernel = _fake_kernel_class()
    t = type(f)
    if t is _FakeKernel:
        if not f._device:
            raise Unsupported("a kernel launched from a kernel")
        vf = INSTANCE[0](f.fn)
        return vf(m, *args, **(kw or {}))
    if getattr(f, "__module__", None) == "flashnb.sim.tensorcore":
        # a tensor-core instruction's twin: its warp collective over the lanes' vectors (.tensorcore)
        from .tensorcore import twin_of

        vf = twin_of(f)
        if vf is None:
            raise Unsupported(f"{getattr(f, '__name__', f)} of flashnb.sim.tensorcore (no vectorised twin)")
        return vf(m, site, *args, **(kw or {}))
    handler = _BUILTINS.get(f) if _hashable(f) else None
    if handler is not None and not kw:
        return handler(args, m)
    if not kw and len(args) == 1:
        r = cast(f, args[0], m) if (isinstance(f, type) or _is_numba_type(f)) else NotImplemented
        if r is not NotImplemented:
            return r
    if is_math(f) and not kw:
        return math_call(f, args, m)
    lanes = any(is_lanes(a) for a in args) or (kw and any(is_lanes(v) for v in kw.values()))
    if not lanes:
        if f is builtins.print:
            _b_print(args, m)
        try:
            return f(*args, **(kw or {}))
        except (Unsupported, KernelFault):
            raise
        except Exception as exc:
            raise KernelFault(exc, first_lane(m)) from exc
    if isinstance(f, type(call)) and f.__code__.co_flags & 0x20:    # a generator function
        raise Unsupported("a generator function called per lane")
    name = f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', '')}"
    if name in ELEMENTWISE and not kw:
        return _elementwise(f, args, m)
    if _is_numba_type(f):
        raise Unsupported(f"numba type {f} called with these arguments")
    return scalarise(f, args, m, kw)


def _hashable(f):
    try:
        hash(f)
        return True
    except TypeError:
        return False


def _elementwise(f, args, m):
    arrs = []
    for a in args:
        if type(a) is V:
            arrs.append(a.a.astype(a.a.dtype) if a.k not in (int, float, bool) else a.a)
        elif type(a) is Mixed:
            a.fail()
        else:
            arrs.append(a)
    r = f(*arrs)
    if not isinstance(r, np.ndarray) or r.shape != (now.L,):
        raise Unsupported(f"{f.__qualname__} did not return one value per lane")
    return _ZeroD(r)


class _ZeroD(V):
    """Per lane, a 0-d array (what an element-wise NumPy function returns for one scalar): ``x[()]`` is the
    scalar; anything else is not simulated per lane."""

    __slots__ = ()

    def __init__(self, a):
        super().__init__(a, "0d")


def f32_math(outer, inner, args, m, site):
    """``outer(inner(x))``: computed at once when it is ``float32(math.fn(x))`` on per-lane values (see
    :func:`.values.f32_math`), else as the two calls it is."""
    from .values import _FAST_MATH, cast_target
    from .values import f32_math as fm

    x = args[0]
    if (type(x) is V or type(x) is Mixed) and inner in _FAST_MATH and cast_target(outer) is np.float32:
        tools.cur.site = site
        return fm(outer, inner, args, m)
    return call(outer, m, site, (call(inner, m, site, args),))


# --------------------------------------------------------------------------- loops and returns


class RetState:
    """The lanes that returned from the function being run (and, in a kernel, exited the thread)."""

    __slots__ = ("m", "kernel")

    def __init__(self, kernel):
        self.m = False
        self.kernel = kernel

    def ret(self, m):
        self.m = m_or(self.m, m)
        if self.kernel:
            g = tools.cur.geo
            g.any_exit = True
            if m is None:
                g.exited[:] = True
            else:
                g.exited |= m


class LoopState:
    """One loop in progress: its lanes (``m``), those that broke and those that continued this iteration."""

    __slots__ = ("entry", "m", "broken", "cont", "rs")

    def __init__(self, m, rs):
        self.entry = m
        self.m = m
        self.broken = False
        self.cont = False
        self.rs = rs

    def brk(self, m):
        self.broken = m_or(self.broken, m)

    def kontinue(self, m):
        self.cont = m_or(self.cont, m)

    def alive(self):
        """Before an iteration: the loop's lanes minus those that broke out or returned."""
        self.cont = False
        m = self.m
        if self.broken is not False:
            m = m_andnot(m, self.broken)
        if self.rs is not None and self.rs.m is not False:
            m = m_andnot(m, self.rs.m)
        self.m = m
        return m is not False

    def test(self, c):
        """A ``while`` condition: lanes where it is false leave the loop."""
        from .values import m_and

        self.m = m_and(self.m, c)
        return self.m


def restore(sv, rs, ls):
    """The mask after a compound statement that may have disabled lanes (returned, broke, continued)."""
    m = sv
    if rs is not None and rs.m is not False:
        m = m_andnot(m, rs.m)
    if ls is not None:
        if ls.broken is not False:
            m = m_andnot(m, ls.broken)
        if ls.cont is not False:
            m = m_andnot(m, ls.cont)
    return m


def range_iter(ls, simple, args):
    """The iterations of ``for i in range(*args)``: the plain ``range`` when every lane has the same bounds and
    the body cannot disable lanes (``simple``); else a generator that keeps ``ls.m`` to the lanes still in the
    loop and yields their loop value (one per lane when the bounds differ per lane)."""
    if any(type(a) is Mixed for a in args):
        args = tuple(collapse_int(a) for a in args)    # range takes the values (it yields Python ints)
    if not any(type(a) is V for a in args):
        try:
            r = range(*args)
        except Exception as exc:
            raise KernelFault(exc, first_lane(ls.m)) from None
        if simple:
            return r
        return _uniform_iter(ls, r)
    return _lane_range(ls, args)


def _uniform_iter(ls, r):
    for i in r:
        if not ls.alive():
            return
        yield i


def iter_values(ls, simple, it):
    """``for x in it`` (anything but range): the same iterations for every lane."""
    if is_lanes(it):
        raise Unsupported("a for loop over a per-lane value")
    if simple:
        return it
    return _uniform_iter(ls, it)


_INT_KINDS = frozenset((int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))


def _lane_range(ls, args):
    m = ls.m
    for a in args:
        if type(a) is V and a.k not in _INT_KINDS:
            lane = first_lane(m)
            try:
                range(*(x if type(x) is not V else _scalar(x, lane) for x in args))
            except Exception as exc:
                raise KernelFault(exc, lane) from None
            raise Unsupported("range() over per-lane values that are not integers")
    if len(args) == 1:
        start, stop, step = 0, args[0], 1
    elif len(args) == 2:
        start, stop, step = args[0], args[1], 1
    else:
        start, stop, step = args
    L = now.L

    def arr(x):
        if type(x) is V:
            return x.a.astype(np.int64) if x.a.dtype != np.int64 else x.a
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            lane = first_lane(m)
            try:
                range(*(y if type(y) is not V else _scalar(y, lane) for y in args))
            except Exception as exc:
                raise KernelFault(exc, lane) from None
        return np.int64(int(x))

    s0, s1, st = arr(start), arr(stop), arr(step)
    zero = st == 0
    if np.any(zero if m is None or not isinstance(zero, np.ndarray) else (zero & m)):
        lane = first_lane(m if not isinstance(zero, np.ndarray) else (zero if m is None else zero & m))
        raise KernelFault(ValueError("range() arg 3 must not be zero"), lane)
    mm = m if isinstance(m, np.ndarray) else None
    bits = max(_bits(start, mm), _bits(stop, mm), _bits(step, mm)) + 1
    if bits > 62:
        raise Unsupported("range() bounds beyond 62 bits")
    cur = np.broadcast_to(s0, (L,)).astype(np.int64)
    stv = np.broadcast_to(st, (L,))
    s1v = np.broadcast_to(s1, (L,))
    while True:
        inside = np.where(stv > 0, cur < s1v, cur > s1v)
        ls.m = _narrow(ls.m, inside)
        if not ls.alive():
            return
        yield V(cur, int, bits)
        cur = cur + stv


def _bits(x, m=None):
    if type(x) is V:
        if x.k is int:
            return x.bits
        if x.a.dtype.itemsize < 8 or x.a.size == 0:
            return 8 * x.a.dtype.itemsize
        a = x.a if m is None else x.a[m]          # numba's int64 results: the active lanes' values
        if a.size == 0:
            return 0
        return max(abs(int(a.min())).bit_length(), abs(int(a.max())).bit_length())
    return abs(int(x)).bit_length()


def _scalar(x, lane):
    from .values import scalar_at
    return scalar_at(x, lane)


def _narrow(m, inside):
    if m is False:
        return False
    if m is None:
        return None if inside.all() else (inside if inside.any() else False)
    r = m & inside
    return r if r.any() else False


def retval(m, m0, old, new):
    """The function's result so far: ``new`` on the lanes returning now."""
    if m is m0 or old is U:
        return new
    return merge(m, new, old)


def assert_(test, msg, m, site):
    """``assert test, msg`` per lane: AssertionError for the first active lane where ``test`` is false."""
    t = truth(test)
    if type(t) is bool:
        if not t:
            raise KernelFault(AssertionError(*(() if msg is None else (msg,))), first_lane(m))
        return
    bad = ~t if m is None else (m & ~t)
    if bad.any():
        lane = first_lane(bad)
        from .values import scalar_at
        raise KernelFault(AssertionError(*(() if msg is None else (scalar_at(msg, lane),))), lane)


def raise_(exc, cause, m):
    """``raise exc [from cause]`` on the active lanes: the first of them raises it."""
    from .values import scalar_at

    lane = first_lane(m)
    exc = scalar_at(exc, lane)
    if isinstance(exc, type) and issubclass(exc, BaseException):
        exc = exc()
    if not isinstance(exc, BaseException):
        exc = TypeError("exceptions must derive from BaseException")
    if cause is not None:
        exc.__cause__ = scalar_at(cause, lane)
    raise KernelFault(exc, lane)


def raise_call(f, args, cause, m):
    """``raise f(*args)``: the exception the first active lane makes, with its own values."""
    from .values import scalar_at

    lane = first_lane(m)
    try:
        exc = f(*(scalar_at(a, lane) for a in args))
    except Exception as e:
        raise KernelFault(e, lane) from None
    raise_(exc, cause, m)


__all__ += ["restore", "iter_values", "retval", "assert_", "f32_math", "lanes_in_order", "raise_", "raise_call"]
