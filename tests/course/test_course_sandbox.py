"""The operating-system sandbox of the course grader (flashnb/course/sandbox.py) on its own: what a process in it can
see, write, reach and leave behind; the grader refuses to grade where it cannot run unless told --no-sandbox; the
instructor's mistakes on the command line are one-line errors; submission names never collide."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashnb.course import grade, sandbox

pytestmark = pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox here: {sandbox.unavailable()}")


def _in_sandbox(code: str, tmp_path: Path, *, hide=(), scratch_mib=4, drop=True) -> subprocess.CompletedProcess:
    root = str(Path(grade.__file__).resolve().parents[2])
    prelude = f"import os, sys\nsys.path.insert(0, {root!r})\n"
    if drop:         # as the grader's child does: leave root before anything else runs
        prelude += "from flashnb.course.sandbox import drop_privileges\ndrop_privileges()\n"
    argv = sandbox.command([sys.executable, "-I", "-c", prelude + textwrap.dedent(code)],
                           scratch_mib=scratch_mib, hide=hide)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


def test_a_process_in_the_sandbox_sees_writes_and_reaches_only_its_own(tmp_path):
    secret = Path(sandbox.__file__).resolve().parents[2] / "assignments"     # beside the package: not bound
    site_dir = Path(os.__file__).parent                                      # bound read-only
    proc = _in_sandbox(f"""
        import socket, errno
        out = []
        out.append(os.getuid() != 0)
        out.append(os.path.exists({str(secret)!r}))
        out.append(os.path.exists({str(tmp_path)!r}))
        try:
            open(os.path.join({str(site_dir)!r}, 'zz_sandbox_probe'), 'w')
            out.append('wrote')
        except OSError as exc:
            out.append(exc.errno in (errno.EROFS, errno.EACCES))
        try:
            socket.create_connection(('10.255.255.1', 80), timeout=2)
            out.append('connected')
        except OSError:
            out.append(True)
        with open('/tmp/x', 'wb') as f:
            try:
                f.write(b'x' * (8 << 20))
                f.flush()
                out.append('wrote 8 MiB')
            except OSError as exc:
                out.append(exc.errno == errno.ENOSPC)
        out.append(sorted(int(p) for p in os.listdir('/proc') if p.isdigit())[:1] == [1])
        print(out)
        """, tmp_path, scratch_mib=4)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str([True, False, False, True, True, True, True]), proc.stdout
    assert not (site_dir / "zz_sandbox_probe").exists()


def test_a_hidden_folder_inside_a_bound_one_is_empty(tmp_path):
    inside = Path(sandbox.__file__).resolve().parents[1] / "kernels"    # bound, as part of the package
    proc = _in_sandbox(f"print(os.listdir({str(inside)!r}))", tmp_path, hide=[inside], drop=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_every_process_dies_with_the_sandbox(tmp_path):
    proc = _in_sandbox("""
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execve('/bin/sleep', ['sleep', '987.655'], {})
            os._exit(0)
        print('parent done')
        """, tmp_path)
    assert proc.returncode == 0 and "parent done" in proc.stdout, proc.stderr[-2000:]
    left = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"987.655" in (d / "cmdline").read_bytes():
                    left.append(int(d.name))
            except OSError:
                pass
    assert left == []


def _one_submission(tmp_path) -> tuple[Path, Path]:
    import nbformat

    from flashnb.course import build

    master = tmp_path / "tiny" / "master.py"
    master.parent.mkdir()
    master.write_text('''# %% [markdown]
# # Tiny
# %% tags=["setup"]
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
''')
    build.build(master, tmp_path / "rel")
    subs = tmp_path / "subs"
    subs.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("def f(x):\n    return x + 1\n", metadata={"tags": ["answer"]})]
    nbformat.write(nb, str(subs / "jane.ipynb"))
    return tmp_path / "rel" / "autograder", subs


def test_without_a_sandbox_the_grader_refuses_unless_told(tmp_path, monkeypatch, capsys):
    from flashnb import cli

    bundle, subs = _one_submission(tmp_path)
    monkeypatch.setattr(sandbox, "unavailable", lambda: "bubblewrap (bwrap) is not installed")
    with pytest.raises(sandbox.SandboxError, match="bwrap\\) is not installed.*--no-sandbox"):
        grade.grade(bundle, subs, tmp_path / "out" / "scores.csv", progress=lambda *_: None)
    assert not (tmp_path / "out" / "scores.csv").exists()
    assert cli.main(["course", "grade", str(bundle), str(subs), "--out", str(tmp_path / "o2" / "scores.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot sandbox" in err, err
    assert cli.main(["course", "grade", str(bundle), str(subs), "--out", str(tmp_path / "o3" / "scores.csv"),
                     "--no-sandbox"]) == 0
    row = (tmp_path / "o3" / "scores.csv").read_text().splitlines()
    assert row[0].split(",")[6] == "sandboxed" and row[1].split(",")[6] == "no" and row[1].split(",")[1] == "1.0"
    assert "without the operating-system sandbox" in (tmp_path / "o3" / "feedback" / "jane.txt").read_text()


def test_instructor_mistakes_are_one_line_errors(tmp_path, capsys):
    from flashnb import cli

    bundle, subs = _one_submission(tmp_path)
    (tmp_path / "afile").write_text("x")
    cases = [
        ([str(bundle), str(subs / "jane.ipynb")], "is a file, not a folder"),           # a notebook, not a folder
        ([str(bundle), str(subs), "--out", str(tmp_path / "afile" / "scores.csv")], "is a file, not a folder"),
        ([str(bundle), str(subs), "--out", str(subs)], "is a folder"),
        ([str(bundle), str(subs), "--out", str(tmp_path / "afile")], "expected a .csv file"),
        ([str(bundle), str(tmp_path / "nowhere")], "does not exist"),
    ]
    for args, says in cases:
        capsys.readouterr()
        assert cli.main(["course", "grade", *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, (args, err)


def test_submission_names_never_collide():
    names = grade.student_names([Path("s/jane.ipynb"), Path("s/jane.py"), Path("s/a b.ipynb"), Path("s/a_b.ipynb"),
                                 Path("s/..ipynb"), Path("s/Bob.ipynb"), Path("s/bob.py")])
    values = list(names.values())
    assert len({v.lower() for v in values}) == len(values), values
    assert names[Path("s/jane.ipynb")] == "jane.ipynb" and names[Path("s/jane.py")] == "jane.py"
    assert all(v and not v.startswith(".") and "/" not in v and " " not in v for v in values), values


def test_a_notebook_of_another_assignment_says_so(tmp_path):
    import nbformat

    bundle, subs = _one_submission(tmp_path)
    nb = nbformat.read(str(subs / "jane.ipynb"), as_version=4)
    nb.metadata["flashnb_course"] = {"assignment": "a3_fa2_forward"}
    nbformat.write(nb, str(subs / "joe.ipynb"))
    graded = {g["student"]: g for g in grade.grade(bundle, subs, tmp_path / "out" / "scores.csv",
                                                   progress=lambda *_: None)}
    assert "this notebook is assignment a3_fa2_forward's, and it was graded with tiny's bundle" in \
        graded["joe"]["problems"][0]
    assert graded["joe"]["results"][0]["earned"] == 0 and graded["jane"]["results"][0]["earned"] == 1
    released = nbformat.read(str(bundle.parent / "student" / "tiny.ipynb"), as_version=4)
    assert released.metadata["flashnb_course"] == {"assignment": "tiny"}


def test_a_folder_where_a_feedback_file_goes_costs_only_that_file(tmp_path):
    import shutil

    bundle, subs = _one_submission(tmp_path)
    shutil.copy(subs / "jane.ipynb", subs / "joe.ipynb")
    (tmp_path / "out" / "feedback" / "jane.txt").mkdir(parents=True)      # made by someone, before the batch
    lines = []
    graded = grade.grade(bundle, subs, tmp_path / "out" / "scores.csv", progress=lines.append)
    assert [g["student"] for g in graded] == ["jane", "joe"]
    rows = (tmp_path / "out" / "scores.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["jane", "joe"] and all(r.split(",")[1] == "1.0" for r in rows[1:])
    assert "autograded: 1/1" in (tmp_path / "out" / "feedback" / "joe.txt").read_text()
    assert any("jane: the feedback file" in ln and "could not be written" in ln for ln in lines), lines
    assert not list((tmp_path / "out").rglob("*.tmp"))


def test_a_python_under_tmp_stays_visible_over_the_private_scratch(tmp_path, monkeypatch):
    """A checkout or virtual environment under /tmp (where the private scratch is mounted) is bound on top of the
    scratch, read-only: a file of it is readable inside, and writing to it is refused."""
    outside = Path(sandbox.SCRATCH) / f"flashnb-sandbox-test-{os.getpid()}"
    outside.mkdir(exist_ok=True)
    try:
        (outside / "marker.txt").write_text("seen")
        paths = sandbox._python_paths()
        monkeypatch.setattr(sandbox, "_python_paths", lambda: paths + [outside])   # as a venv made under /tmp
        argv = sandbox.command([sys.executable, "-I", "-c", f"""
print(open({str(outside / 'marker.txt')!r}).read())
try:
    open({str(outside / 'new.txt')!r}, 'w')
    print('writable')
except OSError:
    print('read-only')
"""], scratch_mib=4)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["seen", "read-only"], r.stdout
    finally:
        for f in outside.iterdir():
            f.unlink()
        outside.rmdir()
