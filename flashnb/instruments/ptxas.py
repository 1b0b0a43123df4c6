"""One kernel through NVVM and ``ptxas -v`` for one compute capability: the :class:`Resources` ptxas reports
(registers, shared memory, stack, spills, ``.f64`` lines), and the PTX rewrites that let one NVVM pass serve
several architectures (:func:`retarget_ptx`, :func:`normalized_ptx`)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import runtime
from .occupancy import Occupancy, occupancy

# --------------------------------------------------------------------------- compiled resources


@dataclass
class Resources:
    """What ptxas reports for one kernel compiled for one compute capability (all sizes in bytes).

    ``registers`` etc. are None when ptxas could not run (``error`` says why); ``shared_bytes`` then
    falls back to the sum of the PTX's ``.shared`` declarations.  ``f64_count`` counts PTX lines with a
    ``.f64`` type -- each one a float64 operation (usually a Python float literal in the kernel).
    """

    name: str
    config: dict
    cc: tuple[int, int]
    registers: int | None = None
    shared_bytes: int | None = None          # static (ptxas)
    dynamic_shared_bytes: int = 0            # dynamic, what the launcher asks for (the registry's spec says)
    stack_bytes: int | None = None          # per-thread stack frame (local memory)
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    f64_count: int = 0
    threads: int | None = None              # block size the launcher uses, when known
    error: str | None = None
    ptxas_log: str = field(default="", repr=False)
    ptx: str | None = field(default=None, repr=False)

    @property
    def ptx_available(self) -> bool:
        return self.ptx is not None

    @property
    def spill_bytes(self) -> int | None:
        if self.spill_store_bytes is None or self.spill_load_bytes is None:
            return None
        return self.spill_store_bytes + self.spill_load_bytes

    def occupancy(self, threads_per_block: int | None = None, cc=None) -> Occupancy:
        """Occupancy at ``threads_per_block`` (default: the launcher's block size) on ``cc`` (default:
        the cc compiled for)."""
        threads = threads_per_block if threads_per_block is not None else self.threads
        if threads is None:
            raise ValueError(f"{self.name}: threads_per_block unknown (pass it, or register threads=)")
        if self.registers is None:
            raise ValueError(f"{self.name}: no register count ({self.error})")
        return occupancy(self.registers, self.shared_bytes or 0, threads, cc or self.cc, self.dynamic_shared_bytes)


    def to_json(self) -> dict:
        d = asdict(self)
        d["cc"] = list(self.cc)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Resources":
        d = dict(d)
        d["cc"] = tuple(d["cc"])
        return cls(**d)


def find_ptxas() -> str | None:
    """Path of a ptxas binary: the nvidia-cuda-nvcc wheel's (via cuda.pathfinder or the package path),
    then ``$CUDA_HOME/bin``, then PATH."""
    with contextlib.suppress(Exception):
        from cuda import pathfinder

        found = pathfinder.find_nvidia_binary_utility("ptxas")
        if found:
            return str(found)
    with contextlib.suppress(Exception):
        import nvidia.cuda_nvcc as nvcc

        for base in list(nvcc.__path__):
            cand = Path(base) / "bin" / "ptxas"
            if cand.is_file():
                return str(cand)
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cand = Path(os.environ[env]) / "bin" / "ptxas"
            if cand.is_file():
                return str(cand)
    return shutil.which("ptxas")


_SHARED_DECL = re.compile(r"^\s*(?:\.visible\s+|\.extern\s+)?\.shared\s+.*?\.b8\s+\S+\[(\d+)\]", re.M)
_F64 = re.compile(r"\.f64\b")


def _parse_ptxas(log: str, res: Resources) -> None:
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        res.stack_bytes, res.spill_store_bytes, res.spill_load_bytes = map(int, m.groups())
    m = re.search(r"Used (\d+) registers", log)
    if m:
        res.registers = int(m.group(1))
    m = re.search(r"(\d+) bytes smem", log)
    res.shared_bytes = int(m.group(1)) if m else (0 if res.registers is not None else res.shared_bytes)


def _ptx_resources(ptx: str, name: str, config: dict, cc) -> Resources:
    res = Resources(name, dict(config), tuple(cc), ptx=ptx)
    res.f64_count = sum(1 for line in ptx.splitlines() if _F64.search(line) and not line.lstrip().startswith("//"))
    res.shared_bytes = sum(int(n) for n in _SHARED_DECL.findall(ptx))
    ptxas = find_ptxas()
    if ptxas is None:
        return res
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas, "-v", f"-arch=sm_{cc[0]}{cc[1]}", str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True)
    res.ptxas_log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        errs = [ln for ln in res.ptxas_log.splitlines() if "error" in ln.lower() or "fatal" in ln.lower()]
        res.error = "ptxas: " + ("; ".join(errs) or res.ptxas_log.strip()[-500:])
        return res
    _parse_ptxas(res.ptxas_log, res)
    return res


@contextlib.contextmanager
def _fake_device(cc):
    """Without a driver, numba asks ``get_current_device()`` for the cc when a kernel calls a device
    function; answer with the cc being compiled for (only when no driver/GPU is present)."""
    import numba.cuda.dispatcher as dispatcher

    if runtime.driver_device_count() > 0:
        yield
        return

    class _Device:
        compute_capability = tuple(cc)
        name = f"(no GPU: compiling for sm_{cc[0]}{cc[1]})"

    saved = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: _Device()
    try:
        yield
    finally:
        dispatcher.get_current_device = saved


def _nvvm(kernel, signature: str, cc) -> str:
    """PTX of ``kernel`` for ``cc`` from NVVM (``numba.cuda.compile_ptx``); raises if it does not compile."""
    from numba import cuda

    if cuda.compile_ptx is None:  # pragma: no cover - guarded by callers
        raise RuntimeError("compile_ptx is unavailable in simulator mode")
    py_func = getattr(kernel, "py_func", kernel)
    with _fake_device(cc):
        ptx, _ = cuda.compile_ptx(py_func, signature, cc=tuple(cc))
    return ptx


def _compile_error(exc: Exception, name: str, config: dict, cc) -> Resources:
    # a kernel that doesn't compile is a guard finding, not a crash
    first = str(exc).strip().splitlines()
    return Resources(name, dict(config), tuple(cc), error=f"{type(exc).__name__}: {first[0] if first else ''}")


def _compile_here(kernel, signature: str, cc, name: str, config: dict) -> Resources:
    try:
        ptx = _nvvm(kernel, signature, cc)
    except Exception as exc:
        return _compile_error(exc, name, config, cc)
    return _ptx_resources(ptx, name, config, cc)


_TARGET = re.compile(r"^\.target\s+sm_\d+[a-z]?\b", re.M)


def retarget_ptx(ptx: str, cc) -> str:
    """``ptx`` with its ``.target`` directive set to ``sm_<cc>`` (one NVVM pass serving several ccs).

    NVVM's PTX for cc 7.5, 8.0 and 9.0 of every registered kernel differ only in that line and in symbol
    names (``normalized_ptx``; checked on a sample in ``tests/instruments/test_ptx_guard.py``), so assembling the cc 8.0
    PTX retargeted to sm_90 gives ptxas the same input as a separate NVVM pass for cc 9.0 would.  Only
    retarget *upwards*: PTX for a lower target is valid for a higher one (as the driver's JIT uses it), not
    the reverse."""
    out, n = _TARGET.subn(f".target sm_{cc[0]}{cc[1]}", ptx, count=1)
    if n != 1:
        raise ValueError("PTX has no .target directive to retarget")
    return out


_SYMBOL = re.compile(r"_ZN\w+|_cudapy_smem_\d+|\$L__\w+|\$__internal_\w+|__nv_static_\w+")


def normalized_ptx(ptx: str) -> str:
    """``ptx`` with every symbol renamed ``SYM0, SYM1, ...`` in order of appearance and the ``.target`` line
    blanked: numba's mangled names carry a per-process counter and a tag of the target options, and shared
    arrays a counter, so two compiles of one kernel differ in names even when the code is the same."""
    ids: dict[str, int] = {}
    ptx = _SYMBOL.sub(lambda m: f"SYM{ids.setdefault(m.group(0), len(ids))}", ptx)
    return _TARGET.sub(".target", ptx)


