"""The table behind ``flashnb inspect``: resources, occupancy and its limiter for every registered kernel."""

from __future__ import annotations

import argparse
import json
from typing import Any, Iterable, Mapping

from ..registry import KERNELS, KernelSpec
from .compiled import resources_many
from .guard import problems
from .jobs import _threads
from .occupancy import _limits, occupancy

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


def report(ccs=((7, 5), (8, 0), (9, 0)), threads=None, names: Iterable[str] | None = None, *,
           progress: bool = True) -> list[dict]:
    """One row per (registered kernel, config, cc): resources, occupancy and its limiter.

    ``threads`` overrides the block size used for occupancy: an int for every kernel, or a mapping
    ``{name: int | f(**config)}``; otherwise the spec's ``threads`` is used (occupancy blank if unknown).
    On the simulator the kernels whose PTX is not cached yet compile in child processes (NVVM: every kernel at
    once takes many minutes on a few cores); a line on stderr says so and a progress bar follows them
    (``progress=False``: silent).
    """
    specs = [KERNELS[n] for n in (names if names is not None else KERNELS)]
    # a tensor-core kernel's configs only on the architectures they declare (registry: kernel_factory(archs=))
    jobs = [(s.name, c, tuple(cc)) for s in specs for c in s.configs for cc in ccs if s.supports(c, cc)]
    results = resources_many(jobs, progress="flashnb inspect" if progress else None)
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
            "occupancy from the published per-SM limits (flashnb.instruments.SM_LIMITS), at thr threads/block."]
    return "\n".join(lines + foot + (["", "problems:"] + ["  " + p for p in notes] if notes else []))


def inspect_parser() -> argparse.ArgumentParser:
    """The ``flashnb inspect`` argument parser."""
    from ..argtypes import int_in

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
