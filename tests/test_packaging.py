"""pyproject.toml (pip) and environment.yml (conda) must list the same runtime packages and pins; the
package's modules import each other without cycles."""

import ast
import copy
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # a dependency of pytest itself
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")
yaml = pytest.importorskip("yaml")  # PyYAML: comes with jupytext (test and notebooks extras)

ROOT = Path(__file__).resolve().parents[1]

# pip distribution -> conda-forge package(s) providing the same thing.
PIP_TO_CONDA = {
    "numba": ("numba",),
    "numba-cuda": ("numba-cuda",),       # conda-forge's numba-cuda depends on cuda-bindings itself
    "cuda-toolkit": ("cuda-version",),   # the metapackage's version pin becomes cuda-version=MAJOR.MINOR
    "numpy": ("numpy",),
    "matplotlib": ("matplotlib",),
    "tqdm": ("tqdm",),
    "nvidia-cuda-nvdisasm": ("cuda-nvdisasm",),   # flashnb.instruments.sass; conda-forge's follows cuda-version
}
# (pip distribution, extra) -> conda-forge package(s) that the extra pulls in.
EXTRA_TO_CONDA = {
    ("numba-cuda", "cu12"): ("libnvjitlink",),
    ("cuda-toolkit", "cccl"): ("cuda-cccl",),
    ("cuda-toolkit", "cudart"): ("cuda-cudart",),
    ("cuda-toolkit", "nvcc"): ("cuda-nvcc-impl",),   # NVVM + ptxas
    ("cuda-toolkit", "nvrtc"): ("cuda-nvrtc",),
}
EXACT_PINS = ("numba", "numba-cuda")  # pinned with == in pyproject, = (or ==) in environment.yml


def _load():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    return pyproject, env


def _runtime(pyproject):
    """{canonical pip name: Requirement} of [project] dependencies."""
    reqs = [Requirement(s) for s in pyproject["project"]["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def _conda_specs(env):
    """{conda name: version spec string ('' if none)} of environment.yml's conda dependencies."""
    specs = {}
    for entry in env["dependencies"]:
        if isinstance(entry, dict):  # the `pip:` sub-list may only install flashnb itself
            assert set(entry) == {"pip"}, f"unexpected environment.yml entry {entry}"
            for line in entry["pip"]:
                assert line.startswith(("-e", ".")), f"pip entry {line!r}: runtime packages belong in the conda list"
            continue
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*?)\s*", entry)
        assert m, f"cannot parse environment.yml dependency {entry!r}"
        name, spec = m.group(1).lower(), m.group(2)
        if spec[:1].isdigit():  # conda's "name 1.2" form
            spec = "=" + spec
        specs[name] = spec
    return specs


def _exact(spec):
    """The version of an exact pin ('==1.2' for pip; '=1.2' or '==1.2' for conda), else None."""
    m = re.fullmatch(r"==?\s*([0-9][0-9A-Za-z.+]*)", spec.strip())
    return m.group(1) if m else None


def _mismatches(pyproject, env):
    """Every way the two files disagree, as readable messages (empty list when they agree)."""
    problems = []
    runtime = _runtime(pyproject)
    conda = _conda_specs(env)
    expected = set()
    for name, req in runtime.items():
        if name not in PIP_TO_CONDA:
            problems.append(f"pyproject runtime package {name!r} has no conda name: add it to PIP_TO_CONDA in "
                            "tests/test_packaging.py and to environment.yml")
            continue
        expected.update(PIP_TO_CONDA[name])
        for extra in sorted(req.extras):
            if (name, extra) not in EXTRA_TO_CONDA:
                problems.append(f"pyproject {name}[{extra}] has no conda equivalent in EXTRA_TO_CONDA")
            else:
                expected.update(EXTRA_TO_CONDA[(name, extra)])
    # conda-only entries: the interpreter, pip, and the optional [notebooks] extra
    notebooks = {canonicalize_name(Requirement(s).name)
                 for s in pyproject["project"].get("optional-dependencies", {}).get("notebooks", [])}
    actual = set(conda) - {"python", "pip"} - notebooks
    if expected - actual:
        problems.append(f"environment.yml lacks {sorted(expected - actual)} (runtime dependencies in pyproject.toml)")
    if actual - expected:
        problems.append(f"environment.yml has {sorted(actual - expected)}, which pyproject.toml's runtime "
                        "dependencies do not list (or PIP_TO_CONDA does not map)")
    for name in EXACT_PINS:
        if name in runtime and name in conda:
            pip_pin, conda_pin = _exact(str(runtime[name].specifier)), _exact(conda[name])
            if pip_pin is None or pip_pin != conda_pin:
                problems.append(f"{name}: pyproject pins {str(runtime[name].specifier)!r}, "
                                f"environment.yml {conda[name]!r}; both must pin the same exact version")
    for name in (set(runtime) & set(conda)) - set(EXACT_PINS):   # e.g. numpy>=1.24 on both sides
        if conda[name] and conda[name].replace(" ", "") != str(runtime[name].specifier):
            problems.append(f"{name}: pyproject says {str(runtime[name].specifier)!r}, environment.yml {conda[name]!r}")
    if "cuda-toolkit" in runtime:
        pin = _exact(str(runtime["cuda-toolkit"].specifier)) or ""
        major_minor = ".".join(pin.split(".")[:2])
        if _exact(conda.get("cuda-version", "")) != major_minor:
            problems.append(f"cuda-toolkit=={pin} needs cuda-version={major_minor} in environment.yml, "
                            f"got {conda.get('cuda-version')!r}")
    python = pyproject["project"].get("requires-python", "")
    if conda.get("python", "").replace(" ", "") != python.replace(" ", ""):
        problems.append(f"python: requires-python {python!r} but environment.yml has {conda.get('python')!r}")
    return problems


def test_environment_yml_mirrors_pyproject():
    pyproject, env = _load()
    assert _mismatches(pyproject, env) == []


def test_environment_yml_is_conda_forge_only_and_never_cudatoolkit():
    _, env = _load()
    assert env["channels"] == ["conda-forge"]
    assert "cudatoolkit" not in _conda_specs(env)


def test_numba_cuda_pinned_exactly_with_cu12_extra():
    pyproject, _ = _load()
    req = _runtime(pyproject)["numba-cuda"]
    assert req.extras == {"cu12"}, f"numba-cuda must use the [cu12] extra, got {req}"
    assert [s.operator for s in req.specifier] == ["=="], f"numba-cuda must be pinned with ==, got {req}"
    cuda = _runtime(pyproject)["cuda-toolkit"]
    assert [s.operator for s in cuda.specifier] == ["=="] and _exact(str(cuda.specifier)).startswith("12.9."), cuda


@pytest.mark.parametrize("edit", ["pip_only", "conda_only", "pin_drift", "new_extra", "bound_drift"])
def test_a_one_sided_change_is_caught(edit):
    """The checker itself: editing only one file must produce a mismatch."""
    pyproject, env = _load()
    pyproject, env = copy.deepcopy(pyproject), copy.deepcopy(env)
    deps, conda = pyproject["project"]["dependencies"], env["dependencies"]
    if edit == "pip_only":
        deps.append("scipy>=1.10")
    elif edit == "conda_only":
        conda.append("scipy>=1.10")
    elif edit == "pin_drift":
        conda[:] = ["numba-cuda=0.30.5" if str(c).startswith("numba-cuda") else c for c in conda]
    elif edit == "new_extra":
        deps[:] = [d.replace("cuda-toolkit[cccl,", "cuda-toolkit[cublas,cccl,") for d in deps]
    elif edit == "bound_drift":
        conda[:] = ["numpy>=2.0" if str(c).startswith("numpy") else c for c in conda]
    assert (pyproject, env) != _load(), f"{edit}: the edit changed nothing"
    assert _mismatches(pyproject, env), f"{edit}: mismatch not detected"


# --------------------------------------------------------------------------- import graph
# (the scan of every import, the layers and the cycle test: tests/test_layering.py)

PACKAGE = ROOT / "flashnb"


def import_graph() -> dict[str, set[str]]:
    """module -> the flashnb modules it imports (every import statement, function-level ones too)."""
    from test_layering import import_edges

    return {m: set(targets) for m, targets in import_edges().items()}


def test_markers_come_from_the_folder_and_the_stage_docstring(tmp_path):
    """`pytest -m stage4` selects stage 4's tests because tests/stages/test_fa2*.py test flashnb/stages/fa2*.py,
    whose docstrings begin "Stage 4"; no hand-kept map of test files to stages."""
    from conftest import TESTS, markers_of

    declared = {"flex", "decode", "distributed"}
    assert markers_of(TESTS / "stages" / "test_fa2.py", declared) == ["stage4"]
    assert markers_of(TESTS / "stages" / "test_fa2_fast_steps.py", declared) == ["stage6"]
    assert markers_of(TESTS / "stages" / "test_block_sparse.py", declared) == ["stage5"]
    assert markers_of(TESTS / "kernels" / "test_flash_tc.py", declared) == ["stage7"]
    assert markers_of(TESTS / "kernels" / "test_decode.py", declared) == ["product", "decode"]
    assert markers_of(TESTS / "kernels" / "test_half.py", declared) == ["product"]
    assert markers_of(TESTS / "test_flex.py", declared) == ["stage0", "flex"]
    assert markers_of(TESTS / "course" / "test_course_a3.py", declared) == ["course"]
    with pytest.raises(pytest.UsageError, match="Stage N"):
        markers_of(TESTS / "stages" / "test_not_a_stage.py", declared)
    with pytest.raises(pytest.UsageError, match="one of its folders"):
        markers_of(TESTS / "elsewhere" / "test_x.py", declared)


def test_kernels_never_import_a_user_surface():
    """The lessons (flashnb.stages), the product kernels (flashnb.kernels) and what they stand on (common, registry,
    rng, masks, modifiers) import no user surface -- api, flex, flex_grad, torch, distributed, course, exercises,
    cli -- not even inside a function: the surfaces sit above the kernels and resolve what a kernel needs before
    they call it (a block mask's finer tiles, a score_mod's derivative); no lower module holds a hook set from
    above."""
    graph = import_graph()
    surfaces = ("flashnb.api", "flashnb.flex", "flashnb.flex_grad", "flashnb.pytorch", "flashnb.distributed",
                "flashnb.course", "flashnb.exercises", "flashnb.cli")
    below = [m for m in graph if m.startswith(("flashnb.stages", "flashnb.kernels")) or m in (
        "flashnb.common", "flashnb.registry", "flashnb.rng", "flashnb.masks")]
    assert len(below) > 15, below                  # the scan found the kernel modules
    upward = {m: sorted(t for t in graph[m] if t.startswith(surfaces)) for m in below}
    assert {m: t for m, t in upward.items() if t} == {}


# A lesson's kernel factory fits on about one screen: its code, comments and docstring at most LESSON_LINES
# lines. The region markers (the comment pairs through which the course and the exercises address the kernel,
# see flashnb/regions.py) are counted apart, with a small allowance of their own.
LESSON_LINES = 120
MARKER_ALLOWANCE = 5


def test_every_stage_kernel_factory_fits_one_screen():
    import inspect

    import flashnb  # noqa: F401  (registers every kernel factory)
    from flashnb import regions, registry

    measured = {}
    for spec in registry.KERNELS.values():
        factory = inspect.unwrap(spec.factory)
        if not factory.__module__.startswith("flashnb.stages."):
            continue
        lines = inspect.getsource(factory).splitlines()
        body = lines[next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ")):]
        markers = sum(1 for ln in body if regions.MARKER.match(ln))
        measured[f"{factory.__module__}.{factory.__name__}"] = (len(body) - markers, len(body))
    assert len(measured) >= 20, sorted(measured)     # the scan found the stages' factories
    too_long = {name: n for name, n in measured.items()
                if n[0] > LESSON_LINES or n[1] > LESSON_LINES + MARKER_ALLOWANCE}
    assert not too_long, f"(lines without region markers, with them) over {LESSON_LINES}: {too_long}"


# Sizes of the kernel code, lessons and product alike: a function of flashnb/stages/ or flashnb/kernels/ (a kernel
# factory, a device function, a launcher) fits in FUNCTION_LINES lines from its `def` to its last line; a module of
# flashnb/kernels/ in KERNEL_MODULE_LINES, one of flashnb/stages/ in STAGE_MODULE_LINES.  What is over them today
# is named below, so that the test fails on anything new: the tensor-core product kernel, not yet split into its
# phases and policies.  Empty these sets once it is.
FUNCTION_LINES = 150
KERNEL_MODULE_LINES = 700
STAGE_MODULE_LINES = 800
EXPECTED_LONG_FUNCTIONS: set = set()
EXPECTED_LONG_MODULES: set = set()


def _sizes():
    """``({"folder/module.py::function": lines}, {"folder/module.py": lines})`` of flashnb/stages and flashnb/kernels
    (every function, nested ones included; a function's lines from its ``def`` to its last line)."""
    functions, modules = {}, {}
    for folder in ("stages", "kernels"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            rel = path.relative_to(PACKAGE).as_posix()
            text = path.read_text()
            modules[rel] = len(text.splitlines())
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"{rel}::{node.name}"
                    functions[key] = max(functions.get(key, 0), node.end_lineno - node.lineno + 1)
    return functions, modules


def test_no_kernel_or_stage_function_over_150_lines():
    functions, _ = _sizes()
    assert any(k.startswith("kernels/") for k in functions) and any(k.startswith("stages/") for k in functions)
    long = {k: n for k, n in functions.items() if n > FUNCTION_LINES}
    assert not {k: n for k, n in long.items() if k not in EXPECTED_LONG_FUNCTIONS}, (
        f"functions over {FUNCTION_LINES} lines: split them (a lesson into factories of one idea each, a product "
        f"kernel into its phases and policies)")
    assert not EXPECTED_LONG_FUNCTIONS - set(long), (
        f"{sorted(EXPECTED_LONG_FUNCTIONS - set(long))} are no longer over {FUNCTION_LINES} lines (or gone): remove "
        "them from EXPECTED_LONG_FUNCTIONS")


def test_no_kernel_module_over_700_lines_nor_stage_module_over_800():
    _, modules = _sizes()
    limit = {"kernels": KERNEL_MODULE_LINES, "stages": STAGE_MODULE_LINES}
    long = {m: n for m, n in modules.items() if n > limit[m.split("/")[0]]}
    assert not {m: n for m, n in long.items() if m not in EXPECTED_LONG_MODULES}, (
        f"modules over {KERNEL_MODULE_LINES} lines (kernels/) or {STAGE_MODULE_LINES} (stages/): split them by "
        "feature or by phase")
    assert not EXPECTED_LONG_MODULES - set(long), (
        f"{sorted(EXPECTED_LONG_MODULES - set(long))} are no longer over the limit (or gone): remove them from "
        "EXPECTED_LONG_MODULES")
