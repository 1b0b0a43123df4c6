"""Stage 7 -- FlashAttention-2 on tensor cores: the matmuls as ``mma.sync``, fed by ``ldmatrix`` and ``cp.async``.

FA2's Section 3.1 argument is about tensor cores: an A100 multiplies matrices 16x faster (312 TFLOP/s FP16) than
it does anything else (19.5 TFLOP/s FP32), so every non-matmul FLOP costs as much as 16 matmul FLOPs.  Stages 4-6
ran the matmuls on the FP32 cores, where the softmax's exponentials and rescaling were noise beside the FFMAs.
Here ``S = Q_i K_jᵀ`` and ``P V_j`` are warp-level MMAs (:mod:`flashnb.kernels.tensorcore.mma`: inline PTX from
Numba, with simulator twins), and the same softmax becomes a real cost (notebook 12 measures it in the SASS).

**Fragments.**  Warp ``w`` owns ``MT`` tiles of 16 query rows (``Br = 16·MT·warps``).  Its ``Q_i`` rows are
loaded once into A fragments (``ldmatrix.x4``: lane ``l`` addresses row ``l % 16``, 16-byte chunk ``l // 16`` of
the k-step); each tile's ``K_j`` rows give the B fragments of ``S = Q_i K_jᵀ`` directly (``ldmatrix.x4`` without
``.trans``: K is row-major by key, which is B = Kᵀ by column); ``V_j`` gives those of ``P V_j`` through
``ldmatrix.x4.trans``.  The S accumulators of two neighbouring 8-key tiles, rounded to the input dtype and packed
in pairs, *are* the A fragment of ``P V_j`` (as in FlashAttention: P is rounded to fp16/bf16 before the second
matmul) -- P never leaves the registers.  float32 inputs run through TF32 (``m16n8k8.tf32``): Q, K, V are rounded
to TF32 (``cvt.rna``) when they are copied to shared memory, P when it is formed; its C and A layouts differ, so
the key order inside each 8-key step is permuted (``a0 = c0, a1 = c2, a2 = c1, a3 = c3``) and V's rows are read
in the same order (plain 32-bit loads: ``.trans`` moves 16-bit elements).

**Online softmax** (FA2 Alg. 1 lines 9-10) per row, in base 2: ``x = S·scale·log₂e``, ``m_i`` the running
max (a row lives in the 4 lanes of a quad: two ``shfl_xor``), ``P~ = exp2(x - m_i)`` (one MUFU.EX2 per
element), ``O~`` and the lane's partial ``l_i`` rescaled by ``exp2(m_old - m_i)``; the quad's partial row sums
are added only once, at the end (line 12), and ``L_i = (m_i + log₂ l_i)·ln 2``.

**Shared memory: swizzled, no bank conflicts.**  A row of ``Dp`` halves is ``Dp/8`` chunks of 16 bytes; with
rows of 128 bytes (``d = 64``) the 8 rows an ``ldmatrix`` matrix reads would all start in bank 0 -- 8-way
conflicts.  Chunk ``c`` of row ``r`` is stored at chunk ``c ^ f(r)`` (``f(r) = r mod 8`` for 8 or more chunks a
row; for 2 or 4, the rows that share a 128-byte line take different chunks), so the 8 rows of every matrix
cover all 32 banks (``flashnb profile fa2-tc``: 0 conflicts).  Rows are ``LD`` elements long, ``Dp``'s chunks
rounded up to a power of two (the XOR must stay inside the row).

**cp.async double buffering** (sm_80+, when a row of ``d`` elements is a whole number of 16-byte chunks):
while tile ``j`` is computed, ``K_{j+1}, V_{j+1}`` are already in flight into the other buffer
(``cp.async.cg`` of 16 bytes per lane; rows beyond ``N`` and chunks beyond ``d`` zero-filled by the instruction);
``cp.async.wait_group 1`` then a barrier make tile ``j`` visible.  Otherwise (``d`` not a multiple of 8 halves, or
of 4 floats; float32 inputs, which are rounded to TF32 on the way; sm_75, which has no cp.async) the copies are
plain loads and stores into one buffer.

**Features**: float16, bfloat16 (``storage=``; O in the same dtype, L float32) and float32 inputs (TF32: errors
of ~1e-3 where float32 gives ~1e-6; d <= 64 forward, d <= 32 backward, where the fragments fit the registers);
causal masks in both alignments (``diag``; tiles entirely above the diagonal are never visited, the mask runs
only on tiles that cross it or the end of the keys); ``Nq != Nk``; any ``d <= 128`` in half precision (padded
with zero columns to the MMA's k: 16 halves, 8 floats); partial tiles; grouped K/V heads (GQA/MQA, the product
kernel's policy: the backward's blocks loop over a K/V head's query heads, dK_j, dV_j summed on chip); attention
dropout (``dropout_p``, ``seed``, ``dropout_at``: the product kernel's Philox policy applied to the P fragments,
so both impls draw the same mask); attention modifiers and block masks (``score_mod`` on the S fragments,
forward and the backward's recomputation, with its derivative on dS; ``mask_mod`` through its block mask:
``EMPTY`` tiles never loaded, ``PARTIAL`` ones masked by the 64-bit element masks of the product kernel's
policies; the default tiles shrink to divide the mask's blocks; the forward prefetches the next visited tile, the
backward copies each visited Q tile alone).  Architectures: sm_80 and sm_90
(``mma.m16n8k16``, ``cp.async``); a float16 forward also for sm_75 (T4: two ``m16n8k8`` per k-step, plain copies).

Kernel ``"fa2_tc.forward"`` (:func:`make_forward`), the backward :mod:`flashnb.kernels.tensorcore.backward`;
launched as impl ``"fa2-tc"`` (:mod:`flashnb.kernels.launch.tensorcore`), stage 7.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, uint32

from ...common import NEG_INF, ONE, ZERO, storage_array_type
from ...registry import kernel_factory
from .. import policies
from ..policies import EMPTY, FULL, PARTIAL
from ..policies.tiles import heavy_first, kv_tile_range
from . import mma
from .fragments import _SHARED_TYPE, _SIGN, FULL_MASK, LN2, LOG2E, _make_policies
from .geometry import _archs, _configs, geometry
from .mma import SHARED_ALIGN

__all__ = ["make_forward"]

_A2 = "float32[:, ::1]"
_M = "uint8[:, :, ::1]"                  # the block mask's tile states (a 1x1x1 placeholder without one)


def _fwd_sig(storage="float16", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {h}, {h}, {_A2}, float32, int32, {_M}, {policies.DROPOUT_SIG})"


def _make_next_tile(tile_state):
    """``next_tile``: the block mask's walk over the K/V tiles (``tile_state``: its policy)."""

    @cuda.jit(device=True, inline="always")
    def next_tile(M, z, bi, j, n_tiles, lane):
        """The first K/V tile from ``j`` on that the block mask does not mark ``EMPTY`` (``n_tiles`` if none), and
        its state: every tile's state is read once, as the loop walks on."""
        st = int32(EMPTY)
        while j < n_tiles:
            st = tile_state(M, z, bi, j, lane)
            if st != EMPTY:
                break
            j += 1
        return j, st

    return next_tile


def _make_q_fragments(g, P, sparse, Br, Bc):
    """``q_fragments``: line 4, Q_i into shared memory (the first K_j, V_j in flight with it), then once into A
    fragments (sign-flipped for a negative scale); m_i, l_i and O~_i initialised."""
    MT, KD, ND, KN, QO, S0 = g["MT"], g["KD"], g["ND"], g["KN"], g["q_offset"], g["stage_offsets"][0]
    ASYNC = g["copy"] == "async"
    at, load_tile = P["at"], P["load_tile"]

    @cuda.jit(device=True, inline="always")
    def q_fragments(Q, Kz, Vz, sm, qa, o, m, lsum, z, i0, wr, lane, tid, Nq, Nk, j, n_tiles, flip):
        load_tile(Q[z], sm, QO, i0, Nq, Br, tid)        # line 4: Q_i (and the first K_j, V_j in flight with it)
        if ASYNC:
            mma.cp_async_commit()
            if j < n_tiles:
                first = j * Bc if sparse else 0
                load_tile(Kz, sm, S0, first, Nk, Bc, tid)
                load_tile(Vz, sm, S0 + KN, first, Nk, Bc, tid)
            mma.cp_async_commit()
            mma.cp_async_wait_group(1)                 # Q_i has landed (K_0, V_0 may still be in flight)
        cuda.syncthreads()
        for mt in range(MT):                           # Q_i's fragments, once: lane l addresses row l % 16
            for kk in range(KD):
                a0, a1, a2, a3 = mma.ldmatrix_x4(sm, QO + at(wr + 16 * mt + 8 * ((lane // 8) % 2), lane,
                                                             2 * kk + lane // 16))
                qa[mt, kk, 0] = a0 ^ flip
                qa[mt, kk, 1] = a1 ^ flip
                qa[mt, kk, 2] = a2 ^ flip
                qa[mt, kk, 3] = a3 ^ flip
            for h in range(2):
                m[mt, h] = NEG_INF
                lsum[mt, h] = ZERO
            for dn in range(ND):
                for c in range(4):
                    o[mt, dn, c] = ZERO
        cuda.syncthreads()                             # Q_i's space may now hold a K/V stage

    return q_fragments


def _make_scores(g, P):
    """``scores``: line 8, ``S_ij = Q_i K_jᵀ`` from Q_i's A fragments and K_j's B fragments (at ``kb``)."""
    MT, NB, KD = g["MT"], g["NB"], g["KD"]
    at, mma_k = P["at"], P["mma_k"]

    @cuda.jit(device=True, inline="always")
    def scores(sm, kb, qa, s, lane):
        for mt in range(MT):                           # line 8: S_ij = Q_i K_jᵀ
            for nb in range(NB):
                for c in range(4):
                    s[mt, nb, c] = ZERO
        for kk in range(KD):
            for nb in range(0, NB, 2):                 # two 8-key n-tiles per ldmatrix.x4 (both halves of the k-step)
                b0, b1, b2, b3 = mma.ldmatrix_x4(sm, kb + at(nb * 8 + 8 * (lane // 16), lane,
                                                          2 * kk + (lane // 8) % 2))
                for mt in range(MT):
                    s[mt, nb, 0], s[mt, nb, 1], s[mt, nb, 2], s[mt, nb, 3] = mma_k(
                        qa[mt, kk, 0], qa[mt, kk, 1], qa[mt, kk, 2], qa[mt, kk, 3], b0, b1,
                        s[mt, nb, 0], s[mt, nb, 1], s[mt, nb, 2], s[mt, nb, 3])
                    s[mt, nb + 1, 0], s[mt, nb + 1, 1], s[mt, nb + 1, 2], s[mt, nb + 1, 3] = mma_k(
                        qa[mt, kk, 0], qa[mt, kk, 1], qa[mt, kk, 2], qa[mt, kk, 3], b2, b3,
                        s[mt, nb + 1, 0], s[mt, nb + 1, 1], s[mt, nb + 1, 2], s[mt, nb + 1, 3])

    return scores


def _make_softmax(g, causal, dropout, score, allowed_bits, is_set, keep_bits, factor, SCORED, MASK_MOD):
    """``softmax``: lines 9-10, the online softmax of one tile's S fragments in base 2 (masks, ``score_mod``,
    dropout: the product kernel's policies), ``O~_i`` and ``l_i`` rescaled."""
    MT, NB, ND = g["MT"], g["NB"], g["ND"]

    @cuda.jit(device=True, inline="always")
    def softmax(masked, s, o, m, lsum, i0, wr, lane, Nk, diag, sl2, z, Nq, dst, st, asc, j0):
        g8 = lane // 4
        t4 = lane % 4
        for mt in range(MT):                           # lines 9-10: the online softmax, base 2
            r0 = i0 + wr + 16 * mt + g8                # this lane's rows r0, r0 + 8; columns j0 + 8nb + 2t + e
            allow0 = allowed_bits(z, r0, 8, j0 + 2 * t4, 8, 2, NB, Nq, Nk, st)       # mask_mod (PARTIAL tiles):
            allow1 = allowed_bits(z, r0, 8, j0 + 2 * t4 + 1, 8, 2, NB, Nq, Nk, st)   # bit h·NB + nb, per e
            for h in range(2):
                mx = NEG_INF
                lim = Nk - 1                           # masked: the row's last key (the end of the keys, the causal
                if causal:                             # diagonal) as an offset from this lane's first column
                    lim = min(lim, r0 + 8 * h + diag)
                lim -= j0 + 2 * t4
                for nb in range(NB):
                    for e in range(2):
                        x = s[mt, nb, 2 * h + e]
                        if SCORED:                     # score_mod of the scaled score, in base 2 from here on
                            x = score(x * asc, z, r0 + 8 * h, j0 + 8 * nb + 2 * t4 + e, Nq, Nk) * LOG2E
                        if masked and (nb * 8 + e > lim or
                                       (MASK_MOD and not is_set(allow0 if e == 0 else allow1, h * NB + nb))):
                            x = NEG_INF
                        s[mt, nb, 2 * h + e] = x
                        mx = max(mx, x)
                mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 1))    # a row lives in a quad of lanes
                mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 2))
                m_new = max(m[mt, h], mx * sl2 if mx != NEG_INF else NEG_INF)
                m_use = ZERO if m_new == NEG_INF else m_new        # a row with no key yet: no NaN
                alpha = mma.exp2(m[mt, h] - m_use)
                m[mt, h] = m_new
                ps = ZERO
                for nb in range(NB):
                    for e in range(2):
                        x = s[mt, nb, 2 * h + e]
                        if masked and x == NEG_INF:
                            p = ZERO                   # (not exp2(-inf·sl2): scale = 0 would make it a NaN)
                        else:
                            p = mma.exp2(x * sl2 - m_use)  # one FFMA and one MUFU.EX2 per score
                        s[mt, nb, 2 * h + e] = p
                        ps += p
                lsum[mt, h] = alpha * lsum[mt, h] + ps
                for dn in range(ND):
                    o[mt, dn, 2 * h] *= alpha
                    o[mt, dn, 2 * h + 1] *= alpha
            if dropout:                                # after l took the undropped P~: P~ ∘ Z / (1-p)
                for e in range(2):                     # this lane's rows g, g+8 and columns 8nb + 2t + e
                    keep = keep_bits(dst, z, i0 + wr + 16 * mt + g8, 8, j0 + 2 * t4 + e, 8, 2, NB, Nq, Nk)
                    for h in range(2):
                        for nb in range(NB):
                            s[mt, nb, 2 * h + e] *= factor(keep, h * NB + nb, dst)

    return softmax


def _make_pv(g, P, TF32):
    """``pv``: line 10, ``O~_i += P~_ij V_j`` with P~ straight from the S registers (V_j at ``kb + KN``)."""
    MT, ND, KV, LD, E, KN = g["MT"], g["ND"], g["KV"], g["LD"], g["E"], g["KN"]
    swz, at, mma_k, p_fragment = P["swz"], P["at"], P["mma_k"], P["p_fragment"]

    @cuda.jit(device=True, inline="always")
    def pv(sm, kb, s, o, lane):
        g8 = lane // 4
        t4 = lane % 4
        for kv in range(KV):                           # line 10: O~_i += P~_ij V_j, k-steps over the keys
            nb = kv * 2 if not TF32 else kv
            nb2 = nb + 1 if not TF32 else nb
            for dn in range(0, ND, 1 if TF32 else 2):
                if TF32:                               # V[2t], V[2t + 1] of column g: the permuted key order
                    vr = uint32(8 * kv + 2 * t4)
                    vc = uint32(2 * dn + g8 // 4)
                    v0 = sm[kb + KN + vr * uint32(LD) + ((vc ^ swz(vr)) * uint32(E)) + uint32(g8 % 4)]
                    v1 = sm[kb + KN + (vr + uint32(1)) * uint32(LD) + ((vc ^ swz(vr + uint32(1))) * uint32(E))
                            + uint32(g8 % 4)]
                    v2 = v0
                    v3 = v1
                else:                                  # ldmatrix.trans: keys 16kv + (0..15), 2 n-tiles of columns
                    v0, v1, v2, v3 = mma.ldmatrix_x4_trans(sm, kb + KN + at(16 * kv + 8 * ((lane // 8) % 2),
                                                                              lane, dn + lane // 16))
                for mt in range(MT):
                    a0, a1, a2, a3 = p_fragment(s[mt, nb, 0], s[mt, nb, 1], s[mt, nb, 2], s[mt, nb, 3],
                                                s[mt, nb2, 0], s[mt, nb2, 1], s[mt, nb2, 2], s[mt, nb2, 3])
                    o[mt, dn, 0], o[mt, dn, 1], o[mt, dn, 2], o[mt, dn, 3] = mma_k(
                        a0, a1, a2, a3, v0, v1, o[mt, dn, 0], o[mt, dn, 1], o[mt, dn, 2], o[mt, dn, 3])
                    if not TF32:
                        o[mt, dn + 1, 0], o[mt, dn + 1, 1], o[mt, dn + 1, 2], o[mt, dn + 1, 3] = mma_k(
                            a0, a1, a2, a3, v2, v3, o[mt, dn + 1, 0], o[mt, dn + 1, 1], o[mt, dn + 1, 2],
                            o[mt, dn + 1, 3])

    return pv


def _make_epilogue(g, from_f32):
    """``epilogue``: lines 12-15, ``O_i = O~_i / l_i`` (the quad's parts of l_i added first) and ``L_i``."""
    MT, ND, d = g["MT"], g["ND"], g["d"]

    @cuda.jit(device=True, inline="always")
    def epilogue(O, L, o, m, lsum, z, i0, wr, lane, Nq):
        g8 = lane // 4
        t4 = lane % 4
        for mt in range(MT):                           # lines 12-15
            for h in range(2):
                l = lsum[mt, h]
                l += cuda.shfl_xor_sync(FULL_MASK, l, 1)      # the quad's parts of l_i
                l += cuda.shfl_xor_sync(FULL_MASK, l, 2)
                row = i0 + wr + 16 * mt + g8 + 8 * h
                inv = ONE / l if l > ZERO else ZERO             # a row with no key: O = 0, L = -inf
                if row < Nq:
                    for dn in range(ND):
                        for e in range(2):
                            col = dn * 8 + 2 * t4 + e
                            if col < d:
                                O[z, row, col] = from_f32(o[mt, dn, 2 * h + e] * inv)
                    if t4 == 0:
                        L[z, row] = (m[mt, h] + float32(math.log2(l))) * LN2 if l > ZERO else NEG_INF

    return epilogue


@kernel_factory("fa2_tc.forward", stage="7", signature=_fwd_sig, configs=_configs(), archs=_archs,
                threads=lambda warps, **_: 32 * warps)
def make_forward(Br, Bc, d, warps, causal, storage="float16", arch=80, gqa=False, dropout=False, sparse=False,
                 score_mod=None, mask_mod=None, H=1):
    """FA2 Alg. 1 on tensor cores for one configuration; grid ``(Tr, BH)``, ``32·warps`` threads.  ``storage``:
    the dtype of Q, K, V, O in HBM; ``arch``: 80 (sm_80, sm_90) or 75 (sm_75, float16); ``gqa``: K, V have fewer
    heads than Q (query head ``z`` reads K/V head ``z // G``, the product kernel's policy); ``dropout``: the
    product kernel's Philox policy on the P fragments (the kernel's last twelve arguments, never read without);
    ``sparse``: the block mask ``M`` at these tiles (``EMPTY`` tiles skipped, ``PARTIAL`` ones ask ``mask_mod``; the
    next visited tile is prefetched as in the dense loop); ``score_mod``,
    ``mask_mod``, ``H``: the product kernel's modifier policies on the S fragments (``b = z // H``, ``h = z % H``).
    The phases of a tile are device functions of their own (:func:`_make_scores`, :func:`_make_softmax`,
    :func:`_make_pv`), built from the same policies."""
    g = geometry(storage, d, Br, Bc, warps, arch)
    MT, NB, ND, KD = g["MT"], g["NB"], g["ND"], g["KD"]
    ASYNC, TF32, KN, TOTAL = g["copy"] == "async", storage == "float32", g["KN"], g["total"]
    S0, S1 = g["stage_offsets"][0], g["stage_offsets"][-1]
    # region policies
    P = _make_policies(storage, g, arch)
    # endregion policies
    load_tile = P["load_tile"]
    SDT = _SHARED_TYPE[storage]
    SIGN = _SIGN[storage]
    kv_head = policies.gqa(gqa)[0]
    drop_state, keep_bits, factor = policies.dropout(dropout)
    H = policies.check_features(sparse, mask_mod, dropout, H, 2 * NB)   # bits: one (mt, e) row pair
    tile_state, is_set = policies.tile_state(sparse), policies.is_set
    score, allowed_bits, _ = policies.modifiers(score_mod, mask_mod, H)
    SCORED, MASK_MOD = score_mod is not None, mask_mod is not None
    next_tile = _make_next_tile(tile_state)
    q_fragments = _make_q_fragments(g, P, sparse, Br, Bc)
    scores = _make_scores(g, P)
    softmax = _make_softmax(g, causal, dropout, score, allowed_bits, is_set, keep_bits, factor, SCORED, MASK_MOD)
    pv = _make_pv(g, P, TF32)
    epilogue = _make_epilogue(g, P["from_f32"])

    @cuda.jit(device=True, inline="always")
    def kv_tile(j, jn, par, masked, n_tiles, Kz, Vz, sm, qa, s, o, m, lsum, i0, wr, lane, tid, Nk, diag, sl2, z, Nq,
                dst, st, asc):
        """One K/V tile (FA2 Alg. 1 lines 6-11); ``jn``: the next tile visited (``j + 1`` without a block mask),
        ``par``: the buffer tile ``j`` is in; ``masked`` (a constant at each call): the tile crosses the causal
        diagonal or the end of the keys, or is ``PARTIAL`` in the block mask ``st``.  ``asc``: ``|scale|`` (with a
        score_mod: its scores, then ``sl2 = 1``, base 2 already)."""
        j0 = j * Bc
        kb = S0 if par == 0 else S1                    # K_j at kb, V_j at kb + KN
        # region kv-load
        if ASYNC:                                      # lines 7-8, pipelined: the next tile flies while j computes
            if jn < n_tiles:
                nb_ = S1 if par == 0 else S0
                n0 = jn * Bc if sparse else j0 + Bc    # (the dense loop's own expression: the same code as ever)
                load_tile(Kz, sm, nb_, n0, Nk, Bc, tid)
                load_tile(Vz, sm, nb_ + KN, n0, Nk, Bc, tid)
                mma.cp_async_commit()
                mma.cp_async_wait_group(1)             # all but the newest group: tile j has landed
            else:
                mma.cp_async_wait_group(0)
        else:
            load_tile(Kz, sm, kb, j0, Nk, Bc, tid)
            load_tile(Vz, sm, kb + KN, j0, Nk, Bc, tid)
        cuda.syncthreads()                             # tile j visible to every warp
        # endregion kv-load
        scores(sm, kb, qa, s, lane)                    # line 8: S_ij = Q_i K_jᵀ
        softmax(masked, s, o, m, lsum, i0, wr, lane, Nk, diag, sl2, z, Nq, dst, st, asc, j0)   # lines 9-10
        pv(sm, kb, s, o, lane)                         # line 10: O~_i += P~_ij V_j
        cuda.syncthreads()                             # every warp is done with this buffer

    @cuda.jit
    def fa2_tc_forward(Q, K, V, O, L, scale, diag, M, threshold, inv_keep, seed_lo, seed_hi, rb, rstep, rsplit, rjump,
                       cb, cstep, csplit, cjump):
        sm = cuda.shared.array(TOTAL, SDT, alignment=SHARED_ALIGN)  # Q_i, then K_j and V_j per stage (swizzled)
        qa = cuda.local.array((MT, KD, 4), uint32)     # Q_i's A fragments (registers: constant indices only)
        s = cuda.local.array((MT, NB, 4), float32)     # S_ij, then P~_ij (C layout)
        o = cuda.local.array((MT, ND, 4), float32)     # O~_i (C layout)
        m = cuda.local.array((MT, 2), float32)         # m_i of rows g and g+8 of each m-tile (base 2, scaled)
        lsum = cuda.local.array((MT, 2), float32)      # this lane's part of l_i
        z = cuda.blockIdx.y
        bi = heavy_first(cuda.blockIdx.x, cuda.gridDim.x, causal)   # causal: the last Q block (the most tiles) first
        i0 = bi * Br
        tid = cuda.threadIdx.x
        lane = tid % 32
        wr = (tid // 32) * 16 * MT                     # the warp's first row in the block
        Nq = Q.shape[1]
        Nk = K.shape[1]
        Kz = K[kv_head(z, Q, K)]                       # GQA: the K/V head of query head z
        Vz = V[kv_head(z, Q, K)]
        flip = SIGN if scale < ZERO else uint32(0)     # a negative scale: Q negated, scores scaled by |scale|
        sl2 = abs(scale) * LOG2E                       # exp(scale·s) = exp2(s·|scale|·log2 e)
        asc = abs(scale)
        if SCORED:
            sl2 = ONE                                  # the modified scores are base 2 already
        dst = drop_state(threshold, inv_keep, seed_lo, seed_hi, rb, rstep, rsplit, rjump, cb, cstep, csplit, cjump)
        # line 5 (causal: no tile entirely above the diagonal); the leading n_full tiles need no mask
        n_tiles, n_full = kv_tile_range(i0, Br, Bc, Nq, Nk, diag, causal)
        j, st = 0, int32(FULL)                         # the first tile visited (with a block mask: not EMPTY)
        if sparse:
            j, st = next_tile(M, z, bi, 0, n_tiles, lane)
        q_fragments(Q, Kz, Vz, sm, qa, o, m, lsum, z, i0, wr, lane, tid, Nq, Nk, j, n_tiles, flip)   # line 4
        if sparse:                                     # line 6 over the block mask's tiles: EMPTY ones skipped
            par = 0
            while j < n_tiles:                         # (block-uniform: every warp reads the same states)
                jn, stn = next_tile(M, z, bi, j + 1, n_tiles, lane)    # the tile to prefetch
                if j < n_full and st != PARTIAL:
                    kv_tile(j, jn, par, False, n_tiles, Kz, Vz, sm, qa, s, o, m, lsum, i0, wr, lane, tid, Nk, diag,
                            sl2, z, Nq, dst, st, asc)
                else:
                    kv_tile(j, jn, par, True, n_tiles, Kz, Vz, sm, qa, s, o, m, lsum, i0, wr, lane, tid, Nk, diag,
                            sl2, z, Nq, dst, st, asc)
                j, st, par = jn, stn, 1 - par
        else:
            for j in range(n_full):                    # line 6: the tiles no mask touches ...
                kv_tile(j, j + 1, j % 2, False, n_tiles, Kz, Vz, sm, qa, s, o, m, lsum, i0, wr, lane, tid, Nk, diag,
                        sl2, z, Nq, dst, FULL, asc)
            for j in range(n_full, n_tiles):           # ... then those crossing the diagonal or the end of the keys
                kv_tile(j, j + 1, j % 2, True, n_tiles, Kz, Vz, sm, qa, s, o, m, lsum, i0, wr, lane, tid, Nk, diag,
                        sl2, z, Nq, dst, FULL, asc)
        epilogue(O, L, o, m, lsum, z, i0, wr, lane, Nq)   # lines 12-15

    return fa2_tc_forward
