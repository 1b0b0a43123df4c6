"""The product kernel against stage 6 (scripts/product_parity.py writes the full table into benchmarks/): with every
policy off its hot loop keeps stage 6's FFMA share (within 1 point) and the same matmul loops in the SASS; with a
feature on the hot loop stays at least 75 % FFMA with no local memory and no spills (ptxas); on full tiles the
simulator's memory profiler sees no bank conflict and every line at its ideal sectors / wavefronts.

CI checks every policy off and every feature at once (forward and backward); each feature alone is `slow` (one more
compile each), as are d = 128 and what Philox costs (the SASS time model at N = 4096)."""

import importlib.util
import sys
from pathlib import Path

import pytest

import flashnb  # noqa: F401

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))      # as `python scripts/product_parity.py` has it: its sibling report.py
_SPEC = importlib.util.spec_from_file_location("product_parity", SCRIPTS / "product_parity.py")
parity = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(parity)

ONE_BY_ONE = [f for f in parity.FEATURES if f not in ("none", "all")]


def _check_sass(rows):
    assert len(rows) == 2 and {r["direction"] for r in rows} == {"forward", "backward"}
    for r in rows:
        what = f"{r['feature']} {r['direction']} {r['config']}"
        assert r["local"] == 0 and r["stack"] == 0 and r["spills"] == 0, what       # registers only
        if r["feature"] == "none":
            assert abs(r["hot_ffma"] - r["stage6_hot_ffma"]) <= parity.NOOP_POINTS, what
            assert r["loops"] == r["stage6_loops"] and r["only_lds128"], what        # stage 6's SASS shape
        else:
            assert r["hot_ffma"] >= parity.FFMA_TARGET, what
        assert r["ok"], what


@pytest.mark.parametrize("feature", ["none", "all"] + [pytest.param(f, marks=pytest.mark.slow) for f in ONE_BY_ONE])
def test_sass_parity(feature):
    _check_sass(parity.sass_rows(64, [feature], stage6=False))    # (stage 6's twin compiled for "none" only)


@pytest.mark.slow
def test_sass_parity_d128():
    _check_sass(parity.sass_rows(128, ["none"], stage6=False))
    _check_sass(parity.sass_rows(128, ["all"], stage6=False))


@pytest.mark.parametrize("feature", ["none", "all"] + [pytest.param(f, marks=pytest.mark.slow) for f in ONE_BY_ONE])
def test_full_tiles_conflict_free_and_ideally_coalesced(feature):
    rows = parity.profile_rows([feature])
    for r in rows:
        assert r["bank_conflicts"] == 0 and r["ok"], (r["feature"], r["direction"], r["off_ideal"])


@pytest.mark.slow
def test_philox_cost_is_reported():
    """The modelled forward with dropout is slower than without (Philox: one call per element, in its own loop)."""
    for r in parity.philox_rows((64,)):
        assert r["slowdown"] > 1 and r["per_element"] > 50 and r["elements"] == 32
