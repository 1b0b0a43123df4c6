"""`flashnb tour` runs every registered impl and reports counted traffic; `flashnb info` is in test_runtime."""

import os
import subprocess
import sys

from flashnb import cli
from flashnb.registry import IMPLS
from flashnb.stages import naive


def test_tour_rows_cover_every_impl_and_agree_with_reference():
    rows = cli.tour_rows(BH=1, Nq=9, Nk=12, d=4, causal=True, progress=False)
    forward = {r["impl"] for r in rows if r["pass"] == "forward"}
    backward = {r["impl"] for r in rows if r["pass"] == "backward"}
    assert forward == set(IMPLS)
    assert backward == {n for n, e in IMPLS.items() if e.backward}
    for r in rows:
        # float32 vs float64 on 12 keys: ~1e-7 expected; TF32 (fa2-tc's float32 path): ~1e-3
        # (tests/kernels/test_flash_tc.py)
        assert r["max_abs_err"] < (5e-3 if IMPLS[r["impl"]].precision == "tf32" else 1e-5), r
        assert r["modelled_ns"] > 0
        assert r["tolerance"] == (1e-2 if IMPLS[r["impl"]].precision == "tf32" else 1e-3), r
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
    assert "every impl agrees with the reference within its tolerance" in r.stdout
    for name, entry in IMPLS.items():     # each row names its tolerance: TF32's for fa2-tc, FP32's for the rest
        tol = "1e-02 TF32" if entry.precision == "tf32" else "1e-03 FP32"
        assert any(f" {name} " in line and tol in line for line in r.stdout.splitlines()), (name, tol)
    for name in IMPLS:
        assert f" {name} " in r.stdout
    assert "modelled" in r.stdout and "not a measurement" in r.stdout


# --------------------------------------------------------------------------- flashnb sanitize SCRIPT, however it ends

_RACY = """import os, sys
import numpy as np
import flashnb
from numba import cuda, float32


@cuda.jit
def rotate(x, out):
    sh = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    sh[t] = x[t]
    {barrier}
    out[t] = sh[(t + 1) % 32]                   # without the barrier: reads a neighbour's write, unordered


rotate[1, 32](flashnb.common.to_device(np.arange(32.0)), flashnb.common.to_device(np.zeros(32)))
print("launched")
{ending}
"""


def _script(tmp_path, name, ending, racy=True):
    path = tmp_path / name
    path.write_text(_RACY.format(ending=ending, barrier="pass" if racy else "cuda.syncthreads()"))
    return str(path)


def _sanitize(*targets):
    return subprocess.run([sys.executable, "-m", "flashnb.cli", "sanitize", *targets, "--tool", "racecheck"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "FLASHNB_DEVICE": "sim"})


def test_sanitize_reports_a_race_however_the_script_ends(tmp_path):
    """Before: a script ending in sys.exit(...) left with exit status 0 and no report, and one that raised lost
    the report of its launches.  Each script here launches a racy kernel and ends another way; every report is
    printed, the exception's traceback too, and the status is 1 (errors found)."""
    endings = {"exit0.py": "sys.exit(0)", "systemexit.py": "raise SystemExit", "exit3.py": "sys.exit(3)",
               "raises.py": "raise RuntimeError('after the launch')", "ends.py": ""}
    r = _sanitize(*(_script(tmp_path, name, ending) for name, ending in endings.items()))
    assert r.returncode == 1, r.stdout + r.stderr
    for name in endings:
        assert f"{name}: 32 error(s) in 1 place(s), 1 launch(es) (racecheck)" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("launched") == 5 and "RuntimeError: after the launch" in r.stderr
    assert "exit3.py: the script exited with status 3" in r.stderr


def test_sanitize_keeps_a_clean_scripts_own_status_and_traps_os_exit(tmp_path):
    """The script's own nonzero status is not lost (a race-free script that ends in sys.exit(3) gives 3, one that
    raises gives 1 as Python does); os._exit(0) after a racy launch still prints the report and exits 1."""
    r = _sanitize(_script(tmp_path, "clean.py", "", racy=False), _script(tmp_path, "three.py", "sys.exit(3)", False))
    assert r.returncode == 3 and "clean.py: no errors in 1 launch(es)" in r.stdout, r.stdout + r.stderr
    r = _sanitize(_script(tmp_path, "hard.py", "os._exit(0)"), _script(tmp_path, "never.py", ""))
    assert r.returncode == 1 and "hard.py: 32 error(s)" in r.stdout and "never.py" not in r.stdout, r.stdout + r.stderr


_OWN_CHECKER = """import numpy as np
import flashnb
from flashnb import common
from numba import cuda


@cuda.jit
def copy(src, dst):
    i = cuda.grid(1)
    if i < dst.size:
        dst[i] = src[i]


@cuda.jit
def shift(x):
    i = cuda.grid(1)
    x[i + 1] = x[i]                             # the last thread writes one past the end


a = common.to_device(np.random.default_rng(3).standard_normal(64).astype(np.float32))
mid = common.empty(64)                          # poisoned: the outer initcheck tracks it
with flashnb.sim.profile() as prof:             # the script's own checker, around the launch that writes mid
    copy[2, 32](a, mid)
print("own profile:", len(prof.traffic.launches), "launch(es)")
out = common.empty(64)
copy[2, 32](mid, out)                           # reads mid, which the profiled launch wrote
assert np.array_equal(out.copy_to_host(), a.copy_to_host())
shift[1, 32](common.to_device(np.zeros(32, np.float32)))
"""


def test_sanitize_a_script_that_starts_its_own_checker(tmp_path):
    """Before: a script running a checker of its own (docs/simulator.md's example does) died under `flashnb
    sanitize` with "already active" and exit 1.  Its checker now works as under `python script.py`, the report
    says the launches in its block were left to it, and the sanitizer keeps watching the rest: the out-of-bounds
    launch after it is found (exit 1), and reading what the profiled launch wrote is not an initcheck finding."""
    path = tmp_path / "own.py"
    path.write_text(_OWN_CHECKER)
    r = subprocess.run([sys.executable, "-m", "flashnb.cli", "sanitize", str(path)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "FLASHNB_DEVICE": "sim"})
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "already active" not in out, out
    assert "own profile: 1 launch(es)" in r.stdout, out
    assert "own.py: 1 error(s) in 1 place(s), 2 launch(es) (memcheck, racecheck, initcheck, synccheck)" in r.stdout, out
    assert "memcheck" in r.stdout.split("own.py: 1 error(s)")[1] and "initcheck:" not in r.stdout, out
    assert ("own.py: 1 launch(es) ran inside the script's own flashnb.sim.profile() block: that checker watched them"
            in r.stdout), out


def test_sanitize_a_missing_file_says_so(tmp_path, capsys):
    assert cli.main(["sanitize", str(tmp_path / "missing.py")]) == 2
    assert f"no such file: {str(tmp_path / 'missing.py')!r}" in capsys.readouterr().err
    assert cli.main(["sanitize", "fa9"]) == 2
    assert "'fa9' is neither an impl" in capsys.readouterr().err
