"""``flashnb course grade``: a folder of submitted notebooks -> ``scores.csv`` and one feedback file each.

What a submission's code can do to its grade, to other grades and to the grading machine is bounded in layers
(``assignments/README.md``, "Threat model"):

1. **The answer grammar** (:mod:`flashnb.course.grammar`, an allow-list) reads the answer cells before anything
   runs: definitions of kernels, device functions, factories, a launcher and constants in the Numba CUDA subset
   are accepted, other top-level lines are blanked (never run); a refused submission scores 0 with the lines and
   the rule.  The older deny-list (:mod:`flashnb.course.screen`) runs behind it.  In the child, before any test,
   the compiler vouches for the answer's kernels and device functions (:mod:`flashnb.course.vouch`).
2. **A child process per submission, in a sandbox** (:mod:`flashnb.course.child`, :mod:`flashnb.course.sandbox`):
   bubblewrap with an allow-listed read-only filesystem (no bundle, submissions or output), a size-limited
   private ``/tmp``, no network, its own PID namespace; the setup and tests reach it on stdin.
3. **Process limits**: CPU seconds for the whole submission (all its processes), address space, the size of
   what it prints and of any file it writes, processes and threads; a test's time limit.  What a limit stops
   scores 0 with the reason; a fresh child goes on with the remaining tests, and the batch with the next
   student.
4. **Inside the child**: an integrity snapshot, a launch hook (a kernel reads only its arguments and calls only
   device functions), and an authenticated channel -- each record tagged with an HMAC under a secret only the
   child's harness holds; a forged record or a change scores the whole submission 0.  Points come from this
   process's manifest, never from the child.
5. **The bundle** is hashed against the ``hashes.json`` the release wrote, held in memory, and checked again
   before and after every submission; a change is undone from memory, and the submission that made it scores 0.
6. **The outputs**: feedback and ``scores.csv`` written whole (temporary file, ``os.replace``) as students finish;
   names made safe and unique; every process of a child gone before the next step.
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
#: wall seconds the child may take to compile the answer before its first test (``flashnb.course.vouch``)
COMPILE_S = 300.0
#: what the feedback of a submission graded with ``--no-sandbox`` says
NO_SANDBOX = ("graded without the operating-system sandbox (--no-sandbox): this submission's code ran with the "
              "grading account's access to files, processes and the network")


@dataclass
class Limits:
    """What one submission may use.  ``cpu_s``: CPU seconds of all its processes together (the course's goal is
    at most 3 CPU-minutes per submission); ``memory_gib``: address space of each of its processes (the
    simulator's threads reserve a stack each, so this counts more than the memory in use; the course tests grade
    every solution under the default); ``output_mib``: what it may print (stdout and stderr together) and the
    largest file it may write; ``processes``: processes and threads it may add to what the grading account
    already runs, times the submissions graded at once (the kernel counts them per account, not per process,
    and does not hold root to it: grade as an ordinary account, best one of its own); ``startup_s``: wall
    seconds for the setup and answer cells, before the first test; ``scratch_mib``: the size of the sandbox's
    private scratch (``/tmp``: its working folder, ``HOME``, caches): every byte it writes, in all files together."""

    cpu_s: float = 180.0
    memory_gib: float = 4.0
    output_mib: float = 8.0
    processes: int = 4096
    startup_s: float = 120.0
    scratch_mib: float = 256.0

    def __post_init__(self):
        for name in ("cpu_s", "memory_gib", "output_mib", "startup_s", "scratch_mib"):
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


def _assignment_of(path) -> str | None:
    """The assignment a released notebook belongs to (its metadata), or None (an older release, a plain file)."""
    from .build import read_master

    try:
        meta = read_master(path).metadata.get("flashnb_course") or {}
    except Exception:   # noqa: BLE001 -- unreadable: reported where the answers are read
        return None
    name = meta.get("assignment") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else None


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
    """The processes of one submission: its child's session (setsid), every descendant of its first process
    (in the sandbox: everything in its PID namespace, however it detached itself), and (``tag``) any that left
    both but still carry its tag."""
    if not _PROC.is_dir():
        return []
    needle = tag.encode() if tag else b""
    stats = {}
    for d in _PROC.iterdir():
        if d.name.isdigit():
            st = _proc_stat(int(d.name))
            if st is not None and int(d.name) != os.getpid():
                stats[int(d.name)] = st
    found = {pid for pid, st in stats.items() if st[1] == sid or pid == sid}
    grew = True
    while grew:                 # descendants of what was found
        grew = False
        for pid, st in stats.items():
            if pid not in found and st[0] in found:
                found.add(pid)
                grew = True
    if tag:
        for pid in stats:
            if pid in found:
                continue
            try:
                if needle in (_PROC / str(pid) / "environ").read_bytes():
                    found.add(pid)
            except OSError:
                pass
    return sorted(found)


def _alive(pid: int) -> bool:
    """Is ``pid`` still running (not gone, not a zombie that holds nothing)?"""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2:].split()[0] not in ("Z", "X")


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
_KEEP: set[int] = set()       # children this process had before it graded (never a submission's)
_SPAWN = threading.Lock()     # a grading child is in _LIVE from the moment it exists


def _children() -> list[int]:
    """This process's child processes now."""
    if not _PROC.is_dir():
        return []
    me = os.getpid()
    return [int(d.name) for d in _PROC.iterdir() if d.name.isdigit() and (_proc_stat(int(d.name)) or (0,))[0] == me]


def _orphans() -> list[int]:
    """Processes re-parented to this one (its subreaper role) that are not a grading child: what a submission
    left behind after its parent died (a double fork, ``setsid``, an emptied environment)."""
    if not _PROC.is_dir():
        return []
    me = os.getpid()
    out = []
    for d in _PROC.iterdir():
        if d.name.isdigit() and int(d.name) not in _LIVE and int(d.name) not in _KEEP:
            st = _proc_stat(int(d.name))
            if st is not None and st[0] == me:
                out.append(int(d.name))
    return out


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


def _uid_tasks(uid: int | None = None) -> int:
    """Processes and threads an account (default: this one) runs now (what RLIMIT_NPROC counts)."""
    if not _PROC.is_dir():
        return 0
    uid, n = (os.getuid() if uid is None else uid), 0
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
    (no tokens, no paths to the bundle); every cache and temporary file goes into the scratch folder (in the
    sandbox: its private ``/tmp``)."""
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
                 jobs: int = 1, sandboxed: bool = True, hide=()):
        self.events: list[dict] = []
        self.stop: str | None = None          # why this process was stopped (timeout, cpu, output, forged)
        self.forged = ""
        self.stderr_tail = b""
        self.output = 0
        self.current: str | None = None
        self.cpu = 0.0
        self.tree_cpu = 0.0        # the most CPU its processes were seen holding (a killed sandbox reports none)
        secret = secrets.token_bytes(32)
        self.secret = secret
        self.tag = secrets.token_hex(16)
        self.sandboxed = sandboxed
        r, w = os.pipe()
        root = str(Path(__file__).resolve().parents[2])
        cmd = [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
               "from flashnb.course.child import main; main()", root]
        work = scratch / "work"
        for d in (work, scratch / "home", scratch / "tmp", scratch / "cache"):
            d.mkdir(parents=True, exist_ok=True)
        if sandboxed:
            from . import sandbox

            env = _child_env(Path(sandbox.SCRATCH), self.tag)
            cmd = sandbox.command(cmd, scratch_mib=limits.scratch_mib, hide=hide)
            uid = sandbox.SANDBOX_UID if os.geteuid() == 0 else os.getuid()
        else:
            env = _child_env(scratch, self.tag)
            uid = None if os.geteuid() == 0 else os.getuid()
        nproc = None
        if uid is not None:   # per account: what it runs now, and this much more for each submission at once
            nproc = _uid_tasks(uid) + int(limits.processes) * max(1, int(jobs))
        payload = dict(secret=secret.hex(), fd=w, setup=bundle.setup, tests=bundle.tests_text, answers=answers,
                       skip=sorted(skip), done=done, sandbox=sandboxed,
                       limits=dict(cpu=max(1, int(cpu_left + 0.999)), memory=int(limits.memory_gib * GIB),
                                   output=int(limits.output_mib * MIB), nproc=nproc))
        with _SPAWN:
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
                    self.tree_cpu = max(self.tree_cpu, _tree_cpu(_tagged(self.proc.pid, None)))
                    if self.tree_cpu > cpu_left + 1.0:
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
            elif ev == "compiling":       # the compiler vouches for the answer: NVVM, a minute for a large kernel
                self.deadline = time.monotonic() + COMPILE_S
            elif ev == "compiled":
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
        """Kill every process of this child (found before its first process is reaped, while they still
        descend from it), reap it with its resource usage, and return only once all of them are gone."""
        doomed = set(_tagged(self.proc.pid, self.tag))
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
        if self.sandboxed and self.proc.returncode is not None and self.proc.returncode > 128:
            self.proc.returncode = -(self.proc.returncode - 128)     # bwrap: 128 + the signal that ended it
        self.cpu = max(self.cpu, self.tree_cpu)
        end = time.monotonic() + 10.0
        while time.monotonic() < end:
            with _SPAWN:
                orphans = set(_orphans())
            doomed = {p for p in doomed | set(_tagged(self.proc.pid, self.tag)) | orphans
                      if _alive(p) and p != self.proc.pid}
            if not doomed:
                break
            for p in doomed:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            _reap_orphans()
            time.sleep(0.02)
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
              jobs: int = 1, sandbox: bool = True, hide=()) -> dict:
    """Grade one submission; returns ``dict(student, results=[Result dicts], cpu_s, wall_s, problems, prose)``.

    ``bundle``: a :class:`Bundle` (or its folder); ``work``: a folder for the submission's scratch (removed
    afterwards); ``screen=False`` skips the static screen (for a submission a person has read and trusts);
    ``jobs``: how many submissions are graded at once (the process limit is per account); ``sandbox``: run its
    processes in the operating-system sandbox (:mod:`flashnb.course.sandbox`; ``False``: said in its
    problems), with ``hide`` (folders) out of its sight."""
    from . import grammar
    from . import screen as screening

    limits = limits or Limits()
    bundle = bundle if isinstance(bundle, Bundle) else Bundle(bundle)
    submission, work = Path(submission), Path(work)
    tests = {t["id"]: t for t in bundle.manifest["tests"]}
    student = submission.stem
    start = time.monotonic()
    problems: list[str] = []
    if not sandbox:
        problems.append(NO_SANDBOX)

    def finished(results, cpu=0.0, status=None) -> dict:
        ordered = [results[tid] for tid in tests]
        return dict(student=student, results=ordered, cpu_s=round(cpu, 1), wall_s=round(time.monotonic() - start, 1),
                    problems=problems, prose=_prose(submission), status=status, sandboxed=bool(sandbox))

    try:
        answers = [_code(a) for a in answer_cells(submission)]
    except Exception as exc:   # noqa: BLE001 -- an unreadable notebook scores 0, the batch goes on
        problems.append(f"could not read the notebook: {type(exc).__name__}: {exc}")
        return finished({r["id"]: r for r in _zero_all(tests, "error", problems[-1])})
    other = _assignment_of(submission)
    if other and other != bundle.manifest.get("name"):
        problems.append(f"this notebook is assignment {other}'s, and it was graded with "
                        f"{bundle.manifest.get('name')}'s bundle: grade it with its own (or hand in the notebook of "
                        "this assignment)")
        return finished({r["id"]: r for r in _zero_all(tests, "error", problems[-1])})
    if not answers:
        problems.append("no cells tagged 'answer' (keep the answer cells of the release, and their tags)")
        return finished({r["id"]: r for r in _zero_all(tests, "error", problems[-1])})
    if len(answers) != bundle.manifest["answer_cells"]:
        problems.append(f"{len(answers)} cells tagged 'answer', the assignment has {bundle.manifest['answer_cells']} "
                        "(keep the answer cells of the release, and their tags)")
    if screen:
        found, runnable, dropped = grammar.check(answers, bundle.setup)
        if not found:
            found = screening.screen(runnable)
        if not found:
            answers = runnable
            if dropped:
                problems.append("not run by the grader (answer cells are definitions: functions, kernels, constants;"
                                " other top-level lines are yours to try things in the notebook): "
                                + ", ".join(f"cell {c} line {ln}" for c, ln in dropped[:12])
                                + (" ..." if len(dropped) > 12 else ""))
        if found:
            msg = ("the grader refused to run this submission: it uses what the answer grammar does not allow "
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

            run = _Run(bundle, answers, set(results), results, scratch, limits, cpu_left, jobs, sandbox, hide)
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


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``: a reader
    (or a batch stopped half-way) sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def student_names(subs: list[Path]) -> dict[Path, str]:
    """One name per submission, unique and safe as a file name: the file's stem (``jane.ipynb`` -> ``jane``);
    characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``; where two files would share a
    name (``jane.ipynb`` and ``jane.py``, ``a b`` and ``a_b``), each gets its file name's suffix, then a
    number."""
    import re

    def clean(text: str) -> str:
        text = re.sub(r"[^\w.-]", "_", text, flags=re.ASCII)
        return "_" + text if text.startswith(".") or not text else text

    stems = [clean(p.stem) for p in subs]
    out, used = {}, set()
    for p, stem in zip(subs, stems):
        name = stem if stems.count(stem) == 1 else clean(p.name)
        base, k = name, 2
        while name.lower() in used:
            name, k = f"{base}-{k}", k + 1
        used.add(name.lower())
        out[p] = name
    return out


def _check_paths(submissions: Path, out_csv: Path) -> None:
    """One-line errors for the mistakes an instructor makes on the command line."""
    if not submissions.exists():
        raise FileNotFoundError(f"the submissions folder {submissions} does not exist")
    if not submissions.is_dir():
        raise ValueError(f"{submissions} is a file, not a folder: put the submitted notebooks in one folder "
                         "(one <student>.ipynb each) and give that folder")
    if out_csv.is_dir():
        raise ValueError(f"--out {out_csv} is a folder; give the CSV file to write, e.g. {out_csv / 'scores.csv'}")
    for parent in [out_csv.parent, *out_csv.parent.parents]:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"--out {out_csv}: {parent} is a file, not a folder")
    if out_csv.suffix.lower() != ".csv":
        raise ValueError(f"--out {out_csv}: expected a .csv file to write the scores to")


def _csv_text(graded: list[dict], manifest: dict) -> str:
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    ids = [t["id"] for t in manifest["tests"]]
    w.writerow(["student", "autograded", "possible", "manual_possible", "cpu_seconds", "wall_seconds", "sandboxed",
                *ids])
    for g in graded:
        w.writerow([g["student"], sum(r["earned"] for r in g["results"]),
                    sum(r["points"] for r in g["results"]), sum(m["points"] for m in manifest.get("manual", [])),
                    g["cpu_s"], g.get("wall_s", 0), "yes" if g.get("sandboxed", True) else "no",
                    *[r["earned"] for r in g["results"]]])
    return buf.getvalue()


def grade(bundle, submissions, out_csv, *, feedback_dir=None, work_dir=None, progress=print, jobs: int = 1,
          limits: Limits | None = None, screen: bool = True, sandbox: bool = True) -> list[dict]:
    """Grade every ``*.ipynb`` (and jupytext ``*.py``) in ``submissions`` against ``bundle`` (an assignment's
    ``autograder/`` folder); write ``out_csv`` (one row per student) and ``feedback_dir/<student>.txt``.

    ``jobs`` submissions are graded at once (each in its own processes); the CSV, the feedback and the progress
    lines come out in the students' order whatever finishes first, each file written whole (a temporary file
    replaced), the CSV again after every student, so a batch stopped half-way leaves the students graded so
    far.  ``limits``: :class:`Limits`; ``screen``: see :func:`grade_one`; ``sandbox=False`` grades without the
    operating-system sandbox (:mod:`flashnb.course.sandbox`), which the CSV and each feedback then say: by
    default a machine where it cannot run is refused (:class:`~flashnb.course.sandbox.SandboxError`)."""
    from concurrent.futures import ThreadPoolExecutor

    from . import sandbox as sandboxing

    limits = limits or Limits()
    if int(jobs) < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs!r}")
    submissions, out_csv = Path(submissions), Path(out_csv)
    _check_paths(submissions, out_csv)
    if sandbox:
        why = sandboxing.unavailable()
        if why:
            raise sandboxing.SandboxError(f"cannot sandbox the submissions: {why}; {sandboxing.INSTALL_HINT}")
    bundle = Bundle(bundle)
    manifest = bundle.manifest
    subs = sorted(p for p in submissions.iterdir() if p.suffix in (".ipynb", ".py") and p.is_file())
    if not subs:
        raise FileNotFoundError(f"no submissions (*.ipynb) in {submissions}")
    names = student_names(subs)
    feedback_dir = Path(feedback_dir) if feedback_dir else out_csv.parent / "feedback"
    feedback_dir.mkdir(parents=True, exist_ok=True)
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    work_root = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="flashnb-grade-"))
    own_root = not work_dir
    hide = [bundle.path, submissions, out_csv.parent, feedback_dir, work_root]
    guard = _Guard(bundle)
    with _SPAWN:
        _KEEP.update(p for p in _children() if p not in _LIVE)
    reaping = _subreaper(True)
    done: dict[str, dict] = {}
    shown = [0]
    show_lock = threading.Lock()
    failed_writes: list[str] = []

    def write_feedback(g: dict) -> None:
        path = feedback_dir / f"{g['student']}.txt"
        try:
            _atomic_write(path, feedback(g, manifest))
        except OSError as exc:      # e.g. a folder of that name: this student's file, never the batch
            note = f"{g['student']}: the feedback file {path} could not be written ({exc})"
            if note not in failed_writes:
                failed_writes.append(note)
                progress(note)

    def grade_sub(sub: Path) -> dict:
        g = grade_one(bundle, sub, work_root / names[sub], limits=limits, screen=screen, jobs=int(jobs),
                      sandbox=sandbox, hide=hide)
        g["student"] = names[sub]
        return g

    def one(sub: Path) -> dict:
        name = names[sub]
        guard.begin(name)
        try:
            g = grade_sub(sub)
        finally:
            guard.end(name)
        done[name] = g
        with show_lock:            # progress, feedback and CSV in the students' order, as soon as the next is done
            while shown[0] < len(subs) and names[subs[shown[0]]] in done:
                g_next = done[names[subs[shown[0]]]]
                _progress(progress, g_next)
                write_feedback(g_next)
                shown[0] += 1
            _atomic_write(out_csv, _csv_text([done[names[s]] for s in subs[:shown[0]]], manifest))
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
            for name in sorted(group):
                sub = next(s for s in subs if names[s] == name)
                before = len(guard.suspects)
                guard.begin(name)
                try:
                    done[name] = grade_sub(sub)
                finally:
                    guard.end(name)
                if len(guard.suspects) > before:
                    culprits.add(name)
        for name in sorted(culprits):
            msg = ("the bundle's files changed on disk while this submission was graded (restored from the copy "
                   "the grader checked); the whole submission scores 0")
            g = done[name]
            g["problems"] = g["problems"] + [msg]
            g["results"] = _zero_all({t["id"]: t for t in manifest["tests"]}, "bundle", msg)
            g["status"] = "bundle"
    finally:
        if reaping:
            _subreaper(False)
        _reap_orphans()
        if own_root:
            shutil.rmtree(work_root, ignore_errors=True)
    graded = [done[names[s]] for s in subs]
    for g in graded:
        write_feedback(g)
    _atomic_write(out_csv, _csv_text(graded, manifest))
    return graded


def _progress(progress, g: dict) -> None:
    got = sum(r["earned"] for r in g["results"])
    note = f", {g['status']}" if g.get("status") else ""
    progress(f"{g['student']}: {got:g}/{sum(r['points'] for r in g['results']):g} ({g['cpu_s']:g} CPU-s{note})")
