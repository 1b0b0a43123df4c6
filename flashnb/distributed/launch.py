"""Start W ranks on this machine from Python (tests, notebooks), each in its own process.

``run(worker, W, ...)`` starts W processes, sets up a process group in each (gloo by default, on a free local
port, with a timeout), calls ``worker(rank, world, *args, **kwargs)`` and returns the results in rank order.
The worker must be importable -- a function at module level of a module (a function defined in a notebook
cell or on stdin cannot be sent to another process) -- and its result picklable (NumPy arrays, dicts).

Processes come from a ``forkserver`` that imports torch and flashnb once, so a run starts in a fraction of a
second instead of paying torch's import in every rank.  Each rank uses one torch thread (W ranks share the
machine's cores).  A rank that raises, or a run that outlives ``timeout``, raises
:class:`~flashnb.distributed.errors.RanksFailed` with every rank's error; processes still running then are
terminated.  From a shell, ``torchrun --standalone --nproc_per_node W -m flashnb.distributed.demo`` is the
other way in.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta

from .errors import RanksFailed

__all__ = ["run", "free_port"]

_PRELOAD = ["torch", "torch.distributed", "flashnb", "flashnb.distributed"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it): for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _context(start_method: str | None):
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be None, 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _reference(worker) -> tuple[str, str]:
    module, name = getattr(worker, "__module__", None), getattr(worker, "__qualname__", "")
    if not callable(worker) or module in (None, "__main__", "__mp_main__") or "<locals>" in name or "." in name:
        raise TypeError(f"worker must be a function defined at module level of an importable module (a function "
                        f"from a notebook cell, __main__ or another function cannot be started in another "
                        f"process), got {worker!r}")
    return module, name


def _rank_main(ref, rank, world, port, backend, group_timeout_s, threads, env, args, kwargs, results):
    """One rank: process group, worker, result (or the error) onto the queue."""
    try:
        os.environ.update(env)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":                   # one GPU per rank, chosen before the group exists
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=group_timeout_s))
        try:
            worker = getattr(importlib.import_module(ref[0]), ref[1])
            results.put((rank, "ok", worker(rank, world, *args, **kwargs)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:        # noqa: BLE001 -- every failure goes back to the parent, named
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


def run(worker, world: int, *args, backend: str = "gloo", timeout: float = 120.0, group_timeout: float = 30.0,
        threads: int = 1, port: int | None = None, env: dict | None = None, start_method: str | None = None,
        **kwargs) -> list:
    """``[worker(0, W, *args, **kwargs), …, worker(W−1, W, …)]``, each in its own process with a process group.

    ``timeout``: seconds for the whole run (then the remaining processes are terminated);
    ``group_timeout``: the process group's timeout (its collectives and transfers); ``port``: the rendezvous
    port (default: :func:`free_port`); ``env``: environment variables set in each rank before the worker
    runs; ``start_method``: None (``"forkserver"`` where there is one), ``"forkserver"`` or ``"spawn"`` -- use
    ``"spawn"`` with ``backend="nccl"``: importing flashnb on a GPU machine initialises the CUDA driver, and a
    process forked after that cannot use CUDA.  With NCCL, rank ``r`` uses GPU ``r mod (GPUs)``.
    Raises :class:`~flashnb.distributed.errors.RanksFailed` if any rank raised or did not finish.
    """
    ref = _reference(worker)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1 (the number of ranks), got {world!r}")
    ctx = _context(start_method)
    for attempt in range(3):            # a port taken between free_port() and the rendezvous: try another
        results = ctx.Queue()
        p = port if port is not None else free_port()
        procs = [ctx.Process(target=_rank_main, args=(ref, r, world, p, backend, group_timeout, threads,
                                                      dict(env or {}), args, kwargs, results), daemon=True)
                 for r in range(world)]
        for proc in procs:
            proc.start()
        got, deadline = {}, time.monotonic() + timeout
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
                got[rank] = (status, value)
                if status == "error" and port is None and "address already in use" in value[1].lower():
                    break                       # the others would wait for a rendezvous that cannot happen
            except queue_module.Empty:
                if all(not proc.is_alive() for proc in procs) and results.empty():
                    break
        for proc in procs:
            proc.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if len(got) == world else 0.5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
        errors = {r: v for r, (s, v) in got.items() if s == "error"}
        for r in range(world):
            if r not in got:
                errors[r] = ("Timeout" if time.monotonic() >= deadline else "Died",
                             f"rank {r} did not finish within {timeout:.0f} s" if time.monotonic() >= deadline
                             else f"rank {r} ended without a result (exit code {procs[r].exitcode})", "")
        if errors and port is None and attempt < 2 and any("address already in use" in e[1].lower()
                                                           for e in errors.values()):
            continue
        break
    if errors:
        lines = "; ".join(f"rank {r}: {e[0]}: {e[1].splitlines()[0] if e[1] else ''}"
                          for r, e in sorted(errors.items()))
        raise RanksFailed(f"{len(errors)} of {world} ranks failed: {lines}", errors,
                          {r: v for r, (s, v) in got.items() if s == "ok"})
    return [got[r][1] for r in range(world)]
