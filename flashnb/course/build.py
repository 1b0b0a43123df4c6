"""``flashnb course release``: from each master, the student notebook and the autograder bundle.

The student notebook keeps every cell but the ``hidden-tests`` and ``solution-only`` ones, with each solution
region replaced by a TODO that says what to write and about how many lines it took.  The bundle
(``autograder/``) holds ``setup.py`` (the cells tagged ``setup``), ``tests.py`` (public and hidden tests),
``manifest.json`` (tests, points, timeouts), ``solution.ipynb`` (the master with library cells expanded:
for teaching assistants) and ``hashes.json`` (the SHA-256 of each, which the grader checks before every
submission).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib
import inspect
import json
import re
import shlex
import textwrap
from pathlib import Path

from . import Fail, reset

#: The files of an autograder bundle the grader checks against ``hashes.json`` before every submission.
BUNDLE_FILES = ("setup.py", "tests.py", "manifest.json", "solution.ipynb", "removed.json")


def bundle_hashes(folder) -> dict:
    """SHA-256 of each bundle file present in ``folder`` (what ``hashes.json`` records)."""
    folder = Path(folder)
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in BUNDLE_FILES if (folder / n).exists()}

DIRECTIVE = "# flashnb-course:"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
TAGS = ("setup", "answer", "answer-prose", "tests", "hidden-tests", "solution-only")


class MasterError(ValueError):
    """A master notebook that cannot be built (the message names the cell)."""


def tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def read_master(path) -> dict:
    import jupytext

    return jupytext.read(str(path))


def _library_source(target: str) -> str:
    """``module import name`` -> the dedented source of that function without its decorators."""
    m = re.fullmatch(r"from\s+([\w.]+)\s+import\s+(\w+)", target.strip())
    if not m:
        raise MasterError(f"'{DIRECTIVE} {target}': expected 'from <module> import <factory>'")
    fn = getattr(importlib.import_module(m.group(1)), m.group(2))
    fn = inspect.unwrap(fn)
    text = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(text).body[0]
    lines = text.splitlines()
    # keep decorators such as @cuda.jit(device=True); drop @kernel_factory(...), which registers the library's
    keep = [ast.get_source_segment(text, dec) for dec in node.decorator_list]
    keep = ["@" + k for k in keep if not k.startswith("kernel_factory")]
    return "\n".join(keep + lines[node.lineno - 1:]) + "\n"


def _todo(indent: str, hint: str, removed: list[str]) -> list[str]:
    from .. import regions

    code = [ln for ln in removed if ln.strip() and not ln.strip().startswith("#")]
    notes = []
    for ln in removed:   # the paper-line comments of the removed code stay, as the hint of what to write
        if "#" in ln and not regions.MARKER.match(ln):
            comment = ln[ln.index("#") + 1:].strip()
            if comment and not comment.startswith(("BEGIN", "END", "##")):
                notes.append(f"{indent}#   {comment}")
    msg = hint.replace('"', "'")
    return ([f"{indent}# TODO: {hint} (about {len(code)} line{'s' if len(code) != 1 else ''})"] + notes
            + [f'{indent}raise NotImplementedError("TODO: {msg}")'])


def cut(source: str, region: str, hint: str, where: str | None = None) -> tuple[str, list[str]]:
    """Replace the body of ``region`` (:mod:`flashnb.regions`: between its markers, which stay so the student
    sees where to write; or a function's body after its docstring) by a TODO; returns the new source and the
    removed lines.  :class:`MasterError` naming the region when the source has none of that name."""
    from .. import regions

    try:
        r = regions.find(source, region, where)
    except regions.RegionError as e:
        raise MasterError(f"todo {region!r}: {e} (the library changed?)") from None
    lines = source.splitlines()
    removed = lines[r.first:r.last]
    if not any(ln.strip() for ln in removed):
        raise MasterError(f"todo {region!r}: the region is empty{f' in {where}' if where else ''}")
    return "\n".join(lines[:r.first] + _todo(r.indent, hint, removed) + lines[r.last:]) + "\n", removed


def _assigned_names(body: list[str]) -> list[str]:
    """When a solution region is only assignments at its own indentation (``x = ...`` answers, possibly with
    helper names), the names its *last* assignments define, in order; else []."""
    text = textwrap.dedent("\n".join(body))
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    if not tree.body or not all(isinstance(n, ast.Assign) and len(n.targets) == 1
                                and isinstance(n.targets[0], ast.Name) for n in tree.body):
        return []
    return list(dict.fromkeys(n.targets[0].id for n in tree.body))


def _regions(source: str) -> tuple[str, str, list[list[str]]]:
    """A cell with ``### BEGIN SOLUTION [hint]`` / ``### END SOLUTION`` regions -> (solution, student, removed)."""
    out_sol, out_stu, removed = [], [], []
    lines = source.splitlines()
    k = 0
    while k < len(lines):
        ln = lines[k]
        if ln.strip().startswith(BEGIN):
            hint = ln.strip()[len(BEGIN):].strip(" :-") or "your code here"
            indent = re.match(r"\s*", ln).group(0)
            body = []
            k += 1
            while k < len(lines) and not lines[k].strip().startswith(END):
                body.append(lines[k])
                k += 1
            if k == len(lines):
                raise MasterError(f"{BEGIN} without {END}")
            out_sol.extend(body)
            names = _assigned_names(body)
            if names:      # numeric answers: the release keeps `name = ...` (not attempted), never a raise
                out_stu.append(f"{indent}# TODO: {hint}")
                out_stu.extend(f"{indent}{n} = ..." for n in names)
            else:
                out_stu.extend(_todo(indent, hint, [b for b in body if not b.strip().startswith("#")]))
            removed.append(body)
        else:
            out_sol.append(ln)
            out_stu.append(ln)
        k += 1
    return "\n".join(out_sol) + "\n", "\n".join(out_stu) + "\n", removed


def expand(cell) -> tuple[str, str, list[list[str]]]:
    """(solution source, student source, removed regions) of one answer cell."""
    src = cell["source"]
    lines = src.splitlines()
    if lines and lines[0].startswith(DIRECTIVE):
        head = [ln[len(DIRECTIVE):].strip() for ln in lines if ln.startswith(DIRECTIVE)]
        solution = _library_source(head[0])
        student, removed = solution, []
        for d in head[1:]:
            parts = shlex.split(d)
            if len(parts) < 2 or parts[0] != "todo" or ".." in parts:
                raise MasterError(f"'{DIRECTIVE} {d}': expected 'todo REGION \"<hint>\"' (REGION: a region of the "
                                  "kernel, between '# region REGION' and '# endregion REGION' markers, or a function "
                                  "it defines)")
            student, gone = cut(student, parts[1], " ".join(parts[2:]) or "your code here", head[0].split()[-1])
            removed.append(gone)
        return solution, student, removed
    return _regions(src)


def _cell_code(cell) -> str:
    return "\n".join(ln for ln in cell["source"].splitlines() if not ln.lstrip().startswith(("%", "!")))


COLAB_CELL = """# Colab (or any fresh runtime without flashnb): install the course's copy of flashnb first.
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("flashnb") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", {spec!r}], check=True)
"""


def build(master_path, out_dir, *, install: str | None = None) -> dict:
    """Build one assignment: ``out_dir/student/<name>.ipynb`` and ``out_dir/autograder/``; returns the manifest.

    ``install`` (a pip requirement, e.g. ``"flashnb[course] @ git+https://<your course's copy>"``) adds a first
    cell to the student notebook that installs flashnb where it is missing -- Colab, a fresh runtime."""
    import nbformat

    from .. import course

    master_path, out_dir = Path(master_path), Path(out_dir)
    name = master_path.parent.name
    nb = read_master(master_path)
    student, solution = copy.deepcopy(nb), copy.deepcopy(nb)
    student.cells, solution.cells = [], []
    for book in (student, solution):        # the grader tells a notebook of another assignment by this
        book.metadata["flashnb_course"] = {"assignment": name}
    setup, tests, answers, removed_all = [], [], 0, []
    for cell in nb.cells:
        t = tags(cell)
        unknown = [x for x in t if x not in TAGS]
        if unknown:
            raise MasterError(f"{master_path}: unknown tag(s) {unknown} (known: {TAGS})")
        if "answer" in t:
            sol, stu, removed = expand(cell)
            if not removed:
                raise MasterError(f"{master_path}: an answer cell has no solution region:\n{cell['source'][:200]}")
            removed_all.extend(removed)
            answers += 1
            solution.cells.append(nbformat.v4.new_code_cell(sol, metadata=copy.deepcopy(cell["metadata"])))
            student.cells.append(nbformat.v4.new_code_cell(stu, metadata=copy.deepcopy(cell["metadata"])))
            continue
        sol_cell = copy.deepcopy(cell)
        if "hidden-tests" in t:    # so that the solution notebook, run in Jupyter, registers them as hidden too
            sol_cell["source"] = ("course._HIDDEN_DEFAULT['value'] = True\n" + sol_cell["source"]
                                  + "\ncourse._HIDDEN_DEFAULT['value'] = False\n")
        solution.cells.append(sol_cell)
        if "setup" in t:
            setup.append(_cell_code(cell))
        if "tests" in t or "hidden-tests" in t:
            tests.append((_cell_code(cell), "hidden-tests" in t))
        if "hidden-tests" in t or "solution-only" in t:
            continue
        student.cells.append(copy.deepcopy(cell))
    if install:
        first = next(i for i, c in enumerate(student.cells) if c["cell_type"] == "code")
        student.cells.insert(first, nbformat.v4.new_code_cell(COLAB_CELL.format(spec=install)))
    for c in student.cells + solution.cells:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    # the tests, registered once here to learn their points (they are run only by check() and the grader)
    tests_py = "from flashnb import course\n\n"
    for code, hidden in tests:
        tests_py += f"course._HIDDEN_DEFAULT['value'] = {hidden}\n{code}\n\n"
    tests_py += "course._HIDDEN_DEFAULT['value'] = False\n"
    setup_py = "\n\n".join(setup) + "\n"
    reset()
    ns: dict = {"__name__": f"flashnb_course_{name}"}
    exec(compile(setup_py, f"<{name} setup>", "exec"), ns)
    exec(compile(tests_py, f"<{name} tests>", "exec"), ns)
    manifest = dict(
        name=name, title=next((c["source"].splitlines()[0].lstrip("# ") for c in nb.cells
                               if c["cell_type"] == "markdown"), name),
        answer_cells=answers,
        tests=[dict(id=t.id, question=t.question, points=t.points, hidden=t.hidden, timeout=t.timeout,
                    requires=list(t.requires)) for t in course.TESTS.values()],
        manual=[dict(m) for m in course.MANUAL],
    )
    reset()
    (out_dir / "student").mkdir(parents=True, exist_ok=True)
    (out_dir / "autograder").mkdir(parents=True, exist_ok=True)
    nbformat.write(student, str(out_dir / "student" / f"{name}.ipynb"))
    nbformat.write(solution, str(out_dir / "autograder" / "solution.ipynb"))
    (out_dir / "autograder" / "setup.py").write_text(setup_py)
    (out_dir / "autograder" / "tests.py").write_text(tests_py)
    (out_dir / "autograder" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out_dir / "autograder" / "removed.json").write_text(json.dumps(removed_all, indent=1) + "\n")
    leaks = solution_leaks(out_dir / "student" / f"{name}.ipynb", out_dir / "autograder" / "solution.ipynb",
                           removed_all)
    if leaks:
        raise MasterError(f"{name}: the student release still holds solution lines: {leaks[:3]}")

    (out_dir / "autograder" / "hashes.json").write_text(
        json.dumps(bundle_hashes(out_dir / "autograder"), indent=1) + "\n")
    return manifest


def solution_leaks(student_nb, solution_nb, removed: list[list[str]]) -> list[str]:
    """Code lines of the removed solution regions that the student notebook still holds (should be none).

    A line counts when it is code (not a comment) of at least 12 characters.  A line the skeleton also keeps
    outside the regions (``cuda.syncthreads()``) is allowed as often as it occurs there: the student notebook
    may hold line ``s`` at most (occurrences in the solution) - (occurrences inside the regions) times."""
    import collections

    import nbformat

    def counts(path) -> collections.Counter:
        nb = nbformat.read(str(path), as_version=4)
        return collections.Counter(ln.split("#")[0].strip() for c in nb.cells for ln in c["source"].splitlines())

    student, solution = counts(student_nb), counts(solution_nb)
    inside = collections.Counter(ln.split("#")[0].strip() for region in removed for ln in region)
    return sorted(s for s in inside if len(s) >= 12 and student[s] > solution[s] - inside[s])


def release(masters, out_dir, *, install: str | None = None) -> list[dict]:
    """Build every master into ``out_dir/<name>/``."""
    return [build(m, Path(out_dir) / Path(m).parent.name, install=install) for m in masters]


__all__ = ["build", "release", "cut", "expand", "solution_leaks", "MasterError", "Fail"]
