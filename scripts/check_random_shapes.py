#!/usr/bin/env python
"""Every implementation against the float64 reference on random shapes the test suite never uses.

    python scripts/check_random_shapes.py [--seed 1] [--cases 10] [--max-n 100] [--impl fa2 ...]

Each case draws batch·heads in 1..2, Nq and Nk in 1..max-n, d from {1, 3, 8, 17, 32, 59, 64, 96, 111, 128} and
causal or not; runs forward and (where the impl has one) backward through the public API; and prints the max
absolute errors and the wall time.  On the simulator a naive case near N = 100, d = 100 takes a minute or more
(one Python thread per CUDA thread); the FlashAttention kernels take seconds.  Exit status 1 if any case fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import flashnb
from flashnb import reference
from flashnb.registry import IMPLS

# float32 kernels vs float64 over <= max-n keys with |q| ~ 2: observed errors are ~1e-6; these bounds leave
# two to three orders of magnitude and still catch any wrong index or mask (those give O(0.1) errors).
FWD_TOL = 1e-4
BWD_TOL = 1e-3
HEAD_DIMS = (1, 3, 8, 17, 32, 59, 64, 96, 111, 128)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", type=int, default=10)
    p.add_argument("--max-n", type=int, default=100)
    p.add_argument("--impl", action="append", choices=sorted(IMPLS), help="default: every dense impl")
    args = p.parse_args(argv)
    impls = args.impl or [n for n, e in IMPLS.items() if e.reference_mask is None]
    rng = np.random.default_rng(args.seed)
    bad = 0
    print(f"mode: {flashnb.MODE}; tolerances: forward {FWD_TOL}, backward {BWD_TOL}")
    for _ in range(args.cases):
        BH = int(rng.integers(1, 3))
        Nq, Nk = (int(x) for x in rng.integers(1, args.max_n + 1, size=2))
        d = int(rng.choice(HEAD_DIMS))
        causal = bool(rng.integers(0, 2))
        q = 2 * rng.standard_normal((BH, Nq, d))
        k, v = rng.standard_normal((BH, Nk, d)), rng.standard_normal((BH, Nk, d))
        do = rng.standard_normal((BH, Nq, d))
        o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
        grads_ref = reference.attention_backward(q, k, v, do, causal=causal)
        finite = np.isfinite(lse_ref)
        for name in impls:
            start = time.perf_counter()
            fwd_err = bwd_err = None
            try:
                o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl=name)
                fwd_err = max(np.abs(o - o_ref).max(), np.abs(lse[finite] - lse_ref[finite]).max(initial=0.0))
                ok = bool(fwd_err <= FWD_TOL and np.array_equal(np.isfinite(lse), finite) and not np.isnan(o).any())
                if IMPLS[name].backward is not None:
                    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl=name)
                    bwd_err = max(np.abs(g - r).max() for g, r in zip(grads, grads_ref))
                    ok &= bool(bwd_err <= BWD_TOL and not any(np.isnan(g).any() for g in grads))
                note = ""
            except Exception as exc:  # report and go on: one failure must not hide the others
                ok, note = False, f"{type(exc).__name__}: {exc}"[:160]
            bad += not ok
            fmt = lambda e: "-" if e is None else f"{e:.1e}"  # noqa: E731
            print(f"{'ok  ' if ok else 'FAIL'} {name:<8} BH={BH} Nq={Nq:<3} Nk={Nk:<3} d={d:<3} causal={causal!s:<5} "
                  f"fwd {fmt(fwd_err):>7}  bwd {fmt(bwd_err):>7}  {time.perf_counter() - start:6.1f} s {note}",
                  flush=True)
    print(f"{bad} failing case(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
