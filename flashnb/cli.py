"""``flashnb`` command line: ``info``, ``tour``, ``inspect``, ``bench``."""

from __future__ import annotations

import argparse
import platform
import sys

import numpy as np

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
        return {"mode": "sim", "device": "simulator (Numba CUDA simulator: each CUDA thread is a Python thread)"}
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


def tour_rows(*, BH=2, Nq=40, Nk=56, d=16, causal=True, seed=0, progress=True):
    """Run every registered impl on one small problem; return a list of result dicts.

    On the simulator each row carries counted HBM bytes and shared accesses, and a *modelled* time (roofline
    of the counted bytes and the benchmark FLOP formula on the ``TOUR_GPU`` preset).  On a GPU it carries a
    *measured* time (CUDA events) instead; counting needs the simulator.
    """
    from tqdm.auto import tqdm

    from . import api, reference, roofline
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
            from . import traffic

            counter = traffic.count()
        row = {"impl": name, "stage": entry.stage, "pass": direction}
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
                       modelled_ns=roofline.modelled_time(flops, nbytes, TOUR_GPU).seconds * 1e9)
        else:
            if info is None:   # read the device once (driver release via NVML or nvidia-smi), not per impl
                from . import bench

                info = bench.device_info()
            row["measured_us"] = _measure(entry, direction, q, k, v, o_ref, lse_ref, do, causal, info) * 1e3
        rows.append(row)
    return rows


def _measure(entry, direction, q, k, v, o, lse, do, causal, info):
    """Median CUDA-event time (ms) of the impl's device-level call on this problem (GPU only)."""
    from . import bench, common

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
    header = f"{'stage':>5}  {'impl':<10} {'pass':<9} {'max err':>9}"
    if MODE == "sim":
        header += f" {'HBM read B':>11} {'HBM write B':>11} {'shared acc.':>11} {'modelled ns':>11}"
    else:
        header += f" {'measured us':>11}"
    print(header)
    ok = True
    for r in rows:
        line = f"{r['stage']:>5}  {r['impl']:<10} {r['pass']:<9} {r['max_abs_err']:9.2e}"
        if "read_bytes" in r:
            line += f" {r['read_bytes']:11,d} {r['write_bytes']:11,d} {r['shared']:11,d} {r['modelled_ns']:11.1f}"
        else:
            line += f" {r['measured_us']:11.1f}"
        print(line)
        ok &= r["max_abs_err"] < 1e-3
    if MODE == "sim":
        print("HBM bytes are counted on the simulator (program-level element accesses x 4 bytes, atomics included "
              f"in the modelled time), not measured.\nModelled time = max(FLOPs / FP32 peak, bytes / bandwidth) on "
              f"a {TOUR_GPU} preset: a model, not a measurement.")
    else:
        print("Measured: median of 5 CUDA-event timings after warm-up, at this tiny size (launch-bound).")
    print("all impls agree with the reference" if ok else "SOME IMPLS DISAGREE WITH THE REFERENCE")
    return 0 if ok else 1


def int_in(lo: int, hi: int | None = None):
    """An argparse ``type``: an int in ``lo..hi`` (no upper bound when ``hi`` is None); out of range is an
    argparse error (usage line, message, exit code 2), never a traceback."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            rule = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be an integer {rule}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``flashnb`` parser (``inspect`` and ``bench`` parse their own options: see their ``--help``)."""
    from . import __version__
    from .api import MAX_HEAD_DIM

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
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("inspect", "bench"):
        if argv[0] == "inspect":
            from .inspect import main_inspect

            return main_inspect(argv[1:])
        from .bench import main_bench

        return main_bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    if args.command == "tour":
        return cmd_tour(args)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
