"""``ring_attention``: context-parallel attention as a differentiable torch function.

Each rank calls it with its own shards (:func:`flashnb.distributed.shard`); the ranks check their arguments
together (:mod:`flashnb.distributed.errors`), run the forward schedule of :mod:`flashnb.distributed.ring`, and
the autograd backward runs the backward schedule from the saved ``(q, k, v, O, L)`` -- what FlashAttention
saves on one device, per shard.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..reference import check_scale
from ..rng import check_dropout
from .blocks import resolve_impl
from .errors import agree, check_agreement, describe
from .layouts import check_layout, check_split
from .ring import SCHEDULES, RingConfig
from .stats import RingStats

__all__ = ["ring_attention", "RingAttentionFunction", "MODES"]

MODES = tuple(SCHEDULES)


class RingAttentionFunction(torch.autograd.Function):
    """``o = RingAttentionFunction.apply(q, k, v, cfg)`` for a :class:`~flashnb.distributed.ring.RingConfig`
    (use :func:`ring_attention`).  Saves q, k, v, O and L of the rank's shard; the backward runs once."""

    @staticmethod
    def forward(ctx, q, k, v, cfg):
        schedule = (cfg.schedule or SCHEDULES[cfg.mode])(cfg)
        o, lse = schedule.forward(q, k, v)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.schedule = schedule
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.schedule.backward(q, k, v, o, lse, do.to(torch.float32).contiguous())
        return dq, dk, dv, None


def _timeout(timeout) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=float(timeout))
    raise TypeError(f"timeout must be None (the process group's), a datetime.timedelta or seconds > 0, got {timeout!r}")


def _local_checks(q, k, v, *, causal, layout, mode, impl, scale, stats, dropout_p, seed, world):
    """This rank's own argument checks; returns ``(impl, scale, dropout)`` or raises ValueError / TypeError /
    NotImplementedError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (this rank's shard), got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or 0 in t.shape:
            raise ValueError(f"{name} must be this rank's shard of shape (B, H, N/W, d) with every axis >= 1, "
                             f"got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (flashnb's kernels compute in float32), got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous (strides {t.stride()} for shape {tuple(t.shape)}): "
                             f"torch.distributed sends only contiguous tensors; pass {name}.contiguous()")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape (B, H_kv, N/W, d), got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    B, H, n, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, n, d):
        raise ValueError(f"k and v must hold the same tokens, batch and head dim as q (B, ·, N/W, d) = "
                         f"({B}, ·, {n}, {d}), got k {tuple(k.shape)}")
    if H % k.shape[1]:
        raise ValueError(f"grouped-query attention: q's heads ({H}) must be a multiple of k's and v's ({k.shape[1]})")
    if not isinstance(causal, (bool,)):
        raise TypeError(f"causal must be True or False (global positions: key <= query), got {causal!r}")
    check_layout(layout)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    try:
        check_split(n * world, layout, world)
    except ValueError as e:
        raise ValueError(f"the shards hold n = {n} tokens per rank, so N = n·W = {n * world}: {e}") from None
    if stats is not None and not isinstance(stats, RingStats):
        raise TypeError(f"stats must be None or a flashnb.distributed.RingStats, got {type(stats).__name__}")
    block = resolve_impl(impl)
    block.check(grouped=k.shape[1] != H)
    s = check_scale(scale, d)
    p = check_dropout(dropout_p, seed)
    if p > 0 and not getattr(block, "dropout", False):
        raise NotImplementedError(f"dropout_p={dropout_p!r} with impl {block!r}: dropout keyed by global row and "
                                  "column needs kernels whose Philox counter takes the block's global positions "
                                  "(impl='flash', the default, through its dropout_at option); use impl='flash', "
                                  "impl=Exact(), or dropout_p=0")
    return block, s, ((p, int(seed)) if p > 0 else None)


def _prepare(q, k, v, *, causal, layout, mode, group, impl, scale, stats, dropout_p, seed, timeout,
             schedule=None) -> RingConfig:
    """The ranks' agreed :class:`RingConfig`, or the same error on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attention needs torch.distributed: call torch.distributed.init_process_group "
                           "first (backend 'gloo' on CPU, 'nccl' on GPUs; torchrun sets up the rest)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    wait = _timeout(timeout)
    error, block, s, drop = None, None, None, None
    try:
        block, s, drop = _local_checks(q, k, v, causal=causal, layout=layout, mode=mode, impl=impl, scale=scale,
                                       stats=stats, dropout_p=dropout_p, seed=seed, world=world)
    except (ValueError, TypeError, NotImplementedError) as e:
        error = e
    config = dict(causal=causal if isinstance(causal, bool) else repr(causal), layout=repr(layout), mode=repr(mode),
                  scale=s, impl=repr(block), dropout=None if drop is None else list(drop))
    info = describe(error, dict(q=q, k=k, v=v), config)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = q.device if isinstance(q, torch.Tensor) and q.is_cuda else torch.device("cuda",
                                                                                          torch.cuda.current_device())
    check_agreement(agree(info, group=group, world=world, device=device, timeout=wait))
    return RingConfig(causal=causal, layout=layout, mode=mode, group=group, rank=rank, world=world,
                      N=q.shape[2] * world, impl=block, scale=s, stats=stats, timeout=wait, dropout=drop,
                      schedule=schedule)


def ring_attention(q, k, v, *, causal=False, layout="zigzag", mode="ring", group=None, impl=None, scale=None,
                   stats=None, dropout_p=0.0, seed=None, timeout=None):
    """Attention of this rank's queries against the whole sequence, its K/V spread over the ranks of ``group``.

    Every rank of ``group`` (default: the whole world) calls it at the same time with its own shards.

    Args:
        q: ``(B, H, N/W, d)`` float32, contiguous: this rank's queries, in ``layout``'s order
            (:func:`flashnb.distributed.shard`).
        k, v: ``(B, H_kv, N/W, d)``, the same tokens' keys and values; ``H_kv`` divides ``H`` (grouped-query
            attention: the smaller K/V travels).
        causal: a causal mask of global positions (key ≤ query).
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (:mod:`flashnb.distributed.layouts`); N/W must
            be what the layout splits (zigzag: two equal chunks per rank).
        mode: ``"ring"`` (K/V pass one hop per step, posted before the step's compute; the backward sends
            dK/dV along with their K/V and home) or ``"allgather"`` (K/V gathered once).
        group: a ``torch.distributed`` process group (default: the world).
        impl: the block computation: None (``Kernels("flash")``: flashnb's product kernel, on the simulator for CPU
            tensors and the GPU for CUDA tensors), a registered impl name, ``Kernels(name, **tile_options)``, or
            ``"exact"`` / ``Exact()`` (float64, for tests and notebooks).
        scale: softmax scale, default ``1/sqrt(d)``.
        stats: a :class:`~flashnb.distributed.RingStats` to record each step's bytes, pairs and times into.
        dropout_p, seed: attention dropout keyed by ``(seed, batch·head, global row, global column)``, so a ring
            draws exactly the mask one device draws for the whole sequence (:mod:`flashnb.rng`).  The product
            kernel (``"flash"``, the default) and ``Exact()`` have it; other impls raise NotImplementedError for
            ``dropout_p > 0``.
        timeout: seconds (or a timedelta) any one transfer may take; default: the process group's timeout.

    Returns ``o``, ``(B, H, N/W, d)`` float32, differentiable with respect to q, k and v.

    Raises, on every rank and before any ring step: ValueError / TypeError (shards of different shapes across
    ranks, a shard length the layout cannot split, a non-contiguous tensor, arguments that differ between
    ranks), NotImplementedError (dropout with an impl that cannot key it globally); during the ring,
    :class:`~flashnb.distributed.RingCommError` / :class:`~flashnb.distributed.RingTimeout` naming the phase,
    step and peer.
    """
    return _ring_attention(q, k, v, causal=causal, layout=layout, mode=mode, group=group, impl=impl, scale=scale,
                           stats=stats, dropout_p=dropout_p, seed=seed, timeout=timeout)


def _ring_attention(q, k, v, *, schedule=None, **kwargs):
    """:func:`ring_attention` with ``schedule``, a :class:`~flashnb.distributed.ring.RingSchedule` subclass in
    place of the mode's (notebook 13 runs a wrong one this way)."""
    cfg = _prepare(q, k, v, schedule=schedule, **kwargs)
    return RingAttentionFunction.apply(q, k, v, cfg)
