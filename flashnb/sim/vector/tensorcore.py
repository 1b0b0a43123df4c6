"""The tensor-core twins on the vectorised simulator: ``mma.sync``, ``ldmatrix``, ``cp.async`` and the conversions
for every warp of a chunk at once.

:mod:`flashnb.sim.tensorcore` defines each instruction twice over: a NumPy core that takes the 32 lanes' registers
of any number of warps, shape ``(..., 32, regs)``, and a warp collective of the threads simulator that hands it one
warp.  Here the lanes' registers already are vectors (lanes are laid out warp after warp, 32 consecutive lanes a
warp, :mod:`.warp`), so a call reshapes them to ``(warps, 32, regs)``, runs the same core once for every warp
that executes the instruction, and hands each lane its own registers back -- the shuffles of :mod:`.warp` in
the same way.  What each instruction reads and writes goes through the lanes' arrays (:mod:`.arrays`), so the
traffic counter, memcheck, initcheck, racecheck and the profiler see exactly the accesses the threads twins
make, element by element, named by the kernel line:

* ``ldmatrix``: lane ``l`` of the first 8, 16 or 32 lanes reads the 16 bytes its address names; the profiler
  groups the reads into one request per 8×8 matrix (the k-th call of each lane at that line, matrix ``l // 8``);
* ``cp.async``: a copy is recorded when a lane issues it (its group: the lane's commits so far) and lands when
  that lane reaches a ``cp.async.wait_group`` covering the group -- the source read, the destination written,
  by the issuing line, as one profiler request of the warp's copies -- so a missing wait leaves shared memory
  unwritten (initcheck) and a missing barrier after the wait leaves the copy unordered against the other
  threads' reads (racecheck);
* ``mma.sync`` and the conversions touch no memory.

The instructions are ``.sync.aligned``: every lane of a warp executes them together.  A warp that reaches one with
only some of its lanes (the others returned early or took another branch), or a block whose last warp is
partial, cannot run in lockstep: the launch goes to the threads simulator, whose twin reports the misuse.  Errors
the threads twins raise (a misaligned address, a bad byte count, ...) are raised here with their messages, for the
first lane in the threads simulator's start order.  A float exception an instruction raises on an active lane is
re-run on that lane's scalars (warned or raised under the caller's NumPy settings, as the threads simulator does).
"""

from __future__ import annotations

import numpy as np

from .. import tensorcore as tc
from ..fallback import KernelFault, Unsupported
from . import arrays, tools
from .arrays import Arr
from .values import _FPE, Mixed, Partial, V, _replay_fp, first_lane, lanes_in_order, make, now, scalar_at, scalarise

__all__ = ["twin_of", "TWINS"]

_INT_KINDS = frozenset((int, bool, np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                        np.uint64))
_FLOAT_KINDS = frozenset((float, np.float16, np.float32, np.float64))

#: Profiler request ids of the twins' accesses (negative: apart from the k-th-access ids of ordinary lines).
_LDMATRIX_REQUEST, _CP_ASYNC_REQUEST = -1, -(1 << 40)


# --------------------------------------------------------------------------- lanes, warps and per-chunk state


def _warps(name, m):
    """The warps executing the instruction: None (every lane of the chunk) or the indices of the warps whose 32
    lanes are all active.  Unsupported when a warp is here with only some of its lanes."""
    g = tools.cur.geo
    if g.T % 32:
        raise Unsupported(f"{name} in a block of {g.T} threads (its last warp is partial; the instruction needs "
                          "all 32 lanes)")
    if m is None:
        return None
    act = m.reshape(-1, 32)
    full = act.all(axis=1)
    if (act.any(axis=1) & ~full).any():
        raise Unsupported(f"{name} reached by only some lanes of a warp (a .sync.aligned instruction)")
    return np.flatnonzero(full)


def _per_warp(a, warps):
    """Lane array ``a`` (L, ...) as (warps, 32, ...) of the executing warps."""
    w = a.reshape((-1, 32) + a.shape[1:])
    return w if warps is None else w[warps]


def _scatter(regs, warps):
    """(warps, 32, R) results of the executing warps as R lane arrays over the chunk (zeros elsewhere)."""
    if warps is None:
        flat = regs.reshape(-1, regs.shape[-1])
    else:
        full = np.zeros((now.L // 32,) + regs.shape[1:], regs.dtype)
        full[warps] = regs
        flat = full.reshape(-1, regs.shape[-1])
    return [np.ascontiguousarray(flat[:, j]) for j in range(flat.shape[1])]


def _plain(x):
    return x.value if type(x) is Partial else x


def _u32(name, x):
    """A register operand as uint32 lanes (or one uint32): ``np.uint32(int(x) & 0xFFFFFFFF)`` per lane, as the
    threads twin converts it."""
    x = _plain(x)
    t = type(x)
    if t is Mixed:
        raise Unsupported(f"{name}: register operands of different types in different lanes")
    if t is V:
        if x.k is np.uint32:
            return x.a
        if x.k in _INT_KINDS:
            return (x.a.astype(np.int64) & 0xFFFFFFFF).astype(np.uint32)
        raise Unsupported(f"{name}: a {x.k.__name__} register operand per lane")
    try:
        return np.uint32(int(x) & 0xFFFFFFFF)
    except Exception as exc:
        raise KernelFault(exc, first_lane(None)) from None


def _f32(name, x):
    """An accumulator operand as float32 lanes (or one float32): ``np.float32(x)``."""
    x = _plain(x)
    t = type(x)
    if t is V:
        if x.k is np.float32:
            return x.a
        if x.k in _FLOAT_KINDS:
            with np.errstate(all="ignore"):
                return x.a.astype(np.float32)
        raise Unsupported(f"{name}: a {x.k.__name__} accumulator operand per lane")
    if t is Mixed:
        raise Unsupported(f"{name}: accumulator operands of different types in different lanes")
    try:
        return np.float32(x)
    except Exception as exc:
        raise KernelFault(exc, first_lane(None)) from None


def _ints(name, x):
    """An index, a byte count or a group count as int64 lanes (or one int)."""
    x = _plain(x)
    t = type(x)
    if t is Mixed:
        from .values import collapse_int

        x, t = collapse_int(x), V
    if t is V:
        if x.k not in _INT_KINDS:
            raise Unsupported(f"{name}: a {x.k.__name__} index per lane")
        return x.a.astype(np.int64)
    if isinstance(x, (int, np.integer)):
        return int(x)
    raise Unsupported(f"{name}: an index of type {t.__name__}")


def _lanes(x, dtype=np.int64):
    """``x`` (lanes or one value) as an array over the chunk's lanes."""
    return x if isinstance(x, np.ndarray) and x.ndim == 1 else np.full(now.L, x, dtype)


def _mask(m):
    return np.ones(now.L, bool) if m is None else m


class _State:
    """The twins' per-chunk, per-lane state: each lane's call counts per (instruction, line) -- the threads twins'
    per-thread sequence numbers -- its commits so far, and the copies issued and not landed."""

    def __init__(self, L):
        self.seq: dict = {}
        self.commits = np.zeros(L, np.int64)
        self.copies: list = []


def _state() -> _State:
    T = tools.cur
    st = T.tc
    if st is None:
        st = T.tc = _State(now.L)
    return st


def _next_seq(key, m):
    """Each active lane's count of earlier calls of ``key`` (then counted)."""
    st = _state()
    c = st.seq.get(key)
    if c is None:
        c = st.seq[key] = np.zeros(now.L, np.int64)
    k = c.copy()
    if m is None:
        c += 1
    else:
        c[m] += 1
    return k


def _byte_offsets(arr, flat):
    """Byte offset of flat element ``flat`` (lanes) of ``arr`` from the start of its allocation (shared: the
    block's array), as the threads twins measure alignment."""
    g = tools.cur.geo
    if arr.memory == "shared":
        return (flat - g.blk * arr.per_block) * arr.dtype.itemsize
    return flat * arr.dtype.itemsize + arr.root_off


def _flat(arr, comps):
    """Flat element index (lanes) of ``arr[comps]`` without bounds checks (the accesses check them)."""
    flat = _lanes(arr.off)
    for c, st in zip(comps, arr.st):
        flat = flat + _lanes(c) * st
    return flat


def _guarded(run, replay_lanes, replay):
    """``run()`` under the launch's float-exception settings; if it raised a flag, ``replay(lane)`` on each of
    ``replay_lanes()`` (start order) under the caller's settings: its warnings and errors are the kernel's."""
    _FPE[0] = False
    out = run()
    if _FPE[0]:
        _FPE[0] = False
        _replay_fp(replay_lanes(), replay)
    return out


# --------------------------------------------------------------------------- mma.sync


def _make_mma(fn, shape, na, nb):
    name = fn.__name__

    def twin(m, site, *args):
        if len(args) != na + nb + 4:
            raise Unsupported(f"{name} called with {len(args)} arguments")
        warps = _warps(name, m)
        L = now.L
        regs = [np.broadcast_to(_u32(name, x), (L,)) for x in args[:na + nb]]
        accs = [np.broadcast_to(_f32(name, x), (L,)) for x in args[na + nb:]]
        A = _per_warp(np.stack(regs[:na], axis=-1), warps)
        B = _per_warp(np.stack(regs[na:], axis=-1), warps)
        C = _per_warp(np.stack(accs, axis=-1), warps)

        def one_warp(lane):
            w = int(lane) // 32 if warps is None else int(np.flatnonzero(warps == int(lane) // 32)[0])
            tc.mma_core(shape, A[w], B[w], C[w])

        def first_lanes():
            ws = np.arange(L // 32) if warps is None else warps
            return lanes_in_order(np.isin(np.arange(L) // 32, ws) & (tools.cur.geo.lane_in_warp == 0))

        D = _guarded(lambda: tc.mma_core(shape, A, B, C), first_lanes, one_warp)
        return tuple(V(d, np.float32) for d in _scatter(D, warps))

    twin.__name__ = name
    return twin


# --------------------------------------------------------------------------- ldmatrix


def _make_ldmatrix(fn, num, trans):
    name = fn.__name__

    def twin(m, site, arr, idx):
        warps = _warps(name, m)
        if type(arr) is not Arr or len(arr.shape) != 1:
            raise Unsupported(f"{name} of a {type(arr).__name__} that is not a 1-D shared or global array")
        if type(idx) is tuple:
            raise Unsupported(f"{name} with a tuple index")
        T = tools.cur
        g = T.geo
        i = _lanes(_ints(name, idx))
        k = _next_seq(("ldmatrix", site), m)
        reads = g.lane_in_warp < 8 * num          # lanes 8j .. 8j+7 give the rows of matrix j
        if m is not None:
            reads = reads & m
        if arr.dtype.itemsize not in (2, 4):
            raise KernelFault(tc.TensorCoreError(tc.ldmatrix_dtype_message(name, arr.dtype)), first_lane(reads))
        off = _byte_offsets(arr, _flat(arr, (i,)))
        bad = reads & (off % 16 != 0)
        if bad.any():
            lane = first_lane(bad)
            raise KernelFault(tc.TensorCoreError(tc.ldmatrix_alignment_message(
                name, int(g.lane_in_warp[lane]), int(i[lane]), int(off[lane]))), lane)
        n = 16 // arr.dtype.itemsize
        T.request = _LDMATRIX_REQUEST - (4 * k + g.lane_in_warp // 8)
        try:
            vals = []
            for e in range(n):
                v = arrays.load(arr, make(i + e, int), reads, site)
                vals.append(v.a if type(v) is V else np.full(now.L, v, arr.dtype))
        finally:
            T.request = None
        rows = np.stack(vals, axis=-1).view(np.uint16)          # (L, 8): each lane's 16 bytes as b16
        regs = tc.ldmatrix_core(_per_warp(rows, warps), num, trans)
        out = [V(r, np.uint32) for r in _scatter(regs, warps)]
        return out[0] if num == 1 else tuple(out)

    twin.__name__ = name
    return twin


# --------------------------------------------------------------------------- cp.async


class _Copy:
    """The copies one ``cp_async_16`` call issued: on the lanes ``issued`` (those not ``landed`` yet are in
    flight), each lane's destination, source, byte count, group and sequence number."""

    __slots__ = ("issued", "landed", "dst", "di", "src", "sidx", "nbytes", "site", "seq", "group")

    def __init__(self, issued, dst, di, src, sidx, nbytes, site, seq, group):
        self.issued, self.landed = issued, np.zeros(now.L, bool)
        self.dst, self.di, self.src, self.sidx, self.nbytes = dst, di, src, sidx, nbytes
        self.site, self.seq, self.group = site, seq, group

    def land(self, lanes):
        """Read the source and write the destination on ``lanes``, named by the issuing line (the threads twin's
        ``_Copy.land``, every lane at once)."""
        T = tools.cur
        L = now.L
        src, dst = self.src, self.dst
        ss, ds = src.dtype.itemsize, dst.dtype.itemsize
        n_src = self.nbytes // ss
        raw = np.zeros((L, 16), np.uint8)
        head = tuple(make(c, int) for c in self.sidx[:-1])
        T.request = _CP_ASYNC_REQUEST - self.seq
        try:
            for e in range(int(n_src[lanes].max())):
                me = lanes & (n_src > e)
                v = arrays.load(src, head + (make(self.sidx[-1] + e, int),), me, self.site)
                a = v.a if type(v) is V else np.full(L, v, src.dtype)
                raw[:, e * ss:(e + 1) * ss] = np.where(me[:, None], a.view(np.uint8).reshape(L, ss), 0)
            out = raw.view(dst.dtype)                           # zero-filled beyond each lane's nbytes
            for e in range(16 // ds):
                arrays.store(dst, make(self.di + e, int), V(np.ascontiguousarray(out[:, e]), dst.dtype.type),
                             lanes, self.site)
        finally:
            T.request = None
        self.landed |= lanes


def cp_async_16(m, site, dst, di, src, sidx, nbytes):
    name = "cp_async_16"
    if type(dst) is not Arr or type(src) is not Arr:
        raise Unsupported(f"{name} between a {type(src).__name__} and a {type(dst).__name__}")
    comps = tuple(_lanes(_ints(name, c)) for c in (sidx if type(sidx) is tuple else (sidx,)))
    d = _lanes(_ints(name, di))
    nb = _lanes(_ints(name, nbytes))
    sdt, ddt = src.dtype, dst.dtype
    act = _mask(m)
    # the threads twin's checks, in its order: the first failing one of the first lane that fails any
    checks = [(~((nb >= 0) & (nb <= 16)) | (nb % sdt.itemsize != 0),
               lambda ln: tc.cp_async_nbytes_message(sdt.itemsize, int(nb[ln]))),
              (np.full(now.L, 16 % ddt.itemsize != 0),
               lambda ln: tc.cp_async_elements_message(ddt.itemsize))]
    if len(dst.shape) != 1:
        checks.append((np.ones(now.L, bool), lambda ln: tc.index_message((int(d[ln]),), len(dst.shape))))
    else:
        off = _byte_offsets(dst, _flat(dst, (d,)))
        checks.append((off % 16 != 0, lambda ln: tc.cp_async_alignment_message("shared destination", int(d[ln]),
                                                                               int(off[ln]))))
    if len(comps) != len(src.shape):
        checks.append((np.ones(now.L, bool),
                       lambda ln: tc.index_message(tuple(int(c[ln]) for c in comps), len(src.shape))))
    else:
        soff = _byte_offsets(src, _flat(src, comps))
        checks.append((soff % 16 != 0, lambda ln: tc.cp_async_alignment_message(
            "global source", tuple(int(c[ln]) for c in comps), int(soff[ln]))))
    bad = np.zeros(now.L, bool)
    for b, _ in checks:
        bad |= b
    bad &= act
    if bad.any():
        lane = first_lane(bad)
        message = next(msg for b, msg in checks if b[lane])
        raise KernelFault(tc.TensorCoreError(message(lane)), lane)
    st = _state()
    st.copies.append(_Copy(act.copy(), dst, d, src, comps, nb, site, _next_seq(("cp.async", site), m),
                           st.commits.copy()))


def cp_async_commit(m, site):
    st = _state()
    if m is None:
        st.commits += 1
    else:
        st.commits[m] += 1


def cp_async_wait_group(m, site, n):
    name = "cp_async_wait_group"
    n = _ints(name, n)
    if isinstance(n, np.ndarray):
        neg = (n < 0) & _mask(m)
        if neg.any():
            lane = first_lane(neg)
            raise KernelFault(tc.TensorCoreError(tc.wait_group_message(int(n[lane]))), lane)
    elif n < 0:
        raise KernelFault(tc.TensorCoreError(tc.wait_group_message(n)), first_lane(m))
    st = _state()
    act = _mask(m)
    ready_below = st.commits - n                # groups older than the newest n committed ones land
    keep = []
    for copy in st.copies:
        lanes = copy.issued & ~copy.landed & act & (copy.group < ready_below)
        if lanes.any():
            copy.land(lanes)
        if (copy.issued & ~copy.landed).any():
            keep.append(copy)
    st.copies = keep


def cp_async_wait_all(m, site):
    cp_async_commit(m, site)
    cp_async_wait_group(m, site, 0)


# --------------------------------------------------------------------------- conversions


def _make_conversion(fn, nargs, compute, kind):
    """``fn(*args)`` per lane by ``compute`` on float32 lane arrays (the threads twin's core on arrays)."""
    name = fn.__name__

    def twin(m, site, *args):
        if len(args) != nargs:
            raise Unsupported(f"{name} called with {len(args)} arguments")
        args = tuple(_plain(a) for a in args)
        if not any(type(a) is V or type(a) is Mixed for a in args):
            try:
                return fn(*args)
            except Exception as exc:
                raise KernelFault(exc, first_lane(m)) from exc
        if any(type(a) is Mixed or (type(a) is V and a.k is not np.float32) for a in args):
            return scalarise(fn, args, m)                     # exact, lane by lane
        xs = [np.broadcast_to(_f32(name, a), (now.L,)) for a in args]

        r = _guarded(lambda: compute(*xs), lambda: lanes_in_order(m),
                     lambda lane: fn(*(scalar_at(a, lane) for a in args)))
        return V(r, kind)

    twin.__name__ = name
    return twin


def _pack(kind):
    return lambda lo, hi: tc.pack_core(lo, hi, kind)


# --------------------------------------------------------------------------- the table


TWINS = {f.__name__: f for f in (
    *(_make_mma(getattr(tc, n), s, na, nb) for n, s, na, nb in (
        ("mma_m16n8k16_f16", "m16n8k16.f16", 4, 2), ("mma_m16n8k16_bf16", "m16n8k16.bf16", 4, 2),
        ("mma_m16n8k8_tf32", "m16n8k8.tf32", 4, 2), ("mma_m16n8k8_f16", "m16n8k8.f16", 2, 1))),
    *(_make_ldmatrix(getattr(tc, f"ldmatrix_x{num}{'_trans' if trans else ''}"), num, trans)
      for num in (1, 2, 4) for trans in (False, True)),
    cp_async_16, cp_async_commit, cp_async_wait_group, cp_async_wait_all,
    _make_conversion(tc.to_tf32, 1, tc.to_tf32_core, np.uint32),
    _make_conversion(tc.pack_f16x2, 2, _pack("f16"), np.uint32),
    _make_conversion(tc.pack_bf16x2, 2, _pack("bf16"), np.uint32),
    _make_conversion(tc.exp2, 1, tc.exp2_core, np.float32),
)}


def twin_of(f):
    """The vectorised twin of ``f`` (a function of :mod:`flashnb.sim.tensorcore` a kernel calls), or None."""
    name = getattr(f, "__name__", None)
    if name is None or getattr(tc, name, None) is not f:
        return None
    return TWINS.get(name)
