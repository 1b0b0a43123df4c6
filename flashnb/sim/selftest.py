"""Tiny kernels that check the simulator patch (used by :func:`flashnb.sim.self_test`)."""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

FULL = 0xFFFFFFFF
NT = 40  # threads per block: not a multiple of 32, so the second warp is partial


@cuda.jit
def _barrier_kernel(out, votes, rounds):
    tid = cuda.threadIdx.x
    bid = cuda.blockIdx.x
    s = cuda.shared.array(64, float32)
    s[tid] = float32(tid + 100 * bid)
    cuda.syncthreads()
    out[bid, tid] = s[(tid + 1) % NT]  # a neighbour's value: only right after the barrier
    # numba types these barriers' predicate as int32 (a bool does not compile for a GPU)
    c = cuda.syncthreads_count(int32(1) if tid % 3 == 0 else int32(0))
    a = cuda.syncthreads_and(int32(1) if tid < NT else int32(0))
    o = cuda.syncthreads_or(int32(1) if tid == 7 else int32(0))
    votes[bid, tid, 0] = c
    votes[bid, tid, 1] = a
    votes[bid, tid, 2] = o
    if tid >= NT - 4:
        return  # early return: the remaining barriers must not wait for these threads
    for k in range(3):
        cuda.syncthreads()
        if tid == 0:
            s[0] = float32(k + 1)
        cuda.syncthreads()
        rounds[bid, tid, k] = s[0]


@cuda.jit
def _warp_kernel(sums, ballots):
    tid = cuda.threadIdx.x
    v = float32(tid)
    offset = 8
    while offset > 0:  # sum over each group of 16 lanes (the partial last warp has exactly 16)
        v += cuda.shfl_xor_sync(FULL, v, offset)
        offset //= 2
    sums[tid] = v
    ballots[tid] = cuda.ballot_sync(FULL, tid % 2 == 0)


def run(warp: bool = True) -> dict:
    checks = []
    grid = 2
    out = np.full((grid, NT), np.nan, np.float32)
    votes = np.full((grid, NT, 3), -1, np.int32)
    rounds = np.full((grid, NT, 3), np.nan, np.float32)
    _barrier_kernel[grid, NT](out, votes, rounds)
    tid = np.arange(NT)
    for b in range(grid):
        np.testing.assert_array_equal(out[b], (tid + 1) % NT + 100 * b, err_msg="syncthreads: shared exchange")
        assert (votes[b, :, 0] == np.count_nonzero(tid % 3 == 0)).all(), "syncthreads_count"
        assert (votes[b, :, 1] == 1).all() and (votes[b, :, 2] == 1).all(), "syncthreads_and / syncthreads_or"
        np.testing.assert_array_equal(rounds[b, : NT - 4], np.tile([1, 2, 3], (NT - 4, 1)), err_msg="early return")
    checks += ["syncthreads", "syncthreads_count/and/or", "early return"]
    if warp:
        n = 48
        sums = np.full(n, np.nan, np.float32)
        ballots = np.zeros(n, np.int64)
        _warp_kernel[1, n](sums, ballots)
        t = np.arange(n)
        expected = np.array([sum(range(16 * (i // 16), 16 * (i // 16) + 16)) for i in t], np.float32)
        np.testing.assert_array_equal(sums, expected, err_msg="shfl_xor_sync reduction")
        assert (ballots[:32] == 0x55555555).all() and (ballots[32:] == 0x5555).all(), "ballot_sync"
        checks += ["shfl_xor_sync", "ballot_sync (partial warp)"]
    return {"installed": warp, "checks": checks}
