"""Write the teaching assistants' material from the masters, by grading: ``assignments/CATALOGUE.md`` (for every
assignment: points, the CPU time to grade one submission, and each common bug of its ``bugs.py`` with the
tests it loses and the message the grader printed) and ``assignments/EXERCISE_ANSWERS.md`` (the worked answer
of every notebook exercise, from ``flashnb.exercises``).

    python scripts/course_catalogue.py                       # about 1-2 minutes per assignment on 2 cores
    python scripts/course_catalogue.py a6_fa2_from_scratch   # that one again; the others' sections kept

Nothing in these files is typed by hand: rerun the script after changing a master, a bug or an exercise.
"""

from __future__ import annotations

import datetime
import platform
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _header() -> list[str]:
    from flashnb.course import grade

    limits = grade.Limits()
    return ["# Course kit: the common-bug catalogue", "",
            "Made by `python scripts/course_catalogue.py` (do not edit by hand): each assignment was released and "
            "its solution, its untouched student notebook and every bug of its `bugs.py` were graded with "
            "`flashnb course grade`. The messages below are what the grader printed.", "",
            f"Graded on {datetime.date.today().isoformat()}, {platform.processor() or platform.machine()}, "
            f"Python {platform.python_version()}, under the grader's default limits ({limits.cpu_s:g} CPU-seconds "
            f"per submission, {limits.memory_gib:g} GiB of address space per process, {limits.output_mib:g} MiB "
            f"of output, {limits.scratch_mib:g} MiB of scratch), each submission in processes of its own, each in "
            "its own bubblewrap sandbox with its own caches (nothing shared between submissions, so every one "
            "compiles its kernels).", ""]


def _section(master: Path, tmp: Path) -> list[str]:
    """One assignment's part of the catalogue: released, its solution, untouched release and bugs graded."""
    from flashnb.course import bugs as course_bugs
    from flashnb.course import build, grade

    name = master.parent.name
    tmp_a = tmp / name
    manifest = build.build(master, tmp_a / "release")
    subs = course_bugs.write_submissions(master.parent, tmp_a / "release", tmp_a / "subs")
    graded = {g["student"]: g for g in grade.grade(tmp_a / "release" / "autograder", tmp_a / "subs",
                                                   tmp_a / "scores.csv", progress=lambda *_: None)}
    total = sum(t["points"] for t in manifest["tests"])
    hidden = sum(t["points"] for t in manifest["tests"] if t["hidden"])
    manual = sum(x["points"] for x in manifest["manual"])
    cpu = [g["cpu_s"] for g in graded.values()]
    wall = [g["wall_s"] for g in graded.values()]
    out = [f"## {manifest['title']} (`{name}`)", "",
           f"{len(manifest['tests'])} autograded tests, {total:g} points ({hidden:g} in hidden tests)"
           + (f", plus {manual:g} points graded by a person" if manual else "") + ". "
           f"Solution: {sum(r['earned'] for r in graded['solution']['results']):g}/{total:g}; untouched "
           f"release: {sum(r['earned'] for r in graded['untouched']['results']):g}/{total:g}. "
           f"CPU time to grade one submission: {min(cpu):g}-{max(cpu):g} s "
           f"(solution {graded['solution']['cpu_s']:g} s); wall time {min(wall):g}-{max(wall):g} s "
           f"(solution {graded['solution']['wall_s']:g} s: each of its processes starts Python, NumPy and numba, "
           "and the compile tests wait on NVVM and ptxas).", "",
           "| test | points | hidden |", "|---|---|---|"]
    out += [f"| {t['id']} | {t['points']:g} | {'yes' if t['hidden'] else ''} |" for t in manifest["tests"]]
    out.append("")
    for stem, bug in subs.items():
        if bug is None:
            continue
        res = graded[stem]["results"]
        lost = [r for r in res if r["earned"] != r["points"]]
        got = sum(r["earned"] for r in res)
        out += [f"### {bug.name}", "", f"Scores {got:g}/{total:g}; loses: "
                + ", ".join(f"`{r['id']}`" for r in lost) + ".", ""]
        if bug.why:
            out += [f"What it means: {bug.why}.", ""]
        first = lost[0] if lost else None
        if first:
            out += ["The grader says:", "", "```", first["message"].strip(), "```", ""]
    return out


def _sections(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """An existing catalogue split into its header lines and each assignment's lines, by folder name."""
    header: list[str] = []
    sections: dict[str, list[str]] = {}
    current = header
    for line in text.splitlines():
        m = re.match(r"## .*\(`([\w-]+)`\)$", line)
        if m:
            current = sections.setdefault(m.group(1), [])
        elif line == OLD_GRADER_HEADING:
            current = sections.setdefault(OLD_GRADER_HEADING, [])
        current.append(line)
    return header, sections


#: a section written by scripts/regrade_hostile_old.py (slow: run by hand), kept as it is by every run of this one
OLD_GRADER_HEADING = "## Against the grader before the sandbox"


def catalogue(names=None, previous: str | None = None) -> str:
    """The whole catalogue; with ``names``, only those assignments are graded again and the others' sections are
    kept from ``previous`` (the catalogue as the script last wrote it), header included.  The section of
    :data:`OLD_GRADER_HEADING` is always kept from ``previous``."""
    masters = sorted((ROOT / "assignments").glob("*/master.py"))
    header, kept = (_sections(previous) if names and previous else (None, {}))
    old_grader = _sections(previous)[1].get(OLD_GRADER_HEADING, []) if previous else []
    out = list(header) if header else _header()
    with tempfile.TemporaryDirectory() as tmp:
        for m in masters:
            name = m.parent.name
            if names and name not in names:
                if name in kept:
                    out += kept[name]
                continue
            out += _section(m, Path(tmp))
    while old_grader and not old_grader[-1].strip():
        old_grader.pop()
    out += old_grader + ([""] if old_grader else [])
    return "\n".join(out) + "\n"


def exercise_answers() -> str:
    import inspect

    from flashnb import exercises

    out = ["# Worked answers to the notebooks' exercises", "",
           "Made by `python scripts/course_catalogue.py` from `flashnb.exercises` (each exercise's explanation "
           "and the code of its solution, which `tests/exercises/test_exercises.py` checks passes the exercise's "
           "check). "
           "Learners see the same with `exercises.answer(\"NN.k\")`.", ""]
    exercises._load_all()
    for ex in sorted(exercises.EXERCISES.values(), key=lambda e: [int(x) for x in e.id.split(".")]):
        out += [f"## {ex.id} · {ex.title} ({ex.tag})", ""]
        if ex.explain:
            out += [inspect.cleandoc(ex.explain), ""]
        if ex.solution is not None:
            out += ["```python", inspect.cleandoc(inspect.getsource(ex.solution)), "```", ""]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import os

    os.environ.setdefault("FLASHNB_DEVICE", "sim")
    import flashnb  # noqa: F401

    names = sys.argv[1:]          # assignments to grade again (default: all); the others' sections are kept
    path = ROOT / "assignments" / "CATALOGUE.md"
    path.write_text(catalogue(names or None, path.read_text() if path.exists() else None))
    (ROOT / "assignments" / "EXERCISE_ANSWERS.md").write_text(exercise_answers())
    print("wrote assignments/CATALOGUE.md and assignments/EXERCISE_ANSWERS.md")
