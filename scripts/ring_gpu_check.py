"""Ring attention on the GPUs of one machine: NCCL, one rank per GPU, flashnb's fa2 kernels on CUDA tensors.

    python scripts/ring_gpu_check.py --out results/gpu/<date>_<gpu>    # a machine with 2 or more GPUs
    python scripts/ring_gpu_check.py --rehearse                         # any machine: gloo, the simulator

For every layout and both modes (causal), each rank checks forward and gradients against float64 on a short
sequence, then times forward and backward on a long one (CUDA events, median of --reps) and records the bytes
it sent (beside the formula), each step's compute and wait time and its peak GPU memory.  With --out the rows
go to ``ring_gpu_check.json`` there, exactly as measured.

--rehearse runs the same steps here before a GPU is lent: CPU ranks on gloo, the kernels on the simulator
through flashnb's CUDA-tensor path (rehearsed), tiny sizes.  It prints correctness and counted bytes only;
its rows say ``"mode_of_run": "rehearsal"`` and hold no time or memory figure.  With fewer than 2 GPUs (and no
--rehearse) nothing is measured: a ring needs two ranks, and NCCL one GPU per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _cases(args, world):
    out = []
    for layout in ("contiguous", "zigzag", "striped"):
        for mode in ("ring", "allgather"):
            out.append(dict(layout=layout, mode=mode, causal=True, N=args.n_per_rank * world,
                            check_N=args.check_per_rank * world, B=1, H=args.heads, H_kv=args.kv_heads, d=args.d))
    return out


def _table(rows, rehearse):
    head = f"{'layout':>10} {'mode':>9} {'W':>2} {'N':>7} {'ok':>3} {'max err':>8} {'sent/formula fwd':>17}"
    head += "" if rehearse else f" {'fwd ms':>8} {'bwd ms':>8} {'peak MiB':>9}"
    lines = [head]
    for r in rows:
        err = max(r["errors"].values())
        frac = f"{r['sent_bytes']['forward']:,}/{r['formula_bytes']['forward']:,}"
        line = f"{r['layout']:>10} {r['mode']:>9} {r['world']:>2} {r['N']:>7} {'yes' if r['ok'] else 'NO':>3} " \
               f"{err:>8.1e} {frac:>17}"
        if not rehearse:
            line += f" {r['fwd_ms']:>8.2f} {r['bwd_ms']:>8.2f} {r['peak_bytes'] / 2**20:>9.1f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rehearse", action="store_true", help="CPU ranks on gloo and the simulator; measures nothing")
    p.add_argument("--world", type=int, default=None, help="ranks (default: every GPU; rehearsal: 4)")
    p.add_argument("--n-per-rank", type=int, default=None, help="tokens per rank of the timed run")
    p.add_argument("--check-per-rank", type=int, default=None, help="tokens per rank of the float64 check")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--d", type=int, default=None)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="folder for ring_gpu_check.json (measured rows only)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds for the whole run")
    a = p.parse_args(argv)
    if a.rehearse:
        os.environ["FLASHNB_DEVICE"] = "sim"
    try:
        import torch
    except ImportError:
        print("ring_gpu_check: needs PyTorch (pip install 'flashnb[torch]'); nothing measured")
        return 2
    from flashnb.distributed import launch, measure

    small = dict(n_per_rank=8, check_per_rank=8, heads=2, kv_heads=1, d=16)
    large = dict(n_per_rank=4096, check_per_rank=256, heads=8, kv_heads=2, d=64)
    for key, value in (small if a.rehearse else large).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if a.rehearse:
        world, backend, start = a.world or 4, "gloo", None
    else:
        world, backend, start = a.world or gpus, "nccl", "spawn"
        if gpus < 2 or world < 2 or world > gpus:
            print(f"ring_gpu_check: a ring needs 2 or more ranks and NCCL one GPU per rank; this machine has {gpus} "
                  f"GPU(s) (world {world}); nothing measured")
            return 2
    cases = _cases(a, world)
    t0 = time.perf_counter()
    out = launch.run(measure.measure_cases, world, cases, reps=1 if a.rehearse else a.reps, rehearse=a.rehearse,
                     backend=backend, start_method=start, timeout=a.timeout, group_timeout=min(300.0, a.timeout))
    rows = [row for rank_rows in out for row in rank_rows]
    label = "rehearsal (gloo on CPU, simulator kernels): nothing here is a measurement" if a.rehearse else \
        f"measured: NCCL, {world} x {torch.cuda.get_device_name(0)}"
    print(f"ring_gpu_check, {label}; {time.perf_counter() - t0:.0f} s")
    print(_table([r for r in rows if r["rank"] == 0], a.rehearse))
    ok = all(r["ok"] and r["sent_bytes"] == r["formula_bytes"] for r in rows)
    if a.out:
        nccl = None if a.rehearse else torch.cuda.nccl.version()
        meta = dict(mode_of_run="rehearsal" if a.rehearse else "measured", world=world, backend=backend,
                    torch=torch.__version__, gpu=None if a.rehearse else torch.cuda.get_device_name(0),
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                    reps=1 if a.rehearse else a.reps)
        path = Path(a.out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "ring_gpu_check.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        print(f"wrote {path / 'ring_gpu_check.json'}")
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
