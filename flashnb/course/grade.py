"""``flashnb course grade``: a folder of submitted notebooks -> ``scores.csv`` and one feedback file each.

Each submission is graded in a child process (simulator mode) that runs the bundle's setup cells, the
submission's ``answer`` cells (nothing else of the submission), then every test of the bundle, and reports
each test as it starts and ends.  The parent enforces each test's timeout: a test that hangs (an endless
loop, a barrier that never completes) or kills the process (a crash) is scored 0 with the reason, and a new
child goes on with the remaining tests -- one submission never stops the batch.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

#: seconds a child may take to start (import flashnb, run the setup and answer cells) before its first test
STARTUP_TIMEOUT = 120.0


def answer_cells(path) -> list[str]:
    """The sources of the cells tagged ``answer`` of a submitted notebook (``.ipynb``, or a jupytext ``.py``)."""
    from .build import read_master, tags

    nb = read_master(path)
    return [c["source"] for c in nb.cells if c["cell_type"] == "code" and "answer" in tags(c)]


def prose_cells(path) -> list[str]:
    from .build import read_master, tags

    nb = read_master(path)
    return [c["source"] for c in nb.cells if "answer-prose" in tags(c)]


# --------------------------------------------------------------------------- the child


def _child(bundle: str, answers_json: str, out: str, skip: list[str], done_json: str) -> None:
    import linecache

    os.environ.setdefault("FLASHNB_DEVICE", "sim")
    import flashnb  # noqa: F401  -- selects the simulator before numba.cuda is imported
    from flashnb import course

    bundle_p = Path(bundle)
    answers = json.loads(Path(answers_json).read_text())
    previous = json.loads(Path(done_json).read_text()) if done_json else {}
    log = open(out, "a", buffering=1)

    def emit(**rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()

    ns: dict = {"__name__": "__main__"}
    setup = (bundle_p / "setup.py").read_text()
    exec(compile(setup, "<setup>", "exec"), ns)
    problems = []
    for i, src in enumerate(answers, 1):
        code = "\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!"))) + "\n"
        name = f"<answer cell {i}>"
        linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
        try:
            exec(compile(code, name, "exec"), ns)
        except Exception as exc:   # noqa: BLE001 -- reported with every test that then fails
            problems.append(f"answer cell {i} raised {type(exc).__name__}: {exc}")
    emit(event="answers", problems=problems)
    course.reset()
    tests_ns: dict = {"__name__": "flashnb_course_tests"}     # the notebook's view: setup names, then tests
    for fname, text in (("<setup>", setup), ("<tests>", (bundle_p / "tests.py").read_text())):
        linecache.cache[fname] = (len(text), None, text.splitlines(keepends=True), fname)
        exec(compile(text, fname, "exec"), tests_ns)
    done = {k: course.Result(**v) for k, v in previous.items()}
    for t in list(course.TESTS.values()):
        if t.id in skip:
            continue
        emit(event="start", id=t.id)
        r = course.run_one(t, ns, done)
        if problems and not r.passed:
            r.message = (r.message + "\n" if r.message else "") + "; ".join(problems)
        done[t.id] = r
        emit(event="result", **r.__dict__)
    emit(event="end")
    log.close()
    sys.stdout.flush()
    os._exit(0)    # kernel threads of a timed-out test must not keep the process alive


# --------------------------------------------------------------------------- the parent


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for ln in path.read_text().splitlines():
        try:
            out.append(json.loads(ln))
        except json.JSONDecodeError:
            break    # a line cut by a crash
    return out


def grade_one(bundle, submission, work, *, cache_dir=None) -> dict:
    """Grade one submission; returns ``dict(student, results=[Result dicts], cpu_s, wall_s, problems)``."""
    from . import Result

    bundle, submission, work = Path(bundle), Path(submission), Path(work)
    manifest = json.loads((bundle / "manifest.json").read_text())
    tests = {t["id"]: t for t in manifest["tests"]}
    work.mkdir(parents=True, exist_ok=True)
    student = submission.stem
    results: dict[str, dict] = {}
    problems: list[str] = []
    try:
        answers = answer_cells(submission)
    except Exception as exc:   # noqa: BLE001 -- an unreadable notebook scores 0, the batch goes on
        answers, problems = [], [f"could not read the notebook: {type(exc).__name__}: {exc}"]
    if len(answers) != manifest["answer_cells"] and not problems:
        problems.append(f"{len(answers)} cells tagged 'answer', the assignment has {manifest['answer_cells']} "
                        "(keep the answer cells of the release, and their tags)")
    (work / "answers.json").write_text(json.dumps(answers))
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    attempts = 0
    while answers and len(results) < len(tests) and attempts <= len(tests):
        attempts += 1
        out = work / f"log{attempts}.jsonl"
        done_path = work / "done.json"
        done_path.write_text(json.dumps(results))
        cmd = [sys.executable, "-m", "flashnb.course.grade", "--child", str(bundle), str(work / "answers.json"),
               str(out), str(done_path), *results]
        env = dict(os.environ, FLASHNB_DEVICE="sim", PYTHONUNBUFFERED="1")
        if cache_dir is not None:      # compile verdicts shared by the batch (criteria.compiles)
            env["FLASHNB_COURSE_CACHE"] = str(cache_dir)
        err_path = work / f"stderr{attempts}.txt"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
            current, deadline, stop = None, time.monotonic() + STARTUP_TIMEOUT, None
            seen = 0
            while proc.poll() is None:
                time.sleep(0.1)
                events = _read(out)
                for ev in events[seen:]:
                    if ev["event"] == "answers":
                        problems.extend(p for p in ev["problems"] if p not in problems)
                    elif ev["event"] == "start":
                        current = ev["id"]
                        deadline = time.monotonic() + tests[current]["timeout"]
                    elif ev["event"] == "result":
                        results[ev["id"]] = {k: v for k, v in ev.items() if k != "event"}
                        current = None
                seen = len(events)
                if time.monotonic() > deadline:
                    stop = "timeout"
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
        for ev in _read(out)[seen:]:
            if ev["event"] == "result":
                results[ev["id"]] = {k: v for k, v in ev.items() if k != "event"}
                current = None if current == ev["id"] else current
            elif ev["event"] == "start":
                current = ev["id"]
        if len(results) == len(tests):
            break
        tail = err_path.read_text().strip().splitlines()[-3:]
        if current is None:     # died before its first test: setup or answer cells
            why = "timeout" if stop else "crash"
            for tid, t in tests.items():
                if tid not in results:
                    results[tid] = Result(tid, t["question"], t["points"], 0.0,
                                          f"the grader could not run your answer cells ({why}): "
                                          + " | ".join(tail), t["hidden"], 0.0, why).__dict__
            break
        t = tests[current]
        if stop == "timeout":
            msg = (f"stopped after {t['timeout']:g} s (an endless loop, or a barrier some threads never reach?);"
                   " the other tests went on")
        else:
            msg = f"the process died during this test (exit code {proc.returncode}): " + " | ".join(tail)
        results[current] = Result(current, t["question"], t["points"], 0.0, msg, t["hidden"], 0.0,
                                  stop or "crash").__dict__
    for tid, t in tests.items():   # no answer cells at all
        results.setdefault(tid, Result(tid, t["question"], t["points"], 0.0, "; ".join(problems) or "not run",
                                       t["hidden"], 0.0, "error").__dict__)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    ordered = [results[tid] for tid in tests]
    return dict(student=student, results=ordered, cpu_s=round(cpu, 1), wall_s=round(time.monotonic() - start, 1),
                problems=problems, prose=_prose(submission))


def _prose(submission) -> list[str]:
    try:
        return prose_cells(submission)
    except Exception:   # noqa: BLE001
        return []


def feedback(graded: dict, manifest: dict) -> str:
    from . import Result

    lines = [f"{manifest['title']} -- {graded['student']}", ""]
    for p in graded["problems"]:
        lines.append(f"! {p}")
    for r in graded["results"]:
        lines.append(Result(**r).line())
    got = sum(r["earned"] for r in graded["results"])
    total = sum(r["points"] for r in graded["results"])
    lines += ["", f"autograded: {got:g}/{total:g} points"]
    for m in manifest.get("manual", []):
        lines.append(f"graded by a person: {m['question']} ({m['points']:g} points) -- rubric: {m['rubric']}")
    if graded.get("prose"):
        lines += ["", "your written answers:"] + [p.strip() for p in graded["prose"]]
    lines.append(f"(graded in {graded['cpu_s']:g} CPU-seconds)")
    return "\n".join(lines) + "\n"


def grade(bundle, submissions, out_csv, *, feedback_dir=None, work_dir=None, progress=print) -> list[dict]:
    """Grade every ``*.ipynb`` (and jupytext ``*.py``) in ``submissions`` against ``bundle`` (an assignment's
    ``autograder/`` folder); write ``out_csv`` (one row per student) and ``feedback_dir/<student>.txt``."""
    import tempfile

    bundle, submissions, out_csv = Path(bundle), Path(submissions), Path(out_csv)
    if not (bundle / "manifest.json").exists():
        raise FileNotFoundError(f"{bundle} is not an autograder bundle (no manifest.json); run "
                                "'flashnb course release' first and pass <release>/<assignment>/autograder")
    manifest = json.loads((bundle / "manifest.json").read_text())
    subs = sorted(p for p in submissions.iterdir() if p.suffix in (".ipynb", ".py") and p.is_file())
    if not subs:
        raise FileNotFoundError(f"no submissions (*.ipynb) in {submissions}")
    feedback_dir = Path(feedback_dir) if feedback_dir else out_csv.parent / "feedback"
    feedback_dir.mkdir(parents=True, exist_ok=True)
    work_root = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="flashnb-grade-"))
    graded = []
    for sub in subs:
        g = grade_one(bundle, sub, work_root / sub.stem, cache_dir=work_root / "compile-cache")
        graded.append(g)
        (feedback_dir / f"{g['student']}.txt").write_text(feedback(g, manifest))
        got = sum(r["earned"] for r in g["results"])
        progress(f"{g['student']}: {got:g}/{sum(r['points'] for r in g['results']):g} ({g['cpu_s']:g} CPU-s)")
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    with open(out_csv, "w", newline="") as f:
        w = csv.writer(f)
        ids = [t["id"] for t in manifest["tests"]]
        w.writerow(["student", "autograded", "possible", "manual_possible", "cpu_seconds", *ids])
        for g in graded:
            w.writerow([g["student"], sum(r["earned"] for r in g["results"]),
                        sum(r["points"] for r in g["results"]), sum(m["points"] for m in manifest.get("manual", [])),
                        g["cpu_s"], *[r["earned"] for r in g["results"]]])
    return graded


if __name__ == "__main__":   # the child: python -m flashnb.course.grade --child BUNDLE ANSWERS OUT DONE [SKIP...]
    if len(sys.argv) >= 6 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[6:], sys.argv[5])
    else:
        sys.exit("usage: flashnb course grade ... (this module's main is the grader's child process)")
