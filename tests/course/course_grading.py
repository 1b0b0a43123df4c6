"""Shared by tests/test_course_a*.py: one assignment released and graded (its solution, its untouched student
notebook, its bugs and every hostile submission of tests/course/course_hostile.py, in one batch: the hostile ones are
graded before the solution and the untouched release), and the checks every assignment must pass.  Each
assignment has its own test file so that pytest-xdist spreads the grading over both CI workers."""

import ast
import csv
import json
import os
from pathlib import Path

import course_hostile
import nbformat
import pytest

from flashnb.course import bugs as course_bugs
from flashnb.course import build, grade

ROOT = Path(__file__).resolve().parents[2]

#: Bugs graded per assignment in the default run (CI): the first BUGS_IN_CI of each bugs.py (one: CI's time budget).
#: Every bug is graded with `pytest -m slow tests/test_course_a*.py` (and by scripts/course_catalogue.py).
BUGS_IN_CI = 1


def graded_assignment(name: str, tmp_path_factory, *, all_bugs: bool = False) -> dict:
    """Build one assignment, write its solution, untouched and bug submissions, grade them all at once."""
    adir = ROOT / "assignments" / name
    tmp = tmp_path_factory.mktemp(name)
    manifest = build.build(adir / "master.py", tmp / "release")
    subs = course_bugs.write_submissions(adir, tmp / "release", tmp / "subs")
    if not all_bugs:
        keep = [stem for stem, bug in subs.items() if bug is not None][:BUGS_IN_CI]
        for stem in [s for s, b in subs.items() if b is not None and s not in keep]:
            os.remove(tmp / "subs" / f"{stem}.ipynb")
            del subs[stem]
    # every hostile submission; the one that runs (memory-hog: the screen passes it, the limits stop it) only
    # with all_bugs (TINY's limits test covers it in the default run)
    kinds = None if all_bugs else {h.kind for h in course_hostile.HOSTILE if h.kind != "memory-hog"}
    hostile = course_hostile.write(name, tmp / "release", tmp / "subs", kinds=kinds, grades=tmp / "out")
    legit = course_hostile.write_legit(name, tmp / "release", tmp / "subs")
    results = grade.grade(tmp / "release" / "autograder", tmp / "subs", tmp / "out" / "scores.csv",
                          progress=lambda *_: None)
    return dict(adir=adir, tmp=tmp, manifest=manifest, subs=subs, hostile=hostile, legit=legit,
                results={g["student"]: g for g in results})


def check_release_holds_no_solution_code(graded):
    tmp = graded["tmp"]
    removed = json.loads((tmp / "release" / "autograder" / "removed.json").read_text())
    assert removed and all(region for region in removed)
    student = tmp / "release" / "student" / f"{graded['adir'].name}.ipynb"
    assert build.solution_leaks(student, tmp / "release" / "autograder" / "solution.ipynb", removed) == []
    nb = nbformat.read(str(student), as_version=4)
    text = "\n".join(c["source"] for c in nb.cells)
    for region in removed:            # every code line of every region, from the master, is gone
        for line in region:
            code = line.split("#")[0].strip()
            if len(code) >= 12:
                assert text.count(code) <= (tmp / "release" / "autograder" / "solution.ipynb").read_text() \
                    .count(json.dumps(code)[1:-1]) - 1, code
    assert "hidden-tests" not in json.dumps([c["metadata"] for c in nb.cells])
    # the answer cells say what to write, with a line count, and parse (a cut that ends on the wrong line leaves
    # the rest of a block behind)
    answers = [c for c in nb.cells if "answer" in c["metadata"].get("tags", [])]
    for c in answers:
        ast.parse(grade._code(c["source"]))
    assert answers and all("TODO" in c["source"] for c in answers)
    assert all("about" in c["source"] for c in answers if "NotImplementedError" in c["source"])


def check_solution_gets_full_marks(graded):
    g = graded["results"]["solution"]
    lost = [(r["id"], r["message"]) for r in g["results"] if not r["earned"] == r["points"]]
    assert lost == [], lost
    assert sum(t["points"] for t in graded["manifest"]["tests"]) == sum(r["earned"] for r in g["results"])


def check_legitimate_variants_get_full_marks(graded):
    """Answers written otherwise than the solution (tests/course/course_hostile.py, LEGIT): full marks."""
    for stem in graded["legit"]:
        g = graded["results"][stem]
        lost = [(r["id"], r["message"][:300]) for r in g["results"] if not r["earned"] == r["points"]]
        assert lost == [], (stem, g["problems"], lost)


def check_untouched_release_gets_zero_and_the_batch_goes_on(graded):
    g = graded["results"]["untouched"]
    assert sum(r["earned"] for r in g["results"]) == 0
    assert all(r["status"] in ("error", "fail", "skipped") for r in g["results"]), g["results"]
    assert any("TODO" in r["message"] for r in g["results"])


def check_each_bug_loses_exactly_its_points(graded):
    bugs = {stem: b for stem, b in graded["subs"].items() if b is not None}
    assert bugs, "no bug submission was graded"
    assert len(course_bugs.load(graded["adir"])) >= 3
    ids = [t["id"] for t in graded["manifest"]["tests"]]
    for stem, bug in bugs.items():
        for t in bug.loses:
            assert t in ids, f"{bug.name}: unknown test {t!r}"
        got = {r["id"]: r for r in graded["results"][stem]["results"]}
        lost = sorted(t for t, r in got.items() if r["earned"] != r["points"])
        assert lost == sorted(bug.loses), (bug.name, lost, {t: got[t]["message"] for t in lost})
        first = next(got[t] for t in ids if t in bug.loses)
        assert bug.says in first["message"], (bug.name, first["message"])


def check_scores_csv_and_feedback(graded):
    out = graded["tmp"] / "out"
    rows = {r["student"]: r for r in csv.DictReader(open(out / "scores.csv"))}
    assert set(rows) == set(graded["subs"]) | set(graded["hostile"]) | set(graded["legit"])
    assert float(rows["solution"]["autograded"]) == float(rows["solution"]["possible"]) > 0
    assert float(rows["untouched"]["autograded"]) == 0
    text = (out / "feedback" / "untouched.txt").read_text()
    assert "TODO" in text and "autograded: 0/" in text


def check_hostile_submissions_score_zero(graded):
    """Every hostile submission scores 0 with the message that names what stopped it (graded before the
    solution and the untouched release, which still score full marks and 0: checked above).  The default run
    grades all but memory-hog, which the screen lets run (``-m slow`` grades it too)."""
    assert len(graded["hostile"]) >= 10
    for stem, h in graded["hostile"].items():
        g = graded["results"][stem]
        got = sum(r["earned"] for r in g["results"])
        text = "\n".join(g["problems"] + [r["message"] for r in g["results"]])
        assert got == 0, (h.kind, got, text[:500])
        assert h.says in text, (h.kind, h.says, text[:800])
        assert g["cpu_s"] <= 30, (h.kind, g["cpu_s"])       # refused before it runs, or stopped at once


def install_tests(namespace: dict, name: str) -> None:
    """Define, in a test module's ``namespace``, the module-scoped ``graded`` fixture of assignment ``name`` and
    its tests (the default run grades the first BUGS_IN_CI bugs; the ``slow`` test grades every one)."""

    @pytest.fixture(scope="module")
    def graded(tmp_path_factory):
        return graded_assignment(name, tmp_path_factory)

    def test_release_holds_no_solution_code(graded):
        check_release_holds_no_solution_code(graded)

    def test_solution_gets_full_marks(graded):
        check_solution_gets_full_marks(graded)

    def test_legitimate_variants_get_full_marks(graded):
        check_legitimate_variants_get_full_marks(graded)

    def test_untouched_release_gets_zero(graded):
        check_untouched_release_gets_zero_and_the_batch_goes_on(graded)

    def test_bugs_lose_exactly_their_points(graded):
        check_each_bug_loses_exactly_its_points(graded)

    def test_scores_csv_and_feedback(graded):
        check_scores_csv_and_feedback(graded)

    def test_hostile_submissions_score_zero(graded):
        check_hostile_submissions_score_zero(graded)

    @pytest.mark.slow
    def test_every_bug_loses_exactly_its_points(tmp_path_factory):
        everything = graded_assignment(name, tmp_path_factory, all_bugs=True)
        check_each_bug_loses_exactly_its_points(everything)
        check_hostile_submissions_score_zero(everything)

    namespace.update({k: v for k, v in locals().items() if k == "graded" or k.startswith("test_")})
