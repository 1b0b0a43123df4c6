"""Stage 6's goals, measured without a GPU, as a table: ``python scripts/stage6_goals.py``.

Every number comes from a tool run here and now: the SASS instruction mix (:mod:`flashnb.instruments.sass`, ptxas +
nvdisasm), ptxas's resources (:mod:`flashnb.instruments`), the simulator's memory profiler
(:func:`flashnb.sim.profile`, full tiles) and the SASS time model (:mod:`flashnb.instruments.sass_model`) at the FA2
paper's benchmark shapes (N = 4096, batch 4, hidden 2048: 32 heads at d = 64, 16 at d = 128) on an H100 SXM.
Stage 4's kernels are measured beside stage 6's.  Writes ``benchmarks/stage6_goals.md`` (``--out``) and
prints it.  Takes about 3 minutes on 2 cores (it compiles every kernel for sm_90).
"""

from __future__ import annotations

import argparse
import datetime
import sys

from report import GOAL_COLUMNS, markdown_table, write_report  # scripts/report.py

import flashnb  # noqa: F401  (selects the simulator before numba.cuda is imported)
from flashnb import cli
from flashnb import instruments as fi
from flashnb.instruments import sass, sass_model
from flashnb.registry import KERNELS
from flashnb.stages import fa2, fa2_fast

GPU = "H100 SXM"
CC = (9, 0)
HEADS = {64: 32, 128: 16}          # hidden 2048 = heads x d; batch 4 at N = 4096 (the FA2 paper's sweep)


def _bwd_config(module, d):
    """The backward kernel's default configuration at head dim ``d`` (None: stage 6 has no backward kernel)."""
    if module is fa2:
        return dict(fa2.default_tiles(d, "backward"), d=d, causal=False)
    if "fa2_fast.backward" not in KERNELS:
        return None
    return dict(fa2_fast.bwd_default_tiles(d), d=d, causal=False)


def rows():
    out = []
    mark = lambda ok: "yes" if ok else "**no**"
    for d in (64, 128):
        for module, kernel in ((fa2, "fa2.forward"), (fa2_fast, "fa2_fast.forward")):
            cfg = module.sass_config(d, False)
            s = sass.sass(kernel, config=cfg, cc=CC)
            f = s.fma_fraction(s.hot_loop)
            goal = kernel.startswith("fa2_fast")
            out.append((f"forward hot loop FFMA share, d={d}", kernel, ">= 70 %", f"{100 * f:.1f} %",
                        mark(f >= 0.70) if goal else "(stage 4)", f"`flashnb sass {kernel} --config ...` {cfg}"))
        for module, kernel in ((fa2, "fa2.backward"), (fa2_fast, "fa2_fast.backward")):
            cfg = _bwd_config(module, d)
            if cfg is None:
                out.append((f"backward hot loop FFMA share, d={d}", kernel, ">= 50 %", "not built", "**no**",
                            "the impl runs stage 4's backward"))
                continue
            s = sass.sass(kernel, config=cfg, cc=CC)
            f = s.fma_fraction(s.hot_loop)
            inner = [s.instructions[a:b + 1] for a, b in s.innermost_loops()]
            worst = min(s.fma_fraction(i) for i in inner if any(x.category == "ffma" for x in i))
            goal = kernel.startswith("fa2_fast")
            out.append((f"backward hot loop FFMA share, d={d}", kernel, ">= 50 %",
                        f"{100 * f:.1f} % (every FFMA loop >= {100 * worst:.1f} %)",
                        mark(f >= 0.50) if goal else "(stage 4)", str(cfg)))
    for kernel, configs in (("fa2_fast.forward", [fa2_fast.sass_config(d, c) for d in (64, 128) for c in (0, 1)]),
                            ("fa2_fast.backward", [_bwd_config(fa2_fast, d) for d in (64, 128)])):
        if kernel not in KERNELS or None in configs:
            continue
        res = fi.resources_many([(kernel, c, cc) for c in configs for cc in ((8, 0), CC)])
        worst = max(r.spill_store_bytes + r.spill_load_bytes + r.stack_bytes for r in res)
        regs = max(r.registers for r in res)
        out.append(("spills / local memory (bytes)", kernel, "0", f"{worst} (max registers {regs})", mark(worst == 0),
                    "ptxas, sm_80 and sm_90, default tiles, causal off/on"))
    prof_rows = cli.profile_rows(["fa2", "fa2-fast"], BH=1, Nq=64, Nk=64, d=64)
    for r in prof_rows:
        goal = r["impl"] == "fa2-fast" and (r["pass"] == "forward" or "fa2_fast.backward" in KERNELS)
        ld, ideal = r["global_ld"], r["global_ld_ideal"]
        out.append((f"shared bank conflicts, {r['pass']}", r["impl"], "0", f"{r['bank_conflicts']:,}",
                    mark(r["bank_conflicts"] == 0) if goal else "(not stage 6's)", "simulator profile, N=64, d=64"))
        out.append((f"global load sectors/request, {r['pass']}", r["impl"], f"ideal {ideal:.2f}", f"{ld:.2f}",
                    mark(abs(ld - ideal) < 1e-9) if goal else "(not stage 6's)", "simulator profile, N=64, d=64"))
    for d in (64, 128):
        for kernel in ("fa2.forward", "fa2_fast.forward"):
            t = sass_model.forward_time(kernel, 4 * HEADS[d], 4096, 4096, d, gpu=GPU, cc=CC)
            f = t.fraction_of_peak()
            goal = kernel.startswith("fa2_fast")
            out.append((f"modelled % of FP32 peak, N=4096, d={d}", kernel, ">= 50 %",
                        f"{100 * f:.1f} % ({t.tflops:.1f} TFLOP/s)", mark(f >= 0.5) if goal else "(stage 4)",
                        f"{GPU}, {t.bound}-bound, {t.blocks_per_sm} blocks/SM, tile FFMA "
                        f"{100 * t.tile_ffma_fraction:.0f} %"))
    return out


def table(rs) -> str:
    return markdown_table(GOAL_COLUMNS, rs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/stage6_goals.md")
    args = ap.parse_args(argv)
    rs = rows()
    text = (f"# Stage 6 goals, measured without a GPU\n\n"
            f"Made by `python scripts/stage6_goals.py` on {datetime.date.today().isoformat()}; SASS for sm_90 "
            f"with the pinned toolchain. *Modelled* times are the SASS time model of "
            f"`flashnb.instruments.sass_model` (issue rate, FP32/MUFU/shared pipes, HBM bytes of the traffic model, "
            f"list scheduling), not measurements; "
            f"it ignores latency the warps cannot hide, so it is an upper bound on speed.\n\n{table(rs)}\n")
    return write_report(args.out, text)


if __name__ == "__main__":
    sys.exit(main())
