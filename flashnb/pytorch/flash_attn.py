"""flash-attn 2.x's functions on flashnb's kernels: :func:`flash_attn_func`, :func:`flash_attn_varlen_func`,
:func:`flash_attn_with_kvcache`, with flash-attn's argument names, defaults, layouts and semantics, so code
written for ``flash_attn`` runs here by changing its import::

    from flashnb.pytorch.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Layouts are flash-attn's: ``(batch, seqlen, heads, d)``; packed ``(total, heads, d)`` with int32 ``cu_seqlens``;
a paged cache ``(num_blocks, page_size, kv_heads, d)`` with ``block_table (batch, max_blocks)``.  k and v may have
fewer heads than q (grouped-/multi-query attention: query head ``h`` reads K/V head ``h // (H / H_kv)``).

How each option reaches the kernels (:func:`flashnb.pytorch.attention`):

* ``causal=True`` is flashnb's ``causal=True``, **bottom-right aligned** (query ``i`` of ``Sq`` sees keys
  ``j <= i + Sk - Sq``); a row that sees no key has output 0, as in flash-attn.
* ``window_size=(left, right)``: query ``i`` sees keys ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``
  (``-1``: that side unbounded; ``causal=True`` sets ``right = 0``) -- a ``mask_mod`` (:mod:`flashnb.flex`), so
  tiles outside the band are skipped, never loaded.
* ``softcap=c > 0``: scores ``c·tanh(s/c)`` of the scaled score ``s``; ``alibi_slopes`` ``(heads,)`` or
  ``(batch, heads)`` float32: the bias ``-slope·|i + Sk - Sq - j|`` added after the softcap -- one ``score_mod``
  with its derivative, the slopes captured as a constant array.
* ``dropout_p``: flashnb's attention dropout (Philox, :mod:`flashnb.rng`), its seed drawn from torch's default
  generator at each call (``torch.manual_seed`` makes it repeatable); flashnb's mask, not the one flash-attn's
  kernels would draw.
* float32, float16 and bfloat16 tensors (flash-attn takes only the halves); CPU tensors run on the simulator,
  CUDA tensors on the GPU.  Autograd for :func:`flash_attn_func` and :func:`flash_attn_varlen_func`.

Extensions (keyword-only, after flash-attn's arguments): ``impl`` and the impl's tile options (``Br``, ``Bc``,
``warps``, ...), ``storage``, ``allow_float64``, as :func:`flashnb.pytorch.attention` takes them.

Not supported yet -- each a clear error naming the argument: ``sinks`` (no sink term in the kernels),
``return_attn_probs=True`` (the kernels never form P), ``deterministic=True`` with a backward on a GPU (dQ is
summed with float32 atomics whose order varies between runs; on the simulator the atomics are applied in a fixed
order, so the backward is bitwise reproducible and ``deterministic=True`` is allowed), a value head dim different
from q's and k's, and in :func:`flash_attn_with_kvcache` rotary embeddings and ``return_softmax_lse=True``.

**Where flashnb does less than flash-attn's kernels, for now.**  :func:`flash_attn_varlen_func` launches the
kernels once per sequence (forward and backward): no padding is read or computed -- counted bytes are the sum
of each sequence's own -- but a packed-sequence tile scheduler (one launch over all sequences) is future work.
:func:`flash_attn_with_kvcache` gathers a paged cache's pages on the host into one contiguous ``(length, heads,
d)`` copy per sequence before the decode kernel runs; paged addressing inside the decode kernel is future work.
The window's bounds, ``Sk - Sq``, the softcap and the ALiBi slopes are arrays the modifiers capture: on a GPU
each distinct set of values is a kernel compile (cached, bounded: :mod:`flashnb.flex`), so packed sequences of
many different ``Sk - Sq`` with a window or ALiBi compile several kernels; the simulator compiles nothing.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch
from numba import float32

from .. import runtime
from ..common import MAX_HEAD_DIM  # flash-decoding's largest head dim, as every impl's
from ..kernels.decode import MAX_NQ  # flash-decoding's rows per block (query heads of a group × new queries)
from .functional import attention

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

_UNBOUNDED = 1 << 30   # a window side without a bound: further than any index (int64 arithmetic in the mask)


# --------------------------------------------------------------------------- argument checks


def _tensor(name, t, ndim, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {what}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {what}, got {tuple(t.shape)}")
    return t


def _check_heads(q, k, v, lead: str, axis: int):
    """q ``(..., H, d)``, k, v ``(..., H_kv, d)``: v's head dim must be q's, H a multiple of H_kv."""
    if v.shape[-1] != q.shape[-1] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"v: a value head dim different from q's and k's is not supported yet (the kernels "
                         f"compute O with d_v = d); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape {lead}, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    H, Hk = q.shape[axis], k.shape[axis]
    if H % Hk:
        raise ValueError(f"k, v: the number of heads in q ({H}) must be a multiple of k's and v's ({Hk}) "
                         "(grouped-query attention)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_window(window_size):
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for an unbounded side, "
                        f"got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size must be (left, right) with each >= 0, or -1 for an unbounded side, "
                         f"got {window_size!r}")
    return left, right


def _check_softcap(softcap):
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) \
            or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: no soft-capping), got {softcap!r}")
    return float(softcap)


def _check_alibi(alibi_slopes, B: int, H: int):
    """``(B, H)`` float32 NumPy slopes, or None."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor of shape (heads,) or (batch, heads), "
                        f"got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32 (as flash-attn's), got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((H,), (B, H)):
        raise ValueError(f"alibi_slopes must have shape (heads,) = ({H},) or (batch, heads) = ({B}, {H}), "
                         f"got {tuple(alibi_slopes.shape)}")
    slopes = alibi_slopes.detach().cpu().numpy().astype(np.float32)
    if not np.isfinite(slopes).all():
        raise ValueError("alibi_slopes must be finite")
    return np.ascontiguousarray(np.broadcast_to(slopes, (B, H)))


def _refuse(sinks, return_attn_probs=False):
    if sinks is not None:
        raise ValueError("sinks: learnable attention sinks are not supported yet (flashnb's kernels have no sink "
                         "term in the softmax denominator); pass sinks=None")
    if return_attn_probs:
        raise ValueError("return_attn_probs=True is not supported: flashnb's kernels never form the attention "
                         "matrix P (flash-attn returns it for testing only); pass return_attn_probs=False")


def _check_deterministic(deterministic, q, k, v):
    """``deterministic=True`` is met on the simulator (atomics applied in a fixed order); refused where a backward
    will run on a GPU."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if deterministic and needs_grad and (q.device.type == "cuda" or runtime.MODE != "sim"):
        raise ValueError("deterministic=True: flashnb's backward on a GPU sums dQ with float32 atomics, whose order "
                         "(and so the last bits of dQ) varies between runs; a deterministic dQ (a split reduction) "
                         "is not implemented yet. On the simulator (CPU tensors) the atomics are applied in a fixed "
                         "order and deterministic=True is allowed; on a GPU pass deterministic=False")


# --------------------------------------------------------------------------- modifiers


def _window_mask(lo: int, hi: int):
    """Query ``i`` sees key ``j`` iff ``i + lo <= j <= i + hi`` (``lo``, ``hi`` already offset by ``Sk - Sq``).
    The bounds are a captured array, not captured numbers: the GPU compile check is keyed by the types of
    captured arrays but the values of captured numbers, so every new ``Sk - Sq`` would be checked again."""
    band = np.array([lo, hi], dtype=np.int64)

    def window_mask(b, h, q_idx, kv_idx):
        return kv_idx >= q_idx + band[0] and kv_idx <= q_idx + band[1]

    window_mask.numpy = lambda b, h, q, kv: (kv >= q + lo) & (kv <= q + hi)
    return window_mask


def _ones(s, b, h, q, kv):
    return np.ones(np.broadcast_shapes(*map(np.shape, (s, b, h, q, kv))))


def _score_mod(cap: float, slopes, off: int):
    """``c·tanh(s/c)`` (``cap > 0``), then ``- slope[b, h]·|i + off - j|`` (``slopes`` a ``(B, H)`` float32 array),
    with its derivative ``.grad`` and NumPy twins ``.numpy`` (float64).  ``c`` and ``off`` are captured as
    arrays (see :func:`_window_mask`)."""
    c = np.array([cap], dtype=np.float32)
    c64 = float(c[0])
    offset = np.array([off], dtype=np.int64)
    if slopes is None:
        def softcap_score(score, b, h, q_idx, kv_idx):
            return c[0] * float32(math.tanh(score / c[0]))

        def softcap_grad(score, b, h, q_idx, kv_idx):
            t = float32(math.tanh(score / c[0]))
            return float32(1) - t * t

        softcap_grad.numpy = lambda s, b, h, q, kv: 1.0 - np.tanh(s / c64) ** 2
        softcap_score.numpy = lambda s, b, h, q, kv: c64 * np.tanh(s / c64)
        softcap_score.grad = softcap_grad
        return softcap_score

    s64 = slopes.astype(np.float64)
    if cap == 0:
        def alibi_score(score, b, h, q_idx, kv_idx):
            return score - slopes[b, h] * float32(abs(q_idx + offset[0] - kv_idx))

        def alibi_grad(score, b, h, q_idx, kv_idx):
            return float32(1)

        alibi_grad.numpy = _ones
        alibi_score.numpy = lambda s, b, h, q, kv: s - s64[b, h] * np.abs(q + off - kv)
        alibi_score.grad = alibi_grad
        return alibi_score

    def softcap_alibi_score(score, b, h, q_idx, kv_idx):
        return c[0] * float32(math.tanh(score / c[0])) - slopes[b, h] * float32(abs(q_idx + offset[0] - kv_idx))

    def softcap_alibi_grad(score, b, h, q_idx, kv_idx):
        t = float32(math.tanh(score / c[0]))
        return float32(1) - t * t

    softcap_alibi_grad.numpy = lambda s, b, h, q, kv: 1.0 - np.tanh(s / c64) ** 2
    softcap_alibi_score.numpy = lambda s, b, h, q, kv: c64 * np.tanh(s / c64) - s64[b, h] * np.abs(q + off - kv)
    softcap_alibi_score.grad = softcap_alibi_grad
    return softcap_alibi_score


def _plan(Sq: int, Sk: int, causal: bool, window, softcap: float, slopes):
    """flashnb's ``causal`` and the modifiers of one launch of ``Sq`` queries against ``Sk`` keys."""
    left, right = window
    if causal:
        right = 0
    off = Sk - Sq
    mask_mod = None
    if left >= 0 or right > 0:    # (-1, 0) is causal alone; (-1, -1) no mask
        lo = -_UNBOUNDED if left < 0 else off - left
        hi = _UNBOUNDED if right < 0 else off + right
        mask_mod = _window_mask(lo, hi)
    score_mod = _score_mod(softcap, slopes, off) if softcap > 0 or slopes is not None else None
    return right == 0, mask_mod, score_mod


def _launch(q, k, v, *, dropout_p, scale, causal, window, softcap, slopes, impl, options):
    """``(B, Sq, H, d)`` q against ``(B, Sk, H_kv, d)`` k, v: ``(B, Sq, H, d)``, differentiable."""
    flag, mask_mod, score_mod = _plan(q.shape[1], k.shape[1], causal, window, softcap, slopes)
    extra = {n: m for n, m in (("mask_mod", mask_mod), ("score_mod", score_mod)) if m is not None}
    if dropout_p:
        extra["dropout_p"] = dropout_p
    o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=flag, scale=scale, impl=impl,
                  **extra, **options)
    return o.transpose(1, 2).contiguous()


# --------------------------------------------------------------------------- flash_attn_func


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None, *,
                    impl="auto", **options):
    """flash-attn's ``flash_attn_func`` on flashnb's kernels: ``(batch, seqlen_q, heads, d)`` out, differentiable.

    Args:
        q: ``(batch, seqlen_q, heads, d)``; k, v: ``(batch, seqlen_k, heads_k, d)``, ``heads`` a multiple of
            ``heads_k`` (MQA/GQA); float32, float16 or bfloat16, on one device.
        dropout_p: attention dropout probability (0 in evaluation); its seed is drawn from torch's generator.
        softmax_scale: default ``1/sqrt(d)``.
        causal: bottom-right aligned causal mask (query ``i`` sees keys ``j <= i + Sk - Sq``).
        window_size: ``(left, right)``: query ``i`` sees keys ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``;
            ``-1`` leaves that side unbounded.
        softcap: ``> 0``: scores become ``softcap·tanh(s/softcap)``.
        alibi_slopes: float32 ``(heads,)`` or ``(batch, heads)``: ``-slope·|i + Sk - Sq - j|`` added to the score.
        deterministic: the backward's bits the same at every run: met on the simulator, refused on a GPU (see the
            module docstring).
        return_attn_probs, sinks: not supported yet (a ValueError unless False / None).
        impl, **options: flashnb's impl and its options (:func:`flashnb.pytorch.attention`).

    A row that sees no key (causal with ``Sq > Sk``, a window) has output 0.
    """
    _refuse(sinks, return_attn_probs)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(name, t, 4, "(batch, seqlen, heads, d)")
    _check_heads(q, k, v, "(batch, seqlen_k, heads_k, d)", 2)
    if not (q.shape[0] == k.shape[0]):
        raise ValueError(f"q, k, v must have one batch size, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    window = _check_window(window_size)
    cap = _check_softcap(softcap)
    slopes = _check_alibi(alibi_slopes, q.shape[0], q.shape[2])
    _check_deterministic(deterministic, q, k, v)
    return _launch(q, k, v, dropout_p=dropout_p, scale=softmax_scale, causal=bool(causal), window=window,
                   softcap=cap, slopes=slopes, impl=impl, options=options)


# --------------------------------------------------------------------------- flash_attn_varlen_func


def _check_cu_seqlens(name, cu, total: int, total_name: str) -> list[int]:
    """``cu_seqlens``: a 1-D int32 tensor ``[0, ..., total]``, non-decreasing; its values as Python ints."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D torch.int32 tensor (batch + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 (as flash-attn's), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D of length batch + 1 >= 2, got shape {tuple(cu.shape)}")
    values = [int(x) for x in cu.tolist()]
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    drops = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if drops:
        i = drops[0]
        raise ValueError(f"{name} must be non-decreasing (cumulative sequence lengths), but {name}[{i}] = "
                         f"{values[i]} < {name}[{i - 1}] = {values[i - 1]}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the total number of tokens, {total_name} = {total}, got "
                         f"{values[-1]}")
    return values


def _check_max_seqlen(name, value, lengths, cu_name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    longest = max(lengths)
    if int(value) < longest:
        i = lengths.index(longest)
        raise ValueError(f"{name} = {value} is smaller than sequence {i}'s length {longest} (from {cu_name})")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, sinks=None, *,
                           impl="auto", **options):
    """flash-attn's ``flash_attn_varlen_func``: packed sequences without padding, differentiable.

    Args:
        q: ``(total_q, heads, d)``; k, v: ``(total_k, heads_k, d)``: the sequences one after another.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, ``[0, ..., total]`` non-decreasing: sequence ``b``'s
            queries are ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``, its keys and values likewise.
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence's length.
        the rest: as :func:`flash_attn_func`, per sequence (causal alignment, windows and ALiBi distances use each
            sequence's own ``Sq``, ``Sk``; ``alibi_slopes`` may be ``(batch, heads)``).  ``block_table`` (a paged
            K/V for varlen) is not supported yet.

    Returns ``(total_q, heads, d)``.  A sequence with no keys has output 0.

    The kernels see **one launch per sequence** (forward, and backward): sequence ``b``'s slices of q, k, v,
    nothing of the others and no padding, so counted bytes and FLOPs are each sequence's own, summed (padding to
    ``max_seqlen`` would cost ``batch·max_seqlen``).  A packed-sequence tile scheduler, one launch over all the
    sequences, is future work.  Gradients flow through torch's slicing and concatenation.
    """
    _refuse(sinks, return_attn_probs)
    if block_table is not None:
        raise ValueError("block_table: a paged K/V cache is not supported by flash_attn_varlen_func yet; pass "
                         "contiguous k, v (flash_attn_with_kvcache takes a block_table)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(name, t, 3, "(total, heads, d)")
    _check_heads(q, k, v, "(total_k, heads_k, d)", 1)
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q.shape[0]")
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k.shape[0]")
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got {len(cq)} and "
                         f"{len(ck)}")
    B = len(cq) - 1
    len_q = [cq[b + 1] - cq[b] for b in range(B)]
    len_k = [ck[b + 1] - ck[b] for b in range(B)]
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, len_q, "cu_seqlens_q")
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, len_k, "cu_seqlens_k")
    window = _check_window(window_size)
    cap = _check_softcap(softcap)
    slopes = _check_alibi(alibi_slopes, B, q.shape[1])
    _check_deterministic(deterministic, q, k, v)
    outs = []
    for b in range(B):
        qb = q[cq[b]:cq[b + 1]]
        if len_q[b] == 0:
            continue
        if len_k[b] == 0:                                  # no key: every row sees nothing, output 0
            outs.append(torch.zeros_like(qb))
            continue
        o = _launch(qb[None], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]], dropout_p=dropout_p,
                    scale=softmax_scale, causal=bool(causal), window=window, softcap=cap,
                    slopes=None if slopes is None else slopes[b:b + 1], impl=impl, options=options)
        outs.append(o[0])
    if not outs:
        return torch.zeros_like(q)
    return torch.cat(outs, dim=0)


# --------------------------------------------------------------------------- flash_attn_with_kvcache


def _check_int_tensor(name, t, shape_what, B):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.int32 tensor of shape {shape_what}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 (as flash-attn's), got {t.dtype}")
    if t.dim() < 1 or t.shape[0] != B:
        raise ValueError(f"{name} must have shape {shape_what} with batch = q.shape[0] = {B}, "
                         f"got {tuple(t.shape)}")
    return t


def _kv_index(row: int, lo: int, hi: int, pages, page_size):
    """``(cache row or page, position in it)`` index tensors of sequence positions ``lo:hi``: of cache row ``row``,
    or through ``pages`` (the sequence's row of the block table) in a paged cache."""
    pos = torch.arange(lo, hi)
    if pages is None:
        return torch.full_like(pos, row), pos
    return pages[pos // page_size].long(), pos % page_size


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            sinks=None, *, impl=None, **options):
    """flash-attn's ``flash_attn_with_kvcache`` (inference, no autograd): append ``k``, ``v`` to the cache in
    place, then attend ``q`` to each sequence's cached keys.

    Args:
        q: ``(batch, seqlen_q, heads, d)``.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, heads_k, d)``, or with ``block_table`` a paged cache
            ``(num_blocks, page_size, heads_k, d)``.
        k, v: None, or ``(batch, seqlen_new, heads_k, d)``: written into the cache **in place** at positions
            ``cache_seqlens[b] ...  cache_seqlens[b] + seqlen_new - 1`` of sequence ``b`` (needs
            ``cache_seqlens``), then attended to with the rest.
        rotary_cos, rotary_sin, rotary_interleaved: rotary embeddings are not supported yet (a ValueError unless
            None); apply them to q and k before the call.
        cache_seqlens: int, or int32 ``(batch,)``: the keys already cached per sequence (default: the whole
            cache, ``seqlen_cache`` keys, or ``max_blocks·page_size`` paged).  Sequence ``b`` attends to its
            first ``cache_seqlens[b] + seqlen_new`` keys (from ``cache_leftpad[b]`` on, when given).
        cache_batch_idx: int32 ``(batch,)``: the cache row of each sequence (default ``b``; contiguous caches).
        cache_leftpad: int32 ``(batch,)``: the first valid key of each sequence's cache row (contiguous caches).
        block_table: int32 ``(batch, max_blocks)``: sequence ``b``'s position ``p`` lives in page
            ``block_table[b, p // page_size]``, row ``p % page_size`` (only the entries the call reads or
            writes are checked and used).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as :func:`flash_attn_func`, aligned to each
            sequence's own key count.
        num_splits: flash-decoding's split count (0: its heuristic); launches that do not run flash-decoding do
            not split.
        return_softmax_lse, sinks: not supported yet (a ValueError unless False / None).
        impl, **options: flashnb's impl and its options; default: ``"flash-decoding"`` (split-KV,
            :mod:`flashnb.kernels.decode`) where it applies -- at most 8 rows (query heads of a group × new
            queries) per block, ``d <= 128``, no softcap, ALiBi or window, every query seeing a key -- and
            ``"auto"`` (the product kernel) otherwise.

    Returns ``(batch, seqlen_q, heads, d)`` in q's dtype.  Every check runs before anything is written.

    One launch per sequence (each has its own key count).  A paged cache's pages are **gathered on the host**
    (torch indexing) into one contiguous ``(length, heads_k, d)`` copy per sequence for the decode kernel: paged
    addressing inside the decode kernel is future work.
    """
    _refuse(sinks)
    if rotary_cos is not None or rotary_sin is not None:
        raise ValueError("rotary_cos, rotary_sin: rotary embeddings are not supported yet; rotate q and k before "
                         "the call and pass rotary_cos=rotary_sin=None")
    if return_softmax_lse:
        raise ValueError("return_softmax_lse=True is not supported yet; pass return_softmax_lse=False")
    _tensor("q", q, 4, "(batch, seqlen_q, heads, d)")
    paged = block_table is not None
    cache_what = "(num_blocks, page_size, heads_k, d)" if paged else "(batch_cache, seqlen_cache, heads_k, d)"
    _tensor("k_cache", k_cache, 4, cache_what)
    _tensor("v_cache", v_cache, 4, cache_what)
    _check_heads(q, k_cache, v_cache, cache_what, 2)
    B, Sq, H, d = q.shape
    if (k is None) != (v is None):
        raise ValueError("k and v: pass both new keys and values, or neither")
    Snew = 0
    if k is not None:
        _tensor("k", k, 4, "(batch, seqlen_new, heads_k, d)")
        _tensor("v", v, 4, "(batch, seqlen_new, heads_k, d)")
        if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"k, v must have shape (batch, seqlen_new, heads_k, d) = ({B}, seqlen_new, "
                             f"{k_cache.shape[2]}, {k_cache.shape[3]}), got k {tuple(k.shape)}, v {tuple(v.shape)}")
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            raise TypeError(f"k, v must have the cache's dtype {k_cache.dtype}, got {k.dtype}, {v.dtype}")
        if k.device != k_cache.device:
            raise ValueError(f"k, v must be on the cache's device {k_cache.device}, got {k.device}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens must be given with new k, v: it says where they are appended")
        Snew = k.shape[1]
    if paged:
        _check_int_tensor("block_table", block_table, "(batch, max_blocks)", B)
        if block_table.dim() != 2:
            raise ValueError(f"block_table must have shape (batch, max_blocks), got {tuple(block_table.shape)}")
        if cache_batch_idx is not None or cache_leftpad is not None:
            raise ValueError("cache_batch_idx and cache_leftpad apply to a contiguous cache, not a paged one "
                             "(block_table): pass None")
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
        table = block_table.detach().cpu()
    else:
        page_size, capacity, table = None, k_cache.shape[1], None
    rows = list(range(B))
    if cache_batch_idx is not None:
        _check_int_tensor("cache_batch_idx", cache_batch_idx, "(batch,)", B)
        rows = [int(x) for x in cache_batch_idx.reshape(-1).tolist()]
        bad = [r for r in rows if not 0 <= r < k_cache.shape[0]]
        if cache_batch_idx.dim() != 1 or bad:
            raise ValueError(f"cache_batch_idx must be 1-D with entries in [0, {k_cache.shape[0]}) (the cache's "
                             f"rows), got {cache_batch_idx.tolist()}")
    elif not paged and k_cache.shape[0] < B:
        raise ValueError(f"k_cache has {k_cache.shape[0]} rows but q has batch {B}: pass cache_batch_idx or a "
                         "cache with a row per sequence")
    if cache_seqlens is None:
        lengths = [capacity] * B
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        lengths = [int(cache_seqlens)] * B
    else:
        _check_int_tensor("cache_seqlens", cache_seqlens, "(batch,)", B)
        if cache_seqlens.dim() != 1:
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({B},), got {tuple(cache_seqlens.shape)}")
        lengths = [int(x) for x in cache_seqlens.tolist()]
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] must be >= 0, got {n}")
        if n + Snew > capacity:
            where = f" ({block_table.shape[1]} pages of {page_size} in block_table)" if paged else ""
            raise ValueError(f"cache_seqlens[{b}] = {n}: with {Snew} new keys sequence {b} needs positions "
                             f"0..{n + Snew - 1}, beyond the cache's capacity of {capacity} per sequence{where}")
    starts = [0] * B
    if cache_leftpad is not None:
        _check_int_tensor("cache_leftpad", cache_leftpad, "(batch,)", B)
        starts = [int(x) for x in cache_leftpad.reshape(-1).tolist()]
        for b, s in enumerate(starts):
            if not 0 <= s <= lengths[b] + Snew:
                raise ValueError(f"cache_leftpad[{b}] = {s} must be in [0, {lengths[b] + Snew}] (sequence {b}'s "
                                 "key count)")
    if paged:
        for b in range(B):
            used = table[b, :-(-(lengths[b] + Snew) // page_size)]
            bad = ((used < 0) | (used >= k_cache.shape[0])).nonzero()
            if len(bad):
                j = int(bad[0, 0])
                raise ValueError(f"block_table[{b}, {j}] = {int(used[j])} is outside the cache's "
                                 f"{k_cache.shape[0]} pages (sequence {b} uses its first {len(used)} entries)")
    window = _check_window(window_size)
    cap = _check_softcap(softcap)
    slopes = _check_alibi(alibi_slopes, B, H)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: the heuristic), got {num_splits!r}")
    if q.device != k_cache.device:
        raise ValueError(f"q and k_cache must be on one device, got {q.device}, {k_cache.device}")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError(f"q, k_cache, v_cache must have one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) and \
            not (q.dtype == torch.float64 and options.get("allow_float64")):
        raise TypeError(f"q, k_cache, v_cache must be float32, float16 or bfloat16 (float64 with "
                        f"allow_float64=True), got {q.dtype}")

    G = H // k_cache.shape[2]
    outs = []
    with torch.no_grad():
        if Snew:                                                # append in place, every sequence first
            for b in range(B):
                at = _kv_index(rows[b], lengths[b], lengths[b] + Snew, table[b] if paged else None, page_size)
                at = tuple(i.to(k_cache.device) for i in at)
                k_cache[at] = k[b]
                v_cache[at] = v[b]
        for b in range(B):
            at = _kv_index(rows[b], starts[b], lengths[b] + Snew, table[b] if paged else None, page_size)
            Sk = len(at[1])
            if Sk == 0:                                         # no key: output 0
                outs.append(torch.zeros_like(q[b]))
                continue
            at = tuple(i.to(k_cache.device) for i in at)
            kb, vb = k_cache[at][None], v_cache[at][None]       # the gather: (1, Sk, heads_k, d) copies
            decodes = cap == 0 and slopes is None and d <= MAX_HEAD_DIM and G * Sq <= MAX_NQ and \
                window[0] < 0 and (window[1] < 0 or causal) and (not causal or Sq <= Sk)
            chosen = impl if impl is not None else "flash-decoding" if decodes else "auto"
            opts = dict(options)
            if chosen == "flash-decoding" and num_splits:
                opts["num_splits"] = int(num_splits)
            outs.append(_launch(q[b:b + 1], kb, vb, dropout_p=0.0, scale=softmax_scale, causal=bool(causal),
                                window=window, softcap=cap, slopes=None if slopes is None else slopes[b:b + 1],
                                impl=chosen, options=opts)[0])
    return torch.stack(outs)
