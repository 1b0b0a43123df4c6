"""The vectorised simulator: every thread of a grid in lockstep, as NumPy vectors (flashnb's default).

The Numba CUDA simulator runs each CUDA thread as a Python thread; this one rewrites a kernel's Python source
(whole-function vectorisation, as ISPC and the MCUDA/COX compilers do) into code that runs every thread of many
blocks at once: a value the same for every thread stays one Python value, a value that differs per thread is a
NumPy array over the threads, shared arrays are one copy per block, local arrays one copy per thread, global
loads and stores gather and scatter for the threads that are active.  It computes what the threads simulator
computes, bit for bit (the same float32 arithmetic, numba's scalar typing -- :mod:`flashnb.sim.arith` --,
Python's exceptions), and counts what
its traffic counter counts; the sanitizer's four tools and the memory profiler work on it with the same
findings.  See :mod:`.translate` (what is translated), :mod:`.values` (the scalar semantics), :mod:`.arrays`,
:mod:`.warp`, :mod:`.tensorcore` (``mma.sync``, ``ldmatrix``, ``cp.async``), :mod:`.tools`, and
:mod:`flashnb.sim.fallback`.

Choosing the simulator: ``FLASHNB_SIM=vector`` (the default) or ``FLASHNB_SIM=threads`` (the Numba simulator's
threads: to step through one thread in a debugger, or to print in thread order), before flashnb is imported, or
at any time::

    flashnb.sim.set_mode("threads")            # for the rest of the process
    with flashnb.sim.simulating("threads"):    # for a block
        ...

A kernel the vectorised simulator cannot run (a construct it does not translate, no source, a warp operation
only some of the lanes reach, ...) runs on the threads simulator, after a one-line note per kernel and reason
on stderr (:func:`flashnb.sim.fallback.notes` lists them; ``FLASHNB_SIM_QUIET=1`` keeps them off stderr).  A kernel
*error* is never retried: it is raised as the threads simulator raises it.
"""

from __future__ import annotations

from ..fallback import KernelFault, Unsupported, notes

__all__ = ["Unsupported", "KernelFault", "notes", "explain", "counts"]


def counts() -> dict:
    """``{"vector": n, "threads": m}``: the top-level launches of this process the vectorised simulator ran, and
    those it handed to the threads simulator (while the vectorised simulator was chosen)."""
    from .launch import COUNTS

    return dict(COUNTS)


def explain(kernel) -> str:
    """Why ``kernel`` (a ``cuda.jit`` kernel or device function, or its Python function) would run on the threads
    simulator, or ``""`` when the vectorised simulator translates it (its device functions are translated as
    they are called)."""
    from .translate import translate

    fn = getattr(kernel, "py_func", kernel)
    fn = getattr(fn, "fn", fn)
    try:
        translate(fn, kernel=not getattr(kernel, "_device", False))
    except Unsupported as exc:
        return str(exc)
    return ""
