"""`flashnb tour` runs every registered impl and reports counted traffic; `flashnb info` is in test_runtime."""

import os
import subprocess
import sys

from flashnb import cli, naive
from flashnb.registry import IMPLS


def test_tour_rows_cover_every_impl_and_agree_with_reference():
    rows = cli.tour_rows(BH=1, Nq=9, Nk=12, d=4, causal=True, progress=False)
    forward = {r["impl"] for r in rows if r["pass"] == "forward"}
    backward = {r["impl"] for r in rows if r["pass"] == "backward"}
    assert forward == set(IMPLS)
    assert backward == {n for n, e in IMPLS.items() if e.backward}
    for r in rows:
        # float32 vs float64 on 12 keys: ~1e-7 expected; TF32 (fa2-tc's float32 path): ~1e-3 (tests/test_fa2_tc.py)
        assert r["max_abs_err"] < (5e-3 if IMPLS[r["impl"]].precision == "tf32" else 1e-5), r
        assert r["modelled_ns"] > 0
    # the naive forward's counted bytes are exactly its model's
    naive_fwd = next(r for r in rows if r["impl"] == "naive" and r["pass"] == "forward")
    model = naive.model_forward(1, 9, 12, 4)
    assert naive_fwd["read_bytes"] == 4 * sum(sum(m["reads"].values()) for m in model)
    assert naive_fwd["write_bytes"] == 4 * sum(sum(m["writes"].values()) for m in model)


def test_tour_command_prints_the_table():
    r = subprocess.run([sys.executable, "-m", "flashnb.cli", "tour", "--bh", "1", "--nq", "5", "--nk", "7",
                        "--d", "3", "--quiet"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "FLASHNB_DEVICE": "sim"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all impls agree with the reference" in r.stdout
    for name in IMPLS:
        assert f" {name} " in r.stdout
    assert "modelled" in r.stdout and "not a measurement" in r.stdout
