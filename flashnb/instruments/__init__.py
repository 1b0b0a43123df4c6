"""Instruments: what a kernel costs, measured or counted without a GPU, and timed with one.

* :mod:`~flashnb.instruments.traffic` -- HBM and shared-memory traffic counted on the simulator, against each
  stage's analytic model.
* :mod:`~flashnb.instruments.roofline` -- a GPU's roofline and where a kernel sits on it.
* :mod:`~flashnb.instruments.bench` -- wall time with CUDA events on a GPU; a modelled time on the simulator.
* :mod:`~flashnb.instruments.rehearsal` -- the GPU code path (device arrays, streams, events) rehearsed on the
  simulator.
* :mod:`~flashnb.instruments.sass`, :mod:`~flashnb.instruments.sass_model` -- a kernel's machine code
  (``nvdisasm``) and a time modelled from its instruction mix.
* Registers, shared memory, spills and occupancy from ``ptxas`` (``flashnb inspect``), one job per module:
  :mod:`~flashnb.instruments.occupancy` (per-SM limits), :mod:`~flashnb.instruments.ptxas` (one kernel through
  NVVM and ptxas), :mod:`~flashnb.instruments.ptx_cache` (NVVM's PTX on disk),
  :mod:`~flashnb.instruments.shipping` (a user's kernel sent to a compile process as source),
  :mod:`~flashnb.instruments.jobs` (compile jobs, here or in child processes),
  :mod:`~flashnb.instruments.compiled` (the public compile API), :mod:`~flashnb.instruments.guard` (the PTX
  guard's verdict) and :mod:`~flashnb.instruments.report` (the ``flashnb inspect`` table).

Every number here comes from compiling the kernel for a real architecture -- ``numba.cuda.compile_ptx`` (NVVM),
then ``ptxas -v`` -- or from counting on the simulator, never from a guess.  This package re-exports the compile
API, so ``from flashnb import instruments as fi; fi.resources_for("fa2.forward")`` reads as it always has.
"""

from .compiled import guard_kernel, launched, resources, resources_for, resources_many, resources_of
from .guard import problems
from .jobs import _worker  # noqa: F401  (the compile child's entry point)
from .occupancy import (
    MAX_OPTIN_SHARED,
    MAX_STATIC_SHARED,
    OPTIN_CHECKED_CCS,
    SM_LIMITS,
    Occupancy,
    SMLimits,
    occupancy,
)
from .ptx_cache import HOST_ONLY, package_digest, ptx_cache_dir, toolchain_versions
from .ptxas import Resources, find_ptxas, normalized_ptx, retarget_ptx
from .report import format_report, inspect_parser, main_inspect, report

__all__ = [
    "SMLimits", "SM_LIMITS", "Occupancy", "Resources", "occupancy", "resources", "resources_for",
    "resources_many", "resources_of", "guard_kernel", "problems", "report", "format_report", "main_inspect",
    "inspect_parser", "find_ptxas", "retarget_ptx", "normalized_ptx", "MAX_STATIC_SHARED", "MAX_OPTIN_SHARED",
    "OPTIN_CHECKED_CCS", "launched", "HOST_ONLY", "package_digest", "ptx_cache_dir", "toolchain_versions",
]


def __getattr__(name):
    """A submodule not imported yet (``import flashnb`` defers them), imported on first use as an attribute."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
