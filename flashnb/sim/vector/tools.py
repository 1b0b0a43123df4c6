"""What a vectorised launch shows the tools: traffic counts, memcheck, initcheck, racecheck, synccheck, profiler.

One :class:`LaunchTools` per launch (``cur``).  Every access the arrays make on the active lanes comes here
once, as one vector: the traffic counter adds the number of active lanes (flashnb.instruments.traffic's rule: one
element per thread that reads or writes it); memcheck's index checks run in :mod:`~flashnb.sim.vector.arrays` before
the access; initcheck keeps, per array, which elements are written (shared: per block; local: per lane; the
outputs a launcher poisoned: per element, across launches, shared with the threads simulator's tool); the
race checker logs ``(element, block, thread, barrier phase, warp phase, read/write/atomic, line)`` and analyses
the log when the launch ends, replaying the threads simulator's shadow-memory rules in the order it runs its
threads (block after block, barrier phase after phase, thread after thread) on the elements that more than
one thread touched with a write among them; the profiler groups accesses into warp requests as the threads
simulator does (the k-th access of each lane at one line to one array).

Findings are buffered: they reach the sanitizer's report, the race report or the profile only when the launch
commits -- a launch that falls back to the threads simulator leaves no trace here.
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from ..fallback import KernelFault, Undo, Unsupported

__all__ = ["LaunchTools", "cur", "where", "register_site"]

# --------------------------------------------------------------------------- source sites

#: Globals this module's launches rebind or fill (the course grader's integrity check leaves them out).
_RUNTIME_STATE = ("cur", "_SITES")
_SITES: list = []            # site id -> (filename, lineno, function name)
_SITE_IDS: dict = {}
_WHERE: dict = {}


def register_site(filename: str, lineno: int, func: str) -> int:
    key = (filename, lineno, func)
    sid = _SITE_IDS.get(key)
    if sid is None:
        sid = _SITE_IDS[key] = len(_SITES)
        _SITES.append(key)
    return sid


def where(site: int) -> str:
    """``file:line (function)`` of a site, as the threads simulator's tools name lines."""
    w = _WHERE.get(site)
    if w is None:
        if site is None or site < 0 or site >= len(_SITES):
            return "?"
        f, line, fn = _SITES[site]
        w = _WHERE[site] = f"{os.path.basename(f)}:{line} ({fn})"
    return w


def site_file_line(site: int):
    return _SITES[site][:2] if site is not None and 0 <= site < len(_SITES) else ("?", 0)


def lane_values(idx, lane):
    """One lane's index values (for messages)."""
    from .values import V

    if type(idx) is not tuple:
        idx = (idx,)
    return tuple(int(i.a[lane]) if type(i) is V else (i if isinstance(i, (slice, type(Ellipsis))) else int(i))
                 for i in idx)


def pre_at(pre, lane):
    """One lane's view chain (the indices that made a view), for messages."""
    return tuple(lane_values(g, lane) for g in pre)


class _Named:
    """What a message needs of an array: its name and the indices that made it (a local array has none)."""

    def __init__(self, name):
        self.name = name
        self.pre = ()


# --------------------------------------------------------------------------- per launch


class _Inactive:
    """The tools when no launch is running (helpers called outside a launch)."""

    active = count = memcheck = initcheck = race = profile = sync = False
    pending_atomics = False
    site = -1
    label = kernel = "?"

    def before_write(self, nd):
        pass


class LaunchTools:
    """The tools of one vectorised launch (see the module docstring)."""

    def __init__(self, label, kernel, counting, spec, undo: Undo):
        self.label = label
        self.kernel = kernel
        self.count = bool(counting)
        self.counts = defaultdict(int)
        self.itemsize = {}
        self.shared_names = {}
        self.undo = undo
        self.site = -1
        self.spec = spec
        tools_on = spec.get("tools", ()) if spec else ()
        self.memcheck = "memcheck" in tools_on
        self.initcheck = "initcheck" in tools_on
        self.race = "racecheck" in tools_on
        self.sync = "synccheck" in tools_on
        self.profile = bool(spec and spec.get("profile"))
        self.active = self.count or self.initcheck or self.race or self.profile
        self.findings = []                       # buffered (tool, kind, message, where, key_extra)
        self.pending_atomics = False
        self.atomics = {}                        # deferred atomics by array (id of its root), see flush_atomics
        self.geo = None
        self.race_log = []
        self.prof_log = defaultdict(list)
        self.prof_k = {}
        self.shared_written = {}                 # id(root) -> bool array over the chunk's shared elements
        self.poison = spec.get("poison") if spec else None    # the sanitizer session's poisoned outputs
        self.seq = 0
        self.grid = (1, 1, 1)
        self.tpb = 1
        self.apply_deferred = None               # warp.apply_deferred (set by the launch)
        self.request = None                      # a tensor-core twin's own profiler requests (lanes), see below
        self.tc = None                           # the tensor-core twins' per-chunk state (.tensorcore)

    # -- traffic
    def bump(self, arr, op, n):
        if arr.memory == "shared":
            self.counts[("s" + op, arr.name)] += n
        elif arr.memory == "global":
            self.counts[(op, arr.name)] += n

    def before_write(self, nd):
        self.undo.before_write(nd)

    # -- every element access of global and shared arrays (after the index checks)
    def access(self, arr, op, flat, m, site, idx):
        from .values import m_count

        if self.count:
            n = m_count(m)
            if arr.memory == "shared":
                self.counts[("s" + op, arr.name)] += n
            else:
                self.counts[(op, arr.name)] += n
        if self.initcheck:
            if arr.memory == "shared":
                self._shared_init(arr, op, flat, m, site, idx)
            elif self.poison is not None:
                self._global_init(arr, op, flat, m, site, idx)
        if self.race:
            self._log_race(arr, op, flat, m, site)
        if self.profile:
            self._log_profile(arr, op, flat, m, site)

    # -- memcheck
    def memcheck_error(self, arr, message, where_, lane):
        from ..sanitizer import MemcheckError

        self.findings.append(("memcheck", "out of bounds", message, where_, (arr.name,)))
        raise KernelFault(MemcheckError(message), lane)

    # -- initcheck
    def _uninit(self, memory, arr, lanes, idx, site, why, pre=None):
        from ..sanitizer import _fmt_ref
        from .values import now

        w = where(site)
        for lane in lanes:
            lane = int(lane)
            ti, bi = now.lane_name(lane)
            ref = _fmt_ref(arr.name, pre_at(arr.pre, lane) if pre is None else pre, lane_values(idx, lane))
            self.findings.append(("initcheck", f"uninitialized {memory} read",
                                  f"read of uninitialized {memory} memory {ref} by thread {list(ti)} in block "
                                  f"{list(bi)} of launch {self.label!r} ({self.kernel}) at {w}: {why}",
                                  w, (arr.name,)))

    def _first_per_element(self, keys, lanes):
        """The first lane (start order) of each distinct key, in start order."""
        from .values import now

        if now.rank is not None:
            order = np.argsort(now.rank[lanes], kind="stable")
            lanes, keys = lanes[order], keys[order]
        _, first = np.unique(keys, return_index=True)
        first.sort()
        return lanes[first], keys[first]

    def _shared_init(self, arr, op, flat, m, site, idx):
        from .values import lanes_in_order

        w = self.shared_written.get(id(arr.root))
        if w is None:
            w = self.shared_written[id(arr.root)] = np.zeros(arr.base.size, bool)
        lanes = lanes_in_order(m)
        f = flat[lanes] if type(flat) is np.ndarray else np.full(len(lanes), flat)
        if op == "w":
            w[f] = True
            return
        bad = ~w[f]
        if bad.any():
            bl, bk = self._first_per_element(f[bad], lanes[bad])
            self._uninit("shared", arr, bl, idx, site, "no thread of this block wrote it in this launch")
            w[bk] = True

    def _global_init(self, arr, op, flat, m, site, idx):
        from .values import lanes_in_order

        p = self.poison.lookup(arr)
        if p is None:
            return
        bitmap, offset = p
        lanes = lanes_in_order(m)
        f = (flat[lanes] if type(flat) is np.ndarray else np.full(len(lanes), flat)) + offset
        if op == "w":
            bitmap[f] = True
            return
        bad = ~bitmap[f]
        if bad.any():
            bl, bk = self._first_per_element(f[bad], lanes[bad])
            self._uninit("global", arr, bl, idx, site,
                         "an output the launcher poisoned with NaN that no launch has written")
            bitmap[bk] = True

    def local_read(self, loc, flat, m, site, idx):
        from .values import lanes_in_order, now

        if loc.written is None:
            loc.written = [None] * loc.size
        lanes = lanes_in_order(m)
        if type(flat) is np.ndarray:
            f = flat[lanes]
        else:
            f = np.full(len(lanes), flat)
        bad = np.ones(len(lanes), bool)
        for e in np.unique(f).tolist():
            wr = loc.written[e]
            if wr is not None:
                sel = f == e
                bad[sel] = ~wr[lanes[sel]]
        if bad.any():
            bl = lanes[bad]
            self._uninit("local", _Named(loc.name), bl, idx, site, "this thread never wrote it")
            for e in np.unique(f[bad]).tolist():
                wr = loc.written[e]
                if wr is None:
                    wr = loc.written[e] = np.zeros(now.L, bool)
                wr[bl[f[bad] == e]] = True

    def local_write(self, loc, flat, m):
        from .values import now

        if loc.written is None:
            loc.written = [None] * loc.size
        if type(flat) is np.ndarray:
            for e in np.unique(flat if m is None else flat[m]).tolist():
                wr = loc.written[e]
                if wr is None:
                    wr = loc.written[e] = np.zeros(now.L, bool)
                hit = flat == e
                wr |= hit if m is None else hit & m
        else:
            wr = loc.written[flat]
            if wr is None:
                wr = loc.written[flat] = np.zeros(now.L, bool)
            if m is None:
                wr[:] = True
            else:
                wr |= m

    # -- synccheck (told by the barrier)
    def barrier_after_exit(self, site, blocks):
        """``blocks``: [(block index tuple, exited thread ids)] of the blocks whose barrier completed with some
        threads already returned."""
        from ..sanitizer import _ranges

        w = where(site)
        for block, exited in blocks:
            self.findings.append(("synccheck", "barrier after exit",
                                  f"syncthreads() at {w} completed in block {list(block)} of launch "
                                  f"{self.label!r} ({self.kernel}) while threads {_ranges(exited)} had already "
                                  "returned -- a barrier inside a branch that not every thread of the block takes "
                                  "(e.g. after an early return) is undefined behaviour in CUDA", w, ()))

    def warp_after_exit(self, site, name, mask, block, warp, gone):
        """A warp operation whose mask names lanes ``gone`` of ``warp`` that had already returned."""
        from ..fastbarrier import exited_lanes_message

        w = where(site)
        self.findings.append(("synccheck", "warp operation after exit",
                              f"cuda.{name} at {w} in block {list(block)} of launch {self.label!r} ({self.kernel}): "
                              + exited_lanes_message(name, mask, warp, gone), w, ()))

    # -- racecheck
    def _log_race(self, arr, op, flat, m, site):
        from .values import now

        g = self.geo
        # lane order within an entry does not matter: the analysis orders accesses by the threads' start rank
        lanes = np.arange(now.L) if m is None else np.flatnonzero(m)
        f = flat[lanes] if type(flat) is np.ndarray else np.full(len(lanes), flat)
        self.seq += 1
        self.race_log.append((arr, op, f, lanes, g.block_lin[lanes], g.tid[lanes], g.phase[g.blk[lanes]],
                              g.wphase[lanes], site, self.seq, g.rank_of[lanes]))

    # -- profiler
    def _log_profile(self, arr, op, flat, m, site):
        from .values import lanes_in_order

        g = self.geo
        lanes = lanes_in_order(m)
        f = flat[lanes] if type(flat) is np.ndarray else np.full(len(lanes), flat)
        key = (site, op, arr.name, arr.memory)
        if self.request is not None:
            # an instruction twin groups its accesses as the hardware serves them (ldmatrix: one request per 8x8
            # matrix; cp.async: the warp's copies), apart from the line's k-th accesses, which it does not count
            k = self.request[lanes]
        else:
            kc = self.prof_k.get(key)
            if kc is None or kc.shape[0] != g.L:
                kc = self.prof_k[key] = np.zeros(g.L, np.int64)
            k = kc[lanes].copy()
            kc[lanes] += 1
        if arr.memory == "shared":
            offs = (f - g.blk[lanes] * arr.per_block) * arr.dtype.itemsize
        else:
            offs = f * arr.dtype.itemsize + arr.root_off
        self.prof_log[key].append((g.block_lin[lanes], g.tid[lanes] >> 5, k, offs, arr.dtype.itemsize))

    def new_chunk(self, geo):
        """A new chunk of blocks starts: per-lane counters restart (its lanes are other threads)."""
        self.geo = geo
        self.prof_k = {}
        self.shared_written = {}
        self.tc = None

    # -- atomics deferred to the threads simulator's order
    def defer_atomic(self, entry):
        """Keep a float atomic (``entry[0]``: its array's root) to apply later, in the threads simulator's order."""
        self.atomics.setdefault(id(entry[0]), []).append(entry)
        self.pending_atomics = True

    def flush_atomics(self, arr=None):
        """Apply the deferred atomics on ``arr`` (every array's when None) before it is read or written plainly.
        They are kept per array, so a read of another array costs one dictionary look-up."""
        if arr is None:
            todo = [e for group in self.atomics.values() for e in group]
            self.atomics = {}
        else:
            todo = self.atomics.pop(id(getattr(arr, "root", None)), None)
        self.pending_atomics = bool(self.atomics)
        if todo:
            self.apply_deferred(todo)

    # -- the end
    def totals(self) -> dict:
        return {k: v for k, v in self.counts.items() if v}

    def commit(self, session_add=None):
        """Hand the buffered findings to the tools' reports (in the order they were found)."""
        spec = self.spec or {}
        add = spec.get("add")
        if add is not None:
            for tool, kind, message, w, extra in self.findings:
                add(tool, kind, self.label, self.kernel, message, w, extra)
        self.findings = []

cur = _Inactive()


def begin(t: LaunchTools):
    global cur
    cur = t


def end():
    global cur
    cur = _Inactive()


__all__ += ["begin", "end", "Unsupported"]
