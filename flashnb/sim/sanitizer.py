"""compute-sanitizer's four tools, on the simulator: memcheck, racecheck, initcheck, synccheck.

On a GPU, ``compute-sanitizer --tool memcheck python my.py`` finds the out-of-bounds access that silently
corrupts someone else's memory.  Learners here have no GPU, and the simulator hides exactly those bugs: it
runs a block's threads in turn (a missing barrier usually works), its shared arrays start as whatever the
last block left there (an uninitialised read usually sees a plausible value), and NumPy wraps a negative index
(``A[-1]`` reads the last element; on a GPU it reads the element *before* the array).  Inside ::

    with flashnb.sim.sanitize() as report:          # all four tools; tools=("memcheck",) for one
        flashnb.attention_forward(q, k, v, impl="fa2")
    print(report)                                   # "no errors in 3 launch(es) (memcheck, racecheck, ...)"

every access of every launch is checked, and the block raises :class:`SanitizerError` at its end when any
tool found something (``raise_on_error=False`` only collects).  The tools:

* **memcheck** -- every index into a global, shared or local array, element or view, is checked against
  the array's shape *before* it is used: a negative index or one past the end is an error naming the kernel,
  the array, the index, the thread and block, and the source line.  As on a GPU, the launch is aborted there
  (the ``with`` block ends with the error).  Stricter than the GPU tool in one way: ``A[i, d]`` on a
  ``(N, d)`` array is reported even though on a GPU it lands inside the allocation (on row ``i + 1``).
* **racecheck** -- :mod:`flashnb.sim.racecheck`: two accesses to one element by different threads, one a
  write, that no barrier orders.
* **initcheck** -- a read of a shared-memory element that no thread of *this block* has written in this
  launch (the simulator's shared arrays are reused from block to block, so such a read sees a stale value),
  of a local-array element this thread has not written, or of an element of a global output that the
  launcher poisoned with NaN (:func:`flashnb.common.empty`) and no launch inside the block has written.
* **synccheck** -- a ``cuda.syncthreads()`` that the threads of one block reach from different call sites,
  or that completes while some threads of the block have already returned (both undefined behaviour in CUDA:
  "allowed in conditional code only if the conditional evaluates identically across the entire thread
  block"), and a warp operation whose mask names lanes that had returned (``shfl_*_sync`` after an early
  return).  A barrier that can never complete stays a :class:`~flashnb.sim.SimulatorDeadlock`.

Each finding is reported once per (tool, kind, array, source lines) with a count, like compute-sanitizer's
error summary.  Slower than counting (every access is checked): keep sizes small.  Needs flashnb's simulator
runtime (:mod:`flashnb.sim` installed).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np

from .. import common
from . import fastbarrier, racecheck, traffic
from .racecheck import _elements, _where

__all__ = ["sanitize", "TOOLS", "Finding", "SanitizerReport", "SanitizerError", "MemcheckError"]

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")

racecheck._SKIP.add(__file__)   # this module's frames are not the kernel's


class SanitizerError(AssertionError):
    """Raised at the end of :func:`sanitize` when a tool found an error (the message is the report)."""


class MemcheckError(SanitizerError):
    """Raised inside the offending thread by memcheck: it aborts the launch, as the access would on a GPU."""


@dataclass
class Finding:
    """One kind of error at one place: the first example in ``message`` and how often it happened."""

    tool: str        # "memcheck", "racecheck", "initcheck" or "synccheck"
    kind: str        # e.g. "out of bounds", "read/write race", "uninitialized shared read", "divergent barrier"
    launch: str
    kernel: str
    message: str
    where: str       # source line(s)
    count: int = 1

    def __str__(self):
        return f"[{self.tool}] {self.message}" + (f" ({self.count}x)" if self.count > 1 else "")


@dataclass
class SanitizerReport:
    """What :func:`sanitize` found: ``findings`` (deduplicated), the launches watched, and their traffic."""

    tools: tuple
    findings: list = field(default_factory=list)
    launches: int = 0
    traffic: object = None

    def __bool__(self):
        return bool(self.findings)

    def by_tool(self, tool: str) -> list:
        """The findings of one tool."""
        return [f for f in self.findings if f.tool == tool]

    def __str__(self):
        tools = ", ".join(self.tools)
        if not self.findings:
            return f"no errors in {self.launches} launch(es) ({tools})"
        total = sum(f.count for f in self.findings)
        return "\n".join([f"{total} error(s) in {len(self.findings)} place(s), {self.launches} launch(es) "
                          f"({tools}):"] + [f"  {f}" for f in self.findings])


def _thread():
    t = threading.current_thread()
    return tuple(t.blockIdx), tuple(t.threadIdx), t.thread_id


def _fmt_one(i) -> str:
    if isinstance(i, (int, np.integer)):
        return str(int(i))
    if isinstance(i, slice):
        parts = ["" if x is None else str(int(x)) for x in (i.start, i.stop)]
        return ":".join(parts) + ("" if i.step is None else f":{int(i.step)}")
    return "..." if i is Ellipsis else repr(i)


def _fmt_index(idx) -> str:
    return ", ".join(_fmt_one(i) for i in idx)


def _only_ints(groups) -> bool:
    return all(isinstance(i, (int, np.integer)) for g in groups for i in g)


def _fmt_ref(name: str, pre: tuple, idx: tuple) -> str:
    """``A[z, i, j]`` for an element reached through integer views (``A[z]`` then ``[i, j]``); the indexing
    chain as written, ``t[16:][31]``, when a view came from a slice (its indices are not the base array's)."""
    if _only_ints(pre):
        return f"{name}[{_fmt_index(tuple(i for g in pre for i in g) + tuple(idx))}]"
    return name + "".join(f"[{_fmt_index(g)}]" for g in (*pre, tuple(idx)))


_OP_NAMES = {"r": "read", "w": "write", "a": "atomic"}


class _Session:
    """The state of one ``sanitize()`` block: findings, poisoned global outputs and which of their elements
    have been written."""

    def __init__(self, tools):
        self.tools = frozenset(tools)
        self.report = SanitizerReport(tuple(t for t in TOOLS if t in self.tools))
        self.races = racecheck.RaceReport()
        self.seen: dict = {}
        self.lock = threading.Lock()
        self.poisoned: list = []          # _Poisoned outputs: address range, the array (kept alive), written flags
        self.launch = None                # the _LaunchObserver in progress

    # -- findings
    def add(self, tool, kind, launch, message, where, key_extra=()):
        key = (tool, kind, launch.kernel, where, *key_extra)
        with self.lock:
            f = self.seen.get(key)
            if f is None:
                f = self.seen[key] = Finding(tool, kind, launch.label, launch.kernel, message, where)
                self.report.findings.append(f)
            else:
                f.count += 1

    # -- hooks
    def observer(self, label, kernel):
        self.report.launches += 1       # counted when it starts: a launch memcheck aborts counts too
        self.launch = _LaunchObserver(self, label, kernel)
        return self.launch

    def poisoned_output(self, dev):
        a = getattr(dev, "_ary", None)
        if isinstance(a, np.ndarray) and a.size:
            start = a.__array_interface__["data"][0]
            self.poisoned.append(_Poisoned(start, start + a.nbytes, a, np.zeros(a.size, bool)))

    def poisoned_at(self, addr):
        """The poisoned output holding address ``addr`` (None if none does)."""
        for p in self.poisoned:
            if p.start <= addr < p.end:
                return p
        return None

    def lookup(self, arr):
        """The vectorised simulator's view of a global array: ``(written flags, element offset)`` of the poisoned
        output it lies in (None if it is not one)."""
        addr = getattr(arr, "addr0", 0)
        p = self.poisoned_at(addr)
        if p is None or p.array.dtype.itemsize != arr.dtype.itemsize:
            return None
        return p.written, (addr - p.start) // p.array.dtype.itemsize

    def barrier(self, block, sites, exited):
        """synccheck, told by the fast barrier each time a block barrier is released."""
        launch = self.launch
        if launch is None:
            return
        by_site: dict = {}
        for tid, site in sites.items():
            by_site.setdefault(site, []).append(tid)
        if len(by_site) > 1:
            parts = [f"{site} (threads {_ranges(tids)})" for site, tids in sorted(by_site.items())]
            self.add("synccheck", "divergent barrier", launch,
                     f"syncthreads() reached from different call sites by the threads of block {list(block)} in "
                     f"launch {launch.label!r} ({launch.kernel}): " + ", ".join(parts) + " -- every thread of a "
                     "block must reach the same barrier (undefined behaviour in CUDA)",
                     " / ".join(sorted(by_site)))
        if exited:
            site = sorted(by_site)[0]
            self.add("synccheck", "barrier after exit", launch,
                     f"syncthreads() at {site} completed in block {list(block)} of launch {launch.label!r} "
                     f"({launch.kernel}) while threads {_ranges(exited)} had already returned -- a barrier inside "
                     "a branch that not every thread of the block takes (e.g. after an early return) is undefined "
                     "behaviour in CUDA",
                     site)


    def warp_after_exit(self, kind, mask, block, warp, lanes, site):
        """synccheck, told by a warp round that completed while lanes its mask names had returned."""
        launch = self.launch
        if launch is None:
            return
        self.add("synccheck", "warp operation after exit", launch,
                 f"cuda.{kind} at {site} in block {list(block)} of launch {launch.label!r} ({launch.kernel}): "
                 + fastbarrier.exited_lanes_message(kind, mask, warp, lanes), site or "?")


@dataclass
class _Poisoned:
    """An output the launcher poisoned with NaN: its addresses, the array, which elements some launch wrote."""

    start: int
    end: int
    array: np.ndarray
    written: np.ndarray


class _Launch:
    """What a finding names of its launch."""

    def __init__(self, label, kernel):
        self.label = label
        self.kernel = kernel


class _Observers:
    """``traffic.observer_factory`` of a sanitize block: a threads-simulator observer per launch, or the
    vectorised simulator's tool settings (:meth:`vector_spec`)."""

    def __init__(self, session):
        self.s = session

    def __call__(self, label, kernel):
        return self.s.observer(label, kernel)

    def vector_spec(self, label, kernel):
        s = self.s

        def add(tool, kind, label, kernel, message, where, extra):
            s.add(tool, kind, _Launch(label, kernel), message, where, extra)

        def launched():
            s.report.launches += 1

        return dict(tools=s.tools, add=add, race_sink=s.races, poison=s, on_launch=launched)


def _ranges(ids) -> str:
    ids = sorted(ids)
    out, start, prev = [], None, None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}..{prev}")
            start = prev = i
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}..{prev}")
    return ", ".join(out)


class _LaunchObserver:
    """What one launch shows the tools (the traffic counter's observer protocol)."""

    def __init__(self, session: _Session, label: str, kernel: str):
        self.s = session
        self.label = label
        self.kernel = kernel
        tools = session.tools
        self.memcheck = "memcheck" in tools
        self.initcheck = "initcheck" in tools
        self.locals = self.memcheck or self.initcheck
        self.race = racecheck._Tracker(label, kernel, session.races) if "racecheck" in tools else None
        self.shared_written: set = set()   # (block, address)
        self.local_written: set = set()    # (block, thread, address)

    # -- memcheck: before the array is indexed
    def index(self, op, proxy, idx):
        if not self.memcheck:
            return
        shape = proxy._a.shape
        full = idx if type(idx) is tuple else (idx,)
        bad = None
        if len(full) > len(shape):
            bad = f"{len(full)} indices into a {len(shape)}-dimensional array"
        else:
            for k, i in enumerate(full):
                if isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) and \
                        not 0 <= i < shape[k]:
                    if _only_ints(proxy._pre):   # dimension of the array as declared
                        bad = (f"index {int(i)} is outside 0..{shape[k] - 1} of dimension "
                               f"{sum(len(g) for g in proxy._pre) + k}")
                    else:                         # a slice made the view: its own dimension and extent
                        view = proxy._kr[1] + "".join(f"[{_fmt_index(g)}]" for g in proxy._pre)
                        bad = (f"index {int(i)} is outside 0..{shape[k] - 1} of dimension {k} of the view "
                               f"{view} (shape {tuple(shape)})")
                    break
        if bad is None:
            return
        memory = traffic.memory_of(proxy)
        name = proxy._kr[1]
        block, tidx, _ = _thread()
        where = _where()
        element = len(full) == len(shape) and all(isinstance(i, (int, np.integer)) for i in full)
        what = f"{_OP_NAMES[op]} of" if element else "view of"
        message = (f"invalid {memory} {what} {_fmt_ref(name, proxy._pre, full)} by thread {list(tidx)} in "
                   f"block {list(block)} of launch {self.label!r} ({self.kernel}) at {where}: {bad}"
                   + (" (NumPy would wrap it silently; on a GPU it touches memory outside the array)"
                      if "index -" in bad else ""))
        self.s.add("memcheck", "out of bounds", self, message, where, (name,))
        raise MemcheckError(message)

    # -- after an element access
    def access(self, op, proxy, idx):
        kind = proxy._kr[0]
        if self.race is not None and kind != "lr":
            self.race.access(op, proxy, idx)
        if not self.initcheck:
            return
        if kind == "sr":
            block = tuple(threading.current_thread().blockIdx)
            for addr, index in _elements(proxy._a, idx):
                key = (block, addr)
                if op == "w":
                    self.shared_written.add(key)
                elif key not in self.shared_written:
                    self._uninit("shared", proxy, index, "no thread of this block wrote it in this launch")
                    self.shared_written.add(key)    # report each element once
        elif kind == "lr":
            block, _, tid = _thread()
            for addr, index in _elements(proxy._a, idx):
                key = (block, tid, addr)
                if op == "w":
                    self.local_written.add(key)
                elif key not in self.local_written:
                    self._uninit("local", proxy, index, "this thread never wrote it")
                    self.local_written.add(key)
        elif self.s.poisoned:
            s = self.s
            for addr, index in _elements(proxy._a, idx):
                p = s.poisoned_at(addr)
                if p is None:
                    continue
                e = (addr - p.start) // p.array.dtype.itemsize
                if op == "w":
                    p.written[e] = True
                elif not p.written[e]:
                    self._uninit("global", proxy, index,
                                 "an output the launcher poisoned with NaN that no launch has written")
                    p.written[e] = True

    def new_local(self, proxy):
        """A fresh ``cuda.local.array``: its memory starts uninitialised (forget an earlier array's writes)."""
        if self.initcheck:
            block, _, tid = _thread()
            for addr, _ in _elements(proxy._a, (slice(None),) * proxy._a.ndim):
                self.local_written.discard((block, tid, addr))

    def _uninit(self, memory, proxy, index, why):
        block, tidx, _ = _thread()
        where = _where()
        name = proxy._kr[1]
        self.s.add("initcheck", f"uninitialized {memory} read", self,
                   f"read of uninitialized {memory} memory {_fmt_ref(name, proxy._pre, index)} by thread "
                   f"{list(tidx)} in block {list(block)} of launch {self.label!r} ({self.kernel}) at {where}: {why}",
                   where, (name,))

    def finish(self):
        if self.race is not None:
            self.race.finish()


@contextlib.contextmanager
def sanitize(tools=TOOLS, raise_on_error: bool = True):
    """Check every launch in the ``with`` block with compute-sanitizer-like ``tools``; yields a
    :class:`SanitizerReport`.

    ``tools`` is any of ``"memcheck"``, ``"racecheck"``, ``"initcheck"``, ``"synccheck"`` (a name or a
    sequence; default all four).  At the end of the block, :class:`SanitizerError` is raised when anything
    was found (``raise_on_error=False``: only the report is filled).  A memcheck error aborts its launch and
    so ends the block.
    """
    from . import is_installed

    if isinstance(tools, str):
        tools = (tools,)
    tools = tuple(tools)
    unknown = [t for t in tools if t not in TOOLS]
    if unknown or not tools:
        raise ValueError(f"tools must be a non-empty selection of {TOOLS}, got {tools!r}")
    if not is_installed():
        raise RuntimeError("the sanitizer needs flashnb's simulator runtime (flashnb.sim.install(); simulator mode)")
    if traffic.observer_factory is not None:
        raise RuntimeError("a sanitizer, race checker or profiler is already active")
    session = _Session(tools)
    report = session.report
    traffic.observer_factory = _Observers(session)
    if "synccheck" in tools:
        fastbarrier.sync_observer = session
    if "initcheck" in tools:
        common.poison_hooks.append(session.poisoned_output)
    aborted = None
    try:
        with traffic.count() as t:
            report.traffic = t
            try:
                yield report
            except MemcheckError as e:   # the launch memcheck aborted: its finding is in the report
                aborted = e
    finally:
        traffic.observer_factory = None
        fastbarrier.sync_observer = None
        if session.poisoned_output in common.poison_hooks:
            common.poison_hooks.remove(session.poisoned_output)
        session.launch = None
    for race in session.races.races:
        report.findings.append(Finding("racecheck", race.kind + " race", race.launch, race.launch,
                                       race.describe(count=False),
                                       f"{race.first.where} / {race.second.where}", race.count))
    if raise_on_error and report.findings:
        raise SanitizerError(str(report)) from aborted


@contextlib.contextmanager
def set_aside():
    """Inside the block the active :func:`sanitize` session (if any) watches nothing, so another checker may start
    there (a script's own ``racecheck.check()`` run by ``flashnb sanitize``); it resumes after the block.  Its
    initcheck then counts an output it tracks as written wherever the block's launches replaced the NaN poison
    (all bytes 0xFF), so a later read of what they wrote is not reported as uninitialised."""
    factory, sync = traffic.observer_factory, fastbarrier.sync_observer
    session = factory.s if isinstance(factory, _Observers) else None
    if session is None:
        yield
        return
    hooked = session.poisoned_output in common.poison_hooks
    traffic.observer_factory = fastbarrier.sync_observer = None
    if hooked:
        common.poison_hooks.remove(session.poisoned_output)
    try:
        yield
    finally:
        traffic.observer_factory, fastbarrier.sync_observer = factory, sync
        if hooked:
            common.poison_hooks.append(session.poisoned_output)
        for p in session.poisoned:
            raw = p.array.reshape(-1).view(np.uint8).reshape(p.array.size, p.array.dtype.itemsize)
            p.written |= (raw != 0xFF).any(axis=1)
