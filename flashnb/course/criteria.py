"""What the autograder checks, each as a function that returns quietly or raises :class:`~flashnb.course.Fail`
with a message a student can act on (which output, which row and tile, which array, which source line).

* :func:`close` -- output against the float64 reference, every element written (outputs are NaN-poisoned
  before the launch, so an element no thread wrote is found), first bad row and its tile named;
* :func:`io_budget` -- the counted HBM traffic equals (or stays within) the algorithm's model;
* :func:`ran_student_kernels` -- every launch ran a kernel the student wrote, none of the library's
  (:func:`student_launches`: the same on launches already counted);
* :func:`race_free` -- no data race under :mod:`flashnb.sim.racecheck`;
* :func:`compiles` -- compiles for sm_80 and sm_90: no float64, shared memory within 48 KiB, no spills;
* :func:`variant_from` -- the student's factory as a :func:`flashnb.registry.variant` of the library's.
"""

from __future__ import annotations

import contextlib
import inspect as _inspect
import re

import numpy as np

from . import Fail

__all__ = ["close", "forward_close", "io_budget", "ran_student_kernels", "student_launches", "race_free", "compiles",
           "variant_from", "numeric", "qkv", "launches"]

#: float32 kernels against the float64 reference.  Attention outputs are convex combinations of v (|v| ~ 1
#: here) after d-term dot products and N-term sums; float32 rounds each term at 6e-8 relative, so errors stay
#: ~1e-6 at the sizes graded (N <= 128, d <= 64).  2e-5 leaves a 10x margin, yet a missing rescale or a wrong
#: mask is off by 1e-2 or more.
TOL = dict(atol=2e-5, rtol=2e-5)


def qkv(seed: int, BH: int, Nq: int, Nk: int, d: int, *, do: bool = False):
    """Seeded standard-normal ``q (BH, Nq, d)``, ``k, v (BH, Nk, d)`` (and ``do``) in float64."""
    rng = np.random.default_rng(seed)
    out = [rng.standard_normal((BH, Nq, d)), rng.standard_normal((BH, Nk, d)), rng.standard_normal((BH, Nk, d))]
    if do:
        out.append(rng.standard_normal((BH, Nq, d)))
    return tuple(out)


def close(got, want, *, what: str, rows_per_tile: int | None = None, atol: float = TOL["atol"],
          rtol: float = TOL["rtol"], case: str = "") -> None:
    """``got`` (float32 from the student's kernels) against ``want`` (float64): same shape, no element left
    unwritten (NaN poison), the same infinities, and ``|got - want| <= atol + rtol·|want|`` everywhere.

    The message names the first bad element, its row (and tile of ``rows_per_tile`` rows) and the case."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    at = f" ({case})" if case else ""
    if got.shape != want.shape:
        raise Fail(f"{what}{at}: shape {got.shape}, expected {want.shape}")

    def where(flat: int) -> str:
        idx = np.unravel_index(flat, got.shape)
        text = f"{what}[{', '.join(str(int(i)) for i in idx)}]"
        if rows_per_tile and got.ndim >= 2:
            row = idx[-2] if got.ndim >= 3 or what.startswith(("o", "dq", "dk", "dv")) else idx[-1]
            text += f" (row {int(row)}, tile {int(row) // rows_per_tile} of {rows_per_tile} rows)"
        return text

    nan = np.isnan(got) & ~np.isnan(want)
    if nan.any():
        n = int(nan.sum())
        raise Fail(f"{what}{at}: {n} of {got.size} elements were never written (still the NaN poison) or are "
                   f"NaN; the first is {where(int(np.flatnonzero(nan)[0]))}")
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite) or not np.array_equal(got[~finite], want[~finite]):
        bad = int(np.flatnonzero((np.isfinite(got) != finite) | (~finite & (got != want)))[0])
        raise Fail(f"{what}{at}: {where(bad)} is {got.flat[bad]!r}, expected {want.flat[bad]!r} (a fully masked "
                   "row has lse = -inf and o = 0)")
    with np.errstate(invalid="ignore"):      # -inf - -inf where both are masked: compared above, zeroed here
        err = np.where(finite, np.abs(got - want), 0.0)
    bound = atol + rtol * np.abs(np.where(finite, want, 0.0))
    if (err > bound).any():
        worst = int(np.argmax(err - bound))
        first = int(np.flatnonzero(err > bound)[0])
        raise Fail(f"{what}{at}: {int((err > bound).sum())} of {got.size} elements differ from the float64 "
                   f"reference by more than {atol:g} + {rtol:g}·|ref|; first {where(first)}: got "
                   f"{got.flat[first]:.6g}, expected {want.flat[first]:.6g}; worst error {err.flat[worst]:.3g}")


def forward_close(run, seed: int, BH: int, Nq: int, Nk: int, d: int, *, causal, tiles: dict) -> None:
    """``run(q, k, v)`` (the student's forward through the library's launcher, returning ``(o, lse)``) against
    :func:`flashnb.reference.attention_forward` on seeded inputs: :func:`close` on both, naming the case."""
    from .. import reference

    q, k, v = qkv(seed, BH, Nq, Nk, d)
    o, lse = run(q, k, v)
    want_o, want_lse = reference.attention_forward(q, k, v, causal=causal)
    case = (f"BH={BH}, Nq={Nq}, Nk={Nk}, d={d}, causal={causal}, "
            + ", ".join(f"{k_}={v_}" for k_, v_ in tiles.items()))
    close(o, want_o, what="o", rows_per_tile=tiles["Br"], case=case)
    close(lse, want_lse, what="lse", rows_per_tile=tiles["Br"], case=case)


def numeric(value, want: float, *, what: str, rtol: float = 0.02, atol: float = 0.0) -> None:
    """A number the student computed (an IO ratio, a byte count) within ``rtol`` of ``want``."""
    if value is ... or value is None:
        raise Fail(f"{what}: not answered yet (still `...`)")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise Fail(f"{what}: expected a number, got {value!r}") from None
    if not abs(x - want) <= atol + rtol * abs(want):
        raise Fail(f"{what}: {x:.6g} is not within {rtol:.3g} (relative) of the expected value; recount from the "
                   "model")


@contextlib.contextmanager
def launches():
    """Count the launches made inside the block (``flashnb.instruments.traffic.count``); yields the counter."""
    from ..instruments import traffic

    with traffic.count() as t:
        yield t


def io_budget(run, model, *, budget: float | None = None, hint: str = "", shared: bool = False,
              labels: bool = True) -> None:
    """``run()`` launches the student's kernels; their counted HBM traffic must equal ``model`` (``budget=None``)
    or stay within ``budget`` of it, launch by launch and array by array.  Shared-memory accesses are compared
    too only with ``shared=True``: the IO complexity is about HBM, and a correct kernel may read its own shared
    tiles in another order or number.  ``labels=False`` compares launches by their order only: for launchers
    the student wrote, whose launch labels (or kernel names) are theirs to choose."""
    from ..instruments import traffic

    with traffic.count() as t:
        run()
    model = [model] if isinstance(model, dict) else list(model)
    if not shared:     # the model's shared counts replaced by the counted ones: only global traffic is compared
        counted = t.summary()
        adjusted = []
        for i, m in enumerate(model):
            m = dict(m)
            if i < len(counted):
                for key in ("shared_reads", "shared_writes", "shared_atomics"):
                    m[key] = counted[i].get(key, 0)
            adjusted.append(m)
        model = adjusted
    if not labels:
        model = [dict(m, launch=t.launches[i].label) if i < len(t.launches) else m for i, m in enumerate(model)]
    diffs = t.check_model(model, budget=budget, raise_on_mismatch=False)
    if diffs:
        rule = "exactly" if budget is None else f"within {budget:.0%}"
        shown = "\n".join("  " + d for d in diffs[:4]) + (f"\n  ... and {len(diffs) - 4} more" if len(diffs) > 4
                                                           else "")
        raise Fail(f"the HBM traffic of your kernels does not match the algorithm's IO model {rule}:\n{shown}"
                   + (f"\n{hint}" if hint else ""))


def ran_student_kernels(run, *, expect: int | None = None, labels=None) -> list:
    """Every launch ``run()`` makes -- or, with ``labels``, every launch with one of those labels (a launcher may
    also run given helper kernels, e.g. FA1's init) -- must run a kernel written by the student (its code comes
    from the submission, not from the installed flashnb); returns the launches."""
    from ..instruments import traffic

    with traffic.count() as t:
        run()
    return student_launches(t.launches, expect=expect, labels=labels)


def student_launches(launches, *, expect: int | None = None, labels=None) -> list:
    """:func:`ran_student_kernels` on launches already counted (``traffic.count().launches``): for a test that
    also needs the outputs of the same run."""
    import os

    if not launches:
        raise Fail("no kernel was launched")
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checked = [lt for lt in launches if labels is None or lt.label in labels]
    if labels is not None and not checked:
        raise Fail(f"no launch labelled {sorted(labels)}; launched: {[lt.label for lt in launches]}")
    theirs = [lt for lt in checked if lt.source and os.path.abspath(lt.source).startswith(package + os.sep)]
    if theirs:
        lt = theirs[0]
        raise Fail(f"launch {lt.label!r} ran flashnb's own kernel {lt.kernel} ({os.path.basename(lt.source)}), not "
                   "yours: build the kernel from your answer cell")
    if expect is not None and len(launches) != expect:
        raise Fail(f"{len(launches)} launches, expected {expect}: {[lt.label for lt in launches]}")
    return launches


def race_free(run) -> None:
    """``run()`` under the race checker: no two unordered accesses to one element (one a write)."""
    from ..sim import racecheck

    with racecheck.check(raise_on_race=False) as report:
        run()
    if report.races:
        shown = "\n".join("  " + str(r) for r in report.races[:3])
        raise Fail(f"{len(report.races)} data race(s) -- a GPU may run these accesses in either order:\n{shown}\n"
                   "within a block: a cuda.syncthreads() is missing between the two accesses, or two threads write "
                   "one element; across blocks: sums need cuda.atomic.add")


def _read(path) -> str:
    if not path:
        return ""
    with open(path) as f:
        return f.read()


def _compile_key(kernel, sig, ccs) -> str | None:
    """A key that changes whenever the compiled code could: the whole source file of the kernel (a cell, a
    variant), its qualified name, the values it closes over, the source of the module whose globals it uses,
    the signature, the architectures and the toolchain's versions.  None when any part cannot be read."""
    import hashlib
    import linecache
    import sys

    import numba

    try:
        fn = getattr(kernel, "py_func", kernel)
        parts = ["".join(linecache.getlines(fn.__code__.co_filename)), fn.__qualname__, sig, repr(ccs),
                 numba.__version__, getattr(numba.cuda, "__version__", ""),
                 _read(getattr(sys.modules.get(fn.__module__), "__file__", None))]
        for cell in fn.__closure__ or ():
            v = cell.cell_contents
            parts.append(getattr(getattr(v, "py_func", v), "__qualname__", None) or repr(v))
        if not parts[0]:
            return None
    except Exception:   # noqa: BLE001 -- no key, no cache: compile
        return None
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def compiles(kernels, ccs=((8, 0), (9, 0))) -> None:
    """Each ``(kernel, signature)`` compiles for every cc in ``ccs`` with no float64 instruction, shared
    memory within 48 KiB and no register spills (the PTX guard every library kernel passes).

    Inside ``flashnb course grade`` the verdicts are cached on disk for the batch (``$FLASHNB_COURSE_CACHE``),
    keyed by :func:`_compile_key`: a submission whose kernel is the same as an earlier one's is not compiled
    again, and any change to the kernel's source, closure values or toolchain is a new key."""
    import json
    import os

    from .. import instruments as fi

    todo = []
    for k, sig in kernels:
        path = _verdict_path(k, sig, ccs)
        if path and os.path.exists(path):
            _gpu_verdict(json.loads(open(path).read()))
            continue
        todo.append((k, sig, path))
    jobs = [(k, sig, cc) for k, sig, _ in todo for cc in ccs]
    results = fi.resources_of(jobs, keep_ptx=False) if jobs else []
    for n, (k, sig, path) in enumerate(todo):
        bad = [p for res in results[n * len(ccs):(n + 1) * len(ccs)] for p in fi.problems(res)]
        _write_verdict(path, bad)
        _gpu_verdict(bad)


def _verdict_path(kernel, sig, ccs) -> str | None:
    """Where the batch's verdict cache keeps ``kernel``'s verdict (None: no cache, or no key)."""
    import os

    cache = os.environ.get("FLASHNB_COURSE_CACHE")
    key = _compile_key(kernel, sig, ccs) if cache else None
    return os.path.join(cache, key + ".json") if key else None


def _write_verdict(path, bad: list) -> None:
    import json
    import os

    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(bad, f)
        os.replace(path + ".tmp", path)


def store_verdict(kernel, sig, ccs, bad: list) -> None:
    """Keep the guard's findings ``bad`` of a kernel compiled elsewhere (:mod:`flashnb.course.vouch`) in the
    batch's verdict cache, where :func:`compiles` finds them."""
    _write_verdict(_verdict_path(kernel, sig, tuple(tuple(c) for c in ccs)), bad)


def _gpu_verdict(bad: list) -> None:
    if bad:
        # ptxas names the kernel by its mangled symbol (hundreds of characters of argument types): the problem's
        # own prefix already names the kernel
        bad = [re.sub(r"'_Z\w+'", "'<the kernel>'", b) for b in bad]
        raise Fail("would not run well on a GPU: " + "; ".join(bad)
                   + ("\n(a Python float literal such as 0.0 or -math.inf makes float64 code: write "
                      "float32(0) )" if any("f64" in b or "float64" in b for b in bad) else ""))


def variant_from(ns: dict, name: str, factory, *, names: dict | None = None):
    """The student's ``ns[name]`` (a kernel factory written in an answer cell) as a variant of the library's
    ``factory`` (:func:`flashnb.registry.variant`): run by the library's launchers inside
    ``registry.using(factory, result)``."""
    from .. import registry

    fn = ns.get(name)
    if fn is None:
        raise Fail(f"{name} is not defined: run your answer cell (it defines {name})")
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise Fail(f"{name} must be the kernel factory function of your answer cell, got {type(fn).__name__}")
    import os

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code_file = os.path.abspath(getattr(_inspect.unwrap(fn), "__code__").co_filename)
    if hasattr(fn, "__wrapped__") or code_file.startswith(package + os.sep):
        raise Fail(f"{name} is flashnb's own factory ({os.path.basename(code_file)}), not yours: write it in your "
                   "answer cell")
    try:
        source = _inspect.getsource(fn)
    except (OSError, TypeError) as exc:
        raise Fail(f"cannot read the source of {name} ({exc}); define it in an answer cell") from None
    # the answer's own helpers (device functions and constants defined anywhere in the answer cells, outside the
    # factory too) resolve as they do in the notebook: the variant is compiled in the library module's namespace
    # (only names the library's module does not define: where it does, the variant keeps the library's, so that a
    # mistake in one question's answer does not cost the points of another)
    import sys

    module = sys.modules.get(getattr(_inspect.unwrap(factory), "__module__", "") or "")
    library = vars(module) if module is not None else {}
    helpers = {k: v for k, v in _answer_names(ns, source).items() if k not in library}
    try:
        made = registry.variant(factory, source=source, names=names, filename=f"<your {name}>")
    except SyntaxError as exc:
        raise Fail(f"{name}: syntax error at line {exc.lineno}: {exc.msg}") from None
    if helpers:       # the variant's namespace is its own copy of the module's: the helpers join it there
        _inspect.unwrap(made).__globals__.update(helpers)
    return made


def _answer_names(ns: dict, source: str) -> dict:
    """The names ``source`` uses that the answer cells bound in ``ns``: their device functions (defined in an answer
    cell) and plain constants."""
    import ast

    try:
        used = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    except SyntaxError:
        return {}
    out = {}
    for k in used & set(ns):
        v = ns[k]
        code = getattr(getattr(v, "py_func", None), "__code__", None)
        if code is not None and code.co_filename.startswith("<answer cell"):
            out[k] = v
        elif type(v) in (int, float, bool) or isinstance(v, np.generic):
            out[k] = v
    return out
