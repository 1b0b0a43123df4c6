"""Stage 2's GPU measurement (notebook 02): each softmax method of :mod:`flashnb.stages.softmax` timed with CUDA
events, beside the HBM bytes its model counts."""

from __future__ import annotations

import numpy as np

from ...common import empty, to_device
from ...stages.softmax import METHODS, model_softmax, softmax_device
from .. import bench

__all__ = ["measure_gpu"]


def measure_gpu(rows: int = 4096, n: int = 4096, *, threads: int = 256, repeats: int = 20, warmup: int = 3,
                seed: int = 1) -> list[dict]:
    """CUDA-event time of each softmax method on a ``rows x n`` float32 matrix (GPU only; for notebook 02).

    One row per method: the :class:`flashnb.instruments.bench.Timing` fields plus the modelled HBM bytes
    (:func:`model_softmax`) and the bandwidth they imply, ``model_bytes / median``.
    """
    info = bench.device_info()
    X = to_device(np.random.default_rng(seed).standard_normal((rows, n), dtype=np.float32))
    Y = empty((rows, n), poison=False)
    out = []
    for method in METHODS:
        t = bench.time_call(lambda: softmax_device(X, Y, method, threads=threads), repeats=repeats, warmup=warmup,
                            info=info)
        m = model_softmax(rows, n, method, threads=threads)[0]
        nbytes = 4 * (sum(m["reads"].values()) + sum(m["writes"].values()))
        out.append(t.row(method=method, rows=rows, n=n, threads=threads, model_bytes=nbytes,
                         gb_per_s=nbytes / (t.median_ms * 1e-3) / 1e9))
    return out
