"""flashnb's attention as PyTorch custom operators: ``torch.ops.flashnb.attention_forward`` and
``torch.ops.flashnb.attention_backward`` (``torch.library.custom_op``), with fake (meta) implementations and
autograd, so that ``torch.compile`` (``fullgraph=True``), ``torch.export`` and ``torch.library.opcheck`` see
one opaque operator per direction instead of NumPy and numba code they cannot trace.

Schemas (``str(torch.ops.flashnb.attention_forward.default._schema)``)::

    flashnb::attention_forward(Tensor q, Tensor k, Tensor v, Tensor? seed, str causal, float? scale,
                               float dropout_p, str impl, str options) -> (Tensor, Tensor)
    flashnb::attention_backward(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? seed,
                                str causal, float? scale, float dropout_p, str impl, str options)
                                -> (Tensor, Tensor, Tensor)

* Tensors: ``q (B, Hq, Nq, d)``, ``k, v (B, Hkv, Nk, d)`` with ``Hq`` a multiple of ``Hkv`` (grouped-query
  attention), one device (CPU: the simulator; CUDA: a GPU), one dtype: float32, float16 or bfloat16.  ``o`` has
  q's shape and dtype, ``lse`` is float32 ``(B, Hq, Nq)``; the backward returns ``dq, dk, dv`` with the shapes
  and dtype of ``q, k, v``.  Any strides (the operator makes its own contiguous copies where needed).
* ``seed``: attention dropout's seed as an int64 tensor of one element (``dropout_p > 0``; None otherwise), so
  that the operator stays functional: :func:`flashnb.pytorch.attention` draws it from torch's generator
  (``torch.randint``, part of the traced graph), outside the operator.  Seeds ``>= 2**63`` travel as their
  two's complement (``seed - 2**64``) and are read back as unsigned.
* ``causal``: ``"none"``, ``"lower_right"`` (flashnb's ``causal=True``) or ``"upper_left"`` (SDPA's
  ``is_causal``); ``scale``: the softmax scale (None: ``1/sqrt(d)``); ``dropout_p``; ``impl``: a registered
  impl (:data:`flashnb.registry.IMPLS`; any impl, forward-only ones too).
* ``options``: the impl's other options as canonical JSON (``{"Br": 16, "storage": "float16", ...}``): numbers,
  strings, booleans travel by value.  **Python objects** -- attention modifiers (``score_mod``, ``mask_mod``,
  ``score_mod_grad``), block masks, any other object an impl takes -- travel as handles
  (``{"$flashnb": "score_mod#<process>.<n>"}``) into a registry of this process (:data:`REGISTRY`): a
  modifier is registered as its :func:`flashnb.flex.snapshot` (code and captured values at that call), a block
  mask with a digest of its arrays.

**The registry's lifetime.**  Handles are made by :func:`flashnb.pytorch.attention` (at every eager call; under
``torch.compile`` once, when the call is traced, and baked into the graph as constants).  The registry keeps the
:data:`REGISTRY_SIZE` most recently used entries; a handle names its process (a random token), so it never
resolves to another object.  The operator refuses (ValueError naming the argument), never guesses, when:

* the handle was made in another process (an exported program run elsewhere) or has been evicted: rebuild the
  call there (call :func:`flashnb.pytorch.attention` once) -- modifiers and block masks do not travel;
* the modifier a compiled graph was traced with has changed what it captures since (an array changed in place),
  or a block mask's arrays changed: a compiled graph keeps the modifier it was traced with (a new function
  object retraces: ``torch.compile`` guards on its identity), so a change of content is an error at the forward.

What ``torch.compile`` needs beyond this module: :func:`flashnb.pytorch.attention` turns its Python arguments into
the ``options`` string in one function marked ``torch.compiler.assume_constant_result`` (run at tracing, its
result a graph constant) and passes ``id()`` of every object argument, so that dynamo guards on the objects
themselves (a closure of the same code with other captured values is another object, hence a retrace).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict

import numpy as np
import torch

from .. import api
from . import devices

__all__ = ["attention_forward", "attention_backward", "REGISTRY", "REGISTRY_SIZE", "SCHEMAS", "SECOND_ORDER"]

CAUSAL = {"none": False, "lower_right": True, "upper_left": "upper_left"}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MODIFIERS = ("score_mod", "mask_mod", "score_mod_grad")

#: Entries the registry keeps (least recently used dropped first).
REGISTRY_SIZE = 1024


# --------------------------------------------------------------------------- the registry of Python objects


class Registry:
    """Process-local handles for the Python objects an operator call needs (see the module docstring)."""

    def __init__(self, size: int = REGISTRY_SIZE):
        self.token = secrets.token_hex(6)          # this process's; a handle from elsewhere never matches
        self.size = size
        self.entries: OrderedDict = OrderedDict()  # handle -> (role, object, digest)
        self.by_key: dict = {}                     # content key -> handle
        self.serial = 0

    def handle(self, role: str, obj) -> str:
        """The handle of ``obj`` in ``role`` (registered on first use; equal content, equal handle)."""
        from .. import flex

        if role in _MODIFIERS:
            obj = flex.snapshot(obj)
            key, digest = (role, obj), None
        else:
            digest = _digest(obj)
            key = (role, id(obj), digest)
        h = self.by_key.get(key)
        if h is None or h not in self.entries:
            self.serial += 1
            h = f"{role}#{self.token}.{self.serial}"
            self.by_key[key] = h
            self.entries[h] = (role, obj, digest, key)
            while len(self.entries) > self.size:
                _, (_, _, _, old) = self.entries.popitem(last=False)
                self.by_key.pop(old, None)
        self.entries.move_to_end(h)
        return h

    def lookup(self, handle: str, role: str, op: str, direction: str):
        """The object of ``handle``, checked: made here, still registered, content unchanged (forward)."""
        entry = self.entries.get(handle)
        if entry is None:
            here = handle.split("#", 1)[-1].startswith(self.token)
            why = (f"it was dropped: the registry keeps the {self.size} most recently used" if here else
                   "modifiers and block masks live in the process that made them")
            raise ValueError(
                f"flashnb::{op}: options name {role} {handle!r}, registered by flashnb.pytorch in "
                f"{'this' if here else 'another'} process, which this process's registry does not hold ({why}); "
                "call flashnb.pytorch.attention with it again in this process (modifiers and block masks do not travel "
                "with an exported program)")
        self.entries.move_to_end(handle)
        _, obj, digest, _ = entry
        if direction == "forward":
            if role in _MODIFIERS and not obj.current():
                raise ValueError(
                    f"flashnb::{op}: {role} {obj.__name__!r} captures arrays that changed in place since this call "
                    "was traced by torch.compile (the compiled graph keeps the modifier it was traced with, a snapshot "
                    "of its values then): pass a new modifier (a new function object is traced again) instead of "
                    "changing the arrays it captures, or call flashnb.pytorch.attention outside torch.compile")
            if digest is not None and _digest(obj) != digest:
                raise ValueError(f"flashnb::{op}: {role} was changed in place since this call was traced by "
                                 "torch.compile (its arrays differ): pass a new block mask object instead")
        return obj


def _digest(obj):
    """BLAKE2 of the arrays an object holds (a block mask's ``mask``/``partial``, an array), or None."""
    arrays = [obj] if isinstance(obj, np.ndarray) else \
        [a for a in (getattr(obj, "mask", None), getattr(obj, "partial", None)) if isinstance(a, np.ndarray)]
    if not arrays:
        return None
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(repr((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1))
    return h.digest()


REGISTRY = Registry()


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def encode_options(options: dict) -> str:
    """``options`` as the operators' JSON string: plain values as they are, objects as registry handles."""
    out = {}
    for name, value in sorted(options.items()):
        if isinstance(value, np.generic):
            value = value.item()
        if _plain(value):
            out[name] = value
        else:
            out[name] = {"$flashnb": REGISTRY.handle(name, value)}
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def decode_options(options: str, op: str, direction: str) -> dict:
    try:
        raw = json.loads(options)
    except (TypeError, ValueError):
        raise ValueError(f"flashnb::{op}: options must be the JSON string flashnb.pytorch.attention makes, got "
                         f"{options!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"flashnb::{op}: options must be a JSON object, got {options!r}")
    return {name: REGISTRY.lookup(v["$flashnb"], name, op, direction) if isinstance(v, dict) and "$flashnb" in v
            else v for name, v in raw.items()}


# --------------------------------------------------------------------------- checks shared by real and fake impls


def _check_inputs(op: str, tensors: dict, seed, causal: str, dropout_p: float) -> None:
    """TypeError / ValueError naming the argument, for what the operator does not take (run by the real and the
    fake implementation alike, so a traced call fails when it is traced)."""
    first = next(iter(tensors))
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashnb::{op}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != (3 if name == "lse" else 4):
            want = "(B, H, N)" if name == "lse" else "(B, H, N, d)"
            raise ValueError(f"flashnb::{op}: {name} must have shape {want}, got {tuple(t.shape)}")
    dev = tensors[first].device
    for name, t in tensors.items():
        if t.device != dev:
            raise ValueError(f"flashnb::{op}: {name} is on {t.device} but {first} is on {dev}: every tensor of one "
                             "call must be on one device")
        want = torch.float32 if name == "lse" else tensors[first].dtype
        if name == "lse" and t.dtype != torch.float32:
            raise TypeError(f"flashnb::{op}: lse must be float32 (what attention_forward returns), got {t.dtype}")
        if name != "lse" and t.dtype != want:
            raise TypeError(f"flashnb::{op}: {name} has dtype {t.dtype} but {first} has {want}: one dtype for "
                            "q, k, v (o, do)")
    if tensors[first].dtype not in _DTYPES:
        raise TypeError(f"flashnb::{op}: {first} has dtype {tensors[first].dtype}; the operator takes float32, "
                        "float16 or bfloat16 (flashnb.pytorch.attention converts float64 with allow_float64=True)")
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    if q.shape[0] != k.shape[0] or k.shape != v.shape or q.shape[3] != k.shape[3]:
        raise ValueError(f"flashnb::{op}: q must be (B, Hq, Nq, d) and k, v (B, Hkv, Nk, d), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"flashnb::{op}: q's heads ({q.shape[1]}) must be a multiple of k's and v's ({k.shape[1]})")
    for name in ("o", "do"):
        if name in tensors and tensors[name].shape != q.shape:
            raise ValueError(f"flashnb::{op}: {name} must have q's shape {tuple(q.shape)}, got "
                             f"{tuple(tensors[name].shape)}")
    if "lse" in tensors and tensors["lse"].shape != q.shape[:3]:
        raise ValueError(f"flashnb::{op}: lse must have shape {tuple(q.shape[:3])}, got {tuple(tensors['lse'].shape)}")
    if causal not in CAUSAL:
        raise ValueError(f"flashnb::{op}: causal must be one of {sorted(CAUSAL)}, got {causal!r}")
    if dropout_p:
        if seed is None:
            raise ValueError(f"flashnb::{op}: dropout_p={dropout_p!r} needs a seed tensor")
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise TypeError(f"flashnb::{op}: seed must be an int64 tensor of one element, got {seed.dtype} "
                            f"{tuple(seed.shape)}")


def _seed_value(seed) -> int:
    s = int(seed.reshape(()).item())
    return s + 2**64 if s < 0 else s


def _call_options(op, q, k, causal, scale, dropout_p, seed, impl, options, direction):
    """``(impl entry, causal, scale, options dict, working dtype)`` of one operator call."""
    entry = api._check_impl(impl, need_backward=direction == "backward")
    opts = decode_options(options, op, direction)
    c = api._check_causal(CAUSAL[causal], q.shape[2], k.shape[2])
    s = api._check_scale(scale, q.shape[3])
    if dropout_p:
        opts.update(dropout_p=float(dropout_p), seed=_seed_value(seed))
    opts = api._check_options(entry, impl, opts, q, k)        # adds heads (q's H) for the modifiers
    storage = opts.pop("storage", "float32")
    if storage != "float32":
        if devices._STORAGE_OF.get(q.dtype) != storage:
            raise TypeError(f"flashnb::{op}: options storage={storage!r} needs tensors of dtype torch.{storage}, "
                            f"got {q.dtype}")
        opts["storage"] = storage
        return entry, c, s, opts, q.dtype
    return entry, c, s, opts, torch.float32


def _flat(t, dtype):
    """(B, H, N, d) -> contiguous (B·H, N, d) in ``dtype`` (a copy only where needed)."""
    return t.to(dtype).contiguous().reshape((-1,) + tuple(t.shape[2:]))


# --------------------------------------------------------------------------- the operators


@torch.library.custom_op("flashnb::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor | None, causal: str,
                      scale: float | None, dropout_p: float, impl: str, options: str
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """FA2 Alg. 1 (or the impl's forward): ``(o, lse)``; see the module docstring."""
    op = "attention_forward"
    _check_inputs(op, dict(q=q, k=k, v=v), seed, causal, dropout_p)
    _, c, s, opts, work = _call_options(op, q, k, causal, scale, dropout_p, seed, impl, options, "forward")
    B, H, Nq, d = q.shape
    o, lse = devices._forward3(_flat(q, work), _flat(k, work), _flat(v, work), c, s, impl, opts)
    return o.reshape(B, H, Nq, d).to(q.dtype), lse.reshape(B, H, Nq)


@attention_forward.register_fake
def _(q, k, v, seed, causal, scale, dropout_p, impl, options):
    _check_inputs("attention_forward", dict(q=q, k=k, v=v), seed, causal, dropout_p)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashnb::attention_backward", mutates_args=())
def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, seed: torch.Tensor | None, causal: str, scale: float | None,
                       dropout_p: float, impl: str, options: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA2 Alg. 2 (or the impl's backward): ``(dq, dk, dv)`` from the forward's ``o`` and ``lse``, recomputing P
    tile by tile; see the module docstring."""
    op = "attention_backward"
    _check_inputs(op, dict(q=q, k=k, v=v, o=o, do=do, lse=lse), seed, causal, dropout_p)
    _, c, s, opts, work = _call_options(op, q, k, causal, scale, dropout_p, seed, impl, options, "backward")
    dq, dk, dv = devices._backward3(_flat(q, work), _flat(k, work), _flat(v, work), _flat(o, work),
                                    lse.contiguous().reshape(-1, q.shape[2]), _flat(do, work), c, s, impl, opts)
    return dq.reshape(q.shape).to(q.dtype), dk.reshape(k.shape).to(k.dtype), dv.reshape(v.shape).to(v.dtype)


@attention_backward.register_fake
def _(do, q, k, v, o, lse, seed, causal, scale, dropout_p, impl, options):
    _check_inputs("attention_backward", dict(q=q, k=k, v=v, o=o, do=do, lse=lse), seed, causal, dropout_p)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    q, k, v, seed, causal, scale, dropout_p, impl, options = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, seed)    # what FlashAttention saves: O and L, never P
    ctx.config = (causal, scale, dropout_p, impl, options)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, seed = ctx.saved_tensors
    if do is None:
        return (None,) * 9
    dq, dk, dv = torch.ops.flashnb.attention_backward(do, q, k, v, o, lse, seed, *ctx.config)
    return dq, dk, dv, None, None, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


#: What a second-order use of flashnb's backward raises.
SECOND_ORDER = ("flashnb's attention backward is not itself differentiable, so a second-order gradient through "
                "flashnb.pytorch.attention (a gradient penalty: autograd.grad(..., create_graph=True), then a backward "
                "through that gradient; a Hessian-vector product) would miss its terms; it is refused.  Compute "
                "that term with torch.nn.functional.scaled_dot_product_attention under torch.nn.attention.sdpa_kernel("
                "SDPBackend.MATH), or plain torch ops; first-order gradients through flashnb are unaffected")


def _refuse_second_order(ctx, *grads):
    raise RuntimeError(SECOND_ORDER)


def _setup_nothing(ctx, inputs, output):
    pass


# flashnb's backward is not itself differentiable: a backward through it (create_graph=True, then a backward of
# the gradient) reaches this node and raises, naming flashnb, instead of dropping the second-order terms
attention_backward.register_autograd(_refuse_second_order, setup_context=_setup_nothing)

SCHEMAS = {name: str(getattr(torch.ops.flashnb, name).default._schema)
           for name in ("attention_forward", "attention_backward")}
