"""Two registries that let a stage plug in without touching the others.

* :data:`KERNELS` -- every ``@cuda.jit`` kernel in the package, as a *kernel factory* (a function of
  compile-time constants such as tile sizes that returns a kernel) together with its launch signature and
  the configurations the PTX guard compiles.  ``tests/test_ptx_guard.py`` checks that no kernel in the
  source tree is missing from it.
* :data:`IMPLS` -- the implementations behind ``flashnb.attention(..., impl=NAME)``.

Both are filled by decorators at import time of the stage modules.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

__all__ = ["KernelSpec", "Impl", "KERNELS", "IMPLS", "kernel_factory", "register_impl"]


@dataclass
class KernelSpec:
    """A kernel factory and what is needed to compile it without a GPU."""

    name: str
    stage: str
    factory: Callable[..., Any]
    signature: str | Callable[..., str]
    configs: list[dict] = field(default_factory=lambda: [{}])
    threads: int | Callable[..., int] | None = None  # threads per block (int or f(**config)); for occupancy

    def signature_for(self, config: dict) -> str:
        sig = self.signature
        return sig(**config) if callable(sig) else sig

    def threads_for(self, config: dict) -> int | None:
        """Threads per block the launcher uses with ``config`` (None when the spec does not say)."""
        t = self.threads
        return int(t(**config)) if callable(t) else (None if t is None else int(t))

    def instances(self):
        """Yield ``(config, kernel, signature)`` for every configuration the guard compiles."""
        for config in self.configs:
            yield config, self.factory(**config), self.signature_for(config)


KERNELS: dict[str, KernelSpec] = {}


def kernel_factory(name: str, *, stage: str, signature, configs=None, threads=None):
    """Register a kernel factory; the factory is memoised so each configuration compiles once.

    ``signature`` is the Numba signature string the kernel is launched with (or a function of the
    configuration returning it); ``configs`` are keyword-argument dicts covering every code path the
    guard must compile (e.g. ``causal`` True and False, the smallest and largest head dim).
    ``threads`` (optional) is the block size the launcher uses -- an int or a function of the
    configuration -- so ``flashnb inspect`` can work out occupancy.
    """

    def decorate(factory):
        signature_of = inspect.signature(factory)
        memo = functools.lru_cache(maxsize=None)(lambda items: factory(**dict(items)))

        @functools.wraps(factory)
        def cached(*args, **kwargs):
            # canonical key: make_x(16, True) and make_x(T=16, trans=True) are one kernel, compiled once
            bound = signature_of.bind(*args, **kwargs)
            bound.apply_defaults()
            return memo(tuple(bound.arguments.items()))

        cached.cache_info = memo.cache_info
        if name in KERNELS:
            raise ValueError(f"kernel {name!r} registered twice")
        KERNELS[name] = KernelSpec(name, stage, cached, signature, list(configs or [{}]), threads)
        return cached

    return decorate


@dataclass
class Impl:
    """One attention implementation: device-array forward/backward plus a description for the tour.

    ``forward(q, k, v, *, causal, scale, **options) -> (o, lse)`` and
    ``backward(q, k, v, o, lse, do, *, causal, scale, **options) -> (dq, dk, dv)`` take and return
    float32 device arrays of shape ``(BH, N, d)`` (``lse``: ``(BH, Nq)``).
    """

    name: str
    stage: str
    description: str
    forward: Callable[..., Any]
    backward: Callable[..., Any] | None = None
    options: tuple[str, ...] = ()
    reference_mask: Callable[..., Any] | None = None

    def mask_for(self, Nq: int, Nk: int, d: int, causal: bool, **options):
        """The boolean (Nq, Nk) mask this impl applies beyond ``causal`` (None: dense attention), so it can
        be checked against ``flashnb.reference.attention_forward(..., mask=...)``."""
        return None if self.reference_mask is None else self.reference_mask(Nq, Nk, d, causal, **options)

    def flops(self, B: int, H: int, Nq: int, Nk: int, d: int, causal: bool, direction: str = "forward") -> float:
        """FLOPs by the FlashAttention benchmark formula (forward ``4·B·H·Nq·Nk·d``, halved when causal;
        backward 2.5x).  For an impl with a :meth:`mask_for` mask, the pairs it skips are not counted:
        ``4·B·H·d·(allowed pairs)``."""
        from . import roofline

        fn = roofline.flops_forward if direction in ("forward", "fwd") else roofline.flops_backward
        mask = self.mask_for(Nq, Nk, d, causal)
        if mask is None:
            return fn(B, H, Nq, Nk, d, causal)
        if causal:
            from .common import causal_diag

            i = np.arange(Nq)[:, None]
            mask = mask & (np.arange(Nk)[None, :] <= i + causal_diag(causal, Nq, Nk))
        return fn(B, H, Nq, Nk, d, False) * float(np.count_nonzero(mask)) / (Nq * Nk)


IMPLS: dict[str, Impl] = {}


def register_impl(name: str, *, stage: str, description: str, forward, backward=None, options=(),
                  reference_mask=None):
    """Make ``impl=name`` available in the public API, the tour and the benchmarks.

    ``reference_mask(Nq, Nk, d, causal, **options)`` is for impls that do not compute dense attention
    (block-sparse ones): it returns the element mask they apply, for checking against the reference.
    """
    if name in IMPLS:
        raise ValueError(f"impl {name!r} registered twice")
    IMPLS[name] = Impl(name, stage, description, forward, backward, tuple(options), reference_mask)
    return IMPLS[name]
