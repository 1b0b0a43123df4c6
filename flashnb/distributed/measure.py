"""What a run on GPUs measures, per case and rank: correctness against float64 on a small sequence, then on a
long one the forward and backward time (CUDA events, median of ``reps``), the bytes sent against the formula,
each step's compute and wait time, and the peak GPU memory.  ``scripts/ring_gpu_check.py`` starts it on every
GPU of a machine (NCCL).

``rehearse=True`` runs the same steps on CPU ranks (gloo) with the kernels on the simulator and flashnb's
CUDA-tensor path rehearsed (:func:`flashnb.pytorch.rehearse_cuda`): every row says ``mode="rehearsal"`` and
carries no time and no memory figure -- nothing there is a measurement.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from . import model
from .blocks import Kernels
from .demo import check, inputs
from .function import ring_attention
from .layouts import shard
from .stats import RingStats

__all__ = ["measure_cases", "CASE_KEYS"]

CASE_KEYS = ("layout", "mode", "causal", "N", "check_N", "B", "H", "H_kv", "d")


@contextlib.contextmanager
def _rehearsing(rehearse: bool):
    if not rehearse:
        yield
        return
    from .. import pytorch as ftorch
    from ..instruments.rehearsal import pretend_gpu

    with pretend_gpu(), ftorch.rehearse_cuda():
        yield


def _clock(device):
    """``mark() -> token``, ``seconds(a, b)``: CUDA events on a CUDA device, perf_counter elsewhere."""
    if device.type == "cuda":
        def mark():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        def seconds(a, b):
            b.synchronize()
            return a.elapsed_time(b) / 1e3

        return mark, seconds
    return time.perf_counter, lambda a, b: b - a


def _one(rank, world, case, impl, device, reps, rehearse):
    B, H, H_kv, d, N = case["B"], case["H"], case["H_kv"], case["d"], case["N"]
    q, k, v, do = (shard(t, layout=case["layout"], rank=rank, world=world).to(device)
                   for t in inputs(N, B=B, H=H, H_kv=H_kv, d=d, seed=1))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    mark, seconds = _clock(device)
    fwd, bwd = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    args = dict(causal=case["causal"], layout=case["layout"], mode=case["mode"], impl=impl)
    for _ in range(reps):                        # timed without stats (their CUDA events synchronise a phase start)
        q.grad = k.grad = v.grad = None
        dist.barrier()
        t0 = mark()
        o = ring_attention(q, k, v, **args)
        t1 = mark()
        o.backward(do)
        t2 = mark()
        fwd.append(seconds(t0, t1))
        bwd.append(seconds(t1, t2))
    stats = RingStats()                          # one more run, untimed, for the per-step record
    ring_attention(q, k, v, stats=stats, **args).backward(do)
    totals = {phase: stats.totals(phase=phase, rank=rank) for phase in ("forward", "backward")}
    row = dict({key: case[key] for key in CASE_KEYS}, rank=rank, world=world, impl=repr(impl),
               mode_of_run="rehearsal" if rehearse else "measured",
               sent_bytes={p: t["sent_bytes"] for p, t in totals.items()},
               formula_bytes={p: model.comm_bytes(case["mode"], p, world, B, N // world, H_kv, d, 4)
                              for p in totals},
               pairs={p: t["pairs"] for p, t in totals.items()})
    if rehearse:
        row.update(fwd_ms=None, bwd_ms=None, steps=None, peak_bytes=None)
    else:
        row.update(fwd_ms=1e3 * statistics.median(fwd), bwd_ms=1e3 * statistics.median(bwd),
                   steps=[dict(phase=r.phase, step=r.step, compute_ms=1e3 * r.compute_s, wait_ms=1e3 * r.wait_s)
                          for r in stats.records],
                   peak_bytes=int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None)
    return row


def measure_cases(rank: int, world: int, cases: list, *, reps: int = 3, rehearse: bool = False) -> list:
    """Every case (a dict of :data:`CASE_KEYS`) on this rank: the check at ``check_N`` tokens, then the timed
    run at ``N``; returns one row per case (see the module docstring)."""
    device = torch.device("cuda", torch.cuda.current_device()) if (torch.cuda.is_available() and not rehearse) \
        else torch.device("cpu")
    impl = Kernels("flash", Br=16, Bc=16, warps=1) if rehearse else Kernels("flash")
    rows = []
    with _rehearsing(rehearse):
        for case in cases:
            ok = check(rank, world, N=case["check_N"], B=case["B"], H=case["H"], H_kv=case["H_kv"], d=case["d"],
                       layout=case["layout"], mode=case["mode"], causal=case["causal"], impl=impl, device=str(device))
            row = _one(rank, world, case, impl, device, reps, rehearse)
            row.update(ok=ok["ok"], errors={name: e["max_abs"] for name, e in ok["errors"].items()},
                       bounds={name: e["bound"] for name, e in ok["errors"].items()})
            rows.append(row)
    return rows
