"""Flash-decoding's GPU measurement (notebook 11): :func:`~flashnb.kernels.launch.decode.decode` at several split
counts and FA2's forward on the same queries and cache, timed with CUDA events."""

from __future__ import annotations

import numpy as np

from ... import runtime
from ...common import cdiv, poisoning, to_device
from ...kernels.launch.decode import KVCache, decode, default_splits
from ...kernels.models.decode import launch_blocks
from ...stages import fa2
from .. import bench

__all__ = ["measure_gpu"]


def measure_gpu(BH: int = 8, length: int = 32768, d: int = 128, Nq: int = 1, splits=(1, 4, 16, None), *,
                repeats: int = 20, warmup: int = 3, seed: int = 0) -> list[dict]:
    """CUDA-event times (GPU only; for notebook 11) of :func:`decode` at each split count in ``splits`` (None:
    the heuristic for this GPU's SMs) and of FA2's forward (:func:`flashnb.stages.fa2.forward`, default tiles) on the
    same ``Nq`` queries and cache, with the blocks each launches.  The cache is filled before timing."""
    if runtime.MODE != "gpu":
        raise RuntimeError("measure_gpu times kernels on a GPU; on the simulator use bench.on_gpu("
                           "'flashnb.instruments.measure.decode:measure_gpu', ...), which measures nothing without a "
                           "GPU")
    info = bench.device_info()
    rng = np.random.default_rng(seed)
    q = to_device(rng.standard_normal((BH, Nq, d), dtype=np.float32))
    k, v = (to_device(rng.standard_normal((BH, length, d), dtype=np.float32)) for _ in range(2))
    cache = KVCache.wrap(k, v)
    scale = d ** -0.5
    flops = 4.0 * BH * Nq * length * d
    out = []
    with poisoning(False):                           # time the kernels, not the NaN fill of fresh outputs
        for S in splits:
            S_used = default_splits(BH, Nq, length, d, gpu=None) if S is None else S
            timing = bench.time_call(lambda: decode(q, cache, scale=scale, causal=True, num_splits=S_used),
                                     repeats=repeats, warmup=warmup, info=info, flops=flops)
            blocks = launch_blocks(BH, Nq, length, d, num_splits=S_used)
            out.append(timing.row(impl="flash-decoding", num_splits=S_used, heuristic=S is None, BH=BH, Nq=Nq,
                                  length=length, d=d, blocks=sum(blocks.values()),
                                  split_blocks=blocks["split-KV partials"]))
        timing = bench.time_call(lambda: fa2.forward(q, k, v, causal=True, scale=scale), repeats=repeats,
                                 warmup=warmup, info=info, flops=flops)
        out.append(timing.row(impl="fa2", num_splits=None, heuristic=False, BH=BH, Nq=Nq, length=length, d=d,
                              blocks=cdiv(Nq, fa2.default_tiles(d)["Br"]) * BH, split_blocks=None))
    return out
