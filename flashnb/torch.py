"""flashnb attention inside a PyTorch model: a ``torch.autograd.Function`` with SDPA's shapes.

Needs PyTorch (``pip install "flashnb[torch]"``); ``import flashnb`` never imports it -- only
``import flashnb.torch`` does.

* :func:`attention` ``(q, k, v, *, causal=False, scale=None, impl="flash", block_mask=None, score_mod=None,
  mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=None)`` (attention modifiers: :mod:`flashnb.flex`;
  dropout: :mod:`flashnb.rng`, the seed drawn from torch's generator when not given) takes tensors of
  shape ``(B, H, N, d)`` (or ``(H, N, d)``, ``(N, d)``) like ``torch.nn.functional.scaled_dot_product_attention``
  and returns ``o`` with q's shape and dtype; gradients flow to q, k and v.  k and v may have fewer heads than q
  (grouped-/multi-query attention, ``impl="flash"`` or ``"fa2"``; dk, dv are summed over each group).
* :func:`scaled_dot_product_attention` has SDPA's own signature and semantics (``is_causal`` aligned top-left,
  ``attn_mask`` a ``causal_lower_right``/``causal_upper_left`` bias or None), for a literal drop-in.
* :class:`FlashAttentionFunction` saves what FlashAttention saves -- q, k, v, O and the log-sum-exp ``L``,
  never P -- and its backward is the impl's recompute backward (P rebuilt tile by tile from ``L``).  That
  backward is not itself differentiable: a second-order use (a gradient penalty, a Hessian-vector product) is a
  RuntimeError saying so (:func:`refuse_second_order`), never a gradient missing its terms.

**Causal alignment.** ``causal=True`` means ``"lower_right"``: aligned to the bottom-right corner when
Nq != Nk, as FlashAttention >= 2.1 and ``torch.nn.attention.bias.causal_lower_right``.  SDPA's
``is_causal=True`` is ``"upper_left"`` (``causal_upper_left``).  They agree only when Nq == Nk.

**Devices.** CPU tensors go through the NumPy API (copied to the simulator's "device", or to the GPU when
flashnb runs on one, and back).  CUDA tensors stay on the GPU: the kernels read and write them zero-copy
through ``__cuda_array_interface__`` (``numba.cuda.as_cuda_array``) and launch on torch's current stream
(``numba.cuda.external_stream``); the outputs are numba allocations wrapped as tensors, not copies.  On the
simulator this path is rehearsed (:func:`rehearse_cuda`): CPU tensors take it, wrapped zero-copy.

**dtypes.** flashnb's kernels compute in float32.  float32 tensors are used as they are.  float16 and bfloat16
tensors given to an impl with half-precision storage (``impl="flash"`` or ``"fa2"``) stay in their dtype: the
kernels read them as they are (half the bytes), widen every element to float32 on chip, and write ``o`` and the
gradients in the input dtype, rounded once (dq is summed in float32 and rounded at the end), as
FlashAttention does; ``lse`` is float32.  dq and dk also inherit the rounding of the stored ``o`` through
``D = rowsum(dO ∘ O)``, an error of order ``|v|·|dO|·2^-11`` (float16; 2^-8 bfloat16) rather than of the
gradient (:func:`flashnb.attention_backward` gives the bound).  bfloat16 tensors reach the kernels as their
uint16 bit patterns (``Tensor.view(torch.uint16)``, zero-copy: NumPy and numba have no bfloat16).  For every
other impl, or with ``storage="float32"``, half tensors are converted to float32 (exact), computed, and ``o`` and
the gradients are converted back to the input dtype.  A float16 gradient beyond 65504 in magnitude is a
ValueError on CPU tensors (the NumPy API's check); on CUDA tensors, which never leave the GPU, it is inf, as in
torch's own half kernels.  float64 is refused unless ``allow_float64=True``, which computes in float32 and
returns float64: float32 accuracy (~1e-7 relative), not float64's.  A conversion or a
``.contiguous()`` of a non-contiguous input is a torch op on the tensor's own device (tracked by autograd).
"""

from __future__ import annotations

import contextlib

import torch

from . import api, common, rehearsal, runtime
from .registry import IMPLS
from .rng import check_dropout

__all__ = ["attention", "scaled_dot_product_attention", "FlashAttentionFunction", "impls_with_backward",
           "rehearse_cuda", "refuse_second_order", "SECOND_ORDER"]

_HALF = (torch.float16, torch.bfloat16)
_STORAGE_OF = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """What the kernels are given: bfloat16 as its uint16 bit patterns (a view), any other tensor as it is."""
    return t.view(torch.uint16) if t.dtype == torch.bfloat16 else t


def _unbits(t: torch.Tensor, dtype) -> torch.Tensor:
    """A kernel's result back in ``dtype`` (uint16 bit patterns viewed as bfloat16)."""
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 and t.dtype == torch.uint16 else t


def _storage(entry, impl: str, storage, dtype) -> str:
    """The storage of a call: ``None`` keeps half tensors in their dtype when the impl can (else float32);
    an explicit half storage needs that dtype and an impl with half storage."""
    half_ok = "storage" in entry.options
    if storage is None:
        return _STORAGE_OF.get(dtype, "float32") if half_ok else "float32"
    storage = api._explicit_storage(entry, impl, storage)
    if storage == "float32":
        return storage
    if _STORAGE_OF.get(dtype) != storage:
        raise TypeError(f"storage={storage!r} needs q, k, v of dtype torch.{storage}, got {dtype}")
    return storage


def impls_with_backward() -> list[str]:
    """The impls :func:`attention` can differentiate (every registered impl with a backward)."""
    return sorted(name for name, e in IMPLS.items() if e.backward is not None)


# --------------------------------------------------------------------------- devices


class _CudaBridge:
    """CUDA tensors <-> numba device arrays without copies, on torch's current stream."""

    def takes(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def context(self, device):
        from numba import cuda

        return cuda.gpus[device.index if device.index is not None else torch.cuda.current_device()]

    def stream(self, device):
        from numba import cuda

        return cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)

    def view(self, t: torch.Tensor):
        from numba import cuda

        # sync=False: the kernels run on torch's current stream, after whatever wrote t on it
        return cuda.as_cuda_array(t.detach(), sync=False)

    def tensor(self, a, device) -> torch.Tensor:
        return torch.as_tensor(a, device=device)   # __cuda_array_interface__: a view that keeps `a` alive


class _SimBridge(_CudaBridge):
    """The same path on the simulator: CPU tensors wrapped as simulator device arrays that share their memory
    (the kernels write into torch's buffers, as on a GPU), and a simulator stream."""

    def __init__(self):
        self.streams = []

    def takes(self, t):
        return t.device.type == "cpu"

    def context(self, device):
        return contextlib.nullcontext()

    def stream(self, device):
        from numba import cuda

        s = cuda.stream()
        self.streams.append(s)
        return s

    def view(self, t):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(t.detach().numpy())   # shares t's memory

    def tensor(self, a, device):
        return torch.from_numpy(a._ary)            # shares the simulator array's memory


_bridge: _CudaBridge = _CudaBridge()


@contextlib.contextmanager
def rehearse_cuda():
    """Inside ``flashnb.rehearsal.pretend_gpu()``: CPU tensors take the CUDA-tensor path (zero-copy views,
    launches on a stream, no host copies), so that path runs before a GPU is lent.  Yields the bridge (its
    ``streams`` lists the streams handed out)."""
    global _bridge
    if not rehearsal.active():
        raise RuntimeError("rehearse_cuda() runs inside flashnb.rehearsal.pretend_gpu()")
    saved, _bridge = _bridge, _SimBridge()
    try:
        yield _bridge
    finally:
        _bridge = saved


def _on_device_path(t: torch.Tensor) -> bool:
    """True: the zero-copy CUDA path; False: the NumPy API (host copies)."""
    if isinstance(_bridge, _SimBridge):
        return _bridge.takes(t)
    if t.device.type == "cuda":
        if runtime.MODE != "gpu":
            raise ValueError(f"q is a CUDA tensor ({t.device}) but flashnb runs on the Numba CUDA simulator "
                             "(no GPU visible to numba, or FLASHNB_DEVICE=sim): move the tensors to the CPU or "
                             "run with FLASHNB_DEVICE=gpu")
        return True
    if t.device.type != "cpu":
        raise ValueError(f"flashnb runs CPU tensors (simulator) and CUDA tensors (GPU), got device {t.device}")
    return False


def _forward3(q, k, v, causal, scale, impl, options):
    """(BH, N, d) contiguous tensors (float32, or in ``options["storage"]``) -> (o, lse) tensors on q's device;
    o in q's dtype, lse float32."""
    if _on_device_path(q):
        b = _bridge
        with b.context(q.device), common.on_stream(b.stream(q.device)), common.poisoning(False):
            o, lse = IMPLS[impl].forward(*(b.view(_bits(t)) for t in (q, k, v)), causal=causal, scale=scale,
                                         **options)
            return _unbits(b.tensor(o, q.device), q.dtype), b.tensor(lse, q.device)
    o, lse = api.attention_forward(*(_bits(t).detach().numpy() for t in (q, k, v)), causal=causal, scale=scale,
                                   impl=impl, **options)
    return _unbits(torch.from_numpy(o), q.dtype), torch.from_numpy(lse)


def _backward3(q, k, v, o, lse, do, causal, scale, impl, options):
    if _on_device_path(q):
        b = _bridge
        with b.context(q.device), common.on_stream(b.stream(q.device)), common.poisoning(False):
            grads = IMPLS[impl].backward(*(b.view(_bits(t)) for t in (q, k, v, o, lse, do)), causal=causal,
                                         scale=scale, **options)
            return tuple(_unbits(b.tensor(g, q.device), q.dtype) for g in grads)
    grads = api.attention_backward(*(_bits(t).detach().numpy() for t in (q, k, v, o, lse, do)), causal=causal,
                                   scale=scale, impl=impl, **options)
    return tuple(_unbits(torch.from_numpy(g), q.dtype) for g in grads)


# --------------------------------------------------------------------------- autograd


SECOND_ORDER = ("flashnb's attention backward is not itself differentiable, so a second-order gradient through "
                "flashnb.torch.attention (a gradient penalty: autograd.grad(..., create_graph=True), then a backward "
                "through that gradient; a Hessian-vector product) would miss its terms; it is refused.  Compute "
                "that term with torch.nn.functional.scaled_dot_product_attention under torch.nn.attention.sdpa_kernel("
                "SDPBackend.MATH), or plain torch ops; first-order gradients through flashnb are unaffected")


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
        o, lse = _forward3(q, k, v, causal, scale, impl, options)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.config = (causal, scale, impl, options)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, impl, options = ctx.config
        with torch.no_grad():
            grads = _backward3(q, k, v, o, lse, do.to(q.dtype).contiguous(), causal, scale, impl, options)
        return (*refuse_second_order(grads, (q, k, v, do)), None, None, None, None)


def _check_tensors(q, k, v, allow_float64):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (flashnb.attention takes NumPy arrays), "
                            f"got {type(t).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype (as SDPA requires), got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype == torch.float64 and not allow_float64:
        raise TypeError("q, k, v are float64 but flashnb's kernels compute in float32: pass allow_float64=True to "
                        "compute in float32 and get float64 results of float32 accuracy, or convert them yourself")
    if q.dtype not in (torch.float32, torch.float64) + _HALF:
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


def _draw_seed() -> int:
    """A dropout seed in ``[0, 2^63)`` from torch's default (CPU) generator, so ``torch.manual_seed`` makes it
    reproducible."""
    return int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())


def attention(q, k, v, *, causal=False, scale=None, impl: str = "flash", block_mask=None, score_mod=None,
              mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=None, allow_float64=False, storage=None,
              **options):
    """flashnb attention on torch tensors, differentiable: ``softmax(scale · q kᵀ [masked]) v``.

    Args:
        q: ``(B, H, Nq, d)`` (or ``(H, Nq, d)``, ``(Nq, d)``); k, v: ``(..., Nk, d)``, same leading axes.
        causal: False, True (= ``"lower_right"``: **bottom-right aligned**, FlashAttention's convention) or
            ``"upper_left"`` (top-left, SDPA's ``is_causal=True``).  Same mask when Nq == Nk.
        scale: softmax scale, default ``1/sqrt(d)``.
        impl: any impl with a backward (:func:`impls_with_backward`); a forward-only impl when no gradient is
            needed.  Default ``"flash"``, the product kernel (:mod:`flashnb.kernels.flash`).
        block_mask: the block-sparse mask of ``impl="flash"`` / ``"fa2"`` (``flashnb.kernels.flash.forward``), or a
            ``flashnb.flex.create_block_mask`` of a ``mask_mod``.
        score_mod, mask_mod, score_mod_grad: attention modifiers (``impl="flash"`` / ``"fa2"``), as in
            :func:`flashnb.attention_forward` (:mod:`flashnb.flex`); the backward needs ``score_mod_grad`` or
            ``score_mod.grad``.  k and v may have fewer heads than q (grouped-query attention).
        dropout_p: attention dropout probability in ``[0, 1)`` (``impl="flash"`` / ``"fa2"``; 0: none).  Applied
            whenever it is non-zero, as SDPA does (pass 0 in evaluation).
        seed: the dropout seed, an int in ``[0, 2**64)``; when None and ``dropout_p > 0``, one is drawn from
            torch's default generator (``torch.manual_seed`` makes it repeatable).  The autograd context keeps
            it: the backward regenerates exactly the forward's mask (:mod:`flashnb.rng`), nothing N×N is saved.
        allow_float64: accept float64 tensors (computed in float32; see the module docstring).
        storage: ``None`` (default: float16 and bfloat16 tensors stay in their dtype when the impl has half
            storage, ``"flash"``, ``"fa2"``; everything else is computed from float32 copies), ``"float32"``
            (always float32 copies), ``"float16"`` / ``"bfloat16"`` (the tensors must have that dtype and the impl
            half storage: TypeError / ValueError otherwise).  See the module docstring.
        **options: the impl's tile options (``Br``, ``Bc``, ``warps``, ...).

    Returns ``o`` with q's shape, dtype and device.
    """
    _check_tensors(q, k, v, allow_float64)
    entry = api._check_impl(impl)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad and entry.backward is None:
        raise ValueError(f"impl {impl!r} has no backward and q, k or v requires grad; use one of "
                         f"{impls_with_backward()} (or run under torch.no_grad())")
    Nq, Nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    c = api._check_causal(causal, Nq, Nk)
    s = api._check_scale(scale, d)
    for name, value in (("block_mask", block_mask), ("score_mod", score_mod), ("mask_mod", mask_mod),
                        ("score_mod_grad", score_mod_grad)):
        if value is not None:
            options[name] = value
    p = check_dropout(dropout_p, 0 if seed is None else seed)   # dropout_p's own errors first, then the impl's
    if p > 0 or seed is not None:                # a seed is drawn (torch's RNG advanced) only for real dropout
        options.update(dropout_p=p, seed=_draw_seed() if seed is None else seed)
    # q is flattened to (B·H, N, d) below: the modifiers' h and b need q's H (api checks it like any option)
    options = api._check_options(entry, impl, options, q, k)
    if "heads" in options:
        from .flex import check_modifiers, snapshot

        # the modifiers as they are now, for the forward and the backward alike (whatever their arrays do between)
        options.update({n: snapshot(options[n]) for n in ("score_mod", "mask_mod", "score_mod_grad") if n in options})
        check_modifiers(score_mod=score_mod, mask_mod=mask_mod, score_mod_grad=score_mod_grad)
        if needs_grad and score_mod is not None and score_mod_grad is None and \
                getattr(getattr(score_mod, "py_func", score_mod), "grad", None) is None:
            raise ValueError(f"score_mod {getattr(score_mod, '__name__', score_mod)!r} has no derivative and q, k or "
                             "v requires grad: pass score_mod_grad (d score_mod / d score, same arguments)")
    dtype = q.dtype
    storage = _storage(entry, impl, storage, dtype)
    work = torch.float32 if storage == "float32" else dtype   # half storage: the tensors as they are
    if storage != "float32":
        options = dict(options, storage=storage)
    q3, k3, v3 = (t.to(work).contiguous().reshape((-1,) + tuple(t.shape[-2:])) for t in (q, k, v))
    o, _ = FlashAttentionFunction.apply(q3, k3, v3, c, s, impl, options)
    return o.reshape(q.shape).to(dtype)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, impl: str = "flash", **options):
    """``torch.nn.functional.scaled_dot_product_attention``'s signature and semantics on flashnb's kernels:
    ``is_causal=True`` is top-left aligned (``"upper_left"``), ``attn_mask`` may be None or a
    ``torch.nn.attention.bias.causal_lower_right``/``causal_upper_left`` bias.  Anything flashnb does not
    compute (a tensor ``attn_mask``) is an error, never ignored; ``enable_gqa=True`` lets k, v have fewer heads
    than q.  ``dropout_p > 0`` is attention dropout (``impl="flash"`` / ``"fa2"``), applied whenever non-zero
    as in SDPA, with a seed drawn from torch's generator (or ``seed=`` among the options): see :func:`attention`.
    Its mask is flashnb's Philox mask, not the one SDPA's kernels would draw."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    causal = "upper_left" if is_causal else False
    if attn_mask is not None:
        if is_causal:
            raise ValueError("pass either attn_mask or is_causal=True, not both (as SDPA)")
        if not isinstance(attn_mask, CausalBias):
            raise ValueError("flashnb computes no arbitrary attn_mask: pass None, causal_lower_right(Nq, Nk) or "
                             "causal_upper_left(Nq, Nk) (torch.nn.attention.bias), or use flashnb.torch.attention "
                             "with block_mask=... for block sparsity")
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (query.shape[-2], key.shape[-2]):
            raise ValueError(f"attn_mask is a causal bias for (Nq, Nk) = ({attn_mask.seq_len_q}, "
                             f"{attn_mask.seq_len_kv}), but q, k have ({query.shape[-2]}, {key.shape[-2]})")
        causal = "lower_right" if attn_mask.variant == CausalVariant.LOWER_RIGHT else "upper_left"
    if not enable_gqa and query.shape[:-2] != key.shape[:-2]:
        raise ValueError("q, k, v need the same number of heads unless enable_gqa=True (as SDPA)")
    return attention(query, key, value, causal=causal, scale=scale, impl=impl, dropout_p=dropout_p, **options)
