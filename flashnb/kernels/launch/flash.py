"""The product kernel's launchers: one FA2 forward and backward on stage 6's fast loop, with every feature a policy.

``impl="flash"`` (the default of :func:`flashnb.attention`, :func:`flashnb.attention_forward`,
:func:`flashnb.attention_backward` and :func:`flashnb.pytorch.attention`).  The loop is stage 6's
(:mod:`flashnb.stages.fa2_fast`, built from :mod:`flashnb.kernels.simt.blocks`): register micro-tiles, 128-bit
conflict-free shared loads, heavy-first causal blocks, dynamic shared memory where the tiles need more than 48 KiB.
The features are the policies of :mod:`flashnb.kernels.policies`, called at fixed places of that loop and compiled
away when off (with all of them off the kernels are stage 6's):

* **storage** -- ``storage="float16"`` / ``"bfloat16"`` (uint16 bit patterns): Q, K, V, O (dO, dK, dV, dQ) kept in
  half precision in HBM, widened at every load, narrowed at every store; tiles, statistics and the dQ accumulator
  stay float32 (a conversion launch narrows dQ after the backward).
* **block masks** -- ``block_mask=`` (:class:`flashnb.masks.BlockMask`, a boolean array, or a prepared mask): three
  tile states, ``EMPTY`` (never loaded, never computed: FA1 Alg. 5's ``if M_ij != 0``), ``FULL`` (no
  per-element work), ``PARTIAL`` (``mask_mod`` per element).
* **attention modifiers** -- ``score_mod`` on every score, ``mask_mod`` through its block mask (built by the user
  surfaces with :func:`flashnb.flex.create_block_mask`), and the backward's ``score_mod_grad`` (default:
  ``score_mod.grad``; the user surfaces derive one from a modifier's source, :mod:`flashnb.flex_grad`, before they
  launch: the kernels never import a user surface).
* **dropout** -- ``dropout_p``, ``seed``: Philox (:mod:`flashnb.rng`) regenerated per element in both directions;
  ``dropout_at`` keys it by positions in a longer sequence (a context-parallel shard).
* **GQA / MQA** -- K, V with fewer heads than Q; the backward's blocks loop over their group's query heads, so K_j,
  V_j are loaded once per group and dK, dV summed on chip.
* **Nq != Nk**, both causal alignments (``causal=True`` / ``"lower_right"``, ``"upper_left"``), any ``d <= 128``.

The forward reads K_j, V_j once per (query head, Q block): under GQA the query heads of a group stream the same
(smaller) K/V tensors, each with its own blocks, as stage 4 does.  A block whose ``Br`` rows were the group's ``G``
heads at ``Br/G`` query positions would load each K/V tile once for the group, but it reads exactly as many K/V
elements whenever ``Br`` divides ``Nq`` (each block still holds ``Br`` rows), and its rows would span heads whose
block-mask states differ; where the sharing pays -- a few queries against a long cache -- flash-decoding
(:mod:`flashnb.kernels.decode`, ``impl="flash-decoding"``) reads each K/V chunk once per group.

Kernels (:mod:`flashnb.kernels.simt.forward`, :mod:`~flashnb.kernels.simt.backward`): ``"flash.forward"``,
``"flash.preprocess"``, ``"flash.backward"``, ``"flash.convert"``.  Traffic models equal to the counter:
:mod:`flashnb.kernels.models.simt`.  Tiles and block masks on them: :mod:`flashnb.kernels.launch.fit`.  The SASS
time model's inputs: :mod:`flashnb.instruments.sass_inputs.flash`.
"""

from __future__ import annotations

import numpy as np

from ...common import (
    allow_dynamic_shared,
    causal_diag,
    cdiv,
    check_storage,
    empty,
    launch,
    opt_in_or_fall_back,
    shared_optin_limit,
    storage_dtype,
    storage_of,
    warn_fallback,
)
from ...registry import register_impl
from .. import policies
from ..policies import modifier_keys
from ..simt.backward import CONVERT_THREADS, make_backward, make_convert
from ..simt.blocks import needs_dynamic, shared_bytes
from ..simt.forward import PRE_WARPS, _fwd_sig, make_forward, make_preprocess
from .fit import PreparedMask, _device_mask, _launch_mask, default_tiles, mask_tiles

__all__ = ["forward", "backward", "last_forward"]

#: What the last :func:`forward` ran with: ``dict(d=, Br=, Bc=, warps=, dynamic=, shared_bytes=, fallback=)``.
last_forward: dict = {}


def _storage(storage, **arrays) -> str:
    """The launch's storage: ``storage`` if given, else what q's dtype stands for; every array must be in it."""
    if storage is None:
        storage = storage_of(arrays["q"]) or "float32"
    want = storage_dtype(check_storage(storage))
    for name, a in arrays.items():
        if a is not None and np.dtype(a.dtype) != want:
            raise TypeError(f"flash with storage={storage!r} takes {name} as {want} "
                            f"{'(bfloat16 bit patterns) ' if storage == 'bfloat16' else ''}device arrays, got "
                            f"{name} of dtype {a.dtype}")
    return storage


def forward(q, k, v, *, causal=False, scale, Br=None, Bc=None, warps=None, block_mask=None, score_mod=None,
            mask_mod=None, heads=1, score_mod_grad=None, dropout_p=0.0, seed=None, dropout_at=None, storage=None):
    """Device arrays in, ``(O, L)`` out (FA2 Alg. 1).  ``Br, Bc, warps`` default to :func:`default_tiles` (with a
    block mask: the largest tiles dividing its blocks).  Tiles over 48 KiB of shared memory run the dynamic kernel
    after the driver opt-in, up to the device's opt-in limit; when the *default* tiles need more than the device
    allows (or the opt-in fails), the launch falls back to the static defaults with a ``RuntimeWarning``
    (:data:`last_forward` says what ran).

    ``block_mask``: a :class:`flashnb.stages.fa2.BlockMask`, a boolean array ``(..., ceil(Nq/Br), ceil(Nk/Bc))`` read
    at the ``Br``, ``Bc`` options or :func:`mask_tiles`, or a :class:`PreparedMask`.  ``score_mod``, ``mask_mod``
    (through its block mask), ``heads`` (the H of ``z = b·H + h``): attention modifiers.  ``k``, ``v`` may have
    fewer batch·heads than ``q`` (GQA: query head ``z`` reads K/V head ``z // G``).  ``dropout_p``, ``seed``:
    attention dropout (:mod:`flashnb.rng`); ``L`` is the undropped softmax's; ``dropout_at``: where these rows and
    columns sit in a longer sequence (:func:`flashnb.kernels.policies.check_dropout_at`: a shard of a
    context-parallel ring draws the single-device mask).  ``storage``: the dtype of q, k, v
    and O (default: q's); L is float32.  ``score_mod_grad`` is the backward's (accepted so one set of options
    serves both)."""
    global last_forward
    storage = _storage(storage, q=q, k=k, v=v)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = policies.gqa_group(BH, k, v)
    drop = policies.dropout_args(dropout_p, seed, dropout_at)
    given = not (Br is None and Bc is None and warps is None)
    optin = shared_optin_limit()
    fallback = None
    scored = score_mod is not None
    try:
        t, M, bm_mod, partial = _launch_mask("forward", d, Br, Bc, warps, block_mask, BH, Nq, Nk, optin=optin,
                                             scored=scored)
    except ValueError as exc:
        if given or isinstance(block_mask, PreparedMask) or not needs_dynamic(**default_tiles(d, False, scored), d=d) \
                or "opt-in limit" not in str(exc):
            raise
        t, M, bm_mod, partial = _launch_mask("forward", d, None, None, None, block_mask, BH, Nq, Nk, static=True)
        fallback = str(exc)
    mask_mod, H = modifier_keys.launch_modifiers(score_mod, mask_mod, None, block_mask, heads, BH)
    config = dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), dynamic=t["dynamic"],
                  storage=storage, sparse=M is not None, score_mod=score_mod, mask_mod=mask_mod if partial else None,
                  H=H, gqa=G > 1, dropout=drop is not policies.NO_DROPOUT)
    nbytes = shared_bytes(t["Br"], t["Bc"], d, t["warps"])
    kernel = make_forward(**config)
    if t["dynamic"]:
        refused = opt_in_or_fall_back("flash forward", kernel, _fwd_sig(storage), nbytes, t, d,
                                      given or isinstance(block_mask, PreparedMask), allow_dynamic_shared)
        if refused:
            fallback = refused
            t, M, _, partial = _launch_mask("forward", d, None, None, None, block_mask, BH, Nq, Nk, static=True)
            nbytes = shared_bytes(t["Br"], t["Bc"], d, t["warps"])
            config.update(Br=t["Br"], Bc=t["Bc"], warps=t["warps"], dynamic=False,
                          mask_mod=mask_mod if partial else None)
            kernel = make_forward(**config)
    if fallback:
        warn_fallback("flash forward", d, fallback, t)
    last_forward = dict(d=d, Br=t["Br"], Bc=t["Bc"], warps=t["warps"], dynamic=t["dynamic"], shared_bytes=nbytes,
                        fallback=fallback)
    O = empty((BH, Nq, d), storage=storage)
    L = empty((BH, Nq))
    launch(kernel, (cdiv(Nq, t["Br"]), BH), 32 * t["warps"], q, k, v, O, L, scale, causal_diag(causal, Nq, Nk),
           _device_mask(None) if M is None else M, *drop, label="flash forward",
           shared=nbytes if t["dynamic"] else 0)
    return O, L


def backward(q, k, v, o, lse, do, *, causal=False, scale, Br=None, Bc=None, warps=None, block_mask=None,
             score_mod=None, mask_mod=None, heads=1, score_mod_grad=None, dropout_p=0.0, seed=None, dropout_at=None,
             storage=None):
    """FA2 Alg. 2: the ``D = rowsum(dO∘O)`` launch (it also zeroes the float32 dQ accumulator), then one block per
    K/V column block of each K/V head (looping over its GQA group's query heads), then, with half storage, dQ
    narrowed by a third launch.  ``Br, Bc, warps`` default to :func:`bwd_default_tiles` (with a block mask: the
    largest dividing its blocks); options as in :func:`forward`, with the forward's ``dropout_p``, ``seed`` (the
    mask is regenerated) and ``score_mod_grad`` (default ``score_mod.grad``; :func:`flashnb.attention_backward`
    derives one from ``score_mod``'s source: :func:`flashnb.flex_grad.derivative`).  ``o`` is the (dropped)
    output."""
    storage = _storage(storage, q=q, k=k, v=v, o=o, do=do)
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = policies.gqa_group(BH, k, v)
    drop = policies.dropout_args(dropout_p, seed, dropout_at)
    t, M, bm_mod, partial = _launch_mask("backward", d, Br, Bc, warps, block_mask, BH, Nq, Nk)
    mask_mod, H = modifier_keys.launch_modifiers(score_mod, mask_mod, score_mod_grad, block_mask, heads, BH)
    if score_mod is not None and score_mod_grad is None:
        score_mod_grad = policies.score_mod_grad_of(score_mod)   # score_mod.grad (the surfaces derive the rest)
    D, dQ = preprocess(o, do, storage)
    dK = empty((BH // G, Nk, d), storage=storage)
    dV = empty((BH // G, Nk, d), storage=storage)
    kernel = make_backward(t["Br"], t["Bc"], d, t["warps"], bool(causal), storage, M is not None, score_mod,
                           mask_mod if partial else None, H, G > 1, score_mod_grad, drop is not policies.NO_DROPOUT)
    launch(kernel, (cdiv(Nk, t["Bc"]), BH // G), 32 * t["warps"], q, k, v, do, lse, D, dQ, dK, dV, scale,
           causal_diag(causal, Nq, Nk), _device_mask(None) if M is None else M, *drop, label="flash backward")
    return convert_dq(dQ, storage), dK, dV


def preprocess(o, do, storage):
    """FA2 Alg. 2 line 4, the backward's first launch (both backends): ``D = rowsum(dO ∘ O)`` and the float32 dQ
    accumulator the atomics add into, zeroed.  Returns ``(D, dQ)``."""
    BH, Nq, d = o.shape
    D = empty((BH, Nq))
    dQ = empty((BH, Nq, d))                            # float32: the atomics' accumulator
    launch(make_preprocess(storage), (cdiv(Nq, PRE_WARPS), BH), 32 * PRE_WARPS, o, do, D, dQ,
           label="D = rowsum(dO∘O)")
    return D, dQ


def convert_dq(dQ, storage):
    """The backward's last launch with half storage (both backends): the float32 dQ accumulator rounded once into
    the inputs' storage (FlashAttention-2 ends its backward the same way); float32 is returned as it is."""
    if storage == "float32":
        return dQ
    BH, Nq, d = dQ.shape
    dQh = empty((BH, Nq, d), storage=storage)
    launch(make_convert(storage), (cdiv(Nq * d, CONVERT_THREADS), BH), CONVERT_THREADS, dQ, dQh,
           label=f"dQ -> {storage}")
    return dQh


register_impl("flash", stage="product",
              description="the product kernel: stage 6's fast loop with every feature as a policy (half storage, "
                          "block masks, score_mod / mask_mod, dropout, GQA/MQA)",
              forward=forward, backward=backward,
              options=("Br", "Bc", "warps", "block_mask", "score_mod", "mask_mod", "score_mod_grad", "dropout_p",
                       "seed", "dropout_at", "storage"),
              gqa=True, mask_tiles=lambda d, Br=None, Bc=None: dict(mask_tiles(d), **{
                  n: v for n, v in (("Br", Br), ("Bc", Bc)) if v is not None}))
