"""The stage kernels may be reformatted outside their regions (flashnb.regions) without breaking what is built on
them.  Each stage module the course and the exercises edit is rewritten -- every local of a kernel factory used only
outside the regions renamed, every long line outside them re-wrapped, aligned comments un-aligned -- and loaded
as a separate module (package ``flashnb.stages``, registrations isolated), its factories put where the course and
the exercises look them up.  Then every assignment's release builds, every bug applies (its strings found exactly
once in its region), the solution cells are the reformatted factories, every exercise variant builds from the
reformatted kernels, and one exercise check and one graded bug give the verdict they give on the real kernels."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import io
import sys
import tokenize
from pathlib import Path

import nbformat
import pytest

from flashnb import exercises, regions, registry
from flashnb.course import bugs as course_bugs
from flashnb.course import build, grade

ROOT = Path(__file__).resolve().parents[1]
#: The stage modules whose kernels the course and the exercises edit.
REFORMATTED = ("naive", "softmax", "fa1", "fa2")
WRAP_AT = 80                # lines longer than this (outside regions, with a comma inside brackets) are re-wrapped


# --------------------------------------------------------------------------- the reformatting


def _is_factory(node) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        isinstance(d, ast.Call) and getattr(d.func, "id", None) == "kernel_factory" for d in node.decorator_list)


def _factory_sources(text: str) -> dict[str, tuple[int, str]]:
    """Each kernel factory of a module: its name -> (first line, 1-based; its source), what regions are parsed in."""
    lines = text.splitlines(keepends=True)
    return {n.name: (n.lineno, "".join(lines[n.lineno - 1:n.end_lineno]))
            for n in ast.parse(text).body if _is_factory(n)}


def _outside_lines(text: str) -> set[int]:
    """1-based numbers of the module's lines outside every region of its factories (markers count as inside)."""
    inside = set()
    for first, source in _factory_sources(text).values():
        for r in regions.parse(source).values():         # marker lines r.first - 1 .. r.last, 0-based in source
            inside.update(range(first + r.first - 1, first + r.last + 1))
    return set(range(1, len(text.splitlines()) + 1)) - inside


def reformat(text: str) -> tuple[str, dict]:
    """``text`` with every kernel factory reformatted outside its regions; the report says what changed."""
    tree = ast.parse(text)
    outside = _outside_lines(text)
    toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    top = set(dir(builtins))
    for node in tree.body:                                # names the module binds: never touched
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            top |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            top |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    keywords = {n.arg for n in ast.walk(tree) if isinstance(n, ast.keyword)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used = {t.string for t in toks if t.type == tokenize.NAME}
    renames: dict[int, dict[str, str]] = {}               # factory line -> {old: new}
    edits: dict[int, list] = {}                           # line -> [(col0, col1, text)]
    for node in filter(_is_factory, tree.body):
        span = range(node.lineno, node.end_lineno + 1)
        stored = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        params = {a.arg for n in ast.walk(node) if isinstance(n, ast.arguments)
                  for a in n.posonlyargs + n.args + n.kwonlyargs + [n.vararg, n.kwarg] if a is not None}
        in_fstrings = {n.id for f in ast.walk(node) if isinstance(f, ast.JoinedStr)
                       for n in ast.walk(f) if isinstance(n, ast.Name)}
        in_regions = {t.string for t in toks if t.type == tokenize.NAME and t.start[0] in span
                      and t.start[0] not in outside}
        local = sorted(stored - params - top - keywords - in_fstrings - in_regions)
        names = {n: n + "_" for n in local if n + "_" not in used}
        renames[node.lineno] = names
        prev = None
        for t in toks:
            if t.start[0] not in span:
                continue
            if t.type == tokenize.NAME and t.string in names and (prev is None or prev.string != "."):
                edits.setdefault(t.start[0], []).append((t.start[1], t.end[1], names[t.string]))
            if (t.type == tokenize.COMMENT and t.start[0] in outside and prev is not None
                    and prev.end[0] == t.start[0] and t.start[1] - prev.end[1] > 2):
                edits.setdefault(t.start[0], []).append((prev.end[1], t.start[1], "  "))   # un-align the comment
            if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                prev = t
    lines = text.splitlines(keepends=True)
    for row, changes in edits.items():
        line = lines[row - 1]
        for c0, c1, new in sorted(changes, reverse=True):
            line = line[:c0] + new + line[c1:]
        lines[row - 1] = line
    text2 = "".join(lines)
    # re-wrap: a long line outside the regions is broken after its first comma inside brackets
    wraps, depth, first_comma = [], 0, {}
    spans = [range(n.lineno, n.end_lineno + 1) for n in filter(_is_factory, tree.body)]
    for t in tokenize.generate_tokens(io.StringIO(text2).readline):
        if t.type == tokenize.OP and t.string in "([{":
            depth += 1
        elif t.type == tokenize.OP and t.string in ")]}":
            depth -= 1
        elif t.type == tokenize.OP and t.string == "," and depth >= 1:
            first_comma.setdefault(t.start[0], t.end[1])
    lines = text2.splitlines(keepends=True)
    for row in sorted(first_comma, reverse=True):
        line = lines[row - 1]
        if row in outside and any(row in s for s in spans) and len(line.rstrip("\n")) > WRAP_AT:
            col = first_comma[row]
            indent = len(line) - len(line.lstrip())
            lines[row - 1] = line[:col] + "\n" + " " * (indent + 8) + line[col:].lstrip()
            wraps.append(row)
    return "".join(lines), dict(renames=renames, wraps=wraps, comments=sum(
        1 for ch in edits.values() for c in ch if c[2] == "  "))


def test_the_reformatting_keeps_every_region_and_changes_each_module():
    for mod in REFORMATTED:
        real = importlib.import_module(f"flashnb.stages.{mod}")
        text = Path(real.__file__).read_text()
        new, report = reformat(text)
        compile(new, mod, "exec")
        before, after = _factory_sources(text), _factory_sources(new)
        assert before.keys() == after.keys() and any(regions.names(src) for _, src in before.values())
        for factory, (_, src) in before.items():
            new_src = after[factory][1]
            assert regions.names(new_src) == regions.names(src), (mod, factory)
            for name in regions.names(src):
                assert regions.body(new_src, name) == regions.body(src, name), (mod, factory, name)
        assert any(report["renames"].values()) and report["wraps"], (mod, report)


# --------------------------------------------------------------------------- the reformatted world


def _defined_in(module, value) -> bool:
    target = getattr(value, "__wrapped__", None) or getattr(value, "py_func", None) or value
    return callable(value) and getattr(target, "__module__", None) == module.__name__ and not inspect.isclass(value)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The reformatted modules loaded beside the real ones, their factories in the real modules' attributes."""
    tmp = tmp_path_factory.mktemp("reformatted")
    names = [f"flashnb.stages.{m}" for m in REFORMATTED]
    with pytest.MonkeyPatch.context() as mp:
        # the copies register their kernels and impls under the same names: the real ones step aside (in place:
        # modules hold these dicts by reference), and come back when the fixture ends
        for k in [k for k, spec in registry.KERNELS.items() if getattr(spec.factory, "__module__", None) in names]:
            mp.delitem(registry.KERNELS, k)
        for k in [k for k, impl in registry.IMPLS.items() if getattr(impl.forward, "__module__", None) in names]:
            mp.delitem(registry.IMPLS, k)
        out = {}
        for mod, name in zip(REFORMATTED, names):
            real = importlib.import_module(name)
            text, report = reformat(Path(real.__file__).read_text())
            path = tmp / f"{mod}.py"
            path.write_text(text)
            spec = importlib.util.spec_from_file_location(f"flashnb.stages._reformatted_{mod}", path)
            copy = importlib.util.module_from_spec(spec)
            mp.setitem(sys.modules, spec.name, copy)
            spec.loader.exec_module(copy)
            swapped = {}
            for attr, value in vars(copy).items():
                if _defined_in(copy, value) and hasattr(real, attr):
                    mp.setattr(real, attr, value)
                    swapped[attr] = value
            out[mod] = dict(real=real, copy=copy, text=text, original=Path(real.__file__).read_text(),
                            report=report, swapped=swapped)
        yield out


def test_every_assignment_builds_and_every_bug_applies_from_the_reformatted_kernels(world, tmp_path):
    masters = sorted((ROOT / "assignments").glob("*/master.py"))
    assert len(masters) == 6
    for master in masters:
        adir, name = master.parent, master.parent.name
        build.build(master, tmp_path / name / "release")
        subs = course_bugs.write_submissions(adir, tmp_path / name / "release", tmp_path / name / "subs")
        assert sum(b is not None for b in subs.values()) == len(course_bugs.load(adir)) >= 3
        solution = nbformat.read(str(tmp_path / name / "release" / "autograder" / "solution.ipynb"), as_version=4)
        cells = [c["source"] for c in solution.cells if "answer" in c["metadata"].get("tags", [])]
        library = [c["source"].splitlines()[0] for c in build.read_master(master).cells
                   if "answer" in build.tags(c) and c["source"].startswith(build.DIRECTIVE)]
        changed = 0
        for first, cell in zip(library, cells):
            module = first.split("import")[0].split()[-1].rsplit(".", 1)[-1]
            if module not in world:
                continue
            assert cell.rstrip("\n") in world[module]["text"], (name, first)      # the reformatted factory
            changed += cell.rstrip("\n") not in world[module]["original"]
        assert changed or not any(f.split("import")[0].split()[-1].rsplit(".", 1)[-1] in world for f in library), name


def test_every_exercise_variant_builds_from_the_reformatted_kernels(world, monkeypatch, capsys):
    """Every variant a worked answer or a wrong answer makes (recorded as registry.variant makes it) is a variant of
    a reformatted factory, built from its reformatted source, and its kernel builds."""
    exercises._load_all()
    factories = {id(v): (mod, attr) for mod, w in world.items() for attr, v in w["swapped"].items()}
    made, variant = [], registry.variant

    def recording(factory, **kwargs):
        made.append(variant(factory, **kwargs))
        return made[-1]

    monkeypatch.setattr(registry, "variant", recording)
    answers = []
    for ex in sorted(exercises.EXERCISES.values(), key=lambda e: e.id):
        for fn in [ex.solution] + ex.wrong:
            if fn is not None and "variant(" in inspect.getsource(fn):
                before = len(made)
                fn()
                answers += [f"{ex.id}: {v.variant_of.__name__}" for v in made[before:]]
    assert len(made) >= 10, answers
    for v, where in zip(made, answers):
        mod, attr = factories.get(id(v.variant_of), (None, None))
        assert mod is not None, f"{where}: a variant of {v.variant_of.__module__}, not of a reformatted factory " \
                                "(add its module to REFORMATTED)"
        assert _from_reformatted(v, world[mod]), f"{where}: not built from the reformatted {mod}.{attr}"
        v(**registry._spec_of(v.variant_of).configs[-1])      # builds (on the simulator: the kernel object)


def _from_reformatted(variant, w) -> bool:
    """Some line of the variant's source outside its regions is a line only the reformatted module has."""
    reformatted = set(w["text"].splitlines()) - set(w["original"].splitlines())
    return any(line in reformatted for line in variant.variant_source.splitlines())


def test_an_exercise_check_gives_the_same_verdict_on_the_reformatted_kernel(world, capsys):
    ex = exercises._load("01.2")
    assert exercises.check("01.2", **ex.solution())
    assert not exercises.check("01.2", **ex.wrong[0]())
    assert "✓ exercise 01.2" in capsys.readouterr().out


def test_a_graded_bug_loses_the_same_points_from_the_reformatted_release(world, tmp_path):
    adir = ROOT / "assignments" / "a1_online_softmax"
    build.build(adir / "master.py", tmp_path / "release")
    subs = course_bugs.write_submissions(adir, tmp_path / "release", tmp_path / "all")
    bug = subs["bug01"]
    (tmp_path / "subs").mkdir()
    (tmp_path / "subs" / "bug01.ipynb").write_bytes((tmp_path / "all" / "bug01.ipynb").read_bytes())
    (g,) = grade.grade(tmp_path / "release" / "autograder", tmp_path / "subs", tmp_path / "scores.csv",
                       progress=lambda *_: None)
    lost = sorted(r["id"] for r in g["results"] if r["earned"] != r["points"])
    assert lost == sorted(bug.loses)
    assert bug.says in next(r["message"] for r in g["results"] if r["id"] == bug.loses[0])
