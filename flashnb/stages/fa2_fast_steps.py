"""Stage 6, step by step -- what each change of :mod:`flashnb.stages.fa2_fast` does to the machine code.

The fast kernel changes several things at once.  Here each change is one small kernel: the heart of FA2
Alg. 1 line 8 -- copy ``Q_i`` and ``K_j`` (``R = C = 32`` rows of ``d``) from HBM to shared memory, then
``S_ij = Q_i K_jᵀ`` on one warp whose lane ``(lr, lc)`` owns the ``TM × TN = 8 × 4`` register micro-tile
of rows ``lr + 4a`` and columns ``lc + 8b`` (stage 4's thread layout) -- written four ways, each one change
away from the one before:

1. :func:`make_qk_stage4` -- as stage 4 writes it (:func:`flashnb.stages.fa2.make_forward`): tiles stored
   *transposed* (``QsT[k, r]``) so that lanes read consecutive rows; ``for k in range(d)``.
2. :func:`make_qk_u32` -- the same with a 32-bit unsigned loop counter and unsigned shared indices (``while
   k < uint32(d)``): numba's ``range`` keeps a 64-bit counter, and a signed index gets a negative-index
   fix-up (``if i < 0: i += n``) before every load.
3. :func:`make_qk_vec` -- row-major tiles whose rows are padded to ``d + 4`` floats, read 4 consecutive
   ``k`` at a time: one 128-bit ``LDS.128`` feeds 4 FFMAs per row, and the copy from HBM is a plain row
   copy (no transposed stores: no bank conflicts, see :func:`flashnb.sim.profile`).
4. :func:`make_qk_swizzle` -- the same without the padding: the 16-byte chunk ``c`` of row ``r`` is stored
   at chunk ``c XOR (r mod 8)``.  The rows a warp reads at once then sit in distinct banks, as with padding,
   and the tile takes no extra bytes (what lets a ``d = 128`` kernel keep bigger tiles within 48 KiB);
   the price is one XOR per load address.
5. :func:`make_stream` -- register prefetch, on a loop over several K tiles: the next tile's loads are issued
   before the current tile's FFMAs, so HBM latency hides behind them (:func:`load_to_use` measures, in the
   SASS, how many instructions separate a load from the first use of its result).

Every kernel computes the same ``S`` (checked against NumPy by :func:`run`) and is registered for the PTX
guard.  ``flashnb sass fa2_fast_steps.qk_u32 --config '{"d": 64}'`` shows each one's SASS; notebook 08
puts them side by side with the full kernels and the SASS time model.
"""

from __future__ import annotations

import re

import numpy as np
from numba import cuda, float32, uint32

from ..common import ZERO
from ..registry import kernel_factory

__all__ = ["make_qk_stage4", "make_qk_u32", "make_qk_vec", "make_qk_swizzle", "make_stream", "run", "run_stream",
           "load_to_use", "STEPS", "R", "C", "TM", "TN"]

R = C = 32             # rows of Q_i and of K_j
LR, LC = 4, 8          # a warp's lanes: 4 along the rows, 8 along the columns (stage 4's layout)
TM, TN = R // LR, C // LC
VEC = 4                # floats per 128-bit load
_SIG = "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])"
_CONFIGS = [dict(d=64), dict(d=128)]


def _check_d(d):
    if d % (4 * VEC) or not 16 <= d <= 128:
        raise ValueError(f"d must be a multiple of 16 in 16..128, got {d}")


@kernel_factory("fa2_fast_steps.qk_stage4", stage="6", signature=_SIG, configs=_CONFIGS, threads=32)
def make_qk_stage4(d):
    """Step 1: stage 4's line 8 -- transposed tiles, ``range`` loops, signed indices."""
    _check_d(d)

    @cuda.jit
    def qk_stage4(Q, K, S):
        QsT = cuda.shared.array((d, R), float32)
        KsT = cuda.shared.array((d, C), float32)
        acc = cuda.local.array((TM, TN), float32)
        qv = cuda.local.array(TM, float32)
        kv = cuda.local.array(TN, float32)
        tid = cuda.threadIdx.x
        lr, lc = tid // LC, tid % LC
        for e in range(tid, R * d, 32):              # copy, transposed: lanes store down a column
            r = e // d
            k = e - r * d
            QsT[k, r] = Q[r, k]
            KsT[k, r] = K[r, k]
        cuda.syncthreads()
        for a in range(TM):
            for b in range(TN):
                acc[a, b] = ZERO
        for k in range(d):                           # FA2 Alg. 1 line 8: TM + TN loads, TM·TN FFMAs
            for a in range(TM):
                qv[a] = QsT[k, lr + LR * a]
            for b in range(TN):
                kv[b] = KsT[k, lc + LC * b]
            for a in range(TM):
                for b in range(TN):
                    acc[a, b] += qv[a] * kv[b]
        for a in range(TM):
            for b in range(TN):
                S[lr + LR * a, lc + LC * b] = acc[a, b]

    return qk_stage4


@kernel_factory("fa2_fast_steps.qk_u32", stage="6", signature=_SIG, configs=_CONFIGS, threads=32)
def make_qk_u32(d):
    """Step 2: a 32-bit unsigned counter and unsigned shared indices; everything else as step 1."""
    _check_d(d)

    @cuda.jit
    def qk_u32(Q, K, S):
        QsT = cuda.shared.array((d, R), float32)
        KsT = cuda.shared.array((d, C), float32)
        acc = cuda.local.array((TM, TN), float32)
        qv = cuda.local.array(TM, float32)
        kv = cuda.local.array(TN, float32)
        tid = cuda.threadIdx.x
        lr, lc = uint32(tid // LC), uint32(tid % LC)
        for e in range(tid, R * d, 32):
            r = e // d
            k = e - r * d
            QsT[k, r] = Q[r, k]
            KsT[k, r] = K[r, k]
        cuda.syncthreads()
        for a in range(TM):
            for b in range(TN):
                acc[a, b] = ZERO
        k = uint32(0)
        while k < uint32(d):                         # line 8, counted in 32 bits, no negative-index fix-ups
            for a in range(TM):
                qv[a] = QsT[k, lr + uint32(LR * a)]
            for b in range(TN):
                kv[b] = KsT[k, lc + uint32(LC * b)]
            for a in range(TM):
                for b in range(TN):
                    acc[a, b] += qv[a] * kv[b]
            k = uint32(k + 1)
        for a in range(TM):
            for b in range(TN):
                S[lr + LR * a, lc + LC * b] = acc[a, b]

    return qk_u32


def _make_qk_rowmajor(d, swizzle):
    """Steps 3 and 4: row-major tiles read 4 floats at a time; rows padded (``swizzle=False``) or swizzled."""
    _check_d(d)
    LD = d if swizzle else d + VEC                   # floats per row in shared memory
    QN, KN = R * LD, C * LD                          # shared array sizes (compile-time constants)

    @cuda.jit(device=True, inline="always")
    def at(r, k):
        """Shared offset of element k of row r: chunk k // 4 moves to (k // 4) XOR (r mod 8) when swizzled."""
        if swizzle:
            return r * uint32(LD) + (((k // uint32(VEC)) ^ (r % uint32(8))) * uint32(VEC)) + k % uint32(VEC)
        return r * uint32(LD) + k

    @cuda.jit
    def qk_rowmajor(Q, K, S):
        Qs = cuda.shared.array(QN, float32)
        Ks = cuda.shared.array(KN, float32)
        acc = cuda.local.array((TM, TN), float32)
        qv = cuda.local.array((TM, VEC), float32)
        kv = cuda.local.array((TN, VEC), float32)
        tid = cuda.threadIdx.x
        lr, lc = uint32(tid // LC), uint32(tid % LC)
        e = uint32(tid)
        while e < uint32(R * d):                     # copy, row by row: consecutive lanes, consecutive floats
            r = e // uint32(d)
            k = e - r * uint32(d)
            Qs[at(r, k)] = Q[r, k]
            Ks[at(r, k)] = K[r, k]
            e += uint32(32)
        cuda.syncthreads()
        for a in range(TM):
            for b in range(TN):
                acc[a, b] = ZERO
        k = uint32(0)
        while k < uint32(d):                         # line 8, 4 k per step: one LDS.128 per row
            for a in range(TM):
                for t in range(VEC):
                    qv[a, t] = Qs[at(lr + uint32(LR * a), k) + uint32(t)]
            for b in range(TN):
                for t in range(VEC):
                    kv[b, t] = Ks[at(lc + uint32(LC * b), k) + uint32(t)]
            for t in range(VEC):                     # 4·TM·TN FFMAs per TM + TN loads
                for a in range(TM):
                    for b in range(TN):
                        acc[a, b] += qv[a, t] * kv[b, t]
            k = uint32(k + VEC)
        for a in range(TM):
            for b in range(TN):
                S[lr + LR * a, lc + LC * b] = acc[a, b]

    return qk_rowmajor


@kernel_factory("fa2_fast_steps.qk_vec", stage="6", signature=_SIG, configs=_CONFIGS, threads=32)
def make_qk_vec(d):
    """Step 3: row-major tiles padded to ``d + 4`` floats, 128-bit loads, plain row copies."""
    return _make_qk_rowmajor(d, swizzle=False)


@kernel_factory("fa2_fast_steps.qk_swizzle", stage="6", signature=_SIG, configs=_CONFIGS, threads=32)
def make_qk_swizzle(d):
    """Step 4: step 3 without the padding -- chunk ``c`` of row ``r`` at chunk ``c XOR (r mod 8)``."""
    return _make_qk_rowmajor(d, swizzle=True)


_STREAM_SIG = _SIG
_STREAM_CONFIGS = [dict(d=32, prefetch=False), dict(d=32, prefetch=True)]


@kernel_factory("fa2_fast_steps.stream", stage="6", signature=_STREAM_SIG, configs=_STREAM_CONFIGS, threads=32)
def make_stream(d, prefetch):
    """Step 5, register prefetch: ``S = Q Kᵀ`` for a ``K`` of several 32-row tiles ``K_j`` streamed through one
    shared buffer (FA2 Alg. 1 lines 6-8), as step 3 computes each tile.  Without ``prefetch`` a tile's copy
    is load, store, barrier, compute: the warp waits for HBM before every tile.  With ``prefetch`` each thread
    loads its share of ``K_{j+1}`` into registers *before* computing tile ``j`` and stores it to shared memory
    after: the loads are in flight while the FFMAs run.  It costs ``32·d/32 = d`` registers per thread (the
    tile over one warp), which is why the fast kernels, already at 164-248 registers, do not do it."""
    if d != 32:
        raise ValueError(f"d must be 32 for the streaming step (its prefetch holds d floats per thread), got {d}")
    LD = d + VEC
    QN, KN = R * LD, C * LD
    PER = C * d // 32                                # elements of K_j each thread copies

    @cuda.jit
    def qk_stream(Q, K, S):
        Qs = cuda.shared.array(QN, float32)
        Ks = cuda.shared.array(KN, float32)
        acc = cuda.local.array((TM, TN), float32)
        qv = cuda.local.array((TM, VEC), float32)
        kv = cuda.local.array((TN, VEC), float32)
        nxt = cuda.local.array(PER, float32)         # registers: this thread's share of K_{j+1}
        tid = uint32(cuda.threadIdx.x)
        lr, lc = tid // uint32(LC), tid % uint32(LC)
        for i in range(PER):                         # Q_i once; element tid + 32·i is row i, column tid
            Qs[uint32(i * LD) + tid] = Q[i, tid]
        if prefetch:
            for i in range(PER):                     # K_0 into registers
                nxt[i] = K[i, tid]
        n_tiles = uint32(K.shape[0] // C)
        jt = uint32(0)
        while jt < n_tiles:                          # line 6: the K/V tiles
            cuda.syncthreads()                       # every lane is done with K_{j-1}
            for i in range(PER):                     # line 7: K_j into shared memory ...
                if prefetch:
                    Ks[uint32(i * LD) + tid] = nxt[i]    # ... from the registers loaded one tile ago
                else:
                    Ks[uint32(i * LD) + tid] = K[jt * uint32(C) + uint32(i), tid]    # ... straight from HBM
            cuda.syncthreads()
            if prefetch and jt + uint32(1) < n_tiles:
                for i in range(PER):                 # K_{j+1}: in flight while line 8 runs
                    nxt[i] = K[(jt + uint32(1)) * uint32(C) + uint32(i), tid]
            for a in range(TM):
                for b in range(TN):
                    acc[a, b] = ZERO
            k = uint32(0)
            while k < uint32(d):                     # line 8, as step 3
                for a in range(TM):
                    for t in range(VEC):
                        qv[a, t] = Qs[(lr + uint32(LR * a)) * uint32(LD) + k + uint32(t)]
                for b in range(TN):
                    for t in range(VEC):
                        kv[b, t] = Ks[(lc + uint32(LC * b)) * uint32(LD) + k + uint32(t)]
                for t in range(VEC):
                    for a in range(TM):
                        for b in range(TN):
                            acc[a, b] += qv[a, t] * kv[b, t]
                k = uint32(k + VEC)
            for a in range(TM):
                for b in range(TN):
                    S[lr + uint32(LR * a), jt * uint32(C) + lc + uint32(LC * b)] = acc[a, b]
            jt += uint32(1)

    return qk_stream


def run_stream(prefetch: bool, tiles: int = 3, seed: int = 0):
    """Run the streaming step (d = 32, ``tiles`` K tiles) on random inputs; ``(S, Q Kᵀ in float64)``, S
    NaN-poisoned before the launch."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((R, 32)).astype(np.float32)
    k = rng.standard_normal((tiles * C, 32)).astype(np.float32)
    s = cuda.to_device(np.full((R, tiles * C), np.nan, np.float32))
    make_stream(32, prefetch)[1, 32](cuda.to_device(q), cuda.to_device(k), s)
    return s.copy_to_host(), q.astype(np.float64) @ k.astype(np.float64).T


_REG = re.compile(r"\bR(\d+)\b")


def load_to_use(s) -> list:
    """For every global load (LDG) in the loop with the most FFMAs (``s``: a :class:`flashnb.instruments.sass.Sass`),
    the number of instructions issued before the first one that reads its result (going round the loop, as the
    next iteration would): the latency the warp has work to cover with.  ``[]`` without such a loop."""
    loops = [lp for lp in s.loops if any(i.category == "ffma" for i in s.instructions[lp[0]:lp[1] + 1])]
    if not loops:
        return []
    a, b = max(loops, key=lambda lp: (sum(i.category == "ffma" for i in s.instructions[lp[0]:lp[1] + 1]),
                                      lp[1] - lp[0]))
    body = s.instructions[a:b + 1]
    out = []
    for p, ins in enumerate(body):
        if ins.category != "ldg":
            continue
        first = _REG.search(ins.operands)
        if first is None:
            continue
        width = max(1, ins.bits // 32)
        regs = {int(first.group(1)) + w for w in range(width)}
        for dist in range(1, len(body)):
            other = body[(p + dist) % len(body)]
            ops = other.operands
            if other.category in ("sts", "stg", "stl", "atom") or other.opcode in ("BRA", "BAR", "EXIT"):
                used = {int(r) for r in _REG.findall(ops)}
            else:
                used = {int(r) for r in _REG.findall(ops.split(",", 1)[1])} if "," in ops else set()
            if used & regs:
                out.append(dist)
                break
    return out


#: the steps in order: (short name, registered kernel name, factory)
STEPS = [("stage 4", "fa2_fast_steps.qk_stage4", make_qk_stage4),
         ("32-bit indices", "fa2_fast_steps.qk_u32", make_qk_u32),
         ("128-bit loads, padded rows", "fa2_fast_steps.qk_vec", make_qk_vec),
         ("128-bit loads, swizzled rows", "fa2_fast_steps.qk_swizzle", make_qk_swizzle)]


def run(factory, d: int, seed: int = 0):
    """Run one step's kernel (one warp) on random ``Q, K`` (32 × d); return ``(S, Q Kᵀ in float64)``.  ``S``
    is NaN-poisoned before the launch, so an element the kernel never writes stays NaN."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((R, d)).astype(np.float32)
    k = rng.standard_normal((C, d)).astype(np.float32)
    s = cuda.to_device(np.full((R, C), np.nan, np.float32))
    factory(d)[1, 32](cuda.to_device(q), cuda.to_device(k), s)
    return s.copy_to_host(), q.astype(np.float64) @ k.astype(np.float64).T
