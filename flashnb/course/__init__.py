"""Graded assignments: one master per assignment, a student release and an autograder made from it.

An assignment is a jupytext notebook ``assignments/<name>/master.py``.  Its cells carry tags:

* ``answer`` -- what the student writes.  A region between ``### BEGIN SOLUTION`` and ``### END SOLUTION``
  is the solution; the release replaces it with a TODO that says how many lines it took.  A cell that is
  one directive, ``# flashnb-course: from flashnb.stages.fa1 import make_forward``, holds the *library's* factory
  (the solution lives where it lives, never copied): the build pastes its source, and each following
  ``# flashnb-course: todo REGION "<hint>"`` cuts the lines of one of its regions (:mod:`flashnb.regions`:
  between ``# region REGION`` and ``# endregion REGION``, or the body of a function it defines) out of the
  release, leaving the markers and a TODO.
* ``tests`` -- public tests (kept in the release: the student runs them with :func:`check`).
* ``hidden-tests`` -- tests only the autograder has (other shapes, the IO budget, ...).
* ``solution-only`` -- cells the release leaves out (worked written answers).

Tests are functions of the answer cells' namespace, registered with :func:`test`::

    @course.test("q1", points=3, name="merge matches float64")
    def _(ns):
        course.criteria.close(ns["merge_state"], ...)

A test passes when it returns; :class:`Fail` (or any ``AssertionError``) carries the message the student
reads.  ``flashnb course release`` builds the student notebooks and the autograder bundles; ``flashnb course
grade`` grades a folder of submitted notebooks into a CSV and one feedback file per student
(``assignments/README.md``).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["test", "manual", "check", "Fail", "Test", "TESTS", "MANUAL", "reset", "run_tests", "Result", "compiled",
           "Compiled", "COMPILED"]


class Fail(AssertionError):
    """A test's verdict with the message a student can act on."""


@dataclass
class Test:
    question: str
    name: str
    points: float
    fn: Callable
    hidden: bool = False
    timeout: float = 120.0     # seconds; the grader stops a test that runs longer
    requires: tuple = ()       # names of tests that must pass first (e.g. correctness before the IO budget)

    @property
    def id(self) -> str:
        return f"{self.question}: {self.name}"


@dataclass
class Result:
    id: str
    question: str
    points: float
    earned: float
    message: str = ""
    hidden: bool = False
    seconds: float = 0.0
    status: str = "pass"      # pass / fail / error / timeout / crash / skipped; a limit: cpu / output / limit;
    #                           the whole submission: refused (screen) / tampered / forged / bundle

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def line(self) -> str:
        mark = "✓" if self.passed else "✗"
        text = f"{mark} [{self.earned:g}/{self.points:g}] {self.id}"
        if self.message and not self.passed:
            text += "\n    " + "\n    ".join(self.message.rstrip().splitlines())
        return text


TESTS: dict[str, Test] = {}
_HIDDEN_DEFAULT = {"value": False}


def reset() -> None:
    """Forget every registered test (the grader does this before loading an assignment's tests)."""
    TESTS.clear()
    MANUAL.clear()
    COMPILED.clear()


@dataclass
class Compiled:
    """An answer name the grader compiles before any test runs (:mod:`flashnb.course.vouch`).  ``kernels(ns)``:
    the ``(kernel, signature)`` pairs the tests launch it as (a factory called with the assignment's configs);
    ``device``: for a device function, the argument types it is compiled with where no kernel calls it."""

    name: str
    question: str
    kernels: Callable | None = None
    device: tuple | None = None


COMPILED: dict[str, Compiled] = {}


def compiled(name: str, *, question: str, kernels: Callable | None = None, device=None) -> None:
    """Declare the answer ``name`` of ``question`` as device code: before any test runs, the grader compiles it
    with numba's CUDA compiler, and what does not compile scores 0 on every test of ``question``.
    ``kernels(ns)`` returns the ``(kernel, signature)`` pairs to compile (a kernel factory called with the configs
    the tests use); ``device`` (argument type names, e.g. ``("float32", "float32")``) compiles a device function
    that none of those kernels calls."""
    COMPILED[name] = Compiled(name, question, kernels, tuple(device) if device is not None else None)


def test(question: str, *, points: float, name: str, hidden: bool | None = None, timeout: float = 120.0,
         requires: tuple | list | str = ()):
    """Register the decorated ``fn(ns)`` as a test of ``question`` worth ``points``.

    ``hidden=None`` takes the cell's kind (``hidden-tests`` cells register hidden tests).  ``requires`` names
    tests (by ``name``, same question or ``"q1: name"``) that must pass before this one is scored: an
    untouched skeleton is trivially race-free and moves no bytes, and must not earn those points."""
    if isinstance(requires, str):
        requires = (requires,)

    def register(fn):
        t = Test(question, name, float(points), fn, _HIDDEN_DEFAULT["value"] if hidden is None else hidden,
                 float(timeout), tuple(resolve(r, question) for r in requires))
        TESTS[t.id] = t
        return fn

    return register


MANUAL: list[dict] = []


def manual(question: str, *, points: float, rubric: str) -> None:
    """A question a person grades (prose): the grader collects the ``answer-prose`` cells and lists the
    points as manual, with this rubric, in the feedback and the CSV."""
    MANUAL[:] = [m for m in MANUAL if m["question"] != question]
    MANUAL.append(dict(question=question, points=float(points), rubric=rubric))


def resolve(requirement: str, question: str) -> str:
    """A ``requires=`` entry as a test id: a registered id as given (``"q1: merge ..."``), else the name of a
    test of the same question (names may contain colons).  An entry that names no registered test is an error
    -- a requirement silently ignored would let an untouched skeleton earn points."""
    for candidate in (requirement, f"{question}: {requirement}"):
        if candidate in TESTS:
            return candidate
    raise ValueError(f"requires={requirement!r} (question {question}) names no test registered before this one; "
                     f"registered: {list(TESTS)}")


#: source names of the grader's own code (the bundle's setup and tests, its warm-up): never a student's lines
_GRADER_SOURCES = ("<setup>", "<tests>", "<grader warm-up>")


def _student_frame(filename: str) -> bool:
    """Is this a frame of the student's code (an answer cell, a notebook cell, their variant of a factory)?"""
    return filename.startswith("<") and filename not in _GRADER_SOURCES and not filename.endswith(
        (" setup>", " tests>"))


def _message(exc: BaseException, hidden: bool = False) -> str:
    """What a student reads for a test that raised ``exc``.  The test's own verdict (an ``AssertionError`` the
    test raised) is given whole; anything else is the exception and the last line of *the student's* code it
    passed through (a cell or a variant, whose file names start with '<'), which is where to look -- never a
    line of the tests.  For a hidden test, an exception that came through the student's code is named by its
    built-in type and that line only: its text could carry the hidden inputs out (``raise ValueError(x)``)."""
    import builtins

    every = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in every if _student_frame(f.filename)]
    where = f"\n    at {frames[-1].filename}, line {frames[-1].lineno}: {frames[-1].line}" if frames else ""
    verdict = isinstance(exc, Fail) and every and not _student_frame(every[-1].filename)
    if hidden and frames and not verdict:
        kind = type(exc).__name__
        kind = kind if getattr(builtins, kind, None) is type(exc) else "an exception"
        return f"{kind} raised in your code during a hidden test (its message is not shown){where}"
    if isinstance(exc, AssertionError) and str(exc):
        return str(exc) + (where if verdict and frames else "")
    return f"{type(exc).__name__}: {exc}{where}"


def run_one(t: Test, ns: dict, done: dict[str, Result]) -> Result:
    """Run one test against ``ns``; ``done`` holds earlier results (for ``requires``)."""
    missing = [r for r in t.requires if r in done and not done[r].passed]
    if missing:
        return Result(t.id, t.question, t.points, 0.0, f"not scored until this passes: {missing[0]}", t.hidden,
                      0.0, "skipped")
    start = time.perf_counter()
    try:
        t.fn(ns)
    except Exception as exc:   # noqa: BLE001 -- every failure of a student's code is a verdict, not a crash
        status = "fail" if isinstance(exc, AssertionError) else "error"
        return Result(t.id, t.question, t.points, 0.0, _message(exc, t.hidden), t.hidden, time.perf_counter() - start,
                      status)
    return Result(t.id, t.question, t.points, t.points, "", t.hidden, time.perf_counter() - start)


def run_tests(ns: dict, *, hidden: bool = True, questions=None, on_result=None) -> list[Result]:
    """Run the registered tests (public ones only with ``hidden=False``) in registration order."""
    done: dict[str, Result] = {}
    out = []
    for t in list(TESTS.values()):
        if (t.hidden and not hidden) or (questions and t.question not in questions):
            continue
        r = run_one(t, ns, done)
        done[t.id] = r
        out.append(r)
        if on_result is not None:
            on_result(r)
    return out


def check(*questions: str, ns: dict | None = None) -> bool:
    """Run the public tests (of ``questions``, default all) against the caller's namespace and print one
    line per test; returns True when all passed.  What a student runs in the assignment notebook."""
    import sys

    if ns is None:
        ns = sys._getframe(1).f_globals
    results = run_tests(ns, hidden=False, questions=set(questions) or None)
    if not results:
        print("no public tests registered yet: run the test cells above first")
        return False
    for r in results:
        print(r.line())
    got, total = sum(r.earned for r in results), sum(r.points for r in results)
    print(f"public tests: {got:g}/{total:g} points (the autograder also runs hidden tests)")
    return all(r.passed for r in results)


@dataclass
class Manifest:
    """What an autograder bundle knows about its assignment (``manifest.json``)."""

    name: str
    title: str
    tests: list = field(default_factory=list)     # [{id, question, points, hidden, timeout}]
    answer_cells: int = 0
    manual: list = field(default_factory=list)     # [{question, points, rubric}] graded by a person
