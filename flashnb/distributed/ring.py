"""The ring schedule and its communication, on ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

Rank ``r`` of ``W`` holds Q, K, V of its shard.  **Forward** (``mode="ring"``): at step ``t = 0 … W−1`` it
holds the K/V of rank ``src = (r − t) mod W``.  Before the step's compute it posts the send of that K/V to
rank ``r + 1`` and the receive of the next from rank ``r − 1`` (one ``batch_isend_irecv``), so the transfer
runs while the blocks of the step are computed (:mod:`flashnb.distributed.blocks`) and merged into the
rank's ``(O, L)``; then it waits for the transfer.  W − 1 hops: every K/V shard visits every rank.

**Backward**: the same K/V ring, and dK/dV follow their K/V.  At step ``t`` the rank computes its blocks'
share of dQ (kept: the queries stay home), dK and dV of the K/V it holds, adds the dK/dV accumulated by the
ranks that K/V visited before (received from ``r − 1``), and sends the sum on to ``r + 1``.  After the last
step each dK/dV has been summed over every rank and takes one more hop: home, to the rank that owns the K/V.
dK/dV travel in float32.  The blocks' backward recomputes ``P`` from the *merged* forward's ``L`` (FA2
Alg. 2), so no rank keeps anything of the forward but ``O`` and ``L``.

**All-gather** (``mode="allgather"``, Llama 3's choice): one all-gather brings every K/V shard to every rank
(posted before the rank's own block, waited for after it); the backward gathers K/V again, computes every
shard's dK/dV and sums them onto their owners with one reduce-scatter.  The same forward bytes as the ring,
in one collective, but every rank holds all N tokens of K/V at once.

Every transfer is waited for with the timeout given to :func:`flashnb.distributed.ring_attention` (default:
the process group's); a failure raises :class:`~flashnb.distributed.errors.RingCommError` naming the phase,
the step and the peer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .blocks import merge, plan_for
from .errors import comm_error
from .layouts import positions
from .stats import RingStats

__all__ = ["RingConfig", "Transfer", "Comm", "RingSchedule", "AllGatherSchedule", "SCHEDULES"]

_PHASE_TAG = {"forward": 0, "backward": 1}
_KIND_TAG = {"K/V": 0, "dK/dV": 1}


@dataclass
class RingConfig:
    """What every rank agreed on (:func:`flashnb.distributed.ring_attention` builds it after the check)."""

    causal: bool
    layout: str
    mode: str
    group: object
    rank: int
    world: int
    N: int
    impl: object
    scale: float
    stats: RingStats | None
    timeout: timedelta | None
    dropout: tuple | None
    schedule: type | None = None

    def global_rank(self, r: int) -> int:
        """The global rank of group rank ``r`` (what point-to-point ops address)."""
        if self.group is None or self.group is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def positions(self, rank: int) -> np.ndarray:
        return positions(self.N, self.layout, rank, self.world)


class Transfer:
    """The sends and receives of one step, posted; :meth:`wait` returns what was received (or raises
    :class:`~flashnb.distributed.errors.RingCommError` naming the step and the peer)."""

    def __init__(self, works, result, *, phase, step, world, what, timeout):
        self.works, self.result = works, result
        self.phase, self.step, self.world, self.what, self.timeout = phase, step, world, what, timeout
        self.started = time.perf_counter()

    def wait(self):
        for work, op, peer in self.works:
            try:
                work.wait() if self.timeout is None else work.wait(timeout=self.timeout)
            except RuntimeError as exc:
                raise comm_error(exc, phase=self.phase, step=self.step, world=self.world, op=op, peer=peer,
                                 what=self.what, started=self.started, timeout=self.timeout) from exc
        return self.result


class Comm:
    """The rank's transfers; each one adds its payload to the step's record."""

    def __init__(self, cfg: RingConfig):
        self.cfg = cfg
        W, r = cfg.world, cfg.rank
        self.next, self.prev = cfg.global_rank((r + 1) % W), cfg.global_rank((r - 1) % W)

    def shift(self, x: torch.Tensor, *, phase: str, step: int, what: str, rec) -> Transfer:
        """Send ``x`` to rank r + 1 and receive a tensor like it from rank r − 1 (the ring's hop)."""
        got = torch.empty_like(x)
        tag = 1000 * _PHASE_TAG[phase] + 2 * step + _KIND_TAG[what]
        ops = [dist.P2POp(dist.isend, x, self.next, self.cfg.group, tag),
               dist.P2POp(dist.irecv, got, self.prev, self.cfg.group, tag)]
        send, recv = dist.batch_isend_irecv(ops)
        rec.sent_bytes += x.nbytes
        rec.recv_bytes += got.nbytes
        return Transfer([(recv, "recv", self.prev), (send, "send", self.next)], got, phase=phase, step=step,
                        world=self.cfg.world, what=what, timeout=self.cfg.timeout)

    def all_gather(self, x: torch.Tensor, *, phase: str, step: int, rec) -> Transfer:
        """Every rank's ``x``, in rank order (posted; wait for it)."""
        parts = [torch.empty_like(x) for _ in range(self.cfg.world)]
        work = dist.all_gather(parts, x, group=self.cfg.group, async_op=True)
        rec.sent_bytes += (self.cfg.world - 1) * x.nbytes       # the payload: this shard, to every other rank
        rec.recv_bytes += (self.cfg.world - 1) * x.nbytes
        return Transfer([(work, "all_gather", None)], parts, phase=phase, step=step, world=self.cfg.world,
                        what="K/V", timeout=self.cfg.timeout)

    def reduce_scatter(self, parts: list, *, phase: str, step: int, rec) -> Transfer:
        """``sum over ranks of parts[r]`` on each rank ``r`` (posted; wait for it)."""
        out = torch.empty_like(parts[0])
        work = dist.reduce_scatter(out, parts, group=self.cfg.group, async_op=True)
        rec.sent_bytes += (self.cfg.world - 1) * out.nbytes
        rec.recv_bytes += (self.cfg.world - 1) * out.nbytes
        return Transfer([(work, "reduce_scatter", None)], out, phase=phase, step=step, world=self.cfg.world,
                        what="dK/dV", timeout=self.cfg.timeout)


class RingSchedule:
    """``mode="ring"``: see the module docstring.  :meth:`next_kv` is the one policy a variant changes."""

    def __init__(self, cfg: RingConfig):
        self.cfg = cfg
        self.stats = cfg.stats if cfg.stats is not None else RingStats()
        self.comm = Comm(cfg)
        self.q_pos = cfg.positions(cfg.rank)

    # ---- one step's blocks

    def src(self, step: int) -> int:
        """Whose K/V rank ``r`` holds at ``step``: ``(r − step) mod W``."""
        return (self.cfg.rank - step) % self.cfg.world

    def _blocks(self, src: int, rec):
        cfg = self.cfg
        blocks = plan_for(cfg.N, cfg.layout, cfg.world, cfg.rank, src, cfg.causal)
        rec.pairs += sum(b.pairs for b in blocks)
        rec.blocks += len(blocks)
        return blocks, cfg.positions(src)

    def attend(self, q, k, v, o, lse, src: int, rec) -> None:
        """Merge this step's blocks (queries against the K/V of rank ``src``) into ``(o, lse)``, in place."""
        cfg = self.cfg
        blocks, k_pos = self._blocks(src, rec)
        m0 = self.stats.mark()
        for b in blocks:
            rows = slice(b.row0, b.row1)
            o_b, lse_b = cfg.impl.forward(q[:, :, rows], k[:, :, :b.keys], v[:, :, :b.keys], causal=b.causal,
                                          scale=cfg.scale, rows=self.q_pos[rows], keys=k_pos[:b.keys],
                                          dropout=cfg.dropout)
            o[:, :, rows], lse[:, :, rows] = merge(o[:, :, rows], lse[:, :, rows], o_b, lse_b)
        self.stats.span(rec, "compute", m0, self.stats.mark())

    def attend_backward(self, q, k, v, o, lse, do, dq, dkv, src: int, rec) -> None:
        """Add this step's blocks' dQ to ``dq`` and their dK, dV (of rank ``src``'s K/V) to ``dkv``, in place."""
        cfg = self.cfg
        blocks, k_pos = self._blocks(src, rec)
        m0 = self.stats.mark()
        for b in blocks:
            rows = slice(b.row0, b.row1)
            dq_b, dk_b, dv_b = cfg.impl.backward(q[:, :, rows], k[:, :, :b.keys], v[:, :, :b.keys], o[:, :, rows],
                                                 lse[:, :, rows], do[:, :, rows], causal=b.causal, scale=cfg.scale,
                                                 rows=self.q_pos[rows], keys=k_pos[:b.keys], dropout=cfg.dropout)
            dq[:, :, rows] += dq_b
            dkv[0, :, :, :b.keys] += dk_b
            dkv[1, :, :, :b.keys] += dv_b
        self.stats.span(rec, "compute", m0, self.stats.mark())

    def waited(self, transfer: Transfer, rec):
        m0 = self.stats.mark()
        out = transfer.wait()
        self.stats.span(rec, "wait", m0, self.stats.mark())
        return out

    def next_kv(self, phase: str, transfer: Transfer, held: torch.Tensor, rec) -> torch.Tensor:
        """The K/V of the next step: what the transfer received."""
        return self.waited(transfer, rec)

    # ---- the two phases

    @staticmethod
    def _start(q, k, v):
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        return o, lse, torch.stack([k.detach(), v.detach()])       # K and V travel as one message

    def forward(self, q, k, v):
        """``(O, L)`` of this rank's queries against the whole sequence."""
        cfg, W = self.cfg, self.cfg.world
        o, lse, kv = self._start(q, k, v)
        self.stats.start(q.device)
        for t in range(W):
            rec = self.stats.step("forward", t, cfg.rank, self.src(t), cfg.mode)
            transfer = self.comm.shift(kv, phase="forward", step=t, what="K/V", rec=rec) if t < W - 1 else None
            rec.kv_bytes_held = kv.nbytes * (2 if transfer else 1)
            self.attend(q, kv[0], kv[1], o, lse, self.src(t), rec)
            if transfer is not None:
                kv = self.next_kv("forward", transfer, kv, rec)
        self.stats.finish()
        return o, lse

    def backward(self, q, k, v, o, lse, do):
        """``(dQ, dK, dV)`` of this rank's shards (dK, dV summed over every rank's queries)."""
        cfg, W = self.cfg, self.cfg.world
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        _, _, kv = self._start(q, k, v)
        self.stats.start(q.device)
        pending = None                                  # the dK/dV on its way from rank r − 1
        for t in range(W):
            rec = self.stats.step("backward", t, cfg.rank, self.src(t), cfg.mode)
            transfer = self.comm.shift(kv, phase="backward", step=t, what="K/V", rec=rec) if t < W - 1 else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            self.attend_backward(q, kv[0], kv[1], o, lse, do, dq, dkv, self.src(t), rec)
            if pending is not None:
                dkv += self.waited(pending, rec)       # the shares of the ranks this K/V visited before
            rec.kv_bytes_held = kv.nbytes * (2 if transfer else 1) + dkv.nbytes * (2 if W > 1 else 1)
            if W > 1:        # on to r + 1; after the last step that is the hop home
                pending = self.comm.shift(dkv, phase="backward", step=t, what="dK/dV", rec=rec)
            else:
                pending = None
            if transfer is not None:
                kv = self.next_kv("backward", transfer, kv, rec)
        home = dkv if pending is None else self.waited(pending, rec)
        self.stats.finish()
        return dq, home[0], home[1]


class AllGatherSchedule(RingSchedule):
    """``mode="allgather"``: one all-gather of K/V (and, in the backward, one reduce-scatter of dK/dV)."""

    def forward(self, q, k, v):
        cfg, W = self.cfg, self.cfg.world
        o, lse, kv = self._start(q, k, v)
        self.stats.start(q.device)
        parts = None
        for t in range(W):
            rec = self.stats.step("forward", t, cfg.rank, self.src(t), cfg.mode)
            if t == 0:
                gather = self.comm.all_gather(kv, phase="forward", step=0, rec=rec) if W > 1 else None
                rec.kv_bytes_held = kv.nbytes * W
                self.attend(q, kv[0], kv[1], o, lse, cfg.rank, rec)   # the own block while the gather runs
                parts = self.waited(gather, rec) if gather is not None else [kv]
                continue
            rec.kv_bytes_held = kv.nbytes * W
            held = parts[self.src(t)]
            self.attend(q, held[0], held[1], o, lse, self.src(t), rec)
        self.stats.finish()
        return o, lse

    def backward(self, q, k, v, o, lse, do):
        cfg, W = self.cfg, self.cfg.world
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        _, _, kv = self._start(q, k, v)
        self.stats.start(q.device)
        dkv = torch.zeros((W,) + tuple(kv.shape), dtype=torch.float32, device=kv.device)
        parts = None
        for t in range(W):
            src = self.src(t)
            rec = self.stats.step("backward", t, cfg.rank, src, cfg.mode)
            rec.kv_bytes_held = kv.nbytes * W + dkv.nbytes
            if t == 0:
                gather = self.comm.all_gather(kv, phase="backward", step=0, rec=rec) if W > 1 else None
                self.attend_backward(q, kv[0], kv[1], o, lse, do, dq, dkv[src], src, rec)
                parts = self.waited(gather, rec) if gather is not None else [kv]
                continue
            held = parts[src]
            self.attend_backward(q, held[0], held[1], o, lse, do, dq, dkv[src], src, rec)
            if t == W - 1:                                # every shard's dK/dV summed onto its owner
                home = self.waited(self.comm.reduce_scatter(list(dkv), phase="backward", step=t, rec=rec), rec)
        if W == 1:
            home = dkv[0]
        self.stats.finish()
        return dq, home[0], home[1]


SCHEDULES = {"ring": RingSchedule, "allgather": AllGatherSchedule}
