"""Stage 7 -- FlashAttention-2 on tensor cores: the matmuls as ``mma.sync``, fed by ``ldmatrix`` and ``cp.async``.

FA2's Section 3.1 argument is about tensor cores: an A100 multiplies matrices 16x faster (312 TFLOP/s FP16) than
it does anything else (19.5 TFLOP/s FP32), so every non-matmul FLOP costs as much as 16 matmul FLOPs.  Stages 4-6
ran the matmuls on the FP32 cores, where the softmax's exponentials and rescaling were noise beside the FFMAs.
Here ``S = Q_i K_jᵀ`` and ``P V_j`` are warp-level MMAs (:mod:`flashnb.kernels.mma`: inline PTX from Numba, with
simulator twins), and the same softmax becomes a real cost (notebook 12 measures it in the SASS).

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

**The backward's tiles** (FA2 Alg. 2, :func:`make_backward`): a warp owns 16 keys of ``K_j`` and keeps their
``dK_j, dV_j`` in registers -- at d = 128 half of a lane's 255 -- so a Q tile is ``Br = 16`` queries there, and
what is left to choose is ``Bc = 16·warps``: every K/V block reads all of ``Q``, ``dO`` and adds into all of
``dQ`` once, so ``Bc`` sets how often they cross HBM.  At d = 128 the default is ``Bc = 128`` over eight warps (as
FA2's own d = 128 backward): 77,824 B of tiles, more than the 48 KiB a block may declare statically, so they are
*dynamic* shared memory, granted after the driver opt-in (``common.allow_dynamic_shared``, as stage 6's d = 128
forward).  A device that refuses it runs static tiles (``Bc = 32``, two warps; bfloat16 ``Bc = 64``, four) with a
``RuntimeWarning``; :data:`last_backward` says what ran.

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

Kernel ``"fa2_tc.forward"`` (:func:`make_forward`); impl ``"fa2-tc"``, stage 7.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint16, uint32
from numba.core.types import float16  # noqa: E402  (numba exports no float16 at the top level)

from .. import modifiers
from ..common import (
    NEG_INF,
    ONE,
    SHARED_LIMIT_BYTES,
    ZERO,
    allow_dynamic_shared,
    causal_diag,
    cdiv,
    check_shared_fit,
    empty,
    launch,
    opt_in_or_fall_back,
    shared_optin_limit,
    storage_array_type,
    storage_conversions,
    storage_of,
    warn_fallback,
)
from ..registry import kernel_factory, register_impl
from . import policies, tiles
from .models import visited_per_head
from .policies import EMPTY, FULL, PARTIAL
from .tensorcore import mma
from .tensorcore.mma import SHARED_ALIGN

__all__ = ["make_forward", "forward", "geometry", "shared_bytes", "default_tiles", "model_forward", "hbm_bytes",
           "sass_config", "sass_shape", "launch_order", "model_options", "check_inputs", "ARCHS", "LOG2E", "LN2",
           "STORAGES", "make_backward", "backward", "bwd_geometry", "bwd_shared_bytes", "bwd_default_tiles",
           "bwd_needs_dynamic", "last_backward", "model_backward", "bwd_sass_config", "bwd_sass_shape",
           "bwd_launch_order", "edge_tile", "bwd_edge_tile", "BWD_LABEL", "measure_gpu", "TF32_MAX_D", "TF32_MAX_D_BWD"]

LOG2E = float32(1.4426950408889634)
POS_INF = float32(math.inf)
LN2 = float32(0.6931471805599453)
FULL_MASK = 0xFFFFFFFF
#: The storages fa2-tc takes: float16 and bfloat16 (m16n8k16), float32 (through TF32, m16n8k8).
STORAGES = ("float16", "bfloat16", "float32")
#: The largest head dim of float32 (TF32) inputs, forward and backward: beyond them every tile choice spills.
TF32_MAX_D, TF32_MAX_D_BWD = 64, 32
#: The architectures each configuration compiles for.
ARCHS = {80: ((8, 0), (9, 0)), 75: ((7, 5),)}

_SHARED_TYPE = {"float16": float16, "bfloat16": uint16, "float32": uint32}   # what a shared tile holds
_SIGN = {"float16": uint32(0x80008000), "bfloat16": uint32(0x80008000), "float32": uint32(0x80000000)}  # sign bits
_A2 = "float32[:, ::1]"
_M = "uint8[:, :, ::1]"                  # the block mask's tile states (a 1x1x1 placeholder without one)


def _fwd_sig(storage="float16", **_):
    h = storage_array_type(storage)
    return f"void({h}, {h}, {h}, {h}, {_A2}, float32, int32, {_M}, {policies.DROPOUT_SIG})"


def geometry(storage: str, d: int, Br: int, Bc: int, warps: int, arch: int = 80) -> dict:
    """Sizes of one configuration: ``E`` elements per 16-byte chunk (8 halves, 4 floats), ``KS`` the MMA's k (16
    halves, 8 floats), ``Dp`` = d padded to ``KS``, ``MT`` m-tiles of 16 rows per warp, ``NB`` 8-key n-tiles of S,
    ``ND`` 8-wide n-tiles of O, ``LD`` the shared row length (``Dp``'s chunks rounded up to a power of two, for the
    swizzle), ``copy`` ``"async"`` (cp.async double buffering) or ``"sync"``.  ValueError naming what is wrong."""
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {list(STORAGES)} for fa2-tc, got {storage!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)} (sm_80+ or sm_75), got {arch!r}")
    if arch == 75 and storage != "float16":
        raise ValueError(f"fa2-tc on sm_75 takes float16 only (no bf16 or tf32 tensor cores there), got {storage!r}")
    if not 1 <= d <= 128:
        raise ValueError(f"head dim d must be in 1..128 for fa2-tc, got {d}")
    if storage == "float32" and d > TF32_MAX_D:
        raise ValueError(f"head dim d must be <= {TF32_MAX_D} for fa2-tc's forward with float32 (TF32) inputs (its "
                         f"fragments take twice the registers), got {d}: use float16/bfloat16, or impl='fa2-fast'")
    for name, v in (("Br", Br), ("Bc", Bc), ("warps", warps)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    tf32 = storage == "float32"
    E, KS = (4, 8) if tf32 else (8, 16)
    if Br % (16 * warps):
        raise ValueError(f"Br={Br} must be a multiple of 16·warps = {16 * warps} (each warp owns m-tiles of 16 rows)")
    if Bc % 16:
        raise ValueError(f"Bc={Bc} must be a multiple of 16 (pairs of 8-key n-tiles per ldmatrix, and the MMA's k "
                         "over the keys in P·V_j)")
    Dp = cdiv(d, 16) * 16                              # the MMA's k (16 halves; 8 floats, twice: n-tile pairs)
    chunks = Dp // E
    LDC = 1 << (chunks - 1).bit_length()               # chunks per shared row: a power of two
    copy = "async" if (arch >= 80 and not tf32 and d % E == 0) else "sync"
    stages = 2 if copy == "async" else 1
    LD = LDC * E
    QN, KN = Br * LD, Bc * LD
    # one shared array: Q_i at 0, then a stage (K_j, V_j) after it; a second stage (async) lives in Q_i's space once
    # its fragments are in registers, when it fits there
    if stages == 1:
        offsets, total = ((0,), QN) if QN >= 2 * KN else ((QN,), QN + 2 * KN)
    else:
        offsets, total = ((QN, 0), QN + 2 * KN) if QN >= 2 * KN else ((QN, QN + 2 * KN), QN + 4 * KN)
    return dict(d=d, E=E, KS=KS, Dp=Dp, MT=Br // (16 * warps), NB=Bc // 8, ND=Dp // 8, KD=Dp // KS, KV=Bc // KS,
                LD=LD, LDC=LDC, threads=32 * warps, copy=copy, stages=stages, itemsize=2 if not tf32 else 4,
                KN=KN, q_offset=0, stage_offsets=offsets, total=total)


def shared_bytes(storage, d, Br, Bc, warps, arch=80) -> int:
    """Static shared memory of one forward block: Q_i, and K_j, V_j in one buffer each per stage."""
    g = geometry(storage, d, Br, Bc, warps, arch)
    return g["itemsize"] * g["total"]


# Tiles per head-dim class and storage, chosen with the SASS time model (scripts/stage7_goals.py) within 48 KiB of
# static shared memory and 255 registers without spills (ptxas, sm_80 and sm_90, causal or not): two m-tiles per
# warp would halve the shared-memory traffic per MMA (every K_j, V_j fragment an ldmatrix brings would serve 32
# rows), but at d = 64 the causal kernel's two copies of the tile loop then spill: one m-tile, eight warps.  TF32
# takes twice the registers per element of Q_i's fragments: four warps, Bc = 32, d <= 64 (beyond it every tile
# choice spills).
_DEFAULTS = {"half": {64: dict(Br=128, Bc=64, warps=8), 128: dict(Br=128, Bc=32, warps=8)},
             "float32": {64: dict(Br=64, Bc=32, warps=4)}}


def default_tiles(d: int, storage: str = "float16") -> dict:
    """The default ``Br, Bc, warps`` at head dim ``d`` (the smallest listed class >= d) for ``storage``."""
    table = _DEFAULTS["float32" if storage == "float32" else "half"]
    for dmax in sorted(table):
        if d <= dmax:
            return dict(table[dmax])
    if storage == "float32" and 1 <= d <= 128:
        geometry(storage, d, 16, 16, 1)            # the ValueError naming the limit
    raise ValueError(f"head dim d must be in 1..128 for fa2-tc, got {d}")


_MODS = dict(score_mod="flashnb.kernels.policies:GUARD_ALIBI", mask_mod="flashnb.kernels.policies:GUARD_WINDOW")
_MODS_2 = dict(score_mod="flashnb.kernels.policies:GUARD_SOFTCAP",
               mask_mod="flashnb.kernels.policies:GUARD_DOCUMENT")
_GRADS = dict(score_mod_grad="flashnb.kernels.policies:_alibi_grad")
_GRADS_2 = dict(score_mod_grad="flashnb.kernels.policies:_softcap_grad")


def _configs():
    """What the PTX guard compiles: the default tiles at d = 64 and 128 for each storage (causal off and on for
    float16), odd head dims (d = 20: plain copies and padding; d = 72: Dp = 80, a row of 10 chunks in 16), one
    m-tile per warp, the sm_75 forward, GQA, dropout, and both pairs of modifiers with a block mask at the tiles a
    mask's default blocks give (:func:`_fit_mask`)."""
    out = []
    for d, st, causal in ((64, "float16", False), (64, "float16", True), (128, "float16", False),
                          (128, "float16", True), (64, "bfloat16", True), (128, "bfloat16", False),
                          (64, "float32", True), (64, "float32", False)):
        out.append(dict(**default_tiles(d, st), d=d, causal=causal, storage=st, arch=80))
    out += [dict(Br=64, Bc=32, warps=2, d=20, causal=True, storage="float16", arch=80),
            dict(Br=32, Bc=32, warps=2, d=72, causal=False, storage="bfloat16", arch=80),
            dict(Br=64, Bc=32, warps=4, d=64, causal=True, storage="float16", arch=75),
            dict(**default_tiles(64), d=64, causal=True, storage="float16", arch=80, gqa=True),
            dict(**default_tiles(64), d=64, causal=True, storage="float16", arch=80, dropout=True),
            dict(**default_tiles(128, "bfloat16"), d=128, causal=False, storage="bfloat16", arch=80, dropout=True),
            dict(Br=64, Bc=32, warps=4, d=64, causal=False, storage="float16", arch=80, sparse=True, H=4, gqa=True,
                 **_MODS),
            dict(Br=32, Bc=32, warps=2, d=128, causal=True, storage="bfloat16", arch=80, sparse=True, H=4, **_MODS_2)]
    return out


def _archs(arch=80, **_):
    return ARCHS[arch]


def _layout(LD, E, swizzle=True):
    """The swizzled layout of a tile with rows of ``LD`` elements (a power of two of 16-byte chunks of ``E``):
    ``swz(r)``, ``chunk_at(r, c)`` (element index of chunk ``c`` of row ``r``) and ``at(r8, lane, c)`` (the row
    ``r8 + lane % 8`` an ldmatrix lane addresses, ``r8`` a multiple of 8: its swizzle depends on the lane only).
    ``swizzle=False``: chunks where they are (notebook 12's counter-example: 8-way conflicts at d = 64)."""
    LDC = LD // E
    RS = max(1, 8 // LDC)                # rows that share a 128-byte line of banks
    SM = min(LDC, 8) if swizzle else 1   # the swizzle's period in chunks (1: none)

    @cuda.jit(device=True, inline="always")
    def swz(r):
        """The swizzle of row ``r``: its chunks are XOR-ed with this (rows that share a line of banks differ)."""
        return (uint32(r) // uint32(RS)) % uint32(SM)

    @cuda.jit(device=True, inline="always")
    def chunk_at(r, c):
        """Element index of chunk ``c`` of tile row ``r``: stored at chunk ``c ^ swz(r)``."""
        return uint32(r) * uint32(LD) + ((uint32(c) ^ swz(r)) * uint32(E))

    @cuda.jit(device=True, inline="always")
    def at(r8, lane, c):
        """Shared index of chunk ``c`` of row ``r8 + lane % 8`` (``r8`` a multiple of 8): the ldmatrix row this lane
        addresses."""
        return uint32(r8 + lane % 8) * uint32(LD) + ((uint32(c) ^ swz(lane % 8)) * uint32(E))

    return swz, chunk_at, at


def _make_policies(storage, g, arch, swizzle=True):
    """The device functions the kernels call, chosen once per configuration: the swizzled shared index, the tile
    copy (async or plain), the MMA of one k-step and the packing of P into A registers."""
    E, LD, Dp, NT, d = g["E"], g["LD"], g["Dp"], g["threads"], g["d"]
    CH = Dp // E                         # chunks of a tile row that hold data
    FULL_D = d == Dp                     # no chunk beyond d: the column test compiles away
    to_f32, from_f32 = storage_conversions(storage)
    tf32 = storage == "float32"
    copy_async = g["copy"] == "async"
    swz, chunk_at, at = _layout(LD, E, swizzle)

    @cuda.jit(device=True, inline="always")
    def to_shared(x):
        """A global element as the shared tile holds it: halves as they are, float32 rounded to TF32 bits."""
        if tf32:
            return mma.to_tf32(x)
        return x

    @cuda.jit(device=True, inline="always")
    def load_chunk(Xz, S, base, r0, N, r, c):
        """Chunk ``c`` of row ``r0 + r`` of ``Xz`` (one head) into row ``r`` of the tile at ``S[base:]``; zeros
        beyond ``N`` rows and ``d`` columns.  Async: one cp.async of 16 bytes (the caller commits and waits; a
        chunk outside the array copies 0 bytes from its row 0); sync: element by element."""
        row = uint32(r0) + uint32(r)
        dst = uint32(base) + chunk_at(r, c)
        if copy_async:
            ok = row < uint32(N) and (FULL_D or uint32(c) * uint32(E) < uint32(d))
            mma.cp_async_16(S, dst, Xz, (row if ok else uint32(0), uint32(c) * uint32(E) if ok else uint32(0)),
                            uint32(16) if ok else uint32(0))
        else:
            for k in range(E):
                col = uint32(c) * uint32(E) + uint32(k)
                v = to_shared(from_f32(ZERO))
                if row < uint32(N) and col < uint32(d):
                    v = to_shared(Xz[row, col])
                S[dst + uint32(k)] = v

    @cuda.jit(device=True, inline="always")
    def load_tile(Xz, S, base, r0, N, ROWS, tid):
        """Rows ``r0 .. r0+ROWS`` of ``Xz`` into the tile at ``S[base:]``: consecutive threads copy consecutive
        chunks of a row (ideal sectors, conflict-free stores); a pass of the block covers ``NT`` chunks.  With
        ``NT`` a multiple of the chunks per row a thread keeps its column and steps its row by a constant (the
        passes unroll: no loop, no division)."""
        if NT % CH == 0:
            for k in range((ROWS * CH + NT - 1) // NT):
                r = uint32(tid // CH) + uint32(k * (NT // CH))
                if (ROWS * CH) % NT == 0 or r < uint32(ROWS):
                    load_chunk(Xz, S, base, r0, N, r, uint32(tid % CH))
        else:
            for k in range((ROWS * CH + NT - 1) // NT):
                e = uint32(tid) + uint32(k * NT)
                if e < uint32(ROWS * CH):
                    load_chunk(Xz, S, base, r0, N, e // uint32(CH), e % uint32(CH))

    if tf32:
        mma_k = mma.mma_m16n8k8_tf32
    elif storage == "bfloat16":
        mma_k = mma.mma_m16n8k16_bf16
    elif arch >= 80:
        mma_k = mma.mma_m16n8k16_f16
    else:
        @cuda.jit(device=True, inline="always")
        def mma_k(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            """sm_75: one k-step of 16 as two m16n8k8 (k 0-7: registers a0, a1, b0; k 8-15: a2, a3, b1)."""
            c0, c1, c2, c3 = mma.mma_m16n8k8_f16(a0, a1, b0, c0, c1, c2, c3)
            return mma.mma_m16n8k8_f16(a2, a3, b1, c0, c1, c2, c3)

    pack2 = mma.pack_bf16x2 if storage == "bfloat16" else mma.pack_f16x2

    @cuda.jit(device=True, inline="always")
    def p_fragment(c00, c01, c02, c03, c10, c11, c12, c13):
        """The A fragment of ``P V_j`` for one k-step from the S accumulators of its 8-key tiles (``c0*``: the
        first, ``c1*``: the second).  Halves: two 8-key tiles, packed in pairs and rounded to the input dtype;
        TF32: one 8-key tile (the ``c1*`` are ignored), its key order permuted (a0 = c0, a1 = c2, a2 = c1,
        a3 = c3) -- V's rows are read in the same order."""
        if tf32:
            return mma.to_tf32(c00), mma.to_tf32(c02), mma.to_tf32(c01), mma.to_tf32(c03)
        return pack2(c00, c01), pack2(c02, c03), pack2(c10, c11), pack2(c12, c13)

    return dict(swz=swz, chunk_at=chunk_at, at=at, load_tile=load_tile, mma_k=mma_k, p_fragment=p_fragment,
                from_f32=from_f32, to_f32=to_f32, to_shared=to_shared)


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
    ``mask_mod``, ``H``: the product kernel's modifier policies on the S fragments (``b = z // H``, ``h = z % H``)."""
    g = geometry(storage, d, Br, Bc, warps, arch)
    MT, NB, ND, KD, KV, LD, E = g["MT"], g["NB"], g["ND"], g["KD"], g["KV"], g["LD"], g["E"]
    ASYNC, TF32, KN, TOTAL, QO = g["copy"] == "async", storage == "float32", g["KN"], g["total"], g["q_offset"]
    S0, S1 = g["stage_offsets"][0], g["stage_offsets"][-1]
    # region policies
    P = _make_policies(storage, g, arch)
    # endregion policies
    swz, at, load_tile, mma_k, p_fragment, from_f32 = P["swz"], P["at"], P["load_tile"], P["mma_k"], \
        P["p_fragment"], P["from_f32"]
    SDT = _SHARED_TYPE[storage]
    SIGN = _SIGN[storage]
    kv_head = policies.gqa(gqa)[0]
    drop_state, keep_bits, factor = policies.dropout(dropout)
    H = policies.check_features(sparse, mask_mod, dropout, H, 2 * NB)   # bits: one (mt, e) row pair
    tile_state, is_set = policies.tile_state(sparse), policies.is_set
    score, allowed_bits, _ = policies.modifiers(score_mod, mask_mod, H)
    SCORED, MASK_MOD = score_mod is not None, mask_mod is not None

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
        bi = cuda.blockIdx.x
        if causal:                                     # heavy first: the last Q block sees the most K/V tiles
            bi = cuda.gridDim.x - 1 - cuda.blockIdx.x
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
        n_tiles = (Nk + Bc - 1) // Bc                  # line 5 (causal: no tile entirely above the diagonal)
        n_full = Nk // Bc                              # the leading tiles that need no mask
        if causal:
            last = min(i0 + Br, Nq) - 1 + diag
            n_tiles = min(n_tiles, last // Bc + 1) if last >= 0 else 0
            n_full = min(n_full, max(0, (i0 + diag + 1) // Bc))
        n_full = min(n_full, n_tiles)
        j, st = 0, int32(FULL)                         # the first tile visited (with a block mask: not EMPTY)
        if sparse:
            j, st = next_tile(M, z, bi, 0, n_tiles, lane)
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

    return fa2_tc_forward


# --------------------------------------------------------------------------- backward (FA2 Alg. 2)


def _bwd_sig(storage="float16", **_):
    h = storage_array_type(storage)
    a3 = "float32[:, :, ::1]"
    return f"void({h}, {h}, {h}, {h}, {_A2}, {_A2}, {a3}, {h}, {h}, float32, int32, {_M}, {policies.DROPOUT_SIG})"


def bwd_geometry(storage: str, d: int, Br: int, Bc: int, warps: int) -> dict:
    """Sizes of one backward configuration (FA2 Alg. 2: a block keeps ``K_j, V_j``, ``Bc = 16·warps`` keys, one
    m-tile of 16 per warp, and visits the ``Br``-row Q tiles; ``Br`` a multiple of ``16·warps``, ``QM =
    Br / (16·warps)`` m-tiles of dQ per warp).  Shared: K_j, V_j, Q_i, dO_i in swizzled rows of ``LD``, dSᵀ in rows
    of ``LDS`` (the Br queries), L_i and D_i.  ``kv_regs``: K_j and V_j's A fragments stay in registers (``KD <=
    4`` k-steps: d <= 64 halves, d <= 32 floats); ``k_regs``: how many k-steps of K_j's stay in registers (all with
    ``kv_regs``; halves at d = 128 over eight warps: seven of eight, V_j's and the last of K_j's reloaded per Q
    tile); ``one_loop``: ``Dp > 64``, where dK_j, dV_j fill half the registers (one copy of the tile loop, L_i and
    D_i read once per lane and query); ``CPT``: dQ_i's columns are computed in that many parts (registers)."""
    if Bc != 16 * warps:
        raise ValueError(f"Bc={Bc} must be 16·warps = {16 * warps} in the backward (each warp owns 16 keys of K_j)")
    if Br % 16:
        raise ValueError(f"Br={Br} must be a multiple of 16 (the m-tiles of dQ_i)")
    if storage == "float32" and d > TF32_MAX_D_BWD:
        raise ValueError(f"head dim d must be <= {TF32_MAX_D_BWD} for fa2-tc's backward with float32 (TF32) inputs "
                         f"(its fragments take twice the registers), got {d}: use float16/bfloat16, or "
                         "impl='fa2-fast'")
    g = geometry(storage, d, 16 * warps, Bc, warps)     # the row layout, copies and MMA (independent of Br)
    RT = Br // 16                                      # dQ_i's 16-row m-tiles, each cut into CPT column parts
    CPT = max(1, g["Dp"] // 32)                        # of at most 32 columns (16 accumulator registers), and more
    while g["Dp"] % (16 * CPT):                        # each part whole pairs of 8-column n-tiles (one ldmatrix.x4
        CPT += 1                                       # of K_j gives two): Dp = 80 -> 5 parts, 112 -> 7
    while RT * CPT < warps and g["Dp"] % (32 * CPT) == 0:   # while that leaves warps without a part
        CPT *= 2
    NDQ = g["Dp"] // CPT // 8
    if NDQ % 2 or CPT * NDQ * 8 != g["Dp"]:            # (every column of dQ_i in exactly one part)
        raise AssertionError(f"dQ's parts do not tile Dp={g['Dp']}: CPT={CPT}, NDQ={NDQ}")
    E, LD = g["E"], g["LD"]
    LDSC = 1 << (Br // E - 1).bit_length()
    LDS = max(LDSC, 1) * E
    KN, QN = Bc * LD, Br * LD
    kv_regs = g["KD"] <= 4                             # (halves: d <= 64; TF32: d <= 32)
    # d = 128 over eight warps (MIO-bound: every k-step of K_j kept saves an ldmatrix.x4 per Q tile): seven of K_j's
    # eight k-steps fit beside dK_j, dV_j (all eight spill on sm_90; fewer warps are HBM-bound and keep none)
    k_regs = g["KD"] if kv_regs else (g["KD"] - 1 if storage != "float32" and g["KD"] == 8 and warps == 8 else 0)
    # dSᵀ after dO_i -- or, when V_j's A fragments stay in registers, in V_j's space (free once they are loaded)
    dso = KN if kv_regs and Bc * LDS <= KN else 2 * KN + 2 * QN
    offsets = dict(K=0, V=KN, Q=2 * KN, dO=2 * KN + QN, dS=dso)
    total = 2 * KN + 2 * QN + (Bc * LDS if dso > KN else 0)
    return dict(g, NQ=Br // 8, KQ=Br // g["KS"], KK=Bc // g["KS"], LDS=LDS, offsets=offsets, total=total,
                kv_regs=kv_regs, k_regs=k_regs, one_loop=g["Dp"] > 64, CPT=CPT, PARTS=RT * CPT,
                IPW=cdiv(RT * CPT, warps), NDQ=NDQ, copy=g["copy"])


def bwd_shared_bytes(storage, d, Br, Bc, warps) -> int:
    """Static shared memory of one backward block: the tiles (their storage's bytes) and L_i, D_i (float32)."""
    return _bwd_dynamic_bytes(Br, Bc, d, warps, storage, dynamic=True) + 4 * 2 * Br


# d = 64: eight warps of 16 keys (Bc = 128 halves the Q_i, dO_i and dQ re-reads of Bc = 64: the model's HBM bytes),
# dSᵀ in V_j's space.  d = 128: dK_j, dV_j of 16 keys x 128 columns hold half a lane's registers, so a warp keeps 16
# keys and Br = 16 queries whatever Bc is; Bc = 128 (eight warps, as FA2's own d = 128 backward) cuts the Q_i, dO_i
# re-reads and the dQ atomics to a quarter of Bc = 32's, and needs 77,824 B: dynamic shared memory with the driver
# opt-in.  Where the device (or the opt-in call) refuses it, the launcher falls back to _BWD_STATIC (within 48 KiB).
# TF32: K_j, V_j's fragments take twice the registers per element: d <= 32 (beyond it every tile choice spills).
# bfloat16 at d = 64: Br = 16 (its causal kernel spills 76 bytes on sm_80 with Br = 32, where float16's fits in 254
# registers).  (scripts/stage7_goals.py has the model's verdict on each.)
_BWD_DEFAULTS = {"float16": {64: dict(Br=32, Bc=128, warps=8), 128: dict(Br=16, Bc=128, warps=8)},
                 "bfloat16": {64: dict(Br=16, Bc=128, warps=8), 128: dict(Br=16, Bc=128, warps=8)},
                 "float32": {32: dict(Br=16, Bc=32, warps=2)}}
# The fallback when dynamic shared memory is refused: the largest tiles within 48 KiB of static shared memory that
# compile without spills (float16's non-causal kernel spills at Bc = 48 and 64; bfloat16's does not).
_BWD_STATIC = {"float16": {128: dict(Br=16, Bc=32, warps=2)}, "bfloat16": {128: dict(Br=16, Bc=64, warps=4)}}
# GQA's loop over a K/V head's query heads takes registers: float16 at d = 64 with Br = 32 then spills.
_BWD_GQA = {"float16": {64: dict(Br=16, Bc=128, warps=8)}}
#: What the last :func:`backward` launch ran with: ``dict(d=, Br=, Bc=, warps=, dynamic=, shared_bytes=, fallback=None
#: or the reason it fell back to the static tiles)``.
last_backward: dict = {}


def bwd_default_tiles(d: int, storage: str = "float16", gqa: bool = False, static: bool = False) -> dict:
    """The backward's default ``Br, Bc, warps`` at head dim ``d`` for ``storage`` (no spills; within the A100's
    opt-in shared memory, :data:`flashnb.kernels.tiles.DESIGN_OPTIN_BYTES`); ``gqa``: for K/V with fewer heads than
    Q; ``static``: the largest within 48 KiB of static shared memory (the fallback when dynamic shared memory is
    refused)."""
    key = storage if storage in _BWD_DEFAULTS else "float16"
    table = _BWD_DEFAULTS[key]
    if gqa:
        table = {**table, **_BWD_GQA.get(storage, {})}
    if static:
        table = {**table, **_BWD_STATIC.get(key, {})}
    for dmax in sorted(table):
        if d <= dmax:
            return dict(table[dmax])
    if storage == "float32" and 1 <= d <= 128:
        bwd_geometry(storage, d, 16, 16, 1)        # the ValueError naming the limit
    raise ValueError(f"head dim d must be in 1..128 for fa2-tc, got {d}")


def bwd_needs_dynamic(storage, d, Br, Bc, warps) -> bool:
    """Whether these backward tiles need more than 48 KiB of shared memory (then: the dynamic build, after the
    driver opt-in)."""
    return bwd_shared_bytes(storage, d, Br, Bc, warps) > SHARED_LIMIT_BYTES


def _bwd_configs():
    """The backward configs the PTX guard compiles: default tiles at d = 64 and 128 (K_j, V_j fragments in
    registers, and reloaded; dQ in one and in two passes; d = 128's in dynamic shared memory, and the static tiles
    it falls back to) for each storage, causal on and off, an odd d, d = 80 and 112 (dQ in odd counts of n-tile
    pairs), GQA and dropout."""
    out = []
    for d, st, causal in ((64, "float16", False), (64, "float16", True), (128, "float16", False),
                          (128, "float16", True), (64, "bfloat16", True), (128, "bfloat16", False),
                          (32, "float32", True), (32, "float32", False)):
        out.append(dict(**bwd_default_tiles(d, st), d=d, causal=causal, storage=st))
    out += [dict(**bwd_default_tiles(128, st, static=True), d=128, causal=c, storage=st)    # the static fallback
            for st in ("float16", "bfloat16") for c in (False, True)]
    out.append(dict(Br=32, Bc=32, warps=2, d=20, causal=True, storage="float16"))
    # dQ_i in parts of 16 columns where Dp's n-tile pairs are odd in number (Dp = 80: five, 112: seven)
    out += [dict(**bwd_default_tiles(80), d=80, causal=True, storage="float16"),
            dict(**bwd_default_tiles(112, "bfloat16"), d=112, causal=False, storage="bfloat16")]
    for d, causal in ((64, True), (64, False), (128, True)):   # GQA: a block loops over its K/V head's query heads
        out.append(dict(**bwd_default_tiles(d, gqa=True), d=d, causal=causal, storage="float16", gqa=True))
    for d, st, causal in ((64, "float16", True), (128, "float16", False)):   # dropout: Z regenerated per tile
        out.append(dict(**bwd_default_tiles(d, st), d=d, causal=causal, storage=st, dropout=True))
    mods = dict(storage="float16", sparse=True, H=4)             # modifiers and block masks (at 64 x 32 blocks)
    out += [dict(Br=32, Bc=32, warps=2, d=64, causal=False, **mods, **_MODS, **_GRADS),
            dict(Br=32, Bc=32, warps=2, d=64, causal=True, gqa=True, **mods, **_MODS_2, **_GRADS_2),
            dict(**bwd_default_tiles(128, static=True), d=128, causal=True, **mods, mask_mod=_MODS_2["mask_mod"])]
    for c in out:                                                # over 48 KiB: the dynamic build
        c["dynamic"] = bwd_needs_dynamic(c["storage"], c["d"], c["Br"], c["Bc"], c["warps"])
    return out


BWD_LABEL = "FA2 tensor-core backward"


def _bwd_dynamic_bytes(Br, Bc, d, warps, storage="float16", dynamic=False, **_):
    """Dynamic shared memory a backward launch of this configuration asks for: its tiles (0 for a static kernel;
    L_i and D_i stay a static array)."""
    if not dynamic:
        return 0
    g = bwd_geometry(storage, d, Br, Bc, warps)
    return g["itemsize"] * g["total"]


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
    NQ, ND, KD, KQ, KK, LD, LDS, E = g["NQ"], g["ND"], g["KD"], g["KQ"], g["KK"], g["LD"], g["LDS"], g["E"]
    OFF, TOTAL, KV_REGS, NDQ, CPT, IPW, PARTS = (g["offsets"], g["total"], g["kv_regs"], g["NDQ"], g["CPT"],
                                                 g["IPW"], g["PARTS"])
    KO, VO, QO, DOO, DSO = OFF["K"], OFF["V"], OFF["Q"], OFF["dO"], OFF["dS"]
    ASYNC, TF32 = g["copy"] == "async", storage == "float32"
    P = _make_policies(storage, g, 80)
    swz, at, load_tile, mma_k, p_fragment, from_f32, to_shared = (
        P["swz"], P["at"], P["load_tile"], P["mma_k"], P["p_fragment"], P["from_f32"], P["to_shared"])
    _, ds_at_chunk, ds_at = _layout(LDS, E)
    SDT = _SHARED_TYPE[storage]
    SIGN = _SIGN[storage]
    KAV = KD if KV_REGS else 1              # V_j's A fragments kept in registers (else reloaded per tile)
    KR = g["k_regs"]                        # K_j's first KR k-steps kept in registers ...
    KAK = KR + (1 if KR < KD else 0)        # ... and one slot for those reloaded per tile
    DQ32 = 0 < KR < KD                      # (d = 128: dQ's atomics indexed in 32 bits, for those registers)
    LDN = 2 * Br                            # L_i and D_i (a compile-time size)
    ONE_LOOP = g["one_loop"]                # d > 64: dK_j, dV_j fill half the registers; one copy of the tile loop
    group = policies.gqa(gqa)[1]
    drop_state, keep_bits, factor = policies.dropout(dropout)
    H = policies.check_features(sparse, mask_mod, dropout, H, 2 * NQ)   # bits: one query parity
    tile_state, is_set = policies.tile_state(sparse), policies.is_set
    score, allowed_bits, grad = policies.modifiers(score_mod, mask_mod, H, score_mod_grad)
    SCORED, MASK_MOD = score_mod is not None, mask_mod is not None
    PIPE = ASYNC and not sparse                 # prefetch the next Q tile during this one's dQ

    @cuda.jit(device=True, inline="always")
    def b_cols(sm, base, k8, n8, lane):
        """The B fragment of one k-step and two 8-wide n-tiles when ``B = X`` (row-major by k, as dO_i in dV, Q_i
        in dK, K_j in dQ): halves by ldmatrix.x4.trans (keys k8 .. k8 + 15, columns n8 .. n8 + 15); TF32 by four
        32-bit loads, rows 2t and 2t + 1 of the 8-row step (the key order of an A fragment made from C registers)."""
        if TF32:
            t4 = uint32(lane % 4)
            g8 = uint32(lane // 4)
            r = uint32(k8) + uint32(2) * t4
            c0 = uint32(n8 // 4) + g8 // uint32(4)
            c1 = uint32(n8 // 4 + 2) + g8 // uint32(4)
            w = g8 % uint32(4)
            v0 = sm[base + r * uint32(LD) + ((c0 ^ swz(r)) * uint32(E)) + w]
            v1 = sm[base + (r + uint32(1)) * uint32(LD) + ((c0 ^ swz(r + uint32(1))) * uint32(E)) + w]
            v2 = sm[base + r * uint32(LD) + ((c1 ^ swz(r)) * uint32(E)) + w]
            v3 = sm[base + (r + uint32(1)) * uint32(LD) + ((c1 ^ swz(r + uint32(1))) * uint32(E)) + w]
            return v0, v1, v2, v3
        return mma.ldmatrix_x4_trans(sm, base + at(k8 + 8 * ((lane // 8) % 2), lane, n8 // 8 + lane // 16))

    @cuda.jit(device=True, inline="always")
    def b_cols_natural(sm, base, k8, n8, lane):
        """As :func:`b_cols` for an A fragment loaded in its natural order (dS from shared memory): TF32 rows t and
        t + 4 of the step.  Halves: the same ldmatrix.trans."""
        if TF32:
            t4 = uint32(lane % 4)
            g8 = uint32(lane // 4)
            r = uint32(k8) + t4
            c0 = uint32(n8 // 4) + g8 // uint32(4)
            c1 = uint32(n8 // 4 + 2) + g8 // uint32(4)
            w = g8 % uint32(4)
            v0 = sm[base + r * uint32(LD) + ((c0 ^ swz(r)) * uint32(E)) + w]
            v1 = sm[base + (r + uint32(4)) * uint32(LD) + ((c0 ^ swz(r + uint32(4))) * uint32(E)) + w]
            v2 = sm[base + r * uint32(LD) + ((c1 ^ swz(r)) * uint32(E)) + w]
            v3 = sm[base + (r + uint32(4)) * uint32(LD) + ((c1 ^ swz(r + uint32(4))) * uint32(E)) + w]
            return v0, v1, v2, v3
        return mma.ldmatrix_x4_trans(sm, base + at(k8 + 8 * ((lane // 8) % 2), lane, n8 // 8 + lane // 16))

    @cuda.jit(device=True, inline="always")
    def a_ds(sm, q16, k0, lane):
        """The A fragment of ``dQ_i = dS K_j`` for queries ``q16 .. q16 + 15`` and one k-step of keys from
        ``k0``, read from dSᵀ (rows = keys): halves by ldmatrix.x4.trans; TF32 by four 32-bit loads."""
        if TF32:
            t4 = uint32(lane % 4)
            g8 = uint32(lane // 4)
            r = uint32(k0) + t4
            c0 = uint32(q16 // 4) + g8 // uint32(4)
            c1 = uint32(q16 // 4 + 2) + g8 // uint32(4)
            w = g8 % uint32(4)
            a0 = sm[DSO + r * uint32(LDS) + ((c0 ^ swz_ds(r)) * uint32(E)) + w]
            a1 = sm[DSO + r * uint32(LDS) + ((c1 ^ swz_ds(r)) * uint32(E)) + w]
            a2 = sm[DSO + (r + uint32(4)) * uint32(LDS) + ((c0 ^ swz_ds(r + uint32(4))) * uint32(E)) + w]
            a3 = sm[DSO + (r + uint32(4)) * uint32(LDS) + ((c1 ^ swz_ds(r + uint32(4))) * uint32(E)) + w]
            return a0, a1, a2, a3
        return mma.ldmatrix_x4_trans(sm, DSO + ds_at(k0 + 8 * (lane // 16), lane, q16 // 8 + (lane // 8) % 2))

    swz_ds = _layout(LDS, E)[0]

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
        n_i = (Nq + Br - 1) // Br                      # line 6: the Q tiles this block sees
        i_first = 0
        i_full = 0                                     # the first Q tile no causal mask touches
        if causal:
            first = j0 - diag
            i_first = first // Br if first > 0 else 0
            i_full = max(i_first, (j0 + Bc - 1 - diag + Br - 1) // Br)
            i_full = min(i_full, n_i)
        z = kz * G                                     # the first query head
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
        if gqa:                                        # each query head of the group in turn
            for z in range(kz * G, z_end):
                q_tiles(z, i_first, i_full, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, j0, tid, diag, sl2,
                        flip, scale, dQ, z_end, dst, Nk, M)
        else:
            q_tiles(kz, i_first, i_full, n_i, Q, dO, L, D, sm, LDs, ka, va, dk, dv, s, dp, dq, j0, tid, diag, sl2,
                    flip, scale, dQ, z_end, dst, Nk, M)
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

    return fa2_tc_backward


# --------------------------------------------------------------------------- launcher


def check_inputs(storage=None, **arrays):
    """The storage of fa2-tc's device arrays (``q=..., k=..., v=...``): float16, bfloat16 (uint16 bits, named by
    ``storage="bfloat16"``) or float32 (run through TF32); TypeError naming the argument otherwise."""
    found = {name: storage_of(a) for name, a in arrays.items()}
    first = next(iter(arrays))
    if storage is None:
        storage = found[first]
        if storage == "bfloat16":
            raise TypeError("fa2-tc: uint16 arrays are bfloat16 bits only with storage='bfloat16'")
    if storage not in STORAGES:
        raise TypeError(f"fa2-tc takes float16, bfloat16 (storage='bfloat16', uint16 bits) or float32 (TF32) inputs; "
                        f"got {first} of dtype {np.dtype(arrays[first].dtype)}")
    want = {"float16": "float16", "bfloat16": "uint16 (bfloat16 bits)", "float32": "float32"}[storage]
    for name, st in found.items():
        if st != storage:
            raise TypeError(f"fa2-tc: {name} must be {want} (storage={storage!r}), got dtype "
                            f"{np.dtype(arrays[name].dtype)}")
    return storage


def _tiles(storage, d, Br, Bc, warps, arch):
    t = default_tiles(d, storage)
    for name, value in (("Br", Br), ("Bc", Bc), ("warps", warps)):
        if value is not None:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            t[name] = int(value)
    geometry(storage, d, t["Br"], t["Bc"], t["warps"], arch)
    check_shared_fit("fa2-tc forward", f"Br={t['Br']}, Bc={t['Bc']} at d={d} ({storage})",
                     shared_bytes(storage, d, t["Br"], t["Bc"], t["warps"], arch), "choose smaller Br/Bc")
    return t


def _fit_mask(direction, d, t, given, block_mask, BH, Nq, Nk):
    """``(tiles, M or None)`` of a launch with ``block_mask`` (a
    :class:`flashnb.masks.BlockMask`, or a boolean array read at the ``Br``, ``Bc`` options or
    :func:`flashnb.kernels.tiles.mask_tiles`): the tiles made to divide the mask's blocks (a given tile must, a
    default one shrinks to the largest that does and that the fragment layout allows), and the mask's states at
    them (:meth:`BlockMask.at_tiles`: uint8 ``(BH, ceil(Nq/Br), ceil(Nk/Bc))``)."""
    if block_mask is None:
        return t, None
    if isinstance(block_mask, tiles.PreparedMask):
        raise TypeError("block_mask: fa2-tc takes a flashnb.masks.BlockMask (flashnb.flex.create_block_mask) or a "
                        "boolean array; a PreparedMask is mapped onto the product kernel's tiles")
    bm = tiles._as_block_mask(block_mask, d, given.get("Br"), given.get("Bc"))
    bm.check(Nq, Nk, BH=BH)
    t = dict(t)

    def shrink(name, within, step, cap):
        x = next((x for x in range(cap - cap % step, 0, -step) if within % x == 0), None)
        if x is None:
            raise ValueError(f"block_mask was built for tiles Br={bm.Br}, Bc={bm.Bc}: the fa2-tc {direction} needs "
                             f"{name} a multiple of {step} dividing {within}; build the mask for tiles that are "
                             "multiples of 16, e.g. flashnb.flex.create_block_mask(..., Br=32, Bc=32)")
        return x

    def refuse_given(name):
        if name in given:
            raise ValueError(f"block_mask was built for tiles Br={bm.Br}, Bc={bm.Bc}; the fa2-tc {direction} tiles "
                             f"Br={t['Br']}, Bc={t['Bc']} must divide them: build the mask for these tiles or pass "
                             f"Br, Bc that divide {bm.Br}, {bm.Bc}")

    if direction == "forward":              # Br = 16·MT·warps rows, Bc a multiple of 16 keys
        if bm.Br % t["Br"]:
            refuse_given("Br")
            t["Br"] = shrink("Br", bm.Br, 16 * t["warps"] if "warps" in given else 16, t["Br"])
            if "warps" not in given:
                t["warps"] = max(w for w in range(1, t["warps"] + 1) if t["Br"] % (16 * w) == 0)
        if bm.Bc % t["Bc"]:
            refuse_given("Bc")
            t["Bc"] = shrink("Bc", bm.Bc, 16, t["Bc"])
    else:                                   # Bc = 16·warps keys, Br a multiple of 16·warps queries
        if bm.Bc % t["Bc"] or bm.Br % t["Br"] or t["Br"] % t["Bc"]:
            if bm.Bc % t["Bc"]:
                refuse_given("Bc")
                refuse_given("warps")
            if bm.Br % t["Br"] or t["Br"] % t["Bc"]:
                refuse_given("Br")
            # the most keys (warps) for which some Br, a multiple of Bc, divides the mask's rows too
            keys = [t["Bc"]] if "Bc" in given or "warps" in given else range(t["Bc"], 0, -16)
            for Bc in keys:
                Br = t["Br"] if "Br" in given else next(
                    (x for x in range(max(t["Br"], Bc) // Bc * Bc, 0, -Bc) if bm.Br % x == 0), None)
                if bm.Bc % Bc == 0 and Br is not None and bm.Br % Br == 0 and Br % Bc == 0:
                    t.update(Br=Br, Bc=Bc, warps=Bc // 16)
                    break
            else:
                raise ValueError(f"block_mask was built for tiles Br={bm.Br}, Bc={bm.Bc}: the fa2-tc backward needs "
                                 "Bc a multiple of 16 dividing the mask's Bc and Br a multiple of that Bc dividing "
                                 "the mask's Br; build the mask for tiles that are multiples of 16, e.g. "
                                 "flashnb.flex.create_block_mask(..., Br=32, Bc=32)")
    return t, bm.at_tiles(t["Br"], t["Bc"], Nq, Nk, BH)


def _modifier_config(score_mod, mask_mod, block_mask, heads, BH, partial):
    """``(mask_mod, H)`` of a launch: the product kernel's checks (``mask_mod`` through its block mask)."""
    bm_mod, H = modifiers.launch_modifiers(score_mod, mask_mod, None, block_mask, heads, BH)
    return (bm_mod if partial else None), H


def device_arch() -> int:
    """80 on sm_80 and newer, 75 on sm_75 (and on the simulator: 80); ValueError naming the architecture below."""
    cc = mma.check_arch("fa2-tc", ((7, 5),))
    return 80 if cc is None or cc >= (8, 0) else 75


def forward(q, k, v, *, causal=False, scale, Br=None, Bc=None, warps=None, storage=None, dropout_p=0.0, seed=None,
            dropout_at=None, block_mask=None, score_mod=None, mask_mod=None, heads=1, score_mod_grad=None):
    """FA2 Alg. 1 on tensor cores: device arrays in (float16, bfloat16 bits with ``storage="bfloat16"``, or float32
    through TF32), ``(O, L)`` out (O in q's storage, L float32).  ``Br, Bc, warps`` default to
    :func:`default_tiles`; on sm_75 only float16 (ValueError naming the architecture otherwise).  ``k``, ``v``
    may have fewer batch·heads than ``q`` (GQA/MQA: query head ``z`` reads K/V head ``z // G``).  ``dropout_p``,
    ``seed``, ``dropout_at``: attention dropout, the same mask as ``impl="flash"`` draws
    (:func:`flashnb.kernels.policies.dropout_args`); ``L`` is the undropped softmax's.  ``block_mask``,
    ``score_mod``, ``mask_mod`` (through its block mask), ``heads``: the product kernel's attention modifiers; with a
    block mask the default tiles shrink to divide its blocks (:func:`_fit_mask`).  ``score_mod_grad`` is the
    backward's (accepted so one set of options serves both)."""
    storage = check_inputs(storage, q=q, k=k, v=v)
    drop = policies.dropout_args(dropout_p, seed, dropout_at)
    arch = device_arch()
    if arch == 75 and storage != "float16":
        raise ValueError(f"fa2-tc on sm_75 takes float16 only (it has no bf16 or tf32 tensor cores), got {storage}")
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = policies.gqa_group(BH, k, v)
    given = {n: x for n, x in (("Br", Br), ("Bc", Bc), ("warps", warps)) if x is not None}
    t, M = _fit_mask("forward", d, _tiles(storage, d, Br, Bc, warps, arch), given, block_mask, BH, Nq, Nk)
    t = _tiles(storage, d, t["Br"], t["Bc"], t["warps"], arch)
    mask_mod, H = _modifier_config(score_mod, mask_mod, block_mask, heads, BH, M is not None and (M == PARTIAL).any())
    O = empty((BH, Nq, d), storage=storage)
    Lse = empty((BH, Nq))
    kernel = make_forward(t["Br"], t["Bc"], d, t["warps"], bool(causal), storage, arch, G > 1,
                          drop is not policies.NO_DROPOUT, M is not None, score_mod, mask_mod, H)
    launch(kernel, (cdiv(Nq, t["Br"]), BH), 32 * t["warps"], q, k, v, O, Lse, scale, causal_diag(causal, Nq, Nk),
           tiles._device_mask(M), *drop, label="FA2 tensor-core forward")
    return O, Lse


def backward(q, k, v, o, lse, do, *, causal=False, scale, Br=None, Bc=None, warps=None, storage=None, dropout_p=0.0,
             seed=None, dropout_at=None, block_mask=None, score_mod=None, mask_mod=None, heads=1,
             score_mod_grad=None):
    """FA2 Alg. 2 on tensor cores: the product kernel's preprocessing launch (``D = rowsum(dO∘O)``, the float32 dQ
    accumulator zeroed), the main launch (one block per K/V tile), and for half storage dQ narrowed (the product
    kernel's convert launch).
    Device arrays in q's storage (``lse`` float32); gradients out in it.  sm_80 and newer (ValueError naming the
    architecture on sm_75).  ``k``, ``v`` may have fewer batch·heads than ``q`` (GQA/MQA): dK, dV have theirs.
    ``dropout_p``, ``seed``, ``dropout_at``: the forward's (its mask is regenerated, never stored); ``block_mask``,
    ``score_mod``, ``mask_mod``, ``heads``: the forward's, and ``score_mod_grad`` (default ``score_mod.grad``, else
    derived from its source: :func:`flashnb.flex_grad.derivative`)."""
    from . import flash

    storage = check_inputs(storage, q=q, k=k, v=v, o=o, do=do)
    drop = policies.dropout_args(dropout_p, seed, dropout_at)
    mma.check_arch("fa2-tc backward", ARCHS[80])
    global last_backward
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = policies.gqa_group(BH, k, v)
    given = {n: x for n, x in (("Br", Br), ("Bc", Bc), ("warps", warps)) if x is not None}
    optin = shared_optin_limit()

    def plan(static=False):                          # (tiles, M): validated, fitted to the block mask
        t0 = _bwd_tiles(storage, d, Br, Bc, warps, G > 1, optin, static)
        t1, M1 = _fit_mask("backward", d, t0, given, block_mask, BH, Nq, Nk)
        return _bwd_tiles(storage, d, t1["Br"], t1["Bc"], t1["warps"], G > 1, optin), M1

    fallback = None
    try:
        t, M = plan()
    except ValueError as exc:                        # default tiles over this device's opt-in limit
        if given or not bwd_needs_dynamic(storage, d, **bwd_default_tiles(d, storage, G > 1)) \
                or "opt-in limit" not in str(exc):
            raise
        (t, M), fallback = plan(static=True), str(exc)
    bm_mod, H = _modifier_config(score_mod, mask_mod, block_mask, heads, BH, True)
    if score_mod is not None and score_mod_grad is None:
        score_mod_grad = policies.score_mod_grad_of(score_mod)   # score_mod.grad, else derived from its source

    def build(t, M):                                 # the kernel of these tiles (mask_mod: only for PARTIAL tiles)
        partial = M is not None and (M == PARTIAL).any()
        return make_backward(t["Br"], t["Bc"], d, t["warps"], bool(causal), storage, G > 1,
                             drop is not policies.NO_DROPOUT, M is not None, score_mod, bm_mod if partial else None,
                             H, score_mod_grad if score_mod is not None else None, dynamic=t["dynamic"])

    D = empty((BH, Nq))
    dQ = empty((BH, Nq, d))                          # float32: the atomics' accumulator
    launch(flash.make_preprocess(storage), (cdiv(Nq, flash.PRE_WARPS), BH), 32 * flash.PRE_WARPS, o, do, D, dQ,
           label="D = rowsum(dO∘O)")
    dK = empty((BH // G, Nk, d), storage=storage)
    dV = empty((BH // G, Nk, d), storage=storage)
    kernel = build(t, M)
    nbytes = _bwd_dynamic_bytes(d=d, storage=storage, **t)
    if t["dynamic"]:
        refused = opt_in_or_fall_back("fa2-tc backward", kernel, _bwd_sig(storage), nbytes, t, d, bool(given),
                                      allow_dynamic_shared)
        if refused:
            fallback = refused
            t, M = plan(static=True)
            nbytes = 0
            kernel = build(t, M)
    if fallback:
        warn_fallback("fa2-tc backward", d, fallback, t)
    last_backward = dict(d=d, Br=t["Br"], Bc=t["Bc"], warps=t["warps"], dynamic=t["dynamic"],
                         shared_bytes=bwd_shared_bytes(storage, d, t["Br"], t["Bc"], t["warps"]), fallback=fallback)
    launch(kernel, (cdiv(Nk, t["Bc"]), BH // G), 32 * t["warps"], q, k, v, do, lse, D, dQ, dK, dV, scale,
           causal_diag(causal, Nq, Nk), tiles._device_mask(M), *drop, label=BWD_LABEL, shared=nbytes)
    if storage != "float32":
        dQh = empty((BH, Nq, d), storage=storage)
        launch(flash.make_convert(storage), (cdiv(Nq * d, flash.CONVERT_THREADS), BH), flash.CONVERT_THREADS, dQ, dQh,
               label=f"dQ -> {storage}")
        dQ = dQh
    return dQ, dK, dV


def _bwd_tiles(storage, d, Br, Bc, warps, gqa=False, optin=tiles.DESIGN_OPTIN_BYTES, static=False):
    """Validated backward tiles (``static``: the static defaults) with ``dynamic`` (over 48 KiB: dynamic shared
    memory, up to ``optin`` bytes; more is a ValueError naming the tiles and the limit)."""
    t = bwd_default_tiles(d, storage, gqa, static)
    for name, value in (("Br", Br), ("Bc", Bc), ("warps", warps)):
        if value is not None:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            t[name] = int(value)
    if Bc is None and warps is not None:
        t["Bc"] = 16 * t["warps"]
    if Br is None and (warps is not None or Bc is not None):
        t["Br"] = max(t["Br"], 16 * t["warps"]) // (16 * t["warps"]) * 16 * t["warps"]
    bwd_geometry(storage, d, t["Br"], t["Bc"], t["warps"])
    check_shared_fit("fa2-tc backward", f"Br={t['Br']}, Bc={t['Bc']} at d={d} ({storage})",
                     bwd_shared_bytes(storage, d, t["Br"], t["Bc"], t["warps"]), "choose smaller Br/Bc", optin=optin)
    t["dynamic"] = bwd_needs_dynamic(storage, d, t["Br"], t["Bc"], t["warps"])
    return t


register_impl("fa2-tc", stage="7",
              description="FA2 forward and backward on tensor cores: mma.sync fed by ldmatrix and cp.async, swizzled "
                          "shared memory; float16/bfloat16, float32 through TF32",
              forward=forward, backward=backward,
              options=("Br", "Bc", "warps", "storage", "dropout_p", "seed", "dropout_at", "block_mask", "score_mod",
                       "mask_mod", "score_mod_grad"), precision="tf32",
              gqa=True, mask_tiles=lambda d, Br=None, Bc=None: _mask_tiles(d, Br, Bc))


def _mask_tiles(d, Br=None, Bc=None) -> dict:
    """The tiles the user surfaces build a ``mask_mod``'s block mask at: the product kernel's
    (:func:`flashnb.kernels.tiles.mask_tiles`, so one mask means the same blocks to every impl), or the ``Br``, ``Bc``
    options; fa2-tc's tiles shrink to divide them."""
    return dict(tiles.mask_tiles(d), **{n: x for n, x in (("Br", Br), ("Bc", Bc)) if x is not None})


# --------------------------------------------------------------------------- analytic model


def model_forward(BH, Nq, Nk, d, *, causal=False, storage="float16", Br=None, Bc=None, warps=None, arch=80,
                  group=1, block_mask=None):
    """Element accesses of :func:`forward` (one launch).  Global: Q, O, L once; K_j, V_j once per visited tile
    (the copies read only elements inside the arrays; zero fill is not a read).  Shared, per block: ``Br·Dp``
    written (Q_i, zero-padded to Dp) and read once (its fragments); per visited tile ``2·Bc·Dp`` written
    (K_j, V_j) and, by each warp, ``2·Bc·Dp`` read (its B fragments of both matmuls, each element once: the
    fragments serve all the warp's m-tiles).  ``group`` (GQA's query heads per K/V head) changes nothing: every
    query head's blocks read its K/V head's tiles.  ``block_mask``: as :func:`forward` takes it; its EMPTY tiles
    are not visited (at the tiles the launch fits to it)."""
    t = _tiles(storage, d, Br, Bc, warps, arch)
    given = {n: x for n, x in (("Br", Br), ("Bc", Bc), ("warps", warps)) if x is not None}
    t, M = _fit_mask("forward", d, t, given, block_mask, BH, Nq, Nk)
    g = geometry(storage, d, t["Br"], t["Bc"], t["warps"], arch)
    per_head, checked = visited_per_head("forward", Nq, Nk, t, causal, M, BH)
    visited = [tile for head in per_head for tile in head]
    kv = sum(cols for _, _, _, cols in visited) * d
    blocks = BH * cdiv(Nq, t["Br"])
    n_visited = len(visited)
    Dp = g["Dp"]
    reads = {"Q": BH * Nq * d, "K": kv, "V": kv}
    if M is not None:                                  # lane 0 of each warp reads each tile state in range
        reads["M"] = BH * checked * t["warps"]
    return [dict(launch="FA2 tensor-core forward", reads=reads,
                 writes={"O": BH * Nq * d, "L": BH * Nq}, atomics={},
                 shared_reads=blocks * t["Br"] * Dp + n_visited * t["warps"] * 2 * t["Bc"] * Dp,
                 shared_writes=blocks * t["Br"] * Dp + n_visited * 2 * t["Bc"] * Dp)]


def hbm_bytes(model, config) -> int:
    """Bytes of a model of fa2-tc's launches at the configuration's storage (L, D, dQ's accumulator: 4 bytes)."""
    from .models import model_bytes

    return sum(m["read_bytes"] + m["write_bytes"] + m["atomic_bytes"]
               for m in model_bytes(model, config.get("storage", "float16")))


# --------------------------------------------------------------------------- the SASS time model's inputs


def sass_config(d, causal, storage="float16", Br=None, Bc=None, warps=None, arch=80) -> dict:
    """The forward kernel's configuration at head dim ``d`` (default tiles unless given)."""
    t = _tiles(storage, d, Br, Bc, warps, arch)
    return dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), storage=storage, arch=arch)


def model_options(config) -> dict:
    return {k: config[k] for k in ("Br", "Bc", "warps", "storage", "arch")}


def sass_shape(config) -> dict:
    """Per warp and K/V tile: the HMMAs of ``S = Q_i K_jᵀ`` (``MT·NB·KD``) and of ``P V_j`` (``MT·ND·KV``; sm_75:
    twice each, two m16n8k8 per k-step); the 32-bit words a thread copies per tile (K_j, V_j: 4 per cp.async
    chunk), in the prologue (Q_i) and the epilogue (O_i's halves, L)."""
    g = geometry(config["storage"], config["d"], config["Br"], config["Bc"], config["warps"], config["arch"])
    twice = 2 if config["arch"] == 75 else 1
    chunk_words = 4                                   # a 16-byte chunk
    per = lambda rows: cdiv(rows * (g["Dp"] // g["E"]), g["threads"]) * chunk_words
    if g["copy"] == "sync":
        per = lambda rows: cdiv(rows * g["Dp"], g["threads"]) * (g["itemsize"] // 4 or 1)
    return dict(phases=(twice * g["MT"] * g["NB"] * g["KD"], twice * g["MT"] * g["ND"] * g["KV"]),
                tile_loads=2 * per(config["Bc"]), prologue_loads=per(config["Br"]),
                epilogue_stores=g["MT"] * g["ND"] * 4)


def launch_order(Tr, causal):
    """The Q block each ``blockIdx.x`` computes, in launch order: heavy first when causal (as the kernel does)."""
    return list(range(Tr))[::-1] if causal else list(range(Tr))


def edge_tile(v, config, Nq, Nk) -> bool:
    """Whether the forward computes tile ``v = (i, j, rows, cols)`` (:func:`flashnb.stages.fa2.tiles_visited`) in its
    masked loop: the tile reaches past ``Nk`` or, causal, past the diagonal of the block's first row."""
    i, j = v[0], v[1]
    Br, Bc = config["Br"], config["Bc"]
    n_full = Nk // Bc
    if config["causal"]:
        n_full = min(n_full, max(0, (i * Br + causal_diag(config["causal"], Nq, Nk) + 1) // Bc))
    return j >= n_full


# --------------------------------------------------------------------------- the backward's model


def model_backward(BH, Nq, Nk, d, *, causal=False, storage="float16", Br=None, Bc=None, warps=None, group=1,
                   block_mask=None):
    """Element accesses of :func:`backward`: stage 4's preprocessing launch (O, dO read; D, dQ = 0 written), the
    main launch, and (half storage) dQ's narrowing.  Main: K_j, V_j once per block; Q_i, dO_i, L_i, D_i once per
    visited tile (valid rows); dQ's atomics once per valid element of each visited tile; dK, dV written once.
    Shared, per block: K_j, V_j written (``2·Bc·Dp``; read once as A fragments where they stay in registers: V_j's
    with ``kv_regs``, K_j's first ``k_regs`` k-steps of ``KS`` columns); per
    visited tile: Q_i, dO_i (``2·Br·Dp``), L_i, D_i (``2·Br``) and dSᵀ (``Bc·Br``) written; each warp reads Q_i and
    dO_i twice (``4·Br·Dp``: the B fragments of Sᵀ, dPᵀ and of dK_j, dV_j), L_i and D_i once per score (``32·Br``;
    at ``Dp > 64`` once per lane and query: ``16·Br``),
    V_j's fragments (``16·Dp``) and K_j's beyond ``k_regs`` (``16·(Dp - k_regs·KS)``) when they do not stay in
    registers; each part of dQ_i reads dSᵀ
    (``16·Bc``) and K_j (``Bc·NDQ·8``).  ``BH`` counts query heads; with ``group`` of them per K/V head (GQA) a
    block is one K/V head's tile and visits the Q tiles of its ``group`` query heads.  ``block_mask``: as
    :func:`backward` takes it (EMPTY tiles are not visited; K_j, V_j are read and dK_j, dV_j written all the same)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or BH % group:
        raise ValueError(f"group must be a positive int dividing BH={BH}, got {group!r}")
    t = _bwd_tiles(storage, d, Br, Bc, warps, gqa=group > 1)
    given = {n: x for n, x in (("Br", Br), ("Bc", Bc), ("warps", warps)) if x is not None}
    t, M = _fit_mask("backward", d, t, given, block_mask, BH, Nq, Nk)
    t = _bwd_tiles(storage, d, t["Br"], t["Bc"], t["warps"], gqa=group > 1)
    Br_, Bc_, W = t["Br"], t["Bc"], t["warps"]
    g = bwd_geometry(storage, d, Br_, Bc_, W)
    Dp = g["Dp"]
    per_head, checked = visited_per_head("backward", Nq, Nk, t, causal, M, BH)
    visited = [tile for head in per_head for tile in head]
    n = len(visited)
    q_rows = sum(rows for _, _, rows, _ in visited)
    BHk = BH // group                                  # K/V heads
    blocks = BHk * cdiv(Nk, Bc_)
    pre = dict(launch="D = rowsum(dO∘O)", reads={"O": BH * Nq * d, "dO": BH * Nq * d},
               writes={"D": BH * Nq, "dQ": BH * Nq * d}, atomics={}, shared_reads=0, shared_writes=0)
    kept = g["k_regs"] * g["KS"]                       # K_j's columns kept in registers
    ld_reads = (16 if g["one_loop"] else 32) * Br_     # L_i, D_i: per lane and query, or per score
    per_tile = (W * (4 * Br_ * Dp + ld_reads + (0 if g["kv_regs"] else 16 * Dp + 16 * (Dp - kept)))
                + g["PARTS"] * (16 * Bc_ + Bc_ * g["NDQ"] * 8))
    main = dict(launch=BWD_LABEL,
                reads={a: x for a, x in (("Q", q_rows * d), ("K", BHk * Nk * d), ("V", BHk * Nk * d),
                                         ("dO", q_rows * d), ("L", q_rows), ("D", q_rows),
                                         ("M", BH * checked * W)) if x},
                writes={"dK": BHk * Nk * d, "dV": BHk * Nk * d}, atomics={"dQ": q_rows * d} if q_rows else {},
                shared_reads=blocks * ((Bc_ * Dp if g["kv_regs"] else 0) + Bc_ * kept) + n * per_tile,
                shared_writes=blocks * 2 * Bc_ * Dp + n * (2 * Br_ * Dp + 2 * Br_ + Bc_ * Br_))
    if storage == "float32":
        return [pre, main]
    return [pre, main, dict(launch=f"dQ -> {storage}", reads={"dQ": BH * Nq * d}, writes={"dQh": BH * Nq * d},
                            atomics={}, shared_reads=0, shared_writes=0)]


def bwd_sass_config(d, causal, storage="float16", Br=None, Bc=None, warps=None) -> dict:
    """The backward kernel's configuration at head dim ``d`` (default tiles unless given)."""
    t = _bwd_tiles(storage, d, Br, Bc, warps)
    return dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), storage=storage,
                dynamic=t["dynamic"])


def bwd_model_options(config) -> dict:
    return {k: config[k] for k in ("Br", "Bc", "warps", "storage")}


def bwd_sass_shape(config) -> dict:
    """Per warp and Q tile: the HMMAs of dQ_i's parts (the one phase that may stay a loop: listed first), then of
    Sᵀ, dPᵀ (``NQ·KD`` each) and of dV_j, dK_j (``ND·KQ`` each); the words a thread copies per tile (Q_i, dO_i: 4
    per chunk; L_i, D_i), in the prologue (K_j, V_j) and the epilogue (dK_j, dV_j)."""
    g = bwd_geometry(config["storage"], config["d"], config["Br"], config["Bc"], config["warps"])
    chunks = lambda rows: cdiv(rows * (g["Dp"] // g["E"]), g["threads"]) * 4
    dq = g["IPW"] * g["KK"] * g["NDQ"]
    return dict(phases=(dq, g["NQ"] * g["KD"], g["NQ"] * g["KD"], g["ND"] * g["KQ"], g["ND"] * g["KQ"]),
                tile_loads=2 * chunks(config["Br"]) + 2, prologue_loads=2 * chunks(config["Bc"]),
                epilogue_stores=2 * g["ND"] * 4)


def bwd_launch_order(Tc, causal):
    """The K/V block each ``blockIdx.x`` computes: block ``j`` as ``j`` (causal: the first blocks, which see the
    most Q tiles, go first already)."""
    return list(range(Tc))


def bwd_edge_tile(v, config, Nq, Nk) -> bool:
    """Whether the backward computes tile ``v = (j, i, rows, cols)`` in its masked loop (it crosses the diagonal)."""
    if not config["causal"]:
        return False
    j, i = v[0], v[1]
    diag = causal_diag(config["causal"], Nq, Nk)
    return i * config["Br"] + diag < j * config["Bc"] + config["Bc"] - 1


# --------------------------------------------------------------------------- GPU measurement (notebook 12)


def measure_gpu(BH: int = 64, N: int = 4096, d: int = 128, *, repeats: int = 10, warmup: int = 3,
                seed: int = 0) -> list[dict]:
    """CUDA-event time of fa2-tc (float16) and fa2-fast (float32, the CUDA cores) forward and backward at one shape
    (GPU only; for notebook 12): one row per (impl, direction) with TFLOP/s by the FlashAttention formula."""
    from ..common import poisoning, to_device
    from ..instruments import bench
    from ..instruments.roofline import flops_backward, flops_forward
    from ..registry import IMPLS

    info = bench.device_info()
    rng = np.random.default_rng(seed)
    x = [rng.standard_normal((BH, N, d), dtype=np.float32) for _ in range(4)]
    out = []
    for impl, storage in (("fa2-tc", "float16"), ("fa2-fast", "float32")):
        entry = IMPLS[impl]
        opts = dict(storage=storage) if storage != "float32" else {}
        with poisoning(False):
            q, k, v, do = (to_device(a.astype(np.float16) if storage == "float16" else a, storage) for a in x)
            o, lse = entry.forward(q, k, v, causal=False, scale=d ** -0.5, **opts)
            for direction, fn, flops in (
                    ("forward", lambda: entry.forward(q, k, v, causal=False, scale=d ** -0.5, **opts),
                     flops_forward(1, BH, N, N, d)),
                    ("backward", lambda: entry.backward(q, k, v, o, lse, do, causal=False, scale=d ** -0.5, **opts),
                     flops_backward(1, BH, N, N, d))):
                t = bench.time_call(fn, repeats=repeats, warmup=warmup, info=info, flops=flops)
                out.append(t.row(impl=impl, storage=storage, direction=direction, BH=BH, N=N, d=d))
    return out
