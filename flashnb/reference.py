"""Float64 NumPy reference attention: the ground truth every kernel is compared against.

Conventions (shared with :mod:`flashnb.api`; leading axes, e.g. batch and heads, are independent problems):

* ``q`` is ``(..., N_q, d)``, ``k`` is ``(..., N_k, d)``, ``v`` is ``(..., N_k, d_v)``; all computing is in
  float64, whatever the input dtype.
* Scores ``S = scale · Q Kᵀ`` with ``scale = 1/sqrt(d)`` by default.
* ``allowed[i, j]`` says whether query ``i`` may attend to key ``j``: ``causal`` (True or ``"lower_right"``)
  is aligned to the bottom-right corner (``j <= i + N_k - N_q``, as FlashAttention >= 2.1);
  ``causal="upper_left"`` to the top-left (``j <= i``, as SDPA's ``is_causal``); ``mask`` (boolean, True =
  allowed, broadcastable to ``(..., N_q, N_k)``) is combined with it by AND.
* Forward: ``P = softmax(S)`` over the allowed keys of each row, ``O = P V``,
  ``lse_i = log sum_{j allowed} exp(S_ij)``.
* Backward (gradients of ``sum(O ∘ dO)``): ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``D_i = sum_j P_ij dP_ij``,
  ``dS = P ∘ (dP - D)``, ``dQ = scale · dS K``, ``dK = scale · dSᵀ Q``.
* A row with no allowed key has ``P = 0``: ``o = 0``, ``lse = -inf`` and zero gradients (never NaN,
  and no NumPy warnings).
* Attention modifiers (:mod:`flashnb.flex`): ``score_mod(S, b, h, q_idx, kv_idx)`` is applied to the scaled
  scores before the mask, a NumPy function of broadcast arrays (``b``, ``h`` index the leading axes
  ``(B, H)``; ``(H, N, d)`` inputs have ``b = 0``, ``(N, d)`` ones ``b = h = 0``); the backward multiplies
  ``dS`` by ``score_mod_grad`` (``d score_mod / d S``, same arguments).  :func:`flashnb.flex.numpy_modifier`
  turns a user's scalar modifier into such a function.
* Grouped-query attention: ``k`` and ``v`` may have fewer heads (axis -3) than ``q``, a divisor of them;
  query head ``h`` uses K/V head ``h // G`` and ``dk``, ``dv`` are summed over each group.
* Dropout: ``dropout_mask`` (float64, broadcastable to ``(..., N_q, N_k)``) is the factor ``W_ij`` each
  attention weight is multiplied by -- ``Z_ij / (1 - p)``: ``1/(1-p)`` where kept, 0 where dropped
  (:func:`flashnb.rng.dropout_scale_np` makes the kernels' mask).  ``o = (P ∘ W) v``; ``lse`` stays the
  undropped softmax's.  Backward of ``sum(o ∘ do)`` with ``A = P ∘ W``: ``dv = Aᵀ do``;
  ``∂/∂P_ij = W_ij (do vᵀ)_ij =: dP_ij``; the softmax Jacobian then gives ``dS = P ∘ (dP - rowsum(P ∘ dP))``.
"""

from __future__ import annotations

import math

import numpy as np

F32_MAX = float(np.finfo(np.float32).max)


def check_scale(scale, d: int) -> float:
    """The softmax scale: ``1/sqrt(d)`` by default, else any finite real number float32 can hold.  Zero (uniform
    attention over the allowed keys) and negative scales (the smallest score weighs most) are valid."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a finite real number or None, got {scale!r}")
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"scale must be a finite real number or None, got {scale!r}")
    if abs(s) > F32_MAX:
        raise ValueError(f"scale={scale!r} is beyond the float32 range (|scale| <= {F32_MAX:.4g}); the kernels "
                         "compute in float32")
    return s


_check_scale = check_scale


CAUSAL_ALIGNMENTS = ("lower_right", "upper_left")


def causal_diag(causal, Nq: int, Nk: int) -> int:
    """The ``diag`` a kernel gets: query ``i`` may see key ``j <= i + diag``.

    ``causal`` True or ``"lower_right"`` (bottom-right aligned, FlashAttention >= 2.1): ``Nk - Nq``, so the
    last query sees every key (and with ``Nq > Nk`` the first ``Nq - Nk`` queries see none);
    ``"upper_left"`` (top-left aligned, ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``):
    ``0``, so query ``i`` sees keys ``0..i``.  Both agree when ``Nq == Nk``.  Non-causal launches ignore it.
    """
    return 0 if causal == "upper_left" else Nk - Nq


def check_causal(causal, Nq: int | None = None, Nk: int | None = None):
    """``False``, ``True`` (bottom-right) or ``"upper_left"``: what the impls get.

    ``causal`` may be False, True, ``"lower_right"`` (= True: FlashAttention's bottom-right alignment) or
    ``"upper_left"`` (SDPA's ``is_causal``); ``"upper_left"`` becomes True when ``Nq == Nk`` (same mask).
    """
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    if isinstance(causal, str) and causal in CAUSAL_ALIGNMENTS:
        if causal == "lower_right" or (Nq is not None and Nq == Nk):
            return True
        return causal
    raise TypeError(f"causal must be False, True (= 'lower_right', bottom-right aligned as FlashAttention), "
                     f"'lower_right' or 'upper_left' (top-left aligned, as SDPA's is_causal), got {causal!r}")


_check_causal = check_causal

__all__ = ["attention_forward", "attention_backward", "attention", "expand_block_mask", "ReferenceCache",
           "check_scale", "check_causal", "causal_diag", "CAUSAL_ALIGNMENTS"]


def _group(q, k, v):
    """GQA: ``(k, v, G)`` with K/V heads repeated to q's (``G = 1`` when they match)."""
    if q.ndim >= 3 and k.ndim == q.ndim and k.shape[:-3] == q.shape[:-3] and k.shape[-3] != q.shape[-3]:
        Hq, Hkv = q.shape[-3], k.shape[-3]
        if Hq % Hkv:
            raise ValueError(f"grouped-query attention needs q's heads ({Hq}) to be a multiple of k's ({Hkv})")
        G = Hq // Hkv
        return np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3), G
    return k, v, 1


def _ungroup(g, G):
    """Sum a gradient of repeated K/V heads over each group of ``G``."""
    if G == 1:
        return g
    return g.reshape(g.shape[:-3] + (g.shape[-3] // G, G) + g.shape[-2:]).sum(axis=-3)


def _indices(shape):
    """Broadcastable ``b, h, q_idx, kv_idx`` for scores of ``shape`` (..., Nq, Nk) -- see the module docstring."""
    Nq, Nk = shape[-2:]
    lead = shape[:-2]
    if len(lead) > 2:
        raise ValueError(f"score_mod needs inputs of shape (N, d), (H, N, d) or (B, H, N, d), got scores {shape}")
    B, H = ((1, 1) + tuple(lead))[-2:]
    b = np.arange(B).reshape(B, 1, 1, 1)
    h = np.arange(H).reshape(1, H, 1, 1)
    qi = np.arange(Nq).reshape(1, 1, Nq, 1)
    ki = np.arange(Nk).reshape(1, 1, 1, Nk)
    return b, h, qi, ki


def _modified(S, fn):
    """``fn(S, b, h, q_idx, kv_idx)`` for scores ``S`` (..., Nq, Nk) with at most two leading axes."""
    S4 = S.reshape((1,) * (4 - S.ndim) + S.shape)
    out = np.asarray(fn(S4, *_indices(S.shape)), dtype=np.float64)
    return np.broadcast_to(out, S4.shape).reshape(S.shape)


def _check_inputs(q, k, v, arrays=()):
    """float64 copies of q, k, v (and of any extra ``(name, array)`` pairs with q's shape), validated."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim < 2 or 0 in a.shape:
            raise ValueError(f"{name} must have shape (..., N, d) with every axis >= 1, got {a.shape}")
    k, v, G = _group(q, k, v)
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (..., N_q, d) and k (..., N_k, d) must share leading axes and d, got {q.shape}, {k.shape}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"v must have shape (..., N_k, d_v) matching k {k.shape}, got {v.shape}")
    extra = []
    for name, a in arrays:
        a = np.asarray(a, dtype=np.float64)
        if a.shape != q.shape[:-1] + v.shape[-1:]:
            raise ValueError(f"{name} must have o's shape {q.shape[:-1] + v.shape[-1:]}, got {a.shape}")
        extra.append(a)
    return q, k, v, extra, G


def _allowed(shape, causal, mask):
    """Boolean ``allowed`` of the scores' ``shape`` (..., N_q, N_k): causal AND mask."""
    Nq, Nk = shape[-2:]
    allowed = np.ones((Nq, Nk), dtype=bool)
    causal = _check_causal(causal)
    if causal:
        i = np.arange(Nq)[:, None]
        j = np.arange(Nk)[None, :]
        allowed = j <= i + causal_diag(causal, Nq, Nk)    # diag Nk - Nq: bottom-right aligned; 0: top-left
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be a boolean array (True = allowed), got dtype {mask.dtype}")
        try:
            if np.broadcast_shapes(mask.shape, shape) != tuple(shape):
                raise ValueError
        except ValueError:
            raise ValueError(f"mask of shape {mask.shape} does not broadcast to the scores' shape {shape}") from None
        allowed = allowed & mask
    return np.broadcast_to(allowed, shape)


def _softmax(q, k, causal, scale, mask, score_mod=None):
    """``(P, lse, scale, S)``: masked row softmax of ``S = scale · Q Kᵀ`` (then ``score_mod``); rows with no
    allowed key give P = 0.  ``S`` is the scaled score before ``score_mod``."""
    scale = _check_scale(scale, q.shape[-1])
    S = S0 = scale * (q @ np.swapaxes(k, -1, -2))
    if score_mod is not None:
        S = _modified(S0, score_mod)
    allowed = _allowed(S.shape, causal, mask)
    S = np.where(allowed, S, -np.inf)
    m = S.max(axis=-1, keepdims=True)                     # -inf on a fully masked row
    m = np.where(np.isfinite(m), m, 0.0)                  # ... so use 0 there: no (-inf) - (-inf)
    E = np.exp(S - m)                                     # exp(-inf) = 0 where masked
    l = E.sum(axis=-1, keepdims=True)
    has_key = l > 0
    P = E / np.where(has_key, l, 1.0)
    lse = np.where(has_key, m + np.log(np.where(has_key, l, 1.0)), -np.inf)[..., 0]
    return P, lse, scale, S0


def _dropout_factors(dropout_mask, shape):
    """``dropout_mask`` as float64 broadcast to the scores' ``shape`` (None stays None), validated."""
    if dropout_mask is None:
        return None
    w = np.asarray(dropout_mask)
    if w.dtype == np.bool_ or not np.issubdtype(w.dtype, np.floating):
        raise TypeError(f"dropout_mask must be a float array of the factors Z/(1-p) (0 where dropped), got dtype "
                        f"{w.dtype}")
    try:
        return np.broadcast_to(w.astype(np.float64), shape)
    except ValueError:
        raise ValueError(f"dropout_mask of shape {w.shape} does not broadcast to the scores' shape {shape}") from None


def attention_forward(q, k, v, *, causal=False, scale=None, mask=None, score_mod=None, dropout_mask=None):
    """Reference forward pass; returns ``(o, lse)`` in float64.

    ``o = softmax(scale · q kᵀ, masked) v`` has shape (..., N_q, d_v); ``lse`` (..., N_q) is the
    log-sum-exp of each row's allowed scaled scores (``-inf`` for a row with no allowed key, whose
    ``o`` row is 0).  See the module docstring for the causal/mask conventions, ``score_mod`` and
    ``dropout_mask`` (``o = (P ∘ dropout_mask) v``, ``lse`` unchanged).
    """
    q, k, v, _, _ = _check_inputs(q, k, v)
    P, lse, _, _ = _softmax(q, k, causal, scale, mask, score_mod)
    W = _dropout_factors(dropout_mask, P.shape)
    return (P if W is None else P * W) @ v, lse


def attention(q, k, v, *, causal=False, scale=None, mask=None, score_mod=None, dropout_mask=None):
    """Reference attention output ``o`` only; see :func:`attention_forward`."""
    return attention_forward(q, k, v, causal=causal, scale=scale, mask=mask, score_mod=score_mod,
                             dropout_mask=dropout_mask)[0]


def attention_backward(q, k, v, do, *, causal=False, scale=None, mask=None, score_mod=None, score_mod_grad=None,
                       dropout_mask=None):
    """Reference gradients ``(dq, dk, dv)`` of ``sum(o * do)``, float64, shapes of q, k, v.

    P is recomputed from q and k (nothing from the forward is needed):
    ``dv = Pᵀ do``, ``dP = do vᵀ``, ``dS = P ∘ (dP - rowsum(P ∘ dP))``, ``dq = scale · dS k``,
    ``dk = scale · dSᵀ q``.  Masked entries and fully masked rows have P = 0, so they contribute nothing.
    With ``dropout_mask`` ``W`` (the forward's): ``dv = (P ∘ W)ᵀ do`` and ``dP = (do vᵀ) ∘ W`` (the module
    docstring derives it); the rest is unchanged.
    """
    q, k, v, (do,), G = _check_inputs(q, k, v, [("do", do)])
    if score_mod is not None and score_mod_grad is None:
        raise ValueError("score_mod needs score_mod_grad (d score_mod / d score) for the backward")
    P, _, scale, S0 = _softmax(q, k, causal, scale, mask, score_mod)
    W = _dropout_factors(dropout_mask, P.shape)
    dv = np.swapaxes(P if W is None else P * W, -1, -2) @ do
    dP = do @ np.swapaxes(v, -1, -2)
    if W is not None:
        dP = dP * W                                       # o = (P ∘ W) v: d o / d P_ij carries W_ij
    D = (P * dP).sum(axis=-1, keepdims=True)              # D_i = rowsum(P ∘ dP) = rowsum(do ∘ o)
    dS = P * (dP - D)
    if score_mod is not None:                             # chain rule through the modifier (where P > 0)
        dS = np.where(P > 0, dS * _modified(S0, score_mod_grad), 0.0)
    dq = scale * (dS @ k)
    dk = scale * (np.swapaxes(dS, -1, -2) @ q)
    return dq, _ungroup(dk, G), _ungroup(dv, G)


def expand_block_mask(block_mask, Nq, Nk, Br, Bc):
    """Element mask ``(..., Nq, Nk)`` from a block mask ``(..., ceil(Nq/Br), ceil(Nk/Bc))``.

    Block ``(I, J)`` covers queries ``I·Br .. I·Br+Br-1`` and keys ``J·Bc .. J·Bc+Bc-1`` (the last block
    row/column is cut at ``Nq``/``Nk``); ``mask[i, j] = block_mask[i // Br, j // Bc]``.
    """
    for name, n in (("Nq", Nq), ("Nk", Nk), ("Br", Br), ("Bc", Bc)):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")
    block_mask = np.asarray(block_mask)
    if block_mask.dtype != np.bool_:
        raise TypeError(f"block_mask must be a boolean array (True = compute the block), got dtype {block_mask.dtype}")
    Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
    if block_mask.ndim < 2 or block_mask.shape[-2:] != (Tr, Tc):
        raise ValueError(f"block_mask must have shape (..., {Tr}, {Tc}) = (..., ceil(Nq/Br), ceil(Nk/Bc)) for "
                         f"Nq={Nq}, Nk={Nk}, Br={Br}, Bc={Bc}; got {block_mask.shape}")
    mask = np.repeat(np.repeat(block_mask, Br, axis=-2), Bc, axis=-1)
    return np.ascontiguousarray(mask[..., :Nq, :Nk])


class ReferenceCache:
    """The float64 reference ``(o, lse, (dq, dk, dv))`` for each registered impl on one problem: dense
    attention, or with the impl's own mask (``Impl.mask_for``, e.g. block-sparse); computed once per mask."""

    def __init__(self, q, k, v, do, *, scale=None):
        self.q, self.k, self.v, self.do, self.scale = q, k, v, do, scale
        self._cache: dict = {}

    def for_impl(self, entry, causal: bool):
        Nq, Nk, d = self.q.shape[-2], self.k.shape[-2], self.q.shape[-1]
        mask = entry.mask_for(Nq, Nk, d, causal)
        key = (bool(causal), None if mask is None else mask.tobytes())
        if key not in self._cache:
            args = dict(causal=causal, scale=self.scale, mask=mask)
            self._cache[key] = (*attention_forward(self.q, self.k, self.v, **args),
                                attention_backward(self.q, self.k, self.v, self.do, **args))
        return self._cache[key]
