"""flashnb attention inside a PyTorch model: custom operators with SDPA's shapes, ``torch.compile``-able.

Needs PyTorch (``pip install "flashnb[torch]"``); ``import flashnb`` never imports it -- only
``import flashnb.pytorch`` does.

* :func:`attention` ``(q, k, v, *, causal=False, scale=None, impl="auto", block_mask=None, score_mod=None,
  mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=None)`` (attention modifiers: :mod:`flashnb.flex`;
  dropout: :mod:`flashnb.rng`, the seed drawn from torch's generator when not given) takes tensors of
  shape ``(B, H, N, d)`` (or ``(H, N, d)``, ``(N, d)``) like ``torch.nn.functional.scaled_dot_product_attention``
  and returns ``o`` with q's shape and dtype; gradients flow to q, k and v.  k and v may have fewer heads than q
  (grouped-/multi-query attention, ``impl="flash"``; dk, dv are summed over each group).
* :func:`scaled_dot_product_attention` has SDPA's own signature and semantics (``is_causal`` aligned top-left,
  ``attn_mask`` a ``causal_lower_right``/``causal_upper_left`` bias or None), for a literal drop-in.
* Both call flashnb's **custom operators** ``torch.ops.flashnb.attention_forward`` / ``attention_backward``
  (:mod:`flashnb.pytorch.ops`: ``torch.library.custom_op`` with fake implementations and ``register_autograd``),
  so ``torch.compile(model, fullgraph=True)``, ``torch.export`` and ``torch.library.opcheck`` see one opaque
  operator per direction.  The forward saves what FlashAttention saves -- q, k, v, O and the log-sum-exp ``L``,
  never P -- and the backward is the impl's recompute backward (P rebuilt tile by tile from ``L``).  That
  backward is not itself differentiable: a second-order use (a gradient penalty, a Hessian-vector product) is a
  RuntimeError saying so (:data:`SECOND_ORDER`), never a gradient missing its terms.  How Python arguments
  (modifiers, block masks, dropout's seed) cross the operator boundary, and what that means for an exported
  program in another process: :mod:`flashnb.pytorch.ops`.
* :func:`register_transformers` plugs flashnb into Hugging Face transformers' ``AttentionInterface``
  (:mod:`flashnb.pytorch.transformers`).
* :mod:`flashnb.pytorch.flash_attn` has flash-attn 2.x's ``flash_attn_func``, ``flash_attn_varlen_func`` and
  ``flash_attn_with_kvcache`` (its names, arguments and layouts) on these operators.
* :class:`FlashAttentionFunction` is the same computation as a ``torch.autograd.Function`` on flattened
  ``(BH, N, d)`` tensors (not traceable by ``torch.compile``); :func:`refuse_second_order` is its refusal.

**Versions.**  Needs ``torch.library.custom_op`` (PyTorch >= 2.4); the tests (CI) run the pinned 2.13.0 (the
README's test command), the only version checked.

**Causal alignment.** ``causal=True`` means ``"lower_right"``: aligned to the bottom-right corner when
Nq != Nk, as FlashAttention >= 2.1 and ``torch.nn.attention.bias.causal_lower_right``.  SDPA's
``is_causal=True`` is ``"upper_left"`` (``causal_upper_left``).  They agree only when Nq == Nk.

**Devices.** CPU tensors go through the NumPy API (copied to the simulator's "device", or to the GPU when
flashnb runs on one, and back).  CUDA tensors stay on the GPU: the kernels read and write them zero-copy
through ``__cuda_array_interface__`` (``numba.cuda.as_cuda_array``) and launch on torch's current stream
(``numba.cuda.external_stream``); the outputs are numba allocations wrapped as tensors, not copies.  On the
simulator this path is rehearsed (:func:`rehearse_cuda`): CPU tensors take it, wrapped zero-copy.

**dtypes.** flashnb's kernels compute in float32.  float32 tensors are used as they are.  float16 and bfloat16
tensors given to an impl with half-precision storage (``impl="flash"``, ``"fa2-tc"``, and so ``"auto"``) stay in
their dtype: the kernels read them as they are (half the bytes), widen every element to float32 on chip (fa2-tc:
its tensor cores multiply the halves, accumulating in float32), and write ``o`` and the
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


from . import ops  # registers torch.ops.flashnb.attention_forward / attention_backward
from .devices import _backward3, _forward3, _on_device_path, impls_with_backward, rehearse_cuda  # noqa: F401
from .functional import (  # noqa: F401
           SECOND_ORDER,
           FlashAttentionFunction,
           _draw_seed,
           attention,
           refuse_second_order,
           scaled_dot_product_attention,
)
from .transformers import register_transformers  # imports transformers only when called

__all__ = ["attention", "scaled_dot_product_attention", "register_transformers", "ops", "FlashAttentionFunction",
           "impls_with_backward", "rehearse_cuda", "refuse_second_order", "SECOND_ORDER"]
