"""The ``cuda`` a kernel sees in the vectorised simulator: thread geometry, barriers, warp operations, atomics.

Lanes are laid out block after block, each block's threads by linear thread id ``x + Dx·(y + Dy·z)``, so a warp
is 32 consecutive lanes (fewer in a partial last warp) and a shuffle is a gather inside that group.

Lockstep runs every lane that reaches a statement together, so

* ``syncthreads()`` needs no waiting, but it is checked: every live thread of a block reaches it, or none does.
  A barrier that only some of a block's live threads reach (they may be waiting at another barrier, or
  would never come: on a GPU a hang or undefined behaviour) cannot be run in lockstep: the launch falls back
  to the threads simulator, which runs it -- or reports the deadlock, or synccheck's finding -- its way;
* a warp operation (shuffle, vote, match, ``syncwarp``) needs every lane its mask names that has not returned to
  be here, with the same mask; if one of them is elsewhere (a divergent shuffle) the launch falls back too;
* an atomic whose result is not used and whose result depends on the order of the operations (a float add,
  ``exch``, ...) is deferred and applied in the threads simulator's order (block after block, barrier phase
  after phase, thread after thread), so float sums round exactly as there.

The semantics of each intrinsic (poison for lanes that do not take part, int32 results, the checks on masks
and values with their messages) are those of :mod:`flashnb.sim.warp`.
"""

from __future__ import annotations

import math

import numpy as np

from ..fallback import KernelFault, Unsupported
from . import tools
from .arrays import Arr, Local, resolve
from .values import (
    _FLOAT_KINDS,
    BINOPS,
    KINDS,
    Mixed,
    V,
    collapse_int,
    dtype_of,
    first_lane,
    is_lanes,
    lanes_in_order,
    make,
    merge,
    scalar_at,
    truth,
)

__all__ = ["Geometry", "VectorCuda", "apply_deferred"]

FULL_MASK = 0xFFFFFFFF
INT_POISON = -559038737


def lane_aware(fn):
    """Mark a method of the vectorised ``cuda`` as taking ``(m, site, *args)``: the calls dispatcher passes the
    active mask and the call site first."""
    fn._lanes = True
    return fn


class Dim3:
    """``cuda.threadIdx`` and friends: ``x``, ``y``, ``z`` (uniform ints or per-lane values)."""

    __slots__ = ("x", "y", "z")

    def __init__(self, x, y, z):
        self.x, self.y, self.z = x, y, z

    def __iter__(self):
        yield self.x
        yield self.y
        yield self.z

    def __repr__(self):
        return f"Dim3({self.x}, {self.y}, {self.z})"


class Geometry:
    """The lanes of one chunk: ``B`` blocks (``blocks``, in the threads simulator's order) of ``T`` threads."""

    def __init__(self, grid, block, blocks, first_block_lin):
        self.grid = tuple(grid)
        self.block = tuple(block)
        self.blocks = blocks
        B = self.B = len(blocks)
        Dx, Dy, Dz = self.block
        T = self.T = Dx * Dy * Dz
        L = self.L = B * T
        self.blk = np.repeat(np.arange(B, dtype=np.int64), T)
        t = np.tile(np.arange(T, dtype=np.int64), B)
        self.tid = t
        self.block_lin = self.blk + first_block_lin
        tx, ty, tz = t % Dx, (t // Dx) % Dy, t // (Dx * Dy)
        # the threads simulator starts a block's threads in np.ndindex(Dx, Dy, Dz) order: x slowest
        rank_in_block = (tx * Dy + ty) * Dz + tz
        self.rank_of = rank_in_block
        self.rank = None if (Dy == 1 and Dz == 1) else (self.blk * T + rank_in_block)
        bx = np.array([b[0] for b in blocks], np.int64)[self.blk]
        by = np.array([b[1] for b in blocks], np.int64)[self.blk]
        bz = np.array([b[2] for b in blocks], np.int64)[self.blk]

        def lanes(a, bound):
            return V(a, int, max(1, int(bound).bit_length()))

        self.threadIdx = Dim3(lanes(tx, Dx), lanes(ty, Dy) if Dy > 1 else 0, lanes(tz, Dz) if Dz > 1 else 0)
        if B == 1:
            self.blockIdx = Dim3(*blocks[0])
        else:
            gx, gy, gz = self.grid
            self.blockIdx = Dim3(lanes(bx, gx) if gx > 1 else 0, lanes(by, gy) if gy > 1 else 0,
                                 lanes(bz, gz) if gz > 1 else 0)
        self.laneid = lanes(t % 32, 32)
        self.exited = np.zeros(L, bool)
        self.any_exit = False
        self.phase = np.zeros(B, np.int64)
        self.wphase = np.zeros(L, np.int64)
        self.block_state = np.zeros(L, bool)
        # warps: lane -> first lane of its warp, lane index in the warp
        self.warp_base = self.blk * T + (t // 32) * 32
        self.lane_in_warp = t % 32
        self.exists_in_warp = np.minimum(32, T - (t // 32) * 32)    # lanes in this lane's warp
        self._bx, self._by, self._bz = bx, by, bz
        self._tx, self._ty, self._tz = tx, ty, tz

    def lane_name(self, lane):
        """(threadIdx, blockIdx) of a lane, as lists for messages."""
        lane = int(lane)
        return ((int(self._tx[lane]), int(self._ty[lane]), int(self._tz[lane])),
                (int(self._bx[lane]), int(self._by[lane]), int(self._bz[lane])))


# --------------------------------------------------------------------------- checks shared with flashnb.sim.warp


def _check_mask_lanes(name, mask, m, g):
    """The threads simulator's mask checks on every active lane: the mask is an int and names the calling lane."""
    if type(mask) is V:
        if mask.k not in (int,) and mask.k not in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                                   np.uint32, np.uint64):
            lane = first_lane(m)
            raise KernelFault(TypeError(f"cuda.{name}: mask must be an integer, got {mask.k.__name__}"), lane)
        mv = mask.a.astype(np.int64) & FULL_MASK
    else:
        if isinstance(mask, (bool, np.bool_)) or not isinstance(mask, (int, np.integer)):
            raise KernelFault(TypeError(f"cuda.{name}: mask must be an integer, got {type(mask).__name__}"),
                              first_lane(m))
        mv = int(mask) & FULL_MASK
    if type(mv) is not np.ndarray and mv == FULL_MASK:
        return mv                                   # names every lane
    lane = g.lane_in_warp
    named = ((mv >> lane) & 1).astype(bool)
    bad = ~named if m is None else (m & ~named)
    if bad.any():
        l0 = first_lane(bad)
        mm = int(mv[l0]) if type(mv) is np.ndarray else mv
        ti, _ = g.lane_name(l0)
        raise KernelFault(RuntimeError(
            f"cuda.{name}: calling lane {int(lane[l0])} (tid={list(ti)}) is not in mask {mm:#010x}; "
            "CUDA requires every calling lane to name itself in the mask (undefined behaviour otherwise)"), l0)
    return mv


def _check_value(name, value, m):
    k = value.k if type(value) is V else type(value)
    if k in (bool, np.bool_) or not (k in (int, float) or (k in KINDS and k is not np.bool_)):
        raise KernelFault(TypeError(f"cuda.{name} only supports 32- and 64-bit ints and floats, got {k.__name__}"),
                          first_lane(m))


def _check_operand(name, operand, m):
    k = operand.k if type(operand) is V else type(operand)
    if k in (bool, np.bool_) or not (k is int or k in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                                       np.uint32, np.uint64)):
        raise KernelFault(TypeError(f"cuda.{name}: lane operand must be an integer, got {k.__name__}"),
                          first_lane(m))


def _check_predicate(name, p, m):
    k = p.k if type(p) is V else type(p)
    if not (k in (bool, int, np.bool_) or k in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                                 np.uint32, np.uint64)):
        raise KernelFault(TypeError(f"cuda.{name}: predicate must be an integer or a boolean, got {k.__name__}"),
                          first_lane(m))


def _rounds(name, mv, m, g, site=None):
    """The warp rounds of a warp operation: every named, live lane of each calling warp must be active here with
    the same mask (else the lanes diverge: the threads simulator must run it).  Returns the per-lane mask
    (int64 array) of the lanes each lane's round has."""
    L = g.L
    _strict_exited(name, mv, m, g, site)
    if m is None and type(mv) is not np.ndarray and mv == FULL_MASK and not g.any_exit and g.T % 32 == 0:
        return mv                                   # every lane of every warp is here, with the full mask
    if type(mv) is not np.ndarray and mv == FULL_MASK and g.T % 32 == 0:
        W = L // 32
        act = (np.ones(L, bool) if m is None else m).reshape(W, 32)
        need = ~g.exited.reshape(W, 32)
        if (act.any(axis=1) & (act != need).any(axis=1)).any():
            _diverged(name, mv)
        return mv
    active = np.ones(L, bool) if m is None else m
    live = ~g.exited
    masks = mv if type(mv) is np.ndarray else np.full(L, mv, np.int64)
    lane = g.lane_in_warp
    exists = lane < g.exists_in_warp
    bit = np.left_shift(np.int64(1), lane)
    # per warp and mask value: OR of the bits of the active lanes calling with it
    uniq = np.unique(masks[active]) if m is not None else np.unique(masks)
    for M in uniq.tolist():
        with_m = active & (masks == M)
        if g.T % 32 == 0:
            W = L // 32
            arrived = np.bitwise_or.reduce(np.where(with_m, bit, 0).reshape(W, 32), axis=1)
            need = np.bitwise_or.reduce(np.where(live & exists & ((M >> lane) & 1).astype(bool), bit, 0)
                                        .reshape(W, 32), axis=1)
            touched = with_m.reshape(W, 32).any(axis=1)
            if (touched & (arrived != need)).any():
                _diverged(name, M)
        else:
            base = g.warp_base
            arrived = np.zeros(L, np.int64)
            np.bitwise_or.at(arrived, base[with_m], bit[with_m])
            need = np.zeros(L, np.int64)
            nsel = live & exists & ((M >> lane) & 1).astype(bool)
            np.bitwise_or.at(need, base[nsel], bit[nsel])
            touched = np.zeros(L, bool)
            touched[base[with_m]] = True
            if (touched & (arrived != need)).any():
                _diverged(name, M)
    return masks


def _strict_exited(name, mv, m, g, site=None):
    """A mask naming a lane that has returned (``flashnb.sim.fastbarrier.STRICT_EXITED_LANES``, the default):
    synccheck's finding when the sanitizer runs it, else the launch fails with the threads simulator's message
    (warp by warp in block order)."""
    from .. import fastbarrier

    T = tools.cur
    if not g.any_exit or not (fastbarrier.STRICT_EXITED_LANES or T.sync):
        return
    active = np.ones(g.L, bool) if m is None else m
    masks = mv if type(mv) is np.ndarray else np.full(g.L, mv, np.int64)
    lane = g.lane_in_warp
    seen = set()
    for first in lanes_in_order(active & (lane == lane)):
        base = int(g.warp_base[first])
        M = int(masks[first])
        if (base, M) in seen:
            continue
        seen.add((base, M))
        n = int(g.exists_in_warp[first])
        gone = [j for j in range(n) if (M >> j) & 1 and g.exited[base + j]]
        if not gone:
            continue
        warp = int(g.tid[first]) // 32
        if T.sync:
            T.warp_after_exit(site, name, M, g.blocks[int(g.blk[first])], warp, gone)
            continue
        raise KernelFault(RuntimeError(fastbarrier.exited_lanes_message(name, M, warp, gone)), int(first), raw=True)


def _diverged(name, M):
    raise Unsupported(f"cuda.{name}(mask={M:#010x}) reached by only some of the live lanes its mask names "
                      "(a divergent warp operation)")


def _participates(g, masks, src_lane):
    """Whether lane ``src_lane`` (in the warp of each lane) takes part in the round of each lane."""
    if type(masks) is not np.ndarray:
        if masks == FULL_MASK and g.T % 32 == 0:
            glob = g.warp_base + src_lane
            if not g.any_exit:
                return True, glob
            return ~g.exited[glob], glob
        masks = np.full(g.L, masks, np.int64)
    exists = src_lane < g.exists_in_warp
    glob = g.warp_base + np.where(exists, src_lane, 0)
    named = ((masks >> src_lane) & 1).astype(bool)
    return exists & named & ~g.exited[glob], glob


def _poison_of(kind, name, warp_of_lane):
    if kind is float or kind in _FLOAT_KINDS:
        return (kind if kind is not float else float)(math.nan)
    try:
        return (kind if kind is not int else int)(INT_POISON)
    except Exception as exc:
        raise KernelFault(type(exc)(f"{name} in warp {warp_of_lane}: {exc}"), 0, raw=True) from None


# --------------------------------------------------------------------------- atomics


def _int32(bits):
    return np.where(bits >= (1 << 31), bits - (1 << 32), bits)


_ORDER_DEPENDENT = {"add", "sub", "exch", "inc", "dec", "max", "min", "nanmax", "nanmin", "cas"}


def _sim_atomic(op):
    from .._numba_adapter import sim

    FakeCUDAAtomic = sim("kernelapi", "FakeCUDAAtomic")
    return getattr(FakeCUDAAtomic, op)


def apply_deferred(entries):
    """Apply deferred atomics in the threads simulator's order: (block, barrier phase, thread, program order)."""
    by_root: dict = {}
    for e in entries:
        by_root.setdefault(id(e[0]), []).append(e)
    for group in by_root.values():
        base = group[0][1]
        op = group[0][2]
        flats = np.concatenate([e[3] for e in group])
        vals = np.concatenate([e[4] for e in group])
        keys = np.concatenate([e[5] for e in group], axis=1)   # (block, phase, rank, seq) rows
        order = _order(keys)
        flats, vals = flats[order], vals[order]
        if op == "add":
            np.add.at(base, flats, vals)
        elif op == "sub":
            np.subtract.at(base, flats, vals)
        else:   # pragma: no cover
            raise AssertionError(op)


_I32 = 1 << 31


def _order(keys):
    """The order of the rows' lexicographic keys (first row most significant): one stable argsort of the keys
    packed into an int64 when their ranges fit 63 bits (they do for every launch of a chunk), else a lexsort."""
    lo = keys.min(axis=1)
    span = keys.max(axis=1) - lo
    bits = [int(s).bit_length() for s in span.tolist()]
    if sum(bits) > 63:
        return np.lexsort(keys[::-1])
    packed = np.zeros(keys.shape[1], np.int64)
    for row, b, low in zip(keys, bits, lo.tolist()):
        if b:
            packed <<= b
            packed |= row.astype(np.int64) - low
    return np.argsort(packed, kind="stable")


class _Atomic:
    """``cuda.atomic``: each function on the active lanes (see the module docstring for the order)."""

    def __init__(self, cuda):
        self._cuda = cuda

    def _op(self, op, m, site, used, array, index, *vals):
        T = tools.cur
        T.site = site
        g = self._cuda.geo
        if isinstance(array, Local):
            raise Unsupported("an atomic on a local array")
        if not isinstance(array, Arr):
            if is_lanes(index) or any(is_lanes(v) for v in vals):
                raise Unsupported(f"an atomic on a {type(array).__name__}")
            return _sim_atomic(op)(None, array, index, *vals)
        r = resolve(array, index, m, "a")
        if type(r) is tuple:
            raise Unsupported("an atomic on a sub-array")
        if array.memory == "global":
            T.before_write(array.root)
        if T.active:
            T.access(array, "a", r, m, site, index if type(index) is tuple else (index,))
        lanes = lanes_in_order(m)
        flat = r[lanes] if type(r) is np.ndarray else np.full(len(lanes), r, np.int64)
        base = array.base
        dt = array.dtype
        if op in ("add", "sub") and not used and dt.kind == "f":
            v = vals[0]
            k = v.k if type(v) is V else type(v)
            rk = _np_result(op, dt, k)
            if rk is dt.type:
                vv = _convert(v, dt, m)
                va = vv[lanes] if type(vv) is np.ndarray else np.full(len(lanes), vv, dt)
                keys = np.stack([g.block_lin[lanes], g.phase[g.blk[lanes]], g.rank_of[lanes],
                                 np.full(len(lanes), T.seq, np.int64)])
                if T.seq < _I32 and keys.size and keys.max() < _I32:
                    keys = keys.astype(np.int32)          # 16 bytes an atomic, until its chunk ends
                T.seq += 1
                T.defer_atomic((array.root, base, op, flat, va, keys))
                return None
        if T.pending_atomics:
            T.flush_atomics(array)
        if op in ("add", "sub", "and_", "or_", "xor") and not used and dt.kind in "iu":
            v = vals[0]
            k = v.k if type(v) is V else type(v)
            rk = _np_result("add", dt, k)
            if rk is dt.type:
                vv = _convert(v, dt, m)
                va = vv[lanes] if type(vv) is np.ndarray else np.full(len(lanes), vv, dt)
                {"add": np.add, "sub": np.subtract, "and_": np.bitwise_and, "or_": np.bitwise_or,
                 "xor": np.bitwise_xor}[op].at(base, flat, va)
                return None
        # the general case: one lane after another, with the threads simulator's own implementation
        fn = _sim_atomic(op)
        olds = []
        view = base
        for j, lane in enumerate(lanes.tolist()):
            args = [scalar_at(v, lane) for v in vals]
            try:
                if op == "compare_and_swap":
                    olds.append(fn(None, view[int(flat[j]):int(flat[j]) + 1], *args))
                else:
                    olds.append(fn(None, view, int(flat[j]), *args))
            except Exception as exc:
                raise KernelFault(exc, lane) from None
        if not used:
            return None
        from .values import assemble
        return assemble(olds, lanes)

    def _make(op, nvals=1):
        @lane_aware
        def f(self, m, site, array, index, *vals, _used=True):
            return self._op(op, m, site, _used, array, index, *vals)
        f.__name__ = op
        f._atomic = True
        return f

    add = _make("add")
    sub = _make("sub")
    and_ = _make("and_")
    or_ = _make("or_")
    xor = _make("xor")
    inc = _make("inc")
    dec = _make("dec")
    exch = _make("exch")
    max = _make("max")
    min = _make("min")
    nanmax = _make("nanmax")
    nanmin = _make("nanmin")
    cas = _make("cas", 2)

    @lane_aware
    def compare_and_swap(self, m, site, array, old, val, _used=True):
        if isinstance(array, Arr):
            return self._op("compare_and_swap", m, site, _used, array, (0,) * array.ndim, old, val)
        return _sim_atomic("compare_and_swap")(None, array, old, val)

    compare_and_swap._atomic = True


def _np_result(op, dt, k):
    """The type of ``array[i] op= value`` on the threads simulator (its atomics are NumPy's in-place operators,
    NumPy's scalar rules), or None when ``k`` is not a number kind."""
    if k not in KINDS:
        return None
    with np.errstate(all="ignore"):
        try:
            x = dt.type(1)
            return type(x - _sample_of(k) if op == "sub" else x + _sample_of(k))
        except Exception:
            return None


def _sample_of(k):
    from .values import _sample
    return _sample(k)


def _convert(v, dt, m):
    from .arrays import convert_for_store
    return convert_for_store(v, dt, m)


# --------------------------------------------------------------------------- shared, local, const


class _Shared:
    def __init__(self, cuda):
        self._cuda = cuda
        self._alloc = {}

    @lane_aware
    def array(self, m, site, shape, dtype, alignment=None):
        from numba.cuda import types as nbt
        from numba.cuda.np import numpy_support

        g = self._cuda.geo
        if alignment is not None:
            raise KernelFault(RuntimeError("Array alignment is not supported in cudasim"), first_lane(m))
        if is_lanes(shape):
            raise Unsupported("a shared array whose shape differs per lane")
        if isinstance(dtype, nbt.Type):
            dtype = numpy_support.as_dtype(dtype)
        dtype = np.dtype(dtype)
        filename, line = tools.site_file_line(site)
        name = self._cuda.shared_name(filename, line)
        dynamic = not isinstance(shape, tuple) and shape == 0
        key = (filename, line, dynamic, dtype.str if dynamic else None)
        arr = self._alloc.get(key)
        if arr is not None:
            return arr
        B = g.B
        if dynamic:
            # one buffer of bytes per block; every dynamic array of the kernel is a view of it (they alias, as
            # in the simulator)
            nbytes = self._cuda.dynshared
            store = self._alloc.get(("dyn-bytes",))
            if store is None:
                store = self._alloc[("dyn-bytes",)] = np.zeros((B, nbytes), np.uint8)
            count = nbytes // dtype.itemsize
            if count * dtype.itemsize != nbytes:
                raise Unsupported("dynamic shared memory that is not a whole number of elements of its type")
            root = store
            per = count
            base = store.reshape(-1).view(dtype)
            shp = (count,)
        else:
            shp = tuple(int(s) for s in (shape if isinstance(shape, tuple) else (shape,)))
            per = 1
            for s in shp:
                per *= s
            root = np.empty((B,) + shp, dtype)
            base = root.reshape(-1)
        st = []
        n = 1
        for s in reversed(shp):
            st.append(n)
            n *= s
        off = 0 if B == 1 else g.blk * per
        arr = Arr(base, off, shp, tuple(reversed(st)), "shared", name, (), root, False, per)
        arr.root_off = 0
        self._alloc[key] = arr
        return arr


class _LocalNS:
    def __init__(self, cuda):
        self._cuda = cuda

    @lane_aware
    def array(self, m, site, shape, dtype, alignment=None):
        from numba.cuda import types as nbt
        from numba.cuda.np import numpy_support

        if alignment is not None:
            raise KernelFault(RuntimeError("Array alignment is not supported in cudasim"), first_lane(m))
        if is_lanes(shape):
            raise Unsupported("a local array whose shape differs per lane")
        if isinstance(dtype, nbt.Type):
            dtype = numpy_support.as_dtype(dtype)
        filename, line = tools.site_file_line(site)
        shp = shape if isinstance(shape, tuple) else (shape,)
        return Local(shp, dtype, self._cuda.shared_name(filename, line))


class _Const:
    def array_like(self, ary):
        return ary


class _Cg:
    def this_grid(self):
        raise Unsupported("cooperative groups (cuda.cg)")


class _Fp16:
    """``cuda.fp16``: the simulator's definitions (a + b, ...), per lane."""

    def __init__(self):
        from .._numba_adapter import sim

        FakeCUDAFp16 = sim("kernelapi", "FakeCUDAFp16")
        self._sim = FakeCUDAFp16()

    def __getattr__(self, name):
        fn = getattr(self._sim, name)

        @lane_aware
        def per_lane(m, site, *args):
            from .values import scalarise
            if not any(is_lanes(a) for a in args):
                return fn(*args)
            return scalarise(fn, args, m)
        return per_lane


# --------------------------------------------------------------------------- the module


class VectorCuda:
    """What ``cuda`` is inside a kernel in the vectorised simulator (the counterpart of the simulator's
    ``FakeCUDAModule``)."""

    warpsize = 32

    def __init__(self, grid, block, dynshared, shared_name):
        from .._numba_adapter import sim

        SimDim3 = sim("kernelapi", "Dim3")

        self.gridDim = SimDim3(*grid)
        self.blockDim = SimDim3(*block)
        self.dynshared = dynshared
        self.shared_name = shared_name
        self.geo = None
        self.atomic = _Atomic(self)
        self.shared = _Shared(self)
        self.local = _LocalNS(self)
        self.const = _Const()
        self.cg = _Cg()
        self.fp16 = _Fp16()

    def new_chunk(self, geo):
        self.geo = geo
        self.shared = _Shared(self)

    @property
    def threadIdx(self):
        return self.geo.threadIdx

    @property
    def blockIdx(self):
        return self.geo.blockIdx

    @property
    def laneid(self):
        return self.geo.laneid

    # -- barriers
    @lane_aware
    def syncthreads(self, m, site):
        g = self.geo
        T = tools.cur
        active = np.ones(g.L, bool) if m is None else m
        act = active.reshape(g.B, g.T)
        live = ~g.exited.reshape(g.B, g.T)
        some = act.any(axis=1)
        if (some & (act != live).any(axis=1)).any():
            raise Unsupported("syncthreads() reached by only some of a block's live threads")
        if T.sync:
            gone = some & ~live.all(axis=1)
            if gone.any():
                T.barrier_after_exit(site, [(g.blocks[b], np.flatnonzero(~live[b]).tolist())
                                            for b in np.flatnonzero(gone).tolist()])
        g.phase[some] += 1
        return None

    def _sync_reduce(self, m, site, value, how):
        g = self.geo
        if is_lanes(value) or True:
            t = truth(value)
            st = g.block_state
            if m is None:
                st[:] = t
            else:
                st[m] = t[m] if type(t) is np.ndarray else t
        self.syncthreads(m, site)
        per_block = st.reshape(g.B, g.T)
        if how == "count":
            res = np.count_nonzero(per_block, axis=1)
        elif how == "and":
            res = per_block.all(axis=1).astype(np.int64)
        else:
            res = per_block.any(axis=1).astype(np.int64)
        self.syncthreads(m, site)
        if g.B == 1:
            return int(res[0])
        return make(res[g.blk], int)

    @lane_aware
    def syncthreads_count(self, m, site, value):
        return self._sync_reduce(m, site, value, "count")

    @lane_aware
    def syncthreads_and(self, m, site, value):
        return self._sync_reduce(m, site, value, "and")

    @lane_aware
    def syncthreads_or(self, m, site, value):
        return self._sync_reduce(m, site, value, "or")

    def threadfence(self):
        pass

    def threadfence_block(self):
        pass

    def threadfence_system(self):
        pass

    # -- warp operations
    @lane_aware
    def syncwarp(self, m, site, mask=FULL_MASK):
        g = self.geo
        mv = _check_mask_lanes("syncwarp", mask, m, g)
        _rounds("syncwarp", mv, m, g, site)
        if m is None:
            g.wphase += 1
        else:
            g.wphase[m] += 1

    def _shuffle(self, name, mode, m, mask, value, operand, site=None):
        g = self.geo
        mask, operand = collapse_int(mask), collapse_int(operand)
        if type(value) is Mixed:
            raise Unsupported(f"cuda.{name} of values of different types in different lanes")
        mv = _check_mask_lanes(name, mask, m, g)
        _check_value(name, value, m)
        _check_operand(name, operand, m)
        masks = _rounds(name, mv, m, g, site)
        lane = g.lane_in_warp
        b = (operand.a.astype(np.int64) if type(operand) is V else int(operand)) & 31
        if mode == "idx":
            j = np.broadcast_to(b, lane.shape) if type(b) is not np.ndarray else b
        elif mode == "up":
            j = np.where(lane - b >= 0, lane - b, lane)
        elif mode == "down":
            j = np.where(lane + b <= 31, lane + b, lane)
        else:
            j = lane ^ b
        ok, src = _participates(g, masks, j)
        k = value.k if type(value) is V else type(value)
        got = value.a[src] if type(value) is V else None
        if ok is True:
            return value if got is None else V(got, k, value.bits)
        act_ok = ok if m is None else (ok | ~m)
        if act_ok.all():
            if got is None:
                return value
            return V(got, k, value.bits)
        bad_lane = first_lane(~ok if m is None else (~ok & m))
        poison = _poison_of(k, name, int(g.tid[bad_lane] // 32))
        if got is None:
            got = np.full(g.L, value, dtype_of(k))
        return V(np.where(ok, got, np.asarray(poison, dtype_of(k))), k,
                 max(value.bits or 0, 30) if k is int else None)

    @lane_aware
    def shfl_sync(self, m, site, mask, value, src_lane):
        return self._shuffle("shfl_sync", "idx", m, mask, value, src_lane, site)

    @lane_aware
    def shfl_up_sync(self, m, site, mask, value, delta):
        return self._shuffle("shfl_up_sync", "up", m, mask, value, delta, site)

    @lane_aware
    def shfl_down_sync(self, m, site, mask, value, delta):
        return self._shuffle("shfl_down_sync", "down", m, mask, value, delta, site)

    @lane_aware
    def shfl_xor_sync(self, m, site, mask, value, lane_mask):
        return self._shuffle("shfl_xor_sync", "bfly", m, mask, value, lane_mask, site)

    def _round_bits(self, g, masks, pred_bits, m):
        """Per lane: OR over the lanes of its round (its warp, its mask) of ``pred_bits``."""
        if type(masks) is not np.ndarray:
            masks = np.full(g.L, masks, np.int64)
        active = np.ones(g.L, bool) if m is None else m
        out = np.zeros(g.L, np.int64)
        for M in np.unique(masks[active]).tolist():
            sel = active & (masks == M)
            acc = np.zeros(g.L, np.int64)
            np.bitwise_or.at(acc, g.warp_base[sel], pred_bits[sel])
            out = np.where(sel, acc[g.warp_base], out)
        return out

    def _vote(self, name, m, mask, predicate, site=None):
        g = self.geo
        mv = _check_mask_lanes(name, mask, m, g)
        _check_predicate(name, predicate, m)
        masks = _rounds(name, mv, m, g, site)
        t = truth(predicate)
        t = np.full(g.L, t) if type(t) is bool else t
        bit = np.left_shift(np.int64(1), g.lane_in_warp)
        yes = self._round_bits(g, masks, np.where(t, bit, 0), m)
        member = self._round_bits(g, masks, bit, m)
        return yes, member

    @lane_aware
    def ballot_sync(self, m, site, mask, predicate):
        yes, _ = self._vote("ballot_sync", m, mask, predicate, site)
        return V(_int32(yes), int, 32)

    @lane_aware
    def all_sync(self, m, site, mask, predicate):
        yes, member = self._vote("all_sync", m, mask, predicate, site)
        return V(yes == member, bool)

    @lane_aware
    def any_sync(self, m, site, mask, predicate):
        yes, _ = self._vote("any_sync", m, mask, predicate, site)
        return V(yes != 0, bool)

    @lane_aware
    def eq_sync(self, m, site, mask, predicate):
        yes, member = self._vote("eq_sync", m, mask, predicate, site)
        return V((yes == member) | (yes == 0), bool)

    def _match(self, name, m, mask, value, site=None):
        g = self.geo
        mv = _check_mask_lanes(name, mask, m, g)
        _check_value(name, value, m)
        masks = _rounds(name, mv, m, g, site)
        if type(masks) is not np.ndarray:
            masks = np.full(g.L, masks, np.int64)
        k = value.k if type(value) is V else type(value)
        a = value.a if type(value) is V else np.full(g.L, value, dtype_of(k))
        keyv = a.view(np.dtype(f"u{a.dtype.itemsize}")).astype(np.uint64)
        active = np.ones(g.L, bool) if m is None else m
        bit = np.left_shift(np.int64(1), g.lane_in_warp)
        out = np.zeros(g.L, np.int64)
        member = self._round_bits(g, masks, bit, m)
        # lanes of one round with equal bits: group by (warp, mask, value)
        for M in np.unique(masks[active]).tolist():
            sel = np.flatnonzero(active & (masks == M))
            keys = np.stack([g.warp_base[sel], keyv[sel].view(np.int64)])
            _, inv = np.unique(keys, axis=1, return_inverse=True)
            inv = inv.reshape(-1)
            acc = np.zeros(inv.max() + 1 if inv.size else 1, np.int64)
            np.bitwise_or.at(acc, inv, bit[sel])
            out[sel] = acc[inv]
        return out, member

    @lane_aware
    def match_any_sync(self, m, site, mask, value):
        out, _ = self._match("match_any_sync", m, mask, value, site)
        return V(_int32(out), int, 32)

    @lane_aware
    def match_all_sync(self, m, site, mask, value):
        out, member = self._match("match_all_sync", m, mask, value, site)
        same = out == member
        masks = _check_mask_lanes("match_all_sync", mask, m, self.geo)
        mm = masks if type(masks) is np.ndarray else np.full(self.geo.L, masks, np.int64)
        return (V(np.where(same, _int32(mm), 0), int, 32), V(same, bool))

    @lane_aware
    def activemask(self, m, site):
        g = self.geo
        n = g.exists_in_warp
        if (n == 32).all():
            return (1 << 32) - 1
        return V((np.left_shift(np.int64(1), n) - 1), int, 33)

    @lane_aware
    def lanemask_lt(self, m, site):
        g = self.geo
        return V(np.left_shift(np.int64(1), g.lane_in_warp) - 1, int, 32)

    @lane_aware
    def nanosleep(self, m, site, ns):
        def check(v):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < 2 ** 32:
                raise TypeError(f"cuda.nanosleep takes a uint32 number of nanoseconds, got {v!r}")
        if type(ns) is V:
            from .values import scalarise
            scalarise(check, (ns,), m)
        else:
            try:
                check(ns)
            except TypeError as exc:
                raise KernelFault(exc, first_lane(m)) from None

    # -- arithmetic helpers of the simulator
    @lane_aware
    def fma(self, m, site, a, b, c):
        return BINOPS["add"](BINOPS["mul"](a, b, m), c, m)

    @lane_aware
    def selp(self, m, site, a, b, c):
        t = truth(a)
        if type(t) is bool:
            return b if t else c
        return merge(t, b, c)

    def _sim_fn(name):
        @lane_aware
        def f(self, m, site, *args):
            from .._numba_adapter import sim

            FakeCUDAModule = sim("kernelapi", "FakeCUDAModule")

            fn = getattr(FakeCUDAModule, name)
            if not any(is_lanes(a) for a in args):
                return fn(self, *args)
            from .values import scalarise
            return scalarise(lambda *a: fn(self, *a), args, m)
        f.__name__ = name
        return f

    popc = _sim_fn("popc")
    brev = _sim_fn("brev")
    clz = _sim_fn("clz")
    ffs = _sim_fn("ffs")
    cbrt = _sim_fn("cbrt")

    @lane_aware
    def grid(self, m, site, n):
        bdim, bid, tid = self.blockDim, self.blockIdx, self.threadIdx
        add, mul = BINOPS["add"], BINOPS["mul"]
        x = add(mul(bid.x, bdim.x, m), tid.x, m)
        if n == 1:
            return x
        y = add(mul(bid.y, bdim.y, m), tid.y, m)
        if n == 2:
            return (x, y)
        z = add(mul(bid.z, bdim.z, m), tid.z, m)
        if n == 3:
            return (x, y, z)
        raise KernelFault(RuntimeError("Global ID has 1-3 dimensions. %d requested" % n), first_lane(m))

    def gridsize(self, n):
        bdim = self.blockDim
        gdim = self.gridDim
        x = bdim.x * gdim.x
        if n == 1:
            return x
        y = bdim.y * gdim.y
        if n == 2:
            return (x, y)
        z = bdim.z * gdim.z
        if n == 3:
            return (x, y, z)
        raise RuntimeError("Global grid has 1-3 dimensions. %d requested" % n)

    def __getattr__(self, name):
        # vector types (cuda.float32x4 ...) and anything else the simulator's module has but lanes cannot run
        raise Unsupported(f"cuda.{name}")
