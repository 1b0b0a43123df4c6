"""GPU measurement of the tensor-core kernels (notebook 12)."""

from __future__ import annotations

import numpy as np

from ...common import poisoning, to_device
from ...registry import IMPLS
from .. import bench
from ..roofline import flops_backward, flops_forward

__all__ = ["measure_gpu"]


def measure_gpu(BH: int = 64, N: int = 4096, d: int = 128, *, repeats: int = 10, warmup: int = 3,
                seed: int = 0) -> list[dict]:
    """CUDA-event time of fa2-tc (float16) and fa2-fast (float32, the CUDA cores) forward and backward at one shape
    (GPU only; for notebook 12): one row per (impl, direction) with TFLOP/s by the FlashAttention formula."""
    info = bench.device_info()
    rng = np.random.default_rng(seed)
    x = [rng.standard_normal((BH, N, d), dtype=np.float32) for _ in range(4)]
    out = []
    for impl, storage in (("fa2-tc", "float16"), ("fa2-fast", "float32")):
        entry = IMPLS[impl]
        opts = dict(storage=storage) if storage != "float32" else {}
        with poisoning(False):
            q, k, v, do = (to_device(a.astype(np.float16) if storage == "float16" else a, storage) for a in x)
            o, lse = entry.forward(q, k, v, causal=False, scale=d ** -0.5, **opts)
            for direction, fn, flops in (
                    ("forward", lambda: entry.forward(q, k, v, causal=False, scale=d ** -0.5, **opts),
                     flops_forward(1, BH, N, N, d)),
                    ("backward", lambda: entry.backward(q, k, v, o, lse, do, causal=False, scale=d ** -0.5, **opts),
                     flops_backward(1, BH, N, N, d))):
                t = bench.time_call(fn, repeats=repeats, warmup=warmup, info=info, flops=flops)
                out.append(t.row(impl=impl, storage=storage, direction=direction, BH=BH, N=N, d=d))
    return out

