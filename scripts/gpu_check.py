#!/usr/bin/env python
"""Everything flashnb can only check on a real GPU, in one run of under five minutes.

0. The tensor-core intrinsics (``flashnb.kernels.tensorcore.mma``: mma.sync, ldmatrix, cp.async, the conversions)
   against their simulator twins' NumPy core on the same random fragments (``flashnb.kernels.tensorcore.check``):
   whether the fragment layouts the twins (and so every simulator test of ``impl="fa2-tc"``) assume are the hardware's.
   Rows ``impl=intrinsics`` of ``correctness.csv``; what the default (``impl="auto"``) then runs for half inputs:
   rows ``default impl for ...`` of ``measurements.csv``.
1. Correctness of every registered implementation (``flashnb.registry.IMPLS``) at realistic sizes
   (default B=2, H=4, N=1024, d=64, causal and not) against the float64 ``flashnb.reference``; an impl whose
   float32 path runs through TF32 tensor cores (``Impl.precision``) at TF32's tolerance.
2. Where ``ncu`` (Nsight Compute) is on PATH: DRAM bytes per kernel launch (``dram__bytes_read.sum``,
   ``dram__bytes_write.sum``) beside the analytic (modelled) traffic of the same call.
3. The notebooks' GPU measurements (softmax methods, block-sparse densities).
4. The tensor cores' speed: ``impl="fa2-tc"`` forward and backward in float16 at N = 4096, d = 64 and 128 (the FA2
   paper's batch 4, hidden 2048), TFLOP/s by the FlashAttention benchmark's formula, beside ``fa2-fast`` (float32
   SIMT) and torch's SDPA in float16 where torch has CUDA (rows of ``measurements.csv``).
5. The benchmark sweep (``flashnb.instruments.bench.sweep``): CUDA-event timings with provenance columns, until the
budget.

Everything measured goes under the output directory: ``--out``, else ``$OUT``, else ``results/gpu/``.
On the simulator it refuses (exit status 2): nothing it measures would mean anything there.

    python scripts/gpu_check.py [--out DIR] [--quick] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import flashnb  # noqa: E402  (chooses GPU or simulator before numba.cuda is imported)

# Forward outputs are float32 with fp32 accumulation over N=1024 keys: errors grow ~sqrt(N)·eps32 ≈ 4e-6
# relative; 2e-4 absolute + 2e-4 relative leaves room for exp() and the backward's longer reductions.
ATOL = 2e-4
RTOL = 2e-4
# TF32 (fa2-tc's float32 path) keeps 10 mantissa bits: inputs and P rounded by up to 2^-11 relative; on the
# simulator's O(1) problems the errors are <= 2e-3 (tests/kernels/test_flash_tc.py), at N = 1024 o is an average of 1024
# values
TF32_TOL = 5e-3
NCU_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum"


def default_out() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "results" / "gpu"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="output directory (default $OUT or results/gpu/)")
    p.add_argument("--impl", action="append", default=None, help="only these implementations (repeatable)")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--N", type=int, default=1024, help="sequence length of the correctness check")
    p.add_argument("--d", type=int, default=64, help="head dim of the correctness check")
    p.add_argument("--bench-N", type=int, action="append", default=None, help="sweep sizes (default 1024 2048 4096)")
    p.add_argument("--bench-d", type=int, action="append", default=None, help="sweep head dims (default 64 128)")
    p.add_argument("--measure-n", type=int, default=4096,
                   help="size of the notebooks' measurements (n x n softmax, N of block-sparse; default 4096)")
    p.add_argument("--tc-N", type=int, default=4096, help="sequence length of the tensor cores' speed step (default "
                   "4096, batch 4, 2048 / d heads; below 1024: one head, for a rehearsal)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--budget", type=float, default=270.0, help="seconds before remaining work is skipped")
    p.add_argument("--quick", action="store_true", help="small sweep (N 1024, d 64) and short repeats")
    p.add_argument("--no-ncu", action="store_true", help="skip the Nsight Compute DRAM measurement")
    p.add_argument("--ncu-child", nargs=4, metavar=("IMPL", "N", "D", "CAUSAL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("B", "H", "N", "d", "repeats", "measure_n"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.budget <= 0:
        p.error(f"--budget must be > 0, got {args.budget}")
    args.out = args.out if args.out is not None else default_out()
    if args.quick:
        args.bench_N = args.bench_N or [1024]
        args.bench_d = args.bench_d or [64]
        args.repeats = min(args.repeats, 5)
    args.bench_N = args.bench_N or [1024, 2048, 4096]
    args.bench_d = args.bench_d or [64, 128]
    return args


def write_rows(path: Path, rows: list[dict], provenance: dict) -> Path:
    """CSV of ``rows`` with the provenance columns appended to every row (header = union of keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**r, **provenance} for r in rows]
    cols = []
    for r in rows or [provenance]:
        cols += [k for k in r if k not in cols]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r.get(k) for k in cols})
    return path


# Impls for square Nq = Nk shapes only when asked for by name: flash-decoding is for a few queries against a KV
# cache (its own measurement is notebook 11's decode.measure_gpu); at Nq = N every group of 8 query rows re-reads
# the whole cache, which would spend the GPU's time budget on a shape it is not made for.
NOT_SQUARE = ("flash-decoding",)


def _impls(args, *, square: bool = False):
    from flashnb.registry import IMPLS

    names = args.impl or [n for n in IMPLS if not (square and n in NOT_SQUARE)]
    bad = [n for n in names if n not in IMPLS]
    if bad:
        raise SystemExit(f"--impl must be among {sorted(IMPLS)}, got {bad}")
    return names


def check_correctness(args, deadline: float) -> list[dict]:
    import numpy as np

    from flashnb import reference
    from flashnb.common import to_device
    from flashnb.registry import IMPLS

    rng = np.random.default_rng(1234)
    B, H, N, d = args.B, args.H, args.N, args.d
    shape = (B, H, N, d)
    q, k, v, do = (rng.standard_normal(shape) for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    rows = []
    refs = reference.ReferenceCache(q, k, v, do, scale=scale)   # dense, or each impl's own mask (block-sparse)

    for causal in (False, True):
        dev = [to_device(x.reshape(B * H, N, d)) for x in (q, k, v, do)]
        for name in _impls(args):
            tol = TF32_TOL if IMPLS[name].precision == "tf32" else ATOL
            row = dict(impl=name, B=B, H=H, N=N, d=d, causal=causal, atol=tol, rtol=tol)
            if time.monotonic() > deadline:
                rows.append({**row, "ok": "", "error": "skipped: time budget"})
                continue
            entry = IMPLS[name]
            try:
                o_ref, lse_ref, grads_ref = refs.for_impl(entry, causal)
                o, lse = entry.forward(*dev[:3], causal=causal, scale=scale)
                got = dict(o=o.copy_to_host().reshape(shape), lse=lse.copy_to_host().reshape(B, H, N))
                want = dict(o=o_ref, lse=lse_ref)
                if entry.backward is not None:
                    dq, dk, dv = entry.backward(*dev[:3], o, lse, dev[3], causal=causal, scale=scale)
                    for key, arr, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref):
                        got[key] = arr.copy_to_host().reshape(shape)
                        want[key] = ref
                ok = True
                for key in got:
                    a, r = got[key], want[key]
                    fin = np.isfinite(r)
                    err = float(np.max(np.abs(a[fin] - r[fin]) - tol * np.abs(r[fin]))) if fin.any() else 0.0
                    row[f"{key}_max_abs_err"] = float(np.max(np.abs(a[fin] - r[fin]))) if fin.any() else 0.0
                    good = (not np.isnan(a).any()) and err <= tol and np.array_equal(a[~fin], r[~fin])
                    ok &= bool(good)
                row["ok"] = ok
            except Exception as exc:
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
                traceback.print_exc()
            rows.append(row)
            print(f"correctness {name:>10} causal={causal!s:<5} {'OK' if row.get('ok') else 'FAIL'} "
                  f"{row.get('error', '')}", flush=True)
    return rows


def check_intrinsics() -> list[dict]:
    """Step 0: every tensor-core intrinsic on this GPU against its twin's NumPy core (``mma_check.run``)."""
    from flashnb.kernels.tensorcore import check as mma_check

    try:
        rows = mma_check.run(seed=0)
    except Exception as exc:
        traceback.print_exc()
        return [dict(impl="intrinsics", intrinsic="(all)", ok=False, error=f"{type(exc).__name__}: {exc}"[:300])]
    for r in rows:
        print(f"intrinsic {r['intrinsic']:<42} {'OK' if r['ok'] else 'FAIL'} ({r['mismatches']} of {r['values']} "
              f"differ, max {r['max_diff']:.3g})", flush=True)
    return [dict(impl="intrinsics", **r) for r in rows]


def tensorcore_speed(deadline: float, repeats: int = 10, N: int = 4096) -> list[dict]:
    """Step 4: fa2-tc (float16) beside fa2-fast (float32) and SDPA (float16) at the FA2 paper's shapes, N = 4096:
    median CUDA-event milliseconds and TFLOP/s (forward ``4·B·H·N²·d``, backward 2.5x that)."""
    import numpy as np

    from flashnb import common
    from flashnb.instruments import bench, roofline
    from flashnb.registry import IMPLS

    rows = []
    info = bench.device_info()
    for d, H in ((128, 16), (64, 32)):
        B = 4
        if N < 1024:                          # a rehearsal's size
            B, H = 1, 1
        rng = np.random.default_rng(0)
        x32 = [rng.standard_normal((B * H, N, d), dtype=np.float32) for _ in range(4)]
        for impl, storage in (("fa2-tc", "float16"), ("fa2-fast", "float32")):
            entry = IMPLS[impl]
            for direction in ("forward", "backward"):
                row = dict(measurement="tensor cores", impl=impl, storage=storage, direction=direction, B=B, H=H,
                           N=N, d=d, causal=False)
                if time.monotonic() > deadline:
                    rows.append({**row, "error": "skipped: time budget"})
                    continue
                try:
                    with common.poisoning(False):
                        dev = [common.to_device(a.astype(np.float16) if storage == "float16" else a, storage)
                               for a in x32]
                        scale = 1.0 / math.sqrt(d)
                        opts = dict(storage=storage) if storage != "float32" else {}
                        o, lse = entry.forward(*dev[:3], causal=False, scale=scale, **opts)
                        call = (lambda: entry.forward(*dev[:3], causal=False, scale=scale, **opts)) \
                            if direction == "forward" else \
                            (lambda: entry.backward(*dev[:3], o, lse, dev[3], causal=False, scale=scale, **opts))
                        t = bench.time_call(call, repeats=repeats, warmup=2, info=info)
                    fl = (roofline.flops_forward if direction == "forward" else roofline.flops_backward)(B, H, N, N, d)
                    row.update(median_ms=t.median_ms, tflops=fl / (t.median_ms * 1e-3) / 1e12)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    traceback.print_exc()
                rows.append(row)
                print(f"tensor cores {impl:>8} {storage} {direction:<8} d={d}: {row.get('median_ms')} ms "
                      f"{row.get('tflops', '')} TFLOP/s {row.get('error', '')}", flush=True)
        rows += _sdpa_speed(B, H, N, d, repeats)
    return rows


def _sdpa_speed(B, H, N, d, repeats) -> list[dict]:
    """torch's SDPA in float16 on CUDA at the same shape (forward, and forward + backward's backward share)."""
    try:
        import torch
    except ImportError:
        return [dict(measurement="tensor cores", impl="torch sdpa", error="skipped: torch is not installed here")]
    if not torch.cuda.is_available():
        return [dict(measurement="tensor cores", impl="torch sdpa", error="skipped: this torch build has no CUDA")]
    from flashnb.instruments import roofline

    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    F = torch.nn.functional.scaled_dot_product_attention
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for direction in ("forward", "backward"):
        times = []
        for rep in range(repeats + 2):
            o = F(q, k, v) if direction == "backward" else None
            start.record()
            if direction == "forward":
                F(q, k, v)
            else:
                o.backward(do)
            end.record()
            torch.cuda.synchronize()
            if rep >= 2:
                times.append(start.elapsed_time(end))
        ms = sorted(times)[len(times) // 2]
        fl = (roofline.flops_forward if direction == "forward" else roofline.flops_backward)(B, H, N, N, d)
        out.append(dict(measurement="tensor cores", impl="torch sdpa", storage="float16", direction=direction, B=B,
                        H=H, N=N, d=d, causal=False, median_ms=ms, tflops=fl / (ms * 1e-3) / 1e12,
                        torch=torch.__version__))
        print(f"tensor cores torch sdpa float16 {direction:<8} d={d}: {ms:.3f} ms {out[-1]['tflops']:.1f} TFLOP/s",
              flush=True)
    return out


def ncu_child(impl: str, N: int, d: int, causal: bool) -> None:
    """Run one forward call under ncu (called in a child process ncu profiles)."""
    import numpy as np

    from flashnb.common import to_device
    from flashnb.registry import IMPLS

    rng = np.random.default_rng(0)
    q, k, v = (to_device(rng.standard_normal((8, N, d), dtype=np.float32)) for _ in range(3))
    IMPLS[impl].forward(q, k, v, causal=causal, scale=1.0 / math.sqrt(d))
    from numba import cuda

    cuda.synchronize()


def parse_ncu_csv(text: str) -> list[dict]:
    """Rows (kernel name, metric, value) from ``ncu --csv`` output (lines before the header skipped)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    out = []
    for r in csv.DictReader(lines[start:]):
        val = (r.get("Metric Value") or "").replace(",", "")
        try:
            value = float(val)
        except ValueError:
            continue
        unit = (r.get("Metric Unit") or "").strip()
        # normalise to bytes and nanoseconds whatever scaling ncu chose (--print-units base asks for none)
        factor = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9,
                  "nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9}.get(unit, 1)
        out.append(dict(id=r.get("ID"), kernel=r.get("Kernel Name", ""), metric=r.get("Metric Name"),
                        value=value * factor, unit=unit))
    return out


def measure_dram(args, deadline: float) -> list[dict]:
    ncu = shutil.which("ncu")
    if ncu is None or args.no_ncu:
        print("ncu: not on PATH (or --no-ncu); DRAM bytes not measured", flush=True)
        return []
    from flashnb.instruments.bench import modelled_bytes

    rows = []
    N, d = args.N, args.d
    for name in _impls(args, square=True):
        if time.monotonic() > deadline:
            rows.append(dict(impl=name, error="skipped: time budget"))
            continue
        # --print-units base: bytes and ns, never auto-scaled (KB/MB); --clock-control none: the GPU keeps its
        # own clocks (the mode seen to work on the lent H200s; DRAM bytes do not depend on the clock anyway).
        cmd = [ncu, "--csv", "--metrics", NCU_METRICS, "--target-processes", "all", "--print-units", "base",
               "--clock-control", "none", sys.executable,
               str(Path(__file__).resolve()), "--ncu-child", name, str(N), str(d), "0"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rows.append(dict(impl=name, error="ncu timed out"))
            continue
        with (args.out / "ncu_log.txt").open("a") as log:   # one file: the device tool returns at most 8
            log.write(f"=== {name}: {' '.join(cmd)} (exit {proc.returncode})\n{proc.stdout}\n--- stderr ---\n"
                      f"{proc.stderr}\n")
        parsed = parse_ncu_csv(proc.stdout)
        if not parsed:
            rows.append(dict(impl=name, error=f"ncu gave no metrics (rc {proc.returncode}): "
                                              f"{(proc.stderr or proc.stdout)[-300:]}"))
            continue
        per = {}
        for r in parsed:
            per.setdefault((r["id"], r["kernel"]), {})[r["metric"]] = r["value"]
        total = 0.0
        for (kid, kernel), m in per.items():
            read, write = m.get("dram__bytes_read.sum", 0.0), m.get("dram__bytes_write.sum", 0.0)
            total += read + write
            rows.append(dict(impl=name, launch=kid, kernel=kernel[:80], N=N, d=d, BH=8, dram_read_bytes=read,
                             dram_write_bytes=write, gpu_time_ns=m.get("gpu__time_duration.sum")))
        model = modelled_bytes(name, 1, 8, N, d, False, "fwd")
        rows.append(dict(impl=name, launch="total", N=N, d=d, BH=8, dram_bytes_total=total,
                         modelled_bytes=model, measured_over_modelled=(total / model) if model else None))
        print(f"ncu {name:>10}: DRAM {total / 1e6:.1f} MB measured vs {model / 1e6 if model else float('nan'):.1f} "
              "MB modelled (element-access model; L2 hits make DRAM lower)", flush=True)
    return rows


def measurements(args, deadline: float) -> list[dict]:
    """The notebooks' own GPU measurements (what notebooks 02, 07 and 11 run through ``bench.on_gpu``), at
    ``--measure-n`` (4096 x 4096 softmax and N = 4096 block-sparse by default; decoding: one query per head
    against a cache of 8 x measure-n keys)."""
    from flashnb.instruments.measure import block_sparse, decode, softmax

    n = args.measure_n
    jobs = [("softmax.measure_gpu", lambda: softmax.measure_gpu(rows=n, n=n, threads=256 if n >= 256 else 32,
                                                               repeats=args.repeats, warmup=1)),
            ("block_sparse.measure_gpu", lambda: block_sparse.measure_gpu(BH=args.B * args.H, N=n, d=args.d,
                                                                          repeats=args.repeats, warmup=1)),
            ("decode.measure_gpu", lambda: decode.measure_gpu(BH=args.B * args.H, length=8 * n, d=args.d, Nq=1,
                                                              repeats=args.repeats, warmup=1))]
    rows = []
    for name, job in jobs:
        if time.monotonic() > deadline:
            rows.append(dict(measurement=name, error="skipped: time budget"))
            continue
        try:
            got = job()
            rows += [dict(measurement=name, **r) for r in got]
            label = lambda r: r.get("method", r.get("density", f"{r.get('impl')} splits={r.get('num_splits')}"))
            print(f"{name}: " + ", ".join(f"{label(r)} {r['median_ms']:.3f} ms" for r in got), flush=True)
        except Exception as exc:
            rows.append(dict(measurement=name, error=f"{type(exc).__name__}: {exc}"[:300]))
            traceback.print_exc()
    return rows


def torch_interop(N: int = 256, d: int = 64) -> list[dict]:
    """flashnb.pytorch on CUDA tensors (issue 15's zero-copy path, on torch's current stream): fa2's forward and
    backward against SDPA in float64 on the same GPU, and one training-style step timed with torch's CUDA
    events.  Skipped (a row that says why) where torch or its CUDA build is missing."""
    try:
        import torch
    except ImportError:
        return [dict(measurement="flashnb.pytorch cuda", error="skipped: torch is not installed here")]
    if not torch.cuda.is_available():
        return [dict(measurement="flashnb.pytorch cuda", error="skipped: this torch build has no CUDA")]
    import flashnb.pytorch as ft

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, d, device="cuda", generator=g, requires_grad=True) for _ in range(3))
    o = ft.attention(q, k, v, causal=True, impl="fa2")
    o.sum().backward()
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True)   # Nq == Nk: same mask
    ref.sum().backward()
    err = max([(o.double() - ref).abs().max().item()]
              + [(x.grad.double() - y.grad).abs().max().item() for x, y in zip((q, k, v), (q64, k64, v64))])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        ft.attention(q, k, v, causal=True, impl="fa2").sum().backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    # float32 kernels against float64 SDPA at N = 256, d = 64: sums of <= 256 float32 terms, so ~1e-5
    return [dict(measurement="flashnb.pytorch cuda", N=N, d=d, max_abs_err_vs_sdpa_float64=err, ok=err < 1e-3,
                 median_ms=sorted(times)[len(times) // 2], torch=torch.__version__)]


def main(argv=None) -> int:
    """The intrinsics against their twins, correctness, then ncu DRAM bytes, the notebooks' measurements, the
    tensor cores' speed, then the sweep (which stops at the budget). Writes at most 7 files under ``--out`` (the
    device tool brings back 8)."""
    args = parse_args(argv)
    if args.ncu_child:
        impl, N, d, causal = args.ncu_child
        ncu_child(impl, int(N), int(d), causal == "1")
        return 0
    if flashnb.is_simulator():
        print("gpu_check: refusing to run -- flashnb is on the Numba CUDA simulator (no CUDA GPU/driver found, "
              "or FLASHNB_DEVICE=sim). Run this on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    deadline = t0 + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    from flashnb.instruments import bench

    info = bench.device_info()
    prov = bench.provenance(info=info)
    (args.out / "device.json").write_text(json.dumps({**info, **prov}, indent=1))
    print(f"device: {info}", flush=True)
    status = 0
    seen_kernels: dict = {}

    @contextlib.contextmanager
    def remember(name, kernel, grid, block, kargs):
        seen_kernels.setdefault(id(kernel), (name, kernel))
        yield

    from flashnb import common as fcommon
    from flashnb import instruments as finspect

    intrinsics = check_intrinsics()          # first: the layouts every fa2-tc number below depends on
    if not all(r.get("ok") for r in intrinsics):
        status = 1
    fcommon.launch_hooks.append(remember)
    try:
        correct = intrinsics + check_correctness(args, deadline)
    finally:
        fcommon.launch_hooks.remove(remember)
    write_rows(args.out / "correctness.csv", correct, prov)
    if not all(r.get("ok") for r in correct if r.get("error") != "skipped: time budget"):
        status = 1
    # ncu gets at most a third of what is left, so the timings below always get their share
    dram = measure_dram(args, time.monotonic() + (deadline - time.monotonic()) / 3)
    if dram:
        write_rows(args.out / "dram.csv", dram, prov)
    meas = measurements(args, deadline - 30)
    from flashnb.kernels import auto

    for storage in auto.HALF:                # what impl="auto" (the default) runs for half inputs on this GPU
        impl, reason = auto.choose(dict(storage=storage))
        meas.append(dict(measurement=f"default impl for {storage} inputs", impl=impl, reason=reason))
        print(f"default impl for {storage} inputs: {impl} ({reason})", flush=True)
    # what the driver loaded (nvJitLink build) for every kernel the correctness step launched; flashnb inspect
    # shows the compile_ptx + ptxas build of the same kernels
    for name, kernel in seen_kernels.values():
        try:
            for row in finspect.launched(kernel):
                meas.append(dict(measurement=f"launched resources: {name}", **row))
        except Exception as exc:   # a missing attribute must not cost the sweep
            meas.append(dict(measurement=f"launched resources: {name}", error=f"{type(exc).__name__}: {exc}"[:300]))
    try:
        meas += torch_interop()
    except Exception as exc:   # a failure here must not cost the sweep below
        meas.append(dict(measurement="flashnb.pytorch cuda", error=f"{type(exc).__name__}: {exc}"[:300]))
        traceback.print_exc()
    print(f"flashnb.pytorch on CUDA tensors: {meas[-1]}", flush=True)
    try:
        meas += tensorcore_speed(deadline - 20, repeats=min(args.repeats, 10), N=args.tc_N)
    except Exception as exc:   # a failure here must not cost the sweep below
        meas.append(dict(measurement="tensor cores", error=f"{type(exc).__name__}: {exc}"[:300]))
        traceback.print_exc()
    write_rows(args.out / "measurements.csv", meas, prov)
    rows = bench.sweep(_impls(args, square=True), tuple(args.bench_N), tuple(args.bench_d), (False, True), B=args.B,
                       H=args.H, repeats=args.repeats, warmup=2, out_dir=args.out, figures_dir=args.out,
                       deadline=deadline - 10, progress=True)
    for r in rows:
        print(f"bench {r['impl']:>10} {r['direction']} N={r['N']} d={r['d']} causal={r['causal']} "
              f"{r.get('median_ms') or r.get('error')} ms  {r.get('tflops') or ''} TFLOP/s", flush=True)
    print(f"gpu_check done in {time.monotonic() - t0:.0f} s; results in {args.out}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
