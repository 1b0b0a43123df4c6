"""The PTX guard: every registered kernel compiles for real GPUs (sm_75, sm_80, sm_90) with no GPU present.

The simulator hides float64 promotion, oversized shared memory and register spills; compiling with NVVM
(``numba.cuda.compile_ptx``) and assembling with ``ptxas -v`` does not.  The simulator process cannot
compile (``compile_ptx`` is None there), so :mod:`flashnb.instruments` compiles in child processes started
with ``FLASHNB_DEVICE=gpu`` and hands back JSON.  Every (kernel, config) gets one NVVM pass, for sm_80;
ptxas assembles that PTX for sm_80 and, retargeted, for sm_90 (NVVM's sm_90 PTX is the same but for the
``.target`` line and symbol names: checked on a sample below).

**Recorded results.**  Compiling every registered (kernel, config) costs minutes of NVVM, and the answer
depends only on the kernels' source and the toolchain.  ``tests/instruments/ptx_guard_results.json`` holds every case's
ptxas report together with the key it was computed under: the digest of every source file of the flashnb
package that kernels can depend on (:func:`flashnb.instruments.package_digest`: all but
:data:`flashnb.instruments.HOST_ONLY`, the simulator, course kit, front ends and host tools) and the toolchain's
versions (:func:`flashnb.instruments.toolchain_versions`).  When both match, the guard checks the recorded reports
and re-compiles a sample of :data:`SPOT_CHECKS` (kernel, config) pairs -- a different sample for every package
digest -- which must reproduce their records exactly.  Any change to a source file kernels can depend on, or
another toolchain, changes the key: then every case is compiled, as if there were no record (a changed kernel
can never pass on an old record).  Refresh the record after changing kernels: ``FLASHNB_GUARD_RECORD=1 python
-m pytest tests/instruments/test_ptx_guard.py`` (compiles everything afresh and rewrites the file).  NVVM's PTX is also
cached on disk (:func:`flashnb.instruments.ptx_cache_dir`), so a second run on one machine skips NVVM; ptxas runs
on every compile.

Also checked: no ``@cuda.jit`` kernel in ``flashnb/`` escapes the registry (AST scan), and the guard does
fail on kernels that are deliberately wrong (a float64 literal, 64 KiB of static shared memory).  A kernel that
takes dynamic shared memory declares its bytes per config (``kernel_factory(dynamic_shared=...)``); the guard
checks static + dynamic against the opt-in limits of sm_80 and sm_90 (``inspect.MAX_OPTIN_SHARED``).  A kernel built
on tensor-core instructions declares the architectures it compiles for (``kernel_factory(archs=...)``): each of its
configs is compiled for those, and asking for another is a ValueError naming the architecture.
"""

from __future__ import annotations  # noqa: I001  (flashnb must be imported before numba.cuda)

import ast
import warnings
from pathlib import Path

import pytest

import flashnb  # noqa: F401  (selects the simulator before numba.cuda is imported)
from flashnb import instruments as fi
from flashnb.instruments import jobs as fjobs
from flashnb.instruments import ptx_cache
from flashnb.registry import KERNELS
from numba import cuda, float32

CCS = [(7, 5), (8, 0), (9, 0)]   # T4 (Colab's free GPU), A100, H100/H200
PACKAGE = Path(flashnb.__file__).resolve().parent
# Packages whose kernels are simulator self-checks, never launched on a GPU (not registered; guarded below).
SIMULATOR_ONLY = ("flashnb.sim",)
# Exercise solutions (and their typical wrong answers) are guarded by signature in tests/exercises/test_exercises.py.
EXERCISES = ("flashnb.exercises",)

CASES = [(name, config) for name, spec in KERNELS.items() for config in spec.configs]
# every case on every architecture it declares (a tensor-core kernel: kernel_factory(archs=...); the rest: all)
JOBS = [(name, config, cc) for name, config in CASES for cc in CCS if KERNELS[name].supports(config, cc)]


def _id(case):
    name, config = case
    return name + "[" + ",".join(f"{k}={v}" for k, v in config.items()) + "]"


RECORD = Path(__file__).resolve().parent / "ptx_guard_results.json"
SPOT_CHECKS = 3     # (kernel, config) pairs re-compiled on every run that uses the record


def _record_key() -> dict:
    return {"package_digest": fi.package_digest(), "toolchain": fi.toolchain_versions()}


def _load_record() -> dict | None:
    """The recorded reports ``{case key: Resources}`` if they were computed for exactly this source and
    toolchain, else None."""
    import json
    import os

    if os.environ.get("FLASHNB_GUARD_RECORD") or not RECORD.exists():
        return None
    data = json.loads(RECORD.read_text())
    if data.get("key") != _record_key():
        return None
    return {(n, fjobs._key(n, c, cc)): fi.Resources.from_json(r)
            for n, c, cc, r in ((e["name"], e["config"], tuple(e["cc"]), e["resources"]) for e in data["results"])}


def _spot_sample(cases: list) -> list:
    """:data:`SPOT_CHECKS` cases picked by the package digest (so every change of the source picks others)."""
    import hashlib

    order = sorted(cases, key=lambda case: hashlib.sha256((fi.package_digest() + _id(case)).encode()).hexdigest())
    return order[:SPOT_CHECKS]


def _same_report(a, b) -> bool:
    fields = ("registers", "shared_bytes", "dynamic_shared_bytes", "stack_bytes", "spill_store_bytes",
              "spill_load_bytes", "f64_count", "threads", "error")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


@pytest.fixture(scope="module")
def compiled():
    """Every (kernel, config, cc): from the record when it matches this source and toolchain (with a sample
    re-compiled and compared), else compiled (NVVM once per kernel and config, ptxas per cc)."""
    import json
    import os

    jobs = JOBS
    record = _load_record()
    if record is not None and all((n, fjobs._key(n, c, cc)) in record for n, c, cc in jobs):
        spot = [(n, c, cc) for n, c in _spot_sample(CASES) for cc in CCS if KERNELS[n].supports(c, cc)]
        for (n, c, cc), fresh in zip(spot, fi.resources_many(spot)):
            kept = record[(n, fjobs._key(n, c, cc))]
            assert _same_report(fresh, kept), (
                f"{n} {c} sm_{cc[0]}{cc[1]}: compiled now {fresh}, recorded {kept}: the record in {RECORD.name} is "
                "not what this source and toolchain compile to; refresh it (FLASHNB_GUARD_RECORD=1)")
        return {k: record[k] for k in ((n, fjobs._key(n, c, cc)) for n, c, cc in jobs)}
    if not os.environ.get("FLASHNB_GUARD_RECORD"):
        warnings.warn(f"{RECORD.name} does not match this source and toolchain: every case compiled (minutes); "
                      "refresh it with FLASHNB_GUARD_RECORD=1 python -m pytest tests/instruments/test_ptx_guard.py",
                      stacklevel=1)
    out = {(n, fjobs._key(n, c, cc)): r for (n, c, cc), r in zip(jobs, fi.resources_many(jobs))}
    if os.environ.get("FLASHNB_GUARD_RECORD"):
        results = [dict(name=n, config=c, cc=list(cc), resources=dict(out[(n, fjobs._key(n, c, cc))].to_json(),
                                                                      ptx=None, ptxas_log=""))
                   for n, c, cc in jobs]
        RECORD.write_text(json.dumps({"key": _record_key(), "results": results}, indent=0, sort_keys=True) + "\n")
    return out


def test_ptxas_available():
    assert fi.find_ptxas(), "ptxas not found: install numba-cuda[cu12] (nvidia-cuda-nvcc-cu12 ships ptxas)"


@pytest.mark.parametrize("job", JOBS, ids=lambda j: f"{_id(j[:2])}-sm_{j[2][0]}{j[2][1]}")
def test_kernel_passes_guard(compiled, job):
    name, config, cc = job
    res = compiled[(name, fjobs._key(name, config, cc))]
    assert res.error is None, res.error
    assert res.f64_count == 0, f"{name} {config}: {res.f64_count} .f64 PTX lines (Python float literal?)"
    assert res.shared_bytes <= 48 * 1024, f"{name} {config}: {res.shared_bytes} B static shared > 48 KiB"
    # dynamic shared memory (what the launcher asks for, per the registry) within the opt-in limit of sm_80 and
    # sm_90 (on sm_75, 64 KiB, the launcher reads the device's limit and falls back to static tiles)
    assert res.dynamic_shared_bytes == KERNELS[name].dynamic_shared_for(config)
    if cc in fi.OPTIN_CHECKED_CCS:
        assert res.shared_bytes + res.dynamic_shared_bytes <= fi.MAX_OPTIN_SHARED[cc], \
            f"{name} {config}: {res.shared_bytes} + {res.dynamic_shared_bytes} B shared > sm_{cc[0]}{cc[1]}'s opt-in"
    assert res.registers is not None, "ptxas gave no register count"
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0, \
        f"{name} {config}: spills {res.spill_store_bytes} B stored / {res.spill_load_bytes} B loaded"
    assert fi.problems(res) == []


# The simulator's self-test kernels are never launched on a GPU, but they are CUDA all the same (a self-test
# written in Python a GPU would reject would prove nothing about the patch): same guard, by signature.
SELF_TEST_KERNELS = {"_barrier_kernel": "void(float32[:, ::1], int32[:, :, ::1], float32[:, :, ::1])",
                     "_warp_kernel": "void(float32[::1], int64[::1])"}


@pytest.fixture(scope="module")
def module_level():
    """The simulator's self-test kernels (both ccs) and the deliberately wrong kernels below, compiled in
    one batch: {(kernel name, cc): Resources}."""
    from flashnb.sim import selftest

    items = [(getattr(selftest, name), sig, cc) for name, sig in sorted(SELF_TEST_KERNELS.items()) for cc in CCS]
    items += [(_bad_float64, "void(float32[::1])", (9, 0)), (_bad_shared, "void(float32[::1])", (8, 0)),
              (_good, "void(float32[::1])", (9, 0))]
    return {(k.py_func.__name__, cc): r for (k, _, cc), r in zip(items, fi.resources_of(items))}


@pytest.mark.parametrize("cc", CCS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("name", sorted(SELF_TEST_KERNELS))
def test_simulator_self_test_kernels_pass_guard(module_level, name, cc):
    res = module_level[(name, cc)]
    assert res.error is None and res.registers is not None, res.error
    assert not fi.problems(res), fi.problems(res)


# --------------------------------------------------------------------------- one NVVM pass for both ccs

# The kernels with the most going on (warp shuffles, atomics, causal and sparse branches, d = 128).
REUSE_SAMPLE = [("fa2.forward", KERNELS["fa2.forward"].configs[-1]),
                ("fa2.backward", KERNELS["fa2.backward"].configs[-1])]


@pytest.mark.slow   # ~20 s of extra NVVM passes; the guard itself (every kernel, every cc) runs in CI
def test_one_nvvm_pass_serves_every_architecture(compiled):
    """The guard's sm_80 and sm_90 results come from the sm_75 PTX retargeted; a separate NVVM pass per cc
    must give the same PTX (up to .target and symbol names) and the same ptxas report, or the reuse is wrong."""
    jobs = [(name, config, cc) for name, config in REUSE_SAMPLE for cc in CCS]
    direct = {fjobs._key(*job): r for job, r in zip(jobs, fi.resources_many(jobs, keep_ptx=True, reuse_ptx=False))}
    for name, config in REUSE_SAMPLE:
        ptx = {cc: direct[fjobs._key(name, config, cc)].ptx for cc in CCS}
        for cc in CCS:
            assert f".target sm_{cc[0]}{cc[1]}" in ptx[cc]
            assert fi.normalized_ptx(ptx[cc]) == fi.normalized_ptx(ptx[CCS[0]]), \
                f"{name} {config}: NVVM's PTX for sm_{cc[0]}{cc[1]} differs from sm_{CCS[0][0]}{CCS[0][1]}'s"
            assert fi.retarget_ptx(ptx[CCS[0]], cc).count(f".target sm_{cc[0]}{cc[1]}") == 1
            reused, own = compiled[(name, fjobs._key(name, config, cc))], direct[fjobs._key(name, config, cc)]
            assert (reused.registers, reused.shared_bytes, reused.stack_bytes, reused.spill_bytes,
                    reused.f64_count) == (own.registers, own.shared_bytes, own.stack_bytes, own.spill_bytes,
                                          own.f64_count)


# --------------------------------------------------------------------------- completeness


def _is_cuda_jit(dec) -> tuple[bool, bool]:
    """(is a cuda.jit decorator, is device=True)."""
    call = dec if isinstance(dec, ast.Call) else None
    target = call.func if call else dec
    is_jit = (isinstance(target, ast.Attribute) and target.attr == "jit"
              and isinstance(target.value, ast.Name) and target.value.id == "cuda")
    device = bool(call) and any(
        kw.arg == "device" and isinstance(kw.value, ast.Constant) and kw.value.value is True
        for kw in call.keywords)
    return is_jit, device


def _kernels_in_source() -> set[tuple[str, str]]:
    """(module, qualname) of every function decorated with ``@cuda.jit`` (not device=True) in flashnb/."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = "flashnb." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        module = module.removesuffix(".__init__")

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual = prefix + child.name
                    for dec in child.decorator_list:
                        is_jit, device = _is_cuda_jit(dec)
                        if is_jit and not device:
                            found.add((module, qual))
                    visit(child, qual + ".<locals>.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")
                else:
                    visit(child, prefix)

        visit(ast.parse(path.read_text(), str(path)), "")
    return found


def _kernels_in_registry() -> set[tuple[str, str]]:
    made = set()
    for spec in KERNELS.values():
        for config in spec.configs:
            f = spec.factory(**config).py_func
            made.add((f.__module__, f.__qualname__))
    return made


def test_scan_finds_kernels():
    assert ("flashnb.stages.naive", "make_matmul.<locals>.matmul") in _kernels_in_source()


def test_every_kernel_is_registered():
    in_source = _kernels_in_source()
    # the simulator's self-test kernels are guarded by signature above instead: exactly those, no others
    sim_only = {(m, q) for m, q in in_source if m.startswith(SIMULATOR_ONLY)}
    assert sim_only == {("flashnb.sim.selftest", n) for n in SELF_TEST_KERNELS}
    exercise_kernels = {(m, q) for m, q in in_source if m.startswith(EXERCISES)}
    missing = in_source - sim_only - exercise_kernels - _kernels_in_registry()
    assert not missing, ("@cuda.jit kernels not produced by any registered factory config (register them "
                         f"with @kernel_factory so the PTX guard compiles them): {sorted(missing)}")


#: CPython 3.11+ compiles a call of more than this many arguments to one tuple (CALL_FUNCTION_EX), which numba's
#: CUDA target cannot compile; the simulator runs it as Python, so only the GPU compile would find it
MAX_CALL_ARGS = 30


def _long_calls(tree) -> list[tuple[str, int, int]]:
    """``(function, line, arguments)`` of every call with more than :data:`MAX_CALL_ARGS` arguments inside a
    ``@cuda.jit`` function (kernel or device function) of ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                _is_cuda_jit(dec)[0] for dec in node.decorator_list):
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and len(call.args) + len(call.keywords) > MAX_CALL_ARGS:
                    found.append((node.name, call.lineno, len(call.args) + len(call.keywords)))
    return found


def test_no_device_call_has_more_arguments_than_numba_compiles():
    """Every call inside a kernel or device function of flashnb passes at most 30 arguments (bundle state into
    fewer, or recompute what can be recomputed)."""
    long = {str(path.relative_to(PACKAGE)): calls for path in sorted(PACKAGE.rglob("*.py"))
            if (calls := _long_calls(ast.parse(path.read_text(), str(path))))}
    assert not long, f"calls over {MAX_CALL_ARGS} arguments in device code (numba cannot compile them): {long}"


def test_the_long_call_check_can_fail():
    args = ", ".join(f"a{i}" for i in range(31))
    source = f"@cuda.jit(device=True)\ndef f({args}):\n    return g({args})\n"
    assert _long_calls(ast.parse(source)) == [("f", 3, 31)]
    assert _long_calls(ast.parse(source.replace("@cuda.jit(device=True)\n", ""))) == []   # host code: fine


# --------------------------------------------------------------------------- the guard can fail


@cuda.jit
def _bad_float64(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] = x[i] * 0.1            # Python float literal: float64 multiply, then a cast back


@cuda.jit
def _bad_shared(x):
    big = cuda.shared.array((128, 128), float32)   # 64 KiB > 48 KiB static limit
    i = cuda.grid(1)
    big[i % 128, i // 128 % 128] = x[i]
    cuda.syncthreads()
    x[i] = big[(i + 1) % 128, i // 128 % 128]


@cuda.jit
def _good(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] = x[i] * float32(0.5)


def test_guard_flags_float64_literal(module_level):
    res = module_level[("_bad_float64", (9, 0))]
    assert res.f64_count > 0 and ".f64" in res.ptx
    assert any("float64" in p for p in fi.problems(res))


def test_guard_flags_oversized_shared_memory(module_level):
    res = module_level[("_bad_shared", (8, 0))]
    assert res.shared_bytes == 128 * 128 * 4
    found = fi.problems(res)
    assert any("shared memory" in p for p in found), found


def test_guard_passes_clean_kernel(module_level):
    res = module_level[("_good", (9, 0))]
    assert fi.problems(res) == [], fi.problems(res)
    assert res.f64_count == 0 and res.registers and res.spill_bytes == 0


def test_a_kernel_is_compiled_only_for_the_architectures_it_declares():
    # the tensor-core kernels declare theirs: m16n8k16 and cp.async need sm_80, m16n8k8.f16 and ldmatrix sm_75
    spec = KERNELS["mma_check.mma"]
    assert spec.archs_for(spec.configs[0]) == ((8, 0), (9, 0))
    assert KERNELS["mma_check.ldmatrix"].archs_for({"num": 4, "trans": False}) == ((7, 5), (8, 0), (9, 0))
    assert all(KERNELS[n].supports(c, (7, 5)) for n, c in CASES if KERNELS[n].archs is None)
    with pytest.raises(ValueError, match=r"'mma_check.mma' .* compiles for sm_80, sm_90 only, not for sm_75: it uses "
                                         "instructions that architecture does not have"):
        fi.resources_for("mma_check.mma", spec.configs[0], (7, 5))


def test_retarget_ptx():
    ptx = "//\n.version 8.8\n.target sm_80\n.address_size 64\n"
    assert fi.retarget_ptx(ptx, (9, 0)) == ptx.replace("sm_80", "sm_90")
    with pytest.raises(ValueError, match="target"):
        fi.retarget_ptx(".version 8.8\n", (9, 0))


# --------------------------------------------------------------------------- the recorded results


def test_record_key_changes_with_any_kernel_source_edit(tmp_path):
    """The record's key is the digest of every flashnb source file kernels can depend on: a copy digests the
    same, a one-character edit of one kernel file (a changed kernel) gives another key, so the old record is not
    used; an edit of a host-only file (the simulator) keeps the key."""
    import shutil

    copy = tmp_path / "flashnb"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert fi.package_digest(copy) == fi.package_digest()
    sim_file = copy / "sim" / "vector" / "arrays.py"
    sim_file.write_text(sim_file.read_text() + " ")
    assert fi.package_digest(copy) == fi.package_digest()
    fa2 = copy / "stages" / "fa2.py"
    fa2.write_text(fa2.read_text() + " ")
    assert fi.package_digest(copy) != fi.package_digest()


def test_host_only_modules_hold_no_device_code():
    """What the key leaves out (:data:`flashnb.instruments.HOST_ONLY`) defines no ``cuda.jit`` function (kernel or
    device), no numba intrinsic and no registered kernel factory: its source cannot change any kernel's PTX.
    (The simulator's self-test kernels are not in the record: ``module_level`` compiles them at every run.)"""
    factories = {spec.factory.__module__ for spec in KERNELS.values() if getattr(spec, "factory", None)}
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not ptx_cache._host_only(rel) or rel == "sim/selftest.py":   # its kernels: compiled at every run, above
            continue
        checked += 1
        module = "flashnb." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        assert module.removesuffix(".__init__") not in factories, f"{rel} registers a kernel factory"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    assert not _is_cuda_jit(dec)[0], f"{rel}: {node.name} is a cuda.jit function"
                    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                    assert name != "intrinsic", f"{rel}: {node.name} is a numba intrinsic"
    assert checked > 30          # the simulator, the course kit, torch, distributed and the host tools


def test_record_key_names_the_toolchain():
    tool = fi.toolchain_versions()
    for dist in ("numba==", "numba-cuda==", "llvmlite==", "nvidia-cuda-nvcc-cu12==", "cuda-toolkit=="):
        assert dist in tool
    assert "==none" not in tool.split(";", 3)[1], tool   # numba itself must be found


def test_record_matches_its_cases():
    """When the record is in use it holds exactly the current cases (no stale or missing entries), and the spot
    check compares every field the guard asserts on."""
    import json

    if not RECORD.exists():
        pytest.skip("no record yet")
    data = json.loads(RECORD.read_text())
    if data["key"] != _record_key():
        pytest.skip("the record is stale (another source or toolchain): the guard compiled every case")
    recorded = {(e["name"], fjobs._key(e["name"], e["config"], tuple(e["cc"]))) for e in data["results"]}
    assert recorded == {(n, fjobs._key(n, c, cc)) for n, c, cc in JOBS}
    a = fi.Resources.from_json(data["results"][0]["resources"])
    b = fi.Resources.from_json(dict(a.to_json(), registers=(a.registers or 0) + 1))
    assert _same_report(a, a) and not _same_report(a, b)
