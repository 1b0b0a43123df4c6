"""Stage 7 -- FA2's forward on tensor cores: ``S = Q_i K_jᵀ`` and ``P~_ij V_j`` as ``mma.sync`` (FA2 Alg. 1).

FA2's Section 3.1 argument is about tensor cores: an A100 multiplies float16 matrices 16x faster (312 TFLOP/s) than
it does anything else (19.5 TFLOP/s FP32), so every non-matmul FLOP costs as much as 16 matmul FLOPs.  Stages 4-6
ran the matmuls on the FP32 cores.  Here the same Algorithm 1 runs its two matmuls as warp-level MMAs
(``mma.sync.aligned.m16n8k16``: float16 inputs, float32 accumulators; :mod:`flashnb.kernels.tensorcore.mma` emits
the PTX from Numba and gives each instruction a simulator twin), and four things change against stage 6:

1. **Fragments instead of micro-tiles.**  Warp ``w`` owns the 16 query rows ``16w .. 16w+15`` of ``Q_i``
   (``Br = 16·warps``).  A lane holds pieces of every operand, as the PTX ISA lays them out: with ``g = lane // 4``
   and ``t = lane % 4``, accumulator registers 0, 1 of an 8-column n-tile are row ``g``, columns ``2t, 2t + 1``;
   registers 2, 3 are row ``g + 8``.  A row of ``S_ij`` lives in the 4 lanes of a quad: ``rowmax`` and ``rowsum``
   are two ``shfl_xor`` each.  ``Q_i``'s A fragments are loaded once (``ldmatrix.x4``); ``K_j``, row-major by key,
   *is* ``K_jᵀ`` by column, the B operand of line 8 (``ldmatrix.x4``); ``V_j`` gives the B operand of line 10
   through ``ldmatrix.x4.trans``.
2. **P never leaves the registers.**  The C registers of two neighbouring 8-key n-tiles of ``S_ij``, rounded to
   float16 and packed in pairs, are exactly the A fragment of ``P~_ij V_j`` for one 16-key k-step (as in
   FlashAttention, P is rounded to the input dtype before the second matmul).
3. **Swizzled shared memory.**  A tile row of ``d`` halves is ``d / 8`` chunks of 16 bytes; the 8 rows one
   ``ldmatrix`` matrix reads would all start in the same bank at ``d = 64``.  Chunk ``c`` of row ``r`` is stored at
   chunk ``c ^ swz(r)``, so those 8 rows cover all 32 banks (:func:`swizzled_layout`; :func:`plain_layout` is the
   counter-example notebook 12 profiles).
4. **cp.async double buffering.**  While tile ``j`` is computed, ``K_{j+1}, V_{j+1}`` are already in flight into
   the other buffer (``cp.async.cg``, 16 bytes per lane, rows beyond ``N`` zero-filled); ``cp.async.wait_group 1``
   then a barrier make tile ``j`` visible (region ``kv-load``).

The softmax is FA2's, in base 2 (``exp(scale·s) = exp2(s·scale·log₂e)``, one MUFU.EX2 a score): ``m_i``, ``l_i``
and the unscaled ``O~_i`` per row, ``O~_i`` divided by ``l_i`` once at the end, ``L_i = m_i + log l_i``.

Kernel ``"tensor_cores.forward"`` (:func:`make_forward`): float16 ``Q, K, V, O`` ``(BH, N, d)``, ``L`` float32
``(BH, N)``; dense or causal (``diag``: query ``r`` sees keys ``<= r + diag``; tiles entirely above the diagonal are
never loaded); ``d`` in 16, 32, 64, 128 (a row is a power of two of 16-byte chunks); sm_80 and sm_90.  A lesson,
forward only: what users run on tensor cores is the product kernel (``impl="fa2-tc"``: bfloat16, float32 through
TF32, any ``d <= 128``, the backward, grouped K/V heads, dropout, attention modifiers, sm_75), built from the same
instructions.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32
from numba.core.types import float16  # noqa: E402  (numba exports no float16 at the top level)

from ..common import (
    NEG_INF,
    ONE,
    ZERO,
    causal_diag,
    cdiv,
    check_shared_fit,
    empty,
    launch,
    storage_array_type,
    storage_conversions,
    storage_of,
    to_device,
)
from ..kernels.tensorcore import mma
from ..kernels.tensorcore.mma import SHARED_ALIGN
from ..registry import kernel_factory

__all__ = ["make_forward", "make_tile", "swizzled_layout", "plain_layout", "tile_copy", "forward", "attention",
           "geometry", "default_tiles", "shared_bytes", "HEAD_DIMS", "ARCHS"]

LOG2E = float32(1.4426950408889634)
LN2 = float32(0.6931471805599453)
FULL_MASK = 0xFFFFFFFF
#: The head dims of the lesson: a tile row is a power of two of 16-byte chunks (the swizzle's XOR stays in the row).
HEAD_DIMS = (16, 32, 64, 128)
#: mma.m16n8k16 and cp.async: sm_80 and newer.
ARCHS = ((8, 0), (9, 0))

_H = storage_array_type("float16")
_SIG = f"void({_H}, {_H}, {_H}, {_H}, float32[:, ::1], float32, int32)"


def geometry(d: int, Br: int, Bc: int, warps: int) -> dict:
    """Sizes of one configuration: ``KD`` k-steps of 16 over ``d`` (line 8), ``NB`` 8-key n-tiles of ``S_ij``,
    ``ND`` 8-wide n-tiles of ``O~_i``, ``KV`` k-steps of 16 keys (line 10), ``CH`` 16-byte chunks (8 halves) a
    row.  ValueError naming what is wrong."""
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim d must be one of {HEAD_DIMS} for the stage-7 lesson, got {d} (the product "
                         "kernel, impl='fa2-tc', takes any d <= 128)")
    for name, v in (("Br", Br), ("Bc", Bc), ("warps", warps)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if Br != 16 * warps:
        raise ValueError(f"Br={Br} must be 16·warps = {16 * warps}: each warp owns one m-tile of 16 query rows")
    if Bc % 16:
        raise ValueError(f"Bc={Bc} must be a multiple of 16 (the k-steps of 16 keys of P~_ij V_j)")
    return dict(KD=d // 16, NB=Bc // 8, ND=d // 8, KV=Bc // 16, CH=d // 8, threads=32 * warps)


def default_tiles(d: int) -> dict:
    """The default ``Br, Bc, warps`` at head dim ``d``: four warps, ``Bc = 64`` (``32`` at d = 128, where
    ``Q_i`` and two buffers of ``K_j, V_j`` then fill the 48 KiB a block may declare)."""
    geometry(d, 64, 32, 4)
    return dict(Br=64, Bc=64 if d <= 64 else 32, warps=4)


def shared_bytes(d, Br, Bc, warps) -> int:
    """Static shared memory of one block: ``Q_i``, and two buffers each of ``K_j`` and ``V_j``, in halves."""
    geometry(d, Br, Bc, warps)
    return 2 * (Br * d + 4 * Bc * d)


def _configs():
    """What the PTX guard compiles: the default tiles at d = 64 and 128, causal off and on."""
    return [dict(**default_tiles(d), d=d, causal=c) for d in (64, 128) for c in (False, True)]


# --------------------------------------------------------------------------- shared-memory layout and copies


def swizzled_layout(CH):
    """``chunk_at(r, c)``: the shared index of chunk ``c`` of tile row ``r`` (rows of ``CH`` chunks of 8 halves),
    stored at chunk ``c ^ swz(r)``.  ``RS`` rows share a 128-byte line of the 32 banks; ``swz`` gives the 8 rows of
    an ldmatrix matrix 8 different 16-byte slots of the banks: no conflict."""
    RS = max(1, 8 // CH)                 # rows that share a line of banks (rows shorter than 8 chunks)
    SM = min(CH, 8)                      # the swizzle's period in chunks

    @cuda.jit(device=True, inline="always")
    def chunk_at(r, c):
        return uint32(r) * uint32(8 * CH) + ((uint32(c) ^ ((uint32(r) // uint32(RS)) % uint32(SM))) * uint32(8))

    return chunk_at


def plain_layout(CH):
    """``chunk_at(r, c)`` without a swizzle: chunk ``c`` of row ``r`` where it is (at d = 64 the 8 rows of an
    ldmatrix matrix all start in bank 0: 8-way conflicts)."""

    @cuda.jit(device=True, inline="always")
    def chunk_at(r, c):
        return uint32(r) * uint32(8 * CH) + uint32(c) * uint32(8)

    return chunk_at


def tile_copy(CH, NT, chunk_at):
    """``load_tile(X, S, base, r0, N, ROWS, tid)``: rows ``r0 .. r0+ROWS`` of ``X`` (one head, ``(N, d)``) into the
    tile at ``S[base:]``, one ``cp.async`` of 16 bytes a chunk (consecutive threads copy consecutive chunks of a row:
    whole sectors); a row at or beyond ``N`` is zero-filled (0 bytes copied).  The caller commits and waits."""

    @cuda.jit(device=True, inline="always")
    def load_tile(X, S, base, r0, N, ROWS, tid):
        for k in range((ROWS * CH + NT - 1) // NT):
            e = tid + k * NT
            if e < ROWS * CH:
                r, c = e // CH, e % CH
                row = uint32(r0 + r)
                ok = row < uint32(N)
                mma.cp_async_16(S, uint32(base) + chunk_at(r, c), X, (row if ok else uint32(0), uint32(8 * c)),
                                uint32(16) if ok else uint32(0))

    return load_tile


# --------------------------------------------------------------------------- one K/V tile: Alg. 1 lines 8-10


def make_tile(Bc, d, causal, chunk_at):
    """``kv_tile(Ks, Vs, kb, qa, s, o, m, lsum, r0, j0, lane, Nk, diag, sl2, masked)``: FA2 Alg. 1 lines 8-10 for
    one K/V tile (``K_j, V_j`` at ``kb`` of ``Ks, Vs``) on one warp's 16 query rows from ``r0``: ``qa`` its ``Q_i``
    fragments, ``s`` the ``S_ij`` / ``P~_ij`` accumulators, ``o`` ``O~_i``, ``m``, ``lsum`` this lane's ``m_i`` and
    part of ``l_i`` for rows ``g``, ``g + 8``.  ``masked``: the tile crosses the end of the keys or the diagonal."""
    KD, NB, ND, KV = d // 16, Bc // 8, d // 8, Bc // 16
    mma_k = mma.mma_m16n8k16_f16

    @cuda.jit(device=True, inline="always")
    def kv_tile(Ks, Vs, kb, qa, s, o, m, lsum, r0, j0, lane, Nk, diag, sl2, masked):
        g, t = lane // 4, lane % 4                       # PTX's groupID and threadID_in_group
        # region scores
        for nb in range(NB):                             # line 8: S_ij = Q_i K_jᵀ, in n-tiles of 8 keys
            for c in range(4):
                s[nb, c] = ZERO
        for kk in range(KD):                             # k-steps of 16 over d
            for nb in range(0, NB, 2):                   # one ldmatrix.x4: the B fragments of n-tiles nb, nb + 1
                b0, b1, b2, b3 = mma.ldmatrix_x4(Ks, kb + chunk_at(8 * nb + 8 * (lane // 16) + lane % 8,
                                                                   2 * kk + (lane // 8) % 2))
                s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3] = mma_k(
                    qa[kk, 0], qa[kk, 1], qa[kk, 2], qa[kk, 3], b0, b1, s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3])
                s[nb + 1, 0], s[nb + 1, 1], s[nb + 1, 2], s[nb + 1, 3] = mma_k(
                    qa[kk, 0], qa[kk, 1], qa[kk, 2], qa[kk, 3], b2, b3,
                    s[nb + 1, 0], s[nb + 1, 1], s[nb + 1, 2], s[nb + 1, 3])
        # endregion scores
        # region online-softmax
        for h in range(2):                               # line 9, rows r0 + g + 8h: registers 2h, 2h + 1
            row = r0 + g + 8 * h
            mx = NEG_INF
            for nb in range(NB):
                for e in range(2):
                    x = s[nb, 2 * h + e] * sl2           # base 2: exp(scale·s) = exp2(s·scale·log2 e)
                    col = j0 + 8 * nb + 2 * t + e
                    if masked and (col >= Nk or (causal and col > row + diag)):
                        x = NEG_INF
                    s[nb, 2 * h + e] = x
                    mx = max(mx, x)
            mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 1))   # rowmax(S_ij): a row lives in a quad of lanes
            mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 2))
            m_new = max(m[h], mx)                        # m_i^(j) = max(m_i^(j-1), rowmax(S_ij))
            m_use = ZERO if m_new == NEG_INF else m_new  # a row with no key yet: exp2(-inf - 0) = 0, no NaN
            alpha = mma.exp2(m[h] - m_use)               # e^(m_i^(j-1) - m_i^(j))
            m[h] = m_new
            rs = ZERO
            for nb in range(NB):
                for e in range(2):
                    p = mma.exp2(s[nb, 2 * h + e] - m_use)   # P~_ij = exp(S_ij - m_i^(j))
                    s[nb, 2 * h + e] = p
                    rs += p
            lsum[h] = alpha * lsum[h] + rs               # l_i^(j), this lane's part (the quad's are added at the end)
            for dn in range(ND):                         # line 10: O~_i = diag(e^(m_i^(j-1) - m_i^(j))) O~_i ...
                o[dn, 2 * h] *= alpha
                o[dn, 2 * h + 1] *= alpha
        # endregion online-softmax
        # region p-times-v
        for kv in range(KV):                             # ... + P~_ij V_j, in k-steps of 16 keys
            # region p-fragment
            a0 = mma.pack_f16x2(s[2 * kv, 0], s[2 * kv, 1])          # the C registers of n-tiles 2kv, 2kv + 1,
            a1 = mma.pack_f16x2(s[2 * kv, 2], s[2 * kv, 3])          # rounded to float16 and packed in pairs:
            a2 = mma.pack_f16x2(s[2 * kv + 1, 0], s[2 * kv + 1, 1])  # the A fragment of P~_ij for keys
            a3 = mma.pack_f16x2(s[2 * kv + 1, 2], s[2 * kv + 1, 3])  # 16kv .. 16kv + 15
            # endregion p-fragment
            for dn in range(0, ND, 2):                   # one ldmatrix.x4.trans: V_j's B fragments, n-tiles dn, dn+1
                v0, v1, v2, v3 = mma.ldmatrix_x4_trans(Vs, kb + chunk_at(16 * kv + 8 * ((lane // 8) % 2) + lane % 8,
                                                                         dn + lane // 16))
                o[dn, 0], o[dn, 1], o[dn, 2], o[dn, 3] = mma_k(
                    a0, a1, a2, a3, v0, v1, o[dn, 0], o[dn, 1], o[dn, 2], o[dn, 3])
                o[dn + 1, 0], o[dn + 1, 1], o[dn + 1, 2], o[dn + 1, 3] = mma_k(
                    a0, a1, a2, a3, v2, v3, o[dn + 1, 0], o[dn + 1, 1], o[dn + 1, 2], o[dn + 1, 3])
        # endregion p-times-v

    return kv_tile


# --------------------------------------------------------------------------- the kernel: Alg. 1 lines 1-7, 11-15


@kernel_factory("tensor_cores.forward", stage="7", signature=_SIG, configs=_configs(), archs=ARCHS,
                threads=lambda warps, **_: 32 * warps)
def make_forward(Br, Bc, d, warps, causal):
    """FA2 Alg. 1 on tensor cores for one ``(Br, Bc, d, warps, causal)``; grid ``(Tr, BH)``, ``32·warps`` threads:
    block ``i`` computes ``O_i, L_i``, warp ``w`` its query rows ``i·Br + 16w .. i·Br + 16w + 15``."""
    G = geometry(d, Br, Bc, warps)
    KD, NB, ND, CH, NT = G["KD"], G["NB"], G["ND"], G["CH"], G["threads"]
    QN, KN, KN2 = Br * d, Bc * d, 2 * Bc * d             # halves of Q_i, K_j (V_j), two K_j buffers: constants
    from_f32 = storage_conversions("float16")[1]
    # region layout
    chunk_at = swizzled_layout(CH)
    # endregion layout
    load_tile = tile_copy(CH, NT, chunk_at)
    kv_tile = make_tile(Bc, d, causal, chunk_at)

    @cuda.jit
    def tc_forward(Q, K, V, O, L, scale, diag):
        Qs = cuda.shared.array(QN, float16, alignment=SHARED_ALIGN)       # Q_i (swizzled rows)
        Ks = cuda.shared.array(KN2, float16, alignment=SHARED_ALIGN)      # K_j and K_{j+1}: two buffers
        Vs = cuda.shared.array(KN2, float16, alignment=SHARED_ALIGN)      # V_j and V_{j+1}
        qa = cuda.local.array((KD, 4), uint32)           # registers: Q_i's A fragments, this warp's 16 rows
        s = cuda.local.array((NB, 4), float32)           # registers: S_ij, then P~_ij (C layout)
        o = cuda.local.array((ND, 4), float32)           # registers: the unscaled O~_i (C layout)
        m = cuda.local.array(2, float32)                 # m_i of this lane's rows g, g + 8 (base 2)
        lsum = cuda.local.array(2, float32)              # this lane's part of l_i
        z, i0 = cuda.blockIdx.y, cuda.blockIdx.x * Br    # head, first query row of Q_i
        tid = cuda.threadIdx.x
        lane = tid % 32
        w16 = 16 * (tid // 32)                           # the warp's first row in Q_i
        Nq, Nk = Q.shape[1], K.shape[1]
        sl2 = scale * LOG2E
        # region causal-skip
        Tc = (Nk + Bc - 1) // Bc
        if causal:                                       # K/V tiles entirely above the diagonal: never loaded
            last = min(i0 + Br, Nq) - 1 + diag           # the last key any row of Q_i may see
            Tc = min(Tc, last // Bc + 1) if last >= 0 else 0
        # endregion causal-skip
        load_tile(Q[z], Qs, 0, i0, Nq, Br, tid)          # line 4: load Q_i ...
        mma.cp_async_commit()
        if Tc > 0:                                       # ... with K_1, V_1 in flight behind it
            load_tile(K[z], Ks, 0, 0, Nk, Bc, tid)
            load_tile(V[z], Vs, 0, 0, Nk, Bc, tid)
        mma.cp_async_commit()
        mma.cp_async_wait_group(1)                       # Q_i has landed
        cuda.syncthreads()
        for kk in range(KD):                             # Q_i's A fragments, once: lane l addresses row l % 16
            qa[kk, 0], qa[kk, 1], qa[kk, 2], qa[kk, 3] = mma.ldmatrix_x4(
                Qs, chunk_at(w16 + 8 * ((lane // 8) % 2) + lane % 8, 2 * kk + lane // 16))
        for h in range(2):                               # line 5: O~_i = 0, l_i = 0, m_i = -inf
            m[h] = NEG_INF
            lsum[h] = ZERO
        for dn in range(ND):
            for c in range(4):
                o[dn, c] = ZERO
        for j in range(Tc):                              # line 6: for 1 <= j <= Tc
            kb = (j % 2) * KN                            # K_j, V_j are in buffer j mod 2
            # region kv-load
            if j + 1 < Tc:                               # line 7, pipelined: K_{j+1}, V_{j+1} fly while j computes
                load_tile(K[z], Ks, KN - kb, (j + 1) * Bc, Nk, Bc, tid)
                load_tile(V[z], Vs, KN - kb, (j + 1) * Bc, Nk, Bc, tid)
                mma.cp_async_commit()
                mma.cp_async_wait_group(1)               # all but the newest group: K_j, V_j have landed
            else:
                mma.cp_async_wait_group(0)
            cuda.syncthreads()                           # K_j, V_j visible to every warp
            # endregion kv-load
            j0 = j * Bc
            masked = j0 + Bc > Nk or (causal and j0 + Bc - 1 > i0 + diag)   # the end of the keys, the diagonal
            kv_tile(Ks, Vs, kb, qa, s, o, m, lsum, i0 + w16, j0, lane, Nk, diag, sl2, masked)   # lines 8-10
            cuda.syncthreads()                           # every warp is done with buffer j mod 2 (refilled next)
        # region epilogue
        g, t = lane // 4, lane % 4
        for h in range(2):                               # lines 12-15, rows g and g + 8 of the warp's m-tile
            l = lsum[h]
            l += cuda.shfl_xor_sync(FULL_MASK, l, 1)     # l_i: the quad's parts
            l += cuda.shfl_xor_sync(FULL_MASK, l, 2)
            row = i0 + w16 + g + 8 * h
            inv = ONE / l if l > ZERO else ZERO          # a row with no key: O_i = 0, L_i = -inf
            if row < Nq:
                for dn in range(ND):                     # line 12: O_i = diag(l_i)^-1 O~_i
                    O[z, row, 8 * dn + 2 * t] = from_f32(o[dn, 2 * h] * inv)
                    O[z, row, 8 * dn + 2 * t + 1] = from_f32(o[dn, 2 * h + 1] * inv)
                if t == 0:                               # line 13: L_i = m_i + log(l_i) (m_i in base 2)
                    L[z, row] = (m[h] + float32(math.log2(l))) * LN2 if l > ZERO else NEG_INF
        # endregion epilogue

    return tc_forward


# --------------------------------------------------------------------------- host


def _tiles(d, Br, Bc, warps):
    """The tiles of a launch: the defaults, with ``Br = 16·warps`` following whichever of the two is given."""
    t = default_tiles(d)
    if warps is not None:
        t.update(warps=warps, Br=16 * warps if Br is None else Br)
    elif Br is not None:
        t.update(Br=Br, warps=max(1, Br // 16))
    if Bc is not None:
        t["Bc"] = Bc
    geometry(d, t["Br"], t["Bc"], t["warps"])
    check_shared_fit("tensor_cores", f"Br={t['Br']}, Bc={t['Bc']} at d={d}", shared_bytes(d, **t),
                     "choose a smaller Bc")
    return t


def forward(q, k, v, *, causal=False, scale, Br=None, Bc=None, warps=None):
    """Device arrays in (float16, ``(BH, N, d)``), ``(O, L)`` out (O float16, L float32): FA2 Alg. 1 on tensor
    cores.  ``causal``: True (bottom-right aligned) or ``"upper_left"``.  ``Br, Bc, warps`` default to
    :func:`default_tiles`."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if storage_of(a) != "float16":
            raise TypeError(f"the stage-7 lesson takes float16 {name}, got dtype {np.dtype(a.dtype)} (the product "
                            "kernel, impl='fa2-tc', also takes bfloat16 and float32)")
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    if k.shape != (BH, Nk, d) or v.shape != k.shape:
        raise ValueError(f"k and v must be (BH, Nk, d) = (BH={BH}, Nk, d={d}), got {k.shape} and {v.shape}")
    t = _tiles(d, Br, Bc, warps)
    O = empty((BH, Nq, d), storage="float16")
    L = empty((BH, Nq))
    launch(make_forward(t["Br"], t["Bc"], d, t["warps"], bool(causal)), (cdiv(Nq, t["Br"]), BH), 32 * t["warps"],
           q, k, v, O, L, scale, causal_diag(causal, Nq, Nk), label="FA2 tensor-core forward (lesson)")
    return O, L


def attention(q, k, v, *, causal=False, scale=None, Br=None, Bc=None, warps=None):
    """NumPy in, NumPy out: ``q`` ``(..., Nq, d)``, ``k, v`` ``(..., Nk, d)``, cast to float16; returns ``(o, lse)``
    (o float16, lse float32), as :func:`forward` computes them.  ``scale`` defaults to ``1/sqrt(d)``."""
    q, k, v = (np.asarray(a) for a in (q, k, v))
    *lead, Nq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dev = [to_device(a.reshape(-1, a.shape[-2], d), "float16") for a in (q, k, v)]
    O, L = forward(*dev, causal=causal, scale=scale, Br=Br, Bc=Bc, warps=warps)
    return O.copy_to_host().reshape(*lead, Nq, d), L.copy_to_host().reshape(*lead, Nq)
