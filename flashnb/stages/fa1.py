"""Stage 3 -- FlashAttention-1 as the 2022 paper wrote it (FA1 Algorithm 1/2 forward, Algorithm 4 backward).

One thread block per (batch, head) -- the grid is ``(BH,)``, as FA1 launched it.  Inside the block:

* **forward** (:func:`make_forward`): the *outer* loop runs over key/value blocks ``j`` (``K_j``, ``V_j``
  loaded into shared memory once), the *inner* loop over query blocks ``i``.  The running output and
  statistics live in HBM: every inner iteration reads ``Q_i, O_i, l_i, m_i`` and writes ``O_i, l_i, m_i``
  back (Alg. 1 lines 8 and 12-13).  The block's warps split the key tile (*split-K*): warp ``w`` scores
  its ``Bc / W`` keys, keeps a partial row max, row sum and partial ``P̃ V``, and the partials are merged
  through shared memory -- the scheme the FA2 paper criticises, kept here so it can be measured.
* **backward** (:func:`make_backward`): Algorithm 4 with recomputation.  ``S`` and ``P`` are rebuilt from
  ``Q_i``, ``K_j`` and the saved statistics, ``D_i = rowsum(dO_i ∘ O_i)`` is recomputed each inner
  iteration, ``dQ_i`` is read-modified-written in HBM every inner iteration, ``dK_j`` and ``dV_j`` are
  accumulated on chip and written once.

Statistics: the paper keeps ``l`` and ``m`` separately.  The public API (and FA2) carry the single
log-sum-exp ``L = m + log l`` instead, so the forward ends with a small kernel ``L = m + log l``
(:func:`make_lse`) and the backward rebuilds ``P = exp(S - L)``, which equals the paper's
``diag(l)^-1 exp(S - m)``.  Both extra launches are in the traffic model.

:func:`fa1_forward_numpy` and :func:`fa1_backward_numpy` transcribe Alg. 1 (with Alg. 2's scale and mask) and
Alg. 4 into float64 NumPy, loops and all, every line tagged with the paper's line number.

Block sizes come from an SRAM budget of ``M`` float32 elements as in the paper (``Bc = ⌈M/4d⌉``,
``Br = min(⌈M/4d⌉, d)``), with ``Bc`` rounded up to a multiple of the number of warps; see :func:`tiles`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from .. import common
from ..common import (
    NEG_INF,
    ROWS_PER_BLOCK,
    ZERO,
    causal_allowed,
    causal_diag,
    cdiv,
    check_shared_fit,
    empty,
    launch,
    launch_rows,
    load_rows,
    load_vec,
    row_index,
    store_rows,
    store_vec,
)
from ..registry import kernel_factory, register_impl

__all__ = ["make_forward", "make_backward", "make_init_forward", "make_zero_rows", "make_lse", "tiles",
           "forward", "forward_stats", "backward", "model_forward", "model_backward", "WARP", "WARPS",
           "DEFAULT_M", "SHARED_LIMIT_BYTES", "ROWS_PER_BLOCK", "shared_elements_forward",
           "shared_elements_backward", "fa1_forward_numpy", "fa1_backward_numpy"]

WARP = 32                 # threads per warp
WARPS = 4                 # W: warps per thread block (FA1 split the key tile over 4 warps)
DEFAULT_M = 4096          # SRAM budget M in float32 elements (16 KiB) fed to the paper's tile formula
SHARED_LIMIT_BYTES = common.SHARED_LIMIT_BYTES   # static shared memory per block (one check: common)

_A3 = "float32[:, :, ::1]"
_A2 = "float32[:, ::1]"
_FWD_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, float32, int32)"
_BWD_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A3}, {_A3}, {_A3}, {_A3}, float32, int32)"


def _configs(**extra):
    return [dict(Br=Br, Bc=Bc, d=d, W=W, causal=c, **extra)
            for Br, Bc, d, W, c in [(16, 64, 16, 4, False), (16, 64, 16, 4, True), (8, 8, 128, 4, True),
                                    (1, 1024, 1, 4, False), (11, 12, 96, 2, False)]]


@cuda.jit(device=True, inline="always")
def exp_diff(a, b):
    """``exp(a - b)`` for ``a <= b``, and 0 when ``a = -inf`` (an empty row: no ``(-inf) - (-inf)``)."""
    if a == NEG_INF:
        return float32(0.0)
    return float32(math.exp(a - b))


# --------------------------------------------------------------------------- forward kernels


@kernel_factory("fa1.forward", stage="3", signature=_FWD_SIG, configs=_configs(),
                threads=lambda Br, Bc, d, W, causal: WARP * W)
def make_forward(Br, Bc, d, W, causal):
    """FA1 Alg. 1 (+ Alg. 2's scale and mask) for one (batch, head) per block; block ``(32, W)``."""
    Bw = Bc // W          # keys per warp (split-K)
    NT = WARP * W

    @cuda.jit
    def fa1_forward(Q, K, V, O, l, m, scale, diag):
        K_j = cuda.shared.array((Bc, d), float32)
        V_j = cuda.shared.array((Bc, d), float32)
        Q_i = cuda.shared.array((Br, d), float32)
        O_i = cuda.shared.array((Br, d), float32)
        l_i = cuda.shared.array(Br, float32)
        m_i = cuda.shared.array(Br, float32)
        m_w = cuda.shared.array((W, Br), float32)      # split-K: each warp's partial row max
        l_w = cuda.shared.array((W, Br), float32)      # ... partial row sum, then its merge weight
        O_w = cuda.shared.array((W, Br, d), float32)   # ... partial P̃ V
        a_i = cuda.shared.array(Br, float32)           # merge weight of the old O_i
        S = cuda.local.array(Bw, float32)              # this thread's slice of one row of S_ij, then P̃_ij
        z = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        w = cuda.threadIdx.y
        tid = w * WARP + lane
        Nq = Q.shape[1]
        Nk = K.shape[1]
        dd = Q.shape[2]   # = d, read at run time so the compiler keeps the d-loops rolled (no spills)
        # region loop-nest
        for j in range((Nk + Bc - 1) // Bc):                      # line 5
            load_rows(K, z, j * Bc, K_j, tid, NT)                 # line 6: K_j, V_j -> SRAM, once
            load_rows(V, z, j * Bc, V_j, tid, NT)
            for i in range((Nq + Br - 1) // Br):                  # line 7
                load_rows(Q, z, i * Br, Q_i, tid, NT)             # line 8: Q_i, O_i, l_i, m_i -> SRAM
                load_rows(O, z, i * Br, O_i, tid, NT)
                load_vec(l, z, i * Br, l_i, tid, NT)
                load_vec(m, z, i * Br, m_i, tid, NT)
                cuda.syncthreads()
        # endregion loop-nest
                for r in range(lane, Br, WARP):                   # warp w: rows r, keys w*Bw .. w*Bw+Bw-1
                    mx = NEG_INF
                    # region scores
                    for cc in range(Bw):                          # line 9: S_ij = τ Q_i K_jᵀ, MASK
                        c = w * Bw + cc
                        acc = float32(0.0)
                        for x in range(dd):
                            acc += Q_i[r, x] * K_j[c, x]
                        s = scale * acc
                        if j * Bc + c >= Nk or (causal and not causal_allowed(i * Br + r, j * Bc + c, diag)):
                            s = NEG_INF
                        S[cc] = s
                        mx = max(mx, s)                           # line 10: m̃ (this warp's keys)
                    # endregion scores
                    ls = float32(0.0)
                    for cc in range(Bw):
                        p = exp_diff(S[cc], mx)                   # line 10: P̃ = exp(S - m̃)
                        S[cc] = p
                        ls += p                                   # line 10: l̃ = rowsum(P̃)
                    for x in range(dd):                           # partial P̃ V_j of this warp's keys
                        acc = float32(0.0)
                        for cc in range(Bw):
                            acc += S[cc] * V_j[w * Bw + cc, x]
                        O_w[w, r, x] = acc
                    m_w[w, r] = mx
                    l_w[w, r] = ls
                cuda.syncthreads()
                for r in range(tid, Br, NT):                      # merge the warps' partials, then the tile
                    mt = NEG_INF
                    for v in range(W):
                        mt = max(mt, m_w[v, r])                   # m̃_ij = max over warps
                    lt = float32(0.0)
                    for v in range(W):
                        lt += exp_diff(m_w[v, r], mt) * l_w[v, r]  # l̃_ij = Σ_w e^(m_w - m̃) l_w
                    mo = m_i[r]
                    lo = l_i[r]
                    # region statistics
                    mn = max(mo, mt)                              # line 11: m_new = max(m_i, m̃_ij)
                    eo = exp_diff(mo, mn)
                    et = exp_diff(mt, mn)
                    ln = eo * lo + et * lt                        # line 11: l_new = e^(m_i-m_new) l_i + ...
                    inv = float32(1.0) / ln if ln > float32(0.0) else float32(0.0)
                    a_i[r] = lo * eo * inv                        # line 12: weight of the old O_i
                    for v in range(W):                            # ... and of warp v's partial P̃ V_j
                        l_w[v, r] = et * exp_diff(m_w[v, r], mt) * inv
                    m_i[r] = mn                                   # line 13 (on chip)
                    l_i[r] = ln
                    # endregion statistics
                # region weights-barrier
                cuda.syncthreads()
                # endregion weights-barrier
                # region o-update
                for e in range(tid, Br * d, NT):                  # line 12: O_i = diag(l_new)^-1 (...)
                    r = e // d
                    x = e - r * d
                    acc = a_i[r] * O_i[r, x]
                    for v in range(W):
                        acc += l_w[v, r] * O_w[v, r, x]
                    O_i[r, x] = acc
                # endregion o-update
                # region write-back
                # Each thread stores exactly the elements it wrote above and loads them again next
                # iteration, so no barrier is needed before the next loads.
                store_rows(O_i, O, z, i * Br, tid, NT)            # lines 12-13: O_i, l_i, m_i -> HBM
                store_vec(l_i, l, z, i * Br, tid, NT)
                store_vec(m_i, m, z, i * Br, tid, NT)
                # endregion write-back

    return fa1_forward


@kernel_factory("fa1.init_forward", stage="3", signature=f"void({_A3}, {_A2}, {_A2})", threads=ROWS_PER_BLOCK)
def make_init_forward():
    """Kernel factory: FA1 Alg. 1 line 2 -- O = 0, l = 0, m = -inf in HBM, one thread per row."""

    @cuda.jit
    def init_forward(O, l, m):
        """Alg. 1 line 2: O = 0, l = 0, m = -inf in HBM; one thread per row."""
        z, i = row_index()
        if i >= O.shape[1]:
            return
        for x in range(O.shape[2]):
            O[z, i, x] = float32(0.0)
        l[z, i] = float32(0.0)
        m[z, i] = NEG_INF

    return init_forward


@kernel_factory("fa1.lse", stage="3", signature=f"void({_A2}, {_A2}, {_A2})", threads=ROWS_PER_BLOCK)
def make_lse():
    """Kernel factory: L = m + log l (the single statistic the API carries), one thread per row."""

    @cuda.jit
    def lse(l, m, L):
        """L = m + log l (-inf for a row with no allowed key): the one statistic the backward needs."""
        z, i = row_index()
        if i >= l.shape[1]:
            return
        li = l[z, i]
        mi = m[z, i]
        value = NEG_INF
        if li > ZERO:
            value = mi + float32(math.log(li))
        L[z, i] = value

    return lse


# --------------------------------------------------------------------------- backward kernels


@kernel_factory("fa1.backward", stage="3", signature=_BWD_SIG, configs=_configs(),
                threads=lambda Br, Bc, d, W, causal: WARP * W)
def make_backward(Br, Bc, d, W, causal):
    """FA1 Alg. 4 (recomputation) for one (batch, head) per block; block ``(32, W)``, element-parallel."""
    NT = WARP * W

    @cuda.jit
    def fa1_backward(Q, K, V, O, L, dO, dQ, dK, dV, scale, diag):
        K_j = cuda.shared.array((Bc, d), float32)
        V_j = cuda.shared.array((Bc, d), float32)
        dK_j = cuda.shared.array((Bc, d), float32)
        dV_j = cuda.shared.array((Bc, d), float32)
        Q_i = cuda.shared.array((Br, d), float32)
        O_i = cuda.shared.array((Br, d), float32)
        dO_i = cuda.shared.array((Br, d), float32)
        dQ_i = cuda.shared.array((Br, d), float32)
        L_i = cuda.shared.array(Br, float32)
        D_i = cuda.shared.array(Br, float32)
        P = cuda.shared.array((Br, Bc), float32)
        dS = cuda.shared.array((Br, Bc), float32)
        z = cuda.blockIdx.x
        tid = cuda.threadIdx.y * WARP + cuda.threadIdx.x
        Nq = Q.shape[1]
        Nk = K.shape[1]
        # region bwd-loop-nest
        for j in range((Nk + Bc - 1) // Bc):                      # line 6
            load_rows(K, z, j * Bc, K_j, tid, NT)                 # line 7: K_j, V_j -> SRAM
            load_rows(V, z, j * Bc, V_j, tid, NT)
            for e in range(tid, Bc * d, NT):                      # line 8: dK̃_j = dṼ_j = 0 on chip
                dK_j[e // d, e % d] = float32(0.0)
                dV_j[e // d, e % d] = float32(0.0)
            for i in range((Nq + Br - 1) // Br):                  # line 9
                load_rows(Q, z, i * Br, Q_i, tid, NT)             # line 10: Q_i, O_i, dO_i, dQ_i, L_i -> SRAM
                load_rows(O, z, i * Br, O_i, tid, NT)
                load_rows(dO, z, i * Br, dO_i, tid, NT)
                load_rows(dQ, z, i * Br, dQ_i, tid, NT)
                load_vec(L, z, i * Br, L_i, tid, NT)
                cuda.syncthreads()
        # endregion bwd-loop-nest
                # region recompute
                for r in range(tid, Br, NT):                      # line 19: D_i = rowsum(dO_i ∘ O_i)
                    acc = float32(0.0)
                    for x in range(d):
                        acc += dO_i[r, x] * O_i[r, x]
                    D_i[r] = acc
                for e in range(tid, Br * Bc, NT):                 # lines 11-13: S = τ Q_i K_jᵀ, MASK,
                    r = e // Bc                                   # P = diag(l)^-1 exp(S - m) = exp(S - L)
                    c = e - r * Bc
                    acc = float32(0.0)
                    for x in range(d):
                        acc += Q_i[r, x] * K_j[c, x]
                    Lr = L_i[r]
                    p = float32(0.0)
                    ok = i * Br + r < Nq and j * Bc + c < Nk and Lr != NEG_INF
                    if ok and (not causal or causal_allowed(i * Br + r, j * Bc + c, diag)):
                        p = float32(math.exp(scale * acc - Lr))
                    P[r, c] = p
                cuda.syncthreads()
                # endregion recompute
                # region dv-ds
                for e in range(tid, Bc * d, NT):                  # line 16: dṼ_j += P_ijᵀ dO_i
                    c = e // d
                    x = e - c * d
                    acc = dV_j[c, x]
                    for r in range(Br):
                        acc += P[r, c] * dO_i[r, x]
                    dV_j[c, x] = acc
                for e in range(tid, Br * Bc, NT):                 # line 17: dP = dO_i V_jᵀ; line 20:
                    r = e // Bc                                   # dS = P ∘ (dP - D_i)
                    c = e - r * Bc
                    acc = float32(0.0)
                    for x in range(d):
                        acc += dO_i[r, x] * V_j[c, x]
                    dS[r, c] = P[r, c] * (acc - D_i[r])
                cuda.syncthreads()
                # endregion dv-ds
                # region dq-dk
                for e in range(tid, Br * d, NT):                  # line 21: dQ_i += τ dS K_j
                    r = e // d
                    x = e - r * d
                    acc = float32(0.0)
                    for c in range(Bc):
                        acc += dS[r, c] * K_j[c, x]
                    dQ_i[r, x] += scale * acc
                for e in range(tid, Bc * d, NT):                  # line 22: dK̃_j += τ dSᵀ Q_i
                    c = e // d
                    x = e - c * d
                    acc = float32(0.0)
                    for r in range(Br):
                        acc += dS[r, c] * Q_i[r, x]
                    dK_j[c, x] += scale * acc
                cuda.syncthreads()
                store_rows(dQ_i, dQ, z, i * Br, tid, NT)         # line 21: dQ_i -> HBM, every inner step
                # endregion dq-dk
            store_rows(dK_j, dK, z, j * Bc, tid, NT)             # line 24: dK_j, dV_j -> HBM, once
            store_rows(dV_j, dV, z, j * Bc, tid, NT)

    return fa1_backward


@kernel_factory("fa1.zero_rows", stage="3", signature=f"void({_A3})", threads=ROWS_PER_BLOCK)
def make_zero_rows():
    """Kernel factory: X = 0 (the backward's dQ before Alg. 4 accumulates into it), one thread per row."""

    @cuda.jit
    def zero_rows(X):
        """Alg. 4 line 5: dQ = 0 in HBM; one thread per row."""
        z, i = row_index()
        if i >= X.shape[1]:
            return
        for x in range(X.shape[2]):
            X[z, i, x] = float32(0.0)

    return zero_rows


# --------------------------------------------------------------------------- tiles


def shared_elements_forward(Br, Bc, d, W):
    """float32 elements the forward kernel declares in shared memory."""
    return 2 * Bc * d + 2 * Br * d + W * Br * d + 2 * W * Br + 3 * Br


def shared_elements_backward(Br, Bc, d):
    """float32 elements the backward kernel declares in shared memory."""
    return 4 * Bc * d + 4 * Br * d + 2 * Br * Bc + 2 * Br


def _positive_int(name, value, allow_none=True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    value = int(value)
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def tiles(d, *, M=None, Br=None, Bc=None, warps=None, check_fit=True):
    """The tiles the FA1 kernels use for head dim ``d``: a dict with ``Br, Bc, warps, M`` and the shared
    bytes of each kernel.

    From the SRAM budget ``M`` (float32 elements, default :data:`DEFAULT_M`) as FA1 Alg. 1 line 1:
    ``Bc = ⌈M/4d⌉`` rounded up to a multiple of ``warps`` (each warp takes ``Bc/warps`` keys),
    ``Br = min(⌈M/4d⌉, d)``.  ``Br`` and ``Bc`` override the formula.  Raises ``ValueError`` (naming the
    option) when the tiles do not divide among the warps or (unless ``check_fit=False``, for models of tiles
    bigger than this kernel can hold) the kernels would exceed 48 KiB of shared memory.
    """
    d = _positive_int("d", d, allow_none=False)
    M = _positive_int("M", M)
    Br = _positive_int("Br", Br)
    Bc = _positive_int("Bc", Bc)
    W = _positive_int("warps", warps)
    if W is None:
        W = WARPS
    if W > 32:
        raise ValueError(f"warps must be at most 32 (1024 threads per block), got {W}")
    if M is not None and M < 4 * d:
        raise ValueError(f"M must be at least 4·d = {4 * d} float32 elements, got M={M}: M is the on-chip memory "
                         "budget of FA1 Alg. 1 line 1 (Bc = ⌈M/4d⌉), and a smaller one cannot hold one row each of "
                         "Q_i, K_j, V_j and O_i")
    budget = DEFAULT_M if M is None else M
    from_budget = Br is None or Bc is None
    base = cdiv(budget, 4 * d)
    if Bc is None:
        Bc = cdiv(base, W) * W
    elif Bc % W:
        raise ValueError(f"Bc={Bc} must be a multiple of warps={W} (split-K: each warp takes Bc/warps keys)")
    if Br is None:
        Br = min(base, d)
    fwd = 4 * shared_elements_forward(Br, Bc, d, W)
    bwd = 4 * shared_elements_backward(Br, Bc, d)
    if check_fit:
        names = "M" if M is not None and from_budget else "Br/Bc"
        check_shared_fit("fa1", f"Br={Br}, Bc={Bc} at d={d}, warps={W} ({fwd:,} B forward, {bwd:,} B backward)",
                         max(fwd, bwd), f"choose a smaller {names}")
    return dict(Br=Br, Bc=Bc, warps=W, M=budget, d=d, shared_bytes_forward=fwd, shared_bytes_backward=bwd)


# --------------------------------------------------------------------------- NumPy transcriptions


def _mask(S, i0, j0, diag):
    """Alg. 2's MASK: key ``c`` allowed for query ``r`` iff ``c <= r + diag`` (-inf elsewhere)."""
    rows = np.arange(i0, i0 + S.shape[0])[:, None]
    cols = np.arange(j0, j0 + S.shape[1])[None, :]
    return np.where(cols <= rows + diag, S, -np.inf)


def fa1_forward_numpy(Q, K, V, Br, Bc, causal=False, scale=None):
    """FA1 Algorithm 1 (with Alg. 2's scale ``tau`` and MASK, no dropout) in float64 NumPy, loops and all:
    ``Q (Nq, d)``, ``K, V (Nk, d)`` -> ``(O, l, m)``, the paper's statistics (``L = m + log l``).

    Line numbers are the paper's (Dao et al. 2022, Alg. 1).  ``causal``: ``True``/``"lower_right"``
    (key ``c <= r + Nk - Nq``) or ``"upper_left"`` (``c <= r``); every tile is visited, as in Alg. 2."""
    Q, K, V = (np.asarray(a, dtype=np.float64) for a in (Q, K, V))
    Nq, d = Q.shape
    Nk = K.shape[0]
    tau = 1.0 / math.sqrt(d) if scale is None else float(scale)
    diag = causal_diag(causal, Nq, Nk)
    O, l, m = np.zeros((Nq, d)), np.zeros(Nq), np.full(Nq, -np.inf)      # line 2: O = 0, l = 0, m = -inf in HBM
    for j0 in range(0, Nk, Bc):                                           # line 5: for 1 <= j <= Tc
        Kj, Vj = K[j0:j0 + Bc], V[j0:j0 + Bc]                             # line 6: load K_j, V_j to SRAM
        for i0 in range(0, Nq, Br):                                       # line 7: for 1 <= i <= Tr
            Qi, Oi, li, mi = Q[i0:i0 + Br], O[i0:i0 + Br], l[i0:i0 + Br], m[i0:i0 + Br]   # line 8: load
            S = tau * Qi @ Kj.T                                           # line 9: S_ij = tau Q_i K_jᵀ
            if causal:
                S = _mask(S, i0, j0, diag)                                #   (Alg. 2: MASK)
            mt = S.max(axis=1)                                            # line 10: m~_ij = rowmax(S_ij)
            Pt = np.exp(S - np.where(np.isfinite(mt), mt, 0.0)[:, None])  # line 10: P~_ij = exp(S_ij - m~_ij)
            lt = Pt.sum(axis=1)                                           # line 10: l~_ij = rowsum(P~_ij)
            mn = np.maximum(mi, mt)                                       # line 11: m_new = max(m_i, m~_ij)
            safe = np.where(np.isfinite(mn), mn, 0.0)                     #   (a row with no key yet: weights 0)
            ln = np.exp(mi - safe) * li + np.exp(mt - safe) * lt          # line 11: l_new
            inv = np.where(ln > 0, 1.0 / np.where(ln > 0, ln, 1.0), 0.0)
            O[i0:i0 + Br] = inv[:, None] * ((li * np.exp(mi - safe))[:, None] * Oi
                                            + np.exp(mt - safe)[:, None] * (Pt @ Vj))   # line 12: write O_i
            l[i0:i0 + Br], m[i0:i0 + Br] = ln, mn                         # line 13: write l_i, m_i
    return O, l, m                                                        # line 16


def fa1_backward_numpy(Q, K, V, O, dO, l, m, Br, Bc, causal=False, scale=None):
    """FA1 Algorithm 4 (the backward with recomputation, no dropout) in float64 NumPy, loops and all:
    ``(dQ, dK, dV)`` from ``Q, K, V, O, dO`` and the forward's statistics ``l, m`` (Alg. 1's outputs).

    Line numbers are the paper's (Dao et al. 2022, Alg. 4); lines 14-15 and 18 (dropout) are the identity
    here.  ``causal`` as in :func:`fa1_forward_numpy`."""
    Q, K, V, O, dO, l, m = (np.asarray(a, dtype=np.float64) for a in (Q, K, V, O, dO, l, m))
    Nq, d = Q.shape
    Nk = K.shape[0]
    tau = 1.0 / math.sqrt(d) if scale is None else float(scale)
    diag = causal_diag(causal, Nq, Nk)
    dQ = np.zeros((Nq, d))                                                # line 5: dQ = 0 in HBM
    dK, dV = np.zeros((Nk, d)), np.zeros((Nk, d))                         # line 5: dK = dV = 0 in HBM
    for j0 in range(0, Nk, Bc):                                           # line 6: for 1 <= j <= Tc
        Kj, Vj = K[j0:j0 + Bc], V[j0:j0 + Bc]                             # line 7: load K_j, V_j to SRAM
        dKj, dVj = np.zeros_like(Kj), np.zeros_like(Vj)                   # line 8: dK~_j = dV~_j = 0 on chip
        for i0 in range(0, Nq, Br):                                       # line 9: for 1 <= i <= Tr
            r = slice(i0, i0 + Br)
            Qi, Oi, dOi, li, mi = Q[r], O[r], dO[r], l[r], m[r]           # line 10: load Q_i, O_i, dO_i, dQ_i, l_i, m_i
            S = tau * Qi @ Kj.T                                           # line 11: S_ij = tau Q_i K_jᵀ
            if causal:
                S = _mask(S, i0, j0, diag)                                # line 12: MASK(S_ij)
            seen = li > 0                                                 #   (a row with no key: P = 0)
            P = np.where(seen[:, None], np.exp(S - np.where(seen, mi, 0.0)[:, None]), 0.0) \
                / np.where(seen, li, 1.0)[:, None]                        # line 13: P_ij = diag(l_i)^-1 exp(S_ij - m_i)
            dVj += P.T @ dOi                                              # line 16: dV~_j += P_ijᵀ dO_i
            dP = dOi @ Vj.T                                               # line 17: dP_ij = dO_i V_jᵀ
            Di = (dOi * Oi).sum(axis=1)                                   # line 19: D_i = rowsum(dO_i ∘ O_i)
            dS = P * (dP - Di[:, None])                                   # line 20: dS_ij = P_ij ∘ (dP_ij - D_i)
            dQ[r] += tau * dS @ Kj                                        # line 21: dQ_i += tau dS_ij K_j (HBM)
            dKj += tau * dS.T @ Qi                                        # line 22: dK~_j += tau dS_ijᵀ Q_i
        dK[j0:j0 + Bc], dV[j0:j0 + Bc] = dKj, dVj                         # line 24: write dK_j, dV_j to HBM
    return dQ, dK, dV                                                     # line 26


# --------------------------------------------------------------------------- launchers


def forward_stats(q, k, v, *, causal, scale, M=None, Br=None, Bc=None, warps=None):
    """Alg. 1 as written: returns ``(O, l, m, tiles)`` -- the paper's statistics, before ``L = m + log l``."""
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    t = tiles(d, M=M, Br=Br, Bc=Bc, warps=warps)
    O = empty((BH, Nq, d))
    l = empty((BH, Nq))
    m = empty((BH, Nq))
    launch_rows(make_init_forward(), BH, Nq, O, l, m, label="init O, l, m")
    kernel = make_forward(t["Br"], t["Bc"], d, t["warps"], bool(causal))
    launch(kernel, (BH,), (WARP, t["warps"]), q, k, v, O, l, m, scale, causal_diag(causal, Nq, Nk),
           label="FA1 forward")
    return O, l, m, t


def forward(q, k, v, *, causal, scale, M=None, Br=None, Bc=None, warps=None):
    """FA1 forward: ``(O, L)`` with ``L = m + log l`` computed by a final small kernel."""
    O, l, m, _ = forward_stats(q, k, v, causal=causal, scale=scale, M=M, Br=Br, Bc=Bc, warps=warps)
    BH, Nq = l.shape
    L = empty((BH, Nq))
    launch_rows(make_lse(), BH, Nq, l, m, L, label="L = m + log l")
    return O, L


def backward(q, k, v, o, lse, do, *, causal, scale, M=None, Br=None, Bc=None, warps=None):
    """FA1 Alg. 4: ``(dQ, dK, dV)``; ``P`` is rebuilt as ``exp(S - L)`` from the saved log-sum-exp."""
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    t = tiles(d, M=M, Br=Br, Bc=Bc, warps=warps)
    dQ = empty((BH, Nq, d))
    dK = empty((BH, Nk, d))   # no zero-fill needed: every row of dK, dV is written exactly once (line 24)
    dV = empty((BH, Nk, d))
    launch_rows(make_zero_rows(), BH, Nq, dQ, label="dQ = 0")
    kernel = make_backward(t["Br"], t["Bc"], d, t["warps"], bool(causal))
    launch(kernel, (BH,), (WARP, t["warps"]), q, k, v, o, lse, do, dQ, dK, dV, scale,
           causal_diag(causal, Nq, Nk),
           label="FA1 backward")
    return dQ, dK, dV


register_impl("fa1", stage="3",
              description="FlashAttention-1: one block per head, K/V outer loop, O/l/m through HBM, split-K "
                          "warps (Alg. 1 / Alg. 4)",
              forward=forward, backward=backward, options=("M", "Br", "Bc", "warps"))


# --------------------------------------------------------------------------- analytic model


def _launch(name, reads, writes, shared_reads=0, shared_writes=0):
    return dict(launch=name, reads={k: v for k, v in reads.items() if v},
                writes={k: v for k, v in writes.items() if v}, atomics={},
                shared_reads=shared_reads, shared_writes=shared_writes)


def model_forward(BH, Nq, Nk, d, *, causal=False, M=None, Br=None, Bc=None, warps=None, check_fit=True):
    """Exact element accesses of :func:`forward`, one dict per launch.  ``causal`` is accepted and changes
    nothing: this kernel visits every tile and masks, so the mask changes values, never which elements are
    touched.  Per (batch, head), with ``Tr = ⌈Nq/Br⌉``, ``Tc = ⌈Nk/Bc⌉``:

    * global: K, V read once (``Nk·d`` each); Q and O read ``Tc·Nq·d``, O written ``Tc·Nq·d``; l and m read
      and written ``Tc·Nq`` each; plus the init (``Nq·d + 2Nq`` writes) and ``L = m + log l``
      (``2Nq`` reads, ``Nq`` writes).
    * shared: every tile is processed full size (padding rows and keys included), see the comments.
    """
    t = tiles(d, M=M, Br=Br, Bc=Bc, warps=warps, check_fit=check_fit)
    Br, Bc, W = t["Br"], t["Bc"], t["warps"]
    Tr, Tc = cdiv(Nq, Br), cdiv(Nk, Bc)
    it = BH * Tr * Tc   # inner iterations over all blocks
    shared_writes = (BH * Tc * 2 * Bc * d                 # K_j, V_j loads (zero-filled past Nk)
                     + it * (2 * Br * d + 2 * Br          # Q_i, O_i, l_i, m_i loads
                             + W * Br * (d + 2)           # split-K partials O_w, m_w, l_w
                             + Br * (W + 3)               # merge: a_i, W weights, m_i, l_i
                             + Br * d))                   # O_i update
    shared_reads = (it * (3 * Br * Bc * d                 # S = Q_i K_jᵀ (2d per score) and P̃ V_j (d per score)
                          + Br * (4 * W + 2)              # merge: m_w three times, l_w once, m_i, l_i
                          + Br * d * (2 + 2 * W))         # O_i update: a_i, O_i, W × (weight, O_w)
                    + BH * Tc * (Nq * d + 2 * Nq))        # O_i, l_i, m_i stores (rows inside Nq only)
    return [
        _launch("init O, l, m", {}, {"O": BH * Nq * d, "l": BH * Nq, "m": BH * Nq}),
        _launch("FA1 forward",
                {"Q": BH * Tc * Nq * d, "K": BH * Nk * d, "V": BH * Nk * d, "O": BH * Tc * Nq * d,
                 "l": BH * Tc * Nq, "m": BH * Tc * Nq},
                {"O": BH * Tc * Nq * d, "l": BH * Tc * Nq, "m": BH * Tc * Nq},
                shared_reads, shared_writes),
        _launch("L = m + log l", {"l": BH * Nq, "m": BH * Nq}, {"L": BH * Nq}),
    ]


def model_backward(BH, Nq, Nk, d, *, causal=False, M=None, Br=None, Bc=None, warps=None, check_fit=True):
    """Exact element accesses of :func:`backward`, one dict per launch (any causal flag).  Per (batch,
    head): K, V read once and dK, dV written once (``Nk·d`` each); Q, O, dO, dQ read ``Tc·Nq·d`` each and
    dQ written ``Tc·Nq·d``; L read ``Tc·Nq``; plus the ``dQ = 0`` init (``Nq·d`` writes)."""
    t = tiles(d, M=M, Br=Br, Bc=Bc, warps=warps, check_fit=check_fit)
    Br, Bc = t["Br"], t["Bc"]
    Tr, Tc = cdiv(Nq, Br), cdiv(Nk, Bc)
    it = BH * Tr * Tc
    shared_writes = (BH * Tc * 4 * Bc * d                 # K_j, V_j loads, dK_j = dV_j = 0
                     + it * (4 * Br * d + Br              # Q_i, O_i, dO_i, dQ_i, L_i loads
                             + Br                         # D_i
                             + 2 * Br * Bc                # P, dS
                             + 2 * Bc * d                 # dV_j, dK_j updates
                             + Br * d))                   # dQ_i update
    shared_reads = (it * (2 * Br * d                      # D_i = rowsum(dO_i ∘ O_i)
                          + Br * Bc * (2 * d + 1)         # S (Q_i, K_j) and L_i
                          + Bc * d * (1 + 2 * Br)         # dV_j += Pᵀ dO_i
                          + Br * Bc * (2 * d + 2)         # dP (dO_i, V_j), dS (P, D_i)
                          + Br * d * (2 * Bc + 1)         # dQ_i += τ dS K_j
                          + Bc * d * (2 * Br + 1))        # dK_j += τ dSᵀ Q_i
                    + BH * (Tc * Nq * d                   # dQ_i stores (rows inside Nq)
                            + 2 * Nk * d))                # dK_j, dV_j stores (rows inside Nk)
    return [
        _launch("dQ = 0", {}, {"X": BH * Nq * d}),
        _launch("FA1 backward",
                {"Q": BH * Tc * Nq * d, "K": BH * Nk * d, "V": BH * Nk * d, "O": BH * Tc * Nq * d,
                 "L": BH * Tc * Nq, "dO": BH * Tc * Nq * d, "dQ": BH * Tc * Nq * d},
                {"dQ": BH * Tc * Nq * d, "dK": BH * Nk * d, "dV": BH * Nk * d},
                shared_reads, shared_writes),
    ]
