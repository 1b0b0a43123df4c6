"""Per-lane values and masks of the vectorised simulator, with the threads simulator's scalar semantics.

A kernel variable holds, in the threads simulator, one Python or NumPy scalar per thread.  Here it holds either

* a **uniform** value -- the very object every lane would hold (a Python int, an ``np.float32``, a tuple, an
  array ...): operations on uniform values are plain Python, so they are exact by construction; or
* a :class:`V` -- one value per lane of the chunk, as a 1-D NumPy array ``a`` (never changed in place) and the
  **kind** ``k`` of the scalar each lane holds: ``int``, ``float``, ``bool`` for Python scalars (stored as
  int64, float64, bool) or a NumPy scalar type (``np.float32``, ``np.uint32`` ...).

Every operator on a :class:`V` is computed as :mod:`flashnb.sim.arith` computes it on one thread's scalars
(numba's typing: ``np.int32 * np.int32`` is an ``np.int64``, ``np.float32 * 1.5`` an ``np.float64``; Python
numbers on both sides keep Python's rules, with int64 wrapping).  The result kind of an operation on two kinds is
found once; the operands are then converted to numba's argument types, and one ufunc computes every lane.  Where a
scalar operation can raise (integer division by zero, ``math.log(0)``, a Python int that does not fit an int32,
a float exception the NumPy settings turn into a warning or an error ...), the condition is tested on the
*active* lanes only -- inactive lanes compute garbage that never counts -- and the first active lane (in the
order the threads simulator starts its threads) that would raise re-runs the scalar operation, so the
exception or warning is exactly the threads simulator's.  Python ints are int64 here: each :class:`V` of kind
``int`` carries a bound on its bit length, and an operation that could leave 64 bits is computed exactly per
lane and wrapped to int64, as numba's int64 arithmetic wraps.

Masks: ``None`` is every lane of the chunk, ``False`` none, else a bool array.
"""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np

from .. import arith
from ..fallback import KernelFault, Unsupported

arith.CALLER_SKIP.add(__file__)

__all__ = ["V", "Mixed", "Partial", "U", "KINDS", "dtype_of", "lift", "scalar_at", "first_lane", "truth",
           "split", "m_and", "m_andnot", "m_or", "merge", "select", "binop", "compare", "cast"]

# --------------------------------------------------------------------------- kinds

_NP_KINDS = (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
             np.uint32, np.uint64, np.bool_)
KINDS = frozenset((int, float, bool) + _NP_KINDS)
_PY_DTYPE = {int: np.dtype(np.int64), float: np.dtype(np.float64), bool: np.dtype(np.bool_)}
_FLOAT_KINDS = frozenset((np.float16, np.float32, np.float64))
_NP_INT_KINDS = frozenset((np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))


def dtype_of(kind) -> np.dtype:
    """The dtype lanes of ``kind`` are stored in."""
    d = _PY_DTYPE.get(kind)
    return d if d is not None else np.dtype(kind)


def _sample(kind):
    if kind is int:
        return 3
    if kind is float:
        return 1.5
    if kind is bool:
        return True
    return kind(3) if kind is not np.bool_ else np.True_


def kind_of(x):
    """The kind of a uniform value (its type when that is a kind, else None)."""
    t = type(x)
    return t if t in KINDS else None


# --------------------------------------------------------------------------- the chunk being run

class _Now:
    """What the helpers need from the chunk in progress (set by the launch): lane count, start order."""

    L = 0
    rank = None          # None when lane order is the threads simulator's start order, else rank per lane
    lane_name = None     # lane -> (threadIdx, blockIdx) for messages
    user_err = None      # np.geterr() of the caller (float exceptions are reported by these rules)
    generated = set()    # code objects of translated functions (to find the kernel line of a warning)


now = _Now()


def first_lane(m) -> int:
    """The active lane the threads simulator would run first (its thread starts first)."""
    if m is None:
        return 0 if now.rank is None else int(np.argmin(now.rank))
    if now.rank is None:
        return int(np.argmax(m))
    idx = np.flatnonzero(m)
    return int(idx[np.argmin(now.rank[idx])])


def lanes_in_order(m) -> np.ndarray:
    """The active lanes in the threads simulator's start order."""
    idx = np.arange(now.L) if m is None else np.flatnonzero(m)
    if now.rank is not None:
        idx = idx[np.argsort(now.rank[idx], kind="stable")]
    return idx


# --------------------------------------------------------------------------- per-lane values


class V:
    """One value per lane: ``a`` (1-D array over the chunk's lanes, never modified), ``k`` (the kind of each
    lane's scalar), ``bits`` (kind ``int`` only: every lane's ``|value| < 2**bits``), ``ix`` (filled by the
    first array access indexed by it: its lanes as int64, their largest value read as unsigned, and the last
    stride-scaled copy; ``a`` never changes, so one index reused over a loop is checked once)."""

    __slots__ = ("a", "k", "bits", "ix")

    def __init__(self, a, k, bits=None):
        self.a = a
        self.k = k
        self.bits = bits
        self.ix = None

    def __bool__(self):
        raise Unsupported("a per-lane value used where Python needs one value (truth value)")

    def __index__(self):
        raise Unsupported("a per-lane value used where Python needs one integer")

    def __iter__(self):
        raise Unsupported("a per-lane value unpacked or iterated")

    def __len__(self):
        raise Unsupported("len() of a per-lane value")

    def __float__(self):
        raise Unsupported("a per-lane value converted by a function that is not simulated per lane")

    __int__ = __float__

    def __hash__(self):
        return id(self)

    def __repr__(self):
        name = self.k.__name__
        return f"<lanes {name} {self.a[:8]!r}{'...' if self.a.size > 8 else ''}>"


class Mixed:
    """Lanes whose scalars are of different types (e.g. ``min(n, k // 2 + 1)`` is a Python int on some lanes and an
    int32 on others): ``parts`` is a list of ``(kind, value, lanes)`` -- the lanes (a bool array, None for all) whose
    scalar is ``value``'s (a :class:`V` or a uniform scalar of that kind).  Every operation runs once per part,
    each on its own lanes, as the threads simulator runs each lane with its own types.  Parts whose values are not
    numbers (tuples, arrays, None ...) cannot be combined: using them is unsupported."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = parts

    @property
    def kinds(self):
        return {k for k, _, _ in self.parts}

    def usable(self):
        return all(k in KINDS for k, _, _ in self.parts)

    def fail(self):
        names = ", ".join(sorted(getattr(k, "__name__", str(k)) for k in self.kinds))
        raise Unsupported(f"values of different types in different lanes ({names})")

    @property
    def truth(self):
        if not self.usable():
            return None
        out = np.zeros(now.L, bool)
        for _, v, pm in self.parts:
            t = truth(v)
            if pm is None:
                out[...] = t
            elif type(t) is bool:
                out[pm] = t
            else:
                out[pm] = t[pm]
        return out

    def __bool__(self):
        self.fail()

    def __repr__(self):
        return f"<mixed {[getattr(k, '__name__', k) for k in self.kinds]}>"


def _parts(x):
    t = type(x)
    if t is Mixed:
        return x.parts
    if t is V:
        return [(x.k, x, None)]
    return [(t, x, None)]


def _mand(a, b):
    """The intersection of two lane masks (None: all lanes; False: none)."""
    if a is False or b is False:
        return False
    if a is None:
        return b
    if b is None:
        return a
    r = a & b
    return r if r.any() else False


def _combine(parts):
    """One value from ``(kind, value, lanes)`` parts (a :class:`V` when they are all of one kind)."""
    flat = []
    for k, v, pm in parts:
        if pm is False:
            continue
        if k is None and type(v) is not Mixed:
            k = v.k if type(v) is V else type(v)
        if type(v) is Mixed:
            for k2, v2, pm2 in v.parts:
                mm = _mand(pm2, pm)
                if mm is not False:
                    flat.append((k2, v2, mm))
        else:
            flat.append((k, v, pm))
    if not flat:
        return parts[0][1] if parts else None
    by_kind: dict = {}
    order = []
    for k, v, pm in flat:
        if k not in by_kind:
            by_kind[k] = (v, pm)
            order.append(k)
            continue
        v0, pm0 = by_kind[k]
        if pm is None:
            by_kind[k] = (v, None)
        elif pm0 is None:
            by_kind[k] = (merge(pm, v, v0), None)
        else:
            by_kind[k] = (merge(pm, v, v0) if k in KINDS else v, pm0 | pm)
    if len(order) == 1:
        return by_kind[order[0]][0]
    return Mixed([(k, by_kind[k][0], by_kind[k][1]) for k in order])


def _mixed2(fn, a, b, m):
    """``fn(a, b, mask)`` per pair of parts of two operands (either may be :class:`Mixed`)."""
    out = []
    for ka, va, ma in _parts(a):
        for kb, vb, mb in _parts(b):
            mm = _mand(_mand(m, ma), mb)
            if mm is False:
                continue
            r = fn(va, vb, mm)
            out.append((r.k if type(r) is V else type(r), r, _mand(ma, mb)))
    if not out:
        return fn(_parts(a)[0][1], _parts(b)[0][1], m)
    return _combine(out)


def _mixed1(fn, x, m):
    out = []
    for k, v, pm in _parts(x):
        mm = _mand(m, pm)
        if mm is False:
            continue
        r = fn(v, mm)
        out.append((r.k if type(r) is V else type(r), r, pm))
    if not out:
        return fn(_parts(x)[0][1], m)
    return _combine(out)


_INT_KINDS_ALL = frozenset((int, bool, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                            np.uint64, np.bool_))


def collapse_int(x):
    """A :class:`Mixed` of integer kinds as one Python-int :class:`V` (where only the values matter: indices,
    range bounds, lane operands)."""
    if type(x) is not Mixed:
        return x
    if not x.kinds <= _INT_KINDS_ALL:
        x.fail()
    for k, v, pm in x.parts:                # uint64 lanes (numba's uint32 + uint32) that an int64 holds
        if k is np.uint64:
            va = v.a if type(v) is V else np.array([v], np.uint64)
            if (va if pm is None or type(v) is not V else va[pm]).max(initial=0) >= np.uint64(1 << 63):
                x.fail()
    a = np.zeros(now.L, np.int64)
    bits = 0
    for k, v, pm in x.parts:
        va = v.a.astype(np.int64) if type(v) is V else np.int64(int(v))
        if type(v) is V:
            b = v.bits if v.k is int else (1 if v.k in (bool, np.bool_) else 8 * v.a.dtype.itemsize)
            if b == 64 and v.k is not int:      # numba's int64 results: the bits their lanes hold
                b = _int_bits_of_array(v.a if pm is None else v.a[pm])
        else:
            b = abs(int(v)).bit_length()
        bits = max(bits, b)
        if pm is None:
            a[...] = va
        else:
            a[pm] = va[pm] if type(va) is np.ndarray else va
    return V(a, int, min(bits, 64))


class _Undefined:
    """A local variable no lane has assigned yet (loads are checked where it may be unassigned)."""

    __slots__ = ()

    def __repr__(self):
        return "<unassigned>"


U = _Undefined()


class Partial:
    """A local variable assigned on the lanes of ``defined`` only (``value`` elsewhere is garbage)."""

    __slots__ = ("value", "defined")

    def __init__(self, value, defined):
        self.value = value
        self.defined = defined


def _int_bits_of_array(a) -> int:
    if a.size == 0:
        return 0
    hi = int(a.max())
    lo = int(a.min())
    return max(abs(hi).bit_length(), abs(lo).bit_length())


def lift(x, kind=None):
    """``x`` (a uniform scalar) as a :class:`V` over every lane."""
    if type(x) is V:
        return x
    k = type(x) if kind is None else kind
    a = np.full(now.L, x, dtype=dtype_of(k))
    return V(a, k, abs(int(x)).bit_length() if k is int else None)


def make(a, k):
    """A :class:`V` of kind ``k`` from array ``a`` (the bit bound of an int computed from the values)."""
    return V(a, k, _int_bits_of_array(a) if k is int else None)


def scalar_at(x, lane):
    """The scalar lane ``lane`` holds (exactly the object the threads simulator would have: its type too)."""
    if type(x) is V:
        k = x.k
        v = x.a[lane]
        if k is int:
            return int(v)
        if k is float:
            return float(v)
        if k is bool:
            return bool(v)
        return v
    if type(x) is tuple:
        return tuple(scalar_at(e, lane) for e in x)
    if type(x) is Mixed:
        for _, v, pm in x.parts:
            if pm is None or pm[lane]:
                return scalar_at(v, lane)
        return scalar_at(x.parts[0][1], lane)
    if type(x) is Partial:
        return scalar_at(x.value, lane)
    return x


def is_lanes(x) -> bool:
    t = type(x)
    if t is V or t is Mixed:
        return True
    if t is tuple:
        return any(is_lanes(e) for e in x)
    return False


# --------------------------------------------------------------------------- masks


def truth(x):
    """Per-lane truth of ``x`` as a bool array, or Python's truth of a uniform ``x``."""
    t = type(x)
    if t is V:
        k = x.k
        if k is bool or k is np.bool_:
            return x.a
        return x.a != 0          # NaN is truthy, as in Python
    if t is Mixed:
        tr = x.truth
        if tr is None:
            x.fail()
        return tr
    return bool(x)


def split(c, m):
    """``(mask where c holds, mask where it does not)`` within ``m``: one of them is ``m`` itself and the other
    ``False`` when ``c`` is uniform."""
    t = truth(c)
    if type(t) is bool:
        return (m, False) if t else (False, m)
    if m is None:
        if t.all():
            return None, False
        if not t.any():
            return False, None
        return t, ~t
    mt = m & t
    if not mt.any():
        return False, m
    mf = m & ~t
    if not mf.any():
        return m, False
    return mt, mf


def m_and(m, c):
    """The lanes of ``m`` where ``c`` holds (``m`` itself when ``c`` is uniformly true)."""
    t = truth(c)
    if type(t) is bool:
        return m if t else False
    if m is None:
        return None if t.all() else (t.copy() if t.any() else False)
    r = m & t
    if r.all() == m.all() and np.array_equal(r, m):
        return m
    return r if r.any() else False


def m_andnot(m, d):
    """``m`` without the lanes of ``d`` (``m`` itself when ``d`` is ``False``)."""
    if d is False or m is False:
        return m
    if d is None:
        return False
    if m is None:
        r = ~d
    else:
        r = m & ~d
    return r if r.any() else False


def m_or(a, b):
    if a is False:
        return b
    if b is False:
        return a
    if a is None or b is None:
        return None
    r = a | b
    return None if r.all() else r


def m_count(m) -> int:
    if m is None:
        return now.L
    if m is False:
        return 0
    return int(np.count_nonzero(m))


# --------------------------------------------------------------------------- merging after a masked region


def _arr(x, k):
    """The array of ``x`` (a V or a uniform scalar of kind ``k``)."""
    return x.a if type(x) is V else x


def merge(m, new, old):
    """Per lane: ``new`` on the lanes of ``m``, ``old`` elsewhere (an assignment inside a masked region)."""
    if m is None or new is old:
        return new
    to = type(old)
    if to is _Undefined:
        return Partial(new, m)
    if to is Partial:
        defined = m | old.defined
        value = merge(m, new, old.value)
        return value if defined.all() else Partial(value, defined)
    tn = type(new)
    if tn is tuple and to is tuple and len(new) == len(old):
        return tuple(merge(m, a, b) for a, b in zip(new, old))
    if tn is Mixed or to is Mixed:
        return _combine([(None, new, m), (None, old, ~m)])
    kn = new.k if tn is V else tn
    ko = old.k if to is V else to
    if kn is not ko or kn not in KINDS:
        if tn is not V and to is not V and tn is to and kn not in KINDS:
            try:
                if new is old or (not isinstance(new, np.ndarray) and new == old):
                    return new
            except Exception:
                pass
        return Mixed([(kn, new, m), (ko, old, ~m)])
    a = np.where(m, _arr(new, kn), _arr(old, ko))
    if a.dtype != dtype_of(kn):
        a = a.astype(dtype_of(kn))
    if kn is int:
        bn = new.bits if tn is V else abs(new).bit_length()
        bo = old.bits if to is V else abs(old).bit_length()
        return V(a, kn, max(bn, bo))
    return V(a, kn)


def select(mt, mf, x, y):
    """The value of ``x if c else y`` whose branches ran on ``mt`` and ``mf``."""
    if mf is False:
        return x
    if mt is False:
        return y
    return merge(mt, x, y)


def check_defined(x, m, name):
    """A load of a variable that may be unassigned on some lanes: Python's UnboundLocalError if an active
    lane has not assigned it."""
    t = type(x)
    if t is _Undefined:
        raise UnboundLocalError(f"cannot access local variable '{name}' where it is not associated with a value")
    if t is Partial:
        missing = ~x.defined if m is None else (m & ~x.defined)
        if missing.any():
            raise KernelFault(UnboundLocalError(
                f"cannot access local variable '{name}' where it is not associated with a value"),
                first_lane(missing))
        return x.value
    return x


def settled(x):
    """A load of a variable the analysis proves assigned on every lane that runs it: the value of a
    :class:`Partial` (the lanes it does not cover are not running this load)."""
    return x.value if type(x) is Partial else x


# --------------------------------------------------------------------------- float exceptions

_FPE = [False]


def _fp_callback(kind, flag):
    _FPE[0] = True


def fp_settings(user: dict) -> dict:
    """The NumPy error settings a launch runs under: ``'call'`` (:func:`_fp_callback` marks it) for every
    category the caller's settings do not ignore, so only real exceptions cost anything."""
    return {cat: ("ignore" if user.get(cat, "ignore") == "ignore" else "call")
            for cat in ("divide", "over", "under", "invalid")}


def _kernel_frame():
    f = sys._getframe(2)
    while f is not None and f.f_code not in now.generated:
        f = f.f_back
    return f


def _replay_fp(lanes, run_one):
    """Re-run the scalar operation of each lane in ``lanes`` (start order) under the caller's error settings:
    a warning is re-issued at the kernel's line (as the threads simulator issues it from the kernel's frame;
    one issued from Python code the operation calls, e.g. numba's ``uint32(x)``, stays where it was issued),
    an error (``np.seterr(...='raise')``) is the kernel's."""
    frame = _kernel_frame()
    for lane in lanes:
        lane = int(lane)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with np.errstate(**now.user_err):
                    run_one(lane)
            except FloatingPointError as exc:
                raise KernelFault(exc, lane) from None
            except Exception:
                pass
        for w in caught:
            if w.filename != __file__:
                modname = _module_of_file(w.filename)
                module = sys.modules.get(modname)
                registry = vars(module).setdefault("__warningregistry__", {}) if module is not None else None
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, module=modname,
                                       registry=registry)
                continue
            if frame is None:
                warnings.warn(w.message, w.category, stacklevel=3)
                continue
            g = frame.f_globals
            modname = g.get("__name__", "kernel")
            module = sys.modules.get(modname)
            registry = vars(module).setdefault("__warningregistry__", {}) if module is not None else None
            warnings.warn_explicit(w.message, w.category, frame.f_code.co_filename, frame.f_lineno,
                                   module=modname, registry=registry)


_MODULE_OF_FILE: dict = {}


def _module_of_file(filename):
    """The name of the loaded module whose source is ``filename`` (the warning registry a warning issued there
    uses), or None."""
    name = _MODULE_OF_FILE.get(filename, 0)
    if name == 0:
        name = next((n for n, mod in list(sys.modules.items()) if getattr(mod, "__file__", None) == filename), None)
        _MODULE_OF_FILE[filename] = name
    return name


def _fp_check_binop(fn, a, b, r, m):
    """After a NumPy-float (or NumPy-integer division) operation that raised a float flag on some lane."""
    _FPE[0] = False
    ra = r
    with np.errstate(all="ignore"):
        bad = ~np.isfinite(ra) if ra.dtype.kind == "f" else np.zeros(ra.shape, bool)
        if ra.dtype.kind in "iu":          # integer division / modulo by zero
            bb = b.a if type(b) is V else b
            bad = np.broadcast_to(bb == 0, ra.shape)
        else:
            for x in (a, b):
                xa = x.a if type(x) is V else x
                if isinstance(xa, np.ndarray) and xa.dtype.kind == "f":
                    bad = bad & ~(np.isnan(xa) & np.isnan(ra)) & ~(np.isinf(xa) & np.isinf(ra))
                elif isinstance(xa, (float, np.floating)) and not math.isfinite(float(xa)):
                    bad = bad & ~np.isnan(ra) if math.isnan(float(xa)) else bad & ~np.isinf(ra)
    if m is not None:
        bad = bad & m
    if not bad.any():
        return
    _replay_fp(lanes_in_order(bad), lambda lane: fn(scalar_at(a, lane), scalar_at(b, lane)))


def _fp_check_unary(fn, x, r, m):
    _FPE[0] = False
    with np.errstate(all="ignore"):
        xa = x.a
        if r.dtype.kind == "f":
            bad = ~np.isfinite(r)
            if xa.dtype.kind == "f":
                bad &= np.isfinite(xa)
        elif xa.dtype.kind == "f":
            bad = ~np.isfinite(xa)      # NaN / inf cast to an integer: 'invalid'
        else:
            return
    if m is not None:
        bad = bad & m
    if bad.any():
        _replay_fp(lanes_in_order(bad), lambda lane: fn(scalar_at(x, lane)))


# --------------------------------------------------------------------------- the slow exact path


def scalarise(fn, args, m, kwargs=None):
    """``fn`` called once per active lane with that lane's scalars, in start order (exact: the same calls the
    threads simulator makes); the results assembled per lane."""
    lanes = lanes_in_order(m)
    results = []
    for lane in lanes:
        lane = int(lane)
        try:
            results.append(fn(*(scalar_at(a, lane) for a in args),
                              **({k: scalar_at(v, lane) for k, v in kwargs.items()} if kwargs else {})))
        except Unsupported:
            raise
        except Exception as exc:
            raise KernelFault(exc, lane) from exc
    return assemble(results, lanes)


def assemble(results, lanes):
    """Per-lane results (one per lane of ``lanes``) as a value over every lane."""
    if not results:
        return None
    first = results[0]
    if type(first) is tuple and all(type(r) is tuple and len(r) == len(first) for r in results):
        return tuple(assemble([r[i] for r in results], lanes) for i in range(len(first)))
    kinds = {type(r) for r in results}
    if len(kinds) > 1 and kinds <= KINDS:
        types_ = [type(r) for r in results]
        parts = []
        for k in dict.fromkeys(types_):
            sel = [i for i, t in enumerate(types_) if t is k]
            pm = np.zeros(now.L, bool)
            pm[lanes[sel]] = True
            parts.append((k, assemble([results[i] for i in sel], lanes[sel]), pm))
        return Mixed(parts)
    if len(kinds) == 1:
        k = type(first)
        if k not in KINDS:
            if all(r is first for r in results):
                return first
            raise Unsupported(f"a function called per lane returned {k.__name__} values")
        dt = dtype_of(k)
        a = np.empty(now.L, dt)
        if k is int and any(not -(1 << 63) < r < (1 << 63) for r in results):
            raise Unsupported("a Python int over 64 bits")
        a[...] = np.asarray(first, dtype=dt)
        a[lanes] = np.asarray(results, dtype=dt)
        return make(a, k)
    raise Unsupported("a function called per lane returned values of different types, not all numbers")


# --------------------------------------------------------------------------- binary operations

_PYFLOAT_EXACT_INT = 53


class _Op:
    __slots__ = ("name", "fn", "ufunc", "plans", "compare", "div", "shift")

    def __init__(self, name, fn, ufunc, compare=False, div=False, shift=False):
        self.name = name
        self.fn = fn
        self.ufunc = ufunc
        self.plans = {}
        self.compare = compare
        self.div = div
        self.shift = shift


def _int_bits(x, k):
    if type(x) is V:
        return x.bits if x.bits is not None else 1     # a bool
    return abs(int(x)).bit_length()


def _bits_after(op, ba, bb, b):
    n = op.name
    if n in ("add", "sub", "and", "or", "xor"):
        return max(ba, bb) + 1
    if n == "mul":
        return ba + bb
    if n in ("floordiv", "mod"):
        return max(ba, bb) + 1
    if n == "rshift":
        return ba
    if n == "lshift":
        if type(b) is V:
            return ba + int(b.a.max()) if b.a.size else ba
        return ba + int(b)
    return 64


def _check_int_range(a, dt, m, k_weak):
    """A Python int converted to NumPy integer dtype ``dt``: NumPy's OverflowError if an active lane's value
    does not fit."""
    if a.dtype.kind == "b":
        return                  # bools fit every integer type (and NumPy cannot compare them with 2**64 - 1)
    info = np.iinfo(dt)
    bad = (a < info.min) | (a > info.max)
    if m is not None:
        bad &= m
    if bad.any():
        lane = first_lane(bad)
        raise KernelFault(OverflowError(f"Python integer {int(a[lane])} out of bounds for {np.dtype(dt).name}"), lane)


def _scalar_plan(op):
    def plan(a, b, m):
        return scalarise(op.fn, (a, b), m)
    return plan


def _pyint_pow_plan(op):
    """``a ** b`` with Python ints (or bools) on both sides: per lane (an int64, wrapped as numba's, or a float
    for a negative ``b``)."""
    def plan(a, b, m):
        return scalarise(op.fn, (a, b), m)
    return plan


_CONV: dict = {}        # a uniform integer converted to a numba argument type: (type name, its type, it) -> scalar


def _nb_plan(op, ka, kb):
    """``a op b`` with a NumPy number on at least one side, as :mod:`flashnb.sim.arith` computes it per lane: the
    operands converted to numba's argument types, one ufunc in those types, numba's result type."""
    na, nb = arith.name_of(ka), arith.name_of(kb)
    sig = arith.lookup(op.name, na, nb)
    if sig is None or op.name == "pow":
        return _scalar_plan(op)            # per lane: numba's TypeError, or ``**`` (rare) exactly as one lane
    a1, a2, r = sig
    d1, d2, dr = np.dtype(arith.NP_TYPES[a1]), np.dtype(arith.NP_TYPES[a2]), np.dtype(arith.NP_TYPES[r])
    rk = arith.NP_TYPES[r]
    ufunc = op.ufunc
    # the scalar operation a lane re-runs to raise its float warning: Python's operator where the threads
    # simulator runs it in the kernel's frame (arith.FAST), else arith's (whose warnings name arith.py)
    fn = arith._FN[op.name] if arith.fast(op.name, ka, kb) else op.fn
    compare = op.compare
    is_float = dr.kind == "f"
    int_div = op.div and dr.kind in "iu"
    shift = op.shift
    if ka is kb and ka is arith.NP_TYPES[a1] and a1 == a2 and (compare or (is_float and r == a1)):
        # NumPy numbers of one type that numba keeps (float32 * float32, int32 < int32): one ufunc as it is
        fast_fn = fn

        def same(a, b, m):
            res = ufunc(a.a if type(a) is V else a, b.a if type(b) is V else b)
            if _FPE[0]:
                if is_float:
                    _fp_check_binop(fast_fn, a, b, res, m)
                else:
                    _FPE[0] = False
            return V(res, rk)
        return same
    bits = dr.itemsize * 8

    def conv(x, k, name, dt):
        if type(x) is V:
            xa = x.a
            return xa if xa.dtype == dt else xa.astype(dt)
        tx = type(x)
        if tx is not int and tx not in _NP_INT_KINDS:      # floats: -0.0 == 0.0, NaN != NaN (no cache)
            return arith.NP_TYPES[name](x) if name == "bool" else arith._to(x, name)
        key = (name, tx, x)
        got = _CONV.get(key)
        if got is None:
            got = arith.NP_TYPES[name](x) if name == "bool" else arith._to(x, name)
            if len(_CONV) > 4096:
                _CONV.clear()
            _CONV[key] = got
        return got

    if not shift and not int_div and not compare and not is_float and dr.kind in "iu" and ka is not int \
            and kb is not int:
        # NumPy integers on both sides (uint32 + uint32 is a uint64): both in the result type, one ufunc
        def iarith(a, b, m):
            if type(a) is V:
                xa = a.a
                if xa.dtype != dr:
                    xa = xa.astype(dr)
            else:
                xa = conv(a, ka, r, dr)
            if type(b) is V:
                xb = b.a
                if xb.dtype != dr:
                    xb = xb.astype(dr)
            else:
                xb = conv(b, kb, r, dr)
            res = ufunc(xa, xb)
            _FPE[0] = False
            return V(res, rk)
        return iarith

    def plan(a, b, m):
        for x, k in ((a, ka), (b, kb)):
            if k is int and type(x) is int and not -(1 << 63) <= x < (1 << 63):
                return scalarise(fn, (a, b), m)          # a uniform Python int only a uint64 holds
        if shift:
            xb = conv(b, kb, a2, d2)
            cnt = xb.astype(np.int64) if type(xb) is np.ndarray and xb.dtype != np.uint64 else xb
            bad = (cnt < 0) | (cnt >= bits) if type(xb) is np.ndarray and xb.dtype != np.uint64 else (
                (xb >= bits) if type(xb) is np.ndarray else not 0 <= int(xb) < bits)
            if type(bad) is np.ndarray:
                if m is not None:
                    bad = bad & m
                if bad.any():
                    lane = first_lane(bad)
                    raise KernelFault(arith.shift_error(arith._to_int(scalar_at(b, lane), a2), r), lane)
            elif bad:
                lane = first_lane(m)
                raise KernelFault(arith.shift_error(arith._to_int(scalar_at(b, lane), a2), r), lane)
            xa = conv(a, ka, r, dr)
            xb = xb.astype(dr) if type(xb) is np.ndarray else dr.type(int(xb))
            res = ufunc(xa, xb)
            _FPE[0] = False
            return V(res if type(res) is np.ndarray else np.full(now.L, res), rk)
        if int_div:
            xa = conv(a, ka, r, dr)
            xb = conv(b, kb, r, dr)
            z = xb == 0
            if type(z) is np.ndarray:
                if m is not None:
                    z = z & m
                if z.any():
                    raise KernelFault(ZeroDivisionError(arith.ZERO_DIV), first_lane(z))
            elif z:
                raise KernelFault(ZeroDivisionError(arith.ZERO_DIV), first_lane(m))
            res = ufunc(xa, xb)
            _FPE[0] = False
            return V(res if type(res) is np.ndarray else np.full(now.L, res), rk)
        if compare or is_float or dr.kind == "b":
            xa = conv(a, ka, a1, d1)
            xb = conv(b, kb, a2, d2)
        else:                               # integer arithmetic: wraps in the result type
            xa = conv(a, ka, r, dr)
            xb = conv(b, kb, r, dr)
        res = ufunc(xa, xb)
        if type(res) is not np.ndarray:
            res = np.full(now.L, res)
        if compare:
            return V(res, np.bool_)
        if is_float:
            if _FPE[0]:
                _fp_check_binop(fn, a, b, res, m)
            if res.dtype != dr:
                res = res.astype(dr)
            return V(res, rk)
        _FPE[0] = False
        if res.dtype != dr:
            res = res.astype(dr)
        return V(res, rk)

    return plan


def _build_plan(op, ka, kb):
    if ka not in _PY_DTYPE or kb not in _PY_DTYPE:
        return _nb_plan(op, ka, kb)
    sa, sb = _sample(ka), _sample(kb)
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = op.fn(sa, sb)
    except Exception:
        return _scalar_plan(op)          # the scalar op raises: every lane re-runs it (the first raises)
    rk = type(r)
    if op.name == "pow" and ka in (int, bool) and kb in (int, bool):
        return _pyint_pow_plan(op)
    if rk not in KINDS or op.name == "pow":
        return _scalar_plan(op)
    ufunc = op.ufunc
    pa, pb = ka in _PY_DTYPE, kb in _PY_DTYPE
    rdt = dtype_of(rk)

    # the dtype each operand is converted to before the ufunc (None: as it is)
    conv_a = conv_b = None
    int_cmp = False
    if pa and pb:
        if op.compare:
            if ka is float or kb is float:
                conv_a = conv_b = np.dtype(np.float64)
            else:
                conv_a = conv_b = np.dtype(np.int64)
        else:
            conv_a = conv_b = rdt
    elif pa or pb:
        strong = np.dtype(kb if pa else ka)
        weak_sample = sa if pa else sb
        opdt = np.result_type(strong, weak_sample)
        weak_kind = ka if pa else kb
        if op.compare and weak_kind in (int, bool) and strong.kind in "iub":
            int_cmp = True
            if strong == np.uint64:
                return _scalar_plan(op)
            conv_a = conv_b = np.dtype(np.int64)
        elif op.name == "truediv" and weak_kind in (int, bool) and strong.kind in "iub":
            # a NumPy integer and a Python int: NumPy's scalar division converts both to float64 (an int out of
            # the integer type's range too: no OverflowError, unlike + or //)
            conv_a = conv_b = np.dtype(np.float64)
        elif pa:
            conv_a = opdt
        else:
            conv_b = opdt
    is_div = op.div
    py_result = rk in _PY_DTYPE
    check_fp = (rk in _FLOAT_KINDS) or (is_div and rk in _NP_INT_KINDS)
    if not pa and not pb:
        # NumPy scalars on both sides: NumPy computes arrays exactly as it computes the scalars (NEP 50)
        with np.errstate(all="ignore"):
            probe = ufunc(np.full(2, sa), np.full(2, sb))
        if probe.dtype == rdt:
            return _np_plan(op, ufunc, rk, check_fp)
    if pa and pb and rk is int and not is_div and not op.shift and op.name in ("add", "sub", "mul", "and", "or",
                                                                               "xor"):
        return _pyint_plan(op, ufunc)
    py_zero_div = is_div and (pa and pb)
    int_result = rk is int
    shift_py = op.shift and pa and pb
    float_vs_int = op.compare and pa and pb and (ka is float) != (kb is float)

    def plan(a, b, m):
        xa = a.a if type(a) is V else a
        xb = b.a if type(b) is V else b
        if float_vs_int:
            ib = a if ka is not float else b
            if _int_bits(ib, int) > _PYFLOAT_EXACT_INT:
                return scalarise(op.fn, (a, b), m)
        if conv_a is not None and type(a) is V:
            if conv_a.kind in "iu" and ka in (int, bool) and not int_cmp and conv_a != np.int64:
                _check_int_range(xa, conv_a, m, ka)
            if xa.dtype != conv_a:
                xa = xa.astype(conv_a)
        elif conv_a is not None and pb is False and pa and not int_cmp:
            pass   # a uniform Python scalar: NumPy converts it weakly itself
        if conv_b is not None and type(b) is V:
            if conv_b.kind in "iu" and kb in (int, bool) and not int_cmp and conv_b != np.int64:
                _check_int_range(xb, conv_b, m, kb)
            if xb.dtype != conv_b:
                xb = xb.astype(conv_b)
        if int_cmp:
            if type(a) is not V:
                xa = int(a)
            if type(b) is not V:
                xb = int(b)
            if type(a) is V and xa.dtype != np.int64:
                xa = xa.astype(np.int64)
            if type(b) is V and xb.dtype != np.int64:
                xb = xb.astype(np.int64)
        elif pa and pb and type(a) is not V and ka is bool and conv_a is not None and conv_a.kind != "b":
            xa = int(a)
        elif pa and pb and type(b) is not V and kb is bool and conv_b is not None and conv_b.kind != "b":
            xb = int(b)
        if py_zero_div:
            z = (xb == 0)
            if m is not None and type(z) is np.ndarray:
                z = z & m
            if np.any(z):
                lane = first_lane(z) if type(z) is np.ndarray else first_lane(m)
                try:
                    op.fn(scalar_at(a, lane), scalar_at(b, lane))
                except Exception as exc:
                    raise KernelFault(exc, lane) from None
        if shift_py:
            neg = (xb < 0) | (xb >= 64)
            if m is not None and type(neg) is np.ndarray:
                neg = neg & m
            if np.any(neg):
                lane = first_lane(neg) if type(neg) is np.ndarray else first_lane(m)
                raise KernelFault(arith.shift_error(int(scalar_at(b, lane)), "int64"), lane)
        if int_result:
            bits = _bits_after(op, _int_bits(a, int), _int_bits(b, int), b)
            if bits > 62:
                return _exact_int(op, a, b, m)
        r = ufunc(xa, xb)
        if check_fp and _FPE[0]:
            _fp_check_binop(op.fn, a, b, r, m)
        elif py_result:
            _FPE[0] = False
        if type(r) is not np.ndarray:        # both operands were uniform arrays of size 1? (never in practice)
            r = np.full(now.L, r)
        if r.dtype != rdt:
            if op.compare or r.dtype.kind == rdt.kind:
                r = r.astype(rdt)
            else:
                return scalarise(op.fn, (a, b), m)
        return V(r, rk, bits if int_result else None)

    return plan


def _np_plan(op, ufunc, rk, check_fp):
    fn = op.fn

    def plan(a, b, m):
        r = ufunc(a.a if type(a) is V else a, b.a if type(b) is V else b)
        if _FPE[0] and check_fp:
            _fp_check_binop(fn, a, b, r, m)
        return V(r, rk)
    return plan


def _pyint_plan(op, ufunc):
    """Python ints on both sides (int64 lanes): exact while the bit bounds say the result fits."""
    name = op.name

    def plan(a, b, m):
        ta, tb = type(a), type(b)
        ba = (a.bits if a.bits is not None else 1) if ta is V else abs(a).bit_length()
        bb = (b.bits if b.bits is not None else 1) if tb is V else abs(b).bit_length()
        bits = ba + bb if name == "mul" else max(ba, bb) + 1
        if bits > 62:
            return _exact_int(op, a, b, m)
        xa = a.a if ta is V else a
        xb = b.a if tb is V else b
        if ta is V and a.k is bool:
            xa = xa.astype(np.int64)
        if tb is V and b.k is bool:
            xb = xb.astype(np.int64)
        return V(ufunc(xa, xb), int, bits)
    return plan


def _exact_int(op, a, b, m):
    """A Python-int operation that might leave int64: computed exactly per active lane."""
    res = scalarise(op.fn, (a, b), m)
    if type(res) is V and res.k is int:
        return res
    return res


_INT64_LO, _INT64_HI = -(1 << 63), (1 << 63) - 1


def _make_binop(op):
    plans = op.plans
    fn = op.fn
    # uniform Python ints: Python's operator, then numba's int64 wrap (the common loop-index arithmetic)
    pyint = arith._FN[op.name] if op.name in ("add", "sub", "mul", "and", "or", "xor", "floordiv", "mod") else None
    fast = arith.FAST[op.name]

    def binop(a, b, m):
        ta = type(a)
        tb = type(b)
        if ta is not V and tb is not V:
            if ta is Mixed or tb is Mixed:
                return _mixed2(binop, a, b, m)
            try:
                if ta is int and tb is int and pyint is not None:
                    r = pyint(a, b)
                    return r if _INT64_LO <= r <= _INT64_HI else arith.wrap(r, "int64")
                if fast[(ta, tb)]:
                    return fast_op(a, b)
                return fn(a, b)
            except Exception as exc:       # every active lane would raise it: the first one does
                raise KernelFault(exc, first_lane(m)) from None
        key = (a.k if ta is V else ta, b.k if tb is V else tb)
        if ta is Mixed or tb is Mixed:
            return _mixed2(binop, a, b, m)
        plan = plans.get(key)
        if plan is None:
            if key[0] not in KINDS or key[1] not in KINDS:
                plan = _scalar_plan(op)
            else:
                plan = _build_plan(op, *key)
            plans[key] = plan
        return plan(a, b, m)

    fast_op = arith._FN[op.name]
    binop.__name__ = f"b_{op.name}"
    return binop


def _floordiv(a, b):
    return a // b


_OPS = {
    "add": _Op("add", arith.BINARY["add"], np.add),
    "sub": _Op("sub", arith.BINARY["sub"], np.subtract),
    "mul": _Op("mul", arith.BINARY["mul"], np.multiply),
    "truediv": _Op("truediv", arith.BINARY["truediv"], np.true_divide, div=True),
    "floordiv": _Op("floordiv", arith.BINARY["floordiv"], np.floor_divide, div=True),
    "mod": _Op("mod", arith.BINARY["mod"], np.remainder, div=True),
    "pow": _Op("pow", arith.BINARY["pow"], np.power),
    "lshift": _Op("lshift", arith.BINARY["lshift"], np.left_shift, shift=True),
    "rshift": _Op("rshift", arith.BINARY["rshift"], np.right_shift, shift=True),
    "and": _Op("and", arith.BINARY["and"], np.bitwise_and),
    "or": _Op("or", arith.BINARY["or"], np.bitwise_or),
    "xor": _Op("xor", arith.BINARY["xor"], np.bitwise_xor),
    "lt": _Op("lt", arith.BINARY["lt"], np.less, compare=True),
    "le": _Op("le", arith.BINARY["le"], np.less_equal, compare=True),
    "gt": _Op("gt", arith.BINARY["gt"], np.greater, compare=True),
    "ge": _Op("ge", arith.BINARY["ge"], np.greater_equal, compare=True),
    "eq": _Op("eq", arith.BINARY["eq"], np.equal, compare=True),
    "ne": _Op("ne", arith.BINARY["ne"], np.not_equal, compare=True),
}

BINOPS = {name: _make_binop(op) for name, op in _OPS.items()}


def binop(name, a, b, m):
    return BINOPS[name](a, b, m)


def compare(name, a, b, m):
    return BINOPS[name](a, b, m)


def identity_is(a, b, m):
    """``a is b``: per lane only when both are uniform (Python objects)."""
    if type(a) is V or type(b) is V:
        raise Unsupported("'is' between per-lane values")
    return a is b


def identity_is_not(a, b, m):
    if type(a) is V or type(b) is V:
        raise Unsupported("'is not' between per-lane values")
    return a is not b


def contains(a, b, m):
    if type(a) is V or type(b) is V:
        raise Unsupported("'in' with per-lane values")
    return a in b


# --------------------------------------------------------------------------- unary operations


def _unary(opname, x, m):
    """``-x``, ``+x``, ``~x`` per lane as numba types them (:data:`flashnb.sim.arith.UNARY`)."""
    fn = arith.UNARY[opname]
    if type(x) is Mixed:
        return _mixed1(lambda v, mm: _unary(opname, v, mm), x, m)
    if type(x) is not V:
        try:
            return fn(x)
        except Exception as exc:
            raise KernelFault(exc, first_lane(m)) from None
    k = x.k
    if k is bool:
        if opname == "invert":
            return V(~x.a, bool)
        a = x.a.astype(np.int64)
        return V(-a if opname == "neg" else a, int, 1)
    if k is int:
        if opname == "pos":
            return x
        return V(np.negative(x.a) if opname == "neg" else np.invert(x.a), int, x.bits + 1 if x.bits < 64 else 64)
    if k is float:
        if opname == "invert":
            return scalarise(fn, (x,), m)
        return V(np.negative(x.a), float) if opname == "neg" else x
    sig = arith.lookup_unary(opname, arith.name_of(k)) if k in arith._NAME else None
    if sig is None:
        return scalarise(fn, (x,), m)           # numba's TypeError, lane by lane
    a, r = sig
    dr = np.dtype(arith.NP_TYPES[r])
    if r == "bool":
        return V(~x.a.astype(bool), np.bool_)
    xa = x.a
    if xa.dtype.kind == "b":
        xa = xa.astype(dr)
    res = xa if opname == "pos" else (np.negative(xa) if opname == "neg" else np.invert(xa))   # in x's type
    if res.dtype != dr:
        res = res.astype(dr)                                                                      # then widened
    _FPE[0] = False
    return V(res, arith.NP_TYPES[r])


def u_neg(x, m):
    return _unary("neg", x, m)


def u_pos(x, m):
    return _unary("pos", x, m)


def u_invert(x, m):
    return _unary("invert", x, m)


def u_not(x, m):
    t = truth(x)
    if type(t) is bool:
        return not t
    return V(~t, bool)


# --------------------------------------------------------------------------- casts


def _cast_plan_check(x, target, m, via=None):
    """Casting a per-lane value to the NumPy scalar type ``target`` (``np.float32(x)`` per lane); ``via`` is what
    the kernel called (a numba type, whose cast calls ``target``), re-run on a lane that warns."""
    run = target if via is None else via
    k = x.k
    dt = np.dtype(target)
    a = x.a
    if k in (int, bool) and dt.kind in "iu":
        if via is not None:
            return V(a.astype(dt), target)          # numba's integer cast wraps (a GPU's truncation)
        if k is int and dt != np.int64:
            _check_int_range(a, dt, m, k)
        elif k is int and dt == np.int64 and x.bits > 63:
            return scalarise(target, (x,), m)
    if k is int and dt.kind == "f" and x.bits > _PYFLOAT_EXACT_INT:
        return scalarise(target, (x,), m)
    if dt.kind in "iu" and a.dtype.kind == "f":
        return _float_to_npint(x, target, dt, m, run)
    if target is np.bool_:
        return V(truth(x) if k is not np.bool_ else a, np.bool_)
    r = a.astype(dt)
    if _FPE[0]:
        _fp_check_unary(run, x, r, m)
    return V(r, target)


def _user_watches_fp() -> bool:
    """Whether the caller's NumPy settings turn some float exception into a warning or an error."""
    ue = now.user_err
    return ue is not None and any(v != "ignore" for v in ue.values())


def _float_to_npint(x, target, dt, m, run):
    """``target(x)`` per lane, ``x`` float and ``target`` a NumPy integer type.  A Python float is converted
    as NumPy converts it: ``int(x)`` (an error for NaN and infinities), then range-checked as a Python int (an
    OverflowError out of range).  A NumPy float is C's cast, whose value out of range (NaN and infinities too)
    is the platform's and differs between NumPy's scalar and array loops: those lanes are cast one by one, as the
    threads simulator casts them, with their 'invalid' warning."""
    a = x.a
    info = np.iinfo(dt)
    if x.k is float:
        with np.errstate(all="ignore"):
            odd = ~(np.abs(a) < 2.0 ** 63)          # NaN, infinities and ints over 64 bits: Python's errors
        if m is not None:
            odd &= m
        if odd.any():
            return scalarise(target, (x,), m)
        with np.errstate(all="ignore"):
            ints = np.trunc(a).astype(np.int64)
        if dt != np.int64:
            _check_int_range(ints, dt, m, int)
        return V(ints.astype(dt), target)
    with np.errstate(all="ignore"):
        r = a.astype(dt)
        odd = ~((a > float(info.min) - 1.0) & (a < float(info.max) + 1.0))
    _FPE[0] = False
    if m is not None:
        odd &= m
    if odd.any():
        idx = lanes_in_order(odd)
        r = r.copy()
        with np.errstate(all="ignore"):
            r[idx] = [target(v) for v in a[idx]]
        if _user_watches_fp():
            _replay_fp(idx, lambda lane: run(a[lane]))
    return V(r, target)


def cast_np(target, x, m, via=None):
    """``target(x)`` for a NumPy scalar type ``target`` (``via``: the numba type the kernel called, if any)."""
    if type(x) is Mixed:
        return _mixed1(lambda v, mm: cast_np(target, v, mm, via), x, m)
    if type(x) is not V:
        return target(x) if via is None else via(x)
    if x.k is target:
        return x
    return _cast_plan_check(x, target, m, via)


def cast_int(x, m):
    """Python's ``int(x)``."""
    if type(x) is Mixed:
        return _mixed1(cast_int, x, m)
    if type(x) is not V:
        return int(x)
    k = x.k
    if k is int:
        return x
    a = x.a
    if a.dtype.kind == "f":
        with np.errstate(all="ignore"):
            bad = ~np.isfinite(a) | (np.abs(a) >= 2.0 ** 62)
        if m is not None:
            bad &= m
        if bad.any():
            return scalarise(int, (x,), m)
        return make(np.trunc(a).astype(np.int64) if a.dtype != np.float16 else a.astype(np.float32).astype(np.int64),
                    int)
    if a.dtype == np.uint64 and (a >= 2 ** 63).any():
        return scalarise(int, (x,), m)
    return make(a.astype(np.int64), int)


def cast_float(x, m):
    """Python's ``float(x)``."""
    if type(x) is Mixed:
        return _mixed1(cast_float, x, m)
    if type(x) is not V:
        return float(x)
    if x.k is float:
        return x
    if x.k is int and x.bits > _PYFLOAT_EXACT_INT:
        return scalarise(float, (x,), m)
    return V(x.a.astype(np.float64), float)


def cast_bool(x, m):
    t = truth(x)
    if type(t) is bool:
        return t
    return V(t, bool)


def _numba_target(t):
    """The NumPy scalar type a numba number type casts to on the simulator (``float32(x)`` is
    ``np.float32(x)``), or None."""
    try:
        from numba.core import types as nbt
    except ImportError:  # pragma: no cover
        return None
    if isinstance(t, nbt.Boolean):
        return bool
    if isinstance(t, (nbt.Integer, nbt.Float)):
        return getattr(np, t.name, None)
    return None


_numba_targets: dict = {}
_FMAX = {np.float16: 65504.0, np.float32: 3.4028234663852886e38, np.float64: 1.7976931348623157e308}


def cast(t, x, m):
    """``t(x)`` for ``t`` a numba number type, a NumPy scalar type, or int/float/bool (None if ``t`` is none of
    them)."""
    target = _numba_targets.get(id(t))
    if target is not None and target is not bool:       # a numba type seen before (no hashing of numba types)
        tx = type(x)
        if tx is V:
            if x.k is target:
                return x                                # float32(x) of a float32: the very value
            return cast_np(target, x, m, t)
        if tx is target:
            return x
        if target in _FLOAT_KINDS:
            if (tx is float or tx is int or tx in _FLOAT_KINDS) and -_FMAX[target] < x < _FMAX[target]:
                return target(x)                        # numba's cast of one finite number in range: NumPy's
        elif tx is int or tx is bool or tx in _NP_INT_KINDS:
            return arith.cast_int_python(target, x)     # numba's integer cast wraps
        return cast_np(target, x, m, t)
    if t is int:
        return cast_int(x, m)
    if t is float:
        return cast_float(x, m)
    if t is bool:
        return cast_bool(x, m)
    if t in _NP_KINDS:
        return cast_np(t, x, m)
    target = _numba_targets.get(id(t), 0) if not isinstance(t, type) else 0
    if target == 0:
        target = _numba_target(t)
        _numba_targets[id(t)] = target
    if target is None:
        return NotImplemented
    if target is bool:
        return cast_bool(x, m)
    return cast_np(target, x, m, t)


# --------------------------------------------------------------------------- builtins


def b_max(args, m):
    """Python's ``max(a, b, ...)`` per lane: the first of the maximal arguments (``b`` replaces ``a`` only if
    ``b > a``, which keeps a NaN that comes first)."""
    return _minmax(args, m, "gt")


def b_min(args, m):
    return _minmax(args, m, "lt")


def _minmax(args, m, cmp):
    if any(type(a) is Mixed for a in args):      # lanes of different types: each lane as Python computes it
        return scalarise(max if cmp == "gt" else min, tuple(args), m)
    if len(args) == 1:
        if is_lanes(args[0]):
            raise Unsupported("max()/min() of a per-lane iterable")
        return (max if cmp == "gt" else min)(args[0])
    best = args[0]
    for x in args[1:]:
        if type(best) is not V and type(x) is not V:
            best = (max if cmp == "gt" else min)(best, x)
            continue
        take = BINOPS[cmp](x, best, m)           # x > best: x replaces best
        t = truth(take)
        if type(t) is bool:
            best = x if t else best
            continue
        kx = x.k if type(x) is V else type(x)
        kb = best.k if type(best) is V else type(best)
        if kx is not kb and m is not None:
            t = t | ~m                           # inactive lanes: whichever keeps one type
            if t.all():
                best = x
                continue
            if not (t & m).any():
                continue
        best = merge(t, x, best)
    return best


def b_abs(x, m):
    if type(x) is not V:
        return abs(x)
    k = x.k
    if k is bool:
        return V(x.a.astype(np.int64), int, 1)
    return V(np.abs(x.a), k, x.bits)


# --------------------------------------------------------------------------- math


_FAST_MATH = {math.exp: np.exp, math.log: np.log, math.log2: np.log2, math.log10: np.log10,
              math.expm1: np.expm1, math.log1p: np.log1p, math.sqrt: np.sqrt, math.tanh: np.tanh,
              math.sinh: np.sinh, math.cosh: np.cosh, math.sin: np.sin, math.cos: np.cos, math.tan: np.tan,
              math.atan: np.arctan, math.asin: np.arcsin, math.acos: np.arccos, math.erf: None}
_FAST_MATH = {k: v for k, v in _FAST_MATH.items() if v is not None}
_BOOL_MATH = {math.isfinite: np.isfinite, math.isnan: np.isnan, math.isinf: np.isinf}
_INT_MATH = {math.floor: np.floor, math.ceil: np.ceil, math.trunc: np.trunc}
#: how far (in float64 ulps) NumPy's float64 math may be from the C library's and still give the same float32
MATH_ULPS = 1 << 12


def is_math(fn) -> bool:
    return fn in _FAST_MATH or fn in _BOOL_MATH or fn in _INT_MATH or fn is math.fabs


def _as_f64(x):
    k = x.k
    if k is int and x.bits > _PYFLOAT_EXACT_INT:
        return None
    return x.a.astype(np.float64) if x.a.dtype != np.float64 else x.a


def math_call(fn, args, m):
    """``math.fn(x)`` per lane, exactly as the C library computes it (Python's ``math``): one call per active
    lane (the result is a Python float, which later arithmetic may use at full precision)."""
    if len(args) == 1 and type(args[0]) is Mixed:
        return _mixed1(lambda v, mm: math_call(fn, (v,), mm), args[0], m)
    if len(args) != 1 or type(args[0]) is not V:
        if any(is_lanes(a) for a in args):
            return scalarise(fn, args, m)
        if len(args) == 1 and type(args[0]) is np.float32 and fn in arith.MATH_F32:
            return arith.math_call(fn, args[0])
        return fn(*args)
    x = args[0]
    if x.k is np.float32 and fn in arith.MATH_F32:     # numba types math.fn(float32) as a float32
        return V(np.abs(x.a), np.float32) if fn is math.fabs else f32_math(np.float32, fn, args, m)
    if fn in _BOOL_MATH:
        if x.k is int and x.bits > 62:
            return scalarise(fn, args, m)
        a = x.a if x.a.dtype.kind != "f" else x.a
        if a.dtype.kind in "iub":
            r = np.zeros(a.shape, bool) if fn is not math.isfinite else np.ones(a.shape, bool)
        else:
            r = _BOOL_MATH[fn](a)
        return V(r, bool)
    if fn in _INT_MATH:
        xf = _as_f64(x) if x.k is not int else None
        if x.k is int:
            return x
        if x.k is bool:
            return V(x.a.astype(np.int64), int, 1)
        if xf is None:
            return scalarise(fn, args, m)
        with np.errstate(all="ignore"):
            bad = ~np.isfinite(xf) | (np.abs(xf) >= 2.0 ** 62)
        if m is not None:
            bad &= m
        if bad.any():
            return scalarise(fn, args, m)
        return make(_INT_MATH[fn](xf).astype(np.int64), int)
    if fn is math.fabs:
        xf = _as_f64(x)
        if xf is None:
            return scalarise(fn, args, m)
        return V(np.abs(xf), float)
    xf = _as_f64(x)
    if xf is None:
        return scalarise(fn, args, m)
    idx = lanes_in_order(m)
    vals = xf[idx].tolist()
    out = np.empty(now.L)
    res = []
    for lane, v in zip(idx, vals):
        try:
            res.append(fn(v))
        except Exception as exc:
            raise KernelFault(exc, int(lane)) from None
    out[idx] = res
    return V(out, float)


def f32_math(outer, inner, args, m):
    """``float32(math.fn(x))`` per lane.  NumPy's float64 ``fn`` gives the result wherever it cannot round to
    another float32 than the C library's value would (its distance to the nearest float32 rounding boundary is
    over :data:`MATH_ULPS` float64 ulps, it is finite, normal in float32, and ``x`` is finite); every other active
    lane calls ``math.fn`` itself (its exceptions, e.g. ``math.exp`` overflow, are the kernel's).  Anything that
    is not this pattern is composed from the general calls."""
    if type(args[0]) is Mixed:
        return _mixed1(lambda v, mm: f32_math(outer, inner, (v,), mm), args[0], m)
    x = args[0]
    if type(x) is not V:
        return outer(inner(x))
    xf = _as_f64(x)
    if xf is None:
        return cast_np(np.float32, math_call(inner, args, m), m)
    with np.errstate(all="ignore"):
        y = _FAST_MATH[inner](xf)
        bits = y.view(np.uint64)
        low = (bits & np.uint64((1 << 29) - 1)).astype(np.int64) - (1 << 28)
        ay = np.abs(y)
        ok = np.isfinite(y) & np.isfinite(xf) & (np.abs(low) > MATH_ULPS) & ((ay >= 2.0 ** -125) | (y == 0))
        ok &= ay < 3.4028234663852886e38
        r = y.astype(np.float32)
    _FPE[0] = False
    redo = ~ok if m is None else (m & ~ok)
    if redo.any():
        idx = lanes_in_order(redo)
        r = r.copy()
        r[idx] = _exact_math_f32(inner, xf, idx)
    return V(r, np.float32)


def _exact_math_f32(inner, xf, idx):
    """``np.float32(inner(x))`` of the lanes ``idx`` (start order) with the C library (``math``): infinities and
    NaN once per distinct value; the first lane whose call raises raises (the threads simulator's first thread);
    a finite result beyond float32 warns as ``np.float32`` of it warns there."""
    xv = xf[idx]
    res = np.empty(len(idx))
    nonfin = ~np.isfinite(xv)
    first_bad = None
    if nonfin.any():
        for val in np.unique(xv[nonfin]).tolist():
            sel = nonfin & ((xv == val) | (np.isnan(xv) if math.isnan(val) else False))
            try:
                res[sel] = inner(val)
            except Exception as exc:
                j = int(np.argmax(sel))
                if first_bad is None or j < first_bad[0]:
                    first_bad = (j, exc)
    for j in np.flatnonzero(~nonfin).tolist():
        if first_bad is not None and j > first_bad[0]:
            break
        try:
            res[j] = inner(float(xv[j]))
        except Exception as exc:
            first_bad = (j, exc)
            break
    if first_bad is not None:
        raise KernelFault(first_bad[1], int(idx[first_bad[0]])) from None
    with np.errstate(all="ignore"):
        fr = res.astype(np.float32)
    over = np.isfinite(res) & ~np.isfinite(fr)
    if over.any():
        _replay_fp(idx[over], lambda lane: np.float32(inner(float(xf[lane]))))
    _FPE[0] = False
    return fr


def cast_target(t):
    """The NumPy scalar type ``t(x)`` casts to (``t`` a numba or NumPy number type), else None."""
    target = _numba_targets.get(id(t))          # a numba type seen before: no hashing of numba types
    if target is not None:
        return target if target in _NP_KINDS else None
    if isinstance(t, type):
        return t if t in _NP_KINDS else None
    target = _numba_target(t)
    _numba_targets[id(t)] = target
    return target if target in _NP_KINDS else None
