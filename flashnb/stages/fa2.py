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

Kernels (arrays float32, C-contiguous, ``(BH, N, d)``; ``L``/``D`` are ``(BH, N)``; with ``storage="float16"`` or
``"bfloat16"`` Q, K, V, O, dO, dK, dV are half precision in HBM and widened to float32 at every load):

* :func:`make_forward` -- FA2 Alg. 1, grid ``(Tr, BH)``, ``32·warps`` threads.
* :func:`make_preprocess` -- FA2 Alg. 2 line 4 (``D = rowsum(dO ∘ O)``), also zeroes the dQ accumulator.
* :func:`make_backward` -- FA2 Alg. 2, grid ``(Tc, BH)``; the warps split the *key* rows of the block.
* :func:`make_convert` -- half storage only: dQ narrowed from its float32 accumulator after the backward.

Attention modifiers (:mod:`flashnb.flex`).  Both kernel factories take compile-time
``score_mod`` / ``mask_mod`` (device functions of the user's Python functions, or ``None`` = the plain kernel,
unchanged) and ``H`` (query heads, for ``b = z // H``, ``h = z % H``); the per-element work is one call of
:func:`make_modify` (forward) or :func:`make_modify_grad` (backward).  ``mask_mod`` needs ``sparse``: the
block mask then has three states, ``M_ij = 0`` empty (skipped, never loaded), ``1`` full (no per-element
work), ``2`` partial (``mask_mod`` per element).  ``gqa``: K and V have fewer heads than Q (grouped- and
multi-query attention, ``G = BH_q / BH_kv`` read from the shapes); the forward reads K/V head ``z // G``;
the backward's grid runs over the K/V heads and each block loops over its ``G`` query heads, so K_j, V_j are
loaded once per group and dK, dV are summed over the group on chip (no reduction kernel, no atomics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import cuda, float32, int32, uint32

from ..common import (
    NEG_INF,
    ONE,
    ZERO,
    causal_diag,
    cdiv,
    check_shared_fit,
    check_storage,
    empty,
    launch,
    positive_int,
    storage_array_type,
    storage_conversions,
    storage_dtype,
    storage_of,
)
from ..registry import kernel_factory, register_impl
from ..rng import check_dropout, dropout_kernel_args, dropout_scale

__all__ = ["BlockMask", "PreparedMask", "prepare_block_mask",
           "make_forward", "make_preprocess", "make_backward", "forward", "backward", "model_forward",
           "model_backward", "default_tiles", "block_tiles", "geometry", "tiles_visited", "LR", "LC", "FULL_MASK",
           "fmas_per_shared_read", "shared_bytes",
           "EMPTY", "FULL", "PARTIAL", "make_modify", "make_modify_grad", "make_convert", "itemsizes", "model_bytes"]

LR = 4                 # lanes of a warp along the rows it owns
LC = 8                 # lanes of a warp along the columns (key columns of S, head-dim columns of O)
FULL_MASK = 0xFFFFFFFF  # every lane takes part in every shuffle (no divergence around them)
PRE_WARPS = 4          # preprocessing kernel: one warp per query row, 4 rows per thread block
EMPTY, FULL, PARTIAL = 0, 1, 2   # block-mask entries: skip the tile / no per-element work / apply mask_mod
NO_SEED = uint32(0)    # the threshold and seed halves a kernel without dropout passes on (never used)

_A3 = "float32[:, :, ::1]"
_A2 = "float32[:, ::1]"
_MASK = "uint8[:, :, ::1]"   # block mask M (BH, Tr, Tc) at the kernel's tiles; a 1x1x1 dummy when dense


# Signatures as functions of the configuration: ``storage`` types the arrays the kernels keep in
# half precision -- Q, K, V, O, dO, dK, dV -- and nothing else (L, D and the dQ accumulator stay float32).
def _fwd_sig(storage="float32", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {h}, {h}, {_A2}, float32, int32, {_MASK})"


def _pre_sig(storage="float32", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {_A2}, {_A3})"


def _bwd_sig(storage="float32", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {h}, {h}, {_A2}, {_A2}, {_A3}, {h}, {h}, float32, int32, {_MASK})"


def _convert_sig(storage="float16", **_):
    return f"void({_A3}, {storage_array_type(storage)})"


_FWD_SIG, _PRE_SIG, _BWD_SIG = _fwd_sig(), _pre_sig(), _bwd_sig()   # the float32 kernels' signatures
_DROPOUT_ARGS = ", uint32, float32, uint32, uint32)"   # dropout=True: threshold, inv_keep, seed_lo, seed_hi appended


def _with_dropout(signature):
    """The launch signature of a configuration: ``signature(config)`` (its storage), with the dropout arguments
    appended when ``dropout=True``."""
    return lambda dropout=False, **config: signature(**config)[:-1] + _DROPOUT_ARGS if dropout else signature(**config)

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
    """What the PTX guard compiles: the default tiles of every head-dim class (causal on and off), plus
    one-warp tiles with an odd head dim (padded to the lanes); the block-sparse variant (FA1 Alg. 5, see
    :mod:`flashnb.stages.block_sparse`) with causal off and on, smallest and largest head dim; half storage (float16,
    bfloat16); dropout (dense causal d = 64; block-sparse GQA d = 128); attention modifiers last."""
    return ([dict(**default_tiles(d, direction), d=d, causal=c) for d, c in ((32, False), (64, True), (128, True))]
            + [dict(Br=16, Bc=16, d=20, warps=1, causal=False)]
            # half storage: float16 at the largest head dim, bfloat16 causal (two configs cover both types)
            + [dict(**default_tiles(d, direction), d=d, causal=c, storage=st)
               for d, c, st in ((128, False, "float16"), (64, True, "bfloat16"))]
            + [dict(**default_tiles(d, direction), d=d, causal=c, sparse=True) for d, c in ((32, False), (128, True))]
            + [dict(**default_tiles(64, direction), d=64, causal=True, dropout=True),     # dropout: dense; sparse GQA
               dict(**default_tiles(128, direction), d=128, causal=False, sparse=True, gqa=True, dropout=True)]
            # last: the richest path (exercise answers are guarded with the last config,
            # tests/exercises/test_exercises.py)
            + [dict(**default_tiles(d, direction), d=d, causal=c, sparse=True, H=4, gqa=True, **mods)
               for d, c, mods in ((64, False, _GUARD_MODS), (128, True, _GUARD_MODS_2))])   # last: REUSE_SAMPLE's


# Modifiers the PTX guard compiles into the kernels (gallery entries, named "module:attr" so the guard's
# JSON configs can carry them): ALiBi + sliding window, tanh soft-capping + document mask (a captured array).
_GUARD_MODS = dict(score_mod="flashnb.flex:GUARD_ALIBI", mask_mod="flashnb.flex:GUARD_WINDOW")
_GUARD_MODS_2 = dict(score_mod="flashnb.flex:GUARD_SOFTCAP", mask_mod="flashnb.flex:GUARD_DOCUMENT")


def geometry(rows: int, cols: int, d: int, warps: int) -> dict:
    """Per-thread micro-tile of a block whose warps split ``rows`` and whose lanes also split ``cols``:
    ``TM`` rows × ``TN`` columns of the score tile, ``DN`` head-dim columns (``Dp = LC·DN >= d``)."""
    if warps < 1 or rows % (warps * LR):
        raise ValueError(f"the rows split over warps ({rows}) must be a multiple of {LR}·warps = {LR * warps}")
    if cols % LC:
        raise ValueError(f"the columns split over lanes ({cols}) must be a multiple of {LC}")
    DN = cdiv(d, LC)
    return dict(TM=rows // (warps * LR), TN=cols // LC, DN=DN, Dp=DN * LC, threads=32 * warps)


# --------------------------------------------------------------------------- forward kernel


@cuda.jit(device=True, inline="always")
def cdiv_dev(a, b):
    """Ceiling division on the device."""
    return (a + b - 1) // b


# --------------------------------------------------------------------------- attention modifiers (flex)

_FLEX = None   # flashnb.flex, which builds on this module, registers itself here when imported (no import cycle)


def _flex_module():
    """:mod:`flashnb.flex` (block masks from ``mask_mod``, modifier checks): registered by flex at its import."""
    if _FLEX is None:
        raise RuntimeError("attention modifiers need flashnb.flex: import flashnb (which imports it) first")
    return _FLEX


_DEVICE_FNS: dict = {}   # Python function -> its device function, least recently used first (bounded, see below)


def python_modifier(fn):
    """The Python function of a modifier: ``fn`` itself, the ``py_func`` of a ``cuda.jit`` device function, or
    the object a ``"module:attr"`` string names (how the PTX guard's JSON configs name gallery modifiers)."""
    if isinstance(fn, str):
        import importlib

        module, _, attr = fn.partition(":")
        fn = getattr(importlib.import_module(module), attr)
    return getattr(fn, "py_func", fn)


def device_modifier(fn):
    """``fn`` compiled as an inlined device function, one per Python function (so every kernel that uses it
    shares it; a :func:`flashnb.flex.snapshot` brings its frozen copy); ``None`` stays ``None``.  The
    :data:`~flashnb.registry.KERNEL_CACHE_SIZE` most recently used are kept."""
    from ..registry import KERNEL_CACHE_SIZE

    if fn is None:
        return None
    fn = python_modifier(fn)
    dev = _DEVICE_FNS.pop(fn, None) or cuda.jit(device=True, inline="always")(fn)
    _DEVICE_FNS[fn] = dev                            # (re)inserted last: the most recently used
    while len(_DEVICE_FNS) > KERNEL_CACHE_SIZE:
        del _DEVICE_FNS[next(iter(_DEVICE_FNS))]
    return dev


@cuda.jit(device=True, inline="always")
def keep_score(s, b, h, q_idx, kv_idx):
    """The score_mod of a kernel without one (never called: the kernels call modifiers only when given)."""
    return s


@cuda.jit(device=True, inline="always")
def allow_all(b, h, q_idx, kv_idx):
    """The mask_mod of a kernel without one (never called on a dense tile)."""
    return True


@cuda.jit(device=True, inline="always")
def unit_grad(s, b, h, q_idx, kv_idx):
    return ONE


def make_modify(score_mod, mask_mod, H):
    """flex, forward: the modified score of element ``(row, col)`` of batch·head ``z`` -- ``score_mod`` on the
    scaled score, then, on a partial tile (``mij == PARTIAL``), ``-inf`` where ``mask_mod`` is False.  Rows and
    columns outside ``Nq × Nk`` are left to the kernel's own masking (a modifier indexing a captured array by
    ``q_idx``/``kv_idx`` never sees them).  Indices reach the modifiers as int32, as :mod:`flashnb.flex` compiles
    them."""
    sm = device_modifier(score_mod) or keep_score
    mm = device_modifier(mask_mod) or allow_all

    @cuda.jit(device=True, inline="always")
    def modify(s, z, row, col, Nq, Nk, mij):
        if row < Nq and col < Nk:
            b = int32(z // H)
            h = int32(z - b * H)
            s = float32(sm(s, b, h, int32(row), int32(col)))
            if mij == PARTIAL and not mm(b, h, int32(row), int32(col)):
                s = NEG_INF
        return s

    return modify


def make_modify_grad(score_mod, score_mod_grad, mask_mod, H):
    """flex, backward (FA2 Alg. 2 lines 11 and 14 with modifiers): ``(P, dS)`` of one element from its scaled
    score ``s``, ``dP``, ``L`` and ``D`` of its row: ``P = exp(score_mod(s) - L)``, ``dS = P ∘ (dP - D) ·
    score_mod_grad(s)`` (the chain rule through the modifier); ``(0, 0)`` where the element is not ``ok`` (out
    of range, causal-masked, a row without keys) or a partial tile's ``mask_mod`` is False."""
    sm = device_modifier(score_mod) or keep_score
    sg = device_modifier(score_mod_grad) or unit_grad
    mm = device_modifier(mask_mod) or allow_all

    @cuda.jit(device=True, inline="always")
    def flex_p_ds(s, dp, Lr, Dr, ok, z, row, col, mij):
        if not ok:
            return ZERO, ZERO
        b = int32(z // H)
        h = int32(z - b * H)
        if mij == PARTIAL and not mm(b, h, int32(row), int32(col)):
            return ZERO, ZERO
        p = float32(math.exp(float32(sm(s, b, h, int32(row), int32(col))) - Lr))
        return p, p * (dp - Dr) * float32(sg(s, b, h, int32(row), int32(col)))

    return flex_p_ds


def _flex_options(score_mod, mask_mod, sparse, H):
    if mask_mod is not None and not sparse:
        raise ValueError("mask_mod needs sparse=True: the kernel reads which tiles are partial from the block mask")
    return score_mod is not None or mask_mod is not None, positive_int("H", H)


@kernel_factory("fa2.forward", stage="4", signature=_with_dropout(_fwd_sig), configs=_configs("forward"),
                threads=lambda warps, **_: 32 * warps)
def make_forward(Br, Bc, d, warps, causal, sparse=False, score_mod=None, mask_mod=None, H=1, gqa=False,
                 dropout=False, storage="float32"):
    """FA2 Alg. 1 for one (Br, Bc, d, warps, causal); grid ``(Tr, BH)``, block ``32·warps`` threads.

    ``sparse``: block-sparse FlashAttention (FA1 Alg. 5 = Alg. 2 with ``if M_ij != 0``): a K/V tile whose
    block-mask entry ``M[z, i, j]`` is 0 is skipped -- never loaded, never computed.  Dense kernels never
    read ``M`` (the launcher passes a 1×1×1 dummy).  ``score_mod``, ``mask_mod``, ``H``, ``gqa``: see the
    module docstring (attention modifiers, grouped-query attention).

    ``dropout``: attention dropout as FA1 Alg. 2 does it; the kernel takes four more arguments, ``threshold``
    (uint32: keep iff the Philox word >= it, :func:`flashnb.rng.keep_threshold`), ``inv_keep`` (float32
    ``1/(1 - p)``, :func:`flashnb.rng.keep_scale`), ``seed_lo``, ``seed_hi`` (uint32), all made on the host.  The
    softmax statistics ``m_i``, ``l_i`` (and so ``L``) come from the *undropped* ``P~``; ``O~`` accumulates
    ``(P~ ∘ Z) V / (1 - p)``, where ``Z_ij`` (keep = 1) is regenerated per element from Philox
    (:func:`flashnb.rng.dropout_scale`, counter ``(col, row, z, 0)``): no mask is read or written.  Without
    ``dropout`` the kernel is the one above, unchanged.

    ``storage``: the dtype of Q, K, V, O in HBM (:data:`flashnb.common.STORAGES`); they are widened to float32
    as they are loaded into shared memory and O is narrowed as it is stored -- every tile, m_i, l_i and L stay
    float32."""
    flex, H = _flex_options(score_mod, mask_mod, sparse, H)
    if dropout and flex:
        raise ValueError("dropout with attention modifiers (score_mod / mask_mod) is not supported")
    to_f32, from_f32 = storage_conversions(storage)  # casts: no instruction for float32 storage
    partial_tiles = mask_mod is not None             # M has partial tiles (mask_mod per element)
    modify = make_modify(score_mod, mask_mod, H)
    g = geometry(Br, Bc, d, warps)
    TM, TN, DN, Dp, NT = g["TM"], g["TN"], g["DN"], g["Dp"], g["threads"]

    @cuda.jit(device=True, inline="always")
    def fa2_tile(QsT, KsT, Vs, S, Oi, m, l, qv, kv, p, r0, lr, lc, i0, j0, Nk, scale, diag, z, Nq, mij,
                 threshold, seed_lo, seed_hi, inv_keep):
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
                if flex:                             # flex: score_mod, and mask_mod on a partial tile
                    s = modify(s, z, i0 + r0 + LR * a, j0 + lc + LC * b, Nq, Nk, mij)
                if crossing:
                    col = j0 + lc + LC * b
                    if col >= Nk or (causal and col > i0 + r0 + LR * a + diag):
                        s = NEG_INF
                S[a, b] = s
                mx = max(mx, s)
            off = LC // 2
            while off > 0:                           # row max across the 8 lanes of the row group
                mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, off))
                off //= 2
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
        if dropout:                                  # FA1 Alg. 2's dropout, after l_i took the undropped P~:
            for a in range(TM):                      # O~ accumulates (P~ ∘ Z) V_j / (1-p)
                for b in range(TN):
                    if S[a, b] != ZERO:
                        S[a, b] *= dropout_scale(seed_lo, seed_hi, z, i0 + r0 + LR * a, j0 + lc + LC * b,
                                                 threshold, inv_keep)
        for b in range(TN):                          # ... + P~ V_j; P~_ij comes from its owner lane
            for src in range(LC):
                for a in range(TM):
                    p[a] = cuda.shfl_sync(FULL_MASK, S[a, b], lr * LC + src)
                j = b * LC + src
                for c in range(DN):
                    vj = Vs[j, lc + LC * c]          # one shared read feeds TM FMAs
                    for a in range(TM):
                        Oi[a, c] += p[a] * vj

    @cuda.jit(device=True, inline="always")
    def fa2_forward_block(Q, K, V, O, L, scale, diag, M, threshold, inv_keep, seed_lo, seed_hi):
        """One thread block of the forward (the kernel below, with or without the dropout arguments)."""
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
        z = cuda.blockIdx.y
        i0 = cuda.blockIdx.x * Br
        tid = cuda.threadIdx.x
        lane = tid % 32
        lr = lane // LC
        lc = lane % LC
        r0 = (tid // 32) * (TM * LR) + lr            # this lane's rows: r0 + LR·a
        Nq = Q.shape[1]
        Nk = K.shape[1]
        kz = z // (Q.shape[0] // K.shape[0]) if gqa else z   # GQA: the K/V head of query head z
        for e in range(tid, Br * d, NT):             # Alg. 1 line 4: load Q_i once (coalesced)
            r = e // d
            k = e - r * d
            QsT[k, r] = to_f32(Q[z, i0 + r, k]) if i0 + r < Nq else ZERO
        for a in range(TM):                          # line 5: O~ = 0, l = 0, m = -inf
            m[a] = NEG_INF
            l[a] = ZERO
            for c in range(DN):
                Oi[a, c] = ZERO
        n_tiles = cdiv_dev(Nk, Bc)
        if causal:                                   # skip K/V blocks entirely above the diagonal
            last = min(i0 + Br, Nq) - 1 + diag       # last key any row of this block may see
            n_tiles = min(n_tiles, last // Bc + 1) if last >= 0 else 0
        for jt in range(n_tiles):                    # line 6
            if sparse:                               # FA1 Alg. 5: if M_ij != 0 (lane 0 reads, the warp shares)
                if cuda.shfl_sync(FULL_MASK, int32(M[z, cuda.blockIdx.x, jt]) if lane == 0 else int32(0), 0) == 0:
                    continue                         # block-uniform: K_j, V_j never loaded
            mij = int32(FULL)
            if partial_tiles:                        # flex: full or partial? (M read again, only for mask_mod)
                mij = cuda.shfl_sync(FULL_MASK, int32(M[z, i0 // Br, jt]) if lane == 0 else int32(0), 0)
            j0 = jt * Bc
            cuda.syncthreads()                       # every warp is done with K_{j-1}, V_{j-1}
            for e in range(tid, Bc * d, NT):         # line 7: load K_j, V_j
                c = e // d
                k = e - c * d
                KsT[k, c] = to_f32(K[kz, j0 + c, k]) if j0 + c < Nk else ZERO
            for e in range(tid, Bc * Dp, NT):
                c = e // Dp
                k = e - c * Dp
                Vs[c, k] = to_f32(V[kz, j0 + c, k]) if j0 + c < Nk and k < d else ZERO
            cuda.syncthreads()
            fa2_tile(QsT, KsT, Vs, S, Oi, m, l, qv, kv, p, r0, lr, lc, i0, j0, Nk, scale, diag, z, Nq, mij,
                     threshold, seed_lo, seed_hi, inv_keep)
        for a in range(TM):                          # lines 12-14: O_i = diag(l)^-1 O~_i, L_i = m + log l
            ls = l[a]
            off = LC // 2
            while off > 0:
                ls += cuda.shfl_xor_sync(FULL_MASK, ls, off)
                off //= 2
            row = i0 + r0 + LR * a
            inv = ONE / ls if ls > ZERO else ZERO
            if row < Nq:
                for c in range(DN):
                    col = lc + LC * c
                    if col < d:
                        O[z, row, col] = from_f32(Oi[a, c] * inv)   # rounded once, here
                if lc == 0:
                    L[z, row] = m[a] + float32(math.log(ls)) if ls > ZERO else NEG_INF

    if dropout:
        @cuda.jit
        def fa2_forward(Q, K, V, O, L, scale, diag, M, threshold, inv_keep, seed_lo, seed_hi):
            fa2_forward_block(Q, K, V, O, L, scale, diag, M, threshold, inv_keep, seed_lo, seed_hi)
    else:
        @cuda.jit
        def fa2_forward(Q, K, V, O, L, scale, diag, M):
            fa2_forward_block(Q, K, V, O, L, scale, diag, M, NO_SEED, ONE, NO_SEED, NO_SEED)

    return fa2_forward


# --------------------------------------------------------------------------- backward kernels


@kernel_factory("fa2.preprocess", stage="4", signature=_pre_sig, threads=32 * PRE_WARPS,
                configs=[{}, dict(storage="float16"), dict(storage="bfloat16")])
def make_preprocess(storage="float32"):
    """FA2 Alg. 2 line 4; ``storage``: the dtype of O and dO (widened to float32; D and dQ stay float32)."""
    to_f32 = storage_conversions(storage)[0]

    @cuda.jit
    def fa2_bwd_preprocess(O, dO, D, dQ):
        """FA2 Alg. 2 line 4: D_i = rowsum(dO_i ∘ O_i), one warp per row (lanes over d, shuffle-reduced);
        also zeroes the dQ accumulator that the main kernel adds into."""
        z = cuda.blockIdx.y
        lane = cuda.threadIdx.x % 32
        i = cuda.blockIdx.x * PRE_WARPS + cuda.threadIdx.x // 32
        acc = ZERO
        if i < O.shape[1]:                          # warp-uniform branch
            for e in range(lane, O.shape[2], 32):
                acc += to_f32(dO[z, i, e]) * to_f32(O[z, i, e])
                dQ[z, i, e] = ZERO
        off = 16
        while off > 0:
            acc += cuda.shfl_down_sync(FULL_MASK, acc, off)
            off //= 2
        if lane == 0 and i < O.shape[1]:
            D[z, i] = acc

    return fa2_bwd_preprocess


@kernel_factory("fa2.backward", stage="4", signature=_with_dropout(_bwd_sig), configs=_configs("backward"),
                threads=lambda warps, **_: 32 * warps)
def make_backward(Br, Bc, d, warps, causal, sparse=False, score_mod=None, mask_mod=None, H=1, gqa=False,
                  score_mod_grad=None, dropout=False, storage="float32"):
    """FA2 Alg. 2 for one configuration; grid ``(Tc, BH)``.  The warps split the Bc *key* rows (each lane
    owns ``TM`` key rows × ``TN`` query columns of Sᵀ and ``TM × DN`` of dK_j, dV_j); dS goes through
    shared memory once per tile so that all threads can form dQ_i = dS K_j and add it into HBM.
    ``sparse``: Q tiles whose block-mask entry ``M[z, i, j]`` is 0 are skipped (FA1 Alg. 5's backward).
    ``score_mod_grad``: ``d score_mod / d score`` (default: the ``grad`` attribute of ``score_mod``, as the
    gallery of :mod:`flashnb.flex` sets it, else derived from its source by :func:`flashnb.flex.derivative`);
    ``gqa``: grid ``(Tc, BH_kv)``, each block loops over its query heads.

    ``dropout`` (FA1 Alg. 4 with dropout, in FA2 Alg. 2's loop order): four more kernel arguments, ``threshold``,
    ``inv_keep``, ``seed_lo``, ``seed_hi`` -- the forward's.  ``P = exp(S - L)`` is the undropped softmax (``L``
    came from the undropped ``P~``); ``Z_ij`` is regenerated from the same Philox counters as in the forward, so it
    is the forward's mask, never stored.  With ``W = Z / (1-p)``: ``dV_j += (P ∘ W)ᵀ dO_i``, ``dP = (dO_i V_jᵀ) ∘ W``,
    ``dS = P ∘ (dP - D)``.  ``D_i = rowsum(dO_i ∘ O_i)`` of the *dropped* output ``O = (P ∘ W) V`` is still
    ``Σ_j P_ij dP_ij``: ``Σ_c dO_ic O_ic = Σ_c dO_ic Σ_j P_ij W_ij V_jc = Σ_j P_ij W_ij (dO_i · V_j)
    = Σ_j P_ij dP_ij`` -- the preprocessing kernel is unchanged.

    ``storage``: the dtype of Q, K, V, dO, dK, dV in HBM (widened at the loads, dK and dV narrowed at the one
    store); L, D and the dQ accumulator stay float32 -- atomics add float32, and :func:`make_convert` narrows
    dQ afterwards, as FlashAttention-2 does (a float32 ``dq_accum``, then a conversion kernel)."""
    flex, H = _flex_options(score_mod, mask_mod, sparse, H)
    if dropout and flex:
        raise ValueError("dropout with attention modifiers (score_mod / mask_mod) is not supported")
    to_f32, from_f32 = storage_conversions(storage)  # casts: no instruction for float32 storage
    if score_mod is not None and score_mod_grad is None:
        score_mod_grad = _flex_module().score_mod_grad_of(score_mod)   # .grad, else derived from its source
    flex_p_ds = make_modify_grad(score_mod, score_mod_grad, mask_mod, H)
    partial_tiles = mask_mod is not None             # M has partial tiles (mask_mod per element)
    g = geometry(Bc, Br, d, warps)
    TM, TN, DN, Dp, NT = g["TM"], g["TN"], g["DN"], g["Dp"], g["threads"]
    BrP, BcP = Br + 1, Bc + 1   # padded leading dimensions of the transposed shared tiles

    @cuda.jit(device=True, inline="always")
    def fa2_bwd_tile(QsT, KsT, VsT, dOsT, Ls, Ds, dSs, S, dP, dKj, dVj, kv, vv, qv, ov,
                     c0, lr, lc, i0, j0, Nk, scale, diag, zq, mij, threshold, seed_lo, seed_hi, inv_keep):
        """Alg. 2 lines 10-16 for one Q tile on this lane's micro-tile of the transposed scores."""
        for a in range(TM):
            for b in range(TN):
                S[a, b] = ZERO
                dP[a, b] = ZERO
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
        for b in range(TN):                          # line 11: P = exp(scale·S - L); line 14: dS
            r = lc + LC * b
            Lr = Ls[r]
            Dr = Ds[r]
            for a in range(TM):
                key = j0 + c0 + LR * a
                if flex:                             # flex: P of the modified score, dS times d score_mod / ds
                    ok = Lr != NEG_INF and key < Nk and not (causal and key - diag > i0 + r)   # as below
                    S[a, b], dP[a, b] = flex_p_ds(scale * S[a, b], dP[a, b], Lr, Dr, ok, zq, i0 + r, key, mij)
                    continue
                pv = ZERO
                if Lr != NEG_INF and key < Nk and not (causal and key > i0 + r + diag):
                    pv = float32(math.exp(scale * S[a, b] - Lr))
                if dropout:                          # lines 11-14 with FA1 Alg. 4's Z_ij regenerated, W = Z/(1-p)
                    w = ZERO
                    if pv != ZERO:
                        w = dropout_scale(seed_lo, seed_hi, zq, i0 + r, key, threshold, inv_keep)
                    S[a, b] = pv * w                 # (P ∘ W), for dV_j += (P ∘ W)ᵀ dO_i
                    dP[a, b] = pv * (dP[a, b] * w - Dr)   # dS = P ∘ ((dO_i V_jᵀ) ∘ W - D)
                    continue
                S[a, b] = pv
                dP[a, b] = pv * (dP[a, b] - Dr)
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

    @cuda.jit(device=True, inline="always")
    def fa2_backward_block(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag, M, threshold, inv_keep, seed_lo, seed_hi):
        """One thread block of the backward (the kernel below, with or without the dropout arguments)."""
        # Transposed tiles get one padding column (BcP = Bc + 1, BrP = Br + 1): lanes that walk down a column
        # then hit 32 different banks instead of one (no shared-memory bank conflicts; never read).
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
        kz = cuda.blockIdx.y                         # the K/V head (without GQA also the query head z)
        j0 = cuda.blockIdx.x * Bc
        tid = cuda.threadIdx.x
        lane = tid % 32
        lr = lane // LC
        lc = lane % LC
        c0 = (tid // 32) * (TM * LR) + lr            # this lane's key rows: c0 + LR·a
        Nq = Q.shape[1]
        Nk = K.shape[1]
        for e in range(tid, Bc * d, NT):             # Alg. 2 line 6: load K_j, V_j
            c = e // d
            k = e - c * d
            inside = j0 + c < Nk
            KsT[k, c] = to_f32(K[kz, j0 + c, k]) if inside else ZERO
            VsT[k, c] = to_f32(V[kz, j0 + c, k]) if inside else ZERO
        for a in range(TM):                          # line 7: dK_j = dV_j = 0 (on chip)
            for c in range(DN):
                dKj[a, c] = ZERO
                dVj[a, c] = ZERO
        i_first = 0
        if causal:                                   # skip Q blocks whose rows all precede key j0
            first = j0 - diag                        # first query row that may see key j0
            i_first = first // Br if first > 0 else 0
        n_q = cdiv_dev(Nq, Br)
        G = Q.shape[0] // K.shape[0] if gqa else 1   # GQA: the G query heads sharing K/V head kz, one after another
        for t in range(i_first, n_q + (G - 1) * (n_q - i_first) if gqa else n_q):  # line 8
            z = kz * G + (t - i_first) // (n_q - i_first) if gqa else kz   # the query head (kz without GQA)
            it = t - (z - kz * G) * (n_q - i_first) if gqa else t          # the Q tile
            if sparse:                               # FA1 Alg. 5: if M_ij != 0 (lane 0 reads, the warp shares)
                if cuda.shfl_sync(FULL_MASK, int32(M[z, it, cuda.blockIdx.x]) if lane == 0 else int32(0), 0) == 0:
                    continue                         # block-uniform: Q_i, dO_i, L_i, D_i never loaded
            mij = int32(FULL)
            if partial_tiles:                        # flex: full or partial? (M read again, only for mask_mod)
                mij = cuda.shfl_sync(FULL_MASK, int32(M[z, it, cuda.blockIdx.x]) if lane == 0 else int32(0), 0)
            i0 = it * Br
            cuda.syncthreads()
            for e in range(tid, Br * Dp, NT):        # line 9: load Q_i, dO_i, L_i, D_i
                r = e // Dp
                k = e - r * Dp
                inside = i0 + r < Nq and k < d
                QsT[k, r] = to_f32(Q[z, i0 + r, k]) if inside else ZERO
                dOsT[k, r] = to_f32(dO[z, i0 + r, k]) if inside else ZERO
            for r in range(tid, Br, NT):
                Ls[r] = L[z, i0 + r] if i0 + r < Nq else NEG_INF
                Ds[r] = D[z, i0 + r] if i0 + r < Nq else ZERO
            cuda.syncthreads()
            fa2_bwd_tile(QsT, KsT, VsT, dOsT, Ls, Ds, dSs, S, dP, dKj, dVj, kv, vv, qv, ov,
                         c0, lr, lc, i0, j0, Nk, scale, diag, z, mij, threshold, seed_lo, seed_hi, inv_keep)
            cuda.syncthreads()                       # dSs complete (written by every warp)
            for e in range(tid, Br * d, NT):         # line 15: dQ_i += scale · dS K_j (atomic, HBM)
                r = e // d
                k = e - r * d
                acc = ZERO
                for c in range(Bc):
                    acc += dSs[c, r] * KsT[k, c]
                if i0 + r < Nq:
                    cuda.atomic.add(dQ, (z, i0 + r, k), scale * acc)
        for a in range(TM):                          # line 18: write dK_j, dV_j once
            key = j0 + c0 + LR * a
            if key < Nk:
                for c in range(DN):
                    col = lc + LC * c
                    if col < d:
                        dK[kz, key, col] = from_f32(scale * dKj[a, c])
                        dV[kz, key, col] = from_f32(dVj[a, c])

    if dropout:
        @cuda.jit
        def fa2_backward(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag, M, threshold, inv_keep, seed_lo, seed_hi):
            fa2_backward_block(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag, M, threshold, inv_keep, seed_lo, seed_hi)
    else:
        @cuda.jit
        def fa2_backward(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag, M):
            fa2_backward_block(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag, M, NO_SEED, ONE, NO_SEED, NO_SEED)

    return fa2_backward


CONVERT_THREADS = 128   # dQ conversion: one element per thread


@kernel_factory("fa2.convert", stage="4", signature=_convert_sig, threads=CONVERT_THREADS,
                configs=[dict(storage="float16"), dict(storage="bfloat16")])
def make_convert(storage="float16"):
    """Half storage only: ``dQh = dQ`` narrowed from the float32 accumulator the backward's atomics summed
    into (FA2 Alg. 2 line 15 adds float32; FlashAttention-2 ends its backward the same way, converting its float32
    ``dq_accum``).  Grid ``(ceil(Nq·d / 128), BH)``, one element per thread."""
    from_f32 = storage_conversions(storage)[1]

    @cuda.jit
    def fa2_convert_dq(dQ, dQh):
        """dQh = dQ (the float32 accumulator) in half storage."""
        z = cuda.blockIdx.y
        e = cuda.blockIdx.x * CONVERT_THREADS + cuda.threadIdx.x
        d = dQ.shape[2]
        if e < dQ.shape[1] * d:
            i = e // d
            dQh[z, i, e - i * d] = from_f32(dQ[z, i, e - i * d])

    return fa2_convert_dq


# --------------------------------------------------------------------------- block masks
# The type fa2's ``block_mask=`` takes.  It lives here, in the lower module, and flashnb.stages.block_sparse
# (the patterns and impl="fa2-sparse") re-exports it: block_sparse builds on fa2, never the reverse.


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A boolean block mask ``(..., Tr, Tc)`` (True = compute the block) and the tiles ``Br × Bc`` it was
    built for.  Leading axes, if any, are the problem's leading (batch, head) axes, flattened or not.

    From a ``mask_mod`` (:func:`flashnb.flex.create_block_mask`) it has three states: ``partial`` (boolean, a
    subset of ``mask``) marks the computed blocks where ``mask_mod`` is applied per element; the other computed
    blocks are full (every element allowed: no per-element work), the rest empty (never loaded).  Such a mask
    keeps its ``mask_mod`` and leading axes ``(B, H)``, so that it is recomputed exactly at finer tiles."""

    mask: np.ndarray
    Br: int
    Bc: int
    partial: np.ndarray | None = None
    mask_mod: object = None

    def __post_init__(self):
        a = np.asarray(self.mask)
        if a.dtype != np.bool_:
            raise TypeError(f"block_mask must be a boolean array (True = compute the block), got dtype {a.dtype}")
        if a.ndim < 2:
            raise ValueError(f"block_mask must have shape (..., ceil(Nq/Br), ceil(Nk/Bc)), got {a.shape}")
        if (self.partial is None) != (self.mask_mod is None):
            raise ValueError("block_mask: partial blocks and mask_mod come together (flashnb.flex.create_block_mask)")
        if self.partial is not None:
            p = np.asarray(self.partial)
            if p.dtype != np.bool_ or p.shape != a.shape or np.any(p & ~a):
                raise ValueError(f"block_mask.partial must be a boolean array of the mask's shape {a.shape} marking "
                                 "computed blocks only")
            object.__setattr__(self, "partial", p)
            # the mask_mod as it was when these tiles were computed (its captured arrays copied): the kernels and
            # the finer tiles of the backward use that, and a launch refuses the mask once the original changed
            object.__setattr__(self, "mask_mod", _flex_module().snapshot(self.mask_mod))
        object.__setattr__(self, "mask", a)
        object.__setattr__(self, "Br", positive_int("Br", self.Br))
        object.__setattr__(self, "Bc", positive_int("Bc", self.Bc))

    @property
    def shape(self) -> tuple:
        return self.mask.shape

    @property
    def density(self) -> float:
        """``s``: the fraction of nonzero blocks."""
        return float(self.mask.mean())

    def check(self, Nq: int, Nk: int, BH: int | None = None) -> None:
        """ValueError naming ``block_mask`` unless the shape is ``(..., ceil(Nq/Br), ceil(Nk/Bc))`` with leading
        axes of ``BH`` (or 1) problems."""
        Tr, Tc = cdiv(Nq, self.Br), cdiv(Nk, self.Bc)
        lead = int(np.prod(self.mask.shape[:-2], dtype=np.int64))
        if self.mask.shape[-2:] != (Tr, Tc) or (BH is not None and lead not in (1, BH)):
            heads = "" if BH is None else f" (leading axes: none, or batch·heads = {BH} in all)"
            raise ValueError(f"block_mask must have shape (..., {Tr}, {Tc}) = (..., ceil(Nq/Br), ceil(Nk/Bc)) for "
                             f"Nq={Nq}, Nk={Nk} and the tiles Br={self.Br}, Bc={self.Bc} it is read at{heads}; "
                             f"got {self.mask.shape}")

    @property
    def states(self) -> np.ndarray:
        """uint8 entries as the kernels read them: ``EMPTY`` (0), ``FULL`` (1), ``PARTIAL`` (2)."""
        m = self.mask.astype(np.uint8)
        return m if self.partial is None else m + self.partial.astype(np.uint8)

    def at_tiles(self, Br: int, Bc: int, Nq: int, Nk: int, BH: int) -> np.ndarray:
        """The mask at finer tiles ``Br × Bc`` (dividing this mask's): uint8 ``(BH, ceil(Nq/Br), ceil(Nk/Bc))``,
        each entry repeated over the tiles inside its block (one with a ``mask_mod`` is recomputed from it at
        those tiles: a partial block may hold empty and full tiles)."""
        self.check(Nq, Nk, BH)
        if self.Br % Br or self.Bc % Bc:
            raise ValueError(f"block_mask built for Br={self.Br}, Bc={self.Bc} cannot be read at tiles "
                             f"Br={Br}, Bc={Bc} (they must divide {self.Br}, {self.Bc})")
        if self.mask_mod is not None:
            flex = _flex_module()

            B, H = self.mask.shape[:2] if self.mask.ndim == 4 else (1, 1)
            m = self.states if (Br, Bc) == (self.Br, self.Bc) else \
                flex.create_block_mask(self.mask_mod, B, H, Nq, Nk, Br=Br, Bc=Bc).states
            m = m.reshape((-1,) + m.shape[-2:])
            return np.ascontiguousarray(np.broadcast_to(m, (BH,) + m.shape[1:]), dtype=np.uint8)
        m = self.mask.reshape((-1,) + self.mask.shape[-2:])
        m = np.repeat(np.repeat(m, self.Br // Br, axis=1), self.Bc // Bc, axis=2)[:, :cdiv(Nq, Br), :cdiv(Nk, Bc)]
        return np.ascontiguousarray(np.broadcast_to(m, (BH,) + m.shape[1:]), dtype=np.uint8)

    def expand(self, Nq: int, Nk: int) -> np.ndarray:
        """The element mask ``(..., Nq, Nk)`` (for :mod:`flashnb.reference`'s ``mask=``)."""
        from ..reference import expand_block_mask

        self.check(Nq, Nk)
        if self.mask_mod is not None:
            flex = _flex_module()

            B, H = self.mask.shape[:2] if self.mask.ndim == 4 else (1, 1)
            return flex.mask_array(self.mask_mod, B, H, Nq, Nk).reshape(self.mask.shape[:-2] + (Nq, Nk))
        return expand_block_mask(self.mask, Nq, Nk, self.Br, self.Bc)

    def __and__(self, other: "BlockMask") -> "BlockMask":
        return self._combine(other, np.logical_and)

    def __or__(self, other: "BlockMask") -> "BlockMask":
        return self._combine(other, np.logical_or)

    def _combine(self, other, op):
        if not isinstance(other, BlockMask) or (other.Br, other.Bc) != (self.Br, self.Bc):
            raise ValueError("block masks combine only with block masks built for the same tiles")
        if self.mask_mod is not None or other.mask_mod is not None:
            raise ValueError("block masks made from a mask_mod combine through their mask_mods: "
                             "flashnb.flex.and_masks / or_masks, then create_block_mask")
        return BlockMask(op(self.mask, other.mask), self.Br, self.Bc)

    def __repr__(self):
        Tr, Tc = self.mask.shape[-2:]
        flex = "" if self.partial is None else \
            f", partial={float(self.partial.mean()):.3f}, mask_mod={getattr(self.mask_mod, '__name__', '?')}"
        return f"BlockMask({Tr}x{Tc} blocks of {self.Br}x{self.Bc}, s={self.density:.3f}{flex})"



# --------------------------------------------------------------------------- launchers


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
    elements as the forward's).  ``M`` is uint8 ``(BH, ceil(Nq/Br), ceil(Nk/Bc))``."""
    if block_mask is None:
        return _tiles(d, direction, Br, Bc, warps), None
    fwd = default_tiles(d, "forward")
    if isinstance(block_mask, BlockMask):
        bm = block_mask
    else:
        bm = BlockMask(block_mask, Br=fwd["Br"] if Br is None else Br, Bc=fwd["Bc"] if Bc is None else Bc)
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
    mask_mod: object = None   # the mask_mod of a block mask from flashnb.flex.create_block_mask (a snapshot)
    lead: tuple = ()          # that block mask's leading axes (B, H)


def prepare_block_mask(block_mask, *, direction, BH, Nq, Nk, d, Br=None, Bc=None, warps=None) -> PreparedMask:
    """:func:`block_tiles` plus the copy of ``M`` to the device, done once (e.g. outside a timed loop)."""
    t, M = block_tiles(d, direction, Br, Bc, warps, block_mask, BH, Nq, Nk)
    if M is None:
        raise ValueError("block_mask is required")
    lead = tuple(block_mask.mask.shape[:-2]) if isinstance(block_mask, BlockMask) else ()
    return PreparedMask(direction, t, _mask_device(M), (BH, Nq, Nk, d), getattr(block_mask, "mask_mod", None), lead)


def _tiles_and_mask(direction, Br, Bc, warps, block_mask, BH, Nq, Nk, d):
    """``(tiles, device M or None)`` for a launch, from nothing, a mask, or a :class:`PreparedMask`."""
    if isinstance(block_mask, PreparedMask):
        if block_mask.direction != direction or block_mask.shape != (BH, Nq, Nk, d):
            raise ValueError(f"block_mask was prepared for the {block_mask.direction} of (BH, Nq, Nk, d) = "
                             f"{block_mask.shape}, not the {direction} of {(BH, Nq, Nk, d)}")
        return block_mask.tiles, block_mask.M
    t, M = block_tiles(d, direction, Br, Bc, warps, block_mask, BH, Nq, Nk)
    return t, (None if M is None else _mask_device(M))


def _group(BH, BHkv, k, v):
    """GQA's ``G = BH_q / BH_kv`` (1: every query head has its own K/V head)."""
    if v is not None and tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if BHkv < 1 or BH % BHkv:
        raise ValueError(f"grouped-query attention: q's batch·heads ({BH}) must be a multiple of k's and v's "
                         f"({BHkv})")
    return BH // BHkv


def _flex(direction, score_mod, mask_mod, score_mod_grad, block_mask, heads, BH, Nq, Nk, d, Br, Bc):
    """``(block_mask, score_mod, mask_mod, score_mod_grad, H)`` of a launch with modifiers (:mod:`flashnb.flex`):
    each modifier a :func:`flashnb.flex.snapshot` of what it captures at this call (the kernels are compiled
    from, and cached by, that); the modifiers checked (compiled alone for a GPU, once per code and captured
    types); the block mask built from ``mask_mod`` when none is given (at the forward's tiles; the backward's
    are recomputed from ``mask_mod``), or ``mask_mod`` taken from a block mask that carries one -- refused when
    the function it came from has changed what it captures since (:func:`flashnb.flex.check_current`) or the
    mask was made for other (B, H) than this call's (:func:`flashnb.flex.check_heads`).  Without modifiers:
    ``(block_mask, None, None, None, 1)``."""
    bm_mod = getattr(block_mask, "mask_mod", None)
    if score_mod is None and mask_mod is None and bm_mod is None:
        if score_mod_grad is not None:
            raise ValueError("score_mod_grad is given without a score_mod")
        return block_mask, None, None, None, 1
    flex = _flex_module()

    H = positive_int("heads", heads)
    if BH % H:
        raise ValueError(f"heads={H} must divide batch·heads = {BH} (q's leading axes)")
    score_mod, mask_mod, score_mod_grad = (None if f is None else flex.snapshot(f)
                                           for f in (score_mod, mask_mod, score_mod_grad))
    if direction == "backward" and score_mod is not None and score_mod_grad is None \
            and getattr(python_modifier(score_mod), "grad", None) is None:
        score_mod_grad = flex.derivative(score_mod)   # derived from its source (flashnb.flex_grad); GPU-checked below
    flex.check_modifiers(score_mod=score_mod, mask_mod=mask_mod if mask_mod is not None else bm_mod,
                         score_mod_grad=score_mod_grad if direction == "backward" else None)
    if block_mask is None:
        if mask_mod is not None:
            fwd = default_tiles(d, "forward")
            block_mask = flex.create_block_mask(mask_mod, BH // H, H, Nq, Nk, Br=fwd["Br"] if Br is None else Br,
                                                Bc=fwd["Bc"] if Bc is None else Bc)
        return block_mask, score_mod, mask_mod, score_mod_grad, H
    if mask_mod is not None and (bm_mod is None or (bm_mod != mask_mod and bm_mod.origin is not mask_mod.origin)):
        raise ValueError(f"block_mask was not made from mask_mod {flex.name_of(mask_mod)!r}: pass "
                         "block_mask=flashnb.flex.create_block_mask(mask_mod, ...) or leave block_mask out")
    if bm_mod is not None:
        flex.check_current(bm_mod)
        lead = block_mask.lead if isinstance(block_mask, PreparedMask) else block_mask.mask.shape[:-2]
        flex.check_heads(bm_mod, lead, BH // H, H, Nq, Nk)
    return block_mask, score_mod, bm_mod, score_mod_grad, H


def _storage(storage, **arrays) -> str:
    """The launch's storage (:data:`flashnb.common.STORAGES`): ``storage`` if given, else what q's dtype stands
    for; every array must be in it (TypeError naming the first that is not)."""
    if storage is None:
        storage = storage_of(arrays["q"]) or "float32"
    want = storage_dtype(check_storage(storage))
    for name, a in arrays.items():
        if a is not None and np.dtype(a.dtype) != want:
            raise TypeError(f"fa2 with storage={storage!r} takes {name} as {want} "
                            f"{'(bfloat16 bit patterns) ' if storage == 'bfloat16' else ''}device arrays, got "
                            f"{name} of dtype {a.dtype}")
    return storage


def _dropout_args(dropout_p, seed, score_mod, mask_mod, block_mask):
    """``()`` without dropout (``dropout_p == 0``), else the kernels' extra arguments ``(threshold, inv_keep,
    seed_lo, seed_hi)`` (:func:`flashnb.rng.dropout_kernel_args`); checks them (:func:`flashnb.rng.check_dropout`)
    and refuses dropout with attention modifiers."""
    p = check_dropout(dropout_p, seed)
    if p == 0:
        return ()
    if score_mod is not None or mask_mod is not None or getattr(block_mask, "mask_mod", None) is not None:
        raise ValueError("dropout_p > 0 with attention modifiers (score_mod / mask_mod) is not supported: fa2's "
                         "dropout covers dense, causal, block-sparse (a plain block_mask) and grouped-query attention")
    return dropout_kernel_args(p, seed)


def forward(q, k, v, *, causal=False, scale, Br=None, Bc=None, warps=None, block_mask=None, score_mod=None,
            mask_mod=None, heads=1, score_mod_grad=None, dropout_p=0.0, seed=None, storage=None):
    """Device arrays in, ``(O, L)`` out (FA2 Alg. 1); ``Br, Bc, warps`` default to :func:`default_tiles`.

    ``block_mask`` (a :class:`BlockMask` or a boolean array ``(..., ceil(Nq/Br),
    ceil(Nk/Bc))``): block-sparse FlashAttention, tiles with ``M = 0`` are never loaded; see
    :func:`block_tiles` for how the mask maps onto the kernel's tiles.  ``score_mod``, ``mask_mod`` (and
    ``heads``, the H of ``z = b·H + h``): attention modifiers, see :mod:`flashnb.flex`.  ``k`` and ``v`` may have
    fewer batch·heads than ``q`` (grouped-query attention: query head ``z`` reads K/V head ``z // G``).
    ``score_mod_grad`` is the backward's (accepted here so that one set of options serves both).

    ``dropout_p`` (in ``[0, 1)``) and ``seed`` (an int in ``[0, 2^64)``, required when ``dropout_p > 0``):
    attention dropout (FA1 Alg. 2), each ``P_ij`` kept with probability ``1 - p`` by the Philox mapping of
    :mod:`flashnb.rng` and scaled by ``1/(1-p)``; ``L`` is the log-sum-exp of the undropped scores.  Give the
    backward the same ``dropout_p`` and ``seed``.  ``dropout_p = 0`` launches the kernel without dropout.
    ``storage``: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (uint16 bit patterns), the dtype of q, k, v and
    of the returned O (default: q's); L is float32 whatever the storage."""
    storage = _storage(storage, q=q, k=k, v=v)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = _group(BH, k.shape[0], k, v)
    drop = _dropout_args(dropout_p, seed, score_mod, mask_mod, block_mask)
    block_mask, score_mod, mask_mod, _, H = _flex("forward", score_mod, mask_mod, None, block_mask, heads, BH, Nq, Nk,
                                                  d, Br, Bc)
    t, M = _tiles_and_mask("forward", Br, Bc, warps, block_mask, BH, Nq, Nk, d)
    O = empty((BH, Nq, d), storage=storage)
    L = empty((BH, Nq))
    kernel = make_forward(t["Br"], t["Bc"], d, t["warps"], bool(causal), M is not None, score_mod, mask_mod, H, G > 1,
                          dropout=bool(drop), storage=storage)
    launch(kernel, (cdiv(Nq, t["Br"]), BH), 32 * t["warps"], q, k, v, O, L, scale, causal_diag(causal, Nq, Nk),
           _mask_device(None) if M is None else M, *drop, label="FA2 forward")
    return O, L


def backward(q, k, v, o, lse, do, *, causal=False, scale, Br=None, Bc=None, warps=None, block_mask=None,
             score_mod=None, mask_mod=None, heads=1, score_mod_grad=None, dropout_p=0.0, seed=None, storage=None):
    """FA2 Alg. 2: the D preprocessing launch, then one thread block per K/V column block.  ``block_mask``
    as in :func:`forward` (Q tiles with ``M = 0`` are skipped).  ``score_mod_grad``: ``d score_mod / d score``
    (default: ``score_mod.grad``, which the gallery sets, else derived from its source:
    :func:`flashnb.flex.derivative`).  Grouped-query attention: one thread block per K/V column block
    *of a K/V head*, looping over the query heads of its group; dK, dV are summed on chip.
    ``dropout_p``, ``seed``: the forward's (the mask is regenerated from them; ``o`` is the dropped output).
    ``storage`` (default: q's dtype): q, k, v, o, do and the returned dQ, dK, dV are in it, lse is float32; with
    half storage dQ is summed in a float32 accumulator and narrowed by a third launch (:func:`make_convert`)."""
    storage = _storage(storage, q=q, k=k, v=v, o=o, do=do)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = _group(BH, k.shape[0], k, v)
    drop = _dropout_args(dropout_p, seed, score_mod, mask_mod, block_mask)
    block_mask, score_mod, mask_mod, score_mod_grad, H = _flex("backward", score_mod, mask_mod, score_mod_grad,
                                                               block_mask, heads, BH, Nq, Nk, d, Br, Bc)
    t, M = _tiles_and_mask("backward", Br, Bc, warps, block_mask, BH, Nq, Nk, d)
    D = empty((BH, Nq))
    dQ = empty((BH, Nq, d))                          # float32: the atomics' accumulator
    launch(make_preprocess(storage), (cdiv(Nq, PRE_WARPS), BH), 32 * PRE_WARPS, o, do, D, dQ,
           label="D = rowsum(dO∘O)")
    dK = empty((BH // G, Nk, d), storage=storage)
    dV = empty((BH // G, Nk, d), storage=storage)
    kernel = make_backward(t["Br"], t["Bc"], d, t["warps"], bool(causal), M is not None, score_mod, mask_mod, H,
                           G > 1, score_mod_grad, dropout=bool(drop), storage=storage)
    launch(kernel, (cdiv(Nk, t["Bc"]), BH // G), 32 * t["warps"], q, k, v, do, lse, D, dQ, dK, dV, scale,
           causal_diag(causal, Nq, Nk), _mask_device(None) if M is None else M, *drop, label="FA2 backward")
    if storage != "float32":
        dQh = empty((BH, Nq, d), storage=storage)
        launch(make_convert(storage), (cdiv(Nq * d, CONVERT_THREADS), BH), CONVERT_THREADS, dQ, dQh,
               label=f"dQ -> {storage}")
        dQ = dQh
    return dQ, dK, dV


register_impl("fa2", stage="4",
              description="FlashAttention-2: Q-block grid, split-Q warps, delayed rescaling; dQ by atomics",
              forward=forward, backward=backward,
              options=("Br", "Bc", "warps", "block_mask", "score_mod", "mask_mod", "score_mod_grad", "dropout_p",
                       "seed", "storage"),
              gqa=True)


# --------------------------------------------------------------------------- analytic model


def tiles_visited(Nq, Nk, Br, Bc, causal, direction="forward", block_mask=None):
    """``[(outer, inner, rows, cols), ...]`` -- the (Q tile, K/V tile) pairs a launch computes, with their
    valid row/column counts.  Forward: outer = Q block i, inner = K/V block j; backward the reverse.
    ``block_mask``: a boolean ``(ceil(Nq/Br), ceil(Nk/Bc))`` array at these tiles; pairs with 0 are left out."""
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
    if block_mask is not None:
        ij = (lambda o, n: (o, n)) if direction == "forward" else (lambda o, n: (n, o))
        out = [tile for tile in out if block_mask[ij(tile[0], tile[1])]]
    return out


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


def _model_mask(direction, block_mask, mask_mod, heads, BH, Nq, Nk, d, Br, Bc):
    """The block mask a launch with ``mask_mod`` builds (as :func:`forward` does; no modifier check)."""
    if mask_mod is None:
        return block_mask
    flex = _flex_module()

    if block_mask is None:
        fwd = default_tiles(d, "forward")
        block_mask = flex.create_block_mask(mask_mod, BH // heads, heads, Nq, Nk, Br=fwd["Br"] if Br is None else Br,
                                            Bc=fwd["Bc"] if Bc is None else Bc)
    return block_mask


def itemsizes(storage="float32") -> dict:
    """Bytes per element of every global array the fa2 launches touch, by kernel parameter name: Q, K, V, O, dO,
    dK, dV and the converted dQh in ``storage`` (4 or 2 bytes); L, D and the dQ accumulator always 4 (float32);
    the block mask M 1 (uint8)."""
    h = storage_dtype(storage).itemsize
    return dict(Q=h, K=h, V=h, O=h, dO=h, dK=h, dV=h, dQh=h, L=4, D=4, dQ=4, M=1)


def model_bytes(model, storage="float32") -> list:
    """A traffic model (elements, CONTRIBUTING.md's format) in bytes at ``storage``: per launch
    ``dict(launch, read_bytes, write_bytes, atomic_bytes)``, each the sum of elements × :func:`itemsizes` --
    what :class:`flashnb.instruments.traffic.LaunchTraffic` reports as ``read_bytes`` and ``write_bytes`` of a counted
    launch."""
    size = itemsizes(storage)
    return [dict(launch=m["launch"], read_bytes=sum(n * size[a] for a, n in m["reads"].items()),
                 write_bytes=sum(n * size[a] for a, n in m["writes"].items()),
                 atomic_bytes=sum(n * size[a] for a, n in m["atomics"].items())) for m in model]


def model_forward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None, block_mask=None, mask_mod=None,
                  heads=1, group=1, storage="float32"):
    """Element accesses of :func:`forward` (one launch): Q, O, L once; K_j, V_j once per visited tile.

    Shared: Q_i written once per block (``Br·d``), K_j and V_j per tile (``Bc·d + Bc·Dp``); per tile each of
    the ``32·warps`` threads reads ``d·(TM + TN)`` (S) and ``Bc·DN`` (V) elements.
    Block-sparse (``block_mask``): visited tiles = those with ``M_ij = 1``, and lane 0 of each warp reads
    ``M_ij`` (one byte, shuffled to the other lanes) once per tile the causal limit lets it reach, and, with a
    ``mask_mod``, once more per visited tile (full or partial?).  ``mask_mod`` (with ``heads``, or a
    ``block_mask`` from :func:`flashnb.flex.create_block_mask`): the visited tiles are the non-empty ones; a
    modifier's per-element work and captured arrays (constant memory on a GPU) are no global traffic.
    ``group`` (GQA, ``BH_q / BH_kv``) changes nothing here: every query head's blocks stream their K/V
    tiles, the group's heads read the same (smaller) K/V tensors.  ``storage`` changes no element count (the
    tiles are float32 whatever HBM holds); bytes per element: :func:`itemsizes`, totals: :func:`model_bytes`."""
    check_storage(storage)
    block_mask = _model_mask("forward", block_mask, mask_mod, heads, BH, Nq, Nk, d, Br, Bc)
    t, M = block_tiles(d, "forward", Br, Bc, warps, block_mask, BH, Nq, Nk)
    g = geometry(t["Br"], t["Bc"], d, t["warps"])
    per_head, checked = _visited_per_head(Nq, Nk, t, causal, "forward", M, BH)
    kv = sum(cols for visited in per_head for _, _, _, cols in visited) * d
    n = sum(len(visited) for visited in per_head)
    again = n * t["warps"] if getattr(block_mask, "mask_mod", None) is not None else 0   # flex: full or partial?
    per_tile_reads = g["threads"] * (d * (g["TM"] + g["TN"]) + t["Bc"] * g["DN"])
    return [_launch("FA2 forward", {"Q": BH * Nq * d, "K": kv, "V": kv, "M": BH * checked * t["warps"] + again},
                    {"O": BH * Nq * d, "L": BH * Nq},
                    shared_reads=n * per_tile_reads,
                    shared_writes=BH * cdiv(Nq, t["Br"]) * t["Br"] * d + n * t["Bc"] * (d + g["Dp"]))]


def model_backward(BH, Nq, Nk, d, *, causal=False, Br=None, Bc=None, warps=None, block_mask=None, mask_mod=None,
                   heads=1, group=1, storage="float32"):
    """Element accesses of :func:`backward`: the preprocessing launch (O, dO read, D and dQ = 0 written),
    then the main launch -- K_j, V_j once per column block; Q_i, dO_i, L_i, D_i once per visited tile;
    ``rows·d`` atomic adds into dQ per visited tile; dK, dV written once.  Block-sparse: as in
    :func:`model_forward` (visited = ``M_ij = 1``, plus one one-byte read of ``M`` per warp per tile).
    ``group`` (GQA): one block per K/V column block of each of the ``BH/group`` K/V heads, looping over the group's
    query heads -- K, V read and dK, dV written once per K/V head, not per query head.  Half ``storage``: a third
    launch reads the float32 dQ accumulator once and writes dQh (:func:`make_convert`); bytes: :func:`model_bytes`."""
    check_storage(storage)
    block_mask = _model_mask("backward", block_mask, mask_mod, heads, BH, Nq, Nk, d, Br, Bc)
    t, M = block_tiles(d, "backward", Br, Bc, warps, block_mask, BH, Nq, Nk)
    BHkv = BH // positive_int("group", group)
    Br_, Bc_ = t["Br"], t["Bc"]
    g = geometry(Bc_, Br_, d, t["warps"])
    per_head, checked = _visited_per_head(Nq, Nk, t, causal, "backward", M, BH)
    q_rows = sum(rows for visited in per_head for _, _, rows, _ in visited)
    n = sum(len(visited) for visited in per_head)
    again = n * t["warps"] if getattr(block_mask, "mask_mod", None) is not None else 0   # flex: full or partial?
    pre = _launch("D = rowsum(dO∘O)", {"O": BH * Nq * d, "dO": BH * Nq * d}, {"D": BH * Nq, "dQ": BH * Nq * d})
    per_tile_reads = (g["threads"] * (2 * d * (g["TM"] + g["TN"]) + 2 * g["TN"] + 2 * Br_ * g["DN"])
                      + 2 * Br_ * d * Bc_)
    per_tile_writes = 2 * g["Dp"] * Br_ + 2 * Br_ + Bc_ * Br_
    main = _launch("FA2 backward",
                   {"Q": q_rows * d, "K": BHkv * Nk * d, "V": BHkv * Nk * d, "dO": q_rows * d,
                    "L": q_rows, "D": q_rows, "M": BH * checked * t["warps"] + again},
                   {"dK": BHkv * Nk * d, "dV": BHkv * Nk * d}, {"dQ": q_rows * d},
                   shared_reads=n * per_tile_reads,
                   shared_writes=BHkv * cdiv(Nk, Bc_) * 2 * d * Bc_ + n * per_tile_writes)
    if storage == "float32":
        return [pre, main]
    return [pre, main, _launch(f"dQ -> {storage}", {"dQ": BH * Nq * d}, {"dQh": BH * Nq * d})]


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

