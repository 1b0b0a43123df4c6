"""How much faster is flashnb's simulator barrier than the stock one?  (simulator only)

Runs one barrier-heavy kernel -- 64-thread blocks doing repeated shared-memory tree reductions, 8
``syncthreads()`` per reduction -- first on the stock Numba CUDA simulator (flashnb.sim uninstalled), then
with flashnb.sim installed, in the same process, checks both give the right answer, and prints the ratio.

    python benchmarks/sim_barrier_speed.py [--blocks 4] [--reps 10]
"""

from __future__ import annotations  # noqa: I001  (flashnb must be imported before numba.cuda)

import argparse
import time

import numpy as np

import flashnb  # noqa: F401  (selects the simulator before numba.cuda is imported)
from flashnb import sim
from numba import cuda, float32

TPB = 64


@cuda.jit
def tree_sums(x, out, reps):
    tid = cuda.threadIdx.x
    b = cuda.blockIdx.x
    s = cuda.shared.array(TPB, float32)
    for r in range(reps):
        s[tid] = x[b, tid] + float32(r)
        cuda.syncthreads()
        half = TPB // 2
        while half > 0:  # 6 halvings; with the load barrier above and the one below: 8 per repetition
            if tid < half:
                s[tid] += s[tid + half]
            cuda.syncthreads()
            half //= 2
        if tid == 0:
            out[b, r] = s[0]
        cuda.syncthreads()


def timed(blocks, reps):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 8, size=(blocks, TPB)).astype(np.float32)  # small integers: exact float32 sums
    out = np.full((blocks, reps), np.nan, np.float32)
    start = time.perf_counter()
    tree_sums[blocks, TPB](x, out, np.int32(reps))
    elapsed = time.perf_counter() - start
    expected = x.sum(axis=1)[:, None] + TPB * np.arange(reps, dtype=np.float32)[None, :]
    np.testing.assert_array_equal(out, expected)
    return elapsed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if flashnb.MODE != "sim":
        raise SystemExit("this benchmark measures the simulator; run it without a GPU or with FLASHNB_DEVICE=sim")
    barriers = args.blocks * args.reps * 8
    sim.uninstall()
    stock = timed(args.blocks, args.reps)
    if not sim.install():
        raise SystemExit("flashnb.sim could not be installed (see the warning above)")
    fast = timed(args.blocks, args.reps)
    print(f"kernel: {args.blocks} blocks x {TPB} threads, {args.reps * 8} syncthreads per block ({barriers} in all)")
    print(f"stock simulator : {stock:7.3f} s  ({1e3 * stock / barriers:6.2f} ms per block-barrier)")
    print(f"flashnb.sim     : {fast:7.3f} s  ({1e3 * fast / barriers:6.2f} ms per block-barrier)")
    print(f"speed-up        : {stock / fast:5.1f}x")


if __name__ == "__main__":
    main()
