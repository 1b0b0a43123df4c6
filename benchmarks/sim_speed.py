"""How fast the two simulators are: the vectorised one (the default) against the Numba simulator's threads.

    python benchmarks/sim_speed.py            # writes benchmarks/sim_speed.md (about 6 minutes on 2 cores)

Each row runs the same launches in both modes in this one process, checks that the outputs are byte-identical
and the traffic counts equal, and reports wall times and their ratio.  Targets: fa2 forward at N = 512, d = 64,
causal at least 30x faster than threads; N = 4096 in under 30 s (vectorised only: the threads simulator would
take about half an hour, so it is not run); notebook-sized launches (N <= 128) at least 8x faster; racecheck at
most about 5x a plain vectorised run; the tensor-core kernels (fa2-tc, float16: mma.sync, ldmatrix, cp.async)
at notebook sizes within about 2x fa2-fast's vectorised time (float32, the CUDA cores), forward and backward.
These are wall times of the simulator on this machine, nothing about a GPU.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("FLASHNB_DEVICE", "sim")
os.environ.setdefault("FLASHNB_SIM_QUIET", "1")

import numpy as np  # noqa: E402

import flashnb  # noqa: E402
from flashnb import sim
from flashnb.instruments import traffic  # noqa: E402
from flashnb.sim import racecheck  # noqa: E402

OUT = Path(__file__).with_name("sim_speed.md")


def inputs(N, d, BH=1, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BH, N, d)).astype(dtype) for _ in range(4)]


def forward(impl, N, d, causal, dtype=np.float32, **opts):
    q, k, v, _ = inputs(N, d, dtype=dtype)
    return lambda: flashnb.attention_forward(q, k, v, impl=impl, causal=causal, **opts)


def backward(impl, N, d, causal, dtype=np.float32, **opts):
    """The backward's launches alone (O and L from one forward, made here)."""
    q, k, v, do = inputs(N, d, dtype=dtype)
    o, lse = flashnb.attention_forward(q, k, v, impl=impl, causal=causal, **opts)
    return lambda: flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, causal=causal, **opts)


def forward_backward(impl, N, d, causal, **opts):
    q, k, v, do = inputs(N, d)

    def run():
        o, lse = flashnb.attention_forward(q, k, v, impl=impl, causal=causal, **opts)
        return (o, lse) + tuple(flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, causal=causal, **opts))
    return run


def timed(mode, fn):
    """(seconds, outputs, traffic counts) of one call of ``fn`` under simulator ``mode``."""
    with sim.simulating(mode), traffic.count() as t:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    return dt, [np.asarray(a) for a in out], t.summary()


def same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def main():
    rows, notes = [], []
    cases = [
        ("fa2 forward", "N = 512, d = 64, causal", forward("fa2", 512, 64, True), True, 30),
        ("fa2-fast forward", "N = 512, d = 64, causal", forward("fa2-fast", 512, 64, True), True, 30),
        ("naive forward + backward", "N = 96, d = 32", forward_backward("naive", 96, 32, False), True, 8),
        ("fa1 forward + backward", "N = 128, d = 32, causal", forward_backward("fa1", 128, 32, True), True, 8),
        ("fa2 forward + backward", "N = 128, d = 64, causal", forward_backward("fa2", 128, 64, True), True, 8),
        ("fa2 forward", "N = 4096, d = 64, causal", forward("fa2", 4096, 64, True), False, None),
    ]
    half = dict(dtype=np.float16, storage="float16")
    shape = "N = 128, d = 64, causal"
    versus = [  # (direction, fa2-tc row, fa2-fast row): the tensor cores against the CUDA cores, vectorised
        ("forward", ("fa2-tc forward (float16)", shape, forward("fa2-tc", 128, 64, True, **half), True, 8),
         ("fa2-fast forward", shape, forward("fa2-fast", 128, 64, True), True, 8)),
        ("backward", ("fa2-tc backward (float16)", shape, backward("fa2-tc", 128, 64, True, **half), True, 8),
         ("fa2-fast backward", shape, backward("fa2-fast", 128, 64, True), True, 8)),
    ]
    cases += [case for _, tc_row, fast_row in versus for case in (tc_row, fast_row)]
    vector_time = {}
    for name, shape, fn, both, target in cases:
        print(f"{name}, {shape} ...", file=sys.stderr, flush=True)
        fn()  # warm-up: kernel factories, the translation cache, Numba's simulator set-up
        tv, ov, cv = timed("vector", fn)
        vector_time[name] = tv
        if both:
            tt, ot, ct = timed("threads", fn)
            exact = same(ov, ot) and cv == ct
            ratio = tt / tv
            met = "yes" if exact and ratio >= target else "no"
            rows.append(f"| {name} | {shape} | {tt:.2f} s | {tv:.2f} s | {ratio:.0f}x | >= {target}x | "
                        f"{'yes' if exact else 'NO'} | {met} |")
        else:
            met = "yes" if tv < 30 else "no"
            rows.append(f"| {name} | {shape} | not run | {tv:.2f} s | | under 30 s | | {met} |")
    # racecheck against a plain vectorised run of the same launches
    fn = forward_backward("fa2", 128, 64, True)
    fn()
    with sim.simulating("vector"), racecheck.check():
        fn()  # warm-up, as for every row above
    gc.collect()
    with sim.simulating("vector"):
        t0 = time.perf_counter()
        fn()
        plain = time.perf_counter() - t0
        t0 = time.perf_counter()
        with racecheck.check():
            fn()
        checked = time.perf_counter() - t0
    notes.append(f"| racecheck, fa2 forward + backward, N = 128, d = 64, causal | {plain:.2f} s | {checked:.2f} s | "
                 f"{checked / plain:.1f}x | at most ~5x | {'yes' if checked / plain <= 5.5 else 'no'} |")

    import numba
    head = [
        "# The vectorised simulator against the threads simulator",
        "",
        f"Made by `python benchmarks/sim_speed.py` on {datetime.date.today().isoformat()}: Python "
        f"{platform.python_version()}, numba-cuda {getattr(numba, '__version__', '?')}, NumPy {np.__version__}, "
        f"{os.cpu_count()} CPU cores. Wall time of one call after a warm-up call, in one process; *exact* means "
        "every output byte-identical and the traffic counts equal between the two modes. Simulator times say "
        "nothing about a GPU.",
        "",
        "| launches | shape (one head) | threads | vector | speed-up | target | exact | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    tail = ["", "| tool | plain vector | checked | cost | target | met |", "|---|---|---|---|---|---|"]
    tc = ["", "The tensor-core kernels against the CUDA-core kernel, both vectorised (the times of the rows above):",
          "", "| launches | shape (one head) | fa2-tc (float16) | fa2-fast (float32) | ratio | target | met |",
          "|---|---|---|---|---|---|---|"]
    for direction, tc_row, fast_row in versus:
        t_tc, t_fast = vector_time[tc_row[0]], vector_time[fast_row[0]]
        ratio = t_tc / t_fast
        tc.append(f"| {direction} | {tc_row[1]} | {t_tc:.2f} s | {t_fast:.2f} s | {ratio:.2f}x | at most ~2x | "
                  f"{'yes' if ratio <= 2.2 else 'no'} |")
    OUT.write_text("\n".join(head + rows + tail + notes + tc) + "\n")
    print(OUT.read_text())


if __name__ == "__main__":
    main()
