"""The shared-memory layout of fa2-tc's tiles and the device functions that fill them and make fragments.

**Shared memory: swizzled, no bank conflicts.**  A row of ``Dp`` halves is ``Dp/8`` chunks of 16 bytes; with
rows of 128 bytes (``d = 64``) the 8 rows an ``ldmatrix`` matrix reads would all start in bank 0 -- 8-way
conflicts.  Chunk ``c`` of row ``r`` is stored at chunk ``c ^ f(r)`` (:func:`_layout`), so the 8 rows of every
matrix cover all 32 banks.  :func:`_make_policies` chooses, once per configuration, the tile copy (``cp.async`` or
plain), the MMA of one k-step and the packing of P into A registers.
"""

from __future__ import annotations

import math

from numba import cuda, float32, uint16, uint32
from numba.core.types import float16  # noqa: E402  (numba exports no float16 at the top level)

from ...common import ZERO, storage_conversions
from . import mma

__all__ = ["LOG2E", "LN2"]

LOG2E = float32(1.4426950408889634)
POS_INF = float32(math.inf)
LN2 = float32(0.6931471805599453)
FULL_MASK = 0xFFFFFFFF

_SHARED_TYPE = {"float16": float16, "bfloat16": uint16, "float32": uint32}   # what a shared tile holds
_SIGN = {"float16": uint32(0x80008000), "bfloat16": uint32(0x80008000), "float32": uint32(0x80000000)}  # sign bits


def _layout(LD, E, swizzle=True):
    """The swizzled layout of a tile with rows of ``LD`` elements (a power of two of 16-byte chunks of ``E``):
    ``swz(r)``, ``chunk_at(r, c)`` (element index of chunk ``c`` of row ``r``) and ``at(r8, lane, c)`` (the row
    ``r8 + lane % 8`` an ldmatrix lane addresses, ``r8`` a multiple of 8: its swizzle depends on the lane only).
    ``swizzle=False``: chunks where they are (notebook 12's counter-example: 8-way conflicts at d = 64)."""
    LDC = LD // E
    RS = max(1, 8 // LDC)                # rows that share a 128-byte line of banks
    SM = min(LDC, 8) if swizzle else 1   # the swizzle's period in chunks (1: none)

    @cuda.jit(device=True, inline="always")
    def swz(r):
        """The swizzle of row ``r``: its chunks are XOR-ed with this (rows that share a line of banks differ)."""
        return (uint32(r) // uint32(RS)) % uint32(SM)

    @cuda.jit(device=True, inline="always")
    def chunk_at(r, c):
        """Element index of chunk ``c`` of tile row ``r``: stored at chunk ``c ^ swz(r)``."""
        return uint32(r) * uint32(LD) + ((uint32(c) ^ swz(r)) * uint32(E))

    @cuda.jit(device=True, inline="always")
    def at(r8, lane, c):
        """Shared index of chunk ``c`` of row ``r8 + lane % 8`` (``r8`` a multiple of 8): the ldmatrix row this lane
        addresses."""
        return uint32(r8 + lane % 8) * uint32(LD) + ((uint32(c) ^ swz(lane % 8)) * uint32(E))

    return swz, chunk_at, at



def _make_policies(storage, g, arch, swizzle=True):
    """The device functions the kernels call, chosen once per configuration: the swizzled shared index, the tile
    copy (async or plain), the MMA of one k-step and the packing of P into A registers."""
    E, LD, Dp, NT, d = g["E"], g["LD"], g["Dp"], g["threads"], g["d"]
    CH = Dp // E                         # chunks of a tile row that hold data
    FULL_D = d == Dp                     # no chunk beyond d: the column test compiles away
    to_f32, from_f32 = storage_conversions(storage)
    tf32 = storage == "float32"
    copy_async = g["copy"] == "async"
    swz, chunk_at, at = _layout(LD, E, swizzle)

    @cuda.jit(device=True, inline="always")
    def to_shared(x):
        """A global element as the shared tile holds it: halves as they are, float32 rounded to TF32 bits."""
        if tf32:
            return mma.to_tf32(x)
        return x

    @cuda.jit(device=True, inline="always")
    def load_chunk(Xz, S, base, r0, N, r, c):
        """Chunk ``c`` of row ``r0 + r`` of ``Xz`` (one head) into row ``r`` of the tile at ``S[base:]``; zeros
        beyond ``N`` rows and ``d`` columns.  Async: one cp.async of 16 bytes (the caller commits and waits; a
        chunk outside the array copies 0 bytes from its row 0); sync: element by element."""
        row = uint32(r0) + uint32(r)
        dst = uint32(base) + chunk_at(r, c)
        if copy_async:
            ok = row < uint32(N) and (FULL_D or uint32(c) * uint32(E) < uint32(d))
            mma.cp_async_16(S, dst, Xz, (row if ok else uint32(0), uint32(c) * uint32(E) if ok else uint32(0)),
                            uint32(16) if ok else uint32(0))
        else:
            for k in range(E):
                col = uint32(c) * uint32(E) + uint32(k)
                v = to_shared(from_f32(ZERO))
                if row < uint32(N) and col < uint32(d):
                    v = to_shared(Xz[row, col])
                S[dst + uint32(k)] = v

    @cuda.jit(device=True, inline="always")
    def load_tile(Xz, S, base, r0, N, ROWS, tid):
        """Rows ``r0 .. r0+ROWS`` of ``Xz`` into the tile at ``S[base:]``: consecutive threads copy consecutive
        chunks of a row (ideal sectors, conflict-free stores); a pass of the block covers ``NT`` chunks.  With
        ``NT`` a multiple of the chunks per row a thread keeps its column and steps its row by a constant (the
        passes unroll: no loop, no division)."""
        if NT % CH == 0:
            for k in range((ROWS * CH + NT - 1) // NT):
                r = uint32(tid // CH) + uint32(k * (NT // CH))
                if (ROWS * CH) % NT == 0 or r < uint32(ROWS):
                    load_chunk(Xz, S, base, r0, N, r, uint32(tid % CH))
        else:
            for k in range((ROWS * CH + NT - 1) // NT):
                e = uint32(tid) + uint32(k * NT)
                if e < uint32(ROWS * CH):
                    load_chunk(Xz, S, base, r0, N, e // uint32(CH), e % uint32(CH))

    if tf32:
        mma_k = mma.mma_m16n8k8_tf32
    elif storage == "bfloat16":
        mma_k = mma.mma_m16n8k16_bf16
    elif arch >= 80:
        mma_k = mma.mma_m16n8k16_f16
    else:
        @cuda.jit(device=True, inline="always")
        def mma_k(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            """sm_75: one k-step of 16 as two m16n8k8 (k 0-7: registers a0, a1, b0; k 8-15: a2, a3, b1)."""
            c0, c1, c2, c3 = mma.mma_m16n8k8_f16(a0, a1, b0, c0, c1, c2, c3)
            return mma.mma_m16n8k8_f16(a2, a3, b1, c0, c1, c2, c3)

    pack2 = mma.pack_bf16x2 if storage == "bfloat16" else mma.pack_f16x2

    @cuda.jit(device=True, inline="always")
    def p_fragment(c00, c01, c02, c03, c10, c11, c12, c13):
        """The A fragment of ``P V_j`` for one k-step from the S accumulators of its 8-key tiles (``c0*``: the
        first, ``c1*``: the second).  Halves: two 8-key tiles, packed in pairs and rounded to the input dtype;
        TF32: one 8-key tile (the ``c1*`` are ignored), its key order permuted (a0 = c0, a1 = c2, a2 = c1,
        a3 = c3) -- V's rows are read in the same order."""
        if tf32:
            return mma.to_tf32(c00), mma.to_tf32(c02), mma.to_tf32(c01), mma.to_tf32(c03)
        return pack2(c00, c01), pack2(c02, c03), pack2(c10, c11), pack2(c12, c13)

    return dict(swz=swz, chunk_at=chunk_at, at=at, load_tile=load_tile, mma_k=mma_k, p_fragment=p_fragment,
                from_f32=from_f32, to_f32=to_f32, to_shared=to_shared)



def _make_bwd_loaders(storage, g, P):
    """The backward's fragment loads (``g``: :func:`~flashnb.kernels.tensorcore.geometry.bwd_geometry`): ``b_cols``
    and ``b_cols_natural`` (B fragments of row-major tiles), ``a_ds`` (dS's A fragments from dSᵀ in shared memory)."""
    LD, LDS, E, DSO = g["LD"], g["LDS"], g["E"], g["offsets"]["dS"]
    TF32 = storage == "float32"
    swz, at = P["swz"], P["at"]
    _, ds_at_chunk, ds_at = _layout(LDS, E)

    @cuda.jit(device=True, inline="always")
    def b_cols(sm, base, k8, n8, lane):
        """The B fragment of one k-step and two 8-wide n-tiles when ``B = X`` (row-major by k, as dO_i in dV, Q_i
        in dK, K_j in dQ): halves by ldmatrix.x4.trans (keys k8 .. k8 + 15, columns n8 .. n8 + 15); TF32 by four
        32-bit loads, rows 2t and 2t + 1 of the 8-row step (the key order of an A fragment made from C registers)."""
        if TF32:
            t4 = uint32(lane % 4)
            g8 = uint32(lane // 4)
            r = uint32(k8) + uint32(2) * t4
            c0 = uint32(n8 // 4) + g8 // uint32(4)
            c1 = uint32(n8 // 4 + 2) + g8 // uint32(4)
            w = g8 % uint32(4)
            v0 = sm[base + r * uint32(LD) + ((c0 ^ swz(r)) * uint32(E)) + w]
            v1 = sm[base + (r + uint32(1)) * uint32(LD) + ((c0 ^ swz(r + uint32(1))) * uint32(E)) + w]
            v2 = sm[base + r * uint32(LD) + ((c1 ^ swz(r)) * uint32(E)) + w]
            v3 = sm[base + (r + uint32(1)) * uint32(LD) + ((c1 ^ swz(r + uint32(1))) * uint32(E)) + w]
            return v0, v1, v2, v3
        return mma.ldmatrix_x4_trans(sm, base + at(k8 + 8 * ((lane // 8) % 2), lane, n8 // 8 + lane // 16))

    @cuda.jit(device=True, inline="always")
    def b_cols_natural(sm, base, k8, n8, lane):
        """As :func:`b_cols` for an A fragment loaded in its natural order (dS from shared memory): TF32 rows t and
        t + 4 of the step.  Halves: the same ldmatrix.trans."""
        if TF32:
            t4 = uint32(lane % 4)
            g8 = uint32(lane // 4)
            r = uint32(k8) + t4
            c0 = uint32(n8 // 4) + g8 // uint32(4)
            c1 = uint32(n8 // 4 + 2) + g8 // uint32(4)
            w = g8 % uint32(4)
            v0 = sm[base + r * uint32(LD) + ((c0 ^ swz(r)) * uint32(E)) + w]
            v1 = sm[base + (r + uint32(4)) * uint32(LD) + ((c0 ^ swz(r + uint32(4))) * uint32(E)) + w]
            v2 = sm[base + r * uint32(LD) + ((c1 ^ swz(r)) * uint32(E)) + w]
            v3 = sm[base + (r + uint32(4)) * uint32(LD) + ((c1 ^ swz(r + uint32(4))) * uint32(E)) + w]
            return v0, v1, v2, v3
        return mma.ldmatrix_x4_trans(sm, base + at(k8 + 8 * ((lane // 8) % 2), lane, n8 // 8 + lane // 16))

    @cuda.jit(device=True, inline="always")
    def a_ds(sm, q16, k0, lane):
        """The A fragment of ``dQ_i = dS K_j`` for queries ``q16 .. q16 + 15`` and one k-step of keys from
        ``k0``, read from dSᵀ (rows = keys): halves by ldmatrix.x4.trans; TF32 by four 32-bit loads."""
        if TF32:
            t4 = uint32(lane % 4)
            g8 = uint32(lane // 4)
            r = uint32(k0) + t4
            c0 = uint32(q16 // 4) + g8 // uint32(4)
            c1 = uint32(q16 // 4 + 2) + g8 // uint32(4)
            w = g8 % uint32(4)
            a0 = sm[DSO + r * uint32(LDS) + ((c0 ^ swz_ds(r)) * uint32(E)) + w]
            a1 = sm[DSO + r * uint32(LDS) + ((c1 ^ swz_ds(r)) * uint32(E)) + w]
            a2 = sm[DSO + (r + uint32(4)) * uint32(LDS) + ((c0 ^ swz_ds(r + uint32(4))) * uint32(E)) + w]
            a3 = sm[DSO + (r + uint32(4)) * uint32(LDS) + ((c1 ^ swz_ds(r + uint32(4))) * uint32(E)) + w]
            return a0, a1, a2, a3
        return mma.ldmatrix_x4_trans(sm, DSO + ds_at(k0 + 8 * (lane // 16), lane, q16 // 8 + (lane // 8) % 2))


    swz_ds = _layout(LDS, E)[0]

    return b_cols, b_cols_natural, a_ds
