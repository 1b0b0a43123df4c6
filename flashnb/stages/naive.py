"""Stage 1 -- standard attention (FA1 paper, Algorithm 0 forward and Algorithm 3 backward).

Every step is its own kernel and every intermediate (S, P, dP, dS) is an ``(N_q, N_k)`` matrix that goes
to HBM and comes back: that round trip is what FlashAttention removes.

Kernels (``BH`` = batch·heads, all arrays float32 and C-contiguous, shape ``(BH, rows, cols)``):

* :func:`make_matmul` -- ``C = alpha · op(A) · op(B)`` through ``T x T`` shared-memory tiles (op = optional
  transpose); with ``causal`` it writes ``-inf`` where key ``j`` is after query ``i``.
* :func:`make_softmax_rows` -- ``P = softmax(S)`` row by row, the safe three-pass algorithm; also writes
  the row log-sum-exp ``L``.
* :func:`make_p_from_lse` -- ``P = exp(S - L)`` (rebuilds P in the backward from the saved L).
* :func:`make_softmax_bwd_rows` -- ``dS = P ∘ (dP - rowsum(P ∘ dP))``.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from ..common import (
    NEG_INF,
    ROWS_PER_BLOCK,
    causal_allowed,
    causal_diag,
    cdiv,
    empty,
    launch,
    launch_rows,
    load_tile,
    row_index,
)
from ..registry import kernel_factory, register_impl

__all__ = ["make_matmul", "make_softmax_rows", "make_p_from_lse", "make_softmax_bwd_rows",
           "forward", "backward", "model_forward", "model_backward", "matmul_model", "TILE", "ROWS_PER_BLOCK"]

TILE = 16            # T: the matmul's output tile is T x T, one thread per output element

_A3 = "float32[:, :, ::1]"
_MATMUL_SIG = f"void({_A3}, {_A3}, {_A3}, float32, int32)"
_ROW_SIG = f"void({_A3}, {_A3}, float32[:, ::1])"


@kernel_factory("naive.matmul", stage="1", signature=_MATMUL_SIG, threads=lambda T, **_: T * T,
                configs=[dict(T=TILE, trans_a=ta, trans_b=tb, causal=c)
                         for ta, tb, c in [(False, True, False), (False, True, True), (False, False, False),
                                           (True, False, False)]])
def make_matmul(T, trans_a, trans_b, causal):
    """Tiled matmul with the tile size ``T`` and transposes baked in as compile-time constants."""

    @cuda.jit
    def matmul(A, B, C, alpha, diag):
        """C[z] = alpha · op(A[z]) · op(B[z]); grid (⌈cols/T⌉, ⌈rows/T⌉, BH), block (T, T)."""
        As = cuda.shared.array((T, T), float32)  # SRAM tile of op(A)
        Bs = cuda.shared.array((T, T), float32)  # SRAM tile of op(B)
        z = cuda.blockIdx.z
        r0 = cuda.blockIdx.y * T
        c0 = cuda.blockIdx.x * T
        row = r0 + cuda.threadIdx.y
        col = c0 + cuda.threadIdx.x
        inner = A.shape[1] if trans_a else A.shape[2]
        acc = float32(0.0)
        for k0 in range(0, inner, T):
            load_tile(A, z, r0, k0, As, trans_a)   # As = op(A)[r0:r0+T, k0:k0+T]
            load_tile(B, z, k0, c0, Bs, trans_b)   # Bs = op(B)[k0:k0+T, c0:c0+T]
            cuda.syncthreads()
            for kk in range(T):
                acc += As[cuda.threadIdx.y, kk] * Bs[kk, cuda.threadIdx.x]
            cuda.syncthreads()
        if row < C.shape[1] and col < C.shape[2]:
            value = alpha * acc
            if causal and not causal_allowed(row, col, diag):
                value = NEG_INF                   # Alg. 2 MASK: key after query
            C[z, row, col] = value

    return matmul


@kernel_factory("naive.softmax_rows", stage="1", signature=_ROW_SIG, threads=ROWS_PER_BLOCK)
def make_softmax_rows():
    """Kernel factory (no constants to bake): row softmax of S with the log-sum-exp L; grid (⌈Nq/32⌉, BH)."""

    @cuda.jit
    def softmax_rows(S, P, L):
        """Alg. 0 line 2: P = softmax(S), one thread per row, three passes over S (max, sum, normalise)."""
        z, i = row_index()
        if i >= S.shape[1]:
            return
        n = S.shape[2]
        # region max-and-sum
        m = NEG_INF
        for j in range(n):                       # pass 1: m = rowmax(S)
            m = max(m, S[z, i, j])
        m_safe = m if m != NEG_INF else float32(0.0)   # fully masked row: avoid (-inf) - (-inf)
        l = float32(0.0)
        for j in range(n):                       # pass 2: l = rowsum(exp(S - m))
            l += float32(math.exp(S[z, i, j] - m_safe))
        # endregion max-and-sum
        inv_l = float32(1.0) / l if l > float32(0.0) else float32(0.0)
        for j in range(n):                       # pass 3: P = exp(S - m) / l
            P[z, i, j] = float32(math.exp(S[z, i, j] - m_safe)) * inv_l
        L[z, i] = m_safe + float32(math.log(l)) if l > float32(0.0) else NEG_INF

    return softmax_rows


@kernel_factory("naive.p_from_lse", stage="1", signature=f"void({_A3}, float32[:, ::1], {_A3})",
                threads=ROWS_PER_BLOCK)
def make_p_from_lse():
    """Kernel factory: P = exp(S - L), the backward's rebuild of P; grid (⌈Nq/32⌉, BH)."""

    @cuda.jit
    def p_from_lse(S, L, P):
        """P = exp(S - L): the probabilities rebuilt from the saved log-sum-exp (0 where L = -inf)."""
        z, i = row_index()
        if i >= S.shape[1]:
            return
        lse = L[z, i]
        for j in range(S.shape[2]):
            p = float32(0.0)
            if lse != NEG_INF:
                p = float32(math.exp(S[z, i, j] - lse))
            P[z, i, j] = p

    return p_from_lse


@kernel_factory("naive.softmax_bwd_rows", stage="1", signature=f"void({_A3}, {_A3}, {_A3})",
                threads=ROWS_PER_BLOCK)
def make_softmax_bwd_rows():
    """Kernel factory: dS = P ∘ (dP - rowsum(P ∘ dP)) row by row; grid (⌈Nq/32⌉, BH)."""

    @cuda.jit
    def softmax_bwd_rows(P, dP, dS):
        """Alg. 3 line 4: dS = P ∘ (dP - rowsum(P ∘ dP)), one thread per row, two passes."""
        z, i = row_index()
        if i >= P.shape[1]:
            return
        n = P.shape[2]
        D = float32(0.0)
        for j in range(n):                       # pass 1: D_i = sum_j P_ij dP_ij
            D += P[z, i, j] * dP[z, i, j]
        for j in range(n):                       # pass 2: dS_ij = P_ij (dP_ij - D_i)
            dS[z, i, j] = P[z, i, j] * (dP[z, i, j] - D)

    return softmax_bwd_rows


# --------------------------------------------------------------------------- launchers


def _check_tile(tile):
    if isinstance(tile, bool) or not isinstance(tile, int) and not hasattr(tile, "__index__"):
        raise TypeError(f"tile must be an int, got {tile!r}")
    tile = int(tile)
    if not 1 <= tile <= 32:
        raise ValueError(f"tile must be in 1..32 (a tile x tile block of at most 1024 threads), got {tile}")
    return tile


def _matmul(A, B, C, alpha, *, trans_a=False, trans_b=False, causal=False, diag=0, tile=TILE, label):
    BH, rows, cols = C.shape
    kernel = make_matmul(tile, trans_a, trans_b, causal)
    launch(kernel, (cdiv(cols, tile), cdiv(rows, tile), BH), (tile, tile), A, B, C, alpha, diag, label=label)


def _scores(q, k, *, causal, scale, tile=TILE):
    BH, Nq, _ = q.shape
    Nk = k.shape[1]
    S = empty((BH, Nq, Nk))
    _matmul(q, k, S, scale, trans_b=True, causal=bool(causal), diag=causal_diag(causal, Nq, Nk), tile=tile,
            label="S = scale·QKᵀ")
    return S


def forward(q, k, v, *, causal, scale, tile=TILE):
    """Algorithm 0: S = scale·QKᵀ → HBM, P = softmax(S) → HBM, O = PV → HBM.  ``tile``: the matmuls'
    ``T`` (default :data:`TILE`; ``flashnb.attention(..., impl="naive", tile=8)``)."""
    tile = _check_tile(tile)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    S = _scores(q, k, causal=causal, scale=scale, tile=tile)
    P = empty((BH, Nq, Nk))
    L = empty((BH, Nq))
    launch_rows(make_softmax_rows(), BH, Nq, S, P, L, label="P = softmax(S)")
    O = empty((BH, Nq, d))
    _matmul(P, v, O, 1.0, tile=tile, label="O = PV")
    return O, L


def backward(q, k, v, o, lse, do, *, causal, scale, tile=TILE):
    """Algorithm 3, after rebuilding P = exp(S - L) (the API carries L, not the N_q x N_k matrix P)."""
    tile = _check_tile(tile)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    S = _scores(q, k, causal=causal, scale=scale, tile=tile)
    P = empty((BH, Nq, Nk))
    launch_rows(make_p_from_lse(), BH, Nq, S, lse, P, label="P = exp(S - L)")
    dV = empty((BH, Nk, d))
    _matmul(P, do, dV, 1.0, trans_a=True, tile=tile, label="dV = PᵀdO")               # Alg. 3 line 2
    dP = empty((BH, Nq, Nk))
    _matmul(do, v, dP, 1.0, trans_b=True, tile=tile, label="dP = dO Vᵀ")              # Alg. 3 line 3
    dS = empty((BH, Nq, Nk))
    launch_rows(make_softmax_bwd_rows(), BH, Nq, P, dP, dS, label="dS = P∘(dP - rowsum(P∘dP))")  # line 4
    dQ = empty((BH, Nq, d))
    _matmul(dS, k, dQ, scale, tile=tile, label="dQ = scale·dS K")                     # Alg. 3 line 5
    dK = empty((BH, Nk, d))
    _matmul(dS, q, dK, scale, trans_a=True, tile=tile, label="dK = scale·dSᵀQ")      # Alg. 3 line 6
    return dQ, dK, dV


register_impl("naive", stage="1", description="standard attention, S and P through HBM (Alg. 0 / Alg. 3)",
              forward=forward, backward=backward, options=("tile",))


# --------------------------------------------------------------------------- analytic model


def matmul_model(BH, rows, cols, inner, T=TILE):
    """Element accesses of one tiled matmul launch ``C (rows x cols) = op(A) (rows x inner) · op(B) (inner x
    cols)`` with ``T x T`` tiles, as a dict ``a_reads, b_reads, c_writes, shared_reads, shared_writes``:
    A is re-read once per column tile of C, B once per row tile; every block writes 2·T² shared elements
    and its T² threads read 2·T each, per k-step."""
    blocks = BH * cdiv(rows, T) * cdiv(cols, T)
    steps = cdiv(inner, T)
    return dict(
        a_reads=BH * rows * inner * cdiv(cols, T),
        b_reads=BH * inner * cols * cdiv(rows, T),
        c_writes=BH * rows * cols,
        shared_writes=blocks * steps * 2 * T * T,
        shared_reads=blocks * steps * 2 * T * T * T,
    )


def _add(acc, launch_name, reads, writes, shared_reads=0, shared_writes=0):
    acc.append(dict(launch=launch_name, reads=reads, writes=writes, atomics={},
                    shared_reads=shared_reads, shared_writes=shared_writes))


_matmul_model = matmul_model   # the name notebook 01 used before it was public


def _mm(acc, name, a, b, c, BH, rows, cols, inner, T=TILE):
    m = matmul_model(BH, rows, cols, inner, T)
    _add(acc, name, {a: m["a_reads"], b: m["b_reads"]}, {c: m["c_writes"]}, m["shared_reads"], m["shared_writes"])


def model_forward(BH, Nq, Nk, d, *, causal=False, tile=TILE):
    """Expected element reads/writes per launch and per array of :func:`forward` (the causal flag does
    not matter here: masking changes values, not accesses).  Returns a list of dicts, one per launch, in
    launch order; array names are the kernels' parameter names.  ``tile``: the matmuls' T (see
    :func:`matmul_model`)."""
    acc = []
    _mm(acc, "S = scale·QKᵀ", "A", "B", "C", BH, Nq, Nk, d, tile)
    _add(acc, "P = softmax(S)", {"S": 3 * BH * Nq * Nk}, {"P": BH * Nq * Nk, "L": BH * Nq})
    _mm(acc, "O = PV", "A", "B", "C", BH, Nq, d, Nk, tile)
    return acc


def model_backward(BH, Nq, Nk, d, *, causal=False, tile=TILE):
    """Expected element reads/writes per launch and per array of :func:`backward` (see model_forward),
    for the ``lse`` the forward produces.  One access depends on ``causal``: with Nq > Nk the first
    Nq - Nk query rows see no key, their L is -inf, and ``p_from_lse`` writes P = 0 there without
    reading S."""
    empty_rows = max(0, Nq - Nk) if causal else 0
    acc = []
    _mm(acc, "S = scale·QKᵀ", "A", "B", "C", BH, Nq, Nk, d, tile)
    _add(acc, "P = exp(S - L)", {"S": BH * (Nq - empty_rows) * Nk, "L": BH * Nq}, {"P": BH * Nq * Nk})
    _mm(acc, "dV = PᵀdO", "A", "B", "C", BH, Nk, d, Nq, tile)
    _mm(acc, "dP = dO Vᵀ", "A", "B", "C", BH, Nq, Nk, d, tile)
    _add(acc, "dS = P∘(dP - rowsum(P∘dP))", {"P": 2 * BH * Nq * Nk, "dP": 2 * BH * Nq * Nk},
         {"dS": BH * Nq * Nk})
    _mm(acc, "dQ = scale·dS K", "A", "B", "C", BH, Nq, d, Nk, tile)
    _mm(acc, "dK = scale·dSᵀQ", "A", "B", "C", BH, Nk, d, Nq, tile)
    return acc
