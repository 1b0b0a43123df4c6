"""The operating-system sandbox every submission is graded in: bubblewrap (``bwrap``, Debian/Ubuntu package
``bubblewrap``), the standard unprivileged Linux sandbox.

Each child process of :mod:`flashnb.course.grade` runs in a fresh one:

* **a filesystem made from an allow-list**: an empty root, then read-only the system (``/usr``, ``/etc`` and the
  ``/bin``, ``/lib`` links), the Python installation (``sys.base_prefix``, ``sys.prefix``, the site-packages
  folders) and flashnb's own package folder -- never the folder above it (a checkout's ``assignments/`` holds
  the masters, with their solutions).  The bundle, the submissions, the output folder and the other
  submissions' scratch are not in that list; where one lies inside a bound folder anyway, an empty folder is
  mounted over it;
* **a private, size-limited scratch**: ``/tmp`` is a tmpfs of ``scratch_mib`` that holds the child's working
  folder, ``HOME``, its temporary files and every cache; it is the only place it can write, the bytes it may
  write in all (not per file) are bounded by its size, and it is gone when the sandbox ends;
* **namespaces**: no network (``--unshare-net``), its own process IDs (``--unshare-pid``: when its first process
  ends, the kernel ends every process it started, however it detached itself), its own IPC and host name, and
  ``--die-with-parent``: if the grader dies, so does the sandbox;
* **an unprivileged account**: run by root, the sandbox keeps only the right to change its user, which the child
  uses to become ``nobody`` (:data:`SANDBOX_UID`) before it reads a line of the submission -- root is not held
  to ``RLIMIT_NPROC`` and could read anything; run by another account, a user namespace maps that account.

The resource limits (CPU, address space, file size, processes) are set by the child on itself
(:func:`flashnb.course.child.set_limits`) before any submitted code runs, and inherited by all it starts.

Where bubblewrap cannot run (macOS, a container without user namespaces, the package missing),
:func:`unavailable` says why, and the grader refuses to grade unless told ``--no-sandbox``.
"""

from __future__ import annotations

import functools
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

__all__ = ["SANDBOX_UID", "SANDBOX_GID", "SandboxError", "unavailable", "command", "SCRATCH", "INSTALL_HINT"]

#: the account a sandbox runs as when the grader is root (``nobody``)
SANDBOX_UID = 65534
SANDBOX_GID = 65534
#: inside the sandbox: the private scratch (a tmpfs)
SCRATCH = "/tmp"
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap) on a "
                "Linux machine whose kernel allows user namespaces, or grade with --no-sandbox (only submissions "
                "from people you trust: their code then runs with the grading account's full access)")


class SandboxError(RuntimeError):
    """The sandbox cannot run here (the message says why and what to do)."""


def _bwrap() -> str | None:
    return shutil.which("bwrap")


def _privileged() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """None when a sandbox with every feature the grader uses starts here; else why not (one line)."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux (this is {sys.platform})"
    exe = _bwrap()
    if exe is None:
        return "bubblewrap (bwrap) is not installed"
    probe = command(["true"], scratch_mib=1, hide=())
    try:
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap did not start ({exc})"
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-2:])
        return f"bwrap cannot create its sandbox here ({tail or f'exit code {proc.returncode}'})"
    return None


def _python_paths() -> list[Path]:
    """What the child's Python needs to read: the installation, its site-packages, flashnb's package folder."""
    paths = {Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).resolve().parent.parent}
    try:
        paths.update(Path(p) for p in site.getsitepackages())
    except AttributeError:      # a virtualenv's old site.py
        pass
    for p in sys.path:          # site-packages folders only: never the working folder or a test folder
        if p and p.rstrip("/").endswith(("site-packages", "dist-packages")):
            paths.add(Path(p))
    paths.add(Path(__file__).resolve().parents[1])      # the flashnb package itself (not the folder above it)
    return sorted({p.resolve() for p in paths if p.exists()})


def _system_paths() -> list[tuple[str, Path]]:
    """("bind" | "symlink", path) for the system folders the interpreter and the compiler's tools need."""
    out = []
    for name in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt/conda"):
        p = Path(name)
        if p.is_symlink():
            out.append(("symlink", p))
        elif p.is_dir():
            out.append(("bind", p))
    for var in ("CUDA_HOME", "CUDA_PATH"):        # a CUDA toolkit outside /usr (numba's compiler uses its NVVM)
        v = os.environ.get(var)
        if v and Path(v).is_dir():
            out.append(("bind", Path(v).resolve()))
    return out


def command(argv: list[str], *, scratch_mib: float, hide=(), env_tag: str | None = None) -> list[str]:
    """``argv`` wrapped in a bubblewrap sandbox (see the module's docstring); ``hide``: folders that must not be
    visible inside even where they lie in a bound folder (the bundle, the submissions, the output)."""
    exe = _bwrap() or "bwrap"
    # the private scratch first: a folder bound below comes on top of it, so a Python installation or flashnb that
    # lies under /tmp (a checkout or a virtual environment made there) stays visible, read-only, inside
    args = [exe, "--tmpfs", "/", "--perms", "01777", "--size", str(int(scratch_mib * (1 << 20))), "--tmpfs", SCRATCH]
    binds = [p for kind, p in _system_paths() if kind == "bind"] + _python_paths()
    # drop a bound folder inside another bound one (mounted once, by the outer)
    binds = sorted({p for p in binds if not any(q != p and q in p.parents for q in binds)}, key=lambda p: len(p.parts))
    made: set[Path] = {Path(SCRATCH)}
    for p in binds:
        for parent in reversed(p.parents):       # the folders above it, readable by the sandbox's account
            if parent != Path("/") and parent not in made:
                args += ["--perms", "0755", "--dir", str(parent)]
                made.add(parent)
        args += ["--ro-bind", str(p), str(p)]
        made.add(p)
    for kind, p in _system_paths():
        if kind == "symlink" and p not in made:
            args += ["--symlink", os.readlink(p), str(p)]
    for h in hide:
        h = Path(h).resolve()
        if any(b == h or b in h.parents for b in binds):
            args += ["--tmpfs", str(h)]           # inside a bound folder: covered by an empty one
    args += ["--proc", "/proc", "--dev", "/dev",
             "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--new-session", "--chdir", SCRATCH]
    if _privileged():
        # keep only the right to become nobody; the child drops it (and every other) before the submission runs
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    return args + ["--"] + list(argv)


def drop_privileges() -> None:
    """In the sandbox, run by root: become :data:`SANDBOX_UID` (which drops every capability).  Called by the
    child before any submitted code runs; a no-op for any other account."""
    if os.getuid() != 0:
        return
    os.setgroups([])
    os.setgid(SANDBOX_GID)
    os.setuid(SANDBOX_UID)
    if os.getuid() == 0 or os.geteuid() == 0:
        raise SandboxError("could not leave root in the sandbox")
