"""Stage 7 -- FlashAttention-2's backward on tensor cores (FA2 Alg. 2).

**The tiles** (:func:`make_backward`): a warp owns 16 keys of ``K_j`` and keeps their
``dK_j, dV_j`` in registers -- at d = 128 half of a lane's 255 -- so a Q tile is ``Br = 16`` queries there, and
what is left to choose is ``Bc = 16·warps``: every K/V block reads all of ``Q``, ``dO`` and adds into all of
``dQ`` once, so ``Bc`` sets how often they cross HBM.  At d = 128 the default is ``Bc = 128`` over eight warps (as
FA2's own d = 128 backward): 77,824 B of tiles, more than the 48 KiB a block may declare statically, so they are
*dynamic* shared memory, granted after the driver opt-in (``common.allow_dynamic_shared``, as stage 6's d = 128
forward).  A device that refuses it runs static tiles (``Bc = 32``, two warps; bfloat16 ``Bc = 64``, four) with a
``RuntimeWarning``; :data:`flashnb.kernels.launch.tensorcore.last_backward` says what ran.

Kernel ``"fa2_tc.backward"`` (:func:`make_backward`); the fragments, layouts and MMAs are the forward's
(:mod:`flashnb.kernels.tensorcore.fragments`).
"""

from __future__ import annotations

from numba import cuda, float32, uint32

from ...common import ZERO, storage_array_type
from ...registry import kernel_factory
from .. import policies
from ..policies import EMPTY, FULL, PARTIAL
from ..policies.tiles import q_tile_range
from . import mma
from .forward import _A2, _M
from .fragments import _SHARED_TYPE, _SIGN, LOG2E, POS_INF, _layout, _make_bwd_loaders, _make_policies
from .geometry import ARCHS, _bwd_configs, _bwd_dynamic_bytes, bwd_geometry
from .mma import SHARED_ALIGN

__all__ = ["make_backward"]


def _bwd_sig(storage="float16", **_):
    h = storage_array_type(storage)
    a3 = "float32[:, :, ::1]"
    return f"void({h}, {h}, {h}, {h}, {_A2}, {_A2}, {a3}, {h}, {h}, float32, int32, {_M}, {policies.DROPOUT_SIG})"


def _make_load_q(storage, g, P, Br, PIPE):
    """``load_q``: lines 7-8, Q_i and dO_i into shared memory (or, pipelined, the wait for the copies issued during
    the previous tile), L_i·log2 e and D_i beside them."""
    QO, DOO = g["offsets"]["Q"], g["offsets"]["dO"]
    ASYNC = g["copy"] == "async"
    load_tile = P["load_tile"]

    @cuda.jit(device=True, inline="always")
    def load_q(Q, dO, L, D, sm, LDs, z, i0, tid, Nq):
        if PIPE:
            mma.cp_async_wait_group(0)         # Q_i, dO_i (issued during the previous tile's dQ)
        else:                                  # plain copies, or (block mask) cp.async of tile i alone
            load_tile(Q[z], sm, QO, i0, Nq, Br, tid)
            load_tile(dO[z], sm, DOO, i0, Nq, Br, tid)
            if ASYNC:
                mma.cp_async_commit()
                mma.cp_async_wait_group(0)
            if tid < Br:
                LDs[tid] = L[z, i0 + tid] * LOG2E if i0 + tid < Nq else POS_INF
                LDs[Br + tid] = D[z, i0 + tid] if i0 + tid < Nq else ZERO
        cuda.syncthreads()                     # Q_i, dO_i, L_i, D_i visible

    return load_q


def _make_s_dp(storage, g, P):
    """``s_dp``: lines 10 and 13, ``Sᵀ = K_j Q_iᵀ`` and ``dPᵀ = V_j dO_iᵀ`` for this warp's 16 keys (K_j's and V_j's
    A fragments kept in registers, or reloaded per tile)."""
    NQ, KD = g["NQ"], g["KD"]
    KO, VO, QO, DOO = g["offsets"]["K"], g["offsets"]["V"], g["offsets"]["Q"], g["offsets"]["dO"]
    KV_REGS, KR = g["kv_regs"], g["k_regs"]
    at, mma_k = P["at"], P["mma_k"]

    @cuda.jit(device=True, inline="always")
    def s_dp(sm, ka, va, s, dp, flip, lane, w16):
        if not KV_REGS:                        # V_j's A fragments (and K_j's beyond the first KR), reloaded
            for kk in range(KD):
                kr = kk if kk < KR else KR     # (a compile-time index: the registers of ka)
                if kk >= KR:
                    a0, a1, a2, a3 = mma.ldmatrix_x4(sm, KO + at(w16 + 8 * ((lane // 8) % 2), lane,
                                                                 2 * kk + lane // 16))
                    ka[KR, 0], ka[KR, 1], ka[KR, 2], ka[KR, 3] = a0 ^ flip, a1 ^ flip, a2 ^ flip, a3 ^ flip
                b0, b1, b2, b3 = mma.ldmatrix_x4(sm, VO + at(w16 + 8 * ((lane // 8) % 2), lane, 2 * kk + lane // 16))
                va[0, 0], va[0, 1], va[0, 2], va[0, 3] = b0, b1, b2, b3
                for nq in range(0, NQ, 2):     # line 10 (Sᵀ = K_j Q_iᵀ) and 13 (dPᵀ = V_j dO_iᵀ), this k-step
                    q0, q1, q2, q3 = mma.ldmatrix_x4(sm, QO + at(nq * 8 + 8 * (lane // 16), lane,
                                                                 2 * kk + (lane // 8) % 2))
                    o0, o1, o2, o3 = mma.ldmatrix_x4(sm, DOO + at(nq * 8 + 8 * (lane // 16), lane,
                                                                  2 * kk + (lane // 8) % 2))
                    if kk == 0:
                        for c in range(4):
                            s[nq, c] = ZERO
                            s[nq + 1, c] = ZERO
                            dp[nq, c] = ZERO
                            dp[nq + 1, c] = ZERO
                    s[nq, 0], s[nq, 1], s[nq, 2], s[nq, 3] = mma_k(ka[kr, 0], ka[kr, 1], ka[kr, 2], ka[kr, 3], q0,
                                                                   q1, s[nq, 0], s[nq, 1], s[nq, 2], s[nq, 3])
                    s[nq + 1, 0], s[nq + 1, 1], s[nq + 1, 2], s[nq + 1, 3] = mma_k(
                        ka[kr, 0], ka[kr, 1], ka[kr, 2], ka[kr, 3], q2, q3, s[nq + 1, 0], s[nq + 1, 1], s[nq + 1, 2],
                        s[nq + 1, 3])
                    dp[nq, 0], dp[nq, 1], dp[nq, 2], dp[nq, 3] = mma_k(va[0, 0], va[0, 1], va[0, 2], va[0, 3], o0,
                                                                       o1, dp[nq, 0], dp[nq, 1], dp[nq, 2], dp[nq, 3])
                    dp[nq + 1, 0], dp[nq + 1, 1], dp[nq + 1, 2], dp[nq + 1, 3] = mma_k(
                        va[0, 0], va[0, 1], va[0, 2], va[0, 3], o2, o3, dp[nq + 1, 0], dp[nq + 1, 1], dp[nq + 1, 2],
                        dp[nq + 1, 3])
        else:
            for nq in range(NQ):
                for c in range(4):
                    s[nq, c] = ZERO
                    dp[nq, c] = ZERO
            for kk in range(KD):
                for nq in range(0, NQ, 2):     # lines 10 and 13
                    q0, q1, q2, q3 = mma.ldmatrix_x4(sm, QO + at(nq * 8 + 8 * (lane // 16), lane,
                                                                 2 * kk + (lane // 8) % 2))
                    o0, o1, o2, o3 = mma.ldmatrix_x4(sm, DOO + at(nq * 8 + 8 * (lane // 16), lane,
                                                                  2 * kk + (lane // 8) % 2))
                    s[nq, 0], s[nq, 1], s[nq, 2], s[nq, 3] = mma_k(ka[kk, 0], ka[kk, 1], ka[kk, 2], ka[kk, 3], q0,
                                                                   q1, s[nq, 0], s[nq, 1], s[nq, 2], s[nq, 3])
                    s[nq + 1, 0], s[nq + 1, 1], s[nq + 1, 2], s[nq + 1, 3] = mma_k(
                        ka[kk, 0], ka[kk, 1], ka[kk, 2], ka[kk, 3], q2, q3, s[nq + 1, 0], s[nq + 1, 1], s[nq + 1, 2],
                        s[nq + 1, 3])
                    dp[nq, 0], dp[nq, 1], dp[nq, 2], dp[nq, 3] = mma_k(va[kk, 0], va[kk, 1], va[kk, 2], va[kk, 3],
                                                                       o0, o1, dp[nq, 0], dp[nq, 1], dp[nq, 2],
                                                                       dp[nq, 3])
                    dp[nq + 1, 0], dp[nq + 1, 1], dp[nq + 1, 2], dp[nq + 1, 3] = mma_k(
                        va[kk, 0], va[kk, 1], va[kk, 2], va[kk, 3], o2, o3, dp[nq + 1, 0], dp[nq + 1, 1],
                        dp[nq + 1, 2], dp[nq + 1, 3])

    return s_dp


def _make_p_ds(storage, g, P, Br, causal, dropout, features):
    """``p_ds``: lines 11 and 14, ``P = exp(scale·S - L)`` and ``dS = P ∘ (dP - D)`` in registers (masks,
    ``score_mod`` and its derivative, dropout: the product kernel's policies), dSᵀ to shared memory for line 15."""
    NQ, E, DSO, ONE_LOOP = g["NQ"], g["E"], g["offsets"]["dS"], g["one_loop"]
    score, allowed_bits, grad, is_set, keep_bits, factor, SCORED, MASK_MOD = features
    from_f32, to_shared = P["from_f32"], P["to_shared"]
    _, ds_at_chunk, _ = _layout(g["LDS"], E)

    @cuda.jit(device=True, inline="always")
    def p_ds(masked, sm, LDs, s, dp, z, i0, j0, w16, g8, t4, diag, sl2, scale, dst, Nq, Nk, st):
        first = j0 + w16 + g8 - i0 - diag - 2 * t4     # masked: key > query + diag, as offsets of this lane's
        keep0 = keep_bits(dst, z, i0 + 2 * t4, 8, j0 + w16 + g8, 8, NQ, 2, Nq, Nk)   # dropout's Z of this lane's
        keep1 = keep_bits(dst, z, i0 + 2 * t4 + 1, 8, j0 + w16 + g8, 8, NQ, 2, Nq, Nk)   # even, odd queries
        allow0 = allowed_bits(z, i0 + 2 * t4, 8, j0 + w16 + g8, 8, NQ, 2, Nq, Nk, st)       # mask_mod, the same
        allow1 = allowed_bits(z, i0 + 2 * t4 + 1, 8, j0 + w16 + g8, 8, NQ, 2, Nq, Nk, st)   # elements (PARTIAL)
        for nq in range(NQ):                   # line 11: P = exp(scale·S - L); line 14: dS = P ∘ (dP - D)
            if ONE_LOOP:                       # d > 64: L_i, D_i of this lane's two queries, read once (keys g and
                c2 = nq * 8 + 2 * t4           # g + 8 share them)
                la0, la1, da0, da1 = LDs[c2], LDs[c2 + 1], LDs[Br + c2], LDs[Br + c2 + 1]
            for e in range(4):
                col = nq * 8 + 2 * t4 + e % 2
                qi = i0 + col                  # this element's query and key
                kj = j0 + w16 + g8 + 8 * (e // 2)
                raw = s[nq, e] * abs(scale)    # the scaled score (a negative scale: K was negated)
                sc = s[nq, e] * sl2            # base 2
                if SCORED:                     # score_mod of the scaled score, then base 2
                    sc = score(raw, z, qi, kj, Nq, Nk) * LOG2E
                # (d <= 64: L_i and D_i read for every score, as the traffic model counts them)
                p = mma.exp2(sc - ((la0 if e % 2 == 0 else la1) if ONE_LOOP else LDs[col]))
                if masked and causal and first + 8 * (e // 2) > nq * 8 + e % 2:      # first key and query in the tile
                    p = ZERO
                if masked and MASK_MOD and not is_set(allow0 if e % 2 == 0 else allow1, nq * 2 + e // 2):
                    p = ZERO
                if dropout:                    # W = Z / (1-p): dV takes P ∘ W, dS = P ∘ (dP ∘ W - D)
                    w = factor(keep0 if e % 2 == 0 else keep1, nq * 2 + e // 2, dst)
                    s[nq, e] = p * w
                    dp[nq, e] = p * (dp[nq, e] * w - ((da0 if e % 2 == 0 else da1) if ONE_LOOP else LDs[Br + col]))
                else:
                    s[nq, e] = p
                    dp[nq, e] = p * (dp[nq, e] - ((da0 if e % 2 == 0 else da1) if ONE_LOOP else LDs[Br + col]))
                if SCORED and qi < Nq and kj < Nk:     # the chain rule through score_mod, inside the problem
                    dp[nq, e] *= grad(raw, z, qi, kj)
                idx = DSO + ds_at_chunk(w16 + g8 + 8 * (e // 2), col // E) + uint32(col % E)
                sm[idx] = to_shared(from_f32(dp[nq, e]))       # dSᵀ for line 15 (rounded as P is)

    return p_ds


def _make_dv_dk(storage, g, P, b_cols):
    """``dv_dk``: lines 12 and 16, ``dV_j += Pᵀ dO_i`` and ``dK_j += dSᵀ Q_i`` with Pᵀ and dSᵀ straight from the
    registers as A fragments."""
    ND, KQ, QO, DOO = g["ND"], g["KQ"], g["offsets"]["Q"], g["offsets"]["dO"]
    TF32 = storage == "float32"
    mma_k, p_fragment = P["mma_k"], P["p_fragment"]

    @cuda.jit(device=True, inline="always")
    def dv_dk(sm, s, dp, dk, dv, lane):
        for kq in range(KQ):                   # line 12: dV_j += Pᵀ dO_i; line 16: dK_j += dSᵀ Q_i
            nq = kq * 2 if not TF32 else kq
            nq2 = nq + 1 if not TF32 else nq
            pa0, pa1, pa2, pa3 = p_fragment(s[nq, 0], s[nq, 1], s[nq, 2], s[nq, 3], s[nq2, 0], s[nq2, 1],
                                            s[nq2, 2], s[nq2, 3])
            sa0, sa1, sa2, sa3 = p_fragment(dp[nq, 0], dp[nq, 1], dp[nq, 2], dp[nq, 3], dp[nq2, 0], dp[nq2, 1],
                                            dp[nq2, 2], dp[nq2, 3])
            for dn in range(0, ND, 2):
                o0, o1, o2, o3 = b_cols(sm, DOO, (16 if not TF32 else 8) * kq, dn * 8, lane)
                q0, q1, q2, q3 = b_cols(sm, QO, (16 if not TF32 else 8) * kq, dn * 8, lane)
                dv[dn, 0], dv[dn, 1], dv[dn, 2], dv[dn, 3] = mma_k(pa0, pa1, pa2, pa3, o0, o1, dv[dn, 0], dv[dn, 1],
                                                                   dv[dn, 2], dv[dn, 3])
                dv[dn + 1, 0], dv[dn + 1, 1], dv[dn + 1, 2], dv[dn + 1, 3] = mma_k(
                    pa0, pa1, pa2, pa3, o2, o3, dv[dn + 1, 0], dv[dn + 1, 1], dv[dn + 1, 2], dv[dn + 1, 3])
                dk[dn, 0], dk[dn, 1], dk[dn, 2], dk[dn, 3] = mma_k(sa0, sa1, sa2, sa3, q0, q1, dk[dn, 0], dk[dn, 1],
                                                                   dk[dn, 2], dk[dn, 3])
                dk[dn + 1, 0], dk[dn + 1, 1], dk[dn + 1, 2], dk[dn + 1, 3] = mma_k(
                    sa0, sa1, sa2, sa3, q2, q3, dk[dn + 1, 0], dk[dn + 1, 1], dk[dn + 1, 2], dk[dn + 1, 3])

    return dv_dk


def _make_next_q(g, P, Br, gqa, PIPE):
    """``next_q``: after the barrier that ends the tile's reads, the next Q tile's copies (this head's next, or
    (GQA) the next query head's first) issued to fly during line 15."""
    QO, DOO = g["offsets"]["Q"], g["offsets"]["dO"]
    load_tile = P["load_tile"]

    @cuda.jit(device=True, inline="always")
    def next_q(i, n_i, Q, dO, L, D, sm, LDs, z, i0, i_first, z_end, tid, Nq):
        cuda.syncthreads()                     # dSᵀ complete; Q_i, dO_i, L_i, D_i no longer read
        zn = z                                 # the next Q tile: this head's ...
        n0 = i0 + Br
        nxt = i + 1 < n_i
        if gqa and not nxt:                    # ... or (GQA) the next query head's first
            zn = z + 1
            n0 = i_first * Br
            nxt = zn < z_end
        if nxt:                                # it flies during line 15
            if PIPE:
                load_tile(Q[zn], sm, QO, n0, Nq, Br, tid)
                load_tile(dO[zn], sm, DOO, n0, Nq, Br, tid)
                mma.cp_async_commit()
            if PIPE and tid < Br:
                LDs[tid] = L[zn, n0 + tid] * LOG2E if n0 + tid < Nq else POS_INF
                LDs[Br + tid] = D[zn, n0 + tid] if n0 + tid < Nq else ZERO

    return next_q


def _make_dq(storage, g, P, d, warps, a_ds, b_cols_natural):
    """``dq``: line 15, ``dQ_i += dS K_j`` over this warp's parts of dQ_i (16 rows × ``NDQ·8`` columns each), added
    into HBM with float32 atomics (other key blocks add too)."""
    KK, NDQ, CPT, IPW, PARTS, KO = g["KK"], g["NDQ"], g["CPT"], g["IPW"], g["PARTS"], g["offsets"]["K"]
    KR, KD = g["k_regs"], g["KD"]
    DQ32 = 0 < KR < KD                      # (d = 128: dQ's atomics indexed in 32 bits, for those registers)
    TF32 = storage == "float32"
    mma_k = P["mma_k"]

    @cuda.jit(device=True, inline="always")
    def dq_parts(sm, dq, dQ, z, i0, tid, lane, g8, t4, scale, Nq):
        for it in range(IPW):                  # line 15: dQ_i += dS K_j, this warp's parts (16 rows × NDQ·8 columns)
            part = (tid // 32) * IPW + it
            if PARTS % warps != 0 and part >= PARTS:
                continue                       # (warp-uniform: fewer parts than warps)
            q16 = (part // CPT) * 16
            c0 = (part % CPT) * NDQ * 8
            for dn in range(NDQ):
                for c in range(4):
                    dq[dn, c] = ZERO
            for kk in range(KK):
                a0, a1, a2, a3 = a_ds(sm, q16, kk * (16 if not TF32 else 8), lane)
                for dn in range(0, NDQ, 2):
                    k0, k1, k2, k3 = b_cols_natural(sm, KO, kk * (16 if not TF32 else 8), c0 + dn * 8, lane)
                    dq[dn, 0], dq[dn, 1], dq[dn, 2], dq[dn, 3] = mma_k(a0, a1, a2, a3, k0, k1, dq[dn, 0], dq[dn, 1],
                                                                       dq[dn, 2], dq[dn, 3])
                    dq[dn + 1, 0], dq[dn + 1, 1], dq[dn + 1, 2], dq[dn + 1, 3] = mma_k(
                        a0, a1, a2, a3, k2, k3, dq[dn + 1, 0], dq[dn + 1, 1], dq[dn + 1, 2], dq[dn + 1, 3])
            r0 = uint32(i0 + q16) + uint32(g8) if DQ32 else 0   # rows and columns in 32 bits (with seven
            cq = uint32(c0) + uint32(2 * t4) if DQ32 else 0     # k-steps of K_j kept, the 64-bit ones spilled)
            for h in range(2):                 # atomically into HBM (other key blocks add too)
                row = r0 + uint32(8 * h) if DQ32 else i0 + q16 + g8 + 8 * h
                if row < (uint32(Nq) if DQ32 else Nq):     # (unsigned against int64 would compare in float64)
                    for dn in range(NDQ):
                        for e in range(2):
                            col = cq + uint32(dn * 8 + e) if DQ32 else c0 + dn * 8 + 2 * t4 + e
                            if col < (uint32(d) if DQ32 else d):
                                cuda.atomic.add(dQ, (z, row, col), scale * dq[dn, 2 * h + e])

    return dq_parts


def _make_q_tiles(q_tile, sparse, causal, ONE_LOOP, MASK_MOD, tile_state):
    """``q_tiles``: line 6, the Q tiles of one query head, each computed by ``q_tile`` masked or not."""

    @cuda.jit(device=True, inline="always")
    def q_tiles(z, i_first, i_full, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, j0, tid, diag, sl2, flip,
                scale, dQ, z_end, dst, Nk, M):
        """Line 6: the Q tiles of query head ``z`` this block sees (with a block mask: its non-EMPTY ones)."""
        lane = tid % 32
        jb = cuda.blockIdx.x
        if sparse:
            for i in range(i_first, n_i):
                st = tile_state(M, z, i, jb, lane)     # (block-uniform)
                if st == EMPTY:
                    continue
                if ONE_LOOP:
                    q_tile(i, causal or MASK_MOD, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, z, j0,
                           tid, diag, sl2, flip, scale, dQ, i_first, z_end, dst, Nk, st)
                elif (causal and i < i_full) or st == PARTIAL:
                    q_tile(i, True, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, z, j0, tid, diag,
                           sl2, flip, scale, dQ, i_first, z_end, dst, Nk, st)
                else:
                    q_tile(i, False, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, z, j0, tid, diag,
                           sl2, flip, scale, dQ, i_first, z_end, dst, Nk, st)
        elif ONE_LOOP:                                 # one loop: the mask tested on every causal tile
            for i in range(i_first, n_i):
                q_tile(i, causal, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, z, j0, tid, diag,
                       sl2, flip, scale, dQ, i_first, z_end, dst, Nk, FULL)
        else:
            for i in range(i_first, i_full):           # the Q tiles the causal diagonal crosses ...
                q_tile(i, True, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, z, j0, tid, diag,
                       sl2, flip, scale, dQ, i_first, z_end, dst, Nk, FULL)
            for i in range(max(i_first, i_full), n_i):     # ... then those no mask touches
                q_tile(i, False, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, z, j0, tid, diag,
                       sl2, flip, scale, dQ, i_first, z_end, dst, Nk, FULL)

    return q_tiles


def _make_kv_fragments(storage, g, P, Br, Bc, PIPE):
    """``kv_fragments``: line 5, K_j and V_j into shared memory (with the first Q tile's copies, pipelined), then
    this warp's 16 keys of them as A fragments (all, or K_j's first ``k_regs`` k-steps); dK_j, dV_j zeroed."""
    KD, ND = g["KD"], g["ND"]
    KO, VO, QO, DOO = g["offsets"]["K"], g["offsets"]["V"], g["offsets"]["Q"], g["offsets"]["dO"]
    ASYNC, KV_REGS, KR = g["copy"] == "async", g["kv_regs"], g["k_regs"]
    at, load_tile = P["at"], P["load_tile"]

    @cuda.jit(device=True, inline="always")
    def kv_fragments(K, V, Q, dO, L, D, sm, LDs, ka, va, dk, dv, kz, z, j0, i_first, n_i, tid, lane, w16, flip, Nq,
                     Nk):
        load_tile(K[kz], sm, KO, j0, Nk, Bc, tid)      # line 5: K_j, V_j (with the first Q_i, dO_i)
        load_tile(V[kz], sm, VO, j0, Nk, Bc, tid)
        if ASYNC:
            if PIPE and i_first < n_i:
                load_tile(Q[z], sm, QO, i_first * Br, Nq, Br, tid)
                load_tile(dO[z], sm, DOO, i_first * Br, Nq, Br, tid)
                if tid < Br:
                    r = i_first * Br + tid
                    LDs[tid] = L[z, r] * LOG2E if r < Nq else POS_INF
                    LDs[Br + tid] = D[z, r] if r < Nq else ZERO
            mma.cp_async_commit()
            mma.cp_async_wait_group(0)
        cuda.syncthreads()
        if KV_REGS:
            for kk in range(KD):                       # this warp's 16 keys of K_j and V_j as A fragments, once
                a0, a1, a2, a3 = mma.ldmatrix_x4(sm, KO + at(w16 + 8 * ((lane // 8) % 2), lane, 2 * kk + lane // 16))
                ka[kk, 0], ka[kk, 1], ka[kk, 2], ka[kk, 3] = a0 ^ flip, a1 ^ flip, a2 ^ flip, a3 ^ flip
                b0, b1, b2, b3 = mma.ldmatrix_x4(sm, VO + at(w16 + 8 * ((lane // 8) % 2), lane, 2 * kk + lane // 16))
                va[kk, 0], va[kk, 1], va[kk, 2], va[kk, 3] = b0, b1, b2, b3
        else:
            for kk in range(KR):                       # K_j's first KR k-steps, once
                a0, a1, a2, a3 = mma.ldmatrix_x4(sm, KO + at(w16 + 8 * ((lane // 8) % 2), lane, 2 * kk + lane // 16))
                ka[kk, 0], ka[kk, 1], ka[kk, 2], ka[kk, 3] = a0 ^ flip, a1 ^ flip, a2 ^ flip, a3 ^ flip
        for dn in range(ND):
            for c in range(4):
                dk[dn, c] = ZERO
                dv[dn, c] = ZERO

    return kv_fragments


def _make_store_dk_dv(g, P, d):
    """``store_dk_dv``: line 18, dK_j (times scale, once) and dV_j to HBM."""
    ND, ONE_LOOP = g["ND"], g["one_loop"]
    from_f32 = P["from_f32"]

    @cuda.jit(device=True, inline="always")
    def store_dk_dv(dK, dV, dk, dv, kz, j0, lane, w16, scale, Nk):
        if ONE_LOOP:                                   # 32-bit, from the thread index (d > 64: the 64-bit lane
            u = uint32(cuda.threadIdx.x)               # and w16, kept alive across the tile loop for this, were
            g8 = u % uint32(32) // uint32(4)           # what spilled at Bc = 128; d = 64 compiles as it did)
            t4 = u % uint32(4)
            k0 = uint32(j0) + u // uint32(32) * uint32(16) + g8
        else:
            g8 = lane // 4
            t4 = lane % 4
            k0 = j0 + w16 + g8
        for h in range(2):                             # line 18: dK_j (times scale, once), dV_j to HBM
            row = k0 + 8 * h
            if row < Nk:
                for dn in range(ND):
                    for e in range(2):
                        col = dn * 8 + 2 * t4 + e
                        if col < d:
                            dK[kz, row, col] = from_f32(scale * dk[dn, 2 * h + e])
                            dV[kz, row, col] = from_f32(dv[dn, 2 * h + e])

    return store_dk_dv


@kernel_factory("fa2_tc.backward", stage="7", signature=_bwd_sig, configs=_bwd_configs(), archs=ARCHS[80],
                threads=lambda warps, **_: 32 * warps, dynamic_shared=_bwd_dynamic_bytes)
def make_backward(Br, Bc, d, warps, causal, storage="float16", gqa=False, dropout=False, sparse=False, score_mod=None,
                  mask_mod=None, H=1, score_mod_grad=None, dynamic=False):
    """FA2 Alg. 2 on tensor cores; grid ``(Tc, BH_kv)``, ``32·warps`` threads, one block per K/V tile.  Warp ``w``
    owns keys ``16w .. 16w + 15`` of ``K_j``: it computes ``Sᵀ = K_j Q_iᵀ`` and ``dPᵀ = V_j dO_iᵀ`` (keys × queries,
    so that ``Pᵀ`` and ``dSᵀ`` are, in registers, the A fragments of ``dV_j += Pᵀ dO_i`` and ``dK_j += dSᵀ Q_i``);
    ``dSᵀ`` goes to shared memory once per tile, where every warp reads it back as the A fragment of ``dQ_i = dS
    K_j`` for its 16·QM query rows, added into HBM with float32 atomics.  ``gqa``: K, V have fewer heads than Q; a
    block visits the Q tiles of each of its K/V head's ``G`` query heads in turn, so dK_j, dV_j are summed on chip
    (the product kernel's policy).  ``dropout``: the forward's ``Z`` regenerated (Philox, the product kernel's
    policy): ``dV_j += (P ∘ W)ᵀ dO_i`` and ``dS = P ∘ (dP ∘ W - D)`` with ``W = Z / (1-p)``.  ``sparse``,
    ``score_mod``, ``mask_mod``, ``H``: as in :func:`make_forward` (a visited Q tile is copied alone), and
    ``score_mod_grad`` (``d score_mod / d score``) multiplies dS.  ``dynamic``: the tiles live in one *dynamic* shared
    array (launched with :func:`_bwd_dynamic_bytes` bytes), what lets them exceed 48 KiB.  sm_80 and sm_90."""
    g = bwd_geometry(storage, d, Br, Bc, warps)
    NQ, ND, KD, NDQ = g["NQ"], g["ND"], g["KD"], g["NDQ"]
    TOTAL, KV_REGS = g["total"], g["kv_regs"]
    ASYNC = g["copy"] == "async"
    P = _make_policies(storage, g, 80)
    SDT = _SHARED_TYPE[storage]
    SIGN = _SIGN[storage]
    KAV = KD if KV_REGS else 1              # V_j's A fragments kept in registers (else reloaded per tile)
    KR = g["k_regs"]                        # K_j's first KR k-steps kept in registers ...
    KAK = KR + (1 if KR < KD else 0)        # ... and one slot for those reloaded per tile
    LDN = 2 * Br                            # L_i and D_i (a compile-time size)
    ONE_LOOP = g["one_loop"]                # d > 64: dK_j, dV_j fill half the registers; one copy of the tile loop
    group = policies.gqa(gqa)[1]
    drop_state, keep_bits, factor = policies.dropout(dropout)
    H = policies.check_features(sparse, mask_mod, dropout, H, 2 * NQ)   # bits: one query parity
    tile_state, is_set = policies.tile_state(sparse), policies.is_set
    score, allowed_bits, grad = policies.modifiers(score_mod, mask_mod, H, score_mod_grad)
    SCORED, MASK_MOD = score_mod is not None, mask_mod is not None
    PIPE = ASYNC and not sparse                 # prefetch the next Q tile during this one's dQ
    b_cols, b_cols_natural, a_ds = _make_bwd_loaders(storage, g, P)
    load_q = _make_load_q(storage, g, P, Br, PIPE)
    s_dp = _make_s_dp(storage, g, P)
    p_ds = _make_p_ds(storage, g, P, Br, causal, dropout,
                      (score, allowed_bits, grad, is_set, keep_bits, factor, SCORED, MASK_MOD))
    dv_dk = _make_dv_dk(storage, g, P, b_cols)
    next_q = _make_next_q(g, P, Br, gqa, PIPE)
    dq_parts = _make_dq(storage, g, P, d, warps, a_ds, b_cols_natural)
    kv_fragments = _make_kv_fragments(storage, g, P, Br, Bc, PIPE)
    store_dk_dv = _make_store_dk_dv(g, P, d)

    @cuda.jit(device=True, inline="always")
    def q_tile(i, masked, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, z, j0, tid, diag, sl2, flip, scale,
               dQ, i_first, z_end, dst, Nk, st):
        """One Q tile (FA2 Alg. 2 lines 7-16) of query head ``z``; ``masked``: it crosses the causal diagonal, or is
        ``PARTIAL`` in the block mask (``st``).  The next tile is ``i + 1`` of the same head, or (GQA) the first of
        the next query head before ``z_end``.  (At most 30 arguments: CPython passes more as one tuple, which
        Numba cannot compile for a GPU.)"""
        lane = tid % 32
        Nq = Q.shape[1]
        i0 = i * Br
        w16 = (tid // 32) * 16                 # the warp's keys in K_j
        g8 = lane // 4
        t4 = lane % 4
        load_q(Q, dO, L, D, sm, LDs, z, i0, tid, Nq)                   # lines 7-8: Q_i, dO_i, L_i, D_i
        s_dp(sm, ka, va, s, dp, flip, lane, w16)                       # lines 10, 13: Sᵀ, dPᵀ
        p_ds(masked, sm, LDs, s, dp, z, i0, j0, w16, g8, t4, diag, sl2, scale, dst, Nq, Nk, st)   # lines 11, 14
        dv_dk(sm, s, dp, dk, dv, lane)                                 # lines 12, 16: dV_j, dK_j
        next_q(i, n_i, Q, dO, L, D, sm, LDs, z, i0, i_first, z_end, tid, Nq)   # the next tile's copies fly ...
        dq_parts(sm, dq, dQ, z, i0, tid, lane, g8, t4, scale, Nq)      # ... during line 15: dQ_i += dS K_j

    q_tiles = _make_q_tiles(q_tile, sparse, causal, ONE_LOOP, MASK_MOD, tile_state)

    @cuda.jit
    def fa2_tc_backward(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag, M, threshold, inv_keep, seed_lo, seed_hi, rb,
                        rstep, rsplit, rjump, cb, cstep, csplit, cjump):
        if dynamic:                                    # (a compile-time constant: one branch is compiled)
            sm = cuda.shared.array(0, SDT, alignment=SHARED_ALIGN)       # TOTAL elements, given at launch
        else:
            sm = cuda.shared.array(TOTAL, SDT, alignment=SHARED_ALIGN)   # K_j, V_j, Q_i, dO_i, dSᵀ (swizzled)
        LDs = cuda.shared.array(LDN, float32)          # L_i·log2 e, D_i
        ka = cuda.local.array((KAK, 4), uint32)        # K_j's A fragments (this warp's 16 keys; sign of scale)
        va = cuda.local.array((KAV, 4), uint32)        # V_j's
        dk = cuda.local.array((ND, 4), float32)        # dK_j (C layout: keys g, g+8; columns 2t, 2t+1)
        dv = cuda.local.array((ND, 4), float32)        # dV_j
        s = cuda.local.array((NQ, 4), float32)         # Sᵀ, then Pᵀ (keys × queries)
        dp = cuda.local.array((NQ, 4), float32)        # dPᵀ, then dSᵀ
        dq = cuda.local.array((NDQ, 4), float32)       # one part of dQ_i (C layout)
        kz = cuda.blockIdx.y                           # the K/V head (without GQA also the query head)
        G = group(Q, K)                                # GQA: its query heads kz·G .. kz·G + G - 1
        z_end = kz * G + G
        j0 = cuda.blockIdx.x * Bc                      # (causal: block 0, the heaviest, is launched first already)
        tid = cuda.threadIdx.x
        lane = tid % 32
        w16 = (tid // 32) * 16
        Nq = Q.shape[1]
        Nk = K.shape[1]
        flip = SIGN if scale < ZERO else uint32(0)     # a negative scale: K negated in Sᵀ, |scale| in the exponent
        sl2 = abs(scale) * LOG2E
        dst = drop_state(threshold, inv_keep, seed_lo, seed_hi, rb, rstep, rsplit, rjump, cb, cstep, csplit, cjump)
        # line 6: the Q tiles this block sees, i_first .. n_i - 1; from i_full on no causal mask touches a tile
        i_first, i_full, n_i = q_tile_range(j0, Br, Bc, Nq, diag, causal)
        z = kz * G                                     # the first query head
        kv_fragments(K, V, Q, dO, L, D, sm, LDs, ka, va, dk, dv, kz, z, j0, i_first, n_i, tid, lane, w16, flip, Nq,
                     Nk)                               # line 5: K_j, V_j (with the first Q_i, dO_i)
        if gqa:                                        # each query head of the group in turn
            for z in range(kz * G, z_end):
                q_tiles(z, i_first, i_full, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, j0, tid, diag, sl2,
                        flip, scale, dQ, z_end, dst, Nk, M)
        else:
            q_tiles(kz, i_first, i_full, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, j0, tid, diag, sl2,
                    flip, scale, dQ, z_end, dst, Nk, M)
        store_dk_dv(dK, dV, dk, dv, kz, j0, lane, w16, scale, Nk)     # line 18

    return fa2_tc_backward
