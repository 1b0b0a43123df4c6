"""Notebook 11's GPU measurement: the product kernel's forward and backward (:mod:`flashnb.kernels.launch.flash`) timed
with CUDA events in each storage, float32, float16 and bfloat16, beside the modelled HBM bytes of its launches."""

from __future__ import annotations

import numpy as np

from ...common import poisoning, to_bfloat16, to_device
from ...kernels.launch.flash import backward, forward
from ...kernels.models.simt import model_backward, model_bytes, model_forward
from ..bench import device_info, time_call

__all__ = ["measure_storage"]


def measure_storage(BH: int = 16, N: int = 4096, d: int = 64, storages=("float32", "float16", "bfloat16"), *,
                    causal: bool = False, repeats: int = 10, warmup: int = 3, seed: int = 0) -> list[dict]:
    """CUDA-event time of the product kernel's forward and backward with Q, K, V, O (dO, dK, dV, dQ) in each
    storage, at one shape (GPU only; notebook 11's measurement, through :func:`flashnb.instruments.bench.on_gpu`).
    Same values in every storage (drawn once, rounded to float16); each row carries the modelled HBM bytes
    (:func:`flashnb.kernels.models.simt.model_bytes`) of its launches."""
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
