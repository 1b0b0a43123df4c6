"""Realistic wrong submissions, made from an assignment's solution by small edits, with the points each must
lose and what the grader must say.  ``assignments/<name>/bugs.py`` lists them as ``BUGS``; the test suite
grades every one (``tests/course/test_course.py``) and ``scripts/course_catalogue.py`` writes the TA catalogue
(``assignments/CATALOGUE.md``) from what the grader printed."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Bug:
    name: str                       # what a student did wrong, in a few words
    cell: int                       # which answer cell (1-based, in notebook order) the edit is in
    replace: list                   # [(old, new)]: each old occurs exactly once in that cell of the solution
    loses: list                     # ids of the tests that must score 0 ("q2: IO budget: ..."); all others full
    says: str                       # a substring of the first lost test's message
    why: str = ""                   # for the catalogue: what the message means and how to fix it
    tags: list = field(default_factory=list)

    def apply(self, solution_nb):
        """A copy of ``solution_nb`` (nbformat) with the edit made; ValueError if an ``old`` is not unique."""
        nb = copy.deepcopy(solution_nb)
        answers = [c for c in nb.cells if c["cell_type"] == "code" and "answer" in c["metadata"].get("tags", [])]
        cell = answers[self.cell - 1]
        for old, new in self.replace:
            n = cell["source"].count(old)
            if n != 1:
                raise ValueError(f"bug {self.name!r}: {old!r} occurs {n} times in answer cell {self.cell}")
            cell["source"] = cell["source"].replace(old, new)
        return nb


def load(assignment_dir) -> list[Bug]:
    """``BUGS`` of ``assignment_dir/bugs.py``."""
    path = Path(assignment_dir) / "bugs.py"
    spec = importlib.util.spec_from_file_location(f"flashnb_course_bugs_{Path(assignment_dir).name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.BUGS)


def write_submissions(assignment_dir, release_dir, out_dir) -> dict:
    """Write ``solution.ipynb``, ``untouched.ipynb`` and one notebook per bug into ``out_dir``; returns
    ``{stem: Bug or None}``."""
    import nbformat

    name = Path(assignment_dir).name
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    solution = nbformat.read(str(Path(release_dir) / "autograder" / "solution.ipynb"), as_version=4)
    nbformat.write(solution, str(out_dir / "solution.ipynb"))
    student = nbformat.read(str(Path(release_dir) / "student" / f"{name}.ipynb"), as_version=4)
    nbformat.write(student, str(out_dir / "untouched.ipynb"))
    made: dict = {"solution": None, "untouched": None}
    for k, bug in enumerate(load(assignment_dir), 1):
        stem = f"bug{k:02d}"
        nbformat.write(bug.apply(solution), str(out_dir / f"{stem}.ipynb"))
        made[stem] = bug
    return made
