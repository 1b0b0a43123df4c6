"""The grader's child process: one submission's answer cells and the bundle's tests, reported on a channel that
only this module can write.

:mod:`flashnb.course.grade` starts it as ``python -m flashnb.course.child`` in the submission's scratch folder
and writes one JSON payload to its stdin -- never on the command line or in the environment, where the answer
cells could read them: the bundle's setup and tests as text (the child never opens the bundle), the answer
cells, the tests to skip and the results so far (for ``requires=``), the number of the pipe to report on and a
per-run secret.  The child reads it whole before any submitted code runs, then:

1. runs the setup cells, registers the tests and keeps its own copy of each (function, points, requirements);
2. warms up what the tests patch into the simulator (the traffic counter, the race checker) with a small
   launch, then takes the **integrity snapshot**: every name of every module in ``sys.modules``, every
   attribute of the classes they define, and the items of flashnb's module-level lists and dicts;
3. runs the answer cells (a ``BaseException`` such as ``SystemExit`` is reported, not obeyed);
4. compares the snapshot; has the compiler vouch for the answer's kernels and device functions
   (:mod:`flashnb.course.vouch`: what does not compile scores 0 on its question's tests, which then do not run);
   then runs each test, comparing again after each one.

A change -- ``numpy.abs`` replaced, ``course.Result`` rebound, a hook appended to ``flashnb.common.launch_hooks``
-- is reported as ``tampered`` with what changed, and the parent scores the whole submission 0.  Each record is
one line: JSON, a tab, and HMAC-SHA256(secret, sequence number + JSON); a line written by anything else (a
print goes to stdout, not here; a write to a guessed descriptor has no valid tag) fails the parent's check, and
the parent scores the submission 0 as forged.  The snapshot, the secret and the channel live in this module's
function locals, which the static screen (:mod:`flashnb.course.screen`) keeps the answer cells from reaching.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys

#: longest message kept from one test (a student's exception text can be any size)
MESSAGE_LIMIT = 4000

_MISSING = object()


def snapshot() -> list:
    """What the integrity check compares: ``(mapping, [(key, value), ...], where)`` for every name of every
    module in ``sys.modules``, every attribute of the classes each defines, and the items of flashnb's
    module-level lists and dicts, less the globals a flashnb module declares in ``_RUNTIME_STATE`` (what its
    own launches change).  Values are held, so an id is never reused by a new object.  (The tests of
    every assignment rebind none of this -- the solutions are graded with it -- so a change is the
    submission's.)"""
    out = [(sys.modules, list(sys.modules.items()), "sys.modules")]    # a module swapped for another
    for name, m in list(sys.modules.items()):
        d = getattr(m, "__dict__", None)
        if not isinstance(d, dict):
            continue
        ours = name == "flashnb" or name.startswith("flashnb.")
        # a flashnb module's _RUNTIME_STATE names the globals its own launches rebind or fill (the simulator's
        # current launch, its site table, its counters), read once here: rebinding the tuple later changes nothing
        state = frozenset(d.get("_RUNTIME_STATE", ())) if ours else frozenset()
        items = [(k, v) for k, v in d.items() if k not in state]
        out.append((d, items, f"module {name}"))
        for k, v in items:
            if isinstance(v, type) and v.__dict__.get("__module__") == name:     # classes defined there
                out.append((v.__dict__, list(v.__dict__.items()), f"class {name}.{k}"))
        if ours:
            for k, v in items:
                if type(v) is list:
                    out.append((v, list(v), f"list {name}.{k}"))
                elif type(v) is dict:
                    out.append((v, list(v.items()), f"dict {name}.{k}"))
    return out


_PLAIN = (type(None), bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset)


def _plain(v) -> bool:
    """A module-level value that is data, not behaviour: a library may rebind such a global when it is called
    (``fa2_fast.last_forward``); a function, class, module or ufunc rebound is never the library's doing."""
    return v is not _MISSING and type(v) in _PLAIN


def changes(snap: list, limit: int = 5) -> list[str]:
    """What differs from ``snap``: deleted names, rebound functions, classes, modules and other objects of
    modules (a module global rebound from data to data is allowed), any rebound class attribute, any name added
    to a flashnb class, changed items of flashnb's lists and dicts (new keys of dicts and modules are allowed:
    caches fill and submodules load)."""
    bad = []
    for obj, items, where in snap:
        if type(obj) is list:
            if len(obj) != len(items) or any(a is not b for a, b in zip(obj, items)):
                bad.append(f"{where} changed")
        else:
            get = obj.get
            for k, v in items:
                now = get(k, _MISSING)
                if now is not v and not (where.startswith("module") and _plain(v) and _plain(now)):
                    bad.append(f"{where}: {k} " + ("deleted" if now is _MISSING else "replaced"))
                    break
            else:
                if where.startswith("class flashnb"):
                    # a name added to one of flashnb's classes overrides what it inherited (a subclass's method
                    # shadowed): the library adds none while it runs, so an added name is the submission's
                    added = sorted(set(obj) - {k for k, _ in items})
                    if added:
                        bad.append(f"{where}: {added[0]} replaced (added over what the class inherited)")
        if len(bad) >= limit:
            break
    return bad


_WARM = '''
from numba import cuda
import numpy as np
import flashnb
from flashnb import traffic
from flashnb.sim import racecheck


@cuda.jit
def warm_up(a, b):
    s = cuda.shared.array(32, np.float32)
    i = cuda.threadIdx.x
    s[i] = a[i]
    cuda.syncthreads()
    b[i] = s[31 - i]
    cuda.atomic.add(b, 0, a[i])


with traffic.count():
    with racecheck.check(raise_on_race=False):
        flashnb.common.launch(warm_up, 1, 32, flashnb.common.to_device(np.ones(32, np.float32)),
                              flashnb.common.empty(32), label="warm-up")
'''


def _is_array(v) -> bool:
    import numpy as np

    return isinstance(v, np.ndarray) or hasattr(v, "__cuda_array_interface__") or (
        hasattr(v, "copy_to_host") and hasattr(v, "shape"))


def _references(kernel, seen: set, nested: bool):
    """``(fn, [(name, value)])``: what a kernel or device function ``kernel`` refers to besides its arguments -- the
    values its closure holds and the globals its code names (``nested``: its inner code objects' names too, sorted)
    -- or ``(None, [])`` when it is not Python code or was already visited (``seen``, updated)."""
    fn = getattr(kernel, "py_func", kernel)
    code = getattr(fn, "__code__", None)
    if code is None or id(fn) in seen:
        return None, []
    seen.add(id(fn))
    values = []
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            values.append((name, cell.cell_contents))
        except ValueError:          # an empty cell
            pass
    if nested:
        names, stack = set(), [code]
        while stack:
            c = stack.pop()
            names.update(c.co_names)
            stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
        names = sorted(names)
    else:
        names = code.co_names
    g = getattr(fn, "__globals__", {})
    return fn, values + [(n, g[n]) for n in names if n in g]


def captured_arrays(kernel, seen=None) -> list[str]:
    """The arrays a kernel (and the device functions it calls) reads that are not its arguments: values it closes
    over or globals it names.  The traffic counter counts the arguments' traffic only, so a kernel that copied a
    captured array (an answer computed on the host) into its outputs would move no counted bytes."""
    seen = set() if seen is None else seen
    fn, values = _references(kernel, seen, nested=True)
    out = []
    for name, v in values:
        if _is_array(v):
            out.append(f"{name} (in {getattr(fn, '__name__', '?')})")
        elif hasattr(v, "py_func"):
            out.extend(captured_arrays(v, seen))
    return out


def python_calls(kernel, seen=None) -> list[str]:
    """The Python functions of the submission (not ``@cuda.jit``) a kernel, or a device function it calls, names:
    the simulator would run them as Python, a GPU cannot (a device function written as plain NumPy)."""
    import types

    seen = set() if seen is None else seen
    _, values = _references(kernel, seen, nested=False)
    out = []
    for _, v in values:
        if isinstance(v, types.FunctionType) and v.__code__.co_filename.startswith(("<answer cell", "<your ")):
            out.append(v.__name__)
        elif hasattr(v, "py_func"):
            out.extend(python_calls(v, seen))
    return out


def _arguments_only(fail):
    """A launch hook: a kernel that reads an array it was not given, or calls a Python function of the answer, fails
    the test that launched it."""
    import contextlib

    @contextlib.contextmanager
    def hook(label, kernel, grid, block, args):
        py = python_calls(kernel)
        if py:
            raise fail(f"launch {label!r}: the kernel calls {', '.join(sorted(set(py))[:3])}, a Python function of "
                       "your answer that is not @cuda.jit(device=True): the simulator runs it as Python, a GPU cannot "
                       "(decorate it, and write it in CUDA Python)")
        bad = captured_arrays(kernel)
        if bad:
            raise fail(f"launch {label!r}: the kernel reads {', '.join(bad[:3])}, an array that is not one of its "
                       "arguments (captured from the host or a global): the traffic counter counts only what a kernel "
                       "is given, so pass every array it reads as an argument")
        yield

    return hook


def set_limits(limits: dict) -> None:
    """This process's resource limits, inherited by what it starts (soft = hard where it may not raise them)."""
    import resource

    def lim(which, soft, hard=None):
        try:
            resource.setrlimit(which, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass

    lim(resource.RLIMIT_CORE, 0)
    lim(resource.RLIMIT_CPU, int(limits["cpu"]), int(limits["cpu"]) + 5)
    lim(resource.RLIMIT_AS, int(limits["memory"]))
    lim(resource.RLIMIT_FSIZE, int(limits["output"]))
    if limits.get("nproc") and hasattr(resource, "RLIMIT_NPROC"):
        lim(resource.RLIMIT_NPROC, int(limits["nproc"]))


def main() -> None:
    import linecache

    payload = json.loads(sys.stdin.read())
    sys.stdin.close()
    set_limits(payload["limits"])
    if payload.get("sandbox"):
        # in the sandbox (flashnb.course.sandbox): leave root, then make the working folders in the private /tmp
        from flashnb.course.sandbox import drop_privileges

        drop_privileges()
        for var in ("HOME", "TMPDIR", "XDG_CACHE_HOME"):
            os.makedirs(os.environ[var], exist_ok=True)
        os.makedirs("/tmp/work", exist_ok=True)
        os.chdir("/tmp/work")
    memory_gib = payload["limits"]["memory"] / (1 << 30)
    secret = bytes.fromhex(payload["secret"])
    channel = os.fdopen(payload["fd"], "w", buffering=1)
    write, dumps, digest, hmac_new = channel.write, json.dumps, hashlib.sha256, hmac.new
    flush, exit_now = channel.flush, os._exit
    seq = [0]

    def emit(**rec):
        text = dumps(rec)
        tag = hmac_new(secret, f"{seq[0]}\t{text}".encode(), digest).hexdigest()
        write(f"{text}\t{tag}\n")
        flush()
        seq[0] += 1

    os.environ.setdefault("FLASHNB_DEVICE", "sim")
    import flashnb  # noqa: F401  -- selects the simulator before numba.cuda is imported
    from flashnb import course

    setup, tests_text = payload["setup"], payload["tests"]
    ns: dict = {"__name__": "__main__"}
    tests_ns: dict = {"__name__": "flashnb_course_tests"}       # the notebook's view: setup names, then tests
    # the setup and the tests are compiled from text that linecache never holds: no traceback, and no code that
    # asks linecache, gets a line of the tests
    exec(compile(setup, "<setup>", "exec"), ns)
    course.reset()
    exec(compile(setup, "<setup>", "exec"), tests_ns)
    exec(compile(tests_text, "<tests>", "exec"), tests_ns)
    import dataclasses

    run_one, Result, replace = course.run_one, course.Result, dataclasses.replace
    tests = [replace(t) for t in course.TESTS.values()]          # this function's copies: what is run
    declared = {k: replace(c) for k, c in course.COMPILED.items()}    # what the compiler must vouch for
    linecache.cache["<grader warm-up>"] = (len(_WARM), None, _WARM.splitlines(keepends=True), "<grader warm-up>")
    exec(compile(_WARM, "<grader warm-up>", "exec"), {"__name__": "flashnb_course_warm_up"})
    from flashnb import common, registry

    # `import flashnb` defers the modules that register kernels and impls: all of them are loaded before the
    # snapshot, so that a registration a test triggers later is not mistaken for the submission's doing
    registry.KERNELS.load_all()
    registry.IMPLS.load_all()
    common.launch_hooks.append(_arguments_only(course.Fail))    # before the snapshot: a part of what it keeps
    snap = snapshot()
    emit(event="ready")

    problems = []
    for i, src in enumerate(payload["answers"], 1):
        code = "\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!"))) + "\n"
        name = f"<answer cell {i}>"
        linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
        try:
            exec(compile(code, name, "exec"), ns)
        except BaseException as exc:   # noqa: BLE001 -- SystemExit too: reported with every test that then fails
            problems.append(f"answer cell {i} raised {type(exc).__name__}: {str(exc)[:500]}")
    emit(event="answers", problems=problems)

    def stop_if_tampered():
        bad = changes(snap)
        if bad:
            emit(event="tampered", changes=bad)
            exit_now(0)

    stop_if_tampered()

    # the compiler vouches for the answer before any test runs: what does not compile scores 0 on its question
    failed: dict = {}
    if declared and any(t.id not in payload["skip"] for t in tests):
        from flashnb.course.vouch import vouch

        emit(event="compiling")
        try:
            failed = vouch(ns, declared, python_calls)
        except Exception as exc:   # noqa: BLE001 -- the tests' own checks report what this could not build
            problems.append(f"the compile check could not run: {type(exc).__name__}: {str(exc)[:300]}")
        emit(event="compiled", failed=failed)
        stop_if_tampered()

    done = {k: Result(**v) for k, v in payload["done"].items()}
    for t in tests:
        if t.id in payload["skip"]:
            continue
        emit(event="start", id=t.id)
        try:
            if t.question in failed:
                r = Result(t.id, t.question, t.points, 0.0, failed[t.question], t.hidden, 0.0, "fail")
            else:
                r = run_one(t, ns, done)
        except BaseException as exc:   # noqa: BLE001 -- KeyboardInterrupt, SystemExit, GeneratorExit from a test
            r = Result(t.id, t.question, t.points, 0.0, f"{type(exc).__name__}: {str(exc)[:500]}", t.hidden, 0.0,
                       "error")
        if r.message.startswith("MemoryError"):
            r.status = "limit"
            r.message += f" (the grader's memory limit: {memory_gib:g} GiB of address space per process)"
        if problems and not r.passed:
            r.message = (r.message + "\n" if r.message else "") + "; ".join(problems)
        if len(r.message) > MESSAGE_LIMIT:
            r.message = r.message[:MESSAGE_LIMIT] + f"\n... ({len(r.message) - MESSAGE_LIMIT} more characters)"
        bad = changes(snap)
        if bad:
            emit(event="tampered", changes=bad, id=t.id)
            exit_now(0)
        done[t.id] = r
        emit(event="result", id=r.id, status=r.status, message=r.message, seconds=r.seconds)
    emit(event="end")
    sys.stdout.flush()
    exit_now(0)    # kernel threads of a timed-out test must not keep the process alive


if __name__ == "__main__":
    main()
