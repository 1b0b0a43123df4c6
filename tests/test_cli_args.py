"""The command line: out-of-range values are argparse errors (usage, one line, exit code 2, no traceback),
--version, help text for every option and no reST markup in --help, and `bench` writing files only where asked
on the simulator (saying where)."""

import argparse
import subprocess
import sys

import pytest

import flashnb
from flashnb import cli
from flashnb import instruments as fi
from flashnb.instruments import bench


@pytest.mark.parametrize("argv, message", [
    (["tour", "--nq", "0"], "argument --nq: must be an integer >= 1, got '0'"),
    (["tour", "--d", "200"], "argument --d: must be an integer in 1..128, got '200'"),
    (["tour", "--bh", "two"], "argument --bh: must be an integer, got 'two'"),
    (["bench", "--N", "-5"], "argument --N: must be an integer >= 1, got '-5'"),
    (["bench", "--d", "0"], "argument --d: must be an integer in 1..128, got '0'"),
    (["bench", "--gpu", "TPU"], "argument --gpu: invalid choice: 'TPU'"),
    (["bench", "--impl", "nope"], "argument --impl: invalid choice: 'nope'"),
    (["inspect", "--threads", "2048"], "argument --threads: must be an integer in 1..1024, got '2048'"),
])
def test_out_of_range_values_are_argparse_errors(argv, message, capsys):
    # Before: `tour --nq 0`, `tour --d 200` and `bench --N -5` printed a Python traceback.
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: flashnb ") and message in err and "Traceback" not in err


def test_out_of_range_in_a_real_process():
    r = subprocess.run([sys.executable, "-m", "flashnb.cli", "tour", "--d", "200"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--d: must be an integer in 1..128" in r.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"flashnb {flashnb.__version__}\n"


def _parsers():
    main = cli.build_parser()
    subs = next(a for a in main._actions if isinstance(a, argparse._SubParsersAction))
    yield "flashnb", main
    for name in ("info", "tour"):
        yield name, subs.choices[name]
    yield "bench", bench.bench_parser()
    yield "inspect", fi.inspect_parser()


def test_every_option_has_help_and_no_rest_markup():
    for name, parser in _parsers():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings}: no help"
        text = parser.format_help()
        for markup in ("``", ":func:", ":class:", ":data:", ":mod:"):
            assert markup not in text, f"{name} --help shows {markup!r}:\n{text}"


@pytest.mark.skipif(not flashnb.is_simulator(), reason="the simulator's defaults")
def test_bench_on_the_simulator_writes_only_where_asked(tmp_path, monkeypatch, capsys):
    # Before: results/bench.csv and figures/bench.png appeared in the current directory, unasked.
    monkeypatch.chdir(tmp_path)
    small = ["--impl", "naive", "--N", "64", "--d", "16", "--causal", "no", "--no-backward"]
    assert bench.main_bench(small) == 0
    out = capsys.readouterr()
    assert list(tmp_path.iterdir()) == []
    assert "--out DIR and --figures DIR save a CSV and a plot" in out.err
    assert "modelled" in out.out and "0.000 ms" not in out.out        # sub-millisecond times in µs
    assert bench.main_bench(small + ["--out", "mine"]) == 0
    out = capsys.readouterr()
    csv_path = (tmp_path / "mine" / "bench.csv").resolve()
    assert csv_path.exists() and not (tmp_path / "figures").exists()
    assert f"writing {csv_path}" in out.err and f"wrote {csv_path}" in out.out
