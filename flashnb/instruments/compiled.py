"""What a kernel costs on a real GPU, found without one: the public compile API behind ``flashnb inspect``
(registered kernels by name, any ``@cuda.jit`` kernel by signature or example arguments), and what the
driver loaded when a GPU ran it (:func:`launched`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Mapping

from .. import runtime
from ..registry import KERNELS, KernelSpec
from .guard import problems
from .jobs import _CACHE, _can_compile_here, _compile_jobs, _in_subprocess, _key, _threads
from .occupancy import _limits
from .ptxas import Resources, _compile_here
from .shipping import _REBUILD_ERROR, _is_flashnb_module, _job_for, _python_function, _source_job


def resources_many(jobs: Iterable[tuple[str, dict, tuple[int, int]]], *, keep_ptx: bool = False,
                   reuse_ptx: bool = True, progress: str | None = None) -> list[Resources]:
    """Compile many registered ``(name, config, cc)`` at once (in child processes in simulator mode).

    One NVVM pass per ``(name, config)`` serves all its ccs (:func:`retarget_ptx`); ``reuse_ptx=False``
    runs NVVM once per cc instead and neither reads nor fills the in-process cache (for checking that
    the two agree).  ``progress``: a name for the work; when NVVM must run in child processes, a line on stderr
    says what runs and a progress bar follows it (None: silent)."""
    jobs = [(n, dict(c), tuple(cc)) for n, c, cc in jobs]
    for n, c, cc in jobs:
        if n not in KERNELS:
            raise ValueError(f"name must be a registered kernel ({sorted(KERNELS)}), got {n!r}")
        _limits(cc)
        KERNELS[n].check_arch(c, cc)     # a tensor-core kernel asked for an architecture without its instructions
    originals = {_key(*j): j for j in jobs}
    cache = _CACHE if reuse_ptx else {}
    todo = [k for k in originals if k not in cache or (keep_ptx and cache[k].ptx is None)]
    if todo:
        if _can_compile_here():
            raw = [dict(name=originals[k][0], config=originals[k][1], cc=list(k[2])) for k in todo]
            results = _compile_jobs(raw, reuse_ptx=reuse_ptx)
            if not keep_ptx:
                for r in results:
                    r.ptx = None
        else:
            raw = [_job_for(originals[k][0], originals[k][1], k[2]) for k in todo]
            results = _in_subprocess(raw, keep_ptx=keep_ptx, reuse_ptx=reuse_ptx, progress=progress)
        for k, r in zip(todo, results):
            r.dynamic_shared_bytes = KERNELS[originals[k][0]].dynamic_shared_for(originals[k][1])
            if r.threads is None:  # a user-registered kernel compiled from source: block size known only here
                r.threads = _threads(KERNELS[originals[k][0]], originals[k][1])
            cache[k] = r
    return [cache[_key(*j)] for j in jobs]


def resources_for(name: str, config: Mapping | None = None, cc=(9, 0), *, keep_ptx: bool = False,
                  progress: bool = True) -> Resources:
    """Resources of the registered kernel ``name`` built with ``config`` (default: its first config).  On the
    simulator a compile that needs NVVM says so on stderr (``progress=False``: silent)."""
    if name not in KERNELS:
        raise ValueError(f"name must be a registered kernel ({sorted(KERNELS)}), got {name!r}")
    if config is None:
        config = KERNELS[name].configs[0]
    return resources_many([(name, dict(config), cc)], keep_ptx=keep_ptx,
                          progress=f"flashnb.instruments.resources_for({name!r})" if progress else None)[0]


def _same_kernel(a, b) -> bool:
    """Same factory-made kernel: identical object, or same code with equal closure constants (the factory
    cache keys positional and keyword calls apart, so equal configs can give two objects)."""
    if a is b:
        return True
    fa, fb = getattr(a, "py_func", None), getattr(b, "py_func", None)
    if fa is None or fb is None or fa.__code__ is not fb.__code__:
        return False
    cells = lambda f: tuple(c.cell_contents for c in (f.__closure__ or ()))
    with contextlib.suppress(Exception):
        return cells(fa) == cells(fb)
    return False


def _registered(kernel) -> tuple[str, dict] | None:
    for spec in KERNELS.values():
        for config in spec.configs:
            with contextlib.suppress(Exception):
                if _same_kernel(spec.factory(**config), kernel):
                    return spec.name, config
    return None


def _type_string(value) -> str:
    """A numba signature string for one example argument (``array(float32, 2d, C)`` -> ``float32[:, ::1]``)."""
    from numba import typeof
    from numba.core import types as nb_types

    try:
        t = typeof(value)
    except (ValueError, TypeError):
        t = typeof(value.copy_to_host())  # a simulator device array
    if isinstance(t, nb_types.Array):
        dims = [":"] * t.ndim
        if t.layout == "C" and t.ndim:
            dims[-1] = "::1"
        elif t.layout == "F" and t.ndim:
            dims[0] = "::1"
        return f"{t.dtype}[{', '.join(dims)}]"
    return str(t)


def _signature_from_args(args) -> str:
    return "void(" + ", ".join(_type_string(a) for a in args) + ")"


def resources(kernel, signature_or_example_args, cc=(9, 0), *, keep_ptx: bool = True,
              progress: bool = True) -> Resources:
    """Resources of any ``@cuda.jit`` kernel, given its signature string or example arguments.

    Works wherever the kernel was written: in flashnb, in a module, in a script (``__main__``) or in a
    notebook cell.  In simulator mode the compile runs in a child process; a kernel that is not flashnb's
    is sent there as source text plus the names it uses (modules, device functions, numbers, numpy values,
    numba types) -- the user's script or notebook is never re-run.  Raises TypeError when the kernel cannot
    be sent (source unavailable, a global of another type) and RuntimeError when the child cannot rebuild
    it; a kernel that does not compile gives a result whose ``error`` says why (a guard finding).  A compile that
    needs NVVM (seconds to a minute; its PTX is then cached on disk) says so on stderr with a progress bar
    (``progress=False``: silent).
    """
    return resources_of([(kernel, signature_or_example_args, cc)], keep_ptx=keep_ptx, progress=progress)[0]


def resources_of(items: Iterable[tuple[Any, Any, tuple[int, int]]], *, keep_ptx: bool = True,
                 progress: bool = True) -> list[Resources]:
    """:func:`resources` of many ``(kernel, signature or example args, cc)`` at once: in simulator mode the
    kernels that are not registered compile together in child processes, one NVVM pass per kernel and
    signature serving all its ccs (:func:`retarget_ptx`); ``progress`` as in :func:`resources`."""
    items = list(items)
    out: list[Resources | None] = [None] * len(items)
    batch: dict[tuple, tuple[list[int], Any, str, tuple, str]] = {}
    for i, (kernel, signature_or_example_args, cc) in enumerate(items):
        cc = tuple(cc)
        _limits(cc)
        sig = (signature_or_example_args if isinstance(signature_or_example_args, str)
               else _signature_from_args(signature_or_example_args))
        found = _registered(kernel)
        if found is not None and sig == KERNELS[found[0]].signature_for(found[1]):
            out[i] = resources_for(found[0], found[1], cc, keep_ptx=keep_ptx, progress=progress)
            continue
        py_func = _python_function(kernel)
        name = f"{py_func.__module__}.{py_func.__qualname__}"
        key = ("<kernel>" + name, sig, cc, py_func)  # the function itself: a re-run cell is a new kernel
        if key in _CACHE:
            out[i] = _CACHE[key]
        elif key in batch:
            batch[key][0].append(i)
        else:
            batch[key] = ([i], kernel, sig, cc, name)
    if batch:
        todo = list(batch.values())
        if _can_compile_here():
            results = [_compile_here(kernel, sig, cc, name, {}) for _, kernel, sig, cc, name in todo]
        else:
            jobs = []
            for _, kernel, sig, cc, name in todo:
                py_func = _python_function(kernel)
                if _is_flashnb_module(py_func.__module__) and "<locals>" not in py_func.__qualname__:
                    jobs.append(dict(module=py_func.__module__, attr=py_func.__qualname__, signature=sig,
                                     cc=list(cc), name=name))
                else:                      # a script, a notebook cell, a user module: sent as source
                    jobs.append(_source_job(kernel, sig, cc, name, {}))
            names = sorted({name.rsplit(".", 1)[-1] for *_, name in todo})
            results = _in_subprocess(jobs, keep_ptx=keep_ptx, progress=(
                f"flashnb.instruments.resources({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                if progress else None))
            for (_, _, _, _, name), res in zip(todo, results):
                if res.error and res.error.startswith(_REBUILD_ERROR):
                    raise RuntimeError(f"{name}: {res.error}")
        for key, (idxs, *_), res in zip(batch, todo, results):
            _CACHE[key] = res
            for i in idxs:
                out[i] = res
    return out


def launched(kernel) -> list[dict]:
    """Registers, static shared memory and local memory of the machine code the driver loaded for each
    signature ``kernel`` has been launched with (GPU only: the simulator loads nothing).  Compare with
    :func:`resources` (``compile_ptx`` + ptxas), which is what ``flashnb inspect`` shows."""
    if runtime.is_simulator():
        raise RuntimeError("inspect.launched reads what a GPU driver loaded; on the simulator nothing is loaded. "
                           "Use inspect.resources(kernel, signature) for the ptxas build")
    overloads = getattr(kernel, "overloads", None)
    if overloads is None:
        raise TypeError(f"kernel must be a @cuda.jit kernel, got {type(kernel).__name__}")
    name = getattr(getattr(kernel, "py_func", kernel), "__name__", str(kernel))
    return [dict(kernel=name, signature=", ".join(str(a) for a in args), registers=k.regs_per_thread,
                 shared_bytes=k.shared_mem_per_block, local_bytes=k.local_mem_per_thread,
                 const_bytes=k.const_mem_size, max_threads_per_block=k.max_threads_per_block)
            for args, k in overloads.items()]


def guard_kernel(spec: KernelSpec | str, config: Mapping | None = None, cc=(9, 0)) -> list[str]:
    """The PTX guard for one registered kernel configuration: a list of problems (empty = clean)."""
    name = spec if isinstance(spec, str) else spec.name
    return problems(resources_for(name, config, cc))


