"""Grade every hostile submission of ``tests/course/course_hostile.py`` with the grader as it was before the
sandbox and the answer grammar, and print a table: entry, class, old score, base score, new score.

    git worktree add /tmp/oldgrader <commit> --detach
    nice -n 10 python scripts/regrade_hostile_old.py /tmp/oldgrader [--assignment a1_online_softmax]

The old grader had no sandbox, so each of its gradings runs here inside a throwaway bubblewrap sandbox of this
script's own (the whole filesystem read-only, a private ``/tmp`` of 1 GiB holding a copy of the release, the
submissions and the output, no network, its own PID namespace): what an attack does to the machine (a ``.pth``
file in site-packages, a process left behind) cannot happen, and it is reported where that is all it does.
Each entry is graded in a batch with a victim graded after it (the solution notebook, ``zz_victim``), so an attack
on later students shows as the victim's score.  "old": the hostile notebook's score with the old grader; "base":
its base notebook's (the untouched release, or the bug or solution it is appended to) with the old grader; "new":
the hostile notebook's score with this checkout's grader (sandbox on).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: run inside the outer sandbox with the old checkout first on sys.path: grade one batch, print the scores as JSON
_OLD_BATCH = r'''
import json, sys
from pathlib import Path
from flashnb.course import grade
bundle, subs, out = (Path(a) for a in sys.argv[1:4])
try:
    res = grade.grade(bundle, subs, out / "scores.csv", feedback_dir=out / "feedback", work_dir=out / "work",
                      progress=lambda *a: None)
    print("RESULT " + json.dumps({g["student"]: [sum(r["earned"] for r in g["results"]),
                                                 sum(r["points"] for r in g["results"]),
                                                 " ".join(str(p) for p in g.get("problems", []))[:160]]
                                  for g in res}))
except BaseException as exc:
    print("RESULT " + json.dumps({"__error__": f"{type(exc).__name__}: {str(exc)[:200]}"}))
'''

#: the catalogue's notebooks, made against the old release with the old checkout's bugs.py (run with the old
#: checkout first on sys.path; the catalogue's module read from this checkout, as if it lay in the old one)
_WRITE = r'''
import json, shutil, sys, types, nbformat
from pathlib import Path
old, new, name, release, out = sys.argv[1:6]
src = Path(new, "tests", "course", "course_hostile.py").read_text()
mod = types.ModuleType("course_hostile")
mod.__file__ = str(Path(old, "tests", "course", "course_hostile.py"))
sys.modules["course_hostile"] = mod
exec(compile(src, "course_hostile.py", "exec"), mod.__dict__)
made = {}
for k, h in enumerate(mod.HOSTILE, 1):
    stem = f"hostile{k:02d}"
    d = Path(out, stem)
    (d / "subs").mkdir(parents=True)
    shutil.copytree(release, d / "release")
    try:
        nb = mod.notebook(h, name, d / "release", d / "release" / "autograder", subs=d / "subs", out=d / "out")
    except Exception as exc:
        made[stem] = dict(kind=h.kind, error=f"{type(exc).__name__}: {exc}"[:200])
        continue
    nbformat.write(nb, str(d / "subs" / f"{stem}.ipynb"))
    made[stem] = dict(kind=h.kind, kind_of=h.kind_of, base=h.base.get(name, "untouched"), victims=h.victims)
print(json.dumps(made))
'''


def _run(cmd, env=None, cwd=None, timeout=900):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    return p


def _outer_sandbox(argv, rw: Path, old: Path) -> list[str]:
    """``argv`` in a bubblewrap sandbox: everything read-only but ``rw`` (a folder under /tmp), a fresh /tmp."""
    return ["bwrap", "--ro-bind", "/", "/", "--size", str(1 << 30), "--tmpfs", "/tmp",
            "--ro-bind", str(old), str(old), "--bind", str(rw), str(rw), "--proc", "/proc", "--dev", "/dev",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--die-with-parent", "--new-session",
            "--setenv", "HOME", "/tmp/home", "--setenv", "TMPDIR", "/tmp", "--chdir", str(rw), "--"] + argv


def _env(path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHNB_", "PYTHON"))}
    env.update(PYTHONPATH=str(path), FLASHNB_DEVICE="sim", PYTHONDONTWRITEBYTECODE="1")
    return env


def _old_grade(old: Path, release: Path, subs: Path, out: Path) -> dict:
    """Grade ``subs`` with the old checkout inside the outer sandbox (``out`` holds the work and the output)."""
    box = out.parent
    p = _run(_outer_sandbox([sys.executable, "-c", _OLD_BATCH, str(release / "autograder"), str(subs), str(out)],
                            box, old), env=_env(old), timeout=1200)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = " | ".join((p.stderr or "").strip().splitlines()[-2:])[:200]
    return {"__error__": f"the grading process ended (exit code {p.returncode}) before writing scores: {tail}"}


def _fmt(s) -> str:
    return "—" if s is None else f"{s[0]:g}/{s[1]:g}"


def _said(s) -> str:
    """The old grader's first problem for a submission (its screen's refusal), on one line."""
    text = " ".join(str(s[2]).split()) if s is not None and len(s) > 2 else ""
    return f"old grader: {text[:140]}" if text else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, help="a checkout of the grader before the sandbox (git worktree add ...)")
    ap.add_argument("--assignment", default="a1_online_softmax")
    ap.add_argument("--only", nargs="*", help="entry kinds (default: all)")
    args = ap.parse_args()
    old, name = args.old.resolve(), args.assignment
    commit = _run(["git", "-C", str(old), "rev-parse", "--short", "HEAD"]).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="regrade-old-", dir="/tmp"))
    try:
        # the release, with each checkout's own build (trusted code: outside any sandbox)
        for which, path in (("old", old), ("new", ROOT)):
            p = _run([sys.executable, "-c", "import sys; from flashnb.course import build; "
                      "build.build(sys.argv[1], sys.argv[2])", str(path / "assignments" / name / "master.py"),
                      str(tmp / which / "release")], env=_env(path))
            if p.returncode:
                sys.exit(f"{which} release failed: {p.stderr[-800:]}")
        p = _run([sys.executable, "-c", _WRITE, str(old), str(ROOT), name, str(tmp / "old" / "release"),
                  str(tmp / "old" / "entries")], env=_env(old))
        if p.returncode:
            sys.exit(f"writing the old notebooks failed: {p.stderr[-800:]}")
        entries = json.loads(p.stdout.strip().splitlines()[-1])
        if args.only:
            entries = {k: v for k, v in entries.items() if v["kind"] in args.only}
        solution = tmp / "old" / "release" / "autograder" / "solution.ipynb"
        # base scores: each base graded once with the old grader
        bases: dict[str, tuple | None] = {}
        for stem, e in entries.items():
            b = e.get("base")
            if b is None or b in bases:
                continue
            box = tmp / "old" / f"base-{len(bases)}"
            (box / "subs").mkdir(parents=True)
            shutil.copytree(tmp / "old" / "release", box / "release")
            nb_of = subprocess.run([sys.executable, "-c", _BASE_NB, str(old), name, str(box / "release"), b,
                                    str(box / "subs" / "base.ipynb")], capture_output=True, text=True,
                                   env=_env(old))
            got = _old_grade(old, box / "release", box / "subs", box / "out") if nb_of.returncode == 0 else {}
            bases[b] = tuple(got["base"][:2]) if "base" in got else None
            print(f"base {b}: {_fmt(bases[b])}", file=sys.stderr, flush=True)
        # new scores: every entry with this checkout's grader, in one batch
        new_subs = tmp / "new" / "subs"
        p = _run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import course_hostile as c; "
                  "from pathlib import Path; c.write(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), "
                  "grades=Path(sys.argv[5]))", str(ROOT / "tests" / "course"), name, str(tmp / "new" / "release"),
                  str(new_subs), str(tmp / "new" / "out")], env=_env(ROOT))
        new: dict = {}
        if p.returncode == 0:
            q = _run([sys.executable, "-c", "import sys, json; from pathlib import Path; "
                      "from flashnb.course import grade; r = grade.grade(Path(sys.argv[1]), Path(sys.argv[2]), "
                      "Path(sys.argv[3]), progress=lambda *a: None); print('RESULT ' + json.dumps({g['student']: "
                      "[sum(x['earned'] for x in g['results']), sum(x['points'] for x in g['results'])] "
                      "for g in r}))", str(tmp / "new" / "release" / "autograder"), str(new_subs),
                      str(tmp / "new" / "out" / "scores.csv")], env=_env(ROOT), timeout=3600)
            for line in q.stdout.splitlines():
                if line.startswith("RESULT "):
                    new = json.loads(line[7:])
        rows = []
        for stem, e in entries.items():
            if "error" in e:
                rows.append((e["kind"], "", "cannot run", "", "", f"not built against the old release: {e['error']}"))
                continue
            d = tmp / "old" / "entries" / stem
            # the victim: the solution, graded after the attack (its name sorts after hostileNN)
            shutil.copy(solution, d / "subs" / "zz_victim.ipynb")
            got = _old_grade(old, d / "release", d / "subs", d / "out")
            base = bases.get(e["base"])
            if "__error__" in got:
                oldtxt, note = "no score", "the batch ended: " + got["__error__"]
            else:
                mine = got.get(stem)
                oldtxt = _fmt(mine)
                note = ""
                v = got.get("zz_victim")
                if v is not None and v[0] != v[1]:
                    note = f"the victim (the solution, graded after it) scored {_fmt(v)}"
                elif v is None:
                    note = "no score for the victim graded after it"
                if mine is not None and base is not None and mine[0] > base[0]:
                    note = "; ".join(x for x in ("above its base", note) if x)
                elif not note:
                    note = _said(mine)
            rows.append((e["kind"], e["kind_of"], oldtxt, f"{e['base']} {_fmt(base)}", _fmt(new.get(stem)), note))
            print(f"{e['kind']}: old {oldtxt} {note}", file=sys.stderr, flush=True)
        print(f"Old grader: {commit}; assignment {name}; {len(rows)} entries")
        print()
        print("| entry | class | old score | base (old grader) | new score | notes |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(str(x).replace("|", "/") for x in r) + " |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


#: the base notebook of an entry (the untouched release, the solution or a bug of the old bugs.py)
_BASE_NB = r'''
import sys, nbformat
from pathlib import Path
old, name, release, base, out = sys.argv[1:6]
from flashnb.course import bugs
if base == "untouched":
    nb = nbformat.read(str(Path(release, "student", name + ".ipynb")), as_version=4)
else:
    nb = nbformat.read(str(Path(release, "autograder", "solution.ipynb")), as_version=4)
    if base != "solution":
        nb = next(b for b in bugs.load(Path(old, "assignments", name)) if b.name.startswith(base)).apply(nb)
nbformat.write(nb, out)
'''


if __name__ == "__main__":
    main()
