"""Data races found on the simulator, in the spirit of compute-sanitizer's ``racecheck``.

A missing ``cuda.syncthreads()`` is the bug the simulator hides best: it runs the threads of a block in
turn, so a thread usually finds what another wrote even where a GPU would not.  Inside
``with flashnb.sim.racecheck.check() as report:`` every element access of every launch (global arrays by
parameter name, shared arrays by variable name) is remembered per element, with the thread that made it
and how many barriers that thread had passed, and two accesses to one element are reported when

* they come from different threads, at least one writes (or one is an atomic and the other is not), and
* nothing orders them: the threads are in different blocks (no barrier spans blocks within a launch), or
  in the same block with no ``syncthreads()`` between them -- both had passed the same number of barriers
  -- and, for two lanes of one warp, no ``syncwarp()`` either.

Atomics never race with atomics.  Shuffles and votes exchange registers, not memory: they order nothing.
Each race is reported once per (kind, array, pair of source lines), with the first example and a count.
``check()`` raises :class:`RaceError` at the end of the block when it found any (``raise_on_race=False``
only collects them).  Slower than counting (every access is looked up): keep sizes small.

Needs flashnb's simulator runtime (:mod:`flashnb.sim` installed; it keeps the barrier counts).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import kernel_line, traffic

__all__ = ["check", "Race", "RaceReport", "RaceError"]

class RaceError(AssertionError):
    """Raised by :func:`check` when a launch inside it had a data race."""


@dataclass(frozen=True)
class Access:
    """One side of a race: who (block, thread), where (file:line) and what (read / write / atomic)."""

    op: str
    block: tuple
    thread: int
    where: str


@dataclass
class Race:
    """Two unordered accesses to one element, at least one a write (or an atomic beside a plain access)."""

    kind: str            # "read/write", "write/write" or "atomic/plain"
    launch: str
    array: str
    memory: str          # "global" or "shared"
    index: tuple         # the element, as the second access indexed it
    first: Access
    second: Access
    count: int = 1       # how many element pairs had this (kind, array, lines)

    def __str__(self):
        return self.describe()

    def describe(self, count: bool = True) -> str:
        """One sentence: the element, the launch, the two accesses (and, with ``count``, how often)."""
        times = f" ({self.count}x)" if count else ""
        return (f"{self.kind} race on {self.memory} {self.array}{list(self.index)} in launch {self.launch!r}"
                f"{times}: {self.first.op} by block {self.first.block} thread {self.first.thread} at "
                f"{self.first.where}, {self.second.op} by block {self.second.block} thread "
                f"{self.second.thread} at {self.second.where}")


@dataclass
class RaceReport:
    """What :func:`check` found: ``races`` (deduplicated) and the number of launches it watched."""

    races: list = field(default_factory=list)
    launches: int = 0

    def __bool__(self):
        return bool(self.races)

    def __str__(self):
        if not self.races:
            return f"no data race in {self.launches} launch(es)"
        return "\n".join([f"{len(self.races)} data race(s) in {self.launches} launch(es):"]
                         + [f"  {r}" for r in self.races])


# the proxy's, this module's and the adapter's (numba's atomics, wrapped to convert their value) frames are not
# the kernel's
_SKIP = {traffic.__file__, __file__, str(Path(__file__).with_name("_numba_adapter.py"))}


#: Per-thread attribution set by an instruction's simulator twin (:mod:`flashnb.sim.tensorcore`) while it makes
#: accesses on a kernel's behalf: ``where`` names the kernel line (a ``cp.async`` lands at ``wait_group`` but is the
#: issuing line's), ``request`` groups the accesses into one hardware request for the profiler.
_site = threading.local()


def _where() -> str:
    """file:line (function) of the kernel code making the access."""
    where = getattr(_site, "where", None)
    return where if where is not None else kernel_line(_SKIP, 3)


def _elements(a: np.ndarray, idx):
    """(address, index tuple) of each element ``a[idx]`` selects (one for a scalar index)."""
    base = a.__array_interface__["data"][0]
    strides = a.strides
    if type(idx) is not tuple:
        idx = (idx,)
    if len(idx) == a.ndim and all(isinstance(i, (int, np.integer)) for i in idx):
        full = tuple(int(i) + (a.shape[k] if i < 0 else 0) for k, i in enumerate(idx))
        return [(base + sum(i * s for i, s in zip(full, strides)), full)]
    sub = a[idx]   # a slice or fewer indices: every element it selects
    sub_base = sub.__array_interface__["data"][0]
    return [(sub_base + sum(i * s for i, s in zip(j, sub.strides)), j) for j in np.ndindex(sub.shape)]


_OPS = {"r": "read", "w": "write", "a": "atomic"}


class _Tracker:
    """Per-launch shadow memory: element key -> [last write, {thread: read}, {thread: atomic}]."""

    def __init__(self, label: str, kernel: str, report: RaceReport):
        self.label = label
        self.kernel = kernel
        self.report = report
        self.state: dict = {}
        self.lock = threading.Lock()
        self.seen: dict = {}

    def index(self, op, proxy, idx):   # bounds are memcheck's business
        pass

    def access(self, op, proxy, idx):
        t = threading.current_thread()
        block = tuple(t.blockIdx)
        tid = t.thread_id
        me = ((block, tid, t.phase, t.warp_phase), _OPS[op], _where())
        shared = proxy._kr[0] == "sr"
        name = proxy._kr[1]
        for addr, index in _elements(proxy._a, idx):
            key = (block, addr) if shared else addr   # shared memory is per block: the same address in
            with self.lock:                            # another block is another block's array
                st = self.state.get(key)
                if st is None:
                    st = self.state[key] = [None, {}, {}]
                last_write, reads, atomics = st
                if op == "w":
                    others = [("write/write", last_write), *(("read/write", r) for r in reads.values()),
                              *(("atomic/plain", a) for a in atomics.values())]
                elif op == "r":
                    others = [("read/write", last_write), *(("atomic/plain", a) for a in atomics.values())]
                else:
                    others = [("atomic/plain", last_write), *(("atomic/plain", r) for r in reads.values())]
                for kind, other in others:
                    if other is not None and self._unordered(other[0], me[0]):
                        self._race(kind, name, "shared" if shared else "global", index, other, me)
                if op == "w":
                    st[0], st[1], st[2] = me, {}, {}
                elif op == "r":
                    reads[(block, tid)] = me
                else:
                    atomics[(block, tid)] = me

    @staticmethod
    def _unordered(u, me) -> bool:
        (ub, ut, uphase, uwphase), (mb, mt, mphase, mwphase) = u, me
        if ub != mb:
            return True                        # different blocks: nothing orders them within a launch
        if ut == mt:
            return False                       # program order
        if uphase != mphase:
            return False                       # a syncthreads() between them
        if ut >> 5 == mt >> 5 and uwphase != mwphase:
            return False                       # lanes of one warp with a syncwarp() between them
        return True

    def _race(self, kind, name, memory, index, other, mine):
        (u, uop, uwhere), (m, op, where) = other, mine
        first, second = Access(uop, u[0], u[1], uwhere), Access(op, m[0], m[1], where)
        key = (kind, name, tuple(sorted([(uop, uwhere), (op, where)])))   # either order of arrival
        race = self.seen.get(key)
        if race is None:
            race = self.seen[key] = Race(kind, self.label, name, memory, index, first, second)
            self.report.races.append(race)
        else:
            race.count += 1

    def finish(self):
        self.report.launches += 1


class _Observers:
    """``traffic.observer_factory`` of a check block: a tracker per threads-simulator launch, or the vectorised
    simulator's settings (its launches log their accesses and :mod:`flashnb.sim.vector.race` replays these rules)."""

    def __init__(self, report):
        self.report = report

    def __call__(self, label, kernel):
        return _Tracker(label, kernel, self.report)

    def vector_spec(self, label, kernel):
        return dict(tools=("racecheck",), race_sink=self.report)


@contextlib.contextmanager
def check(raise_on_race: bool = True):
    """Watch every launch in the ``with`` block for data races; yields a :class:`RaceReport`."""
    from . import is_installed

    if not is_installed():
        raise RuntimeError("racecheck needs flashnb's simulator runtime (flashnb.sim.install())")
    if traffic.observer_factory is not None:
        raise RuntimeError("racecheck.check() is already active")
    report = RaceReport()
    traffic.observer_factory = _Observers(report)
    try:
        with traffic.count():
            yield report
    finally:
        traffic.observer_factory = None
    if raise_on_race and report.races:
        raise RaceError(str(report))
