"""Benchmarks on a real GPU: CUDA-event timing, TFLOP/s, % of the device's own FP32 peak.

* :func:`time_call` -- times ``fn()`` with CUDA events: warm-up calls first (JIT compilation is never
  timed), then ``repeats`` timed calls; reports the median and the spread (min, max, quartiles).
* :func:`device_info` / :func:`device_fp32_peak` -- the device's FP32 peak from its own attributes:
  ``MULTIPROCESSOR_COUNT x FP32 lanes per SM x 2 (FMA) x CLOCK_RATE`` (lanes per SM by compute capability).
* :func:`sweep` / :func:`main_bench` -- every registered implementation's device-level forward and backward
  over sizes; a CSV with provenance columns and a plot.

On the simulator a Python thread runs each CUDA thread, so wall time says nothing about a GPU:
:func:`time_call` raises :class:`SimulatorTimingError`, and :func:`sweep` writes only *modelled* rows
(roofline estimates from :mod:`flashnb.roofline`, labelled ``mode=modelled``) with the timing columns empty.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib
import importlib.metadata as _md
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from . import runtime
from .roofline import GPU, get_gpu, modelled_time

__all__ = ["SimulatorTimingError", "Timing", "FP32_LANES_PER_SM", "fp32_lanes_per_sm", "device_fp32_peak",
           "device_info", "provenance", "time_call", "modelled_bytes", "sweep", "write_csv", "plot_sweep",
           "main_bench", "CSV_COLUMNS", "PROVENANCE_COLUMNS"]


class SimulatorTimingError(RuntimeError):
    """Raised instead of presenting simulator wall time as GPU speed."""


# FP32 CUDA-core lanes per SM (each does one FMA = 2 FLOP per clock).  Sources: NVIDIA architecture
# whitepapers -- V100 (GV100) 64, Turing 64, A100 (GA100, sm_80) 64, GA10x (sm_86/87) 128, Ada (sm_89) 128,
# H100 (GH100, sm_90) 128; also the CUDA C++ Programming Guide "Arithmetic Instructions" throughput table
# (32-bit floating-point add/multiply/FMA results per clock per SM: 64 for 7.x and 8.0, 128 for 8.6-9.0).
FP32_LANES_PER_SM: dict[tuple[int, int], int] = {
    (7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128, (9, 0): 128,
    (10, 0): 128, (12, 0): 128,
}


def fp32_lanes_per_sm(cc) -> int:
    """FP32 CUDA-core lanes per SM for compute capability ``cc`` (64 on sm_80, 128 on sm_86..sm_90)."""
    cc = tuple(cc)
    if cc not in FP32_LANES_PER_SM:
        raise ValueError(f"FP32 lanes per SM unknown for compute capability {cc}; known: {sorted(FP32_LANES_PER_SM)}")
    return FP32_LANES_PER_SM[cc]


def device_fp32_peak(cc, sm_count: int, clock_hz: float) -> float:
    """FP32 FLOP/s = SMs x FP32 lanes per SM x 2 x clock."""
    return sm_count * fp32_lanes_per_sm(cc) * 2 * clock_hz


def _versions() -> dict:
    import flashnb

    def v(dist):
        try:
            return _md.version(dist)
        except _md.PackageNotFoundError:
            return ""

    return dict(numba_version=v("numba"), numba_cuda_version=v("numba-cuda"), flashnb_version=flashnb.__version__)


def device_info() -> dict:
    """Name, cc, SM count, clock, bandwidth and FP32 peak of the current GPU (raises in simulator mode)."""
    if runtime.is_simulator():
        raise SimulatorTimingError("no GPU: flashnb runs on the Numba CUDA simulator (device info is fake)")
    from numba import cuda

    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    cc = tuple(dev.compute_capability)
    sms = int(dev.MULTIPROCESSOR_COUNT)
    clock_hz = float(dev.CLOCK_RATE) * 1e3                      # CLOCK_RATE is in kHz
    mem_clock_hz = float(dev.MEMORY_CLOCK_RATE) * 1e3
    bus_bits = int(dev.GLOBAL_MEMORY_BUS_WIDTH)
    try:
        from numba.cuda.cudadrv import driver as _drv

        drv = ".".join(str(x) for x in _drv.driver.get_version())
    except Exception:  # pragma: no cover
        drv = ""
    peak = device_fp32_peak(cc, sms, clock_hz) if cc in FP32_LANES_PER_SM else float("nan")
    return dict(gpu_name=name, cc=f"{cc[0]}.{cc[1]}", sm_count=sms, clock_mhz=clock_hz / 1e6,
                fp32_peak_tflops=peak / 1e12, hbm_bandwidth_gbs=2 * mem_clock_hz * bus_bits / 8 / 1e9,
                driver_version=drv)


PROVENANCE_COLUMNS = ["gpu_name", "cc", "sm_count", "clock_mhz", "driver_version", "numba_version",
                      "numba_cuda_version", "flashnb_version", "date", "mode"]


def provenance(mode: str | None = None, info: dict | None = None) -> dict:
    """The provenance columns of every CSV row: device, driver, library versions, UTC date and mode
    (``measured`` on a GPU, ``modelled`` on the simulator)."""
    if info is None:
        info = {} if runtime.is_simulator() else device_info()
    mode = mode or ("modelled" if runtime.is_simulator() else "measured")
    row = dict(gpu_name=info.get("gpu_name", "none (simulator)" if runtime.is_simulator() else ""),
               cc=info.get("cc", ""), sm_count=info.get("sm_count", ""), clock_mhz=info.get("clock_mhz", ""),
               driver_version=info.get("driver_version", ""), **_versions(),
               date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), mode=mode)
    return {k: row[k] for k in PROVENANCE_COLUMNS}


@dataclass(frozen=True)
class Timing:
    """A CUDA-event measurement on a GPU (milliseconds); throughput when ``flops`` was given."""

    median_ms: float
    min_ms: float
    max_ms: float
    q1_ms: float
    q3_ms: float
    repeats: int
    warmup: int
    flops: float | None = None
    tflops: float | None = None
    pct_fp32_peak: float | None = None
    device: str = ""
    kind: str = "measured"

    def as_dict(self) -> dict:
        return asdict(self)


def _quartiles(xs):
    s = sorted(xs)
    if len(s) == 1:
        return s[0], s[0]
    q = statistics.quantiles(s, n=4, method="inclusive")
    return q[0], q[2]


def time_call(fn: Callable[[], object], *, repeats: int = 20, warmup: int = 3, flops: float | None = None,
              info: dict | None = None) -> Timing:
    """Median CUDA-event time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls.

    Each timed call is bracketed by two events on the default stream and synchronised, so the time is the
    GPU time of everything ``fn`` enqueued (JIT compilation happens in the warm-up).  With ``flops`` the
    result carries TFLOP/s and the percentage of this device's own FP32 peak.
    Raises :class:`SimulatorTimingError` on the simulator: its wall time is not GPU speed.
    """
    if runtime.is_simulator():
        raise SimulatorTimingError(
            "time_call needs a real GPU: on the Numba CUDA simulator wall time measures Python threads, not a "
            "GPU. Use flashnb.roofline.modelled_time(flops, bytes, gpu) for a modelled estimate.")
    for name, value in (("repeats", repeats), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "repeats" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'repeats' else 0}, got {value!r}")
    from numba import cuda

    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = cuda.event(timing=True), cuda.event(timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    info = info or device_info()
    med = statistics.median(times)
    q1, q3 = _quartiles(times)
    tflops = pct = None
    if flops is not None and med > 0:
        tflops = flops / (med * 1e-3) / 1e12
        peak = info.get("fp32_peak_tflops")
        pct = 100.0 * tflops / peak if peak and math.isfinite(peak) else None
    return Timing(med, min(times), max(times), q1, q3, repeats, warmup, flops, tflops, pct, info.get("gpu_name", ""))


# --------------------------------------------------------------------------- sweep


def modelled_bytes(impl: str, B: int, H: int, N: int, d: int, causal: bool, direction: str = "fwd") -> float | None:
    """HBM bytes of an implementation from its stage module's analytic model (``model_forward`` /
    ``model_backward``: element counts x 4 bytes); None when the stage has no such model."""
    from .registry import IMPLS

    entry = IMPLS[impl]
    fn = entry.forward if direction == "fwd" else entry.backward
    mod = importlib.import_module(fn.__module__)
    model = getattr(mod, "model_forward" if direction == "fwd" else "model_backward", None)
    if model is None:
        return None
    try:
        try:
            launches = model(B * H, N, N, d, causal=causal)
        except TypeError:
            launches = model(B * H, N, N, d)
    except ValueError:  # the model cannot price this configuration (e.g. tiles that do not fit)
        return None
    elems = sum(sum(ln.get(k, {}).values()) for ln in launches for k in ("reads", "writes", "atomics"))
    return 4.0 * elems


CSV_COLUMNS = ["impl", "direction", "B", "H", "N", "d", "causal", "median_ms", "min_ms", "max_ms", "q1_ms", "q3_ms",
               "repeats", "flops", "tflops", "pct_fp32_peak", "modelled_bytes", "modelled_ms", "modelled_bound",
               "modelled_gpu", "error"] + PROVENANCE_COLUMNS


def write_csv(rows: Iterable[dict], path) -> Path:
    """Write sweep rows (missing columns left blank) with the :data:`CSV_COLUMNS` header."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})
    return path


def _device_gpu(info: dict) -> GPU:
    """A roofline GPU built from the device's own attributes (for the modelled columns on a GPU)."""
    cc = tuple(int(x) for x in info["cc"].split("."))
    return GPU(info["gpu_name"], cc, info["sm_count"], info["hbm_bandwidth_gbs"] * 1e9,
               info["fp32_peak_tflops"] * 1e12, float("nan"), info["clock_mhz"] * 1e6, 0,
               FP32_LANES_PER_SM.get(cc, 0))


from .common import poisoning  # noqa: E402


def _inputs(B, H, N, d, seed=0):
    from .common import to_device

    rng = np.random.default_rng(seed)
    return [to_device(rng.standard_normal((B * H, N, d), dtype=np.float32)) for _ in range(4)]


def sweep(impls=None, Ns=(1024, 2048, 4096), ds=(64, 128), causal=(False, True), *, B=2, H=8, repeats=10,
          warmup=2, backward=True, out_dir="results", figures_dir="figures", gpu="H100 SXM", deadline=None,
          progress=True, tag=None) -> list[dict]:
    """Time every registered implementation (``flashnb.registry.IMPLS``, or ``impls``) over sizes.

    On a GPU each row is a CUDA-event measurement of the device-level ``forward`` (inputs allocated outside
    the timed region) and ``backward`` (its ``o``, ``lse`` computed beforehand).  On the simulator rows are
    roofline estimates for ``gpu`` only (``mode=modelled``, timing columns empty).  Writes
    ``out_dir/bench[_tag].csv`` and ``figures_dir/bench[_tag].png``; returns the rows.  ``deadline`` (a
    ``time.monotonic()`` value) skips the remaining sizes once passed.
    """
    from .registry import IMPLS

    names = list(IMPLS) if impls is None else [impls] if isinstance(impls, str) else list(impls)
    for n in names:
        if n not in IMPLS:
            raise ValueError(f"impls must name registered implementations {sorted(IMPLS)}, got {n!r}")
    causals = [causal] if isinstance(causal, bool) else list(causal)
    sim = runtime.is_simulator()
    info = None if sim else device_info()
    prov = provenance(info=info or {})
    model_gpu = get_gpu(gpu) if sim else _device_gpu(info)
    jobs = [(n, N, d, c, direction) for n in names for N in Ns for d in ds for c in causals
            for direction in (("fwd", "bwd") if backward and IMPLS[n].backward is not None else ("fwd",))]
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(jobs, desc="bench", disable=not progress, file=sys.stderr) if tqdm else jobs
    rows = []
    cached_inputs = {}
    for name, N, d, c, direction in bar:
        flops = IMPLS[name].flops(B, H, N, N, d, c, direction)   # masked impls: only the pairs they compute
        nbytes = modelled_bytes(name, B, H, N, d, c, direction)
        row = dict(impl=name, direction=direction, B=B, H=H, N=N, d=d, causal=c, flops=flops,
                   modelled_bytes=nbytes, modelled_gpu=model_gpu.name, **prov)
        if nbytes is not None:
            m = modelled_time(flops, nbytes, model_gpu)
            row.update(modelled_ms=m.seconds * 1e3, modelled_bound=m.bound)
        if not sim:
            if deadline is not None and time.monotonic() > deadline:
                row["error"] = "skipped: time budget"
            else:
                try:
                    key = (B, H, N, d)
                    if key not in cached_inputs:
                        cached_inputs.clear()
                        cached_inputs[key] = _inputs(B, H, N, d)
                    q, k, v, do = cached_inputs[key]
                    entry = IMPLS[name]
                    scale = 1.0 / math.sqrt(d)
                    if direction == "fwd":
                        fn = lambda: entry.forward(q, k, v, causal=c, scale=scale)
                    else:
                        o, lse = entry.forward(q, k, v, causal=c, scale=scale)
                        fn = lambda: entry.backward(q, k, v, o, lse, do, causal=c, scale=scale)
                    with poisoning(False):  # time the kernels, not the NaN fill of fresh outputs
                        t = time_call(fn, repeats=repeats, warmup=warmup, flops=flops, info=info)
                    row.update(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms, q1_ms=t.q1_ms,
                               q3_ms=t.q3_ms, repeats=t.repeats, tflops=t.tflops, pct_fp32_peak=t.pct_fp32_peak)
                except Exception as exc:  # one failing size must not lose the rest of the sweep
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
    suffix = f"_{tag}" if tag else ""
    if out_dir is not None:
        write_csv(rows, Path(out_dir) / f"bench{suffix}.csv")
    if figures_dir is not None and rows:
        fig = plot_sweep(rows)
        Path(figures_dir).mkdir(parents=True, exist_ok=True)
        fig.savefig(Path(figures_dir) / f"bench{suffix}.png", dpi=120, bbox_inches="tight")
    return rows


def plot_sweep(rows: list[dict]):
    """TFLOP/s against N per implementation (measured), or modelled TFLOP/s when nothing was measured."""
    from matplotlib.figure import Figure

    measured = any(r.get("median_ms") not in (None, "") for r in rows)
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    groups = {}
    for r in rows:
        ms = r.get("median_ms") if measured else r.get("modelled_ms")
        if ms in (None, "") or not ms:
            continue
        key = (r["impl"], r["direction"], r["d"], r["causal"])
        groups.setdefault(key, []).append((r["N"], r["flops"] / (float(ms) * 1e-3) / 1e12))
    for (impl, direction, d, c), pts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-",
                label=f"{impl} {direction} d={d}{' causal' if c else ''}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("TFLOP/s (FP32)" if measured else "modelled TFLOP/s (roofline, not measured)")
    gpu = rows[0].get("gpu_name") if measured else rows[0].get("modelled_gpu")
    ax.set_title(f"{'Measured (CUDA events)' if measured else 'MODELLED (no GPU)'} on {gpu}")
    if groups:
        ax.legend(fontsize="x-small", ncol=2)
    return fig


def main_bench(argv=None) -> int:
    """``flashnb bench``: sweep the registered implementations, write a CSV and a plot."""
    from .registry import IMPLS

    p = argparse.ArgumentParser(prog="flashnb bench", description=main_bench.__doc__)
    p.add_argument("--impl", action="append", default=None, help=f"implementation (repeatable) of {sorted(IMPLS)}")
    p.add_argument("--N", type=int, action="append", default=None, help="sequence length (repeatable)")
    p.add_argument("--d", type=int, action="append", default=None, help="head dim (repeatable)")
    p.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--out", default="results", help="CSV directory (default results/)")
    p.add_argument("--figures", default="figures", help="plot directory (default figures/)")
    p.add_argument("--gpu", default="H100 SXM", help="roofline preset for modelled rows on the simulator")
    args = p.parse_args(argv)
    if args.impl:
        for n in args.impl:
            if n not in IMPLS:
                p.error(f"--impl must be one of {sorted(IMPLS)}, got {n!r}")
    if runtime.is_simulator():
        print("flashnb bench: no GPU (simulator mode) -- writing MODELLED roofline estimates only; simulator "
              "wall time is never reported as GPU speed.", file=sys.stderr)
    causal = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    rows = sweep(args.impl, tuple(args.N or (1024, 2048, 4096)), tuple(args.d or (64, 128)), causal, B=args.B,
                 H=args.H, repeats=args.repeats, warmup=args.warmup, backward=not args.no_backward,
                 out_dir=args.out, figures_dir=args.figures, gpu=args.gpu)
    key = "median_ms" if not runtime.is_simulator() else "modelled_ms"
    for r in rows:
        val = r.get(key)
        shown = f"{val:.3f} ms" if isinstance(val, float) else (r.get("error") or "-")
        print(f"{r['impl']:>10} {r['direction']} N={r['N']:<6} d={r['d']:<4} causal={r['causal']!s:<5} "
              f"{'modelled ' if key == 'modelled_ms' else ''}{shown}")
    print(f"wrote {Path(args.out) / 'bench.csv'} and {Path(args.figures) / 'bench.png'}")
    return 0
