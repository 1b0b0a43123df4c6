"""flashnb's additions to the Numba CUDA simulator (installed automatically when ``flashnb.MODE == "sim"``).

* the vectorised simulator (:mod:`flashnb.sim.vector`, the default): every thread of a grid in lockstep, as
  NumPy vectors -- the same results, counts and tool findings as the threads simulator, 30-200x faster.
  ``FLASHNB_SIM=threads`` (or :func:`set_mode`, :func:`simulating`) runs the Numba simulator's threads instead;
  kernels the vectorised one cannot run use them anyway, after a one-line note;
* a thread-block manager whose ``syncthreads()`` waits instead of busy-polling under the GIL
  (:mod:`flashnb.sim.fastbarrier`; same semantics, several times faster on barrier-heavy kernels);
* the warp intrinsics the stock simulator lacks -- ``cuda.syncwarp``, ``cuda.shfl_sync``/``shfl_up_sync``/
  ``shfl_down_sync``/``shfl_xor_sync``, ``cuda.ballot_sync``/``all_sync``/``any_sync``/``eq_sync``,
  ``cuda.match_any_sync``/``match_all_sync``, ``cuda.activemask``, ``cuda.lanemask_lt``
  (:mod:`flashnb.sim.warp`), so kernels using them run unchanged here and on a GPU;
* a block in which every live thread waits for something that cannot happen (a GPU would hang) raises
  :class:`SimulatorDeadlock` instead of hanging.

Both patch *private* simulator internals of numba-cuda 0.30.4.  :func:`install` first checks that those
internals are the ones this code was written against (SHA-256 of their source); if not, it leaves the
stock simulator alone and warns once.

API: :func:`install` (idempotent; returns True when the patch is active), :func:`uninstall`,
:func:`is_installed`, :func:`self_test`.  Tools built on it: :func:`sanitize` (compute-sanitizer's memcheck,
racecheck, initcheck and synccheck; :mod:`flashnb.sim.sanitizer`), :mod:`flashnb.sim.racecheck`, and
:func:`profile` (Nsight-Compute-style sectors per request and bank conflicts; :mod:`flashnb.sim.memprofile`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import warnings

from .. import runtime

__all__ = ["install", "uninstall", "is_installed", "self_test", "EXPECTED_SOURCE_SHA256", "SimulatorDeadlock",
           "sanitize", "SanitizerError", "profile", "mode", "set_mode", "simulating"]

#: SHA-256 of ``inspect.getsource`` of every simulator internal the patch replaces or relies on (numba-cuda 0.30.4).
EXPECTED_SOURCE_SHA256 = {
    "kernel.BlockThread": "31539332ab25b3d00cb2c83f4a2cb7c75acd90b4a17240c6c50333f2559d9a39",
    "kernel.BlockManager": "e2b159fde19167444cb40465e175ed69d0da53a453d678e1510a7f7c753b1b9d",
    "kernel.FakeCUDAKernel.__call__": "71c9d298b7bc62785c792eacfd2c24323bfaf7eaf98d0fa61c920781e81dbada",
    "kernelapi.FakeCUDAModule": "100ce788e6efc8533b27c51247f684d5c850d2a25841aee3ac43558604a71d4e",
}

def kernel_line(skip: set, depth: int = 2) -> str:
    """``file:line (function)`` of the first frame, ``depth`` frames up from the caller of this function, whose
    file is not in ``skip``: the kernel line behind an access or a barrier (racecheck, the sanitizer, the
    profiler and synccheck all name lines this way)."""
    import os
    import sys

    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename in skip:
        f = f.f_back
    if f is None:  # pragma: no cover
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"


_state = {"installed": False, "warned": False, "stock_block_manager": None, "stock_getitem": None, "problem": None}


_LAZY = {  # name -> (submodule, attribute or None for the module itself), imported on first use
    "SimulatorDeadlock": ("fastbarrier", "SimulatorDeadlock"),
    "racecheck": ("racecheck", None),   # `flashnb.sim.racecheck.check()` after a bare `import flashnb`
    "selftest": ("selftest", None),
    "warp": ("warp", None),
    "fastbarrier": ("fastbarrier", None),
    "sanitizer": ("sanitizer", None),
    "memprofile": ("memprofile", None),
    "sanitize": ("sanitizer", "sanitize"),
    "SanitizerError": ("sanitizer", "SanitizerError"),
    "profile": ("memprofile", "profile"),
    "vector": ("vector", None),
}


def __getattr__(name):  # tools without importing the simulator at ``import flashnb.sim``
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        mod = importlib.import_module(f"{__name__}.{module}")
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _source_problem(kernel, kernelapi):
    """None when the simulator internals are the expected ones, else a sentence saying what differs."""
    stock = _state["stock_block_manager"] or getattr(kernel, "BlockManager", None)
    targets = {
        "kernel.BlockThread": getattr(kernel, "BlockThread", None),
        "kernel.BlockManager": stock,
        "kernel.FakeCUDAKernel.__call__": getattr(getattr(kernel, "FakeCUDAKernel", None), "__call__", None),
        "kernelapi.FakeCUDAModule": getattr(kernelapi, "FakeCUDAModule", None),
    }
    changed = []
    for name, obj in targets.items():
        try:
            digest = hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()
        except (TypeError, OSError):
            digest = None
        if digest != EXPECTED_SOURCE_SHA256.get(name):
            changed.append(name)
    if changed:
        return f"{', '.join(changed)} differ from numba-cuda 0.30.4"
    from .warp import INTRINSICS

    present = [n for n in INTRINSICS if n in vars(kernelapi.FakeCUDAModule)]
    if present:
        return f"FakeCUDAModule already defines {', '.join(present)}"
    return None


def _checked_getitem(stock):
    """``kernel[grid, block]`` that refuses what a GPU refuses: the stock simulator runs a grid of 100,000 blocks
    on y, or 2,048 threads per block, where CUDA fails the launch."""

    def __getitem__(self, configuration):
        out = stock(self, configuration)
        from ..common import check_launch_dims

        check_launch_dims(self.fn.__name__, tuple(self.grid_dim), tuple(self.block_dim))
        return out

    __getitem__.__wrapped__ = stock
    return __getitem__


def install() -> bool:
    """Patch the simulator (fast barrier + warp intrinsics).  Idempotent; a no-op returning False in GPU mode.

    Returns True when the patch is active.  When the simulator internals are not the expected ones it
    returns False, keeps the stock simulator, and emits one ``RuntimeWarning``.
    """
    if runtime.MODE != "sim":
        return False
    if _state["installed"]:
        return True
    from ._numba_adapter import sim

    kernel, kernelapi = sim("kernel"), sim("kernelapi")
    problem = _source_problem(kernel, kernelapi)
    if problem is not None:
        _state["problem"] = problem
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(
                f"flashnb.sim: the Numba CUDA simulator's internals are not the ones flashnb patches ({problem}); "
                "using the stock simulator: syncthreads() is slow and the warp intrinsics (cuda.shfl_*_sync, "
                "cuda.ballot_sync, ...) are unavailable.",
                RuntimeWarning,
                stacklevel=2,
            )
        return False
    from . import traffic, warp
    from .fastbarrier import FastBlockManager

    _state["stock_block_manager"] = kernel.BlockManager
    kernel.BlockManager = FastBlockManager
    _state["stock_getitem"] = kernel.FakeCUDAKernel.__getitem__
    kernel.FakeCUDAKernel.__getitem__ = _checked_getitem(kernel.FakeCUDAKernel.__getitem__)
    warp.install(kernelapi.FakeCUDAModule)
    traffic._install()        # its launch patch is where a launch goes to the vectorised simulator
    from ._numba_adapter import install_numba_rules

    install_numba_rules()     # numba's scalar typing in the threads simulator (flashnb.sim.arith)
    _state["installed"] = True
    _state["problem"] = None
    _apply_mode()
    return True


def uninstall() -> None:
    """Restore the stock simulator (and forget an earlier warning, so a later :func:`install` checks afresh)."""
    if _state["installed"]:
        from . import warp
        from ._numba_adapter import sim

        kernel, kernelapi = sim("kernel"), sim("kernelapi")

        kernel.BlockManager = _state["stock_block_manager"]
        kernel.FakeCUDAKernel.__getitem__ = _state["stock_getitem"]
        warp.uninstall(kernelapi.FakeCUDAModule)
        from ._numba_adapter import uninstall_numba_rules

        uninstall_numba_rules()
        _state["installed"] = False
        _apply_mode()
    _state["warned"] = False
    _state["problem"] = None


_mode = {"sim": runtime.SIM}


def _apply_mode() -> None:
    from . import traffic

    if _state["installed"] and _mode["sim"] == "vector":
        from .vector.launch import run

        traffic.vector_launch = run
    else:
        traffic.vector_launch = None


def mode() -> str:
    """``"vector"`` (the vectorised simulator, the default) or ``"threads"`` (the Numba simulator's threads):
    how kernels run now (``"threads"`` also when the patch is not installed)."""
    return _mode["sim"] if _state["installed"] else "threads"


def set_mode(sim: str) -> None:
    """Run kernels from now on with ``sim`` (``"vector"`` or ``"threads"``; see :mod:`flashnb.sim.vector`)."""
    if sim not in runtime.SIMULATORS:
        raise ValueError(f"sim must be one of {list(runtime.SIMULATORS)}, got {sim!r}")
    _mode["sim"] = sim
    _apply_mode()


@contextlib.contextmanager
def simulating(sim: str):
    """``with flashnb.sim.simulating("threads"):`` -- run the block's kernels with ``sim``, then go back."""
    previous = _mode["sim"]
    set_mode(sim)
    try:
        yield sim
    finally:
        set_mode(previous)


def is_installed() -> bool:
    """True while the patched simulator is active."""
    return _state["installed"]


def self_test() -> dict:
    """Run tiny kernels with barriers (and, when installed, warp intrinsics); raise AssertionError on a wrong
    result.  Returns ``dict(installed=..., checks=[names of the checks that passed])``."""
    from .selftest import run

    return run(warp=_state["installed"])


if runtime.MODE == "sim":
    install()
