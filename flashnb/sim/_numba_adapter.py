"""Every use flashnb makes of numba-cuda's simulator internals (and of numba's own), in one place.

The simulator (``numba.cuda.simulator``) is private API of numba-cuda: its classes change without notice.
flashnb reaches into it only through this module, so a numba-cuda upgrade touches this file (and
:data:`flashnb.sim.EXPECTED_SOURCE_SHA256`).  :data:`PRIVATE` lists every private name used; a test checks that
no other module of flashnb imports ``numba.cuda.simulator``.
"""

from __future__ import annotations

import importlib

__all__ = ["PRIVATE", "sim", "install_numba_rules", "uninstall_numba_rules"]

#: every private simulator name flashnb uses: ``module: (names ...)`` (modules under ``numba.cuda.simulator``)
PRIVATE = {
    "kernel": ("BlockManager", "BlockThread", "FakeCUDAKernel", "swapped_cuda_module", "_kernel_context",
               "_get_kernel_context"),
    "kernelapi": ("FakeCUDAModule", "FakeCUDAAtomic", "FakeCUDAFp16", "FakeCUDAShared", "FakeCUDALocal", "Dim3"),
    "cudadrv.devicearray": ("FakeCUDAArray", "FakeWithinKernelCUDAArray", "FakeShape"),
    "args": ("ArgHint", "InOut"),
}


def sim(module: str, name: str | None = None):
    """``numba.cuda.simulator.<module>`` (or its attribute ``name``): the one way flashnb imports them."""
    if module not in PRIVATE:
        raise ValueError(f"module must be one of {sorted(PRIVATE)}, got {module!r}")
    if name is not None and name not in PRIVATE[module]:
        raise ValueError(f"{name!r} is not listed in PRIVATE[{module!r}]")
    mod = importlib.import_module(f"numba.cuda.simulator.{module}")
    return mod if name is None else getattr(mod, name)


_saved: dict = {}
#: the atomics whose one value numba converts to the array's element type
_VALUE_ATOMICS = ("add", "sub", "and_", "or_", "xor", "exch", "max", "min", "nanmax", "nanmin", "inc", "dec")


def install_numba_rules() -> None:
    """numba's scalar rules where the threads simulator calls Python: a device function runs its rewritten copy
    (:mod:`.threads_typing`), ``uint32(x)`` of an integer wraps, ``cuda.fma`` multiplies and adds by numba's
    types, an atomic converts its value to the array's type first.  (A kernel's body is rewritten by
    :class:`~flashnb.sim.fastbarrier.FastBlockManager`.)"""
    if _saved:
        return
    from numba.core.types import scalars

    from . import arith
    from .threads_typing import typed

    kernel = sim("kernel")
    FakeCUDAKernel = kernel.FakeCUDAKernel
    FakeCUDAModule = sim("kernelapi", "FakeCUDAModule")
    call = FakeCUDAKernel.__call__

    def __call__(self, *args):
        if self._device or kernel._kernel_context:
            f = typed(self.fn)
            with kernel.swapped_cuda_module(f, kernel._get_kernel_context()):
                return f(*args)
        return call(self, *args)

    __call__.__wrapped__ = call
    cast = scalars.Integer.cast_python_value

    def cast_python_value(self, value):
        import numpy as np

        if isinstance(value, (int, np.integer)):        # bools too: numba's integer cast truncates (wraps)
            return arith.cast_int_python(getattr(np, self.name), value)
        return cast(self, value)

    fma = vars(FakeCUDAModule).get("fma")

    def numba_fma(self, a, b, c):
        return arith.BINARY["add"](arith.BINARY["mul"](a, b), c)

    FakeCUDAAtomic = sim("kernelapi", "FakeCUDAAtomic")
    atomics = {name: fn for name, fn in vars(FakeCUDAAtomic).items() if name in _VALUE_ATOMICS}

    def converting(fn):
        def atomic(self, array, index, val):
            dt = getattr(array, "dtype", None)
            if dt is not None and dt.kind in "iuf" and not isinstance(val, np.ndarray):
                val = arith.to_type(val, dt)        # numba converts the value to the array's type first
            return fn(self, array, index, val)

        atomic.__wrapped__ = fn
        atomic.__name__ = fn.__name__
        return atomic

    import numpy as np

    _saved.update(call=call, cast=cast, fma=fma, atomics=atomics)
    FakeCUDAKernel.__call__ = __call__
    scalars.Integer.cast_python_value = cast_python_value
    FakeCUDAModule.fma = numba_fma
    for name, fn in atomics.items():
        setattr(FakeCUDAAtomic, name, converting(fn))


def uninstall_numba_rules() -> None:
    if not _saved:
        return
    from numba.core.types import scalars

    sim("kernel", "FakeCUDAKernel").__call__ = _saved["call"]
    scalars.Integer.cast_python_value = _saved["cast"]
    for name, fn in _saved["atomics"].items():
        setattr(sim("kernelapi", "FakeCUDAAtomic"), name, fn)
    mod = sim("kernelapi", "FakeCUDAModule")
    if _saved["fma"] is None:
        del mod.fma
    else:
        mod.fma = _saved["fma"]
    _saved.clear()
