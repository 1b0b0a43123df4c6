"""The course kit, honestly verified: for every assignment the release holds no solution code, the master
solution gets full marks, the untouched release gets zero without crashing the grader, and every bug of
``assignments/<name>/bugs.py`` loses exactly the points it should, with the message it should."""

import csv
import json
from pathlib import Path

import nbformat
import pytest

from flashnb.course import bugs as course_bugs
from flashnb.course import build, grade

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENTS = sorted(p.parent for p in (ROOT / "assignments").glob("*/master.py"))


@pytest.fixture(scope="module", params=[p.name for p in ASSIGNMENTS])
def graded(request, tmp_path_factory):
    """Build one assignment, write its solution, untouched and bug submissions, grade them all at once."""
    adir = ROOT / "assignments" / request.param
    tmp = tmp_path_factory.mktemp(request.param)
    manifest = build.build(adir / "master.py", tmp / "release")
    subs = course_bugs.write_submissions(adir, tmp / "release", tmp / "subs")
    results = grade.grade(tmp / "release" / "autograder", tmp / "subs", tmp / "out" / "scores.csv",
                          progress=lambda *_: None)
    return dict(adir=adir, tmp=tmp, manifest=manifest, subs=subs, results={g["student"]: g for g in results})


def test_release_holds_no_solution_code(graded):
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
    # the answer cells say what to write, with a line count
    answers = [c for c in nb.cells if "answer" in c["metadata"].get("tags", [])]
    assert answers and all("TODO" in c["source"] for c in answers)
    assert all("about" in c["source"] for c in answers if "NotImplementedError" in c["source"])


def test_solution_gets_full_marks(graded):
    g = graded["results"]["solution"]
    lost = [(r["id"], r["message"]) for r in g["results"] if not r["earned"] == r["points"]]
    assert lost == [], lost
    assert sum(t["points"] for t in graded["manifest"]["tests"]) == sum(r["earned"] for r in g["results"])


def test_untouched_release_gets_zero_and_the_batch_goes_on(graded):
    g = graded["results"]["untouched"]
    assert sum(r["earned"] for r in g["results"]) == 0
    assert all(r["status"] in ("error", "fail", "skipped") for r in g["results"]), g["results"]
    assert any("TODO" in r["message"] for r in g["results"])


def test_each_bug_loses_exactly_its_points(graded):
    bugs = {stem: b for stem, b in graded["subs"].items() if b is not None}
    assert len(bugs) >= 3, "every assignment has at least three realistic wrong submissions"
    ids = [t["id"] for t in graded["manifest"]["tests"]]
    for stem, bug in bugs.items():
        for t in bug.loses:
            assert t in ids, f"{bug.name}: unknown test {t!r}"
        got = {r["id"]: r for r in graded["results"][stem]["results"]}
        lost = sorted(t for t, r in got.items() if r["earned"] != r["points"])
        assert lost == sorted(bug.loses), (bug.name, lost, {t: got[t]["message"] for t in lost})
        first = next(got[t] for t in ids if t in bug.loses)
        assert bug.says in first["message"], (bug.name, first["message"])


def test_scores_csv_and_feedback(graded):
    out = graded["tmp"] / "out"
    rows = {r["student"]: r for r in csv.DictReader(open(out / "scores.csv"))}
    assert set(rows) == set(graded["subs"])
    assert float(rows["solution"]["autograded"]) == float(rows["solution"]["possible"]) > 0
    assert float(rows["untouched"]["autograded"]) == 0
    text = (out / "feedback" / "untouched.txt").read_text()
    assert "TODO" in text and "autograded: 0/" in text


TINY = '''# %% [markdown]
# # Tiny: the grader's safety net
# %% tags=["setup"]
import os
os.environ.setdefault("FLASHNB_DEVICE", "sim")
import numpy as np
from numba import cuda
import flashnb
from flashnb import course
# %% tags=["answer"]
def add_one(x):
    ### BEGIN SOLUTION return x + 1
    return x + 1
    ### END SOLUTION
# %% tags=["tests"]
@course.test("q1", points=1, name="first", timeout=8)
def _(ns):
    assert ns["add_one"](1) == 2, "add_one(1) should be 2"
@course.test("q1", points=2, name="second", timeout=8)
def _(ns):
    assert ns["add_one"](41) == 42, "add_one(41) should be 42"
@course.test("q1", points=4, name="third", timeout=8)
def _(ns):
    assert ns["add_one"](-1) == 0, "add_one(-1) should be 0"
'''


def _submission(path, body):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print('scratch cells are not run')\nraise SystemExit"),
                nbformat.v4.new_code_cell(body, metadata={"tags": ["answer"]})]
    nbformat.write(nb, str(path))


def test_hangs_crashes_and_deadlocks_are_scored_and_the_batch_goes_on(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "master.py").write_text(TINY)
    build.build(tmp_path / "tiny" / "master.py", tmp_path / "rel")
    subs = tmp_path / "subs"
    subs.mkdir()
    _submission(subs / "good.ipynb", "def add_one(x):\n    return x + 1  # written differently\n")
    # hangs on the second test only: the third must still be scored
    _submission(subs / "hang.ipynb", "def add_one(x):\n    while x == 41:\n        pass\n    return x + 1\n")
    # kills the process on the second test
    _submission(subs / "crash.ipynb", "import os\ndef add_one(x):\n    if x == 41:\n        os._exit(3)\n"
                "    return x + 1\n")
    # a kernel whose barrier only half the threads reach (the simulator reports the deadlock)
    _submission(subs / "deadlock.ipynb", "from numba import cuda\n@cuda.jit\ndef k(a):\n"
                "    if cuda.threadIdx.x < 8:\n        cuda.syncthreads()\n    else:\n"
                "        cuda.syncwarp(0xFFFFFFFF)\n    a[cuda.threadIdx.x] = 1\n"
                "def add_one(x):\n    a = flashnb.common.to_device(np.zeros(32, np.float32))\n"
                "    k[1, 32](a)\n    return x + 1\n")
    _submission(subs / "syntax.ipynb", "def add_one(x)\n    return x + 1\n")
    res = {g["student"]: {r["id"].split(": ")[1]: r for r in g["results"]}
           for g in grade.grade(tmp_path / "rel" / "autograder", subs, tmp_path / "scores.csv",
                                progress=lambda *_: None)}
    assert [r["earned"] for r in res["good"].values()] == [1, 2, 4]
    assert [r["earned"] for r in res["hang"].values()] == [1, 0, 4]
    assert res["hang"]["second"]["status"] == "timeout" and "stopped after 8 s" in res["hang"]["second"]["message"]
    assert [r["earned"] for r in res["crash"].values()] == [1, 0, 4]
    assert res["crash"]["second"]["status"] == "crash" and "exit code 3" in res["crash"]["second"]["message"]
    assert [r["earned"] for r in res["deadlock"].values()] == [0, 0, 0]
    assert "deadlock" in res["deadlock"]["first"]["message"].lower(), res["deadlock"]["first"]["message"]
    assert [r["earned"] for r in res["syntax"].values()] == [0, 0, 0]
    assert "SyntaxError" in res["syntax"]["first"]["message"]


def test_student_workflow_in_jupyter(tmp_path):
    """The student's view: the released notebook runs top to bottom in a Jupyter kernel (the check cell
    reports the TODOs, it does not crash), and the solution passes every public test there -- where the answer
    cells' source comes from IPython's cell cache, not from a file."""
    import nbclient

    build.build(ROOT / "assignments" / "a1_online_softmax" / "master.py", tmp_path / "rel")
    outputs = {}
    for which, path in (("student", tmp_path / "rel" / "student" / "a1_online_softmax.ipynb"),
                        ("solution", tmp_path / "rel" / "autograder" / "solution.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
        outputs[which] = "".join(o.get("text", "") for c in nb.cells if c["cell_type"] == "code"
                                 for o in c.get("outputs", []))
    assert "public tests: 0/" in outputs["student"] and "NotImplementedError" in outputs["student"]
    public = [ln for ln in outputs["solution"].splitlines() if ln.startswith("public tests:")]
    assert public and public[0].split()[2].split("/")[0] == public[0].split()[2].split("/")[1], public
    assert "✗" not in outputs["solution"]
