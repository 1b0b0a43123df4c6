"""``flashnb course gradescope``: an assignment's bundle as a Gradescope autograder (``autograder.zip``).

Gradescope's autograder format (https://gradescope-autograders.readthedocs.io/en/latest/specs/): a zip with
``setup.sh`` (run once, as root, to build the image: here it installs flashnb into ``/autograder/venv``) and
``run_autograder`` (run for each submission in a fresh container, working directory ``/autograder``).  The zip
is unpacked into ``/autograder/source``; the student's files are in ``/autograder/submission``; the results go
to ``/autograder/results/results.json``: one entry per test with its ``score``, ``max_score``, ``name``,
``output`` (the grader's message) and ``visibility`` -- ``after_published`` for the hidden tests (their names,
points and messages appear when the instructor publishes the grades), ``visible`` for the public ones.

The zip holds the bundle's ``setup.py``, ``tests.py``, ``manifest.json`` and a ``hashes.json`` of those three --
not ``solution.ipynb``, which grading never needs and a submission must not find in its container.
``run_autograder`` grades with :func:`flashnb.course.grade.grade`, so the screen, the limits and the checks of
the bundle all apply; Gradescope adds a container per submission.  ``$AUTOGRADER_ROOT`` (default
``/autograder``) and ``$FLASHNB_PYTHON`` (default ``/autograder/venv/bin/python``) let the same script run
outside Gradescope, on a folder laid out the same way (``tests/course/test_course_hostile.py`` does).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

GRADED_FILES = ("setup.py", "tests.py", "manifest.json")

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, to build the autograder's image: Python and flashnb in /autograder/venv.
set -euo pipefail
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3 python3-venv python3-pip bubblewrap
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install -q --upgrade pip
/autograder/venv/bin/pip install -q {spec}
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission: grade the notebook in $ROOT/submission with the bundle in
# $ROOT/source/bundle, write $ROOT/results/results.json.  ROOT is $AUTOGRADER_ROOT (default /autograder).
set -u
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PY="${FLASHNB_PYTHON:-$ROOT/venv/bin/python}"
[ -x "$PY" ] || PY=python3
cd "$ROOT"
exec "$PY" -m flashnb.course.gradescope run --root "$ROOT"
"""


def build(bundle, out_zip, *, install: str = "flashnb[course]") -> Path:
    """Write Gradescope's ``autograder.zip`` for ``bundle`` (an assignment's ``autograder/`` folder, checked
    against its ``hashes.json`` first); ``install`` is the pip requirement ``setup.sh`` installs (the course's
    copy of flashnb: a version, a git URL or a wheel's URL)."""
    import shlex

    from .grade import Bundle

    b = Bundle(bundle)                     # refuses a bundle that differs from what its release hashed
    out_zip = Path(out_zip)
    out_zip.parent.mkdir(parents=True, exist_ok=True)
    hashes = {n: hashlib.sha256(b.files[n]).hexdigest() for n in GRADED_FILES}
    with zipfile.ZipFile(out_zip, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in (("setup.sh", SETUP_SH.format(spec=shlex.quote(install))),
                           ("run_autograder", RUN_AUTOGRADER)):
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o755 << 16      # executable once unpacked
            z.writestr(info, text)
        for name in GRADED_FILES:
            z.writestr(zipfile.ZipInfo(f"bundle/{name}", date_time=(2020, 1, 1, 0, 0, 0)), b.files[name])
        z.writestr(zipfile.ZipInfo("bundle/hashes.json", date_time=(2020, 1, 1, 0, 0, 0)),
                   json.dumps(hashes, indent=1) + "\n")
    return out_zip


def results(graded: dict, manifest: dict, seconds: float) -> dict:
    """Gradescope's ``results.json`` for one graded submission."""
    tests = []
    for r in graded["results"]:
        out = r["message"] or "passed"
        tests.append(dict(name=r["id"], score=r["earned"], max_score=r["points"], output=out,
                          visibility="after_published" if r["hidden"] else "visible"))
    notes = list(graded["problems"])
    for m in manifest.get("manual", []):
        notes.append(f"graded by a person: {m['question']} ({m['points']:g} points)")
    return dict(execution_time=int(round(seconds)), output="\n".join(notes), tests=tests,
                stdout_visibility="hidden")


def run(root) -> dict:
    """Grade the notebook in ``root/submission`` with ``root/source/bundle``; write and return
    ``root/results/results.json`` -- written whole (a temporary file replaced), and only once every process of
    the submission is gone (:func:`flashnb.course.grade.grade` returns then).  The submission runs in the
    bubblewrap sandbox where the container allows one; where it does not, Gradescope's container is the only
    boundary, and the results say so."""
    import os

    from . import sandbox as sandboxing
    from .grade import _atomic_write, grade

    root = Path(root)
    bundle = root / "source" / "bundle"
    manifest = json.loads((bundle / "manifest.json").read_text())
    (root / "results").mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    found = sorted(p for p in (root / "submission").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts) \
        if (root / "submission").is_dir() else []
    if not found:
        out = dict(score=0.0, output="no notebook (.ipynb) in the submission: submit the assignment's notebook",
                   tests=[dict(name=t["id"], score=0.0, max_score=t["points"], output="no notebook submitted",
                               visibility="after_published" if t["hidden"] else "visible")
                          for t in manifest["tests"]])
    else:
        work = Path(tempfile.mkdtemp(prefix="flashnb-gradescope-"))
        os.chmod(work, 0o700)
        try:
            (work / "subs").mkdir()
            shutil.copy(found[0], work / "subs" / "submission.ipynb")
            graded = grade(bundle, work / "subs", work / "out" / "scores.csv", work_dir=work / "scratch",
                           progress=lambda line: print(line, flush=True),
                           sandbox=sandboxing.unavailable() is None)[0]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out = results(graded, manifest, time.monotonic() - start)
        if len(found) > 1:
            out["output"] = (f"graded {found[0].name} (the submission holds {len(found)} notebooks)\n"
                             + out["output"]).strip()
    _atomic_write(root / "results" / "results.json", json.dumps(out, indent=1) + "\n")
    return out


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m flashnb.course.gradescope",
                                description="Gradescope's run_autograder: grade ROOT/submission into "
                                            "ROOT/results/results.json")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", default="/autograder")
    args = p.parse_args(argv)
    out = run(args.root)
    print(f"{sum(t['score'] for t in out['tests']):g}/{sum(t['max_score'] for t in out['tests']):g} points -> "
          f"{Path(args.root) / 'results' / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
