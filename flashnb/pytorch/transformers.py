"""flashnb in Hugging Face transformers: :func:`register_transformers` adds an attention function (and its mask
function) to ``transformers.AttentionInterface`` / ``AttentionMaskInterface``, so that a model built with
``attn_implementation=<name>`` runs its attention on flashnb (:func:`flashnb.pytorch.attention`).

**The name.**  transformers treats every ``attn_implementation`` whose name contains ``"flash"`` as a
FlashAttention kernel to load (``transformers.utils.is_flash_attention_requested`` tests ``"flash" in name``,
then the model's init imports the ``flash_attn`` package or fetches a kernel from the Hub), so the name
``"flashnb"`` cannot be used; the default is ``"fnb"`` and a name containing ``"flash"`` is a ValueError.

**What the attention function receives and what flashnb makes of it.**  The mask function registered with it
is transformers' own ``sdpa_mask``, so the attention function gets what SDPA gets:

* ``attention_mask=None``: no mask beyond causality.  Causal (``is_causal``, else the module's ``is_causal``,
  with more than one query) is SDPA's top-left ``is_causal`` -- flashnb's ``causal="upper_left"``; otherwise
  no mask (a single decoding query sees every key, as in SDPA).
* a 4-D boolean mask ``(B, 1, Nq, Nk)`` (True = attend; padding, a cache, a sliding window), or an additive
  float mask of 0 and ``-inf`` / the dtype's minimum (a mask a user passes): flashnb fits it, on the host, to
  **causal(diagonal) ∧ sliding window ∧ key padding** -- ``j <= i + diag`` (any diagonal: bottom-right with a
  cache, top-left without), optionally ``i + diag - j < window``, and ``keep[b, j]`` -- and checks that the fit
  reproduces the mask exactly.  The kernel then gets ``causal=`` for the diagonals it knows and a ``mask_mod``
  capturing ``keep`` (and the window) for the rest (:mod:`flashnb.flex`).  Left and right padding, KV caches and
  sliding-window layers are expressible.
* **packed documents** (transformers' padding-free batches: ``DataCollatorWithFlattening`` puts several documents
  in one row, with ``position_ids`` restarting at 0 at each one).  transformers passes them in one of three
  ways, and each is read as the documents' boundaries (:func:`fit_documents`, :func:`documents_from_kwargs`): a
  block-diagonal causal mask (what ``sdpa_mask`` builds for packed ``position_ids`` when the model has no cache),
  checked element by element as above; with ``attention_mask=None``, the collator's ``cu_seq_lens_q`` /
  ``cu_seq_lens_k`` kwargs, else ``position_ids`` that restart (a model run with a cache gets no packed mask from
  transformers, only its ``position_ids``).  Each document is then attended alone, causal inside it, by
  :func:`flashnb.pytorch.flash_attn.flash_attn_varlen_func`: one launch per document on its own slices of Q, K,
  V, so no other document's keys are read and the counted bytes are the documents' own.  Under
  ``torch.compile`` the boundaries cannot be read (``position_ids`` are then not inspected; ``cu_seq_lens_*`` is
  a ValueError).
* anything else is a ValueError naming ``attention_mask``, never an approximation: a mask that differs between
  heads, documents with a sliding window or padding, a prefix-LM mask or any other pattern the fits do not
  reproduce, additive values other than 0 and -inf (a bias: ``position_bias``), attention sinks (``s_aux``).

Query rows that may attend to no key (the left padding of a causal model) come out as 0 from flashnb, while
eager softmaxes such a row over the dtype's minimum (uniform weights): those positions are padding, and their
outputs are garbage in every implementation; compare and train on the real positions.

``softcap`` (Gemma 2's ``attn_logit_softcapping``) becomes ``flashnb.flex.softcap(cap)``. Dropout is flashnb's
(``impl="flash"`` and ``"fa2-tc"`` take it together with a padding ``mask_mod``). Each distinct padding pattern is a
distinct ``mask_mod`` content (a digest picks its block mask; on a GPU a kernel compile per pattern -- the
captured-array limitation of :mod:`flashnb.flex`). The fit runs per attention call, on the host; it needs the mask's
values, so it does not run under ``torch.compile``: there, only masks that are ``None`` are taken (a ValueError says
so otherwise).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .. import flex
from ..registry import impl_entry

__all__ = ["register_transformers", "attention_forward", "fit_mask", "fit_documents", "documents_from_kwargs",
           "DEFAULT_NAME"]

DEFAULT_NAME = "fnb"


def register_transformers(name: str = DEFAULT_NAME, *, impl: str = "auto", **options) -> str:
    """Register flashnb as transformers' attention implementation ``name`` (and its mask function); returns
    ``name``.  ``impl`` and ``options`` (tile options, ...) are passed to :func:`flashnb.pytorch.attention`.  Then
    ``AutoModel.from_config(config, attn_implementation=name)`` (or ``config._attn_implementation = name``, or
    ``model.set_attn_implementation(name)``) runs the model on flashnb."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if "flash" in name:
        raise ValueError(f"name={name!r}: transformers treats every attn_implementation containing 'flash' as a "
                         "FlashAttention kernel to load (transformers.utils.is_flash_attention_requested), so it "
                         f"cannot name flashnb; use another name, e.g. the default {DEFAULT_NAME!r}")
    if name in ("eager", "sdpa") or name.startswith("paged") or "sdpa" in name or "flex_attention" in name:
        raise ValueError(f"name={name!r} is one transformers gives a meaning of its own; choose another")
    from .. import api

    api._check_impl(impl)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, functools.partial(attention_forward, impl=impl, options=dict(options)))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, *, impl: str = "auto", options=None, **kwargs):
    """transformers' attention-function signature: ``query (B, Hq, Nq, d)``, ``key, value (B, Hkv, Nk, d)``;
    returns ``(attn_output (B, Nq, Hq, d), None)`` (no attention weights: flashnb never forms P)."""
    from . import functional

    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: flashnb's transformers attention does not take {name} (attention sinks or an "
                             "additive position bias); use attn_implementation='eager' for this model")
    opts = dict(options or {})
    cap = kwargs.get("softcap")
    if cap is not None:
        opts["score_mod"] = _softcap(float(cap))
    B, Hq, Nq, d = query.shape
    Nk = key.shape[2]
    causal_flag = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    documents = None
    if attention_mask is None:
        causal = "upper_left" if causal_flag and Nq > 1 else False
        documents = documents_from_kwargs(kwargs, B, Nq, Nk)
    else:
        if torch.compiler.is_compiling():
            raise ValueError("attention_mask: under torch.compile flashnb's transformers attention takes no mask "
                             "tensor (fitting one needs its values): compile without padding, or run eagerly")
        try:
            causal, mask_mod = fit_mask(attention_mask, B, Hq, Nq, Nk)
        except ValueError:
            documents = fit_documents(attention_mask, B, Hq, Nq, Nk)
            if documents is None:
                raise
            causal_flag = True
        else:
            if mask_mod is not None:
                opts["mask_mod"] = mask_mod
    if key.shape[1] != Hq and not impl_entry(impl).gqa:                 # impls without grouped-query attention
        key, value = (t.repeat_interleave(Hq // t.shape[1], dim=1) for t in (key, value))
    if documents is not None:
        return _attend_documents(query, key, value, documents, causal=bool(causal_flag), dropout=dropout,
                                 scaling=scaling, softcap=cap, impl=impl, options=dict(options or {})), None
    o = functional.attention(query, key, value, causal=causal, scale=scaling, impl=impl,
                             dropout_p=float(dropout or 0.0), **opts)
    return o.transpose(1, 2).contiguous(), None


def _attend_documents(query, key, value, cu_seqlens, *, causal, dropout, scaling, softcap, impl, options):
    """Packed documents: the ``(B, H, N, d)`` rows flattened to ``(B·N, H, d)`` and each document (``cu_seqlens``
    over the flattened tokens) attended alone by :func:`flashnb.pytorch.flash_attn.flash_attn_varlen_func`: one
    launch per document, its own slices of Q, K, V, no other document's keys read.  ``(B, N, H, d)`` out."""
    from .flash_attn import flash_attn_varlen_func

    B, Hq, N, d = query.shape
    q, k, v = (t.transpose(1, 2).reshape(B * N, t.shape[1], d) for t in (query, key, value))
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    longest = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
    o = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, dropout_p=float(dropout or 0.0),
                               softmax_scale=scaling, causal=causal, softcap=float(softcap or 0.0), impl=impl,
                               **options)
    return o.reshape(B, N, Hq, d)


@functools.lru_cache(maxsize=32)
def _softcap(cap: float):
    return flex.softcap(cap)


# --------------------------------------------------------------------------- masks


def _key_padding(keep: np.ndarray):
    def key_padding_mask(b, h, q_idx, kv_idx):
        return keep[b, kv_idx] != 0

    return flex._twin(key_padding_mask, lambda b, h, q, kv: keep[b, kv] != 0)


def _causal_key_padding(keep: np.ndarray, diag: int):
    def causal_key_padding_mask(b, h, q_idx, kv_idx):
        return keep[b, kv_idx] != 0 and kv_idx <= q_idx + diag

    return flex._twin(causal_key_padding_mask, lambda b, h, q, kv: (keep[b, kv] != 0) & (kv <= q + diag))


def _window_key_padding(keep: np.ndarray, diag: int, window: int):
    def window_key_padding_mask(b, h, q_idx, kv_idx):
        return keep[b, kv_idx] != 0 and kv_idx <= q_idx + diag and q_idx + diag - kv_idx < window

    return flex._twin(window_key_padding_mask,
                      lambda b, h, q, kv: (keep[b, kv] != 0) & (kv <= q + diag) & (q + diag - kv < window))


def _allowed(attention_mask, B, Hq, Nq, Nk) -> torch.Tensor:
    """The boolean ``(B, Nq, Nk)`` of a 4-D transformers mask (True = attend), or a ValueError naming it."""
    m = attention_mask
    if not isinstance(m, torch.Tensor):
        raise ValueError(f"attention_mask: flashnb takes None or a 4-D mask tensor, got {type(m).__name__} (the mask "
                         "function registered with flashnb makes one; another implementation's mask object is not "
                         "one flashnb can read)")
    if m.dim() != 4 or m.shape[0] not in (1, B) or m.shape[1] not in (1, Hq) or tuple(m.shape[2:]) != (Nq, Nk):
        raise ValueError(f"attention_mask must have shape (B or 1, 1 or H, Nq, Nk) = ({B}, 1, {Nq}, {Nk}), got "
                         f"{tuple(m.shape)}")
    m = m.detach().cpu()
    if m.dtype == torch.bool:
        allowed = m
    elif m.is_floating_point():
        blocked = m <= torch.finfo(m.dtype).min / 2          # -inf, or the dtype's minimum (transformers' eager)
        if not torch.all((m == 0) | blocked):
            raise ValueError("attention_mask holds additive values other than 0 and -inf (a bias): flashnb cannot "
                             "express it as a mask; add a bias with a score_mod, or use attn_implementation='eager'")
        allowed = ~blocked
    else:
        raise ValueError(f"attention_mask must be boolean or floating point, got {m.dtype}")
    if allowed.shape[1] > 1 and not torch.equal(allowed, allowed[:, :1].expand_as(allowed)):
        raise ValueError("attention_mask differs between heads: flashnb takes one mask for every head")
    return allowed[:, 0].expand(B, Nq, Nk)


def fit_mask(attention_mask, B: int, Hq: int, Nq: int, Nk: int):
    """``(causal, mask_mod)`` for :func:`flashnb.pytorch.attention` that give exactly ``attention_mask`` (a 4-D
    boolean or 0/-inf additive mask): causal(diag) ∧ sliding window ∧ key padding, fitted and then checked
    element by element; a ValueError naming ``attention_mask`` when no such form reproduces it."""
    allowed = _allowed(attention_mask, B, Hq, Nq, Nk)
    i = torch.arange(Nq)[:, None]
    j = torch.arange(Nk)[None, :]
    keep = allowed.any(dim=1)                                           # (B, Nk): keys some query sees
    padded = not bool(keep.all())
    cands = [(None, None)]
    if bool(allowed.any()):
        rel = (j - i).expand(B, Nq, Nk)[allowed]
        for diag in dict.fromkeys((Nk - Nq, 0, int(rel.max()))):
            cands.append((diag, None))
            w = int((diag - rel).max()) + 1                            # the widest i + diag - j seen, plus one
            if w < Nk + max(Nq - Nk, 0) + abs(diag):
                cands.append((diag, w))
    for diag, window in cands:
        fit = keep[:, None, :].expand(B, Nq, Nk)
        if diag is not None:
            fit = fit & (j <= i + diag)
        if window is not None:
            fit = fit & (i + diag - j < window)
        if torch.equal(fit, allowed):
            return _express(keep, padded, diag, window, Nq, Nk)
    raise ValueError("attention_mask is not causal (any diagonal), a sliding window and key padding: flashnb cannot "
                     "express it (a prefix-LM mask, documents with padding or a window, ...); use "
                     "attn_implementation='sdpa' or 'eager' for this input, or pass a flashnb mask_mod to "
                     "flashnb.pytorch.attention directly")


def fit_documents(attention_mask, B: int, Hq: int, Nq: int, Nk: int):
    """Packed documents: when ``attention_mask`` (4-D, as :func:`fit_mask` takes it) is block-diagonal causal --
    each row of each batch entry a run of contiguous documents, query ``i`` of a document seeing that document's
    keys ``start <= j <= i`` and nothing else -- the documents' ``cu_seqlens`` over the ``B·N`` flattened tokens
    (entry ``b``'s tokens at ``b·N ...``); otherwise None.  Checked element by element, as :func:`fit_mask`."""
    if Nq != Nk:                                                    # a KV cache: not a packed prefill
        return None
    allowed = _allowed(attention_mask, B, Hq, Nq, Nk)
    N = Nq
    if not bool(allowed.any(dim=2).all()):                          # a query that sees no key: padding
        return None
    idx = torch.arange(N)
    start = allowed.to(torch.uint8).argmax(dim=2)                   # (B, N): the first key query i sees
    new = start == idx                                              # a document starts at i
    prev = torch.cat([torch.zeros(B, 1, dtype=start.dtype), start[:, :-1]], dim=1)
    if not bool((new | (start == prev)).all()):                     # starts must be shared within a document
        return None
    i, j = idx[:, None], idx[None, :]
    if not torch.equal((j >= start[:, :, None]) & (j <= i), allowed):
        return None
    cu = [0]
    for b in range(B):
        cu += [b * N + int(t) for t in torch.nonzero(new[b]).flatten().tolist() if t > 0] + [(b + 1) * N]
    return cu


def documents_from_kwargs(kwargs, B: int, Nq: int, Nk: int):
    """Packed documents without a mask (``attention_mask=None``), as transformers' FlashAttention path reads them:
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), else
    ``position_ids`` of one batch entry that restart (a position not one more than the previous one starts a
    document).  The documents' ``cu_seqlens`` (as :func:`fit_documents`), or None for a single sequence."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if torch.compiler.is_compiling():
            raise ValueError("cu_seq_lens_q: under torch.compile flashnb's transformers attention cannot read "
                             "packed-sequence boundaries (they are needed on the host); run eagerly")
        values = [torch.as_tensor(c).flatten().tolist() if c is not None else None for c in (cu_q, cu_k)]
        cu = values[0] if values[0] is not None else values[1]
        if (values[0] is not None and values[1] is not None and values[0] != values[1]) or B != 1 or Nq != Nk \
                or len(cu) < 2 or cu[0] != 0 or cu[-1] != Nq or any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seq_lens_q / cu_seq_lens_k: flashnb takes packed documents of one batch entry "
                             f"with queries and keys alike, [0, ..., {Nq}] non-decreasing; got {values[0]} and "
                             f"{values[1]} for batch {B}, {Nq} queries, {Nk} keys")
        return [int(c) for c in cu]
    pos = kwargs.get("position_ids")
    if pos is None or torch.compiler.is_compiling() or Nq != Nk or Nq < 2 or not isinstance(pos, torch.Tensor) \
            or pos.dim() != 2 or pos.shape[-1] != Nq or pos.shape[0] not in (1, B):
        return None
    pos = pos.detach().cpu().expand(B, Nq)
    starts = torch.ones(B, Nq, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    cu = [0]
    for b in range(B):
        cu += [b * Nq + int(t) for t in torch.nonzero(starts[b]).flatten().tolist() if t > 0] + [(b + 1) * Nq]
    return cu


def _express(keep, padded, diag, window, Nq, Nk):
    known = {Nk - Nq: True, 0: "upper_left"}
    causal = known.get(diag, False) if diag is not None else False
    k = np.ascontiguousarray(keep.numpy().astype(np.uint8))
    k.setflags(write=False)
    if window is not None:
        return causal, _window_key_padding(k if padded else np.ones_like(k), diag, window)
    if diag is not None and causal is False:
        return False, _causal_key_padding(k if padded else np.ones_like(k), diag)
    return causal, (_key_padding(k) if padded else None)
