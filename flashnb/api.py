"""The public API: NumPy in, NumPy out, float32 compute on the device (GPU or simulator).

Every implementation (``impl="naive"``, ``"fa1"``, ``"fa2"``, ...) is reached through these three
functions; each stage registers itself in :data:`flashnb.registry.IMPLS`.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from . import common
from .registry import IMPLS

__all__ = ["attention", "attention_forward", "attention_backward", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 128

_SHAPES_DOC = "(N, d), (H, N, d) or (B, H, N, d)"


def _torch_to_numpy(name: str, x) -> np.ndarray:
    """A torch tensor's values as a NumPy array (a host copy for a CUDA tensor).  This API returns NumPy and
    tracks no gradients, so a tensor that requires grad is refused rather than silently detached;
    bfloat16 (which NumPy lacks) becomes float32 exactly, as every dtype does before the kernels."""
    if x.requires_grad:
        raise TypeError(f"{name} is a torch.Tensor that requires grad, and flashnb.attention* return NumPy "
                        "arrays (no autograd): use flashnb.torch.attention for gradients, or pass "
                        f"{name}.detach() to compute values only")
    if x.is_complex() or str(x.dtype) == "torch.bool":
        raise TypeError(f"{name} must hold real numbers (a float or integer dtype), got dtype {x.dtype}")
    x = x.detach().cpu()
    if str(x.dtype) == "torch.bfloat16":
        x = x.float()
    return x.numpy()


def _is_torch_tensor(x) -> bool:
    torch = sys.modules.get("torch")            # never imports torch: a tensor means torch is loaded
    return torch is not None and isinstance(x, torch.Tensor)


def _as_real_array(name: str, x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        a = x
    elif _is_torch_tensor(x):
        a = _torch_to_numpy(name, x)
    elif hasattr(x, "copy_to_host"):  # a numba device array
        a = x.copy_to_host()
    else:
        try:
            a = np.asarray(x)
        except Exception as exc:  # pragma: no cover - exotic objects
            raise TypeError(f"{name} must be an array of shape {_SHAPES_DOC}, got {type(x).__name__}") from exc
    if a.dtype == object or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise TypeError(
            f"{name} must hold real numbers (a float or integer dtype), got dtype {a.dtype}"
        )
    return a


def _check_scale(scale, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a positive finite real number or None, got {scale!r}")
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"scale must be a positive finite real number or None, got {scale!r}")
    return s


def _check_impl(impl: str, need_backward: bool = False):
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
    entry = IMPLS[impl]
    if need_backward and entry.backward is None:
        with_bwd = sorted(n for n, e in IMPLS.items() if e.backward is not None)
        raise ValueError(f"impl {impl!r} has no backward; use one of {with_bwd}")
    return entry


def _check_qkv(q, k, v):
    q = _as_real_array("q", q)
    k = _as_real_array("k", k)
    v = _as_real_array("v", v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim not in (2, 3, 4):
            raise ValueError(f"{name} must have shape {_SHAPES_DOC}, got ndim {a.ndim} (shape {a.shape})")
        if 0 in a.shape:
            raise ValueError(f"{name} has an empty axis (shape {a.shape}); every axis must be >= 1")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k, v must have the same ndim, got {q.ndim}, {k.ndim}, {v.ndim}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (..., Nk, d), got k {k.shape} and v {v.shape}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q and k must share the leading (batch, heads) axes, got q {q.shape} and k {k.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim d (last axis), got q {q.shape} and k {k.shape}")
    d = q.shape[-1]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim d (last axis of q, k, v) must be in 1..{MAX_HEAD_DIM}, got {d}")
    return q, k, v


def _to3(a: np.ndarray) -> np.ndarray:
    """(…, N, d) -> (BH, N, d), C-contiguous float32 (a copy when the input is not already that)."""
    return np.ascontiguousarray(a.reshape((-1,) + a.shape[-2:]), dtype=np.float32)


def _check_finite(name: str, a: np.ndarray):
    """Finite *after* conversion to float32 (a finite float64 beyond ±3.4e38 would become inf)."""
    if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or inf; inputs must be finite")
    big = np.finfo(np.float32).max
    if np.issubdtype(a.dtype, np.number) and a.size and np.abs(a).max() > big:
        raise ValueError(f"{name} has values beyond the float32 range (|x| > {big:.3g}); "
                         "the kernels compute in float32")


def _check_causal(causal, Nq: int | None = None, Nk: int | None = None):
    """``False``, ``True`` (bottom-right) or ``"upper_left"``: what the impls get.

    ``causal`` may be False, True, ``"lower_right"`` (= True: FlashAttention's bottom-right alignment) or
    ``"upper_left"`` (SDPA's ``is_causal``); ``"upper_left"`` becomes True when ``Nq == Nk`` (same mask).
    """
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    if isinstance(causal, str) and causal in common.CAUSAL_ALIGNMENTS:
        if causal == "lower_right" or (Nq is not None and Nq == Nk):
            return True
        return causal
    raise TypeError(f"causal must be False, True (= 'lower_right', bottom-right aligned as FlashAttention), "
                     f"'lower_right' or 'upper_left' (top-left aligned, as SDPA's is_causal), got {causal!r}")


def attention_forward(q, k, v, *, causal: bool = False, scale=None, impl: str = "naive", **options):
    """Attention forward pass; returns ``(o, lse)``.

    Args:
        q: queries, shape (N_q, d), (H, N_q, d) or (B, H, N_q, d).
        k, v: keys and values, same leading axes as ``q`` and shape (..., N_k, d); ``1 <= d <= 128``.
        causal: False, True, ``"lower_right"`` or ``"upper_left"``: mask keys after the query.  **True means
            ``"lower_right"``**: aligned to the bottom-right corner when N_q != N_k (query ``i`` sees keys
            ``j <= i + N_k - N_q``, as FlashAttention >= 2.1 and ``torch.nn.attention.bias.causal_lower_right``).
            ``"upper_left"``: query ``i`` sees keys ``j <= i``, as ``scaled_dot_product_attention(is_causal=True)``
            and ``causal_upper_left``.  The two agree when N_q == N_k.
        scale: softmax scale, default ``1/sqrt(d)``; must be finite and positive.
        impl: a registered implementation (``flashnb.registry.IMPLS``), e.g. ``"naive"``.
        **options: implementation-specific options (tile sizes, ``block_mask``, ...).

    Inputs of any real dtype are converted to float32 (the kernels compute in float32), and may be
    non-contiguous.  Returns ``o`` with q's shape and ``lse`` (log-sum-exp of each scaled score row) with
    q's shape minus the last axis, both float32.  A query row that may attend to no key gets
    ``o = 0`` and ``lse = -inf``.
    """
    entry = _check_impl(impl)
    q, k, v = _check_qkv(q, k, v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_finite(name, a)
    s = _check_scale(scale, q.shape[-1])
    unknown = set(options) - set(entry.options)
    if unknown:
        raise TypeError(f"impl {impl!r} got unexpected option(s) {sorted(unknown)}; it accepts {list(entry.options)}")
    qd, kd, vd = (common.to_device(_to3(a)) for a in (q, k, v))
    c = _check_causal(causal, q.shape[-2], k.shape[-2])
    o, lse = entry.forward(qd, kd, vd, causal=c, scale=s, **options)
    return o.copy_to_host().reshape(q.shape), lse.copy_to_host().reshape(q.shape[:-1])


def attention(q, k, v, *, causal: bool = False, scale=None, impl: str = "naive", **options):
    """Attention output ``softmax(scale · q kᵀ [+ causal mask]) v``; see :func:`attention_forward`."""
    return attention_forward(q, k, v, causal=causal, scale=scale, impl=impl, **options)[0]


def attention_backward(q, k, v, o, lse, do, *, causal: bool = False, scale=None, impl: str = "naive", **options):
    """Gradients ``(dq, dk, dv)`` of ``sum(o * do)`` with respect to q, k, v.

    ``o`` and ``lse`` are what :func:`attention_forward` returned for the same inputs and options;
    ``do`` has o's shape.  Shapes, dtypes and options as in :func:`attention_forward`.
    """
    entry = _check_impl(impl, need_backward=True)
    q, k, v = _check_qkv(q, k, v)
    o = _as_real_array("o", o)
    do = _as_real_array("do", do)
    lse = _as_real_array("lse", lse)
    if o.shape != q.shape:
        raise ValueError(f"o must have q's shape {q.shape}, got {o.shape}")
    if do.shape != q.shape:
        raise ValueError(f"do must have q's shape {q.shape}, got {do.shape}")
    if lse.shape != q.shape[:-1]:
        raise ValueError(f"lse must have shape {q.shape[:-1]} (q's shape without d), got {lse.shape}")
    for name, a in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        _check_finite(name, a)
    if np.any(np.isnan(lse)) or np.any(lse == np.inf):
        raise ValueError("lse contains NaN or +inf; pass the lse returned by attention_forward")
    s = _check_scale(scale, q.shape[-1])
    unknown = set(options) - set(entry.options)
    if unknown:
        raise TypeError(f"impl {impl!r} got unexpected option(s) {sorted(unknown)}; it accepts {list(entry.options)}")
    dev = [common.to_device(_to3(a)) for a in (q, k, v, o)]
    lse_d = common.to_device(np.ascontiguousarray(lse.reshape(-1, q.shape[-2]), dtype=np.float32))
    do_d = common.to_device(_to3(do))
    c = _check_causal(causal, q.shape[-2], k.shape[-2])
    dq, dk, dv = entry.backward(*dev, lse_d, do_d, causal=c, scale=s, **options)
    return dq.copy_to_host().reshape(q.shape), dk.copy_to_host().reshape(k.shape), dv.copy_to_host().reshape(v.shape)
