"""The product kernel: one FA2 forward and backward on stage 6's fast loop, with every feature as a policy.

``impl="flash"`` (the default of :func:`flashnb.attention`, :func:`flashnb.attention_forward`,
:func:`flashnb.attention_backward` and :func:`flashnb.torch.attention`).  The loop is stage 6's
(:mod:`flashnb.fa2_fast`, built from :mod:`flashnb.kernels.blocks`): register micro-tiles, 128-bit conflict-free
shared loads, heavy-first causal blocks, dynamic shared memory where the tiles need more than 48 KiB.  The features
are the policies of :mod:`flashnb.kernels.policies`, called at fixed places of that loop and compiled away when
off (with all of them off the kernels are stage 6's):

* **storage** -- ``storage="float16"`` / ``"bfloat16"`` (uint16 bit patterns): Q, K, V, O (dO, dK, dV, dQ) kept in
  half precision in HBM, widened at every load, narrowed at every store; tiles, statistics and the dQ accumulator
  stay float32 (a conversion launch narrows dQ after the backward).
* **block masks** -- ``block_mask=`` (:class:`flashnb.fa2.BlockMask`, a boolean array, or a prepared mask): three
  tile states, ``EMPTY`` (never loaded, never computed: FA1 Alg. 5's ``if M_ij != 0``), ``FULL`` (no
  per-element work), ``PARTIAL`` (``mask_mod`` per element).
* **attention modifiers** -- ``score_mod`` on every score, ``mask_mod`` through its block mask (built by the user
  surfaces with :func:`flashnb.flex.create_block_mask`; this module never imports :mod:`flashnb.flex`), and the
  backward's ``score_mod_grad``.
* **dropout** -- ``dropout_p``, ``seed``: Philox (:mod:`flashnb.rng`) regenerated per element in both directions.
* **GQA / MQA** -- K, V with fewer heads than Q; the backward's blocks loop over their group's query heads, so K_j,
  V_j are loaded once per group and dK, dV summed on chip.
* **Nq != Nk**, both causal alignments (``causal=True`` / ``"lower_right"``, ``"upper_left"``), any ``d <= 128``.

The forward reads K_j, V_j once per (query head, Q block): under GQA the query heads of a group stream the same
(smaller) K/V tensors, each with its own blocks, as stage 4 does -- sharing one K/V tile between the group's heads
inside a block would need a block's rows to span heads, whose per-head block-mask states and tile counts the
three-state loop does not have.

Kernels (``flashnb inspect``/``flashnb sass``): ``"flash.forward"``, ``"flash.preprocess"``, ``"flash.backward"``,
``"flash.convert"``.  Traffic models equal to the counter: :func:`model_forward`, :func:`model_backward` (elements),
:func:`model_bytes` (bytes at a storage).  The SASS time model's inputs: :func:`sass_config`, :func:`sass_shape`,
:func:`launch_order`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
from numba import cuda, float32, uint32

from .. import fa2
from ..common import (
    NEG_INF,
    ONE,
    ZERO,
    allow_dynamic_shared,
    causal_diag,
    cdiv,
    check_shared_fit,
    check_storage,
    empty,
    launch,
    positive_int,
    shared_optin_limit,
    storage_array_type,
    storage_dtype,
    storage_of,
)
from ..registry import kernel_factory, register_impl
from . import blocks, policies
from .blocks import LC, LR, PAD, VEC, bwd_geometry, bwd_shared_bytes, geometry, needs_dynamic, shared_bytes
from .policies import EMPTY, FULL, PARTIAL, python_modifier

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


# --------------------------------------------------------------------------- tiles

# Stage 6's tiles (flashnb.fa2_fast: chosen by the SASS mix, ptxas's registers and the SASS time model), per
# head-dim class; d = 128's forward default needs dynamic shared memory (100,352 B), the static table is the
# fallback where a device refuses it.
_FWD = {32: dict(Br=64, Bc=32, warps=2), 64: dict(Br=64, Bc=32, warps=2), 128: dict(Br=64, Bc=64, warps=4)}
_FWD_STATIC = {32: dict(Br=64, Bc=32, warps=2), 64: dict(Br=64, Bc=32, warps=2), 128: dict(Br=24, Bc=32, warps=2)}
_BWD = {32: dict(Br=32, Bc=32, warps=2), 64: dict(Br=32, Bc=32, warps=2), 128: dict(Br=16, Bc=24, warps=2)}
# With a score_mod the forward's tiles hold at most 16 scores per lane (TM·TN <= 16): score_mod is inlined once per
# score, and at 32 per lane a long one (tanh soft-capping) makes the compiler stop unrolling the tile's register
# code, which then lives in local memory.  (The backward's defaults hold 16 and 6.)
_FWD_SCORED = {32: dict(Br=32, Bc=32, warps=2), 64: dict(Br=32, Bc=32, warps=2), 128: dict(Br=64, Bc=32, warps=4)}
#: Opt-in limit the defaults are chosen against (sm_80's 163 KiB, the smaller of sm_80 and sm_90).
DESIGN_OPTIN_BYTES = 163 * 1024
#: What the last :func:`forward` ran with: ``dict(d=, Br=, Bc=, warps=, dynamic=, shared_bytes=, fallback=)``.
last_forward: dict = {}


def _table(table, d):
    for dmax in sorted(table):
        if d <= dmax:
            return dict(table[dmax])
    raise ValueError(f"head dim d must be <= {max(table)}, got {d}")


def default_tiles(d: int, static: bool = False, score_mod: bool = False) -> dict:
    """The forward's default ``Br, Bc, warps`` at head dim ``d`` (stage 6's); ``static``: the largest within 48 KiB
    of static shared memory (the fallback when a device refuses dynamic shared memory); ``score_mod``: at most 16
    scores per lane (a score_mod is inlined once per score: see ``_FWD_SCORED``)."""
    return _table(_FWD_STATIC if static else _FWD_SCORED if score_mod else _FWD, d)


def bwd_default_tiles(d: int) -> dict:
    """The backward's default ``Br, Bc, warps`` (Alg. 2's names: ``Br`` query rows per Q tile, ``Bc`` keys per
    block)."""
    return _table(_BWD, d)


def mask_tiles(d: int) -> dict:
    """The block size a plain boolean ``block_mask`` array is read at (without ``Br``/``Bc`` options), and that the
    user surfaces build a ``mask_mod``'s block mask at: ``Br × Bc`` = 64 × 32 up to d = 64, 32 × 32 at d = 128 --
    FA2's forward tiles (:func:`flashnb.fa2.default_tiles`), so one mask array means the same blocks to every impl.
    The kernels run at tiles that divide it."""
    t = fa2.default_tiles(d)
    return dict(Br=t["Br"], Bc=t["Bc"])


def _option(name, value):
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _largest_divisor(n: int, cap: int, step: int) -> int | None:
    """The largest ``x <= cap`` dividing ``n`` that is a multiple of ``step`` (None if there is none)."""
    return next((x for x in range(cap - cap % step, 0, -step) if n % x == 0), None)


def _fit(direction, t, within, given):
    """Tiles ``t`` made to divide the block mask's ``within = (mBr, mBc)`` (each tile inside one mask block): a given
    tile must divide it (ValueError naming both), a default one shrinks to the largest divisor the layout allows."""
    mBr, mBc = within
    step = {"forward": (LR, LC), "backward": (LC, LR)}[direction]
    for name, m, s in (("Br", mBr, step[0]), ("Bc", mBc, step[1])):
        if m % t[name] == 0:
            continue
        if name in given:
            raise ValueError(f"block_mask was built for tiles Br={mBr}, Bc={mBc}; the flash {direction} tiles "
                             f"Br={t['Br']}, Bc={t['Bc']} must divide them: build the mask for these tiles or pass "
                             f"Br, Bc that divide {mBr}, {mBc}")
        x = _largest_divisor(m, t[name], s)
        if x is None:
            raise ValueError(f"block_mask was built for tiles Br={mBr}, Bc={mBc}: the flash {direction} kernel needs "
                             f"{name} a multiple of {s} dividing {m}; build the mask for tiles that are")
        t[name] = x
    if "warps" not in given:             # the most warps (up to the default) the tiles still split into
        split = t["Br"] if direction == "forward" else t["Bc"]
        t["warps"] = max(w for w in range(1, t["warps"] + 1) if split % (LR * w) == 0
                         and (direction == "forward" or t["Br"] % w == 0))   # (the backward's warps split dQ_i)
    return t


def _tiles(direction, d, Br, Bc, warps, within=None, *, optin=DESIGN_OPTIN_BYTES, static=False, scored=False):
    """Validated tiles of a launch: the defaults (``static``: the forward's static ones; ``scored``: a score_mod's)
    overridden by the options, made to divide a block mask's tiles ``within``; the forward's get ``dynamic`` (more
    than 48 KiB: dynamic shared memory up to ``optin``, more is a ValueError naming tiles and limit), the
    backward's must fit 48 KiB."""
    given = {n: _option(n, v) for n, v in (("Br", Br), ("Bc", Bc), ("warps", warps)) if v is not None}
    t = dict(default_tiles(d, static, scored) if direction == "forward" else bwd_default_tiles(d), **given)
    if within is not None:
        t = _fit(direction, t, within, given)
    what = f"Br={t['Br']}, Bc={t['Bc']} at d={d}"
    if direction == "forward":
        geometry(t["Br"], t["Bc"], d, t["warps"])
        check_shared_fit("flash forward", what, shared_bytes(t["Br"], t["Bc"], d, t["warps"]), "choose smaller Br/Bc",
                         optin=optin)
        t["dynamic"] = needs_dynamic(t["Br"], t["Bc"], d, t["warps"])
    else:
        bwd_geometry(t["Br"], t["Bc"], d, t["warps"])
        check_shared_fit("flash backward", what, bwd_shared_bytes(t["Br"], t["Bc"], d, t["warps"]),
                         "choose smaller Br/Bc")
    return t


def _dynamic_bytes(Br, Bc, d, warps, dynamic=False, **_):
    """Dynamic shared memory a forward launch of this configuration asks for (0 for a static kernel)."""
    return shared_bytes(Br, Bc, d, warps) if dynamic else 0


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


def _check_features(sparse, mask_mod, dropout, H, elements):
    if mask_mod is not None and not sparse:
        raise ValueError("mask_mod needs sparse=True: the kernel reads which tiles are partial from the block mask")
    if (mask_mod is not None or dropout) and elements > policies.MAX_ELEMENTS:
        raise ValueError(f"tiles with {elements} scores per lane: mask_mod and dropout hold a lane's elements in one "
                         f"{policies.MAX_ELEMENTS}-bit mask; choose smaller Br/Bc or more warps")
    return positive_int("H", H)


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
    ``dropout`` (the kernel's ``dropout_p, seed_lo, seed_hi``; ``m_i``, ``l_i``, ``L`` from the undropped ``P~``)."""
    g = geometry(Br, Bc, d, warps)
    TM, TN, DN, Dp, NT = g["TM"], g["TN"], g["DN"], g["Dp"], g["threads"]
    H = _check_features(sparse, mask_mod, dropout, H, TM * TN)
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
    kv_head = policies.gqa(gqa)[0]


    @cuda.jit
    def flash_forward(Q, K, V, O, L, scale, diag, M, dropout_p, seed_lo, seed_hi):
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
        qb = cuda.blockIdx.x                           # the Q block (heavy first when causal)
        if causal:
            qb = cuda.gridDim.x - 1 - cuda.blockIdx.x
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
        dst = drop_state(dropout_p, seed_lo, seed_hi)
        load_tile(Q, Qs, 0, LD, z, i0, Nq, Br, i0 + Br <= Nq, tid)      # line 4: Q_i once
        for a in range(TM):                            # line 5: O~ = 0, l = 0, m = -inf
            m[a] = NEG_INF
            l[a] = ZERO
            for c in range(DN):
                Oi[a, c] = ZERO
        n_tiles = (Nk + Bc - 1) // Bc
        if causal:                                     # skip K/V blocks entirely above the diagonal
            last = min(i0 + Br, Nq) - 1 + diag
            n_tiles = min(n_tiles, last // Bc + 1) if last >= 0 else 0
        for jt in range(n_tiles):                      # line 6
            st = tile_state(M, z, qb, jt, lane)        # block mask: EMPTY, FULL or PARTIAL (FULL when dense)
            if st == EMPTY:
                continue                               # block-uniform: K_j, V_j never loaded
            j0 = jt * Bc
            full = j0 + Bc <= Nk
            cuda.syncthreads()                         # every warp is done with K_{j-1}, V_{j-1}
            load_tile(K, Ks, KO, LD, kz, j0, Nk, Bc, full, tid)         # line 7: K_j, V_j
            load_tile(V, Vs, VO, Dp, kz, j0, Nk, Bc, full, tid)
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
    :func:`make_forward`; ``score_mod_grad`` (default: ``score_mod.grad``) makes ``dS = P ∘ (dP - D) · d score_mod /
    d score``; dropout regenerates the forward's ``Z`` (``dV_j += (P ∘ W)ᵀ dO_i``, ``dS = P ∘ (dP ∘ W - D)``,
    ``W = Z / (1-p)``); half ``storage`` narrows dK, dV at their store (dQ: :func:`make_convert`)."""
    if score_mod is not None and score_mod_grad is None:
        score_mod_grad = getattr(python_modifier(score_mod), "grad", None)
        if score_mod_grad is None:
            raise ValueError(f"score_mod {getattr(python_modifier(score_mod), '__name__', score_mod)!r} has no "
                             "derivative: pass score_mod_grad (d score_mod / d score, same arguments)")
    g = bwd_geometry(Br, Bc, d, warps)
    TM, TN, DN, Dp, TQ, E, NT = g["TM"], g["TN"], g["DN"], g["Dp"], g["TQ"], g["E"], g["threads"]
    H = _check_features(sparse, mask_mod, dropout, H, TM * TN)
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
    group = policies.gqa(gqa)[1]

    @cuda.jit
    def flash_backward(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag, M, dropout_p, seed_lo, seed_hi):
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
        dst = drop_state(dropout_p, seed_lo, seed_hi)
        kfull = j0 + Bc <= Nk
        load_tile(K, Ks, 0, LD, kz, j0, Nk, Bc, kfull, tid)             # Alg. 2 line 6: K_j, V_j once
        load_tile(V, Vs, 0, LD, kz, j0, Nk, Bc, kfull, tid)
        for a in range(TM):                            # line 7: dK_j = dV_j = 0 (registers)
            for c in range(DN):
                dKj[a, c] = ZERO
                dVj[a, c] = ZERO
        i_first = 0
        if causal:                                     # skip Q blocks whose rows all precede key j0
            first = j0 - diag
            i_first = first // Br if first > 0 else 0
        for gz in range(G):
            z = kz * G + gz                            # the query head
            for it in range(i_first, (Nq + Br - 1) // Br):             # line 8
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


# --------------------------------------------------------------------------- block masks at the kernel's tiles


@dataclass(frozen=True)
class PreparedMask:
    """A block mask mapped onto one launch's tiles and copied to the device (:func:`prepare_block_mask`): pass it as
    ``block_mask=`` to reuse it without host work per call (e.g. outside a timed loop)."""

    direction: str
    tiles: dict = field(hash=False)
    M: object = field(hash=False, repr=False)
    shape: tuple = ()          # (BH, Nq, Nk, d) it was prepared for
    mask_mod: object = None    # the mask_mod of a block mask from flashnb.flex.create_block_mask
    partial: bool = False      # whether M has PARTIAL tiles (mask_mod per element)


def _as_block_mask(block_mask, d, Br, Bc):
    """``block_mask`` as a :class:`flashnb.fa2.BlockMask`: a plain boolean array is read at the ``Br``, ``Bc`` options,
    else at :func:`mask_tiles` ``(d)``."""
    if isinstance(block_mask, fa2.BlockMask):
        return block_mask
    t = mask_tiles(d)
    return fa2.BlockMask(np.asarray(block_mask), Br=t["Br"] if Br is None else Br, Bc=t["Bc"] if Bc is None else Bc)


def _mask_at_tiles(direction, d, Br, Bc, warps, block_mask, BH, Nq, Nk, optin=DESIGN_OPTIN_BYTES, static=False,
                   scored=False):
    """``(tiles, M or None, mask_mod)``: the launch's tiles (dividing the block mask's) and the mask's tile states at
    them, uint8 ``(BH, ceil(Nq/Br), ceil(Nk/Bc))`` -- asked of the mask itself (:meth:`BlockMask.at_tiles`: a
    ``mask_mod``'s mask recomputes its states at the finer tiles, a plain one repeats its entries)."""
    if block_mask is None:
        return _tiles(direction, d, Br, Bc, warps, optin=optin, static=static, scored=scored), None, None
    bm = _as_block_mask(block_mask, d, Br, Bc)
    bm.check(Nq, Nk, BH=BH)
    t = _tiles(direction, d, Br, Bc, warps, (bm.Br, bm.Bc), optin=optin, static=static, scored=scored)
    return t, bm.at_tiles(t["Br"], t["Bc"], Nq, Nk, BH), bm.mask_mod


def _device_mask(M):
    """M on the device; dense kernels get a 1x1x1 placeholder they never read."""
    if M is None:
        return cuda.device_array((1, 1, 1), dtype=np.uint8)
    return cuda.to_device(np.ascontiguousarray(M, dtype=np.uint8))


def prepare_block_mask(block_mask, *, direction, BH, Nq, Nk, d, Br=None, Bc=None, warps=None) -> PreparedMask:
    """The block mask mapped onto the ``direction``'s tiles and copied to the device, once."""
    if block_mask is None:
        raise ValueError("block_mask is required")
    t, M, mask_mod = _mask_at_tiles(direction, d, Br, Bc, warps, block_mask, BH, Nq, Nk)
    return PreparedMask(direction, t, _device_mask(M), (BH, Nq, Nk, d), mask_mod, bool((M == PARTIAL).any()))


def _launch_mask(direction, d, Br, Bc, warps, block_mask, BH, Nq, Nk, **kw):
    """``(tiles, device M or None, mask_mod, partial)`` of a launch: from nothing, a mask, or a prepared mask."""
    if isinstance(block_mask, PreparedMask):
        if block_mask.direction != direction or block_mask.shape != (BH, Nq, Nk, d):
            raise ValueError(f"block_mask was prepared for the {block_mask.direction} of (BH, Nq, Nk, d) = "
                             f"{block_mask.shape}, not the {direction} of {(BH, Nq, Nk, d)}")
        return dict(block_mask.tiles), block_mask.M, block_mask.mask_mod, block_mask.partial
    t, M, mask_mod = _mask_at_tiles(direction, d, Br, Bc, warps, block_mask, BH, Nq, Nk, **kw)
    if M is None:
        return t, None, None, False
    return t, _device_mask(M), mask_mod, bool((M == PARTIAL).any())


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


def _group(BH, k, v):
    """GQA's ``G = BH_q / BH_kv`` (1: every query head has its own K/V head)."""
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] < 1 or BH % k.shape[0]:
        raise ValueError(f"grouped-query attention: q's batch·heads ({BH}) must be a multiple of k's and v's "
                         f"({k.shape[0]})")
    return BH // k.shape[0]


def _modifiers(score_mod, mask_mod, score_mod_grad, block_mask, heads, BH, backward):
    """``(mask_mod, H)`` of a launch with attention modifiers, checked against the block mask: ``mask_mod`` reaches
    the kernel through its block mask (:func:`flashnb.flex.create_block_mask`; the user surfaces build it), which
    carries it.  The modifiers themselves are checked for a GPU by the user surfaces (:func:`flashnb.flex.
    check_modifiers`), before any launch."""
    bm_mod = getattr(block_mask, "mask_mod", None)
    if score_mod is None and mask_mod is None and bm_mod is None:
        if score_mod_grad is not None:
            raise ValueError("score_mod_grad is given without a score_mod")
        return None, 1
    H = positive_int("heads", heads)
    if BH % H:
        raise ValueError(f"heads={H} must divide batch·heads = {BH} (q's leading axes)")
    if mask_mod is not None:
        if block_mask is None:
            raise ValueError("mask_mod reaches the flash kernels through its block mask: pass block_mask="
                             "flashnb.flex.create_block_mask(mask_mod, ...) (flashnb.attention and flashnb.torch "
                             "build it for you)")
        if bm_mod is None or python_modifier(bm_mod) is not python_modifier(mask_mod):
            raise ValueError(f"block_mask was not made from mask_mod {getattr(mask_mod, '__name__', mask_mod)!r}: "
                             "pass block_mask=flashnb.flex.create_block_mask(mask_mod, ...) or leave block_mask out")
    if backward and score_mod is not None and score_mod_grad is None \
            and getattr(python_modifier(score_mod), "grad", None) is None:
        raise ValueError(f"score_mod {getattr(python_modifier(score_mod), '__name__', score_mod)!r} has no derivative: "
                         "pass score_mod_grad (a function of the same arguments returning d score_mod / d score, as "
                         "float32), or give the function a .grad attribute")
    return bm_mod, H


def forward(q, k, v, *, causal=False, scale, Br=None, Bc=None, warps=None, block_mask=None, score_mod=None,
            mask_mod=None, heads=1, score_mod_grad=None, dropout_p=0.0, seed=None, storage=None):
    """Device arrays in, ``(O, L)`` out (FA2 Alg. 1).  ``Br, Bc, warps`` default to :func:`default_tiles` (with a
    block mask: the largest tiles dividing its blocks).  Tiles over 48 KiB of shared memory run the dynamic kernel
    after the driver opt-in, up to the device's opt-in limit; when the *default* tiles need more than the device
    allows (or the opt-in fails), the launch falls back to the static defaults with a ``RuntimeWarning``
    (:data:`last_forward` says what ran).

    ``block_mask``: a :class:`flashnb.fa2.BlockMask`, a boolean array ``(..., ceil(Nq/Br), ceil(Nk/Bc))`` read at the
    ``Br``, ``Bc`` options or :func:`mask_tiles`, or a :class:`PreparedMask`.  ``score_mod``, ``mask_mod``
    (through its block mask), ``heads`` (the H of ``z = b·H + h``): attention modifiers.  ``k``, ``v`` may have
    fewer batch·heads than ``q`` (GQA: query head ``z`` reads K/V head ``z // G``).  ``dropout_p``, ``seed``:
    attention dropout (:mod:`flashnb.rng`); ``L`` is the undropped softmax's.  ``storage``: the dtype of q, k, v
    and O (default: q's); L is float32.  ``score_mod_grad`` is the backward's (accepted so one set of options
    serves both)."""
    global last_forward
    storage = _storage(storage, q=q, k=k, v=v)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = _group(BH, k, v)
    drop = policies.dropout_args(dropout_p, seed)
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
    mask_mod, H = _modifiers(score_mod, mask_mod, None, block_mask, heads, BH, False)
    config = dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), dynamic=t["dynamic"],
                  storage=storage, sparse=M is not None, score_mod=score_mod, mask_mod=mask_mod if partial else None,
                  H=H, gqa=G > 1, dropout=drop is not policies.NO_DROPOUT)
    nbytes = shared_bytes(t["Br"], t["Bc"], d, t["warps"])
    kernel = make_forward(**config)
    if t["dynamic"]:
        try:
            allow_dynamic_shared(kernel, _fwd_sig(storage), nbytes)
        except Exception as exc:  # the driver's error type depends on the binding; the fallback is the same
            if given or isinstance(block_mask, PreparedMask):
                raise RuntimeError(f"flash forward: the driver refused {nbytes:,} B of dynamic shared memory for "
                                   f"tiles Br={t['Br']}, Bc={t['Bc']} at d={d}: {exc}") from exc
            fallback = f"the opt-in call for {nbytes:,} B failed: {exc}"
            t, M, _, partial = _launch_mask("forward", d, None, None, None, block_mask, BH, Nq, Nk, static=True)
            nbytes = shared_bytes(t["Br"], t["Bc"], d, t["warps"])
            config.update(Br=t["Br"], Bc=t["Bc"], warps=t["warps"], dynamic=False,
                          mask_mod=mask_mod if partial else None)
            kernel = make_forward(**config)
    if fallback:
        warnings.warn(f"flash forward at d={d}: default tiles need dynamic shared memory this device refuses "
                      f"({fallback}); falling back to the static tiles Br={t['Br']}, Bc={t['Bc']}, "
                      f"warps={t['warps']}", RuntimeWarning, stacklevel=2)
    last_forward = dict(d=d, Br=t["Br"], Bc=t["Bc"], warps=t["warps"], dynamic=t["dynamic"], shared_bytes=nbytes,
                        fallback=fallback)
    O = empty((BH, Nq, d), storage=storage)
    L = empty((BH, Nq))
    launch(kernel, (cdiv(Nq, t["Br"]), BH), 32 * t["warps"], q, k, v, O, L, scale, causal_diag(causal, Nq, Nk),
           _device_mask(None) if M is None else M, *drop, label="flash forward",
           shared=nbytes if t["dynamic"] else 0)
    return O, L


def backward(q, k, v, o, lse, do, *, causal=False, scale, Br=None, Bc=None, warps=None, block_mask=None,
             score_mod=None, mask_mod=None, heads=1, score_mod_grad=None, dropout_p=0.0, seed=None, storage=None):
    """FA2 Alg. 2: the ``D = rowsum(dO∘O)`` launch (it also zeroes the float32 dQ accumulator), then one block per
    K/V column block of each K/V head (looping over its GQA group's query heads), then, with half storage, dQ
    narrowed by a third launch.  ``Br, Bc, warps`` default to :func:`bwd_default_tiles` (with a block mask: the
    largest dividing its blocks); options as in :func:`forward`, with the forward's ``dropout_p``, ``seed`` (the
    mask is regenerated) and ``score_mod_grad`` (default ``score_mod.grad``).  ``o`` is the (dropped) output."""
    storage = _storage(storage, q=q, k=k, v=v, o=o, do=do)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = _group(BH, k, v)
    drop = policies.dropout_args(dropout_p, seed)
    t, M, bm_mod, partial = _launch_mask("backward", d, Br, Bc, warps, block_mask, BH, Nq, Nk)
    mask_mod, H = _modifiers(score_mod, mask_mod, score_mod_grad, block_mask, heads, BH, True)
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
                       "seed", "storage"),
              gqa=True, mask_tiles=lambda d, Br=None, Bc=None: dict(mask_tiles(d), **{
                  n: v for n, v in (("Br", Br), ("Bc", Bc)) if v is not None}))


# --------------------------------------------------------------------------- analytic traffic models


def tiles_visited(Nq, Nk, Br, Bc, causal, direction="forward", states=None):
    """``[(outer, inner, rows, cols), ...]``: the (Q tile, K/V tile) pairs a launch computes for one head, with their
    valid row and column counts -- forward: outer = Q block i, inner = K/V block j; backward the reverse.  ``states``:
    the block mask's ``(ceil(Nq/Br), ceil(Nk/Bc))`` tile states at these tiles (``EMPTY`` pairs are left out)."""
    diag = causal_diag(causal, Nq, Nk)
    out = []
    if direction == "forward":
        for i in range(cdiv(Nq, Br)):
            n = cdiv(Nk, Bc)
            if causal:
                last = min((i + 1) * Br, Nq) - 1 + diag
                n = min(n, last // Bc + 1) if last >= 0 else 0
            out += [(i, j, min(Br, Nq - i * Br), min(Bc, Nk - j * Bc)) for j in range(n)]
    else:
        for j in range(cdiv(Nk, Bc)):
            first = j * Bc - diag
            i_first = first // Br if (causal and first > 0) else 0
            out += [(j, i, min(Br, Nq - i * Br), min(Bc, Nk - j * Bc)) for i in range(i_first, cdiv(Nq, Br))]
    if states is not None:
        ij = (lambda o, n: (o, n)) if direction == "forward" else (lambda o, n: (n, o))
        out = [tile for tile in out if states[ij(tile[0], tile[1])] != EMPTY]
    return out


def _visited_per_head(direction, Nq, Nk, t, causal, M, BH):
    """The visited tiles of each of the BH query heads (one list for all when dense) and the pairs whose block-mask
    entry each warp reads (the causal-limited set: lane 0 of every warp reads ``M`` once per pair)."""
    checked = tiles_visited(Nq, Nk, t["Br"], t["Bc"], causal, direction)
    if M is None:
        return [checked] * BH, 0
    memo = {}                                          # heads sharing one mask share one list
    for z in range(BH):
        key = M[z].tobytes()
        if key not in memo:
            memo[key] = tiles_visited(Nq, Nk, t["Br"], t["Bc"], causal, direction, M[z])
    return [memo[M[z].tobytes()] for z in range(BH)], len(checked)


def _launch_model(name, reads, writes, atomics=None, shared_reads=0, shared_writes=0):
    return dict(launch=name, reads={a: n for a, n in reads.items() if n}, writes={a: n for a, n in writes.items() if n},
                atomics={a: n for a, n in (atomics or {}).items() if n}, shared_reads=int(shared_reads),
                shared_writes=int(shared_writes))


def model_forward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None, block_mask=None, group=1,
                  storage="float32", score_mod=None):
    """Element accesses of :func:`forward` (one launch): Q, O, L once; K_j, V_j once per visited tile; with a block
    mask, one byte of ``M`` per warp per tile the causal limit lets a block reach (lane 0 reads, the warp shares) and
    no K/V for ``EMPTY`` tiles.  ``group`` (GQA) changes nothing: every query head's blocks stream their K/V head's
    tiles.  ``storage`` changes no element count (bytes: :func:`model_bytes`).  Dropout and modifiers move no memory
    (Philox in registers; captured modifier arrays are constants of the kernel); a ``score_mod`` only changes the
    default tiles (:func:`default_tiles`).

    Shared, per block: ``Br·Dp`` written (Q_i), then ``Br·Dp`` written and ``rows·d`` read back (O_i staged); per
    visited tile ``2·Bc·Dp`` written (K_j, V_j) and, per thread, ``Dp·(TM + TN)`` (line 8) and ``Bc·DN`` (line 10)
    read."""
    check_storage(storage)
    positive_int("group", group)
    t, M, _ = _mask_at_tiles("forward", d, Br, Bc, warps, block_mask, BH, Nq, Nk, scored=score_mod is not None)
    g = geometry(t["Br"], t["Bc"], d, t["warps"])
    per_head, checked = _visited_per_head("forward", Nq, Nk, t, causal, M, BH)
    kv = sum(cols for visited in per_head for _, _, _, cols in visited) * d
    n = sum(len(visited) for visited in per_head)
    blocks_ = BH * cdiv(Nq, t["Br"])
    per_tile_reads = g["threads"] * (g["Dp"] * (g["TM"] + g["TN"]) + t["Bc"] * g["DN"])
    return [_launch_model("flash forward", {"Q": BH * Nq * d, "K": kv, "V": kv, "M": BH * checked * t["warps"]},
                          {"O": BH * Nq * d, "L": BH * Nq},
                          shared_reads=n * per_tile_reads + BH * Nq * d,
                          shared_writes=2 * blocks_ * t["Br"] * g["Dp"] + n * 2 * t["Bc"] * g["Dp"])]


def model_backward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None, block_mask=None, group=1,
                   storage="float32"):
    """Element accesses of :func:`backward`: the preprocessing launch (O, dO read; D, dQ = 0 written), then the main
    launch -- K_j, V_j once per block, i.e. once per *K/V* head (``group`` = BH_q / BH_kv query heads share them: GQA
    reads K, V and writes dK, dV once per group); Q_i, dO_i, L_i, D_i once per visited tile; ``rows·d`` atomic adds
    into dQ per visited tile; one byte of ``M`` per warp per reachable pair with a block mask; then, with half
    ``storage``, dQ read once and dQh written (:func:`make_convert`).

    Shared, per block: ``2·Bc·Dp`` written (K_j, V_j), then ``2·Bc·Dp`` written and ``2·keys·d`` read back (dK_j, dV_j
    staged).  Per visited tile: ``2·Br·Dp + 2·Br`` written (Q_i, dO_i, L_i, D_i) and ``Br·Bc`` (dS_ij); per thread
    ``2·Dp·(TM + TN)`` (lines 10, 13), ``2·TN`` (L, D), ``2·Br·DN`` (lines 12, 16) and ``Bc·(TQ + E)`` (line 15)
    read."""
    check_storage(storage)
    BHkv = BH // positive_int("group", group)
    t, M, _ = _mask_at_tiles("backward", d, Br, Bc, warps, block_mask, BH, Nq, Nk)
    Br_, Bc_ = t["Br"], t["Bc"]
    g = bwd_geometry(Br_, Bc_, d, t["warps"])
    per_head, checked = _visited_per_head("backward", Nq, Nk, t, causal, M, BH)
    q_rows = sum(rows for visited in per_head for _, _, rows, _ in visited)
    n = sum(len(visited) for visited in per_head)
    blocks_ = BHkv * cdiv(Nk, Bc_)
    pre = _launch_model("D = rowsum(dO∘O)", {"O": BH * Nq * d, "dO": BH * Nq * d}, {"D": BH * Nq, "dQ": BH * Nq * d})
    per_tile_reads = g["threads"] * (2 * g["Dp"] * (g["TM"] + g["TN"]) + 2 * g["TN"] + 2 * Br_ * g["DN"]
                                     + Bc_ * (g["TQ"] + g["E"]))
    main = _launch_model("flash backward",
                         {"Q": q_rows * d, "K": BHkv * Nk * d, "V": BHkv * Nk * d, "dO": q_rows * d, "L": q_rows,
                          "D": q_rows, "M": BH * checked * t["warps"]},
                         {"dK": BHkv * Nk * d, "dV": BHkv * Nk * d}, {"dQ": q_rows * d},
                         shared_reads=n * per_tile_reads + 2 * BHkv * Nk * d,
                         shared_writes=blocks_ * 4 * Bc_ * g["Dp"] + n * (2 * Br_ * g["Dp"] + 2 * Br_ + Br_ * Bc_))
    if storage == "float32":
        return [pre, main]
    return [pre, main, _launch_model(f"dQ -> {storage}", {"dQ": BH * Nq * d}, {"dQh": BH * Nq * d})]


def itemsizes(storage="float32") -> dict:
    """Bytes per element of every global array the flash launches touch, by kernel parameter name: Q, K, V, O, dO, dK,
    dV and the converted dQh in ``storage`` (4 or 2 bytes); L, D and the dQ accumulator always 4; the block mask M 1."""
    h = storage_dtype(storage).itemsize
    return dict(Q=h, K=h, V=h, O=h, dO=h, dK=h, dV=h, dQh=h, L=4, D=4, dQ=4, M=1)


def model_bytes(model, storage="float32") -> list:
    """A traffic model (elements) in bytes at ``storage``: per launch ``dict(launch, read_bytes, write_bytes,
    atomic_bytes)``, each the sum of elements × :func:`itemsizes` (what the traffic counter reports)."""
    size = itemsizes(storage)
    return [dict(launch=m["launch"], read_bytes=sum(n * size[a] for a, n in m["reads"].items()),
                 write_bytes=sum(n * size[a] for a, n in m["writes"].items()),
                 atomic_bytes=sum(n * size[a] for a, n in m["atomics"].items())) for m in model]


# --------------------------------------------------------------------------- the SASS time model's inputs


def sass_config(d, causal, Br=None, Bc=None, warps=None, **features) -> dict:
    """The forward kernel's configuration at head dim ``d`` (default tiles unless given), with ``features`` (the
    factory's keyword arguments: ``storage``, ``sparse``, ``score_mod``, ``mask_mod``, ``H``, ``gqa``,
    ``dropout``)."""
    t = _tiles("forward", d, Br, Bc, warps, scored=features.get("score_mod") is not None)
    return dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), dynamic=t["dynamic"], **features)


def sass_shape(config):
    """The fields of a :class:`flashnb.sass_model.KernelShape` for the forward kernel, per thread: FFMAs of line 8
    (``TM·TN·Dp``) and line 10 (``TM·DN·Bc``) per K/V tile; K_j and V_j words copied (``2·Bc·Dp`` over the block's
    threads), Q_i's; the O_i words stored row by row, and L; with dropout or a ``mask_mod``, one trip of their
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

