"""The sizes of a fa2-tc configuration and the tiles a launch runs at (host side, no device code).

:func:`geometry` (FA2 Alg. 1's forward) and :func:`bwd_geometry` (Alg. 2's backward) derive everything the kernels
are built from -- fragments per warp, the padded head dim, the swizzled row length, shared-memory offsets, how the
copies run; the default tiles per head-dim class and storage; the configurations the PTX guard compiles; and the
validated tiles of a launch, fitted to a block mask's blocks.
"""

from __future__ import annotations

import numpy as np

from ...common import SHARED_LIMIT_BYTES, cdiv

__all__ = ["STORAGES", "TF32_MAX_D", "TF32_MAX_D_BWD", "ARCHS", "geometry", "shared_bytes", "default_tiles",
           "bwd_geometry", "bwd_shared_bytes", "bwd_default_tiles", "bwd_needs_dynamic", "BWD_LABEL"]

#: The storages fa2-tc takes: float16 and bfloat16 (m16n8k16), float32 (through TF32, m16n8k8).
STORAGES = ("float16", "bfloat16", "float32")
#: The largest head dim of float32 (TF32) inputs, forward and backward: beyond them every tile choice spills.
TF32_MAX_D, TF32_MAX_D_BWD = 64, 32
#: The architectures each configuration compiles for.
ARCHS = {80: ((8, 0), (9, 0)), 75: ((7, 5),)}


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



# --------------------------------------------------------------------------- backward (FA2 Alg. 2)


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


def bwd_default_tiles(d: int, storage: str = "float16", gqa: bool = False, static: bool = False) -> dict:
    """The backward's default ``Br, Bc, warps`` at head dim ``d`` for ``storage`` (no spills; within the A100's
    opt-in shared memory, :data:`flashnb.kernels.launch.fit.DESIGN_OPTIN_BYTES`); ``gqa``: for K/V with fewer heads than
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
