"""GPU-only Python paths rehearsed on the simulator (flashnb.instruments.rehearsal): CUDA-event timing statistics,
device attributes, the notebooks' GPU measurements, the child process notebooks use, the sweep, the tour's measured
column and scripts/gpu_check.py end to end (with a stand-in ncu).  Kernels still run on the simulator; the
point is that the code around them runs before a GPU is lent, not the numbers."""

import ast
import csv
import inspect
import os
import stat
import sys
import textwrap
from pathlib import Path

import numba.cuda
import pytest

import flashnb
from flashnb.instruments import bench, rehearsal
from flashnb.instruments.rehearsal import ManualClock, PretendDevice, PretendEvent, pretend_gpu

ROOT = Path(__file__).resolve().parents[2]
CUDA_SRC = Path(numba.cuda.__file__).resolve().parent


def _function_params(tree, name, cls=None):
    scope = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    args = fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + [ast.literal_eval(d) for d in fn.args.defaults]
    return [(a.arg, dflt) for a, dflt in zip(args, defaults)]


def _params(fn):
    return [(p.name, None if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(fn).parameters.values()]


def test_pretend_events_have_numba_cudas_signatures():
    # the real (GPU) numba-cuda source, read as text: the simulator cannot import it
    api = ast.parse((CUDA_SRC / "api.py").read_text())
    drv = ast.parse((CUDA_SRC / "cudadrv" / "driver.py").read_text())
    assert _function_params(api, "event") == [("timing", True)]
    assert any(isinstance(n, ast.Assign) and n.targets[0].id == "event_elapsed_time" for n in api.body
               if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name))
    assert [p for p, _ in _function_params(drv, "event_elapsed_time")] == ["evtstart", "evtend"]
    for method in ("record", "wait", "synchronize", "elapsed_time", "query"):
        real = _function_params(drv, method, cls="Event")[1:]          # without self
        assert _params(getattr(PretendEvent(lambda: 0.0), method)) == real, method


def test_pretend_device_attributes_are_cuda_device_attributes():
    from cuda.bindings import driver

    for name in PretendDevice.ATTRIBUTES:
        assert hasattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}"), name


def test_pretend_gpu_restores_everything():
    before = (flashnb.runtime.MODE, numba.cuda.event, numba.cuda.get_current_device, hasattr(numba.cuda,
              "event_elapsed_time"), os.environ.get(rehearsal.ENV))
    with pretend_gpu():
        assert not flashnb.is_simulator() and rehearsal.active() and os.environ[rehearsal.ENV] == "1"
    after = (flashnb.runtime.MODE, numba.cuda.event, numba.cuda.get_current_device, hasattr(numba.cuda,
             "event_elapsed_time"), os.environ.get(rehearsal.ENV))
    assert before == after and flashnb.is_simulator() and not rehearsal.active()


def test_time_call_statistics_on_a_manual_clock():
    clock = ManualClock()
    # warm-up calls (JIT compilation) take 1000 ms and must not be timed; then 1, 2, 3, 4, 100 ms
    durations = iter([1000.0, 1000.0, 1.0, 2.0, 3.0, 4.0, 100.0])
    with pretend_gpu(clock):
        t = bench.time_call(lambda: clock.advance(next(durations)), repeats=5, warmup=2, flops=6e9)
    assert next(durations, None) is None                        # exactly warmup + repeats calls
    assert (t.median_ms, t.min_ms, t.max_ms) == (3.0, 1.0, 100.0)
    assert (t.q1_ms, t.q3_ms) == (2.0, 4.0)                      # inclusive quartiles of 1, 2, 3, 4, 100
    assert t.tflops == pytest.approx(2.0)                        # 6e9 FLOP / 3 ms
    peak_tflops = 132 * 128 * 2 * 1.98e9 / 1e12                 # SMs x lanes x FMA x clock (by hand)
    assert t.pct_fp32_peak == pytest.approx(100 * 2.0 / peak_tflops)
    assert t.kind == "rehearsal" and t.device == rehearsal.DEVICE_NAME


def test_timed_calls_run_with_frees_deferred(monkeypatch):
    # Before: arrays fn() allocates could be freed by numba (a synchronising cuMemFree) inside a timed sample.
    import contextlib

    from numba import cuda

    state = {"deferred": False}

    @contextlib.contextmanager
    def defer_cleanup():
        state["deferred"] = True
        try:
            yield
        finally:
            state["deferred"] = False

    monkeypatch.setattr(cuda, "defer_cleanup", defer_cleanup)
    seen = []
    with pretend_gpu(ManualClock()):
        bench.time_call(lambda: seen.append(state["deferred"]), repeats=3, warmup=2)
    assert seen == [False, False, True, True, True]      # warm-ups free normally; every timed call deferred


def test_spin_length_is_measured_not_assumed(monkeypatch):
    clock = ManualClock()

    class HalfSpeedSpin:   # a GPU whose nanosleep(1000) sleeps only 0.5 µs (PTX allows anything in [0, 2 µs])
        def __getitem__(self, launch_config):
            return lambda n: clock.advance(int(n) * 0.5e-3)

    with pretend_gpu(clock):
        n = bench._spin_length(HalfSpeedSpin(), host_s=1e-3)
    # target 2 x 1 ms + 0.2 ms = 2.2 ms; 2200 sleeps give 1.1 ms, too short, so x max(2, 1.5 x 2.2 / 1.1) = 3:
    # 6600 sleeps = 3.3 ms >= 2.2 ms
    assert n == 6600


def test_timed_calls_queue_behind_a_spin_kernel(monkeypatch):
    order = []
    real_event = PretendEvent.record
    monkeypatch.setattr(PretendEvent, "record", lambda self, stream=0: (order.append("event"), real_event(self)))
    spin = bench.make_spin()
    monkeypatch.setattr(bench, "make_spin", lambda: _Recording(spin, order))
    monkeypatch.setattr(bench, "_spin_length", lambda spin, host_s: 200)   # calibration is tested above
    with pretend_gpu():
        bench.time_call(lambda: order.append("fn"), repeats=2, warmup=1)
    # warm-up call, then each timed call: the spin kernel first, so the start event waits behind it
    assert order == ["fn"] + ["spin", "event", "fn", "event"] * 2


class _Recording:
    def __init__(self, kernel, order):
        self.kernel, self.order = kernel, order

    def __getitem__(self, config):
        launch = self.kernel[config]
        return lambda *args: (self.order.append("spin"), launch(*args))


def test_device_info_and_provenance_say_rehearsal():
    with pretend_gpu():
        info = bench.device_info()
        prov = bench.provenance(info=info)
    assert info["sm_count"] == 132 and info["cc"] == "9.0" and info["clock_mhz"] == pytest.approx(1980)
    assert info["hbm_bandwidth_gbs"] == pytest.approx(2 * 3.201e9 * 6144 / 8 / 1e9)
    assert prov["mode"] == "rehearsal" and prov["gpu_name"] == rehearsal.DEVICE_NAME
    assert info["driver_version"] == info["cuda_driver_api"] == "rehearsal"   # bench asks rehearsal.active()


def test_device_info_survives_a_missing_attribute(monkeypatch):
    class NoClock(PretendDevice):
        def __getattribute__(self, name):
            if name == "CLOCK_RATE":
                raise AttributeError(name)  # as a CUDA that retired the attribute would
            return super().__getattribute__(name)

    with pretend_gpu():
        monkeypatch.setattr(numba.cuda, "get_current_device", NoClock)
        info = bench.device_info()
        t = bench.time_call(lambda: None, repeats=2, warmup=0, flops=1e6, info=info)
    assert info["sm_count"] == 132 and info["fp32_peak_tflops"] != info["fp32_peak_tflops"]  # NaN
    assert t.pct_fp32_peak is None and t.tflops is not None


def test_measure_impls_rehearsal():
    with pretend_gpu():
        rows = bench.measure_impls(["fa2", "naive"], BH=1, N=16, d=16, directions=("fwd", "bwd"), repeats=2,
                                   warmup=1)
    assert [(r["impl"], r["direction"]) for r in rows] == [("fa2", "fwd"), ("fa2", "bwd"), ("naive", "fwd"),
                                                           ("naive", "bwd")]
    assert all(r["mode"] == "rehearsal" and r["median_ms"] > 0 and r["tflops"] > 0 for r in rows)
    with pytest.raises(ValueError, match="directions"):
        with pretend_gpu():
            bench.measure_impls("fa2", BH=1, N=16, d=16, directions=("up",))


# CI budget: `slow` -- run `pytest -m slow tests/instruments/test_rehearsal.py` before a GPU session (CONTRIBUTING)
@pytest.mark.slow
def test_softmax_and_block_sparse_measurements_rehearsal():
    with pretend_gpu():
        from flashnb.instruments.measure import block_sparse, softmax

        sm = softmax.measure_gpu(rows=2, n=64, threads=32, repeats=2)
        bsr = block_sparse.measure_gpu(BH=1, N=64, d=16, densities=(1.0, 0.5), repeats=1)
    assert [r["method"] for r in sm] == ["unsafe", "safe", "online"]
    # the modelled bytes come from model_softmax: 3, 4, 3 accesses per element of a 2 x 64 matrix
    assert [r["model_bytes"] for r in sm] == [4 * 3 * 128, 4 * 4 * 128, 4 * 3 * 128]
    assert [r["density"] for r in bsr] == [1.0, 0.5] and all(r["mode"] == "rehearsal" for r in sm + bsr)
    assert bsr[1]["flops"] == pytest.approx(bsr[0]["flops"] / 2)


def test_on_gpu_without_a_gpu_measures_nothing(capsys):
    assert bench.gpu_available() is False
    assert bench.on_gpu("flashnb.instruments.bench:measure_impls", impls=["fa2"]) is None
    assert "nothing is measured" in capsys.readouterr().out
    with pytest.raises(ValueError, match="target"):
        bench.on_gpu("os:system", command="true")


def test_gpu_child_process_rehearsal():
    env = dict(os.environ, FLASHNB_DEVICE="sim", NUMBA_ENABLE_CUDASIM="1", **{rehearsal.ENV: "1"})
    rows = bench._run_child("flashnb.instruments.bench:measure_impls",
                            dict(impls=["fa2"], BH=1, N=16, d=16, repeats=1, warmup=0), env, timeout=300)
    assert len(rows) == 1 and rows[0]["mode"] == "rehearsal" and rows[0]["gpu_name"] == rehearsal.DEVICE_NAME
    env.pop(rehearsal.ENV)
    with pytest.raises(RuntimeError, match="no GPU"):
        bench._run_child("flashnb.instruments.bench:measure_impls", dict(impls=["fa2"]), env, timeout=300)


def test_softmax_rows_come_back_from_the_child_process():
    env = dict(os.environ, FLASHNB_DEVICE="sim", NUMBA_ENABLE_CUDASIM="1", **{rehearsal.ENV: "1"})
    rows = bench._run_child("flashnb.instruments.measure.softmax:measure_gpu",
                            dict(rows=2, n=32, threads=32, repeats=1, warmup=1), env, timeout=300)
    assert [r["method"] for r in rows] == ["unsafe", "safe", "online"] and all(r["gb_per_s"] > 0 for r in rows)


def test_sweep_skips_a_job_projected_past_the_deadline(tmp_path):
    import time

    with pretend_gpu():
        rows = bench.sweep(["onepass"], Ns=(16,), ds=(16,), causal=(False,), B=1, H=1, repeats=10_000, warmup=2,
                           out_dir=tmp_path, figures_dir=None, progress=False, deadline=time.monotonic() + 30)
    assert rows[0]["error"].startswith("skipped: would take") and rows[0].get("median_ms") is None


# CI budget: `slow` -- run `pytest -m slow tests/instruments/test_rehearsal.py` before a GPU session (CONTRIBUTING)
@pytest.mark.slow
def test_sweep_rehearsal(tmp_path):
    with pretend_gpu():
        rows = bench.sweep(["fa2", "onepass"], Ns=(16,), ds=(16,), causal=(True,), B=1, H=1, repeats=1, warmup=0,
                           out_dir=tmp_path, figures_dir=tmp_path, progress=False)
    assert [(r["impl"], r["direction"]) for r in rows] == [("fa2", "fwd"), ("fa2", "bwd"), ("onepass", "fwd")]
    assert all(not r.get("error") and r["median_ms"] > 0 and r["mode"] == "rehearsal" for r in rows)
    with open(tmp_path / "bench.csv") as f:
        got = list(csv.DictReader(f))
    assert all(g["gpu_name"] == rehearsal.DEVICE_NAME and g["mode"] == "rehearsal" for g in got)
    assert (tmp_path / "bench.png").stat().st_size > 0


# CI budget: `slow` -- run `pytest -m slow tests/instruments/test_rehearsal.py` before a GPU session (CONTRIBUTING)
@pytest.mark.slow
def test_tour_measured_column_rehearsal(capsys, monkeypatch):
    from flashnb import cli, registry

    # two impls (one without a backward) keep this short; the GPU branch is the same for every impl
    monkeypatch.setattr(registry, "IMPLS", {n: registry.IMPLS[n] for n in ("onepass", "fa2")})
    with pretend_gpu():
        assert cli.main(["tour", "--bh", "1", "--nq", "8", "--nk", "8", "--d", "8", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "measured us" in out and "HBM read B" not in out and rehearsal.DEVICE_NAME in out
    assert [ln.split()[1] for ln in out.splitlines() if ln.split()[:1] in (["2"], ["4"])] == ["onepass", "fa2", "fa2"]


FAKE_NCU = textwrap.dedent('''\
    #!{python}
    """Stands in for Nsight Compute: runs the profiled command (on the simulator) and prints ncu-style CSV."""
    import subprocess, sys
    args = sys.argv[1:]
    takes_value = {{"--metrics", "--target-processes", "--print-units", "--clock-control"}}
    i = 0
    while args[i].startswith("--"):
        assert args[i] in takes_value or args[i] == "--csv", args[i]
        i += 2 if args[i] in takes_value else 1
    proc = subprocess.run(args[i:])
    if proc.returncode:
        sys.exit(proc.returncode)
    print("==PROF== Disconnected")
    print('"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"')
    for kid in ("0", "1"):
        print(f'"{{kid}}","kernel_{{kid}}","dram__bytes_read.sum","byte","1,000"')
        print(f'"{{kid}}","kernel_{{kid}}","dram__bytes_write.sum","byte","500"')
        print(f'"{{kid}}","kernel_{{kid}}","gpu__time_duration.sum","nsecond","2000"')
''')


@pytest.mark.slow   # run with `pytest -m slow tests/instruments/test_rehearsal.py` before a GPU session (CONTRIBUTING)
def test_gpu_check_rehearsal(tmp_path, monkeypatch):
    spec_path = ROOT / "scripts" / "gpu_check.py"
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_rehearsal", spec_path)
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ncu = bindir / "ncu"
    ncu.write_text(FAKE_NCU.format(python=sys.executable))
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FLASHNB_DEVICE", "sim")   # the profiled child runs on the simulator too
    out = tmp_path / "out"
    with pretend_gpu():
        status = gc.main(["--out", str(out), "--impl", "fa2", "--impl", "fa2-sparse", "--B", "1", "--H", "1",
                          "--N", "32", "--d", "16", "--bench-N", "16", "--bench-d", "16", "--repeats", "1",
                          "--measure-n", "32", "--tc-N", "32"])
    assert status == 0
    with open(out / "correctness.csv") as f:
        correct = list(csv.DictReader(f))
    intrinsics = [r for r in correct if r["impl"] == "intrinsics"]   # step 0, here on the twins themselves
    assert len(intrinsics) == 15 and all(r["ok"] == "True" for r in intrinsics)
    correct = [r for r in correct if r["impl"] != "intrinsics"]
    # fa2-sparse (local attention, 16 x 16 blocks, window 1: not dense at N = 32) is checked against its own mask
    assert [(r["impl"], r["causal"], r["ok"]) for r in correct] == [
        ("fa2", "False", "True"), ("fa2-sparse", "False", "True"), ("fa2", "True", "True"),
        ("fa2-sparse", "True", "True")]
    assert all(r["mode"] == "rehearsal" for r in correct)
    with open(out / "bench.csv") as f:
        assert all(r["median_ms"] and r["mode"] == "rehearsal" for r in csv.DictReader(f))
    with open(out / "dram.csv") as f:
        dram = list(csv.DictReader(f))
    totals = [r for r in dram if r["launch"] == "total"]
    assert [r["impl"] for r in totals] == ["fa2", "fa2-sparse"]
    for r in totals:   # two stand-in launches of 1000 + 500 bytes each, beside the model of the same call
        assert float(r["dram_bytes_total"]) == 3000.0
        model = bench.modelled_bytes(r["impl"], 1, 8, 32, 16, False, "fwd")
        assert float(r["modelled_bytes"]) == model and float(r["measured_over_modelled"]) == pytest.approx(3000 / model)
    with open(out / "measurements.csv") as f:
        tc = [r for r in csv.DictReader(f) if r["measurement"] == "tensor cores" and r["impl"] != "torch sdpa"]
    want = {(i, dr, d) for i in ("fa2-tc", "fa2-fast") for dr in ("forward", "backward") for d in ("64", "128")}
    assert {(r["impl"], r["direction"], r["d"]) for r in tc} == want
    assert all(r["tflops"] and r["mode"] == "rehearsal" for r in tc)
    assert (out / "ncu_log.txt").exists() and (out / "device.json").exists()
    assert len(list(out.iterdir())) <= 8     # the device tool brings back at most 8 files
