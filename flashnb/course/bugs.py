"""Realistic wrong submissions, made from an assignment's solution by small edits, with the points each must
lose and what the grader must say.  ``assignments/<name>/bugs.py`` lists them as ``BUGS``; the test suite
grades every one (``tests/course/test_course.py``) and ``scripts/course_catalogue.py`` writes the TA catalogue
(``assignments/CATALOGUE.md``) from what the grader printed."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path


@dataclass
class Bug:
    """One wrong submission: the solution with an edit made in one answer cell.

    The edit is ``replace`` ([(old, new)]) made inside region ``region`` of that cell (:mod:`flashnb.regions`:
    the markers a library kernel carries, which the solution cell keeps), each ``old`` occurring there exactly
    once -- an entry ``(region, old, new)`` names its own region, for a bug that edits two places; and/or
    ``regions`` ({region: new lines}: whole bodies replaced, as :func:`flashnb.registry.variant` does); and/or
    ``append``, code added at the end of the cell.  A cell with marked regions is edited only
    through a region, so reformatting the kernel outside its regions keeps every bug applying; ``region=None``
    edits a cell without markers (the master's own answer code), each ``old`` once in the whole cell."""

    name: str                       # what a student did wrong, in a few words
    _: KW_ONLY
    cell: int                       # which answer cell (1-based, in notebook order) the edit is in
    loses: list                     # ids of the tests that must score 0 ("q2: IO budget: ..."); all others full
    says: str                       # a substring of the first lost test's message
    region: str | None = None       # the region of that cell the replacements are made in
    replace: list = field(default_factory=list)   # [(old, new) or (region, old, new)]: old once in the region
    regions: dict = field(default_factory=dict)   # {region: new lines}: whole bodies replaced (before replace)
    append: str = ""                # code appended to the cell (e.g. an import that rebinds the answer's name)
    why: str = ""                   # for the catalogue: what the message means and how to fix it
    tags: list = field(default_factory=list)

    def apply(self, solution_nb):
        """A copy of ``solution_nb`` (nbformat) with the edit made; ValueError if an ``old`` is not unique in its
        region (or cell), or the cell has marked regions and the bug names none."""
        from .. import regions

        nb = copy.deepcopy(solution_nb)
        answers = [c for c in nb.cells if c["cell_type"] == "code" and "answer" in c["metadata"].get("tags", [])]
        cell = answers[self.cell - 1]
        where = f"answer cell {self.cell}"
        if not self.replace and not self.regions and not self.append:
            raise ValueError(f"bug {self.name!r}: no edit (give replace=, regions= or append=)")
        try:
            marked = regions.names(cell["source"], where)
        except regions.RegionError as e:
            raise ValueError(f"bug {self.name!r}: {e}") from None
        for region, new_body in self.regions.items():
            try:
                cell["source"] = regions.replace_body(cell["source"], region, new_body, where)
            except regions.RegionError as e:
                raise ValueError(f"bug {self.name!r}: {e}") from None
        edits = [(self.region, *e) if len(e) == 2 else tuple(e) for e in self.replace]
        if any(r is None for r, _, _ in edits) and marked:
            raise ValueError(f"bug {self.name!r}: {where} has marked regions ({', '.join(marked)}): name the one "
                             "the edit is in (region=...)")
        for region, old, new in edits:
            if region is not None:
                try:
                    cell["source"] = regions.replace_in(cell["source"], region, old, new, where)
                except regions.RegionError as e:
                    raise ValueError(f"bug {self.name!r}: {e}") from None
                continue
            n = cell["source"].count(old)
            if n != 1:
                raise ValueError(f"bug {self.name!r}: {old!r} occurs {n} times in answer cell {self.cell}")
            cell["source"] = cell["source"].replace(old, new)
        if self.append:
            cell["source"] = cell["source"].rstrip("\n") + "\n\n" + self.append.strip("\n") + "\n"
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
