"""Every tensor-core intrinsic of :mod:`flashnb.kernels.tensorcore.mma` against its simulator twin, on the same
random inputs.

The twins' fragment layouts are tested against NumPy on plain matrices (``tests/kernels/test_mma.py``); what only a
GPU can say is that the instruction really uses those layouts.  :func:`run` launches one small kernel per
intrinsic -- each lane loads its registers (or its row address) from global memory, executes the instruction,
stores what it got -- and compares the GPU's results with the twin's NumPy core (:mod:`flashnb.sim.tensorcore`)
on the same inputs: ``mma`` within float32 accumulation error, everything else bit for bit.  The first step of
``scripts/gpu_check.py``; on the simulator the same kernels run on the twins (a rehearsal, not a check of
hardware).

Kernels: ``mma_check.mma`` (``shape``: ``"m16n8k16.f16"``, ``"m16n8k16.bf16"``, ``"m16n8k8.tf32"``),
``mma_check.mma1688`` (``m16n8k8.f16``, sm_75+), ``mma_check.convert`` (tf32, f16x2, bf16x2), ``mma_check.ldmatrix``
(``num`` 1, 2, 4, ``trans``), ``mma_check.cp_async`` (zero-fill, two groups, ``wait_group 1`` then ``0``).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, uint16, uint32

from ...registry import kernel_factory
from ...sim import tensorcore as twin
from . import mma
from .mma import SHARED_ALIGN

__all__ = ["make_mma", "make_mma1688", "make_convert", "make_ldmatrix", "make_cp_async", "run", "MMA_TOLERANCE"]

SM80 = ((8, 0), (9, 0))
SM75 = ((7, 5), (8, 0), (9, 0))
_MMA = {"m16n8k16.f16": mma.mma_m16n8k16_f16, "m16n8k16.bf16": mma.mma_m16n8k16_bf16,
        "m16n8k8.tf32": mma.mma_m16n8k8_tf32}
#: |GPU - twin| allowed for one mma on O(1) inputs: the twin rounds an exact sum once, a tensor core accumulates
#: up to 17 terms in float32 in an order of its own (a few ulps of sums of magnitude ~10)
MMA_TOLERANCE = 1e-5


@kernel_factory("mma_check.mma", stage="7", archs=SM80, threads=32,
                signature="void(uint32[:, ::1], uint32[:, ::1], float32[:, ::1], float32[:, ::1])",
                configs=[dict(shape=s) for s in _MMA])
def make_mma(shape):
    """One warp: lane ``l`` executes the mma on ``A[l]`` (4 registers), ``B[l]`` (2), ``C[l]`` (4), stores ``D[l]``."""
    op = _MMA[shape]

    @cuda.jit
    def mma_check(A, B, C, D):
        lane = cuda.laneid
        d0, d1, d2, d3 = op(A[lane, 0], A[lane, 1], A[lane, 2], A[lane, 3], B[lane, 0], B[lane, 1],
                            C[lane, 0], C[lane, 1], C[lane, 2], C[lane, 3])
        D[lane, 0] = d0
        D[lane, 1] = d1
        D[lane, 2] = d2
        D[lane, 3] = d3

    return mma_check


@kernel_factory("mma_check.mma1688", stage="7", archs=SM75, threads=32,
                signature="void(uint32[:, ::1], uint32[:, ::1], float32[:, ::1], float32[:, ::1])")
def make_mma1688():
    """One warp: ``mma.m16n8k8.f16`` (2 A registers, 1 B register), the sm_75 instruction."""

    @cuda.jit
    def mma1688_check(A, B, C, D):
        lane = cuda.laneid
        d0, d1, d2, d3 = mma.mma_m16n8k8_f16(A[lane, 0], A[lane, 1], B[lane, 0], C[lane, 0], C[lane, 1],
                                             C[lane, 2], C[lane, 3])
        D[lane, 0] = d0
        D[lane, 1] = d1
        D[lane, 2] = d2
        D[lane, 3] = d3

    return mma1688_check


@kernel_factory("mma_check.convert", stage="7", archs=SM80, threads=32,
                signature="void(float32[:, ::1], uint32[:, ::1])")
def make_convert():
    """``R[l] = (to_tf32(X[l, 0]), pack_f16x2(X[l, 0], X[l, 1]), pack_bf16x2(X[l, 0], X[l, 1]))``."""

    @cuda.jit
    def convert_check(X, R):
        lane = cuda.laneid
        R[lane, 0] = mma.to_tf32(X[lane, 0])
        R[lane, 1] = mma.pack_f16x2(X[lane, 0], X[lane, 1])
        R[lane, 2] = mma.pack_bf16x2(X[lane, 0], X[lane, 1])

    return convert_check


@kernel_factory("mma_check.ldmatrix", stage="7", archs=SM75, threads=32,
                signature="void(uint16[:, ::1], int32[::1], uint32[:, ::1])",
                configs=[dict(num=n, trans=t) for n in (1, 2, 4) for t in (False, True)])
def make_ldmatrix(num, trans):
    """Lane ``l`` copies row ``l`` of ``M`` (32 rows of 8 b16) into shared memory, then addresses row ``rows[l]``
    for the ldmatrix; ``R[l, :num]`` are its registers."""
    op = {(1, False): mma.ldmatrix_x1, (2, False): mma.ldmatrix_x2, (4, False): mma.ldmatrix_x4,
          (1, True): mma.ldmatrix_x1_trans, (2, True): mma.ldmatrix_x2_trans, (4, True): mma.ldmatrix_x4_trans}[
        (num, bool(trans))]

    def stage(M, rows, S):
        lane = cuda.laneid
        for e in range(8):
            S[lane * 8 + e] = M[lane, e]
        cuda.syncwarp()
        return uint32(rows[lane] * 8)

    stage = cuda.jit(device=True, inline="always")(stage)

    if num == 1:
        @cuda.jit
        def ldmatrix_check(M, rows, R):
            S = cuda.shared.array(256, uint16, alignment=SHARED_ALIGN)
            i = stage(M, rows, S)
            R[cuda.laneid, 0] = op(S, i)
    elif num == 2:
        @cuda.jit
        def ldmatrix_check(M, rows, R):
            S = cuda.shared.array(256, uint16, alignment=SHARED_ALIGN)
            i = stage(M, rows, S)
            r0, r1 = op(S, i)
            R[cuda.laneid, 0] = r0
            R[cuda.laneid, 1] = r1
    else:
        @cuda.jit
        def ldmatrix_check(M, rows, R):
            S = cuda.shared.array(256, uint16, alignment=SHARED_ALIGN)
            i = stage(M, rows, S)
            r0, r1, r2, r3 = op(S, i)
            R[cuda.laneid, 0] = r0
            R[cuda.laneid, 1] = r1
            R[cuda.laneid, 2] = r2
            R[cuda.laneid, 3] = r3

    return ldmatrix_check


@kernel_factory("mma_check.cp_async", stage="7", archs=SM80, threads=32,
                signature="void(uint16[:, ::1], int32[::1], int32[::1], uint16[:, ::1])")
def make_cp_async():
    """Two groups of 16-byte copies: lane ``l`` copies ``nbytes[l]`` bytes of row ``rows[l]`` of ``G`` into chunk
    ``l`` of shared buffer A (group 1) and the whole row ``31 - rows[l]`` into buffer B (group 2);
    ``wait_group 1`` then ``syncwarp``, and lane ``l`` reads chunk ``(l + 1) % 32`` of A; ``wait_group 0``, then
    chunk ``(l + 1) % 32`` of B.  ``out[l, :8]`` and ``out[l, 8:]`` are what it read."""

    @cuda.jit
    def cp_async_check(G, rows, nbytes, out):
        A = cuda.shared.array(256, uint16, alignment=SHARED_ALIGN)
        B = cuda.shared.array(256, uint16, alignment=SHARED_ALIGN)
        lane = cuda.laneid
        mma.cp_async_16(A, lane * 8, G, (rows[lane], 0), uint32(nbytes[lane]))
        mma.cp_async_commit()
        mma.cp_async_16(B, lane * 8, G, (31 - rows[lane], 0), uint32(16))
        mma.cp_async_commit()
        mma.cp_async_wait_group(1)
        cuda.syncwarp()
        other = (lane + 1) % 32
        for e in range(8):
            out[lane, e] = A[other * 8 + e]
        mma.cp_async_wait_group(0)
        cuda.syncwarp()
        for e in range(8):
            out[lane, 8 + e] = B[other * 8 + e]

    return cp_async_check


# --------------------------------------------------------------------------- host side


def _launch(kernel, *arrays):
    from ...common import launch

    dev = [cuda.to_device(np.ascontiguousarray(a)) for a in arrays]
    launch(kernel, 1, 32, *dev, label=kernel.py_func.__name__)
    return dev[-1].copy_to_host()


def _bits(rng, shape, kind):
    """Random finite registers of ``kind`` (values ~N(0, 1), so products and sums stay O(10))."""
    v = rng.standard_normal(shape + ((1,) if kind == "tf32" else (2,))).astype(np.float32)
    return twin.encode(twin.to_tf32_core(v).view(np.float32) if kind == "tf32" else v, kind)


def run(seed: int = 0, cc=None) -> list[dict]:
    """Run every check on this device (GPU, or the simulator's twins): one row per intrinsic with ``ok``, the
    number of mismatching values and the largest difference.  ``cc`` (default: the device's; on the simulator
    (8, 0)) leaves out the checks the architecture lacks."""
    from ... import runtime

    if cc is None:
        cc = (8, 0) if runtime.MODE != "gpu" else tuple(cuda.get_current_device().compute_capability)
    rng = np.random.default_rng(seed)
    rows = []

    def row(name, got, want, exact):
        got, want = np.asarray(got), np.asarray(want)
        if exact:
            bad = int(np.count_nonzero(got != want))
            diff = float(np.max(np.abs(got.astype(np.int64) - want.astype(np.int64)), initial=0))
        else:
            err = np.abs(got.astype(np.float64) - want.astype(np.float64))
            bad = int(np.count_nonzero(~(err <= MMA_TOLERANCE)))
            diff = float(np.nanmax(err, initial=0.0)) if np.isfinite(got).all() else float("inf")
        rows.append(dict(intrinsic=name, ok=bad == 0, mismatches=bad, max_diff=diff, values=int(got.size)))

    if tuple(cc) >= (8, 0):
        for shape in _MMA:
            kind = twin.MMA_SHAPES[shape][4]
            A, B = _bits(rng, (32, 4), kind), _bits(rng, (32, 2), kind)
            C = rng.standard_normal((32, 4)).astype(np.float32)
            D = _launch(make_mma(shape), A, B, C, np.full((32, 4), np.nan, np.float32))
            row(f"mma {shape}", D, twin.mma_core(shape, A, B, C), exact=False)
        X = rng.standard_normal((32, 2)).astype(np.float32) * np.float32(3.0)
        X[0] = (1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11)          # ties: rna away from zero, rn to even
        R = _launch(make_convert(), X, np.zeros((32, 3), np.uint32))
        row("cvt.rna.tf32.f32", R[:, 0], twin.to_tf32_core(X[:, 0]), exact=True)
        row("cvt.rn.f16x2.f32 (pack_f16x2)", R[:, 1], twin.pack_core(X[:, 0], X[:, 1], "f16"), exact=True)
        row("cvt.rn.bf16x2.f32", R[:, 2], twin.pack_core(X[:, 0], X[:, 1], "bf16"), exact=True)
        G = rng.integers(0, 1 << 16, (32, 8), dtype=np.uint16)
        rows_ = rng.permutation(32).astype(np.int32)
        nbytes = (2 * rng.integers(0, 9, 32)).astype(np.int32)    # 0, 2, ..., 16: zero-fill of the rest
        out = _launch(make_cp_async(), G, rows_, nbytes, np.zeros((32, 16), np.uint16))
        other = (np.arange(32) + 1) % 32
        want_a = np.where(np.arange(8)[None, :] < nbytes[other, None] // 2, G[rows_[other]], 0)
        row("cp.async 16 B (zero-fill, wait_group 1)", out[:, :8], want_a, exact=True)
        row("cp.async 16 B (second group, wait_group 0)", out[:, 8:], G[31 - rows_[other]], exact=True)
    A, B = _bits(rng, (32, 2), "f16"), _bits(rng, (32, 1), "f16")
    C = rng.standard_normal((32, 4)).astype(np.float32)
    D = _launch(make_mma1688(), A, B, C, np.full((32, 4), np.nan, np.float32))
    row("mma m16n8k8.f16", D, twin.mma_core("m16n8k8.f16", A, B, C), exact=False)
    M = rng.integers(0, 1 << 16, (32, 8), dtype=np.uint16)
    for num in (1, 2, 4):
        for trans in (False, True):
            rows_ = rng.permutation(32).astype(np.int32)
            R = _launch(make_ldmatrix(num, trans), M, rows_, np.zeros((32, num), np.uint32))
            row(f"ldmatrix x{num}{' .trans' if trans else ''}", R, twin.ldmatrix_core(M[rows_], num, trans),
                exact=True)
    return rows
