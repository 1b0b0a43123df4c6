"""Two registries that let a stage plug in without touching the others.

* :data:`KERNELS` -- every ``@cuda.jit`` kernel in the package, as a *kernel factory* (a function of
  compile-time constants such as tile sizes that returns a kernel) together with its launch signature and
  the configurations the PTX guard compiles.  ``tests/instruments/test_ptx_guard.py`` checks that no kernel in the
  source tree is missing from it.
* :data:`IMPLS` -- the implementations behind ``flashnb.attention(..., impl=NAME)``.

Both are filled by decorators at import time of the modules that define them, and both are filled *on demand*:
``import flashnb`` imports none of those modules.  Asking for one impl (``IMPLS["fa2"]``, :func:`impl_entry`)
imports the module :data:`IMPL_MODULES` names for it; listing a registry (iterating it, ``len``, ``in`` with a name
not yet there, ``keys``/``values``/``items``) first imports every module in :data:`MODULES`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

__all__ = ["KernelSpec", "Impl", "KERNELS", "IMPLS", "AUTO", "impl_entry", "impl_names", "kernel_factory",
           "register_impl", "register_auto", "variant", "using", "KERNEL_CACHE_SIZE", "IMPL_MODULES", "MODULES"]

#: The module(s) that register each impl, imported the first time the impl is asked for: the stage's lesson, or
#: the product kernels' host launchers (:mod:`flashnb.kernels.launch`).
IMPL_MODULES: dict[str, tuple[str, ...]] = {
    "naive": ("flashnb.stages.naive",),
    "onepass": ("flashnb.stages.softmax",),
    "fa1": ("flashnb.stages.fa1",),
    "fa2": ("flashnb.stages.fa2",),
    "fa2-rows": ("flashnb.stages.fa2_steps",),
    "fa2-splitq": ("flashnb.stages.fa2_steps",),
    "fa2-sparse": ("flashnb.stages.block_sparse",),
    "fa2-fast": ("flashnb.stages.fa2_fast",),
    "flash": ("flashnb.kernels.launch.flash",),
    "fa2-tc": ("flashnb.kernels.launch.tensorcore",),
    "flash-decoding": ("flashnb.kernels.launch.decode",),
    "auto": ("flashnb.kernels.auto",),
}

#: Every module that registers kernels or impls, in the order a listing imports them (and lists what they
#: register): the stages' lessons, then the product kernels, then the instruments' own kernels.
MODULES: tuple[str, ...] = (
    "flashnb.rng", "flashnb.stages.naive", "flashnb.stages.softmax", "flashnb.stages.fa1", "flashnb.stages.fa2",
    "flashnb.stages.fa2_steps", "flashnb.stages.block_sparse", "flashnb.kernels.launch.flash",
    "flashnb.kernels.launch.tensorcore", "flashnb.kernels.tensorcore.check", "flashnb.kernels.auto", "flashnb.flex",
    "flashnb.stages.fa2_fast", "flashnb.stages.fa2_fast_steps", "flashnb.stages.tensor_cores",
    "flashnb.kernels.decode",
    "flashnb.kernels.launch.decode", "flashnb.instruments.bench",
)

_LOADING = [False]   # a listing's imports under way (either registry): a listing made meanwhile sees what is there


class _OnDemand(dict):
    """A registry that imports what fills it when asked: one name (``[name]``, ``get``) imports the modules
    ``modules_of(name)`` returns (all of :data:`MODULES` for a name it does not know); a listing imports all of
    :data:`MODULES` first, then keeps their order (what ``order_of`` says for each entry).  Registration writes
    through ``dict`` itself, so a module being imported never triggers more imports."""

    def __init__(self, modules_of, order_of):
        super().__init__()
        self._modules_of, self._order_of = modules_of, order_of
        self._complete = False

    @staticmethod
    def _import(modules) -> None:
        import importlib

        for module in modules:
            importlib.import_module(module)

    def load_all(self) -> None:
        """Import every module of :data:`MODULES` (once), then order the entries as those modules list them.  A
        listing made while they are being imported sees what is registered so far."""
        if self._complete or _LOADING[0]:
            return
        _LOADING[0] = True
        try:
            self._import(MODULES)
        finally:
            _LOADING[0] = False
        rank = {module: i for i, module in enumerate(MODULES)}
        entries = sorted(dict.items(self), key=lambda item: rank.get(self._order_of(item[1]), len(rank)))
        dict.clear(self)
        dict.update(self, entries)
        self._complete = True

    def _load(self, name) -> None:
        if not dict.__contains__(self, name):
            modules = self._modules_of(name)
            self._import(modules) if modules else self.load_all()

    def __getitem__(self, name):
        self._load(name)
        return dict.__getitem__(self, name)

    def get(self, name, default=None):
        self._load(name)
        return dict.get(self, name, default)

    def __contains__(self, name):
        self._load(name)
        return dict.__contains__(self, name)

    def __iter__(self):
        self.load_all()
        return dict.__iter__(self)

    def __len__(self):
        self.load_all()
        return dict.__len__(self)

    def keys(self):
        self.load_all()
        return dict.keys(self)

    def values(self):
        self.load_all()
        return dict.values(self)

    def items(self):
        self.load_all()
        return dict.items(self)

    def __repr__(self):
        self.load_all()
        return dict.__repr__(self)


def _module_prefix(module: str) -> str:
    """The :data:`MODULES` entry that registers what ``module`` defines (``flashnb.kernels.flash`` ->
    ``flashnb.kernels``)."""
    return module if module in MODULES or "." not in module else _module_prefix(module.rsplit(".", 1)[0])


@dataclass
class KernelSpec:
    """A kernel factory and what is needed to compile it without a GPU."""

    name: str
    stage: str
    factory: Callable[..., Any]
    signature: str | Callable[..., str]
    configs: list[dict] = field(default_factory=lambda: [{}])
    threads: int | Callable[..., int] | None = None  # threads per block (int or f(**config)); for occupancy
    dynamic_shared: int | Callable[..., int] | None = None  # dynamic shared bytes per block at launch (f(**config))
    archs: tuple | Callable[..., tuple] | None = None  # compute capabilities it compiles for (None: every one)

    def signature_for(self, config: dict) -> str:
        sig = self.signature
        return sig(**config) if callable(sig) else sig

    def threads_for(self, config: dict) -> int | None:
        """Threads per block the launcher uses with ``config`` (None when the spec does not say)."""
        t = self.threads
        return int(t(**config)) if callable(t) else (None if t is None else int(t))

    def dynamic_shared_for(self, config: dict) -> int:
        """Bytes of *dynamic* shared memory the launcher gives a block of this configuration (0: none)."""
        n = self.dynamic_shared
        return int(n(**config)) if callable(n) else int(n or 0)

    def archs_for(self, config: dict) -> tuple | None:
        """The compute capabilities ``config`` supports, ascending (e.g. ``((8, 0), (9, 0))``: tensor-core
        instructions of sm_80), or None when it runs on every architecture flashnb targets."""
        a = self.archs
        a = a(**config) if callable(a) else a
        return None if a is None else tuple(sorted(tuple(cc) for cc in a))

    def supports(self, config: dict, cc) -> bool:
        archs = self.archs_for(config)
        return archs is None or tuple(cc) in archs

    def check_arch(self, config: dict, cc) -> None:
        """ValueError naming the architecture when ``config`` does not compile for ``cc``."""
        if not self.supports(config, cc):
            names = ", ".join(f"sm_{a[0]}{a[1]}" for a in self.archs_for(config))
            raise ValueError(f"kernel {self.name!r} with config {config} compiles for {names} only, not for "
                             f"sm_{cc[0]}{cc[1]}: it uses instructions that architecture does not have")

    def instances(self):
        """Yield ``(config, kernel, signature)`` for every configuration the guard compiles."""
        for config in self.configs:
            yield config, self.factory(**config), self.signature_for(config)


def _kernel_modules(name: str) -> tuple[str, ...]:
    """A kernel's name does not say its module: every module is imported (an empty tuple: all of them)."""
    return ()


def _kernel_module(spec) -> str:
    return _module_prefix(getattr(spec.factory, "__module__", ""))


KERNELS: dict[str, KernelSpec] = _OnDemand(_kernel_modules, _kernel_module)

#: Kernels each factory keeps (least recently used dropped first): a configuration used again after that many
#: others is built again (on a GPU: compiled again).  Attention modifiers make configurations without bound --
#: one kernel per distinct captured array on a GPU, e.g. ``flex.document(ids)`` with new ids every batch -- so
#: the cache is bounded; flashnb's own configurations number a few dozen per factory.
KERNEL_CACHE_SIZE = 128


def _memoised(factory):
    """``factory`` memoised on its bound arguments: make_x(16, True) and make_x(T=16, trans=True) are one
    kernel, compiled once (the :data:`KERNEL_CACHE_SIZE` most recently used are kept)."""
    signature_of = inspect.signature(factory)
    memo = functools.lru_cache(maxsize=KERNEL_CACHE_SIZE)(lambda items: factory(**dict(items)))

    @functools.wraps(factory)
    def cached(*args, **kwargs):
        bound = signature_of.bind(*args, **kwargs)
        bound.apply_defaults()
        return memo(tuple(bound.arguments.items()))

    cached.cache_info = memo.cache_info
    return cached


def kernel_factory(name: str, *, stage: str, signature, configs=None, threads=None, dynamic_shared=None,
                   archs=None):
    """Register a kernel factory; the factory is memoised so each configuration compiles once.

    ``signature`` is the Numba signature string the kernel is launched with (or a function of the
    configuration returning it); ``configs`` are keyword-argument dicts covering every code path the
    guard must compile (e.g. ``causal`` True and False, the smallest and largest head dim).
    ``threads`` (optional) is the block size the launcher uses -- an int or a function of the
    configuration -- so ``flashnb inspect`` can work out occupancy.  ``dynamic_shared`` (optional; an int or a
    function of the configuration) is the dynamic shared memory per block the launcher asks for: the PTX guard
    checks it against each architecture's opt-in limit, and occupancy counts it.  ``archs`` (optional; a tuple of
    compute capabilities or a function of the configuration returning one): the architectures the kernel compiles
    for, when not all of them (tensor-core instructions): the PTX guard compiles each configuration for those,
    and compiling it for another is a ValueError naming the architecture.
    """

    def decorate(factory):
        cached = _memoised(factory)
        if dict.__contains__(KERNELS, name):
            raise ValueError(f"kernel {name!r} registered twice")
        KERNELS[name] = KernelSpec(name, stage, cached, signature, list(configs or [{}]), threads, dynamic_shared,
                                   archs)
        return cached

    return decorate


@dataclass
class Impl:
    """One attention implementation: device-array forward/backward plus a description for the tour.

    ``forward(q, k, v, *, causal, scale, **options) -> (o, lse)`` and
    ``backward(q, k, v, o, lse, do, *, causal, scale, **options) -> (dq, dk, dv)`` take and return
    float32 device arrays of shape ``(BH, N, d)`` (``lse``: ``(BH, Nq)``).  An impl whose ``options`` include
    ``"storage"`` also takes and returns them in half precision (``storage="float16"``/``"bfloat16"``;
    ``lse`` stays float32): the API sends half inputs only to such impls.
    """

    name: str
    stage: str
    description: str
    forward: Callable[..., Any]
    backward: Callable[..., Any] | None = None
    options: tuple[str, ...] = ()
    reference_mask: Callable[..., Any] | None = None
    gqa: bool = False   # takes K, V with fewer batch·heads than Q (grouped-/multi-query attention)
    # an impl whose kernels take ``mask_mod`` only through its block mask: ``mask_tiles(d, Br=, Bc=) -> dict(Br, Bc)``,
    # the tiles the user surfaces build that block mask at (flashnb.flex.create_block_mask), after checking the
    # modifiers for a GPU (flashnb.flex.check_modifiers); None: the impl does both itself
    mask_tiles: Callable[..., dict] | None = None
    precision: str = "float32"   # what float32 inputs' matmuls run in: "float32" (CUDA cores) or "tf32" (tensor cores)
    # the module holding the traffic models (``model_forward``, ``model_backward``) when it is not the launcher's
    # own: named, not imported, so a launcher never imports the models built on top of it
    models: str | None = None

    def mask_for(self, Nq: int, Nk: int, d: int, causal: bool, **options):
        """The boolean (Nq, Nk) mask this impl applies beyond ``causal`` (None: dense attention), so it can
        be checked against ``flashnb.reference.attention_forward(..., mask=...)``."""
        return None if self.reference_mask is None else self.reference_mask(Nq, Nk, d, causal, **options)

    def flops(self, B: int, H: int, Nq: int, Nk: int, d: int, causal: bool, direction: str = "forward") -> float:
        """FLOPs by the FlashAttention benchmark formula (forward ``4·B·H·Nq·Nk·d``, halved when causal;
        backward 2.5x).  For an impl with a :meth:`mask_for` mask, the pairs it skips are not counted:
        ``4·B·H·d·(allowed pairs)``."""
        fn = flops_forward if direction in ("forward", "fwd") else flops_backward
        mask = self.mask_for(Nq, Nk, d, causal)
        if mask is None:
            return fn(B, H, Nq, Nk, d, causal)
        if causal:
            from .common import causal_diag

            i = np.arange(Nq)[:, None]
            mask = mask & (np.arange(Nk)[None, :] <= i + causal_diag(causal, Nq, Nk))
        return fn(B, H, Nq, Nk, d, False) * float(np.count_nonzero(mask)) / (Nq * Nk)


def _impl_module(entry) -> str:
    modules = IMPL_MODULES.get(entry.name)
    return _module_prefix(modules[0]) if modules else ""


# --------------------------------------------------------------------------- FLOPs (Impl.flops; roofline plots them)


def _check_dims(**dims):
    for k, v in dims.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive int, got {v!r}")


def flops_forward(B: int, H: int, Nq: int, Nk: int, d: int, causal: bool = False) -> float:
    """Forward FLOPs by the FlashAttention benchmark convention: ``4·B·H·Nq·Nk·d`` (two matmuls, QKᵀ and
    PV, at 2 FLOP per multiply-add), halved when causal (about half the scores are masked; exact for
    Nq = Nk up to the diagonal).  Softmax FLOPs are not counted."""
    _check_dims(B=B, H=H, Nq=Nq, Nk=Nk, d=d)
    f = 4.0 * B * H * Nq * Nk * d
    return f / 2 if causal else f


def flops_backward(B: int, H: int, Nq: int, Nk: int, d: int, causal: bool = False) -> float:
    """Backward FLOPs: 2.5 x forward (five matmuls to the forward's two; benchmark_flash_attention.py)."""
    return 2.5 * flops_forward(B, H, Nq, Nk, d, causal)


IMPLS: dict[str, Impl] = _OnDemand(lambda name: IMPL_MODULES.get(name, ()), _impl_module)

#: The default impl's name: not an implementation of its own but a choice among them, made at each launch
#: (:mod:`flashnb.kernels.auto`), so it is kept out of :data:`IMPLS` (which the tour, tests and benchmarks walk).
AUTO = "auto"
_AUTO: list = []


def register_auto(entry: Impl) -> None:
    """Install the entry ``impl="auto"`` resolves to (:mod:`flashnb.kernels.auto`)."""
    _AUTO[:] = [entry]


def impl_entry(name: str) -> Impl | None:
    """The :class:`Impl` of ``name``: a registered impl, or ``"auto"``; None for an unknown name."""
    if name == AUTO:
        if not _AUTO:
            IMPLS._import(IMPL_MODULES[AUTO])     # flashnb.kernels.auto registers it
        return _AUTO[0] if _AUTO else None
    return IMPLS.get(name) if isinstance(name, str) else None


def impl_names() -> list[str]:
    """Every name ``impl=`` takes: ``"auto"`` (the default), then the registered impls."""
    return [AUTO] + sorted(IMPLS)


def _per_head_chunks(fn):
    """``fn`` (an impl's forward or backward on ``(BH, N, d)`` device arrays), run on slices of at most
    ``common.MAX_GRID[1]`` (65,535) batch·heads when there are more: the kernels put batch·heads on gridDim.y
    (gridDim.z for the naive matmuls), which CUDA caps there.  The kernels stay as they are; each slice is one
    set of launches, and its outputs are copied into the full ones."""
    import functools

    @functools.wraps(fn)
    def run(*arrays, **options):
        from . import common

        BH, limit = arrays[0].shape[0], common.MAX_GRID[1]
        if BH <= limit:
            return fn(*arrays, **options)
        if arrays[1].shape[0] != BH:
            raise ValueError(f"batch·heads = {BH:,} is over {limit:,} (CUDA's gridDim.y limit) with grouped-query "
                             "K/V: split the batch yourself")
        if options.get("dropout_p"):
            raise ValueError(f"batch·heads = {BH:,} is over {limit:,} (CUDA's gridDim.y limit) with dropout: the mask "
                             "is keyed by the batch·head index, which slices would restart; run slices of at most "
                             f"{limit:,} batch·heads yourself, each with its own seed")
        if options.get("block_mask") is not None:
            raise ValueError(f"batch·heads = {BH:,} is over {limit:,} (CUDA's gridDim.y limit) and a block_mask is "
                             "given: split the batch yourself (a per-head mask would have to be split with it)")
        outs = None
        for z in range(0, BH, limit):
            part = fn(*(a[z:z + limit] for a in arrays), **options)
            if outs is None:
                outs = [common.empty((BH,) + p.shape[1:], storage=common.storage_of(p) or "float32") for p in part]
            for full, p in zip(outs, part):
                full[z:z + p.shape[0]].copy_to_device(p)
        return tuple(outs)

    return run


def register_impl(name: str, *, stage: str, description: str, forward, backward=None, options=(),
                  reference_mask=None, gqa=False, mask_tiles=None, precision="float32", models=None):
    """Make ``impl=name`` available in the public API, the tour and the benchmarks.

    ``reference_mask(Nq, Nk, d, causal, **options)`` is for impls that do not compute dense attention
    (block-sparse ones): it returns the element mask they apply, for checking against the reference.
    ``gqa``: the impl takes K, V with fewer batch·heads than Q (grouped-query attention: query head ``z`` uses
    K/V head ``z // G``).  ``mask_tiles``: see :class:`Impl` (the user surfaces then check an impl's modifiers and
    build a ``mask_mod``'s block mask before calling it, so its kernels never call back into :mod:`flashnb.flex`).
    K/V head ``z // G``).  ``precision``: ``"tf32"`` for an impl whose float32 inputs go through TF32 tensor cores
    (10-bit mantissas: errors ~1e-3 where float32 gives ~1e-6; tests and the tour hold it to TF32's tolerance).
    ``models``: the name of the module with the impl's traffic models (``model_forward``, ...), when they do not
    live beside its launchers (``flashnb bench`` and the tour look there).
    """
    if dict.__contains__(IMPLS, name):
        raise ValueError(f"impl {name!r} registered twice")
    forward = _per_head_chunks(forward)
    backward = _per_head_chunks(backward) if backward is not None else None
    if precision not in ("float32", "tf32"):
        raise ValueError(f"precision must be 'float32' or 'tf32', got {precision!r}")
    IMPLS[name] = Impl(name, stage, description, forward, backward, tuple(options), reference_mask, bool(gqa),
                       mask_tiles, precision, models)
    return IMPLS[name]


# --------------------------------------------------------------------------- variants (for experiments)


def _spec_of(factory) -> KernelSpec | None:
    return next((spec for spec in KERNELS.values() if spec.factory is factory), None)


def variant(factory, *, region: str | None = None, replace=(), regions: dict | None = None,
            source: str | None = None, names: dict | None = None, filename: str | None = None):
    """A modified copy of a registered kernel factory, for experiments and exercises.

    A stage kernel names the lines worth changing with region markers (``# region kv-barrier`` ...
    ``# endregion kv-barrier``: :mod:`flashnb.regions`; a function defined in the factory is a region too, by
    its name).  ``regions={"causal-skip": new_body}`` replaces the body of each region named (the markers
    stay; a body written without indentation is indented like the region).  ``region="online-update",
    replace=(old, new)`` replaces ``old`` by ``new`` where it occurs, exactly once, inside that region;
    ``replace`` may be a list of pairs.  ``regions`` are applied first, then ``replace``.  Without ``region``,
    each ``old`` must occur exactly once in the factory's whole source (what :func:`flashnb.notebook.show_source`
    prints).  ``show_source(factory, region=name)`` prints a region's lines.  ``source`` instead gives the whole
    edited ``def`` of the factory.  ``factory`` may itself be a variant: its source is the starting point.

    The result is compiled in the namespace of the factory's module (so ``NEG_INF``, ``load_tile``, ...
    resolve as in the original), memoised like the original, and registered nowhere: the original keeps its
    registration and the PTX guard its coverage.  Its source is kept in ``linecache`` under ``<variant of
    module.name>``, so tracebacks, the traffic counter's shared-array names, the sanitizer's line numbers and
    ``inspect.getsource`` work on it.  Use it with the library's own launchers through :func:`using`.
    ``names`` replaces names of the module's namespace for this variant only (e.g. ``names={"merge_state":
    my_merge}`` makes it call your device function); ``filename`` names its source in tracebacks and reports
    (default ``<variant of module.name>``)::

        no_barrier = registry.variant(fa2.make_forward, regions={"kv-barrier": "pass"})
        with registry.using(fa2.make_forward, no_barrier):
            flashnb.attention(q, k, v, impl="fa2", Br=16, Bc=16, warps=2)
    """
    import ast
    import linecache
    import sys
    import textwrap

    from . import regions as _regions

    base = getattr(factory, "variant_source", None)          # a variant of a variant starts from its source
    root = factory.variant_of if base is not None else factory
    original = getattr(root, "__wrapped__", root)
    if not callable(original) or not hasattr(original, "__code__"):
        raise TypeError(f"factory must be a kernel factory function (e.g. fa2.make_forward), got {factory!r}")
    if region is not None and not isinstance(region, str):
        raise TypeError(f"region must be a region name (a str), got {region!r}")
    if regions is not None and not isinstance(regions, dict):
        raise TypeError(f"regions must be a dict {{region name: new body}}, got {type(regions).__name__}")
    where = f"{original.__module__.rsplit('.', 1)[-1]}.{original.__name__}"
    if source is None:
        text = base if base is not None else textwrap.dedent(inspect.getsource(original))
        for name, new_body in (regions or {}).items():
            text = _regions.replace_body(text, name, new_body, where)
        pairs = [replace] if replace and isinstance(replace[0], str) else list(replace)
        if region is not None and not pairs:
            raise TypeError(f"region={region!r} without replace=: say what to change in it (replace=(old, new)), "
                            "or replace its whole body with regions={name: new_body}")
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise TypeError(f"replace must be a pair (old, new) of strings or a list of them, got {pair!r}")
            old, new = pair
            if region is not None:
                text = _regions.replace_in(text, region, old, new, where)
                continue
            n = text.count(old)
            if n != 1:
                raise ValueError(f"replace: {old!r} occurs {n} times in {original.__name__}'s source; it must "
                                 "occur exactly once (name a region to search in: region=..., its names: "
                                 f"{', '.join(_regions.names(text, where)) or 'none'})")
            text = text.replace(old, new)
    elif replace or regions or region is not None:
        raise TypeError("pass either source= or replace=/region=/regions=, not both")
    else:
        text = textwrap.dedent(source)
    tree = ast.parse(text)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(defs) != 1:
        raise ValueError(f"source must hold exactly one function definition (the factory), found {len(defs)}")
    defs[0].decorator_list = []      # drop @kernel_factory(...): a variant is registered nowhere
    module = sys.modules[original.__module__]
    filename = filename or f"<variant of {original.__module__}.{original.__name__}>"
    lines = text.splitlines(keepends=True)
    linecache.cache[filename] = (len(text), None, lines, filename)
    namespace = dict(vars(module))
    if names:
        unknown = [n for n in names if n not in namespace]
        if unknown:
            raise ValueError(f"names: {unknown} are not names of {original.__module__} (a variant can only replace "
                             "names its factory's module defines)")
        namespace.update(names)
    exec(compile(tree, filename, "exec"), namespace)
    made = _memoised(namespace[defs[0].name])
    made.variant_of = root
    made.variant_source = text
    return made


class using:
    """``with using(fa2.make_forward, my_variant):`` -- the library's launchers build their kernels with
    ``my_variant`` instead of the registered factory inside the block (the module attribute is swapped and
    restored on exit).  ``my_variant`` must take the same arguments (see :func:`variant`)."""

    def __init__(self, factory, replacement):
        import sys

        self.module = sys.modules[getattr(factory, "__module__", "")] if hasattr(factory, "__module__") else None
        name = getattr(factory, "__name__", None)
        if self.module is None or getattr(self.module, name, None) is not factory:
            raise ValueError(f"factory must be a kernel factory reachable as a module attribute (e.g. "
                             f"fa2.make_forward), got {factory!r}")
        if not callable(replacement):
            raise TypeError(f"replacement must be a callable kernel factory, got {replacement!r}")
        self.name, self.factory, self.replacement = name, factory, replacement

    def __enter__(self):
        setattr(self.module, self.name, self.replacement)
        return self.replacement

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.factory)
        return False
