"""Shared test helpers. Importing flashnb first selects the simulator (no GPU in CI)."""

import os

# `pytest -n 2` runs two workers on two cores. PyTorch and OpenMP start one thread per core in each of them by
# default, which oversubscribes the machine: their spinning threads made the tiny tensors of the notebooks' and
# tests' training loops about three times slower. One thread per worker, set before anything imports torch; the
# notebooks' kernels (`--nbmake`, in the same run) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The notebooks the run executes save their figures into a temporary folder, not the committed figures/.
if not os.environ.get("FLASHNB_FIGURES_DIR"):
    import tempfile

    os.environ["FLASHNB_FIGURES_DIR"] = tempfile.mkdtemp(prefix="flashnb-figures-")

import importlib.util  # noqa: E402
import zlib
from pathlib import Path

import numpy as np
import pytest

import flashnb  # noqa: F401  (must be imported before numba.cuda)
from flashnb.kernels import flash
from flashnb.stages import fa2

# The impl that carries every feature (half storage, block masks with partial tiles, modifiers, dropout, GQA): the
# product kernel.  Block masks of two states (skip or compute) are also stage 5's lesson, on stage 4's kernels: the
# block-sparse tests run on both, each module with its launchers and models under the same names (`pytest -m
# product` selects the product kernel's cases); stage 4's are `slow` (the "fa2-sparse" impl covers stage 5 in CI).
FEATURE_IMPLS = [pytest.param("flash", marks=pytest.mark.product)]
BLOCK_MASK_IMPLS = [pytest.param("fa2", marks=pytest.mark.slow), pytest.param("flash", marks=pytest.mark.product)]
MODULE_OF = {"fa2": fa2, "flash": flash}


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: reproducible, and different for every test."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def qkv(rng, shape_q, Nk, *, do=False):
    """Random standard-normal q (shape_q) and k, v with Nk keys (never zeros)."""
    *lead, Nq, d = shape_q
    q = rng.standard_normal(shape_q)
    k = rng.standard_normal((*lead, Nk, d))
    v = rng.standard_normal((*lead, Nk, d))
    if do:
        return q, k, v, rng.standard_normal(shape_q)
    return q, k, v


def assert_close(actual, expected, *, atol, rtol, what):
    """Every element written (no NaN poison left) and within atol + rtol·|expected|."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    finite = np.isfinite(expected)
    assert not np.isnan(actual).any(), f"{what}: NaN in output (an element was never written?)"
    assert np.array_equal(np.isfinite(actual), finite), f"{what}: infinities differ from the reference"
    assert np.array_equal(actual[~finite], expected[~finite]), f"{what}: non-finite values differ"
    err = np.abs(actual[finite] - expected[finite])
    bound = atol + rtol * np.abs(expected[finite])
    worst = np.argmax(err - bound) if err.size else 0
    assert np.all(err <= bound), (
        f"{what}: max abs error {err.max():.3e} "
        f"(worst element err {err.flat[worst]:.3e} > bound {bound.flat[worst]:.3e})"
    )


# Markers from where a test lives, so a course (or a learner) can run one stage's tests: `pytest -m stage3`.  The
# folders mirror the package: tests/stages/test_fa2*.py test flashnb.stages.fa2*, whose docstring says "Stage 4";
# tests/kernels/ test the product kernel (or, where the module under test says "Stage 7", the tensor cores); the
# simulator, the instruments and the top-level modules are the toolkit of stage 0.  A test of a module whose
# name is a declared marker (flex, decode, distributed) gets that marker too.
TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "flashnb"
FOLDER_MARKER = {"": "stage0", "stages": "stage0", "sim": "stage0", "instruments": "stage0", "exercises": "stage0",
                 "pytorch": "stage0", "course": "course", "kernels": "product", "distributed": "distributed"}


def _module_under_test(folder: str, stem: str) -> Path | None:
    """The package module a test file tests: the longest ``flashnb/<folder>/<name>.py`` whose name starts the test
    file's name after ``test_`` (``tests/stages/test_fa2_steps.py``: ``flashnb/stages/fa2_steps.py``)."""
    name = stem[len("test_"):]
    base = PACKAGE / folder if folder else PACKAGE
    names = sorted((p.stem for p in base.glob("*.py") if p.stem != "__init__"), key=len, reverse=True)
    return next((base / f"{n}.py" for n in names if name == n or name.startswith(n + "_")), None)


def _stage_of(module: Path | None) -> str | None:
    """``stageN`` when the module's docstring begins ``Stage N``."""
    if module is None:
        return None
    import re

    m = re.match(r'\s*(?:[rR]?"""|\'\'\')\s*Stage (\d+)\b', module.read_text())
    return f"stage{m.group(1)}" if m else None


def markers_of(path: Path, declared: set) -> list[str]:
    """The markers of the test file at ``path`` (see above); a UsageError for a file in no known folder."""
    rel = path.resolve().relative_to(TESTS)
    folder = rel.parts[0] if len(rel.parts) > 1 else ""
    if folder not in FOLDER_MARKER:
        raise pytest.UsageError(f"{rel}: tests live in tests/ or one of its folders "
                                f"{sorted(f for f in FOLDER_MARKER if f)}")
    module = _module_under_test(folder if folder in ("stages", "kernels", "sim", "instruments") else "", path.stem)
    stage = _stage_of(module)
    if folder == "stages" and stage is None:
        raise pytest.UsageError(f"{rel}: a stage's test is named after a module of flashnb/stages (test_<module>*.py) "
                                "whose docstring begins 'Stage N'")
    out = [stage or FOLDER_MARKER[folder]]
    if module is not None and module.stem in declared and module.stem not in out:
        out.append(module.stem)
    return out


# Notebooks that need the optional PyTorch extra: skipped (not failed) where torch is not installed.
NEEDS_TORCH = {"09_transformer_on_flashnb.ipynb", "13_context_parallelism.ipynb"}


# Files that run first (pytest -n 2 --dist loadfile hands whole files to the two workers in collection order): the
# longest ones, so that the run does not end with one worker busy on a long file while the other idles, and
# the PTX guard before the tests and notebooks that compile the same kernels (they then find NVVM's PTX in
# the disk cache, flashnb.instruments.ptx_cache_dir).  The order of the rest is unchanged.
RUN_FIRST = ("test_ptx_guard.py", "test_sim_vector.py", "08_readable_to_fast.ipynb", "test_torch_ops.py",
             "test_flash_parity.py", "test_exercises.py", "test_site.py", "03_flashattention1_forward.ipynb",
             "05_flashattention2_forward.ipynb", "test_distributed.py", "12_tensor_cores.ipynb", "test_sass.py",
             "test_fa2_fast.py", "test_course_hostile.py", "test_course.py", "06_flashattention2_backward.ipynb",
             "09_transformer_on_flashnb.ipynb", "13_context_parallelism.ipynb")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))   # stable: the rest keep order
    no_torch = importlib.util.find_spec("torch") is None
    declared = {line.split(":", 1)[0].strip() for line in config.getini("markers")}
    cache: dict = {}
    for item in items:
        if no_torch and Path(str(item.fspath)).name in NEEDS_TORCH:
            item.add_marker(pytest.mark.skip(reason='needs PyTorch: pip install "flashnb[torch]"'))
        path = Path(str(item.fspath))
        if path.suffix == ".py" and path.name.startswith("test_"):
            if path not in cache:
                cache[path] = markers_of(path, declared)
            for name in cache[path]:
                item.add_marker(getattr(pytest.mark, name))
