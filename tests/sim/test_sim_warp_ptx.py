"""The kernels of test_sim_warp.py also compile for a real GPU (PTX for sm_80, no driver needed).

``cuda.compile_ptx`` is None in simulator mode, so the compile runs in a fresh interpreter with
FLASHNB_DEVICE=gpu.  This guards the simulator's warp intrinsics against accepting code (argument types,
signatures) that numba would reject on a GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

KERNELS = {
    "warp_sums": "void(float32[::1], float32[::1], float32[::1])",
    "broadcast": "void(int32[::1], int32[:, ::1])",
    "inclusive_scan": "void(int32[::1], int32[::1])",
    "votes": "void(int32[::1], int64[:, ::1])",
    "half_masks": "void(float32[::1], float32[:, ::1])",
    "partial_warp": "void(int64[::1], int64[:, ::1])",
    "two_d": "void(int32[:, ::1], int64[:, :, ::1])",
    "syncwarp_exchange": "void(int64[:, ::1])",
}

CODE = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import flashnb
assert flashnb.MODE == "gpu" and not flashnb.sim.is_installed()
from numba import cuda
import test_sim_warp as m
for name, sig in {KERNELS!r}.items():
    ptx, _ = cuda.compile_ptx(getattr(m, name).py_func, sig, cc=(8, 0))
    assert ".f64" not in ptx, name  # no silent float64 promotion either
    print(name, "shfl.sync" in ptx, "vote.sync" in ptx, "bar.warp.sync" in ptx, "match" in ptx)
"""


def test_warp_kernels_compile_to_ptx():
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM",)}
    env["FLASHNB_DEVICE"] = "gpu"
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert set(lines) == set(KERNELS)
    assert lines["warp_sums"].split()[0] == "True"  # shfl.sync
    assert lines["votes"].split()[1] == "True"  # vote.sync
    assert lines["syncwarp_exchange"].split()[2:] == ["True", "True"]  # bar.warp.sync, match.*.sync
