"""The public API: NumPy in, NumPy out, float32 compute on the device (GPU or simulator).

Every implementation (``impl="naive"``, ``"fa1"``, ``"fa2"``, ...) is reached through these three
functions; each stage registers itself in :data:`flashnb.registry.IMPLS`.  The default, ``impl="auto"``
(:mod:`flashnb.kernels.auto`), runs the product kernel, ``impl="flash"`` (:mod:`flashnb.kernels.launch.flash`: stage 6's
fast loop with every feature below), except for float16 and bfloat16 inputs on an sm_80+ GPU whose tensor cores
passed flashnb's check, which go to ``impl="fa2-tc"`` (stage 7) unless tile options name the product kernel's.

**dtypes and storage**.  Arithmetic is float32 everywhere.  What differs is what the kernels keep in
HBM, the ``storage`` argument:

* ``"float32"``: inputs of any real dtype are converted to float32 copies; every result is float32.  This is
  the only path of impls without half storage (all but ``"flash"`` and ``"fa2-tc"``), whatever the inputs' dtype.
* ``"float16"`` (``impl="flash"``, ``"fa2-tc"``): q, k, v (and o, do) must be float16; the kernels read them as
  they are (half the bytes), widen each element to float32 on chip (fa2-tc: its tensor cores multiply the halves,
  accumulating in float32), and round o (dq, dk, dv) to float16 once, at the
  store.  lse stays float32.  This is what ``storage=None`` (the default) picks for an impl with half storage
  when q, k, v are float16.
* ``"bfloat16"`` (``impl="flash"``, ``"fa2-tc"``): NumPy has no bfloat16, so q, k, v (o, do) are uint16 arrays of
  bfloat16 bit patterns (:func:`flashnb.common.to_bfloat16`; :func:`flashnb.common.from_bfloat16` reads results
  back); explicit only, never picked by ``storage=None``.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from . import common
from .reference import F32_MAX, causal_diag
from .reference import check_causal as _check_causal  # one rule for the API and the reference
from .reference import check_scale as _check_scale
from .registry import AUTO, IMPLS, impl_entry, impl_names
from .rng import check_dropout, dropout_word_np, keep_threshold

__all__ = ["attention", "attention_forward", "attention_backward", "KERNEL_OPTIONS", "MAX_HEAD_DIM", "SCORE_LIMIT"]

from .common import MAX_HEAD_DIM  # noqa: E402  (the head dims every impl is built for)

_SHAPES_DOC = "(N, d), (H, N, d) or (B, H, N, d)"


def _torch_to_numpy(name: str, x) -> np.ndarray:
    """A torch tensor's values as a NumPy array (a host copy for a CUDA tensor).  This API returns NumPy and
    tracks no gradients, so a tensor that requires grad is refused rather than silently detached;
    bfloat16 (which NumPy lacks) becomes float32 exactly, as every dtype does before the kernels."""
    if x.requires_grad:
        raise TypeError(f"{name} is a torch.Tensor that requires grad, and flashnb.attention* return NumPy "
                        "arrays (no autograd): use flashnb.pytorch.attention for gradients, or pass "
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
        try:                          # nested lists and other array-likes: converted as np.asarray converts them
            a = np.asarray(x)
        except Exception as exc:      # a ragged list, an exotic object
            raise TypeError(f"{name} must be an array of shape {_SHAPES_DOC} (a NumPy array, or nested lists of "
                            f"numbers with equal lengths at each level), got a {type(x).__name__} NumPy cannot "
                            f"make one array of ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                            ) from None
    if a.dtype == object or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise TypeError(
            f"{name} must hold real numbers (a float or integer dtype), got dtype {a.dtype}"
        )
    return a


#: Largest |score| (``scale · q·k`` and every partial sum of ``q·k``) the float32 kernels accept: half the
#: float32 range, so that differences of scores (``s - m``, ``s - L``) stay finite too.
SCORE_LIMIT = F32_MAX / 2


def _per_query_head(a: np.ndarray, BH: int) -> np.ndarray:
    """K/V ``(BH_kv, N, d)`` repeated to ``BH`` query heads (grouped-query attention; unchanged otherwise)."""
    return a if a.shape[0] == BH else np.repeat(a, BH // a.shape[0], axis=0)


def _check_score_range(q3: np.ndarray, k3: np.ndarray, scale: float) -> None:
    """Refuse inputs whose scores float32 cannot hold: ``|Σ_l q_il k_jl|`` (every partial sum) and
    ``|scale · q_i·k_j|`` must stay within :data:`SCORE_LIMIT` (else the kernels give inf, then NaN).

    Cheap first (Cauchy-Schwarz: every partial sum is at most ``‖q_i‖·‖k_j‖``, O(N·d)); only when that bound
    is over the limit the exact bound ``max (|q| |k|ᵀ)`` is computed (float64, one matmul per head)."""
    q64 = q3.astype(np.float64)
    k64 = _per_query_head(k3, q3.shape[0]).astype(np.float64)
    qn = np.sqrt(np.einsum("bnd,bnd->bn", q64, q64)).max(axis=1)
    kn = np.sqrt(np.einsum("bnd,bnd->bn", k64, k64)).max(axis=1)
    bound = float((qn * kn).max())
    if bound <= SCORE_LIMIT and abs(scale) * bound <= SCORE_LIMIT:
        return
    exact = max(float((np.abs(qb) @ np.abs(kb).T).max()) for qb, kb in zip(q64, k64))
    if exact > SCORE_LIMIT:
        raise ValueError(f"q and k: the dot products q·k reach {exact:.3g} in magnitude, beyond {SCORE_LIMIT:.3g} "
                         "(half the float32 range), so the float32 kernels would give inf and NaN; scale q and k "
                         "down (and the softmax scale up by the same factor squared)")
    if abs(scale) * exact > SCORE_LIMIT:
        raise ValueError(f"scale={scale!r}: the scores scale·q·k reach {abs(scale) * exact:.3g} in magnitude, beyond "
                         f"{SCORE_LIMIT:.3g} (half the float32 range), so the float32 kernels would give inf and "
                         "NaN; use a smaller scale")


def _check_sum_range(v3: np.ndarray, do3: np.ndarray | None = None) -> None:
    """Refuse values whose sums float32 cannot hold although each value can.

    Forward: the unnormalised ``O~_i = Σ_j exp(s_ij - m_i) v_j`` (exp <= 1) reaches up to ``Σ_j |v_jc|`` before
    the division by ``l_i``; a v of 1e38 over 12 keys gives inf, then NaN, while o itself would be finite.
    Backward (``do3`` given): ``dP_ij = do_i · v_j`` and ``dV_j = Σ_i P_ij do_i`` must stay finite as well.
    """
    v64 = np.abs(v3.astype(np.float64))
    colsum = float(v64.sum(axis=1).max())
    if colsum > SCORE_LIMIT:
        raise ValueError(f"v: a column sums to {colsum:.3g} in magnitude over the keys (Σ_j |v_jc|), beyond "
                         f"{SCORE_LIMIT:.3g} (half the float32 range); the kernels accumulate exp(s - m)·v before "
                         "dividing by l, so they would give inf and NaN; scale v down (o scales with it)")
    if do3 is None:
        return
    do64 = np.abs(do3.astype(np.float64))
    if float(do64.sum(axis=1).max()) > SCORE_LIMIT:
        raise ValueError(f"do: a column sums to {float(do64.sum(axis=1).max()):.3g} in magnitude over the queries, "
                         f"beyond {SCORE_LIMIT:.3g}, so dV = Pᵀ·do would overflow float32; scale do down")
    dp = max(float((dob @ vb.T).max()) for dob, vb in zip(do64, _per_query_head(v64, do64.shape[0])))
    if dp > SCORE_LIMIT:
        raise ValueError(f"do and v: the products dP = do·vᵀ reach {dp:.3g} in magnitude, beyond {SCORE_LIMIT:.3g} "
                         "(half the float32 range), so the float32 backward would give inf and NaN; scale do or v "
                         "down (the gradients scale with them)")


#: The keys ``kernel_options=`` takes: how a kernel runs (tiles, warps, splits), never what it computes.  ``Br``,
#: ``Bc``: the query and key tile rows; ``warps``: warps per thread block; ``tile``: the naive and one-pass
#: kernels' square tile; ``M``: the on-chip memory (floats) stage 3 (``"fa1"``) sizes its tiles from;
#: ``num_splits``: the chunks of the keys of ``"flash-decoding"``.  Each impl takes the ones it has.
KERNEL_OPTIONS = ("Br", "Bc", "warps", "tile", "M", "num_splits")


def _with_kernel_options(kernel_options, options: dict) -> dict:
    """``options`` with ``kernel_options`` merged in (FlexAttention's convention: one dict of kernel knobs, apart
    from the semantics).  The same knobs given as keywords are still accepted; a knob given both ways, or a key
    that is no kernel knob, is a ValueError."""
    if kernel_options is None:
        return options
    if not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict (keys among {list(KERNEL_OPTIONS)}), got "
                        f"{type(kernel_options).__name__}")
    for key in kernel_options:
        if key not in KERNEL_OPTIONS:
            raise ValueError(f"kernel_options: unknown key {key!r}; allowed keys: {list(KERNEL_OPTIONS)}")
        if key in options:
            raise ValueError(f"kernel_options: {key!r} is also given as a keyword; give it once")
    return {**options, **kernel_options}


def _check_impl(impl: str, need_backward: bool = False):
    entry = impl_entry(impl) if isinstance(impl, str) else None
    if entry is None:
        raise ValueError(f"impl must be one of {impl_names()}, got {impl!r}")
    if need_backward and entry.backward is None:
        with_bwd = sorted(n for n, e in IMPLS.items() if e.backward is not None)
        raise ValueError(f"impl {impl!r} has no backward; use one of {with_bwd}")
    return entry


_MODIFIERS = ("score_mod", "mask_mod", "score_mod_grad")
_DROPOUT = ("dropout_p", "seed")


def _check_dropout(entry, impl: str, options: dict) -> dict:
    """``dropout_p`` and ``seed`` checked (:func:`flashnb.rng.check_dropout`): with ``dropout_p == 0`` both are
    dropped (no dropout: every impl runs); ``dropout_p > 0`` needs a seed and an impl with dropout."""
    p = check_dropout(options.get("dropout_p", 0.0), options.get("seed"))
    if p == 0:
        return {n: value for n, value in options.items() if n not in _DROPOUT}
    if "dropout_p" not in entry.options:
        have = sorted(n for n, e in IMPLS.items() if "dropout_p" in e.options)
        raise ValueError(f"impl {impl!r} has no attention dropout (dropout_p={p!r}); use one of {have}, or "
                         "dropout_p=0")
    return dict(options, dropout_p=p, seed=int(options["seed"]))


def _check_options(entry, impl: str, options: dict, q, k) -> dict:
    """Options the impl accepts; modifiers and grouped-query K/V only for impls that support them.  Adds
    ``heads`` (q's H, for ``b = z // H``, ``h = z % H``) when a modifier or a block mask with one is given; a
    caller whose q is already flattened to (B·H, N, d) passes ``heads=H`` itself (as ``flashnb.pytorch`` does).
    ``dropout_p``/``seed``: see :func:`_check_dropout`."""
    if any(n in options for n in _DROPOUT):
        options = _check_dropout(entry, impl, options)
    unknown = set(options) - set(entry.options) - ({"heads"} if "score_mod" in entry.options else set())
    if unknown:
        mods = sorted(unknown & set(_MODIFIERS))
        if mods:
            have = sorted(n for n, e in IMPLS.items() if "score_mod" in e.options)
            raise TypeError(f"impl {impl!r} does not take attention modifiers ({', '.join(mods)}); use one of "
                            f"{have}")
        raise TypeError(f"impl {impl!r} got unexpected option(s) {sorted(unknown)}; it accepts {list(entry.options)}")
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3] and not entry.gqa:
        have = sorted(n for n, e in IMPLS.items() if e.gqa)
        raise ValueError(f"q and k must share the leading (batch, heads) axes: impl {impl!r} does not support "
                         f"grouped-query attention (q has {q.shape[-3]} heads, k and v have {k.shape[-3]}); use one "
                         f"of {have}, or repeat k and v to q's heads")
    if any(options.get(n) is not None for n in _MODIFIERS) or \
            getattr(options.get("block_mask"), "mask_mod", None) is not None:
        if options.get("heads") is None:
            options = dict(options, heads=q.shape[-3] if q.ndim >= 3 else 1)
        if entry.mask_tiles is not None:
            options = _surface_modifiers(entry, options, q, k)
    return options


def _surface_modifiers(entry, options: dict, q, k) -> dict:
    """For an impl whose kernels take ``mask_mod`` only through its block mask (``Impl.mask_tiles``, e.g.
    ``"flash"``): the modifiers checked for a GPU here (:func:`flashnb.flex.check_modifiers`: before any launch),
    and ``mask_mod``'s block mask built here (:func:`flashnb.flex.create_block_mask` at the impl's mask tiles) when
    none is given.  Shared by this API and :mod:`flashnb.pytorch`."""
    from . import flex

    mask_mod = options.get("mask_mod")
    bm_mod = getattr(options.get("block_mask"), "mask_mod", None)
    flex.check_modifiers(score_mod=options.get("score_mod"), mask_mod=mask_mod if mask_mod is not None else bm_mod,
                         score_mod_grad=options.get("score_mod_grad"))
    H = options["heads"]
    BH = math.prod(q.shape[:-2])
    if BH % H:
        raise ValueError(f"heads={H} must divide batch·heads = {BH} (q's leading axes)")
    if bm_mod is not None:
        # a given block mask: still what its mask_mod's arrays hold (unless the call's mask_mod is that very
        # snapshot, as flashnb.pytorch's backward passes its forward's), and made for this call's (B, H)
        if not (isinstance(mask_mod, flex.Snapshot) and mask_mod == bm_mod):
            flex.check_current(bm_mod)
        flex.check_heads(bm_mod, options["block_mask"].mask.shape[:-2], BH // H, H, q.shape[-2], k.shape[-2])
    if mask_mod is None or options.get("block_mask") is not None:
        return options
    t = entry.mask_tiles(q.shape[-1], Br=options.get("Br"), Bc=options.get("Bc"))
    return dict(options, block_mask=flex.create_block_mask(mask_mod, BH // H, H, q.shape[-2], k.shape[-2], Br=t["Br"],
                                                           Bc=t["Bc"]))


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
    if q.ndim >= 3 and q.shape[:-3] == k.shape[:-3] and q.shape[-3] != k.shape[-3]:
        if q.shape[-3] % k.shape[-3]:
            raise ValueError(f"grouped-query attention: q's heads ({q.shape[-3]}, q {q.shape}) must be a multiple "
                             f"of k's and v's heads ({k.shape[-3]}, k {k.shape})")
    elif q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q and k must share the leading (batch, heads) axes, got q {q.shape} and k {k.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim d (last axis), got q {q.shape} and k {k.shape}")
    d = q.shape[-1]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim d (last axis of q, k, v) must be in 1..{MAX_HEAD_DIM}, got {d}")
    return q, k, v


def _to3(a: np.ndarray, storage: str = "float32") -> np.ndarray:
    """(…, N, d) -> (BH, N, d), C-contiguous float32 (a copy when the input is not already that); with
    ``storage`` the array as it is (already in that dtype: :func:`_resolve_storage` checked it)."""
    return np.ascontiguousarray(a.reshape((-1,) + a.shape[-2:]), dtype=common.storage_dtype(storage))


def _values(a: np.ndarray, storage: str) -> np.ndarray:
    """An input's values as float32 (bfloat16 bit patterns decoded), for the range checks."""
    return common.from_bfloat16(a) if storage == "bfloat16" else a


_HALF_DTYPE = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}


def _explicit_storage(entry, impl: str, storage: str) -> str:
    """A storage given by name, checked (:func:`flashnb.common.check_storage`) and refused for an impl without half
    storage unless it is float32 (shared by this API and :mod:`flashnb.pytorch`, which then check the dtypes)."""
    storage = common.check_storage(storage)
    if storage != "float32" and "storage" not in entry.options:
        have = sorted(n for n, e in IMPLS.items() if "storage" in e.options)
        raise ValueError(f"storage={storage!r}: impl {impl!r} has no half-precision storage (it computes from "
                         f"float32 copies: pass storage='float32' or None); impls with half storage: {have}")
    return storage


def _resolve_storage(entry, impl: str, storage, arrays: dict) -> str:
    """The storage of a call (see the module docstring): ``storage`` checked against the impl and the arrays'
    dtypes, or (``None``) float16 for float16 inputs of an impl with half storage, else float32."""
    half_ok = "storage" in entry.options
    dtypes = {name: np.dtype(a.dtype) for name, a in arrays.items()}
    for name, a in arrays.items():
        common.check_bfloat16_bits(name, a, storage)
    if storage is None:
        f16 = [name for name, t in dtypes.items() if t == np.float16]
        if not f16 or not half_ok:
            return "float32"                     # the float32 path (float16 inputs of other impls too)
        others = {name: str(t) for name, t in dtypes.items() if t != np.float16}
        if others:
            raise TypeError(f"impl {impl!r} keeps float16 inputs in float16 (half storage), so "
                            f"{', '.join(dtypes)} must all be float16: {', '.join(f16)} are float16 but "
                            f"{', '.join(f'{n} is {t}' for n, t in others.items())}; convert them, or pass "
                            "storage='float32' to compute from float32 copies of all of them")
        return "float16"
    storage = _explicit_storage(entry, impl, storage)
    if storage == "float32":
        return storage
    want = _HALF_DTYPE[storage]
    for name, t in dtypes.items():
        if t != want:
            what = "uint16 bfloat16 bit patterns (flashnb.common.to_bfloat16)" if storage == "bfloat16" else "float16"
            raise TypeError(f"storage={storage!r} takes {name} as {what}, got dtype {t}")
    return storage


def _check_finite(name: str, a: np.ndarray):
    """Finite *after* conversion to float32 (a finite float64 beyond ±3.4e38 would become inf)."""
    if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or inf; inputs must be finite")
    big = np.finfo(np.float32).max
    if np.issubdtype(a.dtype, np.number) and a.size and np.abs(a).max() > big:
        raise ValueError(f"{name} has values beyond the float32 range (|x| > {big:.3g}); "
                         "the kernels compute in float32")


def attention_forward(q, k, v, *, causal: bool = False, scale=None, impl: str = AUTO, storage=None,
                      kernel_options: dict | None = None, **options):
    """Attention forward pass; returns ``(o, lse)``.

    Args:
        q: queries, shape (N_q, d), (H, N_q, d) or (B, H, N_q, d).
        k, v: keys and values, same leading axes as ``q`` and shape (..., N_k, d); ``1 <= d <= 128``.
        causal: False, True, ``"lower_right"`` or ``"upper_left"``: mask keys after the query.  **True means
            ``"lower_right"``**: aligned to the bottom-right corner when N_q != N_k (query ``i`` sees keys
            ``j <= i + N_k - N_q``, as FlashAttention >= 2.1 and ``torch.nn.attention.bias.causal_lower_right``).
            ``"upper_left"``: query ``i`` sees keys ``j <= i``, as ``scaled_dot_product_attention(is_causal=True)``
            and ``causal_upper_left``.  The two agree when N_q == N_k.
        scale: softmax scale, default ``1/sqrt(d)``; any finite real number (0: uniform weights over the
            allowed keys; negative: the smallest score weighs most).  ``|scale · q·k|`` must stay within
            :data:`SCORE_LIMIT` (half the float32 range), else ValueError.
        impl: a registered implementation (``flashnb.registry.IMPLS``) or ``"auto"`` (the default): ``"flash"``,
            the product kernel (every feature below), or ``"fa2-tc"`` for half inputs on a checked sm_80+ GPU
            unless tile options are given (:mod:`flashnb.kernels.auto`; ``Br``, ``Bc``, ``warps`` name the product
            kernel's tiles); a stage's impl (``"naive"``, ``"fa1"``, ``"fa2"``,
            ``"fa2-fast"``, ...) runs that lesson's kernels.
        storage: ``None`` (default), ``"float32"``, ``"float16"`` or ``"bfloat16"``: the dtype the kernels keep
            q, k, v and o in (see the module docstring).  ``None``: float16 when q, k, v are float16 and the impl
            has half storage (``"flash"``; then all three must be float16, else TypeError), float32
            otherwise.
            A half storage for an impl without one is a ValueError.
        kernel_options: how the kernels run, as one dict (FlexAttention's convention): keys among
            :data:`KERNEL_OPTIONS` -- ``Br``, ``Bc`` (tile rows of Q and of K/V), ``warps``, ``tile`` (``"naive"``,
            ``"onepass"``), ``M`` (``"fa1"``), ``num_splits`` (``"flash-decoding"``); e.g.
            ``kernel_options={"Br": 32, "Bc": 32}``.  An unknown key is a ValueError listing the allowed ones; a
            key the impl does not take is a TypeError, as the same keyword would be.  The keywords themselves
            (``Br=32``) are still accepted.
        **options: implementation-specific options (``block_mask``, modifiers, dropout, ...; tile knobs too).
            ``impl="flash"`` (and ``"fa2-tc"``) also take attention modifiers (:mod:`flashnb.flex`):
            ``score_mod(score, b, h, q_idx, kv_idx)`` (float32), ``mask_mod(b, h, q_idx, kv_idx)`` (bool; becomes
            a block mask whose empty tiles are skipped),
            ``block_mask=flashnb.flex.create_block_mask(mask_mod, ...)``, and for the backward
            ``score_mod_grad`` (d score_mod / d score; the gallery's modifiers carry it as ``.grad``; without
            either it is derived from ``score_mod``'s source: :func:`flashnb.flex_grad.derivative`).  ``b``,
            ``h`` index q's leading axes (B, H).  ``impl="flash-decoding"`` (forward only; for a few new queries,
            ``N_q <= 8``, against a long K/V cache: :mod:`flashnb.kernels.decode`) takes ``num_splits`` (chunks of the
            keys, default: enough blocks to fill the GPU's SMs in one wave) and ``warps``.

    Grouped-/multi-query attention: with ``impl="flash"`` or ``"flash-decoding"``, k and v may have fewer
    heads (axis -3) than q, a divisor of q's heads; query head ``h`` uses K/V head ``h // (H_q / H_kv)``.

    Attention dropout (``impl="flash"``): ``dropout_p`` in ``[0, 1)`` and ``seed``, an int in
    ``[0, 2**64)`` (required when ``dropout_p > 0``; there is no default because :func:`attention_backward` needs
    the same one).  Each weight ``P_ij`` is kept with probability ``1 - p`` and scaled by ``1/(1-p)``, decided by
    Philox4x32-10 from ``(seed, batch·head, row, column)`` (:mod:`flashnb.rng`, whose
    ``dropout_keep_np(seed, p, BH, Nq, Nk)`` gives the same mask in NumPy; batch·head is the index in q's
    flattened leading axes); ``lse`` is the undropped softmax's.  Precision: an element is kept iff its 32-bit
    Philox word is ``>= ceil(p·2^32)`` (keep probability within ``2^-32`` of ``1 - p``), and the factor is
    ``1/(1-p)`` computed in float64 and rounded once to float32 (within ``2^-24``); ``p <= 1 - 2^-32``.
    ``dropout_p=0`` is no dropout, for any impl; ``"flash"`` takes dropout with attention modifiers too.

    With float32 storage, inputs of any real dtype are converted to float32 (the kernels compute in float32),
    and may be non-contiguous.  Returns ``o`` with q's shape and ``lse`` (log-sum-exp of each scaled score row)
    with q's shape minus the last axis; ``lse`` is float32, ``o`` is in the storage: float32, float16, or uint16
    bfloat16 bits (o is a convex combination of v's rows, so it never leaves float16's range).  A query row
    that may attend to no key gets ``o = 0`` and ``lse = -inf``.
    """
    entry = _check_impl(impl)
    options = _with_kernel_options(kernel_options, options)
    q, k, v = _check_qkv(q, k, v)
    storage = _resolve_storage(entry, impl, storage, dict(q=q, k=k, v=v))
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_finite(name, _values(a, storage))
    s = _check_scale(scale, q.shape[-1])
    options = _check_options(entry, impl, options, q, k)
    if storage != "float32":
        options = dict(options, storage=storage)
    causal = _check_causal(causal, q.shape[-2], k.shape[-2])
    q3, k3, v3 = (_to3(_values(a, storage)) for a in (q, k, v))   # float32 values, for the range checks
    _check_score_range(q3, k3, s)
    _check_sum_range(v3)
    if storage != "float32":
        q3, k3, v3 = (_to3(a, storage) for a in (q, k, v))
    qd, kd, vd = (common.to_device(a, storage) for a in (q3, k3, v3))
    o, lse = entry.forward(qd, kd, vd, causal=causal, scale=s, **options)
    return o.copy_to_host().reshape(q.shape), lse.copy_to_host().reshape(q.shape[:-1])


def attention(q, k, v, *, causal: bool = False, scale=None, impl: str = AUTO, storage=None,
              kernel_options: dict | None = None, **options):
    """Attention output ``softmax(scale · q kᵀ [+ causal mask]) v``; see :func:`attention_forward`
    (``kernel_options``: a dict of kernel knobs, keys among :data:`KERNEL_OPTIONS`)."""
    return attention_forward(q, k, v, causal=causal, scale=scale, impl=impl, storage=storage,
                             kernel_options=kernel_options, **options)[0]


def attention_backward(q, k, v, o, lse, do, *, causal: bool = False, scale=None, impl: str = AUTO,
                       check_forward: bool = True, storage=None, kernel_options: dict | None = None, **options):
    """Gradients ``(dq, dk, dv)`` of ``sum(o * do)`` with respect to q, k, v.

    What the backward assumes: ``o`` and ``lse`` are what :func:`attention_forward` returned for the *same*
    q, k, v, ``causal``, ``scale`` and mask-defining options (``block_mask``, ``window``, tiles of a block mask).
    The kernels never recompute the forward: they rebuild ``P = exp(scale·q kᵀ - lse)`` from the given ``lse``
    and use ``D = rowsum(do ∘ o)`` from the given ``o``, so a wrong ``o`` or ``lse`` gives wrong gradients
    without any error.  ``check_forward=True`` (the default) guards against that: rows of ``o`` and ``lse`` are
    recomputed in float64 and a ValueError names the first row that is off by more than float32 rounding
    explains.  Small problems (at most :data:`CHECK_ALL_ROWS` rows of batch·heads × N_q, and
    BH·N_q·N_k·d <= 2**22: every simulator-sized problem) are checked row by row, all of them; larger ones
    are sampled -- the first, middle and last query of the first and last batch·head, O(N·d) work -- which
    catches a forward run with other inputs, causal setting, scale or mask, or a scaled ``o``, but not a
    change confined to unsampled rows.  The tolerance is float32's (``1e-3·(1 + |scale|·max Σ|q||k|)`` on
    ``lse``, twice that times max|v| on ``o``), so an error smaller than that passes.  ``check_forward=False``
    skips it (e.g. inside a timed loop).

    ``do`` has o's shape.  Shapes, dtypes and options as in :func:`attention_forward`; ``storage`` as there, for
    q, k, v, o and do (all five float16 for ``storage=None`` to pick float16), and the gradients come back in it
    (``lse`` is float32 whatever the storage; with half storage dq is summed in float32 and rounded once).
    float16 holds at most 65504 in magnitude: a gradient beyond that is a ValueError naming it (use
    ``storage="float32"``, or scale ``do`` down), never a silent inf.  Precision with half storage (unit
    roundoff ``u`` = 2^-11 float16, 2^-8 bfloat16): besides each gradient's own rounding, dq and dk inherit the
    rounding of the stored o through ``D = rowsum(do ∘ o)`` (as in every FlashAttention): ``δD_i <= u·Σ_c
    |do_ic·o_ic|``, so ``|δdq_i| <= |scale|·δD_i·Σ_j P_ij |k_j|`` and ``|δdk_j| <= |scale|·Σ_i P_ij δD_i |q_i|``,
    which scales with ``|v|·|do|·u`` rather than with the gradient (it dominates where ``dP - D`` nearly
    cancels, e.g. v with a large common offset); dv has no such term; ``storage="float32"`` removes it.  The
    ``check_forward`` tolerance on ``o`` also allows the storage's rounding (half an ulp: 2^-11 relative in
    float16, 2^-8 in bfloat16).

    Dropout: pass the forward's ``dropout_p`` and ``seed``; the kernels regenerate its mask from them (nothing
    was stored).  Another seed gives gradients of another mask, without error -- except that
    ``check_forward`` recomputes ``o`` with the mask of the seed given here, so a mismatch there is caught.

    ``kernel_options``: the backward's kernel knobs, as in :func:`attention_forward` (its tiles need not be the
    forward's).
    """
    entry = _check_impl(impl, need_backward=True)
    options = _with_kernel_options(kernel_options, options)
    q, k, v = _check_qkv(q, k, v)
    o = _as_real_array("o", o)
    do = _as_real_array("do", do)
    lse = _as_real_array("lse", lse)
    storage = _resolve_storage(entry, impl, storage, dict(q=q, k=k, v=v, o=o, do=do))
    if o.shape != q.shape:
        raise ValueError(f"o must have q's shape {q.shape}, got {o.shape}")
    if do.shape != q.shape:
        raise ValueError(f"do must have q's shape {q.shape}, got {do.shape}")
    if lse.shape != q.shape[:-1]:
        raise ValueError(f"lse must have shape {q.shape[:-1]} (q's shape without d), got {lse.shape}")
    for name, a in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        _check_finite(name, _values(a, storage))
    if np.any(np.isnan(lse)) or np.any(lse == np.inf):
        raise ValueError("lse contains NaN or +inf; pass the lse returned by attention_forward")
    s = _check_scale(scale, q.shape[-1])
    if not isinstance(check_forward, (bool, np.bool_)):
        raise TypeError(f"check_forward must be True or False, got {check_forward!r}")
    if options.get("score_mod") is not None and options.get("score_mod_grad") is None and \
            "score_mod" in entry.options:
        from .flex_grad import score_mod_grad_of

        # score_mod.grad, else derived from its source: checked for a GPU below with the other modifiers
        options = dict(options, score_mod_grad=score_mod_grad_of(options["score_mod"]))
    options = _check_options(entry, impl, options, q, k)
    causal = _check_causal(causal)
    q3, k3, v3, o3 = (_to3(_values(a, storage)) for a in (q, k, v, o))   # float32 values, for the checks
    lse2 = np.ascontiguousarray(lse.reshape(-1, q.shape[-2]), dtype=np.float32)
    _check_score_range(q3, k3, s)
    do3 = _to3(_values(do, storage))
    _check_sum_range(v3, do3)
    if check_forward:
        _check_forward_outputs(entry, q3, k3, v3, o3, lse2, causal, s, options, rounding=_ROUNDING[storage])
    if storage != "float32":
        options = dict(options, storage=storage)
        q3, k3, v3, o3, do3 = (_to3(a, storage) for a in (q, k, v, o, do))
    dev = [common.to_device(a, storage) for a in (q3, k3, v3, o3)]
    lse_d = common.to_device(lse2)
    do_d = common.to_device(do3, storage)
    dq, dk, dv = entry.backward(*dev, lse_d, do_d, causal=causal, scale=s, **options)
    grads = (dq.copy_to_host().reshape(q.shape), dk.copy_to_host().reshape(k.shape), dv.copy_to_host().reshape(v.shape))
    if storage == "float16":
        for name, g in zip(("dq", "dk", "dv"), grads):
            if not np.all(np.isfinite(g)):
                raise ValueError(f"{name} overflows float16: a gradient is beyond 65504 in magnitude (the kernels "
                                 "computed it in float32 and rounded it to inf at the store); use storage='float32' "
                                 "or scale do down (the gradients scale with it)")
    return grads


#: The unit roundoff of each storage: half an ulp, relative (the most a round-to-nearest store changes a value).
_ROUNDING = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def _mask_rows(entry, options: dict, BH: int, Nq: int, Nk: int, d: int, causal: bool):
    """A function ``(b, i) -> bool (Nk,)``: the keys query ``i`` of batch·head ``b`` may attend to, with the
    causal rule (bottom-right aligned) and the impl's own mask (``Impl.mask_for``, or fa2's ``block_mask``)."""
    full = entry.mask_for(Nq, Nk, d, causal, **options) if entry.reference_mask is not None else None
    blocks = None
    mask_mod = options.get("mask_mod") or getattr(options.get("block_mask"), "mask_mod", None)
    if mask_mod is not None:                 # flex: the element mask is mask_mod's (the block mask follows it)
        from .flex import mask_array

        H = options.get("heads", 1)
        full = mask_array(mask_mod, BH // H, H, Nq, Nk).reshape(BH, Nq, Nk)
    elif full is None and options.get("block_mask") is not None:
        from .kernels.launch.fit import PreparedMask
        from .masks import BlockMask
        from .stages import fa2

        bm = options["block_mask"]
        if isinstance(bm, (fa2.PreparedMask, PreparedMask)):
            blocks = (bm.M.copy_to_host().astype(bool), bm.tiles["Br"], bm.tiles["Bc"])
        else:
            if not isinstance(bm, BlockMask):   # a plain array is read at the forward's tiles (fa2.block_tiles)
                fwd = fa2.default_tiles(d, "forward")
                bm = BlockMask(np.asarray(bm), Br=options.get("Br") or fwd["Br"], Bc=options.get("Bc") or fwd["Bc"])
            bm.check(Nq, Nk, BH=BH)
            blocks = (bm.mask.reshape((-1,) + bm.mask.shape[-2:]), bm.Br, bm.Bc)
    keys = np.arange(Nk)

    def row(b: int, i: int) -> np.ndarray:
        ok = keys <= i + causal_diag(causal, Nq, Nk) if causal else np.ones(Nk, dtype=bool)
        if full is not None:
            f = np.asarray(full).reshape(-1, Nq, Nk)
            ok = ok & f[b if f.shape[0] > 1 else 0, i]
        if blocks is not None:
            M, Br, Bc = blocks
            ok = ok & np.repeat(M[b if M.shape[0] > 1 else 0, i // Br], Bc)[:Nk]
        return ok

    return row


#: ``check_forward`` recomputes every row when there are at most this many (batch·heads × N_q) rows and
#: BH·N_q·N_k·d <= 2**22 (milliseconds of NumPy); larger problems are sampled (6 rows).
CHECK_ALL_ROWS = 2048


def _mismatch_hint(lse_bad: bool, options: dict) -> str:
    """What to do about o and lse that are not the forward's.  lse is the *undropped* softmax's, so a right lse
    with a wrong o is what a dropout forward checked without its dropout arguments (or with other ones) gives."""
    if lse_bad:
        return "pass the o and lse that attention_forward returned for the same inputs and options"
    if not options.get("dropout_p"):
        return ("lse is right but o is not, as after a forward with dropout: pass attention_backward the forward's "
                "dropout_p and seed (its o is the dropped output), or the o attention_forward returned")
    return (f"lse is right but o is not: the mask of dropout_p={options['dropout_p']!r}, seed={options['seed']!r} "
            "is not the forward's; pass the forward's dropout_p and seed (dropout_p=0 if it had none)")


def _check_forward_outputs(entry, q3, k3, v3, o3, lse2, causal, scale, options, rounding=0.0) -> None:
    """Recompute a few rows of ``o`` and ``lse`` in float64 and refuse ones that are not the forward of these
    inputs (see :func:`attention_backward`); ``rounding``: the relative rounding of ``o``'s storage, allowed on top."""
    BH, Nq, d = q3.shape
    Nk = k3.shape[1]
    k3, v3 = _per_query_head(k3, BH), _per_query_head(v3, BH)
    row_mask = _mask_rows(entry, options, BH, Nq, Nk, d, causal)
    score_mod = options.get("score_mod")
    if score_mod is not None:
        from .flex import numpy_modifier

        score_mod, H = numpy_modifier(score_mod), options.get("heads", 1)
    drop_p, seed = options.get("dropout_p", 0.0), options.get("seed")
    keys = np.arange(Nk, dtype=np.int64)
    rows = np.arange(Nq, dtype=np.int64)
    if drop_p and options.get("dropout_at") is not None:     # rows and keys of a longer sequence (a shard)
        from .kernels.policies import check_dropout_at

        (rb, rs, rsp, rj), (cb, cs, csp, cj) = check_dropout_at(options["dropout_at"])
        rows, keys = rb + rs * rows + rj * (rows >= rsp), cb + cs * keys + cj * (keys >= csp)
    keys = keys.astype(np.uint64)
    small = BH * Nq <= CHECK_ALL_ROWS and BH * Nq * Nk * d <= 1 << 22
    for b in range(BH) if small else sorted({0, BH - 1}):
        K, V = k3[b].astype(np.float64), v3[b].astype(np.float64)
        for i in range(Nq) if small else sorted({0, Nq // 2, Nq - 1}):
            qi = q3[b, i].astype(np.float64)
            ok = row_mask(b, i)
            given_lse, given_o = float(lse2[b, i]), o3[b, i].astype(np.float64)
            where = f"row {i} of batch·head {b}"
            if not ok.any():
                want_lse, want_o, tol = -np.inf, np.zeros(d), 1e-6
            else:
                s = scale * (K[ok] @ qi)
                if score_mod is not None:   # the same modifier in float64, on this row's allowed keys
                    s = np.asarray(score_mod(s, b // H, b % H, i, np.flatnonzero(ok)), dtype=np.float64)
                m = s.max()
                p = np.exp(s - m)
                want_lse = m + math.log(p.sum())
                w = np.ones(int(ok.sum()))
                if drop_p:                  # the forward's dropout mask, regenerated as the kernels do
                    words = dropout_word_np(seed, np.uint64(b), np.uint64(rows[i]), keys[ok])
                    w = (words >= np.uint64(keep_threshold(drop_p))) / (1.0 - drop_p)
                want_o = (p * w / p.sum()) @ V[ok]
                # float32 rounding of a score is at most ~d·eps·|scale|·Σ|q||k| (eps = 1.2e-7, d <= 128): this
                # tolerance is that bound for d = 128 with a margin of ~60, yet far below what a wrong o / lse gives
                tol = 1e-3 * (1.0 + abs(scale) * float((np.abs(K[ok]) @ np.abs(qi)).max()))
            lse_bad = not (given_lse == want_lse if not np.isfinite(want_lse) else abs(given_lse - want_lse) <= tol)
            vmax = float(np.abs(V[ok]).max()) / (1.0 - drop_p) if ok.any() else 0.0
            o_err = float(np.abs(given_o - want_o).max())
            if lse_bad or o_err > 2 * tol * vmax + rounding * float(np.abs(want_o).max()) + 1e-6:
                raise ValueError(
                    f"o and lse are not the forward of these q, k, v (causal={causal}, scale={scale:.6g}"
                    f"{', options ' + str(sorted(options)) if options else ''}): at {where} lse is {given_lse:.6g} "
                    f"(recomputed: {want_lse:.6g}) and o differs by up to {o_err:.3g}; "
                    f"{_mismatch_hint(lse_bad, options)} (check_forward=False skips this check)")
