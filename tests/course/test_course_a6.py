"""Assignment a6_fa2_from_scratch: released with a blank answer cell (no solution code), the solution gets full marks,
the untouched release zero, and its bugs (assignments/a6_fa2_from_scratch/bugs.py) lose exactly their points with
their messages.  The default run grades the first bug; `pytest -m slow` grades every one
(tests/course/course_grading.py)."""

import nbformat
from course_grading import ROOT, install_tests

from flashnb.course import bugs as course_bugs

install_tests(globals(), "a6_fa2_from_scratch")


def test_answer_cell_is_blank(graded):
    """From scratch: the student's one answer cell holds only the TODO -- no line of the solution, and none of
    its comments as hints."""
    student = graded["tmp"] / "release" / "student" / "a6_fa2_from_scratch.ipynb"
    nb = nbformat.read(str(student), as_version=4)
    answers = [c for c in nb.cells if "answer" in c["metadata"].get("tags", [])]
    assert len(answers) == 1
    lines = answers[0]["source"].strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("# TODO: write make_forward") and "about" in lines[0], lines
    assert lines[1].startswith('raise NotImplementedError("TODO: '), lines


def test_bugs_edit_regions_never_layout():
    """Every bug edits the master's answer through a region (markers, or a function by its name) -- a whole body,
    or one expression on one line -- never by text that depends on the lines' layout."""
    bugs = course_bugs.load(ROOT / "assignments" / "a6_fa2_from_scratch")
    assert len(bugs) >= 8
    for b in bugs:
        assert b.regions or b.replace or b.append, b.name
        for edit in b.replace:
            region, old = (b.region, edit[0]) if len(edit) == 2 else edit[:2]
            assert region is not None, b.name
            assert "\n" not in old and old == old.strip(), (b.name, old)
