"""GPU/simulator selection happens before numba.cuda is imported; each case runs in a fresh interpreter."""

import os
import subprocess
import sys

import pytest


def run(code, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("FLASHNB_DEVICE", "NUMBA_ENABLE_CUDASIM")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_auto_detect_without_driver_is_simulator():
    from flashnb.runtime import driver_device_count

    if driver_device_count() > 0:
        pytest.skip("this machine has a GPU")
    r = run("import flashnb, numba.cuda.core.config as c; print(flashnb.MODE, c.ENABLE_CUDASIM)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["sim", "1"]


def test_forced_modes():
    r = run("import flashnb; print(flashnb.MODE)", FLASHNB_DEVICE="sim")
    assert r.stdout.strip() == "sim", r.stderr
    # GPU mode imports without a driver (kernels can be compiled to PTX, not launched)
    r = run("import flashnb, numba.cuda.core.config as c; print(flashnb.MODE, c.ENABLE_CUDASIM)", FLASHNB_DEVICE="GPU")
    assert r.stdout.split() == ["gpu", "0"], r.stderr


def test_invalid_value_is_a_clear_error():
    r = run("import flashnb", FLASHNB_DEVICE="tpu")
    assert r.returncode != 0 and "FLASHNB_DEVICE must be 'gpu' or 'sim'" in r.stderr


def test_numba_cuda_already_imported_in_other_mode():
    r = run("import numba.cuda; import flashnb", NUMBA_ENABLE_CUDASIM="1", FLASHNB_DEVICE="gpu")
    assert r.returncode != 0
    assert "already imported in simulator mode" in r.stderr


def test_numba_cuda_imported_first_without_gpu_stops_at_import():
    # `from numba import cuda` first (the usual first line of a kernel notebook) loads numba.cuda in GPU mode;
    # without a GPU every launch would fail later with a driver traceback, so import flashnb stops with one sentence.
    from flashnb.runtime import driver_device_count

    if driver_device_count() > 0:
        pytest.skip("this machine has a GPU")
    r = run("from numba import cuda\nimport flashnb")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("flashnb.runtime.RuntimeModeError: numba.cuda was imported before flashnb, in GPU mode")
    assert "put `import flashnb` before `from numba import cuda`" in last
    assert "driver" not in r.stderr.lower().replace("cuda driver", "")


def test_numba_imported_first_without_numba_cuda_just_works():
    # `from numba import float32` loads numba's config (ENABLE_CUDASIM=0) but not numba.cuda: flashnb reloads the
    # config, and a launch runs on the simulator instead of failing with "CUDA driver library cannot be found".
    from flashnb.runtime import driver_device_count

    if driver_device_count() > 0:
        pytest.skip("this machine has a GPU")
    code = (
        "from numba import float32\n"
        "import numpy as np, flashnb\n"
        "from numba import cuda\n"
        "@cuda.jit\n"
        "def twice(x):\n"
        "    i = cuda.grid(1)\n"
        "    if i < x.size:\n"
        "        x[i] = float32(2) * x[i]\n"
        "a = np.ones(4, np.float32)\n"
        "twice[1, 4](a)\n"
        "print(flashnb.MODE, a.tolist())\n"
    )
    r = run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["sim", "[2.0,", "2.0,", "2.0,", "2.0]"]
    assert "Warning" not in r.stderr, r.stderr


def test_numba_cuda_already_imported_same_mode_is_fine():
    r = run("import numba.cuda; import flashnb; print(flashnb.MODE)", NUMBA_ENABLE_CUDASIM="1")
    assert r.returncode == 0 and r.stdout.strip() == "sim", r.stderr


def test_cli_info():
    r = subprocess.run([sys.executable, "-m", "flashnb.cli", "info"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "FLASHNB_DEVICE": "sim"})
    assert r.returncode == 0, r.stderr
    assert "mode: sim" in r.stdout and "simulator" in r.stdout and "numba-cuda: 0.30.4" in r.stdout


def test_sim_submodules_reachable_after_import_flashnb():
    # The README writes `flashnb.sim.racecheck.check()` after a bare `import flashnb` (was AttributeError).
    r = run("import flashnb\nprint(callable(flashnb.sim.racecheck.check), flashnb.sim.selftest.__name__)\n"
            "try:\n    flashnb.sim.nothing\nexcept AttributeError as e:\n    print(e)", FLASHNB_DEVICE="sim")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["True flashnb.sim.selftest", "module 'flashnb.sim' has no attribute 'nothing'"]
