"""Ring attention on W processes, checked against float64 attention on one device.

    torchrun --standalone --nproc_per_node 4 -m flashnb.distributed.demo            # CPU: gloo, the simulator
    torchrun --standalone --nproc_per_node 8 -m flashnb.distributed.demo --N 8192   # GPUs: NCCL, one GPU a rank

Every rank draws the same seeded q, k, v and dO for the whole sequence, keeps its shard, runs
:func:`flashnb.distributed.ring_attention` forward and backward, and the shards of o, dq, dk, dv are gathered
and compared with :mod:`flashnb.reference` (float64) on rank 0, which prints the errors against their
tolerances and each rank's bytes (beside the formula), attended pairs, compute and wait time.  The exit status
is 1 when a check fails.  :func:`check` is the same run as a function (for :func:`flashnb.distributed.launch.run`).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .. import reference, runtime
from . import model
from .blocks import Kernels, resolve_impl
from .function import _ring_attention
from .layouts import shard, unshard
from .stats import RingStats

__all__ = ["check", "inputs", "main", "TOLERANCES"]

#: Max ``|error|`` allowed against float64, relative to ``max |reference| + 1``: the float32 kernels' rounding over a
#: few hundred terms (~1e-6) plus one float32 merge per ring step, with a margin; a wrong block or a missing
#: merge is O(1).
TOLERANCES = {"o": 2e-5, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4}


def inputs(N: int, *, B: int = 1, H: int = 2, H_kv: int = 1, d: int = 16, seed: int = 0):
    """float32 ``q, k, v, do`` of the whole sequence, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, d, generator=g)
    k = torch.randn(B, H_kv, N, d, generator=g)
    v = torch.randn(B, H_kv, N, d, generator=g)
    do = torch.randn(B, H, N, d, generator=g)
    return q, k, v, do


def _gather(t: torch.Tensor, world: int) -> list:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return [p.cpu() for p in parts]


def _impl(impl):
    if impl in (None, "flash") and runtime.MODE == "sim":
        return Kernels("flash", Br=16, Bc=16, warps=1)     # small tiles: the simulator runs every thread in Python
    return resolve_impl(impl)


def check(rank: int, world: int, *, N: int = 64, B: int = 1, H: int = 2, H_kv: int = 1, d: int = 16,
          layout: str = "zigzag", mode: str = "ring", causal: bool = True, impl=None, seed: int = 0,
          device: str = "cpu", timeout: float | None = None, reference_check: bool = True, schedule=None) -> dict:
    """One forward and backward on this rank; returns (on every rank) the gathered errors against float64,
    their tolerances, every rank's stats rows and the formula's bytes.  ``impl``: None / "flash" (flashnb's
    kernels; small tiles on the simulator), "exact", another impl name, or a block computation object.
    ``schedule``: a :class:`~flashnb.distributed.ring.RingSchedule` subclass to run instead of the mode's."""
    q, k, v, do = inputs(N, B=B, H=H, H_kv=H_kv, d=d, seed=seed)
    local = [shard(t, layout=layout, rank=rank, world=world).to(device) for t in (q, k, v, do)]
    qs, ks, vs = (t.requires_grad_(True) for t in local[:3])
    stats = RingStats()
    block = impl if hasattr(impl, "forward") else _impl(impl)
    o = _ring_attention(qs, ks, vs, causal=causal, layout=layout, mode=mode, impl=block, stats=stats,
                        timeout=timeout, schedule=schedule, group=None, scale=None, dropout_p=0.0, seed=None)
    o.backward(local[3])
    got = {name: unshard(_gather(t.detach(), world), layout=layout, world=world).numpy()
           for name, t in (("o", o), ("dq", qs.grad), ("dk", ks.grad), ("dv", vs.grad))}
    rows = [None] * world
    dist.all_gather_object(rows, stats.rows())
    out = dict(world=world, N=N, B=B, H=H, H_kv=H_kv, d=d, layout=layout, mode=mode, causal=causal,
               impl=repr(block), backend=dist.get_backend(), stats=[r for part in rows for r in part],
               formula={phase: model.comm_bytes(mode, phase, world, B, N // world, H_kv, d, 4)
                        for phase in ("forward", "backward")})
    if reference_check:
        a = [t.numpy().astype(np.float64) for t in (q, k, v, do)]
        o_ref, _ = reference.attention_forward(a[0], a[1], a[2], causal=causal)
        dq_ref, dk_ref, dv_ref = reference.attention_backward(a[0], a[1], a[2], a[3], causal=causal)
        out["errors"] = {}
        for name, ref in (("o", o_ref), ("dq", dq_ref), ("dk", dk_ref), ("dv", dv_ref)):
            err = float(np.abs(got[name] - ref).max())
            bound = TOLERANCES[name] * (1.0 + float(np.abs(ref).max()))
            out["errors"][name] = dict(max_abs=err, bound=bound, ok=bool(np.isfinite(got[name]).all() and err <= bound))
        out["ok"] = all(e["ok"] for e in out["errors"].values())
    return out


def report(result: dict) -> str:
    """The printout of :func:`check`'s result."""
    r = result
    lines = [f"ring attention: W={r['world']} ({r['backend']}), N={r['N']}, B={r['B']}, H={r['H']}, H_kv={r['H_kv']}, "
             f"d={r['d']}, layout={r['layout']}, mode={r['mode']}, causal={r['causal']}, blocks: {r['impl']}"]
    for name, e in r.get("errors", {}).items():
        lines.append(f"  {name:>2}: max |error| vs float64 {e['max_abs']:.2e} (bound {e['bound']:.2e}) "
                     f"{'ok' if e['ok'] else 'FAILED'}")
    stats = RingStats.combine([r["stats"]])
    lines.append(f"  {'phase':<9}{'rank':>5}{'sent B':>12}{'formula B':>12}{'pairs':>9}{'compute s':>11}"
                 f"{'wait s':>9}{'held B':>11}")
    for phase in ("forward", "backward"):
        for rank in range(r["world"]):
            t = stats.totals(phase=phase, rank=rank)
            lines.append(f"  {phase:<9}{rank:>5}{t['sent_bytes']:>12,}{r['formula'][phase]:>12,}{t['pairs']:>9,}"
                         f"{t['compute_s']:>11.3f}{t['wait_s']:>9.3f}{t['kv_bytes_held']:>11,}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashnb.distributed.demo", description=__doc__.splitlines()[0])
    p.add_argument("--N", type=int, default=64, help="sequence length (all ranks together)")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=2, help="query heads")
    p.add_argument("--H-kv", type=int, default=1, help="K/V heads (a divisor of H)")
    p.add_argument("--d", type=int, default=16, help="head dim")
    p.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag", "striped"))
    p.add_argument("--mode", default="ring", choices=("ring", "allgather"))
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--impl", default="flash", help="'flash' (flashnb's product kernel), 'exact' (float64), or an "
                                                   "impl name")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl when CUDA is available)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="the process group's timeout: seconds any collective or transfer may take")
    a = p.parse_args(argv)
    backend = a.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = "cpu"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    torch.set_num_threads(1)
    dist.init_process_group(backend, timeout=timedelta(seconds=a.timeout))
    try:
        result = check(dist.get_rank(), dist.get_world_size(), N=a.N, B=a.B, H=a.H, H_kv=a.H_kv, d=a.d,
                       layout=a.layout, mode=a.mode, causal=not a.no_causal, impl=a.impl, device=device)
        if dist.get_rank() == 0:
            print(report(result), flush=True)
        return 0 if result["ok"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
