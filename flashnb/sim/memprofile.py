"""Memory transactions on the simulator, in the spirit of Nsight Compute's memory metrics.

A GPU does not move single elements: the 32 lanes of a warp execute one load instruction together (one
*request*), and the hardware serves it in 32-byte **sectors** from global memory, or in **wavefronts** from the
32 banks of shared memory.  How many sectors or wavefronts a request costs is decided by which addresses its 32
lanes ask for -- coalescing and bank conflicts -- and that is visible in the kernel's index arithmetic, so the
simulator can count it.  Inside ::

    with flashnb.sim.profile() as prof:
        flashnb.attention_forward(q, k, v, impl="fa2")
    print(prof)                        # per launch, array and source line: requests, sectors or wavefronts
    prof.metrics()                     # Nsight Compute metric names -> values, per launch

every element access of every launch is grouped into requests: **the k-th access made at one source line to
one array by the lanes of one warp** is request k of that (warp, line, array) -- what SIMT execution does when
the lanes run the line together.  Then, per request,

* global memory: ``sectors`` = distinct 32-byte sectors its lanes touch (offsets from the start of the
  allocation, which ``cudaMalloc`` aligns to 256 bytes); ideal = ceil(distinct bytes / 32), so 32 lanes
  reading 32 consecutive float32 cost 4 sectors (ideal 4), the same lanes reading a column of a row-major
  ``(N, 64)`` array cost 32 (ideal 4), and 32 lanes reading one element cost 1 (a broadcast);
* shared memory: banks are 4 bytes wide, 32 of them, word ``w`` in bank ``w mod 32``; ``wavefronts`` = the
  largest number of *distinct* words any one bank must deliver (lanes reading the same word share it: a
  broadcast); ``bank conflicts`` = wavefronts - ideal, ideal = ceil(distinct words / 32).  Each shared array is
  taken to start at bank 0.

Tensor-core loads and copies (:mod:`flashnb.sim.tensorcore`) are grouped as the hardware serves them: an
``ldmatrix`` is one request per 8×8 matrix -- its 8 rows of 16 bytes, one 128-byte phase, ideal 1 wavefront -- so
rows that share banks (a ``d = 64`` half tile without a swizzle: rows 128 bytes apart) cost up to 8; a
``cp.async`` is one request of the warp's 32 chunks of 16 bytes, named by the line that issued it.

Metric names follow Nsight Compute (``l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum``,
``l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum``, ...).  How these counts differ from ncu's:

* they are *program-level*: one request per element access the Python source makes.  The compiled kernel may
  keep a value in a register instead of reloading it, hoist a load out of a loop, or (not in numba's output
  for these kernels) merge neighbouring loads into one 64/128-bit access; ncu counts the instructions that
  really ran;
* sectors are what the load/store unit asks L1 for: no L1 or L2 hit modelling, so ``bytes`` here are not
  DRAM bytes (ncu's ``dram__bytes_read.sum``), which caches reduce;
* lanes that run one line at different times (divergence) are grouped as if they ran it together.

Needs flashnb's simulator runtime; cannot be combined with the sanitizer in one block.
"""

from __future__ import annotations

import contextlib
import html
import math
import threading
from dataclasses import dataclass, field

import numpy as np

from . import racecheck, traffic
from .racecheck import _where

__all__ = ["profile", "MemoryProfile", "LineStats", "request_cost", "METRICS"]

racecheck._SKIP.add(__file__)

SECTOR = 32        # bytes per global-memory sector
BANKS = 32         # shared-memory banks
BANK_WIDTH = 4     # bytes per bank word

_OP = {"r": "ld", "w": "st", "a": "atom"}

#: (memory, op) -> (requests metric, sectors/wavefronts metric, conflicts metric or None), Nsight Compute names
METRICS = {
    ("global", "ld"): ("l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
                       "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", None),
    ("global", "st"): ("l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
                       "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum", None),
    ("global", "atom"): ("l1tex__t_requests_pipe_lsu_mem_global_op_atom.sum",
                         "l1tex__t_sectors_pipe_lsu_mem_global_op_atom.sum", None),
    ("shared", "ld"): ("smsp__sass_inst_executed_op_shared_ld.sum",
                       "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
                       "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
    ("shared", "st"): ("smsp__sass_inst_executed_op_shared_st.sum",
                       "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
                       "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"),
    ("shared", "atom"): ("smsp__sass_inst_executed_op_shared_atom.sum",
                         "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_atom.sum",
                         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_atom.sum"),
}


def request_cost(memory: str, accesses) -> tuple[int, int]:
    """(cost, ideal) of one warp request: ``accesses`` are (byte offset, size) of each lane's access.

    global: cost = distinct 32-byte sectors, ideal = ceil(distinct bytes / 32); shared: cost = wavefronts
    (the most distinct 4-byte words any bank serves), ideal = ceil(distinct words / 32).
    """
    if memory == "global":
        sectors, nbytes = set(), set()
        for off, size in accesses:
            nbytes.update(range(off, off + size))
            sectors.update(range(off // SECTOR, (off + size - 1) // SECTOR + 1))
        return len(sectors), math.ceil(len(nbytes) / SECTOR)
    words = set()
    for off, size in accesses:
        words.update(range(off // BANK_WIDTH, (off + size - 1) // BANK_WIDTH + 1))
    per_bank: dict = {}
    for w in words:
        per_bank[w % BANKS] = per_bank.get(w % BANKS, 0) + 1
    return max(per_bank.values()), math.ceil(len(words) / BANKS)


@dataclass
class LineStats:
    """One (launch, array, memory, op, source line): its requests and what they cost."""

    launch: str
    kernel: str
    array: str
    memory: str       # "global" or "shared"
    op: str           # "ld", "st" or "atom"
    where: str        # file:line (function)
    requests: int = 0
    cost: int = 0     # sectors (global) or wavefronts (shared)
    ideal: int = 0    # the least cost the same bytes could have

    @property
    def per_request(self) -> float:
        """Sectors (global) or wavefronts (shared) per request."""
        return self.cost / self.requests if self.requests else 0.0

    @property
    def bank_conflicts(self) -> int:
        """Shared memory: wavefronts beyond the ideal (Nsight's ``l1tex__data_bank_conflicts_...``)."""
        return self.cost - self.ideal if self.memory == "shared" else 0

    @property
    def excess(self) -> float:
        """cost / ideal: 1.0 is perfectly coalesced (global) or conflict-free (shared)."""
        return self.cost / self.ideal if self.ideal else 1.0

    @property
    def bytes(self) -> int | None:
        """Global memory: bytes moved at sector granularity (sectors x 32); None for shared memory."""
        return self.cost * SECTOR if self.memory == "global" else None


@dataclass
class MemoryProfile:
    """What :func:`profile` measured: one :class:`LineStats` per (launch, array, op, line), launch order."""

    lines: list = field(default_factory=list)
    launches: list = field(default_factory=list)   # (label, kernel) in launch order
    traffic: object = None

    def select(self, launch: str | None = None, array: str | None = None, memory: str | None = None,
               op: str | None = None) -> list:
        """The lines matching every given field (``launch`` matches the label or the kernel name)."""
        return [s for s in self.lines if (launch is None or launch in (s.launch, s.kernel))
                and (array is None or s.array == array) and (memory is None or s.memory == memory)
                and (op is None or s.op == op)]

    def total(self, **where) -> dict:
        """requests, cost, ideal (and bank_conflicts) summed over :meth:`select` (``**where``)."""
        rows = self.select(**where)
        return dict(requests=sum(s.requests for s in rows), cost=sum(s.cost for s in rows),
                    ideal=sum(s.ideal for s in rows), bank_conflicts=sum(s.bank_conflicts for s in rows))

    def metrics(self) -> dict:
        """``{launch label: {Nsight Compute metric name: value}}``, with the sectors-per-request ratios."""
        out: dict = {}
        for s in self.lines:
            m = out.setdefault(s.launch, {})
            req, cost, conf = METRICS[(s.memory, s.op)]
            m[req] = m.get(req, 0) + s.requests
            m[cost] = m.get(cost, 0) + s.cost
            if conf:
                m[conf] = m.get(conf, 0) + s.bank_conflicts
        for m in out.values():
            for op in ("ld", "st"):
                req = m.get(f"l1tex__t_requests_pipe_lsu_mem_global_op_{op}.sum")
                if req:
                    m[f"l1tex__average_t_sectors_per_request_pipe_lsu_mem_global_op_{op}.ratio"] = \
                        m[f"l1tex__t_sectors_pipe_lsu_mem_global_op_{op}.sum"] / req
        return out

    def worst(self, n: int = 5) -> list:
        """The ``n`` lines that waste the most (cost - ideal), most first."""
        return sorted((s for s in self.lines if s.cost > s.ideal), key=lambda s: s.ideal - s.cost)[:n]

    _HEAD = ("launch", "array", "mem", "op", "line", "requests", "per req.", "ideal/req.", "excess", "conflicts")

    def _rows(self, lines=None) -> list:
        rows = []
        for s in (self.lines if lines is None else lines):
            unit = "sect" if s.memory == "global" else "wave"
            rows.append((s.launch, s.array, s.memory, s.op, s.where, f"{s.requests:,}",
                         f"{s.per_request:.2f} {unit}", f"{s.ideal / s.requests:.2f}" if s.requests else "-",
                         f"{s.excess:.2f}x", f"{s.bank_conflicts:,}" if s.memory == "shared" else ""))
        return rows

    def table(self, lines=None) -> str:
        """A plain-text table (all lines, or the given ones)."""
        rows = [self._HEAD] + self._rows(lines)
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._HEAD))]
        out = []
        for j, r in enumerate(rows):
            out.append("  ".join(c.rjust(w) if i >= 5 else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(r, widths))).rstrip())
            if j == 0:
                out.append("  ".join("-" * w for w in widths))
        return "\n".join(out)

    def __str__(self):
        g, sh = self.total(memory="global"), self.total(memory="shared")
        head = (f"{len(self.launches)} launch(es): global {g['requests']:,} requests, {g['cost']:,} sectors "
                f"(ideal {g['ideal']:,}); shared {sh['requests']:,} requests, {sh['cost']:,} wavefronts "
                f"({sh['bank_conflicts']:,} bank conflicts)")
        return head + "\n" + self.table()

    def _repr_html_(self):
        e = html.escape
        head = "".join(f"<th>{e(h)}</th>" for h in self._HEAD)
        body = "".join("<tr>" + "".join(f"<td style='text-align:{'right' if i >= 5 else 'left'}'>{e(c)}</td>"
                                        for i, c in enumerate(r)) + "</tr>" for r in self._rows())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class _LaunchProfiler:
    """Groups one launch's accesses into warp requests (the traffic counter's observer protocol)."""

    locals = False

    def __init__(self, prof: MemoryProfile, label: str, kernel: str):
        self.prof = prof
        self.label = label
        self.kernel = kernel
        self.seq: dict = {}        # (block, thread, line, op, array) -> accesses made so far
        self.requests: dict = {}   # (block, warp, line, op, array, memory, k) -> [(offset, size), ...]
        self.lock = threading.Lock()

    def index(self, op, proxy, idx):
        pass

    def new_local(self, proxy):  # pragma: no cover - locals are not asked for
        pass

    def access(self, op, proxy, idx):
        kind = proxy._kr[0]
        if kind == "lr":
            return
        memory = "shared" if kind == "sr" else "global"
        t = threading.current_thread()
        block, tid = tuple(t.blockIdx), t.thread_id
        where, name = _where(), proxy._kr[1]
        a = proxy._a
        base = _root(a).__array_interface__["data"][0]
        size = a.itemsize
        offsets = [(addr - base, size) for addr, _ in racecheck._elements(a, idx)]
        key = (block, tid, where, op, name)
        request = getattr(racecheck._site, "request", None)   # an instruction twin's own grouping (ldmatrix's
        with self.lock:                                         # 8-row phases, one cp.async), else the k-th access
            k = self.seq.get(key, 0) if request is None else request
            if request is None:
                self.seq[key] = k + 1
            self.requests.setdefault((block, tid >> 5, where, _OP[op], name, memory, k), []).extend(offsets)

    def finish(self):
        stats: dict = {}
        for (block, warp, where, op, name, memory, k), acc in self.requests.items():
            cost, ideal = request_cost(memory, acc)
            s = stats.get((name, memory, op, where))
            if s is None:
                s = stats[(name, memory, op, where)] = LineStats(self.label, self.kernel, name, memory, op, where)
            s.requests += 1
            s.cost += cost
            s.ideal += ideal
        self.prof.lines.extend(sorted(stats.values(), key=lambda s: (s.memory, s.where, s.array, s.op)))
        self.prof.launches.append((self.label, self.kernel))


class _Observers:
    """``traffic.observer_factory`` of a profile block (threads simulator: one profiler per launch; vectorised
    simulator: :mod:`flashnb.sim.vector.profile` groups the launch's logged accesses into the same requests)."""

    def __init__(self, prof):
        self.prof = prof

    def __call__(self, label, kernel):
        return _LaunchProfiler(self.prof, label, kernel)

    def vector_spec(self, label, kernel):
        return dict(profile=True, profile_sink=self.prof)


@contextlib.contextmanager
def profile():
    """Group every access of every launch in the ``with`` block into warp requests; yields a
    :class:`MemoryProfile` (filled as each launch ends)."""
    from . import is_installed

    if not is_installed():
        raise RuntimeError("the memory profiler needs flashnb's simulator runtime (flashnb.sim.install())")
    if traffic.observer_factory is not None:
        raise RuntimeError("a sanitizer, race checker or profiler is already active")
    prof = MemoryProfile()
    traffic.observer_factory = _Observers(prof)
    try:
        with traffic.count() as t:
            prof.traffic = t
            yield prof
    finally:
        traffic.observer_factory = None
