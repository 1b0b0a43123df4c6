"""Exercises that check themselves: every notebook exercise has an id (``"03.2"``: notebook 03, exercise 2),
a level and a time tag, a check the learner runs, and a worked answer kept out of the way.

In a notebook::

    answer = ...                               # your answer here (``...`` means "not attempted yet")
    exercises.check("03.2", tiles_above=answer)
    # -> "exercise 03.2: not attempted yet" / "✓ exercise 03.2 ..." / "✗ exercise 03.2: <what is wrong>"

``exercises.hint("03.2")`` prints a hint, ``exercises.answer("03.2")`` the worked answer (prose and the code
that solves it); ``exercises.catalogue()`` lists every exercise.  :func:`check` returns True/False and
prints; ``strict=True`` raises :class:`Wrong` instead (for tests and graders).

Checks are written against independent ground truth -- the float64 reference, the traffic counter, the
race checker, numbers derived from the papers' formulas -- never against the learner's own output.  Each
exercise also ships its solution as code (``Exercise.solution``), and ``tests/exercises/test_exercises.py`` checks
that every solution passes its check and that typical wrong answers do not.
"""

from __future__ import annotations

import importlib
import inspect
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["check", "hint", "answer", "catalogue", "exercise", "Wrong", "Exercise", "EXERCISES", "close",
           "require", "require_kernel", "require_traffic", "require_gpu_ready"]

LEVELS = {1: "★", 2: "★★", 3: "★★★"}
NOTEBOOKS = ("00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12", "13")


class Wrong(AssertionError):
    """An answer that does not pass its exercise's check; the message says what to look at."""


@dataclass
class Exercise:
    """One exercise: ``check(**answers)`` raises :class:`Wrong` when an answer is wrong."""

    id: str
    title: str
    level: int
    minutes: int
    check: Callable[..., Any]
    hint: str = ""
    explain: str = ""
    solution: Callable[[], dict] | None = None
    wrong: list = field(default_factory=list)    # callables returning answers that must fail (for tests)
    signatures: dict = field(default_factory=dict)   # answer name -> launch signature of a kernel answer

    @property
    def tag(self) -> str:
        return f"{LEVELS[self.level]} ~{self.minutes} min"

    def solves(self, fn):
        """Decorator: ``fn()`` returns the answers (a dict of keyword arguments) that solve this exercise."""
        self.solution = fn
        return fn

    def fails(self, fn):
        """Decorator: ``fn()`` returns answers that are wrong in a typical way (tests check they fail)."""
        self.wrong.append(fn)
        return fn


EXERCISES: dict[str, Exercise] = {}


def exercise(id: str, title: str, *, level: int, minutes: int, hint: str = "", explain: str = "",
             signatures: dict | None = None):
    """Register the decorated function as the check of exercise ``id``; returns the :class:`Exercise`.

    ``signatures`` maps each answer that is a kernel to the Numba signature the check launches it with: the
    kernels of the worked solution and of the wrong answers go through the PTX guard with it
    (``tests/exercises/test_exercises.py``), like every kernel in the package."""
    if level not in LEVELS:
        raise ValueError(f"level must be 1, 2 or 3, got {level!r}")

    def decorate(fn):
        if id in EXERCISES:
            raise ValueError(f"exercise {id!r} defined twice")
        # cleandoc, not dedent: the text starts on the line of the opening quotes, unindented
        ex = Exercise(id, title, level, minutes, fn, inspect.cleandoc(hint), inspect.cleandoc(explain),
                      signatures=dict(signatures or {}))
        EXERCISES[id] = ex
        return ex

    return decorate


def _load(id: str) -> Exercise:
    if not isinstance(id, str) or len(id.split(".")) != 2:
        raise ValueError(f"id must look like '03.2' (notebook 03, exercise 2), got {id!r}")
    nb = id.split(".")[0]
    if nb in NOTEBOOKS:
        importlib.import_module(f"{__name__}.nb{nb}")
    if id not in EXERCISES:
        known = ", ".join(sorted(EXERCISES)) or "none"
        raise ValueError(f"no exercise {id!r} (loaded: {known})")
    return EXERCISES[id]


def _load_all():
    for nb in NOTEBOOKS:
        try:
            importlib.import_module(f"{__name__}.nb{nb}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.nb{nb}":
                raise


def check(id: str, *positional, strict: bool = False, **answers) -> bool:
    """Check the answers to exercise ``id``: keyword arguments, as the notebook cell names them
    (``check("03.2", answer=answer)``), or positional ones in that order (``check("03.2", answer)``).

    An answer left as ``...`` means "not attempted yet": nothing is checked.  Prints the verdict and returns
    True when every answer is right; ``strict=True`` raises :class:`Wrong` instead of printing a failure.
    """
    ex = _load(id)
    head = f"exercise {id} ({ex.title}, {ex.tag})"
    if positional:
        names = list(inspect.signature(ex.check).parameters)
        if len(positional) > len(names):
            raise TypeError(f"exercise {id} takes {len(names)} answer(s), {names}, got {len(positional)} positional "
                            f"answers: pass them by name, e.g. exercises.check({id!r}, {names[0]}=...)")
        twice = sorted(set(names[:len(positional)]) & set(answers))
        if twice:
            raise TypeError(f"exercise {id}: answer(s) {twice} given both by position and by name")
        answers = {**dict(zip(names, positional)), **answers}
    if any(v is ... for v in answers.values()) or not answers:
        missing = [k for k, v in answers.items() if v is ...]
        print(f"{head}: not attempted yet -- fill in {', '.join(missing) or 'your answer'} and run this cell again")
        return False
    expected = list(inspect.signature(ex.check).parameters)
    unknown = sorted(set(answers) - set(expected))
    if unknown:
        raise TypeError(f"exercise {id} takes {expected}, got unknown {unknown}")
    try:
        message = ex.check(**answers)
    except Wrong as e:
        if strict:
            raise Wrong(f"{head}: {e}") from None
        print(f"✗ {head}: {e}")
        if ex.hint:
            print(f"  hint: exercises.hint({id!r})")
        return False
    print(f"✓ {head}: right" + (f" -- {message}" if message else ""))
    return True


def hint(id: str) -> None:
    """Print the hint of exercise ``id``."""
    ex = _load(id)
    print(ex.hint or f"exercise {id} has no hint; exercises.answer({id!r}) shows the worked answer")


def answer(id: str) -> None:
    """Print the worked answer of exercise ``id``: the explanation and the code that solves it."""
    ex = _load(id)
    print(f"exercise {id}: {ex.title} ({ex.tag})\n")
    if ex.explain:
        print(ex.explain + "\n")
    if ex.solution is not None:
        print(textwrap.dedent(inspect.getsource(ex.solution)))


def catalogue() -> list[dict]:
    """Every exercise: id, title, level tag, minutes."""
    _load_all()
    return [dict(id=e.id, title=e.title, level=LEVELS[e.level], minutes=e.minutes)
            for e in sorted(EXERCISES.values(), key=lambda e: tuple(int(x) for x in e.id.split(".")))]


# --------------------------------------------------------------------------- helpers for checks


def require(condition: bool, message: str) -> None:
    """Raise :class:`Wrong` with ``message`` unless ``condition``."""
    if not condition:
        raise Wrong(message)


def close(value, expected, *, rel: float = 0.0, abs: float = 0.0, what: str = "your answer") -> None:
    """Raise :class:`Wrong` unless ``value`` is within ``rel``/``abs`` of ``expected`` (not revealing it)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise Wrong(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(v) or not math.isclose(v, expected, rel_tol=rel, abs_tol=abs):
        direction = "too large" if v > expected else "too small"
        raise Wrong(f"{what} = {value!r} is {direction}")


def require_kernel(kernel, arguments: str) -> None:
    """Raise :class:`Wrong` unless ``kernel`` is a ``@cuda.jit`` kernel (on a GPU or on the simulator)."""
    require(hasattr(kernel, "py_func") or type(kernel).__name__ == "FakeCUDAKernel",
            f"kernel must be a @cuda.jit kernel ({arguments})")


def require_traffic(launch, model: dict, what: str, why) -> None:
    """Raise :class:`Wrong` unless the counted ``launch`` (a :class:`flashnb.instruments.traffic.LaunchTraffic`) reads
    and writes each array exactly as ``model`` says (``{"reads": {array: elements}, "writes": {...}}``);
    ``why(kind, name, counted, expected)`` says what to look at."""
    for kind, arrays in model.items():
        seen = getattr(launch, kind)
        for name, want in arrays.items():
            n = seen.get(name, 0)
            if n != want:
                raise Wrong(f"at {what}, your kernel {kind} {name} {n} times, FA2's model says {want}: "
                            f"{why(kind, name, n, want)}")


def require_gpu_ready(kernel, run, signature: str, hint: str) -> None:
    """Raise :class:`Wrong` unless ``run()`` (one launch of ``kernel``) is clean under the four sanitizer tools
    and ``kernel`` compiles for sm_80 and sm_90 with no problem the PTX guard knows (float64, spills, shared
    memory beyond 48 KiB); ``hint`` names the usual causes of a sanitizer finding."""
    from .. import instruments as fi
    from .. import sim

    with sim.sanitize(raise_on_error=False) as report:
        run()
    require(not report, f"the sanitizer found errors ({hint}):\n{report}")
    problems = [p for r in fi.resources_of([(kernel, signature, cc) for cc in ((8, 0), (9, 0))], keep_ptx=False)
                for p in fi.problems(r)]
    require(not problems, "compiled for a GPU, your kernel has problems:\n" + "\n".join(problems))
