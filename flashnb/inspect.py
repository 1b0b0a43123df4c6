"""What a kernel costs on a real GPU, found without one: registers, shared memory, spills, occupancy.

Every number here comes from compiling the kernel for a real architecture -- ``numba.cuda.compile_ptx``
(NVVM) and then ``ptxas -v`` (the assembler that produces the machine code) -- never from the simulator.

* :func:`resources_for` / :func:`resources` -- compile one kernel for one compute capability and return a
  :class:`Resources` (registers per thread, static shared memory, stack, spill bytes, ``.f64`` count).
* :func:`occupancy` -- resident blocks and warps per SM from those resources and the published per-SM
  limits in :data:`SM_LIMITS`, and which limit binds.
* :func:`guard_kernel` -- the PTX guard's list of problems (float64 instructions, > 48 KiB static shared
  memory, static + dynamic shared memory over the sm_80 / sm_90 opt-in limit, spills, compile errors).
* :func:`report` / :func:`main_inspect` -- the table behind ``flashnb inspect``.

In simulator mode ``numba.cuda.compile_ptx`` does not exist (``NUMBA_ENABLE_CUDASIM`` is read once per
process), so the compilation runs in child Python processes started with ``FLASHNB_DEVICE=gpu``; NVVM and
ptxas need no driver and no GPU.  Results are cached per (kernel, config, cc) in this process only.

What a batch costs, and how it is kept down (measured on the 58 registered configs, numba-cuda 0.30.4,
CUDA 12.9): ``compile_ptx`` takes ~1.3 s per kernel and config -- almost all of it numba's Python front
end, NVVM itself a fraction -- and ``ptxas`` 0.01-0.4 s per cc.  So

* one NVVM pass per (kernel, config), for the lowest cc asked for; ptxas assembles that PTX for every cc,
  with the ``.target`` line rewritten (:func:`retarget_ptx`).  For all 58 configs NVVM's PTX for cc 8.0
  and cc 9.0 were identical but for ``.target`` and symbol names (:func:`normalized_ptx`), so ptxas sees
  the input a separate pass would give it; ``tests/test_ptx_guard.py`` re-checks that on a sample, and
  ``resources_many(..., reuse_ptx=False)`` runs NVVM per cc.  Not equivalent in general: were NVVM's
  cc 9.0 output ever to differ for a kernel outside that sample (it differs for none today), its sm_90
  row would describe the sm_80 PTX assembled for sm_90 -- what the driver's JIT runs from an sm_80 build,
  not what an sm_90 build would run.
* the groups are dealt over ``$FLASHNB_INSPECT_PROCESSES`` child processes (default: the CPUs, at most
  4), and in each, ptxas runs in a thread pool while NVVM compiles the next kernel.

Which build these numbers describe: ``compile_ptx`` + ``ptxas``, a build of the kernel alone.  On a GPU,
numba-cuda 0.30 links the kernel it launches with nvJitLink (and, with ``lto=True``, optimises across the
link), so the launched machine code can use a different number of registers or stack bytes.
:func:`launched` reads what the driver actually loaded -- ``cuFuncGetAttribute`` through numba's kernel
object -- for every signature a kernel was launched with; ``scripts/gpu_check.py`` records it beside the
measurements when a GPU is lent.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import runtime
from .registry import KERNELS, KernelSpec

__all__ = [
    "SMLimits", "SM_LIMITS", "Occupancy", "Resources", "occupancy", "resources", "resources_for",
    "resources_many", "resources_of", "guard_kernel", "problems", "report", "format_report", "main_inspect",
    "find_ptxas", "retarget_ptx", "normalized_ptx", "MAX_STATIC_SHARED", "MAX_OPTIN_SHARED", "OPTIN_CHECKED_CCS",
    "launched",
]

MAX_STATIC_SHARED = 48 * 1024  # bytes of *static* shared memory one block may declare (all cc >= 2.0)
# Bytes of shared memory (static + dynamic) one block may use after the driver opt-in
# (cudaFuncAttributeMaxDynamicSharedMemorySize; CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN):
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
MAX_OPTIN_SHARED = {(7, 5): 64 * 1024, (8, 0): 163 * 1024, (9, 0): 227 * 1024}
# The architectures whose opt-in limit the PTX guard holds dynamic shared memory to (A100, H100/H200: what the
# dynamic defaults are chosen for).  Elsewhere (a T4's 64 KiB) the launcher reads the device's own limit at run
# time and refuses or falls back (``common.shared_optin_limit``); occupancy there says 0 blocks.
OPTIN_CHECKED_CCS = ((8, 0), (9, 0))


# --------------------------------------------------------------------------- per-SM limits


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resource limits of one compute capability.

    Sources: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (registers,
    warps, blocks, shared memory per SM, 48 KiB static shared per block, 255 registers per thread), and
    ``cuda_occupancy.h`` from the CUDA 12.9 runtime (shipped in the nvidia-cuda-runtime-cu12 wheel):
    register allocation unit 256 per warp, 4 sub-partitions per SM (registers are split between them),
    shared memory allocation unit 128 bytes, and 1 KiB of shared memory reserved per block on cc >= 8.0
    (``cudaDevAttrReservedSharedMemoryPerBlock``).
    """

    cc: tuple[int, int]
    gpus: str
    regs_per_sm: int = 64 * 1024
    max_regs_per_block: int = 64 * 1024
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256        # registers are allocated per warp in units of 256
    sub_partitions: int = 4          # each SM's register file is split over 4 sub-partitions
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    max_threads_per_block: int = 1024
    smem_per_sm: int = 164 * 1024    # usable shared memory per SM at the maximum carve-out
    smem_alloc_unit: int = 128
    reserved_smem_per_block: int = 1024
    max_static_smem_per_block: int = MAX_STATIC_SHARED
    max_optin_smem_per_block: int = MAX_STATIC_SHARED   # static + dynamic, after the driver opt-in


SM_LIMITS: dict[tuple[int, int], SMLimits] = {
    # T4 (TU104, Colab's free GPU): 64 KB shared per SM, 16 blocks and 32 warps (1,024 threads) per SM, no
    # reserved shared memory per block before cc 8.0.
    (7, 5): SMLimits((7, 5), "T4", smem_per_sm=64 * 1024, max_blocks_per_sm=16, max_warps_per_sm=32,
                     reserved_smem_per_block=0, max_optin_smem_per_block=MAX_OPTIN_SHARED[(7, 5)]),
    # A100 (GA100): 164 KB shared per SM (of the 192 KB L1/shared array), 32 blocks, 64 warps.
    (8, 0): SMLimits((8, 0), "A100", smem_per_sm=164 * 1024, max_blocks_per_sm=32,
                     max_optin_smem_per_block=MAX_OPTIN_SHARED[(8, 0)]),
    # H100/H200 (GH100): 228 KB shared per SM (of the 256 KB L1/shared array), 32 blocks, 64 warps.
    (9, 0): SMLimits((9, 0), "H100/H200", smem_per_sm=228 * 1024, max_blocks_per_sm=32,
                     max_optin_smem_per_block=MAX_OPTIN_SHARED[(9, 0)]),
}


def _limits(cc) -> SMLimits:
    cc = tuple(cc)
    if cc not in SM_LIMITS:
        raise ValueError(f"cc must be one of {sorted(SM_LIMITS)} (published per-SM limits known), got {cc}")
    return SM_LIMITS[cc]


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks per SM for one kernel at one block size, and the limit that binds.

    ``limits`` maps each resource (``warps``, ``blocks``, ``registers``, ``shared memory``) to the number
    of blocks it alone would allow; ``limiter`` names the smallest (ties: the first in that order, so
    registers or shared memory are named only when they cost blocks the warp/block caps would allow).
    """

    cc: tuple[int, int]
    threads_per_block: int
    blocks_per_sm: int
    warps_per_sm: int
    occupancy: float               # resident warps / max warps per SM
    limiter: str
    limits: dict = field(default_factory=dict)


def occupancy(registers: int, shared_bytes: int, threads_per_block: int, cc=(9, 0), dynamic_bytes: int = 0
              ) -> Occupancy:
    """Blocks per SM the hardware can keep resident, following ``cuda_occupancy.h`` (CUDA 12.9).

    * registers: ``regs_per_warp = round_up(registers · 32, 256)``; each of the 4 sub-partitions holds
      ``floor(16384 / regs_per_warp)`` warps, so ``blocks = 4 · that // warps_per_block``;
    * shared memory: ``round_up(static + dynamic + 1 KiB reserved, 128)`` per block out of the SM's shared
      memory (static <= 48 KiB, static + dynamic <= the opt-in limit, :data:`MAX_OPTIN_SHARED`);
    * warps: ``64 // warps_per_block``; blocks: 32.
    A block that cannot fit at all (too many registers or shared bytes for one block) gives 0 blocks.
    """
    lim = _limits(cc)
    if threads_per_block <= 0 or threads_per_block > lim.max_threads_per_block:
        raise ValueError(f"threads_per_block must be in 1..{lim.max_threads_per_block}, got {threads_per_block}")
    if registers < 0 or shared_bytes < 0 or dynamic_bytes < 0:
        raise ValueError(f"registers, shared_bytes and dynamic_bytes must be >= 0, got {registers}, {shared_bytes}, "
                         f"{dynamic_bytes}")
    warps = -(-threads_per_block // 32)
    # registers
    regs_per_warp = _round_up(registers * 32, lim.reg_alloc_unit)
    if registers > lim.max_regs_per_thread or regs_per_warp * _round_up(warps, lim.sub_partitions) > \
            lim.max_regs_per_block:
        by_regs = 0
    elif regs_per_warp == 0:
        by_regs = lim.max_blocks_per_sm
    else:
        warps_per_sub = (lim.regs_per_sm // lim.sub_partitions) // regs_per_warp
        by_regs = warps_per_sub * lim.sub_partitions // warps
    # shared memory
    smem_alloc = _round_up(shared_bytes + dynamic_bytes + lim.reserved_smem_per_block, lim.smem_alloc_unit)
    if shared_bytes > lim.max_static_smem_per_block or shared_bytes + dynamic_bytes > lim.max_optin_smem_per_block \
            or smem_alloc > lim.smem_per_sm:
        by_smem = 0
    elif smem_alloc == 0:              # no shared memory and no per-block reserve (cc < 8.0)
        by_smem = lim.max_blocks_per_sm
    else:
        by_smem = lim.smem_per_sm // smem_alloc
    by_warps = lim.max_warps_per_sm // warps
    by_blocks = lim.max_blocks_per_sm
    # On a tie the hardware caps (warps, blocks) are named: a resource binds only when it alone costs blocks.
    limits = {"warps": by_warps, "blocks": by_blocks, "registers": by_regs, "shared memory": by_smem}
    blocks = min(limits.values())
    limiter = min(limits, key=lambda k: limits[k])  # dict order breaks ties
    return Occupancy(tuple(cc), threads_per_block, blocks, blocks * warps,
                     blocks * warps / lim.max_warps_per_sm, limiter, limits)


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

    def problems(self, max_shared: int = MAX_STATIC_SHARED) -> list[str]:
        return problems(self, max_shared=max_shared)

    def to_json(self) -> dict:
        d = asdict(self)
        d["cc"] = list(self.cc)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Resources":
        d = dict(d)
        d["cc"] = tuple(d["cc"])
        return cls(**d)


def problems(res: Resources, *, max_shared: int = MAX_STATIC_SHARED) -> list[str]:
    """The PTX guard: everything that would make this kernel wrong or slow on a real GPU."""
    out = []
    where = f"{res.name} {res.config} sm_{res.cc[0]}{res.cc[1]}"
    if res.error:
        out.append(f"{where}: compile error: {res.error}")
    if res.f64_count:
        out.append(f"{where}: {res.f64_count} float64 (.f64) PTX lines -- a Python float literal or "
                   "unwrapped math result in the kernel (use float32(...) / common constants)")
    if res.shared_bytes is not None and res.shared_bytes > max_shared:
        out.append(f"{where}: {res.shared_bytes} bytes static shared memory > {max_shared} (48 KiB)")
    optin = MAX_OPTIN_SHARED.get(tuple(res.cc), MAX_STATIC_SHARED)
    if res.dynamic_shared_bytes and tuple(res.cc) in OPTIN_CHECKED_CCS and \
            (res.shared_bytes or 0) + res.dynamic_shared_bytes > optin:
        out.append(f"{where}: {res.shared_bytes or 0} bytes static + {res.dynamic_shared_bytes} bytes dynamic shared "
                   f"memory > {optin} (the sm_{res.cc[0]}{res.cc[1]} opt-in limit per block)")
    if res.spill_bytes:
        out.append(f"{where}: register spills ({res.spill_store_bytes} B stored, {res.spill_load_bytes} B "
                   "loaded per thread)")
    if res.error is None and res.registers is None:
        out.append(f"{where}: no ptxas report (ptxas not found?)")
    return out


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
    names (``normalized_ptx``; checked on a sample in ``tests/test_ptx_guard.py``), so assembling the cc 8.0
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


def _key(name: str, config: Mapping, cc) -> tuple:
    return (name, json.dumps(dict(config), sort_keys=True, default=str), tuple(cc))


_CACHE: dict[tuple, Resources] = {}


def _threads(spec: KernelSpec | None, config: dict) -> int | None:
    if spec is None:
        return None
    with contextlib.suppress(AttributeError):
        return spec.threads_for(config)
    return None


class _RebuildError(RuntimeError):
    """The compile process could not rebuild a kernel sent as source (its message starts with _REBUILD_ERROR)."""


def _resolve(job: dict):
    """``(kernel, signature, name, config, threads)`` of one job.  A job names a registered kernel (``name``,
    ``config``), a kernel in an importable module (``module``, ``attr``, ``signature``), or carries a kernel's
    source (``source``: see :func:`_describe_function`; ``signature``) -- a kernel written in ``__main__``, a
    notebook cell or a user module, rebuilt here without importing or re-running the user's code."""
    if "source" in job:
        try:
            fn = _rebuild_function(job["source"])
        except Exception as exc:
            raise _RebuildError(f"{_REBUILD_ERROR}: {type(exc).__name__}: {exc}") from exc
        return fn, job["signature"], job.get("name", "?"), job.get("config", {}), None
    if "attr" in job:
        obj = importlib.import_module(job["module"])
        for part in job["attr"].split("."):
            obj = getattr(obj, part)
        return obj, job["signature"], job.get("name", job["attr"]), job.get("config", {}), None
    spec = KERNELS[job["name"]]
    config = job["config"]
    return spec.factory(**config), spec.signature_for(config), spec.name, config, _threads(spec, config)


def _group_key(job: dict) -> str:
    """Jobs that differ only in ``cc`` share one NVVM pass."""
    return json.dumps({k: v for k, v in job.items() if k != "cc"}, sort_keys=True, default=str)


def _groups(jobs: list[dict], reuse_ptx: bool) -> list[list[int]]:
    """Indices of ``jobs`` grouped by one NVVM pass each (every job alone unless ``reuse_ptx``), ccs ascending."""
    groups: dict[Any, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(_group_key(job) if reuse_ptx else i, []).append(i)
    return [sorted(g, key=lambda i: tuple(jobs[i]["cc"])) for g in groups.values()]


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
#: kit, the PyTorch and distributed front ends, and host-only tools.  :func:`package_digest` leaves them out, so
#: editing them keeps the PTX guard's record (``tests/test_ptx_guard.py`` checks that none of them defines a
#: ``cuda.jit`` function, an intrinsic, or a registered kernel factory).
HOST_ONLY = ("sim/", "course/", "torch/", "distributed/", "cli.py", "notebook.py", "sass.py", "sass_model.py",
             "roofline.py", "traffic.py", "rehearsal.py", "_gpu_child.py", "tiny_transformer.py")


def _host_only(rel: str) -> bool:
    return any(rel.startswith(h) if h.endswith("/") else rel == h for h in HOST_ONLY)


def package_digest(root: str | Path | None = None) -> str:
    """SHA-256 of every ``.py`` file of the flashnb package (relative path and bytes) under ``root`` (default:
    this package) that kernels can depend on -- all but :data:`HOST_ONLY`: any edit of such a file changes it."""
    import hashlib

    if root is None and "package" in _DIGESTS:
        return _DIGESTS["package"]
    base = Path(root) if root is not None else Path(__file__).resolve().parent
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


def _job_signature(job: dict) -> str | None:
    if "signature" in job:
        return job["signature"]
    spec = KERNELS.get(job.get("name"))
    return spec.signature_for(job["config"]) if spec is not None else None


def _compile_jobs(jobs: list[dict], *, reuse_ptx: bool = True, ptxas_threads: int = 2) -> list[Resources]:
    """Compile ``jobs`` in this (GPU-mode) process.

    One NVVM pass per kernel and config, for the lowest cc asked for; with ``reuse_ptx`` its PTX, retargeted
    (:func:`retarget_ptx`), is what ptxas assembles for the higher ccs too (``reuse_ptx=False``: a separate
    NVVM pass per cc).  NVVM runs here, one kernel after another; each ptxas is a process of its own, run by
    a pool of ``ptxas_threads`` threads while NVVM goes on with the next kernel."""
    out: list[Resources | None] = [None] * len(jobs)
    with ThreadPoolExecutor(max_workers=max(1, ptxas_threads)) as pool:
        pending = []
        for group in _groups(jobs, reuse_ptx):
            first = jobs[group[0]]
            try:
                kernel, sig, name, config, threads = _resolve(first)
            except Exception as exc:
                error = str(exc) if isinstance(exc, _RebuildError) else f"{type(exc).__name__}: {exc}"
                for i in group:
                    out[i] = Resources(first.get("name", first.get("attr", "?")), first.get("config", {}),
                                       tuple(jobs[i]["cc"]), error=error)
                continue
            key = _ptx_key(first, sig, first["cc"]) if reuse_ptx else None
            ptx = _cached_ptx(key)
            if ptx is None:
                try:
                    ptx = _nvvm(kernel, sig, tuple(first["cc"]))
                except Exception as exc:
                    for i in group:
                        out[i] = _compile_error(exc, name, config, tuple(jobs[i]["cc"]))
                    continue
                _store_ptx(key, ptx)
            for i in group:
                cc = tuple(jobs[i]["cc"])
                pending.append((i, threads, pool.submit(_ptx_resources, retarget_ptx(ptx, cc), name, config, cc)))
        for i, threads, fut in pending:
            out[i] = fut.result()
            out[i].threads = threads
    return out


# --------------------------------------------------------------------------- user kernels (source shipping)
#
# In simulator mode the compile runs in a child process, which cannot import a kernel defined in ``__main__``
# (a script, a notebook cell) and must not re-run the user's script.  So the parent sends the kernel's source
# text (``inspect.getsource``, which reads notebook cells from ``linecache``) and, for every global or closure
# name the code loads, a description the child can rebuild: a module by name, a plain constant (int, float,
# numpy scalar/array/dtype, numba type) by pickle, a device function by its own source (recursively), an
# object of an importable non-user module by import path.  Numba treats globals and closure variables alike
# (compile-time constants), so rebuilding closure values as globals compiles the same kernel.

_REBUILD_ERROR = "could not rebuild the kernel from its source in the compile process"


def _python_function(kernel):
    """The Python function behind a ``@cuda.jit`` kernel (GPU dispatcher or simulator FakeCUDAKernel)."""
    for attr in ("py_func", "fn"):
        fn = getattr(kernel, attr, None)
        if fn is not None and hasattr(fn, "__code__"):
            return fn
    if hasattr(kernel, "__code__"):
        return kernel
    raise TypeError(f"kernel must be a @cuda.jit kernel or a Python function, got {type(kernel).__name__}")


def _is_flashnb_module(name: str | None) -> bool:
    return bool(name) and (name == "flashnb" or name.startswith("flashnb."))


def _loaded_names(code) -> set[str]:
    """Global names the code (and the code nested in it: comprehensions, lambdas) loads."""
    import dis

    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names |= _loaded_names(const)
    return names


def _picklable_constant(value) -> bool:
    import numpy as np
    from numba.core import types as nb_types

    if isinstance(value, (bool, int, float, complex, str, bytes, type(None), np.generic, np.ndarray, np.dtype,
                          nb_types.Type)):
        return True
    if isinstance(value, type) and value.__module__ in ("numpy", "builtins"):
        return True
    if isinstance(value, (tuple, list)):
        return all(_picklable_constant(v) for v in value)
    return False


def _describe_value(owner: str, name: str, value, seen: set) -> dict:
    import base64
    import pickle
    import types as py_types

    if isinstance(value, py_types.ModuleType):
        if value.__name__ == "__main__":
            raise TypeError(f"{owner}: global {name!r} is the __main__ module, which the compile process "
                            "cannot import")
        return {"kind": "module", "module": value.__name__}
    if _picklable_constant(value):
        return {"kind": "pickle", "data": base64.b64encode(pickle.dumps(value)).decode()}
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    is_kernel = hasattr(value, "py_func") or (hasattr(value, "fn") and hasattr(value, "_device"))
    if is_kernel and (not _is_flashnb_module(module) or not qualname or "<" in qualname):
        # a user's device function, or one a factory made (flashnb's own or a registry.variant's): by source
        fn = _python_function(value)
        device = bool(getattr(value, "_device", False) or getattr(value, "targetoptions", {}).get("device"))
        return {"kind": "function", "function": _describe_function(fn, device=device, seen=seen)}
    if module and qualname and module != "__main__" and "<" not in qualname and \
            not module.startswith("numba.cuda.simulator") and module in sys.modules:
        obj = sys.modules[module]
        with contextlib.suppress(AttributeError):
            for part in qualname.split("."):
                obj = getattr(obj, part)
            if obj is value:
                return {"kind": "import", "module": module, "attr": qualname}
    raise TypeError(
        f"{owner}: global or closure variable {name!r} ({type(value).__name__}) cannot be sent to the process "
        "that compiles the kernel (it can send modules, device functions, numbers, numpy values and numba "
        "types); make it one of those, or define the kernel in an importable module and compile it there"
    )


def _describe_function(fn, *, device: bool = False, seen: set | None = None) -> dict:
    """What the compile process needs to rebuild ``fn``: its source and every name its code loads."""
    import inspect as std_inspect
    import textwrap

    seen = set() if seen is None else seen
    owner = f"{fn.__module__}.{fn.__qualname__}"
    if id(fn) in seen:
        raise TypeError(f"{owner}: recursive device functions cannot be sent to the compile process")
    seen.add(id(fn))
    try:
        lines, first = std_inspect.getsourcelines(fn)
    except (OSError, TypeError) as exc:
        raise TypeError(f"{owner}: its source is not available ({exc}); define the kernel in a file or a "
                        "notebook cell so flashnb.inspect can read it") from None
    env = {}
    code = fn.__code__
    for name in sorted(_loaded_names(code)):
        if name in fn.__globals__:
            env[name] = _describe_value(owner, name, fn.__globals__[name], seen)
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            raise TypeError(f"{owner}: closure variable {name!r} is not set yet") from None
        env[name] = _describe_value(owner, name, value, seen)
    seen.discard(id(fn))
    return {"source": textwrap.dedent("".join(lines)), "filename": code.co_filename, "firstlineno": first,
            "name": fn.__name__, "env": env, "device": device}


def _rebuild_value(desc: dict):
    import base64
    import pickle

    kind = desc["kind"]
    if kind == "module":
        return importlib.import_module(desc["module"])
    if kind == "pickle":
        return pickle.loads(base64.b64decode(desc["data"]))
    if kind == "import":
        obj = importlib.import_module(desc["module"])
        for part in desc["attr"].split("."):
            obj = getattr(obj, part)
        return obj
    if kind == "function":
        return _rebuild_function(desc["function"])
    raise ValueError(f"unknown kind {kind!r}")


def _rebuild_function(desc: dict):
    """Execute a function's source (decorators removed) in a fresh namespace holding the names it loads."""
    import ast
    import builtins

    from numba import cuda

    namespace = {"__builtins__": builtins, "__name__": "__flashnb_inspect_user__"}
    namespace.update({name: _rebuild_value(d) for name, d in desc["env"].items()})
    tree = ast.parse(desc["source"])
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(tree.body) != 1 or not defs:
        raise ValueError(f"the source of {desc['name']} is not one function definition")
    defs[0].decorator_list = []
    ast.increment_lineno(tree, desc["firstlineno"] - 1)   # error messages point into the user's file / cell
    exec(compile(tree, desc["filename"], "exec"), namespace)
    fn = namespace[defs[0].name]
    return cuda.jit(device=True)(fn) if desc["device"] else fn


def _source_job(kernel, signature: str, cc, name: str, config: dict) -> dict:
    return dict(source=_describe_function(_python_function(kernel)), signature=signature, cc=list(cc), name=name,
                config=dict(config))


def _job_for(name: str, config: dict, cc) -> dict:
    """The child-process job for a registered kernel: by name for flashnb's own (the child imports flashnb),
    by source for one registered from user code (the child never imports the user's module)."""
    spec = KERNELS[name]
    if _is_flashnb_module(getattr(spec.factory, "__module__", None)):
        return dict(name=name, config=config, cc=list(cc))
    return _source_job(spec.factory(**config), spec.signature_for(config), cc, name, config)


def _worker() -> None:
    """Child-process entry point: JSON jobs on stdin, JSON results on stdout."""
    import flashnb  # noqa: F401  (registers every stage)

    payload = json.load(sys.stdin)
    keep_ptx = bool(payload.get("keep_ptx"))
    out = []
    for res in _compile_jobs(payload["jobs"], reuse_ptx=payload.get("reuse_ptx", True)):
        if not keep_ptx:
            res.ptx = None
        out.append(res.to_json())
    sys.stdout.write("\n@@FLASHNB-JSON@@\n" + json.dumps(out))


def _processes() -> int:
    """Child processes for a batch of compiles: ``$FLASHNB_INSPECT_PROCESSES``, else the CPUs (at most 4)."""
    env = os.environ.get("FLASHNB_INSPECT_PROCESSES")
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


def _one_child(jobs: list[dict], keep_ptx: bool, reuse_ptx: bool, timeout: float) -> list[Resources]:
    env = dict(os.environ)
    env["FLASHNB_DEVICE"] = "gpu"
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", "from flashnb.inspect import _worker; _worker()"],
                          input=json.dumps({"jobs": jobs, "keep_ptx": keep_ptx, "reuse_ptx": reuse_ptx}),
                          capture_output=True, text=True, env=env, timeout=timeout)
    marker = "\n@@FLASHNB-JSON@@\n"
    if proc.returncode != 0 or marker not in proc.stdout:
        raise RuntimeError(f"PTX compile subprocess failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [Resources.from_json(d) for d in json.loads(proc.stdout.split(marker, 1)[1])]


def _in_subprocess(jobs: list[dict], keep_ptx: bool = False, timeout: float = 1800, *,
                   reuse_ptx: bool = True) -> list[Resources]:
    """Compile ``jobs`` in child processes started with ``FLASHNB_DEVICE=gpu`` (:func:`_processes` of them,
    each given whole NVVM groups, dealt round-robin so the big kernels of one module are spread out).  Groups
    whose PTX is in the disk cache (:func:`ptx_cache_dir`) need no child: ptxas runs from here."""
    out: list[Resources | None] = [None] * len(jobs)
    groups, cached = [], []
    for g in _groups(jobs, reuse_ptx):
        first = jobs[g[0]]
        ptx = _cached_ptx(_ptx_key(first, _job_signature(first), first["cc"])) if reuse_ptx else None
        if ptx is None:
            groups.append(g)
        else:
            cached += [(i, ptx) for i in g]
    with ThreadPoolExecutor(max_workers=2) as pool:   # ptxas processes for the cached PTX
        done = [(i, pool.submit(_ptx_resources, retarget_ptx(ptx, jobs[i]["cc"]), jobs[i].get("name", "?"),
                                jobs[i].get("config", {}), tuple(jobs[i]["cc"]))) for i, ptx in cached]
        if groups:
            n = max(1, min(_processes(), len(groups)))
            shares = [[i for g in groups[p::n] for i in g] for p in range(n)]
            with ThreadPoolExecutor(max_workers=n) as children:
                futures = [children.submit(_one_child, [jobs[i] for i in share], keep_ptx, reuse_ptx, timeout)
                           for share in shares]
                results = [f.result() for f in futures]
            for share, res in zip(shares, results):
                for i, r in zip(share, res):
                    out[i] = r
        for i, fut in done:
            r = fut.result()
            r.threads = _threads(KERNELS.get(jobs[i].get("name")), jobs[i]["config"]) if "source" not in jobs[i] \
                and "attr" not in jobs[i] else None
            if not keep_ptx:
                r.ptx = None
            out[i] = r
    return out


def _can_compile_here() -> bool:
    if runtime.is_simulator():
        return False
    from numba import cuda

    return cuda.compile_ptx is not None


def resources_many(jobs: Iterable[tuple[str, dict, tuple[int, int]]], *, keep_ptx: bool = False,
                   reuse_ptx: bool = True) -> list[Resources]:
    """Compile many registered ``(name, config, cc)`` at once (in child processes in simulator mode).

    One NVVM pass per ``(name, config)`` serves all its ccs (:func:`retarget_ptx`); ``reuse_ptx=False``
    runs NVVM once per cc instead and neither reads nor fills the in-process cache (for checking that
    the two agree)."""
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
            results = _in_subprocess(raw, keep_ptx=keep_ptx, reuse_ptx=reuse_ptx)
        for k, r in zip(todo, results):
            r.dynamic_shared_bytes = KERNELS[originals[k][0]].dynamic_shared_for(originals[k][1])
            if r.threads is None:  # a user-registered kernel compiled from source: block size known only here
                r.threads = _threads(KERNELS[originals[k][0]], originals[k][1])
            cache[k] = r
    return [cache[_key(*j)] for j in jobs]


def resources_for(name: str, config: Mapping | None = None, cc=(9, 0), *, keep_ptx: bool = False) -> Resources:
    """Resources of the registered kernel ``name`` built with ``config`` (default: its first config)."""
    if name not in KERNELS:
        raise ValueError(f"name must be a registered kernel ({sorted(KERNELS)}), got {name!r}")
    if config is None:
        config = KERNELS[name].configs[0]
    return resources_many([(name, dict(config), cc)], keep_ptx=keep_ptx)[0]


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


def resources(kernel, signature_or_example_args, cc=(9, 0), *, keep_ptx: bool = True) -> Resources:
    """Resources of any ``@cuda.jit`` kernel, given its signature string or example arguments.

    Works wherever the kernel was written: in flashnb, in a module, in a script (``__main__``) or in a
    notebook cell.  In simulator mode the compile runs in a child process; a kernel that is not flashnb's
    is sent there as source text plus the names it uses (modules, device functions, numbers, numpy values,
    numba types) -- the user's script or notebook is never re-run.  Raises TypeError when the kernel cannot
    be sent (source unavailable, a global of another type) and RuntimeError when the child cannot rebuild
    it; a kernel that does not compile gives a result whose ``error`` says why (a guard finding).
    """
    return resources_of([(kernel, signature_or_example_args, cc)], keep_ptx=keep_ptx)[0]


def resources_of(items: Iterable[tuple[Any, Any, tuple[int, int]]], *, keep_ptx: bool = True) -> list[Resources]:
    """:func:`resources` of many ``(kernel, signature or example args, cc)`` at once: in simulator mode the
    kernels that are not registered compile together in child processes, one NVVM pass per kernel and
    signature serving all its ccs (:func:`retarget_ptx`)."""
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
            out[i] = resources_for(found[0], found[1], cc, keep_ptx=keep_ptx)
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
            results = _in_subprocess(jobs, keep_ptx=keep_ptx)
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


# --------------------------------------------------------------------------- report / CLI


def _threads_for(spec: KernelSpec, config: dict, threads) -> int | None:
    if threads is None:
        return _threads(spec, config)
    if isinstance(threads, Mapping):
        t = threads.get(spec.name)
        if t is None:
            return _threads(spec, config)
        return int(t(**config)) if callable(t) else int(t)
    return int(threads)


def report(ccs=((7, 5), (8, 0), (9, 0)), threads=None, names: Iterable[str] | None = None) -> list[dict]:
    """One row per (registered kernel, config, cc): resources, occupancy and its limiter.

    ``threads`` overrides the block size used for occupancy: an int for every kernel, or a mapping
    ``{name: int | f(**config)}``; otherwise the spec's ``threads`` is used (occupancy blank if unknown).
    """
    specs = [KERNELS[n] for n in (names if names is not None else KERNELS)]
    # a tensor-core kernel's configs only on the architectures they declare (registry: kernel_factory(archs=))
    jobs = [(s.name, c, tuple(cc)) for s in specs for c in s.configs for cc in ccs if s.supports(c, cc)]
    results = resources_many(jobs)
    rows = []
    for (name, config, cc), res in zip(jobs, results):
        t = _threads_for(KERNELS[name], config, threads)
        row = dict(name=name, config=config, cc=cc, regs=res.registers, smem=res.shared_bytes,
                   dyn_smem=res.dynamic_shared_bytes,
                   stack=res.stack_bytes, spills=res.spill_bytes, f64=res.f64_count, threads=t,
                   blocks_per_sm=None, warps_per_sm=None, occupancy=None, limiter=None,
                   problems=problems(res))
        if t is not None and res.registers is not None:
            occ = occupancy(res.registers, res.shared_bytes or 0, t, cc, res.dynamic_shared_bytes)
            row.update(blocks_per_sm=occ.blocks_per_sm, warps_per_sm=occ.warps_per_sm,
                       occupancy=occ.occupancy, limiter=occ.limiter)
        rows.append(row)
    return rows


def _fmt_config(config: dict) -> str:
    return ",".join(f"{k}={'T' if v is True else 'F' if v is False else v}" for k, v in config.items()) or "-"


def format_report(rows: list[dict]) -> str:
    """The report as a fixed-width text table."""
    head = ["kernel", "config", "sm", "regs", "smem", "stack", "spill", "f64", "thr", "blk/SM", "warps",
            "occ", "limiter", "guard"]
    table = [head]
    dash = "-"
    for r in rows:
        table.append([
            r["name"], _fmt_config(r["config"]), f"{r['cc'][0]}{r['cc'][1]}",
            *(dash if r[k] is None else str(r[k]) if k != "smem" or not r.get("dyn_smem") else f"{r[k]}+{r['dyn_smem']}"
              for k in ("regs", "smem", "stack", "spills", "f64", "threads", "blocks_per_sm", "warps_per_sm")),
            dash if r["occupancy"] is None else f"{r['occupancy']:.0%}", r["limiter"] or dash,
            "ok" if not r["problems"] else f"{len(r['problems'])} problem(s)",
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 2 or i >= 12 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [p for r in rows for p in r["problems"]]
    foot = ["", "regs: registers/thread; smem: static shared bytes/block (+ dynamic bytes the launcher asks for); "
                "stack, spill: bytes/thread (ptxas -v);",
            "occupancy from the published per-SM limits (flashnb.inspect.SM_LIMITS), at thr threads/block."]
    return "\n".join(lines + foot + (["", "problems:"] + ["  " + p for p in notes] if notes else []))


def inspect_parser() -> argparse.ArgumentParser:
    """The ``flashnb inspect`` argument parser."""
    from .argtypes import int_in

    p = argparse.ArgumentParser(prog="flashnb inspect",
                                description="Print registers, static shared memory, stack, spills and occupancy of "
                                            "every registered kernel on sm_75 / sm_80 / sm_90, compiled with ptxas "
                                            "(no GPU needed).")
    p.add_argument("--cc", action="append", default=None, metavar="MAJOR.MINOR",
                   help="compute capability to compile for (repeatable; default 7.5, 8.0 and 9.0)")
    p.add_argument("--threads", type=int_in(1, 1024), default=None,
                   help="threads per block (1..1024) for every kernel's occupancy")
    p.add_argument("--kernel", action="append", default=None, help="only this registered kernel (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    return p


def main_inspect(argv=None) -> int:
    """``flashnb inspect``: print the resource/occupancy table of every registered kernel."""
    p = inspect_parser()
    args = p.parse_args(argv)
    try:
        ccs = [tuple(int(x) for x in s.split(".")) for s in args.cc] if args.cc else [(7, 5), (8, 0), (9, 0)]
        for cc in ccs:
            _limits(cc)
        names = args.kernel
        if names:
            for n in names:
                if n not in KERNELS:
                    raise ValueError(f"--kernel must be one of {sorted(KERNELS)}, got {n!r}")
    except ValueError as exc:
        p.error(str(exc))
    rows = report(ccs, threads=args.threads, names=names)
    if args.json:
        print(json.dumps(rows, default=list, indent=1))
    else:
        print(format_report(rows))
    return 1 if any(r["problems"] for r in rows) else 0


def _main(argv=None) -> Any:  # pragma: no cover
    return main_inspect(argv)
