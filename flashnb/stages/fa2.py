"""Stage 4 -- FlashAttention-2 (FA2 paper, Algorithm 1 forward and Algorithm 2 backward).

What changes against stage 3 (FlashAttention-1), the three changes of the FA2 paper:

1. **Fewer non-matmul operations.**  The output accumulator ``O~_i`` is kept *unscaled* on chip and
   multiplied by ``diag(l_i)^-1`` once, after the last K/V tile (delayed rescaling); per tile it is only
   multiplied by ``exp(m_old - m_new)``.  The forward stores one statistic, ``L = m + log l``.
2. **Parallelism over the sequence.**  The forward grid is (Q blocks ``Tr`` × batch·heads): the loop over
   Q blocks became the grid; each thread block keeps ``Q_i`` in shared memory and streams ``K_j, V_j``.
   The backward grid is (K/V blocks ``Tc`` × batch·heads) and ``dQ`` is summed in HBM with atomics.
3. **Split-Q warp partitioning.**  Each warp owns ``Br / warps`` query rows of the block; ``K_j, V_j`` are
   read by every warp; the row max and row sum are reduced *inside* a warp with shuffles; no warp ever
   needs another warp's partial result, so the only block barriers are those around the K/V tile load.

Thread layout (both directions).  A warp's 32 lanes form a ``LR × LC = 4 × 8`` grid, ``lane = lr·LC + lc``.
In the forward, lane ``(lr, lc)`` of warp ``w`` owns the query rows ``w·(Br/warps) + lr + LR·a``
(``a < TM``), the key columns ``lc + LC·b`` of the S tile (``b < TN``) and the head-dim columns
``lc + LC·e`` of ``O`` (``e < DN``): a ``TM × TN`` register micro-tile of S and a ``TM × DN`` one of O,
so every value read from shared memory feeds ``TN``, ``TM`` or ``TM`` FMAs.  The 8 lanes of one row
group hold one row of S between them: the row max is a 3-step ``shfl_xor`` butterfly, and ``P V`` gets
each ``P_ij`` from its owner lane with ``shfl_sync`` (P never touches shared memory).

Kernels (float32, C-contiguous, ``(BH, N, d)``; ``L``/``D`` are ``(BH, N)``):

* :func:`make_forward` -- FA2 Alg. 1, grid ``(Tr, BH)``, ``32·warps`` threads.
* :func:`make_preprocess` -- FA2 Alg. 2 line 4 (``D = rowsum(dO ∘ O)``), also zeroes the dQ accumulator.
* :func:`make_backward` -- FA2 Alg. 2, grid ``(Tc, BH)``; the warps split the *key* rows of the block.

They are dense or causal (bottom-right aligned, ``diag = Nk - Nq``: query ``r`` sees keys ``<= r + diag``), plus
stage 5's one line: with ``sparse``, a tile whose block-mask entry ``M_ij`` is 0 is skipped (FA1 Alg. 5,
:mod:`flashnb.stages.block_sparse`).  Everything else a user may want -- half storage, attention modifiers,
dropout, grouped-query attention -- is the product kernel's (:mod:`flashnb.kernels.launch.flash`, ``impl="flash"``),
where each is a small policy on stage 6's loop rather than a branch of this lesson.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import cuda, float32, int32

from ..common import NEG_INF, ONE, ZERO, causal_diag, cdiv, check_shared_fit, empty, launch, load_rows, load_rows_T
from ..kernels.policies import tiles as tile_ranges
from ..masks import BlockMask
from ..registry import kernel_factory, register_impl

__all__ = ["BlockMask", "PreparedMask", "prepare_block_mask",
           "make_forward", "make_preprocess", "make_backward", "forward", "backward", "model_forward",
           "model_backward", "default_tiles", "block_tiles", "geometry", "tiles_visited", "LR", "LC", "FULL_MASK",
           "fmas_per_shared_read", "shared_bytes"]

LR = 4                 # lanes of a warp along the rows it owns
LC = 8                 # lanes of a warp along the columns (key columns of S, head-dim columns of O)
FULL_MASK = 0xFFFFFFFF  # every lane takes part in every shuffle (no divergence around them)
PRE_WARPS = 4          # preprocessing kernel: one warp per query row, 4 rows per thread block

_A3 = "float32[:, :, ::1]"
_A2 = "float32[:, ::1]"
_MASK = "uint8[:, :, ::1]"   # block mask M (BH, Tr, Tc) at the kernel's tiles; a 1x1x1 dummy when dense
_FWD_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, float32, int32, {_MASK})"
_PRE_SIG = f"void({_A3}, {_A3}, {_A2}, {_A3})"
_BWD_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, {_A3}, {_A3}, float32, int32, {_MASK})"

# Default tiles per head dim, chosen with the resource report (registers, spills, static shared memory
# <= 48 KiB on sm_80/sm_90, occupancy): `flashnb inspect --kernel fa2.forward` prints today's numbers, and
# notebook 05 compares them with FA1's.
_FWD_DEFAULTS = {32: dict(Br=64, Bc=32, warps=4), 64: dict(Br=64, Bc=32, warps=4),
                 128: dict(Br=32, Bc=32, warps=4)}
_BWD_DEFAULTS = {32: dict(Br=32, Bc=32, warps=4), 64: dict(Br=32, Bc=32, warps=4),
                 128: dict(Br=16, Bc=16, warps=4)}


def default_tiles(d: int, direction: str = "forward") -> dict:
    """The default ``Br, Bc, warps`` for head dim ``d`` (the table for the smallest listed d >= d)."""
    table = _FWD_DEFAULTS if direction == "forward" else _BWD_DEFAULTS
    for dmax in sorted(table):
        if d <= dmax:
            return dict(table[dmax])
    raise ValueError(f"head dim d must be <= {max(table)}, got {d}")


def _configs(direction):
    """What the PTX guard compiles: the default tiles of every head-dim class (causal on and off), one-warp
    tiles with an odd head dim (padded to the lanes), and the block-sparse variant (stage 5) with causal off
    and on, smallest and largest head dim -- last, the richest path (the exercises' kernels are guarded with
    the last config, tests/exercises/test_exercises.py)."""
    return ([dict(**default_tiles(d, direction), d=d, causal=c) for d, c in ((32, False), (64, True), (128, True))]
            + [dict(Br=16, Bc=16, d=20, warps=1, causal=False)]
            + [dict(**default_tiles(d, direction), d=d, causal=c, sparse=True) for d, c in ((32, False), (128, True))])


def geometry(rows: int, cols: int, d: int, warps: int) -> dict:
    """Per-thread micro-tile of a block whose warps split ``rows`` and whose lanes also split ``cols``:
    ``TM`` rows × ``TN`` columns of the score tile, ``DN`` head-dim columns (``Dp = LC·DN >= d``)."""
    if warps < 1 or rows % (warps * LR):
        raise ValueError(f"the rows split over warps ({rows}) must be a multiple of {LR}·warps = {LR * warps}")
    if cols % LC:
        raise ValueError(f"the columns split over lanes ({cols}) must be a multiple of {LC}")
    DN = cdiv(d, LC)
    return dict(TM=rows // (warps * LR), TN=cols // LC, DN=DN, Dp=DN * LC, threads=32 * warps)


@cuda.jit(device=True, inline="always")
def cdiv_dev(a, b):
    """Ceiling division on the device."""
    return (a + b - 1) // b


@cuda.jit(device=True, inline="always")
def group_max(x, width):
    """The maximum of ``x`` over each aligned group of ``width`` lanes (a power of two), in all of them: a
    ``shfl_xor`` butterfly, log2(width) steps (lane ``^ off`` stays inside the group)."""
    off = width // 2
    while off > 0:
        x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, off))
        off //= 2
    return x


@cuda.jit(device=True, inline="always")
def group_sum(x, width):
    """:func:`group_max` with a sum: ``x`` summed over each aligned group of ``width`` lanes."""
    off = width // 2
    while off > 0:
        x += cuda.shfl_xor_sync(FULL_MASK, x, off)
        off //= 2
    return x


@cuda.jit(device=True, inline="always")
def store_micro(dst, z, r0, lc, tile, factor):
    """A lane's register micro-tile to HBM: ``dst[z, r0 + LR·a, lc + LC·c] = factor · tile[a, c]`` for the rows
    and columns inside ``dst`` (the lane grid of the module docstring)."""
    for a in range(tile.shape[0]):
        if r0 + LR * a < dst.shape[1]:
            for c in range(tile.shape[1]):
                if lc + LC * c < dst.shape[2]:
                    dst[z, r0 + LR * a, lc + LC * c] = factor * tile[a, c]


# --------------------------------------------------------------------------- forward kernel


@kernel_factory("fa2.forward", stage="4", signature=_FWD_SIG, configs=_configs("forward"),
                threads=lambda warps, **_: 32 * warps)
def make_forward(Br, Bc, d, warps, causal, sparse=False):
    """FA2 Alg. 1 for one (Br, Bc, d, warps, causal); grid ``(Tr, BH)``, block ``32·warps`` threads.  ``sparse``:
    block-sparse FlashAttention (stage 5; FA1 Alg. 5 is Alg. 2 with ``if M_ij != 0``): a K/V tile whose block-mask
    entry ``M[z, i, j]`` is 0 is skipped, never loaded nor computed (dense kernels never read ``M``)."""
    # region lane-grid
    g = geometry(Br, Bc, d, warps)
    # endregion lane-grid
    TM, TN, DN, Dp, NT = g["TM"], g["TN"], g["DN"], g["Dp"], g["threads"]

    @cuda.jit(device=True, inline="always")
    def fa2_tile(QsT, KsT, Vs, S, Oi, m, l, qv, kv, p, r0, lr, lc, i0, j0, Nk, scale, diag):
        """Alg. 1 lines 8-10 for one K/V tile, on this lane's micro-tile (no other warp involved)."""
        for a in range(TM):
            for b in range(TN):
                S[a, b] = ZERO
        for k in range(d):                           # line 8: S = Q_i K_jᵀ, TM + TN reads feed TM·TN FMAs
            for a in range(TM):
                qv[a] = QsT[k, r0 + LR * a]
            for b in range(TN):
                kv[b] = KsT[k, lc + LC * b]
            for a in range(TM):
                for b in range(TN):
                    S[a, b] += qv[a] * kv[b]
        crossing = j0 + Bc > Nk or (causal and j0 + Bc - 1 > i0 + diag)  # only these are masked
        for a in range(TM):                          # line 9: m_new, P~ = exp(S - m_new), l
            mx = NEG_INF
            for b in range(TN):
                s = scale * S[a, b]
                col = j0 + lc + LC * b
                if crossing and (col >= Nk or (causal and col > i0 + r0 + LR * a + diag)):
                    s = NEG_INF
                S[a, b] = s
                mx = max(mx, s)
            mx = group_max(mx, LC)                   # row max across the LC lanes of the row group
            # region online-update
            m_new = max(m[a], mx)
            alpha = ONE
            rs = ZERO
            if m_new != NEG_INF:
                alpha = float32(math.exp(m[a] - m_new))
                for b in range(TN):
                    pb = float32(math.exp(S[a, b] - m_new))
                    S[a, b] = pb
                    rs += pb
            else:                                    # nothing seen yet: P~ = 0
                for b in range(TN):
                    S[a, b] = ZERO
            l[a] = alpha * l[a] + rs                 # per-lane partial, reduced once at the end
            m[a] = m_new
            for c in range(DN):                      # line 10: O~ = diag(e^(m_old - m_new)) O~ ...
                Oi[a, c] *= alpha
            # endregion online-update
        for b in range(TN):                          # ... + P~ V_j; P~_ij comes from its owner lane
            for src in range(LC):
                for a in range(TM):
                    p[a] = cuda.shfl_sync(FULL_MASK, S[a, b], lr * LC + src)
                j = b * LC + src
                for c in range(DN):
                    vj = Vs[j, lc + LC * c]          # one shared read feeds TM FMAs
                    for a in range(TM):
                        Oi[a, c] += p[a] * vj

    @cuda.jit
    def fa2_forward(Q, K, V, O, L, scale, diag, M):
        QsT = cuda.shared.array((d, Br), float32)    # Q_i (transposed: lanes read consecutive rows)
        KsT = cuda.shared.array((d, Bc), float32)    # K_j (transposed)
        Vs = cuda.shared.array((Bc, Dp), float32)    # V_j (head dim padded to Dp with zeros)
        S = cuda.local.array((TM, TN), float32)      # registers: S_ij micro-tile, then P~_ij
        Oi = cuda.local.array((TM, DN), float32)     # registers: unscaled O~_i micro-tile
        m = cuda.local.array(TM, float32)
        l = cuda.local.array(TM, float32)            # this lane's partial row sums
        qv = cuda.local.array(TM, float32)
        kv = cuda.local.array(TN, float32)
        p = cuda.local.array(TM, float32)
        z, i0 = cuda.blockIdx.y, cuda.blockIdx.x * Br  # head, first query row of Q_i
        tid = cuda.threadIdx.x
        lane = tid % 32
        lr, lc = lane // LC, lane % LC               # this lane's place in the warp's LR × LC grid
        r0 = (tid // 32) * (TM * LR) + lr            # this lane's rows: r0 + LR·a
        Nq, Nk = Q.shape[1], K.shape[1]
        load_rows_T(Q, z, i0, Br, QsT, tid, NT)      # Alg. 1 line 4: load Q_i once (coalesced)
        for a in range(TM):                          # line 5: O~ = 0, l = 0, m = -inf
            m[a], l[a] = NEG_INF, ZERO
            for c in range(DN):
                Oi[a, c] = ZERO
        # region tile-count
        n_tiles = cdiv_dev(Nk, Bc)
        # region causal-skip
        if causal:                                   # skip K/V blocks entirely above the diagonal
            last = min(i0 + Br, Nq) - 1 + diag       # last key any row of this block may see
            n_tiles = min(n_tiles, last // Bc + 1) if last >= 0 else 0
        # endregion causal-skip
        # endregion tile-count
        for jt in range(n_tiles):                    # line 6
            # region block-skip
            if sparse:                               # FA1 Alg. 5: if M_ij != 0 (lane 0 reads, the warp shares)
                if cuda.shfl_sync(FULL_MASK, int32(M[z, cuda.blockIdx.x, jt]) if lane == 0 else int32(0), 0) == 0:
                    continue                         # block-uniform: K_j, V_j never loaded
            # endregion block-skip
            j0 = jt * Bc
            # region kv-barrier
            cuda.syncthreads()                       # every warp is done with K_{j-1}, V_{j-1}
            # endregion kv-barrier
            # region kv-load
            load_rows_T(K, z, j0, Bc, KsT, tid, NT)  # line 7: load K_j, V_j
            load_rows(V, z, j0, Vs, tid, NT)
            cuda.syncthreads()
            # endregion kv-load
            fa2_tile(QsT, KsT, Vs, S, Oi, m, l, qv, kv, p, r0, lr, lc, i0, j0, Nk, scale, diag)
        # region epilogue
        for a in range(TM):                          # lines 12-14: O_i = diag(l)^-1 O~_i, L_i = m + log l
            ls = group_sum(l[a], LC)                 # l_i: this row's partial sums over its row group
            row = i0 + r0 + LR * a
            inv = ONE / ls if ls > ZERO else ZERO
            if row < Nq:
                for c in range(DN):
                    col = lc + LC * c
                    if col < d:
                        O[z, row, col] = Oi[a, c] * inv
                if lc == 0:
                    L[z, row] = m[a] + float32(math.log(ls)) if ls > ZERO else NEG_INF
        # endregion epilogue

    return fa2_forward


# --------------------------------------------------------------------------- backward kernels


@kernel_factory("fa2.preprocess", stage="4", signature=_PRE_SIG, threads=32 * PRE_WARPS)
def make_preprocess():
    """FA2 Alg. 2 line 4: ``D_i = rowsum(dO_i ∘ O_i)``, one warp per row (lanes over d, shuffle-reduced); also
    zeroes the dQ accumulator that the main kernel adds into.  Grid ``(ceil(Nq / 4), BH)``."""

    @cuda.jit
    def fa2_bwd_preprocess(O, dO, D, dQ):
        z = cuda.blockIdx.y
        lane = cuda.threadIdx.x % 32
        i = cuda.blockIdx.x * PRE_WARPS + cuda.threadIdx.x // 32
        acc = ZERO
        if i < O.shape[1]:                          # warp-uniform branch
            # region rowsum
            for e in range(lane, O.shape[2], 32):
                acc += dO[z, i, e] * O[z, i, e]
                dQ[z, i, e] = ZERO
            # endregion rowsum
        # region warp-sum
        off = 16
        while off > 0:
            acc += cuda.shfl_down_sync(FULL_MASK, acc, off)
            off //= 2
        # endregion warp-sum
        if lane == 0 and i < O.shape[1]:
            D[z, i] = acc

    return fa2_bwd_preprocess


@kernel_factory("fa2.backward", stage="4", signature=_BWD_SIG, configs=_configs("backward"),
                threads=lambda warps, **_: 32 * warps)
def make_backward(Br, Bc, d, warps, causal, sparse=False):
    """FA2 Alg. 2 for one configuration; grid ``(Tc, BH)``.  The warps split the Bc *key* rows (a lane owns
    ``TM`` key rows × ``TN`` query columns of Sᵀ and ``TM × DN`` of dK_j, dV_j); dS goes through shared memory
    once per tile, so that all threads form dQ_i = dS K_j and add it into HBM.  ``sparse``: Q tiles whose
    block-mask entry ``M[z, i, j]`` is 0 are skipped (FA1 Alg. 5's backward)."""
    g = geometry(Bc, Br, d, warps)
    TM, TN, DN, Dp, NT = g["TM"], g["TN"], g["DN"], g["Dp"], g["threads"]
    BrP, BcP = Br + 1, Bc + 1   # padded leading dimensions of the transposed shared tiles

    @cuda.jit(device=True, inline="always")
    def fa2_bwd_tile(QsT, KsT, VsT, dOsT, Ls, Ds, dSs, S, dP, dKj, dVj, kv, vv, qv, ov, c0, lr, lc, i0, j0, Nk,
                     scale, diag):
        """Alg. 2 lines 10-16 for one Q tile on this lane's micro-tile of the transposed scores."""
        for a in range(TM):
            for b in range(TN):
                S[a, b] = dP[a, b] = ZERO
        for k in range(d):                           # line 10: Sᵀ = K_j Q_iᵀ; line 13: dPᵀ = V_j dO_iᵀ
            for a in range(TM):
                kv[a] = KsT[k, c0 + LR * a]
                vv[a] = VsT[k, c0 + LR * a]
            for b in range(TN):
                qv[b] = QsT[k, lc + LC * b]
                ov[b] = dOsT[k, lc + LC * b]
            for a in range(TM):
                for b in range(TN):
                    S[a, b] += kv[a] * qv[b]
                    dP[a, b] += vv[a] * ov[b]
        for b in range(TN):                          # line 11: P = exp(scale·S - L); line 14: dS = P ∘ (dP - D)
            r = lc + LC * b
            Lr = Ls[r]
            Dr = Ds[r]
            for a in range(TM):
                key = j0 + c0 + LR * a
                # region recompute-p
                pv = ZERO
                if Lr != NEG_INF and key < Nk and not (causal and key > i0 + r + diag):
                    pv = float32(math.exp(scale * S[a, b] - Lr))
                S[a, b] = pv
                # endregion recompute-p
                # region ds
                dP[a, b] = pv * (dP[a, b] - Dr)
                # endregion ds
        for b in range(TN):                          # line 12: dV_j += Pᵀ dO_i; line 16: dK_j += dSᵀ Q_i
            for src in range(LC):
                r = b * LC + src
                for a in range(TM):
                    kv[a] = cuda.shfl_sync(FULL_MASK, S[a, b], lr * LC + src)
                    vv[a] = cuda.shfl_sync(FULL_MASK, dP[a, b], lr * LC + src)
                for c in range(DN):
                    o = dOsT[lc + LC * c, r]
                    q = QsT[lc + LC * c, r]
                    for a in range(TM):
                        dVj[a, c] += kv[a] * o
                        dKj[a, c] += vv[a] * q
        for a in range(TM):                          # dSᵀ to shared for line 15
            for b in range(TN):
                dSs[c0 + LR * a, lc + LC * b] = dP[a, b]

    @cuda.jit
    def fa2_backward(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag, M):
        # Transposed tiles get a padding column (never read): lanes walking down a column hit 32 banks, not one.
        KsT = cuda.shared.array((d, BcP), float32)   # K_j, V_j: loaded once
        VsT = cuda.shared.array((d, BcP), float32)
        QsT = cuda.shared.array((Dp, BrP), float32)  # Q_i, dO_i: one tile per inner step
        dOsT = cuda.shared.array((Dp, BrP), float32)
        Ls = cuda.shared.array(Br, float32)
        Ds = cuda.shared.array(Br, float32)
        dSs = cuda.shared.array((Bc, BrP), float32)  # dS_ijᵀ, for dQ_i (the one inter-warp exchange)
        S = cuda.local.array((TM, TN), float32)      # Sᵀ, then Pᵀ
        dP = cuda.local.array((TM, TN), float32)     # dPᵀ, then dSᵀ
        dKj = cuda.local.array((TM, DN), float32)
        dVj = cuda.local.array((TM, DN), float32)
        kv = cuda.local.array(TM, float32)
        vv = cuda.local.array(TM, float32)
        qv = cuda.local.array(TN, float32)
        ov = cuda.local.array(TN, float32)
        z, j0 = cuda.blockIdx.y, cuda.blockIdx.x * Bc  # head, first key row of K_j
        tid = cuda.threadIdx.x
        lane = tid % 32
        lr, lc = lane // LC, lane % LC               # this lane's place in the warp's LR × LC grid
        c0 = (tid // 32) * (TM * LR) + lr            # this lane's key rows: c0 + LR·a
        Nq, Nk = Q.shape[1], K.shape[1]
        load_rows_T(K, z, j0, Bc, KsT, tid, NT)      # Alg. 2 line 6: load K_j, V_j
        load_rows_T(V, z, j0, Bc, VsT, tid, NT)
        for a in range(TM):                          # line 7: dK_j = dV_j = 0 (on chip)
            for c in range(DN):
                dKj[a, c] = dVj[a, c] = ZERO
        # causal: skip the Q blocks whose rows all precede key j0 (row j0 - diag is the first that may see it)
        i_first = max(j0 - diag, 0) // Br if causal else 0
        for it in range(i_first, cdiv_dev(Nq, Br)):  # line 8
            # region block-skip
            if sparse:                               # FA1 Alg. 5: if M_ij != 0 (lane 0 reads, the warp shares)
                if cuda.shfl_sync(FULL_MASK, int32(M[z, it, cuda.blockIdx.x]) if lane == 0 else int32(0), 0) == 0:
                    continue                         # block-uniform: Q_i, dO_i, L_i, D_i never loaded
            # endregion block-skip
            i0 = it * Br
            cuda.syncthreads()
            load_rows_T(Q, z, i0, Br, QsT, tid, NT)  # line 9: load Q_i, dO_i, L_i, D_i
            load_rows_T(dO, z, i0, Br, dOsT, tid, NT)
            for r in range(tid, Br, NT):
                Ls[r] = L[z, i0 + r] if i0 + r < Nq else NEG_INF
                Ds[r] = D[z, i0 + r] if i0 + r < Nq else ZERO
            cuda.syncthreads()
            fa2_bwd_tile(QsT, KsT, VsT, dOsT, Ls, Ds, dSs, S, dP, dKj, dVj, kv, vv, qv, ov, c0, lr, lc, i0, j0, Nk,
                         scale, diag)
            cuda.syncthreads()                       # dSs complete (written by every warp)
            for e in range(tid, Br * d, NT):         # line 15: dQ_i += scale · dS K_j (atomic, HBM)
                r, k = e // d, e % d
                # region dq-update
                acc = ZERO
                for c in range(Bc):
                    acc += dSs[c, r] * KsT[k, c]
                if i0 + r < Nq:
                    cuda.atomic.add(dQ, (z, i0 + r, k), scale * acc)
                # endregion dq-update
        store_micro(dK, z, j0 + c0, lc, dKj, scale)  # line 18: write dK_j, dV_j once
        store_micro(dV, z, j0 + c0, lc, dVj, ONE)

    return fa2_backward


# --------------------------------------------------------------------------- block masks (stage 5) and launchers


def _tiles(d, direction, Br, Bc, warps):
    """The tiles a launch uses: defaults for ``d`` overridden by the options, checked against the layout."""
    t = default_tiles(d, direction)
    for name, value in (("Br", Br), ("Bc", Bc), ("warps", warps)):
        if value is not None:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be a positive int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            t[name] = int(value)
    # forward: warps split the Br query rows, lanes the Bc keys; backward: warps split the Bc keys
    split, lanes = ("Br", "Bc") if direction == "forward" else ("Bc", "Br")
    if t[split] % (LR * t["warps"]):
        raise ValueError(f"fa2 {direction}: {split}={t[split]} must be a multiple of {LR}·warps = "
                         f"{LR * t['warps']} (each warp owns {split}/warps rows, {LR} lanes along them)")
    if t[lanes] % LC:
        raise ValueError(f"fa2 {direction}: {lanes}={t[lanes]} must be a multiple of {LC} (the lanes of a row group)")
    check_shared_fit(f"fa2 {direction}", f"Br={t['Br']}, Bc={t['Bc']} at d={d}, warps={t['warps']}",
                     shared_bytes(t["Br"], t["Bc"], d, t["warps"], direction), "choose smaller Br/Bc")
    return t


def block_tiles(d, direction, Br, Bc, warps, block_mask, BH, Nq, Nk):
    """``(tiles, M)``: the tiles a launch uses and its block mask at those tiles (``None`` when dense).

    How a block mask maps onto tiles (both directions): the mask was built for tiles ``(mBr, mBc)`` -- a
    :class:`BlockMask` carries them; a plain boolean array is read at the tiles of the
    *forward* launch (the ``Br``/``Bc`` options, else ``default_tiles(d)``), so one array serves forward and
    backward alike.  The kernel's tiles ``(Br, Bc)`` are the options when given, else this direction's default
    tiles when they divide ``(mBr, mBc)``, else the mask's own.  They must divide the mask's tiles: every
    kernel tile then lies inside one mask block, and ``M`` at the kernel's tiles is the mask with each entry
    repeated ``(mBr/Br) × (mBc/Bc)`` times (so the backward's smaller default tiles skip exactly the same
    elements as the forward's).  ``M`` is uint8 ``(BH, ceil(Nq/Br), ceil(Nk/Bc))``, 0 or 1: a block mask made
    from a ``mask_mod`` (partial blocks, :func:`flashnb.flex.create_block_mask`) is the product kernel's
    (``impl="flash"``)."""
    if block_mask is None:
        return _tiles(d, direction, Br, Bc, warps), None
    fwd = default_tiles(d, "forward")
    if isinstance(block_mask, BlockMask):
        bm = block_mask
    else:
        bm = BlockMask(block_mask, Br=fwd["Br"] if Br is None else Br, Bc=fwd["Bc"] if Bc is None else Bc)
    if bm.mask_mod is not None:
        raise ValueError("block_mask was made from a mask_mod (it has partial blocks, where mask_mod applies per "
                         "element): stage 5's kernel skips empty blocks only; use impl='flash' (the product kernel) "
                         "for attention modifiers")
    bm.check(Nq, Nk, BH=BH)
    dflt = default_tiles(d, direction)
    br = Br if Br is not None else (dflt["Br"] if bm.Br % dflt["Br"] == 0 else bm.Br)
    bc = Bc if Bc is not None else (dflt["Bc"] if bm.Bc % dflt["Bc"] == 0 else bm.Bc)
    if warps is None:                                # fewer warps when the mask's tiles are small
        split = br if direction == "forward" else bc
        warps = max([w for w in range(1, dflt["warps"] + 1) if split % (LR * w) == 0] or [1])
    t = _tiles(d, direction, br, bc, warps)
    if bm.Br % t["Br"] or bm.Bc % t["Bc"]:
        raise ValueError(f"block_mask was built for tiles Br={bm.Br}, Bc={bm.Bc} (shape (..., "
                         f"{cdiv(Nq, bm.Br)}, {cdiv(Nk, bm.Bc)}) for Nq={Nq}, Nk={Nk}); the fa2 {direction} tiles "
                         f"Br={t['Br']}, Bc={t['Bc']} must divide them: build the mask for these tiles or pass "
                         f"Br, Bc that divide {bm.Br}, {bm.Bc}")
    return t, bm.at_tiles(t["Br"], t["Bc"], Nq, Nk, BH)


def _mask_device(M):
    """M on the device; the dense kernels get a 1x1x1 placeholder they never read."""
    if M is None:
        return cuda.device_array((1, 1, 1), dtype=np.uint8)
    return cuda.to_device(np.ascontiguousarray(M, dtype=np.uint8))


@dataclass(frozen=True)
class PreparedMask:
    """A block mask already mapped onto one launch's tiles and copied to the device (see
    :func:`prepare_block_mask`): pass it as ``block_mask=`` to reuse it without host work per call."""

    direction: str
    tiles: dict = field(hash=False)
    M: object = field(hash=False, repr=False)
    shape: tuple = ()   # (BH, Nq, Nk, d) it was prepared for


def prepare_block_mask(block_mask, *, direction, BH, Nq, Nk, d, Br=None, Bc=None, warps=None) -> PreparedMask:
    """:func:`block_tiles` plus the copy of ``M`` to the device, done once (e.g. outside a timed loop)."""
    t, M = block_tiles(d, direction, Br, Bc, warps, block_mask, BH, Nq, Nk)
    if M is None:
        raise ValueError("block_mask is required")
    return PreparedMask(direction, t, _mask_device(M), (BH, Nq, Nk, d))


def _tiles_and_mask(direction, Br, Bc, warps, block_mask, BH, Nq, Nk, d):
    """``(tiles, device M or None)`` for a launch, from nothing, a mask, or a :class:`PreparedMask`."""
    if isinstance(block_mask, PreparedMask):
        if block_mask.direction != direction or block_mask.shape != (BH, Nq, Nk, d):
            raise ValueError(f"block_mask was prepared for the {block_mask.direction} of (BH, Nq, Nk, d) = "
                             f"{block_mask.shape}, not the {direction} of {(BH, Nq, Nk, d)}")
        return block_mask.tiles, block_mask.M
    t, M = block_tiles(d, direction, Br, Bc, warps, block_mask, BH, Nq, Nk)
    return t, (None if M is None else _mask_device(M))


def _check_arrays(**arrays):
    """float32 device arrays, K and V with Q's batch·heads (TypeError / ValueError naming the argument)."""
    for name, a in arrays.items():
        if np.dtype(a.dtype) != np.float32:
            raise TypeError(f"fa2 (stage 4) takes {name} as float32 device arrays, got dtype {a.dtype}: half storage "
                            "is the product kernel's (impl='flash')")
    q = arrays["q"]
    for name in ("k", "v"):
        if arrays[name].shape[0] != q.shape[0]:
            raise ValueError(f"fa2 (stage 4): {name} must have q's batch·heads ({q.shape[0]}), got "
                             f"{arrays[name].shape[0]}: grouped-query attention is the product kernel's (impl='flash')")


def forward(q, k, v, *, causal=False, scale, Br=None, Bc=None, warps=None, block_mask=None):
    """Device arrays in, ``(O, L)`` out (FA2 Alg. 1); ``Br, Bc, warps`` default to :func:`default_tiles`.

    ``block_mask`` (a :class:`BlockMask` or a boolean array ``(..., ceil(Nq/Br), ceil(Nk/Bc))``): block-sparse
    FlashAttention (stage 5), tiles with ``M = 0`` are never loaded; see :func:`block_tiles` for how the mask maps
    onto the kernel's tiles."""
    _check_arrays(q=q, k=k, v=v)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    t, M = _tiles_and_mask("forward", Br, Bc, warps, block_mask, BH, Nq, Nk, d)
    O = empty((BH, Nq, d))
    L = empty((BH, Nq))
    kernel = make_forward(t["Br"], t["Bc"], d, t["warps"], bool(causal), M is not None)
    launch(kernel, (cdiv(Nq, t["Br"]), BH), 32 * t["warps"], q, k, v, O, L, scale, causal_diag(causal, Nq, Nk),
           _mask_device(None) if M is None else M, label="FA2 forward")
    return O, L


def backward(q, k, v, o, lse, do, *, causal=False, scale, Br=None, Bc=None, warps=None, block_mask=None):
    """FA2 Alg. 2: the D preprocessing launch, then one thread block per K/V column block.  ``block_mask``
    as in :func:`forward` (Q tiles with ``M = 0`` are skipped)."""
    _check_arrays(q=q, k=k, v=v, o=o, do=do)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    t, M = _tiles_and_mask("backward", Br, Bc, warps, block_mask, BH, Nq, Nk, d)
    D = empty((BH, Nq))
    dQ = empty((BH, Nq, d))                          # the atomics' accumulator, zeroed by the preprocessing
    launch(make_preprocess(), (cdiv(Nq, PRE_WARPS), BH), 32 * PRE_WARPS, o, do, D, dQ, label="D = rowsum(dO∘O)")
    dK = empty((BH, Nk, d))
    dV = empty((BH, Nk, d))
    kernel = make_backward(t["Br"], t["Bc"], d, t["warps"], bool(causal), M is not None)
    launch(kernel, (cdiv(Nk, t["Bc"]), BH), 32 * t["warps"], q, k, v, do, lse, D, dQ, dK, dV, scale,
           causal_diag(causal, Nq, Nk), _mask_device(None) if M is None else M, label="FA2 backward")
    return dQ, dK, dV


register_impl("fa2", stage="4",
              description="FlashAttention-2: Q-block grid, split-Q warps, delayed rescaling; dQ by atomics",
              forward=forward, backward=backward, options=("Br", "Bc", "warps", "block_mask"))


# --------------------------------------------------------------------------- analytic model


def tiles_visited(Nq, Nk, Br, Bc, causal, direction="forward", block_mask=None):
    """``[(outer, inner, rows, cols), ...]`` -- the (Q tile, K/V tile) pairs a launch computes, with their
    valid row/column counts.  Forward: outer = Q block i, inner = K/V block j; backward the reverse.
    ``block_mask``: a boolean ``(ceil(Nq/Br), ceil(Nk/Bc))`` array at these tiles; pairs with 0 are left out."""
    return tile_ranges.tiles_visited(Nq, Nk, Br, Bc, causal, direction, block_mask)   # the kernels' own ranges



def shared_bytes(Br, Bc, d, warps, direction="forward"):
    """Static shared memory of one thread block, in bytes."""
    if direction == "forward":
        g = geometry(Br, Bc, d, warps)
        return 4 * (d * Br + d * Bc + Bc * g["Dp"])
    g = geometry(Bc, Br, d, warps)
    return 4 * (2 * d * (Bc + 1) + 2 * g["Dp"] * (Br + 1) + 2 * Br + Bc * (Br + 1))



def fmas_per_shared_read(Br, Bc, d, warps):
    """Inner-loop FMAs per shared-memory element read of the forward (per thread, from the kernel):
    ``S``: TM·TN FMAs per TM + TN reads; ``P V``: TM FMAs per read of V_j (P arrives by shuffle)."""
    g = geometry(Br, Bc, d, warps)
    TM, TN, DN = g["TM"], g["TN"], g["DN"]
    fmas = d * TM * TN + Bc * DN * TM
    reads = d * (TM + TN) + Bc * DN
    return dict(qk=TM * TN / (TM + TN), pv=float(TM), tile=fmas / reads, fmas=fmas, reads=reads)



def _launch(name, reads, writes, atomics=None, shared_reads=0, shared_writes=0):
    return dict(launch=name, reads={a: n for a, n in reads.items() if n},
                writes={a: n for a, n in writes.items() if n},
                atomics={a: n for a, n in (atomics or {}).items() if n},
                shared_reads=int(shared_reads), shared_writes=int(shared_writes))



def _visited_per_head(Nq, Nk, t, causal, direction, M, BH):
    """The visited tiles of each of the BH heads (one list for all when dense), and the tiles whose mask
    entry each thread reads (the causal-limited set: lane 0 of every warp reads ``M`` once per tile)."""
    checked = tiles_visited(Nq, Nk, t["Br"], t["Bc"], causal, direction)
    if M is None:
        return [checked] * BH, 0
    memo = {}                                        # heads sharing one mask share one list
    for z in range(BH):
        key = M[z].tobytes()
        if key not in memo:
            memo[key] = tiles_visited(Nq, Nk, t["Br"], t["Bc"], causal, direction, M[z].astype(bool))
    return [memo[M[z].tobytes()] for z in range(BH)], len(checked)



def model_forward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None, block_mask=None):
    """Element accesses of :func:`forward` (one launch): Q, O, L once; K_j, V_j once per visited tile.

    Shared: Q_i written once per block (``Br·d``), K_j and V_j per tile (``Bc·d + Bc·Dp``); per tile each of
    the ``32·warps`` threads reads ``d·(TM + TN)`` (S) and ``Bc·DN`` (V) elements.
    Block-sparse (``block_mask``): visited tiles = those with ``M_ij = 1``, and lane 0 of each warp reads
    ``M_ij`` (one byte, shuffled to the other lanes) once per tile the causal limit lets it reach."""
    t, M = block_tiles(d, "forward", Br, Bc, warps, block_mask, BH, Nq, Nk)
    g = geometry(t["Br"], t["Bc"], d, t["warps"])
    per_head, checked = _visited_per_head(Nq, Nk, t, causal, "forward", M, BH)
    kv = sum(cols for visited in per_head for _, _, _, cols in visited) * d
    n = sum(len(visited) for visited in per_head)
    per_tile_reads = g["threads"] * (d * (g["TM"] + g["TN"]) + t["Bc"] * g["DN"])
    return [_launch("FA2 forward", {"Q": BH * Nq * d, "K": kv, "V": kv, "M": BH * checked * t["warps"]},
                    {"O": BH * Nq * d, "L": BH * Nq},
                    shared_reads=n * per_tile_reads,
                    shared_writes=BH * cdiv(Nq, t["Br"]) * t["Br"] * d + n * t["Bc"] * (d + g["Dp"]))]


def model_backward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None, block_mask=None):
    """Element accesses of :func:`backward`: the preprocessing launch (O, dO read, D and dQ = 0 written),
    then the main launch -- K_j, V_j once per column block; Q_i, dO_i, L_i, D_i once per visited tile;
    ``rows·d`` atomic adds into dQ per visited tile; dK, dV written once.  Block-sparse: as in
    :func:`model_forward` (visited = ``M_ij = 1``, plus one one-byte read of ``M`` per warp per tile)."""
    t, M = block_tiles(d, "backward", Br, Bc, warps, block_mask, BH, Nq, Nk)
    Br_, Bc_ = t["Br"], t["Bc"]
    g = geometry(Bc_, Br_, d, t["warps"])
    per_head, checked = _visited_per_head(Nq, Nk, t, causal, "backward", M, BH)
    q_rows = sum(rows for visited in per_head for _, _, rows, _ in visited)
    n = sum(len(visited) for visited in per_head)
    pre = _launch("D = rowsum(dO∘O)", {"O": BH * Nq * d, "dO": BH * Nq * d}, {"D": BH * Nq, "dQ": BH * Nq * d})
    per_tile_reads = (g["threads"] * (2 * d * (g["TM"] + g["TN"]) + 2 * g["TN"] + 2 * Br_ * g["DN"])
                      + 2 * Br_ * d * Bc_)
    per_tile_writes = 2 * g["Dp"] * Br_ + 2 * Br_ + Bc_ * Br_
    main = _launch("FA2 backward",
                   {"Q": q_rows * d, "K": BH * Nk * d, "V": BH * Nk * d, "dO": q_rows * d,
                    "L": q_rows, "D": q_rows, "M": BH * checked * t["warps"]},
                   {"dK": BH * Nk * d, "dV": BH * Nk * d}, {"dQ": q_rows * d},
                   shared_reads=n * per_tile_reads,
                   shared_writes=BH * cdiv(Nk, Bc_) * 2 * d * Bc_ + n * per_tile_writes)
    return [pre, main]


# --------------------------------------------------------------------------- the SASS time model's inputs


def sass_config(d, causal, Br=None, Bc=None, warps=None) -> dict:
    """The forward kernel's configuration at head dim ``d`` (default tiles unless given)."""
    t = _tiles(d, "forward", Br, Bc, warps)
    return dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal))



def sass_shape(config):
    """The fields of a :class:`flashnb.instruments.sass_model.KernelShape` for the forward kernel, per thread: FFMAs of
    line 8 (``TM·TN·d``) and of line 10 (``TM·DN·Bc``) per K/V tile; iterations of the K_j and V_j copy loops
    (``Bc·d`` and ``Bc·Dp`` elements over the block's threads), of the Q_i copy; the O_i stores."""
    g = geometry(config["Br"], config["Bc"], config["d"], config["warps"])
    NT, d, Bc, Br = g["threads"], config["d"], config["Bc"], config["Br"]
    return dict(phases=(g["TM"] * g["TN"] * d, g["TM"] * g["DN"] * Bc),
                tile_loads=cdiv(Bc * d, NT) + cdiv(Bc * g["Dp"], NT), prologue_loads=cdiv(Br * d, NT),
                epilogue_stores=g["TM"] * (g["DN"] + 1))



def launch_order(Tr, causal):
    """The Q block each ``blockIdx.x`` computes, in launch order: stage 4 runs block ``i`` as ``blockIdx.x = i``
    -- with a causal mask, the lightest blocks (fewest K/V tiles) first."""
    return list(range(Tr))

