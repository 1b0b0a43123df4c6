"""Shared test helpers. Importing flashnb first selects the simulator (no GPU in CI)."""

import importlib.util
import zlib
from pathlib import Path

import numpy as np
import pytest

import flashnb  # noqa: F401  (must be imported before numba.cuda)
from flashnb.kernels import flash
from flashnb.stages import fa2

# The impls that carry every feature (half storage, block masks, modifiers, dropout, GQA), each module with its
# launchers and models under the same names: the feature tests run on both (`pytest -m product` selects the product
# kernel's cases in every file).  CI runs them on the product kernel, the default impl; stage 4's (whose features
# the product kernel takes over) are `slow`, so that running each feature test twice costs CI no time.
FEATURE_IMPLS = [pytest.param("fa2", marks=pytest.mark.slow), pytest.param("flash", marks=pytest.mark.product)]
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


# Stage markers, so a course (or a learner) can run one stage's tests: `pytest -m stage3`.
STAGE_OF_MODULE = {
    "test_runtime": "stage0", "test_api": "stage0", "test_reference": "stage0", "test_packaging": "stage0",
    "test_traffic": "stage0", "test_sim_fastbarrier": "stage0", "test_sim_warp": "stage0",
    "test_sim_warp_ptx": "stage0", "test_inspect": "stage0", "test_roofline": "stage0", "test_bench": "stage0",
    "test_ptx_guard": "stage0", "test_cli": "stage0", "test_notebooks": "stage0", "test_readme": "stage0",
    "test_rehearsal": "stage0", "test_sim_racecheck": "stage0", "test_sim_sanitizer": "stage0",
    "test_sim_memprofile": "stage0", "test_inspect_user_kernels": "stage0", "test_course": "stage0",
    "test_sim_vector": "stage0", "test_sim_vector_ops": "stage0", "test_sim_vector_fallback": "stage0",
    "test_course_a1": "stage2", "test_course_a2": "stage3", "test_course_a3": "stage4", "test_course_a4": "stage4",
    "test_course_a5": "stage5", "test_course_hostile": "stage0",
    "test_gpu_path_bugs": "stage0", "test_sass": "stage0",
    "test_traffic_tools": "stage0", "test_api_checks": "stage0", "test_cli_args": "stage0",
    "test_exercises": "stage0", "test_registry_variant": "stage0",
    "test_causal_alignment": "stage0", "test_torch": "stage0", "test_torch_ops": "stage0",
    "test_naive": "stage1", "test_softmax": "stage2", "test_fa1": "stage3", "test_fa2": "stage4",
    "test_fa2_steps": "stage4", "test_dropout": "stage4", "test_half": "stage4",
    "test_block_sparse": "stage5", "test_flex": "flex", "test_flex_grad": "flex", "test_decode": "decode",
    "test_fa2_fast": "stage6", "test_sass_model": "stage6", "test_fa2_fast_steps": "stage6",
    "test_flash": "product", "test_flash_parity": "product",
    "test_distributed": "distributed", "test_tensorcore": "stage7", "test_fa2_tc": "stage7",
}


# Notebooks that need the optional PyTorch extra: skipped (not failed) where torch is not installed.
NEEDS_TORCH = {"09_transformer_on_flashnb.ipynb", "13_context_parallelism.ipynb"}


# Files that run first (pytest -n 2 --dist loadfile hands whole files to the two workers in collection order): the
# longest ones, so that the run does not end with one worker busy on a long file while the other idles, and
# the PTX guard before the tests and notebooks that compile the same kernels (they then find NVVM's PTX in
# the disk cache, flashnb.instruments.ptx_cache_dir).  The order of the rest is unchanged.
RUN_FIRST = ("test_ptx_guard.py", "08_readable_to_fast.ipynb", "test_fa2_fast.py", "09_transformer_on_flashnb.ipynb",
             "test_fa2.py", "05_flashattention2_forward.ipynb", "test_naive.py", "10_attention_modifiers.ipynb",
             "test_exercises.py", "00_memory_hierarchy_and_measurement.ipynb", "test_flex.py", "test_readme.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))   # stable: the rest keep order
    no_torch = importlib.util.find_spec("torch") is None
    for item in items:
        if no_torch and Path(str(item.fspath)).name in NEEDS_TORCH:
            item.add_marker(pytest.mark.skip(reason='needs PyTorch: pip install "flashnb[torch]"'))
        module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
        if module.startswith("test_") and module not in STAGE_OF_MODULE:
            raise pytest.UsageError(f"{module}.py has no stage: add it to STAGE_OF_MODULE in tests/conftest.py")
        if module in STAGE_OF_MODULE:
            item.add_marker(getattr(pytest.mark, STAGE_OF_MODULE[module]))
