"""Benchmarks on a real GPU: CUDA-event timing, TFLOP/s, % of the device's own FP32 peak.

* :func:`time_call` -- times ``fn()`` with CUDA events: warm-up calls first (JIT compilation is never
  timed), then ``repeats`` timed calls; reports the median and the spread (min, max, quartiles).
* :func:`device_info` / :func:`device_fp32_peak` -- the device's FP32 peak from its own attributes:
  ``MULTIPROCESSOR_COUNT x FP32 lanes per SM x 2 (FMA) x CLOCK_RATE`` (lanes per SM by compute capability).
* :func:`sweep` / :func:`main_bench` -- every registered implementation's device-level forward and backward
  over sizes; a CSV with provenance columns and a plot.
* :func:`measure_impls` (and ``softmax.measure_gpu``, ``block_sparse.measure_gpu``) -- the measurements the
  notebooks show; :func:`on_gpu` runs one in a separate process on the GPU, because a notebook's own
  process runs the simulator (only it can count traffic) and a process's mode is fixed at import.

On the simulator a Python thread runs each CUDA thread, so wall time says nothing about a GPU:
:func:`time_call` raises :class:`SimulatorTimingError`, and :func:`sweep` writes only *modelled* rows
(roofline estimates from :mod:`flashnb.instruments.roofline`, labelled ``mode=modelled``) with the timing columns empty.
:mod:`flashnb.instruments.rehearsal` runs all of this on the simulator with a pretend device (``mode=rehearsal``) so the
code is exercised before a GPU is lent; those numbers are not measurements.
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
from numba import cuda, uint32

from .. import runtime
from ..registry import kernel_factory
from . import rehearsal
from .roofline import GPU, get_gpu, modelled_time

__all__ = ["SimulatorTimingError", "Timing", "measure_impls", "on_gpu", "gpu_available", "table", "FP32_LANES_PER_SM",
           "fp32_lanes_per_sm", "device_fp32_peak", "device_info", "provenance", "time_call", "modelled_bytes",
           "sweep", "write_csv", "plot_sweep", "main_bench", "CSV_COLUMNS", "PROVENANCE_COLUMNS", "measure_storage"]


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

    return dict(numba_version=v("numba"), numba_cuda_version=v("numba-cuda"), cuda_bindings_version=v("cuda-bindings"),
                python_version=sys.version.split()[0], flashnb_version=flashnb.__version__)


def _device_attr(dev, name: str):
    """One ``CU_DEVICE_ATTRIBUTE_<name>`` of ``dev``, or None when this driver/binding does not offer it."""
    try:
        return getattr(dev, name)
    except Exception:  # an attribute retired by a newer CUDA, or a binding without it
        return None


def _driver_release() -> str:
    """The NVIDIA driver release (e.g. ``580.159.03``) from NVML or nvidia-smi; "" when neither answers
    (``rehearsal`` under :func:`flashnb.instruments.rehearsal.pretend_gpu`)."""
    if rehearsal.active():
        return "rehearsal"
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        pass
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except Exception:
        return ""


def _driver_api_version() -> str:
    """The CUDA version the driver implements (cuDriverGetVersion, e.g. ``13.0``); "" when unknown
    (``rehearsal`` under :func:`flashnb.instruments.rehearsal.pretend_gpu`)."""
    if rehearsal.active():
        return "rehearsal"
    try:
        from numba.cuda.cudadrv import driver as _drv

        return ".".join(str(x) for x in _drv.driver.get_version())
    except Exception:
        return ""


def device_info() -> dict:
    """Name, cc, SM count, clock, bandwidth and FP32 peak of the current GPU (raises in simulator mode).

    Read from the device's own attributes (``MULTIPROCESSOR_COUNT``, ``CLOCK_RATE`` in kHz,
    ``MEMORY_CLOCK_RATE`` in kHz, ``GLOBAL_MEMORY_BUS_WIDTH`` in bits).  An attribute the driver does not
    offer gives NaN (and no % of peak) rather than an error: a timing is still worth having.
    ``driver_version`` is the NVIDIA driver release; ``cuda_driver_api`` the CUDA version it implements.
    """
    if runtime.is_simulator():
        raise SimulatorTimingError("no GPU: flashnb runs on the Numba CUDA simulator (device info is fake)")
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    cc = tuple(int(x) for x in dev.compute_capability)
    nan = float("nan")
    sms = _device_attr(dev, "MULTIPROCESSOR_COUNT")
    clock_khz = _device_attr(dev, "CLOCK_RATE")
    mem_clock_khz = _device_attr(dev, "MEMORY_CLOCK_RATE")
    bus_bits = _device_attr(dev, "GLOBAL_MEMORY_BUS_WIDTH")
    clock_hz = float(clock_khz) * 1e3 if clock_khz else nan
    api = _driver_api_version()
    peak = device_fp32_peak(cc, int(sms), clock_hz) if sms and cc in FP32_LANES_PER_SM else nan
    # DDR: two transfers per memory clock; the bus width in bits / 8 gives bytes per transfer.
    bandwidth = 2 * float(mem_clock_khz) * 1e3 * int(bus_bits) / 8 if mem_clock_khz and bus_bits else nan
    return dict(gpu_name=name, cc=f"{cc[0]}.{cc[1]}", sm_count=int(sms) if sms else "",
                clock_mhz=clock_hz / 1e6, fp32_peak_tflops=peak / 1e12, hbm_bandwidth_gbs=bandwidth / 1e9,
                driver_version=_driver_release(), cuda_driver_api=api)


PROVENANCE_COLUMNS = ["gpu_name", "cc", "sm_count", "clock_mhz", "driver_version", "cuda_driver_api",
                      "numba_version", "numba_cuda_version", "cuda_bindings_version", "python_version",
                      "flashnb_version", "date", "mode"]


def provenance(mode: str | None = None, info: dict | None = None) -> dict:
    """The provenance columns of every CSV row: device, driver, library versions, UTC date and mode
    (``measured`` on a GPU, ``modelled`` on the simulator)."""
    if info is None:
        info = {} if runtime.is_simulator() else device_info()
    mode = mode or ("modelled" if runtime.is_simulator() else "rehearsal" if rehearsal.active() else "measured")
    row = dict(gpu_name=info.get("gpu_name", "none (simulator)" if runtime.is_simulator() else ""),
               cc=info.get("cc", ""), sm_count=info.get("sm_count", ""), clock_mhz=info.get("clock_mhz", ""),
               driver_version=info.get("driver_version", ""), cuda_driver_api=info.get("cuda_driver_api", ""),
               **_versions(),
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
    host_ms: float | None = None     # host time of one (warm) call: Python work not counted in the GPU time

    def as_dict(self) -> dict:
        return asdict(self)

    def row(self, **fields) -> dict:
        """``fields`` + this timing + ``gpu_name`` and ``mode`` (``measured`` or ``rehearsal``): one row of a
        measurement function's result."""
        return {**fields, **self.as_dict(), "gpu_name": self.device, "mode": self.kind}


def _quartiles(xs):
    s = sorted(xs)
    if len(s) == 1:
        return s[0], s[0]
    q = statistics.quantiles(s, n=4, method="inclusive")
    return q[0], q[2]


@kernel_factory("bench.spin", stage="0", signature="void(int32)", threads=1)
def make_spin():
    """One thread that sleeps ``n`` times ~1 µs: launched just before a timed call, it keeps the GPU busy while
    the host enqueues that call, so the start event fires when the call's kernels are already queued behind
    it and the host's Python work (argument checks, allocations, launches) is not counted as GPU time."""

    @cuda.jit
    def spin(n):
        for _ in range(n):
            cuda.nanosleep(uint32(1000))

    return spin


def _spin_length(spin, host_s: float) -> int:
    """How many ~1 µs sleeps outlast ``host_s`` seconds of host work (with a margin), checked with events:
    ``nanosleep(t)`` may sleep anywhere in [0, 2t], so the count is measured, not assumed."""

    target_ms = 2e3 * host_s + 0.2
    n = int(min(1_000_000, max(200, target_ms * 1e3)))
    for _ in range(4):
        start, end = cuda.event(timing=True), cuda.event(timing=True)
        start.record()
        spin[1, 1](np.int32(n))
        end.record()
        end.synchronize()
        got = cuda.event_elapsed_time(start, end)
        if got >= target_ms or n >= 1_000_000:
            break
        n = int(min(1_000_000, n * (max(2.0, 1.5 * target_ms / got) if got > 0 else 4.0)))
    return n


def time_call(fn: Callable[[], object], *, repeats: int = 20, warmup: int = 3, flops: float | None = None,
              info: dict | None = None) -> Timing:
    """Median CUDA-event time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls.

    Each timed call is bracketed by two events on the default stream (where numba launches) and
    synchronised, so the time is the GPU time of everything ``fn`` enqueued; JIT compilation happens in the
    warm-up.  A sleeping kernel (:func:`make_spin`) is queued before each start event so that host overhead
    is not timed (``host_ms`` reports it: the median host time of a warm-up call).  A ``fn`` that
    synchronises inside (e.g. copies to the host) still counts the GPU's idle time after that point.
    With ``flops`` the result carries TFLOP/s and the percentage of this device's own FP32 peak.
    The timed calls run inside ``cuda.defer_cleanup()``, so numba's deferred frees of arrays ``fn`` allocates
    land after the loop, not in a sample.
    Raises :class:`SimulatorTimingError` on the simulator: its wall time is not GPU speed.
    """
    if runtime.is_simulator():
        raise SimulatorTimingError(
            "time_call needs a real GPU: on the Numba CUDA simulator wall time measures Python threads, not a "
            "GPU. Use flashnb.instruments.roofline.modelled_time(flops, bytes, gpu) for a modelled estimate.")
    for name, value in (("repeats", repeats), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "repeats" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'repeats' else 0}, got {value!r}")
    host = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        cuda.synchronize()
    host_s = statistics.median(host[1:] or host) if host else 1e-3   # the first warm-up call compiles
    spin = make_spin()
    # (rehearsing, the simulator runs the kernels inside the host call itself: there is no overhead to hide)
    n_spin = np.int32(_spin_length(spin, 0.0 if rehearsal.active() else host_s))
    times = []
    # numba frees device memory lazily, in batches; arrays that fn() allocates would otherwise be freed
    # (cuMemFree synchronises) inside some timed samples and not others.  Deferred: freed after the loop.
    with cuda.defer_cleanup():
        for _ in range(repeats):
            start, end = cuda.event(timing=True), cuda.event(timing=True)
            spin[1, 1](n_spin)
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
    return Timing(med, min(times), max(times), q1, q3, repeats, warmup, flops, tflops, pct, info.get("gpu_name", ""),
                  "rehearsal" if rehearsal.active() else "measured", host_s * 1e3)


# --------------------------------------------------------------------------- measurements the notebooks ask for


def measure_impls(impls=("fa2",), BH: int = 8, N: int = 1024, d: int = 64, causal: bool = False,
                  directions=("fwd",), repeats: int = 10, warmup: int = 2, seed: int = 0) -> list[dict]:
    """CUDA-event timings of registered implementations' device-level calls on one problem (GPU only).

    Inputs (seeded normal, float32) are copied to the device before timing; the backward gets the
    implementation's own ``o``, ``lse``.  One row per (impl, direction) with the :class:`Timing` fields,
    FLOPs from :meth:`flashnb.registry.Impl.flops`, and ``gpu_name`` / ``mode`` (``measured``).
    """
    from ..common import to_device
    from ..registry import IMPLS

    names = [impls] if isinstance(impls, str) else list(impls)
    for n in names:
        if n not in IMPLS:
            raise ValueError(f"impls must name registered implementations {sorted(IMPLS)}, got {n!r}")
    for dname in directions:
        if dname not in ("fwd", "bwd"):
            raise ValueError(f"directions must be 'fwd' and/or 'bwd', got {dname!r}")
    info = device_info()
    rng = np.random.default_rng(seed)
    q, k, v, do = (to_device(rng.standard_normal((BH, N, d), dtype=np.float32)) for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    rows = []
    for name in names:
        entry = IMPLS[name]
        for direction in directions:
            if direction == "bwd" and entry.backward is None:
                continue
            if direction == "fwd":
                fn = lambda: entry.forward(q, k, v, causal=causal, scale=scale)  # noqa: E731
            else:
                o, lse = entry.forward(q, k, v, causal=causal, scale=scale)
                fn = lambda: entry.backward(q, k, v, o, lse, do, causal=causal, scale=scale)  # noqa: E731
            with poisoning(False):  # time the kernels, not the NaN fill of fresh outputs
                t = time_call(fn, repeats=repeats, warmup=warmup, info=info,
                              flops=entry.flops(1, BH, N, N, d, causal, direction))
            rows.append(t.row(impl=name, direction=direction, BH=BH, N=N, d=d, causal=causal))
    return rows


CHILD_MARKER = "FLASHNB-GPU-ROWS "


def gpu_available() -> bool:
    """True when this process runs on a GPU, or a CUDA driver here reports one a child process can use."""
    return not runtime.is_simulator() or runtime.driver_device_count() > 0


def on_gpu(target: str, *, timeout: float = 600, **kwargs) -> list[dict] | None:
    """Run the measurement ``target`` (``"flashnb.module:function"``, returning a list of dicts) on a GPU.

    * This process runs on a GPU: called here.
    * This process runs on the simulator (a notebook that counts traffic) but the machine has a GPU: called
      in a child process started with ``FLASHNB_DEVICE=gpu`` (the mode is fixed per process); its rows come
      back as JSON.
    * No GPU: prints one line naming the measurement it did not run and returns None -- nothing is timed,
      nothing is invented (notebook 00 explains why once; the other notebooks' cells stay short).
    """
    module, _, func = target.partition(":")
    if not module.startswith("flashnb.") or not func.isidentifier():
        raise ValueError(f"target must look like 'flashnb.<module>:<function>', got {target!r}")
    if not runtime.is_simulator():
        return getattr(importlib.import_module(module), func)(**kwargs)
    if runtime.driver_device_count() == 0:
        call = f"{target}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        print(f"no GPU here, nothing is measured: {call} runs only on a GPU.")
        return None
    import os

    return _run_child(target, kwargs, dict(os.environ, FLASHNB_DEVICE="gpu", NUMBA_ENABLE_CUDASIM="0"), timeout)


def _run_child(target: str, kwargs: dict, env: dict, timeout: float) -> list[dict]:
    """``python -m flashnb._gpu_child TARGET JSON`` and the rows it prints after :data:`CHILD_MARKER`."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "flashnb._gpu_child", target, json.dumps(kwargs)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the GPU process for {target} failed (exit {proc.returncode}):\n"
                           f"{(proc.stderr or proc.stdout)[-2000:]}")
    return json.loads(lines[-1][len(CHILD_MARKER):])


def table(rows: list[dict] | None, columns) -> str:
    """A plain-text table of ``rows`` (floats to 4 significant digits); "" when there are none."""
    if not rows:
        return ""

    def fmt(x):
        return f"{x:.4g}" if isinstance(x, float) else "" if x is None else str(x)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


# --------------------------------------------------------------------------- sweep


#: Queries per row of an impl made for decoding (``stage="decode"``: flash-decoding): a decoding step is a few new
#: queries against a cache of ``N`` keys, so the sweep runs one query against ``N`` keys, not ``N`` queries.
DECODE_QUERIES = 1


def queries_for(impl: str, N: int) -> int:
    """The query count the sweep uses for ``impl`` at sequence length ``N``: ``N``, or :data:`DECODE_QUERIES` for a
    decoding impl (whose ``N`` is the KV cache's length)."""
    from ..registry import IMPLS

    return DECODE_QUERIES if IMPLS[impl].stage == "decode" else N


def _traffic_model(entry, direction: str):
    """The analytic model of ``entry``'s ``direction``, by the launcher's name in its module: ``forward`` ->
    ``model_forward``, ``forward_rows`` -> ``model_rows_forward`` (None when the module has none)."""
    fn = entry.forward if direction == "fwd" else entry.backward
    mod = importlib.import_module(fn.__module__)
    base = "forward" if direction == "fwd" else "backward"
    name = getattr(fn, "__name__", "")
    step = name[len(base) + 1:] if name.startswith(base + "_") else ""
    return getattr(mod, f"model_{step}_{base}", None) if step else getattr(mod, f"model_{base}", None)


def _modelled_bytes(impl, B, H, N, d, causal, direction, Nq=None):
    """``(bytes or None, why there is no number)``: :func:`modelled_bytes` with the reason it has none."""
    from ..registry import IMPLS

    model = _traffic_model(IMPLS[impl], direction)
    if model is None:
        return None, f"no traffic model for {impl}'s {'forward' if direction == 'fwd' else 'backward'}"
    Nq = N if Nq is None else Nq
    try:
        try:
            launches = model(B * H, Nq, N, d, causal=causal)
        except TypeError:
            launches = model(B * H, Nq, N, d)
    except ValueError as exc:  # the model cannot price this configuration (e.g. tiles that do not fit)
        return None, f"not modelled at this size: {str(exc)[:160]}"
    elems = sum(sum(ln.get(k, {}).values()) for ln in launches for k in ("reads", "writes", "atomics"))
    return 4.0 * elems, None


def modelled_bytes(impl: str, B: int, H: int, N: int, d: int, causal: bool, direction: str = "fwd",
                   Nq: int | None = None) -> float | None:
    """HBM bytes of an implementation from its stage module's analytic model (``model_forward`` /
    ``model_backward``, or ``model_<step>_forward`` for a launcher named ``forward_<step>``: element counts x 4
    bytes) for ``Nq`` queries (default ``N``) against ``N`` keys; None when the stage has no such model or it
    cannot price this configuration."""
    return _modelled_bytes(impl, B, H, N, d, causal, direction, Nq)[0]


def _note(impl: str, N: int, d: int, causal: bool, Nq: int) -> str | None:
    """What sets a row apart from dense attention over ``N`` queries: a decoding impl's query count, a
    block-sparse impl's share of the (query, key) pairs it computes."""
    from ..registry import IMPLS

    entry = IMPLS[impl]
    if Nq != N:
        return f"decoding: {Nq} new quer{'y' if Nq == 1 else 'ies'} against {N} cached keys"
    mask = entry.mask_for(Nq, N, d, causal)
    if mask is not None:
        share = 100.0 * entry.flops(1, 1, Nq, N, d, causal) / (4.0 * Nq * N * d)
        what = "a sliding window" if "window" in entry.options else "a block mask"
        return f"block-sparse, {what}: computes {share:.3g} % of the (query, key) pairs -- not dense attention"
    return None


CSV_COLUMNS = ["impl", "direction", "B", "H", "N", "d", "causal", "median_ms", "min_ms", "max_ms", "q1_ms", "q3_ms",
               "repeats", "host_ms", "flops", "tflops", "pct_fp32_peak", "modelled_bytes", "modelled_ms",
               "modelled_bound", "modelled_gpu", "error", "Nq", "note"] + PROVENANCE_COLUMNS


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


def _device_gpu(info: dict, fallback: str) -> GPU:
    """A roofline GPU built from the device's own attributes (for the modelled columns on a GPU); the preset
    ``fallback`` when the driver did not report SM count, clock or memory bandwidth."""
    cc = tuple(int(x) for x in info["cc"].split("."))
    numbers = (info.get("sm_count"), info.get("hbm_bandwidth_gbs"), info.get("fp32_peak_tflops"))
    if not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in numbers):
        return get_gpu(fallback)
    return GPU(info["gpu_name"], cc, info["sm_count"], info["hbm_bandwidth_gbs"] * 1e9,
               info["fp32_peak_tflops"] * 1e12, float("nan"), info["clock_mhz"] * 1e6, 0,
               FP32_LANES_PER_SM.get(cc, 0))


from ..common import poisoning  # noqa: E402


def _inputs(B, H, N, d, seed=0, Nq=None):
    """Device ``q, k, v, do``: ``Nq`` (default ``N``) queries, ``N`` keys."""
    from ..common import to_device

    rng = np.random.default_rng(seed)
    Nq = N if Nq is None else Nq
    return [to_device(rng.standard_normal((B * H, n, d), dtype=np.float32)) for n in (Nq, N, N, Nq)]


def sweep(impls=None, Ns=(1024, 2048, 4096), ds=(64, 128), causal=(False, True), *, B=2, H=8, repeats=10,
          warmup=2, backward=True, out_dir="results", figures_dir="figures", gpu="H100 SXM", deadline=None,
          progress=True, tag=None) -> list[dict]:
    """Time every registered implementation (``flashnb.registry.IMPLS``, or ``impls``) over sizes.

    On a GPU each row is a CUDA-event measurement of the device-level ``forward`` (inputs allocated outside
    the timed region) and ``backward`` (its ``o``, ``lse`` computed beforehand).  On the simulator rows are
    roofline estimates for ``gpu`` only (``mode=modelled``, timing columns empty).  Writes
    ``out_dir/bench[_tag].csv`` (rewritten after every row, so a run cut short keeps what it measured) and
    ``figures_dir/bench[_tag].png``; returns the rows.  Sizes go smallest first, every impl at each size.
    ``deadline`` (a ``time.monotonic()`` value): a job whose projected time (one warm call, synchronised, x
    the calls it would make) would end past it is skipped, and so is everything once it has passed.
    """
    from ..registry import IMPLS

    names = list(IMPLS) if impls is None else [impls] if isinstance(impls, str) else list(impls)
    for n in names:
        if n not in IMPLS:
            raise ValueError(f"impls must name registered implementations {sorted(IMPLS)}, got {n!r}")
    causals = [causal] if isinstance(causal, bool) else list(causal)
    sim = runtime.is_simulator()
    info = None if sim else device_info()
    prov = provenance(info=info or {})
    model_gpu = get_gpu(gpu) if sim else _device_gpu(info, gpu)
    jobs = [(n, N, d, c, direction) for N in Ns for d in ds for c in causals for n in names
            for direction in (("fwd", "bwd") if backward and IMPLS[n].backward is not None else ("fwd",))]
    suffix = f"_{tag}" if tag else ""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(jobs, desc="bench", disable=not progress, file=sys.stderr) if tqdm else jobs
    rows = []
    cached_inputs = {}
    for name, N, d, c, direction in bar:
        Nq = queries_for(name, N)
        flops = IMPLS[name].flops(B, H, Nq, N, d, c and Nq == N, direction)   # masked impls: the pairs they compute
        if c and Nq != N:     # bottom-right causal, Nq < N: query i sees N - Nq + 1 + i keys (not half of them)
            flops *= 1 - (Nq - 1) / (2 * N)
        nbytes, why = _modelled_bytes(name, B, H, N, d, c, direction, Nq)
        row = dict(impl=name, direction=direction, B=B, H=H, N=N, Nq=Nq, d=d, causal=c, flops=flops,
                   modelled_bytes=nbytes, modelled_gpu=model_gpu.name, **prov)
        notes = [n for n in (_note(name, N, d, c, Nq), why and f"no modelled time: {why}") if n]
        if notes:
            row["note"] = "; ".join(notes)
        if nbytes is not None:
            m = modelled_time(flops, nbytes, model_gpu)
            row.update(modelled_ms=m.seconds * 1e3, modelled_bound=m.bound)
        if not sim:
            if deadline is not None and time.monotonic() > deadline:
                row["error"] = "skipped: time budget"
            else:
                try:
                    key = (B, H, N, d, Nq)
                    if key not in cached_inputs:
                        cached_inputs.clear()
                        cached_inputs[key] = _inputs(B, H, N, d, Nq=Nq)
                    q, k, v, do = cached_inputs[key]
                    entry = IMPLS[name]
                    scale = 1.0 / math.sqrt(d)
                    if direction == "fwd":
                        fn = lambda: entry.forward(q, k, v, causal=c, scale=scale)
                    else:
                        o, lse = entry.forward(q, k, v, causal=c, scale=scale)
                        fn = lambda: entry.backward(q, k, v, o, lse, do, causal=c, scale=scale)
                    with poisoning(False):  # time the kernels, not the NaN fill of fresh outputs
                        fn()                                  # compiles (untimed)
                        cuda.synchronize()
                        t0 = time.perf_counter()
                        fn()
                        cuda.synchronize()
                        one = time.perf_counter() - t0
                        projected = one * (max(1, warmup - 2) + repeats) * 1.5   # 1.5: spins and events
                        if deadline is not None and time.monotonic() + projected > deadline:
                            row["error"] = f"skipped: would take ~{projected:.0f} s, past the time budget"
                        else:   # the two calls above were warm-up already
                            t = time_call(fn, repeats=repeats, warmup=max(1, warmup - 2), flops=flops, info=info)
                            row.update(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms, q1_ms=t.q1_ms,
                                       q3_ms=t.q3_ms, repeats=t.repeats, tflops=t.tflops,
                                       pct_fp32_peak=t.pct_fp32_peak, host_ms=t.host_ms)
                except Exception as exc:  # one failing size must not lose the rest of the sweep
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        if out_dir is not None:
            write_csv(rows, Path(out_dir) / f"bench{suffix}.csv")
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
        nq = r.get("Nq")
        tag = (f" Nq={nq}" if nq not in (None, "") and int(nq) != int(r["N"]) else
               " block-sparse" if str(r.get("note") or "").startswith("block-sparse") else "")
        key = (r["impl"], r["direction"], r["d"], r["causal"], tag)
        groups.setdefault(key, []).append((r["N"], r["flops"] / (float(ms) * 1e-3) / 1e12))
    for (impl, direction, d, c, tag), pts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-",
                label=f"{impl}{tag} {direction} d={d}{' causal' if c else ''}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("TFLOP/s (FP32)" if measured else "modelled TFLOP/s (roofline, not measured)")
    gpu = rows[0].get("gpu_name") if measured else rows[0].get("modelled_gpu")
    ax.set_title(f"{'Measured (CUDA events)' if measured else 'MODELLED (no GPU)'} on {gpu}")
    if groups:
        ax.legend(fontsize="x-small", ncol=2)
    return fig


def bench_parser() -> argparse.ArgumentParser:
    """The ``flashnb bench`` argument parser."""
    from ..api import MAX_HEAD_DIM
    from ..argtypes import int_in
    from ..registry import IMPLS
    from .roofline import GPUS

    p = argparse.ArgumentParser(
        prog="flashnb bench",
        description="Sweep the registered implementations over N and d. On a GPU: CUDA-event timings, written as "
                    "a CSV with provenance (default results/bench.csv) and a plot (default figures/bench.png). On "
                    "the simulator: modelled roofline rows only, printed; saved only where --out / --figures say.")
    p.add_argument("--impl", action="append", default=None, choices=sorted(IMPLS), metavar="IMPL",
                   help=f"implementation (repeatable; default all): {', '.join(sorted(IMPLS))}")
    p.add_argument("--N", type=int_in(1), action="append", default=None,
                   help="sequence length (repeatable; default 1024 2048 4096)")
    p.add_argument("--d", type=int_in(1, MAX_HEAD_DIM), action="append", default=None,
                   help=f"head dim, 1..{MAX_HEAD_DIM} (repeatable; default 64 128)")
    p.add_argument("--causal", choices=["yes", "no", "both"], default="both",
                   help="causal masking: yes, no or both (default both)")
    p.add_argument("--B", type=int_in(1), default=2, help="batch size (default 2)")
    p.add_argument("--H", type=int_in(1), default=8, help="heads (default 8)")
    p.add_argument("--repeats", type=int_in(1), default=10, help="timed calls per row (default 10)")
    p.add_argument("--warmup", type=int_in(0), default=2, help="untimed calls before timing (default 2)")
    p.add_argument("--no-backward", action="store_true", help="forward passes only")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory for bench.csv (default: results/ on a GPU, none on the simulator)")
    p.add_argument("--figures", default=None, metavar="DIR",
                   help="directory for bench.png (default: figures/ on a GPU, none on the simulator)")
    p.add_argument("--gpu", default="H100 SXM", choices=sorted(GPUS), metavar="PRESET",
                   help=f"roofline preset for the modelled columns (default 'H100 SXM'): {', '.join(sorted(GPUS))}")
    return p


def main_bench(argv=None) -> int:
    """flashnb bench: sweep the registered implementations, print the rows, and write a CSV and a plot where
    asked (on a GPU: results/ and figures/ by default)."""
    args = bench_parser().parse_args(argv)
    sim = runtime.is_simulator()
    out = args.out if args.out is not None or sim else "results"
    figures = args.figures if args.figures is not None or sim else "figures"
    if sim:
        print("flashnb bench: no GPU (simulator mode) -- writing MODELLED roofline estimates only; simulator "
              "wall time is never reported as GPU speed.", file=sys.stderr)
    targets = [str(Path(d, f"bench.{ext}").resolve()) for d, ext in ((out, "csv"), (figures, "png")) if d is not None]
    print(f"flashnb bench: writing {' and '.join(targets)}" if targets else
          "flashnb bench: printing the rows only (--out DIR and --figures DIR save a CSV and a plot)", file=sys.stderr)
    causal = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    rows = sweep(args.impl, tuple(args.N or (1024, 2048, 4096)), tuple(args.d or (64, 128)), causal, B=args.B,
                 H=args.H, repeats=args.repeats, warmup=args.warmup, backward=not args.no_backward,
                 out_dir=out, figures_dir=figures, gpu=args.gpu)
    key = "median_ms" if not sim else "modelled_ms"
    for r in rows:
        val = r.get(key)
        shown = f"{val:.3f} ms" if isinstance(val, float) else (r.get("error") or "-")
        if isinstance(val, float) and val < 1:
            shown = f"{val * 1e3:.3f} µs"
        note = f"  ({r['note']})" if r.get("note") else ""
        print(f"{r['impl']:>10} {r['direction']} N={r['N']:<6} d={r['d']:<4} causal={r['causal']!s:<5} "
              f"{'modelled ' if key == 'modelled_ms' else ''}{shown}{note}")
    if targets:
        print(f"wrote {' and '.join(targets)}")
    return 0


# --------------------------------------------------------------------------- half storage on a GPU (notebook 11)


def measure_storage(BH: int = 16, N: int = 4096, d: int = 64, storages=("float32", "float16", "bfloat16"), *,
                    causal: bool = False, repeats: int = 10, warmup: int = 3, seed: int = 0) -> list[dict]:
    """CUDA-event time of the product kernel's forward and backward with Q, K, V, O (dO, dK, dV, dQ) in each
    storage, at one shape (GPU only; notebook 11's measurement, through :func:`on_gpu`).  Same values in every
    storage (drawn once, rounded to float16); each row carries the modelled HBM bytes
    (:func:`flashnb.kernels.models.simt.model_bytes`) of its launches."""
    from ..common import poisoning, to_bfloat16, to_device
    from ..kernels.launch.flash import backward, forward
    from ..kernels.models.simt import model_backward, model_bytes, model_forward

    info = device_info()
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal((BH, N, d)).astype(np.float16).astype(np.float32) for _ in range(4)]
    out = []
    for storage in storages:
        host = [to_bfloat16(a) for a in values] if storage == "bfloat16" else values
        q, k, v, do = (to_device(a, storage) for a in host)
        scale = d ** -0.5
        with poisoning(False):   # time the kernels, not the NaN fill of fresh outputs
            o, lse = forward(q, k, v, causal=causal, scale=scale, storage=storage)
            for direction, fn, model in (
                    ("forward", lambda: forward(q, k, v, causal=causal, scale=scale, storage=storage), model_forward),
                    ("backward", lambda: backward(q, k, v, o, lse, do, causal=causal, scale=scale, storage=storage),
                     model_backward)):
                timing = time_call(fn, repeats=repeats, warmup=warmup, info=info)
                per_launch = model_bytes(model(BH, N, N, d, causal=causal, storage=storage), storage)
                nbytes = sum(x["read_bytes"] + x["write_bytes"] + x["atomic_bytes"] for x in per_launch)
                out.append(timing.row(storage=storage, direction=direction, BH=BH, N=N, d=d, causal=bool(causal),
                                      model_bytes=int(nbytes)))
    return out
