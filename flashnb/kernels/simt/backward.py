"""The product kernel's backward (FA2 Alg. 2) on stage 6's fast loop, and the dQ conversion of half storage, built
from :mod:`flashnb.kernels.simt.blocks` with the feature policies of :mod:`flashnb.kernels.policies`.

Kernels (``flashnb inspect``/``flashnb sass``): ``"flash.backward"``, ``"flash.convert"``.  Launchers:
:mod:`flashnb.kernels.launch.flash`.
"""

from __future__ import annotations

import math

from numba import cuda, float32, uint32

from ...common import NEG_INF, ONE, ZERO, storage_array_type
from ...registry import kernel_factory
from .. import policies
from ..policies import EMPTY
from ..policies.tiles import q_tile_range
from . import blocks
from .blocks import LC, LR, PAD, VEC, bwd_geometry
from .defaults import bwd_default_tiles
from .forward import _A2, _A3, _MASK, _MODS, _MODS_2

__all__ = ["make_backward", "make_convert", "CONVERT_THREADS"]

CONVERT_THREADS = 128        # dQ conversion (half storage): one element per thread


def _bwd_sig(storage="float32", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {h}, {h}, {_A2}, {_A2}, {_A3}, {h}, {h}, float32, int32, {_MASK}, {policies.DROPOUT_SIG})"


def _convert_sig(storage="float16", **_):
    return f"void({_A3}, {storage_array_type(storage)})"


def _bwd_configs():
    """The default tiles (d = 64 with and without the causal mask, d = 128 causal), odd head dims (d = 20 with one
    warp; d = 70: Dp = 96), then each feature as in :func:`_fwd_configs`."""
    t64, t128 = bwd_default_tiles(64), bwd_default_tiles(128)
    return [dict(**t64, d=64, causal=False), dict(**t64, d=64, causal=True), dict(**t128, d=128, causal=True),
            dict(Br=16, Bc=8, warps=1, d=20, causal=True), dict(Br=16, Bc=16, warps=2, d=70, causal=False),
            dict(**t128, d=128, causal=False, storage="float16"),
            dict(**t64, d=64, causal=True, storage="bfloat16"),
            dict(**t64, d=32, causal=False, sparse=True),
            dict(**t64, d=64, causal=True, dropout=True),
            dict(**t128, d=128, causal=False, sparse=True, gqa=True, dropout=True),
            dict(**t64, d=64, causal=False, sparse=True, H=4, gqa=True, **_MODS),
            dict(**t128, d=128, causal=True, sparse=True, H=4, gqa=True, **_MODS_2)]


@kernel_factory("flash.backward", stage="product", signature=_bwd_sig, configs=_bwd_configs(),
                threads=lambda warps, **_: 32 * warps)
def make_backward(Br, Bc, d, warps, causal, storage="float32", sparse=False, score_mod=None, mask_mod=None, H=1,
                  gqa=False, score_mod_grad=None, dropout=False):
    """FA2 Alg. 2 on stage 6's loop, grid ``(Tc, BH_kv)``: each block keeps ``K_j, V_j`` and streams the Q tiles of
    its K/V head's query heads (one, or the ``G`` of a GQA group: dK_j, dV_j summed on chip).  Features as in
    :func:`make_forward`; ``score_mod_grad`` (default: ``score_mod.grad``; the user surfaces derive one from
    ``score_mod``'s source, :func:`flashnb.flex_grad.derivative`) makes ``dS = P ∘ (dP - D) · d score_mod /
    d score``; dropout regenerates the forward's ``Z`` (``dV_j += (P ∘ W)ᵀ dO_i``, ``dS = P ∘ (dP ∘ W - D)``,
    ``W = Z / (1-p)``); half ``storage`` narrows dK, dV at their store (dQ: :func:`make_convert`)."""
    if score_mod is not None and score_mod_grad is None:
        score_mod_grad = policies.score_mod_grad_of(score_mod)   # score_mod.grad (the surfaces derive the rest)
    g = bwd_geometry(Br, Bc, d, warps)
    TM, TN, DN, Dp, TQ, E, NT = g["TM"], g["TN"], g["DN"], g["Dp"], g["TQ"], g["E"], g["threads"]
    H = policies.check_features(sparse, mask_mod, dropout, H, TM * TN)
    LD = Dp + PAD                                       # row length of K_j, V_j, Q_i, dO_i in shared memory
    LS = blocks.ds_row(Bc)                              # row length of dS_ij
    KN, QN, SN = Bc * LD, Br * LD, Br * LS              # shared array sizes (floats)
    to_f32, from_f32 = policies.storage(storage)
    load_tile, load_stats = blocks.make_load_tile(d, Dp, NT, to_f32), blocks.make_load_stats(Br, NT)
    qk_dp, visible = blocks.make_qk_dp(TM, TN, Dp, LD), blocks.make_visible(causal)
    dv_dk, dq = blocks.make_dv_dk(TM, TN, DN // VEC, LD), blocks.make_dq(TQ, E, Bc, LD, LS, d, Dp)
    epilogue = blocks.make_backward_epilogue(Bc, TM, DN // VEC, Dp, d, NT, from_f32)
    tile_state, is_set = policies.tile_state(sparse), policies.is_set
    score, allowed_bits, grad = policies.modifiers(score_mod, mask_mod, H, score_mod_grad)
    drop_state, keep_bits, factor = policies.dropout(dropout)
    group, kv_tile = policies.gqa(gqa)[1], policies.kv_rows()

    @cuda.jit
    def flash_backward(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag, M, threshold, inv_keep, seed_lo, seed_hi, rb, rstep,
                       rsplit, rjump, cb, cstep, csplit, cjump):
        Ks = cuda.shared.array(KN, float32)            # K_j (at the end: dK_j), rows of LD = Dp + 4 floats
        Vs = cuda.shared.array(KN, float32)            # V_j (at the end: dV_j)
        Qs = cuda.shared.array(QN, float32)            # Q_i
        dOs = cuda.shared.array(QN, float32)           # dO_i
        dSs = cuda.shared.array(SN, float32)           # dS_ij, row-major: the one exchange between warps
        Ls = cuda.shared.array(Br, float32)
        Ds = cuda.shared.array(Br, float32)
        S = cuda.local.array((TM, TN), float32)        # Sᵀ, then (P ∘ W)ᵀ (registers: constant indices only)
        dP = cuda.local.array((TM, TN), float32)       # dPᵀ, then dSᵀ
        dKj = cuda.local.array((TM, DN), float32)
        dVj = cuda.local.array((TM, DN), float32)
        kz = cuda.blockIdx.y                           # the K/V head (without GQA also the query head)
        jb = cuda.blockIdx.x
        j0 = jb * Bc
        tid = cuda.threadIdx.x
        lane = tid % 32
        lr = lane // LC
        lc = lane % LC
        c0 = (tid // 32) * (TM * LR) + lr              # this lane's key rows: c0 + LR·a (query columns lc + LC·b)
        krow, qcol = uint32(c0 * LD), uint32(lc * LD)
        vcol, lane8 = uint32(lc * VEC), uint32(lr * LC)
        Nq = Q.shape[1]
        Nk = K.shape[1]
        G = group(Q, K)                                # GQA: the query heads kz·G .. kz·G + G - 1
        dst = drop_state(threshold, inv_keep, seed_lo, seed_hi, rb, rstep, rsplit, rjump, cb, cstep, csplit, cjump)
        kfull = j0 + Bc <= Nk
        kh, kr = kv_tile(kz, j0)                       # where K_j, V_j are stored
        load_tile(K, Ks, 0, LD, kh, kr, Nk, Bc, kfull, tid)             # Alg. 2 line 6: K_j, V_j once
        load_tile(V, Vs, 0, LD, kh, kr, Nk, Bc, kfull, tid)
        for a in range(TM):                            # line 7: dK_j = dV_j = 0 (registers)
            for c in range(DN):
                dKj[a, c] = ZERO
                dVj[a, c] = ZERO
        i_first, _, n_i = q_tile_range(j0, Br, Bc, Nq, diag, causal)   # causal: no Q block before key j0
        for gz in range(G):
            z = kz * G + gz                            # the query head
            for it in range(i_first, n_i):             # line 8
                st = tile_state(M, z, it, jb, lane)    # block mask: EMPTY tiles are never loaded
                if st == EMPTY:
                    continue
                i0 = it * Br
                qfull = i0 + Br <= Nq
                cuda.syncthreads()                     # every warp is done with Q_{i-1}, dO_{i-1}, dS
                load_tile(Q, Qs, 0, LD, z, i0, Nq, Br, qfull, tid)      # line 9: Q_i, dO_i, L_i, D_i
                load_tile(dO, dOs, 0, LD, z, i0, Nq, Br, qfull, tid)
                load_stats(L, D, Ls, Ds, z, i0, Nq, tid)
                cuda.syncthreads()
                qk_dp(Ks, Vs, Qs, dOs, S, dP, krow, qcol)              # lines 10, 13: Sᵀ, dPᵀ
                crossing = not (qfull and kfull) or (causal and j0 + Bc - 1 > i0 + diag)
                allow = allowed_bits(z, i0 + lc, LC, j0 + c0, LR, TN, TM, Nq, Nk, st)   # mask_mod (PARTIAL)
                keep = keep_bits(dst, z, i0 + lc, LC, j0 + c0, LR, TN, TM, Nq, Nk)       # dropout's Z_ij
                for b in range(TN):                    # line 11: P = exp(s - L); line 14: dS = P ∘ (dP - D)
                    r = lc + LC * b
                    Lr = Ls[r]
                    Dr = Ds[r]
                    for a in range(TM):
                        key = j0 + c0 + LR * a
                        s = scale * S[a, b]
                        pv = ZERO
                        gs = ONE                       # d score_mod / d score
                        if is_set(allow, b * TM + a) and (not crossing or (Lr != NEG_INF and visible(
                                i0 + r, key, Nk, diag))):  # padded rows (L = -inf), keys beyond Nk, the causal mask
                            pv = float32(math.exp(score(s, z, i0 + r, key, Nq, Nk) - Lr))
                            gs = grad(s, z, i0 + r, key)
                        w = factor(keep, b * TM + a, dst)              # dropout: W = Z / (1-p)
                        S[a, b] = pv * w
                        dP[a, b] = pv * (dP[a, b] * w - Dr) * gs
                        dSs[uint32(r * LS + c0 + LR * a)] = dP[a, b]  # for line 15
                dv_dk(dOs, Qs, S, dP, dKj, dVj, lane8, vcol)           # lines 12, 16: dV_j, dK_j
                cuda.syncthreads()                     # dS_ij complete (every warp wrote its key columns)
                dq(dSs, Ks, dQ, z, i0, (tid // 32) * TQ, lane, scale, qfull, Nq)   # line 15: dQ_i += dS_ij K_j
        epilogue(Ks, Vs, dK, dV, dKj, dVj, kz, j0, c0, vcol, tid, scale, Nk)      # line 18: dK_j, dV_j

    return flash_backward


@kernel_factory("flash.convert", stage="product", signature=_convert_sig, threads=CONVERT_THREADS,
                configs=[dict(storage="float16"), dict(storage="bfloat16")])
def make_convert(storage="float16"):
    """Half storage only: ``dQh = dQ`` narrowed from the float32 accumulator the backward's atomics summed into (as
    FlashAttention-2 ends its backward).  Grid ``(ceil(Nq·d / 128), BH)``, one element per thread."""
    from_f32 = policies.storage(storage)[1]

    @cuda.jit
    def flash_convert_dq(dQ, dQh):
        z = cuda.blockIdx.y
        e = cuda.blockIdx.x * CONVERT_THREADS + cuda.threadIdx.x
        d = dQ.shape[2]
        if e < dQ.shape[1] * d:
            i = e // d
            dQh[z, i, e - i * d] = from_f32(dQ[z, i, e - i * d])

    return flash_convert_dq
