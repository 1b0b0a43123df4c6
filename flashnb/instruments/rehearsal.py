"""Rehearse flashnb's GPU-only Python paths on the simulator, so they are exercised before a GPU is lent.

Timing with CUDA events, device attributes, the benchmark sweep, ``flashnb tour``'s measured column,
``scripts/gpu_check.py`` and the notebooks' GPU cells only run when ``flashnb.MODE == "gpu"``.  Without a
GPU they would first run -- and first fail -- on borrowed GPU time.  Inside ``with pretend_gpu():``

* :func:`flashnb.is_simulator` answers False, so every GPU branch is taken;
* ``numba.cuda.event(timing=True)`` / ``numba.cuda.event_elapsed_time`` read a clock (wall time, or a
  :class:`ManualClock` a test advances), with the signatures of the real numba-cuda API;
* ``numba.cuda.get_current_device()`` is a :class:`PretendDevice` whose attributes have real CUDA attribute
  names (``MULTIPROCESSOR_COUNT``, ``CLOCK_RATE`` in kHz, ...);

while the kernels still run on the simulator.  **Nothing produced here is a GPU measurement**: the device
is named ``REHEARSAL (simulator, not a GPU)`` and every CSV row says ``mode=rehearsal``.

A child process started by :func:`flashnb.instruments.bench.on_gpu` under rehearsal rehearses too
(``FLASHNB_REHEARSAL=1`` with ``FLASHNB_DEVICE=sim``).
"""

from __future__ import annotations

import contextlib
import os
import time

from .. import runtime

__all__ = ["DEVICE_NAME", "ManualClock", "PretendDevice", "PretendEvent", "pretend_gpu", "active", "ENV",
           "dynamic_shared_requests"]

DEVICE_NAME = "REHEARSAL (simulator, not a GPU)"
ENV = "FLASHNB_REHEARSAL"
_state = runtime.REHEARSAL   # the depth lives in the runtime, where the launch helpers read it
#: ``(kernel, signature, bytes)`` of every dynamic-shared-memory opt-in (``common.allow_dynamic_shared``) a
#: rehearsal made: on a GPU each is a ``cuKernelSetAttribute`` call, which a rehearsal cannot make.
dynamic_shared_requests: list = runtime.DYNAMIC_SHARED_REQUESTS


def active() -> bool:
    """True inside :func:`pretend_gpu` (nothing timed now is a GPU measurement)."""
    return runtime.rehearsing()


class ManualClock:
    """A clock in milliseconds that only moves when told: ``clock.advance(ms)``."""

    def __init__(self):
        self.now_ms = 0.0

    def advance(self, ms: float) -> None:
        self.now_ms += float(ms)

    def __call__(self) -> float:
        return self.now_ms


def _wall_ms() -> float:
    return time.perf_counter() * 1e3


class PretendEvent:
    """``numba.cuda.event(timing=True)``: ``record(stream=0)``, ``synchronize()``, ``elapsed_time(end)``."""

    def __init__(self, clock, timing=True):
        self._clock, self.timing, self.t_ms = clock, timing, None

    def record(self, stream=0):
        self.t_ms = self._clock()

    def wait(self, stream=0):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, evtend):
        return _elapsed(self, evtend)


def _elapsed(start: PretendEvent, end: PretendEvent) -> float:
    if not (start.timing and end.timing):
        raise ValueError("elapsed time needs two events created with timing=True")  # as CUDA refuses
    if start.t_ms is None or end.t_ms is None:
        raise ValueError("elapsed time needs two recorded events")
    return end.t_ms - start.t_ms


class PretendDevice:
    """A device with H200-like attributes (132 SMs; 1980 MHz SM and 3201 MHz memory clocks, as nvidia-smi
    read them on a lent H200; a 6144-bit HBM3e bus); its name says it is a rehearsal."""

    id = 0
    name = DEVICE_NAME.encode()   # numba-cuda returns bytes on some versions; flashnb accepts both
    compute_capability = (9, 0)
    MULTIPROCESSOR_COUNT = 132
    CLOCK_RATE = 1_980_000        # kHz, as CU_DEVICE_ATTRIBUTE_CLOCK_RATE
    MEMORY_CLOCK_RATE = 3_201_000  # kHz, as CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE
    GLOBAL_MEMORY_BUS_WIDTH = 6144  # bits

    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 227 * 1024   # bytes, as CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN

    ATTRIBUTES = ("MULTIPROCESSOR_COUNT", "CLOCK_RATE", "MEMORY_CLOCK_RATE", "GLOBAL_MEMORY_BUS_WIDTH",
                  "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")


@contextlib.contextmanager
def pretend_gpu(clock=None):
    """Take flashnb's GPU code paths on the simulator (see the module docstring); restores everything after.

    ``clock`` is a zero-argument callable in milliseconds read by the pretend events (default: wall time).
    """
    if runtime.MODE != "sim":
        raise RuntimeError("pretend_gpu() rehearses GPU paths on the simulator; this process has a real GPU")
    from numba import cuda

    # flashnb.instruments.bench asks active() for its driver versions ("rehearsal"): it imports this module, not the
    # reverse
    clock = clock or _wall_ms
    patches = [(runtime, "MODE", "gpu"),
               (cuda, "event", lambda timing=True: PretendEvent(clock, timing)),
               (cuda, "event_elapsed_time", _elapsed),
               (cuda, "get_current_device", PretendDevice)]
    saved = [(obj, name, getattr(obj, name, _MISSING)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    _state["depth"] += 1
    old_env = os.environ.get(ENV)
    os.environ[ENV] = "1"
    try:
        yield
    finally:
        _state["depth"] -= 1
        if old_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old_env
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


_MISSING = object()
