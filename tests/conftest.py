"""Shared test helpers. Importing flashnb first selects the simulator (no GPU in CI)."""

import zlib

import numpy as np
import pytest

import flashnb  # noqa: F401  (must be imported before numba.cuda)


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
