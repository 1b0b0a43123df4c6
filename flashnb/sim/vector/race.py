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
    keys, accs, blocks, phases, codes, entry_of, pos = [], [], [], [], [], [], []
    for e, (arr, op, f, lanes, block_lin, tid, phase, wphase, site, seq, rank) in enumerate(log):
        if arr.memory == "shared":
            sp = spaces.setdefault(id(arr.root), len(spaces) + 1)
            k = (np.int64(sp) << np.int64(48)) + f.astype(np.int64)
        else:
            k = np.int64(arr.addr0) + f.astype(np.int64) * arr.dtype.itemsize
        keys.append(k)
        accs.append(block_lin * T + tid)
        blocks.append(np.broadcast_to(block_lin, f.shape))
        phases.append(np.broadcast_to(phase, f.shape))
        codes.append(np.full(len(f), _CODE[op], np.int8))
        entry_of.append(np.full(len(f), e, np.int64))
        pos.append(np.arange(len(f)))
    key = np.concatenate(keys)
    acc = np.concatenate(accs)
    blk = np.concatenate(blocks).astype(np.int64)
    ph = np.concatenate(phases).astype(np.int64)
    code = np.concatenate(codes)

    def conflicting(order, new_group, who):
        """The first sorted position of each group whose accesses come from more than one ``who`` and
        conflict (a write, or an atomic beside a plain access)."""
        starts = np.flatnonzero(np.r_[True, new_group])
        w = who[order]
        cs = code[order]
        many = np.minimum.reduceat(w, starts) != np.maximum.reduceat(w, starts)
        anyw = np.maximum.reduceat((cs == 1).astype(np.int8), starts).astype(bool)
        anya = np.maximum.reduceat((cs == 2).astype(np.int8), starts).astype(bool)
        anyp = np.maximum.reduceat((cs != 2).astype(np.int8), starts).astype(bool)
        return starts[many & (anyw | (anya & anyp))]

    # An element can race only where two threads conflict on it unordered: in two blocks, or in one block
    # within one barrier phase (a superset of the races: the replay below applies the exact rules).
    order = np.argsort(key, kind="stable")
    ks = key[order]
    across = conflicting(order, ks[1:] != ks[:-1], blk)
    order2 = np.lexsort((ph, blk, key))
    k2, b2, p2 = key[order2], blk[order2], ph[order2]
    within = conflicting(order2, (k2[1:] != k2[:-1]) | (b2[1:] != b2[:-1]) | (p2[1:] != p2[:-1]), acc)
    if not len(across) and not len(within):
        sink.launches += 1
        return
    sus_keys = set(ks[across].tolist()) | set(k2[within].tolist())
    entries = np.concatenate(entry_of)
    positions = np.concatenate(pos)
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
