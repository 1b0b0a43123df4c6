"""Notebook 13's workers, importable so that :func:`flashnb.distributed.launch.run` can start them in W
processes (a function defined in a notebook cell cannot be sent to another process), and its one wrong
schedule.

* :func:`run_cases` -- :func:`flashnb.distributed.demo.check` for each of a list of cases, in one process
  group (one start-up for many runs).
* :class:`StaleKVRing` -- a ring whose backward keeps computing with the K/V it already holds: it waits for
  every transfer (so nothing hangs and the bytes are right) but does not use what arrived.  The forward is
  the correct one, so ``o`` matches a single device exactly while dQ, dK, dV do not.
"""

from __future__ import annotations

from .demo import check
from .ring import RingSchedule

__all__ = ["run_cases", "StaleKVRing", "SCHEDULE_VARIANTS"]


class StaleKVRing(RingSchedule):
    """A wrong backward: the K/V of each backward step is the one of the step before (never refreshed)."""

    def next_kv(self, phase, transfer, held, rec):
        arrived = self.waited(transfer, rec)
        return held if phase == "backward" else arrived       # the bug: the backward ignores what arrived


SCHEDULE_VARIANTS = {"stale-kv": StaleKVRing}


def run_cases(rank: int, world: int, cases: list) -> list:
    """``[check(rank, world, **case) for case in cases]``; a case's ``"schedule"`` may name a variant of
    :data:`SCHEDULE_VARIANTS` (``"stale-kv"``)."""
    out = []
    for case in cases:
        case = dict(case)
        if isinstance(case.get("schedule"), str):
            case["schedule"] = SCHEDULE_VARIANTS[case["schedule"]]
        out.append(check(rank, world, **case))
    return out
