"""flashnb.pytorch's functions: :func:`attention` (flashnb's arguments), :func:`scaled_dot_product_attention`
(SDPA's), both calling the custom operators of :mod:`flashnb.pytorch.ops`; :class:`FlashAttentionFunction`, the
same computation as a ``torch.autograd.Function`` on flattened tensors (not traceable by ``torch.compile``)."""

from __future__ import annotations

import operator

import numpy as np
import torch

from .. import api
from ..rng import check_dropout
from . import devices, ops
from .ops import SECOND_ORDER  # what a second-order use raises, in either path

__all__ = ["attention", "scaled_dot_product_attention", "FlashAttentionFunction", "refuse_second_order",
           "SECOND_ORDER"]

# --------------------------------------------------------------------------- autograd


class _SecondOrderRefused(torch.autograd.Function):
    """Passes the gradients of flashnb's backward through unchanged; a backward through them raises
    :data:`SECOND_ORDER` (see :func:`refuse_second_order`)."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tuple(t.detach() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(SECOND_ORDER)


def refuse_second_order(grads, inputs):
    """``grads`` of a backward that is not differentiable, as they are -- unless autograd records that backward
    (``create_graph=True``) and one of ``inputs`` (the forward's inputs, the incoming gradient) requires grad:
    then they come back attached to a node whose backward raises :data:`SECOND_ORDER`, so a second-order use is
    an error naming flashnb instead of a gradient silently missing terms (``once_differentiable`` leaves the
    gradients detached when the incoming gradient needs none, and the double backward then drops them)."""
    if not torch.is_grad_enabled():
        return grads
    sources = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not sources:
        return grads
    given = [g for g in grads if g is not None]
    out = iter(_SecondOrderRefused.apply(len(given), *given, *sources))
    return tuple(None if g is None else next(out) for g in grads)


class FlashAttentionFunction(torch.autograd.Function):
    """``o, lse = FlashAttentionFunction.apply(q, k, v, causal, scale, impl, options)`` on float32 (or, with
    ``options["storage"]``, float16 / bfloat16), C-contiguous ``(BH, N, d)`` tensors (:func:`attention` prepares
    them).  Saves q, k, v, o, lse (not P); ``lse`` is not differentiable.  The backward is not differentiable:
    a second-order use is refused (:func:`refuse_second_order`)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, impl, options):
        o, lse = devices._forward3(q, k, v, causal, scale, impl, options)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.config = (causal, scale, impl, options)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, impl, options = ctx.config
        with torch.no_grad():
            grads = devices._backward3(q, k, v, o, lse, do.to(q.dtype).contiguous(), causal, scale, impl, options)
        return (*refuse_second_order(grads, (q, k, v, do)), None, None, None, None)


def _check_tensors(q, k, v, allow_float64):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (flashnb.attention takes NumPy arrays), "
                            f"got {type(t).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"flashnb runs CPU tensors (simulator) and CUDA tensors (GPU), got device {q.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype (as SDPA requires), got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype == torch.float64 and not allow_float64:
        raise TypeError("q, k, v are float64 but flashnb's kernels compute in float32: pass allow_float64=True to "
                        "compute in float32 and get float64 results of float32 accuracy, or convert them yourself")
    if q.dtype not in (torch.float32, torch.float64) + devices._HALF:
        raise TypeError(f"q, k, v must be float32, float16 or bfloat16 (float64 with allow_float64=True), "
                        f"got {q.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() not in (2, 3, 4) or 0 in t.shape:
            raise ValueError(f"{name} must have shape (B, H, N, d), (H, N, d) or (N, d) with every axis >= 1, "
                             f"got {tuple(t.shape)}")
    gqa = q.dim() >= 3 and q.dim() == k.dim() and q.shape[:-3] == k.shape[:-3] and k.shape[-3] >= 1 \
        and q.shape[-3] % k.shape[-3] == 0
    if not (q.dim() == k.dim() == v.dim()) or (q.shape[:-2] != k.shape[:-2] and not gqa):
        raise ValueError(f"q, k, v must share their leading (batch, heads) axes, or k and v have a divisor of q's "
                         f"heads (grouped-query attention), got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (flashnb has no broadcasting)")
    if k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k and v must have shape (..., Nk, d) with q's d, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)} (flashnb needs v's head dim == q's)")
    if not 1 <= q.shape[-1] <= api.MAX_HEAD_DIM:
        raise ValueError(f"head dim d must be in 1..{api.MAX_HEAD_DIM}, got {q.shape[-1]}")


@torch.compiler.assume_constant_result
def _options(impl, causal, scale, dropout_p, seed, storage, dtype, needs_grad, score_mod, mask_mod, score_mod_grad,
             block_mask, *idents, **options) -> str:
    """Every check of :func:`attention` that needs no tensor, and the operators' ``options`` string (objects
    registered: :mod:`flashnb.pytorch.ops`).  Run at each eager call; under ``torch.compile`` once, when the call is
    traced (its result a graph constant): ``idents`` are the ``id()`` of the object arguments, which makes dynamo
    guard on those objects (another modifier object, another trace)."""
    entry = api._check_impl(impl)
    if needs_grad and entry.backward is None:
        raise ValueError(f"impl {impl!r} has no backward and q, k or v requires grad; use one of "
                         f"{devices.impls_with_backward()} (or run under torch.no_grad())")
    api._check_causal(causal)
    if scale is not None:
        api._check_scale(scale, 1)
    p = check_dropout(dropout_p, 0 if seed is None else seed)   # dropout_p's own errors first, then the impl's
    if p > 0 and "dropout_p" not in entry.options:
        api._check_dropout(entry, impl, dict(dropout_p=p, seed=0))
    given = dict(block_mask=block_mask, score_mod=score_mod, mask_mod=mask_mod, score_mod_grad=score_mod_grad)
    options.update({n: value for n, value in given.items() if value is not None})
    unknown = set(options) - set(entry.options)
    if unknown:                                   # the impl's own error (modifiers named as such)
        api._check_options(entry, impl, options, np.empty((1, 1, 1)), np.empty((1, 1, 1)))
    if any(n in options for n in ops._MODIFIERS):
        from .. import flex

        check = [(options[n], n) for n in ops._MODIFIERS if n in options]
        if needs_grad and score_mod is not None and score_mod_grad is None and "score_mod_grad" in entry.options:
            derived = getattr(getattr(score_mod, "py_func", score_mod), "grad", None) is None
            options["score_mod_grad"] = flex.score_mod_grad_of(score_mod)   # .grad, else derived: kernels never derive
            if derived:
                check.append((options["score_mod_grad"], "score_mod_grad"))   # a refusal names the construct
        flex.check_many(check)                    # compiled alone for a GPU, once per code and captured types
    resolved = devices._storage(entry, impl, storage, dtype)
    if resolved != "float32":
        options["storage"] = resolved
    elif storage is not None:
        options["storage"] = "float32"
    return ops.encode_options(options)


def _draw_seed() -> int:
    """A dropout seed in ``[0, 2^63)`` from torch's default (CPU) generator, so ``torch.manual_seed`` makes it
    reproducible (what :func:`attention` draws, as a tensor)."""
    return int(_seed_tensor().item())


def _seed_tensor() -> torch.Tensor:
    return torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64)


def _as_int64(seed) -> int:
    s = int(seed)
    return s - 2**64 if s >= 2**63 else s


_CAUSAL_NAME = {False: "none", True: "lower_right", "lower_right": "lower_right", "upper_left": "upper_left"}


def _constant(x):
    """``x`` unchanged, except that under ``torch.compile(dynamic=True)`` a Python int or float argument (dynamo
    makes those symbolic, which the options function, run once at tracing, cannot take) becomes a constant of the
    graph, guarded on its value (another value retraces): ``operator.index`` and ``float.as_integer_ratio`` are
    what dynamo specialises on (the ratio is exact, so the float is the same bits).  Eager: the same value."""
    if type(x) is int:
        return operator.index(x)
    if type(x) is float and x - x == 0:          # finite (inf and nan go on to the checks that name them)
        n, d = x.as_integer_ratio()
        return n / d
    return x


def attention(q, k, v, *, causal=False, scale=None, impl: str = "auto", block_mask=None, score_mod=None,
              mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=None, allow_float64=False, storage=None,
              **options):
    """flashnb attention on torch tensors, differentiable: ``softmax(scale · q kᵀ [masked]) v``.

    Args:
        q: ``(B, H, Nq, d)`` (or ``(H, Nq, d)``, ``(Nq, d)``); k, v: ``(..., Nk, d)``, same leading axes.
        causal: False, True (= ``"lower_right"``: **bottom-right aligned**, FlashAttention's convention) or
            ``"upper_left"`` (top-left, SDPA's ``is_causal=True``).  Same mask when Nq == Nk.
        scale: softmax scale, default ``1/sqrt(d)``.
        impl: any impl with a backward (:func:`impls_with_backward`); a forward-only impl when no gradient is
            needed.  Default ``"auto"`` (:mod:`flashnb.kernels.auto`): the product kernel ``"flash"``
            (:mod:`flashnb.kernels.launch.flash`), or ``"fa2-tc"`` (tensor cores) for float16 and bfloat16 tensors on a
            checked sm_80+ GPU unless tile options (the product kernel's) are given.
        block_mask: the block-sparse mask of ``impl="flash"`` and ``"fa2-tc"`` (a boolean block array), or a
            ``flashnb.flex.create_block_mask`` of a ``mask_mod``.
        score_mod, mask_mod, score_mod_grad: attention modifiers (``impl="flash"``, ``"fa2-tc"``), as in
            :func:`flashnb.attention_forward` (:mod:`flashnb.flex`); the backward uses ``score_mod_grad``, else
            ``score_mod.grad``, else the derivative flashnb derives from ``score_mod``'s source
            (:func:`flashnb.flex.derivative`; a modifier outside its subset is refused before the forward when a
            gradient is needed).  k and v may have fewer heads than q (grouped-query attention).
        dropout_p: attention dropout probability in ``[0, 1)`` (``impl="flash"``, ``"fa2-tc"``; 0: none).  Applied
            whenever it is non-zero, as SDPA does (pass 0 in evaluation).
        seed: the dropout seed, an int in ``[0, 2**64)``; when None and ``dropout_p > 0``, one is drawn from
            torch's default generator (``torch.manual_seed`` makes it repeatable; under ``torch.compile`` the draw
            is part of the graph).  It reaches the operator as a tensor, which autograd saves: the backward
            regenerates exactly the forward's mask (:mod:`flashnb.rng`), nothing N×N is saved.
        allow_float64: accept float64 tensors (computed in float32; see the module docstring).
        storage: ``None`` (default: float16 and bfloat16 tensors stay in their dtype when the impl has half
            storage, ``"flash"``; everything else is computed from float32 copies), ``"float32"``
            (always float32 copies), ``"float16"`` / ``"bfloat16"`` (the tensors must have that dtype and the impl
            half storage: TypeError / ValueError otherwise).  See the module docstring.
        **options: the impl's tile options (``Br``, ``Bc``, ``warps``, ...).

    Returns ``o`` with q's shape, dtype and device.  Calls ``torch.ops.flashnb.attention_forward`` (its backward
    ``attention_backward``): traceable by ``torch.compile(fullgraph=True)`` and ``torch.export``
    (:mod:`flashnb.pytorch.ops` says how the Python arguments cross the operator boundary).
    """
    _check_tensors(q, k, v, allow_float64)
    if isinstance(block_mask, np.ndarray) and torch.compiler.is_compiling():
        raise TypeError("block_mask: under torch.compile pass a flashnb.masks.BlockMask (or a "
                        "flashnb.flex.create_block_mask), not a NumPy array, which dynamo would turn into a tensor")
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    scale, dropout_p, seed = _constant(scale), _constant(dropout_p), _constant(seed)
    options = {name: _constant(value) for name, value in options.items()}
    config = _options(impl, causal, scale, dropout_p, seed, storage, q.dtype, needs_grad, score_mod, mask_mod,
                      score_mod_grad, block_mask, id(score_mod), id(mask_mod), id(score_mod_grad), id(block_mask),
                      *[id(value) for value in options.values()], **options)
    seed_t = None
    if dropout_p:
        seed_t = _seed_tensor() if seed is None else torch.tensor([_as_int64(seed)], dtype=torch.int64)
    dtype = q.dtype
    q4, k4, v4 = (_as4(t) for t in (q, k, v))
    if dtype == torch.float64:
        q4, k4, v4 = (t.to(torch.float32) for t in (q4, k4, v4))
    o, _ = torch.ops.flashnb.attention_forward(q4, k4, v4, seed_t, _CAUSAL_NAME.get(causal, "none"),
                                               None if scale is None else float(scale), float(dropout_p), impl,
                                               config)
    return o.reshape(q.shape).to(dtype)


def _as4(t: torch.Tensor) -> torch.Tensor:
    """(N, d) / (H, N, d) / (B, H, N, d) -> (B, H, N, d), a view."""
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, impl: str = "auto", **options):
    """``torch.nn.functional.scaled_dot_product_attention``'s signature and semantics on flashnb's kernels:
    ``is_causal=True`` is top-left aligned (``"upper_left"``), ``attn_mask`` may be None or a
    ``torch.nn.attention.bias.causal_lower_right``/``causal_upper_left`` bias.  Anything flashnb does not
    compute (a tensor ``attn_mask``) is an error, never ignored; ``enable_gqa=True`` lets k, v have fewer heads
    than q.  ``dropout_p > 0`` is attention dropout (``impl="flash"``), applied whenever non-zero
    as in SDPA, with a seed drawn from torch's generator (or ``seed=`` among the options): see :func:`attention`.
    Its mask is flashnb's Philox mask, not the one SDPA's kernels would draw."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    causal = "upper_left" if is_causal else False
    if attn_mask is not None:
        if is_causal:
            raise ValueError("pass either attn_mask or is_causal=True, not both (as SDPA)")
        if not isinstance(attn_mask, CausalBias):
            raise ValueError("flashnb computes no arbitrary attn_mask: pass None, causal_lower_right(Nq, Nk) or "
                             "causal_upper_left(Nq, Nk) (torch.nn.attention.bias), or use flashnb.pytorch.attention "
                             "with block_mask=... for block sparsity")
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (query.shape[-2], key.shape[-2]):
            raise ValueError(f"attn_mask is a causal bias for (Nq, Nk) = ({attn_mask.seq_len_q}, "
                             f"{attn_mask.seq_len_kv}), but q, k have ({query.shape[-2]}, {key.shape[-2]})")
        causal = "lower_right" if attn_mask.variant == CausalVariant.LOWER_RIGHT else "upper_left"
    if not enable_gqa and query.shape[:-2] != key.shape[:-2]:
        raise ValueError("q, k, v need the same number of heads unless enable_gqa=True (as SDPA)")
    return attention(query, key, value, causal=causal, scale=scale, impl=impl, dropout_p=dropout_p, **options)
