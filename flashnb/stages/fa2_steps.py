"""Stage 4, step by step -- the ladder from FA2's Algorithm 1 to the warp-partitioned kernel of
:mod:`flashnb.stages.fa2`.

The kernel in :mod:`flashnb.stages.fa2` does three things at once: it runs FA2 Alg. 1, it splits the query rows of
a block over warps (split-Q), and it gives every lane a register micro-tile (lanes along rows *and*
columns, ``P~`` passed by shuffles).  This module separates them into steps, each a real kernel with its
own launcher and exact traffic model:

* :func:`fa2_forward_numpy` / :func:`fa2_backward_numpy` -- FA2 Alg. 1 and Alg. 2 transcribed into float64
  NumPy, every block tagged with the line it implements.
* **step (a)** :func:`make_rows_forward` (``impl="fa2-rows"``) -- one thread per query row: Alg. 1 with
  delayed rescaling and ``L = m + log l``, nothing else.  Grid ``(Tr, BH)``, ``Br`` threads; ``K_j, V_j``
  in shared memory, loaded by all threads together; the thread's row of ``Q_i`` and of ``O~_i`` in local
  arrays (thread-private; ``d`` floats each are too many for registers at d = 128, so the loops stay rolled
  and the arrays live in local memory -- ``flashnb inspect`` reports them as stack bytes).
* **step (b)** :func:`make_splitq_forward` (``impl="fa2-splitq"``) -- the same algorithm with the block's
  ``Br`` rows split over ``W`` warps: warp ``w`` owns ``Br/W`` rows, ``R = Br/(32·W)`` per lane;
  ``Q_i`` is in shared memory (Alg. 1 line 4, as in FA1 and in :mod:`flashnb.stages.fa2`); no warp ever reads
  another warp's result.
* **step (c)** is :func:`flashnb.stages.fa2.make_forward` itself (``impl="fa2"``): split-Q plus register micro-tiles.

The backward has the same ladder (FA2 Alg. 2; the grid is over K/V column blocks, so a block's "own" rows are
key rows and every block adds into ``dQ``):

* **step (a)** :func:`make_rows_backward` (``impl="fa2-rows"``'s backward) -- one thread per key row: its rows
  of ``K_j, V_j`` and of ``dK_j, dV_j`` thread-private, the query tile ``Q_i, dO_i, L_i, D_i`` in shared
  memory, and each thread adding its own ``scale·dS_ij·k_j`` into ``dQ`` with ``d`` atomics per query row it
  sees: ``Nq·Nk·d`` atomics in all (fewer with ``causal``).
* **step (b)** :func:`make_splitq_backward` (``impl="fa2-splitq"``'s backward) -- the block's ``Bc`` key rows
  split over warps, ``K_j, V_j`` in shared memory, and ``dS_ij`` staged in shared memory so that all threads
  form ``dQ_i += scale·dS_ij K_j`` and add it once: one atomic per element of ``dQ_i`` per tile, ``Bc`` times
  fewer than step (a) -- Alg. 2 line 15 as the paper writes it.
* **step (c)** is :func:`flashnb.stages.fa2.make_backward`: the same exchange, with register micro-tiles,
  padded transposed tiles and ``P``, ``dS`` passed between lanes by shuffles.

Shared-memory reads per FMA in the forward's inner loops, which is what its steps change (``d`` = head dim):
(a) ``S``: one ``K_j`` read per FMA, ``P~V``: one ``V_j`` read per FMA -- 1 FMA per shared read, paid for
with ``2d`` thread-private floats for its ``Q`` and ``O~`` rows; (b) ``S`` reads ``Q_i`` *and* ``K_j`` per
FMA -- 2/3 FMA per shared read, the same inner loop as FA1's split-K kernel minus FA1's merge of the
warps' partial results; (c) micro-tiles, ``TM·TN`` FMAs per ``TM + TN`` reads
(:func:`flashnb.stages.fa2.fmas_per_shared_read`).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from ..common import NEG_INF, ONE, ZERO, causal_allowed, cdiv, check_shared_fit, empty, launch, load_rows, load_rows_T
from ..kernels.policies.tiles import kv_tile_count, q_tile_range
from ..registry import kernel_factory, register_impl
from . import fa2

__all__ = ["fa2_forward_numpy", "fa2_backward_numpy", "make_rows_forward", "make_splitq_forward",
           "make_rows_backward", "make_splitq_backward", "forward_rows", "forward_splitq", "backward_rows",
           "backward_splitq", "model_rows_forward", "model_splitq_forward", "model_rows_backward",
           "model_splitq_backward", "rows_tiles", "splitq_tiles", "shared_bytes", "WARP"]

WARP = 32

_A3 = "float32[:, :, ::1]"
_A2 = "float32[:, ::1]"
_FWD_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, float32, int32)"


# --------------------------------------------------------------------------- NumPy transcriptions


def _tau(d, scale):
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _causal_mask(S, i0, j0, diag):
    """Alg. 2 of FA1 / Section 3.1.1 of FA2: key ``j`` allowed for query ``i`` iff ``j <= i + diag``."""
    rows = np.arange(i0, i0 + S.shape[0])[:, None]
    cols = np.arange(j0, j0 + S.shape[1])[None, :]
    return np.where(cols <= rows + diag, S, -np.inf)


def fa2_forward_numpy(Q, K, V, Br, Bc, causal=False, scale=None):
    """FA2 Algorithm 1 in float64 NumPy, loops and all: ``Q (Nq, d)``, ``K, V (Nk, d)`` -> ``(O, L)``.

    Line numbers are those of the paper (Dao 2023, Alg. 1).  Line 10 is written as the code computes it,
    ``O~ = diag(e^(m_old - m_new)) O~ + P~ V_j``: the paper prints ``diag(...)^-1`` there, which is a typo
    (Dao-AILab/flash-attention issue #991).  ``causal``: bottom-right aligned (``j <= i + Nk - Nq``), K/V
    blocks entirely above the diagonal skipped (Section 3.1.1)."""
    Q, K, V = (np.asarray(a, dtype=np.float64) for a in (Q, K, V))
    Nq, d = Q.shape
    Nk = K.shape[0]
    tau, diag = _tau(d, scale), Nk - Nq
    O = np.zeros((Nq, d))                                          # line 2: O, L divided into Tr blocks
    L = np.zeros(Nq)
    for i0 in range(0, Nq, Br):                                    # line 3: for 1 <= i <= Tr
        Qi = Q[i0:i0 + Br]                                         # line 4: load Q_i to SRAM
        Oi = np.zeros((len(Qi), d))                                # line 5: O~ = 0, l = 0, m = -inf
        li = np.zeros(len(Qi))
        mi = np.full(len(Qi), -np.inf)
        for j0 in range(0, Nk, Bc):                                # line 6: for 1 <= j <= Tc
            if causal and j0 > i0 + len(Qi) - 1 + diag:
                break                                              # (Sec. 3.1.1) every later block is masked
            Kj, Vj = K[j0:j0 + Bc], V[j0:j0 + Bc]                  # line 7: load K_j, V_j to SRAM
            S = tau * Qi @ Kj.T                                    # line 8: S = Q_i K_jᵀ (scaled)
            if causal:
                S = _causal_mask(S, i0, j0, diag)
            m_new = np.maximum(mi, S.max(axis=1))                  # line 9: m_new = max(m, rowmax S)
            safe = np.where(np.isfinite(m_new), m_new, 0.0)        #   (a row with no key yet: P~ = 0)
            P = np.exp(S - safe[:, None])                          # line 9: P~ = exp(S - m_new)
            alpha = np.exp(mi - safe)                              #   e^(m_old - m_new)
            li = alpha * li + P.sum(axis=1)                        # line 9: l = e^(m_old - m_new) l + rowsum P~
            Oi = alpha[:, None] * Oi + P @ Vj                      # line 10: O~ = diag(e^(m_old - m_new)) O~ + P~ V_j
            mi = m_new
        seen = li > 0                                              # rows with no allowed key keep O = 0, L = -inf
        O[i0:i0 + Br] = np.where(seen[:, None], Oi / np.where(seen, li, 1.0)[:, None], 0.0)   # line 12
        L[i0:i0 + Br] = np.where(seen, mi + np.log(np.where(seen, li, 1.0)), -np.inf)         # line 13
    return O, L                                                    # lines 14-15, 17: write and return O, L


def fa2_backward_numpy(Q, K, V, O, dO, L, Br, Bc, causal=False, scale=None):
    """FA2 Algorithm 2 in float64 NumPy: ``(dQ, dK, dV)`` from ``Q, K, V, O, dO`` and ``L = m + log l``.

    Line numbers are the paper's (Dao 2023, Alg. 2), with the softmax scale ``tau`` written out (the
    paper's ``S = Q Kᵀ`` leaves it implicit).  ``causal`` as in :func:`fa2_forward_numpy`: query blocks
    entirely above the diagonal of column block ``j`` are skipped."""
    Q, K, V, O, dO, L = (np.asarray(a, dtype=np.float64) for a in (Q, K, V, O, dO, L))
    Nq, d = Q.shape
    Nk = K.shape[0]
    tau, diag = _tau(d, scale), Nk - Nq
    dQ = np.zeros((Nq, d))                                         # line 3: dQ = 0 in HBM
    dK = np.zeros((Nk, d))
    dV = np.zeros((Nk, d))
    D = (dO * O).sum(axis=1)                                       # line 4: D = rowsum(dO ∘ O)
    for j0 in range(0, Nk, Bc):                                    # line 5: for 1 <= j <= Tc
        Kj, Vj = K[j0:j0 + Bc], V[j0:j0 + Bc]                      # line 6: load K_j, V_j to SRAM
        dKj = np.zeros_like(Kj)                                    # line 7: dK_j = dV_j = 0 on chip
        dVj = np.zeros_like(Vj)
        for i0 in range(0, Nq, Br):                                # line 8: for 1 <= i <= Tr
            if causal and j0 > i0 + min(Br, Nq - i0) - 1 + diag:
                continue                                           # (Sec. 3.1.1) block entirely masked
            Qi, dOi = Q[i0:i0 + Br], dO[i0:i0 + Br]                # line 9: load Q_i, dO_i, L_i, D_i
            Li, Di = L[i0:i0 + Br], D[i0:i0 + Br]
            S = tau * Qi @ Kj.T                                    # line 10: S = Q_i K_jᵀ (scaled)
            if causal:
                S = _causal_mask(S, i0, j0, diag)
            P = np.exp(S - np.where(np.isfinite(Li), Li, 0.0)[:, None])   # line 11: P = exp(S - L_i)
            dVj += P.T @ dOi                                       # line 12: dV_j += Pᵀ dO_i
            dP = dOi @ Vj.T                                        # line 13: dP = dO_i V_jᵀ
            dS = P * (dP - Di[:, None])                            # line 14: dS = P ∘ (dP - D_i)
            dQ[i0:i0 + Br] += tau * dS @ Kj                        # line 15: dQ_i += dS K_j (atomics in HBM)
            dKj += tau * dS.T @ Qi                                 # line 16: dK_j += dSᵀ Q_i
        dK[j0:j0 + Bc], dV[j0:j0 + Bc] = dKj, dVj                  # line 18: write dK_j, dV_j
    return dQ, dK, dV                                              # line 20


# --------------------------------------------------------------------------- kernels


def _rows_configs():
    return [dict(Br=32, Bc=32, d=16, causal=False), dict(Br=32, Bc=32, d=64, causal=True),
            dict(Br=32, Bc=32, d=128, causal=True), dict(Br=16, Bc=16, d=20, causal=False)]


@kernel_factory("fa2_steps.rows", stage="4", signature=_FWD_SIG, configs=_rows_configs(),
                threads=lambda Br, **_: Br)
def make_rows_forward(Br, Bc, d, causal):
    """Step (a): FA2 Alg. 1, one thread per query row; grid ``(Tr, BH)``, block ``Br`` threads."""

    @cuda.jit
    def fa2_rows(Q, K, V, O, L, scale, diag):
        K_j = cuda.shared.array((Bc, d), float32)    # SRAM: the K/V tile all rows of the block read
        V_j = cuda.shared.array((Bc, d), float32)
        q = cuda.local.array(d, float32)             # thread-private: this thread's row of Q_i,
        o = cuda.local.array(d, float32)             # of the unscaled O~_i,
        s = cuda.local.array(Bc, float32)            # and of S_ij, then P~_ij
        z = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        i0 = cuda.blockIdx.x * Br
        i = i0 + tid                                 # this thread's query row
        Nq = Q.shape[1]
        Nk = K.shape[1]
        dd = Q.shape[2]   # = d, read at run time so the compiler keeps the d-loops rolled (no spills at d = 128)
        active = i < Nq
        for x in range(dd):                          # Alg. 1 line 4 (this row only, not to SRAM), line 5
            q[x] = Q[z, i, x] if active else ZERO
            o[x] = ZERO
        m = NEG_INF
        l = ZERO
        for jt in range(kv_tile_count(i0, Br, Bc, Nq, Nk, diag, causal)):   # line 6
            j0 = jt * Bc
            cuda.syncthreads()                       # every row is done with K_{j-1}, V_{j-1}
            load_rows(K, z, j0, K_j, tid, Br)        # line 7: load K_j, V_j (all threads, coalesced)
            load_rows(V, z, j0, V_j, tid, Br)
            cuda.syncthreads()
            if active:
                m_new = m
                for c in range(Bc):                  # line 8: S = scale · q K_jᵀ (masked); one read per FMA
                    acc = ZERO
                    for x in range(dd):
                        acc += q[x] * K_j[c, x]
                    sc = scale * acc
                    if j0 + c >= Nk or (causal and not causal_allowed(i, j0 + c, diag)):
                        sc = NEG_INF
                    s[c] = sc
                    m_new = max(m_new, sc)           # line 9: m_new = max(m, rowmax S)
                alpha = ONE
                if m_new != NEG_INF:
                    alpha = float32(math.exp(m - m_new))
                rs = ZERO
                for c in range(Bc):                  # line 9: P~ = exp(S - m_new), l = e^(m - m_new) l + rowsum P~
                    p = ZERO
                    if s[c] != NEG_INF:
                        p = float32(math.exp(s[c] - m_new))
                    s[c] = p
                    rs += p
                l = alpha * l + rs
                for x in range(dd):                  # line 10: O~ = diag(e^(m - m_new)) O~ ...
                    o[x] *= alpha
                for c in range(Bc):                  # ... + P~ V_j; one read per FMA
                    p = s[c]
                    for x in range(dd):
                        o[x] += p * V_j[c, x]
                m = m_new
        if active:                                   # lines 12-15: O = diag(l)^-1 O~ (once), L = m + log l
            inv = ONE / l if l > ZERO else ZERO
            for x in range(dd):
                O[z, i, x] = o[x] * inv
            L[z, i] = m + float32(math.log(l)) if l > ZERO else NEG_INF

    return fa2_rows


def _splitq_configs():
    return [dict(Br=64, Bc=32, d=32, warps=2, causal=False), dict(Br=64, Bc=32, d=64, warps=2, causal=True),
            dict(Br=32, Bc=16, d=128, warps=1, causal=True), dict(Br=64, Bc=16, d=20, warps=1, causal=False)]


@kernel_factory("fa2_steps.splitq", stage="4", signature=_FWD_SIG, configs=_splitq_configs(),
                threads=lambda warps, **_: WARP * warps)
def make_splitq_forward(Br, Bc, d, warps, causal):
    """Step (b): FA2 Alg. 1 with split-Q warps; grid ``(Tr, BH)``, block ``32·warps`` threads.  Warp ``w``
    owns rows ``w·32R .. (w+1)·32R - 1`` of the block, lane ``t`` the rows ``w·32R + t + 32a`` (``a < R``,
    ``R = Br/(32·warps)``), processed one after another; no warp reads another warp's result."""
    R = Br // (WARP * warps)                         # rows per lane
    NT = WARP * warps

    @cuda.jit
    def fa2_splitq(Q, K, V, O, L, scale, diag):
        Q_iT = cuda.shared.array((d, Br), float32)   # SRAM: Q_i, transposed (lanes read consecutive rows)
        K_j = cuda.shared.array((Bc, d), float32)    # SRAM: K_j, V_j, read by every warp
        V_j = cuda.shared.array((Bc, d), float32)
        o = cuda.local.array((R, d), float32)        # thread-private: this lane's R rows of O~_i
        m = cuda.local.array(R, float32)
        l = cuda.local.array(R, float32)
        s = cuda.local.array(Bc, float32)            # one row of S_ij, then P~_ij
        z = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        i0 = cuda.blockIdx.x * Br
        r0 = (tid // WARP) * (WARP * R) + tid % WARP  # this lane's rows of the block: r0 + 32a
        Nq = Q.shape[1]
        Nk = K.shape[1]
        dd = Q.shape[2]                              # = d at run time: d-loops stay rolled (no spills)
        for e in range(tid, Br * d, NT):             # Alg. 1 line 4: load Q_i once (coalesced)
            r = e // d
            x = e - r * d
            Q_iT[x, r] = Q[z, i0 + r, x] if i0 + r < Nq else ZERO
        for a in range(R):                           # line 5
            m[a] = NEG_INF
            l[a] = ZERO
            for x in range(dd):
                o[a, x] = ZERO
        for jt in range(kv_tile_count(i0, Br, Bc, Nq, Nk, diag, causal)):   # line 6
            j0 = jt * Bc
            cuda.syncthreads()                       # Q_i stored; every warp is done with K_{j-1}, V_{j-1}
            load_rows(K, z, j0, K_j, tid, NT)        # line 7
            load_rows(V, z, j0, V_j, tid, NT)
            cuda.syncthreads()
            for a in range(R):
                r = r0 + WARP * a
                if i0 + r < Nq:
                    m_new = m[a]
                    for c in range(Bc):              # line 8: S = scale · Q_i K_jᵀ; two reads per FMA
                        acc = ZERO
                        for x in range(dd):
                            acc += Q_iT[x, r] * K_j[c, x]
                        sc = scale * acc
                        if j0 + c >= Nk or (causal and not causal_allowed(i0 + r, j0 + c, diag)):
                            sc = NEG_INF
                        s[c] = sc
                        m_new = max(m_new, sc)       # line 9
                    alpha = ONE
                    if m_new != NEG_INF:
                        alpha = float32(math.exp(m[a] - m_new))
                    rs = ZERO
                    for c in range(Bc):              # line 9: P~, l
                        p = ZERO
                        if s[c] != NEG_INF:
                            p = float32(math.exp(s[c] - m_new))
                        s[c] = p
                        rs += p
                    l[a] = alpha * l[a] + rs
                    m[a] = m_new
                    for x in range(dd):              # line 10: O~ = diag(e^(m - m_new)) O~ + P~ V_j
                        o[a, x] *= alpha
                    for c in range(Bc):
                        p = s[c]
                        for x in range(dd):
                            o[a, x] += p * V_j[c, x]
        for a in range(R):                           # lines 12-15
            i = i0 + r0 + WARP * a
            if i < Nq:
                inv = ONE / l[a] if l[a] > ZERO else ZERO
                for x in range(dd):
                    O[z, i, x] = o[a, x] * inv
                L[z, i] = m[a] + float32(math.log(l[a])) if l[a] > ZERO else NEG_INF

    return fa2_splitq


_BWD_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, {_A3}, {_A3}, float32, int32)"


def _rows_bwd_configs():
    return [dict(Br=32, Bc=32, d=16, causal=False), dict(Br=32, Bc=32, d=64, causal=True),
            dict(Br=32, Bc=32, d=128, causal=True), dict(Br=16, Bc=16, d=20, causal=False)]


@kernel_factory("fa2_steps.rows_backward", stage="4", signature=_BWD_SIG, configs=_rows_bwd_configs(),
                threads=lambda Bc, **_: Bc)
def make_rows_backward(Br, Bc, d, causal):
    """Backward step (a): FA2 Alg. 2, one thread per key row; grid ``(Tc, BH)``, block ``Bc`` threads.  Each
    thread adds its own ``scale·dS_ij·k_j`` into ``dQ`` with atomics (``d`` per query row it sees)."""

    @cuda.jit
    def fa2_rows_backward(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag):
        Q_i = cuda.shared.array((Br, d), float32)    # SRAM: the query tile all key rows of the block read
        dO_i = cuda.shared.array((Br, d), float32)
        L_i = cuda.shared.array(Br, float32)
        D_i = cuda.shared.array(Br, float32)
        k = cuda.local.array(d, float32)             # thread-private: this thread's rows of K_j, V_j,
        v = cuda.local.array(d, float32)
        dk = cuda.local.array(d, float32)            # and of the accumulators dK_j, dV_j
        dv = cuda.local.array(d, float32)
        z = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        j0 = cuda.blockIdx.x * Bc
        j = j0 + tid                                 # this thread's key row
        Nq = Q.shape[1]
        Nk = K.shape[1]
        dd = Q.shape[2]                              # = d at run time: d-loops stay rolled (no spills)
        active = j < Nk
        for x in range(dd):                          # Alg. 2 line 6 (this row, not to SRAM), line 7
            k[x] = K[z, j, x] if active else ZERO
            v[x] = V[z, j, x] if active else ZERO
            dk[x] = ZERO
            dv[x] = ZERO
        i_first, _, n_i = q_tile_range(j0, Br, Bc, Nq, diag, causal)   # causal: no Q block before key j0
        for it in range(i_first, n_i):               # line 8
            i0 = it * Br
            cuda.syncthreads()                       # every key row is done with Q_{i-1}, dO_{i-1}
            load_rows(Q, z, i0, Q_i, tid, Bc)        # line 9: load Q_i, dO_i, L_i, D_i (all threads)
            load_rows(dO, z, i0, dO_i, tid, Bc)
            for r in range(tid, Br, Bc):
                L_i[r] = L[z, i0 + r] if i0 + r < Nq else ZERO
                D_i[r] = D[z, i0 + r] if i0 + r < Nq else ZERO
            cuda.syncthreads()
            if active:
                for r in range(min(Br, Nq - i0)):
                    if not (causal and j > i0 + r + diag):
                        s = ZERO
                        dp = ZERO
                        for x in range(dd):          # line 10: S = q_r k_jᵀ; line 13: dP = dO_r v_jᵀ
                            s += Q_i[r, x] * k[x]
                            dp += dO_i[r, x] * v[x]
                        p = float32(math.exp(scale * s - L_i[r]))   # line 11: P = exp(S - L)
                        ds = p * (dp - D_i[r])       # line 14: dS = P ∘ (dP - D)
                        for x in range(dd):
                            dv[x] += p * dO_i[r, x]  # line 12: dV_j += Pᵀ dO_i
                            dk[x] += ds * Q_i[r, x]  # line 16: dK_j += dSᵀ Q_i (scale at the end)
                            cuda.atomic.add(dQ, (z, i0 + r, x), scale * ds * k[x])   # line 15, per key row
        if active:                                   # line 18: write dK_j, dV_j once
            for x in range(dd):
                dK[z, j, x] = scale * dk[x]
                dV[z, j, x] = dv[x]

    return fa2_rows_backward


def _splitq_bwd_configs():
    return [dict(Br=16, Bc=64, d=64, warps=2, causal=True), dict(Br=8, Bc=32, d=128, warps=1, causal=True),
            dict(Br=16, Bc=32, d=32, warps=1, causal=False), dict(Br=16, Bc=64, d=20, warps=1, causal=False)]


@kernel_factory("fa2_steps.splitq_backward", stage="4", signature=_BWD_SIG, configs=_splitq_bwd_configs(),
                threads=lambda warps, **_: WARP * warps)
def make_splitq_backward(Br, Bc, d, warps, causal):
    """Backward step (b): the block's ``Bc`` key rows split over warps (lane ``t`` of warp ``w`` owns key rows
    ``w·32R + t + 32a``, ``R = Bc/(32·warps)``); ``K_j, V_j`` in shared memory; ``dS_ij`` staged in shared
    memory so the whole block forms ``dQ_i += scale·dS_ij K_j``: one atomic per element of ``dQ_i`` per tile."""
    R = Bc // (WARP * warps)                         # key rows per lane
    NT = WARP * warps

    @cuda.jit
    def fa2_splitq_backward(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag):
        K_jT = cuda.shared.array((d, Bc), float32)   # SRAM: K_j, V_j, transposed (lanes own consecutive keys)
        V_jT = cuda.shared.array((d, Bc), float32)
        Q_i = cuda.shared.array((Br, d), float32)    # SRAM: one query tile (every lane reads the same row)
        dO_i = cuda.shared.array((Br, d), float32)
        L_i = cuda.shared.array(Br, float32)
        D_i = cuda.shared.array(Br, float32)
        dS_ij = cuda.shared.array((Br, Bc), float32)  # dS for line 15: the one exchange between warps
        dk = cuda.local.array((R, d), float32)       # thread-private: this lane's R rows of dK_j, dV_j
        dv = cuda.local.array((R, d), float32)
        z = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        j0 = cuda.blockIdx.x * Bc
        c0 = (tid // WARP) * (WARP * R) + tid % WARP  # this lane's key rows of the block: c0 + 32a
        Nq = Q.shape[1]
        Nk = K.shape[1]
        dd = Q.shape[2]                              # = d at run time: d-loops stay rolled (no spills)
        load_rows_T(K, z, j0, Bc, K_jT, tid, NT)     # Alg. 2 line 6: load K_j, V_j once
        load_rows_T(V, z, j0, Bc, V_jT, tid, NT)
        for a in range(R):                           # line 7
            for x in range(dd):
                dk[a, x] = ZERO
                dv[a, x] = ZERO
        i_first, _, n_i = q_tile_range(j0, Br, Bc, Nq, diag, causal)   # causal: no Q block before key j0
        for it in range(i_first, n_i):               # line 8
            i0 = it * Br
            cuda.syncthreads()                       # K_j, V_j stored; every warp is done with the last tile
            load_rows(Q, z, i0, Q_i, tid, NT)        # line 9
            load_rows(dO, z, i0, dO_i, tid, NT)
            for r in range(tid, Br, NT):
                L_i[r] = L[z, i0 + r] if i0 + r < Nq else ZERO
                D_i[r] = D[z, i0 + r] if i0 + r < Nq else ZERO
            cuda.syncthreads()
            for a in range(R):
                c = c0 + WARP * a
                for r in range(Br):
                    ds = ZERO
                    if i0 + r < Nq and j0 + c < Nk and not (causal and j0 + c > i0 + r + diag):
                        s = ZERO
                        dp = ZERO
                        for x in range(dd):          # lines 10, 13: two shared reads per FMA
                            s += Q_i[r, x] * K_jT[x, c]
                            dp += dO_i[r, x] * V_jT[x, c]
                        p = float32(math.exp(scale * s - L_i[r]))   # line 11
                        ds = p * (dp - D_i[r])       # line 14
                        for x in range(dd):          # lines 12, 16
                            dv[a, x] += p * dO_i[r, x]
                            dk[a, x] += ds * Q_i[r, x]
                    dS_ij[r, c] = ds
            cuda.syncthreads()                       # dS_ij complete (every warp's key rows)
            for e in range(tid, Br * d, NT):         # line 15: dQ_i += scale · dS_ij K_j, one atomic per element
                r = e // d
                x = e - r * d
                if i0 + r < Nq:
                    acc = ZERO
                    for c in range(Bc):
                        acc += dS_ij[r, c] * K_jT[x, c]
                    cuda.atomic.add(dQ, (z, i0 + r, x), scale * acc)
        for a in range(R):                           # line 18: write dK_j, dV_j once
            j = j0 + c0 + WARP * a
            if j < Nk:
                for x in range(dd):
                    dK[z, j, x] = scale * dk[a, x]
                    dV[z, j, x] = dv[a, x]

    return fa2_splitq_backward


# --------------------------------------------------------------------------- launchers

_ROWS_DEFAULT = dict(Br=32, Bc=32)
_SPLITQ_DEFAULTS = {64: dict(Br=64, Bc=32, warps=2), 128: dict(Br=32, Bc=16, warps=1)}  # <= 48 KiB shared
_SPLITQ_BWD_DEFAULTS = {64: dict(Br=16, Bc=64, warps=2), 128: dict(Br=8, Bc=32, warps=1)}


def _positive(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_d(d):
    if not 1 <= d <= 128:
        raise ValueError(f"head dim d must be between 1 and 128, got {d}")


def _check_direction(direction):
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")


def shared_bytes(step, Br, Bc, d, direction="forward") -> int:
    """Static shared memory of one thread block of step ``"rows"`` or ``"splitq"``, in bytes."""
    if direction == "forward":
        return 4 * (2 * Bc * d + (Br * d if step == "splitq" else 0))
    if step == "rows":
        return 4 * (2 * Br * d + 2 * Br)                   # Q_i, dO_i, L_i, D_i
    return 4 * (2 * d * Bc + 2 * Br * d + 2 * Br + Br * Bc)  # + K_j, V_j and dS_ij


def rows_tiles(d, Br=None, Bc=None, direction="forward") -> dict:
    """Step (a)'s tiles: ``Br = Bc = 32`` unless given.  One thread per row of the block's own dimension:
    ``Br`` threads per block in the forward (query rows), ``Bc`` in the backward (key rows), at most 1024."""
    _check_d(d)
    _check_direction(direction)
    t = dict(_ROWS_DEFAULT)
    for name, value in (("Br", Br), ("Bc", Bc)):
        if value is not None:
            t[name] = _positive(name, value)
    own = "Br" if direction == "forward" else "Bc"
    if t[own] > 1024:
        raise ValueError(f"fa2-rows {direction}: {own}={t[own]} threads per block > 1024 (one thread per "
                         f"{'query' if own == 'Br' else 'key'} row)")
    check_shared_fit(f"fa2-rows {direction}", f"Br={t['Br']}, Bc={t['Bc']} at d={d}",
                     shared_bytes("rows", t["Br"], t["Bc"], d, direction))
    return t


def splitq_tiles(d, Br=None, Bc=None, warps=None, direction="forward") -> dict:
    """Step (b)'s tiles.  Forward: defaults per head dim (``Br = 64, Bc = 32, 2 warps`` up to d = 64,
    ``32, 16, 1`` to d = 128); ``Br`` must be a multiple of ``32·warps`` (each lane owns ``Br/(32·warps)``
    query rows).  Backward: ``Br = 16, Bc = 64, 2 warps`` up to d = 64, ``8, 32, 1`` to d = 128; the warps
    split the ``Bc`` key rows, which must be a multiple of ``32·warps``."""
    _check_d(d)
    _check_direction(direction)
    table = _SPLITQ_DEFAULTS if direction == "forward" else _SPLITQ_BWD_DEFAULTS
    t = dict(table[64 if d <= 64 else 128])
    for name, value in (("Br", Br), ("Bc", Bc), ("warps", warps)):
        if value is not None:
            t[name] = _positive(name, value)
    own, rows = ("Br", "query") if direction == "forward" else ("Bc", "key")
    if t[own] % (WARP * t["warps"]):
        raise ValueError(f"fa2-splitq {direction}: {own}={t[own]} must be a multiple of 32·warps = "
                         f"{WARP * t['warps']} (every lane owns {own}/(32·warps) {rows} rows)")
    check_shared_fit(f"fa2-splitq {direction}", f"Br={t['Br']}, Bc={t['Bc']} at d={d}",
                     shared_bytes("splitq", t["Br"], t["Bc"], d, direction))
    return t


def forward_rows(q, k, v, *, causal=False, scale, Br=None, Bc=None):
    """Step (a): device arrays ``(BH, N, d)`` in, ``(O, L)`` out; causal bottom-right aligned."""
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    t = rows_tiles(d, Br, Bc)
    O = empty((BH, Nq, d))
    L = empty((BH, Nq))
    launch(make_rows_forward(t["Br"], t["Bc"], d, bool(causal)), (cdiv(Nq, t["Br"]), BH), t["Br"],
           q, k, v, O, L, scale, Nk - Nq, label="FA2 rows forward")
    return O, L


def forward_splitq(q, k, v, *, causal=False, scale, Br=None, Bc=None, warps=None):
    """Step (b): as :func:`forward_rows`, with ``32·warps`` threads splitting the ``Br`` rows of a block."""
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    t = splitq_tiles(d, Br, Bc, warps)
    O = empty((BH, Nq, d))
    L = empty((BH, Nq))
    launch(make_splitq_forward(t["Br"], t["Bc"], d, t["warps"], bool(causal)), (cdiv(Nq, t["Br"]), BH),
           WARP * t["warps"], q, k, v, O, L, scale, Nk - Nq, label="FA2 split-Q forward")
    return O, L


def _preprocess(o, do):
    """Alg. 2 line 4 (stage 4's preprocessing kernel, :func:`flashnb.stages.fa2.make_preprocess`): ``D`` and
    the zeroed ``dQ`` the atomics add into."""
    BH, Nq, d = o.shape
    D = empty((BH, Nq))
    dQ = empty((BH, Nq, d))
    launch(fa2.make_preprocess(), (cdiv(Nq, fa2.PRE_WARPS), BH), WARP * fa2.PRE_WARPS, o, do, D, dQ,
           label="D = rowsum(dO∘O)")
    return D, dQ


def backward_rows(q, k, v, o, lse, do, *, causal=False, scale, Br=None, Bc=None):
    """Backward step (a): the D launch, then one thread per key row; grid ``(Tc, BH)``, ``Bc`` threads."""
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    t = rows_tiles(d, Br, Bc, "backward")
    D, dQ = _preprocess(o, do)
    dK = empty((BH, Nk, d))
    dV = empty((BH, Nk, d))
    launch(make_rows_backward(t["Br"], t["Bc"], d, bool(causal)), (cdiv(Nk, t["Bc"]), BH), t["Bc"],
           q, k, v, do, lse, D, dQ, dK, dV, scale, Nk - Nq, label="FA2 rows backward")
    return dQ, dK, dV


def backward_splitq(q, k, v, o, lse, do, *, causal=False, scale, Br=None, Bc=None, warps=None):
    """Backward step (b): as :func:`backward_rows`, with ``32·warps`` threads splitting the ``Bc`` key rows."""
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    t = splitq_tiles(d, Br, Bc, warps, "backward")
    D, dQ = _preprocess(o, do)
    dK = empty((BH, Nk, d))
    dV = empty((BH, Nk, d))
    launch(make_splitq_backward(t["Br"], t["Bc"], d, t["warps"], bool(causal)), (cdiv(Nk, t["Bc"]), BH),
           WARP * t["warps"], q, k, v, do, lse, D, dQ, dK, dV, scale, Nk - Nq, label="FA2 split-Q backward")
    return dQ, dK, dV


register_impl("fa2-rows", stage="4", forward=forward_rows, backward=backward_rows, options=("Br", "Bc"),
              description="FA2 step (a): one thread per row -- query rows forward (delayed rescaling, L), key rows "
                          "backward (dQ by per-thread atomics)")
register_impl("fa2-splitq", stage="4", forward=forward_splitq, backward=backward_splitq,
              options=("Br", "Bc", "warps"),
              description="FA2 step (b): the block's rows split over warps, the other side's tile in shared memory, "
                          "no micro-tiles; backward: dS through shared memory, one dQ atomic per element and tile")


# --------------------------------------------------------------------------- analytic models


def _model(label, BH, Nq, Nk, d, causal, Br, Bc, per_row_tile_reads, q_tile_writes):
    visited = fa2.tiles_visited(Nq, Nk, Br, Bc, causal)            # the same K/V tiles as fa2's forward
    kv = BH * sum(cols for _, _, _, cols in visited) * d
    rows = BH * sum(r for _, _, r, _ in visited)                    # (row, tile) pairs that compute
    return [dict(launch=label, reads={"Q": BH * Nq * d, "K": kv, "V": kv}, writes={"O": BH * Nq * d, "L": BH * Nq},
                 atomics={}, shared_reads=rows * per_row_tile_reads,
                 shared_writes=BH * cdiv(Nq, Br) * q_tile_writes + BH * len(visited) * 2 * Bc * d)]


def model_rows_forward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None):
    """Element accesses of :func:`forward_rows` (one launch).  Global: Q, O, L once; K_j, V_j once per
    visited tile (``fa2.tiles_visited``).  Shared: K_j, V_j written per visited tile (``2·Bc·d``, zero fill
    included); each row inside ``Nq`` reads ``Bc·d`` of K_j (S) and ``Bc·d`` of V_j (P~V) per tile."""
    t = rows_tiles(d, Br, Bc)
    return _model("FA2 rows forward", BH, Nq, Nk, d, causal, t["Br"], t["Bc"], 2 * t["Bc"] * d, 0)


def model_splitq_forward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None):
    """Element accesses of :func:`forward_splitq`: as :func:`model_rows_forward`, plus ``Q_i`` written to
    shared memory once per block (``Br·d``) and read with every ``K_j`` element of S (``3·Bc·d`` reads per
    row and tile)."""
    t = splitq_tiles(d, Br, Bc, warps)
    return _model("FA2 split-Q forward", BH, Nq, Nk, d, causal, t["Br"], t["Bc"], 3 * t["Bc"] * d, t["Br"] * d)


def _allowed_pairs(i0, rows, j0, cols, causal, diag):
    """(query row, key) pairs of one tile that compute: all, or with ``causal`` those with ``j <= i + diag``."""
    if not causal:
        return rows * cols
    return int(np.clip(i0 + np.arange(rows) + diag - j0 + 1, 0, cols).sum())


def _model_backward(label, BH, Nq, Nk, d, causal, Br, Bc, pair_reads, row_reads, tile_writes, kv_writes,
                    atomics_per_pair):
    visited = fa2.tiles_visited(Nq, Nk, Br, Bc, causal, "backward")   # the same tiles as fa2's backward
    pairs = sum(_allowed_pairs(i * Br, rows, j * Bc, cols, causal, Nk - Nq) for j, i, rows, cols in visited)
    q_rows = sum(rows for _, _, rows, _ in visited)
    pre = fa2._launch("D = rowsum(dO∘O)", {"O": BH * Nq * d, "dO": BH * Nq * d}, {"D": BH * Nq, "dQ": BH * Nq * d})
    dq = BH * (pairs if atomics_per_pair else q_rows) * d
    main = fa2._launch(label, {"Q": BH * q_rows * d, "K": BH * Nk * d, "V": BH * Nk * d, "dO": BH * q_rows * d,
                               "L": BH * q_rows, "D": BH * q_rows},
                       {"dK": BH * Nk * d, "dV": BH * Nk * d}, {"dQ": dq},
                       shared_reads=BH * (pairs * pair_reads + q_rows * row_reads),
                       shared_writes=BH * (len(visited) * tile_writes + cdiv(Nk, Bc) * kv_writes))
    return [pre, main]


def model_rows_backward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None):
    """Element accesses of :func:`backward_rows` (two launches).  The D launch: O, dO read, D and dQ = 0
    written.  The main launch: K, V read once (into registers); Q, dO, L, D once per visited tile
    (``fa2.tiles_visited(..., "backward")``); shared: ``Q_i, dO_i, L_i, D_i`` written per visited tile
    (``2·Br·d + 2·Br``, zero fill included); each (query row, key) pair that computes reads ``4d + 2``
    (``Q_i``, ``dO_i`` twice each, ``L_i``, ``D_i``) and makes ``d`` atomic adds into dQ."""
    t = rows_tiles(d, Br, Bc, "backward")
    Br, Bc = t["Br"], t["Bc"]
    return _model_backward("FA2 rows backward", BH, Nq, Nk, d, causal, Br, Bc, 4 * d + 2, 0,
                           2 * Br * d + 2 * Br, 0, True)


def model_splitq_backward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None):
    """Element accesses of :func:`backward_splitq`: global as :func:`model_rows_backward` but for dQ, now one
    atomic add per element of ``dQ_i`` per visited tile (``rows·d``).  Shared: ``K_j, V_j`` written once per
    column block (``2·Bc·d``); per visited tile ``Q_i, dO_i, L_i, D_i`` and ``dS_ij`` written
    (``2·Br·d + 2·Br + Br·Bc``); each pair that computes reads ``6d + 2`` (``K_j``, ``V_j`` now too), and each
    valid element of ``dQ_i`` reads a row of ``dS_ij`` and a column of ``K_j`` (``2·Bc``)."""
    t = splitq_tiles(d, Br, Bc, warps, "backward")
    Br, Bc = t["Br"], t["Bc"]
    return _model_backward("FA2 split-Q backward", BH, Nq, Nk, d, causal, Br, Bc, 6 * d + 2, 2 * Bc * d,
                           2 * Br * d + 2 * Br + Br * Bc, 2 * Bc * d, False)
