"""Exercises of notebook 08 (from readable to fast: what the machine code costs)."""

from __future__ import annotations

import heapq

import numpy as np

from . import Wrong, close, exercise, require

# --------------------------------------------------------------------------- 08.1


@exercise("08.1", "FFMAs per shared load", level=1, minutes=10,
          hint="""In one step of line 8 a lane loads its TM values of Q_i and its TN values of K_j, then does every
          product of the two: TM·TN FFMAs. With 128-bit loads each load brings 4 consecutive k, so a step covers 4
          k: the same TM + TN loads now feed 4·TM·TN FFMAs.""",
          explain="""Scalar: TM·TN / (TM + TN) FFMAs per shared load; 128-bit: 4·TM·TN / (TM + TN). At stage 4's
          forward micro-tile (TM = TN = 4 at d = 64) that is 2 vs 8; at the step kernels' 8 x 4 it is 2.67 vs 10.67,
          which is exactly what the SASS of the hot loops shows (128 FFMAs for 48 LDS, 128 FFMAs for 12 LDS.128).
          The FP32 pipe takes 4 warp-FFMAs per clock and the shared pipe one 128-byte wavefront (LDS.128 of 32
          lanes: 4 wavefronts), so to keep the FP32 pipe busy an LDS.128 must feed at least 16 FFMAs -- the reason
          the fast kernel still wants large micro-tiles.""")
def check_08_1(fmas_per_load):
    """fmas_per_load(TM, TN, vec): FFMAs per shared load of line 8 for a TM x TN micro-tile and vec floats per
    load (1: LDS.32; 4: LDS.128)."""
    require(callable(fmas_per_load), "fmas_per_load must be a function (TM, TN, vec) -> a number")
    rng = np.random.default_rng(81)
    for _ in range(6):
        TM, TN, vec = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.choice([1, 2, 4]))
        # one step covers vec values of k: TM + TN loads, vec·TM·TN multiply-adds
        close(fmas_per_load(TM, TN, vec), vec * TM * TN / (TM + TN), rel=1e-9,
              what=f"fmas_per_load({TM}, {TN}, {vec})")


@check_08_1.solves
def _():
    def fmas_per_load(TM, TN, vec):
        return vec * TM * TN / (TM + TN)      # TM + TN loads bring vec k each: vec·TM·TN products

    return dict(fmas_per_load=fmas_per_load)


@check_08_1.fails
def _():
    return dict(fmas_per_load=lambda TM, TN, vec: TM * TN / (TM + TN))     # forgets the vector width


# --------------------------------------------------------------------------- 08.2


@exercise("08.2", "which pipe binds", level=2, minutes=20,
          hint="""Each pipe takes a fixed number of warp-instructions per SM per clock: issue 4, fp32 (lanes/32) --
          4 on an H100 --, mufu 0.5, mio 1. The cycles a tile needs on a pipe are its demand divided by that rate;
          the slowest pipe sets the time. The FP32 pipe at full speed would need ffma / 4 cycles.""",
          explain="""cycles(p) = demand(p) / rate(p); the binding pipe is the argmax; the fraction of the FP32
          peak the steady state can reach is (ffma / fp32 rate) / max cycles. For the fast forward at d = 64 it is
          the issue pipe (every instruction that is not an FFMA takes an issue slot an FFMA could have had): the
          fraction is then the FFMA share of the tile. At d = 128 with the tiles that fit in 48 KiB of static shared
          memory (three rows per lane, the fallback when a GPU refuses more) it is the shared pipe: too few FFMAs
          per LDS.128; the default 64 x 64 tiles (dynamic shared memory) feed enough to be issue-bound again.""")
def check_08_2(bound):
    """bound(pipes, ffma, fp32_lanes): pipes = {"issue": n, "fp32": n, "mufu": n, "mio": n} warp-instructions
    (or wavefronts) of one tile, ffma of them FFMAs; fp32_lanes per SM (128 on cc 9.0).  Returns (name of the
    binding pipe, fraction of the FP32 peak)."""
    from ..instruments.roofline import GPU
    from ..instruments.sass_model import Counts, SassCounts, modelled_time

    require(callable(bound), "bound must be a function (pipes, ffma, fp32_lanes) -> (pipe, fraction)")
    rng = np.random.default_rng(82)
    for _ in range(8):
        lanes = int(rng.choice([64, 128]))
        ffma = int(rng.integers(100, 2000))
        pipes = dict(issue=ffma + int(rng.integers(0, 3000)), fp32=ffma + int(rng.integers(0, 500)),
                     mufu=int(rng.integers(0, 400)), mio=int(rng.integers(0, 3000)))
        got = bound(dict(pipes), ffma, lanes)
        require(isinstance(got, tuple) and len(got) == 2, "bound must return (pipe name, fraction)")
        # ground truth: flashnb.instruments.sass_model on one block of one tile, one slot (no prologue or epilogue)
        tile = Counts(categories={"ffma": ffma}, pipes=dict(pipes))
        c = SassCounts("exercise", Counts(), tile, Counts(), [])
        gpu = GPU("toy", (9, 0), 1, 1e30, lanes * 2 * 1e9, 1e12, 1e9, 228 * 1024, lanes)
        t = modelled_time(c, tiles_per_block=[1], warps=1, blocks_per_sm=1, hbm_bytes=0.0,
                          flops=2.0 * 32 * ffma, gpu=gpu)
        if got[0] != t.bound:
            raise Wrong(f"for pipes={pipes} (fp32 lanes {lanes}) the binding pipe is not {got[0]!r}")
        close(got[1], t.fraction_of_peak(gpu), rel=1e-6, what=f"the fraction of peak for pipes={pipes}")


@check_08_2.solves
def _():
    def bound(pipes, ffma, fp32_lanes):
        rate = {"issue": 4, "fp32": fp32_lanes / 32, "mufu": 0.5, "mio": 1}
        cycles = {p: pipes[p] / rate[p] for p in rate}          # each pipe's cycles for the tile
        worst = max(cycles, key=cycles.get)
        return worst, (ffma / rate["fp32"]) / cycles[worst]     # FFMA cycles at full speed / actual

    return dict(bound=bound)


@check_08_2.fails
def _():
    def issue_only(pipes, ffma, fp32_lanes):                     # ignores the shared and MUFU pipes
        return "issue", ffma / pipes["issue"]

    return dict(bound=issue_only)


# --------------------------------------------------------------------------- 08.3


def _makespan(durations, slots):
    """Greedy dispatch in order onto the slot that frees first (an event simulation, written for the check)."""
    free = [0.0] * slots
    heapq.heapify(free)
    end = 0.0
    for d in durations:
        t = heapq.heappop(free) + d
        end = max(end, t)
        heapq.heappush(free, t)
    return end


@exercise("08.3", "heavy first", level=2, minutes=20,
          hint="""A GPU hands out blocks in launch order to whichever SM slot frees first. Keep, for every slot, the
          time it becomes free (a heap); each block starts at the smallest of them. Causal: block i of Tr sees
          i + 1 tiles (Nq = Nk, Br = Bc).""",
          explain="""With the light blocks first, the heaviest block starts last and ends alone: the launch lasts
          about (its own length) longer than it needs to. Heavy first, the long blocks start at once and the short
          ones fill the gaps. For Tr = 64 causal blocks on 16 slots, light first ends at 160 tile-times, heavy first
          at 130 -- the ideal (all 2,080 tile-times spread evenly over 16 slots): a ratio of 1.23.""")
def check_08_3(makespan, light_over_heavy):
    """makespan(durations, slots): when the last block ends if blocks of these durations are dispatched in
    order onto `slots` slots, each to the first free one.  light_over_heavy: makespan of causal blocks of
    1, 2, ..., 64 tile-times on 16 slots, light first, divided by heavy first."""
    require(callable(makespan), "makespan must be a function (durations, slots) -> a number")
    rng = np.random.default_rng(83)
    for _ in range(6):
        n, slots = int(rng.integers(1, 40)), int(rng.integers(1, 9))
        durations = [float(x) for x in rng.integers(1, 20, size=n)]
        close(makespan(list(durations), slots), _makespan(durations, slots), rel=1e-9,
              what=f"makespan of {n} blocks on {slots} slots")
    tiles = [float(i + 1) for i in range(64)]
    close(light_over_heavy, _makespan(tiles, 16) / _makespan(tiles[::-1], 16), rel=1e-3, what="light_over_heavy")


@check_08_3.solves
def _():
    import heapq

    def makespan(durations, slots):
        free = [0.0] * slots                       # when each slot frees
        for d in durations:
            heapq.heappush(free, heapq.heappop(free) + d)
        return max(free)

    tiles = [i + 1 for i in range(64)]
    return dict(makespan=makespan, light_over_heavy=makespan(tiles, 16) / makespan(tiles[::-1], 16))


@check_08_3.fails
def _():
    def round_robin(durations, slots):              # block b on slot b mod slots: not what the GPU does
        load = [0.0] * slots
        for b, d in enumerate(durations):
            load[b % slots] += d
        return max(load)

    return dict(makespan=round_robin, light_over_heavy=1.0)
