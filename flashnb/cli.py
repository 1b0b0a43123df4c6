"""``flashnb`` command line: ``info``, ``tour``, ``inspect``, ``bench``, ``sanitize``, ``profile``."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import threading

import numpy as np

from .argtypes import int_in

DESCRIPTION = ("flashnb: FlashAttention built kernel by kernel in Numba CUDA, on a GPU or on the Numba CUDA "
               "simulator. Run 'flashnb COMMAND --help' for a command's options.")


def _versions() -> dict:
    import numba

    from . import __version__

    out = {"flashnb": __version__, "python": platform.python_version(), "numpy": np.__version__,
           "numba": numba.__version__}
    try:
        from importlib.metadata import version

        out["numba-cuda"] = version("numba-cuda")
    except Exception:  # pragma: no cover - metadata missing in odd installs
        out["numba-cuda"] = "unknown"
    return out


def device_description() -> dict:
    """Mode, device name, compute capability and SM count (or the simulator)."""
    from numba import cuda

    from .runtime import MODE

    if MODE == "sim":
        from . import sim

        how = ("flashnb.sim.vector: a whole grid in lockstep as NumPy vectors" if sim.mode() == "vector"
               else "Numba CUDA simulator: each CUDA thread is a Python thread")
        return {"mode": "sim", "device": f"simulator ({how})"}
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    return {"mode": "gpu", "device": name, "compute_capability": "%d.%d" % dev.compute_capability,
            "sm_count": dev.MULTIPROCESSOR_COUNT}


def cmd_info(args) -> int:
    for key, value in {**device_description(), **_versions()}.items():
        print(f"{key:>20}: {value}")
    from .registry import IMPLS, KERNELS

    print(f"{'impls':>20}: {', '.join(IMPLS)}")
    print(f"{'kernels':>20}: {len(KERNELS)} registered")
    return 0


TOUR_GPU = "H100 SXM"  # preset used for the modelled time in the tour
# What each row of the tour is held to, by what the impl's matmuls run in on float32 input: float32 on the CUDA
# cores (float32 against float64 on these sizes: ~1e-7), or TF32 on the tensor cores (10-bit mantissas: ~1e-3).
TOUR_TOLERANCE = {"float32": 1e-3, "tf32": 1e-2}
# The compute roof of the modelled time, by the same: the FP32 CUDA cores, or the dense TF32 tensor-core peak.
TOUR_PEAK = {"float32": "fp32", "tf32": "tensor_tf32"}


def tour_rows(*, BH=2, Nq=40, Nk=56, d=16, causal=True, seed=0, progress=True):
    """Run every registered impl on one small problem; return a list of result dicts.

    On the simulator each row carries counted HBM bytes and shared accesses, and a *modelled* time (roofline
    of the counted bytes and the benchmark FLOP formula on the ``TOUR_GPU`` preset).  On a GPU it carries a
    *measured* time (CUDA events) instead; counting needs the simulator.
    """
    from tqdm.auto import tqdm

    from . import api, reference
    from .instruments import roofline
    from .registry import IMPLS
    from .runtime import MODE

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BH, Nq, d))
    k = rng.standard_normal((BH, Nk, d))
    v = rng.standard_normal((BH, Nk, d))
    do = rng.standard_normal((BH, Nq, d))
    refs = reference.ReferenceCache(q, k, v, do)   # dense, or each impl's own mask (block-sparse)

    by_stage = sorted(IMPLS, key=lambda n: (IMPLS[n].stage, n))
    jobs = [(n, "forward") for n in by_stage] + [(n, "backward") for n in by_stage if IMPLS[n].backward]
    rows = []
    info = None  # the GPU's device_info, read at the first measurement
    for name, direction in tqdm(jobs, desc="flashnb tour", disable=not progress, file=sys.stderr):
        entry = IMPLS[name]
        counter = None
        if MODE == "sim":
            from .instruments import traffic

            counter = traffic.count()
        row = {"impl": name, "stage": entry.stage, "pass": direction, "precision": entry.precision,
               "tolerance": TOUR_TOLERANCE[entry.precision]}
        o_ref, lse_ref, grads_ref = refs.for_impl(entry, causal)
        with counter if counter is not None else _null():
            if direction == "forward":
                o, lse = api.attention_forward(q, k, v, causal=causal, impl=name)
                finite = np.isfinite(lse_ref)
                err = max(np.abs(o - o_ref).max(), np.abs(lse[finite] - lse_ref[finite]).max(initial=0.0))
                if not np.array_equal(lse[~finite], lse_ref[~finite]):
                    err = float("inf")  # a row with no key must give lse = -inf exactly
            else:
                # the backward is checked on its own: it gets the reference's O and LSE
                grads = api.attention_backward(q, k, v, o_ref, lse_ref, do, causal=causal, impl=name)
                err = max(np.abs(g - r).max() for g, r in zip(grads, grads_ref))
        row["max_abs_err"] = float(err)
        flops = entry.flops(1, BH, Nq, Nk, d, causal, direction)
        if counter is not None:
            nbytes = counter.global_read_bytes + counter.global_write_bytes + 4 * counter.atomics
            row.update(read_bytes=counter.global_read_bytes, write_bytes=counter.global_write_bytes,
                       shared=counter.shared_reads + counter.shared_writes,
                       modelled_ns=roofline.modelled_time(flops, nbytes, TOUR_GPU,
                                                          peak=TOUR_PEAK[entry.precision]).seconds * 1e9)
        else:
            if info is None:   # read the device once (driver release via NVML or nvidia-smi), not per impl
                from .instruments import bench

                info = bench.device_info()
            row["measured_us"] = _measure(entry, direction, q, k, v, o_ref, lse_ref, do, causal, info) * 1e3
        rows.append(row)
    return rows


def _measure(entry, direction, q, k, v, o, lse, do, causal, info):
    """Median CUDA-event time (ms) of the impl's device-level call on this problem (GPU only)."""
    from . import common
    from .instruments import bench

    with common.poisoning(False):  # time the kernels, not the NaN fill of fresh outputs
        return _measure_unpoisoned(bench, common, entry, direction, q, k, v, o, lse, do, causal, info)


def _measure_unpoisoned(bench, common, entry, direction, q, k, v, o, lse, do, causal, info):
    dev = [common.to_device(a) for a in (q, k, v)]
    scale = 1.0 / np.sqrt(q.shape[-1])
    if direction == "forward":
        return bench.time_call(lambda: entry.forward(*dev, causal=causal, scale=scale), repeats=5,
                               info=info).median_ms
    extra = [common.to_device(o), common.to_device(lse), common.to_device(do)]
    return bench.time_call(lambda: entry.backward(*dev, extra[0], extra[1], extra[2], causal=causal, scale=scale),
                           repeats=5, info=info).median_ms


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def cmd_tour(args) -> int:
    from .runtime import MODE

    desc = device_description()
    print(f"flashnb tour on {desc['device']}: BH={args.bh}, Nq={args.nq}, Nk={args.nk}, d={args.d}, "
          f"causal={args.causal}; errors are max |impl - float64 reference|")
    rows = tour_rows(BH=args.bh, Nq=args.nq, Nk=args.nk, d=args.d, causal=args.causal, progress=not args.quiet)
    sw = max([5] + [len(str(r["stage"])) for r in rows])          # column widths fit every stage and impl name
    iw = max([10] + [len(r["impl"]) for r in rows])
    header = f"{'stage':>{sw}}  {'impl':<{iw}} {'pass':<9} {'max err':>9} {'tolerance':>14}"
    if MODE == "sim":
        header += f" {'HBM read B':>11} {'HBM write B':>11} {'shared acc.':>11} {'modelled ns':>11}"
    else:
        header += f" {'measured us':>11}"
    print(header)
    ok = True
    for r in rows:
        tol = f"{r['tolerance']:.0e} {'TF32' if r['precision'] == 'tf32' else 'FP32'}"
        line = f"{r['stage']:>{sw}}  {r['impl']:<{iw}} {r['pass']:<9} {r['max_abs_err']:9.2e} {tol:>14}"
        if "read_bytes" in r:
            line += f" {r['read_bytes']:11,d} {r['write_bytes']:11,d} {r['shared']:11,d} {r['modelled_ns']:11.1f}"
        else:
            line += f" {r['measured_us']:11.1f}"
        print(line)
        ok &= r["max_abs_err"] < r["tolerance"]
    print("Tolerance: what a row's error is held to, by what its matmuls run in on this float32 input: FP32 (CUDA "
          "cores) or TF32 (tensor cores, 10-bit mantissas).")
    if MODE == "sim":
        print("HBM bytes are counted on the simulator (program-level element accesses x 4 bytes, atomics included "
              f"in the modelled time), not measured.\nModelled time = max(FLOPs / peak, bytes / bandwidth) on "
              f"a {TOUR_GPU} preset, peak = the FP32 CUDA cores' (FP32 rows) or the dense TF32 tensor cores' "
              "(TF32 rows): a model, not a measurement.")
    else:
        print("Measured: median of 5 CUDA-event timings after warm-up, at this tiny size (launch-bound).")
    print("every impl agrees with the reference within its tolerance" if ok
          else "SOME IMPLS DISAGREE WITH THE REFERENCE")
    return 0 if ok else 1


def _problem(args, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((args.bh, n, args.d)) for n in (args.nq, args.nk, args.nk, args.nq)]


def _simulator_only(what: str) -> int | None:
    from .runtime import MODE

    if MODE != "sim":
        print(f"flashnb {what} runs kernels on the simulator (it watches every access); this process is in GPU "
              "mode. Run it with FLASHNB_DEVICE=sim.", file=sys.stderr)
        return 2
    return None


class _HardExit(BaseException):
    """``os._exit(status)`` called by a sanitized script (see :func:`_run_script`)."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


@contextlib.contextmanager
def _trap_hard_exit():
    """While a script runs under ``flashnb sanitize``: ``os._exit`` in this process's main thread raises
    :class:`_HardExit` instead of ending the process at once, so the sanitizer's report is still made and printed
    (the script's ``finally`` blocks run on the way out); a forked child or another thread exits as usual."""
    real, pid, main = os._exit, os.getpid(), threading.main_thread()

    def trapped(status):
        if os.getpid() == pid and threading.current_thread() is main:
            raise _HardExit(status)
        real(status)

    os._exit = trapped
    try:
        yield
    finally:
        os._exit = real


def _exit_status(code) -> int:
    """What Python's interpreter makes of ``SystemExit(code)``: None is 0, an int itself, anything else is printed
    to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_script(path: str) -> tuple[int, bool]:
    """Run ``path`` as ``__main__`` (with ``sys.argv = [path]``) and return ``(status, hard)``: the exit status
    Python would give the script -- 0 when it ends, ``n`` for ``sys.exit(n)`` or ``raise SystemExit(n)``, 1 after
    printing the traceback of an uncaught exception (130 for KeyboardInterrupt), ``n`` for ``os._exit(n)`` (then
    ``hard`` is True) -- without letting any of them leave the sanitizer's ``with`` block before its report.  A
    launch that memcheck aborts is left to the sanitizer (it is in the report; the script's status stays 0)."""
    import runpy
    import traceback

    from .sim.sanitizer import MemcheckError

    argv = sys.argv
    sys.argv = [path]
    try:
        with _trap_hard_exit():
            runpy.run_path(path, run_name="__main__")
        return 0, False
    except SystemExit as exc:
        return _exit_status(exc.code), False
    except _HardExit as exc:
        return int(exc.status), True
    except MemcheckError:
        raise                                   # memcheck aborted a launch: the sanitizer reports it
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130, False
    except Exception:
        traceback.print_exc()
        return 1, False
    finally:
        sys.argv = argv


#: The checkers a sanitized script may start itself: (module of flashnb.sim, its function, what the script calls).
_SCRIPT_CHECKERS = (("racecheck", "check", "flashnb.sim.racecheck.check()"),
                    ("sanitizer", "sanitize", "flashnb.sim.sanitize()"),
                    ("memprofile", "profile", "flashnb.sim.profile()"))


@contextlib.contextmanager
def _script_checkers(notes: list):
    """While ``flashnb sanitize`` runs a script: a checker the script starts itself (``racecheck.check()``,
    ``sanitize()``, ``profile()`` -- the simulator watches launches with one checker at a time) works as it does
    under ``python script.py``, with the outer sanitizer set aside for its block
    (:func:`flashnb.sim.sanitizer.set_aside`); ``notes`` gets ``(what, launches)`` per such block, for the report
    to say which launches the script's own checker saw instead."""
    import importlib

    from .instruments import traffic
    from .sim.sanitizer import set_aside

    def nested(original, what):
        @contextlib.contextmanager
        def checker(*args, **kwargs):
            with set_aside(), traffic.count() as counted:
                try:
                    with original(*args, **kwargs) as inner:
                        yield inner
                finally:
                    notes.append((what, len(counted.launches)))
        checker.__doc__, checker.__wrapped__ = original.__doc__, original
        return checker

    saved = []
    for module, name, what in _SCRIPT_CHECKERS:
        mod = importlib.import_module(f"flashnb.sim.{module}")
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, nested(getattr(mod, name), what))
    try:
        yield
    finally:
        for mod, name, original in saved:
            setattr(mod, name, original)


def _sanitize_target(target: str, impls) -> str | None:
    """``"impl"``, ``"script"``, or None after printing why ``target`` is neither (a missing file, a directory, an
    unknown impl name)."""
    if target in impls:
        return "impl"
    if os.path.isfile(target):
        return "script"
    if os.path.isdir(target):
        why = f"{target!r} is a directory; give a Python script"
    elif target.endswith(".py") or os.sep in target or (os.altsep and os.altsep in target):
        why = f"no such file: {target!r}"
    else:
        why = f"{target!r} is neither an impl ({', '.join(impls)}) nor a Python file"
    print(f"flashnb sanitize: {why}", file=sys.stderr)
    return None


def cmd_sanitize(args) -> int:
    """Run impls (forward and backward) or Python scripts under the sanitizer and print each report, however a
    script ends.  Exit status: 1 when the sanitizer found errors; else the first nonzero exit status of a script
    (``sys.exit(n)``, an uncaught exception: 1); else 0.  A script that calls ``os._exit(n)`` ends the process
    with that status policy right after its report (the remaining targets are not run)."""
    from . import api, sim
    from .registry import IMPLS

    if (code := _simulator_only("sanitize")) is not None:
        return code
    tools = tuple(args.tool) if args.tool else sim.sanitizer.TOOLS
    targets = list(IMPLS) if args.target == ["all"] else args.target
    kinds = [_sanitize_target(t, IMPLS) for t in targets]
    if None in kinds:
        return 2
    found, status = False, 0
    for target, kind in zip(targets, kinds):
        code, hard, notes = 0, False, []
        with sim.sanitize(tools=tools, raise_on_error=False) as report:
            if kind == "impl":
                q, k, v, do = _problem(args)
                o, lse = api.attention_forward(q, k, v, causal=args.causal, impl=target)
                if IMPLS[target].backward is not None:
                    api.attention_backward(q, k, v, o, lse, do, causal=args.causal, impl=target)
            else:
                with _script_checkers(notes):
                    code, hard = _run_script(target)
        print(f"{target}: {report}")
        for what, launches in notes:
            print(f"{target}: {launches} launch(es) ran inside the script's own {what} block: that checker watched "
                  "them (as under `python script`), this report does not cover them")
        found |= bool(report)
        if kind == "script" and code != 0:
            print(f"{target}: the script exited with status {code}", file=sys.stderr)
            status = status or code
        if hard:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1 if found else status)
    return 1 if found else status


def profile_rows(impls, *, BH=1, Nq=64, Nk=64, d=32, causal=False, seed=0, storage=None):
    """Every impl in ``impls`` (forward, and backward where it has one) under :func:`flashnb.sim.profile`:
    one dict per (impl, pass) with the global sectors and shared wavefronts per request, their ideals, the
    bank conflicts, and the :class:`~flashnb.sim.memprofile.MemoryProfile` itself (``"profile"``).  ``storage``
    ``"float16"``: the inputs in float16 (what the tensor-core impl is for)."""
    from types import SimpleNamespace

    from . import api, sim
    from .registry import IMPLS

    q, k, v, do = _problem(SimpleNamespace(bh=BH, nq=Nq, nk=Nk, d=d), seed)
    if storage == "float16":
        q, k, v, do = (a.astype(np.float16) for a in (q, k, v, do))
    rows = []
    for name in impls:
        for direction in ("forward", "backward"):
            if direction == "backward" and IMPLS[name].backward is None:
                continue
            if direction == "forward":
                with sim.profile() as prof:
                    api.attention_forward(q, k, v, causal=causal, impl=name)
            else:
                o, lse = api.attention_forward(q, k, v, causal=causal, impl=name)
                with sim.profile() as prof:
                    api.attention_backward(q, k, v, o, lse, do, causal=causal, impl=name)
            row = {"impl": name, "pass": direction, "profile": prof}
            for memory, op in (("global", "ld"), ("global", "st"), ("shared", "ld"), ("shared", "st")):
                t = prof.total(memory=memory, op=op)
                row[f"{memory}_{op}"] = t["cost"] / t["requests"] if t["requests"] else None
                row[f"{memory}_{op}_ideal"] = t["ideal"] / t["requests"] if t["requests"] else None
            row["bank_conflicts"] = prof.total(memory="shared")["bank_conflicts"]
            rows.append(row)
    return rows


def cmd_profile(args) -> int:
    from .registry import IMPLS

    if (code := _simulator_only("profile")) is not None:
        return code
    impls = args.impl or sorted(IMPLS, key=lambda n: (IMPLS[n].stage, n))
    unknown = [n for n in impls if n not in IMPLS]
    if unknown:
        print(f"flashnb profile: unknown impl(s) {unknown}; choose from {', '.join(IMPLS)}", file=sys.stderr)
        return 2
    print(f"flashnb profile on the simulator: BH={args.bh}, Nq={args.nq}, Nk={args.nk}, d={args.d}, "
          f"causal={args.causal}; per warp request (ideal in brackets): global 32-byte sectors, shared wavefronts")
    rows = profile_rows(impls, BH=args.bh, Nq=args.nq, Nk=args.nk, d=args.d, causal=args.causal)

    def cell(r, key):
        return "-" if r[key] is None else f"{r[key]:.2f} ({r[key + '_ideal']:.2f})"

    print(f"{'impl':<10} {'pass':<9} {'global ld':>13} {'global st':>13} {'shared ld':>13} {'shared st':>13} "
          f"{'bank confl.':>11}")
    for r in rows:
        print(f"{r['impl']:<10} {r['pass']:<9} {cell(r, 'global_ld'):>13} {cell(r, 'global_st'):>13} "
              f"{cell(r, 'shared_ld'):>13} {cell(r, 'shared_st'):>13} {r['bank_conflicts']:>11,}")
    if args.lines:
        for r in rows:
            worst = r["profile"].worst(args.lines)
            if worst:
                print(f"\n{r['impl']} {r['pass']}: the {len(worst)} line(s) that waste the most")
                print(r["profile"].table(worst))
    print("\nCounted on the simulator: program-level accesses grouped into warp requests (the k-th access of a "
          "line by a warp's lanes); no cache modelling. Names and caveats: flashnb.sim.memprofile.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``flashnb`` parser (``inspect`` and ``bench`` parse their own options: see their ``--help``)."""
    from . import __version__
    from .common import MAX_HEAD_DIM

    parser = argparse.ArgumentParser(prog="flashnb", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"flashnb {__version__}",
                        help="print the flashnb version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("info", help="mode (GPU or simulator), device and versions",
                   description="Print the mode (GPU or simulator), the device and the versions.")
    tour = sub.add_parser("tour", help="run every registered stage on a small input and check it",
                          description="Run every registered implementation on one small problem: max error vs the "
                                      "float64 reference, counted HBM bytes and modelled time (simulator) or "
                                      "measured time (GPU).")
    tour.add_argument("--bh", type=int_in(1), default=2, help="batch x heads (default 2)")
    tour.add_argument("--nq", type=int_in(1), default=40, help="query sequence length Nq (default 40)")
    tour.add_argument("--nk", type=int_in(1), default=56, help="key sequence length Nk (default 56)")
    tour.add_argument("--d", type=int_in(1, MAX_HEAD_DIM), default=16,
                      help=f"head dim d, 1..{MAX_HEAD_DIM} (default 16)")
    tour.add_argument("--no-causal", dest="causal", action="store_false",
                      help="dense attention (default: causal, aligned bottom-right)")
    tour.add_argument("--quiet", action="store_true", help="no progress bar")
    sub.add_parser("inspect", help="registers, shared memory, spills and occupancy of every kernel (no GPU needed)",
                   add_help=False)
    sub.add_parser("bench", help="time every impl over N (and d) on a GPU; CSV + plot with provenance",
                   add_help=False)
    san = sub.add_parser("sanitize", help="run impls or a script under memcheck, racecheck, initcheck and synccheck "
                         "(simulator)")
    san.add_argument("target", nargs="+", help="impl name(s), 'all', or a Python script to run")
    san.add_argument("--tool", action="append", choices=("memcheck", "racecheck", "initcheck", "synccheck"),
                     help="a tool to run (repeat for several; default: all four)")
    prof = sub.add_parser("profile", help="global sectors and shared-memory bank conflicts per warp request of "
                          "every impl (simulator)")
    prof.add_argument("impl", nargs="*", help="impl name(s); default: all")
    prof.add_argument("--lines", type=int_in(0), default=3, help="show the N most wasteful source lines per pass")
    for p, (nq, nk, d) in ((san, (24, 40, 8)), (prof, (64, 64, 32))):
        p.add_argument("--bh", type=int_in(1), default=1, help="batch x heads (default 1)")
        p.add_argument("--nq", type=int_in(1), default=nq, help=f"query sequence length Nq (default {nq})")
        p.add_argument("--nk", type=int_in(1), default=nk, help=f"key sequence length Nk (default {nk})")
        p.add_argument("--d", type=int_in(1, MAX_HEAD_DIM), default=d,
                       help=f"head dim d, 1..{MAX_HEAD_DIM} (default {d})")
        p.add_argument("--no-causal", dest="causal", action="store_false",
                       help="dense attention (default: causal, aligned bottom-right)")
    sa = sub.add_parser("sass", help="SASS instruction mix of a registered kernel (FFMA share, shared-load widths, "
                        "local memory), its hot loop, no GPU needed",
                        description="Compile a registered kernel (compile_ptx + ptxas) and disassemble it with "
                                    "nvdisasm: the instruction mix of the whole kernel and of its hot loop.")
    sa.add_argument("kernel", help="a registered kernel name, e.g. fa2.forward (see 'flashnb inspect')")
    sa.add_argument("--config", default=None, help="its configuration as a JSON object, e.g. "
                    "'{\"Br\": 64, \"Bc\": 32, \"warps\": 4, \"d\": 64, \"causal\": false}', merged over the "
                    "default (the first configuration the PTX guard compiles): '{\"d\": 32}' changes d alone")
    sa.add_argument("--cc", default="90", choices=("75", "80", "90"), help="architecture (default 90)")
    sa.add_argument("--hot", action="store_true", help="also print the hot loop's instructions")
    course = sub.add_parser("course", help="graded assignments: make the student release, grade submissions",
                            description="Graded assignments (assignments/README.md): 'release' builds the student "
                                        "notebooks and autograder bundles from the masters; 'grade' grades a folder "
                                        "of submitted notebooks into a CSV and one feedback file per student; "
                                        "'gradescope' writes a bundle as a Gradescope autograder zip.")
    csub = course.add_subparsers(dest="course_command", required=True, metavar="ACTION")
    rel = csub.add_parser("release", help="build student notebooks and autograder bundles from the masters")
    rel.add_argument("masters", nargs="*", help="master.py files (default: assignments/*/master.py)")
    rel.add_argument("--out", default="release", help="output folder (default ./release)")
    rel.add_argument("--install", default=None, metavar="PIP_SPEC",
                     help="a pip requirement for the course's copy of flashnb (e.g. \"flashnb[course] @ "
                          "git+https://...\"): adds a first cell that installs it where flashnb is missing (Colab)")
    gr = csub.add_parser("grade", help="grade a folder of submissions into a CSV plus feedback files")
    gr.add_argument("bundle", help="an assignment's autograder folder, e.g. release/a1_online_softmax/autograder")
    gr.add_argument("submissions", help="folder of submitted notebooks (<student>.ipynb)")
    gr.add_argument("--out", default="scores.csv", help="the CSV to write (default ./scores.csv); feedback goes "
                    "into a 'feedback' folder beside it")
    gr.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="grade N submissions at once, each in processes of its own (default 1; about one per core)")
    gr.add_argument("--cpu-seconds", type=float, default=180.0, metavar="S",
                    help="CPU seconds a submission may use, all its processes together (default 180)")
    gr.add_argument("--memory-gib", type=float, default=4.0, metavar="G",
                    help="address space of each of a submission's processes, in GiB (default 4)")
    gr.add_argument("--output-mib", type=float, default=8.0, metavar="M",
                    help="what a submission may print, and the largest file it may write, in MiB (default 8)")
    gr.add_argument("--scratch-mib", type=float, default=256.0, metavar="M",
                    help="size of each submission's private scratch in its sandbox: every byte it writes, in all "
                         "files together, in MiB (default 256)")
    gr.add_argument("--no-sandbox", action="store_true",
                    help="grade without the bubblewrap sandbox where it cannot run (only submissions from people you "
                         "trust: the CSV and each feedback say so)")
    gr.add_argument("--no-screen", action="store_true",
                    help="skip the static screen of the answer cells (only for submissions a person has read: the "
                         "limits and checks still apply, but code the screen would refuse then runs)")
    gs = csub.add_parser("gradescope", help="write an assignment's bundle as a Gradescope autograder zip",
                         description="Gradescope's autograder format: setup.sh, run_autograder and the bundle "
                                     "(assignments/README.md, 'Gradescope').")
    gs.add_argument("bundle", help="an assignment's autograder folder, e.g. release/a1_online_softmax/autograder")
    gs.add_argument("--out", default="autograder.zip", help="the zip to write (default ./autograder.zip)")
    gs.add_argument("--install", default="flashnb[course]", metavar="PIP_SPEC",
                    help="the pip requirement setup.sh installs: the course's copy of flashnb (default "
                         "'flashnb[course]')")
    return parser


def _kind(value) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(type(value), "null")


def kernel_config(spec, text: str | None) -> dict:
    """The configuration ``flashnb sass --config TEXT`` asks for: the JSON object merged over the kernel's default
    (the first configuration the PTX guard compiles), each given value of its default's JSON type, checked by
    building the kernel.  ValueError with the usage message otherwise (not JSON, not an object, an unknown key,
    a value of another type, a value the kernel factory refuses)."""
    import inspect
    import json

    default = dict(spec.configs[0])
    if text is None:
        return default
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config is not JSON ({exc})") from None
    if not isinstance(given, dict):
        raise ValueError(f"--config must be a JSON object of {spec.name}'s options (merged over its default "
                         f"{json.dumps(default)}), got {text!r}")
    params = inspect.signature(spec.factory).parameters
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise ValueError(f"--config: {spec.name} has no option(s) {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(params)}")
    for name, value in given.items():
        want = default.get(name, params[name].default)
        ok = isinstance(value, str) or value is None if want is None else \
            type(value) is type(want) or (type(want) is float and type(value) is int)
        if want is not inspect.Parameter.empty and not ok:
            raise ValueError(f"--config: {name} must be {_kind(want)} (as in the default {json.dumps(default)}), "
                             f"got {json.dumps(value)}")
    config = {**default, **given}
    try:
        spec.signature_for(config)
        spec.factory(**config)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--config {json.dumps(config)}: {exc}") from None
    return config


def cmd_sass(args) -> int:
    from .instruments.sass import sass
    from .registry import KERNELS

    if args.kernel not in KERNELS:
        print(f"flashnb sass: unknown kernel {args.kernel!r}; registered: {', '.join(sorted(KERNELS))}",
              file=sys.stderr)
        return 2
    try:
        config = kernel_config(KERNELS[args.kernel], args.config)
    except ValueError as exc:
        print(f"flashnb sass: {exc}", file=sys.stderr)
        return 2
    try:
        s = sass(args.kernel, cc=(int(args.cc[0]), int(args.cc[1])), config=config)
    except RuntimeError as exc:                 # the compile (NVVM, ptxas) or nvdisasm failed: its own message
        print(f"flashnb sass: {args.kernel} {config} did not compile for sm_{args.cc}: {exc}", file=sys.stderr)
        return 1
    print(s.table())
    if args.hot:
        print("\n".join(str(i) for i in s.hot_loop))
    return 0


def cmd_course(args) -> int:
    from pathlib import Path

    if args.course_command == "release":
        from .course.build import release

        masters = args.masters or sorted(str(p) for p in Path("assignments").glob("*/master.py"))
        if not masters:
            print("no masters given and none in ./assignments/*/master.py", file=sys.stderr)
            return 2
        for m in release(masters, args.out, install=args.install):
            pts = sum(t["points"] for t in m["tests"])
            hidden = sum(t["points"] for t in m["tests"] if t["hidden"])
            print(f"{m['name']}: {len(m['tests'])} tests, {pts:g} points ({hidden:g} hidden) -> "
                  f"{Path(args.out) / m['name']}/student, /autograder")
        return 0
    from .course.grade import BundleError, Limits, grade
    from .course.sandbox import SandboxError

    if args.course_command == "gradescope":
        from .course.gradescope import build

        try:
            out = build(args.bundle, args.out, install=args.install)
        except (FileNotFoundError, BundleError) as exc:
            print(f"flashnb course gradescope: {exc}", file=sys.stderr)
            return 2
        print(f"{out}: upload it as the assignment's autograder (setup.sh installs {args.install})")
        return 0
    try:
        limits = Limits(cpu_s=args.cpu_seconds, memory_gib=args.memory_gib, output_mib=args.output_mib,
                        scratch_mib=args.scratch_mib)
        if args.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
        grade(args.bundle, args.submissions, args.out, jobs=args.jobs, limits=limits, screen=not args.no_screen,
              sandbox=not args.no_sandbox)
    except (FileNotFoundError, BundleError, ValueError, SandboxError) as exc:
        print(f"flashnb course grade: {exc}", file=sys.stderr)
        return 2
    print(f"scores: {args.out}; feedback: {Path(args.out).parent / 'feedback'}")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("inspect", "bench"):
        if argv[0] == "inspect":
            from .instruments import main_inspect

            return main_inspect(argv[1:])
        from .instruments.bench import main_bench

        return main_bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    if args.command == "tour":
        return cmd_tour(args)
    if args.command == "sanitize":
        return cmd_sanitize(args)
    if args.command == "profile":
        return cmd_profile(args)
    if args.command == "course":
        return cmd_course(args)
    if args.command == "sass":
        return cmd_sass(args)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
