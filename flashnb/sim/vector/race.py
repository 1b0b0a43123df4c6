"""The race checker's analysis of one vectorised launch (:mod:`flashnb.sim.racecheck`'s rules, its reports).

The launch logged every global and shared element access of its active lanes: element (by address; shared
memory is one copy per block), block, thread, the barrier phase of the block and the ``syncwarp`` phase of the
lane, read/write/atomic, line.  Two accesses can race only if they touch one element from two threads and one
of them writes (or one is an atomic and the other is not), so the elements where that happens are found first
with array operations; only their accesses are then replayed through the threads simulator's shadow-memory
rules (last write, reads and atomics since, per element; ordered by a barrier between them in one block, or a
``syncwarp`` between two lanes of one warp), in the order the threads simulator runs them: block after block,
barrier phase after phase, thread after thread, each thread's accesses in program order.  The races found, their
counts and first examples are those that order gives.
"""

from __future__ import annotations

import numpy as np

from . import tools

__all__ = ["analyse"]

_OPS = ("read", "write", "atomic")
_CODE = {"r": 0, "w": 1, "a": 2}


def _index_of(arr, f, lane):
    """The element index, in ``arr``'s own coordinates, of flat element ``f`` (as the threads tracker names it)."""
    off = arr.off[lane] if type(arr.off) is np.ndarray else arr.off
    rem = int(f) - int(off)
    out = []
    for st in arr.st:
        i, rem = divmod(rem, st) if st > 0 else (0, rem)
        out.append(int(i))
    return tuple(out)


def analyse(log, sink, label, kernel, grid, T):
    from ..racecheck import Access, Race

    if not log:
        sink.launches += 1
        return
    spaces: dict = {}
    # One row per logged lane access, built entry-wise with array operations: an entry's scalars (its
    # operation, the element key's base and scale) repeated over its lanes.
    lens = np.fromiter((len(e[2]) for e in log), np.int64, len(log))
    base, scale, opcode, shared, size = [], [], [], [], []
    for entry in log:
        arr = entry[0]
        if arr.memory == "shared":
            base.append(spaces.setdefault(id(arr.root), len(spaces) + 1) << 48)
            scale.append(1)
            shared.append(True)
        else:
            base.append(arr.addr0)
            scale.append(arr.dtype.itemsize)
            shared.append(False)
        size.append(arr.base.size)
        opcode.append(_CODE[entry[1]])
    f_all = np.concatenate([e[2] for e in log]).astype(np.int64)
    key = np.repeat(np.array(base, np.int64), lens) + f_all * np.repeat(np.array(scale, np.int64), lens)
    blk = np.concatenate([e[4] for e in log]).astype(np.int64)
    tid = np.concatenate([e[5] for e in log]).astype(np.int64)
    ph = np.concatenate([e[6] for e in log]).astype(np.int64)
    code = np.repeat(np.array(opcode, np.int8), lens)
    on_shared = np.repeat(np.array(shared, bool), lens)

    def conflicting(starts, who, cs):
        """The first sorted position of each group (starting at ``starts``) whose accesses come from more than
        one ``who`` and conflict (a write, or an atomic beside a plain access)."""
        many = np.minimum.reduceat(who, starts) != np.maximum.reduceat(who, starts)
        anyw = np.maximum.reduceat((cs == 1).view(np.int8), starts).astype(bool)
        anya = np.maximum.reduceat((cs == 2).view(np.int8), starts).astype(bool)
        anyp = np.maximum.reduceat((cs != 2).view(np.int8), starts).astype(bool)
        return starts[many & (anyw | (anya & anyp))]

    # An element can race only where two threads conflict on it unordered: in two blocks, or in one block
    # within one barrier phase (a superset of the races: the replay below applies the exact rules).
    sus_keys: set = set()
    rows = np.flatnonzero(~on_shared)
    if len(rows):
        gk, gb, ga, gp, gc = key[rows], blk[rows], blk[rows] * T + tid[rows], ph[rows], code[rows]
        order = np.argsort(gk, kind="stable")
        ks = gk[order]
        across = conflicting(np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]]), gb[order], gc[order])
        order2 = np.lexsort((gp, gb, gk))
        k2, b2, p2 = gk[order2], gb[order2], gp[order2]
        new = (k2[1:] != k2[:-1]) | (b2[1:] != b2[:-1]) | (p2[1:] != p2[:-1])
        within = conflicting(np.flatnonzero(np.r_[True, new]), ga[order2], gc[order2])
        sus_keys |= set(ks[across].tolist()) | set(k2[within].tolist())
    rows = np.flatnonzero(on_shared)
    if len(rows):
        # Shared memory is one copy per block (its element index names the block), so only one block's
        # threads within one barrier phase can conflict.  Element, phase, thread and operation pack into one
        # integer, so one sort of the values (no index sort) groups them.
        offs, total = {}, 0
        for entry, sz in zip(log, size):
            r = id(entry[0].root)
            if entry[0].memory == "shared" and r not in offs:
                offs[r], total = total, total + sz
        start = np.repeat(np.array([offs.get(id(e[0].root), 0) for e in log], np.int64), lens)
        elem = start[rows] + f_all[rows]
        P = int(ph[rows].max()) + 1
        tbits = max(int(tid[rows].max()), 1).bit_length()
        if (total * P).bit_length() + tbits + 2 <= 62:
            cell = elem * P + ph[rows]                  # (element, barrier phase)
            rc = code[rows]
            if total * P <= 1 << 27:
                # only a cell that is written (or updated atomically) can conflict: a table of the written
                # cells drops every read of an element no thread writes in that phase, before the sort
                written = np.zeros(total * P, bool)
                written[cell[rc != 0]] = True
                keep = np.flatnonzero(written[cell])
                rows, elem, cell, rc = rows[keep], elem[keep], cell[keep], rc[keep]
            packed = (cell << (tbits + 2)) | (tid[rows] << 2) | rc
            if len(packed):
                packed.sort()
                grp = packed >> (tbits + 2)
                starts = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
                cs = (packed & 3).astype(np.int8)
                hit = conflicting(starts, (packed >> 2) & ((1 << tbits) - 1), cs)
                if len(hit):
                    bad = np.unique(grp[hit] // P)
                    sus_keys |= set(key[rows[np.isin(elem, bad)]].tolist())
        else:  # pragma: no cover (more elements x phases x threads than one int64 holds)
            sk, sp = key[rows], ph[rows]
            order2 = np.lexsort((sp, sk))
            k2, p2 = sk[order2], sp[order2]
            new = (k2[1:] != k2[:-1]) | (p2[1:] != p2[:-1])
            within = conflicting(np.flatnonzero(np.r_[True, new]), tid[rows][order2], code[rows][order2])
            sus_keys |= set(k2[within].tolist())
    if not sus_keys:
        sink.launches += 1
        return
    entries = np.repeat(np.arange(len(log), dtype=np.int64), lens)
    positions = np.arange(len(key), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    sel = np.flatnonzero(np.isin(key, np.fromiter(sus_keys, np.int64)))
    # the threads simulator's order: block, barrier phase, thread (start order), program order
    cols = []
    for i in sel.tolist():
        e = int(entries[i])
        j = int(positions[i])
        arr, op, f, lanes, block_lin, tid, phase, wphase, site, seq, rank = log[e]
        cols.append((int(block_lin[j]), int(phase[j]), int(rank[j]), seq, i, e, j))
    cols.sort()
    state: dict = {}
    seen: dict = {}
    gx, gy, gz = grid

    def block_tuple(b):
        return (b // (gy * gz), (b // gz) % gy, b % gz)

    def unordered(u, me):
        (ub, ut, uphase, uwphase), (mb, mt, mphase, mwphase) = u, me
        if ub != mb:
            return True
        if ut == mt:
            return False
        if uphase != mphase:
            return False
        if ut >> 5 == mt >> 5 and uwphase != mwphase:
            return False
        return True

    for b, ph, rk, seq, i, e, j in cols:
        arr, op, f, lanes, block_lin, tid, phase, wphase, site, _seq, rank = log[e]
        t = int(tid[j])
        w = tools.where(site)
        me = ((b, t, ph, int(wphase[j])), _OPS[_CODE[op]], w)
        k = int(key[i])
        st = state.get(k)
        if st is None:
            st = state[k] = [None, {}, {}]
        last_write, reads, atomics = st
        if op == "w":
            others = [("write/write", last_write), *(("read/write", r) for r in reads.values()),
                      *(("atomic/plain", a) for a in atomics.values())]
        elif op == "r":
            others = [("read/write", last_write), *(("atomic/plain", a) for a in atomics.values())]
        else:
            others = [("atomic/plain", last_write), *(("atomic/plain", r) for r in reads.values())]
        for kind, other in others:
            if other is not None and unordered(other[0], me[0]):
                (u, uop, uwhere) = other
                first = Access(uop, block_tuple(u[0]), u[1], uwhere)
                second = Access(me[1], block_tuple(b), t, w)
                dkey = (kind, arr.name, tuple(sorted([(uop, uwhere), (me[1], w)])))
                race = seen.get(dkey)
                if race is None:
                    index = _index_of(arr, f[j], int(lanes[j]))
                    race = seen[dkey] = Race(kind, label, arr.name, arr.memory, index, first, second)
                    sink.races.append(race)
                else:
                    race.count += 1
        if op == "w":
            st[0], st[1], st[2] = me, {}, {}
        elif op == "r":
            reads[(b, t)] = me
        else:
            atomics[(b, t)] = me
    sink.launches += 1
