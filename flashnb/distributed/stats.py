"""What a ring run did, per rank and step: bytes sent and received, (query, key) pairs attended, compute and
wait time, and the K/V bytes the rank held at once.

Pass ``stats=RingStats()`` to :func:`flashnb.distributed.ring_attention`; every rank fills its own object (one
row per phase and step, :meth:`RingStats.rows`), and :meth:`RingStats.combine` joins the rows of all ranks.

* ``sent_bytes`` / ``recv_bytes``: ``nbytes`` of the tensors handed to ``torch.distributed`` at that step
  (the payload, counted where it is sent; a collective's own algorithm may move more on the wire).
* ``pairs``: visible (query, key) position pairs of one batch·head computed at that step (the blocks' pairs,
  :class:`flashnb.distributed.blocks.Block`), the work a causal layout balances or not.
* ``kv_bytes_held``: bytes of K/V (and dK/dV) buffers the schedule holds at that step, its own shard included
  (what grows O(N/W) in a ring and O(N) in an all-gather).
* time: ``spans`` are ``(kind, t0, t1)`` with kind ``"compute"`` (the step's blocks) or ``"wait"`` (blocked on
  a transfer after the compute), seconds on ``time.perf_counter`` -- one clock for every process of a machine
  on Linux, so ranks' timelines line up.  CUDA tensors are timed with CUDA events on the current stream (the
  wait spans are then the stream's stall on the transfer), resolved when the phase ends.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

__all__ = ["RingStats", "StepRecord"]


@dataclass
class StepRecord:
    """One rank's step ``step`` of a ``phase`` ("forward" or "backward") with the K/V of rank ``src``."""

    phase: str
    step: int
    rank: int
    src: int
    mode: str
    sent_bytes: int = 0
    recv_bytes: int = 0
    pairs: int = 0
    blocks: int = 0
    kv_bytes_held: int = 0
    spans: list = field(default_factory=list)

    @property
    def compute_s(self) -> float:
        return sum(t1 - t0 for kind, t0, t1 in self.spans if kind == "compute")

    @property
    def wait_s(self) -> float:
        return sum(t1 - t0 for kind, t0, t1 in self.spans if kind == "wait")

    def row(self) -> dict:
        out = asdict(self)
        out["spans"] = [tuple(s) for s in self.spans]
        out.update(compute_s=self.compute_s, wait_s=self.wait_s)
        return out


class _CpuClock:
    def mark(self):
        return time.perf_counter()

    def resolve(self, m) -> float:
        return m


class _CudaClock:
    """CUDA events on the current stream, placed on the host's clock by one synchronised base event."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.base = torch.cuda.Event(enable_timing=True)
        self.base.record(torch.cuda.current_stream(device))
        self.base.synchronize()
        self.base_s = time.perf_counter()
        self.device = device

    def mark(self):
        e = self.torch.cuda.Event(enable_timing=True)
        e.record(self.torch.cuda.current_stream(self.device))
        return e

    def resolve(self, m) -> float:
        m.synchronize()
        return self.base_s + self.base.elapsed_time(m) / 1e3


class RingStats:
    """The rows of one rank (or, after :meth:`combine`, of many).  See the module docstring for the fields."""

    def __init__(self, records=None):
        self.records: list[StepRecord] = list(records or [])
        self._open: list[tuple[StepRecord, str, object, object]] = []
        self._clock = _CpuClock()

    # ---- recording (the schedules call these)

    def start(self, device) -> None:
        """Begin a phase on ``device`` (picks the clock: CUDA events for a CUDA device)."""
        self._clock = _CudaClock(device) if getattr(device, "type", "cpu") == "cuda" else _CpuClock()

    def step(self, phase: str, step: int, rank: int, src: int, mode: str) -> StepRecord:
        rec = StepRecord(phase, step, rank, src, mode)
        self.records.append(rec)
        return rec

    def mark(self):
        return self._clock.mark()

    def span(self, rec: StepRecord, kind: str, m0, m1) -> None:
        self._open.append((rec, kind, m0, m1))

    def finish(self) -> None:
        """Resolve the phase's time marks into seconds (CUDA: waits for the events)."""
        for rec, kind, m0, m1 in self._open:
            rec.spans.append((kind, self._clock.resolve(m0), self._clock.resolve(m1)))
        self._open.clear()

    # ---- reading

    def rows(self, phase: str | None = None) -> list[dict]:
        """One JSON-able dict per step and rank (``compute_s`` and ``wait_s`` added)."""
        return [r.row() for r in self.records if phase is None or r.phase == phase]

    @classmethod
    def combine(cls, parts) -> "RingStats":
        """One object from several ranks' :class:`RingStats` or their :meth:`rows` lists."""
        records = []
        for part in parts:
            rows = part.rows() if isinstance(part, RingStats) else list(part)
            for r in rows:
                r = {k: v for k, v in r.items() if k not in ("compute_s", "wait_s")}
                records.append(StepRecord(**{**r, "spans": [tuple(s) for s in r["spans"]]}))
        records.sort(key=lambda r: (r.phase != "forward", r.rank, r.step))
        return cls(records)

    def select(self, *, phase: str | None = None, rank: int | None = None) -> list[StepRecord]:
        return [r for r in self.records if (phase is None or r.phase == phase) and (rank is None or r.rank == rank)]

    def totals(self, *, phase: str | None = None, rank: int | None = None) -> dict:
        """Sums over the selected steps (``kv_bytes_held``: the largest)."""
        sel = self.select(phase=phase, rank=rank)
        return dict(sent_bytes=sum(r.sent_bytes for r in sel), recv_bytes=sum(r.recv_bytes for r in sel),
                    pairs=sum(r.pairs for r in sel), blocks=sum(r.blocks for r in sel),
                    compute_s=sum(r.compute_s for r in sel), wait_s=sum(r.wait_s for r in sel),
                    kv_bytes_held=max((r.kv_bytes_held for r in sel), default=0))

    def table(self) -> str:
        """A printable table, one line per phase, rank and step."""
        head = (f"{'phase':<9}{'rank':>5}{'step':>5}{'src':>4}{'sent B':>11}{'recv B':>11}{'pairs':>8}"
                f"{'blocks':>7}{'held B':>11}{'compute ms':>11}{'wait ms':>9}")
        lines = [head]
        for r in sorted(self.records, key=lambda r: (r.phase != "forward", r.rank, r.step)):
            lines.append(f"{r.phase:<9}{r.rank:>5}{r.step:>5}{r.src:>4}{r.sent_bytes:>11,}{r.recv_bytes:>11,}"
                         f"{r.pairs:>8,}{r.blocks:>7}{r.kv_bytes_held:>11,}{1e3 * r.compute_s:>11.2f}"
                         f"{1e3 * r.wait_s:>9.2f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"RingStats({len(self.records)} steps)"
