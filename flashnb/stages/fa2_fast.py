"""Stage 6 -- from readable to fast: the FA2 forward (FA2 Alg. 1) and backward (Alg. 2) tuned against their SASS.

Same algorithm, grid ``(Tr, BH)``, split-Q warps and register micro-tiles as :mod:`flashnb.stages.fa2` (stage 4,
kept readable); what changes is *how* each thread's share of the work reaches the FP32 units.  Every change
answers a finding of the stage-4 audit (``flashnb sass fa2.forward``, ``flashnb profile fa2``):

1. **Registers, not the stack.**  ``d`` (padded to ``Dp``), ``Br``, ``Bc`` and the micro-tile ``TM × TN``
   are closure constants of the factory, and the per-lane arrays (``S``, ``O~``, ``m``, ``l``, the loaded
   ``q``/``k`` vectors, ``P~``) are only ever indexed by ``range(CONST)`` loop variables.  LLVM unrolls
   those loops completely and SROA turns the arrays into registers: no ``ldl``/``stl`` anywhere in the
   kernel.  The two loops that stay loops -- over ``k`` in line 8 and over the 8 source lanes in line 10 --
   count in 32-bit unsigned integers (``while k < uint32(Dp)``): numba's ``range`` keeps a 64-bit counter
   and its iterator's bookkeeping, about 10 integer instructions per iteration of the hot loop.
2. **128-bit shared loads.**  ``Q_i`` and ``K_j`` are stored *row-major* (stage 4 stores them transposed);
   in each step of line 8 a lane reads 4 consecutive ``k`` of each of its ``TM`` query rows and ``TN`` key
   rows -- one ``LDS.128`` each, feeding ``4·TM·TN`` FFMAs.  (The PTX has four 32-bit ``ld.shared``; ptxas
   merges them, because it places the shared arrays itself and so knows the address is 16-byte aligned:
   row lengths and offsets must stay multiples of 4 floats.)  Lane ``(lr, lc)`` of warp ``w`` owns query rows
   ``w·TM·LR + lr + LR·a`` and key columns ``lc + LC·b`` (as stage 4) and the head-dim columns
   ``32·c + 4·lc + t`` of ``O~`` (4 consecutive per 32), so line 10 reads ``V_j`` 4 floats at a time too.
3. **Padding instead of transposed stores: no bank conflicts.**  Rows of ``Q_i`` and ``K_j`` are ``Dp + 4``
   floats long (``PAD``), so row ``r`` starts in bank ``4r mod 32``: the 4 rows that a warp's row groups read
   at once, and the 8 key rows its column lanes read at once, fall in distinct banks.  The copies into
   shared memory are plain row copies: consecutive threads, consecutive words (conflict-free) and
   consecutive floats of HBM (ideal sectors).  Stage 4's transposed stores are 32-way conflicts.
4. **Unsigned shared indices.**  numba fixes up negative indices (``if i < 0: i += n``) for signed
   integers; with ``uint32`` indices that code disappears and each load is a base register plus an
   immediate offset.  (Never compare a ``uint`` with a signed int in numba: the comparison is done in
   float64 -- the PTX guard's ``.f64`` check catches it.)
5. **Coalesced epilogue.**  With 4 consecutive columns per lane, storing ``O_i`` straight to HBM would touch
   4x the ideal sectors; ``O_i`` is staged in ``Q_i``'s shared space (rows of odd length ``Dp + 1``: the 32
   lanes' stores hit 32 banks) and written row by row (Alg. 1 line 13, ideal sectors).
6. **Cheap tile loads.**  A thread keeps its columns and steps its rows by a constant, and a tile inside the
   sequence (with ``d = Dp``) is copied without a bounds test: a full K/V tile compiles to an unrolled run of
   LDG + STS pairs, about 4 instructions per float (stage 4's K_j loop at d = 64: 238 SASS instructions per 4
   floats, the 64-bit index arithmetic of ``e // d``, ``e % d`` and the negative-index fix-ups).  Only
   the last tile is checked and zero-filled.  As in stage 4, the causal/``Nk`` mask runs only on tiles that
   cross the diagonal or the end of the keys, and tiles entirely above the (bottom-right aligned) diagonal
   are never visited.

``P~_ij`` still travels from its owner lane by ``shfl_sync`` (never through shared memory), and the row max
and row sum are shuffle butterflies inside the 8 lanes of a row group: no warp needs another warp's result,
so the block barriers are the two around the K/V tile load, plus two around the ``O_i`` staging.

What the compiler makes of it (``flashnb sass fa2_fast.forward --config '{"Br": 64, "Bc": 32, "warps": 2,
"d": 64, "causal": false}'``, sm_90): hot loop (line 10) 84.8% FFMA, only ``LDS.128``; line 8's loop 87%.
At d = 128 (``{"Br": 64, "Bc": 64, "warps": 4, "d": 128, "causal": false, "dynamic": true}``, technique 7):
hot loop 87.5%, line 8 87.1%, only ``LDS.128``, no local memory (the static fallback Br = 24, Bc = 32: 84.6%
and 77%).  Stage 4 (its default tiles): hot loop 65% at d = 64 and 56% at d = 128, ``LDS.32`` only, local
memory in the hot loop.

7. **Dynamic shared memory beyond 48 KiB, where it pays**.  A block may declare only 48 KiB of
   *static* shared memory; beyond that (up to 163 KiB on sm_80, 227 KiB on sm_90) it takes *dynamic* shared
   memory, which a GPU grants a kernel only after the driver opt-in (``common.allow_dynamic_shared``:
   ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``).  ``make_forward(..., dynamic=True)`` declares one
   dynamic array and carves ``Q_i, K_j, V_j`` out of it at constant offsets (``KO``, ``VO``, multiples of 4
   floats).  Offsets, not slices: numba clamps a slice's bounds (``sm[QN:QN + KN]``) against the array's
   run-time length, so ptxas no longer knows the tile starts 16-byte aligned and emits ``LDS.32`` -- the hot
   loop at d = 128, Br = Bc = 32 was 74.9% FFMA with 64 ``LDS.32`` that way, 86.5% with 16 ``LDS.128`` with
   offsets (with or without ``alignment=16`` on the declaration).  It is a compile-time flag,
   used only where the tiles need more than 48 KiB: at d = 64 (Br = 64, Bc = 32) the dynamic build's hot loop
   is 305 instructions at 83.9% FFMA and 168 registers, the static one's 302 at 84.8% and 164 (sm_90).

   Where it pays, by the SASS time model (``sass_model.forward_time("fa2_fast.forward", BH, 4096, 4096, d,
   **tiles)``, H100 SXM, the FA2 paper's shapes: BH = 64 at d = 128, 128 at d = 64; % of the FP32 peak, the
   binding pipe, blocks per SM):

   ===========================  =========  =====================================================
   d = 128 tiles                shared     model
   ===========================  =========  =====================================================
   Br = 24, Bc = 32, 2 warps    45,952 B   45.8 % (mio, 4); causal 43.7 % -- the static fallback
   Br = Bc = 32, 2 warps        50,176 B   54.6 % (mio, 4); causal 52.4 %
   Br = 64, Bc = 32, 4 warps    67,072 B   54.8 % (mio, 3)
   Br = 32, Bc = 64, 2 warps    83,456 B   64.0 % (mio, 2: four warps per SM)
   **Br = Bc = 64, 4 warps**    100,352 B  **66.4 %** (issue, 2); causal 63.5 %  -- the default
   Br = 128, Bc = 64, 8 warps   134,144 B  65.0 % (issue, 1)
   ===========================  =========  =====================================================

   With ``TN = Bc/8 = 8`` key columns per lane, line 8 does 128 FFMAs per 12 ``LDS.128`` (64 per 8 at
   ``TN = 4``): the shared pipe stops binding; ``Br = 64`` halves the K/V re-reads of Br = 32, and two blocks of
   four warps keep as many warps per SM (8) as four blocks of two.  ptxas (``flashnb inspect --kernel
   fa2_fast.forward``): 168 registers on sm_90 (214, causal 248, on sm_80), no spills, no stack.  On an
   A100 (sm_80, 164 KiB per SM) the default leaves one block (four warps) per SM -- the model, which assumes
   every latency hidden, still says 90.5 % there (FP32-bound); only a measurement can say what four warps per
   SM really give.  At d = 64 dynamic shared memory does not pay: Br = Bc = 64 with two warps would give 61.0 %
   (dynamic, 51,200 B) at 254 registers, one short of the limit, against the static default's 59.5 % (issue, 6
   blocks per SM); four warps give 52.9 %.  The backward stays static (no time model for it yet).

   :func:`forward` runs the dynamic kernel after the opt-in, up to the device's opt-in limit
   (``common.shared_optin_limit``; explicit tiles beyond it are a ValueError naming tiles and limit).  When the
   device refuses the *default* tiles (its limit, or the opt-in call), it falls back to the static defaults
   (``default_tiles(d, static=True)``) with a ``RuntimeWarning``, and :data:`last_forward` says what ran.

**The backward** (FA2 Alg. 2, :func:`make_backward`) applies the same six techniques to stage 4's
algorithm and grid ``(Tc, BH)``: each thread block keeps ``K_j, V_j`` and streams ``Q_i, dO_i, L_i, D_i``
(stage 4's preprocessing kernel computes ``D = rowsum(dO ∘ O)``); the warps split the ``Bc`` key rows.

* Lines 10 and 13 (``Sᵀ = K_j Q_iᵀ``, ``dPᵀ = V_j dO_iᵀ``) are one loop over ``k`` (4 per step, ``uint32``):
  lane ``(lr, lc)`` reads its ``TM`` key rows of ``K_j`` and ``V_j`` and its ``TN`` query rows of ``Q_i`` and
  ``dO_i`` with one ``LDS.128`` each (all four tiles row-major in rows of ``Dp + 4``: no bank conflicts) and
  does ``8·TM·TN`` FFMAs on a register micro-tile of each.
* Lines 11 and 14 (``P = exp(scale·S - L)``, ``dS = P ∘ (dP - D)``) stay in registers; the mask (padded rows,
  keys beyond ``Nk``, the causal diagonal) runs only on tiles that cross an edge.
* Lines 12 and 16 (``dV_j += Pᵀ dO_i``, ``dK_j += dSᵀ Q_i``) are the forward's line-10 loop twice over: ``P`` and
  ``dS`` travel from their owner lane by ``shfl_sync``, and one ``LDS.128`` of a row of ``dO_i`` (or ``Q_i``)
  feeds ``4·TM`` FFMAs into the ``TM × DN`` register tiles of ``dV_j`` (``dK_j``), columns ``32·c + 4·lc + t``.
* Line 15 (``dQ_i += dS K_j``) needs every warp's ``dS``: it goes to shared memory once per tile (row-major,
  rows of ``Bc + 4`` or ``Bc + 8`` floats, an odd number of 16-byte chunks: the stores are conflict-free), then
  each warp computes ``Br/warps`` whole rows of ``dQ_i`` in registers -- ``dS`` 4 keys at a time by one
  broadcast ``LDS.128``, ``K_j`` at columns ``lane + 32·e`` -- and adds them into HBM with atomics whose 32 lanes
  hit 32 consecutive floats (ideal sectors).
* Line 18: ``dK_j, dV_j`` are staged in ``K_j``'s and ``V_j``'s space (rows of odd length ``Dp + 1``) and
  stored row by row, as the forward's ``O_i``.

What the compiler makes of it (``flashnb sass fa2_fast.backward --config '{"Br": 32, "Bc": 32, "warps": 2,
"d": 64, "causal": false}'``, sm_90; the three loops with FFMAs are the innermost loops the tool lists): lines
10/13 84.8% FFMA, lines 12/16 (the hot loop) 82.6%, line 15 80.0%, only ``LDS.128`` in the first two (line 15
adds 8 ``LDS.32`` of ``K_j`` per 16 ``LDS.128``).  At d = 128 (``Br = 16, Bc = 24``: ``K_j, V_j, Q_i, dO_i`` in
padded rows fill 43 KiB) 73.8%, 85.0% and 80.0%.  Counted statically, the whole tile loop of line 8 is 21.5%
(d = 64) and 18.3% (d = 128) FFMA: its body also holds both versions of each tile load, the masked and unmasked
exponentials and the ``TQ·E`` atomics (unsigned indices, the ``col < d`` test compiled out when ``d = Dp``),
while the three inner loops run ``Dp/4``, 8 and ``Bc/4`` times per tile.
``flashnb inspect --kernel fa2_fast.backward --cc 9.0``: no spills, no stack; 188 registers at d = 64 (244
causal), 220 at d = 128 (212 causal), 160 at d = 32; static shared memory 23,296 B (d = 32), 39,680 B (d = 64),
44,160 B (d = 128).

Kernels: :func:`make_forward` (``"fa2_fast.forward"``) and :func:`make_backward` (``"fa2_fast.backward"``),
each composed of the device-function blocks of :mod:`flashnb.kernels.simt.blocks` (tile loads, the ``S = Q_i K_jᵀ``
micro-tile, the online-softmax update, ``P~ V_j``, the epilogues; the backward's phases), which the product kernels
(:mod:`flashnb.kernels.launch.flash`) compose too, with their feature policies.
Impl ``"fa2-fast"``: this forward and this backward.  Its options ``Br, Bc, warps`` go to both, as for stage 4
(FA2 names the tiles alike in Alg. 1 and Alg. 2); the backward's defaults are :func:`bwd_default_tiles`, and
tiles that suit the forward but not the backward (``Bc`` a multiple of ``4·warps``, ``Br`` of 8 and of
``warps``, 48 KiB) are refused by the backward with a ValueError naming them.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from ..common import (
    NEG_INF,
    ZERO,
    allow_dynamic_shared,
    causal_diag,
    cdiv,
    check_shared_fit,
    empty,
    launch,
    opt_in_or_fall_back,
    shared_optin_limit,
    warn_fallback,
)
from ..kernels.policies.tiles import heavy_first, kv_tile_count, q_tile_range
from ..kernels.simt import blocks
from ..kernels.simt.blocks import (  # noqa: F401  (the geometry is stage 6's public API)
    LC,
    LR,
    PAD,
    VEC,
    bwd_geometry,
    bwd_shared_bytes,
    geometry,
    needs_dynamic,
    shared_bytes,
)
from ..registry import kernel_factory, register_impl
from . import fa2

__all__ = ["make_forward", "make_backward", "forward", "backward", "model_forward", "model_backward", "default_tiles",
           "bwd_default_tiles", "geometry", "bwd_geometry", "shared_bytes", "bwd_shared_bytes", "needs_dynamic",
           "DESIGN_OPTIN_BYTES", "last_forward", "LR", "LC", "VEC", "PAD"]

_A3 = "float32[:, :, ::1]"
_A2 = "float32[:, ::1]"
_FWD_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, float32, int32)"
_BWD_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, {_A3}, {_A3}, float32, int32)"

# Tiles per head-dim class, chosen with `flashnb sass` (FFMA share of both inner loops) and `flashnb inspect`
# (registers, no spills, static shared memory <= 48 KiB).  Two warps: TM = Br/8 rows × TN = Bc/8 columns.
# d = 128: Br = Bc = 64 with four warps (TM = 4, TN = 8) needs 100,352 B (over 48 KiB): dynamic shared memory with
# the driver opt-in (the module docstring has the model's numbers); where the device (or the opt-in call) refuses
# it, the launcher falls back to _STATIC_DEFAULTS (see forward()).
_DEFAULTS = {32: dict(Br=64, Bc=32, warps=2), 64: dict(Br=64, Bc=32, warps=2), 128: dict(Br=64, Bc=64, warps=4)}
# The largest default tiles that fit in 48 KiB of static shared memory, per head-dim class.
_STATIC_DEFAULTS = {32: dict(Br=64, Bc=32, warps=2), 64: dict(Br=64, Bc=32, warps=2),
                    128: dict(Br=24, Bc=32, warps=2)}
#: Opt-in limit the default tiles are chosen (and the model's tiles checked) against: the smaller of sm_80's
#: (163 KiB) and sm_90's (227 KiB).  A launch checks the device's own (``common.shared_optin_limit``).
DESIGN_OPTIN_BYTES = 163 * 1024
#: What each :func:`forward` launch ran with: ``dict(d=, Br=, Bc=, warps=, dynamic=, shared_bytes=,
#: fallback=None or the reason it fell back to static tiles)``; the last one is ``last_forward``.
last_forward: dict = {}
# The backward's (FA2 Alg. 2: Br query rows per Q tile, Bc key rows per thread block; the warps split the keys).
_BWD_DEFAULTS = {32: dict(Br=32, Bc=32, warps=2), 64: dict(Br=32, Bc=32, warps=2), 128: dict(Br=16, Bc=24, warps=2)}


def default_tiles(d: int, static: bool = False) -> dict:
    """The default ``Br, Bc, warps`` for head dim ``d`` (the table for the smallest listed d >= d); ``static``:
    the largest ones within 48 KiB of static shared memory (the fallback when dynamic shared memory is refused)."""
    table = _STATIC_DEFAULTS if static else _DEFAULTS
    for dmax in sorted(table):
        if d <= dmax:
            return dict(table[dmax])
    raise ValueError(f"head dim d must be <= {max(table)}, got {d}")


def _configs():
    """What the PTX guard compiles: the default tiles of every head-dim class (causal on and off; dynamic
    shared memory where they need more than 48 KiB), the static fallback at d = 128, odd head dims (d = 20, 1;
    d = 70 pads to Dp = 96, which 64 threads load with the general loop), four warps."""
    return ([dict(**t, d=d, causal=c, dynamic=needs_dynamic(**t, d=d))
             for d, c in ((32, False), (64, False), (64, True), (128, False), (128, True)) for t in [default_tiles(d)]]
            + [dict(**default_tiles(128, static=True), d=128, causal=c, dynamic=False) for c in (False, True)]
            + [dict(Br=32, Bc=32, d=20, warps=2, causal=True, dynamic=False),
               dict(Br=64, Bc=32, d=1, warps=4, causal=False, dynamic=False),
               dict(Br=24, Bc=32, d=70, warps=2, causal=True, dynamic=False)])


def _dynamic_bytes(Br, Bc, d, warps, dynamic=False, **_):
    """Dynamic shared memory a launch of this configuration asks for (0 for a static kernel)."""
    return shared_bytes(Br, Bc, d, warps) if dynamic else 0


@kernel_factory("fa2_fast.forward", stage="6", signature=_FWD_SIG, configs=_configs(),
                threads=lambda warps, **_: 32 * warps, dynamic_shared=_dynamic_bytes)
def make_forward(Br, Bc, d, warps, causal, dynamic=False):
    """FA2 Alg. 1 for one (Br, Bc, d, warps, causal); grid ``(Tr, BH)``, block ``32·warps`` threads, built from
    the blocks of :mod:`flashnb.kernels.simt.blocks`.  With ``dynamic`` the kernel declares one *dynamic* shared array
    (launched with :func:`shared_bytes` dynamic bytes) carved into ``Q_i, K_j, V_j``: what lets a block use more
    than the 48 KiB of static shared memory."""
    g = geometry(Br, Bc, d, warps)
    TM, TN, DN, Dp, NT = g["TM"], g["TN"], g["DN"], g["Dp"], g["threads"]
    LD = Dp + PAD                                       # row length of Q_i, K_j in shared memory
    QN, KN, VN = Br * LD, Bc * LD, Bc * Dp              # shared array sizes (floats)
    KO, VO = (QN, QN + KN) if dynamic else (0, 0)       # where K_j, V_j start in their array
    load_tile = blocks.make_load_tile(d, Dp, NT)
    qk, visible = blocks.make_qk(TM, TN, Dp, LD), blocks.make_visible(causal)
    softmax_update, pv = blocks.make_softmax_update(TN, DN), blocks.make_pv(TM, TN, DN // VEC, Dp)
    epilogue = blocks.make_forward_epilogue(Br, TM, DN // VEC, Dp, d, NT)

    @cuda.jit
    def fa2_fast_forward(Q, K, V, O, L, scale, diag):
        if dynamic:                                    # (a compile-time constant: one branch is compiled)
            Qs = cuda.shared.array(0, float32)         # dynamic: QN + KN + VN floats (given at launch)
            Ks = Qs                                    # K_j from element KO on, V_j from VO on (no slices:
            Vs = Qs                                    # their clamped bounds hide the 16-byte alignment)
        else:
            Qs = cuda.shared.array(QN, float32)        # Q_i: rows of LD = Dp + 4 floats; at the end O_i
            Ks = cuda.shared.array(KN, float32)        # K_j: rows of LD floats
            Vs = cuda.shared.array(VN, float32)        # V_j: rows of Dp floats (zero-padded beyond d)
        S = cuda.local.array((TM, TN), float32)        # registers (constant indices only)
        Oi = cuda.local.array((TM, DN), float32)
        m = cuda.local.array(TM, float32)
        l = cuda.local.array(TM, float32)
        z = cuda.blockIdx.y
        i0 = heavy_first(cuda.blockIdx.x, cuda.gridDim.x, causal) * Br  # causal: the heaviest Q block first
        tid = cuda.threadIdx.x
        lane = tid % 32
        lr = lane // LC
        lc = lane % LC
        rw = (tid // 32) * (TM * LR) + lr              # this lane's rows: rw + LR·a (key columns: lc + LC·b)
        qrow, kcol = uint32(rw * LD), uint32(KO + lc * LD)              # unsigned shared offsets
        vcol, lane8 = uint32(lc * VEC), uint32(lr * LC)                 # O~ columns; the row group's first lane
        Nq = Q.shape[1]
        Nk = K.shape[1]
        load_tile(Q, Qs, 0, LD, z, i0, Nq, Br, i0 + Br <= Nq, tid)      # line 4: Q_i once
        for a in range(TM):                            # line 5: O~ = 0, l = 0, m = -inf
            m[a] = NEG_INF
            l[a] = ZERO
            for c in range(DN):
                Oi[a, c] = ZERO
        n_tiles = kv_tile_count(i0, Br, Bc, Nq, Nk, diag, causal)      # causal: no tile above the diagonal
        for jt in range(n_tiles):                      # line 6
            j0 = jt * Bc
            full = j0 + Bc <= Nk
            cuda.syncthreads()                         # every warp is done with K_{j-1}, V_{j-1}
            load_tile(K, Ks, KO, LD, z, j0, Nk, Bc, full, tid)          # line 7: K_j, V_j
            load_tile(V, Vs, VO, Dp, z, j0, Nk, Bc, full, tid)
            cuda.syncthreads()
            qk(Qs, Ks, S, qrow, kcol)                  # line 8: S = Q_i K_jᵀ, LDS.128 loads
            crossing = not full or (causal and j0 + Bc - 1 > i0 + diag)
            for a in range(TM):                        # line 9: the mask only on tiles that cross an edge
                row = i0 + rw + LR * a
                mx = NEG_INF
                for b in range(TN):
                    s = scale * S[a, b]
                    if crossing and not visible(row, j0 + lc + LC * b, Nk, diag):
                        s = NEG_INF
                    S[a, b] = s
                    mx = max(mx, s)
                softmax_update(S, m, l, Oi, a, mx)         # m_new, P~ = exp(S - m_new), l; O~ *= e^(m_old - m_new)
            pv(Vs, S, Oi, lane8, vcol, VO)             # line 10: O~ += P~ V_j
        epilogue(Qs, O, L, Oi, m, l, z, i0, rw, lc, vcol, tid, Nq)     # lines 12-14

    return fa2_fast_forward


# --------------------------------------------------------------------------- backward kernel (FA2 Alg. 2)


def bwd_default_tiles(d: int) -> dict:
    """The backward's default ``Br, Bc, warps`` for head dim ``d``."""
    for dmax in sorted(_BWD_DEFAULTS):
        if d <= dmax:
            return dict(_BWD_DEFAULTS[dmax])
    raise ValueError(f"head dim d must be <= {max(_BWD_DEFAULTS)}, got {d}")


def _bwd_configs():
    """What the PTX guard compiles: default tiles per head-dim class (causal on and off), odd head dims
    (d = 20 with one warp; d = 70: Dp = 96, which 64 threads load with the general loop)."""
    return ([dict(**bwd_default_tiles(d), d=d, causal=c) for d, c in ((32, False), (64, False), (64, True),
                                                                       (128, False), (128, True))]
            + [dict(Br=16, Bc=8, d=20, warps=1, causal=True), dict(Br=16, Bc=16, d=70, warps=2, causal=False)])


@kernel_factory("fa2_fast.backward", stage="6", signature=_BWD_SIG, configs=_bwd_configs(),
                threads=lambda warps, **_: 32 * warps)
def make_backward(Br, Bc, d, warps, causal):
    """FA2 Alg. 2 for one (Br, Bc, d, warps, causal); grid ``(Tc, BH)``, block ``32·warps`` threads, built from
    the blocks of :mod:`flashnb.kernels.simt.blocks`."""
    g = bwd_geometry(Br, Bc, d, warps)
    TM, TN, DN, Dp, TQ, E, NT = g["TM"], g["TN"], g["DN"], g["Dp"], g["TQ"], g["E"], g["threads"]
    LD = Dp + PAD                                       # row length of K_j, V_j, Q_i, dO_i in shared memory
    LS = blocks.ds_row(Bc)                              # row length of dS_ij
    KN, QN, SN = Bc * LD, Br * LD, Br * LS              # shared array sizes (floats)
    load_tile, load_stats = blocks.make_load_tile(d, Dp, NT), blocks.make_load_stats(Br, NT)
    qk_dp = blocks.make_qk_dp(TM, TN, Dp, LD)
    dv_dk, dq = blocks.make_dv_dk(TM, TN, DN // VEC, LD), blocks.make_dq(TQ, E, Bc, LD, LS, d, Dp)
    epilogue = blocks.make_backward_epilogue(Bc, TM, DN // VEC, Dp, d, NT)

    @cuda.jit
    def fa2_fast_backward(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag):
        Ks = cuda.shared.array(KN, float32)            # K_j (at the end: dK_j), rows of LD = Dp + 4 floats
        Vs = cuda.shared.array(KN, float32)            # V_j (at the end: dV_j)
        Qs = cuda.shared.array(QN, float32)            # Q_i
        dOs = cuda.shared.array(QN, float32)           # dO_i
        dSs = cuda.shared.array(SN, float32)           # dS_ij, row-major: the one exchange between warps
        Ls = cuda.shared.array(Br, float32)
        Ds = cuda.shared.array(Br, float32)
        S = cuda.local.array((TM, TN), float32)        # Sᵀ, then Pᵀ (registers: constant indices only)
        dP = cuda.local.array((TM, TN), float32)       # dPᵀ, then dSᵀ
        dKj = cuda.local.array((TM, DN), float32)
        dVj = cuda.local.array((TM, DN), float32)
        z = cuda.blockIdx.y
        j0 = cuda.blockIdx.x * Bc
        tid = cuda.threadIdx.x
        lane = tid % 32
        lr = lane // LC
        lc = lane % LC
        c0 = (tid // 32) * (TM * LR) + lr              # this lane's key rows: c0 + LR·a (query columns lc + LC·b)
        krow, qcol = uint32(c0 * LD), uint32(lc * LD)                   # unsigned shared offsets
        vcol, lane8 = uint32(lc * VEC), uint32(lr * LC)                 # dK_j, dV_j columns; the row group's first
        Nq = Q.shape[1]
        Nk = K.shape[1]
        kfull = j0 + Bc <= Nk
        load_tile(K, Ks, 0, LD, z, j0, Nk, Bc, kfull, tid)              # Alg. 2 line 6: K_j, V_j once
        load_tile(V, Vs, 0, LD, z, j0, Nk, Bc, kfull, tid)
        for a in range(TM):                            # line 7: dK_j = dV_j = 0 (registers)
            for c in range(DN):
                dKj[a, c] = ZERO
                dVj[a, c] = ZERO
        i_first, _, n_i = q_tile_range(j0, Br, Bc, Nq, diag, causal)   # causal: no Q block before key j0
        for it in range(i_first, n_i):                 # line 8
            i0 = it * Br
            qfull = i0 + Br <= Nq
            cuda.syncthreads()                         # every warp is done with Q_{i-1}, dO_{i-1}, dS
            load_tile(Q, Qs, 0, LD, z, i0, Nq, Br, qfull, tid)          # line 9: Q_i, dO_i, L_i, D_i
            load_tile(dO, dOs, 0, LD, z, i0, Nq, Br, qfull, tid)
            load_stats(L, D, Ls, Ds, z, i0, Nq, tid)
            cuda.syncthreads()
            qk_dp(Ks, Vs, Qs, dOs, S, dP, krow, qcol)  # lines 10, 13: Sᵀ = K_j Q_iᵀ, dPᵀ = V_j dO_iᵀ
            crossing = not (qfull and kfull) or (causal and j0 + Bc - 1 > i0 + diag)
            for b in range(TN):                        # line 11: P = exp(scale·S - L); line 14: dS = P∘(dP - D)
                r = lc + LC * b
                Lr = Ls[r]
                Dr = Ds[r]
                for a in range(TM):
                    pv = ZERO
                    if crossing:                       # padded rows (L = -inf), keys beyond Nk, the causal mask
                        key = j0 + c0 + LR * a
                        if Lr != NEG_INF and key < Nk and not (causal and key > i0 + r + diag):
                            pv = float32(math.exp(scale * S[a, b] - Lr))
                    else:
                        pv = float32(math.exp(scale * S[a, b] - Lr))
                    S[a, b] = pv
                    dP[a, b] = pv * (dP[a, b] - Dr)
                    dSs[uint32(r * LS + c0 + LR * a)] = dP[a, b]      # for line 15
            dv_dk(dOs, Qs, S, dP, dKj, dVj, lane8, vcol)   # lines 12, 16: dV_j += Pᵀ dO_i, dK_j += dSᵀ Q_i
            cuda.syncthreads()                         # dS_ij complete (every warp wrote its key columns)
            dq(dSs, Ks, dQ, z, i0, (tid // 32) * TQ, lane, scale, qfull, Nq)     # line 15: dQ_i += dS_ij K_j
        epilogue(Ks, Vs, dK, dV, dKj, dVj, z, j0, c0, vcol, tid, scale, Nk)   # line 18: dK_j, dV_j

    return fa2_fast_backward


# --------------------------------------------------------------------------- launchers


def _tiles(d, Br, Bc, warps, optin=DESIGN_OPTIN_BYTES, static=False):
    """Validated tiles (``static``: the static defaults) with ``dynamic`` (> 48 KiB: dynamic shared memory, up
    to ``optin`` bytes; more is a ValueError naming the tiles and the limit)."""
    t = default_tiles(d, static)
    for name, value in (("Br", Br), ("Bc", Bc), ("warps", warps)):
        if value is not None:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            t[name] = int(value)
    geometry(t["Br"], t["Bc"], d, t["warps"])
    check_shared_fit("fa2-fast forward", f"Br={t['Br']}, Bc={t['Bc']} at d={d}",
                     shared_bytes(t["Br"], t["Bc"], d, t["warps"]), "choose smaller Br/Bc", optin=optin)
    t["dynamic"] = needs_dynamic(t["Br"], t["Bc"], d, t["warps"])
    return t


def forward(q, k, v, *, causal=False, scale, Br=None, Bc=None, warps=None):
    """Device arrays in, ``(O, L)`` out (FA2 Alg. 1); ``Br, Bc, warps`` default to :func:`default_tiles`.

    Tiles over 48 KiB of shared memory run the dynamic-shared-memory kernel, after the driver opt-in
    (``common.allow_dynamic_shared``), up to the device's opt-in limit (``common.shared_optin_limit``; tiles
    given beyond it are a ValueError).  When the *default* tiles need more than the device allows, or the
    opt-in call fails, the launch falls back to :func:`default_tiles` ``(d, static=True)`` with a
    ``RuntimeWarning``; :data:`last_forward` records what ran and why."""
    global last_forward
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    given = not (Br is None and Bc is None and warps is None)
    optin = shared_optin_limit()
    fallback = None
    try:
        t = _tiles(d, Br, Bc, warps, optin)
    except ValueError as exc:
        if given or not needs_dynamic(**default_tiles(d), d=d):
            raise
        t, fallback = _tiles(d, None, None, None, optin, static=True), str(exc)
    nbytes = shared_bytes(t["Br"], t["Bc"], d, t["warps"])
    kernel = make_forward(t["Br"], t["Bc"], d, t["warps"], bool(causal), t["dynamic"])
    if t["dynamic"]:
        refused = opt_in_or_fall_back("fa2-fast forward", kernel, _FWD_SIG, nbytes, t, d, given, allow_dynamic_shared)
        if refused:
            fallback = refused
            t = _tiles(d, None, None, None, optin, static=True)
            nbytes = shared_bytes(t["Br"], t["Bc"], d, t["warps"])
            kernel = make_forward(t["Br"], t["Bc"], d, t["warps"], bool(causal), False)
    if fallback:
        warn_fallback("fa2-fast forward", d, fallback, t)
    last_forward = dict(d=d, Br=t["Br"], Bc=t["Bc"], warps=t["warps"], dynamic=t["dynamic"], shared_bytes=nbytes,
                        fallback=fallback)
    O = empty((BH, Nq, d))
    L = empty((BH, Nq))
    launch(kernel, (cdiv(Nq, t["Br"]), BH), 32 * t["warps"], q, k, v, O, L, scale, causal_diag(causal, Nq, Nk),
           label="FA2 fast forward", shared=nbytes if t["dynamic"] else 0)
    return O, L


def _bwd_tiles(d, Br, Bc, warps):
    t = bwd_default_tiles(d)
    for name, value in (("Br", Br), ("Bc", Bc), ("warps", warps)):
        if value is not None:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            t[name] = int(value)
    bwd_geometry(t["Br"], t["Bc"], d, t["warps"])
    check_shared_fit("fa2-fast backward", f"Br={t['Br']}, Bc={t['Bc']} at d={d}",
                     bwd_shared_bytes(t["Br"], t["Bc"], d, t["warps"]), "choose smaller Br/Bc")
    return t


def backward(q, k, v, o, lse, do, *, causal=False, scale, Br=None, Bc=None, warps=None):
    """FA2 Alg. 2: stage 4's preprocessing launch (``D = rowsum(dO∘O)``, dQ zeroed), then :func:`make_backward`,
    one thread block per K/V block.  ``Br, Bc, warps`` (Alg. 2's names: Br query rows per Q tile, Bc keys per
    block) default to :func:`bwd_default_tiles`; given, they must suit the backward (``Bc`` a multiple of
    ``4·warps``, ``Br`` of 8 and of ``warps``, shared memory <= 48 KiB)."""
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    t = _bwd_tiles(d, Br, Bc, warps)
    D = empty((BH, Nq))
    dQ = empty((BH, Nq, d))
    launch(fa2.make_preprocess(), (cdiv(Nq, fa2.PRE_WARPS), BH), 32 * fa2.PRE_WARPS, o, do, D, dQ,
           label="D = rowsum(dO∘O)")
    dK = empty((BH, Nk, d))
    dV = empty((BH, Nk, d))
    kernel = make_backward(t["Br"], t["Bc"], d, t["warps"], bool(causal))
    launch(kernel, (cdiv(Nk, t["Bc"]), BH), 32 * t["warps"], q, k, v, do, lse, D, dQ, dK, dV, scale,
           causal_diag(causal, Nq, Nk), label="FA2 fast backward")
    return dQ, dK, dV


register_impl("fa2-fast", stage="6",
              description="FA2 forward and backward tuned by their SASS: unrolled register micro-tiles, 128-bit "
                          "conflict-free shared loads, no local memory",
              forward=forward, backward=backward, options=("Br", "Bc", "warps"))


# --------------------------------------------------------------------------- analytic model


def model_forward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None):
    """Element accesses of :func:`forward` (one launch): Q, O, L once; K_j, V_j once per visited tile.

    Shared, per thread block: ``Br·Dp`` written (Q_i, zero-padded), then ``Br·Dp`` written and ``rows·d`` read
    back (O_i staged for the row-by-row store); per visited tile ``2·Bc·Dp`` written (K_j, V_j) and, per
    thread, ``Dp·(TM + TN)`` (line 8) and ``Bc·DN`` (line 10) elements read.  The padding columns of the rows
    (``LD - Dp``) are never touched."""
    t = _tiles(d, Br, Bc, warps)
    g = geometry(t["Br"], t["Bc"], d, t["warps"])
    visited = fa2.tiles_visited(Nq, Nk, t["Br"], t["Bc"], causal)
    n = BH * len(visited)
    kv = BH * sum(cols for _, _, _, cols in visited) * d
    blocks = BH * cdiv(Nq, t["Br"])
    per_tile_reads = g["threads"] * (g["Dp"] * (g["TM"] + g["TN"]) + t["Bc"] * g["DN"])
    return [dict(launch="FA2 fast forward", reads={"Q": BH * Nq * d, "K": kv, "V": kv},
                 writes={"O": BH * Nq * d, "L": BH * Nq}, atomics={},
                 shared_reads=n * per_tile_reads + BH * Nq * d,
                 shared_writes=2 * blocks * t["Br"] * g["Dp"] + n * 2 * t["Bc"] * g["Dp"])]


def model_backward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None):
    """Element accesses of :func:`backward`: stage 4's preprocessing launch (O, dO read; D, dQ = 0 written),
    then the main launch -- K_j, V_j once per block; Q_i, dO_i, L_i, D_i once per visited tile; ``rows·d``
    atomic adds into dQ per visited tile; dK, dV written once.

    Shared, per block: ``2·Bc·Dp`` written (K_j, V_j), then ``2·Bc·Dp`` written and ``2·keys·d`` read back
    (dK_j, dV_j staged).  Per visited tile: ``2·Br·Dp + 2·Br`` written (Q_i, dO_i, L_i, D_i) and ``Br·Bc``
    (dS_ij); per thread ``2·Dp·(TM + TN)`` (lines 10, 13), ``2·TN`` (L, D), ``2·Br·DN`` (lines 12, 16) and
    ``Bc·(TQ + E)`` (line 15) elements read."""
    t = _bwd_tiles(d, Br, Bc, warps)
    Br_, Bc_ = t["Br"], t["Bc"]
    g = bwd_geometry(Br_, Bc_, d, t["warps"])
    visited = fa2.tiles_visited(Nq, Nk, Br_, Bc_, causal, "backward")
    n = BH * len(visited)
    q_rows = BH * sum(rows for _, _, rows, _ in visited)
    blocks = BH * cdiv(Nk, Bc_)
    pre = dict(launch="D = rowsum(dO∘O)", reads={"O": BH * Nq * d, "dO": BH * Nq * d},
               writes={"D": BH * Nq, "dQ": BH * Nq * d}, atomics={}, shared_reads=0, shared_writes=0)
    per_tile_reads = g["threads"] * (2 * g["Dp"] * (g["TM"] + g["TN"]) + 2 * g["TN"] + 2 * Br_ * g["DN"]
                                     + Bc_ * (g["TQ"] + g["E"]))
    main = dict(launch="FA2 fast backward",
                reads={a: x for a, x in (("Q", q_rows * d), ("K", BH * Nk * d), ("V", BH * Nk * d),
                                         ("dO", q_rows * d), ("L", q_rows), ("D", q_rows)) if x},
                writes={"dK": BH * Nk * d, "dV": BH * Nk * d}, atomics={"dQ": q_rows * d} if q_rows else {},
                shared_reads=n * per_tile_reads + 2 * BH * Nk * d,
                shared_writes=blocks * 4 * Bc_ * g["Dp"] + n * (2 * Br_ * g["Dp"] + 2 * Br_ + Br_ * Bc_))
    return [pre, main]


# --------------------------------------------------------------------------- the SASS time model's inputs


def sass_config(d, causal, Br=None, Bc=None, warps=None) -> dict:
    """The forward kernel's configuration at head dim ``d`` (default tiles unless given)."""
    t = _tiles(d, Br, Bc, warps)
    return dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), dynamic=t["dynamic"])


def sass_shape(config):
    """The fields of a :class:`flashnb.instruments.sass_model.KernelShape` for the forward kernel, per thread: FFMAs of
    line 8 (``TM·TN·Dp``) and line 10 (``TM·DN·Bc``) per K/V tile; K_j and V_j words copied (``2·Bc·Dp`` over the
    block's threads), Q_i's; the O_i words stored row by row, and L."""
    g = geometry(config["Br"], config["Bc"], config["d"], config["warps"])
    NT, Dp, Bc, Br = g["threads"], g["Dp"], config["Bc"], config["Br"]
    return dict(phases=(g["TM"] * g["TN"] * Dp, g["TM"] * g["DN"] * Bc), tile_loads=cdiv(2 * Bc * Dp, NT),
                prologue_loads=cdiv(Br * Dp, NT), epilogue_stores=cdiv(Br * Dp, NT) + g["TM"])


def launch_order(Tr, causal):
    """The Q block each ``blockIdx.x`` computes, in launch order: with a causal mask the heaviest first (the
    last Q block sees the most K/V tiles), so the light ones fill the gaps at the end of the launch."""
    return list(range(Tr))[::-1] if causal else list(range(Tr))
