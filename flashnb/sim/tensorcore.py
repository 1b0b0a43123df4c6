"""Simulator twins of the tensor-core instructions: ``mma.sync``, ``ldmatrix``, ``cp.async`` and the conversions.

On a GPU these are single PTX instructions (:mod:`flashnb.kernels.tensorcore.mma` emits them as inline assembly).
Here each one has a *twin* with the same name and arguments, written in two layers:

* a **NumPy core** that takes the 32 lanes' registers as arrays and returns theirs -- shape ``(..., 32, regs)``,
  so one call can serve one warp or every warp of a launch at once.  The core rebuilds the matrices from the
  documented fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k*", "warp-level matrix load
  instruction: ldmatrix"), computes with NumPy, and scatters the result back the same way.  The layouts are
  the tables :data:`LAYOUTS`, one place for each rule;
* a **warp collective** for the threads simulator, in the manner of :mod:`flashnb.sim.warp`'s shuffles: every
  lane hands its registers to the warp (``FastBlockThread.warp_collective``), the last lane to arrive runs the
  core, and each lane gets its own registers back.  All 32 lanes must take part (the instructions are
  ``.sync.aligned``); a missing lane is an error, as a divergent ``mma.sync`` is undefined on a GPU.

What the twins read and write goes through the simulator's arrays, so the traffic counter, the sanitizer and the
profiler see it:

* ``ldmatrix``: lane ``l`` (of the first 8, 16 or 32 lanes for ``.x1``, ``.x2``, ``.x4``) reads the 16-byte row
  its address names, in its own thread, through the counted and race-checked shared array.  The profiler groups
  those reads as the hardware serves them: one request per 8×8 matrix (8 rows of 16 bytes), so rows 128 bytes
  apart (``d = 64`` halves, unswizzled) show as 8 wavefronts where 1 is ideal;
* ``cp.async``: the copy is recorded when issued and *lands* when the issuing thread reaches a
  ``cp.async.wait_group`` that covers its group (``cp.async.commit_group`` closes a group).  A kernel that
  forgets the wait reads shared memory nothing has written (initcheck); one that forgets the barrier after the
  wait reads what another thread's copy wrote without ordering (racecheck).  The landed copy reads the global
  source (counted as element reads of the kernel's parameter) and writes shared memory (element writes), both
  named by the line that issued it.

Values: a packed register is a ``numpy.uint32`` (element 0 in the low 16 bits), a tf32 operand the uint32 bits of
a float32 whose low 13 bits the tensor core ignores, an accumulator a ``numpy.float32``.  The cores compute
``D = A·B + C`` in float64 (exact products, summed in a fixed order) and round once to float32; a GPU
accumulates in float32 in an unspecified order, so compare with tolerances, never bits.  The vectorised
simulator (:mod:`flashnb.sim.vector.tensorcore`) runs the same cores on every warp of a launch at once, with the
same accesses and errors.  Conversions round as PTX says: ``cvt.rn`` to nearest even,
``cvt.rna.tf32.f32`` to nearest with ties away from zero.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = [
    "LAYOUTS", "LDMATRIX_LAYOUT", "MMA_SHAPES", "decode", "encode", "fragments", "matrices", "mma_core",
    "ldmatrix_core", "to_tf32_core", "pack_core", "unpack_core", "exp2_core",
    "mma_m16n8k16_f16", "mma_m16n8k16_bf16", "mma_m16n8k8_tf32", "mma_m16n8k8_f16",
    "to_tf32", "pack_f16x2", "pack_bf16x2", "exp2",
    "ldmatrix_x1", "ldmatrix_x2", "ldmatrix_x4", "ldmatrix_x1_trans", "ldmatrix_x2_trans", "ldmatrix_x4_trans",
    "cp_async_16", "cp_async_commit", "cp_async_wait_group", "cp_async_wait_all", "TensorCoreError",
]

FULL_MASK = 0xFFFFFFFF
LANES = np.arange(32)
_G, _T = LANES >> 2, LANES & 3          # groupID, threadID_in_group


class TensorCoreError(RuntimeError):
    """A tensor-core instruction used in a way a GPU does not allow (missing lanes, misaligned rows, ...)."""


# --------------------------------------------------------------------------- fragment layouts


def _table(*entries):
    """``(rows, cols)`` int arrays of shape (32, regs, halves): the matrix element each lane's register holds."""
    rows = np.stack([np.stack([r for r, _ in reg], axis=-1) for reg in entries], axis=1)
    cols = np.stack([np.stack([c for _, c in reg], axis=-1) for reg in entries], axis=1)
    return rows, cols


def _halves(row, col0):
    """A packed register: elements (row, col0) in the low half and (row, col0 + 1) in the high half."""
    return ((row, col0), (row, col0 + 1))


def _b_halves(row0, col):
    """A packed B register: (row0, col) low, (row0 + 1, col) high (two consecutive k of one column n)."""
    return ((row0, col), (row0 + 1, col))


#: Fragment layouts, PTX ISA "Matrix Fragments for mma.m16n8k*": for each (shape, operand) the ``(rows, cols)``
#: of the element in (lane, register, half).  A is M×K (row-major), B is K×N, C and D are M×N.  tf32 registers
#: hold one element (halves axis of length 1).
LAYOUTS = {
    ("m16n8k16", "a"): _table(_halves(_G, 2 * _T), _halves(_G + 8, 2 * _T), _halves(_G, 2 * _T + 8),
                              _halves(_G + 8, 2 * _T + 8)),
    ("m16n8k16", "b"): _table(_b_halves(2 * _T, _G), _b_halves(2 * _T + 8, _G)),
    ("m16n8k8", "a"): _table(_halves(_G, 2 * _T), _halves(_G + 8, 2 * _T)),
    ("m16n8k8", "b"): _table(_b_halves(2 * _T, _G)),
    ("m16n8k8.tf32", "a"): _table(((_G, _T),), ((_G + 8, _T),), ((_G, _T + 4),), ((_G + 8, _T + 4),)),
    ("m16n8k8.tf32", "b"): _table(((_T, _G),), ((_T + 4, _G),)),
    ("c", "c"): _table(((_G, 2 * _T),), ((_G, 2 * _T + 1),), ((_G + 8, 2 * _T),), ((_G + 8, 2 * _T + 1),)),
}

#: ldmatrix's layout, PTX ISA "ldmatrix": the (row, column) of an 8×8 matrix that lane ``l`` receives in the low
#: and the high half of its register for that matrix, without and with ``.trans``.
LDMATRIX_LAYOUT = {False: ((_G, 2 * _T), (_G, 2 * _T + 1)), True: ((2 * _T, _G), (2 * _T + 1, _G))}

#: (M, N, K, layout key, element type) of each mma the twins implement.
MMA_SHAPES = {
    "m16n8k16.f16": (16, 8, 16, "m16n8k16", "f16"),
    "m16n8k16.bf16": (16, 8, 16, "m16n8k16", "bf16"),
    "m16n8k8.tf32": (16, 8, 8, "m16n8k8.tf32", "tf32"),
    "m16n8k8.f16": (16, 8, 8, "m16n8k8", "f16"),
}


# --------------------------------------------------------------------------- register encodings


def decode(regs, kind: str) -> np.ndarray:
    """Values of packed registers ``regs`` (uint32, shape (..., R)) as float64, shape (..., R, halves):
    ``kind`` "f16" / "bf16" (two halves, low first) or "tf32" (one; the low 13 bits are ignored, as the tensor
    core does)."""
    r = np.asarray(regs).astype(np.uint32)
    if kind == "tf32":
        return (r & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)[..., None]
    halves = np.stack([r & np.uint32(0xFFFF), r >> np.uint32(16)], axis=-1).astype(np.uint16)
    if kind == "f16":
        return halves.view(np.float16).astype(np.float64)
    if kind == "bf16":
        return (halves.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    raise ValueError(f"kind must be 'f16', 'bf16' or 'tf32', got {kind!r}")


def encode(values, kind: str) -> np.ndarray:
    """Inverse of :func:`decode` for values already representable (shape (..., R, halves) -> (..., R) uint32)."""
    v = np.asarray(values)
    if kind == "tf32":
        return v[..., 0].astype(np.float32).view(np.uint32)
    if kind == "f16":
        bits = v.astype(np.float16).view(np.uint16).astype(np.uint32)
    elif kind == "bf16":
        bits = (v.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint32)
    else:
        raise ValueError(f"kind must be 'f16', 'bf16' or 'tf32', got {kind!r}")
    return bits[..., 0] | (bits[..., 1] << np.uint32(16))


def matrices(regs_values, layout, shape) -> np.ndarray:
    """The matrix (..., rows, cols) whose fragments are ``regs_values`` (..., 32, R, halves), by ``layout``."""
    rows, cols = layout
    out = np.zeros(regs_values.shape[:-3] + tuple(shape), dtype=regs_values.dtype)
    out[..., rows, cols] = regs_values
    return out


def fragments(matrix, layout) -> np.ndarray:
    """The fragments (..., 32, R, halves) of ``matrix`` (..., rows, cols) by ``layout``."""
    rows, cols = layout
    return np.asarray(matrix)[..., rows, cols]


# --------------------------------------------------------------------------- NumPy cores


def mma_core(shape: str, a, b, c) -> np.ndarray:
    """``D = A·B + C`` of one ``mma.sync`` per leading index: ``a`` (..., 32, 4 or 2) and ``b`` (..., 32, 2 or 1)
    uint32 registers, ``c`` (..., 32, 4) float32 accumulators; returns D's (..., 32, 4) float32.  ``shape`` is a
    key of :data:`MMA_SHAPES`.  The products are exact in float64 and summed in float64 in the order of k, then C
    is added and the result rounded once to float32.  The order is fixed (element-wise NumPy operations, no
    matmul whose summation order a BLAS chooses), so one warp's result does not depend on how many warps a call
    serves: the threads simulator's twin (one warp a call) and the vectorised simulator's (every warp of a
    launch at once) agree bit for bit."""
    M, N, K, key, kind = MMA_SHAPES[shape]
    A = matrices(decode(a, kind), LAYOUTS[(key, "a")], (M, K))
    B = matrices(decode(b, kind), LAYOUTS[(key, "b")], (K, N))
    C = matrices(np.asarray(c, dtype=np.float32).astype(np.float64)[..., None], LAYOUTS[("c", "c")], (M, N))
    D = A[..., :, 0, None] * B[..., None, 0, :]
    for k in range(1, K):
        D += A[..., :, k, None] * B[..., None, k, :]
    D += C
    return fragments(D, LAYOUTS[("c", "c")])[..., 0].astype(np.float32)


def ldmatrix_core(rows, num: int, trans: bool) -> np.ndarray:
    """``ldmatrix.sync.aligned.m8n8.x{num}[.trans].b16``: ``rows`` (..., 32, 8) uint16 -- lane ``l``'s row of 8
    b16 elements (lanes ``8j .. 8j+7`` give the rows of matrix ``j``; lanes beyond ``8·num`` are ignored) -- to
    the (..., 32, num) uint32 registers.  Lane ``l``'s register ``j`` holds row ``l/4``, columns ``2(l%4)`` and
    ``2(l%4)+1`` of matrix ``j`` (low, high); with ``.trans`` rows ``2(l%4)``, ``2(l%4)+1`` of column ``l/4``."""
    r = np.asarray(rows).astype(np.uint32)
    out = np.empty(r.shape[:-2] + (32, num), dtype=np.uint32)
    (lo_r, lo_c), (hi_r, hi_c) = LDMATRIX_LAYOUT[bool(trans)]
    for j in range(num):
        m = r[..., 8 * j:8 * j + 8, :]                           # (..., 8 rows, 8 columns)
        out[..., j] = m[..., lo_r, lo_c] | (m[..., hi_r, hi_c] << np.uint32(16))
    return out


def to_tf32_core(x) -> np.ndarray:
    """``cvt.rna.tf32.f32``: float32 -> the bits of the nearest tf32 (10-bit mantissa; ties away from zero), as
    uint32 with the low 13 bits zero.  inf and NaN pass through (NaN stays NaN)."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    finite = np.isfinite(f)
    rounded = (u.astype(np.uint64) + 0x1000) & 0xFFFFE000       # add half an ulp of tf32, keep 19 bits
    out = np.where(finite, rounded, u).astype(np.uint64)
    out = np.where(np.isnan(f), u | np.uint32(0x00400000), out)  # a quiet NaN
    return out.astype(np.uint32)


def pack_core(lo, hi, kind: str) -> np.ndarray:
    """``cvt.rn.{f16,bf16}x2.f32``: two float32 rounded to nearest even and packed, ``lo`` in the low 16 bits."""
    lo = np.asarray(lo, dtype=np.float32)
    hi = np.asarray(hi, dtype=np.float32)
    if kind == "f16":
        bits = [x.astype(np.float16).view(np.uint16).astype(np.uint32) for x in (lo, hi)]
    elif kind == "bf16":
        from ..common import to_bfloat16

        bits = [to_bfloat16(x).astype(np.uint32) for x in (lo, hi)]
    else:
        raise ValueError(f"kind must be 'f16' or 'bf16', got {kind!r}")
    return bits[0] | (bits[1] << np.uint32(16))


def exp2_core(x) -> np.ndarray:
    """:func:`exp2` of float32 values: NumPy's float32 ``exp2`` (one loop for an array and for a scalar), subnormal
    results flushed to +0."""
    r = np.exp2(np.asarray(x, dtype=np.float32))
    a = np.abs(r)
    return np.where((a > 0) & (a < np.finfo(np.float32).tiny), np.float32(0.0), r).astype(np.float32)


def unpack_core(r, kind: str) -> np.ndarray:
    """The two float32 values (..., 2) of packed registers ``r`` (low half first)."""
    return decode(r, kind).astype(np.float32)


# --------------------------------------------------------------------------- the threads simulator's collectives


def _thread(name):
    t = threading.current_thread()
    if not hasattr(t, "warp_collective"):
        raise RuntimeError(f"{name}() can only be called from a kernel running on flashnb's simulator runtime")
    return t


_HERE = {__file__}


def _site() -> str:
    """file:line (function) of the kernel line that called the twin."""
    from . import kernel_line

    return kernel_line(_HERE, 2)


def _all_lanes(name):
    def check(rnd):
        if len(rnd.args) != 32:
            missing = sorted(set(range(32)) - set(rnd.args))
            raise TensorCoreError(f"{name}: lanes {missing} of warp {rnd.warp} did not take part; the instruction "
                                  "is .sync.aligned: every lane of the warp must execute it together (they returned "
                                  "early, took another branch, or the block's last warp is partial)")
    return check


def _u32(x):
    return np.uint32(int(x) & 0xFFFFFFFF)


def _mma(name, shape, a, b, c):
    check = _all_lanes(name)

    def compute(rnd, lanes_in_warp, participants):
        check(rnd)
        A = np.array([rnd.args[lane][0][0] for lane in range(32)], dtype=np.uint32)
        B = np.array([rnd.args[lane][0][1] for lane in range(32)], dtype=np.uint32)
        C = np.array([rnd.args[lane][0][2] for lane in range(32)], dtype=np.float32)
        D = mma_core(shape, A, B, C)
        return {lane: tuple(D[lane]) for lane in range(32)}

    t = _thread(name)
    regs = (tuple(_u32(x) for x in a), tuple(_u32(x) for x in b), tuple(np.float32(x) for x in c))
    return t.warp_collective(name, FULL_MASK, regs, None, compute)


def mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``: returns ``(d0, d1, d2, d3)``."""
    return _mma("mma_m16n8k16_f16", "m16n8k16.f16", (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))


def mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: returns ``(d0, d1, d2, d3)``."""
    return _mma("mma_m16n8k16_bf16", "m16n8k16.bf16", (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))


def mma_m16n8k8_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``: returns ``(d0, d1, d2, d3)``."""
    return _mma("mma_m16n8k8_tf32", "m16n8k8.tf32", (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))


def mma_m16n8k8_f16(a0, a1, b0, c0, c1, c2, c3):
    """``mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32`` (sm_75): returns ``(d0, d1, d2, d3)``."""
    return _mma("mma_m16n8k8_f16", "m16n8k8.f16", (a0, a1), (b0,), (c0, c1, c2, c3))


def to_tf32(x):
    """``cvt.rna.tf32.f32``: the tf32 bits (uint32) of a float32."""
    return np.uint32(to_tf32_core(np.float32(x))[()])


def pack_f16x2(lo, hi):
    """``cvt.rn.f16x2.f32``: two float32 as one packed f16x2 register (``lo`` in the low half)."""
    return np.uint32(pack_core(np.float32(lo), np.float32(hi), "f16")[()])


def pack_bf16x2(lo, hi):
    """``cvt.rn.bf16x2.f32``: two float32 as one packed bf16x2 register (``lo`` in the low half)."""
    return np.uint32(pack_core(np.float32(lo), np.float32(hi), "bf16")[()])


def exp2(x):
    """``ex2.approx.ftz.f32``: 2**x in float32 (the hardware's approximation is within 2 ulp of it; -inf -> +0;
    a subnormal result flushes to zero, as ``.ftz`` does)."""
    return np.float32(exp2_core(np.float32(x))[()])


# -- memory: reads and writes through the simulator's arrays, named by the kernel line


def _ndarray(arr) -> np.ndarray:
    """The NumPy array behind a kernel's array: itself, a counting proxy's (:mod:`flashnb.instruments.traffic`), or the
    simulator's device array's."""
    if isinstance(arr, np.ndarray):
        return arr
    from .traffic import _Counted

    if isinstance(arr, _Counted):
        return arr._a
    item = arr.__dict__.get("_item", arr)        # FakeWithinKernelCUDAArray -> FakeCUDAArray
    return getattr(item, "_ary", item)


def _root(a):
    a = _ndarray(a)
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _byte_offset(arr, element_address) -> int:
    return element_address - _root(arr).__array_interface__["data"][0]


def _element_address(arr, idx) -> int:
    a = _ndarray(arr)
    idx = idx if isinstance(idx, tuple) else (idx,)
    if len(idx) != a.ndim:
        raise TensorCoreError(index_message(idx, a.ndim))
    # bounds are memcheck's (the reads below go through the proxy); a wild index must not crash here
    flat = sum(int(i) * s for i, s in zip(idx, a.strides))
    return a.__array_interface__["data"][0] + flat


class _Attribution:
    """Name the accesses made inside the block by a kernel line (and, for the profiler, by one request)."""

    def __init__(self, where, request):
        from . import racecheck

        self.site = racecheck._site
        self.where, self.request = where, request

    def __enter__(self):
        self.saved = (getattr(self.site, "where", None), getattr(self.site, "request", None))
        self.site.where, self.site.request = self.where, self.request

    def __exit__(self, *exc):
        self.site.where, self.site.request = self.saved
        return False


def _next_seq(t, key) -> int:
    seq = getattr(t, "_tensorcore_seq", None)
    if seq is None:
        seq = t._tensorcore_seq = {}
    n = seq.get(key, 0)
    seq[key] = n + 1
    return n


def _bits16(values, dtype) -> list:
    """Raw 16-bit patterns (little-endian order) of ``values`` of ``dtype`` (itemsize 2 or 4)."""
    raw = np.asarray(values, dtype=dtype).view(np.uint16)
    return [int(x) for x in raw.ravel()]


def ldmatrix_dtype_message(name, dtype) -> str:
    return (f"{name}: shared array of dtype {dtype} (ldmatrix moves 16-bit elements: use float16 / uint16, or "
            "float32 read as pairs of b16)")


def ldmatrix_alignment_message(name, lane, idx, off) -> str:
    return (f"{name}: lane {lane}'s row address (element {idx}, byte {off} of the array) is not 16-byte aligned; "
            "ldmatrix rows must start on 16 bytes")


def cp_async_nbytes_message(itemsize, nbytes) -> str:
    return (f"cp_async_16: nbytes must be 0..16 and a multiple of the source's {itemsize}-byte elements, got "
            f"{nbytes}")


def cp_async_elements_message(itemsize) -> str:
    return f"cp_async_16: destination elements of {itemsize} bytes do not tile 16 bytes"


def cp_async_alignment_message(what, idx, off) -> str:
    return (f"cp_async_16: the {what} address (index {idx}, byte {off} of the array) is not 16-byte aligned; "
            "cp.async of 16 bytes needs both addresses on 16 bytes")


def index_message(idx, ndim) -> str:
    return f"index {idx} does not name one element of a {ndim}-dimensional array"


def _read_row(name, arr, idx, lane, where, request):
    """The 16 bytes at element ``idx`` of the 1-D shared array ``arr``, read by this lane, as 8 uint16."""
    dtype = _ndarray(arr).dtype
    if dtype.itemsize not in (2, 4):
        raise TensorCoreError(ldmatrix_dtype_message(name, dtype))
    off = _byte_offset(arr, _element_address(arr, idx))
    if off % 16:
        raise TensorCoreError(ldmatrix_alignment_message(name, lane, int(idx), off))
    n = 16 // dtype.itemsize
    with _Attribution(where, request):
        vals = [arr[int(idx) + e] for e in range(n)]
    return _bits16(vals, dtype)


def _ldmatrix(name, num, trans, arr, idx):
    t = _thread(name)
    lane = t.thread_id & 31
    where = _site()
    k = _next_seq(t, ("ldmatrix", where))
    row = None
    if lane < 8 * num:                    # lanes 8j .. 8j+7 give the rows of matrix j; the others' are ignored
        row = _read_row(name, arr, idx, lane, where, ("ldmatrix", k, lane // 8))
    check = _all_lanes(name)

    def compute(rnd, lanes_in_warp, participants):
        check(rnd)
        rows = np.zeros((32, 8), dtype=np.uint16)
        for ln in range(8 * num):
            rows[ln] = rnd.args[ln][0]
        regs = ldmatrix_core(rows, num, trans)
        return {ln: tuple(np.uint32(x) for x in regs[ln]) for ln in range(32)}

    out = t.warp_collective(name, FULL_MASK, row, None, compute)
    return out[0] if num == 1 else out


def ldmatrix_x1(arr, idx):
    """``ldmatrix.sync.aligned.m8n8.x1.shared.b16``: lanes 0-7 give the row addresses (element ``idx`` of ``arr``);
    returns this lane's register (uint32)."""
    return _ldmatrix("ldmatrix_x1", 1, False, arr, idx)


def ldmatrix_x2(arr, idx):
    """``ldmatrix...x2``: lanes 0-15 give the rows of two 8×8 matrices; returns ``(r0, r1)``."""
    return _ldmatrix("ldmatrix_x2", 2, False, arr, idx)


def ldmatrix_x4(arr, idx):
    """``ldmatrix...x4``: lanes 0-31 give the rows of four 8×8 matrices; returns ``(r0, r1, r2, r3)``."""
    return _ldmatrix("ldmatrix_x4", 4, False, arr, idx)


def ldmatrix_x1_trans(arr, idx):
    """``ldmatrix...x1.trans``: as :func:`ldmatrix_x1`, each matrix transposed."""
    return _ldmatrix("ldmatrix_x1_trans", 1, True, arr, idx)


def ldmatrix_x2_trans(arr, idx):
    """``ldmatrix...x2.trans``."""
    return _ldmatrix("ldmatrix_x2_trans", 2, True, arr, idx)


def ldmatrix_x4_trans(arr, idx):
    """``ldmatrix...x4.trans``."""
    return _ldmatrix("ldmatrix_x4_trans", 4, True, arr, idx)


# -- cp.async: issued now, landed at wait_group


class _Copy:
    __slots__ = ("dst", "di", "src", "sidx", "nbytes", "where", "seq")

    def __init__(self, dst, di, src, sidx, nbytes, where, seq):
        self.dst, self.di, self.src, self.sidx, self.nbytes, self.where, self.seq = dst, di, src, sidx, nbytes, \
            where, seq

    def land(self):
        """Read the source and write the destination, in the waiting thread, named by the issuing line."""
        sdt, ddt = _ndarray(self.src).dtype, _ndarray(self.dst).dtype
        n_src, n_dst = self.nbytes // sdt.itemsize, 16 // ddt.itemsize
        head, last = self.sidx[:-1], int(self.sidx[-1])
        with _Attribution(self.where, ("cp.async", self.seq)):
            vals = [self.src[head + (last + e,)] for e in range(n_src)]
        raw = np.zeros(16, dtype=np.uint8)
        raw[:self.nbytes] = np.asarray(vals, dtype=sdt).view(np.uint8)
        out = raw.view(ddt)
        with _Attribution(self.where, ("cp.async", self.seq)):
            for e in range(n_dst):
                self.dst[int(self.di) + e] = out[e]


def _pending(t):
    state = getattr(t, "_cp_async", None)
    if state is None:
        state = t._cp_async = {"open": [], "groups": []}
    return state


def cp_async_16(dst, di, src, sidx, nbytes):
    """``cp.async.cg.shared.global [dst + di], [src + sidx], 16, nbytes``: copy ``nbytes`` (0..16, a multiple of
    the source's element size) from ``src[sidx]`` on and zero-fill the rest of the 16 bytes at element ``di`` of
    the 1-D shared array ``dst``.  Nothing is read or written until this thread's ``cp_async_wait_group`` covers
    the copy's group.  Both addresses must be 16-byte aligned."""
    t = _thread("cp_async_16")
    sidx = tuple(int(i) for i in (sidx if isinstance(sidx, tuple) else (sidx,)))
    nbytes = int(nbytes)
    sdt, ddt = _ndarray(src).dtype, _ndarray(dst).dtype
    if not 0 <= nbytes <= 16 or nbytes % sdt.itemsize:
        raise TensorCoreError(cp_async_nbytes_message(sdt.itemsize, nbytes))
    if 16 % ddt.itemsize:
        raise TensorCoreError(cp_async_elements_message(ddt.itemsize))
    for what, arr, idx in (("shared destination", dst, int(di)), ("global source", src, sidx)):
        off = _byte_offset(arr, _element_address(arr, idx))
        if off % 16:
            raise TensorCoreError(cp_async_alignment_message(what, idx, off))
    where = _site()
    _pending(t)["open"].append(_Copy(dst, int(di), src, sidx, nbytes, where, _next_seq(t, ("cp.async", where))))


def cp_async_commit():
    """``cp.async.commit_group``: the copies issued since the last commit form one group."""
    state = _pending(_thread("cp_async_commit"))
    state["groups"].append(state["open"])
    state["open"] = []


def wait_group_message(n) -> str:
    return f"cp_async_wait_group: n must be >= 0, got {n}"


def cp_async_wait_group(n):
    """``cp.async.wait_group n``: wait until at most ``n`` of this thread's committed groups are pending (the
    newest ``n``): the older ones land now.  Other threads see them only after a barrier."""
    n = int(n)
    if n < 0:
        raise TensorCoreError(wait_group_message(n))
    state = _pending(_thread("cp_async_wait_group"))
    groups = state["groups"]
    keep = min(n, len(groups))                   # fewer than n pending: nothing to wait for
    ready, state["groups"] = groups[:len(groups) - keep], groups[len(groups) - keep:]
    for group in ready:
        for copy in group:
            copy.land()


def cp_async_wait_all():
    """``cp.async.wait_all``: commit what is open, then wait for every group."""
    cp_async_commit()
    cp_async_wait_group(0)
