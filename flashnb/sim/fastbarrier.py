"""A thread-block manager for the Numba CUDA simulator that waits instead of spinning.

The stock simulator (numba-cuda 0.30.4, ``numba.cuda.simulator.kernel.BlockManager``) runs each CUDA thread
as a Python thread and finds out that every thread has reached ``cuda.syncthreads()`` by *polling* them in a
loop that never sleeps: the polling thread holds the GIL most of the time, so one barrier costs 13-38 ms
per block.  :class:`FastBlockManager` keeps the same rules and replaces the polling with counting under
one lock; a waiting thread blocks on its own pre-locked ``threading.Lock`` (its gate), which the thread
that completes the barrier opens:

* a barrier is released when every *live* thread of the block is waiting at it (threads that have returned
  no longer count, exactly as in the stock simulator);
* when a thread raises, every other thread is aborted (``RuntimeError`` at its current or next barrier) and
  the launch re-raises the first exception, prefixed with ``tid=[..] ctaid=[..]``, as the stock one does;
* ``syncthreads_count/and/or`` are the stock implementations (they are built on ``syncthreads``).

The same lock also serves the warp intrinsics of :mod:`flashnb.sim.warp` (one *round* per (warp, mask)
in progress), which lets the manager detect a block that can never make progress -- every live thread is
waiting, at a barrier or at a warp intrinsic, and none of those waits can complete (on a GPU: a hang) --
and raise a ``SimulatorDeadlock`` describing who waits where, instead of hanging.
"""

from __future__ import annotations

import threading

import numpy as np

from . import kernel_line
from ._numba_adapter import sim as _sim

_sim_kernel = _sim("kernel")

__all__ = ["FastBlockManager", "FastBlockThread", "SimulatorDeadlock", "WarpRound", "STRICT_EXITED_LANES"]

#: When True (the default), a warp intrinsic whose mask names a lane that has already returned -- or that never
#: reaches it because it took another branch and then returned -- fails the launch (under the sanitizer,
#: synccheck reports it instead).  CUDA itself only waits for the *non-exited* lanes named in the mask, and
#: values read from exited lanes are undefined: "returned early, then shuffled with a full mask" often works by
#: accident on a GPU.  False keeps CUDA's rule (the exited lanes are not waited for; reading them gives NaN or
#: 0xDEADBEEF).
STRICT_EXITED_LANES = True


def exited_lanes_message(kind, mask, warp, lanes) -> str:
    return (f"{kind}(mask={mask:#010x}) in warp {warp}: lanes {list(lanes)} named in the mask had already returned "
            "or never reach it (a warp operation after an early return, or in a branch some lanes skip; values "
            "read from them are undefined on a GPU; flashnb.sim.fastbarrier.STRICT_EXITED_LANES = False allows it)")

#: Set by the sanitizer's synccheck (:mod:`flashnb.sim.sanitize`): an object whose ``barrier(block, sites,
#: exited)`` is told, each time a block barrier is released, where each waiting thread called it from
#: (``{thread id: "file:line (function)"}``) and which threads of the block had already returned.
sync_observer = None

_SIM_FILES = None


def _caller_site() -> str:
    """file:line (function) of the kernel code that called ``cuda.syncthreads()`` (simulator frames skipped)."""
    global _SIM_FILES
    if _SIM_FILES is None:
        kernelapi = _sim("kernelapi")

        _SIM_FILES = {__file__, _sim_kernel.__file__, kernelapi.__file__}
    return kernel_line(_SIM_FILES, 3)


def _warp_site() -> str:
    """file:line (function) of the kernel code that called a warp intrinsic."""
    import os

    _caller_site()
    return kernel_line(_SIM_FILES | {os.path.join(os.path.dirname(__file__), "warp.py")}, 3)


class SimulatorDeadlock(RuntimeError):
    """Every live thread of a block waits for something that can no longer happen (a hang on a GPU)."""


class _Generation:
    """One use of the block barrier (threads of the next use wait on a fresh generation)."""

    __slots__ = ("waiters", "done", "sites")

    def __init__(self):
        self.waiters = []
        self.done = False
        self.sites = {}   # thread id -> call site, recorded only while a synccheck observer is set


class WarpRound:
    """One warp intrinsic in progress for one (warp, mask): the values of the lanes that have arrived."""

    __slots__ = ("kind", "warp", "mask", "compute", "args", "results", "done", "site")

    def __init__(self, kind, warp, mask, compute):
        self.kind = kind
        self.compute = compute  # (round, lanes_in_warp, participants_mask) -> {lane: result}
        self.warp = warp
        self.mask = mask
        self.args = {}  # lane -> (value, operand)
        self.results = None  # lane -> result, once complete
        self.done = False
        self.site = None


class FastBlockThread(_sim_kernel.BlockThread):
    """A simulated CUDA thread whose barrier blocks on its own lock (its *gate*) until released: no polling,
    and no contended re-acquire of the manager's lock on wake-up.  ``phase`` counts the block barriers this
    thread has passed and ``warp_phase`` its ``syncwarp`` calls (:mod:`flashnb.sim.racecheck` orders accesses
    by them)."""

    phase = 0
    warp_phase = 0

    def _block(self):
        """Wait at the gate; the manager's lock must *not* be held (it was released by the caller)."""
        self.gate.acquire()

    def run(self):
        try:
            super().run()  # the stock run(): records an exception as (exception with tid/ctaid, traceback)
        finally:
            self._manager._exited(self)

    def syncthreads(self):
        m = self._manager
        site = _caller_site() if sync_observer is not None else None
        with m.lock:
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            gen = m.generation
            m.at_barrier += 1
            m.running -= 1
            self.waiting_at = "syncthreads"
            self.gated = True
            gen.waiters.append(self)
            if site is not None:
                gen.sites[self.thread_id] = site
            if not m._release_barrier_if_complete():
                m._check_deadlock()
        self._block()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")
        self.phase += 1

    def warp_collective(self, kind, mask, value, operand, compute):
        """Wait until every participating lane of this (warp, mask) has called ``kind``; return this lane's
        result of ``compute(round, lanes_in_warp, participants)``.  Used by :mod:`flashnb.sim.warp`."""
        m = self._manager
        lane = self.thread_id & 31
        warp = self.thread_id >> 5
        with m.lock:
            if self.abort:
                raise RuntimeError(f"abort flag set on {kind} call")
            key = (warp, mask)
            rnd = m.rounds.get(key)
            if rnd is None:
                rnd = m.rounds[key] = WarpRound(kind, warp, mask, compute)
                rnd.site = _warp_site() if sync_observer is not None else None
            elif rnd.kind != kind:
                raise RuntimeError(
                    f"lane {lane} of warp {warp} called {kind}(mask={mask:#010x}) while lanes "
                    f"{sorted(rnd.args)} of the same warp wait in {rnd.kind}(mask={mask:#010x}): every lane "
                    "named in a mask must execute the same warp intrinsic (undefined behaviour in CUDA)"
                )
            rnd.args[lane] = (value, operand)
            m.running -= 1
            self.waiting_at = rnd
            self.gated = True
            if not m._complete_round_if_ready(key):
                m._check_deadlock()
        self._block()
        if not rnd.done:
            raise RuntimeError(f"abort flag set on {kind} clear")
        if kind == "syncwarp":
            self.warp_phase += 1
        return rnd.results[lane]


class FastBlockManager(_sim_kernel.BlockManager):
    """Runs one thread block with :class:`FastBlockThread` threads; same interface as the stock manager."""

    def run(self, grid_point, *args):
        self.lock = threading.Lock()
        self.finished = threading.Condition(self.lock)
        self.generation = _Generation()
        self.rounds = {}
        self.first_exception = None
        self.exited = set()  # linear thread ids that have returned
        self.nthreads = 1
        for n in self._block_dim:
            self.nthreads *= n

        from .threads_typing import typed

        f = typed(self._f)      # numba's scalar typing (flashnb.sim.arith)

        def target():
            f(*args)

        threads = []
        for block_point in np.ndindex(*self._block_dim):
            t = FastBlockThread(target, self, grid_point, block_point, self._debug)
            t.waiting_at = None
            t.gated = False
            t.gate = threading.Lock()
            t.gate.acquire()  # closed: a waiting thread blocks on it until the manager opens it
            threads.append(t)
        self.threads = threads
        self.by_tid = {t.thread_id: t for t in threads}
        self.live = self.running = len(threads)  # counted before any thread starts
        self.at_barrier = 0
        with self.lock:
            for i, t in enumerate(threads):
                try:
                    t.start()  # the threads block on self.lock until every one of them is started
                except BaseException:
                    self.live -= len(threads) - i
                    self.running -= len(threads) - i
                    self._fail((RuntimeError("could not start a simulator thread"), None))
                    raise
            while self.live and self.first_exception is None:
                self.finished.wait()
            failure = self.first_exception
        if failure is not None:
            # As the stock manager: raise at once, the other (aborted) threads are not joined.
            raise failure[0].with_traceback(failure[1])

    # -- everything below runs with self.lock held

    def _fail(self, exc_tb):
        if self.first_exception is None:
            self.first_exception = exc_tb
        for t in self.threads:
            t.abort = True
        for t in self.threads:
            self._wake(t)
        self.finished.notify_all()

    def _wake(self, t):
        if t.gated:
            t.gated = False
            t.waiting_at = None
            t.gate.release()

    def _exited(self, t):
        with self.lock:
            self.live -= 1
            self.running -= 1
            self.exited.add(t.thread_id)
            if t.exception is not None:
                self._fail(t.exception)
            elif self.first_exception is None:
                self._release_barrier_if_complete()
                warp = t.thread_id >> 5
                for key in [k for k in self.rounds if k[0] == warp]:
                    self._complete_round_if_ready(key)
                if self.live:
                    self._check_deadlock()
            if not self.live:
                self.finished.notify_all()

    def _release_barrier_if_complete(self):
        if self.at_barrier and self.at_barrier == self.live:
            gen = self.generation
            self.generation = _Generation()
            self.running += self.at_barrier
            self.at_barrier = 0
            gen.done = True
            observer = sync_observer
            if observer is not None and gen.sites:
                observer.barrier(tuple(self.threads[0].blockIdx), gen.sites, sorted(self.exited))
            for t in gen.waiters:
                self._wake(t)
            return True
        return False

    def lanes_in_warp(self, warp):
        """Number of threads in ``warp`` (32 except for a partial last warp)."""
        return min(32, self.nthreads - 32 * warp)

    def live_lanes(self, warp):
        """Bit mask of the lanes of ``warp`` that exist and have not returned."""
        base = 32 * warp
        return sum(1 << lane for lane in range(self.lanes_in_warp(warp)) if base + lane not in self.exited)

    def _complete_round_if_ready(self, key):
        rnd = self.rounds[key]
        participants = rnd.mask & self.live_lanes(rnd.warp)
        arrived = sum(1 << lane for lane in rnd.args)
        if arrived != participants:
            return False
        del self.rounds[key]
        gone = rnd.mask & ((1 << self.lanes_in_warp(rnd.warp)) - 1) & ~participants
        if gone and (STRICT_EXITED_LANES or sync_observer is not None):
            lanes = [lane for lane in range(32) if gone >> lane & 1]
            obs = sync_observer
            if obs is not None:
                obs.warp_after_exit(rnd.kind, rnd.mask, tuple(self.threads[0].blockIdx), rnd.warp, lanes, rnd.site)
            else:
                self._fail((RuntimeError(exited_lanes_message(rnd.kind, rnd.mask, rnd.warp, lanes)), None))
                return True
        try:
            rnd.results = rnd.compute(rnd, self.lanes_in_warp(rnd.warp), participants)
        except BaseException as e:  # a bad value: fail the launch with it, do not strand the lanes
            self._fail((type(e)(f"{rnd.kind} in warp {rnd.warp}: {e}"), e.__traceback__))
            return True
        self.running += len(rnd.args)
        rnd.done = True
        base = 32 * rnd.warp
        for lane in rnd.args:
            self._wake(self.by_tid[base + lane])
        return True

    def _check_deadlock(self):
        if self.running or not self.live or self.first_exception is not None:
            return
        at_barrier = [t for t in self.threads if t.waiting_at == "syncthreads"]
        lines = [
            f"every live thread of block {list(self.threads[0].blockIdx)} is waiting and none of the waits can "
            "complete (a real GPU would hang here):"
        ]
        if at_barrier:
            lines.append(
                f"  {len(at_barrier)} thread(s) wait in syncthreads() (it needs all {self.live} live threads), "
                f"e.g. tid={list(at_barrier[0].threadIdx)}"
            )
        for rnd in self.rounds.values():
            participants = rnd.mask & self.live_lanes(rnd.warp)
            missing = [lane for lane in range(32) if participants >> lane & 1 and lane not in rnd.args]
            where = []
            for lane in missing[:4]:
                other = self.by_tid[32 * rnd.warp + lane].waiting_at
                what = "syncthreads()" if other == "syncthreads" else f"{other.kind}(mask={other.mask:#010x})"
                where.append(f"lane {lane} waits in {what}")
            lines.append(
                f"  warp {rnd.warp}: lanes {sorted(rnd.args)} wait in {rnd.kind}(mask={rnd.mask:#010x}) for "
                f"live lanes {missing} named in the mask ({'; '.join(where)})"
            )
        self._fail((SimulatorDeadlock("\n".join(lines)), None))
