"""What racecheck costs: one FA2 forward + backward on the simulator, plain, counted, and race-checked.

    python benchmarks/racecheck_cost.py

The sizes and tiles are those of tests/sim/test_sim_racecheck.py (several tiles, two warps).  Wall time on the
simulator: it says how long a check takes here, nothing about a GPU.
"""

import time

import numpy as np

import flashnb
from flashnb.instruments import traffic
from flashnb.sim import racecheck

rng = np.random.default_rng(7)
q, k, v, do = (rng.standard_normal((1, n, 8)) for n in (24, 40, 40, 24))
OPTS = dict(Br=16, Bc=16, warps=2)


def run():
    o, lse = flashnb.attention_forward(q, k, v, impl="fa2", **OPTS)
    flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2", **OPTS)


run()  # warm-up (kernel factories, first launches)
for name, ctx in (("plain", None), ("traffic.count", traffic.count), ("racecheck.check", racecheck.check)):
    t0 = time.perf_counter()
    if ctx is None:
        run()
    else:
        with ctx():
            run()
    print(f"{name:16s} {time.perf_counter() - t0:5.2f} s")
