"""Choose between a real GPU and the Numba CUDA simulator, before ``numba.cuda`` is imported.

Numba reads ``NUMBA_ENABLE_CUDASIM`` into ``numba.core.config`` when numba is first imported, and
``numba.cuda`` acts on it once, when it is first imported, so the choice cannot be changed afterwards.
flashnb sets the variable and reloads numba's configuration (``from numba import float32`` before
``import flashnb`` is fine); if ``numba.cuda`` itself was imported first in GPU mode on a machine without a
GPU, ``import flashnb`` raises :class:`RuntimeModeError` saying what to do.  The rule:

* ``FLASHNB_DEVICE=gpu`` or ``FLASHNB_DEVICE=sim`` forces a mode;
* otherwise a real GPU is used when the CUDA driver library loads and reports at least one device,
  and the simulator is used everywhere else (the common case for readers of the notebooks).

The probe talks to the driver through :mod:`ctypes` so that it never imports ``numba.cuda``.

On the simulator, ``FLASHNB_SIM`` chooses how kernels run: ``vector`` (the default; :mod:`flashnb.sim.vector`,
every thread of a grid in lockstep as NumPy vectors) or ``threads`` (the Numba simulator's one Python thread per
CUDA thread).  :data:`SIM` is the choice made at import; :func:`flashnb.sim.set_mode` changes it later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings

__all__ = ["MODE", "SIM", "SIMULATORS", "is_simulator", "select_mode", "driver_device_count", "RuntimeModeError",
           "rehearsing", "REHEARSAL", "DYNAMIC_SHARED_REQUESTS"]

_VALID = ("gpu", "sim")
#: The simulators ``FLASHNB_SIM`` may choose (the first is the default).
SIMULATORS = ("vector", "threads")


class RuntimeModeError(RuntimeError):
    """numba.cuda was already imported in the other mode, or the requested mode cannot work."""


def driver_device_count() -> int:
    """Number of CUDA devices the driver reports, or 0 when no driver library can be loaded."""
    names = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so"]
    found = ctypes.util.find_library("cuda")
    if found:
        names.append(found)
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
            return int(count.value)
        except AttributeError:
            return 0
    return 0


def _requested() -> str | None:
    value = os.environ.get("FLASHNB_DEVICE", "").strip().lower()
    if not value:
        return None
    if value not in _VALID:
        raise RuntimeModeError(
            f"FLASHNB_DEVICE must be 'gpu' or 'sim' (or unset to auto-detect), got {value!r}"
        )
    return value


_NAMES = {"sim": "simulator", "gpu": "GPU"}


def _auto_mode() -> str:
    """The mode chosen without FLASHNB_DEVICE: NUMBA_ENABLE_CUDASIM if set, else GPU iff the driver sees one."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "sim"
    return "gpu" if driver_device_count() > 0 else "sim"


def select_mode() -> str:
    """Decide the mode and set ``NUMBA_ENABLE_CUDASIM`` accordingly; return ``'gpu'`` or ``'sim'``."""
    requested = _requested()
    if "numba.cuda" in sys.modules:
        # Too late to choose: report what numba.cuda is actually running, loudly if it is not what we'd pick.
        try:
            from numba.cuda.core import config  # numba-cuda >= 0.2x keeps its own config
        except ImportError:  # pragma: no cover - older numba-cuda reads numba's
            from numba.core import config

        actual = "sim" if config.ENABLE_CUDASIM else "gpu"
        wanted = requested or _auto_mode()
        if wanted == "sim" and actual == "gpu" and requested is None:
            # numba.cuda runs in GPU mode on a machine without a GPU: every launch would fail later with a
            # driver traceback, so stop here with what to do instead.
            raise RuntimeModeError(
                "numba.cuda was imported before flashnb, in GPU mode, and this machine has no CUDA GPU: "
                "put `import flashnb` before `from numba import cuda` (or set NUMBA_ENABLE_CUDASIM=1 before "
                "Python starts) and restart the interpreter or notebook kernel."
            )
        if wanted != actual:
            message = (
                f"numba.cuda was already imported in {_NAMES[actual]} mode, but flashnb "
                f"{'was asked for' if requested else 'would choose'} {_NAMES[wanted]} mode"
                f"{'' if requested else (' (no CUDA GPU found)' if wanted == 'sim' else ' (a CUDA GPU is present)')}. "
                "NUMBA_ENABLE_CUDASIM is read only when numba.cuda is first imported: import flashnb before "
                "anything imports numba.cuda (or set FLASHNB_DEVICE / NUMBA_ENABLE_CUDASIM before Python "
                "starts) and restart the interpreter or notebook kernel."
            )
            if requested is not None:
                raise RuntimeModeError(f"FLASHNB_DEVICE={requested}: " + message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return actual
    mode = requested or _auto_mode()
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if mode == "sim" else "0"
    if "numba.core.config" in sys.modules:
        # Something imported numba (e.g. `from numba import float32`) without numba.cuda: numba's config has
        # already read the environment, and numba.cuda reads ENABLE_CUDASIM from it, so make it read it again.
        sys.modules["numba.core.config"].reload_config()
    return mode


MODE: str = select_mode()


def _sim_requested() -> str:
    value = os.environ.get("FLASHNB_SIM", "").strip().lower()
    if not value:
        return SIMULATORS[0]
    if value not in SIMULATORS:
        raise RuntimeModeError(f"FLASHNB_SIM must be 'vector' or 'threads' (or unset for 'vector'), got {value!r}")
    return value


SIM: str = _sim_requested()


def is_simulator() -> bool:
    """True when flashnb runs its kernels on the Numba CUDA simulator."""
    return MODE == "sim"


#: A rehearsal of the GPU code paths on the simulator (:func:`flashnb.instruments.rehearsal.pretend_gpu`) under way:
#: its depth.  Kept here, at the bottom, so the launch helpers (:mod:`flashnb.common`) can ask without importing the
#: instruments that set it.
REHEARSAL = {"depth": 0}
#: ``(kernel, signature, bytes)`` of every dynamic-shared-memory opt-in (``common.allow_dynamic_shared``) a
#: rehearsal made: on a GPU each is a ``cuKernelSetAttribute`` call, which a rehearsal cannot make.
DYNAMIC_SHARED_REQUESTS: list = []


def rehearsing() -> bool:
    """True inside :func:`flashnb.instruments.rehearsal.pretend_gpu` (GPU paths taken on the simulator)."""
    return REHEARSAL["depth"] > 0
