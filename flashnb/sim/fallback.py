"""When the vectorised simulator cannot run a kernel: the reasons, the one-line note, and undoing a partial run.

Two kinds of trouble, kept strictly apart:

* :class:`Unsupported` -- the *simulator* cannot run this kernel in lockstep (a construct it does not translate,
  no source, a warp operation or barrier that only some of the lanes it needs reach, values of different types
  in different lanes, ...).  The launch is undone (:class:`Undo` restores every array the attempt wrote) and
  re-run by the threads simulator, after one note per kernel and reason (:func:`note`).
* a *kernel* error (an out-of-bounds index, a race, a deadlock, a float exception the NumPy settings make an
  error, ...) is never retried: it is raised as the threads simulator and its tools raise it
  (:class:`KernelFault` carries the exception and the lane that raised it).
"""

from __future__ import annotations

import os
import sys

__all__ = ["Unsupported", "KernelFault", "note", "say", "notes", "Undo", "QUIET"]


class Unsupported(Exception):
    """The vectorised simulator cannot run this kernel (``reason``), at ``where`` (``file:line (function)``)."""

    def __init__(self, reason: str, where: str | None = None):
        super().__init__(reason if where is None else f"{reason} at {where}")
        self.reason = reason
        self.where = where


class KernelFault(Exception):
    """An error of the kernel itself, raised by lane ``lane`` of the chunk (an index into its lanes); the launch
    re-raises ``exc`` with the threads simulator's ``tid=[..] ctaid=[..]:`` prefix (``raw``: as it is, for the
    errors the threads simulator raises outside any thread, e.g. from a warp operation's result)."""

    def __init__(self, exc: BaseException, lane: int, raw: bool = False):
        super().__init__(str(exc))
        self.exc = exc
        self.lane = int(lane)
        self.raw = raw


#: ``FLASHNB_SIM_QUIET=1`` keeps the notes out of stderr (they are still recorded in :func:`notes`).
QUIET = os.environ.get("FLASHNB_SIM_QUIET", "") not in ("", "0")
#: ``FLASHNB_SIM_NOTES=path`` also appends every note to the file ``path`` (e.g. to list the fallbacks of a
#: whole test run).
NOTES_FILE = os.environ.get("FLASHNB_SIM_NOTES", "")

_noted: dict = {}   # (kernel qualified name, reason) -> the note


def note(kernel_name: str, exc: Unsupported) -> str:
    """Say once per (kernel, reason) that ``kernel_name`` runs on the threads simulator, and why (one line on
    stderr); returns the line."""
    return say((kernel_name, exc.reason), f"flashnb.sim: {kernel_name} runs on the threads simulator (the vectorised "
               f"one cannot run it: {exc})")


def say(key, line: str) -> str:
    """Print ``line`` once per ``key`` on stderr (unless :data:`QUIET`) and record it in :func:`notes`."""
    got = _noted.get(key)
    if got is None:
        _noted[key] = got = line
        if not QUIET:
            print(line, file=sys.stderr)
        if NOTES_FILE:
            with open(NOTES_FILE, "a") as f:
                f.write(line + "\n")
    return got


def notes() -> list[str]:
    """Every fallback note of this process so far, oldest first."""
    return list(_noted.values())


class Undo:
    """Copies of the arrays a vectorised launch writes, taken just before its first write to each, so that a launch
    that turns out to need the threads simulator can be undone and re-run from the same memory."""

    def __init__(self):
        self.saved: dict = {}   # id(root ndarray) -> (ndarray, copy)

    def before_write(self, nd) -> None:
        key = id(nd)
        if key not in self.saved:
            self.saved[key] = (nd, nd.copy())

    def restore(self) -> None:
        for nd, copy in self.saved.values():
            nd[...] = copy
        self.saved.clear()
