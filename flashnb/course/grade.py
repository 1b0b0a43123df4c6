"""``flashnb course grade``: a folder of submitted notebooks -> ``scores.csv`` and one feedback file each.

What a submission's code can do to its grade, to other grades and to the grading machine is bounded in layers
(``assignments/README.md``, "Threat model"):

1. **The screen** (:mod:`flashnb.course.screen`) reads the answer cells before anything runs and refuses what
   an answer never needs (other imports, changing modules' objects, dunders, exec, files, processes); a refused
   submission scores 0 with the lines and the rule.
2. **A child process per submission** (:mod:`flashnb.course.child`) runs the bundle's setup, the answer cells
   (nothing else of the notebook) and the tests, in a scratch folder of its own (its cwd, ``HOME``, ``TMPDIR``
   and caches, removed afterwards), with a clean environment and no path to the bundle: the setup and tests
   reach it on stdin, read from the copy this process verified.
3. **Process limits**: CPU seconds for the whole submission (all its processes), address space, the size of
   what it prints and of any file it writes, processes and threads; a test's time limit.  What a limit stops
   scores 0 with the reason; a fresh child goes on with the remaining tests, and the batch with the next
   student.
4. **An authenticated channel**: the child reports on a pipe, each record tagged with an HMAC under a secret
   only the child's harness holds; a record that fails the check, or an integrity change the child reports
   (:func:`flashnb.course.child.changes`), scores the whole submission 0.  Points come from this process's
   manifest, never from the child.
5. **The bundle** is hashed against the ``hashes.json`` the release wrote, held in memory, and checked again
   before and after every submission; a change is undone from memory, and the submission that made it scores 0
   (with ``--jobs``, the submissions that ran in that window are graded again one at a time to find it).
"""

from __future__ import annotations

import csv
import hashlib
import hmac
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .build import BUNDLE_FILES, bundle_hashes  # noqa: F401  (re-exported: the grader's checks of a bundle)

#: files a bundle holds, each hashed in its ``hashes.json`` (``solution.ipynb`` and ``removed.json`` are for
#: teaching assistants: the grader checks them but never sends them to a child)
GIB = 1 << 30
MIB = 1 << 20


@dataclass
class Limits:
    """What one submission may use.  ``cpu_s``: CPU seconds of all its processes together (the course's goal is
    at most 3 CPU-minutes per submission); ``memory_gib``: address space of each of its processes (the
    simulator's threads reserve a stack each, so this counts more than the memory in use; the course tests grade
    every solution under the default); ``output_mib``: what it may print (stdout and stderr together) and the
    largest file it may write; ``processes``: processes and threads it may add to what the grading account
    already runs, times the submissions graded at once (the kernel counts them per account, not per process,
    and does not hold root to it: grade as an ordinary account, best one of its own); ``startup_s``: wall
    seconds for the setup and answer cells, before the first test."""

    cpu_s: float = 180.0
    memory_gib: float = 4.0
    output_mib: float = 8.0
    processes: int = 4096
    startup_s: float = 120.0

    def __post_init__(self):
        for name in ("cpu_s", "memory_gib", "output_mib", "startup_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)!r}")
        if int(self.processes) < 16:
            raise ValueError(f"Limits.processes must be at least 16 (the simulator runs a thread per CUDA thread), "
                             f"got {self.processes!r}")


class BundleError(RuntimeError):
    """A bundle that cannot be trusted: a file missing, or different from what its release hashed."""


class Bundle:
    """An autograder bundle held in memory after checking it against the ``hashes.json`` its release wrote."""

    def __init__(self, path):
        self.path = Path(path)
        if not (self.path / "manifest.json").exists():
            raise FileNotFoundError(f"{self.path} is not an autograder bundle (no manifest.json); run "
                                    "'flashnb course release' first and pass <release>/<assignment>/autograder")
        hashes_path = self.path / "hashes.json"
        if not hashes_path.exists():
            raise BundleError(f"{self.path} has no hashes.json (made by an older flashnb course release): "
                              "release it again, so the grader can check the bundle before each submission")
        self.hashes_bytes = hashes_path.read_bytes()
        self.hashes = json.loads(self.hashes_bytes)
        self.files: dict[str, bytes] = {}
        for name, digest in self.hashes.items():
            data = (self.path / name).read_bytes() if (self.path / name).exists() else None
            if data is None or hashlib.sha256(data).hexdigest() != digest:
                raise BundleError(f"{self.path / name} does not match the hash its release recorded in hashes.json "
                                  "(changed since 'flashnb course release'?): release it again")
            self.files[name] = data
        self.manifest = json.loads(self.files["manifest.json"])
        self.setup = self.files["setup.py"].decode()
        self.tests_text = self.files["tests.py"].decode()
        self.digest = hashlib.sha256(self.hashes_bytes).hexdigest()
        self.lock = threading.Lock()

    def changed(self) -> list[str]:
        """The bundle's files that differ on disk from the verified copy (deleted ones included)."""
        out = []
        for name, data in list(self.files.items()) + [("hashes.json", self.hashes_bytes)]:
            p = self.path / name
            try:
                same = p.read_bytes() == data
            except OSError:
                same = False
            if not same:
                out.append(name)
        return out

    def restore(self) -> None:
        """Write the verified copy back over what changed."""
        for name, data in list(self.files.items()) + [("hashes.json", self.hashes_bytes)]:
            p = self.path / name
            try:
                if p.is_symlink() or p.is_dir():
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                if not p.exists() or p.read_bytes() != data:
                    p.write_bytes(data)
            except OSError as exc:
                raise BundleError(f"{p} was changed during grading and cannot be restored ({exc})") from None


def answer_cells(path) -> list[str]:
    """The sources of the cells tagged ``answer`` of a submitted notebook (``.ipynb``, or a jupytext ``.py``)."""
    from .build import read_master, tags

    nb = read_master(path)
    return [c["source"] for c in nb.cells if c["cell_type"] == "code" and "answer" in tags(c)]


def prose_cells(path) -> list[str]:
    from .build import read_master, tags

    nb = read_master(path)
    return [c["source"] for c in nb.cells if "answer-prose" in tags(c)]


def _code(src: str) -> str:
    return "\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!"))) + "\n"


# --------------------------------------------------------------------------- processes (Linux: /proc)


_PROC = Path("/proc")
_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int):
    """(ppid, session id, CPU seconds of the process and its reaped children) from /proc, or None."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    ppid, sid = int(fields[1]), int(fields[3])
    cpu = sum(int(f) for f in fields[11:15]) / _CLK
    return ppid, sid, cpu


def _tagged(sid: int, tag: str | None) -> list[int]:
    """The processes of one submission: its child's session (setsid), and (``tag``) any that left it but still
    carry its tag."""
    if not _PROC.is_dir():
        return []
    out = []
    needle = tag.encode() if tag else b""
    for d in _PROC.iterdir():
        if not d.name.isdigit():
            continue
        pid = int(d.name)
        st = _proc_stat(pid)
        if st is None or pid == os.getpid():
            continue
        if st[1] == sid:
            out.append(pid)
            continue
        if not tag:
            continue
        try:
            if needle in (d / "environ").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


def _tree_cpu(pids) -> float:
    return sum((_proc_stat(p) or (0, 0, 0.0))[2] for p in pids)


def _kill_all(sid: int, tag: str) -> None:
    """SIGKILL every process of a submission (its session, and what escaped it with its tag), then reap those
    that were re-parented to this process."""
    for _ in range(3):
        pids = _tagged(sid, tag)
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
    _reap_orphans()


_LIVE: set[int] = set()       # this process's grading children, reaped only by their own _Run


def _reap_orphans() -> None:
    """Reap what was re-parented here (a submission's processes that outlived their parent), never a grading
    child another thread is still watching."""
    if not _PROC.is_dir():
        return
    me = os.getpid()
    for d in _PROC.iterdir():
        if d.name.isdigit() and int(d.name) not in _LIVE:
            st = _proc_stat(int(d.name))
            if st is not None and st[0] == me:
                try:
                    os.waitpid(int(d.name), os.WNOHANG)
                except ChildProcessError:
                    pass


def _subreaper(on: bool) -> bool:
    """Make this process the subreaper of its descendants (Linux), so that a process a submission leaves behind
    is re-parented here and can be found and ended; returns whether it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1 if on else 0, 0, 0, 0) == 0     # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _uid_tasks() -> int:
    """Processes and threads this account runs now (what RLIMIT_NPROC counts)."""
    if not _PROC.is_dir():
        return 0
    uid, n = os.getuid(), 0
    for d in _PROC.iterdir():
        if d.name.isdigit():
            try:
                status = (d / "status").read_text()
            except OSError:
                continue
            fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
            if int(fields.get("Uid", "-1").split()[0]) == uid:
                n += int(fields.get("Threads", "1"))
    return n


def _child_env(scratch: Path, tag: str) -> dict:
    """A clean environment: the toolchain's paths and flashnb's own settings pass, nothing else of the grader's
    (no tokens, no paths to the bundle); every cache and temporary file goes into the scratch folder."""
    keep = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "VIRTUAL_ENV",
            "CONDA_PREFIX", "SYSTEMROOT")
    env = {k: v for k, v in os.environ.items() if k in keep or (k.startswith(("NUMBA_", "FLASHNB_")) and k not in (
        "FLASHNB_COURSE_CACHE", "FLASHNB_PTX_CACHE"))}
    home = scratch / "home"
    env.update(HOME=str(home), TMPDIR=str(scratch / "tmp"), XDG_CACHE_HOME=str(scratch / "cache"),
               FLASHNB_PTX_CACHE=str(scratch / "cache" / "ptx"),
               FLASHNB_COURSE_CACHE=str(scratch / "cache" / "verdicts"),
               MPLCONFIGDIR=str(scratch / "cache" / "matplotlib"), FLASHNB_DEVICE="sim", PYTHONUNBUFFERED="1",
               PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", FLASHNB_GRADE_RUN=tag)
    env.setdefault("FLASHNB_INSPECT_PROCESSES", "1")
    return env


# --------------------------------------------------------------------------- one child


class _Run:
    """One child process: spawned, fed its payload, watched (deadlines, CPU, output), its records checked."""

    def __init__(self, bundle: Bundle, answers, skip, done, scratch: Path, limits: Limits, cpu_left: float,
                 jobs: int = 1):
        self.events: list[dict] = []
        self.stop: str | None = None          # why this process was stopped (timeout, cpu, output, forged)
        self.forged = ""
        self.stderr_tail = b""
        self.output = 0
        self.current: str | None = None
        self.cpu = 0.0
        secret = secrets.token_bytes(32)
        self.secret = secret
        self.tag = secrets.token_hex(16)
        r, w = os.pipe()
        env = _child_env(scratch, self.tag)
        root = str(Path(__file__).resolve().parents[2])
        cmd = [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
               "from flashnb.course.child import main; main()", root]
        work = scratch / "work"
        for d in (work, scratch / "home", scratch / "tmp", scratch / "cache"):
            d.mkdir(parents=True, exist_ok=True)
        nproc = None
        if os.geteuid() != 0:      # per account: what it runs now, and this much more for each submission at once
            nproc = _uid_tasks() + int(limits.processes) * max(1, int(jobs))
        payload = dict(secret=secret.hex(), fd=w, setup=bundle.setup, tests=bundle.tests_text, answers=answers,
                       skip=sorted(skip), done=done,
                       limits=dict(cpu=max(1, int(cpu_left + 0.999)), memory=int(limits.memory_gib * GIB),
                                   output=int(limits.output_mib * MIB), nproc=nproc))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=str(work), env=env, pass_fds=(w,), start_new_session=True)
        _LIVE.add(self.proc.pid)
        os.close(w)
        self.channel = os.fdopen(r, "rb", buffering=0)
        try:
            self.proc.stdin.write(json.dumps(payload).encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.seq = 0
        self.buf = b""

    def _record(self, line: bytes) -> dict | None:
        try:
            text, tag = line.decode().rsplit("\t", 1)
        except (UnicodeDecodeError, ValueError):
            return None
        want = hmac.new(self.secret, f"{self.seq}\t{text}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(tag.strip(), want):
            return None
        try:
            rec = json.loads(text)
        except json.JSONDecodeError:
            return None
        self.seq += 1
        return rec if isinstance(rec, dict) else None

    def watch(self, tests: dict, limits: Limits, cpu_left: float, on_event) -> None:
        """Read the child's output until it ends, stopping it at a deadline or a limit; ``on_event(record)`` is
        called for each authenticated record."""
        self.tests, self.limits, self.on_event = tests, limits, on_event
        sel = selectors.DefaultSelector()
        sel.register(self.channel, selectors.EVENT_READ, "channel")
        sel.register(self.proc.stdout, selectors.EVENT_READ, "out")
        sel.register(self.proc.stderr, selectors.EVENT_READ, "err")
        open_streams = 3
        self.deadline = time.monotonic() + limits.startup_s
        next_cpu_check = 0.0
        cap = int(limits.output_mib * MIB)
        try:
            while open_streams and self.stop is None:
                for key, _ in sel.select(timeout=0.1):
                    data = os.read(key.fileobj.fileno(), 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                        open_streams -= 1
                    elif key.data == "channel":
                        self._channel(data)
                    else:
                        self.output += len(data)
                        if key.data == "err":
                            self.stderr_tail = (self.stderr_tail + data)[-4000:]
                        if self.output > cap:
                            self._kill("output")
                    if self.stop is not None:
                        break
                if self.stop is not None:
                    break
                now = time.monotonic()
                if now > self.deadline:
                    self._kill("timeout")
                    break
                if now > next_cpu_check:
                    next_cpu_check = now + 0.5
                    if _tree_cpu(_tagged(self.proc.pid, None)) > cpu_left + 1.0:
                        self._kill("cpu")
                        break
                if self._exited() and open_streams and not sel.select(timeout=0):
                    # exited: whatever it left in the pipes was read above; descendants may hold them open
                    break
        finally:
            sel.close()
            self._finish()

    def _channel(self, data: bytes) -> None:
        self.buf += data
        while b"\n" in self.buf and self.stop != "forged":
            line, self.buf = self.buf.split(b"\n", 1)
            rec = self._record(line)
            if rec is None:
                self.forged = line[:200].decode(errors="replace")
                self._kill("forged")
                return
            ev = rec.get("event")
            if ev == "start":
                self.current = rec.get("id")
                self.deadline = time.monotonic() + self.tests.get(self.current, {}).get("timeout", 120.0)
            elif ev == "result":
                self.current = None
                self.deadline = time.monotonic() + self.limits.startup_s
            self.events.append(rec)
            self.on_event(rec)
        if len(self.buf) > MIB:
            self.forged = "a record longer than 1 MiB"
            self._kill("forged")

    def _drain(self) -> None:
        """After the child is gone: the records it wrote before it ended (only it held the channel)."""
        end = time.monotonic() + 1.0       # a process that escaped with the channel open must not hold us
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.channel, selectors.EVENT_READ)
                while self.stop != "forged" and time.monotonic() < end:
                    if not sel.select(timeout=0.1):
                        continue
                    data = os.read(self.channel.fileno(), 65536)
                    if not data:
                        break
                    self._channel(data)
        except OSError:
            pass

    def _exited(self) -> bool:
        """Has the child exited?  (Not reaped: :meth:`_finish` reaps it with its resource usage.)"""
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except (ChildProcessError, AttributeError, OSError):
            return self.proc.poll() is not None

    def _kill(self, why: str) -> None:
        if self.stop is None or why == "forged":
            self.stop = why
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass

    def _finish(self) -> None:
        _kill_all(self.proc.pid, self.tag)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            _, status, usage = os.wait4(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            self.cpu = usage.ru_utime + usage.ru_stime
        except ChildProcessError:
            self.proc.wait()
        _LIVE.discard(self.proc.pid)
        if hasattr(self, "on_event"):
            self._drain()
        for f in (self.channel, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        if self.proc.returncode == -signal.SIGXCPU and self.stop is None:
            self.stop = "cpu"
        if self.proc.returncode == -signal.SIGXFSZ and self.stop is None:
            self.stop = "output"


def _result(tid: str, t: dict, status: str, message: str = "", seconds: float = 0.0) -> dict:
    from . import Result

    earned = float(t["points"]) if status == "pass" else 0.0
    return asdict(Result(tid, t["question"], float(t["points"]), earned, message, bool(t["hidden"]),
                         round(float(seconds), 3), status))


def _zero_all(tests: dict, status: str, message: str) -> list[dict]:
    return [_result(tid, t, status, message) for tid, t in tests.items()]


def grade_one(bundle, submission, work, *, limits: Limits | None = None, screen: bool = True,
              jobs: int = 1) -> dict:
    """Grade one submission; returns ``dict(student, results=[Result dicts], cpu_s, wall_s, problems, prose)``.

    ``bundle``: a :class:`Bundle` (or its folder); ``work``: a folder for the submission's scratch (removed
    afterwards); ``screen=False`` skips the static screen (for a submission a person has read and trusts);
    ``jobs``: how many submissions are graded at once (the process limit is per account)."""
    from . import screen as screening

    limits = limits or Limits()
    bundle = bundle if isinstance(bundle, Bundle) else Bundle(bundle)
    submission, work = Path(submission), Path(work)
    tests = {t["id"]: t for t in bundle.manifest["tests"]}
    student = submission.stem
    start = time.monotonic()
    problems: list[str] = []

    def finished(results, cpu=0.0, status=None) -> dict:
        ordered = [results[tid] for tid in tests]
        return dict(student=student, results=ordered, cpu_s=round(cpu, 1), wall_s=round(time.monotonic() - start, 1),
                    problems=problems, prose=_prose(submission), status=status)

    try:
        answers = [_code(a) for a in answer_cells(submission)]
    except Exception as exc:   # noqa: BLE001 -- an unreadable notebook scores 0, the batch goes on
        problems.append(f"could not read the notebook: {type(exc).__name__}: {exc}")
        return finished({r["id"]: r for r in _zero_all(tests, "error", problems[0])})
    if not answers:
        problems.append("no cells tagged 'answer' (keep the answer cells of the release, and their tags)")
        return finished({r["id"]: r for r in _zero_all(tests, "error", problems[0])})
    if len(answers) != bundle.manifest["answer_cells"]:
        problems.append(f"{len(answers)} cells tagged 'answer', the assignment has {bundle.manifest['answer_cells']} "
                        "(keep the answer cells of the release, and their tags)")
    if screen:
        found = screening.screen(answers)
        if found:
            msg = ("the grader refused to run this submission: it uses what answers never need "
                   "(assignments/README.md, 'Threat model'):\n" + "\n".join(str(f) for f in found[:10])
                   + (f"\n... and {len(found) - 10} more" if len(found) > 10 else ""))
            problems.append(msg)
            short = f"not run: the grader refused this submission ({len(found)} line(s) listed at the top)"
            return finished({r["id"]: r for r in _zero_all(tests, "refused", short)}, status="refused")
    results: dict[str, dict] = {}
    cpu_used = 0.0
    attempts = 0
    verdict = None          # "tampered" / "forged": the whole submission scores 0
    scratch = Path(tempfile.mkdtemp(prefix="sub-", dir=str(_mkdir(work))))
    try:
        while len(results) < len(tests) and attempts <= len(tests) and verdict is None:
            attempts += 1
            cpu_left = limits.cpu_s - cpu_used
            if cpu_left <= 0.5:
                for tid, t in tests.items():
                    results.setdefault(tid, _result(tid, t, "limit", f"not run: the submission used its "
                                                    f"{limits.cpu_s:g} CPU-seconds (the grader's limit)"))
                break
            answered = {"seen": False}
            tampered: list = []

            def on_event(rec, answered=answered, tampered=tampered):
                ev = rec.get("event")
                if ev == "answers":
                    answered["seen"] = True
                    problems.extend(str(p) for p in rec.get("problems", []) if str(p) not in problems)
                elif ev == "result" and rec.get("id") in tests and rec["id"] not in results:
                    status = rec.get("status")
                    status = status if status in ("pass", "fail", "error", "skipped", "limit") else "error"
                    results[rec["id"]] = _result(rec["id"], tests[rec["id"]], status, str(rec.get("message", "")),
                                                 rec.get("seconds", 0.0))
                elif ev == "tampered":
                    tampered.append(rec)

            run = _Run(bundle, answers, set(results), results, scratch, limits, cpu_left, jobs)
            run.watch(tests, limits, cpu_left, on_event)
            cpu_used += run.cpu
            if run.stop == "forged":
                verdict = ("forged", "the grader received a result it did not write (a forged record on its "
                                     f"channel: {run.forged[:120]!r}); the whole submission scores 0")
                break
            if tampered:
                what = "; ".join(tampered[0].get("changes", []))[:600]
                verdict = ("tampered", "the submission changed the grader's objects while it ran (" + what
                           + "); the whole submission scores 0")
                break
            if len(results) == len(tests):
                break
            tail = " | ".join(run.stderr_tail.decode(errors="replace").strip().splitlines()[-3:])
            why = _why(run, limits)
            if not answered["seen"]:     # died or was stopped before its first test: setup or answer cells
                for tid, t in tests.items():
                    if tid not in results:
                        results[tid] = _result(tid, t, run.stop or "crash",
                                               f"the grader could not run your answer cells ({why}): " + tail)
                break
            current = run.current
            if current is None or current in results:
                continue                 # between two tests: a fresh child goes on
            t = tests[current]
            if run.stop == "timeout":
                msg = (f"stopped after {t['timeout']:g} s (an endless loop, or a barrier some threads never reach?);"
                       " the other tests went on")
            elif run.stop in ("cpu", "output"):
                msg = f"{why}; the other tests went on"
            else:
                msg = f"the process died during this test (exit code {run.proc.returncode}): " + tail
            results[current] = _result(current, t, run.stop or "crash", msg)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if verdict is not None:
        problems.append(verdict[1])
        results = {r["id"]: r for r in _zero_all(tests, verdict[0], verdict[1])}
    for tid, t in tests.items():
        results.setdefault(tid, _result(tid, t, "error", "; ".join(problems) or "not run"))
    return finished(results, cpu_used, verdict[0] if verdict else None)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _why(run: _Run, limits: Limits) -> str:
    if run.stop == "timeout":
        return "timeout"
    if run.stop == "cpu":
        return f"stopped at the grader's CPU limit ({limits.cpu_s:g} CPU-seconds per submission)"
    if run.stop == "output":
        return f"stopped after printing more than {limits.output_mib:g} MiB (the grader's output limit)"
    return "crash"


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


# --------------------------------------------------------------------------- the batch


class _Guard:
    """Checks the bundle on disk before and after every submission; finds who changed it."""

    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        self.lock = threading.Lock()
        self.active: set[str] = set()
        self.window: set[str] = set()     # submissions that ran since the last clean check
        self.suspects: list[set[str]] = []

    def _check(self) -> None:
        changed = self.bundle.changed()
        if changed:
            self.bundle.restore()
            self.suspects.append(self.window | self.active)
            self.changed = changed
        self.window = set(self.active)

    def begin(self, student: str) -> None:
        with self.lock:
            self._check()
            self.active.add(student)
            self.window.add(student)

    def end(self, student: str) -> None:
        with self.lock:
            self.active.discard(student)
            self._check()


def grade(bundle, submissions, out_csv, *, feedback_dir=None, work_dir=None, progress=print, jobs: int = 1,
          limits: Limits | None = None, screen: bool = True) -> list[dict]:
    """Grade every ``*.ipynb`` (and jupytext ``*.py``) in ``submissions`` against ``bundle`` (an assignment's
    ``autograder/`` folder); write ``out_csv`` (one row per student) and ``feedback_dir/<student>.txt``.

    ``jobs`` submissions are graded at once (each in its own processes); the CSV, the feedback and the progress
    lines come out in the students' order whatever finishes first.  ``limits``: :class:`Limits`; ``screen``:
    see :func:`grade_one`."""
    from concurrent.futures import ThreadPoolExecutor

    limits = limits or Limits()
    if int(jobs) < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs!r}")
    bundle = Bundle(bundle)
    submissions, out_csv = Path(submissions), Path(out_csv)
    manifest = bundle.manifest
    subs = sorted(p for p in submissions.iterdir() if p.suffix in (".ipynb", ".py") and p.is_file())
    if not subs:
        raise FileNotFoundError(f"no submissions (*.ipynb) in {submissions}")
    feedback_dir = Path(feedback_dir) if feedback_dir else out_csv.parent / "feedback"
    feedback_dir.mkdir(parents=True, exist_ok=True)
    work_root = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="flashnb-grade-"))
    own_root = not work_dir
    guard = _Guard(bundle)
    reaping = _subreaper(True)
    done: dict[str, dict] = {}
    shown = [0]
    show_lock = threading.Lock()

    def one(sub: Path) -> dict:
        guard.begin(sub.stem)
        try:
            g = grade_one(bundle, sub, work_root / sub.stem, limits=limits, screen=screen, jobs=int(jobs))
        finally:
            guard.end(sub.stem)
        done[sub.stem] = g
        with show_lock:            # progress in the students' order, as soon as the next one is done
            while shown[0] < len(subs) and subs[shown[0]].stem in done:
                _progress(progress, done[subs[shown[0]].stem])
                shown[0] += 1
        return g

    try:
        if int(jobs) == 1:
            for sub in subs:
                one(sub)
        else:
            with ThreadPoolExecutor(max_workers=int(jobs)) as pool:
                list(pool.map(one, subs))
        # a change of the bundle: who was running?  Alone: that one.  Several: each again, alone.
        culprits: set[str] = set()
        for group in guard.suspects:
            if len(group) == 1:
                culprits |= group
                continue
            for stem in sorted(group):
                sub = next(s for s in subs if s.stem == stem)
                before = len(guard.suspects)
                guard.begin(stem)
                try:
                    done[stem] = grade_one(bundle, sub, work_root / stem, limits=limits, screen=screen)
                finally:
                    guard.end(stem)
                if len(guard.suspects) > before:
                    culprits.add(stem)
        for stem in sorted(culprits):
            msg = ("the bundle's files changed on disk while this submission was graded (restored from the copy "
                   "the grader checked); the whole submission scores 0")
            g = done[stem]
            g["problems"] = g["problems"] + [msg]
            g["results"] = _zero_all({t["id"]: t for t in manifest["tests"]}, "bundle", msg)
            g["status"] = "bundle"
    finally:
        if reaping:
            _subreaper(False)
        _reap_orphans()
        if own_root:
            shutil.rmtree(work_root, ignore_errors=True)
    graded = [done[s.stem] for s in subs]
    for g in graded:
        (feedback_dir / f"{g['student']}.txt").write_text(feedback(g, manifest))
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


def _progress(progress, g: dict) -> None:
    got = sum(r["earned"] for r in g["results"])
    note = f", {g['status']}" if g.get("status") else ""
    progress(f"{g['student']}: {got:g}/{sum(r['points'] for r in g['results']):g} ({g['cpu_s']:g} CPU-s{note})")
