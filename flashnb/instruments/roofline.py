"""A roofline model: how fast a kernel *could* run, from its FLOPs and HBM bytes and a GPU's datasheet.

Everything here is **modelled**, not measured: ``time = max(FLOPs / peak, bytes / HBM bandwidth)``.  Stages 1-6
run on the FP32 CUDA cores, so their compute roof is the non-tensor FP32 peak; stage 7 (``impl="fa2-tc"``) runs its
matmuls on the tensor cores, whose *dense* peaks (FP16/BF16 and TF32; datasheets also quote twice these "with
sparsity") are :attr:`GPU.tensor_fp16_dense` and :attr:`GPU.tensor_tf32_dense` (``modelled_time(...,
peak="tensor_fp16")``).

Tensor cores per SM (dense FP16/BF16 multiply-adds with FP32 accumulation per SM per clock,
:attr:`GPU.tensor_fma_per_sm_clk`): Turing (T4) 8 Tensor Cores x 64 = 512 (NVIDIA Turing architecture
whitepaper); A100 4 x 256 = 1,024 (NVIDIA A100 Tensor Core GPU Architecture whitepaper, "256 FP16/FP32 FMA
operations per clock" per Tensor Core); H100 2,048 ("2x the MMA rate of A100 per SM, clock-for-clock", NVIDIA
H100 Tensor Core GPU Architecture whitepaper).  TF32 runs at half the FP16 rate on both (A100 156 TF, H100 495
TF dense).  The clock that turns the per-SM rate into the datasheet's dense peak is
:attr:`GPU.tensor_clock_hz`: 1.41 GHz on A100 (its boost clock), 1.59 GHz on T4, but 1.83 GHz on H100/H200 --
NVIDIA's 989.5 TFLOPS assumes a lower clock than the 1.98 GHz of its 67 TFLOPS FP32 figure
(``tests/instruments/test_roofline.py`` checks both products).

GPU presets (NVIDIA datasheet values, decimal units: 1 GB/s = 1e9 B/s, 1 TFLOP/s = 1e12 FLOP/s):

* A100 SXM 40GB / 80GB -- NVIDIA A100 Tensor Core GPU datasheet: HBM2 1,555 GB/s (40GB), HBM2e 2,039 GB/s
  (80GB SXM); FP32 19.5 TFLOPS; FP16/BF16 tensor 312 TFLOPS dense (624 with sparsity).  SM count 108 and
  boost clock 1410 MHz from the NVIDIA A100 Tensor Core GPU Architecture whitepaper; shared memory per SM
  up to 164 KB (CUDA C++ Programming Guide, compute capability 8.0).
* H100 SXM5 80GB -- NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3; FP32 67 TFLOPS; FP16/BF16
  tensor 1,979 TFLOPS *with sparsity*, i.e. 989.5 dense.  132 SMs, 1980 MHz max boost (NVIDIA H100 /
  Hopper architecture whitepaper); 228 KB shared memory per SM (Programming Guide, cc 9.0).
* H200 SXM 141GB -- NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s HBM3e; FP32 67 TFLOPS; FP16/BF16
  tensor 1,979 TFLOPS with sparsity (989.5 dense).  Same GH100 configuration as H100 SXM (132 SMs,
  228 KB shared memory per SM); the boost clock is not on the datasheet -- 1980 MHz is the value that
  reproduces 67 TFLOPS (132 SMs x 128 FP32 lanes x 2 FLOP x 1.98 GHz = 66.9 TFLOP/s).

* T4 16GB (Colab's free GPU, Turing, cc 7.5) -- NVIDIA T4 datasheet: GDDR6 320 GB/s; FP32 8.1 TFLOPS;
  FP16 (mixed precision) tensor 65 TFLOPS.  40 SMs x 64 CUDA cores (2,560) and 1590 MHz boost (NVIDIA Turing
  architecture whitepaper, Tesla T4); 64 KB shared memory per SM (Programming Guide, cc 7.5).

Check: FP32 peak = SMs x FP32 lanes per SM x 2 (FMA) x clock: T4 40 x 64 x 2 x 1.59 GHz = 8.1 TF;
A100 108 x 64 x 2 x 1.41 GHz = 19.5 TF; H100 132 x 128 x 2 x 1.98 GHz = 66.9 TF (``tests/instruments/test_roofline.py``
asserts every preset).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from ..registry import _check_dims, flops_backward, flops_forward  # noqa: F401  (the FLOPs convention)

__all__ = ["GPU", "GPUS", "get_gpu", "ModelledTime", "modelled_time", "flops_forward", "flops_backward",
           "roofline_plot"]


@dataclass(frozen=True)
class GPU:
    """Datasheet numbers of one GPU (SI units: bytes/s, FLOP/s, Hz, bytes)."""

    name: str
    cc: tuple[int, int]
    sm_count: int
    hbm_bandwidth: float          # bytes/s
    fp32_peak: float              # FLOP/s on the FP32 CUDA cores (non-tensor)
    tensor_fp16_dense: float      # FLOP/s, FP16/BF16 tensor cores, dense (FP32 accumulation)
    boost_clock_hz: float
    smem_per_sm: int              # bytes of shared memory per SM at the maximum carve-out
    fp32_lanes_per_sm: int
    tensor_tf32_dense: float = 0.0   # FLOP/s, TF32 tensor cores, dense (0: the GPU has no TF32)
    tensor_fma_per_sm_clk: int = 0   # dense FP16 multiply-adds per SM per clock (whitepapers; 0: unknown)

    @property
    def tensor_clock_hz(self) -> float:
        """The clock at which :attr:`tensor_fma_per_sm_clk` on every SM gives the datasheet's dense FP16 peak
        (``peak / (2 · SMs · rate)``; NaN when the rate is unknown)."""
        if not self.tensor_fma_per_sm_clk:
            return float("nan")
        return self.tensor_fp16_dense / (2 * self.sm_count * self.tensor_fma_per_sm_clk)

    def peak(self, which: str = "fp32") -> float:
        """A compute roof in FLOP/s: ``"fp32"`` (CUDA cores), ``"tensor_fp16"`` (also BF16) or ``"tensor_tf32"``."""
        peaks = {"fp32": self.fp32_peak, "tensor_fp16": self.tensor_fp16_dense, "tensor_bf16": self.tensor_fp16_dense,
                 "tensor_tf32": self.tensor_tf32_dense}
        if which not in peaks:
            raise ValueError(f"peak must be one of {sorted(peaks)}, got {which!r}")
        if not peaks[which]:
            raise ValueError(f"{self.name} has no {which} peak (no such tensor cores)")
        return peaks[which]

    @property
    def ridge_intensity(self) -> float:
        """FLOP/byte where the FP32 roof meets the bandwidth roof."""
        return self.fp32_peak / self.hbm_bandwidth

    @property
    def fp32_peak_from_clock(self) -> float:
        """SMs x FP32 lanes per SM x 2 (an FMA is two FLOPs) x boost clock: checks the datasheet peak."""
        return self.sm_count * self.fp32_lanes_per_sm * 2 * self.boost_clock_hz


GPUS: dict[str, GPU] = {
    "A100 40GB SXM": GPU("A100 40GB SXM", (8, 0), 108, 1555e9, 19.5e12, 312e12, 1410e6, 164 * 1024, 64, 156e12, 1024),
    "A100 80GB SXM": GPU("A100 80GB SXM", (8, 0), 108, 2039e9, 19.5e12, 312e12, 1410e6, 164 * 1024, 64, 156e12, 1024),
    "H100 SXM": GPU("H100 SXM", (9, 0), 132, 3.35e12, 67e12, 989.5e12, 1980e6, 228 * 1024, 128, 494.7e12, 2048),
    "H200": GPU("H200", (9, 0), 132, 4.8e12, 67e12, 989.5e12, 1980e6, 228 * 1024, 128, 494.7e12, 2048),
    "T4": GPU("T4", (7, 5), 40, 320e9, 8.1e12, 65e12, 1590e6, 64 * 1024, 64, 0.0, 512),
}


def get_gpu(gpu: str | GPU) -> GPU:
    """A :class:`GPU` preset by name (a key of :data:`GPUS`), or the GPU itself; ValueError otherwise."""
    if isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, str) and gpu in GPUS:
        return GPUS[gpu]
    raise ValueError(f"gpu must be a flashnb.instruments.roofline.GPU or one of {sorted(GPUS)}, got {gpu!r}")


@dataclass(frozen=True)
class ModelledTime:
    """A roofline estimate -- **modelled, not measured**.  ``bound`` is ``"compute"`` or ``"memory"``."""

    seconds: float
    compute_seconds: float
    memory_seconds: float
    bound: str
    flops: float
    bytes: float
    gpu: str
    kind: str = "modelled"

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per HBM byte."""
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def tflops(self) -> float:
        """Modelled throughput (TFLOP/s) -- what the roofline allows, not what a kernel achieved."""
        return self.flops / self.seconds / 1e12 if self.seconds else math.inf

    def __str__(self) -> str:
        scale, unit = _time_unit(self.seconds)
        return (f"modelled {self.seconds * scale:.3f} {unit} on {self.gpu} ({self.bound}-bound: compute "
                f"{self.compute_seconds * scale:.3f} {unit}, memory {self.memory_seconds * scale:.3f} {unit})")


def _time_unit(seconds: float) -> tuple[float, str]:
    """(factor, unit) that shows ``seconds`` with digits before the point: ms from 1 ms up, then µs, then ns."""
    if seconds >= 1e-3:
        return 1e3, "ms"
    if seconds >= 1e-6:
        return 1e6, "µs"
    return 1e9, "ns"


def modelled_time(flops: float, bytes: float, gpu: str | GPU = "H100 SXM", peak: str = "fp32") -> ModelledTime:
    """Roofline time ``max(flops / peak, bytes / HBM bandwidth)`` -- a model, never a measurement.  ``peak``:
    ``"fp32"`` (the CUDA cores, default), ``"tensor_fp16"`` / ``"tensor_bf16"`` or ``"tensor_tf32"`` (dense)."""
    g = get_gpu(gpu)
    for name, value in (("flops", flops), ("bytes", bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    t_c = flops / g.peak(peak)
    t_m = bytes / g.hbm_bandwidth
    return ModelledTime(max(t_c, t_m), t_c, t_m, "compute" if t_c >= t_m else "memory", float(flops),
                        float(bytes), g.name)


def _points(points) -> list[tuple[str, float, float]]:
    out = []
    for p in points:
        if isinstance(p, ModelledTime):
            out.append((p.gpu, p.flops, p.bytes))
        elif isinstance(p, dict):
            out.append((str(p.get("label", p.get("name", ""))), float(p["flops"]), float(p["bytes"])))
        else:
            label, f, b = p
            out.append((str(label), float(f), float(b)))
    return out


def roofline_plot(points: Iterable, gpu: str | GPU = "H100 SXM", ax=None):
    """Draw the (modelled) FP32 roofline of ``gpu`` and each point at its arithmetic intensity.

    ``points``: ``(label, flops, bytes)`` tuples, dicts with those keys, or :class:`ModelledTime`.  Each
    point sits on the roof at its intensity -- the *modelled* attainable FLOP/s, not a measurement.
    Returns the matplotlib Axes (a new headless Figure's when ``ax`` is None).
    """
    g = get_gpu(gpu)
    pts = _points(points)
    if ax is None:
        from matplotlib.figure import Figure

        ax = Figure(figsize=(7, 4.5)).add_subplot()
    intens = [f / b for _, f, b in pts if b > 0] or [g.ridge_intensity]
    lo = min(min(intens), g.ridge_intensity) / 10
    hi = max(max(intens), g.ridge_intensity) * 10
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.loglog(xs, [min(g.fp32_peak, g.hbm_bandwidth * x) / 1e12 for x in xs], color="black",
              label=f"FP32 roof: {g.fp32_peak / 1e12:.1f} TFLOP/s, {g.hbm_bandwidth / 1e12:.2f} TB/s")
    ax.axvline(g.ridge_intensity, color="grey", ls=":", lw=1)
    for label, f, b in pts:
        x = f / b if b > 0 else hi
        y = min(g.fp32_peak, g.hbm_bandwidth * x) / 1e12
        ax.plot([x], [y], "o", label=f"{label} ({x:.1f} FLOP/B)")
    ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
    ax.set_ylabel("modelled attainable TFLOP/s (FP32)")
    ax.set_title(f"Roofline on {g.name} -- modelled, not measured")
    ax.legend(fontsize="small")
    return ax
