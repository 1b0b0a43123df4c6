"""Decoding with a KV cache: flash-decoding (split-KV) for a few new queries against a long cache.

When a language model generates text, each step attends ``Nq = 1`` new query (a few with speculative
decoding: up to 8 here) to every key and value cached so far.  FA2's forward (:mod:`flashnb.stages.fa2`) puts one
thread block on each block of ``Br`` query rows of each head: at ``Nq = 1`` that is **one block per head**,
so a GPU with 132 SMs running 8 heads keeps 124 SMs idle while 8 blocks each stream the whole cache.

Flash-decoding splits the *keys* instead (split-KV):

1. :func:`make_split` -- grid ``(num_splits, BH, ceil(Nq/8))``: block ``(s, z)`` takes chunk ``s`` of the
   cache of head ``z`` (``length / num_splits`` keys rounded up to the tile ``Bc = 32·warps``) and computes, for
   its ``Nq <= 8`` queries, FA2 Alg. 1 on that chunk alone: a partial output ``O_s`` (normalised within the chunk)
   and its log-sum-exp ``L_s``.  Inside the block the *warps* split the keys of each K/V tile (one key per
   thread for ``S = Q_i K_jᵀ``; the thread's lane then shares its ``P~`` with the warp for ``P~ V_j``), so
   each warp keeps its own ``[m, l, O~]``, and the block ends by merging its warps' states.
2. :func:`make_merge` -- grid ``(Nq, BH)``, one warp each: the stage-2 merge operator (:func:`flashnb.stages.softmax.
   merge_state`, ``[m, l] ⊕ [m', l']``) folded over the splits in log-sum-exp form,
   ``L = log Σ_s e^(L_s)``, and ``O = Σ_s e^(L_s - L) O_s``.  A split with no allowed key has
   ``L_s = -inf`` and weighs nothing.

Causal masking is aligned to the bottom-right corner, as FA2's: query ``i`` of ``Nq`` sees the cache positions
``j <= length - Nq + i`` (the new tokens were appended last).  ``"upper_left"`` (``j <= i``) and no mask work
too.  More than 8 queries run in groups of 8 (gridDim.z), each group re-reading its chunks: for a prompt
(prefill) FA2 is the kernel to use.

:class:`KVCache` holds K and V of fixed capacity; :meth:`KVCache.append` writes new rows with a small kernel
(:func:`make_append`).  Grouped-query attention: the cache may have fewer heads than ``q`` (query head ``z``
reads K/V head ``z // G``, ``G = BH_q / BH_kv``).  The split kernel's grid then runs over the K/V heads, and
a block's rows are the ``G·Nq`` (query head, query) pairs that share its K/V head, up to 8 per block (more
on gridDim.z): the ``G`` query heads of a group read each chunk of their K/V head once, together.

This module holds the kernels only.  The host side -- :class:`~flashnb.kernels.launch.decode.KVCache`,
:func:`~flashnb.kernels.launch.decode.decode`, the split heuristic and ``impl="flash-decoding"`` -- is
:mod:`flashnb.kernels.launch.decode`; the traffic and time models (:func:`model_forward`, equal to the traffic
counter's, and :func:`modelled_time`, a per-SM roofline that sees idle SMs: **modelled, not measured**) are
:mod:`flashnb.kernels.models.decode`; the GPU measurement is :mod:`flashnb.instruments.measure.decode`.  Their old
names here still reach them (:data:`MOVED`).
"""

from __future__ import annotations

import math

from numba import cuda, float32

from ..common import NEG_INF, ONE, ZERO, causal_allowed, cdiv
from ..registry import kernel_factory
from ..stages.softmax import merge_state, warp_reduce_state

__all__ = ["make_split", "make_merge", "make_append", "shared_bytes", "MAX_NQ", "WARP", "APPEND_ROWS",
           "APPEND_THREADS"]


WARP = 32
MAX_NQ = 8               # queries per thread block (more run in groups of MAX_NQ on gridDim.z)
FULL_MASK = 0xFFFFFFFF

_A2 = "float32[:, ::1]"
_A3 = "float32[:, :, ::1]"
_A4 = "float32[:, :, :, ::1]"
_SPLIT_SIG = f"void({_A3}, {_A3}, {_A3}, {_A4}, {_A3}, float32, int32, int32, int32)"
_MERGE_SIG = f"void({_A4}, {_A3}, {_A3}, {_A2})"
_APPEND_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, int32)"


@cuda.jit(device=True, inline="always")
def warp_max(x):
    """Maximum of ``x`` over the 32 lanes (butterfly shuffles; every lane gets it)."""
    off = WARP // 2
    while off > 0:
        x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, off))
        off //= 2
    return x


@cuda.jit(device=True, inline="always")
def warp_sum(x):
    """Sum of ``x`` over the 32 lanes (butterfly shuffles; every lane gets it)."""
    off = WARP // 2
    while off > 0:
        x += cuda.shfl_xor_sync(FULL_MASK, x, off)
        off //= 2
    return x


# --------------------------------------------------------------------------- kernels


def shared_bytes(NQ: int, d: int, warps: int) -> int:
    """Static shared memory of one split block: ``Q_i`` (NQ × d), ``K_j`` (Bc × (d + 1)) and the warps' states
    for the block-level merge (``m``, ``l``: warps × NQ; ``O~``: warps × NQ × Dp)."""
    Bc, Dp = WARP * warps, WARP * cdiv(d, WARP)
    return 4 * (NQ * d + Bc * (d + 1) + 2 * warps * NQ + warps * NQ * Dp)


@kernel_factory("decode.split", stage="decode", signature=_SPLIT_SIG,
                configs=[dict(NQ=1, d=64, warps=4, causal=True), dict(NQ=8, d=128, warps=2, causal=False)],
                threads=lambda warps, **_: WARP * warps)
def make_split(NQ, d, warps, causal):
    """Split-KV partials: block ``(s, kz, b)`` runs FA2 Alg. 1 over cache chunk ``s`` of K/V head ``kz`` for
    ``NQ`` rows ``f = 8b ..`` of the ``G·Nq`` (query head, query) pairs that share that K/V head (row ``f``:
    query ``f % Nq`` of query head ``kz·G + f // Nq``); ``32·warps`` threads, K/V tiles of ``Bc = 32·warps``
    keys."""
    Bc = WARP * warps                                # keys per K/V tile: one per thread
    DN = cdiv(d, WARP)                               # head-dim columns per lane: lane + 32·c
    Dp = DN * WARP
    KP = d + 1                                       # K_j's padded row length (a compile-time shape)

    @cuda.jit(device=True, inline="always")
    def split_tile(Qs, Ks, V, s, m, l, Oi, p, tid, w, lane, kz, f0, F, j0, hi, Nq, scale, diag):
        """Alg. 1 lines 8-10 for one K/V tile: each warp on its own 32 keys (no other warp involved)."""
        key = j0 + tid                               # line 8: S = Q_i K_jᵀ, one key per thread
        for a in range(NQ):
            s[a] = ZERO
        for k in range(d):
            kv = Ks[tid, k]
            for a in range(NQ):
                s[a] += Qs[a, k] * kv                # Qs: the warp reads one address (a broadcast)
        for a in range(NQ):                          # line 9: m_new over the warp's 32 keys, P~ = exp(S - m_new)
            x = scale * s[a]
            if key >= hi or f0 + a >= F or (causal and not causal_allowed((f0 + a) % Nq, key, diag)):
                x = NEG_INF
            m_new = max(m[a], warp_max(x))
            alpha = ONE
            pa = ZERO
            if m_new != NEG_INF:
                alpha = float32(math.exp(m[a] - m_new))
                pa = float32(math.exp(x - m_new))
            s[a] = pa
            l[a] = alpha * l[a] + pa                 # per-lane partial, summed over the warp at the end
            m[a] = m_new
            for c in range(DN):                      # line 10: O~ = diag(e^(m_old - m_new)) O~ ...
                Oi[a, c] *= alpha
        kw = j0 + w * WARP                           # ... + P~ V_j over this warp's keys kw .. kw + 31
        for r in range(min(WARP, hi - kw)):          # warp-uniform trip count
            for a in range(NQ):
                p[a] = cuda.shfl_sync(FULL_MASK, s[a], r)   # P~ of key kw + r, from its lane
            for c in range(DN):
                col = lane + WARP * c
                if col < d:
                    vj = V[kz, kw + r, col]          # V_j straight from HBM: lanes read consecutive columns
                    for a in range(NQ):
                        Oi[a, c] += p[a] * vj

    @cuda.jit(device=True, inline="always")
    def merge_warps(red_m, red_l, red_O, O_part, L_part, kz, G, split, f0, F, Nq, tid):
        """The block-level reduction: the warps' [m, l, O~] merged with stage 2's operator, then lines 12-14,
        ``O_s = diag(l)^-1 O~`` and ``L_s = m + log l`` (``-inf``: no allowed key in this chunk)."""
        for e in range(tid, NQ * d, Bc):
            a = e // d
            c = e - a * d
            mm = NEG_INF
            ll = ZERO
            for v in range(warps):
                mm, ll = merge_state(mm, ll, red_m[v, a], red_l[v, a])
            acc = ZERO
            for v in range(warps):
                mv = red_m[v, a]
                wv = float32(math.exp(mv - mm)) if mv != NEG_INF else ZERO
                acc += wv * red_O[v, a, c]
            f = f0 + a
            if f < F:                                # row f: query f % Nq of query head kz·G + f // Nq
                z = kz * G + f // Nq
                O_part[z, split, f % Nq, c] = acc / ll if ll > ZERO else ZERO
                if c == 0:
                    L_part[z, split, f % Nq] = mm + float32(math.log(ll)) if ll > ZERO else NEG_INF

    @cuda.jit
    def decode_split(Q, K, V, O_part, L_part, scale, length, chunk, diag):
        Qs = cuda.shared.array((NQ, d), float32)     # Q_i: this group's queries
        Ks = cuda.shared.array((Bc, KP), float32)    # K_j (+1 column: thread t reads row t, no bank conflicts)
        red_m = cuda.shared.array((warps, NQ), float32)   # each warp's m, l, O~ for the block-level merge
        red_l = cuda.shared.array((warps, NQ), float32)
        red_O = cuda.shared.array((warps, NQ, Dp), float32)
        s = cuda.local.array(NQ, float32)            # registers: this thread's key's scores, then P~
        m = cuda.local.array(NQ, float32)            # this warp's running max (the same in every lane)
        l = cuda.local.array(NQ, float32)            # this lane's partial row sums
        Oi = cuda.local.array((NQ, DN), float32)     # this warp's O~, head-dim columns lane + 32·c
        p = cuda.local.array(NQ, float32)
        split = cuda.blockIdx.x
        kz = cuda.blockIdx.y                         # the K/V head
        tid = cuda.threadIdx.x
        w = tid // WARP
        lane = tid % WARP
        Nq = Q.shape[1]
        G = Q.shape[0] // K.shape[0]                 # GQA: query heads kz·G .. kz·G + G - 1 share K/V head kz
        F = G * Nq                                   # their rows (query head, query), packed: f = g·Nq + i
        f0 = cuda.blockIdx.z * NQ                    # this block's rows f0 .. f0 + NQ - 1
        lo = split * chunk                           # this block's chunk of the cache: keys lo .. hi - 1
        hi = min(lo + chunk, length)
        if causal:                                   # no key after the last diagonal of these rows' queries
            f1 = min(f0 + NQ, F) - 1
            hi = min(hi, (Nq if f1 // Nq > f0 // Nq else f1 % Nq + 1) + diag)
        for e in range(tid, NQ * d, Bc):             # Alg. 1 line 4: load Q_i (zero rows past F)
            r = e // d
            k = e - r * d
            f = f0 + r
            Qs[r, k] = Q[kz * G + f // Nq, f % Nq, k] if f < F else ZERO
        for a in range(NQ):                          # line 5: O~ = 0, l = 0, m = -inf
            m[a] = NEG_INF
            l[a] = ZERO
            for c in range(DN):
                Oi[a, c] = ZERO
        n_tiles = (hi - lo + Bc - 1) // Bc if hi > lo else 0
        for t in range(n_tiles):                     # line 6, over this chunk only
            j0 = lo + t * Bc
            cuda.syncthreads()                       # every warp is done with K_{j-1}
            for e in range(tid, Bc * d, Bc):         # line 7: load K_j (coalesced; zero past the chunk)
                r = e // d
                k = e - r * d
                Ks[r, k] = K[kz, j0 + r, k] if j0 + r < hi else ZERO
            cuda.syncthreads()
            split_tile(Qs, Ks, V, s, m, l, Oi, p, tid, w, lane, kz, f0, F, j0, hi, Nq, scale, diag)
        for a in range(NQ):                          # the warps' [m, l, O~] to shared memory
            la = warp_sum(l[a])
            if lane == 0:
                red_m[w, a] = m[a]
                red_l[w, a] = la
            for c in range(DN):
                red_O[w, a, lane + WARP * c] = Oi[a, c]
        cuda.syncthreads()
        merge_warps(red_m, red_l, red_O, O_part, L_part, kz, G, split, f0, F, Nq, tid)

    return decode_split


@kernel_factory("decode.merge", stage="decode", signature=_MERGE_SIG, configs=[dict(d=64), dict(d=128)],
                threads=WARP)
def make_merge(d):
    """Combine the splits' partials: grid ``(Nq, BH)``, one warp per query row; lanes fold the splits'
    ``[L_s, 1]`` with :func:`flashnb.stages.softmax.merge_state`, then weigh each ``O_s`` by ``e^(L_s - L)``."""
    DN = cdiv(d, WARP)

    @cuda.jit
    def decode_merge(O_part, L_part, O, L):
        red_m = cuda.shared.array(1, float32)        # warp_reduce_state's exchange (one warp: one slot)
        red_l = cuda.shared.array(1, float32)
        acc = cuda.local.array(DN, float32)
        q = cuda.blockIdx.x
        z = cuda.blockIdx.y
        lane = cuda.threadIdx.x
        S = L_part.shape[1]
        m = NEG_INF
        l = ZERO
        for s in range(lane, S, WARP):               # [m, l] ⊕ [L_s, 1]: l = Σ_s e^(L_s - m)
            m, l = merge_state(m, l, L_part[z, s, q], ONE)
        m, l = warp_reduce_state(m, l, red_m, red_l, lane)   # ... over the lanes, as stage 2 reduces a row
        Lq = m + float32(math.log(l)) if l > ZERO else NEG_INF   # L = log Σ_s e^(L_s)
        for c in range(DN):
            acc[c] = ZERO
        for s0 in range(0, S, WARP):                 # O = Σ_s e^(L_s - L) O_s
            wt = ZERO
            if s0 + lane < S:
                Ls = L_part[z, s0 + lane, q]
                if Ls != NEG_INF:                    # a split with no allowed key weighs 0
                    wt = float32(math.exp(Ls - Lq))
            for r in range(min(WARP, S - s0)):       # warp-uniform
                ws = cuda.shfl_sync(FULL_MASK, wt, r)
                for c in range(DN):
                    col = lane + WARP * c
                    if col < d:
                        acc[c] += ws * O_part[z, s0 + r, q, col]
        for c in range(DN):
            col = lane + WARP * c
            if col < d:
                O[z, q, col] = acc[c]
        if lane == 0:
            L[z, q] = Lq

    return decode_merge


APPEND_ROWS = 32        # cache rows per block of the append kernel
APPEND_THREADS = 128


@kernel_factory("decode.append", stage="decode", signature=_APPEND_SIG, threads=APPEND_THREADS)
def make_append():
    """Append rows to a KV cache: grid ``(ceil(n_new / 32), BH_kv)``; a block copies 32 rows of K and V,
    its 128 threads striding over the rows' ``32·d`` consecutive elements (coalesced reads and writes)."""

    @cuda.jit
    def cache_append(K, V, K_new, V_new, start):
        z = cuda.blockIdx.y
        r0 = cuda.blockIdx.x * APPEND_ROWS
        d = K.shape[2]
        n = K_new.shape[1]
        for e in range(cuda.threadIdx.x, APPEND_ROWS * d, APPEND_THREADS):
            r = e // d
            c = e - r * d
            if r0 + r < n:
                K[z, start + r0 + r, c] = K_new[z, r0 + r, c]
                V[z, start + r0 + r, c] = V_new[z, r0 + r, c]

    return cache_append


#: Names that moved out of this module, by their old name (``decode.KVCache``, ``decode.decode``,
#: ``decode.model_forward``, ``decode.measure_gpu``): the host side, the models and the GPU measurement live in the
#: layers that build on these kernels, and ``__getattr__`` below reaches them there.
MOVED = {
    "KVCache": "flashnb.kernels.launch.decode",
    "decode": "flashnb.kernels.launch.decode",
    "forward": "flashnb.kernels.launch.decode",
    "default_warps": "flashnb.kernels.launch.decode",
    "default_splits": "flashnb.kernels.launch.decode",
    "chunk_length": "flashnb.kernels.launch.decode",
    "sm_count": "flashnb.kernels.launch.decode",
    "model_forward": "flashnb.kernels.models.decode",
    "launch_blocks": "flashnb.kernels.models.decode",
    "modelled_time": "flashnb.kernels.models.decode",
    "fa2_modelled_time": "flashnb.kernels.models.decode",
    "measure_gpu": "flashnb.instruments.measure.decode",
}


def __getattr__(name):
    if name in MOVED:
        import importlib

        return getattr(importlib.import_module(MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
