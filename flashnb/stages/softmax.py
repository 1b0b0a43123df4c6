"""Stage 2 -- softmax from unsafe to online, and the one-pass attention row.

The idea FlashAttention stands on: a softmax row needs its maximum ``m`` and its normaliser
``d = sum_j exp(x_j - m)`` before any output can be written, but the pair ``[m, d]`` can be built in the
same pass that finds the maximum (Milakov & Gimelshein 2018), and two partial pairs merge exactly:

    [m, d] ⊕ [m', d'] = [max(m, m'),  d·e^(m - max) + d'·e^(m' - max)]      (associative, commutative)

Row kernels work on a ``(rows, n)`` float32 matrix ``X``, one thread block of ``TPB`` threads per row
(grid ``rows``): thread ``t`` handles elements ``t, t + TPB, t + 2·TPB, ...`` (coalesced), then the block
combines the per-thread partials, either through a tree in shared memory (``reduce="block"``) or with warp
shuffles followed by one shared-memory step across warps (``reduce="warp"``).

* :func:`make_softmax_unsafe` -- ``d = Σ e^x`` (pass 1), ``y = e^x / d`` (pass 2): 2 reads + 1 write per
  element, and overflow for ``x ≳ 88.72`` in float32.
* :func:`make_softmax_safe` -- max (pass 1), ``d = Σ e^(x-m)`` (pass 2), normalise (pass 3): 3 reads + 1 write.
* :func:`make_softmax_online` -- ``[m, d]`` in one pass (pass 1), normalise (pass 2): 2 reads + 1 write.
* :func:`make_online_partials` -- ``[m, d]`` of each chunk of a row, one block per chunk: the merge across
  thread blocks (what split-K / flash-decoding kernels do).
* :func:`make_attention_rows` / :func:`make_attention_tiles` -- attention ``o = softmax(scale·q Kᵀ) V`` for
  query rows in one pass over K and V: the online softmax fused with the weighted sum of V, first key by
  key (Ye's ``o'`` recurrence), then tile by tile through shared memory (FA1 Alg. 1 lines 9-12 for one
  block of query rows) -- where FlashAttention begins.

Host functions take and return NumPy arrays: :func:`softmax`, :func:`online_partials`, :func:`merge`,
:func:`attention_rows`.  ``impl="onepass"`` (forward only) plugs the one-pass kernels into
:func:`flashnb.attention`.

Simulator note: inside a kernel on the simulator ``math.exp`` is Python's.  For ``88.72 < x < 709.78`` it
returns a finite float64 that ``float32(...)`` turns into ``inf`` -- the GPU's answer -- but from
``x ≥ 709.78`` it raises ``OverflowError`` where ``expf`` on a GPU returns ``inf``.  The safe and online
kernels never take ``exp`` of a positive number, so they are unaffected; :func:`softmax` refuses
``method="unsafe"`` on such inputs in simulator mode instead of reporting a simulator artefact.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from .. import runtime
from ..common import (
    NEG_INF,
    ONE,
    ZERO,
    causal_allowed,
    causal_diag,
    cdiv,
    check_shared_fit,
    empty,
    launch,
    load_rows,
    to_device,
)
from ..registry import kernel_factory, register_impl

__all__ = [
    "make_softmax_unsafe", "make_softmax_safe", "make_softmax_online", "make_online_partials",
    "make_attention_rows", "make_attention_tiles", "merge_state", "block_reduce_sum", "block_reduce_max",
    "block_reduce_state", "warp_reduce_sum", "warp_reduce_max", "warp_reduce_state",
    "softmax", "softmax_device", "online_partials", "merge", "merge_all", "attention_rows", "forward",
    "model_softmax", "model_online_partials", "model_attention_rows", "model_forward",
    "METHODS", "REDUCTIONS", "THREADS", "TILE", "FLOAT32_EXP_OVERFLOW", "FLOAT16_EXP_OVERFLOW",
    "SIM_EXP_OVERFLOW",
]

METHODS = ("unsafe", "safe", "online")
REDUCTIONS = ("block", "warp")
THREADS = 32        # default threads per row block (kept small: every thread is a Python thread in the simulator)
TILE = 16           # default Br = Bc of the tiled one-pass attention
WARP = 32
FULL_MASK = 0xFFFFFFFF
FLOAT32_EXP_OVERFLOW = math.log(float(np.finfo(np.float32).max))   # 88.72: expf(x) = inf from here on
FLOAT16_EXP_OVERFLOW = math.log(float(np.finfo(np.float16).max))   # 11.09: e^x > 65504 in half precision
SIM_EXP_OVERFLOW = math.log(float(np.finfo(np.float64).max))       # 709.78: Python's math.exp raises

_X2 = "float32[:, ::1]"
_A3 = "float32[:, :, ::1]"
_ROW_SIG = f"void({_X2}, {_X2})"


# --------------------------------------------------------------------------- the merge and the reductions


@cuda.jit(device=True, inline="always")
def merge_state(m_a, d_a, m_b, d_b):
    """[m_a, d_a] ⊕ [m_b, d_b] = [m, d_a·e^(m_a-m) + d_b·e^(m_b-m)] with m = max(m_a, m_b).

    The exponents are ≤ 0, so nothing overflows; an empty state is [-inf, 0] (its e^(-inf - m) is 0), and
    two empty states give an empty state instead of e^(-inf - (-inf)) = NaN.
    """
    m = max(m_a, m_b)
    if m == NEG_INF:
        return m, ZERO
    return m, d_a * float32(math.exp(m_a - m)) + d_b * float32(math.exp(m_b - m))


@cuda.jit(device=True, inline="always")
def block_reduce_sum(red, value, tid):
    """Sum of ``value`` over the block's threads by a tree in shared memory ``red`` (TPB = red.shape[0],
    a power of two): log2(TPB) halving steps, a barrier after each; every thread gets the total."""
    TPB = red.shape[0]
    red[tid] = value
    cuda.syncthreads()
    s = TPB // 2
    while s > 0:
        if tid < s:
            red[tid] = red[tid] + red[tid + s]
        cuda.syncthreads()
        s //= 2
    total = red[0]
    cuda.syncthreads()          # everyone has read red[0] before red is reused
    return total


@cuda.jit(device=True, inline="always")
def block_reduce_max(red, value, tid):
    """Maximum of ``value`` over the block (same tree as :func:`block_reduce_sum`)."""
    TPB = red.shape[0]
    red[tid] = value
    cuda.syncthreads()
    s = TPB // 2
    while s > 0:
        if tid < s:
            red[tid] = max(red[tid], red[tid + s])
        cuda.syncthreads()
        s //= 2
    total = red[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True, inline="always")
def block_reduce_state(red_m, red_d, m, d, tid):
    """[m, d] ⊕ over the block: the same tree, with the merge as the operator (it is associative)."""
    TPB = red_m.shape[0]
    red_m[tid] = m
    red_d[tid] = d
    cuda.syncthreads()
    s = TPB // 2
    while s > 0:
        if tid < s:
            mm, dd = merge_state(red_m[tid], red_d[tid], red_m[tid + s], red_d[tid + s])
            red_m[tid] = mm
            red_d[tid] = dd
        cuda.syncthreads()
        s //= 2
    m = red_m[0]
    d = red_d[0]
    cuda.syncthreads()
    return m, d


@cuda.jit(device=True, inline="always")
def warp_reduce_sum(value, red, tid):
    """Sum over the block: butterfly shuffles inside each warp (no shared memory, no barrier), then lane 0
    of every warp leaves its total in ``red[warp]`` and every thread adds the NW warp totals."""
    offset = WARP // 2
    while offset > 0:
        value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
        offset //= 2
    if tid % WARP == 0:
        red[tid // WARP] = value
    cuda.syncthreads()
    total = ZERO
    for w in range(red.shape[0]):
        total += red[w]
    cuda.syncthreads()
    return total


@cuda.jit(device=True, inline="always")
def warp_reduce_max(value, red, tid):
    """Maximum over the block with warp shuffles (see :func:`warp_reduce_sum`)."""
    offset = WARP // 2
    while offset > 0:
        value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, offset))
        offset //= 2
    if tid % WARP == 0:
        red[tid // WARP] = value
    cuda.syncthreads()
    total = NEG_INF
    for w in range(red.shape[0]):
        total = max(total, red[w])
    cuda.syncthreads()
    return total


@cuda.jit(device=True, inline="always")
def warp_reduce_state(m, d, red_m, red_d, tid):
    """[m, d] ⊕ over the block with warp shuffles: the merge runs between lanes ``offset`` apart."""
    offset = WARP // 2
    while offset > 0:
        m_o = cuda.shfl_xor_sync(FULL_MASK, m, offset)
        d_o = cuda.shfl_xor_sync(FULL_MASK, d, offset)
        m, d = merge_state(m, d, m_o, d_o)
        offset //= 2
    if tid % WARP == 0:
        red_m[tid // WARP] = m
        red_d[tid // WARP] = d
    cuda.syncthreads()
    m = NEG_INF
    d = ZERO
    for w in range(red_m.shape[0]):
        m, d = merge_state(m, d, red_m[w], red_d[w])
    cuda.syncthreads()
    return m, d


def _row_configs(name):  # noqa: ARG001
    configs = [dict(TPB=t, reduce="block") for t in (32, 256)]
    configs += [dict(TPB=t, reduce="warp") for t in (32, 256)]
    return configs


def _red_size(TPB, reduce):
    """Shared slots a reduction needs: one per thread (tree) or one per warp (shuffles)."""
    if reduce == "warp":
        if TPB % WARP:
            raise ValueError(f"threads must be a multiple of {WARP} with reduce='warp', got {TPB}")
        return TPB // WARP
    return TPB


# --------------------------------------------------------------------------- row softmax kernels


@kernel_factory("softmax.unsafe", stage="2", signature=_ROW_SIG, configs=_row_configs("unsafe"),
                threads=lambda TPB, reduce: TPB)
def make_softmax_unsafe(TPB, reduce):
    """y = e^x / Σ e^x: two passes over the row, and e^x overflows float32 from x ≈ 88.72 on."""
    R = _red_size(TPB, reduce)
    warp = reduce == "warp"

    @cuda.jit
    def softmax_unsafe(X, Y):
        """Grid (rows,), block (TPB,): one block per row of X."""
        red = cuda.shared.array(R, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        n = X.shape[1]
        d = ZERO
        for j in range(tid, n, TPB):                       # pass 1: d = Σ e^x (no shift: unsafe)
            d += float32(math.exp(X[row, j]))
        d = warp_reduce_sum(d, red, tid) if warp else block_reduce_sum(red, d, tid)
        for j in range(tid, n, TPB):                       # pass 2: y = e^x / d
            Y[row, j] = float32(math.exp(X[row, j])) / d

    return softmax_unsafe


@kernel_factory("softmax.safe", stage="2", signature=_ROW_SIG, configs=_row_configs("safe"),
                threads=lambda TPB, reduce: TPB)
def make_softmax_safe(TPB, reduce):
    """Safe softmax in three passes over the row: m = max x, d = Σ e^(x-m), y = e^(x-m) / d."""
    R = _red_size(TPB, reduce)
    warp = reduce == "warp"

    @cuda.jit
    def softmax_safe(X, Y):
        """Grid (rows,), block (TPB,): one block per row of X."""
        red = cuda.shared.array(R, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        n = X.shape[1]
        m = NEG_INF
        for j in range(tid, n, TPB):                       # pass 1: m = max_j x_j
            m = max(m, X[row, j])
        m = warp_reduce_max(m, red, tid) if warp else block_reduce_max(red, m, tid)
        m_safe = m if m != NEG_INF else ZERO               # all -inf: e^(-inf - 0) = 0, no NaN
        d = ZERO
        for j in range(tid, n, TPB):                       # pass 2: d = Σ e^(x_j - m)
            d += float32(math.exp(X[row, j] - m_safe))
        d = warp_reduce_sum(d, red, tid) if warp else block_reduce_sum(red, d, tid)
        inv_d = ONE / d if d > ZERO else ZERO              # fully masked row -> 0 (the reference's rule)
        for j in range(tid, n, TPB):                       # pass 3: y_j = e^(x_j - m) / d
            Y[row, j] = float32(math.exp(X[row, j] - m_safe)) * inv_d

    return softmax_safe


@kernel_factory("softmax.online", stage="2", signature=_ROW_SIG, configs=_row_configs("online"),
                threads=lambda TPB, reduce: TPB)
def make_softmax_online(TPB, reduce):
    """Online softmax in two passes: [m, d] together (d_j = d_{j-1}·e^(m_{j-1}-m_j) + e^(x_j-m_j)), then y."""
    R = _red_size(TPB, reduce)
    warp = reduce == "warp"

    @cuda.jit
    def softmax_online(X, Y):
        """Grid (rows,), block (TPB,): one block per row of X."""
        red_m = cuda.shared.array(R, float32)
        red_d = cuda.shared.array(R, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        n = X.shape[1]
        m = NEG_INF
        d = ZERO
        # region online-pass
        for j in range(tid, n, TPB):                       # pass 1: [m, d] ← [m, d] ⊕ [x_j, 1]
            m, d = merge_state(m, d, X[row, j], ONE)
        # endregion online-pass
        if warp:
            m, d = warp_reduce_state(m, d, red_m, red_d, tid)
        else:
            m, d = block_reduce_state(red_m, red_d, m, d, tid)
        # region normalise
        m_safe = m if m != NEG_INF else ZERO
        inv_d = ONE / d if d > ZERO else ZERO
        for j in range(tid, n, TPB):                       # pass 2: y_j = e^(x_j - m) / d
            Y[row, j] = float32(math.exp(X[row, j] - m_safe)) * inv_d
        # endregion normalise

    return softmax_online


@kernel_factory("softmax.online_partials", stage="2", signature=f"void({_X2}, {_X2}, {_X2})",
                configs=[dict(TPB=32), dict(TPB=256)], threads=lambda TPB: TPB)
def make_online_partials(TPB):
    """[m, d] of every chunk of C = ⌈X.shape[1] / M.shape[1]⌉ elements of a row; one block per chunk.

    With many chunks the last ones can be empty; an empty chunk has the neutral state [-inf, 0].
    """

    @cuda.jit
    def online_partials(X, M, D):
        """Grid (chunks, rows), block (TPB,): M[row, c], D[row, c] = state of X[row, c·C : (c+1)·C]."""
        red_m = cuda.shared.array(TPB, float32)
        red_d = cuda.shared.array(TPB, float32)
        c = cuda.blockIdx.x
        row = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        n = X.shape[1]
        C = (n + M.shape[1] - 1) // M.shape[1]
        m = NEG_INF
        d = ZERO
        # region chunk-fold
        for j in range(c * C + tid, min(n, (c + 1) * C), TPB):
            m, d = merge_state(m, d, X[row, j], ONE)
        # endregion chunk-fold
        m, d = block_reduce_state(red_m, red_d, m, d, tid)
        if tid == 0:
            M[row, c] = m
            D[row, c] = d

    return online_partials


# --------------------------------------------------------------------------- one-pass attention


_ATT_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, float32[:, ::1], float32, int32)"


@kernel_factory("softmax.attention_rows", stage="2", signature=_ATT_SIG,
                configs=[dict(R=TILE, d=dd, causal=c) for dd in (16, 128) for c in (False, True)],
                threads=lambda R, d, causal: R)
def make_attention_rows(R, d, causal):
    """One thread per query row, one key at a time straight from global memory (Ye's o' recurrence)."""

    @cuda.jit
    def attention_rows(Q, K, V, O, L, scale, diag):
        """Grid (⌈Nq/R⌉, BH), block (R,).  For keys j = 1..N (x_j = scale·q·k_j):
        m_j = max(m_{j-1}, x_j);  d_j = d_{j-1}·e^(m_{j-1}-m_j) + e^(x_j-m_j);
        o_j = o_{j-1}·d_{j-1}·e^(m_{j-1}-m_j) / d_j + e^(x_j-m_j) / d_j · V[j]."""
        Qs = cuda.shared.array((R, d), float32)  # the block's query rows (registers can't hold q and o at d=128)
        z = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        i = cuda.blockIdx.x * R + tid
        if i >= Q.shape[1]:
            return
        Nk = K.shape[1]
        q_i = Qs[tid]                                      # thread tid's own row: no barrier needed
        o_i = cuda.local.array(d, float32)
        for t in range(d):
            q_i[t] = Q[z, i, t]
            o_i[t] = ZERO
        n_keys = min(Nk, i + diag + 1) if causal else Nk   # causal: keys j <= i + diag only
        m = NEG_INF
        dn = ZERO
        for j in range(n_keys):
            x = ZERO
            for t in range(d):
                x += q_i[t] * K[z, j, t]
            x *= scale
            m_new = max(m, x)
            decay = float32(math.exp(m - m_new))           # e^(m_{j-1} - m_j); 0 for the first key
            p = float32(math.exp(x - m_new))
            d_new = dn * decay + p
            # region o-update
            a = dn * decay / d_new
            b = p / d_new
            for t in range(d):
                o_i[t] = o_i[t] * a + b * V[z, j, t]
            # endregion o-update
            m = m_new
            dn = d_new
        # region write-o
        for t in range(d):
            O[z, i, t] = o_i[t]
        # endregion write-o
        L[z, i] = m + float32(math.log(dn)) if dn > ZERO else NEG_INF

    return attention_rows


@kernel_factory("softmax.attention_tiles", stage="2", signature=_ATT_SIG,
                configs=[dict(Br=b, Bc=b, d=dd, causal=c) for b, dd in ((16, 16), (16, 128), (32, 128))
                         for c in (False, True)],
                threads=lambda Br, Bc, d, causal: Br)
def make_attention_tiles(Br, Bc, d, causal):
    """One thread per query row, Br rows per block; K and V pass through shared memory Bc rows at a time."""

    @cuda.jit
    def attention_tiles(Q, K, V, O, L, scale, diag):
        """Grid (⌈Nq/Br⌉, BH), block (Br,).  Per K/V tile j (FA1 Alg. 1 lines 9-12, one block of rows):
        S = scale·q Kjᵀ; m~ = max S; P~ = e^(S - m~); l~ = Σ P~;  m_new = max(m, m~);
        l_new = e^(m - m_new)·l + e^(m~ - m_new)·l~;  o ← (l·e^(m - m_new)·o + e^(m~ - m_new)·P~ Vj) / l_new."""
        Kj = cuda.shared.array((Bc, d), float32)
        Vj = cuda.shared.array((Bc, d), float32)
        z = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        r0 = cuda.blockIdx.x * Br
        i = r0 + tid
        Nq = Q.shape[1]
        Nk = K.shape[1]
        active = i < Nq
        q_i = cuda.local.array(d, float32)
        o_i = cuda.local.array(d, float32)
        p = cuda.local.array(Bc, float32)
        for t in range(d):
            q_i[t] = Q[z, i, t] if active else ZERO
            o_i[t] = ZERO
        m_i = NEG_INF
        l_i = ZERO
        last = min(Nk, r0 + Br + diag) if causal else Nk    # keys this block of rows may see
        for k0 in range(0, last, Bc):
            load_rows(K, z, k0, Kj, tid, Br)                 # line 6: load Kj, Vj into SRAM
            load_rows(V, z, k0, Vj, tid, Br)
            cuda.syncthreads()
            # region tile-update
            if active:
                m_t = NEG_INF
                for c in range(Bc):                          # line 9: S = scale·q Kjᵀ (masked)
                    x = ZERO
                    for t in range(d):
                        x += q_i[t] * Kj[c, t]
                    ok = k0 + c < Nk and (not causal or causal_allowed(i, k0 + c, diag))
                    p[c] = scale * x if ok else NEG_INF
                    m_t = max(m_t, p[c])
                l_t = ZERO
                for c in range(Bc):                          # line 10: P~ = e^(S - m~), l~ = Σ P~
                    p[c] = float32(math.exp(p[c] - m_t)) if p[c] != NEG_INF else ZERO
                    l_t += p[c]
                m_new = max(m_i, m_t)                        # line 11
                alpha = float32(math.exp(m_i - m_new)) if m_new != NEG_INF else ZERO
                beta = float32(math.exp(m_t - m_new)) if m_t != NEG_INF else ZERO
                l_new = alpha * l_i + beta * l_t
                inv = ONE / l_new if l_new > ZERO else ZERO
                for t in range(d):                           # line 12: rescale o, add P~ Vj
                    pv = ZERO
                    for c in range(Bc):
                        pv += p[c] * Vj[c, t]
                    o_i[t] = (l_i * alpha * o_i[t] + beta * pv) * inv
                m_i = m_new
                l_i = l_new
            # endregion tile-update
            cuda.syncthreads()                               # tile consumed before the next load
        if active:
            for t in range(d):
                O[z, i, t] = o_i[t]
            L[z, i] = m_i + float32(math.log(l_i)) if l_i > ZERO else NEG_INF

    return attention_tiles


# --------------------------------------------------------------------------- host functions


def _check_x(x):
    if isinstance(x, (bool, np.bool_)) or not hasattr(x, "__len__") and not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a 1-D or 2-D array of real numbers, got {type(x).__name__}")
    a = np.asarray(x)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"x must hold real numbers, got dtype {a.dtype}")
    if a.ndim not in (1, 2) or a.size == 0:
        raise ValueError(f"x must be a non-empty 1-D or 2-D array (rows, n), got shape {a.shape}")
    if np.isnan(a).any() or (a == np.inf).any():
        raise ValueError("x must not contain NaN or +inf (-inf entries are allowed: masked positions)")
    return a


def _check_threads(threads, reduce):
    if isinstance(threads, (bool, np.bool_)) or not isinstance(threads, (int, np.integer)):
        raise TypeError(f"threads must be an int, got {threads!r}")
    threads = int(threads)
    if threads < 1 or threads > 1024 or threads & (threads - 1):
        raise ValueError(f"threads must be a power of two in 1..1024, got {threads}")
    if reduce == "warp" and threads % WARP:
        raise ValueError(f"threads must be a multiple of {WARP} with reduce='warp', got {threads}")
    return threads


_FACTORIES = {"unsafe": make_softmax_unsafe, "safe": make_softmax_safe, "online": make_softmax_online}


def softmax(x, method: str = "online", *, reduce: str = "block", threads: int = THREADS):
    """Row-wise softmax of ``x`` (1-D, or 2-D ``(rows, n)``) on the device; returns float32 NumPy.

    ``method``: ``"unsafe"`` (Σ e^x), ``"safe"`` (three passes) or ``"online"`` (two passes).
    ``reduce``: ``"block"`` (tree in shared memory) or ``"warp"`` (shuffles, then across warps).
    ``threads``: threads per row block (a power of two; a multiple of 32 for ``reduce="warp"``).
    ``-inf`` entries get probability 0.  A row of only ``-inf`` gives zeros with ``safe`` and ``online`` (the
    reference's convention); ``unsafe`` divides 0 by 0 there and returns NaN -- one more way it is unsafe.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    threads = _check_threads(threads, reduce)
    a = _check_x(x)
    a2 = np.ascontiguousarray(np.atleast_2d(a), dtype=np.float32)
    if method == "unsafe" and runtime.is_simulator() and (a2 >= SIM_EXP_OVERFLOW).any():
        raise ValueError(
            f"method='unsafe' with x >= {SIM_EXP_OVERFLOW:.2f}: the simulator's math.exp is Python's and raises "
            "OverflowError there, where a GPU's expf returns inf (and the softmax becomes inf/inf = NaN). "
            f"Any x >= {FLOAT32_EXP_OVERFLOW:.2f} already shows the float32 overflow on the simulator too."
        )
    X = to_device(a2)
    Y = empty(a2.shape)
    softmax_device(X, Y, method, reduce=reduce, threads=threads)
    return Y.copy_to_host().reshape(a.shape)


def softmax_device(X, Y, method: str = "online", *, reduce: str = "block", threads: int = THREADS):
    """``Y = softmax(X)`` row-wise on float32 device arrays ``(rows, n)``: one launch, one block per row (what
    a GPU benchmark times; :func:`softmax` is the NumPy-in, NumPy-out wrapper with the argument checks)."""
    launch(_FACTORIES[method](threads, reduce), X.shape[0], threads, X, Y, label=f"softmax ({method})")


def online_partials(x, chunks: int, *, threads: int = THREADS):
    """``(m, d)``, each ``(rows, chunks)``: the online state of each chunk of each row, one block per chunk."""
    if isinstance(chunks, (bool, np.bool_)) or not isinstance(chunks, (int, np.integer)):
        raise TypeError(f"chunks must be an int, got {chunks!r}")
    a = _check_x(x)
    a2 = np.ascontiguousarray(np.atleast_2d(a), dtype=np.float32)
    if not 1 <= chunks <= a2.shape[1]:
        raise ValueError(f"chunks must be in 1..{a2.shape[1]} (the row length), got {chunks}")
    threads = _check_threads(threads, "block")
    rows = a2.shape[0]
    M = empty((rows, chunks))
    D = empty((rows, chunks))
    launch(make_online_partials(threads), (chunks, rows), threads, to_device(a2), M, D,
           label="[m, d] per chunk")
    return M.copy_to_host(), D.copy_to_host()


def merge(a, b):
    """Host (float64) version of the merge: ``(m_a, d_a) ⊕ (m_b, d_b)``; works elementwise on arrays."""
    m_a, d_a = (np.asarray(t, dtype=np.float64) for t in a)
    m_b, d_b = (np.asarray(t, dtype=np.float64) for t in b)
    m = np.maximum(m_a, m_b)
    safe = np.where(np.isfinite(m), m, 0.0)     # both empty: keep [-inf, 0], never NaN
    with np.errstate(invalid="ignore"):
        d = d_a * np.exp(m_a - safe) + d_b * np.exp(m_b - safe)
    return m, d


def merge_all(m, d, axis=-1):
    """Fold :func:`merge` over ``axis`` (left to right); ``(m, d)`` of the whole row."""
    m = np.moveaxis(np.asarray(m, dtype=np.float64), axis, 0)
    d = np.moveaxis(np.asarray(d, dtype=np.float64), axis, 0)
    state = (np.full(m.shape[1:], -np.inf), np.zeros(m.shape[1:]))
    for k in range(m.shape[0]):
        state = merge(state, (m[k], d[k]))
    return state


def _check_tile(tile, d):
    if tile is None:
        return None
    if isinstance(tile, (bool, np.bool_)) or not isinstance(tile, (int, np.integer)):
        raise TypeError(f"tile must be an int or None, got {tile!r}")
    tile = int(tile)
    if not 1 <= tile <= 64:
        raise ValueError(f"tile must be in 1..64, got {tile}")
    check_shared_fit("onepass", f"tile={tile} at d={d}", 2 * tile * d * 4, "choose a smaller tile")
    return tile


def forward(q, k, v, *, causal, scale, tile=TILE):
    """One-pass attention forward on device arrays ``(BH, N, d)`` → ``(o, lse)``.

    ``tile=None``: key by key from global memory (:func:`make_attention_rows`); ``tile=B``: K and V through
    shared memory B rows at a time, B query rows per block (:func:`make_attention_tiles`).
    """
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    tile = _check_tile(tile, d)
    O = empty((BH, Nq, d))
    L = empty((BH, Nq))
    if tile is None:
        kernel = make_attention_rows(TILE, d, bool(causal))
        launch(kernel, (cdiv(Nq, TILE), BH), TILE, q, k, v, O, L, scale, causal_diag(causal, Nq, Nk),
               label="one-pass attention")
    else:
        kernel = make_attention_tiles(tile, tile, d, bool(causal))
        launch(kernel, (cdiv(Nq, tile), BH), tile, q, k, v, O, L, scale, causal_diag(causal, Nq, Nk),
               label="one-pass attention (tiles)")
    return O, L


register_impl("onepass", stage="2",
              description="online softmax fused with PV, one thread per query row, K/V tiles in shared memory",
              forward=forward, options=("tile",))


def attention_rows(q, K, V, *, tile=TILE, scale=None, causal=False, return_lse=False):
    """Attention for query rows ``q`` (``(d,)`` or ``(Nq, d)``) over keys ``K`` and values ``V`` (``(Nk, d)``),
    in one pass over K and V (see :func:`forward`).  Returns ``o`` (q's shape), and ``lse`` if asked."""
    from ..reference import check_scale

    arrays = {}
    for name, a in (("q", q), ("K", K), ("V", V)):
        a = np.asarray(a)
        if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise TypeError(f"{name} must be a real array, got dtype {a.dtype}")
        if a.size and not (np.all(np.isfinite(a)) and np.abs(a).max() <= np.finfo(np.float32).max):
            raise ValueError(f"{name} must be finite within the float32 range (the kernel computes in float32)")
        arrays[name] = a
    q_arr, K, V = arrays["q"], arrays["K"], arrays["V"]
    q2 = q_arr[None] if q_arr.ndim == 1 else q_arr
    if q2.ndim != 2 or K.ndim != 2 or V.shape != K.shape or K.shape[1] != q2.shape[1] or 0 in q2.shape + K.shape:
        raise ValueError(f"q must be (d,) or (Nq, d) and K, V (Nk, d) with the same d, every axis >= 1; got q "
                         f"{q_arr.shape}, K {K.shape}, V {V.shape}")
    s = check_scale(scale, q2.shape[-1])
    o, lse = forward(*(to_device(a[None]) for a in (q2, K, V)), causal=bool(causal), scale=s, tile=tile)
    o = o.copy_to_host()[0].reshape(q_arr.shape)
    lse = lse.copy_to_host()[0].reshape(q_arr.shape[:-1])
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------- analytic models


def _launch(label, reads, writes, shared_reads=0, shared_writes=0):
    return dict(launch=label, reads={k: v for k, v in reads.items() if v},
                writes={k: v for k, v in writes.items() if v}, atomics={},
                shared_reads=shared_reads, shared_writes=shared_writes)


def _tree(TPB, arrays=1):
    """Shared (reads, writes) of one block_reduce_* call: TPB writes, a halving tree (each combine reads
    2 and writes 1 per array), then every thread reads the result."""
    return arrays * (2 * (TPB - 1) + TPB), arrays * (TPB + TPB - 1)


def _warp(TPB, arrays=1):
    """Shared (reads, writes) of one warp_reduce_* call: lane 0 of each warp writes, everyone reads all."""
    NW = TPB // WARP
    return arrays * TPB * NW, arrays * NW


def model_softmax(rows, n, method="online", *, reduce="block", threads=THREADS):
    """Element accesses of :func:`softmax` on a ``(rows, n)`` input: one launch.

    Global: unsafe reads X twice, safe three times, online twice; all write Y once -- 3, 4, 3 accesses per
    element.  Shared: the block reductions (one for unsafe and online, two for safe)."""
    reduction = _warp if reduce == "warp" else _tree
    passes, (sr, sw) = {
        "unsafe": (2, reduction(threads)),
        "safe": (3, tuple(2 * c for c in reduction(threads))),
        "online": (2, reduction(threads, arrays=2)),
    }[method]
    return [_launch(f"softmax ({method})", {"X": passes * rows * n}, {"Y": rows * n}, rows * sr, rows * sw)]


def model_online_partials(rows, n, chunks, *, threads=THREADS):
    """Element accesses of :func:`online_partials`: X read once, one [m, d] pair written per block."""
    sr, sw = _tree(threads, arrays=2)
    blocks = rows * chunks
    return [_launch("[m, d] per chunk", {"X": rows * n}, {"M": blocks, "D": blocks}, blocks * sr, blocks * sw)]


def _keys(i, Nk, diag, causal):
    return max(0, min(Nk, i + diag + 1)) if causal else Nk


def model_attention_rows(BH, Nq, Nk, d, *, causal=False):
    """Accesses of the key-by-key kernel: each query row reads q once (into shared memory) and the K, V rows
    of every visible key from global memory; its q is read back from shared memory once per key."""
    diag = causal_diag(causal, Nq, Nk)
    keys = sum(_keys(i, Nk, diag, causal) for i in range(Nq))
    return [_launch("one-pass attention", {"Q": BH * Nq * d, "K": BH * keys * d, "V": BH * keys * d},
                    {"O": BH * Nq * d, "L": BH * Nq}, BH * keys * d, BH * Nq * d)]


def model_forward(BH, Nq, Nk, d, *, causal=False, tile=TILE):
    """Accesses of :func:`forward`.  Tiled: each block of Br = tile rows loads every K/V tile it may see
    (2·Bc·d shared writes per tile, zero-filled past Nk) and each of its live rows reads 2·Bc·d from them."""
    if tile is None:
        return model_attention_rows(BH, Nq, Nk, d, causal=causal)
    Br = Bc = tile
    diag = causal_diag(causal, Nq, Nk)
    kv_rows = shared_reads = shared_writes = 0
    for b in range(cdiv(Nq, Br)):
        r0 = b * Br
        last = max(0, min(Nk, r0 + Br + diag)) if causal else Nk
        tiles = cdiv(last, Bc)
        live = min(Br, Nq - r0)
        kv_rows += min(Nk, tiles * Bc)
        shared_writes += tiles * 2 * Bc * d
        shared_reads += tiles * live * 2 * Bc * d
    return [_launch("one-pass attention (tiles)",
                    {"Q": BH * Nq * d, "K": BH * kv_rows * d, "V": BH * kv_rows * d},
                    {"O": BH * Nq * d, "L": BH * Nq}, BH * shared_reads, BH * shared_writes)]


#: Names that moved out of this lesson, by their old name: its GPU measurement lives with the instruments
#: (:mod:`flashnb.instruments.measure.softmax`), which build on the stages; ``softmax.measure_gpu`` still reaches it.
MOVED = {"measure_gpu": "flashnb.instruments.measure.softmax"}


def __getattr__(attr):
    if attr in MOVED:
        import importlib

        return getattr(importlib.import_module(MOVED[attr]), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
