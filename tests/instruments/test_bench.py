"""Benchmarks never present simulator wall time as GPU speed; CSVs carry provenance; gpu_check's
pure-Python parts (argument parsing, CSV writer, ncu CSV parser, refusal on the simulator)."""

import csv
import importlib.util
from pathlib import Path

import pytest

import flashnb
from flashnb.instruments import bench

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_time_call_refuses_on_simulator():
    assert flashnb.is_simulator()
    with pytest.raises(bench.SimulatorTimingError, match="real GPU"):
        bench.time_call(lambda: None)


def test_device_fp32_peak_per_cc():
    assert bench.device_fp32_peak((8, 0), 108, 1410e6) == pytest.approx(19.5e12, rel=0.01)   # 64 lanes/SM
    assert bench.device_fp32_peak((9, 0), 132, 1980e6) == pytest.approx(66.9e12, rel=0.01)   # 128 lanes/SM
    with pytest.raises(ValueError, match="lanes"):
        bench.fp32_lanes_per_sm((6, 1))


def test_sweep_on_simulator_is_modelled_only(tmp_path):
    rows = bench.sweep("naive", Ns=(128,), ds=(64,), causal=(False, True), B=1, H=2, out_dir=tmp_path / "r",
                       figures_dir=tmp_path / "f", progress=False)
    assert len(rows) == 4  # fwd + bwd, causal on/off
    for r in rows:
        assert r["mode"] == "modelled" and r.get("median_ms") is None and r.get("tflops") is None
        assert r["modelled_ms"] > 0 and r["modelled_bound"] in ("compute", "memory")
    with open(tmp_path / "r" / "bench.csv") as f:
        got = list(csv.DictReader(f))
    assert set(bench.PROVENANCE_COLUMNS) <= set(got[0])
    assert all(g["mode"] == "modelled" and g["median_ms"] == "" and g["numba_cuda_version"] for g in got)
    assert all(g["flashnb_version"] == flashnb.__version__ and g["date"] for g in got)
    assert (tmp_path / "f" / "bench.png").stat().st_size > 0


def test_sweep_rejects_unknown_impl():
    with pytest.raises(ValueError, match="impls"):
        bench.sweep("nope", out_dir=None, figures_dir=None, progress=False)


def test_main_bench_on_simulator(tmp_path, capsys):
    assert bench.main_bench(["--impl", "naive", "--N", "64", "--d", "16", "--causal", "no", "--no-backward",
                             "--out", str(tmp_path), "--figures", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "MODELLED" in out.err and "modelled" in out.out
    assert (tmp_path / "bench.csv").exists()


def test_gpu_check_args(monkeypatch, tmp_path):
    gc = _gpu_check()
    monkeypatch.delenv("OUT", raising=False)
    a = gc.parse_args([])
    assert a.out == ROOT / "results" / "gpu" and a.bench_N == [1024, 2048, 4096] and a.N == 1024
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gc.parse_args(["--quick"]).out == tmp_path and gc.parse_args(["--quick"]).bench_N == [1024]
    with pytest.raises(SystemExit):
        gc.parse_args(["--N", "0"])


def test_gpu_check_csv_provenance(tmp_path):
    gc = _gpu_check()
    prov = bench.provenance()
    path = gc.write_rows(tmp_path / "c.csv", [dict(impl="naive", ok=True), dict(impl="fa2", ok=False, error="x")],
                         prov)
    with open(path) as f:
        got = list(csv.DictReader(f))
    assert [g["impl"] for g in got] == ["naive", "fa2"] and got[1]["error"] == "x" and got[0]["error"] == ""
    assert all(g[c] == str(prov[c]) for g in got for c in bench.PROVENANCE_COLUMNS)


def test_gpu_check_parses_ncu_csv():
    gc = _gpu_check()
    text = ('==PROF== Connected\n"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","1","python","h","matmul","1","7","(16, 16, 1)","(4, 4, 8)","0","9.0","Command line profiler",'
            '"dram__bytes_read.sum","Mbyte","1.50"\n'
            '"0","1","python","h","matmul","1","7","(16, 16, 1)","(4, 4, 8)","0","9.0","Command line profiler",'
            '"dram__bytes_write.sum","byte","2,048"\n')
    rows = gc.parse_ncu_csv(text)
    assert [(r["metric"], r["value"]) for r in rows] == [("dram__bytes_read.sum", 1.5e6),
                                                         ("dram__bytes_write.sum", 2048.0)]


def test_gpu_check_refuses_on_simulator(tmp_path, capsys):
    assert _gpu_check().main(["--out", str(tmp_path)]) == 2
    assert "simulator" in capsys.readouterr().err


def _counted_bytes(fn) -> float:
    from flashnb.instruments import traffic

    with traffic.count() as t:
        fn()
    return 4.0 * sum(sum(getattr(ln, k).values()) for ln in t.launches for k in ("reads", "writes", "atomics"))


@pytest.mark.parametrize("impl, direction", [("fa2-rows", "fwd"), ("fa2-rows", "bwd"), ("fa2-splitq", "bwd"),
                                             ("flash-decoding", "fwd")])
def test_sweep_models_every_step_and_decodes_one_query(impl, direction):
    """Before: fa2-rows / fa2-splitq rows said 'modelled -' (their models are named after their launchers, and the
    sweep looked only for model_forward), and flash-decoding ran with as many queries as keys.  Each row's modelled
    bytes now equal the bytes the traffic counter counts running that impl at the row's shape (N = 48 keys), and a
    decoding row has one query, its FLOPs those of one query, and a note saying so."""
    from flashnb.registry import IMPLS

    B, H, N, d = 1, 2, 48, 16
    (row,) = [r for r in bench.sweep(impl, Ns=(N,), ds=(d,), causal=(True,), B=B, H=H, out_dir=None,
                                     figures_dir=None, progress=False) if r["direction"] == direction]
    Nq = 1 if impl == "flash-decoding" else N
    assert row["Nq"] == Nq and row["modelled_ms"] > 0
    q, k, v, do = bench._inputs(B, H, N, d, seed=1, Nq=Nq)
    entry, scale = IMPLS[impl], d ** -0.5
    if direction == "fwd":
        counted = _counted_bytes(lambda: entry.forward(q, k, v, causal=True, scale=scale))
    else:
        o, lse = entry.forward(q, k, v, causal=True, scale=scale)
        counted = _counted_bytes(lambda: entry.backward(q, k, v, o, lse, do, causal=True, scale=scale))
    assert row["modelled_bytes"] == counted
    if impl == "flash-decoding":
        assert row["flops"] == 4 * B * H * 1 * N * d            # one query, every key (bottom-right causal)
        assert row["note"] == f"decoding: 1 new query against {N} cached keys"
    else:
        assert not row.get("note")


def test_bench_labels_sparse_rows_and_says_why_a_row_has_no_model(monkeypatch, capsys):
    """fa2-sparse (a window of one 16-key block) is labelled with the share of pairs it computes -- 16 of 128 keys
    per query, 12.5 % -- and a row without a modelled time says why instead of a bare '-'."""
    monkeypatch.setattr(bench, "_traffic_model", lambda entry, direction: None)
    assert bench.main_bench(["--impl", "fa2-sparse", "--impl", "fa2", "--N", "128", "--d", "16", "--causal", "no",
                             "--no-backward"]) == 0
    lines = capsys.readouterr().out.splitlines()
    sparse = next(ln for ln in lines if ln.lstrip().startswith("fa2-sparse"))
    dense = next(ln for ln in lines if ln.lstrip().startswith("fa2 "))
    assert "block-sparse, a sliding window: computes 12.5 % of the (query, key) pairs" in sparse
    assert dense.endswith("modelled -  (no modelled time: no traffic model for fa2's forward)"), dense
