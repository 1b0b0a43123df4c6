"""NVVM's PTX kept on disk, under a key that changes whenever the PTX could (the job, the signature, the
sources kernels can depend on, the toolchain)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from ..registry import KERNELS
from .shipping import _is_flashnb_module

# --------------------------------------------------------------------------- NVVM's PTX, cached on disk
#
# NVVM (numba's typing + lowering + libNVVM) is what the guard spends its time on; ptxas is cheap.  So NVVM's PTX
# is kept on disk, shared by every process of a run (pytest workers, notebook kernels, compile children) and by
# later runs, under a key that changes whenever the PTX could: the job (a registered kernel's name and config, or
# a user kernel's full source description), the signature, the cc of the NVVM pass, a digest of every source
# file of the flashnb package (a kernel's device functions and constants live there) and the toolchain's
# versions.  ptxas still assembles the PTX for every cc on every call, so registers, spills and shared memory
# are measured each time; only the NVVM step is reused.  A kernel that depends on a module outside flashnb,
# numba, numpy and the standard library is never cached (its key could not see that module change).

_PTX_CACHE_OFF = ("0", "off", "no", "false", "none")
_PORTABLE_MODULES = ("flashnb", "numba", "numpy", "math", "cmath", "operator", "builtins")


def ptx_cache_dir() -> Path | None:
    """Where NVVM's PTX is cached: ``$FLASHNB_PTX_CACHE`` (``0``/``off`` disables it), else
    ``$XDG_CACHE_HOME/flashnb/ptx`` (``~/.cache/flashnb/ptx``)."""
    env = os.environ.get("FLASHNB_PTX_CACHE")
    if env is not None and env.strip().lower() in _PTX_CACHE_OFF:
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashnb" / "ptx"


_DIGESTS: dict[str, str] = {}


#: Parts of the package that hold no device code, so no kernel's PTX depends on them: the simulator, the course
#: kit, the PyTorch and distributed front ends, the kernels' host launchers and traffic models, and host-only tools.
#: :func:`package_digest` leaves them out, so editing them keeps the PTX guard's record
#: (``tests/instruments/test_ptx_guard.py`` checks that none of them defines a ``cuda.jit`` function, an intrinsic,
#: or a registered kernel factory).
HOST_ONLY = ("sim/", "course/", "pytorch/", "distributed/", "cli.py", "notebook.py", "regions.py", "_gpu_child.py",
             "tiny_transformer.py", "kernels/auto.py", "kernels/launch/", "kernels/models/", "instruments/measure/",
             "instruments/sass_inputs/",
             *(f"instruments/{m}.py" for m in ("__init__", "sass", "sass_model", "roofline", "traffic", "rehearsal",
                                                "occupancy", "ptxas", "ptx_cache", "shipping", "jobs", "compiled",
                                                "guard", "report")))


def _host_only(rel: str) -> bool:
    return any(rel.startswith(h) if h.endswith("/") else rel == h for h in HOST_ONLY)


def package_digest(root: str | Path | None = None) -> str:
    """SHA-256 of every ``.py`` file of the flashnb package (relative path and bytes) under ``root`` (default:
    this package) that kernels can depend on -- all but :data:`HOST_ONLY`: any edit of such a file changes it."""
    import hashlib

    if root is None and "package" in _DIGESTS:
        return _DIGESTS["package"]
    base = Path(root) if root is not None else Path(__file__).resolve().parents[1]   # the flashnb package
    h = hashlib.sha256()
    for f in sorted(base.rglob("*.py"), key=lambda f: f.relative_to(base).as_posix()):
        rel = f.relative_to(base).as_posix()
        if not _host_only(rel):
            h.update(rel.encode() + b"\0" + f.read_bytes() + b"\0")
    if root is None:
        _DIGESTS["package"] = h.hexdigest()
    return h.hexdigest()


def toolchain_versions() -> str:
    """The versions that decide NVVM's output: Python, numba, numba-cuda, llvmlite, numpy, and the CUDA wheels
    that ship libNVVM."""
    if "toolchain" not in _DIGESTS:
        from importlib import metadata

        parts = [sys.version.split()[0]]
        for dist in ("numba", "numba-cuda", "llvmlite", "numpy", "cuda-bindings", "nvidia-cuda-nvcc-cu12",
                     "cuda-toolkit"):
            try:
                parts.append(f"{dist}=={metadata.version(dist)}")
            except metadata.PackageNotFoundError:
                parts.append(f"{dist}==none")
        _DIGESTS["toolchain"] = ";".join(parts)
    return _DIGESTS["toolchain"]


def _portable(desc: dict) -> bool:
    """A source description whose every imported name lives in flashnb, numba, numpy or the standard math
    modules (so the package digest and the toolchain versions cover what it depends on)."""
    for value in desc["env"].values():
        kind = value["kind"]
        if kind in ("module", "import"):
            if value["module"].split(".")[0] not in _PORTABLE_MODULES:
                return False
        elif kind == "function" and not _portable(value["function"]):
            return False
    return True


def _ptx_key(job: dict, signature: str | None, cc) -> str | None:
    """The cache key of NVVM's PTX for ``job`` compiled for ``cc`` (None: not cacheable)."""
    import hashlib

    if "source" in job:
        if not _portable(job["source"]):
            return None
        what = ["source", job["source"]]
    elif "attr" in job:
        if not _is_flashnb_module(job.get("module")):
            return None
        what = ["attr", job["module"], job["attr"]]
    else:
        spec = KERNELS.get(job["name"])
        if spec is None or not _is_flashnb_module(getattr(spec.factory, "__module__", None)):
            return None
        what = ["name", job["name"], job["config"]]
        signature = signature or spec.signature_for(job["config"])
    text = json.dumps([what, signature, list(cc), package_digest(), toolchain_versions()], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _cached_ptx(key: str | None) -> str | None:
    folder = ptx_cache_dir()
    if key is None or folder is None:
        return None
    with contextlib.suppress(OSError):
        return (folder / f"{key}.ptx").read_text()
    return None


def _store_ptx(key: str | None, ptx: str) -> None:
    folder = ptx_cache_dir()
    if key is None or folder is None:
        return
    with contextlib.suppress(OSError):          # a read-only or full disk only costs the next run time
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{key}.{os.getpid()}.tmp"
        tmp.write_text(ptx)
        os.replace(tmp, folder / f"{key}.ptx")   # atomic: a concurrent reader sees all of it or nothing


