"""The fast FA2 loop's building blocks: device functions of compile-time tile constants.

Stage 6's lessons (:func:`flashnb.stages.fa2_fast.make_forward`, :func:`~flashnb.stages.fa2_fast.make_backward`)
compose them into dense and causal kernels; the product kernels (:mod:`flashnb.kernels.simt.forward`,
:mod:`~flashnb.kernels.simt.backward`) compose the same blocks plus the feature policies of
:mod:`flashnb.kernels.policies`.  Each block is made by a factory of the tile constants (``Br``, ``Bc``, ``d`` padded
to ``Dp``, the micro-tile ``TM × TN``) and inlined into the kernel (``inline="always"``), so the per-lane arrays it
takes or declares stay registers and a kernel built from blocks compiles to the code of one written in a single
piece.

Thread layout (both directions, as :mod:`flashnb.stages.fa2_fast` describes): a warp's 32 lanes form ``LR × LC = 4 ×
8``, ``lane = lr·LC + lc``.  In the forward lane ``(lr, lc)`` of warp ``w`` owns query rows ``w·TM·LR + lr + LR·a``,
key columns ``lc + LC·b`` of S and head-dim columns ``32·c + 4·lc + t`` of ``O~``; in the backward the roles of
queries and keys swap (the warps split the ``Bc`` key rows).  Shared tiles are row-major in rows of ``Dp + PAD``
floats (row ``r`` starts in bank ``4r mod 32``), read 4 floats at a time (one ``LDS.128``); every shared index
is ``uint32`` (no negative-index fix-ups) and the loops that stay loops count in ``uint32``.

Forward (FA2 Alg. 1): :func:`make_load_tile` (lines 4 and 7), :func:`make_qk` (line 8),
:func:`make_visible` (the causal / ``Nk`` edge of line 9's mask), :func:`make_softmax_update` (line 9 and the
rescale of line 10), :func:`make_pv` (line 10), :func:`make_forward_epilogue` (lines 12-14).
Backward (FA2 Alg. 2): :func:`make_load_tile` (lines 6, 9), :func:`make_load_stats` (``L_i``, ``D_i``),
:func:`make_qk_dp` (lines 10, 13), :func:`make_dv_dk` (lines 12, 16), :func:`make_dq` (line 15),
:func:`make_backward_epilogue` (line 18).
"""

from __future__ import annotations

import math

from numba import cuda, float32, uint32

from ...common import NEG_INF, ONE, SHARED_LIMIT_BYTES, ZERO, cdiv

__all__ = ["LR", "LC", "VEC", "PAD", "FULL_MASK", "geometry", "shared_bytes", "needs_dynamic", "bwd_geometry",
           "ds_row", "bwd_shared_bytes", "make_load_tile", "make_visible", "make_qk", "make_softmax_update",
           "make_pv", "make_forward_epilogue", "make_load_stats", "make_qk_dp", "make_dv_dk", "make_dq",
           "make_backward_epilogue"]

LR = 4                  # lanes of a warp along its rows
LC = 8                  # lanes of a warp along the key columns of S (and the head-dim chunks of O)
VEC = 4                 # floats per 128-bit shared load
PAD = 4                 # Q_i, K_j rows padded by one 16-byte chunk: row r starts at bank 4r mod 32
FULL_MASK = 0xFFFFFFFF


# --------------------------------------------------------------------------- geometry


def geometry(Br: int, Bc: int, d: int, warps: int) -> dict:
    """The forward's per-lane micro-tile and padded sizes: ``TM`` rows × ``TN`` key columns of S, ``DN`` columns of
    O~; ``Dp = ⌈d/32⌉·32`` is ``d`` padded with zero columns (8 lanes × 4 consecutive columns)."""
    if warps < 1 or Br % (warps * LR):
        raise ValueError(f"Br={Br} must be a multiple of {LR}·warps = {LR * warps} (each warp owns Br/warps rows, "
                         f"{LR} lanes along them)")
    if Bc % LC:
        raise ValueError(f"Bc={Bc} must be a multiple of {LC} (the lanes of a row group)")
    if not 1 <= d <= 128:
        raise ValueError(f"head dim d must be in 1..128, got {d}")
    Dp = cdiv(d, LC * VEC) * LC * VEC
    return dict(TM=Br // (warps * LR), TN=Bc // LC, DN=Dp // LC, Dp=Dp, threads=32 * warps)


def shared_bytes(Br, Bc, d, warps):
    """Shared memory of one forward thread block, in bytes (static, or dynamic above 48 KiB): Q_i and K_j in rows
    of ``Dp + PAD``, V_j in ``Dp``."""
    g = geometry(Br, Bc, d, warps)
    return 4 * ((g["Dp"] + PAD) * (Br + Bc) + g["Dp"] * Bc)


def needs_dynamic(Br, Bc, d, warps) -> bool:
    """Whether these forward tiles need more than 48 KiB of shared memory: then the kernel takes it as dynamic
    shared memory (``dynamic=True``), which needs the driver opt-in on a GPU."""
    return shared_bytes(Br, Bc, d, warps) > SHARED_LIMIT_BYTES


def bwd_geometry(Br, Bc, d, warps):
    """The backward's per-lane micro-tiles.  The warps split the ``Bc`` *key* rows: lane ``(lr, lc)`` of warp
    ``w`` owns key rows ``w·TM·LR + lr + LR·a`` (``a < TM``) and query columns ``lc + LC·b`` (``b < TN``) of
    Sᵀ and dPᵀ, and the ``TM × DN`` micro-tiles of dK_j, dV_j (head-dim columns ``32·c + 4·lc + t``).  For
    line 15 the warps split the ``Br`` query rows instead: ``TQ`` rows × the ``E`` columns ``lane + 32·e``
    of dQ_i (consecutive lanes, consecutive columns: coalesced atomics)."""
    if warps < 1 or Bc % (warps * LR):
        raise ValueError(f"Bc={Bc} must be a multiple of {LR}·warps = {LR * warps} (each warp owns Bc/warps key "
                         f"rows, {LR} lanes along them)")
    if Br % LC or Br % warps:
        raise ValueError(f"Br={Br} must be a multiple of {LC} (the lanes of a row group) and of warps={warps} "
                         f"(each warp owns Br/warps rows of dQ_i)")
    if not 1 <= d <= 128:
        raise ValueError(f"head dim d must be in 1..128, got {d}")
    Dp = cdiv(d, LC * VEC) * LC * VEC
    return dict(TM=Bc // (warps * LR), TN=Br // LC, DN=Dp // LC, Dp=Dp, TQ=Br // warps, E=Dp // 32,
                threads=32 * warps)


def ds_row(Bc):
    """Row length of dS_ij in shared memory: ``Bc + 4`` or ``Bc + 8``, whichever is an odd number of 16-byte
    chunks (the 4 × 8 lanes' stores then hit 32 distinct banks)."""
    return Bc + PAD if (Bc // VEC) % 2 == 0 else Bc + 2 * PAD


def bwd_shared_bytes(Br, Bc, d, warps):
    """Static shared memory of one backward block: K_j, V_j, Q_i, dO_i in rows of ``Dp + PAD``; dS_ij; L_i, D_i."""
    g = bwd_geometry(Br, Bc, d, warps)
    return 4 * ((g["Dp"] + PAD) * 2 * (Br + Bc) + Br * ds_row(Bc) + 2 * Br)


# --------------------------------------------------------------------------- both directions


def make_load_tile(d, Dp, NT, to_f32=float32):
    """The tile copy HBM -> shared memory (a device function of the compile-time ``d``, ``Dp`` and ``NT``);
    ``to_f32`` widens each element as it is loaded (``float32``: no instruction)."""
    # a pass of the NT threads covers RSTEP whole rows, or a row takes KREP whole passes (else 0, 0: the general loop)
    RSTEP, KREP = (NT // Dp, 1) if NT % Dp == 0 else (1, Dp // NT) if Dp % NT == 0 else (0, 0)

    @cuda.jit(device=True, inline="always")
    def load_tile(X, Xs, base, ld, z, r0, N, ROWS, full, tid):
        """Rows ``r0 .. r0+ROWS`` of ``X[z]`` into ``Xs`` from element ``base`` on (rows of ``ld`` floats, zeros
        beyond ``d`` and ``N``).  Consecutive threads copy consecutive floats of a row: ideal sectors, and
        consecutive banks.  A thread keeps its columns (``k0 + NT·c``) and steps its row by ``RSTEP``; a full
        tile (with ``d = Dp``) is copied without a bounds test."""
        if RSTEP == 0:                                  # NT and Dp do not divide one another (Dp = 96)
            e = uint32(tid)
            while e < uint32(ROWS * Dp):
                r = e // uint32(Dp)
                k = e - r * uint32(Dp)
                row = uint32(r0) + r
                Xs[uint32(base) + r * uint32(ld) + k] = to_f32(X[z, row, k]) if row < uint32(N) and k < uint32(d) \
                    else ZERO
                e += uint32(NT)
            return
        r = uint32(tid // Dp) if RSTEP > 1 else uint32(0)
        k0 = uint32(tid % Dp) if RSTEP > 1 else uint32(tid)
        if full and d == Dp:                            # a full tile: no test per element
            while r < uint32(ROWS):
                for c in range(KREP):
                    Xs[uint32(base) + r * uint32(ld) + k0 + uint32(c * NT)] = \
                        to_f32(X[z, uint32(r0) + r, k0 + uint32(c * NT)])
                r = uint32(r + RSTEP)
        else:
            while r < uint32(ROWS):
                row = uint32(r0) + r
                for c in range(KREP):
                    k = k0 + uint32(c * NT)
                    Xs[uint32(base) + r * uint32(ld) + k] = to_f32(X[z, row, k]) \
                        if row < uint32(N) and k < uint32(d) else ZERO
                r = uint32(r + RSTEP)

    return load_tile


def make_visible(causal):
    """The edge of the mask: may query row ``row`` see key ``col``?  ``col < Nk``, and with ``causal`` also
    ``col <= row + diag`` (``diag`` from :func:`flashnb.common.causal_diag`: both alignments)."""

    @cuda.jit(device=True, inline="always")
    def visible(row, col, Nk, diag):
        return col < Nk and not (causal and col > row + diag)

    return visible


# --------------------------------------------------------------------------- forward (FA2 Alg. 1)


def make_qk(TM, TN, Dp, LD):
    """Line 8: ``S = Q_i K_jᵀ`` on this lane's ``TM × TN`` micro-tile."""

    @cuda.jit(device=True, inline="always")
    def qk(Qs, Ks, S, qrow, kcol):
        """4 k per step (32-bit counter): one LDS.128 per query row and per key column, ``4·TM·TN`` FFMAs per
        ``TM + TN`` loads.  ``qrow``, ``kcol``: this lane's first row of Q_i and of K_j in shared memory."""
        qv = cuda.local.array((TM, VEC), float32)
        kv = cuda.local.array((TN, VEC), float32)
        for a in range(TM):
            for b in range(TN):
                S[a, b] = ZERO
        k = uint32(0)
        while k < uint32(Dp):
            for a in range(TM):                        # one LDS.128 per row ...
                for t in range(VEC):
                    qv[a, t] = Qs[qrow + uint32(LR * a * LD + t) + k]
            for b in range(TN):                        # ... and per key column
                for t in range(VEC):
                    kv[b, t] = Ks[kcol + uint32(LC * b * LD + t) + k]
            for t in range(VEC):                       # 4·TM·TN FFMAs per TM + TN loads
                for a in range(TM):
                    for b in range(TN):
                        S[a, b] += qv[a, t] * kv[b, t]
            k = uint32(k + VEC)

    return qk


def make_softmax_update(TN, DN):
    """Line 9 and the rescale of line 10 for one row ``a`` of this lane's micro-tile, its scores already scaled
    and masked in ``S[a, :]`` and ``mx`` their maximum (the caller's scoring loop takes it as it writes them)."""

    @cuda.jit(device=True, inline="always")
    def softmax_update(S, m, l, Oi, a, mx):
        """``m_new = max(m, rowmax S)``, ``P~ = exp(S - m_new)`` in place, ``l = e^(m - m_new)·l + rowsum P~`` (this
        lane's partial sum), ``O~ *= e^(m - m_new)``.  The row max is a butterfly over the 8 lanes of the row
        group; a row with nothing seen yet keeps ``P~ = 0``."""
        mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 1))   # row max over the row group's 8 lanes
        mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 2))
        mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 4))
        m_new = max(m[a], mx)
        alpha = ONE
        rs = ZERO
        if m_new != NEG_INF:
            alpha = float32(math.exp(m[a] - m_new))
            for b in range(TN):
                pb = float32(math.exp(S[a, b] - m_new))
                S[a, b] = pb
                rs += pb
        else:
            for b in range(TN):
                S[a, b] = ZERO
        l[a] = alpha * l[a] + rs                       # this lane's partial row sum
        m[a] = m_new
        for c in range(DN):                            # line 10: O~ = diag(e^(m_old - m_new)) O~ ...
            Oi[a, c] *= alpha

    return softmax_update


def make_pv(TM, TN, CD, Dp):
    """Line 10: ``O~ += P~ V_j`` (P~_ij from its owner lane by ``shfl_sync``; never through shared memory)."""

    @cuda.jit(device=True, inline="always")
    def pv(Vs, S, Oi, lane8, vcol, VO):
        """``lane8``: the first lane of this lane's row group; ``vcol``: its first head-dim column; ``VO``: where
        V_j starts in ``Vs``.  One LDS.128 of V_j feeds ``4·TM`` FFMAs."""
        p = cuda.local.array(TM, float32)
        src = uint32(0)
        while src < uint32(LC):
            for b in range(TN):
                for a in range(TM):
                    p[a] = cuda.shfl_sync(FULL_MASK, S[a, b], lane8 + src)
                j = uint32(VO + src * Dp + LC * b * Dp)
                for c4 in range(CD):
                    for t in range(VEC):
                        vj = Vs[j + vcol + uint32(c4 * LC * VEC + t)]
                        for a in range(TM):
                            Oi[a, c4 * VEC + t] += p[a] * vj
            src = uint32(src + 1)

    return pv


def make_forward_epilogue(Br, TM, CD, Dp, d, NT, from_f32=float32):
    """Lines 12-14: ``O_i = diag(l)^-1 O~_i`` staged in ``Q_i``'s space and stored row by row, ``L_i = m + log l``;
    ``from_f32`` narrows each element of O as it is stored (``float32``: no instruction)."""
    LDO = Dp + 1                                        # row length of O_i staged in Q_i's space (odd)

    @cuda.jit(device=True, inline="always")
    def epilogue(Qs, O, L, Oi, m, l, z, i0, rw, lc, vcol, tid, Nq):
        cuda.syncthreads()                             # every warp is done with Q_i: its space takes O_i
        for a in range(TM):
            ls = l[a]
            ls += cuda.shfl_xor_sync(FULL_MASK, ls, 1)
            ls += cuda.shfl_xor_sync(FULL_MASK, ls, 2)
            ls += cuda.shfl_xor_sync(FULL_MASK, ls, 4)
            inv = ONE / ls if ls > ZERO else ZERO
            orow = uint32((rw + LR * a) * LDO)         # rows of odd length: the 32 lanes hit 32 banks
            for c4 in range(CD):
                for t in range(VEC):
                    Qs[orow + vcol + uint32(c4 * LC * VEC + t)] = Oi[a, c4 * VEC + t] * inv
            row = i0 + rw + LR * a
            if lc == 0 and row < Nq:
                L[z, row] = m[a] + float32(math.log(ls)) if ls > ZERO else NEG_INF
        cuda.syncthreads()
        e = uint32(tid)                                # line 13: O_i to HBM, row by row (ideal sectors)
        while e < uint32(Br * Dp):
            r = e // uint32(Dp)
            k = e - r * uint32(Dp)
            row = uint32(i0) + r
            if row < uint32(Nq) and k < uint32(d):
                O[z, row, k] = from_f32(Qs[r * uint32(LDO) + k])
            e += uint32(NT)

    return epilogue


# --------------------------------------------------------------------------- backward (FA2 Alg. 2)


def make_load_stats(Br, NT):
    """Line 9's statistics: ``L_i`` and ``D_i`` of rows ``i0 ..`` into shared memory (``-inf`` and 0 beyond
    ``Nq``: a padded row then gets ``P = 0``)."""

    @cuda.jit(device=True, inline="always")
    def load_stats(L, D, Ls, Ds, z, i0, Nq, tid):
        for r in range(tid, Br, NT):
            Ls[r] = L[z, i0 + r] if i0 + r < Nq else NEG_INF
            Ds[r] = D[z, i0 + r] if i0 + r < Nq else ZERO

    return load_stats


def make_qk_dp(TM, TN, Dp, LD):
    """Lines 10 and 13 in one loop: ``Sᵀ = K_j Q_iᵀ`` and ``dPᵀ = V_j dO_iᵀ`` on this lane's micro-tiles."""

    @cuda.jit(device=True, inline="always")
    def qk_dp(Ks, Vs, Qs, dOs, S, dP, krow, qcol):
        """4 k per step: one LDS.128 per key row (K_j, V_j) and per query row (Q_i, dO_i), ``8·TM·TN`` FFMAs per
        ``2·(TM + TN)`` loads."""
        kv = cuda.local.array((TM, VEC), float32)
        vv = cuda.local.array((TM, VEC), float32)
        qv = cuda.local.array((TN, VEC), float32)
        ov = cuda.local.array((TN, VEC), float32)
        for a in range(TM):
            for b in range(TN):
                S[a, b] = ZERO
                dP[a, b] = ZERO
        k = uint32(0)
        while k < uint32(Dp):
            for a in range(TM):                        # one LDS.128 per key row ...
                for t in range(VEC):
                    kv[a, t] = Ks[krow + uint32(LR * a * LD + t) + k]
                    vv[a, t] = Vs[krow + uint32(LR * a * LD + t) + k]
            for b in range(TN):                        # ... and per query row
                for t in range(VEC):
                    qv[b, t] = Qs[qcol + uint32(LC * b * LD + t) + k]
                    ov[b, t] = dOs[qcol + uint32(LC * b * LD + t) + k]
            for t in range(VEC):                       # 8·TM·TN FFMAs per 2·(TM + TN) loads
                for a in range(TM):
                    for b in range(TN):
                        S[a, b] += kv[a, t] * qv[b, t]
                        dP[a, b] += vv[a, t] * ov[b, t]
            k = uint32(k + VEC)

    return qk_dp


def make_dv_dk(TM, TN, CD, LD):
    """Lines 12 and 16: ``dV_j += Pᵀ dO_i``, ``dK_j += dSᵀ Q_i`` (``P`` in ``S``, ``dS`` in ``dP``, each from its
    owner lane by ``shfl_sync``)."""

    @cuda.jit(device=True, inline="always")
    def dv_dk(dOs, Qs, S, dP, dKj, dVj, lane8, vcol):
        """One LDS.128 of a row of dO_i (and of Q_i) feeds ``4·TM`` FFMAs into the ``TM × DN`` register tiles of
        dV_j (dK_j), columns ``32·c + 4·lc + t``."""
        p = cuda.local.array(TM, float32)
        ds = cuda.local.array(TM, float32)
        src = uint32(0)
        while src < uint32(LC):
            for b in range(TN):                        # query row src + LC·b: P, dS from their owner lane
                for a in range(TM):
                    p[a] = cuda.shfl_sync(FULL_MASK, S[a, b], lane8 + src)
                    ds[a] = cuda.shfl_sync(FULL_MASK, dP[a, b], lane8 + src)
                j = uint32(src * LD + LC * b * LD)
                for c4 in range(CD):
                    for t in range(VEC):
                        o = dOs[j + vcol + uint32(c4 * LC * VEC + t)]
                        q = Qs[j + vcol + uint32(c4 * LC * VEC + t)]
                        for a in range(TM):
                            dVj[a, c4 * VEC + t] += p[a] * o
                            dKj[a, c4 * VEC + t] += ds[a] * q
            src = uint32(src + 1)

    return dv_dk


def make_dq(TQ, E, Bc, LD, LS, d, Dp):
    """Line 15: ``dQ_i += scale · dS_ij K_j``, the one product that needs every warp's dS (exchanged through
    shared memory); each warp computes ``TQ`` whole rows of dQ_i in registers and adds them into HBM."""

    @cuda.jit(device=True, inline="always")
    def dq(dSs, Ks, dQ, z, i0, q0, lane, scale, qfull, Nq):
        """``dS`` 4 keys at a time by one broadcast LDS.128, ``K_j`` at columns ``lane + 32·e``; atomics whose 32
        lanes hit 32 consecutive floats (ideal sectors)."""
        dQi = cuda.local.array((TQ, E), float32)
        kq = cuda.local.array((E, VEC), float32)
        sv = cuda.local.array(VEC, float32)
        srow = uint32(q0 * LS)
        klane = uint32(lane)
        for q in range(TQ):
            for e in range(E):
                dQi[q, e] = ZERO
        c = uint32(0)
        cK = uint32(0)                                 # c·LD: row c of K_j (base + immediate offsets)
        while c < uint32(Bc):                          # 4 keys per step
            for e in range(E):                         # K_j[c + t, lane + 32·e]: consecutive lanes, banks
                for t in range(VEC):
                    kq[e, t] = Ks[klane + uint32(t * LD + 32 * e) + cK]
            for q in range(TQ):                        # dS_ij[q0 + q, c .. c+3]: one LDS.128, a broadcast
                for t in range(VEC):
                    sv[t] = dSs[srow + uint32(q * LS + t) + c]
                for t in range(VEC):
                    for e in range(E):
                        dQi[q, e] += sv[t] * kq[e, t]
            c = uint32(c + VEC)
            cK = uint32(cK + VEC * LD)
        for q in range(TQ):                            # atomically into HBM (other column blocks add too)
            row = uint32(i0 + q0 + q)                  # unsigned indices: no negative-index fix-ups
            if qfull or row < uint32(Nq):
                for e in range(E):
                    col = klane + uint32(32 * e)
                    if d == Dp or col < uint32(d):     # (a compile-time True when d = Dp)
                        cuda.atomic.add(dQ, (z, row, col), scale * dQi[q, e])

    return dq


def make_backward_epilogue(Bc, TM, CD, Dp, d, NT, from_f32=float32):
    """Line 18: ``dK_j`` (times ``scale``, once) and ``dV_j`` staged in ``K_j``'s and ``V_j``'s space (rows of odd
    length ``Dp + 1``) and stored row by row; ``from_f32`` narrows each element as it is stored."""
    LDO = Dp + 1

    @cuda.jit(device=True, inline="always")
    def epilogue(Ks, Vs, dK, dV, dKj, dVj, z, j0, c0, vcol, tid, scale, Nk):
        cuda.syncthreads()                             # every warp is done with K_j, V_j: they take dK_j, dV_j
        for a in range(TM):
            orow = uint32((c0 + LR * a) * LDO)         # rows of odd length: the 32 lanes hit 32 banks
            for c4 in range(CD):
                for t in range(VEC):
                    Ks[orow + vcol + uint32(c4 * LC * VEC + t)] = scale * dKj[a, c4 * VEC + t]
                    Vs[orow + vcol + uint32(c4 * LC * VEC + t)] = dVj[a, c4 * VEC + t]
        cuda.syncthreads()
        e = uint32(tid)                                # dK_j, dV_j to HBM, row by row (ideal sectors)
        while e < uint32(Bc * Dp):
            r = e // uint32(Dp)
            k = e - r * uint32(Dp)
            row = uint32(j0) + r
            if row < uint32(Nk) and k < uint32(d):
                dK[z, row, k] = from_f32(Ks[r * uint32(LDO) + k])
                dV[z, row, k] = from_f32(Vs[r * uint32(LDO) + k])
            e += uint32(NT)

    return epilogue
