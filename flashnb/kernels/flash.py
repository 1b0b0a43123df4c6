"""The product kernel: one FA2 forward and backward on stage 6's fast loop, with every feature as a policy.

``impl="flash"`` (the default of :func:`flashnb.attention`, :func:`flashnb.attention_forward`,
:func:`flashnb.attention_backward` and :func:`flashnb.pytorch.attention`).  The loop is stage 6's
(:mod:`flashnb.stages.fa2_fast`, built from :mod:`flashnb.kernels.blocks`): register micro-tiles, 128-bit conflict-free
shared loads, heavy-first causal blocks, dynamic shared memory where the tiles need more than 48 KiB.  The features
are the policies of :mod:`flashnb.kernels.policies`, called at fixed places of that loop and compiled away when
off (with all of them off the kernels are stage 6's):

* **storage** -- ``storage="float16"`` / ``"bfloat16"`` (uint16 bit patterns): Q, K, V, O (dO, dK, dV, dQ) kept in
  half precision in HBM, widened at every load, narrowed at every store; tiles, statistics and the dQ accumulator
  stay float32 (a conversion launch narrows dQ after the backward).
* **block masks** -- ``block_mask=`` (:class:`flashnb.masks.BlockMask`, a boolean array, or a prepared mask): three
  tile states, ``EMPTY`` (never loaded, never computed: FA1 Alg. 5's ``if M_ij != 0``), ``FULL`` (no
  per-element work), ``PARTIAL`` (``mask_mod`` per element).
* **attention modifiers** -- ``score_mod`` on every score, ``mask_mod`` through its block mask (built by the user
  surfaces with :func:`flashnb.flex.create_block_mask`), and the backward's ``score_mod_grad`` (default:
  ``score_mod.grad``, else derived from the modifier's source by :mod:`flashnb.flex_grad`, which registers itself
  with :mod:`~flashnb.kernels.policies`: the kernels never import a user surface).
* **dropout** -- ``dropout_p``, ``seed``: Philox (:mod:`flashnb.rng`) regenerated per element in both directions;
  ``dropout_at`` keys it by positions in a longer sequence (a context-parallel shard).
* **GQA / MQA** -- K, V with fewer heads than Q; the backward's blocks loop over their group's query heads, so K_j,
  V_j are loaded once per group and dK, dV summed on chip.
* **Nq != Nk**, both causal alignments (``causal=True`` / ``"lower_right"``, ``"upper_left"``), any ``d <= 128``.

The forward reads K_j, V_j once per (query head, Q block): under GQA the query heads of a group stream the same
(smaller) K/V tensors, each with its own blocks, as stage 4 does.  A block whose ``Br`` rows were the group's ``G``
heads at ``Br/G`` query positions would load each K/V tile once for the group, but it reads exactly as many K/V
elements whenever ``Br`` divides ``Nq`` (each block still holds ``Br`` rows), and its rows would span heads whose
block-mask states differ; where the sharing pays -- a few queries against a long cache -- flash-decoding
(:mod:`flashnb.kernels.decode`, ``impl="flash-decoding"``) reads each K/V chunk once per group.

Kernels (``flashnb inspect``/``flashnb sass``): ``"flash.forward"``, ``"flash.preprocess"``, ``"flash.backward"``,
``"flash.convert"``.  Traffic models equal to the counter (:mod:`flashnb.kernels.models`, re-exported here):
:func:`model_forward`, :func:`model_backward` (elements), :func:`model_bytes` (bytes at a storage).  Tiles and block
masks on them: :mod:`flashnb.kernels.tiles`.  The SASS time model's inputs: :func:`sass_config`, :func:`sass_shape`,
:func:`launch_order`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from .. import modifiers
from ..common import (
    NEG_INF,
    ONE,
    ZERO,
    allow_dynamic_shared,
    causal_diag,
    cdiv,
    check_storage,
    empty,
    launch,
    opt_in_or_fall_back,
    shared_optin_limit,
    storage_array_type,
    storage_dtype,
    storage_of,
    warn_fallback,
)
from ..registry import kernel_factory, register_impl
from . import blocks, policies
from .blocks import LC, LR, PAD, VEC, bwd_geometry, geometry, needs_dynamic, shared_bytes
from .models import itemsizes, model_backward, model_bytes, model_forward, tiles_visited  # noqa: F401  (the impl's)
from .policies import EMPTY, FULL, PARTIAL
from .policies.tiles import heavy_first, kv_tile_count, q_tile_range
from .tiles import (  # noqa: F401  (the impl's tiles and block masks)
    DESIGN_OPTIN_BYTES,
    PreparedMask,
    _device_mask,
    _dynamic_bytes,
    _launch_mask,
    _mask_at_tiles,
    _tiles,
    bwd_default_tiles,
    default_tiles,
    mask_tiles,
    prepare_block_mask,
)

__all__ = ["make_forward", "make_backward", "make_preprocess", "make_convert", "forward", "backward",
           "default_tiles", "bwd_default_tiles", "mask_tiles", "prepare_block_mask", "PreparedMask", "tiles_visited",
           "model_forward", "model_backward", "itemsizes", "model_bytes", "sass_config", "sass_shape", "launch_order",
           "last_forward", "EMPTY", "FULL", "PARTIAL"]

_A3 = "float32[:, :, ::1]"
_A2 = "float32[:, ::1]"
_MASK = "uint8[:, :, ::1]"   # the block mask's tile states (BH, Tr, Tc) at the kernel's tiles; 1x1x1 when dense
PRE_WARPS = 4                # preprocessing: one warp per query row, 4 rows per block
CONVERT_THREADS = 128        # dQ conversion (half storage): one element per thread


# Signatures as functions of the configuration: ``storage`` types the arrays kept in HBM (Q, K, V, O, dO, dK, dV)
# and nothing else; the dropout arguments are always there (zeros, never read, without dropout).
def _fwd_sig(storage="float32", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {h}, {h}, {_A2}, float32, int32, {_MASK}, {policies.DROPOUT_SIG})"


def _bwd_sig(storage="float32", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {h}, {h}, {_A2}, {_A2}, {_A3}, {h}, {h}, float32, int32, {_MASK}, {policies.DROPOUT_SIG})"


def _pre_sig(storage="float32", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {_A2}, {_A3})"


def _convert_sig(storage="float16", **_):
    return f"void({_A3}, {storage_array_type(storage)})"


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


# --------------------------------------------------------------------------- forward kernel (FA2 Alg. 1)


@kernel_factory("flash.forward", stage="product", signature=_fwd_sig, configs=_fwd_configs(),
                threads=lambda warps, **_: 32 * warps, dynamic_shared=_dynamic_bytes)
def make_forward(Br, Bc, d, warps, causal, dynamic=False, storage="float32", sparse=False, score_mod=None,
                 mask_mod=None, H=1, gqa=False, dropout=False):
    """FA2 Alg. 1 on stage 6's loop, grid ``(Tr, BH)`` (heavy Q blocks first when causal), ``32·warps`` threads;
    ``dynamic``: one dynamic shared array carved into ``Q_i, K_j, V_j`` (:func:`~flashnb.kernels.blocks.shared_bytes`
    bytes at launch).  The features (:mod:`flashnb.kernels.policies`, all off by default): ``storage`` of Q, K, V, O;
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


@kernel_factory("flash.backward", stage="product", signature=_bwd_sig, configs=_bwd_configs(),
                threads=lambda warps, **_: 32 * warps)
def make_backward(Br, Bc, d, warps, causal, storage="float32", sparse=False, score_mod=None, mask_mod=None, H=1,
                  gqa=False, score_mod_grad=None, dropout=False):
    """FA2 Alg. 2 on stage 6's loop, grid ``(Tc, BH_kv)``: each block keeps ``K_j, V_j`` and streams the Q tiles of
    its K/V head's query heads (one, or the ``G`` of a GQA group: dK_j, dV_j summed on chip).  Features as in
    :func:`make_forward`; ``score_mod_grad`` (default: ``score_mod.grad``, else derived from ``score_mod``'s source
    by :func:`flashnb.flex_grad.derivative`) makes ``dS = P ∘ (dP - D) · d score_mod /
    d score``; dropout regenerates the forward's ``Z`` (``dV_j += (P ∘ W)ᵀ dO_i``, ``dS = P ∘ (dP ∘ W - D)``,
    ``W = Z / (1-p)``); half ``storage`` narrows dK, dV at their store (dQ: :func:`make_convert`)."""
    if score_mod is not None and score_mod_grad is None:
        score_mod_grad = policies.score_mod_grad_of(score_mod)   # score_mod.grad, else derived from its source
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


# --------------------------------------------------------------------------- launchers


def _storage(storage, **arrays) -> str:
    """The launch's storage: ``storage`` if given, else what q's dtype stands for; every array must be in it."""
    if storage is None:
        storage = storage_of(arrays["q"]) or "float32"
    want = storage_dtype(check_storage(storage))
    for name, a in arrays.items():
        if a is not None and np.dtype(a.dtype) != want:
            raise TypeError(f"flash with storage={storage!r} takes {name} as {want} "
                            f"{'(bfloat16 bit patterns) ' if storage == 'bfloat16' else ''}device arrays, got "
                            f"{name} of dtype {a.dtype}")
    return storage


def forward(q, k, v, *, causal=False, scale, Br=None, Bc=None, warps=None, block_mask=None, score_mod=None,
            mask_mod=None, heads=1, score_mod_grad=None, dropout_p=0.0, seed=None, dropout_at=None, storage=None):
    """Device arrays in, ``(O, L)`` out (FA2 Alg. 1).  ``Br, Bc, warps`` default to :func:`default_tiles` (with a
    block mask: the largest tiles dividing its blocks).  Tiles over 48 KiB of shared memory run the dynamic kernel
    after the driver opt-in, up to the device's opt-in limit; when the *default* tiles need more than the device
    allows (or the opt-in fails), the launch falls back to the static defaults with a ``RuntimeWarning``
    (:data:`last_forward` says what ran).

    ``block_mask``: a :class:`flashnb.stages.fa2.BlockMask`, a boolean array ``(..., ceil(Nq/Br), ceil(Nk/Bc))`` read
    at the ``Br``, ``Bc`` options or :func:`mask_tiles`, or a :class:`PreparedMask`.  ``score_mod``, ``mask_mod``
    (through its block mask), ``heads`` (the H of ``z = b·H + h``): attention modifiers.  ``k``, ``v`` may have
    fewer batch·heads than ``q`` (GQA: query head ``z`` reads K/V head ``z // G``).  ``dropout_p``, ``seed``:
    attention dropout (:mod:`flashnb.rng`); ``L`` is the undropped softmax's; ``dropout_at``: where these rows and
    columns sit in a longer sequence (:func:`flashnb.kernels.policies.check_dropout_at`: a shard of a
    context-parallel ring draws the single-device mask).  ``storage``: the dtype of q, k, v
    and O (default: q's); L is float32.  ``score_mod_grad`` is the backward's (accepted so one set of options
    serves both)."""
    global last_forward
    storage = _storage(storage, q=q, k=k, v=v)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = policies.gqa_group(BH, k, v)
    drop = policies.dropout_args(dropout_p, seed, dropout_at)
    given = not (Br is None and Bc is None and warps is None)
    optin = shared_optin_limit()
    fallback = None
    scored = score_mod is not None
    try:
        t, M, bm_mod, partial = _launch_mask("forward", d, Br, Bc, warps, block_mask, BH, Nq, Nk, optin=optin,
                                             scored=scored)
    except ValueError as exc:
        if given or isinstance(block_mask, PreparedMask) or not needs_dynamic(**default_tiles(d, False, scored), d=d) \
                or "opt-in limit" not in str(exc):
            raise
        t, M, bm_mod, partial = _launch_mask("forward", d, None, None, None, block_mask, BH, Nq, Nk, static=True)
        fallback = str(exc)
    mask_mod, H = modifiers.launch_modifiers(score_mod, mask_mod, None, block_mask, heads, BH)
    config = dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), dynamic=t["dynamic"],
                  storage=storage, sparse=M is not None, score_mod=score_mod, mask_mod=mask_mod if partial else None,
                  H=H, gqa=G > 1, dropout=drop is not policies.NO_DROPOUT)
    nbytes = shared_bytes(t["Br"], t["Bc"], d, t["warps"])
    kernel = make_forward(**config)
    if t["dynamic"]:
        refused = opt_in_or_fall_back("flash forward", kernel, _fwd_sig(storage), nbytes, t, d,
                                      given or isinstance(block_mask, PreparedMask), allow_dynamic_shared)
        if refused:
            fallback = refused
            t, M, _, partial = _launch_mask("forward", d, None, None, None, block_mask, BH, Nq, Nk, static=True)
            nbytes = shared_bytes(t["Br"], t["Bc"], d, t["warps"])
            config.update(Br=t["Br"], Bc=t["Bc"], warps=t["warps"], dynamic=False,
                          mask_mod=mask_mod if partial else None)
            kernel = make_forward(**config)
    if fallback:
        warn_fallback("flash forward", d, fallback, t)
    last_forward = dict(d=d, Br=t["Br"], Bc=t["Bc"], warps=t["warps"], dynamic=t["dynamic"], shared_bytes=nbytes,
                        fallback=fallback)
    O = empty((BH, Nq, d), storage=storage)
    L = empty((BH, Nq))
    launch(kernel, (cdiv(Nq, t["Br"]), BH), 32 * t["warps"], q, k, v, O, L, scale, causal_diag(causal, Nq, Nk),
           _device_mask(None) if M is None else M, *drop, label="flash forward",
           shared=nbytes if t["dynamic"] else 0)
    return O, L


def backward(q, k, v, o, lse, do, *, causal=False, scale, Br=None, Bc=None, warps=None, block_mask=None,
             score_mod=None, mask_mod=None, heads=1, score_mod_grad=None, dropout_p=0.0, seed=None, dropout_at=None,
             storage=None):
    """FA2 Alg. 2: the ``D = rowsum(dO∘O)`` launch (it also zeroes the float32 dQ accumulator), then one block per
    K/V column block of each K/V head (looping over its GQA group's query heads), then, with half storage, dQ
    narrowed by a third launch.  ``Br, Bc, warps`` default to :func:`bwd_default_tiles` (with a block mask: the
    largest dividing its blocks); options as in :func:`forward`, with the forward's ``dropout_p``, ``seed`` (the
    mask is regenerated) and ``score_mod_grad`` (default ``score_mod.grad``, else derived from ``score_mod``'s
    source: :func:`flashnb.flex_grad.derivative`).  ``o`` is the (dropped) output."""
    storage = _storage(storage, q=q, k=k, v=v, o=o, do=do)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = policies.gqa_group(BH, k, v)
    drop = policies.dropout_args(dropout_p, seed, dropout_at)
    t, M, bm_mod, partial = _launch_mask("backward", d, Br, Bc, warps, block_mask, BH, Nq, Nk)
    mask_mod, H = modifiers.launch_modifiers(score_mod, mask_mod, score_mod_grad, block_mask, heads, BH)
    if score_mod is not None and score_mod_grad is None:
        score_mod_grad = policies.score_mod_grad_of(score_mod)   # score_mod.grad, else derived from its source
    D = empty((BH, Nq))
    dQ = empty((BH, Nq, d))                            # float32: the atomics' accumulator
    launch(make_preprocess(storage), (cdiv(Nq, PRE_WARPS), BH), 32 * PRE_WARPS, o, do, D, dQ,
           label="D = rowsum(dO∘O)")
    dK = empty((BH // G, Nk, d), storage=storage)
    dV = empty((BH // G, Nk, d), storage=storage)
    kernel = make_backward(t["Br"], t["Bc"], d, t["warps"], bool(causal), storage, M is not None, score_mod,
                           mask_mod if partial else None, H, G > 1, score_mod_grad, drop is not policies.NO_DROPOUT)
    launch(kernel, (cdiv(Nk, t["Bc"]), BH // G), 32 * t["warps"], q, k, v, do, lse, D, dQ, dK, dV, scale,
           causal_diag(causal, Nq, Nk), _device_mask(None) if M is None else M, *drop, label="flash backward")
    if storage != "float32":
        dQh = empty((BH, Nq, d), storage=storage)
        launch(make_convert(storage), (cdiv(Nq * d, CONVERT_THREADS), BH), CONVERT_THREADS, dQ, dQh,
               label=f"dQ -> {storage}")
        dQ = dQh
    return dQ, dK, dV


register_impl("flash", stage="product",
              description="the product kernel: stage 6's fast loop with every feature as a policy (half storage, "
                          "block masks, score_mod / mask_mod, dropout, GQA/MQA)",
              forward=forward, backward=backward,
              options=("Br", "Bc", "warps", "block_mask", "score_mod", "mask_mod", "score_mod_grad", "dropout_p",
                       "seed", "dropout_at", "storage"),
              gqa=True, mask_tiles=lambda d, Br=None, Bc=None: dict(mask_tiles(d), **{
                  n: v for n, v in (("Br", Br), ("Bc", Bc)) if v is not None}))


# --------------------------------------------------------------------------- the SASS time model's inputs


def sass_config(d, causal, Br=None, Bc=None, warps=None, **features) -> dict:
    """The forward kernel's configuration at head dim ``d`` (default tiles unless given), with ``features`` (the
    factory's keyword arguments: ``storage``, ``sparse``, ``score_mod``, ``mask_mod``, ``H``, ``gqa``,
    ``dropout``)."""
    t = _tiles("forward", d, Br, Bc, warps, scored=features.get("score_mod") is not None)
    return dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), dynamic=t["dynamic"], **features)


def sass_shape(config):
    """The fields of a :class:`flashnb.instruments.sass_model.KernelShape` for the forward kernel, per thread: FFMAs of
    line 8 (``TM·TN·Dp``) and line 10 (``TM·DN·Bc``) per K/V tile; K_j and V_j words copied (``2·Bc·Dp`` over the
    block's threads), Q_i's; the O_i words stored row by row, and L; with dropout or a ``mask_mod``, one trip of their
    element loops per element of a lane (``TM·TN``; an upper bound for ``mask_mod``, which runs on PARTIAL tiles
    only)."""
    g = geometry(config["Br"], config["Bc"], config["d"], config["warps"])
    NT, Dp, Bc, Br = g["threads"], g["Dp"], config["Bc"], config["Br"]
    element = config.get("dropout") or config.get("mask_mod") is not None    # Philox, mask_mod: one trip each
    return dict(phases=(g["TM"] * g["TN"] * Dp, g["TM"] * g["DN"] * Bc), tile_loads=cdiv(2 * Bc * Dp, NT),
                prologue_loads=cdiv(Br * Dp, NT), epilogue_stores=cdiv(Br * Dp, NT) + g["TM"],
                element_loops=g["TM"] * g["TN"] if element else 0)


def launch_order(Tr, causal):
    """The Q block each ``blockIdx.x`` computes, in launch order: with a causal mask the heaviest first."""
    return list(range(Tr))[::-1] if causal else list(range(Tr))

