"""Flash-decoding's host side: the KV cache, the split heuristic, the launches of the split and merge kernels
(:mod:`flashnb.kernels.decode`), and ``impl="flash-decoding"``."""

from __future__ import annotations

import numpy as np
from numba import cuda

from ... import runtime
from ...common import (
    MAX_HEAD_DIM,
    causal_diag,
    cdiv,
    check_bfloat16_bits,
    check_shared_fit,
    empty,
    launch,
    positive_int,
    to_device,
)
from ...instruments import roofline
from ...reference import check_causal, check_scale
from ...registry import register_impl
from .. import decode as kernels  # the factories through their module: registry.using swaps them there
from ..decode import APPEND_ROWS, APPEND_THREADS, MAX_NQ, WARP, shared_bytes

__all__ = ["KVCache", "decode", "forward", "default_warps", "default_splits", "chunk_length", "sm_count"]


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
        ``length .. length + n_new - 1`` with :func:`~flashnb.kernels.decode.make_append`'s kernel; returns the
        cache."""
        kn = _device_rows("k_new", k_new, self.heads, self.d)
        vn = _device_rows("v_new", v_new, self.heads, self.d)
        if tuple(kn.shape) != tuple(vn.shape):
            raise ValueError(f"k_new and v_new must have one shape, got {tuple(kn.shape)} and {tuple(vn.shape)}")
        n = int(kn.shape[1])
        if n > self.free:
            raise ValueError(f"k_new: the cache is full: {n} new positions do not fit in the {self.free} left "
                             f"(length {self.length}, capacity {self.capacity}); make a larger KVCache")
        launch(kernels.make_append(), (cdiv(n, APPEND_ROWS), self.heads), APPEND_THREADS, self.K, self.V, kn, vn,
               self.length, label="append to cache")
        self.length += n
        return self

    def __repr__(self) -> str:
        return f"KVCache(heads={self.heads}, length={self.length}, capacity={self.capacity}, d={self.d})"


# --------------------------------------------------------------------------- host side


def default_warps(d: int) -> int:
    """Warps per split block: 4 (K/V tiles of 128 keys) up to d = 64, 2 beyond (the K_j tile must fit in
    48 KiB of shared memory with the warps' merge buffers: :func:`~flashnb.kernels.decode.shared_bytes`)."""
    return 4 if d <= 64 else 2


def sm_count(gpu=None) -> int:
    """SMs to fill: ``gpu``'s (a :mod:`flashnb.instruments.roofline` preset or GPU); ``None``: this GPU's own count when
    running on one, else the H100 SXM preset's."""
    if gpu is None:
        if runtime.MODE == "gpu" and not runtime.rehearsing():
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
        raise TypeError(f"cache must be a flashnb.kernels.launch.decode.KVCache, got {type(cache).__name__}")
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
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim d must be <= {MAX_HEAD_DIM}, got {d}")
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
    launch(kernels.make_split(NQ, d, warps, bool(causal)), (S, cache.heads, row_blocks), Bc, qd, cache.K, cache.V,
           O_part, L_part, s, cache.length, chunk, causal_diag(causal, Nq, cache.length), label="split-KV partials")
    O = empty((BH, Nq, d))
    L = empty((BH, Nq))
    launch(kernels.make_merge(d), (Nq, BH), WARP, O_part, L_part, O, L, label="merge splits")
    return O, L


def forward(q, k, v, *, causal=False, scale, num_splits=None, warps=None):
    """``impl="flash-decoding"``: :func:`decode` of ``q`` against ``k``, ``v`` as a full cache (forward only)."""
    return decode(q, KVCache.wrap(k, v), scale=scale, causal=causal, num_splits=num_splits, warps=warps)


register_impl("flash-decoding", stage="decode",
              description="flash-decoding: split-KV blocks write partial (O, LSE), a merge kernel combines them "
                          "(forward only; for Nq <= 8 new queries against a KV cache)",
              forward=forward, options=("num_splits", "warps"), gqa=True, models="flashnb.kernels.models.decode")
