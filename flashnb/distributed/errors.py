"""Errors of a context-parallel run, raised on every rank and in bounded time, never a hang.

A rank that refuses its arguments while the others start the ring would leave them waiting for it (gloo's
default is 30 minutes).  So before the ring every rank describes its shards and arguments (:func:`describe`),
the descriptions are exchanged in one small all-gather with a timeout (:func:`agree`), and every rank runs the
same check on the same table (:func:`check_agreement`): each raises the same error, naming the rank and the
argument -- shards of different shapes across ranks, a shard length the layout cannot split, a non-contiguous
tensor, arguments that differ between ranks.

A transfer that does not complete (a peer that died, or skipped the backward) surfaces as
:class:`RingCommError` (:class:`RingTimeout` when the time ran out) naming the phase, the step and the peer.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

__all__ = ["RingCommError", "RingTimeout", "RanksFailed", "describe", "agree", "check_agreement", "comm_error"]


class RingCommError(RuntimeError):
    """A ring transfer failed: ``phase`` ("forward", "backward", "check"), ``step``, ``op`` ("send"/"recv"/a
    collective's name) and ``peer`` (the global rank on the other end; None for a collective)."""

    def __init__(self, message: str, *, phase: str, step: int | None, op: str, peer: int | None):
        super().__init__(message)
        self.phase, self.step, self.op, self.peer = phase, step, op, peer


class RingTimeout(RingCommError, TimeoutError):
    """A ring transfer that did not complete within the timeout."""


class RanksFailed(RuntimeError):
    """Raised by :func:`flashnb.distributed.launch.run` when a rank raised or did not finish: ``errors`` maps a
    rank to ``(exception type name, message, traceback text)``; ``results`` holds the ranks that returned."""

    def __init__(self, message: str, errors: dict, results: dict):
        super().__init__(message)
        self.errors, self.results = errors, results


_TIMEOUT_WORDS = ("timed out", "timeout", "time out")


def comm_error(exc: BaseException, *, phase: str, step: int | None, world: int, op: str, peer: int | None,
               what: str, started: float, timeout: timedelta | None) -> RingCommError:
    """The error to raise when waiting on a transfer raised ``exc``: names the phase, step, peer and time."""
    elapsed = time.perf_counter() - started
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    timed_out = any(w in text.lower() for w in _TIMEOUT_WORDS) or (
        timeout is not None and elapsed >= 0.9 * timeout.total_seconds())
    where = f"step {step} of {world}" if step is not None else "the check of the shards"
    who = f"{'from' if op == 'recv' else 'to'} rank {peer}" if peer is not None else "over the group"
    why = "did not complete in time" if timed_out else "failed"
    hint = ("a rank did not call ring_attention (or its backward), or it failed or was stopped"
            if timed_out else "the peer failed, was stopped, or a transfer before this one timed out")
    cls = RingTimeout if timed_out else RingCommError
    return cls(f"ring_attention {phase}, {where}: {op} of {what} {who} {why} after {elapsed:.1f} s ({hint}); "
               f"the backend said: {text}", phase=phase, step=step, op=op, peer=peer)


# --------------------------------------------------------------------------- the check before the ring


_MAX_BYTES = 4096     # one rank's description, JSON, padded: the all-gather moves W times this


def describe(error: BaseException | None, tensors: dict, config: dict) -> dict:
    """This rank's description: its own argument error (if any), the shards' shapes, dtypes, devices and
    contiguity, and the arguments every rank must share."""
    info = {"error": None if error is None else [type(error).__name__, str(error)[:1500]], "config": config}
    for name, t in tensors.items():
        shape = getattr(t, "shape", None)
        info[name] = dict(shape=None if shape is None else [int(s) for s in shape], dtype=str(getattr(t, "dtype", "")),
                          device=str(getattr(getattr(t, "device", None), "type", "")),
                          contiguous=bool(t.is_contiguous()) if hasattr(t, "is_contiguous") else None)
    return info


def _encode(info: dict) -> bytes:
    raw = json.dumps(info, sort_keys=True).encode()
    if len(raw) > _MAX_BYTES - 8:
        if info.get("error"):
            info = dict(info, error=[info["error"][0], info["error"][1][:200]])
        raw = json.dumps(info, sort_keys=True).encode()[:_MAX_BYTES - 8]
    return len(raw).to_bytes(8, "little") + raw


def _decode(buf: bytes) -> dict:
    n = int.from_bytes(buf[:8], "little")
    try:
        return json.loads(buf[8:8 + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"error": ["ValueError", "its description of its arguments did not fit the check's message"]}


def agree(info: dict, *, group, world: int, device, timeout: timedelta | None) -> list[dict]:
    """Every rank's :func:`describe` dict, in rank order: one all-gather of fixed-size byte tensors (on
    ``device``, which NCCL needs to be a CUDA device), waited for with ``timeout``."""
    import torch
    import torch.distributed as dist

    if world == 1:
        return [info]
    raw = _encode(info)
    mine = torch.zeros(_MAX_BYTES, dtype=torch.uint8)
    mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    mine = mine.to(device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    started = time.perf_counter()
    try:
        work = dist.all_gather(parts, mine, group=group, async_op=True)
        work.wait() if timeout is None else work.wait(timeout=timeout)
    except RuntimeError as exc:
        raise comm_error(exc, phase="check", step=None, world=world, op="all_gather", peer=None,
                         what="every rank's shard shapes and arguments", started=started, timeout=timeout) from exc
    return [_decode(bytes(p.cpu().numpy().tobytes())) for p in parts]


_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "NotImplementedError": NotImplementedError}


def check_agreement(infos: list[dict]) -> None:
    """Raise, identically on every rank, the first problem of the table ``infos`` (rank order): a rank's own
    argument error, then shapes, dtypes, devices and arguments that differ between ranks."""
    W = len(infos)
    for r, info in enumerate(infos):
        if info.get("error"):
            kind, message = info["error"]
            raise _ERRORS.get(kind, ValueError)(f"ring_attention on rank {r} of {W}: {message}")
    first = infos[0]
    for name in ("q", "k", "v"):
        for what in ("shape", "dtype", "device"):
            for r, info in enumerate(infos[1:], start=1):
                if info[name][what] != first[name][what]:
                    tail = (" (every rank holds N/W tokens of the same batch, heads and head dim)"
                            if what == "shape" else "")
                    raise (ValueError if what != "dtype" else TypeError)(
                        f"ring_attention: the shards differ across ranks: {name} has {what} "
                        f"{_show(first[name][what])} on rank 0 but {_show(info[name][what])} on rank {r}{tail}")
    for r, info in enumerate(infos[1:], start=1):
        for key in sorted(first["config"]):
            a, b = first["config"][key], info["config"].get(key)
            if a != b:
                raise ValueError(f"ring_attention: {key} differs across ranks: {a!r} on rank 0 but {b!r} on rank {r} "
                                 "(every rank must pass the same arguments)")


def _show(x):
    return tuple(x) if isinstance(x, list) else x
