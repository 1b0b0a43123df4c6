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

Models: :func:`model_forward` (element accesses per launch, equal to the traffic counter's) and
:func:`modelled_time` (a per-SM roofline that sees idle SMs; **modelled, not measured**), with
:func:`fa2_modelled_time` for the comparison with FA2's forward.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
from numba import cuda, float32

from .. import runtime
from ..common import (
    NEG_INF,
    ONE,
    ZERO,
    causal_allowed,
    causal_diag,
    cdiv,
    check_bfloat16_bits,
    check_shared_fit,
    empty,
    launch,
    positive_int,
    to_device,
)
from ..instruments import roofline
from ..reference import check_causal, check_scale
from ..registry import kernel_factory, register_impl
from ..stages.softmax import merge_state, warp_reduce_state

__all__ = ["KVCache", "make_split", "make_merge", "make_append", "decode", "forward", "default_warps",
           "default_splits", "chunk_length", "shared_bytes", "model_forward", "launch_blocks", "modelled_time",
           "fa2_modelled_time", "sm_count", "measure_gpu", "MAX_NQ", "WARP"]

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


# --------------------------------------------------------------------------- the cache


def _device_rows(name: str, x, heads: int, d: int):
    """``x`` as a float32 C-contiguous device array of shape ``(heads, n, d)``; TypeError/ValueError naming it."""
    if hasattr(x, "copy_to_host"):                   # a device array: used as it is, so it must already fit
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"{name} must be float32 (a device array is not converted), got dtype {x.dtype}")
        if not x.is_c_contiguous():
            raise TypeError(f"{name} must be C-contiguous (a device array is not copied)")
        arr = x
    else:
        a = np.asarray(x)
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)) or a.dtype == bool:
            raise TypeError(f"{name} must hold real numbers (a float or integer dtype), got dtype {a.dtype}")
        check_bfloat16_bits(name, a, None, half=False)
        if a.size and not np.all(np.isfinite(a)):
            raise ValueError(f"{name} contains NaN or inf; cache rows must be finite")
        arr = a
    if arr.ndim != 3 or arr.shape[0] != heads or arr.shape[2] != d or arr.shape[1] < 1:
        raise ValueError(f"{name} must have shape (heads, n_new, d) = ({heads}, n_new >= 1, {d}), got "
                         f"{tuple(arr.shape)}")
    return arr if hasattr(arr, "copy_to_host") else to_device(arr)


class KVCache:
    """K and V of ``heads`` heads (``BH_kv``: batch·K/V heads) with room for ``capacity`` positions of head dim
    ``d``, as float32 device arrays ``K``, ``V`` of shape ``(heads, capacity, d)``; the first ``length``
    positions are filled (the rest are NaN until written, so a kernel that reads past ``length`` shows it).

    ``append(k_new, v_new)`` writes ``(heads, n_new, d)`` rows at ``length`` (ValueError when they do not fit,
    or have the wrong shape; TypeError for a non-real dtype or a non-float32 device array).
    :meth:`wrap` uses existing ``(heads, N, d)`` device arrays as a full cache, without a copy."""

    def __init__(self, heads: int, capacity: int, d: int):
        self.heads = positive_int("heads", heads)
        self.capacity = positive_int("capacity", capacity)
        self.d = positive_int("d", d)
        self.K = empty((self.heads, self.capacity, self.d))
        self.V = empty((self.heads, self.capacity, self.d))
        self.length = 0

    @classmethod
    def wrap(cls, k, v) -> "KVCache":
        """A full cache over the float32 device arrays ``k``, ``v`` of shape ``(heads, N, d)`` (not copied)."""
        if tuple(k.shape) != tuple(v.shape) or len(k.shape) != 3:
            raise ValueError(f"k and v must have one shape (heads, N, d), got k {tuple(k.shape)}, v {tuple(v.shape)}")
        cache = cls.__new__(cls)
        cache.heads, cache.capacity, cache.d = (int(n) for n in k.shape)
        cache.K = _device_rows("k", k, cache.heads, cache.d)
        cache.V = _device_rows("v", v, cache.heads, cache.d)
        cache.length = cache.capacity
        return cache

    @property
    def free(self) -> int:
        """Positions left."""
        return self.capacity - self.length

    def append(self, k_new, v_new) -> "KVCache":
        """Write ``k_new``, ``v_new`` (NumPy or float32 device arrays ``(heads, n_new, d)``) at positions
        ``length .. length + n_new - 1`` with :func:`make_append`'s kernel; returns the cache."""
        kn = _device_rows("k_new", k_new, self.heads, self.d)
        vn = _device_rows("v_new", v_new, self.heads, self.d)
        if tuple(kn.shape) != tuple(vn.shape):
            raise ValueError(f"k_new and v_new must have one shape, got {tuple(kn.shape)} and {tuple(vn.shape)}")
        n = int(kn.shape[1])
        if n > self.free:
            raise ValueError(f"k_new: the cache is full: {n} new positions do not fit in the {self.free} left "
                             f"(length {self.length}, capacity {self.capacity}); make a larger KVCache")
        launch(make_append(), (cdiv(n, APPEND_ROWS), self.heads), APPEND_THREADS, self.K, self.V, kn, vn, self.length,
               label="append to cache")
        self.length += n
        return self

    def __repr__(self) -> str:
        return f"KVCache(heads={self.heads}, length={self.length}, capacity={self.capacity}, d={self.d})"


# --------------------------------------------------------------------------- host side


def default_warps(d: int) -> int:
    """Warps per split block: 4 (K/V tiles of 128 keys) up to d = 64, 2 beyond (the K_j tile must fit in
    48 KiB of shared memory with the warps' merge buffers: :func:`shared_bytes`)."""
    return 4 if d <= 64 else 2


def sm_count(gpu=None) -> int:
    """SMs to fill: ``gpu``'s (a :mod:`flashnb.instruments.roofline` preset or GPU); ``None``: this GPU's own count when
    running on one, else the H100 SXM preset's."""
    if gpu is None:
        from ..instruments import rehearsal

        if runtime.MODE == "gpu" and not rehearsal.active():
            return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
        gpu = "H100 SXM"
    return roofline.get_gpu(gpu).sm_count


def _row_blocks(Nq: int, group: int) -> tuple[int, int]:
    """``(NQ, blocks)``: rows per split block and split blocks per K/V head and split, for the ``group·Nq``
    (query head, query) rows that share a K/V head, at most :data:`MAX_NQ` per block."""
    F = positive_int("group", group) * positive_int("Nq", Nq)
    NQ = min(F, MAX_NQ)
    return NQ, cdiv(F, NQ)


def default_splits(BH: int, Nq: int, length: int, d: int, warps: int | None = None, gpu="H100 SXM", *,
                   group: int = 1) -> int:
    """The split count :func:`decode` uses: as many blocks as fit on the SMs in one wave,
    ``floor(SMs / blocks per split)`` -- rounding up instead would leave a second, nearly empty wave of blocks
    (8 heads on 132 SMs: 17 splits are 136 blocks) -- but no more splits than K/V tiles in the cache
    (``ceil(length / Bc)``, so every split has at least one tile), and at least 1.  A split has one block per
    K/V head (``BH / group``) and per 8 of the ``group·Nq`` rows sharing it."""
    Bc = WARP * (warps or default_warps(d))
    per_split = (BH // positive_int("group", group)) * _row_blocks(Nq, group)[1]
    return max(1, min(sm_count(gpu) // per_split, cdiv(length, Bc)))


def chunk_length(length: int, num_splits: int, Bc: int) -> int:
    """Keys per split: ``length / num_splits`` rounded up to a multiple of the tile ``Bc``."""
    return cdiv(cdiv(length, num_splits), Bc) * Bc


def _check_warps(warps, d, NQ):
    warps = default_warps(d) if warps is None else positive_int("warps", warps)
    if warps > 32:
        raise ValueError(f"warps must be in 1..32 (at most 1,024 threads per block), got {warps}")
    check_shared_fit("flash-decoding", f"of Bc={WARP * warps} keys (warps={warps}) at d={d}, Nq={NQ}",
                     shared_bytes(NQ, d, warps), "use fewer warps")
    return warps


def _decode_causal(causal, Nq: int):
    """:func:`decode`'s ``causal``: as given, or (None) False for a single query, where every mask is the same; a
    ValueError naming ``causal`` for several queries, where the choice changes the answer."""
    if causal is not None:
        return causal
    if Nq > 1:
        raise ValueError(f"causal: decoding Nq = {Nq} new queries needs causal=True (bottom-right: query i sees the "
                         "cache up to position length - Nq + i, the new tokens appended last) or causal=False (every "
                         "query sees the whole cache, as flashnb.attention(..., impl='flash-decoding') does by "
                         "default); with one query they are the same")
    return False


def decode(q, cache: KVCache, *, scale=None, causal=None, num_splits=None, warps=None, gpu=None):
    """Attention of ``q`` against the first ``cache.length`` positions of ``cache``: ``(O, L)`` device arrays
    ``(BH, Nq, d)`` and ``(BH, Nq)``.

    ``q``: NumPy or float32 device array ``(BH, Nq, d)``, ``BH`` a multiple of ``cache.heads`` (grouped-query
    attention: the ``G = BH / cache.heads`` query heads of a K/V head share its blocks), ``d = cache.d <= 128``;
    meant for ``G·Nq <= 8`` (more rows run in blocks of 8 on gridDim.z, each re-reading the cache).
    ``causal``: True (bottom-right: query ``i`` sees positions ``<= length - Nq + i``, the new tokens appended
    last), False or ``"upper_left"``.  With one query (``Nq = 1``) every choice is the same mask and ``causal``
    may be left out; with more it must be given: ``flashnb.attention(..., impl="flash-decoding")`` is False by
    default, like every impl, while decoding new tokens wants True, so no default serves both.
    ``num_splits``: chunks the cache is split into (default :func:`default_splits` for ``gpu``'s SMs:
    :func:`sm_count`, this GPU's own when None); more splits than tiles leave some splits empty, which is
    allowed.  ``warps``: per split block (default :func:`default_warps`); K/V tiles are ``32·warps`` keys."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a flashnb.kernels.decode.KVCache, got {type(cache).__name__}")
    if cache.length < 1:
        raise ValueError("cache is empty (length 0): append keys and values first")
    shape = tuple(getattr(q, "shape", np.shape(q)))
    if len(shape) != 3 or shape[2] != cache.d:
        raise ValueError(f"q must have shape (BH, Nq, d) with the cache's d = {cache.d}, got {shape}")
    qd = _device_rows("q", q, shape[0], cache.d)
    BH, Nq, d = (int(n) for n in qd.shape)
    if BH % cache.heads:
        raise ValueError(f"q's batch·heads ({BH}) must be a multiple of the cache's heads ({cache.heads})")
    G = BH // cache.heads
    if d > 128:
        raise ValueError(f"head dim d must be <= 128, got {d}")
    s = check_scale(scale, d)
    causal = check_causal(_decode_causal(causal, Nq), Nq, cache.length)
    NQ, row_blocks = _row_blocks(Nq, G)
    warps = _check_warps(warps, d, NQ)
    Bc = WARP * warps
    S = default_splits(BH, Nq, cache.length, d, warps, gpu, group=G) if num_splits is None \
        else positive_int("num_splits", num_splits)
    chunk = chunk_length(cache.length, S, Bc)
    O_part = empty((BH, S, Nq, d))
    L_part = empty((BH, S, Nq))
    launch(make_split(NQ, d, warps, bool(causal)), (S, cache.heads, row_blocks), Bc, qd, cache.K, cache.V, O_part,
           L_part, s, cache.length, chunk, causal_diag(causal, Nq, cache.length), label="split-KV partials")
    O = empty((BH, Nq, d))
    L = empty((BH, Nq))
    launch(make_merge(d), (Nq, BH), WARP, O_part, L_part, O, L, label="merge splits")
    return O, L


def forward(q, k, v, *, causal=False, scale, num_splits=None, warps=None):
    """``impl="flash-decoding"``: :func:`decode` of ``q`` against ``k``, ``v`` as a full cache (forward only)."""
    return decode(q, KVCache.wrap(k, v), scale=scale, causal=causal, num_splits=num_splits, warps=warps)


register_impl("flash-decoding", stage="decode",
              description="flash-decoding: split-KV blocks write partial (O, LSE), a merge kernel combines them "
                          "(forward only; for Nq <= 8 new queries against a KV cache)",
              forward=forward, options=("num_splits", "warps"), gqa=True)


# --------------------------------------------------------------------------- models


def _launch(name, reads, writes, shared_reads, shared_writes):
    return dict(launch=name, reads={a: n for a, n in reads.items() if n},
                writes={a: n for a, n in writes.items() if n}, atomics={},
                shared_reads=int(shared_reads), shared_writes=int(shared_writes))


def _split_blocks(Nq, length, causal, S, Bc, group=1):
    """``[(s, b, rows, keys)]`` per block of one K/V head: its valid rows (of the ``group·Nq`` sharing the K/V
    head) and the keys its chunk reads (``hi - lo``), in launch order (x fastest)."""
    diag = causal_diag(causal, Nq, length)
    NQ, n_blocks = _row_blocks(Nq, group)
    F = group * Nq
    chunk = chunk_length(length, S, Bc)
    out = []
    for b in range(n_blocks):
        f0, f1 = b * NQ, min(b * NQ + NQ, F) - 1
        q_hi = Nq if f1 // Nq > f0 // Nq else f1 % Nq + 1     # one past the last query of these rows
        for s in range(S):
            lo = s * chunk
            hi = min(lo + chunk, length)
            if causal:
                hi = min(hi, q_hi + diag)
            out.append((s, b, f1 - f0 + 1, max(0, hi - lo)))
    return out


def _plan(BH, Nq, length, d, causal, num_splits, warps, gpu, group):
    causal = check_causal(causal, Nq, length)
    if BH % positive_int("group", group):
        raise ValueError(f"group={group} must divide batch·heads = {BH}")
    NQ, _ = _row_blocks(Nq, group)
    warps = _check_warps(warps, d, NQ)
    S = default_splits(BH, Nq, length, d, warps, gpu, group=group) if num_splits is None \
        else positive_int("num_splits", num_splits)
    return causal, NQ, warps, S


def model_forward(BH, Nq, Nk, d, *, causal=False, num_splits=None, warps=None, gpu="H100 SXM", group=1):
    """Element accesses of :func:`decode` with ``Nk`` = the cache length (two launches).

    Split: every block reads its group's Q rows and the keys of its chunk once (K and V: ``(hi - lo)·d``, V
    straight from HBM), writes ``O_part``, ``L_part`` rows; shared: ``Q_i`` written (NQ·d), per tile ``K_j``
    written (Bc·d) and read by every thread (d, plus NQ·d of ``Q_i``), then the warps' states written
    (2·warps·NQ + warps·NQ·Dp) and read 4·warps times per output element.  Merge: ``L_part`` read twice, ``O_part``
    once, O and L written; shared: 2 writes and 64 reads per row (:func:`flashnb.stages.softmax.warp_reduce_state`).
    ``group`` (GQA, ``BH_q / BH_kv``): the blocks run per K/V head, each on up to 8 of the ``group·Nq`` rows that
    share it, so K and V are read once per K/V head and chunk (per 8 rows)."""
    causal, NQ, warps, S = _plan(BH, Nq, Nk, d, causal, num_splits, warps, gpu, group)
    Bc, Dp = WARP * warps, WARP * cdiv(d, WARP)
    blocks = _split_blocks(Nq, Nk, causal, S, Bc, group)
    BHkv = BH // group
    keys = sum(kk for *_, kk in blocks)
    tiles = sum(cdiv(kk, Bc) for *_, kk in blocks)
    n = len(blocks)
    split = _launch("split-KV partials", {"Q": BH * S * Nq * d, "K": BHkv * keys * d, "V": BHkv * keys * d},
                    {"O_part": BH * S * Nq * d, "L_part": BH * S * Nq},
                    BHkv * (tiles * Bc * d * (NQ + 1) + n * NQ * d * 4 * warps),
                    BHkv * (n * NQ * d + tiles * Bc * d + n * warps * NQ * (2 + Dp)))
    merge = _launch("merge splits", {"O_part": BH * Nq * S * d, "L_part": 2 * BH * Nq * S},
                    {"O": BH * Nq * d, "L": BH * Nq}, BH * Nq * 2 * WARP, BH * Nq * 2)
    return [split, merge]


def launch_blocks(BH, Nq, Nk, d, *, causal=True, num_splits=None, warps=None, gpu="H100 SXM", group=1) -> dict:
    """Thread blocks of each launch of :func:`decode`: ``{"split-KV partials": S · BH_kv · ceil(group·Nq / 8),
    "merge splits": Nq · BH}``."""
    causal, NQ, warps, S = _plan(BH, Nq, Nk, d, causal, num_splits, warps, gpu, group)
    return {"split-KV partials": S * (BH // group) * _row_blocks(Nq, group)[1], "merge splits": Nq * BH}


def _schedule(blocks, g) -> tuple[float, int]:
    """Per-SM roofline: each SM gets ``1/SMs`` of the HBM bandwidth and of the FP32 peak; a block lasts
    ``max(bytes / its bandwidth, FLOPs / its peak)``; blocks go, in launch order, to the SM that frees first.
    Returns (seconds until the last SM is done, SMs that get a block)."""
    bw, peak = g.hbm_bandwidth / g.sm_count, g.fp32_peak / g.sm_count
    heap = [0.0] * g.sm_count
    for nbytes, flops in blocks:
        heapq.heappush(heap, heapq.heappop(heap) + max(nbytes / bw, flops / peak))
    return max(heap), min(len(blocks), g.sm_count)


def modelled_time(BH, Nq, Nk, d, *, causal=True, num_splits=None, warps=None, gpu="H100 SXM", group=1) -> dict:
    """**Modelled, not measured**: :func:`decode`'s time on ``gpu`` by a per-SM roofline (see ``_schedule``:
    one SM is assumed to reach only its share of the bandwidth, so idle SMs cost time; launch overhead, caches
    and latency are left out).  Per block: HBM bytes of its own accesses (as :func:`model_forward` counts
    them), FLOPs ``4·d·rows·keys`` (the scores it computes, masked or not).  Returns blocks, busy SMs, bytes,
    seconds of each launch and in all (the two launches run one after the other)."""
    g = roofline.get_gpu(gpu)
    causal, NQ, warps, S = _plan(BH, Nq, Nk, d, causal, num_splits, warps, gpu, group)
    split = [(4 * (2 * rows * d + rows + 2 * keys * d), 4 * d * rows * keys)
             for _ in range(BH // group) for _, _, rows, keys in _split_blocks(Nq, Nk, causal, S, WARP * warps, group)]
    merge = [(4 * (2 * S + S * d + d + 1), 2 * S * d)] * (BH * Nq)
    t_split, busy_split = _schedule(split, g)
    t_merge, busy_merge = _schedule(merge, g)
    return dict(impl="flash-decoding", num_splits=S, blocks=len(split) + len(merge), split_blocks=len(split),
                merge_blocks=len(merge), busy_sms=busy_split, sms=g.sm_count,
                bytes=sum(b for b, _ in split) + sum(b for b, _ in merge),
                seconds=t_split + t_merge, split_seconds=t_split, merge_seconds=t_merge, gpu=g.name,
                kind="modelled")


def fa2_modelled_time(BH, Nq, Nk, d, *, causal=True, gpu="H100 SXM", Br=None, Bc=None, warps=None) -> dict:
    """FA2's forward (:mod:`flashnb.stages.fa2`, default tiles) by the same per-SM roofline as :func:`modelled_time`:
    one block per ``Br`` query rows of each head, each reading Q_i, its visited K/V tiles, writing O_i, L_i."""
    from ..stages import fa2

    g = roofline.get_gpu(gpu)
    causal = check_causal(causal, Nq, Nk)
    t = fa2.default_tiles(d)
    Br, Bc = Br or t["Br"], Bc or t["Bc"]
    per_block = {}
    for i, _, rows, cols in fa2.tiles_visited(Nq, Nk, Br, Bc, causal):
        per_block[i] = per_block.get(i, 0) + cols
    blocks = []
    for _ in range(BH):
        for i in range(cdiv(Nq, Br)):
            rows, cols = min(Br, Nq - i * Br), per_block.get(i, 0)
            blocks.append((4 * (2 * rows * d + rows + 2 * cols * d), 4 * d * rows * cols))
    seconds, busy = _schedule(blocks, g)
    return dict(impl="fa2", blocks=len(blocks), busy_sms=busy, sms=g.sm_count, bytes=sum(b for b, _ in blocks),
                seconds=seconds, gpu=g.name, kind="modelled")


# --------------------------------------------------------------------------- measurement (GPU only)


def measure_gpu(BH: int = 8, length: int = 32768, d: int = 128, Nq: int = 1, splits=(1, 4, 16, None), *,
                repeats: int = 20, warmup: int = 3, seed: int = 0) -> list[dict]:
    """CUDA-event times (GPU only; for notebook 11) of :func:`decode` at each split count in ``splits`` (None:
    the heuristic for this GPU's SMs) and of FA2's forward (:func:`flashnb.stages.fa2.forward`, default tiles) on the
    same ``Nq`` queries and cache, with the blocks each launches.  The cache is filled before timing."""
    from ..common import poisoning
    from ..instruments import bench
    from ..stages import fa2

    if runtime.MODE != "gpu":
        raise RuntimeError("measure_gpu times kernels on a GPU; on the simulator use bench.on_gpu("
                           "'flashnb.kernels.decode:measure_gpu', ...), which measures nothing without a GPU")
    info = bench.device_info()
    rng = np.random.default_rng(seed)
    q = to_device(rng.standard_normal((BH, Nq, d), dtype=np.float32))
    k, v = (to_device(rng.standard_normal((BH, length, d), dtype=np.float32)) for _ in range(2))
    cache = KVCache.wrap(k, v)
    scale = d ** -0.5
    flops = 4.0 * BH * Nq * length * d
    out = []
    with poisoning(False):                           # time the kernels, not the NaN fill of fresh outputs
        for S in splits:
            S_used = default_splits(BH, Nq, length, d, gpu=None) if S is None else S
            timing = bench.time_call(lambda: decode(q, cache, scale=scale, causal=True, num_splits=S_used),
                                     repeats=repeats, warmup=warmup, info=info, flops=flops)
            blocks = launch_blocks(BH, Nq, length, d, num_splits=S_used)
            out.append(timing.row(impl="flash-decoding", num_splits=S_used, heuristic=S is None, BH=BH, Nq=Nq,
                                  length=length, d=d, blocks=sum(blocks.values()),
                                  split_blocks=blocks["split-KV partials"]))
        timing = bench.time_call(lambda: fa2.forward(q, k, v, causal=True, scale=scale), repeats=repeats,
                                 warmup=warmup, info=info, flops=flops)
        out.append(timing.row(impl="fa2", num_splits=None, heuristic=False, BH=BH, Nq=Nq, length=length, d=d,
                              blocks=cdiv(Nq, fa2.default_tiles(d)["Br"]) * BH, split_blocks=None))
    return out
