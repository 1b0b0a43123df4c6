"""Hostile submissions: what a student who wants marks without solving anything (or wants to hurt other
students' grades or the grading machine) might add to an answer cell, with what stops each one.

Each :class:`Hostile` is a few lines appended to an answer cell (the first, unless it says; in a blank cell, before
its TODO's raise) of a base notebook:
the untouched release, unless ``base`` names a bug of ``assignments/<name>/bugs.py`` (or the solution) for an
assignment, so that what the attack gains shows.  ``BUNDLE_PATH``, ``SUBS_PATH`` and ``OUT_PATH`` in the code are
replaced by the bundle's path, the submissions folder and the output folder (the student who knows where the grader
keeps them).  Used by ``tests/course/course_grading.py`` (every entry, every
assignment, with the screen: each scores 0) and ``tests/course/test_course_hostile.py`` (the layers behind the screen,
with it turned off).
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass, field
from pathlib import Path

import nbformat


@dataclass
class Hostile:
    kind: str                 # a short name
    tried: str                # what it tries (for the report and the README's table)
    code: str                 # appended to the first answer cell
    says: str                 # a substring of the grader's message with the screen on
    stops: str                # what stops it: "screen", and the layer behind it ("integrity", "channel", ...)
    deep: str | None = None   # a substring of the message with the screen off, in the sandbox (None: only the screen
    #                           stops it; "": it scores 0 and the checks after the batch show what it did not do)
    bare: str | None = None   # ... with the screen and the sandbox off (None: never run without the sandbox -- it
    #                           would reach the grading machine itself)
    base: dict = field(default_factory=dict)   # {assignment: "solution" | "<bug name prefix>"}; else untouched
    victims: bool = False     # it targets the submissions graded after it
    cell: int = 0             # the answer cell it is appended to (-1: the last, so later cells do not undo it)
    kind_of: str = ""         # its class: grammar, grader-state, others, host-copy, leak-tests, machine


_RUN_ONE = ("lambda t, ns, done: course.Result(t.id, t.question, t.points, t.points, '', t.hidden)")
_PATCH = f"course.run_one = {_RUN_ONE}\n"

HOSTILE = [
    Hostile("patch-run-one", "replaces the grader's function that runs one test (course.run_one) by one that "
            "returns full points", _PATCH, says="assign to names", stops="grammar, integrity",
            deep="run_one replaced", bare="run_one replaced", kind_of="grader-state"),
    Hostile("patch-result", "rebinds course.Result so that every result it builds is a pass",
            "_R = course.Result\n"
            "course.Result = lambda id, question, points, earned, message='', hidden=False, seconds=0.0, "
            "status='pass': _R(id, question, points, points, '', hidden, seconds, 'pass')\n",
            says=".Result is not part of the answer grammar", stops="grammar, integrity", deep="Result replaced",
            bare="Result replaced", kind_of="grader-state"),
    Hostile("patch-criteria", "replaces the compile check (criteria.compiles) by a no-op",
            "criteria.compiles = lambda *a, **k: None\n", says="assign to names",
            stops="grammar, integrity", deep="compiles replaced",
            base={"a1_online_softmax": "float64 literal in the kernel"}, bare="compiles replaced",
            kind_of="grader-state"),
    Hostile("patch-numpy", "replaces numpy.abs, so every |got - want| is 0", "np.abs = np.zeros_like\n",
            says="assign to names", stops="grammar, integrity", deep="abs replaced",
            base={"a1_online_softmax": "merge forgets to rescale d_b"}, bare="abs replaced", kind_of="grader-state"),
    Hostile("patch-reference", "replaces flashnb's float64 reference of the merge (softmax.merge) by the "
            "submission's own wrong formula",
            "def _wrong(a, b):\n"
            "    m = np.maximum(a[0], b[0])\n"
            "    with np.errstate(invalid='ignore'):\n"
            "        return m, np.where(np.isneginf(m), 0.0, a[1] * np.exp(a[0] - m) + b[1])\n"
            "flashnb.stages.softmax.merge = _wrong\n",
            says="host code indexes only shapes", stops="grammar, integrity", deep="merge replaced",
            base={"a1_online_softmax": "merge forgets to rescale d_b"}, bare="merge replaced", kind_of="grader-state"),
    Hostile("patch-traffic", "makes the traffic counter's model check (Traffic.check_model) report no difference",
            "flashnb.instruments.traffic.Traffic.check_model = "
            "lambda self, model, budget=None, raise_on_mismatch=True: []\n",
            says="assign to names", stops="grammar, integrity", deep="check_model replaced",
            base={"a1_online_softmax": "three passes"}, bare="check_model replaced", kind_of="grader-state"),
    Hostile("launch-hook", "appends a hook to flashnb.common.launch_hooks that swallows the kernel's error and "
            "writes the reference answer into the outputs of every 'merge' launch",
            "class _Fix:\n"
            "    def __init__(self, label, args):\n"
            "        self.label, self.args = label, args\n"
            "    def __enter__(self):\n"
            "        return self\n"
            "    def __exit__(self, *exc):\n"
            "        if self.label == 'merge':\n"
            "            ma, da, mb, db = (a.copy_to_host() for a in self.args[:4])\n"
            "            m, d = flashnb.stages.softmax.merge((ma, da), (mb, db))\n"
            "            self.args[4].copy_to_device(m.astype(np.float32))\n"
            "            self.args[5].copy_to_device(d.astype(np.float32))\n"
            "        return True\n"
            "flashnb.common.launch_hooks.append(lambda label, kernel, grid, block, args: _Fix(label, args))\n",
            says="classdef statements are not part of an answer", stops="grammar, integrity",
            deep="launch_hooks changed",
            bare="launch_hooks changed", kind_of="grader-state"),
    Hostile("uncounted-reads", "reads a whole row through NumPy inside a kernel (X[row].max(), X[row].sum()): the "
            "simulator runs it, the traffic counter never sees it (A1: a three-pass softmax passes the two-read IO "
            "budget)",
            "@cuda.jit\n"
            "def _row_sums(X, Y):\n"
            "    Y[cuda.blockIdx.x] = X[cuda.blockIdx.x].sum()      # a whole row through NumPy, never counted\n",
            says=".sum is not part of the answer grammar", stops="grammar", base={"a1_online_softmax": "solution"},
            kind_of="host-copy"),
    Hostile("forge-channel", "writes result records for every test (full points) to the grader's results channel "
            "-- the log file the old grader named on the child's command line, or any open descriptor -- then exits",
            "import sys, os, json\n"
            "try:\n"
            "    _m = json.load(open(os.path.join(BUNDLE_PATH, 'manifest.json')))\n"
            "except OSError:\n"
            "    _m = dict(tests=[dict(id=f'q{_i}', question='q', points=1.0, hidden=False) for _i in range(9)])\n"
            "_r = [dict(event='answers', problems=[])] + [dict(event='result', id=t['id'], question=t['question'], "
            "points=t['points'], earned=t['points'], message='', hidden=t['hidden'], seconds=0.0, status='pass') "
            "for t in _m['tests']] + [dict(event='end')]\n"
            "_text = ''.join(json.dumps(r) + '\\n' for r in _r)\n"
            "if len(sys.argv) > 4 and sys.argv[1] == '--child':\n"
            "    open(sys.argv[4], 'a').write(_text)\n"
            "for _fd in range(3, 64):\n"
            "    try:\n"
            "        os.write(_fd, _text.encode())\n"
            "    except OSError:\n"
            "        pass\n"
            "os._exit(0)\n",
            says="imports sys", stops="grammar, channel", deep="forged record", bare="forged record",
            kind_of="grader-state"),
    Hostile("rewrite-tests", "rewrites the bundle's tests.py so that every test passes (this submission and "
            "every one graded after it)",
            "import os, json\n"
            "_m = json.load(open(os.path.join(BUNDLE_PATH, 'manifest.json')))\n"
            "_src = 'from flashnb import course\\n' + ''.join('course.test(%r, points=%r, name=%r, hidden=%r, "
            "timeout=%r)(lambda ns: None)\\n' % (t['question'], t['points'], t['id'].split(': ', 1)[1], "
            "t['hidden'], t['timeout']) for t in _m['tests'])\n"
            "open(os.path.join(BUNDLE_PATH, 'tests.py'), 'w').write(_src)\n",
            says="imports os", stops="grammar, sandbox (no bundle in it); the bundle check without one",
            deep="No such file or directory", victims=True, bare="bundle's files changed", kind_of="others"),
    Hostile("rewrite-setup", "appends to the bundle's setup.py a patch of course.run_one, so that every "
            "submission graded after this one gets full points",
            "import os\n"
            "open(os.path.join(BUNDLE_PATH, 'setup.py'), 'a').write('\\nfrom flashnb import course as _c\\n'\n"
            "    '_c.run_one = lambda t, ns, done: '\n"
            "    '_c.Result(t.id, t.question, t.points, t.points, \"\", t.hidden)\\n')\n",
            says="imports os", stops="grammar, sandbox (no bundle in it); the bundle check without one",
            deep="No such file or directory", victims=True, bare="bundle's files changed", kind_of="others"),
    Hostile("rewrite-manifest", "sets every test's time limit in the bundle's manifest.json to 1 ms, so that the "
            "submissions graded after this one time out",
            "import os, json\n"
            "_p = os.path.join(BUNDLE_PATH, 'manifest.json')\n"
            "_m = json.load(open(_p))\n"
            "for _t in _m['tests']:\n"
            "    _t['timeout'] = 0.001\n"
            "open(_p, 'w').write(json.dumps(_m))\n",
            says="imports os", stops="grammar, sandbox (no bundle in it); the bundle check without one",
            deep="No such file or directory", victims=True, bare="bundle's files changed", kind_of="others"),
    Hostile("poison-compile-cache", "overwrites every compile verdict in the batch's shared cache "
            "($FLASHNB_COURSE_CACHE) with 'no problems', so that a later submission whose kernel has float64 code "
            "passes the compile test",
            "import os\n"
            "_d = os.environ.get('FLASHNB_COURSE_CACHE')\n"
            "if _d and os.path.isdir(_d):\n"
            "    for _f in os.listdir(_d):\n"
            "        open(os.path.join(_d, _f), 'w').write('[]')\n",
            says="imports os", stops="grammar, private caches", victims=True, kind_of="others"),
    Hostile("read-solution", "reads the bundle's solution.ipynb and runs its answer cells",
            "import json, os, linecache\n"
            "_nb = json.load(open(os.path.join(BUNDLE_PATH, 'solution.ipynb')))\n"
            "for _i, _c in enumerate(_nb['cells']):\n"
            "    if 'answer' in _c['metadata'].get('tags', []):\n"
            "        _s = ''.join(_c['source']) if isinstance(_c['source'], list) else _c['source']\n"
            "        _n = f'<solution {_i}>'\n"
            "        linecache.cache[_n] = (len(_s), None, _s.splitlines(True), _n)\n"
            "        exec(compile(_s, _n, 'exec'), globals())\n",
            says="imports json", stops="grammar, sandbox (no bundle in it)", cell=-1,
            deep="No such file or directory", kind_of="leak-tests"),
    Hostile("dunder-escape", "climbs from () through __class__ / __subclasses__ to os's globals, then patches "
            "course.run_one through sys.modules",
            "_g = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0]"
            ".__init__.__globals__\n"
            "_c = _g['sys'].modules['flashnb.course']\n"
            "_c.run_one = lambda t, ns, done: _c.Result(t.id, t.question, t.points, t.points, '', t.hidden)\n",
            says="private and special attributes", stops="grammar, integrity", deep="run_one replaced",
            bare="run_one replaced", kind_of="grammar"),
    Hostile("computed-attribute", "patches course.run_one with setattr and a name built at run time",
            f"setattr(course, 'run_' + 'one', {_RUN_ONE})\n", says="setattr is not available",
            stops="grammar, integrity",
            deep="run_one replaced", bare="run_one replaced", kind_of="grammar"),
    Hostile("hidden-exec", "runs the run_one patch from a hex string with exec",
            f"exec(bytes.fromhex({binascii.hexlify(_PATCH.encode()).decode()!r}).decode())\n",
            says="exec is not available",
            stops="grammar, integrity", deep="run_one replaced", bare="run_one replaced", kind_of="grammar"),
    Hostile("frame-walk", "walks from its own frame to the grader's (inspect.currentframe().f_back) and calls the "
            "old grader's emit() with full points",
            "import inspect, json, os\n"
            "_fl = inspect.currentframe().f_back.f_locals\n"
            "if 'emit' in _fl and 'bundle_p' in _fl:\n"
            "    _m = json.loads((_fl['bundle_p'] / 'manifest.json').read_text())\n"
            "    _fl['emit'](event='answers', problems=[])\n"
            "    for _t in _m['tests']:\n"
            "        _fl['emit'](event='result', id=_t['id'], question=_t['question'], points=_t['points'], "
            "earned=_t['points'], message='', hidden=_t['hidden'], seconds=0.0, status='pass')\n"
            "    _fl['emit'](event='end')\n"
            "    os._exit(0)\n",
            says="imports inspect", stops="grammar (in-process state: what a separate process would need)",
            kind_of="grader-state"),
    Hostile("thread-patcher", "starts a thread that keeps patching course.run_one while the tests run",
            "import threading, time\n"
            "def _loop():\n"
            "    while True:\n"
            f"        {_PATCH.strip()}\n"
            "        time.sleep(0.001)\n"
            "threading.Thread(target=_loop, daemon=True).start()\n",
            says="imports threading", stops="grammar, integrity", deep="run_one replaced", bare="run_one replaced",
            kind_of="grader-state"),
    Hostile("orphan-process", "starts a detached process (setsid) that outlives the grading",
            "import subprocess\n"
            "subprocess.Popen(['sleep', '987.654'], start_new_session=True, stdout=subprocess.DEVNULL, "
            "stderr=subprocess.DEVNULL)\n",
            says="imports subprocess", stops="grammar, sandbox (PID namespace), process reaping", deep="", bare="",
            kind_of="machine"),
    Hostile("kill-grader", "sends SIGTERM to the grading process (its parent): the batch stops",
            "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)\n", says="imports os",
            stops="grammar, sandbox (its own PID namespace: the grader is not in it)", deep="", kind_of="others"),
    Hostile("site-packages-pth", "writes a .pth file into site-packages that patches course.run_one at every "
            "interpreter start: every later submission, in this batch and the next, gets full points",
            "import os, site\n"
            "for _d in site.getsitepackages():\n"
            "    open(os.path.join(_d, 'zz_flashnb_hostile.pth'), 'w').write("
            "'import flashnb.course as c; c.run_one = None\\n')\n",
            says="imports os", stops="grammar, sandbox (read-only filesystem)", deep="Read-only file system",
            victims=True, kind_of="others"),
    Hostile("rewrite-submissions", "rewrites every other notebook in the submissions folder (a later student's "
            "correct answer then scores 0)",
            "import os\n"
            "for _f in os.listdir(SUBS_PATH):\n"
            "    if _f.startswith('zz_'):\n"
            "        open(os.path.join(SUBS_PATH, _f), 'w').write('{}')\n",
            says="imports os", stops="grammar, sandbox (no submissions folder in it)",
            deep="No such file or directory", victims=True, kind_of="others"),
    Hostile("kill-batch", "SIGKILL to its parent and to every process it can see: the batch ends with no CSV "
            "and no feedback for anyone",
            "import os, signal\n"
            "for _p in [os.getppid()] + [int(_d) for _d in os.listdir('/proc') if _d.isdigit()]:\n"
            "    if _p != os.getpid():\n"
            "        try:\n"
            "            os.kill(_p, signal.SIGKILL)\n"
            "        except OSError:\n"
            "            pass\n",
            says="imports os", stops="grammar, sandbox (its own PID namespace)", deep="", kind_of="others"),
    Hostile("feedback-folder", "makes a folder where a later student's feedback file goes (the batch crashed "
            "writing it)",
            "import os\n"
            "os.makedirs(os.path.join(OUT_PATH, 'feedback', 'zz_good.txt'), exist_ok=True)\n"
            "os.makedirs(os.path.join(OUT_PATH, 'scores.csv'), exist_ok=True)\n",
            says="imports os", stops="grammar, sandbox (no output folder in it); atomic writes",
            deep="", kind_of="others"),
    Hostile("double-fork", "double-forks a process that leaves the session (setsid), empties its environment and "
            "outlives the grader, then rewrites the results (Gradescope: results.json after the grader wrote it)",
            "import os\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        os.execve('/bin/sleep', ['sleep', '987.654'], {})\n"
            "    os._exit(0)\n",
            says="imports os", stops="grammar, sandbox (PID namespace: it dies with the sandbox)", deep="",
            kind_of="machine"),
    Hostile("disk-flood", "fills the disk with small files (a size limit per file does not stop it)",
            "import os\n"
            "_i = 0\n"
            "while True:\n"
            "    open(f'flood{_i}.bin', 'wb').write(b'x' * 65536)\n"
            "    _i += 1\n",
            says="imports os", stops="grammar, sandbox (a scratch of fixed size)", deep="No space left on device",
            kind_of="machine"),
    Hostile("proc-cmdline", "finds the bundle's path in the grader's command line (/proc/<pid>/cmdline) and runs "
            "solution.ipynb's answer cells",
            "import os, json\n"
            "for _d in os.listdir('/proc'):\n"
            "    try:\n"
            "        _a = open(f'/proc/{_d}/cmdline', 'rb').read().split(b'\\0')\n"
            "    except OSError:\n"
            "        continue\n"
            "    for _x in _a:\n"
            "        _s = os.path.join(_x.decode(errors='replace'), 'solution.ipynb')\n"
            "        if os.path.exists(_s):\n"
            "            for _c in json.load(open(_s))['cells']:\n"
            "                if 'answer' in _c['metadata'].get('tags', []):\n"
            "                    exec(''.join(_c['source']), globals())\n",
            says="imports os", stops="grammar, sandbox (its own PID namespace, no bundle in it)", deep="",
            kind_of="leak-tests"),
    Hostile("memory-hog", "allocates 5 GiB in the answer cell (beyond the grader's 4 GiB of address space, whatever "
            "the process already holds)", "_hog = np.ones((5 << 30) // 8)\n",
            says="NumPy in an answer", stops="grammar; the address-space limit behind it", kind_of="machine"),
]

#: the edit of the solution's third A1 cell that makes "uncounted-reads": a max pass the counter never sees
UNCOUNTED = ("        for j in range(tid, n, TPB):                       # pass 1",
             "        m = max(NEG_INF, X[row].max())                     # a max pass the counter never sees\n"
             "        for j in range(tid, n, TPB):                       # pass 1")


def _answer_cells(nb):
    return [c for c in nb.cells if c["cell_type"] == "code" and "answer" in c["metadata"].get("tags", [])]


def notebook(h: Hostile, name: str, release_dir, bundle, *, subs=None, out=None) -> nbformat.NotebookNode:
    """The hostile submission ``h`` for assignment ``name``: its base with the attack appended to an answer cell
    (the first, unless ``h.cell`` says otherwise)."""
    from flashnb.course import bugs as course_bugs

    release_dir = Path(release_dir)
    solution = nbformat.read(str(release_dir / "autograder" / "solution.ipynb"), as_version=4)
    base = h.base.get(name)
    if base is None:
        nb = nbformat.read(str(release_dir / "student" / f"{name}.ipynb"), as_version=4)
    elif base == "solution":
        nb = solution
    else:
        adir = Path(__file__).resolve().parents[2] / "assignments" / name
        bug = next(b for b in course_bugs.load(adir) if b.name.startswith(base))
        nb = bug.apply(solution)
    cells = _answer_cells(nb)
    if h.kind == "uncounted-reads" and name == "a1_online_softmax":
        old, new = UNCOUNTED
        assert cells[2]["source"].count(old) == 1
        cells[2]["source"] = cells[2]["source"].replace(old, new)
    code = h.code.replace("BUNDLE_PATH", repr(str(bundle)))
    code = code.replace("SUBS_PATH", repr(str(subs) if subs else "/submissions"))
    code = code.replace("OUT_PATH", repr(str(out) if out else "/grades"))
    lines = cells[h.cell]["source"].rstrip("\n").splitlines()
    if lines and lines[-1].startswith("raise NotImplementedError("):
        # a blank answer cell (A6): its TODO raises at the top level, so the attack goes before it, as a
        # student's code would, and runs
        cells[h.cell]["source"] = "\n".join(lines[:-1]) + "\n\n" + code + "\n\n" + lines[-1] + "\n"
    else:
        cells[h.cell]["source"] = cells[h.cell]["source"].rstrip("\n") + "\n\n\n" + code
    return nb


def write(name: str, release_dir, out_dir, *, kinds=None, grades=None) -> dict:
    """Write ``hostileNN.ipynb`` for each entry (``kinds``: a subset by kind) into ``out_dir``; returns
    ``{stem: Hostile}``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    made = {}
    for k, h in enumerate(HOSTILE, 1):
        if kinds is not None and h.kind not in kinds:
            continue
        stem = f"hostile{k:02d}"
        nbformat.write(notebook(h, name, release_dir, Path(release_dir) / "autograder", subs=out_dir, out=grades),
                       str(out_dir / f"{stem}.ipynb"))
        made[stem] = h
    return made


#: Legitimate answers written otherwise than the solution, per assignment: (stem, what, edit of the solution
#: notebook).  Each must score full marks.
def _helper_outside_the_factory(nb):
    """A1: the chunk fold through a device function of the student's, at the top of the cell, outside the kernel
    factory (the grader used to re-run only the factory's source: NameError)."""
    cells = _answer_cells(nb)
    old = "m, d = merge_state(m, d, X[row, j], ONE)"
    assert cells[1]["source"].count(old) == 1
    helper = ("@cuda.jit(device=True)\n"
              "def fold_one(m, d, x):\n"
              "    \"\"\"My helper: fold one element into [m, d].\"\"\"\n"
              "    return merge_state(m, d, x, ONE)\n\n\n")
    cells[1]["source"] = helper + cells[1]["source"].replace(old, "m, d = fold_one(m, d, X[row, j])")
    return nb


def _helper_in_another_cell(nb):
    """A1: the same helper in the first answer cell, used by the kernel of the second."""
    cells = _answer_cells(nb)
    old = "m, d = merge_state(m, d, X[row, j], ONE)"
    cells[0]["source"] += ("\n\n@cuda.jit(device=True)\ndef fold_one(m, d, x):\n"
                           "    return merge_state(m, d, x, ONE)\n")
    cells[1]["source"] = cells[1]["source"].replace(old, "m, d = fold_one(m, d, X[row, j])")
    return nb


LEGIT = {"a1_online_softmax": [("legit_helper_outside", _helper_outside_the_factory),
                               ("legit_helper_other_cell", _helper_in_another_cell)]}


def write_legit(name: str, release_dir, out_dir) -> list[str]:
    """Write the legitimate variants of ``name``'s solution into ``out_dir``; returns their stems."""
    solution = Path(release_dir) / "autograder" / "solution.ipynb"
    made = []
    for stem, edit in LEGIT.get(name, []):
        nbformat.write(edit(nbformat.read(str(solution), as_version=4)), str(Path(out_dir) / f"{stem}.ipynb"))
        made.append(stem)
    return made
