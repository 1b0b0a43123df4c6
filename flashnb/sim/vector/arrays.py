"""Arrays of the vectorised simulator: what ``A[i, j]`` means for every lane at once.

* :class:`Arr` -- a global array (a kernel argument, or a view of one) or a shared array: a flat NumPy buffer,
  an element offset (one number, or one per lane: shared memory is one copy per block, laid out block after
  block), a shape and element strides.  Loads gather the active lanes' elements (``take``), stores scatter
  them; both index exactly as NumPy indexes the threads simulator's arrays (negative indices wrap, an index
  past the end is NumPy's ``IndexError`` for the first active lane) unless memcheck is on, which refuses any
  index outside the shape first, as the threads simulator's memcheck does.
* :class:`Local` -- a ``cuda.local.array``: one 1-D array over the lanes per element (lanes last), so an element
  chosen by a uniform index is one array, no gather.
* plain NumPy arrays a kernel reaches through its globals or closure (``cuda.const.array_like``, captured
  tables) are read with NumPy's rules and are not traffic, as in the threads simulator.

Every access also goes to the launch's tools (:mod:`flashnb.sim.vector.tools`): the traffic counter (one
element per active lane), memcheck, initcheck, racecheck and the memory profiler.
"""

from __future__ import annotations

import numpy as np

from ..fallback import KernelFault, Unsupported
from . import tools
from .tools import lane_values as _lane_vals
from .tools import pre_at as _pre_at
from .values import (
    _FPE,
    KINDS,
    Mixed,
    V,
    _check_int_range,
    _fp_check_unary,
    collapse_int,
    dtype_of,
    first_lane,
    lanes_in_order,
    m_count,
    now,
)

__all__ = ["Arr", "Local", "load", "store", "index_error"]

_INT_KINDS = frozenset((int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))
_BAD_INDEX = ("only integers, slices (`:`), ellipsis (`...`), numpy.newaxis (`None`) and integer or boolean "
              "arrays are valid indices")


class Arr:
    """A global or shared array (or a view of one) as the lanes see it."""

    __slots__ = ("base", "off", "shape", "st", "memory", "name", "pre", "kind", "root", "nd", "fake_shape",
                 "per_block", "dtype", "vview", "addr0", "root_off")

    def __init__(self, base, off, shape, st, memory, name, pre, root, fake_shape, per_block=0, nd=None,
                 vview=False):
        self.base = base          # flat buffer (1-D view of the root allocation(s))
        self.off = off            # element offset: int, or int64 array per lane
        # ``A.shape``: the threads simulator's FakeShape for device arrays (no negative indexing), a tuple else
        self.shape = (_FakeShape if fake_shape else tuple)(int(s) for s in shape)
        self.st = st              # element strides
        self.memory = memory      # "global", "shared" or None (a plain array: not traffic, no tools)
        self.name = name
        self.pre = pre            # indices that made this view (messages): tuple of tuples
        self.root = root          # the root ndarray (shared: the (blocks, ...) store)
        self.fake_shape = fake_shape
        self.per_block = per_block   # shared: elements per block
        self.kind = base.dtype.type
        self.dtype = base.dtype
        self.nd = nd              # a NumPy view of this array when its offset is uniform (global)
        self.vview = vview        # a view whose offset differs per lane
        self.addr0 = 0            # global: address of element 0 of ``base`` (the race checker keys by address)
        self.root_off = 0         # bytes from the allocation's start to ``base`` (the profiler's offsets)

    # numpy-ish attributes kernels read
    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __getattr__(self, name):   # strides, itemsize, nbytes, ...
        if name in ("strides",):
            return tuple(s * self.dtype.itemsize for s in self.st)
        if name == "itemsize":
            return self.dtype.itemsize
        if name == "nbytes":
            return self.size * self.dtype.itemsize
        raise AttributeError(name)

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __repr__(self):
        return f"<lanes' {self.memory} array {self.name} {self.dtype}{self.shape}>"


#: Globals this module's launches rebind or fill (the course grader's integrity check leaves them out).
_RUNTIME_STATE = ("_FakeShape",)
_FakeShape = tuple


def set_fake_shape(cls):
    global _FakeShape
    _FakeShape = cls


_FLAT_CACHES: dict = {}


class Local:
    """A ``cuda.local.array``: ``rows[e]`` is element ``e`` (C order) of every lane (an immutable 1-D array, or
    ``None`` before anything was written)."""

    __slots__ = ("rows", "shape", "st", "kind", "dtype", "name", "written", "size", "fc")

    def __init__(self, shape, dtype, name):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.kind = self.dtype.type
        n = 1
        st = []
        for s in reversed(self.shape):
            st.append(n)
            n *= s
        self.st = tuple(reversed(st))
        self.size = n
        self.rows = [None] * n   # element -> V over the lanes (None: never written)
        self.name = name
        self.written = None      # initcheck: per element, the lanes that wrote it
        self.fc = _FLAT_CACHES.setdefault(self.shape, {})   # in-bounds uniform index -> element

    @property
    def ndim(self):
        return len(self.shape)

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"<lanes' local array {self.name} {self.dtype}{self.shape}>"


# --------------------------------------------------------------------------- index resolution


def _fmt(i) -> str:
    if isinstance(i, slice):
        parts = ["" if x is None else str(int(x)) for x in (i.start, i.stop)]
        return ":".join(parts) + ("" if i.step is None else f":{int(i.step)}")
    if i is Ellipsis:
        return "..."
    return str(int(i))


def _memcheck_fail(arr, op, idx, lane, axis, value, view, nidx_over=None):
    """memcheck's message for lane ``lane`` (the threads simulator's wording)."""
    from ..sanitizer import _fmt_ref, _only_ints

    pre = _pre_at(arr.pre, lane)
    full = _lane_vals(idx, lane)
    shape = arr.shape
    if nidx_over is not None:
        bad = f"{nidx_over} indices into a {len(shape)}-dimensional array"
    elif _only_ints(pre):
        bad = f"index {value} is outside 0..{shape[axis] - 1} of dimension {sum(len(g) for g in pre) + axis}"
    else:
        from ..sanitizer import _fmt_index
        vname = arr.name + "".join(f"[{_fmt_index(g)}]" for g in pre)
        bad = (f"index {value} is outside 0..{shape[axis] - 1} of dimension {axis} of the view {vname} "
               f"(shape {tuple(shape)})")
    element = not view
    opname = {"r": "read", "w": "write", "a": "atomic"}[op]
    what = f"{opname} of" if element else "view of"
    ti, bi = now.lane_name(lane)
    where = tools.where(tools.cur.site)
    label, kernel = tools.cur.label, tools.cur.kernel
    message = (f"invalid {arr.memory} {what} {_fmt_ref(arr.name, pre, full)} by thread {list(ti)} in "
               f"block {list(bi)} of launch {label!r} ({kernel}) at {where}: {bad}"
               + (" (NumPy would wrap it silently; on a GPU it touches memory outside the array)"
                  if "index -" in bad else ""))
    tools.cur.memcheck_error(arr, message, where, lane)


def index_error(lane, message):
    raise KernelFault(IndexError(message), lane)


def resolve(arr, idx, m, op):
    """The flat element index (an int, or an int64 array per lane) of ``arr[idx]`` for element accesses, after
    NumPy's (or memcheck's) checks on the active lanes; or ``('view', new Arr)`` when ``idx`` selects a
    sub-array."""
    if type(idx) is not tuple:
        idx = (idx,)
    shape = arr.shape
    n = len(idx)
    if n == len(shape):
        # The common case first: one element, every index an int or a per-lane int, all in bounds on every
        # lane.  Anything else (a view, a slice, an index out of bounds on some lane, memcheck's report) takes
        # the general path below, which gives the same flat index where this one does.
        flat = arr.off
        st = arr.st
        for axis in range(n):
            i = idx[axis]
            t = type(i)
            if t is V:
                c = i.ix
                if c is None:
                    if i.k not in _INT_KINDS:
                        break
                    a = i.a
                    if a.dtype != np.int64:
                        a = a.astype(np.int64)
                    c = i.ix = [a, int(a.view(np.uint64).max(initial=0)), 1, a]
                if c[1] >= shape[axis]:
                    break
                s = st[axis]
                if c[2] != s:
                    c[2] = s
                    c[3] = c[0] * s
                flat = flat + c[3]
            elif t is int or t in _NP_INT_SET:
                if t is not int:
                    i = int(i)                  # numba's int64 results of index arithmetic
                if not 0 <= i < shape[axis]:
                    break
                flat = flat + i * st[axis]
            else:
                break
        else:
            return flat
    if any(type(i) is Mixed for i in idx):
        idx = tuple(collapse_int(i) for i in idx)       # an index is its value, whatever its type
    shape = arr.shape
    nd = len(shape)
    simple = True
    for i in idx:
        t = type(i)
        if t is V:
            if i.k not in _INT_KINDS:
                if i.k is bool or i.k is np.bool_:
                    raise Unsupported("a per-lane boolean used as an array index")
                index_error(first_lane(m), _BAD_INDEX)
        elif t is int or t in _NP_INT_SET:
            pass
        elif t is slice or i is Ellipsis or i is None:
            simple = False
        elif t is bool or t is np.bool_:
            raise Unsupported("a boolean used as an array index")
        else:
            index_error(first_lane(m), _BAD_INDEX)
    memcheck = arr.memory is not None and tools.cur.memcheck
    n = len(idx)
    if n > nd:
        if memcheck and simple:
            _memcheck_fail(arr, op, idx, first_lane(m), 0, 0, False, nidx_over=n)
        index_error(first_lane(m), f"too many indices for array: array is {nd}-dimensional, but {n} were indexed")
    if not simple:
        return ("view", _slice_view(arr, idx, m, op, memcheck))
    view = n < nd
    flat = arr.off
    for axis in range(n):
        i = idx[axis]
        size = shape[axis]
        stride = arr.st[axis]
        if type(i) is V:
            a = i.a
            if a.dtype != np.int64:
                a = a.astype(np.int64)
            bad = a.view(np.uint64) >= size
            if bad.any():
                a = _fix_axis(arr, op, idx, a, axis, size, m, memcheck, view)
            flat = flat + a * stride if stride != 1 else flat + a
        else:
            i = int(i)
            if not 0 <= i < size:
                if memcheck or i >= size or i < -size:
                    lane = first_lane(m)
                    if memcheck:
                        _memcheck_fail(arr, op, idx, lane, axis, i, view)
                    index_error(lane, f"index {i} is out of bounds for axis {axis} with size {size}")
                i += size
            flat = flat + i * stride
    if view:
        return ("view", _int_view(arr, idx, flat, n))
    return flat


_NP_INT_SET = frozenset((np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))


def _fix_axis(arr, op, idx, a, axis, size, m, memcheck, view):
    """Negative or too-large indices on some lanes: wrap (NumPy) or fail (memcheck) on active lanes; inactive
    lanes' garbage is clamped to 0 so the gather stays inside the buffer."""
    if memcheck:
        bad = (a < 0) | (a >= size)
        act = bad if m is None else bad & m
        if act.any():
            lane = _first_bad_lane(idx, arr.shape, m, axis_limit=None)
            ax, val = _first_bad_axis(idx, arr.shape, lane)
            _memcheck_fail(arr, op, idx, lane, ax, val, view)
        return np.where(bad, 0, a)
    w = np.where(a < 0, a + size, a)
    bad = (w < 0) | (w >= size)
    act = bad if m is None else bad & m
    if act.any():
        lane = _first_bad_lane(idx, arr.shape, m, axis_limit=None, wrap=True)
        ax, val = _first_bad_axis(idx, arr.shape, lane, wrap=True)
        index_error(lane, f"index {val} is out of bounds for axis {ax} with size {arr.shape[ax]}")
    return np.where(bad, 0, w) if bad.any() else w


def _first_bad_lane(idx, shape, m, axis_limit=None, wrap=False):
    anybad = np.zeros(now.L, bool)
    for axis, i in enumerate(idx):
        if axis >= len(shape):
            break
        size = shape[axis]
        if type(i) is V:
            a = i.a.astype(np.int64)
            bad = ((a < -size) | (a >= size)) if wrap else ((a < 0) | (a >= size))
            anybad |= bad
        else:
            i = int(i)
            if (wrap and not -size <= i < size) or (not wrap and not 0 <= i < size):
                anybad[:] = True
    if m is not None:
        anybad &= m
    return first_lane(anybad)


def _first_bad_axis(idx, shape, lane, wrap=False):
    for axis, i in enumerate(idx):
        size = shape[axis]
        v = int(i.a[lane]) if type(i) is V else int(i)
        if (wrap and not -size <= v < size) or (not wrap and not 0 <= v < size):
            return axis, v
    return 0, 0   # pragma: no cover


def _int_view(arr, idx, flat, n):
    """``arr[i, j]`` with fewer indices than dimensions: a view (offset per lane when an index differs)."""
    pre = arr.pre + (tuple(idx),)
    shape = arr.shape[n:]
    st = arr.st[n:]
    vview = type(flat) is np.ndarray and not (type(arr.off) is np.ndarray and
                                               all(type(i) is not V for i in idx))
    if type(flat) is np.ndarray and not vview:
        vview = arr.vview
    nd = None
    if type(flat) is not np.ndarray and arr.nd is not None:
        nd = arr.nd[tuple(int(i) for i in idx)]
    out = Arr(arr.base, flat, shape, st, arr.memory, arr.name, pre, arr.root, arr.fake_shape, arr.per_block, nd,
              vview or arr.vview)
    out.addr0, out.root_off = arr.addr0, arr.root_off
    return out


def _slice_view(arr, idx, m, op, memcheck):
    """``arr[16:]``, ``arr[z, :]`` ...: NumPy's view (slice bounds the same on every lane; an integer index may
    differ per lane); memcheck checks the integer indices."""
    extra = 0
    idx0 = idx
    lanes_idx = [k for k, i in enumerate(idx) if type(i) is V]
    for i in idx:
        if type(i) is slice and any(type(x) is V for x in (i.start, i.stop, i.step)):
            raise Unsupported("slice bounds that differ per lane")
    if lanes_idx:
        if any(i is None or i is Ellipsis for i in idx):
            raise Unsupported("a per-lane index beside None or ... in a view")
        for k in lanes_idx:
            a = idx[k].a.astype(np.int64)
            size = arr.shape[k]
            if (a.view(np.uint64) >= size).any():
                a = _fix_axis(arr, op, idx, a, k, size, m, memcheck, True)
            extra = extra + a * arr.st[k]
        idx = tuple(0 if type(i) is V else i for i in idx)
    if memcheck:
        k = 0
        for i in idx:
            if i is None or i is Ellipsis:
                continue
            if type(i) is not slice:
                v = int(i)
                if k < len(arr.shape) and not 0 <= v < arr.shape[k]:
                    _memcheck_fail(arr, op, idx, first_lane(m), k, v, True)
            k += 1
    tmpl = np.lib.stride_tricks.as_strided(np.zeros(1, arr.dtype), shape=arr.shape,
                                           strides=tuple(s * arr.dtype.itemsize for s in arr.st))
    # the view's geometry, from NumPy itself on a template with the same strides
    base_ptr = tmpl.__array_interface__["data"][0]
    try:
        sub = tmpl[idx]
    except IndexError as exc:
        index_error(first_lane(m), str(exc))
    delta = (sub.__array_interface__["data"][0] - base_ptr) // arr.dtype.itemsize
    st = tuple(s // arr.dtype.itemsize for s in sub.strides)
    nd = None
    if arr.nd is not None and not lanes_idx:
        nd = arr.nd[idx]
    pre = arr.pre + (tuple(idx0),)
    out = Arr(arr.base, arr.off + delta + extra, sub.shape, st, arr.memory, arr.name, pre, arr.root,
              arr.fake_shape, arr.per_block, nd, arr.vview or bool(lanes_idx))
    out.addr0, out.root_off = arr.addr0, arr.root_off
    return out


# --------------------------------------------------------------------------- loads and stores


def _gather(arr, flat, m):
    if type(flat) is np.ndarray:
        return arr.base.take(flat)
    return arr.base[flat]


def load(arr, idx, m, site):
    """``arr[idx]`` on the active lanes: an element per lane (a :class:`V`, or the uniform scalar when every
    lane reads one global element) or a view."""
    T = tools.cur
    T.site = site
    r = resolve(arr, idx, m, "r")
    if type(r) is tuple:
        return r[1]
    if arr.memory is not None:
        if T.pending_atomics:
            T.flush_atomics(arr)
        if T.active:
            T.access(arr, "r", r, m, site, idx)
    if type(r) is np.ndarray:
        return V(arr.base.take(r), arr.kind)
    if arr.memory == "shared" and type(arr.off) is np.ndarray:  # pragma: no cover (off uniform -> r uniform)
        return V(arr.base.take(np.full(now.L, r)), arr.kind)
    return arr.base[r]


def convert_for_store(value, dtype, m):
    """The values ``arr[i] = value`` stores, converted as NumPy's setitem converts the scalar of each lane."""
    t = type(value)
    if t is Mixed:
        if not value.usable():
            value.fail()
        out = np.empty(now.L, dtype)
        for _, v, pm in value.parts:
            mm = pm if m is None else (m & pm if pm is not None else m)
            if pm is not None and not mm.any():
                continue
            c = convert_for_store(v, dtype, mm)
            if pm is None:
                out[...] = c
            else:
                out[pm] = c[pm] if type(c) is np.ndarray else c
        return out
    if t is V:
        k = value.k
        a = value.a
        if k is int and dtype.kind in "iu" and dtype != np.int64:
            _check_int_range(a, dtype, m, k)
        if a.dtype is dtype or a.dtype == dtype:
            return a
        r = a.astype(dtype)
        if _FPE[0]:
            _fp_check_unary(dtype.type, value, r, m)
        return r
    if t not in KINDS:
        if t is tuple or t is list:
            raise Unsupported("a sequence stored into an array element")
        try:
            return np.asarray(value).astype(dtype) if isinstance(value, np.ndarray) else dtype.type(value)
        except Exception as exc:
            raise KernelFault(exc, first_lane(m)) from None
    try:
        with np.errstate(**now.user_err):
            return dtype.type(value) if t is not np.bool_ or dtype.kind == "b" else dtype.type(bool(value))
    except Exception as exc:
        raise KernelFault(exc, first_lane(m)) from None


def store(arr, idx, value, m, site):
    """``arr[idx] = value`` on the active lanes (when several active lanes write one element, the one the threads
    simulator runs last wins)."""
    T = tools.cur
    T.site = site
    r = resolve(arr, idx, m, "w")
    if type(r) is tuple:
        _store_view(r[1], value, m, site)
        return
    if arr.memory is not None:
        if T.pending_atomics:
            T.flush_atomics(arr)
        if arr.memory == "global":
            T.before_write(arr.root)
    vals = convert_for_store(value, arr.dtype, m)
    if T.active and arr.memory is not None:
        T.access(arr, "w", r, m, site, idx)
    base = arr.base
    if type(r) is np.ndarray:
        if m is None:
            if now.rank is not None:
                order = lanes_in_order(None)
                base[r[order]] = vals[order] if type(vals) is np.ndarray else vals
            else:
                base[r] = vals
        else:
            order = lanes_in_order(m)
            base[r[order]] = vals[order] if type(vals) is np.ndarray else vals
    else:
        if type(vals) is np.ndarray:
            base[r] = vals[lanes_in_order(m)[-1]]
        else:
            base[r] = vals


def _store_view(view, value, m, site):
    """``A[0:4] = x`` (a sub-array assigned): uniform view and value only."""
    if type(value) is V or view.vview or type(view.off) is np.ndarray:
        raise Unsupported("a sub-array assigned per lane")
    T = tools.cur
    if view.memory == "global":
        T.before_write(view.root)
    src = value
    if isinstance(value, Arr):
        if value.vview or type(value.off) is np.ndarray:
            raise Unsupported("a sub-array copied per lane")
        src = value.nd
        if value.memory is not None and T.count:
            T.bump(value, "r", value.size * m_count(m))
    tgt = view.nd
    if tgt is None:
        raise Unsupported("a sub-array of shared memory assigned")
    tgt[...] = src
    if T.count and view.memory is not None:
        T.bump(view, "w", view.size * m_count(m))


# --------------------------------------------------------------------------- local arrays


def _local_flat(loc, idx, m, op, site):
    if type(idx) is not tuple:
        idx = (idx,)
    if any(type(i) is Mixed for i in idx):
        idx = tuple(collapse_int(i) for i in idx)
    shape = loc.shape
    if len(idx) != len(shape):
        if len(idx) > len(shape):
            index_error(first_lane(m), f"too many indices for array: array is {len(shape)}-dimensional, but "
                                       f"{len(idx)} were indexed")
        raise Unsupported("a view of a local array")
    uniform = True
    flat = 0
    memcheck = tools.cur.memcheck
    for axis, i in enumerate(idx):
        t = type(i)
        size = shape[axis]
        if t is V:
            uniform = False
            if i.k not in _INT_KINDS:
                if i.k is bool or i.k is np.bool_:
                    raise Unsupported("a per-lane boolean used as an array index")
                index_error(first_lane(m), _BAD_INDEX)
            a = i.a.astype(np.int64) if i.a.dtype != np.int64 else i.a
            bad = a.view(np.uint64) >= size
            if bad.any():
                a = _fix_local_axis(loc, op, idx, a, axis, size, m, memcheck)
            flat = flat + a * loc.st[axis]
        elif t is int or t in _NP_INT_SET:
            v = int(i)
            if not 0 <= v < size:
                if memcheck or not -size <= v < size:
                    lane = first_lane(m)
                    if memcheck:
                        _local_memcheck(loc, op, idx, lane, axis, v)
                    index_error(lane, f"index {v} is out of bounds for axis {axis} with size {size}")
                v += size
            flat = flat + v * loc.st[axis]
        elif t is slice or i is Ellipsis or i is None:
            raise Unsupported("a slice of a local array")
        else:
            index_error(first_lane(m), _BAD_INDEX)
    if uniform and all(type(i) is int and i >= 0 for i in idx):
        loc.fc[idx if len(idx) > 1 else idx[0]] = flat
    return flat, uniform


def _local_memcheck(loc, op, idx, lane, axis, value):
    fake = Arr(np.zeros(1, loc.dtype), 0, loc.shape, loc.st, "local", loc.name, (), None, False)
    _memcheck_fail(fake, op, idx, lane, axis, value, False)


def _fix_local_axis(loc, op, idx, a, axis, size, m, memcheck):
    if memcheck:
        bad = (a < 0) | (a >= size)
        act = bad if m is None else bad & m
        if act.any():
            lane = first_lane(act)
            ax, val = _first_bad_axis(idx, loc.shape, lane)
            _local_memcheck(loc, op, idx, lane, ax, val)
        return np.where(bad, 0, a)
    w = np.where(a < 0, a + size, a)
    bad = (w < 0) | (w >= size)
    act = bad if m is None else bad & m
    if act.any():
        lane = first_lane(act)
        ax, val = _first_bad_axis(idx, loc.shape, lane, wrap=True)
        index_error(lane, f"index {val} is out of bounds for axis {ax} with size {loc.shape[ax]}")
    return np.where(bad, 0, w) if bad.any() else w


_GARBAGE: dict = {}


def garbage(dtype):
    """What an element of a fresh local array holds before it is written (as ``np.empty`` would: anything)."""
    g = _GARBAGE.get((dtype, now.L))
    if g is None:
        g = _GARBAGE[(dtype, now.L)] = np.zeros(now.L, dtype)
    return g


def _row(loc, e):
    v = loc.rows[e]
    if v is None:
        v = loc.rows[e] = V(garbage(loc.dtype), loc.kind)
    return v


def local_load(loc, idx, m, site):
    """``loc[idx]``: an element chosen by indices the same on every lane is one stored row (no copy)."""
    flat = loc.fc.get(idx) if type(idx) is tuple or type(idx) is int else None
    T = tools.cur
    if flat is not None and not T.initcheck:
        v = loc.rows[flat]
        return v if v is not None else _row(loc, flat)
    T.site = site
    flat, uniform = _local_flat(loc, idx, m, "r", site)
    if T.initcheck:
        T.local_read(loc, flat, m, site, idx)
    if uniform:
        return _row(loc, flat)
    uniq = np.unique(flat if m is None else flat[m])
    if len(uniq) == 1:
        return _row(loc, int(uniq[0]))
    stack = np.stack([_row(loc, e).a for e in range(loc.size)])
    return V(stack[flat, np.arange(now.L)], loc.kind)


_FULL: dict = {}


def _full(dtype, value):
    key = (dtype, value.tobytes() if isinstance(value, np.generic) else value, now.L)
    a = _FULL.get(key)
    if a is None:
        a = np.full(now.L, value, dtype)
        if len(_FULL) > 4096:
            _FULL.clear()
        _FULL[key] = a
    return a


def local_store(loc, idx, value, m, site):
    """``loc[idx] = value`` on the active lanes (a value of the array's type is kept as it is: values are never
    changed in place)."""
    flat = loc.fc.get(idx) if type(idx) is tuple or type(idx) is int else None
    T = tools.cur
    if flat is None or T.initcheck:
        T.site = site
        flat, uniform = _local_flat(loc, idx, m, "w", site)
    else:
        uniform = True
    if type(value) is V and value.k is loc.kind:
        vals = value.a
    else:
        vals = convert_for_store(value, loc.dtype, m)
        if type(vals) is not np.ndarray:
            vals = _full(loc.dtype, vals)
    if T.initcheck:
        T.local_write(loc, flat, m)
    rows = loc.rows
    kind = loc.kind
    if uniform:
        if m is None:
            rows[flat] = value if (type(value) is V and value.k is kind) else V(vals, kind)
        else:
            rows[flat] = V(np.where(m, vals, _row(loc, flat).a), kind)
        return
    sel = np.unique(flat if m is None else flat[m])
    for e in sel.tolist():
        hit = flat == e
        if m is not None:
            hit &= m
        rows[e] = V(np.where(hit, vals, _row(loc, e).a), kind)


# --------------------------------------------------------------------------- plain NumPy arrays (constants)


def const_load(nd, idx, m):
    """``nd[idx]`` for a plain NumPy array the kernel reads through its globals or closure (NumPy's rules; not
    traffic)."""
    arr = Arr(nd.reshape(-1) if nd.flags.c_contiguous else np.ascontiguousarray(nd).reshape(-1), 0, nd.shape,
              _c_strides(nd.shape), None, "?", (), nd, False, nd=nd)
    r = resolve(arr, idx, m, "r")
    if type(r) is tuple:
        raise Unsupported("a view of a constant array chosen per lane")
    if type(r) is np.ndarray:
        return V(arr.base.take(r), arr.kind)
    return arr.base[r]


def _c_strides(shape):
    n = 1
    st = []
    for s in reversed(shape):
        st.append(n)
        n *= s
    return tuple(reversed(st))


def const_store(nd, idx, value, m):
    if not nd.flags.c_contiguous:
        raise Unsupported("a store into a non-contiguous host array")
    arr = Arr(nd.reshape(-1), 0, nd.shape, _c_strides(nd.shape), None, "?", (), nd, False, nd=nd)
    r = resolve(arr, idx, m, "w")
    if type(r) is tuple:
        raise Unsupported("a sub-array of a host array assigned")
    tools.cur.before_write(nd)
    vals = convert_for_store(value, arr.dtype, m)
    if type(r) is np.ndarray:
        order = lanes_in_order(m)
        arr.base[r[order]] = vals[order] if type(vals) is np.ndarray else vals
    else:
        arr.base[r] = vals[lanes_in_order(m)[-1]] if type(vals) is np.ndarray else vals


__all__ += ["const_load", "const_store", "local_load", "local_store", "garbage"]


def dtype_kind(d):
    return dtype_of(d)
