"""fa2-tc's host side: checks, tiles, launches (``impl="fa2-tc"``).

:func:`forward` (FA2 Alg. 1) and :func:`backward` (Alg. 2: with the product kernel's preprocessing and dQ
conversion launches) on the kernels of :mod:`flashnb.kernels.tensorcore`; their traffic models
(:func:`model_forward`, :func:`model_backward`) are :mod:`flashnb.kernels.models.tensorcore`'s.
"""

from __future__ import annotations

import numpy as np

from ...common import (
    allow_dynamic_shared,
    causal_diag,
    cdiv,
    check_shared_fit,
    empty,
    launch,
    opt_in_or_fall_back,
    shared_optin_limit,
    storage_of,
    warn_fallback,
)
from ...registry import register_impl
from .. import policies
from ..policies import PARTIAL
from ..policies import modifier_keys as modifiers
from ..tensorcore import backward as tc_backward
from ..tensorcore import forward as tc_forward
from ..tensorcore import mma
from ..tensorcore.geometry import (
    ARCHS,
    BWD_LABEL,
    STORAGES,
    _bwd_dynamic_bytes,
    bwd_default_tiles,
    bwd_geometry,
    bwd_needs_dynamic,
    bwd_shared_bytes,
    default_tiles,
    geometry,
    shared_bytes,
)
from . import fit
from .flash import convert_dq, preprocess

__all__ = ["forward", "backward", "check_inputs", "device_arch", "last_backward"]

#: What the last :func:`backward` launch ran with: ``dict(d=, Br=, Bc=, warps=, dynamic=, shared_bytes=, fallback=None
#: or the reason it fell back to the static tiles)``.
last_backward: dict = {}


# --------------------------------------------------------------------------- the tiles of a launch


def _override(t, Br, Bc, warps):
    """The tiles ``t`` with the options given (ValueError naming one that is not a positive int)."""
    for name, value in (("Br", Br), ("Bc", Bc), ("warps", warps)):
        if value is not None:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            t[name] = int(value)


def _tiles(storage, d, Br, Bc, warps, arch):
    """Validated forward tiles: the defaults, overridden by the options, within shared memory."""
    t = default_tiles(d, storage)
    _override(t, Br, Bc, warps)
    geometry(storage, d, t["Br"], t["Bc"], t["warps"], arch)
    check_shared_fit("fa2-tc forward", f"Br={t['Br']}, Bc={t['Bc']} at d={d} ({storage})",
                     shared_bytes(storage, d, t["Br"], t["Bc"], t["warps"], arch), "choose smaller Br/Bc")
    return t


def _fit_mask(direction, d, t, given, block_mask, BH, Nq, Nk):
    """``(tiles, M or None)`` of a launch with ``block_mask`` (a
    :class:`flashnb.masks.BlockMask`, or a boolean array read at the ``Br``, ``Bc`` options or
    :func:`flashnb.kernels.launch.fit.mask_tiles`): the tiles made to divide the mask's blocks (a given tile must, a
    default one shrinks to the largest that does and that the fragment layout allows), and the mask's states at
    them (:meth:`BlockMask.at_tiles`: uint8 ``(BH, ceil(Nq/Br), ceil(Nk/Bc))``)."""
    if block_mask is None:
        return t, None
    if isinstance(block_mask, fit.PreparedMask):
        raise TypeError("block_mask: fa2-tc takes a flashnb.masks.BlockMask (flashnb.flex.create_block_mask) or a "
                        "boolean array; a PreparedMask is mapped onto the product kernel's tiles")
    bm = fit._as_block_mask(block_mask, d, given.get("Br"), given.get("Bc"))
    bm.check(Nq, Nk, BH=BH)
    t = dict(t)

    def shrink(name, within, step, cap):
        x = fit._largest_divisor(within, cap, step)
        if x is None:
            raise ValueError(f"block_mask was built for tiles Br={bm.Br}, Bc={bm.Bc}: the fa2-tc {direction} needs "
                             f"{name} a multiple of {step} dividing {within}; build the mask for tiles that are "
                             "multiples of 16, e.g. flashnb.flex.create_block_mask(..., Br=32, Bc=32)")
        return x

    def refuse_given(name):
        if name in given:
            raise ValueError(f"block_mask was built for tiles Br={bm.Br}, Bc={bm.Bc}; the fa2-tc {direction} tiles "
                             f"Br={t['Br']}, Bc={t['Bc']} must divide them: build the mask for these tiles or pass "
                             f"Br, Bc that divide {bm.Br}, {bm.Bc}")

    if direction == "forward":              # Br = 16·MT·warps rows, Bc a multiple of 16 keys
        if bm.Br % t["Br"]:
            refuse_given("Br")
            t["Br"] = shrink("Br", bm.Br, 16 * t["warps"] if "warps" in given else 16, t["Br"])
            if "warps" not in given:
                t["warps"] = max(w for w in range(1, t["warps"] + 1) if t["Br"] % (16 * w) == 0)
        if bm.Bc % t["Bc"]:
            refuse_given("Bc")
            t["Bc"] = shrink("Bc", bm.Bc, 16, t["Bc"])
    else:                                   # Bc = 16·warps keys, Br a multiple of 16·warps queries
        if bm.Bc % t["Bc"] or bm.Br % t["Br"] or t["Br"] % t["Bc"]:
            if bm.Bc % t["Bc"]:
                refuse_given("Bc")
                refuse_given("warps")
            if bm.Br % t["Br"] or t["Br"] % t["Bc"]:
                refuse_given("Br")
            # the most keys (warps) for which some Br, a multiple of Bc, divides the mask's rows too
            keys = [t["Bc"]] if "Bc" in given or "warps" in given else range(t["Bc"], 0, -16)
            for Bc in keys:
                Br = t["Br"] if "Br" in given else next(
                    (x for x in range(max(t["Br"], Bc) // Bc * Bc, 0, -Bc) if bm.Br % x == 0), None)
                if bm.Bc % Bc == 0 and Br is not None and bm.Br % Br == 0 and Br % Bc == 0:
                    t.update(Br=Br, Bc=Bc, warps=Bc // 16)
                    break
            else:
                raise ValueError(f"block_mask was built for tiles Br={bm.Br}, Bc={bm.Bc}: the fa2-tc backward needs "
                                 "Bc a multiple of 16 dividing the mask's Bc and Br a multiple of that Bc dividing "
                                 "the mask's Br; build the mask for tiles that are multiples of 16, e.g. "
                                 "flashnb.flex.create_block_mask(..., Br=32, Bc=32)")
    return t, bm.at_tiles(t["Br"], t["Bc"], Nq, Nk, BH)



def _bwd_tiles(storage, d, Br, Bc, warps, gqa=False, optin=fit.DESIGN_OPTIN_BYTES, static=False):
    """Validated backward tiles (``static``: the static defaults) with ``dynamic`` (over 48 KiB: dynamic shared
    memory, up to ``optin`` bytes; more is a ValueError naming the tiles and the limit)."""
    t = bwd_default_tiles(d, storage, gqa, static)
    _override(t, Br, Bc, warps)
    if Bc is None and warps is not None:
        t["Bc"] = 16 * t["warps"]
    if Br is None and (warps is not None or Bc is not None):
        t["Br"] = max(t["Br"], 16 * t["warps"]) // (16 * t["warps"]) * 16 * t["warps"]
    bwd_geometry(storage, d, t["Br"], t["Bc"], t["warps"])
    check_shared_fit("fa2-tc backward", f"Br={t['Br']}, Bc={t['Bc']} at d={d} ({storage})",
                     bwd_shared_bytes(storage, d, t["Br"], t["Bc"], t["warps"]), "choose smaller Br/Bc", optin=optin)
    t["dynamic"] = bwd_needs_dynamic(storage, d, t["Br"], t["Bc"], t["warps"])
    return t



def _mask_tiles(d, Br=None, Bc=None) -> dict:
    """The tiles the user surfaces build a ``mask_mod``'s block mask at: the product kernel's
    (:func:`flashnb.kernels.launch.fit.mask_tiles`, so one mask means the same blocks to every impl), or the
    ``Br``, ``Bc`` options; fa2-tc's tiles shrink to divide them."""
    return dict(fit.mask_tiles(d), **{n: x for n, x in (("Br", Br), ("Bc", Bc)) if x is not None})


def check_inputs(storage=None, **arrays):
    """The storage of fa2-tc's device arrays (``q=..., k=..., v=...``): float16, bfloat16 (uint16 bits, named by
    ``storage="bfloat16"``) or float32 (run through TF32); TypeError naming the argument otherwise."""
    found = {name: storage_of(a) for name, a in arrays.items()}
    first = next(iter(arrays))
    if storage is None:
        storage = found[first]
        if storage == "bfloat16":
            raise TypeError("fa2-tc: uint16 arrays are bfloat16 bits only with storage='bfloat16'")
    if storage not in STORAGES:
        raise TypeError(f"fa2-tc takes float16, bfloat16 (storage='bfloat16', uint16 bits) or float32 (TF32) inputs; "
                        f"got {first} of dtype {np.dtype(arrays[first].dtype)}")
    want = {"float16": "float16", "bfloat16": "uint16 (bfloat16 bits)", "float32": "float32"}[storage]
    for name, st in found.items():
        if st != storage:
            raise TypeError(f"fa2-tc: {name} must be {want} (storage={storage!r}), got dtype "
                            f"{np.dtype(arrays[name].dtype)}")
    return storage



def _modifier_config(score_mod, mask_mod, block_mask, heads, BH, partial):
    """``(mask_mod, H)`` of a launch: the product kernel's checks (``mask_mod`` through its block mask)."""
    bm_mod, H = modifiers.launch_modifiers(score_mod, mask_mod, None, block_mask, heads, BH)
    return (bm_mod if partial else None), H



def device_arch() -> int:
    """80 on sm_80 and newer, 75 on sm_75 (and on the simulator: 80); ValueError naming the architecture below."""
    cc = mma.check_arch("fa2-tc", ((7, 5),))
    return 80 if cc is None or cc >= (8, 0) else 75



def forward(q, k, v, *, causal=False, scale, Br=None, Bc=None, warps=None, storage=None, dropout_p=0.0, seed=None,
            dropout_at=None, block_mask=None, score_mod=None, mask_mod=None, heads=1, score_mod_grad=None):
    """FA2 Alg. 1 on tensor cores: device arrays in (float16, bfloat16 bits with ``storage="bfloat16"``, or float32
    through TF32), ``(O, L)`` out (O in q's storage, L float32).  ``Br, Bc, warps`` default to
    :func:`default_tiles`; on sm_75 only float16 (ValueError naming the architecture otherwise).  ``k``, ``v``
    may have fewer batch·heads than ``q`` (GQA/MQA: query head ``z`` reads K/V head ``z // G``).  ``dropout_p``,
    ``seed``, ``dropout_at``: attention dropout, the same mask as ``impl="flash"`` draws
    (:func:`flashnb.kernels.policies.dropout_args`); ``L`` is the undropped softmax's.  ``block_mask``,
    ``score_mod``, ``mask_mod`` (through its block mask), ``heads``: the product kernel's attention modifiers; with a
    block mask the default tiles shrink to divide its blocks (:func:`_fit_mask`).  ``score_mod_grad`` is the
    backward's (accepted so one set of options serves both)."""
    storage = check_inputs(storage, q=q, k=k, v=v)
    drop = policies.dropout_args(dropout_p, seed, dropout_at)
    arch = device_arch()
    if arch == 75 and storage != "float16":
        raise ValueError(f"fa2-tc on sm_75 takes float16 only (it has no bf16 or tf32 tensor cores), got {storage}")
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = policies.gqa_group(BH, k, v)
    given = {n: x for n, x in (("Br", Br), ("Bc", Bc), ("warps", warps)) if x is not None}
    t, M = _fit_mask("forward", d, _tiles(storage, d, Br, Bc, warps, arch), given, block_mask, BH, Nq, Nk)
    t = _tiles(storage, d, t["Br"], t["Bc"], t["warps"], arch)
    mask_mod, H = _modifier_config(score_mod, mask_mod, block_mask, heads, BH, M is not None and (M == PARTIAL).any())
    O = empty((BH, Nq, d), storage=storage)
    Lse = empty((BH, Nq))
    kernel = tc_forward.make_forward(t["Br"], t["Bc"], d, t["warps"], bool(causal), storage, arch, G > 1,
                                     drop is not policies.NO_DROPOUT, M is not None, score_mod, mask_mod, H)
    launch(kernel, (cdiv(Nq, t["Br"]), BH), 32 * t["warps"], q, k, v, O, Lse, scale, causal_diag(causal, Nq, Nk),
           fit._device_mask(M), *drop, label="FA2 tensor-core forward")
    return O, Lse



def backward(q, k, v, o, lse, do, *, causal=False, scale, Br=None, Bc=None, warps=None, storage=None, dropout_p=0.0,
             seed=None, dropout_at=None, block_mask=None, score_mod=None, mask_mod=None, heads=1,
             score_mod_grad=None):
    """FA2 Alg. 2 on tensor cores: the product kernel's preprocessing launch (``D = rowsum(dO∘O)``, the float32 dQ
    accumulator zeroed), the main launch (one block per K/V tile), and for half storage dQ narrowed (the product
    kernel's convert launch).
    Device arrays in q's storage (``lse`` float32); gradients out in it.  sm_80 and newer (ValueError naming the
    architecture on sm_75).  ``k``, ``v`` may have fewer batch·heads than ``q`` (GQA/MQA): dK, dV have theirs.
    ``dropout_p``, ``seed``, ``dropout_at``: the forward's (its mask is regenerated, never stored); ``block_mask``,
    ``score_mod``, ``mask_mod``, ``heads``: the forward's, and ``score_mod_grad`` (default ``score_mod.grad``, else
    derived from its source: :func:`flashnb.flex_grad.derivative`)."""
    storage = check_inputs(storage, q=q, k=k, v=v, o=o, do=do)
    drop = policies.dropout_args(dropout_p, seed, dropout_at)
    mma.check_arch("fa2-tc backward", ARCHS[80])
    global last_backward
    BH, Nq, d = q.shape
    Nk = k.shape[1]
    G = policies.gqa_group(BH, k, v)
    given = {n: x for n, x in (("Br", Br), ("Bc", Bc), ("warps", warps)) if x is not None}
    optin = shared_optin_limit()

    def plan(static=False):                          # (tiles, M): validated, fitted to the block mask
        t0 = _bwd_tiles(storage, d, Br, Bc, warps, G > 1, optin, static)
        t1, M1 = _fit_mask("backward", d, t0, given, block_mask, BH, Nq, Nk)
        return _bwd_tiles(storage, d, t1["Br"], t1["Bc"], t1["warps"], G > 1, optin), M1

    fallback = None
    try:
        t, M = plan()
    except ValueError as exc:                        # default tiles over this device's opt-in limit
        if given or not bwd_needs_dynamic(storage, d, **bwd_default_tiles(d, storage, G > 1)) \
                or "opt-in limit" not in str(exc):
            raise
        (t, M), fallback = plan(static=True), str(exc)
    bm_mod, H = _modifier_config(score_mod, mask_mod, block_mask, heads, BH, True)
    if score_mod is not None and score_mod_grad is None:
        score_mod_grad = policies.score_mod_grad_of(score_mod)   # score_mod.grad, else derived from its source

    def build(t, M):                                 # the kernel of these tiles (mask_mod: only for PARTIAL tiles)
        partial = M is not None and (M == PARTIAL).any()
        return tc_backward.make_backward(t["Br"], t["Bc"], d, t["warps"], bool(causal), storage, G > 1,
                                         drop is not policies.NO_DROPOUT, M is not None, score_mod,
                                         bm_mod if partial else None, H,
                                         score_mod_grad if score_mod is not None else None, dynamic=t["dynamic"])

    D, dQ = preprocess(o, do, storage)                # line 4 and the float32 dQ accumulator (as the product's)
    dK = empty((BH // G, Nk, d), storage=storage)
    dV = empty((BH // G, Nk, d), storage=storage)
    kernel = build(t, M)
    nbytes = _bwd_dynamic_bytes(d=d, storage=storage, **t)
    if t["dynamic"]:
        refused = opt_in_or_fall_back("fa2-tc backward", kernel, tc_backward._bwd_sig(storage), nbytes, t, d,
                                      bool(given), allow_dynamic_shared)
        if refused:
            fallback = refused
            t, M = plan(static=True)
            nbytes = 0
            kernel = build(t, M)
    if fallback:
        warn_fallback("fa2-tc backward", d, fallback, t)
    last_backward = dict(d=d, Br=t["Br"], Bc=t["Bc"], warps=t["warps"], dynamic=t["dynamic"],
                         shared_bytes=bwd_shared_bytes(storage, d, t["Br"], t["Bc"], t["warps"]), fallback=fallback)
    launch(kernel, (cdiv(Nk, t["Bc"]), BH // G), 32 * t["warps"], q, k, v, do, lse, D, dQ, dK, dV, scale,
           causal_diag(causal, Nq, Nk), fit._device_mask(M), *drop, label=BWD_LABEL, shared=nbytes)
    return convert_dq(dQ, storage), dK, dV



register_impl("fa2-tc", stage="7",
              description="FA2 forward and backward on tensor cores: mma.sync fed by ldmatrix and cp.async, swizzled "
                          "shared memory; float16/bfloat16, float32 through TF32",
              forward=forward, backward=backward,
              options=("Br", "Bc", "warps", "storage", "dropout_p", "seed", "dropout_at", "block_mask", "score_mod",
                       "mask_mod", "score_mod_grad"), precision="tf32",
              gqa=True, mask_tiles=lambda d, Br=None, Bc=None: _mask_tiles(d, Br, Bc),
              models="flashnb.kernels.models.tensorcore")

