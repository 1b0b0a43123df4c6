"""flashnb.instruments on kernels written outside flashnb: in a script (``__main__``), in a notebook cell (source in
``linecache``, as IPython registers it), in a factory's closure, and registered with ``registry.kernel_factory``
from user code.  In simulator mode the compile runs in a child process that never re-runs the user's code."""

import linecache
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import cuda, float32  # module level: the simulator swaps a kernel's global `cuda`, not a closure's

import flashnb
from flashnb import instruments as fi
from flashnb.instruments import compiled
from flashnb.registry import KERNELS

SIG = "void(float32[::1], float32[::1])"

SCRIPT = '''
import math, sys
import numpy as np
import flashnb
from numba import cuda, float32
from flashnb import registry

with open(sys.argv[1], "a") as f:          # counts how often this script's body runs
    f.write("ran\\n")

ALPHA = 3

@cuda.jit(device=True)
def twice(x):
    return float32(2) * x

@cuda.jit
def scale(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = twice(x[i]) * float32(ALPHA) + float32(math.sqrt(float32(2)))

@registry.kernel_factory("user.scale", stage="user", signature="void(float32[::1], float32[::1])",
                         configs=[dict(a=2)], threads=64)
def make_scale(a):
    @cuda.jit
    def scale_a(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = x[i] * float32(a)
    return scale_a

x = np.arange(8, dtype=np.float32)
y = np.zeros_like(x)
scale[1, 8](x, y)                          # the user ran the kernel on the simulator first
r = flashnb.instruments.resources(scale, (x, y))
print("main", r.registers, r.error, ".entry" in r.ptx)
r = flashnb.instruments.resources(make_scale(2), "void(float32[::1], float32[::1])")
print("registered", r.registers, r.error, r.threads)
rows = flashnb.instruments.report(ccs=[(8, 0)], names=["user.scale"])
print("report", rows[0]["regs"], rows[0]["occupancy"], rows[0]["problems"])
'''


def test_kernel_in_a_script_and_user_registered_factory(tmp_path):
    # Before: the child process re-ran the script (its kernel launch then failed: "CUDA driver library cannot
    # be found", returned inside the result) and the registered factory gave KeyError: 'user.scale'.
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    runs = tmp_path / "runs.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHNB_DEVICE", "NUMBA_ENABLE_CUDASIM")}
    env["FLASHNB_DEVICE"] = "sim"
    r = subprocess.run([sys.executable, str(script), str(runs)], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert runs.read_text() == "ran\n", "the user's script ran more than once"
    out = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()}
    regs, error, has_entry = out["main"]
    assert int(regs) > 0 and error == "None" and has_entry == "True"
    regs, error, threads = out["registered"]
    assert int(regs) > 0 and error == "None" and threads == "64"
    regs, occ, problems = out["report"]
    assert int(regs) > 0 and float(occ) > 0 and problems == "[]"


def test_example_arguments_give_a_signature():
    # Before: "void(array(float32, 1d, C), ...)", which numba cannot parse (SyntaxError in the result).
    x = np.zeros((4, 3), np.float32)
    assert compiled._signature_from_args((x, x[:, :2], np.asfortranarray(x), np.float32(1), 2)) == \
        "void(float32[:, ::1], float32[:, :], float32[::1, :], float32, int64)"


def _notebook_cell(source: str, cell: int) -> dict:
    """Run ``source`` as IPython runs a cell: registered in linecache under a cell file name, exec'd in __main__-like
    globals."""
    filename = f"<ipython-input-{cell}-0123456789ab>"
    source = textwrap.dedent(source)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


CELL = """
from numba import cuda, float32
BLOCK = {block}

@cuda.jit
def cell_kernel(x, y):
    tile = cuda.shared.array(BLOCK, float32)
    i = cuda.grid(1)
    if i < x.size:
        tile[cuda.threadIdx.x] = x[i]
    cuda.syncthreads()
    if i < x.size:
        y[i] = tile[cuda.threadIdx.x] * float32(2)
"""


def test_kernel_in_a_notebook_cell():
    ns = _notebook_cell(CELL.format(block=64), cell=1)
    res = fi.resources(ns["cell_kernel"], SIG, (9, 0))
    assert res.error is None and res.registers > 0 and res.shared_bytes == 64 * 4
    assert res.occupancy(64).blocks_per_sm > 0
    assert ".entry" in res.ptx and ".f64" not in res.ptx
    # the cell edited and re-run (same kernel name, other constant) is a new kernel, not a cached answer
    ns2 = _notebook_cell(CELL.format(block=128), cell=2)
    assert fi.resources(ns2["cell_kernel"], SIG, (9, 0)).shared_bytes == 128 * 4


def test_kernel_made_in_a_local_factory():
    # Before: "only registered or module-level kernels can be compiled" (TypeError) for closures.
    def make(factor, T):
        @cuda.jit(device=True)
        def mul(a):
            return a * float32(factor)

        @cuda.jit
        def local_kernel(x, y):
            tile = cuda.shared.array(T, float32)
            i = cuda.grid(1)
            tile[cuda.threadIdx.x] = x[i]
            cuda.syncthreads()
            y[i] = mul(tile[cuda.threadIdx.x])

        return local_kernel

    res = fi.resources(make(3, 32), SIG, (8, 0))
    assert res.error is None and res.registers > 0 and res.shared_bytes == 32 * 4


def test_unsendable_kernels_are_a_clear_error():
    ns = _notebook_cell("""
        from numba import cuda, float32
        class Settings:
            factor = 2
        settings = Settings()

        @cuda.jit
        def uses_object(x, y):
            y[0] = x[0] * float32(settings.factor)
        """, cell=3)
    with pytest.raises(TypeError, match="'settings' \\(Settings\\) cannot be sent"):
        fi.resources(ns["uses_object"], SIG)
    namespace = {"__name__": "__main__"}
    exec(compile("from numba import cuda\n@cuda.jit\ndef nosource(x, y):\n    y[0] = x[0]\n", "<nowhere>", "exec"),
         namespace)
    with pytest.raises(TypeError, match="source is not available"):
        fi.resources(namespace["nosource"], SIG)


@pytest.mark.skipif(not flashnb.is_simulator(), reason="the child-process path exists only on the simulator")
def test_user_registered_kernel_by_name():
    from flashnb import registry

    @registry.kernel_factory("user.test_add", stage="user", signature=SIG, configs=[dict(b=1)])
    def make_add(b):
        @cuda.jit
        def add_b(x, y):
            i = cuda.grid(1)
            if i < x.size:
                y[i] = x[i] + float32(b)
        return add_b

    try:
        res = fi.resources_for("user.test_add", dict(b=1), (9, 0))
        assert res.error is None and res.registers > 0
        # a user kernel run on the simulator compiles from the same source
        x = np.arange(4, dtype=np.float32)
        y = np.zeros_like(x)
        make_add(1)[1, 4](x, y)
        assert y.tolist() == [1, 2, 3, 4]
    finally:
        KERNELS.pop("user.test_add", None)
