"""Compile jobs -- a registered kernel, a kernel in an importable module, or one shipped as source -- here in a
GPU-mode process, or in child processes started with ``FLASHNB_DEVICE=gpu`` when this process runs the simulator
(``NUMBA_ENABLE_CUDASIM`` is read once per process, so ``numba.cuda.compile_ptx`` does not exist in it; NVVM and
ptxas need no driver and no GPU).

NVVM (numba's front end, then libNVVM) costs far more per kernel than ptxas, so a batch is arranged around it:

* one NVVM pass per (kernel, config), for the lowest cc asked for -- cc 8.0 when only 8.0 and 9.0 are asked for,
  so a request for 9.0 alone shares its PTX (and the disk cache's entry) with one for 8.0; ptxas assembles that PTX
  for every cc, with the ``.target`` line rewritten (:func:`flashnb.instruments.ptxas.retarget_ptx`).  NVVM's PTX
  for cc 8.0 and 9.0 is the same but for ``.target`` and symbol names
  (:func:`~flashnb.instruments.ptxas.normalized_ptx`);
  ``tests/instruments/test_ptx_guard.py`` re-checks that on a sample, and ``resources_many(..., reuse_ptx=False)`` runs
  NVVM per cc.  Were NVVM's cc 9.0 output ever to differ for a kernel outside that sample, its sm_90 row would describe
  the sm_80 PTX assembled for sm_90 -- what the driver's JIT runs from an sm_80 build.
* the groups are dealt over ``$FLASHNB_INSPECT_PROCESSES`` child processes (default: the CPUs, at most 4), and in
  each, ptxas runs in a thread pool while NVVM compiles the next kernel.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

from .. import runtime
from ..registry import KERNELS, KernelSpec
from .ptx_cache import _cached_ptx, _ptx_key, _store_ptx
from .ptxas import Resources, _compile_error, _nvvm, _ptx_resources, retarget_ptx
from .shipping import _REBUILD_ERROR, _rebuild_function


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


_SAME_PTX = {(8, 0), (9, 0)}   # ccs whose NVVM output differs only in .target (checked by the guard's test)


def _nvvm_cc(jobs: list[dict], group: list[int], reuse_ptx: bool) -> tuple:
    """The cc of a group's NVVM pass: its lowest, or 8.0 when every cc asked for is 8.0 or 9.0."""
    ccs = {tuple(jobs[i]["cc"]) for i in group}
    if reuse_ptx and ccs <= _SAME_PTX:
        return (8, 0)
    return min(ccs)


def _job_signature(job: dict) -> str | None:
    if "signature" in job:
        return job["signature"]
    spec = KERNELS.get(job.get("name"))
    return spec.signature_for(job["config"]) if spec is not None else None


def _compile_jobs(jobs: list[dict], *, reuse_ptx: bool = True, ptxas_threads: int = 2,
                  done=None) -> list[Resources]:
    """Compile ``jobs`` in this (GPU-mode) process.

    One NVVM pass per kernel and config, for the lowest cc asked for; with ``reuse_ptx`` its PTX, retargeted
    (:func:`retarget_ptx`), is what ptxas assembles for the higher ccs too (``reuse_ptx=False``: a separate
    NVVM pass per cc).  NVVM runs here, one kernel after another; each ptxas is a process of its own, run by
    a pool of ``ptxas_threads`` threads while NVVM goes on with the next kernel.  ``done(n, name)``, if given, is
    told as each NVVM group of ``n`` jobs is through NVVM (or failed)."""
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
                if done is not None:
                    done(len(group), first.get("name", first.get("attr", "?")))
                continue
            cc_nvvm = _nvvm_cc(jobs, group, reuse_ptx)
            key = _ptx_key(first, sig, cc_nvvm) if reuse_ptx else None
            ptx = _cached_ptx(key)
            if ptx is None:
                try:
                    try:
                        ptx = _nvvm(kernel, sig, cc_nvvm)
                    except Exception:
                        if cc_nvvm == tuple(first["cc"]):
                            raise
                        key = None                     # not for 8.0: compile for the cc asked for, uncached
                        ptx = _nvvm(kernel, sig, tuple(first["cc"]))
                except Exception as exc:
                    for i in group:
                        out[i] = _compile_error(exc, name, config, tuple(jobs[i]["cc"]))
                    if done is not None:
                        done(len(group), name)
                    continue
                _store_ptx(key, ptx)
            for i in group:
                cc = tuple(jobs[i]["cc"])
                pending.append((i, threads, pool.submit(_ptx_resources, retarget_ptx(ptx, cc), name, config, cc)))
            if done is not None:
                done(len(group), name)
        for i, threads, fut in pending:
            out[i] = fut.result()
            out[i].threads = threads
    return out


def _worker() -> None:
    """Child-process entry point: JSON jobs on stdin, JSON results on stdout."""
    import flashnb  # noqa: F401  (registers every stage)

    payload = json.load(sys.stdin)
    keep_ptx = bool(payload.get("keep_ptx"))

    def done(n, name):                   # one line per NVVM group, read by the parent's progress bar
        sys.stderr.write(f"{_PROGRESS} {n} {name}\n")
        sys.stderr.flush()

    out = []
    for res in _compile_jobs(payload["jobs"], reuse_ptx=payload.get("reuse_ptx", True),
                             done=done if payload.get("progress") else None):
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


_PROGRESS = "@@FLASHNB-DONE@@"


def _one_child(jobs: list[dict], keep_ptx: bool, reuse_ptx: bool, timeout: float, tick=None) -> list[Resources]:
    """``jobs`` compiled in one child process; ``tick(n, name)`` is called (from this thread) as each NVVM group
    of ``n`` jobs is through NVVM there."""
    import threading

    env = dict(os.environ)
    env["FLASHNB_DEVICE"] = "gpu"
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    root = str(Path(__file__).resolve().parents[2])   # the directory holding the flashnb package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    payload = json.dumps({"jobs": jobs, "keep_ptx": keep_ptx, "reuse_ptx": reuse_ptx, "progress": tick is not None})
    proc = subprocess.Popen([sys.executable, "-c", "from flashnb.instruments.jobs import _worker; _worker()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True)
    reader.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    stderr: list[str] = []
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
        for line in proc.stderr:          # the child's progress lines as they come, the rest kept for errors
            if line.startswith(_PROGRESS + " ") and tick is not None:
                n, _, name = line[len(_PROGRESS) + 1:].strip().partition(" ")
                tick(int(n), name)
            else:
                stderr.append(line)
        proc.wait()
        reader.join()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
    out, err = "".join(stdout), "".join(stderr)
    marker = "\n@@FLASHNB-JSON@@\n"
    if proc.returncode != 0 or marker not in out:
        raise RuntimeError(f"PTX compile subprocess failed (rc {proc.returncode}):\n{err[-3000:]}")
    return [Resources.from_json(d) for d in json.loads(out.split(marker, 1)[1])]


def _progress_bar(groups: list[list[int]], children: int, what: str | None):
    """``(tick, close)`` for a batch whose ``groups`` need NVVM: a line saying what runs and where its PTX is kept,
    and a tqdm bar over their jobs on stderr (``what`` None: no output, a no-op tick)."""
    if what is None or not groups:
        return None, lambda: None
    import threading

    from tqdm.auto import tqdm

    from .ptx_cache import ptx_cache_dir

    total = sum(len(g) for g in groups)
    folder = ptx_cache_dir()
    kept = (f"NVVM's PTX is kept in {folder}, so the next run only runs ptxas" if folder is not None else
            "the PTX cache is off (FLASHNB_PTX_CACHE)")
    print(f"{what}: compiling {total} kernel build(s) for a GPU -- {len(groups)} NVVM pass(es), seconds to a minute "
          f"each, in {children} child process(es); {kept}", file=sys.stderr)
    bar = tqdm(total=total, desc=what, unit="build", file=sys.stderr)
    lock = threading.Lock()

    def tick(n, name):
        with lock:
            bar.set_postfix_str(name, refresh=False)
            bar.update(n)

    return tick, bar.close


def _in_subprocess(jobs: list[dict], keep_ptx: bool = False, timeout: float = 1800, *,
                   reuse_ptx: bool = True, progress: str | None = None) -> list[Resources]:
    """Compile ``jobs`` in child processes started with ``FLASHNB_DEVICE=gpu`` (:func:`_processes` of them,
    each given whole NVVM groups, dealt round-robin so the big kernels of one module are spread out).  Groups
    whose PTX is in the disk cache (:func:`ptx_cache_dir`) need no child: ptxas runs from here.  ``progress``
    (a name for the work, e.g. ``"flashnb inspect"``): when any group needs NVVM, say so on stderr and show a
    progress bar over the jobs as the children finish their NVVM passes."""
    out: list[Resources | None] = [None] * len(jobs)
    groups, cached = [], []
    for g in _groups(jobs, reuse_ptx):
        first = jobs[g[0]]
        ptx = _cached_ptx(_ptx_key(first, _job_signature(first), _nvvm_cc(jobs, g, True))) if reuse_ptx else None
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
            tick, close = _progress_bar(groups, n, progress)
            try:
                with ThreadPoolExecutor(max_workers=n) as children:
                    futures = [children.submit(_one_child, [jobs[i] for i in share], keep_ptx, reuse_ptx, timeout,
                                               tick) for share in shares]
                    results = [f.result() for f in futures]
            finally:
                close()
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

