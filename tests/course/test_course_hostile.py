"""Grades an instructor can trust: the static screen refuses every hostile submission of
tests/course/course_hostile.py and none of the legitimate code (solutions, catalogued bugs, student helpers); behind it,
with the screen turned off, the integrity check, the authenticated channel, the bundle check and the process
reaping each stop what they are meant to, while the submissions graded after the attackers keep their scores;
the process limits score 0 what they stop and the batch goes on; ``--jobs`` changes nothing but the time; the
Gradescope autograder runs on a folder laid out the way Gradescope lays it out.

(Every hostile submission is also graded, with the screen, on every assignment by tests/test_course_a*.py.)"""

import csv
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import course_hostile
import nbformat
import pytest

from flashnb.course import bugs as course_bugs
from flashnb.course import build, grade, grammar, screen

ROOT = Path(__file__).resolve().parents[2]

# A small assignment with the setup of the real ones (flashnb, NumPy, the grader's modules in reach), so that
# every hostile entry applies, and tests cheap enough to grade a dozen submissions in seconds.
TINY = '''# %% [markdown]
# # Tiny: hostile submissions
# %% tags=["setup"]
import math  # noqa: F401
import os

os.environ.setdefault("FLASHNB_DEVICE", "sim")
import flashnb  # noqa: E402,I001
import numpy as np
from numba import cuda, float32  # noqa: F401

from flashnb import course, registry, softmax  # noqa: F401
from flashnb.course import criteria
# %% tags=["answer"]
def scale(x):
    ### BEGIN SOLUTION multiply by 2
    return 2 * x
    ### END SOLUTION
# %% tags=["tests"]
@course.test("q1", points=1, name="an array", timeout=20)
def _(ns):
    criteria.close(ns["scale"](np.arange(4.0)), 2 * np.arange(4.0), what="y")
@course.test("q1", points=2, name="a number", timeout=20)
def _(ns):
    criteria.numeric(ns["scale"](21), 42, what="scale(21)")
# %% tags=["hidden-tests"]
@course.test("q1", points=4, name="hidden", timeout=20)
def _(ns):
    criteria.close(ns["scale"](np.ones(3)), np.full(3, 2.0), what="y")
'''

# Limits: each test of this one calls f(x) with its own x, so that a submission can misbehave in one test.
LIMITED = '''# %% [markdown]
# # Tiny: limits
# %% tags=["setup"]
import os

os.environ.setdefault("FLASHNB_DEVICE", "sim")
import flashnb  # noqa: F401,E402,I001
import numpy as np  # noqa: F401
from flashnb import course
# %% tags=["answer"]
def f(x):
    ### BEGIN SOLUTION add one
    return x + 1
    ### END SOLUTION
# %% tags=["tests"]
@course.test("q1", points=1, name="one", timeout=20)
def _(ns):
    assert ns["f"](1) == 2
@course.test("q1", points=1, name="two", timeout=20)
def _(ns):
    assert ns["f"](2) == 3
@course.test("q1", points=1, name="three", timeout=20)
def _(ns):
    assert ns["f"](3) == 4
@course.test("q1", points=1, name="four", timeout=20)
def _(ns):
    assert ns["f"](4) == 5
@course.test("q1", points=1, name="five", timeout=20)
def _(ns):
    assert ns["f"](5) == 6
'''

# Realistic student code: helpers, NumPy, classes, caches, self-checks -- the screen must refuse none of it.
STUDENT_HELPERS = [
    '''import numpy as np
from functools import lru_cache
from itertools import product
from collections import defaultdict
import math


def ref_softmax(x):
    """My float64 softmax, to check my kernel against."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
    s = e.sum(axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


_x = np.random.default_rng(0).normal(size=(4, 8))
assert np.allclose(ref_softmax(_x).sum(-1), 1.0)
np.testing.assert_allclose(ref_softmax(_x)[0].sum(), 1.0, rtol=1e-12)
counts = defaultdict(int)
for i, j in product(range(3), range(2)):
    counts[i] += j
cache = {}
cache["tiles"] = [(i, j) for i in range(2) for j in range(2) if i <= j]
cache["tiles"].append((9, 9))
order = sorted(cache, key=lambda k: len(k))
print(f"debug: {len(order)} keys, {math.isclose(0.1 + 0.2, 0.3)}")


@lru_cache(maxsize=None)
def tiles(N, B):
    return (N + B - 1) // B


if __name__ == "__main__":
    print(tiles(100, 32))
''',
    '''from dataclasses import dataclass
from typing import Optional


@dataclass
class Tile:
    Br: int
    Bc: int
    note: Optional[str] = None

    def count(self, N: int) -> int:
        return -(-N // self.Br)


class Meter:
    def __init__(self):
        self._n = 0
        self.history = []

    def __repr__(self):
        return f"Meter({self._n})"

    def add(self, k):
        self._n += k
        self.history.append(k)
        return self


m = Meter().add(3)
t = Tile(64, 32)
total = 0


def bump():
    global total
    total += t.count(1000)
    return total


try:
    ratio = 1 / 0
except ZeroDivisionError:
    ratio = float("inf")
if (n := len(m.history)) > 0:
    print(n, getattr(t, "Br", None), hasattr(t, "Bc"), type(t).__name__)
''',
    '''from numba import cuda, float32, int32
from flashnb.common import NEG_INF, ZERO, ONE, to_device, empty
from flashnb.stages.fa2 import geometry
import flashnb
import numpy as np
import math


@cuda.jit(device=True, inline="always")
def my_max(a, b):
    return a if a > b else b


def make_kernel(TPB):
    """A factory with a closure, a nested device function and shared/local arrays."""
    half = TPB // 2

    @cuda.jit(device=True)
    def fold(m, x):
        return my_max(m, x)

    @cuda.jit
    def row_max(X, M):
        s = cuda.shared.array(TPB, float32)
        loc = cuda.local.array(2, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        m = NEG_INF
        for j in range(tid, X.shape[1], cuda.blockDim.x):
            m = fold(m, X[row, j])
        loc[0] = m
        s[tid] = loc[0]
        cuda.syncthreads()
        off = half
        while off > 0:
            if tid < off:
                s[tid] = my_max(s[tid], s[tid + off])
            cuda.syncthreads()
            off //= 2
        if tid == 0:
            M[row] = s[0] * ONE + ZERO
            cuda.atomic.add(M, row, np.float32(0))
        v = cuda.shfl_down_sync(0xFFFFFFFF, m, 1)
        if v != v:
            M[row] = float32(math.exp(ZERO))

    return row_max


x = np.random.default_rng(1).normal(size=(2, 64)).astype(np.float32)
out = empty(2)
flashnb.common.launch(make_kernel(32), 2, 32, to_device(x), out, label="row max")
got = out.copy_to_host()
want = x.max(axis=1)
assert np.allclose(got, want), (got, want)
q = np.random.default_rng(2).normal(size=(1, 8, 4))
o, lse = flashnb.reference.attention_forward(q, q, q)
g = geometry(16, 16, 16, 2)
print(g["TM"], o.shape, int32(3))
''',
    '''N, d, Br, Bc = 1024, 64, 64, 32
Tr, Tc = N // Br, N // Bc
kv_bytes = 2 * Tc * Bc * d * 4 * Tr
ratio = (2 * N * d) / (2 * Tr * Tc * Bc * d)
answers = {"kv": kv_bytes, "ratio": round(ratio, 4)}
answers.update(extra=1)
import statistics, heapq, bisect, random
random.seed(0)
print(statistics.mean([1, 2, 3]), heapq.nsmallest(2, [3, 1, 2]), bisect.bisect([1, 3], 2), random.random())
''',
]


TINY_SETUP = TINY.split('# %% tags=["setup"]\n', 1)[1].split("# %%", 1)[0]

# Answers written otherwise than the solutions, all inside the grammar: helpers in other cells and outside the
# factory, module constants, another kernel structure, a launcher; and self-checks the grader never runs.
UNUSUAL_ANSWERS = [
    ["""from numba import cuda, float32, int32
from flashnb.common import NEG_INF, ZERO, ONE, cdiv, launch
import math

TPB_DEFAULT = 2 * 16


@cuda.jit(device=True, inline="always")
def my_max(a, b):
    return a if a > b else b
""",
     """def make_kernel(TPB):
    \"\"\"A factory: a kernel that reads its helper from another cell.\"\"\"
    half = TPB // 2

    @cuda.jit(device=True)
    def fold(m, x):
        return my_max(m, x)

    @cuda.jit
    def row_max(X, M):
        s = cuda.shared.array(TPB, float32)
        loc = cuda.local.array(2, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        m = NEG_INF
        for j in range(tid, X.shape[1], cuda.blockDim.x):
            m = fold(m, X[row, j])
        loc[0] = m
        s[tid] = loc[0]
        cuda.syncthreads()
        off = half
        while off > 0:
            if tid < off:
                s[tid] = my_max(s[tid], s[tid + off])
            cuda.syncthreads()
            off //= 2
        if tid == 0:
            M[row] = s[0] * ONE + ZERO
            cuda.atomic.add(M, row, float32(0))
        v = cuda.shfl_down_sync(0xFFFFFFFF, m, 1)
        if v != v:
            M[row] = float32(math.exp(ZERO))

    return row_max


def launch_rows(X, M, TPB=32):
    rows, n = X.shape
    grid = (cdiv(rows, 1), 1)
    launch(make_kernel(TPB), grid, TPB, X, M, label=f"row max of {n}")


print("trying make_kernel(32)", make_kernel(32))
assert TPB_DEFAULT == 32, "constants"
"""],
    ["""N, d, Br, Bc, warps, window = 1024, 64, 64, 32, 4, 4
Tr, Tc = N // Br, N // Bc
visited = sum(min(window + 1, 2 * I + 2) for I in range(Tr))
kv_bytes = 2 * visited * Bc * d * 4
ratio = round((2 * N * d) / (2 * Tr * Tc * Bc * d), 4)
tiles = 0
for I in range(Tr):
    if I > 0:
        tiles += min(window + 1, 2 * I + 2)
blocks = math.ceil(N / Bc)
"""],
]

# Ways out of the grammar, by class: each snippet must be refused.
GRAMMAR_ESCAPES = {
    "rebinding a builtin": ["exec = print\n", "exec = exec\n", "try:\n    pass\nexcept Exception as exec:\n    pass\n",
                            "def f():\n    e = eval\n    return e('1')\n", "for open in range(3):\n    pass\n"],
    "strings through getattr": ["def f(x):\n    return getattr(x, '__cl' + 'ass__')\n",
                                "def f(x):\n    return vars(x)\n",
                                "def f(x):\n    return '{0.__class__}'.format(x)\n", "x = f'{().__class__}'\n"],
    "__builtins__": ["def f():\n    return __builtins__['open']\n", "b = __builtins__\n",
                     "def f():\n    return __import__('os')\n"],
    "class hierarchies": ["def f():\n    return ().__class__.__base__.__subclasses__()\n", "class A:\n    pass\n",
                          "def f(x):\n    return type(x)\n"],
    "decorators": ["@print\ndef f():\n    pass\n", "def d(f):\n    return f\n@d\ndef g():\n    pass\n",
                   "@cuda.jit(device=eval('True'))\ndef k():\n    pass\n"],
    "default arguments": ["def f(x=open('/etc/passwd')):\n    return x\n", "def f(x=[].append):\n    return x\n",
                          "def f(x=(lambda: 0)):\n    return x\n"],
    "compile and codecs": ["import codecs\n", "def f():\n    return compile('1', 'x', 'eval')\n", "import importlib\n",
                           "from numba import njit\n", "def f(s):\n    return s.encode('rot13')\n"],
    "the grader's state": ["import gc\n", "import sys\n", "def f():\n    return course.TESTS\n",
                           "def f(g):\n    return g.gi_frame\n", "def f():\n    return criteria\n",
                           "from flashnb.common import launch_hooks\n", "from flashnb import course\n",
                           "def f(x):\n    return x.__globals__\n", "def f():\n    return os\n"],
    "files and processes": ["def f():\n    return open('/proc/1/cmdline')\n", "import os\n", "import subprocess\n",
                            "with open('x') as f:\n    pass\n"],
    "computing on the host": ["def launcher(Q, O):\n    O[0, 0] = Q[0, 0]\n",
                              "def launcher(Q):\n    q = Q\n    return q[0]\n",
                              "def f(Q):\n    return Q.copy_to_host()\n",
                              "@cuda.jit\ndef k(X, Y):\n    Y[0] = X[0].sum()\n",
                              "def f(q):\n    return np.exp(q)\n",
                              "def f(q, k, v):\n    return reference.attention_forward(q, k, v)\n",
                              "from flashnb.reference import attention_forward\n",
                              "from flashnb.common import load_rows\ndef launcher(Q, O):\n"
                              "    load_rows(Q, O, 0, 0)\n",
                              "@cuda.jit(device=True)\ndef mine(Q, O):\n    O[0] = Q[0]\n"
                              "def launcher(Q, O):\n    mine(Q, O)\n"],
}


def _answers(nb) -> list[str]:
    return [grade._code(c["source"]) for c in nb.cells if c["cell_type"] == "code"
            and "answer" in c["metadata"].get("tags", [])]


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Every assignment's release (only built: nothing graded)."""
    tmp = tmp_path_factory.mktemp("releases")
    out = {}
    for m in sorted((ROOT / "assignments").glob("*/master.py")):
        build.build(m, tmp / m.parent.name)
        out[m.parent.name] = tmp / m.parent.name
    return out


def test_grammar_accepts_every_solution_bug_release_and_unusual_answer(releases):
    """The legitimate code: every solution, every catalogued bug, every untouched release, and answers written
    otherwise (helpers in other cells, constants, another kernel structure, self-checks the grader does not run)."""
    checked = 0
    for name, rel in releases.items():
        solution = nbformat.read(str(rel / "autograder" / "solution.ipynb"), as_version=4)
        setup = (rel / "autograder" / "setup.py").read_text()
        notebooks = [solution, nbformat.read(str(rel / "student" / f"{name}.ipynb"), as_version=4)]
        notebooks += [b.apply(solution) for b in course_bugs.load(ROOT / "assignments" / name)]
        for nb in notebooks:
            found, _, _ = grammar.check(_answers(nb), setup)
            assert found == [], (name, [str(f) for f in found])
            assert screen.screen(_answers(nb)) == [], name
            checked += 1
    for cells in UNUSUAL_ANSWERS:
        found, runnable, dropped = grammar.check(cells, TINY_SETUP)
        assert found == [], [str(f) for f in found]
        assert screen.screen(runnable) == [], [str(f) for f in screen.screen(runnable)]
    _, runnable, dropped = grammar.check(UNUSUAL_ANSWERS[0], TINY_SETUP)
    n = len(UNUSUAL_ANSWERS[0][1].splitlines())
    assert dropped == [(2, n - 1), (2, n)] and "print" not in runnable[1] and "make_kernel(TPB)" in runnable[1]
    assert len(runnable[1].splitlines()) == len(UNUSUAL_ANSWERS[0][1].splitlines())     # lines keep their numbers
    _, runnable, dropped = grammar.check(UNUSUAL_ANSWERS[1], TINY_SETUP)      # constants computed by a loop: run
    assert dropped == [] and runnable[0] == UNUSUAL_ANSWERS[1][0]
    ns: dict = {"math": __import__("math")}
    exec(compile(runnable[0], "<constants>", "exec"), ns)
    assert ns["tiles"] == sum(min(4 + 1, 2 * i + 2) for i in range(1, 16)) and ns["blocks"] == 32
    assert checked >= 40


def test_grammar_refuses_what_answers_never_need():
    """Student code that was fine under a deny-list (NumPy on the host, classes, other modules) is outside the
    grammar: refused, with the cell, the line and the rule."""
    for helper in STUDENT_HELPERS:
        found, _, _ = grammar.check([helper], TINY_SETUP)
        assert found and all(f.cell == 1 and f.line >= 1 and f.why for f in found), helper[:80]


def test_grammar_refuses_every_escape_by_class():
    for kind, snippets in GRAMMAR_ESCAPES.items():
        for code in snippets:
            found, _, _ = grammar.check([code], TINY_SETUP)
            assert found, (kind, code)


def test_grammar_refuses_every_hostile_submission_and_names_the_line(releases):
    rel = releases["a1_online_softmax"]
    setup = (rel / "autograder" / "setup.py").read_text()
    for h in course_hostile.HOSTILE:
        nb = course_hostile.notebook(h, "a1_online_softmax", rel, rel / "autograder")
        found, _, _ = grammar.check(_answers(nb), setup)
        assert found, h.kind
        text = "\n".join(str(f) for f in found)
        assert h.says in text, (h.kind, text)
        cell1 = _answers(nb)[0].splitlines()
        first = found[0]
        assert first.cell in (1, 3) and first.line >= 1, str(first)      # the edit is in cell 1 (cell 3: the kernel)
        if first.cell == 1:
            assert first.line > len(cell1) - len(h.code.splitlines()) - 1, (h.kind, str(first))


def test_screen_messages_and_rules():
    f = screen.screen(["import numpy as np\nx = 1\nnp.abs = abs\n"])
    assert len(f) == 1 and f[0].line == 3 and "np.abs" in f[0].what and "an answer changes only" in f[0].why
    alias = screen.screen(["import flashnb\nh = flashnb.common\nh.NEG_INF = 0\n"])
    assert alias and "belongs to h" in alias[0].why
    assert screen.screen(["def k(X):\n    return X.copy()\n"]) == []            # host code: NumPy is fine
    kern = screen.screen(["from numba import cuda\n@cuda.jit\ndef k(X, Y):\n    Y[0] = X.sum()\n"])
    assert kern and kern[0].line == 4 and "a kernel is CUDA Python" in kern[0].why
    host_call = screen.screen(["from numba import cuda\ndef h(X):\n    return X.max()\n"
                               "@cuda.jit\ndef k(X, Y):\n    Y[0] = h(X)\n"])
    assert host_call and "not @cuda.jit(device=True)" in host_call[0].why
    assert screen.screen(["x = getattr(1, 'real')\n"]) == []
    assert screen.screen(["n = 'real'\nx = getattr(1, n)\n"])
    assert screen.screen(["C = type('C', (), {})\n"])
    assert screen.screen(["class A:\n    def __eq__(self, o):\n        return True\n"])
    assert screen.screen(["from numba import njit\n"]) and screen.screen(["import numba\n"])
    assert screen.screen(["from flashnb import traffic\n"]) and screen.screen(["from flashnb.course import criteria\n"])
    assert screen.screen(["import numpy as np\nnp.save('x.npy', np.ones(2))\n"])


def _sub(path, body):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(body, metadata={"tags": ["answer"]})]
    nbformat.write(nb, str(path))


def _tiny(tmp_path, text=TINY, name="tiny"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "master.py").write_text(text)
    build.build(tmp_path / name / "master.py", tmp_path / f"rel_{name}")
    return tmp_path / f"rel_{name}"


def _orphans() -> list[int]:
    out = []
    for d in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if d.name.isdigit():
            try:
                if b"987.654" in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


#: one attack per layer behind the screen in the default run (in the sandbox); every deep entry with -m slow, and
#: every entry that may run outside the sandbox without it
DEEP_IN_CI = ("patch-run-one", "forge-channel", "rewrite-tests", "site-packages-pth", "kill-batch", "double-fork",
              "disk-flood")


def _site_pth() -> list[Path]:
    import site

    return [Path(d) / "zz_flashnb_hostile.pth" for d in site.getsitepackages() if (Path(d) / "zz_flashnb_hostile.pth")
            .exists()]


def _deep(tmp_path, monkeypatch, kinds, *, sandbox=True):
    """Grade the hostile ``kinds`` on TINY with the screen off (two at a time: a change of the bundle is traced
    back to its submission), before a correct submission and the untouched release; every attacker must score 0
    with its layer's message, the two after it keep 7/7 and 0/7, and nothing outside its sandbox changed: the
    bundle, the other submissions, site-packages, the feedback files and the CSV; no process of it is left."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))      # never the machine's caches
    monkeypatch.setenv("GRADER_SECRET_TOKEN", "must-not-reach-the-child")
    rel = _tiny(tmp_path)
    bundle = rel / "autograder"
    before = {n: (bundle / n).read_bytes() for n in os.listdir(bundle)}
    subs = tmp_path / "subs"
    subs.mkdir()
    out = tmp_path / "out"
    made = {}
    for k, h in enumerate(course_hostile.HOSTILE, 1):
        wanted = h.deep if sandbox else h.bare
        if wanted is not None and h.kind in kinds:
            nbformat.write(course_hostile.notebook(h, "tiny", rel, bundle, subs=subs, out=out),
                           str(subs / f"h{k:02d}.ipynb"))
            made[f"h{k:02d}"] = (h, wanted)
    assert made
    _sub(subs / "zz_good.ipynb", "def scale(x):\n    return x * 2\n")
    nbformat.write(nbformat.read(str(rel / "student" / "tiny.ipynb"), as_version=4), str(subs / "zz_untouched.ipynb"))
    env_probe = ("import os\ndef scale(x):\n    raise AssertionError('ENV ' + repr([os.environ.get(k) for k in "
                 "('HOME', 'TMPDIR', 'XDG_CACHE_HOME', 'FLASHNB_PTX_CACHE', 'FLASHNB_COURSE_CACHE', "
                 "'GRADER_SECRET_TOKEN')] + [os.getcwd()]))\n")
    _sub(subs / "zz_env.ipynb", env_probe)
    victims = {p.name: p.read_bytes() for p in subs.iterdir() if p.name.startswith("zz_")}
    lines = []
    graded = {g["student"]: g for g in grade.grade(bundle, subs, out / "scores.csv", screen=False, sandbox=sandbox,
                                                   work_dir=tmp_path / "work", progress=lines.append, jobs=2,
                                                   limits=grade.Limits(scratch_mib=16))}
    leaked = _site_pth()
    for p in leaked:
        p.unlink()
    assert leaked == [], leaked                                            # site-packages untouched
    for stem, (h, wanted) in made.items():
        g = graded[stem]
        text = "\n".join(g["problems"] + [r["message"] for r in g["results"]])
        assert sum(r["earned"] for r in g["results"]) == 0, (h.kind, text[:600])
        assert wanted in text, (h.kind, wanted, text[:600])
    assert sum(r["earned"] for r in graded["zz_good"]["results"]) == 7, graded["zz_good"]["results"]
    assert sum(r["earned"] for r in graded["zz_untouched"]["results"]) == 0
    assert {n: (bundle / n).read_bytes() for n in os.listdir(bundle)} == before      # unchanged (or restored)
    assert {n: (subs / n).read_bytes() for n in victims} == victims                   # the others' notebooks
    assert _orphans() == []
    rows = {r["student"]: r for r in csv.DictReader(open(out / "scores.csv"))}
    assert set(rows) == set(graded) and float(rows["zz_good"]["autograded"]) == 7
    assert {r["sandboxed"] for r in rows.values()} == {"yes" if sandbox else "no"}
    for name in graded:                                                    # every feedback file, whole
        text = (out / "feedback" / f"{name}.txt").read_text()
        assert text.rstrip().endswith("CPU-seconds)"), (name, text[-200:])
        assert ("without the operating-system sandbox" in text) is (not sandbox), name
    msg = graded["zz_env"]["results"][0]["message"]
    values = json.loads(msg.split("ENV ", 1)[1].splitlines()[0].replace("'", '"').replace("None", "null"))
    assert values[5] is None, values                                       # the grader's environment stays out
    scratch = "/tmp/" if sandbox else str(tmp_path / "work" / "zz_env" / "sub-")
    assert all(v.startswith(scratch) for v in values[:5] + values[6:]), values
    assert [ln.split(":")[0] for ln in lines] == sorted(graded)            # progress in the students' order
    return graded


def test_layers_behind_the_screen_stop_each_attack_and_spare_the_others(tmp_path, monkeypatch):
    _deep(tmp_path, monkeypatch, DEEP_IN_CI)


@pytest.mark.slow
def test_every_deep_attack_is_stopped_behind_the_screen(tmp_path, monkeypatch):
    _deep(tmp_path, monkeypatch, {h.kind for h in course_hostile.HOSTILE})


@pytest.mark.slow
def test_without_the_sandbox_the_layers_inside_the_grader_still_hold(tmp_path, monkeypatch):
    """``--no-sandbox``: the integrity check, the channel, the bundle check and the reaping on their own (the
    entries that would reach the machine itself -- site-packages, other submissions -- are never run so)."""
    _deep(tmp_path, monkeypatch, {h.kind for h in course_hostile.HOSTILE}, sandbox=False)


def test_limits_score_what_they_stop_and_the_batch_goes_on(tmp_path):
    rel = _tiny(tmp_path, LIMITED, "limited")
    subs = tmp_path / "subs"
    subs.mkdir()
    _sub(subs / "a_limits.ipynb", "import numpy as np\ndef f(x):\n    if x == 2:\n        np.ones(1 << 30)\n"
         "    if x == 3:\n        print('x' * (3 << 20))\n    if x == 4:\n        raise SystemExit(0)\n"
         "    return x + 1\n")
    _sub(subs / "b_burn.ipynb", "def f(x):\n    while x == 2:\n        pass\n    return x + 1\n")
    _sub(subs / "c_good.ipynb", "def f(x):\n    return x + 1\n")
    limits = grade.Limits(cpu_s=4.0, output_mib=1)   # a child starts in about 1 CPU-s
    res = {g["student"]: {r["id"].split(": ")[1]: r for r in g["results"]}
           for g in grade.grade(rel / "autograder", subs, tmp_path / "scores.csv", limits=limits, screen=False,
                                progress=lambda *_: None)}       # the limits behind the grammar (it refuses np.ones)
    lim = res["a_limits"]
    assert [r["earned"] for r in lim.values()] == [1, 0, 0, 0, 1], {k: r["message"] for k, r in lim.items()}
    assert lim["two"]["status"] == "limit" and "memory limit" in lim["two"]["message"]
    assert lim["three"]["status"] == "output" and "more than 1 MiB" in lim["three"]["message"]
    assert lim["four"]["status"] == "error" and "SystemExit" in lim["four"]["message"]
    burn = res["b_burn"]
    assert [r["earned"] for r in burn.values()] == [1, 0, 0, 0, 0]
    assert burn["two"]["status"] == "cpu" and "CPU limit" in burn["two"]["message"]
    assert burn["three"]["status"] == "limit" and "CPU-seconds" in burn["three"]["message"]
    assert [r["earned"] for r in res["c_good"].values()] == [1] * 5


def test_jobs_change_nothing_but_the_time(tmp_path, capsys):
    from flashnb import cli

    rel = _tiny(tmp_path)
    subs = tmp_path / "subs"
    subs.mkdir()
    _sub(subs / "d_good.ipynb", "def scale(x):\n    return 2 * x\n")
    _sub(subs / "c_half.ipynb", "def scale(x):\n    return x + x if isinstance(x, int) else x\n")
    _sub(subs / "b_refused.ipynb", "import os\ndef scale(x):\n    return 2 * x\n")
    _sub(subs / "a_broken.ipynb", "def scale(x)\n    return 2 * x\n")
    rows, lines = {}, {}
    for jobs in (1, 3):
        lines[jobs] = []
        if jobs == 1:
            grade.grade(rel / "autograder", subs, tmp_path / f"j{jobs}" / "scores.csv", progress=lines[jobs].append)
        else:                                   # the command line, as an instructor runs it
            assert cli.main(["course", "grade", str(rel / "autograder"), str(subs), "--out",
                             str(tmp_path / f"j{jobs}" / "scores.csv"), "--jobs", str(jobs)]) == 0
            lines[jobs] = [ln for ln in capsys.readouterr().out.splitlines() if ln.split(":")[0] in
                           ("a_broken", "b_refused", "c_half", "d_good")]
        rows[jobs] = [{k: v for k, v in r.items() if k not in ("cpu_seconds", "wall_seconds")}
                      for r in csv.DictReader(open(tmp_path / f"j{jobs}" / "scores.csv"))]
        feedback = sorted(p.name for p in (tmp_path / f"j{jobs}" / "feedback").iterdir())
        assert feedback == ["a_broken.txt", "b_refused.txt", "c_half.txt", "d_good.txt"]
    assert rows[1] == rows[3]
    assert [r["student"] for r in rows[3]] == ["a_broken", "b_refused", "c_half", "d_good"]
    assert [float(r["autograded"]) for r in rows[3]] == [0, 0, 2, 7]
    assert [ln.split(":")[0] for ln in lines[3]] == ["a_broken", "b_refused", "c_half", "d_good"]
    assert cli.main(["course", "grade", str(rel / "autograder"), str(subs), "--jobs", "0"]) == 2


def test_a_bundle_changed_since_its_release_is_refused(tmp_path):
    rel = _tiny(tmp_path)
    grade.Bundle(rel / "autograder")
    tests = rel / "autograder" / "tests.py"
    tests.write_text(tests.read_text() + "\n# changed\n")
    with pytest.raises(grade.BundleError, match="does not match the hash"):
        grade.Bundle(rel / "autograder")
    (rel / "autograder" / "hashes.json").unlink()
    with pytest.raises(grade.BundleError, match="no hashes.json"):
        grade.Bundle(rel / "autograder")


def test_gradescope_autograder_runs_on_a_submission_laid_out_as_gradescope_does(tmp_path):
    from flashnb import cli

    rel = _tiny(tmp_path)
    assert cli.main(["course", "gradescope", str(rel / "autograder"), "--out", str(tmp_path / "autograder.zip"),
                     "--install", "flashnb[course]==0.1.0"]) == 0
    root = tmp_path / "autograder"                       # Gradescope: /autograder/{source,submission,results}
    with zipfile.ZipFile(tmp_path / "autograder.zip") as z:
        names = sorted(z.namelist())
        assert names == ["bundle/hashes.json", "bundle/manifest.json", "bundle/setup.py", "bundle/tests.py",
                         "run_autograder", "setup.sh"]                # no solution.ipynb
        z.extractall(root / "source")
        for n in ("run_autograder", "setup.sh"):
            os.chmod(root / "source" / n, (z.getinfo(n).external_attr >> 16) & 0o777)
    assert "flashnb[course]==0.1.0" in (root / "source" / "setup.sh").read_text()
    (root / "submission").mkdir(parents=True)
    _sub(root / "submission" / "tiny_jane.ipynb", "def scale(x):\n    return x * 2 if isinstance(x, int) else x\n")
    (root / "run_autograder").write_bytes((root / "source" / "run_autograder").read_bytes())   # as Gradescope does
    os.chmod(root / "run_autograder", 0o755)
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), FLASHNB_PYTHON=sys.executable)
    proc = subprocess.run([str(root / "run_autograder")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((root / "results" / "results.json").read_text())
    tests = {t["name"]: t for t in out["tests"]}
    assert list(tests) == ["q1: an array", "q1: a number", "q1: hidden"]
    assert [(t["score"], t["max_score"]) for t in tests.values()] == [(0, 1), (2, 2), (0, 4)]
    assert [t["visibility"] for t in tests.values()] == ["visible", "visible", "after_published"]
    assert "differ from the float64 reference" in tests["q1: an array"]["output"]
    assert tests["q1: a number"]["output"] == "passed" and out["stdout_visibility"] == "hidden"
    text = (root / "results" / "results.json").read_text()
    tests_py = (rel / "autograder" / "tests.py").read_text()
    assert not [ln for ln in tests_py.splitlines() if ln.strip().startswith("criteria.") and ln.strip() in text]
    assert not list((root / "results").glob(".*.tmp"))                   # written whole, through a temporary file


def test_nothing_of_the_tests_reaches_the_feedback(tmp_path):
    """A test's line never appears in feedback (the tests are not in linecache, and only the student's frames are
    named), and in a hidden test an exception out of the student's code keeps its text to itself: the student's
    code cannot carry the hidden inputs out in its message, nor read the tests' lines (graded with the screen off,
    in the sandbox)."""
    rel = _tiny(tmp_path)
    subs = tmp_path / "subs"
    subs.mkdir()
    _sub(subs / "a_not_callable.ipynb", "scale = 3\n")
    _sub(subs / "b_value.ipynb", "def scale(x):\n    raise ValueError('LEAK ' + repr(x))\n")
    _sub(subs / "c_assert.ipynb", "def scale(x):\n    raise AssertionError('LEAK ' + repr(x))\n")
    _sub(subs / "d_reader.ipynb", "import linecache, traceback\n"
         "def scale(x):\n    raise ValueError('LEAK ' + repr(linecache.getlines('<tests>')) + "
         "''.join(traceback.format_stack()))\n")
    graded = {g["student"]: g for g in grade.grade(rel / "autograder", subs, tmp_path / "out" / "scores.csv",
                                                   screen=False, progress=lambda *_: None)}
    tests_text = (rel / "autograder" / "tests.py").read_text()
    test_lines = [ln.strip() for ln in tests_text.splitlines() if ln.strip().startswith(("criteria.", "assert "))]
    assert test_lines
    for name, g in graded.items():
        text = (tmp_path / "out" / "feedback" / f"{name}.txt").read_text()
        assert not any(ln in text for ln in test_lines), (name, text)
        hidden = next(r for r in g["results"] if r["hidden"])
        assert hidden["earned"] == 0 and "1., 1., 1." not in hidden["message"], (name, hidden["message"])
    public = {name: g["results"][0]["message"] for name, g in graded.items()}
    assert "not callable" in public["a_not_callable"] and "at <" not in public["a_not_callable"]
    assert "LEAK array([0., 1., 2., 3.])" in public["b_value"]            # public inputs: the message stays
    assert "at <answer cell 1>, line 2" in public["b_value"]
    assert "LEAK []" in public["d_reader"]                                  # linecache never held the tests
    hidden_b = next(r for r in graded["b_value"]["results"] if r["hidden"])["message"]
    assert hidden_b.startswith("ValueError raised in your code during a hidden test"), hidden_b


# A launcher assignment: run(X, Y) launches a kernel that writes Y = 2 X.
CAPTURE = '''# %% [markdown]
# # Tiny: a launcher
# %% tags=["setup"]
import os

os.environ.setdefault("FLASHNB_DEVICE", "sim")
import flashnb  # noqa: E402,I001
import numpy as np
from numba import cuda, float32  # noqa: F401
from flashnb import course
from flashnb.common import launch  # noqa: F401
from flashnb.course import criteria
# %% tags=["answer"]
def make_double():
    @cuda.jit
    def double(X, Y):
        i = cuda.grid(1)
        ### BEGIN SOLUTION write Y = 2 X
        if i < Y.shape[0]:
            Y[i] = 2 * X[i]
        ### END SOLUTION
    return double


def run(X, Y):
    launch(make_double(), 1, 32, X, Y, label="double")


@cuda.jit(device=True)
def twice(x):
    ### BEGIN SOLUTION return 2 x
    return 2 * x
    ### END SOLUTION
# %% tags=["tests"]
@course.test("q1", points=1, name="doubles", timeout=60)
def _(ns):
    x = np.arange(32, dtype=np.float32)
    X, Y = flashnb.common.to_device(x), flashnb.common.empty(32)
    ns["run"](X, Y)
    criteria.close(Y.copy_to_host(), 2.0 * x, what="y")


def _apply(f):
    @cuda.jit
    def apply(X, Y):
        i = cuda.grid(1)
        if i < Y.shape[0]:
            Y[i] = f(X[i])
    return apply


@course.test("q2", points=1, name="twice, in a kernel of the tests", timeout=60)
def _(ns):
    x = np.arange(32, dtype=np.float32)
    X, Y = flashnb.common.to_device(x), flashnb.common.empty(32)
    flashnb.common.launch(_apply(ns["twice"]), 1, 32, X, Y, label="twice")
    criteria.close(Y.copy_to_host(), 2.0 * x, what="y")
'''


def test_a_kernel_that_reads_an_array_it_was_not_given_fails(tmp_path):
    """The grammar lets host code pass a device array to a factory (it cannot tell an array from a tile size), so
    the kernel would read it uncounted: the grader's launch hook finds the captured array and fails the test; the
    kernel given the same array as an argument passes.  Likewise a "device function" written as plain Python,
    which the simulator would run and a GPU could not compile."""
    rel = _tiny(tmp_path, CAPTURE, "capture")
    subs = tmp_path / "subs"
    subs.mkdir()
    head = "from flashnb.common import launch\nfrom numba import cuda\n\n\n"
    _sub(subs / "a_captures.ipynb", head + "def make_double(src):\n    @cuda.jit\n    def double(Y):\n"
         "        i = cuda.grid(1)\n        if i < Y.shape[0]:\n            Y[i] = 2 * src[i]\n    return double\n\n\n"
         "def run(X, Y):\n    launch(make_double(X), 1, 32, Y, label='double')\n\n\n"
         "def twice(x):\n    return x + x\n")
    _sub(subs / "b_argument.ipynb", head + "def make_double():\n    @cuda.jit\n    def double(X, Y):\n"
         "        i = cuda.grid(1)\n        if i < Y.shape[0]:\n            Y[i] = 2 * X[i]\n    return double\n\n\n"
         "def run(X, Y):\n    launch(make_double(), 1, 32, X, Y, label='double')\n\n\n"
         "@cuda.jit(device=True)\ndef twice(x):\n    return x + x\n")
    graded = {g["student"]: g for g in grade.grade(rel / "autograder", subs, tmp_path / "scores.csv",
                                                   progress=lambda *_: None)}
    cap = graded["a_captures"]["results"][0]
    assert cap["earned"] == 0 and "reads src (in double), an array that is not one of its arguments" in \
        cap["message"], cap
    assert graded["a_captures"]["status"] is None                          # the grammar let it through
    py = graded["a_captures"]["results"][1]                                # a plain Python "device function"
    assert py["earned"] == 0 and "the kernel calls twice, a Python function of your answer" in py["message"], py
    assert [r["earned"] for r in graded["b_argument"]["results"]] == [1, 1], graded["b_argument"]["results"]


#: CAPTURE with its answers declared as device code: the grader compiles them before any test runs
VOUCHED = CAPTURE.replace('''# %% tags=["tests"]
@course.test("q1"''', '''# %% tags=["tests"]
course.compiled("make_double", question="q1", kernels=lambda ns: [(ns["make_double"](),
                                                                     "void(float32[::1], float32[::1])")])
course.compiled("twice", question="q2", device=("float32",))


@course.test("q1"''')


def test_what_the_compiler_refuses_scores_zero_before_any_launch(tmp_path):
    """A device function the grammar accepts but NVVM rejects (``int`` of a string: plain Python, which the simulator
    would run) scores 0 on every test of its question before anything launches, with one line naming the function
    and the compiler's first error line; called by the kernel, it takes the kernel's question with it.  A helper
    device function at the top of the cell, called by the kernel, is compiled with it and scores."""
    rel = _tiny(tmp_path, VOUCHED, "vouched")
    subs = tmp_path / "subs"
    subs.mkdir()
    head = "from flashnb.common import launch\nfrom numba import cuda\n\n\n"
    helper = "@cuda.jit(device=True)\ndef helper(x):\n    y = %s\n    return 2 * x\n\n\n"
    kernel = ("def make_double():\n    @cuda.jit\n    def double(X, Y):\n        i = cuda.grid(1)\n"
              "        if i < Y.shape[0]:\n            Y[i] = helper(X[i])\n    return double\n\n\n"
              "def run(X, Y):\n    launch(make_double(), 1, 32, X, Y, label='double')\n\n\n")
    twice = "@cuda.jit(device=True)\ndef twice(x):\n    y = %s\n    return x + x\n"
    _sub(subs / "a_twice.ipynb", head + helper % "x" + kernel + twice % 'int("3")')
    _sub(subs / "b_helper.ipynb", head + helper % 'int("3")' + kernel + twice % "x")
    graded = {g["student"]: g for g in grade.grade(rel / "autograder", subs, tmp_path / "scores.csv",
                                                   progress=lambda *_: None)}
    a, b = graded["a_twice"]["results"], graded["b_helper"]["results"]
    assert [r["earned"] for r in a] == [1, 0] and [r["earned"] for r in b] == [0, 1], (a, b)
    for r, name in ((a[1], "twice"), (b[0], "make_double (its kernel double)")):
        msg = r["message"]
        assert msg.startswith(f"{name} does not compile for a GPU (numba's CUDA compiler): TypingError: ") and \
            "int" in msg and "\n" not in msg and "/" not in msg and r["seconds"] == 0, r


def test_an_answer_device_function_no_kernel_calls_needs_declared_types():
    """Nothing is compiled for it: the assignment must say what to compile it with."""
    import linecache

    from flashnb import course
    from flashnb.course import vouch

    src = "@cuda.jit(device=True)\ndef half(x):\n    return x / 2\n"
    linecache.cache["<answer cell 1>"] = (len(src), None, src.splitlines(True), "<answer cell 1>")
    ns = {"__name__": "__main__"}
    exec("from numba import cuda", ns)
    exec(compile(src, "<answer cell 1>", "exec"), ns)
    got = vouch.vouch(ns, {"half": course.Compiled("half", "q3")})
    assert got == {"q3": "half: a device function no kernel of your answer calls, and the assignment gives no "
                         "types to compile it with"}
    assert vouch.first_error_line("TypingError: Failed in cuda mode pipeline (step: nopython frontend)\n"
                                  "\x1b[1mUnknown attribute 'x' at /home/grader/venv/lib/numba/typing.py\x1b[0m") == \
        "TypingError: Unknown attribute 'x' at typing.py"
