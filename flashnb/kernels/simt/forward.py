"""The product kernel's forward (FA2 Alg. 1) and the backward's preprocessing (Alg. 2 line 4) on stage 6's fast loop,
built from :mod:`flashnb.kernels.simt.blocks` with every feature a policy of :mod:`flashnb.kernels.policies`
(compiled away when off: with all of them off the forward is stage 6's).

Kernels (``flashnb inspect``/``flashnb sass``): ``"flash.forward"``, ``"flash.preprocess"``.  Launchers:
:mod:`flashnb.kernels.launch.flash`.
"""

from __future__ import annotations

from numba import cuda, float32, uint32

from ...common import NEG_INF, ZERO, storage_array_type
from ...registry import kernel_factory
from .. import policies
from ..policies import EMPTY
from ..policies.tiles import heavy_first, kv_tile_count
from . import blocks
from .blocks import LC, LR, PAD, VEC, geometry
from .defaults import _dynamic_bytes, default_tiles

__all__ = ["make_forward", "make_preprocess", "PRE_WARPS"]

_A3 = "float32[:, :, ::1]"
_A2 = "float32[:, ::1]"
_MASK = "uint8[:, :, ::1]"   # the block mask's tile states (BH, Tr, Tc) at the kernel's tiles; 1x1x1 when dense
PRE_WARPS = 4                # preprocessing: one warp per query row, 4 rows per block


# Signatures as functions of the configuration: ``storage`` types the arrays kept in HBM (Q, K, V, O, dO, dK, dV)
# and nothing else; the dropout arguments are always there (zeros, never read, without dropout).
def _fwd_sig(storage="float32", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {h}, {h}, {_A2}, float32, int32, {_MASK}, {policies.DROPOUT_SIG})"


def _pre_sig(storage="float32", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {_A2}, {_A3})"


# --------------------------------------------------------------------------- the PTX guard's configurations

_MODS = dict(score_mod="flashnb.kernels.policies:GUARD_ALIBI", mask_mod="flashnb.kernels.policies:GUARD_WINDOW")
_MODS_2 = dict(score_mod="flashnb.kernels.policies:GUARD_SOFTCAP",
               mask_mod="flashnb.kernels.policies:GUARD_DOCUMENT")


def _fwd_configs():
    """The default tiles (d = 64 with and without the causal mask, d = 128 causal: dynamic shared memory), the static
    fallback at d = 128, odd head dims (d = 20; d = 70 pads to Dp = 96, the general tile load), then each feature:
    float16 (d = 128), bfloat16 (causal), a block mask, dropout, and last the richest paths -- GQA with a block mask
    and dropout, and GQA with both modifiers (at a score_mod's default tiles)."""
    t64, t128, s128 = default_tiles(64), default_tiles(128), default_tiles(128, static=True)
    m64, m128 = default_tiles(64, score_mod=True), default_tiles(128, score_mod=True)
    return [dict(**t64, d=64, causal=False), dict(**t64, d=64, causal=True),
            dict(**t128, d=128, causal=True, dynamic=True), dict(**s128, d=128, causal=True),
            dict(Br=32, Bc=32, warps=2, d=20, causal=True), dict(Br=24, Bc=32, warps=2, d=70, causal=False),
            dict(**t128, d=128, causal=False, dynamic=True, storage="float16"),
            dict(**t64, d=64, causal=True, storage="bfloat16"),
            dict(**t64, d=32, causal=False, sparse=True),
            dict(**t64, d=64, causal=True, dropout=True),
            dict(**t128, d=128, causal=False, dynamic=True, sparse=True, gqa=True, dropout=True),
            dict(**m64, d=64, causal=False, sparse=True, H=4, gqa=True, **_MODS),
            dict(**m128, d=128, causal=True, dynamic=True, sparse=True, H=4, gqa=True, **_MODS_2)]


# --------------------------------------------------------------------------- forward kernel (FA2 Alg. 1)


@kernel_factory("flash.forward", stage="product", signature=_fwd_sig, configs=_fwd_configs(),
                threads=lambda warps, **_: 32 * warps, dynamic_shared=_dynamic_bytes)
def make_forward(Br, Bc, d, warps, causal, dynamic=False, storage="float32", sparse=False, score_mod=None,
                 mask_mod=None, H=1, gqa=False, dropout=False):
    """FA2 Alg. 1 on stage 6's loop, grid ``(Tr, BH)`` (heavy Q blocks first when causal), ``32·warps`` threads;
    ``dynamic``: one dynamic shared array carved into ``Q_i, K_j, V_j``
    (:func:`~flashnb.kernels.simt.blocks.shared_bytes` bytes at launch).  The features
    (:mod:`flashnb.kernels.policies`, all off by default): ``storage`` of Q, K, V, O;
    ``sparse`` (the block mask ``M`` at these tiles: ``EMPTY`` tiles skipped, ``PARTIAL`` ones ask ``mask_mod``);
    ``score_mod``, ``mask_mod`` and ``H`` (``b = z // H``, ``h = z % H``); ``gqa`` (K/V head ``z // G``);
    ``dropout`` (the kernel's ``threshold, inv_keep, seed_lo, seed_hi``; ``m_i``, ``l_i``, ``L`` from the
    undropped ``P~``)."""
    g = geometry(Br, Bc, d, warps)
    TM, TN, DN, Dp, NT = g["TM"], g["TN"], g["DN"], g["Dp"], g["threads"]
    H = policies.check_features(sparse, mask_mod, dropout, H, TM * TN)
    LD = Dp + PAD                                       # row length of Q_i, K_j in shared memory
    QN, KN, VN = Br * LD, Bc * LD, Bc * Dp              # shared array sizes (floats)
    KO, VO = (QN, QN + KN) if dynamic else (0, 0)       # where K_j, V_j start in their array
    to_f32, from_f32 = policies.storage(storage)
    load_tile = blocks.make_load_tile(d, Dp, NT, to_f32)
    qk, visible = blocks.make_qk(TM, TN, Dp, LD), blocks.make_visible(causal)
    softmax_update, pv = blocks.make_softmax_update(TN, DN), blocks.make_pv(TM, TN, DN // VEC, Dp)
    epilogue = blocks.make_forward_epilogue(Br, TM, DN // VEC, Dp, d, NT, from_f32)
    tile_state, is_set = policies.tile_state(sparse), policies.is_set
    score, allowed_bits, _ = policies.modifiers(score_mod, mask_mod, H)
    drop_state, keep_bits, factor = policies.dropout(dropout)
    kv_head, kv_tile = policies.gqa(gqa)[0], policies.kv_rows()


    @cuda.jit
    def flash_forward(Q, K, V, O, L, scale, diag, M, threshold, inv_keep, seed_lo, seed_hi, rb, rstep, rsplit, rjump,
                      cb, cstep, csplit, cjump):
        if dynamic:                                    # (a compile-time constant: one branch is compiled)
            Qs = cuda.shared.array(0, float32)         # Q_i, K_j from KO, V_j from VO (offsets keep LDS.128)
            Ks = Qs
            Vs = Qs
        else:
            Qs = cuda.shared.array(QN, float32)        # Q_i: rows of LD = Dp + 4 floats; at the end O_i
            Ks = cuda.shared.array(KN, float32)        # K_j: rows of LD floats
            Vs = cuda.shared.array(VN, float32)        # V_j: rows of Dp floats (zero-padded beyond d)
        S = cuda.local.array((TM, TN), float32)        # registers (constant indices only)
        Oi = cuda.local.array((TM, DN), float32)
        m = cuda.local.array(TM, float32)
        l = cuda.local.array(TM, float32)
        z = cuda.blockIdx.y
        qb = heavy_first(cuda.blockIdx.x, cuda.gridDim.x, causal)      # the Q block (heavy first when causal)
        i0 = qb * Br
        tid = cuda.threadIdx.x
        lane = tid % 32
        lr = lane // LC
        lc = lane % LC
        rw = (tid // 32) * (TM * LR) + lr              # this lane's rows: rw + LR·a (key columns: lc + LC·b)
        qrow, kcol = uint32(rw * LD), uint32(KO + lc * LD)
        vcol, lane8 = uint32(lc * VEC), uint32(lr * LC)
        Nq = Q.shape[1]
        Nk = K.shape[1]
        kz = kv_head(z, Q, K)                          # GQA: the K/V head of query head z
        dst = drop_state(threshold, inv_keep, seed_lo, seed_hi, rb, rstep, rsplit, rjump, cb, cstep, csplit, cjump)
        load_tile(Q, Qs, 0, LD, z, i0, Nq, Br, i0 + Br <= Nq, tid)      # line 4: Q_i once
        for a in range(TM):                            # line 5: O~ = 0, l = 0, m = -inf
            m[a] = NEG_INF
            l[a] = ZERO
            for c in range(DN):
                Oi[a, c] = ZERO
        n_tiles = kv_tile_count(i0, Br, Bc, Nq, Nk, diag, causal)      # causal: no tile above the diagonal
        for jt in range(n_tiles):                      # line 6
            st = tile_state(M, z, qb, jt, lane)        # block mask: EMPTY, FULL or PARTIAL (FULL when dense)
            if st == EMPTY:
                continue                               # block-uniform: K_j, V_j never loaded
            j0 = jt * Bc
            full = j0 + Bc <= Nk
            cuda.syncthreads()                         # every warp is done with K_{j-1}, V_{j-1}
            kh, kr = kv_tile(kz, j0)                   # where K_j, V_j are stored
            load_tile(K, Ks, KO, LD, kh, kr, Nk, Bc, full, tid)         # line 7: K_j, V_j
            load_tile(V, Vs, VO, Dp, kh, kr, Nk, Bc, full, tid)
            cuda.syncthreads()
            qk(Qs, Ks, S, qrow, kcol)                  # line 8: S = Q_i K_jᵀ
            crossing = not full or (causal and j0 + Bc - 1 > i0 + diag)
            allow = allowed_bits(z, i0 + rw, LR, j0 + lc, LC, TM, TN, Nq, Nk, st)   # mask_mod (PARTIAL tiles)
            keep = keep_bits(dst, z, i0 + rw, LR, j0 + lc, LC, TM, TN, Nq, Nk)       # dropout's Z_ij
            for a in range(TM):                        # line 9
                row = i0 + rw + LR * a
                mx = NEG_INF
                for b in range(TN):
                    col = j0 + lc + LC * b
                    s = score(scale * S[a, b], z, row, col, Nq, Nk)             # score_mod
                    if not is_set(allow, a * TN + b) or (crossing and not visible(row, col, Nk, diag)):
                        s = NEG_INF
                    S[a, b] = s
                    mx = max(mx, s)
                softmax_update(S, m, l, Oi, a, mx)     # m_new, P~ = exp(S - m_new), l; O~ *= e^(m_old - m_new)
                for b in range(TN):                    # dropout, after l took the undropped P~: P~ ∘ Z / (1-p)
                    S[a, b] *= factor(keep, a * TN + b, dst)
            pv(Vs, S, Oi, lane8, vcol, VO)             # line 10: O~ += P~ V_j
        epilogue(Qs, O, L, Oi, m, l, z, i0, rw, lc, vcol, tid, Nq)     # lines 12-14

    return flash_forward


# --------------------------------------------------------------------------- backward kernels (FA2 Alg. 2)


@kernel_factory("flash.preprocess", stage="product", signature=_pre_sig, threads=32 * PRE_WARPS,
                configs=[{}, dict(storage="float16"), dict(storage="bfloat16")])
def make_preprocess(storage="float32"):
    """FA2 Alg. 2 line 4, ``D_i = rowsum(dO_i ∘ O_i)``, one warp per row (lanes over d, shuffle-reduced); also zeroes
    the float32 dQ accumulator the backward adds into.  ``storage``: the dtype of O and dO (widened)."""
    to_f32 = policies.storage(storage)[0]

    @cuda.jit
    def flash_preprocess(O, dO, D, dQ):
        z = cuda.blockIdx.y
        lane = cuda.threadIdx.x % 32
        i = cuda.blockIdx.x * PRE_WARPS + cuda.threadIdx.x // 32
        acc = ZERO
        if i < O.shape[1]:                             # warp-uniform branch
            for e in range(lane, O.shape[2], 32):
                acc += to_f32(dO[z, i, e]) * to_f32(O[z, i, e])
                dQ[z, i, e] = ZERO
        off = 16
        while off > 0:
            acc += cuda.shfl_down_sync(blocks.FULL_MASK, acc, off)
            off //= 2
        if lane == 0 and i < O.shape[1]:
            D[z, i] = acc

    return flash_preprocess
