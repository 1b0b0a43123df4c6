"""The course kit's machinery: a submission that hangs, crashes, deadlocks or does not parse is scored and the
batch goes on; the released notebook works in a Jupyter kernel.  Each assignment is verified by its own
tests/test_course_a*.py (see tests/course/course_grading.py)."""

from pathlib import Path

import nbformat
import pytest

from flashnb.course import build, grade

ROOT = Path(__file__).resolve().parents[2]


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
@course.test("q1", points=1, name="first", timeout=4)
def _(ns):
    assert ns["add_one"](1) == 2, "add_one(1) should be 2"
@course.test("q1", points=2, name="second", timeout=4)
def _(ns):
    assert ns["add_one"](41) == 42, "add_one(41) should be 42"
@course.test("q1", points=4, name="third", timeout=4)
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
    # kills the process on the second test (the screen refuses `os`: graded with the screen off, below)
    crash = "import os\ndef add_one(x):\n    if x == 41:\n        os._exit(3)\n    return x + 1\n"
    (tmp_path / "unscreened").mkdir()
    _submission(tmp_path / "unscreened" / "crash.ipynb", crash)
    _submission(subs / "crash_screened.ipynb", crash)
    # a kernel whose barrier only half the threads reach (the simulator reports the deadlock)
    # (its host code makes an array, which the answer grammar refuses: graded with the screen off, too)
    _submission(tmp_path / "unscreened" / "deadlock.ipynb", "from numba import cuda\n@cuda.jit\ndef k(a):\n"
                "    if cuda.threadIdx.x < 8:\n        cuda.syncthreads()\n    else:\n"
                "        cuda.syncwarp(0xFFFFFFFF)\n    a[cuda.threadIdx.x] = 1\n"
                "def add_one(x):\n    a = flashnb.common.to_device(np.zeros(32, np.float32))\n"
                "    k[1, 32](a)\n    return x + 1\n")
    _submission(subs / "syntax.ipynb", "def add_one(x)\n    return x + 1\n")
    res = {g["student"]: {r["id"].split(": ")[1]: r for r in g["results"]}
           for g in grade.grade(tmp_path / "rel" / "autograder", subs, tmp_path / "scores.csv",
                                progress=lambda *_: None)
           + grade.grade(tmp_path / "rel" / "autograder", tmp_path / "unscreened", tmp_path / "unscreened.csv",
                         progress=lambda *_: None, screen=False)}
    assert [r["status"] for r in res["crash_screened"].values()] == ["refused"] * 3
    assert "refused" in res["crash_screened"]["first"]["message"]
    refused = (tmp_path / "feedback" / "crash_screened.txt").read_text()
    assert "answer cell 1, line 1: `import os` -- imports os" in refused, refused
    assert [r["earned"] for r in res["good"].values()] == [1, 2, 4]
    assert [r["earned"] for r in res["hang"].values()] == [1, 0, 4]
    assert res["hang"]["second"]["status"] == "timeout" and "stopped after 4 s" in res["hang"]["second"]["message"]
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


def test_release_with_an_install_cell_for_colab(tmp_path):
    build.build(ROOT / "assignments" / "a1_online_softmax" / "master.py", tmp_path / "rel",
                install="flashnb[course] @ git+https://example.invalid/flashnb")
    nb = nbformat.read(str(tmp_path / "rel" / "student" / "a1_online_softmax.ipynb"), as_version=4)
    first = next(c for c in nb.cells if c["cell_type"] == "code")
    assert "find_spec(\"flashnb\") is None" in first["source"] and "example.invalid" in first["source"]
    ns: dict = {}
    exec(compile(first["source"], "<install cell>", "exec"), ns)   # flashnb is installed here: it does nothing
    assert "answer" not in first["metadata"].get("tags", []) and "setup" not in first["metadata"].get("tags", [])


def test_compile_verdicts_are_cached_by_kernel_source_and_never_reused_for_a_changed_kernel(tmp_path, monkeypatch):
    import linecache

    from numba import cuda  # noqa: F401  (the cells below use it)

    from flashnb import instruments as fi
    from flashnb.course import Fail, criteria

    calls = []
    real = fi.resources_of
    monkeypatch.setattr(fi, "resources_of", lambda jobs, **kw: calls.append(len(jobs)) or real(jobs, **kw))
    monkeypatch.setenv("FLASHNB_COURSE_CACHE", str(tmp_path / "cache"))

    def cell(name, body):
        src = f"from numba import cuda, float32\n@cuda.jit\ndef k(x):\n    x[0] = {body}\n"
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        ns: dict = {}
        exec(compile(src, name, "exec"), ns)
        return ns["k"]

    sig = "void(float32[::1])"
    criteria.compiles([(cell("<answer cell A>", "x[0] * float32(2)"), sig)])
    criteria.compiles([(cell("<answer cell B>", "x[0] * float32(2)"), sig)])     # the same source text: cached
    assert calls == [2]
    with pytest.raises(Fail, match="float64"):                                   # one character changed
        criteria.compiles([(cell("<answer cell A>", "x[0] * 0.1"), sig)])
    assert calls == [2, 2]
    with pytest.raises(Fail, match="float64"):                                   # its verdict is cached too
        criteria.compiles([(cell("<answer cell C>", "x[0] * 0.1"), sig)])
    assert calls == [2, 2]
