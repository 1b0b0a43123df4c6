"""The memory profiler's requests for one vectorised launch (:mod:`flashnb.sim.memprofile`'s rules).

A request is, as in the threads simulator's profiler, the k-th access of each lane of one warp at one source
line to one array; its cost is the distinct 32-byte sectors its lanes touch (global memory) or the most distinct
4-byte words one of the 32 banks serves (shared memory), computed here for all requests of a line at once.
"""

from __future__ import annotations

import numpy as np

from . import tools

__all__ = ["summarise"]

_OP = {"r": "ld", "w": "st", "a": "atom"}


def _groups(*cols):
    """One group id per row of equal ``cols``."""
    stacked = np.stack([np.asarray(c, np.int64) for c in cols])
    _, inv = np.unique(stacked, axis=1, return_inverse=True)
    return inv.reshape(-1)


def _distinct_per_group(g, v, ngroups):
    """How many distinct values ``v`` each group has."""
    pairs = np.unique(np.stack([g, v]), axis=1)
    return np.bincount(pairs[0], minlength=ngroups), pairs


def summarise(log, prof, label, kernel):
    from ..memprofile import BANK_WIDTH, BANKS, SECTOR, LineStats

    stats = []
    for (site, op, name, memory), entries in log.items():
        block = np.concatenate([e[0] for e in entries])
        warp = np.concatenate([e[1] for e in entries])
        k = np.concatenate([e[2] for e in entries])
        offs = np.concatenate([e[3] for e in entries]).astype(np.int64)
        size = entries[0][4]
        g = _groups(block, warp, k)
        n = int(g.max()) + 1 if g.size else 0
        if memory == "global":
            s0, s1 = offs // SECTOR, (offs + size - 1) // SECTOR
            sec, _ = _distinct_per_group(np.concatenate([g, g]), np.concatenate([s0, s1]), n)
            elems, _ = _distinct_per_group(g, offs, n)
            cost = sec
            ideal = -(-(elems * size) // SECTOR)
        else:
            w0, w1 = offs // BANK_WIDTH, (offs + size - 1) // BANK_WIDTH
            nw, pairs = _distinct_per_group(np.concatenate([g, g]), np.concatenate([w0, w1]), n)
            bank_g = _groups(pairs[0], pairs[1] % BANKS)
            per_bank = np.bincount(bank_g)
            owner = np.zeros(per_bank.size, np.int64)
            owner[bank_g] = pairs[0]
            cost = np.zeros(n, np.int64)
            np.maximum.at(cost, owner, per_bank)
            ideal = -(-nw // BANKS)
        s = LineStats(label, kernel, name, memory, _OP[op], tools.where(site))
        s.requests = n
        s.cost = int(cost.sum())
        s.ideal = int(ideal.sum())
        stats.append(s)
    merged: dict = {}
    for s in stats:                      # lines that print alike are one line, as in the threads profiler
        key = (s.array, s.memory, s.op, s.where)
        if key in merged:
            t = merged[key]
            t.requests += s.requests
            t.cost += s.cost
            t.ideal += s.ideal
        else:
            merged[key] = s
    prof.lines.extend(sorted(merged.values(), key=lambda s: (s.memory, s.where, s.array, s.op)))
    prof.launches.append((label, kernel))
