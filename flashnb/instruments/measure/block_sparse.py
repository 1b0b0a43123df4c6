"""Stage 5's GPU measurement (notebook 07): fa2's block-sparse forward (:mod:`flashnb.stages.block_sparse`) timed
with CUDA events at several densities of a random block mask."""

from __future__ import annotations

import numpy as np

from ...common import poisoning, to_device
from ...stages import fa2
from ...stages.block_sparse import random
from .. import bench
from ..roofline import flops_forward

__all__ = ["measure_gpu"]


def measure_gpu(BH: int = 16, N: int = 4096, d: int = 64, densities=(1.0, 0.5, 0.25, 0.125), *, repeats: int = 10,
                warmup: int = 3, seed: int = 0) -> list[dict]:
    """CUDA-event time of fa2's block-sparse forward at several densities of a random block mask (GPU only;
    for notebook 07).  Masks are built at fa2's default forward tiles and copied to the device untimed; FLOPs
    count only the computed blocks (dense FLOPs x density)."""
    info = bench.device_info()
    rng = np.random.default_rng(seed)
    q, k, v = (to_device(rng.standard_normal((BH, N, d), dtype=np.float32)) for _ in range(3))
    t = fa2.default_tiles(d)
    out = []
    for s in densities:
        bm = random(N, N, t["Br"], t["Bc"], s, seed=seed)
        pm = fa2.prepare_block_mask(bm, direction="forward", BH=BH, Nq=N, Nk=N, d=d)
        flops = flops_forward(1, BH, N, N, d) * bm.density
        with poisoning(False):  # time the kernels, not the NaN fill of fresh outputs
            timing = bench.time_call(lambda: fa2.forward(q, k, v, causal=False, scale=d ** -0.5, block_mask=pm),
                                     repeats=repeats, warmup=warmup, info=info, flops=flops)
        out.append(timing.row(density=bm.density, BH=BH, N=N, d=d))
    return out
