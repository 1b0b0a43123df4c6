"""The compiler vouches for the answer cells before any test runs.

The grammar (:mod:`flashnb.course.grammar`) accepts the Numba CUDA subset's *syntax*; a function in it may still be
plain Python that the simulator would run (``int("3")``, ``round(x, 2)``, a tuple built by ``tuple(range(n))``).
So, in the graded child, after the answer cells' definitions ran and before the first test, every kernel and device
function of the answer is compiled with numba's CUDA compiler (``compile_ptx``, in a child process started with
``FLASHNB_DEVICE=gpu`` by :mod:`flashnb.instruments`; the simulator's process cannot compile):

* each name the assignment declares with :func:`flashnb.course.compiled` ``kernels=``: its kernels, built as the
  tests build them (a kernel factory called with the assignment's configs: grammar-checked host code), with the
  signatures the tests launch them with; the device functions they call are compiled with them;
* each device function of the answer cells that none of those kernels calls: with the argument types the
  assignment declares for it (``device=``, through a one-line kernel that calls it); an answer name without
  them is refused with a message (a helper no kernel calls never runs in the grader, and is left alone).

What does not compile scores 0 on every test of its question, with one line naming the function and the compiler's
first error line.  What compiles is device code: it cannot open files, walk frames or call the grader.  The
verdicts of the PTX guard (float64, spills) are not judged here -- the tests' own compile check scores them -- but
they are stored in the batch's verdict cache (``$FLASHNB_COURSE_CACHE``), so that check does not compile again.
"""

from __future__ import annotations

import linecache
import os
import re

__all__ = ["vouch", "CCS"]

#: the architectures compiled for (those of :func:`flashnb.course.criteria.compiles`: one NVVM pass serves both)
CCS = ((8, 0), (9, 0))

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.+\-]+){2,}/?")
_HEADER = re.compile(r"^(\w+Error: )?(Failed in \w+ mode pipeline|During: |File \"|\s*$)")


def first_error_line(text: str) -> str:
    """The compiler's first informative line of ``text`` (pipeline headers skipped), with no colours and no
    paths of the grading machine (a path becomes its last part)."""
    kind = ""
    m = re.match(r"^(\w+(?:Error|Exception)): ", text or "")
    if m:
        kind, text = m.group(1), text[m.end():]
    for line in _ANSI.sub("", text or "").splitlines():
        line = line.strip()
        if not line or _HEADER.match(line):
            continue
        line = _PATH.sub(lambda p: os.path.basename(p.group(0).rstrip("/")), line)
        return (f"{kind}: " if kind else "") + line[:300]
    return kind or "does not compile"


def _py(fn):
    return getattr(fn, "py_func", fn)


def _is_device(v) -> bool:
    opts = getattr(v, "targetoptions", None) or {}
    return hasattr(v, "py_func") and bool(getattr(v, "_device", False) or opts.get("device"))


def _of_answer(fn) -> bool:
    code = getattr(_py(fn), "__code__", None)
    return code is not None and code.co_filename.startswith(("<answer cell", "<your "))


def _reached(kernel, seen: set) -> None:
    """Add to ``seen`` the ids of the Python functions of ``kernel`` and of every device function it calls."""
    fn = _py(kernel)
    code = getattr(fn, "__code__", None)
    if code is None or id(fn) in seen:
        return
    seen.add(id(fn))
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:
            pass
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
    g = getattr(fn, "__globals__", {})
    values += [g[n] for n in sorted(names) if n in g]
    for v in values:
        if hasattr(v, "py_func"):
            _reached(v, seen)


def _wrapper(name: str, fn, types: tuple):
    """A kernel of one line that calls the device function ``fn`` (compiled as part of it), and its signature."""
    from numba import cuda

    args = ", ".join(f"a{i}" for i in range(len(types)))
    src = f"def _compile_{name}({args}):\n    _f({args})\n"
    filename = f"<compile check of {name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    ns = {"_f": fn, "__name__": "__main__"}
    exec(compile(src, filename, "exec"), ns)
    return cuda.jit(ns[f"_compile_{name}"]), "void(" + ", ".join(types) + ")"


def _compile(items, python_calls=None) -> list[str | None]:
    """Compile ``[(kernel, signature)]`` for :data:`CCS` in child processes; per item None (it compiles) or the
    compiler's first error line.  The guard's verdicts of what compiles go into the batch's verdict cache."""
    from .. import instruments as fi
    from ..instruments.shipping import _describe_function, _python_function
    from . import criteria

    out: list[str | None] = [None] * len(items)
    todo = []
    for i, (k, sig) in enumerate(items):
        py = python_calls(k) if python_calls is not None else []
        if py:
            out[i] = (f"it calls {', '.join(sorted(set(py))[:3])}, a Python function of your answer that is not "
                      "@cuda.jit(device=True)")
            continue
        try:
            _describe_function(_python_function(k))       # what cannot be sent cannot be compiled
        except Exception as exc:   # noqa: BLE001 -- a Python function the kernel calls, a value of the host
            out[i] = first_error_line(f"{type(exc).__name__}: {exc}")
            continue
        todo.append(i)
    if not todo:
        return out
    jobs = [(items[i][0], items[i][1], cc) for i in todo for cc in CCS]
    try:
        results = fi.resources_of(jobs, keep_ptx=False, progress=False)
    except Exception:   # noqa: BLE001 -- one that the compile process could not rebuild: each on its own
        results = []
        for i in todo:
            try:
                results += fi.resources_of([(items[i][0], items[i][1], cc) for cc in CCS], keep_ptx=False,
                                           progress=False)
            except Exception as exc:   # noqa: BLE001
                out[i] = first_error_line(f"{type(exc).__name__}: {exc}")
                results += [None] * len(CCS)
    for n, i in enumerate(todo):
        res = results[n * len(CCS):(n + 1) * len(CCS)]
        if any(r is None for r in res):
            continue
        nvvm = [r.error for r in res if r.error and not r.error.startswith("ptxas")]
        if nvvm:
            out[i] = first_error_line(nvvm[0])
        else:
            criteria.store_verdict(items[i][0], items[i][1], CCS, [p for r in res for p in fi.problems(r)])
    return out


def vouch(ns: dict, declared: dict, python_calls=None) -> dict[str, str]:
    """Compile the answer in ``ns`` as the assignment ``declared`` it (``{name: course.Compiled}``); returns
    ``{question: message}`` for each question whose code does not compile.  ``python_calls(kernel)``: the Python
    functions of the answer a kernel calls (:func:`flashnb.course.child.python_calls`), each a reason it cannot
    compile for a GPU."""
    failed: dict[str, str] = {}
    items, owners = [], []           # (kernel, signature), (question, what)
    seen: set = set()
    for name, c in declared.items():
        if c.kernels is None:
            continue
        try:
            built = list(c.kernels(ns))
        except Exception as exc:   # noqa: BLE001 -- the factory raised, or the name is missing: the tests say so
            del exc
            continue
        for k, sig in built:
            _reached(k, seen)
            items.append((k, sig))
            owners.append((c.question, f"{name} (its kernel {getattr(_py(k), '__name__', '?')})"))
    for name, c in declared.items():
        v = ns.get(name)
        if c.kernels is not None or v is None or not _is_device(v) or not _of_answer(v) or id(_py(v)) in seen:
            continue
        if c.device is None:
            failed.setdefault(c.question, f"{name}: a device function no kernel of your answer calls, and the "
                                          "assignment gives no types to compile it with")
            continue
        try:
            items.append(_wrapper(name, v, c.device))
        except Exception as exc:   # noqa: BLE001
            failed.setdefault(c.question, f"{name} does not compile: {first_error_line(str(exc))}")
            continue
        owners.append((c.question, name))
    for (question, what), err in zip(owners, _compile(items, python_calls)):
        if err is not None:
            failed.setdefault(question, f"{what} does not compile for a GPU (numba's CUDA compiler): {err}")
    return failed
